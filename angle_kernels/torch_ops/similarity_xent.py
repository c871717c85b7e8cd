"""Softmax cross-entropy over cosine similarities, in row blocks: never the full M x Mc matrix.

Computes the contract's similarity_xent (angle_kernels.dispatch.similarity_xent), which covers the
in-batch-negative loss (q = c, diagonal excluded, partner targets, rows without a target weighted 0, identical
texts as extra positives), the contrastive loss with negatives (rectangular, diagonal targets) and ArcCon
(diagonal targets with an additive angular margin on the target logit):

    loss = (1/M) sum_i w_i * (logsumexp_{j in C_i} l_ij - logsumexp_{j in P_i} l_ij)

Rows are processed a block at a time against all columns: a block x Mc tile of cosines is one matrix product of
the raw rows, scaled by the inverse norms (no normalised copy of the inputs is made). Each tile holds whole rows,
so its logsumexps, and with them its gradient, are known as soon as it is computed:

    dL/dl_ij = w_i / M * (softmax_all_ij - softmax_pos_ij)

chained through the margin on the target column. Forward forms the gradients for grad_loss = 1 when autograd
will ask for them (angle_kernels.formed_gradients), accumulating d q_hat = G c_hat and d c_hat += G^T q_hat, and
backward only scales them by grad_loss: three matrix products per block, where recomputing the logits in backward
would take four. The normalisation's backward is applied once at the end (angle_kernels.normalisation). Peak extra
memory is O(block x Mc) for the tiles plus O((M + Mc) x D) for the gradients, kept in the compute dtype.

Nested prefixes (dims = (d_1 < ... < d_k), `PrefixSimilarityXentFunction`): one loss per prefix, each with its own
norms. A block's dot tile is the running sum of the slice products q[blk, s_j] @ c[:, s_j]^T over the slices
s_j = [d_{j-1}, d_j), turned into prefix j's logits at the end of slice j, so q and c are read once per block for
all prefixes. Backward recomputes the tiles and, since slice j belongs to every prefix i >= j, takes one product
per slice and side with the suffix sums of the prefixes' gradient tiles (held together: the dims path takes blocks
of CHUNK_ELEMENTS / (k + 1) logits); each prefix's radial term is applied once at the end, slice by slice.

Huge rows: q and c are taken scaled by a power of two per row (torch_ops/common.py, row scaling), in the
compute-dtype copy the ops make anyway; every formula runs on the scaled rows, and the gradients are multiplied by
the scales once at the end. The derivations: docs/torch-similarity.md.
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from ..contract import MARGIN_SIN_SQUARED_FLOOR, compute_dtype
from ..formed_gradients import GradientsFormedInForward, gradients_wanted
from ..normalisation import normalise_backward, unscaled
from .common import cosine_rows, inverse_norms, prefix_inverse_norms, prefix_slices, rows_per_chunk

FEATURES = ("dims",)  # the contract's optional features this op implements (contract.OPTIONAL_FEATURES)


def _target_columns(target: str, rows: torch.Tensor) -> torch.Tensor:
    return rows ^ 1 if target == "partner" else rows


def margin_logit(cos_t: torch.Tensor, margin: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos(min(arccos(cos_t) + margin, pi)) and its derivative with respect to cos_t."""
    cos_m, sin_m = math.cos(margin), math.sin(margin)
    sin_sq = 1 - cos_t * cos_t
    sin_t = sin_sq.clamp_min(MARGIN_SIN_SQUARED_FLOOR).sqrt()
    value = cos_t * cos_m - sin_t * sin_m
    slope = cos_m + torch.where(sin_sq > MARGIN_SIN_SQUARED_FLOOR, cos_t * sin_m / sin_t, torch.zeros_like(cos_t))
    past_pi = cos_t < -cos_m  # theta + margin > pi: the logit is pinned at cos(pi) = -1
    return torch.where(past_pi, -torch.ones_like(value), value), torch.where(past_pi, torch.zeros_like(slope), slope)


class _Tiles:
    """Recomputes the logits of one row block, identically in forward and backward."""

    def __init__(self, qf, cf, q_inv, c_inv, scale, target, exclude_diagonal, margin, group_ids, dims=None):
        self.qf, self.cf, self.q_inv, self.c_inv = qf, cf, q_inv, c_inv
        self.scale, self.target, self.exclude_diagonal, self.margin = scale, target, exclude_diagonal, margin
        self.group_ids, self.dims = group_ids, dims
        # With dims, backward holds the k prefixes' gradient tiles of a block at once (see the module docstring).
        self.block = rows_per_chunk(cf.shape[0] * (1 if dims is None else len(dims) + 1))

    def blocks(self):
        m = self.qf.shape[0]
        for start in range(0, m, self.block):
            yield start, min(m, start + self.block)

    def rows(self, start: int, end: int):
        """(row indices, local row index, target columns, positives mask or None) of a row block."""
        rows = torch.arange(start, end, device=self.qf.device)
        local = rows - start
        targets = _target_columns(self.target, rows)
        positives = None
        if self.group_ids is not None:
            g = self.group_ids
            positives = (g[None, :] == g[rows, None]) | (g[None, :] == g[targets, None])
            positives[local, targets] = True
            if self.exclude_diagonal:
                positives[local, rows] = False
        return rows, local, targets, positives

    def to_logits(self, tile, rows, local, targets, q_inv, c_inv):
        """Turns a block's dot products into its logits in place, given the inverse norms; returns the target
        cosines."""
        tile.mul_(q_inv[:, None]).mul_(c_inv[None, :])  # cosines
        cos_t = tile[local, targets].clone()
        tile.mul_(self.scale)
        if self.margin != 0.0:
            tile[local, targets] = self.scale * margin_logit(cos_t, self.margin)[0]
        if self.exclude_diagonal:
            tile[local, rows] = float("-inf")
        return cos_t

    def logits(self, start: int, end: int):
        """(logits [b, Mc], local row index, target columns, target cosines, positives mask or None)."""
        rows, local, targets, positives = self.rows(start, end)
        tile = self.qf[start:end] @ self.cf.T
        cos_t = self.to_logits(tile, rows, local, targets, self.q_inv[start:end], self.c_inv)
        return tile, local, targets, cos_t, positives

    def prefix_logits(self, start: int, end: int, rows, local, targets):
        """Yields (i, dot products, logits, target cosines) of prefix i = 0 .. k-1 for a row block: the dot tile
        is a running sum over the slices, the logits a fresh copy (the dot tile must not be modified)."""
        dots = None
        for i, (lo, hi) in enumerate(prefix_slices(self.dims)):
            q_slice, c_slice = self.qf[start:end, lo:hi], self.cf[:, lo:hi]
            dots = q_slice @ c_slice.T if dots is None else dots.addmm_(q_slice, c_slice.T)
            logits = dots.clone()
            cos_t = self.to_logits(logits, rows, local, targets, self.q_inv[start:end, i], self.c_inv[:, i])
            yield i, dots, logits, cos_t

    def grad_cos(self, logits, local, targets, cos_t, positives, lse_all, lse_pos, row_scale):
        """dL/dcos of a block (scale included) from its logits and per-row logsumexps; overwrites nothing."""
        grad = torch.exp(logits - lse_all[:, None])  # softmax over the columns C_i
        if positives is None:
            grad[local, targets] -= 1.0
        else:
            grad -= torch.exp(logits - lse_pos[:, None]).masked_fill_(~positives, 0.0)
        grad.mul_(row_scale[:, None])  # dL/dcos_ij (scale included), but for the margin:
        if self.margin != 0.0:
            grad[local, targets] *= margin_logit(cos_t, self.margin)[1]
        return grad


def _block_lse(logits, local, targets, positives):
    """(logsumexp over C_i, logsumexp over P_i) of a block's logits."""
    lse_all = torch.logsumexp(logits, dim=1)
    if positives is None:
        return lse_all, logits[local, targets]
    return lse_all, torch.logsumexp(logits.masked_fill(~positives, float("-inf")), dim=1)


class SimilarityXentFunction(GradientsFormedInForward):
    """The loss, and with with_grad its gradients for grad_loss = 1, in one walk over the row blocks (module
    docstring); backward scales them."""

    @staticmethod
    def forward(ctx, q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids, with_grad):
        symmetric = c is None
        dtype = compute_dtype(q.dtype)
        qf, q_scale, q_squares = cosine_rows(q.detach())
        cf, c_scale, c_squares = (qf, q_scale, q_squares) if symmetric else cosine_rows(c.detach())
        q_inv, q_has_grad = inverse_norms(qf, q_scale, q_squares)
        c_inv, c_has_grad = (q_inv, q_has_grad) if symmetric else inverse_norms(cf, c_scale, c_squares)
        tiles = _Tiles(qf, cf, q_inv, c_inv, scale, target, exclude_diagonal, margin, group_ids)

        m = qf.shape[0]
        weights = torch.ones(m, dtype=dtype, device=q.device) if row_weights is None else row_weights.to(dtype)
        row_scale = weights * (scale / m)  # dL/dl_ij = row_scale_i * (softmax_all_ij - softmax_pos_ij)
        lse_all = torch.empty(m, dtype=dtype, device=q.device)
        lse_pos = torch.empty(m, dtype=dtype, device=q.device)
        # Gradients with respect to the normalised rows q_hat = q * q_inv and c_hat = c * c_inv; for the
        # in-batch-negative loss q and c are the same tensor and share one buffer.
        d_qhat = torch.zeros_like(qf) if with_grad else None
        d_chat = d_qhat if symmetric or not with_grad else torch.zeros_like(cf)
        for start, end in tiles.blocks():
            logits, local, targets, cos_t, positives = tiles.logits(start, end)
            lse_all[start:end], lse_pos[start:end] = _block_lse(logits, local, targets, positives)
            if not with_grad:
                continue
            grad = tiles.grad_cos(logits, local, targets, cos_t, positives, lse_all[start:end], lse_pos[start:end],
                                  row_scale[start:end])
            del logits
            # cos_ij = q_hat_i . c_hat_j  =>  dq_hat_i = sum_j grad_ij c_hat_j,  dc_hat_j = sum_i grad_ij q_hat_i
            d_qhat[start:end].addmm_(grad * c_inv[None, :], cf)
            d_chat.addmm_(grad.mul_(q_inv[start:end, None]).T, qf[start:end])
        loss = (weights * (lse_all - lse_pos)).sum() / m

        ctx.with_grad = with_grad
        ctx.input_dtypes = (q.dtype, None if symmetric else c.dtype)
        if with_grad:
            dq = normalise_backward(qf, q_inv, q_has_grad, d_qhat, q_scale)
            dc = None if symmetric else normalise_backward(cf, c_inv, c_has_grad, d_chat, c_scale)
            ctx.save_for_backward(dq, dc)
        return loss


class PrefixSimilarityXentFunction(torch.autograd.Function):
    """similarity_xent on every prefix of dims at once: a [k] loss (see the module docstring)."""

    @staticmethod
    def forward(ctx, q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids, dims):
        symmetric = c is None
        dtype = compute_dtype(q.dtype)
        qf, q_scale, _ = cosine_rows(q.detach())
        cf, c_scale, _ = (qf, q_scale, None) if symmetric else cosine_rows(c.detach())
        q_inv, q_has_grad = prefix_inverse_norms(qf, dims, q_scale)  # [M, k]
        c_inv, c_has_grad = (q_inv, q_has_grad) if symmetric else prefix_inverse_norms(cf, dims, c_scale)
        tiles = _Tiles(qf, cf, q_inv, c_inv, scale, target, exclude_diagonal, margin, group_ids, dims)

        m, k = qf.shape[0], len(dims)
        lse_all = torch.empty(m, k, dtype=dtype, device=q.device)
        lse_pos = torch.empty(m, k, dtype=dtype, device=q.device)
        for start, end in tiles.blocks():
            rows, local, targets, positives = tiles.rows(start, end)
            for i, _, logits, _ in tiles.prefix_logits(start, end, rows, local, targets):
                lse_all[start:end, i], lse_pos[start:end, i] = _block_lse(logits, local, targets, positives)

        weights = torch.ones(m, dtype=dtype, device=q.device) if row_weights is None else row_weights.to(dtype)
        loss = (weights[:, None] * (lse_all - lse_pos)).sum(dim=0) / m

        ctx.save_for_backward(qf, None if symmetric else cf, q_inv, c_inv, q_has_grad, c_has_grad, group_ids,
                              lse_all, lse_pos, weights, q_scale, None if symmetric else c_scale)
        ctx.options = (scale, target, exclude_diagonal, margin)
        ctx.dims = dims
        ctx.input_dtypes = (q.dtype, None if symmetric else c.dtype)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        (qf, cf, q_inv, c_inv, q_has_grad, c_has_grad, group_ids, lse_all, lse_pos, weights, q_scale,
         c_scale) = ctx.saved_tensors
        symmetric = cf is None
        cf = qf if symmetric else cf
        dims = ctx.dims
        tiles = _Tiles(qf, cf, q_inv, c_inv, *ctx.options, group_ids, dims)
        m, k = qf.shape[0], len(dims)
        slices = prefix_slices(dims)
        row_scale = weights[:, None] * (grad_loss.to(qf.dtype)[None, :] * tiles.scale / m)  # [M, k]

        # The raw gradients sum_i Ghat_i c[:, :d_i] (inverse norms included) and the radial sums of every prefix;
        # for the in-batch-negative loss q and c are the same tensor and share them.
        dq = torch.zeros_like(qf)
        dc = dq if symmetric else torch.zeros_like(cf)
        q_radial = torch.zeros(m, k, dtype=qf.dtype, device=qf.device)
        c_radial = q_radial if symmetric else torch.zeros(cf.shape[0], k, dtype=qf.dtype, device=qf.device)
        for start, end in tiles.blocks():
            rows, local, targets, positives = tiles.rows(start, end)
            g_hats = []
            for i, dots, logits, cos_t in tiles.prefix_logits(start, end, rows, local, targets):
                grad = tiles.grad_cos(logits, local, targets, cos_t, positives, lse_all[start:end, i],
                                      lse_pos[start:end, i], row_scale[start:end, i])
                del logits
                g_hat = grad.mul_(q_inv[start:end, i, None]).mul_(c_inv[None, :, i])
                radial = g_hat * dots  # sum_j Ghat_ij dots_ij = sum_j G_ij cos_ij
                q_radial[start:end, i] += radial.sum(dim=1)
                c_radial[:, i] += radial.sum(dim=0)
                del radial
                g_hats.append(g_hat)
            # Slice j belongs to the prefixes j .. k-1: walk down, adding each prefix's tile to the running sum.
            running = g_hats.pop()
            for j in reversed(range(k)):
                lo, hi = slices[j]
                dq[start:end, lo:hi].addmm_(running, cf[:, lo:hi])
                dc[:, lo:hi].addmm_(running.T, qf[start:end, lo:hi])
                if j:
                    running += g_hats.pop()

        q_dtype, c_dtype = ctx.input_dtypes
        dq = unscaled(_prefix_radial_backward(qf, q_inv, q_has_grad, q_radial, dq, slices), q_scale).to(q_dtype)
        dc = None if symmetric else unscaled(_prefix_radial_backward(cf, c_inv, c_has_grad, c_radial, dc, slices),
                                             c_scale).to(c_dtype)
        return dq, dc, None, None, None, None, None, None, None


def _prefix_radial_backward(x, inv, has_norm_grad, radial, d_raw, slices):
    """d_raw (overwritten) minus every prefix's radial term [|x| > eps] inv_i^2 radial_i x[:, :d_i]: on slice j,
    the sum of the terms of the prefixes i >= j."""
    shrink = torch.where(has_norm_grad, inv * inv * radial, torch.zeros_like(inv))  # [R, k]
    shrink = shrink.flip(1).cumsum(dim=1).flip(1)
    for j, (lo, hi) in enumerate(slices):
        d_raw[:, lo:hi].addcmul_(x[:, lo:hi], shrink[:, j, None], value=-1.0)
    return d_raw


def similarity_xent(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0, group_ids=None,
                    dims=None):
    if dims is not None:
        return PrefixSimilarityXentFunction.apply(q, c, scale, target, row_weights, exclude_diagonal, margin,
                                                  group_ids, dims)
    # The gradients are computed in forward when autograd will ask for them (module docstring).
    return SimilarityXentFunction.apply(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids,
                                        gradients_wanted(q, c))
