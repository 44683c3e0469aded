"""Where the fixed op's time over the raw packed cuDNN call goes (GPU diagnostic).

The bench compares the op with jax's cuDNN SDPA on precomputed lengths and offsets. This times
the steps between the two, one at a time, fwd+bwd, on the bench's shapes:

    raw            the raw call on precomputed seqlen/offsets (M slots)
    lowered        segment ids -> seqlen/offsets inside the program (lowering.packed, padding
                   merged into the last segment: the op's causal lowering), no guard
    op             AttentionOp as shipped (the lowering and its NaN guard on the value)

Usage: python scripts/op_overhead.py [OUT.txt]   (on a Hopper GPU; prints and writes a table, and
OUT.txt.<variant>.hlo: the seed shape's optimized programs; on a CPU, a dry run through the
cuDNN emulator on small shapes)
"""
from __future__ import annotations

import statistics
import sys
import time

import jax


def main(out_path: str | None = None) -> int:
    from harness.tools.bench import SHAPE_SETS
    from harness.model.case import make_inputs
    from harness.judge.oracle import with_gradients
    from harness.sut import lowering
    from harness.sut.attention_op import AttentionOp, cudnn_backend, cudnn_packed
    from harness.sut.config import AttentionConfig

    # On a CPU, a dry run of this script on the small shapes through the cuDNN emulator.
    gpu = jax.devices()[0].platform == "gpu"
    backend = "cudnn" if gpu else "emulator"
    sdpa, mask_type = cudnn_backend(backend, 9.0)
    lines = []

    def say(text):
        print(text, flush=True)
        lines.append(text)

    for shape in SHAPE_SETS["hopper" if gpu else "small"]():
        case, m = shape.case, shape.max_segments
        x = make_inputs(case)
        q, k, v, seg, ct = (jax.device_put(a) for a in (x.query, x.key, x.value,
                                                         x.segment_ids, x.cotangent))
        pre = tuple(jax.device_put(a) for a in jax.device_get(
            lowering.lengths_and_offsets(seg, m)))

        def packed(q, k, v, seqlen, offsets):
            return cudnn_packed(sdpa, mask_type, q, k, v, seqlen, offsets, scale=case.scale,
                                causal=True)

        def lowered(q, k, v, s):
            seqlen, offsets = lowering.lengths_and_offsets(s, m, padding="merged")
            return packed(q, k, v, seqlen, offsets)

        op = AttentionOp(AttentionConfig(attention="cudnn_flash_jax", packing=True,
                                         max_segments_per_seq=m, hardware="gpu",
                                         cudnn_backend=backend, compute_capability=9.0))

        def shipped(q, k, v, s):
            return op(q, k, v, s, scale=case.scale, causal=True)

        variants = {"raw": (packed, pre), "lowered": (lowered, (seg,)), "op": (shipped, (seg,))}
        say(shape.label)
        times = {}
        for name, (fn, aux) in variants.items():
            program = jax.jit(with_gradients(fn)).lower(q, k, v, *aux, ct).compile()
            args = (q, k, v, *aux, ct)
            jax.block_until_ready(program(*args))
            once = time.perf_counter()
            jax.block_until_ready(program(*args))
            calls = max(1, min(20, int(0.02 / max(time.perf_counter() - once, 1e-6))))
            samples = []
            for _ in range(20):
                start = time.perf_counter()
                for _ in range(calls):
                    result = program(*args)
                jax.block_until_ready(result)
                samples.append((time.perf_counter() - start) / calls)
            times[name] = statistics.median(samples)
            text = program.as_text() or ""
            kernels = text.count("fusion(")
            if out_path and shape.name == "seed":  # the optimized programs, to read
                with open(f"{out_path}.{name}.hlo", "w") as f:
                    f.write(text)
            say(f"  {name:14s} {1e3 * times[name]:8.3f} ms  {times[name] / times['raw']:6.3f}x"
                f"  ({calls} calls/sample; {kernels} fusions in the program)")
    if out_path:
        with open(out_path, "w") as f:
            f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else None))
