"""Segment layouts: each family has its edge cases, and bad segment ids are refused by name."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.model.layouts import LAYOUTS, SegmentIdError, check_segment_ids, segment_ids_from_rows


def segments_of(layout, batch=6, seq_len=256, seed=0):
    lay = LAYOUTS[layout]
    return check_segment_ids(lay.segment_ids(batch, max(seq_len, lay.min_seq_len), seed),
                             padding=lay.padding)


def boundaries(segs):
    return {s.start for s in segs if s.number > 1}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("seed", [0, 1, 7])
def test_every_layout_is_valid_and_reproducible(layout, seed):
    lay = LAYOUTS[layout]
    t = max(256, lay.min_seq_len)
    a = lay.segment_ids(5, t, seed)
    b = lay.segment_ids(5, t, seed)
    assert a.dtype == np.int32 and a.shape == (5, t)
    np.testing.assert_array_equal(a, b)
    segs = check_segment_ids(a, padding=lay.padding)
    if lay.padding == "tail":
        check_segment_ids(a)  # MaxText's convention holds
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


def test_long_rows_cross_512_and_1024():
    segs = segments_of("unaligned/long-edges", batch=4, seq_len=1152)
    assert any(s.start == 0 and s.length == 1152 for s in segs), "one segment across both"
    assert {511, 512, 513, 1023, 1024, 1025} <= boundaries(segs)


def test_padding_before_and_between_segments():
    left = LAYOUTS["padded/left"].segment_ids(6, 256, 0)
    assert (left[:, 0] == 0).all(), "every row starts with padding"
    between = segments_of("padded/between", batch=8)
    ids = LAYOUTS["padded/between"].segment_ids(8, 256, 0)
    gaps = [s.start - prev.stop for prev, s in zip(between, between[1:]) if s.row == prev.row]
    assert gaps and min(gaps) == 1 and max(gaps) > 1, "single-token and longer gaps"
    aligned = [s for s in between if s.row % 4 == 0]
    assert all(s.start % 16 == 0 for s in aligned), "row 0: every segment starts 16-aligned"
    with pytest.raises(SegmentIdError, match="padding must follow the last segment"):
        check_segment_ids(ids)  # MaxText's convention refuses them, naming the position
    assert sum(s.number for s in segments_of("packed/dozens", batch=2, seq_len=1024)
               if s.number >= 16) > 0, "16 or more segments in a row"


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


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(-5, 30).filter(bool), min_size=1, max_size=8)
                .filter(lambda r: any(n > 0 for n in r)), min_size=1, max_size=4))
def test_runs_with_padding_round_trip(rows):
    from harness.model.layouts import rows_of
    seq_len = max(sum(abs(n) for n in r) for r in rows)
    ids = segment_ids_from_rows(rows, seq_len)
    merged = []
    for r in rows:  # adjacent padding runs merge; trailing padding is implicit
        out = []
        for n in r:
            if out and n < 0 and out[-1] < 0:
                out[-1] += n
            else:
                out.append(n)
        while out and out[-1] < 0:
            out.pop()
        merged.append(tuple(out))
    assert rows_of(ids) == tuple(merged)
    check_segment_ids(ids, padding="anywhere")
