"""The kernel under test as Python source for a standalone script: its `standalone` source, or
an import of its function (by module name, or a user's kernel file loaded by its path)."""
from __future__ import annotations

import ast
import functools
import sys
from pathlib import Path

from harness.errors import UsageError
from harness.kernels.kernel import Kernel


def literal(value) -> str:
    """`value` as a Python literal that reads back equal; a UsageError if there is none."""
    text = repr(value)
    try:
        if ast.literal_eval(text) == value:
            return text
    except (ValueError, SyntaxError):
        pass
    raise UsageError(f"cannot write {value!r} into a script as a literal")


def _importable(kernel: Kernel, fn) -> tuple[str, str, object]:
    """(module name, qualified name, module) of the kernel's function; a UsageError if it
    cannot be imported by name."""
    module_name = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    module = sys.modules.get(module_name or "")
    resolved = module
    for part in (qualname or "<none>").split("."):
        resolved = getattr(resolved, part, None)
    if module is None or module_name == "__main__" or "<" in (qualname or "<") \
            or resolved is not fn:
        raise UsageError(f"{kernel.name}: its function {fn!r} cannot be imported by name (a "
                         "lambda, a local function or __main__); give the Kernel a standalone= "
                         "source")
    return module_name, qualname, module


def _load_by_path(user_file: str, module_name: str, qualname: str) -> tuple[list, list]:
    """(imports, lines) that load a user's kernel file (--kernel-module) by its path."""
    path = str(Path(user_file).resolve())
    source = Path(path).read_text() if Path(path).is_file() else ""
    imports, lines = ["import importlib.util"], []
    if "harness" in source:
        imports += ["import types"]
        lines += [
            "if importlib.util.find_spec(\"harness\") is None:",
            "    # The file registers its kernel with attention-harness, which is not "
            "installed here:",
            "    # a stand-in whose register_kernel does nothing lets it load.",
            "    _harness = types.ModuleType(\"harness\")",
            "    _harness.register_kernel = lambda *args, **kwargs: None",
            "    sys.modules[\"harness\"] = _harness",
            "",
        ]
    lines += [
        "# The kernel's own file (given to the harness with --kernel-module), loaded by its "
        "path.",
        f"_KERNEL_FILE = {path!r}",
        f"_spec = importlib.util.spec_from_file_location({module_name!r}, _KERNEL_FILE)",
        "_kernel_module = importlib.util.module_from_spec(_spec)",
        "sys.modules[_spec.name] = _kernel_module",
        "_spec.loader.exec_module(_kernel_module)",
        f"_kernel_fn = _kernel_module.{qualname}",
    ]
    return imports, lines


def kernel_source(kernel: Kernel) -> tuple[str, bool]:
    """(Python source defining `kernel(...)`, whether it needs the harness on the path)."""
    if kernel.standalone is not None:
        return kernel.standalone.rstrip() + "\n", False
    fn, args, keywords = kernel.fn, (), {}
    if isinstance(fn, functools.partial):
        fn, args, keywords = fn.func, fn.args, fn.keywords
    module_name, qualname, module = _importable(kernel, fn)
    partial = bool(args or keywords)
    imports, lines = ["import functools"] if partial else [], []
    user_file = getattr(module, "__file__", None)
    by_path = module_name.startswith("harness_user_kernels_") and user_file
    if by_path:
        more_imports, lines = _load_by_path(user_file, module_name, qualname)
        imports += more_imports
    else:
        head, _, rest = qualname.partition(".")
        imports += [f"from {module_name} import {head} as _kernel_fn"]
        if rest:
            lines += [f"_kernel_fn = _kernel_fn.{rest}"]
    if partial:
        call = ", ".join([literal(a) for a in args]
                         + [f"{k}={literal(v)}" for k, v in keywords.items()])
        lines += [f"kernel = functools.partial(_kernel_fn, {call})"]
    else:
        lines += ["kernel = _kernel_fn"]
    needs_harness = not by_path and module_name.split(".")[0] == "harness"
    return "\n".join(imports) + "\n\n" + "\n".join(lines) + "\n", needs_harness
