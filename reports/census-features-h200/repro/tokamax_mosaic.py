#!/usr/bin/env python3
# Error reproducer written by `python -m harness census`: tokamax:mosaic raised on packed/random-b4-t2048-h8kv2-d128-bf16-s6-bidir-w255.128
# in the census (known): TypeError: Mesh.__init__() got an unexpected keyword argument 'out_shape'
#
# It calls the kernel as the census did (forward and backward through jax.vjp, jitted) on that
# case's inputs, prints the error and exits 1 while the kernel raises; 0 once it runs, 2 where
# it cannot run here (another device, a library missing). It imports attention-harness for the
# kernel and the case: run it from inside the harness's checkout, or with the checkout on
# PYTHONPATH, in the environment the census ran in (the same libraries).
import sys
import traceback
from pathlib import Path

KERNEL = 'tokamax:mosaic'
CASE_ID = 'packed/random-b4-t2048-h8kv2-d128-bf16-s6-bidir-w255.128'
KERNEL_MODULES = []  # what registered the kernel (--kernel-module)
SEEN = "TypeError: Mesh.__init__() got an unexpected keyword argument 'out_shape'"


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
    program = jax.jit(kernel_fn(kernel, case))
    try:
        jax.block_until_ready(program(*make_inputs(case).args))
    except Exception as exc:
        traceback.print_exc(file=sys.stdout)  # in order with the lines around it
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        print(f"FAILED: {KERNEL} raises {type(exc).__name__}: {first}")
        return 1
    print(f"no error: {KERNEL} ran {CASE_ID} forward and backward (the census saw: {SEEN})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
