"""One thread's time from a py-spy raw profile (`py-spy record --idle --threads --subprocesses
--format raw`): seconds inclusive and self per frame, most first.

    python scripts/pyspy_digest.py PROFILE PID THREAD [RATE] [TOP]

PID: the process (as py-spy names it: "process PID:..."), THREAD: a thread name (MainThread),
RATE: the sampling rate the profile was taken at (default 20), TOP: lines (default 60)."""
import collections
import sys


def digest(path: str, pid: str, thread: str, rate: float, top: int) -> str:
    inclusive, own, total = collections.Counter(), collections.Counter(), 0
    for line in open(path, encoding="utf-8", errors="replace"):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames, n = stack.split(";"), int(count)
        if not any(f.startswith(f"process {pid}:") for f in frames[:3]):
            continue
        at = next(i for i, f in enumerate(frames) if f.startswith("thread"))
        if thread not in frames[at]:
            continue
        total += n
        for frame in dict.fromkeys(frames[at + 1:]):
            inclusive[frame] += n
        own[frames[-1]] += n
    out = [f"process {pid}, thread {thread}: {total / rate:.1f} s sampled", "", "inclusive s:"]
    out += [f"{n / rate:8.1f}  {f[:150]}" for f, n in inclusive.most_common(top)]
    out += ["", "self s:"] + [f"{n / rate:8.1f}  {f[:150]}" for f, n in own.most_common(top // 2)]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    args = sys.argv[1:]
    if len(args) < 3:
        sys.exit(__doc__)
    print(digest(args[0], args[1], args[2], float(args[3]) if len(args) > 3 else 20.0,
                 int(args[4]) if len(args) > 4 else 60), end="")
