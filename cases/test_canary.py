"""The harness catches the reported bug, exactly where it must, and subtler ones too."""
import jax
import jax.numpy as jnp
import pytest

from harness.cases import Case
from harness.kernels.reference import dot_product
from harness.registry import Kernel, Platform, select_kernels
from harness.suites import suite_cases

CPU = Platform("cpu")
CANARY = select_kernels("canary_causal_only")[0]


def _run(kernel, case):
    from harness.runner import run_kernel_case
    records = run_kernel_case(kernel, case, CPU).records
    assert all(r["verdict"] in ("pass", "fail") for r in records), records[0].get("message")
    return records


def _failing(records, check):
    return {(r["row"], r["segment"]) for r in records if r["check"] == check and r["verdict"] == "fail"}


@pytest.mark.parametrize("case", [c for c in suite_cases("smoke") if c.dtype != "float16"],
                         ids=lambda c: c.id)
def test_causal_only_is_caught_exactly_after_each_boundary(case):
    records = _run(CANARY, case)
    after_boundary = {(s.row, s.number) for s in case.segments if s.number > 1}
    # Forward output: every segment after a boundary fails, no segment 1 does. dq likewise,
    # except that a single-token segment's dq is not judged (see causal_only_expectation).
    assert _failing(records, "out") == after_boundary
    dq = _failing(records, "dq")
    assert {(s.row, s.number) for s in case.segments if s.number > 1 and s.length > 1} <= dq
    assert dq <= after_boundary
    for check in ("dk", "dv"):
        failing = _failing(records, check)
        for s in case.segments:
            later = sum(t.length for t in case.segments if t.row == s.row and t.number > 1)
            if case.segments_in_row(s.row) == 1:
                assert (s.row, s.number) not in failing, f"{check} {s.label}: unpacked row"
            elif s.number == 1 and later >= s.length and s.length <= 256:  # bf16/f32 limit
                assert (s.row, s.number) in failing, f"{check} {s.label}: later queries read it"


def test_canary_is_invisible_without_packing():
    case = Case("unpacked/pad-tail", 4, 256, 4, 2, 64, "bfloat16", 0)
    assert not any(r["verdict"] == "fail" for r in _run(CANARY, case))


def _off_by_one(query, key, value, segment_ids, *, causal, scale):
    """A subtle bug: each segment's first token also reads the previous segment's last token."""
    prev = jnp.pad(segment_ids[:, :-1], ((0, 0), (1, 0)))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    t = segment_ids.shape[1]
    pos = jnp.arange(t)
    leak = (pos[None, :, None] - 1 == pos[None, None, :]) & (prev[:, :, None] != segment_ids[:, :, None]) \
        & (prev[:, :, None] > 0)
    mask = (same | leak) & (pos[:, None] >= pos[None, :])[None]
    h = query.shape[2]
    k = jnp.repeat(key, h // key.shape[2], axis=2)
    v = jnp.repeat(value, h // value.shape[2], axis=2)
    s = jnp.einsum("bqhd,bkhd->bhqk", query, k, preferred_element_type=jnp.float32) * scale
    p = jax.nn.softmax(jnp.where(mask[:, None], s, -1e30), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(value.dtype), v)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_one_token_leak_is_caught_at_that_token(dtype):
    case = Case("unaligned/block-edges", 4, 256, 4, 2, 32, dtype, 0)
    records = _run(Kernel("off_by_one", _off_by_one), case)
    failing_out = [r for r in records if r["check"] == "out" and r["verdict"] == "fail"]
    assert {(r["row"], r["segment"]) for r in failing_out} == \
        {(s.row, s.number) for s in case.segments if s.number > 1}
    assert all(r["worst_token"] == r["start"] for r in failing_out), "worst token is the first"


def test_a_correct_kernel_passes_everywhere():
    case = Case("packed/many", 4, 256, 4, 2, 32, "bfloat16", 0)
    assert not any(r["verdict"] == "fail" for r in _run(Kernel("dp", dot_product), case))


# ----- the leak probe: bitwise, no tolerance ----------------------------------------------------

def _leaks(records):
    return {(r["row"], r["segment"]) for r in records if r["check"] == "leak" and r["verdict"] == "fail"}


@pytest.mark.parametrize("case", [Case("extremes/long", 3, 2048, 2, 1, 16, "bfloat16", 0),
                                  Case("extremes/single-tokens", 4, 1024, 2, 2, 16, "bfloat16", 0)],
                         ids=lambda c: c.id)
def test_leak_probe_catches_what_rounding_hides(case):
    """Long rows where the canary's dq of a trailing single token, or dk/dv of a long first
    segment, hide inside bf16 noise: the probe still flags every segment of a packed row."""
    records = _run(CANARY, case)
    hidden = {(r["row"], r["segment"]) for r in records
              if r["check"] != "leak" and r["expected"] == "either" and r["verdict"] == "pass"}
    assert hidden, "some wrong gradients pass their tolerance here"
    packed_rows = {s.row for s in case.segments if s.number > 1}
    assert _leaks(records) == {(s.row, s.number) for s in case.segments if s.row in packed_rows}
    assert hidden <= _leaks(records)


def test_leak_probe_flags_a_one_token_leak_and_passes_correct_kernels():
    case = Case("unaligned/block-edges", 4, 256, 4, 2, 32, "bfloat16", 0)
    leaky = _run(Kernel("off_by_one", _off_by_one), case)
    assert {(s.row, s.number) for s in case.segments if s.number > 1} <= _leaks(leaky)
    assert not _leaks(_run(Kernel("dp", dot_product), case))


def test_leak_probe_leaves_out_what_is_not_deterministic():
    import numpy as np

    def noisy(q, k, v, seg, *, causal, scale):
        out = dot_product(q, k, v, seg, causal=causal, scale=scale)
        noise = jax.pure_callback(lambda: np.random.default_rng().standard_normal(out.shape)
                                  .astype(np.float32) * 1e-3, jax.ShapeDtypeStruct(out.shape, jnp.float32))
        return out + jax.lax.stop_gradient(noise).astype(out.dtype)

    case = Case("packed/random", 2, 128, 2, 2, 16, "float32", 0)
    leak = [r for r in _run(Kernel("noisy", noisy), case) if r["check"] == "leak"]
    assert leak and all(r["verdict"] == "pass" for r in leak)
    assert all("not probed (differ run to run): out" in r["message"] for r in leak)
