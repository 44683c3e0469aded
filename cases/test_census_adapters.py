"""The census adapters (harness/kernels/tokamax_adapter.py, flash_attn.py, te_flax.py,
jax_nn.py) on a CPU:
- the modules import without their libraries, and kernels whose library is missing are
  skipped with "optional dependency ... is not installed";
- the adapters that run on CPUs (tokamax's xla and xla_chunked) pass the harness;
- the lowerings the adapters do themselves (cu_seqlens for the FlashAttention ports, lengths
  and offsets for TE) are right, checked through the harness with a reference varlen call;
- each GPU-only adapter whose library imports here lowers for CUDA with its fused-kernel
  marker (`lowering_platforms=("cuda",)` on the CPU; the device queries the libraries make
  while tracing are answered as the H200 would: cuDNN 9.19, 132 SMs, tokamax's device checks);
- tokamax's triton and mosaic raise, when traced for CUDA, the upstream errors their kernels
  declare as known;
- each adapter hands the features it declares to its library's call as the library documents
  them (the window's convention per library, TE's learnable softmax offset, tokamax's soft
  cap), checked on the call's arguments (stand-ins recording them: TE, tokamax, the
  FlashAttention ports), in the program lowered for CUDA where that lowers here (jax's cuDNN
  calls), and judged by the harness where a stand-in computes what the library documents or
  the library itself runs here (tokamax's xla paths, the cuDNN emulator).
"""
import dataclasses
import enum
import functools
import importlib
import importlib.machinery
import importlib.util
import os
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness.kernels.kernel import Kernel, Platform
from harness.engine.program_functions import argument_shapes, kernel_fn
from harness.engine.registry import select_kernels
from harness.engine.runner import run_kernel_case
from harness.model.case import Case
from harness.model.features import Features

MODULES = {"harness.kernels.tokamax_adapter": ["tokamax"],
           "harness.kernels.flash_attn": ["flash_attn_jax", "flash_attn3_jax"],
           "harness.kernels.te_flax": ["transformer_engine", "flax"],
           "harness.kernels.te": ["transformer_engine", "flax"],
           "harness.kernels.jax_nn": []}
CENSUS = ["tokamax:xla", "tokamax:xla_chunked", "tokamax:cudnn", "tokamax:triton",
          "tokamax:mosaic", "flash_attn:varlen", "flash_attn:varlen_vmap", "flash_attn3:varlen",
          "te:flax_segment_ids", "te:flax_seqlens_offsets", "jax_nn:cudnn",
          "jax_nn:cudnn_packed"]
LOWERED = ["tokamax:cudnn", "flash_attn:varlen", "flash_attn:varlen_vmap", "flash_attn3:varlen",
           "te:flax_segment_ids", "te:flax_seqlens_offsets", "jax_nn:cudnn",
           "jax_nn:cudnn_packed"]
H200_CUDNN = 91900    # cuDNN 9.19, as jax reports it on the H200 runner
H200_SMS = 132

HAVE_TOKAMAX = importlib.util.find_spec("tokamax") is not None
CPU_CASES = [Case("packed/random", 2, 256, 4, 2, 32, "bfloat16", 0),
             Case("padded/between", 4, 256, 4, 4, 32, "float32", 0),
             Case("padded/between", 4, 256, 4, 2, 32, "bfloat16", 2, causal=False),
             Case("unaligned/block-edges", 4, 256, 2, 1, 16, "float32", 1)]
GPU_CASES = [Case("padded/between", 2, 256, 4, 2, 128, "bfloat16", 0),
             Case("packed/random", 2, 256, 4, 4, 128, "float16", 1, causal=False)]


def _missing(kernel: Kernel) -> list[str]:
    return [m for m in kernel.requires if importlib.util.find_spec(m.split(".")[0]) is None]


def test_census_kernels_are_registered_with_their_isolation():
    kernels = {k.name: k for k in select_kernels(CENSUS)}
    assert kernels["flash_attn:varlen"].isolation == "flash_attn2"
    assert kernels["flash_attn:varlen_vmap"].isolation == "flash_attn2"
    assert kernels["flash_attn3:varlen"].isolation == "flash_attn3"
    assert {k.isolation for n, k in kernels.items() if not n.startswith("flash_attn")} == {None}
    assert all(k.hlo_markers for n, k in kernels.items() if n in LOWERED)


def test_adapter_modules_import_without_their_libraries():
    """In a fresh interpreter whose import of each library fails (as where it is not
    installed), every adapter module still imports, and none of the libraries was touched."""
    blocked = sorted({m for mods in MODULES.values() for m in mods})
    script = f"""
import sys
BLOCKED = {blocked!r}
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError("blocked for the test: " + name)
sys.meta_path.insert(0, Block())
import harness.kernels
for module in {sorted(MODULES)!r}:
    __import__(module)
print(sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("name", CENSUS)
def test_kernels_without_their_library_are_skipped_with_the_reason(name):
    kernel = select_kernels(name)[0]
    missing = _missing(kernel)
    if not missing:
        pytest.skip(f"{name}: {', '.join(kernel.requires) or 'jax'} installed here")
    case = GPU_CASES[0]
    for platform in (Platform("cpu"), Platform("gpu", 9.0)):
        records = run_kernel_case(kernel, case, platform).records
        assert [r.verdict for r in records] == ["skip"]
        assert f"optional dependency {missing[0]!r} is not installed" in records[0].message


@pytest.mark.skipif(not HAVE_TOKAMAX, reason="tokamax is not installed (Python >= 3.12 only)")
@pytest.mark.parametrize("name", ["tokamax:xla", "tokamax:xla_chunked"])
@pytest.mark.parametrize("case", CPU_CASES, ids=lambda c: c.id)
def test_tokamax_xla_paths_pass_on_cpu(name, case):
    kernel = select_kernels(name)[0]
    records = run_kernel_case(kernel, case, Platform("cpu")).records
    assert records and all(r.verdict == "pass" for r in records), \
        [r.message for r in records if r.verdict != "pass"][:3]


# ----- the adapters' own lowerings, with a reference in place of the library ---------------

def reference_varlen(q, k, v, cu_q, cu_k, *, max_seqlen_q, max_seqlen_k, softmax_scale,
                     is_causal, window_size=(-1, -1)):
    """flash_mha_varlen's meaning on one token stream: token i belongs to sequence m where
    cu[m] <= i < cu[m+1]; tokens from cu[-1] on form one more sequence (what the vmap rule of
    flash-attn-jax makes of a row's tail); each attends within its own sequence. The ports'
    window (their mask.h): keys [i + (sk - sq) - left, i + (sk - sq) + right] of the sequence,
    -1 unbounded, `is_causal` forcing right to 0 (sk = sq here)."""
    del cu_k, max_seqlen_k
    n = q.shape[0]
    seq = jnp.searchsorted(cu_q[1:], jnp.arange(n), side="right")
    lengths = jnp.diff(cu_q)
    mask = seq[:, None] == seq[None, :]
    if is_causal:
        mask &= jnp.tril(jnp.ones((n, n), bool))
    left, right = window_size
    right = 0 if is_causal else right
    i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]   # same sequence: same offset
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    group = q.shape[1] // k.shape[1]
    kf = jnp.repeat(k, group, axis=1).astype(jnp.float32)
    vf = jnp.repeat(v, group, axis=1).astype(jnp.float32)
    logits = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), kf) * softmax_scale
    weights = jax.nn.softmax(jnp.where(mask[None], logits, -jnp.inf), axis=-1)
    out = jnp.einsum("hqk,khd->qhd", weights, vf)
    return jnp.where(jnp.max(lengths) <= max_seqlen_q, out, jnp.nan).astype(q.dtype)


REFERENCE_CASES = [Case("padded/between", 4, 256, 4, 2, 32, "bfloat16", 2, causal=False),
                   Case("padded/left", 4, 256, 4, 1, 32, "bfloat16", 0, causal=False),
                   Case("extremes/single-tokens", 4, 64, 2, 2, 16, "float32", 1),
                   Case("packed/many", 2, 256, 2, 1, 16, "float32", 3, causal=False)]


@pytest.mark.parametrize("way", ["_flattened", "_vmapped"])
@pytest.mark.parametrize("case", REFERENCE_CASES, ids=lambda c: c.id)
def test_flash_attn_cu_seqlens_keep_segments_apart(way, case):
    """The adapters' cu_seqlens (flattened, and per row for the vmap rule), fed to a reference
    varlen call: every check of the harness passes, padding before, between and after
    segments included. Breaking them (e.g. dropping the padding runs) makes this fail."""
    from harness.kernels import flash_attn
    fn = functools.partial(getattr(flash_attn, way), reference_varlen)
    kernel = Kernel(f"reference{way}", fn, takes_max_segments=True, padding_anywhere=True)
    records = run_kernel_case(kernel, case, Platform("cpu")).records
    assert records and all(r.verdict == "pass" for r in records), \
        [r.message for r in records if r.verdict != "pass"][:3]


def test_flash_attn_slots_cover_every_run():
    from harness.kernels.flash_attn import flat_cu_seqlens, row_cu_seqlens
    case = Case("padded/between", 4, 256, 4, 4, 32, "float32", 0)
    seg = jnp.asarray(case.segment_ids)
    flat = np.asarray(flat_cu_seqlens(seg, case.max_segments))
    ids = case.segment_ids.reshape(-1)
    assert flat[0] == 0 and flat[-1] == ids.size and np.all(np.diff(flat) >= 0)
    for lo, hi in zip(flat[:-1], flat[1:]):
        if hi > lo:   # one run of one row: one id, one row
            assert len(set(ids[lo:hi])) == 1 and lo // case.seq_len == (hi - 1) // case.seq_len
    rows = np.asarray(row_cu_seqlens(seg, case.max_segments))
    for r, segments in enumerate(case.row_segments(i) for i in range(case.batch)):
        assert rows[r, -1] == segments[-1].stop
        assert {s.start for s in segments} <= set(rows[r].tolist())


@pytest.mark.parametrize("layout", ["packed/random", "padded/between", "padded/left",
                                    "extremes/pad-heavy"])
def test_te_lengths_and_offsets_follow_the_segments(layout):
    from harness.kernels.te_flax import segment_starts_and_lengths
    from harness.sut.lowering import lengths_and_offsets
    case = Case(layout, 4, 256, 4, 4, 32, "bfloat16", 0)
    m = case.max_segments
    seqlens, offsets = map(np.asarray, segment_starts_and_lengths(jnp.asarray(case.segment_ids), m))
    assert seqlens.shape == (4, m) and offsets.shape == (4, m + 1)
    for r in range(case.batch):
        segments = case.row_segments(r)
        want = [s.length for s in segments] + [-1] * (m - len(segments))
        assert seqlens[r].tolist() == want
        assert offsets[r].tolist() == [s.start for s in segments] + [-1] * (m + 1 - len(segments))
    if not case.padding_inside:   # where the op's own lowering applies, both agree
        ref = lengths_and_offsets(jnp.asarray(case.segment_ids), m)
        assert np.array_equal(seqlens, ref[0]) and np.array_equal(offsets, ref[1])


# ----- lowering for CUDA on the CPU ------------------------------------------------------

def _import_library(kernel: Kernel):
    """Imports the kernel's library as the kernel does; skips (with the reason) where it is not
    installed or cannot be imported without a GPU's libraries."""
    missing = _missing(kernel)
    if missing:
        pytest.skip(f"{kernel.name}: optional dependency {missing[0]!r} is not installed")
    clash = [k.name for k in select_kernels(CENSUS) if k.isolation not in (None, kernel.isolation)
             and k.requires[0] in sys.modules]
    if kernel.isolation and clash:   # on a GPU the second library's import would fail
        pytest.skip(f"{kernel.name} cannot share a process with {clash[0]} (isolation "
                    f"{kernel.isolation!r}): select one group with -k")
    try:
        if kernel.name.startswith("flash_attn:"):
            from harness.kernels.flash_attn import fa2_module
            return fa2_module()
        module = {"flash_attn3": "flash_attn3_jax", "te": "transformer_engine.jax.flax",
                  "tokamax": "tokamax"}.get(kernel.name.split(":")[0])
        return importlib.import_module(module) if module else None
    except (ImportError, OSError) as exc:
        pytest.skip(f"{kernel.name}: its library does not import on this machine: {exc}")


@pytest.fixture
def as_on_the_h200(monkeypatch):
    """Answers, as the H200 would, what the libraries ask the device while tracing: jax's cuDNN
    version and compute capability checks (cuDNN is not loaded on a CPU), tokamax's device
    checks, and flash-attn-jax's SM count (read from the CUDA runtime at lowering). Nothing
    else changes."""
    from jax._src.cudnn import fused_attention_stablehlo
    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: H200_CUDNN)
    # jax asks the first GPU's compute capability (the packed layout and MLA need 9.0).
    monkeypatch.setattr(fused_attention_stablehlo, "check_compute_capability",
                        lambda capability: tuple(map(int, capability.split("."))) <= (9, 0))
    monkeypatch.setattr(fused_attention_stablehlo, "is_cuda_compute_capability_equal",
                        lambda capability: capability == "9.0")

    def patch(kernel: Kernel):
        if kernel.name.startswith("tokamax:"):
            from tokamax._src.ops.attention import jax_nn as tokamax_jax_nn
            monkeypatch.setattr(tokamax_jax_nn.JaxNnDotProductAttention, "supported_on",
                                lambda self, device: True)
        if kernel.name.startswith("flash_attn:"):
            from flash_attn_jax import varlen_bwd, varlen_fwd
            for module in (varlen_fwd, varlen_bwd):
                monkeypatch.setattr(module, "get_sm_count", lambda *a: H200_SMS)
    return patch


def lowered_for_cuda(fn, case) -> str:
    return jax.jit(fn).trace(*argument_shapes(case)).lower(
        lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("case", GPU_CASES, ids=lambda c: c.id)
@pytest.mark.parametrize("name", LOWERED)
def test_gpu_adapters_lower_for_cuda_with_their_markers(name, case, as_on_the_h200):
    """The kernel's whole program (forward and gradients, as the harness builds it) lowered for
    CUDA holds every fused-kernel marker the kernel declares."""
    kernel = select_kernels(name)[0]
    _import_library(kernel)
    as_on_the_h200(kernel)
    text = lowered_for_cuda(kernel_fn(kernel, case), case)
    assert [m for m in kernel.hlo_markers if m not in text] == []


def test_the_mask_path_lowers_to_a_cudnn_bias(as_on_the_h200):
    """jax_nn:cudnn reaches cuDNN with the mask as a bias (not the causal-only call)."""
    kernel = select_kernels("jax_nn:cudnn")[0]
    text = lowered_for_cuda(kernel_fn(kernel, GPU_CASES[0]), GPU_CASES[0])
    assert "__cudnn$fmhaScaleBiasSoftmax" in text and "Backward" in text


@pytest.mark.skipif(not HAVE_TOKAMAX, reason="tokamax is not installed (Python >= 3.12 only)")
def test_tokamax_triton_raises_its_known_upstream_error(monkeypatch):
    """tokamax:triton's declared error is what tracing its kernel for CUDA raises (with
    tokamax's device check answered as on a GPU): pl.dot, removed from jax."""
    if jax.__version_info__ < (0, 11):
        pytest.skip(f"jax {jax.__version__} still has pl.dot")
    from tokamax._src.ops.attention import pallas_triton
    monkeypatch.setattr(pallas_triton.PallasTritonFlashAttention, "supported_on",
                        lambda self, device: True)
    kernel = select_kernels("tokamax:triton")[0]
    with pytest.raises(Exception) as info:
        lowered_for_cuda(kernel_fn(kernel, GPU_CASES[0]), GPU_CASES[0])
    assert kernel.expect_error in f"{info.type.__name__}: {info.value}"


@pytest.mark.skipif(not HAVE_TOKAMAX, reason="tokamax is not installed (Python >= 3.12 only)")
def test_tokamax_mosaic_raises_its_known_upstream_error(monkeypatch):
    """tokamax:mosaic's declared error is what tracing its Mosaic GPU kernel raises (tokamax's
    checks for an sm90 device answered yes). tokamax maps implementation "mosaic" to
    "mosaic_gpu" only when the default device is NVIDIA's, so on the CPU the adapter is called
    with "mosaic_gpu" directly."""
    from tokamax._src import gpu_utils
    from tokamax._src.ops.attention import pallas_mosaic_gpu

    from harness.kernels.tokamax_adapter import tokamax_attention
    monkeypatch.setattr(pallas_mosaic_gpu.PallasMosaicGpuFlashAttention, "supported_on",
                        lambda self, device: True)
    for check, answer in (("has_mosaic_gpu_support", True), ("is_sm90", True),
                          ("is_sm100", False)):
        monkeypatch.setattr(gpu_utils, check, lambda *a, answer=answer: answer)
    kernel = select_kernels("tokamax:mosaic")[0]
    on_cpu = Kernel("mosaic_gpu", functools.partial(tokamax_attention,
                                                    implementation="mosaic_gpu"))
    with pytest.raises(Exception) as info:
        lowered_for_cuda(kernel_fn(on_cpu, GPU_CASES[0]), GPU_CASES[0])
    assert kernel.expect_error in f"{info.type.__name__}: {info.value}"


def test_the_fa2_vmap_padding_bug_is_predicted_row_by_row_from_the_inputs(monkeypatch):
    """flash-attn-jax 0.6.2's vmap rule drops the log-sum-exp of each row's trailing padding
    (a sequence of its own once the rows are flattened) and never writes the last row's
    (harness.kernels.flash_attn.vmap_rule_padding). The prediction, from the case's inputs,
    against what the H200 measured: every padded row of a nightly (night 1 of the 831b954
    series), and the float16 rows of the flake study's four seeds (where dv overflows at
    float16's threshold), failing and passing rows both; and before unwritten memory was
    poisoned (the census, at 18b7f5f), every row but the last ones, whose contents were left
    over from other programs. The rows are fixtures cut from those runs' records and digest
    (cases/fixtures/README.md)."""
    import gzip
    import json
    from pathlib import Path
    from harness.engine.registry import all_kernels
    from harness.views import digest
    kernel = all_kernels()["flash_attn:varlen_vmap"]
    fixtures = Path(__file__).resolve().parent / "fixtures" / "h200"

    def rows(path):
        for line in gzip.open(path, "rt"):
            r = json.loads(line)
            if r.get("type") == "record" and r["kernel"] == kernel.name and r["check"] == "padding":
                yield Case.from_id(r["case_id"]), r["row"], r["verdict"]

    def digest_rows(path):      # a digest (harness.views.digest)
        for r in digest.read(path):
            if r["kernel"] == kernel.name and r["check"] == "padding":
                yield Case.from_id(r["case_id"]), int(r["row"]), r["verdict"]

    measured = list(rows(fixtures / "series-831b954-night1-vmap-padding.jsonl.gz"))
    predicted = [kernel.expected_padding(case, row)[0] for case, row, _ in measured]
    assert predicted == [verdict for *_, verdict in measured]
    assert predicted.count("fail") == 72 and predicted.count("pass") == 17
    # The flake study's padded float16 rows, four seeds (all 252 padded rows of its cases agree;
    # drawing every case's inputs would take CI most of a minute).
    flake = [(c, row, v) for c, row, v
             in digest_rows(fixtures / "flake-4-seeds-vmap-padding.tsv.gz")
             if c.dtype == "float16"]
    predicted = [kernel.expected_padding(case, row)[0] for case, row, _ in flake]
    assert predicted == [verdict for *_, verdict in flake]
    assert len(flake) == 20 and {c.seed for c, *_ in flake} == {2, 3, 4, 5}
    # Three float16 rows fail only by dv's float16 overflow: float32's threshold misses them.
    from harness.kernels import flash_attn
    float16 = [(c, row) for c, row, v in flake
               if v == "fail" and c.dtype == "float16" and row < c.batch - 1]
    monkeypatch.setattr(flash_attn, "_ln_overflow", lambda dtype: flash_attn.LN_FLOAT32_MAX)
    assert [kernel.expected_padding(c, row)[0] for c, row in float16].count("pass") == 3
    monkeypatch.undo()
    before = [(case, row, verdict) for case, row, verdict
              in rows(fixtures / "census-fa-18b7f5f-vmap-padding.jsonl.gz")]
    wrong = [(case.id, row) for case, row, verdict in before
             if kernel.expected_padding(case, row)[0] != verdict]
    assert wrong and all(row == Case.from_id(case_id).batch - 1 for case_id, row in wrong)


# ----- features: each reaches its library's call as the library documents it -------------

# What each adapter's library API takes (harness.model.features), as the kernels declare it.
DECLARED = {
    "jax_nn:cudnn": ("window", "head_dim_v"),
    "jax_nn:cudnn_packed": ("window", "head_dim_v"),
    "jax_nn:cudnn_packed:emulated": ("window", "head_dim_v"),
    "te:thd": ("window", "sinks", "head_dim_v"),
    "te:unfused_fallback": ("window", "sinks", "head_dim_v"),
    "te:flax_segment_ids": ("window", "sinks", "head_dim_v"),
    "te:flax_seqlens_offsets": ("window", "sinks", "head_dim_v"),
    "sut:cudnn_flash_te": ("window", "softcap", "chunk", "sinks", "head_dim_v"),
    **{f"tokamax:{impl}": ("window", "softcap", "head_dim_v")
       for impl in ("xla", "xla_chunked", "cudnn", "triton", "mosaic")},
    "flash_attn:varlen": ("window",),
    "flash_attn:varlen_vmap": ("window",),
    "flash_attn3:varlen": ("window",),
}
CAUSAL_WINDOW = Features(window=(16, 0))
BIDIR_WINDOW = Features(window=(16, 8))
HAVE_FLAX = importlib.util.find_spec("flax") is not None


def feature_case(features: Features, causal: bool = True, layout: str = "packed/random",
                 seq_len: int = 128, head_dim: int = 32, dtype: str = "bfloat16") -> Case:
    return Case(layout, 2, seq_len, 4, 2, head_dim, dtype, 0, causal=causal, features=features)


def on_cpu(kernel: Kernel, **changes) -> Kernel:
    """The kernel's own function with CPU capabilities (its library a stand-in here)."""
    return dataclasses.replace(kernel, name=f"cpu:{kernel.name}", devices=("cpu",),
                               min_compute_capability=None, hlo_markers=(),
                               forward_markers=(), **changes)


def judged(kernel: Kernel, case: Case, platform: Platform | None = None):
    return run_kernel_case(kernel, case, platform or Platform("cpu")).records


def not_ok(records) -> list:
    return [(r.check, r.row, r.segment, r.verdict, r.message[:160]) for r in records
            if r.outcome != "ok"][:4]


def abstract_call(kernel: Kernel, case: Case, **overrides):
    """The kernel's function traced (nothing computed) on the case's shapes, its features handed
    over as the harness hands them."""
    from harness.engine.program_functions import feature_arguments
    shapes = argument_shapes(case)[:-1]                         # no cotangent
    extra = {"max_segments": case.max_segments} if kernel.takes_max_segments else {}
    extra.update(feature_arguments(case), **overrides)

    def fn(q, k, v, seg, *sinks):
        return kernel.fn(q, k, v, seg, causal=case.causal, scale=case.scale, **extra,
                         **({"sinks": sinks[0]} if sinks else {}))
    return jax.eval_shape(fn, *shapes)


def test_adapters_declare_the_features_their_apis_take():
    """No library API here has a chunk argument (only the op, which refuses it by name on its
    fused paths); sinks only TE's learnable softmax; a soft cap only tokamax (and the op)."""
    kernels = {k.name: k for k in select_kernels(list(DECLARED))}
    assert {name: k.features for name, k in kernels.items()} == DECLARED


# jax.nn.dot_product_attention(implementation="cudnn") ---------------------------------------

@pytest.mark.parametrize("causal,features", [(True, CAUSAL_WINDOW), (False, BIDIR_WINDOW),
                                             (False, Features(window=(16, 0)))],
                         ids=["causal", "bidir", "bidir-left-only"])
def test_jax_nn_cudnn_passes_the_window_as_local_window_size(causal, features, monkeypatch):
    calls = []

    def recorder(query, key, value, **kwargs):
        calls.append(kwargs)
        return jnp.zeros(query.shape[:3] + value.shape[3:], query.dtype)
    monkeypatch.setattr(jax.nn, "dot_product_attention", recorder)
    kernel = select_kernels("jax_nn:cudnn")[0]
    abstract_call(kernel, feature_case(features, causal))
    assert calls[-1]["local_window_size"] == features.window
    assert calls[-1]["is_causal"] is causal and calls[-1]["implementation"] == "cudnn"


def test_jax_nn_cudnn_lowers_the_window_to_cudnns_sliding_window(as_on_the_h200):
    """Causal (16, 0): cuDNN's W = 17 with the causal mask. Non-causal (16, 0): jax sends the
    same W without any mask type, which cuDNN reads as a left bound only (keys [i - 16, end of
    row], measured on the H200): passed on as a user's call passes it, for the GPU run to judge
    (never refused here)."""
    kernel = select_kernels("jax_nn:cudnn")[0]
    for causal, mask in ((True, "CAUSAL"), (False, "NO_MASK")):
        case = feature_case(Features(window=(16, 0)), causal, seq_len=256, head_dim=128)
        text = lowered_for_cuda(kernel_fn(kernel, case), case)
        assert "__cudnn$fmhaScaleBiasSoftmax" in text
        assert r"\22sliding_window_length\22: 17" in text
        assert rf"\22mask_type\22: \22{mask}\22" in text


@pytest.mark.parametrize("features,causal,word", [(BIDIR_WINDOW, False, "window"),
                                                  (Features(head_dim_v=16), True, "head_dim_v")],
                         ids=["right-window", "head_dim_v"])
def test_jax_nn_cudnn_refusals_are_jaxs_own_while_tracing(features, causal, word):
    """jax raises while tracing, before cuDNN is asked for anything: a right bound without the
    causal mask ("cuDNN doesn't support right window"), a value head dim of its own ("value
    shape should be ..."). The harness records both as refused, naming the feature."""
    kernel = select_kernels("jax_nn:cudnn")[0]
    records = judged(kernel, feature_case(features, causal, seq_len=256, head_dim=128),
                     Platform("gpu", 9.0))
    assert [r.verdict for r in records] == ["refused"]
    assert f"refused {word} while tracing" in records[0].message


# What the H200's census recorded as refusals (reports/census-features-h200), each still one;
# and crashes whose words once read as one (the type's name, "capture", "softmax", "local").
_REFUSALS = [
    (Features(window=(16, 0)), ValueError(
        "cuDNN doesn't support right window: 128 when causal mask is not used."), "window"),
    (Features(head_dim_v=64), ValueError(
        "value shape should be [4, 2048, 2, 128]: but got (4, 2048, 2, 64)"), "head_dim_v"),
    (Features(head_dim_v=64), ValueError(
        "key (4, 2048, 2, 128) and value (4, 2048, 2, 64) differ (value head dim 64 against "
        "128: attention=cudnn_flash_jax takes equal head dims"), "head_dim_v"),
    (Features(sinks=True), ValueError("Attention sinks on GPU are only supported with "
                                      "attention=cudnn_flash_te. Got attention_kernel=None."),
     "sinks"),
    (Features(sinks=True), ValueError("Unsupported backend: Known cuDNN < 9.26.0 issue with THD "
                                      "learnable softmax backward. Please upgrade cuDNN."),
     "sinks"),
    (Features(chunk=512), ValueError("Chunk attention (attention_type=chunk) is not supported "
                                     "with attention=cudnn_flash_te"), "chunk"),
    (Features(softcap=2.0), ValueError("attn_logits_soft_cap is not supported with "
                                       "attention=cudnn_flash_jax on GPU"), "softcap"),
    (Features(softcap=2.0), NotImplementedError("`logits_soft_cap` unsupported."), "softcap"),
    (Features(softcap=2.0, sinks=True), ValueError(
        "cannot honour logits_soft_cap=2.0; use attention=dot_product (every feature), or "
        "cudnn_flash_te for sinks"), "softcap"),
    (Features(window=(16, 0)), UnboundLocalError(
        "cannot access local variable 'w' where it is not associated with a value"), None),
    (Features(head_dim_v=16), ValueError("block_q=128 does not divide the sequence"), None),
    (Features(head_dim_v=16), ValueError("invalid value for block_kv: 0"), None),
    (Features(softcap=2.0), RuntimeError(
        "operation failed due to a previous error during capture"), None),
    (Features(softcap=2.0), ValueError("softmax scale must be positive"), None),
    (Features(head_dim_v=64), ValueError("Expected 'value' head dimension 128, got 64"),
     "head_dim_v"),
    (Features(head_dim_v=64), ValueError("FlashAttention forward only supports head dimension "
                                         "at most 256"), "head_dim_v"),
    (Features(head_dim_v=64), ValueError("V headdim must equal QK headdim"), "head_dim_v"),
    (Features(sinks=True), ValueError("num_sinks must be 0 on this backend"), "sinks"),
    (Features(sinks=True), NotImplementedError("LEARNABLE_SOFTMAX is not supported"), "sinks"),
    (Features(sinks=True), ValueError("softmax_offset is not supported with THD"), "sinks"),
    (Features(softcap=2.0), ValueError("capping of logits is not supported"), "softcap"),
    # An assert refuses in a refusal's words; a kernel's own invariant naming the feature is
    # a crash (a cold review's mutant read refused, and green).
    (Features(window=(16, 0)), AssertionError("sliding window is not supported"), "window"),
    (Features(window=(16, 0)), AssertionError("local windows are unsupported here"), "window"),
    (Features(window=(16, 0)), AssertionError("window band must be (256, 256), got (256, 257)"),
     None),
    (Features(window=(16, 0)), AssertionError("sliding window band has shape (256, 257), "
                                              "expected (256, 256)"), None),
    (Features(sinks=True), AssertionError("sinks: shape (4,) != (8,)"), None),
    (Features(window=(16, 0)), KeyError("window"), None),
    (Features(window=(16, 0)), TypeError("f() got an unexpected keyword argument "
                                         "'window_size'"), None),
    (Features(window=(16, 0)), ValueError("reduce_window: window_dimensions must have the "
                                          "operand's rank"), None),
    (Features(window=(16, 0)), AttributeError("'Config' object has no attribute "
                                              "'sliding_window'"), None),
]


@pytest.mark.parametrize("features,error,feature", _REFUSALS,
                         ids=[f"{type(e).__name__}-{f or 'error'}-{i}"
                              for i, (_, e, f) in enumerate(_REFUSALS)])
def test_a_refusal_names_its_feature_in_its_message_and_a_crash_is_none(features, error,
                                                                        feature):
    """A refusal is read from the message's words, never the error type's name, and a
    program's bug (a name, attribute or key not there) is never one."""
    from harness.judge.judging import refused_feature
    assert refused_feature(feature_case(features), error) == feature


def test_jaxs_tracer_error_naming_the_windows_argument_is_no_refusal():
    """jax's ConcretizationTypeError (a TypeError) names the argument its tracer came from:
    an adapter's bug, never the library refusing the window."""
    from harness.judge.judging import refused_feature
    with pytest.raises(jax.errors.ConcretizationTypeError) as info:
        jax.jit(lambda window_size: bool(window_size))(3)
    assert "window_size" in str(info.value)
    assert refused_feature(feature_case(CAUSAL_WINDOW), info.value) is None


def test_jaxs_vmap_error_naming_the_sinks_argument_is_no_refusal():
    """vmap's inconsistent sizes are a ValueError naming each argument ("axis 0 of argument
    sinks"): a kernel mapping its sinks over the batch read `refused sinks` and the run was
    green (an adversarial review's kernel). It is that kernel's error."""
    from harness.judge.judging import refused_feature

    def per_row(query, key, value, segment_ids, *, causal, scale, sinks):
        one = lambda q, k, v, s, sink: q * sink.sum()   # noqa: E731 - sinks mapped by mistake
        return jax.vmap(one)(query, key, value, segment_ids, sinks)
    case = feature_case(Features(sinks=True))
    with pytest.raises(ValueError) as info:
        jax.vmap(lambda q, sinks: q * sinks.sum())(jnp.ones((case.batch, 3)),
                                                  jnp.ones((case.heads + 1,)))
    assert "argument sinks" in str(info.value)
    assert refused_feature(case, info.value) is None
    kernel = Kernel("cpu:maps_its_sinks", per_row, devices=("cpu",), features=("sinks",))
    records = judged(kernel, case)
    assert [(r.verdict, r.message.split(":")[0]) for r in records] == [("error", "ValueError")]


def test_a_kernel_that_crashes_while_traced_on_a_feature_is_an_error_not_a_refusal():
    """A kernel that takes windows and value head dims, whose trace crashes on them with words
    that once read as refusals (UnboundLocalError's "local ... value", a ValueError): errors."""
    def crashes(query, key, value, segment_ids, *, causal, scale, window=None):
        if window is not None:
            del window
            return window
        raise ValueError("block_q=128 does not divide the sequence")
    kernel = Kernel("cpu:crashes_on_features", crashes, devices=("cpu",),
                    features=("window", "head_dim_v"))
    for features in (CAUSAL_WINDOW, Features(head_dim_v=16)):
        records = judged(kernel, feature_case(features))
        assert [(r.verdict, r.message.split(":")[0]) for r in records] == \
            [("error", "UnboundLocalError" if features.window else "ValueError")]


def test_a_kernel_without_a_backward_skips_every_gradient_check_dsinks_included():
    """A forward-only kernel on a case with sinks: dq, dk, dv and dsinks each a skip saying
    why (dsinks left no record at all before: a check neither run nor shown as skipped)."""
    kernel = dataclasses.replace(select_kernels("dot_product")[0], name="cpu:forward_only",
                                 backward=False)
    records = judged(kernel, feature_case(Features(sinks=True)))
    skipped = {r.check: r.message for r in records if r.verdict == "skip"}
    assert skipped == dict.fromkeys(("dq", "dk", "dv", "dsinks"), "kernel declares no backward")
    assert {r.check for r in records if r.verdict != "skip"} >= {"out", "leak", "contract"}


# jax's packed cuDNN call (fused_attention_stablehlo.dot_product_attention) --------------------

@pytest.mark.parametrize("causal,features", [(True, CAUSAL_WINDOW), (False, CAUSAL_WINDOW)],
                         ids=["causal", "bidir"])
def test_cudnn_packed_passes_w_equal_left_plus_one_whatever_the_mask(causal, features,
                                                                      monkeypatch):
    """seqlens [B, M] and offsets [B, M+1] as the op builds them (trailing padding merged under
    the causal mask, a segment of its own otherwise: one more slot), PADDING(_CAUSAL), and
    sliding_window_length = left + 1 (W keys, self included) whatever the mask, for a window
    reading nothing ahead: jax's documented (pos - W, pos]."""
    from jax._src.cudnn import fused_attention_stablehlo as sdpa
    calls = []

    def recorder(query, key, value, **kwargs):
        calls.append(kwargs)
        return jnp.zeros(query.shape[:3] + value.shape[3:], query.dtype)
    monkeypatch.setattr(sdpa, "dot_product_attention", recorder)
    kernel = select_kernels("jax_nn:cudnn_packed")[0]
    case = feature_case(features, causal, layout="extremes/pad-heavy")
    abstract_call(kernel, case)
    call = calls[-1]
    slots = case.max_segments + (0 if causal else 1)
    assert call["q_seqlen"].shape == call["kv_seqlen"].shape == (2, slots)
    assert call["q_offsets"].shape == call["kv_offsets"].shape == (2, slots + 1)
    assert call["sliding_window_length"] == 17
    assert call["mask_type"] == (sdpa.MaskType.PADDING_CAUSAL if causal else
                                 sdpa.MaskType.PADDING)
    assert call["qkv_layout"] == "BTNH"


@pytest.mark.parametrize("causal,features,mask", [
    (True, CAUSAL_WINDOW, "PADDING_CAUSAL"), (False, CAUSAL_WINDOW, "PADDING"),
    (True, Features(head_dim_v=64), "PADDING_CAUSAL")], ids=["causal", "bidir", "head_dim_v"])
def test_cudnn_packed_lowers_for_cuda_with_the_feature(causal, features, mask, as_on_the_h200):
    """The fused call in the program lowered for CUDA, as on the H200: the window as W = 17 (a
    bidirectional case's too, when its window reads nothing ahead), the value with
    its own head dim reaching the call (jax checks nothing there; its packed offsets then lay V
    out by the query's head dim: the GPU run's to show)."""
    kernel = select_kernels("jax_nn:cudnn_packed")[0]
    case = feature_case(features, causal, seq_len=256, head_dim=128)
    text = lowered_for_cuda(kernel_fn(kernel, case), case)
    assert set(re.findall(r"__cudnn\$\w+", text)) == {"__cudnn$fmhaSoftmax",
                                                     "__cudnn$fmhaSoftmaxBackward"}
    assert rf"\22mask_type\22: \22{mask}\22" in text
    window = 17 if features.window else 0
    assert rf"\22sliding_window_length\22: {window}" in text
    if features.head_dim_v:
        assert "tensor<2x256x2x64xbf16>" in text


def test_emulated_packed_call_honours_a_causal_window():
    """jax_nn:cudnn_packed's arithmetic on the CPU, through the cuDNN API emulator: W = left + 1
    with the causal mask is the window, every check ok on every segment."""
    kernel = select_kernels("jax_nn:cudnn_packed:emulated")[0]
    records = judged(kernel, feature_case(CAUSAL_WINDOW, True, layout="extremes/pad-heavy"))
    assert records and not_ok(records) == []
    assert {r.check for r in records} >= {"out", "dq", "dk", "dv", "leak"}


@pytest.mark.parametrize("name", ["jax_nn:cudnn_packed", "jax_nn:cudnn_packed:emulated"])
def test_packed_call_skips_a_bidirectional_window_reading_ahead_naming_why(name):
    """jax's sliding_window_length is a left bound only: a bidirectional window reading 8 ahead
    has no argument to go to. Handing over its left bound alone would be the adapter's own
    silent drop (the H200 census's FAIL on bidir-w255.128 was that), so the pair is a skip whose
    reason names the window; a bidirectional window reading nothing ahead is run."""
    kernel = select_kernels(name)[0]
    platform = Platform("gpu", 9.0) if name == "jax_nn:cudnn_packed" else Platform("cpu")
    reasons = kernel.unsupported_reasons(feature_case(BIDIR_WINDOW, False), platform)
    assert any("left-bound window only" in r and "16 back, 8 ahead is not expressible" in r
               for r in reasons), reasons
    assert not any("window" in r for r in
                   kernel.unsupported_reasons(feature_case(CAUSAL_WINDOW, False), platform))


def test_emulated_packed_call_takes_the_value_head_dim():
    """The emulator lays the value out by its own head dim (cuDNN's documented meaning; jax's
    real packed call does not, upstream: the GPU run's to show)."""
    kernel = select_kernels("jax_nn:cudnn_packed:emulated")[0]
    records = judged(kernel, feature_case(Features(head_dim_v=16), True))
    assert records and not_ok(records) == []


# Transformer Engine: a stand-in with TE 2.20's documented semantics --------------------------

class _Softmax(enum.Enum):
    VANILLA_SOFTMAX = 0
    OFF_BY_ONE_SOFTMAX = 1
    LEARNABLE_SOFTMAX = 2

    @classmethod
    def from_str(cls, name):
        table = {"vanilla": cls.VANILLA_SOFTMAX, "off_by_one": cls.OFF_BY_ONE_SOFTMAX,
                 "learnable": cls.LEARNABLE_SOFTMAX}
        if name not in table:
            raise ValueError(f"Unknown softmax_type: {name}")
        return table[name]


_Mask = enum.Enum("AttnMaskType", "NO_MASK PADDING_MASK CAUSAL_MASK PADDING_CAUSAL_MASK")
_Bias = enum.Enum("AttnBiasType", "NO_BIAS POST_SCALE_BIAS")
_Layout = enum.Enum("QKVLayout", "BSHD_BSHD_BSHD THD_THD_THD")


class _Descriptor:
    def __init__(self, **parts):
        self.parts = parts

    @classmethod
    def from_segment_ids_and_pos(cls, segment_ids, segment_pos):
        return cls(ids=segment_ids[0], pos=segment_pos[0])

    @classmethod
    def from_seqlens_and_offsets(cls, seqlens, offsets):
        return cls(seqlens=seqlens[0], offsets=offsets[0])

    def ids_and_positions(self, t):
        """[B, T] sequence number (0: in none) and position within it."""
        if "ids" in self.parts:
            return self.parts["ids"], self.parts["pos"]
        seqlens, offsets = self.parts["seqlens"], self.parts["offsets"]
        m = seqlens.shape[1]
        start, idx = offsets[:, :m, None], jnp.arange(t)[None, None]
        inside = (seqlens[:, :, None] > 0) & (start >= 0) & (idx >= start) & (
            idx < start + seqlens[:, :, None])
        ids = jnp.where(inside.any(axis=1), jnp.argmax(inside, axis=1) + 1, 0)
        first = jnp.take_along_axis(offsets[:, :m], jnp.maximum(ids - 1, 0), axis=1)
        return ids, jnp.where(ids > 0, jnp.arange(t)[None] - first, 0)


class StandinTE:
    """transformer_engine.jax's attention and flax modules as TE 2.20 documents them (THD
    only): `fused_attn` attends within each sequence of the descriptor, `window_size=(left,
    right)` keys [i - left, i + right] (-1 unbounded), the padding-causal mask, LEARNABLE_SOFTMAX
    with `softmax_offset` [1, heads, 1, 1] float32 (asserted, as TE's abstract eval does), zeros
    outside every sequence. Every call's arguments are kept in `calls`."""

    def __init__(self):
        self.calls: list[dict] = []

    def fused_attn(self, qkv, bias, descriptor, seed, attn_bias_type, attn_mask_type,
                   qkv_layout, softmax_type, scaling_factor, dropout_probability, is_training,
                   max_segments_per_seq=1, window_size=None, softmax_offset=None):
        q, k, v = qkv
        heads = q.shape[2]
        self.calls.append(dict(
            mask=attn_mask_type.name, layout=qkv_layout.name, softmax_type=softmax_type.name,
            window_size=window_size, max_segments_per_seq=max_segments_per_seq,
            softmax_offset=None if softmax_offset is None else (softmax_offset.shape,
                                                                str(softmax_offset.dtype)),
            head_dims=(q.shape[-1], v.shape[-1]), descriptor=sorted(descriptor.parts)))
        assert bias is None and attn_bias_type.name == "NO_BIAS" and not dropout_probability
        assert qkv_layout.name == "THD_THD_THD"
        assert attn_mask_type.name in ("PADDING_MASK", "PADDING_CAUSAL_MASK")
        if softmax_type.name == "LEARNABLE_SOFTMAX":
            assert softmax_offset is not None and softmax_offset.shape == (1, heads, 1, 1) \
                and softmax_offset.dtype == jnp.float32, "Expected softmax_offset (1, h, 1, 1)"
        else:
            assert softmax_offset is None
        ids, pos = descriptor.ids_and_positions(q.shape[1])
        allowed = (ids[:, :, None] == ids[:, None, :]) & (ids[:, :, None] > 0)
        pq, pk = pos[:, :, None], pos[:, None, :]
        if attn_mask_type.name == "PADDING_CAUSAL_MASK":
            allowed &= pk <= pq
        left, right = window_size if window_size is not None else (-1, -1)
        if left >= 0:
            allowed &= pk >= pq - left
        if right >= 0:
            allowed &= pk <= pq + right
        group = heads // k.shape[2]
        kf = jnp.repeat(k, group, axis=2).astype(jnp.float32)
        vf = jnp.repeat(v, group, axis=2).astype(jnp.float32)
        logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kf) * scaling_factor
        logits = jnp.where(allowed[:, None], logits, -1e30)
        if softmax_offset is not None:
            sink = jnp.broadcast_to(softmax_offset.reshape(1, heads, 1, 1),
                                    logits.shape[:3] + (1,))
            probs = jax.nn.softmax(jnp.concatenate([logits, sink], axis=-1), axis=-1)[..., :-1]
        else:
            probs = jax.nn.softmax(logits, axis=-1)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, vf)
        return jnp.where((ids > 0)[:, :, None, None], out, 0).astype(q.dtype)

    def flax_module(self):
        """flax DotProductAttention: its fused submodule holds the one parameter,
        softmax_offset (1, heads, 1, 1), boxed with logical axes as TE's is; on the unfused
        path (NVTE_FUSED_ATTN=0) it asserts on a SequenceDescriptor, as TE does."""
        import flax.linen as nn
        te = self

        class _FusedDotProductAttention(nn.Module):
            attn_mask_type: object
            scale_factor: float
            window_size: tuple | None
            max_segments_per_seq: int
            softmax_type: object

            @nn.compact
            def __call__(self, query, key, value, descriptor):
                offset = None
                if self.softmax_type.name == "LEARNABLE_SOFTMAX":
                    offset = self.param("softmax_offset", nn.with_logical_partitioning(
                        nn.initializers.zeros, (None, "heads", None, None)),
                        (1, query.shape[-2], 1, 1), jnp.float32)
                return te.fused_attn((query, key, value), None, descriptor, None,
                                     _Bias.NO_BIAS, self.attn_mask_type, _Layout.THD_THD_THD,
                                     self.softmax_type, self.scale_factor, 0.0, True,
                                     max_segments_per_seq=self.max_segments_per_seq,
                                     window_size=self.window_size, softmax_offset=offset)

        class DotProductAttention(nn.Module):
            head_dim: int
            num_attention_heads: int
            num_gqa_groups: int | None = None
            attention_dropout: float = 0.0
            attn_mask_type: str = "causal"
            qkv_layout: str = "bshd_bshd_bshd"
            scale_factor: float | None = None
            transpose_batch_sequence: bool | None = None
            window_size: tuple | None = None
            max_segments_per_seq: int = 1
            softmax_type: str = "vanilla"

            @nn.compact
            def __call__(self, query, key, value, sequence_descriptor=None, bias=None, *,
                         deterministic=False):
                softmax = _Softmax.from_str(self.softmax_type)
                if os.environ.get("NVTE_FUSED_ATTN", "1") == "0":
                    assert sequence_descriptor is None or isinstance(
                        sequence_descriptor, (jnp.ndarray, np.ndarray)), \
                        f"sequence_descriptor must be None or ndarray, but got " \
                        f"{type(sequence_descriptor)}"
                mask = {"padding": _Mask.PADDING_MASK,
                        "padding_causal": _Mask.PADDING_CAUSAL_MASK}[self.attn_mask_type]
                assert self.qkv_layout == "thd_thd_thd" and not self.transpose_batch_sequence
                return _FusedDotProductAttention(
                    mask, self.scale_factor, self.window_size, self.max_segments_per_seq,
                    softmax)(query, key, value, sequence_descriptor)

        return DotProductAttention

    def install(self, monkeypatch) -> None:
        modules = {}
        for name in ("transformer_engine", "transformer_engine.jax",
                     "transformer_engine.jax.attention", "transformer_engine.jax.flax"):
            module = types.ModuleType(name)
            module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            module.__path__ = []
            modules[name] = module
        attention = modules["transformer_engine.jax.attention"]
        attention.fused_attn = self.fused_attn
        attention.SequenceDescriptor = _Descriptor
        attention.AttnSoftmaxType, attention.AttnMaskType = _Softmax, _Mask
        attention.AttnBiasType, attention.QKVLayout = _Bias, _Layout
        if HAVE_FLAX:
            modules["transformer_engine.jax.flax"].DotProductAttention = self.flax_module()
        modules["transformer_engine.jax"].attention = attention
        modules["transformer_engine.jax"].flax = modules["transformer_engine.jax.flax"]
        modules["transformer_engine"].jax = modules["transformer_engine.jax"]
        for name, module in modules.items():
            monkeypatch.setitem(sys.modules, name, module)


@pytest.fixture
def standin_te(monkeypatch):
    te = StandinTE()
    te.install(monkeypatch)
    return te


TE_THD = ["te:thd", "sut:cudnn_flash_te"]


def te_kernel(name: str) -> Kernel:
    """The kernel, the op's configured as on the H200 (its config refuses cudnn_flash_te on
    other hardware, and below compute capability 9.0)."""
    kernel = select_kernels(name)[0]
    if name.startswith("sut:"):
        kernel = dataclasses.replace(kernel, fn=functools.partial(
            kernel.fn, hardware="gpu", compute_capability=9.0))
    return kernel


@pytest.mark.parametrize("name", TE_THD)
@pytest.mark.parametrize("causal,window,want", [(True, (16, 0), (16, 0)),
                                                (False, (16, 8), (16, 8))],
                         ids=["causal", "bidir"])
def test_te_gets_window_size_and_the_learnable_softmax_offset(name, causal, window, want,
                                                              standin_te):
    """window_size=(left, right) as the case has it (right 0 under the causal mask); sinks as
    LEARNABLE_SOFTMAX with softmax_offset float32 [1, heads, 1, 1]."""
    kernel = te_kernel(name)
    abstract_call(kernel, feature_case(Features(window=window, sinks=True), causal))
    call = standin_te.calls[-1]
    assert call["window_size"] == want
    assert call["softmax_type"] == "LEARNABLE_SOFTMAX"
    assert call["softmax_offset"] == ((1, 4, 1, 1), "float32")
    assert call["mask"] == ("PADDING_CAUSAL_MASK" if causal else "PADDING_MASK")
    assert call["layout"] == "THD_THD_THD"


def test_te_thd_never_lets_a_right_bound_override_the_causal_mask(standin_te):
    """TE's fused kernel sets cuDNN's right bound after the causal mask's: handed (16, 4) with
    the causal mask, the adapter passes (16, 0)."""
    kernel = select_kernels("te:thd")[0]
    case = feature_case(CAUSAL_WINDOW, True)
    abstract_call(kernel, case, window=(16, 4))
    assert standin_te.calls[-1]["window_size"] == (16, 0)


@pytest.mark.parametrize("name", TE_THD)
@pytest.mark.parametrize("causal,features", [
    (True, Features(window=(16, 0), sinks=True)), (False, Features(window=(16, 8), sinks=True)),
    (True, Features(head_dim_v=16))], ids=["causal-window-sinks", "bidir-window-sinks", "dv"])
def test_te_adapters_pass_the_harness_on_a_te_stand_in(name, causal, features, standin_te):
    """The adapters' calls judged by the harness where TE computes what it documents: the
    window, the sinks and their gradient (dsinks, through softmax_offset), the value head dim
    (te:thd; the op refuses it by name on its TE path)."""
    kernel = on_cpu(te_kernel(name))
    records = judged(kernel, feature_case(features, causal, layout="extremes/pad-heavy"))
    if name == "sut:cudnn_flash_te" and features.head_dim_v:
        assert [r.verdict for r in records] == ["refused"]
        assert "refused head_dim_v while tracing" in records[0].message
        return
    assert records and not_ok(records) == []
    assert any(r.check == "dsinks" for r in records) == features.sinks


@pytest.mark.skipif(not HAVE_FLAX, reason="flax is not installed (Python >= 3.12 here)")
@pytest.mark.parametrize("name", ["te:flax_segment_ids", "te:flax_seqlens_offsets"])
@pytest.mark.parametrize("causal,features", [
    (True, Features(window=(16, 0), sinks=True)), (False, Features(window=(16, 8), sinks=True))],
    ids=["causal", "bidir"])
def test_te_flax_modules_take_window_and_sinks_through_their_parameter(name, causal, features,
                                                                       standin_te):
    """The module gets window_size and softmax_type="learnable"; its softmax_offset parameter
    (in its fused submodule, boxed with logical axes) is set to the sinks in the params tree,
    so the harness's dsinks check sees the module's gradient."""
    kernel = on_cpu(select_kernels(name)[0])
    records = judged(kernel, feature_case(features, causal, layout="extremes/pad-heavy"))
    assert records and not_ok(records) == []
    assert any(r.check == "dsinks" for r in records)
    call = standin_te.calls[-1]
    assert call["window_size"] == features.window
    assert call["softmax_offset"] == ((1, 4, 1, 1), "float32")


@pytest.mark.parametrize("cudnn,declared", [(None, False), ((9, 19, 0), True),
                                           ((9, 26, 0), False), ((9, 27, 1), False)])
def test_te_flax_sinks_crash_is_declared_known_only_below_cudnn_9_26(cudnn, declared,
                                                                     monkeypatch):
    """TE's fused backend refuses THD learnable softmax on cuDNN < 9.26 and its flax module
    falls back to a path that crashes: known there, an error with a later cuDNN or where TE
    cannot say which it has (no TE, a stand-in)."""
    from harness.kernels.te_flax import SINKS_FALLBACK_CRASH, sinks_fallback_crash
    if cudnn is not None:
        misc = types.ModuleType("transformer_engine.jax.cpp_extensions.misc")
        misc.get_cudnn_version = lambda: cudnn
        for name in ("transformer_engine", "transformer_engine.jax",
                     "transformer_engine.jax.cpp_extensions"):
            module = types.ModuleType(name)
            module.__path__ = []
            monkeypatch.setitem(sys.modules, name, module)
        monkeypatch.setitem(sys.modules, misc.__name__, misc)
    else:
        monkeypatch.setitem(sys.modules, "transformer_engine", None)
    with_sinks = feature_case(Features(window=(16, 0), sinks=True), True)
    without = feature_case(Features(window=(16, 0)), True)
    assert sinks_fallback_crash(with_sinks) == (SINKS_FALLBACK_CRASH if declared else None)
    assert sinks_fallback_crash(without) is None


@pytest.mark.skipif(not HAVE_FLAX, reason="flax is not installed (Python >= 3.12 here)")
def test_te_unfused_fallback_still_meets_its_known_crash_with_features(standin_te):
    kernel = on_cpu(select_kernels("te:unfused_fallback")[0])
    records = judged(kernel, feature_case(Features(window=(16, 0), sinks=True), True))
    assert [(r.verdict, r.outcome) for r in records] == [("error", "known")]


# tokamax ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("implementation", ["xla", "cudnn", "mosaic"])
def test_tokamax_gets_local_window_size_and_logits_soft_cap(implementation, monkeypatch):
    calls = []
    fake = types.ModuleType("tokamax")

    def recorder(query, key, value, **kwargs):
        calls.append(kwargs)
        return jnp.zeros(query.shape[:3] + value.shape[3:], query.dtype)
    fake.dot_product_attention = recorder
    monkeypatch.setitem(sys.modules, "tokamax", fake)
    kernel = select_kernels(f"tokamax:{implementation}")[0]
    abstract_call(kernel, feature_case(Features(window=(16, 8), softcap=2.5, head_dim_v=16),
                                       causal=False))
    assert calls[-1]["local_window_size"] == (16, 8)
    assert calls[-1]["logits_soft_cap"] == 2.5
    assert calls[-1]["implementation"] == implementation and calls[-1]["is_causal"] is False


TOKAMAX_FEATURE_CASES = [
    feature_case(Features(window=(16, 0), softcap=2.0), True, dtype="float32"),
    feature_case(Features(window=(16, 8), head_dim_v=16), False, layout="extremes/pad-heavy"),
    feature_case(Features(softcap=5.0), False, dtype="float32", layout="extremes/pad-heavy")]


@pytest.mark.skipif(not HAVE_TOKAMAX, reason="tokamax is not installed (Python >= 3.12 only)")
@pytest.mark.parametrize("name", ["tokamax:xla", "tokamax:xla_chunked"])
@pytest.mark.parametrize("case", TOKAMAX_FEATURE_CASES, ids=lambda c: c.id)
def test_tokamax_xla_paths_honour_window_soft_cap_and_value_head_dim(name, case):
    records = judged(select_kernels(name)[0], case)
    assert records and not_ok(records) == []


@pytest.mark.skipif(not HAVE_TOKAMAX, reason="tokamax is not installed (Python >= 3.12 only)")
def test_tokamax_cudnn_refuses_the_soft_cap_and_folds_the_window_into_its_mask(as_on_the_h200):
    """tokamax:cudnn raises NotImplementedError("`logits_soft_cap` not supported.") while
    tracing (a refusal naming it); its window becomes part of the dense mask it hands jax.nn
    (a cuDNN bias), never cuDNN's sliding window."""
    kernel = select_kernels("tokamax:cudnn")[0]
    _import_library(kernel)
    as_on_the_h200(kernel)
    records = judged(kernel, feature_case(Features(softcap=2.0), True, seq_len=256,
                                          head_dim=128), Platform("gpu", 9.0))
    assert [r.verdict for r in records] == ["refused"]
    assert "refused softcap while tracing" in records[0].message
    case = feature_case(BIDIR_WINDOW, False, seq_len=256, head_dim=128)
    text = lowered_for_cuda(kernel_fn(kernel, case), case)
    assert "__cudnn$fmhaScaleBiasSoftmax" in text
    assert r"\22sliding_window_length\22: 0" in text


# the FlashAttention ports --------------------------------------------------------------------

@pytest.mark.parametrize("way", ["_flattened", "_vmapped"])
@pytest.mark.parametrize("case", [
    feature_case(CAUSAL_WINDOW, True, layout="padded/between", seq_len=256),
    feature_case(BIDIR_WINDOW, False, layout="padded/between", seq_len=256),
    feature_case(Features(window=(3, 1)), False, layout="extremes/single-tokens", seq_len=64)],
    ids=lambda c: c.id if isinstance(c, Case) else c)
def test_flash_attn_window_reaches_varlen_as_window_size(way, case):
    """The ports' varlen call gets window_size=(left, right) as the case has it; a reference
    varlen call with the ports' window semantics (per sequence, is_causal forcing right 0)
    passes every check of the harness, padding runs included."""
    from harness.kernels import flash_attn
    windows = []

    def varlen(*args, window_size=(-1, -1), **kwargs):
        windows.append(window_size)
        return reference_varlen(*args, window_size=window_size, **kwargs)
    fn = functools.partial(getattr(flash_attn, way), varlen)
    kernel = Kernel(f"reference{way}", fn, takes_max_segments=True, padding_anywhere=True,
                    features=("window",))
    records = judged(kernel, case)
    assert records and not_ok(records) == []
    assert set(windows) == {case.features.window}
