"""sentence-transformers losses computed by angle_kernels: change one import, get the same results.

    from angle_kernels.integrations.sentence_transformers import CoSENTLoss   # instead of sentence_transformers'
    loss = CoSENTLoss(model)                                                   # same arguments
    trainer = SentenceTransformerTrainer(model=model, train_dataset=dataset, loss=loss)

Each class here subclasses the sentence-transformers loss of the same name, takes the same constructor
arguments (plus a keyword-only `backend`: "auto" (default), "torch", "triton", "cuda"), and returns the same
loss value and gradients on the same model and batch (up to floating-point rounding; GIST's two exceptions are
below), while computing it with angle_kernels' fused losses:

    CoSENTLoss                          cosine_loss (or angle_loss with similarity_fct=pairwise_angle_sim):
                                        O(N) memory, one fused pass over the pairs
    AnglELoss                           angle_loss, pairs or (anchor, positive, negative...) n-tuples
    MultipleNegativesRankingLoss        multiple_negatives_ranking_loss, every option: never the B x B(1+k) score matrix
                                        (nor B x WB(1+k) with gather_across_devices over W processes)
    CachedMultipleNegativesRankingLoss  the same, on the whole cached batch at once (no loss-stage chunking)
    MultipleNegativesSymmetricRankingLoss, CachedMultipleNegativesSymmetricRankingLoss
                                        the same with the per-direction symmetric directions (deprecated
                                        upstream, kept for the scripts that name them)
    GISTEmbedLoss, CachedGISTEmbedLoss  gist_loss: the guide's similarities filter the in-batch negatives tile by
                                        tile, no B x B score matrix of the model or the guide (the cached one on
                                        the whole cached batch at once)
    MatryoshkaLoss                      over the fused losses above but GIST's: every (sampled) dimension in one
                                        fused call, from one read of the embeddings (over GIST, the parent's loop
                                        of fused GIST calls)
    AdaptiveLayerLoss, Matryoshka2dLoss over the non-cached fused losses above (or MatryoshkaLoss over one): every
                                        sampled layer (and dimension) in one fused call on the layers' stacked
                                        embeddings; the KL terms are the parent's

get_config_dict, the settings sentence-transformers' model cards print, is the parent's, plus `backend` where one is
given (the wrappers, MatryoshkaLoss and the layer-wise losses, take none and name their inner loss by its class, as
their parents do).

Argument combinations that the fused losses cannot express run the parent class's own computation,
unchanged; each class's docstring lists them (and a tensor `scale`, a learned nn.Parameter, runs the parent's
computation in CoSENTLoss, AnglELoss and the MNRL family, which train it, as does a learned `hardness_strength` in
the MNRL family and a learned `last_layer_weight` or `prior_layers_weight` in the layer-wise losses; a learned
`kl_div_weight` or `kl_temperature` is trained on the fused path too, whose KL terms are the parent's code), and
`loss.uses_fused_path` tells which path a configured loss takes. The embedding side (the model's forward,
GradCache's mini-batches) is untouched. A subclass of a drop-in that overrides a method the wrappers' loops call
(`forward`, `compute_loss_from_embeddings`, a cached loss's `calculate_loss`) keeps it under MatryoshkaLoss,
AdaptiveLayerLoss and Matryoshka2dLoss, which then run their parents' loops over it (their one fused call would
skip it); GISTEmbedLoss and CachedGISTEmbedLoss refuse one that overrides `sim_matrix`, as they refuse another
`similarity_fct`.

Differences from the parents, on inputs where the parents return NaN: angle_kernels raises a ValueError for
NaN/Inf embeddings or labels (switch the check off with `angle_kernels.set_input_checks(False)`), and gives
zero vectors cosine 0 instead of NaN (finite inputs agree; a zero row's own gradient, which means nothing, is sized
by the epsilon of the normalisation: GISTEmbedLoss's parent uses nn.CosineSimilarity's 1e-8 where this uses 1e-12,
and MatryoshkaLoss's parent normalises each truncated row twice, so there the sizes differ). A wrong number of input
columns (dataset columns other than the label) raises a ValueError naming the loss, the count and the inputs it
takes, where some parents raise an IndexError; CoSENTLoss refuses more than two columns, whose extra ones its parent
ignores. MatryoshkaLoss and Matryoshka2dLoss refuse, when built, a `matryoshka_dims` entry that is not an int and a
`matryoshka_weights` entry that is not a finite real number (a bool included), naming the entry, and AdaptiveLayerLoss
and Matryoshka2dLoss such a `last_layer_weight`, `prior_layers_weight`, `kl_div_weight` or `kl_temperature`: the
parents compute NaN or inf from such a weight, and take `True` as 1. At each call the three refuse, naming it, a
weight past the range of the model's losses' compute dtype (float32's 3.4e38 for a 32- or 16-bit model), before the
model embeds (a drawn layer's weight, alone or times a dimension's, and the sum of a dimension listed twice: before
any loss compute), where the parents' loss is inf or NaN. MultipleNegativesRankingLoss and
CachedMultipleNegativesRankingLoss likewise refuse, when built, a `hardness_strength` that is NaN, inf or a bool
(the parents refuse one < 0 only), or whose sum with `scale` is past the fused call's bound under a hardness_mode,
and GISTEmbedLoss and CachedGISTEmbedLoss a `margin` that is NaN or +-inf (the parents' filter keeps every column
for NaN and -inf, drops every one for +inf; the fused loss refused it at the first step).

GISTEmbedLoss and CachedGISTEmbedLoss (and MatryoshkaLoss over them) differ from their parents beyond rounding in
one case: a column whose guide score is above its row's threshold (the positive's guide score less the margin,
absolute or relative) by at most 2^-16 (`angle_kernels.contract.FILTER_TIE_ALLOWANCE`) stays among the negatives
here, where the parents' strict `>` drops it; a batch with such a column gets another loss. The allowance is there
for exact ties: a copy of row i's positive elsewhere in the batch has the positive's guide score in exact arithmetic,
which the parents' `>` keeps, and here the threshold (a pair score) and the column (a tile of products) round a few ulps
apart, so without it the copy's fate would be the rounding's. So a margin must exceed 2^-16 to drop exact
duplicates. And with a 16-bit guide (a bf16 or fp16 guide model, to save memory) the parents compute the guide's
cosines and thresholds in 16 bits, where columns within about 2^-8 of a threshold tie or flip by rounding; here
they are computed in float32 from the guide's 16-bit embeddings, as for a float32 guide, so the filter and the
loss can differ beyond rounding (by 13-23% on a tiny BERT's batch of 4 with a guide near the model, 4-17% at 8);
with a float32 guide the two agree to rounding.

Where sentence-transformers releases compute a loss differently, the drop-ins compute what the installed one does:
6.3 leaves row i's own anchor (positive) out of GIST's anchor-anchor (positive-positive) block, where earlier releases
left it to the guide's filter, which keeps it when the threshold reaches 1 (a negative margin).
"""

from __future__ import annotations

import importlib.util
import inspect
import random
import re
import warnings
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor

from .. import functional as _functional
from .. import inputs as _inputs
from .. import user_warnings
from ..losses import angle as _angle_losses
from ..losses import retrieval as _retrieval_losses
from ..contract import loss_entry, outside_autocast
from ..dispatch import check_backend, resolve_backend

# The oldest release the drop-ins run on: older parents lack what they build on (MatryoshkaLoss's
# uses_gradient_cache, AdaptiveLayerLoss's layer_weighting, the models' preprocess), which failed at the first step
OLDEST_RELEASE = (5, 7)
_NEEDED = f"pip install 'sentence-transformers>={OLDEST_RELEASE[0]}.{OLDEST_RELEASE[1]}'"

if importlib.util.find_spec("sentence_transformers") is None:  # a bare ModuleNotFoundError said nothing to install
    raise ModuleNotFoundError("angle_kernels.integrations.sentence_transformers replaces sentence-transformers' "
                              f"losses and needs the package: {_NEEDED}", name="sentence_transformers")

from sentence_transformers import __version__ as _st_version  # noqa: E402  (after the check that it is there)
from packaging.version import InvalidVersion as _InvalidVersion  # noqa: E402
from packaging.version import Version as _Version  # noqa: E402


def _release(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string: "6.3.0", "6.3.0.dev0", "6.3.0rc1" and "6.3.0+local" -> (6, 3), "6.10.1"
    -> (6, 10), "6rc3" -> (6, 0), "1!6.3.0" -> (6, 3), by PEP 440's rules (packaging, which transformers and
    sentence-transformers need): the string's first two numbers took an epoch for the major release ("1!6.3.0" was
    refused as 1.6) and a pre-release's number for the minor one ("6rc3" read 6.3). A string that is not PEP 440:
    its first two numbers."""
    try:
        parsed = _Version(version)
    except _InvalidVersion:
        return tuple(int(part) for part in re.findall(r"\d+", version)[:2])
    return (parsed.major, parsed.minor)


if _release(_st_version) < OLDEST_RELEASE:
    raise ImportError(f"angle_kernels.integrations.sentence_transformers subclasses sentence-transformers' losses "
                      f"from release {OLDEST_RELEASE[0]}.{OLDEST_RELEASE[1]} on; {_st_version} is installed: {_NEEDED}",
                      name="sentence_transformers")

try:  # sentence-transformers >= 6.1 keeps the losses here; the old path still works there with a warning
    from sentence_transformers.sentence_transformer import losses as _st_losses
except ImportError:  # pragma: no cover - older sentence-transformers
    from sentence_transformers import losses as _st_losses
from sentence_transformers import util as _st_util

try:  # sentence-transformers >= 6.3 follows `.loss` wrappers to the loss whose calculate_loss MatryoshkaLoss decorates
    from sentence_transformers.base.losses.gradcache import resolve_gradient_cache_loss as _gradient_cache_loss
except ImportError:  # pragma: no cover - older releases decorate the inner loss's own calculate_loss

    def _gradient_cache_loss(loss: Any) -> Any:
        return loss

if TYPE_CHECKING:  # for the annotations only
    from sentence_transformers import SentenceTransformer

try:  # the parent AdaptiveLayerLoss's hidden-state cache, which the fused layer-wise losses read the layer from
    from sentence_transformers.sentence_transformer.losses.adaptive_layer import (
        TransformerDecorator as _TransformerDecorator,
    )
except ImportError:  # pragma: no cover - older sentence-transformers
    from sentence_transformers.losses.AdaptiveLayerLoss import TransformerDecorator as _TransformerDecorator

__all__ = [
    "CoSENTLoss",
    "AnglELoss",
    "MultipleNegativesRankingLoss",
    "CachedMultipleNegativesRankingLoss",
    "MultipleNegativesSymmetricRankingLoss",
    "CachedMultipleNegativesSymmetricRankingLoss",
    "GISTEmbedLoss",
    "CachedGISTEmbedLoss",
    "MatryoshkaLoss",
    "AdaptiveLayerLoss",
    "Matryoshka2dLoss",
]

# sentence-transformers 6.3 leaves row i's own anchor (positive) out of GIST's anchor-anchor (positive-positive) block;
# before, the guide's filter decided, and kept it where the threshold was at least 1 (a negative margin): the drop-ins
# compute what the installed parent computes (gist_loss's self_negatives)
_PARENT_GIST_SELF_NEGATIVES = _release(_st_version) < (6, 3)

_DIRECTIONS = Literal["query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"]
_HARDNESS = Literal["in_batch_negatives", "hard_negatives", "all_negatives"]


class _BackendSetting:
    """Mixed in before the sentence-transformers parent of every drop-in that takes `backend`: get_config_dict (what
    sentence-transformers' model cards print as the loss's settings, and its trainer logs) is the parent's, plus
    "backend" where one was given. The default (None: ANGLE_KERNELS_BACKEND at each call, else auto) adds nothing,
    so a loss built with the parent's arguments alone has the parent's config."""

    def get_config_dict(self) -> dict[str, Any]:
        config = super().get_config_dict()
        return config if self.backend is None else {**config, "backend": self.backend}


# --------------------------------------------------------------------------------------------------------
# Pair ranking: CoSENT and AnglE
# --------------------------------------------------------------------------------------------------------


def _pair_score_kind(similarity_fct: Callable[..., Tensor]) -> str | None:
    """'cosine' or 'angle' when similarity_fct is one our ranking losses compute; None otherwise."""
    if similarity_fct is _st_util.pairwise_cos_sim:
        return "cosine"
    if similarity_fct is _st_util.pairwise_angle_sim:
        return "angle"
    return None


@loss_entry
def _fused_pair_ranking(first: Tensor, second: Tensor, labels: Tensor, kind: str, scale: float,
                        backend: str | None, nested: _inputs.Nested | None = None) -> Tensor:
    """The CoSENT objective over pairs (first[i], second[i]) scored by scale * cos or scale * |angle sim|:
    angle_kernels' ranking term on the pairs [N, 2, D] (one copy of the embeddings; no N x N anywhere), on
    every prefix when nested (MatryoshkaLoss), and on every layer of stacks [L, N, D] when nested.stacked
    (AdaptiveLayerLoss, Matryoshka2dLoss)."""
    if kind == "angle" and first.shape[-1] % 2:
        # pairwise_angle_sim pads an odd dimension with one zero column before splitting into halves
        first = torch.nn.functional.pad(first, (0, 1))
        second = torch.nn.functional.pad(second, (0, 1))
    scale = _inputs.check_scale("scale", scale)
    stack = None if nested is None or not nested.stacked else nested.table
    _, (first_layer, second_layer) = _inputs.check_layer_stack(stack, ("embeddings_a", first),
                                                                ("embeddings_b", second))
    _inputs.check_embedding_group(("embeddings_a", first_layer), ("embeddings_b", second_layer))
    _inputs.check_same_shape("embeddings_a", first, "embeddings_b", second)
    # the name the drop-ins' other messages give the first column, whose rows and device the labels must match
    labels = _inputs.check_labels("labels", labels, first.shape[-2], first.device, embeddings="embeddings_a")
    first, second = _inputs.promote_embeddings(first, second)
    _inputs.check_scaled_weights_fit(first, ("scale", scale), nested=nested)
    ops = resolve_backend(backend, first)
    pairs = torch.stack((first, second), dim=-2)
    if kind == "cosine":
        return _angle_losses.ranking_terms(ops, pairs, labels, cosine_tau=scale, nested=nested)[0]
    return _angle_losses.ranking_terms(ops, pairs, labels, angle_tau=scale, pooling_strategy="sum", nested=nested)[1]


def _require_labels(loss: torch.nn.Module) -> None:
    # the parents fail on labels.numel() / labels[:, None] with an AttributeError or TypeError
    raise ValueError(
        f"{loss.__class__.__name__} requires labels: a float similarity score per pair (the dataset's 'label' or "
        "'score' column); got labels=None, as a dataset without a label column gives")


def _check_labels_given(loss: torch.nn.Module, labels: Tensor | None, columns: int) -> None:
    """At the start of a forward, before the model embeds anything: `loss`, or the inner loss of a Matryoshka or
    layer-wise wrapper, is this module's CoSENTLoss or AnglELoss scoring pairs (AnglELoss's n-tuples default their
    labels) and labels is None: the ValueError naming labels (it came once every column, and every sampled layer,
    was embedded). Any other loss: nothing checked here."""
    while isinstance(loss, (MatryoshkaLoss, _FusedLayerwise)):
        loss = loss.loss
    scores_pairs = isinstance(loss, CoSENTLoss) or (isinstance(loss, AnglELoss) and columns <= 2)
    if labels is None and scores_pairs:
        _require_labels(loss)


def _check_label_count(loss: torch.nn.Module, labels: Tensor | None, batch_size: int) -> None:
    if labels is None:
        _require_labels(loss)
    # the same check and message as sentence-transformers, so a bad batch fails the same way
    if labels.numel() != batch_size:
        raise ValueError(
            f"{loss.__class__.__name__} expects {batch_size} labels (one per example), "
            f"but got {labels.numel()} labels with shape {tuple(labels.shape)}."
        )


# The input columns each loss takes (a dataset's columns other than its label column, in order), as
# sentence-transformers documents them: (fewest, most or None, what they are). The parents fail on too few with an
# IndexError (CoSENTLoss, AnglELoss, CachedGISTEmbedLoss) or a message that names neither the loss nor the inputs,
# and CoSENTLoss silently ignores every column after the second; here each raises _check_columns' ValueError.
_PAIRS = (2, 2, "(input_A, input_B) pairs with a float similarity score as the label (for (anchor, positive, "
          "negative...) tuples use AnglELoss or MultipleNegativesRankingLoss)")
_PAIRS_OR_TUPLES = (2, None, "(input_A, input_B) pairs with a float similarity score as the label, or (anchor, "
                    "positive, negative_1, ..., negative_n) tuples")
_ANCHORED = (2, None, "(anchor, positive) pairs or (anchor, positive, negative_1, ..., negative_n) tuples")
_GIST = (2, 3, "(anchor, positive) pairs or (anchor, positive, negative) triplets")


def _check_columns(loss: torch.nn.Module, count: int) -> None:
    """A ValueError naming the loss, the number of input columns it got and what it takes (loss._input_columns)."""
    fewest, most, inputs = loss._input_columns
    if count < fewest or (most is not None and count > most):
        expected = (f"{fewest} or more" if most is None else str(fewest) if fewest == most else
                    " or ".join(map(str, range(fewest, most + 1))))
        raise ValueError(
            f"{loss.__class__.__name__} got {count} input column{'' if count == 1 else 's'}; it expects {expected}: "
            f"{inputs}. Every dataset column other than the label column ('label' or 'score') is an input column.")


class CoSENTLoss(_BackendSetting, _st_losses.CoSENTLoss):
    """sentence-transformers' CoSENTLoss computed by angle_kernels (`cosine_loss`): same arguments, same results.

    loss = log(1 + sum over pairs (i, j) with label_i < label_j of exp(scale * (s_i - s_j))), s = similarity.

    Fused when `similarity_fct` is `util.pairwise_cos_sim` (the default; computed by
    `angle_kernels.cosine_loss`) or `util.pairwise_angle_sim` (computed by `angle_kernels.angle_loss`).
    Any other similarity function runs sentence-transformers' own computation (`uses_fused_path` is False).

    Args:
        model: the SentenceTransformer.
        scale: inverse temperature of the scores (default 20).
        similarity_fct: pairwise similarity (default `util.pairwise_cos_sim`).
        backend: keyword-only; angle_kernels backend ("auto", "torch", "triton", "cuda"; default: auto).

    Inputs: exactly two columns; other counts raise a ValueError saying what is expected (the parent raises an
    IndexError for one column and ignores the columns after the second), and a score per pair (labels=None, a
    dataset without a label or score column, raises a ValueError naming labels, before the model embeds). A batch
    with nothing to rank (one pair, or every label equal) gives 0 with zero gradients, as the parent does, without a
    warning.
    """

    _input_columns = _PAIRS

    def __init__(self, model: SentenceTransformer, scale: float = 20.0,
                 similarity_fct: Callable[[Tensor, Tensor], Tensor] = _st_util.pairwise_cos_sim, *,
                 backend: str | None = None) -> None:
        _check_constructor_numbers(scale=scale)
        super().__init__(model, scale=scale, similarity_fct=similarity_fct)
        self.backend = check_backend(backend)

    @property
    def uses_fused_path(self) -> bool:
        return _pair_score_kind(self.similarity_fct) is not None and not _tensor_scale(self)

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None) -> Tensor:
        sentence_features = list(sentence_features)
        _check_labels_given(self, labels, len(sentence_features))  # before the model embeds
        return super().forward(sentence_features, labels)

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], labels: Tensor) -> Tensor:
        _check_columns(self, len(embeddings))
        if not self.uses_fused_path:
            _check_label_count(self, labels, embeddings[0].shape[-2])  # _fused_loss checks its own
            return super().compute_loss_from_embeddings(embeddings, labels)
        return self._fused_loss(embeddings, labels)

    def _fused_loss(self, embeddings: list[Tensor], labels: Tensor,
                    nested: _inputs.Nested | None = None) -> Tensor:
        _check_columns(self, len(embeddings))
        _check_label_count(self, labels, embeddings[0].shape[-2])
        labels = labels.reshape(-1)  # any shape of B labels, as the parent's view(-1)
        return _fused_pair_ranking(embeddings[0], embeddings[1], labels, _pair_score_kind(self.similarity_fct),
                                   self.scale, self.backend, nested)


class AnglELoss(_BackendSetting, _st_losses.AnglELoss):
    """sentence-transformers' AnglELoss computed by angle_kernels (`angle_loss`): same arguments, same results.

    The CoSENT objective with the AnglE similarity `|cos(u, v) + sin-term|` (angle-emb's complex division,
    sum pooling); `scale` plays the part of angle-emb's tau. Accepts, like the parent, (text1, text2) pairs
    with labels, and (anchor, positive, negative_1, ..., negative_k) n-tuples whose anchor-positive pairs
    get `labels` (or 1) and anchor-negative pairs `1 - labels` (or 0).

    Always fused, unless `similarity_fct` is reassigned after construction to something other than
    `util.pairwise_angle_sim` (then the parent's computation runs; `uses_fused_path` is False). Pairs without
    labels raise a ValueError naming labels, before the model embeds; a batch with nothing to rank (one pair, or
    every label equal) gives 0 with zero gradients, as the parent does, without a warning.

    Args:
        model: the SentenceTransformer.
        scale: inverse temperature of the scores (default 20).
        backend: keyword-only; angle_kernels backend ("auto", "torch", "triton", "cuda"; default: auto).
    """

    _input_columns = _PAIRS_OR_TUPLES

    def __init__(self, model: SentenceTransformer, scale: float = 20.0, *, backend: str | None = None) -> None:
        _check_constructor_numbers(scale=scale)
        super().__init__(model, scale=scale)
        self.backend = check_backend(backend)

    @property
    def uses_fused_path(self) -> bool:
        return _pair_score_kind(self.similarity_fct) is not None and not _tensor_scale(self)

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor | None) -> Tensor:
        sentence_features = list(sentence_features)
        _check_labels_given(self, labels, len(sentence_features))  # pairs: before the model embeds
        return super().forward(sentence_features, labels)

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], labels: Tensor | None) -> Tensor:
        _check_columns(self, len(embeddings))
        if not self.uses_fused_path:
            return super().compute_loss_from_embeddings(embeddings, labels)
        return self._fused_loss(embeddings, labels)

    def _fused_loss(self, embeddings: list[Tensor], labels: Tensor | None,
                    nested: _inputs.Nested | None = None) -> Tensor:
        _check_columns(self, len(embeddings))
        kind = _pair_score_kind(self.similarity_fct)
        anchors = embeddings[0]
        if len(embeddings) > 2:
            # n-tuples: every (anchor, candidate) pair, positives first, then each negative column
            candidates = embeddings[1:]
            if labels is None:
                labels = torch.ones(anchors.shape[-2], device=anchors.device)
            _check_label_count(self, labels, anchors.shape[-2])
            labels = labels.reshape(-1)
            pair_labels = torch.cat([labels] + [1 - labels] * (len(candidates) - 1))
            first = torch.cat([anchors] * len(candidates), dim=-2)  # rows: [L,] rows, D
            second = torch.cat(candidates, dim=-2)
            return _fused_pair_ranking(first, second, pair_labels, kind, self.scale, self.backend, nested)
        _check_label_count(self, labels, anchors.shape[-2])  # pairs need their labels (tuples default them)
        labels = labels.reshape(-1)  # any shape of B labels, as the parent's view(-1)
        return _fused_pair_ranking(anchors, embeddings[1], labels, kind, self.scale, self.backend, nested)


# --------------------------------------------------------------------------------------------------------
# In-batch negatives: MultipleNegativesRankingLoss and its cached (GradCache) version
# --------------------------------------------------------------------------------------------------------


def _parent_kwargs(parent_init: Callable[..., None], given: dict[str, Any],
                   defaults: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of `given` that the installed parent's __init__ accepts.

    Older sentence-transformers 6.x releases lack some of the newer MultipleNegativesRankingLoss arguments
    (directions, partition_mode, hardness_*): those are dropped while they keep their default value (the
    parent then behaves as that default), and a non-default value raises a TypeError naming the argument.
    """
    accepted = inspect.signature(parent_init).parameters
    out = {}
    for name, value in given.items():
        if name in accepted:
            out[name] = value
        elif value != defaults[name]:
            import sentence_transformers

            raise TypeError(f"{name}={value!r} needs a newer sentence-transformers than the installed "
                            f"{sentence_transformers.__version__}, whose loss does not take {name!r}")
    return out


_MNRL_DEFAULTS = {"gather_across_devices": False, "directions": ("query_to_doc",), "partition_mode": "joint",
                  "hardness_mode": None, "hardness_strength": 0.0, "mini_batch_num_tokens": None,
                  "show_progress_bar": False}


def _mnrl_similarity(loss: torch.nn.Module) -> str | None:
    """The functional API's name of the loss's similarity_fct: "cosine" (util.cos_sim), "dot" (util.dot_score),
    or None for another function."""
    if loss.similarity_fct is _st_util.cos_sim:
        return "cosine"
    if loss.similarity_fct is _st_util.dot_score:
        return "dot"
    return None


def _learned(value: Any) -> bool:
    """Whether a hyper-parameter is learned: a tensor that requires grad (an nn.Parameter the parents train; the
    fused ops take numbers, so a configuration with one runs the parent's computation)."""
    return isinstance(value, torch.Tensor) and value.requires_grad


def _current_value(value: Any) -> Any:
    """A hyper-parameter as the checks read it: a learned one's current value (detached), anything else as given."""
    return value.detach() if _learned(value) else value


def _check_constructor_numbers(*, scale=None, temperature=None, mini_batch_size=None,
                               hardness_strength=None, hardness_mode=None, margin=None) -> None:
    """The numbers a drop-in is built with, checked when it is built (before any model runs: the parents take
    anything, and a bad one failed at the first loss call, after the model's forward passes, or inside GradCache's
    chunking): a number scale or temperature by the loss's one rule (inputs.check_scale; a tensor scale is a learned
    one, the parent's to compute with, `_tensor_scale`), a hardness_strength that is a finite real number (the
    parent refuses one < 0 but takes NaN, inf and True; a learned one by its current value, the parent's to compute
    with) whose sum with a number scale is held to the fused call's bound under a hardness_mode
    (inputs.check_hardness_fits), a GIST margin that is a finite real number (the fused loss refused NaN and +-inf
    at the first step, after the model's forward passes; the parent's filter keeps every column for NaN and -inf,
    and drops every one for +inf), a mini_batch_size of at least one row (an int, or one that converts exactly:
    numpy's integers)."""
    number_scale = scale is not None and not isinstance(scale, torch.Tensor)
    if number_scale:
        scale = _inputs.check_scale("scale", scale)
    if temperature is not None:
        _inputs.check_scale("temperature", temperature, divides=True)
    if margin is not None:
        _inputs.check_scalar("margin", margin)
    if hardness_strength is not None:
        learned = _learned(hardness_strength)
        hardness_strength = _inputs.check_scalar("hardness_strength", _current_value(hardness_strength))
        if number_scale and not learned:
            _inputs.check_hardness_fits(scale=scale, hardness_mode=hardness_mode, hardness_strength=hardness_strength)
    if mini_batch_size is not None:
        try:
            rows = _inputs.check_width("mini_batch_size", mini_batch_size)
        except TypeError:
            rows = 0
        if rows < 1:
            raise ValueError(f"mini_batch_size must be an int >= 1 (rows a mini-batch embeds), got {mini_batch_size!r}")


def _check_directions(directions) -> None:
    """Directions that are none of the four, named in a fixed order with the four in theirs (the parents print
    both as sets, in an order that changes between processes); anything else is the parents' to check."""
    if isinstance(directions, (tuple, list)):
        unknown = [d for d in directions if d not in _inputs.DIRECTIONS]
        if unknown:
            verb = "is not a direction" if len(unknown) == 1 else "are not directions"
            raise ValueError(f"directions: {', '.join(map(repr, unknown))} {verb}; the directions are "
                             f"{', '.join(map(repr, _inputs.DIRECTIONS))}")


def _tensor_scale(loss: torch.nn.Module) -> bool:
    """Whether the loss's scale is a tensor (a learned one: an nn.Parameter the parents train; the fused ops take a
    number), which the parent's computation then runs with."""
    return isinstance(getattr(loss, "scale", None), torch.Tensor)


def _mnrl_unfused_reason(loss: torch.nn.Module) -> str | None:
    """Why a MultipleNegativesRankingLoss configuration cannot run fused; None when it can: every configuration
    with cosine or dot-product similarity (any directions, partition mode, hardness, gathering) and a number as its
    scale runs fused."""
    if _mnrl_similarity(loss) is None:
        return "similarity_fct is neither util.cos_sim nor util.dot_score"
    if _tensor_scale(loss):
        return "scale is a tensor (a learned scale), which the fused ops do not train"
    if _learned(getattr(loss, "hardness_strength", 0.0)):
        return "hardness_strength is learned (a tensor that requires grad), which the fused ops do not train"
    return None


@loss_entry
def _fused_mnrl(loss: torch.nn.Module, embeddings: list[Tensor], nested: _inputs.Nested | None = None) -> Tensor:
    """The loss's configuration (getattr with the defaults: older 6.x parents lack some attributes) computed by
    angle_kernels.losses.retrieval.multiple_negatives, with the checks of the public multiple_negatives_ranking_loss and
    `nested` as parsed by the caller (no second parse of the dims): on every prefix when nested has dims
    (MatryoshkaLoss, which normalises each truncated embedding: every similarity is then a cosine,
    util.dot_score's too), on every layer of stacks [L, rows, D] when nested.stacked."""
    _check_columns(loss, len(embeddings))
    truncated = nested is not None and nested.dims is not None
    queries, positives, *negatives = embeddings
    call = _inputs.check_multiple_negatives(
        queries, positives, negatives, scale=loss.scale, directions=getattr(loss, "directions", ("query_to_doc",)),
        partition_mode=getattr(loss, "partition_mode", "joint"), hardness_mode=getattr(loss, "hardness_mode", None),
        hardness_strength=getattr(loss, "hardness_strength", 0.0), false_negative_margin=None,
        false_negative_strategy="absolute", similarity="cosine" if truncated else _mnrl_similarity(loss),
        gather_across_devices=bool(getattr(loss, "gather_across_devices", False)),  # read by truth value there
        nested=nested)
    return _retrieval_losses.multiple_negatives(resolve_backend(loss.backend, call.queries), **call._asdict())


class _FusedMNRL:
    """The fused loss of the MultipleNegativesRankingLoss family, mixed in before the sentence-transformers
    parent (whose computation `super()` reaches for the configurations `_mnrl_unfused_reason` names)."""

    _input_columns = _ANCHORED

    @property
    def uses_fused_path(self) -> bool:
        return _mnrl_unfused_reason(self) is None

    def compute_loss_from_embeddings(self, embeddings: list[Tensor], labels: Tensor) -> Tensor:
        _check_columns(self, len(embeddings))
        if _mnrl_unfused_reason(self) is not None:
            return super().compute_loss_from_embeddings(embeddings, labels)
        return self._fused_loss(embeddings, labels)

    def _fused_loss(self, embeddings: list[Tensor], labels: Tensor | None,
                    nested: _inputs.Nested | None = None) -> Tensor:
        return _fused_mnrl(self, embeddings, nested)


def _grad_cache_step(loss: Tensor, with_backward: bool) -> Tensor:
    """The end of a cached loss's calculate_loss: with_backward, back-propagate to the cached embeddings
    (GradCache reads the gradient off each cached mini-batch tensor, rep.grad: torch.cat routes it back) and
    return the value detached. That backward runs inside the loss call, so inside the trainer's autocast region
    (mixed precision wraps the loss's forward): it runs with autocast off, as a backward outside the region does
    (autocast ran the ops' backward products in 16 bits: parameter gradients 1.8e-2 off, the parent's 1.4e-4)."""
    if not with_backward:
        return loss
    with outside_autocast(loss):
        loss.backward()
    return loss.detach()


class _FusedCachedMNRL:
    """The loss stage of the cached (GradCache) MultipleNegativesRankingLoss family, fused; mixed in before the
    sentence-transformers parent, whose embedding side is untouched."""

    _input_columns = _ANCHORED

    @property
    def uses_fused_path(self) -> bool:
        return _mnrl_unfused_reason(self) is None

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor) -> Tensor:
        sentence_features = list(sentence_features)
        _check_columns(self, len(sentence_features))  # before embedding any mini-batch
        return super().forward(sentence_features, labels)

    def calculate_loss(self, reps: list[list[Tensor]], labels: Tensor | None = None, *,
                       with_backward: bool = False) -> Tensor:
        _check_columns(self, len(reps))
        if _mnrl_unfused_reason(self) is not None:
            return super().calculate_loss(reps, labels, with_backward=with_backward)
        return self._fused_cached_loss(reps, with_backward)

    def _fused_cached_loss(self, reps: list[list[Tensor]], with_backward: bool,
                           nested: _inputs.Nested | None = None) -> Tensor:
        loss = _fused_mnrl(self, [torch.cat(column) for column in reps], nested)
        return _grad_cache_step(loss, with_backward)


class MultipleNegativesRankingLoss(_BackendSetting, _FusedMNRL, _st_losses.MultipleNegativesRankingLoss):
    """sentence-transformers' MultipleNegativesRankingLoss (InfoNCE with in-batch negatives) computed by
    angle_kernels (`multiple_negatives_ranking_loss`): same arguments, same results, and no B x B(1+k)
    score matrix in memory.

    Inputs: (anchor, positive) pairs or (anchor, positive, negative_1, ..., negative_k) n-tuples; labels are
    ignored, as in the parent.

    Fused for every option (directions, partition_mode, hardness_mode / hardness_strength,
    gather_across_devices) with `similarity_fct=util.cos_sim` (the default) or `util.dot_score`; another
    similarity function runs sentence-transformers' own computation. `uses_fused_path` says which applies.

    gather_across_devices=True (several processes, torch.distributed): as in the parent, every document column
    is all-gathered with gradients (`angle_kernels.distributed.all_gather_with_grad`), and so are the queries
    where a direction scores them as columns (query_to_query, doc_to_query; the parent gathers them always), and
    each rank's loss is the mean over its own queries scored against the documents of every rank (and, for
    doc_to_query, its own positives against every rank's queries); the gather's backward sums the ranks'
    gradients. Still no B x (world_size * B) score matrix. Every rank must hold the same number of rows.

    Args: those of the parent (model, scale, similarity_fct, gather_across_devices, directions,
    partition_mode, hardness_mode, hardness_strength), plus keyword-only `backend` for angle_kernels.
    """

    def __init__(
        self,
        model: SentenceTransformer,
        scale: float = 20.0,
        similarity_fct: Callable[[Tensor, Tensor], Tensor] = _st_util.cos_sim,
        gather_across_devices: bool = False,
        directions: tuple[_DIRECTIONS, ...] = ("query_to_doc",),
        partition_mode: Literal["joint", "per_direction"] = "joint",
        hardness_mode: _HARDNESS | None = None,
        hardness_strength: float = 0.0,
        *,
        backend: str | None = None,
    ) -> None:
        _check_constructor_numbers(scale=scale, hardness_strength=hardness_strength, hardness_mode=hardness_mode)
        _check_directions(directions)
        optional = _parent_kwargs(_st_losses.MultipleNegativesRankingLoss.__init__, {
            "gather_across_devices": gather_across_devices, "directions": directions,
            "partition_mode": partition_mode, "hardness_mode": hardness_mode,
            "hardness_strength": hardness_strength}, _MNRL_DEFAULTS)
        super().__init__(model, scale=scale, similarity_fct=similarity_fct, **optional)
        self.backend = check_backend(backend)



class CachedMultipleNegativesRankingLoss(_BackendSetting, _FusedCachedMNRL,
                                         _st_losses.CachedMultipleNegativesRankingLoss):
    """sentence-transformers' CachedMultipleNegativesRankingLoss (GradCache) with the loss stage computed by
    angle_kernels: same arguments, same results.

    The embedding side is the parent's: mini-batches of `mini_batch_size` rows are embedded without
    gradients, the loss is computed on the cached embeddings and back-propagated to them, and the
    mini-batches are embedded again with gradients. The parent computes the loss stage in chunks of
    `mini_batch_size` query rows so that the score matrix never exists whole; angle_kernels' tiled loss never
    builds it at all, so here the whole batch is one call (forward and backward), whatever mini_batch_size is:
    show_progress_bar shows the embedding passes' bars, and none for the loss stage (one call).

    Fused under the same condition as `MultipleNegativesRankingLoss` (cosine or dot product; every other option,
    gather_across_devices included, which gathers the cached embeddings as the parent does); otherwise the
    parent's chunked computation runs. `uses_fused_path` says which applies.

    Args: those of the parent (model, scale, similarity_fct, mini_batch_size, mini_batch_num_tokens,
    gather_across_devices, directions, partition_mode, show_progress_bar, hardness_mode, hardness_strength),
    plus keyword-only `backend` for angle_kernels.
    """

    def __init__(
        self,
        model: SentenceTransformer,
        scale: float = 20.0,
        similarity_fct: Callable[[Tensor, Tensor], Tensor] = _st_util.cos_sim,
        mini_batch_size: int = 32,
        mini_batch_num_tokens: int | None = None,
        gather_across_devices: bool = False,
        directions: tuple[_DIRECTIONS, ...] = ("query_to_doc",),
        partition_mode: Literal["joint", "per_direction"] = "joint",
        show_progress_bar: bool = False,
        hardness_mode: _HARDNESS | None = None,
        hardness_strength: float = 0.0,
        *,
        backend: str | None = None,
    ) -> None:
        _check_constructor_numbers(scale=scale, mini_batch_size=mini_batch_size, hardness_strength=hardness_strength,
                                   hardness_mode=hardness_mode)
        _check_directions(directions)
        optional = _parent_kwargs(_st_losses.CachedMultipleNegativesRankingLoss.__init__, {
            "mini_batch_num_tokens": mini_batch_num_tokens, "gather_across_devices": gather_across_devices,
            "directions": directions, "partition_mode": partition_mode, "show_progress_bar": show_progress_bar,
            "hardness_mode": hardness_mode, "hardness_strength": hardness_strength}, _MNRL_DEFAULTS)
        super().__init__(model, scale=scale, similarity_fct=similarity_fct, mini_batch_size=mini_batch_size,
                         **optional)
        self.backend = check_backend(backend)


# --------------------------------------------------------------------------------------------------------
# The symmetric variants, deprecated upstream in favour of directions=("query_to_doc", "doc_to_query") with
# partition_mode="per_direction"; kept as drop-ins for the training scripts that still name them.
# --------------------------------------------------------------------------------------------------------
_SYMMETRIC = {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"}


def _become_symmetric(loss: torch.nn.Module, parent: type) -> None:
    """Warn as the deprecated parent does when instantiated itself, and make sure the fused path sees the
    symmetric directions (older 6.x parents compute them without these attributes)."""
    user_warnings.warn(getattr(parent, "__deprecated__", f"{parent.__name__} is deprecated"), DeprecationWarning)
    for name, value in _SYMMETRIC.items():
        if not hasattr(loss, name):
            setattr(loss, name, value)


with warnings.catch_warnings():  # subclassing a @deprecated class warns at definition: at import for our users
    warnings.simplefilter("ignore", DeprecationWarning)

    class MultipleNegativesSymmetricRankingLoss(_BackendSetting, _FusedMNRL,
                                                _st_losses.MultipleNegativesSymmetricRankingLoss):
        """sentence-transformers' MultipleNegativesSymmetricRankingLoss computed by angle_kernels: the mean of
        InfoNCE from queries to [positives; negatives] and from positives to queries, fused, with or without
        gather_across_devices (as `MultipleNegativesRankingLoss` with the per-direction symmetric directions).

        Args: those of the parent (model, scale, similarity_fct, gather_across_devices), plus keyword-only
        `backend`. Fused with `util.cos_sim` (the default) or `util.dot_score`; another similarity function runs
        the parent's code.
        """

        def __init__(self, model: SentenceTransformer, scale: float = 20.0,
                     similarity_fct: Callable[[Tensor, Tensor], Tensor] = _st_util.cos_sim,
                     gather_across_devices: bool = False, *, backend: str | None = None) -> None:
            _check_constructor_numbers(scale=scale)
            super().__init__(model, scale=scale, similarity_fct=similarity_fct,
                             gather_across_devices=gather_across_devices)
            self.backend = check_backend(backend)
            _become_symmetric(self, _st_losses.MultipleNegativesSymmetricRankingLoss)

    class CachedMultipleNegativesSymmetricRankingLoss(
            _BackendSetting, _FusedCachedMNRL, _st_losses.CachedMultipleNegativesSymmetricRankingLoss):
        """sentence-transformers' CachedMultipleNegativesSymmetricRankingLoss (GradCache) with the loss stage
        fused, on the whole cached batch at once (see `CachedMultipleNegativesRankingLoss`).

        Args: those of the parent (model, scale, similarity_fct, mini_batch_size, mini_batch_num_tokens,
        gather_across_devices, show_progress_bar), plus keyword-only `backend`.
        """

        def __init__(self, model: SentenceTransformer, scale: float = 20.0,
                     similarity_fct: Callable[[Tensor, Tensor], Tensor] = _st_util.cos_sim,
                     mini_batch_size: int = 32, mini_batch_num_tokens: int | None = None,
                     gather_across_devices: bool = False, show_progress_bar: bool = False, *,
                     backend: str | None = None) -> None:
            _check_constructor_numbers(scale=scale, mini_batch_size=mini_batch_size)
            optional = _parent_kwargs(_st_losses.CachedMultipleNegativesSymmetricRankingLoss.__init__, {
                "mini_batch_num_tokens": mini_batch_num_tokens, "gather_across_devices": gather_across_devices,
                "show_progress_bar": show_progress_bar}, _MNRL_DEFAULTS)
            super().__init__(model, scale=scale, similarity_fct=similarity_fct, mini_batch_size=mini_batch_size,
                             **optional)
            self.backend = check_backend(backend)
            _become_symmetric(self, _st_losses.CachedMultipleNegativesSymmetricRankingLoss)


# --------------------------------------------------------------------------------------------------------
# GISTEmbed: a guide model's similarities filter the in-batch negatives
# --------------------------------------------------------------------------------------------------------
def _embed_columns(model: torch.nn.Module, features: list[dict[str, Tensor]]) -> list[Tensor]:
    """One sentence embedding per column, as the parents embed them (sentence-transformers >= 6.2 merges
    like-width columns into one forward pass; older releases run one forward per column)."""
    try:
        from sentence_transformers.base.losses.merged_forward import embed_columns
    except ImportError:  # pragma: no cover - older sentence-transformers
        return [model(f)["sentence_embedding"] for f in features]
    return embed_columns(model, features)


def _drop_in_class(loss: torch.nn.Module) -> type:
    """The class of this module that `loss` is an instance of (its own, or the one a user's subclass extends); a loss
    of no class here, its own class."""
    return next((cls for cls in type(loss).__mro__ if cls.__module__ == __name__), type(loss))


def _overridden_methods(loss: torch.nn.Module, names: Sequence[str]) -> list[str]:
    """Those of the methods `names` that `loss`'s class overrides below its drop-in class (a user's subclass):
    the parents' loops call them, and a fused call that computes from the drop-in's own code would skip them."""
    drop_in = _drop_in_class(loss)
    return [name for name in names
            if hasattr(drop_in, name) and getattr(type(loss), name) is not getattr(drop_in, name)]


# The methods of an inner loss that MatryoshkaLoss's and the layer-wise losses' parents call once per dimension or
# layer (a cached loss's calculate_loss, through MatryoshkaLoss's decorator)
_LOOPED_METHODS = ("forward", "compute_loss_from_embeddings", "calculate_loss")


def _gist_options(loss: torch.nn.Module) -> dict[str, Any]:
    # the parent reads its flags by truth value (`if self.contrast_anchors:`): 0, 1 and numpy's bools work there too
    return dict(temperature=loss.temperature, margin_strategy=loss.margin_strategy, margin=loss.margin,
                contrast_anchors=bool(loss.contrast_anchors), contrast_positives=bool(loss.contrast_positives),
                self_negatives=_PARENT_GIST_SELF_NEGATIVES,
                gather_across_devices=bool(getattr(loss, "gather_across_devices", False)), backend=loss.backend)


def _fused_gist(loss: torch.nn.Module, embeddings: list[Tensor], guide_embeddings: list[Tensor]) -> Tensor:
    if _overridden_methods(loss, ("sim_matrix",)):
        # the parent scores every block with self.sim_matrix: a subclass's scores, which the fused loss never asks for
        raise ValueError(f"{type(loss).__name__} overrides sim_matrix, the parent's scores of every block, which "
                         "the fused GIST loss computes itself (cosines); subclass sentence-transformers' "
                         f"{_drop_in_class(loss).__name__} to score with another similarity")
    similarity = getattr(loss, "similarity_fct", None)
    if not (type(similarity) is torch.nn.CosineSimilarity and similarity.dim in (-1, 1)):
        # the parent's own (nn.CosineSimilarity(dim=-1)), which it sets and never takes as an argument: a module
        # put in its place after construction changed the parent's scores, while the fused loss computed cosines
        raise ValueError(f"{type(loss).__name__} computes cosine similarities, as the parent's similarity_fct "
                         f"(nn.CosineSimilarity(dim=-1)) does; this one's similarity_fct was replaced by "
                         f"{similarity!r}: use sentence-transformers' {type(loss).__name__} for another similarity")
    return _functional.gist_loss(embeddings[0], embeddings[1], guide_embeddings[0], guide_embeddings[1],
                                 embeddings[2:], guide_embeddings[2:], **_gist_options(loss))


class GISTEmbedLoss(_BackendSetting, _st_losses.GISTEmbedLoss):
    """sentence-transformers' GISTEmbedLoss computed by angle_kernels (`gist_loss`): the guide's similarities
    filter the in-batch negatives tile by tile, and no B x B score matrix (of the model or of the guide) is
    built. Same arguments (model, guide, temperature, margin_strategy, margin, contrast_anchors,
    contrast_positives, gather_across_devices), plus keyword-only `backend`; always fused.

    The embedding side is the parent's: the model embeds every column with gradients, the guide without
    (on the model's own tokenisation when the two share a vocabulary and the guide's maximum length is not
    shorter, else on the decoded texts re-tokenised for the guide). Same values and gradients as the parent but
    for the tie allowance and a 16-bit guide's filter (the module docstring).
    """

    _input_columns = _GIST

    def __init__(self, model: SentenceTransformer, guide: SentenceTransformer, temperature: float = 0.01,
                 margin_strategy: Literal["absolute", "relative"] = "absolute", margin: float = 0.0,
                 contrast_anchors: bool = True, contrast_positives: bool = True, gather_across_devices: bool = False,
                 *, backend: str | None = None) -> None:
        _check_constructor_numbers(temperature=temperature, margin=margin)
        optional = _parent_kwargs(_st_losses.GISTEmbedLoss.__init__, {
            "gather_across_devices": gather_across_devices}, _MNRL_DEFAULTS)
        super().__init__(model, guide, temperature=temperature, margin_strategy=margin_strategy, margin=margin,
                         contrast_anchors=contrast_anchors, contrast_positives=contrast_positives, **optional)
        self.backend = check_backend(backend)

    @property
    def uses_fused_path(self) -> bool:
        return True

    def _guide_features(self, sentence_features: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """What the guide embeds: shallow copies of the model's features (the guide writes its outputs into
        them), or, when the tokenisers differ, the decoded texts tokenised by the guide."""
        if not self.must_retokenize:
            return [dict(features) for features in sentence_features]
        out = []
        for features in sentence_features:
            input_ids = features["input_ids"]
            if "cu_seq_lens_q" in features:  # packed sequences: one row holding every text, cut at the offsets
                flat, cuts = input_ids[0].tolist(), features["cu_seq_lens_q"].tolist()
                input_ids = [flat[start:end] for start, end in zip(cuts[:-1], cuts[1:])]
            texts = self.tokenizer.batch_decode(input_ids, skip_special_tokens=True)
            out.append(_st_util.batch_to_device(self.guide.preprocess(texts), self.guide.device))
        return out

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor) -> Tensor:
        sentence_features = list(sentence_features)
        _check_columns(self, len(sentence_features))  # before embedding anything
        guide_features = self._guide_features(sentence_features)  # before the model writes into the features
        embeddings = _embed_columns(self.model, sentence_features)
        with torch.no_grad():
            guide_embeddings = _embed_columns(self.guide, guide_features)
        return _fused_gist(self, embeddings, guide_embeddings)


class CachedGISTEmbedLoss(_BackendSetting, _st_losses.CachedGISTEmbedLoss):
    """sentence-transformers' CachedGISTEmbedLoss (GradCache) with the loss stage computed by angle_kernels
    (`gist_loss`) on the whole cached batch at once; the embedding side (model and guide mini-batches) is the
    parent's. Same arguments, plus keyword-only `backend`; always fused. show_progress_bar shows the embedding
    passes' bars, and none for the loss stage (one call). Same results as the parent but for the tie allowance and a
    16-bit guide's filter (the module docstring)."""

    _input_columns = _ANCHORED

    def __init__(self, model: SentenceTransformer, guide: SentenceTransformer, temperature: float = 0.01,
                 mini_batch_size: int = 32,
                 mini_batch_num_tokens: int | None = None, show_progress_bar: bool = False,
                 margin_strategy: Literal["absolute", "relative"] = "absolute", margin: float = 0.0,
                 contrast_anchors: bool = True, contrast_positives: bool = True, gather_across_devices: bool = False,
                 *, backend: str | None = None) -> None:
        _check_constructor_numbers(temperature=temperature, mini_batch_size=mini_batch_size, margin=margin)
        optional = _parent_kwargs(_st_losses.CachedGISTEmbedLoss.__init__, {
            "mini_batch_num_tokens": mini_batch_num_tokens, "gather_across_devices": gather_across_devices,
            "show_progress_bar": show_progress_bar}, _MNRL_DEFAULTS)
        super().__init__(model, guide, temperature=temperature, mini_batch_size=mini_batch_size,
                         margin_strategy=margin_strategy, margin=margin, contrast_anchors=contrast_anchors,
                         contrast_positives=contrast_positives, **optional)
        self.backend = check_backend(backend)

    @property
    def uses_fused_path(self) -> bool:
        return True

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor) -> Tensor:
        sentence_features = list(sentence_features)
        _check_columns(self, len(sentence_features))  # before embedding any mini-batch
        return super().forward(sentence_features, labels)

    def calculate_loss(self, reps: list[list[Tensor]], reps_guided: list[list[Tensor]], *,
                       with_backward: bool = False) -> Tensor:
        _check_columns(self, len(reps))
        if len(reps) != len(reps_guided):
            raise ValueError("reps and reps_guided must have the same length")
        loss = _fused_gist(self, [torch.cat(column) for column in reps], [torch.cat(column) for column in reps_guided])
        return _grad_cache_step(loss, with_backward)


# --------------------------------------------------------------------------------------------------------
# Matryoshka: every nested dimension from one read of the embeddings
# --------------------------------------------------------------------------------------------------------
def _matryoshka_unfused_reason(inner: torch.nn.Module, dims: Sequence[int],
                                weights: Sequence[float] | Tensor) -> str | None:
    """Why MatryoshkaLoss over `inner` with these dims and weights cannot run as one fused call; None when it can."""
    if not hasattr(inner, "_fused_loss") and not hasattr(inner, "_fused_cached_loss"):
        return f"{type(inner).__name__} is not one of angle_kernels' fused drop-ins with a Matryoshka path"
    overridden = _overridden_methods(inner, _LOOPED_METHODS)
    if overridden:
        return f"{type(inner).__name__} overrides {', '.join(overridden)}, which the parent calls per dimension"
    if not inner.uses_fused_path:
        return f"{type(inner).__name__} itself runs unfused in this configuration"
    if _odd_angle_widths(inner, dims):
        return "the angle similarity pads an odd width with a zero column; the fused angle score needs even dims"
    learned = weights.requires_grad if isinstance(weights, Tensor) else any(
        isinstance(w, Tensor) and w.requires_grad for w in weights)
    if learned:
        return "matryoshka_weights require grad (learned weights): the fused call takes the weights as constants"
    return None


def _odd_angle_widths(inner: torch.nn.Module, dims: Sequence[int]) -> list[int]:
    """The odd entries of `dims` where `inner` scores pairs with the angle similarity (the fused call takes every
    width as real and imaginary halves, so it needs even widths); [] otherwise."""
    if getattr(inner, "similarity_fct", None) is not _st_util.pairwise_angle_sim:
        return []
    return [d for d in dims if d % 2]


def _check_matryoshka_entries(*, dims: Sequence[int], weights: Sequence[float] | Tensor | None,
                              n_dims_per_step: int) -> None:
    """Each entry of matryoshka_dims an int and of matryoshka_weights a finite real number (a learned one too: its
    value), named as the constructor names them, and n_dims_per_step an int. The fused call's own checks named the
    entries dims[i] and dim_weights[i] (the functional losses' arguments) at the first step, after the model had
    embedded the batch; an entry that is not a number failed in float(), a float n_dims_per_step in random.sample.
    The containers (none given, one weight per dimension) and the dimensions' range (> 0, at most the model's width)
    are the parent's checks."""
    _inputs.check_width("n_dims_per_step", n_dims_per_step)
    try:
        dims, weights = list(dims), None if weights is None else list(weights)
    except TypeError:  # not sequences: the parent's checks say so
        return
    for i, dim in enumerate(dims):
        _inputs.check_width(f"matryoshka_dims[{i}]", dim)
    for i, weight in enumerate(weights or ()):
        _inputs.check_scalar(f"matryoshka_weights[{i}]", _current_value(weight))


def _embedding_dtype(model: torch.nn.Module) -> torch.dtype:
    """The dtype of a model's embeddings as far as a loss's compute dtype goes (inputs.check_weight_fits), known
    before the model embeds: its first floating parameter's. A float64 model embeds in float64 (autocast leaves it);
    a 32- or 16-bit one in 32 or 16 bits (autocast included), whose losses are computed in float32 either way."""
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


class MatryoshkaLoss(_st_losses.MatryoshkaLoss):
    """sentence-transformers' MatryoshkaLoss, fused: sum_i w_i * loss(embeddings[..., :d_i]) in one call.

    The parent embeds once but calls the inner loss once per dimension, each call reading the embeddings
    again; here, when `loss` is one of this module's fused drop-ins (CoSENTLoss, AnglELoss, the
    MultipleNegativesRankingLoss family, and their cached versions), the model embeds once and one
    angle_kernels call computes every selected dimension from one read of the embeddings (the ops' nested
    prefixes; see angle_kernels.dispatch). Same arguments, values and gradients as the parent, including the
    sampling of `n_dims_per_step` dimensions (the same `random.sample` call, so the same dimensions under the
    same seed) and the parent's normalisation of each truncated embedding (a dot-product similarity is then a
    cosine). `uses_fused_path` says whether the fused call runs; otherwise (another inner loss, an inner loss
    configured unfused, odd dims with the angle similarity, learned matryoshka_weights) the parent's
    per-dimension loop runs. Odd dims with the angle similarity are valid (each odd prefix is padded with a zero
    feature, as `util.pairwise_angle_sim` pads it; the inner drop-in computes each width fused) but take that
    slower loop, which a UserWarning naming matryoshka_dims says once, when the loss is built.
    MultipleNegativesRankingLoss options that need similarity_lse (joint partitions over several directions,
    hardness) take every dimension in one call of that op too, but where the backend computing it at one width has
    no dims for it (a GPU path not yet verified with dims: one pass per dimension inside angle_kernels there).
    A cached loss held by a wrapper (a module with the loss as `.loss`, no calculate_loss of its own, reporting
    `uses_gradient_cache`) is decorated through the wrapper, as sentence-transformers 6.3 does (earlier releases
    fail there when built, and so does this class on them). matryoshka_dims, matryoshka_weights and
    n_dims_per_step set after construction count from the next call, over a cached loss too (the parent's decorator
    of a cached loss keeps those it was built with, while its loop over a non-cached loss reads them at each call).
    On 16-bit embeddings (a bf16 or fp16 model) the fused call normalises and scores every prefix in float32, where
    the parent rounds each normalised prefix back to 16 bits first (6.3; 6.2 normalises in 16 bits): the two differ
    by that rounding, up to about 1e-3 of the loss and a few percent of the parameter gradients on a 2-layer tiny
    BERT in bf16 (MNRL over widths 32, 16, 8), where this one matches a float32 computation on the same embeddings.
    """

    def __init__(self, model: SentenceTransformer, loss: torch.nn.Module, matryoshka_dims: Sequence[int],
                 matryoshka_weights: Sequence[float] | None = None, n_dims_per_step: int = -1) -> None:
        _check_matryoshka_entries(dims=matryoshka_dims, weights=matryoshka_weights, n_dims_per_step=n_dims_per_step)
        super().__init__(model, loss, matryoshka_dims, matryoshka_weights, n_dims_per_step)
        computing = _gradient_cache_loss(self.loss) if self.uses_gradient_cache else self.loss
        odd = _odd_angle_widths(computing, self.matryoshka_dims)
        if odd and hasattr(computing, "_fused_loss") and computing.uses_fused_path:
            # valid (each width computed as the parent computes it, zero-padded) but slower: said once, when built
            user_warnings.warn(
                f"matryoshka_dims {list(map(int, matryoshka_dims))} include the odd width(s) "
                f"{sorted(set(map(int, odd)))} with the angle similarity: the fused call splits every width into "
                "real and imaginary halves and takes even widths only, so this set runs sentence-transformers' "
                "per-width loop (one fused call per width, each padding an odd width with a zero feature as "
                "util.pairwise_angle_sim does: the same values, slower); even widths run as one fused call",
                UserWarning)
        if self.uses_gradient_cache:
            # the parent decorated the calculate_loss of the loss it resolves (through `.loss` wrappers, 6.3) with
            # its per-dimension loop: keep that as the fallback
            cached_loss = _gradient_cache_loss(loss)
            cached_loss.calculate_loss = _FusedCachedMatryoshka(self, cached_loss=cached_loss,
                                                                parent_decorator=cached_loss.calculate_loss)

    @property
    def uses_fused_path(self) -> bool:
        # a gradient-cache loss computes through the calculate_loss __init__ decorated: the held loss's, if wrapped
        computing = _gradient_cache_loss(self.loss) if self.uses_gradient_cache else self.loss
        return _matryoshka_unfused_reason(computing, self.matryoshka_dims, self.matryoshka_weights) is None

    def _check_weights_fit(self) -> None:
        """Each matryoshka_weights entry within the range of the model's losses' compute dtype, named as the
        constructor names it, at each call before the model embeds (the weights are attributes: one set after
        construction counts). Past float32's largest number (3.4e38) a 16- or 32-bit model's loss was inf, with
        NaN gradients, on the fused path and the parent's alike; a float64 model takes such a weight."""
        dtype = _embedding_dtype(self.model)
        for i, weight in enumerate(self.matryoshka_weights):
            name = f"matryoshka_weights[{i}]"  # a learned weight by its value, as when built
            value = _inputs.check_scalar(name, _current_value(weight))
            _inputs.check_weight_fits(name, value, dtype)

    def _drawn(self, sort: bool) -> dict[int, tuple[float, str]]:
        """The dimensions of this step, each with its weight and the weight's name: all, or n_dims_per_step drawn
        as the parent draws them (its forward sorts the draw, its cached decorator does not; the sum is the same
        either way). A dimension listed more than once (the parent accepts it: one weighted term per entry) is one
        prefix weighted by the sum of its entries' weights (named `matryoshka_weights[0] + matryoshka_weights[2]`)."""
        indices = range(len(self.matryoshka_dims))
        if 0 < self.n_dims_per_step < len(indices):
            indices = random.sample(indices, self.n_dims_per_step)
            if sort:
                indices.sort()
        drawn: dict[int, tuple[float, str]] = {}
        for i in indices:
            weight, name = drawn.get(self.matryoshka_dims[i], (0.0, None))
            entry = f"matryoshka_weights[{i}]"
            drawn[self.matryoshka_dims[i]] = (weight + float(self.matryoshka_weights[i]),
                                              entry if name is None else f"{name} + {entry}")
        return drawn

    def _selected(self, embeddings: Tensor, sort: bool) -> _inputs.Nested:
        """The dimensions drawn for this step (`_drawn`) as the fused call's Nested, each weight (a sum of entries
        included) checked against `embeddings`' compute dtype, named, before any loss compute."""
        drawn = self._drawn(sort)
        for weight, name in drawn.values():
            _inputs.check_weight_fits(name, weight, embeddings.dtype)
        return _inputs.check_nested(list(drawn), [weight for weight, _ in drawn.values()], embeddings.shape[-1])

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor) -> Tensor:
        sentence_features = list(sentence_features)
        _check_labels_given(self, labels, len(sentence_features))
        self._check_weights_fit()
        if self.uses_gradient_cache or not self.uses_fused_path:
            return super().forward(sentence_features, labels)
        embeddings = _embed_columns(self.model, sentence_features)
        return self.loss._fused_loss(embeddings, labels, self._selected(embeddings[0], sort=True))


class _FusedCachedMatryoshka:
    """A cached loss's calculate_loss under MatryoshkaLoss: one fused call for every selected dimension on the
    whole cached batch, or the parent's per-dimension decorator when the configuration runs unfused."""

    def __init__(self, matryoshka: MatryoshkaLoss, *, cached_loss: torch.nn.Module,
                 parent_decorator: Callable[..., Tensor]) -> None:
        self.matryoshka = matryoshka
        self.cached_loss = cached_loss  # whose calculate_loss this is (the inner loss, or the one a wrapper holds)
        self.parent_decorator = parent_decorator

    def __call__(self, reps: list[list[Tensor]], *args: Any, with_backward: bool = False, **kwargs: Any) -> Tensor:
        if not self.matryoshka.uses_fused_path:
            # the settings in force, as the fused call reads them (the parent's decorator keeps those it was built
            # with, while the parent's non-cached loop reads them at each call)
            for name in ("matryoshka_dims", "matryoshka_weights", "n_dims_per_step"):
                setattr(self.parent_decorator, name, getattr(self.matryoshka, name))
            return self.parent_decorator(reps, *args, with_backward=with_backward, **kwargs)
        nested = self.matryoshka._selected(reps[0][0], sort=False)
        return self.cached_loss._fused_cached_loss(reps, with_backward, nested)


# --------------------------------------------------------------------------------------------------------
# Layer-wise: AdaptiveLayerLoss and Matryoshka2dLoss, every sampled layer (and dimension) in one fused call
# --------------------------------------------------------------------------------------------------------
def _layerwise_unfused_reason(inner: torch.nn.Module) -> str | None:
    """Why a layer-wise loss over `inner` (the inner loss, or our MatryoshkaLoss over it) cannot run as one
    fused call over the stacked layers; None when it can."""
    if isinstance(inner, MatryoshkaLoss):
        if inner.uses_gradient_cache:
            return "the parent does not support gradient-cache losses under layer-wise training"
        reason = _matryoshka_unfused_reason(inner.loss, inner.matryoshka_dims, inner.matryoshka_weights)
        if reason is not None:
            return reason
        inner = inner.loss
    elif isinstance(inner, _st_losses.MatryoshkaLoss):
        return "the inner MatryoshkaLoss is sentence-transformers' own, not angle_kernels'"
    if not hasattr(inner, "_fused_loss"):
        return f"{type(inner).__name__} is not one of angle_kernels' fused non-cached drop-ins"
    overridden = _overridden_methods(inner, _LOOPED_METHODS)
    if overridden:
        return f"{type(inner).__name__} overrides {', '.join(overridden)}, which the parent calls per layer"
    if not inner.uses_fused_path:
        return f"{type(inner).__name__} itself runs unfused in this configuration"
    if getattr(inner, "gather_across_devices", False):
        return "stacked layers do not combine with gather_across_devices yet"
    return None


class _LayerRecorder(torch.nn.Module):
    """Stands in for the inner loss while the parent's forward runs: the parent installs its decorators (the
    transformer's hidden-state cache, the recording of sentence embeddings for the KL term), draws the layers,
    computes the KL terms and calls the inner loss once per layer; each call here embeds the columns at the
    layer in force (and, for a Matryoshka inner loss, draws its dimensions in the parent's order) and returns
    0. `fused_loss` then computes every recorded layer's weighted loss in one call on the stacked embeddings."""

    def __init__(self, layerwise: torch.nn.Module, inner: torch.nn.Module) -> None:
        super().__init__()
        self.layerwise = [layerwise]  # a list: not registered as a submodule (it owns this recorder)
        self.inner = inner
        self.layers: list[int | None] = []  # None: the final layer
        self.columns: list[list[Tensor]] = []
        self.draws: list[dict[int, tuple[float, str]]] = []  # a Matryoshka inner loss's dims of each layer

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor) -> Tensor:
        layerwise = self.layerwise[0]
        decorator = next(m.forward for m in layerwise.model.modules()
                         if isinstance(m.__dict__.get("forward"), _TransformerDecorator))
        embeddings = _embed_columns(layerwise.model, list(sentence_features))
        self.layers.append(decorator.layer_idx)
        self.columns.append(embeddings)
        if isinstance(self.inner, MatryoshkaLoss):
            self.draws.append(self.inner._drawn(sort=True))
        return embeddings[0].new_zeros(())

    def fused_loss(self, labels: Tensor) -> Tensor:
        """sum over the recorded layers l (and drawn dims i) of weight_l * w_i * loss(layer l[..., :d_i]) as the
        parent weighs them: the final layer by last_layer_weight, a sampled layer by its layer weighting divided
        by the number sampled times prior_layers_weight. Where every weight is 0: 0, with zero gradients for every
        recorded layer, as the parent's 0 * loss gives them (not None: an optimizer skips a parameter whose
        gradient is None, and moves one whose gradient is 0 by its momentum)."""
        layerwise = self.layerwise[0]
        sampled = len(self.layers) - 1
        # named here (an attribute set after construction, a layer_weighting callable's values), not as the
        # layer_weights of the fused call
        last, prior = (_inputs.check_scalar(name, getattr(layerwise, name))
                       for name in ("last_layer_weight", "prior_layers_weight"))
        weighting = {layer: _inputs.check_scalar(f"layer_weighting({layer})", layerwise.get_layer_weight(layer))
                     for layer in self.layers if layer is not None}
        # each term's weight fits the compute dtype, named by the arguments it is made of (the fused call would
        # name it layer_weights[l][i], an argument these classes do not take); a layer's weighting on its own too:
        # the parent's loop multiplies this recorder's 0 by it first (0 x inf: NaN)
        dtype = self.columns[0][0].dtype
        for layer, weight in weighting.items():
            _inputs.check_weight_fits(f"layer_weighting({layer})", weight, dtype)
        weights = [last if layer is None else weighting[layer] / sampled * prior for layer in self.layers]
        names = ["last_layer_weight" if layer is None else
                 f"layer_weighting({layer}) / {sampled} x prior_layers_weight" for layer in self.layers]
        inner, dims, rows, row_names = self.inner, None, weights, names
        if isinstance(inner, MatryoshkaLoss):  # a row per layer: its weight times its drawn dims' weights, else 0
            inner, dims = inner.loss, sorted({d for draw in self.draws for d in draw})
            rows = [[weight * draw.get(d, (0.0, ""))[0] for d in dims] for weight, draw in zip(weights, self.draws)]
            row_names = [[f"{name} x {draw[d][1]}" if d in draw else name for d in dims]
                         for name, draw in zip(names, self.draws)]
        term_weights = rows if dims is None else sum(rows, [])
        for weight, name in zip(term_weights, row_names if dims is None else sum(row_names, [])):
            _inputs.check_weight_fits(name, weight, dtype)
        if not any(w != 0 for w in term_weights):
            return sum(column.sum() for layer in self.columns for column in layer) * 0.0
        width = self.columns[0][0].shape[-1]
        nested = _inputs.check_nested(dims, None, width, layer_weights=rows, layers=len(rows))
        stacks = [torch.stack(layer_columns) for layer_columns in zip(*self.columns)]  # per column: [L, rows, D]
        return inner._fused_loss(stacks, labels, nested)


class _FusedLayerwise:
    """The fused forward of AdaptiveLayerLoss and Matryoshka2dLoss, mixed in before the sentence-transformers
    parent: the parent's own forward runs with a _LayerRecorder in place of the inner loss (so the layers it
    samples, its KL terms and its model decorators are the parent's code), then one fused call computes the
    recorded layers' losses."""

    @property
    def uses_fused_path(self) -> bool:
        # a learned last_layer_weight or prior_layers_weight multiplies the inner loss's value, which the parent's
        # loop trains and the fused call (its weights numbers) would not; learned KL weights are trained either way
        # (the KL terms are the parent's code on both paths)
        if _learned(self.last_layer_weight) or _learned(self.prior_layers_weight):
            return False
        return _layerwise_unfused_reason(self.loss) is None

    def _check_weights_fit(self) -> None:
        """The weights the parent's loop and the fused call multiply terms by, each within the range of the model's
        losses' compute dtype (inputs.check_weight_fits), named, at each call before any layer is embedded:
        last_layer_weight, prior_layers_weight, an inner MatryoshkaLoss's matryoshka_weights and, where the KL terms
        are computed (kl_temperature > 0), kl_div_weight and kl_temperature (it divides the embeddings and multiplies
        the KL term: past the range it is inf there, and the term 0 x inf, NaN). Past float32's largest number a 16-
        or 32-bit model's loss was inf or NaN; a sampled layer's weight, and its product with a dimension's, is
        checked once drawn (_LayerRecorder.fused_loss)."""
        dtype = _embedding_dtype(self.model)
        weights = {"last_layer_weight": self.last_layer_weight, "prior_layers_weight": self.prior_layers_weight}
        if _inputs.check_scalar("kl_temperature", _current_value(self.kl_temperature)) > 0:
            weights.update(kl_div_weight=self.kl_div_weight, kl_temperature=self.kl_temperature)
        for name, weight in weights.items():
            _inputs.check_weight_fits(name, _inputs.check_scalar(name, _current_value(weight)), dtype)
        if isinstance(self.loss, MatryoshkaLoss):
            self.loss._check_weights_fit()

    def forward(self, sentence_features: Iterable[dict[str, Tensor]], labels: Tensor) -> Tensor:
        sentence_features = list(sentence_features)
        _check_labels_given(self, labels, len(sentence_features))  # before any layer is embedded
        self._check_weights_fit()
        if not self.uses_fused_path:
            return super().forward(sentence_features, labels)
        inner = self.loss
        recorder = self.loss = _LayerRecorder(self, inner)
        try:
            kl_terms = super().forward(sentence_features, labels)  # the parent's value with every inner loss 0
        finally:
            self.loss = inner
        return kl_terms + recorder.fused_loss(labels)


def _check_layerwise_numbers(*, n_layers_per_step: int, **numbers: Any) -> None:
    """AdaptiveLayerLoss's and Matryoshka2dLoss's weights and KL temperature, checked when built (as
    _check_constructor_numbers): finite real numbers, named. The parents take anything: NaN or inf gave a NaN or inf
    loss (a NaN kl_temperature turned the KL terms off), True weighed 1; the fused call refused a bad weight at the
    first step, after every layer was embedded, as layer_weights[i], an argument these classes do not take. And
    n_layers_per_step an int (a float failed in random.sample, after the final layer's forward)."""
    _inputs.check_width("n_layers_per_step", n_layers_per_step)
    for name, value in numbers.items():
        _inputs.check_scalar(name, _current_value(value))  # a learned one by its current value


class AdaptiveLayerLoss(_FusedLayerwise, _st_losses.AdaptiveLayerLoss):
    """sentence-transformers' AdaptiveLayerLoss, fused: the final layer's and every sampled earlier layer's loss
    in one angle_kernels call on the layers' embeddings stacked [L, rows, D] (functional's layer_weights).

    Same arguments, values and gradients as the parent: the same layers (its own `random.sample` call, so the
    same draw under the same seed), weights (last_layer_weight, layer_weighting / n_sampled * prior_layers_weight)
    and KL-divergence terms (computed by the parent's code, eagerly). Fused when `loss` is one of this module's
    non-cached drop-ins running fused (CoSENTLoss, AnglELoss, MultipleNegativesRankingLoss and its symmetric
    variant, without gather_across_devices), or this module's MatryoshkaLoss over one (each layer then draws
    its dimensions as the parent's MatryoshkaLoss would); `uses_fused_path` says so. Otherwise the parent's
    per-layer loop runs (sentence-transformers does not support gradient-cache losses here).
    last_layer_weight, prior_layers_weight, kl_div_weight and kl_temperature must be finite real numbers (checked
    when built; the parent computes NaN or inf from them), or learned ones (nn.Parameter: a learned
    last_layer_weight or prior_layers_weight runs the parent's loop, which trains it); a layer_weighting callable's
    values are checked (named) on the fused path.
    """

    def __init__(self, model: SentenceTransformer, loss: torch.nn.Module, n_layers_per_step: int = 1,
                 last_layer_weight: float = 1.0, prior_layers_weight: float = 1.0, kl_div_weight: float = 1.0,
                 kl_temperature: float = 0.3,
                 layer_weighting: Literal["uniform", "log", "linear"] | Callable[[int], float] = "uniform") -> None:
        _check_layerwise_numbers(n_layers_per_step=n_layers_per_step, last_layer_weight=last_layer_weight,
                                 prior_layers_weight=prior_layers_weight, kl_div_weight=kl_div_weight,
                                 kl_temperature=kl_temperature)
        super().__init__(model, loss, n_layers_per_step=n_layers_per_step, last_layer_weight=last_layer_weight,
                         prior_layers_weight=prior_layers_weight, kl_div_weight=kl_div_weight,
                         kl_temperature=kl_temperature, layer_weighting=layer_weighting)


class Matryoshka2dLoss(_FusedLayerwise, _st_losses.Matryoshka2dLoss):
    """sentence-transformers' Matryoshka2dLoss (2D Matryoshka: layers x dimensions), fused: every sampled
    (layer, dimension) term of a step in one angle_kernels call on the stacked layers with nested prefixes; the
    (layer, dimension) pairs a step did not draw get weight 0 and are not computed.

    Same arguments, values and gradients as the parent (see `AdaptiveLayerLoss` and `MatryoshkaLoss`: the same
    draws of layers and of dimensions per layer under the same seed, the parent's KL terms). The inner
    Matryoshka loss is this module's `MatryoshkaLoss`, so `loss` should be one of this module's drop-ins for
    the fused path; `uses_fused_path` says whether it runs.
    """

    def __init__(self, model: SentenceTransformer, loss: torch.nn.Module, matryoshka_dims: Sequence[int],
                 matryoshka_weights: Sequence[float] | None = None, n_layers_per_step: int = 1,
                 n_dims_per_step: int = 1, last_layer_weight: float = 1.0, prior_layers_weight: float = 1.0,
                 kl_div_weight: float = 1.0, kl_temperature: float = 0.3,
                 layer_weighting: Literal["uniform", "log", "linear"] | Callable[[int], float] = "uniform") -> None:
        _check_layerwise_numbers(n_layers_per_step=n_layers_per_step, last_layer_weight=last_layer_weight,
                                 prior_layers_weight=prior_layers_weight, kl_div_weight=kl_div_weight,
                                 kl_temperature=kl_temperature)
        # the parent's __init__ wraps `loss` in sentence-transformers' MatryoshkaLoss; ours instead, then the
        # grandparent's __init__ exactly as the parent calls it
        matryoshka = MatryoshkaLoss(model, loss, matryoshka_dims, matryoshka_weights=matryoshka_weights,
                                    n_dims_per_step=n_dims_per_step)
        _st_losses.AdaptiveLayerLoss.__init__(
            self, model, matryoshka, n_layers_per_step=n_layers_per_step, last_layer_weight=last_layer_weight,
            prior_layers_weight=prior_layers_weight, kl_div_weight=kl_div_weight, kl_temperature=kl_temperature,
            layer_weighting=layer_weighting)
