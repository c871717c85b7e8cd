"""Per-row log partition functions of cosine (or dot-product) scores, in row blocks: never the full M x Mc matrix.

Computes the contract's similarity_lse (see angle_kernels/dispatch.py), the building block of the
in-batch-negative family: joint and per-direction partitions, hardness-weighted negatives, guided (GIST) and
false-negative filtering. For row i with target column t_i = target_offset + i:

    l_ij   = scale * cos(q_i, c_j) + penalty * stop_gradient(cos(q_i, c_j)) * [j in H_i]
    lse_i  = logsumexp over the kept columns K_i of l_ij           (-inf when K_i is empty)

With normalize=False, cos is the raw dot product: the inverse norms are ones and no vector has a norm gradient,
so the same code computes it (the normalisation's backward reduces to the identity).

Rows are processed a block at a time against all columns, as in similarity_xent.py: a block x Mc tile of
cosines is one matrix product of the raw rows scaled by the inverse norms; the filter's tile (a second
product, of the filter embeddings) is recomputed in backward too, so only lse and the norms are kept.
Backward: dL/dcos_ij = g_i * scale * softmax_ij over K_i (the penalty is a stop-gradient, so it changes the
probabilities but not the slope), then the gradients of the normalised rows, d q_hat = G c_hat and
d c_hat += G^T q_hat, and the normalisation's backward once at the end.

Memory: a block holds `common.chunk_elements(device)` logits (CPU: 1 << 22; other devices: 1 << 25, 128 MB of
float32), b x Mc for b rows; at most three tile-sized float32 temporaries are alive at once (cosines, logits and
the penalty term or the filter's own cosines; in backward the logits, their shifted copy and the softmax) with up
to four boolean masks of the same shape (a quarter of a tile each), on top of O((M + Mc) x D) for the
compute-dtype copies and the gradients.

Huge rows: with normalize, q, c and the filter embeddings are taken scaled by a power of two per row
(torch_ops/common.py, row scaling: cosines do not change), the gradients multiplied by the scales at the end.
Raw dot products are not scale-invariant: normalize=False computes on the rows as given.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..contract import compute_dtype
from ..normalisation import normalise_backward
from .common import cosine_rows, inverse_norms, rows_per_chunk


def _scaling(x: torch.Tensor, normalize: bool):
    """(rows in the compute dtype, their scales or None, inverse norms, has-norm-gradient mask): with normalize
    cosine_rows (the rows scaled by their powers of two where needed: common.row_scales); for raw dot products the
    rows as they are, no scales, inverse norms of ones and all-False."""
    if normalize:
        xs, scale, squares = cosine_rows(x)
        return (xs, scale, *inverse_norms(xs, scale, squares))
    dtype = compute_dtype(x.dtype)
    ones = torch.ones(x.shape[0], dtype=dtype, device=x.device)
    return x.to(dtype), None, ones, torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a is b's data seen the same way (a filter input that is the op's own q or c, detached)."""
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride())


class _Tiles:
    """Recomputes the logits of one row block (kept columns only; the rest are -inf), identically in forward
    and backward."""

    def __init__(self, q_in, c_in, qf, cf, q_inv, c_inv, scale, target_offset, period, exclude, penalty, penalty_on,
                 filter_q, filter_c, filter_threshold, filter_keeps_target, normalize):
        self.qf, self.cf, self.q_inv, self.c_inv = qf, cf, q_inv, c_inv
        self.scale, self.target_offset, self.period = scale, target_offset, period
        self.exclude, self.penalty, self.penalty_on = exclude, penalty, penalty_on
        self.filter_threshold, self.filter_keeps_target = filter_threshold, filter_keeps_target
        # A filter on the model's own scores (filter_q, filter_c: q and c detached, the inputs q_in and c_in) reuses
        # the score tile.
        self.own_scores_filter = filter_threshold is not None and _same_values(filter_q, q_in) and _same_values(
            filter_c, c_in)
        if filter_threshold is not None and not self.own_scores_filter:
            self.filter_q, _, self.filter_q_inv, _ = _scaling(filter_q, normalize)
            self.filter_c, _, self.filter_c_inv, _ = _scaling(filter_c, normalize)
        self.block = rows_per_chunk(cf.shape[0], cf.device)

    def blocks(self):
        m = self.qf.shape[0]
        for start in range(0, m, self.block):
            yield start, min(m, start + self.block)

    def logits(self, start: int, end: int) -> torch.Tensor:
        device = self.qf.device
        targets = torch.arange(start, end, device=device)[:, None] + self.target_offset  # [b, 1]
        columns = torch.arange(self.cf.shape[0], device=device)[None, :]  # [1, Mc]
        is_target = columns == targets
        is_own = (columns % self.period == targets) if self.period > 0 else is_target

        cos = self.qf[start:end] @ self.cf.T
        cos.mul_(self.q_inv[start:end, None]).mul_(self.c_inv[None, :])
        logits = cos * self.scale
        if self.penalty != 0.0 and self.penalty_on != "none":
            # the columns without the penalty: every column but the hard ones
            if self.penalty_on == "other":
                soft = is_own
            elif self.penalty_on == "own":
                soft = ~is_own | is_target
            else:  # "all"
                soft = is_target
            logits += (self.penalty * cos).masked_fill_(soft, 0.0)
            del soft
        dropped = {"none": None, "target": is_target, "own": is_own}[self.exclude]
        if self.filter_threshold is not None:
            if self.own_scores_filter:
                guide = cos
            else:
                guide = self.filter_q[start:end] @ self.filter_c.T
                guide.mul_(self.filter_q_inv[start:end, None]).mul_(self.filter_c_inv[None, :])
            filtered = guide > self.filter_threshold[start:end, None]
            if self.filter_keeps_target:
                filtered &= ~is_target
            dropped = filtered if dropped is None else dropped | filtered
        if dropped is not None:
            logits.masked_fill_(dropped, float("-inf"))
        return logits


class SimilarityLseFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c,
                filter_threshold, filter_keeps_target, normalize):
        dtype = compute_dtype(q.dtype)
        q_in, c_in = q.detach(), c.detach()
        qf, q_scale, q_inv, q_has_grad = _scaling(q_in, normalize)
        cf, c_scale, c_inv, c_has_grad = _scaling(c_in, normalize)
        options = (scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c, filter_threshold,
                   filter_keeps_target, normalize)
        tiles = _Tiles(q_in, c_in, qf, cf, q_inv, c_inv, *options)
        lse = torch.empty(qf.shape[0], dtype=dtype, device=q.device)
        for start, end in tiles.blocks():
            lse[start:end] = torch.logsumexp(tiles.logits(start, end), dim=1)
        ctx.save_for_backward(q_in, c_in, qf, cf, q_inv, c_inv, q_has_grad, c_has_grad, lse, q_scale, c_scale)
        ctx.options = options
        ctx.input_dtypes = (q.dtype, c.dtype)
        return lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_lse):
        q_in, c_in, qf, cf, q_inv, c_inv, q_has_grad, c_has_grad, lse, q_scale, c_scale = ctx.saved_tensors
        tiles = _Tiles(q_in, c_in, qf, cf, q_inv, c_inv, *ctx.options)
        # Rows with no kept column (lse = -inf) have no softmax: their weight is 0, and their lse is replaced by
        # 0 so that exp(-inf - lse) is 0 rather than NaN.
        empty = torch.isneginf(lse)
        row_scale = torch.where(empty, torch.zeros_like(lse), grad_lse.to(qf.dtype) * tiles.scale)
        finite_lse = torch.where(empty, torch.zeros_like(lse), lse)
        d_qhat, d_chat = torch.zeros_like(qf), torch.zeros_like(cf)
        for start, end in tiles.blocks():
            grad = torch.exp(tiles.logits(start, end) - finite_lse[start:end, None])  # softmax over K_i
            grad.mul_(row_scale[start:end, None])  # dL/dcos_ij
            d_qhat[start:end].addmm_(grad * c_inv[None, :], cf)
            d_chat.addmm_(grad.mul_(q_inv[start:end, None]).T, qf[start:end])
            del grad  # before the next block's tile is made
        q_dtype, c_dtype = ctx.input_dtypes
        dq = normalise_backward(qf, q_inv, q_has_grad, d_qhat, q_scale).to(q_dtype)
        dc = normalise_backward(cf, c_inv, c_has_grad, d_chat, c_scale).to(c_dtype)
        return dq, dc, *([None] * 11)


def similarity_lse(q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c,
                   filter_threshold, filter_keeps_target, normalize):
    return SimilarityLseFunction.apply(q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q,
                                       filter_c, filter_threshold, filter_keeps_target, normalize)
