"""Triton tests: the kernels through the Triton interpreter (CPU tensors) or, on a machine with a CUDA device,
through the real compiler on CUDA tensors. The root conftest.py decides which (TRITON_INTERPRET) before
triton is imported; ANGLE_KERNELS_TRITON_TEST_DEVICE=cpu|cuda overrides it.

If the kernel modules were already imported in the other mode by an earlier test module (an environment
changed mid-session), they are reloaded in this session's mode. An autouse fixture keeps TRITON_INTERPRET
set for the duration of each interpreted test in this folder, so that tests elsewhere that toggle it with
monkeypatch cannot leak into these. The whole folder is skipped when triton is not installed, and fails
loudly (not skipped) when the compiler mode was chosen but no CUDA device is visible.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

ON_GPU = os.environ.get("TRITON_INTERPRET", "0") in ("", "0")  # set (or not) by the root conftest.py
try:
    import triton  # noqa: F401
    from triton.runtime.interpreter import InterpretedFunction
except Exception as exc:  # noqa: BLE001
    _TRITON_ERROR: Exception | None = exc
else:
    _TRITON_ERROR = None
    import angle_kernels.triton_ops  # noqa: F401  (decorates the kernels in this session's mode)

    _kernel_modules = ("pair_scores", "ranking", "similarity_xent")
    for _name in _kernel_modules:
        _module = importlib.import_module(f"angle_kernels.triton_ops.{_name}")
        _kernel = next(v for k, v in vars(_module).items() if k.endswith("_fwd_kernel"))
        if isinstance(_kernel, InterpretedFunction) == ON_GPU:  # decorated in the wrong mode: redo it
            importlib.reload(_module)

if _TRITON_ERROR is None and ON_GPU:
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("tests/triton: the Triton interpreter is off (ANGLE_KERNELS_TRITON_TEST_DEVICE=cuda "
                           "or TRITON_INTERPRET unset) but no CUDA device is visible")

if _TRITON_ERROR is not None:
    collect_ignore_glob = ["test_*.py"]

HERE = Path(__file__).resolve().parent
# pytest imports every folder's conftest.py under the one module name "conftest" (the last one loaded wins
# sys.modules["conftest"]), and tests elsewhere do `from conftest import ...`. So that loading this folder
# never changes what those imports find, this module leaves sys.modules["conftest"] and moves its folder
# to the end of sys.path (this folder's tests only need it to find triton_oracle).
while str(HERE) in sys.path:
    sys.path.remove(str(HERE))
sys.path.append(str(HERE))


def pytest_plugin_registered(plugin, manager):
    """Runs once pytest has registered this conftest: give the name "conftest" back (see above)."""
    if plugin is sys.modules.get("conftest") and getattr(plugin, "__file__", None) == __file__:
        del sys.modules["conftest"]


def pytest_collection_modifyitems(config, items):
    if _TRITON_ERROR is None:
        return
    skip = pytest.mark.skip(reason=f"triton is not available: {_TRITON_ERROR}")
    for item in items:
        if str(HERE) in str(item.fspath):
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch):
    if not ON_GPU:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
