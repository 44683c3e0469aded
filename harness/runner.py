"""Runs kernels on cases and turns their differences from the truth into per-segment records.

One record per kernel, case, check (out, dq, dk, dv) and segment. Inputs and segment ids are
arguments of jitted programs, so each kernel compiles once per shape, not per layout or seed.
"""
from __future__ import annotations

import functools
import traceback
from dataclasses import dataclass
from typing import Callable, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from harness import leak_probe
from harness.cases import Case, make_inputs
from harness.oracle import dense_attention
from harness.registry import CHECKS, LEAK, Kernel, Platform
from harness.tolerance import tolerance

# A row's per-token errors are kept for plotting when a segment in it gets this close to failing,
# for the checks the HTML report plots, to 3 significant digits.
TRACE_RATIO = 0.5
TRACED_CHECKS = ("out", "dq")

OUTCOMES_OK = ("ok", "caught", "skip", "known")


def _with_gradients(fn: Callable) -> Callable:
    """(q, k, v, seg, cotangent) -> (out, dq, dk, dv) through jax.vjp."""
    def run(q, k, v, seg, ct):
        out, vjp = jax.vjp(lambda q, k, v: fn(q, k, v, seg), q, k, v)
        return (out, *vjp(ct.astype(out.dtype)))
    return run


@functools.lru_cache(maxsize=None)
def _reference_program(scale: float, causal: bool, truth: bool):
    return jax.jit(_with_gradients(functools.partial(
        dense_attention, scale=scale, causal=causal, truth=truth)))


@functools.lru_cache(maxsize=None)
def _kernel_program(kernel: Kernel, scale: float, causal: bool, max_segments: int | None,
                    backward: bool):
    extra = {"max_segments": max_segments} if max_segments is not None else {}

    def fn(q, k, v, seg):
        out = kernel.fn(q, k, v, seg, causal=causal, scale=scale, **extra)
        if out.shape != q.shape:
            raise ValueError(f"{kernel.name}: output shape {out.shape} != query shape {q.shape}")
        return out

    if backward:
        return jax.jit(_with_gradients(fn))
    return jax.jit(lambda q, k, v, seg, ct: (fn(q, k, v, seg),))


@jax.jit
def _token_errors(x, ref):
    """Per token ([B, T]): max abs error (inf where non-finite), summed abs error, and the
    count of non-finite values, over heads and head dims."""
    x = x.astype(jnp.float32)
    finite = jnp.isfinite(x)
    diff = jnp.abs(x - ref)
    return (jnp.where(finite, diff, jnp.inf).max(axis=(2, 3)),
            jnp.where(finite, diff, 0.0).sum(axis=(2, 3)),
            (~finite).sum(axis=(2, 3)))


@dataclass
class Reference:
    """The truth for one case, and how far the same-dtype peer lands from it, per token."""
    truth: tuple
    peer_token_err: dict[str, np.ndarray]
    scale: dict[str, float]


@functools.lru_cache(maxsize=2)
def reference_for(case: Case) -> Reference:
    inputs = make_inputs(case)
    args = (inputs.query, inputs.key, inputs.value, inputs.segment_ids, inputs.cotangent)
    truth = _reference_program(case.scale, case.causal, True)(*args)
    peer = _reference_program(case.scale, case.causal, False)(*args)
    valid = jnp.asarray(case.segment_ids > 0)[:, :, None, None]
    peer_err, scale = {}, {}
    for check, t, p in zip(CHECKS, truth, peer):
        peer_err[check] = np.asarray(_token_errors(p, t)[0])
        scale[check] = float(jnp.where(valid, jnp.abs(t), 0).max())
    return Reference(truth=truth, peer_token_err=peer_err, scale=scale)


def _base(kernel: Kernel, case: Case) -> dict:
    return {"kernel": kernel.name, "case_id": case.id, "layout": case.layout,
            "family": case.family, "dtype": case.dtype, "batch": case.batch,
            "seq_len": case.seq_len, "heads": case.heads, "kv_heads": case.kv_heads,
            "head_dim": case.head_dim}


def _outcome(verdict: str, expected: str) -> str:
    if verdict in ("skip", "error"):
        return verdict
    if expected == "either":
        return "ok"
    if verdict == expected:
        return "ok" if verdict == "pass" else "caught"
    return "fail" if verdict == "fail" else "missed"


def _status_record(kernel, case, verdict, message, check="*", expected="pass",
                   outcome=None) -> dict:
    return {**_base(kernel, case), "check": check, "segment": None, "row": None,
            "verdict": verdict, "expected": expected, "outcome": outcome or verdict,
            "message": message}


_HLO_CHECKED: dict[tuple, list[str]] = {}


def missing_hlo_markers(kernel: Kernel, program, args) -> list[str]:
    """Markers absent from the program handed to XLA (checked once per kernel and shape).

    The lowered module is what XLA compiles; XLA never drops a custom call, and a cuDNN call it
    cannot plan fails compilation rather than falling back. So a fused kernel's custom call in
    the lowered text proves it ran; its absence means something above it chose another path.
    """
    key = (kernel.name, tuple((a.shape, str(a.dtype)) for a in args))
    if key not in _HLO_CHECKED:
        lowered = program.lower(*args)
        text = lowered.as_text()
        if any(m not in text for m in kernel.hlo_markers):
            text += lowered.compile().as_text()  # some backends name the call only there
        _HLO_CHECKED[key] = [m for m in kernel.hlo_markers if m not in text]
    return _HLO_CHECKED[key]


@dataclass
class KernelCaseResult:
    records: list[dict]
    traces: list[dict]


def _elements_per_token(case: Case, check: str) -> int:
    return (case.heads if check in ("out", "dq") else case.kv_heads) * case.head_dim


def _check_records(kernel, case, check, errs, ref: Reference) -> KernelCaseResult:
    tok_max, tok_sum, tok_bad = (np.asarray(e) for e in errs)
    records, tolerances, flagged_rows = [], {}, set()
    for seg in case.segments:
        sl = (seg.row, slice(seg.start, seg.stop))
        seg_err = tok_max[sl]
        worst = int(np.argmax(seg_err))
        max_err = float(seg_err[worst])
        peer_err = float(ref.peer_token_err[check][sl].max())
        tol = tolerances[seg] = tolerance(check, case.dtype, peer_err, ref.scale[check])
        nonfinite = int(tok_bad[sl].sum())
        ratio = max_err / tol if nonfinite == 0 else float("inf")
        verdict = "pass" if ratio <= 1.0 else "fail"
        expected = kernel.expected(case, check, seg)
        records.append({
            **_base(kernel, case), "check": check, "row": seg.row, "segment": seg.number,
            "segment_label": seg.label, "start": seg.start, "length": seg.length,
            "max_abs_err": max_err if nonfinite == 0 else None,
            "mean_abs_err": float(tok_sum[sl].sum()) / (seg.length * _elements_per_token(case, check)),
            "worst_token": seg.start + worst, "nonfinite": nonfinite, "peer_err": peer_err,
            "tolerance": tol, "ratio": ratio if np.isfinite(ratio) else None,
            "verdict": verdict, "expected": expected, "outcome": _outcome(verdict, expected),
        })
        if check in TRACED_CHECKS and not ratio <= TRACE_RATIO:
            flagged_rows.add(seg.row)
    traces = []
    for row in sorted(flagged_rows):
        segs = [s for s in case.segments if s.row == row]
        traces.append({
            "kernel": kernel.name, "case_id": case.id, "check": check, "row": row,
            "token_err": [None if not np.isfinite(x) else float(f"{x:.3g}") for x in tok_max[row]],
            "segments": [{"number": s.number, "start": s.start, "length": s.length} for s in segs],
            "tolerance": {str(s.number): tolerances[s] for s in segs},
        })
    return KernelCaseResult(records, traces)


def run_kernel_case(kernel: Kernel, case: Case, platform: Platform) -> KernelCaseResult:
    """Every check of one kernel on one case; unsupported -> skip, raising -> error."""
    reasons = kernel.unsupported_reasons(case, platform)
    if reasons:
        return KernelCaseResult([_status_record(kernel, case, "skip", "; ".join(reasons))], [])
    try:
        ref = reference_for(case)
        inputs = make_inputs(case)
        program = _kernel_program(kernel, case.scale, case.causal,
                                  case.max_segments if kernel.takes_max_segments else None,
                                  kernel.backward)
        args = (inputs.query, inputs.key, inputs.value, inputs.segment_ids, inputs.cotangent)
        results = program(*args)
        jax.block_until_ready(results)
        errs = [_token_errors(r, t) for r, t in zip(results, ref.truth)]
        missing = missing_hlo_markers(kernel, program, args) if kernel.hlo_markers else []
        if missing:
            raise AssertionError(f"program lacks {missing}: the fused kernel did not run")
    except Exception as exc:  # a kernel that raises is an error, never a skip
        message = f"{type(exc).__name__}: {exc}".strip()
        tb = traceback.format_exc(limit=-3)
        known = kernel.expect_error is not None and kernel.expect_error in message
        record = _status_record(kernel, case, "error", message[:2000],
                                expected="error" if kernel.expect_error else "pass",
                                outcome="known" if known else "error")
        return KernelCaseResult([{**record, "traceback": tb[-4000:]}], [])
    out = KernelCaseResult([], [])
    if kernel.expect_error is not None:
        out.records.append(_status_record(
            kernel, case, "pass", f"expected upstream error {kernel.expect_error!r} did not occur",
            expected="error", outcome="missed"))
    for check, err in zip(CHECKS, errs):
        part = _check_records(kernel, case, check, err, ref)
        out.records += part.records
        out.traces += part.traces
    if not kernel.backward:
        out.records += [_status_record(kernel, case, "skip", "kernel declares no backward", check=c)
                        for c in CHECKS[1:]]
    out.records += _leak_records(kernel, case, program, inputs, results)
    return out


def _leak_records(kernel, case, program, inputs, results) -> list[dict]:
    """The tolerance-free leak probe (harness.leak_probe), one record per segment."""
    try:
        leaks, nondeterministic = leak_probe.probe(program, inputs, case, results)
    except Exception as exc:  # the kernel ran once already: a failure here is the kernel's
        return [_status_record(kernel, case, "error", f"leak probe: {type(exc).__name__}: {exc}",
                               check=LEAK)]
    if len(nondeterministic) == len(results):
        return [_status_record(kernel, case, "skip", "leak probe needs bitwise-deterministic "
                               f"outputs; {', '.join(nondeterministic)} differ run to run",
                               check=LEAK)]
    note = (f"; not probed (differ run to run): {', '.join(nondeterministic)}"
            if nondeterministic else "")
    records = []
    for leak in leaks:
        seg = leak.segment
        verdict = "fail" if leak.leaked else "pass"
        expected = kernel.expected(case, LEAK, seg)
        message = (f"changed while the segment was untouched: {', '.join(leak.leaked)}"
                   if leak.leaked else "bitwise unchanged") + note
        records.append({
            **_base(kernel, case), "check": LEAK, "row": seg.row, "segment": seg.number,
            "segment_label": seg.label, "start": seg.start, "length": seg.length,
            "max_abs_err": leak.max_change, "worst_token": leak.first_token, "tolerance": 0.0,
            "ratio": None, "verdict": verdict, "expected": expected,
            "outcome": _outcome(verdict, expected), "message": message,
        })
    return records


def run_matrix(kernels: Iterable[Kernel], cases: Iterable[Case], platform: Platform,
               on_result: Callable[[Kernel, Case, KernelCaseResult], None] | None = None
               ) -> KernelCaseResult:
    """Cases outermost, so each case's reference is computed once for all kernels."""
    kernels = list(kernels)
    total = KernelCaseResult([], [])
    for case in cases:
        for kernel in kernels:
            result = run_kernel_case(kernel, case, platform)
            total.records += result.records
            total.traces += result.traces
            if on_result:
                on_result(kernel, case, result)
    return total


def is_ok(record: dict) -> bool:
    return record["outcome"] in OUTCOMES_OK
