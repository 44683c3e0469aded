"""How the leak probe's runs are compared with the run on unchanged inputs: per token, on the
device, with one transfer per run; and run two at a time, the host launching one while the
device computes the other (harness.judge.leak_probe decides what a change means)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from harness.ahead import ahead


@ahead
def stacked_changes(base, other):
    def one(a, b):
        differs = (a != b) & ~(jnp.isnan(a) & jnp.isnan(b))
        # NaN against NaN is no change; NaN against a number is an infinite one (so that it
        # counts above any noise threshold, and as noise makes a tensor unprobed).
        change = jnp.where(differs, jnp.nan_to_num(
            jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)), nan=jnp.inf), 0.0)
        return jnp.stack([differs.any(axis=(2, 3)).astype(jnp.float32), change.max(axis=(2, 3))])
    return jnp.stack([one(a, b) for a, b in zip(base, other)])


def changes(base, other) -> list:
    """For each tensor (numpy): [B, T] bool, any value of the token differs (NaN equal to NaN,
    -0 equal to +0); and [B, T] the largest change. One transfer for all tensors."""
    return _read(stacked_changes(base, other))


def _read(stacked) -> list:
    return [(d > 0, c) for d, c in np.asarray(jax.device_get(stacked))]


def all_changes(program, base, runs: list[tuple]) -> list:
    """changes(base, the run's first len(base) results) for each run's arguments, in order.
    Where `program` can launch a run without waiting for it (harness.engine.programs.Program),
    each run is launched before the one before it is read back, so that the host launches one
    while the device computes the other (on the H200's warm nightly, launching the probe's
    runs one at a time took the worker's run thread 20 s beside its 25 s of waiting for the
    device); two runs at most are in flight. The same runs, in the same order, as one at a
    time."""
    n = len(base)
    launch = getattr(program, "launch", None)
    if launch is None:
        return [changes(base, program(*args)[:n]) for args in runs]
    out, pending = [], None
    for args in runs:
        launched = launch(*args)[:n]
        stacked = stacked_changes(base, launched)
        if pending is not None:
            out.append(_read(program.wait(pending)[1]))
        pending = (launched, stacked)
    if pending is not None:
        out.append(_read(program.wait(pending)[1]))
    return out


@ahead
def nonfinite_tokens(tensors):
    return jnp.stack([(~jnp.isfinite(t.astype(jnp.float32))).any(axis=(2, 3)) for t in tensors])
