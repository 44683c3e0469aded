"""The nightly fanned out over runners (.github/workflows/nightly-gpu.yml), simulated on the CPU:
N shard processes (`--shard I/N`, as each runner runs), one merge, and the merged records are
those of one unsharded run, record for record (verdict, outcome, errors); the merged report
selects what the unsharded run selected, so a shard that never reports is a regression against
a baseline of the whole suite."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SELECT = ("--kernels", "dot_product,canary_ignores_segments",
          "--cases", "packed/random-b4-t256-h4kv2*,unaligned/odd-b4-t256-h4kv2*,"
                     "padded/between-b4-t256-h4kv2*")


def _harness(*args):
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=900, env=dict(os.environ))


def _records(path):
    from harness.store import report_file as rec
    header, records = rec.read(path)
    return header, {r.key: (r.verdict, r.outcome, r.max_abs_err, r.ratio) for r in records}


def test_shards_merged_are_one_run_and_a_lost_shard_regresses(tmp_path):
    whole = _harness("run", *SELECT, "--report-dir", str(tmp_path / "whole"))
    assert whole.returncode == 0, whole.stdout[-2000:] + whole.stderr[-2000:]
    parts = []
    for i in (1, 2, 3):
        part = tmp_path / f"part-{i}"
        out = _harness("run", *SELECT, "--shard", f"{i}/3", "--report-dir", str(part))
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        parts.append(str(part))
    merged = _harness("merge", str(tmp_path / "merged"), *parts)
    assert merged.returncode == 0, merged.stdout[-2000:] + merged.stderr[-2000:]
    whole_header, whole_records = _records(tmp_path / "whole")
    merged_header, merged_records = _records(tmp_path / "merged")
    assert merged_records == whole_records
    assert merged_header["selection"] == whole_header["selection"]
    same = _harness("compare", str(tmp_path / "merged"), str(tmp_path / "whole"))
    assert same.returncode == 0 and "no regression" in same.stdout, same.stdout[-2000:]
    # A runner that never reported: its pairs are missing, and that is a regression.
    lost = _harness("merge", str(tmp_path / "lost"), *parts[:2])
    assert lost.returncode == 0, lost.stdout[-2000:]
    gone = _harness("compare", str(tmp_path / "lost"), str(tmp_path / "whole"))
    assert gone.returncode == 1 and "REGRESSION" in gone.stdout, gone.stdout[-2000:]
