"""summary.md: the kernel x layout grid coloured by worst ratio, then every problem by segment,
what was not judged and why, every caught segment, the skips and where the time went. Fit for a
CI job summary or a pull-request comment."""
from __future__ import annotations

from collections import Counter, defaultdict
from pathlib import Path

from harness.judge import judging, tallies
from harness.judge import vocabulary as v
from harness.judge.record import Record
from harness.store.report_file import all_pairs, narrowed
from harness.views.summary import (
    coverage_lines,
    digest_lines,
    fmt,
    kept_text,
    NONE_BAD_SHARD_IDLE,
    named_idle_text,
    known_lines,
    refusal_lines,
    skipped_kernel_lines,
    margin_rows,
    not_judged_lines,
    outcome_text,
    padding_lines,
    power_rows,
    unfinished,
)

MARKS = {v.CELL_OK: "🟢", v.CELL_NEAR: "🟡", v.CELL_CAUGHT: "🔵", v.CELL_KNOWN: "🟠",
         v.CELL_REFUSED: "🟣", v.CELL_FAIL: "🔴", v.CELL_MISSED: "🔴", v.CELL_ERROR: "❌",
         v.CELL_SKIP: "⚪", v.CELL_NOT_RUN: "⚫"}


ENV_KEYS = ("device_kind", "device_count", "platform", "compute_capability", "jax", "jaxlib",
            "cudnn", "transformer_engine", "maxtext", "git_commit", "git_dirty", "time_utc")


def env_line(env: dict) -> str:
    """The environment in one line; a merge's values that differ between its runs (a list)
    are joined."""
    def shown(value) -> str:
        return " + ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    return " · ".join(f"{k}={shown(env.get(k))}" for k in ENV_KEYS if env.get(k) is not None)


def _seeds(header: dict) -> int:
    seeds = header.get("seeds")
    return seeds if isinstance(seeds, int) else 1


def run_line(header: dict, marked: bool = True) -> str:
    """The run in one line; `marked`: with an unfinished run's notice, in bold (markdown)."""
    suite = header.get("suite")
    if isinstance(suite, (list, tuple)):     # a merge of runs of several suites
        parts = [f"suites {', '.join(f'`{s}`' for s in suite)}"]
    else:
        parts = [f"suite `{suite}`"]
    if _seeds(header) > 1:
        parts.append(f"{header['seeds']} seeds")
    if header.get("wall_s") is not None:
        parts.append(f"wall time {header['wall_s']:.0f} s")
    cache = header.get("compilation_cache")
    if cache:
        warmth = "warm" if cache.get("hits") and not cache.get("misses") else (
            "cold" if not cache.get("hits") else "partly warm")
        parts.append(f"compilation cache {warmth} ({cache.get('hits', 0)} hits, "
                     f"{cache.get('misses', 0)} misses)")
        if cache.get("retried"):
            parts.append(f"{cache['retried']} compile(s) tried again after the host could not "
                         "start the compiler")
    if header.get("leak_probe") is False:
        parts.append("leak probe off (--no-leak-probe)")
    elif header.get("probe_mode"):
        parts.append(f"leak probe: {header['probe_mode']} build")
    if header.get("shard"):
        parts.append(f"shard {header['shard']}")
    total = all_pairs(header) or 0
    if narrowed(header):
        n = header.get("pairs_selected")
        parts.append(f"{n} of its {total} kernel x case pairs selected (pytest's -k, --deselect "
                     "or test ids)" if isinstance(n, int) else
                     "narrowed by pytest's -k, --deselect or test ids (in a source)")
    main_parts = header.get("main_parts") or {}
    counts = [str(n) for name, n in main_parts.items() if name != "main.deferred"]
    if len(counts) > 1:
        again = (f", {main_parts['main.deferred']} of them again for memory"
                 if "main.deferred" in main_parts else "")
        parts.append(f"main group in {len(counts)} workers at once ({', '.join(counts)} pairs"
                     f"{again})")
    elif main_parts.get("main.light"):     # headers before --main-workers
        parts.append(f"main group in two workers ({main_parts['main.light']} pairs beside "
                     f"the first, {main_parts.get('main.deferred', 0)} of them again for memory)")
    if header.get("rejudge_kept"):
        parts.append(f"rejudged, but {kept_text(header['rejudge_kept'])}")
    if header.get("run_again"):
        parts.append(f"{len(header['run_again'])} pair(s) run again in a fresh worker (a CUDA "
                     "graph capture broken, a worker killed while XLA compiled beside the "
                     "run, or one that died while it traced the pairs after: "
                     "harness/engine/capture.py, workers.py)")
    notice = unfinished(header) if marked else None
    if notice:
        parts.append(f"**{notice}**")
    return " · ".join(parts)


def timed_kernels(header: dict) -> tuple[list[tuple[str, dict]], str]:
    """The timing table's rows, longest wall first, without the kernels whose every column
    reads 0 (every case skipped, nothing traced); and the line that says how many those are
    ("" where none is)."""
    timing = header.get("timing") or {}
    rows = [(k, t) for k, t in timing.items()
            if any(isinstance(x, (int, float)) and round(x, 1) for x in t.values())]
    idle = len(timing) - len(rows)
    left_out = (f"{idle} {'more ' if rows else ''}row(s) read 0 in every column: left out."
                if idle else "")
    return sorted(rows, key=lambda kv: -kv[1].get("wall_s", 0)), left_out


def timing_lines(header: dict) -> list[str]:
    rows, left_out = timed_kernels(header)
    if not rows and not left_out:
        return []
    out = []
    if rows:
        out += ["wall: the run's time on the kernel (its checks and leak probe included; the "
                "oracle's computing of a case, done once for all its kernels, is the oracle's "
                "row); lower and compile happen beside the run, in other threads or in a "
                "lowering process (compile seconds add up over the threads compiling at once, "
                "and include loading a program the lowering process read from the cache); "
                "waited: how long the run stood still for a program not compiled yet, or for a "
                "trace's environment.", "",
                "| kernel | wall s | programs | lower s | compile s | waited s | runs | "
                "execute s | of which probe build s | host s |",
                "|---|---|---|---|---|---|---|---|---|---|"]
    for kernel, t in rows:
        out.append(f"| {kernel} | {t.get('wall_s', 0):.1f} | {t.get('programs', 0)} | "
                   f"{t.get('lower_s', 0):.1f} | {t.get('compile_s', 0):.1f} | "
                   f"{t.get('wait_s', 0):.1f} | {t.get('runs', 0)} | {t.get('execute_s', 0):.1f} "
                   f"| {t.get('probe_execute_s', 0):.1f} | {t.get('host_s', 0):.1f} |")
    if left_out:
        out += ["", left_out]
    if rows:
        out += ["", "host: the run's own work on the kernel beside the device and the compiler "
                "(per-token metrics, judging, the leak probe's comparisons, transfers, Python): "
                "wall less execute and waited. Of which probe build: the execute seconds of the "
                "leak probe's deterministic build (GPUs; on CPUs the probe runs the default "
                "build). The harness's own programs (per-token metrics, the probe's "
                "perturbations and comparisons, the jvp check's tangents) compile ahead, beside "
                "the kernels' in threads of their own (their row: waited is the run's wait for "
                "one still compiling, or its compiling of one still queued; their runs count "
                "in the kernel's host time)."]
    out += process_lines(header)
    cache = header.get("compilation_cache")
    if cache:
        out += ["", f"compilation cache `{cache.get('dir')}`: {cache.get('hits', 0)} programs "
                f"read from disk, {cache.get('misses', 0)} compiled and written"]
        apart = cache.get("lowering_process")
        if apart:
            out[-1] += (f"; {apart.get('loaded', 0)} programs traced and lowered in a "
                        "lowering process, read from the cache there and loaded by the run, "
                        f"{apart.get('lowered', 0)} lowered there that the cache lacked, "
                        "compiled by the run (not traced again), "
                        f"{apart.get('trace_errors', 0)} programs whose kernel's trace failed "
                        "there handed over as that error (refusals and declared crashes, raised "
                        "by the run as the kernel's own error, not traced again), "
                        f"{apart.get('built_here', 0)} built by the run after that process "
                        "could not hand them over")
            if apart.get("unasked"):
                out[-1] += (f", {apart['unasked']} it could not build left unbuilt: the run "
                            "never asked for them (a deterministic or forward build whose "
                            "trace failed there, of a pair that did not run it)")
            out += _built_here_why(apart.get("why") or {})
    return out


def process_lines(header: dict) -> list[str]:
    """Where a run in worker processes spent its wall time outside the table: each worker's
    start (imports, the device, its lowering process) and time on its pairs, and the join of
    their reports (the run's wall time covers them side by side, then the join). A worker
    that died wrote no header to say it: the line names it as untimed."""
    merged = header.get("merged_from") or []
    workers = [m for m in merged if m.get("startup_s") is not None]
    if not workers or header.get("merge_s") is None:
        return []
    each = "; ".join(f"{m.get('worker', m['path'])} {m['startup_s']:.1f} s starting, "
                     f"{m.get('wall_s') or 0:.1f} s on its pairs{_waits(m)}{_cpu(m)}"
                     for m in workers)
    untimed = [m.get("worker") or Path(m["path"]).parent.name for m in merged
               if m.get("startup_s") is None and Path(m["path"]).name == "report"]
    if untimed:   # beside them: the controller's crash records (`crashes/`), not a worker
        each += f"; untimed (died before writing a header): {', '.join(untimed)}"
    line = f"Worker processes: {each}; their reports joined in {header['merge_s']:.1f} s"
    stamped = [m for m in workers if m.get("began_at") is not None]
    if stamped and None not in (header.get("started_at"), header.get("joined_at")):
        first = min(m["began_at"] for m in stamped) - header["started_at"]
        last = header["joined_at"] - max(m["began_at"] + (m.get("wall_s") or 0)
                                         for m in stamped)
        line += (f" (from the run's start to the first worker's pairs {first:.1f} s; from the "
                 f"end of the last worker's pairs, its programs closed, to the join {last:.1f} "
                 "s: its exit, the controller's wait and bookkeeping"
                 + (", pytest's tests taking their records" if header.get("source") == "pytest"
                    else "") + ")")
    return ["", line + "."]


def _waits(worker: dict, named: int = 3) -> str:
    """How long the worker's run stood still of its time on its pairs, and its largest waits
    (rows of the timing table, which sums them over the workers side by side); older headers
    have none: ""."""
    if worker.get("wait_s") is None:
        return ""
    waits = worker.get("waits") or {}
    largest = ", ".join(f"{row} {s:.1f} s" for row, s in list(waits.items())[:named])
    more = ", ..." if len(waits) > named else ""
    return f", of which {worker['wait_s']:.1f} s waiting" + (f" [{largest}{more}]"
                                                              if largest else "")


def _cpu(worker: dict) -> str:
    """A worker's CPU seconds over its life: its own, its lowering processes' (where it had
    any) and its other child processes' (XLA's ptxas on GPUs, and tools it ran), and how many
    of its cores they kept busy together on average over its start and pairs (older headers
    have none: ""; those before lowering_cpu_s counted every child as a lowering process)."""
    if worker.get("cpu_s") is None:
        return ""
    children = worker.get("children_cpu_s") or 0
    used = worker["cpu_s"] + children
    life, cores = (worker.get("startup_s") or 0) + (worker.get("wall_s") or 0), worker.get("cores")
    busy = f"; together {used / life:.1f} of {cores} cores busy on average" \
        if life > 0 and cores else ""
    lowering = worker.get("lowering_cpu_s")
    if lowering is None:
        parts = [f"its child processes {children:.0f} s"]
    else:
        parts = [f"its lowering processes {lowering:.0f} s"]
        if children - lowering >= 0.5:
            parts.append(f"its other child processes (XLA's ptxas, tools) "
                         f"{children - lowering:.0f} s")
    return f" (CPU {worker['cpu_s']:.0f} s, {', '.join(parts)}{busy})"


def _built_here_why(why: dict) -> list[str]:
    """Why the lowering process did not hand programs over: a line per reason, its kernels
    with the most programs first."""
    out = []
    for reason, names in sorted(why.items(), key=lambda kv: -sum(kv[1].values())):
        kernels = sorted(names.items(), key=lambda kv: (-kv[1], kv[0]))
        listed = ", ".join(f"{name} {n}" for name, n in kernels[:8])
        more = f", {len(kernels) - 8} more kernels" if len(kernels) > 8 else ""
        out.append(f"- {reason}: {sum(names.values())} ({listed}{more})")
    return ["", "Built by the run, and why:", ""] + out if out else []


def _problem_table(rows: list[Record]) -> list[str]:
    out = ["| kernel | check | segment | tokens | max abs err | tolerance | ratio | worst token | case id |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        label = r.where + (" (missed)" if r.outcome == v.MISSED else "")
        ratio = v.has_ratio(r.check)
        out.append(
            f"| {r.kernel} | {r.check} | {label} | {r.tokens} "
            f"| {fmt(r.max_abs_err)} | {fmt(r.tolerance) if ratio else v.rule(r.check)} "
            f"| {fmt(r.ratio) if ratio else '—'} | {r.worst_token} | `{r.case_id}` |")
    return out


def _caught_segments(caught: list[Record]) -> list[str]:
    """One row per caught segment: the checks that caught it and its worst ratio."""
    by_segment: dict[tuple, list[Record]] = defaultdict(list)
    for r in caught:
        by_segment[(r.kernel, r.case_id, r.row, r.segment)].append(r)
    out = ["| kernel | segment | tokens | caught by | worst ratio | case id |",
           "|---|---|---|---|---|---|"]
    for (kernel, case_id, _, _), rows in by_segment.items():
        r0 = rows[0]
        has_ratio, worst = tallies.worst_ratio(rows)
        out.append(f"| {kernel} | {r0.where} | {r0.tokens} "
                   f"| {', '.join(r.check for r in rows)} "
                   f"| {tallies.ratio_text(worst) if has_ratio else 'bitwise'} | `{case_id}` |")
    return out


def _largest(caught: list[Record]) -> str:
    tolerance = [r for r in caught if v.has_ratio(r.check)]
    if tolerance:
        worst = max(tolerance, key=lambda r: float("inf") if r.ratio is None else r.ratio)
        return (f"- largest: `{worst.kernel}` {worst.check} {worst.segment_label} of "
                f"`{worst.case_id}`, ratio {tallies.ratio_text(worst.ratio)}, worst token "
                f"{worst.worst_token}")
    worst = max(caught, key=lambda r: r.max_abs_err or 0.0)
    return (f"- largest: `{worst.kernel}` {worst.check} {worst.where} of `{worst.case_id}`, "
            f"max change {fmt(worst.max_abs_err)}, first changed token {worst.worst_token}")


def _grid(records: list[Record]) -> list[str]:
    kernels, layouts, cells = tallies.grid(records)
    if not kernels:
        return ["| kernel | layouts |", "|---|---|", "| (none: no record was written) | |"]
    out = ["| kernel | " + " | ".join(layouts) + " |", "|---|" + "---|" * len(layouts)]
    for kernel in kernels:
        row = []
        for layout in layouts:
            cell = cells.get((kernel, layout))
            row.append("" if cell is None else f"{MARKS[cell.status]} {cell.text}")
        out.append(f"| {kernel} | " + " | ".join(row) + " |")
    return out


NONE_BAD = "None: every kernel expected to pass passed, every expected failure was caught."
NONE_BAD_NOT_RUN = ("None among the checks that ran: some did not run, or the leak probe could "
                    "not compare some tensors (listed below); those are no pass.")
NONE_BAD_UNFINISHED = ("None among the pairs here; the report is incomplete (the run did not "
                       "finish, or shards are missing), so it is not a pass.")


def none_bad(records: list[Record], header: dict | None = None) -> str:
    """What "no problem" says, in summary.md and report.html alike: incomplete where the run
    did not finish; not a pass where a kernel the run named judged nothing (tallies.
    named_idle); a pass only where every check ran (--no-leak-probe, or tensors the probe
    could not compare: "every kernel expected to pass passed" overstated it)."""
    if unfinished(header or {}):
        return NONE_BAD_UNFINISHED
    if deaths := tallies.unblamed(header):
        return tallies.unblamed_text(deaths)
    if idle := tallies.named_idle(records, header):
        return named_idle_text(idle)
    if tallies.shard_idle(records, header):
        return NONE_BAD_SHARD_IDLE
    return NONE_BAD_NOT_RUN if tallies.not_run(records) or tallies.unprobed(records) \
        else NONE_BAD


def _problems(records: list[Record], header: dict | None = None) -> list[str]:
    bad = tallies.bad(records)
    out = ["", f"## Problems ({len(bad)})", ""]
    if tallies.judged_nothing(records, header):
        out.append("**Nothing was judged**: no check measured anything (every kernel x case "
                   "skipped, or the run stopped before the first finished). This run is not a "
                   "pass.")
    else:
        if deaths := tallies.unblamed(header):   # said beside the problems too
            out.append(f"**{tallies.unblamed_text(deaths)}**.")
        if idle := tallies.named_idle(records, header):
            out.append(f"**{named_idle_text(idle)}**.")
        if not bad:
            if not (idle or deaths) or unfinished(header or {}):
                out.append(none_bad(records, header))
            return out
    digest = digest_lines(records)
    if digest:
        out += ["Per failing kernel and check: how many failed, the worst ratio, the first "
                "(every segment follows).", ""] + [f"- {line}" for line in digest] + [""]
    located = [r for r in bad if r.where and r.expected != v.EITHER and r.outcome != v.ERROR]
    if located:
        out += _problem_table(located)
    unjudged_missed = [r for r in bad if r.segment and r.expected == v.EITHER]
    if unjudged_missed:
        out += ["", "### Checks nothing judged", ""]
        out += [f"- `{r.kernel}` {r.check} {r.segment_label} of `{r.case_id}`: {r.message}"
                for r in unjudged_missed]
    explained = [r for r in bad if r.check in (v.PADDING.name, v.CONTRACT.name)
                 or (r.nonfinite and r.where)]
    if explained:
        out += ["", "### What the failing padding, contract and non-finite checks found", ""]
        out += [f"- `{r.kernel}` {r.check} {r.where} of `{r.case_id}`: {r.message[:300]}"
                for r in explained]
    errors = [r for r in bad if r.outcome == v.ERROR or r.check == v.KERNEL_LEVEL]
    if errors:
        out += ["", "### Errors", "", "Each error record's `traceback` field in report.jsonl "
                "holds the end of its traceback (`python -m harness run --kernels <kernel> "
                "--cases '<case id>'` shows it again).", ""]
        out += [f"- `{r.kernel}` on `{r.case_id}`: {r.outcome}: {r.message[:300]}"
                for r in errors]
    return out


def _leak_power(records: list[Record]) -> list[str]:
    rows = power_rows(records)
    if not rows:
        return []
    out = ["", "## Leak probe: power and false alarms", "",
           "The smallest leak the probe could have seen per tensor, as a fraction of the "
           "tensor's largest value ('bitwise': any change counts), and the probability that "
           "noise alone gave a false leak verdict anywhere in this run (tensors decided above "
           "their run-to-run noise; 0 where every tensor was compared bitwise). A tensor "
           "marked 'no noise seen' was gated although its reruns agreed (a build not "
           "reproducible by construction), at the floor threshold: no rate can be measured "
           "for it.", "",
           "| kernel | smallest detectable leak | false-alarm probability (run) |", "|---|---|---|"]
    out += [f"| {k} | {d} | {p} |" for k, d, p in rows]
    return out


def _caught_section(records: list[Record]) -> list[str]:
    caught = [r for r in records if r.outcome == v.CAUGHT]
    if not caught:
        return []
    out = ["", "## Expected failures caught", ""]
    per = Counter((r.kernel, r.check) for r in caught)
    out += [f"- `{k}` {c}: {n} segments" for (k, c), n in sorted(per.items())]
    out.append(_largest(caught))
    table = _caught_segments(caught)
    out += ["", f"<details><summary>every caught segment ({len(table) - 2})</summary>", ""]
    return out + table + ["", "</details>"]


def render(header: dict, records: list[Record]) -> str:
    out = ["# Attention harness report", "",
           f"{run_line(header)} · {env_line(header.get('environment', {}))}", "",
           f"outcomes: {outcome_text(records)}", "",
           f"🟢 pass (ratio ≤ {judging.NEAR_RATIO}) · 🟡 pass ({judging.NEAR_RATIO} < ratio ≤ 1) · "
           "🔵 expected failure caught · "
           "🟠 known upstream failure, reproduced · 🟣 a feature refused before computing · "
           "🔴 unexpected failure or missed catch · "
           "❌ error · ⚪ skipped · ⚫ some checks not run (the leak probe was off, or could not compare a segment). "
           "A cell reads segments passing every check / segments "
           "measured, and the worst error/tolerance ratio.", ""]
    out += _grid(records)
    idle = skipped_kernel_lines(records)
    if idle:
        out += ["", f"Kernels that skipped every case ({len(idle)}):", ""]
        out += [f"- `{line.split(':', 1)[0]}`:{line.split(':', 1)[1]}" for line in idle]
    out += _problems(records, header)
    refused = refusal_lines(records)
    if refused:
        out += ["", f"## Features refused before computing ({len(refused)})", ""]
        out += [f"- {line}" for line in refused]
    known = known_lines(records)
    if known:
        out += ["", f"## Known upstream bugs ({sum(tallies.known(records).values())} checks)", ""]
        out += [f"- {line}" for line in known]
    n_unjudged = tallies.counts(records).get(v.UNJUDGED, 0)
    out += ["", f"## Not judged ({n_unjudged} checks; {sum(tallies.unprobed(records).values())} "
            "unprobed tensors)", ""]
    out += [f"- {line}" for line in not_judged_lines(records)] or ["Every check was judged."]
    coverage = coverage_lines(records)
    if coverage:
        out += ["", "Leak-probe coverage below 100%:", ""] + [f"- {line}" for line in coverage]
    out += _leak_power(records)
    padding = padding_lines(records)
    if padding:
        out += ["", "## Padding hygiene", ""] + [f"- {line}" for line in padding]
    out += _caught_section(records)
    skips = Counter((r.kernel, r.message) for r in records if r.outcome == v.SKIP)
    if skips:
        out += ["", "## Skipped", ""]
        out += [f"- `{k}` ({n}): {why}" for (k, why), n in sorted(skips.items())]
    if _seeds(header) > 1:
        out += ["", f"## Margin over {header['seeds']} seeds", "",
                "The worst error/tolerance ratio of each case (every seed, every check and "
                "segment expected to pass; a known upstream bug's checks are listed above) of "
                "each kernel expected to pass: its distribution.", "",
                "| kernel | cases | min | median | p95 | max | over 1 |", "|---|---|---|---|---|---|---|"]
        out += [f"| {k} | {n} | {lo} | {med} | {p95} | {hi} | {over} |"
                for k, n, lo, med, p95, hi, over in margin_rows(records)]
    timing = timing_lines(header)
    if timing:
        out += ["", "## Where the time went", ""] + timing
    out += ["", "Reproduce one case: `python -m harness run --suite <suite> --kernels <kernel> "
            "--cases '<case id>'`; shrink a failure to a standalone script: "
            "`python -m harness repro <kernel> '<case id>'`.", ""]
    return "\n".join(out)


def write_markdown(path: Path, header: dict, records: list[Record]) -> None:
    path.write_text(render(header, records))
