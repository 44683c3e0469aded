"""The leak probe: a check that needs no tolerance.

A segment's output and gradients may depend only on its own queries, keys, values and output
cotangent. So the kernel runs twice more: once with every odd-numbered segment's q, k, v and
cotangent redrawn, once with every even-numbered one's. Each segment is untouched in one of the
two runs, and there its out, dq, dk and dv must be bitwise what they were. Any change is a leak
across a boundary, however small: this catches what rounding noise can hide from the tolerance
checks (a single token's dq after thousands of keys, dk/dv of a long first segment).

It needs a kernel that is bitwise deterministic run to run; a tensor that is not (GPU backward
passes that accumulate with atomics can be) is left out of the probe, and the record says so.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from harness.cases import Case, Inputs
from harness.registry import CHECKS


@jax.jit
def _changed_tokens(a, b):
    """[B, T] bool: any value of the token differs (NaN equal to NaN, -0 equal to +0)."""
    differs = (a != b) & ~(jnp.isnan(a) & jnp.isnan(b))
    return differs.any(axis=(2, 3))


@jax.jit
def _max_change(a, b):
    return jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max(axis=(2, 3))


def perturbed(inputs: Inputs, case: Case, parity: int) -> tuple:
    """Program arguments with the segments of number % 2 == parity redrawn (padding kept)."""
    rng = np.random.default_rng([case.seed, 0x1EA4, parity])
    seg = case.segment_ids
    redraw = (seg > 0) & (seg % 2 == parity)
    arrays = []
    for x in (inputs.query, inputs.key, inputs.value, inputs.cotangent):
        fresh = rng.standard_normal(x.shape, dtype=np.float32).astype(x.dtype)
        arrays.append(np.where(redraw[:, :, None, None], fresh, x))
    q, k, v, ct = arrays
    return q, k, v, inputs.segment_ids, ct


@dataclass
class SegmentLeak:
    segment: object
    leaked: list[str]          # tensors that changed although the segment was untouched
    first_token: int | None    # first changed token, if any
    max_change: float


def probe(program, inputs: Inputs, case: Case, results) -> tuple[list[SegmentLeak], list[str]]:
    """Per segment, what changed while it was untouched; and the tensors left out because the
    kernel is not deterministic run to run."""
    names = CHECKS[:len(results)]
    args = (inputs.query, inputs.key, inputs.value, inputs.segment_ids, inputs.cotangent)
    again = program(*args)
    nondeterministic = [n for n, a, b in zip(names, results, again)
                        if bool(_changed_tokens(a, b).any())]
    probed = [i for i, n in enumerate(names) if n not in nondeterministic]
    runs = {}
    for parity in (0, 1):
        other = program(*perturbed(inputs, case, parity))
        runs[parity] = {i: (np.asarray(_changed_tokens(results[i], other[i])),
                            np.asarray(_max_change(results[i], other[i]))) for i in probed}
    leaks = []
    for seg in case.segments:
        clean = 1 - seg.number % 2  # the run in which this segment was not redrawn
        sl = (seg.row, slice(seg.start, seg.stop))
        leaked, firsts, biggest = [], [], 0.0
        for i in probed:
            changed, change = runs[clean][i]
            tokens = np.flatnonzero(changed[sl])
            if tokens.size:
                leaked.append(names[i])
                firsts.append(seg.start + int(tokens[0]))
                biggest = max(biggest, float(change[sl].max()))
        leaks.append(SegmentLeak(seg, leaked, min(firsts, default=None), biggest))
    return leaks, nondeterministic
