"""Transformer Engine kernels (imported lazily: only the GPU runner has TE)."""
from __future__ import annotations

import os

from harness.kernels.kernel import Kernel
from harness.kernels.op import CUDNN, CUDNN_HEAD_DIMS, op_kernel
from harness.sut.attention_op import te_fused_thd

TE_MARKERS = ("te_fused_attn_forward_ffi", "te_fused_attn_backward_ffi")
UNFUSED_CRASH = "sequence_descriptor must be None or ndarray"


def te_thd(query, key, value, segment_ids, *, causal, scale, max_segments):
    return op_kernel(query, key, value, segment_ids, causal=causal, scale=scale,
                     max_segments=max_segments, attention="cudnn_flash_te")


def te_thd_raw(query, key, value, segment_ids, *, causal, scale, max_segments):
    return te_fused_thd(query, key, value, segment_ids, scale=scale, causal=causal,
                        max_segments=max_segments)


def te_unfused_with_descriptor(query, key, value, segment_ids, *, causal, scale, max_segments):
    """TE's flax DotProductAttention on its unfused path (NVTE_FUSED_ATTN=0) with a
    SequenceDescriptor, as MaxText's cudnn_flash_te reaches it where cuDNN declines the fused
    kernel. Upstream it asserts instead of computing (seed report, observation 2)."""
    from transformer_engine.jax import attention as te
    from transformer_engine.jax.flax import DotProductAttention

    from harness.sut.lowering import positions

    pos = positions(segment_ids)
    descriptor = te.SequenceDescriptor.from_segment_ids_and_pos(
        (segment_ids, segment_ids), (pos, pos))
    module = DotProductAttention(
        head_dim=query.shape[-1], num_attention_heads=query.shape[2],
        num_gqa_groups=key.shape[2], attn_mask_type="padding_causal" if causal else "padding",
        qkv_layout="thd_thd_thd", max_segments_per_seq=max_segments, scale_factor=scale,
        transpose_batch_sequence=False)
    previous = os.environ.get("NVTE_FUSED_ATTN")
    os.environ["NVTE_FUSED_ATTN"] = "0"   # read by TE while tracing
    try:
        return module.apply({}, query, key, value, sequence_descriptor=descriptor,
                            deterministic=True)
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
           **_TE, description="the op's cudnn_flash_te: TE THD fused attention with a "
                              "SequenceDescriptor"),
    # TE's THD kernels write zeros at padding (measured on the H200): the stricter convention.
    Kernel("te:thd", te_thd_raw, min_compute_capability=9.0, hlo_markers=TE_MARKERS,
           padding_anywhere=True, padding_output="zero", **_TE,
           description="TE THD fused attention, called directly: padding anywhere "
                       "(pad_between_seqs)"),
    Kernel("te:unfused_fallback", te_unfused_with_descriptor, expect_error=UNFUSED_CRASH, **_TE,
           description="TE's unfused fallback with a SequenceDescriptor: a known upstream crash"),
]
