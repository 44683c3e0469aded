"""tokamax's `dot_product_attention` as kernels: `tokamax:<implementation>` (extra `tokamax`;
tokamax 0.0.12 installs on Python >= 3.12 only, and is imported inside the kernel).

How packing reaches tokamax: its public function has no segment ids. It takes `mask=` (a bool
array broadcastable to [B, N, T, S]), `is_causal` and one length per row
(`query_seq_lengths`/`key_value_seq_lengths`), and folds them into its own `Mask`. That `Mask`
class could also say "each query sees keys [k_start, k_end)" (its docstring's example for two
independent causal sequences), but it lives in `tokamax._src` and the public function wraps
whatever `mask=` it is given as a bool array, so a user of the public API packs rows with a
dense same-segment mask, as these kernels do (harness.sut.dot_product.segment_mask with
causal=False, causality left to `is_causal`; padding attends padding only, so no query row is
fully masked and no valid query sees padding, wherever it sits).

Features, as its API takes them (tokamax 0.0.12 `dot_product_attention`; 0.0.17 the same):
- window: `local_window_size=(before, after)`: "k_start = k - before, k_end = k + after + 1"
  per query row, i.e. keys [i - before, i + after] on the absolute row index. ANDed with the
  same-segment mask that is the per-segment window (it depends on i - j only), so the case's
  (left, right) is passed as is (right 0 under the causal mask).
- softcap: `logits_soft_cap=cap`: "logits = logits_soft_cap * tanh(logits /
  logits_soft_cap), where logits are scale * query @ key.T + bias", the harness's convention.
  xla and xla_chunked cap forward and backward; cudnn raises
  `NotImplementedError("`logits_soft_cap` not supported.")` when traced (a refusal naming
  it); triton caps its forward and raises `NotImplementedError("`logits_soft_cap`
  unsupported.")` when its backward is traced (a refusal too); mosaic caps both.
- head_dim_v: the value may have its own head dim ("Support for different output head
  dimension (h)": value [..., S, K, h] -> output [..., T, N, h]); cudnn pads q, k and v to the
  larger one and slices the output.
No sink or chunk argument (a chunk would need a mask of its own), so neither is declared.

The implementations (tokamax 0.0.12, read from its source):
- `xla`: einsum attention, float32 logits; builds the [B, N, T, S] scores (dense).
- `xla_chunked`: the same in chunks of (512 queries, 1024 keys): no T x S scores, but the
  dense mask is still [B, 1, T, S] bool.
- `cudnn`: jax.nn.dot_product_attention(implementation="cudnn") with the mask, which jax turns
  into a cuDNN bias; GPU only (tokamax refuses other devices: "Not supported on cpu").
- `triton`: Pallas Triton flash attention. Its kernel calls `pl.dot`, which jax deprecated in
  0.11.0 and removed in 0.12.0: on jax 0.11.2 (the H200) and 0.12 it raises
  "AttributeError: pl.dot was deprecated in JAX v0.11.0, and removed in JAX v0.12.0" when
  traced (seen on the H200 with 0.11.2; on 0.12 the same text, raised when its kernel is traced
  for CUDA on a CPU: cases/test_census_adapters.py): a known upstream incompatibility,
  declared with expect_error.
- `mosaic`: Pallas Mosaic GPU flash attention (tokamax maps "mosaic" to "mosaic_gpu" on NVIDIA
  devices; sm90 and sm100 only). It passes `out_shape=` to `plgpu.kernel`, which newer jax
  forwards to `Mesh`: "Mesh.__init__() got an unexpected keyword argument 'out_shape'" on jax
  0.11.2 (seen on the H200) and 0.12 (traced for CUDA on a CPU, tokamax's sm90 checks answered
  yes: cases/test_census_adapters.py): known upstream, declared with expect_error.
"""
from __future__ import annotations

import functools

from harness.kernels.kernel import Kernel
from harness.kernels.op import (
    CUDNN,
    CUDNN_HEAD_DIMS,
    CUDNN_MARKER,
    even_seq,
    pre_hopper_head_dims,
)
from harness.kernels.reference import no_f16_on_cpu
from harness.sut.dot_product import segment_mask

TRITON_ERROR = "pl.dot was deprecated in JAX v0.11.0, and removed in JAX v0.12.0"
MOSAIC_ERROR = "unexpected keyword argument 'out_shape'"
TRITON_MARKER = ("__gpu$xla.gpu.triton",)   # jax's Pallas Triton custom call
MOSAIC_MARKER = ("mosaic_gpu",)             # jax's Mosaic GPU custom call ("mosaic_gpu_v2")


# The features tokamax's public API takes (harness.model.features).
TOKAMAX_FEATURES = ("window", "softcap", "head_dim_v")


def tokamax_attention(query, key, value, segment_ids, *, causal, scale, implementation,
                      window=None, softcap=None):
    """tokamax.dot_product_attention(..., mask=<same segment>, is_causal, scale,
    implementation=implementation[, local_window_size=(left, right)][, logits_soft_cap=cap]):
    the public API, as a user packing rows calls it."""
    import tokamax

    extra = {}
    if window is not None:
        extra["local_window_size"] = (int(window[0]), int(window[1]))
    if softcap is not None:
        extra["logits_soft_cap"] = float(softcap)
    # The mask is built from the traced ids: a mask closed over as a constant makes XLA
    # constant-fold a T x T array at every compile.
    return tokamax.dot_product_attention(
        query, key, value, mask=segment_mask(segment_ids, causal=False), is_causal=causal,
        scale=scale, implementation=implementation, **extra)


def _impl(implementation: str):
    return functools.partial(tokamax_attention, implementation=implementation)


_COMMON = dict(requires=("tokamax",), padding_anywhere=True, features=TOKAMAX_FEATURES)

KERNELS = [
    # float32 included: on CPUs tokamax computes float32 dots exactly; on GPUs its default
    # precision for float32 is TF32 (tokamax._src.precision), which the run judges as it is.
    # float16 asks XLA:CPU for F16_F16_F32 dots, which it rejects (as jax.nn's xla does).
    Kernel("tokamax:xla", _impl("xla"), materializes_scores=True, constraints=no_f16_on_cpu,
           **_COMMON,
           description="tokamax.dot_product_attention, implementation='xla', same-segment "
                       "mask"),
    Kernel("tokamax:xla_chunked", _impl("xla_chunked"), constraints=no_f16_on_cpu, **_COMMON,
           description="tokamax.dot_product_attention, implementation='xla_chunked' "
                       "(512 x 1024 chunks), same-segment mask"),
    # jax.nn's cuDNN path with a bias: the limits jax checks (head_dim <= 128 below Hopper,
    # a multiple of 8; even T and S in training), as for the op's own mask fallback.
    Kernel("tokamax:cudnn", _impl("cudnn"), dtypes=CUDNN, head_dims=CUDNN_HEAD_DIMS,
           devices=("gpu",), min_compute_capability=8.0, hlo_markers=CUDNN_MARKER,
           constraints=lambda c, p: even_seq(c, p) + pre_hopper_head_dims(c, p), **_COMMON,
           description="tokamax.dot_product_attention, implementation='cudnn' (jax.nn's cuDNN "
                       "with the mask as a bias)"),
    # Capabilities below are conservative (bf16/f16, head dims multiple of 8 up to 256): not
    # confirmed against a running kernel, since neither runs on jax >= 0.11.
    Kernel("tokamax:triton", _impl("triton"), dtypes=CUDNN, head_dims=CUDNN_HEAD_DIMS,
           devices=("gpu",), min_compute_capability=8.0, hlo_markers=TRITON_MARKER,
           expect_error=TRITON_ERROR, **_COMMON,
           description="tokamax.dot_product_attention, implementation='triton': a known "
                       "upstream error on jax >= 0.11 (pl.dot removed)"),
    Kernel("tokamax:mosaic", _impl("mosaic"), dtypes=CUDNN, head_dims=CUDNN_HEAD_DIMS,
           devices=("gpu",), min_compute_capability=9.0, hlo_markers=MOSAIC_MARKER,
           expect_error=MOSAIC_ERROR, **_COMMON,
           description="tokamax.dot_product_attention, implementation='mosaic' (Mosaic GPU): "
                       "a known upstream error on jax >= 0.11 (Mesh(out_shape=))"),
]
