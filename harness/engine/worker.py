"""A worker process of the engine: `python -m harness.engine.worker SPEC.json`.

SPEC (written by harness.engine.workers.write_spec) holds the run's options, the worker's
(kernel, case) pairs and its report folder. The worker runs its pairs in this process,
appends each pair's records as it finishes, says which pair it starts (STARTED_FILE) and which
it finished with how many records (FINISHED_FILE), and writes no views: its controller joins
the workers' reports and finishes the run (harness.engine.engine). A user's mistake is one
line on stderr and exit status 2, as from the CLI."""
from __future__ import annotations

import faulthandler
import json
import sys
import time
from pathlib import Path


def run_pairs(spec: dict) -> int:
    from harness.engine.compilation_cache import enable_compilation_cache
    from harness.engine.environment import current_platform, describe
    from harness.engine.options import RunOptions
    from harness.engine.programs import for_run
    from harness.engine.registry import (
        load_kernel_module,
        mark_absl_flags_parsed,
        select_kernels,
    )
    from harness.engine.runner import run_matrix
    from harness.judge.vocabulary import ERROR, SKIP
    from harness.engine.memory import device_memory_bytes
    from harness.engine.memory import memory_bound
    from harness.engine.capture import RETRY_FILE, CaptureBroken, broke_capture, capture_excerpt
    from harness.engine.main_parts import DEFERRED_FILE, main_share_bytes
    from harness.engine.workers import FINISHED_FILE, STARTED_FILE
    from harness.model.case import Case
    from harness.store.writer import ReportWriter

    options = RunOptions.from_json(spec["options"])
    mark_absl_flags_parsed()
    for path in options.kernel_modules:
        load_kernel_module(path)
    pairs = [tuple(p) for p in spec["pairs"]]
    kernels = select_kernels(list(dict.fromkeys(k for k, _ in pairs)))
    cases = [Case.from_id(c) for c in dict.fromkeys(c for _, c in pairs)]
    report_dir = Path(spec["report_dir"])
    enable_compilation_cache(options.cache_dir)
    programs = for_run(options)
    writer = ReportWriter(report_dir, describe(), suite=options.suite,
                          probe_mode=programs.probe_mode, leak_probe=options.leak_probe)
    # From the controller's spec to here (the start of its pairs, their programs' building
    # included from here on): the process, its imports, the device, the lowering process.
    began = time.time()
    started = (report_dir / STARTED_FILE).open("a")
    finished = (report_dir / FINISHED_FILE).open("a")
    deferred = (report_dir / DEFERRED_FILE).open("a") if spec.get("defer_memory") else None
    run_again = {tuple(p) for p in spec.get("run_again", [])}

    def announce(log, kernel, case, **more):
        log.write(json.dumps({"kernel": kernel.name, "case_id": case.id, **more}) + "\n")
        log.flush()

    main_bytes = main_share_bytes(device_memory_bytes()) if deferred is not None else None

    def on_result(kernel, case, result):
        # An error's message only: a skip's reason may name a crash it avoids (jax_nn's
        # VALUE_HEAD_DIM_CRASH names CUDA_ERROR_ILLEGAL_INSTRUCTION), and on the H200 at
        # 0cfdd4f that ended the main group's worker at each such case, three times a night.
        lost = [r for r in result.records if r.verdict == ERROR and device_lost(r.message)]
        # Not a skip: a skip's reason may name the failure it avoids (as above).
        broken = [r for r in result.records if r.verdict != SKIP and broke_capture(r.message)]
        if broken and (kernel.name, case.id) not in run_again:
            # Another thread of this worker broke the pair's capture (harness.engine.capture):
            # no record here; a fresh worker runs it again.
            why = capture_excerpt(broken[0].message)
            with (report_dir / RETRY_FILE).open("a") as log:
                announce(log, kernel, case, why=why)
            raise CaptureBroken(why)
        lost += broken   # broken again in a fresh worker: the records stand, the worker ends
        if deferred is not None and any(memory_bound(r.message, main_bytes)
                                        for r in result.records):
            # Too little device memory in this part's share (harness.engine.main_parts):
            # no record here; the pair runs again with the main group's share.
            announce(deferred, kernel, case)
        else:
            writer.add(result)
            # After its records, and how many: a reader takes the pair once it has read them.
            announce(finished, kernel, case, records=len(result.records))
        if lost:
            # The device context is gone for this process (a kernel's illegal instruction or
            # address is sticky): every later pair would fail here. The pair keeps its error;
            # the worker ends, and its controller starts a fresh one for the rest.
            raise DeviceLost(lost[0].message)
    from harness.engine.compilation_cache import cache_stats

    def close_report():
        since = {"startup_s": round(began - spec["written"], 1)} if "written" in spec else {}
        writer.close(timing=programs.report(), worker=report_dir.parent.name, began_at=began,
                     **since, **cpu_seconds(programs.lowering_cpu_s),
                     compilation_cache={"dir": options.cache_dir, **cache_stats()})
    try:
        run_matrix(kernels, cases, current_platform(), on_result=on_result,
                   programs=programs, leak=options.leak_probe, pairs=set(pairs),
                   on_start=lambda kernel, case: announce(started, kernel, case))
    except (DeviceLost, CaptureBroken):
        # Its pairs' time counts too: a report closed without it left the run's timing table
        # with only the last worker's share (the H200's nightly at 3d22ac7). Its programs
        # closed first, as below: its lowering processes' CPU seconds count once they ended.
        programs.close()
        close_report()
        raise
    finally:
        programs.close()
        started.close()
        finished.close()
        if deferred is not None:
            deferred.close()
    close_report()
    return 0


def cpu_seconds(lowering_cpu_s: float | None = None) -> dict:
    """The CPU time this process used (user and system, every thread, its start included),
    that of its ended children (`children_cpu_s`) and, of those, its lowering processes'
    (`lowering_cpu_s`, reaped when its programs closed; none without them), with the cores it could use: whether a
    run was bound by its CPUs shows there (cold nightlies compile on every core beside the
    run's thread). The other children are XLA's: on GPUs it runs ptxas in a process of its own
    for each program it compiles."""
    import resource

    from harness.engine.environment import usable_cores
    own, children = (resource.getrusage(who) for who in (resource.RUSAGE_SELF,
                                                          resource.RUSAGE_CHILDREN))
    return {"cpu_s": round(own.ru_utime + own.ru_stime, 1),
            "children_cpu_s": round(children.ru_utime + children.ru_stime, 1),
            **({} if lowering_cpu_s is None else {"lowering_cpu_s": round(lowering_cpu_s, 1)}),
            "cores": usable_cores()}


# CUDA errors after which a process's context is unusable (cudaErrorIllegalInstruction and
# the like are "sticky": every later call of the process fails with them).
STICKY = ("CUDA_ERROR_ILLEGAL_INSTRUCTION", "CUDA_ERROR_ILLEGAL_ADDRESS",
          "CUDA_ERROR_MISALIGNED_ADDRESS", "CUDA_ERROR_LAUNCH_FAILED",
          "CUDA_ERROR_HARDWARE_STACK_ERROR", "an illegal memory access was encountered")
DEVICE_LOST = 3   # the worker's exit status when its device context is lost


class DeviceLost(RuntimeError):
    """A kernel left the device context unusable (a sticky CUDA error)."""


def device_lost(message: str) -> bool:
    return any(s in (message or "") for s in STICKY)


def main(argv: list[str]) -> int:
    from harness.engine.capture import CAPTURE_BROKEN, CaptureBroken, capture_excerpt
    from harness.errors import GUARD, UsageError
    GUARD["exits"] = False   # a kernel ending this worker is the controller's to judge
    if len(argv) != 1:
        print("usage: python -m harness.engine.worker SPEC.json (started by the engine)",
              file=sys.stderr)
        return 2
    try:
        return run_pairs(json.loads(Path(argv[0]).read_text()))
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except DeviceLost as exc:
        print(f"device context lost after a pair's error: {capture_excerpt(str(exc))}",
              file=sys.stderr)
        return DEVICE_LOST
    except CaptureBroken as exc:
        print(f"a CUDA graph capture broke: {exc}", file=sys.stderr)
        return CAPTURE_BROKEN


if __name__ == "__main__":
    # Its report is closed by now and its compiles done (Programs.close): the interpreter's
    # teardown is skipped (harness.process_end; 6.9 s passed from the end of the main worker's
    # pairs to the join at 32ec331, 2.0 s without it at a83ae73).
    from harness.process_end import end_process
    # A fatal signal dumps every thread's stack to stderr: its controller reads which thread
    # crashed, and whether it was compiling (harness.engine.capture.StderrTail).
    faulthandler.enable(all_threads=True)
    end_process(main(sys.argv[1:]))
