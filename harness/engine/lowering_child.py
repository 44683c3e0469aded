"""The lowering process itself (`python -m harness.engine.lowering_child READ_FD WRITE_FD`,
started by harness.engine.lowering_process.LoweringProcess, which says what it is for): it
traces and lowers what the run asks for with harness.engine.programs.Programs, reads each
program from jax's cache, never compiles, and answers with the bytes jax read."""
from __future__ import annotations

import contextlib
import pickle
import queue
import sys
import threading
from multiprocessing.connection import Connection

from harness.engine.lowering_process import (
    BAD_REQUEST,
    BUILD_FAILED,
    CACHE_READ_FAILED,
    COMPILE_IN_TRACE,
    NO_CACHE_LOOKUP,
    NOT_IN_CACHE,
    NOT_SERIALIZABLE,
    UNKNOWN_KERNEL,
    dump_lowered,
    kernel_fingerprint,
)

_SERIALIZING = threading.Lock()


class NotCached(BaseException):
    """A program jax's persistent cache does not hold: the run compiles it. (Not an Exception:
    jax takes a failed cache read for a miss and compiles, which this must stop.)"""


def why_not_built(exc: BaseException, in_trace: bool = False) -> str:
    """The reason a program whose build ended in `exc` (`in_trace`: raised by the kernel's
    trace, not by the program's own compile) is not handed over."""
    if not isinstance(exc, NotCached):
        return BUILD_FAILED
    if in_trace:   # at a83ae73 the H200's warm runs listed 34 such programs as "not in the cache"
        return COMPILE_IN_TRACE
    return str(exc) if str(exc) in (NOT_IN_CACHE, NO_CACHE_LOOKUP) else CACHE_READ_FAILED


class _Cached:
    """The executables this process reads from jax's persistent cache, each with the bytes it
    was read from: it is handed over as those bytes, as jax's cache hands it over to a run.
    Serialized again, an executable loaded from the cache loses its code on CPUs ("Function
    transpose_copy_fusion.6 not found" when the run ran it, jax 0.10.2). A program the cache
    does not hold is not compiled here (NotCached): on a GPU, XLA's autotuning would take
    device memory beside the run's, outside every share (harness.engine.device_shares.shares)."""

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
                raise NotCached(NOT_IN_CACHE)
            return executable, seconds

        def backend_compile_and_load(*args, **kwargs):
            raise NotCached(NO_CACHE_LOOKUP)
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


def trace_error_blob(exc: BaseException, lower_s: float) -> bytes | None:
    """(exc, lower_s) pickled with exc's traceback and chain (tblib): the run raises it as
    the kernel's own error, its frames those of this process's trace, which ran the same code
    (harness.engine.lowering_process.load_raised). None where it does not come back from
    pickle as itself (the run traces the kernel again)."""
    try:
        from tblib import pickling_support
        pickling_support.install(exc)
        blob = pickle.dumps((exc, lower_s))
        back, _ = pickle.loads(blob)
    except Exception:
        return None
    return blob if type(back) is type(exc) and str(back) == str(exc) else None


def _executables(compiled) -> list:
    executable = getattr(getattr(compiled, "_executable", None), "xla_executable", None)
    return [executable] if executable is not None else []


def _serve(receive: Connection, send: Connection) -> None:
    from concurrent.futures import Future

    from harness.engine.compilation_cache import enable_compilation_cache
    from harness.engine.options import RunOptions
    from harness.engine.program_functions import DEFAULT
    from harness.engine.program import Program, Timing
    from harness.engine.programs import Programs, _markers
    from harness.engine.registry import all_kernels, load_kernel_module, mark_absl_flags_parsed
    from harness.judge import judging
    from harness.model.case import Case

    options = RunOptions.from_json(receive.recv())
    mark_absl_flags_parsed()
    for path in options.kernel_modules:
        load_kernel_module(path)
    enable_compilation_cache(options.cache_dir)
    # Questions kernels' traces ask of this jax (the op's GQA path: asked op by op inside a
    # trace, each op a compile), answered once before this process refuses to compile: else
    # those traces fail here unless the run happened to cache the same ops (at a83ae73 it had
    # not: 34 programs built by the run on the H200's warm nightly).
    from harness.engine.environment import gqa_offsets_bug
    gqa_offsets_bug()
    executables = _Cached()
    if not executables.watch():
        return    # jax's cache is not where this looks for it: the run builds everything
    # Each program's lowering, until it is answered: one the cache lacks goes to the run as
    # lowered here (the run compiles it, not tracing it again).
    lowerings: dict[int, object] = {}

    class Keeping(Programs):
        def _submit(self, program, lowered, options):
            lowerings[id(program)] = lowered
            super()._submit(program, lowered, options)

    programs = Keeping(deterministic_probe=options.deterministic_probe)
    programs.poisons_unwritten = False   # the run's process fills its blocks, not this one
    kernels = all_kernels()
    outbox: queue.SimpleQueue = queue.SimpleQueue()

    def send_all():   # answers in the order given; this process's reading never waits on them
        with contextlib.suppress(OSError, ValueError):
            while True:
                send.send(outbox.get())
    threading.Thread(target=send_all, name="lowering-answers", daemon=True).start()

    def answer(token: int, program: Program, done: Future, kernel=None, case=None) -> None:
        # ("built", token, blob), ("raised", token, blob): the kernel's trace error,
        # ("lowered", token, blob): lowered here, not in the cache (the run compiles it), or
        # ("failed", token, why): the run builds it
        exc = done.exception()
        lowered = lowerings.pop(id(program), None)
        if lowered is not None and why_not_built(exc, program.trace_error is exc) == NOT_IN_CACHE:
            try:
                outbox.put(("lowered", token, dump_lowered(lowered, program.text,
                                                           program.timing.lower_s)))
                return
            except Exception:   # noqa: BLE001 - a piece that does not pickle: built in the run
                pass
        if exc is not None:
            blob = None
            try:   # every request is answered, whatever this raises
                if kernel is not None and program.trace_error is exc and \
                        judging.trace_error_settles(kernel, case, exc,
                                                    refusals=program.mode == DEFAULT):
                    blob = trace_error_blob(exc, program.timing.lower_s)
            except BaseException:   # noqa: BLE001 - then the run traces it again
                blob = None
            outbox.put(("raised", token, blob) if blob is not None else
                       ("failed", token, why_not_built(exc, program.trace_error is exc)))
            return
        try:
            executable, in_tree, out_tree, devices = executables.serialize(done.result())
            payload = pickle.dumps((executable, in_tree, out_tree, devices, program.text,
                                    program.timing.lower_s, program.timing.compile_s))
        except Exception:   # not serializable: built in the run
            with contextlib.suppress(Exception):
                executables.forget(done.result())
            outbox.put(("failed", token, NOT_SERIALIZABLE))
            return
        outbox.put(("built", token, payload))

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
                pair = (kernel, case)
                programs._tracer.submit(programs._build_kernel, program, kernel, case)
            else:
                case_id, truth, convention, mode = what
                program = Program("oracle", (), Timing(), mode, oracle=True)
                pair = (None, None)
                programs._tracer.submit(programs._build_oracle, program, Case.from_id(case_id),
                                        truth, convention)
        except LookupError:   # a kernel this process does not have under that name
            outbox.put(("failed", token, UNKNOWN_KERNEL))
            continue
        except Exception:
            outbox.put(("failed", token, BAD_REQUEST))
            continue
        program.compiled.add_done_callback(
            lambda done, token=token, program=program, pair=pair:
            answer(token, program, done, *pair))


def main(argv: list[str]) -> int:
    receive = Connection(int(argv[0]), writable=False)
    send = Connection(int(argv[1]), readable=False)
    try:
        _serve(receive, send)
    except (EOFError, OSError, KeyboardInterrupt):
        pass
    # Builds still under way are not waited for: the run has ended or let go of them (this
    # process writes nothing to jax's cache: its compiler refuses).
    from harness.process_end import end_process
    end_process(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
