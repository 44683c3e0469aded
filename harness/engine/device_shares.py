"""How the device's memory is shared among worker groups running at once: each group's
environment (jax's allocator share and preallocation; the main group's parts, their share of
the host's cores), and how many groups run at a time. Moved out of harness.engine.workers,
which starts and watches the workers."""
from __future__ import annotations

import os

from harness.engine.main_parts import CORES_SHARE, MAIN_SHARE, MEM_FRACTION, is_part

DEVICE_SHARE = 0.93      # what the groups running at once may take together (shares)
AT_ONCE = 2              # groups running at once (the main group whole)
USER_MEMORY = (MEM_FRACTION, "XLA_PYTHON_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_ALLOCATOR")
PREALLOCATE = "XLA_PYTHON_CLIENT_PREALLOCATE"


def user_set_memory(environ=os.environ) -> bool:
    """Whether the user chose how jax takes a GPU's memory (a share under either of its names,
    or another allocator): the harness then sets no share of its own."""
    return any(name in environ for name in USER_MEMORY)


def at_once(group_names) -> int:
    """How many groups run at a time: AT_ONCE; with the main group in parts
    (harness.engine.main_parts), every part and one other group at a time."""
    names = list(group_names)
    parts = sum(map(is_part, names))
    return AT_ONCE if not parts else parts + (len(names) > parts)


def shares(group_names, environ=os.environ) -> dict | None:
    """The environment each group's workers add when the groups run at once, or None: run them
    one after another (the user chose how jax takes memory, or there is one group).

    At most `at_once` groups run at a time (`start_groups`), and their shares add up to
    DEVICE_SHARE at most: the rest of the GPU's memory is for what no allocator share covers
    (each process's CUDA context, loaded kernels, cuDNN's own buffers), whose allocations fail,
    mid-capture or mid-launch, on a full device. The main group whole (None) keeps XLA's
    default: 75% of a GPU's memory, taken at start, so its programs fit or not as in a run of
    its own; while it runs, one other group at a time takes memory as it needs it (no
    preallocation) up to what is left (DEVICE_SHARE less the main group's), and the rest wait
    their turn. A group that starts with no main group running (there is none, or it has
    finished) may take half of DEVICE_SHARE (`share`). With the main group in parts, the parts
    share the main group's 75% equally, each taking it as it needs it, and the other groups
    take turns beside them as beside the main group whole; every group's workers are told how
    many run at once (CORES_SHARE: each compiles on its share of the host's cores). On CPUs
    the memory settings are unused."""
    names = list(group_names)
    if len(names) < 2 or user_set_memory(environ):
        return None
    parts = sum(map(is_part, names))
    if parts:
        cores = {CORES_SHARE: str(at_once(names))}
        return {g: {**_fraction(MAIN_SHARE / parts if is_part(g) else DEVICE_SHARE - MAIN_SHARE),
                    **cores} for g in names}
    return {g: {} if g is None else share(main_running=None in names) for g in names}


def share(*, main_running: bool) -> dict:
    """The environment of a group other than the main one, started beside the main group
    whole or not (see shares)."""
    return _fraction(DEVICE_SHARE - MAIN_SHARE if main_running else DEVICE_SHARE / AT_ONCE)


def _fraction(fraction: float) -> dict:
    return {MEM_FRACTION: f"{round(fraction, 3):.3f}", PREALLOCATE: "false"}
