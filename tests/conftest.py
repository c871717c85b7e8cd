"""Fixtures for every test under tests/: seeded generators, the backends under test, the reference package.

Subfolders (tests/ops, tests/train, tests/integrations) have their own conftest files; nothing here changes
global state for them: no autouse fixtures, no global torch settings. The helpers live in
angle_kernels.testing.helpers and the oracle in angle_kernels.testing.oracle (import them from there, not from
conftest: every folder's conftest is imported under the same name).
"""

from __future__ import annotations

import importlib
from types import ModuleType

import pytest
import torch

from angle_kernels.testing.helpers import (
    BACKEND_NAMES,
    Backend,
    backend_or_skip,
    import_angle_emb_package,
    load_reference_loss_module,
    seed_from,
)


@pytest.fixture
def gen(request) -> torch.Generator:
    """A CPU generator seeded from the test's node id: fresh inputs per test, reproducible per test."""
    return torch.Generator().manual_seed(seed_from(request.node.nodeid))


@pytest.fixture(params=BACKEND_NAMES, ids=BACKEND_NAMES)
def backend(request) -> Backend:
    """Each backend available here ("torch" always; "triton" under the interpreter on CPU, or compiled on a
    CUDA device; "cuda" with a CUDA device and the compiled extension), skipped with the reason otherwise.
    `pytest -k cuda` selects the CUDA-backend cases."""
    return backend_or_skip(request.param)


@pytest.fixture(scope="session")
def ref_loss() -> ModuleType:
    """The reference's loss module (angle-emb 0.6.1's angle_emb/loss.py, loaded by path: the losses need only
    torch, not the package's trainer dependencies); tests using it are skipped when it is absent."""
    module = load_reference_loss_module()
    if module is None:
        pytest.skip("angle-emb 0.6.1 is not installed (pip install --no-deps angle-emb==0.6.1)")
    return module


@pytest.fixture(scope="session")
def ref_angle_loss_class():
    """angle_emb.AngleLoss from the installed package (it lives in angle_emb/angle.py, the trainer's module: the
    full package import, see angle_kernels.testing.helpers.import_angle_emb_package)."""
    try:
        return import_angle_emb_package().AngleLoss
    except Exception as exc:  # pragma: no cover - depends on the environment
        pytest.skip(f"angle_emb.AngleLoss cannot be imported: {type(exc).__name__}: {exc}")


@pytest.fixture(scope="session")
def ak():
    """The package under test."""
    return importlib.import_module("angle_kernels")
