"""What a run ran on: platform, device, versions, commit, time."""
from __future__ import annotations

import datetime
import functools
import importlib
import importlib.metadata
import importlib.util
import os
import platform as _platform
import subprocess
from pathlib import Path

import jax

from harness.kernels.kernel import Platform


@functools.lru_cache(maxsize=1)
def nvidia_smi_gpus() -> int | None:
    """How many GPUs `nvidia-smi -L` lists; None without it (no NVIDIA driver) or where it
    fails. Asks no jax backend: a controller that starts one takes a GPU's memory from its
    workers."""
    import shutil
    if not shutil.which("nvidia-smi"):
        return None
    try:
        listing = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True,
                                 timeout=60, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return sum(line.startswith("GPU ") for line in listing.splitlines())


def nvidia_gpus() -> int:
    """The GPUs this process may use by nvidia-smi's count (0 where CUDA_VISIBLE_DEVICES hides
    them all, or without the driver)."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) in ("", "-1"):
        return 0
    return nvidia_smi_gpus() or 0


def check_backend() -> None:
    """jax's backend starts, or a UsageError of one line saying why (JAX_PLATFORMS=cuda on a
    machine without a GPU, a CUDA plugin that cannot load): before any work."""
    from harness.errors import UsageError
    try:
        jax.devices()
    except Exception as exc:   # noqa: BLE001 - jax raises RuntimeError, or AssertionError
        chosen = os.environ.get("JAX_PLATFORMS")
        first = next((ln for ln in str(exc).splitlines() if ln.strip()), None)
        # jax says nothing more than AssertionError where JAX_PLATFORMS names a platform whose
        # plugin is not installed or finds no device: say what that usually means.
        why = first[:300] if first else (
            f"{type(exc).__name__} without a message from jax"
            + (f"; is there a {chosen} device and jax's plugin for it (for cuda: "
               "pip install -e '.[gpu]')? JAX_PLATFORMS=cpu, or unset, runs on the CPU"
               if chosen else ""))
        raise UsageError("jax cannot start its backend"
                         + (f" (JAX_PLATFORMS={chosen})" if chosen else "")
                         + f": {why}") from None


def current_platform() -> Platform:
    from harness.engine.memory import device_memory_bytes

    check_backend()
    device = jax.devices()[0]
    cc = getattr(device, "compute_capability", None)
    return Platform(name=device.platform, compute_capability=float(cc) if cc else None,
                    memory_bytes=device_memory_bytes(), device_count=len(jax.devices()))


def package_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        pass
    # Installed without its metadata (e.g. a bundle on PYTHONPATH): ask the module itself.
    try:
        spec = importlib.util.find_spec(dist)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    try:
        return getattr(importlib.import_module(dist), "__version__", None) or "unknown version"
    except Exception:
        return "unknown version"


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


@functools.lru_cache(maxsize=1)
def gqa_offsets_bug() -> bool | None:
    """Whether this jax has the packed-GQA offsets bug (None: the probe of jax's private
    arithmetic failed, unknown)."""
    try:
        from harness.sut.lowering import upstream_gqa_offsets_wrong
        return upstream_gqa_offsets_wrong()
    except Exception:  # the private jax module moved: unknown
        return None


def _git(*args) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parent, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_state() -> tuple[str | None, bool | None]:
    """(commit, dirty) of the code that runs. HARNESS_GIT_COMMIT (and HARNESS_GIT_DIRTY), where
    set, say it: a GPU runner gets a copy of the working tree, whose .git, if any, can be stale
    (seen on the H200 runner: a .git of an older commit beside the newer tree). Otherwise git."""
    commit = os.environ.get("HARNESS_GIT_COMMIT") or None
    if commit:
        dirty = os.environ.get("HARNESS_GIT_DIRTY")
        return commit, None if dirty is None else dirty not in ("", "0", "false")
    commit = _git("rev-parse", "HEAD")
    if commit:
        status = _git("status", "--porcelain", "--untracked-files=no")
        return commit, bool(status) if status is not None else None
    return None, None


def describe_host() -> dict:
    """What a controller knows without starting a device (its workers' headers say the rest):
    the versions, the commit, the host, the time."""
    commit, dirty = git_state()
    return {"python": _platform.python_version(), "jax": jax.__version__,
            "jaxlib": package_version("jaxlib"), "git_commit": commit, "git_dirty": dirty,
            "time_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(
                timespec="seconds"),
            "host": _platform.node()}


def describe() -> dict:
    device = jax.devices()[0]
    commit, dirty = git_state()
    plat = current_platform()
    return {
        "platform": plat.name,
        "device_kind": device.device_kind,
        "device_count": jax.device_count(),
        "compute_capability": plat.compute_capability,
        "python": _platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": package_version("jaxlib"),
        "cudnn": _cudnn_version(),
        "transformer_engine": (package_version("transformer_engine")
                               or package_version("transformer_engine_jax")),
        "maxtext": package_version("maxtext"),
        "git_commit": commit,
        "git_dirty": dirty,
        "jax_packed_gqa_offsets_bug": gqa_offsets_bug(),
        "time_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": _platform.node(),
    }


def usable_cores() -> int:
    """Cores this process may run on (its affinity, e.g. `taskset`), shared among the pytest
    workers of one machine and the engine's workers running at once."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 2
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1") or 1)
    # The engine's workers running at once on this host (harness.engine.main_parts).
    workers *= int(os.environ.get("HARNESS_WORKERS_AT_ONCE", "1") or 1)
    return max(1, cores // workers)
