"""The compile threads of a run (harness.engine.programs): a thread pool that knows which of its
tasks have not ended, so that closing can wait for the compiles under way (each writes jax's
cache when done) and no longer."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor


class CompilePool(ThreadPoolExecutor):
    """Compile threads, knowing which of their tasks have not ended (`unfinished`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._unfinished: set = set()
        self._count_lock = threading.Lock()

    def submit(self, fn, /, *args, **kwargs):
        future = super().submit(fn, *args, **kwargs)
        with self._count_lock:
            self._unfinished.add(future)
        future.add_done_callback(self._ended)
        return future

    def _ended(self, future) -> None:
        with self._count_lock:
            self._unfinished.discard(future)

    def unfinished(self) -> list:
        with self._count_lock:
            return list(self._unfinished)
