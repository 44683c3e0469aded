"""What a new user still hit (issue 20): silent greens, tracebacks on bad paths, unclear help and
output. Each test failed before its fix."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MATRIX = str(ROOT / "cases" / "test_matrix.py")
ONE_CASE = "packed/random-b4-t256-h4kv2-d64-bf16-s0"


def _run(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def _one_line(out, *needles, status=2):
    text = out.stdout + out.stderr
    assert out.returncode == status, text[-3000:]
    assert "Traceback" not in text and "INTERNALERROR" not in text, text[-3000:]
    errors = [line for line in text.splitlines() if "error" in line.lower()]
    assert errors, text[-2000:]
    assert all(n in text for n in needles), text[-2000:]


# ----- silent greens ------------------------------------------------------------------------

def test_a_kernel_module_that_registers_nothing_is_a_usage_error(tmp_path):
    empty = tmp_path / "nothing.py"
    empty.write_text("import harness\n")
    out = _run("-m", "harness", "run", "--kernel-module", str(empty),
               "--report-dir", str(tmp_path / "r"))
    _one_line(out, "nothing.py: the module registered no kernel")
    assert not (tmp_path / "r").exists()


def test_a_kernel_that_calls_sys_exit_is_an_error_in_its_worker_and_here(tmp_path):
    """A kernel whose library calls sys.exit(0): in the run's process it ended the run with
    status 0 and no record; in a worker of its own the worker ended with status 0 and its
    pairs were dropped from the report, the run green. Now an error record either way."""
    module = tmp_path / "exits.py"
    module.write_text(
        "import sys, harness\n"
        "def exits(q, k, v, seg, *, causal, scale):\n"
        "    sys.exit(0)\n"
        "for name, group in (('exits_here', None), ('exits_apart', 'g1')):\n"
        "    harness.register_kernel(name, exits, dtypes=('bfloat16',), gqa=True,\n"
        "                            isolation=group)\n")
    from harness.store import report_file as rec
    for kernels in ("exits_here", "dot_product,exits_apart"):
        report = tmp_path / kernels.replace(",", "-")
        out = _run("-m", "harness", "run", "--kernel-module", str(module), "--kernels", kernels,
                   "--cases", ONE_CASE, "--no-leak-probe", "--report-dir", str(report))
        assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
        _, records = rec.read(report)
        errors = [r for r in records if r.kernel.startswith("exits")]
        assert [r.outcome for r in errors] == ["error"], [r.message for r in errors]
        assert "SystemExit" in errors[0].message or "status 0" in errors[0].message


def test_a_kernel_raising_asyncio_cancelled_is_an_error_not_a_traceback(tmp_path):
    """asyncio.CancelledError derives from BaseException: a kernel whose library's event loop
    raised it gave the CLI a traceback and no report. Now it is the kernel's error record."""
    module = tmp_path / "cancels.py"
    module.write_text(
        "import asyncio, harness\n"
        "def cancels(q, k, v, seg, *, causal, scale):\n"
        "    raise asyncio.CancelledError('the loop went away')\n"
        "harness.register_kernel('cancels', cancels, dtypes=('bfloat16',), gqa=True)\n")
    from harness.store import report_file as rec
    report = tmp_path / "r"
    out = _run("-m", "harness", "run", "--kernel-module", str(module), "--kernels", "cancels",
               "--cases", ONE_CASE, "--no-leak-probe", "--report-dir", str(report))
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr[-2000:]
    _, records = rec.read(report)
    assert [r.outcome for r in records] == ["error"]
    assert "CancelledError" in records[0].message and "the loop went away" in records[0].message


def test_pytest_says_when_a_check_did_not_run(tmp_path):
    """pytest's terminal read '1 passed' and nothing else for a pair whose leak check did not
    run (--no-leak-probe), where the CLI shows `not run`; JUnit counted it nowhere."""
    junit = tmp_path / "j.xml"
    out = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", MATRIX, "--kernels",
               "dot_product", "--cases", ONE_CASE, "--no-leak-probe", "--report-dir",
               str(tmp_path / "r"), f"--junitxml={junit}")
    assert out.returncode == 0, out.stdout[-2000:]
    assert "harness: not every check ran: 1 not run" in out.stdout, out.stdout[-2000:]
    assert 'name="not_run" value="1"' in junit.read_text()
    out = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", MATRIX, "--kernels",
               "dot_product", "--cases", ONE_CASE, "--report-dir", str(tmp_path / "p"))
    assert out.returncode == 0 and "not every check ran" not in out.stdout, out.stdout[-2000:]


def test_a_kernel_ending_its_worker_while_traced_ahead_is_blamed_not_its_neighbour(tmp_path):
    """A worker traces the pairs after the one it runs: a kernel calling os._exit there ended
    the worker while a correct kernel's pair was the last started, and that pair read ERROR
    beside the culprit's (status 0 and 3 alike). Now the pair runs again alone first."""
    module = tmp_path / "ends.py"
    module.write_text(
        "import os, harness\n"
        "from harness.kernels.reference import dot_product\n"
        "def ends(q, k, v, seg, *, causal, scale):\n"
        "    os._exit(int(os.environ.get('END_STATUS', '0')))\n"
        "for name, fn in (('fine', dot_product), ('ends', ends)):\n"
        "    harness.register_kernel(name, fn, dtypes=('bfloat16',), gqa=True, isolation='g')\n")
    from harness.store import report_file as rec
    for status in ("0", "3"):
        report = tmp_path / status
        out = _run("-m", "harness", "run", "--kernel-module", str(module), "--kernels",
                   "dot_product,fine,ends", "--cases", ONE_CASE, "--no-leak-probe",
                   "--report-dir", str(report), env={"END_STATUS": status})
        assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
        _, records = rec.read(report)
        bad = sorted({(r.kernel, r.outcome) for r in records if r.bad})
        assert bad == [("ends", "error")], bad
        assert "ran alone" in out.stdout + out.stderr


def test_a_kernel_or_module_calling_pytest_skip_is_an_error_not_a_skip(tmp_path):
    """pytest.skip/xfail/importorskip raise BaseExceptions: in a kernel the CLI crashed with a
    traceback and left its report `running`, pytest showed a skip or an xfail; at a kernel
    module's top both printed a traceback. Now an error record on both paths, and one line."""
    module = tmp_path / "skips.py"
    module.write_text(
        "import harness, pytest\n"
        "def skips(q, k, v, seg, *, causal, scale):\n"
        "    pytest.skip('library not available')\n"
        "def xfails(q, k, v, seg, *, causal, scale):\n"
        "    pytest.xfail('nah')\n"
        "for name, fn in (('skips', skips), ('xfails', xfails)):\n"
        "    harness.register_kernel(name, fn, dtypes=('bfloat16',), gqa=True)\n")
    from harness.store import report_file as rec
    for command in (("-m", "harness", "run"), ("-m", "pytest", "-q", "-p", "no:cacheprovider",
                                                 MATRIX)):
        report = tmp_path / command[1]
        out = _run(*command, "--kernel-module", str(module), "--kernels", "skips,xfails",
                   "--cases", ONE_CASE, "--no-leak-probe", "--report-dir", str(report))
        text = out.stdout + out.stderr
        assert out.returncode == 1 and "Traceback" not in text, text[-3000:]
        if command[1] == "pytest":
            assert "2 failed" in text and "skipped" not in text and "xfailed" not in text, text
        header, records = rec.read(report)
        assert header["state"] == "finished"
        assert sorted((r.kernel, r.outcome) for r in records) == [
            ("skips", "error"), ("xfails", "error")], [r.message for r in records]
    top = tmp_path / "skip_at_top.py"
    top.write_text("import pytest\npytest.importorskip('no_such_library_here')\n")
    for command in (("-m", "harness", "run"), ("-m", "pytest", MATRIX)):
        _one_line(_run(*command, "--kernel-module", str(top), "--kernels", "dot_product",
                       "--cases", ONE_CASE, "--report-dir", str(tmp_path / "top")),
                  "skip_at_top.py:2: Skipped", status=2 if command[1] == "harness" else 4)


def test_a_selected_pair_without_a_record_is_an_error_record(tmp_path):
    """Every selected pair leaves a record (a skip included): a finished run whose report lacks
    one lost it on the way (a group's reports left out of the join, a worker that ended
    without a word), and is never green: the pair gets an error record saying so."""
    from harness.engine import engine
    from harness.engine.options import RunOptions
    from harness.engine.registry import select_kernels
    from harness.model.case import Case
    from harness.store import report_file as rec
    report = _report(tmp_path, "r", "--cases", ONE_CASE)
    assert _run("-m", "harness", "report", str(report)).returncode == 0
    kernel, = select_kernels(["dot_product"])
    lost = Case.from_id("unaligned/odd-b4-t256-h4kv2-d64-bf16-s0")
    status = engine.finish(report, RunOptions(), console=False,
                           selected=[(kernel, Case.from_id(ONE_CASE)), (kernel, lost)])
    assert status == 1
    _, records = rec.read(report)
    assert [(r.case_id, r.outcome, r.message) for r in records if r.case_id == lost.id] == [
        (lost.id, "error", engine.UNREPORTED)]
    assert "no record: the pair was selected" in (report / "summary.md").read_text()


def test_isolation_names_and_declarations_are_checked_in_one_line(tmp_path):
    """An isolation group named with '/' or glob characters (its workers' reports were left out
    of the join: the run green without the kernel's failures) is refused when registered; a
    kernel's constraints that return None or raise, and its expect, expect_padding or
    expect_error that raise (mid-run: a traceback and exit 1 before), are one line naming it.
    A run stopped so once begun says so in its header and views, in this process and in workers
    (its header said "running": "killed before its end")."""
    for i, (extra, needle) in enumerate((
            ("isolation='lib[v2]'", "isolation 'lib[v2]': letters, digits"),
            ("constraints=lambda case, platform: None",
             "kernel mine: constraints(case, platform) returned None on"),
            ("constraints=lambda case, platform: 1 / 0",
             "kernel mine: constraints(case, platform) raised on"),
            ("expect=lambda case, check, segment: {'out': 'pass'}[check]",
             "kernel mine: expect(case, 'dq', r0s1) raised on"),
            ("expect_padding=lambda case, row: 1 / 0",
             "kernel mine: expect_padding(case, 1) raised on"),
            ("expect_error=lambda case: case.nope",
             "kernel mine: expect_error(case) raised on"),
            ("expect_error=lambda case: case.nope, isolation='apart'",
             "kernel mine: expect_error(case) raised on"))):
        module = tmp_path / f"mine{i}.py"
        module.write_text("import harness\nfrom harness.kernels.reference import dot_product\n"
                          f"harness.register_kernel('mine', dot_product, {extra})\n")
        report = tmp_path / f"r{i}"
        report.mkdir()
        (report / "summary.md").write_text("an earlier run's green summary")
        out = _run("-m", "harness", "run", "--kernel-module", str(module), "--kernels", "mine",
                   "--cases", ONE_CASE, "--report-dir", str(report))
        _one_line(out, needle)
        if i < 3:
            continue   # refused before the run began: no report
        header = json.loads((report / "report.jsonl").read_text().splitlines()[0])
        assert header["state"] == "interrupted" and needle in header["stopped_by"], header
        stopped = "STOPPED by an error once the run had begun: " + needle
        # The views written as the run stopped (not an earlier run's), and again by `report`.
        assert stopped in (report / "summary.md").read_text()
        assert stopped in (report / "report.html").read_text()
        shown = _run("-m", "harness", "report", str(report))
        assert shown.returncode == 1, shown.stdout[-2000:] + shown.stderr[-2000:]
        assert stopped in shown.stdout
        assert "killed before" not in shown.stdout + (report / "summary.md").read_text()
        if i == 3:   # joined with another report, the merged header keeps why
            merged = _run("-m", "harness", "merge", str(tmp_path / "m"), str(report))
            assert merged.returncode == 1 and stopped in merged.stdout + (
                tmp_path / "m" / "summary.md").read_text(), merged.stdout[-2000:]


def test_a_report_dir_whose_workers_folder_is_not_the_harness_is_refused_not_deleted(tmp_path):
    """A run with workers clears its report folder's workers/ (an earlier run's); a workers/
    that holds anything else (a project's own folder given as --report-dir) is refused in
    one line and kept (it was deleted without a word)."""
    module = tmp_path / "apart.py"
    module.write_text("import harness\nfrom harness.kernels.reference import dot_product\n"
                      "harness.register_kernel('apart', dot_product, isolation='g1')\n")
    mine = tmp_path / "r" / "workers" / "mine"
    mine.mkdir(parents=True)
    (mine / "notes.txt").write_text("precious")
    args = ("-m", "harness", "run", "--kernel-module", str(module), "--kernels",
            "dot_product,apart", "--cases", ONE_CASE, "--no-leak-probe", "--report-dir")
    _one_line(_run(*args, str(tmp_path / "r")), "is not a harness run's worker folders")
    assert (mine / "notes.txt").read_text() == "precious"
    for _ in range(2):   # an earlier run's own workers are cleared
        out = _run(*args, str(tmp_path / "ok"))
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "ok" / "workers").iterdir()) == ["g1-1", "main-1"]


def test_a_run_where_every_case_skipped_is_not_green(tmp_path):
    out = _run("-m", "harness", "run", "--kernels", "sut:cudnn_flash_jax", "--cases", ONE_CASE,
               "--report-dir", str(tmp_path / "r"))
    assert out.returncode == 1, out.stdout[-2000:]
    assert "nothing was judged" in out.stdout
    assert "Nothing was judged" in (tmp_path / "r" / "summary.md").read_text()
    pyt = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", MATRIX, "--kernels",
               "sut:cudnn_flash_jax", "--cases", ONE_CASE, "--report-dir", str(tmp_path / "p"))
    assert pyt.returncode == 1, pyt.stdout[-2000:]
    assert "nothing was judged" in pyt.stdout


def test_a_named_kernel_that_judged_nothing_beside_one_that_passed_is_not_green(tmp_path):
    """--kernels names what the run is asked for: a named kernel whose every case skipped (here
    a GPU kernel on the CPU) leaves the run red beside a kernel that passed, with the reason, in
    the CLI, pytest, summary.md and `harness report` (it read green: exit 0). Kernels the run did
    not name may skip every case (the default selection on a CPU), and a single shard is not
    held to it."""
    both = ("--kernels", "dot_product,sut:cudnn_flash_jax", "--cases", ONE_CASE,
            "--no-leak-probe")
    out = _run("-m", "harness", "run", *both, "--report-dir", str(tmp_path / "r"))
    assert out.returncode == 1, out.stdout[-2000:]
    words = "1 kernel named with --kernels judged nothing"
    assert words in out.stdout and "sut:cudnn_flash_jax: runs on gpu" in out.stdout
    assert words in (tmp_path / "r" / "summary.md").read_text()
    again = _run("-m", "harness", "report", str(tmp_path / "r"))
    assert again.returncode == 1, again.stdout[-2000:]
    pyt = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", MATRIX, *both,
               "--report-dir", str(tmp_path / "p"))
    assert pyt.returncode == 1 and words in pyt.stdout, pyt.stdout[-2000:]
    alone = _run("-m", "harness", "run", "--kernels", "dot_product", "--cases", ONE_CASE,
                 "--no-leak-probe", "--report-dir", str(tmp_path / "a"))
    assert alone.returncode == 0 and words not in alone.stdout, alone.stdout[-2000:]
    shard = _run("-m", "harness", "run", *both, "--shard", "1/1", "--report-dir",
                 str(tmp_path / "s"))
    assert shard.returncode == 1, shard.stdout[-2000:]   # 1/1 is the whole suite


def _report(tmp_path, name, *args):
    """A small CLI run (the leak probe off: these tests are about reports, not the probe)."""
    args = args if "--no-leak-probe" in args else (*args, "--no-leak-probe")
    out = _run("-m", "harness", "run", "--kernels", "dot_product", *args,
               "--report-dir", str(tmp_path / name))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return tmp_path / name


def test_compare_with_nothing_in_common_or_an_interrupted_run_is_not_green(tmp_path):
    a = _report(tmp_path, "a", "--cases", ONE_CASE)
    b = _report(tmp_path, "b", "--cases", "unaligned/odd-b4-t256-h4kv2-d64-bf16-s0")
    out = _run("-m", "harness", "compare", str(a), str(b))
    assert out.returncode == 1 and "NOTHING COMPARED" in out.stdout, out.stdout
    # A run of the same selection that stopped early: its missing pairs are regressions.
    full = _report(tmp_path, "full", "--cases", "packed/random-*-bf16-*")
    from harness.store import report_file as rec
    header, records = rec.read(full)
    kept = [r for r in records if r.case_id == records[0].case_id]
    cut = tmp_path / "cut" / "report.jsonl"
    rec.write_report(cut, header["environment"], kept,
                     **{k: v for k, v in header.items() if k not in ("type", "schema",
                                                                     "environment")},
                     interrupted=True)
    out = _run("-m", "harness", "compare", str(cut), str(full))
    assert out.returncode == 1 and "missing now" in out.stdout, out.stdout[-2000:]


def test_missing_pairs_beyond_twenty_say_how_many_more(tmp_path):
    from harness.judge.regression import Comparison
    from harness.views import compare
    lines = [f"k{i} on c" for i in range(25)]
    import io
    from contextlib import redirect_stdout
    buf = io.StringIO()
    with redirect_stdout(buf):
        compare._listed("missing", lines, shown=20)
    assert "... and 5 more" in buf.getvalue()
    assert Comparison().compared_nothing


def test_a_seed_expanded_case_id_is_a_case_the_cli_runs(tmp_path):
    out = _run("-m", "harness", "run", "--kernels", "dot_product", "--cases",
               ONE_CASE.replace("-s0", "-s2"), "--no-leak-probe", "--report-dir",
               str(tmp_path / "r"))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    from harness.store import report_file as rec
    assert {r.case_id for r in rec.read(tmp_path / "r")[1]} == {ONE_CASE.replace("-s0", "-s2")}


def test_an_interrupted_run_with_nothing_finished_says_so_in_a_well_formed_report(tmp_path):
    from harness.store import report_file as rec
    from harness.views.markdown import render
    md = render({"suite": "nightly", "environment": {}, "interrupted": True}, [])
    assert "every kernel expected to pass passed" not in md
    assert "Nothing was judged" in md and "interrupted" in md
    table = [line for line in md.splitlines() if line.startswith("|")]
    assert all(line.count("|") == table[0].count("|") for line in table), table
    assert rec.SCHEMA


def test_a_run_prints_progress_before_its_first_pair_finishes(tmp_path):
    proc = subprocess.Popen([sys.executable, "-m", "harness", "run", "--kernels", "dot_product",
                             "--cases", ONE_CASE, "--report-dir", str(tmp_path / "r")],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = proc.stderr.readline()
    proc.wait(timeout=600)
    assert first.startswith("[0/1] starting"), first


# ----- tracebacks for a user's mistake ------------------------------------------------------

@pytest.mark.parametrize("make", ["file", "readonly"])
def test_a_report_dir_that_cannot_be_written_is_one_line(tmp_path, make):
    if make == "file":
        target = tmp_path / "afile"
        target.write_text("x")
        target, needle = target / "r", "is a file, not a folder"
    else:
        target, needle = Path("/proc/harness-reports"), "cannot create it"
    out = _run("-m", "harness", "run", "--kernels", "dot_product", "--cases", ONE_CASE,
               "--report-dir", str(target))
    _one_line(out, needle)
    merge = _run("-m", "harness", "merge", str(target), str(tmp_path))
    assert merge.returncode == 2 and "Traceback" not in merge.stderr
    pyt = _run("-m", "pytest", "-p", "no:cacheprovider", MATRIX, "--kernels", "dot_product",
               "--cases", ONE_CASE, "--report-dir", str(target))
    assert pyt.returncode == 4 and needle in pyt.stderr, pyt.stdout[-1000:] + pyt.stderr[-1000:]
    assert "Traceback" not in pyt.stderr


KERNEL = ("import harness\nfrom harness.kernels.reference import dot_product\n"
          "harness.register_kernel('mine', dot_product)\n")


def test_kernel_modules_by_any_name_folder_or_dotted_name(tmp_path):
    no_suffix = tmp_path / "kernels_conf"
    no_suffix.write_text(KERNEL)
    out = _run("-m", "harness", "list", "--kernel-module", str(no_suffix))
    assert out.returncode == 0 and "mine" in out.stdout, out.stderr[-2000:]
    _one_line(_run("-m", "harness", "list", "--kernel-module", str(tmp_path)), "a folder")
    pkg = tmp_path / "mypkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "kernels.py").write_text(KERNEL)
    out = _run("-m", "harness", "list", "--kernel-module", "mypkg.kernels",
               env={"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"})
    assert out.returncode == 0 and "mine" in out.stdout, out.stderr[-2000:]
    _one_line(_run("-m", "harness", "list", "--kernel-module", "nopkg.nomodule"),
              "no importable module")


def test_a_compilation_cache_that_is_a_file_and_a_repro_output_under_a_file(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    _one_line(_run("-m", "harness", "run", "--kernels", "dot_product", "--cases", ONE_CASE,
                   "--compilation-cache", str(afile), "--report-dir", str(tmp_path / "r")),
              "a file, not a folder")
    out = _run("-m", "harness", "repro", "canary_ignores_segments", ONE_CASE, "--output",
               str(afile / "repro.py"), timeout=60)
    _one_line(out, "is a file, not a folder")


# ----- smaller ------------------------------------------------------------------------------

def test_growth_must_be_a_factor_above_one(tmp_path):
    out = _run("-m", "harness", "compare", str(tmp_path), str(tmp_path), "--growth", "-1")
    _one_line(out, "--growth", "must be a finite factor above 1")


def test_a_kernel_with_the_wrong_signature_is_refused_when_registered(tmp_path):
    module = tmp_path / "bad_sig.py"
    module.write_text("import harness\ndef k(q, k, v):\n    return q\n"
                      "harness.register_kernel('bad_sig', k)\n")
    _one_line(_run("-m", "harness", "list", "--kernel-module", str(module)),
              "bad_sig.py:4", "cannot be called as fn(query, key, value, segment_ids")
    # A declared feature is a keyword the function must take (it erred on every window case).
    module.write_text("import harness\ndef k(q, k, v, seg, *, causal, scale, softcap=None):\n"
                      "    return q\nharness.register_kernel('no_window', k, "
                      "features=('softcap', 'window', 'head_dim_v'))\n")
    _one_line(_run("-m", "harness", "list", "--kernel-module", str(module)),
              "bad_sig.py:4", "causal, scale, softcap, window)",
              "unexpected keyword argument 'window'")
    # ... with a default: a case without the feature leaves its keyword out (every case
    # without a window erred, `missing 1 required keyword-only argument: 'window'`).
    module.write_text("import harness\ndef k(q, k, v, seg, *, causal, scale, window):\n"
                      "    return q\nharness.register_kernel('window_required', k, "
                      "features=('window',))\n")
    _one_line(_run("-m", "harness", "list", "--kernel-module", str(module)),
              "bad_sig.py:4", "keyword(s) window of signature", "have no default",
              "(window=None)")
    # ... unless its constraints may skip the cases without the feature.
    module.write_text("import harness\ndef k(q, k, v, seg, *, causal, scale, window):\n"
                      "    return q\nharness.register_kernel('window_only', k, "
                      "features=('window',), constraints=lambda case, platform: [] if "
                      "case.features.window else ['window cases only'])\n")
    out = _run("-m", "harness", "list", "--kernel-module", str(module))
    assert out.returncode == 0 and "window_only" in out.stdout, out.stdout + out.stderr


def test_merge_says_where_it_wrote_and_which_pairs_repeat(tmp_path):
    a = _report(tmp_path, "a", "--cases", ONE_CASE)
    shutil.copytree(a, tmp_path / "again")
    out = _run("-m", "harness", "merge", str(tmp_path / "m"), str(a), str(tmp_path / "again"))
    assert out.returncode == 0
    assert f"merged 2 reports into {tmp_path / 'm'}" in out.stdout
    assert "repeats 1 kernel x case pairs of an earlier source" in out.stderr


@pytest.mark.parametrize("command, options", [
    ("run", ["--report-dir", "default reports/latest", "--growth"]),
    ("list", ["--suite", "--cases", "--verbose"]),
    ("compare", ["--growth", "the report to judge"]),
    ("repro", ["--kernel-module", "a registered kernel name", "failing case's id"]),
])
def test_help_says_what_each_option_does(command, options):
    out = _run("-m", "harness", command, "--help")
    text = " ".join(out.stdout.split())
    for option in options:
        assert option in text, (command, option)
    assert "default reports/latest" in text or command != "run"


def test_console_grid_headers_stay_apart_and_outcomes_read_as_words(tmp_path):
    out = _run("-m", "harness", "run", "--kernels", "dot_product", "--no-leak-probe",
               "--cases", "unaligned/*-bf16-s0", "--report-dir", str(tmp_path / "r"))
    assert out.returncode == 0
    assert "unaligne…" not in out.stdout and "long-edges" in out.stdout and "odd" in out.stdout
    outcomes = next(line for line in out.stdout.splitlines() if line.startswith("outcomes:"))
    assert "{" not in outcomes and "ok " in outcomes


def test_the_example_kernels_pytest_line_runs_only_the_matrix():
    doc = (ROOT / "examples" / "my_kernel.py").read_text()
    line = next(x for x in doc.splitlines() if "pytest" in x)
    assert "cases/test_matrix.py" in line


def test_pytest_header_starts_when_the_run_started(tmp_path):
    out = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", MATRIX, "--kernels",
               "dot_product", "--cases", ONE_CASE, "--report-dir", str(tmp_path / "r"))
    assert out.returncode == 0, out.stdout[-2000:]
    header = json.loads((tmp_path / "r" / "report.jsonl").read_text().splitlines()[0])
    import datetime
    started = datetime.datetime.fromisoformat(header["environment"]["time_utc"])
    ended = datetime.datetime.fromtimestamp((tmp_path / "r" / "report.jsonl").stat().st_mtime,
                                            datetime.timezone.utc)
    assert (ended - started).total_seconds() >= header["wall_s"] - 2
    assert "SKIPPED" not in out.stdout


# ----- from a cold read of the change -------------------------------------------------------

def test_a_wrong_expectation_function_is_one_line_naming_the_kernel(tmp_path):
    module = tmp_path / "bad_expect.py"
    module.write_text("import harness\nfrom harness.kernels.reference import dot_product\n"
                      "harness.register_kernel('bad_expect', dot_product,\n"
                      "    expect=lambda case, check, segment: 'either')\n")
    out = _run("-m", "harness", "run", "--kernel-module", str(module), "--kernels", "bad_expect",
               "--cases", ONE_CASE, "--report-dir", str(tmp_path / "r"))
    _one_line(out, "kernel bad_expect: expect(case, 'leak'", "exact")


def test_two_kernel_modules_of_one_file_name_both_load(tmp_path):
    for folder, name in (("a", "ka"), ("b", "kb")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "kernels.py").write_text(KERNEL.replace("'mine'", f"'{name}'"))
    out = _run("-m", "harness", "list", "--kernel-module", str(tmp_path / "a" / "kernels.py"),
               "--kernel-module", str(tmp_path / "b" / "kernels.py"))
    assert out.returncode == 0 and "ka " in out.stdout and "kb " in out.stdout, out.stderr


def test_report_of_a_file_and_a_malformed_report_are_one_line(tmp_path):
    a = _report(tmp_path, "a", "--cases", ONE_CASE, "--no-leak-probe")
    _one_line(_run("-m", "harness", "report", str(a / "report.jsonl")), "give the report's folder")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"type": "run", "schema": 2, "environment": {}}\n{"type": "record"}\n')
    _one_line(_run("-m", "harness", "compare", str(a), str(broken)), "not a harness report")


def test_the_gate_holds_expected_passes_not_catches_or_rounding_level_checks():
    from harness.judge import regression
    from harness.judge.record import Record

    def rec(check, expected, outcome, err, ratio, verdict="pass"):
        return Record(kernel="k", case_id=ONE_CASE, check=check, verdict=verdict,
                      expected=expected, outcome=outcome, row=0, segment=1, max_abs_err=err,
                      ratio=ratio)
    caught = [rec("out", "fail", "caught", 1.0, 40.0, "fail")]
    grown = [rec("out", "fail", "caught", 2.5, 100.0, "fail")]
    assert not regression.compare(grown, caught).regressed, "a canary's error may grow"
    either = [rec("dk", "either", "unjudged", 0.01, 0.1)]
    assert not regression.compare([rec("dk", "either", "unjudged", 0.06, 0.6, "fail")],
                                  either).regressed, "a check left to the probe: rounding"
    held = [rec("dq", "pass", "ok", 0.01, 0.1)]
    assert regression.compare([rec("dq", "pass", "ok", 0.06, 0.6)], held).regressed
    skipped = [Record(kernel="k", case_id=ONE_CASE, check="*", verdict="skip", expected="pass",
                      outcome="skip")]
    assert regression.compare(skipped, skipped).compared_nothing


# ----- what a new user still hit (issue 34): each a one-line refusal before any work, or the
# ----- behaviour the user meant ---------------------------------------------------------------

SLOW_MODULE = '''
import time
import harness
from harness.sut.dot_product import dot_product

def slow(q, k, v, seg, *, causal, scale):
    time.sleep(float(__import__("os").environ.get("SLOW_S", "30")))   # while tracing
    return dot_product(q, k, v, seg, causal=causal, scale=scale)

harness.register_kernel("slow", slow, dtypes=("float32", "bfloat16"))
'''


def test_a_typo_in_one_of_several_globs_is_refused(tmp_path):
    globs = "packed/random-b4-t256-h4kv2*,unalgned/*"
    out = _run("-m", "harness", "run", "--kernels", "dot_product", "--cases", globs,
               "--report-dir", str(tmp_path / "r"))
    _one_line(out, "'unalgned/*' matches no case")
    assert not (tmp_path / "r").exists()
    pyt = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", MATRIX, "--kernels",
               "dot_product", "--cases", globs, f"--report-dir={tmp_path / 'p'}")
    assert pyt.returncode == 4 and "'unalgned/*' matches no case" in pyt.stderr, pyt.stderr


def _start_slow(tmp_path, report, **env):
    module = tmp_path / "slow.py"
    module.write_text(SLOW_MODULE)
    return subprocess.Popen([sys.executable, "-m", "harness", "run", "--kernel-module",
                             str(module), "--kernels", "slow", "--cases", ONE_CASE,
                             "--report-dir", str(report)], cwd=ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            env={**os.environ, **env})


def _wait_for(path, proc, timeout=120):
    import time
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)


def test_two_runs_on_one_report_folder_the_second_stops_at_once(tmp_path):
    first = _start_slow(tmp_path, tmp_path / "r")
    try:
        _wait_for(tmp_path / "r" / "report.jsonl", first)
        second = _run("-m", "harness", "run", "--kernels", "dot_product", "--cases", ONE_CASE,
                      "--report-dir", str(tmp_path / "r"))
        _one_line(second, "another run (pid", "is writing this report folder")
    finally:
        first.kill()
        first.communicate()


def test_a_run_killed_hard_says_incomplete_in_every_view(tmp_path):
    import signal
    run = _start_slow(tmp_path, tmp_path / "r")
    _wait_for(tmp_path / "r" / "report.jsonl", run)
    run.send_signal(signal.SIGKILL)   # what an OOM killer or a CI timeout does
    run.communicate()
    out = _run("-m", "harness", "report", str(tmp_path / "r"))
    assert out.returncode == 1, out.stdout[-2000:]
    assert "INCOMPLETE" in out.stdout
    summary = (tmp_path / "r" / "summary.md").read_text()
    assert "INCOMPLETE" in summary and "every kernel expected to pass passed" not in summary
    html = (tmp_path / "r" / "report.html").read_text()
    # A banner of its own at the top of the page (not markdown's ** in a plain line), and the
    # problems section does not read as a pass.
    assert '<p class="bad">INCOMPLETE' in html and "**INCOMPLETE" not in html
    assert "every kernel expected to pass passed" not in html
    # Killed while appending: the last line of each file cut short. Read past, not a
    # traceback nor "not a harness report".
    for name in ("report.jsonl", "traces.jsonl"):
        with (tmp_path / "r" / name).open("a") as f:
            f.write('{"type": "record", "kernel": "dot_pro')
    out = _run("-m", "harness", "report", str(tmp_path / "r"))
    assert out.returncode == 1 and "INCOMPLETE" in out.stdout, out.stdout[-2000:] + out.stderr
    assert "Traceback" not in out.stderr and "not a harness report" not in out.stderr


def test_a_report_of_a_run_stopped_by_the_user_is_not_a_pass_to_report_or_merge(tmp_path):
    """`harness report` and `harness merge` of a run stopped by the user (Ctrl-C, SIGTERM: its
    header says interrupted) exit 1, as the views say "not a pass", whatever finished was clean
    (they exited 0 before: only a killed run's 'running' counted)."""
    from harness.store import report_file as rec
    full = _report(tmp_path, "full", "--cases", ONE_CASE)
    header, records = rec.read(full)
    assert records and not any(r.bad for r in records)
    stopped = tmp_path / "stopped" / "report.jsonl"
    rec.write_report(stopped, header["environment"], records,
                     **{k: v for k, v in header.items() if k not in ("type", "schema",
                                                                     "environment", "state")},
                     state="interrupted", interrupted=True)
    out = _run("-m", "harness", "report", str(stopped.parent))
    assert out.returncode == 1 and "interrupted" in out.stdout, out.stdout[-2000:]
    out = _run("-m", "harness", "merge", str(tmp_path / "joined"), str(full), str(stopped.parent))
    assert out.returncode == 1, out.stdout[-2000:] + out.stderr[-2000:]
    assert "interrupted" in (tmp_path / "joined" / "summary.md").read_text()
    out = _run("-m", "harness", "report", str(full))
    assert out.returncode == 0, out.stdout[-2000:]


def test_pytest_report_dir_outside_the_repo_as_two_words(tmp_path):
    where = tmp_path / "x1"
    args = ("-m", "pytest", "-n", "2", "-p", "no:cacheprovider", "--report-dir", str(where),
            "-k", "nothing_zzz")
    first = _run(*args)
    text = first.stdout + first.stderr
    assert "node down" not in text and "Traceback" not in text, text[-3000:]
    assert first.returncode == 5, text[-2000:]     # no test matched -k: pytest's own status
    again = _run(*args)
    assert again.returncode == 4, again.stdout[-2000:] + again.stderr[-2000:]
    assert f"write --report-dir={where}" in again.stdout + again.stderr
    assert "unrecognized arguments" not in again.stdout + again.stderr


def test_the_census_on_a_cpu_runs_the_smoke_suite_and_writes_no_committed_folder():
    from harness.tools.census.options import DEFAULT_REPORT_DIR
    out = _run("-m", "harness", "census", "--help")
    assert "nightly on a GPU, smoke on a CPU" in " ".join(out.stdout.split())
    assert DEFAULT_REPORT_DIR == "reports/census-latest"
    ignore = (ROOT / ".gitignore").read_text()
    assert "!/reports/census-latest" not in ignore and "/reports/*" in ignore


def test_the_nightly_suite_on_a_cpu_is_refused_unless_narrowed(tmp_path):
    out = _run("-m", "harness", "run", "--suite", "nightly", "--report-dir", str(tmp_path / "r"))
    _one_line(out, "sized for a GPU", "--suite smoke")
    listing = _run("-m", "harness", "list", "--suite", "nightly")
    assert listing.returncode == 0 and "note: the nightly suite is sized for a GPU" in listing.stderr
    # pytest's matrix: the same refusal, before collecting anything.
    pyt = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", MATRIX, "--suite", "nightly",
               "--report-dir", str(tmp_path / "p"))
    assert pyt.returncode == 4 and "sized for a GPU" in pyt.stderr, pyt.stderr[-2000:]
    assert "Traceback" not in pyt.stderr
    # Narrowed (to one kernel, which then runs for most of an hour): a note first. (Here its
    # one case dealt into an empty shard, so that it stops there, before any work.)
    narrowed = _run("-m", "harness", "run", "--suite", "nightly", "--kernels", "dot_product",
                    "--cases", "packed/random-b4-t2048-h8kv2-d128-bf16-s0", "--shard", "2/2",
                    "--report-dir", str(tmp_path / "n"))
    assert narrowed.stderr.startswith("note: the nightly suite is sized for a GPU")
    assert "this shard holds no case" in narrowed.stderr
    pyt = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", MATRIX, "--suite", "nightly",
               "--kernels", "dot_product", "--collect-only", "--report-dir", str(tmp_path / "q"))
    assert "note: the nightly suite is sized for a GPU" in pyt.stderr + pyt.stdout
    # The census asked for the nightly suite on a CPU: the same refusal.
    census = _run("-m", "harness", "census", "--suite", "nightly", "--report-dir",
                  str(tmp_path / "c"))
    _one_line(census, "sized for a GPU", "--suite smoke")


def test_a_backend_that_cannot_start_is_one_line(tmp_path):
    env = {"JAX_PLATFORMS": "cuda"}
    for args in (("run", "--kernels", "dot_product", "--report-dir", str(tmp_path / "r")),
                 ("list",)):
        out = _run("-m", "harness", *args, env=env)
        _one_line(out, "jax cannot start its backend (JAX_PLATFORMS=cuda)")
        # jax's bare AssertionError comes with what it usually means.
        assert "jax's plugin for it" in out.stderr
    assert not (tmp_path / "r").exists()     # found before the report folder was made
    pyt = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", MATRIX, "--kernels",
               "dot_product", env=env)
    assert pyt.returncode == 4 and "jax cannot start its backend" in pyt.stderr, pyt.stderr[-2000:]


def test_output_paths_are_checked_before_the_work(tmp_path):
    out = _run("-m", "harness", "bench", "--output", str(tmp_path))
    _one_line(out, "a folder; give a file name")
    (tmp_path / "run").mkdir()
    out = _run("-m", "harness", "baseline", str(tmp_path / "run"), str(tmp_path / "run"))
    _one_line(out, "a folder; give the baseline's file name")


@pytest.mark.parametrize("args, said", [
    (("--kernels", ""), "names no kernel"),
    (("--kernels", "dot_product,dot_product"), "dot_product named twice"),
    (("--report-dir", ""), "an empty path"),
    (("--growth", "inf"), "must be a finite factor above 1"),
    (("--shard", "9/9", "--cases", ONE_CASE), "this shard holds no case"),
])
def test_empty_repeated_and_unbounded_values_are_refused(tmp_path, args, said):
    full = ("--report-dir", str(tmp_path / "r"), *args) if "--report-dir" not in args else args
    _one_line(_run("-m", "harness", "run", *full), said)


def test_compare_and_baseline_refuse_what_cannot_be_compared(tmp_path):
    a = _report(tmp_path, "a", "--cases", ONE_CASE)
    b = _report(tmp_path, "b", "--cases", "packed/many-b4-t256-h4kv4-d32-f32-s0")
    _one_line(_run("-m", "harness", "compare", str(a), str(a)), "the same report twice")
    shutil.copytree(a, tmp_path / "copy")       # a copy is the same run under another name
    _one_line(_run("-m", "harness", "compare", str(tmp_path / "copy"), str(a)),
              "one run twice (identical headers")
    made = _run("-m", "harness", "baseline", str(tmp_path / "base.jsonl.gz"), str(a), str(b))
    _one_line(made, "selected other cases")
    assert _run("-m", "harness", "baseline", str(tmp_path / "base.jsonl.gz"),
                str(a)).returncode == 0
    _one_line(_run("-m", "harness", "compare", str(tmp_path / "base.jsonl.gz"), str(a)),
              "a baseline file", "given as the new report")


def test_without_the_leak_probe_the_canary_checks_it_judges_did_not_run(tmp_path):
    from harness.store import report_file as rec
    out = _run("-m", "harness", "run", "--kernels", "canary_ignores_segments", "--cases",
               ONE_CASE, "--no-leak-probe", "--report-dir", str(tmp_path / "r"))
    assert out.returncode == 0, out.stdout[-2000:]
    _, records = rec.read(tmp_path / "r")
    assert not [r for r in records if r.outcome == "missed"]
    assert [r for r in records if r.outcome == "not run"]
    assert "not run (left to the leak probe, which was off" in out.stdout


def test_merging_reports_of_two_suites_says_so(tmp_path):
    a = _report(tmp_path, "a", "--cases", ONE_CASE)
    b = _report(tmp_path, "b", "--suite", "nightly", "--cases",
                "packed/random-b4-t1024-h8kv8-d64-bf16-s1")
    out = _run("-m", "harness", "merge", str(tmp_path / "m"), str(a), str(b))
    assert "merging reports of different suites" in out.stderr
    summary = (tmp_path / "m" / "summary.md").read_text()
    assert "suites `nightly`, `smoke`" in summary and "['" not in summary.splitlines()[2]


def test_smaller_mistakes_are_named(tmp_path):
    bad = tmp_path / "upper.py"
    bad.write_text("import harness\nharness.register_kernel('u', lambda q, k, v, s, *, causal, "
                   "scale: q, devices=('CPU',))\n")
    _one_line(_run("-m", "harness", "run", "--kernel-module", str(bad)), "'CPU' is not a jax "
              "platform name")
    cache = tmp_path / "cache-file"
    cache.write_text("")
    _one_line(_run("-m", "harness", "run", "--kernels", "dot_product", "--cases", ONE_CASE,
                   "--report-dir", str(tmp_path / "r"),
                   env={"HARNESS_COMPILATION_CACHE": str(cache)}),
              f"HARNESS_COMPILATION_CACHE {cache}: a file")
    (tmp_path / "empty").mkdir()
    out = _run("-m", "harness", "report", str(tmp_path / "empty"))
    _one_line(out, "no report.jsonl in it")
    assert "report.jsonl(.gz) file" not in out.stderr
    pyt = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist", MATRIX,
               "--kernels", "dot_product", "--cases", ONE_CASE, "--no-leak-probe",
               f"--report-dir={tmp_path / 'p'}")
    assert pyt.returncode == 0 and "Unknown pytest.mark" not in pyt.stdout + pyt.stderr


def test_pytest_names_a_declaration_that_raises_as_its_pairs_error(tmp_path):
    """In pytest a kernel's expect or expect_error that raises is its pair's error, naming the
    mistake, red (the pair read "no record ... its worker ended without a word", and an
    expect_error that raised crashed pytest's end with a traceback); the CLI stops the run on
    it (test_isolation_names_and_declarations_are_checked_in_one_line)."""
    for i, (extra, needle) in enumerate((
            ("expect=lambda case, check, segment: {'out': 'pass'}[check]",
             "kernel mine: expect(case, 'dq', r0s1) raised on"),
            ("expect_error=lambda case: case.nope", "kernel mine: expect_error(case) raised on"))):
        module = tmp_path / f"mine{i}.py"
        module.write_text("import harness\nfrom harness.kernels.reference import dot_product\n"
                          f"harness.register_kernel('mine', dot_product, {extra})\n")
        report = tmp_path / f"r{i}"
        out = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", MATRIX, "--suite", "smoke",
                   "--kernel-module", str(module), "--kernels", "mine", "--cases", ONE_CASE,
                   f"--report-dir={report}")
        text = out.stdout + out.stderr
        assert out.returncode == 1 and "Traceback" not in text, text[-3000:]
        header = json.loads((report / "report.jsonl").read_text().splitlines()[0])
        records = [json.loads(x) for x in (report / "report.jsonl").read_text().splitlines()[1:]]
        assert header["state"] == "finished"
        assert [(r["verdict"], r["outcome"]) for r in records] == [("error", "error")], records
        assert needle in records[0]["message"] and needle in text


def test_a_pytest_run_narrowed_by_k_says_so_in_its_report(tmp_path):
    """pytest's -k narrows the matrix's pairs: the report's run line says how many of its
    kernel x case pairs were selected (it read as the whole selection: green, cases 21)."""
    report = tmp_path / "r"
    out = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", MATRIX, "--suite", "smoke",
               "--kernels", "dot_product", "--cases", "packed/random-b4-t256-*",
               "-k", ONE_CASE.split("/")[1], f"--report-dir={report}")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    header = json.loads((report / "report.jsonl").read_text().splitlines()[0])
    assert header["pairs_selected"] == 1 < header["cases"], header
    line = (report / "summary.md").read_text()
    assert f"1 of its {header['cases']} kernel x case pairs selected (pytest's -k" in line
    whole = tmp_path / "w"
    out = _run("-m", "harness", "run", "--kernels", "dot_product", "--cases", ONE_CASE,
               "--report-dir", str(whole))
    assert "pairs selected" not in (whole / "summary.md").read_text()
