"""similarity_lse on the CUDA tile kernels of csrc/similarity_lse.cu by the dense scheme: ops, fakes, autograd, the op.

    cuda_similarity_lse_stats(dots, row_inv, col_inv, row_unscale, filter_dots, filter_row_inv, filter_col_inv,
                              threshold, row0, target_offset, period, scale, penalty, exclude, penalty_on,
                              filter_keeps_target) -> lse [b], top [b], log_sum [b]
    cuda_similarity_lse_grad(dots, row_inv, col_inv, row_unscale, filter_dots, filter_row_inv, filter_col_inv,
                             threshold, top, log_sum, coef, running, row_ratio, col_ratio, row0, target_offset,
                             period, scale, penalty, exclude, penalty_on, filter_keeps_target, radial, keep_running,
                             operand_dtype)
        -> grad [b, Mc] (operand_dtype), next running sum [b, Mc] (keep_running), row_radial [b], col_radial [Mc]

The ops are the tile steps of one block of b rows (csrc/similarity_lse.cu says what they compute); this module
orchestrates them as triton_ops/_similarity_lse_dense.py does its Triton kernels. With dims = (d_1 < ... < d_k)
every prefix q[:, :d_i], c[:, :d_i] in one pass (each with its own norms, a filter cut at the same widths, a [k, M]
result); one width is the scheme at k = 1, d_1 = D (a filter at its own width D'). With s_i = [d_i-1, d_i), a
prefix's dots are the running sum of the slice products, P_i = P_i-1 + q[:, s_i] c[:, s_i]^T. Per block of rows R:

    forward   P = 0 (F = 0); for i = 1 .. k:  P += q_s[R, s_i] c_s[:, s_i]^T (F likewise)   torch, 2 b Mc D in all
                                             lse_i[R] = stats(P, F)                        one read of P
    backward  P_1 .. P_k (F_1 .. F_k), each kept                                           2 b Mc D in all
              for j = k .. 1 (widest first):  H_j, radial sums = grad(P_j, F_j, H_j+1)     H_j = G_j + ratios H_j+1
                                             dq[R, s_j] = H_j c_unit[:, s_j];  dc[:, s_j] += H_j^T q_unit[R, s_j]

x_s = s x are the rows scaled by their powers of two (huge rows; s = 1 for float16, whose products cannot overflow
the fp32 accumulation) in the input dtype, exact. The products take 16-bit operands with fp32 results where the
torch build offers it (angle_kernels.products, as the Triton dense scheme's), fp32 as fp32 (torch's TF32 switch),
fp64 in fp64; nothing is M x Mc: a block holds at most TILE_ELEMENTS logits per tile. For cosines the kernels take the
inverse clamped norms of the scaled rows and the unit rows c_unit = c_s / |c_s| (rounded to the input dtype) are
the backward products' operands; the normalisation's backward is applied once at the end from the radial sums. For
raw dot products (normalize=False) the kernels take 1 / s_j on the columns, so that the scores stay in their anchor
row's scale, s_i q_i . c_j, and 1 / s_i brings each row's logits back (torch_ops/similarity_lse.py's rule: exact,
never inf - inf); the backward products take the rows themselves. G carries grad / max|grad| (at most 1): max|grad|
multiplies the fp32 sums.

The floor. FLOPs: forward 2 M Mc D (+ 2 M Mc D' for a filter of width D' on other embeddings), backward 6 M Mc D
(+ 2 M Mc D'): 8 M Mc D in all, the Triton dense scheme's, all in cuBLAS products. Bytes beyond the products'
operand reads, per logit (fp32 tiles, 16-bit operands): 22 (forward 8: P written and read once; backward 14: P
written and read, G written in 2 bytes and read by the two products); a separate filter adds 8 each way. Against
8 D FLOPs: about 280 FLOPs per byte at D = 768 and 1,490 at D = 4,096 (an H100 balances about 265).

H_j is the sum over the prefixes i >= j (those slice s_j belongs to) of their gradient tiles, kept in prefix j's frame
(ratios q_inv_j+1 / q_inv_j, c_inv_j+1 / c_inv_j, at most 1; ones for dot products); the unit slices take the
inverse norm of the prefix they end, and the normalisation's backward is applied once at the end, slice by slice,
from every prefix's radial sums (the Triton dense dims scheme's). The dims add no FLOPs; each further prefix adds
about 12 bytes per logit forward and 34 backward (the tile copied and added to; the running sum read and written in
fp32), so the tile passes bound k = 5 as they do the Triton scheme.

Deterministic: no float atomics (the radial sums are reduced per tile in a fixed order by the binding); the
products are cuBLAS's. No `reference` (dispatch subtracts the reference logits for backends without it).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from ..contract import compute_dtype
from ..normalisation import inverse_norms_from_norms, row_scales
from ..products import product_into
from ._dense_tiles import column_slices, grad_fake, grad_schema, operand_name, prefix_tiles, running_sums, unit_slices
from ._library import define, op

FEATURES = ("dims",)  # the contract's optional features this op implements (not reference: dispatch subtracts it)
PATHS = ("dense", "dense_dims")  # one width, every prefix of dims: each verified on GPUs on its own

# A block's tiles within TILE_ELEMENTS compute-dtype elements (1 GiB of fp32 logits), at most MAX_BLOCK_ROWS rows
# (dc_hat's read-modify-write per block against the block's products), as the Triton dense scheme.
TILE_ELEMENTS = 1 << 28
MAX_BLOCK_ROWS = 2048

_TILE_ARGS = ("Tensor dots, Tensor row_inv, Tensor col_inv, Tensor row_unscale, Tensor? filter_dots, "
              "Tensor? filter_row_inv, Tensor? filter_col_inv, Tensor? threshold")
_OPTION_ARGS = "int target_offset, int period, float scale, float penalty, str exclude, str penalty_on, " \
               "bool filter_keeps_target"
STATS = define("cuda_similarity_lse_stats", f"({_TILE_ARGS}, int row0, {_OPTION_ARGS}) -> (Tensor, Tensor, Tensor)")
GRAD = define("cuda_similarity_lse_grad", grad_schema(_TILE_ARGS, "Tensor top, Tensor log_sum", _OPTION_ARGS))


@torch.library.register_fake(STATS)
def _stats_fake(dots, row_inv, col_inv, row_unscale, filter_dots, filter_row_inv, filter_col_inv, threshold, row0,
                target_offset, period, scale, penalty, exclude, penalty_on, filter_keeps_target):
    per_row = dots.new_empty((dots.shape[0],))
    return per_row, per_row.new_empty((dots.shape[0],)), per_row.new_empty((dots.shape[0],))


@torch.library.register_fake(GRAD)
def _grad_fake(dots, row_inv, col_inv, row_unscale, filter_dots, filter_row_inv, filter_col_inv, threshold, top,
               log_sum, coef, running, row_ratio, col_ratio, row0, target_offset, period, scale, penalty, exclude,
               penalty_on, filter_keeps_target, radial, keep_running, operand_dtype):
    return grad_fake(dots, keep_running, operand_dtype)


# The kernels as this module calls them (tests/ops/test_cuda_similarity_lse_emulation.py puts CPU models of them
# here, under the same orchestration).
def _stats(*args):
    return op("cuda_similarity_lse_stats")(*args)


def _grad(*args):
    return op("cuda_similarity_lse_grad")(*args)


# ----------------------------------------------------------------------------------------------------------
# The rows: scaled copies, and the factors the kernels take, per prefix
# ----------------------------------------------------------------------------------------------------------
class _Rows(NamedTuple):
    """One side's rows as the scheme takes them, for k prefixes (k = 1: the full width)."""

    scaled: torch.Tensor  # x_s = s x in x's dtype (the products' operand)
    scale: torch.Tensor  # [R] s, compute dtype (one per row, for every prefix)
    inv: torch.Tensor  # [k, R] the kernels' factor: 1 / max(|x_s[:d]|, eps s) (cosines), or 1 / s (dot products)
    has_grad: torch.Tensor | None  # [k, R] cosines: whether the prefix's norm was not clamped (it has a gradient)


def _rows(x: torch.Tensor, dtype: torch.dtype, normalize: bool, slices: list) -> _Rows:
    """x scaled by its rows' powers of two (1 for float16), and the factor the kernels multiply the dots by, for
    every prefix ending a slice (the prefixes' squared norms: running sums of the slices')."""
    # 1 for every float16 row: no product of two of them overflows the fp32 accumulation
    scale = torch.ones(x.shape[0], dtype=dtype, device=x.device) if x.dtype == torch.float16 else row_scales(x)
    scaled = x * scale.to(x.dtype)[:, None]
    if not normalize:
        return _Rows(scaled, scale, scale.reciprocal().expand(len(slices), -1), None)
    squares = torch.stack([torch.linalg.vector_norm(scaled[:, lo:hi], dim=1, dtype=dtype).square()
                           for lo, hi in slices])
    inv, has_grad = inverse_norms_from_norms(squares.cumsum(dim=0).sqrt(), scale[None, :])
    return _Rows(scaled, scale, inv, has_grad)


def _same_rows(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    """Whether a is b's very storage, shape, strides and dtype (a filter on the model's own rows): its dots are b's.
    Under torch.compile, which cannot trace data pointers, never: the filter then takes its own tile of the same
    dots (the same decisions, 2 M Mc D more FLOPs each way)."""
    if a is None or torch.compiler.is_compiling():
        return False
    return (a.dtype == b.dtype and a.device == b.device and a.shape == b.shape and a.stride() == b.stride()
            and a.data_ptr() == b.data_ptr())


def block_rows(m: int, mc: int, k: int, separate_filter: bool) -> int:
    """The rows of logits a block holds: backward's tiles (the k prefixes' P, their F with a filter on other
    embeddings, two running sums and G) within TILE_ELEMENTS, at most MAX_BLOCK_ROWS."""
    tiles = k * (2 if separate_filter else 1) + (3 if k > 1 else 1)
    return max(1, min(m, MAX_BLOCK_ROWS, TILE_ELEMENTS // (max(mc, 1) * tiles)))


class _Scheme(NamedTuple):
    """What forward and backward both need: the scaled rows, the kernels' per-row and per-column factors of every
    prefix, the filter's, and the options in the ops' order."""

    slices: list  # [(lo, hi)] the column slices s_i = [d_i-1, d_i)
    filter_slices: list  # the filter's (its own width with one width; the same as slices with dims)
    q: _Rows
    c: _Rows
    row_inv: torch.Tensor  # [k, M]
    col_inv: torch.Tensor  # [k, Mc]
    row_unscale: torch.Tensor  # [M]
    fq: torch.Tensor | None  # a separate filter's scaled rows (else None)
    fc: torch.Tensor | None
    filter_row_inv: torch.Tensor | None  # [k, M]
    filter_col_inv: torch.Tensor | None  # [k, Mc]
    threshold: torch.Tensor | None  # [k, M]
    options: tuple  # target_offset, period, scale, penalty, exclude, penalty_on, filter_keeps_target

    def tile_args(self, i: int, dots: torch.Tensor, filter_dots: torch.Tensor | None) -> tuple:
        """The ops' tile arguments of prefix i on a block's tiles."""
        def row(x):
            return None if x is None else x[i]

        return (dots, self.row_inv[i], self.col_inv[i], self.row_unscale, filter_dots, row(self.filter_row_inv),
                row(self.filter_col_inv), row(self.threshold))


def _scheme(q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c, filter_threshold,
            filter_keeps_target, normalize, dims) -> _Scheme:
    dtype = compute_dtype(q.dtype)
    slices = column_slices(dims or (q.shape[1],))
    k = len(slices)
    q_rows, c_rows = _rows(q, dtype, normalize, slices), _rows(c, dtype, normalize, slices)
    if normalize:  # cosines: the inverse norms on both sides, logits as they are
        row_inv, col_inv = q_rows.inv, c_rows.inv
        row_unscale = torch.ones(q.shape[0], dtype=dtype, device=q.device)
    else:  # dot products in the anchor row's scale s_i (q_i . c_j), brought back by 1 / s_i
        row_inv = torch.ones((k, q.shape[0]), dtype=dtype, device=q.device)
        col_inv, row_unscale = c_rows.inv.contiguous(), q_rows.inv[0].contiguous()
    fq = fc = filter_row_inv = filter_col_inv = threshold = None
    filter_slices = slices
    if filter_threshold is not None:
        threshold = filter_threshold.reshape(k, q.shape[0])
        if _same_rows(filter_q, q) and _same_rows(filter_c, c):  # the model's own scores: no second tile
            if not normalize:
                threshold = threshold * q_rows.scale  # in the anchor row's scale
        else:
            filter_dtype = compute_dtype(filter_q.dtype)
            if filter_q.dtype != filter_c.dtype:  # as the other backends: both in filter_q's compute dtype
                filter_q, filter_c = filter_q.to(filter_dtype), filter_c.to(filter_dtype)
            filter_slices = slices if dims is not None else column_slices((filter_q.shape[1],))
            fq_rows = _rows(filter_q, filter_dtype, normalize, filter_slices)
            fc_rows = _rows(filter_c, filter_dtype, normalize, filter_slices)
            fq, fc = fq_rows.scaled, fc_rows.scaled
            filter_row_inv, filter_col_inv = fq_rows.inv.contiguous(), fc_rows.inv.contiguous()
        threshold = threshold.contiguous()
    options = (target_offset, period, float(scale), float(penalty), exclude,
               penalty_on if penalty != 0.0 else "none", bool(filter_keeps_target))
    return _Scheme(slices, filter_slices, q_rows, c_rows, row_inv, col_inv, row_unscale, fq, fc, filter_row_inv,
                   filter_col_inv, threshold, options)


class DenseSimilarityLseFunction(torch.autograd.Function):
    """The [k, M] logsumexps of the prefixes (k = 1: the full width; module docstring): forward the row
    statistics, backward forms the tiles again and the gradients."""

    @staticmethod
    def forward(ctx, q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c,
                filter_threshold, filter_keeps_target, normalize, dims):
        dtype = compute_dtype(q.dtype)
        q_in, c_in = q.detach(), c.detach()
        s = _scheme(q_in, c_in, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c,
                    filter_threshold, filter_keeps_target, normalize, dims)
        m, mc, k = q_in.shape[0], c_in.shape[0], len(s.slices)
        separate = s.fq is not None
        block = block_rows(m, mc, 1, separate)  # forward holds one tile per side: the prefixes accumulate in it
        dots = torch.empty((block, mc), dtype=dtype, device=q.device)
        filter_dots = torch.empty((block, mc), dtype=s.threshold.dtype, device=q.device) if separate else None
        stats = [[] for _ in range(k)]
        for r0 in range(0, m, block):
            n = min(block, m - r0)
            for i, ((lo, hi), (f_lo, f_hi)) in enumerate(zip(s.slices, s.filter_slices)):
                tile = dots[:n]
                product_into(tile, s.q.scaled[r0:r0 + n, lo:hi], s.c.scaled[:, lo:hi].T, add=tile if i > 0 else None)
                if separate:
                    filter_tile = filter_dots[:n]
                    product_into(filter_tile, s.fq[r0:r0 + n, f_lo:f_hi], s.fc[:, f_lo:f_hi].T,
                                 add=filter_tile if i > 0 else None)
                stats[i].append(_stats(*s.tile_args(i, dots[:n], filter_dots[:n] if separate else None), r0,
                                       *s.options))
        del dots, filter_dots
        # [k, M] each: per prefix, the blocks' (lse, top, log_sum) in row order
        lse, top, log_sum = (torch.stack([torch.cat([block[o] for block in prefix]) for prefix in stats])
                             for o in range(3))
        ctx.scheme, ctx.rows = s, (q_in, c_in)
        ctx.save_for_backward(top, log_sum, lse)
        ctx.normalize = normalize
        ctx.input_dtypes = (q.dtype, c.dtype)
        return lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_lse):
        top, log_sum, lse = ctx.saved_tensors
        s, normalize = ctx.scheme, ctx.normalize
        dtype = lse.dtype
        k, m, mc = len(s.slices), s.q.scaled.shape[0], s.c.scaled.shape[0]
        device = lse.device
        want_q, want_c = ctx.needs_input_grad[:2]
        q_dtype, c_dtype = ctx.input_dtypes
        separate = s.fq is not None

        # The gradient tiles' per-row factors, at most 1: grad / max|grad| (0 on rows that keep no column, whatever
        # their incoming gradient); `unscale`, max|grad|, multiplies the fp32 sums (module docstring).
        grad = torch.where(lse == float("-inf"), 0.0, grad_lse.to(dtype))
        unscale = grad.abs().amax().clamp_min(torch.finfo(dtype).tiny)
        coef = (grad / unscale).contiguous()
        # The backward products' operands, in the input dtype: for cosines each slice in the frame of the prefix it
        # ends (times that prefix's inverse norm: entries at most 1), for dot products the rows themselves (s x / s).
        if normalize:
            q_unit = unit_slices(s.q, s.slices, dtype) if want_c else None
            c_unit = unit_slices(s.c, s.slices, dtype) if want_q else None
            q_frame, c_frame = s.q.inv, s.c.inv
        else:
            q_unit, c_unit = ctx.rows
            q_frame = torch.ones((k, m), dtype=dtype, device=device)
            c_frame = torch.ones((k, mc), dtype=dtype, device=device)
        q_ratio = (q_frame[1:] / q_frame[:-1]).contiguous()  # [k - 1, M]: from prefix j + 1's frame to prefix j's
        c_ratio = (c_frame[1:] / c_frame[:-1]).contiguous()
        d_q = torch.empty(s.q.scaled.shape, dtype=dtype, device=device) if want_q else None
        d_c = torch.zeros(s.c.scaled.shape, dtype=dtype, device=device) if want_c else None
        q_radial = torch.zeros((k, m), dtype=dtype, device=device)  # sum_c G_ic cos_ic of every prefix
        c_radial = torch.zeros((k, mc), dtype=dtype, device=device)
        operand = operand_name(q_dtype)

        block = block_rows(m, mc, k, separate)
        dots = torch.empty((k, block, mc), dtype=dtype, device=device)
        filter_dots = torch.empty((k, block, mc), dtype=s.threshold.dtype, device=device) if separate else None
        for r0 in range(0, m, block):
            n = min(block, m - r0)
            rows = slice(r0, r0 + n)
            prefix_tiles(dots[:, :n], s.q.scaled[rows], s.c.scaled, s.slices)
            if separate:
                prefix_tiles(filter_dots[:, :n], s.fq[rows], s.fc, s.filter_slices)

            def grad_tile(j, *folded):  # prefix j's op, folding in H_j+1 (folded): H_j = G_j + ratios H_j+1
                return _grad(*s.tile_args(j, dots[j, :n], filter_dots[j, :n] if separate else None), top[j],
                             log_sum[j], coef[j], *folded, r0, *s.options, normalize, j > 0, operand)

            # the widest prefix first; products: H_j in the operand dtype
            for j, products, row_radial, col_radial in running_sums(k, grad_tile, q_ratio, c_ratio):
                if normalize:
                    q_radial[j, rows] = row_radial
                    c_radial[j] += col_radial
                lo, hi = s.slices[j]
                if want_q:
                    product_into(d_q[rows, lo:hi], products, c_unit[:, lo:hi])
                if want_c:
                    product_into(d_c[:, lo:hi], products.T, q_unit[rows, lo:hi], add=d_c[:, lo:hi])
                del products
        dots = filter_dots = None  # the tiles go (grad_tile reads them: a cell, so not `del`)

        def finish(rows: _Rows, radial, d_raw, x_dtype):
            """max|grad| back in; for cosines each slice out of its prefix's frame and the normalisation's backward
            from the radial sums: on slice j, minus the radial terms inv_i^2 radial_i x_s of the prefixes i >= j
            whose norm is not clamped; times s."""
            d_raw[:, s.slices[-1][1]:] = 0.0  # past the widest prefix (if any): no gradient
            if not normalize:
                return d_raw.mul_(unscale).to(x_dtype)
            shrink = torch.where(rows.has_grad, rows.inv * rows.inv * radial * unscale, torch.zeros_like(radial))
            shrink = shrink.flip(0).cumsum(dim=0).flip(0)
            for j, (lo, hi) in enumerate(s.slices):
                d_raw[:, lo:hi].mul_((rows.inv[j] * unscale)[:, None])
                d_raw[:, lo:hi].addcmul_(rows.scaled[:, lo:hi].to(dtype), shrink[j][:, None], value=-1.0)
            return d_raw.mul_(rows.scale[:, None]).to(x_dtype)

        dq = finish(s.q, q_radial, d_q, q_dtype) if want_q else None
        dc = finish(s.c, c_radial, d_c, c_dtype) if want_c else None
        return dq, dc, *([None] * 12)


def code_path(q, c, scale, target_offset=0, period=0, exclude="none", penalty=0.0, penalty_on="none",
              filter_q=None, filter_c=None, filter_threshold=None, filter_keeps_target=False, normalize=True,
              dims=None) -> str:
    """The one of PATHS that computes this call: "dense" at one width, "dense_dims" with dims."""
    return "dense" if dims is None else "dense_dims"


def similarity_lse(q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c,
                   filter_threshold, filter_keeps_target, normalize, dims=None, path=None):
    """Per-row logsumexps [M] of scaled cosines (or dot products) by the dense scheme, [k, M] with dims (module
    docstring); see angle_kernels.dispatch."""
    if path is not None and path != code_path(q, c, scale, dims=dims):
        raise ValueError(f"the cuda backend's similarity_lse has no code path {path!r} for dims={dims!r}; its paths: "
                         f"{PATHS} (dims: dense_dims)")
    lse = DenseSimilarityLseFunction.apply(q, c, scale, target_offset, period, exclude, penalty, penalty_on,
                                           filter_q, filter_c, filter_threshold, filter_keeps_target, normalize,
                                           None if dims is None else tuple(dims))
    return lse[0] if dims is None else lse
