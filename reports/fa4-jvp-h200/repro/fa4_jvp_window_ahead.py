#!/usr/bin/env python3
"""fa4-jax 0.1.0: forward mode (jax.jvp) through flash_attn_varlen with a window that reads
ahead gives a wrong output tangent, while the output itself is right.

Two packed sequences (700 and 1348 tokens), 8 query heads, 2 kv heads, head_dim 128, bfloat16,
not causal, window_size=(255, 128). The output and its tangent (jax.jvp, random input tangents)
are compared with a float32 dense reference of the same mask (each token attends to the keys
of its own sequence from 255 before it to 128 after it), as max abs error over max abs value.
The control is the same call with causal=True and window_size=(255, 0).

Run with python on a GPU fa4-jax supports (checked on an H200, sm_90). Exit status 1 when the
tangent with the window reading ahead is off by more than 10x the output's error (the bug shows),
0 otherwise.
"""
import sys

import jax
import jax.numpy as jnp
import numpy as np
import fa4_jax

LENGTHS = (700, 1348)
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128
SCALE = HEAD_DIM ** -0.5


def reference(q, k, v, causal, window):
    """Float32 dense attention of the packed tokens, sequence by sequence."""
    total = q.shape[0]
    seq = np.repeat(np.arange(len(LENGTHS)), LENGTHS)
    pos = np.concatenate([np.arange(n) for n in LENGTHS])
    same = seq[:, None] == seq[None, :]
    left, right = window
    mask = same & (pos[None, :] >= pos[:, None] - left) & (pos[None, :] <= pos[:, None] + right)
    if causal:
        mask &= pos[None, :] <= pos[:, None]
    group = HEADS // KV_HEADS
    k, v = jnp.repeat(k, group, axis=1), jnp.repeat(v, group, axis=1)
    hi = jax.lax.Precision.HIGHEST
    s = jnp.einsum("qhd,khd->hqk", q * SCALE, k, precision=hi)
    p = jax.nn.softmax(jnp.where(jnp.asarray(mask)[None], s, -1e30), axis=-1)
    assert total == mask.shape[0]
    return jnp.einsum("hqk,khd->qhd", p, v, precision=hi)


def compare(causal, window, inputs, tangents):
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(LENGTHS)]), jnp.int32)

    def kernel(q, k, v):
        return fa4_jax.flash_attn_varlen(q, k, v, cu, cu, causal=causal, window_size=window,
                                         scale=SCALE)

    out, tangent = jax.jit(lambda p, t: jax.jvp(kernel, p, t))(inputs, tangents)
    f32 = lambda xs: tuple(x.astype(jnp.float32) for x in xs)  # noqa: E731
    ref_out, ref_tangent = jax.jit(lambda p, t: jax.jvp(
        lambda q, k, v: reference(q, k, v, causal, window), p, t))(f32(inputs), f32(tangents))

    def rel(got, want):
        got, want = np.asarray(got, np.float32), np.asarray(want)
        return float(np.abs(got - want).max() / np.abs(want).max())
    return rel(out, ref_out), rel(tangent, ref_tangent)


def main():
    device = jax.devices()[0]
    print(f"fa4-jax {getattr(fa4_jax, '__version__', '?')}, jax {jax.__version__}, "
          f"{device.platform} ({device.device_kind})")
    total = sum(LENGTHS)
    keys = jax.random.split(jax.random.PRNGKey(0), 6)
    shapes = [(total, HEADS, HEAD_DIM), (total, KV_HEADS, HEAD_DIM), (total, KV_HEADS, HEAD_DIM)]
    inputs = tuple(jax.random.normal(key, s, jnp.float32).astype(jnp.bfloat16)
                   for key, s in zip(keys[:3], shapes))
    tangents = tuple(jax.random.normal(key, s, jnp.float32).astype(jnp.bfloat16)
                     for key, s in zip(keys[3:], shapes))
    results = {}
    for name, causal, window in (("window reading ahead", False, (255, 128)),
                                 ("control: causal window", True, (255, 0))):
        out_err, tangent_err = compare(causal, window, inputs, tangents)
        results[name] = (out_err, tangent_err)
        print(f"{name:24s} causal={causal!s:5s} window_size={window}: output error "
              f"{out_err:.3g}, tangent error {tangent_err:.3g} (max abs error / max abs value)")
    out_err, tangent_err = results["window reading ahead"]
    if not tangent_err <= 10 * max(out_err, 1e-3):
        print(f"FAILED: the output tangent with window_size=(255, 128) is off by {tangent_err:.3g} "
              f"of its largest value, its output by {out_err:.3g}")
        return 1
    print("PASSED: the output tangent matches the reference as closely as the output")
    return 0


if __name__ == "__main__":
    sys.exit(main())
