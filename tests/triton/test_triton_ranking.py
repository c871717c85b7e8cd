"""Triton ranking_loss (both paths) under the interpreter against the float64 oracle."""

from __future__ import annotations

import importlib

import pytest
import torch

import triton_oracle as oracle
from angle_kernels.triton_ops import ranking_loss

ranking = importlib.import_module("angle_kernels.triton_ops.ranking")

# The log-space scans combine two empty sums (-inf, -inf) into log(0) = -inf on purpose; NumPy (under the
# interpreter) warns about that log(0).
pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")


@pytest.fixture(params=["tiled", "sorted"])
def path(request, monkeypatch):
    if request.param == "sorted":
        # Force the sort path at test sizes, with tiny scan blocks so the cross-block carries are exercised.
        monkeypatch.setattr(ranking, "SMALL_N_MAX", 0)
        monkeypatch.setattr(ranking, "_SCAN_BLOCK", 16)
    return request.param


def _run(scores, labels):
    """The kernels on oracle.DEVICE; (loss, grad) back on CPU."""
    leaf = scores.detach().clone().to(oracle.DEVICE).requires_grad_()
    loss = ranking_loss(leaf, labels.to(oracle.DEVICE))
    loss.backward()
    return loss.detach().cpu(), leaf.grad.cpu()


def _check(scores, labels, value_tol, grad_tol):
    loss, grad = _run(scores, labels)
    ref_leaf = scores.detach().double().requires_grad_()
    ref = oracle.ranking_loss(ref_leaf, labels)
    ref.backward()
    assert loss.dtype == scores.dtype and loss.dim() == 0
    assert grad.dtype == scores.dtype
    assert oracle.rel_err(loss, ref) <= value_tol
    assert oracle.rel_err(grad, ref_leaf.grad) <= grad_tol
    assert torch.isfinite(grad).all()


@pytest.mark.parametrize("n", [1, 3, 37, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_against_oracle_with_heavy_ties(path, n, dtype):
    gen = torch.Generator().manual_seed(oracle.seed(path, n, str(dtype)))
    scores = (20 * torch.randn(n, generator=gen)).to(dtype)  # tau = 20 scale
    labels = torch.randint(0, 4, (n,), generator=gen)
    value_tol, grad_tol = (1e-6, 1e-5) if dtype == torch.float32 else (1e-13, 1e-12)
    _check(scores, labels, value_tol, grad_tol)


def test_float_labels_and_extreme_scores(path):
    gen = torch.Generator().manual_seed(5)
    scores = 300 * torch.randn(50, generator=gen, dtype=torch.float64)  # exp(600) would overflow naively
    labels = torch.rand(50, generator=gen).round(decimals=1)
    _check(scores, labels, 1e-13, 1e-12)


def test_all_labels_equal_is_exactly_zero(path):
    loss, grad = _run(torch.randn(40), torch.full((40,), 3.0))
    assert loss.item() == 0.0
    assert torch.equal(grad, torch.zeros(40))


def test_bool_labels(path):
    gen = torch.Generator().manual_seed(9)
    scores = torch.randn(30, generator=gen, dtype=torch.float64)
    labels = torch.rand(30, generator=gen) > 0.5
    _check(scores, labels, 1e-13, 1e-12)


def test_paths_agree():
    gen = torch.Generator().manual_seed(21)
    scores = 20 * torch.randn(60, generator=gen, dtype=torch.float64)
    labels = torch.randint(0, 6, (60,), generator=gen)
    tiled, _ = _run(scores, labels)
    saved = ranking.SMALL_N_MAX
    try:
        ranking.SMALL_N_MAX = 0
        sorted_path, _ = _run(scores, labels)
    finally:
        ranking.SMALL_N_MAX = saved
    assert abs(tiled.item() - sorted_path.item()) <= 1e-12 * abs(tiled.item())


def test_bad_inputs_raise():
    dev = oracle.DEVICE
    with pytest.raises(ValueError, match="scores must be 1-D"):
        ranking_loss(torch.randn(3, 2, device=dev), torch.zeros(3, device=dev))
    with pytest.raises(TypeError, match="scores must be float32 or float64"):
        ranking_loss(torch.randn(3, device=dev).half(), torch.zeros(3, device=dev))
    with pytest.raises(ValueError, match="labels must have the shape"):
        ranking_loss(torch.randn(3, device=dev), torch.zeros(4, device=dev))


def test_matches_torch_ops():
    ops = oracle.torch_ops_or_none()
    if ops is None or not hasattr(ops, "ranking_loss"):
        pytest.skip("angle_kernels.torch_ops.ranking_loss is not there yet")
    gen = torch.Generator().manual_seed(3)
    scores = 20 * torch.randn(64, generator=gen)
    labels = torch.randint(0, 5, (64,), generator=gen)
    loss, grad = _run(scores, labels)
    b = scores.clone().requires_grad_()  # the torch backend on CPU
    ref = ops.ranking_loss(b, labels)
    ref.backward()
    assert oracle.rel_err(loss, ref) < 1e-6
    assert oracle.rel_err(grad, b.grad) < 1e-5

