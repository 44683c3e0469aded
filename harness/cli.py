"""python -m harness run | list | report | merge | compare | bench | selftest | repro

Every user mistake (a path, a kernel or suite name, a glob, a module, a baseline, a shape too
big for the device) is one line on stderr and exit status 2, found before any work starts."""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path


def _add_selection(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kernels", help="comma-separated kernel names (default: all registered)")
    p.add_argument("--kernel-module", action="append", default=[], metavar="PATH",
                   help="a Python file that calls harness.register_kernel (repeatable)")


def _add_compilation(p: argparse.ArgumentParser) -> None:
    from harness.engine.programs import DEFAULT_CACHE_DIR
    p.add_argument("--compilation-cache", default=DEFAULT_CACHE_DIR, metavar="DIR",
                   help="jax's persistent compilation cache (default %(default)s; "
                        "HARNESS_COMPILATION_CACHE sets it too)")
    p.add_argument("--no-compilation-cache", action="store_true",
                   help="compile everything afresh, keep nothing on disk")


def _load_modules(paths) -> None:
    from harness.engine.registry import load_kernel_module
    for path in paths:
        load_kernel_module(path)


def _programs(args):
    from harness.engine.programs import Programs, enable_compilation_cache
    enable_compilation_cache(None if args.no_compilation_cache else args.compilation_cache)
    return Programs(deterministic_probe=not args.no_deterministic_probe)


def cmd_run(args) -> int:
    from harness.views import report_dir as reporting
    from harness.views import report_file as rec
    from harness.engine.environment import current_platform, describe
    from harness.engine.registry import select_kernels
    from harness.engine.runner import run_matrix
    from harness.model.suites import parse_shard, shard, suite_cases

    _load_modules(args.kernel_module)
    kernels = select_kernels(args.kernels)
    cases = suite_cases(args.suite, args.cases, seeds=args.seeds)
    part = parse_shard(args.shard)
    if part:
        cases = shard(cases, *part)
    if args.baseline:
        rec.read(args.baseline, what="baseline")  # a missing or broken baseline: now, not later
    report_dir = Path(args.report_dir)
    if (report_dir / rec.RECORDS_FILE).exists():
        print(f"replacing the report in {report_dir}/ (--report-dir DIR writes elsewhere)",
              file=sys.stderr)
    programs = _programs(args)
    writer = reporting.ReportWriter(
        report_dir, describe(), suite=args.suite, kernels=[k.name for k in kernels],
        cases=len(cases), seeds=args.seeds, shard=args.shard, probe_mode=programs.probe_mode,
        leak_probe=not args.no_leak_probe)
    from harness.views.progress import progress
    interrupted = False
    signal.signal(signal.SIGTERM, _interrupt)  # `timeout` and CI cancellations: keep the report
    try:
        with progress(len(cases) * len(kernels)) as step:
            def on_result(kernel, case, result):
                writer.add(result)
                step(f"{kernel.name} {case.id}")
            run_matrix(kernels, cases, current_platform(), on_result=on_result,
                       programs=programs, leak=not args.no_leak_probe)
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: the report holds what finished", file=sys.stderr)
    finally:
        programs.close()
    status = writer.finish(baseline=args.baseline, growth=args.growth, timing=programs.report(),
                           interrupted=interrupted)
    return 130 if interrupted else status


def _interrupt(signum, frame):
    raise KeyboardInterrupt


def cmd_list(args) -> int:
    from harness.engine.environment import current_platform
    from harness.engine.registry import select_kernels
    from harness.model.suites import suite_cases

    _load_modules(args.kernel_module)
    platform = current_platform()
    cases = suite_cases(args.suite, args.cases)
    for kernel in select_kernels(args.kernels):
        runnable = sum(not kernel.unsupported_reasons(c, platform) for c in cases)
        print(f"{kernel.name:42s} {runnable:3d}/{len(cases)} cases  {kernel.description}")
    if args.verbose:
        for case in cases:
            print(case.id)
    return 0


def cmd_report(args) -> int:
    from harness.judge import judging
    from harness.views.report_dir import write_views
    from harness.views.summary import print_console
    _, records = write_views(Path(args.report_dir))
    print_console(records)
    return 1 if judging.bad(records) else 0


def cmd_merge(args) -> int:
    from harness.judge import judging
    from harness.views import report_file as rec
    from harness.views.report_dir import merge_reports
    from harness.views.summary import print_console
    for source in args.sources:
        rec.resolve(source)
    merge_reports(Path(args.out), [Path(s) for s in args.sources], rejudged=args.rejudge)
    _, records = rec.read(args.out)
    print_console(records)
    return 1 if judging.bad(records) else 0


def cmd_compare(args) -> int:
    from harness.views import report_file as rec
    from harness.judge.regression import compare_files
    rec.read(args.new)
    rec.read(args.baseline, what="baseline")
    return compare_files(args.new, args.baseline, growth=args.growth)


def cmd_bench(args) -> int:
    from harness.tools.bench import main as bench_main
    _load_modules(args.kernel_module)
    return bench_main(args)


def cmd_selftest(args) -> int:
    from harness.tools.selftest import main as selftest_main
    return selftest_main(args)


def cmd_repro(args) -> int:
    from harness.tools.repro import main as repro_main
    _load_modules(args.kernel_module)
    return repro_main(args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harness", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run the kernel x case matrix and write a report")
    run.add_argument("--suite", default="smoke", help="smoke (CPU, minutes) or nightly (GPU)")
    run.add_argument("--cases", help="glob(s) over case ids, comma-separated, to narrow the suite")
    run.add_argument("--seeds", type=int, default=1, help="run every case under N seeds")
    run.add_argument("--shard", metavar="I/N", help="run shard I of N (join them: harness merge)")
    run.add_argument("--report-dir", default="reports/latest")
    run.add_argument("--baseline", help="a baseline report (folder or file) to compare with")
    run.add_argument("--growth", type=float, default=2.0,
                     help="error growth over the baseline that counts as a regression")
    run.add_argument("--no-leak-probe", action="store_true",
                     help="tolerance checks only (the views then say the probe did not run)")
    run.add_argument("--no-deterministic-probe", action="store_true",
                     help="probe the kernels' default builds on GPUs too (tensors that differ "
                          "run to run are then unprobed)")
    _add_selection(run)
    _add_compilation(run)
    run.set_defaults(func=cmd_run)

    lst = sub.add_parser("list", help="list kernels (and with -v the suite's case ids)")
    lst.add_argument("--suite", default="smoke")
    lst.add_argument("--cases")
    lst.add_argument("-v", "--verbose", action="store_true")
    _add_selection(lst)
    lst.set_defaults(func=cmd_list)

    rep = sub.add_parser("report", help="rewrite summary.md and report.html of a report folder")
    rep.add_argument("report_dir")
    rep.set_defaults(func=cmd_report)

    mrg = sub.add_parser("merge", help="merge report folders (shards of one suite) into one")
    mrg.add_argument("out")
    mrg.add_argument("sources", nargs="+")
    mrg.add_argument("--rejudge", action="store_true",
                     help="recompute expectations/outcomes from the kernels as registered now")
    mrg.set_defaults(func=cmd_merge)

    cmp_ = sub.add_parser("compare", help="compare a report with a baseline (folders or files)")
    cmp_.add_argument("new")
    cmp_.add_argument("baseline")
    cmp_.add_argument("--growth", type=float, default=2.0)
    cmp_.set_defaults(func=cmd_compare)

    bench = sub.add_parser("bench", help="time the op's packed path beside raw cuDNN, TE, the "
                                         "causal-only call, the fallback and XLA (fwd+bwd)")
    bench.add_argument("--shapes", default="small",
                       help="small (a few hundred tokens: any device, CPU included) or hopper "
                            "(8x2048, 1x8192, 1x32768, short segments; 32/8 heads, head_dim "
                            "128: GPUs; refused with one line where nothing fits)")
    bench.add_argument("--repeats", type=int, default=10,
                       help="timed calls per entry (median, min, spread; default %(default)s)")
    bench.add_argument("--output", help="write the results and goal checks as JSON here")
    bench.add_argument("--kernels",
                       help="comma-separated bench entries (default: all of sut:cudnn_flash_jax, "
                            "raw:cudnn_packed, te:thd, raw:te_thd_offsets, sut:cudnn_flash_te, "
                            "maxtext_original:cudnn_flash_jax, sut:cudnn_flash_jax:fallback, "
                            "xla), or any registered kernel")
    bench.add_argument("--kernel-module", action="append", default=[], metavar="PATH",
                       help="a Python file that calls harness.register_kernel (repeatable)")
    bench.set_defaults(func=cmd_bench)

    st = sub.add_parser("selftest", help="the harness's bug zoo: every bug caught, no correct "
                                         "kernel flagged")
    st.add_argument("--bugs", help="comma-separated zoo entries (default: all)")
    st.set_defaults(func=cmd_selftest)

    rp = sub.add_parser("repro", help="shrink a failing case and write a standalone script")
    rp.add_argument("kernel")
    rp.add_argument("case_id")
    rp.add_argument("--check", help="the check that must keep failing (default: the first "
                                    "that fails)")
    rp.add_argument("--output", help="where the script goes (default repro_<kernel>.py)")
    rp.add_argument("--kernel-module", action="append", default=[], metavar="PATH")
    rp.set_defaults(func=cmd_repro)
    return parser


def main(argv=None) -> int:
    from harness.errors import UsageError

    args = build_parser().parse_args(argv)
    try:
        from harness.engine.registry import mark_absl_flags_parsed
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
