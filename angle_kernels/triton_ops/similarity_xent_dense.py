"""similarity_xent as a blocked scheme of dense matrix products: cuBLAS for the products, Triton for the tile math.

Computes the contract's similarity_xent without dims (angle_kernels.dispatch.similarity_xent), the loss of
similarity_xent.py's fused kernels by another schedule; `triton_ops.similarity_xent` takes it where `takes` says so
(wide embeddings). It holds a block of b whole rows of logits at a time: their logsumexps, and with them their
gradients, are known while the block is held, so nothing is recomputed:

    for each block of rows R = [r0, r0 + b):
        S        = q[R] @ c^T                     [b, Mc] raw dots, fp32      cuBLAS, 2 b Mc D FLOPs
        lse[R]   = _dense_xent_stats_kernel(S)    one read of S               Triton
        G        = _dense_xent_grad_kernel(S)     one read of S, G written    Triton
        dq_hat[R] = G @ c_hat                                                 cuBLAS, 2 b Mc D FLOPs
        dc_hat   += G^T @ q_hat[R]                                            cuBLAS, 2 b Mc D FLOPs

G is dL/dcos up to the factor max|w| / M, from the fused backward's own tile code (the tile library's
_grad_cos_tile), and x_hat = x / max(|x|, eps) are unit-row copies of the (power-of-two scaled) inputs in the input
dtype. Forward forms the gradients for grad_loss = 1 when autograd will ask for them and backward scales them
(angle_kernels.formed_gradients); the normalisation's backward is applied once at the end
(angle_kernels.normalisation.normalise_backward).

Precision. S: the 16-bit products accumulated in fp32 (cuBLAS, out_dtype=float32), scaled by the fp32 inverse norms
in the kernels. G is rounded to the input dtype for its products and carries w_i / max|w|, never 1/M nor the
inverse norms (fp16 would underflow or overflow); w_max / M multiplies the fp32 products. fp32 inputs follow torch's
TF32 switch (not ANGLE_KERNELS_ALLOW_TF32); fp64 stays fp64. Without mixed-dtype products (CPU, an older torch) the
16-bit operands are converted to fp32 first: the same values and accumulation, slower.

The floor. FLOPs: 6 M Mc D, all in dense products (the fused kernels execute 10). Bytes beyond the products' operand
reads: 18 per logit (S written once and read twice, G written and read by two products) against 6 D FLOPs: 1,365
FLOPs per byte at D = 4096, 256 at D = 768, where an H100 balances about 265; plus dc_hat's read-modify-write, b / 4
FLOPs per byte. Extra memory: the tile (b x Mc x 6 bytes, at most 1.5 GiB), the unit rows and the fp32 gradients:
O(M + Mc), never M x Mc. Why a second schedule, and the numbers in full: docs/triton-similarity.md.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .._runtime import triton_interpreting
from ..contract import MARGIN_SIN_SQUARED_FLOOR, NORM_EPS, compute_dtype
from ..formed_gradients import GradientsFormedInForward, gradients_wanted
from ..normalisation import inverse_norms_from_norms, normalise_backward
from ._common import CompileCase, new_output
from ._similarity_tiles import (
    _column_state,
    _empty_lse_states,
    _final_lse,
    _fold_dots_into_lse,
    _grad_cos_tile,
    _logits_tile,
    _loss_params,
    _row_norms,
    _row_state,
)

FEATURES = ()  # no dims: the nested-prefix loss stays with the fused kernels

# The tile: up to MAX_BLOCK_ROWS rows of logits at a time, within TILE_ELEMENTS (1.5 GiB of fp32 logits and a
# 16-bit gradient tile). 2048 rows keep dc_hat's read-modify-write per block small against the block's products
# (b / 4 FLOPs per byte, see the floor); below MIN_BLOCK_ROWS it would dominate them, so the scheme is not taken
# where fewer rows fit (Mc > 2^19 columns).
TILE_ELEMENTS = 1 << 28
MAX_BLOCK_ROWS = 2048
MIN_BLOCK_ROWS = 512

# From this embedding width up, the triton backend takes this scheme for the full-width loss (`takes`); below
# it, and always with dims, the fused kernels. Measured on an H100, bf16 (bench/results/h100-80gb-hbm3-2026-11-26/
# second): at D = 768 the dense scheme is 1.1x, 2.8x and 5x faster than the fused kernels for in-batch negatives
# at N = 1,024, 4,096 and 16,384 pairs, 1.4x and 3.7x for ArcCon at 4,096 and 16,384 (the fused kernels 1.5x
# faster at 1,024, where both are launch-bound: 1.8 vs 2.6 ms); at D = 4,096, 5x to 9x. Narrower widths are not
# measured yet, so the fused kernels keep them.
MIN_WIDTH = 768


def block_rows(m: int, mc: int) -> int:
    """The rows of logits held at a time for M x Mc logits."""
    return max(1, min(m, MAX_BLOCK_ROWS, TILE_ELEMENTS // max(mc, 1)))


def takes(width: int, columns: int, dims) -> bool:
    """Whether the triton backend computes similarity_xent by this scheme: the full-width loss, from MIN_WIDTH up,
    where a tile of at least MIN_BLOCK_ROWS rows of `columns` logits fits TILE_ELEMENTS."""
    return dims is None and width >= MIN_WIDTH and TILE_ELEMENTS // max(columns, 1) >= MIN_BLOCK_ROWS



# ----------------------------------------------------------------------------------------------------------
# Kernels: the tile math of one row block, on its dots S
# ----------------------------------------------------------------------------------------------------------

@triton.jit
def _local_row_state(q_norm_ptr, q_scale_ptr, group_ptr, local, row0, n_rows, M, EPS: tl.constexpr,
                     ACC: tl.constexpr, PARTNER_TARGET: tl.constexpr, HAS_GROUPS: tl.constexpr):
    """The row state (_similarity_tiles._row_state) of the block's local rows `local`: rows row0 + local."""
    rows = row0 + local
    row_ok, inv_q, _unit_q, targets, group_row, group_target = _row_state(
        q_norm_ptr, q_scale_ptr, group_ptr, rows, M, EPS, ACC, PARTNER_TARGET, HAS_GROUPS)
    return rows, row_ok & (local < n_rows), inv_q, targets, group_row, group_target


# Arguments that change from block to block or batch to batch: not specialised on their values (Triton would
# compile a variant for == 1 and for divisible by 16), so a new batch size compiles nothing. The row strides are
# left to specialise: divisible by 16 lets the loads vectorise.
_BLOCK_ARGS = ("row0", "n_rows", "M", "Mc")


@triton.jit(do_not_specialize=_BLOCK_ARGS)
def _dense_xent_stats_kernel(
    s_ptr,  # [n_rows, Mc] in: the block's dots of the scaled rows q_s,i . c_s,j, compute dtype, rows stride_s apart
    q_norm_ptr, c_norm_ptr, q_scale_ptr, c_scale_ptr,  # norms of the scaled rows, the rows' scales
    group_ptr,
    lse_all_ptr, lse_pos_ptr,  # [M] out: rows row0 .. row0 + n_rows - 1
    row0, n_rows, M, Mc, stride_s,
    params_ptr,  # [3] in the compute dtype: scale, cos(margin), sin(margin)
    PARTNER_TARGET: tl.constexpr, EXCLUDE_DIAGONAL: tl.constexpr, HAS_MARGIN: tl.constexpr,
    HAS_GROUPS: tl.constexpr, ACC: tl.constexpr, EPS: tl.constexpr, SIN_SQ_FLOOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    scale, cos_m, sin_m = _loss_params(params_ptr)
    local = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows, row_ok, inv_q, targets, group_row, group_target = _local_row_state(
        q_norm_ptr, q_scale_ptr, group_ptr, local, row0, n_rows, M, EPS, ACC, PARTNER_TARGET, HAS_GROUPS)

    max_all, sum_all, max_pos, sum_pos, target_logit = _empty_lse_states(BLOCK_M, ACC)
    for col_start in range(0, Mc, BLOCK_N):
        cols = (col_start + tl.arange(0, BLOCK_N)).to(tl.int64)
        col_ok = cols < Mc
        inv_c, _unit_c, group_col = _column_state(c_norm_ptr, c_scale_ptr, group_ptr, cols, col_ok, EPS, ACC,
                                                  HAS_GROUPS)
        dots = tl.load(s_ptr + local[:, None] * stride_s + cols[None, :], mask=row_ok[:, None] & col_ok[None, :],
                       other=0.0)
        max_all, sum_all, max_pos, sum_pos, target_logit = _fold_dots_into_lse(
            max_all, sum_all, max_pos, sum_pos, target_logit, dots, rows, cols, row_ok, col_ok, inv_q, inv_c,
            targets, group_row, group_target, group_col, scale, cos_m, sin_m, EXCLUDE_DIAGONAL, HAS_MARGIN,
            HAS_GROUPS, SIN_SQ_FLOOR)

    lse_all, lse_pos = _final_lse(max_all, sum_all, max_pos, sum_pos, target_logit, row_ok, HAS_GROUPS)
    tl.store(lse_all_ptr + rows, lse_all, mask=row_ok)
    tl.store(lse_pos_ptr + rows, lse_pos, mask=row_ok)


@triton.jit(do_not_specialize=_BLOCK_ARGS)
def _dense_xent_grad_kernel(
    s_ptr,  # [n_rows, Mc] in: the block's dots of the scaled rows, compute dtype, rows stride_s apart
    g_ptr,  # [n_rows, Mc] out: dL/dcos_ij times M / max|w|, in the products' operand dtype; may be s_ptr
    q_norm_ptr, c_norm_ptr, q_scale_ptr, c_scale_ptr, group_ptr, lse_all_ptr, lse_pos_ptr,
    coef_ptr,  # [M]: w_i / max|w|
    row0, n_rows, M, Mc, stride_s, stride_g,
    params_ptr,  # [3] in the compute dtype: scale, cos(margin), sin(margin)
    PARTNER_TARGET: tl.constexpr, EXCLUDE_DIAGONAL: tl.constexpr, HAS_MARGIN: tl.constexpr,
    HAS_GROUPS: tl.constexpr, ACC: tl.constexpr, EPS: tl.constexpr, SIN_SQ_FLOOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
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
    # In place over S when g_ptr is s_ptr: each element is loaded above, by this program, before it is stored.
    tl.store(g_ptr + local[:, None] * stride_g + cols[None, :], g.to(g_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------------------------------------
# Launch configuration (not tuned on a GPU yet)
# ----------------------------------------------------------------------------------------------------------

# The stats kernel walks whole rows: few rows per program, wide column tiles (b / 4 = 512 programs at b = 2048);
# the gradient kernel is one program per tile. Both are elementwise and bandwidth-bound.
_GPU_STATS_BLOCKS = dict(BLOCK_M=4, BLOCK_N=1024, num_warps=8)
_GPU_GRAD_BLOCKS = dict(BLOCK_M=16, BLOCK_N=256, num_warps=8)


def _blocks(n_rows: int, mc: int, gpu_blocks: dict) -> dict:
    """The launch blocks: the GPU's, or under the interpreter few programs covering the small test problems."""
    if not triton_interpreting():
        return gpu_blocks
    return dict(BLOCK_M=min(64, triton.next_power_of_2(n_rows)), BLOCK_N=min(128, triton.next_power_of_2(mc)),
                num_warps=4)


# ----------------------------------------------------------------------------------------------------------
# The products, autograd function and launcher
# ----------------------------------------------------------------------------------------------------------

class MixedProducts(NamedTuple):
    """What this torch offers on a device for products of 16-bit operands with fp32 results."""

    mm: bool  # torch.mm(a, b, out_dtype=torch.float32, out=...): CUDA only, recent torch
    addmm_into_fp32: bool  # torch.addmm(c, a, b, out_dtype=torch.float32, out=c) with an fp32 c: some releases
    # require c in the operands' dtype


_mixed_products: dict[torch.device, MixedProducts] = {}


def mixed_products(device: torch.device) -> MixedProducts:
    """MixedProducts on `device`, asked once per device by 1 x 1 products (a sync, once). Without them the scheme
    converts its 16-bit operands to fp32 (the same values and accumulation, at the fp32 rate), saying so once."""
    if device not in _mixed_products:
        found = MixedProducts(False, False)
        if device.type == "cuda" and hasattr(torch.ops.aten.mm, "dtype_out"):
            one = torch.ones(1, 1, dtype=torch.bfloat16, device=device)
            out = torch.ones(1, 1, device=device)
            try:
                mm = torch.mm(one, one, out_dtype=torch.float32, out=out).item() == 1.0
            except (RuntimeError, NotImplementedError):
                mm = False
            try:
                addmm = mm and torch.addmm(out, one, one, out_dtype=torch.float32, out=out).item() == 2.0
            except (RuntimeError, NotImplementedError):
                addmm = False
            found = MixedProducts(mm, addmm)
        if device.type == "cuda" and not found.mm:
            warnings.warn(f"angle_kernels: torch {torch.__version__} has no bf16/fp16 matrix products with fp32 "
                          f"results on {device}; the dense similarity_xent scheme converts its operands to fp32 "
                          "(exact, slower)", RuntimeWarning, stacklevel=2)
        _mixed_products[device] = found
    return _mixed_products[device]


def _product_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, accumulate: bool) -> None:
    """out (+)= a @ b in out's dtype: 16-bit operands accumulate in fp32 (cuBLAS's mixed-dtype products on CUDA;
    elsewhere the operands are converted first, the same values and accumulation)."""
    offered = mixed_products(out.device) if a.dtype != out.dtype else None
    if offered is not None and not offered.mm:
        a, b = a.to(out.dtype), b.to(out.dtype)
    if a.dtype == out.dtype:
        if accumulate:
            out.addmm_(a, b)
        else:
            torch.mm(a, b, out=out)
    elif not accumulate:
        torch.mm(a, b, out_dtype=out.dtype, out=out)
    elif offered.addmm_into_fp32:
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:  # a product in a temporary of out's shape, then a sum: one more pass over out
        out.add_(torch.mm(a, b, out_dtype=out.dtype))


def _unit_rows(x: torch.Tensor, inv_norm: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x / max(|x|, eps), computed in `dtype` and rounded to x's dtype (the products' operand); x may be the
    scaled rows, inv_norm theirs."""
    return (x.to(dtype) * inv_norm[:, None]).to(x.dtype)


def _scaled_copy(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x_s = s x in x's dtype (exact: powers of two; s is 1 for ordinary rows and for float16), the products'
    operand in place of x."""
    return x * scale.to(x.dtype)[:, None]


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
        q_norm, q_scale = _row_norms(q_in, dtype)
        c_norm, c_scale = (q_norm, q_scale) if symmetric else _row_norms(c_in, dtype)
        # The products take the scaled rows (huge rows: docs/triton-similarity.md), copies in the input dtype.
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
        weight_max = weights.abs().max().clamp_min(torch.finfo(dtype).tiny)
        coef = (weights / weight_max).contiguous()

        lse_all = new_output((m,), dtype, q.device)
        lse_pos = new_output((m,), dtype, q.device)
        block = block_rows(m, mc)
        dots = torch.empty((block, mc), dtype=dtype, device=q.device)
        if with_grad:
            q_inv, q_has_grad = inverse_norms_from_norms(q_norm, q_scale)
            c_inv, c_has_grad = (q_inv, q_has_grad) if symmetric else inverse_norms_from_norms(c_norm, c_scale)
            q_hat = _unit_rows(q_in, q_inv, dtype)
            c_hat = q_hat if symmetric else _unit_rows(c_in, c_inv, dtype)
            # the gradient tile in the products' operand dtype, over the dots when that is the compute dtype
            grad = dots if q.dtype == dtype else torch.empty((block, mc), dtype=q.dtype, device=q.device)
            # dL/dq_hat and dL/dc_hat, without the factor weight_max / M; one buffer when c is q
            d_qhat = torch.zeros((m, q_in.shape[1]), dtype=dtype, device=q.device)
            d_chat = d_qhat if symmetric else torch.zeros((mc, c_in.shape[1]), dtype=dtype, device=q.device)

        for r0 in range(0, m, block):
            n = min(block, m - r0)
            _product_into(dots[:n], q_in[r0:r0 + n], c_in.T, accumulate=False)
            layout = (r0, n, m, mc, dots.stride(0))
            blocks = _blocks(n, mc, _GPU_STATS_BLOCKS)
            _dense_xent_stats_kernel[(triton.cdiv(n, blocks["BLOCK_M"]),)](
                dots, q_norm, c_norm, q_scale, c_scale, groups, lse_all, lse_pos, *layout, params, **static, **blocks)
            if not with_grad:
                continue
            blocks = _blocks(n, mc, _GPU_GRAD_BLOCKS)
            _dense_xent_grad_kernel[(triton.cdiv(n, blocks["BLOCK_M"]), triton.cdiv(mc, blocks["BLOCK_N"]))](
                dots, grad, q_norm, c_norm, q_scale, c_scale, groups, lse_all, lse_pos, coef, *layout, grad.stride(0),
                params,
                **static, **blocks)
            _product_into(d_qhat[r0:r0 + n], grad[:n], c_hat, accumulate=True)
            _product_into(d_chat, grad[:n].T, q_hat[r0:r0 + n], accumulate=True)
        loss = (weights * (lse_all - lse_pos)).sum() / m

        ctx.with_grad = with_grad
        ctx.input_dtypes = (q.dtype, None if symmetric else c.dtype)
        if with_grad:
            del dots, grad, q_hat, c_hat
            unscale = weight_max / m
            dq = normalise_backward(q_in.to(dtype), q_inv, q_has_grad, d_qhat.mul_(unscale), q_scale)
            dc = None if symmetric else normalise_backward(c_in.to(dtype), c_inv, c_has_grad, d_chat.mul_(unscale),
                                                           c_scale)
            ctx.save_for_backward(dq, dc)
        return loss


def similarity_xent(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0, group_ids=None,
                    dims=None):
    """The dense-products scheme of similarity_xent (dims unsupported: FEATURES); see the module docstring."""
    if dims is not None:
        raise ValueError("the dense similarity_xent scheme has no dims=; the fused kernels compute it")
    return DenseSimilarityXentFunction.apply(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids,
                                             gradients_wanted(q, c))


# ----------------------------------------------------------------------------------------------------------
# The specialisations CI compiles for sm_90 without a GPU (triton_ops._compile_check)
# ----------------------------------------------------------------------------------------------------------
def compile_cases(full: bool) -> list[CompileCase]:
    """CI: bf16 inputs with groups (a bf16 gradient tile), fp32 with a margin (in place); full=True: every dtype,
    both variants."""
    variants = [("fp32", "bf16", True, False), ("fp32", "fp32", False, True)]
    if full:
        variants = [("fp64" if g == "fp64" else "fp32", g, groups, not groups)
                    for g in ("fp32", "bf16", "fp16", "fp64") for groups in (True, False)]
    cases = []
    for acc_name, grad_dtype, has_groups, has_margin in variants:
        constexprs = dict(PARTNER_TARGET=has_groups, EXCLUDE_DIAGONAL=has_groups, HAS_MARGIN=has_margin,
                          HAS_GROUPS=has_groups, ACC=tl.float64 if acc_name == "fp64" else tl.float32, EPS=NORM_EPS,
                          SIN_SQ_FLOOR=MARGIN_SIN_SQUARED_FLOOR)
        label = f"grad={grad_dtype} groups={has_groups} margin={has_margin}"
        pointers = {"group_ptr": "i64", "g_ptr": grad_dtype}
        for kernel, blocks in ((_dense_xent_stats_kernel, _GPU_STATS_BLOCKS), (_dense_xent_grad_kernel,
                                                                                _GPU_GRAD_BLOCKS)):
            tiles = {k: v for k, v in blocks.items() if k != "num_warps"}
            cases.append(CompileCase(kernel, label, acc_name, dict(constexprs, **tiles), blocks["num_warps"],
                                     pointers=pointers))
    return cases
