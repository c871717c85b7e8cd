"""similarity_xent of a batch against itself (c = None) at full width on the CPU, by a triangular schedule: what the
torch backend's "default" path computes for AnglE's in-batch negatives (target "partner", exclude_diagonal, row
weights, group_ids) once its rows span several tiles (`applies`).

The contract and the loss are those of torch_ops/similarity_xent.py (its module docstring):

    loss = (1/M) sum_i w_i * (lse_{j in C_i} l_ij - lse_{j in P_i} l_ij),  l_ij = scale * cos(x_i, x_j)

With c = None the logits are symmetric, l_ij = l_ji, so the M x M matrix is read through its upper triangle of
T x T tiles (I <= J, T = `tile_rows`): a tile holds rows I against columns J and, transposed, rows J against
columns I. Two passes over the triangle:

    1. the loss: per tile E = exp(l_IJ); each row's sum of E off its positives, o_i, and over them, p_i, from E's
       row sums (rows I) and column sums (rows J); then

           loss_i = lse_all - lse_pos = log((o_i + p_i) / p_i) = log1p(o_i / p_i)

       which keeps every digit of a small loss (a row whose positives dominate), as the softmax form's
       -log1p(-r) does, without a logsumexp.
    2. the gradients (only when autograd will ask for them, formed in forward: angle_kernels.formed_gradients): per
       tile E again, and dL/dcos for both orientations in one tile,

           H = E * (f_I[:, None] + f_J[None, :]),  f_i = row_scale_i / (o_i + p_i) off row i's positives,
                                                   -row_scale_i o_i / (p_i (o_i + p_i)) on them

       (row_scale_i = w_i scale / M; the two cases are softmax_all and softmax_all - softmax_pos, the second
       without the difference of two nearly equal softmaxes), then d_I += H x_hat_J and d_J += H^T x_hat_I.
       A diagonal tile's H is G + G^T, G its rows' own factors times E: one product.

No maximum is subtracted before exp: `applies` takes |scale| <= MAX_SCALE = 40 only, so every logit lies in
[-40, 40] (cosines of unit rows, within rounding), its exponential in [4.2e-18, 2.4e17] and any row's sum below
M * 2.4e17: all normal float32 numbers, each term with float32's relative precision (the logit's own rounding,
which the softmax form's shifted exponentials carry too). Without row maxima a tile needs no rescaling of the
sums before it and no pass for its maxima.

Cost: a tile pair (I < J) takes one T x T x D product in pass 1 and three in pass 2 for its 2 T^2 logits: 4 M^2 D
FLOPs in all where the softmax form takes 6 M^2 D (each logit's product, then two gradient products), plus 2 M T D
for the diagonal tiles, which take the softmax form's three products per logit (1/32 more at M = 16 T); a forward
without gradients takes M^2 D, against 2 M^2 D. Elementwise: pass 1 one exp and two sums per tile, pass 2 one exp
and two passes for H. Tiles are even (T even, starting at multiples of T), so a row's target "partner" (i ^ 1) lies
in its diagonal tile: without group_ids the off-diagonal tiles hold no positive and no excluded entry and pay for
no mask.

Memory: a tile E and a tile of factors (T^2 <= common.chunk_elements float32 each; T <= MAX_TILE), boolean masks
on diagonal tiles and with group_ids, and the softmax form's O(M D) rows (unit rows, gradient buffer).
"""

from __future__ import annotations

import math

import torch

from ..contract import compute_dtype
from ..formed_gradients import GradientsFormedInForward
from ._cpu_rows import normalise_backward, normalised_rows
from .common import chunk_elements
from .similarity_xent import _target_columns

# |scale| up to this keeps exp(logit) within float32's normal range with room for any row's sum (module docstring).
MAX_SCALE = 40.0
# The tiles' side: the largest even number whose square fits common.chunk_elements, at most MAX_TILE. The diagonal
# tiles cost the softmax form's three products per logit, so smaller tiles gain, down to where a product of T rows
# stops running at the matrix-product rate: of 256, 512, 1,024 and 2,048, 512 was within 6% of the fastest at
# 2,048-16,384 rows of D = 64-768 on two cores but at two points of D = 64 (1.36x and 1.18x the fastest's time;
# docs/torch-similarity.md, bench/results/cpu-2026-12-04-symmetric-xent/).
MAX_TILE = 512
# Calls of fewer rows than MIN_TILES tiles, or narrower ones, compute in the softmax form (at 2 tiles the diagonal
# tiles are two of three and the schedule lost: 0.84x at 1,024 rows of D = 64 in tiles of 512); D = 64, the
# narrowest width measured, gained 1.18-1.61x from 4 tiles on.
MIN_TILES = 4
MIN_WIDTH = 64


def tile_rows(device: torch.device | str) -> int:
    """T, the side of the square tiles on `device` (even, at least 2)."""
    return max(2, min(MAX_TILE, math.isqrt(chunk_elements(device))) & ~1)


def applies(q: torch.Tensor, c: torch.Tensor | None, scale: float, target: str, exclude_diagonal: bool,
            margin: float) -> bool:
    """Whether a call of the softmax form computes here: rows against themselves on the CPU, no margin (its
    target logits would break the symmetry), |scale| <= MAX_SCALE, rows at least MIN_WIDTH wide and at least
    MIN_TILES tiles of them, outside torch.compile traces (whose graphs would unroll every tile)."""
    return (c is None and q.device.type == "cpu" and margin == 0.0 and abs(scale) <= MAX_SCALE
            and q.shape[1] >= MIN_WIDTH and q.shape[0] >= MIN_TILES * tile_rows(q.device)
            and not (target == "diagonal" and exclude_diagonal) and not torch.compiler.is_compiling())


class _Positives:
    """Which entries of a tile are positives of their rows: a row's target and, with group_ids, every column in its
    own group or its target's (its own column out with exclude_diagonal), as torch_ops/similarity_xent.py's _Tiles
    marks them."""

    def __init__(self, target: str, exclude_diagonal: bool, group_ids: torch.Tensor | None, device):
        self.target, self.exclude_diagonal, self.group_ids, self.device = target, exclude_diagonal, group_ids, device

    def of(self, r0: int, r1: int, c0: int, c1: int) -> torch.Tensor | None:
        """The positives mask [r1 - r0, c1 - c0] of rows r0:r1 at columns c0:c1, None where it is all False (a tile
        off the diagonal without group_ids: the tiles are even, a target is in its row's diagonal tile)."""
        diagonal = r0 == c0
        if self.group_ids is None and not diagonal:
            return None
        rows = torch.arange(r0, r1, device=self.device)
        columns = torch.arange(c0, c1, device=self.device)
        targets = _target_columns(self.target, rows)
        mask = columns[None, :] == targets[:, None]
        if self.group_ids is not None:
            g = self.group_ids
            mask |= (g[c0:c1][None, :] == g[r0:r1, None]) | (g[c0:c1][None, :] == g[targets, None])
        if self.exclude_diagonal and diagonal:
            mask.fill_diagonal_(False)
        return mask


def _tiles(unit: torch.Tensor, scale: float, t: int):
    """The upper triangle's tiles, row tile by row tile: (i0, i1, j0, j1, scale * unit[i0:i1]), the scaled rows made
    once per row tile (a [T, D] copy, not one of every row)."""
    m = unit.shape[0]
    for i0 in range(0, m, t):
        i1 = min(m, i0 + t)
        scaled = unit[i0:i1] * scale
        for j0 in range(i0, m, t):
            yield i0, i1, j0, min(m, j0 + t), scaled


def _exponentials(scaled: torch.Tensor, unit: torch.Tensor, i0: int, j0: int, j1: int,
                  exclude_diagonal: bool) -> torch.Tensor:
    """E = exp(l) of the tile of rows i0:i0 + len(scaled) (scaled: scale * their unit rows) at columns j0:j1; a
    row's own column 0 on a diagonal tile with exclude_diagonal."""
    e = torch.mm(scaled, unit[j0:j1].T).exp_()
    if exclude_diagonal and i0 == j0:
        e.fill_diagonal_(0.0)
    return e


def _sums(unit, scale: float, positives: _Positives, t: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's sums of exp(l) off its positives and over them, (o, p) [M] (pass 1)."""
    m = unit.shape[0]
    off = torch.zeros(m, dtype=unit.dtype)
    on = torch.zeros(m, dtype=unit.dtype)
    for i0, i1, j0, j1, scaled in _tiles(unit, scale, t):
        e = _exponentials(scaled, unit, i0, j0, j1, positives.exclude_diagonal)
        rows_mask = positives.of(i0, i1, j0, j1)
        if rows_mask is None:  # no positive in the tile, either way
            off[i0:i1] += e.sum(dim=1)
            off[j0:j1] += e.sum(dim=0)
            continue
        on[i0:i1] += torch.where(rows_mask, e, 0.0).sum(dim=1)
        if i0 != j0:  # the tile's transpose: rows J against columns I
            columns_mask = positives.of(j0, j1, i0, i1).T
            on[j0:j1] += torch.where(columns_mask, e, 0.0).sum(dim=0)
            off[j0:j1] += torch.where(columns_mask, 0.0, e).sum(dim=0)
        off[i0:i1] += e.masked_fill_(rows_mask, 0.0).sum(dim=1)
    return off, on


def _add_gradients(d_hat, unit, scale: float, positives: _Positives, t: int, factor_off, factor_on) -> None:
    """d_hat += dL/dx_hat (pass 2), from each row's factor off its positives and on them [M]."""
    m = unit.shape[0]
    buffer = torch.empty(min(m, t), min(m, t), dtype=unit.dtype)
    for i0, i1, j0, j1, scaled in _tiles(unit, scale, t):
        e = _exponentials(scaled, unit, i0, j0, j1, positives.exclude_diagonal)
        rows_mask = positives.of(i0, i1, j0, j1)
        if i0 == j0:  # H = G + G^T, G = E times each row's factors
            g = e.mul_(torch.where(rows_mask, factor_on[i0:i1, None], factor_off[i0:i1, None]))
            d_hat[i0:i1].addmm_(g.add(g.T), unit[i0:i1])
            continue
        if rows_mask is None:
            factors = torch.add(factor_off[i0:i1, None], factor_off[None, j0:j1], out=buffer[:i1 - i0, :j1 - j0])
        else:
            columns_mask = positives.of(j0, j1, i0, i1).T
            factors = torch.where(rows_mask, factor_on[i0:i1, None], factor_off[i0:i1, None]).add_(
                torch.where(columns_mask, factor_on[None, j0:j1], factor_off[None, j0:j1]))
        h = e.mul_(factors)
        d_hat[i0:i1].addmm_(h, unit[j0:j1])
        d_hat[j0:j1].addmm_(h.T, unit[i0:i1])


class SymmetricSimilarityXentFunction(GradientsFormedInForward):
    """The loss of rows against themselves, and with with_grad its gradients for grad_loss = 1, by the triangular
    schedule (module docstring); backward scales them (GradientsFormedInForward). Its arguments are the softmax
    form's (c None, margin 0: `applies`)."""

    @staticmethod
    def forward(ctx, q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids, with_grad):
        m, dtype = q.shape[0], compute_dtype(q.dtype)
        (xf, x_scale, x_inv, x_has_grad), = normalised_rows(q.detach())
        unit = xf * x_inv[:, None]
        positives = _Positives(target, exclude_diagonal, group_ids, q.device)
        t = tile_rows(q.device)
        off, on = _sums(unit, scale, positives, t)
        row_losses = torch.log1p(off / on)  # lse_all - lse_pos (module docstring)
        weights = None if row_weights is None else row_weights.to(dtype)
        loss = row_losses.mean() if weights is None else (weights * row_losses).sum() / m

        ctx.with_grad = with_grad
        ctx.input_dtypes = (q.dtype, None)
        if with_grad:
            row_scale = scale / m if weights is None else weights * (scale / m)
            factor_off = row_scale / (off + on)  # softmax_all's factor
            factor_on = factor_off * off / on  # softmax_all - softmax_pos = -softmax_all * o / p on the positives
            factor_on.neg_()
            d_hat = torch.zeros_like(xf)
            _add_gradients(d_hat, unit, scale, positives, t, factor_off, factor_on)
            ctx.save_for_backward(normalise_backward(xf, x_inv, x_has_grad, d_hat, x_scale), None)
        return loss
