"""What the judge concludes where the harness's own side fails: a reference that is non-finite
leaves no tolerance (an error, never a pass), and an oracle that raises is the harness's error,
never the crash a kernel declares."""
import dataclasses

import numpy as np
import pytest

from harness.engine import runner
from harness.engine.runner import run_kernel_case
from harness.judge import judging, oracle
from harness.kernels.kernel import Kernel, Platform
from harness.kernels.reference import dot_product
from harness.model.case import Case
from harness.model.features import Features

CPU = Platform("cpu")
CASE = Case("packed/random", 2, 128, 2, 2, 16, "bfloat16", 0)
SINKS = dataclasses.replace(CASE, features=Features(sinks=True))


def _with_reference(monkeypatch, change):
    """The runner's references, each passed through `change` (a copy: the oracle keeps them)."""
    real = oracle.reference_for

    def reference_for(case, programs=None, convention="segment"):
        ref = real(case, programs, convention)
        return change(dataclasses.replace(
            ref, peer_token_err={k: np.array(e) for k, e in ref.peer_token_err.items()},
            scale=dict(ref.scale)))
    monkeypatch.setattr(runner, "reference_for", reference_for)


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_a_non_finite_peer_on_one_token_is_an_error_of_that_segment_not_a_pass(
        monkeypatch, bad):
    seg = CASE.segments[1]

    def change(ref):
        ref.peer_token_err["out"][seg.row, seg.start] = bad
        return ref
    _with_reference(monkeypatch, change)
    records = run_kernel_case(Kernel("dp", dot_product), CASE, CPU, leak=False).records
    out = {(r.row, r.segment): r for r in records if r.check == "out"}
    broken = out[(seg.row, seg.number)]
    assert (broken.verdict, broken.outcome) == ("error", "error")
    assert broken.ratio is None and broken.tolerance is None
    assert "the reference is non-finite" in broken.message and "peer" in broken.message
    assert all(r.outcome == "ok" for k, r in out.items() if k != (seg.row, seg.number))
    assert all(r.outcome == "ok" for r in records if r.check in ("dq", "dk", "dv"))


def test_a_non_finite_truth_scale_makes_every_segment_of_that_check_an_error(monkeypatch):
    def change(ref):
        ref.scale["dq"] = np.inf
        return ref
    _with_reference(monkeypatch, change)
    kernel = Kernel("dp_either", dot_product, expect=lambda c, check, s: "either")
    records = run_kernel_case(kernel, CASE, CPU, leak=False).records
    dq = [r for r in records if r.check == "dq"]
    assert len(dq) == len(CASE.segments)
    # An expectation that leaves the check to the leak probe does not hide the error.
    assert {(r.verdict, r.outcome) for r in dq} == {("error", "error")}
    assert all("max|truth| inf" in r.message for r in dq)


def test_a_non_finite_peer_of_the_sinks_gradient_is_an_error_not_a_pass():
    ref = oracle.Reference(truth=(), peer_token_err={}, scale={}, peer_dsinks_err=np.inf,
                           dsinks_scale=1.0)
    kernel = Kernel("dp", dot_product, features=("sinks",))
    record = judging.dsinks_record(kernel, SINKS, 1e6, False, ref, "default")
    assert (record.verdict, record.outcome) == ("error", "error")
    assert "dsinks: the reference is non-finite" in record.message


def test_an_oracle_that_raises_is_an_error_even_where_the_kernel_declares_that_crash(
        monkeypatch):
    def reference_for(case, programs=None, convention="segment"):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory allocating the truth")
    monkeypatch.setattr(runner, "reference_for", reference_for)
    kernel = Kernel("dp_oom", dot_product, expect_error="RESOURCE_EXHAUSTED")
    records = run_kernel_case(kernel, CASE, CPU, leak=False).records
    assert [(r.verdict, r.expected, r.outcome) for r in records] == [("error", "pass",
                                                                      "error")]
    assert records[0].message.startswith("oracle failed, the kernel did not run: RuntimeError")
    assert "RESOURCE_EXHAUSTED" in records[0].traceback


def test_the_jvp_oracle_that_raises_is_an_error_of_the_jvp_check_not_a_known_crash(
        monkeypatch):
    def jvp_reference_for(case, programs=None, convention="segment"):
        raise RuntimeError("RESOURCE_EXHAUSTED: the tangents")
    monkeypatch.setattr(runner, "jvp_reference_for", jvp_reference_for)
    kernel = Kernel("dp_fwd", dot_product, forward_mode=True,
                    expect_error="RESOURCE_EXHAUSTED")
    records = run_kernel_case(kernel, CASE, CPU, leak=False).records
    jvp = [r for r in records if r.check == "jvp"]
    assert [(r.verdict, r.outcome) for r in jvp] == [("error", "error")]
    assert jvp[0].message.startswith("oracle's jvp failed")


def test_merge_rejudge_keeps_the_harnesss_own_error_an_error(monkeypatch):
    """merge --rejudge recomputes expectations: an oracle that raised stays the harness's
    error, never matched against the crash the kernel declares now."""
    from harness.judge.rejudge import rejudge

    def reference_for(case, programs=None, convention="segment"):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory allocating the truth")
    monkeypatch.setattr(runner, "reference_for", reference_for)
    kernel = Kernel("dp_oom", dot_product, expect_error="RESOURCE_EXHAUSTED")
    records = run_kernel_case(kernel, CASE, CPU, leak=False).records
    assert records[0].harness_error
    again = rejudge(records, {"dp_oom": kernel}, probed=False)
    assert [(r.verdict, r.outcome) for r in again] == [("error", "error")]
