#!/usr/bin/env bash
# Bundles of the newer JAX attention libraries for the H200 runner (Python 3.12, jax 0.11.2 with
# the CUDA 13 plugin, sm_90, no package registry; ../shared/gpu/README.md), for the kernels of
# harness/kernels/dew_flash_attn.py, fa4.py and tokamax17.py. Run it from the project root on
# the CPU machine:
#
#   bash scripts/make_newlibs_bundles.sh [NAME...]      NAME: dew fa4 tokamax17 (default: all)
#
# It writes, under ${OUT:-.gpu} (keep /.gpu/ ignored):
#   dew/        dew-flash-attn-cu13 0.3.6. Its FlashAttention-2 library (338 MB: sm_80 and
#               sm_120 code only, no PTX; on sm_90 every call runs its FlashAttention-3 library)
#               has its whole fatbin zeroed with fatbin_keep_arch.py --keep 90. About 1.4 MB.
#   fa4/        fa4-jax 0.1.0 with cutejax, jax-tvm-ffi, apache-tvm-ffi, cuda-bindings and the
#               CuTe DSL (nvidia-cutlass-dsl 4.8.1 base, core and the cu13 libraries only: the
#               DSL picks the newest flavour the driver supports, CUDA 13 on driver 580). About
#               55 MiB; xz with the x86 filter and a 256 MiB dictionary takes ~7 minutes here.
#   tokamax17/  tokamax 0.0.17 and what it imports that the runner lacks (xprof without its web
#               UI and events_db library, fire, termcolor, pydantic, qwix, ...). About 12.5 MiB.
#   new/        activate.sh only: sources whichever of dew, fa4, tokamax17 sit beside it, so that
#               scripts/gpu.sh (which sources .gpu/new/activate.sh last) loads what was carried:
#               carry [".gpu/new", ".gpu/dew", ".gpu/fa4"] for example.
# Each bundle is site.tar.xz (the wheels unpacked and trimmed) and activate.sh, which unpacks it
# once into /tmp/<name>-site and puts that first on PYTHONPATH (tokamax17's 0.0.17 then shadows
# the maxtext bundle's 0.0.12; gpu.sh sources new/ after maxtext/). The end of the output is
# each bundle's size and which sets of bundles fit one 64 MiB upload beside the code.
#
# Environment: OUT (default .gpu); PY (the Python whose pip downloads, default python3.12 where
# it runs, else python3; the wheels are for CPython 3.12 manylinux x86_64 either way); FATBIN_KEEP_ARCH (path
# of fatbin_keep_arch.py, default shared/gpu/ or ../shared/gpu/); XZ_FAST=1 packs with
# `xz -T0 -6` (quicker, fa4 ~20 MB larger: 77 MB, over one upload).
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
out=${OUT:-.gpu}
names=("$@"); [ ${#names[@]} -gt 0 ] || names=(dew fa4 tokamax17)
for n in "${names[@]}"; do
  case "$n" in dew|fa4|tokamax17) ;; *) echo "make_newlibs_bundles.sh: unknown bundle '$n' (dew, fa4, tokamax17)" >&2; exit 2 ;; esac
done
if [ -z "${PY:-}" ]; then   # a pyenv shim may exist without its version selected: try each
  for PY in python3.12 python3; do "$PY" -m pip --version > /dev/null 2>&1 && break; done
fi
keep_arch=${FATBIN_KEEP_ARCH:-}
if [ -z "$keep_arch" ]; then
  for c in "$root/shared/gpu/fatbin_keep_arch.py" "$root/../shared/gpu/fatbin_keep_arch.py"; do
    [ -f "$c" ] && { keep_arch=$c; break; }
  done
fi
for tool in unzip xz readelf; do
  command -v "$tool" > /dev/null || { echo "make_newlibs_bundles.sh: needs $tool" >&2; exit 2; }
done
s=$(mktemp -d); trap 'rm -rf "$s"' EXIT

dl() {   # dl DIR REQUIREMENT...: wheels for CPython 3.12 manylinux x86_64, no dependencies
  local d=$1; shift
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$s/whl-$d" "$@"
}
unpack() { mkdir -p "$s/site-$1"; for w in "$s/whl-$1"/*.whl; do unzip -q -o "$w" -d "$s/site-$1"; done; }

pack() {   # pack NAME: site.tar.xz and activate.sh under $out/NAME
  local n=$1 dir=$out/$1
  mkdir -p "$dir"; rm -f "$dir/site.tar.xz"
  local xzopts=(-T1 --x86 --lzma2=preset=9e,dict=256MiB)   # the CuTe DSL's two LLVM builds share code
  [ "${XZ_FAST:-0}" = 1 ] && xzopts=(-T0 -6)
  find "$s/site-$n" -name __pycache__ -type d -prune -exec rm -rf {} +
  tar -cf - -C "$s/site-$n" --sort=name --owner=0 --group=0 --numeric-owner . | xz "${xzopts[@]}" > "$dir/site.tar.xz"
  cat > "$dir/activate.sh" <<ACT
# source this on the GPU runner (scripts/make_newlibs_bundles.sh): unpacks site.tar.xz once into
# /tmp/$n-site (again when the bundle changes) and puts it first on PYTHONPATH.
_nl_dir=\$(cd "\$(dirname "\${BASH_SOURCE[0]}")" && pwd)
_nl_stamp=\$(stat -c %s "\$_nl_dir/site.tar.xz")
if [ "\$(cat /tmp/$n-site/.bundle 2> /dev/null)" != "\$_nl_stamp" ]; then
  rm -rf /tmp/$n-site && mkdir -p /tmp/$n-site
  python3 -c "
import sys, tarfile
with tarfile.open(sys.argv[1]) as t:
    t.extractall(sys.argv[2], **({'filter': 'tar'} if hasattr(tarfile, 'tar_filter') else {}))
" "\$_nl_dir/site.tar.xz" /tmp/$n-site || return 1
  echo "\$_nl_stamp" > /tmp/$n-site/.bundle
fi
export PYTHONPATH=/tmp/$n-site\${PYTHONPATH:+:\$PYTHONPATH}
ACT
}

for n in "${names[@]}"; do
  case "$n" in
    dew)
      [ -n "$keep_arch" ] || { echo "make_newlibs_bundles.sh: fatbin_keep_arch.py not found (shared/gpu/; set FATBIN_KEEP_ARCH)" >&2; exit 2; }
      dl dew dew-flash-attn-cu13==0.3.6; unpack dew
      # The FA2 library's fatbin holds sm_80 and sm_120 ELF only: --keep 90 zeroes all of it
      # (the package still imports and reports its architectures). FA3's (sm_90) stays as is.
      python3 "$keep_arch" "$s/site-dew/dew_flash_attn/libdew_flash_attn.so" --keep 90 | tail -n 1
      pack dew
      # libdew_flash_attn*.so NEED libcudart.so.13 (RUNPATH $ORIGIN/../nvidia/cu13/lib, which
      # misses outside site-packages): the runner's nvidia-cuda-runtime (jax's CUDA 13 plugin).
      cat >> "$out/dew/activate.sh" <<'ACT'
_nl_rt=$(python3 -c "
import os
try:
    import nvidia; paths = list(nvidia.__path__)
except ImportError:
    paths = []
print(next((os.path.join(p, 'cu13', 'lib') for p in paths
            if os.path.exists(os.path.join(p, 'cu13', 'lib', 'libcudart.so.13'))), ''))" 2> /dev/null)
if [ -n "$_nl_rt" ]; then export LD_LIBRARY_PATH=$_nl_rt${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}; fi
ACT
      ;;
    fa4)
      dl fa4 fa4-jax==0.1.0 cutejax==0.1.5 jax-tvm-ffi==0.1.2 apache-tvm-ffi==0.1.15.post2 cuda-bindings==13.5.0 \
         cuda-pathfinder==1.9.1 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
         nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 jaxtyping==0.3.11 wadler-lindig==0.1.8
      unpack fa4
      # Never loaded on the runner: the DSL's profiler (iket), cuda-bindings' other modules
      # (nvml, cufile, cudla, the _v2 API, Cython headers), tvm-ffi's vendored sources, stubs.
      ( cd "$s/site-fa4" && rm -rf nvidia_cutlass_dsl/dsl_packages/iket cuda/bindings/_v2 cuda/bindings/*nvml* \
          cuda/bindings/*cufile* cuda/bindings/*cudla* tvm_ffi/3rdparty nvidia_cutlass_dsl/cu13/lib/stubs \
        && find . -name '*.pxd' -delete )
      pack fa4
      # The wheel's nvidia_cutlass_dsl_packages.pth is not read from a PYTHONPATH folder: without
      # its folder `import cutlass` fails (ModuleNotFoundError), so add it by hand.
      echo 'export PYTHONPATH=/tmp/fa4-site/nvidia_cutlass_dsl/dsl_packages:$PYTHONPATH' >> "$out/fa4/activate.sh"
      ;;
    tokamax17)
      dl tokamax17 tokamax==0.0.17 xprof==2.24.2 fire==0.7.1 termcolor==3.3.0 six==1.17.0 tqdm==4.70.1 \
         pydantic==2.14.4 pydantic-core==2.50.5 typing-inspection==0.4.5 annotated-types==0.8.0 qwix==0.1.8 \
         immutabledict==4.3.1 einshape==1.0 jaxtyping==0.3.11 wadler-lindig==0.1.8
      unpack tokamax17
      # tokamax imports xprof's kernel-stats tool at module scope; its web UI and events_db
      # library are never loaded.
      rm -rf "$s/site-tokamax17/xprof/static" "$s/site-tokamax17/xprof/convert/events_db/python/libpywrap_events_db_c_api.so"
      pack tokamax17
      ;;
  esac
done

mkdir -p "$out/new"
cat > "$out/new/activate.sh" <<'ACT'
# source this on the GPU runner (scripts/gpu.sh does, after the other bundles): loads whichever
# of the dew, fa4 and tokamax17 bundles were carried beside it.
_nl_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
for _nl_b in dew fa4 tokamax17; do
  if [ -f "$_nl_root/$_nl_b/activate.sh" ]; then source "$_nl_root/$_nl_b/activate.sh" || return 1; fi
done
true
ACT

# Sizes, and the sets of bundles that fit one upload (64 MiB) beside the code (the tracked and
# untracked files outside reports/, as the device tool sends the tree).
"$PY" - "$root" "$out" <<'PY'
import itertools, os, subprocess, sys
root, out = sys.argv[1], sys.argv[2]
out = out if os.path.isabs(out) else os.path.join(root, out)
MiB, LIMIT = 2**20, 64 * 2**20
def size(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
files = subprocess.run(["git", "-C", root, "ls-files", "-co", "--exclude-standard"],
                       capture_output=True, text=True).stdout.split("\n")
code = sum(os.path.getsize(os.path.join(root, f)) for f in files
           if f and not f.startswith("reports/") and os.path.isfile(os.path.join(root, f)))
bundles = {b: size(os.path.join(out, b)) for b in sorted(os.listdir(out))
           if os.path.isfile(os.path.join(out, b, "activate.sh"))}
for b, n in bundles.items():
    print(f"{out}/{b}: {n:,} bytes ({n / MiB:.1f} MiB)")
print(f"code without reports/: {code / MiB:.1f} MiB; one upload: 64 MiB")
new = {"dew", "fa4", "tokamax17"}
others = [b for b in bundles if b != "new"]
fits = [set(c) for r in range(len(others), 0, -1) for c in itertools.combinations(others, r)
        if new & set(c) and code + bundles.get("new", 0) + sum(bundles[b] for b in c) <= LIMIT]
maximal = [c for c in fits if not any(c < d for d in fits)]
for c in maximal:
    total = code + bundles.get("new", 0) + sum(bundles[b] for b in c)
    print(f"fits: {' + '.join(sorted(c))} + new + code = {total / MiB:.1f} MiB")
PY
