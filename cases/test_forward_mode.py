"""The forward-mode (jvp) check: kernels that declare forward_mode have the output's tangent for
random input tangents judged per segment against the oracle's (harness.judge.oracle:
reference_jvp_fn, jvp_reference_for).

- the oracle's tangent agrees with a central difference of the float64 segment loop (shares no
  code with it), on every feature, GQA and padding;
- a forward-mode kernel whose tangent leaks across segments is caught by the jvp check alone
  (its output passes), its hand-written control passes;
- a kernel that declares forward mode and raises under jax.jvp is an error of that check (the
  pair's other checks still judged); one that does not declare it has no jvp record;
- the tangent at padding is held to the kernel's output convention;
- the declarations: which kernels say they have forward mode, and fa4's tangent-kernel marker.
"""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness.engine.registry import all_kernels
from harness.engine.runner import run_kernel_case
from harness.judge import vocabulary as v
from harness.judge.loop_oracle import segment_loop_attention
from harness.judge.oracle import jvp_reference_for
from harness.kernels.kernel import Kernel, Platform
from harness.model.case import Case, make_inputs, make_tangents
from harness.model.features import Features
from harness.tools.zoo.forward_mode import hand_written_jvp
from harness.tools.zoo.reference_math import dense, right_mask

CPU = Platform("cpu")


def small(layout="padded/between", features=None, causal=True, dtype="float32", heads=4,
          kv_heads=2, seed=3):
    return Case(layout, 2, 256, heads, kv_heads, 16, dtype, seed, causal=causal,
                features=features or Features())


def central_difference(case: Case, h: float = 1e-6, convention: str = "segment") -> np.ndarray:
    """d/dt of the float64 loop's output along the case's tangents, (f(x + h t) - f(x - h t))
    / 2h: no autodiff, no code shared with the dense oracle."""
    inputs = make_inputs(case)
    tangents = [np.asarray(t, np.float64) for t in make_tangents(case)]
    primals = [np.asarray(x, np.float64) for x in (inputs.query, inputs.key, inputs.value)]
    sinks = None if inputs.sinks is None else np.asarray(inputs.sinks, np.float64)

    def at(sign):
        q, k, vv = (x + sign * h * t for x, t in zip(primals, tangents))
        s = None if sinks is None else sinks + sign * h * tangents[3]
        out, _ = segment_loop_attention(q, k, vv, inputs.segment_ids,
                                        np.zeros(q.shape[:3] + vv.shape[3:]), scale=case.scale,
                                        causal=case.causal, features=case.features or None,
                                        sinks=s, chunk_convention=convention)
        return out
    return (at(1) - at(-1)) / (2 * h)


@pytest.mark.parametrize("features,causal,convention", [
    (None, True, "segment"), (None, False, "segment"), (Features(window=(7, 0)), True, "segment"),
    (Features(window=(7, 3)), False, "segment"), (Features(softcap=2.0), True, "segment"),
    (Features(chunk=16), True, "segment"), (Features(chunk=16), True, "row"),
    (Features(sinks=True), True, "segment"), (Features(head_dim_v=8), True, "segment"),
    (Features(window=(15, 0), sinks=True, softcap=3.0), True, "segment")],
    ids=["causal", "bidir", "window", "bidir-window", "softcap", "chunk", "chunk-from-row",
         "sinks", "head-dim-v", "combined"])
def test_the_oracles_tangent_is_the_float64_loops_derivative(features, causal, convention):
    case = small(features=features, causal=causal)
    truth = np.asarray(jvp_reference_for(case, None, convention).truth[0], np.float64)
    want = central_difference(case, convention=convention)
    valid = case.segment_ids > 0
    scale = np.abs(want[valid]).max()
    assert scale > 0.1
    assert np.abs(truth - want)[valid].max() <= 1e-4 * scale
    assert (truth[~valid] == 0).all()       # the oracle's tangent at padding: zero, as its output


def test_tangents_are_fresh_per_seed_reproducible_and_not_the_inputs():
    a, b = small(seed=1), small(seed=2)
    ta, tb = make_tangents(a), make_tangents(b)
    assert not np.array_equal(np.asarray(ta[0]), np.asarray(tb[0]))
    make_tangents.cache_clear()
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(ta, make_tangents(a)))
    inputs = make_inputs(a)
    assert not np.array_equal(np.asarray(ta[0]), inputs.query)


def forward_kernel(name, fn, **more):
    return Kernel(name, fn, padding_anywhere=True, materializes_scores=True,
                  forward_mode=True, **more)


def by_check(records):
    out = {}
    for r in records:
        out.setdefault(r.check, []).append(r)
    return out


@pytest.mark.parametrize("layout", ["packed/random", "padded/between"])
def test_a_tangent_that_leaks_across_segments_is_caught_by_the_jvp_check_alone(layout):
    case = small(layout, dtype="bfloat16")
    buggy = forward_kernel("jvp_leaks", hand_written_jvp(tangent_ignores_segments=True),
                           backward=False)
    checks = by_check(run_kernel_case(buggy, case, CPU, leak=False).records)
    assert all(r.outcome == v.OK for r in checks["out"])
    assert any(r.outcome == v.FAIL and r.ratio > 5 for r in checks["jvp"])
    # Segment 1 of each row has nothing before it to leak from.
    assert all(r.outcome == v.OK for r in checks["jvp"] if r.segment == 1)
    control = forward_kernel("jvp_right", hand_written_jvp(), backward=False)
    records = run_kernel_case(control, case, CPU, leak=False).records
    assert [r for r in records if r.outcome in v.BAD] == []
    assert len([r for r in records if r.check == "jvp"]) == len(case.segments)


def custom_vjp_attention(query, key, value, segment_ids, *, causal, scale):
    right = right_mask(segment_ids, causal)

    @jax.custom_vjp
    def attend(q, k, vv):
        return dense(q, k, vv, right, scale=scale)
    attend.defvjp(lambda q, k, vv: (attend(q, k, vv), (q, k, vv)),
                  lambda res, g: jax.vjp(lambda *a: dense(*a, right, scale=scale), *res)[1](g))
    return attend(query, key, value)


def test_a_declared_forward_mode_that_raises_is_an_error_of_the_jvp_check():
    case = small("packed/random")
    records = run_kernel_case(forward_kernel("custom_vjp", custom_vjp_attention), case, CPU,
                              leak=False).records
    checks = by_check(records)
    [error] = checks["jvp"]
    assert (error.verdict, error.outcome) == (v.ERROR, v.ERROR)
    assert "forward-mode autodiff" in error.message and error.message.startswith("jvp: ")
    assert all(r.outcome == v.OK for c in ("out", "dq", "dk", "dv") for r in checks[c])
    undeclared = dataclasses.replace(forward_kernel("custom_vjp", custom_vjp_attention),
                                     forward_mode=False)
    assert "jvp" not in by_check(run_kernel_case(undeclared, case, CPU, leak=False).records)


def test_a_forward_rule_narrower_than_its_kernel_skips_the_jvp_check_with_its_reason():
    """forward_limits (fa4-jax's JVP kernel takes head dims <= 128): the jvp check of such a
    case is a skip naming the limit, and the other checks run; a declared forward mode that
    raises on it anyway would be an error (the previous test)."""
    case = small("packed/random")
    limited = forward_kernel("custom_vjp", custom_vjp_attention,
                             forward_limits=lambda c: [f"its JVP takes head dims <= 16, not "
                                                       f"{c.head_dim}"])
    checks = by_check(run_kernel_case(limited, case, CPU, leak=False).records)
    [skipped] = checks["jvp"]
    assert (skipped.verdict, skipped.outcome) == (v.SKIP, v.SKIP)
    assert skipped.message == f"its JVP takes head dims <= 16, not {case.head_dim}"
    assert all(r.outcome == v.OK for c in ("out", "dq", "dk", "dv") for r in checks[c])


def test_fa4s_forward_mode_declarations_on_the_nightly():
    """fa4-jax's JVP kernel, as seen on the H200 (reports/fa4-jvp-h200/): head dims above 128
    are its own refusal (skipped with it), a window reading ahead its known wrong tangent."""
    from harness.engine.registry import select_kernels
    from harness.model.suites import suite_cases
    [fa4] = select_kernels("fa4:varlen")
    cases = suite_cases("nightly")
    skipped = {c.id for c in cases if fa4.forward_reasons(c)}
    known = {c.id for c in cases if fa4.expected(c, "jvp", c.segments[0])[0] == v.KNOWN}
    assert skipped == {c.id for c in cases if max(c.head_dim, c.value_dim) > 128} != set()
    assert known == {c.id for c in cases if c.features.window and c.features.window[1] > 0}
    assert len(known) == 4   # three packed layouts and one sequence per row
    assert all(fa4.expected(c, chk, c.segments[0])[0] == v.PASS for c in cases
               for chk in ("out", "dq", "dk", "dv"))


def nan_tangent_at_padding(query, key, value, segment_ids, *, causal, scale):
    pad = (segment_ids == 0)[:, :, None, None]

    @jax.custom_jvp
    def attend(q, k, vv):
        return dense(q, k, vv, right_mask(segment_ids, causal), scale=scale)

    @attend.defjvp
    def rule(primals, tangents):
        out, tangent = jax.jvp(lambda *a: dense(*a, right_mask(segment_ids, causal),
                                                scale=scale), primals, tangents)
        return out, jnp.where(pad, jnp.nan, tangent)
    return attend(query, key, value)


@pytest.mark.parametrize("convention,fails", [("finite", True), ("undefined", False)])
def test_the_tangent_at_padding_follows_the_output_convention(convention, fails):
    case = small("padded/between")
    kernel = forward_kernel("nan_tangent", nan_tangent_at_padding, backward=False,
                            padding_output=convention)
    checks = by_check(run_kernel_case(kernel, case, CPU, leak=False).records)
    assert all(r.outcome == v.OK for r in checks["jvp"])      # valid tokens are right
    if not fails:   # an undefined output and tangent, no backward: nothing there to look at
        assert "padding" not in checks
        return
    padding = checks["padding"]
    assert padding and all(r.verdict == v.FAIL for r in padding)
    assert all(r.message.startswith("jvp non-finite") for r in padding)


def test_the_kernels_that_declare_forward_mode():
    declared = {name for name, k in all_kernels().items() if k.forward_mode}
    assert declared == {"dot_product", "xla", "sut:dot_product", "maxtext:dot_product",
                        "maxtext_fixed:dot_product", "fa4:varlen"}
    fa4 = all_kernels()["fa4:varlen"]
    assert fa4.forward_markers == ("cutejax.fa4_fwd", "cutejax.fa4_jvp")


def test_repro_says_it_writes_no_script_for_a_failure_of_the_jvp_check_alone():
    from harness.engine.programs import Programs
    from harness.errors import UsageError
    from harness.tools.repro.command import main as repro_main
    from harness.tools.repro.trials import Trials, target_check
    buggy = forward_kernel("jvp_leaks", hand_written_jvp(tangent_ignores_segments=True),
                           backward=False)
    trials = Trials(buggy, CPU, Programs(platform="cpu"), max_runs=4)
    with pytest.raises(UsageError, match="fails only the jvp check .* writes no script"):
        target_check(trials, small("packed/random", dtype="bfloat16"), None)
    with pytest.raises(UsageError, match="--check jvp: repro writes no script"):
        repro_main("dot_product", "packed/random-b4-t256-h4kv2-d64-bf16-s0", check="jvp")


def test_forward_mode_declarations_are_checked_at_registration():
    def fn(q, k, v, s, *, causal, scale):
        return q
    with pytest.raises(ValueError, match="forward_markers without forward_mode"):
        Kernel("k", fn, forward_markers=("x",))
    with pytest.raises(ValueError, match="a fallback would pass as the fused path"):
        Kernel("k", fn, forward_mode=True, hlo_markers=("fused_fwd",))
    Kernel("k", fn, forward_mode=True, hlo_markers=("fused_fwd",), forward_markers=("fused_jvp",))


def test_the_jvp_check_cannot_be_left_to_the_leak_probe():
    from harness.judge.judging import expectation
    with pytest.raises(ValueError, match="leak probe does not look at the output's tangent"):
        expectation("either", "jvp")
    assert expectation(("known", "a named bug"), "jvp") == ("known", "a named bug")
