#!/usr/bin/env python3
"""Runs every shell command block of README.md that needs no GPU, as written, in order, from
the repository root; exits 1 at the first block that fails.

A ```sh block runs unless the line before it (blank lines aside) is a comment
`<!-- not in CI's README step: REASON -->`: it needs a GPU, or another CI stage runs it. A
block marked `<!-- CI's Python 3.12 stage -->` runs only with --python312 (that stage runs it).
A block marked `<!-- CI's first stage: NAME -->` (the two commands) runs only with --run NAME:
CI runs them first, each timed, in the order it chooses.

    python3 scripts/readme_commands.py              # run them
    python3 scripts/readme_commands.py --run main-job   # one named block, timed
    python3 scripts/readme_commands.py --python312  # the Python 3.12 stage's blocks
    python3 scripts/readme_commands.py --list       # show which run and which not, and why
"""
from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SKIP = re.compile(r"<!--\s*not in CI's README step:\s*(?P<why>.*?)\s*-->")
PY312 = "<!-- CI's Python 3.12 stage -->"
FIRST = re.compile(r"<!--\s*CI's first stage:\s*(?P<name>[\w-]+)\s*-->")


def blocks(readme: str) -> list[tuple[str, str | None]]:
    """(commands, reason not to run or None) for each ```sh block."""
    out, lines, i = [], readme.splitlines(), 0
    while i < len(lines):
        if lines[i].strip() == "```sh":
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            before = next((line for line in reversed(lines[:i]) if line.strip()), "")
            skip, first = SKIP.search(before), FIRST.search(before)
            why = (skip.group("why") if skip else
                   f"CI's first stage runs it (--run {first.group('name')})" if first else
                   PY312 if PY312 in before else None)
            out.append(("\n".join(lines[i + 1:j]), why))
            i = j
        i += 1
    return out


def _run(n: int, total: int, commands: str) -> int:
    print(f"[{n}/{total}] $ {commands}", flush=True)
    start = time.monotonic()
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", commands], cwd=ROOT)
    print(f"[{n}/{total}] exit {done.returncode} after {time.monotonic() - start:.0f} s",
          flush=True)
    return done.returncode


def main(argv: list[str]) -> int:
    found = blocks((ROOT / "README.md").read_text())
    if "--run" in argv:
        name = argv[argv.index("--run") + 1]
        marked = [n for n, (_, why) in enumerate(found, 1) if why and f"--run {name})" in why]
        if len(marked) != 1:
            print(f"readme_commands: error: {len(marked)} blocks marked "
                  f"<!-- CI's first stage: {name} -->, not one", file=sys.stderr)
            return 2
        return 1 if _run(marked[0], len(found), found[marked[0] - 1][0]) else 0
    python312 = "--python312" in argv
    for n, (commands, why) in enumerate(found, 1):
        head = commands.splitlines()[0]
        if python312:
            why = None if why == PY312 else "not the Python 3.12 stage's"
        elif why == PY312:
            why = "CI's Python 3.12 stage runs it"
        if why or "--list" in argv:
            print(f"[{n}/{len(found)}] {'skip: ' + why if why else 'runs'}: {head}", flush=True)
            continue
        if _run(n, len(found), commands):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
