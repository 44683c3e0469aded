"""The harness's words, in one place: the checks, what a record's verdict, expectation and
outcome can be, the statuses of a grid cell, and the selftest's verdicts. Every other module
uses these names; none spells its own.

Checks (typed descriptors, not string literals):

    out, dq, dk, dv   tolerance checks of the forward output and the three gradients (valid tokens)
    dsinks            the sinks' gradient (cases with sinks): one per kernel x case, a tolerance
                      check over the heads (a sink's gradient sums over every token of the batch)
    jvp               the output's tangent (forward mode, jax.jvp) for random input tangents,
                      per segment, of the kernels that declare a forward-mode rule
    leak              the leak probe: bitwise (or above run-to-run noise), no tolerance
    padding           what the kernel wrote at padding positions: gradients exactly zero, the
                      output and its tangent (jvp) finite (or zero, where the kernel declares
                      that convention)
    contract          the kernel's output contract: the output's dtype is the query's
    *                 a record about a whole kernel x case (skip, error, expected error absent)

A record's verdict is what was measured, its expectation what a correct harness must conclude,
its outcome the two together:

    verdict   pass | fail | unprobed (leak probe: nothing reproducible to compare) | refused (a
              feature handed over was refused while tracing, before computing) | skip | error
    expected  pass | fail | either (not judged by this check; the leak probe must judge the
              segment) | known (a known upstream numerical bug that shows on some data only) |
              error (a known upstream crash)
    outcome   ok, caught, known, refused   good
              unjudged, not run, skip      neither good nor bad; every view counts them apart
                                           (not run: the leak probe was off; its own check
                                           and the checks left to it)
              fail, missed, error          bad: the run is red
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    name: str
    heads: str            # "query" or "kv": whose heads the tensor has ("" for the others)
    traced: bool          # per-token errors kept for the HTML plots
    bitwise: bool         # judged without a tolerance (no ratio)
    peer_factor: float = 0.0
    floor_eps: float = 0.0
    per_segment: bool = True   # one record per segment (else one per row, or per kernel x case)
    rule: str = ""        # a check without a tolerance: what it asks, in a table's few words

    def __str__(self) -> str:
        return self.name


OUT = Check("out", "query", traced=True, bitwise=False, peer_factor=2.0, floor_eps=2.0)
DQ = Check("dq", "query", traced=True, bitwise=False, peer_factor=3.0, floor_eps=4.0)
DK = Check("dk", "kv", traced=False, bitwise=False, peer_factor=3.0, floor_eps=4.0)
DV = Check("dv", "kv", traced=False, bitwise=False, peer_factor=3.0, floor_eps=4.0)
DSINKS = Check("dsinks", "", traced=False, bitwise=False, peer_factor=3.0, floor_eps=4.0,
               per_segment=False)
# The output's tangent: chained like a gradient (the score's tangent, then the softmax's).
JVP = Check("jvp", "query", traced=False, bitwise=False, peer_factor=3.0, floor_eps=4.0)
LEAK = Check("leak", "", traced=False, bitwise=True, rule="bitwise")
PADDING = Check("padding", "", traced=False, bitwise=True, per_segment=False,
                rule="grads 0, out as declared")
CONTRACT = Check("contract", "", traced=False, bitwise=True, per_segment=False,
                 rule="declared dtype")

TENSORS = (OUT, DQ, DK, DV)      # a kernel program's results, in this order
CHECKS = {c.name: c for c in (*TENSORS, DSINKS, JVP, LEAK, PADDING, CONTRACT)}
KERNEL_LEVEL = "*"               # the check of a record about a whole kernel x case


def check(name: str) -> Check:
    try:
        return CHECKS[name]
    except KeyError:
        raise KeyError(f"unknown check {name!r}; known: {', '.join(CHECKS)}") from None


def rule(check_name: str) -> str:
    """What a check without a tolerance asks, for a table's tolerance column ("—" where the
    record's check is none of the harness's)."""
    chk = CHECKS.get(check_name)
    return chk.rule if chk is not None and chk.rule else "—"


def has_ratio(check_name: str) -> bool:
    """Whether records of this check carry an error/tolerance ratio."""
    chk = CHECKS.get(check_name)
    return chk is not None and not chk.bitwise


# ----- verdicts, expectations, outcomes ---------------------------------------------------------

PASS, FAIL, UNPROBED, SKIP, ERROR = "pass", "fail", "unprobed", "skip", "error"
REFUSED = "refused"
MEASURED = frozenset({PASS, FAIL})

EITHER, KNOWN = "either", "known"
EXPECTATIONS = (PASS, FAIL, EITHER, KNOWN, ERROR)   # ERROR: set by the judge, never returned

OK, CAUGHT, UNJUDGED, MISSED, NOT_RUN = "ok", "caught", "unjudged", "missed", "not run"
GOOD = frozenset({OK, CAUGHT, KNOWN, REFUSED})
BAD = frozenset({FAIL, MISSED, ERROR})
OUTCOMES = (OK, CAUGHT, KNOWN, REFUSED, UNJUDGED, NOT_RUN, SKIP, FAIL, MISSED, ERROR)
# The worst first: what a row, a cell or a test shows when its records disagree.
SEVERITY = (ERROR, FAIL, MISSED, CAUGHT, KNOWN, REFUSED, UNJUDGED, NOT_RUN, OK, SKIP)

# ----- a run's state (its report's header; harness.store.writer) -------------------------------

# A report whose run did not finish (killed: still running; stopped by the user) is never a
# pass, whatever its records say (harness.judge.tallies.unfinished).
RUNNING, FINISHED, INTERRUPTED = "running", "finished", "interrupted"
# A merge of shards I/N that lacks some (its header's shards_missing): not a pass either.
SHARDS_MISSING = "shards missing"
# A report `harness merge` wrote says so in its header (`joined_by`); older ones, by the
# `rejudged` fact every such merge has written (made_by_merge).
MERGE_COMMAND = "harness merge"


def made_by_merge(header: dict | None) -> bool:
    """Whether `harness merge` wrote the report (not a run, whose own join of its workers'
    parts is a merge too)."""
    header = header or {}
    return header.get("joined_by") == MERGE_COMMAND or "rejudged" in header


# A report holding fewer pairs or records than its header says (a file cut at a line, lines
# deleted; harness.store.report_file.shortfall): not a pass.
CUT_SHORT = "cut short"
CUT_SHORT_FIELD = "cut_short"   # the header's field saying why (reading a report adds it)
# A header's `run_again` entry so marked: its worker died on the pair, which then ran alone,
# and no pair of that worker was blamed for a death later: a death no pair repeats (the run is
# not a pass).
UNBLAMED_FIELD = "unblamed"

# ----- grid cells (kernel x layout) ------------------------------------------------------------

CELL_OK, CELL_NEAR, CELL_CAUGHT, CELL_KNOWN = "ok", "near", "caught", "known"
CELL_FAIL, CELL_MISSED, CELL_ERROR, CELL_SKIP = "FAIL", "MISSED", "ERROR", "skip"
CELL_REFUSED, CELL_NOT_RUN = "refused", "not run"
# Which outcome, if any record of a cell has it, names the cell (first match wins): a cell
# with a check that did not run (the leak probe was off) never reads ok.
CELL_BY_OUTCOME = ((ERROR, CELL_ERROR), (FAIL, CELL_FAIL), (MISSED, CELL_MISSED),
                   (CAUGHT, CELL_CAUGHT), (KNOWN, CELL_KNOWN), (REFUSED, CELL_REFUSED),
                   (NOT_RUN, CELL_NOT_RUN))
BAD_CELLS = frozenset({CELL_FAIL, CELL_MISSED, CELL_ERROR})

# ----- the selftest (the bug zoo) --------------------------------------------------------------

ZOO_CAUGHT, ZOO_MISSED, ZOO_OK = "CAUGHT", "MISSED", "ok"
ZOO_FLAGGED, ZOO_ERROR = "FLAGGED", "ERROR"
ZOO_GOOD = frozenset({ZOO_CAUGHT, ZOO_OK})

# ----- padding conventions (a kernel's capability) ----------------------------------------------

PAD_ZERO, PAD_FINITE, PAD_UNDEFINED = "zero", "finite", "undefined"
PADDING_OUTPUTS = (PAD_ZERO, PAD_FINITE, PAD_UNDEFINED)
