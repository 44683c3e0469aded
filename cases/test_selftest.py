"""The harness's bug zoo (python -m harness selftest): every bug caught, exactly where it lives,
no correct kernel flagged; an uncatchable entry or a flagged correct kernel turns it red."""
import io

import pytest
from rich.console import Console

from harness import cli
from harness.tools import selftest, zoo
from harness.model.case import Case
from harness.errors import UsageError
from harness.kernels.kernel import Kernel
from harness.engine.registry import select_kernels

SMALL = (Case("packed/random", 2, 64, 2, 1, 16, "float32", seed=0),)


def _row_before(case, seg):
    return case.segment_ids[seg.row, :seg.start]


def _case_of(res):
    return selftest.SELFTEST_CASES[res.case_index]


def _tile_split(case, seg, tile=zoo.BLOCK_TILE):
    return seg.start % tile != 0 or (seg.start + seg.length) % tile != 0


def _reads_wrong_ids(case, r):
    """The worst token of an out/dq catch reads under the ids it took from another token (or,
    for a gradient of the keys or the probe, its segment is one the forgotten reorder moves)."""
    from harness.kernels.load_balance import forgotten_reorder_expectation, forgotten_reorder_masks
    from harness.model.layouts import Segment
    if r.check in ("out", "dq"):
        wrong, right = forgotten_reorder_masks(case.segment_ids[r.row:r.row + 1], case.causal)
        return not (wrong[0, r.worst_token] == right[0, r.worst_token]).all()
    seg = Segment(r.row, r.segment, r.start, r.length)
    return forgotten_reorder_expectation(case, r.check, seg) != "pass"


# Where each bug lives: its first catch must be there (a bug caught anywhere else would be
# caught by accident, and the case that should show it would prove nothing).
WHERE = {
    "off_by_one_boundary": lambda c, r: r.segment > 1 and r.worst_token == r.start,
    "block_granular_mask": lambda c, r: _tile_split(c, r),
    "wrong_gqa_mapping": lambda c, r: c.gqa,
    "gqa_grad_mean": lambda c, r: c.gqa and r.check in ("dk", "dv"),
    "padding_keys_attended": lambda c, r: c.padding_inside and (_row_before(c, r) == 0).any(),
    "scale_applied_twice": lambda c, r: r.check == "out",
    "segment_ids_folded": lambda c, r: c.layout == "packed/dozens"
    and r.segment > zoo.FOLD,
    "local_window_512": lambda c, r: c.layout == "unaligned/long-edges"
    and r.length > zoo.WINDOW and r.worst_token - r.start >= zoo.WINDOW,
    "dq_only_leak": lambda c, r: r.check == "dq" and r.segment > 1,
    # The output right, its tangent reading earlier segments: the jvp check, past segment 1.
    "jvp_ignores_segments": lambda c, r: r.check == "jvp" and r.segment > 1,
    "dkdv_only_leak": lambda c, r: r.check in ("dk", "dv"),
    "single_tokens_zeroed": lambda c, r: r.length == 1,
    "last_segment_unmasked": lambda c, r: r.segment > 1
    and r.segment == c.segments_in_row(r.row),
    "causal_first_segment_only": lambda c, r: c.causal and r.segment > 1,
    "causal_flag_ignored": lambda c, r: not c.causal,
    "lengths_only_segments": lambda c, r: c.padding_inside and (_row_before(c, r) == 0).any(),
    "mask_after_softmax": lambda c, r: r.segment > 1,
    # Padding hygiene: caught by the padding check on a row with padding, at a padding position.
    "nan_output_at_padding": lambda c, r: r.check == "padding"
    and c.segment_ids[r.row, r.worst_token] == 0 and "out non-finite" in r.message,
    "grads_at_padding": lambda c, r: r.check == "padding"
    and c.segment_ids[r.row, r.worst_token] == 0 and "dq non-zero" in r.message,
    "nan_grads_at_padding": lambda c, r: r.check == "padding"
    and c.segment_ids[r.row, r.worst_token] == 0 and "dk non-finite" in r.message,
    "float32_output": lambda c, r: r.check == "contract" and "float32" in r.message,
    "reorder_forgets_segments": _reads_wrong_ids,
    # The feature bugs: on their feature's case, at a query beyond what the feature allows.
    "window_dropped": lambda c, r: c.features.window is not None
    and r.worst_token - r.start > c.features.window[0],
    "window_off_by_one": lambda c, r: c.features.window is not None
    and r.worst_token - r.start > c.features.window[0],
    "window_from_row_start": lambda c, r: c.features.window is not None and r.start > 0,
    "softcap_dropped": lambda c, r: c.features.softcap is not None,
    "chunk_dropped": lambda c, r: c.features.chunk is not None
    and r.worst_token - r.start >= c.features.chunk,
    "sinks_ignored": lambda c, r: c.features.sinks and r.check == "out",
    "sinks_gradient_zero": lambda c, r: c.features.sinks and r.check == "dsinks",
    "causal_with_cap_or_sinks": lambda c, r: not c.causal
    and (c.features.softcap is not None or c.features.sinks),
}


def test_selftest_catches_every_bug_where_it_lives_and_flags_no_correct_kernel():
    """The CI check: the whole selftest, as `python -m harness selftest` runs it."""
    entries = zoo.entries()
    bugs = [e for e in entries if not e.correct]
    assert len(bugs) >= 12 and len({e.bug for e in bugs}) == len(bugs)
    assert sum(e.correct for e in entries) >= 3
    assert set(WHERE) == {e.name for e in bugs}, "every bug says where it must be caught"

    results = selftest.run(entries)
    verdicts = {r.entry.name: r.verdict for r in results}
    assert verdicts == {e.name: "ok" if e.correct else "CAUGHT" for e in entries}
    for res in results:
        if res.entry.correct:
            assert res.first is None and res.cases_run == len(selftest.SELFTEST_CASES)
            assert res.worst_ratio < 0.8, f"{res.entry.name}: little margin left"
            continue
        r, case = res.first, _case_of(res)
        assert r.case_id == case.id and r.outcome == "fail"
        assert WHERE[res.entry.name](case, r), (res.entry.name, case.id, r.check,
                                                r.segment_label, r.worst_token)
        # A broken kernel stops at the case that catches it.
        assert res.cases_run == res.case_index + 1

    out = io.StringIO()
    selftest.report(results, selftest.SELFTEST_CASES, 12.3, Console(file=out))
    text = out.getvalue()
    assert f"{len(bugs)}/{len(bugs)} bugs caught" in text and "wall time 12.3 s" in text
    for e in entries:
        line = next(x for x in text.splitlines() if f"| {e.name} " in x)
        assert ("CAUGHT" in line) != e.correct and e.bug in line


def test_an_uncatchable_bug_makes_the_selftest_fail(capsys):
    """A correct kernel presented as a bug cannot be caught: MISSED, exit status 1."""
    correct = next(e for e in zoo.entries() if e.name == "ok_additive_bias")
    planted = zoo.Entry(correct.kernel, "a correct kernel posing as a bug")
    assert selftest.main(None, zoo=[planted], cases=SMALL) == 1
    out = capsys.readouterr().out
    assert "MISSED" in out and "0/1 bugs caught" in out and "FAIL" in out


def test_a_flagged_correct_kernel_makes_the_selftest_fail(capsys):
    broken = next(e for e in zoo.entries() if e.name == "scale_applied_twice")
    posing = zoo.Entry(broken.kernel, "a broken kernel posing as correct", correct=True)
    assert selftest.main(None, zoo=[posing], cases=SMALL) == 1
    out = capsys.readouterr().out
    assert "FLAGGED" in out and "0/1 correct kernels unflagged" in out


def test_a_kernel_that_raises_is_an_error_not_a_catch(capsys):
    def raises(q, k, v, seg, *, causal, scale):
        raise RuntimeError("boom")
    entry = zoo.Entry(Kernel("raises", raises), "raises instead of computing")
    assert selftest.main(None, zoo=[entry], cases=SMALL) == 1
    out = capsys.readouterr().out
    assert "ERROR" in out and "boom" in out


def test_bugs_selects_entries_and_unknown_names_are_usage_errors(capsys):
    entries = zoo.entries()
    chosen = selftest.select("ok_float64, scale_applied_twice", entries)
    assert [e.name for e in chosen] == ["ok_float64", "scale_applied_twice"]
    with pytest.raises(UsageError, match="unknown zoo entry nope; known: off_by_one_boundary"):
        selftest.select("scale_applied_twice,nope", entries)
    with pytest.raises(UsageError):
        selftest.main("nope")
    assert cli.main(["selftest", "--bugs", "nope,nada"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "unknown zoo entries nope, nada" in err


def test_zoo_kernels_are_never_registered():
    registered = {k.name for k in select_kernels()}
    assert not registered & {e.name for e in zoo.entries()}
