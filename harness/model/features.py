"""Attention features a case asks a kernel for, beyond the same-segment mask (causal or not).

    window      a sliding (local) window: query i reads key j of its segment only where
                pos_i - left <= pos_j <= pos_i + right (right is 0 under the causal mask);
                Mistral, Gemma 2/3, gpt-oss, MaxText attention_type=local_sliding
    softcap     logit soft capping: each score s becomes cap * tanh(s / cap); Gemma 2
    chunk       chunked attention: query i reads key j only in the same chunk of `chunk`
                positions; Llama 4, MaxText attention_type=chunk
    sinks       a learnable logit per query head added to each softmax's denominator (a
                "sink" that takes attention mass and gives no value); gpt-oss. Its gradient
                (dsinks) is checked like dq, dk and dv
    head_dim_v  the value's (and output's) head dim differs from the query's and key's (MLA)

Positions are within the segment (pos = token index - segment start), as a packed model's
positions are: a window reads the same keys either way (it depends on pos_i - pos_j), a chunk
does not (chunk boundaries at multiples of `chunk` from the segment's start, not the row's). A
kernel whose library documents chunks from the row's start declares that convention
(Kernel.conventions), and is judged against what it documents; the record names it.

In a case id the features follow the mask: `-w63.0` (window left 63, right 0), `-cap2`
(soft cap 2.0), `-ch64` (chunks of 64), `-sink`, `-dv32` (value head dim 32).
"""
from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from harness.errors import BrokenContract

WINDOW, SOFTCAP, CHUNK, SINKS, HEAD_DIM_V = "window", "softcap", "chunk", "sinks", "head_dim_v"
FEATURE_NAMES = (WINDOW, SOFTCAP, CHUNK, SINKS, HEAD_DIM_V)
NONE = "none"     # --features none: the cases without any feature

# Chunk conventions: where chunk 0 starts.
SEGMENT_START, ROW_START = "segment", "row"
CHUNK_CONVENTIONS = (SEGMENT_START, ROW_START)

# How a refusal names a feature: patterns searched (case-insensitive) in the error's message
# (never its type's name: "ValueError" would name the value head dim), each naming the feature
# itself, not a word a crash's message holds too ("cap" alone is in "capture", "soft" in
# "softmax", "value" in "invalid value", "window" in XLA's "reduce_window: window_dimensions").
# Drawn from the library messages in reports/census-features-h200 and their peers' spellings.
REFUSAL_PATTERNS = {
    WINDOW: (r"\bwindows?\b", r"\bwindow_(?:size|left|right|length)", r"sliding[_ ]window",
             r"\blocal[_ ](?:attention|mask)"),
    SOFTCAP: (r"soft[_ -]?cap", r"\blogits?[_ ]cap", r"\bcapping\b"),
    CHUNK: (r"\bchunk(?:s|ed|_size|_attention)?\b",),
    SINKS: (r"sinks?\b", r"softmax_type", r"softmax_offset", r"off_by_one",
            r"learnable[_ ]softmax", r"softmax type"),
    HEAD_DIM_V: (r"head_dim_v", r"\bhead[_ ]?dim(?:s|ension|ensions)?\b", r"\bv_?head",
                 r"\bvalue[_ ](?:shape|head|dim)"),
}
REFUSALS = {name: re.compile("|".join(p), re.IGNORECASE) for name, p in REFUSAL_PATTERNS.items()}

# An `assert` is a refusal only in a refusal's words (a library's `assert window_size ==
# (-1, -1), "sliding window not supported"`): a kernel's own invariant tripping in its window
# code ("sliding window band has shape (256, 257), expected (256, 256)", a cold review's
# mutant) is a crash, which read `refused` and left the run green. The other error types keep
# to naming the feature: the libraries' refusals in reports/ say "unsupported", "cannot",
# "should be", "differ".
# "must", "should" and "only" are an invariant's words as much ("window band must be (T, T)").
ASSERTED_REFUSAL = re.compile(r"support|\bcannot\b|can'?t\b|can not|not implemented"
                              r"|not allowed|not available|unavailable", re.IGNORECASE)

# Errors that are a program's bug, whatever their message says (a name, an attribute, a key or
# an index looked up and not there, arithmetic, a call with the wrong arguments, jax's tracer
# errors, which are TypeErrors): never a refusal. UnboundLocalError's message reads "cannot
# access local variable ... associated with a value"; jax's ConcretizationTypeError names the
# argument its tracer came from ("... the value of the argument window_size").
BUG_ERRORS = (NameError, AttributeError, LookupError, ArithmeticError, RecursionError,
              SyntaxError, ImportError, MemoryError, TypeError, BrokenContract)

# jax's own words for a program's shape bug, whatever type it raises them as: vmap's are
# ValueErrors naming each argument ("axis 0 of argument sinks of type float32[8]"), which read
# as a refusal of the sinks (an adversarial review's kernel, mapping its sinks over the batch:
# `refused`, the run green).
BUG_MESSAGES = re.compile(r"vmap got inconsistent sizes|vmap was requested to map"
                          r"|vmap in_axes|incompatible shapes for broadcasting", re.IGNORECASE)

# What a feature's drop looks like, for the diagnosis of a failing record.
WITHOUT = {WINDOW: "the window", SOFTCAP: "the soft cap", CHUNK: "the chunks",
           SINKS: "the sinks", HEAD_DIM_V: "the value head dim"}

SUFFIX = re.compile(r"-w(?P<left>\d+)\.(?P<right>\d+)|-cap(?P<cap>\d+(?:\.\d+)?)"
                    r"|-ch(?P<chunk>\d+)|(?P<sink>-sink)|-dv(?P<dv>\d+)")


@dataclass(frozen=True)
class Features:
    window: tuple[int, int] | None = None    # (left, right) in positions
    softcap: float | None = None
    chunk: int | None = None
    sinks: bool = False
    head_dim_v: int | None = None

    def __post_init__(self):
        if self.window is not None:
            left, right = self.window
            if left < 0 or right < 0:
                raise ValueError(f"window {self.window}: sizes are >= 0")
        if self.softcap is not None and not self.softcap > 0:
            raise ValueError(f"softcap {self.softcap}: must be above 0")
        if self.chunk is not None and self.chunk < 1:
            raise ValueError(f"chunk {self.chunk}: must be at least 1")
        if self.head_dim_v is not None and self.head_dim_v < 1:
            raise ValueError(f"head_dim_v {self.head_dim_v}: must be at least 1")

    @functools.cached_property
    def names(self) -> tuple[str, ...]:
        """The features present, in FEATURE_NAMES' order (worked out once: every record asks,
        1 s of the H200's warm nightly run thread at 4d948f1)."""
        present = {WINDOW: self.window is not None, SOFTCAP: self.softcap is not None,
                   CHUNK: self.chunk is not None, SINKS: self.sinks,
                   HEAD_DIM_V: self.head_dim_v is not None}
        return tuple(n for n in FEATURE_NAMES if present[n])

    def __bool__(self) -> bool:
        return bool(self.names)

    def without(self, name: str) -> Features:
        """These features less one."""
        from dataclasses import replace
        cleared = {WINDOW: None, SOFTCAP: None, CHUNK: None, SINKS: False, HEAD_DIM_V: None}
        return replace(self, **{name: cleared[name]})

    @property
    def suffix(self) -> str:
        out = ""
        if self.window is not None:
            out += f"-w{self.window[0]}.{self.window[1]}"
        if self.softcap is not None:
            out += f"-cap{self.softcap:g}"
        if self.chunk is not None:
            out += f"-ch{self.chunk}"
        if self.sinks:
            out += "-sink"
        if self.head_dim_v is not None:
            out += f"-dv{self.head_dim_v}"
        return out

    @classmethod
    def parse(cls, text: str) -> Features:
        """From a case id's feature suffix (`-w63.0-cap2`); '' is no feature."""
        values: dict = {}
        pos = 0
        for m in SUFFIX.finditer(text):
            if m.start() != pos:
                break
            pos = m.end()
            if m.group("left") is not None:
                values["window"] = (int(m.group("left")), int(m.group("right")))
            elif m.group("cap") is not None:
                values["softcap"] = float(m.group("cap"))
            elif m.group("chunk") is not None:
                values["chunk"] = int(m.group("chunk"))
            elif m.group("sink"):
                values["sinks"] = True
            else:
                values["head_dim_v"] = int(m.group("dv"))
        if pos != len(text):
            raise ValueError(f"not a feature suffix: {text[pos:]!r}")
        return cls(**values)

    def describe(self) -> str:
        parts = []
        if self.window is not None:
            left, right = self.window
            parts.append(f"window {left} back" + (f", {right} ahead" if right else ""))
        if self.softcap is not None:
            parts.append(f"soft cap {self.softcap:g}")
        if self.chunk is not None:
            parts.append(f"chunks of {self.chunk}")
        if self.sinks:
            parts.append("sinks")
        if self.head_dim_v is not None:
            parts.append(f"value head dim {self.head_dim_v}")
        return ", ".join(parts) or "no feature"
