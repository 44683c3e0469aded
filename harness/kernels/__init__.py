"""Built-in kernels. Importing this package registers them; GPU-only libraries (cuDNN's jax
module at call time, Transformer Engine) are imported inside the kernels, never here, so CPU CI
needs none of them."""
from harness.kernels import maxtext_adapter, pallas, reference, sut, te  # noqa: F401
