"""A user's mistake (a path, a name, a glob, a module, a baseline, a shape too big for the
device): one line that names the problem and the fix, caught before any work starts. The CLI
prints it and exits 2; the pytest plugin turns it into a usage error. Never a traceback."""
from __future__ import annotations

import asyncio
import contextlib
import os
import threading


class UsageError(Exception):
    pass


class BrokenContract(ValueError):
    """A kernel's result that breaks the harness's contract (its output's shape), found by the
    harness's own check: the kernel's error, and never a refusal of a feature, whatever the
    message names (it names the value's head dim)."""


def _pytest_outcomes() -> tuple:
    """pytest.skip, pytest.xfail, pytest.fail and pytest.importorskip raise these, which derive
    from BaseException; a kernel (or its module) calling one stopped, and said nothing the
    harness may take for a skip."""
    try:
        from _pytest.outcomes import OutcomeException
    except ImportError:   # no pytest: no kernel can raise them
        return ()
    return (OutcomeException,)


# What a kernel's code (or its module's, while imported) may raise: any error, a sys.exit() of
# its library (it ended the whole run, or its worker without a word, with status 0), asyncio's
# CancelledError (a BaseException: a library's event loop cancelled under the kernel had given
# the CLI a traceback), and pytest's outcomes. An error, never a skip; KeyboardInterrupt still
# stops the run.
USER_CODE_RAISED = (Exception, SystemExit, asyncio.CancelledError, *_pytest_outcomes())


def raised_at(exc: BaseException) -> str:
    """' (raised at FILE:LINE)': where a user's kernel raised its error, the innermost frame in
    a file of the user's own (not the harness's, jax's, Python's or an installed package's),
    for its error record: a kernel calling np.asarray on a traced array read as if the
    harness's oracle module had failed (the only place jax's message names). '' where there is
    none (a built-in adapter's or a library's error keeps its words as they were, the same on
    every machine; an error handed over from another process keeps no traceback). The path is
    relative to the working folder where it is under it, else the file's name."""
    import os
    import sysconfig
    import traceback
    if exc.__traceback__ is None:
        return ""
    import jax
    paths = sysconfig.get_paths()
    # Installed packages are left by their folder's name below (site- or dist-packages).
    skip = tuple(os.path.abspath(p) + os.sep for p in (
        os.path.dirname(os.path.abspath(__file__)),            # the harness package
        os.path.dirname(os.path.abspath(jax.__file__)), paths["stdlib"], paths["platstdlib"]))
    for frame in reversed(traceback.extract_tb(exc.__traceback__)):
        path = os.path.abspath(frame.filename)
        if frame.filename.startswith("<") or path.startswith(skip) or \
                f"{os.sep}site-packages{os.sep}" in path or f"{os.sep}dist-packages{os.sep}" in path:
            continue
        try:
            shown = os.path.relpath(path)
        except (ValueError, OSError):   # another drive, or no working folder any more
            shown = ".."
        if shown.startswith(".."):
            shown = os.path.basename(path)
        return f" (raised at {shown}:{frame.lineno})"
    return ""


def located(message: str, exc: BaseException) -> str:
    """`message` with raised_at(exc) at the end of its first line (the line every view shows)."""
    first, newline, rest = message.partition("\n")
    return first + raised_at(exc) + newline + rest


class ProcessExitCalled(RuntimeError):
    """A kernel's code called os._exit while the harness traced it: in the run's own process
    that would end the run with the kernel's status (0: a green exit, no report written)."""


_IN_KERNEL = threading.local()
_REAL_EXIT = None
# Off in the engine's worker processes: a worker ended by its kernel is the controller's to
# judge (the pair is blamed, run again alone where it may be another's: workers.py).
GUARD = {"exits": True}


def _guarded_exit(code):
    # A child the kernel forked keeps this thread's depth: its own exit is not the run's.
    if getattr(_IN_KERNEL, "depth", 0) and getattr(_IN_KERNEL, "pid", None) == os.getpid():
        raise ProcessExitCalled(f"the kernel called os._exit({code!r}), which would have ended "
                                f"the run's process with status {code!r}: an error of the "
                                "kernel")
    _REAL_EXIT(code)


@contextlib.contextmanager
def kernel_code():
    """While a kernel's own Python runs (traced, in this thread): os._exit there raises
    ProcessExitCalled, which the run records as the kernel's error (an in-process run, the
    CLI's or pytest's on CPUs, exited 0 with its report unwritten). Elsewhere, and in other
    threads (pytest-xdist's, the harness's own end), in a child the kernel forked, and in the
    engine's workers (GUARD), os._exit is as it was."""
    global _REAL_EXIT
    if not GUARD["exits"]:
        yield
        return
    if os._exit is not _guarded_exit:
        _REAL_EXIT, os._exit = os._exit, _guarded_exit
    _IN_KERNEL.depth = getattr(_IN_KERNEL, "depth", 0) + 1
    _IN_KERNEL.pid = os.getpid()
    try:
        yield
    finally:
        _IN_KERNEL.depth -= 1
