"""The run's programs traced and lowered in a process of their own, and read from jax's cache
there, beside the run.

On a warm run every program is traced and lowered again only to find its key in jax's
persistent compilation cache: on the H200 at 2ad2ee5 the main worker's tracer thread was busy
108 s of a 214 s warm nightly (`Programs._lower` 103.8 s), in the same interpreter as the
thread that runs and judges the pairs, the two taking turns with the GIL. Here a second process
(`python -m harness.engine.lowering_process`, started by `LoweringProcess` when the run has a
cache) does that tracer's work for the programs the run announces
(harness.engine.programs.Programs.prefetch), in the order announced, with the same code
(`Programs` there too: the same environments, compiler options and cache folder). It traces
and lowers each program, looks it up in jax's cache and, where the cache holds it, hands it
over as the bytes jax read (`_Cached`); the run's process loads it as jax's cache would and
runs it. Nothing is keyed by anything but jax's own cache key: every run traces the code as
it is now.

Whatever the process does not hand over is built in the run's own process, as without it: a
program the cache does not hold (compiled by the run, so that XLA's autotuning stays inside
the run's share of the device), a kernel the process cannot find under its name, a trace or
compile that fails (the run then raises the kernel's own error), one jax cannot serialize,
everything once the process is gone. The run's header counts both (`lowering_process` in its
`compilation_cache`). `--no-lowering-process` builds everything in the run's process.

The process takes device memory as it needs it and gives it back (the platform allocator, no
preallocation): loading a program from the cache needs little."""
from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import subprocess
import sys
import threading
from multiprocessing.connection import Connection

ALLOCATOR = {"XLA_PYTHON_CLIENT_ALLOCATOR": "platform", "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
MEMORY_SHARES = ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
STOP_WAIT_S = 5.0
_SERIALIZING = threading.Lock()


def child_environment(environ=os.environ) -> dict:
    """The process's environment: the run's, with the device's memory taken as needed."""
    env = {k: v for k, v in environ.items() if k not in MEMORY_SHARES}
    return {**env, **ALLOCATOR}


class LoweringProcess:
    """The run's side: `request` hands a program's build over; the answer comes back on a
    thread of its own, as `built(program, blob)` or, where the process could not build it,
    `failed(program)` (build it here). Every request gets one of the two, also when the
    process ends early."""

    def __init__(self, options: dict, built, failed):
        self._options = options
        self._built, self._failed = built, failed
        self._lock = threading.Lock()
        self._pending: dict[int, object] = {}
        self._tokens = itertools.count()
        self._proc: subprocess.Popen | None = None
        self._send: Connection | None = None
        self._gone = False

    def request(self, program, message: tuple) -> bool:
        """Hands (kind, *what) over for `program`; False where the process is not there (build
        it here)."""
        with self._lock:
            if self._gone:
                return False
            if self._proc is None and not self._start():
                return False
            token = next(self._tokens)
            self._pending[token] = program
            try:
                self._send.send((message[0], token, *message[1:]))
            except (OSError, ValueError):
                del self._pending[token]
                self._gone = True
                return False
            return True

    def _start(self) -> bool:
        to_child_r, to_child_w = os.pipe()
        from_child_r, from_child_w = os.pipe()
        try:
            self._proc = subprocess.Popen(
                [sys.executable, "-m", __name__, str(to_child_r), str(from_child_w)],
                pass_fds=(to_child_r, from_child_w), env=child_environment(),
                stdout=subprocess.DEVNULL)
        except OSError:
            for fd in (to_child_r, to_child_w, from_child_r, from_child_w):
                os.close(fd)
            self._gone = True
            return False
        os.close(to_child_r)
        os.close(from_child_w)
        self._send = Connection(to_child_w, readable=False)
        self._send.send(self._options)
        threading.Thread(target=self._receive, args=(Connection(from_child_r, writable=False),),
                         name="lowering-receive", daemon=True).start()
        return True

    def _receive(self, conn: Connection) -> None:
        from harness.engine.compilation_cache import count_elsewhere
        try:
            while True:
                kind, token, payload, counts = conn.recv()
                with self._lock:
                    program = self._pending.pop(token, None)
                count_elsewhere(self, counts)
                if program is not None:
                    (self._built(program, payload) if kind == "built"
                     else self._failed(program))
        except (EOFError, OSError):
            pass
        finally:
            conn.close()
            with self._lock:
                self._gone = True
                left, self._pending = list(self._pending.values()), {}
            for program in left:
                self._failed(program)

    def close(self) -> None:
        with self._lock:
            self._gone = True
            send, proc = self._send, self._proc
        if send is not None:
            with contextlib.suppress(OSError, ValueError):
                send.send(None)
            send.close()
        if proc is not None:
            try:
                proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def load(blob: bytes):
    """(compiled, text, lower_s, compile_s) from a built program's blob."""
    from jax.experimental.serialize_executable import deserialize_and_load
    payload, in_tree, out_tree, text, lower_s, compile_s = pickle.loads(blob)
    return deserialize_and_load(payload, in_tree, out_tree), text, lower_s, compile_s


# ----- the process ----------------------------------------------------------------------------

class NotCached(BaseException):
    """A program jax's persistent cache does not hold: the run compiles it. (Not an Exception:
    jax takes a failed cache read for a miss and compiles, which this must stop.)"""


class _Cached:
    """The executables this process reads from jax's persistent cache, each with the bytes it
    was read from: it is handed over as those bytes, as jax's cache hands it over to a run.
    Serialized again, an executable loaded from the cache loses its code on CPUs ("Function
    transpose_copy_fusion.6 not found" when the run ran it, jax 0.10.2). A program the cache
    does not hold is not compiled here (NotCached): on a GPU, XLA's autotuning would take
    device memory beside the run's, outside every share (harness.engine.workers.shares)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._read: dict[int, tuple] = {}      # id -> (executable, the bytes it was read from)

    def watch(self) -> bool:
        """Wraps jax's cache read (this process only); False where jax has no such function."""
        from jax._src import compilation_cache as cc
        from jax._src.lib import xla_client as xc
        if not hasattr(cc, "get_executable_and_time"):
            return False
        read, seen = cc.get_executable_and_time, self

        class Reading:   # the backend, remembering what it deserializes
            def __init__(self, backend):
                self._backend = backend

            def __getattr__(self, name):
                return getattr(self._backend, name)

            def deserialize_executable(self, serialized, *args, **kwargs):
                executable = self._backend.deserialize_executable(serialized, *args, **kwargs)
                with seen._lock:
                    seen._read[id(executable)] = (executable, bytes(serialized))
                return executable

        def get_executable_and_time(*args, **kwargs):
            # Its arguments differ between jax versions (four in 0.10.2, five in 0.11.2): the
            # backend is the one that is a client. Anything unexpected is NotCached too: an
            # Exception here jax would take for a miss, and compile.
            try:
                args = [Reading(a) if isinstance(a, xc.Client) else a for a in args]
                kwargs = {k: Reading(a) if isinstance(a, xc.Client) else a
                          for k, a in kwargs.items()}
                executable, seconds = read(*args, **kwargs)
            except Exception as exc:
                raise NotCached(f"{type(exc).__name__}: {exc}") from exc
            if executable is None:
                raise NotCached("not in the cache")
            return executable, seconds
        cc.get_executable_and_time = get_executable_and_time
        return True

    def persistent_id(self, obj):
        """('exec', bytes) for an executable read from the cache; None for what is not an
        executable; a LookupError for one that was not read from the cache."""
        from jax._src.lib import xla_client as xc
        if not isinstance(obj, xc.LoadedExecutable):
            return None
        with self._lock:
            read = self._read.pop(id(obj), None)
        if read is not None and read[0] is obj:
            return "exec", read[1]
        raise LookupError("an executable not read from jax's cache")


def _serialize(compiled, executables: _Cached):
    """jax.experimental.serialize_executable.serialize, each executable in it handed over as
    `executables` says."""
    from jax.experimental import serialize_executable as se

    class Pickler(se._JaxPjrtPickler):
        def persistent_id(self, obj):
            return executables.persistent_id(obj) or super().persistent_id(obj)
    with _SERIALIZING:   # jax's serialize picks its pickler up by name
        original, se._JaxPjrtPickler = se._JaxPjrtPickler, Pickler
        try:
            return se.serialize(compiled)
        finally:
            se._JaxPjrtPickler = original

def _serve(receive: Connection, send: Connection) -> None:
    from concurrent.futures import Future

    from harness.engine.compilation_cache import cache_stats, enable_compilation_cache
    from harness.engine.options import RunOptions
    from harness.engine.programs import Program, Programs, Timing, _markers
    from harness.engine.registry import all_kernels, load_kernel_module, mark_absl_flags_parsed
    from harness.model.case import Case

    options = RunOptions.from_json(receive.recv())
    mark_absl_flags_parsed()
    for path in options.kernel_modules:
        load_kernel_module(path)
    enable_compilation_cache(options.cache_dir)
    programs = Programs(deterministic_probe=options.deterministic_probe)
    programs.poisons_unwritten = False   # the run's process fills its blocks, not this one
    kernels = all_kernels()
    lock = threading.Lock()
    executables = _Cached()
    watching = executables.watch()

    def answer(token: int, program: Program, done: Future) -> None:
        kind, payload = "failed", None
        if done.exception() is None:
            with contextlib.suppress(Exception):   # not serializable: built in the run
                executable, in_tree, out_tree = _serialize(done.result(), executables)
                payload = pickle.dumps((executable, in_tree, out_tree, program.text,
                                        program.timing.lower_s, program.timing.compile_s))
                kind = "built"
        with lock:
            send.send((kind, token, payload, cache_stats()))

    while True:
        message = receive.recv()
        if message is None:
            return
        kind, token, *what = message
        try:
            if not watching:
                raise LookupError("jax's cache read is not where this process looks for it")
            if kind == "kernel":
                name, case_id, mode = what
                kernel, case = kernels[name], Case.from_id(case_id)
                program = Program(name, _markers(kernel, mode), Timing(), mode)
                programs._tracer.submit(programs._build_kernel, program, kernel, case)
            else:
                case_id, truth, convention, mode = what
                program = Program("oracle", (), Timing(), mode, oracle=True)
                programs._tracer.submit(programs._build_oracle, program, Case.from_id(case_id),
                                        truth, convention)
        except Exception:
            with lock:
                send.send(("failed", token, None, cache_stats()))
            continue
        program.compiled.add_done_callback(
            lambda done, token=token, program=program: answer(token, program, done))


def main(argv: list[str]) -> int:
    receive = Connection(int(argv[0]), writable=False)
    send = Connection(int(argv[1]), readable=False)
    try:
        _serve(receive, send)
    except (EOFError, OSError, KeyboardInterrupt):
        pass
    # Builds still under way are not waited for: the run has ended or let go of them.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
