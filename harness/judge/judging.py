"""The one place that judges: what the checks are, how each is judged, and what a record's
verdict, expectation and outcome mean. Every view, `compare` and `rejudge` read from here.

Checks (typed descriptors, not string literals):

    out, dq, dk, dv   tolerance checks of the forward output and the three gradients
    leak              the leak probe: bitwise, no tolerance (harness.judge.leak_probe)

Tolerance (tolerance checks), for each check and segment:

    tolerance = peer_factor * peer_err + floor_eps * eps(dtype) * max|truth|
    ratio     = kernel_err / tolerance          (pass iff finite and ratio <= 1)

- kernel_err, peer_err: max abs difference from the float32 truth over the segment's tokens.
  The peer is the reference formula computed in the input dtype (oracle.dense_attention with
  truth=False), so peer_err is the rounding noise an honest kernel of that dtype can have.
- peer_factor: 2 for the output, 3 for gradients, as flash-attention's tests use. A fused kernel
  rounds differently from the peer (online softmax, bf16 probabilities, another accumulation
  order); backward passes chain more roundings than the forward pass.
- floor: the peer's error can be exactly zero (a single-token segment's output is its value row;
  its dq is zero in exact arithmetic), which would demand bitwise equality. The floor allows a
  couple of roundings of the largest value of that check: 2 eps for the output; 4 eps for the
  gradients, whose kernels recompute softmax statistics from a rounded output (four times
  that in float32, see FLOAT32_FLOOR_FACTOR). It uses the
  largest |truth| over the whole check tensor, not the segment, because a tiny segment-local
  scale (dq of a single token is 0) says nothing about the kernel's rounding.

A leak across a segment boundary moves outputs by O(1) of the values' scale, while the
tolerances are O(eps) of it: a bf16 leak shows ratios in the tens to hundreds.

The vocabulary of a record:

    verdict   what was measured: pass | fail | unprobed (leak probe: no tensor reproducible)
              | skip | error
    expected  what a correct harness must conclude: pass | fail | either (not judged by this
              check; the leak probe must judge the segment) | known (a known upstream numerical
              bug that shows on some data only: a failure is reported as known, with its
              reason, and a pass is ok) | error (a known upstream crash)
    outcome   the two together:
              ok, caught, known            good
              unjudged, skip               neither good nor bad; every view counts them apart
              fail, missed, error          bad: the run is red
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable, Mapping

import numpy as np

# ----- checks ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Check:
    name: str
    heads: str            # "query" or "kv": whose heads the tensor has ("" for the leak probe)
    traced: bool          # per-token errors kept for the HTML plots
    bitwise: bool         # judged bitwise (no tolerance, no ratio) rather than by tolerance
    peer_factor: float = 0.0
    floor_eps: float = 0.0

    def __str__(self) -> str:
        return self.name


OUT = Check("out", "query", traced=True, bitwise=False, peer_factor=2.0, floor_eps=2.0)
DQ = Check("dq", "query", traced=True, bitwise=False, peer_factor=3.0, floor_eps=4.0)
DK = Check("dk", "kv", traced=False, bitwise=False, peer_factor=3.0, floor_eps=4.0)
DV = Check("dv", "kv", traced=False, bitwise=False, peer_factor=3.0, floor_eps=4.0)
LEAK = Check("leak", "", traced=False, bitwise=True)

TENSORS = (OUT, DQ, DK, DV)      # a kernel program's results, in this order
GRADIENTS = (DQ, DK, DV)
CHECKS = {c.name: c for c in (*TENSORS, LEAK)}
KERNEL_LEVEL = "*"               # the check of a record about a whole kernel x case (skip, error)


def check(name: str) -> Check:
    try:
        return CHECKS[name]
    except KeyError:
        raise KeyError(f"unknown check {name!r}; known: {', '.join(CHECKS)}") from None


# In float32 the peer computes in the truth's own precision, so its error shows almost none of
# the reordering noise of a blocked kernel (online softmax, split accumulations): a few eps of
# the largest value, where Pallas's flash kernel lands on bidirectional rows (1e-6 at |out| 3).
# The floor is four times wider there; a leak still moves values by O(1).
FLOAT32_FLOOR_FACTOR = 4.0


def tolerance(chk: Check, dtype: str, peer_err: float, truth_scale: float) -> float:
    import jax.numpy as jnp
    eps = float(jnp.finfo(dtype).eps)
    floor = chk.floor_eps * (FLOAT32_FLOOR_FACTOR if dtype == "float32" else 1.0)
    # The last term only keeps the tolerance positive for an all-zero check.
    return chk.peer_factor * peer_err + floor * eps * truth_scale + 1e-30


def ratio(kernel_err: float, tol: float, nonfinite: int = 0) -> float | None:
    """error / tolerance; None (reported as inf) where the kernel produced non-finite values."""
    r = kernel_err / tol
    return None if nonfinite or not np.isfinite(r) else r


def tolerance_verdict(r: float | None) -> str:
    return "pass" if r is not None and r <= 1.0 else "fail"


# ----- expectations and outcomes --------------------------------------------------------------

EITHER_REASON = ("this check cannot see the leak reliably (it can hide in rounding noise); "
                 "the leak probe judges the segment")

GOOD = frozenset({"ok", "caught", "known"})
NEUTRAL = frozenset({"unjudged", "skip"})
BAD = frozenset({"fail", "missed", "error"})
OUTCOMES = ("ok", "caught", "known", "unjudged", "skip", "fail", "missed", "error")


def expectation(value, check_name: str = "") -> tuple[str, str]:
    """(expected, reason) from what an expectation function returned: "pass", "fail",
    "either", ("either", reason) or ("known", reason). The leak probe is exact: never "either"
    nor "known". A known bug names itself: "known" needs its reason."""
    if isinstance(value, tuple):
        expected, reason = value
    else:
        expected, reason = value, ""
    if expected not in ("pass", "fail", "either", "known"):
        raise ValueError(f"an expectation must be pass, fail, either or known, not {expected!r}")
    if expected in ("either", "known") and check_name == LEAK.name:
        raise ValueError(f"the leak probe is exact: its expectation is pass or fail, not "
                         f"{expected}")
    if expected == "known" and not reason:
        raise ValueError("a known bug needs its reason: return ('known', 'what and where')")
    if expected == "either":
        return expected, reason or EITHER_REASON
    return expected, reason if expected == "known" else ""


def outcome(verdict: str, expected: str) -> str:
    if verdict in ("skip", "error"):
        return verdict  # an expected error is "known" only when its message matches: see known()
    if expected == "error":
        return "missed"  # a known upstream crash that did not happen
    if verdict == "unprobed":
        # A kernel expected to leak that could not be probed is not ok.
        return "missed" if expected == "fail" else "unjudged"
    if expected == "either":
        return "unjudged"
    if expected == "known":
        return "known" if verdict == "fail" else "ok"
    if verdict == expected:
        return "ok" if verdict == "pass" else "caught"
    return "fail" if verdict == "fail" else "missed"


def error_outcome(message: str, expect_error: str | None) -> tuple[str, str]:
    """(expected, outcome) of a kernel that raised."""
    if expect_error is None:
        return "pass", "error"
    return "error", "known" if expect_error in message else "error"


def is_bad(record: Mapping) -> bool:
    return record["outcome"] in BAD


def is_good(record: Mapping) -> bool:
    return record["outcome"] in GOOD


def measured(record: Mapping) -> bool:
    return record["verdict"] in ("pass", "fail")


# ----- rules across the records of one kernel x case ------------------------------------------

def cover_unjudged(records: list[dict]) -> list[dict]:
    """Every check an expectation leaves `either` must be judged by the leak probe on the same
    segment. Where it is, the record says so (outcome unjudged); where it is not, nothing judged
    that segment, and the record is `missed`: the harness would otherwise count it silently."""
    leak = {(r["row"], r["segment"]): r for r in records
            if r["check"] == LEAK.name and measured(r) and r["expected"] in ("pass", "fail")}
    out = []
    for r in records:
        if r["check"] != LEAK.name and r["expected"] == "either":
            probe = leak.get((r["row"], r["segment"]))
            if probe is None:
                r = {**r, "outcome": "missed",
                     "message": "left unjudged by the expectation, and the leak probe did not "
                                "judge this segment"}
            else:
                r = {**r, "judged_by": f"leak:{probe['outcome']}"}
        out.append(r)
    return out


def rejudge(records: Iterable[dict], kernels: Mapping) -> list[dict]:
    """Each record's expectation and outcome recomputed from the kernels as registered now.
    Errors, ratios and verdicts stay as measured: for reports measured before an expectation
    was corrected."""
    from harness.model.case import Case
    from harness.model.layouts import Segment

    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["kernel"], r["case_id"]), []).append(r)
    out = []
    for (name, case_id), rows in groups.items():
        kernel = kernels.get(name)
        if kernel is None:
            out += rows
            continue
        case = Case.from_id(case_id)
        fresh = []
        for r in rows:
            if r["verdict"] in ("pass", "fail", "unprobed") and r.get("segment"):
                seg = Segment(r["row"], r["segment"], r["start"], r["length"])
                expected, reason = kernel.expected(case, r["check"], seg)
                r = {k: v for k, v in r.items() if k != "judged_by"}
                r.update(expected=expected, outcome=outcome(r["verdict"], expected))
                if r["check"] != LEAK.name:  # a tolerance check's message is its reason
                    r["message"] = reason
            elif r["verdict"] == "error":
                r = {**r, **dict(zip(("expected", "outcome"),
                                     error_outcome(r.get("message", ""), kernel.expect_error)))}
            fresh.append(r)
        out += cover_unjudged(fresh)
    return out


# ----- summaries every view shares ------------------------------------------------------------

def worst_ratio(records: Iterable[Mapping]) -> tuple[bool, float | None]:
    """(any tolerance check measured, worst ratio): None for a non-finite one (reported inf).
    Bitwise checks have no ratio: their verdicts count, not their numbers."""
    ratios = [r["ratio"] for r in records
              if measured(r) and r["check"] in CHECKS and not CHECKS[r["check"]].bitwise]
    if not ratios:
        return False, None
    if any(x is None for x in ratios):
        return True, None
    return True, max(ratios)


def ratio_text(r: float | None) -> str:
    return "inf" if r is None else f"{r:.3g}"


def counts(records: Iterable[Mapping]) -> dict[str, int]:
    c = Counter(r["outcome"] for r in records)
    return {k: c[k] for k in OUTCOMES if c[k]}


def bad(records: Iterable[Mapping]) -> list:
    """Records a run must be red for: unexpected failures, missed catches and errors."""
    return [r for r in records if is_bad(r)]


def unjudged(records: Iterable[Mapping]) -> Counter:
    """(kernel, check, reason) -> count of checks that an expectation left unjudged."""
    return Counter((r["kernel"], r["check"], r.get("message", ""), r.get("judged_by", ""))
                   for r in records if r["outcome"] == "unjudged" and r["check"] != LEAK.name)


def known(records: Iterable[Mapping]) -> Counter:
    """(kernel, check, reason) -> records showing a known upstream bug: segments failing a
    check as an expectation predicts, and cases raising a declared upstream error (check
    KERNEL_LEVEL, reason: the error's first line)."""
    return Counter((r["kernel"], r["check"], (r.get("message") or "").splitlines()[0][:200]
                    if not r.get("segment") else r.get("message", ""))
                   for r in records if r["outcome"] == "known")


def unprobed(records: Iterable[Mapping]) -> Counter:
    """(kernel, tensor) -> leak records in which that tensor could not be probed."""
    c = Counter()
    for r in records:
        if r["check"] == LEAK.name:
            for t in r.get("unprobed") or ():
                c[(r["kernel"], t)] += 1
    return c


def gated(records: Iterable[Mapping]) -> dict[tuple[str, str], tuple[int, float]]:
    """(kernel, tensor) -> (leak records that probed it above its run-to-run noise only, the
    largest change threshold): probed, with less power than bitwise."""
    out: dict[tuple[str, str], tuple[int, float]] = {}
    for r in records:
        if r["check"] == LEAK.name:
            for t, x in (r.get("gated") or {}).items():
                n, worst = out.get((r["kernel"], t), (0, 0.0))
                out[(r["kernel"], t)] = (n + 1, max(worst, x))
    return out


def uncompared(records: Iterable[Mapping]) -> Counter:
    """(kernel, reason) -> leak records the probe measured nothing for."""
    return Counter((r["kernel"], r.get("message", "")) for r in records
                   if r["check"] == LEAK.name and r["verdict"] == "unprobed")


def fallbacks(records: Iterable[Mapping]) -> Counter:
    """(kernel, why) -> leak records probed on the default build because the deterministic
    build could not run."""
    return Counter((r["kernel"], r["fallback"]) for r in records
                   if r["check"] == LEAK.name and r.get("fallback"))


def probe_coverage(records: Iterable[Mapping]) -> dict[str, tuple[int, int]]:
    """kernel -> (segments with all four tensors probed, segments with a leak record)."""
    full, total = Counter(), Counter()
    for r in records:
        if r["check"] == LEAK.name and r.get("segment"):
            total[r["kernel"]] += 1
            if r["verdict"] in ("pass", "fail") and not r.get("unprobed"):
                full[r["kernel"]] += 1
    return {k: (full[k], total[k]) for k in total}
