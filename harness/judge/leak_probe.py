"""The leak probe: a check that needs no tolerance.

A segment's output and gradients may depend only on its own queries, keys, values and output
cotangent. So the kernel runs again with the inputs of everything else redrawn, in groups: the
segments by colour (segment number + row modulo two, like a checkerboard; where a row holds
three segments or more, modulo six in four groups, so that reads up to five segments away are
seen too), and the padding. Each segment is untouched in the other colours' runs and the
padding's, and there its out, dq, dk and dv must be bitwise what they were. A segment that no
run leaves untouched (alone in a batch without padding) was not compared, and says so. Any
change is a leak, however small: this catches what rounding noise hides from the tolerance
checks (a single token's dq after thousands of keys, dk/dv of a long first segment), and valid
queries that read padding keys. A segment whose own values are non-finite cannot be compared
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
  move: elsewhere it could not make one count).
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

import functools
import math
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from harness.ahead import ahead
from harness.judge.metrics import scales
from harness.judge.noise import POWERLESS, Noise, gated_thresholds, rerun_noise
from harness.judge.probe_runs import all_changes, launch_first, nonfinite_tokens
from harness.judge.vocabulary import TENSORS
from harness.model.case import Case, Inputs, device_seed, make_inputs
from harness.model.layouts import Segment

RERUNS = 2
# Reruns where a tensor is (or is declared) not reproducible: the noise estimate's sample.
RERUNS_NOISY = 4
# Mixed into a case's seed for the perturbations (standalone repro scripts draw the same).
PERTURB_SALT = 0x1EA4
# Where only a kernel's default (not deterministic by construction) build can be probed.
RERUNS_UNCERTAIN = 6
# Cases whose perturbation groups are kept (computed once per case, for every kernel).
GROUPS_CACHE = 16


def amplitude(dtype: str) -> float:
    """How much larger the amplified perturbation's values and cotangent are: 64, or 16 in
    float16, whose range (65504) a 64-fold value times a 64-fold cotangent could leave."""
    return 16.0 if dtype == "float16" else 64.0


# Six colours in four groups: colour c is in the two groups of SIX_COLOURS[c]. No colour's pair
# contains another's, so for any two colours some group holds the one and not the other.
SIX_COLOURS = ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3))


def colours(segment_ids: np.ndarray) -> int:
    """How many colours the segments take (segment number + row, modulo it): 2, a checkerboard,
    or 6 where some row holds three segments or more. A segment is compared while the segments
    d places away in its row are redrawn unless d is a multiple of the colours (with the
    checkerboard alone, reads two segments away went unseen: what a context-parallel reorder
    that leaves the ids behind makes)."""
    seg = np.asarray(segment_ids)
    return 6 if max(len(np.unique(row[row > 0])) for row in seg) >= 3 else 2


def groups(case: Case, convention: str = "segment") -> list[tuple[str, np.ndarray]]:
    """(name, [B, T] bool tokens to redraw) for each perturbation (a copy: see _groups)."""
    return [(name, mask.copy()) for name, mask in _groups(case, convention)]


@functools.lru_cache(maxsize=GROUPS_CACHE)
def _groups(case: Case, convention: str = "segment") -> tuple[tuple[str, np.ndarray], ...]:
    """(name, [B, T] bool tokens to redraw) for each perturbation: the segments of one colour and
    of the other (2 colours), or the four groups of six colours (SIX_COLOURS); then the
    padding; then, where the case has a window or chunks, blocks inside the segments
    (feature_groups). Neighbours in a row fall in different colours, and so do the single
    segments of consecutive unpacked rows, so that a segment alone in its row is still compared
    while the other rows are redrawn (a leak across the batch)."""
    seg = case.segment_ids
    n = colours(seg)
    colour = (seg + np.arange(seg.shape[0])[:, None]) % n
    valid = seg > 0
    if n == 2:
        out = [("segments of one colour", valid & (colour == 1)),
               ("segments of the other colour", valid & (colour == 0))]
    else:
        out = []
        for g in range(4):
            members = [c for c, pair in enumerate(SIX_COLOURS) if g in pair]
            out.append((f"segments of colours {', '.join(str(c + 1) for c in members)} of 6",
                        valid & np.isin(colour, members)))
    if (seg == 0).any():
        out.append(("padding", seg == 0))
    out += feature_groups(case, convention)
    for _, mask in out:
        mask.flags.writeable = False   # shared by every caller: _groups is cached
    return tuple((name, mask) for name, mask in out if mask.any())


def positions(segment_ids: np.ndarray) -> np.ndarray:
    """[B, T]: each token's position within its segment (its index in padding runs)."""
    seg = np.asarray(segment_ids)
    idx = np.broadcast_to(np.arange(seg.shape[1]), seg.shape)
    new = np.concatenate([np.ones((seg.shape[0], 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    return idx - np.maximum.accumulate(np.where(new, idx, 0), axis=1)


def feature_groups(case: Case, convention: str = "segment") -> list[tuple[str, np.ndarray]]:
    """Blocks of tokens inside each segment, for a case with a window or chunks: keys of a
    query's own segment outside its window or chunk must not move it either.

    - window (left, right): blocks of r + 1 tokens redrawn every 3r + 3 positions (r = left +
      right), at two phases; between two blocks, the queries whose window reaches no redrawn
      key are compared, the first of them reading exactly from the block's end (a window off by
      one reads the redrawn token before it), and the keys no query of theirs reads beyond;
    - chunks: every other chunk redrawn (by the kernel's convention), then the others."""
    f = case.features
    valid = case.segment_ids > 0
    pos = positions(case.segment_ids)
    out = []
    if f.window is not None:
        r = f.window[0] + f.window[1]
        block, period = r + 1, 3 * r + 3
        for phase in (0, period // 2):
            out.append((f"blocks of {block} inside each segment, every {period} from "
                        f"position {phase} (window)", valid & ((pos - phase) % period < block)))
    if f.chunk is not None:
        at = pos if convention == "segment" else np.broadcast_to(
            np.arange(case.seq_len), pos.shape)
        for parity, name in ((1, "odd"), (0, "even")):
            out.append((f"the {name} chunks of each segment ({convention} convention)",
                        valid & ((at // f.chunk) % 2 == parity)))
    return out


def dependencies(case: Case, convention: str = "segment") -> dict[str, tuple]:
    """Per tensor class ("query": out and dq; "key": dk and dv), [B, T] inclusive bounds of the
    tokens each token's value depends on, from the mask: a query on the keys it reads (and
    itself); a key on the queries that read it and on the keys those read. Masks are
    intervals (a segment, a causal prefix, a window, a chunk: their intersection), so the
    dependencies are intervals too."""
    seg = np.asarray(case.segment_ids)
    b, t = seg.shape
    f = case.features
    q_lo, q_hi = np.tile(np.arange(t), (b, 1)), np.tile(np.arange(t), (b, 1))
    k_lo, k_hi = q_lo.copy(), q_hi.copy()
    for s in case.segments:
        i = np.arange(s.start, s.stop)
        lo, hi = np.full(s.length, s.start), np.full(s.length, s.stop - 1)
        if case.causal:
            hi = np.minimum(hi, i)
        if f.window is not None:
            lo, hi = np.maximum(lo, i - f.window[0]), np.minimum(hi, i + f.window[1])
        if f.chunk is not None:
            base = s.start if convention == "segment" else 0
            start = base + ((i - base) // f.chunk) * f.chunk
            lo, hi = np.maximum(lo, start), np.minimum(hi, start + f.chunk - 1)
        q_lo[s.row, i], q_hi[s.row, i] = np.minimum(lo, i), np.maximum(hi, i)
        # The queries that read key j: from the first whose reach ends at j or later to the
        # last whose reach starts at j or earlier (both bounds rise with the query).
        first = s.start + np.searchsorted(hi, i, side="left")
        last = s.start + np.searchsorted(lo, i, side="right") - 1
        k_lo[s.row, i] = np.minimum(np.minimum(lo[first - s.start], first), i)
        k_hi[s.row, i] = np.maximum(np.maximum(hi[last - s.start], last), i)
    return {"query": (q_lo, q_hi), "key": (k_lo, k_hi)}


def untouched(deps: dict[str, tuple], redraw: np.ndarray) -> dict[str, np.ndarray]:
    """Per tensor class, [B, T] bool: tokens none of whose dependencies was redrawn (their
    values must not move)."""
    count = np.concatenate([np.zeros((redraw.shape[0], 1), np.int64),
                            np.cumsum(redraw, axis=1)], axis=1)
    rows = np.arange(redraw.shape[0])[:, None]
    return {cls: (count[rows, hi + 1] - count[rows, lo]) == 0 for cls, (lo, hi) in deps.items()}


@functools.lru_cache(maxsize=GROUPS_CACHE)
def _kept_per_group(case: Case, convention: str = "segment") -> tuple[dict[str, np.ndarray], ...]:
    """For each perturbation group of the case (_groups, in order): untouched(dependencies of
    the case, the group's redrawn tokens). Worked out once per case for all its kernels (read
    only): per kernel they were 18 s of the H200 nightly worker's run thread."""
    deps = dependencies(case, convention)
    out = []
    for _, redraw in _groups(case, convention):
        kept = untouched(deps, redraw)
        for mask in kept.values():
            mask.flags.writeable = False
        out.append(kept)
    return tuple(out)


@functools.lru_cache(maxsize=GROUPS_CACHE)
def _covered(case: Case, convention: str = "segment") -> bool:
    """Whether each valid token, as a query (out, dq) and as a key (dk, dv), is left untouched
    by some group's perturbation (_kept_per_group): so that a probe whose runs moved none of
    those tokens saw each one reproduced bitwise. Not where a segment has nothing else to
    redraw (one unpacked row without padding)."""
    valid, kept = case.segment_ids > 0, _kept_per_group(case, convention)
    return bool(kept) and all((~valid | np.logical_or.reduce([k[c] for k in kept])).all()
                              for c in ("query", "key"))


@ahead
def redrawn(seed, index, amplitude, q, k, v, cotangent, redraw, valid):
    """q, k, v and the cotangent with the `redraw` tokens drawn afresh, on the device: standard
    normal from the key of (seed, PERTURB_SALT, index), the values and the cotangent
    `amplitude` times larger, the cotangent zero at padding; every other token's bitwise as
    given. (Drawn on the host, the perturbations of the H200 nightly cost its worker 48 s of
    its 125 on the run's thread: numpy's normal draws; here they cost the device microseconds.)"""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(seed), PERTURB_SALT), index)
    out = []
    for i, (x, key_i) in enumerate(zip((q, k, v, cotangent), jax.random.split(key, 4))):
        fresh = jax.random.normal(key_i, x.shape, jnp.float32)
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
            redraw = _groups(case, convention)[index][1]
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
                   convention="segment", plain=None) -> list[dict]:
    """Per redrawn group, _perturbation's changes: one run of each perturbation (`plain`: the
    plain runs' changes, already made); then, of each perturbation that moved a segment's token
    that must not move, a second run (the amplified one always, the plain one where
    `confirm`), a token counting only where both moved it. Elsewhere no second run could make
    one count (_segment_leaks reads no other token); made on every pair, second runs doubled
    the plain perturbations' runs on GPUs."""
    def run(plans):
        return _run_groups(program, base, case, plans, bitwise, thresholds, names, convention)
    if plain is None:
        found = run([(g, bool(bitwise), bool(thresholds)) for g in range(len(groups_))])
    else:
        amplified = run([(g, False, True) for g in range(len(groups_))]) if thresholds \
            else [{} for _ in groups_]
        found = [{**{i: p[i] for i in bitwise}, **a} for p, a in zip(plain, amplified)]
    still, valid = _kept_per_group(case, convention), case.segment_ids > 0
    gated = [names.index(n) for n in thresholds]
    again = [(g, confirm and _moves_kept(f, still[g], names, bitwise, valid),
              _moves_kept(f, still[g], names, gated, valid)) for g, f in enumerate(found)]
    again = [plan for plan in again if plan[1] or plan[2]]
    for (g, _, _), second in zip(again, run(again)):
        found[g] = _both(found[g], second)
    return found


# Which tensors' values depend on which tokens (dependencies): out and dq are a query's, dk
# and dv a key's.
TENSOR_CLASS = {"out": "query", "dq": "query", "dk": "key", "dv": "key"}


def _segment_leaks(case: Case, runs: list, names: list[str], nonfinite: np.ndarray,
                   convention: str = "segment") -> list[SegmentLeak]:
    """Per segment: in each run, the tokens none of whose dependencies was redrawn must not
    have moved (for a case without window or chunks: every token of a segment not redrawn)."""
    still = _kept_per_group(case, convention)
    leaks = []
    for seg in case.segments:
        sl = (seg.row, slice(seg.start, seg.stop))
        leaked, firsts, biggest, by, compared = set(), [], 0.0, [], False
        for (group, _, changes), must in zip(runs, still):
            if not any(m[sl].any() for m in must.values()):
                continue  # no token of this segment was left untouched in that run
            compared = True
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
                                 biggest, by, compared, bad))
    return leaks


def launch_plain(program, base, case: Case, reproducible: bool | None = None,
                 convention: str = "segment") -> list | None:
    """probe's first plain perturbation runs (compared with `base`, the unchanged inputs'
    results), launched and not waited for: probe's `launched`. None where it makes none."""
    groups_ = range(len(_groups(case, convention)))
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
    groups_ = _groups(case, convention)
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
        still = _kept_per_group(case, convention)
        if _covered(case, convention) and not any(
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
    found = _group_changes(program, base, case, groups_, bitwise, limits, names, confirm,
                           convention, plain)
    return _result(case, names, found, groups_, noise, limits, unprobed, nonfinite, convention,
                   scale)


def _result(case, names, found, groups_, noise, limits, unprobed, nonfinite, convention,
            scale=None) -> ProbeResult:
    """The ProbeResult of the groups' changes (`found`) and the gated tensors' `limits`."""
    runs = [(group, redraw, f) for (group, redraw), f in zip(groups_, found)]
    tokens = int((case.segment_ids > 0).sum()) * len(groups_)
    return ProbeResult(
        _segment_leaks(case, runs, names, np.asarray(jax.device_get(nonfinite)), convention),
        [n for n in names if n not in unprobed], unprobed, limits,
        detectable={n: float(f"{t / (amplitude(case.dtype) * scale[n]):.3g}")
                    if scale[n] > 0 else math.inf for n, t in limits.items()},
        false_alarm=float(sum(tokens * noise[n].exceed(t) ** 2 for n, t in limits.items())),
        quiet=[n for n in limits if noise[n].largest == 0])
