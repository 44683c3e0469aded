#!/usr/bin/env python3
# Padding reproducer written by `python -m harness census`: flash_attn:varlen_vmap on packed/random-b4-t2048-h8kv2-d128-bf16-s6-bidir-w255.128 wrote at padding
# positions what a training step cannot take: dq non-finite at 31 padding positions (first 2017); dk non-finite at 31 padding positions (first 2017); dv non-finite at 31 padding positions (first 2017)
#
# It runs the kernel forward and backward (jax.vjp, jitted, the output cotangent zero at padding
# as a masked loss gives it) on that case's inputs and prints, per row, what it wrote at the
# padding positions: dq, dk and dv must be exactly zero there (they enter the projections'
# weight gradients), the output finite (it feeds the next layer). Exits 1 while some row
# violates that, 0 once none does, 2 where it cannot run here. It imports attention-harness for
# the kernel and the case: run it with the harness's checkout on PYTHONPATH.
import sys
from pathlib import Path

KERNEL = 'flash_attn:varlen_vmap'
CASE_ID = 'packed/random-b4-t2048-h8kv2-d128-bf16-s6-bidir-w255.128'
KERNEL_MODULES = []


def find_harness() -> None:
    try:
        import harness  # noqa: F401
        return
    except ImportError:
        pass
    for folder in Path(__file__).resolve().parents:
        if (folder / "harness" / "__init__.py").is_file():
            sys.path.insert(0, str(folder))
            return
    sys.exit("attention-harness is not importable: run with PYTHONPATH=<its checkout>")


def main() -> int:
    find_harness()
    import jax
    import numpy as np

    from harness.engine.environment import current_platform, package_version
    from harness.engine.programs import kernel_fn
    from harness.engine.registry import load_kernel_module, mark_absl_flags_parsed, select_kernels
    from harness.model.case import Case, make_inputs

    mark_absl_flags_parsed()
    for module in KERNEL_MODULES:
        load_kernel_module(module)
    kernel = select_kernels([KERNEL])[0]
    case = Case.from_id(CASE_ID)
    libraries = ", ".join(f"{m} {package_version(m.split('.')[0])}" for m in kernel.requires)
    print(f"{KERNEL} on {CASE_ID}; jax {jax.__version__}" + (f", {libraries}" if libraries else ""))
    reasons = kernel.unsupported_reasons(case, current_platform())
    if reasons:
        print(f"cannot run here: {'; '.join(reasons)}")
        return 2
    results = jax.jit(kernel_fn(kernel, case))(*make_inputs(case).args)
    results = [np.asarray(x, np.float32) for x in results]
    bad = 0
    for row in range(case.batch):
        pad = case.segment_ids[row] == 0
        if not pad.any():
            continue
        for name, x in zip(("out", "dq", "dk", "dv"), results):
            if name == "out" and kernel.padding_output == "undefined":
                continue                          # the kernel declares it undefined there
            at = x[row][pad]                      # [padding tokens, heads, head_dim]
            nonfinite = int((~np.isfinite(at)).any(axis=(1, 2)).sum())
            zero = name != "out" or kernel.padding_output == "zero"
            nonzero = int((at != 0).any(axis=(1, 2)).sum()) if zero else 0
            if nonfinite or nonzero:
                bad += 1
                size = np.abs(np.where(np.isfinite(at), at, 0)).max()
                print(f"row {row}: {name} at {int(pad.sum())} padding positions: "
                      f"{nonfinite} non-finite, {nonzero} non-zero (max finite |{name}| "
                      f"{size:.3g})")
    if bad:
        print(f"FAILED: {KERNEL} wrote non-zero or non-finite values at padding positions "
              f"({bad} row x tensor violations)")
        return 1
    print(f"no violation: {KERNEL} wrote zero gradients and finite outputs at padding here")
    return 0


if __name__ == "__main__":
    sys.exit(main())
