"""Which of the harness's own small programs (harness.ahead) a (kernel, case) pair will call,
at which signatures: read from the lowered outputs of the oracle's and the kernel's programs,
so that harness.engine.programs compiles them ahead in threads of their own, beside the
kernels'; the jvp check's tangents (tangents_ahead) from the pair's announcement alone."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from harness.judge import leak_probe, metrics, probe_runs
from harness.judge.vocabulary import TENSORS
from harness.model.case import Case, tangent_statics, tangents_program


def compile_ahead(case: Case, forward: bool, probe: bool, args: tuple, truth, peer, mine,
                  submit, timing, options: dict | None = None) -> None:
    """Compiles ahead the programs the runner, the oracle and the probe call on a pair, at the
    signatures of their calls there: for its checks and probe, or with `forward` its jvp check
    (its tangents' program was announced with the pair: tangents_ahead).
    `args`: the kernel program's argument shapes; `truth`, `peer`, `mine`: the output shapes
    of the oracle's programs and the kernel's (None for one that failed to lower: its calls,
    if any, compile when made); `submit` runs a callable on a compile thread; `timing` takes
    the seconds (harness.engine.program.Timing); `options`: XLA's compiler options for them
    (harness.engine.compiler_options)."""
    def ahead(fn, *shapes, **static):
        fn.compile_ahead(submit, timing, *shapes, compiler_options=options, **static)

    seg = args[3]
    n = 1 if forward else len(TENSORS)
    if truth is not None and peer is not None:       # reference_for, jvp_reference_for
        ahead(metrics.stacked_token_errors, peer[:n], truth[:n])
        ahead(metrics.scales, truth[:n], seg)
    if mine is None or truth is None:
        return
    got = mine[:n]                                    # the runner's per-token errors
    ahead(metrics.stacked_token_errors, got, truth[:len(got)])
    if probe and not forward:                         # leak_probe.probe
        ahead(probe_runs.stacked_changes, got, got)
        ahead(probe_runs.nonfinite_tokens, got)
        ahead(metrics.scales, got, seg)
        flags = _token_flags(case)
        ahead(leak_probe.redrawn, jax.ShapeDtypeStruct((), jnp.uint32),
              jax.ShapeDtypeStruct((), jnp.int32), jax.ShapeDtypeStruct((), jnp.float32),
              *args[:3], args[-1], flags, flags)


def tangents_ahead(case: Case, submit, timing, options: dict | None = None) -> None:
    """make_tangents' program for the case, compiled ahead. It takes no other program's
    outputs, so a run announces it with the pair (Programs.prefetch): the run draws a case's
    tangents for the jvp check's reference launched ahead, before that case's other programs
    are announced, and it compiled them itself then (13.3 s of the H200's cold nightly at
    4d948f1)."""
    tangents_program.compile_ahead(submit, timing, jax.ShapeDtypeStruct((), jnp.uint32),
                                   _token_flags(case), compiler_options=options,
                                   **tangent_statics(case))


def _token_flags(case: Case):
    """The shape of a per-token flag argument (padding, where a perturbation lands)."""
    return jax.ShapeDtypeStruct((case.batch, case.seq_len), jnp.bool_)
