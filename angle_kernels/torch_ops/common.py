"""Small helpers shared by the pure-PyTorch ops.

Row scaling. Finite rows can have squared norms and dot products beyond the compute dtype (float32 rows around
1.8e19, float64 around 1.3e154): x x^T overflows to inf and the loss to NaN. Every cosine is invariant under a
positive scaling of either row, so the ops compute on scaled rows x_s = s x with a per-row power of two s
(`row_scales`: 1 for rows whose largest magnitude is below 2, which therefore compute bit for bit as unscaled
ones; 2^-floor(log2 max|x|) above, bringing the row's largest entry into [1, 2)). A power of two is exact in
every dtype, so nothing else changes: |x| = |x_s| / s, the norm clamp max(|x|, eps) becomes max(|x_s|, eps s)
(`scaled_eps`), and the gradient with respect to x is s times the gradient with respect to x_s, computed by the
same formulas on the scaled rows (s is piecewise constant in x, its derivative 0 wherever it is defined: the
chain rule through it is this multiplication). The scale costs one max-reduction over each row and a multiply,
folded into the compute-dtype copy that bfloat16/float16 inputs already make.

On CPU tensors the ops skip both when every row's squared norm is below SAFE_SQUARED_NORM (`unscaled_is_exact`:
asking costs no device sync there, and the squared norms are computed anyway): such rows cannot overflow, and
computing them unscaled gives bit for bit what the scaled computation gives (powers of two commute with every
product, sum, square root and reciprocal short of under- or overflow). Elsewhere, and inside torch.compile traces
(`may_skip_scaling`), the rows are always scaled, since asking would cost a host sync per chunk or a graph break.

The normalisation's own helpers (row_dots, scaled_eps, inverse_norms_from_norms, normalise_backward, unscaled) live
in angle_kernels/normalisation.py, below the backends: the Triton dense scheme uses them too.

16-bit operands ("mixed" code paths, docs/torch-similarity.md). On a GPU whose torch has matrix products of
bfloat16/float16 operands with float32 accumulation and output (`mixed_products`), a 16-bit call's products take
its 16-bit rows as they are, at the tensor cores' rate, where the default path converts them to float32 first.
The operands: `half_rows` (bfloat16 rows scaled by their powers of two, exact there; float16 rows as they are, since
their products cannot overflow float32) and `unit_rows` / `unit_slices` (rows divided by their norms, computed in
float32 and rounded to 16 bits, every entry at most 1). The products themselves (`product_into`, `products`,
`mixed_products`) are angle_kernels/products.py's, shared with the CUDA backend.
"""

from __future__ import annotations

import torch

from ..contract import compute_dtype
from ..normalisation import inverse_norms_from_norms, row_dots, row_scales, unscaled
from ..products import (  # noqa: F401  (the torch ops import them from here)
    MIXED_DTYPES,
    MixedProducts,
    _mixed_product_into,
    _mixed_products,
    mixed_products,
    product_into,
    products,
)

# Work is cut into pieces of about this many elements (a row block's tile of logits, a chunk of groups), so
# temporaries stay bounded whatever N is; the budget depends on the device the tensors live on (`chunk_elements`):
# * CPU: CHUNK_ELEMENTS, 1 << 22 (16 MB of float32): pieces that stay near the caches;
# * any other device (CUDA): ACCELERATOR_CHUNK_ELEMENTS, 1 << 25 (128 MB of float32, 256 MB of float64). There each
#   eager op is a kernel launch of ~5-10 us of host time whatever its size, and a block takes a few dozen of them
#   (with dims, more per prefix): with the CPU's budget, 32,768 columns make blocks of 128 rows, 21 with dims
#   (k = 5), and the dims path spent its time launching (781 blocks at N = 16,384 pairs), the full-width one on
#   matrix products with a 128-row side. 1 << 25 elements make a block's products and full-tile passes outlast
#   its launches, while the extra memory stays a few tiles (each op's module docstring says how many).
CHUNK_ELEMENTS = 1 << 22
ACCELERATOR_CHUNK_ELEMENTS = 1 << 25


def chunk_elements(device: torch.device | str) -> int:
    """The piece size, in elements, for tensors on `device`: CHUNK_ELEMENTS on the CPU, ACCELERATOR_CHUNK_ELEMENTS
    on any other device (read at call time, so tests may shrink either)."""
    return CHUNK_ELEMENTS if torch.device(device).type == "cpu" else ACCELERATOR_CHUNK_ELEMENTS


def rows_per_chunk(row_elements: int, device: torch.device | str) -> int:
    """How many rows of `row_elements` elements each make one piece on `device` (chunk_elements), at least 1."""
    return max(1, chunk_elements(device) // max(1, row_elements))


# Rows whose squared norms are below these (in the compute dtype) need no scaling: no product of two of them
# overflows, and the powers of their inverse norms the backward formulas use (up to the third) stay normal.
SAFE_SQUARED_NORM = {torch.float32: 2.0**80, torch.float64: 2.0**600}


def may_skip_scaling(x: torch.Tensor) -> bool:
    """Whether the ops may ask x's values if its rows need scaling: on CPU (no device sync), outside torch.compile
    traces (a data-dependent branch would break the graph). Elsewhere the rows are scaled without asking."""
    return x.device.type == "cpu" and not torch.compiler.is_compiling()


def unscaled_is_exact(squared_norms: torch.Tensor) -> bool:
    """Whether rows with these squared norms (compute dtype) compute exactly as their scaled versions without
    being scaled: every one below SAFE_SQUARED_NORM. Asked only where may_skip_scaling; False elsewhere."""
    if not may_skip_scaling(squared_norms):
        return False
    return bool((squared_norms < SAFE_SQUARED_NORM[squared_norms.dtype]).all())


def scaled_rows(x: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x_s = s x in the compute dtype, s) for the rows of x [..., D]; `scale`: s when already known (backward). A
    new tensor (the multiply folded into the compute-dtype copy of 16-bit inputs)."""
    if scale is None:
        scale = row_scales(x)
    if x.dtype == scale.dtype:
        return torch.mul(x, scale.unsqueeze(-1)), scale
    return x.to(scale.dtype).mul_(scale.unsqueeze(-1)), scale


def cosine_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(rows, scales, squared norms) for cosines of x's rows [M, D]: on CPU, when unscaled_is_exact, x in the
    compute dtype (a copy only for 16-bit inputs), None (no scaling: every later step takes its unscaled form, as
    before row scaling existed) and the squared norms the check computed (for inverse_norms, not computed twice);
    otherwise scaled_rows(x) and None."""
    if may_skip_scaling(x):
        xc = x.to(compute_dtype(x.dtype))
        squares = row_dots(xc, xc)
        if unscaled_is_exact(squares):
            return xc, None, squares
    return (*scaled_rows(x), None)


def inverse_norms_from_squares(squared_norms: torch.Tensor, scale: torch.Tensor | None = None
                               ) -> tuple[torch.Tensor, torch.Tensor]:
    """inverse_norms_from_norms from |x|^2."""
    return inverse_norms_from_norms(squared_norms.clamp_min(0).sqrt(), scale)


def row_squares(x: torch.Tensor) -> torch.Tensor:
    """|x_r|^2 of the rows of x [M, D] in its compute dtype: a batched GEMV (row_dots) for rows in the compute dtype;
    for 16-bit rows their norms taken in float32 (no float32 copy of the rows), squared."""
    if x.dtype == compute_dtype(x.dtype):
        return row_dots(x, x)
    return torch.linalg.vector_norm(x, dim=-1, dtype=compute_dtype(x.dtype)).square_()


def inverse_norms(x: torch.Tensor, scale: torch.Tensor | None = None, squares: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """inverse_norms_from_squares for the rows of a [M, D] tensor (scaled by `scale` when given), in its compute
    dtype; `squares`: their squared norms, when already computed (cosine_rows)."""
    return inverse_norms_from_squares(row_squares(x) if squares is None else squares, scale)


def prefix_slices(dims: tuple[int, ...]) -> list[tuple[int, int]]:
    """The column slices [d_{i-1}, d_i) between consecutive prefix widths (d_0 = 0)."""
    return list(zip((0,) + dims[:-1], dims))


def prefix_inverse_norms(x: torch.Tensor, dims: tuple[int, ...], scale: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """inverse_norms of every prefix x[:, :d] (d in dims) as [M, k] tensors, from running sums of the squared
    norms of the slices: x is read once for all prefixes. `scale` [M]: x holds scaled rows, one scale per row for
    every prefix."""
    squares = torch.stack([row_squares(x[:, lo:hi]) for lo, hi in prefix_slices(dims)], dim=1)
    return inverse_norms_from_squares(squares.cumsum(dim=1), None if scale is None else scale[:, None])


def logsumexp_in_place(x: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp(x, dim=-1) by the same steps, but exponentiating x in place (overwritten): no temporary the
    size of x (torch's makes one)."""
    maxes = torch.amax(x, dim=-1, keepdim=True)
    maxes.masked_fill_(maxes.abs() == float("inf"), 0.0)
    sums = x.sub_(maxes).exp_().sum(dim=-1)
    return sums.log_().add_(maxes.squeeze(-1))


def prefix_radial_backward(x, inv, has_norm_grad, radial, d_raw, slices):
    """d_raw (overwritten) minus every prefix's radial term [|x| > eps] inv_i^2 radial_i x[:, :d_i]: on slice j,
    the sum of the terms of the prefixes i >= j."""
    shrink = torch.where(has_norm_grad, inv * inv * radial, torch.zeros_like(inv))  # [R, k]
    shrink = shrink.flip(1).cumsum(dim=1).flip(1)
    for j, (lo, hi) in enumerate(slices):
        d_raw[:, lo:hi].addcmul_(x[:, lo:hi], shrink[:, j, None], value=-1.0)
    return d_raw


# ---------------------------------------------------------------------------------------------------------
# 16-bit operands with float32 accumulation (module docstring)
# ---------------------------------------------------------------------------------------------------------
def takes_mixed_products(x: torch.Tensor) -> bool:
    """Whether a call on rows x may take a "mixed" code path: 16-bit rows on a device with mixed products."""
    return x.dtype in MIXED_DTYPES and mixed_products(x.device).mm


def half_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(operand rows, their scales or None) of 16-bit rows x [M, D] for the mixed paths: bfloat16 rows scaled by
    their powers of two (row_scales: a new tensor, exact, bfloat16 having float32's exponent range), so that no
    float32 dot product or squared norm of them overflows; float16 rows as they are (scale None): every float16 is
    below 2^16, and their float32 dot products stay far from float32's range."""
    if x.dtype == torch.float16:
        return x, None
    scale = row_scales(x)
    return x * scale.to(x.dtype)[:, None], scale


def unit_rows(x: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """x * inv per row ([M]), computed in float32 and rounded to x's 16-bit dtype: unit rows, entries at most 1."""
    return torch.mul(x, inv[:, None], out=torch.empty_like(x))


def unit_slices(x: torch.Tensor, inv: torch.Tensor, slices: list[tuple[int, int]]) -> torch.Tensor:
    """unit_rows slice by slice: columns [lo_j, hi_j) of x times inv[:, j] ([M, k]), the inverse norm of the prefix
    that slice ends (so every entry is at most 1: a slice is part of its prefix), rounded to x's dtype."""
    out = torch.empty_like(x)
    for j, (lo, hi) in enumerate(slices):
        torch.mul(x[:, lo:hi], inv[:, j, None], out=out[:, lo:hi])
    return out


def normalise_backward_of_rows(x: torch.Tensor, inv_norm: torch.Tensor, has_norm_grad: torch.Tensor,
                               d_hat: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
    """normalisation.normalise_backward for rows x in any dtype (the mixed paths' 16-bit operands) and d_hat in the
    compute dtype (overwritten): the same formula, x's dot products with d_hat taken in the compute dtype a piece of
    rows at a time (no compute-dtype copy of x)."""
    step = rows_per_chunk(x.shape[1], x.device)
    dots = torch.cat([row_dots(x[r:r + step].to(d_hat.dtype), d_hat[r:r + step]) for r in range(0, x.shape[0], step)])
    radial = torch.where(has_norm_grad, inv_norm**3 * dots, torch.zeros_like(inv_norm))
    return unscaled(d_hat.mul_(inv_norm[:, None]).addcmul_(x, radial[:, None], value=-1.0), scale)
