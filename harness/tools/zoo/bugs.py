"""The zoo's broken kernels: each one bug class seen in real kernels, built on the zoo's
reference math with one thing wrong."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from harness.tools.zoo.reference_math import (
    causal_mask,
    dense,
    manual,
    positions,
    right_mask,
    same_segment,
    segment_bounds,
    valid_rows,
)


def with_mask(mask_fn, **dense_kw):
    """A kernel that is right except for its mask: mask_fn(segment_ids, causal) -> [B,T,T]."""
    def kernel(query, key, value, segment_ids, *, causal, scale):
        mask = valid_rows(segment_ids, mask_fn(segment_ids, causal),
                           right_mask(segment_ids, causal))
        return dense(query, key, value, mask, scale=scale, **dense_kw)
    return kernel


def off_by_one_mask(segment_ids, causal):
    # Each query reads from one position before its segment's start (start - 1 from cu_seqlens).
    t = segment_ids.shape[1]
    start, stop = segment_bounds(segment_ids)
    pos = positions(t)[None, None, :]
    hi = pos <= positions(t)[None, :, None] if causal else pos < stop[:, :, None]
    return (pos >= start[:, :, None] - 1) & hi


BLOCK_TILE = 64


def block_granular_mask(segment_ids, causal, tile=BLOCK_TILE):
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


def padding_keys_mask(segment_ids, causal):
    # Padding keys (id 0) are let through: the key-side check forgot that 0 is not a segment.
    mask = same_segment(segment_ids) | (segment_ids[:, None, :] == 0)
    return mask & causal_mask(segment_ids.shape[1]) if causal else mask


FOLD = 16


def folded_mask(segment_ids, causal):
    # Ids stored in 4 bits: segment 17 is segment 1 again, 18 is 2 ...
    folded = jnp.where(segment_ids > 0, (segment_ids - 1) % FOLD + 1, 0)
    return right_mask(folded, causal)


WINDOW = 512


def window_mask(segment_ids, causal):
    # A local-attention window of 512 tokens left on (sliding-window config leaked into a
    # full-attention layer).
    t = segment_ids.shape[1]
    pos = positions(t)
    near = jnp.abs(pos[:, None] - pos[None, :])[None] < WINDOW
    return right_mask(segment_ids, causal) & near


def last_segment_unmasked(segment_ids, causal):
    # The last segment of each row (end taken from seq_len) gets only the causal mask.
    t = segment_ids.shape[1]
    last = segment_ids == segment_ids.max(axis=1, keepdims=True)
    everything = jnp.ones((1, t, t), bool)
    free = everything & causal_mask(t) if causal else everything
    return jnp.where(last[:, :, None], free, right_mask(segment_ids, causal))


def causal_first_segment_only(segment_ids, causal):
    # The causal mask is applied only to segment 1; later segments attend bidirectionally.
    same = same_segment(segment_ids)
    if not causal:
        return same
    return jnp.where((segment_ids == 1)[:, :, None], same & causal_mask(segment_ids.shape[1]),
                     same)


def always_causal(segment_ids, causal):
    # causal=False is ignored: the kernel was written for decoders.
    return right_mask(segment_ids, True)


def compacted(segment_ids):
    """The ids a kernel sees when it rebuilds segments from their lengths alone (cu_seqlens
    without pad_between_seqs): runs laid end to end from position 0, padding after them."""
    valid = segment_ids > 0
    order = jnp.argsort(~valid, axis=1, stable=True)
    ids = jnp.take_along_axis(segment_ids, order, axis=1)
    count = valid.sum(axis=1, keepdims=True)
    return jnp.where(positions(segment_ids.shape[1])[None] < count, ids, 0)


def lengths_only(query, key, value, segment_ids, *, causal, scale):
    ids = compacted(segment_ids)
    return dense(query, key, value, right_mask(ids, causal), scale=scale)


def mask_after_softmax(query, key, value, segment_ids, *, causal, scale):
    # Softmax under the causal mask only; the segment mask multiplied in afterwards, without
    # renormalizing.
    t = segment_ids.shape[1]
    plain = causal_mask(t) if causal else jnp.ones((1, t, t), bool)
    plain = jnp.broadcast_to(plain, (segment_ids.shape[0], t, t))
    same = same_segment(segment_ids)[:, None]
    return dense(query, key, value, plain, scale=scale,
                 after_softmax=lambda p: jnp.where(same, p, 0.0))


def wrong_gqa(query, key, value, segment_ids, *, causal, scale):
    # Query head h reads kv head h % kv_heads (interleaved) instead of h // group.
    heads, kv_heads = query.shape[2], key.shape[2]
    return dense(query, key, value, right_mask(segment_ids, causal), scale=scale,
                 kv_of_head=jnp.arange(heads) % kv_heads)


def scale_twice(query, key, value, segment_ids, *, causal, scale):
    # The caller pre-scaled q and the kernel applies the scale again: 1/d, not 1/sqrt(d).
    return dense(query, key, value, right_mask(segment_ids, causal), scale=scale * scale)


def single_tokens_zeroed(query, key, value, segment_ids, *, causal, scale):
    # Segments of one token take a "nothing to attend" early exit: output left at zero.
    out = dense(query, key, value, right_mask(segment_ids, causal), scale=scale)
    start, stop = segment_bounds(segment_ids)
    one = ((stop - start) == 1) & (segment_ids > 0)
    return jnp.where(one[:, :, None, None], jnp.zeros_like(out), out)


def backward_bug(which):
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


def writes_at_padding(fill, what=("dq", "dk", "dv")):
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


def nan_output_at_padding(query, key, value, segment_ids, *, causal, scale):
    # An epilogue that divides by a zero row sum at padding (nothing attended): NaN written there.
    out = dense(query, key, value, right_mask(segment_ids, causal), scale=scale)
    return jnp.where((segment_ids > 0)[:, :, None, None], out, jnp.nan)


def float32_output(query, key, value, segment_ids, *, causal, scale):
    # Right values, but the output is returned in float32 for bfloat16 inputs: the next layer's
    # matmul silently runs in another precision, and memory doubles.
    q, k, v = (x.astype(jnp.float32) for x in (query, key, value))
    return dense(q, k, v, right_mask(segment_ids, causal), scale=scale)


def reorder_forgets_segments(query, key, value, segment_ids, *, causal, scale):
    # Context parallelism's load-balancing reorder (striped, as for 2 shards) applied to the
    # tokens and their positions but not to the segment ids: each token carries the id of the
    # token whose slot it took. Attention in reordered order, output restored to token order.
    from harness.kernels.load_balance import reorder, restore
    start, _ = segment_bounds(segment_ids)
    pos = jnp.where(segment_ids > 0, positions(segment_ids.shape[1])[None] - start, 0)
    q, k, v, pos = (reorder(x, 2) for x in (query, key, value, pos))
    mask = same_segment(segment_ids)                    # ids left in token order
    if causal:
        mask = mask & (pos[:, None, :] <= pos[:, :, None])
    return restore(dense(q, k, v, mask, scale=scale), 2)


