#!/usr/bin/env bash
# Set everything up (scripts/setup.sh) and run the whole test suite on CPU.
# The Triton kernels run under the Triton interpreter in their own test folder; nothing needs a GPU.
# Two pytest-xdist workers (PYTEST_WORKERS; 0 runs in this process), each test file on one worker (--dist
# loadfile: a file's module fixtures are built once); every test runs torch on one thread (conftest.py), so two
# workers use two cores; the STS-B recipe's file is handed out first (--no-loadscope-reorder keeps the order the root
# conftest.py gives the files). Arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export TORCH_EXTENSIONS_DIR="$PWD/.torch_extensions"
# Byte-compile the project once: where PYTHONDONTWRITEBYTECODE is set (as on some CI images), every interpreter the
# suite starts (CLI runs, README blocks, compile checks) would otherwise compile angle_kernels and angle_train from
# source on import, about half a second of CPU each. pip compiled everything else at install time.
python -m compileall -q -j 0 angle_kernels angle_train tests bench > /dev/null
python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "$@"
