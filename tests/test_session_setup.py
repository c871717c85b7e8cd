"""The test session's own setup (the root conftest.py): the Triton interpreter is on exactly when there is no
CUDA device, so that `pytest tests/ops` on a GPU machine runs the compiled kernels, not the interpreter."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest
import torch

ROOT_CONFTEST = Path(__file__).resolve().parents[1] / "conftest.py"


@pytest.fixture(scope="module")
def root_conftest():
    spec = importlib.util.spec_from_file_location("angle_kernels_root_conftest", ROOT_CONFTEST)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # sets the same environment this session already has
    return module


def test_interpreter_only_without_a_cuda_device(root_conftest):
    decide = root_conftest.use_triton_interpreter
    assert decide({}, cuda_available=lambda: False) is True
    assert decide({}, cuda_available=lambda: True) is False


def test_the_test_device_variable_overrides_the_detection(root_conftest):
    decide = root_conftest.use_triton_interpreter
    assert decide({"ANGLE_KERNELS_TRITON_TEST_DEVICE": "cpu"}, cuda_available=lambda: True) is True
    assert decide({"ANGLE_KERNELS_TRITON_TEST_DEVICE": "CUDA"}, cuda_available=lambda: False) is False
    with pytest.raises(ValueError, match="ANGLE_KERNELS_TRITON_TEST_DEVICE must be 'cpu' or 'cuda'"):
        decide({"ANGLE_KERNELS_TRITON_TEST_DEVICE": "gpu"}, cuda_available=lambda: True)


def test_this_session_applied_the_decision(root_conftest):
    """The decision above is what this session runs with (the root conftest took effect before triton loaded)."""
    interpreting = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    assert interpreting == root_conftest.use_triton_interpreter(os.environ, torch.cuda.is_available)
    assert os.environ.get("ANGLE_KERNELS_POISON_OUTPUTS") == "1"  # unwritten kernel outputs stay NaN in tests
