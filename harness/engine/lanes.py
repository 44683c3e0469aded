"""pytest's matrix, run ahead of its tests by the CLI's engine.

The CLI runs a suite in one process that traces and compiles every program ahead, on every
core, while the device runs what is ready. A pytest test that compiles its own programs when it
starts waits on the compiler most of the time (one H200, the nightly: 200 s with two workers,
against 126 s for the CLI), and a second GPU does not shorten that. So pytest hands the pairs
it selected to that engine when its collection is done: lanes of worker processes
(harness.engine.workers.run_group, `python -m harness run --worker-pairs`: each isolation
group in turn; a worker that dies costs an error record for the pair it was running, and a
fresh worker takes the rest), one lane per GPU with --gpu-per-worker, else one lane. Each test
waits for its pair's records in the lanes' folders and judges them as if it had run the pair
itself; a pair no lane ran (the lanes were stopped or failed) runs inside its test, as with
`--in-test`.

Files, under the run's parts folder (lanes/):
- `plan.json`: written by pytest's controller once the lanes start ({"lanes": N}), or
  {"lanes": 0} where it starts none; tests wait for it.
- `lane-I/<group>-<attempt>/report/`: a worker's report (records, traces) and the pairs it
  finished (isolation.FINISHED_FILE, each line written after the pair's records, with their
  count: a test takes its pair once it has read that many). A worker's last act rewrites its
  report's header line, as a new file moved over the old one: a reader sees one or the other
  whole, and reads on in the new one where it was, shifted by the header's change in length.
- `lane-I/crashes.jsonl`: pairs a worker died on, with the reason; `lane-I/done.json` at the
  lane's end ({"ok": true}, or {"error": ...}).
"""
from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from pathlib import Path

from harness.engine import workers as isolation
from harness.engine.main_parts import parts_wanted, split
from harness.judge.record import first_line

PLAN = "plan.json"
CRASHES = "crashes.jsonl"
DONE = "done.json"
PLAN_WAIT_S = 600     # how long a test waits for the controller's plan before running itself
# How long a finished session waits for its lanes to end on their own (Lanes.stop): a worker's
# programs close within programs.CLOSE_WAIT_S.
FINISH_WAIT_S = 150.0


class Lanes:
    """pytest's controller side: the lanes' threads, each running its share of the pairs in
    workers (its isolation groups several at a time, sharing the lane's GPU: harness.engine.device_shares.shares)."""

    def __init__(self, workdir: Path, options: list[str], gpus: list[str | None]):
        self.workdir, self.options, self.gpus = Path(workdir), options, gpus
        self.threads: list[threading.Thread] = []
        self.stopping = threading.Event()

    def start(self, pairs: list) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        shares = split(pairs, len(self.gpus)) if pairs else []   # whole shapes to a lane
        for index, (gpu, share) in enumerate(zip(self.gpus, shares)):
            thread = threading.Thread(target=self._lane, args=(index, gpu, share), daemon=True,
                                      name=f"lane-{index}")
            thread.start()
            self.threads.append(thread)
        (self.workdir / PLAN).write_text(json.dumps({"lanes": len(self.threads)}))

    def _lane(self, index: int, gpu: str | None, share: list) -> None:
        lane = self.workdir / f"lane-{index}"
        lane.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        crashes = (lane / CRASHES).open("a")
        written = threading.Lock()       # the groups' threads share the file

        def on_crash(kernel, case_id, why):
            if self.stopping.is_set():   # killed by stop(): not a crash of its pair
                raise isolation.Stopped()
            with written:
                crashes.write(json.dumps({"kernel": kernel, "case_id": case_id, "why": why})
                              + "\n")
                crashes.flush()

        groups = isolation.groups(dict.fromkeys(k for k, _ in share))
        status: dict = {"ok": True}
        futures, again = [], None
        try:
            # The groups as the CLI runs them (the main group in parts on GPUs with
            # --main-workers, and what of them lacked memory again at the end).
            pool, futures = isolation.start_groups(
                {g: [(k.name, c.id) for k, c in share if k in members]
                 for g, members in groups.items()},
                lane, self.options, env=env, on_crash=on_crash, stop=self.stopping,
                echo=lambda line: None, parts=parts_wanted(self.options))
            pool.shutdown(wait=True)
            # Every group has ended: a group's real error wins over another's being stopped.
            errors = [f.exception() for f in futures if f.exception() is not None]
            if not errors:
                try:
                    again = isolation.run_deferred(futures, lane, self.options, env=env,
                                                   on_crash=on_crash, stop=self.stopping,
                                                   echo=lambda line: None)
                except isolation.Stopped as exc:
                    errors = [exc]
            real = [e for e in errors if not isinstance(e, isolation.Stopped)]
            if real:
                status = {"error": f"{type(real[0]).__name__}: {real[0]}"}
            elif errors:
                status = {"stopped": True}
        except BaseException as exc:  # noqa: BLE001 - the tests run their pairs themselves
            status = {"error": f"{type(exc).__name__}: {exc}"}
        finally:
            crashes.close()
            # The pairs run again after a broken capture, for the report's header.
            status["run_again"] = isolation.run_again_entries(futures, again)
            (lane / DONE).write_text(json.dumps(status))

    def stop(self, finish_wait_s: float = 0.0) -> None:
        """Stops the lanes, killing their live workers; after up to `finish_wait_s` for the
        lanes to end on their own (a session whose tests all took their records: a worker
        past its last pair still closes its programs and writes its header's last facts,
        and killed then, it reads as a worker that died before writing them)."""
        deadline = time.monotonic() + finish_wait_s
        for thread in self.threads:
            thread.join(timeout=max(0.0, deadline - time.monotonic()))
        self.stopping.set()      # before the kill: no worker starts after it (run_group)
        isolation.stop_live()
        for thread in self.threads:
            thread.join(timeout=30)

    def errors(self) -> list[str]:
        """Why lanes failed (a worker refusing its pairs, ...), one line each."""
        out = []
        for done in sorted(self.workdir.glob(f"lane-*/{DONE}")):
            status = json.loads(done.read_text())
            if "error" in status:
                out.append(f"{done.parent.name}: {first_line(status['error'], 300)}")
        return out

    def run_again(self) -> list[dict]:
        """The pairs the lanes ran again in a fresh worker after a broken capture
        (harness.engine.capture), as the CLI's header lists them."""
        out = []
        for done in sorted(self.workdir.glob(f"lane-*/{DONE}")):
            out += json.loads(done.read_text()).get("run_again", [])
        return out

    def report_dirs(self) -> list[Path]:
        return sorted(p.parent for p in self.workdir.glob("lane-*/*/report/report.jsonl"))

    def finish(self, finished: bool) -> tuple[list[dict], list[dict]]:
        """Stops the lanes (`finished`: after up to FINISH_WAIT_S for them to end on their
        own). Returns each lane worker's probe mode, timing and compilation-cache lookups,
        and its process facts as a joined report's `merged_from` keeps them, named
        lane-I/WORKER (the summary's "Worker processes" line, as of the CLI's workers)."""
        from harness.store.merge import source_entry
        self.stop(FINISH_WAIT_S if finished else 0.0)
        headers = self.headers()
        runs = [{"probe_mode": h.get("probe_mode", "default"), "timing": h.get("timing", {}),
                 "compilation_cache": h.get("compilation_cache")} for _, h in headers]
        return runs, [{**source_entry(report, h), "worker": "/".join(report.parts[-3:-1])}
                      for report, h in headers]

    def headers(self) -> list[tuple[Path, dict]]:
        """(report folder, header) of each lane worker that wrote one (a worker killed before
        its header was written has none); the records are not read."""
        from harness.store import report_file as rec
        out = []
        for report in self.report_dirs():
            try:
                out.append((report, rec.read_header(report)))
            except Exception:
                continue
        return out


def no_lanes(workdir: Path) -> None:
    """The controller starts none (nothing to run ahead): the tests run their pairs."""
    Path(workdir).mkdir(parents=True, exist_ok=True)
    (Path(workdir) / PLAN).write_text(json.dumps({"lanes": 0}))


class _Tail:
    """The complete lines a file has gained since the last read. A file whose first line
    changed is a report whose header a worker rewrote at its end (report_file.update_header:
    the same lines after the first): the read goes on where it was, shifted by the header's
    change in length, so no line is read twice."""

    def __init__(self, path: Path):
        self.path, self.offset, self.rest, self.head = path, 0, b"", None

    def lines(self) -> list[dict]:
        try:
            with self.path.open("rb") as f:
                head = f.readline()
                if head.endswith(b"\n") and head != self.head:
                    if self.head is not None:   # read past it already: offset >= its length
                        self.offset += len(head) - len(self.head)
                    self.head = head
                f.seek(self.offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(data)
        *complete, self.rest = (self.rest + data).split(b"\n")
        out = []
        for line in complete:
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError:
                continue
        return out


class LaneResults:
    """A test's side: the records the lanes have finished, read as they come."""

    def __init__(self, workdir: Path, poll_s: float = 0.1):
        self.workdir, self.poll_s = Path(workdir), poll_s
        self.tails: dict[Path, _Tail] = {}
        self.records: dict[tuple, list] = defaultdict(list)
        self.traces: dict[tuple, list] = defaultdict(list)
        self.finished: dict[tuple, int] = {}   # pair -> how many records it wrote
        self.crashes: dict[tuple, str] = {}
        self.lanes: int | None = None

    def _tail(self, path: Path) -> list[dict]:
        if path not in self.tails:
            self.tails[path] = _Tail(path)
        return self.tails[path].lines()

    def _scan(self) -> None:
        from harness.judge.record import Record, Trace
        for lane in sorted(self.workdir.glob("lane-*")):
            for row in self._tail(lane / CRASHES):
                self.crashes[(row["kernel"], row["case_id"])] = row["why"]
            for report in sorted(lane.glob("*/report")):
                # Finished pairs first: their records are complete in what is read after.
                for row in self._tail(report / isolation.FINISHED_FILE):
                    self.finished[(row["kernel"], row["case_id"])] = row.get("records", 1)
                for row in self._tail(report / "report.jsonl"):
                    if row.get("type") == "record":
                        self.records[(row["kernel"], row["case_id"])].append(
                            Record.from_json(row))
                for row in self._tail(report / "traces.jsonl"):
                    if row.get("type") == "trace":
                        self.traces[(row["kernel"], row["case_id"])].append(Trace.from_json(row))

    def _planned(self, deadline: float) -> int:
        while self.lanes is None:
            plan = self.workdir / PLAN
            if plan.exists():
                self.lanes = json.loads(plan.read_text())["lanes"]
            elif time.monotonic() > deadline:
                self.lanes = 0
            else:
                time.sleep(self.poll_s)
        return self.lanes

    def _settled(self, key) -> bool:
        """After the lanes ended: one more full read of every file, and the pair still lacks
        records (never seen; never handed over incomplete)."""
        self.tails.clear()
        self.records.clear()
        self.traces.clear()
        self._scan()
        return len(self.records[key]) < self.finished.get(key, 1)

    def _all_done(self) -> bool:
        return len(list(self.workdir.glob(f"lane-*/{DONE}"))) >= (self.lanes or 0)

    def wait(self, kernel, case):
        """The pair's records (or its crash's error record) once a lane has them; None where no
        lane will run it (the test runs it itself)."""
        from harness.engine.runner import KernelCaseResult
        if not self._planned(time.monotonic() + PLAN_WAIT_S):
            return None
        key = (kernel.name, case.id)
        while True:
            done = self._all_done()     # before the scan: what a lane wrote before it ended
            self._scan()
            if key in self.finished and len(self.records[key]) >= self.finished[key]:
                # The test's own from here: this process keeps no record it handed over
                # (pytest's garbage collections walk what is held); with -n N it still reads,
                # and keeps, the records of the pairs of the other workers' tests.
                return KernelCaseResult(self.records.pop(key), self.traces.pop(key, []))
            if key in self.crashes:
                return KernelCaseResult(isolation.crash_records(
                    [(*key, self.crashes[key])], {kernel.name: kernel}))
            if done and key not in self.finished:
                return None
            if done and self._settled(key):   # every lane ended and its records stay short
                return None
            time.sleep(self.poll_s)
