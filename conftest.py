"""pytest options and the kernel x case matrix.

    pytest --suite smoke|nightly --kernels a,b --kernel-module my_kernels.py --cases 'packed/*'
           --seeds N --shard I/N --report-dir DIR --baseline reports/baselines/h200.jsonl.gz

Where an NVIDIA GPU is visible (or with --ahead), the matrix's pairs run ahead of their tests in
the CLI's engine (harness.engine.ahead: worker processes compiling ahead on every core, one lane
per GPU with --gpu-per-worker), and each test waits for its pair's records and judges them;
elsewhere (or with --in-test) each pair runs inside its test, compiling its programs then.
Each xdist worker appends its records to DIR/parts/<run>/<worker>.jsonl as it goes; the
controller merges the parts of its own run into DIR/report.jsonl (plus summary.md and
report.html) at the end, so a worker that crashes loses only the test it was running, and a
pytest started inside another (the harness's own tests do) never touches the outer run's parts.
A user's mistake (an unknown kernel or suite, a glob that matches nothing,
a missing module or baseline) is a one-line usage error before anything runs.
"""
from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("attention harness")
    group.addoption("--suite", default="smoke", help="case suite: smoke (CPU) or nightly (GPU)")
    group.addoption("--kernels", default=None, help="comma-separated kernel names (default all)")
    group.addoption("--kernel-module", action="append", default=[], metavar="PATH",
                    help="Python file that registers kernels with harness.register_kernel")
    group.addoption("--cases", default=None, help="glob(s) over case ids, comma-separated")
    group.addoption("--seeds", type=int, default=1, help="run every case under N seeds")
    group.addoption("--shard", default=None, metavar="I/N", help="run shard I of N of the suite")
    group.addoption("--report-dir", default="reports/pytest", help="where the report goes")
    group.addoption("--baseline", default=None, help="baseline report (folder or file)")
    group.addoption("--growth", type=float, default=2.0,
                    help="error growth beyond a check's spread that counts as a regression "
                         "(above 1)")
    group.addoption("--gpu-per-worker", action="store_true",
                    help="one GPU per xdist worker and per engine lane (-n = the number of GPUs)")
    group.addoption("--ahead", action="store_true",
                    help="the CLI's engine runs the selected pairs ahead of their tests (one "
                         "lane per GPU with --gpu-per-worker) and each test judges its pair's "
                         "records (the default where an NVIDIA GPU is visible)")
    group.addoption("--in-test", action="store_true",
                    help="run each kernel x case inside its test, compiling its programs then "
                         "(the default where no NVIDIA GPU is visible)")
    group.addoption("--no-leak-probe", action="store_true", help="tolerance checks only")
    group.addoption("--no-deterministic-probe", action="store_true",
                    help="probe the kernels' default builds on GPUs too")
    group.addoption("--compilation-cache", default=None, metavar="DIR",
                    help="jax's persistent compilation cache (default: the CLI's)")
    group.addoption("--no-compilation-cache", action="store_true")


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def _report_dir(config) -> Path:
    return Path(config.getoption("--report-dir")).resolve()


def _parts(config) -> Path:
    run = config.workerinput["harness_run"] if _is_worker(config) else config._harness_run
    return _report_dir(config) / "parts" / run


def pytest_configure(config):
    from harness.errors import UsageError

    if _is_worker(config):
        config._harness_ahead = config.workerinput.get("harness_ahead", False)
        count = int(config.workerinput.get("workercount", 1))
        from harness.engine.isolation import MEM_FRACTION, user_set_memory
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
        config._harness_start = time.monotonic()
        config._harness_started_utc = _now_utc()
    try:
        if config.getoption("--ahead") and config.getoption("--in-test"):
            raise UsageError("--ahead and --in-test: choose one")
        if config.getoption("--gpu-per-worker") and not _is_worker(config):
            config._harness_gpu_ids = _gpu_per_worker_ids(config)
        if not _is_worker(config):
            config._harness_ahead = not config.getoption("--in-test") and (
                config.getoption("--ahead") or _nvidia_gpu_visible())
        from harness.views import report_file as rec
        from harness.engine.registry import load_kernel_module, mark_absl_flags_parsed
        mark_absl_flags_parsed()
        for path in config.getoption("--kernel-module"):
            load_kernel_module(path)
        if not _is_worker(config):
            if config.getoption("--baseline"):
                rec.read(config.getoption("--baseline"), what="baseline")
            if not config.getoption("--growth") > 1:
                raise UsageError(f"--growth {config.getoption('--growth')}: must be above 1 "
                                 "(a factor of growth)")
            if config.getoption("--seeds") < 1:
                raise UsageError(f"--seeds {config.getoption('--seeds')}: must be at least 1")
            rec.check_writable(_report_dir(config))
        # Every process of the run (workers too, for the harness's own tests as well as the
        # matrix) reads and writes jax's persistent compilation cache.
        if not config.getoption("--no-compilation-cache"):
            from harness.engine.programs import DEFAULT_CACHE_DIR, enable_compilation_cache
            enable_compilation_cache(config.getoption("--compilation-cache")
                                     or DEFAULT_CACHE_DIR)
        config._harness_matrix = _matrix(config)
    except UsageError as exc:
        raise pytest.UsageError(str(exc)) from None


@functools.lru_cache(maxsize=1)
def _nvidia_smi_gpus() -> int | None:
    """How many GPUs `nvidia-smi -L` lists; None without it (no NVIDIA driver) or where it
    fails."""
    if not shutil.which("nvidia-smi"):
        return None
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                 timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(line.startswith("GPU ") for line in listing.splitlines())


def _nvidia_gpu_visible() -> bool:
    """Whether nvidia-smi lists a GPU this process may use (CUDA_VISIBLE_DEVICES honoured)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return False
    return bool(_nvidia_smi_gpus())


def _now_utc() -> str:
    import datetime
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _gpu_per_worker_ids(config) -> list[str] | None:
    """The GPUs --gpu-per-worker hands out: CUDA_VISIBLE_DEVICES's list where it is set (so a
    runner's own selection holds), else nvidia-smi's; None where neither is there (no NVIDIA
    driver: nothing to check). More workers than GPUs is a usage error: a worker without a GPU
    would fall back to the CPU, where the GPU kernels skip."""
    from harness.errors import UsageError

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids, where = [g.strip() for g in visible.split(",") if g.strip()], \
            f"CUDA_VISIBLE_DEVICES={visible!r}"
    elif _nvidia_smi_gpus() is not None:
        ids, where = [str(i) for i in range(_nvidia_smi_gpus())], "nvidia-smi -L"
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


def _matrix(config):
    from harness.engine.registry import select_kernels
    from harness.model.suites import parse_shard, shard, suite_cases
    kernels = select_kernels(config.getoption("--kernels"))
    cases = suite_cases(config.getoption("--suite"), config.getoption("--cases"),
                        seeds=config.getoption("--seeds"))
    part = parse_shard(config.getoption("--shard"))
    if part:
        cases = shard(cases, *part)
    # Case-major order: consecutive tests share the case's reference computation.
    return [(k, c) for c in cases for k in kernels]


def pytest_generate_tests(metafunc):
    if "kernel_case" in metafunc.fixturenames:
        pairs = metafunc.config._harness_matrix
        # One xdist group per shape: with `--dist loadgroup` the tests that share a shape's
        # programs (its oracle, above all) run in one worker, which compiles them once (the
        # smoke matrix 1.4x the CLI's time instead of more). Not the default: xdist 3.8 does not
        # hand a crashed worker's group to its replacement, so the run hangs where a kernel
        # kills its process (cases/test_reports.py's crash test).
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
    from harness.engine.programs import DEFAULT_CACHE_DIR, Programs, enable_compilation_cache
    config = request.config
    if not config.getoption("--no-compilation-cache"):
        enable_compilation_cache(config.getoption("--compilation-cache") or DEFAULT_CACHE_DIR)
    progs = Programs(deterministic_probe=not config.getoption("--no-deterministic-probe"))
    config._harness_programs = progs
    yield progs
    progs.close()


@pytest.fixture
def run_case(request):
    """Runs one kernel x case of the matrix: its records from the engine's lanes, or (with
    --in-test, or where no lane ran it) inside this test, its default and probe builds compiling
    side by side; other tests' programs are left alone there: a kernel that kills its process
    while being traced must take only its own test with it."""
    config = request.config
    lanes = _lane_results(config)

    def run(kernel, case):
        result = lanes.wait(kernel, case) if lanes is not None else None
        return result if result is not None else _run_in_test(request, kernel, case)
    return run


def _run_in_test(request, kernel, case):
    from harness.engine import isolation
    from harness.engine.runner import run_kernel_case
    config = request.config
    platform, programs = request.getfixturevalue("platform"), request.getfixturevalue("programs")
    start = time.perf_counter()
    if isolation.clashes_here(kernel):
        # Its library cannot share this process with one already loaded here (the same FFI
        # targets): the pair runs in a worker of its own.
        result = isolation.run_pair_in_worker(kernel, case, _worker_options(config),
                                              _parts(config) / "isolated" / uuid.uuid4().hex)
    else:
        if not kernel.unsupported_reasons(case, platform):
            isolation.mark_loaded(kernel)   # its library loads only where it runs
            programs.prefetch([(kernel, case)])
        result = run_kernel_case(kernel, case, platform, programs,
                                 leak=not config.getoption("--no-leak-probe"))
    programs.timing[kernel.name].wall_s += time.perf_counter() - start
    return result


# ----- the engine's lanes (harness.engine.ahead) ---------------------------------------------

def _lanes_dir(config) -> Path:
    return _parts(config) / "lanes"


def _lane_results(config):
    """This process's reader of the lanes' records; None where the pairs run in their tests."""
    if not getattr(config, "_harness_ahead", False):
        return None
    if getattr(config, "_harness_lane_results", None) is None:
        from harness.engine.ahead import LaneResults
        config._harness_lane_results = LaneResults(_lanes_dir(config))
    return config._harness_lane_results


MATRIX_TEST = "test_kernel_on_case["


def _selected_pairs(config, nodeids) -> list:
    by_id = {f"{k.name}:{c.id}": (k, c) for k, c in config._harness_matrix}
    # The parameter id sits between "test_kernel_on_case[" and the last "]" (xdist's loadgroup
    # appends "@<group>" after it).
    chosen = [by_id.get(n[n.index(MATRIX_TEST) + len(MATRIX_TEST):n.rindex("]")])
              for n in nodeids if MATRIX_TEST in n]
    return [p for p in chosen if p is not None]


def _whole_matrix_named(config) -> bool:
    """Whether this run names cases/test_matrix.py as a whole and nothing narrows the tests it
    collects (-k, -m, --deselect, --lf, --sw): then every pair of the matrix is selected, and
    the lanes can start before collection (pytest's start, xdist's workers and their
    collection take seconds on a GPU runner, which the lanes' own start then overlaps)."""
    o = config.option
    if o.keyword or o.markexpr or getattr(o, "deselect", None) or getattr(o, "lf", False) \
            or getattr(o, "stepwise", False) or getattr(o, "failedfirst", False):
        return False
    matrix = (Path(__file__).parent / "cases" / "test_matrix.py").resolve()
    here = config.invocation_params.dir
    return any("::" not in a and (here / a).resolve() == matrix for a in config.args)


def _start_lanes(config, pairs) -> None:
    """Controller: the selected matrix tests' pairs to the engine (once)."""
    if getattr(config, "_harness_lanes", None) is not None \
            or not getattr(config, "_harness_ahead", False) \
            or config.option.collectonly or getattr(config, "_harness_matrix", None) is None:
        return
    from harness.engine.ahead import Lanes, no_lanes
    if not pairs:
        no_lanes(_lanes_dir(config))
        config._harness_lanes = False
        return
    gpus: list = [None]
    ids = getattr(config, "_harness_gpu_ids", None)
    if config.getoption("--gpu-per-worker") and ids:
        workers = config.getoption("numprocesses", None)
        gpus = ids[:workers] if isinstance(workers, int) and workers > 0 else ids
    config._harness_lanes = Lanes(_lanes_dir(config), _worker_options(config), gpus)
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
        _start_lanes(config, _selected_pairs(config, [item.nodeid for item in session.items]))


def _stop_lanes(config, parts: Path) -> None:
    """Controller: the lanes stopped (pytest may stop early); each lane worker's probe mode and
    timing beside the tests' parts, for the report's header."""
    lanes = getattr(config, "_harness_lanes", None)
    if not lanes:
        return
    lanes.stop()
    for why in lanes.errors():
        print(f"\nharness: an engine lane failed ({why}); its remaining pairs ran in their tests")
    from harness.views import report_file as rec
    for n, report in enumerate(lanes.report_dirs()):
        try:
            header, _ = rec.read(report)
        except Exception:  # a worker killed before its header was written
            continue
        (parts / f"lane-{n}.run.json").write_text(json.dumps(
            {"probe_mode": header.get("probe_mode", "default"),
             "timing": header.get("timing", {})}))


def _worker_options(config) -> list[str]:
    """The options a worker repeats, as the CLI's controller builds them."""
    import argparse

    from harness.engine.isolation import option_flags
    names = ("kernel_module", "no_leak_probe", "no_deterministic_probe", "no_compilation_cache",
             "compilation_cache")
    options = argparse.Namespace(**{n: config.getoption("--" + n.replace("_", "-"))
                                    for n in names})
    return ["--suite", config.getoption("--suite"), *option_flags(options)]


@pytest.fixture(scope="session")
def record_sink(request):
    """Appends records and traces to this process's part file."""
    from harness.views import report_file as rec
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    parts = _parts(request.config)
    parts.mkdir(parents=True, exist_ok=True)

    def sink(result):
        rec.append(parts / f"{worker}.jsonl", result.records)
        rec.append(parts / f"{worker}.traces.jsonl", result.traces, kind="trace")
    return sink


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if getattr(config, "_harness_matrix", None) is None:
        return  # configuration failed: nothing ran
    parts = _parts(config)
    programs = getattr(config, "_harness_programs", None)
    if programs is not None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        parts.mkdir(parents=True, exist_ok=True)
        (parts / f"{worker}.run.json").write_text(json.dumps(
            {"probe_mode": programs.probe_mode, "timing": programs.report()}))
    if _is_worker(config):
        return
    _stop_lanes(config, parts)
    if not any(p.stat().st_size for p in parts.glob("*.jsonl")):
        shutil.rmtree(parts, ignore_errors=True)
        return  # no matrix test ran
    from harness.views.report_dir import merge_parts
    interrupted = exitstatus == pytest.ExitCode.INTERRUPTED or session.shouldstop is not False
    status = merge_parts(
        _report_dir(config),
        header_info={"suite": config.getoption("--suite"), "seeds": config.getoption("--seeds"),
                     "shard": config.getoption("--shard"),
                     "kernels": sorted({k.name for k, _ in config._harness_matrix}),
                     "cases": len({c for _, c in config._harness_matrix}),
                     "leak_probe": not config.getoption("--no-leak-probe"),
                     "selection": {"suite": config.getoption("--suite"),
                                   "cases": config.getoption("--cases"),
                                   "seeds": config.getoption("--seeds"),
                                   "shard": config.getoption("--shard"),
                                   "kernels": config.getoption("--kernels")},
                     "started_utc": config._harness_started_utc,
                     **({"interrupted": True} if interrupted else {})},
        wall_s=time.monotonic() - config._harness_start, parts=parts,
        baseline=config.getoption("--baseline"), growth=config.getoption("--growth"))
    shutil.rmtree(parts, ignore_errors=True)
    if status and session.exitstatus == 0:
        session.exitstatus = 1
