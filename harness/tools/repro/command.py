"""`python -m harness repro KERNEL CASE_ID`: find the failing check, shrink the case, write the
script, and check that it reproduces the failure with plain python in an empty folder."""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness
from harness.errors import UsageError
from harness.judge.vocabulary import CHECKS, JVP
from harness.model.case import Case
from harness.tools.repro.script import FAILED_MARK, script_text, writer
from harness.tools.repro.shrink import as_custom, shrink
from harness.tools.repro.source import kernel_source
from harness.tools.repro.trials import (
    MAX_RUNS,
    Trial,
    Trials,
    target_check,
)

# The folder that holds the `harness` package: on the script's path when the kernel is harness
# code.
REPO_ROOT = Path(harness.__file__).resolve().parent.parent
VERIFY_TIMEOUT_S = 600


def verify(path: Path, needs_harness: bool) -> tuple[int | None, str]:
    """Runs the script with plain python in an empty folder; (exit status, output). The
    environment's PYTHONPATH loses every entry that holds this harness, unless the kernel itself
    is harness code."""
    env = dict(os.environ)
    # The process that writes the script may hold most of a GPU's memory (jax takes 75% when
    # it starts): the script takes what it needs, not a share of what is left (on the H200 two
    # census scripts ran out of memory beside their census and exited 0).
    if not any(n in env for n in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                                  "XLA_PYTHON_CLIENT_ALLOCATOR")):
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    entries = [p for p in entries if not (Path(p) / "harness" / "__init__.py").is_file()]
    if needs_harness:
        entries.insert(0, str(REPO_ROOT))
    if entries:
        env["PYTHONPATH"] = os.pathsep.join(entries)
    else:
        env.pop("PYTHONPATH", None)
    with tempfile.TemporaryDirectory(prefix="repro-check-") as cwd:
        try:
            done = subprocess.run([sys.executable, str(path.resolve())], cwd=cwd, env=env,
                                  capture_output=True, text=True, timeout=VERIFY_TIMEOUT_S)
        except subprocess.TimeoutExpired as exc:
            out = (exc.stdout or "") if isinstance(exc.stdout, str) else ""
            return None, out + f"\n(timed out after {VERIFY_TIMEOUT_S} s)"
    return done.returncode, done.stdout + done.stderr


def reproduced(code: int | None, output: str) -> bool:
    """Whether the script's run showed the failure: exit status 1 and its FAILED line."""
    return code == 1 and any(line.startswith(FAILED_MARK) for line in output.splitlines())


def default_output(kernel_name: str) -> str:
    return "repro_" + kernel_name.replace(":", "_").replace("/", "_") + ".py"


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _original_case(case_id: str) -> Case:
    try:
        original = Case.from_id(case_id)
        original.segments  # noqa: B018  (a layout that cannot make this shape raises here)
    except ValueError as exc:
        raise UsageError(f"case {case_id!r}: {exc}") from None
    return original


def _find_and_shrink(trials: Trials, original: Case, check: str | None) -> tuple[Trial, str]:
    """(the shrunk trial, the check it fails): the failing check on the original case, then
    the same case as custom rows, shrunk."""
    first = target_check(trials, original, check)
    check = trials.check
    _log(f"{trials.kernel.name} fails {check} on {original.id}; shrinking")
    # The same case as custom rows (the same inputs: they depend on shape, seed and ids).
    start_case = as_custom(original)
    start = trials.fails(start_case, check) if start_case is not None else None
    if start is None:
        start = first  # a layout's case the custom form does not reproduce: start there
    return shrink(trials, start, check, _log), check


def _summary(original: Case, shrunk: Trial, check: str, runs: int, elapsed: float,
             output: Path) -> None:
    worst = shrunk.failing(check)[0]
    label = f"r{worst.row}s{worst.segment}"
    stop = worst.start + worst.length - 1
    print(f"original case: {original.id}")
    print(f"shrunk case:   {shrunk.case.id}  ({runs} kernel runs, {elapsed:.1f} s)")
    print(f"failing:       check {check}, segment {label} (row {worst.row}, tokens "
          f"{worst.start}..{stop}): {writer(check).numbers(worst)}")
    print(f"script:        {output}")


def main(kernel_name: str, case_id: str, check: str | None = None, output: str | None = None,
         max_runs: int | None = None) -> int:
    """Shrinks `case_id`'s failure of `kernel_name` (on `check`, or the first failing one)
    and writes the script to `output`; `max_runs` kernel runs at most (the census spends
    fewer)."""
    from harness.engine.environment import current_platform
    from harness.engine.programs import Programs
    from harness.engine.registry import select_kernels

    kernel = select_kernels([kernel_name])[0]
    original = _original_case(case_id)
    if check is not None and check not in CHECKS:
        raise UsageError(f"--check {check}: unknown check; known: {', '.join(CHECKS)}")
    if check == JVP.name:
        raise UsageError(f"--check {check}: repro writes no script for the forward-mode check "
                         "yet (its records name the case, segment and worst token)")
    kernel_source(kernel)  # refuse a kernel the script could not load, before any work
    output = Path(output or default_output(kernel.name))

    start = time.perf_counter()
    programs = Programs()
    try:
        # A caller may spend fewer kernel runs (the census: one budget per kernel).
        trials = Trials(kernel, current_platform(), programs,
                        max_runs=max_runs or MAX_RUNS)
        shrunk, check = _find_and_shrink(trials, original, check)
    finally:
        programs.close()
    elapsed = time.perf_counter() - start
    text, needs_harness = script_text(kernel, original, shrunk, check, trials.runs, output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(text)
    _summary(original, shrunk, check, trials.runs, elapsed, output)
    code, out = verify(output, needs_harness)
    if reproduced(code, out):
        print(f"checked:       `python {output}` exits 1 (the failure shows)")
        return 0
    print(f"warning: `python {output}` did not reproduce the failure (exit status {code}):",
          file=sys.stderr)
    print("\n".join(out.rstrip().splitlines()[-20:]), file=sys.stderr)
    return 1
