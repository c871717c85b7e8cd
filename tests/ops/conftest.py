"""The op tests: each op on every backend (the `backend` fixture of tests/conftest.py) against the oracle,
angle_kernels.testing.oracle.

Triton runs through the interpreter on CPU tensors or, on a machine with a CUDA device, through the real
compiler on CUDA tensors: the root conftest.py decides which (TRITON_INTERPRET) before triton is imported,
and ANGLE_KERNELS_TRITON_TEST_DEVICE=cpu|cuda overrides it. Here:
    * if the kernel modules were already imported in the other mode (an environment changed mid-session),
      they are reloaded in this session's mode: triton decorates kernels in the mode in force at import;
    * the compiler mode without a visible CUDA device fails loudly, at collection, instead of skipping;
    * an autouse fixture keeps TRITON_INTERPRET set for each interpreted test, so that tests elsewhere that
      toggle it with monkeypatch cannot leak into these.
Without triton installed, only the "triton" cases are skipped (by the backend fixture).
"""

from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch

from angle_kernels.testing.helpers import TRITON_DEVICE

INTERPRETING = TRITON_DEVICE.type == "cpu"

try:
    import triton
    from triton.runtime.interpreter import InterpretedFunction
except Exception:  # noqa: BLE001  (no usable triton: the backend fixture skips the triton cases with the reason)
    triton = None

if triton is not None:
    import angle_kernels.triton_ops as triton_ops

    for _info in pkgutil.iter_modules(triton_ops.__path__):
        _module = importlib.import_module(f"{triton_ops.__name__}.{_info.name}")
        _kernels = [v for v in vars(_module).values() if isinstance(v, triton.runtime.jit.KernelInterface)]
        if any(isinstance(kernel, InterpretedFunction) != INTERPRETING for kernel in _kernels):
            importlib.reload(_module)  # decorated in the other mode: decorate again in this one

    if not INTERPRETING and not torch.cuda.is_available():
        raise RuntimeError("tests/ops: the Triton interpreter is off (ANGLE_KERNELS_TRITON_TEST_DEVICE=cuda or "
                           "TRITON_INTERPRET unset) but no CUDA device is visible")


@pytest.fixture(autouse=True)
def _triton_interpreter(monkeypatch):
    if INTERPRETING:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    yield
