#!/usr/bin/env python3
"""Runs the shell command blocks of README.md and docs/*.md as written, in order, from the
repository root; exits 1 at the first block that fails.

A ```sh block runs unless the line before it (blank lines aside) marks it:
    <!-- needs a GPU[: why] -->          never here (CI has no GPU)
    <!-- not in CI: REASON -->           never here, for the reason given
    <!-- CI's Python 3.12 stage -->      only with --python312 (CI's Python 3.12 stage)
    <!-- CI's first stage: NAME -->      only with --run NAME (CI runs the two commands first,
                                         each timed)

    python3 scripts/readme_commands.py              # every block that runs here, in order
    python3 scripts/readme_commands.py --run main-job   # one named block, timed
    python3 scripts/readme_commands.py --python312  # the Python 3.12 stage's blocks
    python3 scripts/readme_commands.py --list       # which run, which not, and why
"""
from __future__ import annotations

import argparse
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GPU = re.compile(r"<!--\s*needs a GPU\s*(?::\s*(?P<why>.*?))?\s*-->")
SKIP = re.compile(r"<!--\s*not in CI:\s*(?P<why>.*?)\s*-->")
PY312 = "<!-- CI's Python 3.12 stage -->"
FIRST = re.compile(r"<!--\s*CI's first stage:\s*(?P<name>[\w-]+)\s*-->")


def pages() -> list[Path]:
    """README.md, then docs/*.md in name order: the pages whose commands must run as written."""
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def blocks(text: str) -> list[tuple[str, str | None]]:
    """(commands, reason not to run or None) for each ```sh block of a page."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        if lines[i].strip() == "```sh":
            j = i + 1
            while lines[j].strip() != "```":
                j += 1
            before = next((line for line in reversed(lines[:i]) if line.strip()), "")
            gpu, skip, first = GPU.search(before), SKIP.search(before), FIRST.search(before)
            why = ("needs a GPU" + (f": {gpu.group('why')}" if gpu.group("why") else "")
                   if gpu else
                   skip.group("why") if skip else
                   f"CI's first stage runs it (--run {first.group('name')})" if first else
                   PY312 if PY312 in before else None)
            out.append(("\n".join(lines[i + 1:j]), why))
            i = j
        i += 1
    return out


def all_blocks() -> list[tuple[str, str, str | None]]:
    """(page, commands, why not) over every page, in order."""
    return [(page.relative_to(ROOT).as_posix(), commands, why)
            for page in pages() for commands, why in blocks(page.read_text())]


def _run(label: str, commands: str) -> int:
    print(f"[{label}] $ {commands}", flush=True)
    start = time.monotonic()
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", commands], cwd=ROOT, check=False)
    print(f"[{label}] exit {done.returncode} after {time.monotonic() - start:.0f} s", flush=True)
    return done.returncode


def _arguments(argv: list[str]) -> argparse.Namespace:
    """The options; --help prints this script's doc and runs nothing."""
    parser = argparse.ArgumentParser(prog="readme_commands.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--run", metavar="NAME",
                       help="the one block marked <!-- CI's first stage: NAME -->, timed")
    which.add_argument("--python312", action="store_true",
                       help="the blocks marked <!-- CI's Python 3.12 stage -->")
    parser.add_argument("--list", action="store_true",
                        help="say which blocks run and which not (and why); run none")
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _arguments(argv)
    found = all_blocks()
    if args.run is not None:
        name = args.run
        marked = [(page, c) for page, c, why in found if why and f"--run {name})" in why]
        if len(marked) != 1:
            print(f"readme_commands: error: {len(marked)} blocks marked "
                  f"<!-- CI's first stage: {name} -->, not one", file=sys.stderr)
            return 2
        if args.list:
            print(f"[{marked[0][0]} {name}] runs: {marked[0][1].splitlines()[0]}")
            return 0
        return 1 if _run(f"{marked[0][0]} {name}", marked[0][1]) else 0
    python312 = args.python312
    for n, (page, commands, why) in enumerate(found, 1):
        head = commands.splitlines()[0]
        label = f"{n}/{len(found)} {page}"
        if python312:
            why = None if why == PY312 else "not the Python 3.12 stage's"
        elif why == PY312:
            why = "CI's Python 3.12 stage runs it"
        if why or args.list:
            print(f"[{label}] {'skip: ' + why if why else 'runs'}: {head}", flush=True)
            continue
        if _run(label, commands):
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
