#!/usr/bin/env bash
# Build, link and load the CUDA extension (angle_kernels._C) against a CUDA build of torch, on a machine
# without a GPU. Not part of CI: it downloads a CUDA torch with its nvidia packages (several GB).
#
#     bash scripts/check_cuda_build.sh [WORK_DIR]        (default /tmp/angle_kernels_cuda_check)
#
# What it proves, step by step (each step prints what it found; the first failure stops the script):
#   1. a throwaway virtual environment in WORK_DIR/venv gets a CUDA torch from PyPI (pip's configuration is
#      switched off so the machine's CPU-wheel folder is not used): TORCH_CUDA_SPEC, default torch==2.13.0;
#   2. its CUDA major version matches nvcc's (torch's extension builder refuses a mismatch);
#   3. `setup.py build_ext` builds the extension exactly as `pip install --no-build-isolation .` would, with
#      torch's own compiler flags (ANGLE_KERNELS_BUILD_CUDA=1: a compile failure fails this step), for
#      TORCH_CUDA_ARCH_LIST (default "8.0;8.6;8.9;9.0", as setup.py);
#   4. the op schemas are defined (importing the cuda_ops op modules), then torch.ops.load_library loads the
#      .so: that runs its TORCH_LIBRARY_IMPL registration, which fails if a C++ signature does not match its
#      schema, and the script checks that every op now has a CUDA kernel.
# Torch imports without a GPU, so link errors (undefined symbols) and registration errors show up here;
# running the kernels needs a GPU (tests/ops -k cuda, scripts/gpu_check.sh).
#
# The sources are copied to WORK_DIR/src first (the tracked and untracked, not ignored files of this
# checkout), so the build leaves nothing in the repository.
set -euo pipefail
case "${1:-}" in  # the comment above, not a WORK_DIR named --help
  -h|--help) awk 'NR > 1 && !/^#/ {exit} NR > 1 {sub(/^# ?/, ""); print}' "$0"; exit 0 ;;
esac
REPO=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-${ANGLE_CUDA_CHECK_DIR:-/tmp/angle_kernels_cuda_check}}
TORCH_CUDA_SPEC=${TORCH_CUDA_SPEC:-torch==2.13.0}
export TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-8.0;8.6;8.9;9.0}
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
mkdir -p "$WORK"
started=$(date +%s)
step() { echo; echo "== [$(( $(date +%s) - started ))s] $*"; }

NVCC=$(command -v nvcc || true)
if [ -n "${CUDA_HOME:-}" ] && [ -x "$CUDA_HOME/bin/nvcc" ]; then NVCC="$CUDA_HOME/bin/nvcc"; fi
if [ -z "$NVCC" ]; then echo "nvcc not found: install the CUDA toolkit or set CUDA_HOME" >&2; exit 1; fi
NVCC_RELEASE=$("$NVCC" --version | sed -n 's/.*release \([0-9][0-9]*\.[0-9][0-9]*\).*/\1/p')
# torch's builder looks for the toolkit in CUDA_HOME, else next to `which nvcc`; /usr/local/bin/nvcc can be a
# wrapper, so point it at the real toolkit when there is one.
if [ -z "${CUDA_HOME:-}" ] && [ -x /usr/local/cuda/bin/nvcc ]; then export CUDA_HOME=/usr/local/cuda; fi
step "nvcc $NVCC_RELEASE ($NVCC), CUDA_HOME=${CUDA_HOME:-unset}"

step "1. virtual environment with a CUDA torch ($TORCH_CUDA_SPEC) in $WORK/venv"
if [ ! -x "$WORK/venv/bin/python" ]; then python3 -m venv "$WORK/venv"; fi
PY="$WORK/venv/bin/python"
PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS="" PIP_DISABLE_PIP_VERSION_CHECK=1 \
  "$PY" -m pip install -q "$TORCH_CUDA_SPEC" "setuptools>=77" ninja numpy
"$PY" - <<'EOF'
import torch
print(f"torch {torch.__version__}, torch.version.cuda={torch.version.cuda}, "
      f"torch.cuda.is_available()={torch.cuda.is_available()}")
EOF

step "2. CUDA versions"
TORCH_CUDA=$("$PY" -c 'import torch; print(torch.version.cuda or "")')
if [ -z "$TORCH_CUDA" ]; then echo "this torch is a CPU build: pick a CUDA build with TORCH_CUDA_SPEC" >&2; exit 1; fi
if [ "${TORCH_CUDA%%.*}" != "${NVCC_RELEASE%%.*}" ]; then
  echo "torch is built for CUDA $TORCH_CUDA but nvcc is $NVCC_RELEASE: choose a torch whose CUDA major" \
       "version matches (TORCH_CUDA_SPEC)" >&2
  exit 1
fi
echo "torch CUDA $TORCH_CUDA, nvcc $NVCC_RELEASE: same major version"

step "3. setup.py build_ext (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST, MAX_JOBS=$MAX_JOBS)"
rm -rf "$WORK/src"
mkdir -p "$WORK/src"
(cd "$REPO" && git ls-files -z --cached --others --exclude-standard | xargs -0 tar -cf - 2>/dev/null) \
  | tar -xf - -C "$WORK/src"
(cd "$WORK/src" && ANGLE_KERNELS_BUILD_CUDA=1 "$PY" setup.py -q build_ext --inplace 2>&1 | tail -n 40)
SO=$(ls "$WORK"/src/angle_kernels/_C*.so 2>/dev/null | head -n 1 || true)
if [ -z "$SO" ]; then echo "the build produced no angle_kernels/_C*.so" >&2; exit 1; fi
ls -l "$SO"

step "4. load the extension and check its registrations"
(cd "$WORK/src" && "$PY" - "$SO" <<'EOF'
import importlib
import sys

import torch

so = sys.argv[1]
from angle_kernels.cuda_ops import _extension

_extension.define_schemas()  # the angle_kernels::cuda_* schemas first: the kernels attach to them

defined = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("angle_kernels::cuda_"))
torch.ops.load_library(so)  # dlopen: undefined symbols and C++/schema signature mismatches raise here
importlib.import_module("angle_kernels._C")  # what the package does: the same library, as a Python module
print(f"loaded {so}")
missing = [op for op in defined if not torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA")]
print(f"schemas: {', '.join(defined)}")
if not defined or missing:
    sys.exit(f"no CUDA kernel registered for: {missing or 'any op (no schemas defined)'}")
print(f"every one of the {len(defined)} ops has a CUDA kernel (torch {torch.__version__}, CUDA {torch.version.cuda})")
EOF
)
step "done: the extension builds, links and registers against torch $("$PY" -c 'import torch; print(torch.__version__)')"
