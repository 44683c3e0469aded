"""The kernel x case matrix: every registered kernel on every case of the suite, per segment."""
import pytest

from harness.runner import run_kernel_case
from harness.summary import describe_problem, problems

pytestmark = pytest.mark.matrix


def test_kernel_on_case(kernel_case, platform, record_sink, record_property):
    kernel, case = kernel_case
    result = run_kernel_case(kernel, case, platform)
    record_sink(result)
    judged = [r for r in result.records if r["verdict"] in ("pass", "fail")]
    if judged:
        ratios = [r["ratio"] for r in judged]
        record_property("worst_ratio", "inf" if None in ratios else max(ratios))
        record_property("failing_segments", ",".join(sorted(
            {f"{r['check']}:{r['segment_label']}" for r in judged if r["verdict"] == "fail"})))
    bad = problems(result.records)
    if bad:
        pytest.fail("\n".join(describe_problem(r) for r in bad), pytrace=False)
    if not judged:
        pytest.skip(f"{kernel.name}: {result.records[0]['message']}")
