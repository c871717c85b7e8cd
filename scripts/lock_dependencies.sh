#!/usr/bin/env bash
# Rewrite scripts/constraints.txt, the versions scripts/setup.sh installs, from a new environment that takes the
# newest release of every dependency (the lock switched off), then run the suite against it.
#
# Why a lock: the suite runs on a fresh machine against whatever setup.sh installs, so without one a release of
# transformers, peft, triton, pytest or any package they pull in can turn the suite red on a day nothing here
# changed (sentence-transformers 6.3.0 did, the day it appeared). Taking new releases is a change of its own: run
# this, read what moved (`git diff scripts/constraints.txt`), run the suite in the new environment, and commit the
# file with what the new releases needed. torch, sentence-transformers and angle-emb are not in the lock: setup.sh
# pins them itself (TORCH_SPEC, SENTENCE_TRANSFORMERS_SPEC, angle-emb==0.6.1), and docs/reference-packages.md says
# how to move the two references.
#
# Usage: bash scripts/lock_dependencies.sh [--no-test]   (ANGLE_LOCK_VENV: the new environment, default .venv-lock)
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${ANGLE_LOCK_VENV:-.venv-lock}
LOCK=scripts/constraints.txt
rm -rf "$VENV"
ANGLE_CONSTRAINTS="" ANGLE_VENV="$VENV" bash scripts/setup.sh

{
  echo "# The versions scripts/setup.sh installs (pip's -c): every package of the development environment but torch,"
  echo "# sentence-transformers and angle-emb, which setup.sh pins itself. Written by scripts/lock_dependencies.sh"
  echo "# (Python $("$VENV/bin/python" -c 'import platform; print(platform.python_version())'), $(date -u +%Y-%m-%d)); do not edit by hand."
  "$VENV/bin/python" -m pip freeze --all --exclude-editable --disable-pip-version-check \
    | grep -v -i -E '^(torch|sentence-transformers|sentence_transformers|angle-emb|angle_emb)==' \
    | LC_ALL=C sort -f
} > "$LOCK.new"
mv "$LOCK.new" "$LOCK"
echo "wrote $LOCK ($(grep -c '==' "$LOCK") packages); what moved: git diff $LOCK"

if [ "${1:-}" != "--no-test" ]; then
  # shellcheck disable=SC1091
  . "$VENV/bin/activate"
  export TORCH_EXTENSIONS_DIR="$PWD/.torch_extensions"
  python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder
fi
