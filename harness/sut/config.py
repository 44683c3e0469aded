"""The attention op's configuration and the rules that keep it from corrupting training silently."""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass

import numpy as np

KERNELS = ("dot_product", "cudnn_flash_jax", "cudnn_flash_te", "cudnn_flash_auto")
HARDWARE = ("gpu", "cpu", "tpu")
MODES = ("train", "decode")
CUDNN_BACKENDS = ("cudnn", "emulator")
SEGMENT_CHECKS = ("nan", "checkify")

# Compute capability from which cuDNN's packed (offsets) layout and TE's THD fused attention run.
PACKED_MIN_CC = 9.0
# Below this, jax's cuDNN fused attention does not run at all.
CUDNN_MIN_CC = 8.0
# cudnn_flash_auto: Transformer Engine's THD path where it beat cuDNN's packed layout on the
# H200 (bf16, 32/8 heads, head_dim 128, fwd+bwd; reports/h200/bench.txt): long rows (1 x 32768:
# 5.46 vs 6.12 ms) and many short segments (8 x 4096 of 64-256-token segments, M=28: 2.80 vs
# 4.40 ms); cuDNN's packed layout elsewhere (8 x 2048 with 4 segments: 1.34 vs 1.54 ms;
# 1 x 8192 with 8: 1.00 vs 1.05 ms). The rule reads what is static: the row length and
# max_segments_per_seq (the average room per segment).
AUTO_TE_MIN_SEQ_LEN = 16384
AUTO_TE_MAX_TOKENS_PER_SEGMENT = 256


def _flag(x) -> bool:
    return isinstance(x, (bool, np.bool_))


def _whole(x) -> bool:
    """A whole number: Python's, numpy's or a concrete 0-d integer array's (not a bool, not a
    float that happens to be whole)."""
    if _flag(x) or getattr(x, "dtype", np.dtype(int)).kind not in "iu":
        return False
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


def _real(x) -> bool:
    """A number that is not NaN: Python's, numpy's or a concrete 0-d array's (not a bool)."""
    if _flag(x) or isinstance(x, (str, bytes)) or np.ndim(x) != 0 \
            or np.asarray(x).dtype.kind not in "iuf":
        return False
    return not math.isnan(float(x))


class ConfigError(ValueError):
    """A configuration that would train on wrong attention, or crash later."""


@dataclass(frozen=True)
class AttentionConfig:
    attention: str = "dot_product"
    packing: bool = True
    hardware: str = "gpu"
    max_segments_per_seq: int | None = None
    dropout_rate: float = 0.0
    model_mode: str = "train"
    # The GPU's compute capability; None: read from the first device when the op is built.
    compute_capability: float | None = None
    # Take the pre-Hopper fallback (same-segment mask through cuDNN) on any GPU, to test it.
    force_fallback: bool = False
    # "cudnn": jax's cuDNN SDPA; "emulator": harness.sut.cudnn_emulator, its documented
    # semantics in plain JAX (runs anywhere, for CPU CI).
    cudnn_backend: str = "cudnn"
    # Inside jit, rows the packed lowering cannot represent poison their outputs with NaN
    # ("nan"), or raise through jax.experimental.checkify ("checkify"; wrap the step in
    # checkify.checkify).
    segment_check: str = "nan"
    # Attention features, in positions within each segment (a packed model's positions):
    # window (left, right): query i reads keys pos_i - left .. pos_i + right (right 0 under
    # the causal mask); logits_soft_cap: each logit becomes cap * tanh(logit / cap);
    # chunk_size: query i reads only its chunk (pos // chunk_size); sinks: the model has a
    # learnable logit per query head in each softmax (passed to the call). A path that cannot
    # honour one is refused here, naming it: never dropped.
    window: tuple[int, int] | None = None
    logits_soft_cap: float | None = None
    chunk_size: int | None = None
    sinks: bool = False

    def path(self, seq_len: int | None = None, te_available: bool = False) -> str:
        """Which lowering the op takes: dot_product, cudnn_packed (seqlens/offsets, Hopper+),
        cudnn_mask (same-segment mask as a cuDNN bias: below Hopper, or forced),
        xla_fallback (no cuDNN fused attention below CUDNN_MIN_CC), te_thd. `seq_len` and
        `te_available` decide cudnn_flash_auto (prefers_te; and TE where only it honours the
        features asked for)."""
        if self.attention == "dot_product":
            return "dot_product"
        if self.attention == "cudnn_flash_te" or (
                self.attention == "cudnn_flash_auto" and te_available
                and (self.prefers_te(seq_len) or self.needs_te)):
            return "te_thd"
        cc = self.compute_capability
        if self.cudnn_backend == "cudnn" and cc is not None and cc < CUDNN_MIN_CC:
            return "xla_fallback"
        if self.force_fallback or (cc is not None and cc < PACKED_MIN_CC):
            return "cudnn_mask"
        return "cudnn_packed"

    @property
    def needs_te(self) -> bool:
        """Features only TE's fused path honours among the fused ones: sinks (its learnable
        softmax), a window that reads ahead."""
        return self.sinks or (self.window is not None and self.window[1] > 0)

    def feature_problem(self, path: str, causal: bool = True) -> str | None:
        """Why the lowering `path` cannot honour a feature of this configuration, or None.
        dot_product and the XLA fallback honour every one; cuDNN's packed layout a causal
        window (its sliding window has a left bound only); the mask fallback windows and chunks
        (folded into its mask); TE's THD windows and sinks. Soft caps and chunks have no
        fused path here."""
        if path in ("dot_product", "xla_fallback"):
            return None
        asked = []
        if self.logits_soft_cap is not None:
            asked.append(f"logits_soft_cap={self.logits_soft_cap}")
        if self.chunk_size is not None and path != "cudnn_mask":
            asked.append(f"chunk_size={self.chunk_size}")
        if self.sinks and path != "te_thd":
            asked.append("sinks")
        if self.window is not None and path == "cudnn_packed" and self.window[1] > 0:
            asked.append(f"window={tuple(self.window)}, which reads {self.window[1]} keys ahead "
                         "(cuDNN's sliding window has a left bound only)")
        elif self.window is not None and path == "cudnn_packed" and not causal:
            asked.append(f"window={tuple(self.window)} without the causal mask (cuDNN's sliding "
                         "window has a left bound only)")
        if not asked:
            return None
        names = {"cudnn_packed": "cuDNN's packed layout" if self.packing else
                 "cuDNN with packing=False, one sequence per row", "cudnn_mask": "cuDNN with a mask",
                 "te_thd": "Transformer Engine's THD fused attention"}
        return (f"attention={self.attention} ({names.get(path, path)}) cannot honour "
                f"{', '.join(asked)}; use attention=dot_product (every feature), or "
                "cudnn_flash_te for sinks and windows that read ahead")

    def prefers_te(self, seq_len: int | None) -> bool:
        """cudnn_flash_auto's rule (see AUTO_TE_*): TE THD on long rows or many short segments,
        where the GPU runs THD fused attention (Hopper+) and packing is on."""
        if (seq_len is None or not self.packing or self.force_fallback
                or (self.compute_capability or 0) < PACKED_MIN_CC):
            return False
        room = seq_len / max(self.max_segments_per_seq or 1, 1)
        return seq_len >= AUTO_TE_MIN_SEQ_LEN or room <= AUTO_TE_MAX_TOKENS_PER_SEGMENT

    def validate(self) -> AttentionConfig:
        """Raises ConfigError naming the first rule broken; returns self otherwise."""
        def need(ok: bool, message: str) -> None:
            if not ok:
                raise ConfigError(message)

        need(self.attention in KERNELS,
             f"attention={self.attention!r} is not one of {', '.join(KERNELS)}")
        need(self.hardware in HARDWARE, f"hardware={self.hardware!r} is not one of {HARDWARE}")
        need(self.model_mode in MODES, f"model_mode={self.model_mode!r} is not one of {MODES}")
        need(self.cudnn_backend in CUDNN_BACKENDS,
             f"cudnn_backend={self.cudnn_backend!r} is not one of {CUDNN_BACKENDS}")
        need(self.segment_check in SEGMENT_CHECKS,
             f"segment_check={self.segment_check!r} is not one of {SEGMENT_CHECKS}")
        for flag in ("packing", "force_fallback", "sinks"):
            need(_flag(getattr(self, flag)),
                 f"{flag}={getattr(self, flag)!r} must be True or False")
        need(_real(self.dropout_rate) and 0.0 <= self.dropout_rate < 1.0,
             f"dropout_rate={self.dropout_rate!r} is not a number in [0, 1)")
        need(self.max_segments_per_seq is None or (_whole(self.max_segments_per_seq)
                                                   and self.max_segments_per_seq >= 1),
             f"max_segments_per_seq={self.max_segments_per_seq!r} must be a whole number >= 1")
        need(self.window is None or (isinstance(self.window, (tuple, list))
                                     and len(self.window) == 2
                                     and all(_whole(x) and x >= 0 for x in self.window)),
             f"window={self.window!r} must be (left, right), two whole numbers >= 0")
        need(self.logits_soft_cap is None or (_real(self.logits_soft_cap)
                                              and 0 < self.logits_soft_cap < math.inf),
             f"logits_soft_cap={self.logits_soft_cap!r} must be a finite number above 0")
        need(self.chunk_size is None or (_whole(self.chunk_size) and self.chunk_size >= 1),
             f"chunk_size={self.chunk_size!r} must be a whole number >= 1")
        if self.attention == "cudnn_flash_auto" and self.needs_te and (
                self.compute_capability or 0) < PACKED_MIN_CC:
            asked = (["sinks=True"] if self.sinks else []) + (
                [f"window={tuple(self.window)} (reads ahead)"]
                if self.window is not None and self.window[1] > 0 else [])
            need(False, f"attention=cudnn_flash_auto with {' and '.join(asked)} needs "
                 f"Transformer Engine's THD path (compute capability >= {PACKED_MIN_CC}); "
                 f"compute_capability={self.compute_capability}")
        if self.attention != "cudnn_flash_auto":
            # The path is known now (auto's depends on the row length: checked per call).
            problem = self.feature_problem(self.path(), causal=self.window is None
                                           or self.window[1] == 0)
            need(problem is None, problem or "")
        cudnn = self.attention.startswith("cudnn")
        emulated = self.cudnn_backend == "emulator"
        if cudnn and not emulated:
            need(self.hardware == "gpu",
                 f"attention={self.attention} runs on NVIDIA GPUs only, not hardware={self.hardware}")
        if self.attention == "cudnn_flash_te":
            need(not emulated, "attention=cudnn_flash_te has no emulator; use hardware with "
                 "Transformer Engine")
        if self.packing:
            need(self.model_mode == "train",
                 "packing=True with model_mode='decode': packed rows are a training layout; "
                 "decode one sequence per row")
            if cudnn:
                need(self.max_segments_per_seq is not None,
                     f"packing=True with attention={self.attention} needs max_segments_per_seq: "
                     "the packed cuDNN/TE lowering is sized by it at compile time")
            if self.attention == "cudnn_flash_te":
                need((self.compute_capability or 0) >= PACKED_MIN_CC,
                     f"packing=True with attention=cudnn_flash_te needs compute capability >= "
                     f"{PACKED_MIN_CC} (THD fused attention); this GPU has "
                     f"{self.compute_capability}, and TE's unfused fallback crashes on a "
                     "SequenceDescriptor. Use attention=cudnn_flash_jax (it falls back) or "
                     "dot_product")
        if self.dropout_rate > 0 and self.model_mode == "train":
            need(not emulated, "dropout_rate > 0 with cudnn_backend='emulator': the cuDNN "
                 "emulator has no dropout")
            need(self.path() != "xla_fallback",
                 f"dropout_rate={self.dropout_rate} with attention={self.attention} on a GPU of "
                 f"compute capability {self.compute_capability}: cuDNN fused attention needs "
                 f">= {CUDNN_MIN_CC}, and the XLA fallback has no attention dropout; it would "
                 "be silently skipped")
            need(self.attention != "dot_product",
                 "dropout_rate > 0 with attention=dot_product: this op's dot_product has no "
                 "attention dropout; it would be silently skipped")
        return self
