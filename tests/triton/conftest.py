"""Triton interpreter tests: run the kernels on CPU tensors through TRITON_INTERPRET=1.

With ANGLE_KERNELS_TRITON_TEST_DEVICE=cuda the same tests run on a GPU instead (interpreter off; this is how
bench/gpu_suite.py runs them), and the folder is skipped if no GPU is visible.

The interpreter must be on when triton decorates the kernels (at import of angle_kernels.triton_ops), so it
is switched on here, before anything in this folder imports triton; the previous value is restored right
after, and an autouse fixture turns it on again only for the duration of each test in this folder, so the
rest of the suite (which may check that backend="triton" is refused on CPU) sees its own environment.
If the kernel modules were already imported in compiled (GPU) mode by an earlier test module, they are
reloaded in interpreter mode. The whole folder is skipped when triton is not installed.
"""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path

import pytest

ON_GPU = os.environ.get("ANGLE_KERNELS_TRITON_TEST_DEVICE", "cpu") == "cuda"
_previous = os.environ.get("TRITON_INTERPRET")
if not ON_GPU:
    os.environ["TRITON_INTERPRET"] = "1"
try:
    import triton  # noqa: F401
    from triton.runtime.interpreter import InterpretedFunction
except Exception as exc:  # noqa: BLE001
    _TRITON_ERROR: Exception | None = exc
else:
    _TRITON_ERROR = None
    import angle_kernels.triton_ops  # noqa: F401  (decorates the kernels as interpreted functions)

    _kernel_modules = ("pair_scores", "ranking", "similarity_xent")
    for _name in _kernel_modules:
        _module = importlib.import_module(f"angle_kernels.triton_ops.{_name}")
        _kernel = next(v for k, v in vars(_module).items() if k.endswith("_fwd_kernel"))
        if isinstance(_kernel, InterpretedFunction) == ON_GPU:  # decorated in the wrong mode: redo it
            importlib.reload(_module)
finally:
    if _previous is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = _previous

if _TRITON_ERROR is None and ON_GPU:
    import torch

    if not torch.cuda.is_available():
        _TRITON_ERROR = RuntimeError("ANGLE_KERNELS_TRITON_TEST_DEVICE=cuda but no CUDA device is visible")

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
