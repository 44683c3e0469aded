"""The system under test as kernels: the fixed attention op on each of its paths, and the
original MaxText call it replaces (expected to be caught), on real cuDNN and on the emulator."""
from __future__ import annotations

import functools

from harness.kernels.kernel import Kernel
from harness.kernels.reference import ignores_segments_expectation
from harness.sut.attention_op import CUDNN_DTYPES, AttentionOp, cudnn_backend
from harness.sut.config import AttentionConfig

CUDNN = CUDNN_DTYPES
CUDNN_HEAD_DIMS = tuple(range(8, 257, 8))
CUDNN_MARKER = ("__cudnn$fmha",)


def _hardware() -> str:
    import jax
    return "gpu" if jax.devices()[0].platform == "gpu" else "cpu"


def op_kernel(query, key, value, segment_ids, *, causal, scale, max_segments, window=None,
              softcap=None, chunk=None, sinks=None, **config):
    """The op configured as a model configures it: its features in the config (the op
    refuses, at configuration, what its path cannot honour), the sinks at the call."""
    config.setdefault("hardware", _hardware())
    config.setdefault("packing", True)
    op = AttentionOp(AttentionConfig(max_segments_per_seq=max_segments,
                                     window=window, logits_soft_cap=softcap, chunk_size=chunk,
                                     sinks=sinks is not None, **config))
    return op(query, key, value, segment_ids, scale=scale, causal=causal, sinks=sinks)


def original_cudnn_flash_jax(query, key, value, segment_ids, *, causal, scale, backend="cudnn"):
    """MaxText's train-mode cudnn_flash_jax before the fix: causal mask only."""
    del segment_ids, causal
    sdpa, mask_type = cudnn_backend(backend)
    return sdpa(query, key, value, scale=scale, mask_type=mask_type.CAUSAL, qkv_layout="BTNH")


def even_seq(case, platform):
    return [] if case.seq_len % 2 == 0 else [f"odd seq_len {case.seq_len}: cuDNN with a bias "
                                             "needs an even one in training"]


def pre_hopper_head_dims(case, platform):
    cc = platform.compute_capability
    if platform.name == "gpu" and cc is not None and cc < 9.0 and case.head_dim > 128:
        return [f"head_dim {case.head_dim} > 128 below Hopper"]
    return []


def _op(**config):
    return functools.partial(op_kernel, **config)


# The op takes every feature in its config: each path honours it or refuses it by name.
OP_FEATURES = ("window", "softcap", "chunk", "sinks", "head_dim_v")


# The op follows MaxText's convention: padding only after the last segment.
KERNELS = [
    Kernel("sut:dot_product", _op(attention="dot_product"), takes_max_segments=True,
           materializes_scores=True, features=OP_FEATURES, forward_mode=True,
           description="the attention op, attention=dot_product"),
    Kernel("sut:cudnn_flash_jax", _op(attention="cudnn_flash_jax"), takes_max_segments=True, features=OP_FEATURES,
           dtypes=CUDNN, head_dims=CUDNN_HEAD_DIMS, devices=("gpu",), min_compute_capability=9.0,
           hlo_markers=CUDNN_MARKER,
           description="the fixed op: packed seqlens/offsets, PADDING_CAUSAL, real cuDNN (Hopper+)"),
    # Picks TE THD or cuDNN's packed layout per shape (config.AUTO_TE_*): either fused call.
    Kernel("sut:cudnn_flash_auto", _op(attention="cudnn_flash_auto"), takes_max_segments=True, features=OP_FEATURES,
           dtypes=CUDNN, head_dims=CUDNN_HEAD_DIMS, devices=("gpu",), min_compute_capability=9.0,
           hlo_markers=(CUDNN_MARKER[0] + "|te_fused_attn_forward_ffi",),
           deterministic_env={"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"},
           description="the op's auto mode: TE THD on long rows and short segments (when TE is "
                       "installed), packed cuDNN elsewhere"),
    Kernel("sut:cudnn_flash_jax:fallback", _op(attention="cudnn_flash_jax", force_fallback=True),
           takes_max_segments=True, features=OP_FEATURES, dtypes=CUDNN, head_dims=CUDNN_HEAD_DIMS, devices=("gpu",),
           min_compute_capability=8.0, hlo_markers=CUDNN_MARKER, materializes_scores=True,
           constraints=lambda c, p: even_seq(c, p) + pre_hopper_head_dims(c, p),
           description="the fixed op's pre-Hopper fallback (same-segment mask as cuDNN bias), "
                       "forced"),
    # A CPU stand-in for the packed path: on GPUs the real cuDNN runs (sut:cudnn_flash_jax).
    Kernel("sut:cudnn_flash_jax:emulated", _op(attention="cudnn_flash_jax",
                                               cudnn_backend="emulator"),
           takes_max_segments=True, features=OP_FEATURES, dtypes=CUDNN, head_dims=CUDNN_HEAD_DIMS, devices=("cpu",),
           materializes_scores=True,
           description="the fixed op's packed lowering through the cuDNN API emulator"),
    # packing=False: one sequence per row, then padding (per-row lengths, no offsets).
    Kernel("sut:cudnn_flash_jax:rows", _op(attention="cudnn_flash_jax", packing=False),
           takes_max_segments=True, packed=False, features=OP_FEATURES, dtypes=CUDNN,
           head_dims=CUDNN_HEAD_DIMS, devices=("gpu",), min_compute_capability=9.0,
           hlo_markers=CUDNN_MARKER,
           description="the fixed op with packing=False: one sequence per row, per-row lengths "
                       "(real cuDNN)"),
    Kernel("sut:cudnn_flash_jax:rows:emulated",
           _op(attention="cudnn_flash_jax", packing=False, cudnn_backend="emulator"),
           takes_max_segments=True, packed=False, features=OP_FEATURES, dtypes=CUDNN,
           head_dims=CUDNN_HEAD_DIMS, devices=("cpu",), materializes_scores=True,
           description="the fixed op with packing=False through the cuDNN API emulator"),
    Kernel("sut:cudnn_flash_jax:emulated-sm80",
           _op(attention="cudnn_flash_jax", cudnn_backend="emulator", compute_capability=8.0),
           takes_max_segments=True, features=OP_FEATURES, dtypes=CUDNN, head_dims=tuple(range(8, 129, 8)),
           constraints=even_seq, devices=("cpu",),  # a CPU stand-in: on GPUs the real fallback
           materializes_scores=True,
           description="the fixed op as on an sm80 GPU (mask fallback), through the emulator"),
    Kernel("maxtext_original:cudnn_flash_jax", original_cudnn_flash_jax, dtypes=CUDNN,
           head_dims=CUDNN_HEAD_DIMS, devices=("gpu",), min_compute_capability=8.0,
           causal_only=True, hlo_markers=CUDNN_MARKER, expect=ignores_segments_expectation,
           tags=("canary",),
           description="MaxText's cudnn_flash_jax before the fix (causal only, real cuDNN): caught"),
    Kernel("maxtext_original:cudnn_flash_jax:emulated",
           functools.partial(original_cudnn_flash_jax, backend="emulator"), dtypes=CUDNN,
           causal_only=True, expect=ignores_segments_expectation, tags=("canary",),
           devices=("cpu",),  # a CPU stand-in: on GPUs the real original call runs
           materializes_scores=True,
           description="MaxText's cudnn_flash_jax before the fix, through the emulator: caught"),
]
