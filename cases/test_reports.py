"""Reports: JSON Lines, Markdown and HTML views, baseline comparison, and pytest integration
(xdist parts merged even when a worker dies, JUnit properties, --baseline)."""
import gzip
import json
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import jax
import pytest

from harness.engine import device_shares
from harness.engine.environment import describe
from harness.kernels.kernel import Platform
from harness.engine.registry import select_kernels
from harness.engine.runner import run_matrix
from harness.judge.regression import compare
from harness.model.case import Case
from harness.store import report_file as rec
from harness.engine import engine
from harness.engine.options import RunOptions
from harness.store.writer import ReportWriter

ROOT = Path(__file__).resolve().parent.parent
CASE = Case("packed/random", 2, 256, 4, 2, 32, "bfloat16", 0)


def _report(tmp_path, kernels="dot_product,canary_ignores_segments"):
    writer = ReportWriter(tmp_path, describe(), suite="test", kernels=kernels.split(","), cases=1)
    run_matrix(select_kernels(kernels), [CASE], Platform("cpu"), on_result=lambda k, c, r: writer.add(r))
    return writer


def _finish(writer) -> int:
    """The run's end as the engine ends every run: header, views, status."""
    writer.close()
    return engine.finish(writer.dir, RunOptions(), console=False)


def test_views_show_the_canary_down_to_segment_and_token(tmp_path):
    status = _finish(_report(tmp_path))
    assert status == 0, "the canary is expected to fail: its catches keep the run green"
    header, records = rec.read(tmp_path / "report.jsonl")
    assert header["schema"] == rec.SCHEMA and header["environment"]["platform"] == "cpu"
    caught = [r for r in records if r.outcome == "caught" and r.check == "out"]
    first = min(caught, key=lambda r: (r.row, r.segment))
    md = (tmp_path / "summary.md").read_text()
    assert "canary_ignores_segments" in md and "🔵 caught" in md and first.segment_label in md
    assert f"| canary_ignores_segments | {first.segment_label} |" in md
    assert "## Not judged" in md
    html = (tmp_path / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 2, "heatmap and at least one token plot"
    assert f"canary_ignores_segments · out · row {first.row}" in html


def test_a_failing_kernel_is_listed_by_segment_in_markdown(tmp_path):
    from harness.kernels.kernel import Kernel
    from harness.kernels.reference import ignores_segments as causal_only

    writer = ReportWriter(tmp_path, describe(), suite="test")
    run_matrix([Kernel("leaky", causal_only)], [CASE], Platform("cpu"), on_result=lambda k, c, r: writer.add(r))
    assert _finish(writer) == 1
    md = (tmp_path / "summary.md").read_text()
    assert "## Problems" in md and "| leaky | out | r0s2 |" in md
    assert CASE.id in md


def _records(tmp_path):
    _finish(_report(tmp_path))
    return rec.read(tmp_path / "report.jsonl")[1]


def test_compare_passes_an_unchanged_run_and_flags_planted_regressions(tmp_path):
    base = _records(tmp_path)
    assert not compare(base, base).regressed

    flipped = [r.replace() for r in base]
    victim = next(r for r in flipped if r.kernel == "dot_product" and r.check == "dq")
    vars(victim).update(verdict="fail", outcome="fail", ratio=3.0, max_abs_err=victim.max_abs_err * 20)
    result = compare(flipped, base)
    assert result.regressed and len(result.flips) == 1
    assert any("ok -> fail" in line for line in result.regressions)

    grown = [r.replace() for r in base]
    target = max((r for r in grown if r.kernel == "dot_product"
                  and r.check in ("out", "dq", "dk", "dv")), key=lambda r: r.ratio)
    vars(target).update(max_abs_err=target.max_abs_err * 3, ratio=min(target.ratio * 3, 0.99))
    result = compare(grown, base, growth=2.0)
    assert result.regressed and len(result.grown) == 1 and not result.flips

    # A known upstream bug's errors are compared too: no licence to get worse.
    known_base = [r.replace() for r in base]
    bug = next(r for r in known_base if r.kernel == "dot_product" and r.check == "dk")
    vars(bug).update(expected="known", verdict="fail", outcome="known", ratio=2.0)
    known_new = [r.replace() for r in known_base]
    worse = next(r for r in known_new if r.key == bug.key)
    vars(worse).update(max_abs_err=bug.max_abs_err * 10, ratio=20.0)
    result = compare(known_new, known_base, growth=2.0)
    assert result.regressed and not result.flips and "error grew" in result.regressions[0]

    fewer = [r for r in base if r.kernel != "canary_ignores_segments"]
    result = compare(fewer, base)
    assert result.missing_cases == [("canary_ignores_segments", CASE.id)] and not result.regressed


def test_compare_cli_reads_gzip_baselines(tmp_path):
    _records(tmp_path)
    gz = tmp_path / "base.jsonl.gz"
    # An earlier run of the same records (its header another run's: compare refuses a copy).
    lines = (tmp_path / "report.jsonl").read_text().splitlines(keepends=True)
    header = json.loads(lines[0])
    header["earlier"] = True
    gz.write_bytes(gzip.compress((json.dumps(header) + "\n" + "".join(lines[1:])).encode()))
    out = subprocess.run([sys.executable, "-m", "harness", "compare", str(tmp_path / "report.jsonl"),
                          str(gz)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "no regression" in out.stdout


CRASHER = """
import os, harness
from harness.kernels.reference import dot_product
if "," not in os.environ.get("CUDA_VISIBLE_DEVICES", ","):  # a worker: the GPU it was given
    with open(os.environ["GPU_LOG"], "a") as f:
        f.write(os.environ["PYTEST_XDIST_WORKER"] + " " + os.environ["CUDA_VISIBLE_DEVICES"] + "\\n")
def crash_on_many(q, k, v, seg, *, causal, scale):
    if q.shape[1] == 256 and seg.shape[0] == 4 and os.environ.get("CRASH_NOW") == "1":
        try:  # once per session: two workers dying together trip a race inside xdist itself
            os.close(os.open(os.environ["CRASH_MARK"], os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            pass
        else:
            # The worker process dies mid-run (a signal: os._exit in a kernel's traced code is
            # the kernel's error in the run's own processes, harness.errors.kernel_code).
            os.kill(os.getpid(), 9)
    return dot_product(q, k, v, seg, causal=causal, scale=scale)
harness.register_kernel("crasher", crash_on_many, dtypes=("bfloat16",))
"""


def _pytest(*args, env=None, cwd=ROOT):
    import os
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider",
                           str(ROOT / "cases" / "test_matrix.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def test_xdist_parts_survive_a_crashed_worker_and_junit_has_properties(tmp_path):
    """Also: --gpu-per-worker hands out the GPUs of CUDA_VISIBLE_DEVICES, one per worker, and
    the worker that replaces a crashed one (a new id, gw2) takes the crashed one's GPU, not a
    GPU numbered after its id."""
    module = tmp_path / "crasher.py"
    module.write_text(CRASHER)
    junit = tmp_path / "junit.xml"
    gpu_log = tmp_path / "gpus.txt"
    out = _pytest("-n", "2", "--gpu-per-worker", "--in-test", "--kernel-module", str(module),
                  "--kernels", "crasher,dot_product",
                  "--cases", "packed/random-*-bf16-*,unpacked/full-*-bf16-*", "--no-leak-probe",
                  "--report-dir", str(tmp_path / "r"), f"--junitxml={junit}",
                  env={"CRASH_NOW": "1", "GPU_LOG": str(gpu_log), "CUDA_VISIBLE_DEVICES": "5,7",
                       "CRASH_MARK": str(tmp_path / "crashed")})
    assert out.returncode != 0
    assert "replacing crashed worker" in out.stdout, out.stdout[-2000:]
    gpus = dict(line.split() for line in gpu_log.read_text().splitlines())
    assert {gpus["gw0"], gpus["gw1"]} == {"5", "7"} and "gw2" in gpus, gpus
    crashed = out.stdout.split("replacing crashed worker ")[1].split()[0]
    assert gpus["gw2"] == gpus[crashed], (gpus, crashed)
    _, records = rec.read(tmp_path / "r" / "report.jsonl")
    ran = {(r.kernel, r.case_id) for r in records}
    assert ("dot_product", "packed/random-b4-t256-h4kv2-d64-bf16-s0") in ran
    assert ("dot_product", "unpacked/full-b4-t256-h4kv2-d64-bf16-s0") in ran
    props = {p.get("name") for p in ET.parse(junit).iter("property")}
    assert {"worst_ratio", "failing_segments"} <= props
    header, _ = rec.read(tmp_path / "r" / "report.jsonl")
    assert header["timing"]["dot_product"]["wall_s"] > 0, "pytest counts each kernel's wall time"


LANE_CRASHER = """
import os, harness
from harness.kernels.reference import dot_product
with open(os.environ["GPU_LOG"], "a") as f:   # each process that loads it: the GPUs it sees
    f.write(os.environ.get("PYTEST_XDIST_WORKER", "lane") + " "
            + os.environ.get("CUDA_VISIBLE_DEVICES", "-") + "\\n")
def crash_on_short_rows(q, k, v, seg, *, causal, scale):
    if q.shape[1] == 256:
        os._exit(3)  # the process running it dies
    return dot_product(q, k, v, seg, causal=causal, scale=scale)
harness.register_kernel("crasher", crash_on_short_rows, dtypes=("bfloat16",))
"""


def test_the_engine_blames_a_crash_on_its_own_test_and_runs_the_rest(tmp_path):
    """With --ahead (the default on GPUs) the pairs run in the engine's lanes, one per GPU with --gpu-per-worker
    (whole shapes to a lane); a pair that kills its worker is an error record, failing its own
    test and no other, and the lane goes on with a fresh worker."""
    module = tmp_path / "crasher.py"
    module.write_text(LANE_CRASHER)
    gpu_log = tmp_path / "gpus.txt"
    short, long_ = "packed/random-b4-t256-h4kv2-d64-bf16-s0", "packed/dozens-b2-t1024-h2kv1-d32-bf16-s0"
    out = _pytest("-n", "2", "--gpu-per-worker", "--ahead", "--kernel-module", str(module),
                  "--kernels", "crasher,dot_product", "--cases", f"{short},{long_}",
                  "--no-leak-probe", "--report-dir", str(tmp_path / "r"), "-rf",
                  env={"GPU_LOG": str(gpu_log), "CUDA_VISIBLE_DEVICES": "5,7"})
    assert out.returncode == 1, out.stdout[-3000:]
    failed = [ln for ln in out.stdout.splitlines() if ln.startswith("FAILED")]
    assert len(failed) == 1 and f"crasher:{short}" in failed[0], out.stdout[-3000:]
    assert "replacing crashed worker" not in out.stdout    # no pytest worker died
    _, records = rec.read(tmp_path / "r" / "report.jsonl")
    crash = [r for r in records if r.pair == ("crasher", short)]
    assert [r.verdict for r in crash] == ["error"] and "died while running it" in crash[0].message
    assert "exited with status 3" in crash[0].message
    for pair in (("dot_product", short), ("dot_product", long_), ("crasher", long_)):
        mine = [r for r in records if r.pair == pair]
        assert mine and all(r.outcome == "ok" for r in mine if r.measured), pair
    # The lanes' workers (pytest's controller, which loads the module too, sees both GPUs).
    lanes = {line.split()[1] for line in gpu_log.read_text().splitlines()
             if line.startswith("lane") and "," not in line}
    assert lanes == {"5", "7"}, gpu_log.read_text()


def test_a_test_takes_its_pairs_records_once_across_the_workers_header_rewrite(tmp_path):
    """A lane worker's last act rewrites its report's header (a longer line, a new file moved
    over the old one): a test still reading takes each record once, a record written after its
    last read included, and the reader keeps none it has handed over."""
    import json as json_
    from harness.engine import workers as isolation
    from harness.engine.lanes import PLAN, LaneResults
    (tmp_path / PLAN).write_text(json_.dumps({"lanes": 1}))
    report = tmp_path / "lane-0" / "main-1" / "report"
    writer = ReportWriter(report, describe(), suite="test")
    first = [_record(c, "pass", "ok", ratio=0.1) for c in ("out", "dq")]
    second = [_record(c, "pass", "ok", ratio=0.2) for c in ("dk", "dv")]
    rec.append(report / rec.RECORDS_FILE, first)
    reader = LaneResults(tmp_path, poll_s=0.01)
    reader._planned(0.0)
    reader._scan()
    assert len(reader.records[("k", CASE.id)]) == 2
    rec.append(report / rec.RECORDS_FILE, second)    # not read before the rewrite
    writer.close(note="x" * 3000)    # the header grows by more than a record's line
    (report / isolation.FINISHED_FILE).write_text(
        json_.dumps({"kernel": "k", "case_id": CASE.id, "records": 4}) + "\n")
    result = reader.wait(type("Kernel", (), {"name": "k"}), CASE)
    assert [r.check for r in result.records] == ["out", "dq", "dk", "dv"]
    assert ("k", CASE.id) not in reader.records


def test_the_engine_runs_the_pairs_the_tests_select(tmp_path):
    """With the matrix named whole the lanes start before collection, with every pair; with -k
    they wait for the selection and run only its pairs (the report's header times each kernel
    the lanes ran)."""
    args = ("--ahead", "--kernels", "dot_product,xla", "--no-leak-probe",
            "--cases", "packed/random-b4-t256-h4kv2-d64-bf16-s0")
    whole = _pytest(*args, "--report-dir", str(tmp_path / "whole"))
    narrowed = _pytest(*args, "-k", "xla", "--report-dir", str(tmp_path / "k"))
    assert whole.returncode == 0 and narrowed.returncode == 0, narrowed.stdout[-2000:]

    def timed(name):
        header, records = rec.read(tmp_path / name / "report.jsonl")
        return {k for k in header["timing"] if k in ("dot_product", "xla")}, \
            {r.kernel for r in records}
    assert timed("whole") == ({"dot_product", "xla"}, {"dot_product", "xla"})
    assert timed("k") == ({"xla"}, {"xla"})
    # The lane's worker is timed as the CLI's are: the summary's "Worker processes" line, from
    # pytest's start to its pairs and from their end to the join of the tests' parts.
    header = rec.read_header(tmp_path / "whole")
    assert [m["worker"] for m in header["merged_from"] if "worker" in m] == ["lane-0/main-1"]
    line = next(ln for ln in (tmp_path / "whole" / "summary.md").read_text().splitlines()
                if ln.startswith("Worker processes:"))
    assert re.search(r"lane-0/main-1 [\d.]+ s starting, [\d.]+ s on its pairs", line), line
    assert "from the run's start to the first worker's pairs" in line and "untimed" not in line
    assert "pytest's tests taking their records" in line


def test_more_workers_than_gpus_is_a_usage_error(tmp_path):
    out = _pytest("-n", "3", "--gpu-per-worker", "--kernels", "dot_product",
                  "--report-dir", str(tmp_path / "r"), env={"CUDA_VISIBLE_DEVICES": "0,1"})
    assert out.returncode == 4, out.stdout[-2000:] + out.stderr[-2000:]
    assert ("--gpu-per-worker with -n 3: 2 GPU(s) visible (CUDA_VISIBLE_DEVICES='0,1'); use -n 2 "
            "or fewer") in out.stderr, out.stderr[-2000:]
    assert "Traceback" not in out.stderr


def test_pytest_baseline_flags_grown_errors(tmp_path):
    args = ("--kernels", "dot_product", "--cases", "packed/random-b4-t256-h4kv2-d64-bf16-s0",
            "--no-leak-probe")
    good = _pytest(*args, "--report-dir", str(tmp_path / "good"))
    assert good.returncode == 0, good.stdout[-2000:]
    header, records = rec.read(tmp_path / "good" / "report.jsonl")
    for r in records:  # a baseline in which the kernel was 10x more accurate
        if r.max_abs_err:
            r.max_abs_err /= 10
    base = tmp_path / "base.jsonl"
    rec.write_header(base, header["environment"], suite="smoke")
    rec.append(base, records)
    again = _pytest(*args, "--report-dir", str(tmp_path / "again"), "--baseline", str(base))
    assert again.returncode == 1 and "REGRESSION" in again.stdout, again.stdout[-2000:]
    same = _pytest(*args, "--report-dir", str(tmp_path / "same"), "--baseline",
                   str(tmp_path / "good" / "report.jsonl"))
    assert same.returncode == 0 and "no regression" in same.stdout


def test_merge_keeps_one_copy_of_a_kernel_case_run_in_two_shards(tmp_path):
    from harness.store.merge import merge_reports
    for shard in ("a", "b"):
        _finish(_report(tmp_path / shard, kernels="canary_ignores_segments"))
    merge_reports(tmp_path / "m", [tmp_path / "a", tmp_path / "b"])
    one = rec.read_traces(tmp_path / "a" / "traces.jsonl")
    assert one and len(rec.read_traces(tmp_path / "m" / "traces.jsonl")) == len(one)
    assert len(rec.read(tmp_path / "m" / "report.jsonl")[1]) == len(rec.read(tmp_path / "a" / "report.jsonl")[1])


# ----- bugs found reading the H200 report (each test failed before its fix) ---------------------

LEAKY = """
import harness, jax
def leaky(q, k, v, seg, *, causal, scale):
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True)
harness.register_kernel("leaky", leaky, dtypes=("float32",))
"""


def test_junit_worst_ratio_is_finite_for_a_failing_kernel(tmp_path):
    module = tmp_path / "leaky.py"
    module.write_text(LEAKY)
    junit = tmp_path / "junit.xml"
    out = _pytest("--kernel-module", str(module), "--kernels", "leaky",
                  "--cases", "packed/random-*-f32-s0", "--report-dir", str(tmp_path / "r"),
                  f"--junitxml={junit}")
    assert out.returncode == 1, out.stdout[-2000:]
    assert "PytestWarning" not in out.stdout, "record_property works with the junit family"
    props = {p.get("name"): p.get("value") for p in ET.parse(junit).iter("property")}
    ratio = float(props["worst_ratio"])
    assert 1.0 < ratio < float("inf"), props
    assert "leak:r0s2" in props["failing_segments"] and "out:r0s2" in props["failing_segments"]
    assert props["unjudged"] == "0" and props["unprobed"] == "0"


def _record(check, verdict, outcome, ratio=None, expected="pass", segment=1, **extra):
    from harness.judge.record import Record
    return Record.from_json({"kernel": "k", "case_id": CASE.id, "layout": CASE.layout, "check": check,
            "row": 0, "segment": segment, "segment_label": f"r0s{segment}", "start": 0,
            "length": 4, "max_abs_err": 0.5, "worst_token": 0, "tolerance": 0.0 if check == "leak"
            else 1.0, "ratio": ratio, "verdict": verdict, "expected": expected,
            "outcome": outcome, **extra})


def test_a_cell_failing_only_the_leak_check_is_red():
    from harness.judge.tallies import grid
    records = [_record(c, "pass", "ok", ratio=0.05) for c in ("out", "dq", "dk", "dv")]
    records.append(_record("leak", "fail", "fail"))
    cell = grid(records)[2][("k", CASE.layout)]
    assert cell.status == "FAIL" and cell.heat >= 1.0, "as red as a ratio of 10"
    passing = grid(records[:-1] + [_record("leak", "pass", "ok")])[2][("k", CASE.layout)]
    assert passing.status == "ok" and passing.heat < 0


def test_largest_caught_line_names_a_tolerance_check_with_its_ratio():
    from harness.views.markdown import render
    records = [_record("leak", "fail", "caught", expected="fail"),
               _record("out", "fail", "caught", ratio=31.5, expected="fail"),
               _record("dq", "fail", "caught", ratio=2.5, expected="fail")]
    md = render({"suite": "t", "environment": {}}, records)
    largest = next(line for line in md.splitlines() if line.startswith("- largest"))
    assert "out r0s1" in largest and "ratio 31.5" in largest and "nan" not in largest
    only_leak = render({"suite": "t", "environment": {}}, records[:1])
    largest = next(line for line in only_leak.splitlines() if line.startswith("- largest"))
    assert "leak r0s1" in largest and "max change 0.5" in largest and "ratio" not in largest


def test_summary_lists_every_caught_segment_it_says_it_lists():
    from harness.views.markdown import render
    records = [_record(c, "fail", "caught", ratio=5.0, expected="fail", segment=n)
               for n in range(1, 401) for c in ("out", "leak")]
    md = render({"suite": "t", "environment": {}}, records)
    assert "every caught segment (400)" in md
    rows = [line for line in md.splitlines() if line.startswith("| k | r0s")]
    assert len(rows) == 400 and "| out, leak | 5 |" in rows[-1]


def test_the_commit_a_runner_is_told_wins_over_a_stale_git(monkeypatch):
    from harness.engine.environment import git_state
    monkeypatch.setenv("HARNESS_GIT_COMMIT", "feedbeef")
    monkeypatch.setenv("HARNESS_GIT_DIRTY", "0")
    assert git_state() == ("feedbeef", False), "this checkout's .git must not override it"


def test_header_names_the_commit_on_a_copy_without_git(tmp_path):
    import shutil
    copy = tmp_path / "tree"
    shutil.copytree(ROOT / "harness", copy / "harness")
    base = {k: v for k, v in __import__("os").environ.items() if not k.startswith("HARNESS_GIT")}
    ask = [sys.executable, "-c", "from harness.engine.environment import git_state; print(git_state())"]
    unknown = subprocess.run(ask, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                             env={**base, "PYTHONPATH": str(copy)})
    assert unknown.stdout.strip() == "(None, None)", unknown.stderr
    told = subprocess.run(ask, cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**base, "PYTHONPATH": str(copy), "HARNESS_GIT_COMMIT": "abc123",
                               "HARNESS_GIT_DIRTY": "0"})
    assert told.stdout.strip() == "('abc123', False)", told.stderr


def test_merged_header_keeps_versions_each_source_knew(tmp_path):
    from harness.store.merge import merge_reports
    for name, maxtext in (("a", None), ("b", "0.2.5")):
        env = {**describe(), "maxtext": maxtext}
        writer = ReportWriter(tmp_path / name, env, suite="nightly")
        run_matrix(select_kernels("dot_product"), [CASE], Platform("cpu"),
                   on_result=lambda k, c, r: writer.add(r))
    merge_reports(tmp_path / "m", [tmp_path / "a", tmp_path / "b"])
    header, _ = rec.read(tmp_path / "m")
    assert header["environment"]["maxtext"] == "0.2.5"
    assert header["suite"] == "nightly"


def test_compare_flags_outcomes_gone_bad_and_checks_gone_missing(tmp_path):
    """Turning the leak probe off leaves the canary's checks to nothing: their verdicts are the
    same, their outcomes went bad, and the leak records are gone. Both are regressions."""
    base = _records(tmp_path)
    left = [r.replace() for r in base if r.check != "leak"]
    for r in left:
        if r.outcome == "unjudged":
            r.outcome = "missed"
    result = compare(left, base)
    assert not result.flips and result.regressed
    assert any("unjudged -> missed" in line for line in result.regressions)
    assert any("checks ran in the baseline and not now (leak)" in line
               for line in result.regressions)


def test_a_known_numerical_bug_is_reported_as_known_in_every_view_never_as_ok(tmp_path):
    """("known", reason): a named upstream bug that fails on some data only. Where it fails the
    record is `known` (the run stays green) and every view lists it with its reason; where it
    passes, ok; on a check the expectation does not name, a failure is still a FAIL."""
    import jax.numpy as jnp

    from harness.kernels.kernel import Kernel
    from harness.judge import judging
    from harness.kernels.reference import dot_product

    def scaled_dq(q, k, v, seg, *, causal, scale):  # dq 10% off on row 1, output right
        out = dot_product(q, k, v, seg, causal=causal, scale=scale)
        row1 = (jnp.arange(q.shape[0]) == 1)[:, None, None, None]
        return out + jnp.where(row1, 0.1, 0.0).astype(out.dtype) * (out - jax.lax.stop_gradient(out))

    reason = "known upstream bug: dq scaled on row 1"
    kernel = Kernel("scaled_dq", scaled_dq,
                    expect=lambda case, check, seg: ("known", reason) if check in ("dq", "dk", "dv") else "pass")
    writer = ReportWriter(tmp_path, describe(), suite="test")
    run_matrix([kernel], [CASE], Platform("cpu"), on_result=lambda k, c, r: writer.add(r),
               leak=False)
    assert _finish(writer) == 0
    _, records = rec.read(tmp_path / "report.jsonl")
    known = [r for r in records if r.outcome == "known"]
    assert known and {r.row for r in known} == {1} and all(r.message == reason for r in known)
    assert {r.outcome for r in records if r.row == 0} == {"ok"}
    line = f"scaled_dq dq: {sum(r.check == 'dq' for r in known)} segments fail as known ({reason})"
    assert line in (tmp_path / "summary.md").read_text()
    assert "## Known upstream bugs" in (tmp_path / "summary.md").read_text()
    assert line in (tmp_path / "report.html").read_text()
    # The declaration names row 0 too, where dq passes: said, so an over-broad one shows.
    passed = sum(r.check == "dq" and r.expected == "known" and r.outcome == "ok" for r in records)
    wide = f"scaled_dq dq: {passed} segments declared known, passed ({reason})"
    assert passed and wide in (tmp_path / "summary.md").read_text()
    assert wide in (tmp_path / "report.html").read_text()
    assert judging.outcome("fail", "known") == "known" and judging.outcome("pass", "known") == "ok"
    from harness.judge.tallies import grid
    cell = grid(records)[2][("scaled_dq", CASE.layout)]
    assert cell.status == "known" and cell.segments and cell.heat is not None, "a coloured cell"
    with pytest.raises(ValueError, match="needs its reason"):
        judging.expectation("known", "dq")
    with pytest.raises(ValueError, match="exact"):
        judging.expectation(("known", reason), "leak")
    # One check over the heads: no segment the leak probe could judge, so never left to it.
    with pytest.raises(ValueError, match="dsinks check is left to nothing"):
        judging.expectation("either", "dsinks")


def test_the_engine_runs_a_lanes_isolation_groups_at_once(tmp_path, monkeypatch):
    """A lane runs its isolation groups' workers at once, as the CLI does (isolation.shares):
    the FlashAttention groups no longer wait for the main group's worker."""
    from test_isolation import SLOW

    for name in device_shares.USER_MEMORY:     # pytest's xdist workers set a share for themselves
        monkeypatch.delenv(name, raising=False)
    module = tmp_path / "slow.py"
    module.write_text(SLOW)
    calls = tmp_path / "calls.txt"
    out = _pytest("--ahead", "--kernel-module", str(module), "--kernels", "slow_a,slow_b",
                  "--cases", "packed/random-b4-t256-h4kv4-d32-f32-s0", "--no-leak-probe",
                  "--report-dir", str(tmp_path / "r"), env={"SLOW_LOG": str(calls)})
    assert out.returncode == 0, out.stdout[-3000:]
    spans = {}
    for line in calls.read_text().splitlines():
        group, start, end = line.split()
        spans.setdefault(group, []).append((float(start), float(end)))
    assert set(spans) == {"a", "b"}, spans
    # Each group's kernel sleeps 3 s per call: one after another, they would never overlap.
    (a_start, a_end), (b_start, b_end) = spans["a"][0], spans["b"][0]
    assert a_start < b_end and b_start < a_end, spans


def test_a_report_with_no_record_renders_without_warnings(tmp_path):
    """An empty shard, or a run stopped before its first pair: the HTML renders (no empty
    heat map for matplotlib to warn about) and says nothing was judged."""
    import warnings

    from harness.views.html import write_html
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        write_html(tmp_path / "report.html", {"suite": "smoke", "environment": {}}, [], [])
    assert "Nothing was judged" in (tmp_path / "report.html").read_text()


def test_the_timing_table_leaves_out_rows_that_read_zero_and_says_how_many(tmp_path):
    """A kernel that skipped every case has nothing to time (its skips took milliseconds):
    its row would read 0 in every column. Left out, counted; a row with any value stays."""
    from harness.views.html import write_html
    from harness.views.markdown import timing_lines
    zero = {"lower_s": 0.0, "compile_s": 0.0, "execute_s": 0.0, "probe_execute_s": 0.0,
            "wait_s": 0.0, "wall_s": 0.006, "host_s": 0.006, "programs": 0, "runs": 0}
    header = {"timing": {"skipped_all": zero, "skipped_too": dict(zero, wall_s=0.0),
                         "traced_only": dict(zero, lower_s=1.2),
                         "ran": dict(zero, wall_s=3.0, runs=12, programs=2)}}
    table = [line for line in timing_lines(header) if line.startswith("| ")]
    assert [line.split(" | ")[0][2:] for line in table[1:]] == ["ran", "traced_only"]
    assert "2 more row(s) read 0 in every column: left out." in timing_lines(header)
    html = tmp_path / "report.html"
    write_html(html, header, [], [])
    assert html.read_text().count("<tr><td>") == 2 and "2 more row(s) read 0" in html.read_text()
    # Nothing but zeros: no table, the count alone.
    idle = {"timing": {"skipped_all": zero}}
    assert timing_lines(idle) == ["", "1 row(s) read 0 in every column: left out."]
    write_html(html, idle, [], [])
    assert "<th>kernel</th><th>wall s" not in html.read_text()
    assert "1 row(s) read 0 in every column" in html.read_text()


def test_report_renders_a_baseline_whose_known_records_keep_no_message(tmp_path):
    """A baseline keeps only regression.BASELINE_FIELDS, no messages: `harness report` on a
    folder holding one lists its known records under an empty reason instead of a traceback
    (the H200 baseline's 735 known records did that)."""
    from harness.judge.record import Record
    from harness.judge.regression import BASELINE_FIELDS
    known = Record(kernel="k", case_id=CASE.id, check="*", verdict="error", expected="error",
                   outcome="known", message="declared crash\nits traceback")
    ok = Record(kernel="k", case_id=CASE.id, check="out", verdict="pass", expected="pass",
                outcome="ok", row=0, segment=1)
    rec.write_report(tmp_path / "report.jsonl", {"platform": "cpu"}, [known, ok],
                     keep_fields=BASELINE_FIELDS, suite="smoke")
    out = subprocess.run([sys.executable, "-m", "harness", "report", str(tmp_path)],
                         capture_output=True, text=True, cwd=Path(__file__).parent.parent)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Traceback" not in out.stderr
    assert "known 1" in (tmp_path / "summary.md").read_text()


def test_a_cell_with_a_check_not_run_never_reads_ok_and_an_unprobed_tensor_judged_nothing():
    """A grid cell whose checks left to the leak probe did not run (--no-leak-probe) reads
    'not run', not a pass (it read 'near' or 'ok' over ratios nothing judged); and a check left
    to the probe on a tensor the probe could not compare (unprobed) says so, not 'leak probe on
    the same segments: ok'."""
    from harness.judge import judging, tallies
    from harness.judge.record import Record
    from harness.views.summary import not_judged_lines
    where = dict(kernel="k", case_id=CASE.id, layout=CASE.layout, row=0)
    ok = Record(check="out", verdict="pass", expected="pass", outcome="ok", segment=1,
                ratio=0.1, **where)
    left = [Record(check="dk", verdict="fail", expected="either", outcome="unjudged",
                   segment=s, ratio=24.0, message="left to the probe", **where) for s in (1, 2)]
    not_run = judging.cover_unjudged([ok, *left], probed=False)
    assert tallies.cell(not_run).status == "not run"
    assert tallies.cell(judging.cover_unjudged([ok])).status == "ok"
    leak = [Record(check="leak", verdict="pass", expected="pass", outcome="ok", segment=s,
                   probed=["out", "dq", "dv"], unprobed=["dk"] if s == 2 else [], **where)
            for s in (1, 2)]
    judged = judging.cover_unjudged([ok, *left, *leak])
    assert [r.judged_by for r in judged if r.check == "dk"] == [
        "leak:ok", "leak:dk not compared (unprobed)"]
    lines = not_judged_lines(judged)
    assert "k dk: 1 not judged (left to the probe; leak probe on the same segments: ok)" in lines
    assert ("k dk: 1 not judged (left to the probe; leak probe on the same segments: dk not "
            "compared (unprobed))") in lines


def test_a_cell_with_a_segment_the_leak_probe_could_not_compare_never_reads_ok():
    """A leak record the probe compared nothing for (unprobed: its segment non-finite, nothing
    left untouched, no tensor reproducible) and every other check passing: the cell read
    'ok N/N' (a docs audit found it); it reads 'not run', as with the probe off."""
    from harness.judge import judging, tallies
    from harness.judge.record import Record
    where = dict(kernel="k", case_id=CASE.id, layout=CASE.layout, row=0, segment=1)
    ok = Record(check="out", verdict="pass", expected="pass", outcome="ok", ratio=0.1, **where)
    unprobed = Record(check="leak", verdict="unprobed", expected="pass",
                      outcome=judging.outcome("unprobed", "pass"),
                      message="no tensor is reproducible run to run", **where)
    assert tallies.cell([ok, unprobed]).status == "not run"
    assert tallies.cell([ok]).status == "ok"


def test_the_worker_line_names_a_worker_that_died_untimed():
    """A worker killed partway writes no header, so no timing: the summary's worker line names
    it instead of leaving it out (the H200's cold nightly at 396cbf3 showed main-1 and main-3
    and said nothing of main-2, killed between them); the controller's crash records beside
    the workers' reports are no worker."""
    from harness.views.markdown import process_lines
    merged = [{"worker": "main-1", "path": "/w/main-1/report", "startup_s": 5.1, "wall_s": 238.6},
              {"path": "/w/main-2/report"},
              {"worker": "main-3", "path": "/w/main-3/report", "startup_s": 4.0, "wall_s": 41.8},
              {"path": "/w/crashes"}]
    line = process_lines({"merged_from": merged, "merge_s": 1.5})[1]
    assert "main-1 5.1 s starting, 238.6 s on its pairs" in line
    assert "untimed (died before writing a header): main-2;" in line, line
    assert "crashes" not in line
    alive = process_lines({"merged_from": [merged[0]], "merge_s": 1.5})[1]
    assert "untimed" not in alive


def test_the_worker_line_says_whose_run_stood_still_and_for_what():
    """The timing table sums each row over the workers that ran side by side (the H200's
    nightly at ef19cc9: 12.6 to 14.3 s waiting for inputs, summed over three workers); each
    worker's own waits say whose run stood still: a joined report keeps them from its sources'
    timing (source_entry: the total, and the rows of at least WAIT_KEPT_S, largest first), and
    the worker line names the total and the three largest. A source that is itself a joined
    report keeps none: its table is a sum, not one process's."""
    from harness.store.merge import source_entry
    from harness.views.markdown import process_lines
    def header(worker, waits, **more):
        timing = {row: {"wait_s": s, "wall_s": 1.0} for row, s in waits.items()}
        return {"environment": {}, "wall_s": 80.0, "worker": worker, "startup_s": 2.0,
                "timing": timing, **more}
    main = source_entry("/w/main-1/report", header("main-1", {
        "oracle": 3.2, "inputs (drawing ahead)": 0.4, "dot_product": 0.04, "te:thd": 1.1,
        "xla": 0.2}))
    assert main["waits"] == {"oracle": 3.2, "te:thd": 1.1, "inputs (drawing ahead)": 0.4,
                             "xla": 0.2}   # largest first; under WAIT_KEPT_S left out
    assert main["wait_s"] == 4.94            # ... but counted in the total
    fa = source_entry("/w/fa-1/report", header("flash_attn2-1", {"inputs (drawing ahead)": 9.5}))
    idle = source_entry("/w/fa3-1/report", header("flash_attn3-1", {}))
    old = {k: v for k, v in main.items() if k not in ("waits", "wait_s")}   # no timing then
    line = process_lines({"merged_from": [main, fa, idle, old], "merge_s": 1.0})[1]
    assert ("main-1 2.0 s starting, 80.0 s on its pairs, of which 4.9 s waiting [oracle 3.2 s, "
            "te:thd 1.1 s, inputs (drawing ahead) 0.4 s, ...];") in line, line
    assert ("flash_attn2-1 2.0 s starting, 80.0 s on its pairs, of which 9.5 s waiting "
            "[inputs (drawing ahead) 9.5 s];") in line, line
    assert "flash_attn3-1 2.0 s starting, 80.0 s on its pairs, of which 0.0 s waiting;" in line
    assert line.count("waiting") == 3, line     # the old header's worker says nothing of it
    joined = source_entry("/r/report", header(None, {"inputs (drawing ahead)": 13.0},
                                              merged_from=[main, fa]))
    assert "waits" not in joined and "wait_s" not in joined, joined


def test_problem_lines_of_records_without_a_segment_read_whole():
    """A failing dsinks record (one per case) read "dsinks None of ...: FAIL ... worst token
    None (segment )", and a contract one "contract  of" (an adversarial review's mutants)."""
    from harness.judge.record import Record
    from harness.views.summary import describe_problem, digest_lines
    dsinks = Record(kernel="k", case_id=CASE.id, check="dsinks", verdict="fail",
                    expected="pass", outcome="fail", max_abs_err=0.03, tolerance=0.001,
                    ratio=30.0)
    line = describe_problem(dsinks)
    assert line == f"k dsinks of {CASE.id}: FAIL max|err|=0.03 tol=0.001 ratio=30", line
    contract = Record(kernel="k", case_id=CASE.id, check="contract", verdict="fail",
                      expected="pass", outcome="fail", message="output dtype float32")
    assert describe_problem(contract) == f"k contract of {CASE.id}: FAIL: output dtype float32"
    assert digest_lines([contract]) == [f"k contract: 1 record fail; first on {CASE.id}"]


def test_a_cell_whose_per_case_checks_failed_names_them_beside_its_passing_segments():
    """A cold review read 'FAIL 13/13' where only the padding check (or dsinks) failed, every
    segment passing: the cell names the per-case checks that failed."""
    from harness.judge import tallies
    from harness.judge.record import Record
    where = dict(kernel="k", case_id=CASE.id, layout=CASE.layout, row=0)
    ok = [Record(check="out", verdict="pass", expected="pass", outcome="ok", segment=s,
                 ratio=0.1, **where) for s in (1, 2)]
    padding = Record(check="padding", verdict="fail", expected="pass", outcome="fail",
                     message="out non-finite at padding", **where)
    dsinks = Record(check="dsinks", verdict="fail", expected="pass", outcome="fail", ratio=3.0,
                    **where)
    assert tallies.cell([*ok, padding, dsinks]).text == "FAIL 2/2 r=3; dsinks, padding failed"
    assert tallies.cell(ok).text == "ok 2/2 r=0.1"
    # Tensors the leak probe could not compare are named too: "ok 2/2" read as a pass of them.
    leak = [Record(check="leak", verdict="pass", expected="pass", outcome="ok", segment=s,
                   probed=["out", "dq"], unprobed=["dv", "dk"], **where) for s in (1, 2)]
    assert tallies.cell([*ok, *leak]).text == "ok 2/2 r=0.1; dk, dv unprobed"


def test_a_kernel_that_skipped_every_case_is_listed_with_every_reason_its_cases_gave():
    """One case skipped for the window, one for the soft cap: both named, commonest first (the
    list named the window alone, a cold review found)."""
    from harness.judge import tallies
    from harness.judge.record import Record

    def skip(why, case_id):
        return Record(kernel="k", case_id=case_id, layout=CASE.layout, check="*",
                      verdict="skip", expected="pass", outcome="skip", message=why)
    records = [skip("does not take window; causal only", "a"), skip("does not take softcap", "b"),
               skip("does not take window", "c")]
    assert tallies.skipped_everything(records) == {
        "k": "does not take window; causal only; does not take softcap"}


def test_no_problem_is_a_pass_only_where_every_check_ran():
    """summary.md said "every kernel expected to pass passed" under --no-leak-probe (a cold
    review): with checks not run, or tensors the probe could not compare, it says so."""
    from harness.judge.record import Record
    from harness.views.markdown import NONE_BAD, NONE_BAD_NOT_RUN, none_bad
    where = dict(kernel="k", case_id=CASE.id, layout=CASE.layout, row=0, segment=1)
    ok = Record(check="out", verdict="pass", expected="pass", outcome="ok", ratio=0.1, **where)
    not_run = Record(check="leak", verdict="not run", expected="pass", outcome="not run",
                     **where)
    unprobed = Record(check="leak", verdict="pass", expected="pass", outcome="ok",
                      probed=["out"], unprobed=["dk"], **where)
    assert none_bad([ok]) == NONE_BAD
    assert none_bad([ok, not_run]) == none_bad([ok, unprobed]) == NONE_BAD_NOT_RUN


def test_a_problem_table_says_what_a_check_without_a_tolerance_asks():
    """The problem tables' tolerance column read 'exact' for the padding check, whose output
    rule is 'finite' by default (or zero, or none, as the kernel declares), not exact: each check
    without a tolerance says its rule."""
    from harness.judge.record import Record
    from harness.views import html, markdown
    where = dict(kernel="k", case_id=CASE.id, layout=CASE.layout, row=0)
    padding = Record(check="padding", verdict="fail", expected="pass", outcome="fail",
                     message="out non-finite at padding", max_abs_err=1.0, **where)
    leak = Record(check="leak", verdict="fail", expected="pass", outcome="fail", segment=2,
                  max_abs_err=0.5, **where)
    table = markdown._problem_table([padding, leak])
    assert "exact" not in "\n".join(table)
    assert "| grads 0, out as declared |" in table[2] and "| bitwise |" in table[3]
    assert [row["tol"] for row in html._problem_rows([padding, leak])] == \
        ["grads 0, out as declared", "bitwise"]
