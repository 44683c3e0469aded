"""Writing one run's report folder as the run goes: the header first (state "running"), each
kernel x case's records and traces appended as they finish, the header's last facts at the end
(state "finished" or "interrupted"). A run killed hard (SIGKILL, out of memory, a CI timeout)
leaves state "running", and every view says the report is incomplete.

One run writes a folder at a time: the writer holds an exclusive lock on `DIR/.lock` while the
run lives (the kernel releases it with the process, however it ends); a second run on the same
folder is a UsageError naming the run that holds it.
"""
from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path

from harness.errors import UsageError
from harness.judge.vocabulary import FINISHED, INTERRUPTED, RUNNING  # noqa: F401 (theirs)
from harness.store import report_file as rec

LOCK_FILE = ".lock"


class FolderLock:
    """An exclusive lock on a report folder for this process's run."""

    def __init__(self, report_dir: str | Path, option: str = "--report-dir"):
        self.dir = Path(report_dir)
        self.option = option      # how the user named the folder, for the error
        self._fd: int | None = None

    def acquire(self) -> FolderLock:
        self.dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 64).decode(errors="replace").strip() or "another process"
            os.close(fd)
            raise UsageError(f"{self.option} {self.dir}: another run (pid {holder}) is writing "
                             "this report folder; wait for it, or give another folder") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd = fd
        return self

    def __enter__(self) -> FolderLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None


def check_not_being_written(folder: str | Path, option: str) -> None:
    """A UsageError where a run holds the lock of `folder` (a report folder: one with a lock
    file; no lock file is made where there is none)."""
    if (Path(folder) / LOCK_FILE).exists():
        FolderLock(folder, option).acquire().release()


# The views a run writes at its end (harness.views.report_dir).
VIEWS = (rec.SUMMARY_FILE, rec.HTML_FILE)


def begin(report_dir: Path, environment: dict, **run_info) -> None:
    """A run's report begun: its header (state running), no traces yet, and no views: an
    earlier run's in the folder would stand beside this one's records if it were killed
    (pytest ended by SIGTERM left a running header under an earlier run's green summary)."""
    report_dir = Path(report_dir)
    report_dir.mkdir(parents=True, exist_ok=True)
    for name in VIEWS:
        (report_dir / name).unlink(missing_ok=True)
    rec.write_header(report_dir / rec.RECORDS_FILE, environment, state=RUNNING, **run_info)
    (report_dir / rec.TRACES_FILE).write_text("")


class ReportWriter:
    """The folder's report.jsonl and traces.jsonl, written as the run goes."""

    def __init__(self, report_dir: Path, environment: dict, **run_info):
        self.dir = Path(report_dir)
        self.start = time.monotonic()
        begin(self.dir, environment, **run_info)

    def add(self, result) -> None:
        rec.append(self.dir / rec.RECORDS_FILE, result.records)
        rec.append(self.dir / rec.TRACES_FILE, result.traces, kind="trace")

    def close(self, state: str = FINISHED, **facts) -> None:
        """The header's last facts (wall time, timing, ...) and the run's end state."""
        rec.update_header(self.dir / rec.RECORDS_FILE, state=state,
                          wall_s=round(time.monotonic() - self.start, 1), **facts)
