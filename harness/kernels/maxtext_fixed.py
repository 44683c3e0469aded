"""MaxText's own attention op with the project's patch applied: `maxtext_fixed:<kernel>`.

The patch (patches/maxtext-<version>/attention_op.patch, a unified diff of MaxText's
`src/maxtext/layers/attention_op.py`) is applied to the installed maxtext's source with the
`patch` tool (GNU patch; `git apply` where patch is missing), with no fuzz: a patch that does not
apply exactly is an error naming the file and the tool's message, never a half-patched op. The
result is loaded as its own module, `maxtext.layers.attention_op_fixed`, beside the untouched
original, and its AttentionOp is called exactly as the `maxtext:` kernels call the original
(harness.kernels.maxtext_adapter.maxtext_attention: same config, mesh and scaling).

Kernels:
- maxtext_fixed:cudnn_flash_jax: real cuDNN. On Hopper and newer the patched op takes cuDNN's
  packed layout (the hlo marker `__cudnn$fmha` proves the fused kernel ran); below, its segment
  mask (the bias path, with jax's limits on it: even seq_len, head_dim <= 128).
- maxtext_fixed:cudnn_flash_jax:emulated / :emulated-sm80 (CPU): the patched op with jax's
  cuDNN SDPA replaced by harness.sut.cudnn_emulator and jax's compute capability check answering
  as a 9.0 (packed path) or 8.0 (mask path) GPU would. The patch picks its path through
  `jax._src.cudnn.fused_attention_stablehlo.check_compute_capability`, the function jax itself
  uses, so nothing in MaxText's code is bypassed.
- maxtext:cudnn_flash_jax:emulated (CPU): the installed, unpatched op through the same emulator:
  maxtext <= 0.2.5 ignores segment ids there, and the harness must catch it, as on the GPU.

The emulator's stand-in is installed by replacing those two attributes of jax's module while the
kernel traces (the op imports them at call time), under a lock. These kernels run on CPUs only,
where nothing else calls jax's cuDNN SDPA.
"""
from __future__ import annotations

import atexit
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

from harness.kernels import maxtext_adapter
from harness.kernels.kernel import Kernel
from harness.kernels.libraries import mark_absl_flags_parsed
from harness.kernels.op import CUDNN, CUDNN_HEAD_DIMS, CUDNN_MARKER

PATCHES = Path(__file__).resolve().parents[2] / "patches"
PATCH_NAME = "attention_op.patch"
UPSTREAM_PATH = "src/maxtext/layers/attention_op.py"   # the file the patch names
ORIGINAL_MODULE = "maxtext.layers.attention_op"
FIXED_MODULE = "maxtext.layers.attention_op_fixed"
PACKED_MIN_CC = 9.0   # cuDNN's packed layout; below, the patched op takes the segment mask


class PatchError(RuntimeError):
    """The patch is missing, or does not apply to the installed maxtext."""


def version_text() -> str | None:
    import importlib.metadata
    try:
        return importlib.metadata.version("maxtext").split("+")[0]
    except importlib.metadata.PackageNotFoundError:
        return None


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
    atexit.register(shutil.rmtree, out_dir, True)  # kept until exit: tracebacks show its lines
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

def fixed_attention(query, key, value, segment_ids, *, causal, scale, max_segments, attention,
                    emulate: float | None = None, patched: bool = True):
    """MaxText's AttentionOp (patched, or the installed original), as the maxtext: kernels call
    it; `emulate`: through the cuDNN emulator as a GPU of that compute capability."""
    module = patched_module() if patched else None
    call = functools.partial(maxtext_adapter.maxtext_attention, query, key, value, segment_ids,
                             causal=causal, scale=scale, max_segments=max_segments,
                             attention=attention, attention_op_module=module)
    if emulate is None:
        return call()
    with emulated_cudnn(emulate):
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


def _constraints(cc: float | None = None):
    limits = _mask_path_limits(cc)
    return lambda case, platform: (maxtext_adapter.python_312(case, platform)
                                   + _has_patch(case, platform) + limits(case, platform))


_COMMON = dict(requires=("maxtext",), causal_only=True, takes_max_segments=True, dtypes=CUDNN)


def _kernel(name, description, *, emulate=None, patched=True, **capabilities):
    fn = functools.partial(fixed_attention, attention="cudnn_flash_jax", emulate=emulate,
                           patched=patched)
    if emulate is not None:
        capabilities.update(devices=("cpu",), materializes_scores=True)
    return Kernel(name, fn, **_COMMON, description=description, **capabilities)


KERNELS = [
    _kernel("maxtext_fixed:cudnn_flash_jax", head_dims=CUDNN_HEAD_DIMS, devices=("gpu",),
            min_compute_capability=8.0, hlo_markers=CUDNN_MARKER, constraints=_constraints(),
            description="MaxText's AttentionOp, attention=cudnn_flash_jax, with patches/ "
                        "applied (installed maxtext; packed cuDNN on Hopper+, mask below)"),
    _kernel("maxtext_fixed:cudnn_flash_jax:emulated", emulate=9.0, head_dims=CUDNN_HEAD_DIMS,
            constraints=_constraints(9.0),
            description="the patched MaxText op's packed path through the cuDNN emulator"),
    _kernel("maxtext_fixed:cudnn_flash_jax:emulated-sm80", emulate=8.0,
            head_dims=tuple(range(8, 129, 8)), constraints=_constraints(8.0),
            description="the patched MaxText op as on an sm80 GPU (segment mask), through the "
                        "cuDNN emulator"),
    _kernel("maxtext:cudnn_flash_jax:emulated", emulate=9.0, patched=False,
            head_dims=CUDNN_HEAD_DIMS, expect=maxtext_adapter.known_bug_expectation,
            constraints=maxtext_adapter.python_312,
            description="MaxText's AttentionOp as installed (unpatched), attention="
                        "cudnn_flash_jax, through the cuDNN emulator: maxtext <= 0.2.5 caught"),
]
