"""The options of a run, declared once.

`RunOptions` is what a run of the matrix is asked to do: which kernels and cases, where the
report goes, the leak probe's mode, the baseline, the compilation cache. Every option is one
`Option` below: its flag, its default, its help and its check. The CLI's flags
(harness.cli) and pytest's options (harness.pytest_plugin) are generated from these
declarations, and `RunOptions.checked()` runs every check once, whoever built the options (the
CLI, pytest, the census, a test). A value that fails its check is a UsageError of one line
naming the option.

Options reach a worker process as JSON (`to_json` / `from_json`), never as an argv.
"""
from __future__ import annotations

import dataclasses
import math
import re
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from harness.errors import UsageError

DEFAULT_CACHE_DIR = os.environ.get("HARNESS_COMPILATION_CACHE",
                                   os.path.join("~", ".cache", "attention-harness", "jax"))
CLI_REPORT_DIR = "reports/latest"
PYTEST_REPORT_DIR = "reports/pytest"


# ----- checks: each returns the value as the run uses it, or raises UsageError --------------

def check_names(flag: str, text: str | None, what: str) -> tuple[str, ...] | None:
    """Comma-separated names: None where not given; empty or repeated names are mistakes."""
    if text is None:
        return None
    names = [n.strip() for n in text.split(",")]
    if not any(names):
        raise UsageError(f"{flag} {text!r}: names no {what} (leave the option out for all)")
    if "" in names:
        raise UsageError(f"{flag} {text!r}: an empty name between commas")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise UsageError(f"{flag} {text!r}: {', '.join(repeated)} named twice")
    return tuple(names)


def check_kernels(text):
    return check_names("--kernels", text, "kernel")


def check_cases(text):
    return check_names("--cases", text, "case glob")


def check_features(text):
    from harness.model.features import FEATURE_NAMES, NONE
    names = check_names("--features", text, "feature")
    if names is None:
        return None
    unknown = [n for n in names if n not in (*FEATURE_NAMES, NONE)]
    if unknown:
        raise UsageError(f"--features {', '.join(unknown)}: unknown; known: "
                         f"{', '.join(FEATURE_NAMES)}, or {NONE} (cases without features)")
    return names


def whole_number(flag: str, value) -> int:
    # Plain digits: int() would take "1_0" or " 2", and run another number than was written.
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if not isinstance(value, str) or not re.fullmatch(r"-?[0-9]+", value):
        raise UsageError(f"{flag} {value!r}: not a whole number")
    return int(value)


# More seeds than this is a mistake (each case is built once per seed before any glob is
# matched): 1,000 seeds of the nightly are 1.7 million kernel x case pairs.
MAX_SEEDS = 1000


def check_seeds(value) -> int:
    seeds = whole_number("--seeds", value)
    if not 1 <= seeds <= MAX_SEEDS:
        raise UsageError(f"--seeds {value}: must be 1 to {MAX_SEEDS}")
    return seeds


MAIN_WORKERS = 1      # --main-workers' default (harness.engine.main_parts)


def check_main_workers(value) -> int:
    n = whole_number("--main-workers", value)
    if not 1 <= n <= 8:
        raise UsageError(f"--main-workers {value}: must be 1 to 8")
    return n


def check_shard(text) -> str | None:
    if text is None:
        return None
    # Plain digits: int() would take "0_1" or " 1" and the header would say another text.
    match = re.fullmatch(r"(0|[1-9][0-9]*)/(0|[1-9][0-9]*)", str(text))
    if match is None:
        raise UsageError(f"--shard {text!r}: expected I/N, e.g. 1/4") from None
    index, count = (int(x) for x in match.groups())
    if not 1 <= index <= count:
        raise UsageError(f"--shard {text!r}: I must be between 1 and N")
    return f"{index}/{count}"


def check_growth(value) -> float:
    if isinstance(value, str) and not re.fullmatch(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)"
                                                   r"([eE][+-]?[0-9]+)?|[+-]?(nan|inf)", value,
                                                   re.IGNORECASE):
        raise UsageError(f"--growth {value!r}: not a number")
    try:
        growth = float(value)
    except (TypeError, ValueError):
        raise UsageError(f"--growth {value!r}: not a number") from None
    if not math.isfinite(growth) or not growth > 1:
        raise UsageError(f"--growth {value}: must be a finite factor above 1 (an error grown "
                         "by more than it is a regression)")
    return growth


def check_path(flag: str) -> Callable:
    def check(text):
        if text is None:
            return None
        if not str(text).strip():
            raise UsageError(f"{flag} {text!r}: an empty path")
        return str(text)
    return check


def check_cache_path(text):
    """--compilation-cache, whose default HARNESS_COMPILATION_CACHE may set: an empty one is
    named as what the user set."""
    if text is not None and not str(text).strip() and text == DEFAULT_CACHE_DIR:
        raise UsageError(f"HARNESS_COMPILATION_CACHE {text!r}: an empty path (unset it for the "
                         "default folder, or name one)")
    return check_path("--compilation-cache")(text)


def check_cache_choice(directory, off: bool) -> None:
    """--no-compilation-cache beside --compilation-cache DIR (given, not the default): which
    one the user meant, the harness cannot tell."""
    if off and directory is not None:
        raise UsageError(f"--no-compilation-cache with --compilation-cache {directory}: give "
                         "one of them")


def check_modules(values) -> tuple[str, ...]:
    out = []
    for v in values or ():
        if not str(v).strip():
            raise UsageError(f"--kernel-module {v!r}: an empty path")
        same = [o for o in out if os.path.realpath(o) == os.path.realpath(str(v))]
        if same:
            raise UsageError(f"--kernel-module {v}: given twice (as {same[0]} too)")
        out.append(str(v))
    return tuple(out)


# ----- the declarations ---------------------------------------------------------------------

RUN, LIST, PYTEST = "run", "list", "pytest"


@dataclass(frozen=True)
class Option:
    """One option: `name` is RunOptions' field; `flag` its command-line spelling; `switch`
    options are on/off flags that turn the field to False (`--no-leak-probe`); `repeat`
    options take the flag several times; `where`: which commands offer it."""
    name: str
    flag: str
    help: str
    check: Callable[[Any], Any] = lambda v: v
    switch: bool = False
    repeat: bool = False
    metavar: str | None = None
    where: frozenset = frozenset({RUN, PYTEST})


OPTIONS = (
    Option("suite", "--suite", "the suite: smoke (CPU, minutes) or nightly (GPU)",
           where=frozenset({RUN, LIST, PYTEST})),
    Option("cases", "--cases", "glob(s) over case ids, comma-separated, to narrow the suite "
           "(each must match a case); an exact case id is taken as is, in the suite or not "
           "(another seed, a feature with another mask or dtype: docs/features.md)",
           check_cases, metavar="GLOBS", where=frozenset({RUN, LIST, PYTEST})),
    Option("features", "--features", "only the cases with these attention features "
           "(comma-separated: window, softcap, chunk, sinks, head_dim_v; none: the cases "
           "without any)", check_features, metavar="NAMES",
           where=frozenset({RUN, LIST, PYTEST})),
    Option("seeds", "--seeds", "run every case under N seeds (its own and the next ones)",
           check_seeds, metavar="N"),
    Option("shard", "--shard", "run shard I of N of the suite (join the parts with "
           "`harness merge`)", check_shard, metavar="I/N"),
    Option("kernels", "--kernels", "comma-separated kernel names (default: every registered "
           "kernel)", check_kernels, metavar="NAMES", where=frozenset({RUN, LIST, PYTEST})),
    Option("kernel_modules", "--kernel-module", "a Python file (or an importable module) that "
           "calls harness.register_kernel (repeatable)", check_modules, repeat=True,
           metavar="PATH", where=frozenset({RUN, LIST, PYTEST})),
    Option("report_dir", "--report-dir", "where the report goes", check_path("--report-dir"),
           metavar="DIR"),
    Option("baseline", "--baseline", "a baseline report (folder or file) to compare the run "
           "with at its end", check_path("--baseline"), metavar="PATH"),
    Option("growth", "--growth", "an error grown by more than this factor beyond its measured "
           "spread is a regression (a baseline of one run, which measured no spread: past "
           "5x, or above half the tolerance; harness/judge/regression.py)", check_growth,
           metavar="FACTOR"),
    Option("leak_probe", "--no-leak-probe", "tolerance checks only: the views say the probe "
           "did not run, and the checks only it could judge are shown as not run",
           switch=True),
    Option("deterministic_probe", "--no-deterministic-probe", "probe the kernels' default "
           "builds on GPUs too: a tensor that differs in its reruns (made where a perturbation "
           "moved a token that must not move) is then decided above its noise, and one whose "
           "reruns agree is compared bitwise", switch=True),
    Option("compilation_cache", "--compilation-cache", "jax's persistent compilation cache "
           "(HARNESS_COMPILATION_CACHE sets it too)", check_cache_path,
           metavar="DIR"),
    Option("use_compilation_cache", "--no-compilation-cache", "compile everything afresh and "
           "keep nothing on disk", switch=True),
    Option("lowering_process", "--no-lowering-process", "trace and lower every program in "
           "the run's own processes, not in a lowering process beside each that finds them in "
           "jax's cache (harness/engine/lowering_process.py)", switch=True),
    Option("main_workers", "--main-workers", "on GPUs, run the kernels without an isolation "
           "group in N worker processes at once, whole shapes to each, sharing the three "
           "quarters of the device one worker has (a pair that lacks memory there runs again "
           "at the end, alone, with those three quarters; harness/engine/main_parts.py); no "
           "effect on CPUs, or where XLA_CLIENT_MEM_FRACTION or the like is set",
           check_main_workers, metavar="N"),
)
BY_NAME = {o.name: o for o in OPTIONS}


@dataclass(frozen=True)
class RunOptions:
    """What a run of the matrix is asked to do (see OPTIONS for each field's meaning)."""
    suite: str = "smoke"
    cases: tuple[str, ...] | None = None
    features: tuple[str, ...] | None = None
    seeds: int = 1
    shard: str | None = None
    kernels: tuple[str, ...] | None = None
    kernel_modules: tuple[str, ...] = ()
    report_dir: str = CLI_REPORT_DIR
    baseline: str | None = None
    growth: float = 2.0
    leak_probe: bool = True
    deterministic_probe: bool = True
    compilation_cache: str = DEFAULT_CACHE_DIR
    use_compilation_cache: bool = True
    main_workers: int = MAIN_WORKERS
    lowering_process: bool = True
    # Not options of a user: where the run comes from ("cli", "pytest", "census", "worker").
    source: str = field(default="cli", compare=False)

    def checked(self) -> RunOptions:
        """Every option's check, once: the options as the run uses them (comma-separated
        text becomes tuples), or a UsageError naming the first bad one."""
        changes = {}
        for opt in OPTIONS:
            value = getattr(self, opt.name)
            if opt.switch:
                continue
            if opt.name in ("cases", "kernels", "features") and isinstance(value, tuple):
                value = ",".join(value)
            changes[opt.name] = opt.check(value) if value is not None or opt.repeat else None
        if changes["suite"] is None or not str(changes["suite"]).strip():
            raise UsageError("--suite: give a suite name (smoke or nightly)")
        out = dataclasses.replace(self, **changes)
        if out.baseline and _same_path(out.baseline, out.report_dir):
            raise UsageError(f"--baseline {out.baseline}: the run's own --report-dir; a "
                             "baseline is an earlier run")
        return out

    @property
    def shard_part(self) -> tuple[int, int] | None:
        from harness.store.report_file import shard_part
        return shard_part(self.shard)

    @property
    def cache_dir(self) -> str | None:
        return self.compilation_cache if self.use_compilation_cache else None

    def selection(self) -> dict:
        """What the run selected, in its header: two runs that selected alike are compared
        pair for pair (a missing pair is then a regression)."""
        out = {"suite": self.suite, "cases": _joined(self.cases), "seeds": self.seeds,
               "shard": self.shard, "kernels": _joined(self.kernels)}
        if self.features is not None:  # absent from older headers: they still compare alike
            out["features"] = _joined(self.features)
        return out

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> RunOptions:
        known = {f.name for f in dataclasses.fields(cls)}
        values = {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()
                  if k in known}
        return cls(**values)

    @classmethod
    def from_values(cls, get: Callable[[str], Any], **fixed) -> RunOptions:
        """From a command line's values (`get(name)`: argparse's namespace, pytest's
        config), switches included; then checked."""
        check_cache_choice(get("compilation_cache"), bool(get("use_compilation_cache")))
        values = {}
        for opt in OPTIONS:
            value = get(opt.name)
            if opt.switch:
                values[opt.name] = not value
            elif value is not None and not (opt.repeat and not value):
                values[opt.name] = tuple(value) if opt.repeat else value
        values.update(fixed)
        return dataclasses.replace(cls(), **values).checked()


def _joined(names):
    return None if names is None else ",".join(names)


def _same_path(a: str, b: str) -> bool:
    from pathlib import Path
    pa, pb = Path(a).resolve(), Path(b).resolve()
    return pa == pb or pa == pb / "report.jsonl" or pa == pb / "report.jsonl.gz"


# Left None on the command line (the default comes from RunOptions): the harness can then tell
# a path given beside --no-compilation-cache from the default one (check_cache_choice).
UNSET_ON_COMMAND_LINE = ("compilation_cache",)


def parser_default(name: str, where: str) -> Any:
    return None if name in UNSET_ON_COMMAND_LINE else default(name, where)


def default(name: str, where: str) -> Any:
    """An option's default as the command `where` shows it."""
    if name == "report_dir":
        return PYTEST_REPORT_DIR if where == PYTEST else CLI_REPORT_DIR
    return getattr(RunOptions(), name)


# ----- generated command lines --------------------------------------------------------------

def _help(opt: Option, where: str) -> str:
    value = default(opt.name, where)
    if opt.switch or value is None or opt.repeat:
        return opt.help
    return f"{opt.help} (default {value})"


def add_arguments(parser, where: str = RUN) -> None:
    """The options of `where` on an argparse parser (the CLI's run and list)."""
    import argparse

    def typed(check):
        def parse(text):
            try:
                return check(text)
            except UsageError as exc:
                raise argparse.ArgumentTypeError(str(exc)) from None
        return parse
    for opt in OPTIONS:
        if where not in opt.where:
            continue
        help_ = _help(opt, where).replace("%", "%%")
        if opt.switch:
            parser.add_argument(opt.flag, dest=opt.name, action="store_true", help=help_)
        elif opt.repeat:
            parser.add_argument(opt.flag, dest=opt.name, action="append", default=[],
                                metavar=opt.metavar, help=help_)
        else:
            # Checked once, in RunOptions.checked: the parser keeps the text.
            parser.add_argument(opt.flag, dest=opt.name, default=parser_default(opt.name, where),
                                metavar=opt.metavar, help=help_)


def add_pytest_options(group) -> None:
    """The same options as pytest options (harness.pytest_plugin)."""
    for opt in OPTIONS:
        if PYTEST not in opt.where:
            continue
        help_ = _help(opt, PYTEST)
        if opt.switch:
            group.addoption(opt.flag, dest=opt.name, action="store_true", help=help_)
        elif opt.repeat:
            group.addoption(opt.flag, dest=opt.name, action="append", default=[],
                            metavar=opt.metavar, help=help_)
        else:
            group.addoption(opt.flag, dest=opt.name, default=parser_default(opt.name, PYTEST),
                            metavar=opt.metavar, help=help_)
