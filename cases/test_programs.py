"""Programs: compiled once per kernel and shape, ahead of use, timed; the probe's deterministic
build traced afresh where a kernel's library reads its algorithm from the environment."""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from harness.model.case import Case, make_inputs
from harness.kernels.kernel import Kernel
from harness.kernels.reference import dot_product
from harness.engine.programs import DEFAULT, DETERMINISTIC, Programs
from harness.engine.trace_environment import environment_set, traced_under

WIDTH = "HARNESS_TEST_WIDTH"


def _env_primitive():
    """A primitive whose abstract evaluation reads the environment, as TE's backward sizes its
    workspace from NVTE_ALLOW_NONDETERMINISTIC_ALGO."""
    from jax.extend.core import Primitive
    from jax.interpreters import mlir

    prim = Primitive("harness_test_env_width")
    prim.def_abstract_eval(lambda x: jax.core.ShapedArray((int(os.environ.get(WIDTH, "2")),),
                                                          x.dtype))
    prim.def_impl(lambda x: jnp.zeros((int(os.environ.get(WIDTH, "2")),), x.dtype))
    mlir.register_lowering(prim, mlir.lower_fun(
        lambda x: jnp.zeros((int(os.environ.get(WIDTH, "2")),), x.dtype), multiple_results=False))
    return prim


def test_a_trace_under_an_environment_does_not_reuse_cached_abstract_evaluations():
    prim = _env_primitive()
    x = jnp.ones(3)

    def width():
        return jax.jit(lambda x: prim.bind(x)).lower(x).out_info.shape[0]

    assert width() == 2
    with environment_set({WIDTH: "4"}), pytest.raises(ValueError, match="doesn't match"):
        # The trap: jax's abstract-eval cache answers from the first trace while the lowering
        # reads the environment anew (TE's workspace: no verifier catches it, memory does).
        width()
    with traced_under({WIDTH: "4"}):
        fresh = width()
    assert fresh == 4 and width() == 2 and WIDTH not in os.environ


def test_programs_compile_once_per_shape_and_are_timed():
    programs = Programs()
    kernel = Kernel("dp", dot_product)
    a = Case("packed/random", 2, 64, 2, 1, 16, "bfloat16", 0)
    b = Case("packed/many", 2, 64, 2, 1, 16, "bfloat16", 5)   # same shape, other layout and seed
    programs.prefetch([(kernel, a), (kernel, b)])
    pa, pb = programs.get(kernel, a), programs.get(kernel, b)
    assert pa is pb, "one program per kernel and shape"
    out = pa(*make_inputs(b).device_args)
    assert len(out) == 4 and out[0].shape == (2, 64, 2, 16)
    timing = programs.report()
    assert timing["dp"]["programs"] == 1 and timing["dp"]["runs"] == 1
    assert timing["dp"]["compile_s"] > 0 and timing["oracle"]["programs"] == 2
    assert programs.probe_mode == DEFAULT, "a CPU needs no separate deterministic build"
    programs.close()


def test_the_deterministic_build_reuses_the_lowering_unless_the_kernel_reads_the_environment():
    programs = Programs(platform="gpu")   # pretend: builds both modes (compiled for the CPU)
    assert programs.probe_mode == DETERMINISTIC
    case = Case("packed/random", 2, 64, 2, 1, 16, "float32", 0)
    seen = []

    def records_env(q, k, v, seg, *, causal, scale):
        seen.append(os.environ.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO"))
        return dot_product(q, k, v, seg, causal=causal, scale=scale)

    plain = Kernel("plain", records_env)
    te_like = Kernel("te_like", records_env,
                     deterministic_env={"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"})
    for kernel in (plain, te_like):
        seen.clear()
        default = programs.get(kernel, case, DEFAULT)
        det = programs.get(kernel, case, DETERMINISTIC)
        assert default is not det and det.mode == DETERMINISTIC
        det.compiled.result()
        args = make_inputs(case).device_args
        np.testing.assert_array_equal(np.asarray(default(*args)[0]), np.asarray(det(*args)[0]))
        assert seen == ([None] if kernel is plain else [None, "0"]), seen
    programs.close()


def test_a_kernel_that_fails_to_trace_errors_when_run():
    def broken(q, k, v, seg, *, causal, scale):
        raise RuntimeError("no such fused kernel")
    programs = Programs()
    program = programs.get(Kernel("broken", broken),
                           Case("packed/random", 1, 32, 1, 1, 8, "float32", 0))
    with pytest.raises(RuntimeError, match="no such fused kernel"):
        program.missing_markers()
    programs.close()


def test_on_gpus_the_harness_own_programs_skip_autotuning_and_kernels_compile_as_users_do(
        monkeypatch):
    from harness.engine import programs as programs_module
    options = {}
    real = programs_module.Programs._compile

    def spy(self, program, lowered, opts):
        options[(program.name, program.mode)] = opts
        return real(self, program, lowered, opts)

    monkeypatch.setattr(programs_module.Programs, "_compile", spy)
    programs = Programs(platform="gpu")   # pretend (compiled for the CPU)
    case = Case("packed/random", 2, 64, 2, 1, 16, "float32", 0)
    kernel = Kernel("plain", dot_product)
    programs.get(kernel, case, DEFAULT).compiled.result()
    programs.get(kernel, case, DETERMINISTIC).compiled.result()
    programs.oracle(case, truth=True).compiled.result()
    assert options[("plain", DEFAULT)] is None
    assert options[("plain", DETERMINISTIC)] == {"xla_gpu_deterministic_ops": True,
                                                 "xla_gpu_autotune_level": 0}
    assert options[("oracle", DEFAULT)] == {"xla_gpu_autotune_level": 0,
                                            "xla_gpu_enable_triton_gemm": False}
    programs.close()
    cpu = Programs(platform="cpu")
    options.clear()
    cpu.oracle(case, truth=True).compiled.result()
    assert options[("oracle", DEFAULT)] is None
    cpu.close()


def test_only_programs_of_kernels_that_read_the_environment_wait_for_an_environment_trace():
    """A trace under a temporary environment holds ENVIRONMENT_LOCK: a TE-like kernel's program
    must not run meanwhile (it could read the temporary setting); any other program runs."""
    import threading
    from harness.engine.trace_environment import ENVIRONMENT_LOCK
    case = Case("packed/random", 1, 32, 1, 1, 8, "float32", 0)
    programs = Programs()
    plain = programs.get(Kernel("plain", dot_product), case)
    te_like = programs.get(Kernel("te_like", dot_product,
                                  deterministic_env={"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}), case)
    assert not plain.reads_environment and te_like.reads_environment
    args = make_inputs(case).device_args
    plain(*args), te_like(*args)   # compiled
    done = threading.Event()
    with ENVIRONMENT_LOCK:         # as a trace under an environment does
        plain(*args)               # does not wait
        runner = threading.Thread(target=lambda: (te_like(*args), done.set()))
        runner.start()
        assert not done.wait(0.5), "the TE-like program ran during the environment's trace"
    assert done.wait(30)
    runner.join()
    assert programs.report()["te_like"]["wait_s"] >= 0.4
    programs.close()


def test_unwritten_blocks_are_filled_with_nan_bytes_and_freed():
    from harness.engine import unwritten
    compiled = jax.jit(lambda x: (x * 2, jnp.sum(x))).lower(jnp.ones((4, 8), jnp.bfloat16)).compile()
    sizes = unwritten.buffer_sizes(compiled)
    assert sizes[:2] == [4 * 8 * 2, 2], "each output's bytes, in order, then the temporaries"
    fill = np.asarray(unwritten._fill(8)())
    assert (fill == unwritten.POISON_BYTE).all()
    as_bf16 = jax.lax.bitcast_convert_type(unwritten._fill(8)().reshape(4, 2), jnp.bfloat16)
    assert jnp.isnan(as_bf16).all(), "0xFF bytes read as NaN in every float type"
    unwritten.poison(sizes)   # nothing is kept: the blocks are freed once filled


def test_only_the_checked_run_poisons_the_blocks_it_will_take(monkeypatch):
    """The kernel's checked run (its tolerance and padding checks) starts on NaN-filled blocks,
    so what a kernel leaves unwritten reads NaN on every run; the leak probe's reruns do not
    need it (they compare valid tokens)."""
    from harness.engine import unwritten
    from harness.kernels.kernel import Platform
    from harness.engine.runner import run_kernel_case
    calls = []
    monkeypatch.setattr(unwritten, "poison", lambda sizes: calls.append(list(sizes)))
    case = Case("unpacked/pad-tail", 2, 64, 2, 1, 16, "bfloat16", 0)
    programs = Programs()
    assert not programs.poisons_unwritten, "on CPUs XLA's own code writes all it returns"
    programs.poisons_unwritten = True   # as on a GPU
    result = run_kernel_case(Kernel("dp", dot_product), case, Platform("cpu"), programs, leak=True)
    assert any(r.check == "leak" for r in result.records)
    assert len(calls) == 1, "one poisoned run: the checked one"
    out = 2 * 64 * 2 * 16 * 2                     # bf16 [B, T, heads, d]
    assert calls[0][:4] == [out, out, out // 2, out // 2], "out, dq, then dk, dv (1 kv head)"
    assert all(n in unwritten._FILLS for n in calls[0]), \
        "the fills compiled beside the kernel's program, before its run needed them"
    programs.close()


def test_a_checked_run_that_missed_the_filled_blocks_is_filled_and_run_again(monkeypatch):
    """Another thread can take a freed block before the run does; the run's outputs then sit
    in blocks nobody filled (unwritten.landed says so), and the fill and run are done again."""
    from harness.engine import unwritten
    from harness.engine.program import POISON_ATTEMPTS

    class At:
        def __init__(self, address):
            self.address = address

        def unsafe_buffer_pointer(self):
            return self.address
    assert unwritten.landed([At(1), At(2)], {1, 2, 3})
    assert not unwritten.landed([At(1), At(9)], {1, 2, 3})
    assert unwritten.landed([At(9)], set()), "no addresses known: nothing to check"
    answers = iter([False, True])
    monkeypatch.setattr(unwritten, "landed", lambda out, where: next(answers))
    programs = Programs()
    programs.poisons_unwritten = True
    case = Case("packed/random", 2, 64, 2, 1, 16, "bfloat16", 0)
    program = programs.get(Kernel("dp2", dot_product), case)
    program(*make_inputs(case).device_args, poison_unwritten=True)
    assert program.timing.runs == 2 <= POISON_ATTEMPTS
    programs.close()


def test_close_waits_for_the_compiles_under_way_not_for_those_never_started(monkeypatch):
    """A worker ends with os._exit after Programs.close: a compile cut off while it writes
    jax's cache would leave a file jax fails to read. close waits for the tasks under way,
    cancels those not started, and waits at most CLOSE_WAIT_S."""
    import threading

    from harness.engine import programs as programs_module
    programs = Programs(workers=1)
    started, release, ran = threading.Event(), threading.Event(), []
    programs._pool.submit(lambda: (started.set(), release.wait(30), ran.append("ran")))
    never = programs._pool.submit(ran.append, "never")
    assert started.wait(30)
    threading.Timer(0.3, release.set).start()
    programs.close()
    assert ran == ["ran"] and never.cancelled()
    # A compile that does not end: close returns after CLOSE_WAIT_S, the task still running.
    monkeypatch.setattr(programs_module, "CLOSE_WAIT_S", 0.2)
    stuck, hold = Programs(workers=1), threading.Event()
    task = stuck._pool.submit(hold.wait, 30)
    stuck.close()
    assert not task.done()
    hold.set()
    assert task.result(timeout=30) is True
    # The harness's own programs compile in threads of their own: close waits for those too.
    monkeypatch.setattr(programs_module, "CLOSE_WAIT_S", 30)
    own, started, release, ran = Programs(workers=1), threading.Event(), threading.Event(), []
    own._own_pool.submit(lambda: (started.set(), release.wait(30), ran.append("own")))
    assert started.wait(30)
    threading.Timer(0.3, release.set).start()
    own.close()
    assert ran == ["own"]
