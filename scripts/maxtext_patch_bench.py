"""MaxText's own attention op before and after the patch, forward+backward, at the seed shape.

    before  maxtext:cudnn_flash_jax        the installed MaxText's AttentionOp (0.2.5: a causal
                                           mask only, so wrong on packed rows: timed for the
                                           cost of the fix)
    after   maxtext_fixed:cudnn_flash_jax  the same op with patches/maxtext-<version>/ applied
                                           (packed seqlens/offsets on Hopper and newer)

Timing is harness.tools.bench's (the `python -m harness bench` method): jax.vjp of each op
(output and dq, dk, dv) compiled ahead, arguments on the device, two warm-ups, then --repeats
rounds with the two interleaved in a shuffled order; per op the median, min and spread of the
samples; on a GPU a sample is several back-to-back calls. Prints the ratio after / before and the
issue's goal (after <= 0.67x before at the seed shape).

Shapes: `--shape seed` is the seed report's shape (8 x 2048, 32/8 heads, head_dim 128, bf16,
4 segments per row; GPU); `--shape small` the same layout in miniature (2 x 256, 4/2 heads,
head_dim 64). On a CPU both ops run through the cuDNN emulator (maxtext:cudnn_flash_jax:emulated,
maxtext_fixed:cudnn_flash_jax:emulated): a dry run of this script, whose times say nothing about
cuDNN's.

Usage (project root, maxtext installed, Python >= 3.12):
    python scripts/maxtext_patch_bench.py [--shape seed|small] [--repeats N] [--output OUT.json]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

BEFORE, AFTER = "maxtext:cudnn_flash_jax", "maxtext_fixed:cudnn_flash_jax"
GOAL = 0.67
SHAPE_SETS = {"seed": "hopper", "small": "small"}   # ours -> harness.tools.bench's shape set


def entries():
    from harness.tools import bench
    return [bench.Entry(name, "kernel", "cudnn", kernel=name,
                        emulated=lambda n=name: bench._registered(f"{n}:emulated"))
            for name in (BEFORE, AFTER)]


def run(shape_name: str, repeats: int) -> dict:
    """The bench's result for the seed shape of the set, with `after_over_before` added."""
    from harness.engine.environment import current_platform
    from harness.engine.registry import mark_absl_flags_parsed
    from harness.tools import bench

    mark_absl_flags_parsed()
    set_name = SHAPE_SETS[shape_name]
    shape = next(s for s in bench.shape_set(set_name) if s.name == bench.SEED_SHAPE)
    platform = current_platform()
    [plans] = bench.plan_all([shape], entries(), platform, bench.memory_budget(platform), set_name)
    runs = bench.time_shape(shape, plans, repeats) if all(p.runs for p in plans) else []
    result = bench.shape_result(shape, plans, runs)
    medians = {e["entry"]: e["median_ms"] for e in result["entries"]}
    result["after_over_before"] = (medians[AFTER] / medians[BEFORE]
                                   if medians[AFTER] and medians[BEFORE] else None)
    result["platform"], result["shape_option"] = platform.name, shape_name
    return result


def report(result: dict, repeats: int) -> list[str]:
    from harness.tools import bench
    bench.print_shape(result, repeats)
    lines = []
    for e in result["entries"]:
        if e["skipped"] or e["error"]:
            lines.append(f"{e['entry']}: not timed: {e['skipped'] or e['error']}")
    ratio = result["after_over_before"]
    if ratio is not None:
        emulated = " (cpu, through the cuDNN emulator: not cuDNN's times)" \
            if result["platform"] == "cpu" else ""
        lines.append(f"after / before = {ratio:.3f}{emulated}")
        if result["platform"] == "gpu" and result["shape_option"] == "seed":
            lines.append(f"goal after <= {GOAL}x before at the seed shape: "
                         f"{'met' if ratio <= GOAL else 'not met'} ({ratio:.3f})")
    return lines


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPE_SETS), default="seed")
    parser.add_argument("--repeats", type=int, default=20, help="timed rounds (default 20)")
    parser.add_argument("--output", help="write the result as JSON here")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats {args.repeats}: must be at least 1")
    result = run(args.shape, args.repeats)
    for line in report(result, args.repeats):
        print(line)
    if args.output:
        from harness.engine.environment import describe
        with open(args.output, "w") as f:
            json.dump({"environment": describe(), "repeats": args.repeats, "result": result}, f,
                      indent=1)
    return 0 if result["after_over_before"] is not None else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
