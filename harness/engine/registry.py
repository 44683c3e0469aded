"""The registered kernels: the built-in ones (harness.kernels) and those a user adds with
`register_kernel`, directly or from a file (`--kernel-module PATH`)."""
from __future__ import annotations

import importlib.machinery
import importlib.util
import inspect
import re
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

from harness.errors import USER_CODE_RAISED, UsageError
from harness.kernels.kernel import Kernel
from harness.kernels.libraries import mark_absl_flags_parsed

_USER: dict[str, Kernel] = {}
_BUILTIN: dict[str, Kernel] | None = None


def _builtins() -> dict[str, Kernel]:
    global _BUILTIN
    if _BUILTIN is None:
        from harness.kernels.builtin import BUILTIN
        _BUILTIN = {k.name: k for k in BUILTIN}
    return _BUILTIN


def register_kernel(name: str, fn: Callable, *, replace: bool = False, **capabilities) -> Kernel:
    """Adds a kernel to the matrix. Capabilities are the fields of
    `harness.kernels.kernel.Kernel`."""
    if not isinstance(name, str) or not name or name != name.strip() or "," in name:
        raise ValueError(f"kernel name {name!r}: a name is non-empty text without commas or "
                         "surrounding spaces (--kernels selects it by that name)")
    if not (name.isascii() and name.isprintable()):
        # pytest escapes other characters in its test ids ('attn_\\xe9'), where the plugin
        # finds each test's pair by name: a run narrowed with -k or -n lost its lock and its
        # interrupted state (a review's 'attn_é').
        raise ValueError(f"kernel name {name!r}: a name is printable ASCII (pytest escapes "
                         "other characters in its test ids)")
    if not callable(fn):
        raise ValueError(f"kernel {name!r}: fn {fn!r} is not callable")
    if not replace and (name in _USER or name in _builtins()):
        raise ValueError(f"kernel {name!r} is already registered")
    dtypes = capabilities.get("dtypes")
    if isinstance(dtypes, list):   # what it declares, Kernel checks (a string is refused there)
        capabilities["dtypes"] = tuple(dtypes)
    try:
        kernel = Kernel(name=name, fn=fn, **capabilities)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"kernel {name!r}: {exc}") from None
    problem = signature_problem(fn, kernel.takes_max_segments, kernel.features,
                                defaults=kernel.constraints is None)
    if problem:
        raise ValueError(f"kernel {name!r}: {problem}")
    _USER[name] = kernel
    return kernel


def signature_problem(fn: Callable, takes_max_segments: bool = False,
                      features: tuple[str, ...] = (), defaults: bool = True) -> str | None:
    """Why `fn` cannot be called as a kernel (query, key, value, segment_ids, *, causal,
    scale[, max_segments], and a keyword per feature it declares: window, softcap, chunk,
    sinks), or None. Found when it is registered, not once per case (a kernel declaring the
    window without taking `window=` erred on every window case)."""
    from harness.model.features import HEAD_DIM_V
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None  # a builtin or C function: cannot tell, let the first call say
    args = [object()] * 4
    kwargs = {"causal": True, "scale": 1.0}
    if takes_max_segments:
        kwargs["max_segments"] = 4
    # Each declared feature is one keyword (harness.engine.program_functions); the value head
    # dim is the value's shape, no keyword.
    plain = dict(kwargs)
    kwargs.update({f: object() for f in features if f != HEAD_DIM_V})
    try:
        sig.bind(*args, **kwargs)
    except TypeError as exc:
        wanted = "fn(query, key, value, segment_ids, *, " + ", ".join(kwargs) + ")"
        return f"signature {sig} cannot be called as {wanted}: {exc}"
    # A case without a feature hands its keyword over not at all (feature_arguments): a
    # declared feature's keyword needs a default, or every case without it errs; `defaults`
    # False (the kernel's constraints may skip every case without it): not checked here.
    if not defaults:
        return None
    required = [f for f in kwargs if f not in plain and f in sig.parameters
                and sig.parameters[f].default is inspect.Parameter.empty
                and sig.parameters[f].kind is not inspect.Parameter.VAR_KEYWORD]
    if required:
        names = ", ".join(required)
        return (f"keyword(s) {names} of signature {sig} have no default: a case without the "
                f"feature leaves its keyword out, so give each a default ({required[0]}=None)")
    return None


_DOTTED = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def load_kernel_module(path: str | Path) -> None:
    """Imports a user's Python file (any name: `my_kernels.py`, `kernels_conf`) or an importable
    module (`my_pkg.kernels`) that calls register_kernel. A missing or broken file, a folder, or
    a module that registers no kernel is a UsageError of one line."""
    shown = str(path)
    file = Path(path).resolve()
    if file.is_dir():
        raise UsageError(f"--kernel-module {shown}: a folder; give a Python file that calls "
                         "harness.register_kernel")
    if not file.is_file():
        if _DOTTED.match(shown) and not shown.endswith(".py"):
            _import_module(shown)
            return
        raise UsageError(f"--kernel-module {shown}: no such file")
    # The path in the name: two files called kernels.py in two folders are two modules.
    import hashlib
    module_name = (f"harness_user_kernels_{file.stem}_"
                   f"{hashlib.sha1(str(file).encode()).hexdigest()[:8]}")
    if module_name in sys.modules:
        return
    mark_absl_flags_parsed()
    # An explicit source loader: a file need not end in .py.
    loader = importlib.machinery.SourceFileLoader(module_name, str(file))
    spec = importlib.util.spec_from_loader(module_name, loader)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    before = len(_USER)
    try:
        loader.exec_module(module)
    except SyntaxError as exc:
        del sys.modules[module_name]
        raise UsageError(f"--kernel-module {shown}:{exc.lineno}: SyntaxError: {exc.msg}") from None
    except UsageError:
        del sys.modules[module_name]
        raise
    except SystemExit as exc:
        del sys.modules[module_name]
        raise UsageError(exited(shown, exc)) from None
    except USER_CODE_RAISED as exc:   # an error, or pytest.importorskip/skip at its top
        del sys.modules[module_name]
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(file)]
        where = f":{frames[-1].lineno}" if frames else ""
        raise UsageError(f"--kernel-module {shown}{where}: {type(exc).__name__}: {exc}") from None
    if len(_USER) == before:
        raise UsageError(f"--kernel-module {shown}: the module registered no kernel (call "
                         "harness.register_kernel(name, fn, ...) in it)")


def exited(shown: str, exc: SystemExit) -> str:
    """The one line for a kernel module that ended the process while it was imported."""
    return (f"--kernel-module {shown}: it called sys.exit({exc.code!r}) while being imported (a "
            "script's main, or argparse reading the harness's command line?); a kernel module "
            "registers kernels and returns")


def _import_module(name: str) -> None:
    mark_absl_flags_parsed()
    before = len(_USER)
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise UsageError(f"--kernel-module {name}: no such file, and no importable module "
                         f"({exc})") from None
    except SystemExit as exc:
        raise UsageError(exited(name, exc)) from None
    except USER_CODE_RAISED as exc:
        raise UsageError(f"--kernel-module {name}: {type(exc).__name__}: {exc}") from None
    if len(_USER) == before and not getattr(module, "_harness_registered", False):
        raise UsageError(f"--kernel-module {name}: the module registered no kernel (call "
                         "harness.register_kernel(name, fn, ...) in it)")
    module._harness_registered = True  # imported once per process: a second load is a no-op


def all_kernels() -> dict[str, Kernel]:
    return {**_builtins(), **_USER}


def select_kernels(names: str | list[str] | None = None) -> list[Kernel]:
    """All kernels, or the ones named (comma-separated or a list); unknown names are a
    UsageError naming them."""
    kernels = all_kernels()
    if not names:
        return list(kernels.values())
    wanted = [n.strip() for n in (names.split(",") if isinstance(names, str) else names)]
    if not all(wanted):
        raise UsageError(f"kernel names {','.join(wanted)!r}: an empty name")
    unknown = [n for n in wanted if n not in kernels]
    if unknown:
        raise UsageError(f"unknown kernel{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(unknown)}; `python -m harness list` shows the "
                         f"{len(kernels)} registered (add yours with --kernel-module PATH)")
    return [kernels[n] for n in wanted]
