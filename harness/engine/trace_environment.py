"""A library's settings from the environment while one of its programs is traced: the
environment a kernel declares for its deterministic build (Transformer Engine reads NVTE_*
settings when traced, and some when its kernels run) set for that trace only, under
ENVIRONMENT_LOCK, with jax's abstract-evaluation cache cleared around it."""
from __future__ import annotations

import contextlib
import os
import threading


@contextlib.contextmanager
def environment_set(values: dict):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _clear_abstract_eval_cache() -> None:
    from jax._src.interpreters import partial_eval as pe
    pe._cached_abstract_eval.cache_clear()


# Held while the environment is changed for a trace, and while a program of a kernel that
# declares a deterministic environment executes: a library that reads the environment when its
# kernels run (TE reads NVTE_* settings) must never see a trace's temporary setting. Other
# kernels' programs run without it (they need not wait for such a trace).
ENVIRONMENT_LOCK = threading.Lock()


@contextlib.contextmanager
def traced_under(env: dict | None):
    """Traces inside run with `env` set and with jax's abstract-evaluation cache cleared before
    and after, so that what the library read from the environment stays with that trace."""
    if not env:
        yield
        return
    with ENVIRONMENT_LOCK:
        _clear_abstract_eval_cache()
        try:
            with environment_set(env):
                yield
        finally:
            _clear_abstract_eval_cache()
