"""A repro script's common frame: header (what was found, how to run it, where it was made),
imports, the kernel's source, the shrunk case as literals, the inputs' draw, then the parts of
the script for the failing check (a tolerance check's or the leak probe's, from their writers)
and the line that runs main()."""
from __future__ import annotations

import platform as _platform
from pathlib import Path

from harness.judge.vocabulary import LEAK
from harness.kernels.kernel import Kernel
from harness.model.case import Case
from harness.tools.repro import leak_script, tolerance_script
from harness.tools.repro.source import kernel_source
from harness.tools.repro.text import (
    CHECK_WORDS,
    ScriptParts,
    array_literal,
    comment_lines,
)
from harness.tools.repro.trials import Trial

# The script's last line when the failure shows; `verify` looks for it besides exit status 1
# (which an uncaught exception also gives).
FAILED_MARK = "FAILED:"


_INPUTS = '''
def draw_inputs():
    """Standard-normal q, k, v drawn from SEED and rounded to DTYPE (the draw attention-harness
    makes for this case; v with VALUE_DIM). Padding positions hold larger values (x8) that a
    correct kernel never reads; the output cotangent (for gradients) is zero there. With SINKS,
    one learnable logit per query head (float32), drawn last."""
    dtype = jnp.dtype(DTYPE)
    rng = np.random.default_rng([SEED, @INPUT_SALT@])
    batch, seq = SEGMENT_IDS.shape
    valid = (SEGMENT_IDS > 0)[:, :, None, None]

    def draw(heads, dim=HEAD_DIM):
        x = rng.standard_normal((batch, seq, heads, dim), dtype=np.float32)
        poison = @POISON@ * rng.standard_normal(x.shape, dtype=np.float32)
        return np.where(valid, x, poison).astype(dtype)

    q, k, v = draw(HEADS), draw(KV_HEADS), draw(KV_HEADS, VALUE_DIM)
    cotangent = np.where(valid, rng.standard_normal((batch, seq, HEADS, VALUE_DIM),
                                                    dtype=np.float32), 0.0).astype(dtype)
    sinks = rng.standard_normal(HEADS, dtype=np.float32) + @SINK_MEAN@ if SINKS else None
    return q, k, v, cotangent, sinks


def kernel_under_test(q, k, v, segment_ids, sinks=None):
    extra = {} if sinks is None else {"sinks": sinks}
    return kernel(q, k, v, segment_ids, causal=CAUSAL, scale=SCALE, **KERNEL_KWARGS, **extra)


def positions_in_segments(segment_ids):
    """[batch, seq]: each token's position within its segment (its index in padding runs)."""
    seg = np.asarray(segment_ids)
    idx = np.broadcast_to(np.arange(seg.shape[1]), seg.shape)
    new = np.concatenate([np.ones((seg.shape[0], 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    return idx - np.maximum.accumulate(np.where(new, idx, 0), axis=1)
'''

# Exit status 1 is the failure showing (with its FAILED line): a script that cannot run here
# (too few devices for the kernel's mesh) or raises before it judges exits 2, never 1 (a
# sharded kernel's script on one device exited 1 from its mesh's error, or 0 where its mesh
# took the devices there were: a cold review).
_FOOTER = '''

if __name__ == "__main__":
    if len(jax.devices()) < MIN_DEVICES:
        print(f"CANNOT RUN: {KERNEL_NAME} spans {MIN_DEVICES} devices, {len(jax.devices())} "
              f"visible here; exit status 2, not a verdict")
        sys.exit(2)
    try:
        status = main()
    except Exception:
        import traceback
        traceback.print_exc()
        print("CANNOT RUN: the script raised before it could judge (above); exit status 2, "
              "not a verdict")
        sys.exit(2)
    sys.exit(status)
'''

# A kernel that spans several devices: on CPUs XLA makes that many host devices when told
# before jax starts (GPUs ignore the flag).
_HOST_DEVICES = '''import os
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=@N@").strip()
'''


def writer(check: str):
    """The module that writes the script's own parts for `check`."""
    return leak_script if check == LEAK.name else tolerance_script


def _needs(kernel: Kernel) -> str:
    needs = "jax and numpy"
    if kernel.requires:
        needs += " (and " + ", ".join(kernel.requires) + ")"
    elif kernel.standalone is None:
        needs += " (and the kernel's own module, imported below)"
    return needs


def _header(kernel: Kernel, original: Case, trial: Trial, check: str, runs: int, path: Path,
            parts: ScriptParts) -> list[str]:
    """The shebang and the header comment."""
    import jax

    from harness.engine.environment import git_state, package_version
    case, worst = trial.case, trial.failing(check)[0]
    commit, dirty = git_state()
    device = jax.devices()[0]
    label = f"r{worst.row}s{worst.segment}"
    tokens = f"{worst.start}..{worst.start + worst.length - 1}"
    return ["#!/usr/bin/env python3"] + comment_lines(
        f"Standalone reproduction: {kernel.name} fails the `{check}` check on a packed "
        "sequence (several documents per row told apart by int32 segment ids 1..M, 0 = padding)."
        "\n\n"
        f"What was found, by attention-harness (`python -m harness repro {kernel.name} "
        f"{original.id}`):\n"
        f"  kernel   {kernel.name}\n"
        f"  check    {check}: {CHECK_WORDS[check]}\n"
        f"  segment  {label} (row {worst.row}, segment {worst.segment}, tokens {tokens}): "
        f"{parts.found}\n"
        f"  case     {case.id}\n"
        f"           (batch {case.batch}, seq_len {case.seq_len}, heads {case.heads}, kv "
        f"heads {case.kv_heads}, head_dim {case.head_dim}, {case.dtype}, "
        f"{'causal' if case.causal else 'bidirectional'}, seed {case.seed})\n"
        f"  from     {original.id}, shrunk in {runs} kernel runs\n"
        f"  harness  git commit {commit or 'unknown'}"
        f"{' (with uncommitted changes)' if dirty else ''}\n"
        "\n"
        f"Run it with plain python; it needs {_needs(kernel)}:\n"
        f"    python {path.name}\n"
        "Exit status 1: the failure shows (a line starting with FAILED says where); 0: every "
        "segment passes (the kernel is fixed); 2: it could not run here (too few devices, or "
        "it raised: the output says which).\n"
        "\n"
        f"Made with Python {_platform.python_version()}, jax {jax.__version__}, jaxlib "
        f"{package_version('jaxlib') or 'unknown'}, on {device.platform} "
        f"({device.device_kind}).\n"
        "\n"
        + parts.method)


def _case_block(kernel: Kernel, case: Case, check: str, parts: ScriptParts) -> str:
    """The shrunk case as constants: ids, shape, dtype, flags, and the per-segment table."""
    from harness.engine.program_functions import feature_arguments
    kwargs = {"max_segments": case.max_segments} if kernel.takes_max_segments else {}
    kwargs.update(feature_arguments(case))   # the case's features, handed over as the harness does
    f = case.features
    return "\n".join([
        "# ----- the case (shrunk by attention-harness) "
        + "-" * 52,
        f"KERNEL_NAME = {kernel.name!r}",
        f"CHECK = {check!r}",
        f"CASE_ID = {case.id!r}",
        "# int32 [batch, seq]: the segments of each row numbered 1..M, 0 = padding",
        "SEGMENT_IDS = np.array([",
        array_literal(case.segment_ids),
        "], dtype=np.int32)",
        f"HEADS, KV_HEADS, HEAD_DIM = {case.heads}, {case.kv_heads}, {case.head_dim}",
        f"DTYPE = {case.dtype!r}",
        f"CAUSAL = {case.causal!r}",
        f"SCALE = {case.scale!r}  # 1 / sqrt(HEAD_DIM)",
        f"SEED = {case.seed!r}",
        "# Attention features (None: not asked for): a window of keys from LEFT before to RIGHT",
        "# after each query, by position within its segment; a soft cap of the scores; chunks",
        "# counted from CHUNKS_FROM's start; a learnable sink logit per query head; the value's",
        "# head dim.",
        f"WINDOW = {None if f.window is None else tuple(f.window)!r}",
        f"SOFTCAP = {f.softcap!r}",
        f"CHUNK = {f.chunk!r}",
        f"CHUNKS_FROM = {kernel.chunk_convention!r}",
        f"SINKS = {bool(f.sinks)!r}",
        f"VALUE_DIM = {case.value_dim!r}",
        f"KERNEL_KWARGS = {kwargs!r}",
        f"MIN_DEVICES = {kernel.min_devices!r}  # the devices its mesh spans",
        *parts.constants,
        parts.segments_comment,
        "SEGMENTS = [",
        *parts.segment_rows,
        "]",
    ])


def _fill_marks(text: str) -> str:
    """The harness's own constants in place of the templates' marks."""
    from harness.judge.leak_probe import PERTURB_SALT
    from harness.model.case import INPUT_SALT, PADDING_POISON_SCALE, SINK_MEAN
    for mark, value in (("@INPUT_SALT@", hex(INPUT_SALT)), ("@POISON@", repr(PADDING_POISON_SCALE)),
                        ("@PERTURB_SALT@", hex(PERTURB_SALT)), ("@SINK_MEAN@", repr(SINK_MEAN))):
        text = text.replace(mark, value)
    return text


def script_text(kernel: Kernel, original: Case, trial: Trial, check: str, runs: int,
                path: Path) -> tuple[str, bool]:
    """(the script, whether it needs the harness importable: a harness-defined kernel)."""
    source, needs_harness = kernel_source(kernel)
    parts = writer(check).parts(kernel, trial, check)
    header = _header(kernel, original, trial, check, runs, path, parts)
    devices = ([_HOST_DEVICES.replace("@N@", str(kernel.min_devices))]
               if kernel.min_devices > 1 else [])
    imports = parts.imports + devices + ["import jax", "import jax.numpy as jnp",
                                         "import numpy as np"]
    title = f"# ----- {parts.inputs_title} "
    chunks = [
        "\n".join(header) + "\n\n" + "\n".join(imports),
        "# ----- the kernel under test: kernel(query, key, value, segment_ids, *, causal, scale)"
        " --------\n# MaxText layout: [batch, seq, heads, head_dim]; the output is shaped like "
        "the query.\n" + source,
        _case_block(kernel, trial.case, check, parts),
        title + "-" * (100 - len(title)) + "\n" + _INPUTS,
        *(chunk.replace("@FAILED@", FAILED_MARK) for chunk in parts.body),
        _FOOTER,
    ]
    text = _fill_marks("\n\n\n".join(c.strip("\n") for c in chunks) + "\n")
    compile(text, str(path), "exec")
    return text, needs_harness
