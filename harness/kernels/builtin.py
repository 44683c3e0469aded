"""Built-in kernels, as `Kernel` declarations (harness.engine.registry collects them). GPU-only
libraries (cuDNN's jax module, Transformer Engine, MaxText, tokamax, the FlashAttention ports)
are imported inside the kernels, never here, so CPU CI needs none of them."""
from harness.kernels import (
                             flash_attn,
                             jax_nn,
                             maxtext_adapter,
                             maxtext_fixed,
                             op,
                             pallas,
                             reference,
                             sharded,
                             te,
                             te_flax,
                             tokamax_adapter,
)

BUILTIN = [*reference.KERNELS, *pallas.KERNELS, *op.KERNELS, *te.KERNELS,
           *maxtext_adapter.KERNELS, *maxtext_fixed.KERNELS, *tokamax_adapter.KERNELS,
           *flash_attn.KERNELS, *te_flax.KERNELS, *jax_nn.KERNELS, *sharded.KERNELS]
