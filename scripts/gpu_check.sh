#!/usr/bin/env bash
# One stage of the staged GPU run (bench/gpu_suite.py), with its console teed into the output folder.
#
#     bash scripts/gpu_check.sh STAGE OUT_DIR [gpu_suite.py options]
#
#     a  (330 s)  environment, tests/triton with the real compiler, large-size checks
#     b  (330 s)  CUDA extension build, tests/gpu
#     c  (300 s)  hardware limits, op sweep (Triton, CUDA, torch)
#     d  (300 s)  loss sweep against angle-emb 0.6.1 and sentence-transformers
#     e  (480 s)  7B LoRA training benchmark; repeat with --resume-from PREVIOUS_OUT until it says done
#     all         every stage in turn; summary: gather OUT_DIR's stage files into OUT_DIR/summary.md
#
# Each stage stops itself inside its budget and writes its results as it goes (README, "Running on a GPU").
# Without a CUDA device it says so and exits 0. PYTHON picks the interpreter (default python3: the GPU image's).
set -euo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
STAGE=$1
OUT=$2
shift 2
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
# The CUDA extension's JIT build lands in the checkout, so a later stage on the same (warm) machine reuses it.
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.torch_extensions}
export PYTHONUNBUFFERED=1
"${PYTHON:-python3}" bench/gpu_suite.py "$STAGE" "$OUT" "$@" 2>&1 | tee -a "$OUT/console_$STAGE.log"
exit "${PIPESTATUS[0]}"
