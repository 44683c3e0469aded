"""Kernels whose libraries cannot share a process run in worker processes of their own.

A kernel declares a process group (`Kernel.isolation`): flash-attn-jax and flash-attn3-jax
register FFI targets of the same names, so whichever is imported second fails; a library may
also crash its process. When a run selects kernels of more than one group (kernels without a
group form one group of their own), the engine becomes a controller that never touches a device
itself: each group runs in a worker (`python -m harness.engine.worker SPEC.json`: the run's
options and the worker's pairs as JSON, harness.engine.worker), several at a time, sharing
the device (`start_groups`, `shares`: the kernels without a group keep XLA's default 75% of a
GPU's memory, the other groups take turns beside them with what they need of the rest; with
--main-workers on GPUs the kernels without a group run in parts that share those 75%,
harness.engine.main_parts), or one after another with the whole device where the user chose
jax's memory settings themselves (`user_set_memory`). A worker appends its records as it goes
and says which pair it starts. A worker that dies (a crash, a clash at import) costs one error
record, for the pair it was running, with the reason (one killed while XLA compiled runs the
pair again first: harness.engine.capture); a fresh worker takes the group's remaining pairs.
The controller joins the workers' reports into one (harness.store.merge.merge_reports).

pytest uses the same workers: a test whose kernel's group clashes with one already loaded in
its process runs its pair in a worker (run_pair_in_worker).
"""
from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.engine.capture import RETRY_FILE, StderrTail, death, died_compiling
from harness.engine.device_shares import at_once, share, shares, user_set_memory
from harness.engine.main_parts import DEFERRED, DEFERRED_FILE, is_part, with_parts
from harness.engine.memory import memory_bound
from harness.judge.vocabulary import UNBLAMED_FIELD
from harness.store import report_file as rec

STARTED_FILE = "started.jsonl"
FINISHED_FILE = "finished.jsonl"   # pairs whose records are all written (harness.engine.lanes)
_LOADED: set[str] = set()     # isolation groups whose kernels ran in this process
LIVE: set = set()              # worker processes running now (stopped with their run)
_LIVE_LOCK = threading.Lock()   # starting a worker and stopping them all exclude each other


# A worker's exit status when it was interrupted (SIGINT or SIGTERM as a signal, or Python's
# exit 130 or 143): `timeout` signals the whole process group, and a group's thread may see its
# worker gone before the run is marked stopping (the H200's first try at 0cfdd4f blamed a pair).
INTERRUPTED = (-signal.SIGINT, 130, -signal.SIGTERM, 143)   # SIGTERM: `timeout`, a CI cancel


class Stopped(Exception):
    """The run was stopped: no worker starts any more. `result`: what the group's workers had
    done by then (run_group), where known."""

    def __init__(self, result: WorkerResult | None = None):
        super().__init__()
        self.result = result


def groups(kernels) -> dict[str | None, list]:
    """Kernels by process group (None: no group), in selection order. A kernel whose library is
    not installed loads nothing (it skips every case): it needs no worker of its own."""
    import importlib.util
    out: dict[str | None, list] = {}
    for k in kernels:
        installed = all(importlib.util.find_spec(m.split(".")[0]) is not None for m in k.requires)
        out.setdefault(k.isolation if installed else None, []).append(k)
    return out


# XLA records a program's kernels into CUDA graphs (command buffers) as it runs them. A capture
# is invalidated by what any thread does on the same device meanwhile: on the H200 a cold
# nightly's compile threads (loading and autotuning the next programs beside the run) broke
# the run thread's captures (cudaErrorStreamCaptureInvalidated, "operation failed due to a
# previous error during capture", nightly at 3d22ac7), and 11 pairs of three cases erred
# before that worker died. The workers run without command buffers: the same kernels, launched
# one by one instead of as a graph. A user who set the flag keeps their setting.
NO_COMMAND_BUFFERS = "--xla_gpu_enable_command_buffer="


def worker_environment(env: dict) -> dict:
    """The workers' environment: `env` with command buffers off (NO_COMMAND_BUFFERS), unless
    its XLA_FLAGS already say something about them, or no NVIDIA GPU is there: XLA_FLAGS are
    part of jax's cache keys, and on a CPU pytest --ahead's workers found 69 of the CPU smoke's
    367 programs that the CLI's in-process run had compiled (298 compiled again)."""
    from harness.engine.environment import nvidia_smi_gpus   # cached: asked once a process
    flags = env.get("XLA_FLAGS", "")
    if "xla_gpu_enable_command_buffer" in flags \
            or env.get("CUDA_VISIBLE_DEVICES") in ("", "-1") or not nvidia_smi_gpus():
        return dict(env)
    return {**env, "XLA_FLAGS": f"{flags} {NO_COMMAND_BUFFERS}".strip()}


def start_groups(pairs_by_group: dict, workdir: Path, options, *, env=None,
                 on_crash=None, stop=None, echo=print, parts: int = 1):
    """Starts each group's run_group in a thread, `at_once` groups at a time with their
    `shares` of the device (or one after another where `shares` says so), the main group
    first: while it runs, the other groups take turns beside it; a group that starts after the
    main group whole has finished takes the larger share. `pairs_by_group`: group (None: the
    kernels without one) -> its (kernel, case) pairs. `parts` (on GPUs, where the user left
    jax's memory settings alone): the main group runs in that many parts at once
    (harness.engine.main_parts). Returns the pool and one future per group, in the groups'
    order: the caller waits, and on being stopped sets `stop` and calls stop_live before it
    shuts the pool down; then it runs the pairs the parts could not fit (run_deferred)."""
    from concurrent.futures import ThreadPoolExecutor
    env = dict(os.environ if env is None else env)
    if parts > 1 and None in pairs_by_group and not user_set_memory(env):
        pairs_by_group = with_parts(pairs_by_group, parts)
    by_group = shares(pairs_by_group, env)
    futures: dict = {}

    def run(group, pairs):
        extra = {} if by_group is None else by_group[group]
        if extra and group is not None and None in futures and futures[None].done():
            extra = {**extra, **share(main_running=False)}
        return run_group(group or "main", pairs, workdir, options, echo=echo,
                         env={**env, **extra}, on_crash=on_crash, stop=stop,
                         defer_memory=is_part(group))
    pool = ThreadPoolExecutor(max_workers=1 if by_group is None else at_once(pairs_by_group),
                              thread_name_prefix="group")
    # The main group (or its parts) first, whatever the selection's order.
    for g in sorted(pairs_by_group, key=lambda g: not (g is None or is_part(g))):
        futures[g] = pool.submit(run, g, pairs_by_group[g])
        futures[g].group, futures[g].pairs = g, len(pairs_by_group[g])   # header_parts
    return pool, [futures[g] for g in pairs_by_group]


def run_deferred(futures, workdir: Path, options, *, env=None, on_crash=None, stop=None,
                 echo=print) -> WorkerResult | None:
    """Once every group has ended: the pairs the main group's parts deferred for want of
    memory, in workers with the main group's share (alone on the device), as DEFERRED; None
    if none."""
    deferred = [p for r in ended_results(futures) for p in r.deferred]
    if not deferred:
        return None
    echo(f"[worker {DEFERRED}] {len(deferred)} pairs did not fit in their part's share of the "
         "device: again, with the main group's")
    return run_group(DEFERRED, deferred, workdir, options, echo=echo,
                     env=dict(os.environ if env is None else env), on_crash=on_crash,
                     stop=stop)


def ended_results(futures, *, stopped: bool = False) -> list[WorkerResult]:
    """What the groups that ended did, in the groups' order: those that finished, and with
    `stopped`, those stopped partway too (Stopped.result, where known)."""
    out = []
    for f in futures:
        if not f.done() or f.cancelled():
            continue
        exc = f.exception()
        if exc is None:
            out.append(f.result())
        elif stopped and isinstance(exc, Stopped) and exc.result is not None:
            out.append(exc.result)
    return out


def run_again_entries(futures, again: WorkerResult | None = None) -> list[dict]:
    """The header's `run_again`: the pairs the groups that finished or were stopped partway (and
    the deferred pairs' workers, `again`) ran again in a fresh worker (harness.engine.capture)."""
    ended = ended_results(futures, stopped=True) + ([again] if again is not None else [])
    return [{"kernel": k, "case_id": c, "why": why,
             **({UNBLAMED_FIELD: True} if (k, c) in r.unblamed else {})}
            for r in ended for k, c, why in r.run_again]


def report_names(groups, parts: int = 1) -> list[str]:
    """The worker folders' names of a run's groups (None: "main", then its parts'), DEFERRED
    last."""
    from harness.engine.main_parts import part_name
    names = []
    for g in groups:
        names += ["main", *map(part_name, range(parts if parts > 1 else 0))] if g is None \
            else [g]
    return names + [DEFERRED]


def needs_workers(kernels) -> bool:
    return len(groups(kernels)) > 1


def clashes_here(kernel) -> bool:
    """Whether this process already ran a kernel of another process group than `kernel`'s."""
    if kernel.isolation is None:
        return False
    return bool(_LOADED - {kernel.isolation})


def mark_loaded(kernel) -> None:
    if kernel.isolation is not None:
        _LOADED.add(kernel.isolation)


@dataclass
class WorkerResult:
    report_dirs: list[Path] = field(default_factory=list)
    crashes: list[tuple[str, str, str]] = field(default_factory=list)  # (kernel, case, why)
    deferred: list[tuple[str, str]] = field(default_factory=list)   # lacked memory (a part)
    run_again: list[tuple[str, str, str]] = field(default_factory=list)  # harness.engine.capture
    # Pairs a worker died on that ran alone in the next, no pair of that worker blamed for a
    # death later: a death no pair repeats, blamed on none (run_group); the run is not a pass.
    unblamed: list[tuple[str, str]] = field(default_factory=list)
    name: str = ""                 # the group's workers' name (run_group's `name`)
    interrupted: bool = False      # stopped by Ctrl-C / SIGTERM: what finished is kept


def worker_command(spec_file: Path) -> list[str]:
    return [sys.executable, "-m", "harness.engine.worker", str(spec_file)]


def write_spec(path: Path, options, pairs: list, report_dir: Path,
               defer_memory: bool = False, run_again=()) -> Path:
    """A worker's orders: the run's options (paths of kernel modules made absolute: the
    worker may start elsewhere), its pairs and its report folder; `defer_memory`: a pair that
    lacked device memory is listed in DEFERRED_FILE instead of recorded (the main group's parts);
    `run_again`: pairs run once more in a fresh worker (harness.engine.capture)."""
    import dataclasses
    modules = tuple(str(Path(m).resolve()) if os.path.exists(m) else m
                    for m in options.kernel_modules)
    options = dataclasses.replace(options, kernel_modules=modules, source="worker")
    path.write_text(json.dumps({"options": options.to_json(), "pairs": [list(p) for p in pairs],
                                "report_dir": str(report_dir), "defer_memory": defer_memory,
                                "run_again": [list(p) for p in run_again],
                                # when the worker was asked for (its header's startup_s)
                                "written": time.time()}))
    return path


def _done_pairs(report_dir: Path) -> set[tuple[str, str]]:
    """Pairs whose records are all in a worker's report (FINISHED_FILE, written after them).
    A pair with some records only (the worker killed while appending them) is not done: the
    worker died on it, and its crash record stands for it (before, any line of it made it done,
    and the pair kept what the kill left of its records, without a word)."""
    return set(_announced(report_dir / FINISHED_FILE))


def _announced(path: Path, field_: str | None = None) -> list:
    """The pairs a worker's log of pairs (STARTED_FILE, FINISHED_FILE, DEFERRED_FILE,
    RETRY_FILE) names, in order; with `field_`, each with that field of its line. A last line
    cut short by a kill is left out."""
    if not path.exists():
        return []
    rows = [json.loads(x) for x in path.read_text().splitlines(keepends=True)
            if x.strip() and not rec.cut_short(x)]
    pairs = [(r["kernel"], r["case_id"]) for r in rows]
    return pairs if field_ is None else [(p, r.get(field_, "")) for p, r in zip(pairs, rows)]


def _last_started(report_dir: Path) -> tuple[str, str] | None:
    started = _announced(report_dir / STARTED_FILE)
    return started[-1] if started else None


def _stream(command: list[str], echo, env: dict | None = None, stop=None) -> tuple[int, str]:
    """Runs a worker, passing its stderr (progress) through as it comes, and keeps the end of
    it for the reason, should it die. `stop` (a threading.Event): once set, no worker starts."""
    with _LIVE_LOCK:
        if stop is not None and stop.is_set():
            raise Stopped()
        proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                text=True, errors="replace",
                                env=worker_environment(dict(os.environ) if env is None else env))
        LIVE.add(proc)
    tail = StderrTail()
    try:
        for line in proc.stderr:
            if echo is print:
                sys.stderr.write(line)
            tail.add(line)
        return proc.wait(), tail.text()
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    finally:
        LIVE.discard(proc)


def stop_live() -> None:
    """Kills the workers running now (a run stopped early: what they finished is kept)."""
    with _LIVE_LOCK:
        for proc in list(LIVE):
            proc.kill()


def run_group(name: str, pairs: list[tuple[str, str]], workdir: Path, options,
              echo=print, env: dict | None = None, on_crash=None, stop=None,
              defer_memory: bool = False) -> WorkerResult:
    """Runs one process group's pairs in workers until every pair has records or an error.
    `env`: the workers' environment (default: this process's); `on_crash(kernel, case, why)`
    is told each pair a worker died on, as it happens; `stop` (a threading.Event) set: no
    further worker starts (isolation.Stopped). `defer_memory` (a part of the main group,
    harness.engine.main_parts): a pair that lacked device memory goes to `deferred`."""
    import shutil
    result = WorkerResult(name=name)
    # `alone`: the pair a worker died on while others were in it, run alone in the next one
    # before it is blamed: a worker traces and compiles the pairs after the one it runs, and
    # a kernel that ends the process there (os._exit, a fault while tracing) killed it while
    # an innocent pair was the last started (a helper's adversarial review).
    remaining, attempt, alone = list(pairs), 0, None
    # A pair whose worker died and that then ran alone -> the dead worker's pairs: its
    # death stands blamed on none unless one of those is blamed for a death later.
    unblamed: dict[tuple[str, str], set] = {}
    suspects: set = set()   # the pairs of the worker whose death sent `alone` to run alone
    while remaining:
        attempt += 1
        wdir = workdir / f"{name}-{attempt}"
        shutil.rmtree(wdir, ignore_errors=True)   # nothing of an earlier run counts as done
        wdir.mkdir(parents=True)
        running = [alone] if alone else remaining
        spec = write_spec(wdir / "spec.json", options, running, wdir / "report",
                          defer_memory, [p[:2] for p in result.run_again])
        echo(f"[worker {name}#{attempt}] {len(running)} kernel x case pairs"
             + (" (alone)" if alone else ""))
        result.report_dirs.append(wdir / "report")
        try:
            returncode, tail = _stream(worker_command(spec), echo, env, stop)
        except KeyboardInterrupt:
            result.interrupted = True
            return result
        except Stopped:
            raise Stopped(result) from None
        done = _done_pairs(wdir / "report")
        deferred = set(_announced(wdir / "report" / DEFERRED_FILE))
        result.deferred += [p for p in remaining if p in deferred and p not in done]
        left = [p for p in remaining if p not in done and p not in deferred]
        if not left:
            break
        if stop is not None and stop.is_set() or returncode in INTERRUPTED:
            # Stopped with the run (Ctrl-C reaches the workers too): no pair's crash.
            raise Stopped(result)
        if returncode == 2:  # a user's mistake (harness.errors.UsageError): the same for all
            from harness.errors import UsageError
            last = [ln for ln in tail.splitlines() if ln.strip()]
            raise UsageError(last[-1].removeprefix("error: ") if last else
                             f"the worker for isolation group {name!r} refused its pairs")
        if alone is not None and alone not in left:   # alone, it ran: not its crash
            echo(f"[worker {name}#{attempt}] {alone[0]} {alone[1]} ran alone: the worker "
                 "before died of another pair's doing, or of a crash no pair repeats (then the "
                 "run is not a pass)")
            if alone in done and suspects:   # ran (not deferred), its worker's death not memory
                unblamed[alone] = suspects
            alone, remaining = None, left
            continue
        # Whatever its exit status (a process whose capture broke may crash as it ends; a
        # kernel's os._exit(0) ends it with status 0: that pair is to blame, as for a crash,
        # and a fresh worker runs the rest).
        again = [(*p, why) for p, why in _announced(wdir / "report" / RETRY_FILE, "why")
                 if p in left]
        if again:
            echo(f"[worker {name}#{attempt}] a CUDA graph capture broke on {again[0][0]} "
                 f"{again[0][1]}: it runs again in a fresh worker")
            result.run_again += again
            remaining = left
            continue
        crashed = alone or _last_started(wdir / "report")
        why = death(returncode, tail)
        if defer_memory and crashed in left and memory_bound(why):
            echo(f"[worker {name}#{attempt}] out of memory on {crashed[0]} {crashed[1]}: "
                 "deferred")
            result.deferred.append(crashed)
            alone, remaining = None, [p for p in left if p != crashed]
            continue
        if crashed not in left:
            # It died between pairs (after the records of the last pair it started): no pair is
            # to blame where it finished some, a fresh worker takes the rest (each then dies,
            # if it does, while announced); one that died starting up blames its first pair.
            if done or deferred:
                echo(f"[worker {name}#{attempt}] died between pairs: {why}")
                remaining = left
                continue
            crashed = left[0]
        if died_compiling(returncode, tail) and crashed not in [p[:2] for p in result.run_again]:
            echo(f"[worker {name}#{attempt}] died while XLA compiled, on {' '.join(crashed)}: "
                 f"{why}: it runs again in a fresh worker")
            result.run_again, remaining = result.run_again + [(*crashed, why)], left
            continue
        if crashed in left and len(left) > 1 and crashed not in [p[:2] for p in result.run_again]:
            echo(f"[worker {name}#{attempt}] died on {crashed[0]} {crashed[1]}: {why}: it runs "
                 "again alone in a fresh worker before it is blamed")
            result.run_again.append((*crashed, why))
            # A death the harness may have caused (killed outright, as the host's out-of-memory
            # killer does, or out of device memory beside the other groups) is no kernel's if
            # nobody repeats it; any other stands unless one of this worker's pairs repeats it.
            suspects = set() if harness_like(returncode, why) else set(running)
            alone, remaining = crashed, left
            continue
        alone = None
        whose = (f"the worker process for the main group's part {name!r}"
                 if is_part(name) or name == DEFERRED
                 else f"the worker process for isolation group {name!r}")
        result.crashes.append((*crashed, f"{whose} died while running it ({why})"))
        if on_crash:
            on_crash(*result.crashes[-1])
        echo(f"[worker {name}#{attempt}] died on {crashed[0]} {crashed[1]}: {why}")
        remaining = [p for p in left if p != crashed]
    # A death whose pair ran alone, no pair of its worker blamed for one after: nobody repeated it
    # (a kernel that crashed the process once, or the pair before it; a review's kernel that
    # segfaulted on its first trace only read ok with the death in no view).
    blamed = {c[:2] for c in result.crashes}
    result.unblamed = [p for p, pairs_then in unblamed.items() if not pairs_then & blamed]
    return result


def harness_like(returncode: int, why: str) -> bool:
    """Whether a worker's death may be the harness's doing rather than a kernel's: killed by
    SIGKILL (no dump: the host's out-of-memory killer, while a cold run compiles on every
    core) or out of device memory (harness.engine.memory: beside the other groups' workers)."""
    return returncode == -signal.SIGKILL or memory_bound(why)


def clear_workdir(workdir: Path) -> None:
    """Removes an earlier run's worker folders (run_group's `NAME-ATTEMPT/`, `crashes/`;
    hidden files beside them); a folder of that name holding anything else is not the
    harness's: a UsageError, not deleted (a --report-dir given as a project's own folder)."""
    import shutil

    from harness.errors import UsageError
    from harness.kernels.kernel import ISOLATION_NAME
    if not workdir.exists():
        return
    if not workdir.is_dir() or not all(
            d.name.startswith(".") or d.is_dir() and (
                d.name == "crashes" or re.fullmatch(rf"{ISOLATION_NAME}-\d+", d.name))
            for d in workdir.iterdir()):
        raise UsageError(f"--report-dir {workdir.parent}: its {workdir.name}/ is not a harness "
                         "run's worker folders (the run would delete it); give another "
                         "--report-dir")
    shutil.rmtree(workdir, ignore_errors=True)


def worker_reports(workdir: Path, name: str) -> list[Path]:
    """The report folders of a group's workers (run_group's `NAME-ATTEMPT`), in attempt order."""
    found = [(int(m.group(1)), d / "report") for d in workdir.glob(f"{glob.escape(name)}-*")
             if (m := re.fullmatch(re.escape(name) + r"-(\d+)", d.name))]
    return [path for _, path in sorted(found)]


def crash_records(crashes, kernels_by_name) -> list:
    """Error records for the pairs whose worker died (judged like any kernel that raised: an
    error, or known where the kernel declares that crash)."""
    from harness.judge import judging
    from harness.model.case import Case
    return [judging.error_record(kernels_by_name[k], Case.from_id(c), why)
            for k, c, why in crashes]


def run_pair_in_worker(kernel, case, options, workdir: Path):
    """One kernel x case in a worker of its own (pytest, where the kernel's group clashes with
    one this process already loaded): its records and traces, or an error record."""
    from harness.engine.runner import KernelCaseResult
    workdir.mkdir(parents=True, exist_ok=True)
    result = run_group(kernel.isolation or "main", [(kernel.name, case.id)], workdir, options,
                       echo=lambda line: None)
    out = KernelCaseResult()
    for d in result.report_dirs:
        if (d / rec.RECORDS_FILE).exists():
            out.records += [r for r in rec.read(d)[1] if r.pair == (kernel.name, case.id)]
            out.traces += [t for t in rec.read_traces(d / rec.TRACES_FILE)
                           if (t.kernel, t.case_id) == (kernel.name, case.id)]
    out.records += crash_records(result.crashes, {kernel.name: kernel})
    return out
