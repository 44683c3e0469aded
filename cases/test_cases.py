"""Case ids reproduce cases exactly; inputs are fresh random, rounded, with padding poisoned."""
import numpy as np
import pytest

from harness.model.case import PADDING_POISON_SCALE, Case, make_inputs
from harness.model.suites import suite_cases


@pytest.mark.parametrize("case", suite_cases("smoke") + suite_cases("nightly"), ids=lambda c: c.id)
def test_case_id_round_trips(case):
    assert Case.from_id(case.id) == case


def test_bidirectional_case_id():
    case = Case("packed/random", 2, 64, 2, 1, 8, "bfloat16", 3, causal=False)
    assert case.id.endswith("-bidir") and Case.from_id(case.id) == case


@pytest.mark.parametrize("bad", ["packed/random-b2", "nope/x-b1-t8-h1kv1-d8-f32-s0",
                                 "packed/random-b1-t8-h1kv1-d8-f64-s0"])
def test_bad_case_ids_are_refused(bad):
    with pytest.raises(ValueError):
        Case.from_id(bad)


def test_heads_must_be_a_multiple_of_kv_heads():
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        Case("packed/random", 1, 64, 6, 4, 8, "float32", 0)


def test_inputs_are_seeded_random_with_poisoned_padding():
    case = Case("unpacked/pad-tail", 3, 128, 4, 2, 16, "bfloat16", seed=5)
    a, b = make_inputs(case), make_inputs(case)
    np.testing.assert_array_equal(np.asarray(a.query, np.float32), np.asarray(b.query, np.float32))
    other = make_inputs(Case("unpacked/pad-tail", 3, 128, 4, 2, 16, "bfloat16", seed=6))
    assert not np.array_equal(np.asarray(a.query, np.float32), np.asarray(other.query, np.float32))
    pad = case.segment_ids == 0
    assert pad.any()
    assert str(a.query.dtype) == "bfloat16"
    q = np.asarray(a.query, np.float32)
    assert np.abs(q[~pad]).std() < 1.5 < np.abs(q[pad]).std() < PADDING_POISON_SCALE * 1.5
    ct = np.asarray(a.cotangent, np.float32)
    assert (ct[pad] == 0).all() and (ct[~pad] != 0).mean() > 0.99
    assert (np.asarray(a.key, np.float32) != 0).mean() > 0.99, "never zeros"


def test_a_glob_over_a_cases_own_id_takes_every_seed():
    """`--cases '*-s0' --seeds 3` is three seeds of each seed-0 case (it once silently ran one);
    a glob over seeded ids still picks those seeds alone."""
    base = suite_cases("nightly", "*-b4-t2048-h8kv2-d128-bf16-s0")
    three = suite_cases("nightly", "*-b4-t2048-h8kv2-d128-bf16-s0", seeds=3)
    assert len(three) == 3 * len(base) == 39
    assert {c.seed for c in three} == {0, 1, 2}
    one = suite_cases("nightly", "packed/random-b4-t2048-h8kv2-d128-bf16-s2", seeds=1)
    assert [c.id for c in one] == ["packed/random-b4-t2048-h8kv2-d128-bf16-s2"]
    picked = suite_cases("nightly", "packed/random-b4-t2048-h8kv2-d128-bf16-s[2]", seeds=3)
    assert [c.seed for c in picked] == [2]


def test_the_smoke_suite_hands_each_feature_over_without_the_causal_mask_and_in_each_dtype():
    """A cold review's kernels read the bidirectional mask as causal whenever a soft cap, sinks
    or a value head dim was on, or dropped a feature at float16 only, and were green on every
    case of the suite: each feature now comes both ways and in each dtype."""
    cases = suite_cases("smoke")
    for name in ("window", "softcap", "chunk", "sinks", "head_dim_v"):
        have = [c for c in cases if name in c.features.names]
        assert {c.dtype for c in have} == {"float32", "bfloat16", "float16"}, name
        assert {c.causal for c in have} == {True, False}, name


@pytest.mark.parametrize("suite", ["smoke", "nightly"])
def test_each_feature_reaches_every_kind_of_kernel_the_review_found_it_missed(suite):
    """An adversarial review's kernels dropped a feature only where no feature case went: one
    sequence per row (`packed=False` kernels took the causal window alone), MHA without the
    causal mask (`gqa=False` kernels), one kv head, head dim 256; each was green on every case
    of the suite. Each feature now reaches a kernel of one sequence per row and of MHA alone
    (both masks where the feature has both), and a window and soft cap reach MQA at head dim
    256."""
    cases = suite_cases(suite)
    rows = [c for c in cases if c.layout == "unpacked/pad-tail"]
    mha = [c for c in cases if c.heads == c.kv_heads]
    for name in ("window", "softcap", "chunk", "sinks", "head_dim_v"):
        assert any(name in c.features.names for c in rows), name
        assert {c.causal for c in mha if name in c.features.names} >= (
            {True} if suite == "nightly" else {True, False}), name
    for name in ("window", "softcap"):
        assert any(name in c.features.names and c.kv_heads == 1 and c.head_dim == 256
                   for c in cases), name
    assert any(c.features.window and not c.causal for c in rows)
    if suite == "nightly":
        assert any(c.features.window and c.seq_len > 2048 for c in cases)


def test_an_exact_case_id_outside_the_suite_is_that_case_and_a_bad_one_says_why():
    """--cases takes any case id as is (the suites do not pair every feature with every mask
    and dtype): there was no way to ask for one outside them. An id whose features cannot go
    together says why; a glob or text that is no id says it matches nothing."""
    from harness.errors import UsageError
    wanted = "packed/random-b4-t256-h4kv2-d64-f16-s6-bidir-cap2"
    assert [c.id for c in suite_cases("smoke", wanted)] == [wanted]
    assert [c.seed for c in suite_cases("smoke", wanted, seeds=2)] == [6, 7]
    with pytest.raises(UsageError, match="a causal mask reads nothing"):
        suite_cases("smoke", "packed/random-b4-t256-h4kv2-d64-f16-s6-w3.2")
    with pytest.raises(UsageError, match=r"'packed/x-\*' matches no case of suite 'smoke' and"):
        suite_cases("smoke", "packed/x-*")
    with pytest.raises(UsageError, match="has none of --features window"):
        suite_cases("smoke", wanted, features=["window"])


def test_mask_only_features_share_one_draw():
    """A case and the case less its window, soft cap or chunks (a diagnosis's reference) draw
    the same inputs, once: the one Inputs object. Sinks and a value head dim change what is
    drawn, so they draw their own."""
    import dataclasses

    from harness.model.features import Features
    case = Case("packed/random", 2, 64, 2, 1, 8, "bfloat16", 5,
                features=Features(window=(7, 0), softcap=2.0, chunk=16, sinks=True))
    drawn = make_inputs(case)
    for name in ("window", "softcap", "chunk"):
        without = dataclasses.replace(case, features=case.features.without(name))
        assert make_inputs(without) is drawn, name
    no_sinks = make_inputs(dataclasses.replace(case, features=case.features.without("sinks")))
    assert no_sinks is not drawn and no_sinks.sinks is None and drawn.sinks is not None
    # What the shared draw holds is what the case would draw on its own.
    from harness.model.case import _drawn
    own = _drawn.__wrapped__(case)
    assert own is not drawn
    assert all(np.array_equal(a, b) for a, b in zip(own.args, drawn.args))


def test_a_run_draws_inputs_only_for_cases_a_pair_runs_on(monkeypatch):
    """The cases drawn ahead are those some selected kernel runs on: a kernel's unsupported
    cases are skips, and their inputs were drawn (and waited for) for nothing. The skip records
    are written all the same."""
    import dataclasses

    from harness.engine import runner
    from harness.engine.programs import Programs
    from harness.engine.registry import select_kernels
    from harness.kernels.kernel import Platform

    kernel = dataclasses.replace(select_kernels(["xla"])[0], dtypes=("float32",))
    runs = Case("packed/random", 2, 64, 2, 2, 8, "float32", seed=3)
    skipped = Case("packed/random", 2, 64, 2, 2, 8, "bfloat16", seed=4)
    drawn = []
    real = runner.make_inputs
    monkeypatch.setattr(runner, "make_inputs", lambda case: drawn.append(case) or real(case))
    programs = Programs()
    try:
        out = runner.run_matrix([kernel], [skipped, runs], Platform("cpu"), programs=programs,
                                leak=False)
    finally:
        programs.close()
    assert skipped not in drawn and runs in drawn
    by_case = {r.case_id: r.verdict for r in out.records}
    assert by_case[skipped.id] == "skip" and runs.id in by_case
