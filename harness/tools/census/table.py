"""The census table from every part under <report-dir>/parts/: one row per kernel, from the part
that measured it most (parts run on different machines are copied into one folder; a kernel a
part could only skip, e.g. for want of its library, is taken from the part that ran it).

Every verdict comes from the records as judged (harness.judge.tallies, the vocabulary); this
module only groups them: a column's cell is the worst outcome over its cases, with the count of
cases by outcome (a case's outcome is the worst of its records)."""
from __future__ import annotations

import datetime
import json
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

from harness.judge import tallies
from harness.judge import vocabulary as v
from harness.judge.record import Record
from harness.tools.census.findings import kernel_files
from harness.model.features import FEATURE_NAMES
from harness.tools.census.options import census_names

LONG_ROW = 8192
GiB = 2 ** 30
_GRADS = ("dq", "dk", "dv")

# (key, title, which records belong to the column); head-dim columns are added per head dim.
COLUMNS = (
    ("all", "all cases", lambda r: True),
    ("packed", "packed", lambda r: r.family == "packed"),
    ("unaligned", "unaligned", lambda r: r.family == "unaligned"),
    ("padded", "padded (before/between)", lambda r: r.family == "padded"),
    ("bidirectional", "bidirectional", lambda r: not r.causal),
    ("long", f"long rows (>= {LONG_ROW})", lambda r: (r.seq_len or 0) >= LONG_ROW),
    ("float16", "float16", lambda r: r.dtype == "float16"),
    ("gqa", "GQA/MQA", lambda r: r.heads is not None and r.heads != r.kv_heads),
    # The forward-mode check's records alone ("—": the kernel declares no forward mode).
    ("forward", "forward mode (jvp)", lambda r: r.check == v.JVP.name),
)
SHOWN = {v.FAIL: "FAIL", v.MISSED: "MISSED", v.ERROR: "ERROR"}   # bad outcomes, as the grid


@dataclass
class Part:
    name: str
    path: Path
    header: dict = field(default_factory=dict)
    records: list[Record] = field(default_factory=list)
    bench: dict | None = None
    versions: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)


def _json(path: Path):
    return json.loads(path.read_text()) if path.exists() else None


def read_parts(report_dir: Path) -> list[Part]:
    from harness.store import report_file as rec
    parts = []
    for path in sorted(p for p in (report_dir / "parts").glob("*") if p.is_dir()):
        part = Part(path.name, path, bench=_json(path / "bench.json"),
                    versions=_json(path / "versions.json") or {},
                    meta=_json(path / "part.json") or {})
        nightly = path / "nightly"
        if rec.report_files(nightly):
            part.header, part.records = rec.read(nightly)   # committed parts are gzipped
        parts.append(part)
    return parts


def assign(parts: list[Part]) -> dict[str, tuple[Part, list[Record]]]:
    """kernel -> (the part that measured it most, its records there); ties: the later part."""
    best: dict[str, tuple[tuple, Part, list[Record]]] = {}
    for index, part in enumerate(parts):
        by_kernel: dict[str, list[Record]] = defaultdict(list)
        for r in part.records:
            by_kernel[r.kernel].append(r)
        for kernel, rows in by_kernel.items():
            score = (sum(r.verdict != v.SKIP for r in rows), index)
            if kernel not in best or score >= best[kernel][0]:
                best[kernel] = (score, part, rows)
    return {k: (p, rows) for k, (_, p, rows) in best.items()}


def outcome_word(outcome: str | None) -> str:
    return "—" if outcome is None else SHOWN.get(outcome, outcome)


def column_cell(records: list[Record]) -> dict:
    """The worst outcome over the column's cases, and its cases counted by their outcome."""
    by_case: dict[str, list[Record]] = defaultdict(list)
    for r in records:
        by_case[r.case_id].append(r)
    per_case = Counter(tallies.worst_outcome(rows) for rows in by_case.values())
    counts = {o: per_case[o] for o in v.SEVERITY if per_case[o]}   # worst first
    worst = tallies.worst_outcome(records)
    if not counts:
        text = "—"
    else:
        text = ", ".join(f"{outcome_word(o)} {n}" for o, n in counts.items())
    return {"worst": worst, "bad": worst in v.BAD, "counts": counts, "cases": len(by_case),
            "text": text}


def _violation_text(tensor: str, kinds: Counter, biggest: float, rows: int) -> str:
    if kinds.get("non-finite"):
        return f"{tensor} NaN/Inf in {kinds['non-finite']}/{rows} rows"
    return f"{tensor} non-zero (max {biggest:.3g}) in {kinds['non-zero']}/{rows} rows"


def padding_summary(records: list[Record], convention: str) -> dict:
    """What the kernel wrote at padding positions, from the padding records' violations."""
    rows = [r for r in records if r.check == v.PADDING.name and r.measured]
    if not rows:
        return {"rows": 0, "violations": {}, "text": "—"}
    kinds: dict[str, Counter] = defaultdict(Counter)
    biggest: dict[str, float] = defaultdict(float)
    for r in rows:
        for tensor, d in (r.violations or {}).items():
            kinds[tensor][d["kind"]] += 1
            biggest[tensor] = max(biggest[tensor], d.get("max") or 0.0)
    words = [_violation_text(t, kinds[t], biggest[t], len(rows)) for t in _GRADS if kinds[t]]
    if not words:
        words.append("grads 0")
    if kinds["out"]:
        words.append(_violation_text("out", kinds["out"], biggest["out"], len(rows)))
    else:
        words.append({v.PAD_ZERO: "out 0", v.PAD_UNDEFINED: "out not checked (undefined)"}
                     .get(convention, "out finite"))
    if kinds[v.JVP.name]:   # the output's tangent, held to the output's convention
        words.append(_violation_text(v.JVP.name, kinds[v.JVP.name], biggest[v.JVP.name],
                                     len(rows)))
    text = ", ".join(words) + f" ({len(rows)} padded rows)"
    return {"rows": len(rows), "convention": convention, "text": text,
            "violations": {t: dict(k) for t, k in kinds.items()}}


def backward_summary(kernel: str, records: list[Record]) -> dict:
    """Whether the probed build's results were bitwise reproducible run to run (no tensor
    gated above its noise, left unprobed or set apart by two runs of one perturbation), and
    the smallest leak the probe could see."""
    leaks = [r for r in records if r.check == v.LEAK.name and r.probed is not None]
    detect = {t: frac for t, frac in tallies.detectable(records).get(kernel, {}).items()}
    detect_text = ", ".join(f"{t} {'bitwise' if f == 0 else format(f, '.2g')}"
                            for t, f in detect.items()) or "—"
    if not leaks:
        return {"reproducible": None, "text": "not probed", "detectable": detect,
                "detectable_text": detect_text}
    gated = {t: n for (k, t), (n, _) in tallies.gated(records).items() if k == kernel}
    worst = {t: x for (k, t), (_, x) in tallies.gated(records).items() if k == kernel}
    unprobed = {t: n for (k, t), n in tallies.unprobed(records).items() if k == kernel}
    unsteady = {t: n for (k, t), n in tallies.unsteady(records).items() if k == kernel}
    modes = sorted({r.mode for r in leaks if r.mode})
    build = f"{'/'.join(modes) or 'default'} build"
    if not gated and not unprobed and not unsteady:
        text = f"yes: bitwise ({build})"
    else:
        quiet = tallies.quiet(records)
        words = [f"{t} differs run to run ({n} segments, gated at <= {worst[t]:.2g})"
                 if quiet.get((kernel, t), 0) < n else
                 f"{t} gated with no noise seen ({n} segments, at <= {worst[t]:.2g}: a build "
                 "not reproducible by construction)" for t, n in gated.items()]
        words += [f"{t} unprobed ({n} segments)" for t, n in unprobed.items()]
        words += [f"{t} differed between two runs of one perturbation (in the probes of {n} "
                  "segments)"
                  for t, n in unsteady.items()]
        text = f"no: {'; '.join(words)} ({build})"
    return {"reproducible": not gated and not unprobed and not unsteady, "modes": modes,
            "gated": gated, "unprobed": unprobed, "unsteady": unsteady, "text": text,
            "detectable": detect, "detectable_text": detect_text,
            "false_alarm": tallies.false_alarms(records).get(kernel)}


def shape_key(res: dict) -> str:
    return f"{res['shape']} {res['batch']}x{res['seq_len']}"


def bench_cell(entry: dict) -> dict:
    """One kernel at one bench shape: time, useful TFLOP/s, XLA's memory analysis."""
    memory = entry.get("xla_memory")
    cell = {"median_ms": entry.get("median_ms"), "useful_tflops": entry.get("useful_tflops"),
            "spread": entry.get("spread"), "xla_memory": memory,
            "skipped": entry.get("skipped"), "error": entry.get("error")}
    if entry.get("skipped"):
        cell["text"] = "skip"
    elif entry.get("error"):
        cell["text"] = "ERROR"
    elif entry.get("median_ms") is None:
        cell["text"] = "not timed"
    else:
        cell["text"] = f"{entry['median_ms']:.3g} ms, {entry['useful_tflops']:.3g} TFLOP/s"
    cell["memory_text"] = "—" if not memory else f"{memory['total'] / GiB:.3g} GiB"
    return cell


def bench_shapes(parts: list[Part]) -> list[dict]:
    shapes = {}
    for part in parts:
        for res in (part.bench or {}).get("results", []):
            shapes.setdefault(shape_key(res), {"key": shape_key(res), "label": res["label"],
                                               "useful_flops": res["useful_flops"]})
    return list(shapes.values())


def bench_row(kernel: str, part: Part, parts: list[Part]) -> dict[str, dict]:
    """The kernel's bench cells: from its own part, else from any part that timed it."""
    out = {}
    for source in [part] + [p for p in parts if p is not part]:
        for res in (source.bench or {}).get("results", []):
            entry = next((e for e in res["entries"] if e.get("kernel") == kernel), None)
            if entry is not None and shape_key(res) not in out:
                out[shape_key(res)] = dict(bench_cell(entry), part=source.name)
    return out


def repro_files(report_dir: Path, kernel: str) -> list[str]:
    """Every reproducer script of the kernel: one per feature set it fails on, its error's."""
    return [f"repro/{p.name}" for p in kernel_files(report_dir / "repro", kernel)]


def feature_cell(records: list[Record], feature: str) -> dict:
    """One kernel on the cases asking for one feature: ok (honoured), refuses, FAIL (with
    what was dropped, where the records diagnose it), known (a declared upstream drop), ERROR,
    or not taken (its API has no argument for it: skipped), with the reason."""
    def about_another(r: Record) -> bool:
        # A refusal or a skip that names another feature of a combined case says nothing
        # about this one.
        if r.outcome == v.REFUSED:
            return not r.message.startswith(f"refused {feature} ")
        if r.outcome == v.SKIP and r.message.startswith("does not take "):
            return feature not in r.message.split(" (", 1)[0]
        return False
    cases = {r.case_id for r in records if r.features and feature in r.features.split("+")
             and not about_another(r)}
    everything = [r for r in records if r.case_id in cases]
    if not everything:
        return {"word": "—", "worst": None, "bad": False, "text": "—", "cases": 0}
    # The word comes from the cases that ask for this feature alone, where there are any: what
    # a case combining it with another shows may be the other's doing (the counts show all).
    alone = [r for r in everything if r.features == feature]
    mine = alone or everything
    worst = tallies.worst_outcome(mine)
    cases = len({r.case_id for r in everything})
    refused = [r for r in mine if r.outcome == v.REFUSED]
    diagnosed = [r.diagnosis for r in mine if r.diagnosis and r.outcome in (v.FAIL, v.KNOWN)]
    known = [r.message for r in mine if r.outcome == v.KNOWN]
    if worst == v.SKIP:
        word, why = "not taken", next((r.message for r in mine if r.outcome == v.SKIP), "")
    elif worst in (v.FAIL, v.MISSED, v.ERROR):
        word = SHOWN.get(worst, worst)
        why = diagnosed[0] if diagnosed else next(r.message for r in mine if r.outcome == worst)
    elif known:
        # A declared upstream drop or crash, reproduced (whatever else the case shows: the
        # segment-id bug a kernel is caught for ranks above it in severity).
        word, why = "known", (diagnosed[0] + "; " if diagnosed else "") + known[0]
    elif refused and worst == v.REFUSED:
        word, why = "refuses", refused[0].message
    elif worst == v.CAUGHT:
        word, why = "caught", next(r.message for r in mine if r.outcome == v.CAUGHT)
    else:
        word, why = "ok", ""
    per_case = Counter(tallies.worst_outcome([r for r in everything if r.case_id == c])
                       for c in {r.case_id for r in everything})
    counts = ", ".join(f"{outcome_word(o)} {n}" for o, n in per_case.items())
    text = f"{word} ({counts})" + (f": {why[:160]}" if why else "")
    return {"word": word, "worst": worst, "bad": worst in v.BAD, "text": text, "cases": cases,
            "reason": why}


def kernel_row(kernel: str, part: Part, records: list[Record], parts: list[Part],
               report_dir: Path, known) -> dict:
    head_dims = sorted({r.head_dim for r in records if r.head_dim})
    cells = {key: column_cell([r for r in records if keep(r)]) for key, _, keep in COLUMNS}
    cells.update({f"d{d}": column_cell([r for r in records if r.head_dim == d])
                  for d in head_dims})
    registered = known.get(kernel)
    if registered is not None and registered.forward_mode and not cells["forward"]["cases"]:
        # It declares forward mode, and no case reached the check (every case skipped, refused
        # or raised before it): not "—", which says the path offers no jax.jvp.
        cells["forward"] = {**cells["forward"], "text": "not reached"}
    convention = registered.padding_output if registered else v.PAD_FINITE
    return {"kernel": kernel, "part": part.name,
            "also_in": [p.name for p in parts if p is not part
                        and any(r.kernel == kernel for r in p.records)],
            "description": registered.description if registered else "",
            "cells": cells, "outcomes": tallies.counts(records),
            "padding": padding_summary(records, convention),
            "backward": backward_summary(kernel, records),
            "bench": bench_row(kernel, part, parts),
            "versions": part.versions.get(kernel, {}),
            "skip_reasons": dict(Counter(r.message for r in records
                                         if r.verdict == v.SKIP and r.check == v.KERNEL_LEVEL)
                                 .most_common(3)),
            "features": {f: feature_cell(records, f) for f in FEATURE_NAMES},
            "repro": repro_files(report_dir, kernel)}


def part_summary(part: Part) -> dict:
    bench = part.bench or {}
    return {"name": part.name, "environment": part.header.get("environment", {}),
            "suite": part.header.get("suite"), "selection": part.header.get("selection"),
            "cases": part.header.get("cases"), "kernels": part.header.get("kernels"),
            "wall_s": part.header.get("wall_s"), "probe_mode": part.header.get("probe_mode"),
            "command": part.meta.get("command"), "census_wall_s": part.meta.get("wall_s"),
            "problems": part.meta.get("problems", []),
            "bench": {"shapes": bench.get("shapes"), "repeats": bench.get("repeats"),
                      "method": bench.get("method"), "errors": bench.get("errors") or (
                          {"all": bench["error"]} if bench.get("error") else {})}}


def selection_order(parts: list[Part]) -> list[str]:
    """Kernels as the parts selected them (their headers), then any other with records."""
    names = [k for p in parts for k in (p.header.get("kernels") or [])]
    names += [r.kernel for p in parts for r in p.records]
    present = {r.kernel for p in parts for r in p.records}
    return [k for k in dict.fromkeys(names) if k in present]


def build(report_dir: Path) -> dict:
    """census.json's content."""
    from harness.engine.registry import all_kernels
    parts = read_parts(report_dir)
    chosen = assign(parts)
    known = all_kernels()
    order = list(dict.fromkeys(census_names(chosen) + selection_order(parts)))
    rows = [kernel_row(k, *chosen[k], parts, report_dir, known) for k in order]
    head_dims = sorted({int(key[1:]) for row in rows for key in row["cells"]
                        if key.startswith("d") and key[1:].isdigit()})
    columns = [{"key": key, "title": title} for key, title, _ in COLUMNS]
    columns += [{"key": f"d{d}", "title": f"head dim {d}"} for d in head_dims]
    return {"schema": 1, "generated_utc": datetime.datetime.now(datetime.UTC)
            .isoformat(timespec="seconds"), "parts": [part_summary(p) for p in parts],
            "columns": columns, "bench_shapes": bench_shapes(parts), "rows": rows}


def write_table(report_dir: Path) -> tuple[Path, Path, int]:
    from harness.tools.census.render import markdown
    census = build(report_dir)
    js, md = report_dir / "census.json", report_dir / "census.md"
    js.write_text(json.dumps(census, indent=1) + "\n")
    md.write_text(markdown(census))
    return md, js, len(census["rows"])
