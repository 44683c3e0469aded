"""The MaxText patch (patches/maxtext-0.2.5/) and the maxtext_fixed: kernels, which run MaxText's
real AttentionOp with it applied. Needs maxtext (Python >= 3.12); elsewhere the kernels are
skipped with the reason and the rest of this file is skipped.

Run: PYTHONPATH=$PWD /work/venv312/bin/python -m pytest cases/test_maxtext_fixed.py -q
"""
import functools
import importlib.util
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

from harness.kernels.kernel import Platform
from harness.engine.registry import select_kernels
from harness.engine.runner import run_kernel_case
from harness.judge import tallies
from harness.kernels import maxtext_fixed
from harness.model.case import Case
from harness.model.features import Features

HAVE_MAXTEXT = importlib.util.find_spec("maxtext") is not None and sys.version_info >= (3, 12)
needs_maxtext = pytest.mark.skipif(not HAVE_MAXTEXT,
                                   reason="maxtext is not installed (Python >= 3.12 only)")
ROOT = Path(__file__).resolve().parents[1]
CPU = Platform("cpu")
FIXED = "maxtext_fixed:cudnn_flash_jax:emulated"
ORIGINAL = "maxtext:cudnn_flash_jax:emulated"
# Smoke-suite layouts where the original op is caught: packed, unaligned, single tokens, GQA.
CASES = [Case("packed/random", 2, 256, 4, 2, 32, "bfloat16", 0),
         Case("unaligned/block-edges", 4, 256, 4, 4, 32, "float16", 0),
         Case("extremes/single-tokens", 4, 64, 4, 1, 16, "bfloat16", 1)]


def run(name, case):
    return run_kernel_case(select_kernels(name)[0], case, CPU).records


# Feature cases (harness.model.features), small.
WINDOW = Case("packed/random", 2, 256, 4, 2, 32, "bfloat16", 0, features=Features(window=(15, 0)))
UNPACKED_WINDOW = Case("unpacked/pad-tail", 2, 256, 4, 2, 32, "bfloat16", 0,
                       features=Features(window=(15, 0)))
CHUNKS = Case("packed/random", 2, 256, 4, 2, 32, "bfloat16", 0, features=Features(chunk=32))


def feature(case, **features):
    import dataclasses
    return dataclasses.replace(case, features=Features(**features))


def bad(records):
    """Records a correct harness must not show: fail, missed, error, or a known declaration
    that did not reproduce ("declared known, passed")."""
    return [r for r in records if r.outcome in ("fail", "missed", "error")
            or (r.expected == "known" and r.verdict == "pass")]


@pytest.mark.skipif(HAVE_MAXTEXT, reason="maxtext is installed here")
def test_fixed_kernels_are_skipped_with_the_reason():
    for name in ("maxtext_fixed:cudnn_flash_jax", FIXED, f"{FIXED}-sm80", ORIGINAL,
                 "maxtext_fixed:cudnn_flash_te", "maxtext_fixed:dot_product",
                 "maxtext:flash:emulated", "maxtext_fixed:flash:emulated"):
        records = run_kernel_case(select_kernels(name)[0], CASES[0], CPU).records
        assert [r.verdict for r in records] == ["skip"]
        message = records[0].message
        assert "'maxtext' is not installed" in message or "Python >= 3.12" in message, message


# ----- the patch itself ------------------------------------------------------------------------

@needs_maxtext
@pytest.mark.parametrize("tool", ["patch", "git"])
def test_patch_applies_cleanly_to_the_installed_source(tool, monkeypatch, tmp_path):
    if shutil.which(tool) is None:
        pytest.skip(f"no {tool} here")
    if tool == "git":  # hide GNU patch: the fallback
        which = shutil.which
        monkeypatch.setattr(maxtext_fixed.shutil, "which",
                            lambda n: None if n == "patch" else which(n))
    source = maxtext_fixed.original_source()
    patched = maxtext_fixed.apply_patch(source, maxtext_fixed.patch_path(), tmp_path)
    text = patched.read_text()
    assert "def _segment_ids_to_seqlens_offsets(" in text
    assert "mask_type=MaskType.PADDING_CAUSAL" in text
    assert "def validate_gpu_attention_features(" in text
    assert text.count("sliding_window_length=sliding_window_length") == 2   # packed, unpacked
    assert "_segment_ids_to_seqlens_offsets" not in source.read_text(), "the original is untouched"


@needs_maxtext
def test_patch_names_maxtexts_source_file_and_is_for_the_installed_version():
    patch = maxtext_fixed.patch_path()
    headers = [l for l in patch.read_text().splitlines() if l.startswith(("--- ", "+++ "))]
    path = maxtext_fixed.UPSTREAM_PATH
    assert headers == [f"--- a/{path}", f"+++ b/{path}"]
    assert patch.parent.name == f"maxtext-{maxtext_fixed.version_text()}"


@needs_maxtext
def test_a_patch_that_does_not_apply_is_a_clear_error(tmp_path):
    lines = maxtext_fixed.original_source().read_text().splitlines(keepends=True)
    # The decode call's last argument, in the context of the patch's hunk on the train call.
    causal = next(i for i, l in enumerate(lines) if "mask_type=MaskType.CAUSAL," in l)
    at = max(i for i in range(causal) if "return_residual=True" in lines[i])
    lines[at] = lines[at].replace("return_residual=True", "return_residual=False")
    drifted = tmp_path / "attention_op.py"
    drifted.write_text("".join(lines))
    with pytest.raises(maxtext_fixed.PatchError,
                       match=r"does not apply .*source: .*attention_op.py"):
        maxtext_fixed.apply_patch(drifted, maxtext_fixed.patch_path(), tmp_path / "out")


@needs_maxtext
def test_unknown_version_has_no_patch_and_its_kernels_skip_with_that(monkeypatch):
    with pytest.raises(maxtext_fixed.PatchError,
                       match=r"no patch for maxtext 9\.9\.9.*maxtext-0\.2\.5"):
        maxtext_fixed.patch_path("9.9.9")
    monkeypatch.setattr(maxtext_fixed, "version_text", lambda: "9.9.9")
    records = run(FIXED, CASES[0])
    assert [r.verdict for r in records] == ["skip"]
    assert "no patch for maxtext 9.9.9" in records[0].message


@needs_maxtext
def test_patched_module_is_loaded_beside_the_original():
    import maxtext.layers.attention_op as original
    fixed = maxtext_fixed.patched_module()
    assert fixed.__name__ == "maxtext.layers.attention_op_fixed" and fixed is not original
    assert sys.modules["maxtext.layers.attention_op"] is original
    helper = "_segment_ids_to_seqlens_offsets"
    assert hasattr(fixed, helper) and not hasattr(original, helper)


# ----- the kernels ------------------------------------------------------------------------------

@needs_maxtext
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_emulated_fixed_op_passes_where_the_original_is_caught(case):
    fixed = run(FIXED, case)
    assert fixed and all(r.outcome == "ok" and r.verdict == "pass" for r in fixed), \
        [(r.check, r.message) for r in fixed if r.verdict != "pass"][:3]
    checks = {r.check for r in fixed}
    assert {"out", "dq", "dk", "dv", "leak"} <= checks, checks
    for check in ("out", "dq", "dk", "dv", "leak"):   # every segment, every check
        judged = {(r.row, r.segment) for r in fixed if r.check == check}
        assert judged == {(s.row, s.number) for s in case.segments}, check
    original = run(ORIGINAL, case)
    assert any(r.outcome == "caught" and r.check == "leak" for r in original)
    assert not tallies.bad(original), [r.message for r in tallies.bad(original)][:3]


@needs_maxtext
def test_emulated_sm80_takes_the_mask_path_and_passes():
    records = run(f"{FIXED}-sm80", CASES[0])
    assert records and all(r.verdict == "pass" for r in records), records[0].message
    odd = Case("packed/random", 2, 255, 4, 2, 32, "bfloat16", 0)
    [skip] = run(f"{FIXED}-sm80", odd)
    assert skip.verdict == "skip" and "odd seq_len 255" in skip.message


def _fixed(q, k, v, seg, **kwargs):
    """maxtext_fixed.fixed_attention, jitted (eagerly, MaxText's op dispatches op by op)."""
    import jax
    return jax.jit(functools.partial(maxtext_fixed.fixed_attention, causal=True, scale=0.25,
                                     **kwargs))(q, k, v, seg)


def _inputs(rows, seq_len=64, heads=4, kv_heads=2, head_dim=16):
    import jax
    import jax.numpy as jnp
    from harness.model.layouts import segment_ids_from_rows
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    b = len(rows)
    q = jax.random.normal(keys[0], (b, seq_len, heads, head_dim), jnp.bfloat16)
    k, v = (jax.random.normal(x, (b, seq_len, kv_heads, head_dim), jnp.bfloat16) for x in keys[1:])
    return q, k, v, jnp.asarray(segment_ids_from_rows(rows, seq_len))


@needs_maxtext
def test_a_row_of_more_segments_than_max_segments_per_seq_is_nan_not_wrong():
    q, k, v, seg = _inputs([(10, 10, 10, 10, 10), (30, 20)])
    out = np.asarray(_fixed(q, k, v, seg, max_segments=4, attention="cudnn_flash_jax", emulate=9.0),
                     np.float32)
    assert np.isnan(out[0, :50]).all(), "the row with 5 segments over M=4 must be NaN"
    assert np.isfinite(out[1]).all()


@needs_maxtext
def test_packing_without_max_segments_per_seq_is_refused():
    q, k, v, seg = _inputs([(30, 20)])
    with pytest.raises(ValueError, match="max_segments_per_seq must be set when using "
                                         "cudnn_flash_jax attention and packing"):
        _fixed(q, k, v, seg, max_segments=-1, attention="cudnn_flash_jax", emulate=9.0)


@needs_maxtext
@pytest.mark.parametrize("emulate", [8.0, None])   # an sm80 GPU; this CPU (not Hopper either)
def test_packing_with_cudnn_flash_te_below_hopper_is_refused(emulate):
    q, k, v, seg = _inputs([(30, 20)])
    with pytest.raises(ValueError, match="Packing with attention=cudnn_flash_te requires a GPU "
                                         "with compute capability 9.0 or newer"):
        _fixed(q, k, v, seg, max_segments=4, attention="cudnn_flash_te", emulate=emulate)


def _te_reporting_cudnn(monkeypatch, version):
    """A stand-in for the one TE function the patch reads: the cuDNN runtime TE runs."""
    import types
    names = ["transformer_engine", "transformer_engine.jax", "transformer_engine.jax.cpp_extensions"]
    for name in names:
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    misc = types.ModuleType("transformer_engine.jax.cpp_extensions.misc")
    misc.get_cudnn_version = lambda: version
    monkeypatch.setitem(sys.modules, misc.__name__, misc)


@needs_maxtext
@pytest.mark.parametrize("version, refused", [((9, 19, 0), True), ((9, 25, 9), True),
                                              ((9, 26, 0), False)])
def test_sinks_with_packing_on_cudnn_flash_te_are_refused_where_te_cannot_apply_them(
        monkeypatch, version, refused):
    """TE falls back to an unfused path that fails on packed rows where its cuDNN is below 9.26
    (reports/census-features-h200/): the patched op refuses the sinks when it is configured,
    naming them; from 9.26 on it hands them to TE (here no TE runs past the version check)."""
    import jax.numpy as jnp
    _te_reporting_cudnn(monkeypatch, version)
    q, k, v, seg = _inputs([(30, 20)])
    sinks = jnp.zeros((q.shape[2],), jnp.float32)
    with pytest.raises(Exception) as raised:
        _fixed(q, k, v, seg, max_segments=4, attention="cudnn_flash_te", emulate=9.0, sinks=sinks)
    text = str(raised.value)
    if refused:
        assert raised.type is ValueError, text
        assert "Attention sinks with packing (attention=cudnn_flash_te)" in text
        assert f"cuDNN {'.'.join(map(str, version))}" in text
    else:
        assert "Attention sinks with packing" not in text   # past the check: TE's import fails


@needs_maxtext
def test_emulation_is_undone_after_the_call():
    from jax._src.cudnn import fused_attention_stablehlo as sdpa
    before = (sdpa.dot_product_attention, sdpa.check_compute_capability)
    q, k, v, seg = _inputs([(30, 20)])
    _fixed(q, k, v, seg, max_segments=4, attention="cudnn_flash_jax", emulate=9.0)
    assert (sdpa.dot_product_attention, sdpa.check_compute_capability) == before
    assert not sdpa.check_compute_capability("9.0"), "a CPU is no Hopper GPU"


# ----- features ---------------------------------------------------------------------------------

@needs_maxtext
@pytest.mark.parametrize("name", [FIXED, f"{FIXED}-sm80"])
@pytest.mark.parametrize("case", [WINDOW, feature(CASES[2], window=(5, 0))], ids=lambda c: c.id)
def test_the_patched_op_honours_a_causal_window(name, case):
    """cudnn_flash_jax with the patch: sliding_window_length on the packed path (the emulator
    takes it as cuDNN does: a left bound, the right bound the query under a causal mask type),
    the window in the mask on the sm80 path; every segment passes, the leak probe included
    (its blocks inside the segments redraw keys just beyond each window)."""
    records = run(name, case)
    assert records and all(r.outcome == "ok" for r in records), \
        [(r.check, r.where, r.message) for r in records if r.outcome != "ok"][:3]
    judged = {(r.row, r.segment) for r in records if r.check == "leak"}
    assert judged == {(s.row, s.number) for s in case.segments}


@needs_maxtext
@pytest.mark.parametrize("features, name, words", [
    ({"softcap": 2.0}, "softcap", "attn_logits_soft_cap is not supported with "
                                  "attention=cudnn_flash_jax"),
    ({"chunk": 32}, "chunk", "Chunk attention (attention_type=chunk) is not supported with "
                             "attention=cudnn_flash_jax"),
    ({"sinks": True}, "sinks", "Attention sinks on GPU are only supported with "
                               "attention=cudnn_flash_te. Got attention_kernel='cudnn_flash_jax'"),
    ({"window": (15, 0), "softcap": 2.0}, "softcap", "attn_logits_soft_cap"),
], ids=["softcap", "chunk", "sinks", "window+softcap"])
def test_the_patched_op_refuses_what_cudnn_flash_jax_cannot_apply(features, name, words):
    """Refused while tracing, naming the feature: the op raises at configuration (soft cap,
    chunks) or before calling cuDNN (sinks, a call argument)."""
    [record] = run(FIXED, feature(CASES[0], **features))
    assert record.outcome == "refused", record.message
    assert f"refused {name} while tracing" in record.message and words in record.message


@needs_maxtext
def test_the_original_op_drops_the_window_and_the_harness_says_so():
    """maxtext 0.2.5 through the same emulator: the window is dropped. On unpacked rows (where
    its segment-ids bug cannot show) every tolerance check is known with the diagnosis, and the
    leak probe catches the keys outside the window; on packed rows the segments that read
    nothing before them are known, the others caught; nothing fails, no declaration is idle."""
    records = run(ORIGINAL, UNPACKED_WINDOW)
    assert not bad(records), [(r.check, r.where, r.outcome, r.message) for r in bad(records)][:3]
    known = [r for r in records if r.outcome == "known"]
    assert {r.check for r in known} == {"out", "dq", "dk", "dv"}
    assert all(r.diagnosis == "matches the mask without the window: the window was dropped"
               and "ignores the sliding window" in r.message for r in known)
    assert {r.outcome for r in records if r.check == "leak"} == {"caught"}
    packed = run(ORIGINAL, WINDOW)
    assert not bad(packed), [(r.check, r.where, r.outcome, r.message) for r in bad(packed)][:3]
    assert {r.segment for r in packed if r.outcome == "known"} == {1}


@needs_maxtext
def test_the_original_op_drops_the_soft_cap_too():
    records = run(ORIGINAL, feature(UNPACKED_WINDOW, softcap=2.0))
    assert not bad(records), [(r.check, r.where, r.outcome, r.message) for r in bad(records)][:3]
    assert any(r.outcome == "known" and "matches the mask without the soft cap" in r.message
               for r in records)
    assert {r.outcome for r in records if r.check == "leak"} == {"ok"}   # values, not reads


@needs_maxtext
def test_the_patched_packed_path_hands_cudnn_one_head_dim():
    """jax's packed cuDNN layout strides the value and output by the query's head dim (silently
    wrong on the H200 for MLA): the patched op pads q, k and v to one head dim and slices the
    output, which equals dot_product's."""
    from harness.sut import cudnn_emulator
    q, k, v, seg = _inputs([(30, 20), (64,)])
    v = v[..., :8]
    shapes = []
    real = cudnn_emulator.dot_product_attention

    def recording(query, key, value, *args, **kwargs):
        shapes.append((query.shape[-1], key.shape[-1], value.shape[-1],
                       kwargs.get("q_offsets") is not None))
        return real(query, key, value, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cudnn_emulator, "dot_product_attention", recording)
        out = _fixed(q, k, v, seg, max_segments=4, attention="cudnn_flash_jax", emulate=9.0)
    assert shapes == [(16, 16, 16, True)] and out.shape == (2, 64, 4, 8)
    want = _fixed(q, k, v, seg, max_segments=4, attention="dot_product")
    valid = np.asarray(seg) > 0          # padding outputs are each path's own
    np.testing.assert_allclose(np.asarray(out, np.float32)[valid],
                               np.asarray(want, np.float32)[valid], atol=2e-2)


@needs_maxtext
def test_flash_drops_window_and_chunks_unpatched_and_honours_them_patched():
    """MaxText's GPU flash path on tokamax's XLA reference (in place of Triton): 0.2.5 masks
    causal and same-segment only (known), the patch adds the window and the chunks to its mask
    and refuses the soft cap."""
    original = run("maxtext:flash:emulated", CHUNKS)
    assert not bad(original), [(r.check, r.where, r.outcome) for r in bad(original)][:3]
    known = [r for r in original if r.outcome == "known"]
    assert known and all(r.diagnosis == "matches the mask without the chunks: the chunks were "
                                        "dropped" for r in known)
    assert all(r.convention == "chunks from the row's start" for r in original)
    for case in (CHUNKS, WINDOW):
        fixed = run("maxtext_fixed:flash:emulated", case)
        assert fixed and all(r.outcome == "ok" for r in fixed), \
            [(r.check, r.where, r.message) for r in fixed if r.outcome != "ok"][:3]
    [refused] = run("maxtext_fixed:flash:emulated", feature(CASES[0], softcap=2.0))
    assert refused.outcome == "refused" and "attention=flash" in refused.message


@needs_maxtext
def test_the_patched_dot_product_honours_every_feature():
    case = Case("padded/between", 2, 256, 4, 2, 32, "bfloat16", 0,
                features=Features(window=(15, 0), softcap=2.0, sinks=True))
    records = run("maxtext_fixed:dot_product", case)
    assert records and all(r.outcome == "ok" for r in records), \
        [(r.check, r.where, r.message) for r in records if r.outcome != "ok"][:3]
    assert "dsinks" in {r.check for r in records}


@needs_maxtext
def test_gpu_only_fixed_kernels_declare_the_features_and_skip_on_cpu():
    for name in ("maxtext_fixed:cudnn_flash_jax", "maxtext_fixed:cudnn_flash_te"):
        kernel = select_kernels(name)[0]
        assert set(kernel.features) == {"window", "softcap", "chunk", "sinks", "head_dim_v"}
        assert kernel.chunk_convention == "row" and kernel.expect is None   # nothing dropped
        [skip] = run(name, WINDOW)
        assert skip.verdict == "skip" and "runs on gpu" in skip.message


# ----- MaxText's own test of the patch (from the patch) -----------------------------------------

@needs_maxtext
def test_maxtexts_test_of_the_patch_runs_its_cpu_parts_and_skips_the_gpu_ones():
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "maxtext_patch_test.py"), "-q"],
                          cwd=tempfile.gettempdir(), capture_output=True, text=True, timeout=600)
    tail = proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert "16 passed, 16 skipped" in proc.stdout, tail
    assert proc.stdout.count("Requires a GPU.") == 4, tail   # four skip lines of 4 tests each


# ----- the bench before/after (python -m harness bench: MaxText's op before and after) ----

@needs_maxtext
def test_the_bench_times_maxtexts_op_before_and_after_the_patch(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "harness", "bench", "--shapes", "small",
                           "--repeats", "2", "--output", str(out), "--kernels",
                           "maxtext:cudnn_flash_jax,maxtext_fixed:cudnn_flash_jax"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    import json
    report = json.loads(out.read_text())
    seed = next(r for r in report["results"] if r["shape"] == "seed")
    rows = {e["entry"]: e for e in seed["entries"]}
    assert [rows[n]["via"] for n in ("maxtext:cudnn_flash_jax",
                                     "maxtext_fixed:cudnn_flash_jax")] == ["emulator", "emulator"]
    assert all(len(e["times_ms"]) == 2 and e["median_ms"] > 0 for e in rows.values())
    goal = next(g for g in report["goals"] if g["goal"] == "patch_after_vs_before")
    after, before = (rows[n]["median_ms"] for n in ("maxtext_fixed:cudnn_flash_jax",
                                                    "maxtext:cudnn_flash_jax"))
    assert goal["value"] == pytest.approx(after / before)
