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
from ..normalisation import unscaled
from .common import (
    cosine_rows,
    inverse_norms,
    logsumexp_in_place,
    prefix_inverse_norms,
    prefix_radial_backward,
    prefix_slices,
    rows_per_chunk,
    scaled_rows,
)

FEATURES = ("dims", "reference")  # the contract's optional features this op implements (contract.OPTIONAL_FEATURES)


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
                 filter_q, filter_c, filter_threshold, filter_keeps_target, normalize, anchor_scale=None,
                 filter_scaling=None):
        self.qf, self.cf, self.q_inv, self.c_inv = qf, cf, q_inv, c_inv
        self.scale, self.target_offset, self.period = scale, target_offset, period
        self.exclude, self.penalty, self.penalty_on = exclude, penalty, penalty_on
        self.filter_threshold, self.filter_keeps_target = filter_threshold, filter_keeps_target
        self.anchor_scale = anchor_scale
        # A filter on the model's own scores (filter_q, filter_c: q and c detached, the inputs q_in and c_in) reuses
        # the score tile.
        self.own_scores_filter = filter_threshold is not None and _same_values(filter_q, q_in) and _same_values(
            filter_c, c_in)
        if filter_scaling is not None:  # the prefixes' (_PrefixTiles): inverse norms [M, k]
            self.filter_q, self.filter_q_inv, self.filter_c, self.filter_c_inv = filter_scaling
        elif filter_threshold is not None and not self.own_scores_filter:
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
        cos = self.qf[start:end] @ self.cf.T
        if self.anchor_scale is None:
            cos.mul_(self.q_inv[start:end, None])
        cos.mul_(self.c_inv[None, :])  # dot products: s_i (q_i . c_j), their anchor row's scale kept
        guide = None
        if self.filter_threshold is not None and not self.own_scores_filter:
            guide = self.filter_q[start:end] @ self.filter_c.T
            guide.mul_(self.filter_q_inv[start:end, None]).mul_(self.filter_c_inv[None, :])
        return self.masked_logits(cos, start, end, self.filter_threshold, guide)

    def block_masks(self, start: int, end: int, columns: int) -> tuple:
        """What masked_logits reads of a block's indices, the same for every prefix: (each row's target column
        [b, 1], the columns without the penalty or None, the excluded columns or None, the columns a filter may
        drop (all but the target when filter_keeps_target) or None)."""
        device = self.qf.device
        targets = torch.arange(start, end, device=device)[:, None] + self.target_offset  # [b, 1]
        indices = torch.arange(columns, device=device)[None, :]  # [1, Mc]
        is_target = indices == targets
        is_own = (indices % self.period == targets) if self.period > 0 else is_target
        soft = None
        if self.penalty != 0.0 and self.penalty_on != "none":
            # the columns without the penalty: every column but the hard ones
            soft = {"other": is_own, "own": ~is_own | is_target, "all": is_target}[self.penalty_on]
        excluded = {"none": None, "target": is_target, "own": is_own}[self.exclude]
        filterable = ~is_target if self.filter_threshold is not None and self.filter_keeps_target else None
        return targets, soft, excluded, filterable

    def masked_logits(self, cos: torch.Tensor, start: int, end: int, filter_threshold: torch.Tensor | None,
                      guide: torch.Tensor | None, masks: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """logits' result from the block's score tile `cos` (cosines, or dot products in the anchor rows' scale),
        the filter's threshold [M] and, for a filter on other embeddings than q and c, its score tile `guide`;
        masks: the block's block_masks when already made."""
        targets, soft, excluded, filterable = self.block_masks(start, end, cos.shape[1]) if masks is None else masks
        logits = cos * self.scale
        target_logits = logits.gather(1, targets.clamp(max=cos.shape[1] - 1))[:, 0]
        if soft is not None:
            logits += (self.penalty * cos).masked_fill_(soft, 0.0)
        dropped = excluded
        if filter_threshold is not None:
            threshold = filter_threshold[start:end, None]
            if self.own_scores_filter:
                guide = cos
                if self.anchor_scale is not None:  # compared in the anchor row's scale too (exact)
                    threshold = threshold * self.anchor_scale[start:end, None]
            filtered = guide > threshold
            if filterable is not None:
                filtered &= filterable
            dropped = filtered if dropped is None else dropped | filtered
        if dropped is not None:
            logits.masked_fill_(dropped, float("-inf"))
        return logits, target_logits

    def row_values(self, logits: torch.Tensor, start: int, end: int, reference: torch.Tensor | None) -> torch.Tensor:
        """Each row's value from its block of logits: the logsumexp (cosines); for dot products the module
        docstring's lse_i, less the reference logit (in the anchor row's scale, [b]) when one is given."""
        if self.anchor_scale is None:
            return logsumexp_in_place(logits)  # the tile's last use
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


def _reference_logits(tiles: _Tiles, q_scale: torch.Tensor, c_in: torch.Tensor, r_in: torch.Tensor,
                      width: int | None = None) -> tuple:
    """(every row's reference logit in its anchor row's scale, scale * s_i (q_i . r_i); whether r_i is the row of
    row i's target column, whose logit the score tile then gives: the same value from the same products). width:
    the prefix whose logits these are (dims), else the whole rows."""
    rows, r_scale = scaled_rows(r_in)
    width = r_in.shape[1] if width is None else width
    logits = row_dots(tiles.qf[:, :width], rows[:, :width]).mul_(r_scale.reciprocal()).mul_(tiles.scale)
    targets = torch.arange(r_in.shape[0], device=r_in.device) + tiles.target_offset
    in_range = targets < c_in.shape[0]
    same = in_range & (c_in[targets.clamp(max=c_in.shape[0] - 1)] == r_in).all(dim=1)
    return logits, same


def _block_reference(references: tuple, target_logits: torch.Tensor, start: int, end: int) -> torch.Tensor:
    logits, same = references
    return torch.where(same[start:end], target_logits, logits[start:end])


# ---------------------------------------------------------------------------------------------------------
# dims: every prefix in one pass (cumulative products)
# ---------------------------------------------------------------------------------------------------------
def _prefix_scaling(x: torch.Tensor, normalize: bool, dims: tuple[int, ...]):
    """_scaling for every prefix of dims: (rows in the compute dtype, their scales or None, inverse norms [M, k],
    has-norm-gradient mask [M, k]); for raw dot products the inverse scales 1/s, the same for every prefix."""
    if normalize:
        xs, scale, _ = cosine_rows(x)
        return (xs, scale, *prefix_inverse_norms(xs, dims, scale))
    xs, scale = scaled_rows(x)
    k = len(dims)
    return (xs, scale, scale.reciprocal()[:, None].expand(-1, k),
            torch.zeros(x.shape[0], k, dtype=torch.bool, device=x.device))


def _prefix_dots(q: torch.Tensor, c: torch.Tensor, slices: list[tuple[int, int]]) -> torch.Tensor:
    """The dot tiles of every prefix of a row block q [b, D] against c [Mc, D], [k, b, Mc]: prefix p's is the
    running sum of the slice products over the slices up to p, so that all k cost one width's products."""
    dots = torch.empty(len(slices), q.shape[0], c.shape[0], dtype=q.dtype, device=q.device)
    for p, (lo, hi) in enumerate(slices):
        if p == 0:
            torch.mm(q[:, lo:hi], c[:, lo:hi].T, out=dots[0])
        else:
            torch.addmm(dots[p - 1], q[:, lo:hi], c[:, lo:hi].T, out=dots[p])
    return dots


class _PrefixTiles:
    """The logits of every prefix of a row block: one _Tiles (the options, the masks, the row values) and the
    prefixes' dot tiles, scaled by each prefix's inverse norms; the filter's tiles likewise, cut to the prefixes."""

    def __init__(self, q_in, c_in, qf, cf, q_inv, c_inv, options, dims, q_scale, filter_scaling):
        normalize = options[-1]
        self.qf, self.cf, self.q_inv, self.c_inv, self.dims = qf, cf, q_inv, c_inv, dims
        self.slices = prefix_slices(dims)
        # q_inv[:, 0] is each row's 1/s for dot products (the same for every prefix); unused for cosines
        self.tiles = _Tiles(q_in, c_in, qf, cf, q_inv[:, 0], c_inv[:, 0], *options,
                            anchor_scale=None if normalize else q_scale, filter_scaling=filter_scaling)
        self.filter_threshold = options[8]  # [k, M]
        filters = 2 if self.filter_threshold is not None and not self.tiles.own_scores_filter else 1
        self.block = rows_per_chunk(cf.shape[0] * (filters * len(dims) + 2), cf.device)

    def blocks(self):
        m = self.qf.shape[0]
        for start in range(0, m, self.block):
            yield start, min(m, start + self.block)

    def dots(self, start: int, end: int) -> torch.Tensor:
        return _prefix_dots(self.qf[start:end], self.cf, self.slices)

    def guides(self, start: int, end: int) -> torch.Tensor | None:
        """The filter's score tiles of every prefix [k, b, Mc] when it scores other embeddings than q and c."""
        tiles = self.tiles
        if self.filter_threshold is None or tiles.own_scores_filter:
            return None
        guides = _prefix_dots(tiles.filter_q[start:end], tiles.filter_c, self.slices)
        return guides.mul_(tiles.filter_q_inv[start:end].T[:, :, None]).mul_(tiles.filter_c_inv.T[:, None, :])

    def logits(self, dots: torch.Tensor, guides: torch.Tensor | None, p: int, start: int, end: int, masks: tuple):
        """_Tiles.logits of prefix p from its dot tile dots[p], turned into its score tile in place (and left so:
        backward reads it), with the block's masks (_Tiles.block_masks)."""
        cos = dots[p]
        if self.tiles.anchor_scale is None:
            cos.mul_(self.q_inv[start:end, p, None])
        cos.mul_(self.c_inv[None, :, p])
        threshold = None if self.filter_threshold is None else self.filter_threshold[p]
        return self.tiles.masked_logits(cos, start, end, threshold, None if guides is None else guides[p], masks)


class PrefixSimilarityLseFunction(torch.autograd.Function):
    """similarity_lse on every prefix of dims at once: [k, M] (dispatch's contract).

    Per row block, the dot tiles of the prefixes are running sums of the slice products (one width's 2 b Mc D
    FLOPs for all k), each scaled by its prefix's inverse norms into that prefix's scores, from which the one-width
    code (_Tiles.masked_logits, row_values, softmax) takes over. Backward forms the tiles again and walks the
    prefixes from the widest down, keeping the running sum H_j = sum_{p >= j} G_p of the gradient tiles of the raw
    dots (dL/dscore times the inverse norms), so that slice s_j's gradients take one product per side,
    dq[R, s_j] += H_j c[:, s_j] and dc[:, s_j] += H_j^T q[R, s_j]: one width's 4 b Mc D FLOPs. Each prefix's radial
    (norm) term comes from its tile (the torch similarity_xent dims path's radial sums) and is applied at the end,
    slice by slice. Raw dot products take no inverse norms in the running sum (every prefix's factor is the row's
    1/s) and their products the unscaled rows, so that huge rows never meet a product of two small factors."""

    @staticmethod
    def forward(ctx, q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c,
                filter_threshold, filter_keeps_target, normalize, dims, reference=None):
        dtype = compute_dtype(q.dtype)
        q_in, c_in = q.detach(), c.detach()
        qf, q_scale, q_inv, q_has_grad = _prefix_scaling(q_in, normalize, dims)
        cf, c_scale, c_inv, c_has_grad = _prefix_scaling(c_in, normalize, dims)
        options = (scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c, filter_threshold,
                   filter_keeps_target, normalize)
        tiles = _PrefixTiles(q_in, c_in, qf, cf, q_inv, c_inv, options, dims, q_scale,
                             _prefix_filter_scaling(q_in, c_in, filter_q, filter_c, filter_threshold, normalize,
                                                    dims))
        r_in = None if reference is None else reference.detach()
        references = None if r_in is None else [_reference_logits(tiles.tiles, q_scale, c_in, r_in, width=d)
                                                for d in dims]
        lse = torch.empty(len(dims), qf.shape[0], dtype=dtype, device=q.device)
        for start, end in tiles.blocks():
            dots, guides = tiles.dots(start, end), tiles.guides(start, end)
            masks = tiles.tiles.block_masks(start, end, cf.shape[0])
            for p in range(len(dims)):
                logits, target_logits = tiles.logits(dots, guides, p, start, end, masks)
                block_reference = None if references is None else _block_reference(references[p], target_logits,
                                                                                    start, end)
                lse[p, start:end] = tiles.tiles.row_values(logits, start, end, block_reference)
                del logits
            del dots, guides  # before the next block's tiles are made
        ctx.save_for_backward(q_in, c_in, qf, cf, q_inv, c_inv, q_has_grad, c_has_grad, lse, q_scale, c_scale, r_in)
        ctx.options, ctx.dims = options, dims
        ctx.input_dtypes = (q.dtype, c.dtype, None if reference is None else reference.dtype)
        return lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_lse):
        q_in, c_in, qf, cf, q_inv, c_inv, q_has_grad, c_has_grad, lse, q_scale, c_scale, r_in = ctx.saved_tensors
        options, dims = ctx.options, ctx.dims
        normalize = options[-1]
        tiles = _PrefixTiles(q_in, c_in, qf, cf, q_inv, c_inv, options, dims, q_scale,
                             _prefix_filter_scaling(q_in, c_in, *options[6:9], normalize, dims))
        slices = tiles.slices
        empty = torch.isneginf(lse)  # [k, M]: rows of a prefix with no kept column have no softmax
        grad = torch.where(empty, torch.zeros_like(lse), grad_lse.to(lse.dtype))
        row_scale = grad * tiles.tiles.scale
        finite_lse = torch.where(empty, torch.zeros_like(lse), lse)
        # the products' operands: the scaled rows for cosines (the inverse norms are in the tiles), the rows
        # themselves for dot products
        q_rows, c_rows = (qf, cf) if normalize else (q_in.to(qf.dtype), c_in.to(qf.dtype))
        dq, dc = torch.zeros_like(qf), torch.zeros_like(cf)
        k = len(dims)
        q_radial = torch.zeros(qf.shape[0], k, dtype=qf.dtype, device=qf.device)
        c_radial = torch.zeros(cf.shape[0], k, dtype=qf.dtype, device=qf.device)
        for start, end in tiles.blocks():
            dots, guides = tiles.dots(start, end), tiles.guides(start, end)
            masks = tiles.tiles.block_masks(start, end, cf.shape[0])
            running = None
            for j in reversed(range(k)):
                logits = tiles.logits(dots, guides, j, start, end, masks)[0]  # dots[j]: prefix j's scores
                weights = tiles.tiles.softmax(logits, start, end, finite_lse[j])  # dL/dscore / row_scale
                weights.mul_(row_scale[j, start:end, None])  # dL/dscore
                if normalize:
                    # the radial sums sum_c dL/dcos_ic cos_ic (= sum_c G_ic dots_ic, G the raw dots' gradient),
                    # from the score tile, which nothing reads afterwards
                    products = dots[j].mul_(weights)
                    q_radial[start:end, j] = products.sum(dim=1)
                    c_radial[:, j].add_(products.sum(dim=0))
                    weights.mul_(q_inv[start:end, j, None]).mul_(c_inv[None, :, j])  # G
                running = weights if running is None else running.add_(weights)
                del logits, weights
                lo, hi = slices[j]
                dq[start:end, lo:hi].addmm_(running, c_rows[:, lo:hi])
                dc[:, lo:hi].addmm_(running.T, q_rows[start:end, lo:hi])
            del dots, guides, running
        q_dtype, c_dtype, r_dtype = ctx.input_dtypes
        if normalize:
            dq = unscaled(prefix_radial_backward(qf, q_inv, q_has_grad, q_radial, dq, slices), q_scale)
            dc = unscaled(prefix_radial_backward(cf, c_inv, c_has_grad, c_radial, dc, slices), c_scale)
            return dq.to(q_dtype), dc.to(c_dtype), *([None] * 13)
        dr = None
        if r_in is not None:  # the reference logits scale * q_i . r_i of every prefix, with the opposite sign
            referenced = (grad * -tiles.tiles.scale).flip(0).cumsum(dim=0).flip(0)  # [k, M]: slice j's sum
            rows, q_rows = r_in.to(qf.dtype), q_in.to(qf.dtype)
            dr = torch.empty_like(rows)
            for j, (lo, hi) in enumerate(slices):
                dq[:, lo:hi].addcmul_(rows[:, lo:hi], referenced[j, :, None])
                torch.mul(q_rows[:, lo:hi], referenced[j, :, None], out=dr[:, lo:hi])
            dr[:, dims[-1]:] = 0.0
            dr = dr.to(r_dtype)
        return dq.to(q_dtype), dc.to(c_dtype), *([None] * 12), dr


def _prefix_filter_scaling(q_in, c_in, filter_q, filter_c, filter_threshold, normalize, dims):
    """(filter rows, their inverse norms [M, k]) of both sides for a filter on other embeddings than q and c, cut
    to the prefixes; None without one or for a filter on the model's own scores (which reuses the score tiles)."""
    if filter_threshold is None or (_same_values(filter_q, q_in) and _same_values(filter_c, c_in)):
        return None
    fq, _, fq_inv, _ = _prefix_scaling(filter_q, normalize, dims)
    fc, _, fc_inv, _ = _prefix_scaling(filter_c, normalize, dims)
    return fq, fq_inv, fc, fc_inv


def similarity_lse(q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c,
                   filter_threshold, filter_keeps_target, normalize, dims=None, reference=None):
    if dims is not None:
        return PrefixSimilarityLseFunction.apply(q, c, scale, target_offset, period, exclude, penalty, penalty_on,
                                                 filter_q, filter_c, filter_threshold, filter_keeps_target, normalize,
                                                 dims, reference)
    return SimilarityLseFunction.apply(q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q,
                                       filter_c, filter_threshold, filter_keeps_target, normalize, reference)
