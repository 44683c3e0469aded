"""A case: shapes, dtype, a segment layout and a seed. Its id reproduces it exactly."""
from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from harness.layouts import LAYOUTS, Segment, check_segment_ids

DTYPES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16"}
_SHORT = {v: k for k, v in DTYPES.items()}

# Scale of the random values written at padding positions. Padding must never reach a valid
# token; larger-than-data values there make any leak from padding stand out.
PADDING_POISON_SCALE = 8.0

_ID = re.compile(
    r"^(?P<layout>[a-z]+/[a-z-]+)-b(?P<batch>\d+)-t(?P<seq_len>\d+)-h(?P<heads>\d+)"
    r"kv(?P<kv_heads>\d+)-d(?P<head_dim>\d+)-(?P<dtype>[a-z0-9]+)-s(?P<seed>\d+)"
    r"(?P<bidir>-bidir)?$")


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

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; known: {', '.join(LAYOUTS)}")
        if self.dtype not in _SHORT:
            raise ValueError(f"unsupported dtype {self.dtype!r}; known: {', '.join(_SHORT)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")

    @property
    def id(self) -> str:
        return (f"{self.layout}-b{self.batch}-t{self.seq_len}-h{self.heads}kv{self.kv_heads}"
                f"-d{self.head_dim}-{_SHORT[self.dtype]}-s{self.seed}"
                + ("" if self.causal else "-bidir"))

    @classmethod
    def from_id(cls, case_id: str) -> "Case":
        m = _ID.match(case_id)
        if not m:
            raise ValueError(f"not a case id: {case_id!r}")
        g = m.groupdict()
        ints = {k: int(g[k]) for k in ("batch", "seq_len", "heads", "kv_heads", "head_dim", "seed")}
        dtype = DTYPES.get(g["dtype"])
        if dtype is None:
            raise ValueError(f"unknown dtype {g['dtype']!r} in case id {case_id!r}")
        return cls(layout=g["layout"], dtype=dtype, causal=not g["bidir"], **ints)

    @property
    def family(self) -> str:
        return self.layout.split("/")[0]

    @property
    def gqa(self) -> bool:
        return self.heads != self.kv_heads

    @property
    def scale(self) -> float:
        return 1.0 / math.sqrt(self.head_dim)

    @functools.cached_property
    def segment_ids(self) -> np.ndarray:
        return LAYOUTS[self.layout].segment_ids(self.batch, self.seq_len, self.seed)

    @functools.cached_property
    def segments(self) -> tuple[Segment, ...]:
        return tuple(check_segment_ids(self.segment_ids))

    @property
    def packed(self) -> bool:
        return any(s.number > 1 for s in self.segments)

    @property
    def max_segments(self) -> int:
        """The M a packed kernel is configured with: one more than the fullest row, so every
        case also has rows with fewer real segments than the maximum (as TE's tests do)."""
        return max(s.number for s in self.segments) + 1

    def segments_in_row(self, row: int) -> int:
        return sum(1 for s in self.segments if s.row == row)


@dataclass(frozen=True)
class Inputs:
    query: np.ndarray
    key: np.ndarray
    value: np.ndarray
    cotangent: np.ndarray  # for the output; zero at padding
    segment_ids: np.ndarray


def make_inputs(case: Case) -> Inputs:
    """Fresh standard-normal inputs drawn from the case's seed, rounded to its dtype.

    Padding positions of q, k and v hold larger random values (poison); the output cotangent is
    zero there, so a correct kernel's gradients never see them.
    """
    dtype = jnp.dtype(case.dtype)  # numpy has no bfloat16 of its own
    rng = np.random.default_rng([case.seed, 0xA77E])
    b, t = case.batch, case.seq_len
    valid = (case.segment_ids > 0)[:, :, None, None]

    def draw(heads):
        x = rng.standard_normal((b, t, heads, case.head_dim), dtype=np.float32)
        poison = PADDING_POISON_SCALE * rng.standard_normal(x.shape, dtype=np.float32)
        return np.where(valid, x, poison).astype(dtype)

    q, k, v = draw(case.heads), draw(case.kv_heads), draw(case.kv_heads)
    ct = rng.standard_normal(q.shape, dtype=np.float32) * valid
    return Inputs(q, k, v, ct.astype(dtype), case.segment_ids)
