"""Where a harness command's main thread spends its wall time: a sampling profiler (standard
library only, so it runs on a GPU runner where nothing can be installed).

    python scripts/sample_profile.py OUT.txt run --suite nightly --report-dir DIR

Every 10 ms a background thread looks at the main thread's Python stack; OUT.txt lists the
functions by the share of samples they were on the stack (inclusive) and at its top (self:
where the thread was, including C calls it waits in, such as block_until_ready). Overhead is
well under 1% of the run.
"""
from __future__ import annotations

import sys
import threading
from collections import Counter

INTERVAL_S = 0.01
TOP = 45


def _where(code) -> str:
    path = code.co_filename
    for marker in ("/site-packages/", "/harness/", "/lib/python"):
        if marker in path:
            path = path[path.index(marker) + 1:]
            break
    return f"{code.co_name} ({path}:{code.co_firstlineno})"


def main() -> int:
    if len(sys.argv) < 3:
        print(__doc__, file=sys.stderr)
        return 2
    out_path, argv = sys.argv[1], sys.argv[2:]
    main_id = threading.main_thread().ident
    inclusive, top, samples, stop = Counter(), Counter(), [0], threading.Event()

    def sample():
        while not stop.wait(INTERVAL_S):
            frame = sys._current_frames().get(main_id)
            if frame is None:
                continue
            samples[0] += 1
            top[_where(frame.f_code)] += 1
            seen = set()
            while frame is not None:
                key = _where(frame.f_code)
                if key not in seen:
                    seen.add(key)
                    inclusive[key] += 1
                frame = frame.f_back

    sampler = threading.Thread(target=sample, daemon=True, name="sampler")
    sampler.start()
    from harness.cli import main as cli
    try:
        return cli(argv)
    finally:
        stop.set()
        sampler.join()
        n = max(samples[0], 1)
        lines = [f"{samples[0]} samples of the main thread, every {INTERVAL_S * 1e3:.0f} ms "
                 f"(~{samples[0] * INTERVAL_S:.0f} s)", "", "inclusive (on the stack):"]
        lines += [f"  {100 * c / n:5.1f}%  {k}" for k, c in inclusive.most_common(TOP)]
        lines += ["", "self (top of the stack):"]
        lines += [f"  {100 * c / n:5.1f}%  {k}" for k, c in top.most_common(TOP)]
        with open(out_path, "w") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
