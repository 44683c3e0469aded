"""The script for a tolerance check's failure (out, dq, dk or dv): the inputs drawn as the
harness draws them, the checked tensor from the kernel and from a float32 dense reference, and each
segment's max abs error next to the tolerance the harness computed for it on the shrunk case."""
from __future__ import annotations

from harness.judge.judging import FLOAT32_FLOOR_FACTOR
from harness.judge.record import Record
from harness.judge.vocabulary import CHECKS, TENSORS
from harness.kernels.kernel import Kernel
from harness.tools.repro.text import ScriptParts, comment_lines, number_literal
from harness.tools.repro.trials import Trial

_REFERENCE = '''
def reference_attention(q, k, v, segment_ids, sinks=None):
    """The float32 truth: dense softmax over the tokens of the same segment (and, causal, not
    after the query; within WINDOW and CHUNK, by position in the segment), scores soft-capped
    to SOFTCAP * tanh(s / SOFTCAP), exp(sink) added to each softmax's denominator with SINKS;
    HIGHEST matmul precision; padding queries give 0."""
    hi = jax.lax.Precision.HIGHEST
    q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    group = q.shape[2] // k.shape[2]               # GQA: query head h reads kv head h // group
    k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q * SCALE, k, precision=hi)
    if SOFTCAP is not None:
        scores = SOFTCAP * jnp.tanh(scores / SOFTCAP)
    seg = np.asarray(SEGMENT_IDS)
    mask = (seg[:, :, None] == seg[:, None, :]) & (seg[:, :, None] > 0)
    t = seg.shape[1]
    if CAUSAL:
        mask &= np.tril(np.ones((t, t), bool))[None]
    pos = positions_in_segments(seg)
    if WINDOW is not None:
        left, right = WINDOW
        mask &= (pos[:, None, :] >= pos[:, :, None] - left) & (pos[:, None, :] <= pos[:, :, None] + right)
    if CHUNK is not None:
        at = pos if CHUNKS_FROM == "segment" else np.broadcast_to(np.arange(t), seg.shape)
        mask &= (at[:, :, None] // CHUNK) == (at[:, None, :] // CHUNK)
    logits = jnp.where(jnp.asarray(mask)[:, None], scores, -1e30)
    if sinks is None:
        probs = jax.nn.softmax(logits, axis=-1)
    else:
        sink = jnp.asarray(sinks, jnp.float32)[None, :, None, None]
        top = jnp.maximum(logits.max(axis=-1, keepdims=True), sink)
        e = jnp.exp(logits - top)
        probs = e / (e.sum(axis=-1, keepdims=True) + jnp.exp(sink - top))
    out = jnp.einsum("bhqk,bkhd->bqhd", probs, v, precision=hi)
    return jnp.where((segment_ids > 0)[:, :, None, None], out, 0.0)

'''

_CHECKED_OUT = '''
def checked(attention, q, k, v, segment_ids, cotangent, sinks):
    """The checked tensor: the forward output."""
    del cotangent
    return attention(q, k, v, segment_ids, sinks)
'''

_CHECKED_GRAD = '''
def checked(attention, q, k, v, segment_ids, cotangent, sinks):
    """The checked tensor: @CHECK@ of attention(q, k, v), through jax.vjp."""
    out, vjp = jax.vjp(lambda q, k, v: attention(q, k, v, segment_ids, sinks), q, k, v)
    return vjp(cotangent.astype(out.dtype))[@INDEX@]
'''

_TOLERANCE_MAIN = '''

def main():
    q, k, v, cotangent, sinks = draw_inputs()
    segment_ids = jnp.asarray(SEGMENT_IDS)
    got = jax.jit(lambda *a: checked(kernel_under_test, *a))(q, k, v, segment_ids, cotangent,
                                                             sinks)
    f32 = [x.astype(np.float32) for x in (q, k, v, cotangent)]
    want = jax.jit(lambda q, k, v, s, ct, sk: checked(reference_attention, q, k, v, s, ct, sk))(
        f32[0], f32[1], f32[2], segment_ids, f32[3], sinks)
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
          " the\\n  error of the same formula computed in the input dtype, plus a few eps of the"
          " largest value).")
    if failing:
        where = ", ".join(f"{label} (token {token}, {ratio:.3g}x the tolerance)"
                          for label, token, ratio in failing)
        print(f"@FAILED@ {CHECK} of {KERNEL_NAME} is wrong on {len(failing)} of {len(SEGMENTS)}"
              f" segments: {where}")
        return 1
    print(f"PASSED: {CHECK} of {KERNEL_NAME} is within tolerance on every segment")
    return 0
'''


def found(worst: Record) -> str:
    """The worst segment's numbers, for the script's header."""
    ratio = "inf" if worst.ratio is None else f"{worst.ratio:.3g}"
    err = "non-finite" if worst.max_abs_err is None else f"{worst.max_abs_err:.4g}"
    return (f"max abs err {err} against a tolerance of {worst.tolerance:.4g} "
            f"({ratio}x), worst at token {worst.worst_token}")


def numbers(worst: Record) -> str:
    """The worst segment's numbers, for the command's summary."""
    ratio = "inf" if worst.ratio is None else f"{worst.ratio:.3g}"
    err = "non-finite" if worst.max_abs_err is None else f"{worst.max_abs_err:.4g}"
    return f"max abs err {err}, tolerance {worst.tolerance:.4g}, ratio {ratio}"


def _segments_comment(check: str, dtype: str) -> str:
    chk = CHECKS[check]
    return "\n".join(comment_lines(
        "Per segment: row, segment number, first token, end (exclusive), then two numbers "
        f"the harness computed on this case: the tolerance it judged the segment's `{check}` "
        f"by ({chk.peer_factor:g} x the error of the same formula computed in {dtype}, "
        f"plus {chk.floor_eps:g} eps x the largest |{check}| of the case"
        + (f", x{FLOAT32_FLOOR_FACTOR:g} in float32" if dtype == "float32" else "")
        + "), and the max abs error it measured for the kernel."))


def _checked(check: str) -> str:
    """The function that computes the checked tensor: the output, or one gradient."""
    if check == "out":
        return _CHECKED_OUT
    index = [c.name for c in TENSORS].index(check) - 1
    return _CHECKED_GRAD.replace("@CHECK@", check).replace("@INDEX@", str(index))


def parts(kernel: Kernel, trial: Trial, check: str) -> ScriptParts:
    """The tolerance script's own parts, for `check` (out, dq, dk or dv) failing in `trial`."""
    del kernel  # the same script for every kernel
    case = trial.case
    rows = []
    for seg in case.segments:
        rec = trial.record(check, seg.row, seg.number)
        rows.append(f"    ({seg.row}, {seg.number}, {seg.start}, {seg.stop}, "
                    f"{number_literal(rec.tolerance)}, {number_literal(rec.max_abs_err)}),")
    return ScriptParts(
        found=found(trial.failing(check)[0]),
        method=("The script draws the case's inputs from its seed with numpy (the harness's own "
                "draw), computes the checked tensor with the kernel and with a float32 reference "
                "(dense masked softmax, HIGHEST precision), and prints each segment's max abs "
                "error next to the tolerance the harness computed for that segment on this "
                "case."),
        imports=["import sys", ""],
        segments_comment=_segments_comment(check, case.dtype),
        segment_rows=rows,
        constants=[],
        inputs_title="inputs, reference and the checked tensor",
        body=[_REFERENCE, _checked(check), _TOLERANCE_MAIN],
    )
