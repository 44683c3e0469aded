"""The nightly fanned out over runners (.github/workflows/nightly-gpu.yml), simulated on the CPU:
N shard processes (`--shard I/N`, as each runner runs), one merge, and the merged records are
those of one unsharded run, record for record (verdict, outcome, errors); the merged report
selects what the unsharded run selected, so a shard that never reports leaves the merge
incomplete (not green) and is a regression against a baseline of the whole suite."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SELECT = ("--kernels", "dot_product,canary_ignores_segments",
          "--cases", "packed/random-b4-t256-h4kv2*,unaligned/odd-b4-t256-h4kv2*,"
                     "padded/between-b4-t256-h4kv2*")


def _harness(*args):
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, env=dict(os.environ))


def _probe_off(folder, kernels, cases):
    """A run of these kernels and cases without the leak probe, into `folder`: its records."""
    from harness.store import report_file as rec
    out = _harness("run", "--kernels", kernels, "--cases", cases, "--no-leak-probe",
                   "--report-dir", str(folder))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return rec.read(folder)[1]


def _records(path):
    from harness.store import report_file as rec
    header, records = rec.read(path)
    return header, {r.key: (r.verdict, r.outcome, r.max_abs_err, r.ratio) for r in records}


def test_shards_merged_are_one_run_and_a_lost_shard_regresses(tmp_path):
    whole = _harness("run", *SELECT, "--report-dir", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stdout[-2000:] + whole.stderr[-2000:]
    parts = []
    for i in (1, 2, 3):
        part = tmp_path / f"part-{i}"
        out = _harness("run", *SELECT, "--shard", f"{i}/3", "--report-dir", str(part))
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        parts.append(str(part))
    merged = _harness("merge", str(tmp_path / "merged"), *parts)
    assert merged.returncode == 0, merged.stdout[-2000:] + merged.stderr[-2000:]
    whole_header, whole_records = _records(tmp_path / "whole")
    merged_header, merged_records = _records(tmp_path / "merged")
    assert merged_records == whole_records
    assert merged_header["selection"] == whole_header["selection"]
    same = _harness("compare", str(tmp_path / "merged"), str(tmp_path / "whole"))
    assert same.returncode == 0 and "no regression" in same.stdout, same.stdout[-2000:]
    # A runner that never reported: the merge says so and is not green, and its pairs are
    # missing, which is a regression.
    lost = _harness("merge", str(tmp_path / "lost"), *parts[:2])
    assert lost.returncode == 1 and "shard(s) 3/3 missing" in lost.stdout, lost.stdout[-2000:]
    gone = _harness("compare", str(tmp_path / "lost"), str(tmp_path / "whole"))
    assert gone.returncode == 1 and "REGRESSION" in gone.stdout, gone.stdout[-2000:]
    assert "INCOMPLETE" in gone.stdout


def _cut(src: Path, dst: Path, keep) -> Path:
    """A copy of report folder `src` whose report.jsonl keeps the lines `keep(lines)` gives."""
    import shutil
    shutil.copytree(src, dst)
    lines = (dst / "report.jsonl").read_text().splitlines(keepends=True)
    (dst / "report.jsonl").write_text("".join(keep(lines)))
    return dst


def test_a_report_or_shard_cut_short_is_never_green(tmp_path):
    """From an adversarial review: `report` and `merge` were green on a report cut inside a
    pair (its dk, dv, padding and leak records gone) or without a whole pair; only `compare`
    looked, and only at whole pairs."""
    for i in (1, 2):
        out = _harness("run", *SELECT, "--shard", f"{i}/2", "--report-dir", str(tmp_path / f"s{i}"))
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    inside = _cut(tmp_path / "s2", tmp_path / "inside",   # one dv record of a measured pair
                  lambda lines: [x for i, x in enumerate(lines)
                                 if i != next(j for j, y in enumerate(lines)
                                              if '"check": "dv"' in y)])
    seen = _harness("report", str(inside))
    assert seen.returncode == 1 and "records its run wrote: cut short" in seen.stdout, \
        seen.stdout[-2000:]
    merged = _harness("merge", str(tmp_path / "m"), str(tmp_path / "s1"), str(inside))
    assert merged.returncode == 1 and "INCOMPLETE" in merged.stdout, merged.stdout[-2000:]
    assert "records its run wrote" in (tmp_path / "m" / "summary.md").read_text()
    first = next(x for x in (tmp_path / "s1" / "report.jsonl").read_text().splitlines()[1:])
    pair = '"case_id": ' + first.split('"case_id": ')[1].split(",")[0]
    whole_pair = _cut(tmp_path / "s1", tmp_path / "pair",
                      lambda lines: [x for x in lines if pair not in x or x.startswith('{"type": "run"')])
    seen = _harness("report", str(whole_pair))
    assert seen.returncode == 1 and "kernel x case pairs its run selected" in seen.stdout, \
        seen.stdout[-2000:]
    whole = _harness("merge", str(tmp_path / "ok"), str(tmp_path / "s1"), str(tmp_path / "s2"))
    assert whole.returncode == 0, whole.stdout[-2000:]
    # OUT forgotten: shard 1's own report would be replaced; refused, and it stays.
    before = (tmp_path / "s1" / "report.jsonl").read_bytes()
    forgot = _harness("merge", str(tmp_path / "s1"), str(tmp_path / "s2"))
    assert forgot.returncode == 2 and "holds a run's own report (shard 1/2)" in forgot.stderr, \
        forgot.stderr[-2000:]
    assert (tmp_path / "s1" / "report.jsonl").read_bytes() == before
    again = _harness("merge", str(tmp_path / "ok"), str(tmp_path / "s1"), str(tmp_path / "s2"))
    assert again.returncode == 0, again.stdout[-2000:]   # a merge's own OUT, made again


def test_rejudge_recomputes_expectations_but_keeps_a_kernel_it_cannot_load_here(
        tmp_path, monkeypatch, capsys):
    """`merge --rejudge` recomputes each record's expectation from the kernels as registered
    now; a kernel whose library is missing here keeps its records as recorded, and a note says
    so (its expectations may read that library: rejudged without it, TE's declared sinks crash
    read as an unexpected error)."""
    import json
    from harness.engine import engine, registry
    from harness.kernels.kernel import Kernel
    from harness.kernels.reference import dot_product
    from harness.store import report_file as rec
    src = tmp_path / "src"
    _probe_off(src, "dot_product", "packed/random-b4-t256-h4kv2*")
    # The same records again under the names of a kernel that needs a library and of one not
    # registered at all.
    lines = (src / rec.RECORDS_FILE).read_text().splitlines()
    twin = [json.dumps({**row, "kernel": name}) for name in ("needs_a_library", "gone")
            for row in map(json.loads, lines) if row.get("type") == "record"]
    (src / rec.RECORDS_FILE).write_text("\n".join(lines + twin) + "\n")

    def declared(case, check, segment):   # an expectation corrected after the run
        return ("fail", "declared to fail") if check == "out" else ("pass", "")
    now = {"dot_product": Kernel("dot_product", dot_product, expect=declared),
           "needs_a_library": Kernel("needs_a_library", dot_product, expect=declared,
                                     requires=("no_such_library_xyz",))}
    monkeypatch.setattr(registry, "all_kernels", lambda: now)
    engine.merge(tmp_path / "merged", [src], rejudge=True)
    assert ("--rejudge kept the records of 2 kernel(s) as recorded: gone (not registered "
            "here), needs_a_library (no_such_library_xyz not installed here)"
            ) in capsys.readouterr().err
    header, records = rec.read(tmp_path / "merged")
    assert header["rejudge_kept"] == {"gone": "not registered here",
                                      "needs_a_library": "no_such_library_xyz not installed here"}
    assert ("rejudged, but kept the records of 2 kernel(s) as recorded: gone (not registered "
            "here)") in (tmp_path / "merged" / "summary.md").read_text().splitlines()[2]

    def outcomes(kernel):
        return {(r.expected, r.outcome) for r in records if r.kernel == kernel
                and r.check == "out"}
    assert outcomes("dot_product") == {("fail", "missed")}
    assert outcomes("needs_a_library") == outcomes("gone") == {("pass", "ok")}


def test_rejudge_keeps_a_check_left_to_a_probe_that_was_off_not_run_and_rejudges_dsinks(
        tmp_path):
    """`merge --rejudge` of a run made with --no-leak-probe: a check left to the probe reads
    not run again (it read missed, and the merge exited 1); the sinks' gradient (one record
    per pair, no segment) is rejudged too (it was copied as recorded)."""
    from harness.engine import registry
    from harness.judge.rejudge import rejudge
    from harness.kernels.kernel import Kernel
    from harness.store import report_file as rec
    src = tmp_path / "src"
    before = _probe_off(src, "canary_ignores_segments", "packed/random-b4-t256-h4kv2-d64-bf16-s0")
    assert any(r.outcome == "not run" for r in before)
    merged = _harness("merge", "--rejudge", str(tmp_path / "merged"), str(src))
    assert merged.returncode == 0, merged.stdout[-2000:] + merged.stderr[-2000:]
    _, after = rec.read(tmp_path / "merged")
    assert sorted((r.key, r.outcome) for r in after) == sorted((r.key, r.outcome)
                                                               for r in before)
    # The sinks' gradient, rejudged against an expectation corrected after the run.
    records = _probe_off(tmp_path / "sinks", "dot_product",
                         "packed/random-b4-t256-h4kv4-d32-f32-s6-sink")
    dsinks = [r for r in records if r.check == "dsinks"]
    assert [(r.verdict, r.outcome) for r in dsinks] == [("pass", "ok")]
    kernel = registry.all_kernels()["dot_product"]

    def declared(case, check, segment):
        return ("fail", "declared to fail") if check == "dsinks" else "pass"
    now = {"dot_product": Kernel("dot_product", kernel.fn, expect=declared,
                                 features=kernel.features)}
    again = [r for r in rejudge(records, now, probed=False) if r.check == "dsinks"]
    assert [(r.expected, r.outcome) for r in again] == [("fail", "missed")]
    # A non-finite one keeps the message that says so.
    nan = dsinks[0].replace(verdict="fail", outcome="fail", max_abs_err=None, ratio=None,
                            message="dsinks non-finite")
    assert [(r.expected, r.outcome, r.message) for r in rejudge([nan], now, probed=False)] == [
        ("fail", "caught", "dsinks non-finite")]
    # A failing one keeps its diagnosis (what the gradient looks like) before the reason.
    cut = dsinks[0].replace(verdict="fail", outcome="fail", ratio=30.0, diagnosis="zero on "
                            "every head", message="zero on every head")
    assert [(r.outcome, r.message) for r in rejudge([cut], now, probed=False)] == [
        ("caught", "zero on every head")]
    now["dot_product"] = Kernel("dot_product", kernel.fn, features=kernel.features,
                                expect=lambda case, check, segment: ("known", "bug 7")
                                if check == "dsinks" else "pass")
    assert [(r.outcome, r.message) for r in rejudge([cut], now, probed=False)] == [
        ("known", "zero on every head; bug 7")]


def test_rejudge_misses_a_crash_declared_after_a_run_that_did_not_crash(tmp_path, monkeypatch):
    """A kernel that declares an upstream crash now, on a pair that ran cleanly: rejudged, the
    pair gains the record the run would have written ("did not occur", missed); merged with
    --rejudge it exits 1 (it read green: the declaration was never checked)."""
    from harness.engine import registry
    from harness.judge.rejudge import rejudge
    from harness.kernels.kernel import Kernel
    records = _probe_off(tmp_path / "src", "dot_product", "packed/random-b4-t256-h4kv2*")
    kernel = registry.all_kernels()["dot_product"]
    crashes = Kernel("dot_product", kernel.fn, expect_error=lambda case: "CUDNN_STATUS_X")
    again = rejudge(records, {"dot_product": crashes}, probed=False)
    added = [r for r in again if r.check == "*"]
    pairs = {r.pair for r in records}
    assert {r.pair for r in added} == pairs and len(added) == len(pairs) > 1
    assert {(r.verdict, r.expected, r.outcome) for r in added} == {("pass", "error", "missed")}
    assert "'CUDNN_STATUS_X' did not occur" in added[0].message
    assert len(again) == len(records) + len(pairs)
    # Rejudged again, it is not added twice; declared no more, it is gone (the run would not
    # write it); declared again, one per pair again; declared otherwise, the new text.
    assert len(rejudge(again, {"dot_product": crashes}, probed=False)) == len(again)
    plain = rejudge(again, {"dot_product": kernel}, probed=False)
    assert not [r for r in plain if r.check == "*"] and len(plain) == len(records)
    back = rejudge(plain, {"dot_product": crashes}, probed=False)
    assert sorted(r.key for r in back) == sorted(r.key for r in again)
    other = Kernel("dot_product", kernel.fn, expect_error=lambda case: "CUDNN_STATUS_Y")
    changed = [r for r in rejudge(again, {"dot_product": other}, probed=False) if r.check == "*"]
    assert len(changed) == len(pairs)
    assert all("'CUDNN_STATUS_Y' did not occur" in r.message for r in changed)
    # Another check's error (the jvp check's), even with the declared text, is not the
    # default build raising: the run writes "did not occur" beside it, and so does rejudge.
    jvp = records[0].replace(check="jvp", verdict="error", outcome="error", segment=None,
                             message="XlaRuntimeError: CUDNN_STATUS_X in the jvp")
    mixed = rejudge(records + [jvp], {"dot_product": crashes}, probed=False)
    assert [r.outcome for r in mixed if r.check == "*" and r.pair == jvp.pair] == ["missed"]
    # A pair that only skipped gains nothing.
    skipped = [r.replace(verdict="skip", outcome="skip", check="*") for r in records[:1]]
    assert rejudge(skipped, {"dot_product": crashes}, probed=False) == skipped
    from harness.engine import engine
    monkeypatch.setattr(registry, "all_kernels", lambda: {"dot_product": crashes})
    assert engine.merge(tmp_path / "merged", [tmp_path / "src"], rejudge=True)[0] == 1
