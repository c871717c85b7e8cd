"""The README's Python quickstarts run as written (each ```python block, in a fresh interpreter)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_has_quickstarts():
    assert len(BLOCKS) >= 4, "the README lost its Python quickstarts"


@pytest.mark.slow  # a fresh interpreter per block; some train for a few steps (up to ~10 s each)
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, tmp_path):
    code = BLOCKS[index]
    for module in re.findall(r"^\s*(?:import|from) (\w+)", code, flags=re.M):
        if module not in ("os", "tempfile", "torch", "angle_kernels"):
            pytest.importorskip(module)
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, f"README block {index} failed:\n{code}\n--- stderr ---\n{result.stderr[-4000:]}"
