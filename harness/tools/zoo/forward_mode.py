"""The zoo's forward-mode kernels: attention with a JVP rule written out by hand, as a library
with a forward-mode kernel of its own has one (fa4-jax), and that kernel's bug class: the
tangent kernel ignores the segment ids (its mask causal only), while the forward output is
right. They declare no backward (a hand-written tangent rule is what they are about), so the
jvp check alone can catch the bug.

The rule, per query head (s = scale * q.k over the mask, p = softmax(s), out = p v):

    ds   = scale * (tq . k + q . tk)
    dp   = p * (ds - sum_k p * ds)
    tout = dp v + p tv
"""
from __future__ import annotations

import jax
import jax.numpy as jnp

from harness.tools.zoo.reference_math import MASKED, causal_mask, dense, kv_index, right_mask


def _tangent(q, k, v, tq, tk, tv, mask, scale):
    heads = q.shape[2]
    idx = kv_index(heads, k.shape[2])
    f32 = jnp.float32
    k, v, tk, tv = (jnp.take(x, idx, axis=2).astype(f32) for x in (k, v, tk, tv))
    q, tq = q.astype(f32), tq.astype(f32)
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale
    p = jax.nn.softmax(jnp.where(mask[:, None], s, MASKED), axis=-1)
    ds = (jnp.einsum("bqhd,bkhd->bhqk", tq, k) + jnp.einsum("bqhd,bkhd->bhqk", q, tk)) * scale
    dp = p * (ds - (p * ds).sum(axis=-1, keepdims=True))
    return jnp.einsum("bhqk,bkhd->bqhd", dp, v) + jnp.einsum("bhqk,bkhd->bqhd", p, tv)


def hand_written_jvp(tangent_ignores_segments: bool = False):
    """Dense attention with a custom_jvp rule (module docstring); the bug: the tangent's mask
    is causal only, the primal's right."""
    def kernel(query, key, value, segment_ids, *, causal, scale):
        right = right_mask(segment_ids, causal)
        t = segment_ids.shape[1]
        loose = jnp.broadcast_to(causal_mask(t) if causal else jnp.ones((1, t, t), bool),
                                 right.shape)
        tangent_mask = loose if tangent_ignores_segments else right

        @jax.custom_jvp
        def attend(q, k, v):
            return dense(q, k, v, right, scale=scale)

        @attend.defjvp
        def attend_jvp(primals, tangents):
            out = attend(*primals)
            return out, _tangent(*primals, *tangents, tangent_mask, scale).astype(out.dtype)

        return attend(query, key, value)
    return kernel
