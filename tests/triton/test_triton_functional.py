"""The public losses with backend="triton" against backend="torch": the dispatch wiring end to end.

Both backends get the same float32 inputs; values and gradients must agree to float32 tolerances. Under
the interpreter this runs the kernels on CPU; with ANGLE_KERNELS_TRITON_TEST_DEVICE=cuda, on a GPU.
"""

from __future__ import annotations

import pytest
import torch

import triton_oracle as oracle

ak = pytest.importorskip("angle_kernels")


def _gen(*parts):
    return torch.Generator().manual_seed(oracle.seed(*parts))


def _compare(call, tensors, value_tol=1e-6, grad_tol=1e-5):
    results = {}
    for backend in ("torch", "triton"):
        device = "cpu" if backend == "torch" else oracle.DEVICE
        leaves = [t.detach().clone().to(device).requires_grad_(t.is_floating_point()) for t in tensors]
        loss = call(leaves, backend, device)
        loss.backward()
        results[backend] = (loss.detach().cpu(), [leaf.grad.cpu() for leaf in leaves if leaf.grad is not None])
    (ref, ref_grads), (out, grads) = results["torch"], results["triton"]
    assert oracle.rel_err(out, ref) <= value_tol
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads):
        assert oracle.rel_err(g, r) <= grad_tol


def _zigzag(gen, n, d, labels="graded"):
    y_pred = torch.randn(2 * n, d, generator=gen)
    per_pair = torch.randint(0, 5 if labels == "graded" else 2, (n,), generator=gen).float()
    return per_pair.repeat_interleave(2).unsqueeze(1), y_pred


@pytest.mark.parametrize("name", ["cosine_loss", "angle_loss"])
def test_ranking_losses(name):
    y_true, y_pred = _zigzag(_gen(name), 24, 66)

    def call(leaves, backend, device):
        return getattr(ak, name)(y_true.to(device), leaves[0], 20.0, backend=backend)

    _compare(call, [y_pred])


def test_in_batch_negative_loss_with_group_ids():
    gen = _gen("ibn")
    y_true, y_pred = _zigzag(gen, 16, 40, labels="binary")
    group_ids = torch.randint(0, 12, (32,), generator=gen)

    def call(leaves, backend, device):
        return ak.in_batch_negative_loss(y_true.to(device), leaves[0], 20.0, group_ids=group_ids.to(device),
                                         backend=backend)

    _compare(call, [y_pred])


def test_contrastive_with_negative_and_arccon():
    gen = _gen("cln")
    text, pos, neg = (torch.randn(13, 34, generator=gen) for _ in range(3))

    def cln(leaves, backend, device):
        return ak.contrastive_with_negative_loss(*leaves, tau=20.0, backend=backend)

    def arccon(leaves, backend, device):
        return ak.arccon_loss(leaves[0], leaves[1], margin_degrees=10.0, tau=0.05, backend=backend)

    _compare(cln, [text, pos, neg])
    _compare(arccon, [text, pos])


def test_angle_loss_module_format_a():
    y_true, y_pred = _zigzag(_gen("module"), 12, 32, labels="binary")

    def call(leaves, backend, device):
        return ak.AngleLoss(dataset_format="A", backend=backend)(y_true.to(device), leaves[0])

    _compare(call, [y_pred])
