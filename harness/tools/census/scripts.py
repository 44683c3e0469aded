"""The texts the census writes beside its findings: an error reproducer's script, and the short
upstream report (`<name>.md`) beside every reproducer."""
from __future__ import annotations

from collections import Counter

from harness.judge import vocabulary as v
from harness.judge.record import Record, first_line as record_first_line

_ERROR_SCRIPT = '''#!/usr/bin/env python3
# Error reproducer written by `python -m harness census`: @KERNEL@ raised on @CASE@
# in the census (@OUTCOME@): @MESSAGE@
#
# It calls the kernel as the census did (forward and backward through jax.vjp, jitted) on that
# case's inputs, prints the error and exits 1 while the kernel raises; 0 once it runs, 2 where
# it cannot run here (another device, a library missing). It imports attention-harness for the
# kernel and the case: run it from inside the harness's checkout, or with the checkout on
# PYTHONPATH, in the environment the census ran in (the same libraries).
import sys
import traceback
from pathlib import Path

KERNEL = @KERNEL_LIT@
CASE_ID = @CASE_LIT@
KERNEL_MODULES = @MODULES@  # what registered the kernel (--kernel-module)
SEEN = @MESSAGE_LIT@


def find_harness() -> None:
    try:
        import harness  # noqa: F401
        return
    except ImportError:
        pass
    for folder in Path(__file__).resolve().parents:
        if (folder / "harness" / "__init__.py").is_file():
            sys.path.insert(0, str(folder))
            return
    sys.exit("attention-harness is not importable: run with PYTHONPATH=<its checkout>")


def main() -> int:
    find_harness()
    import jax

    from harness.engine.environment import current_platform, package_version
    from harness.engine.program_functions import kernel_fn
    from harness.engine.registry import load_kernel_module, mark_absl_flags_parsed, select_kernels
    from harness.model.case import Case, make_inputs

    mark_absl_flags_parsed()
    for module in KERNEL_MODULES:
        load_kernel_module(module)
    kernel = select_kernels([KERNEL])[0]
    case = Case.from_id(CASE_ID)
    libraries = ", ".join(f"{m} {package_version(m.split('.')[0])}" for m in kernel.requires)
    print(f"{KERNEL} on {CASE_ID}; jax {jax.__version__}" + (f", {libraries}" if libraries else ""))
    reasons = kernel.unsupported_reasons(case, current_platform())
    if reasons:
        print(f"cannot run here: {'; '.join(reasons)}")
        return 2
    program = jax.jit(kernel_fn(kernel, case))
    try:
        jax.block_until_ready(program(*make_inputs(case).args))
    except Exception as exc:
        traceback.print_exc(file=sys.stdout)  # in order with the lines around it
        first = (str(exc).strip().splitlines() or [""])[0][:300]
        print(f"FAILED: {KERNEL} raises {type(exc).__name__}: {first}")
        return 1
    print(f"no error: {KERNEL} ran {CASE_ID} forward and backward (the census saw: {SEEN})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
'''


def first_line(text: str, width: int = 300) -> str:
    return record_first_line(text.strip(), width)


def error_script(kernel, case_id: str, record: Record, modules: list[str], context) -> str:
    message = first_line(record.message)
    fills = {"@KERNEL_LIT@": repr(kernel.name), "@CASE_LIT@": repr(case_id),
             "@MODULES@": repr(modules), "@MESSAGE_LIT@": repr(message),
             "@KERNEL@": kernel.name, "@CASE@": case_id, "@OUTCOME@": record.outcome,
             "@MESSAGE@": message.replace("\n", " ")[:150]}
    text = _ERROR_SCRIPT
    for key, value in fills.items():
        text = text.replace(key, value)
    return text


# ----- the upstream report text ----------------------------------------------------------------

def _value(x) -> str:
    return " / ".join(map(str, x)) if isinstance(x, list) else str(x)


def _cases_run(records: list[Record]) -> int:
    return len({r.case_id for r in records if r.verdict != v.SKIP})


def _and(features) -> str:
    """('window', 'sinks') -> 'window and sinks' (the features a reproducer's cases ask for)."""
    return " and ".join(features)


def _what(kernel, found: list[Record], entry: dict, context: dict) -> list[str]:
    records, suite = context["records"], context["header"].get("suite", "")
    cases = sorted({r.case_id for r in found})
    if entry["kind"] == "error":
        outcomes = Counter(r.outcome for r in found)
        lines = [f"{kernel.name} raises on {len(cases)} of the {_cases_run(records)} {suite} "
                 f"cases it was given: `{first_line(found[0].message)}`."]
        if kernel.expect_error and outcomes.get(v.KNOWN):
            lines.append(f"The harness declares this upstream error (expect_error "
                         f"`{kernel.expect_error}`): its records are `known`, not `error`.")
        return lines
    checks = sorted({r.check for r in found}, key=lambda c: list(v.CHECKS).index(c))
    outcomes = ", ".join(f"{o} {n}" for o, n in Counter(r.outcome for r in found).items())
    lines = [f"{kernel.name} fails the {', '.join(checks)} check(s) on {len(cases)} of the "
             f"{_cases_run(records)} {suite} cases it ran: {len(found)} failing records "
             f"(segments, padded rows), outcomes {outcomes}."]
    if entry.get("features"):
        lines.append(f"These are its failures on the cases asking for {_and(entry['features'])}"
                     " (the census writes a reproducer per feature set a kernel fails on).")
    reasons = sorted({r.message for r in found if r.outcome == v.KNOWN and r.message})
    lines += [f"Known upstream (the kernel's expectation): {m}" for m in reasons[:3]]
    if any(r.outcome == v.CAUGHT for r in found):
        lines.append("The harness expects these failures (the kernel declares them): "
                     "they are `caught`, a known bug shown where it must show.")
    return lines


def _numbers(found: list[Record], shown: int) -> list[str]:
    from harness.views.summary import describe_problem
    lines = [f"- {describe_problem(r)}" for r in found[:shown]]
    if len(found) > shown:
        lines.append(f"- ... and {len(found) - shown} more records (the part's nightly report)")
    return lines


def _versions(context: dict) -> list[str]:
    env = context["header"].get("environment", {})
    keys = ("device_kind", "compute_capability", "python", "jax", "jaxlib", "cudnn",
            "transformer_engine", "maxtext")
    lines = [", ".join(f"{k} {_value(env[k])}" for k in keys if env.get(k) is not None)]
    libs = context["versions"]
    if libs:
        lines.append("the kernel's libraries: " + ", ".join(f"{m} {x}" for m, x in libs.items()))
    commit = env.get("git_commit")
    if commit:
        lines.append(f"attention-harness commit {_value(commit)}"
                     + (" (with uncommitted changes)" if env.get("git_dirty") else ""))
    return [f"- {line}" for line in lines if line]


def _reproduce(entry: dict, context: dict) -> list[str]:
    if not entry.get("script"):
        lines = [f"No script: {entry.get('note') or entry.get('problem') or 'see the census'}."]
    else:
        what = ("raises" if entry["kind"] == "error" else "shows the failure")
        lines = ["```sh", f"python {entry['script']}", "```",
                 f"It exits 1 while the kernel {what}; its output on the census machine: "
                 f"`{entry['script'][:-3]}.txt` (exit status {entry['exit_status']})."]
        if entry.get("needs_harness"):
            lines.append("It imports attention-harness for the kernel: run it inside the "
                         "harness's checkout (or with the checkout on PYTHONPATH), with the "
                         "libraries the census ran with (on the H200 runner: the bundles' "
                         "`activate.sh`).")
        if entry.get("crash"):
            lines.append("The kernel crashes its process (as the census's worker died): the "
                         "script dies with it, by the signal in its exit status.")
        log = [ln for ln in entry.get("repro_log", "").splitlines()
               if ln.split(":")[0] in ("original case", "shrunk case", "failing")]
        lines += ["", "From `harness repro`:", "```", *log, "```"] if log else []
    if entry.get("problem"):
        lines += ["", f"Note: {entry['problem']}."]
    lines += ["", f"The census that found it: `{context['command']}`"]
    return lines


def _adapter(kernel) -> str:
    fn = getattr(kernel.fn, "func", kernel.fn)  # a functools.partial: its function
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', '?')}"


def report_text(kernel, found: list[Record], entry: dict, context: dict, shown: int) -> str:
    """`<name>.md`: what, where, the numbers, the versions, the command."""
    if entry["kind"] == "error":
        headline = f"raises `{first_line(found[0].message, 120)}`"
    else:
        headline = "wrong results on packed rows"
        if entry.get("features"):
            headline += f" with {_and(entry['features'])}"
    where = [f"- the call: {kernel.description or kernel.name}",
             f"- the harness's adapter: `{_adapter(kernel)}`"]
    if entry.get("case_id"):
        where.append(f"- the case: `{entry['case_id']}`" + (
            f" (check `{entry['check']}`)" if entry.get("check") else ""))
    parts = [f"# {kernel.name}: {headline}", "", *_what(kernel, found, entry, context), "",
             "## Where", *where, "", "## The numbers", *_numbers(found, shown), "",
             "## Versions", *_versions(context), "", "## Reproduce", *_reproduce(entry, context)]
    return "\n".join(parts) + "\n"
