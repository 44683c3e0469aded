"""Compile seconds of the nightly's oracle programs, of the harness's own, and of named kernels'
builds under XLA option sets beside NO_AUTOTUNING (the oracle's options before OWN_OPTIONS,
harness/engine/programs.py), one program at a time with no compilation cache (each compile is
a cold one, and has the process's cores to itself), and how far each option set moves the
oracle's outputs from the NO_AUTOTUNING build (the largest difference over an output, as a
share of that output's largest magnitude, over the truth's and the peer's out, dq, dk, dv).

    python3 scripts/compile_costs.py --suite nightly --cases 8 --kernels xla,dot_product

A diagnosis for issue 32 (the cold nightly's compile seconds), not a check: it decides whether
an option set is worth a GPU compare of the whole nightly's verdicts."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# Option sets tried beside the harness's own (each added to NO_AUTOTUNING).
VARIANTS = {
    "no-triton-gemm": {"xla_gpu_enable_triton_gemm": False},
    "llvm-cheap": {"xla_llvm_disable_expensive_passes": True},
    "no-triton-gemm+llvm-cheap": {"xla_gpu_enable_triton_gemm": False,
                                  "xla_llvm_disable_expensive_passes": True},
}


def compile_s(lowered, options: dict | None):
    """(the compiled program, its compile seconds), or (None, why it failed)."""
    from harness.compiling import compile_lowered
    start = time.perf_counter()
    try:
        compiled = compile_lowered(lowered, options)
    except Exception as exc:   # noqa: BLE001 - the row says why
        return None, f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:90]}"
    return compiled, time.perf_counter() - start


def cell(seconds) -> str:
    """A table cell: seconds, or why there are none."""
    return seconds if isinstance(seconds, str) else f"{seconds:.2f}"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--suite", default="smoke")
    parser.add_argument("--cases", type=int, default=8,
                        help="oracle programs' cases, spread over the suite's (one per program)")
    parser.add_argument("--kernels", default="",
                        help="kernels whose default and deterministic builds are timed too")
    args = parser.parse_args(argv)
    from harness.engine.workers import worker_environment
    os.environ.update(worker_environment(dict(os.environ)))
    import jax
    import numpy as np

    from harness.engine.environment import current_platform
    from harness.engine.program_functions import DEFAULT, argument_shapes, kernel_fn
    from harness.engine.compiler_options import DETERMINISTIC_COMPILER_OPTIONS, NO_AUTOTUNING
    from harness.engine.registry import mark_absl_flags_parsed, select_kernels
    from harness.judge.oracle import case_key_span, reference_fn
    from harness.model.case import make_inputs
    from harness.model.suites import suite_cases
    mark_absl_flags_parsed()
    platform = current_platform()
    cases = suite_cases(args.suite)
    chosen: dict = {}
    for c in cases:
        chosen.setdefault((c.shape_key, case_key_span(c)), c)
    every = list(chosen.values())
    step = max(1, len(every) // max(1, args.cases))
    sample = every[::step][:args.cases]
    print(f"{len(every)} oracle cases in `{args.suite}`; timing {len(sample)}; "
          f"platform {platform}; no compilation cache\n")

    totals: dict = {}
    print("| program | case | "
          + " | ".join(["NO_AUTOTUNING s", *(f"{v} s (moved)" for v in VARIANTS)])
          + " |\n|" + "---|" * (3 + len(VARIANTS)))
    for case in sample:
        inputs = make_inputs(case).device_args
        for truth in (True, False):
            lowered = jax.jit(reference_fn(case, truth)).lower(*inputs)
            base, base_s = compile_s(lowered, NO_AUTOTUNING)
            if base is None:
                print(f"| oracle {'truth' if truth else 'peer'} | `{case.id}` | {base_s} |")
                continue
            want = [np.asarray(x, np.float64) for x in base(*inputs)]
            cells = [cell(base_s)]
            totals["NO_AUTOTUNING"] = totals.get("NO_AUTOTUNING", 0.0) + base_s
            for name, extra in VARIANTS.items():
                compiled, s = compile_s(lowered, {**NO_AUTOTUNING, **extra})
                if compiled is None:
                    cells.append(s)
                    continue
                got = [np.asarray(x, np.float64) for x in compiled(*inputs)]
                moved = max(float(np.nanmax(np.abs(g - w)) / max(np.nanmax(np.abs(w)), 1e-30))
                            for g, w in zip(got, want))
                totals[name] = totals.get(name, 0.0) + s
                cells.append(f"{s:.2f} ({moved:.1e})")
            print(f"| oracle {'truth' if truth else 'peer'} | `{case.id}` | "
                  + " | ".join(cells) + " |", flush=True)
    print("\noracle totals, s: " + ", ".join(f"{k} {v:.1f}" for k, v in totals.items()))
    own_programs(sample)
    kernels = select_kernels(args.kernels.split(",")) if args.kernels else []
    if kernels:
        print("\n| kernel | case | default s | deterministic s | "
              + " | ".join(f"deterministic {v} s" for v in VARIANTS) + " |\n|"
              + "---|" * (4 + len(VARIANTS)))
    for kernel in kernels:
        for case in sample:
            if kernel.unsupported_reasons(case, platform) or case.features:
                continue
            try:
                lowered = jax.jit(kernel_fn(kernel, case, DEFAULT)).lower(
                    *argument_shapes(case, DEFAULT))
            except Exception as exc:   # noqa: BLE001 - the row says why
                print(f"| {kernel.name} | `{case.id}` | lowering failed: {type(exc).__name__} |")
                continue
            cells = [compile_s(lowered, None)[1],
                     compile_s(lowered, {**DETERMINISTIC_COMPILER_OPTIONS, **NO_AUTOTUNING})[1]]
            cells += [compile_s(lowered, {**DETERMINISTIC_COMPILER_OPTIONS, **NO_AUTOTUNING,
                                          **extra})[1] for extra in VARIANTS.values()]
            print(f"| {kernel.name} | `{case.id}` | " + " | ".join(map(cell, cells)) + " |",
                  flush=True)
    return 0


def own_programs(sample) -> None:
    """The harness's own programs (harness.ahead) at each sampled case's signatures, each
    signature once (jax's in-process cache would answer a repeat): with no options (XLA's
    defaults, autotuning included: how they compiled before OWN_OPTIONS), with NO_AUTOTUNING,
    and with each option set beside it (no-triton-gemm: OWN_OPTIONS)."""
    import jax
    import jax.numpy as jnp

    from harness.engine.program_functions import argument_shapes
    from harness.engine.compiler_options import NO_AUTOTUNING
    from harness.judge.leak_probe import redrawn
    from harness.judge.metrics import stacked_token_errors
    from harness.judge.oracle import reference_fn
    from harness.judge.vocabulary import TENSORS
    from harness.model.case import tangent_statics, tangents_program
    sets = {"none": {}, "NO_AUTOTUNING": NO_AUTOTUNING,
            **{k: {**NO_AUTOTUNING, **v} for k, v in VARIANTS.items()}}
    totals = dict.fromkeys(sets, 0.0)
    seen: set = set()
    print("\n| own program | case | " + " | ".join(f"{k} s" for k in sets) + " |\n|"
          + "---|" * (2 + len(sets)))
    u32, i32, f32 = (jax.ShapeDtypeStruct((), t) for t in (jnp.uint32, jnp.int32, jnp.float32))
    for case in sample:
        flags = jax.ShapeDtypeStruct((case.batch, case.seq_len), jnp.bool_)
        args = argument_shapes(case)
        truth = jax.jit(reference_fn(case, True)).lower(*args).out_info
        lowerings = {
            "tangents_program": tangents_program._jit.lower(u32, flags, **tangent_statics(case)),
            "redrawn": redrawn._jit.lower(u32, i32, f32, *args[:3], args[-1], flags, flags),
            "stacked_token_errors": stacked_token_errors._jit.lower(truth[:len(TENSORS)],
                                                                  truth[:len(TENSORS)]),
        }
        for name, lowered in lowerings.items():
            text = lowered.as_text()
            if text in seen:
                continue
            seen.add(text)
            cells = []
            for k, options in sets.items():
                _, s = compile_s(lowered, options or None)
                if not isinstance(s, str):
                    totals[k] += s
                cells.append(cell(s))
            print(f"| {name} | `{case.id}` | " + " | ".join(cells) + " |", flush=True)
    print("\nown programs' totals, s: " + ", ".join(f"{k} {v:.1f}" for k, v in totals.items()))


if __name__ == "__main__":
    sys.exit(main())
