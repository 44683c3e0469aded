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
# On CPUs they compile at LLVM's O1, not XLA's O2: over the smoke suite's 68 own programs 8 s,
# not 16 (jax 0.12; 6 s, not 14, for the tangents and perturbations on 0.10.2), the cold smoke
# run 130 s, not 148, every record's numbers the same (reports/cpu-smoke-own-o1/).
CPU_OWN_OPTIONS = {"xla_backend_optimization_level": 1}


def own_options(gpu: bool) -> dict:
    """The oracle's and the harness's own programs' options on a GPU, or on a CPU."""
    return OWN_OPTIONS if gpu else CPU_OWN_OPTIONS


def deterministic_options(gpu: bool) -> dict:
    """A deterministic build's options (on CPUs the probe runs the default build; a
    deterministic one built there anyway, as a test may, gets XLA's flag alone)."""
    return {**DETERMINISTIC_COMPILER_OPTIONS, **(NO_AUTOTUNING if gpu else {})}
