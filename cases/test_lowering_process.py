"""The lowering process (harness.engine.lowering_process): the programs it builds compute what
programs built in the run's own process compute, cold and from jax's cache; whatever it cannot
hand over is built by the run, whose own error it then raises; the header counts both."""
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from harness.engine import lowering_process, registry
from harness.engine.compilation_cache import cache_stats, count_handed_over
from harness.engine.lowering_child import trace_error_blob
from harness.engine.lowering_process import (
    BUILD_FAILED,
    LOAD_FAILED,
    NOT_IN_CACHE,
    COMPILE_IN_TRACE,
    PROCESS_GONE,
    LoweringProcess,
    LoweringProcesses,
    child_environment,
    load_raised,
    processes_for,
)
from harness.engine.options import RunOptions
from harness.engine.environment import current_platform
from harness.engine.program import Program, Timing
from harness.engine.programs import Programs, for_run
from harness.engine.runner import run_kernel_case
from harness.judge.vocabulary import ERROR, KNOWN, REFUSED
from harness.kernels.kernel import Kernel
from harness.kernels.reference import dot_product
from harness.model.case import Case, make_inputs
from harness.model.features import Features
from harness.store.merge import merge_cache
from harness.views.markdown import timing_lines

ROOT = Path(__file__).resolve().parents[1]
CASE = Case("packed/many", 2, 64, 2, 1, 16, "float32", 3)
OTHER = Case("packed/many", 2, 32, 2, 1, 16, "float32", 4)


WARM = """
import sys
from harness.engine.compilation_cache import enable_compilation_cache
from harness.engine.programs import Programs
from harness.engine.registry import all_kernels, load_kernel_module
from harness.model.case import Case
cache, kernel, modules, cases = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
enable_compilation_cache(cache)
for module in filter(None, [modules]):
    load_kernel_module(module)
programs = Programs()
programs.prefetch([(all_kernels()[kernel], Case.from_id(c)) for c in cases])
for program in list(programs._programs.values()):
    program.compiled.exception()
"""


def _warm(tmp_path, kernel: str, cases, module: str = "") -> None:
    """jax's cache in tmp_path/cache filled with the programs of `kernel` on `cases`, by
    another process (as an earlier run fills it)."""
    subprocess.run([sys.executable, "-c", WARM, str(tmp_path / "cache"), kernel, module,
                    *(c.id for c in cases)], cwd=ROOT, check=True, timeout=300)


def _apart(tmp_path, processes: int = 1, **options) -> Programs:
    opts = RunOptions(compilation_cache=str(tmp_path / "cache"), **options)
    return for_run(opts, lowering_processes=processes)


def _counts() -> dict:
    return {"loaded": 0, "lowered": 0, "trace_errors": 0, "built_here": 0,
            **cache_stats().get("lowering_process", {})}


def _why_since(before: dict) -> dict:
    """The programs built here since `before` (_counts), by reason."""
    def totals(counts):
        return {why: sum(names.values()) for why, names in counts.get("why", {}).items()}
    then, now = totals(before), totals(_counts())
    return {why: n - then.get(why, 0) for why, n in now.items() if n > then.get(why, 0)}


def _outputs(programs, kernel, case):
    return [np.asarray(x) for x in programs.get(kernel, case)(*make_inputs(case).device_args)]


def test_handed_over_programs_compute_what_the_run_builds_cold_and_from_the_cache(tmp_path,
                                                                                   monkeypatch):
    kernel = registry.all_kernels()["xla"]
    here = Programs()
    want = _outputs(here, kernel, CASE)
    truth_here = here.oracle(CASE, True)(*make_inputs(CASE).device_args)
    here.close()
    for run in ("cold", "warm"):
        # cold: the cache holds none, the process lowers them and the run compiles those
        # lowerings; warm: the process reads them from
        # the cache and hands them over as read (serialized again, such a program lost its
        # code on CPUs: "Function transpose_copy_fusion.6 not found" when run here)
        if run == "warm":
            _warm(tmp_path, "xla", [CASE, OTHER])
        before, hits = _counts(), cache_stats()["hits"]
        # Two processes, both open from the first request: each shape's programs (the kernel's
        # and the oracle's) go to one of them.
        monkeypatch.setattr(lowering_process, "OPEN_AFTER", 1)
        programs = _apart(tmp_path, processes=2)
        try:
            programs.prefetch([(kernel, CASE), (kernel, OTHER)])
            got = _outputs(programs, kernel, CASE)
            truth = programs.oracle(CASE, True)(*make_inputs(CASE).device_args)
            assert all(p._proc is not None for p in programs._apart.processes), run
            wanted = [p.compiled for p in programs._programs.values()]
            assert len(wanted) >= 3     # the kernel's default build, the two oracles
            for done in wanted:
                done.result(timeout=120)
        finally:
            programs.close()
        # Both processes reaped with their own CPU seconds (importing jax alone takes some).
        assert all(p.cpu_s > 0.1 for p in programs._apart.processes), run
        assert programs.lowering_cpu_s == programs._apart.cpu_s, run
        after = _counts()
        loaded = after["loaded"] - before["loaded"]
        lowered = after["lowered"] - before["lowered"]
        built_here = after["built_here"] - before["built_here"]
        assert loaded + lowered + built_here == len(wanted), run
        if run == "cold":
            # the cache held none: the process lowered them, the run compiled what it lowered
            # (and wrote it to the cache), tracing none of them again
            assert lowered == len(wanted) and built_here == 0 and _why_since(before) == {}
        else:
            assert loaded == len(wanted), "the process read every one from the cache"
            assert cache_stats()["hits"] - hits >= len(wanted)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(a, b)
        for a, b in zip(truth, truth_here, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_kernel_not_the_registrys_under_its_name_is_built_here(tmp_path):
    programs = _apart(tmp_path)
    kernel = Kernel("xla", dot_product)    # the name of a registered kernel, another function
    before = _counts()
    try:
        programs.prefetch([(kernel, OTHER)])
        got = _outputs(programs, kernel, OTHER)
        oracles = [p for p in programs._programs.values() if p.oracle]
        for p in oracles:
            p.compiled.result(timeout=120)
    finally:
        programs.close()
    here = Programs()
    np.testing.assert_array_equal(got[0], _outputs(here, kernel, OTHER)[0])
    here.close()
    # only the oracle's programs went to the process (and came back lowered: the cache is
    # empty); the kernel's were never offered, the run built them
    assert _counts()["lowered"] - before["lowered"] == len(oracles) == 2
    assert _counts()["built_here"] == before["built_here"] and _why_since(before) == {}


BREAKS = textwrap.dedent("""
    import harness
    from harness.kernels.reference import dot_product

    def breaks_when_traced(q, k, v, seg, **kw):
        raise ValueError("lp-test: this kernel refuses to be traced")

    harness.register_kernel("lp_breaks", breaks_when_traced, dtypes=("float32",))
    harness.register_kernel("lp_plain", dot_product, dtypes=("float32",))

    def refuses_the_window(q, k, v, seg, *, window=None, **kw):
        if window is not None:
            raise NotImplementedError(f"lp-test: no sliding window here, asked for {window}")
        return dot_product(q, k, v, seg, **kw)

    def crashes_as_declared(q, k, v, seg, **kw):
        try:
            {}["lp-test"]
        except KeyError as exc:
            raise RuntimeError("lp-test: the declared crash") from exc

    harness.register_kernel("lp_refuses", refuses_the_window, dtypes=("float32",),
                            features=("window",))
    harness.register_kernel("lp_crashes", crashes_as_declared, dtypes=("float32",),
                            expect_error="lp-test: the declared crash")

    def asks_while_traced(q, k, v, seg, **kw):
        import os
        import jax
        import jax.numpy as jnp
        # A question answered op by op inside the trace (as the op's GQA-offsets question
        # was), of a size the test sets: each op a compile of its own.
        with jax.ensure_compile_time_eval():
            n = int(jnp.arange(int(os.environ.get("LP_EAGER", "3"))).sum())
        return dot_product(q, k, v, seg, **kw) if n >= 0 else None

    harness.register_kernel("lp_eager", asks_while_traced, dtypes=("float32",))

    def asks_the_gqa_question_while_traced(q, k, v, seg, **kw):
        from harness.sut import lowering
        lowering.upstream_gqa_offsets_wrong()      # as the op's cuDNN GQA path does
        return dot_product(q, k, v, seg, **kw)

    harness.register_kernel("lp_gqa", asks_the_gqa_question_while_traced, dtypes=("float32",))
""")


@pytest.fixture
def user_kernels(tmp_path):
    module = tmp_path / "lp_kernels.py"
    module.write_text(BREAKS)
    registry.load_kernel_module(module)
    try:
        yield str(module)
    finally:
        for name in ("lp_breaks", "lp_plain", "lp_refuses", "lp_crashes", "lp_eager", "lp_gqa"):
            registry._USER.pop(name, None)


def test_a_kernel_that_fails_in_the_process_fails_here_with_its_own_error(tmp_path,
                                                                          user_kernels):
    programs = _apart(tmp_path, kernel_modules=(user_kernels,))
    kernel = registry.all_kernels()["lp_breaks"]
    before = _counts()
    try:
        programs.prefetch([(kernel, CASE)])
        program = programs.get(kernel, CASE)
        error = program.compiled.exception(timeout=120)
        offered = list(programs._programs.values())
        for p in offered:
            p.compiled.exception(timeout=120)
    finally:
        programs.close()
    assert isinstance(error, ValueError) and "refuses to be traced" in str(error)
    assert program.trace_error is error, "traced here: the run's refusal rule sees it"
    # every program was offered (the kernel's too): the kernel's came back to be built here,
    # the oracle's lowered (the cache is empty: the run compiled them)
    kernels = sum(1 for p in offered if not p.oracle)
    assert kernels >= 1
    assert _counts()["built_here"] - before["built_here"] == kernels
    assert _counts()["lowered"] - before["lowered"] == len(offered) - kernels
    assert _why_since(before) == {BUILD_FAILED: kernels}


WINDOWED = Case("packed/many", 2, 64, 2, 1, 16, "float32", 3, features=Features(window=(8, 0)))


def test_a_refusal_or_a_declared_crash_comes_back_from_the_process_as_the_kernels_own(
        tmp_path, user_kernels):
    """A trace error that decides its pair without an error verdict is raised from the
    process's trace, not traced again: the records are those of a run that traced it itself,
    the traceback's frames the kernel's, and the header counts it."""
    kernels = registry.all_kernels()
    pairs = [(kernels["lp_refuses"], WINDOWED), (kernels["lp_crashes"], CASE),
             (kernels["lp_breaks"], CASE)]
    platform = current_platform()
    before = _counts()
    programs = _apart(tmp_path, kernel_modules=(user_kernels,))
    try:
        programs.prefetch(pairs, probe=False)
        # What the process was offered (the refusing kernel's forward alone is traced by the
        # run itself, after: harness.engine.refusal)
        offered = list(programs._programs.values())
        apart = [run_kernel_case(k, c, platform, programs, leak=False).records for k, c in pairs]
    finally:
        programs.close()
    here = Programs()
    try:
        mine = [run_kernel_case(k, c, platform, here, leak=False).records for k, c in pairs]
    finally:
        here.close()
    assert [[r.outcome for r in rs] for rs in apart] == [[REFUSED], [KNOWN], [ERROR]]
    for got, want in zip(apart, mine, strict=True):
        assert [r.to_json() for r in got] == [r.to_json() for r in want]
    # the declared crash's traceback ends in the kernel's frame, its cause's too
    assert 'in crashes_as_declared\n    raise RuntimeError("lp-test: the declared crash")' \
        in apart[1][0].traceback
    assert "KeyError: 'lp-test'" in apart[1][0].traceback
    # two handed over (the refusal and the crash); the other error was traced again here
    assert _counts()["trace_errors"] - before["trace_errors"] == 2
    kernel_programs = sum(1 for p in offered if not p.oracle)
    assert _why_since(before) == {BUILD_FAILED: kernel_programs - 2}
    assert _counts()["lowered"] - before["lowered"] == len(offered) - kernel_programs


def test_a_trace_error_that_cannot_make_the_trip_is_traced_again_in_the_run():
    """The process sends no error that does not come back from pickle as itself, and the run
    traces a kernel again where it cannot read the error it was sent."""
    class Local(Exception):   # a class defined in a function: pickle cannot name it
        pass
    assert trace_error_blob(Local("lp-test: no window"), 0.1) is None
    try:
        raise ValueError("lp-test: no window")
    except ValueError as exc:
        raised, seconds = load_raised(trace_error_blob(exc, 0.25))
    assert (type(raised), str(raised), seconds) == (ValueError, "lp-test: no window", 0.25)
    assert raised.__traceback__ is not None
    programs = Programs()
    program, traced_here, before = Program("lp_test", (), Timing()), [], _counts()
    try:
        programs._raised_apart((program, lambda: traced_here.append(True)), b"not a pickle")
    finally:
        programs.close()
    assert traced_here == [True] and not program.compiled.done()
    assert _why_since(before) == {LOAD_FAILED: 1}
    assert _counts()["trace_errors"] == before["trace_errors"]


def test_programs_pending_when_the_process_dies_are_built_here(tmp_path, user_kernels):
    kernel = registry.all_kernels()["lp_plain"]
    _warm(tmp_path, "lp_plain", [CASE, OTHER], user_kernels)
    programs = _apart(tmp_path, kernel_modules=(user_kernels,))
    before = _counts()
    try:
        programs.prefetch([(kernel, CASE)])
        programs.get(kernel, CASE).compiled.result(timeout=120)
        first = len(programs._programs)
        assert _counts()["loaded"] - before["loaded"] == first
        process = programs._apart.processes[0]._proc
        os.kill(process.pid, signal.SIGSTOP)
        programs.prefetch([(kernel, OTHER)])          # pending: the process cannot answer
        pending = len(programs._programs) - first
        assert pending > 0 and not programs.get(kernel, OTHER).compiled.done()
        os.kill(process.pid, signal.SIGKILL)
        process.wait()
        got = _outputs(programs, kernel, OTHER)
        for p in programs._programs.values():
            p.compiled.result(timeout=120)
        programs.prefetch([(kernel, Case("packed/many", 2, 16, 2, 1, 16, "float32", 5))])
        later = len(programs._programs) - first - pending   # asked for after it died
        for p in programs._programs.values():
            p.compiled.result(timeout=120)
    finally:
        programs.close()
    here = Programs()
    want = _outputs(here, kernel, OTHER)
    here.close()
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    assert _counts()["built_here"] - before["built_here"] == pending + later
    assert _why_since(before) == {PROCESS_GONE: pending + later}


def test_a_run_without_a_cache_or_with_no_lowering_process_builds_everything_here(tmp_path):
    for options in ({"lowering_process": False}, {"use_compilation_cache": False}):
        programs = _apart(tmp_path, **options)
        try:
            assert programs._apart is None, options
        finally:
            programs.close()


def test_the_process_has_the_runs_environment_but_takes_device_memory_as_it_needs_it():
    run = {"XLA_CLIENT_MEM_FRACTION": "0.3", "XLA_FLAGS": "--x", "PATH": "/bin"}
    assert child_environment(run) == {**run, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    assert child_environment({"XLA_PYTHON_CLIENT_PREALLOCATE": "true"}) == {
        "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}


def test_the_header_counts_what_the_process_handed_over_and_merges_add_them():
    merged = merge_cache([
        {"compilation_cache": {"dir": "c", "hits": 3, "misses": 1,
                               "lowering_process": {"loaded": 3, "lowered": 4,
                                                    "trace_errors": 2,
                                                    "built_here": 3, "why": {
                                   NOT_IN_CACHE: {"xla": 1, "oracle": 1},
                                   LOAD_FAILED: {"te:thd": 1}}}}},
        {"compilation_cache": {"dir": "c", "hits": 2, "misses": 0,
                               "lowering_process": {"loaded": 2, "built_here": 2, "why": {
                                   NOT_IN_CACHE: {"xla": 2}}}}},
        {"compilation_cache": {"dir": "c", "hits": 1, "misses": 0}}])
    assert merged["lowering_process"] == {
        "loaded": 5, "lowered": 4, "trace_errors": 2, "built_here": 5,
        "why": {NOT_IN_CACHE: {"oracle": 1, "xla": 3}, LOAD_FAILED: {"te:thd": 1}}}
    text = "\n".join(timing_lines({"timing": {"xla": {}}, "compilation_cache": merged}))
    assert "5 programs traced and lowered in a lowering process, read from the cache" in text
    assert "4 lowered there that the cache lacked, compiled by the run (not traced again)" \
        in text
    assert "2 programs whose kernel's trace failed there handed over as that error" in text
    assert "5 built by the run after that process could not hand them over" in text
    # a line per reason, the most programs first, its kernels the most first
    assert f"- {NOT_IN_CACHE}: 4 (xla 3, oracle 1)\n- {LOAD_FAILED}: 1 (te:thd 1)" in text


def test_a_program_loaded_from_the_process_counts_as_a_cache_hit_once(monkeypatch):
    from collections import defaultdict

    from harness.engine import compilation_cache
    monkeypatch.setattr(compilation_cache, "_CACHE_EVENTS",
                        defaultdict(int, {"cache_hits": 4, "cache_misses": 1}))
    monkeypatch.setattr(compilation_cache, "_BUILT_HERE_WHY",
                        defaultdict(lambda: defaultdict(int)))
    count_handed_over(True, "xla")
    count_handed_over(True, "xla")
    count_handed_over(False, "xla", NOT_IN_CACHE)   # built here: its own lookup here counts
    stats = cache_stats()
    assert (stats["hits"], stats["misses"]) == (6, 1)
    assert stats["lowering_process"] == {"loaded": 2, "lowered": 0, "trace_errors": 0,
                                         "built_here": 1, "why": {NOT_IN_CACHE: {"xla": 1}}}


TWO_DEVICES = """
import sys
import numpy as np
from harness.engine.compilation_cache import cache_stats
from harness.engine.options import RunOptions
from harness.engine.programs import Programs, for_run
from harness.engine.registry import all_kernels
from harness.model.case import Case, make_inputs
import jax
assert len(jax.devices()) == 2
kernel, case = all_kernels()["xla"], Case.from_id(sys.argv[2])
apart = for_run(RunOptions(compilation_cache=sys.argv[1]))
apart.prefetch([(kernel, case)])
args = make_inputs(case).device_args
got = apart.get(kernel, case)(*args)
apart.close()
assert cache_stats()["lowering_process"]["loaded"] >= 1, cache_stats()
here = Programs()
want = here.get(kernel, case)(*args)
for a, b in zip(got, want, strict=True):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
print("same")
"""


def test_a_program_handed_over_runs_on_its_own_device_where_the_process_sees_two(tmp_path):
    """Loaded on every device the run sees, a one-device program failed when run ("Expected
    args to execute_sharded_on_local_devices to have 2 shards")."""
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=2",
           "JAX_PLATFORMS": "cpu"}
    subprocess.run([sys.executable, "-c", WARM, str(tmp_path / "cache"), "xla", "", CASE.id],
                   cwd=ROOT, check=True, timeout=300, env=env)
    out = subprocess.run([sys.executable, "-c", TWO_DEVICES, str(tmp_path / "cache"), CASE.id],
                         cwd=ROOT, capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and "same" in out.stdout, out.stderr[-3000:]


def _routed(pool, requests) -> list:
    """(index of the process, message) of each (route, message) requested of `pool`."""
    return [(pool._given[route], message) for route, message in requests
            if pool.request(object(), message, route)]


def test_a_route_keeps_its_process_and_a_new_route_goes_to_the_least_asked(monkeypatch):
    """A shape's programs are lowered in one process; new routes balance the processes'
    requests, once the second is open (OPEN_AFTER requests); a process that ended gets none."""
    monkeypatch.setattr(LoweringProcess, "request", lambda self, program, message: True)
    monkeypatch.setattr(lowering_process, "OPEN_AFTER", 1)
    pool = LoweringProcesses({}, None, None, None, count=2)
    assert _routed(pool, [("s1", 1), ("s1", 2), ("s2", 3), ("s3", 4), ("s2", 5), ("s4", 6)]) \
        == [(0, 1), (0, 2), (1, 3), (1, 4), (1, 5), (0, 6)]
    pool.processes[0]._gone = True          # ended: its routes and new ones go to the other
    assert _routed(pool, [("s1", 7), ("s5", 8), ("s6", 9)]) == [(1, 7), (1, 8), (1, 9)]
    # A worker with fewer requests than OPEN_AFTER (a FlashAttention group's) keeps one.
    monkeypatch.setattr(lowering_process, "OPEN_AFTER", 200)
    small = LoweringProcesses({}, None, None, None, count=2)
    assert {i for i, _ in _routed(small, [(f"s{n}", n) for n in range(199)])} == {0}
    assert _routed(small, [("s199", 199), ("s200", 200)]) == [(0, 199), (1, 200)]
    # One process where the run has fewer than 8 cores (CI's 2), two from 8, three from 12,
    # four from 16 (the H200 runner's).
    assert [processes_for(n) for n in (1, 2, 4, 7, 8, 11, 12, 15, 16, 64)] \
        == [1, 1, 1, 1, 2, 2, 3, 3, 4, 4]


def test_a_compile_its_trace_asks_for_that_the_cache_lacks_is_named_as_such(
        tmp_path, user_kernels, monkeypatch):
    """The process never compiles: where a kernel's trace compiles an op of its own (an
    eager question), and the cache lacks it, the trace fails there and the run builds the
    program itself; the header says why in those words, not "not in the cache" (the H200's
    warm runs at a83ae73: 34 programs)."""
    kernel = registry.all_kernels()["lp_eager"]
    _warm(tmp_path, "lp_eager", [CASE], user_kernels)          # its eager op at size 3
    monkeypatch.setenv("LP_EAGER", "5")                          # another op: not in the cache
    programs = _apart(tmp_path, kernel_modules=(user_kernels,))
    before = _counts()
    try:
        programs.prefetch([(kernel, CASE)])
        got = _outputs(programs, kernel, CASE)
        for p in programs._programs.values():
            p.compiled.result(timeout=120)
    finally:
        programs.close()
    here = Programs()
    want = _outputs(here, registry.all_kernels()["lp_plain"], CASE)
    here.close()
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    why = _why_since(before)
    assert why.get(COMPILE_IN_TRACE, 0) >= 1 and NOT_IN_CACHE not in why, why


def test_the_gqa_question_is_answered_before_the_process_refuses_to_compile(tmp_path,
                                                                            user_kernels):
    """The op's traces ask whether this jax has the GQA-offsets bug; a process that asked it
    outside any trace (the run's header: one compiled program) cached none of the ops the
    question evaluates inside a trace. The lowering process answers it before it refuses to
    compile, so such a trace is handed over from a cache filled that way (at a83ae73 the
    H200's warm runs built 34 programs themselves instead)."""
    kernel = registry.all_kernels()["lp_gqa"]
    asked_first = ("from harness.engine.environment import gqa_offsets_bug\n"
                   "gqa_offsets_bug()\n")
    subprocess.run([sys.executable, "-c", asked_first + WARM, str(tmp_path / "cache"), "lp_gqa",
                    user_kernels, CASE.id], cwd=ROOT, check=True, timeout=300)
    programs = _apart(tmp_path, kernel_modules=(user_kernels,))
    before = _counts()
    try:
        programs.prefetch([(kernel, CASE)])
        wanted = list(programs._programs.values())
        for p in wanted:
            p.compiled.result(timeout=120)
    finally:
        programs.close()
    assert _why_since(before) == {}, "every program handed over"
    assert _counts()["loaded"] - before["loaded"] == len(wanted) >= 3


def test_a_probe_build_that_failed_there_is_traced_here_only_once_the_run_asks(
        tmp_path, user_kernels):
    """A deterministic build whose trace failed in the lowering process (not an error it hands
    over: only a default build's refusal is) is left unbuilt until the run asks for it: the
    deterministic build of a pair whose default build refused a feature is never run, and was
    traced again for nothing (86 programs on the H200's warm nightly at 3b0c5fc). Asked for,
    it is traced here, now, with the run's own error; the header counts those never built."""
    import time

    from harness.engine.program_functions import DETERMINISTIC
    kernels = registry.all_kernels()
    programs = _apart(tmp_path, kernel_modules=(user_kernels,))
    programs.probe_mode = DETERMINISTIC          # as on GPUs: a deterministic build per pair
    before = _counts()
    pairs = [(kernels["lp_refuses"], WINDOWED), (kernels["lp_breaks"], CASE)]
    try:
        programs.prefetch(pairs, probe=False)
        builds = {p.name: p for p in programs._programs.values() if p.mode == DETERMINISTIC}
        assert set(builds) == {"lp_refuses", "lp_breaks"}
        deadline = time.monotonic() + 120
        while not all(p.build_here for p in builds.values()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert all(p.build_here and not p.compiled.done() for p in builds.values()), \
            "answered, left unbuilt"
        asked = programs.get(kernels["lp_breaks"], CASE, DETERMINISTIC)
        assert asked is builds["lp_breaks"] and asked.build_here is None
        error = asked.compiled.exception(timeout=120)
        assert isinstance(error, ValueError) and "refuses to be traced" in str(error)
        assert asked.trace_error is error, "traced here: the run's own error"
        assert not builds["lp_refuses"].compiled.done(), "never asked for: never traced"
        stats, why = _counts(), _why_since(before)
        # A tool waiting for every program (scripts/program_costs.py) asks for all of them.
        assert programs.wait_all() == len(programs._programs)
        assert isinstance(builds["lp_refuses"].compiled.exception(), NotImplementedError)
        assert _counts().get("unasked", 0) == before.get("unasked", 0)
    finally:
        programs.close()
    assert stats.get("unasked") == 1 + before.get("unasked", 0)
    assert why.get(BUILD_FAILED) == 2, "the lp_breaks default build, and asked"
    assert _why_since(before).get(BUILD_FAILED) == 3, "and the one wait_all asked for"
    parts = [{"compilation_cache": {"dir": "c", "lowering_process": {**stats, "unasked": n}}}
             for n in (1, 2)]
    assert merge_cache(parts)["lowering_process"]["unasked"] == 3
    cache = {"dir": "c", "lowering_process": {"unasked": 1}}
    lines = "\n".join(timing_lines({"timing": {"xla": {}}, "compilation_cache": cache}))
    assert "1 it could not build left unbuilt: the run never asked for them" in lines


def test_a_lowering_that_does_not_compile_here_is_built_here(monkeypatch):
    """A lowering handed over that the run cannot read back, or whose compile fails here (its
    custom calls' library not imported in the run yet: TE's FFI targets on a cold run), is
    traced here instead: its failure is never the program's error."""
    import threading

    import jax
    import jax.numpy as jnp

    from harness.engine import programs as programs_module
    from harness.engine.lowering_process import LOWERED_FAILED, dump_lowered, load_lowered
    lowered = jax.jit(lambda x: jnp.sin(x) * 2).lower(jax.ShapeDtypeStruct((4,), jnp.float32))
    blob = dump_lowered(lowered, "its text", 0.5)
    back, text, lower_s = load_lowered(blob)
    assert (back.as_text(), text, lower_s) == (lowered.as_text(), "its text", 0.5)
    x = jnp.arange(4.0)
    np.testing.assert_array_equal(back.compile()(x), lowered.compile()(x))
    # Compiled in the process already (a default build the cache held, its lowering shared
    # with the deterministic build): the lowering goes without its executable.
    assert lowered._lowering._executable is not None
    assert len(dump_lowered(lowered, "its text", 0.5)) == len(blob)
    assert load_lowered(dump_lowered(lowered, "", 0.0))[0]._lowering._executable is None
    # A host callback is this process's: not handed over (the run traces it).
    calls_back = jax.jit(lambda x: jax.pure_callback(
        np.sin, jax.ShapeDtypeStruct((4,), jnp.float32), x)).lower(x)
    with pytest.raises(ValueError, match="host callbacks"):
        dump_lowered(calls_back, "", 0.0)

    def no_such_target(*args, **kwargs):
        raise RuntimeError("No registered implementation for FFI custom call to lp_test")
    programs, before = Programs(), _counts()
    monkeypatch.setattr(programs_module, "compile_lowered", no_such_target)
    try:
        for what in (b"not a pickle", blob):
            program, traced_here = Program("lp_test", (), Timing()), threading.Event()
            programs._lowered_apart((program, traced_here.set), what)
            assert traced_here.wait(60) and not program.compiled.done(), what[:12]
    finally:
        programs.close()
    assert _why_since(before) == {LOWERED_FAILED: 2}
    assert _counts()["lowered"] == before["lowered"]


def test_an_answer_whose_handling_raises_fails_its_program_never_leaves_it_pending():
    """Where handling a "failed" answer raises (a build here that cannot be scheduled, say),
    the program fails with that error: before, the receive thread died with it and the run
    waited on the program for ever. The thread goes on answering the others."""
    def failed(item, why):
        raise RuntimeError(f"could not build {item[0].name} here ({why})")
    process = LoweringProcess({}, None, failed, None,
                              broken=lambda item, exc: item[0].fail(exc))
    first, second = Program("a", (), Timing()), Program("b", (), Timing())
    process._answer((first, None), "failed", NOT_IN_CACHE)
    process._answer((second, None), "lowered", b"")   # no `lowered`: failed, NOT_IN_CACHE
    for program in (first, second):
        with pytest.raises(RuntimeError, match=f"could not build {program.name} here"):
            program.compiled.result(timeout=1)
    first.fail(RuntimeError("again"))   # settled already: left as it was
    with pytest.raises(RuntimeError, match="could not build a here"):
        first.compiled.result(timeout=1)


BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass"


def test_a_lowering_process_is_reaped_with_its_own_cpu_seconds_not_its_siblings(monkeypatch):
    """A worker's RUSAGE_CHILDREN sums every ended child (XLA's ptxas processes on GPUs, the
    H200's cold nightly at 9ade3fe: 929 s, all shown as its lowering processes'): a lowering
    process's own seconds come from reaping it."""
    other = subprocess.Popen([sys.executable, "-c", BURN.format(s=0.6)])
    other.wait()   # ended and reaped as subprocess does: in RUSAGE_CHILDREN only
    process = LoweringProcess({}, None, None, None)
    process._proc = subprocess.Popen([sys.executable, "-c", BURN.format(s=0.3)])
    process.wait()
    assert 0.25 < process.cpu_s < 0.55, process.cpu_s
    assert process._proc.returncode == 0
    process.wait()   # reaped already: nothing more, the seconds stay
    assert 0.25 < process.cpu_s < 0.55
    # One that does not end in STOP_WAIT_S is killed, and reaped.
    monkeypatch.setattr(lowering_process, "STOP_WAIT_S", 0.2)
    stuck = LoweringProcess({}, None, None, None)
    stuck._proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    stuck.wait()
    assert stuck._proc.returncode == -signal.SIGKILL and 0 <= stuck.cpu_s < 0.5
    # One reaped by something else already: 0 seconds, its status taken as 0, no error.
    gone = LoweringProcess({}, None, None, None)
    gone._proc = subprocess.Popen([sys.executable, "-c", "pass"])
    os.waitpid(gone._proc.pid, 0)
    gone.wait()
    assert gone.cpu_s == 0.0 and gone._proc.returncode == 0


def test_the_worker_line_tells_the_lowering_processes_from_the_other_children():
    from harness.views.markdown import _cpu
    worker = {"cpu_s": 100.0, "children_cpu_s": 30.0, "lowering_cpu_s": 10.0, "cores": 4,
              "startup_s": 5.0, "wall_s": 45.0}
    assert _cpu(worker) == (" (CPU 100 s, its lowering processes 10 s, its other child "
                            "processes (XLA's ptxas, tools) 20 s; together 2.6 of 4 cores busy "
                            "on average)")
    assert _cpu({**worker, "children_cpu_s": 10.0}) == (
        " (CPU 100 s, its lowering processes 10 s; together 2.2 of 4 cores busy on average)")
    # A worker without lowering processes (--no-lowering-process, no cache), or an older
    # header: its children as one.
    none = {k: v for k, v in worker.items() if k != "lowering_cpu_s"}
    assert _cpu(none) == (" (CPU 100 s, its child processes 30 s; together 2.6 of 4 cores busy "
                          "on average)")
    programs = Programs()
    programs.close()
    assert programs.lowering_cpu_s is None
