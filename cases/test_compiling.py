"""A compile the host could not start (harness.compiling) is tried again, counted and said; any
other compile error raises at once; a kernel whose compile hit the host failure once is judged
on its numbers, and the run's header and summary say a compile was retried."""
import json

import pytest
from jax.errors import JaxRuntimeError

from harness import compiling
from harness.engine.programs import Programs
from harness.engine.runner import run_matrix
from harness.kernels.kernel import Kernel, Platform
from harness.kernels.reference import dot_product
from harness.model.case import Case

PTXAS = "INTERNAL: Failed to launch ptxas"


class _Lowered:
    """A lowered program whose compile fails with `errors`, one per attempt, then returns."""

    def __init__(self, *errors):
        self.errors, self.calls = list(errors), []

    def compile(self, compiler_options=None):
        self.calls.append(compiler_options)
        if self.errors:
            raise self.errors.pop(0)
        return "compiled"


def test_a_host_failure_is_tried_again_counted_and_said(capsys, monkeypatch):
    monkeypatch.setattr(compiling, "_retried", 0)
    pauses = []
    lowered = _Lowered(JaxRuntimeError(PTXAS), JaxRuntimeError(PTXAS))
    assert compiling.compile_lowered(lowered, {"opt": 1}, what="k (default)",
                                     sleep=pauses.append) == "compiled"
    assert lowered.calls == [{"opt": 1}] * 3, "the same options every attempt"
    assert pauses == list(compiling.PAUSES_S)
    assert compiling.retried() == 1, "one compile tried again, however many attempts"
    err = capsys.readouterr().err
    assert "compiling k (default) failed on the host" in err and "Failed to launch ptxas" in err
    assert "attempt 2 of 3" in err and "attempt 3 of 3" in err


def test_a_host_failure_every_attempt_raises_its_last_error():
    lowered = _Lowered(*(JaxRuntimeError(f"{PTXAS} ({i})") for i in range(compiling.ATTEMPTS)))
    with pytest.raises(JaxRuntimeError, match=r"\(2\)"):
        compiling.compile_lowered(lowered, sleep=lambda s: None)
    assert len(lowered.calls) == compiling.ATTEMPTS


@pytest.mark.parametrize("error", [JaxRuntimeError("INTERNAL: ptxas exited with non-zero "
                                                   "error code 255"),
                                   ValueError("the kernel's own error")])
def test_any_other_compile_error_raises_at_once(error):
    before, lowered = compiling.retried(), _Lowered(error)
    with pytest.raises(type(error)):
        compiling.compile_lowered(lowered, sleep=lambda s: pytest.fail("no pause"))
    assert len(lowered.calls) == 1 and compiling.retried() == before


def test_a_kernel_whose_compile_hit_the_host_failure_once_is_judged_and_the_run_says_so(
        monkeypatch, tmp_path):
    """End to end through the CLI: the first compile of the kernel's own program (not the
    oracle's, not a harness program) fails on the host; the kernel's verdicts are its
    numbers' (ok), the header counts one retried compile, the summary says so."""
    import harness.engine.programs as programs_module
    from harness import cli
    real, failed = programs_module.compile_lowered, []

    class _FailsOnce:
        def __init__(self, lowered):
            self.lowered = lowered

        def compile(self, **kwargs):
            if not failed:
                failed.append(1)
                raise JaxRuntimeError(PTXAS)
            return self.lowered.compile(**kwargs)

    def kernel_compile_fails_once(lowered, options=None, *, what="", **kw):
        if what.startswith("dot_product") and not failed:
            lowered = _FailsOnce(lowered)
        return real(lowered, options, what=what, **kw)

    monkeypatch.setattr(programs_module, "compile_lowered", kernel_compile_fails_once)
    monkeypatch.setattr(compiling, "PAUSES_S", (0.0,))
    monkeypatch.setattr(compiling, "_retried", 0)
    out = tmp_path / "run"
    code = cli.main(["run", "--kernels", "dot_product", "--cases",
                     "packed/random-b4-t256-h4kv2-d64-bf16-s0",
                     "--no-compilation-cache", "--report-dir", str(out)])
    assert failed and compiling.retried() == 1
    assert code == 0
    header = json.loads((out / "report.jsonl").read_text().splitlines()[0])
    assert header["compilation_cache"]["retried"] == 1, header["compilation_cache"]
    assert "1 compile(s) tried again after the host could not start the compiler" in \
        (out / "summary.md").read_text()
    records = [json.loads(line) for line in (out / "report.jsonl").read_text().splitlines()[1:]]
    assert records and not [r for r in records if r.get("outcome") in ("error", "skip")]


def test_a_process_that_ran_no_probe_adds_no_mode_beside_its_lanes():
    """pytest's header on a GPU: the lanes probed a deterministic build; the test process took
    their records and probed nothing (its part names no mode). The header says
    "deterministic", where it said ['default', 'deterministic'] on the H200."""
    from harness.store.merge import probe_modes
    assert probe_modes([{"probe_mode": None}, {"probe_mode": "deterministic"},
                        {"probe_mode": "deterministic"}]) == ["deterministic"]
    assert probe_modes([{"probe_mode": None}]) == ["default"]
    assert probe_modes([{"probe_mode": "default"}, {"probe_mode": "deterministic"}]) == \
        ["default", "deterministic"], "processes that did probe differently still say so"


def test_programs_compile_through_the_retrying_compile(monkeypatch):
    """The kernels' programs (Programs._compile) go through compile_lowered."""
    seen = []
    real = compiling.compile_lowered

    def spy(lowered, options=None, **kw):
        seen.append(lowered)
        return real(lowered, options, **kw)

    import harness.engine.programs as programs_module
    monkeypatch.setattr(programs_module, "compile_lowered", spy)
    kernel = Kernel("dp_compiling", dot_product)
    case = Case("packed/random", 1, 24, 2, 1, 8, "float32", 7)
    programs = Programs()
    try:
        result = run_matrix([kernel], [case], Platform("cpu"), programs=programs)
    finally:
        programs.close()
    assert seen and not [r for r in result.records if r.verdict == "error"]


def test_merged_parts_sum_their_retries_and_a_run_without_any_has_no_count():
    from harness.store.merge import merge_cache
    merged = merge_cache([{"compilation_cache": {"dir": "d", "hits": 1, "misses": 2,
                                                 "retried": 1}},
                          {"compilation_cache": {"dir": "d", "hits": 3, "misses": 0}}])
    assert merged == {"dir": "d", "hits": 4, "misses": 2, "retried": 1}
    assert "retried" not in merge_cache([{"compilation_cache": {"dir": "d", "hits": 1,
                                                                "misses": 0}}])


def test_pytest_counts_the_compilation_cache_lookups_of_its_lanes(tmp_path):
    """The workflow's pytest runs the pairs in the engine's lanes (worker processes): its
    header counts their lookups too (on the H200 a warm pytest run of the nightly said "cold (0
    hits, 15 misses)": its own process's only), so that a warm run's hits show, and
    names a probe mode (on a CPU every process's is the default: the case of a process that
    ran none beside lanes that probed a deterministic build is the test above)."""
    import subprocess
    import sys
    case = "packed/random-b4-t256-h4kv2-d64-bf16-s0"

    def run(name, cache, *command):
        out = subprocess.run([sys.executable, "-m", *command, "--kernels", "dot_product",
                              "--cases", case, "--compilation-cache", str(tmp_path / cache),
                              "--report-dir", str(tmp_path / name)],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        return json.loads((tmp_path / name / "report.jsonl").read_text().splitlines()[0])

    cli = run("cli", "cli-cache", "harness", "run")
    matrix = ("pytest", "-q", "-p", "no:cacheprovider", "cases/test_matrix.py", "--ahead")
    run("cold", "pytest-cache", *matrix)
    warm = run("warm", "pytest-cache", *matrix)
    # The same pairs judged: at least the programs the CLI looked up, every one found on disk.
    looked_up = cli["compilation_cache"]["hits"] + cli["compilation_cache"]["misses"]
    assert warm["compilation_cache"]["misses"] == 0, warm["compilation_cache"]
    assert warm["compilation_cache"]["hits"] >= looked_up, (warm["compilation_cache"], looked_up)
    assert warm["probe_mode"] == cli["probe_mode"] == "default"
