"""python -m harness run | list | compare | bench"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _add_selection(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kernels", help="comma-separated kernel names (default: all registered)")
    p.add_argument("--kernel-module", action="append", default=[], metavar="PATH",
                   help="a Python file that calls harness.register_kernel (repeatable)")


def _load_modules(paths) -> None:
    from harness.registry import load_kernel_module
    for path in paths:
        load_kernel_module(path)


def cmd_run(args) -> int:
    from harness import reporting
    from harness.environment import current_platform, describe
    from harness.registry import select_kernels
    from harness.runner import run_matrix
    from harness.suites import suite_cases

    _load_modules(args.kernel_module)
    kernels = select_kernels(args.kernels)
    cases = suite_cases(args.suite, args.cases)
    if not cases:
        print(f"no case of suite {args.suite!r} matches {args.cases!r}", file=sys.stderr)
        return 2
    writer = reporting.ReportWriter(Path(args.report_dir), describe(), suite=args.suite,
                                    kernels=[k.name for k in kernels], cases=len(cases))
    from harness.progress import progress
    with progress(len(cases) * len(kernels)) as step:
        def on_result(kernel, case, result):
            writer.add(result)
            step(f"{kernel.name} {case.id}")
        run_matrix(kernels, cases, current_platform(), on_result=on_result)
    return writer.finish(baseline=args.baseline, growth=args.growth)


def cmd_list(args) -> int:
    from harness.environment import current_platform
    from harness.registry import select_kernels
    from harness.suites import suite_cases

    _load_modules(args.kernel_module)
    platform = current_platform()
    cases = suite_cases(args.suite, args.cases)
    for kernel in select_kernels(args.kernels):
        runnable = sum(not kernel.unsupported_reasons(c, platform) for c in cases)
        print(f"{kernel.name:28s} {runnable:3d}/{len(cases)} cases  {kernel.description}")
    if args.verbose:
        for case in cases:
            print(case.id)
    return 0


def cmd_report(args) -> int:
    from harness.reporting import write_views
    from harness.summary import print_console, problems
    _, records = write_views(Path(args.report_dir))
    print_console(records)
    return 1 if problems(records) else 0


def cmd_merge(args) -> int:
    from harness.reporting import merge_reports
    merge_reports(Path(args.out), [Path(s) for s in args.sources], rejudged=args.rejudge)
    return cmd_report(argparse.Namespace(report_dir=args.out))


def cmd_compare(args) -> int:
    from harness.baseline import compare_files
    return compare_files(args.new, args.baseline, growth=args.growth)


def cmd_bench(args) -> int:
    from harness.bench import main as bench_main
    _load_modules(args.kernel_module)
    return bench_main(args)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m harness", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run the kernel x case matrix and write a report")
    run.add_argument("--suite", default="smoke", help="smoke (CPU, minutes) or nightly (GPU)")
    run.add_argument("--cases", help="glob(s) over case ids, comma-separated, to narrow the suite")
    run.add_argument("--report-dir", default="reports/latest")
    run.add_argument("--baseline", help="a baseline report.jsonl to compare with at the end")
    run.add_argument("--growth", type=float, default=2.0,
                     help="error growth over the baseline that counts as a regression")
    _add_selection(run)
    run.set_defaults(func=cmd_run)

    lst = sub.add_parser("list", help="list kernels (and with -v the suite's case ids)")
    lst.add_argument("--suite", default="smoke")
    lst.add_argument("--cases")
    lst.add_argument("-v", "--verbose", action="store_true")
    _add_selection(lst)
    lst.set_defaults(func=cmd_list)

    rep = sub.add_parser("report", help="rewrite summary.md and report.html from a report folder")
    rep.add_argument("report_dir")
    rep.set_defaults(func=cmd_report)

    mrg = sub.add_parser("merge", help="merge report folders (shards of one suite) into one")
    mrg.add_argument("out")
    mrg.add_argument("sources", nargs="+")
    mrg.add_argument("--rejudge", action="store_true",
                     help="recompute expectations/outcomes from the kernels as registered now")
    mrg.set_defaults(func=cmd_merge)

    cmp_ = sub.add_parser("compare", help="compare a report with a baseline")
    cmp_.add_argument("new")
    cmp_.add_argument("baseline")
    cmp_.add_argument("--growth", type=float, default=2.0)
    cmp_.set_defaults(func=cmd_compare)

    bench = sub.add_parser("bench", help="time kernels forward+backward (medians, ratios)")
    bench.add_argument("--shapes", default="small",
                       help="small (CPU) or hopper (the GPU runner's shapes)")
    bench.add_argument("--repeats", type=int, default=10)
    bench.add_argument("--output", help="write the results as JSON here")
    _add_selection(bench)
    bench.set_defaults(func=cmd_bench)

    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (KeyError, ValueError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
