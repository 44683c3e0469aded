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

A worker killed while XLA's autotuner, in a compile thread, found a red zone modified (the
guard bytes around the buffers it times candidate kernels in, `gpu_profiler.cc`: "Red zone
modified") died of the same concurrency: autotuning is a compile's, and a user's step
compiles before it runs. The pair the run was on is blamed only if it dies so again in a
fresh worker (`died_autotuning`; the H200's cold nightly at 396cbf3 killed its worker on
`tokamax:cudnn`, a pair its warm run passed on the same machine).
"""
from __future__ import annotations

MARKERS = ("previous error during capture", "cudaErrorStreamCaptureInvalidated",
           "cuda_graph_end_capture")
RETRY_FILE = "run_again.jsonl"
CAPTURE_BROKEN = 4      # the worker's exit status: a pair to run again, listed in RETRY_FILE


AUTOTUNER_MARKERS = ("Red zone modified",)


def died_autotuning(why: str | None) -> bool:
    """Whether a worker's death (workers.death) names XLA's autotuner finding a red zone
    modified."""
    return any(m in (why or "") for m in AUTOTUNER_MARKERS)


def broke_capture(message: str | None) -> bool:
    """Whether a record's message says a CUDA graph capture broke."""
    return any(m in (message or "") for m in MARKERS)


class CaptureBroken(RuntimeError):
    """A pair's capture broke in this worker: it runs again in a fresh one."""
