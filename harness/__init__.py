"""A differential, per-segment correctness harness for packed-sequence attention kernels."""
from harness.engine.registry import load_kernel_module, register_kernel, select_kernels
from harness.errors import UsageError
from harness.kernels.kernel import Kernel, Platform
from harness.model.case import Case, make_inputs
from harness.model.layouts import LAYOUTS, SegmentIdError, check_segment_ids

__all__ = [
           "LAYOUTS",
           "Case",
           "Kernel",
           "Platform",
           "SegmentIdError",
           "UsageError",
           "check_segment_ids",
           "load_kernel_module",
           "make_inputs",
           "register_kernel",
           "select_kernels",
]
