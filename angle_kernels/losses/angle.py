"""The AnglE losses (angle-emb 0.6.1's `angle_emb.loss`), from the public functions to the op calls.

    cosine_loss, angle_loss          CoSENT ranking of the cosine / angle scores (paper Eq. 1 and 7): one pair-score
                                     pass, then the ranking term (`ranking_terms`)
    in_batch_negative_loss           AnglE's in-batch negatives over the zigzag rows (Eq. 2): one similarity_xent
                                     call (`in_batch_negatives`; GTE's partition and the false-negative filter
                                     through the similarity_lse blocks of angle_kernels.losses.retrieval)
    contrastive_with_negative_loss   queries against [positives; negatives] (retrieval's `contrastive`)
    AngleLoss's objective            formats A, B and C (`angle_objective_a`, `_b`, `_c`: the terms above, weighted
                                     and summed as angle-emb 0.6.1's AngleLoss does; the module checks, then calls)

Each public function checks its arguments (`angle_kernels.inputs`), resolves the backend and calls its formula,
written once here; `AngleLoss` (angle_kernels.modules) and the integrations check their inputs once and call the
formulas directly. The conventions every loss shares (zigzag layout, dtypes, Matryoshka and layer-wise keywords):
angle_kernels.losses.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..contract import compute_dtype, loss_entry
from ..dispatch import Ops, resolve_backend
from ..inputs import (
    IBN_PARTITIONS,
    POOLING_STRATEGIES,
    Dims,
    DimWeights,
    LayerWeights,
    Nested,
    check_angle_dim,
    check_binary_labels,
    check_choice,
    check_embedding_group,
    check_group_ids,
    check_layer_stack,
    check_nested,
    check_scaled_weights_fit,
    check_scalar,
    check_scale,
    check_zigzag,
    combined,
    nested_dims,
    promote_embeddings,
)
from .retrieval import contrastive, multiple_negatives, multiple_negatives_rows

__all__ = ["cosine_loss", "angle_loss", "in_batch_negative_loss", "contrastive_with_negative_loss"]


@loss_entry
def cosine_loss(y_true: torch.Tensor, y_pred: torch.Tensor, tau: float = 20.0, *, dims: Dims | None = None,
                dim_weights: DimWeights | None = None, layer_weights: LayerWeights | None = None,
                backend: str | None = None) -> torch.Tensor:
    """CoSENT: rank pairs by cosine similarity (AnglE paper, Eq. 1).

    loss = log(1 + sum over pairs (i, j) with label_i < label_j of exp(tau * (cos_i - cos_j)))

    Args:
        y_true: [2N] or [2N, 1] labels in zigzag order (any real values; only their order matters; ties add
            nothing).
        y_pred: [2N, D] embeddings, pair k on rows 2k and 2k+1.
        tau: scale of the cosine (20 in the paper).
        dims, dim_weights, layer_weights: Matryoshka and layer-wise training (see angle_kernels.losses).
        backend: "auto" (default), "torch", "triton" or "cuda".

    O(N log N) time and O(N) extra memory (the reference builds N x N matrices). A batch with nothing to rank (one
    pair, or every label equal) gives 0 with zero gradients, as angle-emb's cosine_loss does, without a warning.
    """
    tau = check_scale("tau", tau)
    layers, (first,) = check_layer_stack(layer_weights, ("y_pred", y_pred))
    labels = check_zigzag(y_true, first)
    nested = check_nested(dims, dim_weights, first.shape[1], layer_weights=layer_weights, layers=layers,
                          embeddings=first)
    check_scaled_weights_fit(first, ("tau", tau), nested=nested)
    ops = resolve_backend(backend, y_pred)
    return ranking_terms(ops, as_pairs(y_pred), labels[0::2], cosine_tau=tau, nested=nested)[0]


@loss_entry
def angle_loss(
    y_true: torch.Tensor,
    y_pred: torch.Tensor,
    tau: float = 1.0,
    pooling_strategy: str = "sum",
    *,
    dims: Dims | None = None,
    dim_weights: DimWeights | None = None,
    layer_weights: LayerWeights | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """AnglE's angle objective (paper Eq. 7): rank pairs by the normalised complex division of their embeddings.

    Each embedding is split into a real (first half) and an imaginary (second half) part. The pair score is
    tau * |pool(z_u / z_v)| with the division normalised by |u| / |v| exactly as angle-emb computes it; 'sum'
    pooling equals tau * |cos(u, v) + (b.c - a.d) / (|u| |v|)| for u = (a, b), v = (c, d), and 'mean' divides
    that by D. The scores are ranked with the CoSENT term, as in cosine_loss (one pair, or every label equal:
    0 with zero gradients, as angle-emb's angle_loss gives).

    Args:
        y_true: [2N] or [2N, 1] labels in zigzag order.
        y_pred: [2N, D] embeddings with an even D.
        tau: scale of the score (the function's default is the reference's 1.0; AngleLoss uses 20).
        pooling_strategy: 'sum' or 'mean' ('mean' divides by each prefix's own width).
        dims, dim_weights, layer_weights: Matryoshka and layer-wise training (see angle_kernels.losses); every
            width even.
        backend: "auto" (default), "torch", "triton" or "cuda".
    """
    tau = check_scale("tau", tau)
    check_choice("pooling_strategy", pooling_strategy, POOLING_STRATEGIES)
    layers, (first,) = check_layer_stack(layer_weights, ("y_pred", y_pred))
    labels = check_zigzag(y_true, first)
    check_angle_dim(first.shape[1])
    nested = check_nested(dims, dim_weights, first.shape[1], even=True, layer_weights=layer_weights, layers=layers,
                          embeddings=first)
    check_scaled_weights_fit(first, ("tau", tau), nested=nested)
    ops = resolve_backend(backend, y_pred)
    return ranking_terms(ops, as_pairs(y_pred), labels[0::2], angle_tau=tau,
                               pooling_strategy=pooling_strategy, nested=nested)[1]


@loss_entry
def in_batch_negative_loss(
    y_true: torch.Tensor,
    y_pred: torch.Tensor,
    tau: float = 20.0,
    negative_weights: float = 0.0,
    *,
    group_ids: torch.Tensor | None = None,
    dims: Dims | None = None,
    dim_weights: DimWeights | None = None,
    layer_weights: LayerWeights | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """In-batch negatives (AnglE paper, Eq. 2) over all 2N rows, computed in blocks (no 2N x 2N matrix).

    Every row i of a positive pair (label 1) is classified against all other rows (itself excluded) with
    logits tau * cos(x_i, x_j); its target is its partner row. Rows of pairs labelled 0 have no target: they
    add 0 but still count in the mean over 2N rows, and serve as negatives for the others.

    Args:
        y_true: [2N] or [2N, 1] labels, each 0 or 1 (anything else raises ValueError; the reference truncates
            float labels and builds wrong targets for integers above 1).
        y_pred: [2N, D] embeddings in zigzag order.
        tau: logit scale.
        negative_weights: accepted for compatibility. In the reference it only adds to logits of rows that
            have no target, so it never changes the loss or its gradient; the same holds here.
        group_ids: optional [2N] integer ids of the texts (equal ids = identical texts). Identical texts are
            then positives rather than negatives (the paper's identical-sentence-pair detection): row i's
            positives are its partner and every other row whose id equals row i's or its partner's, and the
            row's loss is logsumexp(all logits) - logsumexp(positive logits).
        dims, dim_weights, layer_weights: Matryoshka and layer-wise training (see angle_kernels.losses).
        backend: "auto" (default), "torch", "triton" or "cuda".
    """
    tau = check_scale("tau", tau)
    check_scalar("negative_weights", negative_weights)
    layers, (first,) = check_layer_stack(layer_weights, ("y_pred", y_pred))
    labels = check_zigzag(y_true, first)
    check_binary_labels("y_true", labels, "in_batch_negative_loss")
    group_ids = check_group_ids(group_ids, first.shape[0], first)
    nested = check_nested(dims, dim_weights, first.shape[1], layer_weights=layer_weights, layers=layers,
                          embeddings=first)
    check_scaled_weights_fit(first, ("tau", tau), nested=nested)
    return in_batch_negatives(resolve_backend(backend, y_pred), labels, y_pred, tau, group_ids, nested=nested)


@loss_entry
def contrastive_with_negative_loss(
    text: torch.Tensor,
    pos: torch.Tensor,
    neg: torch.Tensor | None = None,
    tau: float = 20.0,
    *,
    dims: Dims | None = None,
    dim_weights: DimWeights | None = None,
    layer_weights: LayerWeights | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """Contrastive loss of queries against their positives, with optional hard negatives (one direction).

    Query i is classified among the candidates [pos; neg] (logits tau * cos) with target pos[i]; the loss is
    the mean cross-entropy over the B queries.

    Args:
        text: [B, D] query embeddings.
        pos: [B', D] positive embeddings, B' >= B: pos[i] belongs to text[i], rows past B are more candidates (as
            angle-emb's code takes them).
        neg: optional [B'', D] extra negative candidates (usually one hard negative per query).
        tau: logit scale.
        dims, dim_weights, layer_weights: Matryoshka and layer-wise training (see angle_kernels.losses).
        backend: "auto" (default), "torch", "triton" or "cuda".
    """
    tau = check_scale("tau", tau)
    text, pos, neg = promote_embeddings(text, pos, neg)
    named = [("text", text), ("pos", pos), *((("neg", neg),) if neg is not None else ())]
    layers, first = check_layer_stack(layer_weights, *named)
    check_embedding_group(*((name, t) for (name, _), t in zip(named, first)))
    if first[1].shape[0] < first[0].shape[0]:  # the widths are check_embedding_group's
        raise ValueError(f"pos must have at least text's {first[0].shape[0]} rows (pos[i] is text[i]'s positive), got "
                         f"shape {tuple(first[1].shape)}")
    nested = check_nested(dims, dim_weights, text.shape[-1], layer_weights=layer_weights, layers=layers,
                          embeddings=text)
    check_scaled_weights_fit(text, ("tau", tau), nested=nested)
    candidates = pos if neg is None else torch.cat((pos, neg.to(pos.dtype)), dim=-2)
    return contrastive(resolve_backend(backend, text), text, candidates, tau, nested)


# The formulas


def as_pairs(y_pred: torch.Tensor) -> torch.Tensor:
    """The zigzag rows [2N, D] as pairs [N, 2, D] (a stack [L, 2N, D] as [L, N, 2, D]; a view when y_pred is
    contiguous)."""
    *layers, rows, dim = y_pred.shape
    return y_pred.reshape(*layers, rows // 2, 2, dim)


def ranking_terms(
    ops: Ops,
    groups: torch.Tensor,
    labels: torch.Tensor,
    *,
    cosine_tau: float | None = None,
    angle_tau: float | None = None,
    pooling_strategy: str = "sum",
    nested: Nested | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The CoSENT ranking term of the cosine scores and of the angle scores, from one pair-score pass.

    groups: [G, K, D]; pair (g, k) is (groups[g, 0], groups[g, k]) and labels ([(K-1) * G]) are ordered
    pair-major: all pairs k = 1 first, then k = 2, ... (zigzag batches: K = 2, one label per pair). A term is
    computed when its tau is given, else returned as None. The angle score is tau * |pool(angle)|, with
    'mean' pooling dividing the sum-pooled score by D (the reference's complex division, see dispatch).
    nested: each term on every prefix (and every layer of stacked groups [L, G, K, D]), weighted and summed; one
    pair-score pass for all of them.
    """
    with_angle = angle_tau is not None
    if nested is None:
        cos, angle = ops.pair_scores(groups, with_angle)
        return _ranking_terms_of(ops, cos, angle, labels, cosine_tau, angle_tau, pooling_strategy, groups.shape[2])
    cos, angle = pair_score_table(ops, groups, with_angle, nested)
    widths = (groups.shape[-1],) if nested.dims is None else nested.dims
    # (layer, prefix) -> its (cosine term, angle term), for the terms with a non-zero weight
    per_term = {(layer, i): _ranking_terms_of(ops, cos[layer, i], angle[layer, i], labels, cosine_tau, angle_tau,
                                              pooling_strategy, widths[i]) for layer, i, _ in nested.terms()}
    return tuple(None if tau is None else nested.weighted_sum(lambda layer, i, which=which: per_term[layer, i][which])
                 for which, tau in enumerate((cosine_tau, angle_tau)))


def pair_score_table(ops: Ops, groups: torch.Tensor, with_angle: bool,
                      nested: Nested) -> tuple[torch.Tensor, ...]:
    """pair_scores of groups [G, K, D] (stacked: [L, G, K, D]) on every prefix of `nested`, as (cos, angle) of
    shape [L, k, G, K-1] (L = 1 unstacked, k = 1 without dims): one op call for every layer and prefix, the
    layers' groups being more groups."""
    flat = groups.reshape(-1, *groups.shape[-2:])
    cos, angle = ops.pair_scores(flat, with_angle, nested.dims)
    shape = (1 if nested.dims is None else len(nested.dims), groups.shape[0] if nested.stacked else 1,
             *groups.shape[-3:-1])
    return tuple(t.reshape(shape[0], shape[1], shape[2], shape[3] - 1).transpose(0, 1) for t in (cos, angle))


def _ranking_terms_of(ops: Ops, cos: torch.Tensor, angle: torch.Tensor, labels: torch.Tensor,
                      cosine_tau: float | None, angle_tau: float | None, pooling_strategy: str,
                      width: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The CoSENT terms of one set of pair scores [G, K-1] of embeddings `width` wide (see ranking_terms)."""
    cosine_term = angle_term = None
    if cosine_tau is not None:
        cosine_term = ops.ranking_loss(cosine_tau * cos.T.reshape(-1), labels)
    if angle_tau is not None:
        pooled = angle.T.reshape(-1)
        if pooling_strategy == "mean":
            pooled = pooled / width
        angle_term = ops.ranking_loss(angle_tau * pooled.abs(), labels)
    return cosine_term, angle_term


def positive_pairs(labels: torch.Tensor) -> torch.Tensor:
    """[N] bool: the zigzag pairs the in-batch-negative term gives a target, those with both rows labelled 1 (the
    reference's rule); the others serve only as negatives."""
    positive = (labels == 1).view(-1, 2)
    return positive[:, 0] & positive[:, 1]


def in_batch_negatives(
    ops: Ops, labels: torch.Tensor, y_pred: torch.Tensor, tau: float, group_ids: torch.Tensor | None = None,
    partition: str = "angle", false_negative_margin: float | None = None, false_negative_strategy: str = "absolute",
    nested: Nested | None = None,
) -> torch.Tensor:
    """in_batch_negative_loss on checked inputs (labels: 0/1, one per row; group_ids: int64 or None), and the
    options of AngleLoss's format A (which never passes group_ids; they do not combine with it).

    partition "angle" (the reference's): row i of a positive pair against every other row, target its partner,
    i.e. the query q_k against every document and every other query, the document d_k against every query and
    every other document; the sum over the rows of positive pairs divided by 2N, the number of rows.
    partition "gte": GTE's improved contrastive loss, one softmax per positive pair over the union of its two
    rows' columns (q_k -> every d and every other q, d_k -> every q and every other d; the positive pair counts
    twice); the sum over the positive pairs divided by N, the number of pairs.
    false_negative_margin: in every row of pair k, a column whose cosine with the row exceeds
    margin_threshold(cos(q_k, d_k), false_negative_strategy, false_negative_margin) leaves the partition
    function; the pair's own positive stays.
    """
    if nested is not None and nested.stacked:
        return nested.over_layers(lambda layer, sub: in_batch_negatives(
            ops, labels, y_pred[layer], tau, group_ids=group_ids, partition=partition,
            false_negative_margin=false_negative_margin, false_negative_strategy=false_negative_strategy, nested=sub))
    pairs = positive_pairs(labels).to(compute_dtype(y_pred.dtype))
    if partition == "angle" and false_negative_margin is None:
        loss = ops.similarity_xent(y_pred, None, tau, "partner", row_weights=pairs.repeat_interleave(2),
                                   exclude_diagonal=True, group_ids=group_ids, dims=nested_dims(nested))
        return combined(loss, nested)
    if group_ids is not None:
        raise ValueError("group_ids works only with partition='angle' and no false-negative filter")
    options = dict(scale=tau, false_negative_margin=false_negative_margin,
                   false_negative_strategy=false_negative_strategy)
    # GTE's term is one per pair (divided by N); AnglE's two rows of each pair (divided by 2N). A row against every
    # other row is one query's "query_to_doc" and "query_to_query" blocks, with the pair's document as the query
    # for row 2k + 1.
    one_row = ("query_to_doc", "query_to_query")

    def pair_losses(queries, documents, dims=None):  # [N], or [k, N] for the prefixes `dims`
        if partition == "gte":
            return multiple_negatives_rows(ops, queries, documents, [], directions=IBN_PARTITIONS["gte"],
                                           dims=dims, **options)
        return (multiple_negatives_rows(ops, queries, documents, [], directions=one_row, dims=dims, **options)
                + multiple_negatives_rows(ops, documents, queries, [], directions=one_row, dims=dims, **options))

    rows = y_pred.shape[0] // 2 if partition == "gte" else y_pred.shape[0]
    queries, documents = y_pred[0::2], y_pred[1::2]
    if nested is None:
        return (pairs * pair_losses(queries, documents)).sum() / rows
    if ops.takes_in_one_call("similarity_lse", queries, documents, tau, dims=nested.dims):
        return nested.combine((pairs * pair_losses(queries, documents, nested.dims)).sum(dim=-1) / rows)
    # one pass per prefix where the backend computing similarity_lse without dims lacks them (as MNRL does)
    return nested.combine(torch.stack([(pairs * pair_losses(queries[:, :d], documents[:, :d])).sum() / rows
                                       for d in nested.dims]))


# AngleLoss (angle_kernels.modules): the AnglE objective, paper Eq. 8, assembled as angle-emb 0.6.1's AngleLoss
class AngleSettings(NamedTuple):
    """AngleLoss's checked settings: the terms' weights and scales, the angle's pooling and the in-batch options (a
    term is computed only when its weight is > 0)."""

    cosine_w: float
    ibn_w: float
    cln_w: float
    angle_w: float
    cosine_tau: float
    ibn_tau: float
    angle_tau: float
    angle_pooling_strategy: str
    ibn_partition: str
    false_negative_margin: float | None
    false_negative_strategy: str


def angle_objective_a(ops: Ops, settings: AngleSettings, row_labels: torch.Tensor, outputs: torch.Tensor,
                      nested: Nested | None) -> torch.Tensor:
    """Format A (text1, text2, label; zigzag rows, labels one per row, 0/1 when ibn_w > 0): cosine_w * cosine +
    ibn_w * in-batch negatives + angle_w * angle, summed in the reference's order."""
    cosine_term, angle_term = _weighted_ranking_terms(ops, settings, as_pairs(outputs), row_labels[0::2], nested)
    ibn_term = None
    if settings.ibn_w > 0:
        ibn_term = settings.ibn_w * in_batch_negatives(
            ops, row_labels, outputs, settings.ibn_tau, partition=settings.ibn_partition,
            false_negative_margin=settings.false_negative_margin,
            false_negative_strategy=settings.false_negative_strategy, nested=nested)
    return _sum_terms([cosine_term, ibn_term, angle_term], outputs)


def angle_objective_b(ops: Ops, settings: AngleSettings, outputs: torch.Tensor, nested: Nested | None) -> torch.Tensor:
    """Format B (query, positive; zigzag rows): the contrastive term of the queries against the positives (the
    weights and labels ignored, as in the reference)."""
    return _angle_contrastive(ops, settings, outputs[..., 0::2, :], outputs[..., 1::2, :], [], nested)


def angle_objective_c(ops: Ops, settings: AngleSettings, outputs: torch.Tensor, nested: Nested | None) -> torch.Tensor:
    """Format C (query, positive, negative rows): (ibn_w * contrastive(q, pos) + cln_w * contrastive(q, pos, neg))
    / 2 + angle_w * angle + cosine_w * cosine, the ranking terms putting the (q, pos) pairs (label 1) above the
    (q, neg) pairs (label 0); the reference's order of summation."""
    rows, dim = outputs.shape[-2:]
    groups = rows // 3
    x = outputs.reshape(*outputs.shape[:-2], groups, 3, dim)
    query, positive, negative = x[..., 0, :], x[..., 1, :], x[..., 2, :]
    contrastive_term = None
    if settings.ibn_w > 0 or settings.cln_w > 0:
        contrastive_term = 0.0
        if settings.ibn_w > 0:
            contrastive_term = settings.ibn_w * _angle_contrastive(ops, settings, query, positive, [], nested)
        if settings.cln_w > 0:
            contrastive_term = contrastive_term + settings.cln_w * _angle_contrastive(ops, settings, query, positive,
                                                                                      [negative], nested)
        contrastive_term = contrastive_term / 2
    pair_labels = torch.cat((torch.ones(groups, device=outputs.device), torch.zeros(groups, device=outputs.device)))
    cosine_term, angle_term = _weighted_ranking_terms(ops, settings, x, pair_labels, nested)
    return _sum_terms([contrastive_term, angle_term, cosine_term], outputs)


def _angle_contrastive(ops: Ops, settings: AngleSettings, queries: torch.Tensor, positives: torch.Tensor,
                       negatives: list[torch.Tensor], nested: Nested | None) -> torch.Tensor:
    """The contrastive terms of formats B and C: query i against [positives; negatives], with the partition and the
    filter chosen (with the defaults, contrastive(queries, [positives; negatives]), the reference's)."""
    return multiple_negatives(ops, queries, positives, negatives, scale=settings.ibn_tau,
                              directions=IBN_PARTITIONS[settings.ibn_partition],
                              false_negative_margin=settings.false_negative_margin,
                              false_negative_strategy=settings.false_negative_strategy, nested=nested)


def _weighted_ranking_terms(ops: Ops, settings: AngleSettings, groups: torch.Tensor, labels: torch.Tensor,
                            nested: Nested | None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(cosine_w * cosine, angle_w * angle) on the pairs (groups[g, 0], groups[g, k]), from one pair-score pass; a
    disabled term is None."""
    if settings.cosine_w <= 0 and settings.angle_w <= 0:
        return None, None
    cosine_term, angle_term = ranking_terms(
        ops, groups, labels,
        cosine_tau=settings.cosine_tau if settings.cosine_w > 0 else None,
        angle_tau=settings.angle_tau if settings.angle_w > 0 else None,
        pooling_strategy=settings.angle_pooling_strategy, nested=nested,
    )
    return (None if cosine_term is None else settings.cosine_w * cosine_term,
            None if angle_term is None else settings.angle_w * angle_term)


def _sum_terms(terms: list[torch.Tensor | None], outputs: torch.Tensor) -> torch.Tensor:
    """The terms that were computed, summed in the given order; when none was (every weight 0), a 0-dim zero
    connected to `outputs` (zero gradients, as every other zero loss here: backward() runs)."""
    computed = [t for t in terms if t is not None]
    if not computed:
        return outputs.flatten()[:0].sum().to(compute_dtype(outputs.dtype))
    total = computed[0]
    for term in computed[1:]:
        total = total + term
    return total
