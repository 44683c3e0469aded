"""The bench's goals, as statements with their numbers (reported, never asserted): the op within
3% of the raw packed call at every shape, at most 0.67x the causal-only call it replaces at the
seed shape, and its best path within 5% of the fastest correct entry. Which entry is the op, the
raw call or the replaced call is each entry's declared capability (entries.BenchEntry.goals)."""
from __future__ import annotations

from harness.tools.bench.entries import (
    AUTO,
    ENTRIES,
    OP_PATH,
    PATCH_AFTER,
    PATCH_BEFORE,
    RAW_BASE,
    RAW_FUSED,
    REPLACED,
    THE_OP,
    entry_with,
)
from harness.tools.bench.shapes import SEED_SHAPE

GOAL_OP_OVER_RAW = 0.03             # the op within 3% of the raw packed call
GOAL_OP_OVER_CAUSAL = 0.67          # the op at most 0.67x the causal-only call, at the seed shape
GOAL_OP_OVER_FASTEST = 0.05         # the op's best path within 5% of the fastest correct entry
GOAL_AUTO_OVER_FUSED = 0.03         # the auto mode within 3% of the faster raw fused call
GOAL_PATCH_OVER_BEFORE = 0.67       # MaxText's op after the patch <= 0.67x before, seed shape


def _goal(goal, shape, value, limit, met, text) -> dict:
    return {"goal": goal, "shape": shape, "value": value, "limit": limit, "met": met,
            "text": text}


def _why(row) -> str:
    return row["skipped"] or row["error"] or "not timed" if row else "not selected"


def _met(met: bool) -> str:
    return "met" if met else "not met"


def _op_vs_raw(shape: str, rows: dict, op_name: str, raw_name: str) -> dict:
    op, raw = rows.get(op_name), rows.get(raw_name)
    if op and raw and op["median_ms"] and raw["median_ms"]:
        d = op["median_ms"] / raw["median_ms"] - 1
        met = d <= GOAL_OP_OVER_RAW
        return _goal("op_vs_raw_packed", shape, d, GOAL_OP_OVER_RAW, met,
                     f"op vs raw packed at {shape}: {d:+.1%} ({op['median_ms']:.3f} vs "
                     f"{raw['median_ms']:.3f} ms; goal <= +{GOAL_OP_OVER_RAW:.0%}: {_met(met)})")
    missing = op_name if not (op and op["median_ms"]) else raw_name
    return _goal("op_vs_raw_packed", shape, None, GOAL_OP_OVER_RAW, None,
                 f"op vs raw packed at {shape}: not measured ({missing}: "
                 f"{_why(rows.get(missing))})")


def _op_vs_causal(res: dict, rows: dict, op_name: str, replaced_name: str) -> dict:
    shape, r = res["shape"], res["op_vs_causal_only"]
    if r is not None:
        met = r <= GOAL_OP_OVER_CAUSAL
        return _goal("op_vs_causal_only", shape, r, GOAL_OP_OVER_CAUSAL, met,
                     f"op vs causal-only at the seed shape: {r:.2f}x "
                     f"({rows[op_name]['median_ms']:.3f} vs "
                     f"{rows[replaced_name]['median_ms']:.3f} ms; goal <= "
                     f"{GOAL_OP_OVER_CAUSAL:.2f}x: {_met(met)})")
    op = rows.get(op_name)
    missing = op_name if not (op and op["median_ms"]) else replaced_name
    return _goal("op_vs_causal_only", shape, None, GOAL_OP_OVER_CAUSAL, None,
                 f"op vs causal-only at the seed shape: not measured ({missing}: "
                 f"{_why(rows.get(missing))})")


def _op_vs_fastest(res: dict, declared: dict) -> dict:
    shape = res["shape"]
    timed = [(e, declared.get(e["entry"])) for e in res["entries"] if e["median_ms"]]
    correct = [(e, spec) for e, spec in timed if spec is None or spec.correct]
    ops = [e for e, spec in correct if spec is not None and OP_PATH in spec.goals]
    if not correct or not ops:
        return _goal("op_vs_fastest", shape, None, GOAL_OP_OVER_FASTEST, None,
                     f"fastest at {shape}: not measured (no op path timed)")
    fastest = min((e for e, _ in correct), key=lambda e: e["median_ms"])
    best = min(ops, key=lambda e: e["median_ms"])
    d = best["median_ms"] / fastest["median_ms"] - 1
    met = d <= GOAL_OP_OVER_FASTEST
    if fastest is best:
        text = (f"fastest at {shape}: {fastest['entry']} {fastest['median_ms']:.3f} ms, an "
                f"op path (goal within {GOAL_OP_OVER_FASTEST:.0%}: met)")
    else:
        text = (f"fastest at {shape}: {fastest['entry']} {fastest['median_ms']:.3f} ms; op "
                f"{best['median_ms']:.3f} ms via {best['entry']} ({d:+.1%}, goal within "
                f"{GOAL_OP_OVER_FASTEST:.0%}: {_met(met)})")
    return _goal("op_vs_fastest", shape, d, GOAL_OP_OVER_FASTEST, met, text)


def _auto_vs_fused(res: dict, declared: dict) -> dict:
    """The op's auto mode against the faster of the raw fused calls (packed cuDNN, TE THD)."""
    shape = res["shape"]
    timed = {e["entry"]: e for e in res["entries"] if e["median_ms"]}
    auto = [timed[n] for n, spec in declared.items() if AUTO in spec.goals and n in timed]
    fused = [timed[n] for n, spec in declared.items() if RAW_FUSED in spec.goals and n in timed]
    if not auto or not fused:
        return _goal("auto_vs_fused", shape, None, GOAL_AUTO_OVER_FUSED, None,
                     f"auto mode at {shape}: not measured (auto or raw fused calls not timed)")
    best = min(fused, key=lambda e: e["median_ms"])
    d = auto[0]["median_ms"] / best["median_ms"] - 1
    met = d <= GOAL_AUTO_OVER_FUSED
    return _goal("auto_vs_fused", shape, d, GOAL_AUTO_OVER_FUSED, met,
                 f"auto mode at {shape}: {auto[0]['median_ms']:.3f} ms vs {best['entry']} "
                 f"{best['median_ms']:.3f} ms ({d:+.1%}; goal within "
                 f"{GOAL_AUTO_OVER_FUSED:.0%}: {_met(met)})")


def _patch_after_vs_before(res: dict, declared: dict) -> dict:
    """MaxText's own op after the patch against before it, at the seed shape."""
    shape = res["shape"]
    timed = {e["entry"]: e for e in res["entries"] if e["median_ms"]}
    pick = lambda goal: next((timed[n] for n, spec in declared.items()
                              if goal in spec.goals and n in timed), None)
    before, after = pick(PATCH_BEFORE), pick(PATCH_AFTER)
    if before is None or after is None:
        return _goal("patch_after_vs_before", shape, None, GOAL_PATCH_OVER_BEFORE, None,
                     f"MaxText's op after/before the patch at {shape}: not measured (maxtext "
                     "not installed, or an entry not timed)")
    r = after["median_ms"] / before["median_ms"]
    met = r <= GOAL_PATCH_OVER_BEFORE
    return _goal("patch_after_vs_before", shape, r, GOAL_PATCH_OVER_BEFORE, met,
                 f"MaxText's op after/before the patch at {shape}: {r:.2f}x "
                 f"({after['median_ms']:.3f} vs {before['median_ms']:.3f} ms; goal <= "
                 f"{GOAL_PATCH_OVER_BEFORE:.2f}x: {_met(met)})")


def goal_checks(results: list[dict], entries=ENTRIES) -> list[dict]:
    """The goals as statements with numbers (never asserted), per shape's result. `entries`:
    the declared bench entries, whose capabilities say which row is the op, the raw packed call
    and the replaced call; rows of other kernels are correct entries that stand for no goal."""
    declared = {e.name: e for e in entries}
    op_name, raw_name, replaced_name = (entry_with(g, entries).name
                                        for g in (THE_OP, RAW_BASE, REPLACED))
    checks = []
    for res in results:
        rows = {e["entry"]: e for e in res["entries"]}
        checks.append(_op_vs_raw(res["shape"], rows, op_name, raw_name))
        if res["shape"] == SEED_SHAPE:
            checks.append(_op_vs_causal(res, rows, op_name, replaced_name))
            if any(PATCH_AFTER in e.goals for e in entries):
                checks.append(_patch_after_vs_before(res, declared))
        checks.append(_op_vs_fastest(res, declared))
        if any(AUTO in e.goals for e in entries):
            checks.append(_auto_vs_fused(res, declared))
    return checks
