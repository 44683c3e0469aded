"""The kernel registry. A kernel declares what it supports; the matrix is generated from that.

A kernel is `fn(query, key, value, segment_ids, *, causal, scale) -> output`, MaxText layout
[batch, seq, heads, head_dim], output shaped like the query. Combinations a kernel does not
declare are skipped, each with its reason; a kernel that raises on a declared combination is an
error, never a skip.
"""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from harness.cases import Case
from harness.layouts import Segment

ALL_DTYPES = ("float32", "bfloat16", "float16")
CHECKS = ("out", "dq", "dk", "dv")
LEAK = "leak"  # the tolerance-free check of harness.leak_probe

# expect(case, check, segment) -> "pass" | "fail" | "either": what a correct harness must
# conclude ("either": not judged, the verdict is reported only).
Expectation = Callable[[Case, str, Segment], str]


@dataclass(frozen=True)
class Platform:
    name: str                      # "cpu" or "gpu"
    compute_capability: float | None = None


@dataclass(frozen=True, eq=False)
class Kernel:
    name: str
    fn: Callable
    dtypes: tuple[str, ...] = ALL_DTYPES
    head_dims: tuple[int, ...] | None = None   # None: any head dim
    gqa: bool = True
    packed: bool = True
    causal_only: bool = False
    devices: tuple[str, ...] = ("cpu", "gpu")
    min_compute_capability: float | None = None
    backward: bool = True
    requires: tuple[str, ...] = ()             # importable modules, checked lazily
    seq_len_multiple: int | None = None
    # Pass max_segments=case.max_segments (static): for kernels configured like MaxText's
    # max_segments_per_seq.
    takes_max_segments: bool = False
    # Anything else a kernel cannot do: (case, platform) -> reasons (empty when it can).
    constraints: Callable[[Case, Platform], list[str]] | None = None
    expect: Expectation | None = None
    # Known upstream failure: the kernel must raise an error containing this text. It is then
    # recorded as "known" (not bad); if it stops raising, that is reported as "missed".
    expect_error: str | None = None
    # Custom-call names that must appear in the compiled program: proof that the fused kernel
    # ran, so a silent fallback cannot pass as it.
    hlo_markers: tuple[str, ...] = ()
    description: str = ""
    tags: tuple[str, ...] = field(default=())

    def unsupported_reasons(self, case: Case, platform: Platform) -> list[str]:
        reasons = []
        if platform.name not in self.devices:
            reasons.append(f"runs on {'/'.join(self.devices)}, not {platform.name}")
        if (self.min_compute_capability is not None and platform.name == "gpu"
                and (platform.compute_capability or 0) < self.min_compute_capability):
            reasons.append(f"needs compute capability >= {self.min_compute_capability}, "
                           f"device has {platform.compute_capability}")
        if case.dtype not in self.dtypes:
            reasons.append(f"dtype {case.dtype} not in {'/'.join(self.dtypes)}")
        if self.head_dims is not None and case.head_dim not in self.head_dims:
            reasons.append(f"head_dim {case.head_dim} not in {self.head_dims}")
        if case.gqa and not self.gqa:
            reasons.append(f"no GQA/MQA ({case.heads} heads over {case.kv_heads} kv heads)")
        if case.packed and not self.packed:
            reasons.append("no packed segments")
        if not case.causal and self.causal_only:
            reasons.append("causal only")
        if self.seq_len_multiple and case.seq_len % self.seq_len_multiple:
            reasons.append(f"seq_len {case.seq_len} not a multiple of {self.seq_len_multiple}")
        if self.constraints is not None:
            reasons += self.constraints(case, platform)
        for module in self.requires:
            if importlib.util.find_spec(module.split(".")[0]) is None:
                reasons.append(f"optional dependency {module!r} is not installed")
        return reasons

    def expected(self, case: Case, check: str, segment: Segment) -> str:
        return self.expect(case, check, segment) if self.expect else "pass"


_KERNELS: dict[str, Kernel] = {}


def register_kernel(name: str, fn: Callable, *, replace: bool = False, **capabilities) -> Kernel:
    """Adds a kernel to the matrix. Capabilities are the fields of `Kernel`."""
    _load_builtins()  # so a user's kernel cannot silently take a built-in's name
    if name in _KERNELS and not replace:
        raise ValueError(f"kernel {name!r} is already registered")
    dtypes = capabilities.get("dtypes")
    if dtypes is not None:
        unknown = set(dtypes) - set(ALL_DTYPES)
        if unknown:
            raise ValueError(f"kernel {name!r}: unknown dtypes {sorted(unknown)}")
        capabilities["dtypes"] = tuple(dtypes)
    kernel = Kernel(name=name, fn=fn, **capabilities)
    _KERNELS[name] = kernel
    return kernel


def load_kernel_module(path: str | Path) -> None:
    """Imports a user's Python file that calls register_kernel."""
    path = Path(path).resolve()
    if not path.is_file():
        raise FileNotFoundError(f"kernel module not found: {path}")
    module_name = f"harness_user_kernels_{path.stem}"
    if module_name in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)


def _load_builtins() -> None:
    import harness.kernels  # noqa: F401  (registers the built-in kernels on first import)


def all_kernels() -> dict[str, Kernel]:
    _load_builtins()
    return dict(_KERNELS)


def select_kernels(names: str | list[str] | None = None) -> list[Kernel]:
    """All kernels, or the ones named (comma-separated or a list); unknown names are an error."""
    kernels = all_kernels()
    if not names:
        return list(kernels.values())
    wanted = [n.strip() for n in (names.split(",") if isinstance(names, str) else names)
              if n.strip()]
    unknown = [n for n in wanted if n not in kernels]
    if unknown:
        raise KeyError(f"unknown kernels {unknown}; registered: {', '.join(kernels)}")
    return [kernels[n] for n in wanted]
