"""jax's cuDNN attention as kernels: `jax_nn:cudnn` (the public
`jax.nn.dot_product_attention(implementation="cudnn")`) and `jax_nn:cudnn_packed` (the packed
call of `jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`, which jax.nn does not
expose), with `jax_nn:cudnn_packed:emulated`, the same call through the CPU emulator of that API
(harness.sut.cudnn_emulator), so that CPU CI exercises its arithmetic. (jax.nn's
`implementation="xla"` with the same mask is the built-in kernel `xla`, harness.kernels.reference.)

jax_nn:cudnn. The public API describes each row with one query length and one key length
(`query_seq_lengths`/`key_value_seq_lengths`, shape [B]): enough for a row with one segment and
tail padding, not for packed rows. So packing reaches it through `mask=` only: the dense
same-segment mask (harness.sut.dot_product.segment_mask, causality left to `is_causal`), which
jax turns into a cuDNN bias, as tokamax:cudnn does. Padding attends padding only: no query row
is fully masked and no valid query sees padding, wherever it sits.
Features, as a user hands them over (jax 0.10.2-0.12, jax/_src/nn/functions.py):
- window: `local_window_size=(left, right)`, documented as keys [i - left, i + right] of the
  row (the docstring: (3, 2) on token 6 reads 3..8). On the absolute row index: ANDed with the
  same-segment mask, that is the per-segment window (it depends on i - j only). On cuDNN jax
  sends `sliding_window_length=left + 1` (a left bound only) where right == 0 or the mask is
  CAUSAL (a right bound is then dropped: causal cases have right 0 anyway), and raises
  `ValueError("cuDNN doesn't support right window: ...")` at trace for a right bound without
  the causal mask: a refusal naming the window. A non-causal (left, 0) window is NOT refused:
  cuDNN gets a left bound and no causal mask, i.e. keys [i - left, end of row], not
  [i - left, i] (research, measured on the H200): passed as is, for the harness to see.
- head_dim_v: jax checks `value` against the key's shape ("value shape should be ...",
  ValueError at trace): a refusal naming the value.
No soft cap, chunk or sink argument.

jax_nn:cudnn_packed. cuDNN's packed (THD-like) layout: `q_seqlen`/`kv_seqlen` [B, M] and
`q_offsets`/`kv_offsets` [B, M+1] (-1 where unused), built by harness.sut.lowering.packed with
the trailing padding as the op lowers it (merged into the last segment under the causal mask,
a segment of its own otherwise: harness.sut.attention_op._padding), `mask_type`
PADDING_CAUSAL / PADDING. Each segment is its own cuDNN sequence, so masks are per segment.
Features:
- window: `sliding_window_length=left + 1`, documented as "(pos - sliding_window_length, pos]":
  W keys, self included, a left bound only. Under PADDING_CAUSAL that is the window
  [i - left, i]. A bidirectional window reading nothing ahead (right 0) is handed over as is
  and judged; one reading ahead has no argument to go to and is skipped with that reason
  (`_left_bound_only`): handing over its left bound alone would be a silent drop of the
  harness's own (it was, on the H200 census: reports/census-features-h200/README.md). The
  emulator leaves the right bound open under PADDING.
- head_dim_v: the value passed with its own head dim. jax checks only that Q and K share one;
  with packed offsets it multiplies every offset by the QUERY's head dim and reuses the K and Q
  offsets for V and O (research: silently wrong on the H200, max err 2.92 at d 64, d_v 32).
  jax_nn:cudnn_packed does not run those cases (VALUE_HEAD_DIM_CRASH: on the H200 the call
  ended in an illegal instruction one night and returned NaN the next).
No soft cap, chunk or sink argument. GPU only (sm90+: jax raises "Packed layout requires a GPU
with at least Hopper architecture" below), padding only after the last segment (the layout).
jax <= 0.11.0 scales packed kv offsets by the number of query heads (fixed in 0.11.2, jax PR
#39521; harness.sut.lowering.upstream_gqa_offsets_wrong asks the code itself): on such a jax
GQA cases are skipped with that reason, as a user of that jax would have to avoid them.

What the cuDNN paths cannot take, as jax checks it when tracing (jax._src.cudnn.
fused_attention_stablehlo, jax 0.10-0.12): float32 (bf16/f16 only); a head dim that is not a
multiple of 8, or above 128 below Hopper (256 on Hopper); with a bias in training, an odd query
or key length; GPUs before compute capability 8.0. Declared below as capabilities and
constraints. The mask costs B x T x T bytes, its bias B x T x T elements of the input dtype.
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
from harness.sut.dot_product import segment_mask

# The features each path's API takes (harness.model.features).
JAX_NN_FEATURES = ("window", "head_dim_v")
PACKED_FEATURES = ("window", "head_dim_v")


def jax_nn_cudnn(query, key, value, segment_ids, *, causal, scale, window=None):
    """jax.nn.dot_product_attention(..., mask=<same segment>, is_causal, scale,
    implementation="cudnn"[, local_window_size=(left, right)]); the mask is built from the
    traced ids (a constant mask would be constant-folded by XLA at every compile)."""
    import jax

    extra = {} if window is None else {"local_window_size": (int(window[0]), int(window[1]))}
    return jax.nn.dot_product_attention(
        query, key, value, mask=segment_mask(segment_ids, causal=False), is_causal=causal,
        scale=scale, implementation="cudnn", **extra)


def sliding_window_length(window) -> int:
    """cuDNN's W for a window (left, right): left + 1 keys, self included (its left bound; it
    has no right bound to take `right`)."""
    return int(window[0]) + 1


def jax_cudnn_packed(query, key, value, segment_ids, *, causal, scale, max_segments,
                     window=None, backend="cudnn"):
    """fused_attention_stablehlo.dot_product_attention(q, k, v, q_seqlen=, kv_seqlen=,
    q_offsets=, kv_offsets=, mask_type=PADDING_CAUSAL|PADDING, qkv_layout="BTNH"
    [, sliding_window_length=left + 1]); `backend` "emulator": the same call through
    harness.sut.cudnn_emulator."""
    from harness.sut.attention_op import _padding, cudnn_backend
    from harness.sut.lowering import packed

    sdpa, mask_type = cudnn_backend(backend)
    seqlen, offsets, _ = packed(segment_ids, max_segments, padding=_padding(causal))
    extra = {} if window is None else {"sliding_window_length": sliding_window_length(window)}
    return sdpa(query, key, value, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets,
                kv_offsets=offsets, scale=scale,
                mask_type=mask_type.PADDING_CAUSAL if causal else mask_type.PADDING,
                qkv_layout="BTNH", **extra)


def _cudnn_limits(case, platform):
    return even_seq(case, platform) + pre_hopper_head_dims(case, platform)


def _gqa_offsets(case, platform):
    """jax <= 0.11.0 lays packed kv out by the query head count (harness.sut.lowering)."""
    if platform.name != "gpu" or not case.gqa:
        return []
    from harness.sut.lowering import upstream_gqa_offsets_wrong
    if upstream_gqa_offsets_wrong():
        return [("this jax scales packed kv offsets by the query head count (jax <= 0.11.0, "
                 "fixed by jax PR #39521): GQA reads the wrong kv memory")]
    return []


def _left_bound_only(case, platform):
    """jax's sliding_window_length is a left bound: (pos - W, pos]. A window of a bidirectional
    case reading ahead has no argument to go to: not asked (handing over its left bound alone
    would be the adapter's own silent drop)."""
    window = case.features.window
    if window is not None and not case.causal and window[1] > 0:
        return [f"jax's packed cuDNN call takes a left-bound window only (sliding_window_length: "
                f"(pos - W, pos]): window {window[0]} back, {window[1]} ahead is not expressible"]
    return []


# On the H200 (jax 0.11.2, cuDNN 9.19) a value head dim of its own (64 against 128) is a known
# upstream bug of jax's packed cuDNN call: jax lays the value and output out by the query's
# head dim. It ends in CUDA_ERROR_ILLEGAL_INSTRUCTION on some nights and returns NaN on others
# (reports/census-features-h200/; the H200 nightly at 3d22ac7 saw both), and the illegal
# instruction is sticky: the process's device context is gone, and the pairs after it in that
# worker failed. A verdict that flips night to night, and a crash that costs a worker, are no
# use to anyone: not run, with the reason; the reproducer stays in that folder.
VALUE_HEAD_DIM_CRASH = (
    "not run: jax's packed cuDNN call with a value head dim of its own is a known upstream bug "
    "(CUDA_ERROR_ILLEGAL_INSTRUCTION, which ends the process's device context, or NaN, night "
    "by night on the H200; reproducer: reports/census-features-h200/repro/"
    "jax_nn_cudnn_packed-error.py)")


def _value_head_dim_crash(case, platform):
    return [VALUE_HEAD_DIM_CRASH] if case.features.head_dim_v else []


def _packed_limits(case, platform):
    return (_left_bound_only(case, platform) + _gqa_offsets(case, platform)
            + _value_head_dim_crash(case, platform))


_PACKED = dict(takes_max_segments=True, dtypes=CUDNN, head_dims=CUDNN_HEAD_DIMS,
               features=PACKED_FEATURES)

KERNELS = [
    Kernel("jax_nn:cudnn", jax_nn_cudnn, dtypes=CUDNN, head_dims=CUDNN_HEAD_DIMS,
           devices=("gpu",), min_compute_capability=8.0, padding_anywhere=True,
           constraints=_cudnn_limits, hlo_markers=CUDNN_MARKER, features=JAX_NN_FEATURES,
           description="jax.nn.dot_product_attention(implementation='cudnn'), same-segment "
                       "mask as a cuDNN bias, local_window_size=(left, right)"),
    # A value head dim of its own: not run (VALUE_HEAD_DIM_CRASH).
    Kernel("jax_nn:cudnn_packed", jax_cudnn_packed, devices=("gpu",),
           min_compute_capability=9.0, constraints=_packed_limits, hlo_markers=CUDNN_MARKER,
           **_PACKED,
           description="jax's packed cuDNN call (fused_attention_stablehlo.dot_product_"
                       "attention, seqlens/offsets, PADDING(_CAUSAL)), sliding_window_length="
                       "left + 1"),
    # A CPU stand-in: on GPUs the real cuDNN runs (jax_nn:cudnn_packed).
    Kernel("jax_nn:cudnn_packed:emulated", functools.partial(jax_cudnn_packed,
                                                             backend="emulator"),
           devices=("cpu",), materializes_scores=True, constraints=_left_bound_only,
           **_PACKED,
           description="jax's packed cuDNN call through the cuDNN API emulator (left-bound "
                       "sliding window, as cuDNN's)"),
]
