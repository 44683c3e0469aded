"""An outside kernel, plugged in by path:

    python -m harness run --kernel-module examples/my_kernel.py --kernels my_attention
    pytest cases/test_matrix.py --kernel-module examples/my_kernel.py --kernels my_attention

The function takes MaxText-layout arrays [batch, seq, heads, head_dim] and int32 segment ids
[batch, seq] (1..M per row, 0 = padding) and returns the output shaped like the query.
"""
import jax
import jax.numpy as jnp

import harness


def my_attention(query, key, value, segment_ids, *, causal, scale):
    heads = query.shape[2]
    key = jnp.repeat(key, heads // key.shape[2], axis=2)
    value = jnp.repeat(value, heads // value.shape[2], axis=2)
    logits = jnp.einsum("bqhd,bkhd->bhqk", query, key, preferred_element_type=jnp.float32) * scale
    mask = segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    if causal:
        t = query.shape[1]
        mask &= jnp.tril(jnp.ones((t, t), bool))
    probs = jax.nn.softmax(jnp.where(mask, logits, -1e30), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", probs.astype(value.dtype), value)


harness.register_kernel(
    "my_attention", my_attention,
    dtypes=("float32", "bfloat16"),   # what it supports; other cases are skipped with the reason
    padding_anywhere=True,            # padding between segments too (not only after the last)
    description="example outside kernel: einsum attention with a segment mask")
