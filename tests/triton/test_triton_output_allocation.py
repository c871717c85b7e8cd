"""How the Triton launchers allocate their outputs: uninitialised in production, NaN-poisoned for tests.

Every kernel writes each element of its outputs, so production allocates them with torch.empty: a NaN fill
would be one more full write (for the bandwidth-bound pair-score backward, about 50% over its floor). With
ANGLE_KERNELS_POISON_OUTPUTS=1 (on under pytest) `_common.new_output` fills them with NaN instead, so an
element a kernel forgets to write makes a test fail. Checked here: the switch, that no launch fills with NaN
when it is off (torch.full / full_like / Tensor.fill_ are watched during forward and backward of every op),
and that the results do not depend on it.
"""

from __future__ import annotations

import importlib
import math

import pytest
import torch

import triton_oracle as oracle
from angle_kernels.triton_ops import pair_scores, ranking_loss, similarity_xent

common = importlib.import_module("angle_kernels.triton_ops._common")
ranking = importlib.import_module("angle_kernels.triton_ops.ranking")

pytestmark = pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning")


def _is_nan(value) -> bool:
    return isinstance(value, (int, float)) and math.isnan(value)


@pytest.fixture
def nan_fills(monkeypatch):
    """A list that records every NaN fill made through torch.full, torch.full_like or Tensor.fill_."""
    seen: list[str] = []
    full, full_like, fill_ = torch.full, torch.full_like, torch.Tensor.fill_

    def watched_full(size, fill_value, *args, **kwargs):
        if _is_nan(fill_value):
            seen.append(f"torch.full({tuple(size)})")
        return full(size, fill_value, *args, **kwargs)

    def watched_full_like(t, fill_value, *args, **kwargs):
        if _is_nan(fill_value):
            seen.append(f"torch.full_like({tuple(t.shape)})")
        return full_like(t, fill_value, *args, **kwargs)

    def watched_fill_(t, value):
        if _is_nan(value):
            seen.append(f"Tensor.fill_({tuple(t.shape)})")
        return fill_(t, value)

    monkeypatch.setattr(torch, "full", watched_full)
    monkeypatch.setattr(torch, "full_like", watched_full_like)
    monkeypatch.setattr(torch.Tensor, "fill_", watched_fill_)
    return seen


def _grads(loss_or_outputs, leaves):
    outputs = loss_or_outputs if isinstance(loss_or_outputs, tuple) else (loss_or_outputs,)
    total = sum((o.double() * (1.0 + torch.arange(o.numel()).reshape(o.shape).to(o.device))).sum()
                for o in outputs if o.requires_grad)
    return torch.autograd.grad(total, leaves)


def _pair_scores(with_angle):
    def run():
        x = torch.randn(9, 3, 34, generator=torch.Generator().manual_seed(1)).to(oracle.DEVICE).requires_grad_()
        cos, angle = pair_scores(x, with_angle)
        return (cos.detach(), angle.detach(), *_grads((cos, angle), [x]))
    return run


def _ranking():
    gen = torch.Generator().manual_seed(2)
    scores = (5 * torch.randn(70, generator=gen)).to(oracle.DEVICE).requires_grad_()
    labels = torch.randint(0, 6, (70,), generator=gen).to(oracle.DEVICE)
    loss = ranking_loss(scores, labels)
    return (loss.detach(), *_grads(loss, [scores]))


# Sizes above the interpreter's 64-row/column tiles: the backward kernels accumulate into their gradient
# buffers block after block (read-modify-write), and the first block must store without reading the
# uninitialised (here: NaN) buffer.
def _similarity_symmetric():
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(80, 24, generator=gen).to(oracle.DEVICE).requires_grad_()
    groups = torch.randint(0, 27, (80,), generator=gen).to(oracle.DEVICE)
    loss = similarity_xent(q, None, 20.0, "partner", exclude_diagonal=True, group_ids=groups)
    return (loss.detach(), *_grads(loss, [q]))


def _similarity_rectangular():
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(70, 24, generator=gen).to(oracle.DEVICE).requires_grad_()
    c = torch.randn(140, 24, generator=gen).to(oracle.DEVICE).requires_grad_()
    loss = similarity_xent(q, c, 20.0, "diagonal", margin=0.2)
    return (loss.detach(), *_grads(loss, [q, c]))


OPS = {
    "pair_scores_angle": _pair_scores(True),
    "pair_scores_cos_only": _pair_scores(False),
    "ranking_tiled": _ranking,
    "ranking_sorted": _ranking,
    "similarity_symmetric_groups": _similarity_symmetric,
    "similarity_rectangular_margin": _similarity_rectangular,
}


def test_new_output_is_nan_only_when_poisoning(monkeypatch, nan_fills):
    monkeypatch.setenv(common.POISON_OUTPUTS_ENV, "1")
    poisoned = common.new_output((3, 5), torch.float32, torch.device(oracle.DEVICE))
    assert poisoned.shape == (3, 5) and poisoned.dtype == torch.float32 and torch.isnan(poisoned).all()
    assert len(nan_fills) == 1
    for off in ("0", ""):
        monkeypatch.setenv(common.POISON_OUTPUTS_ENV, off)
        plain = common.new_output((4,), torch.float64, torch.device(oracle.DEVICE))
        assert plain.shape == (4,) and plain.dtype == torch.float64
    monkeypatch.delenv(common.POISON_OUTPUTS_ENV)
    common.new_output((4,), torch.float64, torch.device(oracle.DEVICE))
    assert len(nan_fills) == 1  # off (unset, "0" or ""): torch.empty, no fill


@pytest.mark.parametrize("op", sorted(OPS))
def test_launches_fill_nothing_unless_poisoning(op, monkeypatch, nan_fills):
    if op == "ranking_sorted":  # the sort path at test size, with several scan blocks
        monkeypatch.setattr(ranking, "SMALL_N_MAX", 0)
        monkeypatch.setattr(ranking, "_SCAN_BLOCK", 16)
    monkeypatch.setenv(common.POISON_OUTPUTS_ENV, "0")
    production = OPS[op]()
    assert nan_fills == [], f"{op} filled outputs with NaN in production: {nan_fills}"

    monkeypatch.setenv(common.POISON_OUTPUTS_ENV, "1")
    poisoned = OPS[op]()
    assert nan_fills, "the poisoning switch is on but no NaN fill was seen"
    for got, ref in zip(production, poisoned):
        assert torch.isfinite(ref).all()  # every element of every poisoned output was written
        assert torch.equal(got, ref)


@pytest.mark.parametrize("poison", ["0", "1"])
def test_angle_without_angle_is_zeros_either_way(poison, monkeypatch):
    monkeypatch.setenv(common.POISON_OUTPUTS_ENV, poison)
    _, angle = pair_scores(torch.randn(5, 2, 7, device=oracle.DEVICE), False)
    assert torch.equal(angle, torch.zeros_like(angle))
