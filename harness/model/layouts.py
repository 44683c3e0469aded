"""Segment layouts: how packed rows are laid out, how they are checked, and the named families.

Segment ids are int32 of shape [batch, seq]; the segments of a row are contiguous runs numbered
1..M in order; 0 is padding. In MaxText's convention padding only follows the last segment
(`padding="tail"`, what the packed cuDNN lowering can represent); Transformer Engine's THD layout
also allows padding before and between segments (`padding="anywhere"`: left-padded rows, and
`pad_between_seqs`, which context parallelism uses for alignment).
"""
from __future__ import annotations

import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np


class SegmentIdError(ValueError):
    """Segment ids that no packed attention kernel can honour."""


@dataclass(frozen=True)
class Segment:
    row: int
    number: int  # 1-based, as in the segment ids
    start: int
    length: int

    @property
    def stop(self) -> int:
        return self.start + self.length

    @property
    def label(self) -> str:
        return f"r{self.row}s{self.number}"


def _runs(row: np.ndarray) -> list[tuple[int, int, int]]:
    """(value, start, length) for each maximal run of equal values."""
    edges = np.flatnonzero(np.diff(row)) + 1
    starts = np.concatenate([[0], edges])
    stops = np.concatenate([edges, [row.size]])
    return [(int(row[s]), int(s), int(e - s)) for s, e in zip(starts, stops)]


def check_segment_ids(segment_ids, max_segments: int | None = None,
                      padding: str = "tail") -> list[Segment]:
    """Validates segment ids and returns their segments; raises SegmentIdError naming the problem.
    `padding`: "tail" (MaxText: padding only after the last segment) or "anywhere"."""
    seg = np.asarray(segment_ids)
    if seg.ndim != 2:
        raise SegmentIdError(f"segment_ids must be [batch, seq], got shape {seg.shape}")
    if not np.issubdtype(seg.dtype, np.integer):
        raise SegmentIdError(f"segment_ids must be integers, got dtype {seg.dtype}")
    segments: list[Segment] = []
    for r in range(seg.shape[0]):
        expected = 1
        seen_padding_at = None
        for value, start, length in _runs(seg[r]):
            if value < 0:
                raise SegmentIdError(f"row {r}: negative segment id {value} at position {start}")
            if value == 0:
                seen_padding_at = start
                continue
            if seen_padding_at is not None and padding == "tail":
                raise SegmentIdError(
                    f"row {r}: padding (0) at position {seen_padding_at} comes before segment "
                    f"{value} at position {start}; padding must follow the last segment")
            if value < expected:
                first = next(s for s in segments if s.row == r and s.number == value)
                raise SegmentIdError(
                    f"row {r}: segment id {value} is not contiguous: it appears at positions "
                    f"{first.start}-{first.stop - 1} and again from {start}")
            if value != expected:
                raise SegmentIdError(
                    f"row {r}: segment ids must be numbered 1..M in order; found {value} at "
                    f"position {start} where {expected} was expected")
            segments.append(Segment(r, value, start, length))
            expected += 1
        count = expected - 1
        if max_segments is not None and count > max_segments:
            raise SegmentIdError(
                f"row {r} has {count} segments, more than max_segments={max_segments}")
    return segments


def segment_ids_from_rows(rows, seq_len: int) -> np.ndarray:
    """Row i holds the runs rows[i] in order: a positive n is the next segment, n tokens long; a
    negative n is -n tokens of padding. Padding fills the row after the last run."""
    out = np.zeros((len(rows), seq_len), np.int32)
    for r, runs in enumerate(rows):
        if any(n == 0 for n in runs) or sum(abs(n) for n in runs) > seq_len:
            raise ValueError(f"row {r}: runs {list(runs)} do not fit in {seq_len} positions")
        pos, number = 0, 0
        for n in runs:
            if n > 0:
                number += 1
                out[r, pos:pos + n] = number
            pos += abs(n)
    return out


def rows_of(segment_ids) -> tuple[tuple[int, ...], ...]:
    """The inverse of segment_ids_from_rows (trailing padding left implicit)."""
    rows = []
    for row in np.asarray(segment_ids):
        runs = [(length if value else -length) for value, _, length in _runs(row)]
        while runs and runs[-1] < 0:
            runs.pop()
        rows.append(tuple(runs))
    return tuple(rows)


# ----- the named layouts -----------------------------------------------------------------

RowBuilder = Callable[[np.random.Generator, int, int], list[int]]


@dataclass(frozen=True)
class Layout:
    family: str
    name: str
    row: RowBuilder  # (rng, row index, seq_len) -> the row's runs (segment_ids_from_rows)
    min_seq_len: int = 8
    doc: str = ""
    padding: str = "tail"  # where the layout puts padding: "tail" or "anywhere"

    @property
    def id(self) -> str:
        return f"{self.family}/{self.name}"

    def segment_ids(self, batch: int, seq_len: int, seed: int) -> np.ndarray:
        if seq_len < self.min_seq_len:
            raise ValueError(f"layout {self.id} needs seq_len >= {self.min_seq_len}, got {seq_len}")
        # The layout's own name enters the seed, so two layouts of one case never share a draw.
        rng = np.random.default_rng([seed, zlib.crc32(self.id.encode())])
        return segment_ids_from_rows([self.row(rng, r, seq_len) for r in range(batch)], seq_len)


def _split(rng: np.random.Generator, total: int, parts: int) -> list[int]:
    """A random composition of total into `parts` positive lengths."""
    parts = max(1, min(parts, total))
    cuts = np.sort(rng.choice(np.arange(1, total), size=parts - 1, replace=False))
    return np.diff(np.concatenate([[0], cuts, [total]])).astype(int).tolist()


def _unpacked_full(rng, r, t):
    return [t]


def _unpacked_pad_tail(rng, r, t):
    # Row 0 loses a single token; the other rows random tails of up to half the row.
    pad = 1 if r == 0 else int(rng.integers(1, t // 2 + 1))
    return [t - pad]


def _packed_random(rng, r, t):
    pad = 0 if r == 0 else int(rng.integers(0, t // 8 + 1))
    return _split(rng, t - pad, int(rng.integers(2, 5)))


def _packed_many(rng, r, t):
    pad = int(rng.integers(0, t // 16 + 1))
    return _split(rng, t - pad, int(rng.integers(5, 10)))


def _packed_dozens(rng, r, t):
    # Long rows packed with many documents: 16-32 segments per row.
    return _split(rng, t - int(rng.integers(0, t // 64 + 1)), int(rng.integers(16, 33)))


def _packed_ragged(rng, r, t):
    # Row r holds r + 1 segments: rows of one batch with different counts, one of them unpacked.
    return _split(rng, t, r % 6 + 1)


_BLOCK_EDGE_ROWS = ([63, 64, 2], [64, 64, 1], [65, 62, 1], [129], [127, 1, 1])


def _unaligned_block_edges(rng, r, t):
    # Boundaries at 63/64/65, 127/128/129: one past, at and one short of 64- and 128-wide tiles.
    head = list(_BLOCK_EDGE_ROWS[(r + int(rng.integers(0, len(_BLOCK_EDGE_ROWS)))) % len(_BLOCK_EDGE_ROWS)])
    rest = t - sum(head)
    return head + ([rest] if rest > 0 else [])


_ODD_LENGTHS = (1, 3, 7, 13, 31, 61, 97, 113, 147, 203, 251, 509)


def _unaligned_odd(rng, r, t):
    lengths, used = [], 0
    while True:
        fits = [n for n in _ODD_LENGTHS if used + n < t - 1]
        if not fits or len(lengths) >= 8:
            break
        n = int(rng.choice(fits))
        lengths.append(n)
        used += n
    return lengths + [t - used - 1]  # leaves one padding token: odd everywhere


def _extremes_single_tokens(rng, r, t):
    # Single-token segments at the row's start, between long ones, and at its end.
    pattern = [[1, 1, 1, t - 4, 1], [t - 2, 1, 1], [1, t - 2], [1] * min(t, 12)][r % 4]
    return pattern


def _extremes_long(rng, r, t):
    # One segment covering nearly the whole row, at either end, ending at the last position.
    return [[t - 1, 1], [1, t - 1], [t]][r % 3]


def _extremes_pad_heavy(rng, r, t):
    # Little data and a long stretch of padding between the last segment and the row's end.
    return [[1], [t // 4, t // 8], [int(rng.integers(1, t // 2))]][r % 3]


def _unaligned_long_edges(rng, r, t):
    # Long rows: one segment crossing 512 and 1024, and boundaries at 511/512/513 and
    # 1023/1024/1025 (block sizes and local windows of 512 and 1024 tokens).
    head = [[t], [511, 512], [512, 512], [513, 512]][r % 4]
    rest = t - sum(head)
    return head + ([rest] if rest > 0 else [])


def _padded_left(rng, r, t):
    # Left padding (as in batched inference), then one to three segments.
    pad = 1 if r == 0 else int(rng.integers(1, t // 4 + 1))
    return [-pad] + _split(rng, t - pad, 1 + r % 3)


def _padded_between(rng, r, t):
    # Padding between segments (TE's pad_between_seqs): each segment padded up to a multiple
    # of 16 (context-parallel alignment), random gaps, single-token gaps, or padding at both
    # ends of the row. Three quarters of the row is data, the gaps fit in the rest.
    kind = r % 4
    lengths = _split(rng, t * 3 // 4, int(rng.integers(2, 6)))
    if kind == 0:
        gaps = [(-n) % 16 or 16 for n in lengths[:-1]]
    elif kind == 2:
        gaps = [1] * (len(lengths) - 1)
    else:
        gaps = [int(g) for g in rng.integers(1, 13, size=len(lengths) - 1)]
    runs = [-int(rng.integers(1, 9))] if kind == 3 else []
    for n, gap in zip(lengths, gaps + [0]):
        runs += [n, -gap] if gap else [n]
    return runs


LAYOUTS: dict[str, Layout] = {
    lay.id: lay for lay in [
        Layout("unpacked", "full", _unpacked_full, doc="one segment filling the row"),
        Layout("unpacked", "pad-tail", _unpacked_pad_tail, doc="one segment, then padding"),
        Layout("packed", "random", _packed_random, doc="2-4 random segments, some padding"),
        Layout("packed", "many", _packed_many, min_seq_len=16, doc="5-9 segments per row"),
        Layout("packed", "ragged", _packed_ragged, doc="row r holds r+1 segments"),
        Layout("packed", "dozens", _packed_dozens, min_seq_len=256,
               doc="16-32 segments per row (long rows)"),
        Layout("unaligned", "block-edges", _unaligned_block_edges, min_seq_len=160,
               doc="boundaries at 63/64/65 and 127/128/129"),
        Layout("unaligned", "odd", _unaligned_odd, min_seq_len=16,
               doc="odd and prime lengths (1, 113, 147, 203 ...)"),
        Layout("extremes", "single-tokens", _extremes_single_tokens, min_seq_len=16,
               doc="single-token segments at start, middle and end"),
        Layout("extremes", "long", _extremes_long, doc="a segment covering nearly the row"),
        Layout("extremes", "pad-heavy", _extremes_pad_heavy, doc="long padding after the data"),
        Layout("unaligned", "long-edges", _unaligned_long_edges, min_seq_len=1040,
               doc="a segment across 512 and 1024; boundaries at 511-513 and 1023-1025"),
        Layout("padded", "left", _padded_left, doc="left padding, then 1-3 segments",
               padding="anywhere"),
        Layout("padded", "between", _padded_between, min_seq_len=256, padding="anywhere",
               doc="padding between segments (pad_between_seqs): aligned, random, 1-token gaps"),
    ]
}

# Cases given by their rows (python -m harness repro writes shrunk cases this way).
CUSTOM = "custom/rows"
