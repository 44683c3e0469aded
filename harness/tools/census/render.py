"""census.md from census.json's content (harness.tools.census.table.build): the parts and their
environments, the verdicts by layout family, then padding, backward, speed, memory, versions
and the reproducers. It words what the table module gathered; it decides nothing."""
from __future__ import annotations

ENVIRONMENT = ("device_kind", "compute_capability", "python", "jax", "jaxlib", "cudnn",
               "transformer_engine", "maxtext")

INTRO = """\
Every packed-attention path a JAX user can pick, run on the same packed rows and judged per
segment against a float32 reference (`python -m harness census`; the records are under
`parts/<part>/nightly/`). A column's cell is the worst outcome over that column's cases, then
the cases counted by outcome (a case's outcome is the worst of its checks: out, dq, dk, dv,
the leak probe, padding, the output contract). `ok`: everything passed; `caught`: failures the
kernel declares (a known bug shown where it must show); `known`: a known upstream bug or
upstream error, as declared; `unjudged`: checks left to the leak probe; `skip`: the kernel
does not take these cases (or its library is absent), with the reason in the records;
**FAIL**, **MISSED**, **ERROR**: unexpected."""


def _value(x) -> str:
    if isinstance(x, list):
        return " / ".join(map(str, x))
    return str(x)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _part_lines(census: dict) -> list[str]:
    lines = []
    for part in census["parts"]:
        env = part["environment"] or {}
        facts = ", ".join(f"{k} {_value(env[k])}" for k in ENVIRONMENT if env.get(k) is not None)
        commit = env.get("git_commit")
        if commit:
            facts += f"; commit `{_value(commit)}`" + (" (dirty)" if env.get("git_dirty") else "")
        run = f"suite {part['suite']}, {part['cases']} cases, {len(part['kernels'] or [])} kernels"
        if part["wall_s"] is not None:
            run += f", run {part['wall_s']:.0f} s"
        bench = part["bench"]
        if bench.get("shapes"):
            run += f"; bench `{bench['shapes']}`, {bench['repeats']} repeats"
        lines.append(f"- **{part['name']}**: {facts or 'no records'}; {run}; time "
                     f"{_value(env.get('time_utc', '?'))}")
        if part.get("command"):
            lines.append(f"  - `{part['command']}`")
        for group, error in (bench.get("errors") or {}).items():
            lines.append(f"  - bench ({group}) did not run: {_cell(error)[:300]}")
        for problem in part.get("problems") or []:
            lines.append(f"  - census step: {_cell(problem)}")
    return lines


def _verdicts(census: dict) -> list[str]:
    cols = census["columns"]
    lines = ["| kernel | " + " | ".join(c["title"] for c in cols) + " |",
             "| --- " * (len(cols) + 1) + "|"]
    for row in census["rows"]:
        cells = []
        for c in cols:
            cell = row["cells"].get(c["key"])
            text = "—" if cell is None else _cell(cell["text"])
            cells.append(f"**{text}**" if cell and cell["bad"] else text)
        lines.append(f"| `{row['kernel']}` | " + " | ".join(cells) + " |")
    return lines


def _features(census: dict) -> list[str]:
    """The path x feature table: each kernel on the cases asking for each feature."""
    from harness.model.features import FEATURE_NAMES
    rows = [r for r in census["rows"] if any(c["cases"] for c in r.get("features", {}).values())]
    if not rows:
        return []
    lines = ["| kernel | " + " | ".join(FEATURE_NAMES) + " |",
             "| --- " * (len(FEATURE_NAMES) + 1) + "|"]
    for row in rows:
        cells = []
        for f in FEATURE_NAMES:
            cell = row["features"].get(f, {"text": "—", "bad": False})
            text = _cell(cell["text"])
            cells.append(f"**{text}**" if cell.get("bad") else text)
        lines.append(f"| `{row['kernel']}` | " + " | ".join(cells) + " |")
    return lines


def _links(row: dict) -> str:
    links = []
    for path in row["repro"]:
        links.append(f"[{path.split('/')[-1]}]({path}) ([report]({path[:-3]}.md))")
    return ", ".join(links) or "—"


def _behaviour(census: dict) -> list[str]:
    shapes = census["bench_shapes"]
    titles = ["kernel", "padding positions", "backward reproducible",
              "smallest detectable leak (of the tensor's scale)"]
    titles += [f"{s['key']}: fwd+bwd median, useful TFLOP/s" for s in shapes]
    titles += [f"{s['key']}: peak memory (XLA: temp + args + outputs)" for s in shapes]
    titles += ["libraries", "reproducers"]
    lines = ["| " + " | ".join(titles) + " |", "| --- " * len(titles) + "|"]
    for row in census["rows"]:
        bench = row["bench"]
        cells = [f"`{row['kernel']}`", row["padding"]["text"], row["backward"]["text"],
                 row["backward"]["detectable_text"]]
        cells += [bench[s["key"]]["text"] if s["key"] in bench else "—" for s in shapes]
        cells += [bench[s["key"]]["memory_text"] if s["key"] in bench else "—" for s in shapes]
        libs = ", ".join(f"{m} {x or 'not installed'}"
                         for m, x in row["versions"].items()) or "—"
        cells += [libs, _links(row)]
        lines.append("| " + " | ".join(_cell(c) for c in cells) + " |")
    return lines


def _skips(census: dict) -> list[str]:
    """Kernels that only skipped, with the part they came from and the records' reasons: their
    absence, explained."""
    out = []
    for row in census["rows"]:
        cell = row["cells"].get("all")
        if cell and cell["worst"] == "skip":
            reasons = "; ".join(f"{_cell(m)} ({n} cases)"
                                for m, n in row.get("skip_reasons", {}).items())
            out.append(f"- `{row['kernel']}` skipped every case in part `{row['part']}`: "
                       f"{reasons or 'see its records'}")
    return out


def markdown(census: dict) -> str:
    parts = ["# Packed-attention census", "", INTRO, "", "## Parts", "", *_part_lines(census),
             "", "## Verdicts by layout family", "", *_verdicts(census), ""]
    features = _features(census)
    if features:
        parts += ["## Features: honoured, refused or dropped", "",
                  "Each path on the cases that ask for a feature (docs/features.md): `ok` "
                  "honoured on every case; `refuses` it raised while tracing, naming the "
                  "feature; **FAIL** it returned numbers that fail, with what the records "
                  "diagnose it dropped; `known` a declared upstream drop, reproduced; `not "
                  "taken` its API has no argument for it. Cases counted by outcome.", "",
                  *features, ""]
    parts += [
             "## Padding, backward, speed, memory, versions", "",
             "Padding: what the kernel wrote at padding positions (gradients must be exactly "
             "zero; the output finite, or zero where the kernel declares it). Backward "
             "reproducible: whether the probed build's out/dq/dk/dv were bitwise the same run "
             "to run: each token in the leak probe's runs that left it untouched, and, where "
             "a token of those moved, in reruns on unchanged inputs and (GPUs) in a second "
             "run of that perturbation (a rare noise may show in none). Speed: one `harness bench` run, median of its samples; useful TFLOP/s "
             "count same-segment causal work only. Peak memory: XLA's memory analysis of the "
             "compiled fwd+bwd program (temp + arguments + outputs).", "",
             *_behaviour(census)]
    skips = _skips(census)
    if skips:
        parts += ["", "## Kernels that only skipped", "", *skips]
    parts += ["", f"Generated {census['generated_utc']} from {len(census['parts'])} part(s); "
              "`python -m harness census --table-only` rebuilds it.", ""]
    return "\n".join(parts)
