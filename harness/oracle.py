"""Reference attention: the float32 truth, its same-dtype peer, and an independent float64 oracle.

Three computations of one definition: token i of segment s attends to token j iff j is in the
same segment s (s > 0) and, when causal, j <= i. Padding tokens attend to nothing; their outputs
are defined as zero here and are never compared.

- `dense_attention(..., truth=True)`: float32 inputs, HIGHEST matmul precision, dense [B,T,T] mask.
  The truth every kernel is compared with.
- `dense_attention(..., truth=False)`: the same formula in the input dtype with the operations in
  another order (keys scaled instead of queries, scores rounded to the dtype). Its distance from
  the truth estimates the rounding noise any kernel of that dtype must be allowed.
- `segment_loop_attention`: NumPy float64, one segment at a time, with the backward pass written
  out by hand. It shares no code with the dense oracle, so the two check each other.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from harness.layouts import check_segment_ids

# A finite "minus infinity": rows that attend to nothing (padding queries) stay NaN-free.
_MASKED = -1e30


def attention_mask(segment_ids, causal: bool):
    """[B, T, T] bool: query i may read key j."""
    q = segment_ids[:, :, None]
    k = segment_ids[:, None, :]
    mask = (q == k) & (q > 0)
    if causal:
        t = segment_ids.shape[1]
        mask = mask & jnp.tril(jnp.ones((t, t), bool))[None]
    return mask


def repeat_kv(x, heads: int):
    """[B, T, KV, D] -> [B, T, heads, D]: query head h reads kv head h // (heads // KV)."""
    return jnp.repeat(x, heads // x.shape[2], axis=2)


def dense_attention(query, key, value, segment_ids, *, scale: float, causal: bool = True,
                    truth: bool = True):
    heads = query.shape[2]
    if truth:
        dtype, precision = jnp.float32, jax.lax.Precision.HIGHEST
        q = query.astype(dtype) * scale
        k = key.astype(dtype)
    else:
        dtype, precision = query.dtype, None
        q = query
        k = (key * jnp.asarray(scale, key.dtype)).astype(dtype)
    k = repeat_kv(k, heads)
    v = repeat_kv(value.astype(dtype), heads)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=precision,
                        preferred_element_type=dtype)
    mask = attention_mask(segment_ids, causal)[:, None]
    probs = jax.nn.softmax(jnp.where(mask, scores.astype(jnp.float32), _MASKED), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(dtype), v, precision=precision,
                     preferred_element_type=dtype)
    valid = (segment_ids > 0)[:, :, None, None]
    return jnp.where(valid, out, 0).astype(dtype)


def segment_loop_attention(query, key, value, segment_ids, cotangent, *, scale: float,
                           causal: bool = True):
    """Float64 forward output and (dq, dk, dv) for the given output cotangent, per segment."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (query, key, value, cotangent))
    heads, kv_heads = q.shape[2], k.shape[2]
    group = heads // kv_heads
    out, dq = np.zeros_like(q), np.zeros_like(q)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for seg in check_segment_ids(np.asarray(segment_ids)):
        rows = (seg.row, slice(seg.start, seg.stop))
        qs, dos = q[rows], do[rows]                      # [L, H, D]
        ks = np.repeat(k[rows], group, axis=1)           # [L, H, D]
        vs = np.repeat(v[rows], group, axis=1)
        s = np.einsum("qhd,khd->hqk", qs, ks) * scale
        if causal:
            s = np.where(np.tril(np.ones((seg.length, seg.length), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        out[rows] = np.einsum("hqk,khd->qhd", p, vs)
        dp = np.einsum("qhd,khd->hqk", dos, vs)
        ds = p * (dp - (dp * p).sum(-1, keepdims=True))
        dq[rows] = np.einsum("hqk,khd->qhd", ds, ks) * scale
        dk_h = np.einsum("hqk,qhd->khd", ds, qs) * scale
        dv_h = np.einsum("hqk,qhd->khd", p, dos)
        # A kv head's gradient is the sum over the query heads that read it.
        dk[rows] = dk_h.reshape(seg.length, kv_heads, group, -1).sum(2)
        dv[rows] = dv_h.reshape(seg.length, kv_heads, group, -1).sum(2)
    return out, (dq, dk, dv)
