"""The harness's own small device programs (per-token metrics, the leak probe's perturbations
and comparisons, the jvp check's tangents), compiled ahead of their first call.

Each is a jitted function, `ahead(fn)`: called with a signature (argument shapes and dtypes,
static arguments) that was compiled ahead, it runs that compiled program; with one that was
not, it is plain jax.jit and compiles on the caller's thread. harness.engine.programs compiles
the signatures a case will need in compile threads of their own, beside the kernels' programs,
from the lowered programs whose outputs they take. On the H200, compiled on the run's thread,
they took 69 s of the cold nightly worker's 350 (reports/nightly-h200-c9725fe/).

A signature still queued when it is called is compiled by the caller; one compiling is waited
for. Either counts as the run's wait for it (its timing's wait_s).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable
from concurrent.futures import Future

import jax
import numpy as np

from harness.compiling import compile_lowered

QUEUED, COMPILING = "queued", "compiling"


def signature(args, static: dict, flat: tuple | None = None) -> tuple:
    """What picks a compiled program: each argument leaf's shape and dtype, the tree, the
    static arguments. `flat`: `args` already flattened (jax.tree_util.tree_flatten)."""
    leaves, tree = flat if flat is not None else jax.tree_util.tree_flatten(args)
    return (tree, tuple((tuple(np.shape(x)), np.dtype(x.dtype).name if hasattr(x, "dtype")
                         else type(x).__name__) for x in leaves),
            tuple(sorted(static.items())))


def _spread(leaves) -> bool:
    """Some argument leaf is an array sharded over several devices (a sharded kernel's
    outputs)."""
    return any(len(getattr(getattr(x, "sharding", None), "device_set", ())) > 1
               for x in leaves)


class _Entry:
    """One signature compiled ahead: compiled by a compile thread, or by its first caller if
    that comes while it is still queued."""

    def __init__(self, shapes: tuple, static: dict, timing, options: dict | None):
        self.shapes, self.static, self.timing, self.options = shapes, static, timing, options
        self.state = QUEUED
        self.compiled: Future = Future()


class Ahead:
    """A jitted function whose signatures can be compiled ahead (`compile_ahead`)."""

    def __init__(self, fn: Callable, static_argnames: tuple[str, ...] = ()):
        self.__wrapped__ = fn
        self.__name__ = getattr(fn, "__name__", "ahead")
        self.__doc__ = fn.__doc__
        self._jit = jax.jit(fn, static_argnames=static_argnames)
        self._entries: dict[tuple, _Entry] = {}
        self._lock = threading.Lock()
        # Calls whose signature had not been compiled ahead (they compiled on their caller's
        # thread, as jax.jit does): what a test of the prediction counts.
        self.unforeseen: set[tuple] = set()

    def __call__(self, *args, **static):
        flat = jax.tree_util.tree_flatten(args)   # once: the spread check and the signature
        if _spread(flat[0]):   # compiled ahead for one device: arrays over several run plain jit
            return self._jit(*args, **static)
        key = signature(args, static, flat)
        entry = self._entries.get(key)
        if entry is None:
            self.unforeseen.add(key)
            return self._jit(*args, **static)
        if not entry.compiled.done():   # compiled here (still queued) or waited for: the
            start = time.perf_counter()  # run stands still for it either way
            if not self._compile(entry):
                entry.compiled.exception()
            entry.timing.wait_s += time.perf_counter() - start
        if entry.compiled.exception() is not None:
            return self._jit(*args, **static)   # raises where it raises, as jax.jit would
        return entry.compiled.result()(*args)

    def compile_ahead(self, submit: Callable[[Callable[[], None]], object], timing, *shapes,
                      compiler_options: dict | None = None, **static) -> bool:
        """Compiles the signature of `shapes` (jax.ShapeDtypeStruct trees) and `static` through
        `submit` (which runs a callable on a compile thread), once, with XLA's
        `compiler_options` (the harness's own: harness.engine.compiler_options); its
        seconds go to `timing` (harness.engine.program.Timing). False where it was compiled
        ahead already."""
        key = signature(shapes, static)
        with self._lock:
            if key in self._entries:
                return False
            entry = self._entries[key] = _Entry(shapes, static, timing, compiler_options)
        timing.programs += 1
        try:
            submit(lambda: self._compile(entry))
        except RuntimeError:   # a closed pool: its first caller compiles it
            pass
        return True

    def _compile(self, entry: _Entry) -> bool:
        """Compiles `entry` here if nobody has begun to; False where somebody had."""
        with self._lock:
            if entry.state != QUEUED:
                return False
            entry.state = COMPILING
        start = time.perf_counter()
        try:
            compiled = compile_lowered(self._jit.lower(*entry.shapes, **entry.static),
                                       entry.options, what=self.__name__)
        except BaseException as exc:   # noqa: BLE001 - its caller runs plain jit, raising there
            entry.compiled.set_exception(exc)
        else:
            entry.compiled.set_result(compiled)
        with self._lock:
            entry.timing.compile_s += time.perf_counter() - start
        return True


def ahead(fn: Callable | None = None, *, static_argnames: tuple[str, ...] = ()):
    """`@ahead` or `@ahead(static_argnames=...)`: `fn` jitted, compilable ahead."""
    if fn is None:
        return lambda f: Ahead(f, static_argnames)
    return Ahead(fn, static_argnames)
