"""Transformer Engine kernels (imported lazily: only the GPU runner has TE).

- `sut:cudnn_flash_te`: the op (harness.sut.attention_op) on its cudnn_flash_te path, which
  configures TE's THD fused attention itself; it takes every feature in its config and refuses
  what its path cannot honour by name (harness.kernels.op.OP_FEATURES).
- `te:thd`: TE's `fused_attn` called directly, as a user packing rows calls it: layout
  THD_THD_THD with a SequenceDescriptor from segment ids and positions within segments, mask
  PADDING_CAUSAL / PADDING (THD takes only these), `is_training=True`.
- `te:unfused_fallback`: TE's flax DotProductAttention on its unfused path with a
  SequenceDescriptor, a known upstream crash.

Features, as TE 2.20 documents them and these kernels hand them over:
- window: `window_size=(left, right)`, "query at position i attends to keys in
  [i - window_size[0], i + window_size[1]] inclusive" within each sequence (make_swa_mask; -1
  unbounded). Right is 0 under the causal mask: TE does not clamp it, and its fused kernel sets
  cuDNN's right bound after the causal mask's (research, library_features.md §3.2), so a right
  bound would override causality. The harness's causal cases have right 0 anyway.
- sinks: `softmax_type` LEARNABLE_SOFTMAX with `softmax_offset`, float32 shaped
  [1, heads, 1, 1] (TE asserts that shape), from the case's sinks [heads]: exp(alpha_h) in each
  softmax's denominator; fused_attn returns its gradient, dsinks. For the flax module:
  `softmax_type="learnable"` and the module's parameter `softmax_offset` (its shape
  (1, heads, 1, 1)) set in the params tree to the case's sinks (`learnable_sink_params`), so
  that its gradient flows back to them.
- head_dim_v: THD_THD_THD takes q, k and v as separate arrays with their own head dims (the
  kv-packed layouts assert equal ones). Where TE's backend rules decline a pair (sm90 training,
  cuDNN >= 9.11: d_qk >= 128, d_v >= 128, d_qk != d_v, except 192/128) fused_attn's abstract
  eval raises `ValueError("Unsupported backend: <TE's reason>")` while tracing: a refusal
  where the reason names the head dims, an error where it does not (only the GPU tells).
No soft cap or chunk argument (TE's experimental score_mod excludes THD, padding and windows).
"""
from __future__ import annotations

import os

import jax.numpy as jnp

from harness.kernels.kernel import Kernel
from harness.kernels.op import CUDNN, CUDNN_HEAD_DIMS, OP_FEATURES, op_kernel

TE_BACKWARD_MARKERS = ("te_fused_attn_backward_ffi",)   # only its backward pass holds it
TE_MARKERS = ("te_fused_attn_forward_ffi", *TE_BACKWARD_MARKERS)
UNFUSED_CRASH = "sequence_descriptor must be None or ndarray"
# The features TE's THD call takes (harness.model.features).
TE_FEATURES = ("window", "sinks", "head_dim_v")


def te_window_size(window, causal: bool) -> tuple[int, int]:
    """TE's window_size for a window (left, right): keys i - left .. i + right of each
    sequence; right 0 under the causal mask (a right bound would override it in TE)."""
    return int(window[0]), 0 if causal else int(window[1])


def te_softmax_offset(sinks):
    """TE's softmax_offset for sinks [heads]: float32 [1, heads, 1, 1]."""
    return sinks.astype(jnp.float32).reshape(1, -1, 1, 1)


def te_thd(query, key, value, segment_ids, *, causal, scale, max_segments, **features):
    """The op's cudnn_flash_te path, its features in the op's config (op_kernel)."""
    return op_kernel(query, key, value, segment_ids, causal=causal, scale=scale,
                     max_segments=max_segments, attention="cudnn_flash_te", **features)


def te_thd_raw(query, key, value, segment_ids, *, causal, scale, max_segments, window=None,
               sinks=None):
    """transformer_engine.jax.attention.fused_attn((q, k, v), None, <descriptor from segment
    ids and positions>, None, NO_BIAS, PADDING_CAUSAL | PADDING, THD_THD_THD, VANILLA |
    LEARNABLE, scale, 0.0, True, max_segments_per_seq=, [window_size=, softmax_offset=])."""
    from transformer_engine.jax import attention as te

    from harness.sut.lowering import positions

    pos = positions(segment_ids)
    descriptor = te.SequenceDescriptor.from_segment_ids_and_pos(
        (segment_ids, segment_ids), (pos, pos))
    mask = te.AttnMaskType.PADDING_CAUSAL_MASK if causal else te.AttnMaskType.PADDING_MASK
    extra = {}
    if window is not None:
        extra["window_size"] = te_window_size(window, causal)
    softmax = te.AttnSoftmaxType.VANILLA_SOFTMAX
    if sinks is not None:
        softmax = te.AttnSoftmaxType.LEARNABLE_SOFTMAX
        extra["softmax_offset"] = te_softmax_offset(sinks)
    return te.fused_attn((query, key, value), None, descriptor, None, te.AttnBiasType.NO_BIAS,
                         mask, te.QKVLayout.THD_THD_THD, softmax, scale, 0.0, True,
                         max_segments_per_seq=max_segments, **extra)


def learnable_sink_params(module, sinks, *args, **kwargs) -> dict:
    """The variables for `module.apply(variables, *args, **kwargs)` of a TE flax module with
    softmax_type "learnable": the params tree the module creates (found by tracing its init,
    as a user reads it from `module.init`), each `softmax_offset` leaf set to the sinks
    [heads] in its shape (1, heads, 1, 1), float32, so that its gradient is dsinks."""
    import jax
    from flax import traverse_util

    shapes = jax.eval_shape(lambda *a: module.init(jax.random.PRNGKey(0), *a, **kwargs), *args)
    # Leaves are shapes, some boxed with their logical axes (nn.with_logical_partitioning).
    flat = traverse_util.flatten_dict(shapes.get("params", {}))
    offsets = [path for path in flat if path[-1] == "softmax_offset"]
    others = [path for path in flat if path[-1] != "softmax_offset"]
    if not offsets or others:
        raise ValueError(f"softmax_type='learnable': expected the module's params to be its "
                         f"softmax_offset alone, found {['/'.join(p) for p in flat] or 'none'}")
    params = {path: sinks.astype(jnp.float32).reshape(getattr(flat[path], "value",
                                                              flat[path]).shape)
              for path in offsets}
    return {"params": traverse_util.unflatten_dict(params)}


def te_unfused_with_descriptor(query, key, value, segment_ids, *, causal, scale, max_segments,
                               window=None, sinks=None):
    """TE's flax DotProductAttention on its unfused path (NVTE_FUSED_ATTN=0) with a
    SequenceDescriptor, as MaxText's cudnn_flash_te reaches it where cuDNN declines the fused
    kernel, the features as for te:flax_* (window_size, softmax_type "learnable" and its
    softmax_offset parameter). Upstream it asserts instead of computing (seed report,
    observation 2)."""
    from transformer_engine.jax import attention as te
    from transformer_engine.jax.flax import DotProductAttention

    from harness.sut.lowering import positions

    pos = positions(segment_ids)
    descriptor = te.SequenceDescriptor.from_segment_ids_and_pos(
        (segment_ids, segment_ids), (pos, pos))
    extra = {}
    if window is not None:
        extra["window_size"] = te_window_size(window, causal)
    if sinks is not None:
        extra["softmax_type"] = "learnable"
    module = DotProductAttention(
        head_dim=query.shape[-1], num_attention_heads=query.shape[2],
        num_gqa_groups=key.shape[2], attn_mask_type="padding_causal" if causal else "padding",
        qkv_layout="thd_thd_thd", max_segments_per_seq=max_segments, scale_factor=scale,
        transpose_batch_sequence=False, **extra)
    previous = os.environ.get("NVTE_FUSED_ATTN")
    os.environ["NVTE_FUSED_ATTN"] = "0"   # read by TE while tracing
    try:
        call = dict(sequence_descriptor=descriptor, deterministic=True)
        variables = ({} if sinks is None else
                     learnable_sink_params(module, sinks, query, key, value, **call))
        return module.apply(variables, query, key, value, **call)
    finally:
        if previous is None:
            os.environ.pop("NVTE_FUSED_ATTN")
        else:
            os.environ["NVTE_FUSED_ATTN"] = previous


# TE reads NVTE_ALLOW_NONDETERMINISTIC_ALGO while tracing to pick its backward algorithm.
TE_DETERMINISTIC = {"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
_TE = dict(takes_max_segments=True, dtypes=CUDNN, head_dims=CUDNN_HEAD_DIMS, devices=("gpu",),
           requires=("transformer_engine",), deterministic_env=TE_DETERMINISTIC)

KERNELS = [
    Kernel("sut:cudnn_flash_te", te_thd, min_compute_capability=9.0, hlo_markers=TE_MARKERS,
           backward_markers=TE_BACKWARD_MARKERS,
           features=OP_FEATURES, **_TE,
           description="the op's cudnn_flash_te: TE THD fused attention with a "
                       "SequenceDescriptor"),
    # TE's THD kernels write zeros at padding (measured on the H200): the stricter convention.
    Kernel("te:thd", te_thd_raw, min_compute_capability=9.0, hlo_markers=TE_MARKERS,
           backward_markers=TE_BACKWARD_MARKERS,
           padding_anywhere=True, padding_output="zero", features=TE_FEATURES, **_TE,
           description="TE THD fused attention, called directly: padding anywhere "
                       "(pad_between_seqs), window_size=(left, right), learnable "
                       "softmax_offset"),
    Kernel("te:unfused_fallback", te_unfused_with_descriptor, expect_error=UNFUSED_CRASH,
           features=TE_FEATURES, **_TE,
           description="TE's unfused fallback with a SequenceDescriptor: a known upstream crash"),
]
