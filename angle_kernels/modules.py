"""nn.Module front ends: AngleLoss (drop-in for angle_emb.AngleLoss 0.6.1) and ArcCSELoss.

Each forward checks its inputs once (angle_kernels.inputs) and calls the formulas of angle_kernels.losses
directly, never the public functions (which would check the same inputs again)."""

from __future__ import annotations

import difflib
import inspect
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from . import user_warnings
from .contract import loss_entry
from .dispatch import check_backend, resolve_backend
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
    check_margin_fits,
    check_nested,
    check_scaled_weights_fit,
    check_same_columns,
    check_scalar,
    check_scale,
    check_triplets,
    check_two_views,
    check_weight_fits,
    check_zigzag,
    promote_embeddings,
    say_no_effect,
)
from .losses.angle import AngleSettings, angle_objective_a, angle_objective_b, angle_objective_c
from .losses.arccse import arccon, triplet

DATASET_FORMATS = ("A", "B", "C")
# the term weights each format multiplies its terms by (format B ignores them, as the reference does)
_TERM_WEIGHTS = {"A": ("cosine_w", "ibn_w", "angle_w"), "B": (), "C": ("cosine_w", "ibn_w", "cln_w", "angle_w")}
_TERM_TAUS = {"cosine_w": "cosine_tau", "ibn_w": "ibn_tau", "cln_w": "ibn_tau", "angle_w": "angle_tau"}


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
    being truncated. As in the reference, the cosine and angle terms of a batch with nothing to rank (format A with
    one pair, or every label equal) are 0 with zero gradients, without a warning.

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
            prefix of the embeddings, weighted and summed, the prefixes from one read of the embeddings (format A's
            "gte" partition and false-negative filter: one similarity_lse call per block for every prefix where
            the backend's similarity_lse has dims, else one per prefix).
            forward's keyword `layer_weights` (layer-wise, Espresso training): `outputs` is a stack [L, rows, D]
            of L layers' embeddings and the loss the weighted sum of the layers' losses (see functional).
        backend: keyword-only; "auto" (default), "torch", "triton" or "cuda".
        **kwargs: accepted and ignored, like the reference, with a warning naming them.
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
        if kwargs:  # taken, as the reference takes them, but never in silence: a misspelt keyword changes nothing
            forward_only = " (layer_weights is an argument of forward: loss(labels, outputs, layer_weights=...))" \
                if "layer_weights" in kwargs else ""
            meant = _close_arguments(set(kwargs) - {"layer_weights"})  # layer_weights: said above
            user_warnings.warn(f"AngleLoss ignores the keyword argument(s) {sorted(kwargs)}, as angle-emb's "
                               f"AngleLoss ignores those it does not take{forward_only}{meant}")
        self.cosine_w = check_scalar("cosine_w", cosine_w)
        self.ibn_w = check_scalar("ibn_w", ibn_w)
        self.cln_w = check_scalar("cln_w", cln_w)
        self.angle_w = check_scalar("angle_w", angle_w)
        self.cosine_tau = check_scale("cosine_tau", cosine_tau)
        self.ibn_tau = check_scale("ibn_tau", ibn_tau)
        self.angle_tau = check_scale("angle_tau", angle_tau)
        if dataset_format is not None:  # None: set before the first call, as angle-emb's AngleLoss() leaves it
            _check_dataset_format(dataset_format)
        self.dataset_format = dataset_format
        # a strategy no term uses is not read (angle-emb never reads it)
        if computes_angle_term(self.angle_w, dataset_format):
            check_choice("angle_pooling_strategy", angle_pooling_strategy, POOLING_STRATEGIES)
        self.angle_pooling_strategy = angle_pooling_strategy
        check_choice("ibn_partition", ibn_partition, tuple(IBN_PARTITIONS))
        self.ibn_partition = ibn_partition
        self.false_negative_margin = check_false_negative_filter(false_negative_margin, false_negative_strategy)
        self.false_negative_strategy = false_negative_strategy
        check_nested(dims, dim_weights, _ANY_WIDTH)  # the widths are checked against the embeddings' in forward
        self.dims, self.dim_weights = dims, dim_weights
        self.backend = check_backend(backend)  # here, not at the first training step

    def _nested(self, width: int, embeddings: torch.Tensor, angle_w: float, layer_weights: LayerWeights | None,
                layers: int | None) -> Nested | None:
        """The dims and layer weights of a call; the prefixes must have even widths where the angle term splits
        them in halves (angle_w > 0, formats A and C: format B has no angle term)."""
        return check_nested(self.dims, self.dim_weights, width,
                            even=computes_angle_term(angle_w, self.dataset_format),
                            layer_weights=layer_weights, layers=layers, embeddings=embeddings)

    def extra_repr(self) -> str:
        return (
            f"dataset_format={self.dataset_format!r}, cosine_w={self.cosine_w}, ibn_w={self.ibn_w}, "
            f"cln_w={self.cln_w}, angle_w={self.angle_w}, cosine_tau={self.cosine_tau}, ibn_tau={self.ibn_tau}, "
            f"angle_tau={self.angle_tau}, angle_pooling_strategy={self.angle_pooling_strategy!r}, "
            f"ibn_partition={self.ibn_partition!r}, false_negative_margin={self.false_negative_margin}, "
            f"false_negative_strategy={self.false_negative_strategy!r}, dims={self.dims}, "
            f"dim_weights={self.dim_weights}"
        )

    def __setstate__(self, state: dict[str, Any]) -> None:
        if "_parameters" not in state:
            # angle-emb's AngleLoss, a plain object whose attributes are its constructor's arguments, pickled where
            # angle-emb was not patched: its pickle names the class angle_emb.angle.AngleLoss, which in a process
            # where angle_kernels.integrations.angle_emb's patch is in effect is this class (or a subclass). Built
            # from those arguments, it loads as the loss the patch makes of angle-emb's, not a module without its
            # nn.Module state.
            self.__init__(**state)
            return
        super().__setstate__(state)

    def settings(self) -> AngleSettings:
        """The terms' weights, scales and in-batch options as forward computes them, read and checked at each call
        (angle-emb sets attributes after construction; one set to a bad value is refused as the constructor
        refuses it, not computed with)."""
        check_choice("ibn_partition", self.ibn_partition, tuple(IBN_PARTITIONS))  # the pooling: in forward
        return AngleSettings(
            *(check_scalar(name, getattr(self, name)) for name in ("cosine_w", "ibn_w", "cln_w", "angle_w")),
            *(check_scale(name, getattr(self, name)) for name in ("cosine_tau", "ibn_tau", "angle_tau")),
            self.angle_pooling_strategy, self.ibn_partition,
            check_false_negative_filter(self.false_negative_margin, self.false_negative_strategy),
            self.false_negative_strategy)

    @loss_entry
    def forward(self, labels: torch.Tensor | None, outputs: torch.Tensor, *,
                layer_weights: LayerWeights | None = None) -> torch.Tensor:
        _check_dataset_format(self.dataset_format)
        # first: outputs, or the first layer of a stack (the values of the others are checked here)
        layers, (first,) = check_layer_stack(layer_weights, ("outputs", outputs))
        settings = self.settings()
        for name in _TERM_WEIGHTS[self.dataset_format]:
            if getattr(settings, name) > 0:  # a weight <= 0 computes no term
                check_weight_fits(name, getattr(settings, name), first.dtype)
        _note_unused_in_batch_options(settings, self.dataset_format)
        if self.dataset_format == "A":
            row_labels = check_zigzag(labels, first, names=("labels", "outputs"))
            if settings.ibn_w > 0:
                check_binary_labels("labels", row_labels, "AngleLoss's in-batch-negative term (ibn_w > 0)")
        elif self.dataset_format == "B":
            check_embeddings("outputs", first, rows_multiple_of=2, layout="format B: query, positive rows")
        else:
            check_embeddings("outputs", first, rows_multiple_of=3, layout="format C: query, positive, negative rows")
        if computes_angle_term(settings.angle_w, self.dataset_format):
            # as angle-emb, which reads the attribute at each call: one set after construction too
            check_choice("angle_pooling_strategy", settings.angle_pooling_strategy, POOLING_STRATEGIES)
            check_angle_dim(first.shape[-1], "outputs")
        ops = resolve_backend(self.backend, outputs)
        nested = self._nested(first.shape[1], first, settings.angle_w, layer_weights, layers)
        if self.dataset_format == "B":  # one unweighted term: the contrastive one, its logits ibn_tau x cos
            check_scaled_weights_fit(first, ("ibn_tau", settings.ibn_tau), nested=nested)
        for name in _TERM_WEIGHTS[self.dataset_format]:
            if getattr(settings, name) > 0:
                check_scaled_weights_fit(first, (_TERM_TAUS[name], getattr(settings, _TERM_TAUS[name])),
                                         nested=nested, weight=(name, getattr(settings, name)))
        # outputs is checked whole above, so the formulas are called rather than the public functions, which would
        # scan the same rows for NaN/Inf again (one more device sync per step)
        if self.dataset_format == "A":
            return angle_objective_a(ops, settings, row_labels, outputs, nested)
        if self.dataset_format == "B":
            return angle_objective_b(ops, settings, outputs, nested)
        return angle_objective_c(ops, settings, outputs, nested)

    if TYPE_CHECKING:  # for type checkers only: calling the module runs forward (nn.Module's __call__ is untyped)
        __call__ = forward


# check_nested's width bound before the embeddings are known (the real one is checked in forward)
_ANY_WIDTH = 1 << 62


def _check_triplet_weight(value) -> float:
    """ArcCSE's lambda: a finite real >= 0 (angle-train's --triplet-w takes the same); a negative weight would
    reward the strongly masked view for being closer to the anchor than the weakly masked one."""
    value = check_scalar("triplet_weight", value)
    if value < 0:
        raise ValueError(f"triplet_weight must be >= 0 (a negative weight rewards the strongly masked view for being "
                         f"the closer one), got {value}")
    return value


def _note_unused_in_batch_options(settings: AngleSettings, dataset_format: str) -> None:
    """A warning (once per process) that the in-batch options were given where no in-batch term is computed
    (computes_in_batch_term): the loss is then that of their defaults. angle-train refuses the same settings before
    the model loads (trainer.check_format_settings)."""
    if computes_in_batch_term(settings.ibn_w, settings.cln_w, dataset_format):
        return
    given = []
    if settings.false_negative_margin is not None:
        given.append(f"false_negative_margin={settings.false_negative_margin:g}")
    if settings.ibn_partition != "angle":
        given.append(f"ibn_partition={settings.ibn_partition!r}")
    if given:
        weights = "ibn_w is 0" if dataset_format == "A" else "ibn_w and cln_w are 0"
        say_no_effect(f"AngleLoss's {' and '.join(given)} {'has' if len(given) == 1 else 'have'} no effect: format "
                      f"{dataset_format} computes no in-batch term where {weights}")


def computes_in_batch_term(ibn_w: float, cln_w: float, dataset_format: str | None) -> bool:
    """Whether AngleLoss computes an in-batch term, the one its false-negative filter and ibn_partition act on:
    format A's with ibn_w > 0, format C's with ibn_w or cln_w > 0, format B's always (a format not set yet may be
    any)."""
    return dataset_format in ("B", None) or ibn_w > 0 or (dataset_format == "C" and cln_w > 0)


def computes_angle_term(angle_w: float, dataset_format: str | None) -> bool:
    """Whether AngleLoss computes its angle term: a positive weight, in formats A and C (format B has none; a format
    not set yet may be either)."""
    return angle_w > 0 and dataset_format != "B"



class ArcCSELoss(nn.Module):
    """ArcCSE's objective: ArcCon plus triplet_weight times the triplet loss (paper: L = L_arc + 0.1 * L_tri).

    forward(h1, h2, anchor=None, weak=None, strong=None): h1, h2 are two views of the same N sentences
    (ArcCon); the triplet term is added when anchor, weak and strong are all given (any number of triplets, of h1's
    width).

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
        check_arccon_options(margin_degrees, tau)
        self.margin_degrees, self.tau = float(margin_degrees), float(tau)
        self.triplet_weight = _check_triplet_weight(triplet_weight)
        self.triplet_margin = check_scalar("triplet_margin", triplet_margin)
        check_nested(dims, dim_weights, _ANY_WIDTH)  # the widths are checked against the embeddings' in forward
        self.dims, self.dim_weights = dims, dim_weights
        self.backend = check_backend(backend)  # here, not at the first training step

    def extra_repr(self) -> str:
        return (f"margin_degrees={self.margin_degrees}, tau={self.tau}, triplet_weight={self.triplet_weight}, "
                f"triplet_margin={self.triplet_margin}, dims={self.dims}, dim_weights={self.dim_weights}")

    @loss_entry
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
                              layers=layers, embeddings=h1)
        # read and checked at each call, as AngleLoss's settings: an attribute set after construction takes effect
        margin_radians, tau = check_arccon_options(self.margin_degrees, self.tau)
        triplet_weight = _check_triplet_weight(self.triplet_weight)
        triplet_margin = check_scalar("triplet_margin", self.triplet_margin)
        if all(given):  # checked whatever the weight: a weight of 0 computes nothing with them, but they are wrong
            check_weight_fits("triplet_weight", triplet_weight, h1.dtype)
            check_triplets(*first[2:])
            check_margin_fits("triplet_margin", triplet_margin, rows=first[2].shape[0], dtype=h1.dtype)
            # one encoder embeds all five, and dims truncate both terms alike: a triplet of another width was scored
            # at a width the views were not, or (with dims) failed inside the triplet's op after ArcCon had run
            check_same_columns("h1", first[0], "anchor", first[2])
        check_scaled_weights_fit(h1, ("1 / tau", 1.0 / tau), nested=nested)
        loss = arccon(ops, h1, h2, margin_radians, tau, nested)
        if all(given) and triplet_weight != 0:
            loss = loss + triplet_weight * triplet(ops, anchor, weak, strong, triplet_margin, nested)
        return loss

    if TYPE_CHECKING:  # for type checkers only: calling the module runs forward (nn.Module's __call__ is untyped)
        __call__ = forward


def _close_arguments(ignored) -> str:
    """'; did you mean cosine_w (for cosine_weight)?' for the ignored keywords close to one AngleLoss takes, else ''."""
    taken = [name for name in inspect.signature(AngleLoss.__init__).parameters if name not in ("self", "kwargs")]
    close = {name: difflib.get_close_matches(name, taken, n=1) for name in sorted(ignored)}
    meant = [f"{match[0]} (for {name})" for name, match in close.items() if match]
    return f"; did you mean {', '.join(meant)}?" if meant else ""
