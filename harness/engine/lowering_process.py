"""The run's programs traced and lowered in a process of their own, and read from jax's cache
there, beside the run.

On a warm run every program is traced and lowered again only to find its key in jax's
persistent compilation cache: on the H200 at 2ad2ee5 the main worker's tracer thread was busy
108 s of a 214 s warm nightly (`Programs._lower` 103.8 s), in the same interpreter as the
thread that runs and judges the pairs, the two taking turns with the GIL. Here a second process
(`python -m harness.engine.lowering_child`, started by `LoweringProcess` when the run has a
cache) does that tracer's work for the programs the run announces
(harness.engine.programs.Programs.prefetch), in the order announced, with the same code
(`Programs` there too: the same environments, compiler options and cache folder). It traces and
lowers each program, looks it up in jax's cache and, where the cache holds it, hands it over as
the bytes jax read (harness.engine.lowering_child); the run's process loads it as jax's cache
would and runs it. Nothing is keyed by anything but jax's own cache key: every run traces the
code as it is now.

A program the cache does not hold (a cold run's, nearly all) comes back as the process lowered
it (`dump_lowered`: jax's `Lowered`, pickled as jax pickles executables, its MLIR module as
bytecode), and the run compiles that lowering (so that XLA's autotuning stays inside the run's
share of the device) and writes it to the cache under the key the process looked up; before,
the run traced it again itself, in the interpreter that judges (on the H200's cold nightly at
3b0c5fc, 1,090 programs; the lower column summed to 225 s of the worker's 304.5 s). Whatever else the process does not hand over is
built in the run's own process, as without it: a kernel the process cannot find under its name,
a trace or compile that fails (the run then raises the kernel's own error), one jax cannot
serialize or pickle, everything once the process is gone. One kind of failed trace comes back instead: a kernel's error that
decides its check without an error verdict, the crash the kernel declares or, on a default
build, a refusal of a feature (harness.judge.judging.trace_error_settles), pickled with its
traceback (tblib); the run raises it as its own trace would have. (On the H200's warm nightly at
1b487e6, 351 of the 362 programs the run built itself were failed traces, traced again beside
the run's thread: MaxText's flash, TE's unfused fallback, tokamax's Mosaic and Triton paths, the
op's refusals.) Any other error the run confirms with its own trace: at once for a default
build, which the run always runs; a deterministic or forward build only once the run asks for
it (harness.engine.programs.Programs.get): on the CPU smoke run, run as if on a GPU, none of
28 such was (the builds of kernels that refuse some of its features). The
process never compiles: jax's compiler is wrapped there to refuse, as is a cache read that
fails in any way. A handed-over program is loaded (or its lowering compiled) on the devices of
the ids it was read or lowered for, and is offered only for a kernel the process has under the
same name and function (`kernel_fingerprint`). The run's header counts each kind
(`lowering_process` in its `compilation_cache`; a program loaded from the process counts as a
cache hit, one compiled from its lowering as a miss, and nothing else of the process does). Each side sends from a thread of
its own, so neither waits on a full pipe while the other waits on it. `--no-lowering-process`
builds everything in the run's process.

The process's environment is the run's, except that it takes device memory as it needs it
(no preallocation): loading a program from the cache needs little."""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
import pickle
import queue
import subprocess
import sys
import threading
import time
from multiprocessing.connection import Connection

NO_PREALLOCATION = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
STOP_WAIT_S = 5.0
# A run's lowering processes (LoweringProcesses): at most this many, each with this many of
# the run's cores. With two, the H200's warm nightly at 4d948f1 kept both busy (190 s of CPU
# in the main worker's 102 s on its pairs) and its run thread waited 16 s for programs not
# handed over yet (reports/nightly-h200-4d948f1/); with three at 396cbf3 it waited 13.2 s,
# 9.0 s of it for kernels' programs, while 3.1 of the 16 cores were busy on average
# (reports/nightly-h200-396cbf3/): one more where the run has 16 cores.
MAX_PROCESSES = 4
CORES_PER_PROCESS = 4
OPEN_AFTER = 200     # requests before a second process opens (LoweringProcesses)
CHILD = "harness.engine.lowering_child"   # the process itself

# Why a program was not handed over (the run's header counts them: compilation_cache): in the
# process,
NOT_IN_CACHE = "not in the cache"
# A compile the kernel's trace itself asked for (an eager op under ensure_compile_time_eval)
# that the cache does not hold: the process never compiles, so the trace fails there.
COMPILE_IN_TRACE = "its trace asked for a compile the cache does not hold"
NO_CACHE_LOOKUP = "looked up in no cache"          # jax compiles it without reading its cache
CACHE_READ_FAILED = "the cache read failed"
BUILD_FAILED = "its trace or compile failed"       # an error the run confirms: traced again
NOT_SERIALIZABLE = "not serializable"
UNKNOWN_KERNEL = "no such kernel in the process"
BAD_REQUEST = "the process could not read the request"
# and in the run.
LOAD_FAILED = "the run could not load it"
LOWERED_FAILED = "its lowering did not compile in the run"   # (e.g. a library not imported yet)
PROCESS_GONE = "the process had ended"


def child_environment(environ=os.environ) -> dict:
    """The process's environment: the run's (a kernel's trace may read any of it, its share
    of device memory included), except that it takes device memory as it needs it, never
    three quarters at start."""
    return {**environ, **NO_PREALLOCATION}


class LoweringProcess:
    """The run's side: `request` hands a program's build over; the answer comes back on a
    thread of its own, as `built(program, blob)`, `raised(program, blob)` (a kernel's trace
    error that decides its pair without an error verdict: a refusal, a declared crash;
    load_raised), `lowered(program, blob)` (a program jax's cache lacks, as the process
    lowered it: load_lowered; the run compiles it) or, where the process could not build it,
    `failed(program, why)` (build it here; `why` is one of the reasons above). Every request
    gets one of them, also when the process ends early; without `lowered`, a lowered program
    comes back as failed (NOT_IN_CACHE). Where `failed` itself raises, `broken(program, exc)`
    is told (the program fails with it: never left pending, the run waiting on it for ever)."""

    def __init__(self, options: dict, built, failed, raised, lowered=None, broken=None):
        self._options = options
        self._built, self._failed, self._raised = built, failed, raised
        self._lowered, self._broken = lowered, broken
        self._lock = threading.Lock()
        self._pending: dict[int, object] = {}
        self._tokens = itertools.count()
        self._proc: subprocess.Popen | None = None
        self.cpu_s = 0.0   # its CPU seconds, once it ended and `wait` reaped it
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._gone = False
        # Taken now: a later copy could catch a trace's temporary setting (traced_under).
        self._environment = child_environment()

    @property
    def gone(self) -> bool:
        """Ended, or could not start: it answers nothing more (requests are built in the
        run). A process not started yet is not gone."""
        return self._gone

    def request(self, program, message: tuple) -> bool:
        """Hands (kind, *what) over for `program`; False where the process is not there (build
        it here). Never waits on the pipe: a thread of its own sends."""
        with self._lock:
            if self._gone:
                return False
            if self._proc is None and not self._start():
                return False
            token = next(self._tokens)
            self._pending[token] = program
        self._outbox.put((message[0], token, *message[1:]))
        return True

    def _start(self) -> bool:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", CHILD, str(to_child_r), str(from_child_w)],
                pass_fds=(to_child_r, from_child_w), env=self._environment,
                stdout=subprocess.DEVNULL)
        except OSError:
            for fd in (to_child_r, to_child_w, from_child_r, from_child_w):
                os.close(fd)
            self._gone = True
            return False
        os.close(to_child_r)
        os.close(from_child_w)
        self._outbox.put(self._options)
        threading.Thread(target=self._send_all, args=(Connection(to_child_w, readable=False),),
                         name="lowering-send", daemon=True).start()
        threading.Thread(target=self._receive, args=(Connection(from_child_r, writable=False),),
                         name="lowering-receive", daemon=True).start()
        return True

    def _send_all(self, conn: Connection) -> None:
        """Sends what `request` queued, in order; None (`stop`) ends it and the process."""
        try:
            while (message := self._outbox.get()) is not None:
                conn.send(message)
        except (OSError, ValueError):
            pass   # the process is gone: its reader answers for what is pending
        finally:
            conn.close()   # the process reads the end of its input and ends

    def _receive(self, conn: Connection) -> None:
        try:
            while True:
                kind, token, payload = conn.recv()
                with self._lock:
                    program = self._pending.pop(token, None)
                if program is not None:
                    self._answer(program, kind, payload)
        except (EOFError, OSError):
            pass
        finally:
            conn.close()
            with self._lock:
                self._gone = True
                left, self._pending = list(self._pending.values()), {}
            for program in left:
                self._answer(program, "failed", PROCESS_GONE)

    def _answer(self, program, kind: str, payload) -> None:
        if kind == "lowered" and self._lowered is None:
            kind, payload = "failed", NOT_IN_CACHE
        if kind in ("built", "raised", "lowered"):
            with contextlib.suppress(Exception):
                {"built": self._built, "raised": self._raised,
                 "lowered": self._lowered}[kind](program, payload)
                return
            payload = LOAD_FAILED
        try:
            self._failed(program, str(payload))
        except BaseException as exc:   # noqa: BLE001 - the receive thread goes on answering
            if self._broken is not None:
                with contextlib.suppress(BaseException):
                    self._broken(program, exc)

    def stop(self) -> None:
        """Tells the process to end once it has read what was sent; answers nothing more."""
        with self._lock:
            self._gone = True
        self._outbox.put(None)

    def wait(self) -> None:
        """Waits STOP_WAIT_S for the stopped process to end, then kills it; reaps it with its
        CPU seconds (`cpu_s`)."""
        proc = self._proc
        if proc is None or proc.returncode is not None:
            return
        deadline = time.monotonic() + STOP_WAIT_S
        while (reaped := _reap(proc, block=False)) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        if reaped is None:
            proc.kill()
            reaped = _reap(proc, block=True)
        self.cpu_s = reaped


def _reap(proc: subprocess.Popen, block: bool) -> float | None:
    """Reaps the ended `proc` (os.wait4: the kernel's account of that one child) and returns
    its CPU seconds, user and system; None while it runs (`block` False). A worker's
    RUSAGE_CHILDREN sums every ended child, XLA's ptxas processes among them: this one's are
    its own. 0.0 where it was reaped already (its seconds unknown)."""
    try:
        pid, status, usage = os.wait4(proc.pid, 0 if block else os.WNOHANG)
    except ChildProcessError:
        proc.returncode = proc.returncode if proc.returncode is not None else 0
        return 0.0
    if pid == 0:
        return None
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime


class LoweringProcesses:
    """Several lowering processes side by side, each with its own interpreter (one tracer
    thread each: tracing holds the GIL). On the H200's warm nightly at 32ec331 one process's
    tracer worked 83 s of the main worker's 137 s on its pairs, and the run thread waited 18.9 s
    for programs not handed over yet (reports/nightly-h200-a83ae73/). A request goes to the
    process its `route` went to before (a kernel's builds on one shape share one lowering
    there). A new route, or one whose process has ended, goes to the live process asked least
    among those opened: the second opens once OPEN_AFTER requests were made (a worker with
    fewer, a FlashAttention group's, keeps one). Every request is answered, as with one."""

    def __init__(self, options: dict, built, failed, raised, count: int, lowered=None,
                 broken=None):
        self.processes = [LoweringProcess(options, built, failed, raised, lowered, broken)
                          for _ in range(max(1, count))]
        self._given: dict = {}
        self._asked = [0] * len(self.processes)
        self._open_after = max(1, OPEN_AFTER)
        self._lock = threading.Lock()

    def request(self, program, message: tuple, route=None) -> bool:
        with self._lock:
            i = self._given.get(route)
            if i is None or self.processes[i].gone:   # a route of an ended process moves on
                opened = range(min(len(self.processes), 1 + sum(self._asked) // self._open_after))
                live = [j for j in opened if not self.processes[j].gone] or [0]
                i = self._given[route] = min(live, key=lambda j: self._asked[j])
            self._asked[i] += 1
        return self.processes[i].request(program, message)

    def close(self) -> None:
        for process in self.processes:   # all told to end first, then waited for
            process.stop()
        for process in self.processes:
            process.wait()

    @property
    def cpu_s(self) -> float:
        """The CPU seconds of those ended and reaped (close)."""
        return sum(process.cpu_s for process in self.processes)


def processes_for(cores: int) -> int:
    """How many lowering processes a run starts: another one (up to MAX_PROCESSES) for each
    CORES_PER_PROCESS cores it has (the run's own thread and compile threads need some)."""
    return max(1, min(MAX_PROCESSES, cores // CORES_PER_PROCESS))


def load(blob: bytes):
    """(compiled, text, lower_s, compile_s) from a built program's blob, loaded on the devices
    jax read it for (by default it would take every device this process sees, and a
    one-device program would then fail when run: "Expected args ... to have 2 shards")."""
    import jax
    from jax.experimental.serialize_executable import deserialize_and_load
    payload, in_tree, out_tree, devices, text, lower_s, compile_s = pickle.loads(blob)
    by_id = {d.id: d for d in jax.devices()}
    compiled = deserialize_and_load(payload, in_tree, out_tree,
                                    execution_devices=[by_id[i] for i in devices])
    return compiled, text, lower_s, compile_s


def _lowered_pickling():
    """(Pickler, Unpickler) of a lowered program (jax.stages.Lowered): jax's own pickling of
    executables (jax.experimental.serialize_executable: its backend, devices by id), taught
    the lowering's MLIR module (as bytecode, parsed again here) and its device lists (ids)."""
    import jax
    from jax._src.interpreters import mlir
    from jax._src.lib import xla_client as xc
    from jax._src.lib.mlir import ir
    from jax.experimental import serialize_executable as se

    class Pickler(se._JaxPjrtPickler):
        def persistent_id(self, obj):
            if isinstance(obj, ir.Module):
                return "module", mlir.module_to_bytecode(obj)
            if isinstance(obj, xc.DeviceList):
                return "device_list", tuple(d.id for d in obj)
            return super().persistent_id(obj)

    class Unpickler(se._JaxPjrtUnpickler):
        def persistent_load(self, pid):
            if pid[0] == "module":
                with mlir.make_ir_context():
                    return ir.Module.parse(pid[1])
            if pid[0] == "device_list":
                by_id = {d.id: d for d in jax.devices()}
                return xc.DeviceList(tuple(by_id[i] for i in pid[1]))
            return super().persistent_load(pid)
    return Pickler, Unpickler


def dump_lowered(lowered, text: str, lower_s: float) -> bytes:
    """A lowered program the process traced and jax's cache lacks, with its text and its
    trace's seconds, as bytes (load_lowered reads them back); an error where some piece of it
    does not pickle (a host callback, a constant argument: the run builds it instead)."""
    import copy
    import io
    lowering = getattr(lowered, "_lowering", None)
    kept = getattr(lowering, "compile_args", None) or {}
    # Arrays, and objects of this process (a host callback; custom partitioning's callbacks,
    # named in the module by their id here): not handed over, the run traces it itself.
    if getattr(lowering, "const_args", None) or kept.get("keepalive") \
            or kept.get("host_callbacks"):
        raise ValueError("constant arguments, kept objects or host callbacks")
    if getattr(lowering, "_executable", None) is not None:
        # Compiled here already (a default build the cache held, whose lowering a
        # deterministic build shares): the lowering alone, not its executable.
        lowering = copy.copy(lowering)
        lowering._executable = None
        lowered = copy.copy(lowered)
        lowered._lowering = lowering
    pickler, _ = _lowered_pickling()
    out = io.BytesIO()
    pickler(out).dump((lowered, text, lower_s))
    return out.getvalue()


def load_lowered(blob: bytes):
    """(lowered, text, lower_s) from dump_lowered's bytes: the lowering as the process
    traced it, on this process's devices of the same ids; compiled here, it is the program
    the process's lowering is (jax's cache key is the same)."""
    import io

    import jax
    _, unpickler = _lowered_pickling()
    return unpickler(io.BytesIO(blob), jax.devices()[0].client).load()


def load_raised(blob: bytes) -> tuple[BaseException, float]:
    """(the kernel's error, its trace's seconds) from a "raised" answer: the error with the
    traceback and chain of the process's trace (tblib reads them back)."""
    return pickle.loads(blob)


def kernel_fingerprint(kernel) -> str:
    """What names a kernel's function across processes: its module and qualified name (and a
    partial's arguments), so that the process builds the kernel the run has under that name."""
    fn, more = kernel.fn, ""
    if isinstance(fn, functools.partial):
        fn, more = fn.func, f"{fn.args!r}{sorted(fn.keywords.items())!r}"
    return f"{getattr(fn, '__module__', None)}:{getattr(fn, '__qualname__', type(fn).__name__)}" \
        f"{more}"
