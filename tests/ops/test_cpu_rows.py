"""The row norms and normalisation backward of the torch backend's CPU softmax forms (torch_ops/_cpu_rows.py): the
same quantities as the blocked form's helpers (common.cosine_rows, common.inverse_norms,
normalisation.normalise_backward), by torch's vector norm and vecdot instead of batched GEMVs (torch.bmm), which a
CPU runs 4-7x slower.

Checked here: each function against the helper it stands for and against float64, on rows that need no scaling,
huge rows (scaled by their powers of two), zero rows (the clamp: no norm gradient), NaN rows (scaled, as there) and
16-bit rows; several tensors taken together (one unsafe row scales them all, which is exact); the chunked dot
products; and that the softmax forms' calls make no batched GEMV at all (the point of the module)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from angle_kernels.dispatch import raw_backend
from angle_kernels.normalisation import normalise_backward as gemv_normalise_backward
from angle_kernels.testing.helpers import generator, leaf_like, randn
from angle_kernels.torch_ops import _cpu_rows, common


def _blocked_form_rows(x: torch.Tensor):
    """What the blocked form computes for x: (rows, scale, inverse norms, has-norm-gradient mask)."""
    rows, scale, squares = common.cosine_rows(x)
    return (rows, scale, *common.inverse_norms(rows, scale, squares))


def _rows(name: str, dtype: torch.dtype, kind: str) -> torch.Tensor:
    x = randn(generator("cpu_rows", name, str(dtype), kind), 9, 37, dtype=torch.float64)
    if kind == "huge":
        x[2] *= 2.0**70 if dtype != torch.float64 else 2.0**700
    elif kind == "zero":
        x[4] = 0.0
    elif kind == "below_eps":  # a norm below eps = 1e-12, not zero: clamped, so no norm term in its gradient
        x[4] *= 5e-13 / x[4].norm()
    elif kind == "nan":
        x[1, 3] = float("nan")
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("kind", ["plain", "huge", "zero", "below_eps", "nan"])
def test_normalised_rows_are_the_blocked_forms(dtype, kind):
    """One tensor: the same rows and scales as the blocked form's helpers, the same has-norm-gradient mask, inverse
    norms within rounding of theirs and of float64's (the norm taken directly, not as the root of a sum of squares:
    the last bit may differ). Huge and NaN rows are scaled, as there."""
    if kind == "huge" and dtype == torch.float16:
        pytest.skip("float16 rows cannot hold values past float32's safe norm")
    x = _rows("one", dtype, kind)
    (rows, scale, inverse, has_grad), = _cpu_rows.normalised_rows(x)
    blocked_rows, blocked_scale, blocked_inverse, blocked_has_grad = _blocked_form_rows(x)
    torch.testing.assert_close(rows, blocked_rows, rtol=0, atol=0, equal_nan=True)
    assert (scale is None) == (blocked_scale is None) == (kind in ("plain", "zero", "below_eps"))
    if scale is not None:
        torch.testing.assert_close(scale, blocked_scale, rtol=0, atol=0)
    assert torch.equal(has_grad, blocked_has_grad)
    eps = torch.finfo(rows.dtype).eps
    torch.testing.assert_close(inverse, blocked_inverse, rtol=4 * eps, atol=0, equal_nan=True)
    # against float64: 1 / max(|x_s|, eps s) of the scaled rows
    exact = 1.0 / torch.maximum(torch.linalg.vector_norm(rows.double(), dim=1),
                                torch.full((rows.shape[0],), 1e-12, dtype=torch.float64)
                                * (1.0 if scale is None else scale.double()))
    torch.testing.assert_close(inverse.double(), exact, rtol=4 * eps, atol=0, equal_nan=True)


def test_tensors_taken_together_share_one_decision():
    """q and c together: safe rows in both compute unscaled; one huge row in c scales both (exact either way: each
    tensor's tuple is then what the blocked form gives for it scaled)."""
    q, c = _rows("q", torch.float32, "plain"), _rows("c", torch.float32, "plain")
    parts = _cpu_rows.normalised_rows(q, c)
    assert [scale for _, scale, _, _ in parts] == [None, None]
    for x, (rows, _, inverse, _) in zip((q, c), parts):
        assert rows.data_ptr() == x.data_ptr()  # float32 rows are used as they are
        torch.testing.assert_close(inverse, _blocked_form_rows(x)[2], rtol=4e-7, atol=0)
    c[5] *= 2.0**70
    for x, (rows, scale, inverse, has_grad) in zip((q, c), _cpu_rows.normalised_rows(q, c)):
        scaled, expected_scale = common.scaled_rows(x)
        torch.testing.assert_close(rows, scaled, rtol=0, atol=0)
        torch.testing.assert_close(scale, expected_scale, rtol=0, atol=0)
        expected_inverse, expected_has_grad = common.inverse_norms(scaled, expected_scale)
        torch.testing.assert_close(inverse, expected_inverse, rtol=4e-7, atol=0)
        assert torch.equal(has_grad, expected_has_grad)


@pytest.mark.parametrize("rows", [1, 7, 64, 65])
def test_row_vecdots_in_pieces(monkeypatch, rows):
    """Dot products of paired rows, a piece of rows at a time (a budget of 4 rows of 16 here), against float64."""
    monkeypatch.setattr(common, "CHUNK_ELEMENTS", 4 * 16)
    gen = generator("row_vecdots", rows)
    a, b = randn(gen, rows, 16), randn(gen, rows, 16)
    torch.testing.assert_close(_cpu_rows.row_vecdots(a, b).double(), (a.double() * b.double()).sum(dim=1),
                               rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kind", ["plain", "huge", "zero", "below_eps"])
def test_normalise_backward_is_the_blocked_forms(kind):
    """The gradient with respect to x of x / max(|x|, eps) (scaled rows with `scale`), against the blocked form's
    (normalisation.normalise_backward) and float64 autograd, each entry within float32's rounding of its row's
    largest; zero rows get d_hat / eps, no norm term."""
    x = _rows("backward", torch.float32, kind)
    d_hat = randn(generator("backward", kind), *x.shape)
    (rows, scale, inverse, has_grad), = _cpu_rows.normalised_rows(x)
    ours = _cpu_rows.normalise_backward(rows, inverse, has_grad, d_hat.clone(), scale)
    theirs = gemv_normalise_backward(rows, inverse, has_grad, d_hat.clone(), scale)
    leaf = x.double().requires_grad_()
    torch.nn.functional.normalize(leaf, dim=1).backward(d_hat.double())
    # each row's gradient is a difference of two terms: its entries are held to the row's largest, in float32
    row_atol = 4e-7 * leaf.grad.abs().amax(dim=1, keepdim=True)
    assert ((ours.double() - theirs.double()).abs() <= row_atol).all()
    assert ((ours.double() - leaf.grad).abs() <= row_atol).all()


class _OpNames(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("op", ["similarity_xent", "similarity_lse"])
def test_the_softmax_forms_make_no_batched_gemv(op):
    """A CPU call of either softmax form, forward and backward, makes no torch.bmm: its row norms and the
    normalisation's backward are this module's."""
    ops = raw_backend("torch")
    gen = generator("no_gemv", op)
    q, c = leaf_like(randn(gen, 12, 20)), leaf_like(randn(gen, 12, 20))
    recorded = _OpNames()
    with recorded:
        if op == "similarity_xent":
            loss = ops.similarity_xent(q, c, 20.0, "diagonal")
        else:
            loss = ops.similarity_lse(q, c, 20.0, 0, 0, "none", 0.0, "none", None, None, None, False, True).sum()
        loss.backward()
    assert "mm" in recorded.names and "bmm" not in recorded.names


def test_wide_rows_norms_are_within_a_few_ulps():
    """The norm taken by torch's vector norm, not as the root of a GEMV's sum of squares, is the more accurate one:
    at D = 4,096 (rows with a mean, whose squares add up to large sums) the inverse norms stay within 4 float32
    ulps of float64's (1.9 here), where the blocked form's GEMV-based ones drift past 8 (15.8)."""
    x = randn(generator("wide_rows"), 512, 4096, scale=3.0) + 0.5
    exact = 1.0 / torch.linalg.vector_norm(x.double(), dim=1)
    (_, _, inverse, _), = _cpu_rows.normalised_rows(x)
    ulp = torch.finfo(torch.float32).eps
    assert ((inverse.double() - exact).abs() / exact).max() <= 4 * ulp
    blocked_inverse = _blocked_form_rows(x)[2]
    assert ((blocked_inverse.double() - exact).abs() / exact).max() > 8 * ulp


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_row_scales_are_the_powers_of_two_of_each_rows_largest_magnitude(dtype):
    """1 for a row whose largest magnitude is below 2 (so it computes bit for bit as unscaled), else 2^-floor(log2)
    of that magnitude, negative entries included, and never below the compute dtype's smallest normal exponent + 1
    (the top binade's rows keep a non-zero scale)."""
    from angle_kernels.normalisation import row_scales

    top = torch.finfo(dtype).max
    rows = torch.tensor([[1.5, -0.5], [0.0, 0.0], [3.0, 0.0], [-5.0, 1.0], [0.25, -1024.5], [top, -top]],
                        dtype=torch.float64).to(dtype)
    bias = 1023 if dtype == torch.float64 else 127
    expected = torch.tensor([1.0, 1.0, 0.5, 0.25, 2.0**-10, 2.0 ** -(bias - 1)], dtype=torch.float64)
    got = row_scales(rows)
    assert got.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(got.double(), expected)


@pytest.mark.parametrize("scaled", [False, True], ids=["plain", "scaled"])
def test_a_clamped_norm_has_no_norm_gradient(scaled):
    """A row whose norm is below eps (eps s for rows scaled by s) divides by the clamp, so the mask that keeps the
    radial term of its gradient is off; rows above the clamp keep it."""
    from angle_kernels.contract import NORM_EPS
    from angle_kernels.normalisation import inverse_norms_from_norms

    scale = torch.tensor([4.0, 4.0, 4.0], dtype=torch.float64) if scaled else None
    clamp = NORM_EPS * (4.0 if scaled else 1.0)
    norms = torch.tensor([0.0, 0.5 * clamp, 2.0 * clamp], dtype=torch.float64)
    inverse, has_grad = inverse_norms_from_norms(norms, scale)
    assert has_grad.tolist() == [False, False, True]
    assert torch.equal(inverse, 1.0 / torch.tensor([clamp, clamp, 2.0 * clamp], dtype=torch.float64))
