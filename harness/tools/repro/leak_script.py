"""The script for a leak-probe failure: the inputs drawn as the harness draws them, the kernel's
out, dq, dk and dv, then the same with the other segments' and the padding's inputs redrawn (the
harness's groups): a segment whose results change at all reads tokens that are not its own."""
from __future__ import annotations

from harness.judge import judging, leak_probe
from harness.judge.record import Record
from harness.kernels.kernel import Kernel
from harness.tools.repro.text import ScriptParts, comment_lines, number_literal
from harness.tools.repro.trials import Trial

_LEAK_MAIN = '''

def program(q, k, v, segment_ids, cotangent):
    """The kernel's out and, with a backward pass, dq, dk, dv (jax.vjp)."""
    if not BACKWARD:
        return (kernel_under_test(q, k, v, segment_ids),)
    out, vjp = jax.vjp(lambda q, k, v: kernel_under_test(q, k, v, segment_ids), q, k, v)
    return (out, *vjp(cotangent.astype(out.dtype)))


def perturbed(inputs, index, redraw):
    """The inputs with the `redraw` tokens' q, k, v and cotangent drawn afresh (standard normal,
    jax.random from the key of the seed, the probe's salt and the group's index; the cotangent
    zero at padding), every other token's as it was."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(SEED), @PERTURB_SALT@), index)
    valid = (SEGMENT_IDS > 0)[:, :, None, None]
    arrays = []
    for i, (x, key_i) in enumerate(zip(inputs, jax.random.split(key, 4))):
        fresh = jax.random.normal(key_i, x.shape, jnp.float32)
        if i == 3:  # the cotangent stays zero at padding
            fresh = jnp.where(valid, fresh, 0.0)
        arrays.append(jnp.where(redraw[:, :, None, None], fresh.astype(x.dtype), x))
    return arrays


def main():
    names = ["out", "dq", "dk", "dv"] if BACKWARD else ["out"]
    q, k, v, cotangent, _ = draw_inputs()
    segment_ids = jnp.asarray(SEGMENT_IDS)
    lowered = jax.jit(program).lower(q, k, v, segment_ids, cotangent)
    device = jax.devices()[0]
    # Bitwise comparisons need a reproducible build: XLA's deterministic ops on GPUs.
    compiled = (lowered.compile(compiler_options={"xla_gpu_deterministic_ops": True})
                if device.platform == "gpu" else lowered.compile())

    def run(q, k, v, ct):
        return [np.asarray(jnp.asarray(x, jnp.float32)) for x in compiled(q, k, v, segment_ids, ct)]

    def changed(a, b):  # [B, T]: any value of the token differs (NaN equal to NaN)
        return ((a != b) & ~(np.isnan(a) & np.isnan(b))).any(axis=(2, 3))

    valid = SEGMENT_IDS > 0
    base = run(q, k, v, cotangent)
    unstable = set()
    for _ in range(2):  # only what reproduces run to run on valid tokens can be probed
        again = run(q, k, v, cotangent)
        unstable |= {n for n, a, b in zip(names, base, again) if (changed(a, b) & valid).any()}
    probed = [i for i, n in enumerate(names) if n not in unstable]
    # The harness's groups (harness.judge.leak_probe.groups): segments by colour, number + row
    # modulo COLOURS (2, or 6 in the four groups of GROUPS_OF_COLOUR), then the padding.
    colour = (SEGMENT_IDS + np.arange(SEGMENT_IDS.shape[0])[:, None]) % COLOURS
    if COLOURS == 2:
        groups = [("segments of one colour", valid & (colour == 1)),
                  ("segments of the other colour", valid & (colour == 0))]
    else:
        groups = [(f"group {g + 1} of 4", valid & np.isin(
            colour, [c for c, pair in enumerate(GROUPS_OF_COLOUR) if g in pair])) for g in range(4)]
    groups.append(("padding", ~valid))
    runs = [(group, redraw, run(*perturbed((q, k, v, cotangent), index, redraw)))
            for index, (group, redraw) in enumerate(g for g in groups if g[1].any())]

    print(f"{KERNEL_NAME}: leak probe on {CASE_ID}")
    print(f"jax {jax.__version__}, {device.platform} ({device.device_kind})")
    if unstable:
        print(f"not reproducible run to run, not probed: {', '.join(sorted(unstable))}")
    failing = []
    for row, number, start, stop, harness_verdict in SEGMENTS:
        leaked, first, biggest, by = set(), [], 0.0, []
        for group, redraw, other in runs:
            if redraw[row, start:stop].any():
                continue  # this segment was redrawn in that run
            for i in probed:
                tokens = np.flatnonzero(changed(base[i], other[i])[row, start:stop])
                if tokens.size:
                    leaked.add(names[i])
                    first.append(start + int(tokens[0]))
                    change = np.abs(base[i] - other[i])[row, start:stop]
                    biggest = max(biggest, float(np.nanmax(change)))
                    by.append(group)
        label = f"r{row}s{number}"
        if leaked:
            failing.append(label)
            print(f"{label:8s} tokens {start}..{stop - 1}: LEAK in {', '.join(n for n in names if n in leaked)} "
                  f"(first token {min(first)}, max change {biggest:.4g}, redrawn: "
                  f"{', '.join(dict.fromkeys(by))}); harness: {harness_verdict}")
        else:
            print(f"{label:8s} tokens {start}..{stop - 1}: bitwise unchanged; "
                  f"harness: {harness_verdict}")
    if failing:
        print(f"@FAILED@ {KERNEL_NAME} leaks across segments on {len(failing)} of {len(SEGMENTS)}"
              f" segments: {', '.join(failing)}")
        return 1
    print(f"PASSED: no segment of {KERNEL_NAME} moves when the rest of its row is redrawn")
    return 0
'''


def found(worst: Record) -> str:
    """The worst segment's numbers, for the script's header."""
    return (f"changed by {number_literal(worst.max_abs_err)} (bitwise probe, no tolerance) "
            f"from token {worst.worst_token}")


def numbers(worst: Record) -> str:
    """The worst segment's numbers, for the command's summary."""
    return f"changed by {worst.max_abs_err:.4g} when other tokens were redrawn"


def _verdict(record: Record) -> str:
    """The harness's leak-probe verdict on a segment, with its message where it failed."""
    return record.verdict + (f" ({record.message})" if judging.failed(record) else "")


def parts(kernel: Kernel, trial: Trial, check: str) -> ScriptParts:
    """The leak script's own parts (`check` is the leak probe's)."""
    rows = [f"    ({seg.row}, {seg.number}, {seg.start}, {seg.stop}, "
            f"{_verdict(trial.record(check, seg.row, seg.number))!r}),"
            for seg in trial.case.segments]
    return ScriptParts(
        found=found(trial.failing(check)[0]),
        method=("The script draws the case's inputs from its seed with numpy (the harness's own "
                "draw), runs the kernel's out, dq, dk and dv, then runs it again with the other "
                "segments' and the padding's inputs redrawn: a segment whose results change at "
                "all reads tokens that are not its own."),
        imports=["import os", "import sys", "",
                 "# Transformer Engine reads this while tracing: its deterministic algorithms, "
                 "for bitwise\n# comparisons.",
                 "os.environ.setdefault(\"NVTE_ALLOW_NONDETERMINISTIC_ALGO\", \"0\")", ""],
        segments_comment="\n".join(comment_lines(
            "Per segment: row, segment number, first token, end (exclusive), and the harness's "
            "leak-probe verdict on this case.")),
        segment_rows=rows,
        constants=[f"BACKWARD = {kernel.backward!r}",
                   "# The leak probe's colours for these ids, and (six colours) each one's groups",
                   f"COLOURS = {leak_probe.colours(trial.case.segment_ids)}",
                   f"GROUPS_OF_COLOUR = {leak_probe.SIX_COLOURS!r}"],
        inputs_title="inputs",
        body=[_LEAK_MAIN],
    )
