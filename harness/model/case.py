"""A case: shapes, dtype, mask, a segment layout and a seed. Its id reproduces it exactly."""
from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from harness.ahead import ahead
from harness.model.features import Features
from harness.model.layouts import (
    CUSTOM,
    LAYOUTS,
    Segment,
    check_segment_ids,
    segment_ids_from_rows,
)

DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
_SHORT = {v: k for k, v in DTYPES.items()}

# Scale of the random values written at padding positions. Padding must never reach a valid
# token; larger-than-data values there make any leak from padding stand out.
PADDING_POISON_SCALE = 8.0
# Mixed into a case's seed for its inputs (standalone repro scripts draw the same).
INPUT_SALT = 0xA77E
# The forward-mode check's input tangents are drawn from a stream of their own: the inputs of
# every case stay what they were.
TANGENT_SALT = 0x7A9E
# The sinks' mean: a sink logit near the largest scores of a row, so that it takes a visible
# share of the softmax's mass (scores are about standard normal).
SINK_MEAN = 1.0

_ID = re.compile(
    r"^(?P<layout>[a-z]+/[a-z-]+)-b(?P<batch>\d+)-t(?P<seq_len>\d+)-h(?P<heads>\d+)"
    r"kv(?P<kv_heads>\d+)-d(?P<head_dim>\d+)-(?P<dtype>[a-z0-9]+)-s(?P<seed>\d+)"
    r"(?P<bidir>-bidir)?(?P<features>(?:-w\d+\.\d+|-cap\d+(?:\.\d+)?|-ch\d+|-sink|-dv\d+)*)"
    r"(?:-r(?P<rows>[0-9p.,]+))?$")


def _rows_text(rows) -> str:
    return ",".join(".".join(str(n) if n > 0 else f"p{-n}" for n in row) for row in rows)


def _rows_parse(text: str) -> tuple[tuple[int, ...], ...]:
    return tuple(tuple(-int(x[1:]) if x.startswith("p") else int(x) for x in row.split(".") if x)
                 for row in text.split(","))


@dataclass(frozen=True)
class Case:
    layout: str
    batch: int
    seq_len: int
    heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    seed: int
    causal: bool = True
    # Only for layout custom/rows: each row's runs (segment_ids_from_rows).
    rows: tuple[tuple[int, ...], ...] | None = None
    # What else the case asks for beyond the same-segment mask (harness.model.features).
    features: Features = Features()

    def __post_init__(self):
        if self.layout != CUSTOM and self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; known: {', '.join(LAYOUTS)}")
        if (self.layout == CUSTOM) != (self.rows is not None):
            raise ValueError(f"rows are given exactly for layout {CUSTOM}")
        if self.rows is not None and len(self.rows) != self.batch:
            raise ValueError(f"{len(self.rows)} rows for batch {self.batch}")
        if self.dtype not in _SHORT:
            raise ValueError(f"unsupported dtype {self.dtype!r}; known: {', '.join(_SHORT)}")
        if min(self.batch, self.seq_len, self.heads, self.kv_heads, self.head_dim) < 1:
            raise ValueError("batch, seq_len, heads, kv_heads and head_dim must be >= 1")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.features.head_dim_v == self.head_dim:
            raise ValueError(f"head_dim_v {self.features.head_dim_v} is the head dim: a value "
                             "head dim of its own differs from the query's")
        if self.causal and self.features.window is not None and self.features.window[1]:
            raise ValueError(f"window {self.features.window}: a causal mask reads nothing "
                             "ahead (right size 0)")

    @property
    def id(self) -> str:
        return (f"{self.layout}-b{self.batch}-t{self.seq_len}-h{self.heads}kv{self.kv_heads}"
                f"-d{self.head_dim}-{_SHORT[self.dtype]}-s{self.seed}"
                + ("" if self.causal else "-bidir") + self.features.suffix
                + ("" if self.rows is None else f"-r{_rows_text(self.rows)}"))

    @classmethod
    def from_id(cls, case_id: str) -> Case:
        m = _ID.match(case_id)
        if not m:
            raise ValueError(f"not a case id: {case_id!r} (ids look like "
                             "packed/random-b4-t256-h4kv2-d64-bf16-s0)")
        g = m.groupdict()
        ints = {k: int(g[k]) for k in ("batch", "seq_len", "heads", "kv_heads", "head_dim", "seed")}
        dtype = DTYPES.get(g["dtype"])
        if dtype is None:
            raise ValueError(f"unknown dtype {g['dtype']!r} in case id {case_id!r}")
        rows = _rows_parse(g["rows"]) if g["rows"] else None
        return cls(layout=g["layout"], dtype=dtype, causal=not g["bidir"], rows=rows,
                   features=Features.parse(g["features"] or ""), **ints)

    def with_seed(self, seed: int) -> Case:
        return dataclasses.replace(self, seed=seed)

    @property
    def family(self) -> str:
        return self.layout.split("/")[0]

    @property
    def gqa(self) -> bool:
        return self.heads != self.kv_heads

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @property
    def value_dim(self) -> int:
        """The value's (and output's) head dim: head_dim unless the case asks for its own."""
        return self.features.head_dim_v or self.head_dim

    @property
    def shape_key(self) -> tuple:
        """What a compiled program depends on: cases that share it share programs."""
        key = (self.batch, self.seq_len, self.heads, self.kv_heads, self.head_dim, self.dtype,
               self.causal)
        return key + (self.features,) if self.features else key

    @functools.cached_property
    def segment_ids(self) -> np.ndarray:
        if self.rows is not None:
            return segment_ids_from_rows(self.rows, self.seq_len)
        return LAYOUTS[self.layout].segment_ids(self.batch, self.seq_len, self.seed)

    @functools.cached_property
    def segments(self) -> tuple[Segment, ...]:
        return tuple(check_segment_ids(self.segment_ids, padding="anywhere"))

    @property
    def packed(self) -> bool:
        return any(s.number > 1 for s in self.segments)

    @functools.cached_property
    def padding_inside(self) -> bool:
        """Padding before a segment somewhere (left padding, or between segments)."""
        valid = self.segment_ids > 0
        later_valid = np.flip(np.logical_or.accumulate(np.flip(valid, 1), 1), 1)
        return bool((~valid & later_valid).any())

    @property
    def max_segments(self) -> int:
        """The M a packed kernel is configured with: at least one more than the fullest row, so
        every case also has rows with fewer real segments than the maximum (as TE's tests do),
        rounded up to a power of two so that cases of one shape share compiled programs."""
        need = max(s.number for s in self.segments) + 1
        return max(4, 1 << (need - 1).bit_length())

    def row_segments(self, row: int) -> list[Segment]:
        return [s for s in self.segments if s.row == row]

    def segments_in_row(self, row: int) -> int:
        return len(self.row_segments(row))


@dataclass(frozen=True, eq=False)
class Inputs:
    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    cotangent: np.ndarray  # for the output; zero at padding
    segment_ids: np.ndarray
    sinks: np.ndarray | None = None   # float32 [heads], where the case has sinks

    @property
    def args(self) -> tuple:
        """A kernel program's arguments, in order: q, k, v, segment ids[, sinks], cotangent."""
        sinks = () if self.sinks is None else (self.sinks,)
        return self.query, self.key, self.value, self.segment_ids, *sinks, self.cotangent

    @functools.cached_property
    def device_args(self) -> tuple:
        """The arguments on the device, moved there once for every kernel and run of a case."""
        import jax
        return tuple(jax.device_put(a) for a in self.args)


def make_inputs(case: Case) -> Inputs:
    """Fresh standard-normal inputs drawn from the case's seed, rounded to its dtype (made once
    per case: the kernels and the oracle read the same arrays).

    Padding positions of q, k and v hold larger random values (poison); the output cotangent is
    zero there, so a correct kernel's gradients never see them.

    What is drawn depends on the case's shape, layout and seed, its sinks and its value head
    dim, not on the rest of its mask: a case and the case less its window, soft cap or chunks
    (a diagnosis's, a prediction's) share one draw (on the H200 nightly's run thread, drawing
    those again took 9 s).
    """
    features = case.features
    if features.window is not None or features.softcap is not None or features.chunk is not None:
        case = dataclasses.replace(case, features=Features(sinks=features.sinks,
                                                           head_dim_v=features.head_dim_v))
    return _drawn(case)


def forget_inputs() -> None:
    """Lets go of the inputs kept (the last 8 cases' draws)."""
    _drawn.cache_clear()


@functools.lru_cache(maxsize=8)
def _drawn(case: Case) -> Inputs:
    dtype = jnp.dtype(case.dtype)  # numpy has no bfloat16 of its own
    rng = np.random.default_rng([case.seed, INPUT_SALT])
    b, t = case.batch, case.seq_len
    valid = (case.segment_ids > 0)[:, :, None, None]

    pad = ~valid[:, :, 0, 0]

    def draw(heads, dim=case.head_dim):
        x = rng.standard_normal((b, t, heads, dim), dtype=np.float32)
        poison = rng.standard_normal(x.shape, dtype=np.float32)
        x[pad] = PADDING_POISON_SCALE * poison[pad]   # in place: padding is a small part
        return x.astype(dtype)

    q, k, v = draw(case.heads), draw(case.kv_heads), draw(case.kv_heads, case.value_dim)
    ct = rng.standard_normal((b, t, case.heads, case.value_dim), dtype=np.float32)
    ct[pad] = 0.0
    # A learnable logit per query head, drawn after everything else (cases without sinks draw
    # what they always drew): around the scores' own scale, so that a sink takes a share of the
    # mass worth seeing, never all of it.
    sinks = (rng.standard_normal(case.heads, dtype=np.float32) + SINK_MEAN
             if case.features.sinks else None)
    return Inputs(q, k, v, ct.astype(dtype), case.segment_ids, sinks)


def device_seed(case: Case) -> np.uint32:
    """The case's seed as jax.random.PRNGKey takes it inside a jitted draw (any seed a case id
    carries, folded to 32 bits)."""
    return np.uint32(case.seed % 2**32)


@functools.lru_cache(maxsize=8)
def make_tangents(case: Case) -> tuple:
    """The input tangents of the forward-mode (jvp) check, on the device: standard normal for q,
    k and v in the case's dtype (larger at padding positions, as the inputs there: a correct
    kernel's tangent at valid tokens never sees them), and for the sinks (float32) where the
    case has them; drawn on the device (jax.random) from the case's seed. (Drawn with numpy on
    the host, they cost the H200 nightly's worker 9 s on the run's thread.)"""
    return tangents_program(device_seed(case), case.segment_ids == 0, **tangent_statics(case))


def tangent_statics(case: Case) -> dict:
    """tangents_program's static arguments for the case."""
    return dict(heads=case.heads, kv_heads=case.kv_heads, head_dim=case.head_dim,
                value_dim=case.value_dim, dtype=case.dtype, sinks=bool(case.features.sinks))


@ahead(static_argnames=("heads", "kv_heads", "head_dim", "value_dim", "dtype", "sinks"))
def tangents_program(seed, pad, *, heads, kv_heads, head_dim, value_dim, dtype, sinks):
    # A draw for each of four keys. One draw cut in four (normals) compiles faster, but draws
    # other tangents: every jvp check's error moves, and a baseline's regression gate reads
    # the moves as growth (four of the CPU smoke's jvp checks past 2x of a two-run baseline).
    keys = jax.random.split(jax.random.fold_in(jax.random.PRNGKey(seed), TANGENT_SALT), 4)
    b, t = pad.shape
    scale = jnp.where(pad, PADDING_POISON_SCALE, 1.0)[:, :, None, None]

    def draw(key, n, dim):
        return (jax.random.normal(key, (b, t, n, dim), jnp.float32) * scale).astype(dtype)

    out = [draw(keys[0], heads, head_dim), draw(keys[1], kv_heads, head_dim),
           draw(keys[2], kv_heads, value_dim)]
    if sinks:
        out.append(jax.random.normal(keys[3], (heads,), jnp.float32))
    return tuple(out)


def normals(key, shapes: list) -> list:
    """Standard normal float32 arrays of `shapes`, cut in order from one draw of their total
    size: one threefry program, not one per array (on CPUs XLA took 1.5 s to compile the leak
    probe's four draws of a smoke case's perturbation, 0.3 s as one)."""
    sizes = [math.prod(s) for s in shapes]
    flat = jax.random.normal(key, (sum(sizes),), jnp.float32)
    ends = np.cumsum(sizes)
    return [flat[end - n:end].reshape(s) for s, n, end in zip(shapes, sizes, ends)]
