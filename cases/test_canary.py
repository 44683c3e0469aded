"""The harness catches the reported bug, exactly where it must, and subtler ones too."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness.model.case import Case
from harness.kernels.kernel import Kernel, Platform
from harness.kernels.reference import dot_product
from harness.engine.registry import select_kernels
from harness.engine.runner import run_kernel_case
from harness.model.suites import suite_cases

CPU = Platform("cpu")
CANARY = select_kernels("canary_ignores_segments")[0]


def _run(kernel, case):
    records = run_kernel_case(kernel, case, CPU).records
    assert all(r.verdict in ("pass", "fail") for r in records), records[0].get("message")
    return records


def _failing(records, check):
    return {(r.row, r.segment) for r in records if r.check == check and r.verdict == "fail"}


def _reads_other_tokens(case, s):
    return s.start > 0 if case.causal else s.length < case.seq_len


# The smoke suite's bfloat16 cases (every layout, GQA, causal and bidirectional, long rows); its
# float32 twins run the same expectations in the matrix (cases/test_matrix.py).
@pytest.mark.parametrize("case", [c for c in suite_cases("smoke") if c.dtype == "bfloat16" and not c.features],
                         ids=lambda c: c.id)
def test_canary_is_caught_exactly_where_it_reads_across(case):
    records = _run(CANARY, case)
    assert not [r for r in records if r.outcome in ("fail", "missed", "error")]
    reading = {(s.row, s.number) for s in case.segments if _reads_other_tokens(case, s)}
    # Causal: the forward output fails on exactly the segments that read earlier tokens
    # (segments after a boundary, or after left padding); dq too, single tokens aside.
    if case.causal:
        assert _failing(records, "out") == reading
        dq = _failing(records, "dq")
        assert {(s.row, s.number) for s in case.segments
                if (s.row, s.number) in reading and s.length > 1} <= dq <= reading
    else:
        assert _failing(records, "out") <= reading
    # The leak probe is exact: every segment of a row with more than itself in it.
    crowded = {(s.row, s.number) for s in case.segments
               if s.length < int((case.segment_ids[s.row] > 0).sum())
               or (_reads_other_tokens(case, s))}
    assert _failing(records, "leak") == crowded
    # Nothing is left unjudged without the probe judging that segment.
    for r in records:
        if r.expected == "either":
            assert r.outcome == "unjudged" and r.judged_by.startswith("leak:")


def test_canary_is_invisible_without_packing():
    case = Case("unpacked/pad-tail", 4, 256, 4, 2, 64, "bfloat16", 0)
    records = _run(CANARY, case)
    assert not any(r.verdict == "fail" for r in records)
    assert {r.outcome for r in records} == {"ok"}


def test_causal_canary_with_left_padding_fails_on_segment_one():
    """Left padding before segment 1: a kernel that ignores segment ids reads the poison."""
    case = Case("padded/left", 4, 256, 4, 2, 64, "bfloat16", 0)
    records = _run(CANARY, case)
    first = {(s.row, s.number) for s in case.segments if s.number == 1}
    assert first <= _failing(records, "out")


def _off_by_one(query, key, value, segment_ids, *, causal, scale):
    """A subtle bug: each segment's first token also reads the previous segment's last token."""
    prev = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    t = segment_ids.shape[1]
    pos = jnp.arange(t)
    leak = (pos[None, :, None] - 1 == pos[None, None, :]) & (prev[:, :, None] != segment_ids[:, :, None]) \
        & (prev[:, :, None] > 0)
    mask = (same | leak) & (pos[:, None] >= pos[None, :])[None]
    return _masked_attention(query, key, value, mask, scale)


def _masked_attention(query, key, value, mask, scale):
    """Softmax attention under a [B, T, T] mask (kv heads grouped)."""
    h = query.shape[2]
    k = jnp.repeat(key, h // key.shape[2], axis=2)
    v = jnp.repeat(value, h // value.shape[2], axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", query, k, preferred_element_type=jnp.float32) * scale
    p = jax.nn.softmax(jnp.where(mask[:, None], s, -1e30), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(value.dtype), v)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_token_leak_is_caught_at_that_token(dtype):
    case = Case("unaligned/block-edges", 4, 256, 4, 2, 32, dtype, 0)
    records = _run(Kernel("off_by_one", _off_by_one), case)
    failing_out = [r for r in records if r.check == "out" and r.verdict == "fail"]
    assert {(r.row, r.segment) for r in failing_out} == \
        {(s.row, s.number) for s in case.segments if s.number > 1}
    assert all(r.worst_token == r.start for r in failing_out), "worst token is the first"


def test_a_correct_kernel_passes_everywhere():
    case = Case("packed/many", 4, 256, 4, 2, 32, "bfloat16", 0)
    assert not any(r.verdict == "fail" for r in _run(Kernel("dp", dot_product), case))


# ----- the leak probe: bitwise, no tolerance ----------------------------------------------------

def _leaks(records):
    return _failing(records, "leak")


@pytest.mark.parametrize("case", [Case("extremes/long", 3, 2048, 2, 1, 16, "bfloat16", 0),
                                  Case("extremes/single-tokens", 4, 1024, 2, 2, 16, "bfloat16", 0)],
                         ids=lambda c: c.id)
def test_leak_probe_catches_what_rounding_hides(case):
    """Long rows where the canary's dq of a trailing single token, or dk/dv of a long first
    segment, hide inside bf16 noise: the probe still flags every segment of a packed row."""
    records = _run(CANARY, case)
    hidden = {(r.row, r.segment) for r in records
              if r.check != "leak" and r.expected == "either" and r.verdict == "pass"}
    assert hidden, "some wrong gradients pass their tolerance here"
    packed_rows = {s.row for s in case.segments if s.number > 1}
    assert _leaks(records) == {(s.row, s.number) for s in case.segments if s.row in packed_rows}
    assert hidden <= _leaks(records)


def test_leak_probe_flags_a_one_token_leak_and_passes_correct_kernels():
    case = Case("unaligned/block-edges", 4, 256, 4, 2, 32, "bfloat16", 0)
    leaky = _run(Kernel("off_by_one", _off_by_one), case)
    assert {(s.row, s.number) for s in case.segments if s.number > 1} <= _leaks(leaky)
    assert not _leaks(_run(Kernel("dp", dot_product), case))


def _reads_padding(query, key, value, segment_ids, *, causal, scale):
    """Valid queries also read padding keys (the segment mask lets 0 match anything)."""
    same = (segment_ids[:, :, None] == segment_ids[:, None, :]) | (segment_ids[:, None, :] == 0)
    same = same & (segment_ids[:, :, None] > 0)
    t = segment_ids.shape[1]
    if causal:
        same = same & jnp.tril(jnp.ones((t, t), bool))[None]
    return _masked_attention(query, key, value, same, scale)


def test_padding_read_is_caught_by_the_probe_where_padding_comes_first():
    case = Case("padded/between", 4, 256, 4, 2, 32, "bfloat16", 0)
    records = _run(Kernel("reads_padding", _reads_padding, padding_anywhere=True), case)
    after_padding = {(s.row, s.number) for s in case.segments
                     if (case.segment_ids[s.row, :s.start] == 0).any()}
    assert after_padding and after_padding <= _leaks(records)
    assert all("padding" in r.message for r in records
               if r.check == "leak" and r.verdict == "fail")


def _noisy_by(amplitude, kernel=dot_product):
    def noisy(q, k, v, seg, *, causal, scale):
        out = kernel(q, k, v, seg, causal=causal, scale=scale)
        noise = jax.pure_callback(lambda: np.random.default_rng().standard_normal(out.shape)
                                  .astype(np.float32) * amplitude,
                                  jax.ShapeDtypeStruct(out.shape, jnp.float32))
        return out + jax.lax.stop_gradient(noise).astype(out.dtype)
    return noisy


_noisy = _noisy_by(1.0)  # run-to-run noise as large as the values: nothing to compare


def test_a_segment_no_run_leaves_untouched_is_not_compared_not_passed():
    """One unpacked row and no padding: nothing else to redraw, nothing compared (without the
    causal mask). Causal, its tail from a cut is redrawn: out and dq of the queries before it
    are compared, dk and dv of no key (each depends on a later query), and the record says so."""
    alone = Case("unpacked/full", 1, 64, 2, 2, 16, "float32", 0, causal=False)
    leak = [r for r in _run_measured(Kernel("dp", dot_product), alone) if r.check == "leak"]
    assert [r.verdict for r in leak] == ["unprobed"] and leak[0].outcome == "unjudged"
    assert "not compared" in leak[0].message
    causal = Case("unpacked/full", 1, 64, 2, 2, 16, "float32", 0)
    leak = [r for r in _run_measured(Kernel("dp", dot_product), causal) if r.check == "leak"]
    assert [(r.verdict, r.probed, r.unprobed) for r in leak] == \
        [("pass", ["out", "dq"], ["dk", "dv"])]
    assert "not compared here: dk, dv" in leak[0].message
    # Two unpacked rows: each is compared while the other row is redrawn (a leak across rows).
    two = Case("unpacked/full", 2, 64, 2, 2, 16, "float32", 0)
    leak = [r for r in _run_measured(Kernel("dp", dot_product), two) if r.check == "leak"]
    assert [r.verdict for r in leak] == ["pass", "pass"]


def test_leak_probe_lists_what_is_not_reproducible_as_unprobed():
    case = Case("packed/random", 2, 128, 2, 2, 16, "float32", 0)
    leak = [r for r in _run(Kernel("noisy", _noisy), case) if r.check == "leak"]
    assert leak and all(r.verdict == "pass" and r.outcome == "ok" for r in leak)
    assert all(r.unprobed == ["out"] and r.probed == ["dq", "dk", "dv"] for r in leak)
    assert all("not probed (its largest run-to-run change at least 1% of its largest value): "
               "out" in r.message for r in leak)


def test_a_probe_that_compared_no_token_still_reruns_to_say_what_is_not_reproducible():
    """One unpacked row without padding: no run leaves a token untouched, so nothing moving
    says nothing of the kernel's noise; the reruns are made and name it, as on a packed row."""
    alone = Case("unpacked/full", 1, 64, 2, 2, 16, "float32", 0, causal=False)
    leak = [r for r in _run_measured(Kernel("noisy_alone", _noisy), alone) if r.check == "leak"]
    assert [r.verdict for r in leak] == ["unprobed"] and "not compared" in leak[0].message
    assert leak[0].unprobed == ["out"] and leak[0].probed == ["dq", "dk", "dv"]


def test_a_tensor_with_small_run_to_run_noise_is_probed_above_it():
    """Like TE's dq on some shapes even in its deterministic mode: a few roundings of noise.
    The probe still compares it, counting changes above the noise (confirmed twice), says so,
    and still catches a leak there; a correct kernel with that noise passes."""
    case = Case("packed/random", 2, 128, 2, 2, 16, "float32", 0)
    leak = [r for r in _run(Kernel("noisy_small", _noisy_by(1e-5)), case) if r.check == "leak"]
    assert leak and all(r.verdict == "pass" for r in leak)
    assert all(r.probed == ["out", "dq", "dk", "dv"] and not r.unprobed for r in leak)
    assert all(set(r.gated) == {"out"} and 0 < r.gated["out"] < 1e-3 for r in leak)
    assert all("above run-to-run noise only" in r.message for r in leak)
    from harness.kernels.reference import ignores_segments
    leaky = Kernel("noisy_leaky", _noisy_by(1e-5, ignores_segments),
                   expect=lambda c, check, s: "either" if check != "leak" else (
                       "fail" if c.segments_in_row(s.row) > 1 else "pass"))
    records = _run(leaky, case)
    leak = [r for r in records if r.check == "leak"]
    # Causal only: later segments read earlier keys; earlier keys' dk/dv see later queries.
    assert {(r.row, r.segment) for r in leak if r.verdict == "fail"} == \
        {(s.row, s.number) for s in case.segments if case.segments_in_row(s.row) > 1}
    # The noisy output itself shows the leak above its noise where the segment reads across.
    assert all("untouched: out" in r.message for r in leak if r.start > 0)


def test_a_leak_that_turns_a_noisy_tensor_nan_is_caught():
    """NaN where the base value was a number is a change above any noise threshold (a leak that
    reads padding poison in float16 can end that way); NaN against NaN is no change."""
    from harness.model.case import make_inputs
    case = Case("packed/random", 2, 128, 2, 2, 16, "float32", 0)
    later = case.segment_ids > 1
    base = (make_inputs(case).query[:, :, 0, 0].astype(np.float32) * later).sum(axis=1)

    def nan_leak(q, k, v, seg, *, causal, scale):
        out = dot_product(q, k, v, seg, causal=causal, scale=scale)
        # Segment 1 of a row turns NaN when a later segment's query is not what it was.
        now = jnp.where(seg > 1, q[:, :, 0, 0], 0).astype(jnp.float32).sum(axis=1)
        moved = jnp.abs(now - jnp.asarray(base)) > 1e-3
        poison = jnp.where(moved[:, None] & (seg == 1), jnp.nan, 0.0)
        return out + jax.lax.stop_gradient(poison)[:, :, None, None].astype(out.dtype)

    leaky = Kernel("nan_leak", _noisy_by(1e-5, nan_leak), backward=False,
                   expect=lambda c, check, s: "fail" if check == "leak" and s.number == 1
                   and c.segments_in_row(s.row) > 1 else "pass")
    leak = [r for r in _run_measured(leaky, case) if r.check == "leak"]
    assert all(set(r.gated or {}) == {"out"} for r in leak), "the output is gated"
    assert {r.outcome for r in leak} == {"ok", "caught"}, [r.message for r in leak]
    assert {(r.row, r.segment) for r in leak if r.outcome == "caught"} == \
        {(s.row, s.number) for s in case.segments if s.number == 1 and case.segments_in_row(s.row) > 1}


def test_a_kernel_expected_to_leak_that_cannot_be_probed_is_not_ok():
    case = Case("packed/random", 2, 128, 2, 2, 16, "float32", 0)

    def expect_leak(case, check, segment):
        return "fail" if check == "leak" else "pass"

    # Forward only, and the output differs run to run: nothing can be probed at all.
    kernel = Kernel("noisy_leaker", _noisy, expect=expect_leak, backward=False)
    leak = [r for r in _run_measured(kernel, case) if r.check == "leak"]
    assert leak and {r.verdict for r in leak} == {"unprobed"}
    assert {r.outcome for r in leak} == {"missed"}, "an expected leak nobody saw is not ok"
    # Where a leak was expected but the probed tensors did not change, that is missed too.
    partly = Kernel("noisy_leaker_2", _noisy, expect=expect_leak)
    assert {r.outcome for r in _run_measured(partly, case) if r.check == "leak"} == {"missed"}


def _run_measured(kernel, case):
    return run_kernel_case(kernel, case, CPU).records


def test_unjudged_checks_need_the_probe_on_their_segment():
    """An expectation that leaves a check unjudged needs the leak probe on that segment: with
    the probe off (--no-leak-probe) the check did not run, and says so; with the probe on but
    not judging that segment, nothing judged it: missed."""
    from harness.judge import judging
    case = Case("packed/random", 2, 128, 2, 2, 16, "float32", 0)
    kernel = Kernel("dp_either", dot_product, expect=lambda c, check, s: "either")
    records = run_kernel_case(kernel, case, CPU, leak=False).records
    tolerance = [r for r in records if r.check in ("out", "dq", "dk", "dv")]
    assert tolerance and {r.outcome for r in tolerance} == {"not run"}
    again = judging.cover_unjudged([r.replace(outcome="unjudged") for r in tolerance],
                                   probed=True)
    assert {r.outcome for r in again if r.check in ("out", "dq", "dk", "dv")} == {"missed"}


def _rarely_noisy(token):
    """Reproducible but for a tiny change on one token in the 2nd run (the first perturbation's,
    after the run on unchanged inputs): nondeterminism that the reruns it asks for miss."""
    def kernel(q, k, v, seg, *, causal, scale):
        out = dot_product(q, k, v, seg, causal=causal, scale=scale)
        counter = {"n": 0}

        def noise():
            counter["n"] += 1
            x = np.zeros(out.shape, np.float32)
            if counter["n"] == 2:
                x[0, token, 0, 0] = 1e-3
            return x

        n = jax.pure_callback(noise, jax.ShapeDtypeStruct(out.shape, jnp.float32))
        return out + jax.lax.stop_gradient(n).astype(out.dtype)
    return kernel


def test_a_leak_on_an_uncertain_build_must_show_twice():
    """Noise that slipped past the reruns lands on one run's token, not on the same token of
    a confirming run; a real leak changes its tokens every time."""
    from harness.judge import leak_probe, probe_groups
    from harness.model.case import make_inputs
    from harness.engine.programs import Programs
    case = Case("packed/random", 2, 128, 2, 2, 16, "float32", 0)
    first_group = probe_groups.groups(case)[0][1]              # what run 2 redraws
    second = next(s for s in case.segments                  # a segment it leaves untouched
                  if s.row == 0 and not first_group[0, s.start:s.stop].any())
    inputs = make_inputs(case)
    unconfirmed = leak_probe.probe(Programs().get(Kernel("noisy_a", _rarely_noisy(second.start)),
                                                  case), inputs, case)
    assert [leak.segment for leak in unconfirmed.leaks if leak.leaked] == [second], \
        "without confirmation, the noise reads as a leak"
    from harness.judge import judging
    from harness.judge.record import Record
    noisy_b = Kernel("noisy_b", _rarely_noisy(second.start))
    confirmed = leak_probe.probe(Programs().get(noisy_b, case), inputs, case, confirm=True)
    assert not any(leak.leaked for leak in confirmed.leaks)
    # Its reruns agreed, so out was compared bitwise; the two runs of the perturbation did not
    # agree, and that is said: out is not reproducible (and the census reads no).
    assert confirmed.gated == {} and confirmed.unsteady == ["out"] and unconfirmed.unsteady == []
    records = judging.leak_records(noisy_b, case, confirmed, "default")
    assert all(r.unsteady == ["out"] and r.verdict == "pass" and "not reproducible: out "
               "differed between two runs of one perturbation" in r.message for r in records)
    assert Record.from_json(records[0].to_json()).unsteady == ["out"]
    from harness.tools.census.table import backward_summary
    summary = backward_summary("noisy_b", records)
    assert summary["reproducible"] is False and summary["unsteady"] == {"out": len(records)}
    assert "out differed between two runs of one perturbation" in summary["text"]
    from harness.views.summary import not_judged_lines
    assert f"noisy_b leak: out not reproducible in the probes of {len(records)} segments " \
           "(two runs of one perturbation differed" in "\n".join(not_judged_lines(records))
    leaky = Programs().get(Kernel("off_by_one", _off_by_one), case)
    found = leak_probe.probe(leaky, inputs, case, reruns=6, confirm=True)
    assert any(leak.leaked for leak in found.leaks), "a real leak still shows"
    assert found.unsteady == [], "a leak moves its tokens in both runs: reproducible"


class _Counted:
    """A program that counts its runs (no `launch`: the probe runs it one run at a time)."""

    def __init__(self, program):
        self.program, self.runs = program, 0

    def __call__(self, *args):
        self.runs += 1
        return self.program(*args)


def _pads_with_the_sum(q, k, v, seg, *, causal, scale):
    """Correct on every segment; at padding, the sum of every query (undefined there)."""
    out = dot_product(q, k, v, seg, causal=causal, scale=scale)
    return jnp.where((seg == 0)[:, :, None, None], q.sum().astype(out.dtype), out)


def _leaks_in_out_only(q, k, v, seg, *, causal, scale):
    """_off_by_one's output with dot_product's gradients: a leak only the output shows."""
    good = dot_product(q, k, v, seg, causal=causal, scale=scale)
    return good + jax.lax.stop_gradient(_off_by_one(q, k, v, seg, causal=causal, scale=scale)
                                        - good)


@pytest.mark.parametrize("gated", [False, True], ids=["bitwise", "gated"])
def test_a_second_run_is_made_only_where_the_first_moved_a_token_that_must_not_move(gated):
    """Confirming (GPUs; the gated tensors always) runs a perturbation again only for the
    groups whose first run changed a segment's token that must not move: on a kernel without
    leaks (whatever it writes at padding) one run per group; on a leaking one a second run for
    each group that moved one, and a reproducible kernel's leaks as its runs made once say.
    Reruns on unchanged inputs are made only where a perturbation moved such a token (a noisy
    tensor's noise does): a reproducible kernel without leaks gets none."""
    from harness.engine.programs import Programs
    from harness.judge import leak_probe, probe_groups
    from harness.model.case import make_inputs
    case = Case("padded/left", 2, 256, 2, 2, 16, "float32", 0)   # two colours and padding
    inputs, groups = make_inputs(case), len(probe_groups.groups(case))
    # Gated: its output noisy by 1e-5 (thresholds from four reruns; each group run plain for
    # the bitwise gradients and amplified for the output); bitwise: reproducible.
    wrap, reruns, kinds = (lambda k: _noisy_by(1e-5, k), leak_probe.RERUNS_NOISY, 2) if gated \
        else (lambda k: k, leak_probe.RERUNS, 1)
    clean = _Counted(Programs().get(Kernel(f"clean_{gated}", wrap(dot_product)), case))
    found = leak_probe.probe(clean, inputs, case, confirm=True)
    assert bool(found.gated) == gated and not any(leak.leaked for leak in found.leaks)
    made = reruns if gated else 0   # no token that must not move moved: no rerun
    assert clean.runs == 1 + made + kinds * groups
    # Padding outputs are undefined: one that moves with every perturbation asks for no second.
    padded = _Counted(Programs().get(Kernel(f"padded_{gated}", wrap(_pads_with_the_sum)), case))
    found = leak_probe.probe(padded, inputs, case, confirm=True)
    assert not any(leak.leaked for leak in found.leaks)
    assert padded.runs == 1 + made + kinds * groups
    # A leak in the output only (gated: the amplified perturbation's tensor; bitwise: the
    # plain one's): one second run per group that moved it, of that perturbation only.
    leaky = _Counted(Programs().get(Kernel(f"leaky_{gated}", wrap(_leaks_in_out_only)), case))
    found = leak_probe.probe(leaky, inputs, case, confirm=True)
    moved = {g for leak in found.leaks for g in leak.by}
    assert 0 < len(moved) < groups and {n for leak in found.leaks for n in leak.leaked} == {"out"}
    assert leaky.runs == 1 + reruns + kinds * groups + len(moved)
    if not gated:   # a reproducible kernel moves the same tokens twice: nothing to confirm
        once = _Counted(Programs().get(Kernel("leaky_once", _leaks_in_out_only), case))
        assert leak_probe.probe(once, inputs, case) == found
        assert once.runs == 1 + reruns + groups


def test_a_deterministic_build_out_of_memory_is_retried_then_visibly_replaced(monkeypatch):
    """cuDNN's and TE's deterministic backward passes ask for tens of GiB on some rows (H200:
    64-128 GiB): retried once with the harness's caches let go, then the default build is
    probed with more reruns, and every record says so. Never a crash of the run."""
    from harness.judge import leak_probe
    from harness.engine.programs import Programs
    real, calls = leak_probe.probe, []

    def out_of_memory(times):
        def probe(program, inputs, case, *args, **kwargs):
            calls.append(kwargs)
            if len(calls) <= times:
                raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
                                   "128.00GiB with allocator GPU_0_bfc")
            return real(program, inputs, case, *args, **kwargs)
        return probe

    from harness.judge import oracle
    case = Case("packed/random", 2, 128, 2, 2, 16, "float32", 0)
    kernel = Kernel("dp", dot_product)
    monkeypatch.setattr(leak_probe, "probe", out_of_memory(1))
    # The next case's reference launched ahead goes too before the retry (GiBs on long rows).
    monkeypatch.setattr(oracle, "_launched", {("next case", None, "segment"): "its outputs"})
    leak = [r for r in run_kernel_case(kernel, case, CPU, Programs(platform="gpu")).records
            if r.check == "leak"]
    assert len(calls) == 2 and {r.mode for r in leak} == {"deterministic"}
    assert not oracle._launched
    calls.clear()
    monkeypatch.setattr(leak_probe, "probe", out_of_memory(2))
    leak = [r for r in run_kernel_case(kernel, case, CPU, Programs(platform="gpu")).records
            if r.check == "leak"]
    assert calls[-1] == {"reruns": leak_probe.RERUNS_UNCERTAIN, "confirm": True,
                         "reproducible": False, "convention": "segment"}
    assert {r.mode for r in leak} == {"default"} and {r.outcome for r in leak} == {"ok"}
    assert all("deterministic build failed (RuntimeError: RESOURCE_EXHAUSTED" in r.message
               and "128.00GiB" in r.message for r in leak)
    # More than the whole device: no retry (letting the caches go cannot make 128 GiB fit).
    from harness.engine import runner
    monkeypatch.setattr(runner, "device_memory_bytes", lambda: 100 * 2**30)
    calls.clear()
    monkeypatch.setattr(leak_probe, "probe", out_of_memory(1))
    leak = [r for r in run_kernel_case(kernel, case, CPU, Programs(platform="gpu")).records
            if r.check == "leak"]
    assert len(calls) == 2 and calls[-1]["reruns"] == leak_probe.RERUNS_UNCERTAIN
    assert {r.mode for r in leak} == {"default"}
    assert runner.requested_bytes("allocate 1.04TiB with") == int(1.04 * 2**40)


def test_a_deterministic_build_that_computes_something_else_is_not_probed(monkeypatch):
    """The probe compares a kernel's deterministic build with itself, so that build must compute
    what the default build computes. Seen on two H200s: XLA's deterministic rewrite of a
    gather's gradient (a scatter-add) mixed batch rows, and every context-parallel kernel read
    as leaking. A build that fails a tolerance check the default build passes is replaced by
    the default build, visibly; the records never blame the kernel for it."""
    from harness.engine import programs as programs_module
    from harness.engine import runner

    class RowsMixed:
        """A deterministic build whose gradients of rows 1.. take in row 0's (the bug seen)."""
        def __init__(self, program):
            self.program = program

        def __call__(self, *args):
            return self._mixed(self.program(*args))

        def launch(self, *args):   # the probe's runs, launched two at a time
            return self._mixed(self.program.launch(*args))

        @staticmethod
        def _mixed(out):
            out = list(out)
            out[1:] = [g.at[1:].add(g[:1]) for g in out[1:]]
            return tuple(out)

        def __getattr__(self, name):
            return getattr(self.program, name)

    real_get = programs_module.Programs.get

    def get(self, kernel, case, mode=programs_module.DEFAULT):
        program = real_get(self, kernel, case, mode)
        return RowsMixed(program) if mode == programs_module.DETERMINISTIC else program

    monkeypatch.setattr(programs_module.Programs, "get", get)
    case = Case("packed/random", 2, 128, 2, 2, 16, "float32", 0)
    kernel = Kernel("dp", dot_product)
    records = run_kernel_case(kernel, case, CPU, programs_module.Programs(platform="gpu")).records
    leak = [r for r in records if r.check == "leak"]
    assert leak and {r.mode for r in leak} == {"default"}
    assert {r.outcome for r in records if r.measured} == {"ok"}
    assert all("deterministic build disagrees with the default build (BuildDisagrees: it "
               "fails" in r.message and "dq r1s1" in r.message for r in leak), leak[0].message
    # Without the check, the same build reads as a leak on every segment of row 1.
    monkeypatch.setattr(runner, "_disagreement", lambda *args: None)
    records = run_kernel_case(kernel, case, CPU, programs_module.Programs(platform="gpu")).records
    leaked = {(r.row, r.outcome) for r in records if r.check == "leak"}
    assert (1, "fail") in leaked and (0, "ok") in leaked


def test_a_deterministic_build_that_cannot_fit_the_device_is_not_run(monkeypatch):
    """XLA knows a program's workspace when it compiles it: a build that needs more than the
    whole device is never run (an out-of-memory run is slow), and the record says why."""
    from harness.judge import leak_probe
    from harness.engine import programs as programs_module, runner
    from harness.engine.programs import Programs
    calls = []
    real = leak_probe.probe
    monkeypatch.setattr(leak_probe, "probe", lambda *a, **k: (calls.append(k), real(*a, **k))[1])
    monkeypatch.setattr(runner, "device_memory_bytes", lambda: 2**20)  # a 1 MiB device
    monkeypatch.setattr(programs_module.Program, "memory_bytes", lambda self: 2**40)
    case = Case("packed/random", 2, 128, 2, 2, 16, "float32", 0)
    leak = [r for r in run_kernel_case(Kernel("dp", dot_product), case, CPU,
                                       Programs(platform="gpu")).records if r.check == "leak"]
    assert calls == [{"reruns": leak_probe.RERUNS_UNCERTAIN, "confirm": True,
                      "reproducible": False, "convention": "segment"}], calls
    assert {r.mode for r in leak} == {"default"} and {r.outcome for r in leak} == {"ok"}
    assert all("DoesNotFit: needs 1024.0 GiB of device memory" in r.message for r in leak)


def test_a_probe_that_raises_is_an_error_of_the_leak_check_with_its_traceback(monkeypatch):
    """Named as every error is (its type and message), and kept with its frames."""
    from harness.judge import leak_probe

    def broken(*args, **kwargs):
        raise RuntimeError("the probe's own failure")
    monkeypatch.setattr(leak_probe, "probe", broken)
    case = Case("packed/random", 2, 128, 2, 2, 16, "float32", 0)
    leak = [r for r in _run_measured(Kernel("dp_probe_raises", dot_product), case)
            if r.check == "leak"]
    assert [(r.verdict, r.message) for r in leak] == \
        [("error", "leak probe: RuntimeError: the probe's own failure")]
    assert "in broken" in leak[0].traceback and "the probe's own failure" in leak[0].traceback


@pytest.mark.parametrize("written,fails", [("max", True), ("mean", False)])
def test_a_huge_finite_output_at_padding_fails_and_a_weighting_of_values_passes(written, fails):
    """An adversarial review's kernel wrote the dtype's largest finite number at padding:
    finite, so green, though the next residual add makes it inf and a zero cotangent times inf
    makes NaN in the weight gradients. A padding output past PADDING_OUTPUT_BOUND times the
    reference's largest valid |out| fails; one that is a weighting of value rows (each padding
    query reading every key alike) passes."""
    def kernel(q, k, v, seg, *, causal, scale):
        out = dot_product(q, k, v, seg, causal=causal, scale=scale)
        kv = jnp.repeat(v, q.shape[2] // v.shape[2], axis=2).mean(axis=1, keepdims=True)
        at_padding = (jnp.full_like(out, jnp.finfo(out.dtype).max) if written == "max"
                      else jnp.broadcast_to(kv, out.shape).astype(out.dtype))
        return jnp.where((seg > 0)[:, :, None, None], out, at_padding)
    case = Case("padded/between", 2, 256, 2, 2, 16, "bfloat16", 0)
    records = run_kernel_case(Kernel(f"pad_{written}", kernel, padding_anywhere=True), case,
                              CPU, leak=False).records
    padding = [r for r in records if r.check == "padding"]
    assert padding and all((r.verdict == "fail") == fails for r in padding), \
        [r.message for r in padding]
    if fails:
        assert all(r.message.startswith("out beyond 1000x the largest valid |out|")
                   for r in padding), [r.message for r in padding]
