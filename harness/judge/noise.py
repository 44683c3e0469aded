"""Run-to-run noise: what reruns of a kernel on unchanged inputs say about a tensor that is not
reproducible, and the change that counts above it (harness.judge.leak_probe decides where it is
asked for and what a change means).

A tensor's noise is each valid token's largest difference over the reruns (`rerun_noise`).
Its threshold is NOISE_FACTOR times the largest (at least NOISE_FLOOR_ULPS roundings of the
tensor's largest value), raised until the false-alarm probability fits FALSE_ALARM_BUDGET:
the tail of the pooled differences is fitted with an exponential above its TAIL_QUANTILE
(rounding noise, a sum of many roundings, has a lighter tail than that), which gives the
chance that one run's noise at a token passes the threshold (`Noise.exceed`)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from harness.judge.probe_runs import all_changes

# A tensor that differs run to run: changes above this many times its largest run-to-run
# difference count, in both of two runs, on perturbations leak_probe.amplitude() times
# larger; none at all when that difference is POWERLESS of the tensor's largest value.
NOISE_FACTOR = 4.0
NOISE_FLOOR_ULPS = 2.0
POWERLESS = 0.01

# The false-alarm probability one probe (a kernel on a case) may have: a night of a few hundred
# probed cases per kernel stays below 1e-3.
FALSE_ALARM_BUDGET = 1e-6
TAIL_QUANTILE = 0.99


@dataclass
class Noise:
    """A tensor's run-to-run differences on valid tokens, and what they allow."""
    largest: float
    sample: np.ndarray         # per-token largest difference over the reruns (valid tokens)

    def exceed(self, threshold: float) -> float:
        """P(one run's noise at a token > threshold): the empirical share above the tail's
        start, times an exponential tail fitted above it (at least 1/n where nothing was seen
        above the threshold's start: the sample cannot say less)."""
        d = self.sample
        if d.size == 0 or self.largest == 0:
            return 0.0 if threshold > 0 else 1.0
        u = float(np.quantile(d, TAIL_QUANTILE))
        above = d[d > u]
        p_u = max(above.size, 1) / d.size
        if threshold <= u:
            return float((d > threshold).mean())
        beta = float((above - u).mean()) if above.size else max(u, self.largest) / 4
        beta = max(beta, (self.largest - u) / 4, 1e-30)
        return p_u * math.exp(-(threshold - u) / beta)

    def threshold(self, floor: float, tokens: int, runs: int) -> float:
        """NOISE_FACTOR times the largest difference (at least `floor`), raised until noise
        alone passes it at some token of some run, twice, with at most FALSE_ALARM_BUDGET."""
        t = NOISE_FACTOR * max(self.largest, floor)
        allowed = math.sqrt(FALSE_ALARM_BUDGET / max(tokens * runs, 1))
        while self.exceed(t) > allowed:
            t *= 1.25
        return t


def rerun_noise(program, args, base, names, valid, reruns) -> dict[str, Noise]:
    """Per tensor: the per-token largest difference (valid tokens) between the base and each of
    `reruns` runs of the unchanged inputs."""
    diffs = {n: np.zeros(int(valid.sum()), np.float32) for n in names}
    for changes in all_changes(program, base, [args] * reruns):
        for name, (_, change) in zip(names, changes):
            if valid.any():
                diffs[name] = np.maximum(diffs[name], change[valid])
    return {n: Noise(float(d.max()) if d.size else 0.0, d) for n, d in diffs.items()}


def gated_thresholds(noise: dict, gated: list[str], scale: dict, dtype: str, tokens: int,
                     runs: int) -> dict[str, float]:
    """Each gated tensor's threshold; the kernel x case's false-alarm budget is shared among
    them (runs x tensors chances for noise to pass twice)."""
    eps = float(jnp.finfo(dtype).eps)
    return {n: noise[n].threshold(NOISE_FLOOR_ULPS * eps * scale[n], tokens,
                                  runs * max(len(gated), 1)) for n in gated}
