#!/usr/bin/env bash
# One stage of the GPU run (bench/gpu_suite.py), with its console teed into the output folder.
#
#     bash scripts/gpu_check.sh STAGE OUT_DIR [gpu_suite.py options]
#
# STAGE is first (8 minutes: correctness of both GPU backends, one headline number), second (the sweeps) or
# third (training at scale); `python bench/gpu_suite.py --help` lists each step and its time limit, and
# docs/gpu-runs.md says how to run them and what to commit after. Each step stops itself inside its limit, and
# the stage packs its results into OUT_DIR after every step (at most 8 files); without a CUDA device `first`
# rehearses its preflight and packing, and every stage says so and exits 0.
# PYTHON picks the interpreter (default python3: the GPU image's). Nothing is installed there: the checkout goes on
# PYTHONPATH, so that angle_kernels (with angle_kernels.testing, the tests' and benchmarks' oracle) imports from it.
set -euo pipefail
if [ $# -lt 2 ]; then
  sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
STAGE=$1
mkdir -p "$2"
OUT=$(CDPATH='' cd -- "$2" && pwd)  # a relative OUT_DIR is the caller's, not the repository root's
shift 2
cd "$(dirname "$0")/.."
REPO_ROOT=$PWD
export PYTHONUNBUFFERED=1
export PYTHONPATH="$REPO_ROOT${PYTHONPATH:+:$PYTHONPATH}"
# packages the machine lacks, brought unpacked by scripts/gpu_bring.sh (datasets, for sentence-transformers' trainer)
if [ -d "$REPO_ROOT/.whl/site" ]; then
  export PYTHONPATH="$PYTHONPATH:$REPO_ROOT/.whl/site"
fi
"${PYTHON:-python3}" bench/gpu_suite.py "$STAGE" "$OUT" "$@" 2>&1 | tee -a "$OUT/console_$STAGE.log"
exit "${PIPESTATUS[0]}"
