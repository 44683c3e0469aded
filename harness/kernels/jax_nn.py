"""`jax.nn.dot_product_attention(implementation="cudnn")` as a kernel: `jax_nn:cudnn`. (Its
`implementation="xla"` with the same mask is the built-in kernel `xla`, harness.kernels.reference.)

Its public API describes each row with one query length and one key length
(`query_seq_lengths`/`key_value_seq_lengths`, shape [B]): enough for a row with one segment and
tail padding, not for packed rows. The packed (THD) form of cuDNN's SDPA (`q_offsets`,
`kv_offsets`) exists only in `jax._src.cudnn` (the op's own path, sut:cudnn_flash_jax). So
packing reaches the public function through `mask=` only: the dense same-segment mask
(harness.sut.dot_product.segment_mask, causality left to `is_causal`), which jax turns into a
cuDNN bias, as tokamax:cudnn does. Padding attends padding only: no query row is fully masked
and no valid query sees padding, wherever it sits.

What this path cannot take, as jax checks it when tracing (jax._src.cudnn.
fused_attention_stablehlo, jax 0.10-0.12): float32 (bf16/f16 only); a head dim that is not a
multiple of 8, or above 128 below Hopper (256 on Hopper); with a bias in training, an odd query
or key length; GPUs before compute capability 8.0. Declared below as capabilities and
constraints. The mask costs B x T x T bytes, its bias B x T x T elements of the input dtype.
"""
from __future__ import annotations

from harness.kernels.kernel import Kernel
from harness.kernels.op import (
    CUDNN,
    CUDNN_HEAD_DIMS,
    CUDNN_MARKER,
    even_seq,
    pre_hopper_head_dims,
)
from harness.sut.dot_product import segment_mask


def jax_nn_cudnn(query, key, value, segment_ids, *, causal, scale):
    """jax.nn.dot_product_attention(..., mask=<same segment>, is_causal, scale,
    implementation="cudnn"); the mask is built from the traced ids (a constant mask would be
    constant-folded by XLA at every compile)."""
    import jax

    return jax.nn.dot_product_attention(
        query, key, value, mask=segment_mask(segment_ids, causal=False), is_causal=causal,
        scale=scale, implementation="cudnn")


def _cudnn_limits(case, platform):
    return even_seq(case, platform) + pre_hopper_head_dims(case, platform)


KERNELS = [
    Kernel("jax_nn:cudnn", jax_nn_cudnn, dtypes=CUDNN, head_dims=CUDNN_HEAD_DIMS,
           devices=("gpu",), min_compute_capability=8.0, padding_anywhere=True,
           constraints=_cudnn_limits, hlo_markers=CUDNN_MARKER,
           description="jax.nn.dot_product_attention(implementation='cudnn'), same-segment "
                       "mask as a cuDNN bias"),
]
