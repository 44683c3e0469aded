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

from harness.layouts import check_segment_ids


def is_concrete(x) -> bool:
    return not isinstance(x, jax.core.Tracer)


def check_concrete(segment_ids, max_segments: int | None) -> None:
    """Raises SegmentIdError naming the first problem (works on concrete arrays only)."""
    check_segment_ids(np.asarray(segment_ids), max_segments=max_segments)


def representable_rows(segment_ids, max_segments: int):
    """[B] bool, traceable: the row is contiguous runs 1..n (n <= max_segments), then padding."""
    seg = segment_ids
    prev, cur = seg[:, :-1], seg[:, 1:]
    step_ok = jnp.where(prev > 0, (cur == prev) | (cur == prev + 1) | (cur == 0), cur == 0)
    return (step_ok.all(axis=1) & (seg[:, 0] <= 1) & (seg >= 0).all(axis=1)
            & (seg <= max_segments).all(axis=1))


def lengths_and_offsets(segment_ids, max_segments: int, padding: str | None = None):
    """(seqlen [B, M], offsets [B, M+1]) int32, -1 where a row has fewer segments.

    `padding` says what becomes of a row's trailing padding (None: nothing; cuDNN leaves
    those outputs undefined, so a NaN there could reach a masked loss as 0 * NaN):
    - "merged": one with the row's last segment (a row of padding only: a segment of its own).
      Right for causal attention only: valid queries never see the later padding keys, and
      with a zero output cotangent at padding (a masked loss) the padding queries add exactly
      zero to the segment's dk and dv. No extra slot: the same M as the raw call.
    - "segment": one more segment right after the row's last one (seqlen [B, M+1], offsets
      [B, M+2]), attending only itself: for bidirectional attention.
    Either way padding outputs are finite and no pass over the output cleans them up."""
    ids = jnp.arange(1, max_segments + 1, dtype=segment_ids.dtype)
    lengths = (segment_ids[:, :, None] == ids).sum(axis=1).astype(jnp.int32)     # [B, M]
    # Segments are contiguous and in order, so segment m starts after all tokens of 1..m-1.
    starts = jnp.cumsum(lengths, axis=1) - lengths
    present = lengths > 0
    seqlen = jnp.where(present, lengths, -1)
    offsets = jnp.where(present, starts, -1)
    if padding is not None:
        if padding not in ("merged", "segment"):
            raise ValueError(f"padding must be None, 'merged' or 'segment', not {padding!r}")
        n = present.sum(axis=1)                                                   # [B]
        pad = segment_ids.shape[1] - lengths.sum(axis=1)                         # [B]
        if padding == "segment":
            seqlen = jnp.pad(seqlen, ((0, 0), (0, 1)), constant_values=-1)
            offsets = jnp.pad(offsets, ((0, 0), (0, 1)), constant_values=-1)
            slot = jnp.arange(max_segments + 1)[None] == n[:, None]              # [B, M+1]
            new_len, new_off = pad, segment_ids.shape[1] - pad
        else:
            slot = jnp.arange(max_segments)[None] == jnp.maximum(n - 1, 0)[:, None]
            last = jnp.take_along_axis(lengths, jnp.maximum(n - 1, 0)[:, None], axis=1)[:, 0]
            new_len = jnp.where(n > 0, last + pad, pad)
            new_off = jnp.where(n > 0, segment_ids.shape[1] - pad - last, 0)
        slot = slot & (pad > 0)[:, None]
        seqlen = jnp.where(slot, new_len[:, None], seqlen)
        offsets = jnp.where(slot, new_off[:, None], offsets)
    offsets = jnp.pad(offsets, ((0, 0), (0, 1)), constant_values=-1)
    return seqlen, offsets


def positions(segment_ids):
    """Position of each token inside its segment (0 at each segment's start and at padding)."""
    t = segment_ids.shape[1]
    idx = jnp.arange(t, dtype=jnp.int32)[None]
    new = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                           segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    start = jax.lax.cummax(jnp.where(new, idx, 0), axis=1)
    return jnp.where(segment_ids > 0, idx - start, 0).astype(jnp.int32)


@functools.lru_cache(maxsize=None)
def upstream_gqa_offsets_wrong() -> bool:
    """Whether this jax scales packed kv offsets by the number of *query* heads (jax <= 0.11.0;
    fixed by jax PR #39521), which makes the packed path read the wrong kv memory under GQA.

    Asked of the code itself, not of its version: runs jax's own offset arithmetic (pure jnp,
    fine on the CPU) on a GQA shape and compares with what cuDNN needs.
    """
    from jax._src.cudnn import fused_attention_stablehlo as sdpa

    with jax.ensure_compile_time_eval():  # the op asks while being traced
        return _probe_gqa_offsets(sdpa)


def _probe_gqa_offsets(sdpa) -> bool:
    heads, kv_heads, head_dim, t = 4, 1, 8, 4
    q = jnp.zeros((1, t, heads, head_dim), jnp.bfloat16)
    k = jnp.zeros((1, t, kv_heads, head_dim), jnp.bfloat16)
    seqlen = jnp.array([[2, 2]], jnp.int32)
    offsets = jnp.array([[0, 2, -1]], jnp.int32)
    _, _, _, kv_off = sdpa._fix_seqlen_offsets(seqlen, seqlen, offsets, offsets, q, k)
    # Element offset of the second kv segment: 2 tokens of kv_heads * head_dim elements.
    return int(kv_off[0, 1]) != 2 * kv_heads * head_dim
