"""Reference attention: the float32 truth, its same-dtype peer, and an independent float64 oracle.

Three computations of one definition: token i of segment s attends to token j iff j is in the
same segment s (s > 0), when causal j <= i, and within the case's features
(harness.model.features): inside the window (pos_i - left <= pos_j <= pos_i + right, positions
within the segment), in the same chunk (pos_i // chunk == pos_j // chunk; chunks from the row's
start where a kernel documents that convention). Scores are scale * q.k, soft-capped to
cap * tanh(score / cap) where the case asks; a sink adds exp(sink_h) to each softmax's
denominator and no value. Padding tokens attend to nothing; their outputs are defined as zero
here and are never compared.

- `dense_attention(..., truth=True)`: float32 inputs, HIGHEST matmul precision, dense [B,T,T] mask
  (on long rows in blocks of queries, each against the keys of its own segments: key_span).
  The truth every kernel is compared with.
- `dense_attention(..., truth=False)`: the same formula in the input dtype with the operations in
  another order (keys scaled instead of queries, scores rounded to the dtype). Its distance from
  the truth estimates the rounding noise any kernel of that dtype must be allowed.
- harness.judge.loop_oracle.segment_loop_attention: NumPy float64, one segment at a time,
  with the backward pass written out by hand. It shares no code with the dense oracle, so the
  two check each other (cases/test_oracle.py).
"""
from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from harness.judge.metrics import scales, token_errors
from harness.judge.vocabulary import JVP, TENSORS
from harness.model.case import Case, make_inputs
from harness.model.layouts import check_segment_ids

# A finite "minus infinity": rows that attend to nothing (padding queries) stay NaN-free.
_MASKED = -1e30


def segment_positions(segment_ids):
    """[B, T] int32: each token's position within its segment (index - the segment's start); a
    token's index for padding runs (never read)."""
    b, t = segment_ids.shape
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    new = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]],
                          axis=1)
    start = jax.lax.cummax(jnp.where(new, idx, 0), axis=1)
    return idx - start


def feature_mask(idx_q, idx_k, pos_q, pos_k, features, chunk_convention: str = "segment"):
    """[..., Tq, Tk] bool: the window and chunk terms of the mask (True where the case asks for
    neither). `idx_*`: indices in the row; `pos_*`: positions within the segment."""
    mask = jnp.ones(jnp.broadcast_shapes(pos_q[..., :, None].shape, pos_k[..., None, :].shape),
                    bool)
    if features.window is not None:
        left, right = features.window
        mask &= (pos_k[..., None, :] >= pos_q[..., :, None] - left)
        mask &= (pos_k[..., None, :] <= pos_q[..., :, None] + right)
    if features.chunk is not None:
        c = features.chunk
        q, k = (pos_q, pos_k) if chunk_convention == "segment" else (idx_q, idx_k)
        mask &= (q[..., :, None] // c) == (k[..., None, :] // c)
    return mask


def repeat_kv(x, heads: int):
    """[B, T, KV, D] -> [B, T, heads, D]: query head h reads kv head h // (heads // KV)."""
    return jnp.repeat(x, heads // x.shape[2], axis=2)


# Dense scores above this size are computed in blocks of queries (memory-bounded, same math).
_BLOCK_BYTES = 1 << 29


def _attend(query, key, value, seg_q, seg_k, pos_q, *, scale, causal, truth, features=None,
            chunk_convention="segment", sinks=None, spos_q=None, spos_k=None, idx_k=None):
    """Attention of a block of queries (at row indices pos_q; within-segment positions spos_q)
    over the keys at row indices idx_k (by default the whole row)."""
    heads = query.shape[2]
    if truth:
        dtype, precision = jnp.float32, jax.lax.Precision.HIGHEST
        q = query.astype(dtype) * scale
        k = key.astype(dtype)
    else:
        dtype, precision = query.dtype, None
        q = query
        k = (key * jnp.asarray(scale, key.dtype)).astype(dtype)
    k = repeat_kv(k, heads)
    v = repeat_kv(value.astype(dtype), heads)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=precision,
                        preferred_element_type=dtype)
    if idx_k is None:
        idx_k = jnp.arange(seg_k.shape[1])
    mask = (seg_q[:, :, None] == seg_k[:, None, :]) & (seg_q[:, :, None] > 0)
    if causal:
        mask = mask & (idx_k[None, None, :] <= pos_q[None, :, None])
    if features is not None and (features.window is not None or features.chunk is not None):
        mask = mask & feature_mask(pos_q[None], idx_k[None], spos_q, spos_k, features,
                                   chunk_convention)
    if features is not None and features.softcap is not None:
        cap = jnp.asarray(features.softcap, scores.dtype)
        scores = cap * jnp.tanh(scores / cap)
    logits = jnp.where(mask[:, None], scores.astype(jnp.float32), _MASKED)
    if sinks is None:
        probs = jax.nn.softmax(logits, axis=-1)
    else:
        # The sink: one more logit per head in every softmax, with no value behind it.
        sink = sinks.astype(jnp.float32)[None, :, None, None]
        top = jnp.maximum(jnp.max(logits, axis=-1, keepdims=True), sink)
        e = jnp.exp(logits - top)
        probs = e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - top))
    out = jnp.einsum("bhqk,bkhd->bqhd", probs.astype(dtype), v, precision=precision,
                     preferred_element_type=dtype)
    return jnp.where((seg_q > 0)[:, :, None, None], out, 0).astype(dtype)


def query_block(batch: int, heads: int, seq_len: int) -> int:
    """Queries per block so that one block's float32 scores stay under _BLOCK_BYTES."""
    rows = _BLOCK_BYTES // (4 * batch * heads * seq_len)
    return seq_len if rows >= seq_len else max(16, 1 << (max(rows, 1).bit_length() - 1))


# A block's keys (key_span) are read in multiples of this many.
SPAN_QUANTUM = 256


def key_span(segment_ids, block: int) -> int | None:
    """How many keys, from the first token of the earliest segment its queries are in, cover
    every key each block of `block` queries can attend to (their segments: a query reads
    nothing outside its own), over every row, rounded up to SPAN_QUANTUM; None where that is
    the whole row. Worked out from the case's segment ids, so a program built with it is one
    case layout's (harness.engine.programs keys the oracle's programs by it)."""
    seg = np.asarray(segment_ids)
    b, t = seg.shape
    if block >= t:
        return None
    n = -(-t // block)
    lo, hi = np.full(n, t), np.zeros(n, np.int64)
    for s in check_segment_ids(seg, padding="anywhere"):
        first, last = s.start // block, (s.stop - 1) // block
        lo[first:last + 1] = np.minimum(lo[first:last + 1], s.start)
        hi[first:last + 1] = np.maximum(hi[first:last + 1], s.stop)
    read = hi > 0
    widest = int((hi - lo)[read].max()) if read.any() else 1
    span = -(-widest // SPAN_QUANTUM) * SPAN_QUANTUM
    return None if span >= t else span


@functools.lru_cache(maxsize=256)
def case_key_span(case: Case) -> int | None:
    """key_span of the case's segment ids in the case's blocks of queries: part of what its
    oracle program is (harness.engine.programs keys the programs by it)."""
    return key_span(case.segment_ids, query_block(case.batch, case.heads, case.seq_len))


def dense_attention(query, key, value, segment_ids, sinks=None, *, scale: float,
                    causal: bool = True, truth: bool = True, block: int | None = None,
                    features=None, chunk_convention: str = "segment", span: int | None = None):
    """Attention with the dense same-segment (and causal) mask and the case's features. Long
    rows are computed in blocks of `block` queries, each rematerialized in the backward pass
    (jax.checkpoint), so memory stays bounded by one block's [batch, heads, block, seq] scores:
    a 32768-token row fits on one GPU. With `span` (key_span of these segment ids and block),
    a block's queries are scored against the `span` keys from the first token of the earliest
    segment they are in, not the whole row: every key outside those is masked for all of them
    (another segment's), so the softmax and the sums see the same terms, less zeros (the
    H200's packed 32768-token row took 4 s a run over the whole row). The same math."""
    b, t, heads, _ = query.shape
    block = block or query_block(b, heads, t)
    spos = segment_positions(segment_ids) if features else None
    attend = functools.partial(_attend, scale=scale, causal=causal, truth=truth,
                               features=features, chunk_convention=chunk_convention,
                               sinks=sinks, spos_k=spos)
    if block >= t:
        return attend(query, key, value, segment_ids, segment_ids, jnp.arange(t), spos_q=spos)
    n = -(-t // block)
    pad = n * block - t

    def in_blocks(x, fill=0):   # [B, T, ...] -> [B, n, block, ...], the last block filled
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2), constant_values=fill)
        return x.reshape(b, n, block, *x.shape[2:])
    blocks = (in_blocks(query).swapaxes(0, 1), in_blocks(segment_ids).swapaxes(0, 1),
              jnp.arange(n * block).reshape(n, block))
    spos_blocks = None if spos is None else in_blocks(spos).swapaxes(0, 1)
    if span is None:
        step = jax.checkpoint(lambda x: attend(x[0], key, value, x[1], segment_ids, x[2],
                                               spos_q=x[3]))
        out = jax.lax.map(step, blocks + (spos_blocks,))   # [n, b, block, heads, d]
        return out.swapaxes(0, 1).reshape(b, n * block, *out.shape[3:])[:, :t]
    # Each query's segment's first token; padding reads nothing (t: never the smallest).
    idx = jnp.arange(t, dtype=jnp.int32)[None]
    valid = segment_ids > 0
    from_start = spos if spos is not None else segment_positions(segment_ids)
    first = jnp.where(valid, idx - from_start, t)
    starts = jnp.clip(in_blocks(first, t).min(axis=(0, 2)), 0, t - span)   # [n]: one per block
    # A span too short for these segment ids (a program built for another layout) would drop
    # keys silently: such a block's truth is NaN instead, which no kernel passes against.
    to_end = segment_positions(segment_ids[:, ::-1])[:, ::-1]        # tokens after, in its run
    ends = jnp.where(valid, idx + to_end + 1, 0)
    covered = in_blocks(ends).max(axis=(0, 2)) <= starts + span

    def window(x):
        q_b, seg_b, pos_b, spos_b, at, ok = x
        k, v, seg_k, spos_k = (None if a is None else jax.lax.dynamic_slice_in_dim(a, at, span, 1)
                               for a in (key, value, segment_ids, spos))
        out = attend(q_b, k, v, seg_b, seg_k, pos_b, spos_q=spos_b, spos_k=spos_k,
                     idx_k=at + jnp.arange(span))
        return jnp.where(ok, out, jnp.nan)
    out = jax.lax.map(jax.checkpoint(window), blocks + (spos_blocks, starts, covered))
    return out.swapaxes(0, 1).reshape(b, n * block, *out.shape[3:])[:, :t]


# ----- the reference of one case --------------------------------------------------------------

def with_gradients(fn, backward: bool = True, diff: tuple[int, ...] = (0, 1, 2)):
    """fn(*inputs) -> program(*inputs, cotangent) = (out, d of each input in `diff`) via jax.vjp
    (by default q, k, v; the inputs after them: segment ids, sinks, or precomputed lengths and
    offsets); (out,) without a backward pass."""
    def run(*args):
        *inputs, ct = args
        if not backward:
            return (fn(*inputs),)

        def f(*d):
            full = list(inputs)
            for i, x in zip(diff, d):
                full[i] = x
            return fn(*full)
        out, vjp = jax.vjp(f, *(inputs[i] for i in diff))
        return (out, *vjp(ct.astype(out.dtype)))
    return run


def gradient_inputs(case: Case) -> tuple[int, ...]:
    """Which program inputs are differentiated: q, k, v, and the sinks where the case has
    them (the program's inputs: q, k, v, segment ids[, sinks])."""
    return (0, 1, 2, 4) if case.features.sinks else (0, 1, 2)


def _reference(case: Case, truth: bool, chunk_convention: str, differentiate):
    """The case's dense attention (truth or peer) through `differentiate` (with_gradients or
    with_tangents); the truth's program takes float32 copies of every input but the segment
    ids."""
    attend = functools.partial(dense_attention, scale=case.scale, causal=case.causal,
                               truth=truth, features=case.features or None,
                               chunk_convention=chunk_convention,
                               block=query_block(case.batch, case.heads, case.seq_len),
                               span=case_key_span(case))
    program = differentiate(attend)
    if not truth:
        return program

    def in_float32(q, k, v, seg, *rest):
        # Derivatives with respect to float32 copies: a bf16 query would round its dq (or a
        # bf16 tangent the output's) to bf16.
        f32 = jnp.float32
        return program(q.astype(f32), k.astype(f32), v.astype(f32), seg,
                       *(x.astype(f32) for x in rest))
    return in_float32


def reference_fn(case: Case, truth: bool, chunk_convention: str = "segment"):
    """(q, k, v, seg[, sinks], cotangent) -> (out, dq, dk, dv[, dsinks]) of the truth (float32)
    or of the same-dtype peer."""
    return _reference(case, truth, chunk_convention,
                      functools.partial(with_gradients, diff=gradient_inputs(case)))


def with_tangents(fn, sinks: bool):
    """fn(q, k, v, seg[, sinks]) -> program(q, k, v, seg[, sinks], tq, tk, tv[, tsinks]) =
    (the output's tangent,) via jax.jvp: the segment ids are data, every other input takes its
    tangent."""
    def run(q, k, v, seg, *rest):
        n = 1 if sinks else 0
        primals, tangents = (q, k, v, *rest[:n]), tuple(rest[n:])

        def f(q, k, v, *s):
            return fn(q, k, v, seg, *s)
        _, tangent = jax.jvp(f, primals, tangents)
        return (tangent,)
    return run


def reference_jvp_fn(case: Case, truth: bool, chunk_convention: str = "segment"):
    """(q, k, v, seg[, sinks], tq, tk, tv[, tsinks]) -> (the output's tangent,) of the truth
    (float32, HIGHEST precision) or of the same-dtype peer."""
    return _reference(case, truth, chunk_convention,
                      functools.partial(with_tangents, sinks=bool(case.features.sinks)))


@dataclass
class Reference:
    """The truth for one case, and how far the same-dtype peer lands from it, per token."""
    truth: tuple                              # out, dq, dk, dv[, dsinks] in float32 (device)
    peer_token_err: dict[str, np.ndarray]     # check name -> [B, T] max abs error of the peer
    scale: dict[str, float]                   # check name -> max |truth| over valid tokens
    # dsinks (a case with sinks): the peer's max abs error over heads, and max |truth|.
    peer_dsinks_err: float | None = None
    dsinks_scale: float | None = None


# The compiled programs of the run in this process (harness.engine.programs.Programs shares
# itself when made): the source of the references asked for without programs, such as a
# kernel's expectation that predicts what a dropped feature moves (harness.judge.prediction).
# From there each shape compiles once (on GPUs without autotuning) and is timed in the oracle's
# row; a fresh jit per case compiled every case again on the run's thread (on the H200 nightly,
# most of MaxText cudnn_flash_jax's 64 s of host time).
_shared_programs = None


def share_programs(programs, closing=None) -> None:
    """Makes `programs` the source of references computed without programs (above); with
    `closing` (programs being closed), only if those are the ones shared now."""
    global _shared_programs
    if closing is None or _shared_programs is closing:
        _shared_programs = programs


@contextlib.contextmanager
def charged_to_oracle():
    """The block's wall time counted in the shared programs' oracle row (the runner takes it
    out of the kernel's own): references computed for a kernel's expectation are the
    oracle's work, not the kernel's host time."""
    programs, start = _shared_programs, time.perf_counter()
    try:
        yield
    finally:
        if programs is not None:
            programs.add_oracle_wall(time.perf_counter() - start)


def oracle_program(case: Case, truth: bool, chunk_convention: str = "segment", programs=None,
                   forward: bool = False):
    """(q, k, v, seg[, sinks], cotangent) -> (out, dq, dk, dv[, dsinks]) of the case's truth or
    peer (`forward`: its forward mode, reference_jvp_fn): `programs`' (or the shared
    programs') compiled program, else a plain jit."""
    programs = programs if programs is not None else _shared_programs
    if programs is not None:
        return (programs.oracle_jvp if forward else programs.oracle)(case, truth,
                                                                     chunk_convention)
    return jax.jit((reference_jvp_fn if forward else reference_fn)(case, truth, chunk_convention))


# The references computed for the case the runner is on, and for the cases made from it (the
# case less a feature: a diagnosis, a kernel's prediction), under each chunk convention asked:
# kept until the runner moves to the next case (forget_references), so that no kernel of the
# case computes one again. (Two kept, the nightly computed its 65 cases' references 717 times:
# a diagnosis or a prediction pushed the case's own out for the next kernel.)
REFERENCES_KEPT = 16


def forget_references() -> None:
    """Lets go of every reference kept (the runner, when it moves to the next case); a
    reference launched ahead for the next case stays (launch_reference)."""
    _kept_reference.cache_clear()
    _kept_jvp_reference.cache_clear()


# The truth's and the peer's outputs of the references launched ahead, not yet read: (case,
# programs, chunk convention, forward) -> (truth program, its outputs, peer program, its
# outputs); one of each mode at a time.
_launched: dict = {}


def launch_reference(case: Case, programs, chunk_convention: str = "segment",
                     forward: bool = False) -> bool:
    """Launches the case's truth and peer (`forward`: their forward mode, the jvp check's
    reference) without waiting for them, where both are compiled (a program still compiling is
    not waited for here): the runner launches the next case's while this case's kernels are
    judged, and the device computes it in the gaps the host leaves (on the H200's warm nightly
    at c4f8fc7 the run thread launched and waited for the oracle's runs for 43 s; at 1b487e6
    it waited 5.5 s for the jvp references, then computed when their first kernel came).
    reference_for (jvp_reference_for) reads it when the case comes. One reference of each
    mode is launched ahead at a time; launching another lets go of the one before. A launch
    that fails is dropped: the reference is then computed when asked for, meeting the
    failure itself."""
    for key in [k for k in _launched if k[3] == forward]:
        del _launched[key]
    pair = [oracle_program(case, truth, chunk_convention, programs, forward=forward)
            for truth in (True, False)]
    if not all(p.compiled.done() and p.compiled.exception() is None for p in pair):
        return False
    try:
        args = _reference_args(case, forward)
        outs = [p.launch(*args) for p in pair]
    except Exception:
        return False
    _launched[(case, programs, chunk_convention, forward)] = (pair[0], outs[0], pair[1], outs[1])
    return True


def _reference_args(case: Case, forward: bool) -> tuple:
    """The oracle's arguments: the case's inputs; in forward mode with the input tangents
    (harness.model.case.make_tangents) in place of the cotangent."""
    args = make_inputs(case).device_args
    if not forward:
        return args
    from harness.model.case import make_tangents
    return args[:-1] + make_tangents(case)


def _truth_and_peer(case: Case, programs, chunk_convention: str, forward: bool) -> tuple:
    """The truth's and the peer's outputs: those launched ahead, else computed now."""
    launched = _launched.pop((case, programs, chunk_convention, forward), None)
    if launched is not None:
        truth_program, truth, peer_program, peer = launched
        return truth_program.wait(truth), peer_program.wait(peer)
    args = _reference_args(case, forward)
    return tuple(oracle_program(case, truth, chunk_convention, programs, forward=forward)(*args)
                 for truth in (True, False))


def forget_launched(keep: Case | None = None) -> None:
    """Lets go of the references launched ahead and not read, both modes, but those of case
    `keep` (the runner: at a case's end, keeping the next case's; at its end, all)."""
    for key in [k for k in _launched if k[0] != keep]:
        del _launched[key]


def reference_for(case: Case, programs=None, chunk_convention: str = "segment") -> Reference:
    """The case's reference, from `programs` (harness.engine.programs.Programs: compiled ahead,
    timed; by default the shared ones) or from plain jit; chunks by the kernel's convention
    (harness.model.features). Kept (REFERENCES_KEPT)."""
    return _kept_reference(case, programs if programs is not None else _shared_programs,
                           chunk_convention)


def jvp_reference_for(case: Case, programs=None, chunk_convention: str = "segment"
                      ) -> Reference:
    """The forward-mode check's reference for the case's input tangents
    (harness.model.case.make_tangents): the truth's output tangent, and how far the same-dtype
    peer's lands from it per token (a Reference whose one tensor is the tangent). Kept."""
    return _kept_jvp_reference(case, programs if programs is not None else _shared_programs,
                               chunk_convention)


@functools.lru_cache(maxsize=REFERENCES_KEPT)
def _kept_reference(case: Case, programs, chunk_convention: str) -> Reference:
    args = make_inputs(case).device_args
    truth, peer = _truth_and_peer(case, programs, chunk_convention, False)
    errors, biggest = jax.device_get((token_errors(peer[:4], truth[:4]),
                                      scales(truth[:4], args[3])))
    out = Reference(truth=truth,
                    peer_token_err={c.name: e[0] for c, e in zip(TENSORS, errors)},
                    scale={c.name: float(b) for c, b in zip(TENSORS, biggest)})
    if case.features.sinks:
        t, p = np.asarray(truth[4], np.float64), np.asarray(peer[4], np.float64)
        out.peer_dsinks_err = float(np.abs(p - t).max())
        out.dsinks_scale = float(np.abs(t).max())
    return out


@functools.lru_cache(maxsize=REFERENCES_KEPT)
def _kept_jvp_reference(case: Case, programs, chunk_convention: str) -> Reference:
    args = _reference_args(case, True)
    truth, peer = _truth_and_peer(case, programs, chunk_convention, True)
    errors, biggest = jax.device_get((token_errors(peer, truth), scales(truth, args[3])))
    return Reference(truth=truth, peer_token_err={JVP.name: errors[0][0]},
                     scale={JVP.name: float(biggest[0])})
