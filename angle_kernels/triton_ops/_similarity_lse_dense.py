"""similarity_lse as blocked dense products, at one width or at every prefix of dims: torch products, Triton tile math.

Computes the contract's similarity_lse (angle_kernels.dispatch.similarity_lse), the per-row logsumexps of
similarity_lse.py's fused kernels by another schedule: the dense scheme of similarity_xent_dense.py, with the
family's exclusions, hardness penalty and filter in the tile code. With dims = (d_1 < ... < d_k) it computes every
prefix q[:, :d_i], c[:, :d_i] in one pass (each with its own norms, the filter cut at the same widths, a [k, M]
result); one width is the scheme at k = 1, d_1 = D (a filter at its own width D'). With s_i = [d_{i-1}, d_i), a
prefix's dots are the running sum of the slice products (the identity of _similarity_xent_dense_dims.py):

    P_i = P_{i-1} + q[:, s_i] c[:, s_i]^T           (P_0 = 0; the same for the filter's dots F_i)

For each block of rows R = [r0, r0 + b):

    forward   P = 0 (F = 0); for i = 1 .. k:  P += q[R, s_i] c[:, s_i]^T   (F likewise)     cuBLAS, 2 b Mc D in all
                                             lse_i[R] = _dense_lse_stats_kernel(P, F)      Triton, one read of P
    backward  P_1 .. P_k (F_1 .. F_k) as above, each kept                                  2 b Mc D in all
              for j = k .. 1 (widest first), _dense_lse_grad_kernel on P_j (F_j):
                  G_j  = dlse_j/dcos times grad_j / max|grad| (no inverse norm), its radial sums
                  H_j  = G_j + (q_inv_j+1 / q_inv_j) (c_inv_j+1 / c_inv_j) H_j+1           the running sum, in place
              dq[R, s_j] += H_j c_unit[:, s_j];  dc[:, s_j] += H_j^T q_unit[R, s_j]          cuBLAS, 4 b Mc |s_j|

H_j is the sum over the prefixes i >= j (those slice s_j belongs to) of their gradient tiles, kept in prefix j's
frame: the scheme and the precision argument are _similarity_xent_dense_dims.py's (its helpers _prefix_tiles,
_unit_slices and _prefix_norm_backward are used here as they are), and the normalisation's backward is applied once
at the end, slice by slice, from the radial sums. The gradient tile is similarity_lse.py's (_grad_logits_tile): 0 off
the kept columns and on rows whose lse is -inf. A filter on the model's own rows (filter_q and filter_c the very
tensors q and c, as a false-negative filter passes them) takes the dots P as its own: no second product.

Precision: as the dense scheme. The tiles are fp32 sums of 16-bit products (fp64 for fp64), scaled by the fp32
inverse norms in the kernels; the filter's tiles are in its own compute dtype (its inputs converted to filter_q's
compute dtype where filter_q and filter_c differ in dtype). G_j carries grad / max|grad| (at most 1), never an
inverse norm nor the upstream gradient's magnitude (fp16 would underflow or overflow); max|grad| multiplies the
fp32 sums. Rows are scaled by a power of two each (huge rows; 1 for fp16), one scale per row for all its prefixes;
normalize=False takes the raw rows (norms and scales of one) and no normalisation backward.

The floor. FLOPs: forward 2 M Mc D (+ 2 M Mc D' for a filter of width D' that is not the model's own rows),
backward 6 M Mc D (+ 2 M Mc D'): 8 M Mc D in all, against the fused kernels' 10 M Mc D (+ 6 M Mc D'), all in dense
products; the dims add nothing to these. A [M] result has no scalar loss whose gradients forward could form (the
dense similarity_xent scheme's 6 M Mc D): its upstream gradient weights the rows, so backward forms the tiles again.
Bytes beyond the products' operand reads, per logit (fp32 tiles, 16-bit inputs): one width 26 (forward 8: the
product's write of the tile, the stats kernel's read; backward 18: the tile written again, 4, the gradient kernel's
read of it and its writes of the gradient in place and of its 16-bit copy, 10, the two products' reads of the copy,
4); each further prefix adds about 12 in forward (the slice product's read-modify-write of the tile, the stats
kernel's read) and 34 in backward (the tile copied and added to, 16; the kernel's reads of the tile and of the
running sum and its two writes, 14; the products' reads, 4): about 230 at k = 5; a separate filter's tiles add about
8 per logit and prefix each way. Against 8 D FLOPs: one width 236 FLOPs per byte at D = 768 and 1,260 at D = 4,096
(an H100 balances about 265); k = 5, 27 and 140 (the tile passes bound it, as the dense dims similarity_xent).
Extra memory: one block's tiles, k of P (k of F with a separate filter) and a 16-bit copy, within TILE_ELEMENTS
(block_rows); the unit slices and the fp32 gradients: O(M + Mc), never M x Mc. docs/triton-similarity.md has the
estimate against the fused kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ..contract import compute_dtype
from ..normalisation import inverse_norms_from_norms
from ._common import CompileCase, new_output
from ._similarity_tiles import _row_norms
from ._similarity_xent_dense_dims import _prefix_norm_backward, _prefix_tiles, _radial_and_running_sum, _unit_slices
from .similarity_lse import _grad_logits_tile
from .similarity_xent_dense import _GPU_GRAD_BLOCKS, _GPU_STATS_BLOCKS, _blocks, _product_into, _scaled_copy

FEATURES = ("dims",)

# A row block's tiles within TILE_ELEMENTS compute-dtype elements; MAX_BLOCK_ROWS and MIN_BLOCK_ROWS as in the dense
# scheme (dc's read-modify-write per block against the block's products), so the scheme is not taken where fewer
# rows fit.
TILE_ELEMENTS = 1 << 28
MAX_BLOCK_ROWS = 2048
MIN_BLOCK_ROWS = 512


def _tiles_per_row(k: int, separate_filter: bool) -> float:
    """The tiles a block holds at once in backward, in compute-dtype tile units: the k prefixes' dots (the running
    sum in place of the widest), the filter's k with a filter that is not the model's own rows, a 16-bit copy."""
    return k * (2 if separate_filter else 1) + 0.5


def block_rows(m: int, mc: int, k: int, separate_filter: bool) -> int:
    """The rows of logits held at a time for M x Mc logits and k prefixes."""
    return max(1, min(m, MAX_BLOCK_ROWS, int(TILE_ELEMENTS // (max(mc, 1) * _tiles_per_row(k, separate_filter)))))


def takes(columns: int, k: int, has_filter: bool) -> bool:
    """Whether this scheme can compute a call of these sizes: a block of at least MIN_BLOCK_ROWS rows of every tile
    fits TILE_ELEMENTS (a filter counted as separate: the choice is made on shapes). The widths from which the
    backend sends it calls are its selector's (similarity_lse_paths)."""
    return TILE_ELEMENTS // (max(columns, 1) * _tiles_per_row(k, has_filter)) >= MIN_BLOCK_ROWS


# ----------------------------------------------------------------------------------------------------------
# Kernels: the tile math of one row block, on its dots P (and the filter's F) of one prefix
# ----------------------------------------------------------------------------------------------------------

@triton.jit
def _dense_lse_row_state(q_norm_ptr, fq_norm_ptr, threshold_ptr, local, row0, n_rows, M, Mc, target_offset,
                         HAS_FILTER: tl.constexpr, ACC: tl.constexpr, FILTER_ACC: tl.constexpr):
    """(rows, valid, inverse norms, target columns, the filter's inverse norms and thresholds) of the block's local
    rows `local`: rows row0 + local. The norms are the clamped ones of the scaled rows (_row_norms); the target
    columns int32, clamped to Mc (no column j < Mc, nor j % period, equals Mc: similarity_lse._lse_row_state)."""
    rows = row0 + local
    row_ok = (local < n_rows) & (rows < M)
    inv_q = 1.0 / tl.load(q_norm_ptr + rows, mask=row_ok, other=1.0).to(ACC)
    targets = tl.minimum(rows + target_offset, Mc).to(tl.int32)
    if HAS_FILTER:
        inv_fq = 1.0 / tl.load(fq_norm_ptr + rows, mask=row_ok, other=1.0).to(FILTER_ACC)
        threshold = tl.load(threshold_ptr + rows, mask=row_ok, other=0.0).to(FILTER_ACC)
    else:  # unused
        inv_fq = inv_q
        threshold = inv_q
    return rows, row_ok, inv_q, targets, inv_fq, threshold


@triton.jit
def _dense_lse_logits(
    s_ptr, f_ptr, c_norm_ptr, fc_norm_ptr, local, cols, row_ok, col_ok, inv_q, targets, inv_fq, threshold,
    period, scale, penalty, stride_s, stride_f,
    EXCLUDE: tl.constexpr, PENALTY_ON: tl.constexpr, PERIODIC: tl.constexpr, HAS_FILTER: tl.constexpr,
    FILTER_KEEPS_TARGET: tl.constexpr, ACC: tl.constexpr, FILTER_ACC: tl.constexpr,
):
    """(cos, logits): the tile's cosines (dot products with normalize=False: norms of one) and l_ij on the kept
    columns K_i, -inf elsewhere (padding included): similarity_lse._lse_logits_tile on dots read from the tiles."""
    ok = row_ok[:, None] & col_ok[None, :]
    kept = ok
    col_index = cols.to(tl.int32)
    is_target = col_index[None, :] == targets[:, None]
    if HAS_FILTER:
        filter_dots = tl.load(f_ptr + local[:, None] * stride_f + cols[None, :], mask=ok, other=0.0).to(FILTER_ACC)
        inv_fc = 1.0 / tl.load(fc_norm_ptr + cols, mask=col_ok, other=1.0).to(FILTER_ACC)
        dropped = filter_dots * inv_fq[:, None] * inv_fc[None, :] > threshold[:, None]
        if FILTER_KEEPS_TARGET:
            dropped = dropped & ~is_target
        kept = kept & ~dropped

    dots = tl.load(s_ptr + local[:, None] * stride_s + cols[None, :], mask=ok, other=0.0).to(ACC)
    inv_c = 1.0 / tl.load(c_norm_ptr + cols, mask=col_ok, other=1.0).to(ACC)
    cos = dots * inv_q[:, None] * inv_c[None, :]
    if PERIODIC:
        own = (col_index % period)[None, :] == targets[:, None]
    else:
        own = is_target
    if EXCLUDE == "target":
        kept = kept & ~is_target
    elif EXCLUDE == "own":
        kept = kept & ~own
    logits = cos * scale
    if PENALTY_ON != "none":
        if PENALTY_ON == "other":
            hard = ~own
        elif PENALTY_ON == "own":
            hard = own & ~is_target
        else:  # "all"
            hard = ~is_target
        logits = tl.where(hard, logits + penalty * cos, logits)
    return cos, tl.where(kept, logits, float("-inf"))


# Arguments that change from block to block or batch to batch: not specialised on their values (Triton would
# compile a variant for == 1 and for divisible by 16), so a new batch size compiles nothing. The row strides are
# left to specialise: divisible by 16 lets the loads vectorise.
_BLOCK_ARGS = ("row0", "n_rows", "M", "Mc", "target_offset", "period")


@triton.jit(do_not_specialize=_BLOCK_ARGS)
def _dense_lse_stats_kernel(
    s_ptr,  # [n_rows, Mc] in: the block's dots of the scaled rows (one prefix), compute dtype, rows stride_s apart
    f_ptr,  # [n_rows, Mc] in (HAS_FILTER): the filter's dots, its compute dtype, rows stride_f apart; may be s_ptr
    q_norm_ptr, c_norm_ptr, fq_norm_ptr, fc_norm_ptr,  # the prefix's clamped norms of the scaled rows
    threshold_ptr,  # [M] the filter's thresholds (HAS_FILTER)
    lse_ptr,  # [M] out: rows row0 .. row0 + n_rows - 1
    row0, n_rows, M, Mc, target_offset, period, stride_s, stride_f,
    params_ptr,  # [2] in the compute dtype: scale, penalty
    EXCLUDE: tl.constexpr, PENALTY_ON: tl.constexpr, PERIODIC: tl.constexpr, HAS_FILTER: tl.constexpr,
    FILTER_KEEPS_TARGET: tl.constexpr, ACC: tl.constexpr, FILTER_ACC: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Scalars come through memory, not as arguments: Triton passes Python floats as fp32.
    scale = tl.load(params_ptr)
    penalty = tl.load(params_ptr + 1)
    local = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows, row_ok, inv_q, targets, inv_fq, threshold = _dense_lse_row_state(
        q_norm_ptr, fq_norm_ptr, threshold_ptr, local, row0, n_rows, M, Mc, target_offset, HAS_FILTER, ACC,
        FILTER_ACC)

    running_max = tl.full([BLOCK_M], float("-inf"), ACC)
    running_sum = tl.zeros([BLOCK_M], ACC)
    for col_start in range(0, Mc, BLOCK_N):
        cols = (col_start + tl.arange(0, BLOCK_N)).to(tl.int64)
        col_ok = cols < Mc
        _cos, logits = _dense_lse_logits(
            s_ptr, f_ptr, c_norm_ptr, fc_norm_ptr, local, cols, row_ok, col_ok, inv_q, targets, inv_fq, threshold,
            period, scale, penalty, stride_s, stride_f, EXCLUDE, PENALTY_ON, PERIODIC, HAS_FILTER,
            FILTER_KEEPS_TARGET, ACC, FILTER_ACC)
        new_max = tl.maximum(running_max, tl.max(logits, axis=1))
        safe = tl.where(new_max == float("-inf"), 0.0, new_max)
        running_sum = running_sum * tl.exp(running_max - safe) + tl.sum(tl.exp(logits - safe[:, None]), axis=1)
        running_max = new_max

    # A row with no kept column has max -inf and sum 0: its lse is -inf. Otherwise sum >= 1.
    empty = running_max == float("-inf")
    lse = tl.where(empty, float("-inf"), running_max + tl.log(tl.where(empty, 1.0, running_sum)))
    tl.store(lse_ptr + rows, lse, mask=row_ok)


@triton.jit(do_not_specialize=_BLOCK_ARGS)
def _dense_lse_grad_kernel(
    s_ptr,  # [n_rows, Mc] in: prefix j's dots of the block's scaled rows, compute dtype, rows stride_s apart
    f_ptr,  # [n_rows, Mc] in (HAS_FILTER): the filter's dots of prefix j, rows stride_f apart; may be s_ptr
    running_ptr,  # [n_rows, Mc] compute dtype: in H_j+1 (unless FIRST), out H_j; rows stride_r apart; may be s_ptr
    operand_ptr,  # [n_rows, Mc] out (HAS_OPERAND): H_j rounded to the products' operand dtype, rows stride_r apart
    q_norm_ptr, c_norm_ptr, fq_norm_ptr, fc_norm_ptr,  # prefix j's clamped norms of the scaled rows
    threshold_ptr,  # [M] prefix j's filter thresholds (HAS_FILTER)
    lse_ptr,  # [M] prefix j's logsumexps
    coef_ptr,  # [M]: grad_j / max|grad|, 0 where lse_j is -inf
    q_ratio_ptr, c_ratio_ptr,  # [M], [Mc]: q_inv_j+1 / q_inv_j, c_inv_j+1 / c_inv_j (read unless FIRST)
    row_radial_ptr,  # [column tiles, n_rows] out: each column tile's sum_c G_ic cos_ic of the block's rows
    col_radial_ptr,  # [row tiles, Mc] out: each row tile's sum_i G_ic cos_ic
    row0, n_rows, M, Mc, target_offset, period, stride_s, stride_f, stride_r,
    params_ptr,  # [2] in the compute dtype: scale, penalty
    EXCLUDE: tl.constexpr, PENALTY_ON: tl.constexpr, PERIODIC: tl.constexpr, HAS_FILTER: tl.constexpr,
    FILTER_KEEPS_TARGET: tl.constexpr, ACC: tl.constexpr, FILTER_ACC: tl.constexpr,
    FIRST: tl.constexpr, HAS_OPERAND: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """G_j, prefix j's gradient tile (similarity_lse._grad_logits_tile: no inverse norm in it), its radial sums, and
    the running sum H_j = G_j + (q_inv_j+1 / q_inv_j) (c_inv_j+1 / c_inv_j) H_j+1 in place of H_j+1, with its
    rounded copy for the slice products: one read of the tile and of the running sum. In place over the tile when
    running_ptr is s_ptr (and f_ptr): each element is loaded by this program before it is stored."""
    scale = tl.load(params_ptr)
    penalty = tl.load(params_ptr + 1)
    local = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows, row_ok, inv_q, targets, inv_fq, threshold = _dense_lse_row_state(
        q_norm_ptr, fq_norm_ptr, threshold_ptr, local, row0, n_rows, M, Mc, target_offset, HAS_FILTER, ACC,
        FILTER_ACC)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < Mc
    lse = tl.load(lse_ptr + rows, mask=row_ok, other=0.0)
    coef = tl.load(coef_ptr + rows, mask=row_ok, other=0.0)

    ok = row_ok[:, None] & col_ok[None, :]
    cos, logits = _dense_lse_logits(
        s_ptr, f_ptr, c_norm_ptr, fc_norm_ptr, local, cols, row_ok, col_ok, inv_q, targets, inv_fq, threshold,
        period, scale, penalty, stride_s, stride_f, EXCLUDE, PENALTY_ON, PERIODIC, HAS_FILTER,
        FILTER_KEEPS_TARGET, ACC, FILTER_ACC)
    g = _grad_logits_tile(logits, lse, coef, scale)  # 0 off K_i and on the padding
    g_cos = g * tl.where(ok, cos, 0.0)
    _radial_and_running_sum(g, g_cos, running_ptr, operand_ptr, q_ratio_ptr, c_ratio_ptr, row_radial_ptr,
                            col_radial_ptr, local, rows, row_ok, cols, col_ok, ok, n_rows, Mc, stride_r, FIRST,
                            HAS_OPERAND)


# ----------------------------------------------------------------------------------------------------------
# The autograd function and launchers
# ----------------------------------------------------------------------------------------------------------

def _same_rows(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Whether a is b's very storage, shape, strides and dtype (a filter on the model's own rows): its dots are b's."""
    return (a is not None and a.dtype == b.dtype and a.device == b.device and a.shape == b.shape
            and a.stride() == b.stride() and a.data_ptr() == b.data_ptr())


def _norms(x: torch.Tensor, dtype: torch.dtype, bounds: torch.Tensor, normalize: bool
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """([k, R] clamped norms of every prefix of the scaled rows, [R] row scales) (_row_norms); without
    normalisation norms and scales of one (raw dot products are not scale-invariant: no row is scaled)."""
    if normalize:
        return _row_norms(x, dtype, bounds)
    ones = torch.ones(x.shape[0], dtype=dtype, device=x.device)
    return ones.expand(bounds.shape[0] - 1, -1).contiguous(), ones


class DenseSimilarityLseFunction(torch.autograd.Function):
    """The [k, M] logsumexps of the prefixes of dims (module docstring): forward the logsumexps, backward forms the
    tiles again and the gradients."""

    @staticmethod
    def forward(ctx, q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c,
                filter_threshold, filter_keeps_target, normalize, dims, filter_dims):
        dtype = compute_dtype(q.dtype)
        q_in, c_in = q.detach(), c.detach()
        m, mc, k = q_in.shape[0], c_in.shape[0], len(dims)
        bounds = torch.tensor((0,) + dims, dtype=torch.int32).to(q.device)
        q_norm, q_scale = _norms(q_in, dtype, bounds, normalize)
        c_norm, c_scale = _norms(c_in, dtype, bounds, normalize)
        # The products take the scaled rows (huge rows: docs/triton-similarity.md), copies in the input dtype.
        q_in, c_in = _scaled_copy(q_in, q_scale), _scaled_copy(c_in, c_scale)
        has_filter = filter_threshold is not None
        own_filter = has_filter and _same_rows(filter_q, q) and _same_rows(filter_c, c)
        separate = has_filter and not own_filter
        filter_dtype = compute_dtype(filter_q.dtype) if has_filter else dtype
        if separate:
            fq, fc = filter_q, filter_c
            if fq.dtype != fc.dtype:  # as the fused kernels: both in filter_q's compute dtype
                fq, fc = fq.to(filter_dtype), fc.to(filter_dtype)
            filter_bounds = torch.tensor((0,) + filter_dims, dtype=torch.int32).to(q.device)
            fq_norm, fq_scale = _norms(fq, filter_dtype, filter_bounds, normalize)
            fc_norm, fc_scale = _norms(fc, filter_dtype, filter_bounds, normalize)
            fq, fc = _scaled_copy(fq, fq_scale), _scaled_copy(fc, fc_scale)
        else:  # the model's own rows, or placeholders never read
            fq, fc, fq_norm, fc_norm = None, None, q_norm, c_norm
        threshold = filter_threshold.reshape(k, m) if has_filter else q_norm
        if penalty == 0.0:
            penalty_on = "none"  # the same logits, one variant fewer
        static = dict(EXCLUDE=exclude, PENALTY_ON=penalty_on, PERIODIC=period > 0, HAS_FILTER=has_filter,
                      FILTER_KEEPS_TARGET=bool(filter_keeps_target and has_filter),
                      ACC=tl.float64 if dtype == torch.float64 else tl.float32,
                      FILTER_ACC=tl.float64 if filter_dtype == torch.float64 else tl.float32)
        params = torch.tensor([float(scale), float(penalty)], dtype=dtype).to(q.device)

        lse = new_output((k, m), dtype, q.device)
        block = block_rows(m, mc, 1, separate)  # forward holds one tile (two with a separate filter)
        dots = torch.empty((block, mc), dtype=dtype, device=q.device)
        filter_dots = torch.empty((block, mc), dtype=filter_dtype, device=q.device) if separate else dots
        slices = list(zip((0,) + dims[:-1], dims))
        filter_dims = filter_dims or dims  # (placeholders without a filter)
        filter_slices = list(zip((0,) + filter_dims[:-1], filter_dims))
        for r0 in range(0, m, block):
            n = min(block, m - r0)
            blocks = _blocks(n, mc, _GPU_STATS_BLOCKS)
            for i, ((lo, hi), (f_lo, f_hi)) in enumerate(zip(slices, filter_slices)):
                _product_into(dots[:n], q_in[r0:r0 + n, lo:hi], c_in[:, lo:hi].T, accumulate=i > 0)
                if separate:
                    _product_into(filter_dots[:n], fq[r0:r0 + n, f_lo:f_hi], fc[:, f_lo:f_hi].T, accumulate=i > 0)
                _dense_lse_stats_kernel[(triton.cdiv(n, blocks["BLOCK_M"]),)](
                    dots, filter_dots, q_norm[i], c_norm[i], fq_norm[i], fc_norm[i], threshold[i], lse[i],
                    r0, n, m, mc, target_offset, period, dots.stride(0), filter_dots.stride(0), params,
                    **static, **blocks)
        del dots, filter_dots

        ctx.save_for_backward(q_in, c_in, q_norm, c_norm, q_scale, c_scale, fq, fc, fq_norm, fc_norm, threshold,
                              lse, params)
        ctx.static, ctx.dims, ctx.filter_dims, ctx.normalize, ctx.separate = (static, dims, filter_dims, normalize,
                                                                             separate)
        ctx.layout = (target_offset, period)
        ctx.input_dtypes = (q.dtype, c.dtype)
        return lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_lse):
        (q_in, c_in, q_norm, c_norm, q_scale, c_scale, fq, fc, fq_norm, fc_norm, threshold, lse,
         params) = ctx.saved_tensors
        dims, static, separate = ctx.dims, ctx.static, ctx.separate
        target_offset, period = ctx.layout
        dtype = lse.dtype
        m, mc, k = q_in.shape[0], c_in.shape[0], len(dims)
        device = q_in.device
        want_q, want_c = ctx.needs_input_grad[:2]

        # The gradient tiles' per-row factors, at most 1: grad / max|grad| (0 on rows that keep no column, whatever
        # their incoming gradient); `unscale`, max|grad|, multiplies the fp32 sums (module docstring).
        grad = torch.where(lse == float("-inf"), 0.0, grad_lse.to(dtype))
        unscale = grad.abs().amax().clamp_min(torch.finfo(dtype).tiny)
        coef = (grad / unscale).contiguous()

        q_inv, q_has_grad = inverse_norms_from_norms(q_norm, q_scale[None, :])  # [k, M]
        c_inv, c_has_grad = inverse_norms_from_norms(c_norm, c_scale[None, :])
        if not ctx.normalize:  # raw dot products: no normalisation, no radial term
            q_has_grad, c_has_grad = torch.zeros_like(q_has_grad), torch.zeros_like(c_has_grad)
        q_ratio = q_inv[1:] / q_inv[:-1]  # [k - 1, M]: from prefix j + 1's frame to prefix j's, at most 1
        c_ratio = c_inv[1:] / c_inv[:-1]
        q_unit = _unit_slices(q_in, q_inv, dims, dtype) if want_c else None
        c_unit = _unit_slices(c_in, c_inv, dims, dtype) if want_q else None

        d_q = torch.zeros(q_in.shape, dtype=dtype, device=device) if want_q else None
        d_c = torch.zeros(c_in.shape, dtype=dtype, device=device) if want_c else None
        q_radial = torch.zeros((k, m), dtype=dtype, device=device)  # sum_c G_ic cos_ic per prefix
        c_radial = torch.zeros((k, mc), dtype=dtype, device=device)

        slices = list(zip((0,) + dims[:-1], dims))
        block = block_rows(m, mc, k, separate)
        dots = torch.empty((k, block, mc), dtype=dtype, device=device)
        filter_dots = torch.empty((k, block, mc), dtype=fq_norm.dtype, device=device) if separate else dots
        running = dots[k - 1]  # the running sum in place of the widest tile, read before it is overwritten
        # the running sum rounded to the products' operand dtype (itself for fp32 and fp64)
        operand = running if q_in.dtype == dtype else torch.empty((block, mc), dtype=q_in.dtype, device=device)
        for r0 in range(0, m, block):
            n = min(block, m - r0)
            rows = slice(r0, r0 + n)
            _prefix_tiles(dots[:, :n], q_in[rows], c_in, dims)
            if separate:
                _prefix_tiles(filter_dots[:, :n], fq[rows], fc, ctx.filter_dims)
            blocks = _blocks(n, mc, _GPU_GRAD_BLOCKS)
            grid = (triton.cdiv(n, blocks["BLOCK_M"]), triton.cdiv(mc, blocks["BLOCK_N"]))
            row_radial = torch.empty((grid[1], n), dtype=dtype, device=device)
            col_radial = torch.empty((grid[0], mc), dtype=dtype, device=device)
            for j in reversed(range(k)):
                first = j == k - 1
                ratios = (q_inv[0], c_inv[0]) if first else (q_ratio[j], c_ratio[j])  # placeholders when first
                _dense_lse_grad_kernel[grid](
                    dots[j], filter_dots[j], running, operand, q_norm[j], c_norm[j], fq_norm[j], fc_norm[j],
                    threshold[j], lse[j], coef[j], *ratios, row_radial, col_radial, r0, n, m, mc, target_offset,
                    period, dots.stride(1), filter_dots.stride(1), running.stride(0), params,
                    **static, FIRST=first, HAS_OPERAND=operand is not running, **blocks)
                q_radial[j, rows] += row_radial.sum(dim=0)
                c_radial[j] += col_radial.sum(dim=0)
                lo, hi = slices[j]
                if want_q:
                    _product_into(d_q[rows, lo:hi], operand[:n], c_unit[:, lo:hi], accumulate=True)
                if want_c:
                    _product_into(d_c[:, lo:hi], operand[:n].T, q_unit[rows, lo:hi], accumulate=True)
        del dots, filter_dots, running, operand, q_unit, c_unit

        def finish(x, inv, has_grad, radial, d_raw, x_dtype, x_scale):
            """Each slice out of its prefix's frame, times max|grad|; then the normalisation's backward."""
            for j, (lo, hi) in enumerate(slices):
                d_raw[:, lo:hi].mul_(inv[j][:, None] * unscale)
            return _prefix_norm_backward(x, inv, has_grad, radial.mul_(unscale), d_raw, dims, x_scale).to(x_dtype)

        q_dtype, c_dtype = ctx.input_dtypes
        dq = finish(q_in, q_inv, q_has_grad, q_radial, d_q, q_dtype, q_scale) if want_q else None
        dc = finish(c_in, c_inv, c_has_grad, c_radial, d_c, c_dtype, c_scale) if want_c else None
        return dq, dc, *([None] * 13)


def similarity_lse(q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c,
                   filter_threshold, filter_keeps_target, normalize):
    """similarity_lse at one width by the blocked dense products (module docstring, k = 1): [M]."""
    return DenseSimilarityLseFunction.apply(q, c, scale, target_offset, period, exclude, penalty, penalty_on,
                                            filter_q, filter_c, filter_threshold, filter_keeps_target, normalize,
                                            (q.shape[1],), None if filter_q is None else (filter_q.shape[1],))[0]


def similarity_lse_dims(q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c,
                        filter_threshold, filter_keeps_target, normalize, dims):
    """similarity_lse of every prefix of dims by the blocked dense products in one pass (module docstring):
    [k, M]; filter_threshold [k, M]."""
    return DenseSimilarityLseFunction.apply(q, c, scale, target_offset, period, exclude, penalty, penalty_on,
                                            filter_q, filter_c, filter_threshold, filter_keeps_target, normalize,
                                            tuple(dims), tuple(dims))


# ----------------------------------------------------------------------------------------------------------
# The specialisations CI compiles for sm_90 without a GPU (triton_ops._compile_check)
# ----------------------------------------------------------------------------------------------------------
def compile_cases(full: bool) -> list[CompileCase]:
    """CI: bf16 inputs with everything on (periodic own columns excluded, a penalty, a filter keeping the target;
    a bf16 copy of the running sum, not the first prefix), fp32 plain (the first prefix, no copy); full=True: every
    dtype, both variants."""
    variants = [("bf16", True), ("fp32", False)]
    if full:
        variants = [(x, rich) for x in ("fp32", "bf16", "fp16", "fp64") for rich in (True, False)]
    cases = []
    for x_dtype, rich in variants:
        acc_name = "fp64" if x_dtype == "fp64" else "fp32"
        acc = tl.float64 if x_dtype == "fp64" else tl.float32
        half = x_dtype in ("bf16", "fp16")
        options = dict(EXCLUDE="own" if rich else "none", PENALTY_ON="other" if rich else "none", PERIODIC=rich,
                       HAS_FILTER=rich, FILTER_KEEPS_TARGET=rich, ACC=acc, FILTER_ACC=acc)
        label = f"x={x_dtype} exclude/penalty/filter={rich}"
        for kernel, blocks, extra, pointers in (
                (_dense_lse_stats_kernel, _GPU_STATS_BLOCKS, {}, {}),
                (_dense_lse_grad_kernel, _GPU_GRAD_BLOCKS, dict(FIRST=not half, HAS_OPERAND=half),
                 {"operand_ptr": x_dtype})):
            tiles = {name: v for name, v in blocks.items() if name != "num_warps"}
            cases.append(CompileCase(kernel, label, acc_name, dict(options, **extra, **tiles), blocks["num_warps"],
                                     pointers=pointers))
    return cases
