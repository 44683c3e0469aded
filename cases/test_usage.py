"""What a new user hits: every mistake is one line naming the problem, found before any work;
outside kernels work whatever flags library they use; the views and parts are where they say."""
import os
import subprocess
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
MATRIX = str(ROOT / "cases" / "test_matrix.py")
ONE_CASE = "packed/random-b4-t256-h4kv2-d64-bf16-s0"


def _run(*args, cwd=ROOT, env=None, timeout=600):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def _one_line_error(out, *needles):
    text = out.stdout + out.stderr
    assert "Traceback" not in text and "INTERNALERROR" not in text, text[-3000:]
    errors = [line for line in text.splitlines() if "error" in line.lower()]
    assert errors, text[-2000:]
    assert all(n in text for n in needles), text[-2000:]


BROKEN = "import harness\ndef k(q, k, v, seg, *, causal, scale)\n    return q\n"


@pytest.mark.parametrize("args, needles", [
    (["--kernel-module", "/no/such/kernels.py"], ["/no/such/kernels.py", "no such file"]),
    (["--kernels", "dot_product,nope"], ["unknown kernel nope", "harness list"]),
    (["--cases", "packed/nothing-*"], ["'packed/nothing-*' matches no case", "list --suite smoke -v"]),
    (["--suite", "weekly"], ["unknown suite 'weekly'"]),
    (["--baseline", "/no/such/baseline.jsonl"], ["baseline /no/such/baseline.jsonl"]),
    (["--shard", "3/2"], ["--shard '3/2'"]),
])
def test_cli_mistakes_are_one_line_before_any_work(tmp_path, args, needles):
    out = _run("-m", "harness", "run", *args, "--report-dir", str(tmp_path / "r"))
    assert out.returncode == 2
    _one_line_error(out, *needles)
    assert not (tmp_path / "r").exists(), "no work started"


@pytest.mark.parametrize("args, needles", [
    (["--kernel-module", "/no/such/kernels.py"], ["/no/such/kernels.py", "no such file"]),
    (["--kernels", "dot_product,nope"], ["unknown kernel nope"]),
    (["--cases", "packed/nothing-*"], ["'packed/nothing-*' matches no case"]),
    (["--baseline", "/no/such/baseline.jsonl"], ["baseline /no/such/baseline.jsonl"]),
])
def test_pytest_mistakes_are_one_line_and_not_green(tmp_path, args, needles):
    out = _run("-m", "pytest", "-p", "no:cacheprovider", MATRIX, *args,
               "--report-dir", str(tmp_path / "r"))
    assert out.returncode not in (0, 5), out.stdout[-2000:]
    _one_line_error(out, *needles)


def test_a_broken_kernel_module_is_one_line_in_cli_and_pytest(tmp_path):
    module = tmp_path / "broken.py"
    module.write_text(BROKEN)
    cli = _run("-m", "harness", "list", "--kernel-module", str(module))
    assert cli.returncode == 2
    _one_line_error(cli, "broken.py:2: SyntaxError")
    raising = tmp_path / "raising.py"
    raising.write_text("import harness\nraise RuntimeError('no GPU here')\n")
    cli = _run("-m", "harness", "list", "--kernel-module", str(raising))
    assert cli.returncode == 2
    _one_line_error(cli, "raising.py:2: RuntimeError: no GPU here")
    pyt = _run("-m", "pytest", "-p", "no:cacheprovider", MATRIX, "--kernel-module", str(module),
               "--report-dir", str(tmp_path / "r"))
    assert pyt.returncode not in (0, 5)
    _one_line_error(pyt, "broken.py:2: SyntaxError")


ABSL_KERNEL = """
import sys
import harness
from absl import flags
from harness.kernels.reference import dot_product

flags.DEFINE_integer("block_q", 64, "a tuning flag the library reads")
FLAGS = flags.FLAGS

def reads_flag(q, k, v, seg, *, causal, scale):
    assert FLAGS.block_q == 64          # UnparsedFlagAccessError without parsed flags
    return dot_product(q, k, v, seg, causal=causal, scale=scale)

def parses_argv(q, k, v, seg, *, causal, scale):
    if not FLAGS.is_parsed():
        FLAGS(sys.argv)                 # the harness's own options are not its flags
    return dot_product(q, k, v, seg, causal=causal, scale=scale)

harness.register_kernel("absl_reads", reads_flag)
harness.register_kernel("absl_parses", parses_argv)
"""


def test_a_kernel_reading_absl_flags_runs_under_cli_and_pytest(tmp_path):
    pytest.importorskip("absl")
    module = tmp_path / "absl_kernel.py"
    module.write_text(ABSL_KERNEL)
    cli = _run("-m", "harness", "run", "--kernel-module", str(module),
               "--kernels", "absl_reads,absl_parses", "--cases", ONE_CASE,
               "--report-dir", str(tmp_path / "cli"))
    assert cli.returncode == 0, cli.stdout[-2000:] + cli.stderr[-2000:]
    pyt = _run("-m", "pytest", "-p", "no:cacheprovider", MATRIX, "--kernel-module", str(module),
               "--kernels", "absl_reads,absl_parses", "--cases", ONE_CASE,
               "--report-dir", str(tmp_path / "pyt"))
    assert pyt.returncode == 0, pyt.stdout[-2000:]
    assert "2 passed" in pyt.stdout


def test_a_nested_pytest_leaves_the_outer_runs_parts_alone(tmp_path):
    """The README's test command runs a nested pytest (test_registry); it used to delete the
    outer run's part files, so the outer run wrote no report."""
    outer = tmp_path / "reports" / "parts" / "outer-run"
    outer.mkdir(parents=True)
    (outer / "gw0.jsonl").write_text('{"type": "record"}\n')
    out = _run("-m", "pytest", "-p", "no:cacheprovider", MATRIX, "--kernels", "dot_product",
               "--cases", ONE_CASE, "--report-dir", str(tmp_path / "reports"))
    assert out.returncode == 0, out.stdout[-2000:]
    assert (outer / "gw0.jsonl").read_text() == '{"type": "record"}\n'
    assert (tmp_path / "reports" / "report.jsonl").exists()
    # Alone in its folder, a run takes its parts away and parts/ with them (it used to leave
    # an empty parts/ in every report folder pytest wrote).
    alone = _run("-m", "pytest", "-p", "no:cacheprovider", MATRIX, "--kernels", "dot_product",
                 "--cases", ONE_CASE, "--report-dir", str(tmp_path / "alone"))
    assert alone.returncode == 0, alone.stdout[-2000:]
    assert (tmp_path / "alone" / "report.jsonl").exists()
    assert not (tmp_path / "alone" / "parts").exists()


def test_compare_takes_folders_and_warns_when_not_like_for_like(tmp_path):
    from harness.store import report_file as rec
    a = _run("-m", "harness", "run", "--kernels", "dot_product", "--cases", ONE_CASE,
             "--report-dir", str(tmp_path / "a"))
    assert a.returncode == 0, a.stderr[-2000:]
    again = _run("-m", "harness", "run", "--kernels", "dot_product", "--cases", ONE_CASE,
                 "--report-dir", str(tmp_path / "a2"))
    assert again.returncode == 0, again.stderr[-2000:]
    same = _run("-m", "harness", "compare", str(tmp_path / "a2"), str(tmp_path / "a"))
    assert same.returncode == 0 and "no regression" in same.stdout
    assert "warning" not in same.stdout
    header, records = rec.read(tmp_path / "a")
    other = tmp_path / "other.jsonl"
    rec.write_header(other, {**header["environment"], "device_kind": "NVIDIA H200",
                             "platform": "gpu"}, suite="nightly")
    rec.append(other, records)
    warned = _run("-m", "harness", "compare", str(tmp_path / "a"), str(other))
    assert warned.returncode == 0
    assert "warning: not like for like (suite 'smoke' vs the baseline's 'nightly'" in warned.stdout
    empty = tmp_path / "empty"
    empty.mkdir()
    missing = _run("-m", "harness", "compare", str(tmp_path / "a"), str(empty))
    assert missing.returncode == 2
    _one_line_error(missing, "a folder without report.jsonl")


def test_list_into_a_closed_pipe_is_quiet():
    out = subprocess.run(f"{sys.executable} -m harness list --suite nightly -v | head -n 1",
                         shell=True, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.stdout.count("\n") == 1 and "BrokenPipe" not in out.stderr, out.stderr


def test_help_lists_every_command():
    out = _run("-m", "harness", "--help")
    for command in ("run", "list", "report", "merge", "compare", "baseline", "bench", "selftest",
                    "repro", "census"):
        assert command in out.stdout


def test_a_run_says_when_it_replaces_a_report(tmp_path):
    args = ("-m", "harness", "run", "--kernels", "dot_product", "--cases", ONE_CASE,
            "--report-dir", str(tmp_path / "r"))
    assert "replacing" not in _run(*args).stderr
    assert "replacing the report in" in _run(*args).stderr


def test_a_run_stopped_by_sigterm_keeps_its_report(tmp_path):
    import signal
    import time
    from harness.store import report_file as rec
    proc = subprocess.Popen([sys.executable, "-m", "harness", "run", "--kernels", "dot_product",
                             "--report-dir", str(tmp_path / "r")], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    report = tmp_path / "r" / "report.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not report.exists() or report.read_text().count("\n") < 3):
        time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 130, err[-2000:]
    header, records = rec.read(tmp_path / "r")
    assert header["interrupted"] and records and "wall_s" in header
    assert "interrupted" in (tmp_path / "r" / "summary.md").read_text()


def test_the_readme_commands_script_answers_help_and_refuses_what_it_does_not_know():
    """`--help` prints its usage and runs no block; an unknown option is a usage error (it ran
    every block before, taking --help for no option at all)."""
    script = [sys.executable, str(ROOT / "scripts" / "readme_commands.py")]
    helped = subprocess.run([*script, "--help"], capture_output=True, text=True, timeout=60)
    assert helped.returncode == 0 and "--python312" in helped.stdout, helped.stdout
    assert "$ " not in helped.stdout, "a block ran"
    wrong = subprocess.run([*script, "--bogus"], capture_output=True, text=True, timeout=60)
    assert wrong.returncode == 2 and "unrecognized arguments: --bogus" in wrong.stderr
    assert not wrong.stdout


def test_every_command_block_runs_in_ci_or_says_why_not():
    """README.md and docs/*.md: every ```sh block runs in CI as written, or says why not (it
    needs a GPU, or CI's Python 3.12 stage runs it); the two commands run first, by name."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from readme_commands import all_blocks
    found = all_blocks()
    assert {page for page, _, _ in found} >= {"README.md", "docs/kernels.md"}
    skipped = [why for _, _, why in found if why is not None]
    assert all(why for why in skipped)
    assert all(why.startswith(("needs a GPU", "CI's first stage", "<!-- CI's Python 3.12"))
               for why in skipped), skipped
    first = [why for _, _, why in found if why and why.startswith("CI's first stage")]
    assert first == ["CI's first stage runs it (--run main-job)",
                     "CI's first stage runs it (--run test-command)"], first
    ci = (ROOT / ".ci" / "run").read_text()
    assert "readme_commands.py --run main-job" in ci and "readme_commands.py --run test-command" in ci
    assert "python3 scripts/readme_commands.py\n" in ci and "readme_commands.py --python312" in ci
    text = "\n".join(c for _, c, _ in found)
    for path in ("examples/my_kernel.py", "constraints/maxtext.txt", "reports/baselines/h200.jsonl.gz"):
        if path in text:
            assert (ROOT / path).exists(), f"a page names {path}, which does not exist"
    assert "python3 -m pytest -n 2" in text, "the README's test command, which CI runs"
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 250, "the README is read in five minutes"
    for link in re.findall(r"\]\((docs/[\w.-]+\.md|reports/README\.md)", readme):
        assert (ROOT / link).exists(), f"the README points to {link}, which does not exist"



def test_the_reports_check_names_a_folder_git_does_not_have_or_nobody_lists(tmp_path):
    """scripts/reports_listed.py (CI runs it on the tree): the folders reports/README.md lists
    are the ones git tracks, and reports/ is small. Here on a throwaway repository, so that no
    test reads the committed reports."""
    def git(*args):
        subprocess.run(["git", *args], cwd=tmp_path, check=True, capture_output=True)

    def check():
        return subprocess.run([sys.executable, str(ROOT / "scripts" / "reports_listed.py"),
                               str(tmp_path)], capture_output=True, text=True)
    git("init", "-q")
    (tmp_path / "reports" / "a-h200").mkdir(parents=True)
    (tmp_path / "reports" / "a-h200" / "README.md").write_text("a")
    (tmp_path / "reports" / "README.md").write_text(
        "| folder | claim |\n|---|---|\n| `a-h200/` | a claim |\n| `b-cpu/` | another |\n")
    git("add", "reports")
    out = check()
    assert out.returncode == 1 and "not in git: ['b-cpu']" in out.stderr
    (tmp_path / "reports" / "b-cpu").mkdir()
    (tmp_path / "reports" / "b-cpu" / "big.bin").write_bytes(b"0" * 10_000_001)
    (tmp_path / "reports" / "c").mkdir()
    (tmp_path / "reports" / "c" / "x").write_text("x")
    git("add", "reports")
    out = check()
    assert out.returncode == 1 and "not listed in reports/README.md: ['c']" in out.stderr
    assert "more than 10 MB" in out.stderr
    (tmp_path / "reports" / "b-cpu" / "big.bin").write_bytes(b"0")
    git("rm", "-q", "-r", "--cached", "reports/c")
    out = check()
    assert out.returncode == 0 and "2 folders, each listed and in git" in out.stdout


def test_pytest_stopped_by_sigterm_says_interrupted_and_leaves_no_earlier_views(tmp_path):
    """pytest's run on SIGTERM (`timeout`, a CI cancel) stops as the CLI's does: interrupted,
    its views written from what finished. A run killed before its end leaves no views: an
    earlier run's green summary.md stood beside a header that said running."""
    import signal
    import time
    from harness.store import report_file as rec
    report_dir = tmp_path / "r"
    report_dir.mkdir()
    for name in ("summary.md", "report.html"):
        (report_dir / name).write_text("outcomes: ok 59 (an earlier run's)")
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                             "cases/test_matrix.py", "--suite", "smoke", "--kernels",
                             "dot_product", f"--report-dir={report_dir}"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    report = report_dir / "report.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not report.exists():
        time.sleep(0.2)
    # Begun: the header says running, and the earlier run's views are gone.
    assert rec.read_header(report_dir)["state"] == "running"
    assert not (report_dir / "summary.md").exists() and not (report_dir / "report.html").exists()
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 2, out[-2000:] + err[-2000:]   # pytest's "interrupted"
    header = rec.read_header(report_dir)
    assert header["state"] == "interrupted", header
    assert "interrupted" in (report_dir / "summary.md").read_text()


TERM_IN_GC = """
import gc, os, signal
import harness
from harness.kernels.reference import dot_product

sent = []

def _term(phase, info):   # SIGTERM arrives while Python runs a garbage-collection callback
    if phase == "start" and not sent:
        sent.append(1)
        os.kill(os.getpid(), signal.SIGTERM)

def expect(case, check, segment):
    if not sent and os.environ.get("TERM_IN_GC"):
        gc.callbacks.append(_term)
        gc.collect()
        gc.callbacks.remove(_term)
    return "pass"

harness.register_kernel("term_in_gc", dot_product, dtypes=("float32",), expect=expect)
"""


@pytest.mark.parametrize("front", ["cli", "pytest"])
def test_a_sigterm_python_drops_in_a_gc_callback_still_stops_the_run(tmp_path, front):
    """CI's SIGTERM landed while jax's garbage-collection callback ran: Python printed the
    KeyboardInterrupt as 'ignored' and the run went on to its end, exit 0. The request is kept
    and the run stops at the next pair, interrupted (CLI 130, pytest 2)."""
    import os
    from harness.store import report_file as rec
    module = tmp_path / "kernels.py"
    module.write_text(TERM_IN_GC)
    cases = "packed/random-b4-t256-h4kv4-d32-f32-s0,unaligned/odd-b4-t256-h4kv4-d32-f32-s0"
    common = ["--kernel-module", str(module), "--kernels", "term_in_gc", "--cases", cases,
              f"--report-dir={tmp_path / 'r'}", "--no-leak-probe"]
    command = ["-m", "harness", "run", *common] if front == "cli" else \
        ["-m", "pytest", "-q", "-p", "no:cacheprovider", "cases/test_matrix.py", *common]
    out = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, env={**os.environ, "TERM_IN_GC": "1"})
    assert out.returncode == (130 if front == "cli" else 2), out.stdout[-2000:] + out.stderr[-2000:]
    header, records = rec.read(tmp_path / "r")
    assert header["state"] == "interrupted"
    # Not run on to its end (the signal's exception, where Python raised it after the callback
    # returned, stops the pair it came in).
    assert len({r.case_id for r in records}) < 2
