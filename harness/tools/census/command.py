"""`python -m harness census`: run the suite over the census kernels (through `harness run`'s own
command), then per isolation group the bench, the libraries' versions and the reproducers, then
the table over every part present."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

from harness.errors import UsageError
from harness.tools.census.options import census_names

PART_FILE = "part.json"
BENCH_FILE = "bench.json"
VERSIONS_FILE = "versions.json"
FINDINGS_FILE = "findings.json"


def select(args) -> list:
    """The kernels this part covers: --kernels, else the census set that is registered, less
    --without."""
    import fnmatch
    from harness.engine.registry import all_kernels, select_kernels
    if args.kernels:
        if args.without:
            raise UsageError("--kernels and --without: give one of them")
        return select_kernels(args.kernels)
    names = census_names(all_kernels())
    globs = [g.strip() for g in (args.without or "").split(",") if g.strip()]
    unmatched = [g for g in globs if not any(fnmatch.fnmatchcase(n, g) for n in names)]
    if unmatched:
        raise UsageError(f"--without {', '.join(unmatched)}: no kernel of the census set "
                         "matches")
    names = [n for n in names if not any(fnmatch.fnmatchcase(n, g) for g in globs)]
    if not names:
        raise UsageError("no kernel of the census set is left to run")
    return select_kernels(names)


def _check_args(args) -> None:
    """Every user mistake before any work: the suite, the cases, the shape set."""
    from harness.model.suites import suite_cases
    from harness.tools.bench.shapes import shape_set
    suite_cases(args.suite, args.cases, seeds=args.seeds)
    if not args.no_bench:
        shape_set(args.shapes)


def main(args) -> int:
    from harness.tools.census.table import write_table
    report_dir = Path(args.report_dir)
    if args.table_only:
        if not (report_dir / "parts").is_dir():
            raise UsageError(f"--report-dir {report_dir}: no parts/ folder: nothing to tabulate "
                             "(run `python -m harness census` first)")
        return _table(report_dir, write_table)
    kernels = select(args)
    _check_args(args)
    part_dir = report_dir / "parts" / args.part
    if args.after_run:
        return after_run(args, kernels, part_dir)
    from harness.views import report_file as rec
    rec.check_writable(part_dir)
    start = time.monotonic()
    clear_part(part_dir, kernels, Path(args.report_dir) / "repro", args.no_repro)
    _write_part(args, kernels, part_dir, None, [], None)  # the command, for the children
    run_status = run_suite(args, kernels, part_dir / "nightly")
    problems = after_groups(args, kernels, part_dir)
    _write_part(args, kernels, part_dir, run_status, problems, time.monotonic() - start)
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
    from harness.tools.census.findings import safe_name
    shutil.rmtree(part_dir / "groups", ignore_errors=True)
    for name in (BENCH_FILE, VERSIONS_FILE, PART_FILE):
        (part_dir / name).unlink(missing_ok=True)
    if keep_repro:
        return
    for kernel in kernels:
        for stem in (safe_name(kernel.name), safe_name(kernel.name) + "-error"):
            for suffix in (".py", ".md", ".txt"):
                (repro_dir / (stem + suffix)).unlink(missing_ok=True)


# ----- the suite ------------------------------------------------------------------------------

def _option_argv(args) -> list[str]:
    """The options a census passes on (to `harness run`, and to its children)."""
    argv = []
    for module in args.kernel_module:
        argv += ["--kernel-module", str(Path(module).resolve()) if Path(module).exists()
                 else module]
    if args.no_compilation_cache:
        argv.append("--no-compilation-cache")
    else:
        argv += ["--compilation-cache", str(args.compilation_cache)]
    return argv


def run_suite(args, kernels, report_dir: Path) -> int:
    """The suite over the kernels, by `harness run` itself (its controller and workers where
    the kernels' libraries cannot share a process); its exit status."""
    from harness import cli
    argv = ["run", "--suite", args.suite, "--seeds", str(args.seeds), "--report-dir",
            str(report_dir), "--kernels", ",".join(k.name for k in kernels),
            *_option_argv(args)]
    if args.cases:
        argv += ["--cases", args.cases]
    if args.no_leak_probe:
        argv.append("--no-leak-probe")
    return cli.cmd_run(cli.build_parser().parse_args(argv))


# ----- bench, versions and reproducers, per isolation group ---------------------------------

def group_dir(part_dir: Path, group: str | None) -> Path:
    return part_dir / "groups" / (group or "main")


def after_groups(args, kernels, part_dir: Path) -> list[str]:
    """The bench, versions and reproducers: in this process where the kernels share one, else
    one child per isolation group; the groups' files joined. The problems, in words."""
    from harness.engine import isolation
    groups = isolation.groups(kernels)
    problems = []
    if len(groups) == 1:
        (group, members), = groups.items()
        if after_run(args, members, part_dir, group=group):
            problems.append(f"group {group or 'main'}: a step failed (see "
                            f"{group_dir(part_dir, group)})")
    else:
        for group, members in groups.items():
            problems += _child(args, group, members, part_dir)
    join_groups(part_dir)
    return problems


def _child(args, group, members, part_dir: Path) -> list[str]:
    """`census --after-run` for one group's kernels, in a process of its own."""
    argv = [sys.executable, "-m", "harness", "census", "--after-run", "--part", args.part,
            "--report-dir", str(args.report_dir), "--kernels", ",".join(k.name for k in members),
            "--suite", args.suite, "--seeds", str(args.seeds), "--shapes", args.shapes,
            "--repeats", str(args.repeats), "--repro-runs", str(args.repro_runs),
            *_option_argv(args)]
    argv += ["--cases", args.cases] if args.cases else []
    argv += ["--no-bench"] * args.no_bench + ["--no-repro"] * args.no_repro
    print(f"[census] {group or 'main'}: bench, versions and reproducers in a child process",
          file=sys.stderr, flush=True)
    done = subprocess.run(argv)
    if done.returncode == 0:
        return []
    return [f"group {group or 'main'}: the child process exited with status {done.returncode}"]


def after_run(args, kernels, part_dir: Path, group: str | None = "") -> int:
    """One group's bench, versions and reproducers, in this process; 1 if a step failed."""
    from harness.engine import isolation
    from harness.views import report_file as rec
    if group == "":
        group = next(iter(isolation.groups(kernels)))
    out = group_dir(part_dir, group)
    out.mkdir(parents=True, exist_ok=True)
    (out / VERSIONS_FILE).write_text(json.dumps(versions(kernels), indent=1) + "\n")
    failed = 0
    if not args.no_bench:
        failed |= run_bench(args, kernels, out / BENCH_FILE)
    if not args.no_repro:
        nightly = part_dir / "nightly"
        header, records = rec.read(nightly) if (nightly / rec.RECORDS_FILE).exists() else ({}, [])
        from harness.tools.census.findings import write_findings
        meta = part_dir / PART_FILE
        command = (json.loads(meta.read_text()).get("command") if meta.exists() else None) \
            or command_line(args)
        written = write_findings(Path(args.report_dir) / "repro", kernels, header, records,
                                 list(args.kernel_module), command, args.repro_runs)
        (out / FINDINGS_FILE).write_text(json.dumps(written, indent=1) + "\n")
        failed |= any(w.get("problem") for w in written)
    return failed


def versions(kernels) -> dict[str, dict[str, str | None]]:
    """kernel -> the version of each module it requires (its top-level package), read in the
    process that runs it."""
    from harness.engine.environment import package_version
    return {k.name: {m.split(".")[0]: package_version(m.split(".")[0]) for m in k.requires}
            for k in kernels}


def run_bench(args, kernels, output: Path) -> int:
    """`harness bench` over the kernels; a bench that cannot run writes its error instead."""
    from harness.tools.bench import main as bench_main
    ns = argparse.Namespace(shapes=args.shapes, repeats=args.repeats, output=str(output),
                            kernels=",".join(k.name for k in kernels), kernel_module=[])
    try:
        bench_main(ns)
        return 0
    except UsageError as exc:  # e.g. nothing of the shape set fits this device
        error, trace = str(exc), None
    except Exception as exc:
        error, trace = f"{type(exc).__name__}: {exc}", traceback.format_exc()
    print(f"census: the bench did not run: {error}", file=sys.stderr)
    output.write_text(json.dumps({"shapes": args.shapes, "error": error, "traceback": trace,
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


def _write_part(args, kernels, part_dir: Path, run_status: int | None, problems: list[str],
                wall_s: float | None) -> None:
    """part.json: what this part ran, and how it went (written at the start, without the
    status, and again at the end)."""
    meta = {"part": args.part, "suite": args.suite, "cases": args.cases, "seeds": args.seeds,
            "kernels": [k.name for k in kernels], "bench_shapes": None if args.no_bench
            else args.shapes, "repeats": args.repeats, "repro": not args.no_repro,
            "leak_probe": not args.no_leak_probe, "run_status": run_status,
            "problems": problems, "wall_s": None if wall_s is None else round(wall_s, 1),
            "command": command_line(args)}
    (part_dir / PART_FILE).write_text(json.dumps(meta, indent=1) + "\n")


def command_line(args) -> str:
    """The census command that makes this part again."""
    import shlex
    words = ["python", "-m", "harness", "census", "--suite", args.suite, "--part", args.part,
             "--report-dir", str(args.report_dir)]
    if args.kernels:
        words += ["--kernels", args.kernels]
    if args.without:
        words += ["--without", args.without]
    if args.cases:
        words += ["--cases", args.cases]
    if args.seeds != 1:
        words += ["--seeds", str(args.seeds)]
    for module in args.kernel_module:
        words += ["--kernel-module", module]
    words += ["--no-bench"] if args.no_bench else ["--shapes", args.shapes, "--repeats",
                                                   str(args.repeats)]
    words += ["--no-repro"] if args.no_repro else (
        ["--repro-runs", str(args.repro_runs)] if args.repro_runs != 40 else [])
    words += ["--no-leak-probe"] * args.no_leak_probe
    return " ".join(shlex.quote(w) for w in words)
