"""Plain-JAX kernels: MaxText's dot_product, XLA's dot_product_attention, and the bug canary."""
from __future__ import annotations

import jax
import jax.numpy as jnp

from harness.registry import LEAK, register_kernel
from harness.sut.dot_product import dot_product, segment_mask
from harness.tolerance import RULES


def xla_dot_product_attention(query, key, value, segment_ids, *, causal, scale):
    """jax.nn.dot_product_attention, XLA implementation, with the same-segment mask."""
    return jax.nn.dot_product_attention(
        query, key, value, mask=segment_mask(segment_ids, causal=False), scale=scale,
        is_causal=causal, implementation="xla")


def no_f16_on_cpu(case, platform):
    # XLA:CPU's dot_general rejects float16 operands with float32 accumulation, which
    # jax.nn.dot_product_attention asks for ("precision F16_F16_F32 is not supported").
    if platform.name == "cpu" and case.dtype == "float16":
        return ["float16 dot_general with float32 accumulation is not supported by XLA:CPU"]
    return []


def causal_only(query, key, value, segment_ids, *, causal, scale):
    """The reported bug: a causal mask only, segment ids ignored (MaxText's cudnn_flash_jax)."""
    del segment_ids
    return jax.nn.dot_product_attention(query, key, value, scale=scale, is_causal=True,
                                        implementation="xla")


def causal_only_expectation(case, check, segment):
    """Where ignoring segment ids must be caught.

    The forward output and dq of a segment are wrong iff earlier segments precede it in its row:
    exactly segments 2.. fail, segment 1 passes. One exception for dq: a single-token segment's
    true dq is exactly 0, and the leaked dq of a query whose attention is spread over n earlier
    keys is O(1/sqrt(n)) of the gradients' scale, inside bf16 noise for long rows (seen on the
    H200: ratios 0.9-1.0 after ~2000 tokens); its forward output fails by orders of magnitude,
    so its dq is not judged.

    dk and dv of a packed row's segment 1 (length L1) are wrong because every later query reads
    its keys. That must be caught when the later segments hold at least L1 tokens and L1 is
    short enough for the leak to clear the tolerance floor (_visible_length); otherwise the
    change can hide in rounding noise (H200, bf16: 933 later tokens after L1 = 1115 gave dv
    ratio 0.67; L1 of 512 to 1970 gave 0.6-1.0) and is not judged. dk/dv of later segments are
    wrong too, by an amount the layout decides, and not judged. Unpacked rows are right.

    The leak probe has no tolerance, so it is judged everywhere: every segment of a packed row
    changes when its neighbours are redrawn (later ones read earlier keys; segment 1's dk/dv
    are read by later queries), and no segment of an unpacked row does."""
    row_segments = [s for s in case.segments if s.row == segment.row]
    if check == LEAK:  # exact: every segment of a packed row reads or is read across
        return "fail" if len(row_segments) > 1 else "pass"
    if check == "out" or (check == "dq" and segment.length > 1):
        return "fail" if segment.number > 1 else "pass"
    if check == "dq":
        return "pass" if segment.number == 1 else "either"
    if len(row_segments) == 1:
        return "pass"
    if segment.number == 1:
        later = sum(s.length for s in row_segments[1:])
        return "fail" if later >= segment.length and segment.length <= _visible_length(
            case, check) else "either"
    return "either"


def _visible_length(case, check) -> float:
    """The longest first segment whose dk/dv leak still clears the tolerance floor.

    The later queries' random-signed contributions to a key's gradient add up to about
    1/sqrt(L1) of the gradients' scale, while the floor is floor_eps * eps of it; with a factor
    2 margin, L1 <= (1 / (2 * floor_eps * eps))^2: 256 tokens in bf16, 16384 in fp16. (H200:
    bf16 rows with L1 of 512 to 1970 gave dk/dv ratios 0.6-1.0.)"""
    fraction = RULES[check].floor_eps * float(jnp.finfo(case.dtype).eps)
    return (1.0 / (2.0 * fraction)) ** 2


register_kernel(
    "dot_product", dot_product,
    description="MaxText-style dot_product attention in the input dtype (dense mask)")
register_kernel(
    "xla", xla_dot_product_attention, constraints=no_f16_on_cpu,
    description="jax.nn.dot_product_attention(implementation='xla') with the segment mask")
register_kernel(
    "canary_causal_only", causal_only, causal_only=True, constraints=no_f16_on_cpu,
    expect=causal_only_expectation, tags=("canary",),
    description="causal mask only, segment ids ignored: the reported bug; must be caught")
