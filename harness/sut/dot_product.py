"""MaxText-style dot_product attention: the op's dot_product kernel and its XLA fallback."""
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


def dot_product(query, key, value, segment_ids, *, causal, scale):
    """MaxText-style dot_product attention in the input dtype: the query is scaled first, query
    heads are grouped over kv heads by reshaping, logits and softmax in float32."""
    b, t, heads, d = query.shape
    kv_heads = key.shape[2]
    q = (query * jnp.asarray(scale, query.dtype)).reshape(b, t, kv_heads, heads // kv_heads, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", q, key, preferred_element_type=jnp.float32)
    mask = segment_mask(segment_ids, causal)[:, :, None]   # [B, 1, 1, T, T]
    logits = jnp.where(mask, logits, _MAXTEXT_MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", probs, value)
    return out.reshape(b, t, heads, d)
