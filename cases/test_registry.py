"""Capabilities decide skips (with reasons); errors stay errors; outside kernels plug in by path."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.model.case import Case
from harness.errors import UsageError
from harness.kernels.kernel import Kernel, Platform
from harness.engine.registry import register_kernel, select_kernels
from harness.engine.runner import run_kernel_case

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "my_kernel.py"
CASE = Case("packed/random", 2, 128, 4, 2, 32, "bfloat16", 0)


def _noop(q, k, v, seg, *, causal, scale):
    return q


@pytest.mark.parametrize("caps, platform, reason", [
    ({"dtypes": ("float32",)}, Platform("cpu"), "dtype bfloat16 not in float32"),
    ({"gqa": False}, Platform("cpu"), "no GQA/MQA"),
    ({"packed": False}, Platform("cpu"), "no packed segments"),
    ({"head_dims": (64, 128)}, Platform("cpu"), "head_dim 32 not in (64, 128)"),
    ({"devices": ("gpu",)}, Platform("cpu"), "runs on gpu, not cpu"),
    ({"min_compute_capability": 9.0}, Platform("gpu", 8.0), "needs compute capability >= 9.0"),
    ({"requires": ("transformer_engine_not_here",)}, Platform("cpu"), "not installed"),
    ({"seq_len_multiple": 96}, Platform("cpu"), "not a multiple of 96"),
])
def test_unsupported_combinations_are_skipped_with_the_reason(caps, platform, reason):
    records = run_kernel_case(Kernel("k", _noop, **caps), CASE, platform).records
    assert [r.verdict for r in records] == ["skip"]
    assert reason in records[0].message


def test_a_kernel_that_raises_is_an_error_not_a_skip():
    def broken(q, k, v, seg, *, causal, scale):
        raise RuntimeError("cuDNN said no")
    records = run_kernel_case(Kernel("broken", broken), CASE, Platform("cpu")).records
    assert records[0].outcome == "error" and "cuDNN said no" in records[0].message


def test_an_error_record_says_where_in_the_kernel_it_was_raised():
    """A kernel calling np.asarray on a traced array: jax's message names only the harness's
    oracle module (where the traced function lives), which read as the reference failing (a
    cold review). The record's first line ends with the kernel's own file and line."""
    import numpy as np

    def concretizes(q, k, v, seg, *, causal, scale):
        return q * np.asarray(seg).max()
    record = run_kernel_case(Kernel("concretizes", concretizes), CASE, Platform("cpu")).records[0]
    first = record.message.splitlines()[0]
    assert record.outcome == "error" and "TracerArrayConversionError" in first, record.message
    line = concretizes.__code__.co_firstlineno + 1
    assert first.endswith(f"(raised at cases/test_registry.py:{line})"), first


def test_an_empty_expected_error_is_refused_not_a_licence_for_every_crash():
    """An expected error is the text its message holds: "" is in every message, so an
    expect_error of "" (or a function returning it) made any crash known, green."""
    def crashes(q, k, v, seg, *, causal, scale):
        raise RuntimeError("CUDA illegal memory access: a real bug")
    with pytest.raises(ValueError, match="every message holds an empty one"):
        Kernel("k", crashes, expect_error="")
    for name in ("main", "main.1", "main.deferred"):   # the main group's, and its parts' folders
        with pytest.raises(ValueError, match="name the group otherwise"):
            Kernel("k", crashes, isolation=name)
    kernel = Kernel("k", crashes, expect_error=lambda case: "")
    with pytest.raises(UsageError, match="kernel k: expect_error.case. returned '' on"):
        run_kernel_case(kernel, CASE, Platform("cpu"))
    named = Kernel("k", crashes, expect_error=lambda case: "illegal memory access")
    assert [r.outcome for r in run_kernel_case(named, CASE, Platform("cpu")).records] == [
        "known"]


def test_wrong_output_shape_is_an_error():
    def wrong(q, k, v, seg, *, causal, scale):
        return q[:, :-1]
    records = run_kernel_case(Kernel("wrong", wrong), CASE, Platform("cpu")).records
    assert records[0].outcome == "error" and "output shape" in records[0].message


def test_a_kernel_that_returns_its_query_fails_everywhere():
    records = run_kernel_case(Kernel("noop", _noop), CASE, Platform("cpu")).records
    assert {r.verdict for r in records if r.check == "out"} == {"fail"}


def test_duplicate_and_unknown_names_are_refused():
    with pytest.raises(ValueError, match="already registered"):
        register_kernel("dot_product", _noop)
    with pytest.raises(UsageError, match="unknown kernel nope"):
        select_kernels("dot_product,nope")
    with pytest.raises(ValueError, match="unknown dtypes"):
        register_kernel("k_bad_dtype", _noop, dtypes=("float64",))


def _run(*args, cwd=ROOT):
    return subprocess.run([sys.executable, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600)


def test_kernel_module_is_picked_up_by_the_cli(tmp_path):
    out = _run("-m", "harness", "run", "--kernel-module", str(EXAMPLE), "--kernels", "my_attention",
               "--cases", "packed/random-*-bf16-*", "--features", "none",
               "--report-dir", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    lines = [json.loads(x) for x in (tmp_path / "report.jsonl").read_text().splitlines()]
    assert lines[0]["type"] == "run" and lines[0]["kernels"] == ["my_attention"]
    assert {x["verdict"] for x in lines[1:]} == {"pass"}
    assert {x["check"] for x in lines[1:]} == {"out", "dq", "dk", "dv", "leak", "padding",
                                               "contract"}
    assert (tmp_path / "summary.md").exists() and (tmp_path / "report.html").exists()


def test_kernel_module_is_picked_up_by_pytest(tmp_path):
    out = _run("-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "cases" / "test_matrix.py"),
               "--kernel-module", str(EXAMPLE), "--kernels", "my_attention,canary_ignores_segments",
               "--cases", "packed/random-b4-t256-h4kv2-d64-bf16-s0", "--report-dir", str(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "my_attention:packed/random" in _run("-m", "pytest", "--collect-only", "-q",
                                                 "-p", "no:cacheprovider",
                                                 str(ROOT / "cases" / "test_matrix.py"),
                                                 "--kernel-module", str(EXAMPLE),
                                                 "--kernels", "my_attention").stdout
    kernels = {json.loads(x).get("kernel") for x in (tmp_path / "report.jsonl").read_text().splitlines()}
    assert {"my_attention", "canary_ignores_segments"} <= kernels


def test_cli_exits_non_zero_when_a_kernel_fails(tmp_path):
    leaky = tmp_path / "leaky.py"
    leaky.write_text(
        "import harness, jax\n"
        "def leaky(q, k, v, seg, *, causal, scale):\n"
        "    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=True)\n"
        "harness.register_kernel('leaky', leaky)\n")
    out = _run("-m", "harness", "run", "--kernel-module", str(leaky), "--kernels", "leaky",
               "--cases", "packed/random-*-f32-*", "--report-dir", str(tmp_path / "r"))
    assert out.returncode == 1
    assert "FAIL" in out.stdout and "r0s2" in out.stdout


def test_every_builtin_kernel_takes_the_keywords_of_the_features_it_declares():
    """What register_kernel checks of a user's kernel holds for the built-in ones: each can be
    called with its declared features' keywords (an adapter missing one would err per case)."""
    from harness.engine.registry import all_kernels, signature_problem
    problems = {k.name: p for k in all_kernels().values()
                if (p := signature_problem(k.fn, k.takes_max_segments, k.features))}
    assert not problems
    assert any(k.features for k in all_kernels().values())
