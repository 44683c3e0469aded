"""Segment ids -> what packed kernels take: per-segment lengths and offsets (cuDNN), positions
within segments (TE), and the check that a row can be represented at all.

cuDNN's packed form (jax.nn's cuDNN SDPA, `q_seqlen`/`q_offsets`): row b's segment m
(0-based) has length seqlen[b, m] and starts at offsets[b, m]; seqlen is [B, M], offsets
[B, M+1]; unused entries are -1. A row can only be lowered if its ids are contiguous runs
1..n, n <= M, followed by padding: anything else would be silently mis-lowered (an id above M
is dropped; an id in two runs merges them), so it is refused.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np


class SegmentIdError(ValueError):
    """Segment ids the packed lowering cannot represent (MaxText's convention: each row is
    contiguous runs numbered 1..n, n <= max_segments_per_seq, then padding, id 0)."""


def is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def row_problem(row: np.ndarray, max_segments: int | None) -> str | None:
    """What keeps one row of concrete ids from the packed layout, or None."""
    edges = np.flatnonzero(np.diff(row)) + 1
    starts = np.concatenate([[0], edges]).astype(int)
    expected, padding_at, first_seen = 1, None, {}
    for start in starts:
        value = int(row[start])
        if value < 0:
            return f"negative segment id {value} at position {start}"
        if value == 0:
            padding_at = start if padding_at is None else padding_at
            continue
        if padding_at is not None:
            return (f"padding (0) at position {padding_at} comes before segment {value} at "
                    f"position {start}; padding must follow the last segment")
        if value in first_seen:
            return (f"segment id {value} is not contiguous: it appears from position "
                    f"{first_seen[value]} and again from {start}")
        if value != expected:
            return (f"segment ids must be numbered 1..M in order; found {value} at position "
                    f"{start} where {expected} was expected")
        first_seen[value] = start
        expected += 1
    if max_segments is not None and expected - 1 > max_segments:
        return f"{expected - 1} segments, more than max_segments={max_segments}"
    return None


def check_concrete(segment_ids, max_segments: int | None) -> None:
    """Raises SegmentIdError naming the first problem (works on concrete arrays only)."""
    seg = np.asarray(segment_ids)
    if seg.ndim != 2:
        raise SegmentIdError(f"segment_ids must be [batch, seq], got shape {seg.shape}")
    if not np.issubdtype(seg.dtype, np.integer):
        raise SegmentIdError(f"segment_ids must be integers, got dtype {seg.dtype}")
    for r, row in enumerate(seg):
        problem = row_problem(row, max_segments)
        if problem:
            raise SegmentIdError(f"row {r}: {problem}")


def representable_rows(segment_ids, max_segments: int):
    """[B] bool, traceable: the row is contiguous runs 1..n (n <= max_segments), then padding."""
    return packed(segment_ids, max_segments)[2]


def lengths_and_offsets(segment_ids, max_segments: int, padding: str | None = None):
    """(seqlen [B, M], offsets [B, M+1]) int32, -1 where a row has fewer segments; see
    `packed`, which also says which rows could be lowered."""
    return packed(segment_ids, max_segments, padding)[:2]


def packed(segment_ids, max_segments: int, padding: str | None = None):
    """(seqlen [B, M], offsets [B, M+1], ok [B]): cuDNN's packed form of each row, -1 where a
    row has fewer segments, and whether the row could be lowered at all.

    One pass over the ids (a single reduction: for each m the tokens with 0 < id <= m, and the
    steps that break the layout), then elementwise work on [B, M]: a few small kernels, not one
    per quantity, since every kernel before the attention adds its launch to the step.

    A row that cannot be lowered (ok False) gets one segment over the whole row: a lowering in
    bounds whatever its ids, for a caller that poisons or refuses the row anyway.

    `padding` says what becomes of a row's trailing padding (None: nothing; cuDNN leaves
    those outputs undefined, so a NaN there could reach a masked loss as 0 * NaN):
    - "merged": one with the row's last segment (a row of padding only: a segment of its own).
      Right for causal attention only: valid queries never see the later padding keys, and
      with a zero output cotangent at padding (a masked loss) the padding queries add exactly
      zero to the segment's dk and dv. No extra slot: the same M as the raw call.
    - "segment": one more segment right after the row's last one (seqlen [B, M+1], offsets
      [B, M+2]), attending only itself: for bidirectional attention.
    Either way padding outputs are finite and no pass over the output cleans them up."""
    if padding not in (None, "merged", "segment"):
        raise ValueError(f"padding must be None, 'merged' or 'segment', not {padding!r}")
    seg = segment_ids.astype(jnp.int32)  # narrow ids (int8) would wrap M and the id range
    t = seg.shape[1]
    m = jnp.arange(1, max_segments + 1, dtype=jnp.int32)
    # A step from prev to cur keeps the layout if cur is prev, prev + 1 or padding after a
    # segment, or padding after padding; the row starts with id 0 or 1; ids lie in 0..M.
    prev = jnp.concatenate([jnp.zeros_like(seg[:, :1]), seg[:, :-1]], axis=1)
    first = jnp.arange(t)[None] == 0
    step_ok = jnp.where(first, seg <= 1,
                        jnp.where(prev > 0, (seg == prev) | (seg == prev + 1) | (seg == 0),
                                  seg == 0))
    broken = ~step_ok | (seg < 0) | (seg > max_segments)
    columns = jnp.concatenate([(seg[:, :, None] > 0) & (seg[:, :, None] <= m),
                               broken[:, :, None]], axis=2)
    counts = columns.sum(axis=1, dtype=jnp.int32)                              # [B, M+1]
    up_to = counts[:, :max_segments]                   # tokens with 0 < id <= m, m = 1..M
    ok = counts[:, max_segments] == 0
    starts = jnp.concatenate([jnp.zeros_like(up_to[:, :1]), up_to[:, :-1]], axis=1)
    lengths = up_to - starts
    present = lengths > 0
    pad = t - up_to[:, -1:]                                                    # [B, 1]
    index = jnp.arange(max_segments)[None]
    seqlen = jnp.where(present, lengths, -1)
    offsets = jnp.where(present, starts, -1)
    # The slot after the last present segment: segments of a lowerable row are 1..n, so it is
    # where a present slot is followed by an absent one (slot 0 in a row of padding only).
    after = jnp.concatenate([present[:, 1:], jnp.zeros_like(present[:, :1])], axis=1)
    if padding == "merged":
        slot = jnp.where(up_to[:, -1:] > 0, present & ~after, index == 0) & (pad > 0)
        seqlen = jnp.where(slot, lengths + pad, seqlen)
        offsets = jnp.where(slot, starts, offsets)
    elif padding == "segment":
        before = jnp.concatenate([jnp.ones_like(present[:, :1]), present], axis=1)
        here = jnp.concatenate([present, jnp.zeros_like(present[:, :1])], axis=1)
        slot = before & ~here & (pad > 0)                                      # [B, M+1]
        seqlen = jnp.where(slot, pad, jnp.pad(seqlen, ((0, 0), (0, 1)), constant_values=-1))
        offsets = jnp.where(slot, t - pad,
                            jnp.pad(offsets, ((0, 0), (0, 1)), constant_values=-1))
    whole = jnp.arange(seqlen.shape[1])[None] == 0
    seqlen = jnp.where(ok[:, None], seqlen, jnp.where(whole, t, -1))
    offsets = jnp.where(ok[:, None], offsets, jnp.where(whole, 0, -1))
    offsets = jnp.pad(offsets, ((0, 0), (0, 1)), constant_values=-1)
    return seqlen.astype(jnp.int32), offsets.astype(jnp.int32), ok


def positions(segment_ids):
    """Position of each token inside its segment (0 at each segment's start and at padding)."""
    t = segment_ids.shape[1]
    idx = jnp.arange(t, dtype=jnp.int32)[None]
    new = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                           segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    start = jax.lax.cummax(jnp.where(new, idx, 0), axis=1)
    return jnp.where(segment_ids > 0, idx - start, 0).astype(jnp.int32)


@functools.cache
def upstream_gqa_offsets_wrong() -> bool:
    """Whether this jax scales packed kv offsets by the number of *query* heads (jax <= 0.11.0;
    fixed by jax PR #39521), which makes the packed path read the wrong kv memory under GQA.

    Asked of the code itself, not of its version: runs jax's own offset arithmetic (pure jnp,
    fine on the CPU) on a GQA shape and compares with what cuDNN needs.
    """
    from jax._src import core
    from jax._src.cudnn import fused_attention_stablehlo as sdpa

    if getattr(core, "trace_state_clean", lambda: False)():
        # Asked outside any trace (the run's header; a lowering process before its traces,
        # harness.engine.lowering_child): one compiled program. Evaluated op by op instead,
        # on the H200 it took a nightly worker 2.8 s to start.
        return _probe_gqa_offsets(sdpa)
    with jax.ensure_compile_time_eval():  # the op asks while being traced
        return _probe_gqa_offsets(sdpa)


def _probe_gqa_offsets(sdpa) -> bool:
    heads, kv_heads, head_dim, t = 4, 1, 8, 4
    q = np.zeros((1, t, heads, head_dim), jnp.bfloat16)
    k = np.zeros((1, t, kv_heads, head_dim), jnp.bfloat16)
    seqlen = np.array([[2, 2]], np.int32)
    offsets = np.array([[0, 2, -1]], np.int32)
    # One program (read from the persistent compilation cache), not a dozen eager ops.
    kv_offsets = jax.jit(lambda s, o: sdpa._fix_seqlen_offsets(s, s, o, o, q, k)[3])
    kv_off = kv_offsets(seqlen, offsets)
    # Element offset of the second kv segment: 2 tokens of kv_heads * head_dim elements.
    return int(kv_off[0, 1]) != 2 * kv_heads * head_dim
