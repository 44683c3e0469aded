"""A CUDA graph capture broken by another thread of the worker: the pair runs again, once, in a
fresh worker.

On a program's first run XLA loads each cuDNN attention graph by capturing it into a CUDA
graph (cuda_dnn.cc: `graph.deserialize`, `cuda_graph_end_capture`). The capture is the
process's: what another thread of the worker does on the device meanwhile (a compile thread
autotuning the next programs, in a cold run) invalidates it. The run then fails with
"operation failed due to a previous error during capture", and so does every later pair of
that process until it dies (the H200's cold nightly at 55ad216: the pairs of two cases, then
SIGSEGV). That failure is the harness's, not the kernel's.

So a worker that finds one in a pair's records writes none of them, lists the pair in
RETRY_FILE and ends with CAPTURE_BROKEN; its controller (harness.engine.workers.run_group)
starts a fresh worker for the pairs left, that one among them, and tells it so (the spec's
`run_again`). A pair whose capture breaks again there keeps its records, error and all: what
happens twice is not left out. The report's header lists the pairs run again (`run_again`), and
the summary's first line counts them.

A worker killed by a signal just after XLA's autotuner, in a compile thread, logged a red
zone modified (the guard bytes around the buffers it times candidate kernels in,
`gpu_profiler.cc`: "Red zone modified") is taken as the same concurrency's doing, not proven
so: autotuning is a compile's, and a user's step compiles before it runs. The pair the run
was on runs again in a fresh worker (`died_autotuning`; the H200's cold nightly at 396cbf3
lost its worker so on `tokamax:cudnn`, a pair its warm run passed on the same machine). A
kernel that truly writes out of bounds now and then may so pass on its second run: the
header's run_again keeps the first death's reason. Each pair runs again once at most, for
either cause: what breaks it in the fresh worker stands as its error.
"""
from __future__ import annotations

MARKERS = ("previous error during capture", "cudaErrorStreamCaptureInvalidated",
           "cuda_graph_end_capture")
RETRY_FILE = "run_again.jsonl"
CAPTURE_BROKEN = 4      # the worker's exit status: a pair to run again, listed in RETRY_FILE


AUTOTUNER_MARKERS = ("Red zone modified",)


# How many of a dead worker's last stderr lines are searched (other compile threads may log
# XLA's timer warnings after the autotuner's line, before the signal lands).
AUTOTUNER_LINES = 20


def died_autotuning(returncode: int, tail: str | None) -> bool:
    """Whether a worker killed by a signal logged XLA's autotuner finding a red zone modified
    among its last AUTOTUNER_LINES lines of stderr."""
    last = [ln for ln in (tail or "").splitlines() if ln.strip()][-AUTOTUNER_LINES:]
    return returncode < 0 and any(m in ln for ln in last for m in AUTOTUNER_MARKERS)


def broke_capture(message: str | None) -> bool:
    """Whether a record's message says a CUDA graph capture broke."""
    return any(m in (message or "") for m in MARKERS)


class CaptureBroken(RuntimeError):
    """A pair's capture broke in this worker: it runs again in a fresh one."""
