"""The census's kernels and its command line (kept free of jax: the CLI builds its parser from
here before anything is imported)."""
from __future__ import annotations

import argparse

# Every packed-attention path a JAX user can pick (issue 18), in the table's order: the dense
# references, the libraries' public calls, MaxText's paths, and the op. `tokamax:*` stands for
# every registered tokamax implementation.
CENSUS_KERNELS = (
    "dot_product", "xla", "pallas_mha", "jax_nn:cudnn", "tokamax:*",
    "flash_attn:varlen", "flash_attn:varlen_vmap", "flash_attn3:varlen",
    "te:thd", "te:flax_segment_ids", "te:flax_seqlens_offsets",
    "maxtext:dot_product", "maxtext:cudnn_flash_jax", "maxtext:cudnn_flash_te",
    "maxtext_fixed:cudnn_flash_jax", "sut:cudnn_flash_jax", "sut:cudnn_flash_auto",
)

DEFAULT_REPORT_DIR = "reports/census"


def census_names(registered) -> list[str]:
    """The census set among the registered kernel names (in CENSUS_KERNELS's order)."""
    names = list(registered)
    out = []
    for entry in CENSUS_KERNELS:
        if entry.endswith(":*"):
            out += [n for n in names if n.startswith(entry[:-1])]
        elif entry in names:
            out.append(entry)
    return list(dict.fromkeys(out))


def part_name(text: str) -> str:
    """--part: a folder name under parts/ (letters, digits, '-', '_', '.')."""
    if not text or not all(ch.isalnum() or ch in "-_." for ch in text) or text[0] == ".":
        raise argparse.ArgumentTypeError(f"{text!r}: a part is a plain folder name (letters, "
                                         "digits, '-', '_', '.')")
    return text


def add_arguments(p: argparse.ArgumentParser, add_compilation, seed_count) -> None:
    """The census subcommand's options (cli.py passes its shared helpers)."""
    p.add_argument("--suite", default="nightly",
                   help="the suite the census runs (default %(default)s; smoke on a CPU)")
    p.add_argument("--cases", help="glob(s) over case ids, comma-separated, to narrow the suite")
    p.add_argument("--seeds", type=seed_count, default=1,
                   help="run every case under N seeds (default %(default)s)")
    p.add_argument("--kernels", help="comma-separated kernel names (default: the census set "
                                     "that is registered; harness/tools/census/options.py)")
    p.add_argument("--without", metavar="KERNELS",
                   help="leave these out of the census set (comma-separated names or globs, "
                        "e.g. 'flash_attn*': another part runs them)")
    p.add_argument("--kernel-module", action="append", default=[], metavar="PATH",
                   help="a Python file (or module) that registers kernels (repeatable)")
    p.add_argument("--report-dir", default=DEFAULT_REPORT_DIR, metavar="DIR",
                   help="where the census goes (default %(default)s): parts/<part>/, repro/, "
                        "census.md, census.json")
    p.add_argument("--part", type=part_name, default="all",
                   help="this run's part (default %(default)s): parts run on different "
                        "machines, copied into one --report-dir, give one table")
    p.add_argument("--shapes", default="census",
                   help="the bench's shape set (default %(default)s: the seed shape and "
                        "1 x 8192; small on a CPU)")
    p.add_argument("--repeats", type=seed_count, default=10,
                   help="timed bench samples per kernel and shape (default %(default)s)")
    p.add_argument("--no-bench", action="store_true", help="leave the bench out")
    p.add_argument("--no-repro", action="store_true",
                   help="write no reproducers for failures and errors")
    p.add_argument("--repro-runs", type=seed_count, default=40,
                   help="kernel runs `harness repro` may spend shrinking one kernel's failing "
                        "case (default %(default)s; each new shape compiles anew)")
    p.add_argument("--table-only", action="store_true",
                   help="rebuild census.md and census.json from the parts present; run nothing")
    p.add_argument("--no-leak-probe", action="store_true",
                   help="tolerance checks only (the table then says the probe did not run)")
    p.add_argument("--after-run", action="store_true", help=argparse.SUPPRESS)  # a group's child
    add_compilation(p)
