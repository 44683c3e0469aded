"""The kernel's runs on candidate cases, for one check: which check fails on the original case,
and whether a candidate still fails it. A `Trial` is one run of the kernel on one case (its
records); `Trials` runs them, each (case, check) once, within a budget of kernel runs."""
from __future__ import annotations

from dataclasses import dataclass

from harness.errors import UsageError
from harness.judge import judging
from harness.judge import vocabulary as v
from harness.judge.record import Record, first_line
from harness.judge.vocabulary import JVP, LEAK, TENSORS
from harness.kernels.kernel import Kernel, Platform
from harness.model.case import Case

MAX_RUNS = 150


@dataclass
class Trial:
    """One run of the kernel on one case: the case and the run's records."""
    case: Case
    records: list[Record]

    def failing(self, check: str, evidence: bool = False) -> list[Record]:
        """The check's failing segment records, worst first (those that are evidence first).
        `evidence`: only those, leaving out failures against a tensor that is zero everywhere in
        the case (its tolerance is then only the 1e-30 that keeps it positive: any rounding
        fails it; e.g. dq of a case made of single-token segments)."""
        bad = [r for r in self.records if r.check == check and judging.failed(r) and r.segment]
        if evidence:
            bad = [r for r in bad if judging.is_evidence(r)]
        return sorted(bad, key=lambda r: (not judging.is_evidence(r), -(
            r.ratio if r.ratio is not None else float("inf"))))

    def record(self, check: str, row: int, segment: int) -> Record:
        """The check's record of one segment."""
        return next(r for r in self.records if r.check == check and r.row == row
                    and r.segment == segment)


class Budget(Exception):
    """The budget of kernel runs is spent."""


class Trials:
    """Runs one kernel on cases for one check, each case once, at most `max_runs` times."""

    def __init__(self, kernel: Kernel, platform: Platform, programs, max_runs: int = MAX_RUNS):
        self.kernel, self.platform, self.programs = kernel, platform, programs
        self.max_runs, self.runs = max_runs, 0
        self.check: str | None = None  # the check to keep failing (target_check decides)
        self._seen: dict[tuple, Trial | None] = {}

    def supported(self, case: Case) -> bool:
        return not self.kernel.unsupported_reasons(case, self.platform)

    def run(self, case: Case, leak: bool) -> Trial:
        from harness.engine.runner import run_kernel_case
        if self.runs >= self.max_runs:
            raise Budget
        self.runs += 1
        return Trial(case, run_kernel_case(self.kernel, case, self.platform, self.programs,
                                           leak=leak).records)

    def fails(self, case: Case, check: str) -> Trial | None:
        """The trial, if `check` fails on some segment of the case."""
        key = (case, check)
        if key not in self._seen:
            if not self.supported(case):
                return None
            trial = self.run(case, leak=check == LEAK.name)
            self._seen[key] = trial if trial.failing(check, evidence=True) else None
        return self._seen[key]


def target_check(trials: Trials, case: Case, check: str | None) -> Trial:
    """Runs the original case; returns its trial, with `check` resolved (trials.check)."""
    kernel = trials.kernel
    reasons = kernel.unsupported_reasons(case, trials.platform)
    if reasons:
        raise UsageError(f"{kernel.name} does not run {case.id} on {trials.platform.name}: "
                         f"{'; '.join(reasons)}")
    wanted = [check] if check else [c.name for c in TENSORS]
    trial = trials.run(case, leak=check == LEAK.name)
    refuse_errors(kernel, trial)
    for name in wanted:
        if trial.failing(name):
            trials.check = name
            return trial
    if not check:
        trial = trials.run(case, leak=True)
        refuse_errors(kernel, trial)
        if trial.failing(LEAK.name):
            trials.check = LEAK.name
            return trial
        if trial.failing(JVP.name):
            raise UsageError(f"{kernel.name} fails only the jvp check on {case.id}, which repro "
                             "writes no script for yet (its records name the segment and worst "
                             "token)")
        raise UsageError(f"{kernel.name} passes every check on {case.id}: nothing to reproduce")
    raise UsageError(f"{kernel.name} passes the {check} check on {case.id}: nothing to "
                     "reproduce (leave --check out to take the first failing one)")


def refuse_errors(kernel: Kernel, trial: Trial) -> None:
    """A UsageError if the kernel raised on the case: repro shrinks wrong results only."""
    for r in trial.records:
        if r.verdict == v.ERROR:
            raise UsageError(f"{kernel.name} raises on {trial.case.id} "
                             f"({first_line(r.message, 300)}); repro shrinks "
                             "wrong results, not errors")
