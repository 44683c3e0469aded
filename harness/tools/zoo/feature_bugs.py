"""The zoo's feature kernels: attention with a sliding window, a soft cap, chunks and sinks
(harness.model.features), written here with its own math (segment ranges, not ids), and the
feature bugs of real fast paths: each kernel honours every feature but one thing.

Positions are within each segment (pos = index - the segment's start), as the harness defines
them. The correct math: `features_dense`; each bug is a keyword that bends one part of it."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from harness.tools.zoo.reference_math import MASKED, kv_index, positions, segment_bounds


def features_mask(segment_ids, causal, window=None, chunk=None, *, window_extra=0,
                  window_from_row=False, drop_window=False, drop_chunk=False):
    """[B, T, T] bool from segment ranges: same run, causal, window, chunk. The keywords after
    the star are the bugs: a window one key wider (`window_extra`), query positions within
    the segment held against key indices within the row (`window_from_row`), a feature
    dropped."""
    t = segment_ids.shape[1]
    start, stop = segment_bounds(segment_ids)
    idx = positions(t)[None, :]
    q_idx, k_idx = idx[:, :, None], idx[:, None, :]
    mask = (k_idx >= start[:, :, None]) & (k_idx < stop[:, :, None])
    if causal:
        mask &= k_idx <= q_idx
    q_pos = idx - start                                     # [B, T]: within the segment
    k_pos = q_pos[:, None, :]
    if window is not None and not drop_window:
        left, right = window
        left += window_extra
        k_at = jnp.broadcast_to(idx[:, None, :], mask.shape) if window_from_row else k_pos
        mask &= (k_at >= q_pos[:, :, None] - left) & (k_at <= q_pos[:, :, None] + right)
    if chunk is not None and not drop_chunk:
        mask &= (q_pos[:, :, None] // chunk) == (k_pos // chunk)
    # Padding queries read themselves: defined, and never compared.
    pad = (segment_ids == 0)[:, :, None]
    return jnp.where(pad, jnp.eye(t, dtype=bool)[None], mask)


def features_dense(query, key, value, segment_ids, *, causal, scale, window=None, softcap=None,
                   chunk=None, sinks=None, drop_softcap=False, sinks_forward=True,
                   sinks_gradient=True, causal_beside=False, **mask_bugs):
    """Dense attention with every feature; `drop_softcap`, `sinks_forward` (False: the sinks
    are ignored), `sinks_gradient` (False: no gradient reaches them) and `causal_beside`
    (the causal mask whenever a soft cap or sinks are on: a fast path written for decoders)
    are bugs too."""
    if causal_beside and (softcap is not None or sinks is not None):
        causal = True
    heads, kv_heads = query.shape[2], key.shape[2]
    idx = kv_index(heads, kv_heads)
    k, v = jnp.take(key, idx, axis=2), jnp.take(value, idx, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", query, k, preferred_element_type=jnp.float32) * scale
    if softcap is not None and not drop_softcap:
        s = softcap * jnp.tanh(s / softcap)
    mask = features_mask(segment_ids, causal, window, chunk, **mask_bugs)
    s = jnp.where(mask[:, None], s, MASKED)
    if sinks is not None and sinks_forward:
        sink = sinks if sinks_gradient else jax.lax.stop_gradient(sinks)
        sink = sink.astype(jnp.float32)[None, :, None, None]
        top = jnp.maximum(s.max(axis=-1, keepdims=True), sink)
        e = jnp.exp(s - top)
        p = e / (e.sum(axis=-1, keepdims=True) + jnp.exp(sink - top))
    else:
        p = jax.nn.softmax(s, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", p.astype(value.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.astype(query.dtype)


def features_online(query, key, value, segment_ids, *, causal, scale, window=None, softcap=None,
                    chunk=None, sinks=None, block=64):
    """Correct, other math: keys in blocks with an online softmax (a running max and sum per
    query, the sink seeding both), as a flash kernel computes it."""
    b, t, heads, d = query.shape
    n = -(-t // block)
    pad = n * block - t
    idx = kv_index(heads, key.shape[2])
    k = jnp.pad(jnp.take(key, idx, axis=2), ((0, 0), (0, pad), (0, 0), (0, 0)))
    v = jnp.pad(jnp.take(value, idx, axis=2), ((0, 0), (0, pad), (0, 0), (0, 0)))
    full = features_mask(segment_ids, causal, window, chunk)            # [B, T, T]
    full = jnp.pad(full, ((0, 0), (0, 0), (0, pad)))
    kb = k.reshape(b, n, block, heads, d).swapaxes(0, 1)
    vb = v.reshape(b, n, block, heads, d).swapaxes(0, 1)
    mb = full.reshape(b, t, n, block).transpose(2, 0, 1, 3)

    def step(carry, xs):
        m, l, acc = carry
        kj, vj, allowed = xs
        s = jnp.einsum("bqhd,bkhd->bhqk", query, kj, preferred_element_type=jnp.float32) * scale
        if softcap is not None:
            s = softcap * jnp.tanh(s / softcap)
        s = jnp.where(allowed[:, None], s, MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        l = l * alpha + p.sum(axis=-1)
        pv = jnp.einsum("bhqk,bkhd->bqhd", p.astype(value.dtype), vj,
                        preferred_element_type=jnp.float32)
        return (m_new, l, acc * alpha.transpose(0, 2, 1)[..., None] + pv), None

    if sinks is None:
        m0, l0 = jnp.full((b, heads, t), MASKED, jnp.float32), jnp.zeros((b, heads, t))
    else:   # the sink's exp(sink - max) starts the sum, its logit the max
        m0 = jnp.broadcast_to(sinks.astype(jnp.float32)[None, :, None], (b, heads, t))
        l0 = jnp.ones((b, heads, t), jnp.float32)
    (m, l, acc), _ = jax.lax.scan(step, (m0, l0, jnp.zeros((b, t, heads, d), jnp.float32)),
                                  (kb, vb, mb))
    return (acc / l.transpose(0, 2, 1)[..., None]).astype(query.dtype)


def bug(**bent):
    """A kernel taking every feature, with one part bent (features_dense's keywords)."""
    return functools.partial(features_dense, **bent)
