"""Pieces of a repro script's text that both script writers use: what a writer hands the
assembler (`ScriptParts`), comments, and literals for arrays and numbers."""
from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass

import numpy as np

# The check, in words, for the script's header.
CHECK_WORDS = {
    "out": "the forward output",
    "dq": "the query gradient dq (jax.vjp, random output cotangent, zero at padding)",
    "dk": "the key gradient dk (jax.vjp, random output cotangent, zero at padding)",
    "dv": "the value gradient dv (jax.vjp, random output cotangent, zero at padding)",
    "leak": ("the leak probe: a segment's out, dq, dk and dv must stay bitwise the same when "
             "the tokens outside its mask (other segments, padding, keys beyond a window or "
             "chunk) are redrawn"),
}


@dataclass
class ScriptParts:
    """What one kind of script (a tolerance check's, the leak probe's) puts into the common
    frame that harness.tools.repro.script assembles."""
    found: str                  # the worst segment's numbers, in words (the header)
    method: str                 # the header's last paragraph: what the script does
    imports: list[str]          # the script's import lines (and what must precede them)
    segments_comment: str       # the comment above SEGMENTS
    segment_rows: list[str]     # the rows of SEGMENTS
    constants: list[str]        # constants after KERNEL_KWARGS
    inputs_title: str           # the title of the section that draws the inputs
    body: list[str]             # the chunks after the inputs: functions and main()


def comment_lines(text: str, width: int = 98) -> list[str]:
    """Comment lines, each paragraph wrapped; continuation lines of an indented line align with
    its text after the first word ("  segment  r0s2 ..." continues under "r0s2")."""
    out = []
    for para in text.split("\n"):
        m = re.match(r"^( +)(\S+ +)?", para)
        if m is None:
            indent = ""
        elif m.group(2) and len(m.group(1)) <= 2:
            indent = " " * m.end()
        else:
            indent = m.group(1)
        lines = textwrap.wrap(para, width - 2, break_long_words=False, break_on_hyphens=False,
                              subsequent_indent=indent, drop_whitespace=True) or [""]
        if m:  # textwrap keeps the first line's indent; restore it if dropped
            lines[0] = para[:len(m.group(1))] + lines[0].lstrip()
        out += ["#" + (" " + line if line else "") for line in lines]
    return out


def array_literal(a: np.ndarray, indent: str = "    ", width: int = 96) -> str:
    """The rows of a 2-d integer array as list literals, wrapped at `width`."""
    rows = []
    for row in a.tolist():
        text, line = [], indent + "["
        for i, x in enumerate(row):
            piece = f"{x}" + (", " if i < len(row) - 1 else "],")
            if len(line) + len(piece) > width:
                text.append(line.rstrip())
                line = indent + " "
            line += piece
        text.append(line)
        rows.append("\n".join(text))
    return "\n".join(rows)


def number_literal(x) -> str:
    """A float as a literal; `float("inf")` for None or a non-finite value."""
    if x is None:
        return "float(\"inf\")"
    x = float(x)
    return repr(x) if np.isfinite(x) else "float(\"inf\")"
