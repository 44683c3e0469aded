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
  declare as known.
"""
import functools
import importlib
import importlib.util
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness.kernels.kernel import Kernel, Platform
from harness.engine.programs import argument_shapes, kernel_fn
from harness.engine.registry import select_kernels
from harness.engine.runner import run_kernel_case
from harness.model.case import Case

MODULES = {"harness.kernels.tokamax_adapter": ["tokamax"],
           "harness.kernels.flash_attn": ["flash_attn_jax", "flash_attn3_jax"],
           "harness.kernels.te_flax": ["transformer_engine", "flax"],
           "harness.kernels.jax_nn": []}
CENSUS = ["tokamax:xla", "tokamax:xla_chunked", "tokamax:cudnn", "tokamax:triton",
          "tokamax:mosaic", "flash_attn:varlen", "flash_attn:varlen_vmap", "flash_attn3:varlen",
          "te:flax_segment_ids", "te:flax_seqlens_offsets", "jax_nn:cudnn"]
LOWERED = ["tokamax:cudnn", "flash_attn:varlen", "flash_attn:varlen_vmap", "flash_attn3:varlen",
           "te:flax_segment_ids", "te:flax_seqlens_offsets", "jax_nn:cudnn"]
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
                     is_causal):
    """flash_mha_varlen's meaning on one token stream: token i belongs to sequence m where
    cu[m] <= i < cu[m+1]; tokens from cu[-1] on form one more sequence (what the vmap rule of
    flash-attn-jax makes of a row's tail); each attends within its own sequence."""
    del cu_k, max_seqlen_k
    n = q.shape[0]
    seq = jnp.searchsorted(cu_q[1:], jnp.arange(n), side="right")
    lengths = jnp.diff(cu_q)
    mask = seq[:, None] == seq[None, :]
    if is_causal:
        mask &= jnp.tril(jnp.ones((n, n), bool))
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
    version check (cuDNN is not loaded on a CPU), tokamax's device checks, and flash-attn-jax's
    SM count (read from the CUDA runtime at lowering). Nothing else changes."""
    from jax._src.cudnn import fused_attention_stablehlo
    monkeypatch.setattr(fused_attention_stablehlo, "check_cudnn_version", lambda: H200_CUDNN)

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
