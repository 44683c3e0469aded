"""Context parallelism's load-balancing reorder, and the bug of forgetting the segment ids.

Under a causal mask the last tokens of a row do the most work. Context parallelism splits the
sequence over `cp` devices, so the tokens are first reordered to give every device a fair
share: Transformer Engine's striped strategy (`ReorderStrategy.Striped`, what MaxText's input
pipeline applies to packed rows, stripe 1) deals the row out in stripes of `stripe` tokens,
round robin: device r holds stripes r, r + cp, r + 2 cp, ... For cp = 4, 16 tokens, stripe 1:
device 0 holds tokens [0, 4, 8, 12], device 1 [1, 5, 9, 13], ... (TE 2.20.2's docstring and its
`reorder_causal_striped`, which reshapes the sequence to [T / (cp * stripe), cp, stripe] and
swaps the first two axes). The reordered row is laid out device after device, so a sequence
sharded over the context axis gives each device its share.

Segment ids and positions must be reordered with the tokens. A pipeline that reorders the tokens
but not the segment ids labels each token with the id of whichever token used to sit where it
now sits: the same class of bug as the seed's (attention across documents), one level up. The
reorder canary (harness.kernels.sharded) and the zoo's `reorder_forgets_segments` are that bug;
`forgotten_reorder_expectation` says exactly where the harness must catch it.

Everything here is plain numpy/jnp. The reorder is a reshape and an axis swap (as TE's is), so
autodiff carries gradients back to token order by the inverse swap; `striped_order` is the same
permutation as an index array, for the expectations.
"""
from __future__ import annotations

import numpy as np

from harness.judge import probe_groups
from harness.judge.vocabulary import DK, DQ, DV, LEAK, OUT

STRIPE = 1   # MaxText's and TE's stripe for packed rows (ring attention supports only 1)


def striped_order(seq_len: int, cp: int, stripe: int = STRIPE) -> np.ndarray:
    """order[j] = the token (original position) at reordered position j."""
    if cp < 1 or stripe < 1:
        raise ValueError(f"cp ({cp}) and stripe ({stripe}) must be positive")
    if seq_len % (cp * stripe):
        raise ValueError(f"seq_len {seq_len} is not a multiple of cp * stripe = {cp * stripe}")
    stripes = np.arange(seq_len // stripe)                # stripe s covers tokens s*stripe ...
    per_device = [stripes[r::cp] for r in range(cp)]      # device r: stripes r, r + cp, ...
    dealt = np.concatenate(per_device)
    return (dealt[:, None] * stripe + np.arange(stripe)[None, :]).reshape(-1)


def inverse_order(order: np.ndarray) -> np.ndarray:
    """inverse[a] = the reordered position of token a."""
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)
    return inverse


def reorder(x, cp: int, axis: int = 1, stripe: int = STRIPE):
    """x (numpy or jax) with its sequence axis in load-balanced order: TE's reshape and axis
    swap, so its gradient is a transpose too. (As a gather, whose gradient is a scatter-add,
    the leak probe's deterministic builds of the CP kernels computed something else than their
    default builds on two H200s: reports/h200x2/README.md.)"""
    _check(x.shape[axis], cp, stripe)
    return _swap(x, axis, (x.shape[axis] // (cp * stripe), cp), stripe)


def restore(x, cp: int, axis: int = 1, stripe: int = STRIPE):
    """The inverse of `reorder`: the sequence axis back in token order."""
    _check(x.shape[axis], cp, stripe)
    return _swap(x, axis, (cp, x.shape[axis] // (cp * stripe)), stripe)


def _check(seq_len: int, cp: int, stripe: int) -> None:
    if cp < 1 or stripe < 1:
        raise ValueError(f"cp ({cp}) and stripe ({stripe}) must be positive")
    if seq_len % (cp * stripe):
        raise ValueError(f"seq_len {seq_len} is not a multiple of cp * stripe = {cp * stripe}")


def _swap(x, axis: int, outer: tuple[int, int], stripe: int):
    """The sequence axis split into [outer[0], outer[1], stripe], its first two parts swapped."""
    axis %= x.ndim
    split = x.reshape(*x.shape[:axis], *outer, stripe, *x.shape[axis + 1:])
    return split.swapaxes(axis, axis + 1).reshape(x.shape)


def segment_positions(segment_ids: np.ndarray) -> np.ndarray:
    """Numpy: each token's position inside its segment, 0 at padding (harness.sut.lowering's
    `positions`, for the expectations)."""
    seg = np.asarray(segment_ids)
    idx = np.arange(seg.shape[1])[None]
    new = np.concatenate([np.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    start = np.maximum.accumulate(np.where(new, idx, 0), axis=1)
    return np.where(seg > 0, idx - start, 0)


# ----- where the forgotten reorder must be caught ------------------------------------------------

def forgotten_reorder_masks(segment_ids, causal: bool, cp: int = 2):
    """([B, T, T] what the buggy kernel lets query a read, [B, T, T] what it should), both in
    token order. The buggy kernel reorders tokens and positions but not the ids: token a carries
    the id found at its reordered slot, ids[inverse[a]], and reads the tokens that carry the same
    id at positions (inside their own segments) up to its own."""
    ids = np.asarray(segment_ids)
    label = ids[:, inverse_order(striped_order(ids.shape[1], cp))]
    pos = segment_positions(ids)
    wrong = label[:, :, None] == label[:, None, :]
    right = ids[:, :, None] == ids[:, None, :]
    if causal:
        wrong &= pos[:, None, :] <= pos[:, :, None]
        right &= np.tril(np.ones((ids.shape[1],) * 2, bool))[None]
    return wrong, right


def forgotten_reorder_expectation(case, check: str, segment, cp: int = 2):
    """Exactly where a kernel that forgets to reorder the segment ids must be caught.

    From the masks above, per segment S of row r:
    - leak probe: S's out, dq, dk and dv depend on the keys and values its queries read, and on
      the queries (and cotangents) of the valid tokens that read its keys, with everything those
      read. The probe redraws its groups (harness.judge.probe_groups.groups: the segments of each
      colour, the padding) and compares S in the runs that leave it untouched: "fail" iff such a run redraws
      a token S depends on. Padding queries carry a zero cotangent: they add exact zeros to dk/dv,
      so they are not dependencies.
    - out, dq: "pass" where every query of S reads exactly what it should (bitwise the correct
      kernel's mask), else "either" (how far a wrong read moves a value depends on the data;
      the probe judges the segment).
    - dk, dv: "pass" where every valid query that reads (or should read) a key of S has exactly
      the right mask row, else "either"."""
    row, sl = segment.row, slice(segment.start, segment.stop)
    w, t = _row_masks(case, row, cp)
    valid = case.segment_ids[row] > 0
    same = (w == t).all(axis=1)                      # query a's mask row is right
    if check == LEAK.name:
        return "fail" if _probe_sees(case, row, sl, w, valid) else "pass"
    if check in (OUT.name, DQ.name):
        return "pass" if same[sl].all() else ("either", _MOVED)
    if check in (DK.name, DV.name):
        readers = valid & (w[:, sl].any(axis=1) | t[:, sl].any(axis=1))
        return "pass" if same[readers].all() else ("either", _MOVED)
    return "pass"


def forgotten_reorder_padding(case, row: int, cp: int = 2) -> str:
    """The padding check of that kernel: "fail" where a valid query reads a padding key under
    the moved ids (that key then gets dk/dv, which must be zero at padding)."""
    w, _ = _row_masks(case, row, cp)
    ids = case.segment_ids[row]
    return "fail" if w[np.ix_(ids > 0, ids == 0)].any() else "pass"


_MOVED = ("tokens read under ids moved from other tokens: how far that moves a value depends on "
          "the data; the leak probe judges the segment")


def _probe_sees(case, row: int, sl: slice, reads: np.ndarray, valid: np.ndarray) -> bool:
    inside = np.zeros(reads.shape[0], bool)
    inside[sl] = True
    depends = reads[sl].any(axis=0)                          # keys S's queries read
    readers = valid & reads[:, sl].any(axis=1)               # valid queries that read S's keys
    depends |= readers | reads[readers].any(axis=0)          # them, and what they read
    depends &= ~inside
    for _, redraw in probe_groups.groups(case):
        if not redraw[row, sl].any() and (redraw[row] & depends).any():
            return True
    return False


_MASKS: dict = {}


def _row_masks(case, row: int, cp: int):
    """One row's masks, kept for the checks and segments that ask next (a row at a time: a
    [T, T] mask of a 32768-token row is 1 GiB)."""
    key = (case.id, row, cp)
    if key not in _MASKS:
        _MASKS.clear()
        wrong, right = forgotten_reorder_masks(case.segment_ids[row:row + 1], case.causal, cp)
        _MASKS[key] = wrong[0], right[0]
    return _MASKS[key]
