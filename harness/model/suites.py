"""Named suites: which cases a run covers. Smoke is small enough for 2 CPU cores (rows up to
1152 tokens, kept cheap with 2 heads of 32); nightly is sized for one Hopper GPU (rows up to
32768 tokens)."""
from __future__ import annotations

import fnmatch

from harness.errors import UsageError
from harness.model.case import Case
from harness.model.features import Features
from harness.model.layouts import LAYOUTS

# Layouts every suite covers at its main shapes; the long-row layouts have shapes of their own.
_LONG = ("unaligned/long-edges", "packed/dozens")
_MAIN = [lay for lay in LAYOUTS if lay not in _LONG]
_BIDIRECTIONAL = ("packed/random", "padded/between", "unpacked/pad-tail", "extremes/single-tokens")


# The attention features models train with (harness.model.features), each on packed,
# unaligned and padded rows: sliding windows (causal, and reading ahead without the causal mask),
# a soft cap, chunks, sinks, a value head dim of its own, and two combinations models use
# (gpt-oss: a window with sinks; Gemma 2: a window with a soft cap). Sizes are in tokens of the
# suite's rows: windows and chunks short enough that every segment of a row holds several, so
# the leak probe finds tokens beyond their edges inside one segment.
def feature_set(window: int, ahead: int, chunk: int, head_dim_v: int) -> list[tuple]:
    """(features, causal) of a suite's feature cases."""
    return [(Features(window=(window, 0)), True),
            (Features(window=(window, ahead)), False),
            (Features(softcap=2.0), True),
            (Features(chunk=chunk), True),
            (Features(sinks=True), True),
            (Features(head_dim_v=head_dim_v), True),
            (Features(window=(window, 0), sinks=True), True),
            (Features(window=(window, 0), softcap=2.0), True)]


_FEATURE_LAYOUTS = ("packed/random", "unaligned/odd", "padded/between")


def smoke() -> list[Case]:
    cases = []
    for layout in _MAIN:
        cases.append(Case(layout, 4, 256, 4, 4, 32, "float32", seed=0))
        cases.append(Case(layout, 4, 256, 4, 2, 64, "bfloat16", seed=0))
    for layout in ("packed/random", "unaligned/block-edges"):
        cases.append(Case(layout, 4, 256, 4, 4, 64, "float16", seed=1))
    # Long rows: a segment across 512 and 1024, boundaries at 511-513 and 1023-1025.
    cases.append(Case("unaligned/long-edges", 4, 1152, 2, 1, 32, "bfloat16", seed=0))
    cases.append(Case("unaligned/long-edges", 4, 1152, 2, 2, 32, "float32", seed=0))
    cases.append(Case("packed/dozens", 2, 1024, 2, 1, 32, "bfloat16", seed=0))
    # Bidirectional (BERT-style packing).
    for layout in _BIDIRECTIONAL:
        cases.append(Case(layout, 4, 256, 4, 2, 64, "bfloat16", seed=2, causal=False))
        cases.append(Case(layout, 4, 256, 4, 4, 32, "float32", seed=2, causal=False))
    # Features: bfloat16 GQA on each feature layout; float32 MHA on packed rows.
    for features, causal in feature_set(window=15, ahead=8, chunk=32, head_dim_v=32):
        for layout in _FEATURE_LAYOUTS:
            cases.append(Case(layout, 4, 256, 4, 2, 64, "bfloat16", seed=6, causal=causal,
                              features=features))
    for features, causal in feature_set(window=15, ahead=8, chunk=32, head_dim_v=16):
        cases.append(Case("packed/random", 4, 256, 4, 4, 32, "float32", seed=6, causal=causal,
                          features=features))
    # Each feature where the sets above do not hand it over: without the causal mask, and in
    # float16 (a cold review's mutants read the bidirectional mask as causal whenever a soft
    # cap, sinks or a value head dim was on, or dropped a feature at float16 only: green on
    # every case of the suite).
    for features in (Features(softcap=2.0), Features(sinks=True), Features(head_dim_v=32)):
        cases.append(Case("packed/random", 4, 256, 4, 2, 64, "bfloat16", seed=6, causal=False,
                          features=features))
    for features, causal in feature_set(window=15, ahead=8, chunk=32, head_dim_v=32)[2:6]:
        cases.append(Case("packed/random", 4, 256, 4, 4, 64, "float16", seed=6, causal=causal,
                          features=features))
    cases.append(Case("packed/random", 4, 256, 4, 4, 64, "float16", seed=6,
                      features=Features(window=(15, 0))))
    # One sequence per row (the op's packing=False path takes it alone: it dropped the window
    # there, green on every case above, from an adversarial review of the op).
    cases.append(Case("unpacked/pad-tail", 4, 256, 4, 2, 64, "bfloat16", seed=6,
                      features=Features(window=(15, 0))))
    cases += _coverage((4, 256, 4, 2, 64, "bfloat16"), window=15, ahead=8, chunk=32,
                       head_dim_v=32)
    # MHA without the causal mask: a kernel of MHA alone (`gqa=False`) met the soft cap, chunks,
    # sinks and a value head dim only causal (an adversarial review's kernel read them as
    # causal).
    for features in (Features(softcap=2.0), Features(chunk=32), Features(sinks=True),
                     Features(head_dim_v=16)):
        cases.append(Case("packed/random", 4, 256, 4, 4, 32, "float32", seed=6, causal=False,
                          features=features))
    # MQA at head dim 256 with a window and a soft cap (Gemma's shapes): no feature case had one
    # kv head or head dim 256 (the review's kernel dropped every feature at one kv head).
    cases.append(Case("packed/random", 4, 256, 4, 1, 256, "bfloat16", seed=6,
                      features=Features(window=(15, 0), softcap=2.0)))
    return cases


def _coverage(shape: tuple, **sizes) -> list[Case]:
    """Cases an adversarial review found no feature case of a suite held, at its GQA `shape`
    (batch, tokens, heads, kv heads, head dim, dtype): one sequence per row with every feature
    of feature_set(**sizes) but the causal window (the op's packing=False path and per-row
    layouts take no other case; the review's kernel dropped all of them there, green on every
    case of the suite), and chunks without the causal mask."""
    out = [Case("unpacked/pad-tail", *shape, seed=6, causal=causal, features=features)
           for features, causal in feature_set(**sizes)[1:6]]
    out.append(Case("packed/random", *shape, seed=6, causal=False,
                    features=Features(chunk=sizes["chunk"])))
    return out


def nightly() -> list[Case]:
    cases = []
    for layout in _MAIN:
        cases.append(Case(layout, 4, 2048, 8, 2, 128, "bfloat16", seed=0))   # GQA
        cases.append(Case(layout, 4, 1024, 8, 8, 64, "bfloat16", seed=1))    # MHA
    cases.append(Case("unaligned/long-edges", 4, 2048, 8, 2, 128, "bfloat16", seed=0))
    for layout in ("packed/random", "unaligned/block-edges", "extremes/single-tokens"):
        cases.append(Case(layout, 4, 2048, 8, 8, 128, "float16", seed=2))
    for layout in ("packed/random", "unaligned/odd"):
        cases.append(Case(layout, 2, 1024, 8, 1, 256, "bfloat16", seed=3))    # MQA, head_dim 256
    for layout in ("packed/many", "unpacked/pad-tail", "extremes/long", "unaligned/block-edges"):
        cases.append(Case(layout, 1, 8192, 16, 4, 128, "bfloat16", seed=5))   # long rows
    cases.append(Case("packed/dozens", 1, 32768, 16, 4, 128, "bfloat16", seed=7))
    for layout in _BIDIRECTIONAL:
        cases.append(Case(layout, 4, 2048, 8, 2, 128, "bfloat16", seed=4, causal=False))
    for layout in ("packed/random", "padded/between"):
        cases.append(Case(layout, 4, 1024, 8, 8, 64, "bfloat16", seed=4, causal=False))
    # Features at the main GQA shape: windows of 255 back (and 128 ahead), chunks of 512.
    for features, causal in feature_set(window=255, ahead=128, chunk=512, head_dim_v=64):
        for layout in _FEATURE_LAYOUTS:
            cases.append(Case(layout, 4, 2048, 8, 2, 128, "bfloat16", seed=6, causal=causal,
                              features=features))
    # Each feature where the set above does not hand it over (as in the smoke suite): without
    # the causal mask, in float16 MHA, and one sequence per row with a window (the op's
    # packing=False path). Held on the H200 at 329f7c8 (reports/nightly-h200-329f7c8/).
    for features in (Features(softcap=2.0), Features(sinks=True), Features(head_dim_v=64)):
        cases.append(Case("packed/random", 4, 2048, 8, 2, 128, "bfloat16", seed=6, causal=False,
                          features=features))
    for features, causal in (feature_set(window=255, ahead=128, chunk=512, head_dim_v=64)[2:6]
                             + [(Features(window=(255, 0)), True)]):
        cases.append(Case("packed/random", 4, 2048, 8, 8, 128, "float16", seed=6, causal=causal,
                          features=features))
    cases.append(Case("unpacked/pad-tail", 4, 2048, 8, 2, 128, "bfloat16", seed=6,
                      features=Features(window=(255, 0))))
    # As in the smoke suite (_coverage); and MQA at head dim 256, and a row of 8192 tokens, each
    # with a window (no feature case had one kv head, head dim 256 or a row past 2048 tokens).
    cases += _coverage((4, 2048, 8, 2, 128, "bfloat16"), window=255, ahead=128, chunk=512,
                       head_dim_v=64)
    cases.append(Case("packed/random", 2, 1024, 8, 1, 256, "bfloat16", seed=6,
                      features=Features(window=(255, 0), softcap=2.0)))
    cases.append(Case("packed/many", 1, 8192, 16, 4, 128, "bfloat16", seed=6,
                      features=Features(window=(255, 0))))
    return cases


SUITES = {"smoke": smoke, "nightly": nightly}


def suite_cases(name: str, pattern=None, seeds: int = 1, features=None) -> list[Case]:
    """The suite's cases, each under `seeds` seeds (its own and the next ones).

    `pattern` (globs over case ids: comma-separated text or a sequence) narrows them: a case
    whose own id matches comes under all its seeds, another only under the seeds whose ids
    match; an exact id of the case under a later seed (no glob characters) comes under `seeds`
    seeds from that one. The suite's own seeds differ by shape (`-s0`, `-s1`, ...): a glob
    ending in one seed picks those shapes' cases. `features` (names of
    harness.model.features, or `none`) keeps the cases with any of those features (`none`:
    the cases without one). A glob that matches no case, or a selection that leaves none, is a
    UsageError naming it."""
    from harness.model.features import NONE
    if name not in SUITES:
        raise UsageError(f"unknown suite {name!r}; known: {', '.join(SUITES)}")
    if seeds < 1:
        raise UsageError(f"--seeds {seeds}: must be at least 1")
    cases = SUITES[name]()
    wanted = set(features or ())

    def kept(c: Case) -> bool:
        return not wanted or (NONE in wanted and not c.features) or \
            bool(wanted & set(c.features.names))
    if features:
        cases = [c for c in cases if kept(c)]
        if not cases:
            raise UsageError(f"--features {','.join(features)}: no case of suite {name!r} has "
                             f"{'them' if len(wanted) > 1 else 'it'}")
    if not pattern:
        return [c.with_seed(c.seed + i) for c in cases for i in range(seeds)]
    globs = [p.strip() for p in (pattern.split(",") if isinstance(pattern, str) else pattern)
             if p.strip()]

    def matches(case: Case, glob: str) -> bool:
        return fnmatch.fnmatch(case.id, glob)
    chosen, unmatched = [], []
    for g in globs:
        # A glob that matches a case's own id takes it under every seed (`*-s0 --seeds 50` is
        # fifty seeds, not one); otherwise it picks the seeds whose ids it matches (`*-s7
        # --seeds 10`).
        mine = [c.with_seed(c.seed + i) for c in cases for i in range(seeds)
                if matches(c, g) or matches(c.with_seed(c.seed + i), g)]
        # An exact case id, in the suite or not (a case under another seed, as a --seeds run
        # wrote it; a feature on a layout, dtype or mask the suite does not pair it with):
        # that case, under its own seed (and the next ones with --seeds).
        exact, why = _exact(g)
        if exact is not None and kept(exact):
            mine += [exact.with_seed(exact.seed + i) for i in range(seeds)]
        if not mine and exact is not None:   # a case id, without the features asked for
            raise UsageError(f"--cases: {g!r} has none of --features {','.join(features)}")
        if not mine:
            unmatched.append(f"{g!r}" + (f" ({why})" if why else ""))
        chosen += mine
    if unmatched:
        raise UsageError(f"--cases: {', '.join(unmatched)} "
                         f"match{'es' if len(unmatched) == 1 else ''} no case of suite "
                         f"{name!r}{' with those --features' if features else ''} and "
                         f"{'is' if len(unmatched) == 1 else 'are'} no case id; `python -m "
                         f"harness list --suite {name} -v` lists the case ids")
    # In suite order, each once.
    order = {c: n for n, c in enumerate(c.with_seed(c.seed + i) for c in cases
                                        for i in range(seeds))}
    return sorted(dict.fromkeys(chosen), key=lambda c: order.get(c, len(order)))


def _exact(text: str) -> tuple[Case | None, str | None]:
    """(the case `text` names exactly, None) or (None, why it names none: the case's own
    words, for text that looks like an id); (None, None) for a glob."""
    if any(ch in text for ch in "*?["):
        return None, None
    try:
        return Case.from_id(text), None
    except ValueError as exc:   # an id's own words (a window a causal mask cannot take), not
        # the parser's "not a case id" for text that is none
        return None, (None if str(exc).startswith("not a case id") else str(exc))


def shard(cases: list[Case], index: int, count: int) -> list[Case]:
    """Shard `index` of `count` (1-based) of the cases. Cases of one shape stay together where
    there are at least `count` shapes (a shard then compiles only its own shapes' programs),
    the shapes dealt out by cost, largest first, to the least loaded shard; otherwise the
    cases are dealt out one by one. Every case lands in exactly one shard."""
    groups: dict[tuple, list[Case]] = {}
    for c in cases:
        groups.setdefault(c.shape_key, []).append(c)
    if len(groups) < count:
        return cases[index - 1::count]
    load = [0.0] * count
    mine: list[Case] = []
    for key, members in sorted(groups.items(), key=lambda kv: -_cost(kv[1])):
        target = load.index(min(load))
        load[target] += _cost(members)
        if target == index - 1:
            mine += members
    chosen = set(mine)
    return [c for c in cases if c in chosen]


def _cost(cases: list[Case]) -> float:
    # Programs to compile (one per shape) plus attention work (batch * heads * seq^2).
    return 1.0 + sum(c.batch * c.heads * c.seq_len ** 2 / 4e8 for c in cases)
