"""MaxText's own AttentionOp as kernels. Without maxtext (or on Python 3.11, where it does not
install) they are skipped with that reason; with it, maxtext:dot_product must pass on CPU, its
attention features included (handed over as a model configures them)."""
import dataclasses
import importlib.util
import sys
import types

import numpy as np
import pytest

from harness.model.case import Case
from harness.model.features import Features
from harness.kernels.kernel import Platform
from harness.engine.registry import select_kernels
from harness.engine.runner import run_kernel_case

HAVE_MAXTEXT = importlib.util.find_spec("maxtext") is not None and sys.version_info >= (3, 12)
needs_maxtext = pytest.mark.skipif(not HAVE_MAXTEXT,
                                   reason="maxtext is not installed (Python >= 3.12 only)")
CPU = Platform("cpu")
MAXTEXT_KERNELS = "maxtext:dot_product,maxtext:cudnn_flash_jax,maxtext:cudnn_flash_te,maxtext:flash"
CASES = [Case("packed/random", 2, 256, 4, 2, 32, "bfloat16", 0),
         Case("unaligned/block-edges", 4, 256, 4, 4, 32, "float32", 0),
         Case("extremes/single-tokens", 4, 64, 4, 1, 16, "bfloat16", 1)]


def feature_case(features, layout="packed/random", dtype="bfloat16", **kwargs):
    return Case(layout, 2, 256, 4, 2, 32, dtype, 0, features=features, **kwargs)


# Small feature cases: a window of 16 keys, a soft cap, chunks of 32 (segments of these rows
# start off multiples of 32, so row-start and segment-start chunks differ), sinks, a value head
# dim of its own, and the combinations models use, on packed rows and padding between segments.
FEATURE_CASES = [feature_case(Features(window=(15, 0))),
                 feature_case(Features(softcap=2.0)),
                 feature_case(Features(chunk=32), dtype="float32"),
                 feature_case(Features(sinks=True)),
                 feature_case(Features(head_dim_v=16)),
                 feature_case(Features(window=(15, 0), sinks=True), layout="padded/between"),
                 feature_case(Features(window=(15, 0), softcap=2.0), layout="unaligned/odd")]


@pytest.mark.skipif(HAVE_MAXTEXT, reason="maxtext is installed here")
def test_maxtext_kernels_are_skipped_with_the_reason():
    for kernel in select_kernels(MAXTEXT_KERNELS):
        records = run_kernel_case(kernel, CASES[0], Platform("cpu")).records
        assert [r.verdict for r in records] == ["skip"]
        message = records[0].message
        assert "'maxtext' is not installed" in message or "Python >= 3.12" in message


@pytest.mark.skipif(not HAVE_MAXTEXT, reason="maxtext is not installed (Python >= 3.12 only)")
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_maxtext_dot_product_honours_segments(case):
    kernel = select_kernels("maxtext:dot_product")[0]
    records = run_kernel_case(kernel, case, Platform("cpu")).records
    assert records and all(r.verdict == "pass" for r in records), records[0].message


@pytest.mark.skipif(not HAVE_MAXTEXT, reason="maxtext is not installed (Python >= 3.12 only)")
def test_adapter_config_refuses_attributes_base_yml_lacks():
    from harness.kernels.maxtext_adapter import MaxTextConfig
    config = MaxTextConfig(attention="dot_product")
    assert config.attention == "dot_product" and config.ici_context_autoregressive_parallelism == 1
    with pytest.raises(AttributeError, match="does not define"):
        config.not_a_maxtext_setting


def test_maxtext_releases_with_the_bug_are_expected_to_be_caught(monkeypatch):
    from harness.kernels import maxtext_known
    case = Case("packed/random", 2, 256, 4, 2, 32, "bfloat16", 0)
    second = next(s for s in case.segments if s.number == 2)
    kernel = select_kernels("maxtext:cudnn_flash_jax")[0]
    monkeypatch.setattr(maxtext_known, "installed_version", lambda: (0, 2, 5))
    assert kernel.expected(case, "out", second)[0] == "fail"
    assert kernel.expected(case, "leak", second)[0] == "fail"
    monkeypatch.setattr(maxtext_known, "installed_version", lambda: (0, 3, 0))
    assert kernel.expected(case, "out", second)[0] == "pass", "a fixed release must pass"


def test_float16_softmax_sum_bug_is_known_only_where_it_can_show(monkeypatch):
    from harness.kernels import maxtext_known
    from harness.model.layouts import Segment
    kernel = select_kernels("maxtext:dot_product")[0]
    monkeypatch.setattr(maxtext_known, "installed_version", lambda: (0, 2, 5))
    f16 = Case("unaligned/block-edges", 4, 2048, 8, 8, 128, "float16", 2)
    long, short = Segment(3, 4, 129, 1919), Segment(0, 1, 0, 256)
    assert kernel.expected(f16, "dq", long) == ("known", maxtext_known.FLOAT16_SUM_REASON)
    assert kernel.expected(f16, "dk", long)[0] == "known"
    assert kernel.expected(f16, "jvp", long)[0] == "known"    # forward mode: the same sum**-2
    assert kernel.expected(f16, "dv", long)[0] == "pass"      # dv never differentiates the sum
    assert kernel.expected(f16, "out", long)[0] == "pass"     # the forward pass is right
    # The H200 nightly's other long float16 segments (sums 238.3 and 253.0) passed: not known.
    assert kernel.expected(f16, "dq", Segment(0, 4, 129, 1919))[0] == "pass"
    single = Case("extremes/single-tokens", 4, 2048, 8, 8, 128, "float16", 2)
    assert all(kernel.expected(single, "dq", s)[0] == "pass" for s in single.segments)
    assert kernel.expected(f16, "dq", short)[0] == "pass"     # 256 keys cannot sum above 256
    bf16 = Case("unaligned/block-edges", 4, 2048, 8, 8, 128, "bfloat16", 2)
    assert kernel.expected(bf16, "dq", long)[0] == "pass"
    monkeypatch.setattr(maxtext_known, "installed_version", lambda: (0, 3, 0))
    assert kernel.expected(f16, "dq", long)[0] == "pass"


@pytest.mark.skipif(not HAVE_MAXTEXT, reason="maxtext is not installed (Python >= 3.12 only)")
def test_float16_softmax_sum_bug_shows_and_is_reported_as_known():
    """The bug itself, on CPU: jax's float16 gradient of 1/s vanishes above s = 256, and
    MaxText's dot_product fails dq on a long float16 segment, reported as known."""
    import jax
    import jax.numpy as jnp
    assert float(jax.grad(lambda s: 1 / s)(jnp.float16(300.0))) == 0.0
    kernel = select_kernels("maxtext:dot_product")[0]
    case = Case.from_id("unaligned/block-edges-b4-t2048-h8kv8-d128-f16-s2")
    records = run_kernel_case(kernel, case, Platform("cpu"), leak=False).records
    known = [r for r in records if r.outcome == "known"]
    # The forward mode's tangent meets the same sum**-2 (the jvp check, declared known on the
    # same segment); whether its error passes the tolerance depends on the tangent drawn (4.6x
    # with numpy's draws, within it with jax.random's): known or ok, never a failure.
    assert known and {"dq", "dk"} <= {r.check for r in known} <= {"dq", "dk", "jvp"}
    assert {r.expected for r in records if r.check == "jvp"
            and (r.row, r.segment) == (known[0].row, known[0].segment)} == {"known"}
    assert len({(r.row, r.segment) for r in known}) == 1
    assert all(r.length > 256 for r in known)
    assert not [r for r in records if r.outcome in ("fail", "missed", "error")]


# ----- features ---------------------------------------------------------------------------------

class _Recorder:
    """A stand-in AttentionOp: records its constructor's arguments and its call."""
    calls: list = []

    def __init__(self, **kwargs):
        _Recorder.calls.append({"init": kwargs})

    def __call__(self, *args, **kwargs):
        _Recorder.calls[-1]["call"] = (args, kwargs)
        return args[0], None


def _small_inputs(head_dim=16):
    import jax.numpy as jnp
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.standard_normal((1, 16, h, head_dim), dtype=np.float32))
               for h in (4, 2, 2))
    seg = jnp.asarray([[1] * 10 + [2] * 6], jnp.int32)
    return q, k, v, seg


@needs_maxtext
@pytest.mark.parametrize("features, op_args, config_args", [
    ({}, {}, {}),
    ({"window": (15, 0)}, {"attention_type": "local_sliding", "sliding_window_size": 16},
     {"sliding_window_size": 16}),
    ({"chunk": 32}, {"attention_type": "chunk", "chunk_attn_window_size": 32},
     {"chunk_attn_window_size": 32}),
    ({"softcap": 2.0}, {"attn_logits_soft_cap": 2.0}, {"attn_logits_soft_cap": 2.0}),
    ({"window": (3, 0), "softcap": 30.0},
     {"attention_type": "local_sliding", "sliding_window_size": 4, "attn_logits_soft_cap": 30.0},
     {"sliding_window_size": 4, "attn_logits_soft_cap": 30.0}),
], ids=["none", "window", "chunk", "softcap", "window+softcap"])
def test_adapter_hands_each_feature_to_the_ops_constructor(features, op_args, config_args):
    """As MaxText's model layers configure a layer: attention_type and sizes to AttentionOp's
    constructor (W = left + 1 keys, self included), the config carrying the same settings."""
    from harness.kernels.maxtext_adapter import maxtext_attention
    _Recorder.calls.clear()
    q, k, v, seg = _small_inputs()
    maxtext_attention(q, k, v, seg, causal=True, scale=0.25, max_segments=4,
                      attention="dot_product", **features,
                      attention_op_module=types.SimpleNamespace(AttentionOp=_Recorder))
    [call] = _Recorder.calls
    init = dict(call["init"])
    config = init.pop("config")
    base = {"mesh", "attention_kernel", "max_target_length", "num_query_heads", "num_kv_heads",
            "dtype"}
    assert set(init) == base | set(op_args)
    assert {n: init[n] for n in op_args} == op_args
    assert {n: getattr(config, n) for n in config_args} == config_args
    assert config.attention_type == "global"          # per layer, as the models set it
    assert config.head_dim == 16
    assert call["call"][1] == {}                       # no sinks: the call as before


@needs_maxtext
def test_adapter_hands_the_sinks_to_the_call():
    import jax.numpy as jnp
    from harness.kernels.maxtext_adapter import maxtext_attention
    _Recorder.calls.clear()
    q, k, v, seg = _small_inputs()
    sinks = jnp.arange(4, dtype=jnp.float32)
    maxtext_attention(q, k, v, seg, causal=True, scale=0.25, max_segments=4,
                      attention="cudnn_flash_te", sinks=sinks,
                      attention_op_module=types.SimpleNamespace(AttentionOp=_Recorder))
    [call] = _Recorder.calls
    args, kwargs = call["call"]
    assert args[5] == "train" and set(kwargs) == {"sinks"}
    np.testing.assert_array_equal(np.asarray(kwargs["sinks"]), np.arange(4))
    assert call["init"]["config"].attention_sink is True


@needs_maxtext
def test_the_real_op_resolves_what_the_adapter_hands_over():
    """MaxText's AttentionOp itself: the strings resolve to its AttentionType, the sizes land."""
    import maxtext.layers.attention_op as attention_op
    from maxtext.common.common_types import AttentionType

    from harness.kernels.maxtext_adapter import maxtext_attention
    seen = []

    class Op(attention_op.AttentionOp):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            seen.append((self.attention_type, self.sliding_window_size,
                         self.chunk_attn_window_size, self.attn_logits_soft_cap))

    q, k, v, seg = _small_inputs()
    module = types.SimpleNamespace(AttentionOp=Op)
    maxtext_attention(q, k, v, seg, causal=True, scale=0.25, max_segments=4,
                      attention="dot_product", window=(4, 0), softcap=5.0,
                      attention_op_module=module)
    maxtext_attention(q, k, v, seg, causal=True, scale=0.25, max_segments=4,
                      attention="dot_product", chunk=8, attention_op_module=module)
    assert seen == [(AttentionType.LOCAL_SLIDING, 5, None, 5.0),
                    (AttentionType.CHUNK, None, 8, None)]


def test_maxtext_kernels_declare_the_features_maxtexts_api_takes():
    for kernel in select_kernels(MAXTEXT_KERNELS):
        assert set(kernel.features) == {"window", "softcap", "chunk", "sinks", "head_dim_v"}
        assert kernel.chunk_convention == "row", kernel.name


def test_what_maxtexts_api_cannot_express_is_skipped_with_the_reason():
    kernel = select_kernels("maxtext:dot_product")[0]
    both = feature_case(Features(window=(15, 0), chunk=32))
    assert any("local_sliding or chunk, not both" in r
               for r in kernel.unsupported_reasons(both, CPU))
    ahead = feature_case(Features(window=(15, 8)), causal=False)
    reasons = kernel.unsupported_reasons(ahead, CPU)
    assert "causal only" in reasons
    assert any("MaxText's local_sliding window is causal" in r for r in reasons)
    # A causal window alone adds no reason to those of the same case without it (on Python 3.11
    # those are MaxText's absence, on 3.12 none).
    assert (kernel.unsupported_reasons(feature_case(Features(window=(15, 0))), CPU)
            == kernel.unsupported_reasons(feature_case(Features()), CPU))


@needs_maxtext
@pytest.mark.parametrize("case", FEATURE_CASES, ids=lambda c: c.id)
def test_maxtext_dot_product_honours_each_feature(case):
    kernel = select_kernels("maxtext:dot_product")[0]
    records = run_kernel_case(kernel, case, CPU).records
    assert records and all(r.verdict == "pass" and r.outcome == "ok" for r in records), \
        [(r.check, r.where, r.message) for r in records if r.verdict != "pass"][:3]
    checks = {r.check for r in records}
    assert {"out", "dq", "dk", "dv", "leak"} <= checks
    assert ("dsinks" in checks) == case.features.sinks
    if case.features.chunk is not None:
        assert all(r.convention == "chunks from the row's start" for r in records)


@needs_maxtext
def test_maxtexts_chunks_start_at_the_row_not_the_segment():
    """Judged by segment-start chunks, the same kernel fails: the row convention it declares is
    what MaxText computes (_generate_chunk_attention_mask on the row index)."""
    kernel = select_kernels("maxtext:dot_product")[0]
    by_segment = dataclasses.replace(kernel, name="maxtext:dot_product(segment chunks)",
                                     conventions={})
    case = feature_case(Features(chunk=32), dtype="float32")
    records = run_kernel_case(by_segment, case, CPU, leak=False).records
    assert any(r.verdict == "fail" and r.check == "out" for r in records)


@needs_maxtext
def test_dropped_features_are_known_where_they_show_and_only_in_0_2_5(monkeypatch):
    """The paths that drop a feature (maxtext <= 0.2.5) expect it exactly where the drop moves
    a segment past its tolerance (predicted from the inputs), and a leak where the probe's
    blocks see keys outside the window; a later release must pass."""
    from harness.kernels import maxtext_known
    monkeypatch.setattr(maxtext_known, "installed_version", lambda: (0, 2, 5))
    jax_k, te, flash = select_kernels("maxtext:cudnn_flash_jax,maxtext:cudnn_flash_te,"
                                      "maxtext:flash")
    window = feature_case(Features(window=(15, 0)), layout="unpacked/pad-tail")
    [first, *_] = window.segments
    assert jax_k.expected(window, "out", first)[0] == "known"
    assert "ignores the sliding window" in jax_k.expected(window, "out", first)[1]
    assert "2865-2874" in jax_k.expected(window, "dq", first)[1]
    assert jax_k.expected(window, "leak", first)[0] == "fail"
    assert flash.expected(window, "dv", first)[0] == "known"
    # TE honours the window: nothing known, on any check or segment.
    assert all(te.expected(window, c, s)[0] == "pass" for s in window.segments
               for c in ("out", "dq", "dk", "dv", "leak"))
    # A soft cap changes values, not what a token reads: known on the tolerance checks where
    # it shows, never on the leak probe.
    capped = feature_case(Features(softcap=2.0, sinks=True))
    assert {te.expected(capped, "out", s)[0] for s in capped.segments} == {"known"}
    assert {te.expected(capped, "leak", s)[0] for s in capped.segments} == {"pass"}
    assert te.expected(capped, "dsinks", None)[0] == "known"
    # A segment the window cannot cut (16 keys or fewer) is expected to pass.
    short = feature_case(Features(window=(15, 0)), layout="extremes/single-tokens")
    ones = [s for s in short.segments if s.length == 1]
    assert ones and all(flash.expected(short, c, s)[0] == "pass" for s in ones
                        for c in ("out", "dq", "dk", "dv", "leak"))
    monkeypatch.setattr(maxtext_known, "installed_version", lambda: (0, 3, 0))
    assert jax_k.expected(window, "out", first)[0] == "pass", "a fixed release must pass"
    assert te.expected(capped, "out", capped.segments[0])[0] == "pass"


def test_float16_softmax_sum_takes_the_window_into_account(monkeypatch):
    """A window of 16 keys keeps every softmax sum at or below 16: the float16 bug cannot show,
    where the same case without it is known."""
    from harness.kernels import maxtext_known
    from harness.model.layouts import Segment
    kernel = select_kernels("maxtext:dot_product")[0]
    monkeypatch.setattr(maxtext_known, "installed_version", lambda: (0, 2, 5))
    long = Segment(3, 4, 129, 1919)
    f16 = Case("unaligned/block-edges", 4, 2048, 8, 8, 128, "float16", 2)
    windowed = dataclasses.replace(f16, features=Features(window=(15, 0)))
    assert kernel.expected(f16, "dq", long)[0] == "known"
    assert kernel.expected(windowed, "dq", long)[0] == "pass"
    assert max(maxtext_known.softmax_sums(windowed).values()) <= 16.0
