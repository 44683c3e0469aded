"""The FlashAttention ports for JAX, through their varlen call `flash_mha_varlen`:
- `flash_attn:varlen` and `flash_attn:varlen_vmap`: flash-attn-jax 0.6.2 (FlashAttention-2;
  extra `flash-attn`), called on the packed rows flattened to one token stream, and per row
  through the library's own vmap rule;
- `flash_attn3:varlen`: flash-attn3-jax 0.2.3 (FlashAttention-3), flattened (the library has
  no vmap rule for its varlen primitives: per-row calls cannot be vmapped).

Both take q [total, heads, d], k and v [total, kv_heads, d] (GQA/MQA when kv_heads divides
heads) and `cu_seqlens` int32 [n+1], the cumulative boundaries of n sequences (0, l1, l1+l2,
..., the last entry the end of the last sequence), plus static `max_seqlen_q/k` (an upper
bound on any sequence's length: the row length T here) and `softmax_scale`, `is_causal`.

cu_seqlens cannot leave a gap between two sequences: padding before or between segments is
expressed as sequences of its own (a stretch of padding attends only itself, and no valid
query sees it), so these kernels take padding anywhere. Slots are static: a row of at most M
segments has at most 2M+1 runs (segments and stretches of padding); unused slots are
zero-length sequences (repeated boundaries). Flattened: every run of every row is a sequence,
each row's trailing padding included (rows are cut at their start). Per row (vmap): the
boundaries of the row's runs up to the end of its last segment; trailing padding is left out,
as a user lists documents, and the library's vmap rule makes it the gap sequence between rows.

Features: both take `window_size=(left, right)` (default (-1, -1), -1 unbounded): keys
[i + (sk - sq) - left, i + (sk - sq) + right] of each varlen sequence (their mask.h, bottom-right
aligned; sk = sq here, self-attention, so [i - left, i + right] within the sequence, which is
the segment), and `is_causal` forces right to 0 (the harness's causal cases have right 0). The
case's (left, right) is passed as is; padding runs, sequences of their own, get the window
too and stay apart. Nothing else: FA2's Python API has no soft cap, sinks, chunk argument and
asserts equal head dims (`dq == dk == dv`); FA3's FFI has `softcap` and `attention_chunk`, but
its Python wrapper hard-codes 0 for both (and the published wheel is built without soft
capping), and its output takes the query's head dim (wheel: head dim 128 only). So they
declare the window only.

From their source (wheels read 2026-11-30): bf16/f16 only (`assert q_dtype in [bfloat16,
float16]`); FA2 has kernels for head dims up to 256 (its wrapper pads d to a multiple of 8;
declared: multiples of 8), sm_80 code and PTX; FA3's published wheels carry sm_90 code for
head_dim 128 only. FFI targets: FA2 `flash_mha_varlen_fwd`/`flash_mha_varlen_bwd`, FA3
`flash_mha_fwd`/`flash_mha_bwd` (varlen shares them). Neither exposes a determinism switch
(FA2 passes `deterministic=False` to its backward; FA3's varlen call does not forward one).
The two libraries register FFI targets of the same names: whichever is imported second fails
("Duplicate FFI handler registration"), so their kernels are in different isolation groups.
"""
from __future__ import annotations

import ctypes
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from harness.kernels.kernel import Kernel
from harness.kernels.op import CUDNN, CUDNN_HEAD_DIMS

# Custom calls of each pass; the _BACKWARD ones only its backward pass holds.
FA2_BACKWARD_MARKERS = ("flash_mha_varlen_bwd",)
FA2_MARKERS = ("flash_mha_varlen_fwd", *FA2_BACKWARD_MARKERS)
FA3_BACKWARD_MARKERS = ("flash_mha_bwd",)
FA3_MARKERS = ("flash_mha_fwd", *FA3_BACKWARD_MARKERS)


def run_starts(segment_ids):
    """[B, T] bool: where a run of equal ids (a segment, or a stretch of padding) begins; every
    row's first token begins one."""
    seg = segment_ids.astype(jnp.int32)
    prev = jnp.concatenate([jnp.full_like(seg[:, :1], -1), seg[:, :-1]], axis=1)
    return seg != prev


def slots_per_row(max_segments: int) -> int:
    """Runs a row of at most max_segments segments can have: the segments, and a stretch of
    padding before each and after the last."""
    return 2 * max_segments + 1


def flat_cu_seqlens(segment_ids, max_segments: int):
    """int32 [B * (2M+1) + 1]: every run of the flattened rows as one sequence; unused slots are
    zero-length sequences at the end."""
    b, t = segment_ids.shape
    starts = jnp.nonzero(run_starts(segment_ids).reshape(-1),
                         size=b * slots_per_row(max_segments), fill_value=b * t)[0]
    return jnp.concatenate([starts, jnp.array([b * t])]).astype(jnp.int32)


def row_cu_seqlens(segment_ids, max_segments: int):
    """int32 [B, 2M+1]: per row, the boundaries of its runs up to the end of its last segment
    (trailing padding left out), the unused slots repeating that end."""
    _, t = segment_ids.shape
    index = jnp.arange(t, dtype=jnp.int32)[None]
    end = jnp.max(jnp.where(segment_ids > 0, index + 1, 0), axis=1)          # [B]
    starts = run_starts(segment_ids) & (index < end[:, None])
    first = jax.vmap(lambda s: jnp.nonzero(s, size=2 * max_segments, fill_value=t)[0])(starts)
    cu = jnp.concatenate([jnp.minimum(first, end[:, None]), end[:, None]], axis=1)
    return cu.astype(jnp.int32)


def load_cudart12() -> None:
    """flash-attn-jax's extension links libcudart.so.12, which a CUDA 13 jax does not bring:
    load it globally first, from the system or from the nvidia-cuda-runtime-cu12 package
    (nvidia/cuda_runtime/lib on sys.path). If neither has it, the import that follows fails
    with the loader's own message."""
    try:
        ctypes.CDLL("libcudart.so.12", mode=ctypes.RTLD_GLOBAL)
        return
    except OSError:
        pass
    for root in sys.path:
        path = os.path.join(root or ".", "nvidia", "cuda_runtime", "lib", "libcudart.so.12")
        if os.path.exists(path):
            ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
            return


def fa2_module():
    load_cudart12()
    import flash_attn_jax
    return flash_attn_jax


# The features the ports' Python APIs take (harness.model.features).
FA_FEATURES = ("window",)


def window_size(window) -> dict:
    """The ports' keyword for a window (left, right): `window_size=(left, right)`; nothing
    without one (their default (-1, -1), unbounded)."""
    return {} if window is None else {"window_size": (int(window[0]), int(window[1]))}


def _flattened(varlen, query, key, value, segment_ids, *, causal, scale, max_segments,
               window=None):
    b, t, heads, d = query.shape
    cu = flat_cu_seqlens(segment_ids, max_segments)
    out = varlen(query.reshape(b * t, heads, d), key.reshape(b * t, key.shape[2], d),
                 value.reshape(b * t, value.shape[2], d), cu, cu, max_seqlen_q=t,
                 max_seqlen_k=t, softmax_scale=scale, is_causal=causal, **window_size(window))
    return out.reshape(query.shape)


def fa2_flattened(query, key, value, segment_ids, *, causal, scale, max_segments, window=None):
    """flash_attn_jax.flash_mha_varlen on the rows flattened to one token stream."""
    return _flattened(fa2_module().flash_mha_varlen, query, key, value, segment_ids, causal=causal,
                      scale=scale, max_segments=max_segments, window=window)


def _vmapped(varlen, query, key, value, segment_ids, *, causal, scale, max_segments,
             window=None):
    t = query.shape[1]

    def row(q, k, v, cu):
        return varlen(q, k, v, cu, cu, max_seqlen_q=t, max_seqlen_k=t, softmax_scale=scale,
                      is_causal=causal, **window_size(window))

    return jax.vmap(row)(query, key, value, row_cu_seqlens(segment_ids, max_segments))


def fa2_vmapped(query, key, value, segment_ids, *, causal, scale, max_segments, window=None):
    """jax.vmap of flash_attn_jax.flash_mha_varlen over rows, each with its own cu_seqlens:
    the library's vmap rule flattens the batch itself."""
    return _vmapped(fa2_module().flash_mha_varlen, query, key, value, segment_ids, causal=causal,
                    scale=scale, max_segments=max_segments, window=window)


def fa3_flattened(query, key, value, segment_ids, *, causal, scale, max_segments, window=None):
    """flash_attn3_jax.flash_mha_varlen on the rows flattened to one token stream."""
    import flash_attn3_jax
    return _flattened(flash_attn3_jax.flash_mha_varlen, query, key, value, segment_ids,
                      causal=causal, scale=scale, max_segments=max_segments, window=window)


# exp overflows float32 above this: ln(FLT_MAX).
LN_FLOAT32_MAX = float(np.log(np.finfo(np.float32).max))


def _ln_overflow(dtype) -> float:
    """ln of the smallest value that rounds to infinity in `dtype` (its largest finite value
    plus half an ulp there): float16 11.09, bfloat16 88.72."""
    import ml_dtypes
    info = ml_dtypes.finfo(dtype)
    top = float(info.max)
    return float(np.log(top + float(info.eps) * 2.0 ** np.floor(np.log2(top)) / 2))


def vmap_rule_padding(case, row):
    """Which rows' padding flash-attn-jax 0.6.2's vmap rule for its varlen call gets wrong
    (upstream; reproducer: reports/census/repro/flash_attn_varlen_vmap.py), from its source
    (`varlen_fwd.py`, `varlen_bwd.py`, `_flash_mha_varlen_*_batch`) and the case's inputs.

    The rule flattens the rows and offsets each row's cu_seqlens by its start, so a row's
    trailing padding (what a user leaves out of cu_seqlens) becomes a sequence of its own
    between two rows. The forward drops that sequence's log-sum-exp, and the backward pads it
    back with zeros: there the softmax is exp(score * scale - 0), which overflows once a score
    reaches ln(FLT_MAX), and infinity times the zero cotangent is NaN in dq, dk and dv. For
    dv the softmax is first rounded to the inputs' type (its product with the cotangent runs
    in that type), which overflows sooner in float16: a score of ln(65520) = 11.09 makes dv
    NaN there (dq and dk stay finite: their softmax is multiplied by the zero cotangent in
    float32 first). So a row other than the last fails where some query of its trailing
    padding scores some key it sees there (causal: those before it) at or above the lower of
    the two, computed here from the case's inputs (the poisoned padding scores high). The last
    row's trailing padding is in no sequence at all and never written: it reads NaN
    (harness.engine.unwritten). Checked against the H200's records: 89 of 89 padded rows of
    a nightly, and 252 of 252 of the flake study's four seeds, whose float16 rows showed the
    float16 threshold (cases/test_census_adapters.py checks the nightly's and the float16
    ones). For bfloat16 the threshold is bfloat16's, 88.7209, a hair under float32's 88.7228."""
    ids = case.segment_ids[row]
    valid = np.flatnonzero(ids > 0)
    end = int(valid.max()) + 1 if valid.size else 0
    if end == ids.size:
        return "pass"                      # no trailing padding: an empty sequence
    if row == case.batch - 1:
        return "fail"
    from harness.model.case import make_inputs  # cached: a case's rows draw it once
    inputs = make_inputs(case)
    q = np.asarray(inputs.query[row, end:], np.float32)                        # [L, H, d]
    k = np.repeat(np.asarray(inputs.key[row, end:], np.float32),
                  case.heads // case.kv_heads, axis=1)                          # [L, H, d]
    threshold = min(LN_FLOAT32_MAX, _ln_overflow(case.dtype))
    for first in range(0, q.shape[0], 256):     # queries in blocks: a long gap is 8k tokens
        scores = np.einsum("ihd,jhd->hij", q[first:first + 256], k) * case.scale
        if case.causal:
            seen = np.arange(first, first + scores.shape[1])[:, None] >= np.arange(k.shape[0])
            scores = np.where(seen[None], scores, -np.inf)
        if scores.max() >= threshold:
            return "fail"
    return "pass"


def _sm90_only(case, platform):
    cc = platform.compute_capability
    if platform.name == "gpu" and cc is not None and int(cc) != 9:
        return [f"flash-attn3-jax's published wheels carry sm_90 code only; device has {cc}"]
    return []


_FA2 = dict(dtypes=CUDNN, head_dims=CUDNN_HEAD_DIMS, devices=("gpu",), padding_anywhere=True,
            min_compute_capability=8.0, requires=("flash_attn_jax", "einops"),
            takes_max_segments=True, hlo_markers=FA2_MARKERS,
            backward_markers=FA2_BACKWARD_MARKERS, isolation="flash_attn2",
            features=FA_FEATURES,
            # Its backward accumulates dq with atomic adds, and no setting changes that: the
            # leak probe decides its gradients statistically (harness.judge.leak_probe).
            reproducible=False)

KERNELS = [
    Kernel("flash_attn:varlen", fa2_flattened, **_FA2,
           description="flash-attn-jax 0.6.2 flash_mha_varlen (FlashAttention-2), rows "
                       "flattened with cu_seqlens"),
    Kernel("flash_attn:varlen_vmap", fa2_vmapped, **_FA2, expect_padding=vmap_rule_padding,
           description="flash-attn-jax 0.6.2 flash_mha_varlen (FlashAttention-2), per-row "
                       "cu_seqlens through its vmap rule"),
    Kernel("flash_attn3:varlen", fa3_flattened, dtypes=CUDNN, head_dims=(128,), devices=("gpu",),
           padding_anywhere=True, min_compute_capability=9.0, constraints=_sm90_only,
           requires=("flash_attn3_jax", "einops"), takes_max_segments=True,
           hlo_markers=FA3_MARKERS, backward_markers=FA3_BACKWARD_MARKERS, isolation="flash_attn3",
           reproducible=False,
           features=FA_FEATURES,
           description="flash-attn3-jax 0.2.3 flash_mha_varlen (FlashAttention-3, Hopper, "
                       "head_dim 128), rows flattened with cu_seqlens"),
]
