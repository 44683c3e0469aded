"""XLA's compiler options for the programs the harness builds: the oracle's and its own (per-token
metrics, the probe's perturbations and comparisons, the jvp check's tangents), and the leak
probe's deterministic builds. Each kernel's default build compiles as users compile it: with
none."""
from __future__ import annotations

DETERMINISTIC_COMPILER_OPTIONS = {"xla_gpu_deterministic_ops": True}
# The harness's programs on GPUs (the oracle's, its own, the probe's deterministic builds) skip
# XLA's autotuning: it times candidate GEMM algorithms and Triton configurations on the device
# for every program (tens of seconds each for the float32 oracle on the H200).
NO_AUTOTUNING = {"xla_gpu_autotune_level": 0}
# The oracle's and the harness's own programs on GPUs also make their GEMMs cuBLAS calls, not
# Triton fusions (code XLA generates and ptxas compiles per program): on the H200 the oracle's
# sampled programs compiled in 9.9 s, not 15.3 s, with bitwise the same outputs
# (reports/nightly-h200-45854c3/). The probe's deterministic builds keep XLA's GEMMs.
OWN_OPTIONS = {**NO_AUTOTUNING, "xla_gpu_enable_triton_gemm": False}
# On CPUs they compile with XLA's defaults. At LLVM's O1 they computed the same bytes and the
# smoke suite's own programs compiled in half the time, but the cold smoke run's wall time did
# not move (reports/cpu-smoke-side-by-side/own-o1-07ac076/): not taken.


def own_options(gpu: bool) -> dict | None:
    """The oracle's and the harness's own programs' options on a GPU; None (XLA's defaults) on a
    CPU."""
    return OWN_OPTIONS if gpu else None


def deterministic_options(gpu: bool) -> dict:
    """A deterministic build's options (on CPUs the probe runs the default build; a
    deterministic one built there anyway, as a test may, gets XLA's flag alone)."""
    return {**DETERMINISTIC_COMPILER_OPTIONS, **(NO_AUTOTUNING if gpu else {})}
