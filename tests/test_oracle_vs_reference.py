"""The oracle itself (angle_kernels.testing.oracle) checked where it can be: so that it can be trusted where it
is used alone.

* Its losses against the reference, angle-emb 0.6.1's angle_emb.loss and AngleLoss, in float64 (skipped when
  angle-emb is not installed): then every oracle-based loss test means parity too.
* Its two levels against each other: the op contract of angle_kernels/dispatch.py (op level) assembled into
  each loss must give the reference's formula (loss level); e.g. the angle score's (u.v + b.c - a.d) / P is the
  reference's complex division, and in-batch negatives are similarity_xent with partner targets and weights.
"""

from __future__ import annotations

import math

import pytest
import torch

from angle_kernels.testing import oracle
from angle_kernels.testing.helpers import REFERENCE_ATOL, assert_close, grads_of, randn, zigzag_labels

LABEL_KINDS = ["graded", "ties", "binary", "equal"]
TAUS = [0.05, 1.0, 20.0]


def _same_value_and_gradient(fn_a, fn_b, inputs, what, atol=0.0):
    value_a, grads_a = grads_of(fn_a, *inputs)
    value_b, grads_b = grads_of(fn_b, *inputs)
    assert_close(value_a, value_b, 1e-12, f"{what} value", atol=atol)
    for k, (grad_a, grad_b) in enumerate(zip(grads_a, grads_b)):
        assert_close(grad_a, grad_b, 1e-10, f"{what} gradient of input {k}")


# --------------------------------------------------------------------------------------------------------
# the oracle's losses against the reference
# --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n,d", [(1, 2), (3, 6), (37, 130)])
@pytest.mark.parametrize("kind", LABEL_KINDS)
def test_losses_match_reference(ref_loss, gen, n, d, kind):
    y_true = zigzag_labels(gen, n, kind).double()
    binary = zigzag_labels(gen, n, "binary").double()
    x = randn(gen, 2 * n, d, dtype=torch.float64)
    for tau in TAUS:
        cases = {
            "cosine": (lambda x: oracle.cosine_loss(y_true, x, tau),
                       lambda x: ref_loss.cosine_loss(y_true[:, None], x, tau)),
            "angle sum": (lambda x: oracle.angle_loss(y_true, x, tau, "sum"),
                          lambda x: ref_loss.angle_loss(y_true[:, None], x, tau, "sum")),
            "angle mean": (lambda x: oracle.angle_loss(y_true, x, tau, "mean"),
                           lambda x: ref_loss.angle_loss(y_true[:, None], x, tau, "mean")),
            "in-batch negatives": (lambda x: oracle.in_batch_negative_loss(binary, x, tau),
                                   lambda x: ref_loss.in_batch_negative_loss(binary[:, None], x, tau)),
        }
        for name, (ours, reference) in cases.items():
            _same_value_and_gradient(ours, reference, [x], f"{name} tau={tau}", atol=REFERENCE_ATOL)


def test_contrastive_and_module_formats_match_reference(ref_loss, ref_angle_loss_class, gen):
    text, pos, neg = (randn(gen, 5, 8, dtype=torch.float64) for _ in range(3))
    for negatives in ([], [neg]):
        _same_value_and_gradient(lambda *t: oracle.contrastive_with_negative_loss(*t, tau=7.0),
                                 lambda *t: ref_loss.contrastive_with_negative_loss(*t, tau=7.0),
                                 [text, pos, *negatives], "contrastive", atol=REFERENCE_ATOL)
    weights = dict(cosine_w=0.3, ibn_w=1.0, cln_w=0.5, angle_w=0.02, angle_tau=10.0)
    for fmt, rows in (("A", 10), ("B", 10), ("C", 15)):
        x = randn(gen, rows, 8, dtype=torch.float64)
        labels = (zigzag_labels(gen, rows // 2, "binary") if fmt == "A" else torch.ones(rows)).double()
        reference = ref_angle_loss_class(dataset_format=fmt, **weights)
        _same_value_and_gradient(lambda x: oracle.angle_loss_module(labels, x, dataset_format=fmt, **weights),
                                 lambda x: reference(labels[:, None], x), [x], f"AngleLoss format {fmt}",
                                 atol=REFERENCE_ATOL)


# --------------------------------------------------------------------------------------------------------
# the op contract assembled into the losses equals the reference's formulas
# --------------------------------------------------------------------------------------------------------
def test_pair_scores_give_the_reference_scores(gen):
    """cos is the cosine score; |angle| * tau is the reference's complex division, sum-pooled (/ D for mean)."""
    x = randn(gen, 74, 130, dtype=torch.float64)
    cos, angle = oracle.pair_scores(x.view(37, 2, 130), True)
    assert_close(20.0 * cos[:, 0], oracle.cosine_scores(x, 20.0), 1e-13, "cosine scores")
    assert_close(20.0 * angle[:, 0].abs(), oracle.angle_scores(x, 20.0, "sum"), 1e-13, "angle scores, sum")
    assert_close(20.0 * angle[:, 0].abs() / 130, oracle.angle_scores(x, 20.0, "mean"), 1e-13, "angle scores, mean")


def test_similarity_xent_gives_the_softmax_losses(gen):
    x = randn(gen, 38, 16, dtype=torch.float64)
    labels = zigzag_labels(gen, 19, "binary").double()
    group_ids = torch.randint(0, 12, (38,), generator=gen)
    for ids in (None, group_ids):
        _same_value_and_gradient(
            lambda x: oracle.similarity_xent(x, None, 20.0, "partner", row_weights=labels, exclude_diagonal=True,
                                             group_ids=ids),
            lambda x: oracle.in_batch_negative_loss(labels, x, 20.0, group_ids=ids), [x],
            f"in-batch negatives, group ids: {ids is not None}")
    text, pos, neg = x[:12], x[12:24], x[24:36]
    _same_value_and_gradient(lambda t, p, n: oracle.similarity_xent(t, torch.cat([p, n]), 20.0, "diagonal"),
                             lambda t, p, n: oracle.contrastive_with_negative_loss(t, p, n, 20.0), [text, pos, neg],
                             "contrastive with negatives")
    h1 = x[:19]
    h2 = h1 + 2.0 * randn(gen, 19, 16, dtype=torch.float64)  # target cosines well inside (-1, 1)
    _same_value_and_gradient(lambda a, b: oracle.similarity_xent(a, b, 1 / 0.05, "diagonal", margin=math.radians(10)),
                             lambda a, b: oracle.arccon_loss(a, b, 10.0, 0.05), [h1, h2], "arccon")

