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

A worker killed by a signal while XLA compiled is taken as the harness's concurrency's doing,
not proven so: autotuning is a compile's, and a user's step compiles before it runs. That is a
worker whose last lines of stderr hold XLA's autotuner's words (the guard bytes around the
buffers it times candidate kernels in modified, `gpu_profiler.cc`: "Red zone modified"; its
timer's warning, `cuda_timer.cc`: "Delay kernel timed out"), or whose crashing thread was
compiling, beside the run or in the run's own thread (a kernel whose compile crashes XLA
every time so crashes again, and that stands), or whose other threads were compiling when it
crashed (the run's thread launching a program meanwhile). Workers dump every Python thread's
stack on a fatal signal (faulthandler, harness.engine.worker); `StderrTail` keeps, in place of
the dump, one line naming the crashing thread's innermost frames, where the dump names one (a
thread of XLA's or CUDA's own has no Python frames: faulthandler names none), and how many
other threads were compiling, and `death` gives it after the worker's own last line. The pair
the run was on runs again in a fresh worker (`died_compiling`; the H200's cold nightlies lost
a worker so at 396cbf3, on `tokamax:cudnn` after a red zone modified, a pair its warm run
passed on the same machine, and at 4bd381a, on `sut:cudnn_flash_jax`, after five timer
warnings and no red-zone line; at 9ade3fe, on `sut:cudnn_flash_jax:fallback`, SIGSEGV in the
run's thread launching the leak probe's build, its dump holding XLA's compile 16 times, the
pair then an error, which the first cold run on the same machine passed). Another thread
counts as compiling only inside XLA's compiler (`backend_compile_and_load`): a warm run loads
its programs from jax's cache and compiles next to none, so a crash there is the kernel's at
once. A kernel that truly
crashes now and then may so pass on its second run: the header's run_again keeps the first
death's reason. Each pair runs again once at most, for either cause: what breaks it in the
fresh worker stands as its error.
"""
from __future__ import annotations

import re
import signal

MARKERS = ("previous error during capture", "cudaErrorStreamCaptureInvalidated",
           "cuda_graph_end_capture")
RETRY_FILE = "run_again.jsonl"
CAPTURE_BROKEN = 4      # the worker's exit status: a pair to run again, listed in RETRY_FILE


AUTOTUNER_MARKERS = ("Red zone modified", "Delay kernel timed out")


# How many of a dead worker's last stderr lines are searched (other compile threads may log
# XLA's timer warnings after the autotuner's line, before the signal lands).
AUTOTUNER_LINES = 20

FATAL = "Fatal Python error:"     # faulthandler's dump begins so
CURRENT = "Current thread "       # and so the crashing thread's frames, innermost first
OTHER_THREAD = "Thread 0x"        # and so each other thread's
CRASHED = "the crashing thread "  # the line StderrTail adds: CRASHED + COMPILING, OTHER or NONE
COMPILING = "was compiling: "
OTHER = "was not compiling: "
NONE = "had no Python frames (a thread of XLA's or CUDA's own, or none named)"
BESIDE = "; compiling beside it: "   # then how many other threads the dump shows compiling
# A frame of any of these in the crashing thread's stack: it was compiling (jax's calls into
# XLA's compiler, and the harness's one entry to them).
COMPILE_FRAMES = {"backend_compile_and_load", "compile_or_get_cached", "compile_lowered"}
# A frame of this in another thread's stack: it was in XLA's compiler (a program read from
# jax's cache is loaded without it, as in a warm run).
BESIDE_FRAMES = {"backend_compile_and_load"}
SHOWN_FRAMES = 4
_FRAME = re.compile(r'\s*File "(?P<path>[^"]*)", line (?P<line>\d+|\?+) in (?P<name>\S+)')
# The dump's other lines (CPython 3.11 to 3.13; each thread's header is CURRENT or
# OTHER_THREAD): a thread with no frame or collecting garbage, the runtime's state, the
# extension modules loaded.
_DUMP = re.compile(r"(Stack \(most recent call first\)|"
                   r"\s+<no Python frame>|\s+Garbage-collecting|Python runtime state:|"
                   r"Extension modules:|\s+\.\.\.\s*$|\s*$)")
# What abseil prints after a fatal log line (XLA's "F... Check failed: ..."), before the abort:
# its stack, dozens of lines that would push that line out of the tail.
_CHECK_TRACE = re.compile(r"(\*\*\* Check failure stack trace: \*\*\*|\s+@\s+0x)")


def died_compiling(returncode: int, tail: str | None) -> bool:
    """Whether a worker killed by a signal logged XLA's autotuner's words among its last
    AUTOTUNER_LINES lines of stderr, or its crashing thread was compiling, or other threads
    of it were (StderrTail's line)."""
    if returncode >= 0:
        return False
    last = [ln for ln in (tail or "").splitlines() if ln.strip()][-AUTOTUNER_LINES:]
    return any(m in ln for ln in last for m in (*AUTOTUNER_MARKERS, CRASHED + COMPILING, BESIDE))


def death(returncode: int, tail: str) -> str:
    """Why a worker stopped, in one line: the signal or exit status, its last line of stderr
    (XLA's own last words, say, which tell an out-of-memory abort: harness.engine.memory), and
    where faulthandler dumped the threads' stacks, what StderrTail made of the crashing one."""
    if returncode < 0:
        try:
            name = signal.Signals(-returncode).name
        except ValueError:
            name = f"signal {-returncode}"
        how = f"killed by {name}"
    else:
        how = f"exited with status {returncode}"
    last = [ln for ln in tail.splitlines() if ln.strip()]
    own = [ln for ln in last if not ln.startswith(CRASHED)]
    crashed = [ln for ln in last if ln.startswith(CRASHED)]
    return how + (f": {own[-1][:300]}" if own else "") + (f"; {crashed[-1][:400]}"
                                                         if crashed else "")


class StderrTail:
    """What a worker's stderr leaves for the reason it died: its last `lines` lines (of at
    most `chars` characters in all), without faulthandler's dump of the threads' stacks (a
    fatal signal) and abseil's stack after a fatal log line; in the dump's place, as the last
    line, the crashing thread: whether it was compiling and its innermost frames (function,
    the file's last three path parts, line), or that it had none. Lines other threads log
    while the dump is written are kept. A later dump replaces an earlier one (a lowering
    process, which shares the stream, may die first; a worker that then dies without a dump,
    killed by SIGKILL, keeps that one's line)."""

    def __init__(self, lines: int = 40, chars: int = 1500):
        self._lines: list[str] = []
        self._keep, self._chars = lines, chars
        self._dumped = False        # a dump was seen
        self._current = False       # in its crashing thread's frames
        self._frames: list[tuple[str, str, str]] = []
        self._others: list[bool] = []   # the dump's other threads: each one compiling or not

    def add(self, line: str) -> None:
        if line.startswith(FATAL):
            self._dumped, self._current, self._frames, self._others = True, False, [], []
            return
        if self._dumped and line.startswith(OTHER_THREAD):
            self._current = False
            self._others.append(False)
            return
        if self._dumped and line.startswith(CURRENT):
            self._current = True
            return
        frame = _FRAME.match(line) if self._dumped else None
        if frame is not None:
            if self._current:
                path = "/".join(frame["path"].split("/")[-3:])
                self._frames.append((frame["name"], path, frame["line"]))
            elif self._others and frame["name"] in BESIDE_FRAMES:
                self._others[-1] = True
            return
        if self._dumped and _DUMP.match(line):
            # The crashing thread's frames end at the blank line after them (or the next
            # thread's header, above); a line saying it is collecting garbage comes before
            # its frames and is passed over.
            self._current = self._current and "Garbage-collecting" in line
            return
        if not _CHECK_TRACE.match(line):
            self._lines = (self._lines + [line])[-self._keep:]

    def text(self) -> str:
        text = "".join(self._lines)[-self._chars:]
        if not self._dumped:
            return text
        if self._frames:
            how = COMPILING if any(f[0] in COMPILE_FRAMES for f in self._frames) else OTHER
            how += " < ".join(f"{name} ({path}:{line})"
                              for name, path, line in self._frames[:SHOWN_FRAMES])
        else:
            how = NONE
        if any(self._others):
            how += f"{BESIDE}{sum(self._others)} thread(s)"
        head = text.rstrip("\n")
        return (f"{head}\n" if head else "") + f"{CRASHED}{how}\n"


def broke_capture(message: str | None) -> bool:
    """Whether a record's message says a CUDA graph capture broke."""
    return any(m in (message or "") for m in MARKERS)


def capture_excerpt(message: str, width: int = 300) -> str:
    """The part of a record's message that says its capture broke: `width` characters from a
    little before its first marker (a leak record's message names its finding first, and the
    broken run of its probe after it: its first 300 characters read as a leak)."""
    if len(message) <= width:
        return message
    at = min((i for m in MARKERS if (i := message.find(m)) >= 0), default=0)
    start = max(0, min(at - width // 3, len(message) - width))
    return ("..." if start else "") + message[start:start + width]


class CaptureBroken(RuntimeError):
    """A pair's capture broke in this worker: it runs again in a fresh one."""
