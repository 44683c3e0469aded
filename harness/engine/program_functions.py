"""What a kernel's program computes, as a function of its arguments: the kernel with the case's
features handed over (`kernel_fn`), its arguments' shapes (`argument_shapes`), and the case's
static features as keyword arguments (`feature_arguments`). harness.engine.programs traces and
compiles these; the census's and reproducers' scripts call them as they are."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from harness.errors import BrokenContract, kernel_code
from harness.judge.oracle import gradient_inputs, with_gradients, with_tangents
from harness.kernels.kernel import Kernel
from harness.model.case import Case

DEFAULT = "default"
# The kernel's forward mode: (q, k, v, seg[, sinks], tangents) -> (the output's tangent,),
# through jax.jvp (the jvp check of kernels that declare forward_mode).
FORWARD = "forward"
# The leak probe's build on GPUs (harness.engine.programs): the default's lowering compiled
# with XLA's deterministic ops.
DETERMINISTIC = "deterministic"


def feature_arguments(case: Case) -> dict:
    """The case's static features as a kernel's keyword arguments (harness.model.features):
    window=(left, right), softcap=, chunk=. Sinks travel as an array input."""
    f = case.features
    out = {}
    if f.window is not None:
        out["window"] = tuple(f.window)
    if f.softcap is not None:
        out["softcap"] = f.softcap
    if f.chunk is not None:
        out["chunk"] = f.chunk
    return out


def kernel_fn(kernel: Kernel, case: Case, mode: str = DEFAULT):
    """The kernel's program as a function of (q, k, v, seg[, sinks], cotangent): the case's
    features handed over as keyword arguments, the sinks as `sinks=` (differentiated). In
    FORWARD mode, of (q, k, v, seg[, sinks], tq, tk, tv[, tsinks]): the output's tangent."""
    extra = {"max_segments": case.max_segments} if kernel.takes_max_segments else {}
    extra.update(feature_arguments(case))

    def fn(q, k, v, seg, *sinks):
        more = {"sinks": sinks[0]} if sinks else {}
        out = kernel.fn(q, k, v, seg, causal=case.causal, scale=case.scale, **extra, **more)
        want = q.shape[:-1] + v.shape[-1:]
        if out.shape != want:
            raise BrokenContract(f"{kernel.name}: output shape {out.shape} != {want} (the "
                                 "query's, with the value's head dim)")
        return out

    program = (with_tangents(fn, bool(case.features.sinks)) if mode == FORWARD else
               with_gradients(fn, kernel.backward, gradient_inputs(case)))

    def traced(*args):   # the kernel's code, forward and backward, as the harness traces it
        with kernel_code():
            return program(*args)
    return traced


def argument_shapes(case: Case, mode: str = DEFAULT) -> tuple:
    """The program's arguments: (q, k, v, seg[, sinks], cotangent); in FORWARD mode (q, k, v,
    seg[, sinks], tq, tk, tv[, tsinks])."""
    dtype = jnp.dtype(case.dtype)
    b, t, d, dv = case.batch, case.seq_len, case.head_dim, case.value_dim
    sinks = (jax.ShapeDtypeStruct((case.heads,), jnp.float32),) if case.features.sinks else ()
    qkv = (jax.ShapeDtypeStruct((b, t, case.heads, d), dtype),
           jax.ShapeDtypeStruct((b, t, case.kv_heads, d), dtype),
           jax.ShapeDtypeStruct((b, t, case.kv_heads, dv), dtype))
    if mode == FORWARD:
        return (*qkv, jax.ShapeDtypeStruct((b, t), jnp.int32), *sinks, *qkv, *sinks)
    return (*qkv, jax.ShapeDtypeStruct((b, t), jnp.int32), *sinks,
            jax.ShapeDtypeStruct((b, t, case.heads, dv), dtype))
