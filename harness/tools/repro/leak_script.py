"""The script for a leak-probe failure: the inputs drawn as the harness draws them, the kernel's
out, dq, dk and dv, then the same with the other segments' and the padding's inputs redrawn, and
with a window or chunks blocks inside each segment (the harness's groups): a token whose results
change at all although nothing it may depend on was redrawn reads tokens outside its mask."""
from __future__ import annotations

from harness.engine.refusal import gradients_refused
from harness.judge import judging, probe_groups
from harness.judge.record import Record
from harness.kernels.kernel import Kernel
from harness.tools.repro.text import ScriptParts, comment_lines, number_literal
from harness.tools.repro.trials import Trial

_LEAK_MAIN = '''

def program(q, k, v, segment_ids, cotangent, sinks):
    """The kernel's out and, with a backward pass, dq, dk, dv (jax.vjp; the sinks, one logit per
    head shared by every token, are held as they are)."""
    if not BACKWARD:
        return (kernel_under_test(q, k, v, segment_ids, sinks),)
    out, vjp = jax.vjp(lambda q, k, v: kernel_under_test(q, k, v, segment_ids, sinks), q, k, v)
    return (out, *vjp(cotangent.astype(out.dtype)))


def perturbed(inputs, index, redraw):
    """The inputs with the `redraw` tokens' q, k, v and cotangent drawn afresh (standard normal,
    jax.random from the key of the seed, the probe's salt and the group's index; the cotangent
    zero at padding), every other token's as it was."""
    key = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(SEED), @PERTURB_SALT@), index)
    valid = (SEGMENT_IDS > 0)[:, :, None, None]
    # One standard normal draw for the four, cut in order.
    flat = jax.random.normal(key, (sum(x.size for x in inputs),), jnp.float32)
    sizes = np.cumsum([0] + [x.size for x in inputs])
    arrays = []
    for i, x in enumerate(inputs):
        fresh = flat[sizes[i]:sizes[i + 1]].reshape(x.shape)
        if i == 3:  # the cotangent stays zero at padding
            fresh = jnp.where(valid, fresh, 0.0)
        arrays.append(jnp.where(redraw[:, :, None, None], fresh.astype(x.dtype), x))
    return arrays


def redrawn_groups():
    """(name, [batch, seq] tokens redrawn) for each run, as the harness's probe groups them:
    segments by colour (number + r (r + 1) / 2 for row r, modulo COLOURS: 2, or 6 in the four groups of
    GROUPS_OF_COLOUR), the padding, then with WINDOW blocks of left + right + 1 tokens inside
    each segment every 3 (left + right + 1) positions, at two phases, with CHUNK every other
    chunk of each segment, then the others, and CAUSAL without WINDOW each segment from a cut
    to its end."""
    valid = SEGMENT_IDS > 0
    rows = np.arange(SEGMENT_IDS.shape[0])
    colour = (SEGMENT_IDS + (rows * (rows + 1) // 2)[:, None]) % COLOURS
    if COLOURS == 2:
        groups = [("segments of one colour", valid & (colour == 1)),
                  ("segments of the other colour", valid & (colour == 0))]
    else:
        groups = []
        for g in range(4):
            members = [c for c, pair in enumerate(GROUPS_OF_COLOUR) if g in pair]
            groups.append((f"segments of colours {', '.join(str(c + 1) for c in members)} of 6",
                           valid & np.isin(colour, members)))
    groups.append(("padding", ~valid))
    pos = positions_in_segments(SEGMENT_IDS)
    if WINDOW is not None:
        block = WINDOW[0] + WINDOW[1] + 1
        for phase in (0, 3 * block // 2):
            groups.append((f"blocks of {block} inside each segment, every {3 * block} from "
                           f"position {phase} (window)", valid & ((pos - phase) % (3 * block) < block)))
    if CHUNK is not None:
        at = pos if CHUNKS_FROM == "segment" else np.broadcast_to(
            np.arange(SEGMENT_IDS.shape[1]), pos.shape)
        for parity, name in ((1, "odd"), (0, "even")):
            groups.append((f"the {name} chunks of each segment ({CHUNKS_FROM} convention)",
                           valid & ((at // CHUNK) % 2 == parity)))
    if CAUSAL and WINDOW is None:
        # Each segment from a cut on: every other one at its last token, the others at a half,
        # a quarter and three quarters in turn.
        tails = np.zeros(SEGMENT_IDS.shape, bool)
        for n, (row, _, start, stop, _) in enumerate(SEGMENTS):
            length = stop - start
            if length >= 2:
                cut = min(length - 1, max(1, (length - 1, length // 2, length - 1,
                                              length // 4, length - 1, 3 * length // 4)[n % 6]))
                tails[row, start + cut:stop] = True
        groups.append(("each segment's tail from a cut (causal)", tails))
    return [g for g in groups if g[1].any()]


def depends_on():
    """Per tensor class ("query": out and dq; "key": dk and dv), [batch, seq] first and last
    token that each token's values depend on, from the mask (same segment, causal, WINDOW, CHUNK:
    intervals): a query on the keys it reads and itself, a key on the queries that read it and
    the keys those read."""
    batch, seq = SEGMENT_IDS.shape
    q_lo, q_hi = np.tile(np.arange(seq), (batch, 1)), np.tile(np.arange(seq), (batch, 1))
    k_lo, k_hi = q_lo.copy(), q_hi.copy()
    for row, _, start, stop, _ in SEGMENTS:
        i = np.arange(start, stop)
        lo, hi = np.full(stop - start, start), np.full(stop - start, stop - 1)
        if CAUSAL:
            hi = np.minimum(hi, i)
        if WINDOW is not None:
            lo, hi = np.maximum(lo, i - WINDOW[0]), np.minimum(hi, i + WINDOW[1])
        if CHUNK is not None:
            base = start if CHUNKS_FROM == "segment" else 0
            first = base + (i - base) // CHUNK * CHUNK
            lo, hi = np.maximum(lo, first), np.minimum(hi, first + CHUNK - 1)
        q_lo[row, i], q_hi[row, i] = np.minimum(lo, i), np.maximum(hi, i)
        readers_from = start + np.searchsorted(hi, i, side="left")
        readers_to = start + np.searchsorted(lo, i, side="right") - 1
        k_lo[row, i] = np.minimum(np.minimum(lo[readers_from - start], readers_from), i)
        k_hi[row, i] = np.maximum(np.maximum(hi[readers_to - start], readers_to), i)
    return {"query": (q_lo, q_hi), "key": (k_lo, k_hi)}


def main():
    names = ["out", "dq", "dk", "dv"] if BACKWARD else ["out"]
    q, k, v, cotangent, sinks = draw_inputs()
    segment_ids = jnp.asarray(SEGMENT_IDS)
    lowered = jax.jit(program).lower(q, k, v, segment_ids, cotangent, sinks)
    device = jax.devices()[0]
    # Bitwise comparisons need a reproducible build: XLA's deterministic ops on GPUs.
    compiled = (lowered.compile(compiler_options={"xla_gpu_deterministic_ops": True})
                if device.platform == "gpu" else lowered.compile())

    def run(q, k, v, ct):
        return [np.asarray(jnp.asarray(x, jnp.float32))
                for x in compiled(q, k, v, segment_ids, ct, sinks)]

    def changed(a, b):  # [B, T]: any value of the token differs (NaN equal to NaN)
        return ((a != b) & ~(np.isnan(a) & np.isnan(b))).any(axis=(2, 3))

    valid = SEGMENT_IDS > 0
    base = run(q, k, v, cotangent)
    unstable = set()
    for _ in range(2):  # only what reproduces run to run on valid tokens can be probed
        again = run(q, k, v, cotangent)
        unstable |= {n for n, a, b in zip(names, base, again) if (changed(a, b) & valid).any()}
    probed = [i for i, n in enumerate(names) if n not in unstable]
    runs = [(group, redraw, run(*perturbed((q, k, v, cotangent), index, redraw)))
            for index, (group, redraw) in enumerate(redrawn_groups())]
    # In each run, the tokens none of whose dependencies was redrawn must not move.
    deps, rows = depends_on(), np.arange(SEGMENT_IDS.shape[0])[:, None]
    still = []
    for _, redraw, _ in runs:
        count = np.concatenate([np.zeros((redraw.shape[0], 1), np.int64),
                                np.cumsum(redraw, axis=1)], axis=1)
        still.append({c: count[rows, hi + 1] == count[rows, lo] for c, (lo, hi) in deps.items()})

    print(f"{KERNEL_NAME}: leak probe on {CASE_ID}")
    print(f"jax {jax.__version__}, {device.platform} ({device.device_kind})")
    if unstable:
        print(f"not reproducible run to run, not probed: {', '.join(sorted(unstable))}")
    failing = []
    for row, number, start, stop, harness_verdict in SEGMENTS:
        leaked, first, biggest, by, compared = set(), [], 0.0, [], False
        for (group, _, other), must in zip(runs, still):
            if not any(m[row, start:stop].any() for m in must.values()):
                continue  # every token of this segment read a redrawn token in that run
            compared = True
            for i in probed:
                kept = must["query" if names[i] in ("out", "dq") else "key"][row, start:stop]
                tokens = np.flatnonzero(changed(base[i], other[i])[row, start:stop] & kept)
                if tokens.size:
                    leaked.add(names[i])
                    first.append(start + int(tokens[0]))
                    # As the harness counts it: a number against NaN is an infinite change.
                    was, now = base[i][row, start:stop], other[i][row, start:stop]
                    moved = (was != now) & ~(np.isnan(was) & np.isnan(now))
                    change = np.where(moved, np.nan_to_num(np.abs(was - now), nan=np.inf), 0.0)
                    biggest = max(biggest, float(np.where(kept, change.max(axis=(1, 2)), 0.0).max()))
                    by.append(group)
        label = f"r{row}s{number}"
        if leaked:
            failing.append(label)
            print(f"{label:8s} tokens {start}..{stop - 1}: LEAK in {', '.join(n for n in names if n in leaked)} "
                  f"(first token {min(first)}, max change {biggest:.4g}, redrawn: "
                  f"{', '.join(dict.fromkeys(by))}); harness: {harness_verdict}")
        elif compared:
            print(f"{label:8s} tokens {start}..{stop - 1}: bitwise unchanged; "
                  f"harness: {harness_verdict}")
        else:
            print(f"{label:8s} tokens {start}..{stop - 1}: not compared (no run left a token of it "
                  f"untouched); harness: {harness_verdict}")
    if failing:
        print(f"@FAILED@ {KERNEL_NAME} reads tokens outside its mask (other segments', the padding's"
              f"{', or its own beyond the window or chunk' if WINDOW or CHUNK else ''}) on "
              f"{len(failing)} of {len(SEGMENTS)} segments: {', '.join(failing)}")
        return 1
    print(f"PASSED: no segment of {KERNEL_NAME} moves when tokens outside its mask are redrawn")
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
                "segments' and the padding's inputs redrawn (and, with a window or chunks, "
                "blocks inside each segment): a token whose results change at all although "
                "nothing its mask lets it depend on was redrawn reads tokens outside its mask."),
        imports=["import os", "import sys", "",
                 "# Transformer Engine reads this while tracing: its deterministic algorithms, "
                 "for bitwise\n# comparisons.",
                 "os.environ.setdefault(\"NVTE_ALLOW_NONDETERMINISTIC_ALGO\", \"0\")", ""],
        segments_comment="\n".join(comment_lines(
            "Per segment: row, segment number, first token, end (exclusive), and the harness's "
            "leak-probe verdict on this case.")),
        segment_rows=rows,
        # A backward that refused the case's feature: the forward alone, as the run judged it.
        constants=[f"BACKWARD = {kernel.backward and not gradients_refused(trial.records)!r}",
                   "# The leak probe's colours for these ids, and (six colours) each one's groups",
                   f"COLOURS = {probe_groups.colours(trial.case.segment_ids)}",
                   f"GROUPS_OF_COLOUR = {probe_groups.SIX_COLOURS!r}"],
        inputs_title="inputs",
        body=[_LEAK_MAIN],
    )
