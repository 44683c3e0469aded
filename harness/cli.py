"""python -m harness run | list | report | merge | compare | baseline | bench | selftest | repro |
census

Every user mistake (a path, a kernel or suite name, a glob, a module, a baseline, a shape too
big for the device) is one line on stderr and exit status 2, found before any work starts. The
run's options are declared once (harness.engine.options); this module only turns a command
line into them and calls the engine or a tool."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from harness.engine import options as opts


def _run_options(args, **fixed) -> opts.RunOptions:
    return opts.RunOptions.from_values(lambda name: getattr(args, name, None), **fixed)


def cmd_run(args) -> int:
    from harness.engine import engine
    options = _run_options(args)
    engine.refuse_gpu_suite_on_cpu(options)
    return engine.run(options)


def cmd_list(args) -> int:
    from harness.engine import engine
    from harness.engine.environment import current_platform
    options = _run_options(args)
    selection = engine.select(options)
    platform = current_platform()
    for kernel in selection.kernels:
        runnable = sum(not kernel.unsupported_reasons(c, platform) for c in selection.cases)
        print(f"{kernel.name:42s} {runnable:3d}/{len(selection.cases)} cases  "
              f"{kernel.description}")
    warning = engine.gpu_suite_warning(options, platform)
    if warning:
        print(f"note: {warning}", file=sys.stderr)
    if args.verbose:
        for case in selection.cases:
            print(case.id)
    return 0


def cmd_report(args) -> int:
    from harness.judge import tallies
    from harness.store import report_file as rec
    from harness.views.report_dir import write_views
    from harness.views.summary import print_console
    if not args.report_dir.strip():
        raise _usage(f"report {args.report_dir!r}: an empty path; give a report folder")
    folder = Path(args.report_dir)
    if folder.is_file():
        raise _usage(f"report {args.report_dir}: a file; give the report's folder (the views "
                     "are written beside report.jsonl)")
    if not folder.is_dir():
        raise _usage(f"report {args.report_dir}: no such folder")
    if not rec.report_files(folder):
        raise _usage(f"report {args.report_dir}: no report.jsonl in it: not a report folder (a "
                     "run writes one where --report-dir says)")
    rec.check_writable(folder, option="report")   # its views are written there
    from harness.store.writer import check_not_being_written
    check_not_being_written(folder, "report")   # not a folder a run is writing now
    header, records = write_views(folder)
    print_console(records, header)
    return tallies.run_status(records, header)


def cmd_merge(args) -> int:
    from harness.engine import engine
    from harness.judge import vocabulary
    from harness.store import report_file as rec
    from harness.views.summary import print_console
    from harness.store.writer import FolderLock
    if not args.out.strip():
        raise _usage(f"merge {args.out!r}: an empty path; give the folder the merged report "
                     "goes to")
    out = Path(args.out)
    seen = {}
    for source in args.sources:
        path = rec.resolve(source).resolve()
        if path in seen:
            raise _usage(f"merge: {source} given twice (as {seen[path]} too)")
        if path.parent == out.resolve():
            raise _usage(f"merge {args.out}: {source} is in the folder the merged report goes "
                         "to, and would be overwritten; give another OUT")
        if rec.read_header(source).get("baseline_of"):
            raise _usage(f"merge: {source} is a baseline (made by `harness baseline`: records "
                         "cut to what the gate reads); merge the runs' own reports")
        seen[path] = source
    rec.check_writable(args.out, option="merge OUT")
    with FolderLock(out, option="merge OUT"):   # not a folder a run is writing now
        if out.is_dir() and rec.report_files(out):
            held = rec.read_header(out, what="merge OUT")
            if not vocabulary.made_by_merge(held):   # a merge's OUT made again: fine
                raise _usage(f"merge {args.out}: holds a run's own report"
                             + (f" (shard {held['shard']})" if held.get("shard") else "")
                             + ", which the merge would replace; give OUT first, a folder of its "
                             "own: merge OUT SOURCE...")
        status, overlaps, header, records = engine.merge(
            out, [Path(s) for s in args.sources], rejudge=args.rejudge)
    print_console(records, header)
    for source, n, kept in overlaps:
        if n:
            print(f"note: {source} repeats {n} kernel x case pairs of an earlier source; its "
                  "records replace theirs", file=sys.stderr)
        if kept:
            print(f"note: {source} only skipped {kept} kernel x case pairs an earlier source "
                  "has records of; those records stay (a skip never hides what was measured)",
                  file=sys.stderr)
    print(f"merged {len(args.sources)} reports into {args.out}/ (report.jsonl, summary.md, "
          "report.html)")
    return status


def cmd_compare(args) -> int:
    from harness.views.compare import check_comparable, compare_files
    growth = opts.check_growth(args.growth)
    check_comparable(args.new, args.baseline)
    return compare_files(args.new, args.baseline, growth=growth)


def cmd_baseline(args) -> int:
    from harness.store import report_file as rec
    from harness.views.compare import check_baseline_sources, write_baseline
    out = Path(args.out)
    if out.is_dir():
        raise _usage(f"baseline {args.out}: a folder; give the baseline's file name "
                     "(.jsonl or .jsonl.gz)")
    if not args.out.endswith((".jsonl", ".jsonl.gz")):
        raise _usage(f"baseline {args.out!r}: give the baseline's file name, ending .jsonl or "
                     ".jsonl.gz")
    if out.name.startswith("report.jsonl") and any(
            (out.parent / n).exists() for n in ("report.jsonl", "report.jsonl.gz")
            if n != out.name):
        raise _usage(f"baseline {args.out}: a report folder's second report file (it has "
                     f"{'report.jsonl' if out.name.endswith('.gz') else 'report.jsonl.gz'}); "
                     "give another file name")
    rec.check_writable(out.parent, option="baseline OUT")
    from harness.store.writer import check_not_being_written
    check_not_being_written(out.parent, "baseline OUT")
    check_baseline_sources(args.sources)
    for source in args.sources:
        if rec.resolve(source).resolve() == out.resolve():
            raise _usage(f"baseline {args.out}: the report of {source}, one of its runs, would "
                         "be overwritten; give another file name")
    return write_baseline(args.out, args.sources)


def _cache(args) -> None:
    from harness.engine.compilation_cache import enable_compilation_cache
    opts.check_cache_choice(args.compilation_cache, args.no_compilation_cache)
    enable_compilation_cache(None if args.no_compilation_cache else
                             opts.check_cache_path(
        opts.DEFAULT_CACHE_DIR if args.compilation_cache is None else args.compilation_cache))


def _load_modules(paths) -> None:
    from harness.engine.registry import load_kernel_module
    for path in paths:
        load_kernel_module(path)


def _output_file(path: str | None, option: str = "--output") -> str | None:
    """A file the command will write at its end: checked now, not after the work."""
    from harness.store import report_file as rec
    if path is None:
        return None
    if not path.strip():
        raise _usage(f"{option} {path!r}: an empty path")
    if Path(path).is_dir():
        raise _usage(f"{option} {path}: a folder; give a file name")
    rec.check_writable(Path(path).parent if Path(path).parent != Path("") else Path("."),
                       option=option)
    return path


def cmd_bench(args) -> int:
    from harness.tools.bench import main as bench_main
    _load_modules(args.kernel_module)
    _cache(args)  # compilation is not timed; XLA's memory analysis reads a cached program too
    from harness.tools.census.options import positive
    repeats = positive("--repeats")(args.repeats)
    return bench_main(shapes=args.shapes, repeats=repeats,
                      output=_output_file(args.output), kernels=args.kernels)


def cmd_selftest(args) -> int:
    from harness.tools.selftest import main as selftest_main
    _cache(args)
    return selftest_main(bugs=args.bugs)


def cmd_repro(args) -> int:
    from harness.tools.repro import main as repro_main
    _load_modules(args.kernel_module)
    _cache(args)
    return repro_main(args.kernel, args.case_id, check=args.check,
                      output=_output_file(args.output))


def cmd_census(args) -> int:
    from harness.tools.census import main as census_main
    from harness.tools.census.options import CensusOptions
    census = CensusOptions.from_args(args)
    return census_main(census, _run_options(args, source="census",
                                            suite=census.suite,
                                            report_dir=str(census.run_dir)))


def _usage(message: str):
    from harness.errors import UsageError
    return UsageError(message)


class Parser(argparse.ArgumentParser):
    """argparse with its mistakes in one line, as every other mistake here (its own print the
    usage block before them): the command, what is wrong, where the help is."""

    def error(self, message):
        self.exit(2, f"error: {self.prog}: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m harness", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = sub.add_parser("run", help="run the kernel x case matrix and write a report")
    opts.add_arguments(run, opts.RUN)
    run.set_defaults(func=cmd_run)

    lst = sub.add_parser("list", help="list kernels (and with -v the suite's case ids)")
    opts.add_arguments(lst, opts.LIST)
    lst.add_argument("-v", "--verbose", action="store_true", help="also list the case ids")
    lst.set_defaults(func=cmd_list)
    _view_parsers(sub)
    _tool_parsers(sub)
    return parser


def _view_parsers(sub) -> None:
    """report, merge, compare, baseline."""
    rep = sub.add_parser("report", help="rewrite summary.md and report.html of a report folder")
    rep.add_argument("report_dir", help="a report folder (with report.jsonl)")
    rep.set_defaults(func=cmd_report)

    mrg = sub.add_parser("merge", help="merge report folders (shards of one suite) into one")
    mrg.add_argument("out", help="the folder the merged report goes to")
    mrg.add_argument("sources", nargs="+", help="report folders (or report.jsonl files)")
    mrg.add_argument("--rejudge", action="store_true",
                     help="recompute expectations/outcomes from the kernels as registered "
                          "now (a kernel not registered here, or whose library is missing "
                          "here, keeps its records)")
    mrg.set_defaults(func=cmd_merge)

    cmp_ = sub.add_parser("compare", help="compare a report with a baseline (folders or files)")
    cmp_.add_argument("new", help="the report to judge (folder or file)")
    cmp_.add_argument("baseline", help="the baseline report or baseline file")
    cmp_.add_argument("--growth", default=opts.default("growth", opts.RUN), metavar="FACTOR",
                      help=opts.BY_NAME["growth"].help + " (default %(default)s)")
    cmp_.set_defaults(func=cmd_compare)

    base = sub.add_parser("baseline", help="make one baseline from several runs of the same "
                                           "cases (each check's error range over them)")
    base.add_argument("out", help="the baseline file to write (.jsonl or .jsonl.gz)")
    base.add_argument("sources", nargs="+", help="report folders or files of the runs")
    base.set_defaults(func=cmd_baseline)


def _add_cache(p) -> None:
    p.add_argument("--compilation-cache", metavar="DIR", help=opts.BY_NAME[
        "compilation_cache"].help + f" (default {opts.DEFAULT_CACHE_DIR})".replace("%", "%%"))
    p.add_argument("--no-compilation-cache", action="store_true",
                   help=opts.BY_NAME["use_compilation_cache"].help)


def _tool_parsers(sub) -> None:
    """bench, selftest, repro, census."""
    from harness.tools.bench.entries import DEFAULT_ENTRIES_TEXT
    bench = sub.add_parser("bench", help="time the op's packed path beside raw cuDNN, TE, the "
                                         "causal-only call, the fallback and XLA (fwd+bwd)")
    bench.add_argument("--shapes", default="small",
                       help="small (a few hundred tokens: any device, CPU included), hopper "
                            "(8x2048, 1x8192, 1x32768, short segments; 32/8 heads, head_dim "
                            "128: GPUs; refused with one line where nothing fits) or census "
                            "(the seed shape and 1x8192 of hopper) (default %(default)s)")
    bench.add_argument("--repeats", default=10,
                       help="timed calls per entry (median, min, spread; default %(default)s)")
    bench.add_argument("--output", help="write the results and goal checks as JSON here")
    bench.add_argument("--kernels", help="comma-separated bench entries, or any registered "
                                         f"kernel (default: {DEFAULT_ENTRIES_TEXT})")
    bench.add_argument("--kernel-module", action="append", default=[], metavar="PATH",
                       help=opts.BY_NAME["kernel_modules"].help)
    _add_cache(bench)
    bench.set_defaults(func=cmd_bench)

    st = sub.add_parser("selftest", help="the harness's bug zoo: every bug caught, no correct "
                                         "kernel flagged")
    st.add_argument("--bugs", help="comma-separated zoo entries (default: all)")
    _add_cache(st)
    st.set_defaults(func=cmd_selftest)

    rp = sub.add_parser("repro", help="shrink a failing case and write a standalone script")
    rp.add_argument("kernel", help="a registered kernel name")
    rp.add_argument("case_id", help="the failing case's id (from a report)")
    rp.add_argument("--check", help="the check that must keep failing (default: the first "
                                    "that fails)")
    rp.add_argument("--output", help="where the script goes (default repro_<kernel>.py)")
    rp.add_argument("--kernel-module", action="append", default=[], metavar="PATH",
                    help=opts.BY_NAME["kernel_modules"].help)
    _add_cache(rp)
    rp.set_defaults(func=cmd_repro)

    from harness.tools.census.options import add_arguments as census_arguments
    cen = sub.add_parser("census", help="every packed path judged, timed and tabled: the suite, "
                                        "one bench, reproducers, census.md (in "
                                        "reports/census-latest unless --report-dir)")
    census_arguments(cen)
    cen.set_defaults(func=cmd_census)


def main(argv=None) -> int:
    from harness.errors import UsageError

    args = build_parser().parse_args(argv)
    try:
        from harness.kernels.libraries import mark_absl_flags_parsed
        mark_absl_flags_parsed()
        return args.func(args)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # `python -m harness list | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
