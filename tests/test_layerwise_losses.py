"""Layer-wise (Espresso / 2D-Matryoshka) training: `layer_weights` on every loss and on AngleLoss / ArcCSELoss.

Embeddings stacked [L, rows, D] give sum over (layer l, prefix i) of weight[l][i] * loss(x[l, ..., :d_i]); the
oracle here is exactly that sum of the float64 oracle's calls on each layer's truncated embeddings
(angle_kernels.testing.oracle), values and gradients, on every backend (a case with dims skips the backends whose
op lacks the nested prefixes), float64 and float32 plus bf16 at the half rule (under the Triton interpreter, one
weighting and dtype per case, in turn over each op's cases: _interpreted_triton_runs). Three weightings: one weight per
layer (the full width), one per layer times dim_weights, and a table with zeros (Espresso's: the earlier layers
only at the narrow width). Also: the pair-score losses make one op call for the whole stack, weights that are all
0 give 0 with zero gradients, and bad stacks or weights are refused.
"""

from __future__ import annotations

import pytest
import torch

import angle_kernels as ak
from angle_kernels.testing.cases import LOSS_CASES, MODULES_WITH_BOTH_OPS, Draw
from angle_kernels.testing.helpers import (HALF_DTYPES, across_backends, check_against_oracle, generator,
                                           skip_unless_feature)

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


def _draw(gen, dtype):
    """Inputs of the shared loss cases as stacks of LAYERS layers: 6 zigzag pairs, 7 rows (6 for MNRL)."""
    return Draw(gen, dtype, lead=(LAYERS,), width=WIDTH, pairs=6, rows=7, mnrl_rows=6)


def _zigzag(gen, dtype):
    return _draw(gen, dtype).zigzag()


def _stacks(gen, dtype, count):
    return _draw(gen, dtype).inputs(count)


# name -> (the op whose dims feature the loss needs, make(draw, kwargs) -> (inputs, ours(*x, backend), oracle of one
# layer's call)): the cases shared with the Matryoshka tests, but for mnrl_symmetric (those tests' own)
CASES = {name: case for name, case in LOSS_CASES.items() if name != "mnrl_symmetric"
         and name not in ("AngleLoss_A_gte", "AngleLoss_A_filter")}  # (the Matryoshka tests' own)


DTYPES = (torch.float64, torch.float32, *HALF_DTYPES[:1])


def _interpreted_triton_runs(name, weighting, dtype):
    """Under the Triton interpreter (seconds a case: similarity_lse's cases launch 90-170 kernels each), the cases of
    each op take the (weighting, dtype) runs in turn: run r of an op is its case r mod n (n cases) with weighting
    r mod 3 and dtype (r + r // 3) mod 3, for r < max(n, 3). So every case runs once (an op with fewer than three
    cases runs one of them twice), each op meets every weighting and every dtype, and an op of six cases six
    distinct (weighting, dtype) pairs. What a weighting asks of the op (no dims; two prefixes; one prefix narrower
    than the width) is the plain op's with more rows, whose dims tests/ops holds to the oracle in every dtype
    (test_dims_against_oracle); the stacking and weighting is the same front-end code on every backend, which the
    torch backend's cases (and a GPU's) check in every combination."""
    op = CASES[name][0]
    same_op = [case for case, (case_op, _) in CASES.items() if case_op == op]
    runs = max(len(same_op), len(WEIGHTINGS))
    return any((same_op[r % len(same_op)], list(WEIGHTINGS)[r % len(WEIGHTINGS)], DTYPES[(r + r // 3) % len(DTYPES)])
               == (name, weighting, dtype) for r in range(runs))


@pytest.mark.parametrize("backend, name, weighting, dtype", across_backends(
    [(name, weighting, dtype) for name in CASES for weighting in WEIGHTINGS for dtype in DTYPES],
    _interpreted_triton_runs), indirect=["backend"])
def test_against_the_oracle_of_each_layer(backend, name, weighting, dtype):
    op, make = CASES[name]
    kwargs, weights = WEIGHTINGS[weighting]
    if "dims" in kwargs:
        skip_unless_feature(backend, op, "dims")
        if name in MODULES_WITH_BOTH_OPS:
            skip_unless_feature(backend, "similarity_xent", "dims")
    inputs, ours, one_layer = make(_draw(generator("layerwise", name, weighting, dtype), dtype), kwargs)
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


def test_group_ids_apply_to_every_layer_of_a_stack():
    """in_batch_negative_loss on a stack with group_ids treats identical texts as positives in every layer, as it does
    on each layer alone; a stack that dropped them would push duplicates apart in every layer."""
    y_true, y_pred = _zigzag(generator("layerwise", "group ids"), torch.float64)
    labels = torch.ones_like(y_true)
    group_ids = torch.arange(y_pred.shape[1])
    group_ids[4], group_ids[9] = 0, 3  # row 4 repeats row 0's text, row 9 row 3's
    weights = [0.5, 1.0, 2.0]
    expected = sum(w * ak.in_batch_negative_loss(labels, y_pred[layer], group_ids=group_ids, backend="torch")
                   for layer, w in enumerate(weights))
    assert not torch.allclose(expected, ak.in_batch_negative_loss(labels, y_pred, layer_weights=weights,
                                                                  backend="torch"))
    got = ak.in_batch_negative_loss(labels, y_pred, group_ids=group_ids, layer_weights=weights, backend="torch")
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=0)


@pytest.mark.parametrize("kwargs", [dict(layer_weights=[0.0, 0.0, 0.0]),
                                    dict(layer_weights=[0.0, 0.0, 0.0], dims=(8, 16)),
                                    dict(layer_weights=[[0.0, 0.0]] * 3, dims=(8, 16))], ids=["layers", "dims", "rows"])
@pytest.mark.parametrize("name", list(CASES))
def test_weights_that_are_all_zero_give_a_zero_loss_with_zero_gradients(name, kwargs):
    """As all-zero dim_weights (and sentence-transformers' AdaptiveLayerLoss / Matryoshka2dLoss with every weight
    0): a loss of 0 with zero gradients, which a trainer can step on; these raised ValueError."""
    _, make = CASES[name]
    inputs, ours, _ = make(_draw(generator("layerwise", "all zero", name), torch.float64), kwargs)
    leaves = [x.clone().requires_grad_() for x in inputs]
    loss = ours(*leaves, backend="torch")
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0 and float(loss.detach()) == 0.0, (name, loss)
    grads = [g for g in torch.autograd.grad(loss, leaves, allow_unused=True) if g is not None]
    assert grads and all(not g.any() for g in grads), name


@pytest.mark.parametrize("kwargs, error, message", [
    (dict(layer_weights=[1.0, 1.0]), ValueError, "one entry per layer of the stack"),
    (dict(layer_weights=[1.0, float("nan"), 1.0]), ValueError, r"layer_weights\[1\]"),
    (dict(layer_weights=[[1.0, 1.0]] * 3), ValueError, "rows .* need dims"),
    (dict(layer_weights=[[1.0, 1.0]] * 3, dims=(8, 16), dim_weights=(1.0, 2.0)), ValueError, "replace dim_weights"),
    (dict(layer_weights=[[1.0]] * 3, dims=(8, 16)), ValueError, r"layer_weights\[0\] must have one weight per dim"),
    # a row longer than dims: its extra weight is a mistake, not to be dropped silently
    (dict(layer_weights=[[1.0, 1.0, 5.0]] * 3, dims=(8, 16)), ValueError,
     r"layer_weights\[0\] must have one weight per dim \(2\)"),
    (dict(layer_weights=[1.0, 1.0, 1.0], dims=(8, 32)), ValueError, "width 16"),
    # learned weights (a softmax of a parameter): .tolist() dropped their graph, and they never trained
    (dict(layer_weights=torch.nn.Parameter(torch.ones(3)).softmax(0)), TypeError,
     r"layer_weights must be real numbers, got a tensor that requires grad.*layer_weights.tolist\(\)"),
    (dict(layer_weights=list(torch.nn.Parameter(torch.ones(3)))), TypeError, r"layer_weights\[0\] .* requires grad"),
    (dict(layer_weights=[1.0] * 3, dims=(8, 16), dim_weights=torch.nn.Parameter(torch.ones(2))), TypeError,
     r"dim_weights\[0\] .* requires grad"),
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


@pytest.mark.parametrize("kwargs, named", [
    (dict(layer_weights=[1.0, 1e300, 1.0]), r"layer_weights\[1\]"),
    (dict(layer_weights=[[1.0, 1.0], [1.0, 1.0], [1.0, -1e39]], dims=(8, 16)), r"layer_weights\[2\]\[1\]"),
    # each factor fits, their product does not
    (dict(layer_weights=[1.0, 1e20, 1.0], dims=(16, 8), dim_weights=(1.0, 1e20)),
     r"layer_weights\[1\] x dim_weights\[1\]"),
])
def test_a_layer_weight_past_the_compute_dtypes_range_is_refused_by_name(kwargs, named):
    """A layer's weight (times a dim's) multiplies its loss in float32 for 32- and 16-bit embeddings: past float32's
    range it was inf, an inf loss and NaN gradients. Refused before any compute, naming the weight; float64 takes
    it."""
    y_true, y_pred = _zigzag(generator("layerwise", "weight range"), torch.float64)
    for dtype in (torch.float32, torch.bfloat16):
        with pytest.raises(ValueError, match=rf"^{named} must be within \+-3\.40282e\+38 \(float32's range"):
            ak.cosine_loss(y_true, y_pred.to(dtype), **kwargs)
    assert torch.isfinite(ak.cosine_loss(y_true, y_pred, **kwargs))
