"""The leak probe: a check that needs no tolerance.

A segment's output and gradients may depend only on its own queries, keys, values and output
cotangent. So the kernel runs again with the inputs of everything else redrawn, in groups: the
segments by colour (segment number + the row's offset modulo two, like a checkerboard; where a row holds
three segments or more, modulo six in four groups, so that reads up to five segments away are
seen too), and the padding (the masks: harness.judge.probe_groups). Each segment is untouched
in the other colours' runs and the padding's, and there its out, dq, dk and dv must be bitwise
what they were. A segment that no run leaves untouched (alone in a batch without padding) was
not compared, and says so. Any change is a leak, however small: this catches what rounding
noise hides from the tolerance checks (a single token's dq after thousands of keys, dk/dv of a
long first segment), and valid queries that read padding keys. A segment whose own values are non-finite cannot be compared
(NaN equals NaN): never a pass.

Bitwise comparisons need a reproducible kernel. The probe runs the kernel's deterministic build
(harness.engine.programs), each group's perturbation first, every tensor compared bitwise. Where
one moved a segment's token that must not move, reruns on the same inputs check, on valid
tokens only (padding outputs of packed kernels are undefined), that the kernel reproduces every
tensor: a moved token of a tensor that reproduces is a leak. Where nothing moved and each valid
token was compared in some run, the probe is done: no rerun could make a token count, and each
token reproduced bitwise in the runs that compared it.

Tensors that are not reproducible (some of TE's backward passes even with its deterministic
setting; kernels that accumulate dq with atomics and declare `reproducible=False`, and the
gradients of a GPU kernel's default build probed where its deterministic build cannot run:
neither is ever trusted on a bitwise rerun) are decided statistically, on a change that is
systematic:
- noise (harness.judge.noise): RERUNS_NOISY reruns of the unchanged inputs give every token's
  run-to-run difference; the threshold is NOISE_FACTOR times the largest (at least
  NOISE_FLOOR_ULPS roundings of the tensor's largest value), raised until the false-alarm
  probability below fits its budget;
- amplified: those tensors are probed on perturbations whose redrawn values and cotangents are
  amplitude() times larger (64; 16 in float16). A leak is linear in what leaks in (another
  segment's values reach an output through p @ v, its cotangent reaches dk and dv through
  p^T @ dO), so it grows that much while the noise, the unchanged segment's own rounding, does
  not;
- confirmed: a token counts as changed only where both of two runs of each perturbation moved it
  past the threshold (the second run is made where the first moved a token that must not
  move: elsewhere it could not make one count). A tensor compared bitwise that the two runs
  set apart is listed as `unsteady`: not reproducible, though its reruns agreed.
The false-alarm probability is computed, not assumed: the tail of the pooled run-to-run
differences is fitted with an exponential (above its 99th percentile; rounding noise, a sum of
many roundings, has a lighter tail than that), which gives the chance that one run's noise at a
token passes the threshold; squared for the confirming run, summed over the tokens and runs.
Each leak record carries it (`false_alarm`) and, per tensor, the smallest leak the probe could
have seen as a fraction of the tensor's largest value (`detectable`: threshold / (amplitude *
scale); zero for a tensor compared bitwise). A tensor whose noise is over POWERLESS of its
scale is unprobed: listed in the record, never dropped.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from harness.ahead import ahead
from harness.judge.metrics import scales
from harness.judge.noise import POWERLESS, Noise, gated_thresholds, rerun_noise
from harness.judge.probe_groups import TENSOR_CLASS, covered, kept_per_group, shared_groups
from harness.judge.probe_runs import all_changes, launch_first, nonfinite_tokens
from harness.judge.vocabulary import TENSORS
from harness.model.case import Case, Inputs, device_seed, make_inputs, normals
from harness.model.layouts import Segment

RERUNS = 2
# Reruns where a tensor is (or is declared) not reproducible: the noise estimate's sample.
RERUNS_NOISY = 4
# Mixed into a case's seed for the perturbations (standalone repro scripts draw the same).
PERTURB_SALT = 0x1EA4
# Where only a kernel's default (not deterministic by construction) build can be probed.
RERUNS_UNCERTAIN = 6


def amplitude(dtype: str) -> float:
    """How much larger the amplified perturbation's values and cotangent are: 64, or 16 in
    float16, whose range (65504) a 64-fold value times a 64-fold cotangent could leave."""
    return 16.0 if dtype == "float16" else 64.0


@ahead
def redrawn(seed, index, amplitude, q, k, v, cotangent, redraw, valid):
    """q, k, v and the cotangent with the `redraw` tokens drawn afresh, on the device: standard
    normal from the key of (seed, PERTURB_SALT, index), the values and the cotangent
    `amplitude` times larger, the cotangent zero at padding; every other token's bitwise as
    given. (Drawn on the host, the perturbations of the H200 nightly cost its worker 48 s of
    its 125 on the run's thread: numpy's normal draws; here they cost the device microseconds.)
    One draw for the four (harness.model.case.normals)."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), PERTURB_SALT), index)
    xs = (q, k, v, cotangent)
    out = []
    for i, (x, fresh) in enumerate(zip(xs, normals(key, [x.shape for x in xs]))):
        if i >= 2:   # the values and the cotangent
            fresh = fresh * amplitude
        if i == 3:   # the cotangent stays zero at padding
            fresh = jnp.where(valid[:, :, None, None], fresh, 0.0)
        out.append(jnp.where(redraw[:, :, None, None], fresh.astype(x.dtype), x))
    return tuple(out)


class _OnDevice:
    """The probe's program arguments on the device, for the case the run is on: each group's
    is drawn once per case, not once per kernel (every kernel on the case probes every group;
    a nightly case's group is tens of MB, a long row's hundreds). The run lets them go once a
    case's kernels are done (runner.run_matrix); a call for another case lets the previous
    case's go too."""

    def __init__(self):
        self._case = None
        self._args: dict = {}

    def __call__(self, case: Case, index: int, amplitude: float = 1.0,
                 convention: str = "segment") -> tuple:
        """Program arguments (on the device) with group `index`'s q, k, v and cotangent drawn
        afresh (the sinks, shared by every token, stay); the same for every kernel run on the
        case."""
        if case != self._case:
            self.cache_clear()
            self._case = case
        key = (index, amplitude, convention)
        if key not in self._args:
            fixed = make_inputs(case).device_args
            redraw = shared_groups(case, convention)[index][1]
            q, k, v, ct = redrawn(device_seed(case), np.int32(index),
                                  np.float32(amplitude), *fixed[:3], fixed[-1], redraw,
                                  case.segment_ids > 0)
            self._args[key] = (q, k, v, *fixed[3:-1], ct)
        return self._args[key]

    def cache_clear(self) -> None:
        """Let the device arrays go (a program that needs the memory, a case done)."""
        self._case, self._args = None, {}


perturbed = _OnDevice()


@dataclass
class SegmentLeak:
    segment: Segment
    leaked: list[str]          # tensors that changed although the segment was untouched
    first_token: int | None    # first changed token, if any
    max_change: float
    by: list[str] = field(default_factory=list)  # the redrawn groups that moved it
    compared: bool = True      # some run left the segment untouched (else nothing was compared)
    nonfinite: list[str] = field(default_factory=list)  # tensors non-finite on the segment
    # Tensor -> largest change between reruns of the unchanged inputs on the segment (where
    # reruns ran: judging.reruns_within_tolerance).
    rerun_change: dict = field(default_factory=dict)
    # Tensors no run compared on this segment though it compared others: a causal segment
    # alone in its batch, whose keys' dk and dv depend on every later query, so each causal
    # tail run touches them all (probe_groups.causal_tails). Not probed here, and said so.
    uncompared: list[str] = field(default_factory=list)

    def tensors(self, found) -> dict:
        """The segment's record's probed and unprobed tensors: the probe's (a ProbeResult),
        less those it did not compare here."""
        return {"probed": [t for t in found.probed if t not in self.uncompared],
                "unprobed": found.unprobed + [t for t in self.uncompared
                                              if t not in found.unprobed]}


@dataclass
class ProbeResult:
    leaks: list[SegmentLeak]
    probed: list[str]          # tensors compared: bitwise, or above their noise (gated)
    unprobed: list[str]        # tensors whose run-to-run noise leaves nothing to compare
    gated: dict[str, float] = field(default_factory=dict)  # tensor -> change that counts
    detectable: dict[str, float] = field(default_factory=dict)  # tensor -> leak / scale
    false_alarm: float = 0.0   # probability that noise alone made some token count as changed
    # Gated tensors whose reruns showed no noise at all (a build not reproducible by
    # construction): their threshold is the floor, and no false-alarm rate can be measured
    # for them (`false_alarm` counts only the tensors whose noise was seen).
    quiet: list[str] = field(default_factory=list)
    # Tensors compared bitwise that two runs of one perturbation gave apart on a valid token:
    # not reproducible, though the reruns agreed (rare noise; a change counts only where both
    # runs made it).
    unsteady: list[str] = field(default_factory=list)


def _perturbation_runs(case, index, plain, amplified, convention="segment"):
    """The arguments of one run of a redrawn group's perturbations: the plain one where
    `plain` (for the bitwise tensors), then the amplified one where `amplified` (the gated)."""
    return ([perturbed(case, index, 1.0, convention)] if plain else []) + \
        ([perturbed(case, index, amplitude(case.dtype), convention)] if amplified else [])


def _perturbation(changes, bitwise, thresholds, names) -> dict:
    """tensor index -> ([B, T] bool changed, [B, T] largest change) for one run of a redrawn
    group's perturbations (_perturbation_runs, in order): the bitwise tensors on the plain
    one, the gated ones above their threshold on the amplified one."""
    changes, found = list(changes), {}
    if bitwise:
        found, changes = {i: changes[0][i] for i in bitwise}, changes[1:]
    for name, limit in thresholds.items():   # on the amplified run, the one left
        i = names.index(name)
        found[i] = (changes[0][i][1] > limit, changes[0][i][1])
    return found


def _both(first: dict, second: dict) -> dict:
    """The tensors of `second` changed only where both runs changed them (the largest change
    of the two); the others as `first` has them."""
    return {i: (c & second[i][0], np.maximum(m, second[i][1])) if i in second else (c, m)
            for i, (c, m) in first.items()}


def _moves_kept(found: dict, kept: dict, names: list[str], indices, valid) -> bool:
    """Whether one of these tensors changed on a token of a segment none of whose dependencies
    was redrawn (the tokens _segment_leaks reads; padding outputs may be undefined)."""
    return any((found[i][0] & kept[TENSOR_CLASS[names[i]]] & valid).any() for i in indices)


def _run_groups(program, base, case, plans, bitwise, thresholds, names, convention,
                launched=None) -> list:
    """_perturbation's changes for each plan (group index, plain, amplified): its runs launched
    together (probe_runs.all_changes; `launched`: the first of them, launched already)."""
    runs = [_perturbation_runs(case, g, p, a, convention) for g, p, a in plans]
    changes = iter(all_changes(program, base, [x for r in runs for x in r], launched))
    return [_perturbation([next(changes) for _ in r], bitwise if p else [],
                          thresholds if a else {}, names) for r, (_, p, a) in zip(runs, plans)]


def _group_changes(program, base, case, groups_, bitwise, thresholds, names, confirm,
                   convention="segment", plain=None) -> tuple[list[dict], list[str]]:
    """Per redrawn group, _perturbation's changes: one run of each perturbation (`plain`: the
    plain runs' changes, already made); then, of each perturbation that moved a segment's token
    that must not move, a second run (the amplified one always, the plain one where
    `confirm`), a token counting only where both moved it. Elsewhere no second run could make
    one count (_segment_leaks reads no other token); made on every pair, second runs doubled
    the plain perturbations' runs on GPUs. And the bitwise tensors two runs of one
    perturbation gave apart (`unsteady`)."""
    def run(plans):
        return _run_groups(program, base, case, plans, bitwise, thresholds, names, convention)
    if plain is None:
        found = run([(g, bool(bitwise), bool(thresholds)) for g in range(len(groups_))])
    else:
        amplified = run([(g, False, True) for g in range(len(groups_))]) if thresholds \
            else [{} for _ in groups_]
        found = [{**{i: p[i] for i in bitwise}, **a} for p, a in zip(plain, amplified)]
    still, valid = kept_per_group(case, convention), case.segment_ids > 0
    gated = [names.index(n) for n in thresholds]
    again = [(g, confirm and _moves_kept(f, still[g], names, bitwise, valid),
              _moves_kept(f, still[g], names, gated, valid)) for g, f in enumerate(found)]
    again = [plan for plan in again if plan[1] or plan[2]]
    unsteady = set()
    for (g, plain_again, _), second in zip(again, run(again)):
        if plain_again:   # the same inputs twice: a valid token one run moved, the other not
            unsteady.update(names[i] for i in bitwise
                            if (valid & (found[g][i][0] != second[i][0])).any())
        found[g] = _both(found[g], second)
    return found, sorted(unsteady, key=names.index)


def _segment_leaks(case: Case, runs: list, names: list[str], nonfinite: np.ndarray,
                   convention: str = "segment") -> list[SegmentLeak]:
    """Per segment: in each run, the tokens none of whose dependencies was redrawn must not
    have moved (for a case without window or chunks: every token of a segment not redrawn)."""
    still = kept_per_group(case, convention)
    leaks = []
    for seg in case.segments:
        sl = (seg.row, slice(seg.start, seg.stop))
        leaked, firsts, biggest, by, classes = set(), [], 0.0, [], set()
        for (group, _, changes), must in zip(runs, still):
            kept_here = {c for c, m in must.items() if m[sl].any()}
            if not kept_here:
                continue  # no token of this segment was left untouched in that run
            classes |= kept_here
            moved = False
            for i, (flags, change) in changes.items():
                kept = must[TENSOR_CLASS[names[i]]][sl]
                tokens = np.flatnonzero(flags[sl] & kept)
                if tokens.size:
                    moved = True
                    leaked.add(names[i])
                    firsts.append(seg.start + int(tokens[0]))
                    biggest = max(biggest, float(np.where(kept, change[sl], 0).max()))
            if moved:
                by.append(group)
        bad = [n for i, n in enumerate(names) if nonfinite[i][sl].any()]
        leaks.append(SegmentLeak(seg, [n for n in names if n in leaked], min(firsts, default=None),
                                 biggest, by, bool(classes), bad, uncompared=[
                                     n for n in names if classes
                                     and TENSOR_CLASS[n] not in classes]))
    return leaks


def launch_plain(program, base, case: Case, reproducible: bool | None = None,
                 convention: str = "segment") -> list | None:
    """probe's first plain perturbation runs (compared with `base`, the unchanged inputs'
    results), launched and not waited for: probe's `launched`. None where it makes none."""
    groups_ = range(len(shared_groups(case, convention)))
    return None if reproducible is False else launch_first(
        program, base[:len(TENSORS)], [perturbed(case, g, 1.0, convention) for g in groups_])


def probe(program, inputs: Inputs, case: Case, first=None, reruns: int = RERUNS,
          confirm: bool = False, reproducible: bool | None = None,
          convention: str = "segment", launched: list | None = None) -> ProbeResult:
    """Runs `program` (the kernel's build for the probe) on the case and its perturbations.
    `first`: this program's results on the unchanged inputs, if already computed; `launched`:
    launch_plain's runs with the same arguments.

    `confirm` runs a perturbation twice, a token counting as changed only where both runs
    changed it (the second run where the first changed a token that must not move): rare
    noise that the reruns missed seldom lands on the same token twice, a leak does.
    Seldom is not never (on the H200 a default build's dq reproduced in 6 reruns, then
    changed one token by 1 ulp in both runs of a perturbation), so `reproducible=False` (the
    kernel declares its backward not reproducible, or the build is a GPU default build
    standing in for a deterministic one that cannot run) decides the gradients statistically
    (above their noise, amplified, confirmed) even where the reruns happened to agree; those
    whose reruns agreed are listed in `quiet`: their threshold is the floor, and their
    false-alarm probability cannot be measured. `convention`: where the kernel's chunks start
    (harness.model.features)."""
    # out, dq, dk, dv: a sink's gradient depends on every token (all_changes compares those)
    args = inputs.device_args
    base = (first if first is not None else program(*args))[:len(TENSORS)]
    names = [c.name for c in TENSORS[:len(base)]]
    valid = np.asarray(case.segment_ids > 0)
    noisy = reproducible is False
    groups_ = shared_groups(case, convention)
    nonfinite, plain = nonfinite_tokens(base), None
    everything = list(range(len(names)))
    if not noisy:
        # Each group's plain perturbation first, every tensor compared bitwise. Where none
        # moved a segment's token that must not move, and each valid token was one of those in
        # some run, the probe is done: every token reproduced bitwise where it was compared,
        # and reruns, which tell noise from a leak, have neither to tell apart (they were
        # RERUNS runs on every pair).
        plain = _run_groups(program, base, case, [(g, True, False) for g in range(len(groups_))],
                            everything, {}, names, convention, launched)
        still = kept_per_group(case, convention)
        if covered(case, convention) and not any(
                _moves_kept(f, kept, names, everything, valid) for f, kept in zip(plain, still)):
            return _result(case, names, plain, groups_, {}, {}, [], nonfinite, convention)
    # Launched now, read after the reruns: not each a wait for a program launched just before.
    scaled = scales(base, args[3])
    noise = rerun_noise(program, args, base, names, valid,
                        max(reruns, RERUNS_NOISY if noisy else 0))
    if not noisy and reruns < RERUNS_NOISY and any(n.largest > 0 for n in noise.values()):
        more = rerun_noise(program, args, base, names, valid, RERUNS_NOISY - reruns)
        noise = {n: Noise(max(noise[n].largest, more[n].largest),
                          np.maximum(noise[n].sample, more[n].sample)) for n in names}
    scale = dict(zip(names, np.asarray(jax.device_get(scaled)).tolist()))
    candidates = [n for n in names if noise[n].largest > 0 or (noisy and n != TENSORS[0].name)]
    unprobed = [n for n in candidates if noise[n].largest >= POWERLESS * scale[n]]
    limits = gated_thresholds(noise, [n for n in candidates if n not in unprobed], scale,
                              case.dtype, int(valid.sum()), len(groups_))
    bitwise = [i for i, n in enumerate(names) if n not in candidates]
    found, unsteady = _group_changes(program, base, case, groups_, bitwise, limits, names,
                                     confirm, convention, plain)
    return _result(case, names, found, groups_, noise, limits, unprobed, nonfinite, convention,
                   scale, unsteady, {n: _on_tokens(noise[n].sample, valid) for n in names})


def _on_tokens(sample: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """A per-valid-token sample (harness.judge.noise) laid out on the [B, T] tokens."""
    full = np.zeros(valid.shape, np.float32)
    full[valid] = sample
    return full


def _result(case, names, found, groups_, noise, limits, unprobed, nonfinite, convention,
            scale=None, unsteady=(), rerun_change=None) -> ProbeResult:
    """The ProbeResult of the groups' changes (`found`) and the gated tensors' `limits`."""
    runs = [(group, redraw, f) for (group, redraw), f in zip(groups_, found)]
    tokens = int((case.segment_ids > 0).sum()) * len(groups_)
    leaks = _segment_leaks(case, runs, names, np.asarray(jax.device_get(nonfinite)), convention)
    for leak in leaks if rerun_change else ():
        s = leak.segment
        leak.rerun_change = {t: float(c[s.row, s.start:s.stop].max())
                             for t, c in rerun_change.items()}
    return ProbeResult(
        leaks,
        [n for n in names if n not in unprobed], unprobed, limits,
        detectable={n: float(f"{t / (amplitude(case.dtype) * scale[n]):.3g}")
                    if scale[n] > 0 else math.inf for n, t in limits.items()},
        false_alarm=float(sum(tokens * noise[n].exceed(t) ** 2 for n, t in limits.items())),
        quiet=[n for n in limits if noise[n].largest == 0], unsteady=list(unsteady))
