"""Runs kernels on cases and turns what they computed into per-segment records.

The data path, one kernel on one case:

    case -> inputs (made once) -> kernel program (default build) -> oracle (reference_for)
         -> per-segment metrics (harness.judge.metrics) -> verdicts (harness.judge.judging) -> records
         -> leak probe (deterministic build, harness.judge.leak_probe) -> leak records

One record per kernel, case, check and segment. Inputs and segment ids are arguments of
compiled programs, so a kernel compiles once per shape, not per layout or seed.
"""
from __future__ import annotations

import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Iterable

import numpy as np

from harness.judge import judging, leak_probe
from harness.model.case import Case, make_inputs
from harness.judge.judging import KERNEL_LEVEL, LEAK, TENSORS
from harness.engine.kernel import Kernel, Platform
from harness.judge.metrics import segment_error, token_errors
from harness.judge.oracle import Reference, reference_for
from harness.engine.programs import DEFAULT, Programs, device_memory_bytes

# A row's per-token errors are kept for plotting when a segment in it gets this close to failing,
# for the checks the HTML report plots, to 3 significant digits.
TRACE_RATIO = 0.5
# Cases whose inputs are drawn ahead of the one running (make_inputs keeps 8).
INPUTS_AHEAD = 4
INPUTS = "inputs (drawing ahead)"   # its row of the timing table: how long the run waited


@dataclass
class KernelCaseResult:
    records: list[dict] = field(default_factory=list)
    traces: list[dict] = field(default_factory=list)


def _base(kernel: Kernel, case: Case) -> dict:
    return {"kernel": kernel.name, "case_id": case.id, "layout": case.layout,
            "family": case.family, "dtype": case.dtype, "batch": case.batch,
            "seq_len": case.seq_len, "heads": case.heads, "kv_heads": case.kv_heads,
            "head_dim": case.head_dim, "causal": case.causal, "seed": case.seed}


def _segment_fields(seg) -> dict:
    return {"row": seg.row, "segment": seg.number, "segment_label": seg.label,
            "start": seg.start, "length": seg.length}


def _status_record(kernel, case, verdict, message, check=KERNEL_LEVEL, expected="pass",
                   outcome=None) -> dict:
    return {**_base(kernel, case), "check": check, "segment": None, "row": None,
            "verdict": verdict, "expected": expected,
            "outcome": outcome or judging.outcome(verdict, expected), "message": message}


def _check_records(kernel, case, chk, errors, ref: Reference) -> KernelCaseResult:
    per_token = (case.heads if chk.heads == "query" else case.kv_heads) * case.head_dim
    out, tolerances, flagged_rows = KernelCaseResult(), {}, set()
    for seg in case.segments:
        m = segment_error(errors, ref.peer_token_err[chk.name], seg, per_token)
        tol = tolerances[seg] = judging.tolerance(chk, case.dtype, m.peer_err, ref.scale[chk.name])
        ratio = judging.ratio(m.max_abs_err, tol, m.nonfinite)
        verdict = judging.tolerance_verdict(ratio)
        expected, reason = kernel.expected(case, chk.name, seg)
        record = {
            **_base(kernel, case), "check": chk.name, **_segment_fields(seg),
            "max_abs_err": m.max_abs_err if m.nonfinite == 0 else None,
            "mean_abs_err": m.mean_abs_err, "worst_token": m.worst_token,
            "nonfinite": m.nonfinite, "peer_err": m.peer_err, "tolerance": tol,
            "ratio": ratio, "verdict": verdict, "expected": expected,
            "outcome": judging.outcome(verdict, expected), "mode": DEFAULT}
        if reason:
            record["message"] = reason
        out.records.append(record)
        if chk.traced and not (ratio is not None and ratio <= TRACE_RATIO):
            flagged_rows.add(seg.row)
    tok_max = errors[0]
    for row in sorted(flagged_rows):
        segs = case.row_segments(row)
        out.traces.append({
            "kernel": kernel.name, "case_id": case.id, "check": chk.name, "row": row,
            "token_err": [None if not np.isfinite(x) else float(f"{x:.3g}") for x in tok_max[row]],
            "segments": [{"number": s.number, "start": s.start, "length": s.length} for s in segs],
            "tolerance": {str(s.number): tolerances[s] for s in segs},
        })
    return out


def run_kernel_case(kernel: Kernel, case: Case, platform: Platform,
                    programs: Programs | None = None, leak: bool = True) -> KernelCaseResult:
    """Every check of one kernel on one case; unsupported -> skip, raising -> error."""
    reasons = kernel.unsupported_reasons(case, platform)
    if reasons:
        return KernelCaseResult([_status_record(kernel, case, "skip", "; ".join(reasons))])
    programs = programs or _default_programs()
    try:
        inputs = make_inputs(case)
        try:
            ref = reference_for(case, programs)
        except Exception as exc:  # not the kernel's doing: say whose it is
            raise RuntimeError(f"oracle failed, the kernel did not run: {type(exc).__name__}: "
                               f"{exc}") from exc
        program = programs.get(kernel, case, DEFAULT)
        results = program(*inputs.device_args)
        errs = token_errors(results, ref.truth[:len(results)])
        missing = program.missing_markers()
        if missing:
            raise AssertionError(f"program lacks {missing}: the fused kernel did not run")
    except Exception as exc:  # a kernel that raises is an error, never a skip
        message = f"{type(exc).__name__}: {exc}".strip()
        expected, outcome = judging.error_outcome(message, kernel.expect_error)
        record = _status_record(kernel, case, "error", message[:2000], expected=expected,
                                outcome=outcome)
        return KernelCaseResult([{**record, "traceback": traceback.format_exc(limit=-3)[-4000:]}])
    out = KernelCaseResult()
    if kernel.expect_error is not None:
        out.records.append(_status_record(
            kernel, case, "pass", f"expected upstream error {kernel.expect_error!r} did not occur",
            expected="error"))
    for chk, err in zip(TENSORS, errs):
        part = _check_records(kernel, case, chk, err, ref)
        out.records += part.records
        out.traces += part.traces
    if not kernel.backward:
        out.records += [_status_record(kernel, case, "skip", "kernel declares no backward",
                                       check=c.name) for c in TENSORS[1:]]
    if leak:
        out.records += _leak_records(kernel, case, programs, inputs, results)
    out.records = judging.cover_unjudged(out.records)
    return out


def _leak_records(kernel, case, programs: Programs, inputs, results) -> list[dict]:
    """The tolerance-free leak probe (harness.judge.leak_probe), one record per segment, from the
    kernel's deterministic build where the platform needs one."""
    mode, note = programs.probe_mode, ""
    # On GPUs even a deterministic build is not reproducible by construction everywhere (TE's
    # dq on some shapes): a change must show in two runs of each perturbation, so that noise
    # the reruns happened not to see cannot pass for a leak.
    confirm = programs.platform == "gpu"
    try:
        if mode == DEFAULT:
            found = leak_probe.probe(programs.get(kernel, case, DEFAULT), inputs, case, results,
                                     confirm=confirm)
        else:
            try:
                found = _probe_deterministic(programs.get(kernel, case, mode), inputs, case,
                                             confirm)
            except Exception as exc:  # e.g. a deterministic workspace that does not fit
                note = (f"deterministic build failed ({type(exc).__name__}: "
                        f"{str(exc).splitlines()[0][:300] if str(exc) else ''}); probed the "
                        f"default build ({leak_probe.RERUNS_UNCERTAIN} reruns, each leak "
                        "confirmed by a second run)")
                mode = DEFAULT
                found = leak_probe.probe(programs.get(kernel, case, DEFAULT), inputs, case,
                                         results, reruns=leak_probe.RERUNS_UNCERTAIN,
                                         confirm=True)
    except Exception as exc:  # the kernel ran once already: a failure here is the kernel's
        return [_status_record(kernel, case, "error", f"leak probe: {type(exc).__name__}: {exc}",
                               check=LEAK.name)]
    records = []
    for leak in found.leaks:
        seg = leak.segment
        if not leak.compared:
            verdict, message = "unprobed", "no run left this segment untouched (nothing else " \
                                           "in its batch to redraw): not compared"
        elif leak.leaked:
            verdict = "fail"
            message = (f"changed while the segment was untouched: {', '.join(leak.leaked)} "
                       f"(redrawn: {', '.join(leak.by)})")
        elif found.probed:
            verdict, message = "pass", "unchanged"
        else:
            verdict, message = "unprobed", "no tensor is reproducible run to run"
        if found.gated:
            message += "; above run-to-run noise only (confirmed twice): " + ", ".join(
                f"{t} changes > {x:.2g}" for t, x in found.gated.items())
        if found.unprobed:
            message += f"; not probed (run-to-run noise over {leak_probe.POWERLESS:.0%} of " \
                       f"the values): {', '.join(found.unprobed)}"
        if note:
            message += f"; {note}"
        expected, _ = kernel.expected(case, LEAK.name, seg)
        records.append({
            **_base(kernel, case), "check": LEAK.name, **_segment_fields(seg),
            "max_abs_err": leak.max_change, "worst_token": leak.first_token, "tolerance": 0.0,
            "ratio": None, "verdict": verdict, "expected": expected,
            "outcome": judging.outcome(verdict, expected), "message": message, "mode": mode,
            "probed": found.probed, "unprobed": found.unprobed,
            **({"gated": {t: float(f"{x:.3g}") for t, x in found.gated.items()}}
               if found.gated else {}),
            **({"fallback": note} if note else {})})
    return records


class DoesNotFit(RuntimeError):
    """A program that needs more device memory than the device has: not run at all (an
    out-of-memory run is slow: XLA logs its whole allocator state)."""


def _probe_deterministic(program, inputs, case, confirm):
    """The probe on a deterministic build; where its workspace does not fit (cuDNN's and TE's
    deterministic backward passes ask for tens of GiB on long or many-segment rows), once more
    after the harness lets go of the device buffers it keeps for other cases. A build that
    needs more than the whole device (cuDNN: 1 TiB at 1 x 32768) is not run at all."""
    need, limit = program.memory_bytes(), device_memory_bytes()
    if need is not None and limit is not None and need > limit:
        raise DoesNotFit(f"needs {need / 2**30:.1f} GiB of device memory (workspace included), "
                         f"more than the {limit / 2**30:.1f} GiB this device has")
    try:
        return leak_probe.probe(program, inputs, case, confirm=confirm)
    except Exception as exc:
        if "RESOURCE_EXHAUSTED" not in str(exc):
            raise
        asked, limit = requested_bytes(str(exc)), device_memory_bytes()
        if asked is not None and limit is not None and asked > limit:
            raise  # more than the whole device (TE asked for 128 GiB): letting go cannot help
    import gc
    leak_probe.perturbed.cache_clear()
    make_inputs.cache_clear()
    reference_for.cache_clear()
    gc.collect()
    return leak_probe.probe(program, inputs, case, confirm=confirm)


_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def requested_bytes(message: str) -> int | None:
    """The allocation an XLA out-of-memory error asked for ("...allocate 128.07GiB..")."""
    import re
    found = re.search(r"allocate ([0-9.]+)\s*(B|KiB|MiB|GiB|TiB)", message)
    return int(float(found.group(1)) * _UNITS[found.group(2)]) if found else None


_PROGRAMS: Programs | None = None


def _default_programs() -> Programs:
    global _PROGRAMS
    if _PROGRAMS is None:
        _PROGRAMS = Programs()
    return _PROGRAMS


def run_matrix(kernels: Iterable[Kernel], cases: Iterable[Case], platform: Platform,
               on_result: Callable[[Kernel, Case, KernelCaseResult], None] | None = None,
               programs: Programs | None = None, leak: bool = True) -> KernelCaseResult:
    """Cases outermost, grouped by shape, so each case's reference is computed once for all
    kernels and each shape's programs compile together, ahead of use."""
    kernels, cases = list(kernels), list(cases)
    programs = programs or _default_programs()
    first = {}
    for i, c in enumerate(cases):
        first.setdefault(c.shape_key, i)
    cases.sort(key=lambda c: first[c.shape_key])
    supported = [(k, c) for c in cases for k in kernels if not k.unsupported_reasons(c, platform)]
    programs.prefetch(supported)
    total = KernelCaseResult()
    # The next cases' inputs, and the leak probe's redrawn ones, are drawn while this one runs
    # (numpy draws without the GIL).
    def draw(case):
        make_inputs(case)
        if leak:
            leak_probe.draw_ahead(case)

    drawing = ThreadPoolExecutor(max_workers=INPUTS_AHEAD, thread_name_prefix="inputs")
    ahead = {c: drawing.submit(draw, c) for c in cases[:INPUTS_AHEAD]}
    try:
        for i, case in enumerate(cases):
            drawn = ahead.pop(case, None)
            if drawn is not None:
                start = time.perf_counter()
                drawn.exception()  # wait; a failed draw is drawn again, and recorded, per kernel
                programs.timing[INPUTS].wait_s += time.perf_counter() - start
            following = cases[i + INPUTS_AHEAD:i + INPUTS_AHEAD + 1]
            ahead.update({c: drawing.submit(draw, c) for c in following if c not in ahead})
            for kernel in kernels:
                start = time.perf_counter()
                result = run_kernel_case(kernel, case, platform, programs, leak)
                programs.timing[kernel.name].wall_s += time.perf_counter() - start
                total.records += result.records
                total.traces += result.traces
                if on_result:
                    on_result(kernel, case, result)
    finally:
        drawing.shutdown(wait=False, cancel_futures=True)
    return total

