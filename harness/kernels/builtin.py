"""Built-in kernels, as `Kernel` declarations (harness.engine.registry collects them). GPU-only
libraries (cuDNN's jax module, Transformer Engine, MaxText, tokamax, the FlashAttention ports,
dew-flash-attn, fa4-jax) are imported inside the kernels, never here, so CPU CI needs none of
them."""
from harness.kernels import (
                             dew_flash_attn,
                             fa4,
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
                             tokamax17,
                             tokamax_adapter,
)

BUILTIN = [*reference.KERNELS, *pallas.KERNELS, *op.KERNELS, *te.KERNELS,
           *maxtext_adapter.KERNELS, *maxtext_fixed.KERNELS, *tokamax_adapter.KERNELS,
           *flash_attn.KERNELS, *dew_flash_attn.KERNELS, *fa4.KERNELS, *tokamax17.KERNELS,
           *te_flax.KERNELS, *jax_nn.KERNELS, *sharded.KERNELS]
