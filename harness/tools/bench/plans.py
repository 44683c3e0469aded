"""The bench's plan: for each shape and entry, what runs on this device (the kernel or raw call,
and through what: cuDNN, TE, XLA or the cuDNN emulator), or why not; and each program's estimated
peak memory against the device's limit, checked before any work."""
from __future__ import annotations

import dataclasses
import importlib.util
import os
from dataclasses import dataclass, field

import jax.numpy as jnp

from harness.errors import UsageError
from harness.kernels.kernel import Kernel, Platform, scores_bytes
from harness.kernels.op import CUDNN as CUDNN_DTYPES
from harness.model.case import Case
from harness.sut.config import PACKED_MIN_CC
from harness.tools.bench.entries import (
    MASK_BIAS,
    TE_MASKS,
    BenchEntry,
    RawCall,
    gqa_offsets_bug,
    registered,
)
from harness.tools.bench.shapes import Shape

GiB = 2 ** 30
CPU_DENSE_FACTOR = 2                # XLA:CPU's dense peak over scores_bytes (see the docstring)
TE_MASK_BYTES_PER_PAIR = 10         # TE's segment-id path may build [B, 1, T, T] masks (bool/int32)


@dataclass
class Plan:
    """One entry at one shape on this device: what runs, or why not."""
    entry: BenchEntry
    shape: Shape
    kernel: Kernel | None
    via: str
    reasons: list[str]
    need_bytes: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def runs(self) -> bool:
        return not self.reasons


def raw_reasons(raw: RawCall, case: Case, platform: Platform) -> list[str]:
    """Why a raw call cannot run the case on this device (none: it can)."""
    reasons = []
    if platform.name == "gpu":
        if raw.needs_packed_hopper and (platform.compute_capability or 0) < PACKED_MIN_CC:
            reasons.append(f"{raw.fused} needs compute capability >= {PACKED_MIN_CC}, device "
                           f"has {platform.compute_capability}")
    elif raw.emulator:
        if platform.name != "cpu":
            reasons.append(f"runs on gpu (cuDNN) or cpu (emulator), not {platform.name}")
    else:
        reasons.append(f"runs on gpu, not {platform.name}")
    for module in raw.requires:
        if importlib.util.find_spec(module) is None:
            reasons.append(f"optional dependency '{module}' is not installed")
    if case.dtype not in CUDNN_DTYPES:
        reasons.append(f"dtype {case.dtype} not in {'/'.join(CUDNN_DTYPES)}")
    if case.head_dim % 8 or case.head_dim > 256:
        reasons.append(f"head_dim {case.head_dim} not a multiple of 8 up to 256")
    return reasons


def peak_bytes(case: Case, dense: bool, platform: Platform, te_segment_ids: bool = False,
               mask_bias: bool = False) -> int:
    """A program's estimated peak: inputs (q, k, v, cotangent), outputs (out, dq, dk, dv), a
    float32 dq accumulator and softmax statistics; dense kernels add their float32 scores
    (harness.kernels.kernel.scores_bytes, doubled on CPUs); TE's segment-id path may add [B, T, T]
    masks; cuDNN with a mask bias (the fallback) its [B, 1, T, T] boolean mask and bias."""
    itemsize = jnp.dtype(case.dtype).itemsize
    btd = case.batch * case.seq_len * case.head_dim
    need = itemsize * btd * 4 * (case.heads + case.kv_heads)
    need += 4 * btd * case.heads + 8 * case.batch * case.heads * case.seq_len
    if dense:
        need += scores_bytes(case) * (CPU_DENSE_FACTOR if platform.name == "cpu" else 1)
    if te_segment_ids:
        need += TE_MASK_BYTES_PER_PAIR * case.batch * case.seq_len ** 2
    if mask_bias:
        need += (1 + 2 * itemsize) * case.batch * case.seq_len ** 2
    return need


def host_memory_bytes() -> int | None:
    """The host's available memory (/proc/meminfo MemAvailable), else its physical memory."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def memory_budget(platform: Platform) -> int | None:
    """What one program may use: the GPU allocator's limit, or the CPU host's free memory."""
    if platform.name == "cpu":
        return host_memory_bytes()
    return platform.memory_bytes

def _raw_plan(entry: BenchEntry, case: Case, platform: Platform):
    """(via, reasons, dense, notes) of a raw call."""
    raw, notes = entry.raw, []
    via = "emulator" if raw.emulator and platform.name == "cpu" else entry.via
    reasons = raw_reasons(raw, case, platform)
    if raw.gqa_offsets_bug and via == "cudnn" and case.gqa and not reasons:
        bug, note = gqa_offsets_bug()
        if bug:
            notes.append("this jax's packed GQA offsets bug: kv repeated to the query heads, "
                         "as the op does")
        if note:
            notes.append(note)
    return via, reasons, via == "emulator", notes


def _kernel_plan(entry: BenchEntry, case: Case, platform: Platform):
    """(kernel, via, reasons, dense, notes) of a registered kernel (its CPU stand-in on CPUs)."""
    kernel, via = registered(entry.kernel), entry.via
    if platform.name == "cpu" and entry.emulated is not None:
        kernel, via = entry.emulated(), "emulator"
    # The memory rule is this module's (plan), the same for every entry.
    reasons = kernel.unsupported_reasons(case, dataclasses.replace(platform, memory_bytes=None))
    # On cuDNN a mask bias is what grows, not scores (the registry counts it as dense, for its
    # own skip rule).
    dense = kernel.materializes_scores and not (entry.memory == MASK_BIAS and via == "cudnn")
    notes = [] if kernel.backward else ["forward only"]
    return kernel, via, reasons, dense, notes


def plan(entry: BenchEntry, shape: Shape, platform: Platform, budget: int | None) -> Plan:
    case = shape.case
    if entry.raw is not None:
        kernel = None
        via, reasons, dense, notes = _raw_plan(entry, case, platform)
    else:
        kernel, via, reasons, dense, notes = _kernel_plan(entry, case, platform)
    need = peak_bytes(case, dense, platform, te_segment_ids=entry.memory == TE_MASKS,
                      mask_bias=entry.memory == MASK_BIAS and via == "cudnn")
    if not reasons and budget and need > budget:
        reasons.append(f"needs ~{need / GiB:.1f} GiB, more than the {budget / GiB:.1f} GiB this "
                       f"{platform.name} device has")
    return Plan(entry, shape, kernel, via, reasons, need, notes)


def plan_all(shapes, entries, platform: Platform, budget: int | None, set_name: str):
    """Every (shape, entry) plan; a UsageError if memory alone leaves nothing to run."""
    plans = [[plan(e, s, platform, budget) for e in entries] for s in shapes]
    flat = [p for row in plans for p in row]
    if not any(p.runs for p in flat):
        too_big = [p.need_bytes for p in flat if p.reasons and p.reasons[-1].startswith("needs ~")]
        if too_big:
            hint = ": use --shapes small" if set_name != "small" else ""
            raise UsageError(f"--shapes {set_name} needs ~{min(too_big) / GiB:.0f} GiB per "
                             f"program; this {platform.name} device has {budget / GiB:.0f} GiB"
                             f"{hint}")
    return plans
