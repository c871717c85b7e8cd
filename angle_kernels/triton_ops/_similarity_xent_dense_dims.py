"""similarity_xent with nested prefixes (dims) as blocked dense products: torch products, Triton tile math.

Computes the contract's similarity_xent with dims = (d_1 < ... < d_k): one loss per prefix q[:, :d_i], c[:, :d_i],
each with its own norms, a [k] loss. The dense scheme of similarity_xent_dense.py, extended to the prefixes by the
identity the torch backend's dims path uses (torch_ops/similarity_xent.py): a prefix's dot products are the running
sum of the slice products, with s_i = [d_{i-1}, d_i),

    P_i = P_{i-1} + q[:, s_i] c[:, s_i]^T           (P_0 = 0)

so forming all k tiles of a row block costs one width's products. For each block of rows R = [r0, r0 + b):

    forward   P = 0; for i = 1 .. k:  P += q[R, s_i] c[:, s_i]^T         one [b, Mc] tile, 2 b Mc D FLOPs in all
                                      lse_i[R] = stats kernel (P, prefix i's norms)      Triton, one read of P
    backward  P_1 .. P_k as above, each kept                              k tiles, 2 b Mc D FLOPs in all
              for j = k .. 1 (widest first), one kernel (_dense_dims_grad_kernel) on P_j:
                  G_j   = dL/dcos of prefix j (prefix j's norms, lse_j), and its radial sums
                  R'_j  = G_j + (q_inv_j+1 / q_inv_j) (c_inv_j+1 / c_inv_j) R'_j+1      the running sum, in place
              then the slice products, torch:
                  dq[R, s_j] += R'_j c_unit[:, s_j];  dc[:, s_j] += R'_j^T q_unit[R, s_j]  2 x 2 b Mc |s_j| FLOPs

Slice s_j belongs to every prefix i >= j, so its gradient products take the sum of those prefixes' tiles, each with
its inverse norms: sum_{i >= j} q_inv_i G_i c_inv_i. That sum is kept in prefix j's frame, R'_j (the torch
backend's mixed path, MixedPrefixSimilarityXentFunction): G_i carries neither inverse norm, the ratios are at most
1 (a longer prefix has the larger norm), so R'_j rounded to the input dtype stays in range; the operands are the
slices divided by the norm of the prefix they end (c_unit[:, s_j] = c[:, s_j] c_inv_j, entries at most 1), and
slice j of the fp32 sums is multiplied by q_inv_j (c_inv_j) once at the end. Each prefix's radial (norm) term,
sum_c G_ic cos_ic per row and per column, comes from its tile and G_j (the torch dims path's radial sums) and is
applied once at the end, slice by slice, summed over the prefixes the slice belongs to.

The forward's tile kernel is the dense scheme's (similarity_xent_dense._dense_xent_stats_kernel, unchanged), launched
once per prefix on that prefix's tile with its norms; the backward's, `_dense_dims_grad_kernel`, is the dense
scheme's gradient tile code (the tile library's _logits_tile and _grad_cos_tile) with the radial sums and the running
sum in its epilogue, launched once per prefix; the products are the dense scheme's (_product_into: 16-bit operands,
fp32 accumulation and results). The norms of every prefix of the scaled rows come from the family's row-norm kernel
in one read (_similarity_tiles._row_norms with bounds).

Precision: as the dense scheme. The tiles are fp32 sums of 16-bit products (fp64 for fp64), scaled by the fp32
inverse norms in the kernels; G_j carries w_i / max|w| and grad_loss_j / max|grad_loss| (at most 1), never 1/M nor
an inverse norm (fp16 would underflow or overflow); max|w| max|grad_loss| / M multiplies the fp32 sums. Rows are
scaled by a power of two each (huge rows; 1 for fp16), one scale per row for all its prefixes.

The floor. FLOPs: forward 2 M Mc D; backward 2 M Mc D (the tiles again) + 4 M Mc D (the slice products): 8 M Mc D
in all, against one width's 6 M Mc D in the dense scheme (which forms the gradients in forward for grad_loss = 1; a
[k] loss cannot: its upstream gradient weights the prefixes, and forming each prefix's gradients apart would take k
times the products). Bytes beyond the products' operand reads, per logit and prefix (fp32 tiles): forward 12 (the
slice product's read-modify-write of the tile, the stats kernel's read); backward 34 (the tile formed again, a copy
of the previous prefix's and the product's read-modify-write, 16; the gradient kernel's reads of the tile and of the
running sum and its writes of the running sum and its 16-bit copy, 14; the slice products' reads of the copy, 4):
at k = 5 about 230 bytes per logit against 8 D FLOPs, 27 FLOPs per byte at D = 768 and 140 at D = 4,096, where an
H100 balances about 265: the tile passes, not the products, bound this scheme (docs/triton-similarity.md has the
estimate against one width and what would lower it).
Extra memory: one block's k + 1 compute-dtype tiles and a 16-bit one, b (k + 1.5) Mc elements with b chosen
(block_rows) to keep them within TILE_ELEMENTS (1 GiB of fp32 at most); the unit slices and the fp32 gradients:
O(M + Mc), never M x Mc.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ..contract import MARGIN_SIN_SQUARED_FLOOR, NORM_EPS, compute_dtype
from ..normalisation import inverse_norms_from_norms
from ._common import CompileCase, new_output
from ._similarity_tiles import _column_state, _grad_cos_tile, _logits_tile, _loss_params, _row_norms
from .similarity_xent_dense import (
    _BLOCK_ARGS,
    _GPU_GRAD_BLOCKS,
    _GPU_STATS_BLOCKS,
    _blocks,
    _dense_xent_stats_kernel,
    _local_row_state,
    _product_into,
    _scaled_copy,
)

FEATURES = ("dims",)

# The tiles of a row block, all k + 1 of them (and a 16-bit copy of one) within TILE_ELEMENTS compute-dtype
# elements; MAX_BLOCK_ROWS and MIN_BLOCK_ROWS as in the dense scheme (dc's read-modify-write per block against the
# block's products), so the scheme is not taken where fewer rows fit.
TILE_ELEMENTS = 1 << 28
MAX_BLOCK_ROWS = 2048
MIN_BLOCK_ROWS = 512


def _tiles_per_row(k: int) -> float:
    """The compute-dtype tiles one block holds at once, in tile-sized units: the k prefixes' in backward, the
    running sum and its 16-bit copy (half a tile)."""
    return k + 1.5


def block_rows(m: int, mc: int, k: int) -> int:
    """The rows of logits held at a time for M x Mc logits and k prefixes."""
    return max(1, min(m, MAX_BLOCK_ROWS, int(TILE_ELEMENTS // (max(mc, 1) * _tiles_per_row(k)))))


def takes(width: int, columns: int, dims) -> bool:
    """Whether this scheme can compute a dims call of these sizes: a block of at least MIN_BLOCK_ROWS rows of every
    tile fits TILE_ELEMENTS (the width from which the backend sends it dims calls is its selector's,
    similarity_xent_paths.DENSE_DIMS_MIN_WIDTH)."""
    return dims is not None and TILE_ELEMENTS // (max(columns, 1) * _tiles_per_row(len(dims))) >= MIN_BLOCK_ROWS


# ----------------------------------------------------------------------------------------------------------
# Kernel: one prefix's step of the backward, on its tile of a row block
# ----------------------------------------------------------------------------------------------------------

@triton.jit
def _radial_and_running_sum(g, g_cos, running_ptr, operand_ptr, q_ratio_ptr, c_ratio_ptr, row_radial_ptr,
                            col_radial_ptr, local, rows, row_ok, cols, col_ok, ok, n_rows, Mc, stride_r,
                            FIRST: tl.constexpr, HAS_OPERAND: tl.constexpr):
    """The epilogue of a dims gradient tile (this module's kernel and the dense similarity_lse's): the tile's radial
    partial sums (g_cos: G_j times the scores, per row and per column), then the running sum R'_j = G_j + (q_inv_j+1
    / q_inv_j) (c_inv_j+1 / c_inv_j) R'_j+1 stored over R'_j+1, and its copy in the products' operand dtype."""
    tl.store(row_radial_ptr + tl.program_id(1).to(tl.int64) * n_rows + local, tl.sum(g_cos, axis=1),
             mask=local < n_rows)
    tl.store(col_radial_ptr + tl.program_id(0).to(tl.int64) * Mc + cols, tl.sum(g_cos, axis=0), mask=col_ok)

    at = local[:, None] * stride_r + cols[None, :]
    if not FIRST:
        q_ratio = tl.load(q_ratio_ptr + rows, mask=row_ok, other=0.0)
        c_ratio = tl.load(c_ratio_ptr + cols, mask=col_ok, other=0.0)
        previous = tl.load(running_ptr + at, mask=ok, other=0.0)
        g = g + previous * q_ratio[:, None] * c_ratio[None, :]
    tl.store(running_ptr + at, g, mask=ok)
    if HAS_OPERAND:
        tl.store(operand_ptr + at, g.to(operand_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=_BLOCK_ARGS)
def _dense_dims_grad_kernel(
    s_ptr,  # [n_rows, Mc] in: prefix j's dots of the block's scaled rows, compute dtype, rows stride_s apart
    running_ptr,  # [n_rows, Mc] compute dtype: in R'_j+1 (unless FIRST), out R'_j; rows stride_r apart
    operand_ptr,  # [n_rows, Mc] out (HAS_OPERAND): R'_j rounded to the products' operand dtype, rows stride_r apart
    q_norm_ptr, c_norm_ptr, q_scale_ptr, c_scale_ptr,  # prefix j's norms of the scaled rows, the rows' scales
    group_ptr, lse_all_ptr, lse_pos_ptr,  # [M] prefix j's logsumexps
    coef_ptr,  # [M]: w_i / max|w| times grad_loss_j / max|grad_loss|
    q_ratio_ptr, c_ratio_ptr,  # [M], [Mc]: q_inv_j+1 / q_inv_j, c_inv_j+1 / c_inv_j (read unless FIRST)
    row_radial_ptr,  # [column tiles, n_rows] out: each column tile's sum_c G_ic cos_ic of the block's rows
    col_radial_ptr,  # [row tiles, Mc] out: each row tile's sum_i G_ic cos_ic
    row0, n_rows, M, Mc, stride_s, stride_r,
    params_ptr,  # [3] in the compute dtype: scale, cos(margin), sin(margin)
    PARTNER_TARGET: tl.constexpr, EXCLUDE_DIAGONAL: tl.constexpr, HAS_MARGIN: tl.constexpr,
    HAS_GROUPS: tl.constexpr, ACC: tl.constexpr, EPS: tl.constexpr, SIN_SQ_FLOOR: tl.constexpr,
    FIRST: tl.constexpr, HAS_OPERAND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """G_j, prefix j's dL/dcos tile (the dense scheme's gradient tile: _grad_cos_tile, no inverse norm in it), its
    radial sums, and the running sum R'_j = G_j + (q_inv_j+1 / q_inv_j) (c_inv_j+1 / c_inv_j) R'_j+1 in place of
    R'_j+1, with its rounded copy for the slice products: one read of the tile and of the running sum."""
    scale, cos_m, sin_m = _loss_params(params_ptr)
    local = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows, row_ok, inv_q, targets, group_row, group_target = _local_row_state(
        q_norm_ptr, q_scale_ptr, group_ptr, local, row0, n_rows, M, EPS, ACC, PARTNER_TARGET, HAS_GROUPS)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < Mc
    inv_c, _unit_c, group_col = _column_state(c_norm_ptr, c_scale_ptr, group_ptr, cols, col_ok, EPS, ACC, HAS_GROUPS)
    lse_all = tl.load(lse_all_ptr + rows, mask=row_ok, other=0.0)
    lse_pos = tl.load(lse_pos_ptr + rows, mask=row_ok, other=0.0)
    coef = tl.load(coef_ptr + rows, mask=row_ok, other=0.0)

    ok = row_ok[:, None] & col_ok[None, :]
    dots = tl.load(s_ptr + local[:, None] * stride_s + cols[None, :], mask=ok, other=0.0)
    cos, logits, is_target, valid, positive, slope = _logits_tile(
        dots, rows, cols, row_ok, col_ok, inv_q, inv_c, targets, group_row, group_target, group_col,
        scale, cos_m, sin_m, EXCLUDE_DIAGONAL, HAS_MARGIN, HAS_GROUPS, SIN_SQ_FLOOR)
    g = _grad_cos_tile(logits, is_target, valid, positive, slope, lse_all, lse_pos, coef, scale,
                       HAS_MARGIN, HAS_GROUPS)
    g_cos = g * tl.where(ok, cos, 0.0)  # g is 0 outside the valid entries; cos is finite everywhere
    _radial_and_running_sum(g, g_cos, running_ptr, operand_ptr, q_ratio_ptr, c_ratio_ptr, row_radial_ptr,
                            col_radial_ptr, local, rows, row_ok, cols, col_ok, ok, n_rows, Mc, stride_r, FIRST,
                            HAS_OPERAND)


def _unit_slices(x: torch.Tensor, inv: torch.Tensor, dims: tuple, dtype: torch.dtype) -> torch.Tensor:
    """x's slices s_j, each times inv[j] ([k, R]: the inverse norm of the prefix it ends), computed in `dtype` and
    rounded to x's dtype: every entry at most 1 in magnitude (a slice is part of its prefix)."""
    out = torch.empty_like(x)
    for j, (lo, hi) in enumerate(zip((0,) + dims[:-1], dims)):
        out[:, lo:hi] = x[:, lo:hi].to(dtype) * inv[j][:, None]
    return out


def _prefix_tiles(out: torch.Tensor, q_rows: torch.Tensor, c_rows: torch.Tensor, dims: tuple) -> None:
    """out[i] = q_rows[:, :d_i] @ c_rows[:, :d_i]^T for every prefix i (out [k, b, Mc], compute dtype): each tile the
    previous one plus its slice's product."""
    for i, (lo, hi) in enumerate(zip((0,) + dims[:-1], dims)):
        if i > 0:
            out[i].copy_(out[i - 1])
        _product_into(out[i], q_rows[:, lo:hi], c_rows[:, lo:hi].T, accumulate=i > 0)


def _prefix_norm_backward(x: torch.Tensor, inv: torch.Tensor, has_norm_grad: torch.Tensor, radial: torch.Tensor,
                          d_raw: torch.Tensor, dims: tuple, scale: torch.Tensor) -> torch.Tensor:
    """The gradient with respect to x (scaled rows x_s = s x, any dtype) from d_raw = sum_i inv_i sum_c G_i c[:, :d_i]
    (overwritten) and every prefix's radial sums radial [k, R]: on slice j, minus the radial terms
    [|x_s[:d_i]| > eps s] inv_i^2 radial_i x_s of the prefixes i >= j; then times s."""
    shrink = torch.where(has_norm_grad, inv * inv * radial, torch.zeros_like(inv))  # [k, R]
    shrink = shrink.flip(0).cumsum(dim=0).flip(0)
    for j, (lo, hi) in enumerate(zip((0,) + dims[:-1], dims)):
        d_raw[:, lo:hi].addcmul_(x[:, lo:hi].to(d_raw.dtype), shrink[j][:, None], value=-1.0)
    return d_raw.mul_(scale[:, None])


class DenseDimsSimilarityXentFunction(torch.autograd.Function):
    """The [k] losses of the prefixes of dims (module docstring): forward takes the logsumexps, backward forms the
    tiles again and the gradients."""

    @staticmethod
    def forward(ctx, q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids, dims):
        symmetric = c is None
        dtype = compute_dtype(q.dtype)
        q_in = q.detach()
        c_in = q_in if symmetric else c.detach()
        m, mc, k = q_in.shape[0], c_in.shape[0], len(dims)
        bounds = torch.tensor((0,) + tuple(dims), dtype=torch.int32).to(q.device)
        q_norm, q_scale = _row_norms(q_in, dtype, bounds)  # [k, M] norms of every prefix of the scaled rows
        c_norm, c_scale = (q_norm, q_scale) if symmetric else _row_norms(c_in, dtype, bounds)
        q_in = _scaled_copy(q_in, q_scale)
        c_in = q_in if symmetric else _scaled_copy(c_in, c_scale)
        groups = group_ids.contiguous() if group_ids is not None else q_norm  # placeholder pointer if unused
        static = dict(
            PARTNER_TARGET=target == "partner", EXCLUDE_DIAGONAL=bool(exclude_diagonal),
            HAS_MARGIN=margin != 0.0, HAS_GROUPS=group_ids is not None,
            ACC=tl.float64 if dtype == torch.float64 else tl.float32,
            EPS=NORM_EPS, SIN_SQ_FLOOR=MARGIN_SIN_SQUARED_FLOOR,
        )
        params = torch.tensor([float(scale), math.cos(margin), math.sin(margin)], dtype=dtype).to(q.device)
        weights = torch.ones(m, dtype=dtype, device=q.device) if row_weights is None else row_weights.to(dtype)

        lse_all = new_output((k, m), dtype, q.device)
        lse_pos = new_output((k, m), dtype, q.device)
        block = block_rows(m, mc, k)
        dots = torch.empty((block, mc), dtype=dtype, device=q.device)
        for r0 in range(0, m, block):
            n = min(block, m - r0)
            blocks = _blocks(n, mc, _GPU_STATS_BLOCKS)
            for i, (lo, hi) in enumerate(zip((0,) + tuple(dims[:-1]), dims)):
                _product_into(dots[:n], q_in[r0:r0 + n, lo:hi], c_in[:, lo:hi].T, accumulate=i > 0)
                _dense_xent_stats_kernel[(triton.cdiv(n, blocks["BLOCK_M"]),)](
                    dots, q_norm[i], c_norm[i], q_scale, c_scale, groups, lse_all[i], lse_pos[i],
                    r0, n, m, mc, dots.stride(0), params, **static, **blocks)
        del dots
        loss = (weights * (lse_all - lse_pos)).sum(dim=1) / m

        ctx.save_for_backward(q_in, None if symmetric else c_in, q_norm, c_norm, q_scale, c_scale, groups, lse_all,
                              lse_pos, weights, params)
        ctx.symmetric = symmetric
        ctx.static = static
        ctx.dims = tuple(dims)
        ctx.input_dtypes = (q.dtype, None if symmetric else c.dtype)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        (q_in, c_saved, q_norm, c_norm, q_scale, c_scale, groups, lse_all, lse_pos, weights,
         params) = ctx.saved_tensors
        symmetric, dims, static = ctx.symmetric, ctx.dims, ctx.static
        c_in = q_in if symmetric else c_saved
        dtype = lse_all.dtype
        m, mc, k = q_in.shape[0], c_in.shape[0], len(dims)
        device = q_in.device

        # The gradient tiles' per-row factors for each prefix, at most 1: w_i / max|w| times
        # grad_loss_j / max|grad_loss|; `unscale` multiplies the fp32 sums (module docstring).
        tiny = torch.finfo(dtype).tiny
        weight_max = weights.abs().max().clamp_min(tiny)
        grad_loss = grad_loss.to(dtype)
        grad_max = grad_loss.abs().max().clamp_min(tiny)
        coef = ((grad_loss / grad_max)[:, None] * (weights / weight_max)[None, :]).contiguous()  # [k, M]
        unscale = weight_max * grad_max / m

        q_inv, q_has_grad = inverse_norms_from_norms(q_norm, q_scale[None, :])  # [k, M]
        c_inv, c_has_grad = (q_inv, q_has_grad) if symmetric else inverse_norms_from_norms(c_norm, c_scale[None, :])
        q_ratio = q_inv[1:] / q_inv[:-1]  # [k - 1, M]: from prefix j + 1's frame to prefix j's, at most 1
        c_ratio = c_inv[1:] / c_inv[:-1]
        q_unit = _unit_slices(q_in, q_inv, dims, dtype)
        c_unit = q_unit if symmetric else _unit_slices(c_in, c_inv, dims, dtype)

        d_q = torch.zeros(q_in.shape, dtype=dtype, device=device)  # slice j in prefix j's frame until the end
        d_c = d_q if symmetric else torch.zeros(c_in.shape, dtype=dtype, device=device)
        q_radial = torch.zeros((k, m), dtype=dtype, device=device)  # sum_c G_ic cos_ic per prefix
        c_radial = q_radial if symmetric else torch.zeros((k, mc), dtype=dtype, device=device)

        slices = list(zip((0,) + dims[:-1], dims))
        block = block_rows(m, mc, k)
        dots = torch.empty((k, block, mc), dtype=dtype, device=device)
        running = torch.empty((block, mc), dtype=dtype, device=device)
        # the running sum rounded to the products' operand dtype (itself for fp32 and fp64)
        operand = running if q_in.dtype == dtype else torch.empty((block, mc), dtype=q_in.dtype, device=device)
        for r0 in range(0, m, block):
            n = min(block, m - r0)
            rows = slice(r0, r0 + n)
            _prefix_tiles(dots[:, :n], q_in[rows], c_in, dims)
            blocks = _blocks(n, mc, _GPU_GRAD_BLOCKS)
            grid = (triton.cdiv(n, blocks["BLOCK_M"]), triton.cdiv(mc, blocks["BLOCK_N"]))
            row_radial = torch.empty((grid[1], n), dtype=dtype, device=device)
            col_radial = torch.empty((grid[0], mc), dtype=dtype, device=device)
            for j in reversed(range(k)):
                first = j == k - 1
                ratios = (q_inv[0], c_inv[0]) if first else (q_ratio[j], c_ratio[j])  # placeholders when first
                _dense_dims_grad_kernel[grid](
                    dots[j], running, operand, q_norm[j], c_norm[j], q_scale, c_scale, groups, lse_all[j], lse_pos[j],
                    coef[j], *ratios, row_radial, col_radial, r0, n, m, mc, dots.stride(1), running.stride(0), params,
                    **static, FIRST=first, HAS_OPERAND=operand is not running, **blocks)
                q_radial[j, rows] += row_radial.sum(dim=0)
                c_radial[j] += col_radial.sum(dim=0)
                lo, hi = slices[j]
                _product_into(d_q[rows, lo:hi], operand[:n], c_unit[:, lo:hi], accumulate=True)
                _product_into(d_c[:, lo:hi], operand[:n].T, q_unit[rows, lo:hi], accumulate=True)
        del dots, running, operand, q_unit, c_unit

        for j, (lo, hi) in enumerate(slices):  # each slice out of its prefix's frame
            d_q[:, lo:hi].mul_(q_inv[j][:, None] * unscale)
            if not symmetric:
                d_c[:, lo:hi].mul_(c_inv[j][:, None] * unscale)
        q_radial.mul_(unscale)
        if not symmetric:
            c_radial.mul_(unscale)
        q_dtype, c_dtype = ctx.input_dtypes
        dq = _prefix_norm_backward(q_in, q_inv, q_has_grad, q_radial, d_q, dims, q_scale).to(q_dtype)
        dc = None if symmetric else _prefix_norm_backward(c_in, c_inv, c_has_grad, c_radial, d_c, dims,
                                                          c_scale).to(c_dtype)
        return dq, dc, None, None, None, None, None, None, None


def similarity_xent(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0, group_ids=None,
                    dims=None):
    """similarity_xent with dims by the blocked dense products (module docstring): a [k] loss."""
    if dims is None:
        raise ValueError("the dense dims scheme of similarity_xent takes dims=; without, the dense scheme computes it")
    return DenseDimsSimilarityXentFunction.apply(q, c, scale, target, row_weights, exclude_diagonal, margin,
                                                 group_ids, tuple(dims))


# ----------------------------------------------------------------------------------------------------------
# The specialisations CI compiles for sm_90 without a GPU (triton_ops._compile_check)
# ----------------------------------------------------------------------------------------------------------
def compile_cases(full: bool) -> list[CompileCase]:
    """CI: bf16 inputs with groups (a bf16 copy of the running sum, not the first prefix), fp32 with a margin (the
    first prefix, no copy); full=True: every dtype, both variants. (The forward's stats kernel is the dense
    scheme's, compiled with its cases.)"""
    variants = [("fp32", "bf16", True, False), ("fp32", "fp32", False, True)]
    if full:
        variants = [("fp64" if x == "fp64" else "fp32", x, groups, not groups)
                    for x in ("fp32", "bf16", "fp16", "fp64") for groups in (True, False)]
    cases = []
    for acc_name, x_dtype, has_groups, has_margin in variants:
        half = x_dtype in ("bf16", "fp16")
        constexprs = dict(PARTNER_TARGET=has_groups, EXCLUDE_DIAGONAL=has_groups, HAS_MARGIN=has_margin,
                          HAS_GROUPS=has_groups, ACC=tl.float64 if acc_name == "fp64" else tl.float32, EPS=NORM_EPS,
                          SIN_SQ_FLOOR=MARGIN_SIN_SQUARED_FLOOR, FIRST=not half, HAS_OPERAND=half,
                          **{k: v for k, v in _GPU_GRAD_BLOCKS.items() if k != "num_warps"})
        label = f"x={x_dtype} groups={has_groups} margin={has_margin}"
        cases.append(CompileCase(_dense_dims_grad_kernel, label, acc_name, constexprs, _GPU_GRAD_BLOCKS["num_warps"],
                                 pointers={"group_ptr": "i64", "operand_ptr": x_dtype}))
    return cases
