"""The bug zoo: broken attention kernels, each a bug class seen in real kernels, and correct
kernels written with different math. `python -m harness selftest` (harness.tools.selftest) runs them
all and proves that the harness catches every bug and flags no correct kernel.

Zoo kernels are never registered: they do not appear in `python -m harness list` or in the
kernel x case matrix.

Every kernel follows harness.engine.kernel: `fn(query, key, value, segment_ids, *, causal, scale)`,
[batch, seq, heads, head_dim], query head h reads kv head h // (heads // kv_heads). Masks are
[batch, seq_q, seq_k] booleans built from the segment ids. Valid queries never read padding;
padding queries (never compared) read something harmless so that nothing is NaN.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import jax
import jax.numpy as jnp

from harness.engine.kernel import Kernel

_MASKED = -1e30     # a finite minus infinity: fully masked rows stay NaN-free


@dataclass(frozen=True)
class Entry:
    kernel: Kernel
    bug: str            # the bug class in one line; for a correct kernel, its math
    correct: bool = False

    @property
    def name(self) -> str:
        return self.kernel.name


# ----- masks ------------------------------------------------------------------------------------

def _positions(t: int):
    return jnp.arange(t)


def segment_bounds(segment_ids):
    """(start, stop) [B, T]: the first position of each token's run, and one past its last."""
    t = segment_ids.shape[1]
    pos = _positions(t)[None, :]
    prev = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)), constant_values=-1)
    nxt = jnp.pad(segment_ids[:, 1:], ((0, 0), (0, 1)), constant_values=-1)
    first = segment_ids != prev
    last = segment_ids != nxt
    start = jax.lax.cummax(jnp.where(first, pos, 0), axis=1)
    stop = jax.lax.cummin(jnp.where(last, pos + 1, t), axis=1, reverse=True)
    return start, stop


def causal_mask(t: int):
    pos = _positions(t)
    return (pos[None, :, None] >= pos[None, None, :])


def same_segment(seg_q, seg_k=None):
    seg_k = seg_q if seg_k is None else seg_k
    return seg_q[:, :, None] == seg_k[:, None, :]


def right_mask(segment_ids, causal: bool):
    """The definition: same segment (padding only with padding), and k <= q when causal."""
    mask = same_segment(segment_ids)
    return mask & causal_mask(segment_ids.shape[1]) if causal else mask


def _valid_rows(segment_ids, mask, fallback):
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
    p = jax.nn.softmax(jnp.where(mask, s, _MASKED), axis=-1)
    if after_softmax is not None:
        p = after_softmax(p)
    out = jnp.einsum("bhqk,bkhd->bqhd", p.astype(value.dtype), v,
                     preferred_element_type=jnp.float32)
    return out.astype(query.dtype)


def _group_sum(x, kv_heads: int, reduce: str = "sum"):
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
        s = jnp.where(m[:, None], scores(q, k), _MASKED)
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
        with _enable_x64() if dtype == jnp.float64 else contextlib.nullcontext():
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
        return (dq.astype(in_dtype), _group_sum(dk, kv_heads, kv_reduce).astype(key.dtype),
                _group_sum(dv, kv_heads, kv_reduce).astype(value.dtype), None, None, None)

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
    pos = _positions(t)[None, None, :]
    hi = pos <= _positions(t)[None, :, None] if causal else pos < stop[:, :, None]
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
    pos_q = _positions(t)

    def step(carry, xs):
        m, l, acc = carry                      # [B,H,T], [B,H,T], [B,T,H,D] float32
        kj, vj, segj, j = xs
        s = jnp.einsum("bqhd,bkhd->bhqk", query, kj, preferred_element_type=jnp.float32) * scale
        allowed = segment_ids[:, :, None] == segj[:, None, :]
        if causal:
            pos_k = j * block + jnp.arange(block)
            allowed = allowed & (pos_k[None, None, :] <= pos_q[None, :, None])
        s = jnp.where(allowed[:, None], s, _MASKED)
        m_new = jnp.maximum(m, s.max(axis=-1))
        alpha = jnp.exp(m - m_new)
        p = jnp.exp(s - m_new[..., None])
        l = l * alpha + p.sum(axis=-1)
        pv = jnp.einsum("bhqk,bkhd->bqhd", p.astype(value.dtype), vj,
                        preferred_element_type=jnp.float32)
        acc = acc * alpha.transpose(0, 2, 1)[..., None] + pv
        return (m_new, l, acc), None

    init = (jnp.full((b, heads, t), _MASKED, jnp.float32), jnp.zeros((b, heads, t), jnp.float32),
            jnp.zeros((b, t, heads, d), jnp.float32))
    (m, l, acc), _ = jax.lax.scan(step, init, (kb, vb, sb, jnp.arange(n)))
    # Padding queries read padding keys (at least themselves): l > 0 everywhere.
    return (acc / l.transpose(0, 2, 1)[..., None]).astype(query.dtype)


def _enable_x64():
    ctx = getattr(jax, "enable_x64", None)
    if ctx is None:  # older jax
        from jax.experimental import enable_x64 as ctx
    return ctx(True)


def float64(query, key, value, segment_ids, *, causal, scale):
    """Forward and hand-written backward in float64 (jax's x64 inside the kernel only)."""
    with _enable_x64():
        mask = _valid_rows(segment_ids, right_mask(segment_ids, causal),
                           jnp.eye(segment_ids.shape[1], dtype=bool)[None])
        return manual(query, key, value, mask, scale=scale, dtype=jnp.float64)


# ----- broken kernels ---------------------------------------------------------------------------

def _reference_math(mask_fn, **dense_kw):
    """A kernel that is right except for its mask: mask_fn(segment_ids, causal) -> [B,T,T]."""
    def kernel(query, key, value, segment_ids, *, causal, scale):
        mask = _valid_rows(segment_ids, mask_fn(segment_ids, causal),
                           right_mask(segment_ids, causal))
        return dense(query, key, value, mask, scale=scale, **dense_kw)
    return kernel


def _off_by_one_mask(segment_ids, causal):
    # Each query reads from one position before its segment's start (start - 1 from cu_seqlens).
    t = segment_ids.shape[1]
    start, stop = segment_bounds(segment_ids)
    pos = _positions(t)[None, None, :]
    hi = pos <= _positions(t)[None, :, None] if causal else pos < stop[:, :, None]
    return (pos >= start[:, :, None] - 1) & hi


BLOCK_TILE = 64


def _block_granular_mask(segment_ids, causal, tile=BLOCK_TILE):
    # Tiles of 64 x 64 that contain any allowed pair are computed in full: inside them only the
    # causal mask is applied (the segment mask is skipped, as for a tile classified "full").
    b, t = segment_ids.shape
    n = -(-t // tile)
    pad = n * tile - t
    exact = right_mask(segment_ids, causal) & (segment_ids > 0)[:, :, None]
    exact = jnp.pad(exact, ((0, 0), (0, pad), (0, pad)))
    tiles = exact.reshape(b, n, tile, n, tile).any(axis=(2, 4))
    coarse = jnp.repeat(jnp.repeat(tiles, tile, axis=1), tile, axis=2)[:, :t, :t]
    return coarse & causal_mask(t) if causal else coarse


def _padding_keys_mask(segment_ids, causal):
    # Padding keys (id 0) are let through: the key-side check forgot that 0 is not a segment.
    mask = same_segment(segment_ids) | (segment_ids[:, None, :] == 0)
    return mask & causal_mask(segment_ids.shape[1]) if causal else mask


FOLD = 16


def _folded_mask(segment_ids, causal):
    # Ids stored in 4 bits: segment 17 is segment 1 again, 18 is 2 ...
    folded = jnp.where(segment_ids > 0, (segment_ids - 1) % FOLD + 1, 0)
    return right_mask(folded, causal)


WINDOW = 512


def _window_mask(segment_ids, causal):
    # A local-attention window of 512 tokens left on (sliding-window config leaked into a
    # full-attention layer).
    t = segment_ids.shape[1]
    pos = _positions(t)
    near = jnp.abs(pos[:, None] - pos[None, :])[None] < WINDOW
    return right_mask(segment_ids, causal) & near


def _last_segment_unmasked(segment_ids, causal):
    # The last segment of each row (end taken from seq_len) gets only the causal mask.
    t = segment_ids.shape[1]
    last = segment_ids == segment_ids.max(axis=1, keepdims=True)
    everything = jnp.ones((1, t, t), bool)
    free = everything & causal_mask(t) if causal else everything
    return jnp.where(last[:, :, None], free, right_mask(segment_ids, causal))


def _causal_first_segment_only(segment_ids, causal):
    # The causal mask is applied only to segment 1; later segments attend bidirectionally.
    same = same_segment(segment_ids)
    if not causal:
        return same
    return jnp.where((segment_ids == 1)[:, :, None], same & causal_mask(segment_ids.shape[1]),
                     same)


def _always_causal(segment_ids, causal):
    # causal=False is ignored: the kernel was written for decoders.
    return right_mask(segment_ids, True)


def _compacted(segment_ids):
    """The ids a kernel sees when it rebuilds segments from their lengths alone (cu_seqlens
    without pad_between_seqs): runs laid end to end from position 0, padding after them."""
    valid = segment_ids > 0
    order = jnp.argsort(~valid, axis=1, stable=True)
    ids = jnp.take_along_axis(segment_ids, order, axis=1)
    count = valid.sum(axis=1, keepdims=True)
    return jnp.where(_positions(segment_ids.shape[1])[None] < count, ids, 0)


def _lengths_only(query, key, value, segment_ids, *, causal, scale):
    ids = _compacted(segment_ids)
    return dense(query, key, value, right_mask(ids, causal), scale=scale)


def _mask_after_softmax(query, key, value, segment_ids, *, causal, scale):
    # Softmax under the causal mask only; the segment mask multiplied in afterwards, without
    # renormalizing.
    t = segment_ids.shape[1]
    plain = causal_mask(t) if causal else jnp.ones((1, t, t), bool)
    plain = jnp.broadcast_to(plain, (segment_ids.shape[0], t, t))
    same = same_segment(segment_ids)[:, None]
    return dense(query, key, value, plain, scale=scale,
                 after_softmax=lambda p: jnp.where(same, p, 0.0))


def _wrong_gqa(query, key, value, segment_ids, *, causal, scale):
    # Query head h reads kv head h % kv_heads (interleaved) instead of h // group.
    heads, kv_heads = query.shape[2], key.shape[2]
    return dense(query, key, value, right_mask(segment_ids, causal), scale=scale,
                 kv_of_head=jnp.arange(heads) % kv_heads)


def _scale_twice(query, key, value, segment_ids, *, causal, scale):
    # The caller pre-scaled q and the kernel applies the scale again: 1/d, not 1/sqrt(d).
    return dense(query, key, value, right_mask(segment_ids, causal), scale=scale * scale)


def _single_tokens_zeroed(query, key, value, segment_ids, *, causal, scale):
    # Segments of one token take a "nothing to attend" early exit: output left at zero.
    out = dense(query, key, value, right_mask(segment_ids, causal), scale=scale)
    start, stop = segment_bounds(segment_ids)
    one = ((stop - start) == 1) & (segment_ids > 0)
    return jnp.where(one[:, :, None, None], jnp.zeros_like(out), out)


def _backward_bug(which):
    def kernel(query, key, value, segment_ids, *, causal, scale):
        right = right_mask(segment_ids, causal)
        t = segment_ids.shape[1]
        # The backward kernel's mask ignores the segment ids (causal only).
        loose = causal_mask(t) if causal else jnp.ones((1, t, t), bool)
        loose = jnp.broadcast_to(loose, right.shape)
        if which == "dq":
            return manual(query, key, value, right, scale=scale, dq_mask=loose)
        if which == "dkdv":
            return manual(query, key, value, right, scale=scale, dkdv_mask=loose)
        return manual(query, key, value, right, scale=scale, kv_reduce="mean")
    return kernel


def _writes_at_padding(fill, what=("dq", "dk", "dv")):
    """Right attention whose backward writes `fill(x)` into the gradients at padding positions
    (stale memory, an unmasked epilogue): invisible on valid tokens, but it reaches the weight
    gradients in training."""
    def kernel(query, key, value, segment_ids, *, causal, scale):
        pad = (segment_ids == 0)[:, :, None, None]

        def right(q, k, v):
            return dense(q, k, v, right_mask(segment_ids, causal), scale=scale)

        @jax.custom_vjp
        def attend(q, k, v):
            return right(q, k, v)

        def attend_fwd(q, k, v):
            return right(q, k, v), (q, k, v)

        def attend_bwd(res, g):
            _, vjp = jax.vjp(right, *res)
            grads = vjp(g)
            return tuple(jnp.where(pad, fill(x), d) if name in what else d
                         for name, x, d in zip(("dq", "dk", "dv"), res, grads))

        attend.defvjp(attend_fwd, attend_bwd)
        return attend(query, key, value)
    return kernel


def _nan_output_at_padding(query, key, value, segment_ids, *, causal, scale):
    # An epilogue that divides by a zero row sum at padding (nothing attended): NaN written there.
    out = dense(query, key, value, right_mask(segment_ids, causal), scale=scale)
    return jnp.where((segment_ids > 0)[:, :, None, None], out, jnp.nan)


def _float32_output(query, key, value, segment_ids, *, causal, scale):
    # Right values, but the output is returned in float32 for bfloat16 inputs: the next layer's
    # matmul silently runs in another precision, and memory doubles.
    q, k, v = (x.astype(jnp.float32) for x in (query, key, value))
    return dense(q, k, v, right_mask(segment_ids, causal), scale=scale)


def _reorder_forgets_segments(query, key, value, segment_ids, *, causal, scale):
    # Context parallelism's load-balancing reorder (striped, as for 2 shards) applied to the
    # tokens and their positions but not to the segment ids: each token carries the id of the
    # token whose slot it took. Attention in reordered order, output restored to token order.
    from harness.kernels.load_balance import reorder, restore
    start, _ = segment_bounds(segment_ids)
    pos = jnp.where(segment_ids > 0, _positions(segment_ids.shape[1])[None] - start, 0)
    q, k, v, pos = (reorder(x, 2) for x in (query, key, value, pos))
    mask = same_segment(segment_ids)                    # ids left in token order
    if causal:
        mask = mask & (pos[:, None, :] <= pos[:, :, None])
    return restore(dense(q, k, v, mask, scale=scale), 2)


def _kernel(name, fn, description):
    return Kernel(name, fn, padding_anywhere=True, materializes_scores=True,
                  dtypes=("float32", "bfloat16"), tags=("zoo",), description=description)


_BUGS = [
    ("off_by_one_boundary", _reference_math(_off_by_one_mask),
     "boundary off by one: a segment also reads the token before it"),
    ("block_granular_mask", _reference_math(_block_granular_mask),
     "block-granular mask: a 64x64 tile touching a segment is read whole"),
    ("wrong_gqa_mapping", _wrong_gqa,
     "wrong GQA head mapping: kv head h % kv_heads, not h // group"),
    ("gqa_grad_mean", _backward_bug("mean"),
     "GQA backward: dk/dv averaged, not summed, over a kv head's group"),
    ("padding_keys_attended", _reference_math(_padding_keys_mask),
     "padding keys attended: the key-side mask lets id 0 through"),
    ("scale_applied_twice", _scale_twice,
     "wrong scale: applied twice (1/d, not 1/sqrt(d))"),
    ("segment_ids_folded", _reference_math(_folded_mask),
     "segment ids folded into 4 bits: segment 17 reads segment 1"),
    ("local_window_512", _reference_math(_window_mask),
     "a local window: 512-token sliding window left on"),
    ("dq_only_leak", _backward_bug("dq"),
     "dq-only leak: the dq backward kernel ignores segment ids"),
    ("dkdv_only_leak", _backward_bug("dkdv"),
     "dk/dv-only leak: the dk/dv backward kernel ignores segment ids"),
    ("single_tokens_zeroed", _single_tokens_zeroed,
     "single-token segments zeroed by an early exit"),
    ("last_segment_unmasked", _reference_math(_last_segment_unmasked),
     "last segment unmasked: it reads every earlier token"),
    ("causal_first_segment_only", _reference_math(_causal_first_segment_only),
     "non-causal after the first segment: later ones see their future"),
    ("causal_flag_ignored", _reference_math(_always_causal),
     "causal=False ignored: bidirectional rows computed causally"),
    ("lengths_only_segments", _lengths_only,
     "segments rebuilt from lengths alone: padding between shifts them"),
    ("mask_after_softmax", _mask_after_softmax,
     "segment mask applied after the softmax, not renormalized"),
    ("nan_output_at_padding", _nan_output_at_padding,
     "NaN output at padding positions (poisons the next layer)"),
    ("grads_at_padding", _writes_at_padding(lambda x: x),
     "non-zero dq/dk/dv at padding (stale values reach weight grads)"),
    ("nan_grads_at_padding", _writes_at_padding(lambda x: jnp.full_like(x, jnp.nan), ("dk",)),
     "NaN dk at padding (every weight gradient goes NaN)"),
    ("float32_output", _float32_output,
     "float32 output for bfloat16 inputs (the output contract)"),
    ("reorder_forgets_segments", _reorder_forgets_segments,
     "context-parallel reorder moves the tokens, not their segment ids"),
]

_CORRECT = [
    ("ok_additive_bias", additive_bias,
     "additive -1e9 bias from segment start/stop, GQA by reshape"),
    ("ok_online_softmax", online_softmax,
     "online softmax over 128-key blocks (flash-style), fp32 state"),
    ("ok_float64", float64,
     "float64 forward and hand-written backward (custom_vjp)"),
]


def entries() -> list[Entry]:
    """The zoo: the broken kernels, then the correct ones."""
    return ([Entry(_kernel(name, fn, bug), bug) for name, fn, bug in _BUGS]
            + [Entry(_kernel(name, fn, math), math, correct=True) for name, fn, math in _CORRECT])
