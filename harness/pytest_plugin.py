"""The harness's pytest plugin: the run's options as pytest options, and the kernel x case matrix.

    pytest --suite smoke|nightly --kernels a,b --kernel-module my_kernels.py --cases 'packed/*'
           --features window --seeds N --shard I/N --report-dir DIR --baseline PATH

pyproject.toml loads it with `-p harness.pytest_plugin`, so its options are known when pytest
parses the command line (`--report-dir /abs/path` works with or without test paths). The
options are the engine's own declarations (harness.engine.options), checked once; a mistake is
a usage error of one line before anything runs.

Where an NVIDIA GPU is visible (or with --ahead), the matrix's pairs run ahead of their tests in
the engine's worker lanes (harness.engine.lanes: worker processes compiling ahead on every core,
one lane per GPU with --gpu-per-worker), and each test waits for its pair's records and judges
them; elsewhere (or with --in-test) each pair runs inside its test. Each xdist worker appends its
records to DIR/parts/<run>/<worker>/ as it goes; the controller joins them and finishes the
report with the engine's one finish (views, status, baseline): a crashed worker loses only its
test; a pytest inside another never touches the outer run's parts."""
from __future__ import annotations

import contextlib
import functools
import os
import shutil
import time
import uuid
from pathlib import Path

import pytest

MATRIX_TEST = "test_kernel_on_case["


def pytest_addoption(parser):
    from harness.engine.options import add_pytest_options
    group = parser.getgroup("attention harness")
    add_pytest_options(group)
    group.addoption("--gpu-per-worker", action="store_true",
                    help="one GPU per xdist worker and per engine lane (-n = the number of GPUs)")
    group.addoption("--ahead", action="store_true",
                    help="the engine runs the selected pairs ahead of their tests (one lane per "
                         "GPU with --gpu-per-worker) and each test judges its pair's records "
                         "(the default where an NVIDIA GPU is visible)")
    group.addoption("--in-test", action="store_true",
                    help="run each kernel x case inside its test, compiling its programs then "
                         "(the default where no NVIDIA GPU is visible)")


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def _report_dir(config) -> Path:
    return Path(config._harness_options.report_dir).resolve()


def _parts(config) -> Path:
    run = config.workerinput["harness_run"] if _is_worker(config) else config._harness_run
    return _report_dir(config) / "parts" / run


def pytest_configure(config):
    from harness.engine import engine
    from harness.engine.environment import check_backend, nvidia_gpus
    from harness.engine.options import RunOptions
    from harness.errors import UsageError

    config.addinivalue_line("markers", "matrix: a kernel x case differential check")
    config.addinivalue_line("markers", "gpu: needs a GPU")
    # The matrix groups its tests by shape for xdist; known without xdist too (-p no:xdist).
    config.addinivalue_line("markers", "xdist_group(name): tests that share a shape's programs")
    if _is_worker(config):
        config._harness_ahead = config.workerinput.get("harness_ahead", False)
        count = int(config.workerinput.get("workercount", 1))
        from harness.engine.device_shares import MEM_FRACTION, user_set_memory
        if config._harness_ahead and not user_set_memory():
            # The engine's lanes hold the GPU (jax's default share); a worker takes device
            # memory only as it needs it (the harness's own tests, a pair no lane ran).
            os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        if config.getoption("--gpu-per-worker"):
            # Before anything asks jax for a device: the CUDA backend reads this once, at start.
            os.environ["CUDA_VISIBLE_DEVICES"] = str(config.workerinput["harness_gpu"])
        elif count > 1 and not user_set_memory() and not config._harness_ahead:
            # Workers sharing a GPU must not each take jax's default 75% of its memory.
            os.environ[MEM_FRACTION] = f"{min(0.75, 0.9 / count):.2f}"
    else:
        config._harness_run = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
        config._harness_gpus = {}  # xdist worker id -> its GPU (--gpu-per-worker)
        config._harness_start, config._harness_started_at = time.monotonic(), time.time()
        import datetime
        config._harness_started_utc = datetime.datetime.now(datetime.timezone.utc).isoformat(
            timespec="seconds")
    try:
        if config.getoption("--ahead") and config.getoption("--in-test"):
            raise UsageError("--ahead and --in-test: choose one")
        if getattr(config.option, "dist", None) == "each":   # a failing worker's pair read ok
            raise UsageError("--dist each runs every test on every worker, and the report holds "
                             "each kernel x case pair once: use --dist load (the default)")
        options = RunOptions.from_values(config.getoption, source="pytest")
        config._harness_options = options
        _settle_rootdir(config, options)
        if config.getoption("--gpu-per-worker") and not _is_worker(config):
            config._harness_gpu_ids = _gpu_per_worker_ids(config)
        if not _is_worker(config):
            config._harness_ahead = not config.getoption("--in-test") and (
                config.getoption("--ahead") or bool(nvidia_gpus()))
            engine.refuse_gpu_suite_on_cpu(options)   # the nightly suite on a CPU
        # Every process of the run (workers too, for the harness's own tests as well as the
        # matrix) loads the kernel modules and reads jax's persistent compilation cache. The
        # controller's prepare starts jax's backend where there is no GPU (on a GPU machine
        # its lanes do); a worker starts it here.
        if _is_worker(config):
            check_backend()
        selection = engine.prepare(options) if not _is_worker(config) else engine.select(options)
        if _is_worker(config):
            from harness.engine.compilation_cache import enable_compilation_cache
            enable_compilation_cache(options.cache_dir)
        config._harness_selection = selection
        # Case-major order: consecutive tests share the case's reference computation.
        config._harness_matrix = [(k, c) for c in selection.cases for k in selection.kernels]
    except UsageError as exc:
        raise pytest.UsageError(str(exc)) from None


def _settle_rootdir(config, options) -> None:
    """pytest settles its rootdir and configuration file before it knows this plugin's options:
    in `--report-dir DIR` (two words) DIR looks like a test path to it, and where DIR exists it
    becomes the rootdir, without pyproject.toml's settings. The controller refuses that in one
    line; its xdist workers (which settle theirs anew, after the controller made DIR) are told
    the controller's rootdir and configuration file."""
    from harness.errors import UsageError
    report_dir = Path(options.report_dir).resolve()
    if config.rootpath.resolve() == report_dir or (
            config.inipath is None and report_dir in {Path(a).resolve()
                                                      for a in config.invocation_params.args}):
        raise UsageError(f"--report-dir {options.report_dir}: pytest took this existing folder "
                         f"for a test path while it looked for its configuration; write "
                         f"--report-dir={options.report_dir}")
    inside = report_dir == config.rootpath.resolve() or config.rootpath.resolve() in \
        report_dir.parents
    if not _is_worker(config) and not inside:
        pinned = f"--rootdir={config.rootpath}" + (
            f" -c {config.inipath}" if config.inipath is not None else "")
        os.environ["PYTEST_ADDOPTS"] = f"{os.environ.get('PYTEST_ADDOPTS', '')} {pinned}".strip()


@functools.lru_cache(maxsize=1)
def _gpu_per_worker_ids(config) -> list[str] | None:
    """The GPUs --gpu-per-worker hands out: CUDA_VISIBLE_DEVICES's list where it is set (so a
    runner's own selection holds), else nvidia-smi's; None where neither is there (no NVIDIA
    driver: nothing to check). More workers than GPUs is a usage error: a worker without a GPU
    would fall back to the CPU, where the GPU kernels skip."""
    from harness.engine.environment import nvidia_smi_gpus
    from harness.errors import UsageError
    if (visible := os.environ.get("CUDA_VISIBLE_DEVICES")) is not None:
        where = f"CUDA_VISIBLE_DEVICES={visible!r}"
        ids = [g.strip() for g in visible.split(",") if g.strip()]
    elif nvidia_smi_gpus() is not None:
        ids, where = [str(i) for i in range(nvidia_smi_gpus())], "nvidia-smi -L"
    else:
        return None
    workers = config.getoption("numprocesses", None)  # xdist's -n, "auto" already resolved
    if isinstance(workers, int) and workers > len(ids):
        raise UsageError(f"--gpu-per-worker with -n {workers}: {len(ids)} GPU(s) visible "
                         f"({where}); use -n {len(ids)} or fewer")
    return ids


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node):
    """xdist (controller): tells each worker the run its parts belong to and, with
    --gpu-per-worker, the GPU that is its own: the lowest one no live worker holds. A worker
    that replaces a crashed one has a new id (gw2, ...) but takes the GPU the crashed one
    freed."""
    config = node.config
    node.workerinput["harness_run"] = config._harness_run
    node.workerinput["harness_ahead"] = getattr(config, "_harness_ahead", False)
    if config.getoption("--gpu-per-worker"):
        held, ids = config._harness_gpus, config._harness_gpu_ids
        slot = min(set(range(len(held) + 1)) - set(held.values()))
        held[node.gateway.id] = slot
        node.workerinput["harness_gpu"] = ids[slot] if ids and slot < len(ids) else str(slot)


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error):
    """xdist (controller): a worker that is gone frees its GPU."""
    node.config._harness_gpus.pop(node.gateway.id, None)


def pytest_generate_tests(metafunc):
    if "kernel_case" in metafunc.fixturenames:
        pairs = metafunc.config._harness_matrix
        # One xdist group per shape: with `--dist loadgroup` a shape's tests (its oracle's
        # programs) run in one worker. Not the default: xdist 3.8 does not hand a crashed
        # worker's group on, so the run hangs where a kernel kills its process.
        metafunc.parametrize("kernel_case", [
            pytest.param((k, c), marks=pytest.mark.xdist_group(_shape_group(c)))
            for k, c in pairs],
            ids=[f"{k.name}:{c.id}" for k, c in pairs])


def _shape_group(case) -> str:
    return "shape-" + "-".join(str(x) for x in case.shape_key)


@pytest.fixture(scope="session")
def platform():
    from harness.engine.environment import current_platform
    return current_platform()


@pytest.fixture(scope="session")
def programs(request):
    """This process's compiled programs. Each test traces and compiles its own kernel's
    programs (see run_case): no program of another test is traced ahead."""
    from harness.engine.programs import Programs
    progs = Programs(deterministic_probe=request.config._harness_options.deterministic_probe)
    request.config._harness_programs = progs
    yield progs
    progs.close()


@pytest.fixture
def run_case(request):
    """Runs one kernel x case of the matrix: its records from the engine's lanes, or (with
    --in-test, or where no lane ran it) inside this test, its default and probe builds compiling
    side by side (other tests' programs left alone: a kernel that kills its process while
    traced takes only its test with it). A declaration of the kernel that raises (Kernel._call)
    is the pair's error."""
    from harness.engine import engine
    lanes = _lane_results(request.config)

    def run(kernel, case):
        engine.stop_if_asked()   # a SIGTERM whose exception Python lost: stop before this pair
        result = lanes.wait(kernel, case) if lanes is not None else None
        try:
            return result if result is not None else _run_in_test(request, kernel, case)
        except engine.UsageError as exc:
            return engine.declaration_raised(kernel, case, exc)
    return run


def moved_to(config, case) -> None:
    """A test about to run its pair in this process: where its case is not the last one run
    here, the last case's references and perturbations are let go of, as the engine's runner
    does at each case (a long row's are GiBs of device memory); the matrix's case-major order
    keeps a case's tests together, so each case's references are computed once."""
    if getattr(config, "_harness_last_case", case) != case:
        from harness.judge import leak_probe
        from harness.judge.oracle import forget_references
        leak_probe.perturbed.cache_clear()
        forget_references()
    config._harness_last_case = case


def _run_in_test(request, kernel, case):
    from harness.engine import workers
    from harness.engine.runner import run_kernel_case
    config = request.config
    platform, programs = request.getfixturevalue("platform"), request.getfixturevalue("programs")
    start = time.perf_counter()
    if workers.clashes_here(kernel):
        # Its library cannot share this process with one already loaded here (the same FFI
        # targets): the pair runs in a worker of its own.
        result = workers.run_pair_in_worker(kernel, case, config._harness_options,
                                            _parts(config) / "isolated" / uuid.uuid4().hex)
    else:
        moved_to(config, case)
        if not kernel.unsupported_reasons(case, platform):
            workers.mark_loaded(kernel)   # its library loads only where it runs
            programs.prefetch([(kernel, case)])
        result = run_kernel_case(kernel, case, platform, programs,
                                 leak=config._harness_options.leak_probe)
    programs.timing[kernel.name].wall_s += time.perf_counter() - start
    return result


# ----- the engine's lanes (harness.engine.lanes) ---------------------------------------------

def _lanes_dir(config) -> Path:
    return _parts(config) / "lanes"


def _lane_results(config):
    """This process's reader of the lanes' records; None where the pairs run in their tests."""
    if not getattr(config, "_harness_ahead", False):
        return None
    if getattr(config, "_harness_lane_results", None) is None:
        from harness.engine.lanes import LaneResults
        config._harness_lane_results = LaneResults(_lanes_dir(config))
    return config._harness_lane_results


def _selected_pairs(config, nodeids) -> list:
    by_id = {f"{k.name}:{c.id}": (k, c) for k, c in config._harness_matrix}
    # The parameter id sits between "test_kernel_on_case[" and the last "]" (xdist's loadgroup
    # appends "@<group>" after it).
    chosen = [by_id.get(n[n.index(MATRIX_TEST) + len(MATRIX_TEST):n.rindex("]")])
              for n in nodeids if MATRIX_TEST in n]
    return [p for p in chosen if p is not None]


def _whole_matrix_named(config) -> bool:
    """This run names cases/test_matrix.py whole, nothing narrowing it (-k, -m, --deselect,
    --lf, --sw): every pair is selected, and the lanes start before collection (seconds)."""
    o = config.option
    if o.keyword or o.markexpr or getattr(o, "deselect", None) or getattr(o, "lf", False) \
            or getattr(o, "stepwise", False) or getattr(o, "failedfirst", False):
        return False
    matrix = (Path(config.rootpath) / "cases" / "test_matrix.py").resolve()
    here = config.invocation_params.dir
    return any("::" not in a and (here / a).resolve() == matrix for a in config.args)


def _begin(config, pairs) -> None:
    """Controller, matrix tests selected: the report folder is this run's (locked), its header
    says running until the end's finish (a pytest killed hard leaves it incomplete)."""
    if getattr(config, "_harness_lock", None) is not None or not pairs \
            or config.option.collectonly:
        return
    from harness.engine import engine
    from harness.engine.environment import describe_host
    from harness.errors import UsageError
    from harness.store.writer import FolderLock, begin
    config._harness_pairs = list(pairs)   # each must leave a record (engine.unreported)
    try:
        config._harness_lock = FolderLock(_report_dir(config)).acquire()
    except UsageError as exc:
        pytest.exit(f"error: {exc}", returncode=pytest.ExitCode.USAGE_ERROR)
    begin(_report_dir(config), describe_host(),
          **engine.run_info(config._harness_options, config._harness_selection))
    with contextlib.suppress(ValueError):   # SIGTERM as the CLI takes it: interrupted
        engine.on_sigterm()


def _start_lanes(config, pairs) -> None:
    """Controller: the selected matrix tests' pairs to the engine (once)."""
    _begin(config, pairs)
    if getattr(config, "_harness_lanes", None) is not None \
            or not getattr(config, "_harness_ahead", False) \
            or config.option.collectonly or getattr(config, "_harness_matrix", None) is None:
        return
    from harness.engine.lanes import Lanes, no_lanes
    if not pairs:
        no_lanes(_lanes_dir(config))
        config._harness_lanes = False
        return
    gpus: list = [None]
    ids = getattr(config, "_harness_gpu_ids", None)
    if config.getoption("--gpu-per-worker") and ids:
        workers = config.getoption("numprocesses", None)
        gpus = ids[:workers] if isinstance(workers, int) and workers > 0 else ids
    config._harness_lanes = Lanes(_lanes_dir(config), config._harness_options, gpus)
    config._harness_lanes.start(pairs)


def pytest_sessionstart(session):
    """Controller: the whole matrix named and nothing narrowing it: the lanes start now."""
    config = session.config
    if not _is_worker(config) and getattr(config, "_harness_matrix", None) is not None \
            and _whole_matrix_named(config):
        _start_lanes(config, list(config._harness_matrix))


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """xdist (controller): the first worker's collection names the selected tests."""
    _start_lanes(node.config, _selected_pairs(node.config, ids))


def pytest_collection_finish(session):
    config = session.config
    if not _is_worker(config) and not config.pluginmanager.hasplugin("dsession"):
        pairs = _selected_pairs(config, [item.nodeid for item in session.items])
        _begin(config, pairs)
        _start_lanes(config, pairs)


def _matrix_asked(config) -> bool:
    """The command line names cases/test_matrix.py, a test of it, or a folder holding it."""
    matrix = (Path(config.rootpath) / "cases" / "test_matrix.py").resolve()
    paths = [(config.invocation_params.dir / a.split("::")[0]).resolve() for a in config.args]
    return any(p == matrix or p in matrix.parents for p in paths)


def _stop_lanes(config, finished: bool) -> tuple[list[dict], list[dict]]:
    """Controller: the lanes stopped (`finished`: pytest did not stop early, and they end on
    their own first); each lane worker's probe mode, timing and cache lookups, for the
    report's header, and its process facts (Lanes.finish)."""
    lanes = getattr(config, "_harness_lanes", None)
    if not lanes:
        return [], []
    runs, workers = lanes.finish(finished)
    config._harness_run_again = lanes.run_again()
    for why in lanes.errors():
        print(f"\nharness: an engine lane failed ({why}); its remaining pairs ran in their tests")
    return runs, workers


@pytest.fixture(scope="session")
def record_sink(request):
    """Appends records and traces to this process's part of the report."""
    from harness.store.writer import ReportWriter
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    writer = None

    def sink(result):
        nonlocal writer
        if writer is None:
            from harness.engine.environment import describe
            writer = ReportWriter(_parts(request.config) / worker, describe(),
                                  suite=request.config._harness_options.suite)
        writer.add(result)
    yield sink
    if writer is not None:
        from harness.engine.compilation_cache import cache_stats
        programs = getattr(request.config, "_harness_programs", None)
        writer.close(probe_mode=programs.probe_mode if programs else None,
                     timing=programs.report() if programs else {},
                     compilation_cache={"dir": request.config._harness_options.cache_dir,
                                        **cache_stats()})


@pytest.hookimpl(hookwrapper=True, tryfirst=True)
def pytest_sessionfinish(session, exitstatus):
    """The report joined before xdist waits for its workers to exit (each part was closed
    before its worker finished); on Ctrl-C after (still in a test)."""
    if not (stopped := exitstatus == pytest.ExitCode.INTERRUPTED):
        _session_finish(session, exitstatus)
    yield
    if stopped:
        _session_finish(session, exitstatus)


def _session_finish(session, exitstatus):
    config = session.config
    if getattr(config, "_harness_matrix", None) is None or _is_worker(config):
        return  # configuration failed (nothing ran), or a worker (its part is written)
    parts = _parts(config)
    # Stopped early (the user, -x / --maxfail): interrupted, and the lanes are not waited for.
    interrupted = exitstatus == pytest.ExitCode.INTERRUPTED or session.shouldstop is not False \
        or session.shouldfail is not False
    lanes = _stop_lanes(config, not interrupted and exitstatus in (pytest.ExitCode.OK,
                                                                   pytest.ExitCode.TESTS_FAILED))
    sources = sorted(p for p in parts.glob("*") if (p / "report.jsonl").exists())
    lock = getattr(config, "_harness_lock", None)
    try:
        if sources or lock is not None:   # no source: begun, but no matrix test ran
            _finish(config, session, interrupted, sources, *lanes)
        elif _matrix_asked(config):   # none of its tests selected: the folder is as it was
            config.pluginmanager.get_plugin("terminalreporter").write_line(
                f"harness: every matrix test deselected: {_report_dir(config)} not written")
    finally:
        shutil.rmtree(parts, ignore_errors=True)
        if lock is not None:   # holding the folder: parts/ too, unless a run killed left some
            with contextlib.suppress(OSError):
                parts.parent.rmdir()
            lock.release()


def _finish(config, session, interrupted, sources, lane_runs, lane_workers) -> None:
    from harness.engine import engine
    from harness.engine.environment import describe_host
    from harness.store import report_file as rec
    from harness.store.merge import merge_cache, merge_reports, merge_timing, probe_modes
    from harness.store.writer import FINISHED, INTERRUPTED
    options = config._harness_options
    # Headers alone: reading the parts' records (and the joined report's) took seconds of the
    # H200 nightly's pytest wall time; the merge copies lines (harness.store.merge).
    runs = [rec.read_header(s) for s in sources] + lane_runs
    modes = probe_modes(runs)
    report_dir = _report_dir(config)
    info = engine.run_info(options, config._harness_selection)
    joined, joined_at = time.monotonic(), time.time()
    if sources:
        merge_reports(report_dir, sources, **info)
    else:
        rec.write_header(report_dir / rec.RECORDS_FILE, describe_host(), **info)
    joined_header = rec.read_header(report_dir)
    # When the run started, as the CLI's header says (the parts' were made as they began).
    environment = dict(joined_header["environment"], time_utc=config._harness_started_utc)
    # Beside the tests' parts, the lane workers: when they began and ended (as the CLI's).
    processes = {"merged_from": joined_header.get("merged_from", []) + lane_workers,
                 "merge_s": round(time.monotonic() - joined, 1), "joined_at": joined_at,
                 "started_at": config._harness_started_at} if lane_workers else {}
    status = engine.finish(
        report_dir, options, state=INTERRUPTED if interrupted else FINISHED, console=False,
        selected=getattr(config, "_harness_pairs", None),
        wall_s=round(time.monotonic() - config._harness_start, 1),
        timing=merge_timing([r.get("timing") for r in runs]),
        # The lanes compiled (or read from the cache) what the tests' own processes did not.
        compilation_cache=merge_cache(runs),
        probe_mode=modes[0] if len(modes) == 1 else modes, environment=environment, **processes,
        # Pairs the lanes ran again after a broken capture (harness.engine.capture).
        **({"run_again": again} if (again := getattr(config, "_harness_run_again", [])) else {}))
    header, records = rec.read_lines(report_dir)   # how many, not parsed into records
    print(f"\nharness report: {report_dir}/ ({len(records)} records, wall time "
          f"{header.get('wall_s', 0):.0f} s)")
    if status and session.exitstatus == 0:
        session.exitstatus = 1
