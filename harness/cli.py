"""python -m harness run | list | report | merge | compare | baseline | bench | selftest | repro |
census

Every user mistake (a path, a kernel or suite name, a glob, a module, a baseline, a shape too
big for the device) is one line on stderr and exit status 2, found before any work starts."""
from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path


def growth_factor(text: str) -> float:
    """--growth: an error grown by more than this factor is a regression; above 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 1:
        raise argparse.ArgumentTypeError(f"{text} must be above 1 (a factor of growth)")
    return value


def seed_count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text} must be at least 1")
    return value


def _add_selection(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kernels", help="comma-separated kernel names (default: all registered)")
    p.add_argument("--kernel-module", action="append", default=[], metavar="PATH",
                   help="a Python file (or an importable module name) that calls "
                        "harness.register_kernel (repeatable)")


def _add_growth(p: argparse.ArgumentParser) -> None:
    p.add_argument("--growth", type=growth_factor, default=2.0,
                   help="an error grown by more than this factor beyond its measured spread is "
                        "a regression (default %(default)s; see harness/judge/regression.py)")


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


def _selection(args) -> dict:
    """What the run selected, in its header: two runs that selected alike are compared pair for
    pair (a missing pair is then a regression)."""
    return {"suite": args.suite, "cases": args.cases, "seeds": args.seeds, "shard": args.shard,
            "kernels": args.kernels}


def cmd_run(args) -> int:
    from harness.views import report_dir as reporting
    from harness.views import report_file as rec
    from harness.engine.environment import current_platform, describe
    from harness.engine.registry import select_kernels
    from harness.engine.runner import run_matrix
    from harness.model.suites import parse_shard, shard, suite_cases

    _load_modules(args.kernel_module)
    if args.worker_pairs:
        return _run_worker(args)
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
    rec.check_writable(report_dir)
    from harness.engine import isolation
    if isolation.needs_workers(kernels):
        return _run_controller(args, kernels, cases, report_dir)
    programs = _programs(args)
    writer = reporting.ReportWriter(
        report_dir, describe(), suite=args.suite, kernels=[k.name for k in kernels],
        cases=len(cases), seeds=args.seeds, shard=args.shard, probe_mode=programs.probe_mode,
        leak_probe=not args.no_leak_probe, selection=_selection(args))
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


def _run_worker(args) -> int:
    """A worker of a controller (harness.engine.isolation): the pairs of its file, records
    appended as they finish, each pair announced before it starts; no views."""
    import json

    from harness.engine.environment import current_platform, describe
    from harness.engine.isolation import FINISHED_FILE, STARTED_FILE
    from harness.engine.registry import select_kernels
    from harness.engine.runner import run_matrix
    from harness.model.case import Case
    from harness.views import report_dir as reporting

    pairs = [tuple(p) for p in json.loads(Path(args.worker_pairs).read_text())]
    kernels = select_kernels(list(dict.fromkeys(k for k, _ in pairs)))
    cases = [Case.from_id(c) for c in dict.fromkeys(c for _, c in pairs)]
    report_dir = Path(args.report_dir)
    programs = _programs(args)
    writer = reporting.ReportWriter(report_dir, describe(), suite=args.suite,
                                    probe_mode=programs.probe_mode,
                                    leak_probe=not args.no_leak_probe)
    started = (report_dir / STARTED_FILE).open("a")
    finished = (report_dir / FINISHED_FILE).open("a")

    def announce(log, kernel, case, **more):
        log.write(json.dumps({"kernel": kernel.name, "case_id": case.id, **more}) + "\n")
        log.flush()

    def on_result(kernel, case, result):
        writer.add(result)
        # After its records, and how many: a reader takes the pair once it has read them all.
        announce(finished, kernel, case, records=len(result.records))
    try:
        run_matrix(kernels, cases, current_platform(), on_result=on_result,
                   programs=programs, leak=not args.no_leak_probe, pairs=set(pairs),
                   on_start=lambda kernel, case: announce(started, kernel, case))
    finally:
        programs.close()
        started.close()
        finished.close()
    writer.close(timing=programs.report())
    return 0


def _run_controller(args, kernels, cases, report_dir: Path) -> int:
    """Kernels of several process groups: each group in workers, two groups at a time (or one
    after another, harness.engine.isolation.start_groups); their reports joined into one."""
    import threading
    from harness.engine import isolation
    from harness.views import report_file as rec
    from harness.views.report_dir import finish_merged, merge_reports

    import time
    start = time.monotonic()
    import shutil
    workdir = report_dir / "workers"
    shutil.rmtree(workdir, ignore_errors=True)   # an earlier run's workers are not this run's
    options = ["--suite", args.suite, *isolation.option_flags(args)]
    groups = isolation.groups(kernels)
    stopping = threading.Event()
    crashes, interrupted = [], False
    crashes_lock = threading.Lock()
    signal.signal(signal.SIGTERM, _interrupt)

    def on_crash(kernel, case_id, why):
        if stopping.is_set():        # killed because the run was stopped: not its pair's crash
            raise isolation.Stopped()
        with crashes_lock:           # kept as it happens: a run stopped later still has it
            crashes.append((kernel, case_id, why))

    pool, futures = isolation.start_groups(
        {g: [(k.name, c.id) for c in cases for k in members] for g, members in groups.items()},
        workdir, options, on_crash=on_crash, stop=stopping)
    try:
        for future in futures:
            try:
                interrupted |= future.result().interrupted
            except isolation.Stopped:
                interrupted = True
    except BaseException as exc:    # stopped (Ctrl-C, SIGTERM), or a group's usage error
        stopping.set()               # before the kill: no worker starts after it
        for sig in (signal.SIGINT, signal.SIGTERM):   # a second signal: let the merge finish
            signal.signal(sig, signal.SIG_IGN)
        isolation.stop_live()
        pool.shutdown(wait=True, cancel_futures=True)
        if not isinstance(exc, KeyboardInterrupt):
            raise
        interrupted = True
    pool.shutdown(wait=True)
    if interrupted:
        print("interrupted: the report holds what finished", file=sys.stderr)
    # Every worker's report, in the groups' order (a worker stopped early kept what it wrote).
    dirs = [d for g in groups for d in isolation.worker_reports(workdir, g or "main")
            if (d / rec.RECORDS_FILE).exists()]
    records = isolation.crash_records(crashes, {k.name: k for k in kernels})
    if records or not dirs:
        crash_dir = workdir / "crashes"
        rec.write_report(crash_dir / rec.RECORDS_FILE, {}, records, suite=args.suite)
        dirs.append(crash_dir)
    merge_reports(report_dir, dirs)
    return finish_merged(report_dir, baseline=args.baseline, growth=args.growth,
                         interrupted=interrupted, suite=args.suite,
                         wall_s=round(time.monotonic() - start, 1),
                         kernels=[k.name for k in kernels], cases=len(cases), seeds=args.seeds,
                         shard=args.shard, selection=_selection(args),
                         isolation={g or "main": [k.name for k in m]
                                    for g, m in isolation.groups(kernels).items()})


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
    from harness.views import report_file as rec
    from harness.views.report_dir import run_status, write_views
    from harness.views.summary import print_console
    rec.resolve(args.report_dir)
    if not Path(args.report_dir).is_dir():
        raise _usage(f"report {args.report_dir}: give the report's folder (the views are "
                     "written beside report.jsonl)")
    _, records = write_views(Path(args.report_dir))
    print_console(records)
    return run_status(records)


def cmd_merge(args) -> int:
    from harness.views import report_file as rec
    from harness.views.report_dir import merge_reports, run_status
    from harness.views.summary import print_console
    for source in args.sources:
        rec.resolve(source)
    rec.check_writable(args.out, option="merge OUT")
    overlaps = merge_reports(Path(args.out), [Path(s) for s in args.sources],
                             rejudged=args.rejudge)
    _, records = rec.read(args.out)
    print_console(records)
    for source, n in overlaps:
        print(f"note: {source} repeats {n} kernel x case pairs of an earlier source; its "
              "records replace theirs", file=sys.stderr)
    print(f"merged {len(args.sources)} reports into {args.out}/ (report.jsonl, summary.md, "
          "report.html)")
    return run_status(records)


def cmd_compare(args) -> int:
    from harness.views import report_file as rec
    from harness.views.compare import compare_files
    rec.read(args.new)
    rec.read(args.baseline, what="baseline")
    return compare_files(args.new, args.baseline, growth=args.growth)


def cmd_baseline(args) -> int:
    from harness.views import report_file as rec
    from harness.views.compare import write_baseline
    for source in args.sources:
        rec.read(source)
    parent = Path(args.out).parent
    rec.check_writable(parent, option="baseline OUT")
    return write_baseline(args.out, args.sources)


def _cache(args) -> None:
    from harness.engine.programs import enable_compilation_cache
    enable_compilation_cache(None if args.no_compilation_cache else args.compilation_cache)


def cmd_bench(args) -> int:
    from harness.tools.bench import main as bench_main
    _load_modules(args.kernel_module)
    _cache(args)  # compilation is not timed; XLA's memory analysis reads a cached program too
    return bench_main(args)


def cmd_selftest(args) -> int:
    from harness.tools.selftest import main as selftest_main
    _cache(args)
    return selftest_main(args)


def cmd_repro(args) -> int:
    from harness.tools.repro import main as repro_main
    from harness.views import report_file as rec
    _load_modules(args.kernel_module)
    _cache(args)
    if args.output:  # a path it cannot write: now, not after minutes of shrinking
        rec.check_writable(Path(args.output).parent, option="--output")
        if Path(args.output).is_dir():
            raise _usage(f"--output {args.output}: a folder; give the script's file name")
    return repro_main(args)


def cmd_census(args) -> int:
    from harness.tools.census import main as census_main
    _load_modules(args.kernel_module)
    return census_main(args)


def _usage(message: str):
    from harness.errors import UsageError
    return UsageError(message)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m harness", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    _run_parser(sub)
    _view_parsers(sub)
    _tool_parsers(sub)
    return parser


def _run_parser(sub) -> None:
    run = sub.add_parser("run", help="run the kernel x case matrix and write a report")
    run.add_argument("--suite", default="smoke",
                     help="smoke (CPU, minutes) or nightly (GPU) (default %(default)s)")
    run.add_argument("--cases", help="glob(s) over case ids, comma-separated, to narrow the "
                                     "suite; a case id with another seed (…-s1) is taken as is")
    run.add_argument("--seeds", type=seed_count, default=1,
                     help="run every case under N seeds (default %(default)s)")
    run.add_argument("--shard", metavar="I/N", help="run shard I of N (join them: harness merge)")
    run.add_argument("--report-dir", default="reports/latest", metavar="DIR",
                     help="where the report goes (default %(default)s)")
    run.add_argument("--baseline", help="a baseline report (folder or file) to compare with")
    _add_growth(run)
    run.add_argument("--worker-pairs", help=argparse.SUPPRESS)  # a controller's worker
    run.add_argument("--no-leak-probe", action="store_true",
                     help="tolerance checks only (the views then say the probe did not run)")
    run.add_argument("--no-deterministic-probe", action="store_true",
                     help="probe the kernels' default builds on GPUs too (a tensor that "
                          "differs in its reruns is then decided above its noise, one whose "
                          "reruns agree bitwise)")
    _add_selection(run)
    _add_compilation(run)
    run.set_defaults(func=cmd_run)


def _view_parsers(sub) -> None:
    """list, report, merge, compare, baseline."""
    lst = sub.add_parser("list", help="list kernels (and with -v the suite's case ids)")
    lst.add_argument("--suite", default="smoke", help="the suite whose cases are counted and "
                                                       "listed (default %(default)s)")
    lst.add_argument("--cases", help="glob(s) over case ids, comma-separated")
    lst.add_argument("-v", "--verbose", action="store_true", help="also list the case ids")
    _add_selection(lst)
    lst.set_defaults(func=cmd_list)

    rep = sub.add_parser("report", help="rewrite summary.md and report.html of a report folder")
    rep.add_argument("report_dir", help="a report folder (with report.jsonl)")
    rep.set_defaults(func=cmd_report)

    mrg = sub.add_parser("merge", help="merge report folders (shards of one suite) into one")
    mrg.add_argument("out", help="the folder the merged report goes to")
    mrg.add_argument("sources", nargs="+", help="report folders (or report.jsonl files)")
    mrg.add_argument("--rejudge", action="store_true",
                     help="recompute expectations/outcomes from the kernels as registered now")
    mrg.set_defaults(func=cmd_merge)

    cmp_ = sub.add_parser("compare", help="compare a report with a baseline (folders or files)")
    cmp_.add_argument("new", help="the report to judge (folder or file)")
    cmp_.add_argument("baseline", help="the baseline report or baseline file")
    _add_growth(cmp_)
    cmp_.set_defaults(func=cmd_compare)

    base = sub.add_parser("baseline", help="make one baseline from several runs of the same "
                                           "cases (each check's error range over them)")
    base.add_argument("out", help="the baseline file to write (.jsonl or .jsonl.gz)")
    base.add_argument("sources", nargs="+", help="report folders or files of the runs")
    base.set_defaults(func=cmd_baseline)


def _tool_parsers(sub) -> None:
    """bench, selftest, repro, census."""
    bench = sub.add_parser("bench", help="time the op's packed path beside raw cuDNN, TE, the "
                                         "causal-only call, the fallback and XLA (fwd+bwd)")
    bench.add_argument("--shapes", default="small",
                       help="small (a few hundred tokens: any device, CPU included) or hopper "
                            "(8x2048, 1x8192, 1x32768, short segments; 32/8 heads, head_dim "
                            "128: GPUs; refused with one line where nothing fits); census "
                            "(the seed shape and 1x8192 of hopper)")
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
    _add_compilation(bench)
    bench.set_defaults(func=cmd_bench)

    st = sub.add_parser("selftest", help="the harness's bug zoo: every bug caught, no correct "
                                         "kernel flagged")
    st.add_argument("--bugs", help="comma-separated zoo entries (default: all)")
    _add_compilation(st)
    st.set_defaults(func=cmd_selftest)

    rp = sub.add_parser("repro", help="shrink a failing case and write a standalone script")
    rp.add_argument("kernel", help="a registered kernel name")
    rp.add_argument("case_id", help="the failing case's id (from a report)")
    rp.add_argument("--check", help="the check that must keep failing (default: the first "
                                    "that fails)")
    rp.add_argument("--output", help="where the script goes (default repro_<kernel>.py)")
    rp.add_argument("--kernel-module", action="append", default=[], metavar="PATH",
                    help="a Python file (or module) that registers the kernel (repeatable)")
    _add_compilation(rp)
    rp.set_defaults(func=cmd_repro)

    from harness.tools.census.options import add_arguments as census_arguments
    cen = sub.add_parser("census", help="every packed path judged, timed and tabled: the suite, "
                                        "one bench, reproducers, reports/census/census.md")
    census_arguments(cen, _add_compilation, seed_count)
    cen.set_defaults(func=cmd_census)


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
