"""The bench's shapes: packed rows with exact segment lengths (drawn once, from a fixed seed),
their useful FLOPs (same-segment causal work only) and cuDNN's packed layout of their segment
ids (seqlens and offsets, computed in numpy outside any program)."""
from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from harness.errors import UsageError
from harness.model.case import Case
from harness.model.layouts import CUSTOM

SEED_SHAPE = "seed"                 # the shape of the op-vs-causal-only goal


@dataclass(frozen=True)
class Shape:
    name: str
    case: Case                      # layout custom/rows: exact segment lengths per row
    layout: str                     # how its segments were drawn, in words

    @functools.cached_property
    def lengths(self) -> tuple[int, ...]:
        return tuple(s.length for s in self.case.segments)

    @functools.cached_property
    def max_segments(self) -> int:
        """M: the fullest row's segments + 1 (so some rows have fewer than M, as in training)."""
        return max(s.number for s in self.case.segments) + 1

    @property
    def label(self) -> str:
        c = self.case
        return (f"{self.name}: {c.batch}x{c.seq_len}, {c.heads}/{c.kv_heads} heads, head_dim "
                f"{c.head_dim}, {c.dtype}; {self.layout} ({len(self.lengths)} segments in "
                f"all, M={self.max_segments})")


def _equalish(rng: np.random.Generator, total: int, parts: int) -> list[int]:
    """`parts` lengths summing to `total`, each cut within a tenth of a part of an even split."""
    base = total / parts
    jitter = int(base / 10)
    cuts = [round(i * base) + int(rng.integers(-jitter, jitter + 1)) for i in range(1, parts)]
    return np.diff([0, *cuts, total]).astype(int).tolist()


def _short(rng: np.random.Generator, total: int, lo: int, hi: int) -> list[int]:
    """Segments of lo..hi tokens while at least lo tokens are left; the rest is padding."""
    runs, left = [], total
    while left >= lo:
        n = min(int(rng.integers(lo, hi + 1)), left)
        runs.append(n)
        left -= n
    return runs


def _shape(name, layout, batch, seq_len, heads, kv_heads, head_dim, row) -> Shape:
    rng = np.random.default_rng([20240611, seq_len, batch])  # fixed: the same rows every run
    rows = tuple(tuple(row(rng, seq_len)) for _ in range(batch))
    return Shape(name, Case(CUSTOM, batch, seq_len, heads, kv_heads, head_dim, "bfloat16", 0,
                            rows=rows), layout)


def _hopper() -> list[Shape]:
    return [
        _shape(SEED_SHAPE, "4 equal-ish segments per row", 8, 2048, 32, 8, 128,
               lambda rng, t: _equalish(rng, t, 4)),
        _shape("long-8k", "8 equal-ish segments", 1, 8192, 32, 8, 128,
               lambda rng, t: _equalish(rng, t, 8)),
        _shape("long-32k", "16 equal-ish segments", 1, 32768, 32, 8, 128,
               lambda rng, t: _equalish(rng, t, 16)),
        _shape("short", "segments of 64-256 tokens, then < 64 padding", 8, 4096, 32, 8, 128,
               lambda rng, t: _short(rng, t, 64, 256)),
    ]


def _small() -> list[Shape]:
    # Two shapes (compilation dominates a CPU run): the seed shape in miniature, and one long
    # row of many short segments.
    return [
        _shape(SEED_SHAPE, "4 equal-ish segments per row", 2, 256, 4, 2, 64,
               lambda rng, t: _equalish(rng, t, 4)),
        _shape("short", "segments of 16-64 tokens, then < 16 padding", 1, 512, 4, 2, 64,
               lambda rng, t: _short(rng, t, 16, 64)),
    ]


def _census() -> list[Shape]:
    # The census's two shapes (harness.tools.census): the seed shape and one row of 8192.
    return [s for s in _hopper() if s.name in (SEED_SHAPE, "long-8k")]


SHAPE_SETS: dict[str, Callable[[], list[Shape]]] = {"small": _small, "hopper": _hopper,
                                                    "census": _census}


def shape_set(name: str) -> list[Shape]:
    if name not in SHAPE_SETS:
        raise UsageError(f"unknown shape set {name!r} for --shapes; known: "
                         f"{', '.join(SHAPE_SETS)} (small: any device; hopper, census: GPU "
                         "shapes)")
    return SHAPE_SETS[name]()


def useful_flops(lengths, heads: int, head_dim: int) -> tuple[int, int]:
    """(forward, forward+backward) FLOPs of same-segment causal attention over segments of the
    given lengths: forward 4 * L(L+1)/2 * head_dim * heads per segment, backward 2.5x that."""
    forward = sum(4 * (n * (n + 1) // 2) * head_dim * heads for n in lengths)
    return forward, forward * 7 // 2


def packed_lengths_offsets(segment_ids, max_segments: int) -> tuple[np.ndarray, np.ndarray]:
    """cuDNN's packed layout from segment ids, in numpy (outside any program): seqlen [B, M]
    and offsets [B, M+1], int32, -1 where a row has fewer segments. Each positive run of a row
    is a segment (rows are contiguous runs 1..n; harness.model.layouts.check_segment_ids)."""
    seg = np.asarray(segment_ids)
    b, t = seg.shape
    seqlen = np.full((b, max_segments), -1, np.int32)
    offsets = np.full((b, max_segments + 1), -1, np.int32)
    for r, row in enumerate(seg):
        edges = np.flatnonzero(np.diff(row)) + 1
        starts, stops = np.concatenate([[0], edges]), np.concatenate([edges, [t]])
        keep = row[starts] > 0
        starts, stops = starts[keep], stops[keep]
        if starts.size > max_segments:
            raise ValueError(f"row {r} has {starts.size} segments, more than {max_segments}")
        seqlen[r, :starts.size] = stops - starts
        offsets[r, :starts.size] = starts
    return seqlen, offsets
