"""The bug zoo: broken attention kernels, each a bug class seen in real kernels, and correct
kernels written with different math. `python -m harness selftest` (harness.tools.selftest) runs them
all and proves that the harness catches every bug and flags no correct kernel.

Zoo kernels are never registered: they do not appear in `python -m harness list` or in the
kernel x case matrix.

Every kernel follows harness.kernels.kernel: `fn(query, key, value, segment_ids, *, causal, scale)`,
[batch, seq, heads, head_dim], query head h reads kv head h // (heads // kv_heads). Masks are
[batch, seq_q, seq_k] booleans built from the segment ids. Valid queries never read padding;
padding queries (never compared) read something harmless so that nothing is NaN.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp

from harness.kernels.kernel import Kernel
from harness.tools.zoo.bugs import (
    BLOCK_TILE,
    FOLD,
    WINDOW,
    always_causal,
    backward_bug,
    block_granular_mask,
    causal_first_segment_only,
    float32_output,
    folded_mask,
    last_segment_unmasked,
    lengths_only,
    mask_after_softmax,
    nan_output_at_padding,
    off_by_one_mask,
    padding_keys_mask,
    reorder_forgets_segments,
    scale_twice,
    single_tokens_zeroed,
    window_mask,
    with_mask,
    writes_at_padding,
    wrong_gqa,
)
from harness.tools.zoo.feature_bugs import bug, features_dense, features_online
from harness.tools.zoo.forward_mode import hand_written_jvp
from harness.tools.zoo.reference_math import additive_bias, float64, online_softmax

__all__ = ["BLOCK_TILE", "FOLD", "WINDOW", "Entry", "entries"]


@dataclass(frozen=True)
class Entry:
    kernel: Kernel
    bug: str            # the bug class in one line; for a correct kernel, its math
    correct: bool = False

    @property
    def name(self) -> str:
        return self.kernel.name



def _kernel(name, fn, description, features=(), **more):
    return Kernel(name, fn, padding_anywhere=True, materializes_scores=True,
                  dtypes=("float32", "bfloat16"), tags=("zoo",), description=description,
                  features=features, constraints=_feature_cases_only if features else None,
                  **more)


# Kernels of plain jax: jax's autodiff gives them forward mode, and the jvp check holds them to
# it (the correct ones are its controls).
_PLAIN_JAX = {"ok_additive_bias", "ok_online_softmax", "ok_features_dense", "ok_features_online"}
# A forward-mode kernel of its own (a JVP rule) and no backward: the jvp check alone judges it.
_FORWARD_ONLY = dict(forward_mode=True, backward=False)

_FORWARD_BUGS = [
    ("jvp_ignores_segments", hand_written_jvp(tangent_ignores_segments=True),
     "JVP kernel ignores segment ids: the output right, its tangent leaks"),
]

_FORWARD_CORRECT = [
    ("ok_hand_written_jvp", hand_written_jvp(),
     "dense forward, JVP rule written out by hand (custom_jvp)"),
]


def _feature_cases_only(case, platform):
    """The feature kernels run on the cases with features (the others cover the rest)."""
    return [] if case.features else ["a feature kernel of the zoo: feature cases only"]


_EVERY_FEATURE = ("window", "softcap", "chunk", "sinks")

_FEATURE_BUGS = [
    ("window_dropped", bug(drop_window=True),
     "window dropped: the sliding window ignored, every earlier key read"),
    ("window_off_by_one", bug(window_extra=1),
     "window off by one: one key more than the window reaches"),
    ("window_from_row_start", bug(window_from_row=True),
     "window from the row's start: key indices against query positions"),
    ("softcap_dropped", bug(drop_softcap=True), "soft cap dropped: raw logits reach the softmax"),
    ("chunk_dropped", bug(drop_chunk=True), "chunks dropped: queries read earlier chunks"),
    ("sinks_ignored", bug(sinks_forward=False),
     "sinks ignored in the forward: no mass taken by the sink"),
    ("sinks_gradient_zero", bug(sinks_gradient=False),
     "sinks' gradient zero: the forward right, nothing reaches the sinks"),
    ("causal_with_cap_or_sinks", bug(causal_beside=True),
     "bidirectional read as causal when a soft cap or sinks are on"),
]

_FEATURE_CORRECT = [
    ("ok_features_dense", features_dense,
     "window, soft cap, chunks and sinks from segment ranges, dense"),
    ("ok_features_online", features_online,
     "every feature, online softmax over 64-key blocks seeded by the sink"),
]


_BUGS = [
    ("off_by_one_boundary", with_mask(off_by_one_mask),
     "boundary off by one: a segment also reads the token before it"),
    ("block_granular_mask", with_mask(block_granular_mask),
     "block-granular mask: a 64x64 tile touching a segment is read whole"),
    ("wrong_gqa_mapping", wrong_gqa,
     "wrong GQA head mapping: kv head h % kv_heads, not h // group"),
    ("gqa_grad_mean", backward_bug("mean"),
     "GQA backward: dk/dv averaged, not summed, over a kv head's group"),
    ("padding_keys_attended", with_mask(padding_keys_mask),
     "padding keys attended: the key-side mask lets id 0 through"),
    ("scale_applied_twice", scale_twice,
     "wrong scale: applied twice (1/d, not 1/sqrt(d))"),
    ("segment_ids_folded", with_mask(folded_mask),
     "segment ids folded into 4 bits: segment 17 reads segment 1"),
    ("local_window_512", with_mask(window_mask),
     "a local window: 512-token sliding window left on"),
    ("dq_only_leak", backward_bug("dq"),
     "dq-only leak: the dq backward kernel ignores segment ids"),
    ("dkdv_only_leak", backward_bug("dkdv"),
     "dk/dv-only leak: the dk/dv backward kernel ignores segment ids"),
    ("single_tokens_zeroed", single_tokens_zeroed,
     "single-token segments zeroed by an early exit"),
    ("last_segment_unmasked", with_mask(last_segment_unmasked),
     "last segment unmasked: it reads every earlier token"),
    ("causal_first_segment_only", with_mask(causal_first_segment_only),
     "non-causal after the first segment: later ones see their future"),
    ("causal_flag_ignored", with_mask(always_causal),
     "causal=False ignored: bidirectional rows computed causally"),
    ("lengths_only_segments", lengths_only,
     "segments rebuilt from lengths alone: padding between shifts them"),
    ("mask_after_softmax", mask_after_softmax,
     "segment mask applied after the softmax, not renormalized"),
    ("nan_output_at_padding", nan_output_at_padding,
     "NaN output at padding positions (poisons the next layer)"),
    ("grads_at_padding", writes_at_padding(lambda x: x),
     "non-zero dq/dk/dv at padding (stale values reach weight grads)"),
    ("nan_grads_at_padding", writes_at_padding(lambda x: jnp.full_like(x, jnp.nan), ("dk",)),
     "NaN dk at padding (every weight gradient goes NaN)"),
    ("float32_output", float32_output,
     "float32 output for bfloat16 inputs (the output contract)"),
    ("reorder_forgets_segments", reorder_forgets_segments,
     "context-parallel reorder moves the tokens, not their segment ids"),
]

_CORRECT = [
    ("ok_additive_bias", additive_bias,
     "additive -1e9 bias from segment start/stop, GQA by reshape"),
    ("ok_online_softmax", online_softmax,
     "online softmax over 128-key blocks (flash-style), fp32 state"),
    ("ok_float64", float64,
     "float64 forward and hand-written backward (custom_vjp)"),
]


def entries() -> list[Entry]:
    """The zoo: the broken kernels (the feature bugs among them), then the correct ones."""
    def plain(name):
        return {"forward_mode": True} if name in _PLAIN_JAX else {}
    return ([Entry(_kernel(name, fn, desc), desc) for name, fn, desc in _BUGS]
            + [Entry(_kernel(name, fn, desc, _EVERY_FEATURE), desc)
               for name, fn, desc in _FEATURE_BUGS]
            + [Entry(_kernel(name, fn, desc, **_FORWARD_ONLY), desc)
               for name, fn, desc in _FORWARD_BUGS]
            + [Entry(_kernel(name, fn, math, **plain(name)), math, correct=True)
               for name, fn, math in _CORRECT]
            + [Entry(_kernel(name, fn, math, _EVERY_FEATURE, **plain(name)), math, correct=True)
               for name, fn, math in _FEATURE_CORRECT]
            + [Entry(_kernel(name, fn, math, **_FORWARD_ONLY), math, correct=True)
               for name, fn, math in _FORWARD_CORRECT])
