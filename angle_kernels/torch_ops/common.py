"""Small helpers shared by the pure-PyTorch ops."""

from __future__ import annotations

import torch

from ..contract import NORM_EPS

# Work is cut into pieces of about this many elements, so temporaries stay a few MB whatever N is.
CHUNK_ELEMENTS = 1 << 22


def rows_per_chunk(row_elements: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(1, row_elements))


def row_dots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b, dim=-1) for [M, D] tensors as a batched GEMV: no [M, D] temporary."""
    return torch.bmm(a.unsqueeze(1), b.unsqueeze(2)).view(a.shape[0])


def inverse_norms_from_norms(norms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """1 / max(|x|, eps) from |x|, and the mask of vectors whose norm was not clamped (only those have a norm
    gradient)."""
    return 1.0 / norms.clamp_min(NORM_EPS), norms > NORM_EPS


def inverse_norms_from_squares(squared_norms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """inverse_norms_from_norms from |x|^2."""
    return inverse_norms_from_norms(squared_norms.clamp_min(0).sqrt())


def inverse_norms(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """inverse_norms_from_squares for the rows of a [M, D] tensor, in its own dtype."""
    return inverse_norms_from_squares(row_dots(x, x))


def prefix_slices(dims: tuple[int, ...]) -> list[tuple[int, int]]:
    """The column slices [d_{i-1}, d_i) between consecutive prefix widths (d_0 = 0)."""
    return list(zip((0,) + dims[:-1], dims))


def prefix_inverse_norms(x: torch.Tensor, dims: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """inverse_norms of every prefix x[:, :d] (d in dims) as [M, k] tensors, from running sums of the squared
    norms of the slices: x is read once for all prefixes."""
    squares = torch.stack([row_dots(x[:, lo:hi], x[:, lo:hi]) for lo, hi in prefix_slices(dims)], dim=1)
    return inverse_norms_from_squares(squares.cumsum(dim=1))


def normalise_backward(x: torch.Tensor, inv_norm: torch.Tensor, has_norm_grad: torch.Tensor,
                       d_hat: torch.Tensor) -> torch.Tensor:
    """Gradient with respect to x of x_hat = x * inv_norm, given d_hat = dL/dx_hat (overwritten):
    dx = inv * d_hat - inv^3 * (x . d_hat) * x, the second term only where the norm was not clamped."""
    radial = torch.where(has_norm_grad, inv_norm**3 * row_dots(x, d_hat), torch.zeros_like(inv_norm))
    return d_hat.mul_(inv_norm[:, None]).addcmul_(x, radial[:, None], value=-1.0)
