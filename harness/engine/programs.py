"""A kernel's program: its forward output and gradients, `(q, k, v, seg, cotangent) -> (out, dq,
dk, dv)`, compiled once per kernel, shape and mode, and timed; and the oracle's programs.

Two modes:
- `default`: the kernel as users train with it (cuDNN's, TE's and XLA's default algorithms).
  The tolerance checks run this program.
- `deterministic`: for the leak probe on GPUs, whose bitwise comparisons need reproducible
  results. The same lowering compiled with XLA's `xla_gpu_deterministic_ops` (per program:
  nothing else in the process changes). A kernel whose library chooses its algorithms from the
  environment while it is traced declares `deterministic_env` (Transformer Engine:
  NVTE_ALLOW_NONDETERMINISTIC_ALGO=0) and is traced afresh under it. jax caches abstract
  evaluations across traces, and TE sizes its backward workspace there: the cache is cleared
  around that trace, or the deterministic kernel would run in the default algorithm's smaller
  workspace and write past it. On CPUs every program is deterministic already, and the probe
  runs the default one.

A background thread traces the programs a run announces (`prefetch`), in run order, and a pool of
threads compiles them (XLA compiles without holding the GIL), so tracing, compiling and executing
overlap. Lower, compile and execute seconds are kept per kernel, the oracle's under "oracle".
"""
from __future__ import annotations

import contextlib
import sys
import threading
import time
from collections import defaultdict
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor

import jax

from harness.compiling import compile_lowered
from harness.engine import compiler_options, lowering_process, own_programs, unwritten
from harness.engine.compile_pool import CompilePool
from harness.engine.compilation_cache import (
    count_handed_over,
    count_left_unbuilt,
    count_lowered_apart,
    count_trace_error_handed_over,
)
from harness.engine.environment import usable_cores
from harness.engine.lowering_process import LoweringProcesses, kernel_fingerprint, processes_for
from harness.engine.program import Program, Timing
from harness.engine.registry import all_kernels
from harness.engine.trace_environment import traced_under
from harness.engine.program_functions import (
    DEFAULT,
    DETERMINISTIC,
    FORWARD,
    argument_shapes,
    kernel_fn,
)
from harness.judge.oracle import case_key_span, reference_fn, reference_jvp_fn, share_programs
from harness.kernels.kernel import Kernel
from harness.model.case import Case

ORACLE = "oracle"
# The harness's own small programs (harness.ahead), compiled ahead: their row of the timing
# table (programs and compile seconds; waited: the run's waits for one still compiling, and
# its compiling of one still queued).
OWN = "harness's own programs"
# Their compile threads. They compile once the programs whose outputs they take are built; queued
# behind the kernels' compiles, the run's thread compiled them itself (75 s of the H200's cold
# nightly worker's 324 s at 4d948f1).
OWN_THREADS = 4
SWITCH_INTERVAL_S = 0.0001
# How long `close` waits for the compiles under way (each writes jax's cache when done).
CLOSE_WAIT_S = 120.0


class Programs:
    """The compiled programs of one run, and their times per kernel."""
    lowering_cpu_s = None   # its lowering processes' CPU seconds, once closed (if it had any)

    def __init__(self, deterministic_probe: bool = True, platform: str | None = None,
                 workers: int | None = None, lowering_process: dict | None = None,
                 lowering_processes: int | None = None):
        self.platform = platform or jax.devices()[0].platform
        # Only GPUs need a separate deterministic build; elsewhere the probe's mode is default.
        # A GPU's allocator hands a run blocks that earlier programs wrote: there a kernel's
        # checked run starts on NaN-filled blocks (harness.engine.unwritten). On CPUs every
        # kernel is XLA's own code, which writes all it returns: the fills would only cost time.
        self.poisons_unwritten = self.platform == "gpu"
        self.probe_mode = DETERMINISTIC if deterministic_probe and self.platform == "gpu" \
            else DEFAULT
        # The run's thread waits on the device dozens of times per kernel and case; each time
        # it wants the GIL back while the tracer thread holds it, it waits up to the switch
        # interval (5 ms by default; at 0.5 ms the H200's warm nightly at c4f8fc7 sampled its
        # run thread 42 s of 203 inside jax's calls of compiled programs).
        sys.setswitchinterval(min(sys.getswitchinterval(), SWITCH_INTERVAL_S))
        self._pool = CompilePool(max_workers=workers or usable_cores(),
                                 thread_name_prefix="compile")
        # The harness's own programs in threads of their own (see OWN_THREADS).
        self._own_pool = CompilePool(max_workers=OWN_THREADS, thread_name_prefix="compile-own")
        self._tracer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trace")
        self._programs: dict[tuple, Program] = {}
        self._lowered: dict[tuple, object] = {}
        self._lock = threading.Lock()          # the dicts
        self._trace_lock = threading.Lock()    # one trace at a time (environment, jax caches)
        self.timing: dict[str, Timing] = defaultdict(Timing)
        # The own programs' row is read and written by compile threads (their done callbacks)
        # as well as the run's: made here, never by two threads' first lookups at once.
        self.timing[OWN] = Timing()
        gpu = self.platform == "gpu"
        self._own = compiler_options.own_options(gpu)
        self._deterministic = compiler_options.deterministic_options(gpu)
        # References asked for outside the runner's calls (a drop's prediction) come from here.
        share_programs(self)
        # `lowering_process`: the run's options (as JSON data), to trace and lower what
        # `prefetch` announces in a process of their own and read it from jax's cache there
        # (harness.engine.lowering_process): `lowering_processes` of them (default: as many
        # as the run's cores allow, processes_for).
        self._apart = None if lowering_process is None else LoweringProcesses(
            lowering_process, self._built_apart, self._failed_apart, self._raised_apart,
            lowering_processes or processes_for(usable_cores()), lowered=self._lowered_apart,
            broken=lambda item, exc: item[0].fail(exc))   # _failed_apart raised

    # ----- kernels ----------------------------------------------------------------------------

    def get(self, kernel: Kernel, case: Case, mode: str = DEFAULT) -> Program:
        program, fresh = self._entry(("kernel", kernel, _shape(kernel, case), mode),
                                     kernel.name, _markers(kernel, mode), mode,
                                     bool(kernel.deterministic_env))
        if fresh:
            self._build_kernel(program, kernel, case)
        elif self._asked_for([program]):   # its build failed in the lowering process: now
            start = time.perf_counter()
            self._build_kernel(program, kernel, case)
            program.timing.wait_s += time.perf_counter() - start
        return program

    def _asked_for(self, programs) -> list:
        """Marks `programs` asked for; the builds among them left for the run to ask for
        (_failed_apart), counted as built here, as (name, build): the run builds them now."""
        with self._lock:
            left = [(p.name, p.build_here) for p in programs if p.build_here]
            for p in programs:
                p.asked, p.build_here = True, None
        for name, _ in left:
            count_left_unbuilt(name, lowering_process.BUILD_FAILED, built=True)
        return left

    def prefetch(self, pairs, probe: bool = True) -> None:
        """Starts tracing and compiling, in order, what (kernel, case) pairs will run: each
        case's oracle, each kernel's default build and, where the probe needs one, its
        deterministic build; then the harness's own programs the pair calls (metrics, and with
        `probe` the leak probe's), from those programs' output shapes."""
        modes = [DEFAULT] + ([self.probe_mode] if self.probe_mode != DEFAULT else [])
        registered = all_kernels()
        for kernel, case in pairs:
            convention = kernel.chunk_convention
            forward = [FORWARD] if kernel.forward_mode and not kernel.forward_reasons(case) \
                else []
            if forward:
                own_programs.tangents_ahead(case, self._own_pool.submit, self.timing[OWN],
                                            self._own)
            for truth in (True, False):
                for mode in [DEFAULT] + forward:
                    program, fresh = self._oracle_entry(case, truth, convention, mode)
                    if fresh:
                        self._build_ahead(program, ("oracle", case.id, truth, convention, mode),
                                          self._oracle_key(case, truth, convention, mode),
                                          self._build_oracle, case, truth, convention)
            for mode in modes + forward:
                program, fresh = self._entry(("kernel", kernel, _shape(kernel, case), mode),
                                             kernel.name, _markers(kernel, mode), mode,
                                             bool(kernel.deterministic_env))
                if fresh:
                    message = ("kernel", kernel.name, kernel_fingerprint(kernel), case.id,
                               mode) if registered.get(kernel.name) is kernel else None
                    self._build_ahead(program, message, (kernel.name, _shape(kernel, case)),
                                      self._build_kernel, kernel, case)
                if mode != DETERMINISTIC:   # its outputs are the default build's
                    self._own_after(kernel, case, mode, probe)

    def _build_ahead(self, program: Program, message: tuple | None, route, build,
                     *args) -> None:
        """`build(program, *args)` on the tracer thread, or `message` handed to a lowering
        process (None: a kernel it cannot know, not the registry's under its name), the one
        `route` went to before (a kernel's builds on one shape: one lowering there)."""
        def here():
            try:
                self._tracer.submit(build, program, *args)
            except RuntimeError as exc:   # closed: the program fails, it never stays pending
                program.compiled.set_exception(exc)
        if self._apart is None or message is None:
            here()
        elif not self._apart.request((program, here), message, route):
            self._failed_apart((program, here), lowering_process.PROCESS_GONE)

    def _built_apart(self, item, blob: bytes) -> None:   # loaded on a compile thread
        self._apart_in_pool(self._load, item, blob)

    def _lowered_apart(self, item, blob: bytes) -> None:   # compiled on a compile thread
        self._apart_in_pool(self._compile_apart, item, blob)

    def _apart_in_pool(self, take, item, blob: bytes) -> None:
        try:
            self._pool.submit(take, item, blob)
        except RuntimeError as exc:   # closed
            item[0].compiled.set_exception(exc)

    def _failed_apart(self, item, why: str) -> None:
        """Built here; a deterministic or forward build whose trace or compile failed there
        only once the run asks for it (`get`): on the CPU smoke run, run as if on a GPU, none
        of 28 was (kernels that refuse some of its features)."""
        program, here = item
        if why == lowering_process.BUILD_FAILED and program.mode != DEFAULT \
                and not program.oracle:
            with self._lock:
                if not program.asked:
                    program.build_here = here
                    count_left_unbuilt(program.name, why)
                    return
        count_handed_over(False, program.name, why)
        here()

    def _raised_apart(self, item, blob: bytes) -> None:
        """A kernel's trace error from the lowering process (a refusal, a declared crash): the
        program fails with it, as if traced here, and is not traced again."""
        program = item[0]
        try:
            exc, lower_s = lowering_process.load_raised(blob)
        except Exception:
            self._failed_apart(item, lowering_process.LOAD_FAILED)
            return
        count_trace_error_handed_over()
        with self._lock:
            program.timing.lower_s += lower_s
        program.trace_error = exc
        program.compiled.set_exception(exc)

    def _compile_apart(self, item, blob: bytes) -> None:
        """Any failure, its compile's included, builds it here instead (the kernel's own trace
        says what fails; a lowering whose custom calls' library is not imported here yet, TE's
        on a cold run, does not compile until a trace here imports it)."""
        def compiled_here():
            lowered, text, lower_s = lowering_process.load_lowered(blob)
            compiled = compile_lowered(lowered, self._options(item[0]),
                                       what=f"{item[0].name} ({item[0].mode})")
            return compiled, text, lower_s, 0.0
        self._take_apart(item, compiled_here, lowering_process.LOWERED_FAILED,
                         count_lowered_apart)

    def _options(self, program: Program) -> dict | None:
        """Its compiler options: the harness's own for the oracle's, with XLA's deterministic
        ops for a deterministic build; users' (none) for a kernel's default or forward build."""
        if program.oracle:
            return self._own
        if program.mode == DETERMINISTIC:
            return self._deterministic
        return None

    def _load(self, item, blob: bytes) -> None:
        """A program the lowering process built, loaded here; built here where it fails."""
        self._take_apart(item, lambda: lowering_process.load(blob), lowering_process.LOAD_FAILED,
                         lambda: count_handed_over(True, item[0].name))

    def _take_apart(self, item, take, why: str, count) -> None:
        """`take()`: (compiled, text, lower_s, compile_s) of a program the lowering process
        handed over, made runnable here (loaded, or its lowering compiled) and counted
        (`count()`); where that fails, built here (`why`)."""
        program, start = item[0], time.perf_counter()
        try:
            compiled, text, lower_s, compile_s = take()
            outputs = jax.tree.map(lambda o: jax.ShapeDtypeStruct(o.shape, o.dtype),
                                   compiled.out_info)
        except BaseException:   # noqa: BLE001 - whatever it is, the run's own build says
            self._failed_apart(item, why)
            return
        count()
        program.text, program.outputs = text, outputs
        with self._lock:
            program.timing.programs += 1
            program.timing.lower_s += lower_s
            program.timing.compile_s += compile_s + time.perf_counter() - start
        self._ready_to_run(program, compiled)

    def _entry(self, key, name, markers, mode, reads_environment=False) -> tuple[Program, bool]:
        with self._lock:
            program = self._programs.get(key)
            if program is not None:
                return program, False
            program = self._programs[key] = Program(name, markers, self.timing[name], mode,
                                                    reads_environment)
            return program, True

    def _lower(self, key, fn, shapes, env, timing):
        """The lowering of `fn` at `shapes` under `env`, traced once."""
        with self._trace_lock:
            if key in self._lowered:
                return self._lowered[key]
            start = time.perf_counter()
            try:
                with traced_under(env):
                    self._lowered[key] = jax.jit(fn).lower(*shapes)
            finally:
                timing.lower_s += time.perf_counter() - start
            return self._lowered[key]

    def _build_kernel(self, program: Program, kernel: Kernel, case: Case) -> None:
        deterministic = program.mode == DETERMINISTIC
        # A fresh trace where the kernel's library reads its algorithm from the environment;
        # otherwise the default lowering, compiled with other options.
        env = kernel.deterministic_env if deterministic else None
        mode = FORWARD if program.mode == FORWARD else DEFAULT   # deterministic: the default's
        key = (kernel, _shape(kernel, case), tuple(sorted((env or {}).items())), mode)
        try:
            lowered = self._lower(key, kernel_fn(kernel, case, mode),
                                  argument_shapes(case, mode), env, program.timing)
            program.text = lowered.as_text() if program.markers else ""
        except BaseException as exc:  # the kernel fails while tracing (a library may even
            program.trace_error = exc            # sys.exit): its error, when run; never a hang
            program.compiled.set_exception(exc)
            return
        self._submit(program, lowered, self._options(program))

    def _own_after(self, kernel: Kernel, case: Case, mode: str, probe: bool) -> None:
        """`_build_own` on the tracer thread once the programs whose outputs it reads are built
        (the oracle's two and the kernel's): next in line there, or, with a lowering process,
        once all three are built, there or here."""
        def build_own(_=None):
            with contextlib.suppress(RuntimeError):   # closed: nothing more to compile
                self._tracer.submit(self._build_own, kernel, case, mode, probe)
        if self._apart is None:
            build_own()
            return
        convention = kernel.chunk_convention
        keys = [self._oracle_key(case, True, convention, mode),
                self._oracle_key(case, False, convention, mode),
                ("kernel", kernel, _shape(kernel, case), mode)]
        with self._lock:
            waits = [self._programs[k].compiled for k in keys]
        left = [len(waits)]

        def one_done(_):
            with self._lock:
                left[0] -= 1
                if left[0] > 0:
                    return
            build_own()
        for done in waits:
            done.add_done_callback(one_done)

    def _build_own(self, kernel: Kernel, case: Case, mode: str, probe: bool) -> None:
        """Compiles ahead the harness's own programs this pair calls in `mode`
        (harness.engine.own_programs), from the outputs of the programs lowered so far."""
        def outputs(key, entry=None):
            lowered = self._lowered.get(key)
            if lowered is not None:
                return lowered.out_info
            program = self._programs.get(entry or key)
            return None if program is None else program.outputs
        convention = kernel.chunk_convention
        own_programs.compile_ahead(
            case, mode == FORWARD, probe, argument_shapes(case),
            outputs(self._oracle_key(case, True, convention, mode)),
            outputs(self._oracle_key(case, False, convention, mode)),
            outputs((kernel, _shape(kernel, case), (), mode),
                    ("kernel", kernel, _shape(kernel, case), mode)),
            self._own_pool.submit, self.timing[OWN], self._own)

    # ----- the oracle -------------------------------------------------------------------------

    def oracle(self, case: Case, truth: bool, chunk_convention: str = "segment",
               mode: str = DEFAULT) -> Program:
        program, fresh = self._oracle_entry(case, truth, chunk_convention, mode)
        if fresh:
            self._build_oracle(program, case, truth, chunk_convention)
        return program

    def oracle_jvp(self, case: Case, truth: bool, chunk_convention: str = "segment") -> Program:
        """The oracle's forward mode: (q, k, v, seg[, sinks], tangents) -> (output tangent,)."""
        return self.oracle(case, truth, chunk_convention, FORWARD)

    @staticmethod
    def _oracle_key(case: Case, truth: bool, chunk_convention: str, mode: str) -> tuple:
        # The convention changes the program only where the case has chunks; the keys a block
        # of queries reads on long rows (oracle.case_key_span) depend on the case's layout.
        key = ("oracle", case.shape_key, truth, mode, case_key_span(case))
        return key + (chunk_convention,) if case.features.chunk is not None else key

    def _oracle_entry(self, case: Case, truth: bool, chunk_convention: str = "segment",
                      mode: str = DEFAULT):
        program, fresh = self._entry(self._oracle_key(case, truth, chunk_convention, mode),
                                     ORACLE, (), mode)
        program.oracle = True
        return program, fresh

    def _build_oracle(self, program: Program, case: Case, truth: bool,
                      chunk_convention: str = "segment") -> None:
        build = reference_jvp_fn if program.mode == FORWARD else reference_fn
        try:
            lowered = self._lower(self._oracle_key(case, truth, chunk_convention, program.mode),
                                  build(case, truth, chunk_convention),
                                  argument_shapes(case, program.mode), None, program.timing)
        except BaseException as exc:
            program.compiled.set_exception(exc)
            return
        self._submit(program, lowered, self._options(program))

    # ----- compiling --------------------------------------------------------------------------

    def _submit(self, program: Program, lowered, options) -> None:
        program.timing.programs += 1
        try:
            self._pool.submit(self._compile, program, lowered, options)
        except RuntimeError as exc:   # closed: the program fails, it never stays pending
            program.compiled.set_exception(exc)

    def _compile(self, program: Program, lowered, options) -> None:
        start = time.perf_counter()
        try:
            compiled = compile_lowered(lowered, options, what=f"{program.name} ({program.mode})")
        except BaseException as exc:
            with self._lock:  # compile threads add up concurrently
                program.timing.compile_s += time.perf_counter() - start
            program.compiled.set_exception(exc)
            return
        with self._lock:
            program.timing.compile_s += time.perf_counter() - start
        self._ready_to_run(program, compiled)

    def _ready_to_run(self, program: Program, compiled) -> None:
        start = time.perf_counter()
        if self.poisons_unwritten and program.mode in (DEFAULT, FORWARD) and not program.oracle:
            # A kernel's checked run poisons its blocks first: its fills compile here (should
            # that fail, they compile when the run needs them, and fail there).
            with contextlib.suppress(Exception):
                unwritten.prepare(program.fill_sizes(compiled))
        with self._lock:
            program.timing.compile_s += time.perf_counter() - start
        program.compiled.set_result(compiled)

    def wait_all(self) -> int:
        """Waits until every program started so far is compiled or has failed (a tool that
        times programs: scripts/program_costs.py); how many there are."""
        while True:
            for _, here in self._asked_for(list(self._programs.values())):   # all asked: now
                here()
            pending = [p for p in list(self._programs.values()) if not p.compiled.done()]
            if not pending:
                return len(self._programs)
            pending[0].compiled.exception()

    def add_oracle_wall(self, seconds: float) -> None:
        """Oracle work done outside the runner's own calls (harness.judge.oracle
        .charged_to_oracle): the oracle's wall time, which the runner takes out of the
        kernel's."""
        self.timing[ORACLE].wall_s += seconds

    def report(self) -> dict:
        return {name: t.as_dict() for name, t in sorted(self.timing.items())}

    def close(self) -> None:
        """Lets go of what is not built yet; waits up to CLOSE_WAIT_S for the compiles under
        way, which write jax's cache (a worker ends with os._exit: one cut off mid-write would
        leave a file jax then fails to read, and never writes again)."""
        # The tracer first: what a stopped lowering process leaves unanswered then fails at
        # once (its build cannot be queued), never pending.
        self._tracer.shutdown(wait=False, cancel_futures=True)
        if self._apart is not None:
            self._apart.close()
            self.lowering_cpu_s = self._apart.cpu_s
        for pool in (self._pool, self._own_pool):
            pool.shutdown(wait=False, cancel_futures=True)
        futures.wait(self._pool.unfinished() + self._own_pool.unfinished(),
                     timeout=CLOSE_WAIT_S)
        share_programs(None, closing=self)   # references asked for later: plain jit


def for_run(options, lowering_processes: int | None = None) -> Programs:
    """The programs of a run with these options (harness.engine.options.RunOptions): found in
    jax's cache by lowering processes where the run has a cache, unless --no-lowering-process
    (`lowering_processes` of them; default: processes_for the run's cores)."""
    apart = options.lowering_process and options.cache_dir
    return Programs(deterministic_probe=options.deterministic_probe,
                    lowering_process=options.to_json() if apart else None,
                    lowering_processes=lowering_processes)


def _markers(kernel: Kernel, mode: str) -> tuple[str, ...]:
    """The custom calls that prove the kernel's own code ran in a program of `mode`."""
    return kernel.forward_markers if mode == FORWARD else kernel.hlo_markers


def _shape(kernel: Kernel, case: Case) -> tuple:
    return (case.shape_key, case.max_segments if kernel.takes_max_segments else None)
