"""Seconds per run of the programs behind a nightly's largest execute rows, on the machine whose
compilation cache a nightly just filled (the programs are built as the run builds them, so
they load from that cache): the oracle's truth and peer, reverse mode and forward mode, on one
case per oracle program of the suite (its shape, features and key span), and each named
kernel's default build against the leak probe's deterministic build on one case per shape.
Each program runs once untimed (its load), then `--runs` times, each launched and waited for;
the median is printed, per run (how many runs a night makes of each is in its timing table).

    python3 scripts/program_costs.py --suite nightly --kernels tokamax:xla_chunked,dot_product

A diagnosis for issue 32 (where the device's share of a warm nightly goes), not a check."""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="smoke")
    parser.add_argument("--kernels", default="dot_product")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--compilation-cache", default=os.environ.get("HARNESS_COMPILATION_CACHE"))
    args = parser.parse_args(argv)
    # As the workers run (harness.engine.workers): the same flags, so the same cache keys.
    from harness.engine.workers import worker_environment
    os.environ.update(worker_environment(dict(os.environ)))
    from harness.engine.compilation_cache import enable_compilation_cache
    from harness.engine.programs import Programs
    from harness.engine.program_functions import DEFAULT
    from harness.engine.environment import current_platform
    from harness.engine.registry import mark_absl_flags_parsed, select_kernels
    from harness.judge.oracle import case_key_span
    from harness.model.case import make_inputs, make_tangents
    from harness.model.suites import suite_cases
    mark_absl_flags_parsed()
    if args.compilation_cache:
        enable_compilation_cache(args.compilation_cache)
    programs = Programs(deterministic_probe=True)
    platform = current_platform()
    cases = suite_cases(args.suite)
    kernels = select_kernels(args.kernels.split(","))

    def timed(program, call_args) -> float:
        program(*call_args)                      # its load, its first run
        seconds = []
        for _ in range(args.runs):
            start = time.perf_counter()
            program(*call_args)
            seconds.append(time.perf_counter() - start)
        return statistics.median(seconds)

    def row(what: str, case, program, call_args) -> None:
        try:
            ms = f"{timed(program, call_args) * 1e3:.1f}"
        except Exception as exc:                 # noqa: BLE001 - a row says why it has no time
            ms = f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:100]}"
        print(f"| {what} | `{case.id}` | {ms} |", flush=True)

    def first_per(items, key) -> list:   # the first item of each key, in order
        out: dict = {}
        for item in items:
            out.setdefault(key(item), item)
        return list(out.values())
    # One case per oracle program (shape_key holds the features), one per shape without them.
    chosen = first_per(cases, lambda c: (c.shape_key, case_key_span(c)))
    plain = first_per([c for c in chosen if not c.features], lambda c: c.shape_key)
    # Everything compiled ahead on every core, as a run does (one at a time here would take
    # the oracle's 100 programs most of ten minutes on a cold cache): the oracle's through a
    # kernel with the default chunk convention and a forward mode (dot_product), as timed.
    reference, = select_kernels(["dot_product"])
    programs.prefetch([(reference, c) for c in chosen]
                      + [(k, c) for c in plain for k in kernels], probe=False)
    started = time.perf_counter()
    built = programs.wait_all()   # all compiled (or failed) before anything is timed
    print(f"compiled (or loaded) {built} programs in {time.perf_counter() - started:.0f} s\n")
    print("| program | case | median ms per run |\n|---|---|---|")
    for case in chosen:
        inputs = make_inputs(case).device_args
        tangents = inputs[:-1] + make_tangents(case)
        for truth in (True, False):
            name = "truth" if truth else "peer"
            row(f"oracle {name}, reverse", case, programs.oracle(case, truth), inputs)
            row(f"oracle {name}, forward", case, programs.oracle_jvp(case, truth), tangents)
    for case in plain:
        for kernel in kernels:
            if kernel.unsupported_reasons(case, platform):
                continue
            inputs = make_inputs(case).device_args
            for mode in dict.fromkeys((DEFAULT, programs.probe_mode)):   # one on CPUs
                row(f"{kernel.name} {mode} build", case, programs.get(kernel, case, mode),
                    inputs)
    programs.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
