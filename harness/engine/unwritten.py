"""Memory a kernel leaves unwritten reads NaN, the same way every run.

A kernel that never writes some of its output (flash-attn-jax's vmap rule leaves the last row's
trailing padding out of every sequence) returns whatever its buffers held: the leftovers of
earlier programs of the process, zeros on one run and a stale gradient on the next. Judged as
found, the padding verdict of such a kernel flips from run to run on the same code.

So before a kernel's checked run, the allocator's blocks that run will take are filled with
0xFF bytes (NaN in every float type, -1 in the integer ones) and handed back: buffers of the
program's output sizes, then one of its temporary size, allocated in that order (XLA's order:
the outputs, then the temporaries), filled on the device, and freed once the fill is done. A
best-fit allocator (XLA's BFC on GPUs) hands the same blocks to the run's identical requests;
a kernel that writes every element it returns never sees them. What stays unwritten then
reads NaN: a padding or tolerance failure that names the tensor, instead of a verdict that
depends on what ran before. Only on GPUs (`Programs.poisons_unwritten`): on CPUs every kernel
here is XLA's own code.

Arguments are not touched, and nothing is kept: the fill's buffers are gone before the run.
The run's outputs must sit where the fill was (`landed`); where another thread took a block
first, the fill and the run are done once more.
"""
from __future__ import annotations

import contextlib
import threading

import jax
import jax.numpy as jnp
import numpy as np

from harness.compiling import compile_lowered

POISON_BYTE = 0xFF
_FILLS: dict[int, object] = {}     # bytes -> the compiled fill of that many bytes
_LOCK = threading.Lock()


def _fill(nbytes: int):
    """The compiled program that returns `nbytes` bytes of POISON_BYTE. On a GPU each compile
    takes about a tenth of a second, and a nightly needs hundreds of sizes: the compile
    threads build them ahead (`prepare`), beside the kernel programs they belong to."""
    with _LOCK:
        fill = _FILLS.get(nbytes)
    if fill is None:
        fill = compile_lowered(
            jax.jit(lambda: jnp.full((nbytes,), POISON_BYTE, jnp.uint8)).lower())
        with _LOCK:
            fill = _FILLS.setdefault(nbytes, fill)
    return fill


def prepare(sizes: list[int]) -> None:
    """Compiles the fills of these sizes now (a compile thread), not when a run needs them."""
    for n in sizes:
        _fill(n)


def buffer_sizes(compiled) -> list[int]:
    """Byte sizes of the blocks one run of `compiled` allocates, in allocation order: each
    output, then the temporaries (where the backend says how big they are). No blocks (an empty
    list) for a program over several devices (a sharded kernel): its blocks are per device, and this
    fills one device's allocator only."""
    outputs = jax.tree.leaves(compiled.out_info)
    if any(len(getattr(getattr(o, "sharding", None), "device_set", ())) > 1 for o in outputs):
        return []
    sizes = [int(np.prod(o.shape)) * np.dtype(o.dtype).itemsize for o in outputs]
    try:
        temp = int(compiled.memory_analysis().temp_size_in_bytes)
    except Exception:  # a backend without a memory analysis: the outputs alone
        temp = 0
    return [s for s in (*sizes, temp) if s > 0]


def poison(sizes: list[int]) -> set[int]:
    """Fill blocks of these sizes with POISON_BYTE and free them, the fill finished first;
    returns where they were (device addresses), for `landed`."""
    blocks = [_fill(n)() for n in sizes]
    jax.block_until_ready(blocks)
    where = set()
    for block in blocks:
        with contextlib.suppress(Exception):   # a backend without addresses: nothing to check
            where.add(block.unsafe_buffer_pointer())
        block.delete()
    return where


def landed(results, where: set[int]) -> bool:
    """Whether every result of the run sits in a block `poison` filled. Another thread may
    take a freed block first (a compile thread's autotuning, a garbage-collected array), and
    then the run gets a block nobody filled: the caller fills and runs once more."""
    if not where:
        return True
    try:
        return all(r.unsafe_buffer_pointer() in where for r in jax.tree.leaves(results))
    except Exception:   # a result over several devices, or no addresses: nothing to check
        return True
