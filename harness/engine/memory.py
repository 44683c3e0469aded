"""What an error's words say about device memory: whether a pair lacked it, and how much was
asked for (the runner's retry of a probe that did not fit, the deferral of a pair of the main
group's parts, harness.engine.main_parts)."""
from __future__ import annotations

import functools
import re

_MEMORY = re.compile(r"RESOURCE_EXHAUSTED|DoesNotFit|[Oo]ut of memory|ALLOC_FAILED|"
                     r"cudaErrorMemoryAllocation|GiB this device allows")
_UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def requested_bytes(message: str, words: str = "allocate") -> int | None:
    """The amount of memory a message says was asked for, after one of `words` (a regex
    alternation): XLA's out-of-memory error ("...allocate 128.07GiB.."), by default; the
    harness's DoesNotFit says "needs"."""
    found = re.search(rf"(?:{words})\s+([0-9.]+)\s*(B|KiB|MiB|GiB|TiB)", message)
    return int(float(found.group(1)) * _UNITS[found.group(2)]) if found else None


def memory_bound(text: str, main_bytes: int | None = None) -> bool:
    """Whether a record's message (or a worker's death) says the pair lacked device memory,
    and (where `main_bytes`, the main group's share, is known) no more than that share would
    give it: what would not fit there either is not worth running again."""
    if not _MEMORY.search(text or ""):
        return False
    amount = requested_bytes(text, "needs?|allocate")
    return main_bytes is None or amount is None or amount <= main_bytes


@functools.lru_cache(maxsize=1)
def device_memory_bytes() -> int | None:
    """What one program may use on the first device (its allocator's limit), if known."""
    import jax
    try:
        stats = jax.devices()[0].memory_stats() or {}
    except Exception:
        return None
    limit = stats.get("bytes_limit")
    return int(limit) if limit else None
