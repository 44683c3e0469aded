#!/usr/bin/env python3
"""The reorder's gradient alone, in XLA's default and deterministic builds, checked exactly.

`jnp.take(x, order, axis=1)` with a permutation `order` (the striped load-balancing reorder of
context parallelism, 2 devices) differentiates to a scatter-add of the cotangent; with a
permutation that scatter only moves values, so the gradient is exactly `ct[:, inverse]`.
`xla_gpu_deterministic_ops` makes XLA rewrite scatter-adds. While the harness's context-parallel
kernels reordered with that gather, their deterministic builds (the leak probe's) differed from
their default builds on two H200s (before-fix/). This checks the gather's gradient on its own,
on one device and with the sequence sharded over two, at the probe's shapes: on the H200 pair
every build is exact (reorder_gradient_check.txt), so what went wrong needs the program around
it. Exits 1 while some build's gradient is not exactly the permuted cotangent, 0 once every
build's is, 2 without a GPU."""
import sys

import jax
import jax.numpy as jnp
import numpy as np


def striped(t: int, cp: int = 2) -> np.ndarray:
    return np.concatenate([np.arange(t)[r::cp] for r in range(cp)])


def main() -> int:
    if jax.devices()[0].platform != "gpu":
        print("cannot run here: needs a GPU (xla_gpu_deterministic_ops)")
        return 2
    print(f"jax {jax.__version__}, {jax.device_count()} x {jax.devices()[0].device_kind}")
    bad = 0
    for b, t, h, d, dtype in ((4, 1024, 8, 64, jnp.bfloat16), (4, 2048, 8, 128, jnp.bfloat16),
                              (4, 1024, 8, 64, jnp.float32)):
        order = striped(t)
        inverse = np.argsort(order)
        rng = np.random.default_rng(0)
        x = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
        ct = jnp.asarray(rng.standard_normal((b, t, h, d)), dtype)
        want = np.asarray(ct, np.float32)[:, inverse]

        def grad(x, ct):
            return jax.vjp(lambda x: jnp.take(x, order, axis=1), x)[1](ct)[0]
        layouts = [("one device", None)]
        if jax.device_count() >= 2:
            mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("context",))
            spec = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "context"))
            layouts.append(("sequence over 2 devices", spec))
        for where, sharding in layouts:
            fn = jax.jit(grad, in_shardings=(sharding, sharding) if sharding else None,
                         out_shardings=sharding)
            for build, options in (("default", None),
                                   ("deterministic", {"xla_gpu_deterministic_ops": True})):
                compiled = fn.lower(x, ct).compile(compiler_options=options) if options \
                    else fn.lower(x, ct).compile()
                got = np.asarray(compiled(x, ct), np.float32)
                diff = np.abs(got - want).max(axis=(1, 2, 3))
                rows = [int(r) for r in np.nonzero(diff)[0]]
                shape = f"{b}x{t}x{h}x{d} {jnp.dtype(dtype).name}"
                if rows:
                    bad += 1
                    print(f"WRONG  {shape}, {where}, {build} build: rows {rows} differ from the "
                          f"permuted cotangent (max |diff| per row {np.round(diff, 3).tolist()})")
                else:
                    print(f"exact  {shape}, {where}, {build} build")
    if bad:
        print(f"FAILED: {bad} build(s) of the reorder's gradient are not the permuted cotangent")
        return 1
    print("every build's gradient is exactly the permuted cotangent")
    return 0


if __name__ == "__main__":
    sys.exit(main())
