"""What MaxText releases are known to get wrong, as the maxtext: kernels' expectations
(harness.kernels.maxtext_adapter runs the op; this module says what a correct harness must
conclude about it, by the installed version):

- cudnn_flash_jax ignores the segment ids in training (the seed report; maxtext <= 0.2.5):
  caught (`known_bug_expectation`).
- Where MaxText 0.2.5 silently drops a feature on a path (cudnn_flash_jax: window, chunk,
  soft cap; cudnn_flash_te: soft cap, chunk; GPU flash: window, chunk, soft cap), the kernel
  expects it (`drops_expectation`): known on the tolerance checks where dropping it moves the
  segment past its tolerance (predicted from the case's inputs), a leak where the leak probe's
  blocks see the keys it should not read, pass elsewhere. Sinks on cudnn_flash_jax and flash
  raise while tracing (validate_gpu_flash_attention): a refusal.
- dot_product's float16 softmax sum above 256 drops the gradient through it: known on the
  segments predicted from the inputs (`float16_sum_expectation`), and its low-precision softmax
  moves dsinks (known on those cases).
"""
from __future__ import annotations

import functools

import numpy as np

from harness.model.features import CHUNK, SOFTCAP, WINDOW


# MaxText releases whose cudnn_flash_jax ignores decoder_segment_ids in training (the seed
# report; still in 0.2.5 on the H200): there the harness expects the bug and catches it, as it
# does the original call. A later release is expected to pass: if it still ignores segment ids,
# that is a FAIL, and if an old one stops showing the bug, a MISSED.
IGNORES_SEGMENTS_UP_TO = (0, 2, 5)


@functools.lru_cache(maxsize=1)
def version_text() -> str | None:
    """The installed maxtext's version, without a local part ("0.2.5"); None without maxtext."""
    import importlib.metadata
    try:
        return importlib.metadata.version("maxtext").split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return None


def installed_version() -> tuple[int, ...] | None:
    """version_text as numbers ((0, 2, 5)), for comparing with the releases named here."""
    text = version_text()
    if text is None:
        return None
    return tuple(int(p) for p in text.split(".")[:3] if p.isdigit())


def known_bug_expectation(case, check, segment):
    from harness.kernels.reference import ignores_segments_expectation
    version = installed_version()
    if version is not None and version <= IGNORES_SEGMENTS_UP_TO and segment is not None:
        return ignores_segments_expectation(case, check, segment)
    return "pass"


# ----- features a path drops ---------------------------------------------------------------------

# MaxText releases whose GPU paths silently drop configured features (0.2.5, read from the
# wheel's src/maxtext/layers/attention_op.py; line numbers are that file's). None of its config
# checks (configs/types.py) refuses these combinations.
DROPS_UP_TO = (0, 2, 5)
DROPPED = {   # path -> feature -> (what it ignores, where)
    "cudnn_flash_jax": {
        WINDOW: ("the sliding window", "cudnn_jax_flash_attention (2829-2877) calls jax's cuDNN "
                 "SDPA with mask_type=CAUSAL and no sliding_window_length (2865-2874), and reads "
                 "neither attention_type nor sliding_window_size"),
        CHUNK: ("the chunks", "cudnn_jax_flash_attention (2829-2877) never reads attention_type "
                "or chunk_attn_window_size; its call is plain CAUSAL (2865-2874)"),
        SOFTCAP: ("the soft cap", "cudnn_jax_flash_attention (2829-2877) hands jax's cuDNN SDPA "
                  "no attn_logits_soft_cap (nor a score_mod)"),
    },
    "cudnn_flash_te": {
        CHUNK: ("the chunks", "on the packed (THD) layout cudnn_flash_attention hands TE a "
                "SequenceDescriptor of the segments only (2693-2715); attention_type=chunk "
                "reaches TE nowhere (2663-2664 raises under context parallelism only)"),
        SOFTCAP: ("the soft cap", "cudnn_flash_attention builds TE's DotProductAttention "
                  "(2757-2776) without attn_logits_soft_cap, which TE takes no argument for"),
    },
    "flash": {
        WINDOW: ("the sliding window", "on GPU apply_attention masks causal and same-segment only "
                 "(tokamax Mask, 1733-1737); it reads attention_type only to refuse block "
                 "diffusion (1714-1718)"),
        CHUNK: ("the chunks", "on GPU apply_attention masks causal and same-segment only "
                "(1733-1737)"),
        SOFTCAP: ("the soft cap", "on GPU apply_attention calls tokamax's Pallas-Triton flash "
                  "attention without logits_soft_cap (1739)"),
    },
}
@functools.lru_cache(maxsize=8)
def drop_prediction(case, dropped: tuple[str, ...], convention: str) -> dict:
    """What a kernel that computes `case` without the features `dropped` shows, from the case's
    inputs (harness.judge.prediction)."""
    import dataclasses

    from harness.judge.prediction import prediction

    features = case.features
    for name in dropped:
        features = features.without(name)
    return prediction(case, dataclasses.replace(case, features=features), convention)


def drops_expectation(attention: str, base=None, convention: str = "row"):
    """expect(case, check, segment) of MaxText's `attention` path, which drops the features
    DROPPED[attention] (maxtext <= DROPS_UP_TO): where `base` (the path's other expectations)
    says pass, the drop's prediction (harness.judge.prediction: known past its tolerance, a
    leak where the probe sees one); `base`'s word elsewhere (a fail or an either stays)."""
    from harness.judge import vocabulary as v
    from harness.judge.prediction import expected

    def expect(case, check, segment):
        value = base(case, check, segment) if base is not None else v.PASS
        dropped = tuple(n for n in case.features.names if n in DROPPED[attention])
        version = installed_version()
        if (not dropped or version is None or version > DROPS_UP_TO
                or (value[0] if isinstance(value, tuple) else value) != v.PASS):
            return value
        what = " and ".join(DROPPED[attention][n][0] for n in dropped)
        where = "; ".join(DROPPED[attention][n][1] for n in dropped)
        reason = (f"known upstream bug: MaxText {'.'.join(map(str, version))}'s {attention} "
                  f"ignores {what} (layers/attention_op.py: {where})")
        return expected(drop_prediction(case, dropped, convention), check, segment, reason,
                        value)
    return expect

# MaxText's dot_product divides its unnormalized output by the softmax sum in the input dtype
# (`prefill_unnormalized_output / prefill_exponentials_sum`, float32_logits off as in base.yml).
# jax differentiates x / s through s**-2, and in float16 s * s overflows once s > 256: the
# gradient through the sum is 0 (`jax.grad(lambda s: 1 / s)(jnp.float16(300))` is -0.0). That
# gradient reaches the logits only: dq and dk are wrong for queries whose exponentials (relative
# to their max) sum above 256, which needs more than 256 keys in the segment; dv (the
# exponentials over the sum, times the cotangent) never differentiates the sum and is right.
# Seen on the H200 and on CPU: dq 9.8x, dk 7.4x the tolerance on a 1919-token float16 segment,
# dv 0.08x. bfloat16 has float32's range and is unaffected.
FLOAT16_SUM_REASON = ("known upstream bug: float16 softmax sum > 256 drops the gradient through "
                      "it (jax differentiates out / sum via sum**-2, which overflows float16): "
                      "dq and dk of segments where some query's sum, computed from the inputs, "
                      "passes 255.7, and the output's tangent (jvp) there, through the same "
                      "sum**-2")
FLOAT16_SUM_UP_TO = (0, 2, 5)
# Forward mode meets the same overflow: the tangent of out / sum is d(out) / sum - out * d(sum)
# * sum**-2. Seen on CPU on the one segment predicted (sum 256.1): jvp 4.6x the tolerance.
FLOAT16_SUM_CHECKS = ("dq", "dk", "jvp")


# The overflow needs a float16 softmax sum above 255.94 (its square passes float16's 65504). A
# segment is predicted to show the bug where some query's sum, computed in float32 from the
# float16 inputs as MaxText scales and masks them, exceeds 255.94 less float16's rounding of the
# exponentials and of their sum (each within half an ulp, 2**-11: 0.1% together). On the H200
# nightly's float16 cases the one segment predicted (sum 256.1) is the one that fails; the next
# sums (253.0, 245.5) pass. A failure on any other segment is a FAIL.
FLOAT16_SUM_PREDICTED = 255.94 * (1 - 2 ** -10)


@functools.lru_cache(maxsize=4)
def softmax_sums(case) -> dict[tuple[int, int], float]:
    """(row, segment number) -> the largest softmax denominator sum_j exp(s_ij - max_j s_ij)
    over the segment's queries and heads, from the case's inputs (query pre-scaled in its
    dtype, as the adapter and MaxText's attention layer do; same-segment, causal mask; with the
    case's features as MaxText applies them: the soft cap on the scores, the window and the
    row-start chunks in the mask, the sink's logit in the max and the sum)."""
    import jax
    import jax.numpy as jnp

    from harness.model.case import make_inputs

    x = make_inputs(case)
    group = case.heads // case.kv_heads
    f = case.features

    @jax.jit
    def row_sums(q, k, seg, sinks):
        q = (q * jnp.asarray(case.scale, q.dtype)).astype(jnp.float32)
        k = jnp.repeat(k, group, axis=1).astype(jnp.float32)
        s = jnp.einsum("qhd,khd->hqk", q, k)
        if f.softcap is not None:
            s = f.softcap * jnp.tanh(s / f.softcap)
        t = seg.shape[0]
        idx = jnp.arange(t)
        mask = (seg[:, None] == seg[None, :]) & (seg[:, None] > 0)
        if case.causal:
            mask &= jnp.tril(jnp.ones((t, t), bool))
        if f.window is not None:
            mask &= idx[None, :] >= idx[:, None] - f.window[0]
        if f.chunk is not None:
            mask &= idx[:, None] // f.chunk == idx[None, :] // f.chunk
        s = jnp.where(mask[None], s, -jnp.inf)
        m = jnp.max(s, axis=-1, keepdims=True)
        if sinks is not None:
            m = jnp.maximum(m, sinks[:, None, None])
        total = jnp.where(mask[None], jnp.exp(s - m), 0.0).sum(-1)
        if sinks is not None:
            total += jnp.exp(sinks[:, None] - m[..., 0])
        return total.max(axis=0)                                           # [T]

    out = {}
    for row in range(case.batch):
        sums = np.asarray(row_sums(x.query[row], x.key[row], x.segment_ids[row], x.sinks))
        for seg in case.row_segments(row):
            out[(row, seg.number)] = float(sums[seg.start:seg.stop].max())
    return out


# MaxText's dot_product computes its softmax in the inputs' dtype by default (base.yml:
# float32_logits false): with sinks, each token's share of the sink is rounded to bfloat16 or
# float16, and dsinks, one sum over every token of the batch, gathers those roundings. Seen on
# the CPU smoke suite's bfloat16 sinks cases: 1.30x and 1.87x the tolerance (which the float32
# softmax of the harness's peer sets) on 2 of 8; 0.05x and 0.21x with float32_logits on. The
# other checks of those cases pass. Declared on every low-precision sinks case, so the cases
# where it does not show are listed as "declared known, passed".
LOW_PRECISION_SINKS_REASON = (
    "MaxText's dot_product computes the softmax in the inputs' dtype by default "
    "(float32_logits false): the sink's share of each softmax is rounded to it, and dsinks, "
    "a sum over every token, lands up to about 2x the tolerance of a float32 softmax")


def float16_sum_expectation(case, check, segment):
    """Known exactly where the bug can show: dq, dk and jvp in float16 of segments in which some
    query's softmax sum passes FLOAT16_SUM_PREDICTED (a segment needs over 256 keys for that),
    and dsinks (segment None: it sums over every query) where some segment does; everywhere
    else the kernel must pass."""
    version = installed_version()
    if segment is None and check == "dsinks" and case.dtype in ("bfloat16", "float16"):
        return "known", LOW_PRECISION_SINKS_REASON
    if segment is None:
        if (check == "dsinks" and case.dtype == "float16" and version is not None
                and version <= FLOAT16_SUM_UP_TO
                and any(s.length > 256 and softmax_sums(case)[(s.row, s.number)]
                        > FLOAT16_SUM_PREDICTED for s in case.segments)):
            return "known", FLOAT16_SUM_REASON + "; dsinks, through those queries' sums"
        return "pass"
    if (case.dtype == "float16" and check in FLOAT16_SUM_CHECKS and segment.length > 256
            and version is not None and version <= FLOAT16_SUM_UP_TO
            and softmax_sums(case)[(segment.row, segment.number)] > FLOAT16_SUM_PREDICTED):
        return "known", FLOAT16_SUM_REASON
    return "pass"


# The known expectations of each path in maxtext <= 0.2.5: segment ids ignored by
# cudnn_flash_jax (its train call is plain CAUSAL), and the features each drops (DROPPED).
CUDNN_FLASH_JAX_EXPECT = drops_expectation("cudnn_flash_jax", base=known_bug_expectation)
CUDNN_FLASH_TE_EXPECT = drops_expectation("cudnn_flash_te")
FLASH_EXPECT = drops_expectation("flash")
