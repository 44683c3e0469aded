"""The registered kernels: the built-in ones (harness.kernels) and those a user adds with
`register_kernel`, directly or from a file (`--kernel-module PATH`)."""
from __future__ import annotations

import importlib.util
import sys
import traceback
from pathlib import Path
from typing import Callable

from harness.errors import UsageError
from harness.engine.kernel import ALL_DTYPES, Kernel

_USER: dict[str, Kernel] = {}
_BUILTIN: dict[str, Kernel] | None = None


def _builtins() -> dict[str, Kernel]:
    global _BUILTIN
    if _BUILTIN is None:
        from harness.kernels import BUILTIN
        _BUILTIN = {k.name: k for k in BUILTIN}
    return _BUILTIN


def register_kernel(name: str, fn: Callable, *, replace: bool = False, **capabilities) -> Kernel:
    """Adds a kernel to the matrix. Capabilities are the fields of `harness.engine.kernel.Kernel`."""
    if not replace and (name in _USER or name in _builtins()):
        raise ValueError(f"kernel {name!r} is already registered")
    dtypes = capabilities.get("dtypes")
    if dtypes is not None:
        unknown = set(dtypes) - set(ALL_DTYPES)
        if unknown:
            raise ValueError(f"kernel {name!r}: unknown dtypes {sorted(unknown)}")
        capabilities["dtypes"] = tuple(dtypes)
    try:
        kernel = Kernel(name=name, fn=fn, **capabilities)
    except TypeError as exc:
        raise ValueError(f"kernel {name!r}: {exc}") from None
    _USER[name] = kernel
    return kernel


def mark_absl_flags_parsed() -> None:
    """Outside kernels are often built on libraries that read absl flags (tokamax, MaxText,
    paxml). Unparsed, they raise or parse this process's own argv (`--suite ...`) and fail on
    options that are not theirs. The harness owns the command line: the libraries get their
    flags' defaults."""
    if importlib.util.find_spec("absl") is None:
        return
    from absl import flags
    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def load_kernel_module(path: str | Path) -> None:
    """Imports a user's Python file that calls register_kernel; a missing or broken file is a
    UsageError of one line."""
    shown = path
    path = Path(path).resolve()
    if not path.is_file():
        raise UsageError(f"--kernel-module {shown}: no such file")
    module_name = f"harness_user_kernels_{path.stem}"
    if module_name in sys.modules:
        return
    mark_absl_flags_parsed()
    spec = importlib.util.spec_from_file_location(module_name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as exc:
        del sys.modules[module_name]
        raise UsageError(f"--kernel-module {shown}:{exc.lineno}: SyntaxError: {exc.msg}") from None
    except Exception as exc:
        del sys.modules[module_name]
        frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename == str(path)]
        where = f":{frames[-1].lineno}" if frames else ""
        raise UsageError(f"--kernel-module {shown}{where}: {type(exc).__name__}: {exc}") from None


def all_kernels() -> dict[str, Kernel]:
    return {**_builtins(), **_USER}


def select_kernels(names: str | list[str] | None = None) -> list[Kernel]:
    """All kernels, or the ones named (comma-separated or a list); unknown names are a
    UsageError naming them."""
    kernels = all_kernels()
    if not names:
        return list(kernels.values())
    wanted = [n.strip() for n in (names.split(",") if isinstance(names, str) else names)
              if n.strip()]
    unknown = [n for n in wanted if n not in kernels]
    if unknown:
        raise UsageError(f"unknown kernel{'s' if len(unknown) > 1 else ''} "
                         f"{', '.join(unknown)}; `python -m harness list` shows the "
                         f"{len(kernels)} registered (add yours with --kernel-module PATH)")
    return [kernels[n] for n in wanted]
