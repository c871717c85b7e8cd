"""Matryoshka (dims / dim_weights) on every loss and on AngleLoss / ArcCSELoss: the result must be
sum_i w_i * loss(embeddings[..., :d_i]), the weighted sum over the truncated embeddings, computed here by the
float64 oracle of each truncated call (angle_kernels.testing.oracle), values and gradients, on every backend whose ops
implement the nested prefixes (the others are skipped), float64 and float32 plus bf16 at the half rule (under the
Triton interpreter, one dtype per case, in turn: _interpreted_triton_runs, on three of the widths and fewer rows).
Also: dims in any order with their weights, the fallback of a backend lacking the feature, bad arguments.
"""

from __future__ import annotations

import re

import pytest
import torch

import angle_kernels as ak
from angle_kernels.testing.cases import LOSS_CASES, MODULES_WITH_BOTH_OPS, Draw
from angle_kernels.testing.helpers import (HALF_DTYPES, across_backends, check_against_oracle, generator, in_turn,
                                           randn, skip_unless_feature)

WIDTH = 24
DIMS = (24, 8, 16, 6)  # any order: the losses sort them, with their weights
WEIGHTS = (1.0, 0.5, 2.0, 0.25)


# Through the Triton interpreter every program runs in Python: the pair-score kernels one per group (a pair, or a row
# of the in-batch losses), the fused similarity_lse once per prefix and block. There a case takes three of the widths,
# which keep what DIMS crosses (the full width, a prefix whose half is odd for the angle, a power of two; unsorted,
# each with its own weight; 8 is one more turn of the same slice loop), and fewer rows (_draw).
INTERPRETED_DIMS = (24, 6, 16)
INTERPRETED_WEIGHTS = (1.0, 0.25, 2.0)


def _widths(backend):
    """(dims, dim_weights) a case on `backend` runs with."""
    return (INTERPRETED_DIMS, INTERPRETED_WEIGHTS) if backend.interpreted else (DIMS, WEIGHTS)


def _weighted(oracle_fn, truncate_inputs, dims=DIMS, weights=WEIGHTS):
    """The oracle of the Matryoshka loss: sum_i w_i * oracle_fn(inputs truncated to d_i)."""
    def loss(*inputs):
        return sum(w * oracle_fn(*truncate_inputs(inputs, d)) for d, w in zip(dims, weights))
    return loss


def _cut(inputs, d):
    return [x[..., :d] for x in inputs]


def _draw(gen, dtype, interpreted=False):
    """Inputs of the shared loss cases: 7 zigzag pairs, 9 rows (8 for MNRL), WIDTH features; through the Triton
    interpreter 4 pairs and 4 rows (each a pair-score program; the similarity kernels take up to 16 rows in one
    row block either way), which still give the binary cases both labels."""
    if interpreted:
        return Draw(gen, dtype, lead=(), width=WIDTH, pairs=4, rows=4, mnrl_rows=4)
    return Draw(gen, dtype, lead=(), width=WIDTH, pairs=7, rows=9, mnrl_rows=8)


def _zigzag(gen, dtype):
    return _draw(gen, dtype).zigzag()


# name -> (the op whose dims feature the loss needs, make(draw, kwargs) -> (inputs, ours(*inputs, backend), oracle
# of one call)): the cases shared with the layer-wise tests, but for AngleLoss_B (those tests' own)
CASES = {name: case for name, case in LOSS_CASES.items() if name != "AngleLoss_B"}
# format A's in-batch options: the similarity_lse blocks that the mnrl cases hold to the oracle on every backend and
# dtype, composed by the loss layer (backend-independent); on the interpreted Triton backend (6-8 s a case) one
# dtype is enough
ONE_DTYPE_ON_TRITON = ("AngleLoss_A_gte", "AngleLoss_A_filter")
DTYPES = (torch.float64, torch.float32, *HALF_DTYPES[:1])
# the order the cases of an op take the dtypes in under the interpreter: float32 last, so that similarity_lse's two
# cases besides ONE_DTYPE_ON_TRITON (float32) take the other two
INTERPRETED_ROTATION = (torch.float64, HALF_DTYPES[0], torch.float32)


def _interpreted_triton_runs(name, dtype):
    """Under the Triton interpreter (seconds a case), each case in one dtype: ONE_DTYPE_ON_TRITON's in float32, the
    others' in turn among the cases of the same op (INTERPRETED_ROTATION), so that each op's dims meet every dtype.
    A case's front end is the same code on every backend, which the torch backend's cases check in every dtype, and
    tests/ops holds every op's dims to the oracle in every dtype (test_dims_against_oracle)."""
    if name in ONE_DTYPE_ON_TRITON:
        return dtype == torch.float32
    op = CASES[name][0]
    same_op = [case for case, (case_op, _) in CASES.items() if case_op == op and case not in ONE_DTYPE_ON_TRITON]
    return in_turn(same_op, INTERPRETED_ROTATION)(name, dtype)


@pytest.mark.parametrize("backend, name, dtype", across_backends(
    [(name, dtype) for name in CASES for dtype in DTYPES], _interpreted_triton_runs), indirect=["backend"])
def test_against_the_oracle_of_the_truncated_losses(backend, name, dtype):
    op, make = CASES[name]
    skip_unless_feature(backend, op, "dims")
    if name in ONE_DTYPE_ON_TRITON and backend.name == "triton" and dtype != torch.float32:
        pytest.skip("float32 only on the interpreted Triton backend (ONE_DTYPE_ON_TRITON)")
    if op == "pair_scores" and name in MODULES_WITH_BOTH_OPS:
        skip_unless_feature(backend, "similarity_xent", "dims")
    dims, weights = _widths(backend)
    inputs, ours, one_call = make(_draw(generator("matryoshka", name, dtype), dtype, backend.interpreted),
                                  dict(dims=dims, dim_weights=weights))
    check_against_oracle(lambda *x: ours(*x, backend=backend.name), _weighted(one_call, _cut, dims, weights), inputs,
                         f"{name} {dtype}", device=backend.device)


def test_the_interpreted_draws_give_the_binary_cases_both_labels(monkeypatch):
    """_draw's interpreted size (4 pairs) is small enough that a seed could draw one label only, which would leave a
    binary case (the in-batch-negative term's positives and negatives) half tested: every binary case meets both
    labels in every dtype, with the seeds test_against_the_oracle_of_the_truncated_losses draws them with."""
    drawn = []
    zigzag = Draw.zigzag

    def recorded(self, binary=False):
        labels, embeddings = zigzag(self, binary)
        if binary:
            drawn.append(labels)
        return labels, embeddings

    monkeypatch.setattr(Draw, "zigzag", recorded)
    checked = set()
    for name, (_, make) in CASES.items():
        for dtype in DTYPES:
            drawn.clear()
            make(_draw(generator("matryoshka", name, dtype), dtype, interpreted=True),
                 dict(dims=INTERPRETED_DIMS, dim_weights=INTERPRETED_WEIGHTS))
            for labels in drawn:
                assert set(labels.tolist()) == {0.0, 1.0}, (name, dtype, labels)
                checked.add(name)
    assert {"in_batch_negative_loss", "AngleLoss_A"} <= checked, checked


@pytest.mark.parametrize("name", list(CASES))
def test_weights_that_are_all_zero_give_a_zero_loss_with_zero_gradients(name):
    """As sentence-transformers' MatryoshkaLoss with every weight 0 (or a step whose sampled dims all weigh 0): a
    loss of 0 with zero gradients, not None (which a trainer's backward cannot take) nor an error."""
    _, make = CASES[name]
    inputs, ours, _ = make(_draw(generator("zero weights", name), torch.float64),
                           dict(dims=(8, 16), dim_weights=(0, 0)))
    leaves = [x.clone().requires_grad_() for x in inputs]
    loss = ours(*leaves, backend="torch")
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0 and float(loss) == 0.0, (name, loss)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    assert all(g is not None and not g.any() for g in grads), name


@pytest.mark.parametrize("name", ONE_DTYPE_ON_TRITON)
def test_one_pass_per_prefix_where_the_backend_lacks_dims(name, monkeypatch):
    """Format A's GTE partition and filter with dims where similarity_lse's dims would leave the backend the call
    without them takes (Ops.takes_in_one_call False): one call per prefix on the truncated embeddings, the same
    loss and gradients as the one-call path's."""
    from angle_kernels.dispatch import Ops

    _, make = CASES[name]
    inputs, ours, _ = make(_draw(generator("per prefix", name), torch.float64), dict(dims=DIMS, dim_weights=WEIGHTS))
    results = []
    for one_call in (True, False):
        monkeypatch.setattr(Ops, "takes_in_one_call", lambda self, *args, **kwargs: one_call)
        leaves = [x.clone().requires_grad_() for x in inputs]
        loss = ours(*leaves, backend="torch")
        results.append((loss, *torch.autograd.grad(loss, leaves)))
    for one_call, per_prefix in zip(*results):
        torch.testing.assert_close(per_prefix, one_call, rtol=1e-12, atol=1e-12)


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


# every loss that parses dims (through check_nested) on its embeddings' dtype: name -> call(embeddings dtype, kwargs)
def _dim_weight_calls(gen):
    y_true, y_pred = _zigzag(gen, torch.float64)
    binary = (y_true > 0.2).double()  # in-batch negatives take 0/1 labels
    q, p, n = (randn(gen, 4, y_pred.shape[-1], dtype=torch.float64) for _ in range(3))
    return {
        "cosine": lambda dtype, kw: ak.cosine_loss(y_true, y_pred.to(dtype), **kw),
        "angle": lambda dtype, kw: ak.angle_loss(y_true, y_pred.to(dtype), **kw),
        "in_batch_negative": lambda dtype, kw: ak.in_batch_negative_loss(binary, y_pred.to(dtype), **kw),
        "contrastive": lambda dtype, kw: ak.contrastive_with_negative_loss(q.to(dtype), p.to(dtype), n.to(dtype), **kw),
        "mnrl": lambda dtype, kw: ak.multiple_negatives_ranking_loss(q.to(dtype), p.to(dtype), [n.to(dtype)], **kw),
        "arccon": lambda dtype, kw: ak.arccon_loss(q.to(dtype), p.to(dtype), **kw),
        "triplet": lambda dtype, kw: ak.triplet_loss(q.to(dtype), p.to(dtype), n.to(dtype), 0.1, **kw),
    }


def test_a_dim_weight_past_the_compute_dtypes_range_is_refused_by_name():
    """A dim weight multiplies its prefix's loss in the compute dtype: float32 for 32- and 16-bit embeddings, where
    dim_weights (1e300, 1) was inf: an inf loss and NaN gradients. Refused before any compute, naming the weight
    and the range; float64 embeddings take it, the weighted sum the loss times the weight."""
    width = _zigzag(generator("matryoshka", "weight range"), torch.float64)[1].shape[-1]
    for name, call in _dim_weight_calls(generator("matryoshka", "weight range")).items():
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            with pytest.raises(ValueError, match=r"^dim_weights\[0\] must be within \+-3\.40282e\+38 \(float32's "
                                                 rf"range: the loss of {str(dtype)[6:]} embeddings is computed in "
                                                 r"float32, where a larger weight is inf\); got 1e\+300$"):
                call(dtype, dict(dims=(width, 8), dim_weights=(1e300, 1.0)))
        weighted = call(torch.float64, dict(dims=(width, 8), dim_weights=(1e300, 0.0)))
        torch.testing.assert_close(weighted, 1e300 * call(torch.float64, {}), rtol=1e-12, atol=0, msg=name)


# the factor each loss's logits are multiplied by, as the refusal names it, and the settings that make it 20
LOGIT_FACTORS = {"cosine": ("tau", {}), "angle": ("tau", {"tau": 20.0}), "in_batch_negative": ("tau", {}),
                 "contrastive": ("tau", {}), "mnrl": ("scale", {}), "arccon": ("1 / tau", {})}


@pytest.mark.parametrize("name", sorted(LOGIT_FACTORS))
def test_a_dim_weight_times_the_logits_factor_past_the_range_is_refused_by_name(name):
    """A dim weight within float32's range times the loss's logit factor (tau, scale, 1 / tau: 20 here) past it:
    the backward forms that product in float32, and a finite loss came with NaN gradients (mnrl dim_weights (3e37,):
    64 of 64 entries NaN). Refused before any compute, naming both; just inside the bound no gradient is NaN."""
    gen = generator("matryoshka", "scaled weight range")
    width = _zigzag(gen, torch.float64)[1].shape[-1]
    call = _dim_weight_calls(gen)[name]
    factor, settings = LOGIT_FACTORS[name]
    with pytest.raises(ValueError, match=rf"^the largest dims or layer weight x {re.escape(factor)} must be within "
                                         r"3\.40282e\+38 \(float32's range: .*; got 5\.1\d*e\+38$"):
        call(torch.float32, dict(settings, dims=(width, 8), dim_weights=(1.5 * 3.4028e38 / 20, 1.0)))
    call(torch.float64, dict(settings, dims=(width, 8), dim_weights=(1.5 * 3.4028e38 / 20, 1.0)))  # taken


@pytest.mark.parametrize("loss", ["mnrl", "in_batch_negative"])
def test_just_inside_the_scaled_weight_bound_no_gradient_is_nan(loss):
    gen = generator("matryoshka", "scaled weight gradients")
    q, p = (randn(gen, 8, 16) for _ in range(2))
    labels = torch.tensor([1.0, 1.0, 0.0, 0.0]).repeat(2)
    weights = {"dims": (16, 8), "dim_weights": (0.99 * 3.4028e38 / 20, 1.0)}
    leaf = q.clone().requires_grad_()
    value = (ak.multiple_negatives_ranking_loss(leaf, p, **weights) if loss == "mnrl" else
             ak.in_batch_negative_loss(labels, leaf, **weights))
    value.backward()
    assert not leaf.grad.isnan().any()
