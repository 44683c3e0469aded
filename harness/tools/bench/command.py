"""`python -m harness bench`: plan every (shape, entry) on this device (refusing before any work
when memory leaves nothing to run), time each shape, print its table and the goals, and write
the JSON report."""
from __future__ import annotations

import json

from harness.errors import UsageError
from harness.tools.bench.entries import select_entries
from harness.tools.bench.goals import goal_checks
from harness.tools.bench.plans import memory_budget, plan_all
from harness.tools.bench.results import print_shape, shape_result
from harness.tools.bench.shapes import shape_set
from harness.tools.bench.timing import time_shape

# How the numbers were taken, in the JSON report.
METHOD = {"timing": "jax.vjp forward+backward, compiled ahead, arguments on device, two "
                    "warm-ups, repeats interleaved across entries in an order shuffled each "
                    "round, a sample = one untimed call, then calls_per_sample back-to-back "
                    "calls / calls_per_sample (1 call, none untimed, on CPUs); spread = "
                    "(max - min) / median",
          "useful_flops": "same-segment causal only: forward 4*L(L+1)/2*head_dim*heads per "
                          "segment, backward 2.5x forward",
          "xla_memory": "XLA's memory analysis of the compiled fwd+bwd program, bytes: temp, "
                        "arguments, outputs, alias; total = temp + arguments + outputs"}


def main(shapes: str = "small", repeats: int = 10, output: str | None = None,
         kernels=None) -> int:
    """Times the entries (`kernels`: names, or None for the bench's own) on the shape set
    `shapes`, `repeats` samples each; the JSON report to `output`."""
    from harness.engine.environment import current_platform, describe

    if repeats < 1:
        raise UsageError(f"--repeats {repeats}: must be at least 1")
    shape_set_name = shapes
    shapes = shape_set(shape_set_name)
    entries = select_entries(kernels)
    platform = current_platform()
    budget = memory_budget(platform)
    plans = plan_all(shapes, entries, platform, budget, shape_set_name)  # refuses before any work
    if platform.name == "cpu":
        print("cpu: the cuDNN entries run through the cuDNN emulator (dense, plain JAX); their "
              "times say nothing about cuDNN's")
    print("useful TFLOP/s: same-segment causal work only (forward 4*L(L+1)/2*head_dim*heads per "
          "segment of L tokens, backward 2.5x the forward)\n")
    results = []
    for shape, shape_plans in zip(shapes, plans):
        timings = time_shape(shape, shape_plans, repeats) \
            if any(p.runs for p in shape_plans) else []
        results.append(shape_result(shape, shape_plans, timings))
        print_shape(results[-1], repeats)
        del timings
    checks = goal_checks(results)
    print("\ngoals" + (" (measured on the cpu through the emulator: the goals are for the GPU)"
                       if platform.name == "cpu" else "") + ":")
    for c in checks:
        print(f"  {c['text']}")
    if output:
        with open(output, "w") as f:
            json.dump({"environment": describe(), "shapes": shape_set_name, "repeats": repeats,
                       "method": METHOD, "results": results, "goals": checks}, f, indent=1)
    return 0
