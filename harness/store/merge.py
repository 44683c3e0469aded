"""Joining report folders into one: the workers of a run, the parts of a pytest run, the shards
of a suite. A kernel x case in a later source replaces the same one from an earlier source,
unless the later source only skipped it: a skip never hides what was measured."""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from harness.judge.vocabulary import SKIP, UNBLAMED_FIELD, made_by_merge
from harness.store import report_file as rec
from harness.store.writer import FINISHED, INTERRUPTED, RUNNING

# What a merged header keeps of its sources' (shared, or the list of their values).
RUN_FACTS = ("seeds", "shard", "probe_mode", "leak_probe", "interrupted", "stopped_by",
             "shards_filled")


def merge_timing(timings: list[dict]) -> dict:
    """Per-kernel seconds and counts summed over workers or shards."""
    out: dict[str, dict] = {}
    for timing in timings:
        for kernel, t in (timing or {}).items():
            acc = out.setdefault(kernel, {})
            for k, v in t.items():
                acc[k] = round(acc.get(k, 0) + v, 3)
    return out


def merged_environment(environments: list[dict]) -> dict:
    """One environment for several runs: a value they share, or the list of their values."""
    keys = list(dict.fromkeys(k for env in environments for k in env))
    out = {}
    for key in keys:
        values = list(dict.fromkeys(json.dumps(env.get(key)) for env in environments))
        values = [json.loads(v) for v in values]
        present = [v for v in values if v is not None]
        out[key] = present[0] if len(present) == 1 else (present or None)
    return out


def probe_modes(runs: list[dict]) -> list[str]:
    """The probe modes the run's processes name: a process that ran no probe (pytest's tests
    took their records from the lanes) names none, so it adds no "default" beside the lanes'."""
    return sorted({r["probe_mode"] for r in runs if r.get("probe_mode")}) or ["default"]


def merge_cache(headers: list[dict]) -> dict | None:
    """The compilation cache's hits and misses (and compiles retried) summed over the sources'
    processes."""
    seen = [h["compilation_cache"] for h in headers if h.get("compilation_cache")]
    if not seen:
        return None
    dirs = sorted({str(c.get("dir")) for c in seen})
    out = {"dir": dirs[0] if len(dirs) == 1 else dirs,
           "hits": sum(c.get("hits", 0) for c in seen),
           "misses": sum(c.get("misses", 0) for c in seen)}
    retried = sum(c.get("retried", 0) for c in seen)
    if retried:
        out["retried"] = retried
    apart = [c["lowering_process"] for c in seen if c.get("lowering_process")]
    if apart:
        out["lowering_process"] = {k: sum(a.get(k, 0) for a in apart)
                                   for k in ("loaded", "lowered", "trace_errors",
                                             "built_here")}
        unasked = sum(a.get("unasked", 0) for a in apart)
        if unasked:
            out["lowering_process"]["unasked"] = unasked
        why = merge_timing([a.get("why") for a in apart])   # reason -> kernel -> programs
        if why:
            out["lowering_process"]["why"] = {r: dict(sorted(why[r].items()))
                                              for r in sorted(why)}
    return out


def shards_of(header: dict) -> list[str]:
    """The shard texts "I/N" a report holds: its own, or a merged report's (flat, however many
    merges deep; older merged headers nested them)."""
    out: list[str] = []
    stack = [header.get("shard")]
    while stack:
        x = stack.pop()
        if isinstance(x, list):
            stack.extend(x)
        elif x is not None:
            out.append(x)
    return sorted(set(out))


def merged_shards(headers: list[dict]):
    """The joined header's `shard`: the one shard its sources share, the sorted list of their
    shards, or None."""
    shards = sorted({s for h in headers for s in shards_of(h)})
    return None if not shards else shards[0] if len(shards) == 1 else shards


def _unsharded(selection: dict | None) -> dict | None:
    """A selection without its shard, its lists in one order (report_file.canonical)."""
    return None if selection is None else {k: x for k, x in rec.canonical(selection).items()
                                           if k != "shard"}


def merged_selection(headers: list[dict]) -> dict | None:
    """What the joined report selected: the sources' common selection; where they are the
    shards I/N of one selection (sources that are merges of shards included), that selection
    unsharded (a shard that never reported then leaves pairs missing, which a comparison with
    a baseline of the whole suite counts as regressions)."""
    chosen = [h.get("selection") for h in headers]
    if not chosen or any(c is None for c in chosen):
        return None
    rest = [_unsharded(c) for c in chosen]
    if any(r != rest[0] for r in rest):
        return None
    shards = {s for h in headers for s in shards_of(h)}
    if len(shards) <= 1 and len({c.get("shard") for c in chosen}) == 1:
        return chosen[0]
    parts = [rec.shard_part(x) for x in shards]
    if shards and None not in parts and len({n for _, n in parts}) == 1:
        return {**chosen[0], "shard": None}   # as the first source wrote it
    return None


# What shards of one run share in their environment: the code and what it ran on. Not the
# host, the start time, the Python or optional libraries each runner has (the workflow asks
# for Python >= 3.11, Transformer Engine where it installs), and unknown (None) on either side
# is not a difference.
SHARED = ("git_commit", "git_dirty", "jax", "jaxlib", "platform", "device_kind",
          "compute_capability")


def check_shards(headers: list[dict], names: list[str]) -> None:
    """`harness merge` of shards: those of one selection, dealt out into one N, run by the
    same code on the same kind of device, or a UsageError naming the first that is not
    (shards of 1/3 and 2/2 merged as whole, of two selections, or a stale shard of another
    commit, lost or mixed pairs without a word). A source that is itself a merge of shards is
    held to the same, through each of its shards."""
    from harness.errors import UsageError
    first, code = None, None
    sharded = any(rec.shard_part(s) is not None for h in headers for s in shards_of(h))
    for name, h in zip(names, headers):
        env = {k: (h.get("environment") or {}).get(k) for k in SHARED}
        # Beside shards, every source, sharded or not: an unsharded rerun of another commit (or
        # a dirty tree) would replace their records with its own (a "fixed" rerun hiding the
        # night's FAILs). Reports without shards merge as they are (a CPU run and a GPU run).
        if not sharded:
            continue
        if code is None:
            code = (name, env)
        elif why := _env_differs(env, code[1]):
            raise UsageError(f"harness merge: {name} and {code[0]} were not run by the same code "
                             f"on the same kind of device ({why}); a merge joins reports of one "
                             "commit and device")
        parts = [p for s in shards_of(h) if (p := rec.shard_part(s)) is not None]
        if not parts:
            continue
        if h.get("selection") is None:
            raise UsageError(f"harness merge: {name} holds shards ({', '.join(shards_of(h))}) "
                             "but records no selection (a merge of unlike parts, or an older "
                             "harness): its shards cannot be checked against the others")
        counts = sorted({n for _, n in parts})
        if len(counts) > 1:
            raise UsageError(f"harness merge: {name} holds shards of {counts[0]} and "
                             f"{counts[1]}; shards merge into one report only from one sharded "
                             "run")
        this = (name, counts[0], _unsharded(h["selection"]), env)
        if first is None:
            first = this
            continue
        why = (f"{this[1]} shards against {first[1]}" if this[1] != first[1]
               else "their selections differ: suite, cases, seeds, kernels or features"
               if this[2] != first[2] else _env_differs(this[3], first[3]))
        if why:
            raise UsageError(f"harness merge: {name} and {first[0]} are not shards of one run "
                             f"({why}); shards merge into one report only from one sharded run")


def _env_differs(env: dict, first: dict) -> str | None:
    """The environment facts two shards do not share, named (at most three), or None."""
    keys = [k for k in SHARED if None not in (env.get(k), first.get(k))
            and env.get(k) != first.get(k)]
    return "; ".join(f"{k} {env.get(k)!r} vs {first.get(k)!r}" for k in keys[:3]) or None


def missing_shards(headers: list[dict], whole: bool = False) -> list[str]:
    """The shards I/N absent from sources that are two or more shards of one N (whose joined
    selection is then the whole, merged_selection), or with `whole` (`harness merge`: the
    shards of a suite joined into the whole) one or more: the pairs they would have brought
    are not in the joined report, which is therefore not a pass
    (harness.judge.tallies.unfinished). A run's own join of its workers' or lanes' parts, each
    of its one shard, leaves `whole` off."""
    present = [s for h in headers for s in shards_of(h)]
    # The sharded sources alone: an unsharded rerun beside them does not complete them.
    parts = [p for x in present if (p := rec.shard_part(x)) is not None]
    counts, have = {n for _, n in parts}, {i for i, _ in parts}
    if len(counts) != 1 or len(have) < (1 if whole else 2):
        return []
    n = counts.pop()
    # Shards past the selection's cases hold none and never ran (run_info's shards_filled).
    # A merge of shards keeps theirs (RUN_FACTS): a list where its sources' differ.
    filled = min([x for h in headers if h.get("shards_filled") for x in (
        h["shards_filled"] if isinstance(h["shards_filled"], list) else [h["shards_filled"]])]
        or [n])
    return [f"{i}/{n}" for i in range(1, filled + 1) if i not in have]


def _run_again(headers: list[dict], origin: dict[tuple, int]) -> list[dict]:
    """The sources' `run_again` entries, each once; a death no pair repeated (UNBLAMED_FIELD)
    only from the source whose records of its pair the merge keeps (a later run of the pair
    replaced it: a shard run again over a flaky one)."""
    out = []
    for i, h in enumerate(headers):
        for e in h.get("run_again") or []:
            if e.get(UNBLAMED_FIELD) and origin.get((e.get("kernel"), e.get("case_id"))) != i:
                continue
            if e not in out:
                out.append(e)
    return out


def superseded(headers: list[dict], held: list[set], short: list) -> set[int]:
    """The sources a later source replaces whole: a run of the same selection (its shard
    included), kernels, cases and code, that finished holding every pair and record it selected,
    among them every pair the earlier one holds (a shard run again after its runner died). What
    the earlier one lacked, and its unfinished state, are then not the merge's: each pair it held
    is replaced, or was measured where the later one skipped it. Where any of that is unknown
    (a merged source, an older header), nothing is replaced."""
    def same_run(a: dict, b: dict) -> bool:
        return (a.get("selection") is not None
                and rec.canonical(a["selection"]) == rec.canonical(b.get("selection"))
                and isinstance(a.get("kernels"), list) and isinstance(b.get("kernels"), list)
                and set(a["kernels"]) == set(b["kernels"]) and a.get("cases") == b.get("cases")
                and (ea := a.get("environment") or {}).get("git_commit") is not None
                and ea["git_commit"] == (eb := b.get("environment") or {}).get("git_commit")
                and _env_differs(ea, eb) is None)
    whole = [j for j, h in enumerate(headers)
             if short[j] == 0 and not h.get(rec.CUT_SHORT) and h.get("state") == FINISHED
             and not rec.narrowed(h) and not made_by_merge(h)]
    return {i for i, h in enumerate(headers) for j in whole
            if j > i and not made_by_merge(h) and same_run(h, headers[j])
            and held[i] <= held[j]}


def _only_skipped(rows: list[str]) -> bool:
    """Whether a pair's record lines are skips only (nothing measured, nothing raised)."""
    return all(json.loads(row).get("outcome") == SKIP for row in rows)


# A worker's waits kept in `merged_from` (source_entry): those of at least this many seconds.
WAIT_KEPT_S = 0.05


def source_entry(path, header: dict) -> dict:
    """What a joined report's header keeps of one source (`merged_from`): its path, its
    environment and wall time, and a worker's process facts (its name, start, CPU seconds, and
    how long it stood still: `wait_s` in all, `waits` per row of its timing table of at least
    WAIT_KEPT_S, largest first), which the summary's "Worker processes" line reads. The joined
    timing table sums the rows over workers that ran side by side; `waits` says whose run stood
    still. A source that is itself a joined report has no waits of its own: its table is a sum."""
    timing = header.get("timing")
    stood_still = {}
    if timing is not None and not header.get("merged_from"):   # one process's, not a sum
        rows = sorted(((row, t.get("wait_s", 0.0)) for row, t in timing.items()),
                      key=lambda kv: (-kv[1], kv[0]))
        stood_still = {"wait_s": round(sum(s for _, s in rows), 3),
                       "waits": {row: s for row, s in rows if s >= WAIT_KEPT_S}}
    return {"path": str(path), "environment": header["environment"],
            "wall_s": header.get("wall_s"),
            **{k: header[k] for k in ("worker", "startup_s", "began_at", "cpu_s", "children_cpu_s",
                                      "lowering_cpu_s", "cores") if header.get(k) is not None},
            **stood_still}


def merge_reports(out_dir: Path, sources: list[Path], transform: Callable | None = None,
                  whole: bool = False, **header) -> list[tuple[Path, int, int]]:
    """One report (records and traces) from several report folders; `transform(records,
    header)` rewrites each source's records, with its header, first (merge --rejudge);
    `whole`: the sources are the shards of a suite, to be whole (missing_shards);
    `header` adds to the joined header.
    Returns (source, pairs it replaced, pairs it only skipped where an earlier source had
    records of them, kept) for each source that overlapped an earlier one."""
    by_case: dict[tuple, list] = {}
    traces: dict[tuple, list] = {}
    headers, overlaps, short = [], [], []   # short: pairs each source lacks of its selection
    held: list[set] = []                    # the pairs each source holds
    origin: dict[tuple, int] = {}           # pair -> the source whose records the merge keeps
    for src in sources:
        # Each record's line as its source wrote it, where nothing rewrites them.
        if transform is None:
            head, rows = rec.read_lines(src)
        else:
            head, records = rec.read(src)
            rows = [(r.pair, rec.record_line(r)) for r in transform(records, head)]
        headers.append(head)
        fresh: dict[tuple, list] = {}
        for pair, row in rows:
            fresh.setdefault(pair, []).append(row)
        held.append(set(fresh))
        expected = rec.pairs_expected(head)
        short.append(None if expected is None else max(0, expected - len(fresh)))
        overlap = set(fresh) & set(by_case)
        kept = {p for p in overlap if _only_skipped(fresh[p]) and not _only_skipped(by_case[p])}
        if overlap:
            overlaps.append((src, len(overlap) - len(kept), len(kept)))
        by_case.update({p: rows for p, rows in fresh.items() if p not in kept})
        origin.update({p: len(headers) - 1 for p in fresh if p not in kept})
        fresh_traces: dict[tuple, list] = {key: [] for key in fresh if key not in kept}
        folder = Path(src) if Path(src).is_dir() else Path(src).parent
        for pair, line in rec.read_trace_lines(folder / rec.TRACES_FILE):
            if pair not in kept:
                fresh_traces.setdefault(pair, []).append(line)
        traces.update(fresh_traces)
    rows = [r for pair_rows in by_case.values() for r in pair_rows]
    # A source a later one replaced whole says nothing of the merge's completeness.
    replaced = superseded(headers, held, short)
    short = [0 if i in replaced else x for i, x in enumerate(short)]
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Its run's facts (interrupted, stopped_by, ...) are not the merge's either.
    facts = merged_environment([{k: h.get(k) for k in RUN_FACTS}
                                for i, h in enumerate(headers) if i not in replaced])
    facts["shard"] = merged_shards(headers)
    states = {h.get("state") for i, h in enumerate(headers) if i not in replaced}
    facts["state"] = next((s for s in (RUNNING, INTERRUPTED) if s in states), FINISHED)
    suites = sorted({h.get("suite") for h in headers}, key=str)
    rec.write_header(out_dir / rec.RECORDS_FILE,
                     merged_environment([h["environment"] for h in headers]),
                     **{**facts, "suite": suites[0] if len(suites) == 1 else suites,
                        "merged_from": [source_entry(s, h) for s, h in zip(sources, headers)],
                        "timing": merge_timing([h.get("timing") for h in headers]),
                        "compilation_cache": merge_cache(headers),
                        "selection": merged_selection(headers),
                        # What the sources selected (a source cut short stays short here).
                        **({"pairs_selected": len(by_case) + sum(short)}
                           if short and None not in short else {}),
                        **({"shards_missing": missing} if (missing := missing_shards(headers, whole))
                           else {}),
                        **({"narrowed": True} if any(rec.narrowed(h) for h in headers) else {}),
                        # A source that holds fewer records than it wrote: so does the merge.
                        **({rec.CUT_SHORT: cut} if (cut := "; ".join(
                            f"{s}: {h[rec.CUT_SHORT]}" for i, (s, h) in
                            enumerate(zip(sources, headers))
                            if h.get(rec.CUT_SHORT) and i not in replaced)) else {}),
                        # Pairs run again in a fresh worker, a death no pair repeated among
                        # them (tallies.unblamed): a shard's stay in the nightly's join.
                        **({"run_again": again}
                           if (again := _run_again(headers, origin)) else {}),
                        rec.RECORDS_WRITTEN: len(rows),
                        **header})
    with (out_dir / rec.RECORDS_FILE).open("a") as f:
        f.writelines(rows)
    with (out_dir / rec.TRACES_FILE).open("w") as f:
        f.writelines(line for key in by_case for line in traces.get(key, []))
    return overlaps
