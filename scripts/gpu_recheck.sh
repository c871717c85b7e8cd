#!/usr/bin/env bash
# The targeted rerun after `gpu_check.sh first`, once its failures are fixed on CPU: the tests that failed, and
# the CUDA backend's checks that `first` left out for time.
#
#     bash scripts/gpu_recheck.sh OUT_DIR 'PYTEST_K'
#
# In OUT_DIR (at most 6 files, all logs as they are written): the CUDA extension's build (in the background,
# this GPU's architecture, as `first` builds it); `pytest -v tests/ops -k "(PYTEST_K) and not cuda"` with the
# real Triton compiler; then the CUDA backend's large-size checks in every dtype (`python -m angle_kernels.verify
# --backend cuda --sizes large`: its --out JSON holds the passed entries for angle_kernels/verified.py) and its
# op tests (`pytest -v tests/ops -k cuda`). About 2 minutes on an H100 (108 s on 2026-11-26).
set -uo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(CDPATH='' cd -- "$1" && pwd) || exit 2  # a relative OUT_DIR is the caller's, not the repository root's
K=$2
cd "$(dirname "$0")/.."
REPO_ROOT=$PWD
# nothing is installed on the GPU machine: the checkout goes on the path (angle_kernels, angle_kernels.testing)
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 ANGLE_KERNELS_TRITON_TEST_DEVICE=cuda ANGLE_KERNELS_CUDA_JIT=0
PY=${PYTHON:-python3}
# as gpu_suite.py builds it: the image's TORCH_CUDA_ARCH_LIST, else this GPU's capability
ARCH=${TORCH_CUDA_ARCH_LIST:-$("$PY" -c 'import torch; print(".".join(map(str, torch.cuda.get_device_capability(0))))')} || exit 1
(TORCH_CUDA_ARCH_LIST=$ARCH ANGLE_KERNELS_BUILD_CUDA=1 MAX_JOBS=$(nproc) "$PY" setup.py build_ext --inplace \
  >"$OUT/cuda_build.log" 2>&1; echo "build rc $?" >>"$OUT/cuda_build.log") &
BUILD=$!
PYTEST=("$PY" -m pytest -v -p no:cacheprovider -rfE --timeout 90)
ANGLE_KERNELS_AUTOTUNE=first timeout 150 "${PYTEST[@]}" -n 12 tests/ops -k "($K) and not cuda" >"$OUT/pytest_triton.log" 2>&1
echo "triton tests: rc $? $(tail -1 "$OUT/pytest_triton.log")"
wait $BUILD
tail -1 "$OUT/cuda_build.log"
timeout 130 "$PY" -m angle_kernels.verify --backend cuda --sizes large --dtypes bfloat16,float32,float16,float64 \
  --time-limit 120 --out "$OUT/verify_cuda.json" --no-record >"$OUT/verify_cuda.log" 2>&1
echo "cuda verify: rc $?"; grep -E "^(passed|FAILED|not verified)" "$OUT/verify_cuda.log"
timeout 60 "${PYTEST[@]}" -n 8 tests/ops -k cuda >"$OUT/pytest_cuda.log" 2>&1
echo "cuda tests: rc $? $(tail -1 "$OUT/pytest_cuda.log")"
