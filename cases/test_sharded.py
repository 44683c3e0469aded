"""Sharded kernels (harness.kernels.sharded) and context parallelism's load-balancing reorder
(harness.kernels.load_balance).

The sharded cases run the harness's CLI in a subprocess on fake CPU devices: jax fakes N of
them only when XLA_FLAGS says so before it starts, and this process started it with one. The
correct kernels must pass every check of every segment (leak probe included) in token order;
the reorder canary must be caught exactly where its expectation says, which on these cases is
the leak probe on every segment of every packed row.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness.kernels.kernel import Kernel, Platform
from harness.engine.registry import select_kernels
from harness.engine.runner import run_kernel_case
from harness.judge import probe_groups
from harness.judge.vocabulary import BAD
from harness.kernels import load_balance, sharded
from harness.model.case import Case

ROOT = Path(__file__).resolve().parents[1]
# CPU devices, also on a machine with GPUs: the CI path, whatever runs it.
FAKE_DEVICES = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_PLATFORMS": "cpu"}
CORRECT = ("sharded:sut:dot_product:data", "sharded:sut:dot_product:heads",
           "sharded:cp:dot_product")
CANARY = "sharded:reorder_canary"
# One shape (programs compile once): layouts where every segment of every packed row reads
# under another segment's id, and single tokens, where some do not (the canary computes them
# right: expected to pass there).
CASES = ("packed/many-b4-t256-h4kv2-d64-bf16-s0", "padded/between-b4-t256-h4kv2-d64-bf16-s0",
         "unaligned/block-edges-b4-t256-h4kv2-d64-bf16-s0")
BLIND_SPOTS = "extremes/single-tokens-b4-t256-h4kv2-d64-bf16-s0"


# ----- the reorder --------------------------------------------------------------------------

def _te_striped(seq_len, cp, stripe):
    """TE 2.20.2's Striped reorder as its source defines it (reorder_causal_striped): the
    sequence as [seq_len / (cp * stripe), cp, stripe], the first two axes swapped."""
    return np.arange(seq_len).reshape(seq_len // (cp * stripe), cp, stripe) \
        .swapaxes(0, 1).reshape(-1)


def test_striped_order_is_tes():
    # TE's docstring: 4 GPUs, 16 tokens -> GPU0 [0, 4, 8, 12], GPU1 [1, 5, 9, 13], ...
    assert load_balance.striped_order(16, 4).tolist() == [0, 4, 8, 12, 1, 5, 9, 13,
                                                          2, 6, 10, 14, 3, 7, 11, 15]
    assert load_balance.striped_order(8, 2, stripe=2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    for t, cp, stripe in [(8, 2, 1), (256, 2, 1), (1152, 4, 1), (96, 2, 4), (96, 3, 8)]:
        assert (load_balance.striped_order(t, cp, stripe) == _te_striped(t, cp, stripe)).all()
    with pytest.raises(ValueError, match="not a multiple of cp"):
        load_balance.striped_order(10, 4)


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is None,
                    reason="Transformer Engine is not installed (GPU runner only)")
def test_reorder_matches_transformer_engine():
    from transformer_engine.jax.attention import (ReorderStrategy,
                                                  inverse_reorder_causal_load_balancing,
                                                  reorder_causal_load_balancing)
    x = jnp.arange(2 * 64 * 3, dtype=jnp.float32).reshape(2, 64, 3)
    ours = load_balance.reorder(x, 2)
    theirs = reorder_causal_load_balancing(x, ReorderStrategy.Striped, cp_size=2, seq_dim=1,
                                           stripe_size=1)
    assert (ours == theirs).all()
    assert (load_balance.restore(ours, 2) == inverse_reorder_causal_load_balancing(
        theirs, ReorderStrategy.Striped, cp_size=2, seq_dim=1, stripe_size=1)).all()


def test_reorder_round_trips_and_its_gradient_restores_token_order():
    x = np.random.default_rng(0).standard_normal((2, 12, 3)).astype(np.float32)
    reordered = load_balance.reorder(x, 2)
    assert reordered[:, :6].tolist() == x[:, ::2].tolist()       # device 0: even tokens
    assert (load_balance.restore(reordered, 2) == x).all()
    assert (np.asarray(load_balance.restore(load_balance.reorder(jnp.asarray(x), 2), 2)) == x).all()
    ct = jnp.asarray(np.random.default_rng(1).standard_normal(x.shape).astype(np.float32))
    _, pullback = jax.vjp(lambda a: load_balance.reorder(a, 2), jnp.asarray(x))
    assert (pullback(ct)[0] == load_balance.restore(ct, 2)).all()


# ----- capabilities -------------------------------------------------------------------------

def test_a_kernel_needing_more_devices_is_skipped_with_the_reason():
    case = Case.from_id(CASES[0])
    kernel = Kernel("two", lambda *a, **k: None, min_devices=2)
    assert kernel.unsupported_reasons(case, Platform("cpu")) == ["needs 2 devices, 1 visible"]
    assert kernel.unsupported_reasons(case, Platform("cpu", device_count=2)) == []
    for kernel in select_kernels([k.name for k in sharded.KERNELS]):
        assert kernel.min_devices == 2
        if jax.device_count() < 2:
            records = run_kernel_case(kernel, case, Platform("cpu")).records
            assert [r.verdict for r in records] == ["skip"]
            assert "needs 2 devices, 1 visible" in records[0].message


# ----- the canary's expectation ---------------------------------------------------------------

def test_the_expectation_models_the_canary_exactly():
    """The canary (run on one device) computes attention under exactly the mask the
    expectation simulates; where that mask is right, its expectation is pass."""
    case = Case.from_id(BLIND_SPOTS)
    ids = case.segment_ids
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((4, 256, h, 16)), jnp.float32) for h in (4, 2, 2))
    out = sharded.cp_dot_product(q, k, v, jnp.asarray(ids), causal=True, scale=0.25, devices=1,
                                 reorder_ids=False)
    wrong, right = load_balance.forgotten_reorder_masks(ids, causal=True)
    simulated = sharded.masked_dot_product(q, k, v, jnp.asarray(wrong), scale=0.25)
    assert np.abs(np.asarray(out - simulated)).max() < 1e-5
    assert not (wrong == right).all()
    row0 = {s.number: s for s in case.row_segments(0)}  # runs 1, 1, 1, 252, 1
    row1 = {s.number: s for s in case.row_segments(1)}  # runs 254, 1, 1
    expect = load_balance.forgotten_reorder_expectation
    # Row 0: segment 1 keeps its own id, right everywhere. Segment 2 takes segment 4's id and
    # reads its first token; segment 4 reads segment 2. Two segments apart: the checkerboard
    # never redraws them apart (its blind spot); a row of three segments or more takes six
    # colours, and both are caught.
    assert probe_groups.colours(ids) == 6
    assert [expect(case, c, row0[1]) for c in ("out", "dq", "dk", "dv", "leak")] == ["pass"] * 5
    assert expect(case, "out", row0[2])[0] == "either" and expect(case, "leak", row0[2]) == "fail"
    assert expect(case, "leak", row0[4]) == "fail"
    # Row 1: segments 1 and 2 read each other (two colours): caught; segment 3 keeps its id.
    assert [expect(case, "leak", row1[n]) for n in (1, 2, 3)] == ["fail", "fail", "pass"]


def test_rows_the_forgotten_reorder_leaves_right_pass():
    """A row of 255 tokens and one: every token keeps its own id after the reorder."""
    case = Case("extremes/long", 1, 256, 2, 1, 16, "bfloat16", 0)
    assert len(case.row_segments(0)) == 2
    for seg in case.segments:
        for check in ("out", "dq", "dk", "dv", "leak"):
            assert load_balance.forgotten_reorder_expectation(case, check, seg) == "pass"
    two = Case("custom/rows", 1, 16, 2, 1, 16, "float32", 0, rows=((6, 10),))
    for seg in two.segments:
        assert load_balance.forgotten_reorder_expectation(two, "leak", seg) == "fail"
        assert load_balance.forgotten_reorder_expectation(two, "out", seg)[0] == "either"


# ----- tracing inside the mesh's context --------------------------------------------------------

def test_within_traces_forward_and_backward_inside_the_contexts():
    """TE binds its context-parallel primitives under the mesh and MeshResource, forward and
    backward; the harness traces the backward after the kernel returned."""
    import contextlib
    active = []

    @contextlib.contextmanager
    def guard():
        active.append(True)
        try:
            yield
        finally:
            active.pop()

    @jax.custom_vjp
    def needs_guard(q, k, v, ids, pos):
        return q * k + v

    def forward(q, k, v, ids, pos):
        assert active, "forward traced outside the context"
        return q * k + v, (q, k)

    def backward(res, g):
        assert active, "backward traced outside the context"
        q, k = res
        return g * k, g * q, g, None, None

    needs_guard.defvjp(forward, backward)
    x = jnp.arange(4.0)
    ids = jnp.ones(4, jnp.int32)
    with pytest.raises(AssertionError, match="outside the context"):
        jax.jit(jax.grad(lambda q: needs_guard(q, x, x, ids, ids).sum()))(x)
    run = sharded.within(lambda: [guard()], needs_guard)
    grad = jax.jit(jax.grad(lambda q: run(q, x, x, ids, ids).sum()))(x)
    assert (grad == x).all() and not active


# ----- the sharded cases on fake devices --------------------------------------------------------

def _harness(python, *args, tmp_path, extra_env=None):
    env = {**os.environ, **FAKE_DEVICES, "PYTHONPATH": str(ROOT), **(extra_env or {})}
    return subprocess.run([python, "-m", "harness", *args, "--report-dir", str(tmp_path)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def _records(report_dir):
    from harness.store import report_file as rec
    return rec.read(report_dir)


def test_sharded_kernels_on_two_fake_devices(tmp_path):
    cases = ",".join((*CASES, BLIND_SPOTS))
    out = _harness(sys.executable, "run", "--suite", "smoke", "--kernels",
                   ",".join((*CORRECT, CANARY)), "--cases", cases, tmp_path=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    header, records = _records(tmp_path)
    assert header["environment"]["device_count"] == 2
    assert not [r for r in records if r.outcome in BAD or r.verdict == "error"]
    skipped = {(r.kernel, r.case_id) for r in records if r.verdict == "skip"}
    # The op follows MaxText's convention (padding only after the last segment).
    assert skipped == {(k, CASES[1]) for k in CORRECT[:2]}
    for kernel in (*CORRECT, CANARY):
        for case_id in (*CASES, BLIND_SPOTS):
            case = Case.from_id(case_id)
            if (kernel, case_id) in skipped:
                continue
            mine = [r for r in records if r.kernel == kernel and r.case_id == case_id]
            leak = {(r.row, r.segment): r for r in mine if r.check == "leak"}
            assert set(leak) == {(s.row, s.number) for s in case.segments}, (kernel, case_id)
            if kernel in CORRECT:
                assert all(r.outcome == "ok" for r in mine), (kernel, case_id)
            elif case_id in CASES:      # caught by the probe on every segment of packed rows
                for s in case.segments:
                    if case.segments_in_row(s.row) > 1:
                        assert leak[(s.row, s.number)].outcome == "caught", (case_id, s)
    blind = [r for r in records if r.kernel == CANARY and r.case_id == BLIND_SPOTS]
    assert {r.outcome for r in blind if r.check == "leak"} == {"ok", "caught"}


def test_sharded_programs_really_span_two_devices():
    """The context-parallel program gathers keys over two devices; the op's splits its rows."""
    script = """
import jax, jax.numpy as jnp
from harness.kernels import sharded
s = jax.ShapeDtypeStruct
q, kv, seg = s((4, 64, 4, 16), jnp.float32), s((4, 64, 2, 16), jnp.float32), s((4, 64), jnp.int32)
cp = jax.jit(lambda q, k, v, i: sharded.cp_dot_product(q, k, v, i, causal=True, scale=0.25))
text = cp.lower(q, kv, kv, seg).compile().as_text()
op = jax.jit(lambda q, k, v, i: sharded.op_data_heads(q, k, v, i, causal=True, scale=0.25,
             max_segments=4, attention="dot_product", data=2, heads=1))
shardings = op.lower(q, kv, kv, seg).compile().output_shardings
print(jax.device_count(), "all-gather" in text, len(shardings.device_set))
"""
    env = {**os.environ, **FAKE_DEVICES, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-3:] == ["2", "True", "2"]


STANDIN = ROOT / "cases" / "fixtures" / "te_standin.py"


@pytest.mark.skipif(importlib.util.find_spec("flax") is None or sys.version_info < (3, 12)
                    or importlib.util.find_spec("maxtext") is None,
                    reason="needs flax and maxtext (Python >= 3.12)")
def test_te_and_maxtext_context_parallel_plumbing_on_a_te_stand_in(tmp_path):
    """Everything but TE's kernel, for real: the reorder, the sharding, MaxText 0.2.5's own
    AttentionOp on its cudnn_flash_te path with ici_context_parallelism=2, the way back. TE's
    attention is the stand-in's (exact, and refusing any call that is not ring CP over THD
    inside the mesh and MeshResource)."""
    out = _harness(sys.executable, "run", "--suite", "smoke", "--kernel-module", str(STANDIN),
                   "--kernels", "standin:te:ring,standin:maxtext:cudnn_flash_te",
                   "--cases", CASES[0], tmp_path=tmp_path)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    _, records = _records(tmp_path)
    assert {r.kernel for r in records} == {"standin:te:ring", "standin:maxtext:cudnn_flash_te"}
    assert records and all(r.outcome == "ok" for r in records)
