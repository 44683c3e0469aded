"""Built-in kernels, as `Kernel` declarations (harness.engine.registry collects them). GPU-only
libraries (cuDNN's jax module, Transformer Engine, MaxText) are imported inside the kernels,
never here, so CPU CI needs none of them."""
from harness.kernels import maxtext_adapter, op, pallas, reference, sharded, te

BUILTIN = [*reference.KERNELS, *pallas.KERNELS, *op.KERNELS, *te.KERNELS,
           *maxtext_adapter.KERNELS, *sharded.KERNELS]
