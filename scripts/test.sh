#!/usr/bin/env bash
# Set everything up (scripts/setup.sh) and run the whole test suite on CPU.
# The Triton kernels run under the Triton interpreter in their own test folder; nothing needs a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export TORCH_EXTENSIONS_DIR="$PWD/.torch_extensions"
python -m pytest -q "$@"
