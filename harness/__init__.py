"""A differential, per-segment correctness harness for packed-sequence attention kernels."""
from harness.model.case import Case, make_inputs
from harness.errors import UsageError
from harness.engine.kernel import Kernel, Platform
from harness.model.layouts import LAYOUTS, SegmentIdError, check_segment_ids
from harness.engine.registry import load_kernel_module, register_kernel, select_kernels

__all__ = ["Case", "Kernel", "LAYOUTS", "Platform", "SegmentIdError", "UsageError",
           "check_segment_ids", "load_kernel_module", "make_inputs", "register_kernel",
           "select_kernels"]
