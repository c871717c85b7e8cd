"""Per-row log partition functions of cosine logits with exclusions, hardness and filters: never M x Mc.

Computes the contract's similarity_lse (angle_kernels.dispatch.similarity_lse), the building block of the
in-batch-negative family. Row i's target column is t_i = target_offset + i (possibly >= Mc: then no column is), its
own columns are the j with j % period == t_i (only j == t_i when period == 0), and

    l_ij  = scale * cos(q_i, c_j) + penalty * sg(cos(q_i, c_j)) * H_ij        (sg: stop-gradient)
    lse_i = logsumexp_{j in K_i} l_ij                                           (-inf when K_i is empty)

The hardness set H (penalty_on) and the kept columns K_i (exclude, the filter) are functions of (i, j) computed in
the tile from indices and the filter's own dot tile, so the kernels keep per-row state only.

Forward (`_similarity_lse_fwd_kernel`): one program per BLOCK_M rows walks all BLOCK_N column blocks. Per tile, with
a filter, its dot tile over D' (the filter's own width and dtype) becomes a drop mask; then the dot tile over D,
scaled by the inverse norms into cosines, becomes the masked logits, folded into an online logsumexp per row. It
stores lse [M].

Backward. With G_ij = grad_lse_i * scale * exp(l_ij - lse_i) on the kept columns (0 elsewhere and on rows whose lse
is -inf; the penalty carries no gradient), the normalisation's backward is similarity_xent's:

    dq_i = inv_q_i * sum_j G_ij inv_c_j c_j  -  [|q_i| > eps] inv_q_i^2 (sum_j G_ij cos_ij) q_i

and its mirror image for dc. `_similarity_lse_bwd_dq_kernel` owns a row block and walks the columns,
`_similarity_lse_bwd_dc_kernel` owns a column block and walks the rows, each recomputing the tiles (the filter's
included) and adding G @ x_hat into its own rows of a fp32 (fp64) buffer; the tile library's finish kernel then
applies the normalisation's backward once per row. A side that needs no gradient skips its kernel; normalize=False
runs the same kernels with norms of one and no finish kernel.

The floor. FLOPs: forward 2 M Mc D, plus 2 M Mc D' for the filter; backward 8 M Mc D + 4 M Mc D' against a nominal
4 M Mc D (the recomputations are the price of O(M + Mc) memory). Bytes: the inputs once, (M + Mc)(D + D')
elements, and 4 M bytes of lse; the backward's gradient buffers cost a read-modify-write per block pass, BLOCK_N / 2
FLOPs per byte (likely its bound on an H100/H200).

Tiles, blocks, autotuning, precision and huge rows are the family's (_similarity_tiles.py); the tune key, the
filter's forward/backward caveat and a worked example of the floor: docs/triton-similarity.md.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ..contract import NORM_EPS, compute_dtype
from ._common import CompileCase, acc_dtype_of, new_output
from ._similarity_tiles import (
    _GPU_CONFIGS_16BIT,
    _GPU_CONFIGS_32BIT,
    _accumulate_grad_tile,
    _autotune_bucket,
    _dot_precision,
    _dot_tile,
    _interpreter_blocks,
    _inverse_norms,
    _online_lse_update,
    _operand_dtype,
    _row_norms,
    _similarity_xent_bwd_finish_kernel,
    _tile_launch,
    any_scaled,
    autotuned,
    gradient_tile_scale,
    kernels_for,
)

PATHS = ("fused",)  # the one code path, verified on GPUs on its own (angle_kernels.verified)

# ----------------------------------------------------------------------------------------------------------
# Tile helpers (inlined into the kernels)
# ----------------------------------------------------------------------------------------------------------


@triton.jit
def _lse_row_state(q_norm_ptr, q_scale_ptr, fq_norm_ptr, fq_scale_ptr, threshold_ptr, rows, M, Mc, target_offset,
                   HAS_FILTER: tl.constexpr, EPS: tl.constexpr, ACC: tl.constexpr, FILTER_ACC: tl.constexpr):
    """Per-row (valid, inverse norms of the scaled and of the raw row (_similarity_tiles._inverse_norms), target
    column, the filter's inverse norm (of its scaled row) and threshold).

    The target columns are int32 (the masks are index compares on [BLOCK_M, BLOCK_N] tiles: half the registers
    of int64), clamped to Mc: any t_i >= Mc names no column, and neither a column j < Mc nor j % period can
    equal Mc."""
    row_ok = rows < M
    inv_q, unit_q = _inverse_norms(q_norm_ptr, q_scale_ptr, rows, row_ok, EPS, ACC)
    targets = tl.minimum(rows + target_offset, Mc).to(tl.int32)
    if HAS_FILTER:
        inv_fq, _unit_fq = _inverse_norms(fq_norm_ptr, fq_scale_ptr, rows, row_ok, EPS, FILTER_ACC)
        threshold = tl.load(threshold_ptr + rows, mask=row_ok, other=0.0)
    else:  # unused
        inv_fq = inv_q
        threshold = inv_q
    return row_ok, inv_q, unit_q, targets, inv_fq, threshold


@triton.jit
def _lse_logits_tile(
    q_ptr, c_ptr, c_norm_ptr, fq_ptr, fc_ptr, fc_norm_ptr, q_scale_ptr, c_scale_ptr, fq_scale_ptr, fc_scale_ptr,
    scaled, rows, cols, row_ok, col_ok, inv_q, targets, inv_fq, threshold,
    D, DF, period, scale, penalty,
    stride_qm, stride_qd, stride_cm, stride_cd, stride_fqm, stride_fqd, stride_fcm, stride_fcd,
    EXCLUDE: tl.constexpr, PENALTY_ON: tl.constexpr, PERIODIC: tl.constexpr, HAS_FILTER: tl.constexpr,
    FILTER_KEEPS_TARGET: tl.constexpr, ACC: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr,
    FILTER_ACC: tl.constexpr, FILTER_OPERAND: tl.constexpr, FILTER_PRECISION: tl.constexpr, EPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """(cos, unit_c, logits): the tile's cosines, its raw columns' inverse norms (unit columns), and l_ij on the
    kept columns K_i, -inf elsewhere (padding rows and columns included). The dots are those of the scaled rows
    (_similarity_tiles._add_dots; `scaled`: whether any scale is not 1).

    Order for registers: the filter's tile is reduced to one mask before the main dot tile is computed, and the
    index masks are formed after it, so that one [BLOCK_M, BLOCK_N] mask at most is live across a K-loop."""
    if HAS_FILTER:
        filter_dots = _dot_tile(fq_ptr, fc_ptr, rows, cols, row_ok, col_ok, DF, stride_fqm, stride_fqd,
                                stride_fcm, stride_fcd, fq_scale_ptr, fc_scale_ptr, scaled, FILTER_ACC,
                                FILTER_OPERAND, FILTER_PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
        inv_fc, _unit_fc = _inverse_norms(fc_norm_ptr, fc_scale_ptr, cols, col_ok, EPS, FILTER_ACC)
        dropped = filter_dots * inv_fq[:, None] * inv_fc[None, :] > threshold[:, None]
        if FILTER_KEEPS_TARGET:
            dropped = dropped & (cols.to(tl.int32)[None, :] != targets[:, None])

    dots = _dot_tile(q_ptr, c_ptr, rows, cols, row_ok, col_ok, D, stride_qm, stride_qd, stride_cm, stride_cd,
                     q_scale_ptr, c_scale_ptr, scaled, ACC, OPERAND, PRECISION, BLOCK_M, BLOCK_N, BLOCK_K)
    inv_c, unit_c = _inverse_norms(c_norm_ptr, c_scale_ptr, cols, col_ok, EPS, ACC)
    cos = dots * inv_q[:, None] * inv_c[None, :]

    col_index = cols.to(tl.int32)
    is_target = col_index[None, :] == targets[:, None]
    if PERIODIC:
        own = (col_index % period)[None, :] == targets[:, None]
    else:
        own = is_target
    kept = row_ok[:, None] & col_ok[None, :]
    if EXCLUDE == "target":
        kept = kept & ~is_target
    elif EXCLUDE == "own":
        kept = kept & ~own
    if HAS_FILTER:
        kept = kept & ~dropped
    logits = cos * scale
    if PENALTY_ON != "none":
        if PENALTY_ON == "other":
            hard = ~own
        elif PENALTY_ON == "own":
            hard = own & ~is_target
        else:  # "all"
            hard = ~is_target
        logits = tl.where(hard, logits + penalty * cos, logits)
    return cos, unit_c, tl.where(kept, logits, float("-inf"))


# ----------------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------------

# Integer arguments that change from call to call (batch sizes, a rank's target offset, the period): Triton
# would specialise them on their value (== 1, divisible by 16) and compile a variant per case; they only bound
# loops and feed masks, so they are not specialised, and a new batch size compiles nothing.
_RUNTIME_INT_ARGS = ("M", "Mc", "M_BUCKET", "Mc_BUCKET", "target_offset", "period")


@triton.jit(do_not_specialize=_RUNTIME_INT_ARGS)
def _similarity_lse_fwd_kernel(
    q_ptr, c_ptr, q_norm_ptr, c_norm_ptr,  # norms of the scaled rows
    fq_ptr, fc_ptr, fq_norm_ptr, fc_norm_ptr, threshold_ptr,  # the filter's (placeholders without one)
    q_scale_ptr, c_scale_ptr, fq_scale_ptr, fc_scale_ptr,  # the rows' scales (powers of two)
    scaled_ptr,  # [1] int32: whether any scale is not 1 (_similarity_tiles._add_dots)
    lse_ptr,  # [M] out, compute dtype
    M, Mc, D, DF, target_offset, period,
    M_BUCKET, Mc_BUCKET,  # autotune keys only (next powers of two of M and Mc), unused in the body
    stride_qm, stride_qd, stride_cm, stride_cd, stride_fqm, stride_fqd, stride_fcm, stride_fcd,
    params_ptr,  # [2] in the compute dtype: scale, penalty
    EXCLUDE: tl.constexpr, PENALTY_ON: tl.constexpr, PERIODIC: tl.constexpr, HAS_FILTER: tl.constexpr,
    FILTER_KEEPS_TARGET: tl.constexpr, ACC: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr,
    FILTER_ACC: tl.constexpr, FILTER_OPERAND: tl.constexpr, FILTER_PRECISION: tl.constexpr, EPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    # Scalars come through memory, not as arguments: Triton passes Python floats as fp32.
    scale = tl.load(params_ptr)
    penalty = tl.load(params_ptr + 1)
    scaled = tl.load(scaled_ptr) != 0
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok, inv_q, unit_q, targets, inv_fq, threshold = _lse_row_state(
        q_norm_ptr, q_scale_ptr, fq_norm_ptr, fq_scale_ptr, threshold_ptr, rows, M, Mc, target_offset, HAS_FILTER,
        EPS, ACC, FILTER_ACC)

    running_max = tl.full([BLOCK_M], float("-inf"), ACC)
    running_sum = tl.zeros([BLOCK_M], ACC)
    for col_start in range(0, Mc, BLOCK_N):
        cols = (col_start + tl.arange(0, BLOCK_N)).to(tl.int64)
        col_ok = cols < Mc
        cos, unit_c, logits = _lse_logits_tile(
            q_ptr, c_ptr, c_norm_ptr, fq_ptr, fc_ptr, fc_norm_ptr, q_scale_ptr, c_scale_ptr, fq_scale_ptr,
            fc_scale_ptr, scaled, rows, cols, row_ok, col_ok, inv_q, targets,
            inv_fq, threshold, D, DF, period, scale, penalty, stride_qm, stride_qd, stride_cm, stride_cd,
            stride_fqm, stride_fqd, stride_fcm, stride_fcd, EXCLUDE, PENALTY_ON, PERIODIC, HAS_FILTER,
            FILTER_KEEPS_TARGET, ACC, OPERAND, PRECISION, FILTER_ACC, FILTER_OPERAND, FILTER_PRECISION, EPS,
            BLOCK_M, BLOCK_N, BLOCK_K)
        running_max, running_sum = _online_lse_update(running_max, running_sum, logits)

    # A row with no kept column has max -inf and sum 0: its lse is -inf (written out: -inf + log(0) would be
    # too, but the intent is clearer). Otherwise sum >= 1.
    empty = running_max == float("-inf")
    lse = tl.where(empty, float("-inf"), running_max + tl.log(tl.where(empty, 1.0, running_sum)))
    tl.store(lse_ptr + rows, lse, mask=row_ok)


@triton.jit
def _grad_logits_tile(logits, lse, coef, scale):
    """G_ij = grad_lse_i * scale * exp(l_ij - lse_i): 0 off K_i (logits -inf) and on rows with lse = -inf (the
    launcher zeroes their coef, and lse is read as +inf there: exp(l - inf) = 0 for every logit, so no 0 * inf = NaN
    can arise even if backward kept a column forward dropped)."""
    safe_lse = tl.where(lse == float("-inf"), float("inf"), lse)
    return (coef * scale)[:, None] * tl.exp(logits - safe_lse[:, None])


@triton.jit(do_not_specialize=_RUNTIME_INT_ARGS)
def _similarity_lse_bwd_dq_kernel(
    q_ptr, c_ptr, q_norm_ptr, c_norm_ptr,  # norms of the scaled rows
    fq_ptr, fc_ptr, fq_norm_ptr, fc_norm_ptr, threshold_ptr,
    q_scale_ptr, c_scale_ptr, fq_scale_ptr, fc_scale_ptr,  # the rows' scales (powers of two)
    scaled_ptr,  # [1] int32: whether any scale is not 1 (_similarity_tiles._add_dots)
    lse_ptr, coef_ptr,  # [M]: the forward's lse; grad_lse, 0 where lse = -inf
    dq_raw_ptr,  # [M, D] fp32/fp64 out: sum_j G_ij inv_c_j c_j
    dq_radial_ptr,  # [M] out: sum_j G_ij cos_ij
    M, Mc, D, DF, target_offset, period,
    M_BUCKET, Mc_BUCKET,  # autotune keys only (next powers of two of M and Mc), unused in the body
    stride_qm, stride_qd, stride_cm, stride_cd, stride_fqm, stride_fqd, stride_fcm, stride_fcd,
    params_ptr,  # [2] in the compute dtype: scale, penalty
    EXCLUDE: tl.constexpr, PENALTY_ON: tl.constexpr, PERIODIC: tl.constexpr, HAS_FILTER: tl.constexpr,
    FILTER_KEEPS_TARGET: tl.constexpr, ACC: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr,
    FILTER_ACC: tl.constexpr, FILTER_OPERAND: tl.constexpr, FILTER_PRECISION: tl.constexpr, EPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    scale = tl.load(params_ptr)
    penalty = tl.load(params_ptr + 1)
    scaled = tl.load(scaled_ptr) != 0
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok, inv_q, unit_q, targets, inv_fq, threshold = _lse_row_state(
        q_norm_ptr, q_scale_ptr, fq_norm_ptr, fq_scale_ptr, threshold_ptr, rows, M, Mc, target_offset, HAS_FILTER,
        EPS, ACC, FILTER_ACC)
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    coef = tl.load(coef_ptr + rows, mask=row_ok, other=0.0)

    radial = tl.zeros([BLOCK_M], ACC)
    for col_start in range(0, Mc, BLOCK_N):
        cols = (col_start + tl.arange(0, BLOCK_N)).to(tl.int64)
        col_ok = cols < Mc
        cos, unit_c, logits = _lse_logits_tile(
            q_ptr, c_ptr, c_norm_ptr, fq_ptr, fc_ptr, fc_norm_ptr, q_scale_ptr, c_scale_ptr, fq_scale_ptr,
            fc_scale_ptr, scaled, rows, cols, row_ok, col_ok, inv_q, targets,
            inv_fq, threshold, D, DF, period, scale, penalty, stride_qm, stride_qd, stride_cm, stride_cd,
            stride_fqm, stride_fqd, stride_fcm, stride_fcd, EXCLUDE, PENALTY_ON, PERIODIC, HAS_FILTER,
            FILTER_KEEPS_TARGET, ACC, OPERAND, PRECISION, FILTER_ACC, FILTER_OPERAND, FILTER_PRECISION, EPS,
            BLOCK_M, BLOCK_N, BLOCK_K)
        g = _grad_logits_tile(logits, lse, coef, scale)
        g = g.to(OPERAND)  # the radial sum takes the rounded tile the products take (as the prefix kernels)
        radial += tl.sum(g.to(ACC) * cos, axis=1)
        _accumulate_grad_tile(g, c_ptr, cols, col_ok, unit_c, dq_raw_ptr, rows, row_ok, col_start > 0,
                              D, stride_cm, stride_cd, ACC, OPERAND, PRECISION, BLOCK_K)
    tl.store(dq_radial_ptr + rows, radial, mask=row_ok)


@triton.jit(do_not_specialize=_RUNTIME_INT_ARGS)
def _similarity_lse_bwd_dc_kernel(
    q_ptr, c_ptr, q_norm_ptr, c_norm_ptr,  # norms of the scaled rows
    fq_ptr, fc_ptr, fq_norm_ptr, fc_norm_ptr, threshold_ptr,
    q_scale_ptr, c_scale_ptr, fq_scale_ptr, fc_scale_ptr,  # the rows' scales (powers of two)
    scaled_ptr,  # [1] int32: whether any scale is not 1 (_similarity_tiles._add_dots)
    lse_ptr, coef_ptr,  # [M]: the forward's lse; grad_lse, 0 where lse = -inf
    dc_raw_ptr,  # [Mc, D] fp32/fp64 out: sum_i G_ij inv_q_i q_i
    dc_radial_ptr,  # [Mc] out: sum_i G_ij cos_ij
    M, Mc, D, DF, target_offset, period,
    M_BUCKET, Mc_BUCKET,  # autotune keys only (next powers of two of M and Mc), unused in the body
    stride_qm, stride_qd, stride_cm, stride_cd, stride_fqm, stride_fqd, stride_fcm, stride_fcd,
    params_ptr,  # [2] in the compute dtype: scale, penalty
    EXCLUDE: tl.constexpr, PENALTY_ON: tl.constexpr, PERIODIC: tl.constexpr, HAS_FILTER: tl.constexpr,
    FILTER_KEEPS_TARGET: tl.constexpr, ACC: tl.constexpr, OPERAND: tl.constexpr, PRECISION: tl.constexpr,
    FILTER_ACC: tl.constexpr, FILTER_OPERAND: tl.constexpr, FILTER_PRECISION: tl.constexpr, EPS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    scale = tl.load(params_ptr)
    penalty = tl.load(params_ptr + 1)
    scaled = tl.load(scaled_ptr) != 0
    cols = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < Mc

    radial = tl.zeros([BLOCK_N], ACC)
    for row_start in range(0, M, BLOCK_M):
        rows = (row_start + tl.arange(0, BLOCK_M)).to(tl.int64)
        row_ok, inv_q, unit_q, targets, inv_fq, threshold = _lse_row_state(
            q_norm_ptr, q_scale_ptr, fq_norm_ptr, fq_scale_ptr, threshold_ptr, rows, M, Mc, target_offset,
            HAS_FILTER, EPS, ACC, FILTER_ACC)
        lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
        coef = tl.load(coef_ptr + rows, mask=row_ok, other=0.0)
        cos, unit_c, logits = _lse_logits_tile(
            q_ptr, c_ptr, c_norm_ptr, fq_ptr, fc_ptr, fc_norm_ptr, q_scale_ptr, c_scale_ptr, fq_scale_ptr,
            fc_scale_ptr, scaled, rows, cols, row_ok, col_ok, inv_q, targets,
            inv_fq, threshold, D, DF, period, scale, penalty, stride_qm, stride_qd, stride_cm, stride_cd,
            stride_fqm, stride_fqd, stride_fcm, stride_fcd, EXCLUDE, PENALTY_ON, PERIODIC, HAS_FILTER,
            FILTER_KEEPS_TARGET, ACC, OPERAND, PRECISION, FILTER_ACC, FILTER_OPERAND, FILTER_PRECISION, EPS,
            BLOCK_M, BLOCK_N, BLOCK_K)
        g = _grad_logits_tile(logits, lse, coef, scale)
        g = g.to(OPERAND)  # the radial sum takes the rounded tile the products take (as the prefix kernels)
        radial += tl.sum(g.to(ACC) * cos, axis=0)
        _accumulate_grad_tile(tl.trans(g), q_ptr, rows, row_ok, unit_q, dc_raw_ptr, cols, col_ok,
                              row_start > 0, D, stride_qm, stride_qd, ACC, OPERAND, PRECISION, BLOCK_K)
    tl.store(dc_radial_ptr + cols, radial, mask=col_ok)


# ----------------------------------------------------------------------------------------------------------
# Launch configuration
# ----------------------------------------------------------------------------------------------------------

_TILE_KERNELS = (_similarity_lse_fwd_kernel, _similarity_lse_bwd_dq_kernel, _similarity_lse_bwd_dc_kernel)
# The tile library's configs and bucketing (_similarity_tiles; see similarity_xent._TUNE_KEY); the key names the
# flags that change the work per tile.
_TUNE_KEY = ["M_BUCKET", "Mc_BUCKET", "D", "DF", "PENALTY_ON", "HAS_FILTER", "PRECISION", "FILTER_PRECISION"]

_TUNED = autotuned(_TILE_KERNELS, _TUNE_KEY)


def _filter_operand(fq_dtype: torch.dtype, fc_dtype: torch.dtype):
    """The filter dots' operand dtype: the inputs' own (tensor cores for 16-bit), or filter_q's compute dtype
    when filter_q and filter_c differ in dtype (both are converted to it after loading)."""
    if fq_dtype == fc_dtype:
        return _operand_dtype(fq_dtype)
    return acc_dtype_of(fq_dtype)


# ----------------------------------------------------------------------------------------------------------
# Autograd function and launcher
# ----------------------------------------------------------------------------------------------------------


def _unit_norms(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Norms and scales of one for every row: the kernels' cosines are then raw dot products (normalize=False;
    they are not scale-invariant, so no row is scaled)."""
    ones = torch.ones(x.shape[0], dtype=dtype, device=x.device)
    return ones, ones


class SimilarityLseFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c,
                filter_threshold, filter_keeps_target, normalize):
        dtype = compute_dtype(q.dtype)
        q_in, c_in = q.detach(), c.detach()
        m, d = q_in.shape
        mc = c_in.shape[0]
        norms = _row_norms if normalize else _unit_norms
        q_norm, q_scale = norms(q_in, dtype)
        c_norm, c_scale = norms(c_in, dtype)
        has_filter = filter_threshold is not None
        if has_filter:
            filter_dtype = compute_dtype(filter_q.dtype)
            fq, fc = filter_q, filter_c
            (fq_norm, fq_scale), (fc_norm, fc_scale) = norms(fq, filter_dtype), norms(fc, filter_dtype)
            threshold = filter_threshold  # contiguous, in filter_dtype (contract.check_similarity_lse)
            filter_operand = _filter_operand(fq.dtype, fc.dtype)
            filter_precision = _dot_precision(fq.dtype if fq.dtype == fc.dtype else filter_dtype)
        else:  # placeholders: never read
            filter_dtype, fq, fc, fq_norm, fc_norm, threshold = dtype, q_in, c_in, q_norm, c_norm, q_norm
            fq_scale, fc_scale = q_scale, c_scale
            filter_operand, filter_precision = _operand_dtype(q.dtype), _dot_precision(q.dtype)
        if penalty == 0.0:
            penalty_on = "none"  # the same logits, one variant fewer
        static = dict(
            EXCLUDE=exclude, PENALTY_ON=penalty_on, PERIODIC=period > 0, HAS_FILTER=has_filter,
            FILTER_KEEPS_TARGET=bool(filter_keeps_target and has_filter),
            ACC=acc_dtype_of(q.dtype), OPERAND=_operand_dtype(q.dtype), PRECISION=_dot_precision(q.dtype),
            FILTER_ACC=acc_dtype_of(filter_dtype), FILTER_OPERAND=filter_operand,
            FILTER_PRECISION=filter_precision, EPS=NORM_EPS,
        )
        params = torch.tensor([float(scale), float(penalty)], dtype=dtype).to(q.device)
        runtime = (m, mc, d, fq.shape[1] if has_filter else 0, target_offset, period,
                   _autotune_bucket(m), _autotune_bucket(mc),
                   q_in.stride(0), q_in.stride(1), c_in.stride(0), c_in.stride(1),
                   fq.stride(0), fq.stride(1), fc.stride(0), fc.stride(1), params)
        inputs = (q_in, c_in, q_norm, c_norm, fq, fc, fq_norm, fc_norm, threshold, q_scale, c_scale, fq_scale, fc_scale,
                  any_scaled(q_scale, c_scale, fq_scale, fc_scale))

        lse = new_output((m,), dtype, q.device)
        blocks = _interpreter_blocks(m, mc, max(d, runtime[3]))
        fwd_kernel, _, _ = kernels_for(_TUNED, q.dtype)
        _tile_launch(fwd_kernel, lambda b: (triton.cdiv(m, b["BLOCK_M"]),), blocks,
                     *inputs, lse, *runtime, **static)

        ctx.save_for_backward(*inputs, lse)
        ctx.static, ctx.runtime, ctx.blocks, ctx.normalize = static, runtime, blocks, normalize
        return lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_lse):
        *inputs, lse = ctx.saved_tensors
        q_in, c_in, q_norm, c_norm = inputs[:4]
        q_scale, c_scale = inputs[9:11]
        m, d = q_in.shape
        mc = c_in.shape[0]
        dtype = lse.dtype
        # Rows with no kept column contribute nothing, whatever their incoming gradient.
        coef, unscale = gradient_tile_scale(torch.where(lse == float("-inf"), 0.0, grad_lse.to(dtype)), 1)
        _, dq_kernel, dc_kernel = kernels_for(_TUNED, q_in.dtype)
        finish = dict(HAS_B=False, ACC=ctx.static["ACC"], EPS=NORM_EPS,
                      BLOCK_D=min(triton.next_power_of_2(d), 1024), num_warps=4)

        def gradient(kernel, grid, x_in, x_norm, x_scale, rows):
            """One side's gradient: its tile kernel accumulates the raw sum and the radial term, then the finish
            kernel applies the normalisation's backward (without normalisation the raw sum is the gradient)."""
            raw = new_output((rows, d), dtype, x_in.device)
            radial = new_output((rows,), dtype, x_in.device)
            _tile_launch(kernel, grid, ctx.blocks, *inputs, lse, coef, raw, radial, *ctx.runtime, **ctx.static)
            if not ctx.normalize:
                return (raw * unscale).to(x_in.dtype)
            out = new_output((rows, d), x_in.dtype, x_in.device)
            _similarity_xent_bwd_finish_kernel[(rows,)](x_in, x_norm, x_scale, raw, radial, raw, radial, out, unscale,
                                                        rows, d, x_in.stride(0), x_in.stride(1), **finish)
            return out

        dq = dc = None
        if ctx.needs_input_grad[0]:
            dq = gradient(dq_kernel, lambda b: (triton.cdiv(m, b["BLOCK_M"]),), q_in, q_norm, q_scale, m)
        if ctx.needs_input_grad[1]:
            dc = gradient(dc_kernel, lambda b: (triton.cdiv(mc, b["BLOCK_N"]),), c_in, c_norm, c_scale, mc)
        return dq, dc, *([None] * 11)


def similarity_lse(q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c,
                   filter_threshold, filter_keeps_target, normalize):
    """Flash-style per-row logsumexps of scaled cosines (or dot products) with exclusions, hardness and filters;
    see angle_kernels.dispatch."""
    return SimilarityLseFunction.apply(q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q,
                                       filter_c, filter_threshold, filter_keeps_target, normalize)


# ----------------------------------------------------------------------------------------------------------
# The specialisations CI compiles for sm_90 without a GPU (triton_ops._compile_check)
# ----------------------------------------------------------------------------------------------------------
def compile_cases(full: bool) -> list[CompileCase]:
    """CI: bf16 with everything on (periodic own columns excluded, a penalty, a bf16 filter keeping the target),
    fp32 plain (no filter, no penalty), the first autotune config of each; full=True: every input dtype, both
    variants, every autotune config. Plus the finish kernel as launched here (HAS_B=False)."""
    variants = [("bf16", True), ("fp32", False)]
    if full:
        variants = [(x, rich) for x in ("fp32", "bf16", "fp16", "fp64") for rich in (True, False)]
    operands = {"fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16, "fp64": tl.float64}
    cases = []
    for x_dtype, rich in variants:
        configs = _GPU_CONFIGS_32BIT if x_dtype in ("fp32", "fp64") else _GPU_CONFIGS_16BIT
        acc = tl.float64 if x_dtype == "fp64" else tl.float32
        pointer_dtype = "fp64" if x_dtype == "fp64" else "fp32"
        for config in configs if full else configs[:1]:
            constexprs = dict(
                EXCLUDE="own" if rich else "none", PENALTY_ON="other" if rich else "none", PERIODIC=rich,
                HAS_FILTER=rich, FILTER_KEEPS_TARGET=rich, ACC=acc, OPERAND=operands[x_dtype], PRECISION="ieee",
                FILTER_ACC=acc, FILTER_OPERAND=operands[x_dtype], FILTER_PRECISION="ieee", EPS=NORM_EPS,
                **config.kwargs)
            blocks = "x".join(str(v) for v in config.kwargs.values())
            label = f"x={x_dtype} exclude/penalty/filter={rich} tile={blocks} w={config.num_warps}"
            pointers = {"q_ptr": x_dtype, "c_ptr": x_dtype, "fq_ptr": x_dtype, "fc_ptr": x_dtype, "scaled_ptr": "i32"}
            cases += [CompileCase(kernel, label, pointer_dtype, constexprs, config.num_warps, config.num_stages,
                                  pointers) for kernel in _TILE_KERNELS]
    for x_dtype in dict.fromkeys(x for x, _ in variants):
        pointer_dtype = "fp64" if x_dtype == "fp64" else "fp32"
        cases.append(CompileCase(_similarity_xent_bwd_finish_kernel, f"x={x_dtype} HAS_B=False", pointer_dtype,
                                 dict(HAS_B=False, ACC=acc_dtype_of(torch.float64 if x_dtype == "fp64" else
                                                                    torch.float32), EPS=NORM_EPS, BLOCK_D=1024),
                                 4, pointers={"x_ptr": x_dtype, "dx_ptr": x_dtype}))
    return cases
