"""Plain-JAX kernels: MaxText's dot_product, XLA's dot_product_attention, and the bug canary."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from harness.judge.vocabulary import DQ, LEAK, OUT
from harness.kernels.kernel import Kernel
from harness.sut.dot_product import dot_product, segment_mask


def xla_dot_product_attention(query, key, value, segment_ids, *, causal, scale, window=None):
    """jax.nn.dot_product_attention, XLA implementation, with the same-segment mask and its
    own sliding window (`local_window_size=(left, right)`: keys i - left .. i + right of the
    row, which within a contiguous segment is the segment's window)."""
    extra = {} if window is None else {"local_window_size": tuple(window)}
    return jax.nn.dot_product_attention(
        query, key, value, mask=segment_mask(segment_ids, causal=False), scale=scale,
        is_causal=causal, implementation="xla", **extra)


def no_f16_on_cpu(case, platform):
    # XLA:CPU's dot_general rejects float16 operands with float32 accumulation, which
    # jax.nn.dot_product_attention asks for ("precision F16_F16_F32 is not supported").
    if platform.name == "cpu" and case.dtype == "float16":
        return ["float16 dot_general with float32 accumulation is not supported by XLA:CPU"]
    return []


def ignores_segments(query, key, value, segment_ids, *, causal, scale):
    """The reported bug: segment ids ignored, the causal flag kept (MaxText's cudnn_flash_jax
    called cuDNN with a causal mask only)."""
    del segment_ids
    return jax.nn.dot_product_attention(query, key, value, scale=scale, is_causal=causal,
                                        implementation="xla")


def ignores_segments_expectation(case, check, segment):
    """Where a kernel that ignores segment ids must be caught, and where it must pass.

    Its queries read every token before them (causal) or every token of the row
    (bidirectional): other segments and padding alike. A segment that reads no other token and
    is read by none is computed right: every check passes (unpacked rows, padding only after).

    - leak probe (bitwise, no tolerance): fails on every segment that reads another token or
      whose keys another valid token reads. Exact; judged everywhere.
    - out: a causal segment that reads earlier tokens is wrong by O(1) at its first token,
      which reads itself and them alone. A bidirectional one is visible when padding (poison)
      is read, or when the foreign tokens are at least a sixteenth of its own: the shift is
      about sqrt(foreign / own) of the output's scale, against a tolerance of a few eps.
    - dq: as out for segments longer than one token. A single-token segment's true dq is
      exactly 0, and its leaked dq after n keys is O(1/sqrt(n)) of the gradients' scale,
      inside bf16 noise for long rows (seen on the H200: ratios 0.9-1.0 after ~2000 tokens):
      not judged here (the probe judges it).
    - dk/dv of a causal segment at the row's start (L tokens) are wrong because later queries
      read its keys: visible when at least L later valid tokens read it and L is short enough
      for the leak to clear the tolerance floor (_visible_length; H200, bf16: L of 512 to 1970
      gave ratios 0.6-1.0), and no padding lies before the readers (its poison keys draw their
      attention away). dk/dv of other segments are wrong by an amount the layout decides.
      Those are not judged here (the probe judges them)."""
    row = case.segment_ids[segment.row]
    own = segment.length
    if case.causal:
        read = row[:segment.start]
        read_by = int((row[segment.stop:] > 0).sum())
    else:
        read = np.concatenate([row[:segment.start], row[segment.stop:]])
        read_by = int((read > 0).sum())
    reads_padding = bool((read == 0).any())
    if read.size == 0 and read_by == 0:
        return "pass"
    if check == LEAK.name:
        return "fail"
    if check in (OUT.name, DQ.name):
        if read.size == 0:
            return "pass"
        if check == DQ.name and own == 1:
            return "either"
        visible = case.causal or reads_padding or 16 * int((read > 0).sum()) >= own
        return "fail" if visible else "either"
    # Padding (poison) between the segment and its later readers draws their attention away.
    valid = np.flatnonzero(row > 0)
    clean = not (row[:valid[-1]] == 0).any()
    if (case.causal and clean and read.size == 0 and read_by >= own
            and own <= _visible_length(case, check)):
        return "fail"
    return "either"


def ignores_segments_padding(case, row):
    """The padding check of a kernel that ignores segment ids: its valid queries read padding
    keys wherever a valid token follows padding (causal) or shares the row with it
    (bidirectional), and those keys then get gradients: dk/dv at padding are not zero there."""
    ids = case.segment_ids[row]
    pad = np.flatnonzero(ids == 0)
    valid = np.flatnonzero(ids > 0)
    if pad.size == 0 or valid.size == 0:
        return "pass"
    read = valid.max() > pad.min() if case.causal else True
    return "fail" if read else "pass"


def _visible_length(case, check) -> float:
    """The longest first segment whose dk/dv leak still clears the tolerance floor.

    The later queries' random-signed contributions to a key's gradient add up to about
    1/sqrt(L1) of the gradients' scale, while the floor is floor_eps * eps of it; with a factor
    2 margin, L1 <= (1 / (2 * floor_eps * eps))^2: 256 tokens in bf16, 16384 in fp16. (H200:
    bf16 rows with L1 of 512 to 1970 gave dk/dv ratios 0.6-1.0.)"""
    from harness.judge.vocabulary import check as check_named
    fraction = check_named(check).floor_eps * float(jnp.finfo(case.dtype).eps)
    return (1.0 / (2.0 * fraction)) ** 2


# What `python -m harness repro` pastes into a standalone script for the canary: the same call
# as ignores_segments, with nothing but jax.
CANARY_STANDALONE = '''\
import jax


def kernel(query, key, value, segment_ids, *, causal, scale, max_segments=None):
    """jax.nn.dot_product_attention (XLA) with the causal flag and no mask: the segment ids are
    ignored, so tokens attend across document boundaries and into padding (the reported bug:
    MaxText's cudnn_flash_jax called cuDNN with a causal mask only)."""
    del segment_ids, max_segments
    return jax.nn.dot_product_attention(query, key, value, scale=scale, is_causal=causal,
                                        implementation="xla")
'''


KERNELS = [
    Kernel("dot_product", dot_product, padding_anywhere=True, materializes_scores=True,
           features=("window", "softcap", "chunk", "sinks", "head_dim_v"), forward_mode=True,
           description="MaxText-style dot_product attention in the input dtype (dense mask)"),
    # jax.nn's API takes a window, and a value whose head dim differs (which it refuses).
    Kernel("xla", xla_dot_product_attention, constraints=no_f16_on_cpu, padding_anywhere=True,
           materializes_scores=True, features=("window", "head_dim_v"), forward_mode=True,
           description="jax.nn.dot_product_attention(implementation='xla') with the segment mask"),
    Kernel("canary_ignores_segments", ignores_segments, constraints=no_f16_on_cpu,
           padding_anywhere=True, materializes_scores=True,
           expect=ignores_segments_expectation, expect_padding=ignores_segments_padding,
           tags=("canary",),
           standalone=CANARY_STANDALONE,
           description="segment ids ignored (the reported bug): must be caught"),
]
