"""The leak probe: a check that needs no tolerance.

A segment's output and gradients may depend only on its own queries, keys, values and output
cotangent. So the kernel runs again with the inputs of everything else in the row redrawn, in
three groups: every odd-numbered segment, every even-numbered one, and the padding. Each segment
is untouched in two of those runs (the other parity's, and the padding's), and there its out,
dq, dk and dv must be bitwise what they were. Any change is a leak, however small: this catches
what rounding noise hides from the tolerance checks (a single token's dq after thousands of
keys, dk/dv of a long first segment), and valid queries that read padding keys.

Bitwise comparisons need a reproducible kernel. The probe runs the kernel's deterministic build
(harness.programs) and first checks, on valid tokens only (padding outputs of packed kernels
are undefined), that two reruns on the same inputs reproduce every tensor. A tensor that still
differs run to run cannot be probed: it is listed as unprobed in the record, never dropped.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from harness.cases import Case, Inputs
from harness.judging import TENSORS
from harness.layouts import Segment

RERUNS = 2


@jax.jit
def _changed_tokens(a, b):
    """[B, T] bool: any value of the token differs (NaN equal to NaN, -0 equal to +0)."""
    differs = (a != b) & ~(jnp.isnan(a) & jnp.isnan(b))
    return differs.any(axis=(2, 3))


@jax.jit
def _max_change(a, b):
    return jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)).max(axis=(2, 3))


def groups(case: Case) -> list[tuple[str, np.ndarray]]:
    """(name, [B, T] bool tokens to redraw) for each perturbation."""
    seg = case.segment_ids
    out = [("odd segments", (seg > 0) & (seg % 2 == 1)),
           ("even segments", (seg > 0) & (seg % 2 == 0))]
    if (seg == 0).any():
        out.append(("padding", seg == 0))
    return [(name, mask) for name, mask in out if mask.any()]


def perturbed(inputs: Inputs, case: Case, index: int, redraw: np.ndarray) -> tuple:
    """Program arguments with the `redraw` tokens' q, k, v and cotangent drawn afresh."""
    rng = np.random.default_rng([case.seed, 0x1EA4, index])
    arrays = []
    for x in (inputs.query, inputs.key, inputs.value, inputs.cotangent):
        fresh = rng.standard_normal(x.shape, dtype=np.float32).astype(x.dtype)
        if x is inputs.cotangent:
            fresh = np.where((case.segment_ids > 0)[:, :, None, None], fresh, 0).astype(x.dtype)
        arrays.append(np.where(redraw[:, :, None, None], fresh, x))
    q, k, v, ct = arrays
    return q, k, v, inputs.segment_ids, ct


@dataclass
class SegmentLeak:
    segment: Segment
    leaked: list[str]          # tensors that changed although the segment was untouched
    first_token: int | None    # first changed token, if any
    max_change: float
    by: list[str] = field(default_factory=list)  # the redrawn groups that moved it


@dataclass
class ProbeResult:
    leaks: list[SegmentLeak]
    probed: list[str]          # tensors compared bitwise
    unprobed: list[str]        # tensors that differ run to run on valid tokens: not probed


def probe(program, inputs: Inputs, case: Case, first=None) -> ProbeResult:
    """Runs `program` (the kernel's build for the probe) on the case and its perturbations.
    `first`: this program's results on the unchanged inputs, if already computed."""
    args = inputs.args
    base = first if first is not None else program(*args)
    names = [c.name for c in TENSORS[:len(base)]]
    valid = np.asarray(case.segment_ids > 0)
    unstable = set()
    for _ in range(RERUNS):
        again = program(*args)
        for name, a, b in zip(names, base, again):
            if (np.asarray(_changed_tokens(a, b)) & valid).any():
                unstable.add(name)
    probed = [i for i, n in enumerate(names) if n not in unstable]
    runs = []
    for index, (group, redraw) in enumerate(groups(case)):
        other = program(*perturbed(inputs, case, index, redraw))
        runs.append((group, redraw, {i: (np.asarray(_changed_tokens(base[i], other[i])),
                                         np.asarray(_max_change(base[i], other[i])))
                                     for i in probed}))
    leaks = []
    for seg in case.segments:
        sl = (seg.row, slice(seg.start, seg.stop))
        leaked, firsts, biggest, by = set(), [], 0.0, []
        for group, redraw, changes in runs:
            if redraw[sl].any():
                continue  # this segment was redrawn in that run
            moved = False
            for i in probed:
                changed, change = changes[i]
                tokens = np.flatnonzero(changed[sl])
                if tokens.size:
                    moved = True
                    leaked.add(names[i])
                    firsts.append(seg.start + int(tokens[0]))
                    biggest = max(biggest, float(change[sl].max()))
            if moved:
                by.append(group)
        leaks.append(SegmentLeak(seg, [n for n in names if n in leaked], min(firsts, default=None),
                                 biggest, by))
    return ProbeResult(leaks, [names[i] for i in probed], [n for n in names if n in unstable])
