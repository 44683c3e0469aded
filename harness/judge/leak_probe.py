"""The leak probe: a check that needs no tolerance.

A segment's output and gradients may depend only on its own queries, keys, values and output
cotangent. So the kernel runs again with the inputs of everything else redrawn, in three groups:
the segments of one colour of a checkerboard (segment number + row), those of the other colour,
and the padding. Each segment is untouched in two of those runs (the other colour's, and the
padding's), and there its out, dq, dk and dv must be bitwise what they were. A segment that no
run leaves untouched (alone in a batch without padding) was not compared, and says so. Any change is a leak, however small: this catches
what rounding noise hides from the tolerance checks (a single token's dq after thousands of
keys, dk/dv of a long first segment), and valid queries that read padding keys.

Bitwise comparisons need a reproducible kernel. The probe runs the kernel's deterministic build
(harness.engine.programs) and first checks, on valid tokens only (padding outputs of packed kernels
are undefined), that two reruns on the same inputs reproduce every tensor. A tensor that still
differs run to run (some of TE's backward passes even with its deterministic setting) is probed
above its noise: a token counts as changed only where the change exceeds NOISE_FACTOR times the
largest run-to-run difference seen on the valid tokens, in two runs of each perturbation. A
leak moves values by O(1) of their scale, run-to-run noise by a few roundings. Where the noise
itself is a sizeable part of the tensor's scale (POWERLESS), the tensor cannot be probed: it is
listed as unprobed in the record, never dropped. Every record names its gated tensors and their
thresholds.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from harness.model.case import Case, Inputs, make_inputs
from harness.judge.judging import TENSORS
from harness.model.layouts import Segment
from harness.judge.metrics import scales

RERUNS = 2
# Mixed into a case's seed for the perturbations (standalone repro scripts draw the same).
PERTURB_SALT = 0x1EA4
# Where only a kernel's default (not deterministic by construction) build can be probed.
RERUNS_UNCERTAIN = 6
# A tensor that differs run to run: changes above this many times its largest run-to-run
# difference count, in both of two runs; none at all when that difference is this large a
# part of the tensor's largest value.
NOISE_FACTOR = 8.0
POWERLESS = 0.01


@jax.jit
def _stacked_changes(base, other):
    def one(a, b):
        differs = (a != b) & ~(jnp.isnan(a) & jnp.isnan(b))
        # NaN against NaN is no change; NaN against a number is an infinite one (so that it
        # counts above any noise threshold, and as noise makes a tensor unprobed).
        change = jnp.where(differs, jnp.nan_to_num(
            jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)), nan=jnp.inf), 0.0)
        return jnp.stack([differs.any(axis=(2, 3)).astype(jnp.float32), change.max(axis=(2, 3))])
    return jnp.stack([one(a, b) for a, b in zip(base, other)])


def _changes(base, other) -> list:
    """For each tensor (numpy): [B, T] bool, any value of the token differs (NaN equal to NaN,
    -0 equal to +0); and [B, T] the largest change. One transfer for all tensors."""
    stacked = np.asarray(jax.device_get(_stacked_changes(base, other)))
    return [(d > 0, c) for d, c in stacked]


def groups(case: Case) -> list[tuple[str, np.ndarray]]:
    """(name, [B, T] bool tokens to redraw) for each perturbation. Segments alternate like a
    checkerboard (segment number + row): neighbours in a row fall in different groups, and so do
    the single segments of consecutive unpacked rows, so that a segment alone in its row is
    still compared while the other rows are redrawn (a leak across the batch)."""
    seg = case.segment_ids
    parity = (seg + np.arange(seg.shape[0])[:, None]) % 2
    out = [("segments of one colour", (seg > 0) & (parity == 1)),
           ("segments of the other colour", (seg > 0) & (parity == 0))]
    if (seg == 0).any():
        out.append(("padding", seg == 0))
    return [(name, mask) for name, mask in out if mask.any()]


@functools.lru_cache(maxsize=24)
def perturbed_host(case: Case, index: int) -> tuple:
    """(q, k, v, cotangent) in numpy with group `index`'s tokens drawn afresh (only those are
    drawn: the groups together cost one draw of the inputs). Cached for the runs ahead, which
    draw them in background threads."""
    inputs = make_inputs(case)
    redraw = groups(case)[index][1]
    rng = np.random.default_rng([case.seed, PERTURB_SALT, index])
    valid = (case.segment_ids > 0)[redraw][:, None, None]
    arrays = []
    for x in (inputs.query, inputs.key, inputs.value, inputs.cotangent):
        fresh = rng.standard_normal((int(redraw.sum()), *x.shape[2:]), dtype=np.float32)
        if x is inputs.cotangent:
            fresh = np.where(valid, fresh, 0)  # the cotangent stays zero at padding
        y = x.copy()
        y[redraw] = fresh.astype(x.dtype)
        arrays.append(y)
    return tuple(arrays)


@functools.lru_cache(maxsize=4)
def perturbed(case: Case, index: int) -> tuple:
    """Program arguments (on the device) with group `index`'s q, k, v and cotangent drawn
    afresh; the same for every kernel run on the case."""
    q, k, v, ct = (jax.device_put(a) for a in perturbed_host(case, index))
    return q, k, v, make_inputs(case).device_args[3], ct


def draw_ahead(case: Case) -> None:
    """Everything the probe will draw for `case` (host arrays), for a background thread."""
    for index in range(len(groups(case))):
        perturbed_host(case, index)


@dataclass
class SegmentLeak:
    segment: Segment
    leaked: list[str]          # tensors that changed although the segment was untouched
    first_token: int | None    # first changed token, if any
    max_change: float
    by: list[str] = field(default_factory=list)  # the redrawn groups that moved it
    compared: bool = True      # some run left the segment untouched (else nothing was compared)


@dataclass
class ProbeResult:
    leaks: list[SegmentLeak]
    probed: list[str]          # tensors compared: bitwise, or above their noise (gated)
    unprobed: list[str]        # tensors whose run-to-run noise leaves nothing to compare
    gated: dict[str, float] = field(default_factory=dict)  # tensor -> change that counts


def probe(program, inputs: Inputs, case: Case, first=None, reruns: int = RERUNS,
          confirm: bool = False) -> ProbeResult:
    """Runs `program` (the kernel's build for the probe) on the case and its perturbations.
    `first`: this program's results on the unchanged inputs, if already computed.

    A build that is not deterministic by construction (the default build of a GPU kernel whose
    deterministic build could not run) may reproduce a tensor in a few reruns by chance and
    differ in the next run: there `reruns` is raised and `confirm` runs each perturbation twice,
    a token counting as changed only where both runs changed it (noise that slipped past the
    reruns does not land on the same token twice; a leak does). Gated tensors are always
    confirmed that way."""
    args = inputs.device_args
    base = first if first is not None else program(*args)
    names = [c.name for c in TENSORS[:len(base)]]
    valid = np.asarray(case.segment_ids > 0)
    noise = dict.fromkeys(names, 0.0)
    for _ in range(reruns):
        changes = _changes(base, program(*args))
        for name, (_, change) in zip(names, changes):
            if valid.any():
                noise[name] = max(noise[name], float(change[valid].max()))
    scale = dict(zip(names, np.asarray(jax.device_get(scales(base, args[3]))).tolist()))
    gated = {n: NOISE_FACTOR * noise[n] for n in names
             if noise[n] > 0 and noise[n] < POWERLESS * scale[n]}
    unprobed = [n for n in names if noise[n] > 0 and n not in gated]
    probed = [i for i, n in enumerate(names) if n not in unprobed]
    threshold = [gated.get(n) for n in names]

    def changed(changes):
        """[B, T] bool per probed tensor: bitwise, or above the tensor's threshold."""
        return {i: ((changes[i][1] > threshold[i]) if threshold[i] is not None
                    else changes[i][0], changes[i][1]) for i in probed}

    runs = []
    for index, (group, redraw) in enumerate(groups(case)):
        found = changed(_changes(base, program(*perturbed(case, index))))
        if confirm or gated:
            again = changed(_changes(base, program(*perturbed(case, index))))
            found = {i: (c1 & again[i][0], np.maximum(m1, again[i][1]))
                     for i, (c1, m1) in found.items()}
        runs.append((group, redraw, found))
    leaks = []
    for seg in case.segments:
        sl = (seg.row, slice(seg.start, seg.stop))
        leaked, firsts, biggest, by, compared = set(), [], 0.0, [], False
        for group, redraw, changes in runs:
            if redraw[sl].any():
                continue  # this segment was redrawn in that run
            compared = True
            moved = False
            for i in probed:
                flags, change = changes[i]
                tokens = np.flatnonzero(flags[sl])
                if tokens.size:
                    moved = True
                    leaked.add(names[i])
                    firsts.append(seg.start + int(tokens[0]))
                    biggest = max(biggest, float(change[sl].max()))
            if moved:
                by.append(group)
        leaks.append(SegmentLeak(seg, [n for n in names if n in leaked], min(firsts, default=None),
                                 biggest, by, compared))
    return ProbeResult(leaks, [names[i] for i in probed], unprobed, gated)
