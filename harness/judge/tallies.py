"""What the records of a run add up to, decided once for every view: counts of outcomes, the
problems, what was not judged, the grid's cells, the margin over seeds, each plotted row's
outcome, the selftest's verdict for a zoo kernel, and whether a run judged anything at all.
Views print these; none of them re-derives a verdict.
"""
from __future__ import annotations

import math
from collections import Counter, defaultdict
from collections.abc import Iterable
from dataclasses import dataclass

from harness.judge import judging
from harness.judge import vocabulary as v
from harness.judge.record import Record, first_line


def worst_ratio(records: Iterable[Record]) -> tuple[bool, float | None]:
    """(any tolerance check measured, worst ratio): None for a non-finite one (reported inf).
    Bitwise checks have no ratio: their verdicts count, not their numbers."""
    ratios = [r.ratio for r in records if r.measured and v.has_ratio(r.check)]
    if not ratios:
        return False, None
    if any(x is None for x in ratios):
        return True, None
    return True, max(ratios)


def ratio_text(r: float | None) -> str:
    return "inf" if r is None else f"{r:.3g}"


def counts(records: Iterable[Record]) -> dict[str, int]:
    c = Counter(r.outcome for r in records)
    return {k: c[k] for k in v.OUTCOMES if c[k]}


def bad(records: Iterable[Record]) -> list[Record]:
    """Records a run must be red for: unexpected failures, missed catches and errors."""
    return [r for r in records if r.bad]


def worst_outcome(records: Iterable[Record]) -> str | None:
    """The most severe outcome among the records (vocabulary.SEVERITY), None if there are none."""
    present = {r.outcome for r in records}
    return next((o for o in v.SEVERITY if o in present), None)


def lone_shard(header: dict | None) -> bool:
    """A run's single shard I/N of N > 1 that is not the whole selection (its header's shard
    text; shards_filled: how many shards hold cases). A merge, of one shard or several, is
    held to the whole."""
    header = header or {}
    shard, filled = header.get("shard"), header.get("shards_filled")
    return (isinstance(shard, str) and not shard.endswith("/1") and not v.made_by_merge(header)
            and not (isinstance(filled, int) and filled <= 1))


def _measured_any(records: Iterable[Record]) -> bool:
    return any(r.measured or r.verdict == v.ERROR for r in records)


def judged_nothing(records: Iterable[Record], header: dict | None = None) -> bool:
    """No check measured anything (every pair skipped, or nothing ran): a run like that is never
    green. A lone shard is not held to it (every kernel may skip its cases: shard_idle), the
    shards merged are."""
    return not lone_shard(header) and not _measured_any(records)


def shard_idle(records: Iterable[Record], header: dict | None) -> bool:
    """A lone shard whose every pair skipped: not a failure of the shard (its merge is held to
    judging something), and no pass of anything either; the views say which."""
    return lone_shard(header) and not _measured_any(records)


def named_idle(records: Iterable[Record], header: dict | None) -> dict[str, str]:
    """kernel -> why (its records' commonest message), for each kernel the run named
    (`--kernels`) whose every pair skipped or refused its features: naming a kernel asks for
    its verdicts, and a run that gave none is not a pass, however green the other kernels (as a
    run that judged nothing at all is not). Kernels the run did not name may skip every case
    (GPU kernels on a CPU); a single shard is not held to it (its cases may be ones the kernel
    skips), the shards merged are."""
    header = header or {}
    if header.get("source") == "census":   # the part's kernels, not a user's naming
        return {}
    named = (header.get("selection") or {}).get("kernels")
    if not named or lone_shard(header):
        return {}
    named = set(named.split(","))
    why: dict[str, Counter] = defaultdict(Counter)
    judged = set()
    for r in records:
        if r.kernel in named:
            if r.measured or r.verdict == v.ERROR:
                judged.add(r.kernel)
            else:
                why[r.kernel][first_line(r.message, 200)] += 1
    return {k: c.most_common(1)[0][0] for k, c in sorted(why.items()) if k not in judged}


def unfinished(header: dict | None) -> str | None:
    """How the run that wrote a report's header did not finish: RUNNING (killed before its
    end: its header still says so), INTERRUPTED (stopped by the user), SHARDS_MISSING (a
    merge of shards without some: harness.store.merge.missing_shards) or CUT_SHORT (it holds
    fewer pairs or records than its header says, as reading it found:
    harness.store.report_file.shortfall); None where it finished (or the header is older than
    the state field)."""
    if not header:
        return None
    if header.get("state") == v.RUNNING:
        return v.RUNNING
    if header.get("state") == v.INTERRUPTED or header.get("interrupted"):
        return v.INTERRUPTED
    if header.get("shards_missing"):
        return v.SHARDS_MISSING
    if header.get(v.CUT_SHORT_FIELD):
        return v.CUT_SHORT
    return None


def unblamed(header: dict | None) -> list[dict]:
    """The header's `run_again` entries of worker deaths no pair repeated (the pair the worker
    died on ran alone after it, and no pair of that worker was blamed for a death later:
    harness.engine.workers.run_group)."""
    return [e for e in (header or {}).get("run_again") or [] if e.get(v.UNBLAMED_FIELD)]


def unblamed_text(entries: list[dict]) -> str:
    """Those deaths in one line, as every view says them."""
    shown = "; ".join(f"{e['kernel']} on {e['case_id']}: {' '.join(str(e.get('why')).split())}"
                      [:300] for e in entries[:3])
    return (f"{len(entries)} worker death(s) that no pair repeated: the pair last started ran "
            f"alone after it, and no pair of that worker died again ({shown}"
            f"{'; ...' if len(entries) > 3 else ''}); this run is not a pass")


def run_status(records: Iterable[Record], header: dict | None = None) -> int:
    """A run's exit status from its records: 1 if anything is bad, if nothing at all was
    judged (a run where every pair skipped is never green), if a kernel the run named judged
    nothing (named_idle), if the run did not finish (unfinished: killed, or stopped by the
    user, whatever finished before is clean), or if a worker died and no pair repeated it
    (unblamed); else 0."""
    records = list(records)
    if unfinished(header) or unblamed(header):
        return 1
    return 1 if bad(records) or judged_nothing(records, header) or named_idle(records, header) \
        else 0


def unjudged(records: Iterable[Record]) -> Counter:
    """(kernel, check, reason, judged_by) -> count of checks an expectation left unjudged."""
    return Counter((r.kernel, r.check, r.message, r.judged_by or "")
                   for r in records if r.outcome == v.UNJUDGED and r.check != v.LEAK.name)


def known_passed(records: Iterable[Record]) -> Counter:
    """(kernel, check, reason) -> checks a known-bug declaration names that passed: where the
    declaration is wider than what fails, every view says so ("declared known, passed")."""
    return Counter((r.kernel, r.check, first_line(r.message, 200))
                   for r in records if r.expected == v.KNOWN and r.outcome == v.OK)


def known(records: Iterable[Record]) -> Counter:
    """(kernel, check, reason) -> records showing a known upstream bug: segments failing a
    check as an expectation predicts, and cases raising a declared upstream error (check
    KERNEL_LEVEL, reason: the error's first line)."""
    return Counter((r.kernel, r.check, first_line(r.message, 200)
                    if not r.segment else r.message)
                   for r in records if r.outcome == v.KNOWN)


def unprobed(records: Iterable[Record]) -> Counter:
    """(kernel, tensor) -> leak records in which that tensor could not be probed."""
    c = Counter()
    for r in records:
        if r.check == v.LEAK.name:
            for t in r.unprobed or ():
                c[(r.kernel, t)] += 1
    return c


def gated(records: Iterable[Record]) -> dict[tuple[str, str], tuple[int, float]]:
    """(kernel, tensor) -> (leak records that probed it above its run-to-run noise only, the
    largest change threshold): probed, with less power than bitwise."""
    out: dict[tuple[str, str], tuple[int, float]] = {}
    for r in records:
        if r.check == v.LEAK.name:
            for t, x in (r.gated or {}).items():
                n, worst = out.get((r.kernel, t), (0, 0.0))
                out[(r.kernel, t)] = (n + 1, max(worst, x))
    return out


def quiet(records: Iterable[Record]) -> dict[tuple[str, str], int]:
    """(kernel, tensor) -> leak records that gated it although its reruns showed no noise (a
    build not reproducible by construction): a threshold with no measured false-alarm rate."""
    out: Counter = Counter()
    for r in records:
        if r.check == v.LEAK.name:
            out.update((r.kernel, t) for t in r.quiet or ())
    return dict(out)


def unsteady(records: Iterable[Record]) -> dict[tuple[str, str], int]:
    """(kernel, tensor) -> leak records whose probe saw two runs of one perturbation give the
    tensor apart (compared bitwise, yet not reproducible)."""
    out: Counter = Counter()
    for r in records:
        if r.check == v.LEAK.name:
            out.update((r.kernel, t) for t in r.unsteady or ())
    return dict(out)


def detectable(records: Iterable[Record]) -> dict[str, dict[str, float]]:
    """kernel -> tensor -> the largest (worst) smallest-detectable leak, as a fraction of the
    tensor's scale, over the kernel's leak records; 0 for tensors probed bitwise everywhere."""
    out: dict[str, dict[str, float]] = defaultdict(dict)
    for r in records:
        if r.check != v.LEAK.name or not r.measured:
            continue
        for t in r.probed or ():
            frac = (r.detectable or {}).get(t, 0.0)
            out[r.kernel][t] = max(out[r.kernel].get(t, 0.0), frac)
    return dict(out)


def false_alarms(records: Iterable[Record]) -> dict[str, float]:
    """kernel -> probability of at least one false leak verdict over the run (the union bound of
    its gated probes' false-alarm probabilities; one value per kernel x case)."""
    per_case: dict[tuple[str, str], float] = {}
    for r in records:
        if r.check == v.LEAK.name and r.false_alarm is not None:
            per_case[r.pair] = max(per_case.get(r.pair, 0.0), r.false_alarm)
    out: dict[str, float] = defaultdict(float)
    for (kernel, _), p in per_case.items():
        out[kernel] += p
    return dict(out)


def uncompared(records: Iterable[Record]) -> Counter:
    """(kernel, reason) -> leak records the probe measured nothing for."""
    return Counter((r.kernel, r.message) for r in records
                   if r.check == v.LEAK.name and r.verdict == v.UNPROBED
                   and r.outcome != v.NOT_RUN)


def fallbacks(records: Iterable[Record]) -> Counter:
    """(kernel, why) -> leak records probed on the default build because the deterministic
    build could not run."""
    return Counter((r.kernel, r.fallback) for r in records
                   if r.check == v.LEAK.name and r.fallback)


def probe_coverage(records: Iterable[Record]) -> dict[str, tuple[int, int]]:
    """kernel -> (segments with all four tensors probed, segments with a leak record)."""
    full, total = Counter(), Counter()
    for r in records:
        if r.check == v.LEAK.name and r.segment:
            total[r.kernel] += 1
            if r.measured and not r.unprobed:
                full[r.kernel] += 1
    return {k: (full[k], total[k]) for k in total}


def padding_rows(records: Iterable[Record]) -> dict[str, tuple[int, int]]:
    """kernel -> (rows with padding judged clean or as expected, rows with padding judged)."""
    good, total = Counter(), Counter()
    for r in records:
        if r.check == v.PADDING.name and r.measured:
            total[r.kernel] += 1
            good[r.kernel] += r.outcome in v.GOOD
    return {k: (good[k], total[k]) for k in total}


# ----- the grid: one cell per kernel x layout ---------------------------------------------------

@dataclass
class Cell:
    """One kernel on one layout, over every case, check and segment of that layout."""
    status: str          # vocabulary.CELL_*
    segments: int = 0    # segments measured
    failing: int = 0     # segments with at least one failing check (the leak probe included)
    worst_ratio: float | None = None   # worst tolerance ratio (None: non-finite, or none)
    has_ratio: bool = False
    # Failing checks judged per case, not per segment (padding, dsinks, ...): a cell read
    # "FAIL 13/13" where only they failed, every segment passing.
    case_checks: tuple[str, ...] = ()
    # Tensors the leak probe could not compare in some segment (its reruns differ past what
    # the probe can decide): the cell read "ok 11/11" beside them, a pass the README promises
    # they are never shown as (a cold review).
    unprobed: tuple[str, ...] = ()

    @property
    def measured(self) -> bool:
        return self.status not in (v.CELL_SKIP, v.CELL_ERROR) and not (
            self.status in (v.CELL_KNOWN, v.CELL_REFUSED) and not self.segments)

    @property
    def bad(self) -> bool:
        return self.status in v.BAD_CELLS

    @property
    def text(self) -> str:
        if not self.measured:
            return self.status
        ratio = ratio_text(self.worst_ratio) if self.has_ratio else "—"
        beyond = f"; {', '.join(self.case_checks)} failed" if self.case_checks else ""
        if self.unprobed:
            beyond += f"; {', '.join(self.unprobed)} unprobed"
        return f"{self.status} {self.segments - self.failing}/{self.segments} r={ratio}{beyond}"

    @property
    def heat(self) -> float | None:
        """log10 of the worst ratio for the heatmap's colour; a cell with a failing check is
        at least as red as a ratio of 10, whichever check failed (a leak has no ratio)."""
        if not self.measured:
            return None
        if not self.has_ratio:
            value = -2.0
        elif self.worst_ratio is None:
            value = 4.0
        else:
            value = math.log10(max(self.worst_ratio, 1e-4))
        return max(value, 1.0) if self.status in (v.CELL_FAIL, v.CELL_MISSED) else value


def cell(rows: list[Record]) -> Cell:
    outcomes = counts(rows)
    seg_fail: dict[tuple, bool] = defaultdict(bool)
    for r in rows:
        if r.measured and r.segment:
            seg_fail[(r.case_id, r.row, r.segment)] |= judging.failed(r)
    status = next((s for o, s in v.CELL_BY_OUTCOME if outcomes.get(o)), None)
    if status is None and any(r.check == v.LEAK.name and r.verdict == v.UNPROBED for r in rows):
        status = v.CELL_NOT_RUN   # a segment the leak probe could not compare: never plain ok
    has_ratio, worst = worst_ratio(rows)
    if status is None:
        if not seg_fail and not any(r.measured for r in rows):
            status = v.CELL_SKIP
        else:
            status = v.CELL_NEAR if has_ratio and judging.near(worst) else v.CELL_OK
    per_case = sorted({r.check for r in rows if not r.segment and judging.failed(r)})
    unprobed = {t for r in rows if r.check == v.LEAK.name for t in r.unprobed or ()}
    return Cell(status, len(seg_fail), sum(seg_fail.values()), worst, has_ratio,
                tuple(per_case), tuple(sorted(unprobed, key=list(v.CHECKS).index)))


def column(r: Record) -> str:
    """A record's grid column: its layout, or for a case with features (harness.model.features)
    those features (`+window+sinks`), whatever the layout: a feature has a column of its own."""
    if not r.features:
        return r.layout
    return f"+{r.features}" + ("" if r.causal else " bidir")


def skipped_everything(records: Iterable[Record]) -> dict[str, str]:
    """kernel -> why it skipped, for kernels every record of which is a skip: listed once,
    instead of filling the grid with empty rows. Each reason its cases gave, commonest first
    (one case skipped for the window, another for the soft cap: both are named)."""
    reasons: dict[str, Counter] = defaultdict(Counter)
    ran = set()
    for r in records:
        if r.outcome == v.SKIP and r.check == v.KERNEL_LEVEL:
            for part in (r.message or "").split("; "):
                reasons[r.kernel][part] += 1
        else:
            ran.add(r.kernel)
    return {k: "; ".join(p for p, _ in c.most_common()) for k, c in reasons.items()
            if k not in ran}


def grid(records: list[Record]) -> tuple[list[str], list[str], dict[tuple[str, str], Cell]]:
    """(kernels, columns, cells): one row per kernel that ran something (skipped_everything
    lists the others), one column per layout and per feature set."""
    idle = skipped_everything(records)
    by_cell: dict[tuple[str, str], list[Record]] = defaultdict(list)
    for r in records:
        if r.kernel not in idle:
            by_cell[(r.kernel, column(r))].append(r)
    kernels = list(dict.fromkeys(r.kernel for r in records if r.kernel not in idle))
    columns = dict.fromkeys(column(r) for r in records if r.kernel not in idle)
    layouts = sorted(c for c in columns if not c.startswith("+")) + sorted(
        c for c in columns if c.startswith("+"))
    return kernels, layouts, {key: cell(rows) for key, rows in by_cell.items()}


def refusals(records: Iterable[Record]) -> Counter:
    """(kernel, feature, first line of the refusal) -> cases refused (a case whose backward
    pass alone refused has a refused record per gradient check: one case)."""
    cases: dict[tuple, set] = {}
    for r in records:
        if r.outcome == v.REFUSED:
            # "window", or "window in its backward pass" (harness.engine.refusal)
            feature = r.message.removeprefix("refused ").split(" while tracing", 1)[0]
            key = (r.kernel, feature, r.message.split(": ", 1)[-1][:200])
            cases.setdefault(key, set()).add(r.case_id)
    return Counter({key: len(ids) for key, ids in cases.items()})


def not_run(records: Iterable[Record]) -> Counter:
    """(kernel, check) -> checks that did not run (left to a probe that was off)."""
    return Counter((r.kernel, r.check) for r in records if r.outcome == v.NOT_RUN)


@dataclass
class CheckDigest:
    """One check of a failing kernel: how many segments failed, the worst ratio, the first."""
    kernel: str
    check: str
    segments: int
    worst: float | None          # None: non-finite, or a check without a ratio
    has_ratio: bool
    first: Record


def digests(records: Iterable[Record]) -> list[CheckDigest]:
    """Per failing kernel and check (bad outcomes only), in the order each first fails: the
    digest a failing kernel's report opens with, before the list of every segment. Its first
    segment is the first in the records' order, as the list shows them (by case id,
    `...-bidir-sink` came before `...-sink`, listed after it)."""
    groups: dict[tuple[str, str], list[Record]] = defaultdict(list)
    for r in records:
        if r.bad and r.outcome != v.ERROR:
            groups[(r.kernel, r.check)].append(r)
    out = []
    for (kernel, check), rows in groups.items():
        has_ratio, worst = worst_ratio(rows)
        out.append(CheckDigest(kernel, check, len(rows), worst, has_ratio, rows[0]))
    return out


# ----- margins over seeds, plotted rows, the selftest -------------------------------------------

def margins(records: list[Record]) -> dict[str, list[float | None]]:
    """kernel -> the worst tolerance ratio of each case it was expected to pass (None:
    non-finite), over the checks expected to pass (a known upstream bug's checks are not a
    margin): over many seeds, how close a kernel comes to its tolerance."""
    by_case: dict[tuple[str, str], list[Record]] = defaultdict(list)
    for r in records:
        by_case[r.pair].append(r)
    out: dict[str, list[float | None]] = defaultdict(list)
    for (kernel, _), rows in by_case.items():
        if any(r.expected == v.FAIL for r in rows):
            continue
        has_ratio, worst = worst_ratio(r for r in rows if r.expected == v.PASS)
        if has_ratio:
            out[kernel].append(worst)
    return dict(out)


def row_outcomes(records: Iterable[Record]) -> dict[tuple, str]:
    """(kernel, case id, check, row) -> the most severe outcome of that check's segments in the
    row (a row plotted once shows its worst segment, whichever comes last)."""
    rows: dict[tuple, list[Record]] = defaultdict(list)
    for r in records:
        if r.row is not None:
            rows[(r.kernel, r.case_id, r.check, r.row)].append(r)
    return {key: worst_outcome(rs) for key, rs in rows.items()}


def zoo_verdict(correct: bool, flagged: bool, errored: bool, measured: bool) -> str:
    """The selftest's verdict for one zoo kernel: a bug must be caught (flagged by some bad
    record), a correct kernel must run (measure something) and never be flagged."""
    if errored:
        return v.ZOO_ERROR
    if correct:
        return v.ZOO_FLAGGED if flagged or not measured else v.ZOO_OK
    return v.ZOO_CAUGHT if flagged else v.ZOO_MISSED


def first_catch(records: list[Record]) -> Record | None:
    """The first bad measurement of one kernel x case: checks in the order out, dq, dk, dv,
    dsinks, jvp, leak, padding, contract; within a check, the first row and segment."""
    flagged = [r for r in records if r.outcome in (v.FAIL, v.MISSED)]
    for chk in (*v.TENSORS, v.DSINKS, v.JVP, v.LEAK, v.PADDING, v.CONTRACT):
        hits = [r for r in flagged if r.check == chk.name]
        if hits:
            return min(hits, key=lambda r: (r.row if r.row is not None else -1, r.segment or 0))
    return None
