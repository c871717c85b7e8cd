"""Softmax cross-entropy over cosine similarities, flash-style: never the M x Mc matrix.

Computes the contract's similarity_xent (angle_kernels/dispatch.py) with fused kernels; for wide embeddings
`similarity_xent` (the launcher, at the end) hands the full-width loss to the dense scheme of
similarity_xent_dense.py instead (cuBLAS products, 6 M Mc D FLOPs), which reuses this file's tile helpers. The
loss: in-batch negatives (c = q, diagonal excluded, partner targets, zero-weighted rows without a target,
identical texts as extra positives via group_ids), the contrastive loss with negatives (rectangular q/c,
diagonal targets) and ArcCon (diagonal targets with an additive angular margin on the target logit):

    l_ij  = scale * cos(q_i, c_j)          (target column: scale * cos(min(theta + margin, pi)))
    loss  = (1/M) sum_i w_i * (logsumexp_{j in C_i} l_ij - logsumexp_{j in P_i} l_ij)

Forward (`_similarity_xent_fwd_kernel`): one program per BLOCK_M rows walks all BLOCK_N column blocks; each
tile of raw dot products is a K-loop of tl.dot over D (any D: the rows never sit in registers whole), is
scaled by the per-row and per-column inverse norms into cosines, and feeds an online (running-max)
logsumexp per row, plus a second one over the positives when group_ids is given (without group_ids the
positive logsumexp is just the target logit, picked out of its tile). It stores two numbers per row.

Backward recomputes each tile and forms dL/dcos_ij = w_i g / M * scale * (softmax_C_ij - softmax_P_ij)
(times the margin's slope on the target column). With c_hat = c / |c|:

    dq_i = inv_q_i * sum_j G_ij inv_c_j c_j  -  [|q_i| > eps] inv_q_i^2 (sum_j G_ij cos_ij) q_i

and the mirror image for dc. Two kernels, no atomics: `_similarity_xent_bwd_dq_kernel` owns a row block
and walks the columns, `_similarity_xent_bwd_dc_kernel` owns a column block and walks the rows (each
recomputes the tiles). Why not one kernel with atomics (flash-attention 2 style)? Its atomics would add a
[BLOCK, D] fp32 update per tile into the other side's gradient: M/BLOCK_M * Mc * D fp32 atomic adds (25 G
for M = Mc = 64k, D = 768), non-deterministic and bound by the L2's atomic throughput; the second kernel
costs one extra tile recomputation (2 M Mc D FLOPs on tensor cores) instead. Because D can be thousands,
the [BLOCK, D] gradient accumulator does not fit in registers: each program adds its tile's contribution
into its own rows of a fp32 [M, D] buffer, chunk by chunk over D (read-modify-write, exclusive to the
program, a barrier between column blocks). The normalisation's backward (the radial term above and the
inv_q scaling) is applied once at the end by `_similarity_xent_bwd_finish_kernel`, which also adds the two
halves of the symmetric case.

The floor. FLOPs: forward 2 M Mc D; backward 2 x (2 M Mc D recompute + 2 M Mc D gradient) = 8 M Mc D
(the nominal work of the loss is 2 M Mc D forward + 4 M Mc D backward: the two recomputations are the price
of O(M) memory). In-batch negatives with N = 65536 pairs (M = Mc = 131072), D = 768: 2.6e13 forward + 1.1e14
backward FLOPs, 0.17 s at 790 TFLOP/s bf16. Bytes: the inputs are re-read once per row/column block pass
(mostly from L2), plus the gradient buffers' read-modify-write: M*D*8 bytes per column block, against
4 BLOCK_M BLOCK_N D FLOPs, i.e. BLOCK_N / 2 = 32 FLOPs per byte at BLOCK_N = 64. That is below the H200's
ratio (about 165 FLOPs per byte of HBM, 50-70 from L2), so the backward is likely bound by this traffic
rather than by the tensor cores: one program's buffer rows are BLOCK_M x D x 4 bytes (384 KB at D = 768,
about the L2 for 132 programs; 2 MB at D = 4096, HBM). The known fix, not done here because it needs a GPU
to tune, is to compute the gradient tiles of several column blocks into shared memory and apply them in one
wider dot (BLOCK_N / 2 -> several hundred FLOPs per byte). The tile math (exp, selects) is O(M Mc), about
D/4 times fewer operations than the dots.

Nested prefixes (dims = (d_1 < ... < d_K), one loss per prefix q[:, :d_i], c[:, :d_i]; the `_prefix_` kernels).
Within a column block the K-loop over D runs slice by slice, s_i = [d_{i-1}, d_i), into one live dot tile; at
the end of slice i that tile holds prefix i's dot products, which (with prefix i's inverse norms, [K, M] from
running sums of the slices' squared norms) feed prefix i's online logsumexps: the row states are [BLOCK_M, KP]
(KP = K rounded up to a power of two) and prefix i updates their column i. So the embeddings are read once for
all prefixes and the tensor-core work is the full-width loss's. The widths are runtime values (a [K + 1] int32
tensor of bounds, K a runtime loop bound): a new dims tuple compiles nothing unless its KP is new, because a
constexpr per width would compile (and autotune) every tuple a user tries, for no gain: the slice loops are
masked K-loops like the full-width one, each costing at most one partial chunk. Backward, in the same kernels'
layout: at each boundary, prefix i's gradient tile G_i (dL_i/dcos) and its radial sum (k numbers per row,
[K, M]), then G_i @ (c_hat_i[:, :d_i]), scaled per row by inv_q_i on the fp32 product (a zero prefix's 1/eps
never enters a 16-bit operand), added into the leading d_i columns of a zeroed fp32 buffer; one finish kernel
subtracts every prefix's radial term. One gradient tile is live at a time, so registers stay those of the
full-width kernels (plus the [BLOCK, KP] states). Its cost: the gradient products run over each prefix's
whole width, 2 M Mc (d_1 + ... + d_K) FLOPs per backward kernel instead of 2 M Mc D; for the usual halving
dims (64, 128, 256, 512, 768) that is 2.25x the full-width loss's gradient products. The alternative, one
product per slice with the suffix sums sum_{i >= j} Ghat_i (what the torch backend does), needs the K
gradient tiles of a block at once, with the inverse norms inside the 16-bit operand: K tiles of registers or a
scratch buffer, and the fp16 overflow above. The radial sums use the rounded 16-bit gradient tile the products
use: a short prefix's gradient is nearly all radial (a width of 1 has none), and only the same g on both sides
cancels it (with the fp32 tile instead, fp16 inputs missed the half rule by 4x at width 1).

The floor with dims: forward 2 M Mc D FLOPs and the full-width bytes, plus K elementwise passes over each tile
(the exp of K logsumexps: K times the full-width tile math, still O(M Mc K) against O(M Mc D)); backward
2 x (2 M Mc D recompute + 2 M Mc sum_i d_i gradient) FLOPs, and the gradient buffers' read-modify-write grows
in the same ratio sum_i d_i / D. Compiled for sm_90 as a launch specialises it (bf16, KP = 4, the first config;
contiguous rows, D a multiple of 16): forward 185 registers, dq 250, dc 255, no spill (other configs: see
_GPU_CONFIGS_16BIT). Not timed on a GPU.

Huge rows. Finite rows can have squared norms and dot products beyond the accumulator (float32/bf16 rows around
1.8e19, float64 around 1.3e154); cosines are invariant under a positive scaling of either row, so the kernels work
on rows scaled by a power of two each (_common's row scaling: 1 for rows whose largest magnitude is below 2, which
compute bit for bit as before; none for float16, whose products cannot overflow fp32). The pass that already read
every row for its norms (`_row_norms_kernel`, one read of q and of c) finds the scales online and stores the
clamped norms of the scaled rows, max(|x_s|, eps s), and the scales. The tiles are dot products of the scaled rows:
when any scale differs from 1 (a flag on the device, computed without a host sync), the K-loops multiply each
loaded chunk by its rows' scales in the operand dtype (exact), one multiply per loaded element against BLOCK_N
(BLOCK_M) multiply-adds of the tile that use it; otherwise they run the plain loop, as before. The gradient
products take x_hat = x * s / max(|x_s|, eps s) (exact to rounding while |x| < ~2^125 in fp32), and the finish
kernels apply dL/dx = s dL/dx_s on the scaled rows: s * (inv_s raw - inv_s^2 radial x_s). Registers, sm_90 bf16
(first config): forward 182, dq 190-194, dc 248, no spills (174, 183, 255 before); the prefix forward 255 with an
8-byte spill (185, none, before: the scaled K-loop nested in the prefix loop is what takes them), its backward
236-242. fp32 variants spilled before and still do.

Blocks for an H200 (autotuned among a few configs when not interpreting; see _GPU_CONFIGS_*): for bf16,
BLOCK_M = 128 rows (two 64-row wgmma warpgroups with 8 warps), BLOCK_N = 64 columns, BLOCK_K = 32, 3
pipeline stages: 36-41 KB of shared memory; at 174-255 registers x 256 threads a program holds most of an
SM's 64K registers, so one program runs per SM and the pipeline stages hide the load latency. Larger tiles
spill (read from the sm_90 compile: `python -m angle_kernels.triton_ops._compile_check --full`). The tuning
runs once per dtype, flags, D and power-of-two bucket of M and of Mc (_TUNE_KEY), not once per shape: a new
batch size re-tunes only when it enters a new bucket, and compiles nothing (_BATCH_SIZE_ARGS).

Precision. Dots accumulate in fp32 (fp64 for fp64 inputs). bf16/fp16 inputs feed tl.dot natively on a GPU
(tensor cores, fp32 accumulation) and the backward's softmax-gradient tile is rounded to the input dtype for
its dot, as flash attention does; the tile carries w_i g / max|w g| (at most scale in magnitude), not w_i g / M,
and the finish kernels apply max|w g| / M in the compute dtype, so an fp16 tile does not flush to zero at large M
(`gradient_tile_scale`). Under the Triton interpreter, bf16 tl.dot and bf16 arithmetic are
silently wrong (it multiplies raw bits), so the operand dtype is a constexpr (OPERAND) and interpreter runs
convert bf16 tiles to fp32 right after loading. fp32 dots use input_precision="ieee" (exact fp32); TF32 is
used only when ANGLE_KERNELS_ALLOW_TF32=1 is set.
"""

from __future__ import annotations

import math
import os

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ..contract import MARGIN_SIN_SQUARED_FLOOR, NORM_EPS, compute_dtype
from ..dispatch import triton_interpreting
from . import _common
from ._common import CompileCase, Tuning, TunedKernel, new_output, pow2, raise_exponent, scaled_eps

_TF32_ENV = "ANGLE_KERNELS_ALLOW_TF32"
FEATURES = ("dims",)  # the contract's optional features this op implements (contract.OPTIONAL_FEATURES)
# The code paths a call can take, each verified on GPUs on its own (angle_kernels.verified): the fused kernels of
# this file at full width, the dense scheme (similarity_xent_dense), the fused prefix kernels (dims).
PATHS = ("fused", "dense", "dims")


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

_TILE_KERNELS = (_similarity_xent_fwd_kernel, _similarity_xent_bwd_dq_kernel, _similarity_xent_bwd_dc_kernel)

# GPU candidates (see the module docstring). Under the interpreter autotuning with more than one config
# fails, and one config sized to cover the (small) test problems in few programs is used instead.
# 16-bit operands run on tensor cores (wgmma). Compiled for sm_90 with triton 3.9 as launches specialise them
# (contiguous rows, D a multiple of 16: python -m angle_kernels.triton_ops._compile_check --full; stack bytes =
# spills): the full-width kernels use 119-186 / 181-240 / 198-255 registers (forward / dq / dc) in every config
# below, no spills, 36-74 KB of shared memory (BLOCK_K = 32 / 64); the prefix (dims) backward kernels spill up to
# 176 / 464 bytes in the BLOCK_K = 64 configs (the fp32 gradient chunk and the recomputed tile are live
# together); 128 x 128 spills far more. fp32 with input_precision="ieee" cannot use tensor cores (FMA dots hold
# both operands in registers): its backward kernels sit at 255 registers and spill up to 552 bytes (prefix: 848),
# so the exact-fp32 path is expected to be slow; bf16/fp16 is the training path. None of this is measured on a
# GPU yet: autotuning picks among these on the first call of each key (see _TUNE_KEY).
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
# Autotuning benchmarks every config (several compiles and timed runs, minutes at large sizes) for each new
# key. Keying on the exact row counts would redo that for every batch size a training run meets (the last
# batch of an epoch, filtered pairs), so the key holds their power-of-two buckets (M_BUCKET, Mc_BUCKET; the
# assumption, not yet measured, is that the best tile changes little within a factor of two); D is the model's
# width and stays exact. The constexpr flags are in the key because each compiles a different kernel (TF32
# against exact fp32 dots above all): a config tuned for one variant says little about another. Triton adds
# the tensor arguments' dtypes to the key itself.
_TUNE_KEY = ["M_BUCKET", "Mc_BUCKET", "D", "PARTNER_TARGET", "EXCLUDE_DIAGONAL", "HAS_GROUPS", "HAS_MARGIN",
             "PRECISION"]


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


def _interpreter_blocks(m: int, mc: int, d: int) -> dict:
    def fit(n: int, cap: int) -> int:
        return max(16, min(cap, triton.next_power_of_2(max(n, 1))))

    return dict(BLOCK_M=fit(m, 64), BLOCK_N=fit(mc, 64), BLOCK_K=fit(d, 256))


def _operand_dtype(dtype: torch.dtype):
    """The dtype tiles are converted to before tl.dot (see Precision in the module docstring)."""
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


# ----------------------------------------------------------------------------------------------------------
# Autograd function and launcher
# ----------------------------------------------------------------------------------------------------------


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
    from . import similarity_xent_dense  # imported here: that module builds on this one's tile helpers

    if dims is not None:
        return "dims"
    columns = q.shape[0] if c is None else c.shape[0]
    return "dense" if similarity_xent_dense.takes(q.shape[1], columns, dims) else "fused"


def similarity_xent(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0, group_ids=None,
                    dims=None):
    """Softmax cross-entropy over cosine similarities, by the fused kernels above or, for wide embeddings, by the
    dense scheme (code_path); see angle_kernels.dispatch."""
    from . import similarity_xent_dense

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
