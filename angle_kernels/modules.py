"""nn.Module front ends: AngleLoss (drop-in for angle_emb.AngleLoss 0.6.1) and ArcCSELoss.

Each forward checks its inputs once (angle_kernels.inputs) and calls the formulas of angle_kernels.losses
directly, never the public functions (which would check the same inputs again)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .dispatch import Ops, resolve_backend
from .contract import compute_dtype
from .inputs import (
    IBN_PARTITIONS,
    POOLING_STRATEGIES,
    Dims,
    DimWeights,
    LayerWeights,
    Nested,
    check_angle_dim,
    check_arccon_options,
    check_binary_labels,
    check_choice,
    check_embeddings,
    check_false_negative_filter,
    check_layer_stack,
    check_nested,
    check_scalar,
    check_scale,
    check_triplets,
    check_two_views,
    check_zigzag,
    promote_embeddings,
)
from .losses.angle import as_pairs, in_batch_negatives, ranking_terms
from .losses.arccse import arccon, triplet
from .losses.retrieval import multiple_negatives

DATASET_FORMATS = ("A", "B", "C")


def _check_dataset_format(dataset_format) -> None:
    if dataset_format not in DATASET_FORMATS:
        raise ValueError(f"AngleLoss needs dataset_format 'A' (text1, text2, label), 'B' (query, positive) or "
                         f"'C' (query, positive, negative); got {dataset_format!r}")


class AngleLoss(nn.Module):
    """The AnglE objective (paper Eq. 8) assembled exactly as angle-emb 0.6.1's `AngleLoss`.

    Called as `loss(labels, outputs)`, like the reference (which is a plain callable), and usable as an
    nn.Module. `dataset_format` selects how `outputs` is laid out:

    - 'A' (text1, text2, label): zigzag rows [2N, D], labels [2N] or [2N, 1];
      loss = cosine_w * cosine + ibn_w * in-batch negatives + angle_w * angle (each term only if its weight > 0).
    - 'B' (query, positive): zigzag rows; loss = contrastive(query, positive, tau=ibn_tau); weights and labels
      are ignored, as in the reference.
    - 'C' (query, positive, negative): rows in groups of three [3B, D]; labels ignored;
      loss = (ibn_w * contrastive(q, pos) + cln_w * contrastive(q, pos, neg)) / 2
             + angle_w * angle + cosine_w * cosine
      where the angle and cosine terms rank the (q, pos) pairs (label 1) above the (q, neg) pairs (label 0).

    Defaults are 0.6.1's: cosine_w=0, ibn_w=1, cln_w=1, angle_w=0.02, every tau 20, 'sum' pooling (the paper
    used w=1 for every term and an angle tau of 1). Where the terms allow, they share one pass over the
    embeddings: the cosine and angle scores of all pairs come from a single pair-score op.

    Options of the in-batch-negative terms (ibn, and cln in format C; the defaults are the reference's terms):

    - ibn_partition "angle": the reference's terms. "gte": GTE's improved contrastive loss (Li et al., 2023), one
      softmax per pair over query -> every document, query -> every other query, document -> every query and
      document -> every other document (losses.retrieval.multiple_negatives with all four directions, "joint"). In
      format A the pairs labelled 1 get a term (divided by N, the number of pairs) and the others serve only as
      negatives; in format C the ibn term is GTE's on (q, pos) and the cln term GTE's with the hard negatives as
      more documents (query -> own and others' negatives; document -> other documents, own negative excluded).
    - false_negative_margin (None: off) and false_negative_strategy: the positive-aware false-negative filter
      on the model's own scores. In every row, a column whose cosine with the row exceeds its pair's positive
      cosine c minus the margin ("absolute") or c - |c| * margin ("relative") leaves the partition function;
      the positive stays. In format A with ibn_partition "angle" it filters AnglE's rows (each row against all
      other 2N - 1 rows, its partner the target, the threshold from the pair's cosine; divided by 2N).

    Differences from the reference: a ValueError (not NotImplementedError) for an unknown dataset_format, at
    construction, or a missing one, at the call; a 0-dim zero tensor (not the float 0.0) when every weight is 0;
    format C's `if cll > 0` check, which forces a GPU sync, is dropped (it only differs when the contrastive terms
    are exactly 0, where adding 0 changes nothing); graded labels with ibn_w > 0 raise ValueError instead of
    being truncated.

    Args:
        cosine_w, ibn_w, cln_w, angle_w: term weights (a term is computed only when its weight is > 0).
        cosine_tau, ibn_tau, angle_tau: the terms' scales (finite, > 0: check_scale; the reference
            accepts any value).
        angle_pooling_strategy: 'sum' or 'mean'.
        dataset_format: 'A', 'B' or 'C' (None: set the attribute before the first call).
        ibn_partition: keyword-only; "angle" (default) or "gte" (see above).
        false_negative_margin: keyword-only; None (default: no filter) or a real number (see above).
        false_negative_strategy: keyword-only; "absolute" (default) or "relative".
        dims, dim_weights: keyword-only; Matryoshka training (angle_kernels.functional): every term on every
            prefix of the embeddings, weighted and summed, the prefixes from one read of the embeddings. Not
            combined yet with format A's "gte" partition or false-negative filter (a ValueError says so).
            forward's keyword `layer_weights` (layer-wise, Espresso training): `outputs` is a stack [L, rows, D]
            of L layers' embeddings and the loss the weighted sum of the layers' losses (see functional).
        backend: keyword-only; "auto" (default), "torch", "triton" or "cuda".
        **kwargs: accepted and ignored, like the reference.
    """

    def __init__(
        self,
        cosine_w: float = 0.0,
        ibn_w: float = 1.0,
        cln_w: float = 1.0,
        angle_w: float = 0.02,
        cosine_tau: float = 20.0,
        ibn_tau: float = 20.0,
        angle_tau: float = 20.0,
        angle_pooling_strategy: str = "sum",
        dataset_format: str | None = None,
        *,
        ibn_partition: str = "angle",
        false_negative_margin: float | None = None,
        false_negative_strategy: str = "absolute",
        dims: Dims | None = None,
        dim_weights: DimWeights | None = None,
        backend: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__()
        self.cosine_w = check_scalar("cosine_w", cosine_w)
        self.ibn_w = check_scalar("ibn_w", ibn_w)
        self.cln_w = check_scalar("cln_w", cln_w)
        self.angle_w = check_scalar("angle_w", angle_w)
        self.cosine_tau = check_scale("cosine_tau", cosine_tau)
        self.ibn_tau = check_scale("ibn_tau", ibn_tau)
        self.angle_tau = check_scale("angle_tau", angle_tau)
        check_choice("angle_pooling_strategy", angle_pooling_strategy, POOLING_STRATEGIES)
        self.angle_pooling_strategy = angle_pooling_strategy
        if dataset_format is not None:  # None: set before the first call, as angle-emb's AngleLoss() leaves it
            _check_dataset_format(dataset_format)
        self.dataset_format = dataset_format
        check_choice("ibn_partition", ibn_partition, tuple(IBN_PARTITIONS))
        self.ibn_partition = ibn_partition
        self.false_negative_margin = check_false_negative_filter(false_negative_margin, false_negative_strategy)
        self.false_negative_strategy = false_negative_strategy
        check_nested(dims, dim_weights, _ANY_WIDTH)  # the widths are checked against the embeddings' in forward
        self.dims, self.dim_weights = dims, dim_weights
        self.backend = backend

    def _nested(self, width: int, layer_weights: LayerWeights | None, layers: int | None) -> Nested | None:
        return check_nested(self.dims, self.dim_weights, width, even=self.angle_w > 0, layer_weights=layer_weights,
                            layers=layers)

    def extra_repr(self) -> str:
        return (
            f"dataset_format={self.dataset_format!r}, cosine_w={self.cosine_w}, ibn_w={self.ibn_w}, "
            f"cln_w={self.cln_w}, angle_w={self.angle_w}, cosine_tau={self.cosine_tau}, ibn_tau={self.ibn_tau}, "
            f"angle_tau={self.angle_tau}, angle_pooling_strategy={self.angle_pooling_strategy!r}, "
            f"ibn_partition={self.ibn_partition!r}, false_negative_margin={self.false_negative_margin}, "
            f"false_negative_strategy={self.false_negative_strategy!r}, dims={self.dims}, "
            f"dim_weights={self.dim_weights}"
        )

    def forward(self, labels: torch.Tensor | None, outputs: torch.Tensor, *,
                layer_weights: LayerWeights | None = None) -> torch.Tensor:
        _check_dataset_format(self.dataset_format)
        # first: outputs, or the first layer of a stack (the values of the others are checked here)
        layers, (first,) = check_layer_stack(layer_weights, ("outputs", outputs))
        stack = (layer_weights, layers)
        if self.dataset_format == "A":
            return self._format_a(labels, outputs, first, stack)
        if self.dataset_format == "B":
            check_embeddings("outputs", first, rows_multiple_of=2, layout="format B: query, positive rows")
            # outputs is checked whole, so the computing half is called rather than the public function, which
            # would scan the same rows for NaN/Inf again (one more device sync per step).
            return self._contrastive(resolve_backend(self.backend, outputs), outputs[..., 0::2, :],
                                     outputs[..., 1::2, :], [], self._nested(first.shape[1], *stack))
        return self._format_c(outputs, first, stack)

    if TYPE_CHECKING:  # for type checkers only: calling the module runs forward (nn.Module's __call__ is untyped)
        __call__ = forward

    def _contrastive(self, ops: Ops, queries: torch.Tensor, positives: torch.Tensor, negatives: list[torch.Tensor],
                     nested: Nested | None) -> torch.Tensor:
        """The contrastive terms of formats B and C: query i against [positives; negatives], with the partition
        and the filter chosen (with the defaults, contrastive(queries, [positives; negatives]), the reference's)."""
        return multiple_negatives(ops, queries, positives, negatives, scale=self.ibn_tau,
                                  directions=IBN_PARTITIONS[self.ibn_partition],
                                  false_negative_margin=self.false_negative_margin,
                                  false_negative_strategy=self.false_negative_strategy, nested=nested)

    def _ranking_terms(self, ops: Ops, groups: torch.Tensor, labels: torch.Tensor,
                       nested: Nested | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(cosine_w * cosine, angle_w * angle) on the pairs (groups[g, 0], groups[g, k]), from one pair-score
        pass; a disabled term is None."""
        if self.cosine_w <= 0 and self.angle_w <= 0:
            return None, None
        if self.angle_w > 0:
            check_angle_dim(groups.shape[-1], "outputs")
        cosine_term, angle_term = ranking_terms(
            ops, groups, labels,
            cosine_tau=self.cosine_tau if self.cosine_w > 0 else None,
            angle_tau=self.angle_tau if self.angle_w > 0 else None,
            pooling_strategy=self.angle_pooling_strategy, nested=nested,
        )
        return (None if cosine_term is None else self.cosine_w * cosine_term,
                None if angle_term is None else self.angle_w * angle_term)

    def _format_a(self, labels: torch.Tensor | None, outputs: torch.Tensor, first: torch.Tensor,
                  stack: tuple[LayerWeights | None, int | None]) -> torch.Tensor:
        row_labels = check_zigzag(labels, first, names=("labels", "outputs"))
        if self.ibn_w > 0:
            check_binary_labels("labels", row_labels, "AngleLoss's in-batch-negative term (ibn_w > 0)")
        ops = resolve_backend(self.backend, outputs)
        nested = self._nested(first.shape[1], *stack)
        cosine_term, angle_term = self._ranking_terms(ops, as_pairs(outputs), row_labels[0::2], nested)
        ibn_term = None
        if self.ibn_w > 0:
            ibn_term = self.ibn_w * in_batch_negatives(
                ops, row_labels, outputs, self.ibn_tau, partition=self.ibn_partition,
                false_negative_margin=self.false_negative_margin, false_negative_strategy=self.false_negative_strategy,
                nested=nested)
        return _sum_terms([cosine_term, ibn_term, angle_term], outputs)  # the reference's order of summation

    def _format_c(self, outputs: torch.Tensor, first: torch.Tensor,
                  stack: tuple[LayerWeights | None, int | None]) -> torch.Tensor:
        check_embeddings("outputs", first, rows_multiple_of=3,
                                layout="format C: query, positive, negative rows")
        rows, dim = first.shape
        groups = rows // 3
        x = outputs.reshape(*outputs.shape[:-2], groups, 3, dim)
        query, positive, negative = x[..., 0, :], x[..., 1, :], x[..., 2, :]
        ops = resolve_backend(self.backend, outputs)
        nested = self._nested(first.shape[1], *stack)
        # The computing halves, called directly: outputs was checked whole just above.
        contrastive_term = None
        if self.ibn_w > 0 or self.cln_w > 0:
            contrastive_term = 0.0
            if self.ibn_w > 0:
                contrastive_term = self.ibn_w * self._contrastive(ops, query, positive, [], nested)
            if self.cln_w > 0:
                contrastive_term = contrastive_term + self.cln_w * self._contrastive(ops, query, positive, [negative],
                                                                                     nested)
            contrastive_term = contrastive_term / 2
        pair_labels = torch.cat((torch.ones(groups, device=outputs.device), torch.zeros(groups, device=outputs.device)))
        cosine_term, angle_term = self._ranking_terms(ops, x, pair_labels, nested)
        return _sum_terms([contrastive_term, angle_term, cosine_term], outputs)  # the reference's order


# check_nested's width bound before the embeddings are known (the real one is checked in forward)
_ANY_WIDTH = 1 << 62


def _sum_terms(terms: list[torch.Tensor | None], outputs: torch.Tensor) -> torch.Tensor:
    terms = [t for t in terms if t is not None]
    if not terms:
        return torch.zeros((), dtype=compute_dtype(outputs.dtype), device=outputs.device)
    total = terms[0]
    for term in terms[1:]:
        total = total + term
    return total


class ArcCSELoss(nn.Module):
    """ArcCSE's objective: ArcCon plus triplet_weight times the triplet loss (paper: L = L_arc + 0.1 * L_tri).

    forward(h1, h2, anchor=None, weak=None, strong=None): h1, h2 are two views of the same N sentences
    (ArcCon); the triplet term is added when anchor, weak and strong are all given.

    Args:
        margin_degrees: ArcCon's additive angular margin in degrees (10).
        tau: ArcCon's temperature (0.05; finite, > 0).
        triplet_weight: lambda (0.1).
        triplet_margin: the triplet loss's margin (0.0).
        dims, dim_weights: keyword-only; Matryoshka training (angle_kernels.functional), both terms.
            forward's keyword `layer_weights`: every input is a stack [L, rows, D] of L layers' embeddings (see
            functional).
        backend: keyword-only; "auto" (default), "torch", "triton" or "cuda".
    """

    def __init__(self, margin_degrees: float = 10.0, tau: float = 0.05, triplet_weight: float = 0.1,
                 triplet_margin: float = 0.0, *, dims: Dims | None = None, dim_weights: DimWeights | None = None,
                 backend: str | None = None) -> None:
        super().__init__()
        self.margin_radians, self.tau = check_arccon_options(margin_degrees, tau)
        self.margin_degrees = float(margin_degrees)
        self.triplet_weight = check_scalar("triplet_weight", triplet_weight)
        self.triplet_margin = check_scalar("triplet_margin", triplet_margin)
        check_nested(dims, dim_weights, _ANY_WIDTH)  # the widths are checked against the embeddings' in forward
        self.dims, self.dim_weights = dims, dim_weights
        self.backend = backend

    def extra_repr(self) -> str:
        return (f"margin_degrees={self.margin_degrees}, tau={self.tau}, triplet_weight={self.triplet_weight}, "
                f"triplet_margin={self.triplet_margin}, dims={self.dims}, dim_weights={self.dim_weights}")

    def forward(self, h1: torch.Tensor, h2: torch.Tensor, anchor: torch.Tensor | None = None,
                weak: torch.Tensor | None = None, strong: torch.Tensor | None = None, *,
                layer_weights: LayerWeights | None = None) -> torch.Tensor:
        given = [t is not None for t in (anchor, weak, strong)]
        if any(given) and not all(given):
            raise ValueError("ArcCSELoss needs all three of anchor, weak and strong for the triplet term, or none")
        if all(given):
            h1, h2, anchor, weak, strong = promote_embeddings(h1, h2, anchor, weak, strong)
        else:
            h1, h2 = promote_embeddings(h1, h2)
        triplets = [("anchor", anchor), ("weak", weak), ("strong", strong)] if all(given) else []
        layers, first = check_layer_stack(layer_weights, ("h1", h1), ("h2", h2), *triplets)
        check_two_views(*first[:2])
        ops = resolve_backend(self.backend, h1)
        nested = check_nested(self.dims, self.dim_weights, first[0].shape[1], layer_weights=layer_weights,
                              layers=layers)
        loss = arccon(ops, h1, h2, self.margin_radians, self.tau, nested)
        if all(given) and self.triplet_weight != 0:
            check_triplets(*first[2:])
            loss = loss + self.triplet_weight * triplet(ops, anchor, weak, strong, self.triplet_margin, nested)
        return loss

    if TYPE_CHECKING:  # for type checkers only: calling the module runs forward (nn.Module's __call__ is untyped)
        __call__ = forward
