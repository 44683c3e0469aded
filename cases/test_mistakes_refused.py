"""Mistakes a user made in a cold review of the CLI, each refused in one line before it could
overwrite a report, wreck a run still writing its folder, or let a fallback pass as a fused
kernel. Each test failed before its fix."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from harness.errors import UsageError
from harness.kernels.kernel import Kernel
from harness.kernels.reference import dot_product

ROOT = Path(__file__).resolve().parent.parent
ONE_CASE = "packed/random-b4-t256-h4kv2-d64-bf16-s0"


def _run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def _refused(out, *needles):
    text = out.stdout + out.stderr
    assert out.returncode == 2, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert all(n in text for n in needles), text[-2000:]


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> Path:
    """A small finished run (probe off: these tests are about the files, not the checks)."""
    folder = tmp_path_factory.mktemp("runs") / "a"
    out = _run("run", "--kernels", "dot_product", "--cases", ONE_CASE, "--no-leak-probe",
               "--report-dir", str(folder))
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return folder


def test_baseline_and_merge_never_overwrite_their_own_sources(report, tmp_path):
    src = tmp_path / "a"
    shutil.copytree(report, src)
    before = (src / "report.jsonl").read_bytes()
    _refused(_run("baseline", str(src / "report.jsonl"), str(src), str(report)),
             "would be overwritten")
    _refused(_run("merge", str(src), str(src), str(report)), "would be overwritten")
    assert (src / "report.jsonl").read_bytes() == before
    _refused(_run("merge", str(tmp_path / "m"), str(src), str(src / "report.jsonl")),
             "given twice")
    base = tmp_path / "base.jsonl"
    assert _run("baseline", str(base), str(src), str(report)).returncode == 0
    _refused(_run("merge", str(tmp_path / "m"), str(src), str(base)), "is a baseline")


def test_report_merge_and_baseline_wait_for_a_run_writing_the_folder(report, tmp_path):
    from harness.store.writer import FolderLock
    busy = tmp_path / "busy"
    shutil.copytree(report, busy)
    (busy / ".lock").unlink(missing_ok=True)
    before = (busy / "report.jsonl").read_bytes()
    with FolderLock(busy):    # a run writing it now
        _refused(_run("report", str(busy)), "report", "another run")
        _refused(_run("merge", str(busy), str(report)), "merge OUT", "another run")
        _refused(_run("baseline", str(busy / "base.jsonl"), str(report)), "baseline OUT",
                 "another run")
    assert (busy / "report.jsonl").read_bytes() == before
    assert not (busy / "base.jsonl").exists()
    assert _run("report", str(busy)).returncode == 0


def test_a_baseline_of_a_run_that_did_not_finish_is_refused_and_compare_warns(report,
                                                                             tmp_path):
    from harness.store import report_file as rec
    header, records = rec.read(report)
    killed = tmp_path / "killed" / "report.jsonl"
    rec.write_report(killed, header["environment"], records,
                     **{**{k: x for k, x in header.items()
                           if k not in ("type", "schema", "environment")}, "state": "running"})
    _refused(_run("baseline", str(tmp_path / "b.jsonl"), str(killed), str(report)),
             "is incomplete", "made of runs that finished")
    out = _run("compare", str(report), str(killed))
    assert "warning: the baseline is incomplete" in out.stdout, out.stdout


@pytest.mark.parametrize("declared, needle", [
    (dict(hlo_markers="te_fused_attn_forward_ffi"), "hlo_markers 'te_fused_attn_forward_ffi': "
                                                    "a tuple of names, not one string"),
    (dict(requires="jax"), "requires 'jax': a tuple of names"),
    (dict(head_dims=(-1,)), "head_dims (-1,): a tuple of positive whole numbers"),
    (dict(head_dims=(32.5,)), "head_dims (32.5,)"),
    (dict(seq_len_multiple=0), "seq_len_multiple 0: a positive whole number"),
    (dict(min_devices=0), "min_devices 0"),
    (dict(gqa="yes"), "gqa 'yes': True or False"),
    (dict(reproducible="no"), "reproducible 'no'"),
    (dict(output_dtype="float99"), "output_dtype 'float99'"),
])
def test_a_declaration_of_the_wrong_type_is_named_not_read_letter_by_letter(declared, needle):
    with pytest.raises(ValueError) as raised:
        Kernel("k", dot_product, **declared)
    assert needle in str(raised.value)


def test_register_kernel_names_the_kernel_and_a_lone_dtype_string():
    import harness
    with pytest.raises(ValueError, match="kernel 'k1': dtypes 'float32': a tuple of names"):
        harness.register_kernel("k1", dot_product, dtypes="float32")
    with pytest.raises(ValueError, match="kernel 'k2': hlo_markers 'x': a tuple of names"):
        harness.register_kernel("k2", dot_product, hlo_markers="x")


def test_a_kernel_module_that_exits_while_imported_is_named(tmp_path):
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nsys.exit(0)\n")
    out = _run("run", "--kernel-module", str(exits), "--kernels", "dot_product", "--cases",
               ONE_CASE, "--report-dir", str(tmp_path / "r"))
    _refused(out, "exits.py: it called sys.exit(0) while being imported")
    pyt = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(ROOT / "cases" / "test_matrix.py"), "--kernel-module", str(exits),
                          "--cases", ONE_CASE, "--report-dir", str(tmp_path / "p")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert pyt.returncode == 4 and "INTERNALERROR" not in pyt.stdout + pyt.stderr
    assert "exits.py: it called sys.exit(0)" in pyt.stdout + pyt.stderr


def test_pytest_dist_each_is_refused(tmp_path):
    """`-n 2 --dist each` ran every test on both workers and the report kept one worker's
    records of each pair: a kernel that failed on one worker read ok (an adversarial review)."""
    pyt = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          str(ROOT / "cases" / "test_matrix.py"), "-n", "2", "--dist", "each",
                          "--kernels", "dot_product", "--cases", ONE_CASE,
                          "--report-dir", str(tmp_path / "p")],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert pyt.returncode == 4 and "INTERNALERROR" not in pyt.stdout + pyt.stderr
    assert "--dist each runs every test on every worker" in pyt.stdout + pyt.stderr
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("args, needle", [
    (["bench", "--kernels", ""], "--kernels '': names no bench entry"),
    (["bench", "--kernels", ","], "--kernels ',': names no bench entry"),
    (["bench", "--kernels", "xla,xla"], "xla named twice"),
    (["selftest", "--bugs", ""], "--bugs '': names no zoo entry"),
    (["run", "--shard", "0_1/0_2"], "--shard '0_1/0_2': expected I/N"),
    (["run", "--shard", "01/3"], "--shard '01/3': expected I/N"),
    (["run", "--shard", "0/3"], "--shard '0/3': I must be between 1 and N"),
    (["run", "--seeds", "10000000000", "--cases", "nope*"], "--seeds 10000000000: must be 1 to"),
    # From an adversarial review of bad input: each was run as another value, read as all,
    # or answered with argparse's usage block or a traceback.
    (["run", "--seeds", "1_0"], "--seeds '1_0': not a whole number"),
    (["run", "--seeds", " 2"], "--seeds ' 2': not a whole number"),
    (["compare", "a", "b", "--growth", "1_000"], "--growth '1_000': not a number"),
    (["bench", "--repeats", "abc"], "--repeats 'abc': not a whole number"),
    (["census", "--without", ""], "--without '': names no kernel glob"),
    (["census", "--without", "te:*,,fa4:*"], "an empty name between commas"),
    (["repro", "", ONE_CASE], "an empty name"),
    (["merge", "", "x"], "merge '': an empty path"),
    (["report", " "], "report ' ': an empty path"),
    (["compare", "", "x"], "report '': an empty path"),
    (["baseline", "out.txt", "x"], "ending .jsonl or .jsonl.gz"),
    (["compare", "x"], "python -m harness compare: the following arguments are required"),
])
def test_smaller_mistakes_are_refused_not_read_as_all(args, needle):
    _refused(_run(*args), needle)


def test_an_empty_cache_variable_is_named_as_set(tmp_path):
    out = _run("run", "--kernels", "dot_product", "--cases", ONE_CASE, "--report-dir",
               str(tmp_path / "r"), env={"HARNESS_COMPILATION_CACHE": ""})
    _refused(out, "HARNESS_COMPILATION_CACHE '': an empty path")


def test_a_cache_folder_it_cannot_write_in_is_refused_before_any_work(tmp_path, monkeypatch):
    from harness.engine.compilation_cache import enable_compilation_cache
    cache = tmp_path / "cache"
    cache.mkdir()
    # Root writes anywhere: the write test is made to fail where it would be written.
    (cache / f".write-test-{os.getpid()}").mkdir()
    with pytest.raises(UsageError, match="--compilation-cache .*cache: cannot write in it"):
        enable_compilation_cache(str(cache))


def test_a_broken_report_line_is_named(report, tmp_path):
    """A finished report with a line cut in the middle (a copy that went wrong): the error
    names the line, not only the file."""
    from harness.store import report_file
    lines = (report / "report.jsonl").read_text().splitlines(keepends=True)
    broken = tmp_path / "report.jsonl"
    broken.write_text("".join(lines[:2]) + lines[2][:40] + "\n" + "".join(lines[3:]))
    with pytest.raises(UsageError, match=r"report\.jsonl: not a harness report \(line 3 is "
                                         r"not JSON: .* at column"):
        report_file.read(broken)


@pytest.mark.parametrize("command", [["run", "--kernels", "dot_product", "--cases", ONE_CASE],
                                     ["selftest"]])
def test_no_cache_beside_a_cache_folder_is_refused(command, tmp_path):
    """--no-compilation-cache with --compilation-cache DIR: which did the user mean? (The
    default folder alone beside --no-compilation-cache is no question.)"""
    _refused(_run(*command, "--no-compilation-cache", "--compilation-cache", str(tmp_path),
                  "--report-dir", str(tmp_path / "r")) if command[0] == "run" else
             _run(*command, "--no-compilation-cache", "--compilation-cache", str(tmp_path)),
             "--no-compilation-cache with --compilation-cache", "give one of them")
    assert not (tmp_path / "r").exists()


def test_census_table_only_refuses_options_it_would_ignore(tmp_path):
    """--table-only runs nothing: --kernels or --suite beside it read as honoured and were not
    (the table came out of the parts present, whatever they named)."""
    for extra in (["--kernels", "xla"], ["--suite", "smoke"], ["--no-bench"]):
        _refused(_run("census", "--table-only", "--report-dir", str(tmp_path), *extra),
                 "--table-only runs nothing", extra[0])
    # --report-dir is what it reads: never refused for that.
    out = _run("census", "--table-only", "--report-dir", str(tmp_path))
    _refused(out, "no parts/ folder")


def test_an_edited_report_is_refused_in_one_line(report, tmp_path):
    """From a cold review: a record edited to verdict fail beside outcome ok read green
    (`harness report` exit 0), an unknown outcome dropped out of the counts, a NaN error
    compared clean and a string error ended in a traceback."""
    import json
    lines = (report / "report.jsonl").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if '"verdict": "pass"' in line)
    for change in ({"verdict": "fail"}, {"outcome": "weird"}, {"max_abs_err": float("nan")},
                   {"max_abs_err": "big"}):
        edited = tmp_path / "-".join(map(str, change.values()))
        shutil.copytree(report, edited)
        row = {**json.loads(lines[at]), **change}
        (edited / "report.jsonl").write_text(
            "\n".join([*lines[:at], json.dumps(row), *lines[at + 1:]]) + "\n")
        _refused(_run("report", str(edited)), f"report.jsonl:{at + 1}:", "(edited?)")


def test_a_mistake_argparse_finds_is_one_line():
    out = _run("run", "--no-such-option")
    _refused(out, "unrecognized arguments: --no-such-option")
    assert len((out.stdout + out.stderr).strip().splitlines()) == 1, out.stderr


def test_register_kernel_refuses_a_name_no_selection_reaches_and_a_fn_it_cannot_call():
    import harness
    for name in ("", "a,b", " spaced "):
        with pytest.raises(ValueError, match="a name is non-empty text without commas"):
            harness.register_kernel(name, dot_product)
    # pytest escapes other characters in its ids, where its plugin finds each test's pair.
    for name in ("attn_\u00e9", "tab\there"):
        with pytest.raises(ValueError, match="a name is printable ASCII"):
            harness.register_kernel(name, dot_product)
    with pytest.raises(ValueError, match="kernel 'nc': fn 42 is not callable"):
        harness.register_kernel("nc", 42)


def test_a_report_it_cannot_read_or_write_is_named(report, tmp_path):
    """From an adversarial review: a header without its environment ended in a traceback in
    merge, report and compare; a folder with report.jsonl and report.jsonl.gz read one of them
    without a word; `harness report` of a folder it cannot write in raised OSError."""
    import gzip
    import json
    lines = (report / "report.jsonl").read_text().splitlines()
    for env in (None, "x"):
        edited = tmp_path / f"env-{env}"
        shutil.copytree(report, edited)
        head = {**json.loads(lines[0]), "environment": env}
        (edited / "report.jsonl").write_text("\n".join([json.dumps(head), *lines[1:]]) + "\n")
        for args in (["report", str(edited)], ["compare", str(edited), str(report)],
                     ["merge", str(tmp_path / f"m-{env}"), str(edited)]):
            _refused(_run(*args), "report.jsonl:1: its header")
    both = tmp_path / "both"
    shutil.copytree(report, both)
    with gzip.open(both / "report.jsonl.gz", "wt") as f:   # another report than the plain one
        f.write((tmp_path / "env-x" / "report.jsonl").read_text())
    _refused(_run("compare", str(both), str(report)), "holds both report.jsonl and "
             "report.jsonl.gz, which differ")
    _refused(_run("baseline", str(report / "report.jsonl.gz"), str(tmp_path / "env-x")),
             "a report folder's second report file")


def test_report_of_a_folder_it_cannot_write_in_is_refused(report, tmp_path, monkeypatch,
                                                         capsys):
    from harness import cli
    ro = tmp_path / "ro"
    shutil.copytree(report, ro)
    # Root writes anywhere: the write test is made to fail where it would be written.
    monkeypatch.setattr(os, "getpid", lambda: 4242)
    (ro / ".write-test-4242").mkdir()
    assert cli.main(["report", str(ro)]) == 2
    assert "the folder is not writable" in capsys.readouterr().err
