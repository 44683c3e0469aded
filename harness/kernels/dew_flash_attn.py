"""dew-flash-attn (`dew_flash_attn`, extra `dew`; wheel dew-flash-attn-cu13 0.3.6) through its
varlen call, as kernel `dew_flash_attn:varlen`:

    flash_mha_varlen(query, key, value, cu_seqlens, max_seqlen, softmax_scale=None,
                     is_causal=False, window_size=(-1, -1), sinks=None,
                     key_cu_seqlens=None, key_max_seqlen=None) -> [T, H, D]

q, k and v are [T, H, D] and [T, H_k, D] (GQA/MQA where H_k divides H), bf16 or fp16 (anything
else raises ValueError), D <= 256 (the wrapper pads other widths to a multiple of 8), key and
value of one shape (no value head dim of its own). `cu_seqlens` is int32 [N+1] from 0 to T,
empty sequences allowed; `max_seqlen` a Python int at least the longest sequence (the row
length T here).

The rows are flattened to one token stream and cut into sequences exactly as for the
FlashAttention ports (harness.kernels.flash_attn.flat_cu_seqlens): every run of every row (a
segment, or a stretch of padding before, between or after segments) is a sequence of its own,
unused slots are empty sequences at the end, and cu_seqlens[-1] == B * T always. Padding is
never left outside the sequences: dew leaves rows past cu_seqlens[-1] unwritten (its output
buffers are not zero-filled), and its sinks' backward sums dsinks over ALL rows, so an
uncovered row's unspecified output would reach dsinks (NaN * 0 is NaN). A stretch of padding
attends only itself (finite output; its cotangent is zero, so its gradients are zero and it
adds nothing to dsinks): padding anywhere, output "finite".

Features, as dew documents them:
- window: `window_size=(left, right)`, FlashAttention's convention: query i of a sequence
  reads keys [i + (sk - sq) - left, i + (sk - sq) + right] of that sequence (bottom-right
  aligned; sk = sq here, so [i - left, i + right], positions within the sequence = the
  segment), -1 unbounded on that side; `is_causal` forces right to 0 (the harness's causal
  cases have right 0). The case's (left, right) is passed as is.
- sinks: `sinks` float32 [H], one learned logit per query head in each row's softmax
  denominator with no value (applied outside the kernel as out * sigmoid(lse - sink)); its
  gradient comes back through the library's custom_vjp (dsinks, checked).
No soft cap, chunk or value head dim (it checks key.shape == value.shape).

On Hopper (sm_90) every call runs FlashAttention-3 (`_hopper()`): FFI targets
`dew_flash3_mha_varlen_fwd` / `dew_flash3_mha_varlen_bwd`. Elsewhere it runs its
FlashAttention-2 library, whose wheel holds sm_80 and sm_120 code only (and the bundle for the
runner zeroes it, scripts/make_newlibs_bundles.sh): the kernel is declared for sm_90 only. Its
targets are all prefixed `dew_flash...` and registered at its first call, so it shares a
process with flash-attn-jax and flash-attn3-jax (whose targets are `flash_mha_*`): no
isolation group. Its FA3 backward is called without a deterministic switch (FA3's dq
accumulates with atomic adds; the FA2 path passes deterministic=False): not reproducible.
"""
from __future__ import annotations

from harness.kernels.flash_attn import flat_cu_seqlens, window_size
from harness.kernels.kernel import Kernel
from harness.kernels.op import CUDNN

DEW_BACKWARD_MARKERS = ("dew_flash3_mha_varlen_bwd",)   # only its backward pass holds it
DEW_MARKERS = ("dew_flash3_mha_varlen_fwd", *DEW_BACKWARD_MARKERS)
# The features its varlen call takes (harness.model.features).
DEW_FEATURES = ("window", "sinks")
MAX_HEAD_DIM = 256


def dew_module():
    import dew_flash_attn
    return dew_flash_attn


def dew_flattened(query, key, value, segment_ids, *, causal, scale, max_segments, window=None,
                  sinks=None, varlen=None):
    """dew_flash_attn.flash_mha_varlen on the rows flattened to one token stream, every run a
    sequence (module docstring). `varlen`: the library's call (a stand-in in tests)."""
    varlen = varlen or dew_module().flash_mha_varlen
    b, t, heads, d = query.shape
    cu = flat_cu_seqlens(segment_ids, max_segments)
    extra = window_size(window)
    if sinks is not None:
        extra["sinks"] = sinks
    out = varlen(query.reshape(b * t, heads, d), key.reshape(b * t, key.shape[2], d),
                 value.reshape(b * t, value.shape[2], value.shape[3]), cu, int(t),
                 softmax_scale=scale, is_causal=causal, **extra)
    return out.reshape(query.shape[:3] + value.shape[3:])


def _constraints(case, platform):
    reasons = []
    if case.head_dim > MAX_HEAD_DIM:
        reasons.append(f"head_dim {case.head_dim} > {MAX_HEAD_DIM}")
    cc = platform.compute_capability
    if platform.name == "gpu" and cc is not None and int(cc) != 9:
        reasons.append("dew-flash-attn runs FlashAttention-3 on sm_90 only (elsewhere its "
                       f"FlashAttention-2 library, sm_80/sm_120 code); device has {cc}")
    return reasons


# No forward mode (no jvp check): dew-flash-attn 0.3.6's attention is a jax.custom_vjp
# (`_attend` in its __init__.py), and jax.jvp cannot go through a custom_vjp.
KERNELS = [
    Kernel("dew_flash_attn:varlen", dew_flattened, dtypes=CUDNN, devices=("gpu",),
           min_compute_capability=9.0, constraints=_constraints, padding_anywhere=True,
           requires=("dew_flash_attn",), takes_max_segments=True, hlo_markers=DEW_MARKERS,
           backward_markers=DEW_BACKWARD_MARKERS,
           features=DEW_FEATURES, reproducible=False,
           description="dew-flash-attn 0.3.6 flash_mha_varlen (FlashAttention-3 on Hopper), "
                       "rows flattened with cu_seqlens, window_size and learnable sinks"),
]
