"""MaxText's own attention op as harness kernels: `maxtext:<kernel>`.

Wraps `maxtext.layers.attention_op.AttentionOp` from the MaxText that is installed (extra
`maxtext`; Python >= 3.12), in train mode, so the harness checks the real code rather than a
re-implementation. MaxText's conventions stay here:
- the op applies no softmax scale: the caller pre-scales the query, as MaxText's attention
  layer does;
- segment positions follow from the segment ids (position within each segment);
- a one-device mesh over the first local device (each pytest-xdist worker pins its own GPU),
  with every axis MaxText's base.yml names (`mesh_axes`), each of size 1: the TE path reads
  `mesh.shape[config.context_sharding]`;
- the op reads nine config attributes on this path; the adapter answers each from MaxText's own
  `configs/base.yml` defaults, with `attention` set to the kernel, dropout off,
  `max_segments_per_seq` set to the case's M (base.yml's -1 asks GPU users of TE to set it) and
  `dataset_type` a real dataset's (base.yml's "synthetic" keeps TE off its packed THD layout), as
  a GPU user training on packed data sets them, and refuses any attribute base.yml does not
  define (so a new read is an error, not a guess).

Features (harness.model.features), handed over as a user configures a model (MaxText 0.2.5;
line numbers below are its wheel's maxtext/layers/attention_op.py). AttentionOp reads none of
them from the config:
they are constructor arguments, as MaxText's model layers pass them (gpt-oss, gemma2: per-layer
`attention_type`; layers/attentions.py forwards the rest), and the sinks are a call argument:
- window (left, 0): `attention_type="local_sliding"`, `sliding_window_size=left + 1`. MaxText's
  window is W keys including self, causal (left only): dot_product masks `col > row - W` and
  `col <= row` (attention_op.py:1174-1182); TE gets `window_size=[W - 1, 0]` (2676-2677). It has
  no right bound: a window reading ahead is not declared (constraints).
- softcap: `attn_logits_soft_cap=cap`, on the pre-scaled logits (3018-3020).
- chunk: `attention_type="chunk"`, `chunk_attn_window_size=C`. MaxText's chunks start at
  multiples of C from the ROW's start, not each segment's (`_generate_chunk_attention_mask`,
  437-464, on the row index): the kernels declare `conventions={"chunk": "row"}`. One
  attention_type per layer: a window with chunks is not declared.
- sinks: `op(..., sinks=array[heads])`, float32 (MaxText's parameter: `(num_query_heads,)`,
  weight_dtype), an input of the program, so its gradient flows.
- head_dim_v: by the value's shape (MLA): AttentionOp checks only that query and key agree.
The config also carries them, as a user's would (`sliding_window_size`, `chunk_attn_window_size`,
`attn_logits_soft_cap`, `attention_sink`; `attention_type` stays "global", set per layer), and
`head_dim`, which the TE path reads for its sinks (2788-2799).

What MaxText releases are known to get wrong (segment ids ignored, features dropped, the
float16 softmax sum) is harness.kernels.maxtext_known: the kernels' expectations.
"""
from __future__ import annotations

import functools
import sys

from harness.kernels.te_flax import sinks_fallback_crash
from harness.kernels.kernel import Kernel
from harness.kernels.maxtext_known import (
    CUDNN_FLASH_JAX_EXPECT,
    CUDNN_FLASH_TE_EXPECT,
    FLASH_EXPECT,
    float16_sum_expectation,
)
from harness.kernels.op import CUDNN, CUDNN_HEAD_DIMS, CUDNN_MARKER
from harness.kernels.te import TE_BACKWARD_MARKERS, TE_DETERMINISTIC, TE_MARKERS
from harness.kernels.tokamax_adapter import TRITON_ERROR, TRITON_MARKER
from harness.model.features import CHUNK, FEATURE_NAMES


@functools.lru_cache(maxsize=1)
def base_config() -> dict:
    import importlib.resources

    import yaml
    return yaml.safe_load((importlib.resources.files("maxtext") / "configs" / "base.yml").read_text())


class MaxTextConfig:
    """The config attributes AttentionOp reads: overrides first, then base.yml defaults."""

    def __init__(self, **overrides):
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        base = base_config()
        if name.startswith("__") or name not in base:
            raise AttributeError(f"maxtext adapter: AttentionOp read config.{name}, which "
                                 "MaxText's base.yml does not define")
        return base[name]


# A real (packed) dataset, as in the seed report's run (`dataset_type=tfds packing=true`).
# base.yml's default, "synthetic", keeps cudnn_flash_te on its dense BSHD layout, where TE turns
# the segment mask into one length per row: on the H200 every segment after a row's first came
# out wrong (zeros at its first token; reports/h200/README.md).
DATASET_TYPE = "tfds"


def feature_settings(window=None, softcap=None, chunk=None, sinks=False) -> tuple[dict, dict]:
    """(AttentionOp constructor arguments, config settings) for the features, as a user
    configures a model: nothing for a case without them (the op as the plain kernels call it)."""
    op, config = {}, {}
    if window is not None:
        left, right = (int(x) for x in window)
        if right:
            raise ValueError(f"window {tuple(window)}: MaxText's local_sliding window is causal "
                             "(left only); it takes no right bound")
        op.update(attention_type="local_sliding", sliding_window_size=left + 1)
        config["sliding_window_size"] = left + 1
    if chunk is not None:
        if window is not None:
            raise ValueError("MaxText's attention_type is local_sliding or chunk, not both")
        op.update(attention_type="chunk", chunk_attn_window_size=int(chunk))
        config["chunk_attn_window_size"] = int(chunk)
    if softcap is not None:
        op["attn_logits_soft_cap"] = config["attn_logits_soft_cap"] = float(softcap)
    if sinks:
        config["attention_sink"] = True
    return op, config


def maxtext_attention(query, key, value, segment_ids, *, causal, scale, max_segments, attention,
                      attention_op_module=None, window=None, softcap=None, chunk=None,
                      sinks=None):
    """MaxText's AttentionOp in train mode. `attention_op_module`: the module whose AttentionOp
    runs (default the installed `maxtext.layers.attention_op`; harness.kernels.maxtext_fixed
    passes that module with the patch under patches/ applied). Features as the module
    docstring says: window/softcap/chunk to the constructor, sinks to the call."""
    import importlib

    import jax
    import numpy as np
    from jax.sharding import Mesh

    from harness.sut.lowering import positions

    module = attention_op_module or importlib.import_module("maxtext.layers.attention_op")

    del causal  # MaxText's decoder attention is causal; the kernel declares causal_only
    _, t, heads, head_dim = query.shape
    op_features, config_features = feature_settings(window, softcap, chunk, sinks is not None)
    config = MaxTextConfig(attention=attention, enable_dropout=False, dropout_rate=0.0,
                           max_segments_per_seq=max_segments, dataset_type=DATASET_TYPE,
                           head_dim=head_dim, **config_features)
    axes = tuple(base_config()["mesh_axes"])
    mesh = Mesh(np.array(jax.local_devices()[:1]).reshape((1,) * len(axes)), axes)
    op = module.AttentionOp(config=config, mesh=mesh, attention_kernel=attention,
                            max_target_length=t, num_query_heads=heads,
                            num_kv_heads=key.shape[2], dtype=query.dtype, **op_features)
    call = {} if sinks is None else {"sinks": sinks}
    out = op(query * jax.numpy.asarray(scale, query.dtype), key, value, segment_ids,
             positions(segment_ids), "train", **call)
    return out[0] if isinstance(out, tuple) else out


def python_312(case, platform):
    if sys.version_info < (3, 12):
        return [f"maxtext installs on Python >= 3.12 only, this is "
                f"{sys.version_info.major}.{sys.version_info.minor}"]
    return []


def feature_limits(case, platform):
    """What MaxText's API cannot express: a window reading ahead (its local_sliding window is
    causal, W keys up to self, and the decoder causal: no right bound to hand over), and a
    window with chunks (one attention_type per layer)."""
    f = case.features
    out = []
    if f.window is not None and (f.window[1] or not case.causal):
        out.append(f"a window without the causal mask ({f.window[0]} back, {f.window[1]} ahead): "
                   "MaxText's local_sliding window is causal (sliding_window_size keys up to "
                   "self) and has no right bound")
    if f.window is not None and f.chunk is not None:
        out.append("a window with chunks: MaxText's attention_type is local_sliding or chunk, "
                   "not both")
    return out


def maxtext_constraints(case, platform):
    return python_312(case, platform) + feature_limits(case, platform)


# The features AttentionOp takes on every path (its constructor and call; head_dim_v by the
# value's shape), and where its chunks start.
MAXTEXT_FEATURES = FEATURE_NAMES
MAXTEXT_CONVENTIONS = {CHUNK: "row"}

# max_segments_per_seq as a GPU user with TE must set it (base.yml's default is -1).
_COMMON = dict(requires=("maxtext",), causal_only=True, constraints=maxtext_constraints,
               takes_max_segments=True, features=MAXTEXT_FEATURES,
               conventions=MAXTEXT_CONVENTIONS)

# What `python -m harness repro` pastes into a standalone script for a maxtext:<kernel> (with
# @ATTENTION@ replaced by the kernel): maxtext_attention above with nothing but jax, numpy, yaml
# and maxtext. Keep the two in step (cases/test_repro.py runs both on a stand-in AttentionOp).
MAXTEXT_STANDALONE = '''\
import functools
import importlib.resources

import jax
import jax.numpy as jnp
import numpy as np
import yaml
from jax.sharding import Mesh
from maxtext.layers.attention_op import AttentionOp

ATTENTION = "@ATTENTION@"  # MaxText's `attention` setting: the kernel under test

try:  # MaxText's libraries read absl flags: mark them parsed (their defaults), as the harness does
    from absl import flags as _absl_flags
    if not _absl_flags.FLAGS.is_parsed():
        _absl_flags.FLAGS.mark_as_parsed()
except ImportError:
    pass


@functools.lru_cache(maxsize=1)
def _base_config() -> dict:
    """The defaults of the installed MaxText: its configs/base.yml."""
    return yaml.safe_load((importlib.resources.files("maxtext") / "configs" / "base.yml").read_text())


class MaxTextConfig:
    """The config attributes AttentionOp reads: overrides first, then base.yml defaults."""

    def __init__(self, **overrides):
        self.__dict__.update(overrides)

    def __getattr__(self, name):
        base = _base_config()
        if name.startswith("__") or name not in base:
            raise AttributeError(f"AttentionOp read config.{name}, which MaxText's base.yml "
                                 "does not define")
        return base[name]


def _positions(segment_ids):
    """Position of each token inside its segment (0 at each segment's start and at padding)."""
    t = segment_ids.shape[1]
    idx = jnp.arange(t, dtype=jnp.int32)[None]
    new = jnp.concatenate([jnp.ones_like(segment_ids[:, :1], bool),
                           segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    start = jax.lax.cummax(jnp.where(new, idx, 0), axis=1)
    return jnp.where(segment_ids > 0, idx - start, 0).astype(jnp.int32)


def _feature_settings(window=None, softcap=None, chunk=None, sinks=False):
    """(AttentionOp arguments, config settings) for the features, as a model configures them: a
    window (left, 0) is local_sliding attention over left + 1 keys (self included, causal);
    chunks are chunk attention (MaxText counts them from the row's start); the soft cap caps
    the pre-scaled logits."""
    op, config = {}, {}
    if window is not None:
        left, right = (int(x) for x in window)
        if right:
            raise ValueError(f"window {tuple(window)}: MaxText's local_sliding window is causal "
                             "(left only); it takes no right bound")
        op.update(attention_type="local_sliding", sliding_window_size=left + 1)
        config["sliding_window_size"] = left + 1
    if chunk is not None:
        if window is not None:
            raise ValueError("MaxText's attention_type is local_sliding or chunk, not both")
        op.update(attention_type="chunk", chunk_attn_window_size=int(chunk))
        config["chunk_attn_window_size"] = int(chunk)
    if softcap is not None:
        op["attn_logits_soft_cap"] = config["attn_logits_soft_cap"] = float(softcap)
    if sinks:
        config["attention_sink"] = True
    return op, config


def kernel(query, key, value, segment_ids, *, causal, scale, max_segments=-1, window=None,
           softcap=None, chunk=None, sinks=None):
    """MaxText's AttentionOp in train mode with attention=ATTENTION, dropout off,
    max_segments_per_seq=max_segments (as MaxText's base.yml asks on GPUs with TE) and a real
    dataset's dataset_type (base.yml's "synthetic" keeps TE off its packed layout), on a
    one-device mesh with every axis of base.yml's mesh_axes (size 1). The op applies no softmax
    scale: the query is pre-scaled, as MaxText's attention layer does. Segment positions are
    each token's position inside its segment. MaxText's decoder attention is causal.
    Features: window=(left, 0), softcap=, chunk= go to the op's constructor, sinks (float32
    [heads]) to its call."""
    del causal
    _, t, heads, head_dim = query.shape
    op_features, config_features = _feature_settings(window, softcap, chunk, sinks is not None)
    config = MaxTextConfig(attention=ATTENTION, enable_dropout=False, dropout_rate=0.0,
                           max_segments_per_seq=max_segments, dataset_type="tfds",
                           head_dim=head_dim, **config_features)
    axes = tuple(_base_config()["mesh_axes"])
    mesh = Mesh(np.array(jax.local_devices()[:1]).reshape((1,) * len(axes)), axes)
    op = AttentionOp(config=config, mesh=mesh, attention_kernel=ATTENTION, max_target_length=t,
                     num_query_heads=heads, num_kv_heads=key.shape[2], dtype=query.dtype,
                     **op_features)
    call = {} if sinks is None else {"sinks": sinks}
    out = op(query * jnp.asarray(scale, query.dtype), key, value, segment_ids,
             _positions(segment_ids), "train", **call)
    return out[0] if isinstance(out, tuple) else out
'''


def mla_needs_hopper(case, platform):
    """jax's cuDNN attention takes a value head dim of its own (MLA) on Hopper and newer only:
    below, it raises "mla requires cudnn version >= 9.10 and at least hopper arch." when
    traced (fused_attention_stablehlo.py:398-400), naming no feature."""
    if (case.features.head_dim_v is not None and platform.name == "gpu"
            and (platform.compute_capability or 0) < 9.0):
        return [f"value head dim {case.features.head_dim_v} != head dim {case.head_dim}: jax's "
                "cuDNN attention takes it (MLA) on compute capability >= 9.0 only"]
    return []


KERNELS = [
    # MaxText's dot_product masks by comparing segment ids: padding may sit anywhere.
    Kernel("maxtext:dot_product", functools.partial(maxtext_attention, attention="dot_product"),
           padding_anywhere=True, materializes_scores=True, expect=float16_sum_expectation,
           forward_mode=True, **_COMMON,
           standalone=MAXTEXT_STANDALONE.replace("@ATTENTION@", "dot_product"),
           description="MaxText's AttentionOp, attention=dot_product (installed maxtext)"),
    Kernel("maxtext:cudnn_flash_jax",
           functools.partial(maxtext_attention, attention="cudnn_flash_jax"),
           dtypes=CUDNN, devices=("gpu",), min_compute_capability=8.0,
           hlo_markers=CUDNN_MARKER, expect=CUDNN_FLASH_JAX_EXPECT,
           **{**_COMMON, "constraints": lambda c, p: maxtext_constraints(c, p)
              + mla_needs_hopper(c, p)},
           standalone=MAXTEXT_STANDALONE.replace("@ATTENTION@", "cudnn_flash_jax"),
           description="MaxText's AttentionOp, attention=cudnn_flash_jax (installed maxtext; "
                       "maxtext <= 0.2.5 ignores segment ids, the window, chunks and soft "
                       "cap: expected to be caught / known)"),
    Kernel("maxtext:cudnn_flash_te",
           functools.partial(maxtext_attention, attention="cudnn_flash_te"),
           dtypes=CUDNN, devices=("gpu",), min_compute_capability=9.0,
           hlo_markers=TE_MARKERS, backward_markers=TE_BACKWARD_MARKERS,
           deterministic_env=TE_DETERMINISTIC, padding_output="zero",
           expect=CUDNN_FLASH_TE_EXPECT, expect_error=sinks_fallback_crash,
           **{**_COMMON, "requires": ("maxtext", "transformer_engine")},
           standalone=MAXTEXT_STANDALONE.replace("@ATTENTION@", "cudnn_flash_te"),
           description="MaxText's AttentionOp, attention=cudnn_flash_te (installed maxtext and "
                       "TE; maxtext <= 0.2.5 ignores chunks and the soft cap: known)"),
    # On GPUs MaxText's `flash` is tokamax's Pallas-Triton flash attention (apply_attention,
    # 1712-1740). tokamax 0.0.12's Triton kernel calls pl.dot, gone from jax 0.12 and
    # deprecated in 0.11 (harness.kernels.tokamax_adapter: raised when traced on the H200's
    # jax 0.11.2): a known upstream crash until that changes.
    # Its mask compares segment ids (1736): padding may sit anywhere.
    Kernel("maxtext:flash", functools.partial(maxtext_attention, attention="flash"),
           dtypes=CUDNN, head_dims=CUDNN_HEAD_DIMS, devices=("gpu",), padding_anywhere=True,
           min_compute_capability=8.0, hlo_markers=TRITON_MARKER, expect_error=TRITON_ERROR,
           expect=FLASH_EXPECT, **_COMMON,
           standalone=MAXTEXT_STANDALONE.replace("@ATTENTION@", "flash"),
           description="MaxText's AttentionOp, attention=flash on GPU: tokamax Pallas-Triton "
                       "(installed maxtext; tokamax 0.0.12 needs pl.dot, gone from jax >= 0.11: "
                       "known crash; maxtext <= 0.2.5 ignores the window, chunks and soft cap)"),
]
