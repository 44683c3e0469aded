"""Regression against a baseline: the rules (harness.views.compare reads the files and prints).

A regression (exit 1) is:
- a verdict that flipped between measured verdicts (pass <-> fail) on a check held to it
  (expected to pass, or a known upstream bug): the same code on the same case gives the same
  verdicts, so a flip is either a change in the kernel or a check that is not reproducible;
  both need a look. Known-bug zones compare this way too;
- a check that was not bad now fails, errors or is missed (a check left to the leak probe and
  now judged by nothing counts);
- a kernel x case that ran now skipped, newly erroring, or checks of it that ran and now did
  not (the leak probe turned off);
- an error that grew beyond what the check's own spread allows (below);
- pairs of the baseline missing from a run that selected the same cases (an interrupted run,
  a kernel that silently lost cases). Where the selection differs, new and missing pairs are
  listed, not failed: suites grow and shrink on purpose.

Growth is calibrated on the check's own noise. A baseline made from several runs (`harness
baseline OUT RUN...`, e.g. nightlies of one commit on two machines) carries each check's error
range over those runs. A check whose runs agreed bitwise regresses when its error grows past
`growth` times the baseline's; a check that varied between runs only past `growth` times the
largest error it showed and above NOISE_RATIO of its tolerance. A single-run baseline says
nothing about a check's spread: there growth counts above RATIO_FLOOR of the tolerance, or
beyond UNCALIBRATED_GROWTH times the baseline's error (more than machines were seen to differ),
whatever `growth` says below that. A check exact in the baseline (error 0: the kernel ran the
oracle's own sums) regresses only past NOISE_RATIO of its tolerance: a reordered sum on
another machine is not a regression of the kernel.
Measured on the H200: between two fresh machines running the same programs, 2,545 of 2,546
checks agreed bitwise; one (XLA's float16 dk at ratio 0.41) grew 2.07x.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from harness.judge import vocabulary as v
from harness.judge.record import Record

NOISE_RATIO = 0.1
RATIO_FLOOR = 0.5
UNCALIBRATED_GROWTH = 5.0


@dataclass
class Comparison:
    flips: list[tuple[Record, Record]] = field(default_factory=list)      # (base, new)
    regressions: list[str] = field(default_factory=list)
    grown: list[tuple[Record, Record]] = field(default_factory=list)
    new_cases: list[tuple[str, str]] = field(default_factory=list)
    missing_cases: list[tuple[str, str]] = field(default_factory=list)
    lost_checks: list[Record] = field(default_factory=list)   # ran in the baseline, not now
    common: int = 0                                           # kernel x case pairs in both
    measured_both: int = 0                # checks measured in both (what was compared)
    same_selection: bool = False

    @property
    def regressed(self) -> bool:
        return bool(self.regressions)

    @property
    def compared_nothing(self) -> bool:
        """No check was measured in both reports (no pair in common, or every shared pair
        skipped in one of them): nothing was compared, never a pass."""
        return self.measured_both == 0


def err_range(b: Record) -> tuple[float | None, float | None, int]:
    """(smallest, largest, runs) of a baseline check's error over the runs it was made from."""
    if b.extra.get("err_range"):
        lo, hi, n = b.extra["err_range"]
        return lo, hi, int(n)
    return b.max_abs_err, b.max_abs_err, 1


def grew(b: Record, r: Record, growth: float) -> bool:
    """Whether a tolerance check's error grew beyond its calibrated band."""
    if not (v.has_ratio(r.check) and r.measured and b.measured):
        return False
    lo, hi, runs = err_range(b)
    if r.max_abs_err is None:
        return hi is not None            # non-finite now, finite before
    if hi is None or r.max_abs_err <= growth * hi:
        return False
    if hi == 0:
        # Exact before: any other order of the same sums is "infinitely" worse. Growth from
        # zero counts only past the noise share of the tolerance, or where no ratio is known.
        return r.ratio is None or r.ratio > NOISE_RATIO
    if runs >= 2 and lo == hi:
        return True                      # bitwise stable across runs and machines
    if r.ratio is None:
        return True
    if runs >= 2:
        return r.ratio > NOISE_RATIO
    return r.ratio > RATIO_FLOOR or r.max_abs_err > UNCALIBRATED_GROWTH * hi


def _label(r: Record) -> str:
    return f"{r.kernel} {r.check} {r.where} of {r.case_id}"


def _pair_changes(new: list[Record], base: list[Record], result: Comparison) -> None:
    base_pairs = {r.pair for r in base}
    # A pair the baseline lacks, bad now: nothing to compare it with, and never a pass.
    for pair, n in sorted(Counter(r.pair for r in new if r.bad and r.pair not in base_pairs)
                          .items()):
        result.regressions.append(f"{pair[0]} on {pair[1]}: a pair the baseline lacks, with "
                                  f"{n} bad record(s) now")
    ran_before = {r.pair for r in base if r.outcome != v.SKIP}
    errored_before = {r.pair for r in base if r.outcome == v.ERROR}
    for r in new:
        if r.outcome == v.SKIP and r.check == v.KERNEL_LEVEL and r.pair in ran_before:
            result.regressions.append(f"{r.kernel} on {r.case_id}: ran in the baseline, now "
                                      f"skipped ({r.message})")
        if r.outcome == v.ERROR and r.pair in base_pairs and r.pair not in errored_before:
            result.regressions.append(f"{r.kernel} on {r.case_id}: now errors: {r.message}")


# Checks whose verdicts and errors the gate holds the kernel to: those expected to pass, and
# known upstream bugs (no licence to get worse). An expected failure (a canary) or a check left
# to the leak probe (`either`: its numbers sit in rounding noise) regresses only when its
# outcome goes bad.
HELD = (v.PASS, v.KNOWN)


def _check_changes(new: list[Record], base: list[Record], growth: float,
                   result: Comparison, both: set) -> None:
    base_by_key = {b.key: b for b in base}
    for r in new:
        b = base_by_key.get(r.key)
        if b is None:
            # A check of a pair in both that the baseline did not have, bad now (a pair refused
            # whole there, its forward judged and failing now); errors: _pair_changes.
            if r.bad and r.outcome != v.ERROR and r.pair in both:
                result.regressions.append(f"{_label(r)}: {r.outcome}, a check the baseline "
                                          "did not have")
            continue
        result.measured_both += b.measured and r.measured
        # Held where either report holds it: a kernel that got worse while its expectation was
        # loosened to `either` or `fail` (a canary's) still regressed against its baseline.
        held = r.expected in HELD or b.expected in HELD
        if b.verdict != r.verdict:
            result.flips.append((b, r))
            if b.measured and r.measured and held:
                result.regressions.append(f"{_label(r)}: verdict {b.verdict} -> {r.verdict} "
                                          f"({b.outcome} -> {r.outcome})")
                continue
            if b.measured and not r.measured and held \
                    and r.verdict not in (v.SKIP, v.ERROR):   # a pair's: _pair_changes
                # It ran and now compared nothing (a leak probe now unprobed: its tensors too
                # noisy, or not reproducible).
                result.regressions.append(f"{_label(r)}: measured in the baseline "
                                          f"({b.verdict}), now {r.verdict} ({r.outcome})")
                continue
        if not b.bad and r.bad:
            result.regressions.append(f"{_label(r)}: {b.outcome} -> {r.outcome}")
        elif held and grew(b, r, growth):
            result.grown.append((b, r))
            new_err = "nan/inf" if r.max_abs_err is None else format(r.max_abs_err, ".3g")
            result.regressions.append(f"{_label(r)}: error grew {err_range(b)[1]:.3g} -> "
                                      f"{new_err} (> {growth}x, ratio "
                                      f"{'inf' if r.ratio is None else format(r.ratio, '.2g')})")


def compare(new: list[Record], base: list[Record], growth: float = 2.0,
            same_selection: bool = False) -> Comparison:
    """`same_selection`: the two runs selected the same cases (suite, case globs, seeds, shard),
    so a pair of the baseline missing now is a regression, not a choice."""
    if growth <= 1:
        raise ValueError(f"growth {growth}: must be above 1")
    result = Comparison(same_selection=same_selection)
    new_cases, base_cases = {r.pair for r in new}, {r.pair for r in base}
    result.new_cases = sorted(new_cases - base_cases)
    result.missing_cases = sorted(base_cases - new_cases)
    both = new_cases & base_cases
    result.common = len(both)
    _pair_changes(new, base, result)
    _check_changes(new, base, growth, result, both)
    new_keys = {r.key for r in new}
    # A baseline check that did not run (skipped, or the leak probe off) is not lost now.
    # Nor is a refusal gone: the path computes now (harness.engine.refusal: a backward's refusal
    # no longer hides its forward), and the run judges what it computed.
    lost = [b for b in base if b.pair in both and b.key not in new_keys
            and b.outcome not in (v.SKIP, v.NOT_RUN, v.REFUSED)]
    result.lost_checks = lost
    for (kernel, case_id), n in sorted(Counter(b.pair for b in lost).items()):
        checks = sorted({b.check for b in lost if b.pair == (kernel, case_id)})
        result.regressions.append(f"{kernel} on {case_id}: {n} checks ran in the baseline and not "
                                  f"now ({', '.join(checks)})")
    if same_selection:
        for kernel, case_id in result.missing_cases:
            result.regressions.append(f"{kernel} on {case_id}: in the baseline, missing now "
                                      "(the same cases were selected)")
    return result


# What a baseline keeps of each record: what the rules above read (the check's identity, its
# verdict, expectation and outcome, its error and ratio, its error range over the runs). The
# rest (the case's shape, token positions, the probe's details, messages) is the runs' own
# report's: a baseline of two full nightlies with the feature cases (96,485 records) is 2.0 MB
# so, 5.2 MB whole.
BASELINE_FIELDS = ("kernel", "case_id", "check", "row", "segment", "verdict", "expected",
                   "outcome", "max_abs_err", "ratio", "err_range")


def baseline_from_runs(runs: list[list[Record]]) -> list[Record]:
    """One baseline from several runs of the same selection: each check as the first run
    measured it, with the range of its error over every run that measured it (`err_range`:
    smallest, largest, runs; None where a run's error was non-finite). Runs whose measured
    verdicts differ on a check are refused (ValueError): the same code gives the same
    verdicts, and which one the baseline kept would depend on the runs' order."""
    errors: dict[tuple, list] = {}
    verdicts: dict[tuple, set] = {}
    for records in runs:
        for r in records:
            if v.has_ratio(r.check) and r.measured:
                errors.setdefault(r.key, []).append(r.max_abs_err)
            if r.measured:
                verdicts.setdefault(r.key, set()).add(r.verdict)
    split = [k for k, seen in verdicts.items() if len(seen) > 1]
    if split:
        kernel, case_id, check, *where = split[0]
        raise ValueError(f"the runs disagree on {len(split)} check(s)' verdicts (first: {kernel} "
                         f"{check} {where} of {case_id}: {' vs '.join(sorted(verdicts[split[0]]))}"
                         "): a baseline is made of runs that agree")
    out, seen = [], set()
    for records in runs:
        for r in records:
            if r.key in seen:
                continue
            seen.add(r.key)
            errs = errors.get(r.key)
            if errs:
                finite = [e for e in errs if e is not None]
                rng = ([min(finite), max(finite), len(errs)] if len(finite) == len(errs)
                       else [None, None, len(errs)])
                r = r.replace(extra={**r.extra, "err_range": rng})
            out.append(r)
    return out
