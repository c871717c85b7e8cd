"""torch.autograd.gradcheck (float64, finite differences vs the explicit backward passes) on every autograd
Function of the pure-PyTorch backend, through the op entry points of angle_kernels.torch_ops (the contract in
angle_kernels/dispatch.py), and on every public loss.

Inputs are small, random and away from the non-smooth points (zero vectors, exact ties of |angle| at 0, the
triplet hinge, the ArcCon margin's pi clamp), where finite differences are meaningless.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.autograd import gradcheck

from ak_testing import randn, zigzag_labels

torch_ops = pytest.importorskip("angle_kernels.torch_ops")


def _leaf(gen, *shape, scale=1.0):
    return randn(gen, *shape, dtype=torch.float64, scale=scale).requires_grad_(True)


def _check(fn, *inputs):
    assert gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-4, check_undefined_grad=True)


# --------------------------------------------------------------------------------------------------------
# the ops
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("with_angle", [False, True])
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("d", [2, 6, 9])
def test_pair_scores(gen, k, d, with_angle):
    if with_angle and d % 2:
        d += 1
    x = _leaf(gen, 5, k, d)
    cos, angle = torch_ops.pair_scores(x, with_angle)
    assert cos.shape == (5, k - 1) and angle.shape == (5, k - 1)
    if not with_angle:
        assert torch.count_nonzero(angle) == 0
    _check(lambda x: torch_ops.pair_scores(x, with_angle), x)


def test_pair_scores_combined_cotangents(gen):
    """One backward with both cotangents non-trivial (cos and angle used together, as AngleLoss does)."""
    x = _leaf(gen, 4, 3, 8)
    weights = randn(gen, 4, 2, dtype=torch.float64)

    def f(x):
        cos, angle = torch_ops.pair_scores(x, True)
        return (cos * weights).sum() + (angle.abs() * weights.flip(0)).sum()

    _check(f, x)


@pytest.mark.parametrize("kind", ["graded", "ties", "binary", "equal"])
@pytest.mark.parametrize("n", [1, 2, 7, 40])
def test_ranking_loss(gen, n, kind):
    labels = zigzag_labels(gen, n, kind)[0::2].double()
    scores = _leaf(gen, n, scale=3.0)
    _check(lambda s: torch_ops.ranking_loss(s, labels), scores)


def test_ranking_loss_large_scores(gen):
    """tau = 20 puts score differences near +-40: the log-space sums must keep the gradient exact."""
    labels = zigzag_labels(gen, 30, "ties")[0::2].double()
    scores = _leaf(gen, 30, scale=20.0)
    _check(lambda s: torch_ops.ranking_loss(s, labels), scores)


@pytest.mark.parametrize("with_weights", [False, True])
def test_similarity_xent_partner_exclude_diagonal(gen, with_weights):
    rows = 10
    q = _leaf(gen, rows, 6)
    weights = None
    if with_weights:
        weights = zigzag_labels(gen, rows // 2, "binary").double()
        weights[:2] = 1.0
    _check(lambda q: torch_ops.similarity_xent(q, None, 5.0, "partner", row_weights=weights, exclude_diagonal=True), q)


def test_similarity_xent_group_ids(gen):
    rows = 12
    q = _leaf(gen, rows, 6)
    group_ids = torch.tensor([0, 1, 2, 0, 3, 4, 5, 1, 6, 6, 7, 8])
    weights = torch.ones(rows, dtype=torch.float64)
    weights[10:] = 0.0
    _check(
        lambda q: torch_ops.similarity_xent(q, None, 4.0, "partner", row_weights=weights, exclude_diagonal=True,
                                            group_ids=group_ids),
        q,
    )


@pytest.mark.parametrize("candidates", [1, 2])
def test_similarity_xent_diagonal_rectangular(gen, candidates):
    q = _leaf(gen, 5, 6)
    c = _leaf(gen, 5 * candidates, 6)
    _check(lambda q, c: torch_ops.similarity_xent(q, c, 7.0, "diagonal"), q, c)


@pytest.mark.parametrize("margin_degrees", [10.0, 60.0])
def test_similarity_xent_margin(gen, margin_degrees):
    q = _leaf(gen, 6, 5)
    c = (q.detach() + 0.8 * randn(gen, 6, 5, dtype=torch.float64)).requires_grad_(True)
    _check(lambda q, c: torch_ops.similarity_xent(q, c, 1 / 0.5, "diagonal", margin=math.radians(margin_degrees)), q, c)


def test_similarity_xent_margin_with_exclude_diagonal_and_weights(gen):
    """Every option at once on the symmetric op: a margin on the partner logit."""
    q = _leaf(gen, 8, 6)
    weights = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.5, 0.5], dtype=torch.float64)
    _check(
        lambda q: torch_ops.similarity_xent(q, None, 3.0, "partner", row_weights=weights, exclude_diagonal=True,
                                            margin=math.radians(10.0)),
        q,
    )


# --------------------------------------------------------------------------------------------------------
# the public losses
# --------------------------------------------------------------------------------------------------------
def test_public_ranking_losses(ak, gen):
    y = zigzag_labels(gen, 6, "ties")
    x = _leaf(gen, 12, 6)
    _check(lambda x: ak.cosine_loss(y, x, 20.0), x)
    _check(lambda x: ak.angle_loss(y, x, 1.0, "sum"), x)
    _check(lambda x: ak.angle_loss(y[:, None], x, 20.0, "mean"), x)


def test_public_in_batch_negative_loss(ak, gen):
    y = zigzag_labels(gen, 6, "binary")
    y[:2] = 1.0
    x = _leaf(gen, 12, 6)
    _check(lambda x: ak.in_batch_negative_loss(y, x, 5.0), x)
    group_ids = torch.tensor([0, 1, 2, 3, 0, 4, 5, 5, 6, 7, 8, 9])
    _check(lambda x: ak.in_batch_negative_loss(y, x, 5.0, group_ids=group_ids), x)


def test_public_contrastive(ak, gen):
    text, pos, neg = _leaf(gen, 4, 6), _leaf(gen, 4, 6), _leaf(gen, 3, 6)
    _check(lambda t, p: ak.contrastive_with_negative_loss(t, p, tau=5.0), text, pos)
    _check(lambda t, p, n: ak.contrastive_with_negative_loss(t, p, n, 5.0), text, pos, neg)


def test_public_arccse(ak, gen):
    h1 = _leaf(gen, 5, 6)
    h2 = (h1.detach() + 0.8 * randn(gen, 5, 6, dtype=torch.float64)).requires_grad_(True)
    _check(lambda a, b: ak.arccon_loss(a, b, 10.0, 0.5), h1, h2)
    anchor, weak, strong = _leaf(gen, 6, 5), _leaf(gen, 6, 5), _leaf(gen, 6, 5)
    _check(lambda a, w, s: ak.triplet_loss(a, w, s, 0.1), anchor, weak, strong)


@pytest.mark.parametrize("fmt", ["A", "B", "C"])
def test_public_angle_loss_module(ak, gen, fmt):
    rows = 9 if fmt == "C" else 8
    labels = zigzag_labels(gen, 4, "binary") if fmt == "A" else torch.ones(rows)
    if fmt == "A":
        labels[:2] = 1.0
    x = _leaf(gen, rows, 6)
    module = ak.AngleLoss(dataset_format=fmt, cosine_w=0.5, angle_w=0.5, angle_tau=2.0, ibn_tau=3.0, cosine_tau=2.0)
    _check(lambda x: module(labels, x), x)
