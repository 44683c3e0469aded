"""Built-in kernels, as `Kernel` declarations (harness.engine.registry collects them). GPU-only
libraries (cuDNN's jax module, Transformer Engine, MaxText) are imported inside the kernels,
never here, so CPU CI needs none of them."""
from harness.kernels import maxtext_adapter, maxtext_fixed, op, pallas, reference, te

BUILTIN = [*reference.KERNELS, *pallas.KERNELS, *op.KERNELS, *te.KERNELS,
           *maxtext_adapter.KERNELS, *maxtext_fixed.KERNELS]
