"""A shape's results: per entry its samples' median, min and spread, its ratio to the raw packed
call (else the first entry timed), useful TFLOP/s and its outputs' distance from the op's, as a
JSON-ready dict; and the table printed for it."""
from __future__ import annotations

import statistics
import sys

from harness.tools.bench.entries import RAW_BASE, REPLACED, THE_OP
from harness.tools.bench.plans import GiB, Plan
from harness.tools.bench.shapes import Shape, useful_flops
from harness.tools.bench.timing import Timing


def _row(p: Plan, t: Timing | None, total_flops: int) -> dict:
    """One entry's row of the report."""
    row = {"entry": p.entry.name, "kernel": p.kernel.name if p.kernel else p.entry.name,
           "role": p.entry.role, "via": p.via,
           "estimated_peak_gib": round(p.need_bytes / GiB, 3),
           "skipped": "; ".join(p.reasons) or None, "error": None, "median_ms": None,
           "min_ms": None, "max_ms": None, "spread": None, "times_ms": [],
           "ratio": None, "ratio_base": None, "ratio_to_raw_packed": None,
           "useful_tflops": None, "calls_per_sample": None, "max_abs_diff_vs_op": None,
           "xla_memory": None, "notes": p.notes}
    if t is not None:
        row["error"] = t.error
        row["max_abs_diff_vs_op"] = t.diff
        row["calls_per_sample"] = t.calls
        row["xla_memory"] = t.memory
        if t.times and t.error is None:
            med = statistics.median(t.times)
            row.update(median_ms=med * 1e3, min_ms=min(t.times) * 1e3,
                       max_ms=max(t.times) * 1e3,
                       spread=(max(t.times) - min(t.times)) / med,
                       times_ms=[x * 1e3 for x in t.times],
                       useful_tflops=total_flops / med / 1e12)
    return row


def _timed_with(plans: list[Plan], rows: list[dict], goal: str) -> dict | None:
    """The timed row of the first entry that stands for `goal`."""
    return next((row for p, row in zip(plans, rows)
                 if goal in p.entry.goals and row["median_ms"] is not None), None)


def shape_result(shape: Shape, plans: list[Plan], timings: list[Timing]) -> dict:
    case = shape.case
    forward, total = useful_flops(shape.lengths, case.heads, case.head_dim)
    by_plan = {id(t.plan): t for t in timings}
    entries = [_row(p, by_plan.get(id(p)), total) for p in plans]
    timed = [e for e in entries if e["median_ms"] is not None]
    raw = _timed_with(plans, entries, RAW_BASE)
    base = raw or (timed[0] if timed else None)
    for e in timed:
        e["ratio"] = e["median_ms"] / base["median_ms"]
        e["ratio_base"] = base["entry"]
        if raw is not None:
            e["ratio_to_raw_packed"] = e["ratio"]
    op, replaced = _timed_with(plans, entries, THE_OP), _timed_with(plans, entries, REPLACED)
    op_vs_causal = (op["median_ms"] / replaced["median_ms"]
                    if op is not None and replaced is not None else None)
    return {"shape": shape.name, "label": shape.label, "case_id": case.id,
            "batch": case.batch, "seq_len": case.seq_len, "heads": case.heads,
            "kv_heads": case.kv_heads, "head_dim": case.head_dim, "dtype": case.dtype,
            "segments": len(shape.lengths), "max_segments": shape.max_segments,
            "segment_lengths": list(shape.lengths),
            "useful_flops_forward": forward, "useful_flops": total,
            "ratio_base": base["entry"] if base else None,
            "op_vs_causal_only": op_vs_causal, "entries": entries}


def _si(n: float) -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= factor:
            return f"{n / factor:.3g} {prefix}"
    return f"{n:.3g} "


def _fmt(value, spec: str, width: int) -> str:
    return f"{value:{width}{spec}}" if value is not None else " " * (width - 1) + "-"


def print_shape(res: dict, repeats: int, out=None) -> None:
    out = out or sys.stdout
    print(res["label"], file=out)
    print(f"  forward+backward, median of {repeats} samples; useful work "
          f"{_si(res['useful_flops'])}FLOP per call; ratios against {res['ratio_base'] or '-'}",
          file=out)
    print(f"  {'entry':34s} {'via':8s} {'median ms':>10s} {'min ms':>10s} {'spread':>7s} "
          f"{'ratio':>7s} {'TFLOP/s':>8s} {'max|Δout| vs op':>16s}", file=out)
    for e in res["entries"]:
        head = f"  {e['entry']:34s} {e['via']:8s}"
        if e["skipped"]:
            print(f"{head} skip: {e['skipped']}", file=out)
        elif e["error"]:
            print(f"{head} error: {e['error']}", file=out)
        elif e["median_ms"] is None:
            print(f"{head} not timed", file=out)
        else:
            notes = e["notes"] + ([f"{e['calls_per_sample']} calls/sample"]
                                  if (e["calls_per_sample"] or 1) > 1 else [])
            notes = f"  ({'; '.join(notes)})" if notes else ""
            print(f"{head} {e['median_ms']:10.3f} {e['min_ms']:10.3f} {e['spread']:7.1%} "
                  f"{e['ratio']:6.2f}x {_fmt(e['useful_tflops'], '.3g', 8)} "
                  f"{_fmt(e['max_abs_diff_vs_op'], '.3g', 16)}{notes}", file=out)
    if res["op_vs_causal_only"] is not None:
        print(f"  op vs causal-only: {res['op_vs_causal_only']:.2f}x", file=out)
    out.flush()
