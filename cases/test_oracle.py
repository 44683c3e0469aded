"""The references are trusted everywhere they are used: the dense float32 oracle (jax,
autodiff) and the float64 segment loop (NumPy, hand-written backward) share no code, so their
agreement over every layout, head grouping, input dtype and mask checks both. The blockwise
(memory-bounded) form of the dense oracle is the same math."""
import functools

import numpy as np
import pytest

from harness.model.case import Case, make_inputs
from harness.model.features import Features
from harness.model.layouts import LAYOUTS
from harness.judge.loop_oracle import segment_loop_attention
from harness.judge.oracle import dense_attention, reference_for


def _agree(case, rtol, convention="segment"):
    x = make_inputs(case)
    truth = reference_for(case, None, convention).truth
    loop = segment_loop_attention(x.query, x.key, x.value, x.segment_ids, x.cotangent,
                                  scale=case.scale, causal=case.causal,
                                  features=case.features, sinks=x.sinks,
                                  chunk_convention=convention)
    valid = (case.segment_ids > 0)[:, :, None, None]
    for name, dense, f64 in zip(("out", "dq", "dk", "dv"), truth, (loop[0], *loop[1])):
        dense = np.where(valid, np.asarray(dense), 0)
        f64 = np.where(valid, f64, 0)
        scale = np.abs(f64).max()
        assert np.abs(dense - f64).max() <= rtol * scale, (name, case.id)
    if case.features.sinks:
        dense, f64 = np.asarray(truth[4]), loop[1][3]
        assert np.abs(dense - f64).max() <= rtol * np.abs(f64).max(), ("dsinks", case.id)


@pytest.mark.parametrize("features", [
    Features(window=(7, 0)), Features(window=(0, 0)), Features(softcap=1.5),
    Features(chunk=16), Features(sinks=True), Features(head_dim_v=8),
    Features(window=(15, 0), sinks=True), Features(window=(9, 0), softcap=2.0, chunk=24)],
    ids=lambda f: f.suffix)
@pytest.mark.parametrize("layout", ["packed/random", "padded/between"])
def test_oracles_agree_on_every_feature(features, layout):
    """Windows, soft caps, chunks (from each segment's start), sinks (dsinks included) and a
    value head dim of its own: the dense oracle and the hand-written float64 loop agree."""
    _agree(Case(layout, 2, 256, 4, 2, 16, "float32", seed=4, features=features), 2e-5)


@pytest.mark.parametrize("features", [Features(window=(6, 5)), Features(chunk=20),
                                      Features(sinks=True, softcap=2.0)], ids=lambda f: f.suffix)
def test_oracles_agree_on_features_without_the_causal_mask(features):
    _agree(Case("packed/random", 2, 256, 4, 4, 16, "float32", seed=6, causal=False,
                features=features), 2e-5)


def test_chunks_from_the_rows_start_are_another_mask():
    """A kernel documenting chunks from the row's start is judged against that convention:
    the oracles agree on it too, and it differs from chunks from each segment's start."""
    case = Case("packed/random", 2, 256, 4, 2, 16, "float32", seed=4, features=Features(chunk=16))
    _agree(case, 2e-5, convention="row")
    by_row = np.asarray(reference_for(case, None, "row").truth[0])
    by_segment = np.asarray(reference_for(case, None, "segment").truth[0])
    assert np.abs(by_row - by_segment).max() > 0.1


def _seq_len(layout):
    return max(192, LAYOUTS[layout].min_seq_len)


@pytest.mark.parametrize("layout, heads, kv_heads", [
    *[(layout, 4, 2) for layout in LAYOUTS],
    *[(layout, 4, kv) for layout in ("packed/many", "padded/between", "extremes/single-tokens")
      for kv in (4, 1)]])
def test_oracles_agree_on_every_layout_and_head_grouping(layout, heads, kv_heads):
    _agree(Case(layout, 3, _seq_len(layout), heads, kv_heads, 16, "float32", seed=3), 2e-5)


@pytest.mark.parametrize("layout", ["packed/random", "padded/between", "unpacked/pad-tail",
                                    "extremes/single-tokens", "padded/left"])
@pytest.mark.parametrize("kv_heads", [4, 1])
def test_oracles_agree_without_the_causal_mask(layout, kv_heads):
    _agree(Case(layout, 3, _seq_len(layout), 4, kv_heads, 16, "float32", seed=5, causal=False),
           2e-5)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("layout", ["packed/many", "padded/between", "extremes/single-tokens"])
@pytest.mark.parametrize("causal", [True, False])
def test_oracles_agree_on_low_precision_inputs(dtype, layout, causal):
    # The truth computes in float32 from the rounded inputs; the loop in float64 from the same.
    _agree(Case(layout, 2, _seq_len(layout), 4, 2, 32, dtype, seed=1, causal=causal), 2e-5)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("truth", [True, False])
def test_blockwise_oracle_is_the_dense_one(causal, truth):
    import jax
    import jax.numpy as jnp
    from harness.judge.oracle import with_gradients

    # The truth in float32; the peer in bf16, where summing dk/dv over blocks rounds differently.
    case = Case("packed/many", 2, 200, 4, 2, 16, "float32" if truth else "bfloat16", seed=2,
                causal=causal)
    x = make_inputs(case)
    seg = jnp.asarray(x.segment_ids)
    outs = []
    for block in (None, 64, 48):  # whole; blocks dividing nothing evenly included
        fn = lambda q, k, v, s, block=block: dense_attention(
            q, k, v, s, scale=case.scale, causal=causal, truth=truth, block=block)
        outs.append(jax.jit(with_gradients(fn))(x.query, x.key, x.value, seg, x.cotangent))
    valid = (case.segment_ids > 0)[:, :, None, None]
    for whole, blocked in ((outs[0], outs[1]), (outs[0], outs[2])):
        for a, b in zip(whole, blocked):
            a = np.where(valid, np.asarray(a, np.float32), 0)
            b = np.where(valid, np.asarray(b, np.float32), 0)
            tol = 1e-5 if truth else 4 * float(jnp.finfo(case.dtype).eps)
            assert np.abs(a - b).max() <= tol * max(np.abs(a).max(), 1.0)


@pytest.mark.parametrize("layout,batch,causal,features,convention", [
    ("packed/dozens", 1, True, {}, "segment"),
    ("packed/dozens", 1, False, {"window": (15, 8), "sinks": True}, "segment"),
    ("packed/many", 1, True, {"chunk": 32}, "row"),
    ("padded/between", 2, False, {"softcap": 2.0}, "segment"),
    ("padded/between", 2, True, {"window": (15, 0), "chunk": 32}, "segment"),
])
def test_the_oracle_on_the_keys_its_blocks_read_is_the_oracle_on_the_whole_row(
        layout, batch, causal, features, convention):
    """key_span: a long row's blocks of queries scored against the keys of their own segments
    only give the whole row's output, gradients and forward-mode tangent (float32 rounding
    apart), features, padding and rows sharing a block's keys included; the span covers every
    block's segments."""
    import jax
    from harness.judge.oracle import gradient_inputs, key_span, with_gradients, with_tangents
    from harness.model.case import make_tangents

    case = Case(layout, batch, 2048, 2, 1, 8, "float32", seed=3, causal=causal,
                features=Features(**features))
    span = key_span(case.segment_ids, 128)
    assert span is not None and span < case.seq_len
    for block in range(case.seq_len // 128):   # from its earliest segment's first token
        touching = [x for x in case.segments
                    if x.start // 128 <= block <= (x.stop - 1) // 128]
        if touching:
            assert max(x.stop for x in touching) - min(x.start for x in touching) <= span
    args = make_inputs(case).device_args
    for mode in ("reverse", "forward"):
        outs = []
        for sp in (None, span):
            fn = functools.partial(dense_attention, scale=case.scale, causal=causal, block=128,
                                   features=case.features, chunk_convention=convention, span=sp)
            if mode == "reverse":
                outs.append(jax.jit(with_gradients(fn, diff=gradient_inputs(case)))(*args))
            else:
                outs.append(jax.jit(with_tangents(fn, bool(case.features.sinks)))(
                    *args[:-1], *make_tangents(case)))
        valid = (case.segment_ids > 0)[:, :, None, None]
        for whole, spanned in zip(*outs):
            whole, spanned = np.asarray(whole, np.float64), np.asarray(spanned, np.float64)
            if whole.ndim == 4:
                whole, spanned = np.where(valid, whole, 0), np.where(valid, spanned, 0)
            assert np.abs(whole - spanned).max() <= 1e-6 * max(np.abs(whole).max(), 1.0), mode
    assert key_span(case.segment_ids, case.seq_len) is None   # one block: the whole row


def test_a_span_too_short_for_the_segments_gives_a_nan_truth_not_a_wrong_one():
    """A program whose span does not cover the segment ids it is handed (built for another
    layout) says so: the blocks it cannot cover are NaN."""
    from harness.judge.oracle import key_span

    case = Case("packed/dozens", 1, 2048, 2, 1, 8, "float32", seed=3)
    x = make_inputs(case)
    span = key_span(case.segment_ids, 128)
    short = np.asarray(dense_attention(x.query, x.key, x.value, x.segment_ids, scale=case.scale,
                                       block=128, span=span - 256))
    valid = case.segment_ids > 0
    assert np.isnan(short[valid]).any()
    right = np.asarray(dense_attention(x.query, x.key, x.value, x.segment_ids, scale=case.scale,
                                       block=128, span=span))
    assert not np.isnan(right[valid]).any()


def test_oracle_attends_within_segment_only():
    """Changing one segment's keys and values leaves every other segment's truth bitwise equal."""
    import jax.numpy as jnp

    case = Case("packed/random", 2, 128, 2, 2, 8, "float32", seed=0)
    x = make_inputs(case)
    seg = case.segments[1]
    k2, v2 = x.key.copy(), x.value.copy()
    k2[seg.row, seg.start:seg.stop] += 1.0
    v2[seg.row, seg.start:seg.stop] -= 1.0
    a = np.asarray(dense_attention(x.query, x.key, x.value, jnp.asarray(x.segment_ids), scale=case.scale))
    b = np.asarray(dense_attention(x.query, k2, v2, jnp.asarray(x.segment_ids), scale=case.scale))
    for s in case.segments:
        same = np.array_equal(a[s.row, s.start:s.stop], b[s.row, s.start:s.stop])
        assert same == (s != seg), s.label


def test_a_drops_prediction_compiles_each_shape_once_in_the_runs_programs(monkeypatch):
    """A kernel's expectation that predicts a dropped feature (harness.judge.prediction) takes
    its references from the run's compiled programs: the second case of a shape compiles
    nothing (a fresh jit per case compiled on the run's thread every time: most of MaxText
    cudnn_flash_jax's 64 s of host time in the H200 nightly), and predicts what plain jit does."""
    import dataclasses

    from harness.engine.programs import ORACLE, Programs
    from harness.judge import oracle
    from harness.judge.prediction import prediction

    def both(case):
        return case, dataclasses.replace(case, features=case.features.without("window"))
    first = both(Case("packed/random", 2, 64, 2, 1, 16, "bfloat16", 0,
                      features=Features(window=(7, 0))))
    second = both(Case("extremes/single-tokens", 2, 64, 2, 1, 16, "bfloat16", 1,
                       features=Features(window=(7, 0))))
    monkeypatch.setattr(oracle, "_shared_programs", None)
    plain = [prediction(*pair, "row") for pair in (first, second)]
    programs = Programs(platform="cpu")
    assert oracle._shared_programs is programs
    shared = [prediction(*first, "row")]
    compiled = programs.timing[ORACLE].programs
    shared.append(prediction(*second, "row"))
    assert compiled == 3, "the truth and peer of the case, the truth without the window"
    assert programs.timing[ORACLE].programs == compiled, "nothing compiled for the second case"
    assert shared == plain
    assert programs.timing[ORACLE].wall_s > 0, "the prediction's time is the oracle's"
    # Closed (a repro or selftest that ended earlier in the process): plain jit again, never
    # a closed pool's error, nor a program left waiting for a compile that will not come.
    programs.close()
    assert oracle._shared_programs is None
    assert prediction(*second, "row") == plain[1]


def test_each_reference_computed_once_per_case():
    """The runner computes a case's references once for all its kernels: a kernel whose
    failing checks are diagnosed (the case held without each of its features) does not push
    the case's own reference out for the next kernel. On a case with two droppable features,
    the old two-entry cache computed the case's reference again for the kernel after the
    broken one."""
    from harness.engine.programs import ORACLE, Programs
    from harness.engine.runner import run_matrix
    from harness.judge.oracle import forget_references
    from harness.kernels.kernel import Platform
    from harness.tools.zoo import entries

    by_name = {e.name: e.kernel for e in entries()}
    kernels = [by_name["window_dropped"], by_name["ok_features_dense"]]
    case = Case("packed/random", 2, 128, 2, 2, 16, "float32", seed=3,
                features=Features(window=(7, 0), softcap=2.0))
    forget_references()
    programs = Programs()
    try:
        out = run_matrix(kernels, [case], Platform("cpu"), programs=programs, leak=False)
    finally:
        programs.close()
    assert any(r.diagnosis for r in out.records if r.kernel == "window_dropped")
    # Truth and peer: of the case, of the case without the window, without the soft cap; and
    # the jvp check's (the correct kernel has forward mode).
    assert programs.timing[ORACLE].runs == 2 * 3 + 2


def test_a_pytest_process_lets_go_of_the_last_cases_references_at_the_next_case():
    """pytest's --in-test path, as the engine's runner at each case: the references kept for
    one case are let go of when a test of another case runs in the process (a long row's are
    GiBs of device memory), and kept while the tests of the same case run."""
    from types import SimpleNamespace

    from harness.judge.oracle import _kept_reference, forget_references, reference_for
    from harness.pytest_plugin import moved_to
    first = Case("packed/random", 2, 128, 2, 2, 16, "float32", seed=3)
    second = Case("packed/random", 2, 128, 2, 2, 16, "float32", seed=4)
    forget_references()
    config = SimpleNamespace()
    moved_to(config, first)
    reference_for(first)
    moved_to(config, first)      # another kernel of the same case: its reference stays
    assert _kept_reference.cache_info().currsize == 1
    moved_to(config, second)
    assert _kept_reference.cache_info().currsize == 0
    reference_for(second)
    assert _kept_reference.cache_info().currsize == 1



@pytest.mark.parametrize("names", [["dot_product", "xla"], ["canary_ignores_segments", "xla"]])
def test_the_next_cases_reference_is_launched_ahead_and_read_once(monkeypatch, names):
    """The runner launches the next case's reference once this case's first kernel has run
    (oracle.launch_reference), and its jvp check's reference (xla has forward mode) once this
    case's first kernel with that check has run (the canary has none: this case's own is read
    before the next one's is launched), and the next case reads them: each case's truth and
    peer run once in each mode, the records are those of a run that computes each reference
    when its case comes, and nothing launched stays after the run."""
    from harness.engine import runner
    from harness.engine.programs import ORACLE, Programs
    from harness.engine.registry import select_kernels
    from harness.judge import oracle
    from harness.kernels.kernel import Platform

    kernels = select_kernels(names)
    assert [k.name for k in kernels] == names
    # bfloat16: the truth (float32) and the peer (bfloat16) differ, so a swap would show.
    cases = [Case("packed/random", 2, 128, 2, 2, 16, "bfloat16", seed=s) for s in (3, 4, 5)]
    read = []

    class Launched(dict):   # oracle._launched, saying which cases' references were read
        def pop(self, key, default=None):
            got = super().pop(key, default)
            if got is not None:
                read.append((key[0], key[3]))   # (case, forward)
            return got

    def run(launch, on_result=None):
        oracle.forget_references()
        monkeypatch.setattr(oracle, "_launched", Launched())
        monkeypatch.setattr(runner, "launch_reference", launch)
        programs = Programs()
        try:
            # Compiled before the run: launch_reference does not wait for a compile.
            for case in cases:
                for truth in (True, False):
                    programs.oracle(case, truth).compiled.result()
                    programs.oracle_jvp(case, truth).compiled.result()
            out = runner.run_matrix(kernels, cases, Platform("cpu"), programs=programs,
                                    leak=False, on_result=on_result)
        finally:
            programs.close()
            assert not oracle._launched   # let go of, read or not
        return [r.to_json() for r in out.records], programs.timing[ORACLE].runs

    ahead, ahead_runs = run(oracle.launch_reference)
    assert read == [(c, forward) for c in cases[1:] for forward in (False, True)]
    read.clear()
    plain, plain_runs = run(lambda *a, **k: False)
    assert read == []
    # Truth and peer once per case, and the jvp check's (xla has forward mode) once per case.
    assert ahead_runs == plain_runs == 2 * len(cases) + 2 * len(cases)
    assert ahead == plain

    # A run that ends with the next case's reference launched and not read lets go of it.
    class Stop(Exception):
        pass

    def stop_after_the_first_case(kernel, case, result):
        if case == cases[0] and kernel.name == kernels[-1].name:
            raise Stop
    read.clear()
    with pytest.raises(Stop):
        run(oracle.launch_reference, stop_after_the_first_case)
    assert read == []


def test_launching_a_reference_lets_go_of_the_one_launched_before():
    """One reference of each mode is launched ahead at a time (a long row's are GiBs of device
    memory)."""
    from harness.engine.programs import Programs
    from harness.judge import oracle

    first, second = (Case("packed/random", 2, 128, 2, 2, 16, "bfloat16", seed=s) for s in (3, 4))
    programs = Programs()
    try:
        for case in (first, second):
            for truth in (True, False):
                programs.oracle(case, truth).compiled.result()
        assert oracle.launch_reference(first, programs)
        assert [k[0] for k in oracle._launched] == [first]
        assert oracle.launch_reference(second, programs)
        assert [k[0] for k in oracle._launched] == [second]
        # the jvp check's reference is launched beside it, one at a time too
        for case in (first, second):
            for truth in (True, False):
                programs.oracle_jvp(case, truth).compiled.result()
        assert oracle.launch_reference(first, programs, forward=True)
        assert oracle.launch_reference(second, programs, forward=True)
        assert [k[0::3] for k in oracle._launched] == [(second, False), (second, True)]
    finally:
        oracle.forget_launched()
        programs.close()
    assert not oracle._launched
