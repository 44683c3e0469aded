"""The system under test: config rules, the packed lowering, bad segment ids in and out of jit,
the GQA offsets workaround, and the emulator's API contract."""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness.model.case import Case, make_inputs
from harness.model.layouts import LAYOUTS, check_segment_ids
from harness.model.layouts import SegmentIdError as LayoutError
from harness.sut import SegmentIdError
from harness.sut import AttentionConfig, AttentionOp, ConfigError
from harness.sut import cudnn_emulator as emu
from harness.sut import lowering


def cfg(**kw):
    base = dict(attention="cudnn_flash_jax", packing=True, hardware="gpu", max_segments_per_seq=8,
                compute_capability=9.0)
    return AttentionConfig(**{**base, **kw})


# ----- config rules: each one refuses a setting that would corrupt training or crash later ----

@pytest.mark.parametrize("overrides, message", [
    ({"attention": "flash"}, "is not one of"),
    ({"hardware": "cpu"}, "runs on NVIDIA GPUs only"),
    ({"max_segments_per_seq": None}, "needs max_segments_per_seq"),
    ({"attention": "cudnn_flash_te", "max_segments_per_seq": None}, "needs max_segments_per_seq"),
    ({"max_segments_per_seq": 0}, "must be a whole number >= 1"),
    ({"attention": "cudnn_flash_te", "compute_capability": 8.0}, "needs compute capability >= 9.0"),
    ({"attention": "cudnn_flash_te", "cudnn_backend": "emulator"}, "has no emulator"),
    ({"model_mode": "decode"}, "packed rows are a training layout"),
    ({"dropout_rate": 0.1, "compute_capability": 7.5}, "XLA fallback has no attention dropout"),
    ({"dropout_rate": 0.1, "attention": "dot_product"}, "dot_product has no attention dropout"),
    ({"dropout_rate": 0.1, "cudnn_backend": "emulator"}, "emulator has no dropout"),
    ({"dropout_rate": 1.0}, "not a number in [0, 1)"),
    ({"segment_check": "ignore"}, "segment_check"),
    # From an adversarial review of the op: each was taken as it came (a window of 2.5 keys
    # ran as 2 on one path and 3 on another; an infinite cap made every output NaN) or
    # raised a TypeError that named no field.
    ({"window": (2.5, 0)}, "window=(2.5, 0) must be (left, right), two whole numbers"),
    ({"window": 4}, "window=4 must be (left, right)"),
    ({"window": ("2", 0)}, "window=('2', 0) must be"),
    ({"logits_soft_cap": float("inf")}, "logits_soft_cap=inf must be a finite number above 0"),
    ({"logits_soft_cap": "1"}, "logits_soft_cap='1' must be"),
    ({"chunk_size": 2.5}, "chunk_size=2.5 must be a whole number"),
    ({"max_segments_per_seq": 3.5}, "max_segments_per_seq=3.5 must be a whole number"),
    ({"max_segments_per_seq": "4"}, "max_segments_per_seq='4' must be"),
    ({"dropout_rate": None}, "dropout_rate=None is not a number"),
    ({"packing": "no"}, "packing='no' must be True or False"),
    ({"force_fallback": 1}, "force_fallback=1 must be True or False"),
    ({"window": (2, 3)}, "window=(2, 3), which reads 3 keys ahead"),
    ({"attention": "cudnn_flash_auto", "window": (2, 3), "compute_capability": 8.0},
     "cudnn_flash_auto with window=(2, 3) (reads ahead) needs"),
])
def test_config_rules(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        cfg(**overrides).validate()


@pytest.mark.parametrize("overrides, path", [
    ({}, "cudnn_packed"),
    ({"compute_capability": 8.0}, "cudnn_mask"),
    ({"force_fallback": True}, "cudnn_mask"),
    ({"compute_capability": 7.5}, "xla_fallback"),
    ({"attention": "dot_product"}, "dot_product"),
    ({"attention": "cudnn_flash_te"}, "te_thd"),
])
def test_path_selection(overrides, path):
    config = cfg(**overrides).validate()
    assert config.path() == path


def test_valid_configs_pass():
    cfg().validate()
    cfg(dropout_rate=0.1).validate()              # cuDNN packed path does dropout
    cfg(dropout_rate=0.1, compute_capability=8.0).validate()  # so does the mask fallback
    AttentionConfig(attention="dot_product", hardware="cpu").validate()


# ----- the lowering -------------------------------------------------------------------------

@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_lengths_offsets_and_positions_match_the_segments(layout):
    if LAYOUTS[layout].padding != "tail":
        pytest.skip("padding before a segment: the MaxText-convention lowering refuses it "
                    "(test_the_op_refuses_padding_before_a_segment)")
    seg = LAYOUTS[layout].segment_ids(6, max(256, LAYOUTS[layout].min_seq_len), 0)
    segments = check_segment_ids(seg)
    m = max(s.number for s in segments) + 1
    seqlen, offsets = map(np.asarray, lowering.lengths_and_offsets(jnp.asarray(seg), m))
    pos = np.asarray(lowering.positions(jnp.asarray(seg)))
    assert seqlen.shape == (6, m) and offsets.shape == (6, m + 1)
    for r in range(6):
        mine = [s for s in segments if s.row == r]
        assert seqlen[r].tolist() == [s.length for s in mine] + [-1] * (m - len(mine))
        assert offsets[r].tolist() == [s.start for s in mine] + [-1] * (m + 1 - len(mine))
        for s in mine:
            assert pos[r, s.start:s.stop].tolist() == list(range(s.length))


@settings(max_examples=80, deadline=None)
@given(st.lists(st.lists(st.integers(0, 5), min_size=12, max_size=12), min_size=1, max_size=3),
       st.integers(1, 4))
def test_traced_representability_agrees_with_the_concrete_check(rows, max_segments):
    seg = np.array(rows, np.int32)
    traced = np.asarray(lowering.representable_rows(jnp.asarray(seg), max_segments))
    for r in range(seg.shape[0]):
        try:
            check_segment_ids(seg[r:r + 1], max_segments=max_segments)
            ok = True
        except LayoutError:
            ok = False
        assert traced[r] == ok, seg[r]
        # The op's own concrete check (it stands alone, without the harness's) agrees too.
        assert (lowering.row_problem(seg[r], max_segments) is None) == ok, seg[r]


def _packed_reference(lengths, t, m, padding):
    """cuDNN's packed form of a row of segments `lengths` then padding, from the definition."""
    pad, n = t - sum(lengths), len(lengths)
    seqlen, offsets = list(lengths), [sum(lengths[:i]) for i in range(n)]
    if pad and padding == "merged":
        if n:
            seqlen[-1] += pad
        else:
            seqlen, offsets = [pad], [0]
    elif pad and padding == "segment":
        seqlen, offsets = seqlen + [pad], offsets + [t - pad]
    slots = m + (padding == "segment")
    return seqlen + [-1] * (slots - len(seqlen)), offsets + [-1] * (slots + 1 - len(offsets))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(1, 4), max_size=4), min_size=1, max_size=3),
       st.sampled_from([None, "merged", "segment"]))
def test_the_packed_lowering_matches_its_definition(rows, padding):
    t, m = 16, 4
    seg = np.zeros((len(rows), t), np.int32)
    for r, lengths in enumerate(rows):
        seg[r, :sum(lengths)] = np.repeat(np.arange(1, len(lengths) + 1), lengths)
    seqlen, offsets, ok = map(np.asarray, jax.jit(lowering.packed, static_argnums=(1, 2))(
        jnp.asarray(seg), m, padding))
    assert ok.all()
    for r, lengths in enumerate(rows):
        assert (seqlen[r].tolist(), offsets[r].tolist()) == _packed_reference(
            lengths, t, m, padding), (lengths, padding)


@settings(max_examples=50, deadline=None)
@given(st.lists(st.integers(-1, 6), min_size=10, max_size=10),
       st.sampled_from([None, "merged", "segment"]))
def test_rows_the_lowering_cannot_represent_get_one_segment_over_the_row(row, padding):
    """Whatever the ids, the lowering stays in bounds; a row it cannot represent is one
    segment (the op poisons or refuses it anyway)."""
    seqlen, offsets, ok = map(np.asarray, lowering.packed(jnp.array([row], jnp.int32), 3,
                                                          padding))
    try:
        check_segment_ids(np.array([row]), max_segments=3)
        expect_ok = True
    except LayoutError:
        expect_ok = False
    assert ok[0] == expect_ok, row
    used, starts = seqlen[0] > 0, offsets[0][:-1]
    assert (starts[used] >= 0).all() and (starts[used] + seqlen[0][used] <= 10).all()
    if not expect_ok:
        slots = seqlen.shape[1]
        assert seqlen[0].tolist() == [10] + [-1] * (slots - 1)
        assert offsets[0].tolist() == [0] + [-1] * slots


# ----- bad segment ids through the op: concrete raises, jitted is loud ------------------------

def _op(**kw):
    return AttentionOp(cfg(**{"cudnn_backend": "emulator", "max_segments_per_seq": 2, **kw}))


def _qkv(b=2, t=8, h=2, kv=1, d=8, dtype=jnp.bfloat16):
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    return (jax.random.normal(k[0], (b, t, h, d), dtype), jax.random.normal(k[1], (b, t, kv, d), dtype),
            jax.random.normal(k[2], (b, t, kv, d), dtype))


GOOD = [1, 1, 1, 2, 2, 2, 0, 0]
TOO_MANY = [1, 1, 2, 2, 3, 3, 0, 0]        # id 3 > max_segments_per_seq=2
SPLIT = [1, 1, 2, 2, 1, 1, 0, 0]            # id 1 in two runs


@pytest.mark.parametrize("bad, message", [(TOO_MANY, "more than max_segments=2"),
                                          (SPLIT, "not contiguous")])
def test_concrete_bad_segment_ids_raise(bad, message):
    q, k, v = _qkv()
    with pytest.raises(SegmentIdError, match=message):
        _op()(q, k, v, jnp.array([GOOD, bad], jnp.int32), scale=0.35)


LEFT_PADDED = [0, 0, 1, 1, 1, 2, 2, 2]       # padding before a segment


ONE_SEQUENCE = [1, 1, 1, 1, 1, 0, 0, 0]
ROWS_LEFT_PADDED = [0, 0, 0, 0, 0, 0, 1, 1]  # its valid tokens lie past its length (2)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("packing, good, bad", [
    (True, GOOD, TOO_MANY), (True, GOOD, SPLIT), (True, GOOD, LEFT_PADDED),
    (False, ONE_SEQUENCE, GOOD), (False, ONE_SEQUENCE, ROWS_LEFT_PADDED)])
def test_jitted_bad_rows_make_the_loss_nan(packing, good, bad, causal):
    q, k, v = _qkv()
    op = _op(packing=packing, max_segments_per_seq=2 if packing else None)
    step = jax.jit(lambda q, k, v, s: op(q, k, v, s, scale=0.35, causal=causal))
    seg = jnp.array([good, bad], jnp.int32)
    out = np.asarray(step(q, k, v, seg), np.float32)
    assert np.isfinite(out[0]).all() and np.isnan(out[1]).any(), "the bad row carries a NaN"
    # A loss masked at padding (jnp.where, as training code does) keeps it.
    masked = np.where(np.asarray(seg > 0)[:, :, None, None], out, 0.0)
    assert np.isnan(masked[1].sum()), "so the loss is NaN"
    # Good rows: finite, and exactly what the op computes outside jit (where no guard runs).
    both_good = jnp.array([good, good], jnp.int32)
    jitted = np.asarray(step(q, k, v, both_good))
    assert np.isfinite(jitted.astype(np.float32)).all()
    eager = np.asarray(op(q, k, v, both_good, scale=0.35, causal=causal))
    assert np.array_equal(jitted.view(np.uint16), eager.view(np.uint16))
    # The guard's gradient is the identity: a good row's dv is what it is without the guard.
    loss = lambda v, s: (op(q, k, v, s, scale=0.35, causal=causal).astype(jnp.float32) ** 2).sum()
    dv = np.asarray(jax.jit(jax.grad(loss))(v, seg), np.float32)
    assert np.isfinite(dv[0]).all()
    assert np.array_equal(dv[0], np.asarray(jax.grad(loss)(v, both_good), np.float32)[0])


def test_the_guard_changes_no_value_but_the_poisoned_tokens():
    """Good tokens keep their values (an added +0 may only turn -0 into +0), poisoned ones are
    NaN, and the gradient is the identity."""
    from harness.sut.attention_op import poisoned
    v = jnp.array([-0.0, 3e-38, -1.5, 1.5], jnp.bfloat16).reshape(1, 4, 1, 1)
    poison = jnp.array([[False, False, False, True]])
    out = np.asarray(jax.jit(poisoned)(v, poison), np.float32).reshape(-1)
    assert out[:3].tolist() == np.asarray(v, np.float32).reshape(-1)[:3].tolist()
    assert np.isnan(out[3])
    g = jax.grad(lambda v: (poisoned(v, poison) * 2.0).astype(jnp.float32).sum())(v)
    assert np.asarray(g, np.float32).reshape(-1).tolist() == [2.0] * 4, "identity gradient"


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.uint8, jnp.int16])
def test_the_packed_lowering_takes_narrow_integer_ids(dtype):
    seg = np.array([GOOD, [1, 1, 1, 1, 1, 1, 1, 1]])
    for m in (3, 200, 40000):
        want = [np.asarray(a) for a in lowering.packed(jnp.asarray(seg, jnp.int32), m, "merged")]
        got = [np.asarray(a) for a in lowering.packed(jnp.asarray(seg, dtype), m, "merged")]
        for w, g in zip(want, got):
            assert np.array_equal(w, g), (dtype, m)


@pytest.mark.parametrize("causal", [True, False])
def test_the_packed_lowering_computes_padding(causal):
    """Padding gets finite outputs and exactly zero gradients where its cotangent is zero, with
    no pass over the output: the lowering merges it into the last segment (causal: no extra
    slot) or gives it a segment slot of its own (bidirectional)."""
    seg = jnp.array([[1, 1, 2, 2, 2, 0, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]], jnp.int32)
    seqlen, offsets = map(np.asarray, lowering.lengths_and_offsets(seg, 3, padding="segment"))
    assert seqlen.tolist() == [[2, 3, 3, -1], [8, -1, -1, -1]]
    assert offsets.tolist() == [[0, 2, 5, -1, -1], [0, -1, -1, -1, -1]]
    seqlen, offsets = map(np.asarray, lowering.lengths_and_offsets(seg, 3, padding="merged"))
    assert seqlen.tolist() == [[2, 6, -1], [8, -1, -1]]
    assert offsets.tolist() == [[0, 2, -1, -1], [0, -1, -1, -1]]
    only_padding = jnp.zeros((1, 8), jnp.int32)
    assert [np.asarray(a).tolist() for a in lowering.lengths_and_offsets(
        only_padding, 3, padding="merged")] == [[[8, -1, -1]], [[0, -1, -1, -1]]]
    q, k, v = _qkv()
    ct = jnp.broadcast_to(jnp.where((seg > 0)[:, :, None, None], 1.0, 0.0), q.shape).astype(q.dtype)
    fn = lambda q, k, v: _op()(q, k, v, seg, scale=0.35, causal=causal)
    out, vjp = jax.vjp(fn, q, k, v)
    grads = vjp(ct)
    assert np.isfinite(np.asarray(out, np.float32)).all()
    pad = ~np.asarray(seg > 0)
    for g in grads:
        assert (np.asarray(g, np.float32)[pad] == 0).all()


@pytest.mark.parametrize("bad", [TOO_MANY, SPLIT])
def test_jitted_bad_rows_raise_through_checkify(bad):
    from jax.experimental import checkify
    q, k, v = _qkv()
    step = checkify.checkify(jax.jit(lambda q, k, v, s: _op(segment_check="checkify")(
        q, k, v, s, scale=0.35)))
    err, _ = step(q, k, v, jnp.array([GOOD, bad], jnp.int32))
    with pytest.raises(Exception, match="cannot be lowered to the packed layout"):
        err.throw()
    err, _ = step(q, k, v, jnp.array([GOOD, GOOD], jnp.int32))
    err.throw()  # good rows: no error


@pytest.mark.parametrize("make, message", [
    (lambda: _qkv(dtype=jnp.float32), "takes bfloat16/float16, not float32"),
    (lambda: _qkv(d=12), "head_dim 12 unsupported"),
    (lambda: (_qkv()[0], _qkv(t=6)[1], _qkv(t=6)[2]), "does not match query"),
    (lambda: _qkv(h=3, kv=2), "not a multiple of 2 kv heads"),
])
def test_bad_inputs_get_a_clear_error(make, message):
    q, k, v = make()
    with pytest.raises(ValueError, match=message):
        _op()(q, k, v, jnp.ones(q.shape[:2], jnp.int32), scale=0.35)


def test_segment_ids_shape_is_checked():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="segment_ids"):
        _op()(q, k, v, jnp.ones((2, 7), jnp.int32), scale=0.35)


def test_unpacked_config_takes_per_row_lengths_and_refuses_packed_rows():
    case = Case("unpacked/pad-tail", 3, 128, 4, 2, 32, "bfloat16", 0)
    x = make_inputs(case)
    op = AttentionOp(cfg(cudnn_backend="emulator", packing=False))
    out = np.asarray(op(x.query, x.key, x.value, x.segment_ids, scale=case.scale), np.float32)
    ref = np.asarray(AttentionOp(cfg(attention="dot_product", packing=False))(
        x.query, x.key, x.value, x.segment_ids, scale=case.scale), np.float32)
    valid = case.segment_ids > 0
    assert np.abs(out[valid] - ref[valid]).max() < 0.05
    q, k, v = _qkv()
    with pytest.raises(SegmentIdError, match="more than max_segments=1"):
        op(q, k, v, jnp.array([GOOD, GOOD], jnp.int32), scale=0.35)


# ----- GQA: jax's own packed offset arithmetic, and the workaround --------------------------------

def _jax_version_at_most(v):
    return tuple(int(x) for x in jax.__version__.split(".")[:3]) <= v


def test_upstream_gqa_kv_offsets_and_the_workaround():
    """jax <= 0.11.0 multiplies packed kv offsets by the query head count. With 4 query heads
    over 1 kv head, the second kv segment's element offset comes out 4x too far; giving cuDNN
    as many kv heads as query heads (what the op does there) makes the same arithmetic right."""
    from jax._src.cudnn import fused_attention_stablehlo as sdpa

    heads, kv_heads, d, t = 4, 1, 8, 8
    seqlen = jnp.array([[3, 5]], jnp.int32)
    offsets = jnp.array([[0, 3, -1]], jnp.int32)
    q = jnp.zeros((1, t, heads, d), jnp.bfloat16)
    k_gqa = jnp.zeros((1, t, kv_heads, d), jnp.bfloat16)
    _, _, _, kv_off = sdpa._fix_seqlen_offsets(seqlen, seqlen, offsets, offsets, q, k_gqa)
    right_for_gqa = 3 * kv_heads * d          # token 3 of a [T, kv_heads, d] tensor
    wrong = int(kv_off[0, 1]) != right_for_gqa
    assert wrong == lowering.upstream_gqa_offsets_wrong()
    assert wrong == _jax_version_at_most((0, 11, 0)), jax.__version__
    # Asked while a program is traced (the op's own question), the same answer as outside.
    lowering.upstream_gqa_offsets_wrong.cache_clear()
    asked = []
    jax.jit(lambda x: asked.append(lowering.upstream_gqa_offsets_wrong()) or x).lower(1.0)
    lowering.upstream_gqa_offsets_wrong.cache_clear()
    assert asked == [wrong] == [lowering.upstream_gqa_offsets_wrong()]
    # The workaround: kv repeated to the query head count.
    k_rep = jnp.zeros((1, t, heads, d), jnp.bfloat16)
    _, _, _, kv_off = sdpa._fix_seqlen_offsets(seqlen, seqlen, offsets, offsets, q, k_rep)
    assert int(kv_off[0, 1]) == 3 * heads * d


# ----- the emulator's contract --------------------------------------------------------------

def test_emulator_refuses_packed_layout_below_hopper():
    q, k, v = _qkv()
    seqlen = jnp.array([[3, 3], [3, 3]], jnp.int32)
    offsets = jnp.array([[0, 3, -1], [0, 3, -1]], jnp.int32)
    with pytest.raises(NotImplementedError, match="at least Hopper"):
        emu.dot_product_attention(q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets,
                                  kv_offsets=offsets, mask_type=emu.MaskType.PADDING_CAUSAL,
                                  compute_capability=8.0)


def test_emulator_padding_mask_uses_seqlens():
    q, k, v = _qkv(b=1)
    full = emu.dot_product_attention(q, k, v, mask_type=emu.MaskType.CAUSAL)
    padded = emu.dot_product_attention(q, k, v, q_seqlen=jnp.array([5]), kv_seqlen=jnp.array([5]),
                                       mask_type=emu.MaskType.PADDING_CAUSAL)
    np.testing.assert_array_equal(np.asarray(full[:, :5], np.float32), np.asarray(padded[:, :5], np.float32))
    assert (np.asarray(padded[:, 5:], np.float32) == 0).all()


def test_original_call_through_the_emulator_leaks_and_the_fix_does_not():
    case = Case("packed/random", 2, 128, 4, 2, 32, "bfloat16", 0)
    x = make_inputs(case)
    from harness.kernels.op import original_cudnn_flash_jax
    fixed = AttentionOp(cfg(cudnn_backend="emulator", max_segments_per_seq=case.max_segments))
    a = np.asarray(fixed(x.query, x.key, x.value, x.segment_ids, scale=case.scale), np.float32)
    b = np.asarray(original_cudnn_flash_jax(x.query, x.key, x.value, x.segment_ids, causal=True,
                                            scale=case.scale, backend="emulator"), np.float32)
    for s in case.segments:
        rows = (s.row, slice(s.start, s.stop))
        assert np.array_equal(a[rows], b[rows]) == (s.number == 1), s.label


@pytest.mark.parametrize("layout", ["padded/left", "padded/between"])
@pytest.mark.parametrize("attention", ["dot_product", "cudnn_flash_jax"])
def test_the_op_refuses_padding_before_a_segment(layout, attention):
    """MaxText's convention (padding only after the last segment) is what the packed lowering
    can represent: left padding or padding between segments is refused by name, not lowered."""
    case = Case(layout, 4, 256, 4, 2, 32, "bfloat16", 0)
    x = make_inputs(case)
    op = AttentionOp(cfg(attention=attention, cudnn_backend="emulator", hardware="cpu"))
    with pytest.raises(SegmentIdError, match=r"padding \(0\) at position \d+ comes before segment"):
        op(x.query, x.key, x.value, x.segment_ids, scale=case.scale)


def test_the_op_refuses_mixed_dtypes():
    case = Case("packed/random", 2, 64, 2, 2, 16, "bfloat16", 0)
    x = make_inputs(case)
    op = AttentionOp(cfg(cudnn_backend="emulator", hardware="cpu"))
    with pytest.raises(ValueError, match="must share a dtype; got bfloat16, float32, float32"):
        op(x.query, x.key.astype(np.float32), x.value.astype(np.float32), x.segment_ids,
           scale=case.scale)


@pytest.mark.parametrize("window", [(1, 0), (3, 0)])
def test_one_sequence_per_row_honours_the_window(window):
    """From an adversarial review of the op: with packing=False the cuDNN path took the
    window and dropped it (per-row lengths, no sliding_window_length): off by 3.2 on valid
    tokens, no error. The harness's matrix catches it too (sut:cudnn_flash_jax:rows:emulated on
    the smoke suite's unpacked window case)."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 8, 2, 8)), jnp.bfloat16) for _ in range(3))
    seg = jnp.asarray([[1] * 6 + [0] * 2])
    rows = AttentionOp(AttentionConfig(attention="cudnn_flash_jax", cudnn_backend="emulator",
                                       hardware="cpu", packing=False, window=window))
    ref = AttentionOp(AttentionConfig(attention="dot_product", hardware="cpu", window=window))
    got, want = rows(q, k, v, seg, scale=0.35), ref(q, k, v, seg, scale=0.35)
    assert float(jnp.abs(got - want)[:, :6].max()) < 0.05


def test_a_refusal_with_packing_off_names_that_path():
    """The op with packing=False refusing a soft cap named "cuDNN's packed layout", the path
    it was not on."""
    with pytest.raises(ConfigError, match=r"\(cuDNN with packing=False, one sequence per row\) "
                                          r"cannot honour logits_soft_cap=2.0"):
        AttentionConfig(attention="cudnn_flash_jax", hardware="cpu", packing=False,
                        logits_soft_cap=2.0).validate()


def test_sinks_that_are_not_an_array_are_named():
    op = AttentionOp(AttentionConfig(attention="dot_product", hardware="cpu", sinks=True))
    q = jnp.zeros((1, 8, 2, 8), jnp.float32)
    with pytest.raises(ValueError, match="sinks list: an array of shape"):
        op(q, q, q, jnp.ones((1, 8), jnp.int32), scale=1.0, sinks=[0.0, 0.0])
