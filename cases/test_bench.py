"""python -m harness bench: every entry a CPU can run runs (the cuDNN ones through the emulator),
the report's fields, the refusals, the useful-FLOP formula and the raw packed call's lengths and
offsets. Nothing here times anything: the bench's numbers are read, never judged."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness.tools.bench import command as bench_command
from harness.tools.bench import entries as bench_entries
from harness.tools.bench import goals as bench_goals
from harness.tools.bench import plans as bench_plans
from harness.tools.bench import shapes as bench_shapes
from harness.tools.bench import timing as bench_timing
from harness import cli
from harness.model.case import Case
from harness.kernels.kernel import Platform
from harness.model.layouts import CUSTOM
from harness.sut.lowering import lengths_and_offsets

ROOT = Path(__file__).resolve().parent.parent
CPU_ENTRIES = ("sut:cudnn_flash_jax", "raw:cudnn_packed", "maxtext_original:cudnn_flash_jax",
               "sut:cudnn_flash_jax:fallback", "xla")
TE_ENTRIES = ("te:thd", "raw:te_thd_offsets", "sut:cudnn_flash_te")


def _cli(*args, timeout=300):
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    """One CPU run of the small set (compilation of ten programs: the slow part, shared)."""
    out = tmp_path_factory.mktemp("bench") / "bench.json"
    proc = _cli("bench", "--shapes", "small", "--repeats", "2", "--output", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout, json.loads(out.read_text())


def test_small_runs_every_entry_a_cpu_can(small_run):
    stdout, _ = small_run
    lines = stdout.splitlines()
    for shape in bench_shapes.shape_set("small"):
        start = next(i for i, x in enumerate(lines) if x.startswith(f"{shape.name}: "))
        table = lines[start:start + 3 + len(bench_entries.ENTRIES)]
        assert "ratios against raw:cudnn_packed" in table[1] and "TFLOP/s" in table[2]
        rows = {x.split()[0]: x for x in table[3:]}
        for name in CPU_ENTRIES:
            assert "skip" not in rows[name] and "error" not in rows[name], rows[name]
            assert rows[name].split()[1] == ("xla" if name == "xla" else "emulator")
        assert rows["raw:cudnn_packed"].split()[5] == "1.00x"
        for name in TE_ENTRIES:
            assert "skip: runs on gpu, not cpu" in rows[name]
    assert "op vs causal-only at the seed shape: " in stdout
    assert "op vs raw packed at short: " in stdout and "fastest at seed: " in stdout


def test_small_output_json_has_the_fields(small_run):
    _, report = small_run
    assert report["environment"]["platform"] == "cpu" and report["repeats"] == 2
    assert [r["shape"] for r in report["results"]] == ["seed", "short"]
    for res in report["results"]:
        entries = {e["entry"]: e for e in res["entries"]}
        assert list(entries) == [e.name for e in bench_entries.ENTRIES]
        for name in CPU_ENTRIES:
            e = entries[name]
            assert e["skipped"] is None and e["error"] is None
            assert len(e["times_ms"]) == 2 and e["min_ms"] <= e["median_ms"]
            assert e["spread"] >= 0 and e["ratio_base"] == "raw:cudnn_packed"
            assert e["ratio_to_raw_packed"] == pytest.approx(
                e["median_ms"] / entries["raw:cudnn_packed"]["median_ms"])
            assert e["useful_tflops"] == pytest.approx(
                res["useful_flops"] / (e["median_ms"] * 1e-3) / 1e12)
        for name in TE_ENTRIES:
            assert entries[name]["skipped"] and entries[name]["median_ms"] is None
        # Same outputs as the op (the raw call's precomputed lengths/offsets are right), and the
        # causal-only call caught attending across segments.
        assert entries["raw:cudnn_packed"]["max_abs_diff_vs_op"] < 0.05
        assert entries["sut:cudnn_flash_jax:fallback"]["max_abs_diff_vs_op"] < 0.05
        assert entries["maxtext_original:cudnn_flash_jax"]["max_abs_diff_vs_op"] > 1.0
        assert res["op_vs_causal_only"] == pytest.approx(
            entries["sut:cudnn_flash_jax"]["median_ms"]
            / entries["maxtext_original:cudnn_flash_jax"]["median_ms"])
    goals = {(g["goal"], g["shape"]) for g in report["goals"]}
    assert goals == {("op_vs_raw_packed", "seed"), ("op_vs_causal_only", "seed"),
                     ("op_vs_fastest", "seed"), ("op_vs_raw_packed", "short"),
                     ("op_vs_fastest", "short"), ("auto_vs_fused", "seed"),
                     ("auto_vs_fused", "short"), ("patch_after_vs_before", "seed")}
    # MaxText's op before and after the patch is measured where maxtext is installed (3.12).
    maxtext = importlib.util.find_spec("maxtext") is not None
    assert all(g["text"] and (g["value"] is not None or
                              (g["goal"] == "patch_after_vs_before" and not maxtext))
               for g in report["goals"])


def _no_work(monkeypatch):
    def boom(*args, **kwargs):
        raise AssertionError("bench did work before refusing")
    monkeypatch.setattr(bench_timing, "make_inputs", boom)
    monkeypatch.setattr(bench_command, "time_shape", boom)


def test_hopper_on_a_small_cpu_is_refused_in_one_line_before_any_work(monkeypatch, capsys):
    _no_work(monkeypatch)
    monkeypatch.setattr(bench_plans, "host_memory_bytes", lambda: 8 * bench_plans.GiB)
    assert cli.main(["bench", "--shapes", "hopper"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1
    assert captured.err.startswith("error: --shapes hopper needs ~")
    assert "per program; this cpu device has 8 GiB: use --shapes small" in captured.err


def test_hopper_is_refused_on_this_cpu():
    cpu = Platform("cpu")
    need = min(bench_plans.peak_bytes(s.case, True, cpu)
               for s in bench_shapes.shape_set("hopper"))
    if (bench_plans.host_memory_bytes() or 0) >= need:
        pytest.skip(f"this host has room for a hopper program "
                    f"(~{need / bench_plans.GiB:.0f} GiB)")
    proc = _cli("bench", "--shapes", "hopper", timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.count("\n") == 1 and "use --shapes small" in proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["bench", "--shapes", "nope"], "error: unknown shape set 'nope' for --shapes; known: small"),
    (["bench", "--kernels", "sut:cudnn_flash_jax,nope"], "error: unknown bench entry nope;"),
    (["bench", "--repeats", "0"], "error: --repeats 0: must be at least 1"),
])
def test_usage_errors_are_one_line(monkeypatch, capsys, argv, message):
    _no_work(monkeypatch)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(message) and err.count("\n") == 1


def test_entries_that_do_not_fit_are_skipped_with_the_numbers():
    gpu = Platform("gpu", 9.0, memory_bytes=20 * bench_plans.GiB)
    shapes = bench_shapes.shape_set("hopper")
    plans = bench_plans.plan_all(shapes, bench_entries.select_entries("sut:cudnn_flash_jax,xla"),
                                 gpu, gpu.memory_bytes, "hopper")
    reasons = {(s.name, p.entry.name): p.reasons for s, row in zip(shapes, plans) for p in row}
    assert not reasons[("seed", "sut:cudnn_flash_jax")] and not reasons[("seed", "xla")]
    assert reasons[("long-8k", "xla")] == [
        "needs ~32.4 GiB, more than the 20.0 GiB this gpu device has"]
    assert all(not reasons[(s.name, "sut:cudnn_flash_jax")] for s in shapes)


def test_useful_flops_count_same_segment_causal_pairs_only():
    # Segments of 3 and 1 tokens: 3*4/2 + 1 = 7 causal pairs; 2 heads of dim 4; two matmuls of
    # 2 FLOPs per multiply-add: forward 4 * 7 * 4 * 2 = 224; backward 2.5x: 560; total 784.
    assert bench_shapes.useful_flops([3, 1], heads=2, head_dim=4) == (224, 784)
    # The same by brute force over packed rows with padding (padding pairs count nothing).
    for seg in ([1, 1, 1, 2, 0, 0], [1, 2, 2, 2, 2, 3, 3, 0], [1] * 9):
        lengths = [seg.count(n) for n in sorted(set(seg) - {0})]
        pairs = sum(1 for i in range(len(seg)) for j in range(i + 1) if seg[i] and seg[i] == seg[j])
        assert bench_shapes.useful_flops(lengths, heads=2, head_dim=4)[0] \
            == 4 * pairs * 4 * 2, seg


def test_shapes_have_the_exact_segments():
    for shape in bench_shapes.shape_set("hopper") + bench_shapes.shape_set("small"):
        case = shape.case
        assert case.layout == CUSTOM and case.dtype == "bfloat16"
        counts = [case.segments_in_row(r) for r in range(case.batch)]
        assert shape.max_segments == max(counts) + 1
    hopper = {s.name: s for s in bench_shapes.shape_set("hopper")}
    assert [(s.case.batch, s.case.seq_len, s.case.heads, s.case.kv_heads, s.case.head_dim)
            for s in hopper.values()] == [(8, 2048, 32, 8, 128), (1, 8192, 32, 8, 128),
                                          (1, 32768, 32, 8, 128), (8, 4096, 32, 8, 128)]
    assert [hopper["seed"].case.segments_in_row(r) for r in range(8)] == [4] * 8
    assert len(hopper["long-8k"].lengths) == 8 and len(hopper["long-32k"].lengths) == 16
    assert 64 <= min(hopper["short"].lengths) and max(hopper["short"].lengths) <= 256
    assert all(sum(row) == 2048 for row in hopper["seed"].case.rows)


def test_raw_packed_lengths_and_offsets_equal_the_ops_lowering():
    seqlen, offsets = bench_shapes.packed_lengths_offsets(
        Case(CUSTOM, 2, 8, 1, 1, 8, "bfloat16", 0, rows=((3, 2), (4,))).segment_ids, 3)
    assert seqlen.tolist() == [[3, 2, -1], [4, -1, -1]]
    assert offsets.tolist() == [[0, 3, -1, -1], [0, -1, -1, -1]]
    lowering = jax.jit(lengths_and_offsets, static_argnums=1)
    for shape in bench_shapes.shape_set("small") + bench_shapes.shape_set("hopper"):
        seg = shape.case.segment_ids
        ours = bench_shapes.packed_lengths_offsets(seg, shape.max_segments)
        theirs = lowering(jnp.asarray(seg), shape.max_segments)
        for a, b in zip(ours, theirs):
            assert a.dtype == np.int32 and np.array_equal(a, np.asarray(b)), shape.name


def _result(shape, **medians):
    roles = {e.name: e.role for e in bench_entries.ENTRIES}
    op, causal_only = (bench_entries.entry_with(goal).name
                       for goal in (bench_entries.THE_OP, bench_entries.REPLACED))
    return {"shape": shape, "op_vs_causal_only": (medians[op] / medians[causal_only]
                                                  if causal_only in medians else None),
            "entries": [{"entry": n, "role": roles[n], "median_ms": medians.get(n),
                         "skipped": None if n in medians else "not here", "error": None}
                        for n in roles]}


def test_goal_checks_are_statements_with_numbers():
    results = [_result("seed", **{"sut:cudnn_flash_jax": 2.40, "raw:cudnn_packed": 2.36,
                                  "te:thd": 2.31, "sut:cudnn_flash_te": 2.45,
                                  "maxtext_original:cudnn_flash_jax": 3.0}),
               _result("long-32k", **{"sut:cudnn_flash_jax": 2.0})]
    texts = [g["text"] for g in bench_goals.goal_checks(results)]
    assert texts == [
        "op vs raw packed at seed: +1.7% (2.400 vs 2.360 ms; goal <= +3%: met)",
        "op vs causal-only at the seed shape: 0.80x (2.400 vs 3.000 ms; goal <= 0.67x: not met)",
        "MaxText's op after/before the patch at seed: not measured (maxtext not installed, or "
        "an entry not timed)",
        "fastest at seed: te:thd 2.310 ms; op 2.400 ms via sut:cudnn_flash_jax (+3.9%, goal "
        "within 5%: met)",
        "auto mode at seed: not measured (auto or raw fused calls not timed)",
        "op vs raw packed at long-32k: not measured (raw:cudnn_packed: not here)",
        "fastest at long-32k: sut:cudnn_flash_jax 2.000 ms, an op path (goal within 5%: met)",
        "auto mode at long-32k: not measured (auto or raw fused calls not timed)",
    ]
    # The auto mode against the faster raw fused call, and MaxText's op after the patch.
    results = [_result("seed", **{"sut:cudnn_flash_jax": 2.40, "raw:cudnn_packed": 2.36,
                                  "raw:te_thd_offsets": 2.30, "sut:cudnn_flash_auto": 2.35,
                                  "maxtext:cudnn_flash_jax": 3.0,
                                  "maxtext_fixed:cudnn_flash_jax": 1.8})]
    texts = [g["text"] for g in bench_goals.goal_checks(results)]
    assert ("auto mode at seed: 2.350 ms vs raw:te_thd_offsets 2.300 ms (+2.2%; goal within "
            "3%: met)") in texts
    assert ("MaxText's op after/before the patch at seed: 0.60x (1.800 vs 3.000 ms; goal <= "
            "0.67x: met)") in texts


def test_samples_of_back_to_back_calls(monkeypatch, tmp_path, capsys):
    # GPUs take several calls per sample; force that path here on one cheap entry.
    monkeypatch.setattr(bench_timing, "calls_per_sample", lambda seconds, platform: 3)
    out = tmp_path / "b.json"
    assert cli.main(["bench", "--shapes", "small", "--repeats", "2", "--kernels",
                     "raw:cudnn_packed", "--output", str(out)]) == 0
    assert "3 calls/sample" in capsys.readouterr().out
    for res in json.loads(out.read_text())["results"]:
        (entry,) = res["entries"]
        assert entry["calls_per_sample"] == 3 and len(entry["times_ms"]) == 2
        assert entry["ratio_to_raw_packed"] == 1.0
