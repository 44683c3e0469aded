"""The zoo's attention math: masks from segment ids, dense attention, attention with its backward
written out (as fused kernels' separate dq and dk/dv kernels compute it), and three correct
kernels written with different math."""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

MASKED = -1e30     # a finite minus infinity: fully masked rows stay NaN-free


# ----- masks ------------------------------------------------------------------------------------

def positions(t: int):
    return jnp.arange(t)


def segment_bounds(segment_ids):
    """(start, stop) [B, T]: the first position of each token's run, and one past its last."""
    t = segment_ids.shape[1]
    pos = positions(t)[None, :]
    prev = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    nxt = jnp.pad(segment_ids[:, 1:], ((0, 0), (0, 1)), constant_values=-1)
    first = segment_ids != prev
    last = segment_ids != nxt
    start = jax.lax.cummax(jnp.where(first, pos, 0), axis=1)
    stop = jax.lax.cummin(jnp.where(last, pos + 1, t), axis=1, reverse=True)
    return start, stop


def causal_mask(t: int):
    pos = positions(t)
    return (pos[None, :, None] >= pos[None, None, :])


def same_segment(seg_q, seg_k=None):
    seg_k = seg_q if seg_k is None else seg_k
    return seg_q[:, :, None] == seg_k[:, None, :]


def right_mask(segment_ids, causal: bool):
    """The definition: same segment (padding only with padding), and k <= q when causal."""
    mask = same_segment(segment_ids)
    return mask & causal_mask(segment_ids.shape[1]) if causal else mask


def valid_rows(segment_ids, mask, fallback):
    """`mask` for valid queries, `fallback` for padding queries."""
    return jnp.where((segment_ids > 0)[:, :, None], mask, fallback)


# ----- shared attention math --------------------------------------------------------------------

def kv_index(heads: int, kv_heads: int):
    """The kv head each query head reads: h // (heads // kv_heads)."""
    return jnp.arange(heads) // (heads // kv_heads)


def dense(query, key, value, mask, *, scale, kv_of_head=None, after_softmax=None):
    """Dense attention over a [B, T, T] (or [B, H, T, T]) mask: scores and softmax in float32,
    matmuls in the input dtype with float32 accumulation."""
    heads, kv_heads = query.shape[2], key.shape[2]
    idx = kv_index(heads, kv_heads) if kv_of_head is None else kv_of_head
    k = jnp.take(key, idx, axis=2)
    v = jnp.take(value, idx, axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", query, k, preferred_element_type=jnp.float32) * scale
    mask = mask[:, None] if mask.ndim == 3 else mask
    p = jax.nn.softmax(jnp.where(mask, s, MASKED), axis=-1)
    if after_softmax is not None:
        p = after_softmax(p)
    out = jnp.einsum("bhqk,bkhd->bqhd", p.astype(value.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.astype(query.dtype)


def group_sum(x, kv_heads: int, reduce: str = "sum"):
    """[B, T, H, D] -> [B, T, KV, D]: a kv head's gradient over the query heads that read it."""
    b, t, h, d = x.shape
    x = x.reshape(b, t, kv_heads, h // kv_heads, d)
    return x.mean(axis=3) if reduce == "mean" else x.sum(axis=3)


def manual(query, key, value, mask, *, scale, dtype=jnp.float32, dq_mask=None, dkdv_mask=None,
           kv_reduce="sum"):
    """Dense attention with the backward pass written out (custom_vjp), as a fused kernel's
    separate dq and dk/dv kernels compute it: each recomputes the probabilities from the
    forward's log-sum-exp under its own mask. All math in `dtype`.

    dq_mask / dkdv_mask: the masks those backward kernels use (default: the forward's).
    kv_reduce: how dk/dv are reduced over the query heads of a kv head ("sum" is right)."""
    dq_mask = mask if dq_mask is None else dq_mask
    dkdv_mask = mask if dkdv_mask is None else dkdv_mask
    heads, kv_heads = query.shape[2], key.shape[2]
    group = heads // kv_heads
    in_dtype = query.dtype

    def scores(q, k):
        q = q.astype(dtype)
        k = jnp.repeat(k.astype(dtype), group, axis=2)
        return jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=jax.lax.Precision.HIGHEST) * scale

    def forward(q, k, v, m):
        s = jnp.where(m[:, None], scores(q, k), MASKED)
        lse = jax.nn.logsumexp(s, axis=-1, keepdims=True)
        p = jnp.exp(s - lse)
        vv = jnp.repeat(v.astype(dtype), group, axis=2)
        out = jnp.einsum("bhqk,bkhd->bqhd", p, vv, precision=jax.lax.Precision.HIGHEST)
        return out, lse

    @jax.custom_vjp
    def attend(q, k, v, m, m_dq, m_kv):
        return forward(q, k, v, m)[0].astype(in_dtype)

    def attend_fwd(q, k, v, m, m_dq, m_kv):
        out, lse = forward(q, k, v, m)
        return out.astype(in_dtype), (q, k, v, m_dq, m_kv, out, lse)

    def attend_bwd(res, g):
        # The backward pass is traced after the forward, outside any context the kernel
        # entered: float64 needs jax's x64 here again.
        with enable_x64() if dtype == jnp.float64 else contextlib.nullcontext():
            return _backward(res, g)

    def _backward(res, g):
        q, k, v, m_dq, m_kv, out, lse = res
        hi = jax.lax.Precision.HIGHEST
        s = scores(q, k)
        do = g.astype(dtype)
        kk = jnp.repeat(k.astype(dtype), group, axis=2)
        vv = jnp.repeat(v.astype(dtype), group, axis=2)
        qq = q.astype(dtype)
        dp = jnp.einsum("bqhd,bkhd->bhqk", do, vv, precision=hi)
        delta = jnp.einsum("bqhd,bqhd->bhq", do, out, precision=hi)[..., None]

        def probs(m):
            return jnp.where(m[:, None], jnp.exp(jnp.minimum(s - lse, 0.0)), 0.0)

        p_dq = probs(m_dq)
        dq = jnp.einsum("bhqk,bkhd->bqhd", p_dq * (dp - delta), kk, precision=hi) * scale
        p_kv = probs(m_kv)
        dk = jnp.einsum("bhqk,bqhd->bkhd", p_kv * (dp - delta), qq, precision=hi) * scale
        dv = jnp.einsum("bhqk,bqhd->bkhd", p_kv, do, precision=hi)
        return (dq.astype(in_dtype), group_sum(dk, kv_heads, kv_reduce).astype(key.dtype),
                group_sum(dv, kv_heads, kv_reduce).astype(value.dtype), None, None, None)

    attend.defvjp(attend_fwd, attend_bwd)
    return attend(query, key, value, mask, dq_mask, dkdv_mask)


# ----- correct kernels (different math) ---------------------------------------------------------

def additive_bias(query, key, value, segment_ids, *, causal, scale):
    """An additive bias (0 or -1e9) on the float32 scores, built from segment ranges
    (cu_seqlens-style start/stop positions) rather than id equality; grouped-query heads by
    reshaping the query."""
    b, t, heads, d = query.shape
    kv_heads = key.shape[2]
    start, stop = segment_bounds(segment_ids)
    pos = positions(t)[None, None, :]
    hi = pos <= positions(t)[None, :, None] if causal else pos < stop[:, :, None]
    allowed = (pos >= start[:, :, None]) & hi
    # Padding queries read their own run (any harmless choice).
    bias = jnp.where(allowed, 0.0, -1e9).astype(jnp.float32)[:, None, None]   # [B,1,1,T,T]
    q = query.reshape(b, t, kv_heads, heads // kv_heads, d)
    s = jnp.einsum("btkgd,bskd->bkgts", q, key, preferred_element_type=jnp.float32)
    p = jax.nn.softmax(s * scale + bias, axis=-1)
    out = jnp.einsum("bkgts,bskd->btkgd", p.astype(value.dtype), value,
                     preferred_element_type=jnp.float32)
    return out.reshape(b, t, heads, d).astype(query.dtype)


ONLINE_BLOCK = 128


def online_softmax(query, key, value, segment_ids, *, causal, scale, block=ONLINE_BLOCK):
    """Flash-style: keys in blocks of 128, a running max and sum per query (online softmax),
    matmuls in the input dtype with float32 accumulation, probabilities rounded to the input
    dtype for P @ V. Gradients by differentiating the scan."""
    b, t, heads, d = query.shape
    kv_heads = key.shape[2]
    n = -(-t // block)
    pad = n * block - t
    idx = kv_index(heads, kv_heads)
    k = jnp.pad(jnp.take(key, idx, axis=2), ((0, 0), (0, pad), (0, 0), (0, 0)))
    v = jnp.pad(jnp.take(value, idx, axis=2), ((0, 0), (0, pad), (0, 0), (0, 0)))
    seg_k = jnp.pad(segment_ids, ((0, 0), (0, pad)), constant_values=-1)   # matches nothing
    kb = k.reshape(b, n, block, heads, d).swapaxes(0, 1)
    vb = v.reshape(b, n, block, heads, d).swapaxes(0, 1)
    sb = seg_k.reshape(b, n, block).swapaxes(0, 1)
    pos_q = positions(t)

    def step(carry, xs):
        m, l, acc = carry                      # [B,H,T], [B,H,T], [B,T,H,D] float32
        kj, vj, segj, j = xs
        s = jnp.einsum("bqhd,bkhd->bhqk", query, kj, preferred_element_type=jnp.float32) * scale
        allowed = segment_ids[:, :, None] == segj[:, None, :]
        if causal:
            pos_k = j * block + jnp.arange(block)
            allowed = allowed & (pos_k[None, None, :] <= pos_q[None, :, None])
        s = jnp.where(allowed[:, None], s, MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        l = l * alpha + p.sum(axis=-1)
        pv = jnp.einsum("bhqk,bkhd->bqhd", p.astype(value.dtype), vj,
                        preferred_element_type=jnp.float32)
        acc = acc * alpha.transpose(0, 2, 1)[..., None] + pv
        return (m_new, l, acc), None

    init = (jnp.full((b, heads, t), MASKED, jnp.float32), jnp.zeros((b, heads, t), jnp.float32),
            jnp.zeros((b, t, heads, d), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(step, init, (kb, vb, sb, jnp.arange(n)))
    # Padding queries read padding keys (at least themselves): l > 0 everywhere.
    return (acc / l.transpose(0, 2, 1)[..., None]).astype(query.dtype)


def enable_x64():
    ctx = getattr(jax, "enable_x64", None)
    if ctx is None:  # older jax
        from jax.experimental import enable_x64 as ctx
    return ctx(True)


def float64(query, key, value, segment_ids, *, causal, scale):
    """Forward and hand-written backward in float64 (jax's x64 inside the kernel only)."""
    with enable_x64():
        mask = valid_rows(segment_ids, right_mask(segment_ids, causal),
                           jnp.eye(segment_ids.shape[1], dtype=bool)[None])
        return manual(query, key, value, mask, scale=scale, dtype=jnp.float64)


