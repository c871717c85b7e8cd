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
Raw dot products (normalize=False) take the rows scaled the same way, so that no product of two entries overflows;
their scores are brought back to size by the inverse powers of two (exact), and a row's logits stay in its anchor
row's own scale, w_ij = s_i l_ij (bounded, whatever the rows' size), until its final value:
    lse_i = m_i / s_i + log sum_j exp((w_ij - m_i) / s_i),   m_i = max over the kept columns of w_ij,
which is the logsumexp of the logits (bit for bit the usual one for rows with s_i = 1) and never meets inf - inf:
logits beyond the compute dtype give lse_i = +inf, their true value's rounding, with a gradient that is exact (the
softmax, exp((w_ij - m_i) / s_i) / sum, is the hard maximum it then is). With `reference` (rows r [M, D]; dot
products only), the op returns lse_i - l(q_i, r_i), l(q_i, r_i) = scale * q_i . r_i, as (m_i - w(q_i, r_i)) / s_i +
log sum_j ...: exact also where both terms overflow and their difference does not (the loss of a huge row whose
positive dominates: 0). Where r_i is the row of row i's target column, its logit is read from the same score tile
as the target column's, so that a dominant positive gives exactly 0.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable

from ..contract import compute_dtype
from ..normalisation import normalise_backward, row_dots
from .common import cosine_rows, inverse_norms, rows_per_chunk, scaled_rows

FEATURES = ("reference",)  # the contract's optional features this op implements (contract.OPTIONAL_FEATURES)


def _scaling(x: torch.Tensor, normalize: bool):
    """(rows in the compute dtype, their scales or None, inverse norms, has-norm-gradient mask): with normalize
    cosine_rows (the rows scaled by their powers of two where needed: common.row_scales); for raw dot products the
    rows scaled by their powers of two (common.scaled_rows), their scales, the inverse scales 1/s in place of inverse
    norms (a scaled row times its 1/s is the row, exactly) and all-False (no norm, no norm gradient)."""
    if normalize:
        xs, scale, squares = cosine_rows(x)
        return (xs, scale, *inverse_norms(xs, scale, squares))
    xs, scale = scaled_rows(x)
    return xs, scale, scale.reciprocal(), torch.zeros(x.shape[0], dtype=torch.bool, device=x.device)


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a is b's data seen the same way (a filter input that is the op's own q or c, detached)."""
    return (a.data_ptr() == b.data_ptr() and a.dtype == b.dtype and a.shape == b.shape
            and a.stride() == b.stride())


class _Tiles:
    """Recomputes the logits of one row block (kept columns only; the rest are -inf), identically in forward
    and backward. Raw dot products (anchor_scale: the rows' powers of two s) come in their anchor row's scale,
    w = s_i * l_ij (module docstring); cosines as they are."""

    def __init__(self, q_in, c_in, qf, cf, q_inv, c_inv, scale, target_offset, period, exclude, penalty, penalty_on,
                 filter_q, filter_c, filter_threshold, filter_keeps_target, normalize, anchor_scale=None):
        self.qf, self.cf, self.q_inv, self.c_inv = qf, cf, q_inv, c_inv
        self.scale, self.target_offset, self.period = scale, target_offset, period
        self.exclude, self.penalty, self.penalty_on = exclude, penalty, penalty_on
        self.filter_threshold, self.filter_keeps_target = filter_threshold, filter_keeps_target
        self.anchor_scale = anchor_scale
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

    def logits(self, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the block's logits, -inf outside the kept columns; each row's target-column logit before the exclusions,
        0 where the target lies past the columns)."""
        device = self.qf.device
        targets = torch.arange(start, end, device=device)[:, None] + self.target_offset  # [b, 1]
        columns = torch.arange(self.cf.shape[0], device=device)[None, :]  # [1, Mc]
        is_target = columns == targets
        is_own = (columns % self.period == targets) if self.period > 0 else is_target

        cos = self.qf[start:end] @ self.cf.T
        if self.anchor_scale is None:
            cos.mul_(self.q_inv[start:end, None])
        cos.mul_(self.c_inv[None, :])  # dot products: s_i (q_i . c_j), their anchor row's scale kept
        logits = cos * self.scale
        target_logits = logits.gather(1, targets.clamp(max=self.cf.shape[0] - 1))[:, 0]
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
            threshold = self.filter_threshold[start:end, None]
            if self.own_scores_filter:
                guide = cos
                if self.anchor_scale is not None:  # compared in the anchor row's scale too (exact)
                    threshold = threshold * self.anchor_scale[start:end, None]
            else:
                guide = self.filter_q[start:end] @ self.filter_c.T
                guide.mul_(self.filter_q_inv[start:end, None]).mul_(self.filter_c_inv[None, :])
            filtered = guide > threshold
            if self.filter_keeps_target:
                filtered &= ~is_target
            dropped = filtered if dropped is None else dropped | filtered
        if dropped is not None:
            logits.masked_fill_(dropped, float("-inf"))
        return logits, target_logits

    def row_values(self, logits: torch.Tensor, start: int, end: int, reference: torch.Tensor | None) -> torch.Tensor:
        """Each row's value from its block of logits: the logsumexp (cosines); for dot products the module
        docstring's lse_i, less the reference logit (in the anchor row's scale, [b]) when one is given."""
        if self.anchor_scale is None:
            return torch.logsumexp(logits, dim=1)
        top = logits.amax(dim=1)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))  # a row without kept columns: -inf below
        inverse = self.q_inv[start:end]  # 1 / s_i
        spread = logits.sub_(top[:, None]).mul_(inverse[:, None]).exp_().sum(dim=1).log_()  # the tile's last use
        return (top if reference is None else top - reference).mul_(inverse).add_(spread)

    def softmax(self, logits: torch.Tensor, start: int, end: int, lse: torch.Tensor) -> torch.Tensor:
        """The softmax over each row's kept columns (rows without any: 0), from the row's logsumexp (cosines) or,
        for dot products, in the anchor row's scale (a hard maximum where the logits overflow, never inf - inf);
        formed in place of `logits` (one tile per block at a time)."""
        if self.anchor_scale is None:
            return logits.sub_(lse[start:end, None]).exp_()
        top = logits.amax(dim=1)
        top = torch.where(torch.isfinite(top), top, torch.zeros_like(top))
        weights = logits.sub_(top[:, None]).mul_(self.q_inv[start:end, None]).exp_()
        return weights.div_(weights.sum(dim=1, keepdim=True).clamp_min(torch.finfo(weights.dtype).tiny))


class SimilarityLseFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c,
                filter_threshold, filter_keeps_target, normalize, reference=None):
        dtype = compute_dtype(q.dtype)
        q_in, c_in = q.detach(), c.detach()
        qf, q_scale, q_inv, q_has_grad = _scaling(q_in, normalize)
        cf, c_scale, c_inv, c_has_grad = _scaling(c_in, normalize)
        options = (scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c, filter_threshold,
                   filter_keeps_target, normalize)
        tiles = _Tiles(q_in, c_in, qf, cf, q_inv, c_inv, *options, anchor_scale=None if normalize else q_scale)
        r_in = None if reference is None else reference.detach()
        references = None if r_in is None else _reference_logits(tiles, q_scale, c_in, r_in)
        lse = torch.empty(qf.shape[0], dtype=dtype, device=q.device)
        for start, end in tiles.blocks():
            logits, target_logits = tiles.logits(start, end)
            block_reference = None if references is None else _block_reference(references, target_logits, start, end)
            lse[start:end] = tiles.row_values(logits, start, end, block_reference)
            del logits  # before the next block's tile is made
        ctx.save_for_backward(q_in, c_in, qf, cf, q_inv, c_inv, q_has_grad, c_has_grad, lse, q_scale, c_scale, r_in)
        ctx.options = options
        ctx.input_dtypes = (q.dtype, c.dtype, None if reference is None else reference.dtype)
        return lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_lse):
        q_in, c_in, qf, cf, q_inv, c_inv, q_has_grad, c_has_grad, lse, q_scale, c_scale, r_in = ctx.saved_tensors
        normalize = ctx.options[-1]
        tiles = _Tiles(q_in, c_in, qf, cf, q_inv, c_inv, *ctx.options, anchor_scale=None if normalize else q_scale)
        # Rows with no kept column (lse = -inf) have no softmax: their weight is 0 (and for cosines their lse is
        # replaced by 0 so that exp(-inf - lse) is 0 rather than NaN).
        empty = torch.isneginf(lse)
        grad = grad_lse.to(qf.dtype)
        row_scale = torch.where(empty, torch.zeros_like(lse), grad * tiles.scale)
        finite_lse = torch.where(empty, torch.zeros_like(lse), lse)
        d_qhat, d_chat = torch.zeros_like(qf), torch.zeros_like(cf)
        for start, end in tiles.blocks():
            weights = tiles.softmax(tiles.logits(start, end)[0], start, end, finite_lse)  # softmax over K_i
            weights.mul_(row_scale[start:end, None])  # dL/dcos_ij (dL/ddot_ij)
            d_qhat[start:end].addmm_(weights * c_inv[None, :], cf)
            d_chat.addmm_(weights.mul_(q_inv[start:end, None]).T, qf[start:end])
            del weights  # before the next block's tile is made
        q_dtype, c_dtype, r_dtype = ctx.input_dtypes
        if normalize:
            dq = normalise_backward(qf, q_inv, q_has_grad, d_qhat, q_scale).to(q_dtype)
            dc = normalise_backward(cf, c_inv, c_has_grad, d_chat, c_scale).to(c_dtype)
            return dq, dc, *([None] * 12)
        # dot products: the scores' gradients are those of the rows themselves (no norm); the reference logit
        # scale * q_i . r_i enters with the opposite sign (its rows' gradient too)
        dr = None
        if r_in is not None:
            referenced = torch.where(empty, torch.zeros_like(grad), grad) * -tiles.scale
            rows = r_in.to(qf.dtype)
            d_qhat.addcmul_(rows, referenced[:, None])
            dr = (q_in.to(qf.dtype) * referenced[:, None]).to(r_dtype)  # a product: q_in may be the input itself
        return d_qhat.to(q_dtype), d_chat.to(c_dtype), *([None] * 11), dr


def _reference_logits(tiles: _Tiles, q_scale: torch.Tensor, c_in: torch.Tensor, r_in: torch.Tensor) -> tuple:
    """(every row's reference logit in its anchor row's scale, scale * s_i (q_i . r_i); whether r_i is the row of
    row i's target column, whose logit the score tile then gives: the same value from the same products)."""
    rows, r_scale = scaled_rows(r_in)
    logits = row_dots(tiles.qf, rows).mul_(r_scale.reciprocal()).mul_(tiles.scale)
    targets = torch.arange(r_in.shape[0], device=r_in.device) + tiles.target_offset
    in_range = targets < c_in.shape[0]
    same = in_range & (c_in[targets.clamp(max=c_in.shape[0] - 1)] == r_in).all(dim=1)
    return logits, same


def _block_reference(references: tuple, target_logits: torch.Tensor, start: int, end: int) -> torch.Tensor:
    logits, same = references
    return torch.where(same[start:end], target_logits, logits[start:end])


def similarity_lse(q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c,
                   filter_threshold, filter_keeps_target, normalize, reference=None):
    return SimilarityLseFunction.apply(q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q,
                                       filter_c, filter_threshold, filter_keeps_target, normalize, reference)
