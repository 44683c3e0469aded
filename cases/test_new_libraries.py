"""The adapters of three newer JAX attention libraries on a CPU (harness/kernels/dew_flash_attn.py,
fa4.py, tokamax17.py):
- their declarations (features, padding, reproducibility, isolation, markers), their place in
  the census set, and their skips: a missing library, an older tokamax ("needs tokamax >=
  0.0.17 (found X)"); their modules import without the libraries;
- the adapters' own arithmetic: cu_seqlens over the flattened rows (every run a sequence,
  cu[-1] == B * T), fa4's used lengths (padding slots 0), tokamax's per-query key ranges;
- the arguments each hands its library (window convention, sinks [heads] float32, GQA kept,
  max_seqlen a Python int, fa4's backend and defined_padding), on recording stand-ins;
- judged by the harness against its oracle, with stand-ins that compute what each library
  documents (no library needed: CI runs these), and with the libraries themselves where they
  are installed (Python >= 3.12 throwaway environments; skipped with the reason elsewhere):
  dew with only its two FFI calls replaced by jnp (its own custom_vjp, sinks and dsinks run),
  fa4's own reference backend, tokamax 0.0.17's xla op;
- lowered for CUDA on the CPU with their fused-kernel markers where the library is here
  (dew's FA3 targets, fa4's CuTe kernels compiled for sm_90a, tokamax's Triton and Mosaic
  GPU calls), the device queries answered as the H200 would.
"""
import dataclasses
import functools
import importlib
import importlib.machinery
import importlib.util
import itertools
import re
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness.engine.program_functions import FORWARD, argument_shapes, feature_arguments, kernel_fn
from harness.engine.registry import all_kernels, select_kernels
from harness.engine.runner import run_kernel_case
from harness.kernels import dew_flash_attn, fa4, tokamax17
from harness.kernels.kernel import Kernel, Platform
from harness.model.case import Case
from harness.model.features import Features

NEW = ["dew_flash_attn:varlen", "fa4:varlen", "tokamax17:xla", "tokamax17:triton",
       "tokamax17:mosaic"]
LIBRARIES = ["dew_flash_attn", "fa4_jax", "cutejax", "cutlass", "tokamax"]
H200_SMS = 132


def installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ValueError:      # in sys.modules without a spec (a stand-in)
        return True


HAVE_DEW = installed("dew_flash_attn")
HAVE_FA4 = installed("fa4_jax")
HAVE_TOKAMAX17 = installed("tokamax") and tokamax17.version_constraint(None, None) == []


def feature_case(features: Features | None = None, causal: bool = True,
                 layout: str = "packed/random", seq_len: int = 128, heads: int = 4,
                 kv_heads: int = 2, head_dim: int = 32, dtype: str = "bfloat16",
                 batch: int = 2, seed: int = 0) -> Case:
    return Case(layout, batch, seq_len, heads, kv_heads, head_dim, dtype, seed, causal=causal,
                features=features or Features())


def on_cpu(kernel: Kernel, fn=None, **changes) -> Kernel:
    """The kernel's declarations with CPU capabilities, its library a stand-in (or its CPU
    path) here."""
    return dataclasses.replace(kernel, name=f"cpu:{kernel.name}", fn=fn or kernel.fn,
                               devices=("cpu",), min_compute_capability=None, hlo_markers=(),
                               forward_markers=(),
                               **changes)


def judged(kernel: Kernel, case: Case):
    return run_kernel_case(kernel, case, Platform("cpu")).records


def not_ok(records) -> list:
    return [(r.check, r.row, r.segment, r.verdict, r.message[:160]) for r in records
            if r.outcome != "ok"][:4]


def abstract_call(kernel: Kernel, case: Case):
    """The kernel's function traced (nothing computed) on the case's shapes, its features handed
    over as the harness hands them."""
    shapes = argument_shapes(case)[:-1]                         # no cotangent
    extra = {"max_segments": case.max_segments} if kernel.takes_max_segments else {}
    extra.update(feature_arguments(case))

    def fn(q, k, v, seg, *sinks):
        return kernel.fn(q, k, v, seg, causal=case.causal, scale=case.scale, **extra,
                         **({"sinks": sinks[0]} if sinks else {}))
    return jax.eval_shape(fn, *shapes)


def lowered_for_cuda(fn, case, mode: str = "default") -> str:
    return jax.jit(fn).trace(*argument_shapes(case, mode)).lower(
        lowering_platforms=("cuda",)).as_text()


# ----- declarations -------------------------------------------------------------------------

def test_declarations():
    kernels = {k.name: k for k in select_kernels(NEW)}
    assert {n: k.features for n, k in kernels.items()} == {
        "dew_flash_attn:varlen": ("window", "sinks"), "fa4:varlen": ("window", "head_dim_v"),
        **{f"tokamax17:{i}": ("window", "softcap", "head_dim_v")
           for i in ("xla", "triton", "mosaic")}}
    assert {n: k.padding_output for n, k in kernels.items()} == {
        "dew_flash_attn:varlen": "finite", "fa4:varlen": "zero", "tokamax17:xla": "finite",
        "tokamax17:triton": "finite", "tokamax17:mosaic": "finite"}
    assert {n: k.reproducible for n, k in kernels.items()} == {
        "dew_flash_attn:varlen": False, "fa4:varlen": False, "tokamax17:xla": None,
        "tokamax17:triton": None, "tokamax17:mosaic": None}
    # dew's FFI targets are dew_flash*, fa4's cutejax.fa4_*: neither clashes with the
    # FlashAttention ports' flash_mha_* (which need groups of their own).
    assert {k.isolation for k in kernels.values()} == {None}
    assert all(k.padding_anywhere for k in kernels.values())
    assert kernels["dew_flash_attn:varlen"].requires == ("dew_flash_attn",)
    assert kernels["dew_flash_attn:varlen"].min_compute_capability == 9.0
    assert kernels["dew_flash_attn:varlen"].hlo_markers == (
        "dew_flash3_mha_varlen_fwd", "dew_flash3_mha_varlen_bwd")
    assert kernels["fa4:varlen"].requires[0] == "fa4_jax"
    assert kernels["fa4:varlen"].hlo_markers == ("cutejax.fa4_fwd", "cutejax.fa4_bwd")
    assert kernels["tokamax17:xla"].devices == ("cpu", "gpu")
    assert kernels["tokamax17:triton"].hlo_markers == ("__gpu$xla.gpu.triton",)
    assert kernels["tokamax17:mosaic"].hlo_markers == ("mosaic_gpu",)
    assert all(k.requires == ("tokamax",) for n, k in kernels.items() if n.startswith("tok"))


def test_the_new_kernels_are_in_the_census_set():
    from harness.tools.census.options import census_names
    names = census_names(all_kernels())
    assert [n for n in names if n in NEW] == NEW
    # tokamax:* stays the public function's five kernels; tokamax17:* its own entry.
    assert not [n for n in names if n.startswith("tokamax:") and "17" in n]


def test_modules_import_without_their_libraries():
    """In a fresh interpreter whose import of each library fails, the adapter modules (and the
    registry) still import, and none of the libraries was touched."""
    script = f"""
import sys
BLOCKED = {LIBRARIES!r}
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError("blocked for the test: " + name)
sys.meta_path.insert(0, Block())
import harness.kernels.dew_flash_attn, harness.kernels.fa4, harness.kernels.tokamax17
from harness.engine.registry import all_kernels
assert {{"dew_flash_attn:varlen", "fa4:varlen", "tokamax17:mosaic"}} <= set(all_kernels())
print(sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("name", NEW)
def test_a_missing_library_is_a_skip_with_the_reason(name):
    kernel = select_kernels(name)[0]
    missing = [m for m in kernel.requires if not installed(m)]
    if not missing:
        pytest.skip(f"{name}: {', '.join(kernel.requires)} installed here")
    case = feature_case(seq_len=256, head_dim=128)
    for platform in (Platform("cpu"), Platform("gpu", 9.0)):
        records = run_kernel_case(kernel, case, platform).records
        assert [r.verdict for r in records] == ["skip"]
        assert f"optional dependency {missing[0]!r} is not installed" in records[0].message


def test_dew_runs_on_sm90_only():
    kernel = select_kernels("dew_flash_attn:varlen")[0]
    case = feature_case(head_dim=128)
    assert any("sm_90 only" in r for r in kernel.unsupported_reasons(case, Platform("gpu", 10.0)))
    assert any("compute capability >= 9.0" in r
               for r in kernel.unsupported_reasons(case, Platform("gpu", 8.0)))
    assert not [r for r in kernel.unsupported_reasons(case, Platform("gpu", 9.0))
                if "sm_90" in r or "capability" in r]
    assert any("head_dim 512 > 256" in r for r in kernel.unsupported_reasons(
        feature_case(head_dim=512), Platform("gpu", 9.0)))
    # bf16/f16 only (dew raises ValueError on others); no value head dim of its own (it checks
    # key.shape == value.shape): both skipped before its call.
    assert "dtype float32" in " ".join(kernel.unsupported_reasons(
        feature_case(dtype="float32"), Platform("gpu", 9.0)))
    assert "does not take head_dim_v" in " ".join(kernel.unsupported_reasons(
        feature_case(Features(head_dim_v=16)), Platform("gpu", 9.0)))


def _fake_tokamax_package(root, version: str):
    """A package `tokamax` with its dist-info of `version` under root (nothing else)."""
    (root / "tokamax").mkdir()
    (root / "tokamax" / "__init__.py").write_text("raise ImportError('not for importing')\n")
    info = root / f"tokamax-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: tokamax\nVersion: {version}\n")


@pytest.mark.parametrize("version,skipped", [("0.0.12", True), ("0.0.16", True),
                                             ("0.0.17", False), ("0.1.0", False)])
def test_an_older_tokamax_is_a_skip_naming_the_version(version, skipped, tmp_path,
                                                       monkeypatch):
    """The version is read from the dist-info beside the package jax would import, without
    importing it (the fake package raises on import)."""
    monkeypatch.delitem(sys.modules, "tokamax", raising=False)
    _fake_tokamax_package(tmp_path, version)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.invalidate_caches()
    assert tokamax17.installed_version() == version
    case = feature_case(seq_len=256, head_dim=128)
    for name in ("tokamax17:xla", "tokamax17:triton", "tokamax17:mosaic"):
        reasons = select_kernels(name)[0].unsupported_reasons(case, Platform("gpu", 9.0))
        want = f"needs tokamax >= 0.0.17 (found {version})"
        assert (want in reasons) == skipped, reasons


def test_an_imported_tokamax_answers_with_its_own_version(monkeypatch):
    fake = types.ModuleType("tokamax")
    fake.__version__ = "0.0.12"
    monkeypatch.setitem(sys.modules, "tokamax", fake)
    assert tokamax17.version_constraint(None, None) == ["needs tokamax >= 0.0.17 (found 0.0.12)"]
    fake.__version__ = "0.0.17"
    assert tokamax17.version_constraint(None, None) == []


# ----- the adapters' arithmetic --------------------------------------------------------------

ARITHMETIC_LAYOUTS = ["packed/random", "padded/between", "padded/left", "extremes/pad-heavy",
                      "extremes/single-tokens", "unaligned/block-edges"]


def _runs(ids: np.ndarray):
    """(start, stop, id) of each run of equal ids in a row."""
    edges = np.flatnonzero(np.diff(ids)) + 1
    bounds = np.concatenate([[0], edges, [ids.size]])
    return [(int(a), int(b), int(ids[a])) for a, b in itertools.pairwise(bounds)]


@pytest.mark.parametrize("layout", ARITHMETIC_LAYOUTS)
def test_fa4_slots_and_used_lengths(layout):
    """Every run of the flattened rows is a slot (cu[-1] == B * T, as the reference backend
    needs); a segment's used length is its length, a stretch of padding's 0; unused slots are
    empty at the end."""
    case = feature_case(layout=layout, seq_len=256, batch=3)
    cu, used = map(np.asarray, fa4.slots_and_used(jnp.asarray(case.segment_ids),
                                                  case.max_segments))
    ids = case.segment_ids.reshape(-1)
    assert cu[0] == 0 and cu[-1] == ids.size and np.all(np.diff(cu) >= 0)
    assert cu.dtype == np.int32 and used.dtype == np.int32 and used.shape == (cu.size - 1,)
    want = []
    for row in range(case.batch):
        want += [(row * case.seq_len + a, row * case.seq_len + b, i)
                 for a, b, i in _runs(case.segment_ids[row])]
    got = [(int(a), int(b)) for a, b in itertools.pairwise(cu) if b > a]
    assert got == [(a, b) for a, b, _ in want]
    nonempty = used[np.diff(cu) > 0]
    assert nonempty.tolist() == [b - a if i > 0 else 0 for a, b, i in want]
    assert not used[np.diff(cu) == 0].any()


@pytest.mark.parametrize("layout", ARITHMETIC_LAYOUTS)
def test_tokamax17_key_ranges_are_each_tokens_run(layout):
    """k_start/k_end per query: its run's bounds, so [k_start, k_end) is its own segment (or
    its own stretch of padding) and nothing else."""
    case = feature_case(layout=layout, seq_len=256, batch=3)
    start, end = map(np.asarray, tokamax17.run_bounds(jnp.asarray(case.segment_ids)))
    assert start.dtype == np.int32 and end.dtype == np.int32
    for row in range(case.batch):
        for a, b, _ in _runs(case.segment_ids[row]):
            assert (start[row, a:b] == a).all() and (end[row, a:b] == b).all()


# ----- arguments, on recording stand-ins ------------------------------------------------------

def _dew_recorder(calls):
    def varlen(q, k, v, cu_seqlens, max_seqlen, softmax_scale=None, is_causal=False,
               window_size=(-1, -1), sinks=None):
        calls.append(dict(q=q.shape, k=k.shape, v=v.shape, cu=(cu_seqlens.shape,
                          str(cu_seqlens.dtype)), max_seqlen=max_seqlen,
                          max_seqlen_type=type(max_seqlen), scale=softmax_scale,
                          causal=is_causal, window_size=window_size,
                          sinks=None if sinks is None else (sinks.shape, str(sinks.dtype))))
        return jnp.zeros(q.shape, q.dtype)
    return varlen


@pytest.mark.parametrize("causal,features", [
    (True, Features(window=(16, 0), sinks=True)), (False, Features(window=(16, 8), sinks=True)),
    (True, Features())], ids=["causal-window-sinks", "bidir-window-sinks", "plain"])
def test_dew_gets_window_size_sinks_and_its_packing(causal, features):
    """flash_mha_varlen(q [B*T, H, D], k/v [B*T, Hk, D], cu_seqlens int32 [B*(2M+1)+1],
    max_seqlen=T (a Python int), softmax_scale, is_causal, window_size=(left, right) as the
    case has it, sinks float32 [H])."""
    calls = []
    kernel = dataclasses.replace(select_kernels("dew_flash_attn:varlen")[0],
                                 fn=functools.partial(dew_flash_attn.dew_flattened,
                                                      varlen=_dew_recorder(calls)))
    case = feature_case(features, causal, heads=8, kv_heads=2)
    out = abstract_call(kernel, case)
    assert out.shape == (2, 128, 8, 32)
    call = calls[-1]
    n = 2 * 128
    assert (call["q"], call["k"], call["v"]) == ((n, 8, 32), (n, 2, 32), (n, 2, 32))
    assert call["cu"] == ((2 * (2 * case.max_segments + 1) + 1,), "int32")
    assert call["max_seqlen"] == 128 and call["max_seqlen_type"] is int
    assert call["scale"] == case.scale and call["causal"] is causal
    assert call["window_size"] == (features.window or (-1, -1))
    assert call["sinks"] == (((8,), "float32") if features.sinks else None)


def _fa4_recorder(calls):
    def varlen(q, k, v, cu_q, cu_k, *, seqused_q=None, seqused_k=None, causal=False,
               window_size=None, scale=None, backend=None, defined_padding=False):
        calls.append(dict(q=q.shape, k=k.shape, v=v.shape, same_cu=cu_q is cu_k,
                          same_used=seqused_q is seqused_k, used=seqused_q.shape,
                          causal=causal, window_size=window_size, scale=scale,
                          backend=backend, defined_padding=defined_padding))
        return jnp.zeros(q.shape[:2] + v.shape[2:], q.dtype)
    return varlen


@pytest.mark.parametrize("causal,features", [
    (True, Features(window=(16, 0))), (False, Features(window=(16, 8), head_dim_v=16)),
    (True, Features())], ids=["causal-window", "bidir-window-dv", "plain"])
def test_fa4_gets_window_size_seqused_and_defined_padding(causal, features):
    """flash_attn_varlen(q, k, v [B*T, ., .], cu, cu, seqused_q=seqused_k=used, causal,
    window_size=(left, right) or None, scale, backend="cute" (never fa4's CPU default),
    defined_padding=True)."""
    calls = []
    kernel = dataclasses.replace(select_kernels("fa4:varlen")[0], fn=functools.partial(
        fa4.fa4_flattened, varlen=_fa4_recorder(calls)))
    case = feature_case(features, causal, heads=8, kv_heads=2)
    out = abstract_call(kernel, case)
    assert out.shape == (2, 128, 8, case.value_dim)
    call = calls[-1]
    n = 2 * 128
    assert (call["q"], call["k"], call["v"]) == ((n, 8, 32), (n, 2, 32), (n, 2, case.value_dim))
    assert call["same_cu"] and call["same_used"]
    assert call["used"] == (2 * (2 * case.max_segments + 1),)
    assert call["causal"] is causal and call["scale"] == case.scale
    assert call["window_size"] == features.window
    assert call["backend"] == "cute" and call["defined_padding"] is True


# A stand-in for tokamax's private attention modules: Mask and CausalMask as tokamax 0.0.17
# defines them (base.py: as_array, __and__), an xla op computing what its Mask allows, and
# recorders for the others. Checked against the real classes where tokamax 0.0.17 is here.

@dataclasses.dataclass(frozen=True)
class _CausalMask:
    offset: int = 0
    window_size: int | None = None

    def __and__(self, other):
        offset = min(self.offset, other.offset)
        bounds = [m.offset - m.window_size for m in (self, other) if m.window_size is not None]
        return _CausalMask(offset, offset - max(bounds) if bounds else None)


class _Mask:
    def __init__(self, bool_mask=None, *, causal_mask=None, k_start=None, k_end=None,
                 is_causal=False):
        self.bool_mask = bool_mask
        self.causal_mask = _CausalMask() if is_causal else causal_mask
        self.k_start, self.k_end = k_start, k_end

    def __and__(self, other):
        assert isinstance(other, _CausalMask)
        causal = other if self.causal_mask is None else self.causal_mask & other
        return _Mask(self.bool_mask, causal_mask=causal, k_start=self.k_start,
                     k_end=self.k_end)

    def as_array(self, q_len, k_len):
        q, k = jnp.arange(q_len)[:, None], jnp.arange(k_len)[None, :]
        parts = []
        if self.causal_mask is not None:
            parts.append(q >= k - self.causal_mask.offset)
            if self.causal_mask.window_size is not None:
                parts.append(q < k - self.causal_mask.offset + self.causal_mask.window_size)
        if self.k_start is not None:
            parts.append(k >= self.k_start[..., None])
        if self.k_end is not None:
            parts.append(k < self.k_end[..., None])
        return functools.reduce(jnp.logical_and, parts)


def _standin_xla(query, key, value, *, mask, logits_scale, logits_soft_cap=None):
    """base.DotProductAttention's meaning: float32 logits, soft cap after the scale, the
    Mask's keys only; GQA by repeating key heads."""
    t, heads = query.shape[1], query.shape[2]
    group = heads // key.shape[2]
    k = jnp.repeat(key, group, axis=2).astype(jnp.float32)
    v = jnp.repeat(value, group, axis=2).astype(jnp.float32)
    s = jnp.einsum("bqhd,bkhd->bhqk", query.astype(jnp.float32), k) * logits_scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    allowed = jnp.broadcast_to(mask.as_array(t, t), s.shape)
    p = jax.nn.softmax(jnp.where(allowed, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v).astype(query.dtype)


@pytest.fixture
def standin_tokamax(monkeypatch):
    """Installs the stand-in as `tokamax._src.ops.attention.{api,base}` (version 0.0.17);
    returns the calls its ops saw."""
    calls = []

    def recorder(name):
        def op(query, key, value, **kwargs):
            calls.append(dict(name=name, q=query.shape, k=key.shape, v=value.shape, **kwargs))
            return _standin_xla(query, key, value, **kwargs)
        return op
    names = ["tokamax", "tokamax._src", "tokamax._src.ops", "tokamax._src.ops.attention",
             "tokamax._src.ops.attention.api", "tokamax._src.ops.attention.base"]
    modules = {}
    for name in names:
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
        module.__path__ = []
        modules[name] = module
    modules["tokamax"].__version__ = "0.0.17"
    base = modules["tokamax._src.ops.attention.base"]
    base.Mask, base.CausalMask = _Mask, _CausalMask
    api = modules["tokamax._src.ops.attention.api"]
    api.IMPLEMENTATIONS = {n: recorder(n) for n in ("xla", "triton", "mosaic_gpu")}
    for parent, child in itertools.pairwise(names[:-1]):
        setattr(modules[parent], child.rsplit(".", 1)[1], modules[child])
    attention = modules["tokamax._src.ops.attention"]
    attention.api, attention.base = api, base
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return calls


@pytest.mark.parametrize("implementation", ["xla", "triton", "mosaic"])
def test_tokamax17_gets_its_mask_soft_cap_and_scale(implementation, standin_tokamax):
    """IMPLEMENTATIONS[xla | triton | mosaic_gpu](q, k, v [B, T, ., .] as they are, mask=Mask(
    k_start/k_end int32 [B, 1, T], causal; the window as CausalMask(offset=right,
    window_size=left + right + 1)), logits_scale=scale, logits_soft_cap=cap)."""
    kernel = select_kernels(f"tokamax17:{implementation}")[0]
    case = feature_case(Features(window=(16, 8), softcap=2.5, head_dim_v=16), causal=False,
                        heads=8, kv_heads=2)
    abstract_call(kernel, case)
    call = standin_tokamax[-1]
    assert call["name"] == tokamax17.IMPLEMENTATIONS[implementation]
    assert (call["q"], call["k"], call["v"]) == ((2, 128, 8, 32), (2, 128, 2, 32),
                                                 (2, 128, 2, 16))
    assert call["logits_scale"] == case.scale and call["logits_soft_cap"] == 2.5
    mask = call["mask"]
    assert mask.k_start.shape == mask.k_end.shape == (2, 1, 128)
    assert mask.k_start.dtype == mask.k_end.dtype == jnp.int32
    assert mask.causal_mask == _CausalMask(offset=8, window_size=25)
    abstract_call(kernel, feature_case(Features(window=(16, 0)), causal=True))
    assert standin_tokamax[-1]["mask"].causal_mask == _CausalMask(offset=0, window_size=17)
    abstract_call(kernel, feature_case(causal=True))
    assert standin_tokamax[-1]["mask"].causal_mask == _CausalMask()
    assert standin_tokamax[-1]["logits_soft_cap"] is None


# ----- judged by the harness, with stand-ins computing what each library documents ----------

def _segments_of(cu, n):
    """Each token's sequence (tokens from cu[-1] on: one more) and its position in it."""
    idx = jnp.arange(n)
    seq = jnp.searchsorted(cu[1:], idx, side="right")
    return seq, idx - cu[seq]


def _attend(q, k, v, allowed, scale, sinks=None):
    """float32 attention of q [n, H, d] over k, v [n, Hk, .] where allowed [n, n] (or
    [H, n, n]); a sink per head adds e^sink to each denominator; rows with no key give 0."""
    heads = q.shape[1]
    group = heads // k.shape[1]
    kf = jnp.repeat(k, group, axis=1).astype(jnp.float32)
    vf = jnp.repeat(v, group, axis=1).astype(jnp.float32)
    s = jnp.einsum("qhd,khd->hqk", q.astype(jnp.float32), kf) * scale
    allowed = jnp.broadcast_to(allowed, s.shape)
    s = jnp.where(allowed, s, -jnp.inf)
    if sinks is not None:
        sink = jnp.broadcast_to(sinks.astype(jnp.float32)[:, None, None], s.shape[:2] + (1,))
        s = jnp.concatenate([s, sink], axis=-1)
    top = jax.lax.stop_gradient(jnp.max(jnp.where(jnp.isfinite(s), s, -1e30), -1,
                                        keepdims=True))
    e = jnp.where(jnp.isfinite(s), jnp.exp(s - top), 0.0)
    p = e / jnp.maximum(e.sum(-1, keepdims=True), 1e-30)
    if sinks is not None:
        p = p[..., :-1]
    return jnp.einsum("hqk,khd->qhd", p, vf)


def _fa_window(n, cu, causal, window_size):
    """FlashAttention's varlen mask: same sequence; keys [i - left, i + right] of it (-1:
    unbounded), right 0 under is_causal (sk = sq: no bottom-right shift)."""
    seq, _ = _segments_of(cu, n)
    i, j = jnp.arange(n)[:, None], jnp.arange(n)[None, :]
    allowed = seq[:, None] == seq[None, :]
    left, right = window_size
    right = 0 if causal else right
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    return allowed


def reference_dew_varlen(q, k, v, cu_seqlens, max_seqlen, softmax_scale=None, is_causal=False,
                         window_size=(-1, -1), sinks=None):
    """dew's flash_mha_varlen as it documents itself (module docstring of the adapter)."""
    assert isinstance(max_seqlen, int) and q.dtype in (jnp.bfloat16, jnp.float16)
    assert sinks is None or sinks.shape == q.shape[1:2]
    allowed = _fa_window(q.shape[0], cu_seqlens, is_causal, window_size)
    longest = jnp.max(jnp.diff(cu_seqlens))
    out = _attend(q, k, v, allowed, softmax_scale, sinks)
    return jnp.where(longest <= max_seqlen, out, jnp.nan).astype(q.dtype)


def reference_fa4_varlen(q, k, v, cu_q, cu_k, *, seqused_q=None, seqused_k=None, causal=False,
                         window_size=None, scale=None, backend=None, defined_padding=False):
    """fa4's flash_attn_varlen as it documents itself: slots of cu, only their first seqused
    tokens used; the band -right <= q_pos - kv <= left (None unbounded) on used lengths;
    unused rows 0 (defined_padding)."""
    assert defined_padding and backend == "cute"
    n = q.shape[0]
    seq, local = _segments_of(cu_q, n)
    used = jnp.concatenate([seqused_q, jnp.zeros((1,), seqused_q.dtype)])[seq]
    live = local < used
    allowed = (seq[:, None] == seq[None, :]) & live[:, None] & live[None, :]
    left, right = window_size if window_size is not None else (None, None)
    right = 0 if causal else right
    d = local[:, None] - local[None, :]
    if left is not None:
        allowed &= d <= left
    if right is not None:
        allowed &= -d <= right
    out = _attend(q, k, v, allowed, scale)
    return jnp.where(live[:, None, None], out, 0).astype(q.dtype)


DEW_CASES = [
    feature_case(Features(window=(16, 0), sinks=True), True, layout="padded/between",
                 seq_len=256, heads=4, kv_heads=1),
    feature_case(Features(window=(16, 8), sinks=True), False, layout="extremes/pad-heavy"),
    feature_case(Features(sinks=True), True, layout="padded/left", dtype="float16"),
    feature_case(Features(), False, layout="packed/random", seq_len=128, heads=4, kv_heads=4)]


@pytest.mark.parametrize("case", DEW_CASES, ids=lambda c: c.id)
def test_dew_adapter_passes_on_a_stand_in(case):
    """The adapter's cu_seqlens, window and sinks handed to a stand-in that computes what dew
    documents: every check passes, padding anywhere, dsinks included."""
    kernel = on_cpu(select_kernels("dew_flash_attn:varlen")[0], requires=(),
                    fn=functools.partial(dew_flash_attn.dew_flattened,
                                         varlen=reference_dew_varlen))
    records = judged(kernel, case)
    assert records and not_ok(records) == []
    assert any(r.check == "dsinks" for r in records) == case.features.sinks
    assert any(r.check == "padding" for r in records) == bool((case.segment_ids == 0).any())


FA4_CASES = [
    feature_case(Features(window=(16, 0)), True, layout="padded/between", seq_len=256),
    feature_case(Features(window=(16, 8), head_dim_v=16), False, layout="extremes/pad-heavy"),
    feature_case(Features(), True, layout="padded/left", dtype="float16", kv_heads=1)]


@pytest.mark.parametrize("case", FA4_CASES, ids=lambda c: c.id)
def test_fa4_adapter_passes_on_a_stand_in(case):
    """The adapter's slots and used lengths: padding slots unused and defined as 0 (its
    declared padding output "zero" is held to exactly that)."""
    kernel = on_cpu(select_kernels("fa4:varlen")[0], requires=(),
                    fn=functools.partial(fa4.fa4_flattened, varlen=reference_fa4_varlen))
    records = judged(kernel, case)
    assert records and not_ok(records) == []
    padding = [r for r in records if r.check == "padding"]
    assert padding and all("output convention: zero" in r.message for r in padding)
    # Forward mode (fa4 has a tangent kernel): the tangent judged per segment, and held to the
    # zero convention at padding too.
    assert len([r for r in records if r.check == "jvp"]) == len(case.segments)
    assert all("jvp" in r.message.split(" clean")[0] for r in padding)


TOKAMAX_CASES = [
    feature_case(Features(window=(16, 0), softcap=2.0), True, layout="padded/between",
                 seq_len=256, dtype="float32"),
    feature_case(Features(window=(16, 8), head_dim_v=16), False, layout="extremes/pad-heavy"),
    feature_case(Features(), True, layout="unaligned/block-edges", seq_len=160, kv_heads=1)]


@pytest.mark.parametrize("case", TOKAMAX_CASES, ids=lambda c: c.id)
def test_tokamax17_adapter_passes_on_a_stand_in(case, standin_tokamax):
    """The packed Mask (each query's run, causal, the public API's window) under tokamax's
    Mask semantics: every check passes, padding anywhere."""
    kernel = on_cpu(select_kernels("tokamax17:xla")[0])
    records = judged(kernel, case)
    assert records and not_ok(records) == []


# ----- with the libraries themselves (where installed) ----------------------------------------

need_tokamax17 = pytest.mark.skipif(
    not HAVE_TOKAMAX17, reason="tokamax >= 0.0.17 is not installed (Python >= 3.12 only)")
need_dew = pytest.mark.skipif(not HAVE_DEW, reason="dew_flash_attn is not installed")
need_fa4 = pytest.mark.skipif(not HAVE_FA4,
                              reason="fa4_jax is not installed (Python >= 3.12 only)")


def _import_or_skip(module: str):
    try:
        return importlib.import_module(module)
    except (ImportError, OSError) as exc:   # dew needs libcudart.so.13 loadable
        pytest.skip(f"{module} does not import on this machine: {exc}")


@need_tokamax17
@pytest.mark.parametrize("layout", ["padded/between", "extremes/pad-heavy"])
@pytest.mark.parametrize("window,causal", [((16, 0), True), ((16, 8), False), (None, True)])
def test_the_stand_in_mask_is_tokamax_s(layout, window, causal):
    from tokamax._src.ops.attention import base
    case = feature_case(layout=layout, seq_len=256)
    seg = jnp.asarray(case.segment_ids)
    real = tokamax17.packed_mask(base, seg, causal=causal, window=window)
    ours = tokamax17.packed_mask(types.SimpleNamespace(Mask=_Mask, CausalMask=_CausalMask), seg,
                                 causal=causal, window=window)
    t = case.seq_len
    want = np.broadcast_to(np.asarray(real.as_array(t, t)), (case.batch, 1, t, t))
    assert np.array_equal(np.broadcast_to(np.asarray(ours.as_array(t, t)), want.shape), want)


@need_tokamax17
@pytest.mark.parametrize("case", TOKAMAX_CASES + [
    feature_case(Features(softcap=5.0), False, layout="padded/left", dtype="float32")],
    ids=lambda c: c.id)
def test_tokamax17_xla_passes_on_cpu(case):
    records = judged(select_kernels("tokamax17:xla")[0], case)
    assert records and not_ok(records) == []


@pytest.fixture
def tokamax_as_on_the_h200(monkeypatch):
    """tokamax's device queries answered as the H200 would (sm90, 132 SMs, Pallas Triton's
    GPU info), and its cross-compilation mode on, for lowering its GPU ops on the CPU."""
    tokamax = _import_or_skip("tokamax")
    from jax._src.pallas.triton import gpu_info
    from tokamax._src import gpu_utils
    from tokamax._src import mosaic_gpu as tokamax_mosaic_gpu
    h200 = gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H200)
    monkeypatch.setattr(gpu_info, "get_gpu_info", lambda *a: h200)
    for check, answer in (("has_mosaic_gpu_support", True), ("is_sm90", True),
                          ("is_sm80", False), ("is_sm100", False)):
        monkeypatch.setattr(gpu_utils, check, lambda *a, answer=answer: answer)
    device = types.SimpleNamespace(core_count=H200_SMS, device_kind="NVIDIA H200")
    monkeypatch.setattr(tokamax_mosaic_gpu, "backend",
                        types.SimpleNamespace(get_default_device=lambda: device))
    with tokamax.config.cross_compile(True):
        yield


@need_tokamax17
@pytest.mark.parametrize("name", ["tokamax17:triton", "tokamax17:mosaic"])
@pytest.mark.parametrize("case", [
    feature_case(seq_len=256, head_dim=128),
    feature_case(Features(window=(16, 8), head_dim_v=32), False, seq_len=256, head_dim=64),
    feature_case(Features(window=(16, 0)), True, layout="padded/between", seq_len=256,
                 head_dim=64)], ids=lambda c: c.id)
def test_tokamax17_gpu_ops_lower_for_cuda_with_their_markers(name, case, tokamax_as_on_the_h200):
    """Forward and gradients, as the harness builds them, hold the Triton / Mosaic GPU calls
    (tokamax 0.0.17 lowers against this jax; 0.0.12's kernels raise here)."""
    kernel = select_kernels(name)[0]
    text = lowered_for_cuda(kernel_fn(kernel, case), case)
    assert [m for m in kernel.hlo_markers if m not in text] == []
    assert len(re.findall(r"custom_call @(__gpu\$xla\.gpu\.triton|mosaic_gpu\w*)", text)) >= 2


@need_tokamax17
def test_tokamax17_triton_refuses_the_soft_cap_by_name(tokamax_as_on_the_h200):
    """Its backward raises NotImplementedError("`logits_soft_cap` unsupported.") while traced:
    a refusal of softcap (Mosaic takes it)."""
    from harness.judge.judging import refused_feature
    case = feature_case(Features(softcap=2.0), seq_len=256, head_dim=64)
    with pytest.raises(NotImplementedError) as info:
        lowered_for_cuda(kernel_fn(select_kernels("tokamax17:triton")[0], case), case)
    assert refused_feature(case, info.value) == "softcap"
    text = lowered_for_cuda(kernel_fn(select_kernels("tokamax17:mosaic")[0], case), case)
    assert "mosaic_gpu" in text


# dew: its two FFI calls replaced by jnp, everything else (argument checks, custom_vjp, the
# sinks' scaling and dsinks, GQA's per-key-head gradients) its own.

def _fa3_forward(query, key, value, starts, longest, scale, causal, window):
    """What dew's FA3 varlen forward target returns: out [T, H, D] and lse [H, T] (float32;
    -inf where a row sees no key)."""
    assert starts is not None, "the adapter calls the varlen entry point"
    allowed = _fa_window(query.shape[0], starts[0], causal, window)
    heads = query.shape[1]
    kf = jnp.repeat(key, heads // key.shape[1], axis=1).astype(jnp.float32)
    s = jnp.einsum("qhd,khd->hqk", query.astype(jnp.float32), kf) * scale
    s = jnp.where(allowed[None], s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    out = _attend(query, key, value, allowed, scale)
    return out.astype(query.dtype), lse


def _fa3_backward(grad, query, key, value, out, lse, starts, longest, scale, causal, window):
    """FlashAttention's backward from the out and lse it is handed (dew hands the sunk output
    and lse + sink): P = exp(s - lse), dS = P * (dO.v - rowsum(dO * out)); dk, dv per key head."""
    allowed = _fa_window(query.shape[0], starts[0], causal, window)
    heads, kv_heads = query.shape[1], key.shape[1]
    group = heads // kv_heads
    f32 = jnp.float32
    q, g, o = (x.astype(f32) for x in (query, grad, out))
    k = jnp.repeat(key, group, axis=1).astype(f32)
    v = jnp.repeat(value, group, axis=1).astype(f32)
    s = jnp.einsum("qhd,khd->hqk", q, k) * scale
    p = jnp.where(allowed[None], jnp.exp(s - lse[:, :, None]), 0.0)
    dv = jnp.einsum("hqk,qhd->khd", p, g)
    dp = jnp.einsum("qhd,khd->hqk", g, v)
    delta = jnp.einsum("qhd,qhd->hq", g, o)
    ds = p * (dp - delta[:, :, None])
    dq = jnp.einsum("hqk,khd->qhd", ds, k) * scale
    dk = jnp.einsum("hqk,qhd->khd", ds, q) * scale
    n = key.shape[0]
    dk = dk.reshape(n, kv_heads, group, -1).sum(2)
    dv = dv.reshape(n, kv_heads, group, -1).sum(2)
    return dq.astype(query.dtype), dk.astype(key.dtype), dv.astype(value.dtype)


@pytest.fixture
def dew_on_cpu(monkeypatch):
    dew = _import_or_skip("dew_flash_attn")
    monkeypatch.setattr(dew, "_hopper", lambda: True)
    return dew


@need_dew
@pytest.mark.parametrize("case", DEW_CASES, ids=lambda c: c.id)
def test_dew_itself_passes_with_its_ffi_calls_in_jnp(case, dew_on_cpu, monkeypatch):
    """dew's own flash_mha_varlen (its sinks outside the kernel, dsinks through its custom_vjp,
    its GQA reduction) judged by the harness, its FA3 targets replaced by jnp."""
    monkeypatch.setattr(dew_on_cpu, "_forward3", _fa3_forward)
    monkeypatch.setattr(dew_on_cpu, "_backward3", _fa3_backward)
    kernel = on_cpu(select_kernels("dew_flash_attn:varlen")[0])
    records = judged(kernel, case)
    assert records and not_ok(records) == []
    assert any(r.check == "dsinks" for r in records) == case.features.sinks


@need_dew
@pytest.mark.parametrize("case", [
    feature_case(seq_len=256, head_dim=128, layout="padded/between"),
    feature_case(Features(window=(16, 8), sinks=True), False, seq_len=256, head_dim=64,
                 dtype="float16"),
    feature_case(Features(window=(16, 0), sinks=True), True, seq_len=256, head_dim=40,
                 kv_heads=1)], ids=lambda c: c.id)
def test_dew_lowers_for_cuda_with_its_fa3_targets(case, dew_on_cpu):
    """Forward and gradients hold dew's FA3 varlen targets, the window as its attributes."""
    kernel = select_kernels("dew_flash_attn:varlen")[0]
    text = lowered_for_cuda(kernel_fn(kernel, case), case)
    assert [m for m in kernel.hlo_markers if m not in text] == []
    left, right = case.features.window or (-1, -1)
    assert f"window_size_left = {left} : i64, window_size_right = {right} : i64" in text
    assert f"is_causal = {str(case.causal).lower()}" in text


@need_fa4
@pytest.mark.parametrize("case", FA4_CASES + [
    feature_case(Features(), False, layout="padded/between", seq_len=256, batch=4, seed=2)],
    ids=lambda c: c.id)
def test_fa4_reference_backend_passes_on_cpu(case):
    """fa4's own flash_attn_varlen, its pure-jnp reference backend (fa4's oracle for its
    kernels), judged by the harness: windows, value head dim, GQA, padding exactly 0."""
    _import_or_skip("fa4_jax")
    kernel = on_cpu(select_kernels("fa4:varlen")[0], requires=("fa4_jax",),
                    fn=functools.partial(fa4.fa4_flattened, backend="reference"))
    records = judged(kernel, case)
    assert records and not_ok(records) == []
    assert [r for r in records if r.check == "padding"]
    # Its forward mode (the reference backend's JVP rule, as the cute one's tangent kernel).
    assert len([r for r in records if r.check == "jvp"]) == len(case.segments)


@need_fa4
def test_fa4_compiles_its_sm90_kernels_on_the_cpu(monkeypatch):
    """Traced for CUDA with the device's architecture answered as sm_90, the CuTe DSL compiles
    fa4's real sm_90a kernels here (no GPU, no libcuda): the forward with LSE and the varlen
    backward, each marker present. Tens of seconds."""
    if not all(installed(m) for m in ("cutejax", "cutlass")):
        pytest.skip("fa4's cute stack (cutejax, nvidia-cutlass-dsl) is not installed")
    monkeypatch.setenv("CUTE_DSL_ARCH", "sm_90a")
    kernels = _import_or_skip("fa4_jax.kernels")
    monkeypatch.setattr(kernels, "_device_arch", lambda: 90)
    kernel = select_kernels("fa4:varlen")[0]
    case = feature_case(Features(window=(16, 0)), True, layout="padded/between", seq_len=256,
                        head_dim=64)
    text = lowered_for_cuda(kernel_fn(kernel, case), case)
    assert [m for m in kernel.hlo_markers if m not in text] == []
    assert "fa4_fwd_lse_dp" in text          # defined_padding's zero-filled outputs
    # Forward mode: the forward with LSE and the fused tangent kernel (zero-filled padding).
    text = lowered_for_cuda(kernel_fn(kernel, case, FORWARD), case, FORWARD)
    assert [m for m in kernel.forward_markers if m not in text] == []
    assert "fa4_jvp_dp" in text
