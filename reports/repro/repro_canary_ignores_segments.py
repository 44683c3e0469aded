#!/usr/bin/env python3
# Standalone reproduction: canary_ignores_segments fails the `out` check on a packed sequence
# (several documents per row told apart by int32 segment ids 1..M, 0 = padding).
#
# What was found, by attention-harness (`python -m harness repro canary_ignores_segments
# packed/random-b4-t256-h4kv2-d64-bf16-s0`):
#   kernel   canary_ignores_segments
#   check    out: the forward output
#   segment  r0s2 (row 0, segment 2, tokens 1..1): max abs err 0.3945 against a tolerance of
#            0.01624 (24.3x), worst at token 1
#   case     custom/rows-b1-t2-h1kv1-d1-bf16-s0-r1.1
#            (batch 1, seq_len 2, heads 1, kv heads 1, head_dim 1, bfloat16, causal, seed 0)
#   from     packed/random-b4-t256-h4kv2-d64-bf16-s0, shrunk in 11 kernel runs
#   harness  git commit 0d66e12cc80a8d6f7f6cbced521574358764b23b
#
# Run it with plain python; it needs jax and numpy:
#     python repro_canary_ignores_segments.py
# Exit status 1: the failure shows (a line starting with FAILED says where); 0: every segment
# passes (the kernel is fixed).
#
# Made with Python 3.11.7, jax 0.10.2, jaxlib 0.10.2, on cpu (cpu).
#
# The script draws the case's inputs from its seed with numpy (the harness's own draw), computes
# the checked tensor with the kernel and with a float32 reference (dense masked softmax, HIGHEST
# precision), and prints each segment's max abs error next to the tolerance the harness computed
# for that segment on this case.

import sys

import jax
import jax.numpy as jnp
import numpy as np


# ----- the kernel under test: kernel(query, key, value, segment_ids, *, causal, scale) --------
# MaxText layout: [batch, seq, heads, head_dim]; the output is shaped like the query.
import jax


def kernel(query, key, value, segment_ids, *, causal, scale, max_segments=None):
    """jax.nn.dot_product_attention (XLA) with the causal flag and no mask: the segment ids are
    ignored, so tokens attend across document boundaries and into padding (the reported bug:
    MaxText's cudnn_flash_jax called cuDNN with a causal mask only)."""
    del segment_ids, max_segments
    return jax.nn.dot_product_attention(query, key, value, scale=scale, is_causal=causal,
                                        implementation="xla")


# ----- the case (shrunk by attention-harness) ----------------------------------------------------
KERNEL_NAME = 'canary_ignores_segments'
CHECK = 'out'
CASE_ID = 'custom/rows-b1-t2-h1kv1-d1-bf16-s0-r1.1'
# int32 [batch, seq]: the segments of each row numbered 1..M, 0 = padding
SEGMENT_IDS = np.array([
    [1, 2],
], dtype=np.int32)
HEADS, KV_HEADS, HEAD_DIM = 1, 1, 1
DTYPE = 'bfloat16'
CAUSAL = True
SCALE = 1.0  # 1 / sqrt(HEAD_DIM)
SEED = 0
KERNEL_KWARGS = {}
# Per segment: row, segment number, first token, end (exclusive), then two numbers the harness
# computed on this case: the tolerance it judged the segment's `out` by (2 x the error of the same
# formula computed in bfloat16, plus 2 eps x the largest |out| of the case), and the max abs error
# it measured for the kernel.
SEGMENTS = [
    (0, 1, 0, 1, 0.0162353515625, 0.0),
    (0, 2, 1, 2, 0.0162353515625, 0.39453125),
]


# ----- inputs, reference and the checked tensor ---------------------------------------------------

def draw_inputs():
    """Standard-normal q, k, v drawn from SEED and rounded to DTYPE (the draw attention-harness
    makes for this case). Padding positions hold larger values (x8) that a correct kernel never
    reads; the output cotangent (for gradients) is zero there."""
    dtype = jnp.dtype(DTYPE)
    rng = np.random.default_rng([SEED, 0xa77e])
    batch, seq = SEGMENT_IDS.shape
    valid = (SEGMENT_IDS > 0)[:, :, None, None]

    def draw(heads):
        x = rng.standard_normal((batch, seq, heads, HEAD_DIM), dtype=np.float32)
        poison = 8.0 * rng.standard_normal(x.shape, dtype=np.float32)
        return np.where(valid, x, poison).astype(dtype)

    q, k, v = draw(HEADS), draw(KV_HEADS), draw(KV_HEADS)
    cotangent = (rng.standard_normal(q.shape, dtype=np.float32) * valid).astype(dtype)
    return q, k, v, cotangent


def kernel_under_test(q, k, v, segment_ids):
    return kernel(q, k, v, segment_ids, causal=CAUSAL, scale=SCALE, **KERNEL_KWARGS)


def reference_attention(q, k, v, segment_ids):
    """The float32 truth: dense softmax over the tokens of the same segment (and, causal, not
    after the query), HIGHEST matmul precision; padding queries give 0."""
    hi = jax.lax.Precision.HIGHEST
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]               # GQA: query head h reads kv head h // group
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q * SCALE, k, precision=hi)
    seg_q, seg_k = segment_ids[:, :, None], segment_ids[:, None, :]
    mask = (seg_q == seg_k) & (seg_q > 0)
    if CAUSAL:
        t = segment_ids.shape[1]
        mask = mask & jnp.tril(jnp.ones((t, t), bool))[None]
    probs = jax.nn.softmax(jnp.where(mask[:, None], scores, -1e30), axis=-1)
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=hi)
    return jnp.where((segment_ids > 0)[:, :, None, None], out, 0.0)


def checked(attention, q, k, v, segment_ids, cotangent):
    """The checked tensor: the forward output."""
    del cotangent
    return attention(q, k, v, segment_ids)


def main():
    q, k, v, cotangent = draw_inputs()
    segment_ids = jnp.asarray(SEGMENT_IDS)
    got = jax.jit(lambda *a: checked(kernel_under_test, *a))(q, k, v, segment_ids, cotangent)
    f32 = [x.astype(np.float32) for x in (q, k, v, cotangent)]
    want = jax.jit(lambda q, k, v, s, ct: checked(reference_attention, q, k, v, s, ct))(
        f32[0], f32[1], f32[2], segment_ids, f32[3])
    got = np.asarray(jnp.asarray(got, jnp.float32))
    want = np.asarray(want)
    # Per token: the max abs error over heads and head dims (inf where not finite).
    err = np.where(np.isfinite(got), np.abs(got - want), np.inf).max(axis=(2, 3))

    device = jax.devices()[0]
    print(f"{KERNEL_NAME}: check {CHECK} on {CASE_ID}")
    print(f"jax {jax.__version__}, {device.platform} ({device.device_kind})")
    print(f"{'segment':8s} {'tokens':>11s} {'max abs err':>12s} {'tolerance*':>11s} {'ratio':>9s}"
          f" {'harness err':>12s}  verdict")
    failing = []
    for row, number, start, stop, tolerance, harness_err in SEGMENTS:
        seg_err = err[row, start:stop]
        worst = start + int(np.argmax(seg_err))
        value = float(seg_err.max())
        ratio = value / tolerance if tolerance > 0 else float("inf")
        bad = not value <= tolerance
        if bad:
            failing.append((f"r{row}s{number}", worst, ratio))
        verdict = f"FAIL (worst token {worst})" if bad else "ok"
        tokens = f"{start}..{stop - 1}"
        print(f"{f'r{row}s{number}':8s} {tokens:>11s} {value:12.4g} {tolerance:11.4g} "
              f"{ratio:9.3g} {harness_err:12.4g}  {verdict}")
    print("* tolerance: what attention-harness allowed this segment on this case (a multiple of"
          " the\n  error of the same formula computed in the input dtype, plus a few eps of the"
          " largest value).")
    if failing:
        where = ", ".join(f"{label} (token {token}, {ratio:.3g}x the tolerance)"
                          for label, token, ratio in failing)
        print(f"FAILED: {CHECK} of {KERNEL_NAME} is wrong on {len(failing)} of {len(SEGMENTS)}"
              f" segments: {where}")
        return 1
    print(f"PASSED: {CHECK} of {KERNEL_NAME} is within tolerance on every segment")
    return 0


if __name__ == "__main__":
    sys.exit(main())
