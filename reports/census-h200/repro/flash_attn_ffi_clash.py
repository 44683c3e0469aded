#!/usr/bin/env python3
"""flash-attn-jax 0.6.2 and flash-attn3-jax 0.2.3 cannot share a process: both register XLA FFI
targets of the same names (flash_mha_fwd, ...), so whichever is imported second fails with
`Duplicate FFI handler registration`, and every call of that library then errors. Exits 1 while
the clash is there (at import, when the backend starts, or when a call runs), 0 once both
import and run in one process, 2 where one of them is not installed.

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
    import flash_attn_jax  # (FlashAttention-2 registers its FFI targets)
    print("flash_attn_jax imported")
    try:
        import flash_attn3_jax
    except Exception as exc:  # the clash, at import
        print(f"FAILED: importing flash_attn3_jax after flash_attn_jax raises "
              f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
        return 1
    print("flash_attn3_jax imported")
    # jax registers a platform's FFI targets when that platform's backend starts: a duplicate
    # name may only show there, or when a call is compiled. Start it, then call each library.
    import jax
    import jax.numpy as jnp
    failed = []
    try:
        print(f"backend: {jax.devices()[0].device_kind} x {jax.device_count()}")
    except Exception as exc:
        failed.append(f"starting the backend raises {type(exc).__name__}: "
                      f"{str(exc).splitlines()[0][:300]}")
    q = jnp.ones((1, 128, 1, 128), jnp.bfloat16)
    for name, library in (("flash_attn_jax", flash_attn_jax), ("flash_attn3_jax", flash_attn3_jax)):
        try:
            out = jax.block_until_ready(jax.jit(library.flash_mha)(q, q, q))
            print(f"{name}.flash_mha ran: output {out.shape} {out.dtype}")
        except Exception as exc:
            failed.append(f"{name}.flash_mha raises {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0][:300]}")
    if failed:
        for line in failed:
            print("FAILED: " + line)
        return 1
    print("no clash: both libraries imported, registered and ran in one process")
    return 0


if __name__ == "__main__":
    sys.exit(main())
