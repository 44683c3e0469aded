"""Reference attention: the float32 truth, its same-dtype peer, and an independent float64 oracle.

Three computations of one definition: token i of segment s attends to token j iff j is in the
same segment s (s > 0) and, when causal, j <= i. Padding tokens attend to nothing; their outputs
are defined as zero here and are never compared.

- `dense_attention(..., truth=True)`: float32 inputs, HIGHEST matmul precision, dense [B,T,T] mask
  (in blocks of queries for long rows). The truth every kernel is compared with.
- `dense_attention(..., truth=False)`: the same formula in the input dtype with the operations in
  another order (keys scaled instead of queries, scores rounded to the dtype). Its distance from
  the truth estimates the rounding noise any kernel of that dtype must be allowed.
- `segment_loop_attention`: NumPy float64, one segment at a time, with the backward pass written
  out by hand. It shares no code with the dense oracle, so the two check each other.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from harness.judge.metrics import scales, token_errors
from harness.judge.vocabulary import TENSORS
from harness.model.case import Case, make_inputs
from harness.model.layouts import check_segment_ids

# A finite "minus infinity": rows that attend to nothing (padding queries) stay NaN-free.
_MASKED = -1e30


def repeat_kv(x, heads: int):
    """[B, T, KV, D] -> [B, T, heads, D]: query head h reads kv head h // (heads // KV)."""
    return jnp.repeat(x, heads // x.shape[2], axis=2)


# Dense scores above this size are computed in blocks of queries (memory-bounded, same math).
_BLOCK_BYTES = 1 << 29


def _attend(query, key, value, seg_q, seg_k, pos_q, *, scale, causal, truth):
    """Attention of a block of queries (at positions pos_q) over the whole row."""
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
    mask = (seg_q[:, :, None] == seg_k[:, None, :]) & (seg_q[:, :, None] > 0)
    if causal:
        mask = mask & (jnp.arange(seg_k.shape[1])[None, None, :] <= pos_q[None, :, None])
    probs = jax.nn.softmax(jnp.where(mask[:, None], scores.astype(jnp.float32), _MASKED), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(dtype), v, precision=precision,
                     preferred_element_type=dtype)
    return jnp.where((seg_q > 0)[:, :, None, None], out, 0).astype(dtype)


def query_block(batch: int, heads: int, seq_len: int) -> int:
    """Queries per block so that one block's float32 scores stay under _BLOCK_BYTES."""
    rows = _BLOCK_BYTES // (4 * batch * heads * seq_len)
    return seq_len if rows >= seq_len else max(16, 1 << (max(rows, 1).bit_length() - 1))


def dense_attention(query, key, value, segment_ids, *, scale: float, causal: bool = True,
                    truth: bool = True, block: int | None = None):
    """Attention with the dense same-segment (and causal) mask. Long rows are computed in
    blocks of `block` queries, each rematerialized in the backward pass (jax.checkpoint), so
    memory stays bounded by one block's [batch, heads, block, seq] scores: a 32768-token row fits
    on one GPU. Every query sees the whole row either way: the same math."""
    b, t, heads, _ = query.shape
    block = block or query_block(b, heads, t)
    attend = functools.partial(_attend, scale=scale, causal=causal, truth=truth)
    if block >= t:
        return attend(query, key, value, segment_ids, segment_ids, jnp.arange(t))
    n = -(-t // block)
    pad = n * block - t
    q = jnp.pad(query, ((0, 0), (0, pad), (0, 0), (0, 0)))
    seg_q = jnp.pad(segment_ids, ((0, 0), (0, pad)))
    blocks = (q.reshape(b, n, block, *q.shape[2:]).swapaxes(0, 1),
              seg_q.reshape(b, n, block).swapaxes(0, 1),
              jnp.arange(n * block).reshape(n, block))
    step = jax.checkpoint(lambda x: attend(x[0], key, value, x[1], segment_ids, x[2]))
    out = jax.lax.map(step, blocks)                        # [n, b, block, heads, d]
    return out.swapaxes(0, 1).reshape(b, n * block, *out.shape[3:])[:, :t]


def segment_loop_attention(query, key, value, segment_ids, cotangent, *, scale: float,
                           causal: bool = True):
    """Float64 forward output and (dq, dk, dv) for the given output cotangent, per segment."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (query, key, value, cotangent))
    heads, kv_heads = q.shape[2], k.shape[2]
    group = heads // kv_heads
    out, dq = np.zeros_like(q), np.zeros_like(q)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    for seg in check_segment_ids(np.asarray(segment_ids), padding="anywhere"):
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


# ----- the reference of one case --------------------------------------------------------------

def with_gradients(fn, backward: bool = True):
    """fn(q, k, v, *aux) -> program(q, k, v, *aux, cotangent) = (out, dq, dk, dv) via jax.vjp
    (aux: segment ids, or precomputed lengths and offsets); (out,) without a backward pass."""
    def run(q, k, v, *rest):
        *aux, ct = rest
        if not backward:
            return (fn(q, k, v, *aux),)
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, *aux), q, k, v)
        return (out, *vjp(ct.astype(out.dtype)))
    return run


def reference_fn(case: Case, truth: bool):
    """(q, k, v, seg, cotangent) -> (out, dq, dk, dv) of the truth (float32) or of the
    same-dtype peer."""
    program = with_gradients(functools.partial(
        dense_attention, scale=case.scale, causal=case.causal, truth=truth))
    if not truth:
        return program

    def in_float32(q, k, v, seg, ct):
        # Gradients with respect to float32 copies: a bf16 query would round its dq to bf16.
        f32 = jnp.float32
        return program(q.astype(f32), k.astype(f32), v.astype(f32), seg, ct.astype(f32))
    return in_float32


@dataclass
class Reference:
    """The truth for one case, and how far the same-dtype peer lands from it, per token."""
    truth: tuple                              # out, dq, dk, dv in float32 (device arrays)
    peer_token_err: dict[str, np.ndarray]     # check name -> [B, T] max abs error of the peer
    scale: dict[str, float]                   # check name -> max |truth| over valid tokens


@functools.lru_cache(maxsize=2)
def reference_for(case: Case, programs=None) -> Reference:
    """The case's reference, from `programs` (harness.engine.programs.Programs: compiled ahead, timed)
    or from plain jit."""
    args = make_inputs(case).device_args
    if programs is not None:
        truth = programs.oracle(case, True)(*args)
        peer = programs.oracle(case, False)(*args)
    else:
        truth = jax.jit(reference_fn(case, True))(*args)
        peer = jax.jit(reference_fn(case, False))(*args)
    errors, biggest = jax.device_get((token_errors(peer, truth), scales(truth, args[3])))
    return Reference(truth=truth,
                     peer_token_err={c.name: e[0] for c, e in zip(TENSORS, errors)},
                     scale={c.name: float(b) for c, b in zip(TENSORS, biggest)})
