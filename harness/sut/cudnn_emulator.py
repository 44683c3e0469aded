"""A CPU emulator of jax's cuDNN attention API, `jax._src.cudnn.fused_attention_stablehlo
.dot_product_attention`, written from its documented semantics in plain JAX.

It lets the attention op's cuDNN lowering (seqlens, offsets, mask types) run end to end where
there is no GPU, so CPU CI catches a wrong lowering, and the original causal-only call, the
same way the GPU run does. On the GPU it is itself a kernel under test against real cuDNN.

Semantics (BTNH layout only; no dropout, no fp8):
- scores = scale * q.k, plus `bias` (broadcast to [B, N, T, S]); a boolean `mask` keeps
  True positions, as jax turns it into a large negative bias elsewhere.
- CAUSAL: key j is visible to query i iff j <= i. PADDING: only the first q_seqlen[b] queries
  and kv_seqlen[b] keys of row b take part. PADDING_CAUSAL: both.
- Packed (q_offsets/kv_offsets given, [B, M+1]; seqlens [B, M]; unused entries -1): segment m
  of row b is tokens offsets[b, m] .. offsets[b, m] + seqlen[b, m] - 1; a query sees only keys
  of its own segment, and with a causal mask type those at or before its position within the
  segment. Only allowed with a PADDING mask type, as cuDNN requires.
- sliding_window_length W: key j is visible to query i only where j > i - W (positions within
  the segment when packed): a left bound only, as cuDNN's; with a causal mask type the right
  bound is i, without one there is none (the whole rest of the segment).
- Queries outside every segment (padding) are undefined in cuDNN; the emulator returns zeros.
"""
from __future__ import annotations

import enum

import jax
import jax.numpy as jnp


class MaskType(enum.Enum):
    NO_MASK = 0
    PADDING = 1
    CAUSAL = 2
    PADDING_CAUSAL = 3


def _has(mask_type, *names) -> bool:
    # Accept jax's own MaskType as well: the op passes whichever backend's enum it was given.
    return mask_type.name in names


def _token_segments(seqlen, offsets, t):
    """(segment index [B, T] or -1, position within segment [B, T])."""
    m = seqlen.shape[1]
    starts = offsets[:, :m]
    idx = jnp.arange(t)[None, None, :]
    inside = ((starts[:, :, None] >= 0) & (seqlen[:, :, None] > 0)
              & (idx >= starts[:, :, None]) & (idx < starts[:, :, None] + seqlen[:, :, None]))
    any_seg = inside.any(axis=1)
    seg = jnp.where(any_seg, jnp.argmax(inside, axis=1), -1)
    start = jnp.take_along_axis(starts, jnp.maximum(seg, 0), axis=1)
    return seg, jnp.arange(t)[None] - start


def dot_product_attention(query, key, value, bias=None, mask=None, q_seqlen=None, kv_seqlen=None,
                          q_offsets=None, kv_offsets=None, fp8_params=None, *, scale=1.0,
                          mask_type=MaskType.NO_MASK, seed=42, dropout_rate=0.0,
                          qkv_layout="BTNH", sliding_window_length=None, use_fp8=False,
                          return_residual=False, compute_capability=None):
    """Emulates the cuDNN SDPA call. `compute_capability` (extra): below 9.0, refuse the packed
    layout exactly as jax does on such a GPU."""
    del seed
    if qkv_layout not in ("BTNH", "BSNH"):
        raise NotImplementedError(f"emulator supports the BTNH layout only, not {qkv_layout}")
    if dropout_rate or use_fp8 or fp8_params is not None or return_residual:
        raise NotImplementedError("emulator has no dropout, fp8 or residuals")
    if sliding_window_length is not None and sliding_window_length <= 0:
        raise ValueError("Require sliding_window_length > 0")
    packed = q_offsets is not None
    if packed and compute_capability is not None and compute_capability < 9.0:
        raise NotImplementedError("Packed layout requires a GPU with at least Hopper architecture.")
    padding = _has(mask_type, "PADDING", "PADDING_CAUSAL")
    causal = _has(mask_type, "CAUSAL", "PADDING_CAUSAL")
    if padding and (q_seqlen is None or kv_seqlen is None):
        raise ValueError("Require q_seqlen and kv_seqlen to generate padding mask")
    if packed and (kv_offsets is None or not padding):
        raise ValueError("packed layout needs q/kv offsets, q/kv seqlens and a PADDING mask type")

    b, t, heads, _ = query.shape
    s = key.shape[1]
    if heads % key.shape[2]:
        raise ValueError(f"{heads} query heads do not group over {key.shape[2]} kv heads")
    group = heads // key.shape[2]
    k = jnp.repeat(key, group, axis=2).astype(jnp.float32)
    v = jnp.repeat(value, group, axis=2).astype(jnp.float32)
    logits = jnp.einsum("bqhd,bkhd->bhqk", query.astype(jnp.float32), k) * scale
    if bias is not None:
        logits = logits + bias.astype(jnp.float32)

    allowed = jnp.ones((b, 1, t, s), bool)
    q_pos = jnp.broadcast_to(jnp.arange(t)[None], (b, t))
    k_pos = jnp.broadcast_to(jnp.arange(s)[None], (b, s))
    q_valid = jnp.ones((b, t), bool)
    if packed:
        q_seg, q_pos = _token_segments(q_seqlen, q_offsets, t)
        k_seg, k_pos = _token_segments(kv_seqlen, kv_offsets, s)
        q_valid = q_seg >= 0
        allowed &= ((q_seg[:, :, None] == k_seg[:, None, :]) & (q_seg[:, :, None] >= 0))[:, None]
    elif padding:
        q_valid = jnp.arange(t)[None] < q_seqlen.reshape(b, 1)
        k_valid = jnp.arange(s)[None] < kv_seqlen.reshape(b, 1)
        allowed &= (q_valid[:, :, None] & k_valid[:, None, :])[:, None]
    if causal:
        allowed &= (k_pos[:, None, :] <= q_pos[:, :, None])[:, None]
    if sliding_window_length is not None:
        allowed &= (k_pos[:, None, :] > q_pos[:, :, None] - sliding_window_length)[:, None]
    if mask is not None:
        allowed &= jnp.asarray(mask, bool).reshape((1,) * (4 - mask.ndim) + mask.shape)
    logits = jnp.where(allowed, logits, -1e30)
    probs = jax.nn.softmax(logits, axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
    out = jnp.where(q_valid[:, :, None, None], out, 0.0)
    return out.astype(query.dtype)
