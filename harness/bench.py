"""python -m harness bench: forward+backward time per kernel, medians and ratios in one run.

Numbers come from one process on one device, each the median of --repeats timed calls after a
warm-up (compilation excluded). Ratios are against the first kernel listed, so a run compares
kernels with each other, never with a number from another day. Nothing here asserts a speed.
"""
from __future__ import annotations

import json
import statistics
import time

import jax

from harness.cases import Case, make_inputs
from harness.environment import current_platform, describe
from harness.registry import select_kernels
from harness.runner import _kernel_program

SHAPES = {
    "small": [Case("packed/random", 2, 256, 4, 2, 64, "bfloat16", 0)],
    # The GPU runner's shapes: 8 x 2048 with 4 segments per row, and 1 x 8192 with 8.
    "hopper": [Case("packed/random", 8, 2048, 32, 8, 128, "bfloat16", 0),
               Case("packed/many", 1, 8192, 32, 8, 128, "bfloat16", 0)],
}


def time_kernel(kernel, case: Case, repeats: int) -> float:
    x = make_inputs(case)
    program = _kernel_program(kernel, case.scale, case.causal,
                              case.max_segments if kernel.takes_max_segments else None,
                              kernel.backward)
    args = [jax.device_put(a) for a in (x.query, x.key, x.value, x.segment_ids, x.cotangent)]
    jax.block_until_ready(program(*args))  # compile and warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(program(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main(args) -> int:
    platform = current_platform()
    kernels = select_kernels(args.kernels)
    rows = []
    for case in SHAPES[args.shapes]:
        base = None
        print(f"{case.id}: forward+backward, median of {args.repeats}")
        for kernel in kernels:
            reasons = kernel.unsupported_reasons(case, platform)
            if reasons:
                print(f"  {kernel.name:45s} skip: {'; '.join(reasons)}")
                continue
            try:
                t = time_kernel(kernel, case, args.repeats)
            except Exception as exc:  # report and go on: a benchmark is not a verdict
                print(f"  {kernel.name:45s} error: {type(exc).__name__}: {str(exc)[:120]}")
                continue
            base = base or t
            rows.append({"case_id": case.id, "kernel": kernel.name, "median_ms": t * 1e3,
                         "ratio_to_first": t / base})
            print(f"  {kernel.name:45s} {t * 1e3:9.3f} ms  x{t / base:.2f}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump({"environment": describe(), "repeats": args.repeats, "results": rows}, f,
                      indent=1)
    return 0
