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
    * the row weights w_i scale / M multiply [b, D] products, never the tile.

Per block: the logits product, the scale, the softmax, two row maxima and a row sum (with group_ids, the
positives' masked softmax too), then the two gradient products: about half of the blocked form's full-tile passes.
Memory: two tiles (the logits and the softmax; with group_ids three, plus the boolean positives masks) of
`common.chunk_elements` logits, and the unit rows and gradient buffers, O((M + Mc) D). Huge rows are scaled as in
the blocked form (_cpu_rows.normalised_rows: common.cosine_rows' rule, its norms and the normalisation's backward by
torch's vector norm and vecdot, not batched GEMVs, which a CPU runs 4-7x slower); the unit rows are exact cosines'
operands whatever the scale.

dims (nested prefixes) compute as on the "default" path everywhere (similarity_xent.PrefixSimilarityXentFunction).
On a GPU the "default" path keeps the blocked form (similarity_xent.SimilarityXentFunction): the op sweeps timed that
code and `auto`'s choices there depend on its times (angle_kernels.measured); torch_ops/similarity_xent_paths.py
routes the calls.
"""

from __future__ import annotations

import torch

from ..contract import compute_dtype
from ..formed_gradients import GradientsFormedInForward, gradients_wanted
from ._cpu_rows import normalise_backward, normalised_rows
from .similarity_xent import PrefixSimilarityXentFunction, _Tiles, margin_logit


def _log_partition(logits: torch.Tensor, probabilities: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's logsumexp as (m, log s), m + log s, from a block of logits [b, Mc] whose rows each hold a finite
    value and their softmax: m the largest logit, log s = -log(max softmax) (module docstring)."""
    return logits.amax(dim=1), probabilities.amax(dim=1).log_().neg_()


def _row_losses(off_positives: torch.Tensor, far: torch.Tensor) -> torch.Tensor:
    """lse_all - lse_pos of each row [b], from the softmax mass off its positives r (sum_{j not in P} softmax_all_j)
    and the same value computed as (m_all - m_pos) + (log s_all - log s_pos) (`far`): -log(1 - r) where r <= 1/2,
    which keeps every digit of a small loss (a row whose positives dominate), `far` elsewhere (a loss >= log 2)."""
    return torch.where(off_positives <= 0.5, torch.log1p(off_positives.neg()).neg_(), far)


class _DiagonalEntries:
    """The entries (i, start + i) of a row block's [b, Mc] tile, read and written through a view of its diagonal: the
    targets of target "diagonal" and every row's own column (what exclude_diagonal removes)."""

    def __init__(self, start: int, end: int):
        self.start, self.end = start, end

    def of(self, tile: torch.Tensor) -> torch.Tensor:
        """The entries [b] (a view of the tile)."""
        return tile[:, self.start:self.end].diagonal()

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


class SoftmaxSimilarityXentFunction(GradientsFormedInForward):
    """The full-width loss, and with with_grad its gradients for grad_loss = 1, in one walk over the row blocks
    (module docstring); backward scales them (GradientsFormedInForward)."""

    @staticmethod
    def forward(ctx, q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids, with_grad):
        symmetric = c is None
        dtype = compute_dtype(q.dtype)
        parts = normalised_rows(q.detach()) if symmetric else normalised_rows(q.detach(), c.detach())
        (qf, q_scale, q_inv, q_has_grad), (cf, c_scale, c_inv, c_has_grad) = parts[0], parts[-1]
        q_hat = qf * q_inv[:, None]
        c_hat = q_hat if symmetric else cf * c_inv[:, None]
        # the blocks and their rows' targets and positives, as the blocked form lays them out
        tiles = _Tiles(qf, cf, q_inv, c_inv, scale, target, exclude_diagonal, margin, group_ids)

        m = qf.shape[0]
        # dL/dcos_ij = row_scale_i * (softmax_all_ij - softmax_pos_ij): one number for the rows without row weights
        weights = None if row_weights is None else row_weights.to(dtype)
        row_scale = scale / m if weights is None else weights * (scale / m)
        row_losses = torch.empty(m, dtype=dtype, device=q.device)  # lse_all - lse_pos
        # Gradients with respect to the unit rows; one buffer when c is q (in-batch negatives).
        d_qhat = torch.zeros_like(qf) if with_grad else None
        d_chat = d_qhat if symmetric or not with_grad else torch.zeros_like(cf)
        for start, end in tiles.blocks():
            if target == "diagonal" and group_ids is None:
                positives, targets = None, _DiagonalEntries(start, end)
            else:
                _, local, columns, positives = tiles.rows(start, end)
                targets = _IndexedEntries(local, columns)
            logits = torch.mm(q_hat[start:end], c_hat.T)  # cosines
            slope = None
            if margin != 0.0:
                value, slope = margin_logit(targets.of(logits), margin)
            logits.mul_(scale)
            if margin != 0.0:
                targets.set(logits, scale * value)
            if exclude_diagonal:  # row i's own column, start + i
                _DiagonalEntries(start, end).set(logits, float("-inf"))
            grad = torch.softmax(logits, dim=1)  # softmax_all; its positive columns are zeroed below
            softmax_pos = None
            top, log_sum = _log_partition(logits, grad)
            if positives is None:  # P_i is the target: lse_pos is its logit
                far = top.sub_(targets.of(logits)).add_(log_sum)
                targets.set(grad, 0.0)
            else:
                softmax_pos = torch.softmax(logits.masked_fill_(~positives, float("-inf")), dim=1)
                top_pos, log_sum_pos = _log_partition(logits, softmax_pos)
                far = top.sub_(top_pos).add_(log_sum.sub_(log_sum_pos))
                grad.masked_fill_(positives, 0.0)
            del logits
            row_losses[start:end] = _row_losses(grad.sum(dim=1), far)
            if not with_grad:
                del grad, softmax_pos  # before the next block's tiles are made
                continue
            # softmax_all - softmax_pos: softmax_all off the positives; at a positive column j, softmax_pos_j
            # (exp(-row loss) - 1) (softmax_all_j = softmax_pos_j exp(lse_pos - lse_all)), which keeps its digits
            # where the positives dominate the row and the two softmaxes' difference would cancel
            shrink = torch.expm1(row_losses[start:end].neg())
            if positives is None:  # softmax_pos is 1 at the target
                targets.set(grad, shrink)
            else:
                grad.add_(softmax_pos.mul_(shrink[:, None]))  # softmax_pos is 0 off the positives
                del softmax_pos
            if slope is not None:
                targets.set(grad, targets.of(grad) * slope)
            # cos_ij = q_hat_i . c_hat_j: dq_hat_i = sum_j g_ij c_hat_j, dc_hat_j = sum_i g_ij q_hat_i (g: dL/dcos)
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
            dq = normalise_backward(qf, q_inv, q_has_grad, d_qhat, q_scale)
            dc = None if symmetric else normalise_backward(cf, c_inv, c_has_grad, d_chat, c_scale)
            ctx.save_for_backward(dq, dc)
        return loss


def similarity_xent(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0, group_ids=None,
                    dims=None):
    """The op in the softmax form (module docstring); dims as the "default" path computes them."""
    if dims is not None:  # forms the gradients in forward when autograd will ask for them (its docstring)
        return PrefixSimilarityXentFunction.apply(q, c, scale, target, row_weights, exclude_diagonal, margin,
                                                  group_ids, dims, gradients_wanted(q, c))
    return SoftmaxSimilarityXentFunction.apply(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids,
                                               gradients_wanted(q, c))
