"""What joining and comparing reports may never make green: a merge of shards without some, a
skip that would hide a measured failure, a report whose run did not finish; and what it may not
make red: pairs pytest did not select."""
import io
from pathlib import Path
from contextlib import redirect_stdout

import pytest

from harness.engine import engine
from harness.errors import UsageError
from harness.judge.record import Record
from harness.judge.tallies import run_status
from harness.store import report_file as rec
from harness.views.compare import compare_files

CASE_IDS = ("packed/random-b2-t128-h2kv2-d16-bf16-s0", "unaligned/odd-b2-t128-h2kv2-d16-bf16-s0")
SELECTION = {"suite": "t", "cases": "*", "seeds": None, "kernels": "k,j"}


def _record(kernel, case_id, outcome, check="out", ratio=0.1):
    verdict = {"ok": "pass", "fail": "fail", "skip": "skip"}[outcome]
    return Record.from_json({"kernel": kernel, "case_id": case_id, "layout": case_id.split("-")[0],
                             "check": check if outcome != "skip" else "*", "row": 0,
                             "segment": 1 if outcome != "skip" else None, "max_abs_err": 0.5,
                             "tolerance": 1.0, "ratio": ratio if outcome != "skip" else None,
                             "verdict": verdict, "expected": "pass", "outcome": outcome,
                             "message": "optional dependency 'te' is not installed"
                             if outcome == "skip" else ""})


def _write(folder, records, **header):
    if header.get("shard") and "pairs_selected" not in header:   # as a shard's run writes it
        header["pairs_selected"] = len({(r.kernel, r.case_id) for r in records})
    info = {"suite": "t", "kernels": ["k", "j"], "cases": len(CASE_IDS), "state": "finished",
            "selection": {**SELECTION, "shard": header.get("shard")}, **header}
    rec.write_report(folder / rec.RECORDS_FILE, {"platform": "cpu"}, records, **info)
    return folder


def _compare(new, base) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        status = compare_files(new, base)
    return status, out.getvalue()


def test_a_merge_of_shards_without_one_is_incomplete_not_green(tmp_path):
    parts = [_write(tmp_path / f"p{i}", [_record("k", CASE_IDS[0], "ok")], shard=f"{i}/3")
             for i in (1, 2)]
    status, _, header, records = engine.merge(tmp_path / "m", parts)
    assert header["shards_missing"] == ["3/3"] and header["selection"]["shard"] is None
    assert status == 1 and run_status(records, header) == 1
    md = (tmp_path / "m" / "summary.md").read_text()
    assert "INCOMPLETE: shard(s) 3/3 missing" in md and "None: every kernel" not in md
    # The missing shard brought in: complete, and green.
    last = _write(tmp_path / "p3", [_record("j", CASE_IDS[1], "ok")], shard="3/3")
    status, _, header, _ = engine.merge(tmp_path / "m2", [*parts, last])
    assert status == 0 and "shards_missing" not in header
    # One shard on its own is a merge of shards without the others too (a docs audit: the
    # fan-out's merge job, given one part of two, joined it green, and its compare with the
    # baseline of the whole listed the other's pairs as missing, exit 0).
    status, _, header, _ = engine.merge(tmp_path / "m3", parts[:1])
    assert status == 1 and header["shards_missing"] == ["2/3", "3/3"]
    assert header["selection"]["shard"] == "1/3"
    alone = _write(tmp_path / "q1", [_record("k", CASE_IDS[0], "ok")], shard="1/1")
    status, _, header, _ = engine.merge(tmp_path / "m4", [alone])
    assert status == 0 and "shards_missing" not in header


def test_a_later_skip_never_hides_a_measured_failure(tmp_path):
    measured = _write(tmp_path / "a", [_record("k", CASE_IDS[0], "fail", ratio=40.0),
                                       _record("k", CASE_IDS[1], "ok")])
    skipped = _write(tmp_path / "b", [_record("k", CASE_IDS[0], "skip"),
                                      _record("k", CASE_IDS[1], "fail", ratio=3.0)])
    status, overlaps, _, records = engine.merge(tmp_path / "m", [measured, skipped])
    assert status == 1
    assert {(r.case_id, r.outcome) for r in records} == {(CASE_IDS[0], "fail"),
                                                         (CASE_IDS[1], "fail")}
    assert overlaps == [(skipped, 1, 1)]   # one pair replaced (measured), one kept
    # A measured result still replaces an earlier one (a pair run again), and a skip replaces
    # a skip.
    status, overlaps, _, records = engine.merge(tmp_path / "m2", [skipped, measured])
    assert {(r.case_id, r.outcome) for r in records} == {(CASE_IDS[0], "fail"),
                                                         (CASE_IDS[1], "ok")}
    assert overlaps == [(measured, 2, 0)]


def test_compare_of_a_report_whose_run_did_not_finish_is_never_green(tmp_path):
    both = [_record(k, c, "ok") for k in ("k", "j") for c in CASE_IDS]
    base = _write(tmp_path / "base", both)
    # Killed after its first pair, and narrower than the baseline (one kernel): what it has
    # compares clean, and it is still not a pass.
    cut = _write(tmp_path / "cut", both[:1], kernels=["k"], state="running",
                 selection={**SELECTION, "kernels": "k", "shard": None})
    status, text = _compare(cut, base)
    assert status == 1 and "INCOMPLETE" in text and "never finished" in text, text
    assert "no regression among the pairs compared" in text
    finished = _write(tmp_path / "done", both[:2], kernels=["k"],
                      selection={**SELECTION, "kernels": "k", "shard": None})
    status, text = _compare(finished, base)
    assert status == 0 and "INCOMPLETE" not in text, text


def test_pairs_pytest_did_not_select_are_missing_not_regressions(tmp_path):
    both = [_record(k, c, "ok") for k in ("k", "j") for c in CASE_IDS]
    base = _write(tmp_path / "base", both)
    narrowed = _write(tmp_path / "k", both[:2], pairs_selected=2)
    status, text = _compare(narrowed, base)
    assert status == 0 and "narrowed by pytest" in text and "missing: 2" in text, text
    # Not narrowed, the same selection: the pairs it lacks are regressions.
    lacking = _write(tmp_path / "lacking", both[:2])
    status, text = _compare(lacking, base)
    assert status == 1 and "missing now (the same cases were selected)" in text, text


def test_a_shard_missing_beside_an_unsharded_rerun_is_still_missing(tmp_path):
    parts = [_write(tmp_path / f"p{i}", [_record("k", CASE_IDS[0], "ok")], shard=f"{i}/3")
             for i in (1, 2)]
    rerun = _write(tmp_path / "rerun", [_record("j", CASE_IDS[1], "ok")])
    status, _, header, _ = engine.merge(tmp_path / "m", [*parts, rerun])
    assert status == 1 and header["shards_missing"] == ["3/3"]


def test_a_narrowed_run_stays_narrowed_through_a_merge(tmp_path):
    both = [_record(k, c, "ok") for k in ("k", "j") for c in CASE_IDS]
    base = _write(tmp_path / "base", both)
    narrowed = _write(tmp_path / "k", both[:2], pairs_selected=2)
    engine.merge(tmp_path / "m", [narrowed])
    status, text = _compare(tmp_path / "m", base)
    assert status == 0 and "narrowed by pytest" in text, text


def test_merge_refuses_shards_of_two_runs_and_counts_no_empty_shard_missing(tmp_path):
    """From a cold review: shards 1/3 and 2/2, or of two selections, merged with exit 0 and
    their lost pairs listed as 'missing' beside 'no regression'; and shards 1/3 and 2/3 of
    two cases (3/3 holds none: refused when run) merged INCOMPLETE, '3/3 missing'."""
    import subprocess
    import sys
    root = Path(__file__).resolve().parent.parent
    one, two = ("packed/random-b4-t256-h4kv2-d64-bf16-s0",
                "packed/many-b4-t256-h4kv2-d64-bf16-s0")

    def harness(*args):
        return subprocess.run([sys.executable, "-m", "harness", *args], cwd=root, timeout=600,
                              capture_output=True, text=True)

    def shard(part, kernels="dot_product", cases=f"{one},{two}"):
        out = tmp_path / f"{kernels}-{part.replace('/', 'of')}"
        done = harness("run", "--kernels", kernels, "--cases", cases, "--shard", part,
                       "--no-leak-probe", "--report-dir", str(out))
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return str(out)
    for a, b in ((shard("1/3"), shard("2/2")), (shard("1/2", "dot_product,xla"), shard("2/2"))):
        out = harness("merge", str(tmp_path / "m"), a, b)
        assert out.returncode == 2 and "are not shards of one run" in out.stderr, out.stderr
        assert "Traceback" not in out.stderr
    out = harness("merge", str(tmp_path / "whole"), shard("1/3"), shard("2/3"))
    assert out.returncode == 0 and "INCOMPLETE" not in out.stdout, out.stdout[-2000:]
    from harness.store import report_file as rec
    assert "shards_missing" not in rec.read_header(tmp_path / "whole")


def test_a_merge_of_a_merge_is_held_to_its_shards(tmp_path):
    """From an adversarial review: a merge of shards 1/3 and 2/3, merged again with 3/3 of
    another selection or with a shard 2/2, joined green (a merged source's shards were never
    checked), and its compare with the whole listed the lost pairs beside 'no regression'; a
    two-step merge, merged again, said its first shards were missing (the header nested
    them); a shard of another commit stood in for today's."""
    import pytest
    from harness.errors import UsageError
    parts = [_write(tmp_path / f"p{i}", [_record("k", CASE_IDS[0], "ok")], shard=f"{i}/3")
             for i in (1, 2)]
    engine.merge(tmp_path / "m12", parts)
    other = _write(tmp_path / "other", [_record("j", CASE_IDS[1], "ok")], shard="3/3",
                   selection={**SELECTION, "cases": "x*", "shard": "3/3"})
    halves = _write(tmp_path / "half", [_record("j", CASE_IDS[1], "ok")], shard="2/2")
    for wrong, why in ((other, "their selections differ"), (halves, "2 shards against 3")):
        with pytest.raises(UsageError, match=why):
            engine.merge(tmp_path / "bad", [tmp_path / "m12", wrong])
    last = _write(tmp_path / "p3", [_record("j", CASE_IDS[1], "ok")], shard="3/3")
    status, _, header, _ = engine.merge(tmp_path / "whole", [tmp_path / "m12", last])
    assert status == 0 and header["shard"] == ["1/3", "2/3", "3/3"], header["shard"]
    assert header["selection"] == {**SELECTION, "shard": None}
    status, _, header, _ = engine.merge(tmp_path / "again", [tmp_path / "whole"])
    assert status == 0 and "shards_missing" not in header
    # The same shard 3/3 from another commit: refused, naming the commit.
    def shard(name, part, commit):
        rec.write_report(tmp_path / name / rec.RECORDS_FILE,
                         {"platform": "cpu", "git_commit": commit},
                         [_record("j", CASE_IDS[1], "ok")], suite="t", kernels=["k", "j"],
                         cases=2, state="finished", shard=part,
                         selection={**SELECTION, "shard": part})
        return tmp_path / name
    with pytest.raises(UsageError, match="git_commit '0000"):
        engine.merge(tmp_path / "bad2", [shard("today", "1/3", "1" * 40),
                                         shard("stale", "3/3", "0" * 40)])


def test_a_baseline_cut_short_or_spelled_otherwise_is_no_pass(tmp_path):
    """From an adversarial review: a baseline cut at a line (its header intact) compared
    'no regression' with a run whose pairs it had lost; the same selection with its kernels
    in another order turned the missing-pair rule off."""
    both = [_record(k, c, "ok") for k in ("k", "j") for c in CASE_IDS]
    base = _write(tmp_path / "base", both, pairs_selected=4)
    cut = _write(tmp_path / "cut", both[:2], pairs_selected=4)
    grown = _write(tmp_path / "new", [*both[:2], *[_record(r.kernel, r.case_id, "ok", ratio=0.9)
                                                   for r in both[2:]]], pairs_selected=4)
    status, text = _compare(grown, cut)
    assert status == 1 and "INCOMPLETE BASELINE: it holds 2 of the 4" in text, text
    status, text = _compare(cut, base)
    assert status == 1 and "INCOMPLETE: the new report is incomplete (it holds 2" in text, text
    status, text = _compare(_write(tmp_path / "same", both, pairs_selected=4), base)
    assert status == 0, text
    # The kernels named in another order select alike: a pair lost is a regression.
    reordered = _write(tmp_path / "reordered", both[:3],
                       selection={**SELECTION, "kernels": "j,k", "shard": None})
    status, text = _compare(reordered, base)
    assert status == 1 and "missing now (the same cases were selected)" in text, text


def test_an_exact_check_is_not_regressed_by_rounding():
    """From an adversarial review: a check at error 0 in the baseline (the oracle's own sums),
    at 1e-7 now (ratio 0.027), was a regression; past the noise share of its tolerance it
    still is."""
    from harness.judge.regression import NOISE_RATIO, grew

    def check(err, ratio, runs=None):
        r = _record("k", CASE_IDS[0], "ok", ratio=ratio)
        r.max_abs_err = err
        if runs:
            r.extra["err_range"] = runs
        return r
    for runs in (None, [0.0, 0.0, 2]):
        base = check(0.0, 0.0, runs)
        assert not grew(base, check(1e-7, 0.027), 2.0)
        assert grew(base, check(0.01, NOISE_RATIO * 2), 2.0)
        assert grew(base, check(None, None), 2.0)
    # Away from zero, as before: a bitwise-stable check regresses past its growth.
    assert grew(check(1e-7, 0.027, [1e-7, 1e-7, 2]), check(3e-7, 0.08), 2.0)


def test_the_cut_short_rule_reads_older_headers_merges_and_baselines(tmp_path):
    """From a cold read: the committed baseline and merged reports carry no pairs_selected,
    so a copy of them cut short compared green; shards of runners with another Python or
    without Transformer Engine were refused; a run folder with report.jsonl beside its gzip
    copy (scripts/gpu.sh keeps both) was refused."""
    import gzip
    import shutil
    from harness.store import merge
    both = [_record(k, c, "ok") for k in ("k", "j") for c in CASE_IDS]
    old = _write(tmp_path / "old", both)          # no pairs_selected: kernels x cases
    assert rec.pairs_expected(rec.read_header(old)) == 4
    status, text = _compare(_write(tmp_path / "new", both), _write(tmp_path / "cut", both[:3]))
    assert status == 1 and "INCOMPLETE BASELINE: it holds 3 of the 4" in text, text
    parts = [_write(tmp_path / f"p{i}", both[2 * (i - 1):2 * i], shard=f"{i}/2",
                    pairs_selected=2) for i in (1, 2)]
    engine.merge(tmp_path / "m", parts)
    assert rec.read_header(tmp_path / "m")["pairs_selected"] == 4
    # Runners that differ in what the shards need not share merge; another jax does not.
    heads = [{"shard": f"{i}/2", "selection": {**SELECTION, "shard": f"{i}/2"},
              "environment": {"python": py, "transformer_engine": te, "git_dirty": dirty,
                              "jax": "0.11.2", "host": f"h{i}"}}
             for i, py, te, dirty in ((1, "3.11.7", None, None), (2, "3.12.3", "2.4.0", False))]
    merge.check_shards(heads, ["a", "b"])
    heads[1]["environment"]["jax"] = "0.10.2"
    import pytest
    from harness.errors import UsageError
    with pytest.raises(UsageError, match="jax '0.10.2' vs '0.11.2'"):
        merge.check_shards(heads, ["a", "b"])
    # report.jsonl beside its gzip copy reads; beside another report it does not.
    copy = tmp_path / "copy"
    shutil.copytree(old, copy)
    with gzip.open(copy / "report.jsonl.gz", "wb") as f:
        f.write((copy / "report.jsonl").read_bytes())
    assert rec.resolve(copy).name == "report.jsonl"
    with gzip.open(copy / "report.jsonl.gz", "wb") as f:
        f.write((tmp_path / "cut" / "report.jsonl").read_bytes())
    with pytest.raises(UsageError, match="which differ"):
        rec.resolve(copy)


def test_the_exit_guard_leaves_a_forked_childs_exit_alone():
    """From a cold read: a child forked inside a kernel's traced code kept the guard, and its
    multiprocessing exit raised there (the parent read status 0 for the child's 3)."""
    import multiprocessing
    import sys
    from harness.errors import ProcessExitCalled, kernel_code

    def child():
        sys.exit(3)
    with kernel_code():
        proc = multiprocessing.get_context("fork").Process(target=child)
        proc.start()
        proc.join(60)
        assert proc.exitcode == 3
        import os
        import pytest
        with pytest.raises(ProcessExitCalled):
            os._exit(0)


def test_a_merge_keeps_to_one_commit_and_the_shards_that_ran(tmp_path):
    """From an adversarial review: an unsharded rerun from another commit merged beside the
    night's shards replaced their records, green; a merge of merges of shards 1/3 and 2/3 (3/3
    held no case and never ran) said shard 3/3 was missing; a lone shard whose cases the named
    kernel all skips was red, though its merge with the others was green."""
    import pytest
    from harness.errors import UsageError
    from harness.views.summary import NONE_BAD_SHARD_IDLE

    def shard(name, part, records, commit="a" * 40, **extra):
        rec.write_report(tmp_path / name / rec.RECORDS_FILE,
                         {"platform": "cpu", "git_commit": commit}, records, suite="t",
                         kernels=["k", "j"], cases=2, state="finished", shard=part,
                         selection={**SELECTION, "shard": part},
                         pairs_selected=len({r.pair for r in records}), **extra)
        return tmp_path / name
    ok = [_record("k", CASE_IDS[0], "ok")]
    parts = [shard(f"p{i}", f"{i}/3", ok if i == 1 else [_record("j", CASE_IDS[1], "ok")],
                   shards_filled=2) for i in (1, 2)]
    rerun = shard("rerun", None, ok, commit="b" * 40)
    with pytest.raises(UsageError, match="not run by the same code.*git_commit 'bbbb"):
        engine.merge(tmp_path / "mixed", [*parts, rerun])
    dirty = tmp_path / "dirty" / rec.RECORDS_FILE   # today's commit, edited and not committed
    rec.write_report(dirty, {"platform": "cpu", "git_commit": "a" * 40, "git_dirty": True}, ok,
                     suite="t", kernels=["k", "j"], cases=2, state="finished",
                     selection={**SELECTION, "shard": None})
    for p in parts:
        rec.update_header(p / rec.RECORDS_FILE, environment={"platform": "cpu",
                                                             "git_commit": "a" * 40,
                                                             "git_dirty": False})
    with pytest.raises(UsageError, match="git_dirty True vs False"):
        engine.merge(tmp_path / "mixed", [*parts, dirty.parent])
    # Without shards, reports of two devices merge as they are (a CPU run beside a GPU run).
    gpu = shard("gpu", None, [_record("j", CASE_IDS[1], "ok")])
    rec.update_header(gpu / rec.RECORDS_FILE, environment={"platform": "gpu"})
    assert engine.merge(tmp_path / "devices", [rerun, gpu])[0] == 0
    for i, p in enumerate(parts, 1):
        engine.merge(tmp_path / f"m{i}", [p])
    status, _, header, _ = engine.merge(tmp_path / "mm", [tmp_path / "m1", tmp_path / "m2"])
    assert status == 0 and "shards_missing" not in header, header.get("shards_missing")
    skips = [_record("k", CASE_IDS[1], "skip")]
    idle = shard("idle", "2/2", skips)
    header, records = rec.read(idle)
    assert run_status(records, header) == 0
    from harness.views.report_dir import write_views
    write_views(idle)
    assert NONE_BAD_SHARD_IDLE in (idle / "summary.md").read_text()
    assert engine.merge(tmp_path / "alone", [idle])[0] == 1   # shard 1/2 missing
    whole = shard("whole", "1/1", skips)
    assert run_status(*reversed(rec.read(whole))) == 1
    # The only shard holding cases is the whole selection; a merge of one shard is held too.
    only = shard("only", "1/3", skips, shards_filled=1)
    assert run_status(*reversed(rec.read(only))) == 1
    assert engine.merge(tmp_path / "only-merged", [only])[0] == 1


def test_a_baseline_of_a_cut_run_is_refused(tmp_path):
    """From a cold read: `harness baseline` made a baseline of a run cut short, and copied the
    reader's note of the cut into it (every compare against it then read INCOMPLETE), or not,
    by the order of its sources."""
    import pytest
    from harness.errors import UsageError
    from harness.views.compare import write_baseline
    both = [_record(k, c, "ok", check=chk) for k in ("k", "j") for c in CASE_IDS
            for chk in ("out", "dq")]
    whole = _write(tmp_path / "whole", both, pairs_selected=4)
    cut = _write(tmp_path / "cut", both, pairs_selected=4)
    lines = (cut / rec.RECORDS_FILE).read_text().splitlines(keepends=True)
    (cut / rec.RECORDS_FILE).write_text("".join(lines[:-1]))
    for order in ([cut, whole], [whole, cut]):
        with pytest.raises(UsageError, match="is incomplete .it holds 7 of the 8 records"):
            write_baseline(tmp_path / "b.jsonl.gz", order)
    again = _write(tmp_path / "again", both, pairs_selected=4)
    write_baseline(tmp_path / "b.jsonl.gz", [whole, again])
    header, _ = rec.read(tmp_path / "b.jsonl.gz")
    assert rec.CUT_SHORT not in header and header[rec.RECORDS_WRITTEN] == 8


def test_a_merge_made_before_joined_by_is_made_again(tmp_path):
    """From a cold read: an OUT written by an older `harness merge` (its header has the
    `rejudged` fact, not `joined_by`) was refused as a run's own report."""
    import subprocess
    import sys
    src = _write(tmp_path / "src", [_record("k", CASE_IDS[0], "ok")], pairs_selected=1)
    old = _write(tmp_path / "old", [_record("k", CASE_IDS[0], "ok")], pairs_selected=1,
                 rejudged=False)
    run = _write(tmp_path / "run", [_record("k", CASE_IDS[0], "ok")], pairs_selected=1)
    root = Path(__file__).resolve().parent.parent
    again, refused = (subprocess.run([sys.executable, "-m", "harness", "merge", str(out),
                                      str(src)], cwd=root, capture_output=True, text=True,
                                     timeout=300) for out in (old, run))
    assert again.returncode != 2 and "own report" not in again.stderr, again.stderr[-2000:]
    assert refused.returncode == 2 and "holds a run's own report" in refused.stderr, \
        refused.stderr[-2000:]


def test_a_shard_run_again_whole_after_its_runner_died_completes_the_merge(tmp_path):
    """A shard whose runner died (its report cut short, its state 'running') and the same shard
    run again to the end: merged in that order, the rerun replaces the cut one whole and the
    merge is green (it read INCOMPLETE, the cut source's shortfall and state carried over). In
    the other order, or against a rerun of another selection, kernels or commit, the cut source
    still counts."""
    def pairs(shard):
        return [_record(k, c, "ok") for k in ("k", "j") for c in CASE_IDS
                if (CASE_IDS.index(c) % 2) + 1 == int(shard[0])]

    def shard(name, records, **header):
        folder = tmp_path / name
        info = {"suite": "t", "kernels": ["k", "j"], "cases": 1, "state": "finished",
                "selection": {**SELECTION, "shard": header.get("shard", "2/2")},
                "shard": "2/2", "pairs_selected": 2, **header}
        rec.write_report(folder / rec.RECORDS_FILE,
                         {"platform": "cpu", "git_commit": header.pop("commit", "abc")},
                         records, **{k: x for k, x in info.items() if k != "commit"})
        return folder
    one = shard("p1", pairs("1/2"), shard="1/2")
    cut = shard("p2-cut", pairs("2/2")[:1], state="running")
    again = shard("p2-again", pairs("2/2"))
    status, _, header, records = engine.merge(tmp_path / "m", [one, cut])
    assert status == 1 and header["state"] == "running"
    status, _, header, records = engine.merge(tmp_path / "m2", [one, cut, again])
    assert status == 0 and header["state"] == "finished" and len(records) == 4, header
    assert rec.CUT_SHORT not in header and header["pairs_selected"] == 4
    md = (tmp_path / "m2" / "summary.md").read_text()
    assert "INCOMPLETE" not in md and "never finished" not in md
    # The cut one last: its pair may be cut inside; the merge stays unfinished.
    status, _, header, _ = engine.merge(tmp_path / "m3", [one, again, cut])
    assert status == 1 and header["state"] == "running"
    # Stopped (Ctrl-C, SIGTERM) rather than killed, then run again: its interrupted fact goes
    # with it.
    stopped = shard("p2-stopped", pairs("2/2")[:1], state="interrupted", interrupted=True)
    status, _, header, _ = engine.merge(tmp_path / "m4", [one, stopped, again])
    assert status == 0 and not header.get("interrupted"), header
    # Cut short without the running state (a file cut at a line) and run again: green too.
    short = shard("p2-short", pairs("2/2")[:1])
    status, _, header, _ = engine.merge(tmp_path / "m5", [one, short])
    assert status == 1 and rec.CUT_SHORT in header
    status, _, header, _ = engine.merge(tmp_path / "m6", [one, short, again])
    assert status == 0 and rec.CUT_SHORT not in header, header
    # Not the same run: the cut one had a kernel more (a --kernel-module the rerun lacked: its
    # selection reads alike), or held a pair the rerun does not (another commit is refused).
    wider = shard("p2-wider", pairs("2/2")[:1], state="running", kernels=["k", "j", "mine"],
                  pairs_selected=3)
    extra = shard("p2-extra", [*pairs("2/2")[:1], _record("k", CASE_IDS[0], "ok")],
                  state="running", pairs_selected=3)
    other = shard("p2-other", pairs("2/2")[:1], state="running", commit="def")
    with pytest.raises(UsageError, match="not run by the same code"):
        engine.merge(tmp_path / "n", [one, other, again])
    for n, earlier in enumerate((wider, extra)):
        status, _, header, _ = engine.merge(tmp_path / f"n{n}", [one, earlier, again])
        assert status == 1 and header["state"] == "running", earlier
