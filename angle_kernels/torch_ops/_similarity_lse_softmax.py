"""similarity_lse at full width in the softmax form: what the torch backend computes on the CPU.

The contract is torch_ops/similarity_lse.py's (its module docstring): per row i, lse_i = logsumexp over the kept
columns K_i of l_ij = scale * cos_ij (+ the hardness penalty), -inf where K_i is empty, and in backward
dL/dcos_ij = g_i * scale * softmax_ij over K_i. The schedule is the same too (a block of rows against all columns,
the score and filter tiles made again in backward, only lse and the rows kept between the passes; the one exception
below keeps at most one tile, never an M x Mc matrix beyond the tile budget), computed with fewer passes over each
block's tiles, which is what a call costs on a CPU once its products are paid for:

    * the products take unit rows q_hat = q / max(|q|, eps), c_hat and likewise the filter's rows (made once,
      O((M + Mc) D)): a tile is its cosines, with no inverse norms multiplied into it (blocked form: two passes per
      tile, and two more per gradient tile in backward);
    * a row's lse is m_i - max_j log_softmax_ij (m_i the row's largest kept logit: the largest entry of its
      log_softmax is -log sum_j exp(l_ij - m_i)), and backward's softmax is `torch.softmax` of the block's logits:
      torch's fused softmax kernels, where the blocked form subtracts and exponentiates the tile in separate passes
      (on CPUs where torch's elementwise exp is MKL's, several times the softmax's time per entry, most of all on
      the entries that underflow);
    * g_i * scale multiplies the [b, D] products, not the tile;
    * a call whose rows make one block (M x Mc within the tile budget, common.chunk_elements: 1 << 22 logits on the CPU,
      2,048 x 2,048) and whose gradients autograd will ask for keeps that block's softmax for backward (its lse then
      taken from the softmax, as m_i - log max_j softmax_ij): backward makes only the two gradient products, not the
      score and filter tiles, their masks and softmax again (eager code's count of products: GIST up to ~2,000 pairs
      makes 12 products per call instead of 18). The kept tile is the one forward made, held by the call's ctx (not a
      saved tensor: _take_kept_tile) and let go by its backward. The tiles kept at once, by every call between its
      forward and its backward, hold at most KEPT_TILES tile budgets in all (64 MiB of float32 on the CPU, `_KEPT`):
      enough for one loss's calls (GIST's blocks, with a negative column four; MNRL's four GTE directions), so that
      their backward passes are the two gradient products each; a loss of more calls (those over every layer of a stack)
      keeps the first calls' tiles that fit and makes the others' again in backward, so its memory does not grow with
      the number of calls (each call keeping its own tile, 8 layers x 4 directions of 2,048 rows held 512 MB at once:
      more than at 4,096 rows, which keep none); a call of several blocks keeps none, and so does a call inside a
      torch.compile trace (the budget is Python state dynamo cannot trace).

The masks (exclusions, penalty, filter) are the blocked form's (similarity_lse._Tiles.masked_logits), made with fewer
boolean tiles where they are each row's target column alone (no penalty, exclude "none" or "target": GIST, the
query-to-query direction, the false-negative filter): the target columns are read and written through a view of the
block's diagonal, and the filter's comparison is the one [b, Mc] mask (_NamedFilterTiles.masked_logits; the same
values, bit for bit); a row that keeps no column is zeroed by its index, not by a mask broadcast over the tile (a CPU
fills a boolean mask at several times a float op's time per entry: GIST at 256 pairs, D = 64, 1.16-1.18x the eager
formula's time -> 1.06-1.08x, bench/results/cpu-2026-11-29-gist-masks/). Memory:
as the blocked form, at most three tile-sized float32 temporaries per block (cosines, logits and the filter's
cosines; in backward the logits and their softmax), with its boolean masks, on top of O((M + Mc) D) for the unit
rows and the gradients. Huge rows are scaled as there; unit rows are exact cosines' operands whatever the scale. The
rows' norms and the normalisation's backward are _cpu_rows.py's (torch's vector norm and vecdot, not the blocked
form's batched GEMVs, which a CPU runs 4-7x slower).

Raw dot products (normalize=False, with or without `reference`: MNRL's util.dot_score logits) take the same form
(SoftmaxDotLseFunction) where the blocked form's row scaling would change no bit (`takes_dot_products`: rows whose
products cannot overflow, and no filter but one on the model's own scores): the logits are the rows' products times
the scale, a row's value its lse less its reference logit (similarity_lse.py's `_reference_logits`); other dot
product calls (a guide's filter, rows near the dtype's range, inside torch.compile traces, where the values cannot be
asked) compute as everywhere, and so do dims (similarity_lse.py). On a GPU every call keeps the blocked form: the op
sweeps timed that code and `auto`'s choices depend on its times (angle_kernels.measured);
torch_ops/similarity_lse_paths.py routes the calls.
"""

from __future__ import annotations

import threading

import torch
from torch.autograd.function import once_differentiable

from ..contract import compute_dtype
from ..formed_gradients import gradients_wanted
from ._cpu_rows import SAFE_NORM, normalise_backward, normalised_rows, row_norms
from .common import chunk_elements, may_skip_scaling
from .similarity_lse import _block_reference, _reference_logits, _same_values, _Tiles


def _unit_rows(rows: torch.Tensor, inverse_norms: torch.Tensor) -> torch.Tensor:
    return rows * inverse_norms[:, None]


def _filter_unit_rows(rows: torch.Tensor) -> torch.Tensor:
    (scaled, _, inverse_norms, _), = normalised_rows(rows)
    return _unit_rows(scaled, inverse_norms)


def _row_lse(logits: torch.Tensor) -> torch.Tensor:
    """Each row's logsumexp [b] of a block of logits [b, Mc] (-inf outside the kept columns): m - max log_softmax,
    -inf for a row without kept columns (whose log_softmax is NaN)."""
    top = logits.amax(dim=1)
    spread = torch.log_softmax(logits, dim=1).amax(dim=1)  # -log sum_j exp(l_ij - m_i)
    return torch.where(torch.isneginf(top), top, top - spread)


def _row_lse_and_softmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(each row's logsumexp [b], the block's softmax [b, Mc]) of a block of logits: lse = m - log max_j softmax_ij
    (the softmax at the largest logit is exp(m - lse), at least 1 / Mc: no underflow); a row without kept columns
    gets lse = -inf and a softmax row of zeros (its weight in backward, where torch.softmax gives NaN)."""
    top = logits.amax(dim=1)
    weights = torch.softmax(logits, dim=1)
    empty = torch.isneginf(top)
    lse = torch.where(empty, top, top - weights.amax(dim=1).log_())
    _zero_rows(weights, empty)
    return lse, weights


def _zero_rows(tile: torch.Tensor, rows: torch.Tensor) -> None:
    """Zeroes the rows of a [b, Mc] tile where the mask `rows` [b] holds: by their indices where its values may be
    asked (common.may_skip_scaling's rule), as a CPU fills a broadcast [b, 1] mask entry by entry, at several times a
    float op's time per entry; elsewhere (inside torch.compile traces, where an index list has a data-dependent
    shape) by the broadcast mask."""
    if not may_skip_scaling(rows):
        tile.masked_fill_(rows[:, None], 0.0)
    elif bool(rows.any()):
        tile.index_fill_(0, rows.nonzero().view(-1), 0.0)


class _NamedFilterTiles(_Tiles):
    """similarity_lse._Tiles (the blocks and the masks) told whether its filter scores the model's own q and c
    (`own_scores`), instead of finding out by comparing data pointers, which torch.compile cannot trace. The filter's
    rows are _UnitTiles' own."""

    def __init__(self, q_in, c_in, qf, cf, q_inv, c_inv, scale, target_offset, period, exclude, penalty, penalty_on,
                 filter_threshold, filter_keeps_target, own_scores):
        super().__init__(q_in, c_in, qf, cf, q_inv, c_inv, scale, target_offset, period, exclude, penalty, penalty_on,
                         None, None, None, filter_keeps_target, True)  # no filter: no data pointers compared
        self.filter_threshold, self.own_scores_filter = filter_threshold, own_scores
        # the masks are each row's target column alone: read and written through the block's diagonal
        self.target_masks_only = exclude != "own" and (penalty == 0.0 or penalty_on == "none")

    def masked_logits(self, cos: torch.Tensor, start: int, end: int, filter_threshold: torch.Tensor | None,
                      guide: torch.Tensor | None, masks: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """_Tiles.masked_logits' result, for calls whose masks are each row's target column alone (no penalty, exclude
        "none" or "target": `target_masks_only`) with the target columns read and written through a view of the
        block's diagonal, not [b, Mc] boolean tiles compared from the indices and combined (up to four, each at
        several times a float op's time per entry on a CPU); the filter's comparison is the one tile left. Other
        calls: _Tiles.masked_logits."""
        if masks is not None or not self.target_masks_only:
            return super().masked_logits(cos, start, end, filter_threshold, guide, masks)
        rows, columns = cos.shape
        logits = cos * self.scale
        # row i's target column is first + i: the diagonal of the columns from `first` on holds the rows whose target
        # lies within the columns; the others read the last column, as _Tiles.masked_logits' clamped gather does
        first = start + self.target_offset
        within = max(0, min(rows, columns - first))
        target_logits = logits[:, first:].diagonal().clone() if within else logits.new_empty(0)
        if within < rows:
            target_logits = torch.cat([target_logits, logits[within:, columns - 1]])
        if filter_threshold is not None:
            threshold = filter_threshold[start:end, None]
            filtered = (cos if self.own_scores_filter else guide) > threshold
            if self.filter_keeps_target and within:
                filtered[:, first:].diagonal().fill_(False)
            logits.masked_fill_(filtered, float("-inf"))
        if self.exclude == "target" and within:
            logits[:, first:].diagonal().fill_(float("-inf"))
        return logits, target_logits


def _filter_on_own_scores(q, c, filter_q, filter_c, filter_threshold) -> bool:
    """Whether the call's filter is on the model's own scores (filter_q and filter_c are q and c detached: the
    score tile serves as the filter's). Inside torch.compile traces it is taken as one on other embeddings, whose
    products give the same values."""
    return (filter_threshold is not None and not torch.compiler.is_compiling() and _same_values(filter_q, q)
            and _same_values(filter_c, c))


class _UnitTiles:
    """The logits of a row block from unit rows, identically in forward and backward: the score tile, the filter's
    (for a filter on other embeddings than q and c), then the blocked form's masks."""

    def __init__(self, tiles: _Tiles, q_hat: torch.Tensor, c_hat: torch.Tensor, filter_q: torch.Tensor | None,
                 filter_c: torch.Tensor | None):
        self.tiles, self.q_hat, self.c_hat = tiles, q_hat, c_hat
        self.guided = tiles.filter_threshold is not None and not tiles.own_scores_filter
        if self.guided:
            self.filter_q_hat, self.filter_c_hat = _filter_unit_rows(filter_q), _filter_unit_rows(filter_c)

    def logits(self, start: int, end: int) -> tuple[torch.Tensor, None]:
        """(the block's logits, no reference logit: _row_values' `logits_of`)."""
        cos = torch.mm(self.q_hat[start:end], self.c_hat.T)
        guide = torch.mm(self.filter_q_hat[start:end], self.filter_c_hat.T) if self.guided else None
        return self.tiles.masked_logits(cos, start, end, self.tiles.filter_threshold, guide)[0], None


class _KeptTiles:
    """The elements of the softmax tiles kept between a call's forward and its backward, counted over every call of
    the process against one budget (KEPT_TILES tile budgets: module docstring)."""

    def __init__(self):
        self._elements, self._lock = 0, threading.Lock()

    def reserve(self, elements: int, budget: int) -> _Reservation | None:
        """A reservation of `elements` where the tiles kept now leave room for them within `budget`, else None."""
        with self._lock:
            if self._elements + elements > budget:
                return None
            self._elements += elements
        return _Reservation(self, elements)

    def release(self, elements: int) -> None:
        with self._lock:
            self._elements -= elements

    @property
    def elements(self) -> int:
        return self._elements


class _Reservation:
    """One kept tile's share of the budget: given back by backward once it has used the tile, or when the graph that
    holds it goes without a backward (the reservation, held by the call's ctx, is collected with it)."""

    def __init__(self, kept: _KeptTiles, elements: int):
        self._kept, self._elements = kept, elements

    def release(self) -> None:
        if self._elements:
            self._kept.release(self._elements)
            self._elements = 0

    def __del__(self):
        self.release()


# How many tile budgets (common.chunk_elements) the kept softmax tiles may hold together: GIST's four blocks (with a
# negative column) or MNRL's four GTE directions at 2,048 rows keep all theirs (GIST, 2,048 pairs, D = 384, two
# threads: 0.60-0.62x the eager formula's time keeping every tile, 0.83-0.87x keeping one budget's worth).
KEPT_TILES = 4
_KEPT = _KeptTiles()


def _row_values(tiles: _Tiles, logits_of, keep: bool, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor | None, _Reservation | None]:
    """(each row's value [M], the softmax kept for backward or None, its reservation of the kept tiles' budget): the
    lse of its block's logits, less its reference logit where `logits_of(start, end)` (-> (logits, reference logits
    [b] or None)) gives one. With `keep` (autograd will ask for the gradients) a call of one block keeps that block's
    softmax where the tiles kept by calls awaiting their backward leave room for it (module docstring), outside
    torch.compile traces; otherwise each block's tile is freed before the next is made."""
    blocks = list(tiles.blocks())
    m, mc = tiles.qf.shape[0], tiles.cf.shape[0]
    budget = KEPT_TILES * chunk_elements(tiles.qf.device)
    # inside a torch.compile trace nothing is kept (the budget's lock and reservations are Python state dynamo
    # cannot trace): backward makes the tiles again there
    traced = torch.compiler.is_compiling()
    reservation = _KEPT.reserve(m * mc, budget) if keep and len(blocks) == 1 and not traced else None
    if reservation is not None:
        logits, reference = logits_of(*blocks[0])
        lse, weights = _row_lse_and_softmax(logits)
        return (lse if reference is None else lse - reference), weights, reservation
    values = torch.empty(tiles.qf.shape[0], dtype=dtype, device=tiles.qf.device)
    for start, end in blocks:
        logits, reference = logits_of(start, end)
        lse = _row_lse(logits)
        values[start:end] = lse if reference is None else lse - reference
        del logits
    return values, None, None


def _score_gradients(tiles: _Tiles, logits_of, kept: torch.Tensor | None, values: torch.Tensor,
                     grad_values: torch.Tensor, q_rows: torch.Tensor, c_rows: torch.Tensor):
    """(dL/dq_rows, dL/dc_rows, g_i * scale [M]) for scores q_rows c_rows^T (unit rows: cosines; the rows: dot
    products): dL/dscore_ij = g_i * scale * softmax_ij over K_i, the softmax `kept` by forward or made again from
    `logits_of` a block at a time. Rows with no kept column (value -inf, where torch.softmax gives NaN) weigh 0."""
    empty = torch.isneginf(values)
    row_scale = torch.where(empty, torch.zeros_like(values), grad_values.to(values.dtype) * tiles.scale)
    d_q, d_c = torch.zeros_like(q_rows), torch.zeros_like(c_rows)
    for start, end in tiles.blocks():
        if kept is not None:  # the call's one block: its softmax from forward, empty rows zeroed there
            weights = kept
        else:
            weights = torch.softmax(logits_of(start, end)[0], dim=1)  # softmax over K_i
            _zero_rows(weights, empty[start:end])
        block_scale = row_scale[start:end, None]  # dL/dscore_ij = block_scale_i * weights_ij
        d_q[start:end].addcmul_(torch.mm(weights, c_rows), block_scale)
        d_c.addmm_(weights.T, q_rows[start:end] * block_scale)
        del weights  # before the next block's tile is made
    return d_q, d_c, row_scale


def _take_kept_tile(ctx) -> torch.Tensor | None:
    """The softmax tile forward kept for this backward (or None), taken off the call's ctx: a second backward
    (retain_graph) makes the tiles again. An attribute of ctx, not a saved tensor: whether a call keeps its tile
    depends on what the calls before it keep, so a non-reentrant torch.utils.checkpoint, whose recomputation of the
    forward (the first call's tiles still reserved) kept fewer, found fewer tensors saved and raised; with the tile
    off the saved tensors, the backward uses the original forward's tile or, where it kept none, makes them."""
    kept, ctx.kept_tile = ctx.kept_tile, None
    return kept


def _release(ctx) -> None:
    """After backward has used the call's kept tile (taken off its ctx: _take_kept_tile), its share of the budget is
    free for the next calls."""
    if ctx.kept_reservation is not None:
        ctx.kept_reservation.release()


class SoftmaxSimilarityLseFunction(torch.autograd.Function):
    """similarity_lse of cosines (normalize=True) at full width, without reference (module docstring)."""

    @staticmethod
    def forward(ctx, q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c,
                filter_threshold, filter_keeps_target, with_grad):
        dtype = compute_dtype(q.dtype)
        q_in, c_in = q.detach(), c.detach()
        (qf, q_scale, q_inv, q_has_grad), (cf, c_scale, c_inv, c_has_grad) = normalised_rows(q_in, c_in)
        own_scores = _filter_on_own_scores(q_in, c_in, filter_q, filter_c, filter_threshold)
        tiles = _NamedFilterTiles(q_in, c_in, qf, cf, q_inv, c_inv, scale, target_offset, period, exclude, penalty,
                                  penalty_on, filter_threshold, filter_keeps_target, own_scores)
        unit_tiles = _UnitTiles(tiles, _unit_rows(qf, q_inv), _unit_rows(cf, c_inv), filter_q, filter_c)
        lse, ctx.kept_tile, ctx.kept_reservation = _row_values(tiles, unit_tiles.logits, with_grad, dtype)
        ctx.save_for_backward(qf, cf, q_inv, c_inv, q_has_grad, c_has_grad, lse, q_scale, c_scale)
        ctx.unit_tiles = unit_tiles  # the unit rows and the filter's, O((M + Mc) D): not made again in backward
        ctx.input_dtypes = (q.dtype, c.dtype)
        return lse

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_lse):
        qf, cf, q_inv, c_inv, q_has_grad, c_has_grad, lse, q_scale, c_scale = ctx.saved_tensors
        kept = _take_kept_tile(ctx)
        unit_tiles = ctx.unit_tiles
        q_hat, c_hat = unit_tiles.q_hat, unit_tiles.c_hat
        d_qhat, d_chat, _ = _score_gradients(unit_tiles.tiles, unit_tiles.logits, kept, lse, grad_lse, q_hat, c_hat)
        _release(ctx)
        q_dtype, c_dtype = ctx.input_dtypes
        dq = normalise_backward(qf, q_inv, q_has_grad, d_qhat, q_scale).to(q_dtype)
        dc = normalise_backward(cf, c_inv, c_has_grad, d_chat, c_scale).to(c_dtype)
        return dq, dc, *([None] * 11)


class SoftmaxDotLseFunction(torch.autograd.Function):
    """similarity_lse of raw dot products (normalize=False) at full width, with or without reference, for rows that
    need no scaling and a filter on the model's own scores or none (`takes_dot_products`): the logits are the
    rows' products times the scale (every row's power of two is 1, so the blocked form's anchor-row scale is the
    identity), and each row's value is its lse less its reference logit (similarity_lse.py's `_reference_logits`,
    the target column's own logit where the reference row is that column's)."""

    @staticmethod
    def forward(ctx, q, c, reference, scale, target_offset, period, exclude, penalty, penalty_on, filter_threshold,
                filter_keeps_target, own_scores, with_grad):
        dtype = compute_dtype(q.dtype)
        q_in, c_in = q.detach(), c.detach()
        qf, cf = q_in.to(dtype), c_in.to(dtype)
        tiles = _NamedFilterTiles(q_in, c_in, qf, cf, None, None, scale, target_offset, period, exclude, penalty,
                                  penalty_on, filter_threshold, filter_keeps_target, own_scores)
        r_in = None if reference is None else reference.detach()
        references = None if r_in is None else _reference_logits(tiles, None, c_in, r_in)

        def logits_of(start, end):
            logits, target_logits = tiles.masked_logits(torch.mm(qf[start:end], cf.T), start, end, filter_threshold,
                                                        None)
            return logits, None if references is None else _block_reference(references, target_logits, start, end)

        values, ctx.kept_tile, ctx.kept_reservation = _row_values(tiles, logits_of, with_grad, dtype)
        ctx.save_for_backward(qf, cf, r_in, values)
        ctx.tiles, ctx.logits_of = tiles, logits_of
        ctx.input_dtypes = (q.dtype, c.dtype, None if reference is None else reference.dtype)
        return values

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_values):
        qf, cf, r_in, values = ctx.saved_tensors
        kept = _take_kept_tile(ctx)
        d_q, d_c, row_scale = _score_gradients(ctx.tiles, ctx.logits_of, kept, values, grad_values, qf, cf)
        _release(ctx)
        q_dtype, c_dtype, r_dtype = ctx.input_dtypes
        dr = None
        if r_in is not None:  # the reference logit scale * q_i . r_i enters with the opposite sign
            rows = r_in.to(qf.dtype)
            d_q.addcmul_(rows, row_scale[:, None], value=-1.0)
            dr = (qf * row_scale[:, None]).neg_().to(r_dtype)
        return d_q.to(q_dtype), d_c.to(c_dtype), dr, *([None] * 10)


def takes_dot_products(q, c, reference, scale, penalty, filter_q, filter_c, filter_threshold) -> bool:
    """Whether SoftmaxDotLseFunction computes this call of raw dot products: asked on the CPU outside torch.compile
    traces only (common.may_skip_scaling; elsewhere the blocked form computes), with no filter or one on the model's
    own scores, for rows whose norms are below _cpu_rows.SAFE_NORM (the roots of common.SAFE_SQUARED_NORM) and logits
    within a quarter of the dtype's range, (scale + |penalty|) * the largest squared norm: no product of two rows
    then overflows, and every row's power of two (row scaling, common.py) is one whose removal changes no bit."""
    if not may_skip_scaling(q):
        return False
    if filter_threshold is not None and not _filter_on_own_scores(q.detach(), c.detach(), filter_q, filter_c,
                                                                 filter_threshold):
        return False
    dtype = compute_dtype(q.dtype)
    rows = (q, c) if reference is None else (q, c, reference)
    # torch's max, not Python's: a NaN anywhere makes `largest` NaN, and the call then goes to the blocked form
    largest = float(torch.stack([row_norms(x.detach()).max().double() for x in rows]).max())
    return largest < SAFE_NORM[dtype] and (scale + abs(penalty)) * largest**2 < torch.finfo(dtype).max / 4


def dot_similarity_lse(q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c,
                       filter_threshold, filter_keeps_target, reference=None):
    """The op of raw dot products at full width in the softmax form, for calls `takes_dot_products` accepts."""
    own_scores = filter_threshold is not None
    return SoftmaxDotLseFunction.apply(q, c, reference, scale, target_offset, period, exclude, penalty, penalty_on,
                                       filter_threshold, filter_keeps_target, own_scores,
                                       gradients_wanted(q, c) or (reference is not None and reference.requires_grad))


def similarity_lse(q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c,
                   filter_threshold, filter_keeps_target):
    """The op of cosines at full width, without reference, in the softmax form (module docstring)."""
    return SoftmaxSimilarityLseFunction.apply(q, c, scale, target_offset, period, exclude, penalty, penalty_on,
                                              filter_q, filter_c, filter_threshold, filter_keeps_target,
                                              gradients_wanted(q, c))
