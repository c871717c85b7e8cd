"""similarity_xent on the CUDA tile kernels of csrc/similarity_xent_dense.cu by the dense scheme: ops, fakes, autograd.

    cuda_similarity_xent_dense_stats(dots, row_inv, col_inv, groups, row0, scale, target, exclude_diagonal, margin)
        -> lse_all [b], lse_pos [b]
    cuda_similarity_xent_dense_grad(dots, row_inv, col_inv, groups, lse_all, lse_pos, coef, running, row_ratio,
                                    col_ratio, row0, scale, target, exclude_diagonal, margin, radial, keep_running,
                                    operand_dtype)
        -> grad [b, Mc] (operand_dtype), next running sum [b, Mc] (keep_running), row_radial [b], col_radial [Mc]

The ops are the tile steps of one block of b rows (csrc/similarity_xent_dense.cu says what they compute); this
module orchestrates them as the Triton backend's dense schemes do their kernels (triton_ops/similarity_xent_dense.py
at one width, triton_ops/_similarity_xent_dense_dims.py with dims). Two code paths:

"dense", one width: a block of whole rows is held at a time, so its logsumexps, and with them its gradients, are
known while it is: nothing is recomputed. Per block of rows R = [r0, r0 + b):

    P         = q_s[R] @ c_s^T              [b, Mc] raw dots, compute dtype      torch (cuBLAS), 2 b Mc D FLOPs
    lse[R]    = stats(P)                    one read of P                         CUDA
    G         = grad(P)                     one read of P, G written in the operand dtype
    dq_hat[R] += G @ c_unit                                                       torch, 2 b Mc D FLOPs
    dc_hat   += G^T @ q_unit[R]                                                   torch, 2 b Mc D FLOPs

Forward forms the gradients for grad_loss = 1 when autograd will ask for them and backward scales them
(angle_kernels.formed_gradients); the normalisation's backward is applied once at the end
(angle_kernels.normalisation.normalise_backward).

"dense_dims", dims = (d_1 < ... < d_k): one loss per prefix q[:, :d_i], c[:, :d_i], each with its own norms, a [k]
loss. A prefix's dots are the running sum of the slice products, P_i = P_i-1 + q[:, s_i] c[:, s_i]^T with
s_i = [d_i-1, d_i), so all k tiles of a block cost one width's products:

    forward   P = 0; for i = 1 .. k: P += q_s[R, s_i] c_s[:, s_i]^T; lse_i[R] = stats(P, prefix i's norms)
    backward  P_1 .. P_k as above, each kept
              for j = k .. 1 (widest first): R_j, radial sums = grad(P_j, R_j+1)   R_j = G_j + ratios R_j+1
                                             dq[R, s_j] += R_j c_unit[:, s_j];  dc[:, s_j] += R_j^T q_unit[R, s_j]

R_j is the sum over the prefixes i >= j (those slice s_j belongs to) of their gradient tiles, kept in prefix j's
frame (ratios q_inv_j+1 / q_inv_j, c_inv_j+1 / c_inv_j, at most 1); the unit slices take the inverse norm of the
prefix they end; the normalisation's backward is applied once at the end, slice by slice, from every prefix's
radial sums (the Triton dense dims scheme's). A [k] loss cannot form its gradients in forward (its upstream
gradient weights the prefixes), so backward forms the tiles again.

x_s = s x are the rows scaled by their powers of two (huge rows; s = 1 for float16, whose products cannot overflow
the fp32 accumulation) in the input dtype, exact. The products take 16-bit operands with fp32 results where the
torch build offers it (angle_kernels.products), fp32 as fp32 (torch's TF32 switch), fp64 in fp64; nothing is
M x Mc: a block holds at most TILE_ELEMENTS logits per tile. G carries w_i / max|w| (times grad_loss_j /
max|grad_loss| with dims), never 1 / M nor an inverse norm (fp16 would underflow or overflow): max|w| / M multiplies
the fp32 sums.

The floor. FLOPs: one width 6 M Mc D (the Triton dense scheme's; the fused kernels execute 10), all in cuBLAS
products; dims 8 M Mc D (forward 2, backward 2 + 4). Bytes beyond the products' operand reads, per logit (fp32
tiles, 16-bit operands): one width 18 (P written once and read twice, G written and read by two products), the
Triton dense scheme's: 1,365 FLOPs per byte at D = 4,096, 256 at D = 768 (an H100 balances about 265); dims about
12 forward and 34 backward per prefix (the tile copied and added to; the running sum read and written in fp32), so
the tile passes bound k = 5 as they do the Triton scheme.

Deterministic: no float atomics (the radial sums are reduced per tile in a fixed order by the binding); the
products are cuBLAS's.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from ..contract import compute_dtype
from ..formed_gradients import GradientsFormedInForward, gradients_wanted
from ..normalisation import inverse_norms_from_norms, normalise_backward, row_scales
from ..products import product_into
from ._dense_tiles import column_slices, grad_fake, grad_schema, operand_name, prefix_tiles, running_sums, unit_slices
from ._library import define, op

FEATURES = ("dims",)
PATHS = ("dense", "dense_dims")  # one width, every prefix of dims: each verified on GPUs on its own

# A block's tiles within TILE_ELEMENTS compute-dtype elements (1 GiB of fp32 logits), at most MAX_BLOCK_ROWS rows
# (dc_hat's read-modify-write per block against the block's products: b / 4 FLOPs per byte); below MIN_BLOCK_ROWS it
# would dominate them, so the selector does not send one-width calls here where fewer rows fit (`takes`).
TILE_ELEMENTS = 1 << 28
MAX_BLOCK_ROWS = 2048
MIN_BLOCK_ROWS = 512

_TILE_ARGS = "Tensor dots, Tensor row_inv, Tensor col_inv, Tensor? groups"
_OPTION_ARGS = "float scale, str target, bool exclude_diagonal, float margin"
STATS = define("cuda_similarity_xent_dense_stats", f"({_TILE_ARGS}, int row0, {_OPTION_ARGS}) -> (Tensor, Tensor)")
GRAD = define("cuda_similarity_xent_dense_grad",
              grad_schema(_TILE_ARGS, "Tensor lse_all, Tensor lse_pos", _OPTION_ARGS))


@torch.library.register_fake(STATS)
def _stats_fake(dots, row_inv, col_inv, groups, row0, scale, target, exclude_diagonal, margin):
    return dots.new_empty((dots.shape[0],)), dots.new_empty((dots.shape[0],))


@torch.library.register_fake(GRAD)
def _grad_fake(dots, row_inv, col_inv, groups, lse_all, lse_pos, coef, running, row_ratio, col_ratio, row0, scale,
               target, exclude_diagonal, margin, radial, keep_running, operand_dtype):
    return grad_fake(dots, keep_running, operand_dtype)


# The kernels as this module calls them (tests/ops/test_cuda_similarity_xent_dense_emulation.py puts CPU models of
# them here, under the same orchestration).
def _stats(*args):
    return op("cuda_similarity_xent_dense_stats")(*args)


def _grad(*args):
    return op("cuda_similarity_xent_dense_grad")(*args)


def block_rows(m: int, mc: int, tiles: float) -> int:
    """The rows of logits a block holds: `tiles` compute-dtype tiles of Mc columns within TILE_ELEMENTS, at most
    MAX_BLOCK_ROWS."""
    return max(1, min(m, MAX_BLOCK_ROWS, int(TILE_ELEMENTS // (max(mc, 1) * tiles))))


def takes(width: int, columns: int) -> bool:
    """Whether a block of at least MIN_BLOCK_ROWS rows of `columns` logits fits TILE_ELEMENTS at one width (the dot
    tile and its 16-bit gradient copy): where the selector may send a one-width call (the width from which it does is
    its own, similarity_xent_paths.DENSE_MIN_WIDTH)."""
    return TILE_ELEMENTS // (max(columns, 1) * 1.5) >= MIN_BLOCK_ROWS


# ----------------------------------------------------------------------------------------------------------
# The rows: scaled copies and their inverse norms, per prefix
# ----------------------------------------------------------------------------------------------------------
class _Rows(NamedTuple):
    """One side's rows as the scheme takes them, for k prefixes (k = 1: the full width)."""

    scaled: torch.Tensor  # x_s = s x in x's dtype (the products' operand)
    scale: torch.Tensor  # [R] s, compute dtype (one per row, for every prefix)
    inv: torch.Tensor  # [k, R] 1 / max(|x_s[:d]|, eps s)
    has_grad: torch.Tensor  # [k, R] whether the prefix's norm was not clamped (it has a gradient)


def _rows(x: torch.Tensor, dtype: torch.dtype, slices: list) -> _Rows:
    """x scaled by its rows' powers of two (1 for float16) and the inverse norms of every prefix ending a slice (the
    prefixes' squared norms: running sums of the slices')."""
    scale = torch.ones(x.shape[0], dtype=dtype, device=x.device) if x.dtype == torch.float16 else row_scales(x)
    scaled = x * scale.to(x.dtype)[:, None]
    squares = torch.stack([torch.linalg.vector_norm(scaled[:, lo:hi], dim=1, dtype=dtype).square()
                           for lo, hi in slices])
    inv, has_grad = inverse_norms_from_norms(squares.cumsum(dim=0).sqrt(), scale[None, :])
    return _Rows(scaled, scale, inv.contiguous(), has_grad)


def _accumulate(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """out += a @ b (out one view object: product_into adds in place only when `add` is `out` itself)."""
    product_into(out, a, b, add=out)


# ----------------------------------------------------------------------------------------------------------
# One width: the gradients formed in forward
# ----------------------------------------------------------------------------------------------------------
class DenseSimilarityXentFunction(GradientsFormedInForward):
    """The loss, and with with_grad its gradients for grad_loss = 1, in one walk over the row blocks (module
    docstring); backward (inherited) scales them."""

    @staticmethod
    def forward(ctx, q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids, with_grad):
        symmetric = c is None
        dtype = compute_dtype(q.dtype)
        q_in = q.detach()
        c_in = q_in if symmetric else c.detach()
        m, mc = q_in.shape[0], c_in.shape[0]
        slices = [(0, q_in.shape[1])]
        q_rows = _rows(q_in, dtype, slices)
        c_rows = q_rows if symmetric else _rows(c_in, dtype, slices)
        row_inv, col_inv = q_rows.inv[0], c_rows.inv[0]
        options = (float(scale), target, bool(exclude_diagonal), float(margin))
        weights = torch.ones(m, dtype=dtype, device=q.device) if row_weights is None else row_weights.to(dtype)
        weight_max = weights.abs().max().clamp_min(torch.finfo(dtype).tiny)
        coef = (weights / weight_max).contiguous()

        lse_all = torch.empty(m, dtype=dtype, device=q.device)
        lse_pos = torch.empty(m, dtype=dtype, device=q.device)
        block = block_rows(m, mc, 1.5)
        dots = torch.empty((block, mc), dtype=dtype, device=q.device)
        if with_grad:
            q_unit = unit_slices(q_rows, slices, dtype)
            c_unit = q_unit if symmetric else unit_slices(c_rows, slices, dtype)
            # dL/dq_hat and dL/dc_hat, without the factor weight_max / M; one buffer when c is q
            d_q = torch.zeros(q_in.shape, dtype=dtype, device=q.device)
            d_c = d_q if symmetric else torch.zeros(c_in.shape, dtype=dtype, device=q.device)
        for r0 in range(0, m, block):
            n = min(block, m - r0)
            rows = slice(r0, r0 + n)
            product_into(dots[:n], q_rows.scaled[rows], c_rows.scaled.T)
            lse_all[rows], lse_pos[rows] = _stats(dots[:n], row_inv, col_inv, group_ids, r0, *options)
            if not with_grad:
                continue
            grad, _, _, _ = _grad(dots[:n], row_inv, col_inv, group_ids, lse_all, lse_pos, coef, None, None, None,
                                  r0, *options, False, False, operand_name(q.dtype))
            _accumulate(d_q[rows], grad, c_unit)
            _accumulate(d_c, grad.T, q_unit[rows])
            del grad
        del dots
        loss = (weights * (lse_all - lse_pos)).sum() / m

        ctx.with_grad = with_grad
        ctx.input_dtypes = (q.dtype, None if symmetric else c.dtype)
        if with_grad:
            unscale = weight_max / m
            dq = normalise_backward(q_rows.scaled.to(dtype), row_inv, q_rows.has_grad[0], d_q.mul_(unscale),
                                    q_rows.scale)
            dc = None if symmetric else normalise_backward(c_rows.scaled.to(dtype), col_inv, c_rows.has_grad[0],
                                                           d_c.mul_(unscale), c_rows.scale)
            ctx.save_for_backward(dq, dc)
        return loss


def similarity_xent(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0, group_ids=None,
                    dims=None):
    """The dense scheme of similarity_xent at one width (module docstring)."""
    if dims is not None:
        raise ValueError("the cuda dense similarity_xent scheme takes no dims=; its dense_dims path computes them")
    return DenseSimilarityXentFunction.apply(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids,
                                             gradients_wanted(q, c))


# ----------------------------------------------------------------------------------------------------------
# dims: the prefixes' tiles as running sums of slice products
# ----------------------------------------------------------------------------------------------------------


def _prefix_norm_backward(rows: _Rows, radial: torch.Tensor, d_raw: torch.Tensor, slices: list,
                          unscale: torch.Tensor) -> torch.Tensor:
    """The gradient with respect to x from d_raw = sum_i R'_j in prefix j's frame (overwritten) and every prefix's
    radial sums [k, R]: slice j times inv_j, minus the radial terms inv_i^2 radial_i x_s of the prefixes i >= j whose
    norm is not clamped; all times `unscale`, then s."""
    shrink = torch.where(rows.has_grad, rows.inv * rows.inv * radial * unscale, torch.zeros_like(radial))
    shrink = shrink.flip(0).cumsum(dim=0).flip(0)
    d_raw[:, slices[-1][1]:] = 0.0  # past the widest prefix (if any): no gradient
    for j, (lo, hi) in enumerate(slices):
        d_raw[:, lo:hi].mul_((rows.inv[j] * unscale)[:, None])
        d_raw[:, lo:hi].addcmul_(rows.scaled[:, lo:hi].to(d_raw.dtype), shrink[j][:, None], value=-1.0)
    return d_raw.mul_(rows.scale[:, None])


class DenseDimsSimilarityXentFunction(torch.autograd.Function):
    """The [k] losses of the prefixes of dims (module docstring): forward the row statistics, backward forms the
    tiles again and the gradients."""

    @staticmethod
    def forward(ctx, q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids, dims):
        symmetric = c is None
        dtype = compute_dtype(q.dtype)
        q_in = q.detach()
        c_in = q_in if symmetric else c.detach()
        m, mc = q_in.shape[0], c_in.shape[0]
        slices = column_slices(dims)
        k = len(slices)
        q_rows = _rows(q_in, dtype, slices)
        c_rows = q_rows if symmetric else _rows(c_in, dtype, slices)
        options = (float(scale), target, bool(exclude_diagonal), float(margin))
        weights = torch.ones(m, dtype=dtype, device=q.device) if row_weights is None else row_weights.to(dtype)

        lse_all = torch.empty((k, m), dtype=dtype, device=q.device)
        lse_pos = torch.empty((k, m), dtype=dtype, device=q.device)
        block = block_rows(m, mc, 1)
        dots = torch.empty((block, mc), dtype=dtype, device=q.device)
        for r0 in range(0, m, block):
            n = min(block, m - r0)
            rows = slice(r0, r0 + n)
            tile = dots[:n]
            for i, (lo, hi) in enumerate(slices):
                product_into(tile, q_rows.scaled[rows, lo:hi], c_rows.scaled[:, lo:hi].T, add=tile if i > 0 else None)
                lse_all[i, rows], lse_pos[i, rows] = _stats(tile, q_rows.inv[i], c_rows.inv[i], group_ids, r0,
                                                            *options)
        del dots
        loss = (weights * (lse_all - lse_pos)).sum(dim=1) / m

        ctx.rows = (q_rows, None if symmetric else c_rows)
        ctx.save_for_backward(lse_all, lse_pos, weights, group_ids)
        ctx.options = options
        ctx.slices = slices
        ctx.input_dtypes = (q.dtype, None if symmetric else c.dtype)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        lse_all, lse_pos, weights, group_ids = ctx.saved_tensors
        q_rows, c_saved = ctx.rows
        symmetric = c_saved is None
        c_rows = q_rows if symmetric else c_saved
        options, slices = ctx.options, ctx.slices
        dtype = lse_all.dtype
        k, m, mc = len(slices), q_rows.scaled.shape[0], c_rows.scaled.shape[0]
        device = lse_all.device
        q_dtype, c_dtype = ctx.input_dtypes

        # The gradient tiles' per-row factors for each prefix, at most 1: w_i / max|w| times
        # grad_loss_j / max|grad_loss|; `unscale` multiplies the fp32 sums (module docstring).
        tiny = torch.finfo(dtype).tiny
        weight_max = weights.abs().max().clamp_min(tiny)
        grad_loss = grad_loss.to(dtype)
        grad_max = grad_loss.abs().max().clamp_min(tiny)
        coef = ((grad_loss / grad_max)[:, None] * (weights / weight_max)[None, :]).contiguous()  # [k, M]
        unscale = weight_max * grad_max / m

        q_ratio = (q_rows.inv[1:] / q_rows.inv[:-1]).contiguous()  # [k - 1, M]: from prefix j + 1's frame to j's
        c_ratio = (c_rows.inv[1:] / c_rows.inv[:-1]).contiguous()
        q_unit = unit_slices(q_rows, slices, dtype)
        c_unit = q_unit if symmetric else unit_slices(c_rows, slices, dtype)
        d_q = torch.zeros(q_rows.scaled.shape, dtype=dtype, device=device)  # slice j in prefix j's frame
        d_c = d_q if symmetric else torch.zeros(c_rows.scaled.shape, dtype=dtype, device=device)
        q_radial = torch.zeros((k, m), dtype=dtype, device=device)  # sum_c G_ic cos_ic per prefix
        c_radial = q_radial if symmetric else torch.zeros((k, mc), dtype=dtype, device=device)
        operand = operand_name(q_dtype)

        # backward's tiles: the k prefixes' P, two running sums and the 16-bit copy
        block = block_rows(m, mc, k + 2.5)
        dots = torch.empty((k, block, mc), dtype=dtype, device=device)
        for r0 in range(0, m, block):
            n = min(block, m - r0)
            rows = slice(r0, r0 + n)
            prefix_tiles(dots[:, :n], q_rows.scaled[rows], c_rows.scaled, slices)

            def grad_tile(j, *folded):  # prefix j's op, folding in R_j+1 (folded): R_j = G_j + ratios R_j+1
                return _grad(dots[j, :n], q_rows.inv[j], c_rows.inv[j], group_ids, lse_all[j], lse_pos[j], coef[j],
                             *folded, r0, *options, True, j > 0, operand)

            # the widest prefix first; products: R_j in the operand dtype
            for j, products, row_radial, col_radial in running_sums(k, grad_tile, q_ratio, c_ratio):
                q_radial[j, rows] += row_radial
                c_radial[j] += col_radial
                lo, hi = slices[j]
                _accumulate(d_q[rows, lo:hi], products, c_unit[:, lo:hi])
                _accumulate(d_c[:, lo:hi], products.T, q_unit[rows, lo:hi])
                del products
        dots = None  # the tiles go (grad_tile reads them: a cell, so not `del`)
        del q_unit, c_unit

        if symmetric:
            return (_prefix_norm_backward(q_rows, q_radial, d_q, slices, unscale).to(q_dtype),
                    None, None, None, None, None, None, None, None)
        dq = _prefix_norm_backward(q_rows, q_radial, d_q, slices, unscale).to(q_dtype)
        dc = _prefix_norm_backward(c_rows, c_radial, d_c, slices, unscale).to(c_dtype)
        return dq, dc, None, None, None, None, None, None, None


def similarity_xent_dims(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0, group_ids=None,
                         dims=None):
    """similarity_xent with dims by the dense scheme (module docstring): a [k] loss."""
    if dims is None:
        raise ValueError("the cuda dense dims scheme of similarity_xent takes dims=; without, its dense path")
    return DenseDimsSimilarityXentFunction.apply(q, c, scale, target, row_weights, exclude_diagonal, margin,
                                                 group_ids, tuple(dims))
