"""What a kernel that computes another mask than the case asks shows: the prediction behind a
known upstream drop.

A path that silently computes `without` (the case less a feature, or less part of one) in place of
`case` moves each segment by as much as the truth of `without` differs from the case's truth. So
its expectation is read off the inputs, not guessed: `prediction(case, without)` gives, per
(check, row, segment number) of out, dq, dk and dv, that distance over the tolerance the judge
applies there (harness.judge.judging); for "dsinks" the same over the heads; for "leak" the
segments where the leak probe's perturbations redraw a token the path reads and the case's mask
does not. `expected(...)` turns one entry into the expectation: known past KNOWN_ABOVE times the
tolerance (the kernel's own rounding comes on top of what the drop moves: a fraction of the
tolerance), pass below PASS_BELOW, too close to call between the two (left to the leak probe).
"""
from __future__ import annotations

from harness.judge import vocabulary as v

KNOWN_ABOVE, PASS_BELOW = 1.5, 0.5


def prediction(case, without, convention: str) -> dict:
    """Per check (and segment) what computing `without` in place of `case` moves (docstring)."""
    import numpy as np

    from harness.judge import judging, oracle, probe_groups
    from harness.judge.metrics import segment_error, token_errors
    from harness.model.case import make_inputs

    # The case's reference as the runner computed it (kept while it is on the case), and the
    # truth of `without` on the case's inputs, from the run's compiled programs
    # (oracle.share_programs), each shape compiled once.
    with oracle.charged_to_oracle():
        ref = oracle.reference_for(case, None, convention)
        got = oracle.oracle_program(without, True, convention)(*make_inputs(case).device_args)
    out = {}
    for chk, errors in zip(v.TENSORS, token_errors(got[:4], ref.truth[:4])):
        for seg in case.segments:
            m = segment_error(errors, ref.peer_token_err[chk.name], seg, 1)
            tol = judging.tolerance(chk, case.dtype, m.peer_err, ref.scale[chk.name])
            out[(chk.name, seg.row, seg.number)] = m.max_abs_err / tol
    if case.features.sinks:
        err = float(np.abs(np.asarray(got[4], np.float64)
                           - np.asarray(ref.truth[4], np.float64)).max())
        out[v.DSINKS.name] = err / judging.tolerance(v.DSINKS, case.dtype, ref.peer_dsinks_err,
                                                     ref.dsinks_scale)
    must = probe_groups.dependencies(case, convention)
    reads = probe_groups.dependencies(without, convention)
    leaks = set()
    for _, redraw in probe_groups.groups(case, convention):
        kept, still = probe_groups.untouched(must, redraw), probe_groups.untouched(reads, redraw)
        for seg in case.segments:
            sl = (seg.row, slice(seg.start, seg.stop))
            if any((kept[c][sl] & ~still[c][sl]).any() for c in kept):
                leaks.add((seg.row, seg.number))
    out[v.LEAK.name] = leaks
    return out


def expected(predicted: dict, check: str, segment, reason: str, otherwise):
    """The expectation of one check (segment None: over the heads, dsinks) of a path that drops
    what `predicted` measures; `otherwise` where the prediction has no word for the check."""
    if check == v.LEAK.name:
        return v.FAIL if (segment.row, segment.number) in predicted[check] else v.PASS
    key = check if segment is None else (check, segment.row, segment.number)
    if key not in predicted:
        return otherwise
    ratio = predicted[key]
    if ratio > KNOWN_ABOVE or (segment is None and ratio > 1.0):
        return v.KNOWN, reason
    if ratio < PASS_BELOW or segment is None:
        return v.PASS
    return v.EITHER, (f"{reason}; dropping it moves this segment {ratio:.2f}x its tolerance: "
                      "too close to call, left to the leak probe")
