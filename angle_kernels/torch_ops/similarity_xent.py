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
would take four. The normalisation's backward is applied once at the end (angle_kernels.normalisation).

Nested prefixes (dims = (d_1 < ... < d_k), `PrefixSimilarityXentFunction`): one loss per prefix, each with its own
norms. A block's dot tiles, one per prefix, are held together as one [k, block, Mc] tensor: prefix i's is the
running sum of the slice products q[blk, s_j] @ c[:, s_j]^T over the slices s_j = [d_{j-1}, d_j), j <= i, each
product written into its place, so q and c are read once per block for all prefixes. Forward turns the k tiles
into logits in place and takes their logsumexps (and the target columns, the margin, the excluded diagonal) for
all prefixes at once: per block, k matrix products and a dozen ops whatever k (on a GPU every op is a launch).
The gradients walk the prefixes from the widest down: prefix j's gradient tile Ghat_j (its inverse norms and
grad_loss_j folded in) is formed from its dot tile (whose place then takes Ghat_j * dots_j, the products of its
radial sums) and added at once into the running sum of the prefixes i >= j, which, since slice j belongs to every
prefix i >= j, takes slice j's two matrix products (dq and dc); each prefix's radial term is applied once at the
end, slice by slice. The loss is a [k] vector, so its gradients depend on grad_loss's direction, which forward does
not know: the default path forms them in forward, from the dot tiles it holds (its logits then made beside them,
a prefix at a time), for the grad_loss the last backward of the same kind received (ones at first: equal weights),
and backward returns them when its grad_loss equals that one (bit for bit what it would compute), else recomputes
the dot tiles and forms them for its own. On the CPU only (reading grad_loss elsewhere waits for the device). A
training loop weights the prefixes the same way at every step: from its second step, the products total
one width's, 6 M Mc D (2 forward, 4 for the gradients), not 8 (tests/test_matryoshka_flops.py). The mixed path
forms them in backward.

Memory. The blocks hold `common.chunk_elements(device)` logits (CPU: 1 << 22; other devices: 1 << 25, 128 MB of
float32): a block of b rows takes b x Mc of them, and with dims b x Mc x (k + 1). Tile-sized temporaries alive at
once: full width 3 (the logits, the softmax and one product's operand or a subtraction), 4 with group_ids (the
positives' softmax) plus two boolean masks; with dims the k dot tiles and 2 more (a gradient tile and the running
sum; 3 with group_ids), at most (k + 3) / (k + 1) of a piece. On top of them, O((M + Mc) x D) for the compute-dtype
copies and the gradients.

Huge rows: q and c are taken scaled by a power of two per row (torch_ops/common.py, row scaling), in the
compute-dtype copy the ops make anyway; every formula runs on the scaled rows, and the gradients are multiplied by
the scales once at the end. The derivations: docs/torch-similarity.md.

Code paths (PATHS; `code_path` names the one a call takes where the backend may take its GPU path, which dispatch
decides). "default": the products in the compute dtype, float32 copies of 16-bit inputs included; the arithmetic the
CPU suite verifies, allowed everywhere. On CPU tensors its full-width calls compute in the softmax form instead
(_similarity_xent_softmax.py: the same schedule with fewer passes over each tile; similarity_xent_paths.py, the
op module the backend names, routes them): the blocked form here is what the default path runs on a GPU.
"mixed": 16-bit inputs on a GPU whose torch has products of 16-bit operands with float32 accumulation and output
(common.mixed_products), the Triton dense scheme's arithmetic: the logits from
the 16-bit rows (bfloat16 scaled by their powers of two; common.half_rows), the gradient tiles rounded to the input
dtype with only w_i / max|w| (and with dims grad_loss_i / max|grad_loss|) in them, multiplied by unit rows (full
width; with dims, each slice divided by the norm of the prefix it ends, so every operand entry is at most 1), and
max|w| / M, the inverse norms and the upstream gradient applied to the float32 sums (`MixedSimilarityXentFunction`,
`MixedPrefixSimilarityXentFunction`). The same tile code as "default" (_Tiles), the products by common.product_into;
on the CPU (tests) its products convert the 16-bit operands to float32: the same values. Not verified on a GPU yet:
dispatch takes it only where it is (angle_kernels.verified).
"""

from __future__ import annotations

import math

import torch
from torch.autograd.function import once_differentiable

from ..contract import MARGIN_SIN_SQUARED_FLOOR, compute_dtype
from ..formed_gradients import GradientsFormedInForward, gradients_wanted
from ..normalisation import normalise_backward, unscaled
from .common import (
    cosine_rows,
    half_rows,
    inverse_norms,
    logsumexp_in_place,
    normalise_backward_of_rows,
    prefix_inverse_norms,
    prefix_radial_backward,
    prefix_slices,
    product_into,
    products,
    rows_per_chunk,
    takes_mixed_products,
    unit_rows,
    unit_slices,
)

FEATURES = ("dims",)  # the contract's optional features this op implements (contract.OPTIONAL_FEATURES)
PATHS = ("default", "mixed")  # module docstring


def code_path(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0, group_ids=None,
              dims=None) -> str:
    """The path a call takes where the backend may take its GPU path: "mixed" for 16-bit rows on a device with
    mixed-dtype products (common.takes_mixed_products), "default" otherwise."""
    return "mixed" if takes_mixed_products(q) else "default"


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
        # With dims, a block holds the k prefixes' dot tiles at once (see the module docstring).
        self.block = rows_per_chunk(cf.shape[0] * (1 if dims is None else len(dims) + 1), cf.device)

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
        tile = products(self.qf[start:end], self.cf.T)
        cos_t = self.to_logits(tile, rows, local, targets, self.q_inv[start:end], self.c_inv)
        return tile, local, targets, cos_t, positives

    def prefix_dots(self, start: int, end: int) -> torch.Tensor:
        """The dot tiles of every prefix of a row block, [k, b, Mc]: prefix i's is the running sum of the slice
        products q[blk, s_j] @ c[:, s_j]^T over j <= i, each product written into its place."""
        q, c = self.qf[start:end], self.cf
        dots = torch.empty(len(self.dims), end - start, c.shape[0], dtype=self.q_inv.dtype, device=q.device)
        for i, (lo, hi) in enumerate(prefix_slices(self.dims)):
            product_into(dots[i], q[:, lo:hi], c[:, lo:hi].T, add=None if i == 0 else dots[i - 1])
        return dots

    def prefix_margins(self, dots, start: int, end: int, local, targets):
        """(scale * margin logit, its slope) of every prefix's target column, [k, b] each, from a block's dot tiles
        (before they are changed): None without a margin. The target cosines are computed as in the tiles."""
        if self.margin == 0.0:
            return None
        rows_inv, columns_inv = self.q_inv[start:end].T, self.c_inv[targets].T  # [k, b]
        cos_t = dots[:, local, targets].mul_(rows_inv).mul_(columns_inv)
        value, slope = margin_logit(cos_t, self.margin)
        return value.mul_(self.scale), slope

    def prefix_logits(self, dots, row_factor, column_factor, rows, local, targets, margin_logits, in_place: bool):
        """The logits of a block from its dot tiles: dots [k, b, Mc] (every prefix) or [b, Mc] (one prefix),
        row_factor scale * q_inv ([k, b] or [b]), column_factor c_inv ([k, Mc] or [Mc]), margin_logits the
        matching part of prefix_margins' first output or None; in place, or into a new tile. Forward and backward
        compute them identically from the same dots."""
        if in_place:
            logits = dots.mul_(row_factor[..., :, None])
        else:
            logits = torch.mul(dots, row_factor[..., :, None])
        logits.mul_(column_factor[..., None, :])
        if margin_logits is not None:
            logits[..., local, targets] = margin_logits
        if self.exclude_diagonal:
            logits[..., local, rows] = float("-inf")
        return logits

    def walk(self, row_scale, add_gradients=None):
        """(lse_all, lse_pos) [M] of the full-width loss, one row block at a time; with add_gradients, each block's
        dL/dcos tile (grad_cos with row_scale's rows) is handed to add_gradients(grad, start, end) while the block is
        held."""
        m = self.qf.shape[0]
        lse_all = torch.empty(m, dtype=row_scale.dtype, device=row_scale.device)
        lse_pos = torch.empty(m, dtype=row_scale.dtype, device=row_scale.device)
        for start, end in self.blocks():
            logits, local, targets, cos_t, positives = self.logits(start, end)
            lse_all[start:end], lse_pos[start:end] = _block_lse(logits, local, targets, positives)
            if add_gradients is None:
                del logits  # before the next block's tile is made
                continue
            grad = self.grad_cos(logits, local, targets, cos_t, positives, lse_all[start:end], lse_pos[start:end],
                                 row_scale[start:end])
            del logits
            add_gradients(grad, start, end)
            del grad
        return lse_all, lse_pos

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
        # Gradients with respect to the normalised rows q_hat = q * q_inv and c_hat = c * c_inv; for the
        # in-batch-negative loss q and c are the same tensor and share one buffer.
        d_qhat = torch.zeros_like(qf) if with_grad else None
        d_chat = d_qhat if symmetric or not with_grad else torch.zeros_like(cf)

        def add_gradients(grad, start, end):
            # cos_ij = q_hat_i . c_hat_j  =>  dq_hat_i = sum_j grad_ij c_hat_j,  dc_hat_j = sum_i grad_ij q_hat_i
            d_qhat[start:end].addmm_(grad * c_inv[None, :], cf)
            d_chat.addmm_(grad.mul_(q_inv[start:end, None]).T, qf[start:end])

        lse_all, lse_pos = tiles.walk(row_scale, add_gradients if with_grad else None)
        loss = (weights * (lse_all - lse_pos)).sum() / m

        ctx.with_grad = with_grad
        ctx.input_dtypes = (q.dtype, None if symmetric else c.dtype)
        if with_grad:
            dq = normalise_backward(qf, q_inv, q_has_grad, d_qhat, q_scale)
            dc = None if symmetric else normalise_backward(cf, c_inv, c_has_grad, d_chat, c_scale)
            ctx.save_for_backward(dq, dc)
        return loss


class MixedSimilarityXentFunction(GradientsFormedInForward):
    """SimilarityXentFunction on the "mixed" path (module docstring): the same walk over the row blocks, with the
    16-bit rows as the logits' operands and each block's gradient tile rounded to the input dtype and multiplied by
    16-bit unit rows, float32 accumulation throughout."""

    @staticmethod
    def forward(ctx, q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids, with_grad):
        symmetric = c is None
        dtype = compute_dtype(q.dtype)
        qs, q_scale = half_rows(q.detach())
        cs, c_scale = (qs, q_scale) if symmetric else half_rows(c.detach())
        q_inv, q_has_grad = inverse_norms(qs, q_scale)
        c_inv, c_has_grad = (q_inv, q_has_grad) if symmetric else inverse_norms(cs, c_scale)
        tiles = _Tiles(qs, cs, q_inv, c_inv, scale, target, exclude_diagonal, margin, group_ids)

        m = qs.shape[0]
        weights = torch.ones(m, dtype=dtype, device=q.device) if row_weights is None else row_weights.to(dtype)
        # The tiles carry w_i / max|w| times scale, at most scale (times the margin's slope) in magnitude, never 1/M
        # nor the inverse norms (16 bits would underflow or overflow); max|w| / M multiplies the float32 sums.
        weight_max = weights.abs().max().clamp_min(torch.finfo(dtype).tiny)
        tile_scale = weights / weight_max * scale
        if with_grad:
            q_hat = unit_rows(qs, q_inv)
            c_hat = q_hat if symmetric else unit_rows(cs, c_inv)
            d_qhat = torch.zeros(qs.shape, dtype=dtype, device=q.device)  # one buffer when c is q
            d_chat = d_qhat if symmetric else torch.zeros(cs.shape, dtype=dtype, device=q.device)

        def add_gradients(grad, start, end):
            tile = grad.to(q.dtype)
            product_into(d_qhat[start:end], tile, c_hat, add=d_qhat[start:end])
            product_into(d_chat, tile.T, q_hat[start:end], add=d_chat)

        lse_all, lse_pos = tiles.walk(tile_scale, add_gradients if with_grad else None)
        loss = (weights * (lse_all - lse_pos)).sum() / m

        ctx.with_grad = with_grad
        ctx.input_dtypes = (q.dtype, None if symmetric else c.dtype)
        if with_grad:
            q_hat = c_hat = None  # before the normalisation's backward
            unscale = weight_max / m
            dq = normalise_backward_of_rows(qs, q_inv, q_has_grad, d_qhat.mul_(unscale), q_scale)
            dc = None if symmetric else normalise_backward_of_rows(cs, c_inv, c_has_grad, d_chat.mul_(unscale),
                                                                   c_scale)
            ctx.save_for_backward(dq, dc)
        return loss


def _prefix_losses(ctx, q, c, qf, cf, q_scale, c_scale, scale, target, row_weights, exclude_diagonal, margin,
                   group_ids, dims, on_block=None):
    """The forward of both dims Functions, from their operands qf and cf (cf None when c is q): the [k] losses; saves
    what backward needs. on_block(tiles, start, end, dots, lse_all, lse_pos, weights, q_has_grad, c_has_grad), when
    given, is called for each row block once its logsumexps are known, with its dot tiles intact (the logits are
    then made prefix by prefix beside them)."""
    symmetric = c is None
    cf = qf if symmetric else cf
    dtype = compute_dtype(q.dtype)
    q_inv, q_has_grad = prefix_inverse_norms(qf, dims, q_scale)  # [M, k]
    c_inv, c_has_grad = (q_inv, q_has_grad) if symmetric else prefix_inverse_norms(cf, dims, c_scale)
    tiles = _Tiles(qf, cf, q_inv, c_inv, scale, target, exclude_diagonal, margin, group_ids, dims)

    m, k = qf.shape[0], len(dims)
    lse_all = torch.empty(m, k, dtype=dtype, device=q.device)
    lse_pos = torch.empty(m, k, dtype=dtype, device=q.device)
    c_factor = c_inv.T.contiguous()  # [k, Mc]: each prefix's inverse norms as a contiguous row
    weights = torch.ones(m, dtype=dtype, device=q.device) if row_weights is None else row_weights.to(dtype)
    for start, end in tiles.blocks():
        rows, local, targets, positives = tiles.rows(start, end)
        dots = tiles.prefix_dots(start, end)
        margins = tiles.prefix_margins(dots, start, end, local, targets)
        row_factor = (q_inv[start:end] * scale).T
        not_positive = None if positives is None else ~positives
        if on_block is None:  # every prefix's logits at once, in place of the dots
            logits = tiles.prefix_logits(dots, row_factor, c_factor, rows, local, targets,
                                         None if margins is None else margins[0], in_place=True)
            if positives is None:
                lse_pos[start:end] = logits[:, local, targets].T
            else:
                for i in range(k):
                    lse_pos[start:end, i] = logsumexp_in_place(logits[i].masked_fill(not_positive, float("-inf")))
            lse_all[start:end] = logsumexp_in_place(logits).T
            del dots, logits
            continue
        for i in range(k):  # a prefix at a time, beside the dots (which on_block takes)
            logits = tiles.prefix_logits(dots[i], row_factor[i], c_factor[i], rows, local, targets,
                                         None if margins is None else margins[0][i], in_place=False)
            if positives is None:
                lse_pos[start:end, i] = logits[local, targets]
            else:
                lse_pos[start:end, i] = logsumexp_in_place(logits.masked_fill(not_positive, float("-inf")))
            lse_all[start:end, i] = logsumexp_in_place(logits)
            del logits
        on_block(tiles, start, end, dots, lse_all, lse_pos, weights, q_has_grad, c_has_grad)
        del dots

    loss = (weights[:, None] * (lse_all - lse_pos)).sum(dim=0) / m

    ctx.save_for_backward(qf, None if symmetric else cf, q_inv, c_inv, q_has_grad, c_has_grad, group_ids,
                          lse_all, lse_pos, weights, q_scale, None if symmetric else c_scale)
    ctx.options = (scale, target, exclude_diagonal, margin)
    ctx.dims = dims
    ctx.input_dtypes = (q.dtype, None if symmetric else c.dtype)
    return loss


def _prefix_gradient_tiles(tiles, start, end, lse_all, lse_pos, c_factor, row_factor, dots=None):
    """(dots, gradient) of a row block of the dims backward: its dot tiles [k, b, Mc] (prefix_dots, recomputed as in
    forward), and gradient(j), a new tile: prefix j's dL/dlogit (softmax over C_i minus softmax over P_i) times
    row_factor[j] ([k, b]) per row, the target column's entry (the one-hot's -1, the margin's slope) included,
    formed from dots[j] (which the caller may overwrite afterwards). dots: the block's dot tiles where forward holds
    them (not recomputed)."""
    rows, local, targets, positives = tiles.rows(start, end)
    dots = tiles.prefix_dots(start, end) if dots is None else dots
    margins = tiles.prefix_margins(dots, start, end, local, targets)
    logit_factor = (tiles.q_inv[start:end] * tiles.scale).T  # [k, b]
    target_grads = _target_grads(lse_all[start:end].T, lse_pos[start:end].T, row_factor, margins,
                                 positives is not None)
    not_positive = None if positives is None else ~positives

    def gradient(j: int) -> torch.Tensor:
        g_hat = tiles.prefix_logits(dots[j], logit_factor[j], c_factor[j], rows, local, targets,
                                    None if margins is None else margins[0][j], in_place=False)
        softmax_pos = None
        if not_positive is not None:
            softmax_pos = torch.sub(g_hat, lse_pos[start:end, j, None]).exp_().masked_fill_(not_positive, 0.0)
        g_hat.sub_(lse_all[start:end, j, None]).exp_()  # softmax over the columns C_i
        if softmax_pos is not None:
            g_hat.sub_(softmax_pos)
            del softmax_pos
        g_hat.mul_(row_factor[j, :, None])
        if target_grads is not None:  # the target column: the -1 of the one-hot, the margin's slope
            g_hat[local, targets] = target_grads[j]
        return g_hat

    return dots, gradient


# The upstream gradient (grad_loss [k], as float64 on the CPU) the last dims backward of each kind of call (dims and
# the options that tell one loss from another) received: the one its next forward forms the gradients for
# (PrefixSimilarityXentFunction). A training loop weights the prefixes the same way at every step. Used only when the
# next backward's grad_loss is equal to it, value for value: the gradients are then those backward would compute, bit
# for bit, whatever ran before (a resumed run equals an uninterrupted one).
_LAST_UPSTREAM: dict = {}


def _upstream(grad_loss: torch.Tensor) -> torch.Tensor | None:
    """grad_loss's values as a CPU float64 tensor (exact for every floating dtype); None on the meta device."""
    return None if grad_loss.is_meta else grad_loss.detach().to("cpu", torch.float64)


class _PrefixGradients:
    """The gradients of the dims loss for one upstream gradient grad_loss [k], summed over the row blocks
    (add_block) and finished by the radial terms (finish)."""

    def __init__(self, qf, cf, q_inv, c_inv, weights, grad_loss, scale, symmetric, dims):
        m, k = qf.shape[0], len(dims)
        self.qf, self.cf, self.q_inv, self.c_inv, self.symmetric = qf, cf, q_inv, c_inv, symmetric
        self.slices = prefix_slices(dims)
        # dL/dl_ij of prefix p = row_scale_ip * (softmax_all - softmax_pos); folded with q_inv into one row factor.
        self.row_scale = weights[:, None] * (grad_loss.to(qf.dtype)[None, :] * scale / m)  # [M, k]
        self.c_factor = c_inv.T.contiguous()  # [k, Mc]
        # The raw gradients sum_i Ghat_i c[:, :d_i] (inverse norms included) and the radial sums of every prefix;
        # for the in-batch-negative loss q and c are the same tensor and share them.
        self.dq = torch.zeros_like(qf)
        self.dc = self.dq if symmetric else torch.zeros_like(cf)
        self.q_radial = torch.zeros(m, k, dtype=qf.dtype, device=qf.device)
        self.c_radial = self.q_radial if symmetric else torch.zeros(cf.shape[0], k, dtype=qf.dtype, device=qf.device)

    def add_block(self, tiles, start, end, lse_all, lse_pos, dots=None):
        """Add a row block's terms; dots: its dot tiles where the caller holds them (overwritten), else recomputed."""
        qf, cf, dq, dc = self.qf, self.cf, self.dq, self.dc
        grad_factor = (self.row_scale[start:end] * self.q_inv[start:end]).T  # [k, b]
        dots, gradient = _prefix_gradient_tiles(tiles, start, end, lse_all, lse_pos, self.c_factor, grad_factor, dots)
        running = None  # sum over the prefixes i >= j of Ghat_i, walking j down from the widest prefix
        for j in reversed(range(len(self.slices))):
            g_hat = gradient(j)
            g_hat.mul_(self.c_factor[j, None, :])  # Ghat_j = dL/dcos * q_inv * c_inv
            dots[j].mul_(g_hat)  # Ghat_j * dots_j: its row and column sums are the radial sums
            running = g_hat if running is None else running.add_(g_hat)
            del g_hat
            lo, hi = self.slices[j]
            dq[start:end, lo:hi].addmm_(running, cf[:, lo:hi])
            dc[:, lo:hi].addmm_(running.T, qf[start:end, lo:hi])
        self.q_radial[start:end].add_(dots.sum(dim=2).T)  # sum_j Ghat_ij dots_ij
        self.c_radial.add_(dots.sum(dim=1).T)

    def finish(self, q_has_grad, c_has_grad, q_scale, c_scale):
        """(dq, dc) in the compute dtype (dc None when c is q)."""
        dq = unscaled(prefix_radial_backward(self.qf, self.q_inv, q_has_grad, self.q_radial, self.dq, self.slices),
                      q_scale)
        dc = None if self.symmetric else unscaled(prefix_radial_backward(
            self.cf, self.c_inv, c_has_grad, self.c_radial, self.dc, self.slices), c_scale)
        return dq, dc


class PrefixSimilarityXentFunction(torch.autograd.Function):
    """similarity_xent on every prefix of dims at once: a [k] loss (see the module docstring).

    On the CPU, when autograd will ask for its gradients, forward forms them for the upstream gradient the last
    backward of these dims received (ones the first time), in the same walk over the row blocks, from
    the dot tiles it holds: the products total one width's (2 M Mc D forward, 4 M Mc D for the gradients), where
    forming them in backward would recompute the dots (8 M Mc D). Backward returns them when its grad_loss equals
    that one, value for value (they are then bit for bit what it would compute), else computes them for its own (and
    remembers it). On other devices backward computes them: reading grad_loss would wait for the device."""

    @staticmethod
    def forward(ctx, q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids, dims, with_grad):
        qf, q_scale, _ = cosine_rows(q.detach())
        cf, c_scale, _ = (None, q_scale, None) if c is None else cosine_rows(c.detach())
        ctx.formed = None
        ctx.kind = (tuple(dims), c is None, target, exclude_diagonal, margin, group_ids is None, row_weights is None)
        on_block = None
        if with_grad and q.device.type == "cpu":
            direction = _LAST_UPSTREAM.get(ctx.kind)
            direction = torch.ones(len(dims), dtype=torch.float64) if direction is None else direction
            formed, has_grads = [], []

            def on_block(tiles, start, end, dots, lse_all, lse_pos, weights, q_has_grad, c_has_grad):
                if not formed:
                    has_grads.extend((q_has_grad, c_has_grad))
                    formed.append(_PrefixGradients(tiles.qf, tiles.cf, tiles.q_inv, tiles.c_inv, weights,
                                                   direction.to(tiles.qf.device), tiles.scale, c is None, dims))
                formed[0].add_block(tiles, start, end, lse_all, lse_pos, dots)

        loss = _prefix_losses(ctx, q, c, qf, cf, q_scale, c_scale, scale, target, row_weights, exclude_diagonal,
                              margin, group_ids, dims, on_block)
        if on_block is not None:
            gradients = formed[0].finish(*has_grads, q_scale, c_scale) if formed else None
            ctx.formed = (direction, gradients)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        formed, ctx.formed = ctx.formed, None
        if formed is not None:  # the CPU: reading grad_loss costs no wait
            upstream = _upstream(grad_loss)
            formed_for, gradients = formed
            if upstream is not None and gradients is not None and torch.equal(upstream, formed_for):
                (dq, dc), (q_dtype, c_dtype) = gradients, ctx.input_dtypes
                return (dq.to(q_dtype), None if dc is None else dc.to(c_dtype),
                        None, None, None, None, None, None, None, None)
            if upstream is not None:
                _LAST_UPSTREAM[ctx.kind] = upstream
        (qf, cf, q_inv, c_inv, q_has_grad, c_has_grad, group_ids, lse_all, lse_pos, weights, q_scale,
         c_scale) = ctx.saved_tensors
        symmetric = cf is None
        cf = qf if symmetric else cf
        tiles = _Tiles(qf, cf, q_inv, c_inv, *ctx.options, group_ids, ctx.dims)
        gradients = _PrefixGradients(qf, cf, q_inv, c_inv, weights, grad_loss, tiles.scale, symmetric, ctx.dims)
        for start, end in tiles.blocks():
            gradients.add_block(tiles, start, end, lse_all, lse_pos)
        dq, dc = gradients.finish(q_has_grad, c_has_grad, q_scale, c_scale)
        q_dtype, c_dtype = ctx.input_dtypes
        return dq.to(q_dtype), None if dc is None else dc.to(c_dtype), None, None, None, None, None, None, None, None


class MixedPrefixSimilarityXentFunction(torch.autograd.Function):
    """PrefixSimilarityXentFunction on the "mixed" path (module docstring). Forward: the same, on the 16-bit rows.
    Backward: the running sum of the prefixes' gradient tiles is kept in the frame of the prefix being walked,
    R'_j = sum_{i >= j} G_i (q_inv_i / q_inv_j) (c_inv_i / c_inv_j), where G_i carries neither inverse norm (every
    ratio is at most 1: a longer prefix has the larger norm), so that rounded to 16 bits it stays in range; its
    products take each slice s_j divided by prefix j's norm (common.unit_slices, entries at most 1), and slice j of
    the float32 sums is multiplied by prefix j's inverse norm at the end:
    dq[:, s_j] = q_inv_j * sum_blocks R'_j @ c_unit[:, s_j], dc[:, s_j] = c_inv_j * sum_blocks R'_j^T q_unit[blk, s_j].
    """

    @staticmethod
    def forward(ctx, q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids, dims):
        qs, q_scale = half_rows(q.detach())
        cs, c_scale = (None, q_scale) if c is None else half_rows(c.detach())
        return _prefix_losses(ctx, q, c, qs, cs, q_scale, c_scale, scale, target, row_weights, exclude_diagonal,
                              margin, group_ids, dims)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        (qs, cs, q_inv, c_inv, q_has_grad, c_has_grad, group_ids, lse_all, lse_pos, weights, q_scale,
         c_scale) = ctx.saved_tensors
        symmetric = cs is None
        cs = qs if symmetric else cs
        dims = ctx.dims
        tiles = _Tiles(qs, cs, q_inv, c_inv, *ctx.options, group_ids, dims)
        dtype = q_inv.dtype
        m, k = qs.shape[0], len(dims)
        slices = prefix_slices(dims)
        # The tiles' row factors: w_i / max|w| and grad_loss_p / max|grad_loss| times scale, at most scale in
        # magnitude; `unscale` (max|w| max|grad_loss| / M) multiplies the float32 sums.
        tiny = torch.finfo(dtype).tiny
        weight_max = weights.abs().max().clamp_min(tiny)
        grad_loss = grad_loss.to(dtype)
        grad_max = grad_loss.abs().max().clamp_min(tiny)
        row_factor = (weights / weight_max)[:, None] * (grad_loss / grad_max * tiles.scale)[None, :]  # [M, k]
        unscale = weight_max * grad_max / m
        c_factor = c_inv.T.contiguous()  # [k, Mc]
        # from prefix j + 1's frame to prefix j's: the ratios of their inverse norms, at most 1
        q_ratio = q_inv[:, 1:] / q_inv[:, :-1]  # [M, k - 1]
        c_ratio = (c_inv[:, 1:] / c_inv[:, :-1]).T.contiguous()  # [k - 1, Mc]
        q_unit = unit_slices(qs, q_inv, slices)
        c_unit = q_unit if symmetric else unit_slices(cs, c_inv, slices)

        dq = torch.zeros(qs.shape, dtype=dtype, device=qs.device)  # slice j in prefix j's frame until the end
        dc = dq if symmetric else torch.zeros(cs.shape, dtype=dtype, device=qs.device)
        q_radial = torch.zeros(m, k, dtype=dtype, device=qs.device)
        c_radial = q_radial if symmetric else torch.zeros(cs.shape[0], k, dtype=dtype, device=qs.device)
        for start, end in tiles.blocks():
            dots, gradient = _prefix_gradient_tiles(tiles, start, end, lse_all, lse_pos, c_factor,
                                                    row_factor[start:end].T)
            running = None  # R'_j
            for j in reversed(range(k)):
                g = gradient(j)
                dots[j].mul_(g)  # G_j * dots_j: with both inverse norms, the radial products
                if running is not None:  # R'_j = G_j + (q_inv_j+1 / q_inv_j) (c_inv_j+1 / c_inv_j) R'_j+1
                    g.addcmul_(running.mul_(q_ratio[start:end, j, None]), c_ratio[j, None, :])
                running = g
                del g
                tile = running.to(qs.dtype)
                lo, hi = slices[j]
                product_into(dq[start:end, lo:hi], tile, c_unit[:, lo:hi], add=dq[start:end, lo:hi])
                product_into(dc[:, lo:hi], tile.T, q_unit[start:end, lo:hi], add=dc[:, lo:hi])
                del tile
            # the radial sums sum_j Ghat_ij dots_ij, Ghat = G q_inv c_inv: one batched product per side
            q_radial[start:end].add_(torch.bmm(dots, c_factor.unsqueeze(2)).squeeze(2).T * q_inv[start:end])
            c_radial.add_(torch.bmm(dots.transpose(1, 2), q_inv[start:end].T.unsqueeze(2)).squeeze(2).T * c_inv)
            del dots, running, gradient  # gradient holds the block's dots: freed before the next block's
        q_unit = c_unit = None

        for j, (lo, hi) in enumerate(slices):  # each slice out of its prefix's frame
            dq[:, lo:hi].mul_(q_inv[:, j, None] * unscale)
            if not symmetric:
                dc[:, lo:hi].mul_(c_inv[:, j, None] * unscale)
        q_radial.mul_(unscale)
        if not symmetric:
            c_radial.mul_(unscale)
        q_dtype, c_dtype = ctx.input_dtypes
        dq = unscaled(prefix_radial_backward(qs, q_inv, q_has_grad, q_radial, dq, slices), q_scale).to(q_dtype)
        dc = None if symmetric else unscaled(prefix_radial_backward(cs, c_inv, c_has_grad, c_radial, dc, slices),
                                             c_scale).to(c_dtype)
        return dq, dc, None, None, None, None, None, None, None


def _target_grads(lse_all, lse_pos, grad_factor, margins, has_positives: bool):
    """What every prefix's gradient tile holds on its target column once multiplied by its row factor, [k, b] (all
    inputs [k, b]; margins as prefix_margins gives them), computed for all prefixes at once so that the tiles only
    take one write there: softmax_all - 1 without group_ids (the target's logit is lse_pos), softmax_all -
    softmax_pos with them, times the margin's slope. None where the tiles are right as they are (group_ids, no
    margin)."""
    if not has_positives:
        values = torch.exp(lse_pos - lse_all).sub_(1.0)
    elif margins is not None:
        logit = margins[0]
        values = torch.exp(logit - lse_all).sub_(torch.exp(logit - lse_pos))
    else:
        return None
    values.mul_(grad_factor)
    return values if margins is None else values.mul_(margins[1])


def similarity_xent(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0, group_ids=None,
                    dims=None, path=None):
    """The op on the code path `path` (PATHS), by default the one `code_path` names: dispatch holds the backend to
    "default" where "mixed" may not compute (angle_kernels.verified)."""
    if path is None:
        path = code_path(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids, dims)
    if path not in PATHS:
        raise ValueError(f"the torch backend's similarity_xent has no code path {path!r}; its paths: {PATHS}")
    mixed = path == "mixed"
    if dims is not None and mixed:
        return MixedPrefixSimilarityXentFunction.apply(q, c, scale, target, row_weights, exclude_diagonal, margin,
                                                       group_ids, dims)
    if dims is not None:  # forms the gradients in forward when autograd will ask for them (its docstring)
        return PrefixSimilarityXentFunction.apply(q, c, scale, target, row_weights, exclude_diagonal, margin,
                                                  group_ids, dims, gradients_wanted(q, c))
    # The gradients are computed in forward when autograd will ask for them (module docstring).
    function = MixedSimilarityXentFunction if mixed else SimilarityXentFunction
    return function.apply(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids,
                          gradients_wanted(q, c))
