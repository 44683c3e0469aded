"""The fixed attention op: MaxText's AttentionOp train path, kernels selected by name.

MaxText's `cudnn_flash_jax` called cuDNN with a causal mask only, so packed rows attended
across their boundaries. Here the segment ids always reach the kernel:

- cudnn_packed (Hopper+): segment ids -> per-row seqlens [B, M] and offsets [B, M+1] with
  PADDING_CAUSAL, cuDNN's packed layout, which skips cross-segment work.
- cudnn_mask (below Hopper, where the packed layout raises; or forced): the same-segment mask
  as a cuDNN bias with a causal mask type. Still fused, still correct, slower.
- xla_fallback (no cuDNN fused attention below sm80): dense dot_product with the same mask.
- te_thd: Transformer Engine's THD fused attention, on the same seqlens and offsets.
- cudnn_flash_auto: te_thd or cudnn_packed, whichever was faster on the H200 for the row
  length and max_segments_per_seq (config.AUTO_TE_*), te_thd only where TE is installed.

Padding tokens (after the last segment of a row) are computed, not left undefined: with the
causal mask they join the row's last segment (valid queries never look ahead at them, and with
a zero output cotangent there they add exactly zero to its gradients), without it they form one
more segment. Defined outputs, gradients exactly zero where the output cotangent is, no extra
pass over the output to clean undefined values up, and (causal) no extra slot for cuDNN.

Segment ids the packed lowering cannot represent (an id above max_segments_per_seq, one id in
two runs, padding before a segment) raise SegmentIdError when they are concrete. Inside jit
they cannot raise: with segment_check="nan" each row that cannot be lowered gets NaNs (in the
values of its valid tokens, so their outputs, valid and kept by a loss masked at padding, are
NaN), so the step's loss goes NaN (loud, never silently wrong); with
"checkify" a jax.experimental.checkify error names the problem when the step is wrapped in
checkify.checkify.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from harness.sut import lowering
from harness.sut.config import AttentionConfig, ConfigError
from harness.sut.dot_product import dot_product, local_mask, segment_mask

CUDNN_DTYPES = ("bfloat16", "float16")


def _device_compute_capability() -> float | None:
    device = jax.devices()[0]
    cc = getattr(device, "compute_capability", None)
    return float(cc) if cc else None


def cudnn_backend(name: str, compute_capability: float | None = None):
    """(dot_product_attention, MaskType) of the real cuDNN API or of the emulator."""
    if name == "emulator":
        import functools

        from harness.sut import cudnn_emulator as emu
        return (functools.partial(emu.dot_product_attention, compute_capability=compute_capability),
                emu.MaskType)
    from jax._src.cudnn import fused_attention_stablehlo as sdpa
    return sdpa.dot_product_attention, sdpa.MaskType


def te_available() -> bool:
    """Transformer Engine's JAX extension is installed (not imported: that happens on use)."""
    import importlib.util
    return importlib.util.find_spec("transformer_engine") is not None


class AttentionOp:
    def __init__(self, config: AttentionConfig):
        if (config.compute_capability is None and config.hardware == "gpu"
                and config.cudnn_backend == "cudnn" and config.attention != "dot_product"):
            config = dataclasses.replace(config, compute_capability=_device_compute_capability())
        self.config = config.validate()
        self.te_available = (config.attention == "cudnn_flash_auto"
                             and config.cudnn_backend == "cudnn" and te_available())

    def path(self, seq_len: int) -> str:
        """The lowering this op takes for rows of `seq_len` tokens (config.path)."""
        return self.config.path(seq_len, self.te_available)

    @property
    def max_segments(self) -> int:
        return self.config.max_segments_per_seq if self.config.packing else 1

    def _check_inputs(self, query, key, value, segment_ids) -> None:
        """Shapes, dtypes and head dims the selected kernel cannot take: a clear error, now."""
        if query.ndim != 4 or key.ndim != 4 or value.ndim != 4:
            raise ValueError("query, key and value must be [batch, seq, heads, head_dim]; got "
                             f"{query.shape}, {key.shape}, {value.shape}")
        b, t, heads, d = query.shape
        path = self.path(t)
        fused = path.startswith("cudnn") or path == "te_thd"
        if key.shape[:3] != value.shape[:3] or (fused and key.shape != value.shape):
            raise ValueError(
                f"key {key.shape} and value {value.shape} differ" + (
                    f" (value head dim {value.shape[3]} against {key.shape[3]}: attention="
                    f"{self.config.attention} takes equal head dims; jax's packed cuDNN layout "
                    "would lay the value out by the query's head dim)"
                    if fused and key.shape[:3] == value.shape[:3] else ""))
        if not query.dtype == key.dtype == value.dtype:
            raise ValueError(f"query, key and value must share a dtype; got {query.dtype}, "
                             f"{key.dtype}, {value.dtype}")
        if key.shape[0] != b or key.shape[1] != t or key.shape[3] != d:
            raise ValueError(f"key {key.shape} does not match query {query.shape} in batch, "
                             "sequence or head_dim (self-attention)")
        if heads % key.shape[2]:
            raise ValueError(f"{heads} query heads are not a multiple of {key.shape[2]} kv heads")
        if segment_ids.shape != (b, t):
            raise ValueError(f"segment_ids {segment_ids.shape} must be [batch, seq] = {(b, t)}")
        if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
            raise ValueError(f"segment_ids must be integers, got {segment_ids.dtype}")
        if fused:
            if str(query.dtype) not in CUDNN_DTYPES:
                raise ValueError(f"attention={self.config.attention} takes {'/'.join(CUDNN_DTYPES)}, "
                                 f"not {query.dtype}")
            cc = self.config.compute_capability
            max_d = 128 if cc is not None and cc < 9.0 else 256
            if d % 8 or d > max_d:
                raise ValueError(f"head_dim {d} unsupported by cuDNN fused attention here "
                                 f"(multiple of 8, at most {max_d})")
            if path == "cudnn_mask" and t % 2:
                raise ValueError(f"seq_len {t} must be even for cuDNN attention with a mask bias "
                                 "in training")

    def __call__(self, query, key, value, segment_ids, *, scale: float, causal: bool = True,
                 sinks=None):
        """`sinks` [heads] float32: the learnable sink logits, where the config has sinks."""
        segment_ids = jnp.asarray(segment_ids) if lowering.is_concrete(segment_ids) else segment_ids
        self._check_inputs(query, key, value, segment_ids)
        if (sinks is not None) != self.config.sinks:
            raise ConfigError(f"sinks={'given' if sinks is not None else 'missing'} but the "
                              f"config has sinks={self.config.sinks}")
        if sinks is not None and not hasattr(sinks, "shape"):
            raise ValueError(f"sinks {type(sinks).__name__}: an array of shape [heads] = "
                             f"({query.shape[2]},), float32")
        if sinks is not None and sinks.shape != (query.shape[2],):
            raise ValueError(f"sinks {sinks.shape} must be [heads] = ({query.shape[2]},)")
        limit = self.max_segments if self.config.attention != "dot_product" else None
        if lowering.is_concrete(segment_ids):
            lowering.check_concrete(segment_ids, limit)
        path = self.path(query.shape[1])
        problem = self.config.feature_problem(path, causal)
        if problem:
            raise ConfigError(problem)
        c = self.config
        if path in ("dot_product", "xla_fallback"):
            return dot_product(query, key, value, segment_ids, causal=causal, scale=scale,
                               window=c.window, softcap=c.logits_soft_cap, chunk=c.chunk_size,
                               sinks=sinks)
        rows = path == "cudnn_packed" and not self.config.packing   # one sequence per row
        traced = not lowering.is_concrete(segment_ids)
        if path in ("cudnn_packed", "te_thd") or traced:
            # The packed lowering (one pass over the ids) also says which rows it represents
            # (concrete ids: all of them, check_concrete has passed).
            seqlen, offsets, ok = lowering.packed(segment_ids, self.max_segments,
                                                  padding=_padding(causal))
        if traced:
            value = self._guard(value, segment_ids, ok)
        if path == "cudnn_mask":
            out = self._cudnn_mask(query, key, value, segment_ids, scale, causal)
        elif rows:
            out = self._cudnn_rows(query, key, value, segment_ids, ok, scale, causal)
        elif path == "cudnn_packed":
            out = self._cudnn_packed(query, key, value, seqlen, offsets, scale, causal)
        else:
            out = self._te_thd(query, key, value, seqlen, offsets, scale, causal, sinks)
        if rows:
            # Per-row lengths leave padding outputs undefined; zero them so that no NaN there
            # can reach a masked loss (0 * NaN is NaN). The packed paths compute padding as a
            # segment of its own (defined, no extra pass); the mask path attends padding to
            # padding.
            out = jnp.where((segment_ids > 0)[:, :, None, None], out, 0)
        return out.astype(query.dtype)

    def _guard(self, value, segment_ids, ok):
        """`ok` [B]: which rows the packed lowering represents (rows it cannot get one segment
        over the whole row, in bounds, and are poisoned or refused here)."""
        if self.config.segment_check == "checkify":
            from jax.experimental import checkify
            checkify.check(ok.all(), "segment_ids cannot be lowered to the packed layout: a row "
                           f"has an id above max_segments_per_seq={self.max_segments}, an id in "
                           "two separate runs, or padding before a segment (rows ok: {ok})", ok=ok)
            return value
        # A NaN in the value of every valid token of a bad row: every path lowers a bad row so
        # that each token's query attends its own key at least (the packed lowering gives it
        # one segment over the whole row, the rows path its full length), so its output (valid,
        # kept by a loss masked at padding) is NaN and the step's loss goes NaN, loudly. In the
        # value, not the output: the kernel keeps its output for the backward pass, so changing
        # it costs a copy of the output, and the value (kv heads only) is the smallest tensor
        # to copy. One elementwise pass, added: an add's gradient is the identity (no pass over
        # dv in the backward). Elsewhere it adds +0, which leaves every value but the sign of a
        # zero (and, on XLA:CPU, subnormals, flushed) as it was.
        return poisoned(value, ~ok[:, None] & (segment_ids != 0))

    def _sdpa(self):
        return cudnn_backend(self.config.cudnn_backend, self.config.compute_capability)

    def _cudnn_rows(self, query, key, value, segment_ids, ok, scale, causal):
        # One sequence per row, then padding: plain per-row lengths, no packed offsets. A row
        # that is not one (ok False; poisoned by the guard) is computed over its full length.
        # The window (left, 0), causal (feature_problem refuses others): cuDNN's sliding window
        # over the row's positions, which are the sequence's.
        sdpa, mask_type = self._sdpa()
        lengths = jnp.where(ok, (segment_ids > 0).sum(axis=1), segment_ids.shape[1])
        lengths = lengths.astype(jnp.int32)
        window = self.config.window
        extra = {} if window is None else {"sliding_window_length": int(window[0]) + 1}
        return sdpa(query, key, value, q_seqlen=lengths, kv_seqlen=lengths, scale=scale,
                    dropout_rate=self.config.dropout_rate,
                    mask_type=mask_type.PADDING_CAUSAL if causal else mask_type.PADDING,
                    qkv_layout="BTNH", **extra)

    def _cudnn_packed(self, query, key, value, seqlen, offsets, scale, causal):
        sdpa, mask_type = self._sdpa()
        repeat = (self.config.cudnn_backend == "cudnn" and key.shape[2] != query.shape[2]
                  and lowering.upstream_gqa_offsets_wrong())
        return cudnn_packed(sdpa, mask_type, query, key, value, seqlen, offsets, scale=scale,
                            causal=causal, dropout_rate=self.config.dropout_rate,
                            repeat_kv=repeat, window=self.config.window)

    def _cudnn_mask(self, query, key, value, segment_ids, scale, causal):
        sdpa, mask_type = self._sdpa()
        same = segment_mask(segment_ids, causal=False)          # [B, 1, T, T]
        if self.config.window is not None or self.config.chunk_size is not None:
            same = same & local_mask(segment_ids, self.config.window, self.config.chunk_size)
        return sdpa(query, key, value, mask=same, scale=scale,
                    dropout_rate=self.config.dropout_rate,
                    mask_type=mask_type.CAUSAL if causal else mask_type.NO_MASK,
                    qkv_layout="BTNH")

    def _te_thd(self, query, key, value, seqlen, offsets, scale, causal, sinks=None):
        # The same lowering as the cuDNN path, handed to TE as lengths and offsets: TE would
        # otherwise derive them again from segment ids and positions, in more passes.
        return te_fused_packed(query, key, value, seqlen, offsets, scale=scale, causal=causal,
                               dropout_rate=self.config.dropout_rate,
                               window=self.config.window, sinks=sinks)


def poisoned(value, poison):
    """value with NaN where poison [B, T] is set (every head and feature of those tokens)."""
    return value + jnp.where(poison, jnp.nan, 0).astype(value.dtype)[:, :, None, None]


def _padding(causal: bool) -> str:
    """Trailing padding in the packed lowering: merged into the last segment where the mask is
    causal (no extra slot, so no extra work for cuDNN), a segment of its own otherwise."""
    return "merged" if causal else "segment"


def cudnn_packed(sdpa, mask_type, query, key, value, seqlen, offsets, *, scale, causal,
                 dropout_rate=0.0, repeat_kv=False, window=None):
    """cuDNN's packed layout (jax's SDPA or the emulator): segment lengths [B, M] and offsets
    [B, M+1]. `repeat_kv`: this jax scales kv offsets by the query head count (jax <= 0.11.0),
    so cuDNN gets as many kv heads as query heads; autodiff sums the repeated heads' grads.
    `window` (left, 0), causal only: cuDNN's sliding window of left + 1 keys, self included,
    per packed sequence."""
    if repeat_kv:
        group = query.shape[2] // key.shape[2]
        key, value = jnp.repeat(key, group, axis=2), jnp.repeat(value, group, axis=2)
    extra = {} if window is None else {"sliding_window_length": window[0] + 1}
    return sdpa(query, key, value, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets,
                kv_offsets=offsets, scale=scale, dropout_rate=dropout_rate,
                mask_type=mask_type.PADDING_CAUSAL if causal else mask_type.PADDING,
                qkv_layout="BTNH", **extra)


def te_fused_thd(query, key, value, segment_ids, *, scale, causal, max_segments,
                 dropout_rate=0.0):
    """Transformer Engine's THD fused attention with a SequenceDescriptor built from segment
    ids and positions within segments (padding, id 0, may sit anywhere in a row)."""
    from transformer_engine.jax import attention as te

    pos = lowering.positions(segment_ids)
    descriptor = te.SequenceDescriptor.from_segment_ids_and_pos(
        (segment_ids, segment_ids), (pos, pos))
    return te_fused_attention(query, key, value, descriptor, scale=scale, causal=causal,
                              max_segments=max_segments, dropout_rate=dropout_rate)


def te_fused_packed(query, key, value, seqlen, offsets, *, scale, causal, dropout_rate=0.0,
                    window=None, sinks=None):
    """Transformer Engine's THD fused attention on cuDNN's packed form: seqlen [B, M] and
    offsets [B, M+1], -1 where unused."""
    from transformer_engine.jax import attention as te

    descriptor = te.SequenceDescriptor.from_seqlens_and_offsets((seqlen, seqlen),
                                                                (offsets, offsets))
    return te_fused_attention(query, key, value, descriptor, scale=scale, causal=causal,
                              max_segments=seqlen.shape[1], dropout_rate=dropout_rate,
                              window=window, sinks=sinks)


def te_fused_attention(query, key, value, descriptor, *, scale, causal, max_segments,
                       dropout_rate=0.0, window=None, sinks=None):
    """Transformer Engine's THD fused attention for a SequenceDescriptor. `window` (left,
    right): TE's window_size, keys i - left .. i + right within each sequence (right 0 under
    the causal mask: TE would let a right bound override causality); `sinks` [heads]: TE's
    learnable softmax (its softmax_offset, [1, heads, 1, 1], float32; its gradient is dsinks)."""
    from transformer_engine.jax import attention as te

    mask = te.AttnMaskType.PADDING_CAUSAL_MASK if causal else te.AttnMaskType.PADDING_MASK
    extra = {}
    if window is not None:
        extra["window_size"] = (int(window[0]), 0 if causal else int(window[1]))
    softmax = te.AttnSoftmaxType.VANILLA_SOFTMAX
    if sinks is not None:
        softmax = te.AttnSoftmaxType.LEARNABLE_SOFTMAX
        extra["softmax_offset"] = sinks.astype(jnp.float32).reshape(1, -1, 1, 1)
    return te.fused_attn(
        (query, key, value), None, descriptor, None, te.AttnBiasType.NO_BIAS, mask,
        te.QKVLayout.THD_THD_THD, softmax, scale,
        dropout_rate, True, max_segments_per_seq=max_segments, **extra)
