"""python -m harness bench: what the attention op's packed path costs beside the calls it is
measured against, forward+backward, per shape, in one process.

Entries (the rows of each shape's table; `--kernels` picks some, or adds any registered kernel):

  sut:cudnn_flash_jax               the op: AttentionOp(attention=cudnn_flash_jax, packing,
                                    max_segments_per_seq = M): segment ids in; lengths and
                                    offsets derived inside the program; packed cuDNN,
                                    PADDING_CAUSAL.
  raw:cudnn_packed                  jax's cuDNN dot_product_attention with q/kv_seqlen [B, M] and
                                    q/kv_offsets [B, M+1] computed once, outside the timed
                                    program, and passed in as arguments; PADDING_CAUSAL, BTNH,
                                    the same M. The op's time over this one is what the op adds.
  te:thd                            Transformer Engine's THD fused attention from segment ids
                                    and positions (harness.sut.attention_op.te_fused_thd): TE
                                    derives seqlens/offsets inside.
  raw:te_thd_offsets                TE's fused_attn with SequenceDescriptor.from_seqlens_and_
                                    offsets on the same precomputed seqlens/offsets: no
                                    conversion inside the program.
  sut:cudnn_flash_te                the op's TE path (attention=cudnn_flash_te), the path the op
                                    can take where TE is the faster one: the op's own lowering
                                    to seqlens/offsets, handed to TE (te_fused_packed).
  maxtext_original:cudnn_flash_jax  the causal-only call the op replaces. Wrong on packed rows
                                    (it attends across segments): timed for the cost of the fix.
  sut:cudnn_flash_jax:fallback      the op's pre-Hopper path (same-segment mask as a cuDNN
                                    bias), forced.
  xla                               jax.nn.dot_product_attention(implementation="xla"), masked.

M is the shape's fullest row's segment count + 1. On a CPU the cuDNN entries run through the
cuDNN emulator (harness.sut.cudnn_emulator) so that a CPU run (`--shapes small`) takes every code
path; on a GPU they run real cuDNN. The TE entries need a GPU of compute capability >= 9.0 and
Transformer Engine. Entries a device cannot run are listed as skipped, with the reason.

Timing: jax.vjp of each entry (output and dq, dk, dv), compiled ahead (compilation excluded),
every argument on the device before the clock starts, two warm-up calls, then --repeats rounds
in which every entry takes one sample, in an order shuffled anew each round (interleaved, so
clock or thermal drift hits all alike; shuffled, so that no entry always follows the same one:
in a fixed order the op, always right after XLA's 16 ms dense call, measured 3.0% and 5.4% over
the raw call on the H200 where scripts/op_overhead.py, timing each program on its own, measured
2.5% and 1.7%). A sample is one call on CPUs; on GPUs it is one untimed call, then K
back-to-back calls (K sized from the warm-up so a sample lasts about 50 ms, at most 20 calls)
divided by K, so that the per-call sync and launch cost, the same for every entry, does not
pull the ratios towards 1, and a state the previous entry left behind fades within the sample
(at 20 ms a 6 ms call took 2 or 3 calls a sample, and its samples fell into two modes 8% apart
on the H200). Reported:
median, min and spread ((max - min) / median) of the samples per entry; ratios against
raw:cudnn_packed where it ran (else the first entry that ran), and the op against causal-only.

Useful TFLOP/s count same-segment causal work only: a segment of L tokens costs a forward of
4 * L(L+1)/2 * head_dim * heads FLOPs (two matmuls over the causal triangle), and the backward is
counted as 2.5 times the forward (FlashAttention's convention: five matmuls to the forward's
two), whatever the entry actually computes: a call that attends across segments or over padding
gets no credit for it.

Memory: before any work, each entry's peak is estimated (dense kernels: harness.engine.kernel.
scores_bytes, doubled on CPUs, where XLA keeps more float32 [B, H, T, T] temporaries alive: a
hopper run on a CPU was killed at 24 GB where scores_bytes says 16 GiB; fused kernels: inputs,
outputs, gradients, a float32 dq accumulator and softmax statistics) against the device's limit
(GPU: its allocator's limit; CPU: the host's available memory). Entries that do not fit are
skipped with the numbers; a shape set of which nothing fits is refused with one line.

Nothing here asserts a speed: the goals are printed as statements with their numbers.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import os
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from harness.model.case import Case, make_inputs
from harness.errors import UsageError
from harness.engine.kernel import Kernel, Platform, scores_bytes
from harness.kernels.op import CUDNN as CUDNN_DTYPES
from harness.kernels.op import CUDNN_MARKER as CUDNN_MARKERS
from harness.kernels.te import TE_MARKERS
from harness.model.layouts import CUSTOM
from harness.judge.oracle import with_gradients

GiB = 2 ** 30
PACKED_MIN_CC = 9.0                 # cuDNN's packed layout and TE's THD fused attention
CPU_DENSE_FACTOR = 2                # XLA:CPU's dense peak over scores_bytes (see the docstring)
TE_MASK_BYTES_PER_PAIR = 10         # TE's segment-id path may build [B, 1, T, T] masks (bool/int32)

# Goals (reported, never asserted).
SAMPLE_S = 0.05                     # a GPU sample's length: back-to-back calls (see time_shape)
MAX_CALLS_PER_SAMPLE = 20
GOAL_OP_OVER_RAW = 0.03             # the op within 3% of the raw packed call
GOAL_OP_OVER_CAUSAL = 0.67          # the op at most 0.67x the causal-only call, at the seed shape
GOAL_OP_OVER_FASTEST = 0.05         # the op's best path within 5% of the fastest correct entry
SEED_SHAPE = "seed"


# ----- shapes ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Shape:
    name: str
    case: Case                      # layout custom/rows: exact segment lengths per row
    layout: str                     # how its segments were drawn, in words

    @functools.cached_property
    def lengths(self) -> tuple[int, ...]:
        return tuple(s.length for s in self.case.segments)

    @functools.cached_property
    def max_segments(self) -> int:
        """M: the fullest row's segments + 1 (so some rows have fewer than M, as in training)."""
        return max(s.number for s in self.case.segments) + 1

    @property
    def label(self) -> str:
        c = self.case
        return (f"{self.name}: {c.batch}x{c.seq_len}, {c.heads}/{c.kv_heads} heads, head_dim "
                f"{c.head_dim}, {c.dtype}; {self.layout} ({len(self.lengths)} segments in "
                f"all, M={self.max_segments})")


def _equalish(rng: np.random.Generator, total: int, parts: int) -> list[int]:
    """`parts` lengths summing to `total`, each cut within a tenth of a part of an even split."""
    base = total / parts
    jitter = int(base / 10)
    cuts = [round(i * base) + int(rng.integers(-jitter, jitter + 1)) for i in range(1, parts)]
    return np.diff([0, *cuts, total]).astype(int).tolist()


def _short(rng: np.random.Generator, total: int, lo: int, hi: int) -> list[int]:
    """Segments of lo..hi tokens while at least lo tokens are left; the rest is padding."""
    runs, left = [], total
    while left >= lo:
        n = min(int(rng.integers(lo, hi + 1)), left)
        runs.append(n)
        left -= n
    return runs


def _shape(name, layout, batch, seq_len, heads, kv_heads, head_dim, row) -> Shape:
    rng = np.random.default_rng([20240611, seq_len, batch])  # fixed: the same rows every run
    rows = tuple(tuple(row(rng, seq_len)) for _ in range(batch))
    return Shape(name, Case(CUSTOM, batch, seq_len, heads, kv_heads, head_dim, "bfloat16", 0,
                            rows=rows), layout)


def _hopper() -> list[Shape]:
    return [
        _shape(SEED_SHAPE, "4 equal-ish segments per row", 8, 2048, 32, 8, 128,
               lambda rng, t: _equalish(rng, t, 4)),
        _shape("long-8k", "8 equal-ish segments", 1, 8192, 32, 8, 128,
               lambda rng, t: _equalish(rng, t, 8)),
        _shape("long-32k", "16 equal-ish segments", 1, 32768, 32, 8, 128,
               lambda rng, t: _equalish(rng, t, 16)),
        _shape("short", "segments of 64-256 tokens, then < 64 padding", 8, 4096, 32, 8, 128,
               lambda rng, t: _short(rng, t, 64, 256)),
    ]


def _small() -> list[Shape]:
    # Two shapes (compilation dominates a CPU run): the seed shape in miniature, and one long
    # row of many short segments.
    return [
        _shape(SEED_SHAPE, "4 equal-ish segments per row", 2, 256, 4, 2, 64,
               lambda rng, t: _equalish(rng, t, 4)),
        _shape("short", "segments of 16-64 tokens, then < 16 padding", 1, 512, 4, 2, 64,
               lambda rng, t: _short(rng, t, 16, 64)),
    ]


SHAPE_SETS: dict[str, Callable[[], list[Shape]]] = {"small": _small, "hopper": _hopper}


def shape_set(name: str) -> list[Shape]:
    if name not in SHAPE_SETS:
        raise UsageError(f"unknown shape set {name!r} for --shapes; known: "
                         f"{', '.join(SHAPE_SETS)} (small: any device; hopper: GPU shapes)")
    return SHAPE_SETS[name]()


def useful_flops(lengths, heads: int, head_dim: int) -> tuple[int, int]:
    """(forward, forward+backward) FLOPs of same-segment causal attention over segments of the
    given lengths: forward 4 * L(L+1)/2 * head_dim * heads per segment, backward 2.5x that."""
    forward = sum(4 * (n * (n + 1) // 2) * head_dim * heads for n in lengths)
    return forward, forward * 7 // 2


def packed_lengths_offsets(segment_ids, max_segments: int) -> tuple[np.ndarray, np.ndarray]:
    """cuDNN's packed layout from segment ids, in numpy (outside any program): seqlen [B, M]
    and offsets [B, M+1], int32, -1 where a row has fewer segments. Each positive run of a row
    is a segment (rows are contiguous runs 1..n; harness.model.layouts.check_segment_ids)."""
    seg = np.asarray(segment_ids)
    b, t = seg.shape
    seqlen = np.full((b, max_segments), -1, np.int32)
    offsets = np.full((b, max_segments + 1), -1, np.int32)
    for r, row in enumerate(seg):
        edges = np.flatnonzero(np.diff(row)) + 1
        starts, stops = np.concatenate([[0], edges]), np.concatenate([edges, [t]])
        keep = row[starts] > 0
        starts, stops = starts[keep], stops[keep]
        if starts.size > max_segments:
            raise ValueError(f"row {r} has {starts.size} segments, more than {max_segments}")
        seqlen[r, :starts.size] = stops - starts
        offsets[r, :starts.size] = starts
    return seqlen, offsets


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


def _gqa_offsets_bug() -> tuple[bool, str]:
    from harness.engine.environment import gqa_offsets_bug
    bug = gqa_offsets_bug()
    if bug is None:  # the private jax function moved: as the op would, go on
        return False, "GQA offsets probe failed; kv not repeated"
    return bug, ""


# ----- entries --------------------------------------------------------------------------------

def _registered(name: str) -> Kernel:
    from harness.engine.registry import all_kernels
    return all_kernels()[name]


def _emulated_fallback() -> Kernel:
    from harness.kernels.op import _op
    return dataclasses.replace(
        _registered("sut:cudnn_flash_jax:fallback"), name="sut:cudnn_flash_jax:fallback:emulated",
        fn=_op(attention="cudnn_flash_jax", force_fallback=True, cudnn_backend="emulator"),
        devices=("cpu",), min_compute_capability=None, hlo_markers=(), materializes_scores=True)


@dataclass(frozen=True)
class Entry:
    name: str
    role: str       # op, raw_packed, te, op_te, causal_only, fallback, dense, kernel
    via: str        # on a GPU: cudnn, te, xla
    kernel: str | None = None                   # the registered kernel it runs
    emulated: Callable[[], Kernel] | None = None  # its CPU stand-in through the cuDNN emulator
    raw: str | None = None                      # cudnn_packed | te_offsets: a call built here


ENTRIES = (
    Entry("sut:cudnn_flash_jax", "op", "cudnn", kernel="sut:cudnn_flash_jax",
          emulated=lambda: _registered("sut:cudnn_flash_jax:emulated")),
    Entry("raw:cudnn_packed", "raw_packed", "cudnn", raw="cudnn_packed"),
    Entry("te:thd", "te", "te", kernel="te:thd"),
    Entry("raw:te_thd_offsets", "te", "te", raw="te_offsets"),
    Entry("sut:cudnn_flash_te", "op_te", "te", kernel="sut:cudnn_flash_te"),
    Entry("maxtext_original:cudnn_flash_jax", "causal_only", "cudnn",
          kernel="maxtext_original:cudnn_flash_jax",
          emulated=lambda: _registered("maxtext_original:cudnn_flash_jax:emulated")),
    Entry("sut:cudnn_flash_jax:fallback", "fallback", "cudnn",
          kernel="sut:cudnn_flash_jax:fallback", emulated=_emulated_fallback),
    Entry("xla", "dense", "xla", kernel="xla"),
)
OP, RAW_PACKED, CAUSAL_ONLY = "sut:cudnn_flash_jax", "raw:cudnn_packed", \
    "maxtext_original:cudnn_flash_jax"
OP_PATHS = ("op", "op_te")


def select_entries(names) -> list[Entry]:
    """The bench entries, or those named (bench entries or any registered kernel)."""
    if not names:
        return list(ENTRIES)
    from harness.engine.registry import all_kernels
    known = {e.name: e for e in ENTRIES}
    wanted = [n.strip() for n in (names.split(",") if isinstance(names, str) else names)
              if n.strip()]
    kernels = all_kernels()
    unknown = [n for n in wanted if n not in known and n not in kernels]
    if unknown:
        raise UsageError(f"unknown bench entr{'ies' if len(unknown) > 1 else 'y'} "
                         f"{', '.join(unknown)}; entries: {', '.join(known)}, or any registered "
                         "kernel (`python -m harness list`)")
    return [known.get(n) or Entry(n, "kernel", "-", kernel=n) for n in wanted]


@dataclass
class Plan:
    """One entry at one shape on this device: what runs, or why not."""
    entry: Entry
    shape: Shape
    kernel: Kernel | None
    via: str
    reasons: list[str]
    need_bytes: int = 0
    notes: list[str] = field(default_factory=list)

    @property
    def runs(self) -> bool:
        return not self.reasons


def _raw_reasons(entry: Entry, case: Case, platform: Platform) -> list[str]:
    reasons = []
    if entry.raw == "cudnn_packed":
        if platform.name == "gpu":
            if (platform.compute_capability or 0) < PACKED_MIN_CC:
                reasons.append(f"cuDNN's packed layout needs compute capability >= "
                               f"{PACKED_MIN_CC}, device has {platform.compute_capability}")
        elif platform.name != "cpu":
            reasons.append(f"runs on gpu (cuDNN) or cpu (emulator), not {platform.name}")
    else:
        if platform.name != "gpu":
            reasons.append(f"runs on gpu, not {platform.name}")
        elif (platform.compute_capability or 0) < PACKED_MIN_CC:
            reasons.append(f"TE's THD fused attention needs compute capability >= "
                           f"{PACKED_MIN_CC}, device has {platform.compute_capability}")
        if importlib.util.find_spec("transformer_engine") is None:
            reasons.append("optional dependency 'transformer_engine' is not installed")
    if case.dtype not in CUDNN_DTYPES:
        reasons.append(f"dtype {case.dtype} not in {'/'.join(CUDNN_DTYPES)}")
    if case.head_dim % 8 or case.head_dim > 256:
        reasons.append(f"head_dim {case.head_dim} not a multiple of 8 up to 256")
    return reasons


def peak_bytes(case: Case, dense: bool, platform: Platform, te_segment_ids: bool = False,
               mask_bias: bool = False) -> int:
    """A program's estimated peak: inputs (q, k, v, cotangent), outputs (out, dq, dk, dv), a
    float32 dq accumulator and softmax statistics; dense kernels add their float32 scores
    (harness.engine.kernel.scores_bytes, doubled on CPUs); TE's segment-id path may add [B, T, T]
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


def plan(entry: Entry, shape: Shape, platform: Platform, budget: int | None) -> Plan:
    case = shape.case
    notes = []
    if entry.raw:
        kernel = None
        via = "emulator" if entry.raw == "cudnn_packed" and platform.name == "cpu" else entry.via
        reasons = _raw_reasons(entry, case, platform)
        dense = via == "emulator"
        if entry.raw == "cudnn_packed" and via == "cudnn" and case.gqa and not reasons:
            bug, note = _gqa_offsets_bug()
            if bug:
                notes.append("this jax's packed GQA offsets bug: kv repeated to the query heads, "
                             "as the op does")
            if note:
                notes.append(note)
    else:
        kernel = _registered(entry.kernel)
        via = entry.via
        if platform.name == "cpu" and entry.emulated is not None:
            kernel, via = entry.emulated(), "emulator"
        # The memory rule is this module's (below), the same for every entry.
        reasons = kernel.unsupported_reasons(case, dataclasses.replace(platform, memory_bytes=None))
        # The fallback on cuDNN is fused: its [B, 1, T, T] bias is what grows, not scores
        # (the registry counts it as dense, for its own skip rule).
        dense = kernel.materializes_scores and not (entry.role == "fallback" and via == "cudnn")
        if not kernel.backward:
            notes.append("forward only")
    need = peak_bytes(case, dense, platform,
                      te_segment_ids=entry.kernel in ("te:thd", "sut:cudnn_flash_te"),
                      mask_bias=entry.role == "fallback" and via == "cudnn")
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


# ----- running --------------------------------------------------------------------------------

def _entry_fn(p: Plan):
    """(fn(q, k, v, *aux), names of aux arguments) for a plan."""
    case, m = p.shape.case, p.shape.max_segments
    if p.entry.raw == "cudnn_packed":
        repeat = p.via == "cudnn" and case.gqa and _gqa_offsets_bug()[0]
        backend = "emulator" if p.via == "emulator" else "cudnn"
        return functools.partial(raw_cudnn_packed, scale=case.scale, backend=backend,
                                 repeat_kv=repeat), ("seqlen", "offsets")
    if p.entry.raw == "te_offsets":
        return functools.partial(raw_te_thd_offsets, scale=case.scale,
                                 max_segments=m), ("seqlen", "offsets")
    kernel = p.kernel
    extra = {"max_segments": m} if kernel.takes_max_segments else {}

    def fn(q, k, v, seg):
        return kernel.fn(q, k, v, seg, causal=case.causal, scale=case.scale, **extra)
    return fn, ("segment_ids",)


@dataclass
class Run:
    plan: Plan
    args: tuple = ()
    compiled: object = None
    times: list[float] = field(default_factory=list)   # seconds per call, one per sample
    calls: int = 1                                      # back-to-back calls per sample
    error: str | None = None
    diff: float | None = None


def _markers(p: Plan) -> tuple[str, ...]:
    if p.via == "cudnn":
        return CUDNN_MARKERS
    if p.via == "te":
        return TE_MARKERS
    return ()


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


def _calls_per_sample(seconds: float, platform: str) -> int:
    """On GPUs a sample is several back-to-back calls (dispatch pipelines behind the device),
    about SAMPLE_S long, so that a per-call sync and launch cost, the same for every entry,
    does not pull the ratios towards 1. CPUs execute synchronously: one call."""
    if platform == "cpu" or seconds <= 0:
        return 1
    return max(1, min(MAX_CALLS_PER_SAMPLE, int(SAMPLE_S / seconds)))


def time_shape(shape: Shape, plans: list[Plan], repeats: int) -> list[Run]:
    """Compiles the shape's runnable entries, warms each up, then times `repeats` rounds,
    each entry once per round."""
    case = shape.case
    x = make_inputs(case)
    seqlen, offsets = packed_lengths_offsets(case.segment_ids, shape.max_segments)
    on_device = {k: jax.device_put(a) for k, a in [
        ("q", x.query), ("k", x.key), ("v", x.value), ("ct", x.cotangent),
        ("segment_ids", x.segment_ids), ("seqlen", seqlen), ("offsets", offsets)]}
    jax.block_until_ready(list(on_device.values()))
    runs = [Run(p) for p in plans if p.runs]
    lowered = {}
    for r in runs:
        try:
            fn, aux = _entry_fn(r.plan)
            r.args = tuple(on_device[k] for k in ("q", "k", "v", *aux, "ct"))
            backward = r.plan.kernel.backward if r.plan.kernel is not None else True
            lowered[id(r)] = jax.jit(with_gradients(fn, backward)).lower(*r.args)
        except Exception as exc:  # report and go on: a benchmark is not a verdict
            r.error = _error(exc)
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        futures = {id(r): pool.submit(lowered[id(r)].compile) for r in runs if id(r) in lowered}
        for r in runs:
            if id(r) in futures:
                try:
                    r.compiled = futures[id(r)].result()
                except Exception as exc:
                    r.error = _error(exc)
    for r in runs:
        markers = _markers(r.plan)
        if r.compiled is not None and markers:
            text = lowered[id(r)].as_text()
            if any(m not in text for m in markers):
                text += r.compiled.as_text() or ""
            missing = [m for m in markers if m not in text]
            if missing:
                r.plan.notes.append(f"no {', '.join(missing)} in the program: not the fused "
                                    "kernel")
    valid = on_device["segment_ids"][:, :, None, None] > 0
    reference = None
    platform = jax.devices()[0].platform
    for r in runs:  # warm-up (twice; the second sizes a sample); outputs compared with the op's
        if r.compiled is None:
            continue
        try:
            jax.block_until_ready(r.compiled(*r.args))
            start = time.perf_counter()
            out = r.compiled(*r.args)
            jax.block_until_ready(out)
            r.calls = _calls_per_sample(time.perf_counter() - start, platform)
        except Exception as exc:
            r.error, r.compiled = _error(exc), None
            continue
        if r.plan.entry.name == OP:
            reference = out[0]
        if reference is not None:
            delta = jnp.abs(out[0].astype(jnp.float32) - reference.astype(jnp.float32))
            r.diff = float(jnp.max(jnp.where(valid, delta, 0.0)))
        del out
    order = np.random.default_rng(0)
    for _ in range(repeats):
        for i in order.permutation(len(runs)):  # no entry always follows the same one
            r = runs[i]
            if r.compiled is None:
                continue
            try:
                if platform != "cpu":  # an untimed call first: the sample starts in stride
                    jax.block_until_ready(r.compiled(*r.args))
                start = time.perf_counter()
                for _ in range(r.calls):
                    out = r.compiled(*r.args)  # the last one done: all done (one stream)
                jax.block_until_ready(out)
                r.times.append((time.perf_counter() - start) / r.calls)
                del out
            except Exception as exc:
                r.error, r.compiled = _error(exc), None
    return runs


# ----- results --------------------------------------------------------------------------------

def shape_result(shape: Shape, plans: list[Plan], runs: list[Run]) -> dict:
    case = shape.case
    forward, total = useful_flops(shape.lengths, case.heads, case.head_dim)
    by_plan = {id(r.plan): r for r in runs}
    entries = []
    for p in plans:
        r = by_plan.get(id(p))
        row = {"entry": p.entry.name, "kernel": p.kernel.name if p.kernel else p.entry.name,
               "role": p.entry.role, "via": p.via,
               "estimated_peak_gib": round(p.need_bytes / GiB, 3),
               "skipped": "; ".join(p.reasons) or None, "error": None, "median_ms": None,
               "min_ms": None, "max_ms": None, "spread": None, "times_ms": [],
               "ratio": None, "ratio_base": None, "ratio_to_raw_packed": None,
               "useful_tflops": None, "calls_per_sample": None, "max_abs_diff_vs_op": None,
               "notes": p.notes}
        if r is not None:
            row["error"] = r.error
            row["max_abs_diff_vs_op"] = r.diff
            row["calls_per_sample"] = r.calls
            if r.times and r.error is None:
                med = statistics.median(r.times)
                row.update(median_ms=med * 1e3, min_ms=min(r.times) * 1e3,
                           max_ms=max(r.times) * 1e3,
                           spread=(max(r.times) - min(r.times)) / med,
                           times_ms=[t * 1e3 for t in r.times],
                           useful_tflops=total / med / 1e12)
        entries.append(row)
    timed = [e for e in entries if e["median_ms"] is not None]
    base = next((e for e in timed if e["entry"] == RAW_PACKED), timed[0] if timed else None)
    for e in timed:
        e["ratio"] = e["median_ms"] / base["median_ms"]
        e["ratio_base"] = base["entry"]
        if base["entry"] == RAW_PACKED:
            e["ratio_to_raw_packed"] = e["ratio"]
    named = {e["entry"]: e for e in timed}
    op_vs_causal = (named[OP]["median_ms"] / named[CAUSAL_ONLY]["median_ms"]
                    if OP in named and CAUSAL_ONLY in named else None)
    return {"shape": shape.name, "label": shape.label, "case_id": case.id,
            "batch": case.batch, "seq_len": case.seq_len, "heads": case.heads,
            "kv_heads": case.kv_heads, "head_dim": case.head_dim, "dtype": case.dtype,
            "segments": len(shape.lengths), "max_segments": shape.max_segments,
            "segment_lengths": list(shape.lengths),
            "useful_flops_forward": forward, "useful_flops": total,
            "ratio_base": base["entry"] if base else None,
            "op_vs_causal_only": op_vs_causal, "entries": entries}


def goal_checks(results: list[dict]) -> list[dict]:
    """The issue's goals as statements with numbers (never asserted)."""
    checks = []

    def add(goal, shape, value, limit, met, text):
        checks.append({"goal": goal, "shape": shape, "value": value, "limit": limit,
                       "met": met, "text": text})

    def why(entry):
        return entry["skipped"] or entry["error"] or "not timed" if entry else "not selected"

    for res in results:
        shape = res["shape"]
        entries = {e["entry"]: e for e in res["entries"]}
        op, raw = entries.get(OP), entries.get(RAW_PACKED)
        if op and raw and op["median_ms"] and raw["median_ms"]:
            d = op["median_ms"] / raw["median_ms"] - 1
            met = d <= GOAL_OP_OVER_RAW
            add("op_vs_raw_packed", shape, d, GOAL_OP_OVER_RAW, met,
                f"op vs raw packed at {shape}: {d:+.1%} ({op['median_ms']:.3f} vs "
                f"{raw['median_ms']:.3f} ms; goal <= +{GOAL_OP_OVER_RAW:.0%}: "
                f"{'met' if met else 'not met'})")
        else:
            missing = OP if not (op and op["median_ms"]) else RAW_PACKED
            add("op_vs_raw_packed", shape, None, GOAL_OP_OVER_RAW, None,
                f"op vs raw packed at {shape}: not measured ({missing}: "
                f"{why(entries.get(missing))})")
        if shape == SEED_SHAPE:
            r = res["op_vs_causal_only"]
            if r is not None:
                met = r <= GOAL_OP_OVER_CAUSAL
                add("op_vs_causal_only", shape, r, GOAL_OP_OVER_CAUSAL, met,
                    f"op vs causal-only at the seed shape: {r:.2f}x ({op['median_ms']:.3f} vs "
                    f"{entries[CAUSAL_ONLY]['median_ms']:.3f} ms; goal <= "
                    f"{GOAL_OP_OVER_CAUSAL:.2f}x: {'met' if met else 'not met'})")
            else:
                missing = OP if not (op and op["median_ms"]) else CAUSAL_ONLY
                add("op_vs_causal_only", shape, None, GOAL_OP_OVER_CAUSAL, None,
                    f"op vs causal-only at the seed shape: not measured ({missing}: "
                    f"{why(entries.get(missing))})")
        correct = [e for e in res["entries"] if e["median_ms"] and e["role"] != "causal_only"]
        ops = [e for e in correct if e["role"] in OP_PATHS]
        if not correct or not ops:
            add("op_vs_fastest", shape, None, GOAL_OP_OVER_FASTEST, None,
                f"fastest at {shape}: not measured (no op path timed)")
            continue
        fastest = min(correct, key=lambda e: e["median_ms"])
        best = min(ops, key=lambda e: e["median_ms"])
        d = best["median_ms"] / fastest["median_ms"] - 1
        met = d <= GOAL_OP_OVER_FASTEST
        if fastest is best:
            text = (f"fastest at {shape}: {fastest['entry']} {fastest['median_ms']:.3f} ms, an "
                    f"op path (goal within {GOAL_OP_OVER_FASTEST:.0%}: met)")
        else:
            text = (f"fastest at {shape}: {fastest['entry']} {fastest['median_ms']:.3f} ms; op "
                    f"{best['median_ms']:.3f} ms via {best['entry']} ({d:+.1%}, goal within "
                    f"{GOAL_OP_OVER_FASTEST:.0%}: {'met' if met else 'not met'})")
        add("op_vs_fastest", shape, d, GOAL_OP_OVER_FASTEST, met, text)
    return checks


def _si(n: float) -> str:
    for factor, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if n >= factor:
            return f"{n / factor:.3g} {prefix}"
    return f"{n:.3g} "


def _fmt(value, spec: str, width: int) -> str:
    return f"{value:{width}{spec}}" if value is not None else " " * (width - 1) + "-"


def print_shape(res: dict, repeats: int, out=None) -> None:
    out = out or sys.stdout
    print(res["label"], file=out)
    print(f"  forward+backward, median of {repeats} samples; useful work {_si(res['useful_flops'])}FLOP "
          "per call; "
          f"ratios against {res['ratio_base'] or '-'}", file=out)
    print(f"  {'entry':34s} {'via':8s} {'median ms':>10s} {'min ms':>10s} {'spread':>7s} "
          f"{'ratio':>7s} {'TFLOP/s':>8s} {'max|Δout| vs op':>16s}", file=out)
    for e in res["entries"]:
        head = f"  {e['entry']:34s} {e['via']:8s}"
        if e["skipped"]:
            print(f"{head} skip: {e['skipped']}", file=out)
        elif e["error"]:
            print(f"{head} error: {e['error']}", file=out)
        elif e["median_ms"] is None:
            print(f"{head} not timed", file=out)
        else:
            notes = e["notes"] + ([f"{e['calls_per_sample']} calls/sample"]
                                  if (e["calls_per_sample"] or 1) > 1 else [])
            notes = f"  ({'; '.join(notes)})" if notes else ""
            print(f"{head} {e['median_ms']:10.3f} {e['min_ms']:10.3f} {e['spread']:7.1%} "
                  f"{e['ratio']:6.2f}x {_fmt(e['useful_tflops'], '.3g', 8)} "
                  f"{_fmt(e['max_abs_diff_vs_op'], '.3g', 16)}{notes}", file=out)
    if res["op_vs_causal_only"] is not None:
        print(f"  op vs causal-only: {res['op_vs_causal_only']:.2f}x", file=out)
    out.flush()


def main(args) -> int:
    from harness.engine.environment import current_platform, describe

    if args.repeats < 1:
        raise UsageError(f"--repeats {args.repeats}: must be at least 1")
    shapes = shape_set(args.shapes)
    entries = select_entries(args.kernels)
    platform = current_platform()
    budget = memory_budget(platform)
    plans = plan_all(shapes, entries, platform, budget, args.shapes)  # refuses before any work
    if platform.name == "cpu":
        print("cpu: the cuDNN entries run through the cuDNN emulator (dense, plain JAX); their "
              "times say nothing about cuDNN's")
    print("useful TFLOP/s: same-segment causal work only (forward 4*L(L+1)/2*head_dim*heads per "
          "segment of L tokens, backward 2.5x the forward)\n")
    results = []
    for shape, shape_plans in zip(shapes, plans):
        runs = time_shape(shape, shape_plans, args.repeats) if any(p.runs for p in shape_plans) \
            else []
        results.append(shape_result(shape, shape_plans, runs))
        print_shape(results[-1], args.repeats)
        del runs
    checks = goal_checks(results)
    print("\ngoals" + (" (measured on the cpu through the emulator: the goals are for the GPU)"
                       if platform.name == "cpu" else "") + ":")
    for c in checks:
        print(f"  {c['text']}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"environment": describe(), "shapes": args.shapes, "repeats": args.repeats,
                       "method": {"timing": "jax.vjp forward+backward, compiled ahead, arguments "
                                            "on device, two warm-ups, repeats interleaved across "
                                            "entries in an order shuffled each round, a sample "
                                            "= one untimed call, then calls_per_sample "
                                            "back-to-back calls / calls_per_sample (1 call, "
                                            "none untimed, on CPUs); spread = "
                                            "(max - min) / median",
                                  "useful_flops": "same-segment causal only: forward "
                                                  "4*L(L+1)/2*head_dim*heads per segment, "
                                                  "backward 2.5x forward"},
                       "results": results, "goals": checks}, f, indent=1)
    return 0
