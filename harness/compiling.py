"""Compiling a lowered program, tried again where the host could not start the compiler.

XLA's GPU compiler runs ptxas in a subprocess. On a host compiling on every core in several
processes (a cold nightly), starting it can fail: `INTERNAL: Failed to launch ptxas`. On the
H200 one such compile of `sut:cudnn_flash_te` at one shape errored six cases of a cold nightly
that passed in the warm run after it (reports/nightly-h200-8d4d95e/). That failure is the
host's, not the kernel's, and says nothing about the kernel's numbers: the compile is tried
again, up to ATTEMPTS attempts in all, after a pause; each retry is said on stderr (naming the
program where its caller does), and each compile that needed one is counted (`retried`: a
run's header keeps the count beside the compilation cache's hits and misses; the pauses count
in the compile's seconds). Any other error raises at once; a compile that still fails raises
its last error. Compiles through plain jax.jit (a harness program not compiled ahead, the
oracle outside a run) are not retried.
"""
from __future__ import annotations

import sys
import threading
import time

# What XLA says when it could not start the subprocess (xla/stream_executor/cuda/
# subprocess_compilation.cc); nothing else is retried.
HOST_FAILURES = ("Failed to launch ptxas",)
ATTEMPTS = 3
PAUSES_S = (2.0, 10.0)   # before the second and the third attempt

_lock = threading.Lock()
_retried = 0


def host_failure(exc: BaseException) -> bool:
    """`exc` says the host could not start the compiler (not that the program is wrong)."""
    return any(text in str(exc) for text in HOST_FAILURES)


def compile_lowered(lowered, options: dict | None = None, *, what: str = "",
                    sleep=time.sleep):
    """`lowered.compile(...)`; a host failure (HOST_FAILURES) is tried again. `what`: the
    program, for the line on stderr."""
    global _retried
    for attempt in range(ATTEMPTS):
        try:
            return lowered.compile(compiler_options=options) if options else lowered.compile()
        except Exception as exc:
            if attempt + 1 == ATTEMPTS or not host_failure(exc):
                raise
            pause = PAUSES_S[min(attempt, len(PAUSES_S) - 1)]
            if attempt == 0:
                with _lock:
                    _retried += 1
            print(f"harness: compiling {what or 'a program'} failed on the host "
                  f"({str(exc).strip()[:120]}); trying it again in {pause:.0f} s "
                  f"(attempt {attempt + 2} of {ATTEMPTS})",
                  file=sys.stderr, flush=True)
            sleep(pause)
    raise AssertionError("unreachable")


def retried() -> int:
    """How many compiles this process tried again after a host failure (each once, however
    many attempts it took)."""
    return _retried
