"""The AnglE and ArcCSE losses' conventions where a mistake would change a loss without an error: which row of a
pair carries its label (the reference reads y_true[::2]), weights of any sign applied to their prefixes and layers
(only zero weights skipped), one weight per width and per layer (no extra weights dropped), every layer of a stack
checked for non-finite values, and the documented defaults. The torch backend against angle_kernels.testing.oracle
in float64."""

from __future__ import annotations

import pytest
import torch

import angle_kernels as ak
from angle_kernels.testing import oracle


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("loss", ["cosine_loss", "angle_loss"])
def test_ranking_losses_read_the_label_of_each_pairs_first_row(loss):
    """The reference takes one label per pair from rows 0, 2, 4, ... (y_true[::2]); labels that differ within a
    pair must be read from the pair's first row, not its second."""
    y_pred = _randn(12, 8, seed=1)
    # first rows ranked 0..5, second rows in the opposite order: the two readings give different losses
    y_true = torch.tensor([0., 5., 1., 4., 2., 3., 3., 2., 4., 1., 5., 0.], dtype=torch.float64)
    ours = getattr(ak, loss)(y_true, y_pred, 20.0 if loss == "cosine_loss" else 1.0, backend="torch")
    expected = getattr(oracle, loss)(y_true, y_pred, 20.0 if loss == "cosine_loss" else 1.0)
    flipped = getattr(oracle, loss)(y_true.view(-1, 2).flip(1).reshape(-1), y_pred,
                                    20.0 if loss == "cosine_loss" else 1.0)
    assert abs(expected.item() - flipped.item()) > 1e-3  # the test can tell the two readings apart
    torch.testing.assert_close(ours, expected, rtol=1e-9, atol=1e-12)


def test_more_dim_weights_than_dims_are_refused():
    """dim_weights must have exactly one weight per dim: extra weights are a mistake (e.g. a stale list after
    dims was shortened), not to be dropped silently."""
    y_pred = _randn(8, 8, seed=2)
    y_true = torch.tensor([1., 1., 0., 0., 1., 1., 0., 0.], dtype=torch.float64)
    with pytest.raises(ValueError, match="one weight per dim"):
        ak.cosine_loss(y_true, y_pred, dims=(4, 8), dim_weights=[1.0, 1.0, 5.0], backend="torch")
    with pytest.raises(ValueError, match="one weight per dim"):
        ak.triplet_loss(y_pred, y_pred.flip(0), y_pred.roll(1, 0), dims=(4,), dim_weights=[1.0, 2.0],
                        backend="torch")


@pytest.mark.parametrize("weights", [[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
def test_more_layer_weights_than_layers_are_refused(weights):
    """layer_weights must have one entry per layer of the stack: a third weight for a 2-layer stack raises the
    ValueError naming layer_weights, even when the extra weight is 0 (which would otherwise be skipped silently)
   ."""
    h1, h2 = _randn(2, 6, 8, seed=3), _randn(2, 6, 8, seed=4)
    y_true = torch.tensor([1., 1., 0., 0., 1., 1.], dtype=torch.float64)
    with pytest.raises(ValueError, match="layer_weights must have one entry per layer"):
        ak.arccon_loss(h1, h2, layer_weights=weights, backend="torch")
    with pytest.raises(ValueError, match="layer_weights must have one entry per layer"):
        ak.in_batch_negative_loss(y_true, h1, layer_weights=weights, backend="torch")


def test_non_finite_values_in_the_second_layer_of_a_stack_raise():
    """check_layer_stack checks the values of layers 1.. (layer 0 by the usual checks): a NaN in layer 1 of a
    2-layer stack raises ValueError, not a NaN loss."""
    y_pred = _randn(2, 8, 8, seed=5)
    y_pred[1, 3, 2] = float("nan")
    y_true = torch.tensor([1., 1., 0., 0., 1., 1., 0., 0.], dtype=torch.float64)
    with pytest.raises(ValueError, match="NaN or Inf"):
        ak.cosine_loss(y_true, y_pred, layer_weights=[1.0, 1.0], backend="torch")
    h1, h2 = _randn(2, 6, 8, seed=6), _randn(2, 6, 8, seed=7)
    h2[1, 0, 0] = float("inf")
    with pytest.raises(ValueError, match="NaN or Inf"):
        ak.arccon_loss(h1, h2, layer_weights=[1.0, 0.5], backend="torch")


def test_angle_loss_format_a_reads_the_label_of_each_pairs_first_row():
    """AngleLoss format A (graded labels, ibn_w = 0) ranks pairs by the label of their first row, as angle-emb's
    y_true[::2] does, for the cosine and the angle terms."""
    outputs = _randn(12, 8, seed=8)
    labels = torch.tensor([0., 5., 1., 4., 2., 3., 3., 2., 4., 1., 5., 0.], dtype=torch.float64)
    weights = dict(cosine_w=1.0, ibn_w=0.0, angle_w=0.5, cosine_tau=20.0, angle_tau=20.0)
    ours = ak.AngleLoss(dataset_format="A", backend="torch", **weights)(labels, outputs)
    expected = oracle.angle_loss_module(labels, outputs, dataset_format="A", **weights)
    torch.testing.assert_close(ours, expected, rtol=1e-9, atol=1e-12)


def test_negative_dim_weights_are_applied_not_dropped():
    """dim_weights may be any finite numbers: a negative weight multiplies its prefix's loss like any other, it is
    not skipped as a zero weight is."""
    y_pred = _randn(8, 8, seed=9)
    y_true = torch.tensor([1., 1., 0., 0., 3., 3., 2., 2.], dtype=torch.float64)
    ours = ak.cosine_loss(y_true, y_pred, dims=(8, 4), dim_weights=(-0.5, 1.0), backend="torch")
    expected = oracle.cosine_loss(y_true, y_pred[:, :4]) - 0.5 * oracle.cosine_loss(y_true, y_pred)
    torch.testing.assert_close(ours, expected, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("kwargs, weights", [
    (dict(layer_weights=[1.0, -0.5]), {(0, 8): 1.0, (1, 8): -0.5}),
    (dict(dims=(4, 8), layer_weights=[[1.0, -0.5], [-0.25, 2.0]]),
     {(0, 4): 1.0, (0, 8): -0.5, (1, 4): -0.25, (1, 8): 2.0}),
])
def test_negative_layer_weights_are_applied_not_dropped(kwargs, weights):
    """A stack's loss is sum over (layer, prefix) of weight * loss, negative weights included (only zero weights
    are skipped)."""
    stack = _randn(2, 8, 8, seed=10)
    y_true = torch.tensor([1., 1., 0., 0., 1., 1., 0., 0.], dtype=torch.float64)
    h2 = _randn(2, 8, 8, seed=11)
    ours = ak.in_batch_negative_loss(y_true, stack, backend="torch", **kwargs)
    expected = sum(w * oracle.in_batch_negative_loss(y_true, stack[layer, :, :d]) for (layer, d), w in weights.items())
    torch.testing.assert_close(ours, expected, rtol=1e-9, atol=1e-12)
    ours = ak.arccon_loss(stack, h2, backend="torch", **kwargs)
    expected = sum(w * oracle.arccon_loss(stack[layer, :, :d], h2[layer, :, :d]) for (layer, d), w in weights.items())
    torch.testing.assert_close(ours, expected, rtol=1e-9, atol=1e-12)


def test_triplet_loss_default_margin_is_zero():
    """triplet_loss's default margin is ArcCSE's 0 (Eq. 4, as its docstring states), not a margin of its own."""
    anchor, weak, strong = _randn(16, 8, seed=12), _randn(16, 8, seed=13), _randn(16, 8, seed=14)
    ours = ak.triplet_loss(anchor, weak, strong, backend="torch")
    torch.testing.assert_close(ours, oracle.triplet_loss(anchor, weak, strong, 0.0), rtol=1e-9, atol=1e-12)
    assert abs(ours.item() - oracle.triplet_loss(anchor, weak, strong, 0.1).item()) > 1e-3
