"""What a failing feature case's records say the kernel did (harness.engine.diagnosis)."""
from harness.engine.runner import run_kernel_case
from harness.kernels.kernel import Kernel, Platform
from harness.model.case import Case
from harness.model.features import Features
from harness.views.summary import describe_problem


def test_a_kernel_counting_chunks_from_the_row_start_is_told_so():
    """A kernel whose chunks start at the row (another library's convention), judged by the
    harness's count from each segment's start: its failures name the convention (they read
    like any failure before)."""
    from harness.judge.oracle import dense_attention

    def row_chunks(query, key, value, segment_ids, *, causal, scale, chunk=None):
        return dense_attention(query, key, value, segment_ids, scale=scale, causal=causal,
                               truth=False, features=Features(chunk=chunk),
                               chunk_convention="row").astype(query.dtype)
    kernel = Kernel("cpu:row_chunks", row_chunks, devices=("cpu",), features=("chunk",))
    case = Case("packed/random", 2, 128, 4, 2, 32, "float32", 0, features=Features(chunk=32))
    records = run_kernel_case(kernel, case, Platform("cpu")).records
    failing = [r for r in records if r.check == "out" and r.outcome == "fail"]
    assert failing and all(r.diagnosis.startswith("matches chunks counted from the row's "
                                                   "start") for r in failing), failing[:1]
    declared = Kernel("cpu:row_chunks_declared", row_chunks, devices=("cpu",),
                      features=("chunk",), conventions={"chunk": "row"})
    records = run_kernel_case(declared, case, Platform("cpu")).records
    assert not [r for r in records if r.outcome not in ("ok", "skip")], \
        [(r.check, r.outcome) for r in records if r.outcome != "ok"][:3]


def test_a_kernel_dropping_two_features_is_told_both_were_dropped():
    """A kernel that takes a window and a soft cap and computes neither: dropping either alone
    does not match its results, dropping both does, and its failures say so."""
    from harness.judge.oracle import dense_attention

    def plain(query, key, value, segment_ids, *, causal, scale, window=None, softcap=None):
        return dense_attention(query, key, value, segment_ids, scale=scale, causal=causal,
                               truth=False).astype(query.dtype)
    kernel = Kernel("cpu:drops_both", plain, devices=("cpu",), features=("window", "softcap"))
    case = Case("packed/random", 2, 128, 4, 2, 32, "float32", 0,
                features=Features(window=(15, 0), softcap=2.0))
    failing = [r for r in run_kernel_case(kernel, case, Platform("cpu")).records
               if r.check == "out" and r.outcome == "fail"]
    assert failing and all(r.diagnosis == "matches the mask without the window and the soft "
                           "cap: each was dropped" for r in failing), failing[:1]


def test_a_window_one_token_off_is_told_so():
    """A kernel whose window reaches one key further back than asked (a bound written with <=
    for <), or one short: dropping the window does not match its results, the window one token
    wider (narrower) does, and its failures say which (it read like any failure before)."""
    from harness.judge.oracle import dense_attention

    def off_by(extra):
        def window_off(query, key, value, segment_ids, *, causal, scale, window=None):
            left, right = window
            return dense_attention(query, key, value, segment_ids, scale=scale, causal=causal,
                                   truth=False, features=Features(window=(left + extra, right))
                                   ).astype(query.dtype)
        return window_off
    case = Case("packed/random", 2, 128, 4, 2, 32, "float32", 0, features=Features(window=(15, 0)))
    for extra, said in ((1, "matches a window of 16 back: one token wider than the case's 15 "
                             "back (an off-by-one)"),
                        (-1, "matches a window of 14 back: one token narrower than the case's "
                             "15 back (an off-by-one)")):
        kernel = Kernel(f"cpu:window_off_{extra}", off_by(extra), devices=("cpu",),
                        features=("window",))
        failing = [r for r in run_kernel_case(kernel, case, Platform("cpu")).records
                   if r.outcome == "fail" and r.check in ("out", "dq", "dk", "dv")]
        assert failing and all(r.diagnosis == said and r.message.startswith(said)
                               for r in failing), failing[:1]
        # Each problem's line (a failing pytest test's text, the CLI's problem list) says it.
        assert all(describe_problem(r).endswith(f": {said}") for r in failing), \
            describe_problem(failing[0])
    # Bidirectional, one token wider each way (|i - j| <= w + 1): both sides at once.

    def both_wider(query, key, value, segment_ids, *, causal, scale, window=None):
        left, right = window
        return dense_attention(query, key, value, segment_ids, scale=scale, causal=causal,
                               truth=False, features=Features(window=(left + 1, right + 1))
                               ).astype(query.dtype)
    wide = Case("packed/random", 2, 128, 4, 2, 32, "float32", 0, causal=False,
                features=Features(window=(15, 15)))
    kernel = Kernel("cpu:window_both_wider", both_wider, devices=("cpu",), features=("window",))
    failing = [r for r in run_kernel_case(kernel, wide, Platform("cpu"), leak=False).records
               if r.outcome == "fail" and r.check in ("out", "dq", "dk", "dv")]
    said = ("matches a window of 16 back, 16 ahead: one token wider on each side than the "
            "case's 15 back, 15 ahead (an off-by-one)")
    assert failing and all(r.diagnosis == said for r in failing), failing[:1]


def test_a_sinks_gradient_cut_or_flipped_is_described():
    """dsinks failed with an empty message (a new user's trial): a kernel whose sinks' gradient
    is stopped reads 'zero on every head', one whose gradient has the wrong sign says so."""
    import jax
    from harness.judge.oracle import dense_attention

    def sinks_kernel(how):
        def attend(query, key, value, segment_ids, *, causal, scale, sinks=None):
            s = {"cut": jax.lax.stop_gradient(sinks), "flipped": 2 * jax.lax.stop_gradient(
                sinks) - sinks}[how]
            return dense_attention(query, key, value, segment_ids, s, scale=scale,
                                   causal=causal, truth=False,
                                   features=Features(sinks=True)).astype(query.dtype)
        return attend
    case = Case("packed/random", 2, 128, 4, 2, 32, "float32", 0, features=Features(sinks=True))
    for how, said in (("cut", "zero on every head: the gradient does not reach the sinks"),
                      ("flipped", "of the opposite sign on 4 of the 4 heads whose truth is not "
                                  "zero")):
        kernel = Kernel(f"cpu:sinks_{how}", sinks_kernel(how), devices=("cpu",),
                        features=("sinks",))
        records = run_kernel_case(kernel, case, Platform("cpu"), leak=False).records
        dsinks = [r for r in records if r.check == "dsinks"]
        assert [(r.outcome, r.diagnosis, r.message) for r in dsinks] == [("fail", said, said)]
        assert describe_problem(dsinks[0]).endswith(f": {said}")
        # The other checks pass: the forward (and dq, dk, dv) are right (the probe is off).
        assert all(r.outcome == "ok" for r in records if r.check not in ("dsinks", "leak")), \
            [(r.check, r.outcome) for r in records if r.outcome != "ok"][:3]


def test_a_window_one_token_off_is_tried_only_where_every_failing_segment_could_show_it():
    """A window of w back differs from w + 1 only at distance w + 1, which a segment of w + 1
    tokens lacks: where a shorter segment fails too (the nightly's segment-ids bug on its
    window cases), no reference is computed for the near windows."""
    from harness.engine.diagnosis import _near_windows
    causal = Case("packed/random", 2, 128, 4, 2, 32, "float32", 0,
                  features=Features(window=(15, 0)))
    assert _near_windows(causal, 17) == {"window16.0": (16, 0), "window14.0": (14, 0)}
    assert _near_windows(causal, 16) == {"window14.0": (14, 0)}
    assert _near_windows(causal, 15) == {}
    both = Case("packed/random", 2, 128, 4, 2, 32, "float32", 0, causal=False,
                features=Features(window=(15, 0)))
    assert list(_near_windows(both, 17)) == ["window16.0", "window14.0", "window15.1",
                                             "window16.1"]
    # Both sides at once (|i - j| <= w + 1 for a window of w each way): either side can show it.
    wide = Case("packed/random", 2, 128, 4, 2, 32, "float32", 0, causal=False,
                features=Features(window=(15, 15)))
    assert list(_near_windows(wide, 17)) == ["window16.15", "window14.15", "window15.16",
                                             "window15.14", "window16.16", "window14.14"]
