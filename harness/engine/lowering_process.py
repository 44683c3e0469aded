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
everything once the process is gone. The process never compiles: jax's compiler is wrapped
there to refuse (NotCached), as is a cache read that fails in any way. A handed-over program is
loaded on the devices jax read it for, and is offered only for a kernel the process has under
the same name and function (`kernel_fingerprint`). The run's header counts both
(`lowering_process` in its `compilation_cache`; the process's hits are the programs it handed
over). Each side sends from a thread of its own, so neither waits on a full pipe while the
other waits on it. `--no-lowering-process` builds everything in the run's process.

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
from multiprocessing.connection import Connection

NO_PREALLOCATION = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
STOP_WAIT_S = 5.0
_SERIALIZING = threading.Lock()
_NAMES = itertools.count()


def child_environment(environ=os.environ) -> dict:
    """The process's environment: the run's (a kernel's trace may read any of it, its share
    of device memory included), except that it takes device memory as it needs it, never
    three quarters at start."""
    return {**environ, **NO_PREALLOCATION}


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
        self._name = next(_NAMES)   # its cache counts' key (harness.engine.compilation_cache)
        self._proc: subprocess.Popen | None = None
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._gone = False
        # Taken now: a later copy could catch a trace's temporary setting (traced_under).
        self._environment = child_environment()

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
                [sys.executable, "-m", __name__, str(to_child_r), str(from_child_w)],
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
        """Sends what `request` queued, in order; None (close) ends it and the process."""
        try:
            while (message := self._outbox.get()) is not None:
                conn.send(message)
        except (OSError, ValueError):
            pass   # the process is gone: its reader answers for what is pending
        finally:
            conn.close()   # the process reads the end of its input and ends

    def _receive(self, conn: Connection) -> None:
        from harness.engine.compilation_cache import count_elsewhere
        try:
            while True:
                kind, token, payload, counts = conn.recv()
                with self._lock:
                    program = self._pending.pop(token, None)
                count_elsewhere(self._name, counts)
                if program is not None:
                    self._answer(program, payload if kind == "built" else None)
        except (EOFError, OSError):
            pass
        finally:
            conn.close()
            with self._lock:
                self._gone = True
                left, self._pending = list(self._pending.values()), {}
            for program in left:
                self._answer(program, None)

    def _answer(self, program, payload: bytes | None) -> None:
        try:
            if payload is not None:
                self._built(program, payload)
                return
        except Exception:
            pass
        self._failed(program)

    def close(self) -> None:
        with self._lock:
            self._gone = True
            proc = self._proc
        self._outbox.put(None)
        if proc is not None:
            try:
                proc.wait(STOP_WAIT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


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
        # id -> (executable, the bytes it was read from, the ids of the devices it was read for)
        self._read: dict[int, tuple] = {}

    def watch(self) -> bool:
        """Wraps jax's cache read, and its compiler so that it never compiles (this process
        only); False where jax has no such functions."""
        from jax._src import compilation_cache as cc
        from jax._src import compiler
        from jax._src.lib import xla_client as xc
        if not (hasattr(cc, "get_executable_and_time")
                and hasattr(compiler, "backend_compile_and_load")):
            return False
        read, seen = cc.get_executable_and_time, self
        devices = threading.local()

        class Reading:   # the backend, remembering what it deserializes
            def __init__(self, backend):
                self._backend = backend

            def __getattr__(self, name):
                return getattr(self._backend, name)

            def deserialize_executable(self, serialized, *args, **kwargs):
                executable = self._backend.deserialize_executable(serialized, *args, **kwargs)
                with seen._lock:
                    seen._read[id(executable)] = (executable, bytes(serialized), devices.ids)
                return executable

        def get_executable_and_time(*args, **kwargs):
            # Its arguments differ between jax versions (four in 0.10.2, five in 0.11.2): the
            # backend is the one that is a client. Anything unexpected is NotCached too: an
            # Exception here jax would take for a miss, and compile.
            try:
                given = [*args, *kwargs.values()]
                lists = [a for a in given if isinstance(a, xc.DeviceList)]
                devices.ids = [d.id for d in lists[0]] if len(lists) == 1 else None
                args = [Reading(a) if isinstance(a, xc.Client) else a for a in args]
                kwargs = {k: Reading(a) if isinstance(a, xc.Client) else a
                          for k, a in kwargs.items()}
                executable, seconds = read(*args, **kwargs)
            except Exception as exc:
                raise NotCached(f"{type(exc).__name__}: {exc}") from exc
            if executable is None:
                raise NotCached("not in the cache")
            return executable, seconds
        def backend_compile_and_load(*args, **kwargs):
            raise NotCached("not compiled here")   # a program jax looks up in no cache
        cc.get_executable_and_time = get_executable_and_time
        compiler.backend_compile_and_load = backend_compile_and_load
        return True

    def forget(self, compiled) -> None:
        """Lets go of what was kept for a program not handed over."""
        with self._lock:
            for key in [k for k, v in self._read.items() if v[0] in _executables(compiled)]:
                del self._read[key]

    def serialize(self, compiled) -> tuple:
        """(payload, in_tree, out_tree, device ids): jax.experimental.serialize_executable
        .serialize with its executable as the bytes it was read from, and the devices it was
        read for; a LookupError for a program with an executable not read from the cache."""
        from jax.experimental import serialize_executable as se
        from jax._src.lib import xla_client as xc
        used = []

        class Pickler(se._JaxPjrtPickler):
            def persistent_id(self, obj):
                if not isinstance(obj, xc.LoadedExecutable):
                    return super().persistent_id(obj)
                with seen._lock:
                    read = seen._read.pop(id(obj), None)
                if read is None or read[0] is not obj or read[2] is None:
                    raise LookupError("an executable not read from jax's cache")
                used.append(read[2])
                return "exec", read[1]
        seen = self
        with _SERIALIZING:   # jax's serialize picks its pickler up by name
            original, se._JaxPjrtPickler = se._JaxPjrtPickler, Pickler
            try:
                payload, in_tree, out_tree = se.serialize(compiled)
            finally:
                se._JaxPjrtPickler = original
        if len(used) != 1:
            raise LookupError(f"{len(used)} executables in one program")
        return payload, in_tree, out_tree, used[0]


def _executables(compiled) -> list:
    executable = getattr(getattr(compiled, "_executable", None), "xla_executable", None)
    return [executable] if executable is not None else []

def kernel_fingerprint(kernel) -> str:
    """What names a kernel's function across processes: its module and qualified name (and a
    partial's arguments), so that the process builds the kernel the run has under that name."""
    fn, more = kernel.fn, ""
    if isinstance(fn, functools.partial):
        fn, more = fn.func, f"{fn.args!r}{sorted(fn.keywords.items())!r}"
    return f"{getattr(fn, '__module__', None)}:{getattr(fn, '__qualname__', type(fn).__name__)}" \
        f"{more}"


def _serve(receive: Connection, send: Connection) -> None:
    from concurrent.futures import Future

    from harness.engine.compilation_cache import enable_compilation_cache
    from harness.engine.options import RunOptions
    from harness.engine.programs import Program, Programs, Timing, _markers
    from harness.engine.registry import all_kernels, load_kernel_module, mark_absl_flags_parsed
    from harness.model.case import Case

    options = RunOptions.from_json(receive.recv())
    mark_absl_flags_parsed()
    for path in options.kernel_modules:
        load_kernel_module(path)
    enable_compilation_cache(options.cache_dir)
    executables = _Cached()
    if not executables.watch():
        return    # jax's cache is not where this looks for it: the run builds everything
    programs = Programs(deterministic_probe=options.deterministic_probe)
    programs.poisons_unwritten = False   # the run's process fills its blocks, not this one
    kernels = all_kernels()
    outbox: queue.SimpleQueue = queue.SimpleQueue()

    def send_all():   # answers in the order given; this process's reading never waits on them
        with contextlib.suppress(OSError, ValueError):
            while True:
                send.send(outbox.get())
    threading.Thread(target=send_all, name="lowering-answers", daemon=True).start()

    counts = {"hits": 0}   # programs read from the cache and handed over (it compiles none)
    counting = threading.Lock()

    def answer(token: int, program: Program, done: Future) -> None:
        kind, payload = "failed", None
        if done.exception() is None:
            try:
                executable, in_tree, out_tree, devices = executables.serialize(done.result())
                payload = pickle.dumps((executable, in_tree, out_tree, devices, program.text,
                                        program.timing.lower_s, program.timing.compile_s))
                kind = "built"
            except Exception:   # not serializable: built in the run
                with contextlib.suppress(Exception):
                    executables.forget(done.result())
        with counting:   # counted and queued together: the last answer has the total
            counts["hits"] += kind == "built"
            outbox.put((kind, token, payload, dict(counts)))

    while True:
        message = receive.recv()
        if message is None:
            return
        kind, token, *what = message
        try:
            if kind == "kernel":
                name, fingerprint, case_id, mode = what
                kernel, case = kernels[name], Case.from_id(case_id)
                if kernel_fingerprint(kernel) != fingerprint:
                    raise LookupError(f"{name}: another function under that name here")
                program = Program(name, _markers(kernel, mode), Timing(), mode)
                programs._tracer.submit(programs._build_kernel, program, kernel, case)
            else:
                case_id, truth, convention, mode = what
                program = Program("oracle", (), Timing(), mode, oracle=True)
                programs._tracer.submit(programs._build_oracle, program, Case.from_id(case_id),
                                        truth, convention)
        except Exception:
            with counting:
                outbox.put(("failed", token, None, dict(counts)))
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
