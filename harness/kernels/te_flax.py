"""Transformer Engine's flax `DotProductAttention` module (transformer_engine.jax.flax) on the
THD layout, as a flax user packing rows calls it (extra `te`; imported inside the kernels, GPU
runner only): `te:flax_segment_ids` describes the rows with a `SequenceDescriptor` from segment
ids and positions, `te:flax_seqlens_offsets` with one from lengths and offsets.

The module's arguments (TE 2.20, transformer_engine/jax/flax/transformer.py): head_dim,
num_attention_heads, num_gqa_groups (kv heads), attention_dropout (0), attn_mask_type
("padding_causal" / "padding": THD takes only these), qkv_layout "thd_thd_thd",
scale_factor, transpose_batch_sequence=False ([batch, seq, heads, dim]), max_segments_per_seq,
and the features' window_size and softmax_type (below); `deterministic` defaults to False,
which TE also reads as training mode (is_training), as MaxText calls it. `dtype` is deprecated (the inputs' is used).
The fused cuDNN path is TE's default (NVTE_FUSED_ATTN unset means 1); where TE finds no fused
kernel it falls back to its unfused path, which asserts on a SequenceDescriptor (te.py's
te:unfused_fallback) and whose program would lack TE's fused markers anyway.

Features (harness.model.features), handed to the module as te.py describes for TE's THD call:
- window: the module's `window_size=(left, right)` ("query at position i attends to keys in
  [i - window_size[0], i + window_size[1]] inclusive", within each sequence); right 0 under the
  causal mask, which TE does not clamp (te.te_window_size).
- sinks: `softmax_type="learnable"`, which gives the module one parameter, `softmax_offset`
  (1, heads, 1, 1) float32 (in its fused submodule); `apply` gets it set to the case's sinks
  (te.learnable_sink_params), so jax.vjp differentiates the sinks through it (dsinks).
  Without sinks the module has no parameters: `apply({}, ...)`.
- head_dim_v: q, k and v are separate arrays (thd_thd_thd), the value with its own head dim.
  Where TE's backend rules decline a configuration (a head dim pair on sm90 training, say),
  the module does not raise: it warns and falls back to its unfused path, which asserts on
  the SequenceDescriptor (te:unfused_fallback's crash) while tracing, a message that names no
  feature: an error record, as a user would meet it.

Lengths and offsets: segment m of row b has length seqlens[b, m] and starts at offsets[b, m]
(cuDNN's packed form, -1 where unused, offsets [B, M+1]). `harness.sut.lowering` computes them
for rows padded only at the tail; padding before or between segments (TE's pad_between_seqs)
needs each segment's own start, computed here, so both kernels take padding anywhere.
"""
from __future__ import annotations

import jax.numpy as jnp

from harness.kernels.kernel import Kernel
from harness.kernels.op import CUDNN, CUDNN_HEAD_DIMS
from harness.kernels.te import (
    TE_BACKWARD_MARKERS,
    TE_DETERMINISTIC,
    TE_FEATURES,
    TE_MARKERS,
    UNFUSED_CRASH,
    learnable_sink_params,
    te_window_size,
)


def segment_starts_and_lengths(segment_ids, max_segments: int):
    """(seqlens [B, M], offsets [B, M+1]) int32: segment m+1's length and first position, -1
    where a row has no such segment; padding (id 0) may sit anywhere. Assumes each id forms one
    contiguous run (harness.model.layouts guarantees it)."""
    seg = segment_ids.astype(jnp.int32)
    ids = jnp.arange(1, max_segments + 1, dtype=jnp.int32)
    member = seg[:, :, None] == ids                                   # [B, T, M]
    lengths = member.sum(axis=1, dtype=jnp.int32)
    starts = jnp.argmax(member, axis=1).astype(jnp.int32)
    present = lengths > 0
    seqlens = jnp.where(present, lengths, -1)
    offsets = jnp.pad(jnp.where(present, starts, -1), ((0, 0), (0, 1)), constant_values=-1)
    return seqlens, offsets


def _module(query, key, *, causal, scale, max_segments, window=None, sinks=None):
    from transformer_engine.jax.flax import DotProductAttention

    extra = {}
    if window is not None:
        extra["window_size"] = te_window_size(window, causal)
    if sinks is not None:
        extra["softmax_type"] = "learnable"
    return DotProductAttention(
        head_dim=query.shape[-1], num_attention_heads=query.shape[2],
        num_gqa_groups=key.shape[2], attention_dropout=0.0,
        attn_mask_type="padding_causal" if causal else "padding", qkv_layout="thd_thd_thd",
        scale_factor=scale, transpose_batch_sequence=False, max_segments_per_seq=max_segments,
        **extra)


def _apply(module, query, key, value, descriptor, sinks):
    """module.apply, its softmax_offset parameter set to the sinks where there are sinks."""
    variables = ({} if sinks is None else
                 learnable_sink_params(module, sinks, query, key, value,
                                       sequence_descriptor=descriptor))
    return module.apply(variables, query, key, value, sequence_descriptor=descriptor)


def te_flax_segment_ids(query, key, value, segment_ids, *, causal, scale, max_segments,
                        window=None, sinks=None):
    """DotProductAttention with SequenceDescriptor.from_segment_ids_and_pos."""
    from transformer_engine.jax.attention import SequenceDescriptor

    from harness.sut.lowering import positions

    pos = positions(segment_ids)
    descriptor = SequenceDescriptor.from_segment_ids_and_pos((segment_ids, segment_ids),
                                                             (pos, pos))
    module = _module(query, key, causal=causal, scale=scale, max_segments=max_segments,
                     window=window, sinks=sinks)
    return _apply(module, query, key, value, descriptor, sinks)


def te_flax_seqlens_offsets(query, key, value, segment_ids, *, causal, scale, max_segments,
                            window=None, sinks=None):
    """DotProductAttention with SequenceDescriptor.from_seqlens_and_offsets."""
    from transformer_engine.jax.attention import SequenceDescriptor

    seqlens, offsets = segment_starts_and_lengths(segment_ids, max_segments)
    descriptor = SequenceDescriptor.from_seqlens_and_offsets((seqlens, seqlens),
                                                             (offsets, offsets))
    module = _module(query, key, causal=causal, scale=scale, max_segments=max_segments,
                     window=window, sinks=sinks)
    return _apply(module, query, key, value, descriptor, sinks)


# THD fused attention needs sm90 (TE; the H200 facts). Head dims and dtypes as te:thd.
_TE_FLAX = dict(takes_max_segments=True, dtypes=CUDNN, head_dims=CUDNN_HEAD_DIMS,
                devices=("gpu",), min_compute_capability=9.0, padding_anywhere=True,
                requires=("transformer_engine", "flax"), hlo_markers=TE_MARKERS,
                backward_markers=TE_BACKWARD_MARKERS,
                deterministic_env=TE_DETERMINISTIC, features=TE_FEATURES)

# On the H200 (TE 2.20.2, cuDNN 9.19) TE's fused backend refuses THD learnable softmax ("Known
# cuDNN < 9.26.0 issue with THD learnable softmax backward"); the flax module then falls back
# to its unfused path without saying so, which cannot take the THD SequenceDescriptor and
# raises. A known upstream crash on the cases with sinks (reports/census-features-h200/).
# Declared only where TE's own cuDNN runtime is below 9.26 (read from TE, as its refusal is):
# with a later cuDNN, or where the version cannot be read, the crash is an error.
SINKS_FALLBACK_CRASH = UNFUSED_CRASH   # the same unfused path's crash as te:unfused_fallback
SINKS_FUSED_FROM_CUDNN = (9, 26, 0)


def te_cudnn_version() -> tuple[int, int, int] | None:
    """The cuDNN runtime TE was loaded with (None: no TE, or TE cannot say)."""
    try:
        from transformer_engine.jax.cpp_extensions.misc import get_cudnn_version
        return tuple(int(part) for part in get_cudnn_version())
    except Exception:  # no TE, a stand-in, or no cuDNN library loadable: unknown
        return None


def sinks_fallback_crash(case):
    if not case.features.sinks:
        return None
    version = te_cudnn_version()
    return SINKS_FALLBACK_CRASH if version is not None and version < SINKS_FUSED_FROM_CUDNN \
        else None


KERNELS = [
    Kernel("te:flax_segment_ids", te_flax_segment_ids, **_TE_FLAX,
           expect_error=sinks_fallback_crash,
           description="TE flax DotProductAttention, THD, SequenceDescriptor from segment ids "
                       "and positions"),
    Kernel("te:flax_seqlens_offsets", te_flax_seqlens_offsets, **_TE_FLAX,
           expect_error=sinks_fallback_crash,
           description="TE flax DotProductAttention, THD, SequenceDescriptor from lengths and "
                       "offsets"),
]
