"""The harness's own programs compiled ahead (harness.ahead): the same results as jax.jit, a
queued signature compiled by its caller, a failed compile raising where jax.jit raises; and a
run of the matrix compiling none of them on the run's thread."""
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness.ahead import Ahead, ahead
from harness.engine.program import Timing
from harness.engine.programs import OWN, Programs
from harness.engine.runner import run_matrix
from harness.judge import leak_probe, metrics, probe_runs
from harness.kernels.kernel import Kernel, Platform
from harness.kernels.reference import dot_product
from harness.model import case as case_module
from harness.model.case import Case
from harness.model.features import Features


def _shapes(*arrays):
    return tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays)


def test_a_signature_compiled_ahead_runs_that_program_and_gives_what_jit_gives():
    @ahead(static_argnames=("power",))
    def f(x, y, *, power):
        return (x * y) ** power

    x, y = jnp.arange(6.0).reshape(2, 3), jnp.ones((2, 3))
    timing = Timing()
    with ThreadPoolExecutor(1) as pool:
        assert f.compile_ahead(pool.submit, timing, *_shapes(x, y), power=2)
        assert not f.compile_ahead(pool.submit, timing, *_shapes(x, y), power=2), "once"
    got = f(x, y, power=2)
    np.testing.assert_array_equal(got, jax.jit(lambda a, b: (a * b) ** 2)(x, y))
    assert timing.programs == 1 and timing.compile_s > 0
    assert not f.unforeseen
    f(x, y, power=3)   # another static argument: not compiled ahead, plain jit
    assert len(f.unforeseen) == 1


def test_a_queued_signature_is_compiled_by_its_caller_and_never_twice():
    compiled = []

    def f(x):
        compiled.append(1)   # runs once per trace
        return x + 1

    g = Ahead(f)
    queue, timing = [], Timing()
    x = jnp.zeros(4)
    g.compile_ahead(queue.append, timing, *_shapes(x))   # queued, not started
    np.testing.assert_array_equal(g(x), np.ones(4))
    queue[0]()   # the compile thread comes later: nothing left to do
    assert len(compiled) == 1 and not g.unforeseen
    # The run stood still while it compiled: that is its wait for the program.
    assert timing.wait_s > 0 and timing.wait_s >= timing.compile_s * 0.5, timing


def test_a_signature_that_fails_to_compile_raises_at_the_call_as_jit_does():
    g = Ahead(lambda x: jnp.reshape(x, (5,)))
    x = jnp.zeros(4)
    with ThreadPoolExecutor(1) as pool:
        g.compile_ahead(pool.submit, Timing(), *_shapes(x))
    with pytest.raises(TypeError):
        g(x)


def test_a_closed_pool_leaves_the_signature_to_its_caller():
    g = Ahead(lambda x: x * 2)
    pool = ThreadPoolExecutor(1)
    pool.shutdown()
    x = jnp.ones(3)
    g.compile_ahead(pool.submit, Timing(), *_shapes(x))
    np.testing.assert_array_equal(g(x), 2 * np.ones(3))


def test_a_matrix_run_compiles_none_of_the_harness_programs_on_its_thread():
    """Every call the runner, the oracle, the jvp check and the leak probe make was foreseen by
    Programs.prefetch, at its exact signature: a signature missed there compiles on the run's
    thread (the H200 cold nightly: 69 s of its worker's 350)."""
    own = [metrics.stacked_token_errors, metrics.scales, probe_runs.stacked_changes,
           probe_runs.nonfinite_tokens, leak_probe.redrawn, case_module.tangents_program]
    assert all(isinstance(f, Ahead) for f in own)
    before = [set(f.unforeseen) for f in own]
    kernel = Kernel("dp_ahead", dot_product, forward_mode=True,
                    features=("window", "softcap", "chunk", "sinks", "head_dim_v"))
    # Shapes no other test uses, so that their signatures are new to this process.
    cases = [Case("packed/random", 2, 40, 3, 1, 8, "bfloat16", 3),
             Case("unpacked/pad-tail", 2, 40, 3, 1, 8, "float16", 4,
                  features=Features(window=(5, 0), sinks=True)),
             Case("packed/random", 1, 40, 3, 3, 8, "float32", 5, causal=False,
                  features=Features(head_dim_v=4))]
    programs = Programs()
    try:
        # Announced and traced first: a call the run makes before the tracer has come to its
        # pair compiles on the run's thread as it always did (no harm, but not what this
        # test looks for: signatures that were never foreseen).
        programs.prefetch([(kernel, c) for c in cases])
        programs._tracer.submit(lambda: None).result()
        result = run_matrix([kernel], cases, Platform("cpu"), programs=programs)
    finally:
        programs.close()
    assert not [r for r in result.records if r.verdict in ("error", "skip")]
    new = {f.__name__: f.unforeseen - b for f, b in zip(own, before)}
    assert not any(new.values()), f"compiled on the run's thread: {new}"
    row = programs.report()[OWN]
    assert row["programs"] >= len(own), row


def test_the_harness_programs_compile_while_every_kernel_compile_thread_is_busy():
    """They compile in threads of their own: queued behind the kernels' compiles, the run's
    thread reached them first and compiled them itself (the H200's cold nightly at 4d948f1:
    75 s of its 324)."""
    import threading
    kernel = Kernel("dp_own_pool", dot_product)
    case = Case("packed/random", 2, 48, 3, 1, 8, "bfloat16", 6)   # a shape of its own
    programs, hold = Programs(workers=1), threading.Event()
    busy = programs._pool.submit(hold.wait, 60)   # the kernels' only compile thread
    try:
        programs.prefetch([(kernel, case)])
        programs._tracer.submit(lambda: None).result()   # traced; own programs announced
        own = [e for f in (metrics.stacked_token_errors, metrics.scales)
               for e in f._entries.values() if e.timing is programs.timing[OWN]]
        assert own
        for entry in own:
            entry.compiled.result(timeout=60)   # compiled, the kernels' thread still held
        assert not busy.done()
    finally:
        hold.set()
        programs.close()


def test_the_jvp_tangents_program_is_compiled_ahead_when_its_pair_is_announced():
    """make_tangents takes no other program's outputs: it is compiled ahead from the pair's
    announcement, before anything of the pair is traced (the run draws the next case's
    tangents for its jvp reference launched ahead, before that case's other programs are
    announced; compiled on the run's thread then, 13.3 s of the H200's cold nightly)."""
    import threading
    kernel = Kernel("dp_tangents_ahead", dot_product, forward_mode=True)
    case = Case("packed/random", 2, 56, 3, 1, 8, "bfloat16", 7)   # a shape of its own
    programs, hold = Programs(), threading.Event()
    programs._tracer.submit(hold.wait, 60)   # nothing gets traced
    before = set(case_module.tangents_program.unforeseen)
    try:
        programs.prefetch([(kernel, case)])
        entries = [e for e in case_module.tangents_program._entries.values()
                   if e.timing is programs.timing[OWN]]
        assert len(entries) == 1
        entries[0].compiled.result(timeout=60)   # compiled with the tracer still held
        case_module.make_tangents(case)
        assert case_module.tangents_program.unforeseen == before
    finally:
        hold.set()
        programs.close()


def test_a_signature_compiles_with_the_options_it_was_given():
    """compile_ahead's compiler options reach XLA: an option XLA does not know fails that
    compile."""
    @ahead
    def g(x):
        return x * 3

    x = jnp.ones((5,))
    with ThreadPoolExecutor(1) as pool:
        g.compile_ahead(pool.submit, Timing(), *_shapes(x),
                        compiler_options={"xla_no_such_option_here": True})
    entry, = g._entries.values()
    assert "xla_no_such_option_here" in str(entry.compiled.exception(timeout=60))


def test_the_harness_programs_compiled_ahead_take_the_runs_own_options():
    """On a GPU the harness's own programs compile with OWN_OPTIONS, as the oracle's do
    (cases/test_programs.py); elsewhere with none. (Programs told the platform is a GPU: XLA's
    CPU backend takes the GPU options and ignores them.)"""
    from harness.engine.compiler_options import OWN_OPTIONS
    kernel = Kernel("dp_own_options", dot_product, forward_mode=True)
    case = Case("packed/random", 2, 64, 3, 1, 8, "bfloat16", 8)   # a shape of its own
    programs = Programs(platform="gpu")
    try:
        programs.prefetch([(kernel, case)], probe=False)
        programs._tracer.submit(lambda: None).result()
        own = [e for f in (metrics.stacked_token_errors, case_module.tangents_program)
               for e in f._entries.values() if e.timing is programs.timing[OWN]]
        assert len(own) >= 2 and all(e.options == OWN_OPTIONS for e in own)
    finally:
        programs.close()
    on_cpu = Programs(platform="cpu")
    try:
        assert on_cpu._own is None
    finally:
        on_cpu.close()
