"""python -m harness repro: a failing case shrunk to a small one, and a standalone script that
shows the failure with plain python (no harness)."""
import ast
import contextlib
import io
import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest

from harness.model.case import Case
from harness.cli import main as cli_main
from harness.kernels.kernel import Platform
from harness.engine.registry import select_kernels
from harness.engine.runner import run_kernel_case

ROOT = Path(__file__).resolve().parent.parent

ORIGINAL = "packed/random-b4-t256-h4kv2-d64-bf16-s0"
CPU = Platform("cpu")
MAXTEXT = ("maxtext:dot_product", "maxtext:cudnn_flash_jax", "maxtext:cudnn_flash_te")


def _repro(*argv):
    """(exit status, stdout, stderr) of `python -m harness repro ...`, in this process."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main(["repro", *argv])
    return code, out.getvalue(), err.getvalue()


def _field(output: str, name: str) -> str:
    line = next(line for line in output.splitlines() if line.startswith(name + ":"))
    return line.split(":", 1)[1].split()[0]


def _plain_python(script, cwd, pythonpath=None):
    """The script run by plain python from `cwd`, with no PYTHONPATH but `pythonpath`."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath:
        env["PYTHONPATH"] = str(pythonpath)
    cwd.mkdir(parents=True, exist_ok=True)
    return subprocess.run([sys.executable, str(script)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def _imported_modules(source: str) -> set[str]:
    tree = ast.parse(source)
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import)
             for a in n.names}
    return names | {n.module.split(".")[0] for n in ast.walk(tree)
                    if isinstance(n, ast.ImportFrom) and n.module}


def test_canary_repro_shrinks_and_its_script_fails_with_plain_python(tmp_path):
    script = tmp_path / "out" / "repro_canary.py"
    code, out, err = _repro("canary_ignores_segments", ORIGINAL, "--output", str(script))
    assert code == 0, err
    assert "checked:" in out and "exits 1" in out

    # Shrunk: no bigger than the original anywhere, at most 2 rows, the same dtype and mask,
    # and the same check still fails on it.
    original, shrunk = Case.from_id(ORIGINAL), Case.from_id(_field(out, "shrunk case"))
    for dim in ("batch", "seq_len", "heads", "kv_heads", "head_dim"):
        assert getattr(shrunk, dim) <= getattr(original, dim), dim
    assert shrunk.batch <= 2 and len(shrunk.segments) < len(original.segments)
    assert (shrunk.dtype, shrunk.causal) == (original.dtype, original.causal)
    assert _field(out, "failing") == "check"
    assert " out, segment " in out
    canary = select_kernels("canary_ignores_segments")[0]
    records = run_kernel_case(canary, shrunk, CPU, leak=False).records
    assert any(r.check == "out" and r.verdict == "fail" for r in records)

    # The script: jax and numpy only; the shrunk ids as a literal; run from an empty folder with
    # a `harness` on the path that refuses to import (it shadows any installed one).
    text = script.read_text()
    # traceback: a script that raises before it judges says so (exit 2)
    assert _imported_modules(text) <= {"sys", "jax", "numpy", "traceback"}
    assert shrunk.id in text and ORIGINAL in text and "SEGMENT_IDS = np.array([" in text
    poison = tmp_path / "poison" / "harness"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text("raise ImportError('a repro script must not need the "
                                        "harness')\n")
    done = _plain_python(script, tmp_path / "elsewhere", pythonpath=poison.parent)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED: out of canary_ignores_segments" in done.stdout
    assert any("FAIL (worst token" in line for line in done.stdout.splitlines())

    # With the kernel fixed (the segment mask passed), the same script exits 0.
    broken = ("    del segment_ids, max_segments\n"
              "    return jax.nn.dot_product_attention(query, key, value, scale=scale,")
    assert broken in text
    fixed = script.with_name("fixed.py")
    fixed.write_text(text.replace(broken, (
        "    mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]\n"
        "    return jax.nn.dot_product_attention(query, key, value, mask=mask, scale=scale,")))
    done = _plain_python(fixed, tmp_path / "elsewhere", pythonpath=poison.parent)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASSED" in done.stdout


def test_a_correct_kernel_is_refused_in_one_line(tmp_path):
    script = tmp_path / "x.py"
    code, out, err = _repro("dot_product", "packed/random-b1-t16-h1kv1-d8-bf16-s0",
                            "--output", str(script))
    assert code == 2 and not script.exists()
    assert err.count("\n") == 1 and "passes every check" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, message", [
    (["no_such_kernel", ORIGINAL], "unknown kernel no_such_kernel"),
    (["canary_ignores_segments", "packed/random-b4"], "not a case id"),
    (["canary_ignores_segments", "packed/dozens-b1-t64-h1kv1-d8-bf16-s0"], "needs seq_len"),
    (["canary_ignores_segments", ORIGINAL, "--check", "nope"], "unknown check"),
])
def test_usage_errors_are_one_line(argv, message):
    code, out, err = _repro(*argv)
    assert code == 2 and err.count("\n") == 1 and message in err


USER_KERNEL = '''
import jax

import harness


def leaky(query, key, value, segment_ids, *, causal, scale):
    """Segment ids ignored: the bug, in a user's own file."""
    return jax.nn.dot_product_attention(query, key, value, scale=scale, is_causal=causal,
                                        implementation="xla")


harness.register_kernel("repro_test_leaky", leaky, dtypes=("float32", "bfloat16"))
'''


def test_a_user_kernel_script_loads_its_file_by_path(tmp_path):
    module = tmp_path / "repro_user_kernel.py"
    module.write_text(USER_KERNEL)
    script = tmp_path / "repro_user.py"
    code, out, err = _repro("repro_test_leaky", "packed/random-b2-t32-h2kv1-d8-f32-s0",
                            "--kernel-module", str(module), "--output", str(script))
    assert code == 0, err
    text = script.read_text()
    assert f"_KERNEL_FILE = {str(module.resolve())!r}" in text
    assert "spec_from_file_location" in text and "_kernel_module.leaky" in text
    assert "harness" not in _imported_modules(text)
    done = _plain_python(script, tmp_path / "elsewhere")
    assert done.returncode == 1, done.stdout + done.stderr
    assert "FAILED: out of repro_test_leaky" in done.stdout


def test_the_canary_standalone_source_computes_what_the_kernel_does():
    canary = select_kernels("canary_ignores_segments")[0]
    scope = {}
    exec(compile(canary.standalone, "standalone", "exec"), scope)
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 16, h, 8), dtype=np.float32))
               for h in (4, 2, 2))
    seg = jnp.asarray(np.repeat([[1, 2, 3, 0]], 4, axis=1).repeat(2, axis=0).astype(np.int32))
    for causal in (True, False):
        want = canary.fn(q, k, v, seg, causal=causal, scale=0.3)
        got = scope["kernel"](q, k, v, seg, causal=causal, scale=0.3, max_segments=4)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ----- maxtext: its standalone source mirrors the adapter (checked on a stand-in AttentionOp) ----

FAKE_ATTENTION_OP = '''
import numpy as np

CALLS = []


class AttentionOp:
    """Records what it is given; "computes" something that depends on all of it."""

    def __init__(self, *, config, mesh, attention_kernel, max_target_length, num_query_heads,
                 num_kv_heads, dtype):
        try:
            config.not_in_base_yml
            refused = False
        except AttributeError:
            refused = True
        CALLS.append({
            "config": (config.attention, config.enable_dropout, config.dropout_rate,
                       config.context_sharding, config.ici_context_autoregressive_parallelism,
                       config.max_segments_per_seq, config.dataset_type),
            "refuses_unknown_settings": refused,
            "mesh": (tuple(mesh.axis_names), dict(mesh.shape), mesh.devices.size),
            "op": (attention_kernel, max_target_length, num_query_heads, num_kv_heads,
                   np.dtype(dtype).name),
        })

    def __call__(self, query, key, value, segment_ids, positions, mode):
        CALLS[-1].update(query=np.asarray(query), key=np.asarray(key), value=np.asarray(value),
                         segment_ids=np.asarray(segment_ids), positions=np.asarray(positions),
                         mode=mode)
        return query * 2 + positions[:, :, None, None].astype(query.dtype), None
'''

BASE_YML = ('{"mesh_axes": ["data", "stage", "fsdp", "sequence", "context", "tensor"], '
            '"context_sharding": "context", "ici_context_autoregressive_parallelism": 1, '
            '"attention": "autoselected", "enable_dropout": true, "dropout_rate": 0.1, '
            '"max_segments_per_seq": -1, "dataset_type": "synthetic"}')


@pytest.fixture
def fake_maxtext(tmp_path, monkeypatch):
    """A stand-in `maxtext` package (AttentionOp recording its arguments, a base.yml) and a
    `yaml` that reads it (base.yml is written as JSON, which is YAML), first on the path."""
    root = tmp_path / "fake"
    (root / "maxtext" / "layers").mkdir(parents=True)
    (root / "maxtext" / "configs").mkdir()
    (root / "maxtext" / "__init__.py").write_text("")
    (root / "maxtext" / "layers" / "__init__.py").write_text("")
    (root / "maxtext" / "layers" / "attention_op.py").write_text(FAKE_ATTENTION_OP)
    (root / "maxtext" / "configs" / "base.yml").write_text(BASE_YML)
    (root / "yaml.py").write_text("import json\n\n\ndef safe_load(text):\n"
                                  "    return json.loads(text)\n")
    for name in [m for m in sys.modules if m in ("yaml", "maxtext") or m.startswith("maxtext.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(root))
    from harness.kernels import maxtext_adapter
    maxtext_adapter.base_config.cache_clear()
    yield sys.modules
    maxtext_adapter.base_config.cache_clear()
    for name in [m for m in sys.modules
                 if m in ("yaml", "maxtext") or m.startswith("maxtext.")]:
        if str(root) in (getattr(sys.modules[name], "__file__", None) or ""):
            del sys.modules[name]


@pytest.mark.parametrize("name", MAXTEXT)
def test_maxtext_standalone_source_mirrors_the_adapter(name, fake_maxtext):
    kernel = select_kernels(name)[0]
    attention = name.split(":", 1)[1]
    assert f'ATTENTION = "{attention}"' in kernel.standalone
    assert _imported_modules(kernel.standalone) <= {"functools", "importlib", "jax", "numpy",
                                                    "yaml", "maxtext", "absl"}
    scope = {}
    exec(compile(kernel.standalone, name, "exec"), scope)
    calls = fake_maxtext["maxtext.layers.attention_op"].CALLS
    rng = np.random.default_rng(1)
    q, k, v = (jnp.asarray(rng.standard_normal((2, 8, h, 16), dtype=np.float32), jnp.bfloat16)
               for h in (4, 2, 2))
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], jnp.int32)
    adapter_out = kernel.fn(q, k, v, seg, causal=True, scale=0.25, max_segments=4)
    adapter_call = calls.pop()
    script_out = scope["kernel"](q, k, v, seg, causal=True, scale=0.25, max_segments=4)
    script_call = calls.pop()
    assert adapter_call.keys() == script_call.keys()
    for key, value in adapter_call.items():
        if isinstance(value, np.ndarray):
            np.testing.assert_array_equal(script_call[key], value, err_msg=key)
        else:
            assert script_call[key] == value, key
    assert adapter_call["config"] == (attention, False, 0.0, "context", 1, 4, "tfds")
    assert adapter_call["refuses_unknown_settings"]
    assert adapter_call["op"] == (attention, 8, 4, 2, "bfloat16")
    assert adapter_call["mode"] == "train"
    np.testing.assert_array_equal(adapter_call["positions"][0], [0, 1, 2, 0, 1, 0, 0, 0])
    np.testing.assert_array_equal(  # the query arrives pre-scaled
        adapter_call["query"], np.asarray(q * jnp.asarray(0.25, jnp.bfloat16)))
    np.testing.assert_array_equal(np.asarray(script_out), np.asarray(adapter_out))


def test_repro_scripts_are_named_after_the_kernel():
    from harness.tools.repro.command import default_output
    assert default_output("maxtext:cudnn_flash_jax") == "repro_maxtext_cudnn_flash_jax.py"
    assert default_output("a/b:c") == "repro_a_b_c.py"


def test_a_lambda_kernel_is_refused_before_any_work():
    from harness.errors import UsageError
    from harness.kernels.kernel import Kernel
    from harness.tools.repro.source import kernel_source
    with pytest.raises(UsageError, match="standalone="):
        kernel_source(Kernel("lam", lambda q, k, v, s, *, causal, scale: q))
    source, needs_harness = kernel_source(select_kernels("maxtext_original:cudnn_flash_jax:"
                                                         "emulated")[0])
    assert "functools.partial(_kernel_fn, backend='emulator')" in source and needs_harness


FEATURE_KERNELS = '''
import harness
from harness.tools.zoo.feature_bugs import bug, features_dense

EVERY = ("window", "softcap", "chunk", "sinks", "head_dim_v")
harness.register_kernel("repro_test_softcap_dropped", bug(drop_softcap=True),
                        dtypes=("float32",), features=EVERY, padding_anywhere=True)
harness.register_kernel("repro_test_features_ok", features_dense, dtypes=("float32",),
                        features=EVERY, padding_anywhere=True)
'''
FEATURE_CASE = "packed/random-b2-t64-h2kv1-d8-f32-s6-w7.0-cap2-sink"


def test_a_feature_cases_script_hands_over_the_features_and_its_reference_applies_them(
        tmp_path):
    """A repro script of a case with features calls the kernel with them (window, soft cap,
    sinks) and compares it with a reference that applies them: the soft cap a kernel drops
    fails in the script run with plain python, and the script's reference is the harness's
    truth (on the H200 a script without the features passed on MaxText's dropped soft cap)."""
    module = tmp_path / "feature_kernels.py"
    module.write_text(FEATURE_KERNELS)
    script = tmp_path / "softcap.py"
    code, out, err = _repro("repro_test_softcap_dropped", FEATURE_CASE, "--kernel-module",
                            str(module), "--output", str(script))
    assert code == 0, err + out
    assert "`python" in out and "exits 1" in out
    text = script.read_text()
    assert "WINDOW = (7, 0)" in text and "SOFTCAP = 2.0" in text and "SINKS = True" in text
    assert "'softcap': 2.0" in text and "'window': (7, 0)" in text
    # Its reference, run on the shrunk case's own inputs, is the harness's float32 truth.
    import importlib.util
    import sys

    import jax.numpy as jnp

    from harness.judge.oracle import dense_attention
    from harness.model.case import Case, make_inputs
    sys.path.insert(0, str(tmp_path))
    try:
        spec = importlib.util.spec_from_file_location("softcap_script", script)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    finally:
        sys.path.remove(str(tmp_path))
    case = Case.from_id(mod.CASE_ID)
    assert case.features.names == ("window", "softcap", "sinks")
    q, k, v, _, sinks = mod.draw_inputs()
    inputs = make_inputs(case)
    assert np.array_equal(np.asarray(q), inputs.query)
    assert np.array_equal(np.asarray(sinks), inputs.sinks)
    got = np.asarray(mod.reference_attention(q, k, v, jnp.asarray(mod.SEGMENT_IDS), sinks))
    want = np.asarray(dense_attention(q, k, v, jnp.asarray(case.segment_ids), jnp.asarray(sinks),
                                      scale=case.scale, causal=case.causal,
                                      features=case.features))
    assert np.abs(got - want).max() < 1e-5


LEAK_KERNELS = '''
import harness
from harness.tools.zoo.feature_bugs import bug

EVERY = ("window", "softcap", "chunk", "sinks", "head_dim_v")
harness.register_kernel("repro_test_window_wide", bug(window_extra=1), dtypes=("float32",),
                        features=EVERY, padding_anywhere=True)
harness.register_kernel("repro_test_window_from_row", bug(window_from_row=True),
                        dtypes=("float32",), features=EVERY, padding_anywhere=True)
harness.register_kernel("repro_test_chunk_dropped", bug(drop_chunk=True), dtypes=("float32",),
                        features=EVERY, padding_anywhere=True)
'''


@pytest.fixture(scope="module")
def leak_kernels(tmp_path_factory):
    """One file for the module: a process registers its kernels once."""
    module = tmp_path_factory.mktemp("leak_kernels") / "leak_kernels.py"
    module.write_text(LEAK_KERNELS)
    return module


def test_a_leak_beyond_the_window_gets_a_script_that_fails_with_plain_python(tmp_path,
                                                                              leak_kernels):
    """A window one key too wide, on a case with a soft cap and sinks too: the leak script
    redraws blocks inside the segment (the probe's window groups), holds the sinks, and fails;
    the same script with the window right exits 0."""
    script = tmp_path / "wide.py"
    code, out, err = _repro("repro_test_window_wide", FEATURE_CASE, "--check", "leak",
                            "--kernel-module", str(leak_kernels), "--output", str(script))
    assert code == 0, err + out
    assert "check leak" in out and "exits 1" in out
    text = script.read_text()
    assert "SINKS = True" in text and "WINDOW = (7, 0)" in text
    done = _plain_python(script, tmp_path / "elsewhere", pythonpath=ROOT)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "(window)" in done.stdout and "FAILED: repro_test_window_wide reads tokens" in done.stdout
    broken = "functools.partial(_kernel_fn, window_extra=1)"
    assert broken in text
    fixed = script.with_name("fixed.py")
    fixed.write_text(text.replace(broken, "_kernel_fn"))
    done = _plain_python(fixed, tmp_path / "elsewhere", pythonpath=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASSED" in done.stdout and "not compared" not in done.stdout


@pytest.mark.parametrize("kernel_name,case_id", [
    # One key past the window, padding between segments: segments longer than the window
    # leak, shorter ones do not.
    ("repro_test_window_wide", "padded/between-b2-t256-h2kv1-d8-f32-s6-w7.0-sink"),
    ("repro_test_chunk_dropped", "packed/random-b2-t128-h2kv1-d8-f32-s6-bidir-ch16"),
])
def test_a_leak_script_judges_each_segment_as_the_harness_does(tmp_path, leak_kernels,
                                                               kernel_name, case_id):
    """The leak script on an unshrunk case with several segments, padding and a window or
    chunks: the segments it finds leaking are the ones the harness's probe fails, no more."""
    from harness.engine.registry import load_kernel_module
    from harness.tools.repro.script import script_text
    from harness.tools.repro.trials import Trial
    load_kernel_module(leak_kernels)
    kernel = select_kernels([kernel_name])[0]
    case = Case.from_id(case_id)
    trial = Trial(case, run_kernel_case(kernel, case, CPU, leak=True).records)
    failing = {(r.row, r.segment) for r in trial.failing("leak")}
    assert failing and len(failing) < len(case.segments), failing
    script = tmp_path / "leak.py"
    script.write_text(script_text(kernel, case, trial, "leak", 1, script)[0])
    done = _plain_python(script, tmp_path / "elsewhere", pythonpath=ROOT)
    assert done.returncode == 1, done.stdout + done.stderr
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith("r") and " tokens " in ln]
    assert len(lines) == len(case.segments)
    for seg, line in zip(case.segments, lines):
        assert line.startswith(f"r{seg.row}s{seg.number} ")
        assert ("LEAK" in line) == ((seg.row, seg.number) in failing), line
        assert ("LEAK" in line) == ("harness: fail" in line), line


NAN_LEAK = """
import jax.numpy as jnp
import harness
from harness.kernels.reference import dot_product

def nan_once_padding_is_redrawn(q, k, v, seg, *, causal, scale):
    # Finite while the padding holds its poison (draws 8 times larger than the tokens'): NaN
    # everywhere once the probe redraws the padding small. A leak whose change is a number
    # against NaN.
    out = dot_product(q, k, v, seg, causal=causal, scale=scale)
    return out + 0.0 * jnp.log(jnp.max(jnp.abs(k)) - 10.0)

harness.register_kernel("repro_test_nan_leak", nan_once_padding_is_redrawn, dtypes=("float32",),
                        padding_anywhere=True)
"""


def test_a_leak_script_counts_a_number_against_nan_as_an_infinite_change(tmp_path):
    """Where the probe's run turns a number into NaN the harness counts an infinite change;
    the leak script says the same (it took NaN for no change: "max change 0")."""
    from harness.engine.registry import load_kernel_module
    from harness.tools.repro.script import script_text
    from harness.tools.repro.trials import Trial
    module = tmp_path / "nan_leak.py"
    module.write_text(NAN_LEAK)
    load_kernel_module(str(module))
    kernel = select_kernels(["repro_test_nan_leak"])[0]
    case = Case.from_id("padded/between-b2-t256-h2kv1-d8-f32-s0")
    trial = Trial(case, run_kernel_case(kernel, case, CPU, leak=True).records)
    failing = trial.failing("leak")
    # The harness's largest change: an infinite one, kept as float32's largest number.
    assert failing and all(r.max_abs_err >= np.finfo(np.float32).max for r in failing), failing
    script = tmp_path / "leak.py"
    script.write_text(script_text(kernel, case, trial, "leak", 1, script)[0])
    done = _plain_python(script, tmp_path / "elsewhere", pythonpath=ROOT)
    assert done.returncode == 1, done.stdout + done.stderr
    leaks = [ln for ln in done.stdout.splitlines() if " LEAK in " in ln]
    assert leaks and all("LEAK in out " in ln and "max change inf," in ln for ln in leaks), \
        done.stdout


@pytest.mark.parametrize("case_id,convention", [
    ("padded/between-b2-t256-h2kv1-d8-f32-s0-bidir-w5.3", "segment"),     # a window ahead
    ("packed/random-b2-t128-h2kv1-d8-bf16-s5-w3.0-ch5-sink", "segment"),
    ("packed/random-b2-t128-h2kv1-d8-f32-s0-ch16-dv4", "row"),             # chunks from the row
    ("unaligned/odd-b2-t200-h2kv1-d8-f32-s5-bidir-w2.0-ch7", "row"),
    ("extremes/single-tokens-b2-t64-h2kv1-d8-f32-s0-w0.0", "segment"),
    ("packed/random-b2-t128-h2kv1-d8-bf16-s1", "segment"),                # causal: tails cut
])
def test_a_leak_scripts_groups_dependencies_and_draws_are_the_probes(tmp_path, case_id,
                                                                       convention):
    """The leak script's own code against the harness's probe, without running a kernel: the
    same redrawn groups in the same order (their index keys the draw), the same dependency
    intervals (either chunk convention, windows with keys ahead), the same inputs, sinks and
    perturbations, bit for bit."""
    import runpy
    from types import SimpleNamespace
    from unittest import mock

    import harness
    from harness.judge import leak_probe, probe_groups
    from harness.model.case import make_inputs
    from harness.tools.repro.script import script_text
    from harness.tools.repro.trials import Trial
    from harness.tools.zoo.feature_bugs import features_dense

    case = Case.from_id(case_id)
    kernel = harness.register_kernel(f"repro_test_structure_{convention}", features_dense,
                                     replace=True, dtypes=("float32", "bfloat16"),
                                     features=("window", "softcap", "chunk", "sinks",
                                               "head_dim_v"),
                                     padding_anywhere=True, conventions={"chunk": convention})

    class Written(Trial):   # the header needs a failing record; this one is made up
        def failing(self, check, evidence=False):
            s = self.case.segments[0]
            return [SimpleNamespace(verdict="fail", message="", max_abs_err=1.0,
                                    worst_token=s.start, row=s.row, segment=s.number,
                                    start=s.start, length=s.length)]

        def record(self, check, row, segment):
            return SimpleNamespace(verdict="pass", message="")
    script = tmp_path / "leak.py"
    script.write_text(script_text(kernel, case, Written(case, []), "leak", 1, script)[0])
    with mock.patch.dict(os.environ):   # the script sets TE's NVTE_ variable on import
        ns = runpy.run_path(str(script), run_name="not_main")
    assert ns["CHUNKS_FROM"] == convention
    mine, theirs = ns["redrawn_groups"](), probe_groups.groups(case, convention)
    assert [name for name, _ in mine] == [name for name, _ in theirs]
    for (_, a), (_, b) in zip(mine, theirs):
        assert np.array_equal(a, b)
    script_deps, probe_deps = ns["depends_on"](), probe_groups.dependencies(case, convention)
    for cls in ("query", "key"):
        for bound in (0, 1):
            assert np.array_equal(script_deps[cls][bound], probe_deps[cls][bound]), (cls, bound)
    q, k, v, cotangent, sinks = ns["draw_inputs"]()
    device = make_inputs(case).device_args
    if case.features.sinks:
        assert np.array_equal(sinks, np.asarray(device[4]))
    for index, (_, redraw) in enumerate(mine):
        script_arrays = ns["perturbed"]((q, k, v, cotangent), index, redraw)
        probe_arrays = leak_probe.perturbed(case, index, 1.0, convention)
        for a, b in zip(script_arrays, (*probe_arrays[:3], probe_arrays[-1])):
            assert np.array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32)), index


def test_a_script_that_cannot_run_here_exits_2_never_1_and_makes_its_host_devices(tmp_path):
    """A sharded kernel's script on one device exited 1 from its mesh's error (read as the
    failure showing) or 0 where its mesh took the devices there were (a cold review). The
    script makes MIN_DEVICES host devices on CPUs itself; too few visible, or an error before
    it judges: exit 2, 'CANNOT RUN'."""
    import dataclasses

    from harness.tools.repro.script import script_text
    from harness.tools.repro.trials import Trial
    canary = select_kernels(["canary_ignores_segments"])[0]
    case = Case.from_id(ORIGINAL)
    trial = Trial(case, run_kernel_case(canary, case, CPU, leak=False).records)
    spans = dataclasses.replace(canary, min_devices=2)
    path = tmp_path / "repro_spans.py"
    text, needs_harness = script_text(spans, case, trial, "out", 1, path)
    path.write_text(text)
    env_pythonpath = ROOT if needs_harness else None
    shows = _plain_python(path, tmp_path / "a", env_pythonpath)
    assert shows.returncode == 1 and "FAILED:" in shows.stdout, shows.stdout + shows.stderr
    one = subprocess.run([sys.executable, str(path)], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300, env={
                             **{k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
                             **({"PYTHONPATH": str(ROOT)} if needs_harness else {}),
                             "XLA_FLAGS": "--xla_force_host_platform_device_count=1"})
    assert one.returncode == 2 and "CANNOT RUN: canary_ignores_segments spans 2 devices, 1" \
        in one.stdout, one.stdout + one.stderr
    broken = tmp_path / "repro_broken.py"
    broken.write_text(text.replace("def main():", "def main():\n    raise RuntimeError('x')", 1))
    crashed = _plain_python(broken, tmp_path / "b", env_pythonpath)
    assert crashed.returncode == 2 and "CANNOT RUN: the script raised" in crashed.stdout
