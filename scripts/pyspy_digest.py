"""One thread's time from a py-spy raw profile (`py-spy record --idle --threads --subprocesses
--format raw`): seconds inclusive and self per frame, most first; or, with --under FRAME, the
seconds spent under FRAME (a frame's text, e.g. backend_compile_and_load) by the harness code
that called it (its three nearest harness frames).

    python scripts/pyspy_digest.py PROFILE PID THREAD [RATE] [TOP] [--under FRAME]

PID: the process (as py-spy names it: "process PID:..."), THREAD: a thread name (MainThread),
RATE: the sampling rate the profile was taken at (default 20), TOP: lines (default 60).

    python scripts/pyspy_digest.py PROFILE --busy [RATE] [TOP]

--busy: every process's threads (numbered threads of a pool as one: compile_0..15 as
"compile") by the seconds they were sampled at work, most first: not waiting (a sample whose
innermost frame is one of IDLE) and not a thread with no Python frame (an interpreter's
teardown shows as the MainThread's samples with none: counted apart, as "no Python frame")."""
import argparse
import collections


def _samples(path: str):
    """(the thread's process frame or None, the thread's frame and those below it, samples)
    of each stack in the profile that names a thread."""
    for line in open(path, encoding="utf-8", errors="replace"):
        stack, _, count = line.rstrip("\n").rpartition(" ")
        frames, n = stack.split(";"), int(count)
        at = next((i for i, f in enumerate(frames) if f.startswith("thread")), None)
        if at is None:
            continue
        # The thread's own process is the last one named before it (a worker's lowering
        # process is named after the worker and its parents).
        owner = [f for f in frames[:at] if f.startswith("process ")]
        yield (owner[-1] if owner else None), frames[at:], n


def _stacks(path: str, pid: str, thread: str):
    """(the thread's frame and those below it, samples) of the thread's stacks."""
    for owner, frames, n in _samples(path):
        if owner is not None and owner.startswith(f"process {pid}:") and thread in frames[0]:
            yield frames, n


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


# Innermost frames of a thread that waits (a lock, a queue, a pipe, a sleep; the harness's
# own threads that send, receive and stream, blocked in a C call under these frames), by the
# function's name as py-spy writes it, and the file's path where the name alone is common.
IDLE = {"Condition.wait", "SimpleQueue.get", "Queue.get", "Connection._recv", "Event.wait",
        "Thread._wait_for_tstate_lock", "_wait_for_tstate_lock", "select", "sleep", "poll",
        "LoweringProcess._send_all", "_serve.<locals>.send_all", "_stream"}
IDLE_IN = {("_worker", "concurrent/futures/thread.py"), ("select", "selectors.py")}


def _idle(frame: str) -> bool:
    name, _, where = frame.partition(" (")
    return name in IDLE or any(name == n and path in where for n, path in IDLE_IN)


def _process(frame: str) -> str:
    """'process 2507:"python3 -m harness.engine.worker /tmp/.../spec.json"' -> 'process 2507
    harness.engine.worker ...spec.json' (its module and last argument)."""
    pid, _, command = frame.partition(":")
    words = command.strip('"').split()
    module = next((w for w in words if w.startswith("harness")), "")
    return " ".join([pid, module, words[-1][-40:] if words else ""]).strip()


def busy(path: str, rate: float, top: int) -> str:
    at_work, idle_frameless = collections.Counter(), collections.Counter()
    for owner, frames, n in _samples(path):
        process = _process(owner) if owner is not None else "?"
        thread = frames[0].rsplit(": ", 1)[-1].rstrip("_0123456789")
        if len(frames) == 1:
            idle_frameless[(process, thread + " (no Python frame)")] += n
        elif not _idle(frames[-1]):
            at_work[(process, thread)] += n
    rows = (at_work + idle_frameless).most_common(top)
    return "".join(f"{n / rate:8.1f}  {p}  {t}\n" for (p, t), n in rows)


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


def _main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="%(prog)s PROFILE PID THREAD [RATE] [TOP] [--under FRAME]\n"
              "       %(prog)s PROFILE --busy [RATE] [TOP]")
    parser.add_argument("profile")
    parser.add_argument("--busy", action="store_true", help="every thread's time at work")
    parser.add_argument("--under", metavar="FRAME", help="a frame's text")
    a, rest = parser.parse_known_intermixed_args()
    if a.busy:
        if a.under is not None:
            parser.error("--busy and --under: choose one")
        if len(rest) > 2:
            parser.error(f"--busy takes RATE and TOP at most, not {' '.join(rest)}")
        try:
            rate, top = float(rest[0]) if rest else 20.0, int(rest[1]) if len(rest) > 1 else 60
        except ValueError:
            parser.error(f"--busy: RATE and TOP are numbers, not {' '.join(rest)}")
        print(busy(a.profile, rate, top), end="")
        return
    parser.add_argument("pid")
    parser.add_argument("thread")
    parser.add_argument("rate", nargs="?", type=float, default=20.0)
    parser.add_argument("top", nargs="?", type=int, default=60)
    a = parser.parse_intermixed_args()
    print(under(a.profile, a.pid, a.thread, a.rate, a.top, a.under) if a.under
          else digest(a.profile, a.pid, a.thread, a.rate, a.top), end="")


if __name__ == "__main__":
    _main()
