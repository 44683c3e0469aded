"""MaxText's own attention op with the project's patch applied: `maxtext_fixed:<kernel>`.

The patch (patches/maxtext-<version>/attention_op.patch, a unified diff of MaxText's
`src/maxtext/layers/attention_op.py`) is applied to the installed maxtext's source with the
`patch` tool (GNU patch; `git apply` where patch is missing), with no fuzz: a patch that does not
apply exactly is an error naming the file and the tool's message, never a half-patched op. The
result is loaded as its own module, `maxtext.layers.attention_op_fixed`, beside the untouched
original, and its AttentionOp is called exactly as the `maxtext:` kernels call the original
(harness.kernels.maxtext_adapter.maxtext_attention: same config, mesh and scaling).

Kernels (each takes the features the maxtext: kernels take, handed over the same way; with
the patch every path honours a feature or refuses it when the op is configured, so none
declares a known drop):
- maxtext_fixed:cudnn_flash_jax: real cuDNN. On Hopper and newer the patched op takes cuDNN's
  packed layout (the hlo marker `__cudnn$fmha` proves the fused kernel ran); below, its segment
  mask (the bias path, with jax's limits on it: even seq_len, head_dim <= 128). The window goes
  to cuDNN as `sliding_window_length` (packed: per segment; below Hopper, into the mask); soft
  cap and chunks are refused by AttentionOp.__init__, sinks by validate_gpu_flash_attention; a
  value head dim of its own (MLA) reaches the packed call padded to the query's (jax lays the
  packed value and output out with the query's head dim).
- maxtext_fixed:cudnn_flash_jax:emulated / :emulated-sm80 (CPU): the patched op with jax's
  cuDNN SDPA replaced by harness.sut.cudnn_emulator and jax's compute capability check answering
  as a 9.0 (packed path) or 8.0 (mask path) GPU would. The patch picks its path through
  `jax._src.cudnn.fused_attention_stablehlo.check_compute_capability`, the function jax itself
  uses, so nothing in MaxText's code is bypassed. The emulator takes `sliding_window_length` as
  cuDNN does (a left bound; the right bound is the query under a causal mask type).
- maxtext:cudnn_flash_jax:emulated (CPU): the installed, unpatched op through the same emulator:
  maxtext <= 0.2.5 ignores segment ids there, and the window, chunks and soft cap, and the
  harness must catch it (segments) or report it known (features), as on the GPU.
- maxtext_fixed:cudnn_flash_te (GPU, TE): the patched op's TE path: window as before, sinks
  where TE's cuDNN is 9.26 or newer (below, TE would fall back to a path that fails on packed
  rows: refused at configuration, naming the sinks), soft cap and chunks refused at
  configuration.
- maxtext_fixed:dot_product (CPU, GPU): the patched op's dot_product (it honours everything;
  the patch adds only the configuration checks on its way).
- maxtext:flash:emulated, maxtext_fixed:flash:emulated (CPU): MaxText's GPU `flash` path
  (apply_attention's tokamax branch, which a CPU takes too) with tokamax's Pallas-Triton class
  replaced by tokamax's own XLA reference of the same op (tokamax._src.ops.attention.base.
  DotProductAttention: same call, same Mask), so that the mask MaxText builds is checked where
  no Triton runs: unpatched, the window, chunks and soft cap are dropped (known); patched, the
  window and chunks honoured, the soft cap refused.

The stand-ins are installed by replacing attributes of jax's (or tokamax's) module while the
kernel traces (the op looks them up at call time), under a lock. These kernels run on CPUs only,
where nothing else calls jax's cuDNN SDPA or tokamax's Triton flash attention.
"""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

from harness.kernels import maxtext_adapter, maxtext_known
from harness.kernels.kernel import ALL_DTYPES, Kernel, Platform
from harness.kernels.libraries import mark_absl_flags_parsed
from harness.kernels.op import CUDNN, CUDNN_HEAD_DIMS, CUDNN_MARKER
from harness.kernels.reference import no_f16_on_cpu
from harness.kernels.te import TE_BACKWARD_MARKERS, TE_DETERMINISTIC, TE_MARKERS
from harness.process_end import at_end

PATCHES = Path(__file__).resolve().parents[2] / "patches"
PATCH_NAME = "attention_op.patch"
UPSTREAM_PATH = "src/maxtext/layers/attention_op.py"   # the file the patch names
ORIGINAL_MODULE = "maxtext.layers.attention_op"
FIXED_MODULE = "maxtext.layers.attention_op_fixed"
PACKED_MIN_CC = 9.0   # cuDNN's packed layout; below, the patched op takes the segment mask


class PatchError(RuntimeError):
    """The patch is missing, or does not apply to the installed maxtext."""


version_text = maxtext_known.version_text


def patch_path(version: str | None = None) -> Path:
    """patches/maxtext-<version>/attention_op.patch for the installed (or given) version."""
    version = version or version_text()
    path = PATCHES / f"maxtext-{version}" / PATCH_NAME
    if not path.is_file():
        known = sorted(p.parent.name for p in PATCHES.glob(f"maxtext-*/{PATCH_NAME}"))
        raise PatchError(f"no patch for maxtext {version}: {path} is missing (patches exist for "
                         f"{', '.join(known) or 'no version'})")
    return path


def original_source() -> Path:
    spec = importlib.util.find_spec(ORIGINAL_MODULE)
    if spec is None or not spec.origin:
        raise PatchError(f"{ORIGINAL_MODULE} is not installed")
    return Path(spec.origin)


def apply_to_tree(patch: Path, root: Path, *, dry_run: bool = False) -> None:
    """Applies a unified diff whose paths are a/..., b/... inside the folder `root`: GNU patch
    without fuzz (a drifted source fails rather than patching the nearest match), or `git apply`
    where patch is missing. PatchError with the tool's message when it does not apply."""
    if shutil.which("patch"):
        cmd = ["patch", "-p1", "--batch", "--forward", "--fuzz=0", "--reject-file=-",
               f"--directory={root}", f"--input={patch}", *(["--dry-run"] if dry_run else [])]
        env = None
    elif shutil.which("git"):
        cmd = ["git", "-C", str(root), "apply", *(["--check"] if dry_run else []), str(patch)]
        # Never let git find a repository above `root` and apply the patch there instead.
        env = {**os.environ, "GIT_CEILING_DIRECTORIES": str(root.parent)}
    else:
        raise PatchError("applying the MaxText patch needs the `patch` tool (GNU patch) or git; "
                         "neither is on PATH")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        message = " ".join((proc.stdout + proc.stderr).split())
        raise PatchError(f"{patch} does not apply in {root} ({cmd[0]}): {message}")


def apply_patch(source: Path, patch: Path, out_dir: Path, *, dry_run: bool = False) -> Path:
    """A copy of `source` at out_dir/src/maxtext/layers/attention_op.py (the path the patch
    names), patched there; returns its path. The installed file is never written."""
    out = out_dir / UPSTREAM_PATH
    out.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(source, out)
    try:
        apply_to_tree(patch, out_dir, dry_run=dry_run)
    except PatchError as exc:
        raise PatchError(f"{exc} (source: {source})") from None
    return out


@functools.lru_cache(maxsize=1)
def patched_module():
    """The installed maxtext's attention_op.py with the patch applied, loaded (once per
    process) as `maxtext.layers.attention_op_fixed`; the original module stays as it is."""
    mark_absl_flags_parsed()  # MaxText's libraries read absl flags at import
    source, patch = original_source(), patch_path()
    out_dir = Path(tempfile.mkdtemp(prefix="maxtext-fixed-"))
    at_end(shutil.rmtree, out_dir, True)  # kept until the process ends: tracebacks show its lines
    patched = apply_patch(source, patch, out_dir)
    spec = importlib.util.spec_from_file_location(FIXED_MODULE, patched)
    module = importlib.util.module_from_spec(spec)
    sys.modules[FIXED_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[FIXED_MODULE]
        raise
    return module


# ----- the cuDNN emulator in place of jax's SDPA ------------------------------------------------

_EMULATION = threading.Lock()


def emulated_sdpa(compute_capability: float):
    """jax's cuDNN `dot_product_attention`, emulated (harness.sut.cudnn_emulator) as on a GPU of
    that compute capability. The emulator computes no logsumexp: with return_residual, a NaN
    residual stands in (MaxText's train path discards it; any use of it would show)."""
    import jax.numpy as jnp

    from harness.sut import cudnn_emulator

    def sdpa(query, key, value, *args, return_residual=False, **kwargs):
        out = cudnn_emulator.dot_product_attention(query, key, value, *args,
                                                   compute_capability=compute_capability,
                                                   **kwargs)
        if not return_residual:
            return out
        b, t, n, _ = query.shape
        return out, jnp.full((b, n, t), jnp.nan, jnp.float32)
    return sdpa


@contextlib.contextmanager
def emulated_cudnn(compute_capability: float):
    """While inside: jax's cuDNN SDPA is the emulator, and jax's compute capability check
    answers as a GPU of `compute_capability` would."""
    from unittest import mock

    from jax._src.cudnn import fused_attention_stablehlo as sdpa_module

    def check_compute_capability(capability: str) -> bool:
        return compute_capability >= float(capability)

    with _EMULATION, \
            mock.patch.object(sdpa_module, "dot_product_attention",
                              emulated_sdpa(compute_capability)), \
            mock.patch.object(sdpa_module, "check_compute_capability", check_compute_capability):
        yield


# ----- kernels ----------------------------------------------------------------------------------

@contextlib.contextmanager
def emulated_triton():
    """While inside: tokamax's Pallas-Triton flash attention class, which MaxText's GPU `flash`
    path instantiates and calls, is tokamax's XLA reference of the same op (same arguments,
    same Mask; it runs anywhere)."""
    from unittest import mock

    from tokamax._src.ops.attention import base as tokamax_base
    from tokamax._src.ops.attention import pallas_triton

    with _EMULATION, mock.patch.object(pallas_triton, "PallasTritonFlashAttention",
                                       tokamax_base.DotProductAttention):
        yield


def fixed_attention(query, key, value, segment_ids, *, causal, scale, max_segments, attention,
                    emulate: float | None = None, patched: bool = True, **features):
    """MaxText's AttentionOp (patched, or the installed original), as the maxtext: kernels call
    it, with the case's features; `emulate`: through the cuDNN emulator as a GPU of that compute
    capability (attention=cudnn_flash_jax), or through tokamax's XLA reference in place of its
    Triton kernel (attention=flash)."""
    module = patched_module() if patched else None
    call = functools.partial(maxtext_adapter.maxtext_attention, query, key, value, segment_ids,
                             causal=causal, scale=scale, max_segments=max_segments,
                             attention=attention, attention_op_module=module, **features)
    if emulate is None:
        return call()
    with (emulated_triton() if attention == "flash" else emulated_cudnn(emulate)):
        return call()


def _has_patch(case, platform):
    if sys.version_info < (3, 12) or version_text() is None:
        return []          # the adapter's rule and `requires` give the reason
    try:
        patch_path()
    except PatchError as exc:
        return [str(exc)]
    return []


def _mask_path_limits(cc: float | None):
    """jax's limits on cuDNN with a bias (the patched op's path below Hopper)."""
    def reasons(case, platform):
        here = cc if cc is not None else (platform.compute_capability
                                          if platform.name == "gpu" else None)
        if here is None or here >= PACKED_MIN_CC:
            return []
        out = []
        if case.seq_len % 2:
            out.append(f"odd seq_len {case.seq_len}: cuDNN with a bias needs an even one in "
                       "training (the patched op's pre-Hopper path)")
        if case.head_dim > 128:
            out.append(f"head_dim {case.head_dim} > 128 below Hopper")
        return out
    return reasons


def _mla_limits(cc: float | None):
    """jax's cuDNN takes a value head dim of its own (MLA) on Hopper and newer only
    (maxtext_adapter.mla_needs_hopper), on a GPU of compute capability `cc` (None: the
    platform's)."""
    def reasons(case, platform):
        here = platform if cc is None else Platform("gpu", cc)
        return maxtext_adapter.mla_needs_hopper(case, here)
    return reasons


def _constraints(*limits):
    """MaxText's (Python, what its API cannot express), the patch's (one for this version), and
    the path's `limits` (functions of case and platform)."""
    return lambda case, platform: (maxtext_adapter.maxtext_constraints(case, platform)
                                   + _has_patch(case, platform)
                                   + [r for f in limits for r in f(case, platform)])


def _cudnn_flash_jax_constraints(cc: float | None = None):
    return _constraints(_mask_path_limits(cc), _mla_limits(cc))


_COMMON = dict(requires=("maxtext",), causal_only=True, takes_max_segments=True, dtypes=CUDNN,
               features=maxtext_adapter.MAXTEXT_FEATURES,
               conventions=maxtext_adapter.MAXTEXT_CONVENTIONS)


def _kernel(name, description, *, attention="cudnn_flash_jax", emulate=None, patched=True,
            **capabilities):
    fn = functools.partial(fixed_attention, attention=attention, emulate=emulate,
                           patched=patched)
    if emulate is not None:
        capabilities.update(devices=("cpu",), materializes_scores=True)
    return Kernel(name, fn, **{**_COMMON, **capabilities}, description=description)


# The flash kernels' `emulate`: any value puts tokamax's XLA reference in place of Triton.
# MaxText's GPU flash path masks by comparing segment ids (padding attends padding only), so,
# like dot_product, it takes padding anywhere. tokamax's XLA reference multiplies float16 with
# float32 accumulation, which XLA:CPU does not do.
XLA_FOR_TRITON = 0.0

KERNELS = [
    _kernel("maxtext_fixed:cudnn_flash_jax", head_dims=CUDNN_HEAD_DIMS, devices=("gpu",),
            min_compute_capability=8.0, hlo_markers=CUDNN_MARKER,
            constraints=_cudnn_flash_jax_constraints(),
            description="MaxText's AttentionOp, attention=cudnn_flash_jax, with patches/ "
                        "applied (installed maxtext; packed cuDNN on Hopper+, mask below; "
                        "window honoured, soft cap, chunks and sinks refused)"),
    _kernel("maxtext_fixed:cudnn_flash_jax:emulated", emulate=9.0, head_dims=CUDNN_HEAD_DIMS,
            constraints=_cudnn_flash_jax_constraints(9.0),
            description="the patched MaxText op's packed path through the cuDNN emulator"),
    _kernel("maxtext_fixed:cudnn_flash_jax:emulated-sm80", emulate=8.0,
            head_dims=tuple(range(8, 129, 8)), constraints=_cudnn_flash_jax_constraints(8.0),
            description="the patched MaxText op as on an sm80 GPU (segment mask), through the "
                        "cuDNN emulator"),
    _kernel("maxtext:cudnn_flash_jax:emulated", emulate=9.0, patched=False,
            head_dims=CUDNN_HEAD_DIMS, expect=maxtext_known.CUDNN_FLASH_JAX_EXPECT,
            constraints=maxtext_adapter.maxtext_constraints,
            description="MaxText's AttentionOp as installed (unpatched), attention="
                        "cudnn_flash_jax, through the cuDNN emulator: maxtext <= 0.2.5 caught "
                        "(segment ids), known (window, chunks, soft cap)"),
    _kernel("maxtext_fixed:cudnn_flash_te", attention="cudnn_flash_te", devices=("gpu",),
            min_compute_capability=9.0, hlo_markers=TE_MARKERS,
            backward_markers=TE_BACKWARD_MARKERS,
            deterministic_env=TE_DETERMINISTIC, padding_output="zero",
            requires=("maxtext", "transformer_engine"), constraints=_constraints(),
            description="MaxText's AttentionOp, attention=cudnn_flash_te, with patches/ applied "
                        "(installed maxtext and TE; window honoured, sinks from TE's cuDNN 9.26 "
                        "on, soft cap, chunks and sinks below it refused)"),
    # dot_product computes in the inputs' dtype: every dtype, on any device; padding anywhere.
    _kernel("maxtext_fixed:dot_product", attention="dot_product", dtypes=ALL_DTYPES,
            padding_anywhere=True, materializes_scores=True, constraints=_constraints(),
            expect=maxtext_known.float16_sum_expectation, forward_mode=True,
            description="MaxText's AttentionOp, attention=dot_product, with patches/ applied "
                        "(it honours every feature; the patch adds checks on its way)"),
    _kernel("maxtext:flash:emulated", attention="flash", emulate=XLA_FOR_TRITON, patched=False,
            expect=maxtext_known.FLASH_EXPECT,
            constraints=lambda c, p: maxtext_adapter.maxtext_constraints(c, p)
            + no_f16_on_cpu(c, p), padding_anywhere=True,
            description="MaxText's AttentionOp as installed (unpatched), attention=flash on its "
                        "GPU path, with tokamax's XLA reference in place of Triton: maxtext <= "
                        "0.2.5 known (window, chunks, soft cap)"),
    _kernel("maxtext_fixed:flash:emulated", attention="flash", emulate=XLA_FOR_TRITON,
            constraints=_constraints(no_f16_on_cpu), padding_anywhere=True,
            description="the patched MaxText op's GPU flash path with tokamax's XLA reference "
                        "in place of Triton: window and chunks in its mask, soft cap refused"),
]
