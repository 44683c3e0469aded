"""Per-token and per-segment error metrics: how far a kernel's tensor lands from the truth; and
what it wrote at padding positions (padding_violations: the padding check's measurement)."""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from harness.ahead import ahead
from harness.judge import vocabulary as v
from harness.model.layouts import Segment


def _token_errors(x, ref):
    x = x.astype(jnp.float32)
    finite = jnp.isfinite(x)
    diff = jnp.abs(x - ref)
    return (jnp.where(finite, diff, jnp.inf).max(axis=(2, 3)),
            jnp.where(finite, diff, 0.0).sum(axis=(2, 3)),
            (~finite).sum(axis=(2, 3)))


@ahead
def stacked_token_errors(results, truth):
    return jnp.stack([jnp.stack([m, s, n.astype(jnp.float32)])
                      for m, s, n in (_token_errors(x, ref) for x, ref in zip(results, truth))])


def token_errors(results, truth) -> tuple:
    """For each tensor of `results` against `truth` (tuples), per token ([B, T], numpy): max
    abs error (inf where non-finite), summed abs error, and the count of non-finite values,
    over heads and head dims. One program and one transfer for all: the run waits on the
    device once, not once per array."""
    return read_token_errors(stacked_token_errors(results, truth))


def read_token_errors(stacked) -> tuple:
    """token_errors of stacked_token_errors' result, launched before (the run waits for it
    here, not where it launched it)."""
    return tuple((m, s, n.astype(np.int64)) for m, s, n in np.asarray(jax.device_get(stacked)))


@ahead
def scales(tensors, segment_ids):
    """Max |x| over valid tokens, for each tensor (stacked, float32: one transfer)."""
    valid = (segment_ids > 0)[:, :, None, None]
    return jnp.stack([jnp.where(valid, jnp.abs(t), 0).max().astype(jnp.float32)
                      for t in tensors])


@dataclass(frozen=True)
class SegmentError:
    max_abs_err: float        # inf where the kernel produced non-finite values
    mean_abs_err: float
    worst_token: int          # position in the row
    nonfinite: int
    peer_err: float           # the same-dtype peer's max abs error over the segment


def segment_error(errors, peer_token_err: np.ndarray, seg: Segment,
                  elements_per_token: int) -> SegmentError:
    """One segment's metrics from a tensor's per-token errors (numpy, from token_errors)."""
    tok_max, tok_sum, tok_bad = errors
    sl = (seg.row, slice(seg.start, seg.stop))
    seg_err = tok_max[sl]
    worst = int(np.argmax(seg_err))
    return SegmentError(
        max_abs_err=float(seg_err[worst]),
        mean_abs_err=float(tok_sum[sl].sum()) / (seg.length * elements_per_token),
        worst_token=seg.start + worst,
        nonfinite=int(tok_bad[sl].sum()),
        peer_err=float(peer_token_err[sl].max()))


# The tensors the kernel's padding-output convention covers: the output and its tangent.
OUTPUT_LIKE = (v.OUT.name, v.JVP.name)


# How far past the truth's largest |out| over valid tokens a finite output at padding may go:
# attention's output is a weighting of value rows, whatever a padding query reads, so a sane
# kernel stays within the values' range; an adversarial review's kernel wrote the dtype's
# largest finite number there (finite: green), which the next residual add makes inf and a
# zero cotangent times inf makes NaN in the weight gradients.
PADDING_OUTPUT_BOUND = 1000.0


def padding_violations(errors_by_tensor: dict, row: int, pad: np.ndarray, convention: str,
                       scales: dict | None = None) -> dict:
    """tensor -> {"kind", "count", "first", "max"} at a row's padding positions `pad` (bool
    [T]) from per-token errors against a truth that is zero there (harness.judge.oracle):
    gradients must be exactly zero, the output and its tangent (jvp) finite (and zero under
    the zero convention; not looked at where the kernel declares them undefined), the output
    within PADDING_OUTPUT_BOUND times `scales["out"]` (the truth's largest |out|, if given)."""
    found = {}
    positions = np.flatnonzero(pad)
    for name, (tok_max, _, tok_bad) in errors_by_tensor.items():
        output_like = name in OUTPUT_LIKE
        if output_like and convention == v.PAD_UNDEFINED:
            continue
        bad = tok_bad[row, positions] > 0
        if bad.any():
            found[name] = dict(kind="non-finite", count=int(bad.sum()),
                               first=int(positions[bad][0]), max=None)
            continue
        must_be_zero = not output_like or convention == v.PAD_ZERO
        size = tok_max[row, positions]
        if must_be_zero and (size > 0).any():
            nz = size > 0
            found[name] = dict(kind="non-zero", count=int(nz.sum()), first=int(positions[nz][0]),
                               max=float(f"{size.max():.3g}"))
        elif name == v.OUT.name and (scales or {}).get(name) is not None:
            big = size > PADDING_OUTPUT_BOUND * scales[name]
            if big.any():
                found[name] = dict(kind=f"beyond {PADDING_OUTPUT_BOUND:g}x the largest valid "
                                   "|out| of the reference", count=int(big.sum()),
                                   first=int(positions[big][0]), max=float(f"{size.max():.3g}"))
    return found
