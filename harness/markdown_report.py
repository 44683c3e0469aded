"""summary.md: the kernel x layout grid coloured by worst ratio, then every problem by segment.
Fit for a CI job summary or a pull-request comment."""
from __future__ import annotations

from collections import Counter
from pathlib import Path

from harness.registry import LEAK
from harness.summary import counts, grid, problems

_MARK = {"ok": "🟢", "caught": "🔵", "known": "🟠", "FAIL": "🔴", "MISSED": "🔴", "ERROR": "❌", "skip": "⚪"}


def _mark(cell) -> str:
    if cell.status == "ok" and cell.worst_ratio is not None and cell.worst_ratio > 0.5:
        return "🟡"  # passing, but past half its tolerance
    return _MARK[cell.status]


def _fmt(x, digits=3) -> str:
    return "nan/inf" if x is None else f"{x:.{digits}g}"


def _env_line(env: dict) -> str:
    keys = ("device_kind", "platform", "compute_capability", "jax", "jaxlib", "cudnn",
            "transformer_engine", "maxtext", "git_commit", "time_utc")
    return " · ".join(f"{k}={env.get(k)}" for k in keys if env.get(k) is not None)


MAX_ROWS = 300


def _segment_table(rows: list[dict]) -> list[str]:
    out = ["| kernel | check | segment | tokens | max abs err | tolerance | ratio | worst token | case id |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        label = r["segment_label"] + (" (missed)" if r["outcome"] == "missed" else "")
        leak = r["check"] == LEAK  # bitwise check: the change itself, no tolerance or ratio
        out.append(
            f"| {r['kernel']} | {r['check']} | {label} | {r['start']}..{r['start'] + r['length'] - 1} "
            f"| {_fmt(r['max_abs_err'])} | {'bitwise' if leak else _fmt(r['tolerance'])} "
            f"| {'—' if leak else _fmt(r['ratio'])} | {r['worst_token']} | `{r['case_id']}` |")
    return out


def render(header: dict, records: list[dict]) -> str:
    kernels, layouts, cells = grid(records)
    out = ["# Attention harness report", "",
           f"suite `{header.get('suite')}` · {_env_line(header.get('environment', {}))}", "",
           f"outcomes: {', '.join(f'{k} {v}' for k, v in sorted(counts(records).items()))}", "",
           "🟢 pass (ratio ≤ 0.5) · 🟡 pass (0.5 < ratio ≤ 1) · 🔵 expected failure caught · "
           "🟠 known upstream failure, reproduced · 🔴 unexpected failure or missed catch · "
           "❌ error · ⚪ skipped", "",
           "| kernel | " + " | ".join(layouts) + " |",
           "|---|" + "---|" * len(layouts)]
    for kernel in kernels:
        row = []
        for layout in layouts:
            cell = cells.get((kernel, layout))
            row.append("" if cell is None else f"{_mark(cell)} {cell.text}")
        out.append(f"| {kernel} | " + " | ".join(row) + " |")

    bad = problems(records)
    out += ["", f"## Problems ({len(bad)})", ""]
    if not bad:
        out.append("None: every kernel expected to pass passed, every expected failure was caught.")
    else:
        out += _segment_table([r for r in bad if r["outcome"] != "error"])
        errors = [r for r in bad if r["outcome"] == "error"]
        if errors:
            out += ["", "### Errors", ""]
            out += [f"- `{r['kernel']}` on `{r['case_id']}`: {r.get('message', '')[:300]}"
                    for r in errors]

    caught = [r for r in records if r["outcome"] == "caught"]
    if caught:
        out += ["", "## Expected failures caught", ""]
        per = Counter((r["kernel"], r["check"]) for r in caught)
        out += [f"- `{k}` {c}: {n} segments" for (k, c), n in sorted(per.items())]
        worst = max(caught, key=lambda r: r["ratio"] or float("inf"))
        out.append(f"- largest: `{worst['kernel']}` {worst['check']} {worst['segment_label']} of "
                   f"`{worst['case_id']}`, ratio {_fmt(worst['ratio'])}, worst token "
                   f"{worst['worst_token']}")
        out += ["", f"<details><summary>every caught segment (first {MAX_ROWS})</summary>", ""]
        out += _segment_table(caught[:MAX_ROWS])
        out += ["", "</details>"]

    skips = Counter((r["kernel"], r.get("message", "")) for r in records if r["outcome"] == "skip")
    if skips:
        out += ["", "## Skipped", ""]
        out += [f"- `{k}` ({n}): {why}" for (k, why), n in sorted(skips.items())]
    out += ["", "Reproduce one case: `python -m harness run --suite <suite> --kernels <kernel> "
            "--cases '<case id>'`.", ""]
    return "\n".join(out)


def write_markdown(path: Path, header: dict, records: list[dict]) -> None:
    path.write_text(render(header, records))
