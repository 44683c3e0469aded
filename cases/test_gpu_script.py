"""scripts/gpu.sh: the one entry point for GPU runs. Its plan names each step's command; an
unknown step is refused before anything runs; a step run on a CPU (HARNESS_ARGS narrowing it to
the smoke suite) writes its report, its line in steps.txt and one archive into OUT, and the
run's failure shows in its exit status line."""
import os
import re
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu.sh"
LEAKY = '''
import jax
import harness

def leaky(query, key, value, segment_ids, *, causal, scale):
    del segment_ids  # attends across segments: the leak probe must fail it
    return jax.nn.dot_product_attention(query, key, value, scale=scale, is_causal=causal)

harness.register_kernel("leaky", leaky, dtypes=("float32",))
'''


def _gpu_sh(*args, env=None, timeout=600):
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})


def test_the_plan_names_every_steps_command():
    out = _gpu_sh("--plan", "env", "nightly:n1", "census:te", "census:fa", "bench",
                  "features:f", "patch-test", "repro:reports/repro/x.py", "flake:4",
                  "census:drops=maxtext:cudnn_flash_jax,te:thd", "costs:tokamax:xla,xla")
    assert out.returncode == 0, out.stderr
    said = out.stdout
    assert ("costs:tokamax:xla,xla: python3 scripts/program_costs.py --suite nightly --kernels "
            "tokamax:xla,xla") in said
    assert "nightly:n1: python3 -m harness run --suite nightly --report-dir" in said
    assert "census:te: python3 -m harness census --part te --without flash_attn*" in said
    assert "--features window,softcap,chunk,sinks,head_dim_v" in said
    assert "flake:4: python3 -m harness run --suite nightly --seeds 4" in said
    assert "patch-test: python3 scripts/maxtext_patch_test.py" in said
    assert ("census:drops=maxtext:cudnn_flash_jax,te:thd: python3 -m harness census --part drops "
            "--kernels maxtext:cudnn_flash_jax,te:thd --report-dir") in said


def test_an_unknown_step_is_refused_before_anything_runs(tmp_path):
    out = _gpu_sh("nightly:a", "nighty:b", env={"OUT": str(tmp_path)})
    assert out.returncode == 2 and "unknown step 'nighty:b'" in out.stderr
    assert not list(tmp_path.iterdir())


def _on_this_cpu(tmp_path, **more) -> dict:
    """The script's environment for a step here: its folders under tmp_path, no bundles (this
    machine's .gpu/ is for the GPU), a stamp given."""
    return {"OUT": str(tmp_path / "out"), "GPU_SCRATCH": str(tmp_path / "scratch"),
            "BUNDLES": str(tmp_path / "no-bundles"), "HARNESS_GIT_COMMIT": "test",
            "HARNESS_GIT_DIRTY": "0", **more}


def test_a_step_on_a_cpu_writes_its_report_its_status_and_one_archive(tmp_path):
    module = tmp_path / "leaky.py"
    module.write_text(LEAKY)
    env = _on_this_cpu(tmp_path, HARNESS_ARGS=f"--suite smoke --cases packed/random-*-f32-s0 "
                       f"--kernel-module {module} --kernels leaky,dot_product")
    out = _gpu_sh("nightly:n1", env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    steps = (tmp_path / "scratch" / "steps.txt").read_text()
    assert "tree: commit test, dirty 0" in steps
    assert "nightly:n1 rc=1 " in steps, steps   # the leak fails the run: its status says so
    # The cores busy in each 10 s of the step, from CPU seconds sampled once a second.
    busy = re.search(r", cores busy by 10 s, (the cgroup's|the host's) \([^)]+\):((?: \d+\.\d)+)"
                     r" \(of (\d+)\)", steps)
    assert busy, steps
    assert all(0 <= float(x) <= 4 * os.cpu_count() for x in busy.group(2).split()), steps
    archives = list((tmp_path / "out").glob("gpu-*.tar.xz"))
    assert len(archives) == 1
    with tarfile.open(archives[0]) as tar:
        names = tar.getnames()
    assert {"steps.txt", "n1/report.jsonl.gz", "n1/summary.md", "n1.log.txt",
            "n1.cpu.txt"} <= set(names)


FAKE_PYSPY = """#!/usr/bin/env bash
# As py-spy record does: writes its -o file, runs the command after --, and exits 0 whatever
# the command's status.
while [ "$1" != -- ]; do [ "$1" = -o ] && : > "$2"; shift; done; shift
"$@"; exit 0
"""


def test_a_profiled_step_says_its_commands_status_not_the_profilers(tmp_path):
    """Under PYSPY the step's status is the run's (py-spy exits 0 whatever its command did:
    the H200's cold nightly at 396cbf3 exited 1 on an error and steps.txt read rc=0)."""
    module = tmp_path / "leaky.py"
    module.write_text(LEAKY)
    fake = tmp_path / "py-spy"
    fake.write_text(FAKE_PYSPY)
    fake.chmod(0o755)
    env = _on_this_cpu(tmp_path, PYSPY=str(fake), HARNESS_ARGS=(
        f"--suite smoke --cases packed/random-*-f32-s0 --kernel-module {module} "
        "--kernels leaky,dot_product"))
    out = _gpu_sh("nightly:n1", env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    steps = (tmp_path / "scratch" / "steps.txt").read_text()
    assert "nightly:n1 rc=1 " in steps, steps


def test_a_profiled_step_whose_command_said_nothing_is_unknown_not_a_success(tmp_path):
    """A profiler that ends well without its command's status (the shell around the command
    killed; here a stand-in that never runs it): the step's status is unknown, never 0."""
    fake = tmp_path / "py-spy"
    fake.write_text(FAKE_PYSPY.replace('"$@"; exit 0', "exit 0"))
    fake.chmod(0o755)
    out = _gpu_sh("nightly:n1", env=_on_this_cpu(tmp_path, PYSPY=str(fake),
                                                 HARNESS_ARGS="--suite smoke"))
    assert out.returncode == 0, out.stderr[-2000:]
    steps = (tmp_path / "scratch" / "steps.txt").read_text()
    assert "nightly:n1 rc=unknown " in steps, steps


def test_a_step_stopped_at_its_limit_leaves_time_to_pack_its_files(tmp_path):
    """A step runs under what is left of the call less PACK_S, and is killed KILL_S seconds
    after being told to stop: the archive is written inside CALL_S (at 79376bd a run stopped
    at the call's limit lost every file to the device tool's own limit while they were
    packed)."""
    import re
    env = _on_this_cpu(tmp_path, HARNESS_ARGS="--suite smoke", CALL_S="60", PACK_S="52",
                       KILL_S="5", MIN_LEFT="1")
    out = _gpu_sh("nightly:n1", env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    steps = (tmp_path / "scratch" / "steps.txt").read_text()
    found = re.search(r"nightly:n1 rc=(\d+) wall=(\d+)s", steps)
    assert found, steps
    # Stopped (124), or killed after its grace (137): within 8 s and 5 more, not the call's 60.
    assert found.group(1) in ("124", "137") and int(found.group(2)) <= 8 + 5 + 2, steps
    assert len(list((tmp_path / "out").glob("gpu-*.tar.xz"))) == 1


def test_the_profile_digest_lists_threads_at_work_and_a_teardown_apart(tmp_path):
    """scripts/pyspy_digest.py --busy: a thread's samples in a wait are not work; a pool's
    numbered threads are one row; samples with no Python frame (an interpreter's teardown)
    are a row of their own."""
    worker = 'process 10:"python3 -m harness.engine.worker /x/spec.json"'
    profile = tmp_path / "p.txt"
    profile.write_text("\n".join([
        f"{worker};thread (10): MainThread;run (harness/x.py:1);block_until_ready (jax/a.py:2) 40",
        f"{worker};thread (10): MainThread;run (harness/x.py:1);Condition.wait (threading.py:3) 20",
        f"{worker};thread (10): MainThread 10",
        f"{worker};thread (11): compile_0;load (harness/y.py:3) 24",
        f"{worker};thread (12): compile_1;load (harness/y.py:3) 16",
        f"{worker};thread (13): lowering-send;LoweringProcess._send_all (harness/z.py:9) 60",
    ]) + "\n")
    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "pyspy_digest.py"), str(profile),
                          "--busy", "20"], capture_output=True, text=True, check=True).stdout
    rows = [line.split(None, 1) for line in out.splitlines()]
    name = "process 10 harness.engine.worker /x/spec.json"
    assert rows == [["2.0", f"{name}  MainThread"], ["2.0", f"{name}  compile"],
                    ["0.5", f"{name}  MainThread (no Python frame)"]]
    # One thread's digest, as before --busy: PID THREAD [RATE] [TOP], --under anywhere.
    for args in (["10", "MainThread"], ["10", "MainThread", "20", "5"],
                 ["--under", "block_until_ready", "10", "MainThread"]):
        out = subprocess.run([sys.executable, str(ROOT / "scripts" / "pyspy_digest.py"),
                              str(profile), *args], capture_output=True, text=True, check=True)
        assert out.stdout.startswith("process 10, thread MainThread: "), (args, out.stdout)
    assert "2.0 s under 'block_until_ready'" in out.stdout
    bad = subprocess.run([sys.executable, str(ROOT / "scripts" / "pyspy_digest.py"),
                          str(profile), "--busy", "fast"], capture_output=True, text=True)
    assert bad.returncode == 2 and "RATE and TOP are numbers" in bad.stderr
