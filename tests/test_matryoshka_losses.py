"""Matryoshka (dims / dim_weights) on every loss and on AngleLoss / ArcCSELoss: the result must be
sum_i w_i * loss(embeddings[..., :d_i]), the weighted sum over the truncated embeddings, computed here by the
float64 oracle of each truncated call (tests/oracle.py), values and gradients, on every backend whose ops
implement the nested prefixes (the others are skipped), float64 and float32 plus bf16 at the half rule.
Also: dims in any order with their weights, the fallback of a backend lacking the feature, bad arguments.
"""

from __future__ import annotations

import pytest
import torch

import angle_kernels as ak
import oracle
from ak_testing import HALF_DTYPES, check_against_oracle, generator, randn, skip_unless_feature

WIDTH = 24
DIMS = (24, 8, 16, 6)  # any order: the losses sort them, with their weights
WEIGHTS = (1.0, 0.5, 2.0, 0.25)


def _weighted(oracle_fn, truncate_inputs):
    """The oracle of the Matryoshka loss: sum_i w_i * oracle_fn(inputs truncated to d_i)."""
    def loss(*inputs):
        return sum(w * oracle_fn(*truncate_inputs(inputs, d)) for d, w in zip(DIMS, WEIGHTS))
    return loss


def _cut(inputs, d):
    return [x[..., :d] for x in inputs]


def _zigzag(gen, dtype, pairs=7, binary=False):
    labels = (torch.rand(pairs, generator=gen) > 0.4).double() if binary else torch.rand(pairs, generator=gen)
    return labels.repeat_interleave(2), randn(gen, 2 * pairs, WIDTH, dtype=dtype)


# name -> (the op whose dims feature the loss needs, make(gen, dtype) -> (inputs, ours(*inputs, backend), oracle))
def _cosine(gen, dtype):
    y_true, y_pred = _zigzag(gen, dtype)
    return ([y_pred], lambda x, backend: ak.cosine_loss(y_true, x, dims=DIMS, dim_weights=WEIGHTS, backend=backend),
            _weighted(lambda x: oracle.cosine_loss(y_true, x), _cut))


def _angle(gen, dtype):
    y_true, y_pred = _zigzag(gen, dtype)
    return ([y_pred], lambda x, backend: ak.angle_loss(y_true, x, 20.0, "mean", dims=DIMS, dim_weights=WEIGHTS,
                                                       backend=backend),
            _weighted(lambda x: oracle.angle_loss(y_true, x, 20.0, "mean"), _cut))


def _in_batch(gen, dtype):
    y_true, y_pred = _zigzag(gen, dtype, binary=True)
    return ([y_pred], lambda x, backend: ak.in_batch_negative_loss(y_true, x, dims=DIMS, dim_weights=WEIGHTS,
                                                                   backend=backend),
            _weighted(lambda x: oracle.in_batch_negative_loss(y_true, x), _cut))


def _contrastive(gen, dtype):
    inputs = [randn(gen, 9, WIDTH, dtype=dtype) for _ in range(3)]
    return (inputs, lambda q, p, n, backend: ak.contrastive_with_negative_loss(q, p, n, dims=DIMS,
                                                                               dim_weights=WEIGHTS, backend=backend),
            _weighted(oracle.contrastive_with_negative_loss, _cut))


def _arccon(gen, dtype):
    inputs = [randn(gen, 9, WIDTH, dtype=dtype) for _ in range(2)]
    return (inputs, lambda a, b, backend: ak.arccon_loss(a, b, dims=DIMS, dim_weights=WEIGHTS, backend=backend),
            _weighted(oracle.arccon_loss, _cut))


def _triplet(gen, dtype):
    inputs = [randn(gen, 9, WIDTH, dtype=dtype) for _ in range(3)]
    return (inputs, lambda a, w, s, backend: ak.triplet_loss(a, w, s, 0.1, dims=DIMS, dim_weights=WEIGHTS,
                                                             backend=backend),
            _weighted(lambda a, w, s: oracle.triplet_loss(a, w, s, 0.1), _cut))


def _mnrl(options):
    def make(gen, dtype):
        inputs = [randn(gen, 8, WIDTH, dtype=dtype) for _ in range(3)]
        return (inputs, lambda q, p, n, backend: ak.multiple_negatives_ranking_loss(
                    q, p, (n,), dims=DIMS, dim_weights=WEIGHTS, backend=backend, **options),
                _weighted(lambda q, p, n: oracle.multiple_negatives_ranking_loss(q, p, (n,), 20.0, **options), _cut))
    return make


def _angle_module(dataset_format):
    def make(gen, dtype):
        if dataset_format == "A":
            labels, outputs = _zigzag(gen, dtype, binary=True)
        else:
            labels, outputs = torch.zeros(18), randn(gen, 18, WIDTH, dtype=dtype)
        weights = dict(cosine_w=1.0, angle_w=0.5, dataset_format=dataset_format)
        module = ak.AngleLoss(**weights, dims=DIMS, dim_weights=WEIGHTS)

        def ours(x, backend):
            module.backend = backend
            return module(labels, x)
        return [outputs], ours, _weighted(lambda x: oracle.angle_loss_module(labels, x, **weights), _cut)
    return make


def _arccse_module(gen, dtype):
    inputs = [randn(gen, 9, WIDTH, dtype=dtype) for _ in range(5)]
    module = ak.ArcCSELoss(dims=DIMS, dim_weights=WEIGHTS)

    def ours(*xs, backend):
        module.backend = backend
        return module(*xs)
    return inputs, lambda *xs, backend: ours(*xs, backend=backend), _weighted(oracle.arccse_loss, _cut)


CASES = {
    "cosine_loss": ("pair_scores", _cosine),
    "angle_loss": ("pair_scores", _angle),
    "triplet_loss": ("pair_scores", _triplet),
    "in_batch_negative_loss": ("similarity_xent", _in_batch),
    "contrastive_with_negative_loss": ("similarity_xent", _contrastive),
    "arccon_loss": ("similarity_xent", _arccon),
    "mnrl_standard": ("similarity_xent", _mnrl({})),
    "mnrl_symmetric": ("similarity_xent", _mnrl(dict(directions=("query_to_doc", "doc_to_query"),
                                                      partition_mode="per_direction"))),
    # similarity_lse has no dims: one pass per prefix, still against the same oracle
    "mnrl_gte_hardness": ("similarity_xent", _mnrl(dict(directions=("query_to_doc", "query_to_query",
                                                                    "doc_to_query", "doc_to_doc"),
                                                        hardness_mode="in_batch_negatives", hardness_strength=3.0))),
    "AngleLoss_A": ("pair_scores", _angle_module("A")),
    "AngleLoss_C": ("pair_scores", _angle_module("C")),
    "ArcCSELoss": ("pair_scores", _arccse_module),
}


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, *HALF_DTYPES[:1]], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_against_the_oracle_of_the_truncated_losses(backend, name, dtype):
    op, make = CASES[name]
    skip_unless_feature(backend, op, "dims")
    if op == "pair_scores" and name in ("AngleLoss_A", "AngleLoss_C", "ArcCSELoss"):
        skip_unless_feature(backend, "similarity_xent", "dims")
    inputs, ours, exact = make(generator("matryoshka", name, dtype), dtype)
    check_against_oracle(lambda *x: ours(*x, backend=backend.name), exact, inputs, f"{name} {dtype}",
                         device=backend.device)


def test_one_dim_is_the_truncated_loss():
    """dims=(d,) is the loss on the first d features, exactly (no weight, no sum)."""
    gen = generator("matryoshka", "one")
    y_true, y_pred = _zigzag(gen, torch.float64)
    assert torch.equal(ak.cosine_loss(y_true, y_pred, dims=(10,)), ak.cosine_loss(y_true, y_pred[:, :10]))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(dims=(8, 8)), ValueError, "distinct"),
    (dict(dims=(8, 32)), ValueError, "width 24"),
    (dict(dims=(8, 16), dim_weights=(1.0,)), ValueError, "one weight per dim"),
    (dict(dim_weights=(1.0,)), ValueError, "dim_weights needs dims"),
    (dict(dims=(8, 16.0)), TypeError, r"dims\[1\]"),
    (dict(dims=(0, 8)), ValueError, r"dims\[0\] must be >= 1"),
    (dict(dims=(8, 16), dim_weights=(1.0, float("nan"))), ValueError, r"dim_weights\[1\]"),
    (dict(dims=()), TypeError, "non-empty"),
])
def test_bad_dims_are_refused(kwargs, error, message):
    gen = generator("matryoshka", "bad")
    y_true, y_pred = _zigzag(gen, torch.float32)
    with pytest.raises(error, match=message):
        ak.cosine_loss(y_true, y_pred, **kwargs)


def test_angle_needs_even_dims():
    y_true, y_pred = _zigzag(generator("matryoshka", "odd"), torch.float32)
    with pytest.raises(ValueError, match="even"):
        ak.angle_loss(y_true, y_pred, dims=(24, 7))
