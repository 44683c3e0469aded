"""Sharded kernels: attention over a mesh of devices, judged per segment in token order.

Each kernel builds a `jax.sharding.Mesh` over the first devices of the process, lays the
inputs out as its users do (over batch and heads; or over the sequence, after the
load-balancing reorder of context parallelism, harness.kernels.load_balance), runs the sharded
computation and maps the output back to token order. The harness sees an ordinary kernel: the
oracle, the per-segment checks and the leak probe compare global inputs and outputs, and the
gradients come back through the reorder and the sharding by autodiff, so dq, dk and dv are
judged in token order too. A kernel needs `min_devices` devices (CPU CI fakes them with
XLA_FLAGS=--xla_force_host_platform_device_count=N, set before jax starts).

- `sharded:sut:<attention>:data|heads`: the project's op on a data x heads mesh (2 x 1 or 1 x 2).
- `sharded:cp:dot_product`: dense attention with context parallelism over 2 devices, striped
  reorder, all-gather of keys and values (real context parallelism on CPUs too).
- `sharded:reorder_canary`: the same, with the tokens reordered but not the segment ids (the
  bug class): expected to be caught where load_balance.forgotten_reorder_expectation says.
- `sharded:te:ring`: Transformer Engine's flax DotProductAttention, THD, ring context
  parallelism with striped load balancing (GPU, TE, 2 devices).
- `sharded:maxtext:cudnn_flash_te`: MaxText 0.2.5's AttentionOp with packing and
  ici_context_parallelism=2 on its TE path (GPU, TE, maxtext, 2 devices).
"""
from __future__ import annotations

import contextlib
import functools

import numpy as np

from harness.kernels import load_balance
from harness.kernels.kernel import Kernel
from harness.kernels.op import CUDNN, CUDNN_HEAD_DIMS, CUDNN_MARKER, op_kernel
from harness.kernels.te import TE_BACKWARD_MARKERS, TE_DETERMINISTIC, TE_MARKERS

CP = 2                                  # devices on the context axis
_MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)   # MaxText's DEFAULT_MASK_VALUE


def mesh(shape: tuple[int, ...], axes: tuple[str, ...]):
    """A Mesh of the process's first prod(shape) devices (the kernel declares how many it needs:
    too few is a skip with the reason, never an error)."""
    import jax
    from jax.sharding import Mesh

    n = int(np.prod(shape))
    devices = jax.devices()
    if len(devices) < n:
        raise RuntimeError(f"mesh {dict(zip(axes, shape))} needs {n} devices, "
                           f"{len(devices)} visible")
    return Mesh(np.array(devices[:n]).reshape(shape), axes)


def _constrain(x, the_mesh, *spec):
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P
    return jax.lax.with_sharding_constraint(x, NamedSharding(the_mesh, P(*spec)))


# ----- the op over batch and heads ---------------------------------------------------------------

def op_data_heads(query, key, value, segment_ids, *, causal, scale, max_segments, attention,
                  data, heads):
    """The op (harness.sut) under shard_map on a (data, heads) mesh: each device attends its
    rows and its heads (query heads and their kv heads, which stay together: query head h reads
    kv head h // group, and both are split in contiguous blocks). No collective: a device that
    mixed rows or heads up would read another's inputs."""
    import jax
    from jax.sharding import PartitionSpec as P

    the_mesh = mesh((data, heads), ("data", "heads"))
    tokens = P("data", None, "heads", None)

    def local(q, k, v, seg):
        return op_kernel(q, k, v, seg, causal=causal, scale=scale, max_segments=max_segments,
                         attention=attention)

    # check_vma off: cuDNN's custom calls carry no varying-axes rules; nothing is replicated.
    return jax.shard_map(local, mesh=the_mesh, in_specs=(tokens, tokens, tokens, P("data", None)),
                         out_specs=tokens, check_vma=False)(query, key, value, segment_ids)


def _divides(data: int, heads: int):
    def constraint(case, platform):
        reasons = []
        if case.batch % data:
            reasons.append(f"batch {case.batch} does not split over {data} devices")
        if case.kv_heads % heads:
            reasons.append(f"{case.kv_heads} kv heads do not split over {heads} devices")
        return reasons
    return constraint


# ----- context parallelism -----------------------------------------------------------------------

def context_parallel(attend, query, key, value, segment_ids, *, the_mesh, axis, cp=CP,
                     reorder_ids=True):
    """Lays a batch out as context parallelism's users do, runs `attend` on it and returns the
    output in token order.

    q, k, v, segment ids and positions (each token's position inside its segment, computed in
    token order) are reordered for load balance and sharded on the sequence over `axis`;
    `attend(q, k, v, ids, pos)` sees them so. With reorder_ids=False the segment ids stay in
    token order while everything else moves: the bug class of the reorder canary."""
    from harness.sut.lowering import positions

    pos = positions(segment_ids)
    q, k, v, pos_r = (load_balance.reorder(x, cp) for x in (query, key, value, pos))
    ids = load_balance.reorder(segment_ids, cp) if reorder_ids else segment_ids
    if the_mesh is not None:
        q, k, v = (_constrain(x, the_mesh, None, axis, None, None) for x in (q, k, v))
        ids, pos_r = (_constrain(x, the_mesh, None, axis) for x in (ids, pos_r))
    return load_balance.restore(attend(q, k, v, ids, pos_r), cp)


def masked_dot_product(query, key, value, allowed, *, scale):
    """MaxText-style dense attention under a [B, Tq, Tk] mask: the query scaled first, query
    heads grouped over kv heads by reshaping, logits and softmax in float32."""
    import jax
    import jax.numpy as jnp

    b, t, heads, d = query.shape
    kv_heads = key.shape[2]
    q = (query * jnp.asarray(scale, query.dtype)).reshape(b, t, kv_heads, heads // kv_heads, d)
    logits = jnp.einsum("btkgd,bskd->bkgts", q, key, preferred_element_type=jnp.float32)
    logits = jnp.where(allowed[:, None, None], logits, _MASK_VALUE)
    probs = jax.nn.softmax(logits, axis=-1).astype(value.dtype)
    return jnp.einsum("bkgts,bskd->btkgd", probs, value).reshape(b, t, heads, d)


def _segment_attention(causal, scale):
    """attend(q, k, v, ids, pos) for queries against keys given with their ids and positions:
    the same segment, and (causal) a key position inside the segment up to the query's."""
    def attend(q, k, v, ids_q, pos_q, ids_k, pos_k):
        allowed = ids_q[:, :, None] == ids_k[:, None, :]
        if causal:
            allowed &= pos_k[:, None, :] <= pos_q[:, :, None]
        return masked_dot_product(q, k, v, allowed, scale=scale)
    return attend


def all_gather_attention(the_mesh, axis, causal, scale):
    """Context parallelism by all-gather: each device keeps its queries and gathers every
    device's keys, values, ids and positions (in reordered order: the mask compares ids and
    positions, never array indices). Gradients of the gathered keys and values flow back
    through the all-gather's transpose, a reduce-scatter. Without a mesh: the same math on one
    device (the zoo's form of the canary)."""
    import jax
    from jax.sharding import PartitionSpec as P

    attend = _segment_attention(causal, scale)
    if the_mesh is None:
        return lambda q, k, v, ids, pos: attend(q, k, v, ids, pos, ids, pos)

    def local(q, k, v, ids, pos):
        k_all, v_all, ids_all, pos_all = (jax.lax.all_gather(x, axis, axis=1, tiled=True)
                                          for x in (k, v, ids, pos))
        return attend(q, k_all, v_all, ids, pos, ids_all, pos_all)

    tokens, rows = P(None, axis, None, None), P(None, axis)
    return jax.shard_map(local, mesh=the_mesh, in_specs=(tokens, tokens, tokens, rows, rows),
                         out_specs=tokens)


def cp_dot_product(query, key, value, segment_ids, *, causal, scale, devices=CP,
                   reorder_ids=True):
    """Dense attention with context parallelism over `devices` (the reorder always for CP=2
    shards; devices=1 runs the shards' math on one device)."""
    the_mesh = mesh((devices,), ("context",)) if devices > 1 else None
    attend = all_gather_attention(the_mesh, "context", causal, scale)
    return context_parallel(attend, query, key, value, segment_ids, the_mesh=the_mesh,
                            axis="context", reorder_ids=reorder_ids)


def reorder_canary_expectation(case, check, segment):
    return load_balance.forgotten_reorder_expectation(case, check, segment, cp=CP)


def reorder_canary_padding(case, row):
    return load_balance.forgotten_reorder_padding(case, row, cp=CP)


# ----- Transformer Engine and MaxText (GPU) -----------------------------------------------------

def within(contexts, fn):
    """fn(q, k, v, ids, pos), with its forward and its backward traced inside `contexts()` (a
    list of context managers). The harness takes jax.vjp of a kernel and traces the backward
    after the kernel returned, outside any context it entered: TE binds its context-parallel
    primitives, forward and backward, under the mesh and its MeshResource."""
    import jax

    def enter():
        stack = contextlib.ExitStack()
        for c in contexts():
            stack.enter_context(c)
        return stack

    @jax.custom_vjp
    def run(q, k, v, ids, pos):
        with enter():
            return fn(q, k, v, ids, pos)

    def forward(q, k, v, ids, pos):
        with enter():
            out, pullback = jax.vjp(lambda q, k, v: fn(q, k, v, ids, pos), q, k, v)
        return out, pullback

    def backward(pullback, g):
        with enter():
            return (*pullback(g), None, None)   # ids and positions: no gradient

    run.defvjp(forward, backward)
    return run


def te_ring(query, key, value, segment_ids, *, causal, scale, max_segments):
    """TE's flax DotProductAttention, THD layout, ring context parallelism over 2 devices with
    striped load balancing, as MaxText's cudnn_flash_te calls it with packing: a mesh axis "cp",
    `with mesh, global_shard_guard(MeshResource(cp_resource="cp"))`, inputs, ids and positions
    reordered (TE's Striped, stripe 1) and sharded on the sequence over "cp", a
    SequenceDescriptor from the reordered ids and positions. Ring THD takes only the
    padding-causal mask (the kernel is causal only)."""
    from transformer_engine.jax.attention import SequenceDescriptor
    from transformer_engine.jax.flax import DotProductAttention
    from transformer_engine.jax.sharding import MeshResource, global_shard_guard

    del causal
    the_mesh = mesh((CP,), ("cp",))
    module = DotProductAttention(
        head_dim=query.shape[-1], num_attention_heads=query.shape[2],
        num_gqa_groups=key.shape[2], attn_mask_type="padding_causal", qkv_layout="thd_thd_thd",
        max_segments_per_seq=max_segments, scale_factor=scale, transpose_batch_sequence=False,
        context_parallel_causal_load_balanced=True, context_parallel_axis="cp",
        context_parallel_strategy="ring")

    def attend(q, k, v, ids, pos):
        descriptor = SequenceDescriptor.from_segment_ids_and_pos((ids, ids), (pos, pos))
        return module.apply({}, q, k, v, sequence_descriptor=descriptor, deterministic=False)

    attend = within(lambda: [the_mesh, global_shard_guard(MeshResource(cp_resource="cp"))],
                    attend)
    return context_parallel(attend, query, key, value, segment_ids, the_mesh=the_mesh,
                            axis="cp")


def maxtext_ring(query, key, value, segment_ids, *, causal, scale, max_segments):
    """MaxText's own AttentionOp (attention=cudnn_flash_te, train mode) with packing and context
    parallelism, as a MaxText user trains: a mesh over base.yml's mesh_axes with `context` of
    size 2 (ici_context_parallelism=2), context_parallel_strategy="ring" with load balancing
    (the only strategy MaxText 0.2.5 packs with), inputs, ids and positions reordered by the
    caller (MaxText's input pipeline: TE's Striped, stripe 1) and sharded on the sequence over
    `context`, the op called under `with mesh, global_shard_guard(MeshResource(cp_resource=
    "context"))`. The query is pre-scaled (the op applies no scale); causal only."""
    import jax.numpy as jnp
    from maxtext.layers.attention_op import AttentionOp
    from transformer_engine.jax.sharding import MeshResource, global_shard_guard

    from harness.kernels.maxtext_adapter import DATASET_TYPE, MaxTextConfig, base_config

    del causal
    axes = tuple(base_config()["mesh_axes"])
    the_mesh = mesh(tuple(CP if a == "context" else 1 for a in axes), axes)
    config = MaxTextConfig(attention="cudnn_flash_te", enable_dropout=False, dropout_rate=0.0,
                           max_segments_per_seq=max_segments, dataset_type=DATASET_TYPE,
                           packing=True, ici_context_parallelism=CP,
                           context_parallel_strategy="ring", context_parallel_load_balance=True)
    _, t, heads, _ = query.shape
    op = AttentionOp(config=config, mesh=the_mesh, attention_kernel="cudnn_flash_te",
                     max_target_length=t, num_query_heads=heads, num_kv_heads=key.shape[2],
                     dtype=query.dtype)

    def attend(q, k, v, ids, pos):
        out = op(q, k, v, ids, pos, "train")
        return out[0] if isinstance(out, tuple) else out

    attend = within(lambda: [the_mesh, global_shard_guard(MeshResource(cp_resource="context"))],
                    attend)
    return context_parallel(attend, query * jnp.asarray(scale, query.dtype), key, value,
                            segment_ids, the_mesh=the_mesh, axis="context")


# ----- the kernels ------------------------------------------------------------------------------

def _op(attention, data, heads):
    return functools.partial(op_data_heads, attention=attention, data=data, heads=heads)


def _op_kernels():
    out = []
    for axis, (data, heads) in (("data", (2, 1)), ("heads", (1, 2))):
        common = dict(takes_max_segments=True, min_devices=data * heads,
                      constraints=_divides(data, heads))
        out += [
            Kernel(f"sharded:sut:dot_product:{axis}", _op("dot_product", data, heads),
                   materializes_scores=True, **common,
                   description=f"the op, attention=dot_product, {axis} split over 2 devices "
                               "(shard_map on a data x heads mesh)"),
            Kernel(f"sharded:sut:cudnn_flash_jax:{axis}", _op("cudnn_flash_jax", data, heads),
                   dtypes=CUDNN, head_dims=CUDNN_HEAD_DIMS, devices=("gpu",),
                   min_compute_capability=9.0, hlo_markers=CUDNN_MARKER, **common,
                   description=f"the fixed op (packed cuDNN), {axis} split over 2 devices "
                               "(shard_map on a data x heads mesh)"),
        ]
    return out


_CP = dict(min_devices=CP, seq_len_multiple=CP * load_balance.STRIPE)
# TE's ring attention over THD: padding-causal only, and MaxText's decoder is causal.
_TE_CP = dict(**_CP, takes_max_segments=True, causal_only=True, dtypes=CUDNN,
              head_dims=CUDNN_HEAD_DIMS, devices=("gpu",), min_compute_capability=9.0,
              hlo_markers=TE_MARKERS, backward_markers=TE_BACKWARD_MARKERS,
              deterministic_env=TE_DETERMINISTIC)


def python_312(case, platform):
    from harness.kernels.maxtext_adapter import python_312 as check
    return check(case, platform)


KERNELS = [
    *_op_kernels(),
    Kernel("sharded:cp:dot_product", cp_dot_product, padding_anywhere=True,
           materializes_scores=True, **_CP,
           description="dense attention, context parallel over 2 devices: striped reorder, "
                       "all-gather of keys and values"),
    Kernel("sharded:reorder_canary", functools.partial(cp_dot_product, reorder_ids=False),
           padding_anywhere=True, materializes_scores=True, expect=reorder_canary_expectation,
           expect_padding=reorder_canary_padding, tags=("canary",), **_CP,
           description="context parallel, tokens reordered but not the segment ids (the bug "
                       "class): must be caught"),
    Kernel("sharded:te:ring", te_ring, padding_anywhere=True,
           requires=("transformer_engine",), **_TE_CP,
           description="TE flax DotProductAttention, THD, ring context parallelism over 2 "
                       "devices, striped load balancing"),
    Kernel("sharded:maxtext:cudnn_flash_te", maxtext_ring,
           requires=("maxtext", "transformer_engine"), constraints=python_312, **_TE_CP,
           description="MaxText's AttentionOp, cudnn_flash_te, packing, "
                       "ici_context_parallelism=2 (ring, striped)"),
]
