"""Regression against a baseline report: verdict flips, new and missing cases, grown errors.

A regression (exit 1) is: a check that was not bad (passed, caught, unjudged) now fails, errors
or is missed; a kernel x case that ran now skipped, or checks of it that ran and now did not (the
leak probe turned off); or an error that grew by more than `growth` times while
the new error is above NOISE_RATIO of its tolerance (so errors at the rounding floor,
where a factor of two is noise, never count). New and missing cases are listed, not failed:
suites grow and shrink on purpose. A baseline from another suite or platform is compared all
the same, with a warning first: most of its pairs will be new or missing.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from harness.judge import judging
from harness.views import report_file as rec

NOISE_RATIO = 0.1


@dataclass
class Comparison:
    flips: list[tuple[dict, dict]] = field(default_factory=list)      # (base, new)
    regressions: list[str] = field(default_factory=list)
    grown: list[tuple[dict, dict]] = field(default_factory=list)
    new_cases: list[tuple[str, str]] = field(default_factory=list)
    missing_cases: list[tuple[str, str]] = field(default_factory=list)
    lost_checks: list[dict] = field(default_factory=list)   # ran in the baseline, not now

    @property
    def regressed(self) -> bool:
        return bool(self.regressions)


def _cases(records) -> set[tuple[str, str]]:
    return {(r["kernel"], r["case_id"]) for r in records}


def compare(new: list[dict], base: list[dict], growth: float = 2.0) -> Comparison:
    result = Comparison()
    base_by_key = {rec.record_key(r): r for r in base}
    new_cases, base_cases = _cases(new), _cases(base)
    result.new_cases = sorted(new_cases - base_cases)
    result.missing_cases = sorted(base_cases - new_cases)
    ran_before = {(r["kernel"], r["case_id"]) for r in base if r["outcome"] != "skip"}
    errored_before = {(r["kernel"], r["case_id"]) for r in base if r["outcome"] == "error"}
    for r in new:
        case = (r["kernel"], r["case_id"])
        if r["outcome"] == "skip" and r["check"] == judging.KERNEL_LEVEL and case in ran_before:
            result.regressions.append(f"{case[0]} on {case[1]}: ran in the baseline, now skipped "
                                      f"({r.get('message', '')})")
        if r["outcome"] == "error" and case in base_cases and case not in errored_before:
            result.regressions.append(f"{case[0]} on {case[1]}: now errors: {r.get('message', '')}")
        b = base_by_key.get(rec.record_key(r))
        if b is None:
            continue
        if b["verdict"] != r["verdict"]:
            result.flips.append((b, r))
        if not judging.is_bad(b) and judging.is_bad(r):
            # Whether or not the measurement flipped: a check that was left to the leak probe
            # and is now judged by nothing is as much a regression as a pass turned fail.
            result.regressions.append(
                f"{r['kernel']} {r['check']} {r.get('segment_label')} of {r['case_id']}: "
                f"{b['outcome']} -> {r['outcome']}")
        chk = judging.CHECKS.get(r["check"])
        if chk is None or chk.bitwise:
            continue  # kernel-level records and bitwise checks have no error to grow
        old_err, new_err = b.get("max_abs_err"), r.get("max_abs_err")
        if judging.measured(r) and judging.measured(b):
            if new_err is None and old_err is not None:
                result.grown.append((b, r))
            elif (old_err is not None and new_err is not None and new_err > growth * old_err
                  and r["ratio"] is not None and r["ratio"] > NOISE_RATIO):
                result.grown.append((b, r))
    new_keys = {rec.record_key(r) for r in new}
    both = new_cases & base_cases
    lost = [b for b in base if (b["kernel"], b["case_id"]) in both
            and rec.record_key(b) not in new_keys and b["outcome"] != "skip"]
    result.lost_checks = lost
    for (kernel, case_id), n in sorted(Counter((b["kernel"], b["case_id"]) for b in lost).items()):
        checks = sorted({b["check"] for b in lost if (b["kernel"], b["case_id"]) == (kernel, case_id)})
        result.regressions.append(f"{kernel} on {case_id}: {n} checks ran in the baseline and not "
                                  f"now ({', '.join(checks)})")
    for b, r in result.grown:
        # A known upstream bug is no licence to get worse: its errors are compared too.
        if r["expected"] in ("pass", "known"):
            result.regressions.append(
                f"{r['kernel']} {r['check']} {r.get('segment_label')} of {r['case_id']}: error "
                f"grew {b['max_abs_err']:.3g} -> "
                f"{'nan/inf' if r['max_abs_err'] is None else format(r['max_abs_err'], '.3g')} "
                f"(> {growth}x)")
    return result


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


def compare_files(new_path, base_path, growth: float = 2.0) -> int:
    new_header, new = rec.read(new_path)
    base_header, base = rec.read(base_path, what="baseline")
    print(f"compare {new_path} with baseline {base_path} (growth factor {growth})")
    differs = mismatch(new_header, base_header)
    if differs:
        print(f"  warning: not like for like ({'; '.join(differs)}): expect many new and "
              "missing pairs")
    result = compare(new, base, growth)
    print(f"  verdict flips: {len(result.flips)}")
    for b, r in result.flips[:40]:
        print(f"    {r['kernel']} {r['check']} {r.get('segment_label')} of {r['case_id']}: "
              f"{b['verdict']} -> {r['verdict']}")
    print(f"  errors grown > {growth}x: {len(result.grown)}")
    print(f"  new kernel x case: {len(result.new_cases)}; missing: {len(result.missing_cases)}")
    print(f"  checks that ran in the baseline and not now: {len(result.lost_checks)}")
    for k, c in result.missing_cases[:20]:
        print(f"    missing: {k} on {c}")
    if result.regressed:
        print(f"REGRESSION ({len(result.regressions)}):")
        for line in result.regressions[:60]:
            print(f"  {line}")
        return 1
    print("no regression")
    return 0
