"""A feature refused while a kernel's program was traced (harness.judge.judging.refused_feature):
by the whole path, or by its backward pass alone.

A kernel's default program traces its forward and backward passes as one (jax.vjp), so a
backward that refused a window hid a forward that dropped it: a cold review's mutant, whose
forward ignored the window and whose backward raised "sliding window is not supported", read
`refused` and pytest passed it, while a forward-only user got the window silently dropped.
Where the default program refused a feature, the kernel's forward is traced and judged alone:
a forward that refuses too makes the whole pair refused; one that computes is judged as any
forward is (its output, padding, leak probe, jvp), and its gradient checks are the refused ones.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from harness.judge import judging
from harness.judge import vocabulary as v
from harness.judge.record import Record

GRADIENTS = frozenset(c.name for c in (*v.TENSORS[1:], v.DSINKS))
IN_BACKWARD = "in its backward pass while tracing (the forward computed and was judged alone)"


def judged(kernel, case, feature: str, message: str, run: Callable) -> tuple[list[Record], list]:
    """(records, traces) of a pair whose default program refused `feature` with `message`.
    `run(kernel)`: the pair's checks for a kernel (harness.engine.runner.run_kernel_case)."""
    whole = [judging.refused_record(kernel, case, feature, message)]
    # A crash the kernel declares, met: the pair reads as before (its forward alone would not
    # raise it, and the declaration would read missed).
    if not kernel.backward or judging.declared_crash(kernel, case, message):
        return whole, []
    result = run(kernel.forward_only())   # the markers its forward holds (backward_markers)
    if any(r.outcome == v.REFUSED and r.check == v.KERNEL_LEVEL for r in result.records):
        return whole, []    # the forward refused too: the whole path did
    # The gradient checks the forward-only kernel skipped ("declares no backward") are the
    # refused ones; an error of the forward stays its error.
    return [judging.refused_record(kernel, case, feature, message, check=r.check,
                                   where=IN_BACKWARD)
            if r.verdict == v.SKIP and r.check in GRADIENTS else r
            for r in result.records], result.traces


def gradients_refused(records: Iterable[Record]) -> bool:
    """Whether a pair's gradient checks were refused, its forward judged alone (judged): a
    reproducer then runs the forward alone too."""
    return any(r.outcome == v.REFUSED and r.check in GRADIENTS for r in records)
