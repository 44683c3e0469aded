"""A feature refused by a kernel's backward pass alone (harness.engine.refusal): its forward is
judged by itself. Before, the default program (forward and backward traced as one) read
`refused` whole, and a forward that dropped the window passed (a cold review's mutants)."""
import jax
import pytest

from harness.engine.runner import run_kernel_case
from harness.judge import tallies
from harness.kernels.kernel import Kernel, Platform
from harness.model.case import Case
from harness.model.features import Features
from harness.sut.dot_product import dot_product

WINDOW = Features(window=(16, 0))
CASE = Case("packed/random", 2, 128, 4, 2, 32, "float32", 0, features=WINDOW)


def _refusing_backward(honours_window: bool, refuse_in_jvp: bool = False):
    """dot_product whose backward (custom_vjp, or its custom_jvp rule) raises a refusal of the
    window, its forward honouring the window or dropping it."""
    def kernel(query, key, value, segment_ids, *, causal, scale, window=None):
        kw = {"window": window} if honours_window else {}

        def plain(q, k, v):
            return dot_product(q, k, v, segment_ids, causal=causal, scale=scale, **kw)
        if refuse_in_jvp:
            f = jax.custom_jvp(plain)

            @f.defjvp
            def _(primals, tangents):
                if window is not None:
                    raise NotImplementedError("sliding window: no derivative rule")
                return jax.jvp(plain, primals, tangents)
            return f(query, key, value)
        f = jax.custom_vjp(plain)

        def fwd(q, k, v):
            return plain(q, k, v), (q, k, v)

        def bwd(res, g):
            if window is not None:
                raise NotImplementedError("sliding window is not supported in the backward")
            return jax.vjp(plain, *res)[1](g)
        f.defvjp(fwd, bwd)
        return f(query, key, value)
    return kernel


def _outcomes(records) -> dict:
    out = {}
    for r in records:
        out.setdefault(r.check, set()).add(r.outcome)
    return out


@pytest.mark.parametrize("refuse_in_jvp", [False, True], ids=["custom_vjp", "custom_jvp"])
def test_a_forward_that_drops_the_window_fails_though_its_backward_refuses(refuse_in_jvp):
    kernel = Kernel("cpu:drops_then_refuses", _refusing_backward(False, refuse_in_jvp),
                    devices=("cpu",), features=("window",), forward_mode=refuse_in_jvp)
    records = run_kernel_case(kernel, CASE, Platform("cpu")).records
    outcomes = _outcomes(records)
    assert "fail" in outcomes["out"] and "fail" in outcomes["leak"], outcomes
    assert outcomes["dq"] == outcomes["dk"] == outcomes["dv"] == {"refused"}
    assert "*" not in outcomes   # no pair-level refusal hides the forward's failure
    failing = [r for r in records if r.check == "out" and r.outcome == "fail"]
    assert "the window was dropped" in failing[0].message
    if refuse_in_jvp:
        assert outcomes["jvp"] == {"refused"}
    assert tallies.run_status(records) == 1


def test_a_forward_that_honours_the_window_passes_and_its_gradients_read_refused():
    kernel = Kernel("cpu:forward_only_window", _refusing_backward(True), devices=("cpu",),
                    features=("window",))
    records = run_kernel_case(kernel, CASE, Platform("cpu")).records
    outcomes = _outcomes(records)
    assert outcomes["out"] == outcomes["leak"] == {"ok"}, outcomes
    assert outcomes["dq"] == outcomes["dk"] == outcomes["dv"] == {"refused"}
    refused = [r for r in records if r.outcome == "refused"]
    assert refused[0].message.startswith("refused window in its backward pass while tracing")
    assert list(tallies.refusals(records).values()) == [1]   # one case, not one per check
    assert tallies.run_status(records) == 0


def test_a_kernel_refusing_in_its_forward_is_refused_whole():
    def refuses(query, key, value, segment_ids, *, causal, scale, window=None):
        if window is not None:
            raise NotImplementedError("sliding window is not supported")
        return dot_product(query, key, value, segment_ids, causal=causal, scale=scale)
    kernel = Kernel("cpu:refuses", refuses, devices=("cpu",), features=("window",))
    records = run_kernel_case(kernel, CASE, Platform("cpu")).records
    assert [(r.check, r.outcome) for r in records] == [("*", "refused")]


def test_the_harnesss_own_shape_check_is_never_a_refusal_of_the_value_head_dim():
    """A kernel that pads its output to the query's head dim on a value-head-dim case: the
    harness's check names the value's head dim, and read as a refusal (green) before."""
    import jax.numpy as jnp

    def padded(query, key, value, segment_ids, *, causal, scale):
        out = dot_product(query, key, value, segment_ids, causal=causal, scale=scale)
        extra = query.shape[-1] - out.shape[-1]
        return jnp.pad(out, ((0, 0), (0, 0), (0, 0), (0, extra)))
    kernel = Kernel("cpu:pads_dv", padded, devices=("cpu",), features=("head_dim_v",))
    case = Case("packed/random", 2, 128, 4, 2, 32, "float32", 0,
                features=Features(head_dim_v=16))
    records = run_kernel_case(kernel, case, Platform("cpu")).records
    assert [(r.check, r.outcome) for r in records] == [("*", "error")]
    assert "BrokenContract" in records[0].message and "output shape" in records[0].message


def test_a_pair_refused_whole_in_the_baseline_and_judged_now_is_no_lost_check():
    """The first run after this change: the baseline's pair-level refusal is gone, its
    forward judged now (a regression only through what the run itself finds bad)."""
    from harness.judge import judging, regression
    kernel = Kernel("cpu:forward_only_window", _refusing_backward(True), devices=("cpu",),
                    features=("window",))
    base = [judging.refused_record(kernel, CASE, "window", "NotImplementedError: window")]
    new = run_kernel_case(kernel, CASE, Platform("cpu")).records
    result = regression.compare(new, base, same_selection=True)
    assert not result.regressed and not result.lost_checks, result.regressions


def test_a_pair_refused_in_the_baseline_whose_forward_fails_now_regresses():
    """compare alone (no run's status beside it): the new failing checks of a pair the
    baseline had are regressions, though the baseline lacks those checks (a cold review:
    'no regression', exit 0)."""
    from harness.judge import judging, regression
    kernel = Kernel("cpu:drops_then_refuses", _refusing_backward(False), devices=("cpu",),
                    features=("window",))
    base = [judging.refused_record(kernel, CASE, "window", "NotImplementedError: window")]
    new = run_kernel_case(kernel, CASE, Platform("cpu")).records
    result = regression.compare(new, base, same_selection=True)
    assert result.regressed
    assert any("out r" in line and "a check the baseline did not have" in line
               for line in result.regressions), result.regressions[:3]


def test_backward_markers_stay_out_of_the_forward_alone_and_a_declared_crash_reads_known():
    """A fused kernel's backward custom call is not in its forward's program (a cold review:
    TE, FlashAttention and fa4 would read ERROR, 'program lacks ..._bwd'); a crash the kernel
    declares, met while tracing, reads as before (its forward alone would make it missed)."""
    kernel = Kernel("cpu:fused", _refusing_backward(True), devices=("cpu",),
                    features=("window",), hlo_markers=("fwd_call", "bwd_call"),
                    backward_markers=("bwd_call",))
    assert kernel.forward_only().hlo_markers == ("fwd_call",)
    assert kernel.forward_only().backward is False
    with pytest.raises(ValueError, match="backward_markers"):
        Kernel("cpu:bad", _refusing_backward(True), hlo_markers=("a",),
               backward_markers="a")   # a lone string, read letter by letter: refused
    declared = Kernel("cpu:declared", _refusing_backward(True), devices=("cpu",),
                      features=("window",), expect_error="not supported in the backward")
    records = run_kernel_case(declared, CASE, Platform("cpu")).records
    assert [(r.check, r.outcome) for r in records] == [("*", "refused")]


def test_the_leak_reproducer_runs_the_forward_alone_where_the_backward_refused():
    """The repro script's program ran jax.vjp through a backward that refuses the window: it
    raised instead of showing the leak (a cold review). It runs the forward alone, as the
    run judged it."""
    from harness.tools.repro import leak_script
    from harness.tools.repro.trials import Trial
    kernel = Kernel("cpu:drops_then_refuses", _refusing_backward(False), devices=("cpu",),
                    features=("window",))
    records = run_kernel_case(kernel, CASE, Platform("cpu")).records
    parts = leak_script.parts(kernel, Trial(CASE, records), "leak")
    assert "BACKWARD = False" in parts.constants
    plain = Kernel("cpu:plain", dot_product, devices=("cpu",), features=("window",))
    judged = [r for r in records if r.outcome != "refused"]
    parts = leak_script.parts(plain, Trial(CASE, judged), "leak")
    assert "BACKWARD = True" in parts.constants

