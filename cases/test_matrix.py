"""The kernel x case matrix: every registered kernel on every case of the suite, per segment."""
import pytest

from harness.judge import judging
from harness.views.summary import describe_problem

pytestmark = pytest.mark.matrix


def test_kernel_on_case(kernel_case, run_case, record_sink, record_property):
    kernel, case = kernel_case
    result = run_case(kernel, case)
    record_sink(result)
    has_ratio, worst = judging.worst_ratio(result.records)
    if has_ratio:
        record_property("worst_ratio", judging.ratio_text(worst))
    measured = [r for r in result.records if judging.measured(r)]
    if measured:
        record_property("failing_segments", ",".join(sorted(
            {f"{r['check']}:{r['segment_label']}" for r in measured if r["verdict"] == "fail"})))
        record_property("unjudged", judging.counts(result.records).get("unjudged", 0))
        record_property("unprobed", sum(judging.unprobed(result.records).values()))
    bad = judging.bad(result.records)
    if bad:
        pytest.fail("\n".join(describe_problem(r) for r in bad), pytrace=False)
    record_property("outcomes", ",".join(f"{k}:{v}" for k, v in
                                         judging.counts(result.records).items()))
    if all(r["outcome"] == "skip" for r in result.records):
        pytest.skip(f"{kernel.name}: {result.records[0]['message']}")
    # A known upstream crash, reproduced, passes (its outcome is in the report), never a skip.
