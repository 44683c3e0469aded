"""On CPUs the oracle's and the harness's own programs compile at LLVM's O1
(harness.engine.compiler_options.CPU_OWN_OPTIONS), and so compute bitwise what XLA's default
build computes: every error a report holds, and a baseline's, stays as it was. Checked on the
smoke suite's features (windows, soft caps, chunks, sinks, a value head dim of its own), truth
and peer, gradients and tangents; a jax whose O1 computes otherwise fails here."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness.engine.compiler_options import CPU_OWN_OPTIONS
from harness.judge import leak_probe, metrics, probe_runs
from harness.judge.oracle import _reference_args, reference_fn, reference_jvp_fn
from harness.model.case import make_inputs, tangent_statics, tangents_program
from harness.model.suites import suite_cases

CASES = ("packed/random-b4-t256-h4kv2-d64-bf16-s6-w15.0-cap2",
         "padded/between-b4-t256-h4kv2-d64-bf16-s6-ch32",
         "packed/random-b4-t256-h4kv4-d32-f32-s6-w15.0-sink",
         "unaligned/odd-b4-t256-h4kv2-d64-bf16-s6-dv32")


def _case(case_id):
    case, = [c for c in suite_cases("smoke") if c.id == case_id]
    return case


def _both_builds(fn, *args, **static):
    """fn's outputs compiled with XLA's defaults and with CPU_OWN_OPTIONS, as byte arrays."""
    lowered = jax.jit(fn, static_argnames=tuple(static)).lower(*args, **static)
    return [[np.asarray(x).view(np.uint8) for x in jax.tree_util.tree_leaves(
                compiled(*args))]
            for compiled in (lowered.compile(), lowered.compile(CPU_OWN_OPTIONS))]


def _same(builds):
    default, own = builds
    assert len(default) == len(own)
    for i, (a, b) in enumerate(zip(default, own)):
        assert np.array_equal(a, b), f"output {i}: {np.count_nonzero(a != b)} bytes differ"


@pytest.mark.parametrize("case_id", CASES)
@pytest.mark.parametrize("truth", [True, False], ids=["truth", "peer"])
def test_the_oracles_programs_at_o1_compute_bitwise_what_the_default_build_does(case_id, truth):
    case = _case(case_id)
    _same(_both_builds(reference_fn(case, truth), *_reference_args(case, forward=False)))
    _same(_both_builds(reference_jvp_fn(case, truth), *_reference_args(case, forward=True)))


@pytest.mark.parametrize("case_id", CASES[2:])
def test_the_harness_own_programs_at_o1_compute_bitwise_what_the_default_build_does(case_id):
    case = _case(case_id)
    args = make_inputs(case).device_args
    q, k, v, seg, cotangent = args[:3] + (args[3], args[-1])
    pad = seg == 0
    redraw = jnp.zeros_like(pad).at[:, 5:40].set(True)
    _same(_both_builds(tangents_program.__wrapped__, np.uint32(7), pad, **tangent_statics(case)))
    _same(_both_builds(leak_probe.redrawn.__wrapped__, np.uint32(7), np.int32(3),
                       np.float32(4.0), q, k, v, cotangent, redraw, ~pad))
    other = tuple(x + 1e-3 * (x != 0) for x in (q, k, v))
    _same(_both_builds(metrics.stacked_token_errors.__wrapped__, (q, k, v), other))
    _same(_both_builds(metrics.scales.__wrapped__, (q, k, v), seg))
    _same(_both_builds(probe_runs.stacked_changes.__wrapped__, (q, k, v), other))
    _same(_both_builds(probe_runs.nonfinite_tokens.__wrapped__, (q, k, v)))
