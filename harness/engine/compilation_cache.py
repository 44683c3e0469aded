"""jax's persistent compilation cache: turned on in a folder (`enable_compilation_cache`, the
option --compilation-cache or HARNESS_COMPILATION_CACHE; its default is
harness.engine.options.DEFAULT_CACHE_DIR), and this process's hits and misses as jax reports
them, with the compiles tried again after a host failure (harness.compiling) where there were
any (`cache_stats`: a run's header keeps them)."""
from __future__ import annotations

import os
import threading
from collections import defaultdict

import jax


def enable_compilation_cache(path: str | None) -> str | None:
    """jax's persistent compilation cache in `path` (a user's second run finds its programs
    compiled); None leaves it off. Every program is cached, however fast it compiled."""
    if not path:
        return None
    from harness.errors import UsageError
    given = path
    path = os.path.expanduser(path)
    # Named as the user gave it: the option, or the environment variable that set its default.
    name = ("HARNESS_COMPILATION_CACHE" if given == os.environ.get("HARNESS_COMPILATION_CACHE")
            else "--compilation-cache")
    if os.path.exists(path) and not os.path.isdir(path):
        raise UsageError(f"{name} {given}: a file, not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"{name} {given}: cannot create it ({exc.strerror})") from None
    # A folder it may not write: found now, not as a warning per program compiled.
    probe = os.path.join(path, f".write-test-{os.getpid()}")
    try:
        with open(probe, "w"):
            pass
        os.unlink(probe)
    except OSError as exc:
        raise UsageError(f"{name} {given}: cannot write in it ({exc.strerror}); give a folder "
                         "the run can write, or --no-compilation-cache") from None
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    return path


# jax's persistent cache, as jax reports it (its monitoring events): how many programs this
# process found compiled on disk, and how many it compiled and wrote. A run's header keeps
# them, so that a reader (and a script) tells a warm run from a cold one. Counted from the
# compile threads and the lowering processes' receiving threads at once: under a lock (`+=` on
# a dict entry is a read and a write another thread may come between).
_CACHE_EVENTS: dict[str, int] = defaultdict(int)
_CACHE_PREFIX = "/jax/compilation_cache/"
_COUNTING = threading.Lock()


def _count_cache_event(event: str, **_) -> None:
    if event.startswith(_CACHE_PREFIX):
        with _COUNTING:
            _CACHE_EVENTS[event[len(_CACHE_PREFIX):]] += 1


jax.monitoring.register_event_listener(_count_cache_event)


# Why the lowering process did not hand a program over: reason -> kernel (or "oracle") -> n.
_BUILT_HERE_WHY: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))


def count_handed_over(loaded: bool, name: str = "", why: str = "") -> None:
    """A program of kernel `name` the lowering process built (harness.engine.lowering_process):
    `loaded` here, or built here after it could not hand it over, for the reason `why`."""
    with _COUNTING:
        _CACHE_EVENTS["apart_loaded" if loaded else "apart_built_here"] += 1
        if not loaded:
            _BUILT_HERE_WHY[why or "unknown"][name] += 1


def count_left_unbuilt(name: str, why: str, built: bool = False) -> None:
    """A program of kernel `name` the lowering process could not build (`why`), left for the
    run to build if it asks for it (harness.engine.programs: a deterministic or forward build
    whose trace failed there); `built`: the run asked, and built it here after all."""
    with _COUNTING:
        _CACHE_EVENTS["apart_unasked"] += -1 if built else 1
    if built:
        count_handed_over(False, name, why)


def count_lowered_apart() -> None:
    """A program jax's cache lacks that the lowering process traced and lowered, compiled by
    the run (harness.engine.programs), not traced again."""
    with _COUNTING:
        _CACHE_EVENTS["apart_lowered"] += 1


def count_trace_error_handed_over() -> None:
    """A kernel's trace error the lowering process handed over: raised here, not traced again
    (harness.engine.lowering_process.load_raised); no cache lookup."""
    with _COUNTING:
        _CACHE_EVENTS["apart_raised"] += 1


def cache_stats() -> dict:
    """This process's compilation-cache lookups: hits (compiled programs read from disk, by
    this process or, for the programs it loaded, by its lowering process, which never
    compiles) and misses (compiled here, then written); `retried`, where any compile was tried
    again after the host could not start the compiler (harness.compiling);
    `lowering_process`, where one read programs for this process: how many it handed over
    (`loaded` here), how many it lowered that the cache lacks (`lowered`: compiled here, not
    traced again), how many programs' trace errors it handed over (`trace_errors`, a
    kernel's error per build: raised here, not traced again), and how many it could not
    (`built_here`), and why not (`why`: reason -> kernel -> programs); `unasked`, where
    some it could not build were never built here (the run never asked for them)."""
    from harness.compiling import retried
    with _COUNTING:   # one moment's counts, whatever threads count meanwhile
        events = dict(_CACHE_EVENTS)
        why = {w: dict(sorted(names.items())) for w, names in sorted(_BUILT_HERE_WHY.items())}
    stats = {"hits": events.get("cache_hits", 0) + events.get("apart_loaded", 0),
             "misses": events.get("cache_misses", 0)}
    tried_again = retried()   # read once: a compile thread may count one more meanwhile
    if tried_again:
        stats["retried"] = tried_again
    if any(events.get(k) for k in ("apart_loaded", "apart_built_here", "apart_raised",
                                   "apart_unasked", "apart_lowered")):
        stats["lowering_process"] = {
            "loaded": events.get("apart_loaded", 0),
            "lowered": events.get("apart_lowered", 0),
            "trace_errors": events.get("apart_raised", 0),
            "built_here": events.get("apart_built_here", 0),
            "why": why}
        if events.get("apart_unasked"):
            stats["lowering_process"]["unasked"] = events["apart_unasked"]
    return stats
