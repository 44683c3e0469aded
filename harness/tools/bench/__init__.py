"""python -m harness bench: what the attention op's packed path costs beside the calls it is
measured against, forward+backward, per shape, in one process.

Entries (the rows of each shape's table; `--kernels` picks some, or adds any registered kernel):

  sut:cudnn_flash_jax               the op: AttentionOp(attention=cudnn_flash_jax, packing,
                                    max_segments_per_seq = M): segment ids in; lengths and
                                    offsets derived inside the program; packed cuDNN,
                                    PADDING_CAUSAL.
  raw:cudnn_packed                  jax's cuDNN dot_product_attention with q/kv_seqlen [B, M] and
                                    q/kv_offsets [B, M+1] computed once, outside the timed
                                    program, and passed in as arguments; PADDING_CAUSAL, BTNH,
                                    the same M. The op's time over this one is what the op adds.
  te:thd                            Transformer Engine's THD fused attention from segment ids
                                    and positions (harness.sut.attention_op.te_fused_thd): TE
                                    derives seqlens/offsets inside.
  raw:te_thd_offsets                TE's fused_attn with SequenceDescriptor.from_seqlens_and_
                                    offsets on the same precomputed seqlens/offsets: no
                                    conversion inside the program.
  sut:cudnn_flash_te                the op's TE path (attention=cudnn_flash_te), the path the op
                                    can take where TE is the faster one: the op's own lowering
                                    to seqlens/offsets, handed to TE (te_fused_packed).
  maxtext_original:cudnn_flash_jax  the causal-only call the op replaces. Wrong on packed rows
                                    (it attends across segments): timed for the cost of the fix.
  sut:cudnn_flash_jax:fallback      the op's pre-Hopper path (same-segment mask as a cuDNN
                                    bias), forced.
  xla                               jax.nn.dot_product_attention(implementation="xla"), masked.

M is the shape's fullest row's segment count + 1. On a CPU the cuDNN entries run through the
cuDNN emulator (harness.sut.cudnn_emulator) so that a CPU run (`--shapes small`) takes every code
path; on a GPU they run real cuDNN. The TE entries need a GPU of compute capability >= 9.0 and
Transformer Engine. Entries a device cannot run are listed as skipped, with the reason.

Timing: jax.vjp of each entry (output and dq, dk, dv), compiled ahead (compilation excluded),
every argument on the device before the clock starts, two warm-up calls, then --repeats rounds
in which every entry takes one sample, in an order shuffled anew each round (interleaved, so
clock or thermal drift hits all alike; shuffled, so that no entry always follows the same one:
in a fixed order the op, always right after XLA's 16 ms dense call, measured 3.0% and 5.4% over
the raw call on the H200 where a script timing each program on its own (since removed) measured
2.5% and 1.7%). A sample is one call on CPUs; on GPUs it is one untimed call, then K
back-to-back calls (K sized from the warm-up so a sample lasts about 50 ms, at most 20 calls)
divided by K, so that the per-call sync and launch cost, the same for every entry, does not
pull the ratios towards 1, and a state the previous entry left behind fades within the sample
(at 20 ms a 6 ms call took 2 or 3 calls a sample, and its samples fell into two modes 8% apart
on the H200). Reported:
median, min and spread ((max - min) / median) of the samples per entry; ratios against
raw:cudnn_packed where it ran (else the first entry that ran), and the op against causal-only.

Useful TFLOP/s count same-segment causal work only: a segment of L tokens costs a forward of
4 * L(L+1)/2 * head_dim * heads FLOPs (two matmuls over the causal triangle), and the backward is
counted as 2.5 times the forward (FlashAttention's convention: five matmuls to the forward's
two), whatever the entry actually computes: a call that attends across segments or over padding
gets no credit for it.

Memory: before any work, each entry's peak is estimated (dense kernels: harness.kernels.kernel.
scores_bytes, doubled on CPUs, where XLA keeps more float32 [B, H, T, T] temporaries alive: a
hopper run on a CPU was killed at 24 GB where scores_bytes says 16 GiB; fused kernels: inputs,
outputs, gradients, a float32 dq accumulator and softmax statistics) against the device's limit
(GPU: its allocator's limit; CPU: the host's available memory). Entries that do not fit are
skipped with the numbers; a shape set of which nothing fits is refused with one line.

Nothing here asserts a speed: the goals are printed as statements with their numbers.

The package: `shapes` (the shape sets, useful FLOPs, the packed layout), `entries` (the entries,
declared by capability: what each runs, which goals it takes part in, how its memory grows),
`plans` (what runs where, and the memory check), `timing`, `results` (a shape's numbers and
table), `goals` and `command` (main).
"""
from harness.tools.bench.command import main
from harness.tools.bench.shapes import (
    SHAPE_SETS,
)

__all__ = ["SHAPE_SETS", "main"]
