"""What a kernel did where a feature case fails: each failing tolerance check held against the
case without one feature at a time (and, where none alone matches, without two or more at
once, fewest first), and, with chunks, against chunks counted from the other start; with a
window that none of those explains, against the window one token wider or narrower on each
side. A check that passes there on every segment names it, in the record's diagnosis and
message: "matches the mask without the window: the window was dropped", "matches chunks
counted from the row's start" (a kernel whose library counts chunks from the row, judged by
the harness's count from each segment's start), or "matches a window of 64 back: one token
wider than the case's 63 back (an off-by-one)"."""
from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable

from harness.engine.program_functions import DEFAULT
from harness.judge import judging
from harness.judge import vocabulary as v
from harness.judge.metrics import token_errors
from harness.judge.record import Record
from harness.judge.vocabulary import TENSORS
from harness.model.features import CHUNK_CONVENTIONS, HEAD_DIM_V


def _convention_diagnosis(convention: str) -> str:
    return (f"matches chunks counted from the {convention}'s start: its chunks start there, "
            f"not where the harness counts them (a library that documents it declares "
            f"conventions={{'chunk': {convention!r}}})")


def diagnosed(kernel, case, results, records: list[Record], reference: Callable
              ) -> list[Record]:
    """`records` with their diagnoses; `reference(case, chunk_convention)`: the oracle's
    reference of a case (its time the oracle's); `results`: the kernel's out, dq, dk, dv."""
    failing = {r.check for r in records if r.verdict == v.FAIL and v.has_ratio(r.check)
               and r.segment}
    droppable = [f for f in case.features.names if f != HEAD_DIM_V]
    others = [c for c in CHUNK_CONVENTIONS if c != kernel.chunk_convention] \
        if case.features.chunk is not None else []
    if not failing or not (droppable or others or case.features.window is not None):
        return records
    matches: dict[str, dict[str, bool]] = {}
    tensors = results[:len(TENSORS)]

    def explained() -> bool:
        """Whether some reference tried so far matches each failing check."""
        return all(any(matches.get(chk, {}).values()) for chk in failing)

    def held(name: str, against, convention: str) -> None:
        try:
            ref = reference(against, convention)
        except Exception:   # noqa: BLE001 - a diagnosis that cannot be made is left out
            return
        for chk, err in zip(TENSORS, token_errors(tensors, ref.truth[:len(tensors)])):
            if chk.name in failing:
                again, _ = judging.tensor_records(kernel, against, chk, err, ref, DEFAULT)
                matches.setdefault(chk.name, {})[name] = all(r.verdict == v.PASS
                                                             for r in again)
    for name in droppable:
        held(name, dataclasses.replace(case, features=case.features.without(name)),
             kernel.chunk_convention)
    # Where no single feature's absence explains a failing check: two or more features at
    # once, fewest first, until each failing check is explained (or none is left to try).
    combos = {"+".join(c): c for size in range(2, len(droppable) + 1)
              for c in itertools.combinations(droppable, size)}   # matches' key -> features
    for key, combo in combos.items():
        if explained():
            break
        without = case.features
        for name in combo:
            without = without.without(name)
        held(key, dataclasses.replace(case, features=without), kernel.chunk_convention)
    for convention in others:
        held(convention, case, convention)
    # matches' key -> the window one token off, of those that could change every failing
    # segment (none where one is too short for it: the nightly's segment-ids bug on its window
    # cases compiled no reference for them)
    near = _near_windows(case, min((r.length for r in records if r.verdict == v.FAIL
                                    and r.check in failing and r.length), default=0))
    for key, window in near.items():
        if explained():
            break
        held(key, dataclasses.replace(case, features=dataclasses.replace(
            case.features, window=window)), kernel.chunk_convention)
    out = []
    for r in records:
        found = matches.get(r.check, {}) if r.verdict == v.FAIL and r.check in failing else {}
        diagnosis = _drop_diagnosis({n: m for n, m in found.items() if n in droppable},
                                    next((c for k, c in combos.items() if found.get(k)), ()))
        if diagnosis is None and any(found.get(c) for c in others):
            diagnosis = _convention_diagnosis(next(c for c in others if found.get(c)))
        if diagnosis is None and any(found.get(k) for k in near):
            diagnosis = _window_diagnosis(case.features.window,
                                          near[next(k for k in near if found.get(k))])
        if diagnosis:
            r = r.replace(diagnosis=diagnosis, message=diagnosis + (
                f"; {r.message}" if r.message else ""))
        out.append(r)
    return out


def _drop_diagnosis(dropped: dict[str, bool], together=()) -> str | None:
    """The diagnosis of a failing feature case from whether its results match the case without
    each feature within tolerance (feature -> matches): the first that matches was dropped;
    where none does, `together`: the fewest features whose dropping at once matches."""
    from harness.model.features import WITHOUT
    for name, matches in dropped.items():
        if matches:
            plural = WITHOUT[name].endswith("s")   # the chunks, the sinks
            return (f"matches the mask without {WITHOUT[name]}: {WITHOUT[name]} "
                    f"{'were' if plural else 'was'} dropped")
    if together:
        *rest, last = [WITHOUT[n] for n in together]
        return f"matches the mask without {', '.join(rest)} and {last}: each was dropped"
    return None


def _near_windows(case, shortest: int) -> dict[str, tuple[int, int]]:
    """The case's window one token wider or narrower on one side (a bound written with < for
    <=, or the other way): key -> (left, right); a side ahead only where the case reads ahead
    (bidirectional), narrower only where the side is not 0. Wider first: the commoner bug.
    Only those that change a segment of `shortest` tokens (the shortest failing one): a side
    of w differs from w + 1 at distance w + 1 alone, which a segment of w + 1 tokens lacks."""
    if case.features.window is None:
        return {}
    left, right = case.features.window
    sides = [(1, 0), (-1, 0)] + ([(0, 1), (0, -1), (1, 1), (-1, -1)] if not case.causal else [])
    near = {}
    for d_left, d_right in sides:
        window = (left + d_left, right + d_right)
        # The nearest distance at which the two windows differ, on a side that changed.
        reach = min(max(left, window[0]) if d_left else math.inf,
                    max(right, window[1]) if d_right else math.inf)
        if min(window) >= 0 and reach < shortest:
            near[f"window{window[0]}.{window[1]}"] = window
    return near


def _window_diagnosis(asked: tuple[int, int], window: tuple[int, int]) -> str:
    """The diagnosis of a failing window case whose results match `window`, one token off."""
    def text(w):
        return f"{w[0]} back" + (f", {w[1]} ahead" if w[1] else "")
    wider = sum(window) > sum(asked)
    sides = " on each side" if window[0] != asked[0] and window[1] != asked[1] else ""
    return (f"matches a window of {text(window)}: one token {'wider' if wider else 'narrower'}"
            f"{sides} than the case's {text(asked)} (an off-by-one)")
