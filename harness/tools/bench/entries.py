"""The bench's entries: what each row of a shape's table runs, declared by capability. An entry
runs a registered kernel (with a CPU stand-in through the cuDNN emulator, where it has one) or a
raw call built here; it says which goals it takes part in, whether it computes packed attention
correctly, and how its memory grows. Nothing in the bench branches on an entry's name."""
from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

from harness.errors import UsageError
from harness.kernels.kernel import Kernel
from harness.model.case import Case

# What an entry stands for in the goals (BenchEntry.goals).
THE_OP = "the_op"        # the op's packed path: measured against the others in the goals, and
                         # the outputs every entry is compared with (max|Δout| vs op)
OP_PATH = "op_path"      # a path the op can take: "fastest" takes the best of them
RAW_BASE = "raw_base"    # the raw packed call: the base of the ratios (what the op adds)
REPLACED = "replaced"    # the causal-only call the op replaces (the seed shape's goal)
AUTO = "auto"            # the op's auto mode: measured against the faster raw fused call
PATCH_BEFORE = "patch_before"  # MaxText's own op as installed (0.2.5: causal only, wrong)
PATCH_AFTER = "patch_after"    # the same op with patches/maxtext-<version>/ applied
RAW_FUSED = "raw_fused"  # a raw fused call (packed cuDNN, TE THD): the auto mode's yardstick

# How an entry's peak memory grows beside inputs, outputs and gradients (BenchEntry.memory).
AS_DECLARED = "as_declared"  # its kernel's materializes_scores; a raw call: dense when emulated
TE_MASKS = "te_masks"        # TE's segment-id path: may build [B, 1, T, T] masks besides
MASK_BIAS = "mask_bias"      # on cuDNN a [B, 1, T, T] mask and bias, not scores (the registry
                             # counts it dense, for its own skip rule); emulated: as declared


# ----- raw calls ------------------------------------------------------------------------------

def raw_cudnn_packed(query, key, value, seqlen, offsets, *, scale, backend, repeat_kv=False):
    """jax's cuDNN SDPA (or the emulator) on precomputed packed lengths and offsets."""
    from harness.sut.attention_op import cudnn_backend, cudnn_packed

    sdpa, mask_type = cudnn_backend(backend)
    return cudnn_packed(sdpa, mask_type, query, key, value, seqlen, offsets, scale=scale,
                        causal=True, repeat_kv=repeat_kv)


def raw_te_thd_offsets(query, key, value, seqlen, offsets, *, scale, max_segments):
    """TE's THD fused attention on precomputed seqlens [B, M] / offsets [B, M+1] (-1 unused):
    what the op's TE path computes inside its program."""
    from harness.sut.attention_op import te_fused_packed

    assert seqlen.shape[1] == max_segments, (seqlen.shape, max_segments)
    return te_fused_packed(query, key, value, seqlen, offsets, scale=scale, causal=True)


def gqa_offsets_bug() -> tuple[bool, str]:
    """(whether this jax has the packed-GQA offsets bug, a note when that is unknown)."""
    from harness.engine.environment import gqa_offsets_bug as probe
    bug = probe()
    if bug is None:  # the private jax function moved: as the op would, go on
        return False, "GQA offsets probe failed; kv not repeated"
    return bug, ""


def _cudnn_packed_call(case: Case, via: str, max_segments: int):
    repeat = via == "cudnn" and case.gqa and gqa_offsets_bug()[0]
    backend = "emulator" if via == "emulator" else "cudnn"
    return functools.partial(raw_cudnn_packed, scale=case.scale, backend=backend,
                             repeat_kv=repeat)


def _te_offsets_call(case: Case, via: str, max_segments: int):
    return functools.partial(raw_te_thd_offsets, scale=case.scale, max_segments=max_segments)


@dataclass(frozen=True)
class RawCall:
    """A call built here, not a registered kernel: it takes seqlens [B, M] and offsets [B, M+1]
    computed outside the timed program, as arguments."""
    build: Callable[[Case, str, int], Callable]  # (case, via, M) -> fn(q, k, v, seqlen, offsets)
    fused: str                      # its fused kernel, in words (for the reasons it is skipped)
    emulator: bool = False          # on CPUs it runs through the cuDNN emulator
    needs_packed_hopper: bool = True  # on GPUs: compute capability >= sut.config.PACKED_MIN_CC
    requires: tuple[str, ...] = ()  # optional modules it imports
    gqa_offsets_bug: bool = False   # hands GQA to cuDNN's packed layout: this jax's bug applies


CUDNN_PACKED = RawCall(_cudnn_packed_call, "cuDNN's packed layout", emulator=True,
                       gqa_offsets_bug=True)
TE_OFFSETS = RawCall(_te_offsets_call, "TE's THD fused attention",
                     requires=("transformer_engine",))


# ----- entries --------------------------------------------------------------------------------

def registered(name: str) -> Kernel:
    from harness.engine.registry import all_kernels
    return all_kernels()[name]


def _emulated_fallback() -> Kernel:
    from harness.kernels.op import op_kernel
    return dataclasses.replace(
        registered("sut:cudnn_flash_jax:fallback"), name="sut:cudnn_flash_jax:fallback:emulated",
        fn=functools.partial(op_kernel, attention="cudnn_flash_jax", force_fallback=True,
                             cudnn_backend="emulator"),
        devices=("cpu",), min_compute_capability=None, hlo_markers=(), materializes_scores=True)


@dataclass(frozen=True)
class BenchEntry:
    """One row of a shape's table: what it runs and what it stands for."""
    name: str
    role: str       # the report's word for it: op, raw_packed, te, op_te, causal_only, fallback,
                    # dense, kernel (written to the JSON; nothing branches on it)
    via: str        # its fused kernel on a GPU: cudnn, te, xla (the program must show its markers)
    kernel: str | None = None                     # the registered kernel it runs
    emulated: Callable[[], Kernel] | None = None  # its CPU stand-in through the cuDNN emulator
    raw: RawCall | None = None                    # or a call built here
    goals: frozenset[str] = frozenset()           # THE_OP, OP_PATH, RAW_BASE, REPLACED
    correct: bool = True    # computes same-segment attention (may be "the fastest correct")
    memory: str = AS_DECLARED                     # AS_DECLARED, TE_MASKS or MASK_BIAS


ENTRIES = (
    BenchEntry("sut:cudnn_flash_jax", "op", "cudnn", kernel="sut:cudnn_flash_jax",
               emulated=lambda: registered("sut:cudnn_flash_jax:emulated"),
               goals=frozenset({THE_OP, OP_PATH})),
    BenchEntry("raw:cudnn_packed", "raw_packed", "cudnn", raw=CUDNN_PACKED,
               goals=frozenset({RAW_BASE, RAW_FUSED})),
    BenchEntry("te:thd", "te", "te", kernel="te:thd", memory=TE_MASKS),
    BenchEntry("raw:te_thd_offsets", "te", "te", raw=TE_OFFSETS, goals=frozenset({RAW_FUSED})),
    # The op choosing TE THD or packed cuDNN per shape (sut.config.AUTO_TE_*).
    BenchEntry("sut:cudnn_flash_auto", "op_auto", "cudnn|te", kernel="sut:cudnn_flash_auto",
               emulated=lambda: registered("sut:cudnn_flash_jax:emulated"),
               goals=frozenset({AUTO, OP_PATH}), memory=TE_MASKS),
    BenchEntry("sut:cudnn_flash_te", "op_te", "te", kernel="sut:cudnn_flash_te",
               goals=frozenset({OP_PATH}), memory=TE_MASKS),
    # Wrong on packed rows (it attends across segments): timed for the cost of the fix.
    BenchEntry("maxtext_original:cudnn_flash_jax", "causal_only", "cudnn",
               kernel="maxtext_original:cudnn_flash_jax",
               emulated=lambda: registered("maxtext_original:cudnn_flash_jax:emulated"),
               goals=frozenset({REPLACED}), correct=False),
    BenchEntry("sut:cudnn_flash_jax:fallback", "fallback", "cudnn",
               kernel="sut:cudnn_flash_jax:fallback", emulated=_emulated_fallback,
               memory=MASK_BIAS),
    BenchEntry("xla", "dense", "xla", kernel="xla"),
    # MaxText's AttentionOp before and after the patch (installed maxtext; Python >= 3.12).
    BenchEntry("maxtext:cudnn_flash_jax", "maxtext_before", "cudnn",
               kernel="maxtext:cudnn_flash_jax",
               emulated=lambda: registered("maxtext:cudnn_flash_jax:emulated"),
               goals=frozenset({PATCH_BEFORE}), correct=False),
    BenchEntry("maxtext_fixed:cudnn_flash_jax", "maxtext_after", "cudnn",
               kernel="maxtext_fixed:cudnn_flash_jax",
               emulated=lambda: registered("maxtext_fixed:cudnn_flash_jax:emulated"),
               goals=frozenset({PATCH_AFTER})),
)


DEFAULT_ENTRIES_TEXT = ", ".join(e.name for e in ENTRIES)


def entry_with(goal: str, entries=ENTRIES) -> BenchEntry | None:
    """The first of `entries` that stands for `goal` (THE_OP, RAW_BASE, REPLACED, ...)."""
    return next((e for e in entries if goal in e.goals), None)


def select_entries(names) -> list[BenchEntry]:
    """The bench entries, or those named (bench entries or any registered kernel)."""
    if names is None:
        return list(ENTRIES)
    from harness.engine.options import check_names
    from harness.engine.registry import all_kernels
    known = {e.name: e for e in ENTRIES}
    wanted = check_names("--kernels", names if isinstance(names, str) else ",".join(names),
                         "bench entry")
    kernels = all_kernels()
    unknown = [n for n in wanted if n not in known and n not in kernels]
    if unknown:
        raise UsageError(f"unknown bench entr{'ies' if len(unknown) > 1 else 'y'} "
                         f"{', '.join(unknown)}; entries: {', '.join(known)}, or any registered "
                         "kernel (`python -m harness list`)")
    return [known.get(n) or BenchEntry(n, "kernel", "-", kernel=n) for n in wanted]
