"""The census's kernels and its options (kept free of jax: the CLI builds its parser from here
before anything is imported). The options it shares with a run (suite, cases, features, seeds,
kernels, kernel modules, the leak probe, the compilation cache) are the run's own declarations
(harness.engine.options); the census adds its part, its bench and its reproducers."""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path

from harness.engine import options as run_options
from harness.errors import UsageError

# Every packed-attention path a JAX user can pick, in the table's order: the dense references,
# the libraries' public calls, MaxText's paths, and the op. `tokamax:*` stands for every
# registered tokamax implementation.
CENSUS_KERNELS = (
    "dot_product", "xla", "pallas_mha", "jax_nn:cudnn", "jax_nn:cudnn_packed", "tokamax:*",
    "flash_attn:varlen", "flash_attn:varlen_vmap", "flash_attn3:varlen",
    "dew_flash_attn:*", "fa4:*", "tokamax17:*",
    "te:thd", "te:flax_segment_ids", "te:flax_seqlens_offsets",
    "maxtext:dot_product", "maxtext:cudnn_flash_jax", "maxtext:cudnn_flash_te", "maxtext:flash",
    "maxtext_fixed:cudnn_flash_jax", "maxtext_fixed:cudnn_flash_te",
    "maxtext_fixed:dot_product", "sut:cudnn_flash_jax", "sut:cudnn_flash_auto",
)

# A committed census lives in a folder named for what it shows; a run writes here unless told.
DEFAULT_REPORT_DIR = "reports/census-latest"
# The run options a census passes on to its run (the rest are the census's own).
SHARED = ("cases", "features", "seeds", "kernels", "kernel_modules", "leak_probe",
          "compilation_cache", "use_compilation_cache")


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
        raise UsageError(f"--part {text!r}: a part is a plain folder name (letters, digits, "
                         "'-', '_', '.')")
    return text


def positive(flag: str):
    def check(value) -> int:
        from harness.engine.options import whole_number
        n = whole_number(flag, value)
        if n < 1:
            raise UsageError(f"{flag} {value}: must be at least 1")
        return n
    return check


@dataclass(frozen=True)
class CensusOptions:
    """What a census does beyond its run (the run's options are a RunOptions)."""
    report_dir: str = DEFAULT_REPORT_DIR
    part: str = "all"
    suite: str | None = None          # None: nightly on a GPU, smoke on a CPU
    without: str | None = None
    shapes: str = "census"
    repeats: int = 10
    bench: bool = True
    repro: bool = True
    repro_runs: int = 40
    table_only: bool = False

    def checked(self) -> CensusOptions:
        part_name(self.part)
        run_options.check_path("--report-dir")(self.report_dir)
        return dataclasses.replace(self, repeats=positive("--repeats")(self.repeats),
                                   repro_runs=positive("--repro-runs")(self.repro_runs))

    @property
    def run_dir(self) -> Path:
        """Where the part's suite run writes its report."""
        return Path(self.report_dir) / "parts" / self.part / "nightly"

    @property
    def part_dir(self) -> Path:
        return Path(self.report_dir) / "parts" / self.part

    def resolved_suite(self) -> str:
        if self.suite:
            return self.suite
        from harness.engine.environment import nvidia_gpus
        return "nightly" if nvidia_gpus() else "smoke"

    @classmethod
    def from_args(cls, args) -> CensusOptions:
        if args.table_only:
            _refuse_with_table_only(args)
        out = cls(report_dir=args.report_dir, part=args.part, suite=args.suite,
                  without=args.without, shapes=args.shapes, repeats=args.repeats,
                  bench=not args.no_bench, repro=not args.no_repro,
                  repro_runs=args.repro_runs, table_only=args.table_only).checked()
        return dataclasses.replace(out, suite=out.resolved_suite())

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> CensusOptions:
        return cls(**data)


def _refuse_with_table_only(args) -> None:
    """--table-only runs nothing: an option that would shape a run (given, not its default)
    beside it is a mistake the harness names, not one it ignores."""
    defaults = argparse.ArgumentParser(add_help=False)
    add_arguments(defaults)
    given = sorted(a.option_strings[0] for a in defaults._actions
                   if a.dest not in ("report_dir", "table_only") and a.option_strings
                   and getattr(args, a.dest, a.default) != a.default)
    if given:
        raise UsageError(f"--table-only runs nothing: {', '.join(given)} would not apply "
                         "(it rebuilds the table of --report-dir from the parts present)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The census subcommand's options: the run's shared ones, then its own."""
    p.add_argument("--suite", default=None,
                   help="the suite the census runs (default: nightly on a GPU, smoke on a CPU)")
    shared = argparse.ArgumentParser(add_help=False)
    run_options.add_arguments(shared, run_options.RUN)
    for action in shared._actions:
        if action.dest in SHARED:
            p._add_action(action)
    p.add_argument("--without", metavar="KERNELS",
                   help="leave these out of the census set (comma-separated names or globs, "
                        "e.g. 'flash_attn*': another part runs them)")
    p.add_argument("--report-dir", default=DEFAULT_REPORT_DIR, metavar="DIR",
                   help="where the census goes (default %(default)s): parts/<part>/, repro/, "
                        "census.md, census.json")
    p.add_argument("--part", default="all",
                   help="this run's part (default %(default)s): parts run on different "
                        "machines, copied into one --report-dir, give one table")
    p.add_argument("--shapes", default="census",
                   help="the bench's shape set (default %(default)s: the seed shape and "
                        "1 x 8192; small on a CPU)")
    p.add_argument("--repeats", default=10,
                   help="timed bench samples per kernel and shape (default %(default)s)")
    p.add_argument("--no-bench", action="store_true", help="leave the bench out")
    p.add_argument("--no-repro", action="store_true",
                   help="write no reproducers for failures and errors")
    p.add_argument("--repro-runs", default=40,
                   help="kernel runs `harness repro` may spend shrinking one kernel's failing "
                        "case (default %(default)s; each new shape compiles anew)")
    p.add_argument("--table-only", action="store_true",
                   help="rebuild census.md and census.json from the parts present; run nothing")
