"""The main group in parts on one GPU: several worker processes share its pairs.

A worker runs one pair at a time, and on the H200 most of a warm run is the host's work
(Python, launches, transfers, tracing for the cache's keys), not the device's: the warm nightly
at 55ad216 took 242 s while its kernels and oracle executed for about 115 s, and the main
group's worker alone ran 3,250 of its 3,445 pairs (reports/nightly-h200-55ad216/). The host's
work is one interpreter's, so it parallelises over processes, not threads.

With `--main-workers N` (on GPUs, where the user left jax's memory settings alone) the main
group's pairs are split into N parts of whole shapes (a shape's programs compile in one
process; a case's references are computed in one), balanced by their estimated work
(`split`). The parts run at once, each in workers of its own (`part_name`), beside the other
groups: the parts share the 75% of the device the main group has whole, and the other groups
keep what they have beside it (harness.engine.device_shares.shares). A pair that lacks memory in its
share (an out-of-memory error, a deterministic build or dense scores larger than that share)
keeps no record there: its worker lists it (DEFERRED_FILE), and once every group has ended it
runs again alone with the share the main group has when it runs whole (DEFERRED,
harness.engine.workers.run_deferred): every pair runs with the memory it would have had in one
worker. Each worker compiles with its share of the host's cores (CORES_SHARE).

One worker is the default: on the H200 three parts took a cold nightly past 574 s, less than
half done, where one worker took 374 s; the nightly's deterministic builds and probe runs ask
for 16-64 GiB each, which a part's share did not hold (reports/nightly-h200-79376bd/).
"""
from __future__ import annotations

import os

PART = "main."                 # a part's name: main.1, main.2, ...
DEFERRED = "main.deferred"
DEFERRED_FILE = "deferred.jsonl"
CORES_SHARE = "HARNESS_WORKERS_AT_ONCE"   # workers compiling at once on the host (usable_cores)
MAIN_SHARE = 0.75    # XLA's default share of a GPU's memory: the main group's, as alone
MEM_FRACTION = "XLA_CLIENT_MEM_FRACTION"    # jax's name; it refuses both names set at once


def part_name(index: int) -> str:
    return f"{PART}{index + 1}"


def is_part(group) -> bool:
    return isinstance(group, str) and group.startswith(PART) and group[len(PART):].isdigit()


def parts_wanted(options) -> int:
    """How many parts the main group runs in: --main-workers where a GPU is seen, else one."""
    from harness.engine.environment import nvidia_gpus
    return max(1, options.main_workers) if nvidia_gpus() else 1


def pair_cost(case) -> float:
    """A pair's estimated share of a run's time (compiling and the host's work dominate;
    long rows also run longer)."""
    return 1 + case.batch * case.seq_len / 16384


def split(pairs: list, parts: int, case_of=lambda c: c) -> list[list]:
    """The pairs in at most `parts` shares, whole shapes to a share, the largest first onto the
    share with the least work so far (pair_cost); each share in run order. `case_of`: a pair's
    case from its second item (a Case already, or its id)."""
    by_shape: dict[tuple, list] = {}
    cost_of: dict[tuple, float] = {}
    for pair in pairs:
        case = case_of(pair[1])
        by_shape.setdefault(case.shape_key, []).append(pair)
        cost_of[case.shape_key] = cost_of.get(case.shape_key, 0.0) + pair_cost(case)
    shares: list[list] = [[] for _ in range(parts)]
    load = [0.0] * parts
    for shape in sorted(by_shape, key=lambda s: (-cost_of[s], str(s))):
        i = load.index(min(load))
        shares[i] += by_shape[shape]
        load[i] += cost_of[shape]
    order = {pair: n for n, pair in enumerate(pairs)}
    return [sorted(share, key=order.__getitem__) for share in shares if share]


def with_parts(pairs_by_group: dict, parts: int) -> dict:
    """The groups with the main group (None) split into its parts (part_name), first; the same
    groups where it has one shape or `parts` is 1."""
    from harness.model.case import Case
    main = pairs_by_group.get(None) or []
    shares = split(main, parts, Case.from_id) if parts > 1 else []
    if len(shares) < 2:
        return dict(pairs_by_group)
    out = {part_name(i): share for i, share in enumerate(shares)}
    out.update({g: ps for g, ps in pairs_by_group.items() if g is not None})
    return out


def main_share_bytes(limit: int | None, environ=os.environ) -> int | None:
    """The main group's share of the device when it runs whole, from a part's worker's own
    allocator limit and its share (MEM_FRACTION); None where either is unknown."""
    try:
        return int(limit / float(environ[MEM_FRACTION]) * MAIN_SHARE) if limit else None
    except (KeyError, ValueError, ZeroDivisionError):
        return None


def header_parts(futures, rerun: bool = True) -> dict:
    """The header's account of the main group's parts: each part's pair count, and how many
    pairs its workers deferred to DEFERRED ({} where the main group ran whole). From the split
    start_groups made (each future's `group` and `pairs`), so that a run stopped early still
    says it; the deferred count only where every part finished (a part stopped early may have
    deferred more) and the deferred pairs ran again (`rerun`: the run was not stopped first)."""
    out, deferred = {}, 0
    for f in futures:
        if is_part(getattr(f, "group", None)):
            out[f.group] = f.pairs
            finished = f.done() and not f.cancelled() and f.exception() is None
            deferred = deferred + len(f.result().deferred) if finished and deferred is not None \
                else None
    if out and deferred is not None and (rerun or not deferred):
        out[DEFERRED] = deferred
    return out
