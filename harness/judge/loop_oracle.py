"""The independent oracle: attention in NumPy float64, one segment at a time, the backward pass
written out by hand. It shares no code with the dense oracle (harness.judge.oracle), so the two
check each other (cases/test_oracle.py, cases/test_forward_mode.py); the definition they both
compute is in that module's docstring."""
from __future__ import annotations

import numpy as np

from harness.model.layouts import check_segment_ids


def segment_loop_attention(query, key, value, segment_ids, cotangent, *, scale: float,
                           causal: bool = True, features=None, sinks=None,
                           chunk_convention: str = "segment"):
    """Float64 forward output and (dq, dk, dv[, dsinks]) for the given output cotangent, one
    segment at a time, the backward pass written out by hand (soft cap and sinks included)."""
    q, k, v, do = (np.asarray(x, np.float64) for x in (query, key, value, cotangent))
    heads, kv_heads = q.shape[2], k.shape[2]
    group = heads // kv_heads
    out, dq = np.zeros(q.shape[:3] + v.shape[3:]), np.zeros_like(q)
    dk, dv = np.zeros_like(k), np.zeros_like(v)
    sink = None if sinks is None else np.asarray(sinks, np.float64)
    dsink = np.zeros(heads) if sink is not None else None
    cap = getattr(features, "softcap", None)
    for seg in check_segment_ids(np.asarray(segment_ids), padding="anywhere"):
        rows = (seg.row, slice(seg.start, seg.stop))
        qs, dos = q[rows], do[rows]                      # [L, H, D]
        ks = np.repeat(k[rows], group, axis=1)           # [L, H, D]
        vs = np.repeat(v[rows], group, axis=1)
        raw = np.einsum("qhd,khd->hqk", qs, ks) * scale
        s = cap * np.tanh(raw / cap) if cap else raw
        pos = np.arange(seg.length)
        allowed = np.ones((seg.length, seg.length), bool)
        if causal:
            allowed &= pos[None, :] <= pos[:, None]
        if features is not None and features.window is not None:
            left, right = features.window
            allowed &= ((pos[None, :] >= pos[:, None] - left)
                        & (pos[None, :] <= pos[:, None] + right))
        if features is not None and features.chunk is not None:
            c, at = features.chunk, pos if chunk_convention == "segment" else pos + seg.start
            allowed &= (at[None, :] // c) == (at[:, None] // c)
        s = np.where(allowed, s, -np.inf)
        top = s.max(-1, keepdims=True)
        if sink is not None:
            top = np.maximum(top, sink[:, None, None])
        e = np.exp(s - top)
        z = e.sum(-1, keepdims=True)
        if sink is not None:
            z = z + np.exp(sink[:, None, None] - top)
        p = e / z
        o = np.einsum("hqk,khd->qhd", p, vs)
        out[rows] = o
        dp = np.einsum("qhd,khd->hqk", dos, vs)
        # D = do . o: the sink takes mass but gives no value, so the same as without it.
        big_d = np.einsum("qhd,qhd->hq", dos, o)[..., None]
        ds = p * (dp - big_d)
        if cap:
            ds = ds * (1.0 - np.tanh(raw / cap) ** 2)
        dq[rows] = np.einsum("hqk,khd->qhd", ds, ks) * scale
        dk_h = np.einsum("hqk,qhd->khd", ds, qs) * scale
        dv_h = np.einsum("hqk,qhd->khd", p, dos)
        # A kv head's gradient is the sum over the query heads that read it.
        dk[rows] = dk_h.reshape(seg.length, kv_heads, group, -1).sum(2)
        dv[rows] = dv_h.reshape(seg.length, kv_heads, group, -1).sum(2)
        if sink is not None:
            p_sink = (np.exp(sink[:, None, None] - top) / z)[..., 0]     # [H, L]
            dsink -= (p_sink * big_d[..., 0]).sum(-1)
    grads = (dq, dk, dv) + ((dsink,) if sink is not None else ())
    return out, grads
