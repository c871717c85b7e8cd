"""The normalisation x_hat = x / max(|x|, eps) in PyTorch: inverse norms and its backward, on plain or scaled rows.

Shared by the torch backend (torch_ops/common.py builds its cosine helpers on these), the Triton backend's dense
similarity_xent scheme (triton_ops/similarity_xent_dense.py), which forms its gradients with torch products, and the
CUDA backend's similarity_lse (its rows' scales). Scaled
rows are x_s = s x with a power of two s per row (torch_ops/common.py, row scaling): the clamp becomes
max(|x_s|, eps s) and the gradient with respect to x is s times the one with respect to x_s.
"""

from __future__ import annotations

import torch

from .contract import NORM_EPS, compute_dtype

# float32 and float64 as bits: (integer dtype, mantissa bits, exponent bias)
_FLOAT_BITS = {torch.float32: (torch.int32, 23, 127), torch.float64: (torch.int64, 52, 1023)}


def row_dots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b, dim=-1) for [M, D] tensors as a batched GEMV: no [M, D] temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(a.shape[0])


def unscaled(dx: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """The gradient with respect to x from the one with respect to the scaled rows s x (in place): s dx; dx as it is
    when the rows were not scaled (scale None)."""
    return dx if scale is None else dx.mul_(scale[:, None])


def scaled_eps(scale: torch.Tensor) -> torch.Tensor:
    """The norm clamp of scaled rows, eps * s, floored at the dtype's smallest normal number (so that a zero row
    scaled by a tiny s, a prefix of a huge row, divides by a positive number)."""
    return (scale * NORM_EPS).clamp_min(torch.finfo(scale.dtype).tiny)


def inverse_norms_from_norms(norms: torch.Tensor, scale: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, torch.Tensor]:
    """1 / max(|x|, eps) from |x|, and the mask of vectors whose norm was not clamped (only those have a norm
    gradient). With `scale` (broadcastable to norms), the norms are those of scaled rows: 1 / max(|x_s|, eps s)."""
    if scale is None:
        return 1.0 / norms.clamp_min(NORM_EPS), norms > NORM_EPS
    eps = scaled_eps(scale)
    return 1.0 / torch.maximum(norms, eps), norms > eps


def normalise_backward(x: torch.Tensor, inv_norm: torch.Tensor, has_norm_grad: torch.Tensor,
                       d_hat: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Gradient with respect to x of x_hat = x * inv_norm, given d_hat = dL/dx_hat (overwritten):
    dx = inv * d_hat - inv^3 * (x . d_hat) * x, the second term only where the norm was not clamped.

    With `scale` [M], x and inv_norm are the scaled rows s x and their inverse norms (row_scales): the same
    formula is then the gradient with respect to s x, and s times it the gradient with respect to x."""
    radial = torch.where(has_norm_grad, inv_norm**3 * row_dots(x, d_hat), torch.zeros_like(inv_norm))
    return unscaled(d_hat.mul_(inv_norm[:, None]).addcmul_(x, radial[:, None], value=-1.0), scale)


def row_scales(x: torch.Tensor) -> torch.Tensor:
    """The per-row powers of two s of row scaling (torch_ops/common.py's docstring), [...] for x [..., D], in x's
    compute dtype: 1 where max|x_row| < 2, else 2^-floor(log2(max|x_row|)) (never below 2^-(bias - 1), so s stays
    a normal number)."""
    dtype = compute_dtype(x.dtype)
    if x.device.type == "cpu":  # two reductions (aminmax is much slower on CPU)
        low, high = x.amin(dim=-1), x.amax(dim=-1)
    else:  # one read of x
        low, high = torch.aminmax(x, dim=-1)
    largest = torch.maximum(high, low.neg()).to(dtype)  # max |x|, exact in any dtype
    int_dtype, mantissa, bias = _FLOAT_BITS[dtype]
    exponent = ((largest.view(int_dtype) >> mantissa) & (2 * bias + 1)) - bias  # floor(log2): exact, from the bits
    exponent = exponent.clamp(0, bias - 1)
    return ((bias - exponent) << mantissa).view(dtype)
