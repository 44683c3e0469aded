"""MaxText-style dot_product attention: the op's dot_product kernel and its XLA fallback, with
the attention features models train with (sliding windows, logit soft caps, chunks, sinks, a
value head dim of its own)."""
from __future__ import annotations

import jax
import jax.numpy as jnp

# MaxText's DEFAULT_MASK_VALUE: a large finite negative, added where attention is not allowed.
_MAXTEXT_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


def segment_mask(segment_ids, causal: bool):
    """[B, 1, T, T] bool: same segment, and j <= i when causal (MaxText's mask)."""
    mask = segment_ids[:, :, None] == segment_ids[:, None, :]
    if causal:
        t = segment_ids.shape[1]
        mask = mask & jnp.tril(jnp.ones((t, t), bool))[None]
    return mask[:, None]


def segment_positions(segment_ids):
    """[B, T]: each token's position within its segment (a packed model's position ids)."""
    b, t = segment_ids.shape
    idx = jnp.broadcast_to(jnp.arange(t), (b, t))
    first = jnp.concatenate([jnp.ones((b, 1), bool),
                             segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return idx - jax.lax.cummax(jnp.where(first, idx, 0), axis=1)


def local_mask(segment_ids, window=None, chunk=None):
    """[B, 1, T, T] bool: the sliding window (pos_i - left <= pos_j <= pos_i + right) and the
    chunks (pos_i // chunk == pos_j // chunk), on positions within each segment; all True where
    neither is asked for."""
    b, t = segment_ids.shape
    mask = jnp.ones((b, t, t), bool)
    if window is None and chunk is None:
        return mask[:, None]
    pos = segment_positions(segment_ids)
    pq, pk = pos[:, :, None], pos[:, None, :]
    if window is not None:
        left, right = window
        mask &= (pk >= pq - left) & (pk <= pq + right)
    if chunk is not None:
        mask &= (pq // chunk) == (pk // chunk)
    return mask[:, None]


def dot_product(query, key, value, segment_ids, *, causal, scale, window=None, softcap=None,
                chunk=None, sinks=None):
    """MaxText-style dot_product attention in the input dtype: the query is scaled first, query
    heads are grouped over kv heads by reshaping, logits and softmax in float32. `window`
    (left, right), `chunk` (positions within each segment), `softcap` (cap * tanh(logit /
    cap)) and `sinks` (one logit per query head in each softmax's denominator) as a model asks."""
    b, t, heads, d = query.shape
    kv_heads, dv = key.shape[2], value.shape[3]
    group = heads // kv_heads
    q = (query * jnp.asarray(scale, query.dtype)).reshape(b, t, kv_heads, group, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", q, key, preferred_element_type=jnp.float32)
    if softcap is not None:
        logits = softcap * jnp.tanh(logits / softcap)
    mask = segment_mask(segment_ids, causal)
    if window is not None or chunk is not None:
        mask = mask & local_mask(segment_ids, window, chunk)
    logits = jnp.where(mask[:, :, None], logits, _MAXTEXT_MASK_VALUE)   # [B, K, G, T, S]
    if sinks is None:
        probs = jax.nn.softmax(logits, axis=-1)
    else:
        # The sink: a logit per query head taking part in the softmax, with no value.
        sink = jnp.broadcast_to(sinks.astype(jnp.float32).reshape(kv_heads, group)
                                [None, :, :, None, None], (b, kv_heads, group, t, 1))
        probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
    out = jnp.einsum("bkgts,bskd->btkgd", probs.astype(value.dtype), value)
    return out.reshape(b, t, heads, dv)
