"""Softmax cross-entropy over cosine similarities, in row blocks: never the full M x Mc matrix.

Computes the contract's similarity_xent (see angle_kernels/dispatch.py), which covers the in-batch-negative
loss (q = c, diagonal excluded, partner targets, rows without a target weighted 0, identical texts as extra
positives), the contrastive loss with negatives (rectangular, diagonal targets) and ArcCon (diagonal targets
with an additive angular margin on the target logit):

    loss = (1/M) sum_i w_i * (logsumexp_{j in C_i} l_ij - logsumexp_{j in P_i} l_ij)

Rows are processed a block at a time against all columns: a block x Mc tile of cosines is one matrix product
of the raw rows, scaled by the inverse norms (no normalised copy of the inputs is made). Forward keeps two
numbers per row (the logsumexps); backward recomputes each tile and forms

    dL/dl_ij = w_i / M * (softmax_all_ij - softmax_pos_ij)

chains it through the margin on the target column, and accumulates the gradients of the normalised rows,
d q_hat = G c_hat and d c_hat += G^T q_hat. The normalisation's backward is applied once at the end:
dx = (d x_hat - x_hat (x_hat . d x_hat)) / |x| (just d x_hat / eps where the norm was clamped).
Peak extra memory is O(block x Mc) for the tile plus O((M + Mc) x D) for the gradients. When every row fits
in one block (M * Mc <= CHUNK_ELEMENTS, 16 MB of float32), forward keeps that single tile for backward
instead of recomputing it: the same memory bound, one matrix product fewer (3 instead of 4, like eager code).
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from ..contract import MARGIN_SIN_SQUARED_FLOOR, compute_dtype
from .common import inverse_norms, normalise_backward, rows_per_chunk


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

    def __init__(self, qf, cf, q_inv, c_inv, scale, target, exclude_diagonal, margin, group_ids):
        self.qf, self.cf, self.q_inv, self.c_inv = qf, cf, q_inv, c_inv
        self.scale, self.target, self.exclude_diagonal, self.margin = scale, target, exclude_diagonal, margin
        self.group_ids = group_ids
        self.block = rows_per_chunk(cf.shape[0])
        self.cached = None  # (logits, target cosines) of the only block, when there is one block

    @property
    def single_block(self) -> bool:
        return self.block >= self.qf.shape[0]

    def blocks(self):
        m = self.qf.shape[0]
        for start in range(0, m, self.block):
            yield start, min(m, start + self.block)

    def logits(self, start: int, end: int):
        """(logits [b, Mc], local row index, target columns, target cosines, positives mask or None)."""
        device = self.qf.device
        rows = torch.arange(start, end, device=device)
        local = rows - start
        targets = _target_columns(self.target, rows)
        if self.cached is not None:
            tile, cos_t = self.cached
        else:
            tile = self.qf[start:end] @ self.cf.T
            tile.mul_(self.q_inv[start:end, None]).mul_(self.c_inv[None, :])  # cosines
            cos_t = tile[local, targets].clone()
            tile.mul_(self.scale)
            if self.margin != 0.0:
                tile[local, targets] = self.scale * margin_logit(cos_t, self.margin)[0]
            if self.exclude_diagonal:
                tile[local, rows] = float("-inf")
        positives = None
        if self.group_ids is not None:
            g = self.group_ids
            positives = (g[None, :] == g[rows, None]) | (g[None, :] == g[targets, None])
            positives[local, targets] = True
            if self.exclude_diagonal:
                positives[local, rows] = False
        return tile, local, targets, cos_t, positives


class SimilarityXentFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids):
        symmetric = c is None
        dtype = compute_dtype(q.dtype)
        qf = q.detach().to(dtype)
        cf = qf if symmetric else c.detach().to(dtype)
        q_inv, q_has_grad = inverse_norms(qf)
        c_inv, c_has_grad = (q_inv, q_has_grad) if symmetric else inverse_norms(cf)
        tiles = _Tiles(qf, cf, q_inv, c_inv, scale, target, exclude_diagonal, margin, group_ids)

        m = qf.shape[0]
        lse_all = torch.empty(m, dtype=dtype, device=q.device)
        lse_pos = torch.empty(m, dtype=dtype, device=q.device)
        kept = (None, None)
        for start, end in tiles.blocks():
            logits, local, targets, cos_t, positives = tiles.logits(start, end)
            if tiles.single_block:
                kept = (logits, cos_t)
            lse_all[start:end] = torch.logsumexp(logits, dim=1)
            if positives is None:
                lse_pos[start:end] = logits[local, targets]
            else:
                lse_pos[start:end] = torch.logsumexp(logits.masked_fill(~positives, float("-inf")), dim=1)

        weights = torch.ones(m, dtype=dtype, device=q.device) if row_weights is None else row_weights.to(dtype)
        loss = (weights * (lse_all - lse_pos)).sum() / m

        ctx.save_for_backward(
            qf, None if symmetric else cf, q_inv, c_inv, q_has_grad, c_has_grad, group_ids, lse_all, lse_pos, weights,
            *kept,
        )
        ctx.options = (scale, target, exclude_diagonal, margin)
        ctx.input_dtypes = (q.dtype, None if symmetric else c.dtype)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        (qf, cf, q_inv, c_inv, q_has_grad, c_has_grad, group_ids, lse_all, lse_pos, weights,
         kept_logits, kept_cos_t) = ctx.saved_tensors
        symmetric = cf is None
        cf = qf if symmetric else cf
        tiles = _Tiles(qf, cf, q_inv, c_inv, *ctx.options, group_ids)
        if kept_logits is not None:
            tiles.cached = (kept_logits, kept_cos_t)
        m = qf.shape[0]
        row_scale = weights * (grad_loss.to(qf.dtype) * tiles.scale / m)

        # Gradients with respect to the normalised rows q_hat = q * q_inv and c_hat = c * c_inv; for the
        # in-batch-negative loss q and c are the same tensor and share one buffer.
        d_qhat = torch.zeros_like(qf)
        d_chat = d_qhat if symmetric else torch.zeros_like(cf)
        for start, end in tiles.blocks():
            logits, local, targets, cos_t, positives = tiles.logits(start, end)
            grad = torch.exp(logits - lse_all[start:end, None])  # softmax over the columns C_i
            if positives is None:
                grad[local, targets] -= 1.0
            else:
                grad -= torch.exp(logits - lse_pos[start:end, None]).masked_fill_(~positives, 0.0)
            grad.mul_(row_scale[start:end, None])  # dL/dcos_ij (scale included), but for the margin:
            if tiles.margin != 0.0:
                grad[local, targets] *= margin_logit(cos_t, tiles.margin)[1]
            # cos_ij = q_hat_i . c_hat_j  =>  dq_hat_i = sum_j grad_ij c_hat_j,  dc_hat_j = sum_i grad_ij q_hat_i
            d_qhat[start:end].addmm_(grad * c_inv[None, :], cf)
            d_chat.addmm_(grad.mul_(q_inv[start:end, None]).T, qf[start:end])

        q_dtype, c_dtype = ctx.input_dtypes
        dq = normalise_backward(qf, q_inv, q_has_grad, d_qhat).to(q_dtype)
        dc = None if symmetric else normalise_backward(cf, c_inv, c_has_grad, d_chat).to(c_dtype)
        return dq, dc, None, None, None, None, None, None


def similarity_xent(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0, group_ids=None,
                    dims=None):
    return SimilarityXentFunction.apply(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids)
