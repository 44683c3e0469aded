"""`python -m harness census`: run the suite over the census kernels (the engine's run, as
`harness run` does), then per isolation group the bench, the libraries' versions and the
reproducers, then the table over every part present."""
from __future__ import annotations

import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

from harness.errors import UsageError
from harness.store import report_file as rec
from harness.tools.census.findings import versions
from harness.tools.census.options import census_names

PART_FILE = "part.json"
BENCH_FILE = "bench.json"
VERSIONS_FILE = "versions.json"
FINDINGS_FILE = "findings.json"


def select(census, run) -> list:
    """The kernels this part covers: --kernels, else the census set that is registered, less
    --without."""
    import fnmatch

    from harness.engine.registry import all_kernels, select_kernels
    from harness.engine.options import check_names
    without = check_names("--without", census.without, "kernel glob")
    if run.kernels:
        if without is not None:
            raise UsageError("--kernels and --without: give one of them")
        return select_kernels(list(run.kernels))
    names = census_names(all_kernels())
    globs = list(without or ())
    unmatched = [g for g in globs if not any(fnmatch.fnmatchcase(n, g) for n in names)]
    if unmatched:
        raise UsageError(f"--without {', '.join(unmatched)}: no kernel of the census set "
                         "matches")
    names = [n for n in names if not any(fnmatch.fnmatchcase(n, g) for g in globs)]
    if not names:
        raise UsageError("no kernel of the census set is left to run")
    return select_kernels(names)


def main(census, run) -> int:
    """A census part: its suite run (the engine's), then per isolation group the bench, the
    versions and the reproducers, then the table over every part present. `census`: a
    CensusOptions; `run`: the run's options (RunOptions)."""
    import dataclasses

    from harness.engine import engine
    from harness.tools.bench.shapes import shape_set
    from harness.tools.census.table import write_table
    report_dir = Path(census.report_dir)
    if census.table_only:
        if not (report_dir / "parts").is_dir():
            raise UsageError(f"--report-dir {report_dir}: no parts/ folder: nothing to tabulate "
                             "(run `python -m harness census` first)")
        return _table(report_dir, write_table)
    # The nightly suite asked for on a CPU: refused unless --kernels or --cases narrow it (a
    # note first where they do), as a run is.
    engine.refuse_gpu_suite_on_cpu(run)
    for path in run.kernel_modules:
        from harness.engine.registry import load_kernel_module
        load_kernel_module(path)
    kernels = select(census, run)
    run = dataclasses.replace(run, kernels=tuple(k.name for k in kernels),
                              report_dir=str(census.run_dir), source="census").checked()
    engine.select(run)   # every user mistake (cases, features) before any work
    if census.bench:
        shape_set(census.shapes)
    part_dir = census.part_dir
    rec.check_writable(part_dir)
    engine.check_not_running(census.run_dir)
    start = time.monotonic()
    clear_part(part_dir, kernels, report_dir / "repro", not census.repro)
    _write_part(census, run, kernels, None, [], None)  # the command, for the children
    run_status = engine.run(run)
    problems = after_groups(census, run, kernels)
    _write_part(census, run, kernels, run_status, problems, time.monotonic() - start)
    status = _table(report_dir, write_table)
    for problem in problems:
        print(f"census: {problem}", file=sys.stderr)
    return 1 if problems or status else 0


def _table(report_dir: Path, write_table) -> int:
    md, js, rows = write_table(report_dir)
    print(f"census: {rows} kernels in {md} and {js}")
    return 0


def clear_part(part_dir: Path, kernels, repro_dir: Path, keep_repro: bool) -> None:
    """What an earlier run of this part left (its groups' files, bench, versions; and, unless
    reproducers are left out, its kernels' reproducers): nothing stale reaches the table."""
    import shutil

    from harness.tools.census.findings import kernel_files
    shutil.rmtree(part_dir / "groups", ignore_errors=True)
    for name in (BENCH_FILE, VERSIONS_FILE, PART_FILE):
        (part_dir / name).unlink(missing_ok=True)
    if keep_repro:
        return
    for kernel in kernels:   # its scripts of every feature set, the error's, and their texts
        for path in kernel_files(repro_dir, kernel.name, (".py", ".md", ".txt")):
            path.unlink(missing_ok=True)


# ----- bench, versions and reproducers, per isolation group ---------------------------------

def group_dir(part_dir: Path, group: str | None) -> Path:
    return part_dir / "groups" / (group or "main")


def after_groups(census, run, kernels) -> list[str]:
    """The bench, versions and reproducers: in this process where the kernels share one, else
    one child per isolation group (harness.tools.census.child); the groups' files joined. The
    problems, in words."""
    from harness.engine import workers
    groups = workers.groups(kernels)
    problems = []
    if len(groups) == 1:
        (group, members), = groups.items()
        if after_run(census, run, members, group):
            problems.append(f"group {group or 'main'}: a step failed (see "
                            f"{group_dir(census.part_dir, group)})")
    else:
        for group, members in groups.items():
            problems += _child(census, run, group, members)
    join_groups(census.part_dir)
    return problems


def _child(census, run, group, members) -> list[str]:
    """One group's bench, versions and reproducers in a process of its own: its orders as a
    JSON spec (harness.tools.census.child), never an argv of options."""
    import dataclasses
    spec = group_dir(census.part_dir, group) / "spec.json"
    spec.parent.mkdir(parents=True, exist_ok=True)
    run = dataclasses.replace(run, kernels=tuple(k.name for k in members))
    spec.write_text(json.dumps({"census": census.to_json(), "run": run.to_json(),
                                "group": group}))
    print(f"[census] {group or 'main'}: bench, versions and reproducers in a child process",
          file=sys.stderr, flush=True)
    done = subprocess.run([sys.executable, "-m", "harness.tools.census.child", str(spec)])
    if done.returncode == 0:
        return []
    return [f"group {group or 'main'}: the child process exited with status {done.returncode}"]


def after_run(census, run, kernels, group) -> int:
    """One group's bench, versions and reproducers, in this process; 1 if a step failed."""
    out = group_dir(census.part_dir, group)
    out.mkdir(parents=True, exist_ok=True)
    (out / VERSIONS_FILE).write_text(json.dumps(versions(kernels), indent=1) + "\n")
    failed = 0
    if census.bench:
        failed |= run_bench(census, kernels, out / BENCH_FILE)
    if census.repro:
        nightly = census.run_dir
        header, records = rec.read(nightly) if (nightly / rec.RECORDS_FILE).exists() else ({}, [])
        from harness.tools.census.findings import write_findings
        meta = census.part_dir / PART_FILE
        command = (json.loads(meta.read_text()).get("command") if meta.exists() else None) \
            or command_line(census, run)
        written = write_findings(Path(census.report_dir) / "repro", kernels, header, records,
                                 list(run.kernel_modules), command, census.repro_runs)
        (out / FINDINGS_FILE).write_text(json.dumps(written, indent=1) + "\n")
        failed |= any(w.get("problem") for w in written)
    return failed


def run_bench(census, kernels, output: Path) -> int:
    """`harness bench` over the kernels; a bench that cannot run writes its error instead."""
    from harness.tools.bench import main as bench_main
    try:
        bench_main(shapes=census.shapes, repeats=census.repeats, output=str(output),
                   kernels=[k.name for k in kernels])
        return 0
    except UsageError as exc:  # e.g. nothing of the shape set fits this device
        error, trace = str(exc), None
    except Exception as exc:
        error, trace = f"{type(exc).__name__}: {exc}", traceback.format_exc()
    print(f"census: the bench did not run: {error}", file=sys.stderr)
    output.write_text(json.dumps({"shapes": census.shapes, "error": error, "traceback": trace,
                                  "results": []}, indent=1) + "\n")
    return 1


def join_bench(docs: dict[str, dict]) -> dict:
    """One bench report from the groups' (group -> bench JSON): each shape's entries joined
    (ratios stay relative to each group's own base), errors kept by group."""
    out: dict = {"groups": list(docs), "errors": {}, "results": []}
    by_shape: dict[str, dict] = {}
    for group, doc in docs.items():
        if doc.get("error"):
            out["errors"][group] = doc["error"]
        for key in ("environment", "shapes", "repeats", "method"):
            if key in doc:
                out.setdefault(key, doc[key])
        for res in doc.get("results", []):
            if res["shape"] in by_shape:
                by_shape[res["shape"]]["entries"] += res["entries"]
            else:
                by_shape[res["shape"]] = dict(res, entries=list(res["entries"]))
                out["results"].append(by_shape[res["shape"]])
    return out


def join_groups(part_dir: Path) -> None:
    """The part's bench.json and versions.json from its groups' files."""
    groups = sorted(p for p in (part_dir / "groups").glob("*") if p.is_dir())
    benches = {g.name: json.loads((g / BENCH_FILE).read_text()) for g in groups
               if (g / BENCH_FILE).exists()}
    if benches:
        (part_dir / BENCH_FILE).write_text(json.dumps(join_bench(benches), indent=1) + "\n")
    found = {}
    for g in groups:
        if (g / VERSIONS_FILE).exists():
            found.update(json.loads((g / VERSIONS_FILE).read_text()))
    (part_dir / VERSIONS_FILE).write_text(json.dumps(found, indent=1) + "\n")


def _write_part(census, run, kernels, run_status: int | None, problems: list[str],
                wall_s: float | None) -> None:
    """part.json: what this part ran, and how it went (written at the start, without the
    status, and again at the end)."""
    meta = {"part": census.part, "suite": run.suite, "cases": _joined(run.cases),
            "features": _joined(run.features), "seeds": run.seeds,
            "kernels": [k.name for k in kernels],
            "bench_shapes": census.shapes if census.bench else None,
            "repeats": census.repeats, "repro": census.repro, "leak_probe": run.leak_probe,
            "run_status": run_status, "problems": problems,
            "wall_s": None if wall_s is None else round(wall_s, 1),
            "command": command_line(census, run)}
    census.part_dir.mkdir(parents=True, exist_ok=True)
    (census.part_dir / PART_FILE).write_text(json.dumps(meta, indent=1) + "\n")


def _joined(names):
    return None if names is None else ",".join(names)


def command_line(census, run) -> str:
    """The census command that makes this part again."""
    import shlex
    words = ["python", "-m", "harness", "census", "--suite", run.suite, "--part", census.part,
             "--report-dir", str(census.report_dir)]
    if census.without:
        words += ["--without", census.without]
    elif run.kernels:
        words += ["--kernels", ",".join(run.kernels)]
    if run.cases:
        words += ["--cases", ",".join(run.cases)]
    if run.features:
        words += ["--features", ",".join(run.features)]
    if run.seeds != 1:
        words += ["--seeds", str(run.seeds)]
    for module in run.kernel_modules:
        words += ["--kernel-module", module]
    words += ["--no-bench"] if not census.bench else ["--shapes", census.shapes, "--repeats",
                                                      str(census.repeats)]
    words += ["--no-repro"] if not census.repro else (
        ["--repro-runs", str(census.repro_runs)] if census.repro_runs != 40 else [])
    words += ["--no-leak-probe"] * (not run.leak_probe)
    return " ".join(shlex.quote(w) for w in words)
