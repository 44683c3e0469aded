"""The system under test: a MaxText-style attention op with the packed-sequence fix.

`AttentionOp(config)(query, key, value, segment_ids, scale=...)` selects its kernel by name, as
MaxText's `attention=` setting does: `dot_product`, `cudnn_flash_jax` (fixed: packed
seqlens/offsets on Hopper+, a same-segment-mask fallback below) or `cudnn_flash_te` (THD).
"""
from harness.sut.attention_op import AttentionOp
from harness.sut.config import AttentionConfig, ConfigError
from harness.sut.lowering import SegmentIdError

__all__ = ["AttentionConfig", "AttentionOp", "ConfigError", "SegmentIdError"]
