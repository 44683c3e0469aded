"""What the harness leaves for its process's end, and the end of the processes that skip the
interpreter's own.

A kernel module may leave a file for the process's lifetime (maxtext_fixed's patched copy of
MaxText's module, whose lines tracebacks show). `at_end` registers its removal: done at a
normal exit (atexit), and by `end_process`, with which a worker and a lowering process end:
it flushes their output and leaves with os._exit, skipping the interpreter's teardown (joining
threads, jax letting go of the device: on the H200's warm nightly at 32ec331, 4.7 s of the
main worker's end), which would skip atexit's hooks too."""
from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading

_HOOKS: list[tuple] = []
_LOCK = threading.Lock()


def at_end(fn, *args) -> None:
    """`fn(*args)` once when the process ends, normally or through `end_process`."""
    with _LOCK:
        _HOOKS.append((fn, args))


def run_hooks() -> None:
    """The registered hooks, last registered first, each once; one that raises stops none."""
    with _LOCK:
        hooks, _HOOKS[:] = list(_HOOKS), []
    for fn, args in reversed(hooks):
        with contextlib.suppress(Exception):
            fn(*args)


def end_process(code: int) -> None:
    """Ends this process now with `code`: the hooks run, stdout and stderr are flushed, and
    nothing else of the interpreter's teardown happens. Files the caller wrote must be closed
    and threads that write must be done (harness.engine.programs.Programs.close waits for its
    compiles)."""
    run_hooks()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):   # a reader gone (a broken pipe) ends it too
            stream.flush()
    os._exit(code)


atexit.register(run_hooks)
