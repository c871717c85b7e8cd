"""The nn.Module front ends' options: each one reaches the loss (ArcCSELoss's backend is its own, not the
environment's), is shown in the module's repr, and is checked when the module is built (bad dims, dim_weights,
margins and temperatures refused at construction, not at the first training step)."""

from __future__ import annotations

import pytest
import torch

import angle_kernels as ak
from angle_kernels.testing import oracle


def test_arccse_loss_uses_its_backend_argument_not_the_environment(monkeypatch):
    gen = torch.Generator().manual_seed(1)
    h1, h2 = (torch.randn(4, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    loss = ak.ArcCSELoss(backend="torch")
    monkeypatch.setenv("ANGLE_KERNELS_BACKEND", "no-such-backend")
    torch.testing.assert_close(loss(h1, h2), oracle.arccse_loss(h1, h2))


def test_arccse_loss_repr_shows_every_option():
    text = repr(ak.ArcCSELoss(margin_degrees=5.0, tau=0.1, triplet_weight=0.2, triplet_margin=0.3))
    for part in ("margin_degrees=5.0", "tau=0.1", "triplet_weight=0.2", "triplet_margin=0.3"):
        assert part in text


def test_angle_loss_repr_shows_every_option():
    """print(loss) shows every setting, the Matryoshka dims and their weights included."""
    text = repr(ak.AngleLoss(cosine_w=0.5, ibn_w=0.25, cln_w=0.75, angle_w=0.125, cosine_tau=3.0, ibn_tau=4.0,
                             angle_tau=5.0, angle_pooling_strategy="mean", dataset_format="C", dims=(4, 8),
                             dim_weights=(1.0, 2.0)))
    for part in ("dataset_format='C'", "cosine_w=0.5", "ibn_w=0.25", "cln_w=0.75", "angle_w=0.125", "cosine_tau=3.0",
                 "ibn_tau=4.0", "angle_tau=5.0", "angle_pooling_strategy='mean'", "dims=(4, 8)",
                 "dim_weights=(1.0, 2.0)"):
        assert part in text, part


@pytest.mark.parametrize("kwargs", [dict(dims=(0, 8)), dict(dim_weights=(1.0,)), dict(dims=(4, 8), dim_weights=(1.0,))])
def test_angle_loss_checks_dims_at_construction(kwargs):
    with pytest.raises(ValueError):
        ak.AngleLoss(dataset_format="A", **kwargs)


@pytest.mark.parametrize("kwargs", [dict(triplet_margin=float("nan")), dict(tau=0.0), dict(tau=-1.0),
                                    dict(margin_degrees=float("inf")), dict(dims=(0, 8)),
                                    dict(dim_weights=(1.0,))])
def test_arccse_loss_checks_its_options_at_construction(kwargs):
    with pytest.raises(ValueError):
        ak.ArcCSELoss(**kwargs)
