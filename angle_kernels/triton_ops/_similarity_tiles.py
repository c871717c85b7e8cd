"""The Triton tile library of the similarity family: what similarity_xent, its dense scheme and similarity_lse share.

The op modules import from here, downward, and never one another's private names (the layout of Liger-Kernel's
ops/utils.py). Nothing here is an op: the kernels below are launched by the op modules, whose compile_cases list
their specialisations (similarity_xent's: the finish and row-norm kernels; similarity_lse's: the finish kernel
with HAS_B=False).

    @triton.jit helpers, inlined into the kernels:
        _dot_tile, _add_dots, _k_chunk          dot tiles of the rows (scaled by powers of two), a K-loop over D
        _inverse_norms, _row_state, _column_state, _loss_params
        _logits_tile, _margin_logit             cosines, logits and the C_i / P_i masks of similarity_xent
        _online_lse_update, _empty_lse_states, _fold_dots_into_lse, _final_lse      online logsumexps
        _grad_cos_tile                          a tile's dL/dcos
        _accumulate_grad_tile, _accumulate_grad_columns     g @ x_hat into the program's rows of a fp32 buffer
    kernels:
        _similarity_xent_bwd_finish_kernel      the normalisation's backward, once per row
        _row_norms_kernel                       the rows' scales and clamped norms (or their prefixes'), one read
    launch configuration:
        _GPU_CONFIGS_16BIT, _GPU_CONFIGS_32BIT, autotuned, kernels_for, _autotune_bucket, _interpreter_blocks,
        _operand_dtype, _dot_precision (ANGLE_KERNELS_ALLOW_TF32), _tile_launch, _row_norms, any_scaled,
        gradient_tile_scale

Tile shapes, registers, precision (the interpreter's bf16, TF32, the fp16 gradient tile) and huge rows:
docs/triton-similarity.md.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .._runtime import triton_interpreting
from ..contract import NORM_EPS
from . import _common
from ._common import Tuning, TunedKernel, new_output, pow2, raise_exponent, scaled_eps

_TF32_ENV = "ANGLE_KERNELS_ALLOW_TF32"


# ----------------------------------------------------------------------------------------------------------
# Tile helpers (inlined into the kernels)
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _dot_tile(
    a_ptr, b_ptr, rows, cols, row_ok, col_ok, D,
    stride_am, stride_ad, stride_bm, stride_bd, a_scale_ptr, b_scale_ptr, scaled,
    ACC: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """[BLOCK_M, BLOCK_N] dot products of the scaled rows a_s[rows] . b_s[cols] (see _add_dots), a K-loop over D."""
    dots = tl.zeros([BLOCK_M, BLOCK_N], dtype=ACC)
    return _add_dots(dots, a_ptr, b_ptr, rows, cols, row_ok, col_ok, 0, D, stride_am, stride_ad, stride_bm,
                     stride_bd, a_scale_ptr, b_scale_ptr, scaled, ACC, OPERAND, PRECISION, BLOCK_K)


@triton.jit
def _add_dots(
    dots, a_ptr, b_ptr, rows, cols, row_ok, col_ok, k_lo, k_hi,
    stride_am, stride_ad, stride_bm, stride_bd, a_scale_ptr, b_scale_ptr, scaled,
    ACC: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """dots + the dot products of the scaled rows a_s[rows] and b_s[cols] (x_s = s x, the rows' powers of two in
    a_scale_ptr, b_scale_ptr) over the columns k_lo .. k_hi - 1, a K-loop.

    `scaled` (a runtime flag, the same for every program of a launch) says whether any scale differs from 1: only
    then does the loop multiply each loaded chunk by its rows' scales (exact: powers of two, in the operand dtype
    too); ordinary inputs take the loop without them, the one they always took, at its speed."""
    if scaled:
        for k_start in range(k_lo, k_hi, BLOCK_K):
            a, b = _k_chunk(a_ptr, b_ptr, rows, cols, row_ok, col_ok, k_start, k_hi, stride_am, stride_ad, stride_bm,
                            stride_bd, BLOCK_K)
            # the scales are reloaded (from the cache) at each step rather than kept live across the loop, and
            # multiply in the operand dtype (exact for powers of two; bf16 under the interpreter is fp32 already)
            a_scale = tl.load(a_scale_ptr + rows, mask=row_ok, other=1.0).to(OPERAND)
            b_scale = tl.load(b_scale_ptr + cols, mask=col_ok, other=1.0).to(OPERAND)
            a = a.to(OPERAND) * a_scale[:, None]
            b = b.to(OPERAND) * b_scale[None, :]
            dots = tl.dot(a, b, dots, input_precision=PRECISION, out_dtype=ACC)
    else:
        for k_start in range(k_lo, k_hi, BLOCK_K):
            a, b = _k_chunk(a_ptr, b_ptr, rows, cols, row_ok, col_ok, k_start, k_hi, stride_am, stride_ad, stride_bm,
                            stride_bd, BLOCK_K)
            dots = tl.dot(a.to(OPERAND), b.to(OPERAND), dots, input_precision=PRECISION, out_dtype=ACC)
    return dots


@triton.jit
def _k_chunk(a_ptr, b_ptr, rows, cols, row_ok, col_ok, k_start, k_hi, stride_am, stride_ad, stride_bm, stride_bd,
             BLOCK_K: tl.constexpr):
    """The K-chunk [k_start, k_start + BLOCK_K) of a's rows [BLOCK_M, BLOCK_K] and of b's columns, transposed
    [BLOCK_K, BLOCK_N], zero past k_hi and outside the rows / columns."""
    ks = (k_start + tl.arange(0, BLOCK_K)).to(tl.int64)
    k_ok = ks < k_hi
    a = tl.load(a_ptr + rows[:, None] * stride_am + ks[None, :] * stride_ad, mask=row_ok[:, None] & k_ok[None, :],
                other=0.0)
    b = tl.load(b_ptr + ks[:, None] * stride_bd + cols[None, :] * stride_bm, mask=k_ok[:, None] & col_ok[None, :],
                other=0.0)
    return a, b


@triton.jit
def _inverse_norms(norm_ptr, scale_ptr, idx, ok, EPS: tl.constexpr, ACC: tl.constexpr):
    """(1 / max(|x_s|, eps s), 1 / max(|x|, eps)) of the rows idx, from the scaled rows' clamped norms
    max(|x_s|, eps s) (_row_norms_kernel stores them so) and the scales: the first turns dots of scaled rows into
    cosines, the second (the same for ordinary rows, whose s is 1) makes unit rows of the raw ones (a kernel that
    does not use it does not load the scales)."""
    inv = 1.0 / tl.load(norm_ptr + idx, mask=ok, other=1.0).to(ACC)
    return inv, inv * tl.load(scale_ptr + idx, mask=ok, other=1.0).to(ACC)


@triton.jit
def _loss_params(params_ptr):
    """(scale, cos(margin), sin(margin)) from a [3] tensor in the compute dtype. Scalars come through memory, not as
    arguments: Triton passes Python floats as fp32, and the float64 path must see cos(margin) to float64
    precision."""
    return tl.load(params_ptr), tl.load(params_ptr + 1), tl.load(params_ptr + 2)


@triton.jit
def _margin_logit(cos, cos_m, sin_m, SIN_SQ_FLOOR: tl.constexpr):
    """cos(min(arccos(cos) + m, pi)) and its derivative in cos.

    The derivative is 0 past pi, and the sin term's share of it is dropped where 1 - cos^2 is clamped.
    """
    sin_sq = 1.0 - cos * cos
    sin_t = tl.sqrt(tl.maximum(sin_sq, SIN_SQ_FLOOR))
    value = cos * cos_m - sin_t * sin_m
    slope = cos_m + tl.where(sin_sq > SIN_SQ_FLOOR, cos * sin_m / sin_t, 0.0)
    past_pi = cos < -cos_m  # theta + m > pi: the logit is pinned at cos(pi) = -1
    return tl.where(past_pi, -1.0, value), tl.where(past_pi, 0.0, slope)


@triton.jit
def _logits_tile(
    dots, rows, cols, row_ok, col_ok, inv_q, inv_c, targets, group_row, group_target, group_col,
    scale, cos_m, sin_m,
    EXCLUDE_DIAGONAL: tl.constexpr, HAS_MARGIN: tl.constexpr, HAS_GROUPS: tl.constexpr,
    SIN_SQ_FLOOR: tl.constexpr,
):
    """(cos, logits with -inf outside C_i, is_target, valid = in C_i, positive = in P_i, per-row target slope).

    The margin is evaluated on a per-row vector (the target cosine picked out of the tile), not on the whole
    tile: fewer live [BLOCK_M, BLOCK_N] tensors, fewer registers.
    """
    cos = dots * inv_q[:, None] * inv_c[None, :]
    valid = row_ok[:, None] & col_ok[None, :]
    if EXCLUDE_DIAGONAL:
        valid = valid & (cols[None, :] != rows[:, None])
    is_target = (cols[None, :] == targets[:, None]) & valid
    logits = tl.where(valid, cos * scale, float("-inf"))
    if HAS_MARGIN:
        target_cos = tl.sum(tl.where(is_target, cos, 0.0), axis=1)  # 0 when the target is in another tile
        margin_value, slope = _margin_logit(target_cos, cos_m, sin_m, SIN_SQ_FLOOR)
        logits = tl.where(is_target, (margin_value * scale)[:, None], logits)
    else:
        slope = inv_q * 0.0 + 1.0
    if HAS_GROUPS:
        same = (group_col[None, :] == group_row[:, None]) | (group_col[None, :] == group_target[:, None])
        positive = (same & valid) | is_target
    else:
        positive = is_target
    return cos, logits, is_target, valid, positive, slope


@triton.jit
def _online_lse_update(running_max, running_sum, logits):
    """Fold a [rows, cols] tile into a per-row running (max, sum of exp(x - max)); -inf is the empty sum."""
    new_max = tl.maximum(running_max, tl.max(logits, axis=1))
    safe = tl.where(new_max == float("-inf"), 0.0, new_max)
    running_sum = running_sum * tl.exp(running_max - safe) + tl.sum(tl.exp(logits - safe[:, None]), axis=1)
    return new_max, running_sum


@triton.jit
def _row_state(
    q_norm_ptr, q_scale_ptr, group_ptr, rows, M, EPS: tl.constexpr, ACC: tl.constexpr, PARTNER_TARGET: tl.constexpr,
    HAS_GROUPS: tl.constexpr,
):
    """Per-row (valid, inverse norms of the scaled and of the raw rows (_inverse_norms), target columns and,
    optionally, the group ids of the row and its target)."""
    row_ok = rows < M
    inv_q, unit_q = _inverse_norms(q_norm_ptr, q_scale_ptr, rows, row_ok, EPS, ACC)  # unit_q: loaded only if used
    if PARTNER_TARGET:
        targets = rows ^ 1
    else:
        targets = rows
    if HAS_GROUPS:
        group_row = tl.load(group_ptr + rows, mask=row_ok, other=0)
        group_target = tl.load(group_ptr + targets, mask=row_ok & (targets < M), other=0)
    else:
        group_row = rows
        group_target = rows
    return row_ok, inv_q, unit_q, targets, group_row, group_target


@triton.jit
def _column_state(c_norm_ptr, c_scale_ptr, group_ptr, cols, col_ok, EPS: tl.constexpr, ACC: tl.constexpr,
                  HAS_GROUPS: tl.constexpr):
    """Per-column (inverse norms of the scaled and of the raw column (_inverse_norms), group id: the column's own
    index without groups).

    The tile kernels load these after their dot K-loop, not before: live across it, they cost the forward kernel
    some 70 registers (spilling in its fp32 variant, from the sm_90 compile).
    """
    inv_c, unit_c = _inverse_norms(c_norm_ptr, c_scale_ptr, cols, col_ok, EPS, ACC)
    if HAS_GROUPS:
        group_col = tl.load(group_ptr + cols, mask=col_ok, other=0)
    else:
        group_col = cols
    return inv_c, unit_c, group_col


@triton.jit
def _empty_lse_states(BLOCK_M: tl.constexpr, ACC: tl.constexpr):
    """A row block's running logsumexp states before its first tile: (max, sum) over C_i, over P_i, target logit."""
    return (tl.full([BLOCK_M], float("-inf"), ACC), tl.zeros([BLOCK_M], ACC),
            tl.full([BLOCK_M], float("-inf"), ACC), tl.zeros([BLOCK_M], ACC), tl.zeros([BLOCK_M], ACC))


@triton.jit
def _fold_dots_into_lse(
    max_all, sum_all, max_pos, sum_pos, target_logit,
    dots, rows, cols, row_ok, col_ok, inv_q, inv_c, targets, group_row, group_target, group_col, scale, cos_m, sin_m,
    EXCLUDE_DIAGONAL: tl.constexpr, HAS_MARGIN: tl.constexpr, HAS_GROUPS: tl.constexpr, SIN_SQ_FLOOR: tl.constexpr,
):
    """Fold a tile of raw dot products, as logits, into a row block's running logsumexps: over C_i, and over P_i
    (with groups an online logsumexp of the positives; without, P_i = {t_i} and its logsumexp is the target logit,
    picked out of the one tile that holds it)."""
    cos, logits, is_target, valid, positive, slope = _logits_tile(
        dots, rows, cols, row_ok, col_ok, inv_q, inv_c, targets, group_row, group_target, group_col,
        scale, cos_m, sin_m, EXCLUDE_DIAGONAL, HAS_MARGIN, HAS_GROUPS, SIN_SQ_FLOOR)
    max_all, sum_all = _online_lse_update(max_all, sum_all, logits)
    if HAS_GROUPS:
        max_pos, sum_pos = _online_lse_update(max_pos, sum_pos, tl.where(positive, logits, float("-inf")))
    else:
        target_logit += tl.sum(tl.where(is_target, logits, 0.0), axis=1)
    return max_all, sum_all, max_pos, sum_pos, target_logit


@triton.jit
def _final_lse(max_all, sum_all, max_pos, sum_pos, target_logit, row_ok, HAS_GROUPS: tl.constexpr):
    """(logsumexp over C_i, logsumexp over P_i) of a row block from its running states.

    Every valid row has a finite maximum (its target column), so its sum is >= 1; the clamps only keep the
    padding rows (not stored) away from log(0).
    """
    lse_all = tl.where(row_ok, max_all, 0.0) + tl.log(tl.maximum(sum_all, 1.0))
    if HAS_GROUPS:
        lse_pos = tl.where(row_ok, max_pos, 0.0) + tl.log(tl.maximum(sum_pos, 1.0))
    else:
        lse_pos = target_logit
    return lse_all, lse_pos


@triton.jit
def _grad_cos_tile(
    logits, is_target, valid, positive, slope, lse_all, lse_pos, coef, scale,
    HAS_MARGIN: tl.constexpr, HAS_GROUPS: tl.constexpr,
):
    """dL/dcos for one tile: coef_i * scale * (softmax over C_i - softmax over P_i), times the margin slope."""
    p_all = tl.exp(logits - lse_all[:, None])  # 0 outside C_i (logits = -inf there)
    if HAS_GROUPS:
        p_pos = tl.where(positive, tl.exp(logits - lse_pos[:, None]), 0.0)
    else:
        p_pos = tl.where(is_target, 1.0, 0.0)  # P_i = {t_i}: its softmax is exactly 1
    g = (coef * scale)[:, None] * (p_all - p_pos)
    if HAS_MARGIN:
        g = tl.where(is_target, g * slope[:, None], g)
    return tl.where(valid, g, 0.0)


@triton.jit
def _accumulate_grad_tile(
    g_operand, x_ptr, x_idx, x_ok, inv_x, out_ptr, out_idx, out_ok, accumulate, D, stride_xm, stride_xd,
    ACC: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """out[out_idx] (+)= g @ (inv_x * x[x_idx]) over all D columns: `_accumulate_grad_columns` unscaled. inv_x:
    the raw rows' inverse norms (unit rows)."""
    _accumulate_grad_columns(g_operand, x_ptr, x_idx, x_ok, inv_x, out_ptr, out_idx, out_ok, inv_x, accumulate, D,
                             D, stride_xm, stride_xd, ACC, OPERAND, PRECISION, False, BLOCK_K)


@triton.jit
def _accumulate_grad_columns(
    g_operand, x_ptr, x_idx, x_ok, inv_x, out_ptr, out_idx, out_ok, out_scale, accumulate, k_end, D,
    stride_xm, stride_xd,
    ACC: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr, SCALE_OUT: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """out[out_idx, :k_end] (+)= g @ (inv_x * x[x_idx, :k_end]) (times out_scale per out row when SCALE_OUT), D
    chunk by D chunk, into a contiguous [*, D] fp32/fp64 buffer whose rows out_idx this program owns; g is
    [len(out_idx), len(x_idx)] in the operand dtype.

    The inverse norms go on the unit rows x_hat (bounded by 1) and on the fp32/fp64 product, never on g: 1/|x|
    reaches 1e12 for a zero row, and g / |x| would overflow an fp16 operand into inf (and inf * 0 = NaN in the
    product). With accumulate false (the program's first block) it stores without reading: the buffer needs
    no zeroing.
    """
    tl.debug_barrier()  # the previous block's stores are visible to every thread of the program
    for k_start in range(0, k_end, BLOCK_K):
        ks = (k_start + tl.arange(0, BLOCK_K)).to(tl.int64)
        k_ok = ks < k_end
        x_chunk = tl.load(x_ptr + x_idx[:, None] * stride_xm + ks[None, :] * stride_xd,
                          mask=x_ok[:, None] & k_ok[None, :], other=0.0)
        x_hat = (x_chunk.to(ACC) * inv_x[:, None]).to(OPERAND)
        update = tl.dot(g_operand, x_hat, input_precision=PRECISION, out_dtype=ACC)
        if SCALE_OUT:
            update = update * out_scale[:, None]
        out_ptrs = out_ptr + out_idx[:, None] * D + ks[None, :]
        ok = out_ok[:, None] & k_ok[None, :]
        if accumulate:
            update += tl.load(out_ptrs, mask=ok, other=0.0)
        tl.store(out_ptrs, update, mask=ok)


# ----------------------------------------------------------------------------------------------------------
# Kernels the ops share: the normalisation's backward, the row norms and scales
# ----------------------------------------------------------------------------------------------------------

@triton.jit
def _similarity_xent_bwd_finish_kernel(
    x_ptr,  # [R, D] the input rows (q or c), any strides
    norm_ptr,  # [R] clamped norms of the scaled rows, max(|x_s|, eps s)
    scale_ptr,  # [R] the rows' scales
    raw_a_ptr, radial_a_ptr,  # [R, D], [R]: one side's accumulation
    raw_b_ptr, radial_b_ptr,  # the other side's (read only HAS_B: the symmetric case, c is q)
    dx_ptr,  # [R, D] out, contiguous, x's dtype
    unscale_ptr,  # [1] compute dtype: the factor the gradient tiles left out (see gradient_tile_scale)
    R, D, stride_xm, stride_xd,
    HAS_B: tl.constexpr, ACC: tl.constexpr, EPS: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """dx = unscale * (inv * raw - [|x| > eps] inv^2 radial x): the normalisation's backward, applied once, on the
    scaled rows x_s = s x (inv their inverse norms): dx = s * unscale * (inv_s raw - [|x_s| > eps s] inv_s^2 radial
    x_s), whose every factor stays in range for huge rows."""
    row = tl.program_id(0).to(tl.int64)
    unscale = tl.load(unscale_ptr).to(ACC)
    norm = tl.load(norm_ptr + row).to(ACC)  # max(|x_s|, eps s)
    row_scale = tl.load(scale_ptr + row).to(ACC)
    eps = scaled_eps(row_scale, EPS, ACC)
    inv = 1.0 / norm
    radial = tl.load(radial_a_ptr + row).to(ACC)
    if HAS_B:
        radial += tl.load(radial_b_ptr + row).to(ACC)
    shrink = tl.where(norm > eps, inv * inv * radial, 0.0)
    for start in range(0, D, BLOCK_D):
        ks = (start + tl.arange(0, BLOCK_D)).to(tl.int64)
        ok = ks < D
        raw = tl.load(raw_a_ptr + row * D + ks, mask=ok, other=0.0).to(ACC)
        if HAS_B:
            raw += tl.load(raw_b_ptr + row * D + ks, mask=ok, other=0.0).to(ACC)
        x = tl.load(x_ptr + row * stride_xm + ks * stride_xd, mask=ok, other=0.0).to(ACC) * row_scale
        dx = (inv * raw - shrink * x) * unscale * row_scale
        tl.store(dx_ptr + row * D + ks, dx.to(dx_ptr.dtype.element_ty), mask=ok)


@triton.jit(do_not_specialize=("R", "D", "K"))
def _row_norms_kernel(
    x_ptr,  # [R, D], any strides
    norm_ptr,  # [K, R] out: clamped norms max(|x_s|, eps s) of the prefixes of the scaled rows (K = 1 without dims)
    scale_ptr,  # [R] out: the rows' scales (powers of two)
    bounds_ptr,  # [K + 1] int32: 0, d_1, ..., d_K (read only HAS_DIMS)
    R, D, K, stride_xm, stride_xd,
    SCALE_ROWS: tl.constexpr, HAS_DIMS: tl.constexpr, ACC: tl.constexpr, EPS: tl.constexpr, KP: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The rows' scales and the clamped norms of the scaled rows (or of their prefixes), in one read: each chunk's
    largest magnitudes may raise the rows' running scale exponents (_common.raise_exponent), and what was summed at
    the old scales, the running squares and the finished prefixes', is rescaled. One scale per row for all its
    prefixes (the tiles' running dot products share it); SCALE_ROWS False keeps every scale 1. The norms are
    stored clamped, max(|x_s|, eps s): the tile kernels take their inverse as it is, and a norm that was not
    clamped is one above eps s."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < R
    prefixes = tl.arange(0, KP)
    squares = tl.zeros([BLOCK_R, BLOCK_D], ACC)  # elementwise partial sums over every column so far
    finished = tl.zeros([BLOCK_R, KP], ACC)  # the squared norms of the prefixes done
    exponent = tl.zeros([BLOCK_R], tl.int32)
    lo = D * 0
    for i in range(0, K):
        if HAS_DIMS:
            hi = tl.load(bounds_ptr + i + 1)
        else:
            hi = D
        for start in range(lo, hi, BLOCK_D):
            ks = (start + tl.arange(0, BLOCK_D)).to(tl.int64)
            ok = row_ok[:, None] & (ks < hi)[None, :]
            x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :] * stride_xd, mask=ok, other=0.0).to(ACC)
            if SCALE_ROWS:
                exponent, factor, row_scale = raise_exponent(exponent, tl.max(tl.abs(x), axis=1), ACC)
                squares = squares * (factor * factor)[:, None]
                finished = finished * (factor * factor)[:, None]
                x = x * row_scale[:, None]
            squares += x * x
        finished = tl.where(prefixes[None, :] == i, tl.sum(squares, axis=1)[:, None], finished)
        lo = hi
    row_scale = pow2(-exponent, ACC)
    clamped = tl.maximum(tl.sqrt(finished), scaled_eps(row_scale, EPS, ACC)[:, None])  # max(|x_s|, eps s)
    tl.store(norm_ptr + prefixes[None, :] * R + rows[:, None], clamped, mask=row_ok[:, None] & (prefixes < K)[None, :])
    tl.store(scale_ptr + rows, row_scale, mask=row_ok)


# ----------------------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------------------

# GPU candidates (see docs/triton-similarity.md, Blocks). Under the interpreter autotuning with more than one config
# fails, and one config sized to cover the (small) test problems in few programs is used instead.
# 16-bit operands run on tensor cores (wgmma). Compiled for sm_90 with triton 3.9 as launches specialise them
# (contiguous rows, D a multiple of 16: python -m angle_kernels.triton_ops._compile_check --full; stack bytes =
# spills): the full-width kernels use 119-186 / 181-240 / 198-255 registers (forward / dq / dc) in every config
# below, no spills, 36-74 KB of shared memory (BLOCK_K = 32 / 64); the prefix (dims) backward kernels spill up to
# 176 / 464 bytes in the BLOCK_K = 64 configs (the fp32 gradient chunk and the recomputed tile are live
# together); 128 x 128 spills far more. fp32 with input_precision="ieee" cannot use tensor cores (FMA dots hold
# both operands in registers): its backward kernels sit at 255 registers and spill up to 552 bytes (prefix: 848),
# so the exact-fp32 path is expected to be slow; bf16/fp16 is the training path. None of this is measured on a
# GPU yet: autotuning picks among these on the first call of each key (each op module's _TUNE_KEY).
_GPU_CONFIGS_16BIT = [
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 32}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 128, "BLOCK_K": 64}, num_warps=8, num_stages=3),
    triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 64}, num_warps=8, num_stages=3),
]
_GPU_CONFIGS_32BIT = [
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 16}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "BLOCK_K": 32}, num_warps=4, num_stages=2),
    triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32}, num_warps=8, num_stages=2),
]


def _autotune_bucket(rows: int) -> int:
    """The autotune key of a row count: its next power of two (513 .. 1024 all give 1024)."""
    return triton.next_power_of_2(max(rows, 1))


def autotuned(tile_kernels: tuple, key: list, tunings: dict | None = None) -> dict:
    """The tile kernels as `TunedKernel`s autotuned on `key` over the configs of each operand class ("16bit":
    tensor cores, "32bit": fp32/fp64 dots), each with its launch's `Tuning` from `tunings` (kernel -> Tuning;
    none declared: the kernel writes every output element without reading it first)."""
    tunings = tunings or {}
    return {name: tuple(_common.tuned_kernel(k, configs, key, tunings.get(k, Tuning()), triton_interpreting())
                        for k in tile_kernels)
            for name, configs in (("16bit", _GPU_CONFIGS_16BIT), ("32bit", _GPU_CONFIGS_32BIT))}


def kernels_for(tuned: dict, dtype: torch.dtype) -> tuple:
    """(forward, dq, dc) `TunedKernel`s of `autotuned` for inputs of `dtype`: those tuned over the configs that
    suit its dots."""
    return tuned["16bit" if dtype in (torch.bfloat16, torch.float16) else "32bit"]


def _interpreter_blocks(m: int, mc: int, d: int) -> dict:
    def fit(n: int, cap: int) -> int:
        return max(16, min(cap, triton.next_power_of_2(max(n, 1))))

    return dict(BLOCK_M=fit(m, 64), BLOCK_N=fit(mc, 64), BLOCK_K=fit(d, 256))


def _operand_dtype(dtype: torch.dtype):
    """The dtype tiles are converted to before tl.dot (see docs/triton-similarity.md, Precision)."""
    if dtype == torch.float64:
        return tl.float64
    if dtype == torch.float32:
        return tl.float32
    if dtype == torch.bfloat16:
        return tl.float32 if triton_interpreting() else tl.bfloat16
    return tl.float16


def _dot_precision(dtype: torch.dtype) -> str:
    if dtype == torch.float32 and os.environ.get(_TF32_ENV, "0") not in ("", "0") and not triton_interpreting():
        return "tf32"
    return "ieee"


def _tile_launch(kernel: TunedKernel, grid_of, blocks, *args, **constexprs):
    """Launch a tile kernel: autotuned on a GPU, with `blocks` under the interpreter (see TunedKernel.launch)."""
    kernel.launch(grid_of, blocks, *args, **constexprs)


# The row-norm kernel's blocks: a few whole rows per program on a GPU (bandwidth-bound, one read of the rows); few
# programs under the interpreter.
_GPU_NORM_BLOCKS = dict(BLOCK_R=4, BLOCK_D=512, num_warps=4)


def _row_norms(x: torch.Tensor, dtype: torch.dtype, bounds: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(norms, scales) of x's rows in one read (`_row_norms_kernel`): the clamped norms max(|x_s|, eps s) of the
    scaled rows [R], or with `bounds` ([K + 1] int32: 0, d_1, ..., d_K) of every prefix x_s[:, :d_i], [K, R]; and
    each row's scale [R] (a power of two, 1 for ordinary rows; 1 for every float16 row, whose products cannot
    overflow)."""
    rows, width = x.shape
    k = 1 if bounds is None else bounds.shape[0] - 1
    norms = new_output((rows,) if bounds is None else (k, rows), dtype, x.device)
    scales = new_output((rows,), dtype, x.device)
    if triton_interpreting():
        blocks = dict(BLOCK_R=max(1, min(64, triton.next_power_of_2(rows))), num_warps=4,
                      BLOCK_D=max(16, min(256, triton.next_power_of_2(width))))
    else:
        blocks = dict(_GPU_NORM_BLOCKS,
                      BLOCK_D=max(16, min(_GPU_NORM_BLOCKS["BLOCK_D"], triton.next_power_of_2(width))))
    _row_norms_kernel[(triton.cdiv(rows, blocks["BLOCK_R"]),)](
        x, norms, scales, norms if bounds is None else bounds, rows, width, k, x.stride(0), x.stride(1),
        SCALE_ROWS=x.dtype != torch.float16, HAS_DIMS=bounds is not None,
        ACC=tl.float64 if dtype == torch.float64 else tl.float32, EPS=NORM_EPS, KP=triton.next_power_of_2(k),
        **blocks)
    return norms, scales


def any_scaled(*scales: torch.Tensor) -> torch.Tensor:
    """[1] int32 on the scales' device: 1 when any row scale differs from 1, the `scaled` flag of the tile kernels'
    K-loops (_add_dots). No host sync."""
    return torch.stack([(s != 1).any() for s in scales]).any().to(torch.int32).reshape(1)


def gradient_tile_scale(per_row: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(coef, unscale): the gradient tiles' per-row factors, per_row / max|per_row| (at most 1 in magnitude), and
    the factor they leave out, max|per_row| / rows ([1], compute dtype), which the finish kernels apply.

    Why: the backward rounds each gradient tile to the operand dtype before its products. With the upstream
    gradient and 1/M inside, an fp16 tile's entries (about scale * p_ij * g / M) fall below fp16's smallest
    subnormal (6e-8) at training sizes (M = 131,072: ~1e-9) and flush to zero; scaled to at most scale, they stay
    in range whatever M and the upstream gradient are, and the factor is applied in the compute dtype. No host
    sync: both stay on the device."""
    largest = per_row.abs().amax().clamp_min(torch.finfo(per_row.dtype).tiny)
    return (per_row / largest).contiguous(), (largest / rows).reshape(1)
