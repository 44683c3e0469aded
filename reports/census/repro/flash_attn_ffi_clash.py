#!/usr/bin/env python3
"""flash-attn-jax 0.6.2 and flash-attn3-jax 0.2.3 cannot share a process: both register XLA FFI
targets of the same names (flash_mha_fwd, ...), so whichever is imported second fails with
`Duplicate FFI handler registration`, and every call of that library then errors. Exits 1 while
the clash is there, 0 once both import in one process, 2 where one of them is not installed.

On the project's H200 runner: `source .gpu/fa/activate.sh && python3 flash_attn_ffi_clash.py`
(the bundle of ../shared/gpu/make_fa_bundle.sh; flash-attn-jax needs libcudart.so.12, which the
bundle's nvidia-cuda-runtime-cu12 brings: it is loaded first, as the harness's adapter does)."""
import ctypes
import importlib.util
import sys
from pathlib import Path


def load_cudart() -> None:
    spec = importlib.util.find_spec("nvidia.cuda_runtime")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        for lib in Path(folder, "lib").glob("libcudart.so.12*"):
            ctypes.CDLL(str(lib), mode=ctypes.RTLD_GLOBAL)
            return


def main() -> int:
    for name in ("flash_attn_jax", "flash_attn3_jax"):
        if importlib.util.find_spec(name) is None:
            print(f"cannot run here: {name} is not installed")
            return 2
    load_cudart()
    import flash_attn_jax  # noqa: F401  (FlashAttention-2 registers its FFI targets)
    print("flash_attn_jax imported")
    try:
        import flash_attn3_jax  # noqa: F401
    except Exception as exc:  # the clash
        print(f"FAILED: importing flash_attn3_jax after flash_attn_jax raises "
              f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
        return 1
    print("no clash: both libraries imported in one process")
    return 0


if __name__ == "__main__":
    sys.exit(main())
