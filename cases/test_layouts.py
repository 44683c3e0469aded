"""Segment layouts: each family has its edge cases, and bad segment ids are refused by name."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.layouts import LAYOUTS, SegmentIdError, check_segment_ids, segment_ids_from_rows


def segments_of(layout, batch=6, seq_len=256, seed=0):
    return check_segment_ids(LAYOUTS[layout].segment_ids(batch, seq_len, seed))


def boundaries(segs):
    return {s.start for s in segs if s.number > 1}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("seed", [0, 1, 7])
def test_every_layout_is_valid_and_reproducible(layout, seed):
    a = LAYOUTS[layout].segment_ids(5, 256, seed)
    b = LAYOUTS[layout].segment_ids(5, 256, seed)
    assert a.dtype == np.int32 and a.shape == (5, 256)
    np.testing.assert_array_equal(a, b)
    segs = check_segment_ids(a)
    assert {s.row for s in segs} == set(range(5)), "every row holds at least one segment"


def test_unpacked_layouts_have_one_segment_per_row_and_pad_tail_pads():
    assert all(s.number == 1 for s in segments_of("unpacked/full"))
    segs = segments_of("unpacked/pad-tail")
    assert all(s.number == 1 and s.stop < 256 for s in segs)
    assert segs[0].stop == 255, "row 0 loses exactly one token"


def test_packed_layouts():
    many = segments_of("packed/many")
    assert max(s.number for s in many) > 4
    ragged = segments_of("packed/ragged")
    counts = [sum(s.row == r for s in ragged) for r in range(6)]
    assert counts == [1, 2, 3, 4, 5, 6], "rows of one batch hold different counts"
    rnd = segments_of("packed/random")
    assert all(sum(s.row == r for s in rnd) >= 2 for r in range(6))


def test_block_edge_boundaries_cover_63_to_129():
    seen = set()
    for seed in range(3):
        seen |= boundaries(segments_of("unaligned/block-edges", seed=seed))
    assert {63, 64, 65, 127, 128, 129} <= seen


def test_extremes():
    single = segments_of("extremes/single-tokens", batch=4)
    assert any(s.length == 1 and s.start == 0 for s in single)
    assert any(s.length == 1 and s.stop == 256 for s in single), "single token at the last position"
    long = segments_of("extremes/long", batch=3)
    assert max(s.length for s in long) >= 255
    assert any(s.stop == 256 for s in long), "a segment ending at the last position"
    heavy = segments_of("extremes/pad-heavy", batch=3)
    assert all(max(s.stop for s in heavy if s.row == r) <= 192 for r in range(3))


@pytest.mark.parametrize("ids, message", [
    ([[1, 1, 2, 2, 1, 0]], "not contiguous"),
    ([[1, 1, 0, 2, 2, 0]], "padding (0) at position 2"),
    ([[1, 1, 3, 3, 0, 0]], "numbered 1..M in order"),
    ([[2, 2, 2, 0, 0, 0]], "numbered 1..M in order"),
    ([[1, -1, 0, 0, 0, 0]], "negative"),
    ([[1, 2, 3, 4, 5, 0]], "more than max_segments=4"),
])
def test_bad_segment_ids_are_refused_by_name(ids, message):
    with pytest.raises(SegmentIdError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_segment_ids(np.array(ids, np.int32), max_segments=4)


def test_shapes_and_dtypes_are_checked():
    with pytest.raises(SegmentIdError, match="must be \\[batch, seq\\]"):
        check_segment_ids(np.ones(5, np.int32))
    with pytest.raises(SegmentIdError, match="integers"):
        check_segment_ids(np.ones((1, 5), np.float32))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(1, 40), min_size=1, max_size=8), min_size=1, max_size=4),
       st.integers(0, 10))
def test_rows_round_trip_through_segment_ids(rows, pad):
    seq_len = max(sum(r) for r in rows) + pad
    segs = check_segment_ids(segment_ids_from_rows(rows, seq_len))
    assert [[s.length for s in segs if s.row == r] for r in range(len(rows))] == rows
