"""Layer-wise (Espresso / 2D-Matryoshka) training: `layer_weights` on every loss and on AngleLoss / ArcCSELoss.

Embeddings stacked [L, rows, D] give sum over (layer l, prefix i) of weight[l][i] * loss(x[l, ..., :d_i]); the
oracle here is exactly that sum of the float64 oracle's calls on each layer's truncated embeddings (tests/oracle.py),
values and gradients, on every backend (a case with dims skips the backends whose op lacks the nested prefixes),
float64 and float32 plus bf16 at the half rule. Three weightings: one weight per layer (the full width), one
per layer times dim_weights, and a table with zeros (Espresso's: the earlier layers only at the narrow width).
Also: the pair-score losses make one op call for the whole stack, and bad stacks or weights are refused.
"""

from __future__ import annotations

import pytest
import torch

import angle_kernels as ak
import oracle
from ak_testing import HALF_DTYPES, check_against_oracle, generator, randn, skip_unless_feature

LAYERS, WIDTH = 3, 16
# name -> (the keyword arguments of our call, the weight of (layer, width) for the oracle)
WEIGHTINGS = {
    "per_layer": (dict(layer_weights=[0.5, 1.0, 2.0]),
                  {(0, WIDTH): 0.5, (1, WIDTH): 1.0, (2, WIDTH): 2.0}),
    "per_layer_and_dim": (dict(layer_weights=[1.0, 0.25, 2.0], dims=(16, 6), dim_weights=(1.0, 3.0)),
                          {(0, 16): 1.0, (0, 6): 3.0, (1, 16): 0.25, (1, 6): 0.75, (2, 16): 2.0, (2, 6): 6.0}),
    "table_with_zeros": (dict(layer_weights=[[1.0, 1.0], [0.5, 0.0], [0.25, 0.0]], dims=(8, 16)),
                         {(0, 8): 1.0, (0, 16): 1.0, (1, 8): 0.5, (2, 8): 0.25}),
}


def _layerwise(oracle_fn, weights):
    """The oracle of a stacked loss: sum over (layer, width) of weight * oracle_fn(each input's layer, truncated)."""
    def loss(*stacks):
        return sum(w * oracle_fn(*(x[layer, :, :width] for x in stacks)) for (layer, width), w in weights.items())
    return loss


def _zigzag(gen, dtype, pairs=6, binary=False):
    labels = (torch.rand(pairs, generator=gen) > 0.4).double() if binary else torch.rand(pairs, generator=gen)
    return labels.repeat_interleave(2), randn(gen, LAYERS, 2 * pairs, WIDTH, dtype=dtype)


def _stacks(gen, dtype, count, rows=7):
    return [randn(gen, LAYERS, rows, WIDTH, dtype=dtype) for _ in range(count)]


# name -> (the op whose dims feature the loss needs, make(gen, dtype, kwargs) -> (inputs, ours(*x, backend), oracle
# of one layer's call))
def _cosine(gen, dtype, kwargs):
    y_true, y_pred = _zigzag(gen, dtype)
    return ([y_pred], lambda x, backend: ak.cosine_loss(y_true, x, **kwargs, backend=backend),
            lambda x: oracle.cosine_loss(y_true, x))


def _angle(gen, dtype, kwargs):
    y_true, y_pred = _zigzag(gen, dtype)
    return ([y_pred], lambda x, backend: ak.angle_loss(y_true, x, 20.0, "mean", **kwargs, backend=backend),
            lambda x: oracle.angle_loss(y_true, x, 20.0, "mean"))


def _in_batch(gen, dtype, kwargs):
    y_true, y_pred = _zigzag(gen, dtype, binary=True)
    return ([y_pred], lambda x, backend: ak.in_batch_negative_loss(y_true, x, **kwargs, backend=backend),
            lambda x: oracle.in_batch_negative_loss(y_true, x))


def _contrastive(gen, dtype, kwargs):
    return (_stacks(gen, dtype, 3), lambda q, p, n, backend: ak.contrastive_with_negative_loss(
                q, p, n, **kwargs, backend=backend),
            oracle.contrastive_with_negative_loss)


def _arccon(gen, dtype, kwargs):
    return (_stacks(gen, dtype, 2), lambda a, b, backend: ak.arccon_loss(a, b, **kwargs, backend=backend),
            oracle.arccon_loss)


def _triplet(gen, dtype, kwargs):
    return (_stacks(gen, dtype, 3), lambda a, w, s, backend: ak.triplet_loss(a, w, s, 0.1, **kwargs, backend=backend),
            lambda a, w, s: oracle.triplet_loss(a, w, s, 0.1))


def _mnrl(options):
    def make(gen, dtype, kwargs):
        return (_stacks(gen, dtype, 3, rows=6), lambda q, p, n, backend: ak.multiple_negatives_ranking_loss(
                    q, p, (n,), **kwargs, backend=backend, **options),
                lambda q, p, n: oracle.multiple_negatives_ranking_loss(q, p, (n,), 20.0, **options))
    return make


def _split(kwargs):
    """AngleLoss / ArcCSELoss take dims at construction and layer_weights in forward."""
    kwargs = dict(kwargs)
    return kwargs.pop("layer_weights"), kwargs


def _angle_module(dataset_format):
    def make(gen, dtype, kwargs):
        layer_weights, nested = _split(kwargs)
        if dataset_format == "A":
            labels, outputs = _zigzag(gen, dtype, binary=True)
        else:
            labels, outputs = torch.zeros(18), randn(gen, LAYERS, 18, WIDTH, dtype=dtype)
        weights = dict(cosine_w=1.0, angle_w=0.5, dataset_format=dataset_format)
        module = ak.AngleLoss(**weights, **nested)

        def ours(x, backend):
            module.backend = backend
            return module(labels, x, layer_weights=layer_weights)
        return [outputs], ours, lambda x: oracle.angle_loss_module(labels, x, **weights)
    return make


def _arccse_module(gen, dtype, kwargs):
    layer_weights, nested = _split(kwargs)
    module = ak.ArcCSELoss(**nested)

    def ours(*xs, backend):
        module.backend = backend
        return module(*xs, layer_weights=layer_weights)
    return _stacks(gen, dtype, 5), ours, oracle.arccse_loss


CASES = {
    "cosine_loss": ("pair_scores", _cosine),
    "angle_loss": ("pair_scores", _angle),
    "triplet_loss": ("pair_scores", _triplet),
    "in_batch_negative_loss": ("similarity_xent", _in_batch),
    "contrastive_with_negative_loss": ("similarity_xent", _contrastive),
    "arccon_loss": ("similarity_xent", _arccon),
    "mnrl_standard": ("similarity_xent", _mnrl({})),
    "mnrl_gte_hardness": ("similarity_xent", _mnrl(dict(directions=("query_to_doc", "query_to_query",
                                                                    "doc_to_query", "doc_to_doc"),
                                                        hardness_mode="in_batch_negatives", hardness_strength=3.0))),
    "AngleLoss_A": ("pair_scores", _angle_module("A")),
    "AngleLoss_B": ("similarity_xent", _angle_module("B")),
    "AngleLoss_C": ("pair_scores", _angle_module("C")),
    "ArcCSELoss": ("pair_scores", _arccse_module),
}
MODULES_WITH_BOTH_OPS = ("AngleLoss_A", "AngleLoss_C", "ArcCSELoss")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, *HALF_DTYPES[:1]], ids=str)
@pytest.mark.parametrize("weighting", list(WEIGHTINGS))
@pytest.mark.parametrize("name", list(CASES))
def test_against_the_oracle_of_each_layer(backend, name, weighting, dtype):
    op, make = CASES[name]
    kwargs, weights = WEIGHTINGS[weighting]
    if "dims" in kwargs:
        skip_unless_feature(backend, op, "dims")
        if name in MODULES_WITH_BOTH_OPS:
            skip_unless_feature(backend, "similarity_xent", "dims")
    inputs, ours, one_layer = make(generator("layerwise", name, weighting, dtype), dtype, kwargs)
    check_against_oracle(lambda *x: ours(*x, backend=backend.name), _layerwise(one_layer, weights), inputs,
                         f"{name} {weighting} {dtype}", device=backend.device)


def test_the_pair_score_losses_make_one_op_call_for_the_stack(monkeypatch):
    """Every layer and prefix of a stack from one pair_scores call: the layers' groups become more groups."""
    from angle_kernels.dispatch import Ops
    calls = []
    original = Ops.pair_scores

    def counting(self, x, with_angle, dims=None):
        calls.append((tuple(x.shape), dims))
        return original(self, x, with_angle, dims)
    monkeypatch.setattr(Ops, "pair_scores", counting)
    y_true, y_pred = _zigzag(generator("layerwise", "calls"), torch.float64)
    ak.AngleLoss(cosine_w=1.0, ibn_w=0.0, angle_w=1.0, dataset_format="A", dims=(8, 16), backend="torch")(
        y_true, y_pred, layer_weights=[1.0, 0.5, 0.25])
    assert calls == [((LAYERS * 6, 2, WIDTH), (8, 16))]


def test_zero_weights_and_a_one_layer_stack():
    """A layer weighted 0 adds nothing (its terms are skipped); a stack of one layer is the plain loss."""
    y_true, y_pred = _zigzag(generator("layerwise", "zero"), torch.float64)
    for loss in (ak.cosine_loss, ak.in_batch_negative_loss):
        labels = (y_true > 0.5).double() if loss is ak.in_batch_negative_loss else y_true
        expected = loss(labels, y_pred[0]) + loss(labels, y_pred[2])
        torch.testing.assert_close(loss(labels, y_pred, layer_weights=[1.0, 0.0, 1.0]), expected, rtol=1e-14, atol=0)
        assert torch.equal(loss(labels, y_pred[:1], layer_weights=[1.0]), loss(labels, y_pred[0]))


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(layer_weights=[1.0, 1.0]), ValueError, "one entry per layer of the stack"),
    (dict(layer_weights=[0.0, 0.0, 0.0]), ValueError, "every .* weight is 0"),
    (dict(layer_weights=[1.0, float("nan"), 1.0]), ValueError, r"layer_weights\[1\]"),
    (dict(layer_weights=[[1.0, 1.0]] * 3), ValueError, "rows .* need dims"),
    (dict(layer_weights=[[1.0, 1.0]] * 3, dims=(8, 16), dim_weights=(1.0, 2.0)), ValueError, "replace dim_weights"),
    (dict(layer_weights=[[1.0]] * 3, dims=(8, 16)), ValueError, r"layer_weights\[0\] must have one weight per dim"),
    (dict(layer_weights=[1.0, 1.0, 1.0], dims=(8, 32)), ValueError, "width 16"),
])
def test_bad_layer_weights_are_refused(kwargs, error, message):
    y_true, y_pred = _zigzag(generator("layerwise", "bad"), torch.float32)
    with pytest.raises(error, match=message):
        ak.cosine_loss(y_true, y_pred, **kwargs)


def test_stacks_must_be_three_dimensional_and_alike():
    gen = generator("layerwise", "shapes")
    y_true, y_pred = _zigzag(gen, torch.float32)
    with pytest.raises(ValueError, match=r"y_pred: with layer_weights, embeddings are a stack \[L, rows, D\]"):
        ak.cosine_loss(y_true, y_pred[0], layer_weights=[1.0])
    q, p = _stacks(gen, torch.float32, 2)
    with pytest.raises(ValueError, match="pos: every stack needs the same number"):
        ak.contrastive_with_negative_loss(q, p[:2], layer_weights=[1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="gather_across_devices"):
        ak.multiple_negatives_ranking_loss(q, p, layer_weights=[1.0] * 3, gather_across_devices=True)
    with pytest.raises(ValueError, match="labels|y_true"):
        ak.cosine_loss(y_true[:-2], y_pred, layer_weights=[1.0] * 3)
