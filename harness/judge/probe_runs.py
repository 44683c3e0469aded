"""How the leak probe's runs are compared with the run on unchanged inputs: per token, on the
device; launched in batches, the host launching a batch's runs while the device computes them,
and the batch read back after one wait with one device_get (harness.judge.leak_probe decides
what a change means)."""
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
        # counts above any noise threshold, and as noise makes a tensor unprobed), and so is
        # an infinity against a number (nan_to_num's default had made it float32's largest).
        change = jnp.where(differs, jnp.nan_to_num(
            jnp.abs(a.astype(jnp.float32) - b.astype(jnp.float32)), nan=jnp.inf,
            posinf=jnp.inf), 0.0)
        return jnp.stack([differs.any(axis=(2, 3)).astype(jnp.float32), change.max(axis=(2, 3))])
    return jnp.stack([one(a, b) for a, b in zip(base, other)])


def changes(base, other) -> list:
    """For each tensor (numpy): [B, T] bool, any value of the token differs (NaN equal to NaN,
    -0 equal to +0); and [B, T] the largest change. One transfer for all tensors."""
    return _read(stacked_changes(base, other))


def _read(stacked) -> list:
    return _split(jax.device_get(stacked))


def _split(stacked) -> list:   # [tensors, 2, B, T] -> per tensor (changed, largest change)
    return [(d > 0, c) for d, c in np.asarray(stacked)]


# Runs launched before the first of them is read back. A run's outputs are let go as soon as
# its comparison is launched: what a batch keeps is each run's small comparison.
RUNS_IN_FLIGHT = 8


def all_changes(program, base, runs: list[tuple], launched: list | None = None) -> list:
    """changes(base, the run's first len(base) results) for each run's arguments, in order.
    Where `program` can launch a run without waiting for it (harness.engine.program.Program),
    up to RUNS_IN_FLIGHT runs are launched, each with its comparison, and then read back
    together: one wait and one device_get per batch, not one per run (on the H200's warm nightly
    at c4f8fc7, launching two at a time and reading each run back took the worker's run thread
    76 s of its 203, in the launches' and the reads' calls into jax). The same runs, in the
    same order, as one at a time. `launched`: the first batch, launched already
    (launch_first with the same arguments)."""
    n = len(base)
    launch = getattr(program, "launch", None)
    if launch is None:
        return [changes(base, program(*args)[:n]) for args in runs]
    assert not launched or len(launched) == min(len(runs), RUNS_IN_FLIGHT), \
        "launched: launch_first of these runs"
    out = []
    for first in range(0, len(runs), RUNS_IN_FLIGHT):
        batch = launched if first == 0 and launched else launch_first(
            program, base, runs[first:first + RUNS_IN_FLIGHT])
        program.wait(batch)
        out += [_split(s) for s in jax.device_get(batch)]
    return out


def launch_first(program, base, runs: list[tuple]) -> list:
    """all_changes' first batch of these runs, launched (each with its comparison) and not
    waited for; [] where `program` cannot launch a run without waiting for it."""
    launch = getattr(program, "launch", None)
    if launch is None:
        return []
    return [stacked_changes(base, launch(*args)[:len(base)]) for args in runs[:RUNS_IN_FLIGHT]]


@ahead
def nonfinite_tokens(tensors):
    return jnp.stack([(~jnp.isfinite(t.astype(jnp.float32))).any(axis=(2, 3)) for t in tensors])
