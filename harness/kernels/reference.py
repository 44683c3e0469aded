"""Plain-JAX kernels: MaxText's dot_product, XLA's dot_product_attention, and the bug canary."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from harness.registry import register_kernel

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


def xla_dot_product_attention(query, key, value, segment_ids, *, causal, scale):
    """jax.nn.dot_product_attention, XLA implementation, with the same-segment mask."""
    return jax.nn.dot_product_attention(
        query, key, value, mask=segment_mask(segment_ids, causal=False), scale=scale,
        is_causal=causal, implementation="xla")


def no_f16_on_cpu(case, platform):
    # XLA:CPU's dot_general rejects float16 operands with float32 accumulation, which
    # jax.nn.dot_product_attention asks for ("precision F16_F16_F32 is not supported").
    if platform.name == "cpu" and case.dtype == "float16":
        return ["float16 dot_general with float32 accumulation is not supported by XLA:CPU"]
    return []


def causal_only(query, key, value, segment_ids, *, causal, scale):
    """The reported bug: a causal mask only, segment ids ignored (MaxText's cudnn_flash_jax)."""
    del segment_ids
    return jax.nn.dot_product_attention(query, key, value, scale=scale, is_causal=True,
                                        implementation="xla")


# Later queries reading segment 1's keys move its dk/dv by an amount that grows with their
# number; below this many later tokens the move can hide inside bf16 rounding.
CANARY_MIN_LATER_TOKENS = 16


def causal_only_expectation(case, check, segment):
    """Where ignoring segment ids must be caught.

    The forward output and dq of a segment are wrong iff earlier segments precede it in its row:
    exactly segments 2.. fail, segment 1 passes. dk and dv of a packed row's segment 1 are wrong
    because every later query reads its keys; that must be caught whenever the later segments
    hold at least CANARY_MIN_LATER_TOKENS tokens. dk/dv of later segments are wrong too (their
    attention weights are diluted by the earlier keys) but by an amount the layout decides
    (a single trailing token's key gradient moves by very little), so they are not judged.
    Unpacked rows are right everywhere."""
    row_segments = [s for s in case.segments if s.row == segment.row]
    if check in ("out", "dq"):
        return "fail" if segment.number > 1 else "pass"
    if len(row_segments) == 1:
        return "pass"
    if segment.number == 1:
        later = sum(s.length for s in row_segments[1:])
        return "fail" if later >= CANARY_MIN_LATER_TOKENS else "either"
    return "either"


register_kernel(
    "dot_product", dot_product,
    description="MaxText-style dot_product attention in the input dtype (dense mask)")
register_kernel(
    "xla", xla_dot_product_attention, constraints=no_f16_on_cpu,
    description="jax.nn.dot_product_attention(implementation='xla') with the segment mask")
register_kernel(
    "canary_causal_only", causal_only, causal_only=True, constraints=no_f16_on_cpu, expect=causal_only_expectation,
    tags=("canary",),
    description="causal mask only, segment ids ignored: the reported bug; must be caught")
