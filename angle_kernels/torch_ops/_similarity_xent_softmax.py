"""similarity_xent at full width in the softmax form: what the torch backend's "default" path computes on the CPU.

The contract and the loss are those of torch_ops/similarity_xent.py (its module docstring):

    loss = (1/M) sum_i w_i * (logsumexp_{j in C_i} l_ij - logsumexp_{j in P_i} l_ij),  l_ij = scale * cos_ij
    dL/dl_ij = w_i / M * (softmax_all_ij - softmax_pos_ij)

computed a row block at a time against all columns (never the M x Mc matrix), with the gradients formed in forward
(angle_kernels.formed_gradients), but by fewer passes over each block's tile, which is what a call costs on a CPU
once its three matrix products are paid for:

    * the products take unit rows q_hat = q / max(|q|, eps) and c_hat (made once, O((M + Mc) D)): the tile is the
      cosines, and the gradient products need no inverse norms multiplied into the tile (blocked form: four passes);
    * one `torch.softmax` of the block's logits gives the gradient's softmax_all and the row's loss: with r_i the
      softmax's mass off the positives P_i (one sum), lse_all_i - lse_pos_i = -log(1 - r_i) = -log1p(-r_i), which
      keeps every digit of a small loss (a row whose positives dominate: eager code and the blocked form lose
      them to the rounding of lse at the logits' magnitude); where r_i > 1/2 (a loss above log 2) it is taken from
      each logsumexp as m + log s, m the row's largest logit and log s = -log(max softmax) (at the largest logit the
      softmax is exp(m - lse) = 1 / s, at least 1 / Mc: no underflow), the maxima subtracted first. The blocked
      form takes a logsumexp, then exponentiates the tile again. The gradient at a positive column is softmax_pos
      (exp(-loss) - 1): no difference of two nearly equal softmaxes;
    * the row weights w_i scale / M multiply [b, D] products, never the tile;
    * q's rows and c's are normalised as one tensor (one norm, one set of unit rows and gradients, one
      normalisation backward), and a call whose rows fit one block (every small call) writes its two gradient
      products straight into that buffer: at 256 pairs of D = 64 each of the three matrix products takes ~80 us
      on one thread and each of the call's ~60 other ops ~2 us (bench/bench_per_call.py), so every op counts.

Per block: the logits product, the scale, the softmax, two row maxima and a row sum (with group_ids, the
positives' masked softmax too), then the two gradient products: about half of the blocked form's full-tile passes.
Memory: two tiles (the logits and the softmax; with group_ids three, plus the boolean positives masks) of
`common.chunk_elements` logits, and the rows (q's and c's, copied into one tensor), unit rows and gradient buffer,
O((M + Mc) D), at most three times the inputs' size in the compute dtype. Huge rows are scaled as in
the blocked form (_cpu_rows.normalised_rows: common.cosine_rows' rule, its norms and the normalisation's backward by
torch's vector norm and vecdot, not batched GEMVs, which a CPU runs 4-7x slower); the unit rows are exact cosines'
operands whatever the scale.

dims (nested prefixes; SoftmaxPrefixSimilarityXentFunction): the blocked form's schedule for them
(similarity_xent.PrefixSimilarityXentFunction: each block's dot tiles of every prefix from one read of its rows, the
prefixes walked from the widest down into a running sum of gradient tiles whose slice products make each slice's
gradients, the gradients formed in forward for the upstream gradient of the last backward of the same kind) with each
prefix's tile turned into its row losses and gradient tile by one softmax, as above: a small loss keeps its digits
at every prefix (the blocked form's lse_all - lse_pos rounds it away: 0 for a float32 loss of 2e-7, its gradients
17% off). Per block: the k dot tiles, a prefix's logits and softmax, and the running sum (k + 3 tiles, the blocked
form's count: its blocks are the same).

Rows against themselves (c = None: AnglE's in-batch negatives) from a few tiles of rows on, without a margin, compute
by the triangular schedule of _similarity_xent_symmetric.py instead (`applies` says when): the logits are
symmetric, so two thirds of these products suffice.

On a GPU the "default" path keeps the blocked form (similarity_xent.SimilarityXentFunction and
PrefixSimilarityXentFunction): the op sweeps timed that code and `auto`'s choices there depend on its times
(angle_kernels.measured); torch_ops/similarity_xent_paths.py routes the calls.
"""

from __future__ import annotations

import torch

from torch.autograd.function import once_differentiable

from ..contract import compute_dtype
from ..formed_gradients import GradientsFormedInForward, gradients_wanted
from . import _similarity_xent_symmetric
from ._cpu_rows import normalise_backward, normalised_rows
from .common import cosine_rows, prefix_inverse_norms
from .similarity_xent import _LAST_UPSTREAM, _PrefixGradients, _Tiles, _upstream, margin_logit


def _log_partition(logits: torch.Tensor, probabilities: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's logsumexp as (m, -log s), m - (-log s), from a block of logits [b, Mc] whose rows each hold a
    finite value and their softmax: m the largest logit, -log s = log(max softmax) (module docstring), returned with
    that sign because a small call pays for every op, a negation too."""
    return logits.amax(dim=1), probabilities.amax(dim=1).log_()


def _row_losses(off_positives: torch.Tensor, far: torch.Tensor) -> torch.Tensor:
    """lse_all - lse_pos of each row [b], from the softmax mass off its positives r (sum_{j not in P} softmax_all_j)
    and the same value computed as (m_all - m_pos) + (log s_all - log s_pos) (`far`): -log(1 - r) where r <= 1/2,
    which keeps every digit of a small loss (a row whose positives dominate), `far` elsewhere (a loss >= log 2)."""
    return torch.where(off_positives <= 0.5, torch.log1p(off_positives.neg()).neg_(), far)


def _losses_and_gradient(logits: torch.Tensor, targets, positives: torch.Tensor | None, slope: torch.Tensor | None,
                         with_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(each row's loss lse_all - lse_pos [b], and with with_grad its dL/dlogit tile softmax_all - softmax_pos [b, Mc]
    times the margin's slope on the target column, else None) of a row block's logits [b, Mc] (overwritten with
    group_ids), from one softmax (two with group_ids): the module docstring's formulas. targets: the block's target
    entries (_DiagonalEntries or _IndexedEntries); positives: its positives mask, None where the target is the only
    positive; slope: the margin's slope at the targets [b], None without a margin."""
    grad = torch.softmax(logits, dim=1)  # softmax_all; its positive columns are zeroed below
    softmax_pos = None
    top, minus_log_sum = _log_partition(logits, grad)
    if positives is None:  # P_i is the target: lse_pos is its logit
        far = top.sub_(targets.of(logits)).sub_(minus_log_sum)
        targets.set(grad, 0.0)
    else:
        softmax_pos = torch.softmax(logits.masked_fill_(~positives, float("-inf")), dim=1)
        top_pos, minus_log_sum_pos = _log_partition(logits, softmax_pos)
        far = top.sub_(top_pos).sub_(minus_log_sum.sub_(minus_log_sum_pos))
        grad.masked_fill_(positives, 0.0)
    losses = _row_losses(grad.sum(dim=1), far)
    if not with_grad:
        return losses, None
    # softmax_all - softmax_pos: softmax_all off the positives; at a positive column j, softmax_pos_j
    # (exp(-row loss) - 1) (softmax_all_j = softmax_pos_j exp(lse_pos - lse_all)), which keeps its digits
    # where the positives dominate the row and the two softmaxes' difference would cancel
    shrink = torch.expm1(losses.neg())
    if positives is None:  # softmax_pos is 1 at the target
        targets.set(grad, shrink)
    else:
        grad.add_(softmax_pos.mul_(shrink[:, None]))  # softmax_pos is 0 off the positives
        del softmax_pos
    if slope is not None:
        targets.set(grad, targets.of(grad) * slope)
    return losses, grad


class _DiagonalEntries:
    """The entries (i, start + i) of a row block's [b, Mc] tile, read and written through a view of its diagonal: the
    targets of target "diagonal" and every row's own column (what exclude_diagonal removes)."""

    def __init__(self, start: int, end: int):
        self.start, self.end = start, end

    def of(self, tile: torch.Tensor) -> torch.Tensor:
        """The entries [b] (a view of the tile): its diagonal at offset start, b long since end <= M <= Mc."""
        return tile.diagonal(self.start)

    def set(self, tile: torch.Tensor, values) -> None:
        """Writes `values` (a [b] tensor or a number) into the entries."""
        if isinstance(values, torch.Tensor):
            self.of(tile).copy_(values)
        else:
            self.of(tile).fill_(values)


class _IndexedEntries:
    """A row block's target entries (local[i], columns[i]) of its tile by index (the blocked form's indices): target
    "partner", and every target with group_ids, whose masks take the indices anyway."""

    def __init__(self, local: torch.Tensor, columns: torch.Tensor):
        self.local, self.columns = local, columns

    def of(self, tile: torch.Tensor) -> torch.Tensor:
        """The entries [b] (a copy)."""
        return tile[self.local, self.columns]

    def set(self, tile: torch.Tensor, values) -> None:
        tile[self.local, self.columns] = values


def _block(tiles: _Tiles, q_block: torch.Tensor, c_hat: torch.Tensor, start: int, end: int,
           with_grad: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(each row's loss lse_all - lse_pos [b], and with with_grad its tile softmax_all - softmax_pos [b, Mc], the
    margin's slope at the targets, else None: _losses_and_gradient's) of the row block [start, end) at full width,
    q_block its unit rows q_hat[start:end]: its cosines, its logits (the margin at the targets, its own column out
    with exclude_diagonal), then _losses_and_gradient."""
    if tiles.target == "diagonal" and tiles.group_ids is None:
        positives, targets = None, _DiagonalEntries(start, end)
    else:
        _, local, columns, positives = tiles.rows(start, end)
        targets = _IndexedEntries(local, columns)
    logits = torch.mm(q_block, c_hat.T)  # cosines
    slope = None
    if tiles.margin != 0.0:
        value, slope = margin_logit(targets.of(logits), tiles.margin)
    logits.mul_(tiles.scale)
    if tiles.margin != 0.0:
        targets.set(logits, tiles.scale * value)
    if tiles.exclude_diagonal:  # row i's own column, start + i
        _DiagonalEntries(start, end).set(logits, float("-inf"))
    return _losses_and_gradient(logits, targets, positives, slope, with_grad)


class SoftmaxSimilarityXentFunction(GradientsFormedInForward):
    """The full-width loss, and with with_grad its gradients for grad_loss = 1, in one walk over the row blocks
    (module docstring); backward scales them (GradientsFormedInForward)."""

    @staticmethod
    def forward(ctx, q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids, with_grad):
        symmetric = c is None
        m = q.shape[0]
        dtype = compute_dtype(q.dtype)
        # q's rows and c's as one tensor (c is q when symmetric): one set of norms, unit rows and gradient buffer,
        # one normalisation backward (a small call pays for every op; the copy is O((M + Mc) D))
        (xf, x_scale, x_inv, x_has_grad), = normalised_rows(q.detach() if symmetric else torch.cat((q, c)))
        x_hat = xf * x_inv[:, None]
        q_hat, c_hat = (x_hat, x_hat) if symmetric else (x_hat[:m], x_hat[m:])
        # the blocks and their rows' targets and positives, as the blocked form lays them out (all this form reads
        # of _Tiles: its logits come from the unit rows, so the tiles take no inverse norms)
        tiles = _Tiles(q_hat, c_hat, None, None, scale, target, exclude_diagonal, margin, group_ids)

        # dL/dcos_ij = row_scale_i * (softmax_all_ij - softmax_pos_ij): one number for the rows without row weights
        weights = None if row_weights is None else row_weights.to(dtype)
        row_scale = scale / m if weights is None else weights * (scale / m)
        # Gradients with respect to the unit rows, d_hat = [dq_hat; dc_hat] (one [M, D] buffer when c is q).
        # cos_ij = q_hat_i . c_hat_j: dq_hat_i = sum_j g_ij c_hat_j, dc_hat_j = sum_i g_ij q_hat_i (g: dL/dcos)
        one_block = m <= tiles.block  # one block holds every row (every small call): its products are the gradients
        d_hat = None
        if with_grad:  # written into by one block (its values unread), added to by several
            d_hat = torch.empty_like(xf) if one_block else torch.zeros_like(xf)
            d_qhat, d_chat = (d_hat, d_hat) if symmetric else (d_hat[:m], d_hat[m:])
        if one_block:
            row_losses, grad = _block(tiles, q_hat, c_hat, 0, m, with_grad)
            if grad is not None:
                if weights is None:  # scale / M multiplies the [M, D] products
                    d_qhat.addmm_(grad, c_hat, beta=0.0, alpha=row_scale)  # beta 0: the empty buffer unread
                    q_rows, alpha = q_hat, row_scale
                else:
                    torch.mm(grad, c_hat, out=d_qhat).mul_(row_scale[:, None])
                    q_rows, alpha = q_hat * row_scale[:, None], 1.0
                d_chat.addmm_(grad.T, q_rows, beta=1.0 if symmetric else 0.0, alpha=alpha)
                del grad
        else:
            row_losses = torch.empty(m, dtype=dtype, device=q.device)  # lse_all - lse_pos
            for start, end in tiles.blocks():
                row_losses[start:end], grad = _block(tiles, q_hat[start:end], c_hat, start, end, with_grad)
                if grad is None:
                    continue
                if weights is None:
                    d_qhat[start:end].addmm_(grad, c_hat, alpha=row_scale)
                    d_chat.addmm_(grad.T, q_hat[start:end], alpha=row_scale)
                else:
                    block_scale = row_scale[start:end, None]
                    d_qhat[start:end].addcmul_(torch.mm(grad, c_hat), block_scale)
                    d_chat.addmm_(grad.T, q_hat[start:end] * block_scale)
                del grad
        loss = row_losses.mean() if weights is None else (weights * row_losses).sum() / m

        ctx.with_grad = with_grad
        ctx.input_dtypes = (q.dtype, None if symmetric else c.dtype)
        if with_grad:
            dx = normalise_backward(xf, x_inv, x_has_grad, d_hat, x_scale)
            if symmetric:
                ctx.save_for_backward(dx, None)
            else:
                ctx.save_for_backward(dx[:m], dx[m:])
        return loss


def _prefix_walk(tiles: _Tiles, gradients: _PrefixGradients | None) -> torch.Tensor:
    """Every prefix's row losses lse_all - lse_pos [M, k], and with `gradients` their gradient terms added to it
    (the upstream gradient it was made for), in one walk over the row blocks: per block the dot tiles of every prefix
    from one read of its rows (_Tiles.prefix_dots, the blocked form's), then, from the widest prefix down, its
    logits, one softmax giving its row losses and gradient tile (_losses_and_gradient), and that tile folded into the
    running sum of the prefixes i >= j whose two slice products make slice j's gradients (the blocked form's
    _PrefixGradients.add_block, with the gradient tile of the softmax form)."""
    m, k = tiles.qf.shape[0], len(tiles.dims)
    slices = None if gradients is None else gradients.slices
    row_losses = torch.empty(m, k, dtype=tiles.q_inv.dtype, device=tiles.qf.device)
    c_factor = tiles.c_inv.T.contiguous()  # [k, Mc]: each prefix's inverse norms as a contiguous row
    for start, end in tiles.blocks():
        rows, local, columns, positives = tiles.rows(start, end)
        if tiles.target == "diagonal" and positives is None:
            targets = _DiagonalEntries(start, end)
        else:
            targets = _IndexedEntries(local, columns)
        dots = tiles.prefix_dots(start, end)
        margins = tiles.prefix_margins(dots, start, end, local, columns)
        logit_factor = (tiles.q_inv[start:end] * tiles.scale).T  # [k, b]
        # dL/dcos of prefix j times its inverse norms: row_scale * q_inv per row (with c_inv per column below)
        grad_factor = None if gradients is None else (gradients.row_scale[start:end] * tiles.q_inv[start:end]).T
        running = None  # sum over the prefixes i >= j of Ghat_i, walking j down from the widest prefix
        for j in reversed(range(k)):
            logits = tiles.prefix_logits(dots[j], logit_factor[j], c_factor[j], rows, local, columns,
                                         None if margins is None else margins[0][j], in_place=gradients is None)
            row_losses[start:end, j], g_hat = _losses_and_gradient(
                logits, targets, positives, None if margins is None else margins[1][j], gradients is not None)
            del logits
            if g_hat is None:
                continue
            g_hat.mul_(grad_factor[j, :, None]).mul_(c_factor[j, None, :])  # Ghat_j = dL/dcos * q_inv * c_inv
            dots[j].mul_(g_hat)  # Ghat_j * dots_j: its row and column sums are the radial sums
            running = g_hat if running is None else running.add_(g_hat)
            del g_hat
            lo, hi = slices[j]
            gradients.dq[start:end, lo:hi].addmm_(running, tiles.cf[:, lo:hi])
            gradients.dc[:, lo:hi].addmm_(running.T, tiles.qf[start:end, lo:hi])
        if gradients is not None:
            gradients.q_radial[start:end].add_(dots.sum(dim=2).T)
            gradients.c_radial.add_(dots.sum(dim=1).T)
        del dots, running
    return row_losses


class SoftmaxPrefixSimilarityXentFunction(torch.autograd.Function):
    """similarity_xent on every prefix of dims at once, a [k] loss, in the softmax form: the blocked
    PrefixSimilarityXentFunction's schedule and upstream-gradient rule (its docstring: forward forms the gradients
    for the grad_loss the last backward of the same kind received, ones at first; backward returns them when its
    grad_loss equals that one, else walks again for its own), each prefix's tile turned into its losses and
    gradient by one softmax (_prefix_walk): a small loss keeps its digits, as at full width."""

    @staticmethod
    def forward(ctx, q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids, dims, with_grad):
        symmetric = c is None
        qf, q_scale, _ = cosine_rows(q.detach())
        cf, c_scale, _ = (qf, q_scale, None) if symmetric else cosine_rows(c.detach())
        q_inv, q_has_grad = prefix_inverse_norms(qf, dims, q_scale)  # [M, k]
        c_inv, c_has_grad = (q_inv, q_has_grad) if symmetric else prefix_inverse_norms(cf, dims, c_scale)
        m, dtype = qf.shape[0], compute_dtype(q.dtype)
        weights = torch.ones(m, dtype=dtype, device=q.device) if row_weights is None else row_weights.to(dtype)
        tiles = _Tiles(qf, cf, q_inv, c_inv, scale, target, exclude_diagonal, margin, group_ids, dims)
        ctx.kind = (tuple(dims), symmetric, target, exclude_diagonal, margin, group_ids is None, row_weights is None)
        ctx.formed = None
        gradients = None
        if with_grad:
            direction = _LAST_UPSTREAM.get(ctx.kind)
            direction = torch.ones(len(dims), dtype=torch.float64) if direction is None else direction
            gradients = _PrefixGradients(qf, cf, q_inv, c_inv, weights, direction.to(q.device), scale, symmetric,
                                         dims)
        loss = (weights[:, None] * _prefix_walk(tiles, gradients)).sum(dim=0) / m
        if gradients is not None:
            ctx.formed = (direction, gradients.finish(q_has_grad, c_has_grad, q_scale, c_scale))
        ctx.save_for_backward(qf, None if symmetric else cf, q_inv, c_inv, q_has_grad, c_has_grad, group_ids, weights,
                              q_scale, None if symmetric else c_scale)
        ctx.options = (scale, target, exclude_diagonal, margin)
        ctx.dims = dims
        ctx.input_dtypes = (q.dtype, None if symmetric else c.dtype)
        return loss

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss):
        formed, ctx.formed = ctx.formed, None
        upstream = _upstream(grad_loss)
        q_dtype, c_dtype = ctx.input_dtypes
        if formed is not None and upstream is not None and torch.equal(upstream, formed[0]):
            dq, dc = formed[1]
        else:
            if upstream is not None:
                _LAST_UPSTREAM[ctx.kind] = upstream
            qf, cf, q_inv, c_inv, q_has_grad, c_has_grad, group_ids, weights, q_scale, c_scale = ctx.saved_tensors
            symmetric = cf is None
            cf = qf if symmetric else cf
            tiles = _Tiles(qf, cf, q_inv, c_inv, *ctx.options, group_ids, ctx.dims)
            gradients = _PrefixGradients(qf, cf, q_inv, c_inv, weights, grad_loss, tiles.scale, symmetric, ctx.dims)
            _prefix_walk(tiles, gradients)
            dq, dc = gradients.finish(q_has_grad, c_has_grad, q_scale, c_scale)
        return dq.to(q_dtype), None if dc is None else dc.to(c_dtype), None, None, None, None, None, None, None, None


def similarity_xent(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0, group_ids=None,
                    dims=None):
    """The op in the softmax form (module docstring), with dims too, or by the triangular schedule where it applies
    (_similarity_xent_symmetric.applies); forms the gradients in forward when autograd will ask for them."""
    if dims is not None:
        return SoftmaxPrefixSimilarityXentFunction.apply(q, c, scale, target, row_weights, exclude_diagonal, margin,
                                                         group_ids, dims, gradients_wanted(q, c))
    function = (_similarity_xent_symmetric.SymmetricSimilarityXentFunction
                if _similarity_xent_symmetric.applies(q, c, scale, target, exclude_diagonal, margin)
                else SoftmaxSimilarityXentFunction)
    return function.apply(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids, gradients_wanted(q, c))
