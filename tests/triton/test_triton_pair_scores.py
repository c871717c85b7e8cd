"""Triton pair_scores under the interpreter against the float64 oracle (and torch_ops when present)."""

from __future__ import annotations

import pytest
import torch

import triton_oracle as oracle
from angle_kernels.triton_ops import pair_scores

SHAPES = [(37, 2, 130), (5, 3, 6), (1, 2, 2), (16, 3, 64)]


def _inputs(groups, k, d, dtype, layout="contiguous", zero_row=True):
    gen = torch.Generator().manual_seed(oracle.seed(groups, k, d, str(dtype), layout))
    if layout == "contiguous":
        x = torch.randn(groups, k, d, generator=gen)
    elif layout == "strided_d":  # every other element of a wider tensor
        x = torch.randn(groups, k, 2 * d, generator=gen)[:, :, ::2]
    else:  # "group_minor": groups are the fastest-moving index after D
        x = torch.randn(k, groups, d, generator=gen).transpose(0, 1)
    if zero_row:
        x[0, 1] = 0.0  # a zero vector: finite everywhere, cosine 0
    return x.to(dtype)


def _run(x, with_angle, grad_seed):
    """The kernels on oracle.DEVICE (x's strides kept); results come back on CPU."""
    # A fresh leaf with x's strides (clone() would make a non-dense layout contiguous).
    leaf = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=oracle.DEVICE)
    leaf.copy_(x.detach())
    assert leaf.stride() == x.stride()
    leaf.requires_grad_()
    cos, angle = pair_scores(leaf, with_angle)
    gen = torch.Generator().manual_seed(grad_seed)
    gc = torch.randn(cos.shape, generator=gen, dtype=torch.float64)
    ga = torch.randn(cos.shape, generator=gen, dtype=torch.float64)
    loss = (cos.double() * gc.to(cos.device)).sum()
    if with_angle:
        loss = loss + (angle.double() * ga.to(cos.device)).sum()
    loss.backward()
    return cos.detach().cpu(), angle.detach().cpu(), leaf.grad.cpu(), gc, ga


def _reference(x, with_angle, gc, ga, dtype=torch.float64):
    leaf = x.detach().to(dtype).requires_grad_()
    cos, angle = oracle.pair_scores(leaf)
    loss = (cos.double() * gc).sum() + ((angle.double() * ga).sum() if with_angle else 0.0)
    loss.backward()
    return cos, angle, leaf.grad


@pytest.mark.parametrize("groups,k,d", SHAPES)
@pytest.mark.parametrize("with_angle", [True, False])
def test_fp32_against_oracle(groups, k, d, with_angle):
    x = _inputs(groups, k, d, torch.float32)
    cos, angle, dx, gc, ga = _run(x, with_angle, oracle.seed("g", groups, k, d))
    ref_cos, ref_angle, ref_dx = _reference(x, with_angle, gc, ga)
    assert cos.dtype == torch.float32 and cos.shape == (groups, k - 1)
    assert dx.dtype == torch.float32 and dx.shape == x.shape
    assert oracle.rel_err(cos, ref_cos) < 1e-6
    if with_angle:
        assert oracle.rel_err(angle, ref_angle) < 1e-6
    else:
        assert torch.equal(angle, torch.zeros_like(angle))
    assert oracle.rel_err(dx, ref_dx) < 1e-5
    assert torch.isfinite(dx).all()


@pytest.mark.parametrize("layout", ["strided_d", "group_minor"])
def test_arbitrary_strides(layout):
    x = _inputs(9, 3, 34, torch.float32, layout)
    assert not x.is_contiguous()
    cos, angle, dx, gc, ga = _run(x, True, 7)
    ref_cos, ref_angle, ref_dx = _reference(x, True, gc, ga)
    assert oracle.rel_err(cos, ref_cos) < 1e-6
    assert oracle.rel_err(angle, ref_angle) < 1e-6
    assert oracle.rel_err(dx, ref_dx) < 1e-5


def test_odd_d_without_angle_and_zigzag_view():
    y_pred = _inputs(11, 2, 33, torch.float32).reshape(22, 33)  # zigzag rows
    cos, angle, dx, gc, ga = _run(y_pred.view(11, 2, 33), False, 3)
    ref_cos, _, ref_dx = _reference(y_pred.view(11, 2, 33), False, gc, ga)
    assert oracle.rel_err(cos, ref_cos) < 1e-6
    assert oracle.rel_err(dx, ref_dx) < 1e-5


def test_float64_stays_float64():
    x = _inputs(7, 3, 18, torch.float64)
    cos, angle, dx, gc, ga = _run(x, True, 5)
    ref_cos, ref_angle, ref_dx = _reference(x, True, gc, ga)
    assert cos.dtype == torch.float64 and dx.dtype == torch.float64
    assert oracle.rel_err(cos, ref_cos) < 1e-13
    assert oracle.rel_err(angle, ref_angle) < 1e-13
    assert oracle.rel_err(dx, ref_dx) < 1e-12


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_twice_eager_error(dtype):
    groups, k, d = 32, 3, 130
    # No zero row: eager fp16 turns eps = 1e-12 into 0 and returns NaN there, and a zero vector's gradient
    # (about 1 / eps) overflows fp16 in any implementation.
    x = _inputs(groups, k, d, dtype, zero_row=False)
    cos, angle, dx, gc, ga = _run(x, True, 11)
    ref_cos, ref_angle, ref_dx = _reference(x, True, gc, ga)
    eager_cos, eager_angle, eager_dx = _reference(x, True, gc, ga, dtype=dtype)  # eager PyTorch in that dtype
    assert cos.dtype == torch.float32 and dx.dtype == dtype
    assert oracle.rel_err(cos, ref_cos) <= 2 * oracle.rel_err(eager_cos, ref_cos)
    assert oracle.rel_err(angle, ref_angle) <= 2 * oracle.rel_err(eager_angle, ref_angle)
    assert oracle.rel_err(dx, ref_dx) <= 2 * oracle.rel_err(eager_dx, ref_dx)


def test_odd_d_with_angle_raises():
    with pytest.raises(ValueError, match="even D"):
        pair_scores(torch.randn(3, 2, 5, device=oracle.DEVICE), True)


def test_bad_shape_and_dtype_raise():
    with pytest.raises(ValueError, match="x must be"):
        pair_scores(torch.randn(3, 1, 4, device=oracle.DEVICE), True)
    with pytest.raises(TypeError, match="x must be"):
        pair_scores(torch.ones(3, 2, 4, dtype=torch.int32, device=oracle.DEVICE), True)


def test_matches_torch_ops():
    ops = oracle.torch_ops_or_none()
    if ops is None or not hasattr(ops, "pair_scores"):
        pytest.skip("angle_kernels.torch_ops.pair_scores is not there yet")
    x = _inputs(13, 3, 66, torch.float32)
    cos, angle, dx, gc, ga = _run(x, True, 13)
    leaf = x.clone().requires_grad_()  # the torch backend on CPU
    t_cos, t_angle = ops.pair_scores(leaf, True)
    ((t_cos.double() * gc).sum() + (t_angle.double() * ga).sum()).backward()
    assert oracle.rel_err(cos, t_cos) < 1e-6
    assert oracle.rel_err(angle, t_angle) < 1e-6
    assert oracle.rel_err(dx, leaf.grad) < 1e-5
