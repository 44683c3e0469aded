"""The kernel x case matrix: every registered kernel on every case of the suite, per segment."""
import pytest

from harness.judge import tallies
from harness.judge import vocabulary as v
from harness.views.summary import describe_problem

pytestmark = pytest.mark.matrix


def test_kernel_on_case(kernel_case, run_case, record_sink, record_property):
    kernel, case = kernel_case
    result = run_case(kernel, case)
    record_sink(result)
    has_ratio, worst = tallies.worst_ratio(result.records)
    if has_ratio:
        record_property("worst_ratio", tallies.ratio_text(worst))
    measured = [r for r in result.records if r.measured]
    if measured:
        record_property("failing_segments", ",".join(sorted(
            {f"{r.check}:{r.where}" for r in measured if r.verdict == v.FAIL})))
        record_property("unjudged", tallies.counts(result.records).get(v.UNJUDGED, 0))
        record_property("not_run", tallies.counts(result.records).get(v.NOT_RUN, 0))
        record_property("unprobed", sum(tallies.unprobed(result.records).values()))
        padded = tallies.padding_rows(result.records).get(kernel.name)
        if padded:
            record_property("padding_rows_clean", f"{padded[0]}/{padded[1]}")
    bad = tallies.bad(result.records)
    if bad:
        # The numbers at the failure site: kernel, check, segment, tokens, error, tolerance,
        # ratio, worst token and case id, one line per problem.
        pytest.fail(f"{len(bad)} problem(s) of {kernel.name} on {case.id}:\n"
                    + "\n".join(describe_problem(r) for r in bad), pytrace=False)
    record_property("outcomes", ",".join(f"{k}:{n}" for k, n in
                                         tallies.counts(result.records).items()))
    if all(r.outcome == v.SKIP for r in result.records):
        pytest.skip(f"{kernel.name}: {result.records[0].message}")
    # A known upstream crash, reproduced, passes (its outcome is in the report), never a skip.
