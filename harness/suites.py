"""Named suites: which cases a run covers. Smoke is small enough for 2 CPU cores; nightly is
sized for one Hopper GPU."""
from __future__ import annotations

import fnmatch

from harness.cases import Case
from harness.layouts import LAYOUTS


def smoke() -> list[Case]:
    cases = []
    for layout in LAYOUTS:
        cases.append(Case(layout, 4, 256, 4, 4, 32, "float32", seed=0))
        cases.append(Case(layout, 4, 256, 4, 2, 64, "bfloat16", seed=0))
    for layout in ("packed/random", "unaligned/block-edges"):
        cases.append(Case(layout, 4, 256, 4, 4, 64, "float16", seed=1))
    return cases


def nightly() -> list[Case]:
    cases = []
    for layout in LAYOUTS:
        cases.append(Case(layout, 4, 2048, 8, 2, 128, "bfloat16", seed=0))   # GQA
        cases.append(Case(layout, 4, 1024, 8, 8, 64, "bfloat16", seed=1))    # MHA
    for layout in ("packed/random", "unaligned/block-edges", "extremes/single-tokens"):
        cases.append(Case(layout, 4, 2048, 8, 8, 128, "float16", seed=2))
    for layout in ("packed/random", "unaligned/odd"):
        cases.append(Case(layout, 2, 1024, 8, 1, 256, "bfloat16", seed=3))    # MQA, head_dim 256
    for layout in ("packed/many", "unpacked/pad-tail", "extremes/long", "unaligned/block-edges"):
        cases.append(Case(layout, 1, 8192, 16, 4, 128, "bfloat16", seed=5))   # long rows
    return cases


SUITES = {"smoke": smoke, "nightly": nightly}


def suite_cases(name: str, pattern: str | None = None) -> list[Case]:
    """The suite's cases; `pattern` (a glob over case ids, comma-separated) narrows them."""
    if name not in SUITES:
        raise KeyError(f"unknown suite {name!r}; known: {', '.join(SUITES)}")
    cases = SUITES[name]()
    if pattern:
        globs = [p.strip() for p in pattern.split(",") if p.strip()]
        cases = [c for c in cases if any(fnmatch.fnmatch(c.id, g) for g in globs)]
    return cases
