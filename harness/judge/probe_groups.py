"""The leak probe's perturbations, as token masks: which tokens each run redraws (`groups`:
the segments by colour, the padding, blocks inside segments for windows and chunks) and which
tokens' values must not move in it (`dependencies`, `untouched`: the mask's reach, per query and
per key). harness.judge.leak_probe runs the kernel on them and judges what moved; the repro
scripts and the predictions of a dropped feature read the same masks."""
from __future__ import annotations

import functools

import numpy as np

from harness.model.case import Case

# Cases whose perturbation groups are kept (computed once per case, for every kernel).
GROUPS_CACHE = 16

# Which tensors' values depend on which tokens (dependencies): out and dq are a query's, dk
# and dv a key's.
TENSOR_CLASS = {"out": "query", "dq": "query", "dk": "key", "dv": "key"}


# Six colours in four groups: colour c is in the two groups of SIX_COLOURS[c]. No colour's pair
# contains another's, so for any two colours some group holds the one and not the other.
SIX_COLOURS = ((0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3))


def colours(segment_ids: np.ndarray) -> int:
    """How many colours the segments take (segment number + the row's offset, modulo it:
    segment_colours): 2, a checkerboard, or 6 where some row holds three segments or more. A
    segment is compared while the segments d places away in its row are redrawn unless d is a
    multiple of the colours (with the checkerboard alone, reads two segments away went unseen:
    what a context-parallel reorder that leaves the ids behind makes)."""
    seg = np.asarray(segment_ids)
    return 6 if max(len(np.unique(row[row > 0])) for row in seg) >= 3 else 2


def groups(case: Case, convention: str = "segment") -> list[tuple[str, np.ndarray]]:
    """(name, [B, T] bool tokens to redraw) for each perturbation (a copy of shared_groups)."""
    return [(name, mask.copy()) for name, mask in shared_groups(case, convention)]


@functools.lru_cache(maxsize=GROUPS_CACHE)
def shared_groups(case: Case, convention: str = "segment") -> tuple[tuple[str, np.ndarray], ...]:
    """(name, [B, T] bool tokens to redraw) for each perturbation: the segments of one colour and
    of the other (2 colours), or the four groups of six colours (SIX_COLOURS); then the
    padding; then, where the case has a window or chunks, blocks inside the segments
    (feature_groups). Neighbours in a row fall in different colours; across rows the colours
    follow row_offsets, so a segment alone in its row is compared while some other rows are
    redrawn (a leak across the batch), not all of them."""
    seg = case.segment_ids
    n = colours(seg)
    colour = segment_colours(seg, n)
    valid = seg > 0
    if n == 2:
        out = [("segments of one colour", valid & (colour == 1)),
               ("segments of the other colour", valid & (colour == 0))]
    else:
        out = []
        for g in range(4):
            members = [c for c, pair in enumerate(SIX_COLOURS) if g in pair]
            out.append((f"segments of colours {', '.join(str(c + 1) for c in members)} of 6",
                        valid & np.isin(colour, members)))
    if (seg == 0).any():
        out.append(("padding", seg == 0))
    out += feature_groups(case, convention)
    for _, mask in out:
        mask.flags.writeable = False   # shared by every caller: shared_groups is cached
    return tuple((name, mask) for name, mask in out if mask.any())


def row_offsets(rows: int) -> np.ndarray:
    """Each row's colour offset: the triangular numbers r (r + 1) / 2, so that the offset
    between two rows d apart (d r + d (d + 1) / 2) changes from row to row. With the row
    number itself as the offset, segment s + 1 of every row took the colour of segment s of
    the next: a kernel flattening its rows with ids row + id (not row * segments + id) read
    there, and was never seen (a cold review), nor, in two colours, were reads two rows
    away. Now those are seen on some row pairs. Not every read across the batch is: in two
    colours, three rows or more of one segment each always put two rows in one colour (at
    four rows, rows 0 and 3, and rows 1 and 2, share theirs: a read three rows away, or of the
    batch reversed, is not seen, where the row number as the offset saw both). Separating
    every pair of rows takes runs of their own (the rows whose index has bit b set), not
    done."""
    r = np.arange(rows)
    return r * (r + 1) // 2


def segment_colours(segment_ids: np.ndarray, n: int) -> np.ndarray:
    """[B, T] each token's colour: its segment number plus its row's offset, modulo n."""
    seg = np.asarray(segment_ids)
    return (seg + row_offsets(seg.shape[0])[:, None]) % n


def positions(segment_ids: np.ndarray) -> np.ndarray:
    """[B, T]: each token's position within its segment (its index in padding runs)."""
    seg = np.asarray(segment_ids)
    idx = np.broadcast_to(np.arange(seg.shape[1]), seg.shape)
    new = np.concatenate([np.ones((seg.shape[0], 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    return idx - np.maximum.accumulate(np.where(new, idx, 0), axis=1)


def feature_groups(case: Case, convention: str = "segment") -> list[tuple[str, np.ndarray]]:
    """Blocks of tokens inside each segment, for a case with a window or chunks: keys of a
    query's own segment outside its window or chunk must not move it either.

    - window (left, right): blocks of r + 1 tokens redrawn every 3r + 3 positions (r = left +
      right), at two phases; between two blocks, the queries whose window reaches no redrawn
      key are compared, the first of them reading exactly from the block's end (a window off by
      one reads the redrawn token before it), and the keys no query of theirs reads beyond;
    - chunks: every other chunk redrawn (by the kernel's convention), then the others;
    - the causal mask (without a window, whose blocks probe it): causal_tails."""
    f = case.features
    valid = case.segment_ids > 0
    pos = positions(case.segment_ids)
    out = []
    if f.window is not None:
        r = f.window[0] + f.window[1]
        block, period = r + 1, 3 * r + 3
        for phase in (0, period // 2):
            out.append((f"blocks of {block} inside each segment, every {period} from "
                        f"position {phase} (window)", valid & ((pos - phase) % period < block)))
    if f.chunk is not None:
        at = pos if convention == "segment" else np.broadcast_to(
            np.arange(case.seq_len), pos.shape)
        for parity, name in ((1, "odd"), (0, "even")):
            out.append((f"the {name} chunks of each segment ({convention} convention)",
                        valid & ((at // f.chunk) % 2 == parity)))
    if case.causal and f.window is None:
        out.append(("each segment's tail from a cut (causal)", causal_tails(case)))
    return out


def tail_cut(index: int, length: int) -> int:
    """Where segment number `index` of a case (in case.segments' order) of `length` tokens is
    cut (causal_tails): every other segment at its last token (a read ahead from any position
    on reaches it), the others at a half, a quarter and three quarters in turn."""
    return min(length - 1, max(1, (length - 1, length // 2, length - 1, length // 4,
                                   length - 1, 3 * length // 4)[index % 6]))


def causal_tails(case: Case) -> np.ndarray:
    """[B, T] bool: each segment of two tokens or more from its cut (tail_cut) to its end.
    Under the causal mask the queries before a cut read nothing after it, so their out and dq
    must not move: a kernel reading a key ahead there is seen (an adversarial review's bfloat16
    kernel read the next key from position 768 of each segment on, inside the tolerance of the
    long rows' outputs, and no group redrew a token its own segment's earlier queries must not
    read). One cut per segment per run (a query after it reads the redrawn keys), where
    tail_cut puts it: a read ahead at one position only is seen where a cut falls just after
    it, not everywhere."""
    out = np.zeros(case.segment_ids.shape, bool)
    for n, s in enumerate(case.segments):
        if s.length >= 2:
            out[s.row, s.start + tail_cut(n, s.length):s.stop] = True
    return out


def dependencies(case: Case, convention: str = "segment") -> dict[str, tuple]:
    """Per tensor class ("query": out and dq; "key": dk and dv), [B, T] inclusive bounds of the
    tokens each token's value depends on, from the mask: a query on the keys it reads (and
    itself); a key on the queries that read it and on the keys those read. Masks are
    intervals (a segment, a causal prefix, a window, a chunk: their intersection), so the
    dependencies are intervals too."""
    seg = np.asarray(case.segment_ids)
    b, t = seg.shape
    f = case.features
    q_lo, q_hi = np.tile(np.arange(t), (b, 1)), np.tile(np.arange(t), (b, 1))
    k_lo, k_hi = q_lo.copy(), q_hi.copy()
    for s in case.segments:
        i = np.arange(s.start, s.stop)
        lo, hi = np.full(s.length, s.start), np.full(s.length, s.stop - 1)
        if case.causal:
            hi = np.minimum(hi, i)
        if f.window is not None:
            lo, hi = np.maximum(lo, i - f.window[0]), np.minimum(hi, i + f.window[1])
        if f.chunk is not None:
            base = s.start if convention == "segment" else 0
            start = base + ((i - base) // f.chunk) * f.chunk
            lo, hi = np.maximum(lo, start), np.minimum(hi, start + f.chunk - 1)
        q_lo[s.row, i], q_hi[s.row, i] = np.minimum(lo, i), np.maximum(hi, i)
        # The queries that read key j: from the first whose reach ends at j or later to the
        # last whose reach starts at j or earlier (both bounds rise with the query).
        first = s.start + np.searchsorted(hi, i, side="left")
        last = s.start + np.searchsorted(lo, i, side="right") - 1
        k_lo[s.row, i] = np.minimum(np.minimum(lo[first - s.start], first), i)
        k_hi[s.row, i] = np.maximum(np.maximum(hi[last - s.start], last), i)
    return {"query": (q_lo, q_hi), "key": (k_lo, k_hi)}


def untouched(deps: dict[str, tuple], redraw: np.ndarray) -> dict[str, np.ndarray]:
    """Per tensor class, [B, T] bool: tokens none of whose dependencies was redrawn (their
    values must not move)."""
    count = np.concatenate([np.zeros((redraw.shape[0], 1), np.int64),
                            np.cumsum(redraw, axis=1)], axis=1)
    rows = np.arange(redraw.shape[0])[:, None]
    return {cls: (count[rows, hi + 1] - count[rows, lo]) == 0 for cls, (lo, hi) in deps.items()}


@functools.lru_cache(maxsize=GROUPS_CACHE)
def kept_per_group(case: Case, convention: str = "segment") -> tuple[dict[str, np.ndarray], ...]:
    """For each perturbation group of the case (shared_groups, in order): untouched(dependencies of
    the case, the group's redrawn tokens). Worked out once per case for all its kernels (read
    only): per kernel they were 18 s of the H200 nightly worker's run thread."""
    deps = dependencies(case, convention)
    out = []
    for _, redraw in shared_groups(case, convention):
        kept = untouched(deps, redraw)
        for mask in kept.values():
            mask.flags.writeable = False
        out.append(kept)
    return tuple(out)


@functools.lru_cache(maxsize=GROUPS_CACHE)
def covered(case: Case, convention: str = "segment") -> bool:
    """Whether each valid token, as a query (out, dq) and as a key (dk, dv), is left untouched
    by some group's perturbation (kept_per_group): so that a probe whose runs moved none of
    those tokens saw each one reproduced bitwise. Not where a segment has nothing else to
    redraw (one unpacked row without padding)."""
    valid, kept = case.segment_ids > 0, kept_per_group(case, convention)
    return bool(kept) and all((~valid | np.logical_or.reduce([k[c] for k in kept])).all()
                              for c in ("query", "key"))
