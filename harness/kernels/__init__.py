"""Built-in kernels. Importing this package registers them; GPU-only libraries are imported
inside the kernels' functions, never here, so CPU CI needs none of them."""
from harness.kernels import pallas, reference  # noqa: F401
