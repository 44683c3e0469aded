"""Reports measured before an expectation was corrected, judged again (`harness merge
--rejudge`): each record's expectation and outcome recomputed from the kernels as registered
now, by harness.judge.judging's rules; what was measured stays as it was."""
from __future__ import annotations

from collections.abc import Iterable, Mapping

from harness.judge import vocabulary as v
from harness.judge.judging import cover_unjudged, error_outcome, kernel_level_records, outcome
from harness.judge.record import Record
from harness.judge.vocabulary import KERNEL_LEVEL


def rejudge(records: Iterable[Record], kernels: Mapping, probed: bool = True) -> list[Record]:
    """Each record's expectation and outcome recomputed from the kernels as registered now.
    Errors, ratios and verdicts stay as measured: for reports measured before an expectation
    was corrected. `probed`: the report's run had the leak probe on (its header's leak_probe);
    a pair whose records say the probe did not run for it (not run) keeps that, so a check left
    to the probe reads not run again, never missed."""
    from harness.model.case import Case
    from harness.model.layouts import Segment

    groups: dict[tuple, list[Record]] = {}
    for r in records:
        groups.setdefault(r.pair, []).append(r)
    out = []
    for (name, case_id), rows in groups.items():
        kernel = kernels.get(name)
        if kernel is None:
            out += rows
            continue
        case = Case.from_id(case_id)
        fresh = []
        pair_probed = probed and not any(r.outcome == v.NOT_RUN for r in rows)
        for r in rows:
            if r.verdict in (v.PASS, v.FAIL, v.UNPROBED) and r.segment:
                seg = Segment(r.row, r.segment, r.start, r.length)
                expected, reason = kernel.expected(case, r.check, seg)
                changes = dict(expected=expected, outcome=outcome(r.verdict, expected),
                               judged_by=None)
                if v.has_ratio(r.check) and not r.nonfinite:  # the message is its reason
                    changes["message"] = reason
                r = r.replace(**changes)
            elif r.verdict in (v.PASS, v.FAIL) and r.check == v.DSINKS.name:
                expected, reason = kernel.expected(case, r.check, None)
                # Non-finite (no error measured): its message says so, whatever is expected.
                # Else its diagnosis (what the gradient looks like, where it fails) and reason.
                r = r.replace(expected=expected, outcome=outcome(r.verdict, expected),
                              **({} if r.max_abs_err is None else {"message": "; ".join(
                                  x for x in (r.diagnosis, reason) if x)}))
            elif r.verdict in (v.PASS, v.FAIL) and r.check == v.PADDING.name:
                expected, _ = kernel.expected_padding(case, r.row)
                r = r.replace(expected=expected, outcome=outcome(r.verdict, expected))
            elif r.verdict == v.PASS and r.check == KERNEL_LEVEL and r.expected == v.ERROR:
                continue   # a declared crash that did not occur: written again below, if still
            elif r.verdict == v.ERROR and not r.harness_error:   # the harness's: as it is
                expected, result = error_outcome(r.message, kernel.error_expected(case))
                r = r.replace(expected=expected, outcome=result)
            fresh.append(r)
        out += cover_unjudged(fresh + _crash_not_seen(kernel, case, fresh), probed=pair_probed)
    return out


def _crash_not_seen(kernel, case, rows: list[Record]) -> list[Record]:
    """The record of a crash the kernel declares now on a pair whose default build ran without
    one ("did not occur": missed), as the run writes it (judging.kernel_level_records) and
    with the declaration of now; nothing where that build raised (its error record, with no
    check) or the pair only skipped. (The pair's earlier such record was left out: rejudged
    twice, or under another declaration, the pair has one, or none once none is declared.)"""
    ran = any(r.verdict in (v.PASS, v.FAIL, v.UNPROBED) for r in rows)
    if not ran or any(r.verdict == v.ERROR and r.check == KERNEL_LEVEL for r in rows):
        return []
    return [r for r in kernel_level_records(kernel, case) if r.expected == v.ERROR]
