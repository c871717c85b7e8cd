"""Softmax cross-entropy over cosine similarities, flash-style: never the M x Mc matrix.

Computes the contract's similarity_xent (angle_kernels.dispatch.similarity_xent) with fused kernels; for wide
embeddings the launcher (`similarity_xent`, `code_path`) hands the full-width loss to the dense scheme of
similarity_xent_dense.py (cuBLAS products). The tile and online-logsumexp helpers, the finish and row-norm kernels
and the launch configuration are the family's tile library, _similarity_tiles.py. Design, registers and
precision in full: docs/triton-similarity.md.

    l_ij  = scale * cos(q_i, c_j)          (target column: scale * cos(min(theta + margin, pi)))
    loss  = (1/M) sum_i w_i * (logsumexp_{j in C_i} l_ij - logsumexp_{j in P_i} l_ij)

Forward (`_similarity_xent_fwd_kernel`): one program per BLOCK_M rows walks all BLOCK_N column blocks; each tile is
a K-loop of tl.dot over D, scaled by the inverse norms into cosines and folded into an online logsumexp per row
(plus one over the positives with group_ids). It stores two numbers per row.

Backward recomputes each tile and forms G_ij = dL/dcos_ij. With c_hat = c / |c|:

    dq_i = inv_q_i * sum_j G_ij inv_c_j c_j  -  [|q_i| > eps] inv_q_i^2 (sum_j G_ij cos_ij) q_i

and the mirror image for dc. Two kernels, no atomics: `_similarity_xent_bwd_dq_kernel` owns a row block and walks
the columns, `_similarity_xent_bwd_dc_kernel` owns a column block and walks the rows, each adding its tiles'
products into its own rows of a fp32 [*, D] buffer; `_similarity_xent_bwd_finish_kernel` applies the
normalisation's backward once per row (and adds the two halves of the symmetric case).

Nested prefixes (dims, the `_prefix_` kernels): the K-loop runs slice by slice, s_i = [d_{i-1}, d_i), into one dot
tile, which at the end of slice i feeds prefix i's online logsumexps ([BLOCK_M, KP] row states): one read of the
embeddings for all prefixes. Huge rows: the tiles are dot products of rows scaled by a power of two each
(`_row_norms_kernel` finds the scales; `_add_dots` applies them only when one differs from 1).

The floor. FLOPs: forward 2 M Mc D; backward 2 x (2 M Mc D recompute + 2 M Mc D gradient) = 8 M Mc D (the two
recomputations are the price of O(M) memory); with dims the gradient products run over every prefix's width,
2 M Mc sum_i d_i per backward kernel. Bytes: the inputs re-read once per row/column block pass (mostly from L2),
plus the gradient buffers' read-modify-write, BLOCK_N / 2 = 32 FLOPs per byte at BLOCK_N = 64: likely the
backward's bound. Registers (sm_90, bf16, first config; `python -m angle_kernels.triton_ops._compile_check`):
forward 181, dq 194, dc 248, no spills; prefix kernels 255 (an 8-byte spill), 236, 242.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ..contract import MARGIN_SIN_SQUARED_FLOOR, NORM_EPS, compute_dtype
from . import similarity_xent_dense
from ._common import CompileCase, Tuning, new_output, scaled_eps
from ._similarity_tiles import (
    _GPU_CONFIGS_16BIT,
    _GPU_CONFIGS_32BIT,
    _GPU_NORM_BLOCKS,
    _accumulate_grad_columns,
    _accumulate_grad_tile,
    _add_dots,
    _autotune_bucket,
    _column_state,
    _dot_precision,
    _dot_tile,
    _empty_lse_states,
    _final_lse,
    _fold_dots_into_lse,
    _grad_cos_tile,
    _interpreter_blocks,
    _inverse_norms,
    _logits_tile,
    _loss_params,
    _online_lse_update,
    _operand_dtype,
    _row_norms,
    _row_norms_kernel,
    _row_state,
    _similarity_xent_bwd_finish_kernel,
    _tile_launch,
    any_scaled,
    autotuned,
    gradient_tile_scale,
    kernels_for,
)

FEATURES = ("dims",)  # the contract's optional features this op implements (contract.OPTIONAL_FEATURES)
# The code paths a call can take, each verified on GPUs on its own (angle_kernels.verified): the fused kernels of
# this file at full width, the dense scheme (similarity_xent_dense), the fused prefix kernels (dims).
PATHS = ("fused", "dense", "dims")


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------

# The tile kernels' arguments that change with the batch size. Triton specialises integer arguments on their
# value (== 1, divisible by 16) and compiles a variant per case; these only bound loops and masks, so
# specialising them buys nothing, and not doing so keeps a new batch size from compiling anything.
_BATCH_SIZE_ARGS = ("M", "Mc", "M_BUCKET", "Mc_BUCKET")


@triton.jit(do_not_specialize=_BATCH_SIZE_ARGS)
def _similarity_xent_fwd_kernel(
    q_ptr, c_ptr, q_norm_ptr, c_norm_ptr,  # norms of the scaled rows
    q_scale_ptr, c_scale_ptr, scaled_ptr,  # the rows' scales; [1] int32: whether any is not 1 (_add_dots)
    group_ptr,
    lse_all_ptr, lse_pos_ptr,  # [M] out, compute dtype
    M, Mc, D,
    M_BUCKET, Mc_BUCKET,  # autotune keys only (next powers of two of M and Mc), unused in the body
    stride_qm, stride_qd, stride_cm, stride_cd,
    params_ptr,  # [3] in the compute dtype: scale, cos(margin), sin(margin)
    PARTNER_TARGET: tl.constexpr, EXCLUDE_DIAGONAL: tl.constexpr, HAS_MARGIN: tl.constexpr,
    HAS_GROUPS: tl.constexpr, ACC: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr,
    EPS: tl.constexpr, SIN_SQ_FLOOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    scale, cos_m, sin_m = _loss_params(params_ptr)
    scaled = tl.load(scaled_ptr) != 0
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok, inv_q, _unit_q, targets, group_row, group_target = _row_state(
        q_norm_ptr, q_scale_ptr, group_ptr, rows, M, EPS, ACC, PARTNER_TARGET, HAS_GROUPS)

    max_all, sum_all, max_pos, sum_pos, target_logit = _empty_lse_states(BLOCK_M, ACC)
    for col_start in range(0, Mc, BLOCK_N):
        cols = (col_start + tl.arange(0, BLOCK_N)).to(tl.int64)
        col_ok = cols < Mc
        dots = _dot_tile(q_ptr, c_ptr, rows, cols, row_ok, col_ok, D, stride_qm, stride_qd, stride_cm,
                         stride_cd, q_scale_ptr, c_scale_ptr, scaled, ACC, OPERAND, PRECISION, BLOCK_M, BLOCK_N,
                         BLOCK_K)
        inv_c, _unit_c, group_col = _column_state(c_norm_ptr, c_scale_ptr, group_ptr, cols, col_ok, EPS, ACC,
                                                  HAS_GROUPS)
        max_all, sum_all, max_pos, sum_pos, target_logit = _fold_dots_into_lse(
            max_all, sum_all, max_pos, sum_pos, target_logit, dots, rows, cols, row_ok, col_ok, inv_q, inv_c,
            targets, group_row, group_target, group_col, scale, cos_m, sin_m, EXCLUDE_DIAGONAL, HAS_MARGIN,
            HAS_GROUPS, SIN_SQ_FLOOR)

    lse_all, lse_pos = _final_lse(max_all, sum_all, max_pos, sum_pos, target_logit, row_ok, HAS_GROUPS)
    tl.store(lse_all_ptr + rows, lse_all, mask=row_ok)
    tl.store(lse_pos_ptr + rows, lse_pos, mask=row_ok)


@triton.jit(do_not_specialize=_BATCH_SIZE_ARGS)
def _similarity_xent_bwd_dq_kernel(
    q_ptr, c_ptr, q_norm_ptr, c_norm_ptr, q_scale_ptr, c_scale_ptr, scaled_ptr, group_ptr, lse_all_ptr, lse_pos_ptr,
    coef_ptr,
    dq_raw_ptr,  # [M, D] fp32/fp64 out: sum_j G_ij inv_c_j c_j
    dq_radial_ptr,  # [M] out: sum_j G_ij cos_ij
    M, Mc, D,
    M_BUCKET, Mc_BUCKET,  # autotune keys only (next powers of two of M and Mc), unused in the body
    stride_qm, stride_qd, stride_cm, stride_cd,
    params_ptr,  # [3] in the compute dtype: scale, cos(margin), sin(margin)
    PARTNER_TARGET: tl.constexpr, EXCLUDE_DIAGONAL: tl.constexpr, HAS_MARGIN: tl.constexpr,
    HAS_GROUPS: tl.constexpr, ACC: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr,
    EPS: tl.constexpr, SIN_SQ_FLOOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    scale, cos_m, sin_m = _loss_params(params_ptr)
    scaled = tl.load(scaled_ptr) != 0
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok, inv_q, _unit_q, targets, group_row, group_target = _row_state(
        q_norm_ptr, q_scale_ptr, group_ptr, rows, M, EPS, ACC, PARTNER_TARGET, HAS_GROUPS)
    lse_all = tl.load(lse_all_ptr + rows, mask=row_ok, other=0.0)
    lse_pos = tl.load(lse_pos_ptr + rows, mask=row_ok, other=0.0)
    coef = tl.load(coef_ptr + rows, mask=row_ok, other=0.0)

    radial = tl.zeros([BLOCK_M], ACC)
    for col_start in range(0, Mc, BLOCK_N):
        cols = (col_start + tl.arange(0, BLOCK_N)).to(tl.int64)
        col_ok = cols < Mc
        dots = _dot_tile(q_ptr, c_ptr, rows, cols, row_ok, col_ok, D, stride_qm, stride_qd, stride_cm,
                         stride_cd, q_scale_ptr, c_scale_ptr, scaled, ACC, OPERAND, PRECISION, BLOCK_M, BLOCK_N,
                         BLOCK_K)
        inv_c, unit_c, group_col = _column_state(c_norm_ptr, c_scale_ptr, group_ptr, cols, col_ok, EPS, ACC,
                                                 HAS_GROUPS)
        cos, logits, is_target, valid, positive, slope = _logits_tile(
            dots, rows, cols, row_ok, col_ok, inv_q, inv_c, targets, group_row, group_target, group_col,
            scale, cos_m, sin_m, EXCLUDE_DIAGONAL, HAS_MARGIN, HAS_GROUPS, SIN_SQ_FLOOR)
        g = _grad_cos_tile(logits, is_target, valid, positive, slope, lse_all, lse_pos, coef, scale,
                           HAS_MARGIN, HAS_GROUPS)
        g = g.to(OPERAND)  # the radial sum takes the rounded tile the products take (as the prefix kernels)
        radial += tl.sum(g.to(ACC) * cos, axis=1)
        # g @ c_hat[cols] into this program's rows of the buffer (the inverse norms on c_hat: see the helper)
        _accumulate_grad_tile(g, c_ptr, cols, col_ok, unit_c, dq_raw_ptr, rows, row_ok, col_start > 0,
                              D, stride_cm, stride_cd, ACC, OPERAND, PRECISION, BLOCK_K)
    tl.store(dq_radial_ptr + rows, radial, mask=row_ok)


@triton.jit(do_not_specialize=_BATCH_SIZE_ARGS)
def _similarity_xent_bwd_dc_kernel(
    q_ptr, c_ptr, q_norm_ptr, c_norm_ptr, q_scale_ptr, c_scale_ptr, scaled_ptr, group_ptr, lse_all_ptr, lse_pos_ptr,
    coef_ptr,
    dc_raw_ptr,  # [Mc, D] out: sum_i G_ij inv_q_i q_i
    dc_radial_ptr,  # [Mc] out: sum_i G_ij cos_ij
    M, Mc, D,
    M_BUCKET, Mc_BUCKET,  # autotune keys only (next powers of two of M and Mc), unused in the body
    stride_qm, stride_qd, stride_cm, stride_cd,
    params_ptr,  # [3] in the compute dtype: scale, cos(margin), sin(margin)
    PARTNER_TARGET: tl.constexpr, EXCLUDE_DIAGONAL: tl.constexpr, HAS_MARGIN: tl.constexpr,
    HAS_GROUPS: tl.constexpr, ACC: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr,
    EPS: tl.constexpr, SIN_SQ_FLOOR: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    scale, cos_m, sin_m = _loss_params(params_ptr)
    scaled = tl.load(scaled_ptr) != 0
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < Mc
    inv_c, _unit_c, group_col = _column_state(c_norm_ptr, c_scale_ptr, group_ptr, cols, col_ok, EPS, ACC, HAS_GROUPS)

    radial = tl.zeros([BLOCK_N], ACC)
    for row_start in range(0, M, BLOCK_M):
        rows = (row_start + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok, inv_q, unit_q, targets, group_row, group_target = _row_state(
            q_norm_ptr, q_scale_ptr, group_ptr, rows, M, EPS, ACC, PARTNER_TARGET, HAS_GROUPS)
        lse_all = tl.load(lse_all_ptr + rows, mask=row_ok, other=0.0)
        lse_pos = tl.load(lse_pos_ptr + rows, mask=row_ok, other=0.0)
        coef = tl.load(coef_ptr + rows, mask=row_ok, other=0.0)
        dots = _dot_tile(q_ptr, c_ptr, rows, cols, row_ok, col_ok, D, stride_qm, stride_qd, stride_cm,
                         stride_cd, q_scale_ptr, c_scale_ptr, scaled, ACC, OPERAND, PRECISION, BLOCK_M, BLOCK_N,
                         BLOCK_K)
        cos, logits, is_target, valid, positive, slope = _logits_tile(
            dots, rows, cols, row_ok, col_ok, inv_q, inv_c, targets, group_row, group_target, group_col,
            scale, cos_m, sin_m, EXCLUDE_DIAGONAL, HAS_MARGIN, HAS_GROUPS, SIN_SQ_FLOOR)
        g = _grad_cos_tile(logits, is_target, valid, positive, slope, lse_all, lse_pos, coef, scale,
                           HAS_MARGIN, HAS_GROUPS)
        g = g.to(OPERAND)  # the radial sum takes the rounded tile the products take (as the prefix kernels)
        radial += tl.sum(g.to(ACC) * cos, axis=0)
        # g^T @ q_hat[rows] ([BLOCK_N, BLOCK_M] x [BLOCK_M, D]) into this program's columns of the buffer
        _accumulate_grad_tile(tl.trans(g), q_ptr, rows, row_ok, unit_q, dc_raw_ptr, cols, col_ok,
                              row_start > 0, D, stride_qm, stride_qd, ACC, OPERAND, PRECISION, BLOCK_K)
    tl.store(dc_radial_ptr + cols, radial, mask=col_ok)


# Nested prefixes (dims, see the module docstring): the same tiles, one prefix at a time within a column block.
_PREFIX_RUNTIME_ARGS = _BATCH_SIZE_ARGS + ("K",)


@triton.jit
def _online_lse_update_prefix(max_state, sum_state, this, logits):
    """_online_lse_update on column `this` ([1, KP] mask) of [rows, KP] per-prefix states."""
    new_max, new_sum = _online_lse_update(tl.max(tl.where(this, max_state, float("-inf")), axis=1),
                                          tl.sum(tl.where(this, sum_state, 0.0), axis=1), logits)
    return tl.where(this, new_max[:, None], max_state), tl.where(this, new_sum[:, None], sum_state)


@triton.jit(do_not_specialize=_PREFIX_RUNTIME_ARGS)
def _similarity_xent_prefix_fwd_kernel(
    q_ptr, c_ptr, q_norm_ptr, c_norm_ptr,  # norms of the scaled rows: [K, M] and [K, Mc], prefix by prefix
    q_scale_ptr, c_scale_ptr, scaled_ptr,  # the rows' scales [M], [Mc] (one per row for all its prefixes); [1] flag
    group_ptr,
    lse_all_ptr, lse_pos_ptr,  # [K, M] out, compute dtype
    M, Mc, D,
    M_BUCKET, Mc_BUCKET,  # autotune keys only (next powers of two of M and Mc), unused in the body
    stride_qm, stride_qd, stride_cm, stride_cd,
    params_ptr,  # [3] in the compute dtype: scale, cos(margin), sin(margin)
    bounds_ptr,  # [K + 1] int32: 0, d_1, ..., d_K
    K,
    PARTNER_TARGET: tl.constexpr, EXCLUDE_DIAGONAL: tl.constexpr, HAS_MARGIN: tl.constexpr,
    HAS_GROUPS: tl.constexpr, ACC: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr,
    EPS: tl.constexpr, SIN_SQ_FLOOR: tl.constexpr, KP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    scale, cos_m, sin_m = _loss_params(params_ptr)
    scaled = tl.load(scaled_ptr) != 0
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    prefixes = tl.arange(0, KP)
    # One online logsumexp pair per row and prefix: [BLOCK_M, KP] states, column i updated at prefix i's
    # boundary (KP = k rounded up to a power of two; the widths are runtime values).
    max_all = tl.full([BLOCK_M, KP], float("-inf"), ACC)
    sum_all = tl.zeros([BLOCK_M, KP], ACC)
    max_pos = tl.full([BLOCK_M, KP], float("-inf"), ACC)
    sum_pos = tl.zeros([BLOCK_M, KP], ACC)
    target_logit = tl.zeros([BLOCK_M, KP], ACC)
    for col_start in range(0, Mc, BLOCK_N):
        cols = (col_start + tl.arange(0, BLOCK_N)).to(tl.int64)
        col_ok = cols < Mc
        if HAS_GROUPS:
            group_col = tl.load(group_ptr + cols, mask=col_ok, other=0)
        else:
            group_col = cols
        dots = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        for i in range(0, K):
            row_ok, inv_q, _unit_q, targets, group_row, group_target = _row_state(
                q_norm_ptr + i * M, q_scale_ptr, group_ptr, rows, M, EPS, ACC, PARTNER_TARGET, HAS_GROUPS)
            dots = _add_dots(dots, q_ptr, c_ptr, rows, cols, row_ok, col_ok, tl.load(bounds_ptr + i),
                             tl.load(bounds_ptr + i + 1), stride_qm, stride_qd, stride_cm, stride_cd, q_scale_ptr,
                             c_scale_ptr, scaled, ACC, OPERAND, PRECISION, BLOCK_K)
            inv_c, _unit_c = _inverse_norms(c_norm_ptr + i * Mc, c_scale_ptr, cols, col_ok, EPS, ACC)
            cos, logits, is_target, valid, positive, slope = _logits_tile(
                dots, rows, cols, row_ok, col_ok, inv_q, inv_c, targets, group_row, group_target, group_col,
                scale, cos_m, sin_m, EXCLUDE_DIAGONAL, HAS_MARGIN, HAS_GROUPS, SIN_SQ_FLOOR)
            this = prefixes[None, :] == i
            max_all, sum_all = _online_lse_update_prefix(max_all, sum_all, this, logits)
            if HAS_GROUPS:
                max_pos, sum_pos = _online_lse_update_prefix(max_pos, sum_pos, this,
                                                             tl.where(positive, logits, float("-inf")))
            else:
                target_logit += tl.where(this, tl.sum(tl.where(is_target, logits, 0.0), axis=1)[:, None], 0.0)

    # As in the full-width kernel: the clamps only keep padding rows and prefixes (not stored) from log(0).
    row_ok = rows < M
    out = prefixes[None, :] * M + rows[:, None]
    ok = row_ok[:, None] & (prefixes[None, :] < K)
    tl.store(lse_all_ptr + out, tl.where(ok, max_all, 0.0) + tl.log(tl.maximum(sum_all, 1.0)), mask=ok)
    if HAS_GROUPS:
        lse_pos = tl.where(ok, max_pos, 0.0) + tl.log(tl.maximum(sum_pos, 1.0))
    else:
        lse_pos = target_logit
    tl.store(lse_pos_ptr + out, lse_pos, mask=ok)


@triton.jit
def _prefix_grad_tile(
    dots, i, q_ptr, c_ptr, q_norm_ptr, c_norm_ptr, q_scale_ptr, c_scale_ptr, scaled, group_ptr, lse_all_ptr,
    lse_pos_ptr, coef_ptr, bounds_ptr,
    rows, cols, col_ok, group_col, M, Mc, stride_qm, stride_qd, stride_cm, stride_cd, scale, cos_m, sin_m,
    PARTNER_TARGET: tl.constexpr, EXCLUDE_DIAGONAL: tl.constexpr, HAS_MARGIN: tl.constexpr,
    HAS_GROUPS: tl.constexpr, ACC: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr,
    EPS: tl.constexpr, SIN_SQ_FLOOR: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """Prefix i's step of a backward tile: the dot tile extended over slice i, then (dots, prefix i's dL/dcos
    tile in the operand dtype, its cosines, row_ok, the inverse norms of prefix i of the scaled rows and columns,
    those of the raw ones (unit rows), the width d_i).

    The radial sums take the rounded g the products use: a short prefix's gradient is nearly all radial (a
    width of 1 has none), and only the same g on both sides cancels it.
    """
    width = tl.load(bounds_ptr + i + 1)
    row_ok, inv_q, unit_q, targets, group_row, group_target = _row_state(
        q_norm_ptr + i * M, q_scale_ptr, group_ptr, rows, M, EPS, ACC, PARTNER_TARGET, HAS_GROUPS)
    dots = _add_dots(dots, q_ptr, c_ptr, rows, cols, row_ok, col_ok, tl.load(bounds_ptr + i), width,
                     stride_qm, stride_qd, stride_cm, stride_cd, q_scale_ptr, c_scale_ptr, scaled, ACC, OPERAND,
                     PRECISION, BLOCK_K)
    inv_c, unit_c = _inverse_norms(c_norm_ptr + i * Mc, c_scale_ptr, cols, col_ok, EPS, ACC)
    cos, logits, is_target, valid, positive, slope = _logits_tile(
        dots, rows, cols, row_ok, col_ok, inv_q, inv_c, targets, group_row, group_target, group_col,
        scale, cos_m, sin_m, EXCLUDE_DIAGONAL, HAS_MARGIN, HAS_GROUPS, SIN_SQ_FLOOR)
    lse_all = tl.load(lse_all_ptr + i * M + rows, mask=row_ok, other=0.0)
    lse_pos = tl.load(lse_pos_ptr + i * M + rows, mask=row_ok, other=0.0)
    coef = tl.load(coef_ptr + i * M + rows, mask=row_ok, other=0.0)
    g = _grad_cos_tile(logits, is_target, valid, positive, slope, lse_all, lse_pos, coef, scale,
                       HAS_MARGIN, HAS_GROUPS)
    return dots, g.to(OPERAND), cos, row_ok, inv_q, inv_c, unit_q, unit_c, width


@triton.jit(do_not_specialize=_PREFIX_RUNTIME_ARGS)
def _similarity_xent_prefix_bwd_dq_kernel(
    q_ptr, c_ptr, q_norm_ptr, c_norm_ptr,  # norms [K, *] per prefix, of the scaled rows
    q_scale_ptr, c_scale_ptr, scaled_ptr,  # the rows' scales; [1] flag (_add_dots)
    group_ptr, lse_all_ptr, lse_pos_ptr, coef_ptr,  # [K, *] per prefix
    dq_raw_ptr,  # [M, D] fp32/fp64, zeroed: sum_i inv_q_i sum_j G_ij c_hat_j[:d_i] (inv_q_i of the scaled rows)
    dq_radial_ptr,  # [K, M] out: sum_j G_ij cos_ij per prefix
    M, Mc, D,
    M_BUCKET, Mc_BUCKET,  # autotune keys only (next powers of two of M and Mc), unused in the body
    stride_qm, stride_qd, stride_cm, stride_cd,
    params_ptr,  # [3] in the compute dtype: scale, cos(margin), sin(margin)
    bounds_ptr,  # [K + 1] int32: 0, d_1, ..., d_K
    K,
    PARTNER_TARGET: tl.constexpr, EXCLUDE_DIAGONAL: tl.constexpr, HAS_MARGIN: tl.constexpr,
    HAS_GROUPS: tl.constexpr, ACC: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr,
    EPS: tl.constexpr, SIN_SQ_FLOOR: tl.constexpr, KP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    scale, cos_m, sin_m = _loss_params(params_ptr)
    scaled = tl.load(scaled_ptr) != 0
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    prefixes = tl.arange(0, KP)
    radial = tl.zeros([BLOCK_M, KP], ACC)
    for col_start in range(0, Mc, BLOCK_N):
        cols = (col_start + tl.arange(0, BLOCK_N)).to(tl.int64)
        col_ok = cols < Mc
        if HAS_GROUPS:
            group_col = tl.load(group_ptr + cols, mask=col_ok, other=0)
        else:
            group_col = cols
        dots = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        for i in range(0, K):
            dots, g, cos, row_ok, inv_q, inv_c, unit_q, unit_c, width = _prefix_grad_tile(
                dots, i, q_ptr, c_ptr, q_norm_ptr, c_norm_ptr, q_scale_ptr, c_scale_ptr, scaled, group_ptr,
                lse_all_ptr, lse_pos_ptr, coef_ptr, bounds_ptr, rows, cols, col_ok, group_col, M, Mc, stride_qm,
                stride_qd, stride_cm, stride_cd, scale, cos_m, sin_m, PARTNER_TARGET, EXCLUDE_DIAGONAL, HAS_MARGIN,
                HAS_GROUPS, ACC, OPERAND, PRECISION, EPS, SIN_SQ_FLOOR, BLOCK_K)
            radial += tl.where(prefixes[None, :] == i, tl.sum(g.to(ACC) * cos, axis=1)[:, None], 0.0)
            # inv_q_i (g @ c_hat[cols, :d_i]) into this program's rows: inv_q_i differs per prefix, so it goes
            # on the fp32/fp64 product (see the helper), and the buffer was zeroed (prefixes overlap).
            _accumulate_grad_columns(g, c_ptr, cols, col_ok, unit_c, dq_raw_ptr, rows, row_ok, inv_q,
                                     True, width, D, stride_cm, stride_cd, ACC, OPERAND, PRECISION, True, BLOCK_K)
    ok = (rows < M)[:, None] & (prefixes[None, :] < K)
    tl.store(dq_radial_ptr + prefixes[None, :] * M + rows[:, None], radial, mask=ok)


@triton.jit(do_not_specialize=_PREFIX_RUNTIME_ARGS)
def _similarity_xent_prefix_bwd_dc_kernel(
    q_ptr, c_ptr, q_norm_ptr, c_norm_ptr,  # norms [K, *] per prefix, of the scaled rows
    q_scale_ptr, c_scale_ptr, scaled_ptr,  # the rows' scales; [1] flag (_add_dots)
    group_ptr, lse_all_ptr, lse_pos_ptr, coef_ptr,  # [K, *] per prefix
    dc_raw_ptr,  # [Mc, D] fp32/fp64, zeroed: sum_i inv_c_i sum_j G_ij q_hat_j[:d_i] (inv_c_i of the scaled rows)
    dc_radial_ptr,  # [K, Mc] out: sum_i G_ij cos_ij per prefix
    M, Mc, D,
    M_BUCKET, Mc_BUCKET,  # autotune keys only (next powers of two of M and Mc), unused in the body
    stride_qm, stride_qd, stride_cm, stride_cd,
    params_ptr,  # [3] in the compute dtype: scale, cos(margin), sin(margin)
    bounds_ptr,  # [K + 1] int32: 0, d_1, ..., d_K
    K,
    PARTNER_TARGET: tl.constexpr, EXCLUDE_DIAGONAL: tl.constexpr, HAS_MARGIN: tl.constexpr,
    HAS_GROUPS: tl.constexpr, ACC: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr,
    EPS: tl.constexpr, SIN_SQ_FLOOR: tl.constexpr, KP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    scale, cos_m, sin_m = _loss_params(params_ptr)
    scaled = tl.load(scaled_ptr) != 0
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < Mc
    prefixes = tl.arange(0, KP)
    if HAS_GROUPS:
        group_col = tl.load(group_ptr + cols, mask=col_ok, other=0)
    else:
        group_col = cols
    radial = tl.zeros([BLOCK_N, KP], ACC)
    for row_start in range(0, M, BLOCK_M):
        rows = (row_start + tl.arange(0, BLOCK_M)).to(tl.int64)
        dots = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
        for i in range(0, K):
            dots, g, cos, row_ok, inv_q, inv_c, unit_q, unit_c, width = _prefix_grad_tile(
                dots, i, q_ptr, c_ptr, q_norm_ptr, c_norm_ptr, q_scale_ptr, c_scale_ptr, scaled, group_ptr,
                lse_all_ptr, lse_pos_ptr, coef_ptr, bounds_ptr, rows, cols, col_ok, group_col, M, Mc, stride_qm,
                stride_qd, stride_cm, stride_cd, scale, cos_m, sin_m, PARTNER_TARGET, EXCLUDE_DIAGONAL, HAS_MARGIN,
                HAS_GROUPS, ACC, OPERAND, PRECISION, EPS, SIN_SQ_FLOOR, BLOCK_K)
            radial += tl.where(prefixes[None, :] == i, tl.sum(g.to(ACC) * cos, axis=0)[:, None], 0.0)
            _accumulate_grad_columns(tl.trans(g), q_ptr, rows, row_ok, unit_q, dc_raw_ptr, cols, col_ok, inv_c, True,
                                     width, D, stride_qm, stride_qd, ACC, OPERAND, PRECISION, True, BLOCK_K)
    ok = col_ok[:, None] & (prefixes[None, :] < K)
    tl.store(dc_radial_ptr + prefixes[None, :] * Mc + cols[:, None], radial, mask=ok)


@triton.jit(do_not_specialize=("R", "K"))
def _similarity_xent_prefix_bwd_finish_kernel(
    x_ptr,  # [R, D] the input rows (q or c), any strides
    norm_ptr,  # [K, R] clamped norms of every prefix of the scaled rows
    scale_ptr,  # [R] the rows' scales
    raw_a_ptr, radial_a_ptr,  # [R, D], [K, R]: one side's accumulation (scaled inverse norms already applied)
    raw_b_ptr, radial_b_ptr,  # the other side's (read only HAS_B: the symmetric case, c is q)
    dx_ptr,  # [R, D] out, contiguous, x's dtype
    unscale_ptr,  # [1] compute dtype: the factor the gradient tiles left out (see gradient_tile_scale)
    bounds_ptr,  # [K + 1] int32: 0, d_1, ..., d_K
    R, D, K, stride_xm, stride_xd,
    HAS_B: tl.constexpr, ACC: tl.constexpr, EPS: tl.constexpr, KP: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dx = unscale * (raw - sum over the prefixes i with d_i > column of [|x[:d_i]| > eps] inv_i^2 radial_i x):
    each prefix's normalisation backward, applied once, on the scaled rows x_s = s x (raw then holds the scaled
    inverse norms' products): dx = s * unscale * (raw - sum_i [|x_s[:d_i]| > eps s] inv_s,i^2 radial_i x_s)."""
    row = tl.program_id(0).to(tl.int64)
    unscale = tl.load(unscale_ptr).to(ACC)
    row_scale = tl.load(scale_ptr + row).to(ACC)
    eps = scaled_eps(row_scale, EPS, ACC)
    prefixes = tl.arange(0, KP)
    has = prefixes < K
    norm = tl.load(norm_ptr + prefixes * R + row, mask=has, other=1.0).to(ACC)  # max(|x_s[:d_i]|, eps s)
    inv = 1.0 / norm
    radial = tl.load(radial_a_ptr + prefixes * R + row, mask=has, other=0.0).to(ACC)
    if HAS_B:
        radial += tl.load(radial_b_ptr + prefixes * R + row, mask=has, other=0.0).to(ACC)
    shrink = tl.where(norm > eps, inv * inv * radial, 0.0)
    widths = tl.load(bounds_ptr + 1 + prefixes, mask=has, other=0)
    for start in range(0, D, BLOCK_D):
        ks = (start + tl.arange(0, BLOCK_D)).to(tl.int64)
        ok = ks < D
        raw = tl.load(raw_a_ptr + row * D + ks, mask=ok, other=0.0).to(ACC)
        if HAS_B:
            raw += tl.load(raw_b_ptr + row * D + ks, mask=ok, other=0.0).to(ACC)
        x = tl.load(x_ptr + row * stride_xm + ks * stride_xd, mask=ok, other=0.0).to(ACC) * row_scale
        column_shrink = tl.sum(tl.where(ks[:, None] < widths[None, :], shrink[None, :], 0.0), axis=1)
        dx = (raw - column_shrink * x) * unscale * row_scale
        tl.store(dx_ptr + row * D + ks, dx.to(dx_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------------------

_TILE_KERNELS = (_similarity_xent_fwd_kernel, _similarity_xent_bwd_dq_kernel, _similarity_xent_bwd_dc_kernel)

# Autotuning benchmarks every config (several compiles and timed runs, minutes at large sizes) for each new
# key. Keying on the exact row counts would redo that for every batch size a training run meets (the last
# batch of an epoch, filtered pairs), so the key holds their power-of-two buckets (M_BUCKET, Mc_BUCKET; the
# assumption, not yet measured, is that the best tile changes little within a factor of two); D is the model's
# width and stays exact. The constexpr flags are in the key because each compiles a different kernel (TF32
# against exact fp32 dots above all): a config tuned for one variant says little about another. Triton adds
# the tensor arguments' dtypes to the key itself.
_TUNE_KEY = ["M_BUCKET", "Mc_BUCKET", "D", "PARTNER_TARGET", "EXCLUDE_DIAGONAL", "HAS_GROUPS", "HAS_MARGIN",
             "PRECISION"]


_TUNED = autotuned(_TILE_KERNELS, _TUNE_KEY)
_PREFIX_TILE_KERNELS = (_similarity_xent_prefix_fwd_kernel, _similarity_xent_prefix_bwd_dq_kernel,
                        _similarity_xent_prefix_bwd_dc_kernel)
# KP (the number of prefixes rounded up to a power of two) shapes the per-row state: a key of its own. The prefix
# gradient kernels add every prefix's gradient into the leading columns of zeroed buffers (prefixes overlap), so
# the autotuner must zero them again before each of its runs.
_PREFIX_TUNED = autotuned(_PREFIX_TILE_KERNELS, _TUNE_KEY + ["KP"], {
    _similarity_xent_prefix_bwd_dq_kernel: Tuning(reset_to_zero=("dq_raw_ptr",)),
    _similarity_xent_prefix_bwd_dc_kernel: Tuning(reset_to_zero=("dc_raw_ptr",)),
})



# ----------------------------------------------------------------------------------------------------------
# Autograd function and launcher
# ----------------------------------------------------------------------------------------------------------


class SimilarityXentFunction(torch.autograd.Function):
    """The loss (dims None) or the [K] losses of the prefixes of dims (the `_prefix_` kernels): the same launches,
    with per-prefix norms, logsumexps and radial sums laid out [K, rows]."""

    @staticmethod
    def forward(ctx, q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids, dims):
        symmetric = c is None
        dtype = compute_dtype(q.dtype)
        q_in = q.detach()
        c_in = q_in if symmetric else c.detach()
        m, d = q_in.shape
        mc = c_in.shape[0]
        bounds = None if dims is None else torch.tensor((0,) + dims, dtype=torch.int32).to(q.device)
        q_norm, q_scale = _row_norms(q_in, dtype, bounds)
        c_norm, c_scale = (q_norm, q_scale) if symmetric else _row_norms(c_in, dtype, bounds)
        scaled = any_scaled(q_scale, c_scale)
        groups = group_ids.contiguous() if group_ids is not None else q_norm  # placeholder pointer if unused
        static = dict(
            PARTNER_TARGET=target == "partner", EXCLUDE_DIAGONAL=bool(exclude_diagonal),
            HAS_MARGIN=margin != 0.0, HAS_GROUPS=group_ids is not None,
            ACC=tl.float64 if dtype == torch.float64 else tl.float32,
            OPERAND=_operand_dtype(q.dtype), PRECISION=_dot_precision(q.dtype),
            EPS=NORM_EPS, SIN_SQ_FLOOR=MARGIN_SIN_SQUARED_FLOOR,
        )
        params = torch.tensor([float(scale), math.cos(margin), math.sin(margin)], dtype=dtype).to(q.device)
        runtime = (m, mc, d, _autotune_bucket(m), _autotune_bucket(mc),
                   q_in.stride(0), q_in.stride(1), c_in.stride(0), c_in.stride(1), params)
        per_row = (m,)
        if dims is not None:
            runtime += (bounds, len(dims))
            static["KP"] = triton.next_power_of_2(len(dims))
            per_row = (len(dims), m)

        lse_all = new_output(per_row, dtype, q.device)
        lse_pos = new_output(per_row, dtype, q.device)
        blocks = _interpreter_blocks(m, mc, d)
        fwd_kernel, _, _ = kernels_for(_TUNED if dims is None else _PREFIX_TUNED, q.dtype)
        _tile_launch(fwd_kernel, lambda b: (triton.cdiv(m, b["BLOCK_M"]),), blocks,
                     q_in, c_in, q_norm, c_norm, q_scale, c_scale, scaled, groups, lse_all, lse_pos, *runtime, **static)

        weights = torch.ones(m, dtype=dtype, device=q.device) if row_weights is None else row_weights.to(dtype)
        loss = (weights * (lse_all - lse_pos)).sum(dim=-1) / m

        ctx.save_for_backward(q_in, None if symmetric else c_in, q_norm, c_norm, q_scale, c_scale, scaled, groups,
                              lse_all, lse_pos, weights, bounds)
        ctx.symmetric = symmetric
        ctx.static = static
        ctx.runtime = runtime
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        (q_in, c_saved, q_norm, c_norm, q_scale, c_scale, scaled, groups, lse_all, lse_pos, weights,
         bounds) = ctx.saved_tensors
        symmetric = ctx.symmetric
        c_in = q_in if symmetric else c_saved
        m, d = q_in.shape
        mc = c_in.shape[0]
        dtype = lse_all.dtype
        prefixes = bounds is not None
        coef, unscale = gradient_tile_scale(weights * grad_loss.to(dtype)[..., None], m)  # [M], or [K, M] with dims
        blocks = _interpreter_blocks(m, mc, d)
        common = (q_in, c_in, q_norm, c_norm, q_scale, c_scale, scaled, groups, lse_all, lse_pos, coef)

        def per_row(rows):  # the radial sums' layout
            return (lse_all.shape[0], rows) if prefixes else (rows,)

        # With dims every prefix adds into its leading columns: zeroed buffers (the full-width kernels store their
        # first block without reading).
        raw_buffer = torch.zeros if prefixes else new_output
        dq_raw = raw_buffer((m, d), dtype=dtype, device=q_in.device)
        dq_radial = new_output(per_row(m), dtype, q_in.device)
        _, dq_kernel, dc_kernel = kernels_for(_PREFIX_TUNED if prefixes else _TUNED, q_in.dtype)
        _tile_launch(dq_kernel, lambda b: (triton.cdiv(m, b["BLOCK_M"]),), blocks,
                     *common, dq_raw, dq_radial, *ctx.runtime, **ctx.static)
        dc_raw = raw_buffer((mc, d), dtype=dtype, device=q_in.device)
        dc_radial = new_output(per_row(mc), dtype, q_in.device)
        _tile_launch(dc_kernel, lambda b: (triton.cdiv(mc, b["BLOCK_N"]),), blocks,
                     *common, dc_raw, dc_radial, *ctx.runtime, **ctx.static)

        finish = dict(ACC=ctx.static["ACC"], EPS=NORM_EPS, BLOCK_D=min(triton.next_power_of_2(d), 1024), num_warps=4)
        if prefixes:
            finish["KP"] = ctx.static["KP"]

        def finish_launch(x, norm, x_scale, raw_a, radial_a, raw_b, radial_b, has_b):
            dx = new_output(x.shape, x.dtype, x.device)
            rows = x.shape[0]
            if prefixes:
                _similarity_xent_prefix_bwd_finish_kernel[(rows,)](
                    x, norm, x_scale, raw_a, radial_a, raw_b, radial_b, dx, unscale, bounds, rows, d,
                    bounds.shape[0] - 1, x.stride(0), x.stride(1), HAS_B=has_b, **finish)
            else:
                _similarity_xent_bwd_finish_kernel[(rows,)](
                    x, norm, x_scale, raw_a, radial_a, raw_b, radial_b, dx, unscale, rows, d, x.stride(0),
                    x.stride(1), HAS_B=has_b, **finish)
            return dx

        if symmetric:
            dq = finish_launch(q_in, q_norm, q_scale, dq_raw, dq_radial, dc_raw, dc_radial, True)
            return dq, None, None, None, None, None, None, None, None
        dq = finish_launch(q_in, q_norm, q_scale, dq_raw, dq_radial, dq_raw, dq_radial, False)
        dc = finish_launch(c_in, c_norm, c_scale, dc_raw, dc_radial, dc_raw, dc_radial, False)
        return dq, dc, None, None, None, None, None, None, None


def code_path(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0, group_ids=None,
              dims=None) -> str:
    """The one of PATHS that computes this call: dims -> the prefix kernels; wide embeddings -> the dense scheme
    (similarity_xent_dense.takes); else the fused kernels."""
    if dims is not None:
        return "dims"
    columns = q.shape[0] if c is None else c.shape[0]
    return "dense" if similarity_xent_dense.takes(q.shape[1], columns, dims) else "fused"


def similarity_xent(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0, group_ids=None,
                    dims=None):
    """Softmax cross-entropy over cosine similarities, by the fused kernels above or, for wide embeddings, by the
    dense scheme (code_path); see angle_kernels.dispatch."""
    if code_path(q, c, scale, target, dims=dims) == "dense":
        return similarity_xent_dense.similarity_xent(q, c, scale, target, row_weights, exclude_diagonal, margin,
                                                     group_ids)
    return SimilarityXentFunction.apply(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids, dims)


# ----------------------------------------------------------------------------------------------------------
# The specialisations CI compiles for sm_90 without a GPU (triton_ops._compile_check)
# ----------------------------------------------------------------------------------------------------------
def compile_cases(full: bool) -> list[CompileCase]:
    """CI: bf16 with groups, fp32 with a margin, the first autotune config of each, full-width and with dims (4
    prefixes); full=True: every dtype, both variants, every autotune config."""
    variants = [("bf16", tl.bfloat16, True, False), ("fp32", tl.float32, False, True)]
    if full:
        variants = [(x, operand, groups, not groups)
                    for x, operand in (("fp32", tl.float32), ("bf16", tl.bfloat16), ("fp16", tl.float16),
                                       ("fp64", tl.float64))
                    for groups in (True, False)]
    cases = []
    for x_dtype, operand, has_groups, has_margin in variants:
        configs = _GPU_CONFIGS_32BIT if x_dtype in ("fp32", "fp64") else _GPU_CONFIGS_16BIT
        acc = tl.float64 if x_dtype == "fp64" else tl.float32
        pointer_dtype = "fp64" if x_dtype == "fp64" else "fp32"
        for config in configs if full else configs[:1]:
            constexprs = dict(PARTNER_TARGET=has_groups, EXCLUDE_DIAGONAL=has_groups, HAS_MARGIN=has_margin,
                              HAS_GROUPS=has_groups, ACC=acc, OPERAND=operand, PRECISION="ieee", EPS=NORM_EPS,
                              SIN_SQ_FLOOR=MARGIN_SIN_SQUARED_FLOOR, **config.kwargs)
            blocks = "x".join(str(v) for v in config.kwargs.values())
            label = f"x={x_dtype} groups={has_groups} margin={has_margin} tile={blocks} w={config.num_warps}"
            pointers = {"q_ptr": x_dtype, "c_ptr": x_dtype, "group_ptr": "i64", "bounds_ptr": "i32",
                        "scaled_ptr": "i32"}
            cases += [CompileCase(kernel, label, pointer_dtype, constexprs, config.num_warps, config.num_stages,
                                  pointers) for kernel in _TILE_KERNELS]
            cases += [CompileCase(kernel, f"{label} KP=4", pointer_dtype, dict(constexprs, KP=4), config.num_warps,
                                  config.num_stages, pointers) for kernel in _PREFIX_TILE_KERNELS]
        finish_pointers = {"x_ptr": x_dtype, "dx_ptr": x_dtype, "bounds_ptr": "i32"}
        cases.append(CompileCase(_similarity_xent_bwd_finish_kernel, f"x={x_dtype}", pointer_dtype,
                                 dict(HAS_B=True, ACC=acc, EPS=NORM_EPS, BLOCK_D=1024), 4, pointers=finish_pointers))
        cases.append(CompileCase(_similarity_xent_prefix_bwd_finish_kernel, f"x={x_dtype} KP=4", pointer_dtype,
                                 dict(HAS_B=True, ACC=acc, EPS=NORM_EPS, KP=4, BLOCK_D=1024), 4,
                                 pointers=finish_pointers))
        norm_blocks = {k: v for k, v in _GPU_NORM_BLOCKS.items() if k != "num_warps"}
        for has_dims, kp in ((False, 1), (True, 4)):
            cases.append(CompileCase(_row_norms_kernel, f"x={x_dtype} dims={has_dims}", pointer_dtype,
                                     dict(SCALE_ROWS=x_dtype != "fp16", HAS_DIMS=has_dims, ACC=acc, EPS=NORM_EPS, KP=kp,
                                          **norm_blocks), _GPU_NORM_BLOCKS["num_warps"],
                                     pointers={"x_ptr": x_dtype, "bounds_ptr": "i32"}))
    return cases
