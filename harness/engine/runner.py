"""Runs kernels on cases and hands what they computed to the judge.

The data path, one kernel on one case:

    case -> inputs (made once, harness.model.case) -> kernel program (default build; on GPUs
    the blocks it will take filled with NaN first: harness.engine.unwritten) -> oracle
    (harness.judge.oracle) -> per-token errors (harness.judge.metrics) -> records
    (harness.judge.judging: tolerance checks per segment, padding per row, the output
    contract) -> leak probe (deterministic build, harness.judge.leak_probe) -> leak records
    (harness.judge.judging) -> views.

Nothing here decides a verdict: the runner measures, the judge decides. Inputs and segment ids
are arguments of compiled programs, so a kernel compiles once per shape, not per layout or seed.
"""
from __future__ import annotations

import functools
import math
import time
import traceback
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from harness.engine.programs import (
    DEFAULT,
    DETERMINISTIC,
    FORWARD,
    ORACLE,
    Programs,
)
from harness.engine import diagnosis, refusal
from harness.engine.memory import device_memory_bytes, requested_bytes
from harness.errors import USER_CODE_RAISED, located
from harness.judge import judging, leak_probe
from harness.judge.metrics import read_token_errors, stacked_token_errors, token_errors
from harness.judge.oracle import (
    forget_launched,
    forget_references,
    jvp_reference_for,
    launch_reference,
    reference_for,
)
from harness.judge.record import Record, Trace, first_line
from harness.judge.tallies import ratio_text
from harness.judge.vocabulary import JVP, LEAK, PASS, TENSORS
from harness.kernels.kernel import Kernel, Platform
from harness.model.case import Case, forget_inputs, make_inputs, make_tangents

# Cases whose inputs are drawn ahead of the one running (make_inputs keeps 8).
INPUTS_AHEAD = 4
INPUTS = "inputs (drawing ahead)"   # its row of the timing table: how long the run waited


class OracleFailed(RuntimeError):
    """The oracle raised on a case: the kernel did not run (judging.oracle_error_record)."""


@dataclass
class KernelCaseResult:
    records: list[Record] = field(default_factory=list)
    traces: list[Trace] = field(default_factory=list)


def _traces(kernel, case, chk, errors, tolerances, records) -> list[Trace]:
    """Per-token errors of the rows where a segment of a traced check is near or over its
    tolerance (judging.near), to 3 significant digits, for the plots."""
    if not chk.traced:
        return []
    rows = sorted({r.row for r in records if r.measured and judging.near(r.ratio)})
    tok_max = errors[0]
    out = []
    for row in rows:
        segs = case.row_segments(row)
        out.append(Trace(
            kernel=kernel.name, case_id=case.id, check=chk.name, row=row,
            # Python floats: a numpy scalar's isfinite and format cost twice as much, same text
            token_err=[None if not math.isfinite(x) else float(f"{x:.3g}")
                       for x in np.asarray(tok_max[row]).tolist()],
            segments=[{"number": s.number, "start": s.start, "length": s.length} for s in segs],
            tolerance={str(s.number): tolerances[s] for s in segs}))
    return out


def _measure(kernel: Kernel, case: Case, programs: Programs):
    """(inputs, reference, results, per-token errors) of the kernel's default build; raises
    whatever the kernel raised, or a missing fused-kernel marker."""
    try:
        inputs = make_inputs(case)
        ref = _oracle(programs, reference_for, case, kernel.chunk_convention)
    except Exception as exc:  # not the kernel's doing: say whose it is
        raise OracleFailed(f"oracle failed, the kernel did not run: {type(exc).__name__}: "
                           f"{exc}") from exc
    program = programs.get(kernel, case, DEFAULT)
    results = program(*inputs.device_args, poison_unwritten=programs.poisons_unwritten)
    tensors = results[:len(TENSORS)]
    errs = token_errors(tensors, ref.truth[:len(tensors)])
    program.require_markers()
    return inputs, ref, results, errs


def run_kernel_case(kernel: Kernel, case: Case, platform: Platform,
                    programs: Programs | None = None, leak: bool = True) -> KernelCaseResult:
    """Every check of one kernel on one case; unsupported -> skip, raising -> error."""
    reasons = kernel.unsupported_reasons(case, platform)
    if reasons:
        return KernelCaseResult([judging.skip_record(kernel, case, reasons)])
    programs = programs or _default_programs()
    try:
        inputs, ref, results, errs = _measure(kernel, case, programs)
    except OracleFailed as exc:  # the harness's error: never the kernel's declared crash
        return KernelCaseResult([judging.oracle_error_record(kernel, case, str(exc),
                                                             _traceback())])
    except USER_CODE_RAISED as exc:  # a kernel that raises is an error, never a skip
        message = located(judging.error_message(exc), exc)
        # Raised while tracing, naming a feature the case handed over: refused before any
        # computing, which a path may always do (judging.refused_feature).
        feature = judging.refused_feature(case, programs.get(kernel, case, DEFAULT).trace_error)
        if feature is not None:
            return KernelCaseResult(*refusal.judged(
                kernel, case, feature, message,
                lambda k: run_kernel_case(k, case, platform, programs, leak)))
        return KernelCaseResult([judging.error_record(
            kernel, case, message, _traceback())])
    out = KernelCaseResult(judging.kernel_level_records(kernel, case))
    out.records.append(judging.contract_record(kernel, case, str(results[0].dtype)))
    for chk, err in zip(TENSORS, errs):
        records, tolerances = judging.tensor_records(kernel, case, chk, err, ref, DEFAULT)
        out.records += records
        out.traces += _traces(kernel, case, chk, err, tolerances, records)
    if case.features.sinks and kernel.backward:
        out.records.append(_dsinks(kernel, case, results, ref))
    out.records = diagnosis.diagnosed(
        kernel, case, results, out.records,
        lambda c, convention: _oracle(programs, reference_for, c, convention))
    padding = {chk.name: err for chk, err in zip(TENSORS, errs)}
    limits = kernel.forward_reasons(case)
    if kernel.forward_mode and limits:
        out.records.append(judging.skip_record(kernel, case, limits, check=JVP.name))
    elif kernel.forward_mode:
        records, tangent_err = _jvp_records(kernel, case, programs, inputs)
        out.records += records
        if tangent_err is not None:
            padding[JVP.name] = tangent_err
    out.records += judging.padding_records(kernel, case, padding, ref.scale)
    if leak:
        out.records += _leak_records(kernel, case, programs, inputs, results[:len(TENSORS)],
                                     _disagreement(kernel, case, ref, out.records))
    else:
        out.records.append(judging.probe_off_record(kernel, case))
    out.records = judging.cover_unjudged(judging.reruns_within_tolerance(out.records),
                                         probed=leak)
    if case.features.chunk is not None and kernel.chunk_convention != "segment":
        # Judged against the chunks its library documents: every record says which.
        out.records = [r.replace(convention=f"chunks from the {kernel.chunk_convention}'s "
                                            "start") for r in out.records]
    return out


def _oracle(programs: Programs, reference, case: Case, convention: str):
    """`reference` (reference_for, jvp_reference_for) of the case, its wall time the oracle's
    (its row of the timing table): the first kernel run on a case computes it for all, and its
    own row would otherwise carry it."""
    start = time.perf_counter()
    try:
        return reference(case, programs, convention)
    finally:
        programs.timing[ORACLE].wall_s += time.perf_counter() - start


def _jvp_records(kernel, case, programs, inputs) -> tuple[list[Record], tuple | None]:
    """The forward-mode check (kernels that declare forward_mode): the output's tangent for the
    case's input tangents against the oracle's, per segment; and its per-token errors (for the
    padding check). A kernel that raises under jax.jvp: an error record of this check."""
    try:
        ref = _oracle(programs, jvp_reference_for, case, kernel.chunk_convention)
    except Exception as exc:  # not the kernel's doing: say whose it is
        return [judging.oracle_error_record(
            kernel, case, f"oracle's jvp failed, the kernel's did not run: "
            f"{type(exc).__name__}: {exc}", _traceback(), check=JVP.name)], None
    try:
        program = programs.get(kernel, case, FORWARD)
        args = inputs.device_args[:-1] + make_tangents(case)
        tangent = program(*args, poison_unwritten=programs.poisons_unwritten)
        program.require_markers()
    except USER_CODE_RAISED as exc:  # declared and raising: an error, never a skip
        message = located(judging.error_message(exc), exc)
        if feature := judging.refused_feature(case, programs.get(kernel, case, FORWARD)
                                              .trace_error):   # refused before computing
            return [judging.refused_record(kernel, case, feature, message, JVP.name)], None
        return [judging.error_record(kernel, case, f"jvp: {message}", _traceback(),
                                     check=JVP.name)], None
    errs = token_errors(tangent, ref.truth)
    records, _ = judging.tensor_records(kernel, case, JVP, errs[0], ref, FORWARD)
    return records, errs[0]


def _dsinks(kernel, case, results, ref) -> Record:
    """The sinks' gradient against the truth's, over the heads."""
    got, want = (np.asarray(x, np.float64) for x in (results[len(TENSORS)],
                                                     ref.truth[len(TENSORS)]))
    nonfinite = not np.isfinite(got).all()
    err = float(np.abs(got - want).max()) if not nonfinite else math.inf
    return judging.dsinks_record(kernel, case, err, nonfinite, ref, DEFAULT,
                                 "" if nonfinite else _dsinks_detail(got, want))


def _dsinks_detail(got: np.ndarray, want: np.ndarray) -> str:
    """What a sinks' gradient (one per head) looks like against the truth's: zero where the
    truth is not (the gradient never reached the sinks), of the opposite sign on most heads,
    or its worst head's two values."""
    worst = int(np.abs(got - want).argmax())
    moving = want != 0
    if not got.any() and moving.any():
        return "zero on every head: the gradient does not reach the sinks"
    flipped = int((np.sign(got[moving]) == -np.sign(want[moving])).sum())
    if flipped > moving.sum() / 2:
        return (f"of the opposite sign on {flipped} of the {int(moving.sum())} heads whose "
                "truth is not zero")
    return f"worst on head {worst}: {got[worst]:.4g}, the truth {want[worst]:.4g}"


def _disagreement(kernel, case, ref, default_records: list[Record]):
    """A check of the probe's own build (the same lowering, compiled deterministically): a
    function that launches it on the build's results and returns its reader, which says ''
    where they pass every tolerance check the default build passes, else which do not.
    The probe compares that build with itself, so a build that computes something else (XLA's
    deterministic rewrite of an op gone wrong) would show its own mistakes as leaks."""
    passed = {(r.check, r.row, r.segment) for r in default_records
              if r.verdict == PASS}

    def launched(base):
        """The check of the build's results `base`, launched on the device: a function that
        reads it (the run waits for the build's run there, not here)."""
        base = base[:len(TENSORS)]
        errors = stacked_token_errors(base, ref.truth[:len(base)])

        def differs() -> str:
            bad = []
            for chk, err in zip(TENSORS, read_token_errors(errors)):
                records, _ = judging.tensor_records(kernel, case, chk, err, ref, DETERMINISTIC)
                bad += [f"{r.check} {r.where} (ratio {ratio_text(r.ratio)})" for r in records
                        if (r.check, r.row, r.segment) in passed
                        and r.verdict != PASS]
            return (f"it fails {len(bad)} tolerance check(s) the default build passes: "
                    + ", ".join(bad[:4]) + (f" and {len(bad) - 4} more" if len(bad) > 4 else "")
                    if bad else "")
        return differs
    return launched


def _leak_records(kernel, case, programs: Programs, inputs, results, disagreement=None
                  ) -> list[Record]:
    """The tolerance-free leak probe (harness.judge.leak_probe), from the kernel's
    deterministic build where the platform needs one and it computes what the default build
    computes (`disagreement`); the judge turns its result into one record per segment."""
    mode, note = programs.probe_mode, ""
    # On GPUs even a deterministic build is not reproducible by construction everywhere (TE's
    # dq on some shapes): a change must show in two runs of each perturbation, so that noise
    # the reruns happened not to see cannot pass for a leak.
    confirm = programs.platform == "gpu"
    try:
        if mode == DEFAULT:
            found = leak_probe.probe(programs.get(kernel, case, DEFAULT), inputs, case, results,
                                     confirm=confirm, reproducible=kernel.reproducible,
                                     convention=kernel.chunk_convention)
        else:
            try:
                found = _probe_deterministic(programs.get(kernel, case, mode), inputs, case,
                                             confirm, kernel.reproducible, disagreement,
                                             kernel.chunk_convention)
            except Exception as exc:  # e.g. a deterministic workspace that does not fit
                note = (f"deterministic build {_failed(exc)} ({type(exc).__name__}: "
                        f"{first_line(str(exc), 300)}); probed the "
                        f"default build, not reproducible by construction: its gradients "
                        f"above their run-to-run noise ({leak_probe.RERUNS_UNCERTAIN} reruns), "
                        "each leak confirmed by a second run")
                mode = DEFAULT
                # The default build stands in for a deterministic one: it is not reproducible
                # by construction (a dq accumulated with atomics), and reruns that happen to
                # agree bitwise do not make it so. A tensor compared bitwise on their word
                # reads as leaking on the night its noise comes in the perturbed runs instead
                # (the H200 at 2d9d1cd: cuDNN's dq at 1 x 32768, 6 identical reruns, then one
                # token 1 ulp off in both runs of a perturbation). So its gradients are decided
                # above their noise always, however the reruns went.
                found = leak_probe.probe(programs.get(kernel, case, DEFAULT), inputs, case,
                                         results, reruns=leak_probe.RERUNS_UNCERTAIN,
                                         confirm=True, reproducible=False,
                                         convention=kernel.chunk_convention)
    except USER_CODE_RAISED as exc:  # the kernel ran once already: a failure here is its
        return [judging.error_record(kernel, case, f"leak probe: {judging.error_message(exc)}",
                                     _traceback(), check=LEAK.name)]
    return judging.leak_records(kernel, case, found, mode, note)


def _traceback() -> str:
    """The end of the error being handled, as records keep it: its three innermost frames (of
    each exception in its chain), without the lines of markers under a frame's code (an error
    the lowering process handed over has its frames, not their columns)."""
    lines = traceback.format_exc(limit=-3).splitlines(keepends=True)
    return "".join(x for x in lines if not x.strip() or x.strip(" ^~\n"))[-4000:]


class BuildDisagrees(RuntimeError):
    """The deterministic build computes something else than the default build."""


def _failed(exc) -> str:
    return "disagrees with the default build" if isinstance(exc, BuildDisagrees) else "failed"


class DoesNotFit(RuntimeError):
    """A program that needs more device memory than the device has: not run at all (an
    out-of-memory run is slow: XLA logs its whole allocator state)."""


def _probe_deterministic(program, inputs, case, confirm, reproducible=None, disagreement=None,
                         convention="segment"):
    """The probe on a deterministic build; where its workspace does not fit (cuDNN's and TE's
    deterministic backward passes ask for tens of GiB on long or many-segment rows), once more
    after the harness lets go of the device buffers it keeps for other cases. A build that
    needs more than the whole device (cuDNN: 1 TiB at 1 x 32768) is not run at all."""
    need, limit = program.memory_bytes(), device_memory_bytes()
    if need is not None and limit is not None and need > limit:
        raise DoesNotFit(f"needs {need / 2**30:.1f} GiB of device memory (workspace included), "
                         f"more than the {limit / 2**30:.1f} GiB this device has")

    def attempt():
        # Launched in the order the device computes them: the build's run, the disagreement
        # check's errors, the probe's plain perturbations. The host reads the check while the
        # device computes the perturbations (read first, the device stood idle while the
        # host judged it, on every pair).
        base = program.launch(*inputs.device_args)
        differs = disagreement(base) if disagreement else None
        try:
            plain, failed = leak_probe.launch_plain(program, base, case, reproducible,
                                                    convention), None
        except Exception as exc:   # raised once the check is read: a build that disagrees says so
            plain, failed = None, exc
        program.wait(base)   # the build's run, in its execute seconds (the device works on)
        if differs is not None and (found := differs()):
            raise BuildDisagrees(found)
        if failed is not None:
            raise failed
        return leak_probe.probe(program, inputs, case, first=base, confirm=confirm,
                                reproducible=reproducible, convention=convention,
                                launched=plain)
    try:
        return attempt()
    except Exception as exc:
        if "RESOURCE_EXHAUSTED" not in str(exc):
            raise
        asked, limit = requested_bytes(str(exc)), device_memory_bytes()
        if asked is not None and limit is not None and asked > limit:
            raise  # more than the whole device (TE asked for 128 GiB): letting go cannot help
    import gc
    leak_probe.perturbed.cache_clear()
    forget_inputs()
    forget_references()
    forget_launched()   # the next case's reference, launched ahead: computed again when due
    gc.collect()
    return attempt()


_PROGRAMS: Programs | None = None


def _default_programs() -> Programs:
    global _PROGRAMS
    if _PROGRAMS is None:
        _PROGRAMS = Programs()
    return _PROGRAMS


def run_matrix(kernels: Iterable[Kernel], cases: Iterable[Case], platform: Platform,
               on_result: Callable[[Kernel, Case, KernelCaseResult], None] | None = None,
               programs: Programs | None = None, leak: bool = True,
               pairs: set[tuple[str, str]] | None = None,
               on_start: Callable[[Kernel, Case], None] | None = None) -> KernelCaseResult:
    """Cases outermost, grouped by shape, so each case's reference is computed once for all
    kernels and each shape's programs compile together, ahead of use. `pairs`: only these
    (kernel name, case id) of the product (a worker's share, harness.engine.workers);
    `on_start` is told each pair before it runs."""
    kernels, cases = list(kernels), list(cases)
    programs = programs or _default_programs()
    first = {}
    for i, c in enumerate(cases):
        first.setdefault(c.shape_key, i)
    cases.sort(key=lambda c: first[c.shape_key])

    def chosen(k, c):
        return pairs is None or (k.name, c.id) in pairs
    supported = [(k, c) for c in cases for k in kernels
                 if chosen(k, c) and not k.unsupported_reasons(c, platform)]
    programs.prefetch(supported, probe=leak)
    total = KernelCaseResult()
    # The next cases' inputs are drawn while this one runs (numpy draws without the GIL); the
    # leak probe draws its perturbations on the device.
    def draw(case):
        make_inputs(case)

    # Only the cases some pair here runs on: a worker of one library's kernels (the H200's
    # FlashAttention 3 worker at 396cbf3: 31 of the nightly's 65 cases) drew them all, and
    # its run waited for draws of cases it then skipped.
    drawn_cases = list(dict.fromkeys(c for _, c in supported))
    place = {c: j for j, c in enumerate(drawn_cases)}
    drawing = ThreadPoolExecutor(max_workers=INPUTS_AHEAD, thread_name_prefix="inputs")
    ahead = {c: drawing.submit(draw, c) for c in drawn_cases[:INPUTS_AHEAD]}
    # Each case's first kernel (its chunk convention is the reference's) for the reference
    # launched ahead.
    first_kernel, first_forward = {}, {}
    for k, c in supported:
        first_kernel.setdefault(c, k)
        if k.forward_mode and not k.forward_reasons(c):   # its jvp check's reference too
            first_forward.setdefault(c, k)
    try:
        for i, case in enumerate(cases):
            drawn = ahead.pop(case, None)
            if drawn is not None:
                start = time.perf_counter()
                drawn.exception()  # wait; a failed draw is drawn again, and recorded, per kernel
                programs.timing[INPUTS].wait_s += time.perf_counter() - start
            if case in place:
                j = place[case]
                following = drawn_cases[j + INPUTS_AHEAD:j + INPUTS_AHEAD + 1]
                ahead.update({c: drawing.submit(draw, c) for c in following if c not in ahead})
            for kernel in kernels:
                if not chosen(kernel, case):
                    continue
                if on_start:
                    on_start(kernel, case)
                start, oracle = time.perf_counter(), programs.timing[ORACLE].wall_s
                result = run_kernel_case(kernel, case, platform, programs, leak)
                # The oracle's time (computed for the case by its first kernel) is its own.
                programs.timing[kernel.name].wall_s += (time.perf_counter() - start
                                                        - (programs.timing[ORACLE].wall_s - oracle))
                total.records += result.records
                total.traces += result.traces
                if on_result:
                    on_result(kernel, case, result)
                if i + 1 < len(cases):
                    _launch_next_references(programs, case, cases[i + 1], kernel, first_kernel,
                                            first_forward, ahead)
            # The case's perturbations and references go before the next case's kernels need
            # the device's memory (a long row's are GiBs), and so does any of its references
            # launched ahead and never read (its kernels raised first); the next case's stay.
            leak_probe.perturbed.cache_clear()
            forget_references()
            forget_launched(keep=cases[i + 1] if i + 1 < len(cases) else None)
    finally:
        drawing.shutdown(wait=False, cancel_futures=True)
        forget_launched()
    return total


def _launch_next_references(programs: Programs, case: Case, nxt: Case, kernel: Kernel,
                            first_kernel: dict, first_forward: dict, ahead: dict) -> None:
    """Launches the next case's reference (oracle.launch_reference) once this case's first
    kernel has run, and its jvp check's reference, where a kernel will run that check on it,
    once this case's first kernel with that check has run (its own, launched ahead, read by
    then; the first kernel where none has it): the device computes them while the host judges
    this case's kernels. Not where the next case's inputs are still being drawn (it does not
    wait for them), and not where no kernel will run on it. The launches' time is the
    oracle's; the device runs in order, so a run of this case's next kernel that is waited for
    may wait for a reference's computing too, and that wait counts in the kernel's execute
    seconds."""
    if nxt not in first_kernel:
        return
    drawn = ahead.get(nxt)
    if drawn is not None and not (drawn.done() and drawn.exception() is None):
        return
    if kernel is first_kernel.get(case):
        _oracle(programs, launch_reference, nxt, first_kernel[nxt].chunk_convention)
    if nxt in first_forward and kernel is first_forward.get(case, first_kernel.get(case)):
        _oracle(programs, functools.partial(launch_reference, forward=True), nxt,
                first_forward[nxt].chunk_convention)

