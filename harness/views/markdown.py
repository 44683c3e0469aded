"""summary.md: the kernel x layout grid coloured by worst ratio, then every problem by segment,
what was not judged and why, every caught segment, the skips and where the time went. Fit for a
CI job summary or a pull-request comment."""
from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

from harness.judge import judging
from harness.views.summary import coverage_lines, grid, known_lines, margin_rows, not_judged_lines

_MARK = {"ok": "🟢", "caught": "🔵", "known": "🟠", "FAIL": "🔴", "MISSED": "🔴", "ERROR": "❌",
         "skip": "⚪"}


def _mark(cell) -> str:
    if cell.status == "ok" and cell.has_ratio and (cell.worst_ratio is None
                                                    or cell.worst_ratio > 0.5):
        return "🟡"  # passing, but past half its tolerance
    return _MARK[cell.status]


def _fmt(x, digits=3) -> str:
    return "nan/inf" if x is None else f"{x:.{digits}g}"


ENV_KEYS = ("device_kind", "device_count", "platform", "compute_capability", "jax", "jaxlib",
            "cudnn", "transformer_engine", "maxtext", "git_commit", "git_dirty", "time_utc")


def env_line(env: dict) -> str:
    return " · ".join(f"{k}={env.get(k)}" for k in ENV_KEYS if env.get(k) is not None)


def _seeds(header: dict) -> int:
    seeds = header.get("seeds")
    return seeds if isinstance(seeds, int) else 1


def run_line(header: dict) -> str:
    parts = [f"suite `{header.get('suite')}`"]
    if _seeds(header) > 1:
        parts.append(f"{header['seeds']} seeds")
    if header.get("wall_s") is not None:
        parts.append(f"wall time {header['wall_s']:.0f} s")
    if header.get("leak_probe") is False:
        parts.append("leak probe off (--no-leak-probe)")
    elif header.get("probe_mode"):
        parts.append(f"leak probe: {header['probe_mode']} build")
    if header.get("shard"):
        parts.append(f"shard {header['shard']}")
    if header.get("interrupted"):
        parts.append("**interrupted: only what finished is here**")
    return " · ".join(parts)


def timing_lines(header: dict) -> list[str]:
    timing = header.get("timing") or {}
    if not timing:
        return []
    out = ["wall: the run's time on the kernel (its checks and leak probe included); lower and "
           "compile happen beside the run, in other threads (compile seconds add up over the "
           "threads compiling at once); waited: how long the run stood still for a program not "
           "compiled yet, or for a trace's environment.", "",
           "| kernel | wall s | programs | lower s | compile s | waited s | runs | execute s |",
           "|---|---|---|---|---|---|---|---|"]
    for kernel, t in sorted(timing.items(), key=lambda kv: -kv[1].get("wall_s", 0)):
        out.append(f"| {kernel} | {t.get('wall_s', 0):.1f} | {t.get('programs', 0)} | "
                   f"{t.get('lower_s', 0):.1f} | {t.get('compile_s', 0):.1f} | "
                   f"{t.get('wait_s', 0):.1f} | {t.get('runs', 0)} | {t.get('execute_s', 0):.1f} |")
    return out


def _segment_table(rows: list[dict]) -> list[str]:
    out = ["| kernel | check | segment | tokens | max abs err | tolerance | ratio | worst token | case id |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        label = r["segment_label"] + (" (missed)" if r["outcome"] == "missed" else "")
        bitwise = judging.check(r["check"]).bitwise
        out.append(
            f"| {r['kernel']} | {r['check']} | {label} | {r['start']}..{r['start'] + r['length'] - 1} "
            f"| {_fmt(r['max_abs_err'])} | {'bitwise' if bitwise else _fmt(r['tolerance'])} "
            f"| {'—' if bitwise else _fmt(r['ratio'])} | {r['worst_token']} | `{r['case_id']}` |")
    return out


def _caught_segments(caught: list[dict]) -> list[str]:
    """One row per caught segment: the checks that caught it and its worst ratio."""
    by_segment: dict[tuple, list[dict]] = defaultdict(list)
    for r in caught:
        by_segment[(r["kernel"], r["case_id"], r["row"], r["segment"])].append(r)
    out = ["| kernel | segment | tokens | caught by | worst ratio | case id |",
           "|---|---|---|---|---|---|"]
    for (kernel, case_id, _, _), rows in by_segment.items():
        r0 = rows[0]
        has_ratio, worst = judging.worst_ratio(rows)
        out.append(f"| {kernel} | {r0['segment_label']} | {r0['start']}..{r0['start'] + r0['length'] - 1} "
                   f"| {', '.join(r['check'] for r in rows)} "
                   f"| {judging.ratio_text(worst) if has_ratio else 'bitwise'} | `{case_id}` |")
    return out


def _largest(caught: list[dict]) -> str:
    tolerance = [r for r in caught if not judging.check(r["check"]).bitwise]
    if tolerance:
        worst = max(tolerance, key=lambda r: float("inf") if r["ratio"] is None else r["ratio"])
        return (f"- largest: `{worst['kernel']}` {worst['check']} {worst['segment_label']} of "
                f"`{worst['case_id']}`, ratio {judging.ratio_text(worst['ratio'])}, worst token "
                f"{worst['worst_token']}")
    worst = max(caught, key=lambda r: r.get("max_abs_err") or 0.0)
    return (f"- largest: `{worst['kernel']}` leak {worst['segment_label']} of `{worst['case_id']}`, "
            f"max change {_fmt(worst.get('max_abs_err'))}, first changed token {worst['worst_token']}")


def render(header: dict, records: list[dict]) -> str:
    kernels, layouts, cells = grid(records)
    out = ["# Attention harness report", "",
           f"{run_line(header)} · {env_line(header.get('environment', {}))}", "",
           f"outcomes: {', '.join(f'{k} {v}' for k, v in judging.counts(records).items())}", "",
           "🟢 pass (ratio ≤ 0.5) · 🟡 pass (0.5 < ratio ≤ 1) · 🔵 expected failure caught · "
           "🟠 known upstream failure, reproduced · 🔴 unexpected failure or missed catch · "
           "❌ error · ⚪ skipped. A cell reads segments passing every check / segments "
           "measured, and the worst error/tolerance ratio.", "",
           "| kernel | " + " | ".join(layouts) + " |",
           "|---|" + "---|" * len(layouts)]
    for kernel in kernels:
        row = []
        for layout in layouts:
            cell = cells.get((kernel, layout))
            row.append("" if cell is None else f"{_mark(cell)} {cell.text}")
        out.append(f"| {kernel} | " + " | ".join(row) + " |")

    bad = judging.bad(records)
    out += ["", f"## Problems ({len(bad)})", ""]
    if not bad:
        out.append("None: every kernel expected to pass passed, every expected failure was caught.")
    else:
        segment_level = [r for r in bad if r.get("segment") and r["expected"] != "either"]
        out += _segment_table(segment_level)
        unjudged_missed = [r for r in bad if r.get("segment") and r["expected"] == "either"]
        if unjudged_missed:
            out += ["", "### Checks nothing judged", ""]
            out += [f"- `{r['kernel']}` {r['check']} {r['segment_label']} of `{r['case_id']}`: "
                    f"{r.get('message', '')}" for r in unjudged_missed]
        errors = [r for r in bad if not r.get("segment")]
        if errors:
            out += ["", "### Errors", ""]
            out += [f"- `{r['kernel']}` on `{r['case_id']}`: {r['outcome']}: "
                    f"{r.get('message', '')[:300]}" for r in errors]

    known = known_lines(records)
    if known:
        out += ["", f"## Known upstream bugs ({sum(judging.known(records).values())} checks)", ""]
        out += [f"- {line}" for line in known]

    not_judged = not_judged_lines(records)
    n_unjudged = judging.counts(records).get("unjudged", 0)
    out += ["", f"## Not judged ({n_unjudged} checks; {sum(judging.unprobed(records).values())} "
            "unprobed tensors)", ""]
    out += [f"- {line}" for line in not_judged] or ["Every check was judged."]
    coverage = coverage_lines(records)
    if coverage:
        out += ["", "Leak-probe coverage below 100%:", ""] + [f"- {line}" for line in coverage]

    caught = [r for r in records if r["outcome"] == "caught"]
    if caught:
        out += ["", "## Expected failures caught", ""]
        per = Counter((r["kernel"], r["check"]) for r in caught)
        out += [f"- `{k}` {c}: {n} segments" for (k, c), n in sorted(per.items())]
        out.append(_largest(caught))
        table = _caught_segments(caught)
        out += ["", f"<details><summary>every caught segment ({len(table) - 2})</summary>", ""]
        out += table
        out += ["", "</details>"]

    skips = Counter((r["kernel"], r.get("message", "")) for r in records if r["outcome"] == "skip")
    if skips:
        out += ["", "## Skipped", ""]
        out += [f"- `{k}` ({n}): {why}" for (k, why), n in sorted(skips.items())]
    if _seeds(header) > 1:
        out += ["", f"## Margin over {header['seeds']} seeds", "",
                "The worst error/tolerance ratio of each case (every seed, every check and "
                "segment) of each kernel expected to pass: its distribution.", "",
                "| kernel | cases | min | median | p95 | max | over 1 |", "|---|---|---|---|---|---|---|"]
        out += [f"| {k} | {n} | {lo} | {med} | {p95} | {hi} | {over} |"
                for k, n, lo, med, p95, hi, over in margin_rows(records)]
    timing = timing_lines(header)
    if timing:
        out += ["", "## Where the time went", ""] + timing
    out += ["", "Reproduce one case: `python -m harness run --suite <suite> --kernels <kernel> "
            "--cases '<case id>'`; shrink a failure to a standalone script: "
            "`python -m harness repro <kernel> '<case id>'`.", ""]
    return "\n".join(out)


def write_markdown(path: Path, header: dict, records: list[dict]) -> None:
    path.write_text(render(header, records))
