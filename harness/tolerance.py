"""The tolerance model: a kernel's error is judged against a same-dtype peer's error plus a floor.

For each check and segment:

    tolerance = peer_factor * peer_err + floor_eps * eps(dtype) * max|truth|
    ratio     = kernel_err / tolerance          (pass iff finite and ratio <= 1)

- kernel_err, peer_err: max abs difference from the float32 truth over the segment's tokens.
  The peer is the reference formula computed in the input dtype (oracle.dense_attention with
  truth=False), so peer_err is the rounding noise an honest kernel of that dtype can have.
- peer_factor: 2 for the output, 3 for gradients, as flash-attention's tests use. A fused kernel
  rounds differently from the peer (online softmax, bf16 probabilities, another accumulation
  order); backward passes chain more roundings than the forward pass.
- floor: the peer's error can be exactly zero (a single-token segment's output is its value row;
  its dq is zero in exact arithmetic), which would demand bitwise equality. The floor allows a
  couple of roundings of the largest value of that check: 2 eps for the output; 4 eps for the
  gradients, whose kernels recompute softmax statistics from a rounded output.
  It uses the largest |truth| over the whole check tensor, not the segment, because a tiny
  segment-local scale (dq of a single token is 0) says nothing about the kernel's rounding.

A leak across a segment boundary moves outputs by O(1) of the values' scale, while the
tolerances are O(eps) of it: a bf16 leak shows ratios in the tens to hundreds.
"""
from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp


@dataclass(frozen=True)
class Rule:
    peer_factor: float
    floor_eps: float


RULES = {
    "out": Rule(peer_factor=2.0, floor_eps=2.0),
    "dq": Rule(peer_factor=3.0, floor_eps=4.0),
    "dk": Rule(peer_factor=3.0, floor_eps=4.0),
    "dv": Rule(peer_factor=3.0, floor_eps=4.0),
}


def tolerance(check: str, dtype: str, peer_err: float, truth_scale: float) -> float:
    rule = RULES[check]
    eps = float(jnp.finfo(dtype).eps)
    # The last term only keeps the tolerance positive for an all-zero check.
    return rule.peer_factor * peer_err + rule.floor_eps * eps * truth_scale + 1e-30


def ratio(kernel_err: float, tol: float) -> float:
    return kernel_err / tol
