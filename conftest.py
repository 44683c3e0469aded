"""pytest options and the kernel x case matrix.

    pytest --suite smoke|nightly --kernels a,b --kernel-module my_kernels.py --cases 'packed/*'
           --report-dir DIR --baseline reports/baselines/h200.jsonl

Each xdist worker appends its records to DIR/parts/<worker>.jsonl as it goes; the controller
merges the parts into DIR/report.jsonl (plus summary.md and report.html) at the end, so a worker
that crashes loses only the test it was running.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest


def pytest_addoption(parser):
    group = parser.getgroup("attention harness")
    group.addoption("--suite", default="smoke", help="case suite: smoke (CPU) or nightly (GPU)")
    group.addoption("--kernels", default=None, help="comma-separated kernel names (default all)")
    group.addoption("--kernel-module", action="append", default=[], metavar="PATH",
                    help="Python file that registers kernels with harness.register_kernel")
    group.addoption("--cases", default=None, help="glob(s) over case ids, comma-separated")
    group.addoption("--report-dir", default="reports/pytest", help="where the report goes")
    group.addoption("--baseline", default=None, help="baseline report.jsonl to compare with")
    group.addoption("--growth", type=float, default=2.0,
                    help="error growth over the baseline that counts as a regression")
    group.addoption("--gpu-per-worker", action="store_true",
                    help="pin each xdist worker to its own GPU (CUDA_VISIBLE_DEVICES=worker index)")


def _is_worker(config) -> bool:
    return hasattr(config, "workerinput")


def _report_dir(config) -> Path:
    return Path(config.getoption("--report-dir")).resolve()


def pytest_configure(config):
    if _is_worker(config) and config.getoption("--gpu-per-worker"):
        # Before anything asks jax for a device: the CUDA backend reads this once, at start.
        index = int(config.workerinput["workerid"].removeprefix("gw"))
        os.environ["CUDA_VISIBLE_DEVICES"] = str(index)
    from harness.registry import load_kernel_module
    for path in config.getoption("--kernel-module"):
        load_kernel_module(path)
    if not _is_worker(config):
        parts = _report_dir(config) / "parts"
        parts.mkdir(parents=True, exist_ok=True)
        for old in parts.glob("*.jsonl"):
            old.unlink()


def _matrix(config):
    from harness.registry import select_kernels
    from harness.suites import suite_cases
    kernels = select_kernels(config.getoption("--kernels"))
    cases = suite_cases(config.getoption("--suite"), config.getoption("--cases"))
    # Case-major order: consecutive tests share the case's reference computation.
    return [(k, c) for c in cases for k in kernels]


def pytest_generate_tests(metafunc):
    if "kernel_case" in metafunc.fixturenames:
        pairs = _matrix(metafunc.config)
        metafunc.parametrize("kernel_case", pairs, ids=[f"{k.name}:{c.id}" for k, c in pairs])


@pytest.fixture(scope="session")
def platform():
    from harness.environment import current_platform
    return current_platform()


@pytest.fixture(scope="session")
def record_sink(request):
    """Appends records and traces to this process's part file."""
    from harness import records as rec
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    parts = _report_dir(request.config) / "parts"
    parts.mkdir(parents=True, exist_ok=True)

    def sink(result):
        rec.append(parts / f"{worker}.jsonl", result.records)
        rec.append(parts / f"{worker}.traces.jsonl", result.traces, kind="trace")
    return sink


def pytest_sessionfinish(session, exitstatus):
    config = session.config
    if _is_worker(config):
        return
    parts = _report_dir(config) / "parts"
    if not any(p.stat().st_size for p in parts.glob("*.jsonl")):
        return  # no matrix test ran
    from harness.reporting import merge_parts
    status = merge_parts(_report_dir(config), suite=config.getoption("--suite"),
                         baseline=config.getoption("--baseline"),
                         growth=config.getoption("--growth"))
    if status and session.exitstatus == 0:
        session.exitstatus = 1
