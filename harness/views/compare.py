"""`python -m harness compare NEW BASELINE` (and a run's `--baseline`): reads both reports,
asks harness.judge.regression what regressed, and prints it. Exit 1 on a regression, when the
two reports have no kernel x case pair in common (nothing was compared: never a silent pass),
and when the new report is incomplete (its run did not finish, or shards are missing)."""
from __future__ import annotations

from harness.judge import regression
from harness.store import report_file as rec
from harness.judge import tallies
from harness.judge import vocabulary as v
from harness.store.report_file import canonical, narrowed

SHOWN = 40


def mismatch(new_header: dict, base_header: dict) -> list[str]:
    """Why two reports are not like for like (suite, platform, device), if they are not."""
    out = []
    if new_header.get("suite") != base_header.get("suite"):
        out.append(f"suite {new_header.get('suite')!r} vs the baseline's "
                   f"{base_header.get('suite')!r}")
    env_new, env_base = new_header.get("environment", {}), base_header.get("environment", {})
    for key in ("platform", "device_kind"):
        if env_new.get(key) != env_base.get(key):
            out.append(f"{key} {env_new.get(key)!r} vs the baseline's {env_base.get(key)!r}")
    return out


def incomplete(header: dict) -> str | None:
    """Why a report is incomplete, in a few words (harness.judge.tallies.unfinished), or None
    where its run finished."""
    how = tallies.unfinished(header)
    if how is None:
        return None
    return {v.RUNNING: "its run never finished: killed before its end",
            v.INTERRUPTED: "its run was stopped before its end",
            v.SHARDS_MISSING: "a merge of shards without "
                              + ", ".join(header.get("shards_missing") or []),
            v.CUT_SHORT: header.get(rec.CUT_SHORT)}[how]


def same_selection(new_header: dict, base_header: dict) -> bool:
    """Both runs selected the same cases (suite, case globs, seeds, shard, kernels), neither
    narrowed by pytest: then every pair of the baseline should be there, whether the new run
    ended or was interrupted. Reports without a selection (older harness versions, merged
    parts) are not assumed to match."""
    new, base = canonical(new_header.get("selection")), canonical(base_header.get("selection"))
    return (new is not None and new == base
            and not narrowed(new_header) and not narrowed(base_header))


def _identity(path) -> tuple:
    p = rec.resolve(path)
    return (p.resolve(),)


def check_comparable(new_path, base_path) -> None:
    """Mistakes before comparing: the same report twice (nothing can regress against itself),
    a baseline file given as the new report."""
    from harness.errors import UsageError
    new_header = rec.read_header(new_path)
    base_header = rec.read_header(base_path, what="baseline")
    if _identity(new_path) == _identity(base_path):
        raise UsageError(f"compare {new_path} {base_path}: the same report twice; give a new "
                         "run and an earlier one")
    if new_header == base_header:
        started = (new_header.get("environment") or {}).get("time_utc")
        raise UsageError(f"compare {new_path} {base_path}: one run twice (identical headers"
                         + (f", started {started}" if started else "") + "): a copy of a "
                         "report compares with itself; give a new run and an earlier one")
    if new_header.get("baseline_of"):
        raise UsageError(f"compare {new_path}: a baseline file (made by `harness baseline`), "
                         "given as the new report; the new report comes first, the baseline "
                         "second")


def check_baseline_sources(sources) -> None:
    """`harness baseline OUT RUN...`: every run readable, each given once, all of one
    selection (a baseline's error ranges are over runs of the same cases)."""
    from harness.errors import UsageError
    headers = {}
    for src in sources:
        header = rec.read_header(src)
        key = _identity(src)
        if key in headers:
            raise UsageError(f"baseline: {src} given twice")
        if header.get("baseline_of"):
            raise UsageError(f"baseline: {src} is a baseline already; give the runs' reports")
        if (why := incomplete(header)) is not None:
            raise UsageError(f"baseline: {src} is incomplete ({why}); a baseline is made of "
                             "runs that finished")
        headers[key] = (src, header)
    (first, h0), *rest = headers.values()
    for src, header in rest:
        if header.get("selection") is None or h0.get("selection") is None:
            missing = src if header.get("selection") is None else first
            raise UsageError(f"baseline: {missing} records no selection (a merge of unlike "
                             "parts, or an older harness); a baseline of several runs is made "
                             "of runs of one selection")
        if canonical(header.get("selection")) != canonical(h0.get("selection")) or \
                header.get("suite") != h0.get("suite"):
            raise UsageError(f"baseline: {src} selected other cases than {first} "
                             f"({header.get('selection')} vs {h0.get('selection')}); a baseline "
                             "is made of runs of the same selection")


def _listed(title: str, lines: list[str], shown: int = SHOWN) -> None:
    print(f"  {title}: {len(lines)}")
    for line in lines[:shown]:
        print(f"    {line}")
    if len(lines) > shown:
        print(f"    ... and {len(lines) - shown} more")


def compare_files(new_path, base_path, growth: float = 2.0) -> int:
    new_header, new = rec.read(new_path)
    base_header, base = rec.read(base_path, what="baseline")
    print(f"compare {new_path} with baseline {base_path} (growth factor {growth})")
    differs = mismatch(new_header, base_header)
    if differs:
        print(f"  warning: not like for like ({'; '.join(differs)}): expect many new and "
              "missing pairs")
    base_short = base_header.get(rec.CUT_SHORT)
    if not base_short and (why := incomplete(base_header)) is not None:
        print(f"  warning: the baseline is incomplete ({why}): the pairs it lacks are new "
              "here, not compared")
    if base_short:
        print(f"INCOMPLETE BASELINE: {base_short}; the pairs it lacks are not compared, so "
              "this is not a pass")
    result = regression.compare(new, base, growth, same_selection(new_header, base_header))
    if narrowed(new_header):
        print("  note: the new run was narrowed by pytest (-k, --deselect or test ids): the "
              "pairs it did not select are listed as missing, not counted as regressions")
    _listed("verdict flips", [f"{r.kernel} {r.check} {r.where} of {r.case_id}: {b.verdict} -> "
                              f"{r.verdict}" for b, r in result.flips])
    print(f"  errors grown beyond their band (> {growth}x): {len(result.grown)}")
    print(f"  kernel x case in both: {result.common}; new: {len(result.new_cases)}; "
          f"missing: {len(result.missing_cases)}")
    print(f"  checks that ran in the baseline and not now: {len(result.lost_checks)}")
    _listed("missing", [f"{k} on {c}" for k, c in result.missing_cases], shown=20)
    # Judged on a second try in a fresh worker (harness.engine.capture): not a regression, but
    # a kernel that fails now and then can pass so; the first failure is named here.
    again = new_header.get("run_again") or []
    if again:
        _listed("run again in a fresh worker, judged on that run (the first failure)",
                [f"{a['kernel']} on {a['case_id']}: {' '.join(str(a.get('why', '')).split())[:200]}"
                 for a in again])
    unfinished = incomplete(new_header)
    if unfinished:
        print(f"INCOMPLETE: the new report is incomplete ({unfinished}); it is not a pass, "
              "whatever it compares")
    deaths = tallies.unblamed(new_header)   # a crash no pair repeated: not a pass either
    if deaths:
        print(f"UNBLAMED CRASH: {tallies.unblamed_text(deaths)}")
    if result.compared_nothing:
        print("NOTHING COMPARED: no check was measured in both this run and the baseline "
              "(another suite, kernels or cases, or every shared pair skipped); this is not a "
              "pass")
        return 1
    if result.regressed:
        print(f"REGRESSION ({len(result.regressions)}):")
        for line in result.regressions[:60]:
            print(f"  {line}")
        if len(result.regressions) > 60:
            print(f"  ... and {len(result.regressions) - 60} more")
        return 1
    no_pass = unfinished or deaths or base_short
    print("no regression among the pairs compared" if no_pass else "no regression")
    return 1 if no_pass else 0


def write_baseline(out_path, sources) -> int:
    """`python -m harness baseline OUT RUN...`: one baseline from several runs of the same
    selection, with each check's error range over them (regression.baseline_from_runs), each
    record cut to what the gate reads (regression.BASELINE_FIELDS)."""
    headers, runs = [], []
    for src in sources:
        header, records = rec.read(src)
        if header.get(rec.CUT_SHORT):   # seen once its records are read
            from harness.errors import UsageError
            raise UsageError(f"baseline: {src} is incomplete ({header[rec.CUT_SHORT]}); a "
                             "baseline is made of runs that finished")
        headers.append(header)
        runs.append(records)
    try:
        records = regression.baseline_from_runs(runs)
    except ValueError as exc:
        from harness.errors import UsageError
        raise UsageError(f"harness baseline: {exc}") from None
    header = {k: x for k, x in headers[0].items()
              if k not in ("type", "schema", "environment", rec.RECORDS_WRITTEN, rec.CUT_SHORT)}
    header["baseline_of"] = [{"path": str(s), "environment": h.get("environment"),
                              "wall_s": h.get("wall_s")} for s, h in zip(sources, headers)]
    header["baseline_fields"] = list(regression.BASELINE_FIELDS)
    # The pairs its runs selected: a baseline cut short later is then seen (cut_short).
    known = [n for h in headers if (n := rec.pairs_expected(h)) is not None]
    header["pairs_selected"] = known[0] if known else len({r.pair for r in records})
    rec.write_report(out_path, headers[0].get("environment", {}), records,
                     keep_fields=regression.BASELINE_FIELDS, **header)
    print(f"baseline of {len(sources)} runs: {len(records)} records -> {out_path}")
    return 0
