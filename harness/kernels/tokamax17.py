"""tokamax 0.0.17's packed path (extra `tokamax17`; Python >= 3.12, jax >= 0.11.1), as kernels
`tokamax17:xla`, `tokamax17:triton` and `tokamax17:mosaic`. The `tokamax:*` kernels
(harness.kernels.tokamax_adapter) stay as they are: the public function with a dense
same-segment mask, on whichever tokamax is installed (MaxText pins 0.0.12).

tokamax's public `dot_product_attention` has no segment ids or cu_seqlens (its
query/key_value_seq_lengths are right-padding, not packing). Its attention ops take a
`Mask` whose per-query key ranges express packing without a T x T array -- the `Mask`
docstring's own example, "a mask for two independent causal sequences":
`Mask(k_start=..., is_causal=True)`. That class and the ops live in private modules, so these
kernels call them as tokamax's public function does underneath:

    from tokamax._src.ops.attention import api, base
    api.IMPLEMENTATIONS[impl](q, k, v, mask=base.Mask(k_start=, k_end=, is_causal=),
                              logits_scale=scale, logits_soft_cap=cap)

with impl "xla" (base.DotProductAttention, einsum; dense scores), "triton"
(pallas_triton.PallasTritonFlashAttention) or "mosaic_gpu" (Mosaic GPU, sm80/sm90/sm100;
tokamax's public API maps "mosaic" to it on NVIDIA devices). q, k and v stay [B, T, H, D];
k_start/k_end are int32 [B, 1, T] ("*#B #h #T"): for each query, the start and end
(exclusive) of its run -- its segment, or the stretch of padding it sits in -- so a query
reads its own segment only, and padding reads only its own stretch (finite output, nothing
valid sees it; padding anywhere). Triton and Mosaic fold `is_causal` into k_end and pre-reduce
the ranges per block to skip blocks outside them.

Features, as tokamax takes them:
- window: the public API's own construction, `mask &= base.CausalMask(offset=right,
  window_size=left + right + 1)`: key k is read where k <= q + right and k > q + right -
  (left + right + 1), i.e. keys [i - left, i + right] on the row index; ANDed with the run's
  range that is the per-segment window (it depends on i - j only). Mosaic folds it into
  k_start/k_end; Triton reads it as a mask array (it folds only a plain causal mask).
- softcap: `logits_soft_cap=cap` ("logits = logits_soft_cap * tanh(logits /
  logits_soft_cap)", scale applied first: the harness's convention). Triton's backward raises
  NotImplementedError("`logits_soft_cap` unsupported.") while traced: a refusal naming it.
- head_dim_v: the value's own head dim ("*B t h d" -> output "*B T H d").
No sink or chunk argument.

A version check (`constraints`): the packed path needs tokamax >= 0.0.17. 0.0.12 (MaxText's
pin) has the same private modules, but its Triton kernel calls `pl.dot` (removed from jax
0.12, deprecated in 0.11) and its Mosaic kernel passes `out_shape=` to `plgpu.kernel` (fails on
jax 0.11.2): cases run under an older tokamax are skipped, naming the version found. The
version is the installed package's (its dist-info next to the module jax would import), read
without importing tokamax.
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp

from harness.kernels.flash_attn import run_starts
from harness.kernels.kernel import Kernel
from harness.kernels.op import CUDNN, CUDNN_HEAD_DIMS
from harness.kernels.reference import no_f16_on_cpu
from harness.kernels.tokamax_adapter import MOSAIC_MARKER, TRITON_MARKER

MIN_VERSION = (0, 0, 17)
# The features its ops take (harness.model.features).
TOKAMAX17_FEATURES = ("window", "softcap", "head_dim_v")
# Kernel name -> api.IMPLEMENTATIONS key.
IMPLEMENTATIONS = {"xla": "xla", "triton": "triton", "mosaic": "mosaic_gpu"}


def run_bounds(segment_ids):
    """(start, end) int32 [B, T]: the run (a segment, or a stretch of padding) each token sits
    in, end exclusive."""
    _, t = segment_ids.shape
    index = jnp.arange(t, dtype=jnp.int32)[None]
    begins = run_starts(segment_ids)
    start = jax.lax.cummax(jnp.where(begins, index, 0), axis=1)
    after = jnp.concatenate([begins[:, 1:], jnp.ones_like(begins[:, :1])], axis=1)
    end = jax.lax.cummin(jnp.where(after, index + 1, t), axis=1, reverse=True)
    return start.astype(jnp.int32), end.astype(jnp.int32)


def packed_mask(base, segment_ids, *, causal: bool, window=None):
    """tokamax's Mask for the packed rows: each query's key range its run's, causal as asked,
    the window as the public API builds it (CausalMask(offset=right, window_size=left + right
    + 1))."""
    start, end = run_bounds(segment_ids)
    mask = base.Mask(k_start=start[:, None, :], k_end=end[:, None, :], is_causal=causal)
    if window is not None:
        left, right = int(window[0]), int(window[1])
        mask &= base.CausalMask(offset=right, window_size=left + right + 1)
    return mask


def tokamax17_attention(query, key, value, segment_ids, *, causal, scale, implementation,
                        window=None, softcap=None):
    """api.IMPLEMENTATIONS[implementation](q, k, v, mask=<the packed Mask>, logits_scale=scale,
    logits_soft_cap=softcap)."""
    from tokamax._src.ops.attention import api, base
    op = api.IMPLEMENTATIONS[implementation]
    mask = packed_mask(base, segment_ids, causal=causal, window=window)
    return op(query, key, value, mask=mask, logits_scale=scale,
              logits_soft_cap=None if softcap is None else float(softcap))


def _release(text: str) -> tuple[int, ...]:
    m = re.match(r"\d+(?:\.\d+)*", text.strip())
    return tuple(int(x) for x in m.group().split(".")) if m else ()


def installed_version() -> str | None:
    """The tokamax version an import would load (None: not installed): the imported module's,
    else the dist-info beside the package on the import path, else the first on sys.path."""
    module = sys.modules.get("tokamax")
    if module is not None and getattr(module, "__version__", None):
        return str(module.__version__)
    spec = importlib.util.find_spec("tokamax")
    if spec is None:
        return None
    found = _version_beside(str(Path(spec.origin).resolve().parent.parent)) \
        if spec.origin else None
    if found is not None:
        return found
    try:
        return importlib.metadata.version("tokamax")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


@functools.lru_cache(maxsize=None)
def _version_beside(root: str) -> str | None:
    """The version of the tokamax dist-info in `root`, once per folder: every kernel and case
    asks (reading the dist-infos each time took the H200's warm nightly 2.3 s of its run's
    thread at 4d948f1)."""
    for dist in importlib.metadata.distributions(path=[root]):
        if (dist.metadata["Name"] or "").lower() == "tokamax":
            return dist.version
    return None


def version_constraint(case, platform) -> list[str]:
    """Skips where the tokamax installed is older than the packed path needs (requires= says
    so where none is)."""
    found = installed_version()
    if found is None or _release(found) >= MIN_VERSION:
        return []
    return [f"needs tokamax >= {'.'.join(map(str, MIN_VERSION))} (found {found})"]


def _impl(name: str):
    return functools.partial(tokamax17_attention, implementation=IMPLEMENTATIONS[name])


_COMMON = dict(requires=("tokamax",), padding_anywhere=True, features=TOKAMAX17_FEATURES)

# No forward mode (no jvp check): tokamax 0.0.17's attention is a custom_vjp, and jax.jvp
# through it raises "can't apply forward-mode autodiff (jvp) to a custom_vjp function"
# (its XLA implementation, on a CPU with jax 0.12; the rule is the library's, not the
# device's).
KERNELS = [
    Kernel("tokamax17:xla", _impl("xla"), materializes_scores=True,
           constraints=lambda c, p: version_constraint(c, p) + no_f16_on_cpu(c, p), **_COMMON,
           description="tokamax 0.0.17 xla attention op (einsum), packed through "
                       "Mask(k_start, k_end, is_causal)"),
    # Conservative capabilities (bf16/f16, head dims multiples of 8 up to 256), as for
    # tokamax:triton/mosaic.
    Kernel("tokamax17:triton", _impl("triton"), dtypes=CUDNN, head_dims=CUDNN_HEAD_DIMS,
           devices=("gpu",), min_compute_capability=8.0, hlo_markers=TRITON_MARKER,
           constraints=version_constraint, **_COMMON,
           description="tokamax 0.0.17 Pallas Triton flash attention, packed through "
                       "Mask(k_start, k_end, is_causal)"),
    Kernel("tokamax17:mosaic", _impl("mosaic"), dtypes=CUDNN, head_dims=CUDNN_HEAD_DIMS,
           devices=("gpu",), min_compute_capability=9.0, hlo_markers=MOSAIC_MARKER,
           constraints=version_constraint, **_COMMON,
           description="tokamax 0.0.17 Pallas Mosaic GPU flash attention, packed through "
                       "Mask(k_start, k_end, is_causal)"),
]
