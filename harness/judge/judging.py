"""The one place that judges: how each check's verdict is decided, what a record expects and
what its outcome is. The runner hands measurements in; every record that leaves comes from
here. Views, `compare`, the selftest and repro only read what this module decided (the
summaries they share are in harness.judge.tallies, the words in harness.judge.vocabulary).

Tolerance (tolerance checks out, dq, dk, dv), for each check and segment:

    tolerance = peer_factor * peer_err + floor_eps * eps(dtype) * max|truth|
    ratio     = kernel_err / tolerance          (pass iff finite and ratio <= 1)

  (a reference that is non-finite on the segment, its peer's error or max|truth|, leaves no
  tolerance: the check is an error, never a pass; no_tolerance)

- kernel_err, peer_err: max abs difference from the float32 truth over the segment's tokens.
  The peer is the reference formula computed in the input dtype (oracle.dense_attention with
  truth=False), so peer_err is the rounding noise an honest kernel of that dtype can have.
- peer_factor: 2 for the output, 3 for gradients, as flash-attention's tests use. A fused kernel
  rounds differently from the peer (online softmax, bf16 probabilities, another accumulation
  order); backward passes chain more roundings than the forward pass.
- floor: the peer's error can be exactly zero (a single-token segment's output is its value row;
  its dq is zero in exact arithmetic), which would demand bitwise equality. The floor allows a
  couple of roundings of the largest value of that check: 2 eps for the output; 4 eps for the
  gradients, whose kernels recompute softmax statistics from a rounded output (four times
  that in float32, see FLOAT32_FLOOR_FACTOR). It uses the largest |truth| over the whole check
  tensor, not the segment, because a tiny segment-local scale (dq of a single token is 0) says
  nothing about the kernel's rounding.

A leak across a segment boundary moves outputs by O(1) of the values' scale, while the
tolerances are O(eps) of it: a bf16 leak shows ratios in the tens to hundreds. A ratio above
NEAR_RATIO passes, but close: the views mark it, and keep its row's per-token errors.
"""
from __future__ import annotations

import numpy as np

from harness.judge import vocabulary as v
from harness.judge.metrics import OUTPUT_LIKE, padding_violations, segment_error
from harness.judge.record import Record, first_line
from harness.judge.vocabulary import KERNEL_LEVEL, LEAK, Check

# In float32 the peer computes in the truth's own precision, so its error shows almost none of
# the reordering noise of a blocked kernel (online softmax, split accumulations): a few eps of
# the largest value, where Pallas's flash kernel lands on bidirectional rows (1e-6 at |out| 3).
# The floor is four times wider there; a leak still moves values by O(1).
FLOAT32_FLOOR_FACTOR = 4.0
# A passing check past this share of its tolerance is "near": marked in the views, and its row's
# per-token errors kept for the plots.
NEAR_RATIO = 0.5
# Non-finite positions a record names (the rest are counted).
POSITIONS_SHOWN = 8

EITHER_REASON = ("this check cannot see the leak reliably (it can hide in rounding noise); "
                 "the leak probe judges the segment")


def tolerance(chk: Check, dtype: str, peer_err: float, truth_scale: float) -> float:
    import jax.numpy as jnp
    eps = float(jnp.finfo(dtype).eps)
    floor = chk.floor_eps * (FLOAT32_FLOOR_FACTOR if dtype == "float32" else 1.0)
    # The last term only keeps the tolerance positive for an all-zero check.
    return chk.peer_factor * peer_err + floor * eps * truth_scale + 1e-30


def ratio(kernel_err: float, tol: float, nonfinite: int = 0) -> float | None:
    """error / tolerance; None (reported as inf) where the kernel produced non-finite values."""
    r = kernel_err / tol
    return None if nonfinite or not np.isfinite(r) else r


def tolerance_verdict(r: float | None) -> str:
    return v.PASS if r is not None and r <= 1.0 else v.FAIL


def within(err: float | None, tol: float) -> bool:
    """One token's error inside its tolerance (None: non-finite, never)."""
    return err is not None and np.isfinite(err) and err <= tol


def near(r: float | None) -> bool:
    """A ratio worth a closer look: non-finite, or past NEAR_RATIO of the tolerance."""
    return r is None or r > NEAR_RATIO


def failed(record: Record) -> bool:
    """The check measured a failure (whatever was expected)."""
    return record.verdict == v.FAIL


# tolerance() adds 1e-30 to keep a tolerance positive; one this small means the true tensor is
# zero everywhere in the case.
DEGENERATE_TOLERANCE = 2e-30


def is_evidence(record: Record) -> bool:
    """Whether a failing record shows a bug by itself: a bitwise check's always does; a
    tolerance check's does unless its tolerance is degenerate (the true tensor is zero
    everywhere in the case: any rounding fails it, e.g. dq of single-token segments)."""
    return not v.has_ratio(record.check) or record.tolerance > DEGENERATE_TOLERANCE


# ----- expectations and outcomes --------------------------------------------------------------

def expectation(value, check_name: str = "") -> tuple[str, str]:
    """(expected, reason) from what an expectation function returned: "pass", "fail",
    "either", ("either", reason) or ("known", reason). The bitwise checks are exact: never
    "either" nor "known". A known bug names itself: "known" needs its reason."""
    expected, reason = value if isinstance(value, tuple) else (value, "")
    if expected not in v.EXPECTATIONS or expected == v.ERROR:
        raise ValueError(f"an expectation must be pass, fail, either or known, not {expected!r}")
    chk = v.CHECKS.get(check_name)
    if expected in (v.EITHER, v.KNOWN) and chk is not None and chk.bitwise:
        raise ValueError(f"the {check_name} check is exact: its expectation is pass or fail, "
                         f"not {expected}")
    if expected == v.EITHER and check_name == v.JVP.name:
        raise ValueError("the jvp check is left to nothing: the leak probe does not look at the "
                         "output's tangent; its expectation is pass, fail or known")
    if expected == v.EITHER and check_name == v.DSINKS.name:
        raise ValueError("the dsinks check is left to nothing: it is one check over the heads, "
                         "with no segment the leak probe could judge; its expectation is pass, "
                         "fail or known")
    if expected == v.KNOWN and not reason:
        raise ValueError("a known bug needs its reason: return ('known', 'what and where')")
    if expected == v.EITHER:
        return expected, reason or EITHER_REASON
    return expected, reason if expected == v.KNOWN else ""


def outcome(verdict: str, expected: str) -> str:
    if verdict == v.REFUSED:
        return v.REFUSED  # a feature refused before computing: what a path may always do
    if verdict in (v.SKIP, v.ERROR):
        return verdict  # an expected error is "known" only when its message matches
    if expected == v.ERROR:
        return v.MISSED  # a known upstream crash that did not happen
    if verdict == v.UNPROBED:
        # A kernel expected to leak that could not be probed is not ok.
        return v.MISSED if expected == v.FAIL else v.UNJUDGED
    if expected == v.EITHER:
        return v.UNJUDGED
    if expected == v.KNOWN:
        return v.KNOWN if verdict == v.FAIL else v.OK
    if verdict == expected:
        return v.OK if verdict == v.PASS else v.CAUGHT
    return v.FAIL if verdict == v.FAIL else v.MISSED


def error_outcome(message: str, expect_error: str | None) -> tuple[str, str]:
    """(expected, outcome) of a kernel that raised: a declared upstream crash whose text shows
    is known; anything else is an error."""
    if expect_error is None:
        return v.PASS, v.ERROR
    return v.ERROR, v.KNOWN if expect_error in message else v.ERROR


# ----- records ----------------------------------------------------------------------------------

def case_fields(case) -> dict:
    out = dict(case_id=case.id, layout=case.layout, family=case.family, dtype=case.dtype,
               batch=case.batch, seq_len=case.seq_len, heads=case.heads,
               kv_heads=case.kv_heads, head_dim=case.head_dim, causal=case.causal,
               seed=case.seed)
    if case.features:
        out["features"] = "+".join(case.features.names)
    return out


def segment_fields(seg) -> dict:
    return dict(row=seg.row, segment=seg.number, segment_label=seg.label, start=seg.start,
                length=seg.length)


def status_record(kernel, case, verdict: str, message: str, check: str = KERNEL_LEVEL,
                  expected: str = v.PASS, outcome_: str | None = None, **more) -> Record:
    """A record without a segment: a skip, an error, a kernel-level expectation."""
    return Record(kernel=kernel.name, check=check, verdict=verdict, expected=expected,
                  outcome=outcome_ or outcome(verdict, expected), message=message,
                  **case_fields(case), **more)


def skip_record(kernel, case, reasons: list[str], check: str = KERNEL_LEVEL) -> Record:
    return status_record(kernel, case, v.SKIP, "; ".join(reasons), check=check)


def error_record(kernel, case, message: str, traceback: str | None = None,
                 check: str = KERNEL_LEVEL) -> Record:
    """A kernel that raised: an error, never a skip (known where it declared that crash)."""
    expected, result = error_outcome(message, kernel.error_expected(case))
    return status_record(kernel, case, v.ERROR, message[:2000], check=check, expected=expected,
                         outcome_=result, traceback=traceback)


def oracle_error_record(kernel, case, message: str, traceback: str | None = None,
                        check: str = KERNEL_LEVEL) -> Record:
    """The oracle raised, so the kernel's check did not run: an error, never matched against
    the crash the kernel declares (that crash is the kernel's; this one is the harness's)."""
    return status_record(kernel, case, v.ERROR, message[:2000], check=check,
                         traceback=traceback, harness_error=True)


def kernel_level_records(kernel, case) -> list[Record]:
    """What a kernel that ran declares about the whole case: a declared upstream crash that did
    not happen is missed; a declared missing backward leaves its gradient checks skipped."""
    out = []
    declared = kernel.error_expected(case)
    if declared is not None:
        out.append(status_record(kernel, case, v.PASS, f"expected upstream error "
                                 f"{declared!r} did not occur", expected=v.ERROR))
    if not kernel.backward:
        grads = [*v.TENSORS[1:], *([v.DSINKS] if case.features.sinks else [])]
        out += [status_record(kernel, case, v.SKIP, "kernel declares no backward", check=c.name)
                for c in grads]
    return out


def contract_record(kernel, case, out_dtype: str) -> Record:
    """The output contract: the output's dtype is the query's unless the kernel declares
    another (`Kernel.output_dtype`)."""
    want = kernel.output_dtype or case.dtype
    verdict = v.PASS if out_dtype == want else v.FAIL
    message = (f"output dtype {out_dtype}" if verdict == v.PASS else
               f"output dtype {out_dtype}, expected {want} (the query's dtype"
               f"{'' if kernel.output_dtype is None else ', as the kernel declares'})")
    return status_record(kernel, case, verdict, message, check=v.CONTRACT.name)


def refused_feature(case, error: BaseException | None) -> str | None:
    """The feature a kernel refused: an error raised while it was traced (before anything
    computed) whose message names one of the features the case handed over (their patterns:
    harness.model.features.REFUSALS). None: no refusal (an error is an error), and never for an
    error that is a program's bug (features.BUG_ERRORS, BUG_MESSAGES), whatever else it says."""
    from harness.model.features import ASSERTED_REFUSAL, BUG_ERRORS, BUG_MESSAGES, REFUSALS
    text = "" if error is None else str(error)
    if not text or not case.features or isinstance(error, BUG_ERRORS) or BUG_MESSAGES.search(text):
        return None
    if isinstance(error, AssertionError) and not ASSERTED_REFUSAL.search(text):
        return None   # a kernel's own invariant, not a refusal (features.ASSERTED_REFUSAL)
    # The feature named first: a refusal names what it refuses before any advice it gives.
    found = [(m.start(), name) for name in case.features.names
             if (m := REFUSALS[name].search(text)) is not None]
    return min(found)[1] if found else None


def error_message(exc: BaseException) -> str:
    """A raised error as its records name it."""
    return f"{type(exc).__name__}: {exc}".strip()


def trace_error_settles(kernel, case, exc: BaseException, refusals: bool = True) -> bool:
    """Whether an error raised while `kernel` was traced on `case` decides its check without
    an error verdict: the crash the kernel declares, or, with `refusals` (the build whose
    check reads them: a kernel's default build), a refusal of a feature the case handed over
    (harness.engine.lowering_process hands such errors over; any other trace error the run
    confirms with its own trace)."""
    return (refusals and refused_feature(case, exc) is not None) or \
        declared_crash(kernel, case, error_message(exc))


def declared_crash(kernel, case, message: str) -> bool:
    """Whether an error's message is the crash the kernel declares on the case (known)."""
    return error_outcome(message, kernel.error_expected(case))[1] == v.KNOWN


def refused_record(kernel, case, feature: str, message: str, check: str = KERNEL_LEVEL,
                   where: str = "while tracing") -> Record:
    """A feature refused before computing: the path's honest answer, never a pass of the
    checks it did not run (`check`: the one refused, where the path computed the others)."""
    return status_record(kernel, case, v.REFUSED,
                         f"refused {feature} {where}: {first_line(message, 500)}", check=check)


def dsinks_record(kernel, case, err, nonfinite, reference, mode, detail="") -> Record:
    """The sinks' gradient: one record per kernel x case (a sink's gradient sums over every
    token of the batch: no segment), against the peer's error over the heads; `detail`: what
    the kernel's gradient looks like, its diagnosis where it fails."""
    chk = v.DSINKS
    expected, reason = kernel.expected(case, chk.name, None)
    unjudgeable = no_tolerance(chk, case.dtype, reference.peer_dsinks_err, reference.dsinks_scale)
    if unjudgeable:
        return status_record(kernel, case, v.ERROR, unjudgeable, check=chk.name,
                             expected=expected, outcome_=v.ERROR, harness_error=True,
                             max_abs_err=None if nonfinite else err, mode=mode)
    tol = tolerance(chk, case.dtype, reference.peer_dsinks_err, reference.dsinks_scale)
    verdict = tolerance_verdict(r := ratio(err, tol, int(nonfinite)))
    diagnosis = (detail if verdict == v.FAIL else "") or None
    message = "dsinks non-finite" if nonfinite else "; ".join(x for x in (diagnosis, reason) if x)
    return status_record(kernel, case, verdict, message, check=chk.name, expected=expected,
                         max_abs_err=None if nonfinite else err, diagnosis=diagnosis,
                         peer_err=reference.peer_dsinks_err, tolerance=tol, ratio=r, mode=mode)


def nonfinite_positions(bad_tokens: np.ndarray, start: int) -> str:
    """'tokens 5, 7 (+3 more)' for a segment's per-token non-finite counts."""
    where = np.flatnonzero(bad_tokens) + start
    shown = ", ".join(str(int(p)) for p in where[:POSITIONS_SHOWN])
    more = f" (+{where.size - POSITIONS_SHOWN} more)" if where.size > POSITIONS_SHOWN else ""
    return f"tokens {shown}{more}"


def no_tolerance(chk: Check, dtype: str, peer_err: float, truth_scale: float) -> str | None:
    """Why a check has no tolerance, or None: the reference it is computed from is non-finite
    (the peer in the input's dtype overflowed, or the truth itself), and an infinite tolerance
    would pass any error. The check is an error (the harness's reference, not the kernel), never
    a pass."""
    bad = [f"{what} {x}" for what, x in ((f"the {dtype} peer's error", peer_err),
                                          ("max|truth|", truth_scale)) if not np.isfinite(x)]
    if not bad:
        return None
    return (f"{chk.name}: the reference is non-finite ({', '.join(bad)}): no tolerance, the "
            "check cannot be judged")


def tensor_records(kernel, case, chk: Check, errors, reference, mode: str
                   ) -> tuple[list[Record], dict]:
    """The tolerance check `chk` on every segment, from the tensor's per-token errors
    (harness.judge.metrics.token_errors) and the case's reference; also each segment's
    tolerance (for the plots; None where the reference left none)."""
    per_token = (case.heads if chk.heads == "query" else case.kv_heads) * case.head_dim
    records, tolerances = [], {}
    for seg in case.segments:
        m = segment_error(errors, reference.peer_token_err[chk.name], seg, per_token)
        expected, reason = kernel.expected(case, chk.name, seg)
        unjudgeable = no_tolerance(chk, case.dtype, m.peer_err, reference.scale[chk.name])
        if unjudgeable:
            tolerances[seg] = None
            records.append(Record(
                kernel=kernel.name, check=chk.name, **case_fields(case), **segment_fields(seg),
                max_abs_err=m.max_abs_err if m.nonfinite == 0 else None, verdict=v.ERROR,
                expected=expected, outcome=v.ERROR, message=unjudgeable, mode=mode,
                harness_error=True))
            continue
        tol = tolerances[seg] = tolerance(chk, case.dtype, m.peer_err,
                                          reference.scale[chk.name])
        r = ratio(m.max_abs_err, tol, m.nonfinite)
        verdict = tolerance_verdict(r)
        message = reason
        if m.nonfinite:
            bad = errors[2][seg.row, seg.start:seg.stop]
            message = (f"{chk.name} non-finite (NaN/Inf) in row {seg.row} at "
                       f"{nonfinite_positions(bad, seg.start)}" + (f"; {reason}" if reason else ""))
        records.append(Record(
            kernel=kernel.name, check=chk.name, **case_fields(case), **segment_fields(seg),
            max_abs_err=m.max_abs_err if m.nonfinite == 0 else None,
            mean_abs_err=m.mean_abs_err, worst_token=m.worst_token, nonfinite=m.nonfinite,
            peer_err=m.peer_err, tolerance=tol, ratio=r, verdict=verdict, expected=expected,
            outcome=outcome(verdict, expected), message=message, mode=mode))
    return records, tolerances


# ----- rules across the records of one kernel x case ------------------------------------------

def probe_off_record(kernel, case) -> Record:
    """The leak check of a pair run with the probe off (--no-leak-probe): one record for the
    case, not run, so every view shows a check that did not run (the probe's segments would
    otherwise leave no trace, and a kernel's cell read ok)."""
    return status_record(kernel, case, v.UNPROBED, "the leak probe was off (--no-leak-probe): "
                         "not run", check=LEAK.name, outcome_=v.NOT_RUN)


def cover_unjudged(records: list[Record], probed: bool = True) -> list[Record]:
    """Every check an expectation leaves `either` must be judged by the leak probe on the same
    segment. Where it is, the record says so (outcome unjudged); where it is not, nothing judged
    that segment, and the record is `missed`: the harness would otherwise count it silently.
    Where the probe was switched off (`probed` False), such a check did not run: `not run`,
    shown as such in every view, never a pass."""
    leak = {(r.row, r.segment): r for r in records
            if r.check == LEAK.name and r.measured and r.expected in (v.PASS, v.FAIL)}
    out = []
    for r in records:
        if r.check != LEAK.name and r.expected == v.EITHER and r.measured:
            probe = leak.get((r.row, r.segment))
            if probe is None and not probed:
                r = r.replace(outcome=v.NOT_RUN,
                              message="left to the leak probe, which did not run "
                                      "(--no-leak-probe): not judged")
            elif probe is None:
                r = r.replace(outcome=v.MISSED,
                              message="left unjudged by the expectation, and the leak probe did "
                                      "not judge this segment")
            elif r.check in (probe.unprobed or ()):
                # The probe compared the segment, not this tensor (noise, or no token left).
                r = r.replace(judged_by=f"leak:{r.check} not compared (unprobed)")
            else:
                r = r.replace(judged_by=f"leak:{probe.outcome}")
        out.append(r)
    return out


def reruns_within_tolerance(records: list[Record]) -> list[Record]:
    """The leak probe's reruns of the unchanged inputs are runs too: two that differ on a
    segment by over twice the check's tolerance are not both within it, and the check fails
    (a kernel right on its first call only passed, its reruns taken for noise)."""
    spread = {(r.row, r.segment): r for r in records if r.check == LEAK.name and r.rerun_change}
    out = []
    for r in records:
        probe = spread.get((r.row, r.segment))
        change = probe.rerun_change.get(r.check) if probe else None
        if change is not None and r.tolerance and change > 2 * r.tolerance and r.measured:
            r = r.replace(verdict=v.FAIL, outcome=outcome(v.FAIL, r.expected), message=(
                f"two runs of its {probe.mode} build on the unchanged inputs differ by "
                f"{change:.3g}, over twice the tolerance {r.tolerance:.3g}: not both within it "
                "(the leak probe's reruns)" + (f"; {r.message}" if r.message else "")))
        out.append(r)
    return out


# ----- the leak probe's verdicts ------------------------------------------------------------

def leak_message(leak, found, note: str) -> tuple[str, str]:
    """(verdict, message) of one segment's leak probe (harness.judge.leak_probe.SegmentLeak of
    a ProbeResult). A segment whose own values are non-finite is never a pass: NaN equals NaN,
    so a kernel writing NaN everywhere would otherwise look unchanged."""
    if not leak.compared:
        verdict, message = v.UNPROBED, ("no run left this segment untouched (nothing else in its "
                                        "batch to redraw): not compared")
    elif leak.leaked:
        verdict = v.FAIL
        message = (f"changed while the segment was untouched: {', '.join(leak.leaked)} "
                   f"(redrawn: {', '.join(leak.by)})")
    elif leak.nonfinite:
        verdict, message = v.UNPROBED, (f"{', '.join(leak.nonfinite)} non-finite on this "
                                        "segment: nothing to compare")
    elif found.probed:
        verdict, message = v.PASS, "unchanged"
    else:
        verdict, message = v.UNPROBED, "no tensor is reproducible run to run"
    if found.gated:
        message += "; above run-to-run noise only: " + ", ".join(
            f"{t} changes > {x:.2g}" for t, x in found.gated.items())
        if found.quiet:
            message += (f" ({', '.join(found.quiet)}: no noise seen in the reruns, the floor "
                        "threshold of a build not reproducible by construction; no false-alarm "
                        "rate measurable)")
    if found.unsteady:
        message += (f"; not reproducible: {', '.join(found.unsteady)} differed between two runs "
                    "of one perturbation (a change counts only where both runs made it)")
    if found.unprobed:
        from harness.judge.noise import POWERLESS
        message += (f"; not probed (its largest run-to-run change at least {POWERLESS:.0%} "
                    f"of its largest value): {', '.join(found.unprobed)}")
    message += f"; not compared here: {', '.join(leak.uncompared)}" if leak.uncompared else ""
    return verdict, message + (f"; {note}" if note else "")


def leak_records(kernel, case, found, mode: str, note: str = "") -> list[Record]:
    """One leak record per segment from the probe's result (harness.judge.leak_probe)."""
    records = []
    for leak in found.leaks:
        verdict, message = leak_message(leak, found, note)
        expected, _ = kernel.expected(case, LEAK.name, leak.segment)
        records.append(Record(
            kernel=kernel.name, check=LEAK.name, **case_fields(case),
            **segment_fields(leak.segment), max_abs_err=leak.max_change,
            worst_token=leak.first_token, tolerance=0.0, ratio=None, verdict=verdict,
            expected=expected, outcome=outcome(verdict, expected), message=message, mode=mode,
            **leak.tensors(found),
            gated={t: float(f"{x:.3g}") for t, x in found.gated.items()} or None,
            detectable=found.detectable or None,
            false_alarm=found.false_alarm if found.gated else None,
            quiet=list(found.quiet) or None, unsteady=list(found.unsteady) or None,
            fallback=note or None, rerun_change=leak.rerun_change or None))
    return records


# ----- padding hygiene ------------------------------------------------------------------------

def padding_records(kernel, case, errors_by_tensor: dict, scales=None) -> list[Record]:
    """One record per row with padding: what the kernel wrote there reaches training (dq/dk/dv
    enter the projections' weight gradients; a NaN output poisons the next layer's p @ v)."""
    records = []
    convention = kernel.padding_output
    checked = [n for n in errors_by_tensor
               if not (n in OUTPUT_LIKE and convention == v.PAD_UNDEFINED)]
    if not checked:
        return []  # an undefined output and no backward: nothing there to look at
    for row in range(case.batch):
        pad = case.segment_ids[row] == 0
        if not pad.any():
            continue
        found = padding_violations(errors_by_tensor, row, pad, convention, scales)
        verdict = v.FAIL if found else v.PASS
        expected, reason = kernel.expected_padding(case, row)
        if found:
            message = "; ".join(
                f"{t} {d['kind']} at {d['count']} padding positions (first {d['first']}"
                + (f", max |{t}| {d['max']:.3g})" if d["max"] is not None else ")")
                for t, d in found.items())
        else:
            message = (f"{', '.join(checked)} clean at {int(pad.sum())} padding positions "
                       f"(output convention: {convention})")
        if reason:
            message += f"; {reason}"
        first = min((d["first"] for d in found.values()), default=None)
        biggest = max((d["max"] or 0.0 for d in found.values()), default=None)
        records.append(Record(
            kernel=kernel.name, check=v.PADDING.name, **case_fields(case), row=row,
            segment_label=f"r{row}pad", start=None, length=int(pad.sum()),
            max_abs_err=biggest, worst_token=first, verdict=verdict, expected=expected,
            outcome=outcome(verdict, expected), message=message, violations=found or None))
    return records
