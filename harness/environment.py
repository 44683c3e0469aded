"""What a run ran on: platform, device, versions, commit, time."""
from __future__ import annotations

import datetime
import importlib.metadata
import platform as _platform
import subprocess
from pathlib import Path

import jax

from harness.registry import Platform


def current_platform() -> Platform:
    device = jax.devices()[0]
    cc = getattr(device, "compute_capability", None)
    return Platform(name=device.platform, compute_capability=float(cc) if cc else None)


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cudnn_version() -> str | None:
    try:
        from jax._src.lib import cuda_versions  # present only with the CUDA plugin
    except ImportError:
        return None
    if cuda_versions is None:
        return None
    try:
        v = cuda_versions.cudnn_get_version()
    except Exception:  # no GPU or no cuDNN library loadable
        return None
    return f"{v // 10000}.{v // 100 % 100}.{v % 100}"


def _gqa_offsets_bug() -> bool | None:
    try:
        from harness.sut.lowering import upstream_gqa_offsets_wrong
        return upstream_gqa_offsets_wrong()
    except Exception:  # the private jax module moved: unknown
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def describe() -> dict:
    device = jax.devices()[0]
    plat = current_platform()
    return {
        "platform": plat.name,
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "compute_capability": plat.compute_capability,
        "python": _platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": _version("jaxlib"),
        "cudnn": _cudnn_version(),
        "transformer_engine": _version("transformer_engine") or _version("transformer_engine_jax"),
        "maxtext": _version("maxtext"),
        "git_commit": _git_commit(),
        "jax_packed_gqa_offsets_bug": _gqa_offsets_bug(),
        "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": _platform.node(),
    }
