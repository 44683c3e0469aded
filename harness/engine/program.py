"""One compiled program of a run (`Program`: a kernel's build or the oracle's, with its
markers, its runs and their waits) and the seconds kept per kernel (`Timing`);
harness.engine.programs builds them."""
from __future__ import annotations

import contextlib
import time
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import jax

from harness.engine import unwritten
from harness.engine.program_functions import DEFAULT, DETERMINISTIC
from harness.engine.trace_environment import ENVIRONMENT_LOCK

# Fills and runs of a kernel's checked run until its outputs sit in the filled blocks
# (harness.engine.unwritten.landed); after that the last run counts as it is.
POISON_ATTEMPTS = 2


@dataclass
class Timing:
    lower_s: float = 0.0
    compile_s: float = 0.0
    execute_s: float = 0.0
    probe_execute_s: float = 0.0   # of execute_s: the leak probe's deterministic build (GPUs)
    wait_s: float = 0.0        # the run waited for its programs (compiling; a trace's environment)
    wall_s: float = 0.0        # the run's time on this kernel, checks and probe included
    programs: int = 0
    runs: int = 0

    def as_dict(self) -> dict:
        # host: the run's own work on this kernel beside the device and the compiler (per-token
        # metrics, judging, the probe's comparisons, transfers, Python): wall less execute and
        # waited.
        host = max(self.wall_s - self.execute_s - self.wait_s, 0.0) if self.wall_s else 0.0
        return {"lower_s": round(self.lower_s, 3), "compile_s": round(self.compile_s, 3),
                "execute_s": round(self.execute_s, 3),
                "probe_execute_s": round(self.probe_execute_s, 3),
                "wait_s": round(self.wait_s, 3),
                "wall_s": round(self.wall_s, 3), "host_s": round(host, 3),
                "programs": self.programs, "runs": self.runs}


@dataclass
class Program:
    """One compiled program. Errors of tracing or compiling surface when it is run."""
    name: str
    markers: tuple[str, ...]
    timing: Timing
    mode: str = DEFAULT
    reads_environment: bool = False    # its library reads the environment (ENVIRONMENT_LOCK)
    oracle: bool = False               # the harness's own reference, not a kernel
    text: str = ""                     # the lowered module: proof of which custom calls ran
    compiled: Future = field(default_factory=Future)
    # Raised while the kernel was traced, before anything computed: where it names a feature
    # the case handed over, a refusal (harness.judge.judging.refusal).
    trace_error: BaseException | None = None
    _buffer_sizes: list[int] | None = field(default=None, repr=False)
    # Its output shapes, where the lowering process built it (harness.engine.own_programs).
    outputs: object = field(default=None, repr=False)
    # A build the run asked for (harness.engine.programs.Programs.get), and one whose build
    # failed in the lowering process, left for the run to trace once it asks: its build here.
    asked: bool = field(default=False, repr=False)
    build_here: object = field(default=None, repr=False)

    def fail(self, exc: BaseException) -> None:
        """Fails with `exc`, unless compiled or failed already: never left pending."""
        with contextlib.suppress(InvalidStateError):
            self.compiled.set_exception(exc)

    def missing_markers(self) -> list[str]:
        """Fused-kernel custom calls absent from the program handed to XLA. XLA never drops a
        custom call, and a cuDNN call it cannot plan fails compilation rather than falling
        back: a marker in the lowered text proves the fused kernel ran; its absence means
        something above it chose another path."""
        compiled = self.compiled.result()
        text = self.text

        def absent(marker: str) -> bool:  # "a|b": either custom call proves a fused kernel ran
            return not any(m in text for m in marker.split("|"))
        if any(absent(m) for m in self.markers):
            text += compiled.as_text() or ""  # some backends name the call only there
        return [m for m in self.markers if absent(m)]

    def require_markers(self) -> None:
        """An AssertionError naming the fused-kernel custom calls the program lacks."""
        missing = self.missing_markers()
        if missing:
            raise AssertionError(f"program lacks {missing}: the fused kernel did not run")

    def memory_bytes(self) -> int | None:
        """What one run allocates beyond its arguments (XLA's temporaries, cuDNN's and TE's
        workspaces included, and its outputs), as compiled; None if the backend does not say."""
        try:
            stats = self.compiled.result().memory_analysis()
            return int(stats.temp_size_in_bytes + stats.output_size_in_bytes)
        except Exception:
            return None

    def __call__(self, *args, poison_unwritten: bool = False):
        """One run. `poison_unwritten`: the blocks the run will take are filled with NaN first
        (harness.engine.unwritten), so what the kernel leaves unwritten reads NaN every time."""
        compiled = self._ready()
        with self._environment():
            return self._execute(compiled, args, poison_unwritten)

    def launch(self, *args):
        """One run (unpoisoned), launched and not waited for (`wait` waits): the host launches
        it while the device still works on the run before (the leak probe's runs)."""
        compiled = self._ready()
        with self._environment():
            return self._launched(compiled, args)

    def wait(self, out):
        start = time.perf_counter()
        jax.block_until_ready(out)
        self._executed(time.perf_counter() - start)
        return out

    def _launched(self, compiled, args):
        start = time.perf_counter()
        out = compiled(*args)
        self._executed(time.perf_counter() - start)
        self.timing.runs += 1
        return out

    def _executed(self, seconds: float) -> None:
        self.timing.execute_s += seconds
        if self.mode == DETERMINISTIC:
            self.timing.probe_execute_s += seconds

    def _ready(self):   # the compiled program, once compiled (the run's wait for it counted)
        if not self.compiled.done():
            start = time.perf_counter()
            self.compiled.exception()
            self.timing.wait_s += time.perf_counter() - start
        return self.compiled.result()

    @contextlib.contextmanager
    def _environment(self):   # held while a program whose library reads it runs
        lock = ENVIRONMENT_LOCK if self.reads_environment else contextlib.nullcontext()
        start = time.perf_counter()
        with lock:
            self.timing.wait_s += time.perf_counter() - start
            yield

    def _execute(self, compiled, args, poison_unwritten: bool = False):
        if not poison_unwritten:
            return self._timed(compiled, args)
        sizes = self.fill_sizes(compiled)
        for _ in range(POISON_ATTEMPTS):
            where = unwritten.poison(sizes)
            out = self._timed(compiled, args)
            if unwritten.landed(out, where):
                break
        return out

    def fill_sizes(self, compiled) -> list[int]:
        """The blocks its run takes (unwritten.buffer_sizes), worked out once."""
        if self._buffer_sizes is None:
            self._buffer_sizes = unwritten.buffer_sizes(compiled)
        return self._buffer_sizes

    def _timed(self, compiled, args):
        return self.wait(self._launched(compiled, args))
