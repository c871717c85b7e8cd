#!/usr/bin/env bash
# Set everything up (scripts/setup.sh) and run the main job on its built-in default: a side-by-side benchmark
# of our losses against the reference (angle-emb) and sentence-transformers, then a short training demo.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
python bench/bench_losses.py --out runs/bench       # about a minute on 2 idle cores; tables, JSON, plot in runs/bench
python -m angle_train.demo
