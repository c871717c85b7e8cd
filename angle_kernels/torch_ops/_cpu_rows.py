"""The rows' norms and the normalisation's backward for the torch backend's CPU softmax forms
(_similarity_xent_softmax.py, _similarity_lse_softmax.py), by reductions that are fast on a CPU.

common.cosine_rows / common.inverse_norms and normalisation.normalise_backward take each row's dot product (|x|^2 for
the norm, x . dx_hat for the backward's radial term) as a batched GEMV (torch.bmm of [M, 1, D] by [M, D, 1]), which
a CPU runs at about 1.3 GFLOP/s: at 256 rows of D = 384 one takes 77 us on one thread, where torch's vector norm
takes 12 us and an elementwise product summed 21 us. An MNRL call in the softmax form made four of them, a tenth of
its time at 256 pairs. The functions here compute the same quantities by those reductions instead:

    |x|        torch.linalg.vector_norm (the norm itself, not the root of a sum of squares taken first: at
               D = 4,096 within 2 float32 ulps of float64's where the GEMV's root drifts 16)
    x . dx_hat torch.linalg.vecdot, a piece of rows at a time (common.rows_per_chunk: its [b, D] product stays
               within one piece of memory whatever M is)

and otherwise follow the helpers they replace step for step: rows that need no scaling (every norm below
SAFE_NORM, the root of common.SAFE_SQUARED_NORM, asked only where common.may_skip_scaling allows) compute unscaled,
all others are scaled by their powers of two (common.scaled_rows) with the clamp max(|x_s|, eps s). Powers of two
commute with these reductions as with the GEMV, so an unscaled row still computes bit for bit as its scaled version.
The GEMV helpers stay as they are: the blocked forms and the Triton and CUDA dense schemes use them, and GPU runs
verified and timed that code (its fingerprint covers them).
"""

from __future__ import annotations

import itertools

import torch

from ..contract import compute_dtype
from ..normalisation import inverse_norms_from_norms, unscaled
from .common import SAFE_SQUARED_NORM, may_skip_scaling, rows_per_chunk, scaled_rows

# Rows whose norms are below these need no scaling (common.SAFE_SQUARED_NORM, as norms): 2^40 and 2^300.
SAFE_NORM = {dtype: bound**0.5 for dtype, bound in SAFE_SQUARED_NORM.items()}


def row_norms(x: torch.Tensor) -> torch.Tensor:
    """|x_r| of the rows of x [M, D] in its compute dtype (16-bit rows read as they are, accumulated in float32)."""
    return torch.linalg.vector_norm(x, dim=-1, dtype=compute_dtype(x.dtype))


def normalised_rows(*tensors: torch.Tensor) -> list[tuple]:
    """[(rows in the compute dtype, their scales or None, inverse norms 1 / max(|x|, eps), has-norm-gradient mask)]
    for the rows of each tensor [M_t, D] (one device and dtype): common.cosine_rows followed by common.inverse_norms
    (module docstring), the tensors taken together, so that a small call pays for one check and one set of inverse
    norms: unscaled when every norm of every tensor is below SAFE_NORM, otherwise each tensor scaled."""
    if may_skip_scaling(tensors[0]):
        dtype = compute_dtype(tensors[0].dtype)
        rows = [x if x.dtype == dtype else x.to(dtype) for x in tensors]
        norms = torch.cat([row_norms(x) for x in rows]) if len(rows) > 1 else row_norms(rows[0])
        if float(norms.max()) < SAFE_NORM[dtype]:  # torch's max is NaN for any NaN norm: those get scaled
            inverse, has_grad = inverse_norms_from_norms(norms)
            if len(rows) == 1:
                return [(rows[0], None, inverse, has_grad)]
            # each tensor's part by slicing: a small call pays for every op, and Tensor.split is a Python function
            bounds = [0, *itertools.accumulate(x.shape[0] for x in rows)]
            return [(x, None, inverse[lo:hi], has_grad[lo:hi]) for x, lo, hi in zip(rows, bounds, bounds[1:])]
    scaled = [scaled_rows(x) for x in tensors]
    return [(x, scale, *inverse_norms_from_norms(row_norms(x), scale)) for x, scale in scaled]


def row_vecdots(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """sum(a * b, dim=-1) [M] for [M, D] tensors of one dtype, a piece of rows at a time."""
    step = rows_per_chunk(a.shape[1], a.device)
    if a.shape[0] <= step:
        return torch.linalg.vecdot(a, b)
    return torch.cat([torch.linalg.vecdot(a[r:r + step], b[r:r + step]) for r in range(0, a.shape[0], step)])


def normalise_backward(x: torch.Tensor, inv_norm: torch.Tensor, has_norm_grad: torch.Tensor, d_hat: torch.Tensor,
                       scale: torch.Tensor | None = None) -> torch.Tensor:
    """normalisation.normalise_backward (its docstring: the gradient with respect to x of x_hat = x * inv_norm from
    d_hat, overwritten; with `scale`, of scaled rows), its dot products by row_vecdots."""
    radial = torch.where(has_norm_grad, inv_norm**3 * row_vecdots(x, d_hat), 0.0)
    return unscaled(d_hat.mul_(inv_norm[:, None]).addcmul_(x, radial[:, None], value=-1.0), scale)
