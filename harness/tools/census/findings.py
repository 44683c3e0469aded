"""The census's reproducers: for a kernel with a failing check, `harness repro`'s minimal script
per finding: one for each feature set among its failing cases (its first failing case of that
set, shrunk), `<name>.py` for the cases without features and `<name>-<features>.py` for the
others (`maxtext_cudnn_flash_jax-window.py`); for a kernel that raised, a small script that
calls it on the smallest case it raised on and exits 1 while it raises. Beside each script,
`<name>.md` (a short upstream report: what, where, the numbers, the versions, the command) and
`<name>.txt` (the script's output on this machine)."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

from harness.errors import UsageError
from harness.judge import vocabulary as v
from harness.judge.record import Record
from harness.tools.census.scripts import error_script, report_text

# Checks `harness repro` can shrink (a tolerance check, or the leak probe), in its order.
SHRINKABLE = (*(c.name for c in v.TENSORS), v.LEAK.name)
NUMBERS_SHOWN = 8
CRASH_TEXT = "died while running it"   # harness.engine.workers's words for a dead worker


def safe_name(kernel: str) -> str:
    """A kernel's name as a file name ('tokamax:triton' -> 'tokamax_triton')."""
    return kernel.replace(":", "_").replace("/", "_")


def feature_groups(fails: list[Record]) -> dict[tuple[str, ...], list[Record]]:
    """The failing records by the feature set of their case (`Features.names`; () for the
    cases without features), in the order the sets first appear."""
    from harness.model.case import Case
    groups: dict[tuple[str, ...], list[Record]] = {}
    for r in fails:
        groups.setdefault(Case.from_id(r.case_id).features.names, []).append(r)
    return groups


def fail_stem(kernel: str, features: tuple[str, ...] = ()) -> str:
    """A fail reproducer's file name without its suffix: `<safe_name>` for the cases without
    features, `<safe_name>-<features joined by '-'>` for a feature set."""
    return "-".join((safe_name(kernel), *features))


def kernel_files(folder: Path, kernel: str, suffixes=(".py",)) -> list[Path]:
    """The kernel's reproducer files in `folder` with these suffixes: `<name>`, then
    `<name>-<features>` (in FEATURE_NAMES' order), then `<name>-error`."""
    from harness.model.features import FEATURE_NAMES
    if not folder.is_dir():
        return []
    feature = "|".join(map(re.escape, FEATURE_NAMES))
    pattern = re.compile(re.escape(safe_name(kernel))
                         + rf"(?P<features>(?:-(?:{feature}))*)(?P<error>-error)?")
    found = []
    for path in folder.iterdir():
        m = pattern.fullmatch(path.stem) if path.suffix in suffixes else None
        if m and not (m["features"] and m["error"]):
            names = m["features"].split("-")[1:]
            order = [FEATURE_NAMES.index(n) for n in names]
            found.append(((bool(m["error"]), len(order), order, suffixes.index(path.suffix)),
                          path))
    return [path for _, path in sorted(found)]


def versions(kernels) -> dict[str, dict[str, str | None]]:
    """kernel -> the version of each module it requires (its top-level package), read in the
    process that runs it."""
    from harness.engine.environment import package_version
    return {k.name: {m.split(".")[0]: package_version(m.split(".")[0]) for m in k.requires}
            for k in kernels}


def failing(records) -> list[Record]:
    """Records that show a wrong result: a failing check that the run judged (an unexpected
    failure, a caught bug, a known upstream one); not the unjudged (rounding-level) ones."""
    return [r for r in records if r.verdict == v.FAIL and r.outcome in (v.FAIL, v.CAUGHT,
                                                                          v.KNOWN)]


def raised(records) -> list[Record]:
    """Records of a kernel that raised (an error, or a declared upstream error: known); not
    the harness's own errors (its oracle raised, its reference non-finite): no script of the
    kernel reproduces those."""
    return [r for r in records if r.verdict == v.ERROR and not r.harness_error]


def write_findings(repro_dir: Path, kernels, header: dict, records: list[Record],
                   kernel_modules: list[str], command: str, max_runs: int) -> list[dict]:
    """Every kernel's reproducers; one dict per script written (or attempted): a fail
    reproducer per feature set among its failing cases (feature_groups), in the order they
    first appear, then its error reproducer. `header`: the part's run (environment, suite);
    `command`: the census command of the part."""
    written = []
    for kernel in kernels:
        mine = [r for r in records if r.kernel == kernel.name]
        fails, errors = failing(mine), raised(mine)
        if not fails and not errors:
            continue
        repro_dir.mkdir(parents=True, exist_ok=True)
        context = dict(header=header, versions=versions([kernel])[kernel.name],
                       command=command, records=mine, max_runs=max_runs,
                       kernel_modules=kernel_modules)
        name = safe_name(kernel.name)
        for features, group in feature_groups(fails).items():
            path = repro_dir / f"{fail_stem(kernel.name, features)}.py"
            written.append(fail_repro(kernel, group, path, context, features))
        if errors:
            path = repro_dir / (f"{name}-error.py" if fails else f"{name}.py")
            written.append(error_repro(kernel, errors, path, kernel_modules, context))
    return written


def _run_script(path: Path, needs_harness: bool) -> tuple[int | None, str]:
    """The script run with plain python in an empty folder (as `harness repro` checks its
    own); its output goes to <name>.txt."""
    from harness.tools.repro.command import verify
    code, output = verify(path, needs_harness)
    path.with_suffix(".txt").write_text(f"$ python {path.name}\n{output.rstrip()}\n"
                                        f"(exit status {code})\n")
    return code, output


def fail_repro(kernel, fails: list[Record], path: Path, context: dict,
               features: tuple[str, ...] = ()) -> dict:
    """`harness repro` on the first failing case (its first shrinkable check), then the
    script's run and the report text. `fails`: one feature set's failing records (`features`,
    () for the cases without any)."""
    from harness.tools.repro import main as repro_main
    from harness.tools.repro.command import reproduced
    from harness.tools.repro.source import kernel_source
    entry = {"kernel": kernel.name, "kind": "fail", "script": None, "report": None,
             "problem": None, "exit_status": None}
    if features:
        entry["features"] = list(features)
    shrinkable = [r for r in fails if r.check in SHRINKABLE]
    # The padding script runs the default program (out, dq, dk, dv): a row whose only
    # violation is the output's tangent (jvp) gets the no-script note below.
    padding = [r for r in fails if r.check == v.PADDING.name
               and set(r.violations or {}) - {v.JVP.name}]
    log = io.StringIO()
    if not shrinkable and padding:
        from harness.tools.census.padding_script import write_padding_repro
        case_id = write_padding_repro(kernel, padding, path, context["kernel_modules"])
        print(f"[census] padding reproducer for {kernel.name} on {case_id}", flush=True)
        code, output = _run_script(path, needs_harness=True)
        entry.update(case_id=case_id, check=v.PADDING.name, script=path.name, exit_status=code,
                     needs_harness=True, reproduced=code == 1 and "FAILED:" in output)
        if not entry["reproduced"]:
            entry["problem"] = f"the script did not show the failure (exit status {code})"
    elif not shrinkable:
        entry["note"] = ("its failures are in checks `harness repro` does not shrink ("
                         + ", ".join(sorted({r.check for r in fails})) + "): no script")
    else:
        case_id = shrinkable[0].case_id
        on_case = [r for r in shrinkable if r.case_id == case_id]
        check = min(on_case, key=lambda r: SHRINKABLE.index(r.check)).check
        entry.update(case_id=case_id, check=check)
        print(f"[census] repro {kernel.name} {check} on {case_id}", flush=True)
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                repro_main(kernel.name, case_id, check=check, output=str(path),
                           max_runs=context["max_runs"])
        except UsageError as exc:
            entry["problem"] = f"harness repro: {exc}"
        except Exception as exc:  # the census goes on; the report says what broke
            entry["problem"] = f"harness repro raised {type(exc).__name__}: {exc}"
        if path.exists():
            needs_harness = kernel_source(kernel)[1]
            code, output = _run_script(path, needs_harness)
            entry.update(script=path.name, exit_status=code, needs_harness=needs_harness,
                         reproduced=reproduced(code, output))
            if not entry["reproduced"] and not entry["problem"]:
                entry["problem"] = f"the script did not show the failure (exit status {code})"
    entry["repro_log"] = log.getvalue()[-4000:]
    entry["report"] = _write_report(path, kernel, fails, entry, context)
    return entry


def smallest_case(records: list[Record]) -> str:
    """The case id of the smallest case among the records (tokens x heads x head_dim)."""
    def size(r: Record) -> tuple:
        work = (r.batch or 0) * (r.seq_len or 0) * ((r.heads or 0) + 2 * (r.kv_heads or 0))
        return (work * (r.head_dim or 0), r.case_id)
    return min(records, key=size).case_id


def error_repro(kernel, errors: list[Record], path: Path, kernel_modules: list[str],
                context: dict) -> dict:
    """A script that calls the kernel (forward and backward, as the run did) on the smallest
    case it raised on, prints the error and exits 1 while it raises."""
    from harness.tools.repro.command import reproduced
    # Errors of the kernel's own program first: a leak-probe error (e.g. a deterministic build
    # that does not fit) may not show in the default program the script runs.
    direct = [r for r in errors if not r.message.startswith("leak probe:")] or errors
    case_id = smallest_case(direct)
    first = next(r for r in direct if r.case_id == case_id)
    modules = [str(Path(m).resolve()) if Path(m).exists() else m for m in kernel_modules]
    path.write_text(error_script(kernel, case_id, first, modules, context))
    print(f"[census] error reproducer for {kernel.name} on {case_id}", flush=True)
    code, output = _run_script(path, needs_harness=True)
    # A kernel whose worker died (harness.engine.workers) takes the script's process with it:
    # a death by a signal is that crash, shown.
    crashed = CRASH_TEXT in first.message and code is not None and code < 0
    entry = {"kernel": kernel.name, "kind": "error", "case_id": case_id, "script": path.name,
             "exit_status": code, "reproduced": reproduced(code, output) or crashed,
             "crash": crashed, "needs_harness": True, "problem": None}
    if not entry["reproduced"]:
        entry["problem"] = f"the script did not raise the error here (exit status {code})"
    entry["report"] = _write_report(path, kernel, errors, entry, context)
    return entry


def _write_report(path: Path, kernel, found: list[Record], entry: dict, context: dict) -> str:
    md = path.with_suffix(".md")
    md.write_text(report_text(kernel, found, entry, context, NUMBERS_SHOWN))
    return md.name
