"""python -m harness repro KERNEL CASE_ID: the smallest case that still fails, as a script.

1. Runs the kernel on the case (any case id, not only a suite's) and picks the check to keep
   failing: `--check`, else the first failing tolerance check in the order out, dq, dk, dv, else
   the leak probe. A kernel that passes everything is a usage error.
2. Shrinks the case greedily, as a `custom/rows` case: one row, then fewer rows; fewer segments
   (half of them, a quarter, ..., one), less padding, shorter segments (to one token, halved, one
   less); then the smallest shape at once (one head, the smallest head_dim, no trailing padding:
   each new shape compiles anew, which costs seconds), else step by step: a shorter row (trailing
   padding trimmed, to a length the kernel takes), fewer heads (MHA with one head first, GQA kept
   only where needed), a smaller head_dim (among the kernel's). A candidate is kept when the same
   check still fails (verdict fail) on some segment, against a tensor that is not zero everywhere;
   candidates the kernel does not declare are never run. dtype, causal flag and seed stay. At
   most MAX_RUNS kernel runs.
3. Writes a standalone script: the kernel (its `standalone` source, or an import of its
   function), the shrunk segment ids as a literal, the inputs redrawn with numpy from the case's
   seed (the harness's own draw, so the tolerances below apply), a float32 dense reference, and
   the failing check per segment against the tolerance the harness computed on the shrunk case.
   It exits 1 while the failure shows, 0 once the kernel is fixed.
4. Runs the script with plain python in an empty folder (no PYTHONPATH into this repository) and
   says whether it reproduced the failure.

The package: `trials` (the kernel's runs for one check), `shrink` (the moves and the greedy
loop), `source` (the kernel as script source), `script` (the script's common frame) with its two
writers, `tolerance_script` (out, dq, dk, dv) and `leak_script` (the leak probe), `text` (their
shared pieces), and `command` (main).
"""
from harness.tools.repro.command import main

__all__ = ["main"]
