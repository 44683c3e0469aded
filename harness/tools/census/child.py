"""One isolation group's bench, versions and reproducers, in a process of its own:
`python -m harness.tools.census.child SPEC.json` (written by harness.tools.census.command:
the census's options, the run's, and the group), so that no two clashing libraries ever share
a process."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def main(argv: list[str]) -> int:
    from harness.engine.options import RunOptions
    from harness.engine.compilation_cache import enable_compilation_cache
    from harness.engine.registry import (
        load_kernel_module,
        mark_absl_flags_parsed,
        select_kernels,
    )
    from harness.errors import UsageError
    from harness.tools.census.command import after_run
    from harness.tools.census.options import CensusOptions
    if len(argv) != 1:
        print("usage: python -m harness.tools.census.child SPEC.json (started by the census)",
              file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    try:
        census = CensusOptions.from_json(spec["census"])
        run = RunOptions.from_json(spec["run"])
        mark_absl_flags_parsed()
        for path in run.kernel_modules:
            load_kernel_module(path)
        enable_compilation_cache(run.cache_dir)
        return after_run(census, run, select_kernels(list(run.kernels)), spec["group"])
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
