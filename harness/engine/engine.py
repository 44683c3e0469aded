"""The engine: `run(options) -> status` runs a matrix from its options to its finished report.

    options (harness.engine.options) -> selection (kernels, cases) -> pairs run here, or in
    worker processes per isolation group (harness.engine.workers) -> records in the report
    folder -> finish: the header's last facts, the views, the console, the status, the
    baseline compared

Every caller is thin: the CLI's `run`, the census and the worker processes call `run` or its
steps; pytest (harness.pytest_plugin) calls `prepare`, the same workers through its lanes
(harness.engine.lanes), and `finish`. There is one finish: whoever ran the pairs, a report is
ended, viewed, judged for its status and compared with its baseline here.
"""
from __future__ import annotations

import signal
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from harness.engine import main_parts, workers
from harness.engine.options import RunOptions
from harness.errors import UsageError
from harness.judge import tallies
from harness.judge import vocabulary as v
from harness.store import report_file as rec
from harness.store.writer import FINISHED, INTERRUPTED, VIEWS, FolderLock, ReportWriter, begin

# The exit status of a run stopped by Ctrl-C or SIGTERM (what finished is kept).
STOPPED = 130


@dataclass
class Selection:
    """What a run runs: its kernels and its cases (in suite order); a shard's: how many of
    its run's shards hold a case (the others are refused: merge.missing_shards)."""
    kernels: list
    cases: list
    shards_filled: int | None = None

    @property
    def pairs(self) -> int:
        return len(self.kernels) * len(self.cases)


def select(options: RunOptions) -> Selection:
    """The kernels and cases the options name: modules loaded, names and globs checked (one
    UsageError naming the first mistake)."""
    from harness.engine.registry import (
        load_kernel_module,
        mark_absl_flags_parsed,
        select_kernels,
    )
    from harness.model.suites import shard, suite_cases
    mark_absl_flags_parsed()
    for path in options.kernel_modules:
        load_kernel_module(path)
    kernels = select_kernels(options.kernels)
    cases = suite_cases(options.suite, options.cases, seeds=options.seeds,
                        features=options.features)
    if options.shard_part:
        # Dealt out one by one where the shapes are fewer than the shards: the shards past
        # the cases' count hold none (harness.model.suites.shard).
        filled = min(options.shard_part[1], len(cases))
        return Selection(kernels, shard(cases, *options.shard_part), filled)
    return Selection(kernels, cases)


def prepare(options: RunOptions) -> Selection:
    """Everything a user can get wrong, before any work: the options, the selection, the
    baseline (readable), the report folder (writable), the compilation cache."""
    from harness.engine.environment import check_backend, nvidia_gpus
    from harness.engine.compilation_cache import enable_compilation_cache
    if not nvidia_gpus():
        # jax's backend starts here, or one line says why, before the report folder is made
        # (on a GPU machine this process starts no device: its workers do, and say so).
        check_backend()
    selection = select(options)
    if not selection.cases:
        raise UsageError(f"--shard {options.shard}: this shard holds no case (the suite's "
                         "cases deal out into fewer shards); use fewer shards")
    if options.baseline:
        rec.read(options.baseline, what="baseline")
    rec.check_writable(options.report_dir)
    enable_compilation_cache(options.cache_dir)
    return selection


def gpu_suite_warning(options: RunOptions, platform=None) -> str | None:
    """The nightly suite on a CPU: rows up to 32768 tokens, hours of work. `platform`: the
    Platform where one was started; else whether nvidia-smi lists a GPU (nothing started)."""
    from harness.engine.environment import nvidia_gpus
    on_cpu = platform.name == "cpu" if platform is not None else not nvidia_gpus()
    if options.suite == "nightly" and on_cpu:
        return ("the nightly suite is sized for a GPU (rows up to 32768 tokens): on this CPU "
                "one kernel takes most of an hour")
    return None


def refuse_gpu_suite_on_cpu(options: RunOptions) -> None:
    """The nightly suite on a CPU (run, pytest's matrix, the census) with nothing narrowing it:
    a UsageError before any work. Narrowed with --cases, --kernels or --shard, it runs (the
    user chose what to wait for), after a one-line note on stderr."""
    options = options.checked()
    warning = gpu_suite_warning(options)
    if warning and not (options.cases or options.kernels or options.shard):
        raise UsageError(f"{warning}; use --suite smoke, or narrow it with --cases or "
                         "--kernels")
    if warning:
        print(f"note: {warning}; narrowed, so it runs", file=sys.stderr)


def run_info(options: RunOptions, selection: Selection, **more) -> dict:
    """The header's account of what the run was asked to do."""
    return {"suite": options.suite, "kernels": [k.name for k in selection.kernels],
            "cases": len(selection.cases), "seeds": options.seeds, "shard": options.shard,
            "leak_probe": options.leak_probe, "selection": options.selection(),
            "source": options.source, **more,
            **({"shards_filled": selection.shards_filled} if selection.shards_filled else {})}


def run(options: RunOptions) -> int:
    """Runs the matrix the options select and finishes its report; the run's exit status (0
    green, 1 red or regressed, 130 stopped)."""
    options = options.checked()
    selection = prepare(options)
    report_dir = Path(options.report_dir)
    lock = FolderLock(report_dir).acquire()
    try:
        present = [n for n in (rec.RECORDS_FILE, rec.TRACES_FILE, *VIEWS)
                   if (report_dir / n).exists()]
        if present:
            print(f"replacing the report in {report_dir}/ ({', '.join(present)}; --report-dir "
                  "DIR writes elsewhere)", file=sys.stderr)
        previous = signal.getsignal(signal.SIGTERM)
        on_sigterm()   # `timeout`, CI cancellations
        try:
            # On GPUs the pairs run in worker processes: this process never starts a device
            # (that would take a share of its memory from the workers), and a kernel that
            # leaves a device context unusable costs one worker, not the run.
            from harness.engine.environment import nvidia_gpus
            if workers.needs_workers(selection.kernels) or nvidia_gpus():
                facts, interrupted = _run_in_workers(options, selection, report_dir)
            else:
                facts, interrupted = _run_here(options, selection, report_dir)
        finally:
            signal.signal(signal.SIGTERM, previous)
        if interrupted:
            print("interrupted: the report holds what finished", file=sys.stderr)
        status = finish(report_dir, options, state=INTERRUPTED if interrupted else FINISHED,
                        selected=[(k, c) for c in selection.cases for k in selection.kernels],
                        **facts)
        return STOPPED if interrupted else status
    finally:
        lock.release()


def stopped_by(report_dir: Path, exc: UsageError) -> None:
    """The report of a run a user's mistake stopped once it had begun (a kernel's `expect`
    that raises): its header interrupted, and by what (its views said "killed before its
    end"), and its views written from it (an earlier run's in the folder would stand). In
    workers, what they finished stays in their folders: the report has the header only."""
    from harness.views.report_dir import write_views
    rec.update_header(report_dir / rec.RECORDS_FILE, state=INTERRUPTED, stopped_by=str(exc))
    write_views(report_dir)


# A SIGTERM received (interrupt): Python drops an exception raised where it cannot be raised
# (jax's garbage-collection callback, a __del__), so the request is kept and checked again
# after each pair (stop_if_asked).
_TERM_ASKED = threading.Event()


def interrupt(signum, frame):
    """SIGTERM (`timeout`, a CI cancel) as Ctrl-C: the run stops as interrupted."""
    _TERM_ASKED.set()
    raise KeyboardInterrupt


def on_sigterm() -> None:
    """Installs `interrupt` for SIGTERM in this (the main) thread, no stop asked yet."""
    _TERM_ASKED.clear()
    signal.signal(signal.SIGTERM, interrupt)


def stop_if_asked() -> None:
    """Raises KeyboardInterrupt where a SIGTERM came and its exception was lost: CI's run that
    SIGTERM met inside jax's garbage-collection callback ran on to its end, exit 0."""
    if _TERM_ASKED.is_set():
        raise KeyboardInterrupt


def _result(future):
    """A worker group's result, waited for a second at a time: a SIGTERM whose exception was
    lost stops the wait (stop_if_asked)."""
    from concurrent.futures import wait
    while not wait([future], timeout=1.0).done:
        stop_if_asked()
    return future.result()


def _programs(options: RunOptions):
    from harness.engine.programs import for_run
    return for_run(options)


def _run_here(options: RunOptions, selection: Selection, report_dir: Path
              ) -> tuple[dict, bool]:
    """Every pair in this process, records written as they finish."""
    from harness.engine.environment import current_platform, describe
    from harness.engine.runner import run_matrix
    from harness.views.progress import progress
    programs = _programs(options)
    writer = ReportWriter(report_dir, describe(),
                          **run_info(options, selection, probe_mode=programs.probe_mode))
    interrupted = False
    try:
        with progress(selection.pairs) as step:
            def on_result(kernel, case, result):
                writer.add(result)
                step(f"{kernel.name} {case.id}")
                stop_if_asked()
            run_matrix(selection.kernels, selection.cases, current_platform(),
                       on_result=on_result, programs=programs, leak=options.leak_probe)
    except KeyboardInterrupt:
        interrupted = True
    except UsageError as exc:   # a kernel's own declaration raised mid-run (Kernel._call)
        stopped_by(report_dir, exc)
        raise
    finally:
        programs.close()
    from harness.engine.compilation_cache import cache_stats
    return {"wall_s": round(time.monotonic() - writer.start, 1), "timing": programs.report(),
            "compilation_cache": {"dir": options.cache_dir, **cache_stats()}}, interrupted


def _run_in_workers(options: RunOptions, selection: Selection, report_dir: Path
                    ) -> tuple[dict, bool]:
    """Kernels of several isolation groups: each group's pairs in worker processes (several
    groups at a time, harness.engine.workers.start_groups); their reports joined into the
    folder's. This process never touches a device."""
    import threading

    from harness.engine.environment import describe_host
    from harness.store.merge import merge_reports
    workdir = report_dir / "workers"
    workers.clear_workdir(workdir)   # an earlier run's workers are not this run's
    start, started_at = time.monotonic(), time.time()
    begin(report_dir, describe_host(), **run_info(options, selection))
    groups = workers.groups(selection.kernels)
    stopping = threading.Event()
    crashes, interrupted = [], False
    crashes_lock = threading.Lock()

    def on_crash(kernel, case_id, why):
        if stopping.is_set():        # killed because the run was stopped: not its pair's crash
            raise workers.Stopped()
        with crashes_lock:           # kept as it happens: a run stopped later still has it
            crashes.append((kernel, case_id, why))

    wanted = main_parts.parts_wanted(options)   # the main group's parts (one: whole)
    pool, futures = workers.start_groups(
        {g: [(k.name, c.id) for c in selection.cases for k in members]
         for g, members in groups.items()},
        workdir, options, on_crash=on_crash, stop=stopping,
        parts=wanted)
    again = None
    try:
        for future in futures:
            try:
                interrupted |= _result(future).interrupted
            except workers.Stopped:
                interrupted = True
        if not interrupted:
            stop_if_asked()
            again = workers.run_deferred(futures, workdir, options, on_crash=on_crash,
                                         stop=stopping)
            interrupted |= again is not None and again.interrupted
    except BaseException as exc:    # stopped (Ctrl-C, SIGTERM), or a group's usage error
        stopping.set()               # before the kill: no worker starts after it
        for sig in (signal.SIGINT, signal.SIGTERM):   # a second signal: let the merge finish
            signal.signal(sig, signal.SIG_IGN)
        workers.stop_live()
        pool.shutdown(wait=True, cancel_futures=True)
        if isinstance(exc, UsageError):
            stopped_by(report_dir, exc)
        if not isinstance(exc, KeyboardInterrupt):
            raise
        interrupted = True
    pool.shutdown(wait=True)
    # Every worker's report, in the groups' order (a worker stopped early kept what it wrote).
    dirs = [d for name in workers.report_names(groups, wanted)
            for d in workers.worker_reports(workdir, name) if (d / rec.RECORDS_FILE).exists()]
    records = workers.crash_records(crashes, {k.name: k for k in selection.kernels})
    if records or not dirs:
        crash_dir = workdir / "crashes"
        rec.write_report(crash_dir / rec.RECORDS_FILE, {}, records, suite=options.suite)
        dirs.append(crash_dir)
    parts = main_parts.header_parts(futures, rerun=not interrupted)
    run_again = workers.run_again_entries(futures, again)
    joined, joined_at = time.monotonic(), time.time()
    merge_reports(report_dir, dirs, **run_info(
        options, selection, isolation={g or "main": [k.name for k in m]
                                       for g, m in groups.items()},
        **({"main_parts": parts} if parts else {}),
        **({"run_again": run_again} if run_again else {})))
    end = time.monotonic()
    return {"wall_s": round(end - start, 1), "merge_s": round(end - joined, 1),
            "started_at": started_at, "joined_at": joined_at}, interrupted


def finish(report_dir: Path, options: RunOptions, *, state: str = FINISHED,
           console: bool = True, selected: list | None = None, **facts) -> int:
    """The one end of every run: the header's last facts (`facts`: wall time, timing, ...)
    and its state, the views, the console, the status; then the baseline compared. Returns 1
    if anything is bad or regressed (or nothing was judged), else 0. `selected`: the (kernel,
    case) pairs the run selected; in a finished run, each without a record gets an error
    record (unreported)."""
    from harness.views.report_dir import write_views
    from harness.views.summary import named_idle_text, print_console
    if selected is not None:   # fewer than the header's kernels x cases: pytest's -k and kin
        facts["pairs_selected"] = len(selected)
    rec.update_header(Path(report_dir) / rec.RECORDS_FILE, state=state,
                      **({"interrupted": True} if state == INTERRUPTED else {}), **facts)
    header, records = write_views(Path(report_dir))
    if state == FINISHED and selected and unreported(Path(report_dir), selected, records):
        header, records = write_views(Path(report_dir))
    if console:
        print_console(records, header)
        wall = header.get("wall_s")
        print(("" if wall is None else f"wall time {wall:.0f} s; ")
              + f"report: {report_dir}/ (report.jsonl, summary.md, report.html)")
    elif tallies.judged_nothing(records, header):
        print("harness: nothing was judged (no check measured anything): not a pass")
    elif idle := tallies.named_idle(records, header):
        print("harness: " + named_idle_text(idle))
    elif (not_run := sum(tallies.not_run(records).values())) + \
            (unprobed := sum(tallies.unprobed(records).values())):
        # pytest's terminal says passed for a pair whose leak check did not run: never silently
        print(f"\nharness: not every check ran: {not_run} not run, {unprobed} tensor x segment(s) "
              "the leak probe could not compare (unprobed); neither is a pass (summary.md "
              "lists them)")
    if not console and (deaths := tallies.unblamed(header)):   # pytest's tests all passed
        print("\nharness: " + tallies.unblamed_text(deaths))
    status = tallies.run_status(records, header)
    if options.baseline:
        from harness.views.compare import compare_files
        status |= compare_files(Path(report_dir) / rec.RECORDS_FILE, options.baseline,
                                growth=options.growth)
    return status


def merge(out: Path, sources: list[Path], rejudge: bool = False
          ) -> tuple[int, list, dict, list]:
    """`harness merge`: several reports (the shards of a suite) joined into one, optionally
    with every expectation recomputed from the kernels as registered now; the views written.
    Returns (status, overlaps, the joined header, its records)."""
    from harness.store.merge import merge_reports
    from harness.views.report_dir import write_views
    transform, kept = None, {}   # kernel -> why its records were kept as recorded
    if rejudge:
        from harness.engine.registry import all_kernels
        from harness.judge.rejudge import rejudge as rejudged
        kernels = all_kernels()

        def transform(records, head):
            # A kernel whose library is missing here keeps its records as recorded: its
            # expectations may read that library (te:flax_*'s sinks crash is declared from TE's
            # cuDNN version), and read without it they would turn a declared crash red.
            records = list(records)
            kept.update({name: why for name in sorted({r.kernel for r in records})
                         if name not in kept and (why := _not_here(kernels.get(name)))})
            return rejudged(records, {n: k for n, k in kernels.items() if n not in kept},
                            probed=head.get("leak_probe") is not False)
    from harness.store.merge import check_shards
    heads = [rec.read_header(s) for s in sources]
    check_shards(heads, [str(s) for s in sources])
    suites = {h.get("suite") for h in heads}
    if len(suites) > 1:
        names = ", ".join(map(str, sorted(suites, key=str)))
        print(f"note: merging reports of different suites ({names}): "
              "the merged report is no one suite's run, and compares pair for pair with neither",
              file=sys.stderr)
    overlaps = merge_reports(Path(out), [Path(s) for s in sources], transform, whole=True,
                             rejudged=rejudge, joined_by=v.MERGE_COMMAND)
    if kept:   # the report says it too, not only the console
        from harness.views.summary import kept_text
        print(f"note: --rejudge {kept_text(kept)}", file=sys.stderr)
        rec.update_header(Path(out) / rec.RECORDS_FILE, rejudge_kept=kept)
    header, records = write_views(Path(out))
    return tallies.run_status(records, header), overlaps, header, records


# A selected pair with no record in a finished run's report.
UNREPORTED = ("no record: the pair was selected and nothing of it reached the report (its "
              "worker ended without a word about it, or its records were lost); not a pass")


def declaration_raised(kernel, case, exc: UsageError):
    """The pair's result where a declaration of its kernel raised in pytest's test (the CLI
    stops the run: stopped_by): its one error record, naming the mistake (not a record lost
    on the way, and not judged by the declaration that raised)."""
    from harness.engine.runner import KernelCaseResult
    from harness.judge import judging
    return KernelCaseResult(records=[judging.status_record(kernel, case, v.ERROR, str(exc))])


def unreported(report_dir: Path, selected: list, records: list) -> bool:
    """Appends an error record (UNREPORTED) for each selected (kernel, case) pair without a
    record in the report: every pair that runs leaves one, a skip included, so a pair without
    any was lost on the way (a kernel's sys.exit(0) ending its worker, a group's reports left
    out of the join), and a run that lost one is never green. True where it appended some."""
    from harness.judge import judging
    have = {r.pair for r in records}
    lost = []
    for k, c in selected:
        if (k.name, c.id) not in have:
            try:
                lost.append(judging.error_record(k, c, UNREPORTED))
            except UsageError:   # its expect_error raised: an error all the same
                lost.append(judging.status_record(k, c, v.ERROR, UNREPORTED))
    if lost:
        rec.append(report_dir / rec.RECORDS_FILE, lost)
        rec.update_header(report_dir / rec.RECORDS_FILE)   # its count of records, these too
    return bool(lost)


def _not_here(kernel) -> str | None:
    """Why a kernel cannot be judged again here (not registered, or its libraries missing);
    None where it can."""
    if kernel is None:
        return "not registered here"
    missing = kernel.missing_requirements()
    return f"{', '.join(missing)} not installed here" if missing else None


def check_not_running(report_dir: Path) -> None:
    """A folder another run is writing now: a UsageError (its lock is held)."""
    FolderLock(report_dir).acquire().release()


__all__ = [
    "Selection",
    "UsageError",
    "check_not_running",
    "finish",
    "merge",
    "prepare",
    "run",
    "run_info",
    "select",
]
