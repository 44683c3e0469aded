"""python -m harness census on the CPU: a tiny census in two parts (one of them split over
isolation groups), joined into one table whose verdicts are the records' own, with a reproducer
for a failing kernel and an error reproducer for a raising one that exit 1 with plain python."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.judge import tallies
from harness.judge.record import Record
from harness.tools.census.command import join_bench
from harness.tools.census.options import census_names
from harness.tools.census.table import COLUMNS, column_cell, padding_summary
from harness.store import report_file as rec

ROOT = Path(__file__).resolve().parent.parent
CASES = "packed/random-*-f32-*"          # two smoke cases: causal and bidirectional
PART_A = ("dot_product", "canary_ignores_segments", "xla")
PART_B = ("clash_a", "clash_b", "census_raises")

# Two "libraries" that cannot share a process (as flash-attn-jax and flash-attn3-jax), and a
# kernel that always raises (in group a: two groups, two child processes).
KERNELS = """
import sys, harness
from harness.kernels.reference import dot_product

def _load(group):
    owner = sys.modules.setdefault("_ffi_owner", type(sys)("_ffi_owner"))
    if getattr(owner, "group", group) != group:
        raise RuntimeError("Duplicate FFI handler registration for flash_mha_fwd")
    owner.group = group

def make(group):
    def kernel(q, k, v, seg, *, causal, scale):
        _load(group)
        return dot_product(q, k, v, seg, causal=causal, scale=scale)
    return kernel

def always_raises(q, k, v, seg, *, causal, scale):
    raise RuntimeError("census test: this kernel always raises")

for group in ("a", "b"):
    harness.register_kernel(f"clash_{group}", make(group), isolation=group,
                            dtypes=("float32", "bfloat16"))
harness.register_kernel("census_raises", always_raises, dtypes=("float32",), isolation="a")
"""


def _census(*args, timeout=400):
    return subprocess.run([sys.executable, "-m", "harness", "census", "--suite", "smoke",
                           "--repro-runs", "6", "--features", "none", *args], cwd=ROOT,
                          capture_output=True,
                          text=True, timeout=timeout)


@pytest.fixture(scope="module")
def census(tmp_path_factory):
    """Part a (one process: the suite, the bench on small shapes, a reproducer for the canary)
    and part b (two isolation groups: workers, and a child per group for the bench and the
    reproducers), written into one folder."""
    tmp = tmp_path_factory.mktemp("census")
    module = tmp / "census_kernels.py"
    module.write_text(KERNELS)
    out = tmp / "census"
    a = _census("--kernels", ",".join(PART_A), "--cases", CASES, "--shapes", "small",
                "--repeats", "1", "--part", "a", "--report-dir", str(out))
    assert a.returncode == 0, a.stdout[-3000:] + a.stderr[-3000:]
    b = _census("--kernels", ",".join(PART_B), "--cases", CASES, "--shapes", "small",
                "--repeats", "1", "--part", "b", "--report-dir", str(out),
                "--kernel-module", str(module))
    assert b.returncode == 0, b.stdout[-3000:] + b.stderr[-3000:]
    return out


def _table(census_dir):
    return json.loads((census_dir / "census.json").read_text())


def _records(census_dir, part):
    return rec.read(census_dir / "parts" / part / "nightly")[1]


def _plain_python(script: Path, cwd: Path):
    """The script run from an empty folder, with no PYTHONPATH into this checkout."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_two_parts_give_one_table_with_every_kernel_and_the_columns(census):
    table = _table(census)
    assert [r["kernel"] for r in table["rows"]] == [
        "dot_product", "xla", "canary_ignores_segments", "clash_a", "clash_b", "census_raises"]
    assert {r["kernel"]: r["part"] for r in table["rows"]} == {
        **{k: "a" for k in PART_A}, **{k: "b" for k in PART_B}}
    assert [p["name"] for p in table["parts"]] == ["a", "b"]
    keys = [c["key"] for c in table["columns"]]
    assert keys == [key for key, _, _ in COLUMNS] + ["d32"]
    md = (census / "census.md").read_text()
    assert ("| kernel | all cases | packed | unaligned | padded (before/between) | bidirectional "
            "| long rows (>= 8192) | float16 | GQA/MQA | forward mode (jvp) | head dim 32 |") in md
    for kernel in PART_A + PART_B:
        assert f"| `{kernel}` |" in md
    commit = table["parts"][0]["environment"]["git_commit"]
    assert commit and commit in md


def test_each_cell_is_the_worst_outcome_its_records_say(census):
    table = _table(census)
    records = _records(census, "a") + _records(census, "b")
    for row in table["rows"]:
        mine = [r for r in records if r.kernel == row["kernel"]]
        for key, _, keep in COLUMNS:
            cell, chosen = row["cells"][key], [r for r in mine if keep(r)]
            assert cell["worst"] == tallies.worst_outcome(chosen), (row["kernel"], key)
            assert cell["cases"] == len({r.case_id for r in chosen})
    rows = {r["kernel"]: r for r in table["rows"]}
    canary = [r for r in records if r.kernel == "canary_ignores_segments"]
    shown = "FAIL" if tallies.worst_outcome(canary) == "fail" else "caught"
    # The canary takes no feature: the smoke suite's feature cases are skips in its cells.
    assert rows["canary_ignores_segments"]["cells"]["packed"]["text"].startswith(f"{shown} 2")
    # Forward mode: dot_product and xla declare it (their jvp records), the canary does not.
    assert rows["dot_product"]["cells"]["forward"]["text"].startswith("ok ")
    assert rows["canary_ignores_segments"]["cells"]["forward"]["text"] == "—"
    assert rows["canary_ignores_segments"]["cells"]["bidirectional"]["text"].startswith(
        f"{shown} 1")
    assert rows["dot_product"]["cells"]["packed"]["text"] == "ok 2"
    assert rows["census_raises"]["cells"]["all"]["text"] == "ERROR 2"
    assert rows["dot_product"]["cells"]["float16"]["text"] == "—"     # no float16 case here
    md = (census / "census.md").read_text()
    assert "| `census_raises` | **ERROR 2** |" in md
    # The clashing kernels ran, each in a process of its own.
    assert rows["clash_a"]["cells"]["all"]["text"] == rows["clash_b"]["cells"]["all"]["text"] \
        == "ok 2"


def test_padding_backward_and_leak_power_come_from_the_records(census):
    rows = {r["kernel"]: r for r in _table(census)["rows"]}
    assert rows["dot_product"]["padding"]["text"].startswith("grads 0, out finite")
    canary = rows["canary_ignores_segments"]["padding"]
    assert "dk non-zero" in canary["text"] and canary["violations"]["dk"]["non-zero"] > 0
    assert rows["dot_product"]["backward"]["reproducible"] is True
    assert rows["dot_product"]["backward"]["detectable"] == {t: 0.0 for t in
                                                             ("out", "dq", "dk", "dv")}
    assert rows["census_raises"]["backward"]["text"] == "not probed"


def test_bench_times_and_xla_memory_at_both_shapes(census):
    table = _table(census)
    shapes = [s["key"] for s in table["bench_shapes"]]
    assert shapes == ["seed 2x256", "short 1x512"]
    rows = {r["kernel"]: r for r in table["rows"]}
    for kernel in ("dot_product", "xla", "clash_a", "clash_b"):
        for shape in shapes:
            cell = rows[kernel]["bench"][shape]
            assert cell["error"] is None and cell["median_ms"] > 0 and cell["useful_tflops"] > 0
            mem = cell["xla_memory"]
            assert mem["total"] == mem["temp"] + mem["arguments"] + mem["outputs"] > 0
    assert rows["census_raises"]["bench"]["seed 2x256"]["text"] == "skip"   # float32 only
    bench = json.loads((census / "parts" / "b" / "bench.json").read_text())
    assert sorted(bench["groups"]) == ["a", "b"] and not bench["errors"]
    assert "peak memory (XLA: temp + args + outputs)" in (census / "census.md").read_text()


def test_a_failing_kernel_gets_a_repro_script_that_exits_1(census, tmp_path):
    script = census / "repro" / "canary_ignores_segments.py"
    row = next(r for r in _table(census)["rows"] if r["kernel"] == "canary_ignores_segments")
    assert row["repro"] == ["repro/canary_ignores_segments.py"]
    done = _plain_python(script, tmp_path / "run")
    assert done.returncode == 1, done.stdout + done.stderr
    assert any(line.startswith("FAILED:") for line in done.stdout.splitlines())
    report = (census / "repro" / "canary_ignores_segments.md").read_text()
    assert "## Versions" in report and "jax " in report and "python -m harness census" in report
    assert "exit status 1" in (census / "repro" / "canary_ignores_segments.txt").read_text()
    for kernel in ("dot_product", "xla", "clash_a"):   # nothing to reproduce
        assert not (census / "repro" / f"{kernel}.py").exists()


def test_a_raising_kernel_gets_an_error_reproducer_that_exits_1(census, tmp_path):
    script = census / "repro" / "census_raises.py"   # it imports the harness for the kernel
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED: census_raises raises RuntimeError: census test: this kernel always " \
           "raises" in done.stdout
    report = (census / "repro" / "census_raises.md").read_text()
    assert report.startswith("# census_raises: raises `RuntimeError: census test")
    assert "--kernel-module" in report and "--part b" in report


def test_table_only_rebuilds_the_table_without_running_anything(census, tmp_path):
    before = _table(census)
    for name in ("census.md", "census.json"):
        (census / name).unlink()
    table_only = [sys.executable, "-m", "harness", "census", "--table-only", "--report-dir"]
    done = subprocess.run([*table_only, str(census)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    after = _table(census)
    assert [r["cells"] for r in after["rows"]] == [r["cells"] for r in before["rows"]]
    assert (census / "census.md").exists()
    empty = subprocess.run([*table_only, str(tmp_path / "none")], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)
    assert empty.returncode == 2 and empty.stderr.startswith("error: --report-dir")


@pytest.mark.parametrize("args, message", [
    (("--kernels", "no_such_kernel"), "error: unknown kernel no_such_kernel"),
    (("--kernels", "dot_product", "--shapes", "huge"), "error: unknown shape set 'huge'"),
    (("--kernels", "dot_product", "--cases", "nothing-*"), "error: --cases: 'nothing-*' matches no case of suite 'smoke'"),
    (("--part", "../elsewhere"), "a part is a plain folder name"),
])
def test_user_mistakes_are_one_line_before_any_work(tmp_path, args, message):
    done = _census(*args, "--report-dir", str(tmp_path / "c"), timeout=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not (tmp_path / "c").exists()


# ----- pieces, without a run ---------------------------------------------------------------

def _record(**fields) -> Record:
    base = dict(kernel="k", case_id="c", check="out", verdict="pass", expected="pass",
                outcome="ok", family="packed", causal=True, seq_len=256, dtype="float32",
                heads=4, kv_heads=4, head_dim=32)
    return Record(**{**base, **fields})


def test_the_census_set_expands_tokamax_and_keeps_registered_names_only():
    names = ["xla", "tokamax:cudnn", "tokamax:xla", "other", "flash_attn:varlen"]
    assert census_names(names) == ["xla", "tokamax:cudnn", "tokamax:xla", "flash_attn:varlen"]


def test_a_cell_counts_cases_by_their_worst_outcome():
    records = [_record(case_id="c1"), _record(case_id="c1", check="dq", verdict="fail",
                                               outcome="fail"),
               _record(case_id="c2"), _record(case_id="c3", verdict="skip", outcome="skip")]
    cell = column_cell(records)
    assert cell["worst"] == "fail" and cell["bad"] and cell["cases"] == 3
    assert cell["text"] == "FAIL 1, ok 1, skip 1"


def test_padding_text_names_what_was_written():
    nan = {"dq": {"kind": "non-finite", "count": 3, "first": 5, "max": None}}
    records = [_record(check="padding", verdict="fail", outcome="fail", violations=nan),
               _record(check="padding")]
    assert padding_summary(records, "finite")["text"] == \
        "dq NaN/Inf in 1/2 rows, out finite (2 padded rows)"
    assert padding_summary([_record(check="padding")], "zero")["text"] == \
        "grads 0, out 0 (1 padded rows)"


def test_bench_reports_of_groups_join_per_shape():
    one = {"shapes": "small", "results": [{"shape": "seed", "entries": [{"kernel": "a"}]}]}
    two = {"shapes": "small", "results": [{"shape": "seed", "entries": [{"kernel": "b"}]}]}
    joined = join_bench({"g1": one, "g2": two, "g3": {"error": "no room", "results": []}})
    assert [e["kernel"] for e in joined["results"][0]["entries"]] == ["a", "b"]
    assert joined["errors"] == {"g3": "no room"} and joined["groups"] == ["g1", "g2", "g3"]
    assert one["results"][0]["entries"] == [{"kernel": "a"}]   # the sources stay as they were


PADDING_KERNEL = """
import jax.numpy as jnp, harness
from harness.tools.zoo.bugs import writes_at_padding
harness.register_kernel("nan_dk_at_padding", writes_at_padding(
    lambda x: jnp.full_like(x, jnp.nan), ("dk",)), dtypes=("float32",))
"""


def test_a_padding_failure_gets_a_script_that_shows_it(tmp_path):
    """`harness repro` does not shrink padding failures: the census writes a script that runs
    the kernel on the failing case and looks at its padding positions, exit 1 while it shows."""
    from harness.kernels.kernel import Platform
    from harness.engine.registry import load_kernel_module, select_kernels
    from harness.engine.runner import run_kernel_case
    from harness.model.case import Case
    from harness.tools.census.findings import write_findings

    module = tmp_path / "pad_kernel.py"
    module.write_text(PADDING_KERNEL)
    load_kernel_module(module)
    kernel = select_kernels("nan_dk_at_padding")[0]
    case = Case("packed/random", 4, 128, 2, 2, 16, "float32", 0)
    records = run_kernel_case(kernel, case, Platform("cpu"), leak=False).records
    assert any(r.check == "padding" and r.outcome == "fail" for r in records)
    written = write_findings(tmp_path / "repro", [kernel], {"suite": "smoke", "environment": {}},
                             records, [str(module)], "python -m harness census ...", 5)
    (entry,) = written
    assert entry["check"] == "padding" and entry["reproduced"] and entry["exit_status"] == 1
    output = (tmp_path / "repro" / "nan_dk_at_padding.txt").read_text()
    assert "dk at" in output and "non-finite" in output and "FAILED:" in output


WINDOW_WIDE = """
import harness
from harness.tools.zoo.feature_bugs import bug
harness.register_kernel("census_window_one_too_wide", bug(window_extra=1), dtypes=("float32",),
                        features=("window", "softcap", "chunk", "sinks", "head_dim_v"),
                        padding_anywhere=True)
"""


def test_a_leak_beyond_the_window_alone_gets_a_leak_script(tmp_path):
    """A kernel whose failures on a window case are leaks (a window one key too wide; its
    tolerance records are left out here, as where the extra key hides in the tolerance): the
    census's reproducer is a leak script (blocks inside each segment redrawn) that exits 1,
    not a note that no script could be written."""
    from harness.engine.registry import load_kernel_module, select_kernels
    from harness.engine.runner import run_kernel_case
    from harness.kernels.kernel import Platform
    from harness.model.case import Case
    from harness.tools.census.findings import write_findings

    module = tmp_path / "window_wide.py"
    module.write_text(WINDOW_WIDE)
    load_kernel_module(module)
    kernel = select_kernels("census_window_one_too_wide")[0]
    case = Case.from_id("packed/random-b2-t64-h2kv1-d8-f32-s6-w7.0")
    records = run_kernel_case(kernel, case, Platform("cpu"), leak=True).records
    leaks = [r for r in records if r.outcome == "fail" and r.check == "leak"]
    assert leaks
    (entry,) = write_findings(tmp_path / "repro", [kernel], {"suite": "smoke", "environment": {}},
                              leaks, [str(module)],
                              "python -m harness census ...", 5)
    assert entry["problem"] is None and entry["check"] == "leak", entry
    assert entry["reproduced"] and entry["exit_status"] == 1
    output = (tmp_path / "repro" / entry["script"]).with_suffix(".txt").read_text()
    assert "(window)" in output and "FAILED:" in output


FEATURE_DROPS = """
import harness
from harness.tools.zoo.feature_bugs import bug
harness.register_kernel("census_drops_window_and_softcap",
                        bug(drop_window=True, drop_softcap=True), dtypes=("float32",),
                        features=("window", "softcap", "chunk", "sinks", "head_dim_v"),
                        padding_anywhere=True)
"""


def test_a_kernel_dropping_two_features_gets_a_reproducer_per_feature_set(tmp_path):
    """As MaxText's cudnn_flash_jax drops the window, the soft cap and the chunks: one
    reproducer per feature set the kernel fails on (not only its first failing case), each
    named for its features, each exiting 1; the table lists them all."""
    from harness.engine.registry import load_kernel_module, select_kernels
    from harness.engine.runner import run_kernel_case
    from harness.kernels.kernel import Platform
    from harness.model.case import Case
    from harness.tools.census.command import clear_part
    from harness.tools.census.findings import write_findings
    from harness.tools.census.table import repro_files

    module = tmp_path / "feature_drops.py"
    module.write_text(FEATURE_DROPS)
    load_kernel_module(module)
    kernel = select_kernels("census_drops_window_and_softcap")[0]
    records = []
    for case_id in ("packed/random-b4-t256-h4kv4-d32-f32-s6-w15.0",    # the smoke suite's
                    "packed/random-b4-t256-h4kv4-d32-f32-s6-cap2"):
        records += run_kernel_case(kernel, Case.from_id(case_id), Platform("cpu"),
                                   leak=False).records
    repro = tmp_path / "report" / "repro"
    written = write_findings(repro, [kernel], {"suite": "smoke", "environment": {}}, records,
                             [str(module)], "python -m harness census ...", 4)
    name = "census_drops_window_and_softcap"
    assert [e["script"] for e in written] == [f"{name}-window.py", f"{name}-softcap.py"]
    assert [e["features"] for e in written] == [["window"], ["softcap"]]
    for entry in written:
        assert entry["problem"] is None and entry["reproduced"] and entry["exit_status"] == 1
        assert entry["case_id"].endswith({"window": "-w15.0", "softcap": "-cap2"}[
            entry["features"][0]])
    env = {**os.environ, "PYTHONPATH": str(ROOT)}   # the kernel is the harness's zoo
    for script in (f"{name}-window.py", f"{name}-softcap.py"):
        done = subprocess.run([sys.executable, str(repro / script)], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 1, done.stdout + done.stderr
        assert any(line.startswith("FAILED:") for line in done.stdout.splitlines())
        report = (repro / script).with_suffix(".md").read_text()
        feature = script[len(name) + 1:-3]
        assert report.startswith(f"# {name}: wrong results on packed rows with {feature}\n")
        assert "exit status 1" in (repro / script).with_suffix(".txt").read_text()
    assert not (repro / f"{name}.py").exists()
    assert repro_files(tmp_path / "report", name) == [f"repro/{name}-window.py",
                                                      f"repro/{name}-softcap.py"]
    clear_part(tmp_path / "part", [kernel], repro, keep_repro=False)   # a rerun clears them all
    assert not list(repro.iterdir())
