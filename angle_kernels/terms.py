"""The computing layer: each loss's formula, written once, on checked inputs and a resolved backend.

Every function here takes a `dispatch.Ops` (a resolved backend: `dispatch.resolve_backend`) and inputs the
caller has already checked and parsed with `angle_kernels.options` (and `checks`): embeddings of one float
dtype, labels as tensors, options normalised (scales as floats, margins in radians, directions as tuples,
Matryoshka / layer-wise weights as an `options.Nested` or None). They check only what the fronts cannot see
before the formula runs (the ops check their own contract) and return a 0-dim loss (per-row losses for
multiple_negatives_rows).

    ranking_terms        CoSENT terms of the cosine and the angle scores (cosine_loss, angle_loss, AngleLoss,
                         CoSENTLoss / AnglELoss), from one pair-score pass
    in_batch_negatives   AnglE's in-batch-negative term (in_batch_negative_loss, AngleLoss format A)
    contrastive          query i among candidates, target candidates[i] (contrastive_with_negative_loss)
    arccon, triplet      ArcCSE's terms (arccon_loss, triplet_loss, ArcCSELoss)
    multiple_negatives   sentence-transformers' MultipleNegativesRankingLoss, every option
                         (multiple_negatives_rows: its per-query losses)
    gist                 GISTEmbedLoss: in-batch negatives filtered by a guide model

Callers: the public losses of `angle_kernels.functional` (check, resolve the backend, call one of these),
`modules.AngleLoss` / `ArcCSELoss` and `integrations.sentence_transformers`, which check their own inputs once
and call these directly. With a `nested` (options.check_nested), each term is computed on every prefix (and
every layer of stacked inputs [L, rows, D]) and weighted: the pair-score terms in one op call, the softmax
terms one op call per layer. The integrations and the public losses call them as attributes of this module
(`terms.ranking_terms(...)`): the integration tests count the calls by patching those attributes.
"""

from __future__ import annotations

import torch

from .contract import compute_dtype
from .dispatch import Ops
from .options import HARDNESS_MODES, IBN_PARTITIONS, Nested


def margin_threshold(positive: torch.Tensor, strategy: str, margin: float) -> torch.Tensor:
    """Where a false-negative filter starts: columns scoring above this leave the partition function.
    "absolute": positive - margin; "relative": positive - |positive| * margin (GIST's two strategies)."""
    positive = positive.detach()
    return positive - margin if strategy == "absolute" else positive - positive.abs() * margin


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
    cos, angle = _pair_score_table(ops, groups, with_angle, nested)
    widths = (groups.shape[-1],) if nested.dims is None else nested.dims
    # (layer, prefix) -> its (cosine term, angle term), for the terms with a non-zero weight
    per_term = {(layer, i): _ranking_terms_of(ops, cos[layer, i], angle[layer, i], labels, cosine_tau, angle_tau,
                                              pooling_strategy, widths[i]) for layer, i, _ in nested.terms()}
    return tuple(None if tau is None else nested.weighted_sum(lambda layer, i, which=which: per_term[layer, i][which])
                 for which, tau in enumerate((cosine_tau, angle_tau)))


def _pair_score_table(ops: Ops, groups: torch.Tensor, with_angle: bool,
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


def _combined(loss: torch.Tensor, nested: Nested | None) -> torch.Tensor:
    """An op's loss as the caller wants it: itself, or the weighted sum of its [k] per-prefix losses."""
    return loss if nested is None else nested.combine(loss)


def _dims(nested: Nested | None) -> tuple[int, ...] | None:
    return None if nested is None else nested.dims


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
            ops, labels, y_pred[layer], tau, group_ids, partition, false_negative_margin, false_negative_strategy, sub))
    pairs = positive_pairs(labels).to(compute_dtype(y_pred.dtype))
    if partition == "angle" and false_negative_margin is None:
        return _combined(ops.similarity_xent(y_pred, None, tau, "partner", row_weights=pairs.repeat_interleave(2),
                                             exclude_diagonal=True, group_ids=group_ids, dims=_dims(nested)), nested)
    if nested is not None:
        raise ValueError("dims (Matryoshka) works with the in-batch-negative term only with partition='angle' and "
                         "no false-negative filter for now")
    if group_ids is not None:
        raise ValueError("group_ids works only with partition='angle' and no false-negative filter")
    queries, documents = y_pred[0::2], y_pred[1::2]
    options = dict(false_negative_margin=false_negative_margin, false_negative_strategy=false_negative_strategy)
    if partition == "gte":
        return (pairs * multiple_negatives_rows(ops, queries, documents, [], tau, IBN_PARTITIONS["gte"],
                                                **options)).mean()
    # A row against every other row is one query's "query_to_doc" and "query_to_query" blocks, with the pair's
    # document as the query for row 2k + 1.
    one_row = ("query_to_doc", "query_to_query")
    both_rows = (multiple_negatives_rows(ops, queries, documents, [], tau, one_row, **options)
                 + multiple_negatives_rows(ops, documents, queries, [], tau, one_row, **options))
    return (pairs * both_rows).sum() / y_pred.shape[0]


def contrastive(ops: Ops, queries: torch.Tensor, candidates: torch.Tensor, tau: float,
                nested: Nested | None = None) -> torch.Tensor:
    """Mean cross-entropy of query i among the candidates (logits tau * cos), target candidates[i]."""
    if nested is not None and nested.stacked:
        return nested.over_layers(lambda layer, sub: contrastive(ops, queries[layer], candidates[layer], tau, sub))
    return _combined(ops.similarity_xent(queries, candidates.to(queries.dtype), tau, "diagonal", dims=_dims(nested)),
                     nested)


def arccon(ops: Ops, h1: torch.Tensor, h2: torch.Tensor, margin: float, tau: float,
           nested: Nested | None = None) -> torch.Tensor:
    """ArcCon on checked views; margin in radians."""
    if nested is not None and nested.stacked:
        return nested.over_layers(lambda layer, sub: arccon(ops, h1[layer], h2[layer], margin, tau, sub))
    return _combined(ops.similarity_xent(h1, h2.to(h1.dtype), 1.0 / tau, "diagonal", margin=margin,
                                         dims=_dims(nested)), nested)


def triplet(ops: Ops, anchor: torch.Tensor, weak: torch.Tensor, strong: torch.Tensor, margin: float,
            nested: Nested | None = None) -> torch.Tensor:
    """mean(max(0, cos(anchor, strong) - cos(anchor, weak) + margin)) on checked triplets, one pair-score pass
    (for every prefix and layer at once when nested)."""
    groups = torch.stack((anchor, weak.to(anchor.dtype), strong.to(anchor.dtype)), dim=-2)
    if nested is None:
        cos, _ = ops.pair_scores(groups, False)
        return torch.relu(cos[:, 1] - cos[:, 0] + margin).mean()
    cos, _ = _pair_score_table(ops, groups, False, nested)
    per_term = torch.relu(cos[..., 1] - cos[..., 0] + margin).mean(dim=-1)  # [L, k]
    return nested.weighted_sum(lambda layer, i: per_term[layer, i])


def positive_scores(ops: Ops, a: torch.Tensor, b: torch.Tensor, similarity: str = "cosine",
                    dims: tuple[int, ...] | None = None) -> torch.Tensor:
    """s(a_i, b_i) per row in the compute dtype: the cosine (one pair-score pass) or the dot product; [k, rows] of
    every prefix with dims."""
    if similarity == "cosine":
        return ops.pair_scores(torch.stack((a, b.to(a.dtype)), dim=1), False, dims)[0][..., 0]
    dtype = compute_dtype(a.dtype)
    if dims is None:
        return torch.linalg.vecdot(a.to(dtype), b.to(dtype))
    return torch.stack([torch.linalg.vecdot(a[:, :d].to(dtype), b[:, :d].to(dtype)) for d in dims])


def _own_rows_first(local: torch.Tensor, gathered: torch.Tensor, rank: int) -> list[torch.Tensor]:
    """The rows of `gathered` (every rank's `local`, in rank order) with this rank's own rows first, as pieces for
    one torch.cat; the own rows are `local` itself (same values; its gradient then comes straight from this
    rank's loss, the other ranks' through the gather's backward)."""
    rows = local.shape[0]
    return [local, gathered[:rank * rows], gathered[(rank + 1) * rows:]]


def multiple_negatives(ops: Ops, queries: torch.Tensor, positives: torch.Tensor, negatives: list[torch.Tensor],
                       scale: float, directions: tuple = ("query_to_doc",), partition_mode: str = "joint",
                       hardness_mode: str | None = None, hardness_strength: float = 0.0,
                       false_negative_margin: float | None = None, false_negative_strategy: str = "absolute",
                       gathered: tuple | None = None, similarity: str = "cosine",
                       nested: Nested | None = None) -> torch.Tensor:
    """sentence-transformers' MultipleNegativesRankingLoss on checked inputs (see the public function).

    gathered: None, or (rank, all queries, all positives, all negatives) when the columns come from every rank
    (all_gather_with_grad); this rank's rows are scored against them, its row i's positive being column
    rank * B + i. Two paths: the standard and the per-direction symmetric losses without hardness or filter are
    the similarity_xent op (one kernel computes each row's partition and positive); everything else combines
    per-row log partitions of similarity_lse blocks with the positive scores; so do dot-product logits
    (similarity="dot"), which similarity_xent does not compute. nested: both paths compute every prefix in one
    pass of their op (the second, per prefix on the truncated embeddings where the backend that would compute
    similarity_lse without dims lacks them: `Ops.takes_in_one_call`).
    """
    if nested is not None and nested.stacked:
        if gathered is not None:
            raise ValueError("stacked layers (layer_weights) do not combine with gather_across_devices yet")
        return nested.over_layers(lambda layer, sub: multiple_negatives(
            ops, queries[layer], positives[layer], [t[layer] for t in negatives], scale, directions, partition_mode,
            hardness_mode, hardness_strength, false_negative_margin, false_negative_strategy, None, similarity, sub))
    hard = hardness_mode is not None and hardness_strength > 0.0
    plain = (set(directions) == {"query_to_doc"} or partition_mode == "per_direction") and not hard and (
        similarity == "cosine")
    rank, all_queries, all_positives, all_negatives = gathered or (0, queries, positives, negatives)
    if plain and false_negative_margin is None:
        # logsumexp over the columns does not depend on their order: with this rank's positives first, row i's
        # target is column i, the op's "diagonal" target, gathered or not
        own_first = [positives] if gathered is None else _own_rows_first(positives, all_positives, rank)
        loss = contrastive(ops, queries, torch.cat([*own_first, *(t.to(positives.dtype) for t in all_negatives)]),
                           scale, nested)
        if "doc_to_query" in directions:
            query_columns = queries if gathered is None else torch.cat(_own_rows_first(queries, all_queries, rank))
            loss = (loss + contrastive(ops, positives, query_columns, scale, nested)) / 2
        return loss
    options = (scale, directions, partition_mode, hardness_mode, hardness_strength, false_negative_margin,
               false_negative_strategy)
    if nested is None:
        return multiple_negatives_rows(ops, queries, positives, negatives, *options, gathered, similarity).mean()

    if ops.takes_in_one_call("similarity_lse", queries, positives.to(queries.dtype), scale, dims=nested.dims):
        return nested.combine(multiple_negatives_rows(ops, queries, positives, negatives, *options, gathered,
                                                      similarity, dims=nested.dims).mean(dim=-1))

    def truncated(d):  # one pass per prefix
        cut = [t[:, :d] for t in (queries, positives, all_queries, all_positives)]
        negatives_cut, all_negatives_cut = [t[:, :d] for t in negatives], [t[:, :d] for t in all_negatives]
        return multiple_negatives_rows(ops, cut[0], cut[1], negatives_cut, *options,
                                       None if gathered is None else (rank, cut[2], cut[3], all_negatives_cut),
                                       similarity).mean()

    return nested.combine(torch.stack([truncated(d) for d in nested.dims]))


def multiple_negatives_rows(ops: Ops, queries: torch.Tensor, positives: torch.Tensor, negatives: list[torch.Tensor],
                            scale: float, directions: tuple = ("query_to_doc",), partition_mode: str = "joint",
                            hardness_mode: str | None = None, hardness_strength: float = 0.0,
                            false_negative_margin: float | None = None, false_negative_strategy: str = "absolute",
                            gathered: tuple | None = None, similarity: str = "cosine",
                            dims: tuple[int, ...] | None = None) -> torch.Tensor:
    """The loss of each query [B] of multiple_negatives (same arguments), from per-row log partitions of
    similarity_lse blocks and the positive scores: log_partition_i - scale * s(queries_i, positives_i). Dot
    products are not bounded: each block gives its partition relative to the positive logit (the op's
    `reference`: the pair's other text), so that logits beyond the compute dtype whose difference is not still
    give the exact loss (a row whose positive dominates: 0), not inf - inf. dims: the losses [k, B] of every
    prefix, each op called once for all of them."""
    rank, all_queries, all_positives, all_negatives = gathered or (0, queries, positives, negatives)
    negative_columns = [t.to(positives.dtype) for t in all_negatives]
    offset, world_rows = rank * queries.shape[0], all_queries.shape[0]
    documents = torch.cat([all_positives, *negative_columns])  # row i's positive: column offset + i
    relative = similarity == "dot"
    positive = None if relative and false_negative_margin is None else positive_scores(ops, queries, positives,
                                                                                         similarity, dims)
    threshold = None
    if false_negative_margin is not None:
        threshold = margin_threshold(positive, false_negative_strategy, false_negative_margin)

    def block(anchors, columns, partners, **options):
        filtering = {} if threshold is None else dict(filter_q=anchors.detach(), filter_c=columns.detach(),
                                                      filter_threshold=threshold, filter_keeps_target=True)
        return ops.similarity_lse(anchors, columns.to(anchors.dtype), scale, target_offset=offset, **options,
                                  **filtering, normalize=not relative, dims=dims,
                                  reference=partners.to(anchors.dtype) if relative else None)

    hard = hardness_mode is not None and hardness_strength > 0.0
    penalty = dict(penalty=hardness_strength, penalty_on=HARDNESS_MODES[hardness_mode]) if hard else {}
    log_partitions = [block(queries, documents, positives, period=world_rows, **penalty)]  # query_to_doc
    if "query_to_query" in directions:
        log_partitions.append(block(queries, all_queries, positives, exclude="target"))
    if "doc_to_query" in directions:
        log_partitions.append(block(positives, all_queries, queries))
    if "doc_to_doc" in directions:
        log_partitions.append(block(positives, documents, queries, period=world_rows, exclude="own"))
    stacked = torch.stack(log_partitions)
    log_z = torch.logsumexp(stacked, dim=0) if partition_mode == "joint" else stacked.mean(dim=0)
    return log_z if relative else log_z - scale * positive


def gist(ops: Ops, anchors: torch.Tensor, positives: torch.Tensor, negatives: list[torch.Tensor],
         guide_anchors: torch.Tensor, guide_positives: torch.Tensor, guide_negatives: list[torch.Tensor],
         temperature: float, margin_strategy: str = "absolute", margin: float = 0.0, contrast_anchors: bool = True,
         contrast_positives: bool = True, gathered: tuple | None = None) -> torch.Tensor:
    """sentence-transformers' GISTEmbedLoss on checked inputs (see gist_loss). gathered: None, or (rank, all
    positives, all negatives, all guide positives, all guide negatives) from every rank (the anchors stay
    local, as in sentence-transformers)."""
    rank, all_positives, all_negatives, all_guide_positives, all_guide_negatives = gathered or (
        0, positives, negatives, guide_positives, guide_negatives)
    scale = 1.0 / temperature
    cos_positive = positive_scores(ops, anchors, positives)
    guide_positive = positive_scores(ops, guide_anchors, guide_positives)
    threshold = margin_threshold(guide_positive, margin_strategy, margin)

    def block(rows, columns, guide_rows, guide_columns, keep_positive=False):
        return ops.similarity_lse(rows, columns.to(rows.dtype), scale, target_offset=rank * rows.shape[0],
                                  filter_q=guide_rows, filter_c=guide_columns.to(guide_rows.dtype),
                                  filter_threshold=threshold, filter_keeps_target=keep_positive)

    log_partitions = [block(anchors, all_positives, guide_anchors, all_guide_positives, keep_positive=True)]
    if contrast_anchors:
        log_partitions.append(block(anchors, anchors, guide_anchors, guide_anchors))
    if contrast_positives:
        log_partitions.append(block(positives, all_positives, guide_positives, all_guide_positives))
    for negative, guide_negative in zip(all_negatives, all_guide_negatives):
        log_partitions.append(block(anchors, negative, guide_anchors, guide_negative))
    return (torch.logsumexp(torch.stack(log_partitions), dim=0) - scale * cos_positive).mean()

