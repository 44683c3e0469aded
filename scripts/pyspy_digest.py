"""One thread's time from a py-spy raw profile (`py-spy record --idle --threads --subprocesses
--format raw`): seconds inclusive and self per frame, most first; or, with --under FRAME, the
seconds spent under FRAME (a frame's text, e.g. backend_compile_and_load) by the harness code
that called it (its three nearest harness frames).

    python scripts/pyspy_digest.py PROFILE PID THREAD [RATE] [TOP] [--under FRAME]

PID: the process (as py-spy names it: "process PID:..."), THREAD: a thread name (MainThread),
RATE: the sampling rate the profile was taken at (default 20), TOP: lines (default 60)."""
import argparse
import collections


def _stacks(path: str, pid: str, thread: str):
    """(the thread's frame and those below it, samples) of the thread's stacks."""
    for line in open(path, encoding="utf-8", errors="replace"):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames, n = stack.split(";"), int(count)
        at = next((i for i, f in enumerate(frames) if f.startswith("thread")), None)
        if at is None:
            continue
        # The thread's own process is the last one named before it (a worker's lowering
        # process is named after the worker and its parents).
        owner = [f for f in frames[:at] if f.startswith("process ")]
        if not owner or not owner[-1].startswith(f"process {pid}:"):
            continue
        if thread in frames[at]:
            yield frames[at:], n


def digest(path: str, pid: str, thread: str, rate: float, top: int) -> str:
    inclusive, own, total = collections.Counter(), collections.Counter(), 0
    for frames, n in _stacks(path, pid, thread):
        total += n
        for frame in dict.fromkeys(frames[1:]):
            inclusive[frame] += n
        own[frames[-1]] += n
    out = [f"process {pid}, thread {thread}: {total / rate:.1f} s sampled", "", "inclusive s:"]
    out += [f"{n / rate:8.1f}  {f[:150]}" for f, n in inclusive.most_common(top)]
    out += ["", "self s:"] + [f"{n / rate:8.1f}  {f[:150]}" for f, n in own.most_common(top // 2)]
    return "\n".join(out) + "\n"


def _short(frame: str) -> str:   # "probe (harness/judge/leak_probe.py:465)" -> "probe:465"
    return frame.split(" (")[0] + ":" + frame.rsplit(":", 1)[-1].rstrip(")")


def under(path: str, pid: str, thread: str, rate: float, top: int, target: str) -> str:
    callers, total = collections.Counter(), 0
    for frames, n in _stacks(path, pid, thread):
        at = next((i for i, f in enumerate(frames) if target in f), None)
        if at is None:
            continue
        total += n
        ours = [f for f in frames[:at] if "harness/" in f][-3:][::-1]
        callers[" < ".join(_short(f) for f in ours) or "(no harness frame)"] += n
    out = [f"process {pid}, thread {thread}: {total / rate:.1f} s under {target!r}, by the "
           "harness code that called it (nearest first):", ""]
    out += [f"{n / rate:8.1f}  {c}" for c, n in callers.most_common(top)]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile")
    parser.add_argument("pid")
    parser.add_argument("thread")
    parser.add_argument("rate", nargs="?", type=float, default=20.0)
    parser.add_argument("top", nargs="?", type=int, default=60)
    parser.add_argument("--under", metavar="FRAME", help="a frame's text")
    a = parser.parse_intermixed_args()
    print(under(a.profile, a.pid, a.thread, a.rate, a.top, a.under) if a.under
          else digest(a.profile, a.pid, a.thread, a.rate, a.top), end="")
