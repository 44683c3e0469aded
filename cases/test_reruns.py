"""A tolerance check judges one run of the kernel; the leak probe's reruns of the unchanged
inputs are runs too (harness.judge.judging.reruns_within_tolerance). A kernel right on its
first call only (state kept across calls: a workspace not zeroed, a cache) passed every check,
its later runs taken for run-to-run noise (a helper's adversarial review); now two runs apart
by more than twice a check's tolerance fail it. Run-to-run noise within that passes."""
import os
import subprocess
import sys
from pathlib import Path

from harness.judge import judging
from harness.judge import vocabulary as v
from harness.judge.record import Record

ROOT = Path(__file__).resolve().parent.parent
ONE_CASE = "packed/random-b4-t256-h4kv2-d64-bf16-s0"

MODULE = '''
import jax, jax.numpy as jnp, numpy as np, harness
from harness.kernels.reference import dot_product

def drifting(after):
    calls = [0]
    def factor():
        calls[0] += 1
        return np.float32(1.0 if calls[0] == 1 else after)
    def kernel(q, k, v, seg, *, causal, scale):
        f = jax.pure_callback(factor, jax.ShapeDtypeStruct((), jnp.float32))
        out = dot_product(q, k, v, seg, causal=causal, scale=scale)
        return (out.astype(jnp.float32) * f).astype(out.dtype)
    return kernel

harness.register_kernel("first_call_only", drifting(1.5), dtypes=("bfloat16",), gqa=True)
harness.register_kernel("drifts_within", drifting(1.0 + 2.0 ** -7), dtypes=("bfloat16",),
                        gqa=True)
'''


def _run(tmp_path, kernel):
    module = tmp_path / "drift.py"
    module.write_text(MODULE)
    report = tmp_path / kernel
    out = subprocess.run([sys.executable, "-m", "harness", "run", "--kernel-module", str(module),
                          "--kernels", kernel, "--cases", ONE_CASE, "--report-dir", str(report)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600, env=os.environ)
    from harness.store import report_file as rec
    return out, rec.read(report)[1]


def test_a_kernel_right_on_its_first_call_only_fails(tmp_path):
    out, records = _run(tmp_path, "first_call_only")
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-2000:]
    failed = [r for r in records if r.check == "out" and r.verdict == v.FAIL]
    assert failed and all(r.ratio <= 1 for r in failed)   # its first run within tolerance
    assert "two runs of its default build on the unchanged inputs differ by" in failed[0].message
    assert "two runs of its default build" in out.stdout


def test_run_to_run_noise_within_twice_the_tolerance_passes(tmp_path):
    out, records = _run(tmp_path, "drifts_within")
    assert not [r for r in records if r.check in ("out", "dq", "dk", "dv") and r.bad], \
        out.stdout[-3000:]
    leak = [r for r in records if r.check == "leak"]
    assert leak and all(r.rerun_change and r.rerun_change["out"] > 0 for r in leak)


def _record(check, **more):
    return Record(kernel="k", case_id="c", check=check, row=0, segment=1, **more)


def test_the_rule_fails_only_past_twice_the_tolerance_on_the_same_segment():
    def judged(change):
        records = [_record("out", verdict=v.PASS, expected=v.PASS, outcome=v.OK,
                           max_abs_err=0.1, tolerance=1.0, ratio=0.1),
                   _record("dq", verdict=v.PASS, expected=v.PASS, outcome=v.OK,
                           max_abs_err=0.1, tolerance=1.0, ratio=0.1),
                   _record("leak", verdict=v.PASS, expected=v.PASS, outcome=v.OK,
                           mode="default", rerun_change={"out": change})]
        return {r.check: r.verdict for r in judging.reruns_within_tolerance(records)}
    assert judged(2.0) == {"out": v.PASS, "dq": v.PASS, "leak": v.PASS}
    assert judged(2.01) == {"out": v.FAIL, "dq": v.PASS, "leak": v.PASS}
    assert judged(float("nan"))["out"] == v.PASS   # nothing measured: never a verdict from it
