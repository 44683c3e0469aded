"""Progress of a long run: done/total, current kernel and case, elapsed time and estimate.
A live rich bar on a terminal; plain lines (one every few seconds) in CI logs and pipes."""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager


@contextmanager
def progress(total: int, label: str = "kernel x case"):
    if sys.stderr.isatty():
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), TimeRemainingColumn(), transient=True) as bar:
            task = bar.add_task(label, total=total)

            def step(what: str) -> None:
                bar.update(task, advance=1, description=what)
            yield step
        return

    start, last, done = time.monotonic(), 0.0, 0
    # At once: the first pair waits for its shape's programs to compile (a minute on a CPU).
    print(f"[0/{total}] starting: tracing and compiling the first programs", file=sys.stderr,
          flush=True)

    def step(what: str) -> None:
        nonlocal last, done
        done += 1
        now = time.monotonic()
        if now - last >= 5 or done == total:
            last = now
            elapsed = now - start
            # The first pairs wait for their programs to compile: an estimate from them says
            # nothing (it read 33,685 s for a 100-s run); shown from a tenth of the run on.
            eta = (f"eta {elapsed / done * (total - done):.0f}s" if done * 10 >= total
                   else "eta once a tenth has run")
            print(f"[{done}/{total}] {what}  elapsed {elapsed:.0f}s  {eta}",
                  file=sys.stderr, flush=True)
    yield step
