"""Timing a shape's entries: jax.vjp of each (output and dq, dk, dv), compiled ahead, every
argument on the device before the clock starts, two warm-up calls, then rounds in which every
entry takes one sample, in an order shuffled anew each round (see the package's docstring)."""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from harness.judge.oracle import with_gradients
from harness.kernels.op import CUDNN_MARKER as CUDNN_MARKERS
from harness.kernels.te import TE_MARKERS
from harness.model.case import make_inputs
from harness.tools.bench.entries import THE_OP
from harness.tools.bench.plans import Plan
from harness.tools.bench.shapes import Shape, packed_lengths_offsets

SAMPLE_S = 0.05                     # a GPU sample's length: back-to-back calls (see time_shape)
MAX_CALLS_PER_SAMPLE = 20


def entry_fn(p: Plan):
    """(fn(q, k, v, *aux), names of aux arguments) for a plan."""
    case, m = p.shape.case, p.shape.max_segments
    if p.entry.raw is not None:
        return p.entry.raw.build(case, p.via, m), ("seqlen", "offsets")
    kernel = p.kernel
    extra = {"max_segments": m} if kernel.takes_max_segments else {}

    def fn(q, k, v, seg):
        return kernel.fn(q, k, v, seg, causal=case.causal, scale=case.scale, **extra)
    return fn, ("segment_ids",)


@dataclass
class Timing:
    """One plan's program and samples."""
    plan: Plan
    args: tuple = ()
    compiled: object = None
    times: list[float] = field(default_factory=list)   # seconds per call, one per sample
    calls: int = 1                                      # back-to-back calls per sample
    error: str | None = None
    diff: float | None = None
    memory: dict | None = None                          # xla_memory of the compiled program


def xla_memory(compiled) -> dict | None:
    """XLA's memory analysis of a compiled program, in bytes: temp (its buffers and the fused
    kernels' workspaces), arguments, outputs, alias (outputs sharing an argument's buffer) and
    total = temp + arguments + outputs, the program's footprint as compiled; None where the
    backend gives no analysis."""
    try:
        stats = compiled.memory_analysis()
        parts = {"temp": int(stats.temp_size_in_bytes),
                 "arguments": int(stats.argument_size_in_bytes),
                 "outputs": int(stats.output_size_in_bytes),
                 "alias": int(stats.alias_size_in_bytes)}
    except Exception:  # a backend without the analysis
        return None
    return {**parts, "total": parts["temp"] + parts["arguments"] + parts["outputs"]}


def _markers(p: Plan) -> tuple[str, ...]:
    """The custom calls its program must show: a registered kernel's own (an entry "a|b" is
    either), a raw call's by the fused kernel it calls."""
    if p.kernel is not None and p.via != "emulator":
        return p.kernel.hlo_markers
    if p.via == "cudnn":
        return CUDNN_MARKERS
    if p.via == "te":
        return TE_MARKERS
    return ()


def _error(exc: Exception) -> str:
    return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"


def calls_per_sample(seconds: float, platform: str) -> int:
    """On GPUs a sample is several back-to-back calls (dispatch pipelines behind the device),
    about SAMPLE_S long, so that a per-call sync and launch cost, the same for every entry,
    does not pull the ratios towards 1. CPUs execute synchronously: one call."""
    if platform == "cpu" or seconds <= 0:
        return 1
    return max(1, min(MAX_CALLS_PER_SAMPLE, int(SAMPLE_S / seconds)))


def _on_device(shape: Shape) -> dict:
    """The shape's inputs, cotangent, segment ids and packed layout, on the device."""
    case = shape.case
    x = make_inputs(case)
    seqlen, offsets = packed_lengths_offsets(case.segment_ids, shape.max_segments)
    on_device = {k: jax.device_put(a) for k, a in [
        ("q", x.query), ("k", x.key), ("v", x.value), ("ct", x.cotangent),
        ("segment_ids", x.segment_ids), ("seqlen", seqlen), ("offsets", offsets)]}
    jax.block_until_ready(list(on_device.values()))
    return on_device


def _compile(timings: list[Timing], on_device: dict) -> dict:
    """Lowers each entry's program (errors noted), then compiles them side by side; the
    lowered programs by id of their timing."""
    lowered = {}
    for t in timings:
        try:
            fn, aux = entry_fn(t.plan)
            t.args = tuple(on_device[k] for k in ("q", "k", "v", *aux, "ct"))
            backward = t.plan.kernel.backward if t.plan.kernel is not None else True
            lowered[id(t)] = jax.jit(with_gradients(fn, backward)).lower(*t.args)
        except Exception as exc:  # report and go on: a benchmark is not a verdict
            t.error = _error(exc)
    with ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1))) as pool:
        futures = {id(t): pool.submit(lowered[id(t)].compile) for t in timings
                   if id(t) in lowered}
        for t in timings:
            if id(t) in futures:
                try:
                    t.compiled = futures[id(t)].result()
                    t.memory = xla_memory(t.compiled)
                except Exception as exc:
                    t.error = _error(exc)
    return lowered


def _check_markers(timings: list[Timing], lowered: dict) -> None:
    """A note on each program without its fused kernel's markers (not the fused kernel)."""
    for t in timings:
        markers = _markers(t.plan)
        if t.compiled is not None and markers:
            text = lowered[id(t)].as_text()

            def absent(marker, text_=None):
                return not any(m in (text_ or text) for m in marker.split("|"))
            if any(absent(m) for m in markers):
                text += t.compiled.as_text() or ""
            missing = [m for m in markers if absent(m)]
            if missing:
                t.plan.notes.append(f"no {', '.join(missing)} in the program: not the fused "
                                    "kernel")


def _warm_up(timings: list[Timing], valid, platform: str) -> None:
    """Two calls each (the second sizes a sample); outputs compared with the op's."""
    reference = None
    for t in timings:
        if t.compiled is None:
            continue
        try:
            jax.block_until_ready(t.compiled(*t.args))
            start = time.perf_counter()
            out = t.compiled(*t.args)
            jax.block_until_ready(out)
            t.calls = calls_per_sample(time.perf_counter() - start, platform)
        except Exception as exc:
            t.error, t.compiled = _error(exc), None
            continue
        if THE_OP in t.plan.entry.goals:
            reference = out[0]
        if reference is not None:
            delta = jnp.abs(out[0].astype(jnp.float32) - reference.astype(jnp.float32))
            t.diff = float(jnp.max(jnp.where(valid, delta, 0.0)))
        del out


def _sample(timings: list[Timing], repeats: int, platform: str) -> None:
    """`repeats` rounds, each entry one sample a round, in an order shuffled each round."""
    order = np.random.default_rng(0)
    for _ in range(repeats):
        for i in order.permutation(len(timings)):  # no entry always follows the same one
            t = timings[i]
            if t.compiled is None:
                continue
            try:
                if platform != "cpu":  # an untimed call first: the sample starts in stride
                    jax.block_until_ready(t.compiled(*t.args))
                start = time.perf_counter()
                for _ in range(t.calls):
                    out = t.compiled(*t.args)  # the last one done: all done (one stream)
                jax.block_until_ready(out)
                t.times.append((time.perf_counter() - start) / t.calls)
                del out
            except Exception as exc:
                t.error, t.compiled = _error(exc), None


def time_shape(shape: Shape, plans: list[Plan], repeats: int) -> list[Timing]:
    """Compiles the shape's runnable entries, warms each up, then times `repeats` rounds,
    each entry once per round."""
    on_device = _on_device(shape)
    timings = [Timing(p) for p in plans if p.runs]
    lowered = _compile(timings, on_device)
    _check_markers(timings, lowered)
    valid = on_device["segment_ids"][:, :, None, None] > 0
    platform = jax.devices()[0].platform
    _warm_up(timings, valid, platform)
    _sample(timings, repeats, platform)
    return timings
