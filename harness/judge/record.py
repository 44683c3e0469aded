"""A record: one verdict of one check of one kernel on one case (per segment, per row, or for the
whole kernel x case), and a trace: one row's per-token errors for the plots. Typed objects with
one reader (`from_json`) and one writer (`to_json`); the JSON Lines report format is the one the
harness has always written, so old reports and baselines still read.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

from harness.judge import vocabulary as v


def first_line(message: str | None, width: int) -> str:
    """A message's first line, cut to `width` characters ("" for none: a baseline's records
    keep no messages)."""
    return ((message or "").splitlines() or [""])[0][:width]


@dataclass
class Record:
    kernel: str
    case_id: str
    check: str
    verdict: str
    expected: str
    outcome: str
    # The case (also in its id; kept for readers of the JSON that filter by them).
    layout: str = ""
    family: str = ""
    dtype: str = ""
    batch: int | None = None
    seq_len: int | None = None
    heads: int | None = None
    kv_heads: int | None = None
    head_dim: int | None = None
    causal: bool = True
    seed: int | None = None
    features: str | None = None           # the case's features ("window+sinks"), if any
    convention: str | None = None         # a convention the kernel documents (chunks: "row")
    # Where: a segment (row, 1-based segment number, its tokens), a row (padding), or nothing
    # (a record about the whole kernel x case).
    row: int | None = None
    segment: int | None = None
    segment_label: str | None = None
    start: int | None = None
    length: int | None = None
    # What was measured.
    max_abs_err: float | None = None      # None: non-finite (tolerance checks)
    mean_abs_err: float | None = None
    worst_token: int | None = None
    nonfinite: int | None = None
    peer_err: float | None = None
    tolerance: float | None = None
    ratio: float | None = None            # None: no ratio (bitwise) or non-finite (tolerance)
    message: str = ""
    mode: str | None = None               # the build that produced it: default | deterministic
    # The leak probe.
    probed: list | None = None            # tensors compared
    unprobed: list | None = None          # tensors whose run-to-run noise left nothing to compare
    gated: dict | None = None             # tensor -> the change that counts (above noise)
    detectable: dict | None = None        # tensor -> smallest leak it could see, / its scale
    false_alarm: float | None = None      # probability of a false leak verdict (gated tensors)
    quiet: list | None = None             # gated tensors whose reruns showed no noise: no rate
    unsteady: list | None = None          # bitwise tensors two runs of one perturbation set apart
    fallback: str | None = None           # why the default build was probed
    rerun_change: dict | None = None      # tensor -> largest change between reruns of the
    #                                       unchanged inputs on the segment (where reruns ran)
    judged_by: str | None = None          # an unjudged check: the leak record that judged it
    # Padding hygiene: tensor -> {"kind", "count", "first", "max"} for each violation.
    violations: dict | None = None
    traceback: str | None = None
    # An error of the harness's own side (its oracle raised, its reference is non-finite):
    # never the kernel's, so never matched against the crash a kernel declares.
    harness_error: bool | None = None
    # A failing check of a case with features whose results match the case without one of them:
    # that feature was dropped ("matches the mask without the window").
    diagnosis: str | None = None
    extra: dict = field(default_factory=dict)   # fields of other harness versions, kept as read

    # ----- reading -------------------------------------------------------------------------

    @property
    def key(self) -> tuple:
        """Identifies one check of one segment (or row) across runs."""
        return (self.kernel, self.case_id, self.check, self.row, self.segment)

    @property
    def pair(self) -> tuple[str, str]:
        return (self.kernel, self.case_id)

    @property
    def measured(self) -> bool:
        return self.verdict in v.MEASURED

    @property
    def bad(self) -> bool:
        return self.outcome in v.BAD

    @property
    def tokens(self) -> str:
        """'start..stop' of the segment, '' where the record has none."""
        if self.start is None or self.length is None:
            return ""
        return f"{self.start}..{self.start + self.length - 1}"

    @property
    def where(self) -> str:
        """The segment label, 'row r', or '' for a kernel-level record."""
        if self.segment_label:
            return self.segment_label
        return f"row {self.row}" if self.row is not None else ""

    def replace(self, **changes) -> Record:
        return dataclasses.replace(self, **changes)

    # ----- the JSON form -------------------------------------------------------------------

    def to_json(self) -> dict:
        out = {}
        for f in fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if value is None and f.name in _OPTIONAL:
                continue
            out[f.name] = value
        return {**self.extra, **out}

    @classmethod
    def from_json(cls, row: dict) -> Record:
        known, extra = {}, {}
        for k, x in row.items():   # one pass over the row's keys (a report holds 100,000 rows)
            if k in _FIELD_SET:
                known[k] = x
            elif k != "type":
                extra[k] = x
        if known.get("message") is None:
            known["message"] = ""
        record = cls(**known, extra=extra)   # a required field missing: TypeError, its reader's
        _check_words(known)
        return record


class BadRecord(ValueError):
    """A record line the harness never writes (an edited report): its reader names it."""


_VERDICTS = frozenset({v.PASS, v.FAIL, v.UNPROBED, v.SKIP, v.ERROR, v.REFUSED})
_OUTCOMES = frozenset(v.OUTCOMES)
_NUMBERS = ("max_abs_err", "mean_abs_err", "peer_err", "tolerance", "ratio")


def _check_words(row: dict) -> None:
    """Its verdict and outcome in the harness's words, ok only for a pass (judging.outcome),
    its errors numbers (the harness writes a non-finite one as null, never NaN)."""
    verdict, result = row.get("verdict"), row.get("outcome")
    if verdict not in _VERDICTS or result not in _OUTCOMES:
        raise BadRecord(f"verdict {verdict!r}, outcome {result!r}: not the harness's words")
    if result == v.OK and verdict != v.PASS:
        raise BadRecord(f"outcome ok with verdict {verdict!r}: the harness never writes that")
    for name in _NUMBERS:
        x = row.get(name)
        if x is not None and (type(x) not in (int, float) or x != x):
            raise BadRecord(f"{name} {x!r}: not a finite number or null")


_FIELDS = tuple(f.name for f in fields(Record) if f.name != "extra")
_FIELD_SET = frozenset(_FIELDS)
# Written only where set (leak, padding, error and merged records).
_OPTIONAL = frozenset({"probed", "unprobed", "gated", "detectable", "false_alarm", "quiet",
                       "unsteady",
                       "fallback", "features", "convention", "diagnosis",
                       "judged_by", "violations", "traceback", "mode", "harness_error"})


@dataclass
class Trace:
    """One row's per-token max |error| (None where non-finite) for the plots, with the row's
    segments and each one's tolerance."""
    kernel: str
    case_id: str
    check: str
    row: int
    token_err: list
    segments: list            # [{"number", "start", "length"}]
    tolerance: dict           # str(segment number) -> tolerance

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, row: dict) -> Trace:
        return cls(**{f.name: row[f.name] for f in fields(cls)})
