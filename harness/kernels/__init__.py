"""Built-in kernels, as `Kernel` declarations (harness.registry collects them). GPU-only
libraries (cuDNN's jax module, Transformer Engine, MaxText) are imported inside the kernels,
never here, so CPU CI needs none of them."""
from harness.kernels import maxtext_adapter, pallas, reference, sut, te

BUILTIN = [*reference.KERNELS, *pallas.KERNELS, *sut.KERNELS, *te.KERNELS,
           *maxtext_adapter.KERNELS]
