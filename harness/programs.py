"""A kernel's program: its forward output and gradients, `(q, k, v, seg, cotangent) -> (out, dq,
dk, dv)`, compiled once per kernel, shape and mode, and timed.

Two modes:
- `default`: the kernel as users train with it (cuDNN's, TE's and XLA's default algorithms).
  The tolerance checks run this program.
- `deterministic`: for the leak probe on GPUs, whose bitwise comparisons need reproducible
  results. Compiled with XLA's `xla_gpu_deterministic_ops` (per program: nothing else in the
  process changes) and traced, fresh, with Transformer Engine's deterministic algorithms
  (`NVTE_ALLOW_NONDETERMINISTIC_ALGO=0`, which TE reads while tracing). On CPUs every program is
  deterministic already, and the probe runs the default one.

Programs are lowered in the calling thread and compiled in a pool of threads (XLA compiles
without holding the GIL): `prefetch` announces what a run will need so that compiles overlap
with each other and with execution. Compile and execute seconds are kept per kernel.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from collections import defaultdict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp

from harness.cases import Case
from harness.kernel import Kernel
from harness.oracle import with_gradients

DEFAULT = "default"
DETERMINISTIC = "deterministic"
DETERMINISTIC_COMPILER_OPTIONS = {"xla_gpu_deterministic_ops": True}
DETERMINISTIC_ENV = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}


@contextlib.contextmanager
def _environment(values: dict):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _kernel_fn(kernel: Kernel, case: Case):
    extra = {"max_segments": case.max_segments} if kernel.takes_max_segments else {}

    def fn(q, k, v, seg):
        out = kernel.fn(q, k, v, seg, causal=case.causal, scale=case.scale, **extra)
        if out.shape != q.shape:
            raise ValueError(f"{kernel.name}: output shape {out.shape} != query shape {q.shape}")
        return out

    if kernel.backward:
        return with_gradients(fn)
    return lambda q, k, v, seg, ct: (fn(q, k, v, seg),)


def argument_shapes(case: Case) -> tuple:
    dtype = jnp.dtype(case.dtype)
    b, t, d = case.batch, case.seq_len, case.head_dim
    return (jax.ShapeDtypeStruct((b, t, case.heads, d), dtype),
            jax.ShapeDtypeStruct((b, t, case.kv_heads, d), dtype),
            jax.ShapeDtypeStruct((b, t, case.kv_heads, d), dtype),
            jax.ShapeDtypeStruct((b, t), jnp.int32),
            jax.ShapeDtypeStruct((b, t, case.heads, d), dtype))


@dataclass
class Timing:
    lower_s: float = 0.0
    compile_s: float = 0.0
    execute_s: float = 0.0
    programs: int = 0
    runs: int = 0

    def as_dict(self) -> dict:
        return {"lower_s": round(self.lower_s, 3), "compile_s": round(self.compile_s, 3),
                "execute_s": round(self.execute_s, 3), "programs": self.programs,
                "runs": self.runs}


@dataclass
class Program:
    """One compiled kernel program. Errors of lowering or compiling surface when it is run."""
    kernel: Kernel
    mode: str
    text: str = ""                     # the lowered module: proof of which custom calls ran
    compiled: Future = field(default_factory=Future)
    timing: Timing | None = None

    def missing_markers(self) -> list[str]:
        """Fused-kernel custom calls absent from the program handed to XLA. XLA never drops a
        custom call, and a cuDNN call it cannot plan fails compilation rather than falling
        back: a marker in the lowered text proves the fused kernel ran; its absence means
        something above it chose another path."""
        text = self.text
        if any(m not in text for m in self.kernel.hlo_markers):
            text += self.compiled.result().as_text() or ""  # some backends name it only there
        return [m for m in self.kernel.hlo_markers if m not in text]

    def __call__(self, *args):
        compiled = self.compiled.result()
        start = time.perf_counter()
        out = compiled(*args)
        jax.block_until_ready(out)
        self.timing.execute_s += time.perf_counter() - start
        self.timing.runs += 1
        return out


class Programs:
    """Compiled kernel programs of one run, and their times per kernel."""

    def __init__(self, deterministic_probe: bool = True, platform: str | None = None,
                 workers: int | None = None):
        self.platform = platform or jax.devices()[0].platform
        # Only GPUs need a separate deterministic build; elsewhere the probe's mode is default.
        self.probe_mode = DETERMINISTIC if deterministic_probe and self.platform == "gpu" \
            else DEFAULT
        self._pool = ThreadPoolExecutor(max_workers=workers or min(8, os.cpu_count() or 2),
                                        thread_name_prefix="compile")
        self._programs: dict[tuple, Program] = {}
        self._lock = threading.Lock()
        self.timing: dict[str, Timing] = defaultdict(Timing)

    def key(self, kernel: Kernel, case: Case, mode: str) -> tuple:
        return (kernel, case.shape_key,
                case.max_segments if kernel.takes_max_segments else None, mode)

    def get(self, kernel: Kernel, case: Case, mode: str = DEFAULT) -> Program:
        key = self.key(kernel, case, mode)
        with self._lock:
            program = self._programs.get(key)
        if program is None:
            program = self._build(kernel, case, mode)
            with self._lock:
                program = self._programs.setdefault(key, program)
        return program

    def prefetch(self, pairs) -> None:
        """Lowers the programs (kernel, case) pairs will need and starts compiling them."""
        for kernel, case in pairs:
            self.get(kernel, case, DEFAULT)
            if self.probe_mode != DEFAULT:
                self.get(kernel, case, self.probe_mode)

    def _build(self, kernel: Kernel, case: Case, mode: str) -> Program:
        timing = self.timing[kernel.name]
        program = Program(kernel, mode, timing=timing)
        deterministic = mode == DETERMINISTIC
        start = time.perf_counter()
        try:
            # A fresh jit each time: TE reads its setting while tracing, and a traced program
            # keeps the algorithm it was traced with.
            with _environment(DETERMINISTIC_ENV) if deterministic else contextlib.nullcontext():
                lowered = jax.jit(_kernel_fn(kernel, case)).lower(*argument_shapes(case))
            program.text = lowered.as_text() if kernel.hlo_markers else ""
        except Exception as exc:  # the kernel fails while tracing: its error, when run
            program.compiled.set_exception(exc)
            return program
        finally:
            timing.lower_s += time.perf_counter() - start
        timing.programs += 1
        options = DETERMINISTIC_COMPILER_OPTIONS if deterministic else None
        self._pool.submit(self._compile, program, lowered, options)
        return program

    @staticmethod
    def _compile(program: Program, lowered, options) -> None:
        start = time.perf_counter()
        try:
            compiled = lowered.compile(compiler_options=options) if options else lowered.compile()
        except Exception as exc:
            program.compiled.set_exception(exc)
        else:
            program.compiled.set_result(compiled)
        finally:
            program.timing.compile_s += time.perf_counter() - start

    def report(self) -> dict:
        return {name: t.as_dict() for name, t in sorted(self.timing.items())}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def enable_compilation_cache(path: str | None) -> str | None:
    """jax's persistent compilation cache in `path` (a user's second run finds its programs
    compiled); None leaves it off. Every program is cached, however fast it compiled."""
    if not path:
        return None
    path = os.path.expanduser(path)
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


DEFAULT_CACHE_DIR = os.environ.get("HARNESS_COMPILATION_CACHE",
                                   os.path.join("~", ".cache", "attention-harness", "jax"))


@functools.lru_cache(maxsize=1)
def device_memory_bytes() -> int | None:
    """What one program may use on the first device (its allocator's limit), if known."""
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:
        return None
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None
