"""A reproducer for what a kernel writes at padding positions (`harness repro` shrinks tolerance
and leak failures; the padding check's failures get this script instead): the kernel's forward
and backward on the case the census saw fail, and every row's padding positions looked at as the
padding check does (harness.judge.metrics.padding_violations): gradients exactly zero, the output
finite. Exits 1 while a violation shows."""
from __future__ import annotations

from pathlib import Path

from harness.judge.record import Record

_SCRIPT = '''#!/usr/bin/env python3
# Padding reproducer written by `python -m harness census`: @KERNEL@ on @CASE@ wrote at padding
# positions what a training step cannot take: @SEEN@
#
# It runs the kernel forward and backward (jax.vjp, jitted, the output cotangent zero at padding
# as a masked loss gives it) on that case's inputs and prints, per row, what it wrote at the
# padding positions: dq, dk and dv must be exactly zero there (they enter the projections'
# weight gradients), the output finite (it feeds the next layer). Exits 1 while some row
# violates that, 0 once none does, 2 where it cannot run here. It imports attention-harness for
# the kernel and the case: run it with the harness's checkout on PYTHONPATH.
import sys
from pathlib import Path

KERNEL = @KERNEL_LIT@
CASE_ID = @CASE_LIT@
KERNEL_MODULES = @MODULES@


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
    from harness.engine.program_functions import kernel_fn
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
'''


def padding_script(kernel, record: Record, modules: list[str]) -> str:
    fills = {"@KERNEL_LIT@": repr(kernel.name), "@CASE_LIT@": repr(record.case_id),
             "@MODULES@": repr(modules), "@KERNEL@": kernel.name, "@CASE@": record.case_id,
             "@SEEN@": record.message.replace("\n", " ")[:200]}
    text = _SCRIPT
    for key, value in fills.items():
        text = text.replace(key, value)
    return text


def write_padding_repro(kernel, padding_fails: list[Record], path: Path,
                        kernel_modules: list[str]) -> str:
    """The script for the first case whose padding check failed; its case id."""
    first = min(padding_fails, key=lambda r: (r.case_id, r.row))
    modules = [str(Path(m).resolve()) if Path(m).exists() else m for m in kernel_modules]
    path.write_text(padding_script(kernel, first, modules))
    return first.case_id
