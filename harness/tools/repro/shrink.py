"""Shrinking a failing case: moves that propose smaller candidates (as `custom/rows` cases), and
the greedy loop that keeps the first candidate on which the same check still fails.

Moves, in order: one row, then fewer rows; fewer segments (half of them, a quarter, ..., one),
less padding, shorter segments (to one token, halved, one less); then the smallest shape at once
(one head, the smallest head_dim, no trailing padding: each new shape compiles anew, which costs
seconds), else step by step: a shorter row, fewer heads, a smaller head_dim. Candidates the
kernel does not declare are never run; dtype, causal flag and seed stay."""
from __future__ import annotations

from collections.abc import Callable, Iterator

from harness.kernels.kernel import Kernel
from harness.model.case import Case
from harness.model.layouts import CUSTOM, rows_of, segment_ids_from_rows
from harness.tools.repro.trials import Budget, Trial, Trials


def as_custom(case: Case, rows=None, seq_len: int | None = None, heads: int | None = None,
              kv_heads: int | None = None, head_dim: int | None = None) -> Case | None:
    """The case as a custom/rows case with some dimensions replaced; None if invalid. Rows are
    normalized (adjacent padding merged, trailing padding implicit) so equal cases share ids."""
    rows = rows_of(case.segment_ids) if rows is None else tuple(tuple(r) for r in rows)
    seq_len = case.seq_len if seq_len is None else seq_len
    if not rows or any(not any(n > 0 for n in row) for row in rows):
        return None  # a row without a segment says nothing
    try:
        rows = rows_of(segment_ids_from_rows(rows, seq_len))
        return Case(CUSTOM, batch=len(rows), seq_len=seq_len,
                    heads=case.heads if heads is None else heads,
                    kv_heads=case.kv_heads if kv_heads is None else kv_heads,
                    head_dim=case.head_dim if head_dim is None else head_dim,
                    dtype=case.dtype, seed=case.seed, causal=case.causal, rows=rows,
                    features=case.features)
    except ValueError:
        return None


def _row_moves(case: Case, trial: Trial, check: str) -> Iterator[Case | None]:
    rows = rows_of(case.segment_ids)
    if len(rows) == 1:
        return
    failing_rows = list(dict.fromkeys(r.row for r in trial.failing(check)))
    for r in failing_rows:                                    # one row: the worst first
        yield as_custom(case, rows=[rows[r]])
    for r in range(len(rows)):                                # one row less
        yield as_custom(case, rows=rows[:r] + rows[r + 1:])


def _replace_run(rows, r, i, new):
    """rows with run i of row r replaced by `new` (removed if None)."""
    row = list(rows[r])
    row[i:i + 1] = [] if new is None else [new]
    return rows[:r] + (tuple(row),) + rows[r + 1:]


def _segment_moves(case: Case, trial: Trial, check: str) -> Iterator[Case | None]:
    rows = rows_of(case.segment_ids)
    for r, row in enumerate(rows):                            # fewer segments
        segments = [i for i, n in enumerate(row) if n > 0]
        size = len(segments) // 2
        while size >= 1:                                      # half of them, a quarter, ... one
            for first in range(0, len(segments), size):
                drop = set(segments[first:first + size])
                yield as_custom(case, rows=rows[:r] + (tuple(
                    n for i, n in enumerate(row) if i not in drop),) + rows[r + 1:])
            size //= 2
    for r, row in enumerate(rows):                            # less padding inside the row
        for i, n in enumerate(row):
            if n < 0:
                for new in dict.fromkeys([None, -(-n // 2), n + 1]):
                    if new != 0 and new != n:
                        yield as_custom(case, rows=_replace_run(rows, r, i, new))
    for r, row in enumerate(rows):                            # shorter segments
        for i, n in enumerate(row):
            if n > 1:
                for new in dict.fromkeys([1, n // 2, n - 1]):
                    yield as_custom(case, rows=_replace_run(rows, r, i, new))


def _shortest(case: Case, trials: Trials, min_len: int = 0, **dims) -> int:
    """The shortest row, at least as long as the longest row's runs (and min_len), that the
    kernel takes with `dims`; the case's own length if none is shorter."""
    used = max(sum(abs(n) for n in row) for row in rows_of(case.segment_ids))
    for s in range(max(used, min_len), case.seq_len):
        c = as_custom(case, seq_len=s, **dims)
        if c is not None and trials.supported(c):
            return s
    return case.seq_len


def _smallest_shape_moves(case: Case, trials: Trials) -> Iterator[Case | None]:
    """Every shape reduction at once (each new shape compiles anew, which costs seconds):
    the shortest row, one head, and the smallest head_dim; then with head_dim 8 (what fused
    kernels that do not declare their head dims usually take)."""
    kernel = trials.kernel
    smallest = min(kernel.head_dims) if kernel.head_dims is not None else 1
    used = max(sum(abs(n) for n in row) for row in rows_of(case.segment_ids))
    for d in dict.fromkeys([smallest] + ([8] if kernel.head_dims is None else [])):
        dims = dict(heads=1, kv_heads=1, head_dim=min(d, case.head_dim))
        # No trailing padding, then one token of it (bidirectional kernels that read padding).
        for min_len in (0, used + 1):
            yield as_custom(case, seq_len=_shortest(case, trials, min_len, **dims), **dims)


def _seq_len_moves(case: Case, trials: Trials) -> Iterator[Case | None]:
    """Trailing padding trimmed: all of it, all but a token (a bug that needs padding to
    read), then to round lengths (block sizes the kernel needs and does not declare)."""
    used = max(sum(abs(n) for n in row) for row in rows_of(case.segment_ids))
    candidates = [_shortest(case, trials)]
    if used + 1 < case.seq_len:
        candidates.append(_shortest(case, trials, min_len=used + 1))
    # Kernels with block sizes of their own that they do not declare: round numbers too.
    for multiple in (8, 16, 64, 128):
        candidates.append(-(-used // multiple) * multiple)
    for s in sorted(dict.fromkeys(candidates)):
        if s < case.seq_len:
            yield as_custom(case, seq_len=s)


def _head_moves(case: Case) -> Iterator[Case | None]:
    h, kv = case.heads, case.kv_heads
    options = [(1, 1), (2, 1), (kv, kv), (h // 2, max(1, kv // 2)), (h // 2, kv), (h, kv // 2)]
    for heads, kv_heads in dict.fromkeys(options):
        if (1 <= kv_heads <= heads and heads % kv_heads == 0 and heads <= h and kv_heads <= kv
                and (heads, kv_heads) != (h, kv)):
            yield as_custom(case, heads=heads, kv_heads=kv_heads)


def _head_dim_moves(case: Case, kernel: Kernel) -> Iterator[Case | None]:
    d = case.head_dim
    if kernel.head_dims is not None:
        smaller = sorted(x for x in kernel.head_dims if x < d)
        # The smallest the kernel takes, then about half (the largest at most d / 2).
        options = smaller[:1] + [x for x in reversed(smaller) if x <= d // 2][:1]
    else:
        options = [1, d // 2]
    for x in dict.fromkeys(options):
        if 1 <= x < d:
            yield as_custom(case, head_dim=x)


def shrink(trials: Trials, trial: Trial, check: str, log: Callable[[str], None]) -> Trial:
    """Greedy: the first candidate of the first move that still fails is kept, and the moves
    start over from it, until none is kept or the run budget is spent."""
    moves = [
        ("rows", lambda c, r: _row_moves(c, r, check)),
        ("segments", lambda c, r: _segment_moves(c, r, check)),
        ("shape", lambda c, r: _smallest_shape_moves(c, trials)),
        ("seq_len", lambda c, r: _seq_len_moves(c, trials)),
        ("heads", lambda c, r: _head_moves(c)),
        ("head_dim", lambda c, r: _head_dim_moves(c, trials.kernel)),
    ]
    current = trial
    try:
        progress = True
        while progress:
            progress = False
            for name, move in moves:
                for candidate in move(current.case, current):
                    if candidate is None or candidate == current.case:
                        continue
                    found = trials.fails(candidate, check)
                    if found is not None:
                        log(f"  {name:9s} {candidate.id}")
                        current, progress = found, True
                        break
                if progress:
                    break
    except Budget:
        log(f"  stopped after {trials.runs} kernel runs (the budget)")
    return current
