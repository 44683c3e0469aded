"""Reports: JSON Lines, Markdown and HTML views, baseline comparison, and pytest integration
(xdist parts merged even when a worker dies, JUnit properties, --baseline)."""
import gzip
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

from harness import records as rec
from harness.baseline import compare
from harness.cases import Case
from harness.environment import describe
from harness.kernel import Platform
from harness.registry import select_kernels
from harness.reporting import ReportWriter
from harness.runner import run_matrix

ROOT = Path(__file__).resolve().parent.parent
CASE = Case("packed/random", 2, 256, 4, 2, 32, "bfloat16", 0)


def _report(tmp_path, kernels="dot_product,canary_ignores_segments"):
    writer = ReportWriter(tmp_path, describe(), suite="test", kernels=kernels.split(","), cases=1)
    run_matrix(select_kernels(kernels), [CASE], Platform("cpu"), on_result=lambda k, c, r: writer.add(r))
    return writer


def test_views_show_the_canary_down_to_segment_and_token(tmp_path):
    status = _report(tmp_path).finish()
    assert status == 0, "the canary is expected to fail: its catches keep the run green"
    header, records = rec.read(tmp_path / "report.jsonl")
    assert header["schema"] == rec.SCHEMA and header["environment"]["platform"] == "cpu"
    caught = [r for r in records if r["outcome"] == "caught" and r["check"] == "out"]
    first = min(caught, key=lambda r: (r["row"], r["segment"]))
    md = (tmp_path / "summary.md").read_text()
    assert "canary_ignores_segments" in md and "🔵 caught" in md and first["segment_label"] in md
    assert f"| canary_ignores_segments | {first['segment_label']} |" in md
    assert "## Not judged" in md
    html = (tmp_path / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 2, "heatmap and at least one token plot"
    assert f"canary_ignores_segments · out · row {first['row']}" in html


def test_a_failing_kernel_is_listed_by_segment_in_markdown(tmp_path):
    from harness.kernel import Kernel
    from harness.kernels.reference import ignores_segments as causal_only

    writer = ReportWriter(tmp_path, describe(), suite="test")
    run_matrix([Kernel("leaky", causal_only)], [CASE], Platform("cpu"), on_result=lambda k, c, r: writer.add(r))
    assert writer.finish() == 1
    md = (tmp_path / "summary.md").read_text()
    assert "## Problems" in md and "| leaky | out | r0s2 |" in md
    assert CASE.id in md


def _records(tmp_path):
    _report(tmp_path).finish()
    return rec.read(tmp_path / "report.jsonl")[1]


def test_compare_passes_an_unchanged_run_and_flags_planted_regressions(tmp_path):
    base = _records(tmp_path)
    assert not compare(base, base).regressed

    flipped = [dict(r) for r in base]
    victim = next(r for r in flipped if r["kernel"] == "dot_product" and r["check"] == "dq")
    victim.update(verdict="fail", outcome="fail", ratio=3.0, max_abs_err=victim["max_abs_err"] * 20)
    result = compare(flipped, base)
    assert result.regressed and len(result.flips) == 1
    assert any("ok -> fail" in line for line in result.regressions)

    grown = [dict(r) for r in base]
    target = max((r for r in grown if r["kernel"] == "dot_product" and r["check"] != "leak"),
                 key=lambda r: r["ratio"])
    target.update(max_abs_err=target["max_abs_err"] * 3, ratio=min(target["ratio"] * 3, 0.99))
    result = compare(grown, base, growth=2.0)
    assert result.regressed and len(result.grown) == 1 and not result.flips

    fewer = [r for r in base if r["kernel"] != "canary_ignores_segments"]
    result = compare(fewer, base)
    assert result.missing_cases == [("canary_ignores_segments", CASE.id)] and not result.regressed


def test_compare_cli_reads_gzip_baselines(tmp_path):
    _records(tmp_path)
    gz = tmp_path / "base.jsonl.gz"
    gz.write_bytes(gzip.compress((tmp_path / "report.jsonl").read_bytes()))
    out = subprocess.run([sys.executable, "-m", "harness", "compare", str(tmp_path / "report.jsonl"),
                          str(gz)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "no regression" in out.stdout


CRASHER = """
import os, harness
from harness.kernels.reference import dot_product
def crash_on_many(q, k, v, seg, *, causal, scale):
    if q.shape[1] == 256 and seg.shape[0] == 4 and os.environ.get("CRASH_NOW") == "1":
        os._exit(3)  # the worker process dies mid-run
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
    module = tmp_path / "crasher.py"
    module.write_text(CRASHER)
    junit = tmp_path / "junit.xml"
    out = _pytest("-n", "2", "--kernel-module", str(module), "--kernels", "crasher,dot_product",
                  "--cases", "packed/random-*-bf16-*,unpacked/full-*-bf16-*",
                  "--report-dir", str(tmp_path / "r"), f"--junitxml={junit}",
                  env={"CRASH_NOW": "1"})
    assert out.returncode != 0
    assert "crashed" in out.stdout.lower() or "worker" in out.stdout.lower(), out.stdout[-2000:]
    _, records = rec.read(tmp_path / "r" / "report.jsonl")
    ran = {(r["kernel"], r["case_id"]) for r in records}
    assert ("dot_product", "packed/random-b4-t256-h4kv2-d64-bf16-s0") in ran
    assert ("dot_product", "unpacked/full-b4-t256-h4kv2-d64-bf16-s0") in ran
    props = {p.get("name") for p in ET.parse(junit).iter("property")}
    assert {"worst_ratio", "failing_segments"} <= props


def test_pytest_baseline_flags_grown_errors(tmp_path):
    args = ("--kernels", "dot_product", "--cases", "packed/random-*-bf16-*")
    good = _pytest(*args, "--report-dir", str(tmp_path / "good"))
    assert good.returncode == 0, good.stdout[-2000:]
    header, records = rec.read(tmp_path / "good" / "report.jsonl")
    for r in records:  # a baseline in which the kernel was 10x more accurate
        if r.get("max_abs_err"):
            r["max_abs_err"] /= 10
    base = tmp_path / "base.jsonl"
    rec.write_header(base, header["environment"], suite="smoke")
    rec.append(base, [{k: v for k, v in r.items() if k != "type"} for r in records])
    again = _pytest(*args, "--report-dir", str(tmp_path / "again"), "--baseline", str(base))
    assert again.returncode == 1 and "REGRESSION" in again.stdout, again.stdout[-2000:]
    same = _pytest(*args, "--report-dir", str(tmp_path / "same"), "--baseline",
                   str(tmp_path / "good" / "report.jsonl"))
    assert same.returncode == 0 and "no regression" in same.stdout


def test_merge_keeps_one_copy_of_a_kernel_case_run_in_two_shards(tmp_path):
    from harness.reporting import merge_reports
    for shard in ("a", "b"):
        _report(tmp_path / shard, kernels="canary_ignores_segments").finish()
    merge_reports(tmp_path / "m", [tmp_path / "a", tmp_path / "b"])
    one = rec.read_traces(tmp_path / "a" / "traces.jsonl")
    assert one and len(rec.read_traces(tmp_path / "m" / "traces.jsonl")) == len(one)
    assert len(rec.read(tmp_path / "m" / "report.jsonl")[1]) == len(rec.read(tmp_path / "a" / "report.jsonl")[1])
