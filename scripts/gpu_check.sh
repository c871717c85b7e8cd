#!/usr/bin/env bash
# One stage of the staged GPU run (bench/gpu_suite.py), with its console teed into the output folder.
#
#     bash scripts/gpu_check.sh STAGE OUT_DIR [gpu_suite.py options]
#
# STAGE is a, b, c, d, e (or all); `python bench/gpu_suite.py --help` lists what each does and its time
# budget, and the README's "Running on a GPU" says how to run them on a lent GPU. Each stage stops itself inside
# its budget and writes its results as it goes; without a CUDA device it says so and exits 0.
# PYTHON picks the interpreter (default python3: the GPU image's).
set -euo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
STAGE=$1
OUT=$2
shift 2
cd "$(dirname "$0")/.."
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
"${PYTHON:-python3}" bench/gpu_suite.py "$STAGE" "$OUT" "$@" 2>&1 | tee -a "$OUT/console_$STAGE.log"
exit "${PIPESTATUS[0]}"
