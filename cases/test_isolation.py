"""Kernels whose libraries cannot share a process (Kernel.isolation) run in workers of their own;
a worker that dies costs one error record, and the rest of the run goes on."""
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.engine import device_shares
from harness.engine.options import RunOptions

ROOT = Path(__file__).resolve().parent.parent
ONE = "packed/random-b4-t256-h4kv4-d32-f32-s0"
TWO = "unaligned/odd-b4-t256-h4kv4-d32-f32-s0"

# Two "libraries" that register the same process-wide name, as flash-attn-jax and
# flash-attn3-jax register FFI targets of the same names: whichever comes second fails.
CLASHING = """
import sys, harness
from harness.kernels.reference import dot_product

def _load(group):
    owner = sys.modules.setdefault("_ffi_owner", type(sys)("_ffi_owner"))
    if getattr(owner, "group", group) != group:
        raise RuntimeError("Duplicate FFI handler registration for flash_mha_fwd")
    owner.group = group

def make(group):
    def kernel(q, k, v, seg, *, causal, scale):
        _load(group)
        return dot_product(q, k, v, seg, causal=causal, scale=scale)
    return kernel

harness.register_kernel("clash_a", make("a"), isolation="a", dtypes=("float32",))
harness.register_kernel("clash_b", make("b"), isolation="b", dtypes=("float32",))
harness.register_kernel("plain", dot_product, dtypes=("float32",))
"""

CRASHING = """
import os, harness
from harness.kernels.reference import dot_product

def crashes_on_odd(q, k, v, seg, *, causal, scale):
    import jax
    def die(x):
        if os.environ.get("CRASH_ODD") == "1":
            os._exit(7)  # the library takes its process down
        return x
    # The layout is only known when it runs: a host callback looks at the ids.
    out = dot_product(q, k, v, seg, causal=causal, scale=scale)
    odd = jax.pure_callback(lambda s: die(s), jax.ShapeDtypeStruct(seg.shape, seg.dtype), seg)
    return out + 0 * jax.lax.stop_gradient(odd[:, :, None, None]).astype(out.dtype)

harness.register_kernel("crashy", crashes_on_odd, isolation="crashy", dtypes=("float32",))
"""


def _run(*args, env=None):
    import os
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=900, env={**os.environ, **(env or {})})


def _run_module(tmp_path, source: str, kernels: str, cases: str, env=None, more=()):
    """`harness run` of the kernels a module (its source here) registers, on `cases`, without
    the leak probe, into tmp_path/r."""
    module = tmp_path / "kernels.py"
    module.write_text(source)
    return _run("run", "--kernel-module", str(module), "--kernels", kernels, "--cases", cases,
                "--report-dir", str(tmp_path / "r"), "--no-leak-probe", *more, env=env)


def _ok_probe_off(records) -> bool:
    """Every check ok, the leak check's one record per pair not run (--no-leak-probe)."""
    get = (lambda r, k: r[k]) if records and isinstance(records[0], dict) else getattr
    return {(get(r, "check") == "leak", get(r, "outcome")) for r in records} == {
        (False, "ok"), (True, "not run")}


def _records(report_dir):
    lines = [json.loads(x) for x in (Path(report_dir) / "report.jsonl").read_text().splitlines()]
    return lines[0], [r for r in lines[1:] if r["type"] == "record"]


def test_kernels_that_cannot_share_a_process_run_in_workers(tmp_path):
    out = _run_module(tmp_path, CLASHING, "clash_a,clash_b,plain", ONE)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    header, records = _records(tmp_path / "r")
    assert {r["kernel"] for r in records} == {"clash_a", "clash_b", "plain"}
    assert _ok_probe_off(records), [r["message"] for r in records if r["outcome"] != "ok"][:3]
    assert header["isolation"] == {"a": ["clash_a"], "b": ["clash_b"], "main": ["plain"]}
    assert header["selection"]["cases"] == ONE and header["environment"]["platform"] == "cpu"
    # Where the wall time went outside the table: each worker's start and pairs, the join.
    starts = [m["startup_s"] for m in header["merged_from"]]
    assert len(starts) == 3 and all(s > 0 for s in starts), header["merged_from"]
    assert 0 <= header["merge_s"] <= header["wall_s"]
    summary = (tmp_path / "r" / "summary.md").read_text()
    assert "Worker processes: " in summary and "reports joined in" in summary
    assert "<p>Worker processes: " in (tmp_path / "r" / "report.html").read_text()
    # Each worker's CPU seconds (its own over its life, its children's, its lowering processes'
    # of those), and the cores they kept busy: whether the run was bound by its CPUs.
    for m in header["merged_from"]:
        assert m["cpu_s"] > 0 and m["cores"] >= 1, m
        assert 0 <= m.get("lowering_cpu_s", 0) <= m["children_cpu_s"] + 0.1, m
    # ... and how long each stood still, for what (the table sums that over the workers).
    assert re.search(r"s on its pairs, of which \d+\.\d s waiting( \[[^]]+\])? \(CPU \d+ s, its "
                     r"(lowering|child) processes \d+ s[^;]*; together \d+\.\d of \d+ cores "
                     r"busy on average\)",
                     summary), summary[-3000:]
    for m in header["merged_from"]:
        assert m["wait_s"] >= sum(m["waits"].values()) - 1e-6, m
    # The clash is real: in one process, the second library fails (an error, never a pass).
    same = tmp_path / "same.py"
    same.write_text(CLASHING.replace('isolation="b"', 'isolation="a"'))
    # (Traced in one process: a lowering process beside it would trace both there, and the
    # run would load the one that traced without its library's import.)
    out = _run("run", "--kernel-module", str(same), "--kernels", "clash_a,clash_b",
               "--cases", ONE, "--report-dir", str(tmp_path / "s"), "--no-leak-probe",
               "--no-lowering-process")
    assert out.returncode == 1
    errors = [r for r in _records(tmp_path / "s")[1] if r["outcome"] == "error"]
    assert errors and "Duplicate FFI handler registration" in errors[0]["message"]


def test_a_worker_that_dies_is_one_error_and_the_run_goes_on(tmp_path):
    out = _run_module(tmp_path, CRASHING, "crashy,dot_product", f"{ONE},{TWO}",
                      env={"CRASH_ODD": "1"})
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    _, records = _records(tmp_path / "r")
    crashed = [r for r in records if r["kernel"] == "crashy"]
    # Both of its cases die: each is one error naming the death; nothing is dropped.
    assert {(r["case_id"], r["outcome"]) for r in crashed} == {(ONE, "error"), (TWO, "error")}
    assert all("died while running it (exited with status 7" in r["message"] for r in crashed)
    # The kernels of the other group ran every case.
    fine = {r["case_id"] for r in records if r["kernel"] == "dot_product" and r["outcome"] == "ok"}
    assert fine == {ONE, TWO}


def test_pytest_runs_a_clashing_kernel_in_a_worker(tmp_path):
    module = tmp_path / "clash.py"
    module.write_text(CLASHING)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "no:xdist", str(ROOT / "cases" / "test_matrix.py"),
                          "--kernel-module", str(module), "--kernels", "clash_a,clash_b",
                          "--cases", ONE, "--no-leak-probe", "--report-dir", str(tmp_path / "r")],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    _, records = _records(tmp_path / "r")
    assert {r["kernel"] for r in records if r["outcome"] == "ok"} == {"clash_a", "clash_b"}


def test_a_worker_dying_between_pairs_blames_no_pair(tmp_path, monkeypatch):
    """A worker that dies after a pair's records and before it announces the next one: no pair
    was running, so none is blamed, and a fresh worker runs the rest. One that dies before it
    finishes anything blames the pair it would have run first (and the run goes on)."""
    from harness.engine import workers as isolation
    pairs = [("k", "a"), ("k", "b"), ("k", "c")]
    # "a*": killed while appending a's records (one whole, one cut short, never finished).
    # "at start": it dies again when run alone (run_group's `alone`), so it is blamed.
    script = {"between": [("a",), ("b", "c")], "at start": [(), (), ("b", "c")],
              "mid-write": [("a*",), ("b", "c")]}

    def run(plan):
        attempts = iter(plan)

        def fake_stream(command, echo, env=None, stop=None):
            report = Path(json.loads(Path(command[-1]).read_text())["report_dir"])
            report.mkdir(parents=True)
            ran = next(attempts)
            with (report / "report.jsonl").open("w") as rec, \
                    (report / isolation.STARTED_FILE).open("w") as started, \
                    (report / isolation.FINISHED_FILE).open("w") as finished:
                for case in ran:
                    pair = {"kernel": "k", "case_id": case.rstrip("*")}
                    started.write(json.dumps(pair) + "\n")
                    rec.write(json.dumps({"type": "record", **pair}) + "\n")
                    if case.endswith("*"):
                        rec.write(json.dumps({"type": "record", **pair})[:20])
                    else:
                        finished.write(json.dumps({**pair, "records": 1}) + "\n")
            dies = len(ran) < len(json.loads(Path(command[-1]).read_text())["pairs"])
            return (-9, "Killed") if dies else (0, "")
        monkeypatch.setattr(isolation, "_stream", fake_stream)
        return isolation.run_group("g", pairs, tmp_path / str(len(list(tmp_path.iterdir()))),
                                   RunOptions(), echo=lambda line: None)
    between = run(script["between"])
    assert between.crashes == [] and len(between.report_dirs) == 2
    at_start = run(script["at start"])
    assert [c[:2] for c in at_start.crashes] == [("k", "a")]
    assert "killed by SIGKILL" in at_start.crashes[0][2]
    # Its records not all written: the pair it died on, blamed (it read as done before, and
    # kept what the kill left of its records without a word); the join reads past the cut line.
    mid_write = run(script["mid-write"])
    assert [c[:2] for c in mid_write.crashes] == [("k", "a")]
    from harness.store import report_file as rec
    header_line = json.dumps({"type": "run", "schema": 2, "environment": {},
                              "state": "running"}) + "\n"
    first = mid_write.report_dirs[0] / "report.jsonl"
    first.write_text(header_line + first.read_text())
    assert [pair for pair, _ in rec.read_lines(first)[1]] == [("k", "a")]


SLOW = """
import os, time, harness, jax
from harness.kernels.reference import dot_product

def make(group):
    def call(s):
        start = time.time()
        time.sleep(3)
        if os.environ.get("SLOW_LOG"):   # when each call ran, per group
            with open(os.environ["SLOW_LOG"], "a") as f:
                f.write(f"{group} {start} {time.time()}\\n")
        return s

    def kernel(q, k, v, seg, *, causal, scale):
        out = dot_product(q, k, v, seg, causal=causal, scale=scale)
        # The library takes its time on every call (a host callback that sleeps).
        slow = jax.pure_callback(call, jax.ShapeDtypeStruct(seg.shape, seg.dtype), seg)
        return out + 0 * jax.lax.stop_gradient(slow[:, :, None, None]).astype(out.dtype)
    return kernel

harness.register_kernel("slow_a", make("a"), isolation="a", dtypes=("float32",))
harness.register_kernel("slow_b", make("b"), isolation="b", dtypes=("float32",))
"""


def test_the_groups_workers_run_at_once_each_with_its_share_of_the_device(tmp_path, monkeypatch):
    """A nightly's FlashAttention groups ran after the main group's worker, doubling its time:
    the groups' workers now run at once. The kernels without a group keep XLA's default share
    of a GPU's memory (their probe's memory checks see what they saw alone); the others take
    what they need of the rest. A share the user set runs the groups one after another."""
    grow = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    assert device_shares.shares([None, "fa2", "fa3"], {}) == {
        None: {}, "fa2": {**grow, "XLA_CLIENT_MEM_FRACTION": "0.180"},
        "fa3": {**grow, "XLA_CLIENT_MEM_FRACTION": "0.180"}}
    assert device_shares.shares(["fa2", "fa3"], {})["fa3"] == {
        **grow, "XLA_CLIENT_MEM_FRACTION": "0.465"}
    # The user's own choice, under either of jax's names or another allocator: no shares.
    for name in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION",
                 "XLA_PYTHON_CLIENT_ALLOCATOR"):
        assert device_shares.shares([None, "fa2"], {name: ".5"}) is None
    assert device_shares.shares([None], {}) is None
    # pytest's xdist workers set a share for themselves (harness.pytest_plugin): not the user's choice here.
    for name in device_shares.USER_MEMORY:
        monkeypatch.delenv(name, raising=False)
    out = _run_module(tmp_path, SLOW, "slow_a,slow_b", ONE)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    header, records = _records(tmp_path / "r")
    assert {r["kernel"] for r in records if r["outcome"] == "ok"} == {"slow_a", "slow_b"}
    from datetime import datetime
    (a, b) = header["merged_from"]
    start_a, start_b = (datetime.fromisoformat(m["environment"]["time_utc"]) for m in (a, b))
    # Each worker sleeps at least 3 s per call of its kernel: had b waited for a, it would
    # have started after a's whole run.
    assert abs((start_b - start_a).total_seconds()) < min(a["wall_s"], b["wall_s"]), header


def test_main_is_not_a_group_name():
    """The kernels without a group run as "main": a group of that name would share its
    workers' folders."""
    import pytest

    from harness.kernels.kernel import Kernel
    from harness.kernels.reference import dot_product
    with pytest.raises(ValueError, match="isolation 'main'"):
        Kernel("k", dot_product, isolation="main")


def test_two_groups_run_at_a_time_the_main_group_first(tmp_path, monkeypatch):
    """Three groups at once once took more than the GPU had (the main group's 75% and two
    FlashAttention groups growing to 20% each): a cuDNN capture and a kernel launch in the main
    group failed on one cold H200 nightly, and a FlashAttention worker's allocations failed for
    want of memory. Now the main group starts first and the others take turns beside it, so
    the shares running at once never add up past DEVICE_SHARE; a group that starts once the
    main group has finished takes the larger share."""
    import threading
    import time

    from harness.engine import workers as isolation
    running, peak, lock, log = {}, [], threading.Lock(), []
    sleeps = {"main": 0.6, "fa2": 0.2, "fa3": 0.2, "fa4": 0.2, "fa5": 0.2}

    def fake_run_group(name, pairs, workdir, options, *, env, **_):
        with lock:
            running[name] = float(env.get(device_shares.MEM_FRACTION, device_shares.MAIN_SHARE))
            peak.append(sum(running.values()))
            log.append((name, running[name], time.monotonic()))
        time.sleep(sleeps[name])
        with lock:
            running.pop(name)
            log.append((name, None, time.monotonic()))
        return isolation.WorkerResult()
    monkeypatch.setattr(isolation, "run_group", fake_run_group)
    groups = {"fa2": [("a", "c")], None: [("b", "c")], "fa3": [("d", "c")],
              "fa4": [("e", "c")], "fa5": [("f", "c")]}
    pool, futures = isolation.start_groups(groups, tmp_path, [], env={})
    pool.shutdown(wait=True)
    assert [f.result().interrupted for f in futures] == [False] * 5
    starts = [(n, share) for n, share, _ in log if share is not None]
    assert "main" in [n for n, _ in starts[:2]] and len(starts) == 5
    assert max(peak) <= device_shares.DEVICE_SHARE + 1e-9, peak
    main_end = next(t for n, share, t in log if n == "main" and share is None)
    for name, share, t in log:
        if share is not None and name != "main":   # beside main: the small share; after: half
            assert share == (0.18 if t < main_end else 0.465), log


def test_ctrl_c_stops_a_controller_running_several_groups(tmp_path, monkeypatch):
    """Ctrl-C while the main group and one other run and a third waits its turn: every worker
    stops, the waiting group never starts, no pair is blamed for being stopped, and the report
    keeps what finished and says it was interrupted (exit 130)."""
    import os
    import signal
    import time

    from harness.engine import workers as isolation
    for name in device_shares.USER_MEMORY:
        monkeypatch.delenv(name, raising=False)
    module = tmp_path / "slow.py"
    module.write_text(SLOW + '\nharness.register_kernel("slow_main", make("main"), '
                             'dtypes=("float32",))\n')
    report = tmp_path / "r"
    workers = report / "workers"
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness", "run", "--kernel-module", str(module),
         "--kernels", "slow_main,slow_a,slow_b", "--cases", f"{ONE},{TWO}",
         "--report-dir", str(report), "--no-leak-probe"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "SLOW_LOG": str(tmp_path / "calls.log")})
    # Where this test runs with SIGINT ignored (a background job), its child ignores it too:
    # SIGTERM (`timeout`, a CI cancellation) takes the same path in the CLI.
    stop = signal.SIGTERM if signal.getsignal(signal.SIGINT) == signal.SIG_IGN else signal.SIGINT
    try:
        def nonempty(pattern):
            return any(f.stat().st_size for f in workers.glob(pattern))
        # Both running groups have started a pair, and one pair is done: each of them has
        # another pair to go, so the third group is still waiting for a turn.
        deadline = time.monotonic() + 300
        while not (nonempty(f"main-1/report/{isolation.STARTED_FILE}")
                   and nonempty(f"a-1/report/{isolation.STARTED_FILE}")
                   and nonempty(f"*/report/{isolation.FINISHED_FILE}")):
            assert proc.poll() is None and time.monotonic() < deadline, "no pair finished"
            time.sleep(0.2)
        proc.send_signal(stop)
        out = proc.communicate(timeout=120)[0]
    finally:
        proc.kill()
    assert proc.returncode == 130, out[-3000:]
    header, records = _records(report)
    assert header.get("interrupted") is True
    assert records and not [r for r in records if r["outcome"] == "error"], out[-3000:]
    calls = {line.split()[0] for line in (tmp_path / "calls.log").read_text().splitlines()}
    assert "b" not in calls and not list(workers.glob("b-*")), calls


LOSES_THE_DEVICE = """
import os
import harness
from harness.kernels.reference import dot_product

def loses(q, k, v, seg, *, causal, scale):
    # The first case it ever runs "loses the device": an error whose words are a sticky CUDA
    # error's (CUDA_ERROR_ILLEGAL_INSTRUCTION); a process that saw one must not go on.
    open(os.environ["LOST_MARKER"] + str(os.getpid()), "w").close()
    first = os.environ["LOST_MARKER"] + "first"
    if not os.path.exists(first):
        open(first, "w").close()
        raise RuntimeError("INTERNAL: CUDA error: CUDA_ERROR_ILLEGAL_INSTRUCTION: an illegal "
                           "instruction was encountered")
    return dot_product(q, k, v, seg, causal=causal, scale=scale)

harness.register_kernel("loses", loses, dtypes=("float32",), isolation="lossy")
"""


def test_a_worker_whose_device_is_lost_ends_and_a_fresh_one_takes_the_rest(tmp_path):
    """A sticky CUDA error leaves a process's device context unusable (on the H200 every pair
    after jax's packed cuDNN call crashed failed in that process): the worker ends after that
    pair's error record, and a fresh worker runs the rest."""
    # The kernel "loses the device" when first traced, as files say: in the workers only
    # (a lowering process would trace it first, and would count as one more process).
    out = _run_module(tmp_path, LOSES_THE_DEVICE, "loses,dot_product", f"{ONE},{TWO}",
                      env={"LOST_MARKER": str(tmp_path / "lost-")},
                      more=("--no-lowering-process",))
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    _, records = _records(tmp_path / "r")
    mine = {r["case_id"]: r["outcome"] for r in records if r["kernel"] == "loses"
            and r["check"] in ("*", "out")}
    # The first case errs (the device "lost"); the second ran in a fresh worker, and passed.
    assert sorted(mine.values()) == ["error", "ok"], mine
    pids = [p for p in tmp_path.glob("lost-*") if p.name != "lost-first"]
    assert len(pids) == 2, "two worker processes ran the kernel"
    # Both workers' time is in the run's timing table: the lost one closed its report with it
    # (the oracle ran truth and peer in each worker: 2 + 2 for the lossy group, 4 + 4 for
    # dot_product with its forward mode).
    workers = sorted((tmp_path / "r" / "workers").glob("lossy-*/report/report.jsonl"))
    assert len(workers) == 2, workers
    for path in workers:
        worker_header = json.loads(path.read_text().splitlines()[0])
        assert worker_header["timing"]["loses"]["wall_s"] > 0, worker_header
    header, _ = _records(tmp_path / "r")
    assert header["timing"]["oracle"]["runs"] == 12, header["timing"]


def test_workers_run_without_command_buffers_unless_the_user_chose(monkeypatch):
    """Worker processes on a GPU machine start with XLA's command buffers off (a capture is
    broken by any thread's work on the device: the compile threads' on the H200); a user's own
    setting of the flag is kept, their other flags too. Without a GPU their flags are the
    user's (XLA_FLAGS are part of jax's cache keys: the in-process runs' programs stay found)."""
    from harness.engine import environment
    from harness.engine.workers import NO_COMMAND_BUFFERS, worker_environment
    monkeypatch.setattr(environment, "nvidia_smi_gpus", lambda: None)
    assert worker_environment({"XLA_FLAGS": "--a"}) == {"XLA_FLAGS": "--a"}
    assert worker_environment({}) == {}
    monkeypatch.setattr(environment, "nvidia_smi_gpus", lambda: 2)
    assert worker_environment({"CUDA_VISIBLE_DEVICES": ""}) == {"CUDA_VISIBLE_DEVICES": ""}
    assert worker_environment({})["XLA_FLAGS"] == NO_COMMAND_BUFFERS
    assert worker_environment({"XLA_FLAGS": "--xla_dump_to=/tmp/d"})["XLA_FLAGS"] == \
        f"--xla_dump_to=/tmp/d {NO_COMMAND_BUFFERS}"
    mine = {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=FUSION", "OTHER": "1"}
    assert worker_environment(mine) == mine


def test_the_main_group_splits_into_parts_of_whole_shapes():
    """On one H200 the main group's worker ran 3,250 of a warm nightly's 3,445 pairs, mostly on
    the host: with --main-workers N its pairs run in N parts, whole shapes to a part (their
    programs compile once, a case's references are computed once), the largest first onto the
    part with the least work so far; each part in run order."""
    from harness.engine import main_parts
    from harness.engine import workers as isolation
    from harness.model.case import Case
    small = ["packed/random-b4-t256-h4kv4-d32-f32-s0", "unaligned/odd-b4-t256-h4kv4-d32-f32-s0"]
    large = ["packed/random-b4-t1024-h4kv4-d32-f32-s0", "unaligned/odd-b4-t1024-h4kv4-d32-f32-s0"]
    odd = ["packed/random-b2-t512-h4kv2-d64-f32-s0"]
    main = [(k, c) for c in small + large + odd for k in ("x", "y")]
    shares = main_parts.split(main, 2, Case.from_id)
    assert shares == [[(k, c) for c in large for k in ("x", "y")],
                      [(k, c) for c in small + odd for k in ("x", "y")]]
    assert {Case.from_id(c).shape_key for _, c in shares[0]}.isdisjoint(
        {Case.from_id(c).shape_key for _, c in shares[1]})
    split = main_parts.with_parts({None: main, "fa": [("f", small[0])]}, 3)
    assert list(split) == ["main.1", "main.2", "main.3", "fa"]
    assert sorted(p for n in ("main.1", "main.2", "main.3") for p in split[n]) == sorted(main)
    assert split["fa"] == [("f", small[0])]
    # One shape, or one part: the main group stays whole.
    assert main_parts.with_parts({None: [("x", c) for c in small]}, 3) == \
        {None: [("x", c) for c in small]}
    assert main_parts.with_parts({None: main}, 1) == {None: main}
    assert isolation.memory_bound("XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while "
                                  "trying to allocate 2.00GiB")
    assert not isolation.memory_bound("wrong result")
    # What would not fit in the main group's share either is not worth running again there.
    too_big = ("deterministic build failed (DoesNotFit: needs 1024.8 GiB of device memory "
               "(workspace included), more than the 31.0 GiB this device has)")
    main = main_parts.main_share_bytes(int(31 * 2**30), {main_parts.MEM_FRACTION: "0.233"})
    assert 99 * 2**30 < main < 100 * 2**30
    assert not isolation.memory_bound(too_big, main) and isolation.memory_bound(too_big)
    assert isolation.memory_bound(too_big.replace("1024.8", "40.0"), main)
    assert main_parts.main_share_bytes(None) is None
    assert main_parts.main_share_bytes(2**30, {}) is None


def test_the_parts_run_at_once_beside_the_other_groups_with_equal_shares(tmp_path,
                                                                        monkeypatch):
    """Every part of the main group starts at once, the other groups take turns in one more
    place; the parts share the main group's 75% equally, the others have what they had beside
    the main group whole, each taken as needed; each is told how many run at once (its share
    of the host's cores); the parts defer what lacks memory. Where the user set jax's memory, or with one part, the main group runs whole with
    XLA's default share."""
    import threading

    from harness.engine import main_parts
    from harness.engine import workers as isolation
    log, lock = [], threading.Lock()
    started = threading.Barrier(4, timeout=30)   # three parts and one other group at once

    def logged(name, env, more):   # what a group's workers were given
        with lock:
            log.append((name, env.get(device_shares.MEM_FRACTION), env.get(device_shares.PREALLOCATE),
                        env.get(main_parts.CORES_SHARE), more.get("defer_memory")))

    def fake_run_group(name, pairs, workdir, options, *, env, **more):
        logged(name, env, more)
        if name != "fb":
            started.wait()
        return isolation.WorkerResult(name=name)
    monkeypatch.setattr(isolation, "run_group", fake_run_group)
    cases = [f"packed/random-b4-t{t}-h4kv4-d32-f32-s0" for t in (256, 512, 1024)]
    groups = {None: [(k, c) for c in cases for k in "xy"], "fa": [("f", cases[0])],
              "fb": [("g", cases[0])]}
    pool, futures = isolation.start_groups(groups, tmp_path, [], env={}, parts=3)
    pool.shutdown(wait=True)
    assert sorted(log[:4]) == [(n, "0.180" if n == "fa" else "0.250", "false", "4", n != "fa")
                               for n in ("fa", "main.1", "main.2", "main.3")]
    assert log[4] == ("fb", "0.180", "false", "4", False)
    assert main_parts.header_parts(futures) == {"main.1": 2, "main.2": 2, "main.3": 2,
                                                "main.deferred": 0}
    assert isolation.report_names(groups, 3) == ["main", "main.1", "main.2", "main.3", "fa",
                                                 "fb", "main.deferred"]

    # One part (the default), the main group named last: it still starts first, whole, with
    # XLA's default share, and the other groups take turns beside it with theirs.
    main_started, fb_started = threading.Event(), threading.Event()

    def in_turn(name, pairs, workdir, options, *, env, **more):
        logged(name, env, more)
        if name == "main":
            main_started.set()
            assert fb_started.wait(timeout=30)   # until an other group's turn has come
        elif name == "fa":
            assert main_started.wait(timeout=30)
        else:
            fb_started.set()
        return isolation.WorkerResult(name=name)
    monkeypatch.setattr(isolation, "run_group", in_turn)
    last = {"fa": groups["fa"], "fb": groups["fb"], None: groups[None]}
    log.clear()
    pool, futures = isolation.start_groups(last, tmp_path, [], env={}, parts=1)
    pool.shutdown(wait=True)
    assert log == [("main", None, None, None, False), ("fa", "0.180", "false", None, False),
                   ("fb", "0.180", "false", None, False)]
    assert main_parts.header_parts(futures) == {}
    # The user's memory setting: no parts, one group after another, the main group first,
    # each with the user's setting.
    monkeypatch.setattr(isolation, "run_group", fake_run_group)
    log.clear()
    started = threading.Barrier(1)
    pool, futures = isolation.start_groups(last, tmp_path, [], env={device_shares.MEM_FRACTION: ".5"},
                                           parts=3)
    pool.shutdown(wait=True)
    assert log == [(n, ".5", None, None, False) for n in ("main", "fa", "fb")]
    assert main_parts.header_parts(futures) == {}

    class Stopped:   # a part stopped before it finished: how many it deferred is not known
        group, pairs = "main.1", 5

        def done(self):
            return False
    from harness.views.markdown import run_line
    header = {"suite": "nightly", "main_parts": main_parts.header_parts([Stopped()])}
    assert header["main_parts"] == {"main.1": 5}
    header["main_parts"]["main.2"] = 3
    assert "main group in 2 workers at once (5, 3 pairs) ·" in run_line(header) + " ·"


HUNGRY = """
import os, harness
from harness.kernels.reference import dot_product

def hungry(q, k, v, seg, *, causal, scale):
    # Out of memory where its process has a small share of the device (a part's), as a kernel
    # whose workspace does not fit there.
    if os.environ.get("XLA_CLIENT_MEM_FRACTION") and q.shape[1] == 256:
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 30.0GiB")
    return dot_product(q, k, v, seg, causal=causal, scale=scale)

harness.register_kernel("hungry", hungry, dtypes=("float32",))
harness.register_kernel("plain", dot_product, dtypes=("float32",))
"""


def test_main_workers_is_an_option_checked_and_sent_to_the_workers():
    """--main-workers N: one by default (reports/nightly-h200-79376bd/), 1 to 8, a whole
    number; it reaches a worker in its options' JSON (no effect there: a worker runs the pairs
    it is given)."""
    from harness.engine.options import RunOptions, check_main_workers
    from harness.errors import UsageError
    assert RunOptions().main_workers == 1
    chosen = RunOptions.from_values({"suite": "nightly", "main_workers": "2"}.get)
    assert chosen.main_workers == 2
    assert RunOptions.from_json(chosen.to_json()) == chosen
    for bad, words in (("0", "must be 1 to 8"), ("9", "must be 1 to 8"),
                       ("two", "not a whole number")):
        with pytest.raises(UsageError, match=f"--main-workers .*{words}"):
            check_main_workers(bad)


def test_a_parts_pair_that_lacks_memory_runs_again_with_the_main_groups_share(tmp_path,
                                                                              monkeypatch):
    """A pair of a main group's part that runs out of memory in its share keeps no record
    there: it runs again once the groups have ended, with the main group's share (DEFERRED),
    and its records are those; the other pairs keep theirs."""
    from harness.engine import main_parts
    from harness.engine import workers as isolation
    from harness.store import report_file as rec
    # pytest's xdist workers set a share for themselves (harness.pytest_plugin): not the user's.
    for name in device_shares.USER_MEMORY:
        monkeypatch.delenv(name, raising=False)
    module = tmp_path / "hungry.py"
    module.write_text(HUNGRY)
    options = RunOptions(kernel_modules=(str(module),), leak_probe=False)
    small, large = ONE, "packed/random-b4-t1024-h4kv4-d32-f32-s0"
    groups = {None: [(k, c) for c in (small, large) for k in ("hungry", "plain")]}
    pool, futures = isolation.start_groups(groups, tmp_path, options, env=None, parts=2,
                                           echo=lambda line: None)
    pool.shutdown(wait=True)
    results = {f.result().name: f.result() for f in futures}
    assert set(results) == {"main.1", "main.2"}
    assert [p for r in results.values() for p in r.deferred] == [("hungry", small)]
    assert all(r.crashes == [] for r in results.values())
    again = isolation.run_deferred(futures, tmp_path, options, echo=lambda line: None)
    assert again.name == main_parts.DEFERRED and again.crashes == []
    records = {}
    for name in isolation.report_names([None], 2):
        for d in isolation.worker_reports(tmp_path, name):
            for r in rec.read(d)[1]:
                records.setdefault((r.kernel, r.case_id), []).append((name, r))
    # Each pair once, from one worker: the deferred one from DEFERRED's, the others from their
    # part's.
    assert {pair: {n for n, _ in rows} for pair, rows in records.items()} == {
        ("hungry", small): {"main.deferred"}, ("plain", small): {"main.2"},
        ("hungry", large): {"main.1"}, ("plain", large): {"main.1"}}
    assert all(_ok_probe_off([r for _, r in rows]) for rows in records.values())
    assert main_parts.header_parts(futures) == {"main.1": 2, "main.2": 2, "main.deferred": 1}
    # A run stopped before the deferred pairs ran again does not say they did.
    assert main_parts.header_parts(futures, rerun=False) == {"main.1": 2, "main.2": 2}


AVOIDS_A_CRASH = """
import harness
from harness.kernels.reference import dot_product

def avoided(case, platform):
    # Not run, with a reason that names the crash it avoids (as jax_nn's VALUE_HEAD_DIM_CRASH).
    return (["a known upstream bug (CUDA_ERROR_ILLEGAL_INSTRUCTION)"]
            if case.layout.startswith("packed") else [])

harness.register_kernel("avoids", dot_product, dtypes=("float32",), isolation="careful",
                        constraints=avoided)
"""


def test_a_skip_naming_a_sticky_error_does_not_end_its_worker(tmp_path):
    """Only an error ends a worker for a lost device: a skip whose reason names the crash it
    avoids ended the H200's main worker at each such case (three fresh workers a night)."""
    out = _run_module(tmp_path, AVOIDS_A_CRASH, "avoids,dot_product", f"{ONE},{TWO}")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    _, records = _records(tmp_path / "r")
    mine = {r["case_id"]: r["outcome"] for r in records if r["kernel"] == "avoids"
            and r["check"] in ("*", "out")}
    assert mine == {ONE: "skip", TWO: "ok"}, mine
    assert [p.name for p in (tmp_path / "r" / "workers").glob("careful-*")] == ["careful-1"]


def test_main_workers_end_to_end_on_a_gpu_machine(tmp_path, monkeypatch):
    """The engine's own path where a GPU is seen (nvidia-smi's count stood in for), with
    --main-workers 3: two shapes, two parts at once; the pair a part lacked memory for
    runs again, the merged report holds each pair once with its records from the worker that
    ran it whole, and the header line says how the main group ran and how many pairs again."""
    from harness.engine import environment
    from harness.engine.engine import run
    from harness.store import report_file as rec
    from harness.views.markdown import run_line
    for name in device_shares.USER_MEMORY:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(environment, "nvidia_gpus", lambda: 1)
    module = tmp_path / "hungry.py"
    module.write_text(HUNGRY)
    small, large = ONE, "unaligned/long-edges-b4-t1152-h2kv2-d32-f32-s0"   # smoke's cases
    report = tmp_path / "r"
    options = RunOptions(kernel_modules=(str(module),), leak_probe=False, main_workers=3,
                         kernels=("hungry", "plain"), cases=(small, large),
                         report_dir=str(report), use_compilation_cache=False)
    assert run(options) == 0
    header, records = rec.read(report)
    pairs = {}
    for r in records:
        pairs.setdefault(r.pair, []).append(r)
    assert set(pairs) == {(k, c) for k in ("hungry", "plain") for c in (small, large)}
    assert all(_ok_probe_off(rows) for rows in pairs.values()), pairs
    assert header["main_parts"] == {"main.1": 2, "main.2": 2, "main.deferred": 1}
    assert "main group in 2 workers at once (2, 2 pairs, 1 of them again for memory)" \
        in run_line(header)
    merged = [m["path"].split("/workers/")[-1] for m in header["merged_from"]]
    assert merged == ["main.1-1/report", "main.2-1/report", "main.deferred-1/report"]


def test_a_worker_stopped_by_sigterm_is_a_stop_not_its_pairs_crash(tmp_path, monkeypatch):
    """`timeout` signals the whole process group: a worker killed by SIGTERM (or exiting 143)
    was being stopped with its run; no pair is blamed and no fresh worker starts (the H200's
    first try at 0cfdd4f blamed te:thd and started main.light#2)."""
    import pytest

    from harness.engine import workers as isolation
    for status in (-15, 143):
        def fake_stream(command, echo, env=None, stop=None, status=status):
            Path(json.loads(Path(command[-1]).read_text())["report_dir"]).mkdir(parents=True)
            return status, "Terminated"
        monkeypatch.setattr(isolation, "_stream", fake_stream)
        with pytest.raises(isolation.Stopped):
            isolation.run_group("g", [("k", "a")], tmp_path / str(status), RunOptions(),
                                echo=lambda line: None)


def test_a_group_stopped_partway_keeps_the_pairs_it_ran_again(tmp_path, monkeypatch):
    """A group stopped after one of its pairs ran again (a broken capture) still says so: the
    header's run_again is what the workers did, stopped or not."""
    from concurrent.futures import Future

    from harness.engine import workers as isolation
    from harness.engine.capture import RETRY_FILE
    attempts = []

    def fake_stream(command, echo, env=None, stop=None):
        report = Path(json.loads(Path(command[-1]).read_text())["report_dir"])
        report.mkdir(parents=True)
        attempts.append(report)
        if len(attempts) == 1:   # the capture broke on ("k", "a"): run it again
            (report / RETRY_FILE).write_text(json.dumps(
                {"kernel": "k", "case_id": "a", "why": "previous error during capture"}) + "\n")
            return 4, "a CUDA graph capture broke"
        return -15, "Terminated"   # the fresh worker is stopped with the run
    monkeypatch.setattr(isolation, "_stream", fake_stream)
    with pytest.raises(isolation.Stopped) as stopped:
        isolation.run_group("g", [("k", "a"), ("k", "b")], tmp_path, RunOptions(),
                            echo=lambda line: None)
    assert len(attempts) == 2
    assert stopped.value.result.run_again == [("k", "a", "previous error during capture")]
    future = Future()
    future.set_exception(stopped.value)
    assert isolation.run_again_entries([future]) == [
        {"kernel": "k", "case_id": "a", "why": "previous error during capture"}]


RED_ZONE = "E1205 19:26:40.789849    5693 gpu_profiler.cc:374] Red zone modified"
TIMER = ("W1205 19:26:40.790001    5680 cuda_timer.cc:88] Delay kernel timed out: measured time "
         "has sub-optimal accuracy.")


def _pairs_file(path: Path, pairs, **more) -> None:
    """A worker's log of pairs (STARTED_FILE, FINISHED_FILE, RETRY_FILE), as workers write it."""
    path.write_text("".join(json.dumps({"kernel": k, "case_id": c, **more}) + "\n"
                            for k, c in pairs))


def _red_zone_death(report: Path, pairs) -> tuple[int, str]:
    """Dies as the H200's cold nightly's worker did at 396cbf3: on its first pair, announced,
    SIGSEGV after XLA's autotuner's line, other threads' timer warnings logged after it."""
    from harness.engine import workers as isolation
    _pairs_file(report / isolation.STARTED_FILE, pairs[:1])
    return -11, f"{RED_ZONE}\n{TIMER}\n{TIMER}"


def _scripted_group(tmp_path, monkeypatch, ends, defer_memory=False):
    """run_group over ("k", "a"), ("k", "b") whose workers end as `ends` say, one per worker
    (each given its report folder and pairs, returning the exit status and stderr's end); the
    worker after them finishes what it is given. Returns the result, each worker's pairs and
    its spec's run_again, and what run_group said."""
    from harness.engine import workers as isolation
    given, told, said = [], [], []

    def fake_stream(command, echo, env=None, stop=None):
        spec = json.loads(Path(command[-1]).read_text())
        report = Path(spec["report_dir"])
        report.mkdir(parents=True)
        pairs = [tuple(p) for p in spec["pairs"]]
        given.append(pairs)
        told.append([tuple(p) for p in spec["run_again"]])
        if len(given) <= len(ends):
            return ends[len(given) - 1](report, pairs)
        _pairs_file(report / isolation.FINISHED_FILE, pairs)
        return 0, ""
    monkeypatch.setattr(isolation, "_stream", fake_stream)
    result = isolation.run_group("g", [("k", "a"), ("k", "b")], tmp_path, RunOptions(),
                                 echo=said.append, defer_memory=defer_memory)
    return result, given, told, said


def test_a_worker_killed_in_xlas_autotuning_runs_its_pair_again(tmp_path, monkeypatch):
    """A worker killed just after XLA's autotuner (a compile thread) logged a red zone
    modified is taken as the harness's concurrency's doing (harness.engine.capture): the pair
    runs again in a fresh worker, no error, and the header's run_again keeps the death."""
    result, given, told, said = _scripted_group(tmp_path, monkeypatch, [_red_zone_death])
    assert given == [[("k", "a"), ("k", "b")]] * 2
    # The fresh worker is told the pair was run again (its spec's run_again: a capture that
    # breaks there then stands as the pair's error, harness.engine.worker).
    assert told == [[], [("k", "a")]]
    assert result.crashes == []
    assert result.run_again == [("k", "a", f"killed by SIGSEGV: {TIMER}")]
    assert any("died while XLA compiled, on k a" in line and "runs again" in line
               for line in said), said


def test_a_worker_killed_after_the_autotuners_timer_warnings_alone_runs_its_pair_again(
        tmp_path, monkeypatch):
    """As the H200's cold nightly's worker died at 4bd381a: SIGSEGV after XLA's timer warnings
    (the autotuner timing candidates in a compile thread), no red-zone line. Any other line
    before the signal is the pair's (test_a_worker_killed_otherwise_blames_its_pair_at_once)."""
    from harness.engine import workers as isolation

    def timer_death(report, pairs):
        _pairs_file(report / isolation.STARTED_FILE, pairs[:1])
        return -11, f"{TIMER}\n{TIMER}\n"
    result, given, _, _ = _scripted_group(tmp_path, monkeypatch, [timer_death])
    assert result.crashes == [] and given == [[("k", "a"), ("k", "b")]] * 2
    assert result.run_again == [("k", "a", f"killed by SIGSEGV: {TIMER}")]


CRASHES_IN = """
import faulthandler, sys, threading, time
faulthandler.enable(all_threads=True)

def {name}():
    faulthandler._sigsegv()

def {beside}():
    time.sleep(60)

threading.Thread(target={beside}, daemon=True).start()
print("W1205 21:35:09.5 29399 some log line", file=sys.stderr, flush=True)
threading.Thread(target={name}).start()
time.sleep(60)
"""


@pytest.mark.parametrize("name, beside, compiling",
                         [("backend_compile_and_load", "waits", True),
                          ("kernel_launch", "waits", False),
                          ("kernel_launch", "backend_compile_and_load", True)])
def test_a_workers_crashing_thread_is_read_from_faulthandlers_dump(tmp_path, name, beside,
                                                                   compiling):
    """A real fatal signal in a thread of a process with faulthandler on (as workers run):
    what the controller keeps of its stderr ends with the crashing thread's frames and says
    whether it was compiling, and whether another thread was (the H200's cold nightly at
    9ade3fe: its run thread launching, 16 threads compiling), either of which runs its pair
    again (harness.engine.capture); the dump itself is not kept, the lines before it are."""
    from harness.engine.capture import BESIDE, CRASHED, StderrTail, died_compiling
    proc = subprocess.run([sys.executable, "-c", CRASHES_IN.format(name=name, beside=beside)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode < 0 and "Current thread" in proc.stderr
    tail = StderrTail()
    for line in proc.stderr.splitlines(keepends=True):
        tail.add(line)
    kept = tail.text().splitlines()
    assert len(kept) == 2 and kept[0].endswith("some log line"), kept
    assert kept[-1].startswith(CRASHED + ("was compiling: " if name == "backend_compile_and_load"
                                          else "was not "))
    assert f"{name} (<string>:6) < run (" in kept[-1]
    assert kept[-1].endswith(f"{BESIDE}1 thread(s)") is (beside != "waits")
    assert beside not in tail.text() and "Thread 0x" not in tail.text()
    assert died_compiling(proc.returncode, tail.text()) is compiling
    assert not died_compiling(0, tail.text())


ABORTS_OUT_OF_MEMORY = """
import ctypes, faulthandler, os, sys, time
faulthandler.enable(all_threads=True)
print("F1205 external/xla/x.cc:1] Check failed: RESOURCE_EXHAUSTED: Out of memory while "
      "trying to allocate 70.00GiB", file=sys.stderr, flush=True)
# abseil's stack after its fatal line, as XLA's aborts print it
print("*** Check failure stack trace: ***", file=sys.stderr)
for i in range(60):
    print(f"    @     0x7f0e{i:08x}  absl::LogMessage::Flush()", file=sys.stderr)
sys.stderr.flush()
if sys.argv[1] == "native":   # a thread of a library's own, with no Python frame
    libc = ctypes.CDLL(None)
    libc.pthread_create(ctypes.byref(ctypes.c_ulong()), None, libc.abort, None)
    time.sleep(60)
os.abort()
"""


@pytest.mark.parametrize("where", ["python", "native"])
def test_a_workers_death_reason_keeps_its_own_last_line_before_the_crashing_thread(
        tmp_path, where):
    """The reason a worker died gives its own last line (XLA's, here an out-of-memory abort:
    a main group's part defers such a pair, harness.engine.memory), then the crashing thread
    as faulthandler named it, or that it had no Python frames (a thread of XLA's or CUDA's
    own: faulthandler names no current thread then)."""
    from harness.engine.capture import CRASHED, NONE, StderrTail, death, died_compiling
    from harness.engine.memory import memory_bound
    proc = subprocess.run([sys.executable, "-c", ABORTS_OUT_OF_MEMORY, where],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode < 0 and "Fatal Python error" in proc.stderr
    tail = StderrTail()
    for line in proc.stderr.splitlines(keepends=True):
        tail.add(line)
    why = death(proc.returncode, tail.text())
    assert why.startswith("killed by SIGABRT: F1205 ") and memory_bound(why), why
    if where == "native":
        assert why.endswith(f"; {CRASHED}{NONE}"), why
    else:
        assert f"; {CRASHED}was not compiling: <module> (<string>:" in why, why
    assert not died_compiling(proc.returncode, tail.text())


def test_the_dump_keeps_what_other_threads_log_meanwhile_and_passes_over_garbage_collecting():
    """Lines logged by other threads while faulthandler writes its dump are kept (XLA's
    autotuner's red-zone line, here: its pair runs again); the crashing thread's frames are
    read past a line saying it was collecting garbage; a second dump replaces the first."""
    from harness.engine.capture import BESIDE, CRASHED, StderrTail, died_compiling
    dump = ["Fatal Python error: Segmentation fault\n", "\n",
            "Thread 0x00007f01 (most recent call first):\n",
            '  File "/x/threading.py", line 355 in wait\n', "\n",
            "Current thread 0x00007f02 (most recent call first):\n", "  Garbage-collecting\n",
            f"{RED_ZONE}\n",
            '  File "/site/jax/_src/compiler.py", line 395 in backend_compile_and_load\n',
            '  File "/w/harness/compiling.py", line 43 in compile_lowered\n', "\n",
            "Extension modules: numpy.core (total: 1)\n"]
    tail = StderrTail()
    for line in ["an earlier dump's\n", "Fatal Python error: Aborted\n",
                 "Current thread 0x00007f03 (most recent call first):\n",
                 '  File "/w/harness/engine/program.py", line 9 in run\n', "\n",
                 "before\n", *dump]:
        tail.add(line)
    kept = tail.text().splitlines()
    assert kept[:-1] == ["an earlier dump's", "before", RED_ZONE], kept
    assert kept[-1] == (CRASHED + "was compiling: backend_compile_and_load "
                        "(jax/_src/compiler.py:395) < compile_lowered (w/harness/compiling.py:43)")
    assert died_compiling(-11, tail.text())
    # The crashing thread's frames end with its block: a compile in a thread after it is
    # another thread's, and the pair runs again for it too.
    other = StderrTail()
    for line in ["Fatal Python error: Segmentation fault\n",
                 "Current thread 0x00007f02 (most recent call first):\n",
                 '  File "/w/harness/engine/program.py", line ??? in _launched\n', "\n",
                 "Thread 0x00007f01 (most recent call first):\n", *dump[8:10], "  ...\n"]:
        other.add(line)
    assert other.text().splitlines() == [
        CRASHED + "was not compiling: _launched (harness/engine/program.py:???)"
        f"{BESIDE}1 thread(s)"]
    assert died_compiling(-11, other.text())
    # Another thread waiting, or loading a program from jax's cache (no XLA compile, as in a
    # warm run): the crash is the run's.
    alone = StderrTail()
    for line in ["Fatal Python error: Segmentation fault\n",
                 "Current thread 0x00007f02 (most recent call first):\n",
                 '  File "/w/harness/engine/program.py", line ??? in _launched\n', "\n",
                 *dump[2:5], "Thread 0x00007f04 (most recent call first):\n",
                 '  File "/site/jax/_src/compiler.py", line 509 in compile_or_get_cached\n',
                 '  File "/w/harness/compiling.py", line 43 in compile_lowered\n']:
        alone.add(line)
    assert alone.text().splitlines() == [
        CRASHED + "was not compiling: _launched (harness/engine/program.py:???)"]
    assert not died_compiling(-11, alone.text())


def test_a_worker_killed_in_xlas_autotuning_twice_is_the_pairs_error(tmp_path, monkeypatch):
    """Killed so again in the fresh worker: the pair's error stands (what happens twice is not
    left out), and the rest runs on."""
    result, given, told, _ = _scripted_group(tmp_path, monkeypatch, [_red_zone_death] * 2)
    assert given == [[("k", "a"), ("k", "b")]] * 2 + [[("k", "b")]]
    assert told == [[]] + [[("k", "a")]] * 2
    assert [c[:2] for c in result.crashes] == [("k", "a")]
    assert "died while running it (killed by SIGSEGV" in result.crashes[0][2]
    assert len(result.run_again) == 1


def test_a_pair_runs_again_once_at_most_for_either_cause(tmp_path, monkeypatch):
    """Run again after a broken capture, then its fresh worker killed after the autotuner's
    red-zone line: the second failure stands as the pair's error (harness.engine.capture)."""
    from harness.engine.capture import RETRY_FILE

    def capture_broke(report, pairs):
        _pairs_file(report / RETRY_FILE, pairs[:1], why="during capture")
        return 4, "a CUDA graph capture broke"
    result, given, _, _ = _scripted_group(tmp_path, monkeypatch,
                                          [capture_broke, _red_zone_death])
    assert given == [[("k", "a"), ("k", "b")]] * 2 + [[("k", "b")]]
    assert [c[:2] for c in result.crashes] == [("k", "a")]
    assert result.run_again == [("k", "a", "during capture")]


def test_a_worker_killed_otherwise_blames_its_pair_once_it_dies_alone(tmp_path, monkeypatch):
    """Any other death is the pair's once a worker running it alone dies too (a kernel that
    crashes its process). A worker traces and compiles the pairs after the one it runs: a
    kernel ending the process there (os._exit at trace, a fault) killed it while an innocent
    pair was the last started, and that pair read ERROR (a helper's adversarial review)."""
    def segv(report, pairs):
        return -11, "Segmentation fault in the kernel's own library"
    result, given, _, _ = _scripted_group(tmp_path, monkeypatch, [segv, segv])
    assert [c[:2] for c in result.crashes] == [("k", "a")]
    assert [a[:2] for a in result.run_again] == [("k", "a")]
    assert given == [[("k", "a"), ("k", "b")], [("k", "a")], [("k", "b")]]
    # Alone, it ran: not its crash; the rest runs on in a fresh worker. No pair died again:
    # a death no pair repeats, blamed on none, and the run is not a pass (a review's kernel
    # that segfaulted on its first trace only read ok, the death in no view).
    result, given, _, said = _scripted_group(tmp_path / "once", monkeypatch, [segv])
    assert result.crashes == [] and [a[:2] for a in result.run_again] == [("k", "a")]
    assert given == [[("k", "a"), ("k", "b")], [("k", "a")], [("k", "b")]]
    assert any("ran alone" in line for line in said), said
    assert result.unblamed == [("k", "a")]
    from concurrent.futures import Future

    from harness.engine.workers import run_again_entries
    from harness.judge import tallies
    done = Future()
    done.set_result(result)
    header = {"run_again": run_again_entries([done])}
    assert header["run_again"] == [{"kernel": "k", "case_id": "a", "unblamed": True,
                                    "why": "killed by SIGSEGV: Segmentation fault in the "
                                           "kernel's own library"}]
    assert tallies.unblamed(header) and tallies.run_status([], header) == 1
    assert "1 worker death(s) that no pair repeated" in tallies.unblamed_text(
        tallies.unblamed(header))
    # The death repeated by a pair after it (blamed there): that pair's error, none unblamed.

    def ran(report, pairs):
        _pairs_file(report / isolation.FINISHED_FILE, pairs)
        return 0, ""
    from harness.engine import workers as isolation
    result, given, _, _ = _scripted_group(tmp_path / "later", monkeypatch, [segv, ran, segv])
    assert given == [[("k", "a"), ("k", "b")], [("k", "a")], [("k", "b")]]
    assert [c[:2] for c in result.crashes] == [("k", "b")] and result.unblamed == []
    # Killed outright (no dump: the host's out-of-memory killer while a cold run compiles) or
    # out of device memory: maybe the harness's doing, run again alone, not held against it.
    for end in ((-9, ""), (-6, "RESOURCE_EXHAUSTED: Out of memory while trying to allocate")):
        result, given, _, _ = _scripted_group(tmp_path / f"harness{end[0]}", monkeypatch,
                                              [lambda report, pairs, end=end: end])
        assert [a[:2] for a in result.run_again] == [("k", "a")] and result.unblamed == []
    # The pair that ran alone deferred there (it lacked device memory, a main part's worker):
    # it did not run, so it did not pass.

    def deferred(report, pairs):
        _pairs_file(report / isolation.DEFERRED_FILE, pairs)
        return 0, ""
    result, given, _, _ = _scripted_group(tmp_path / "deferred", monkeypatch, [segv, deferred],
                                          defer_memory=True)
    assert result.deferred == [("k", "a")] and result.unblamed == []


CRASHES_ONCE = """
import os, signal
import harness
from harness.kernels.reference import dot_product

def crash_once(q, k, v, seg, *, causal, scale):
    # Its first trace in any process ends that process (a fault now and then); then it is right.
    if not os.path.exists(os.environ["CRASH_MARKER"]):
        open(os.environ["CRASH_MARKER"], "w").close()
        os.kill(os.getpid(), signal.SIGSEGV)
    return dot_product(q, k, v, seg, causal=causal, scale=scale)

harness.register_kernel("crash_once", crash_once, dtypes=("float32",), isolation="crashy")
"""


def test_a_worker_death_no_pair_repeats_is_not_a_pass(tmp_path):
    """A kernel that kills its worker once (its first trace) and is right after: its pair
    ran alone in a fresh worker and passed, and the run read ok with exit 0, the death in no
    view (an adversarial review). Now the death stands, blamed on none: exit 1, every view
    says it, and so does a merge of the report."""
    cases = f"{ONE},packed/many-b4-t256-h4kv4-d32-f32-s0"
    out = _run_module(tmp_path, CRASHES_ONCE, "crash_once,dot_product", cases,
                      env={"CRASH_MARKER": str(tmp_path / "crashed")},
                      more=("--no-lowering-process",))
    assert (tmp_path / "crashed").exists()
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "worker death(s) that no pair repeated" in out.stdout, out.stdout[-3000:]
    header, records = _records(tmp_path / "r")
    assert _ok_probe_off(records)   # every check ran, and passed
    assert [e["kernel"] for e in header["run_again"] if e.get("unblamed")] == ["crash_once"]
    assert "worker death(s) that no pair repeated" in (tmp_path / "r" / "summary.md").read_text()
    merged = _run("merge", str(tmp_path / "m"), str(tmp_path / "r"))
    assert merged.returncode == 1 and "1 worker death(s) that no pair repeated" in \
        merged.stdout, merged.stdout[-2000:]
    # Run again (the kernel no longer crashes) and merged over it: the pair's records are the
    # second run's, and so is its verdict.
    (tmp_path / "again").mkdir()
    again = _run_module(tmp_path / "again", CRASHES_ONCE, "crash_once,dot_product", cases,
                        env={"CRASH_MARKER": str(tmp_path / "crashed")},
                        more=("--no-lowering-process",))
    assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-2000:]
    merged = _run("merge", str(tmp_path / "m2"), str(tmp_path / "r"),
                  str(tmp_path / "again" / "r"))
    assert merged.returncode == 0 and "no pair repeated" not in merged.stdout, \
        merged.stdout[-2000:]


BREAKS_A_CAPTURE = """
import os
import harness
from harness.kernels.reference import dot_product

def broken(q, k, v, seg, *, causal, scale):
    # Its first run fails as XLA's cuDNN graph load does when another thread breaks its CUDA
    # graph capture; ALWAYS_BROKEN: every run, in every process.
    open(os.environ["CAPTURE_MARKER"] + str(os.getpid()), "w").close()
    first = os.environ["CAPTURE_MARKER"] + "first"
    if os.environ.get("ALWAYS_BROKEN") == "1" or not os.path.exists(first):
        open(first, "w").close()
        raise RuntimeError("INTERNAL: detail::cuda_graph_end_capture(fake_stream, &graph_obj) "
                           "failed with operation failed due to a previous error during capture")
    return dot_product(q, k, v, seg, causal=causal, scale=scale)

harness.register_kernel("broken_capture", broken, dtypes=("float32",), isolation="capture")
"""


def _capture_run(tmp_path, always: bool):
    # Its "first run" is its first trace, as files say: in the workers only (a lowering
    # process would trace it first).
    return _run_module(tmp_path, BREAKS_A_CAPTURE, "broken_capture,dot_product", ONE,
                       env={"CAPTURE_MARKER": str(tmp_path / "capture-"),
                            "ALWAYS_BROKEN": "1" if always else "0"},
                       more=("--no-lowering-process",))


def test_a_pair_whose_capture_broke_runs_again_in_a_fresh_worker(tmp_path):
    """A CUDA graph capture broken by another thread of the worker is the harness's failure,
    not the kernel's (harness.engine.capture): the worker writes none of the pair's records
    and ends, a fresh worker runs the pair again, and the header and summary say so."""
    out = _capture_run(tmp_path, always=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    header, records = _records(tmp_path / "r")
    mine = [r for r in records if r["kernel"] == "broken_capture"]
    assert mine and _ok_probe_off(mine), mine
    assert [(r["kernel"], r["case_id"]) for r in header["run_again"]] == [("broken_capture", ONE)]
    assert "during capture" in header["run_again"][0]["why"]
    pids = [p for p in tmp_path.glob("capture-*") if p.name != "capture-first"]
    assert len(pids) == 2, "two worker processes ran the kernel"
    assert "1 pair(s) run again in a fresh worker" in (tmp_path / "r" / "summary.md").read_text()
    assert "runs again in a fresh worker" in out.stdout + out.stderr


def test_the_reason_a_pair_runs_again_shows_its_broken_capture():
    """A leak record names its finding first and the broken run of its probe after it: the
    reason the run gives (its header's run_again, the worker's last line) is the part around
    the capture's marker, not the message's first 300 characters, which read as a leak."""
    from harness.engine.capture import MARKERS, capture_excerpt
    leak = ("changed while the segment was untouched: dk, dv (max change 0.5 at token 3) "
            * 8 + "; its deterministic build: INTERNAL: " + MARKERS[0] + " in the stream")
    assert len(leak) > 600
    why = capture_excerpt(leak)
    assert MARKERS[0] in why and why.startswith("...") and len(why) <= 303
    short = f"XlaRuntimeError: {MARKERS[1]}"
    assert capture_excerpt(short) == short
    fits = "x" * 150 + MARKERS[0] + "y" * 10   # shorter than the width: whole
    assert capture_excerpt(fits) == fits
    late = "x" * 650 + MARKERS[0]              # near the end: the last 300 characters
    assert capture_excerpt(late) == "..." + late[-300:]
    assert capture_excerpt("z" * 400) == "z" * 300   # no marker: the first 300


def test_a_capture_that_breaks_again_in_the_fresh_worker_is_an_error(tmp_path):
    """Broken twice, in two processes: the pair's error stands (what happens twice is not
    left out), recorded once."""
    out = _capture_run(tmp_path, always=True)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    header, records = _records(tmp_path / "r")
    mine = [r for r in records if r["kernel"] == "broken_capture"]
    assert {r["outcome"] for r in mine} == {"error"} and len(mine) == 1, mine
    assert "during capture" in mine[0]["message"]
    assert len(header["run_again"]) == 1


def test_pytest_lanes_header_lists_the_pairs_run_again(tmp_path):
    """pytest's lanes (--ahead) run a pair whose capture broke again in a fresh worker too, and
    its report's header lists it, as the CLI's does."""
    import os
    module = tmp_path / "kernels.py"
    module.write_text(BREAKS_A_CAPTURE)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
         str(ROOT / "cases" / "test_matrix.py"), "--ahead", "--kernel-module", str(module),
         "--kernels", "broken_capture,dot_product", "--cases", ONE, "--no-leak-probe",
         "--no-lowering-process",   # its "first run" is its first trace, as in _capture_run
         "--report-dir", str(tmp_path / "r")], cwd=ROOT, capture_output=True, text=True,
        timeout=600, env={**os.environ, "CAPTURE_MARKER": str(tmp_path / "capture-"),
                          "ALWAYS_BROKEN": "0"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    header, records = _records(tmp_path / "r")
    assert _ok_probe_off([r for r in records if r["kernel"] == "broken_capture"])
    assert [(r["kernel"], r["case_id"]) for r in header["run_again"]] == [("broken_capture", ONE)]
    assert "1 pair(s) run again in a fresh worker" in (tmp_path / "r" / "summary.md").read_text()


def test_pytest_lanes_hold_a_worker_death_no_pair_repeats(tmp_path):
    """pytest's lanes (--ahead) as the CLI: a kernel that kills its worker once and is right
    after fails the session (exit 1, every test passed), its terminal and summary say why."""
    import os
    module = tmp_path / "kernels.py"
    module.write_text(CRASHES_ONCE)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q",
         str(ROOT / "cases" / "test_matrix.py"), "--ahead", "--kernel-module", str(module),
         "--kernels", "crash_once,dot_product", "--no-leak-probe", "--no-lowering-process",
         "--cases", f"{ONE},packed/many-b4-t256-h4kv4-d32-f32-s0",
         "--report-dir", str(tmp_path / "r")], cwd=ROOT, capture_output=True, text=True,
        timeout=600, env={**os.environ, "CRASH_MARKER": str(tmp_path / "crashed")})
    assert (tmp_path / "crashed").exists()
    assert out.returncode == 1 and "4 passed" in out.stdout, out.stdout[-3000:] + out.stderr[-3000:]
    assert "1 worker death(s) that no pair repeated" in out.stdout, out.stdout[-3000:]
    header, _ = _records(tmp_path / "r")
    assert [e["kernel"] for e in header["run_again"] if e.get("unblamed")] == ["crash_once"]


SKIPS_NAMING_A_CAPTURE = """
import harness
from harness.kernels.reference import dot_product

def avoid(case, platform):
    return ["cuda_graph_end_capture fails on this shape: not run"]

harness.register_kernel("avoids_capture", dot_product, dtypes=("float32",), isolation="grp",
                        constraints=avoid)
"""


def test_a_skip_naming_a_broken_capture_is_a_skip(tmp_path):
    """A skip's reason may name the capture failure it avoids: that pair is skipped, in one
    worker, and nothing runs again."""
    out = _run_module(tmp_path, SKIPS_NAMING_A_CAPTURE, "avoids_capture,dot_product",
                      f"{ONE},{TWO}")
    # Named and skipping every case: red for that alone (tallies.named_idle), nothing else.
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    assert "1 kernel named with --kernels judged nothing" in out.stdout
    header, records = _records(tmp_path / "r")
    assert not [r for r in records if r["outcome"] not in ("ok", "skip", "not run")]
    mine = [r for r in records if r["kernel"] == "avoids_capture"]
    assert len(mine) == 2 and {r["outcome"] for r in mine} == {"skip"}, mine
    assert "run_again" not in header
    assert [d.name for d in (tmp_path / "r" / "workers").glob("grp-*")] == ["grp-1"]


END_PROCESS = """
import sys, tempfile, shutil, threading, time
from pathlib import Path
from harness.process_end import at_end, end_process
left = Path(tempfile.mkdtemp(prefix="harness-end-"))
at_end(shutil.rmtree, left, True)
at_end(lambda: 1 / 0)                       # one that raises stops none
threading.Thread(target=time.sleep, args=(60,)).start()   # not joined: no 60 s wait
print(left, end="")                          # buffered: flushed before the exit
sys.stderr.write("bye")
end_process(7)
print("never")
"""


def test_a_worker_ends_at_once_its_hooks_run_and_its_output_flushed():
    """harness.process_end.end_process, with which a worker and a lowering process end: the
    exit status given, the hooks a kernel module registered (maxtext_fixed's temporary folder)
    run, stdout and stderr flushed, no thread waited for."""
    out = subprocess.run([sys.executable, "-c", END_PROCESS], capture_output=True, text=True,
                         timeout=30, cwd=ROOT)
    assert out.returncode == 7, out.stderr[-2000:]
    assert out.stderr == "bye" and out.stdout and "never" not in out.stdout
    assert not Path(out.stdout).exists(), out.stdout


EXITS = """
import os
import harness
from harness.sut.dot_product import dot_product


def ends_the_process(q, k, v, segment_ids, *, causal, scale):
    os._exit(0)


harness.register_kernel("ends_the_process", ends_the_process, dtypes=("float32",))
"""


def test_a_kernel_calling_os_exit_in_the_runs_own_process_is_its_error(tmp_path):
    """From an adversarial review: a kernel calling os._exit(0) while traced, in the run's own
    process (the CLI's and pytest's on CPUs), ended the run with status 0 and its report
    unwritten: green. Now its error, the run red, and the report whole."""
    out = _run_module(tmp_path, EXITS, "ends_the_process,dot_product", ONE)
    assert out.returncode == 1, out.stdout[-3000:] + out.stderr[-3000:]
    header, records = _records(tmp_path / "r")
    assert header["state"] == "finished"
    ended = [r for r in records if r["kernel"] == "ends_the_process"]
    assert [r["outcome"] for r in ended] == ["error"]
    assert "the kernel called os._exit(0)" in ended[0]["message"], ended[0]["message"]
    assert {r["outcome"] for r in records if r["kernel"] == "dot_product"} <= {"ok", "not run"}
    module = tmp_path / "kernels.py"
    pyt = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-p", "no:xdist", str(ROOT / "cases" / "test_matrix.py"),
                          "--kernel-module", str(module), "--kernels", "ends_the_process",
                          "--cases", ONE, "--no-leak-probe", "--report-dir", str(tmp_path / "p")],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert pyt.returncode == 1 and "os._exit(0)" in pyt.stdout, pyt.stdout[-3000:]
    # Every matrix test deselected: the folder holding that report is said to be left as is
    # (under xdist too, whose controller collects nothing).
    pyt = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-n", "2", str(ROOT / "cases" / "test_matrix.py"),
                          "--kernel-module", str(module), "--kernels", "ends_the_process",
                          "--cases", ONE, "-k", "not ends_the_process",
                          "--report-dir", str(tmp_path / "p")],
                         cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert "every matrix test deselected" in pyt.stdout and "not written" in pyt.stdout, \
        pyt.stdout[-3000:]


def test_a_declaration_that_exits_or_skips_is_its_authors_mistake():
    """From an adversarial review: constraints calling sys.exit(0) ended the CLI's run with
    status 0 (a wrong kernel's failures unwritten); expect calling pytest.skip read '2 skipped'
    in pytest. Both are a mistake of one line naming the kernel and the declaration."""
    import pytest as pt
    from harness.errors import UsageError
    from harness.kernels.kernel import Kernel
    from harness.model.suites import suite_cases
    from harness.sut.dot_product import dot_product
    case = suite_cases("smoke")[0]
    for how in (lambda *a: sys.exit(0), lambda *a: pt.skip("x")):
        kernel = Kernel("declares", dot_product, constraints=how)
        with pt.raises(UsageError, match="kernel declares: constraints"):
            kernel._reasons(kernel.constraints, "constraints(case, platform)", case, None)
