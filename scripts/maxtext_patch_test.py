"""Runs the test that the MaxText patch adds (tests/unit/cudnn_flash_jax_packing_test.py, from
patches/maxtext-<version>/cudnn_flash_jax_packing_test.patch) against the installed maxtext with
the patch applied, leaving the installed files untouched.

The test file is written out of its patch into a scratch folder; MaxText's
`maxtext.layers.attention_op` is then the patched module (harness.kernels.maxtext_fixed) in this
process, and pytest runs the file. On a GPU every test runs (the packed-layout ones on Hopper and
newer). Elsewhere the GPU tests skip with their reason ("Requires a GPU.": cudnn_flash_jax against
dot_product, packed layout and segment mask, without and with a sliding window) and the rest
run: the lowering of segment ids, the configuration checks (soft cap, chunks, empty windows
refused where a GPU kernel would not apply them; sinks refused by cudnn_flash_jax) and the GPU
flash path's window and chunk masks on tokamax's XLA reference. On a CPU: 16 passed, 16 skipped.

Usage (from the project root, with maxtext installed; Python >= 3.12):
    python scripts/maxtext_patch_test.py [pytest options, e.g. -k packed]
"""
from __future__ import annotations

import atexit
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TEST_PATCH = "cudnn_flash_jax_packing_test.patch"
TEST_FILE = "tests/unit/cudnn_flash_jax_packing_test.py"


def main(argv: list[str]) -> int:
    import pytest

    import maxtext.layers
    from harness.kernels import maxtext_fixed

    fixed = maxtext_fixed.patched_module()
    sys.modules[maxtext_fixed.ORIGINAL_MODULE] = fixed
    maxtext.layers.attention_op = fixed
    root = Path(tempfile.mkdtemp(prefix="maxtext-patch-test-"))
    atexit.register(shutil.rmtree, root, True)
    maxtext_fixed.apply_to_tree(maxtext_fixed.patch_path().parent / TEST_PATCH, root)
    print(f"maxtext.layers.attention_op: {fixed.__file__} (patched); test: {root / TEST_FILE}",
          flush=True)
    return pytest.main([str(root / TEST_FILE), f"--rootdir={root}", "-p", "no:cacheprovider",
                        "-rs", "-W", "ignore::pytest.PytestUnknownMarkWarning",
                        "-W", "ignore::pytest.PytestAssertRewriteWarning", *argv])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
