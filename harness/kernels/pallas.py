"""Pallas flash attention (jax.experimental.pallas.ops.gpu.attention.mha) with segment ids:
Triton on the GPU, the Pallas interpreter on the CPU."""
from __future__ import annotations

import jax

from harness.kernels.kernel import Kernel


def pallas_mha(query, key, value, segment_ids, *, causal, scale):
    from jax.experimental.pallas.ops.gpu import (
        attention,  # deprecated upstream; import late
    )

    interpret = jax.devices()[0].platform != "gpu"
    return attention.mha(query, key, value, segment_ids, sm_scale=scale, causal=causal,
                         interpret=interpret)


KERNELS = [
    Kernel(
        "pallas_mha", pallas_mha,
        # The kernel tiles the sequence in blocks of min(128, T), with no ragged tail, and has
        # no grouped kv heads. Its mask compares segment ids, so padding may sit anywhere.
        gqa=False, seq_len_multiple=128, padding_anywhere=True,
        requires=("jax.experimental.pallas",),
        description="Pallas mha with segment_ids (Triton on GPU, interpreter on CPU)"),
]
