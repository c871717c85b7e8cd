"""The retrieval losses (sentence-transformers 6.3's MultipleNegativesRankingLoss and GISTEmbedLoss), from the
public functions to the op calls.

    multiple_negatives_ranking_loss   InfoNCE with in-batch negatives, every option (`multiple_negatives`: the
                                      standard and symmetric losses as similarity_xent calls, everything else from
                                      similarity_lse blocks, `multiple_negatives_rows`)
    gist_loss                         in-batch negatives filtered by a guide model (`gist`)

Each public function checks its arguments (`angle_kernels.inputs`), resolves the backend and calls its formula,
written once here; the sentence-transformers integration checks its inputs once and calls the formulas directly.
Shared conventions: angle_kernels.losses.
"""

from __future__ import annotations

import contextlib
import math

import torch

from ..contract import FILTER_TIE_ALLOWANCE, compute_dtype, loss_entry
from ..dispatch import Ops, resolve_backend
from ..distributed import all_gather_many_with_grad, gathering_rank_and_world_size, refused_together
from ..inputs import (
    HARDNESS_MODES,
    MARGIN_STRATEGIES,
    Dims,
    DimWeights,
    LayerWeights,
    Nested,
    check_choice,
    check_columns,
    check_embedding_group,
    check_flag,
    check_multiple_negatives,
    check_same_device,
    check_same_shape,
    check_scalar,
    check_scale,
    combined,
    nested_dims,
    promote_embeddings,
)

__all__ = ["multiple_negatives_ranking_loss", "gist_loss"]


@loss_entry
def multiple_negatives_ranking_loss(
    queries: torch.Tensor,
    positives: torch.Tensor,
    negatives: tuple[torch.Tensor, ...] | list[torch.Tensor] = (),
    *,
    scale: float = 20.0,
    directions: tuple[str, ...] | list[str] = ("query_to_doc",),
    partition_mode: str = "joint",
    hardness_mode: str | None = None,
    hardness_strength: float = 0.0,
    false_negative_margin: float | None = None,
    false_negative_strategy: str = "absolute",
    similarity: str = "cosine",
    gather_across_devices: bool = False,
    dims: Dims | None = None,
    dim_weights: DimWeights | None = None,
    layer_weights: LayerWeights | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """InfoNCE with in-batch negatives, every option of sentence-transformers 6.3's MultipleNegativesRankingLoss
    (same values and gradients), plus a false-negative filter, without any B x B score matrix.

    Row i scores its query against the documents [positives; negatives[0]; negatives[1]; ...] (logits
    scale * cos), its positive being positives[i]; `directions` adds the other interaction blocks of the row:
    "query_to_query" (the other queries, itself excluded), "doc_to_query" (its positive against every query),
    "doc_to_doc" (its positive against the documents that belong to other queries). partition_mode="joint":
    one softmax over every selected block (GTE's improved contrastive loss uses all four); "per_direction":
    one per direction, their log partition functions averaged ("query_to_doc" and "doc_to_query": symmetric
    InfoNCE). loss = mean_i (log_partition_i - scale * cos(queries_i, positives_i)).

    hardness_mode / hardness_strength (alpha): adds alpha * stop_gradient(cos) to the query-to-document logits
    of "in_batch_negatives" (the documents of other queries), "hard_negatives" (the row's own negatives) or
    "all_negatives" (every column but the positive), as sentence-transformers defines them; scale + alpha is
    held to check_scale's bound (inputs.LARGEST_LOGIT_FACTOR), the penalised logits' factor.
    false_negative_margin: a column whose cosine with the row's anchor exceeds the positive's cosine minus the
    margin ("absolute") or minus |positive| * margin ("relative", false_negative_strategy) leaves the
    partition function, in every block (the positive itself stays): positive-aware false-negative filtering
    as in NV-Retriever; None (default) keeps every column.
    similarity: "cosine" (default; util.cos_sim) or "dot" (util.dot_score: raw dot products, for models whose
    embeddings are not normalised); every score above, the positive's, the hardness penalty's and the
    filter's, is then that similarity.
    gather_across_devices: with torch.distributed initialised, the columns come from every process
    (all_gather_with_grad) and each process's loss is the mean over its own rows, as in sentence-transformers;
    every process must pass the same shapes.
    dims, dim_weights: Matryoshka (see angle_kernels.losses). Every option computes every prefix in one call
    of each op it makes (the standard and symmetric losses one similarity_xent call; the joint partitions,
    hardness, the filter and dot products one similarity_lse call per block of columns), except where the backend
    that would compute a call at one width has no dims for it (a GPU path not yet verified with dims): then one
    call per prefix on the truncated embeddings (`Ops.takes_in_one_call`), never a move to a slower backend.

    Args:
        queries, positives: [B, D]; negatives: any number of [B, D] tensors (hard-negative columns).
        backend: "auto" (default), "torch", "triton" or "cuda".
    """
    call = check_multiple_negatives(
        queries, positives, negatives, scale=scale, directions=directions, partition_mode=partition_mode,
        hardness_mode=hardness_mode, hardness_strength=hardness_strength, false_negative_margin=false_negative_margin,
        false_negative_strategy=false_negative_strategy, similarity=similarity,
        gather_across_devices=gather_across_devices, dims=dims, dim_weights=dim_weights, layer_weights=layer_weights)
    return multiple_negatives(resolve_backend(backend, call.queries), **call._asdict())


@loss_entry
def gist_loss(
    anchors: torch.Tensor,
    positives: torch.Tensor,
    guide_anchors: torch.Tensor,
    guide_positives: torch.Tensor,
    negatives: tuple[torch.Tensor, ...] | list[torch.Tensor] = (),
    guide_negatives: tuple[torch.Tensor, ...] | list[torch.Tensor] = (),
    *,
    temperature: float = 0.01,
    margin_strategy: str = "absolute",
    margin: float = 0.0,
    contrast_anchors: bool = True,
    contrast_positives: bool = True,
    self_negatives: bool = False,
    gather_across_devices: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """GISTEmbed (Solatorio, 2024) as sentence-transformers 6.3's GISTEmbedLoss computes it: InfoNCE whose
    in-batch negatives are filtered by a guide model, without any B x B score matrix.

    Row i's logits (cos / temperature) are anchor i against every positive (its own, column i, is the target),
    plus, with contrast_anchors, against every other anchor, with contrast_positives, positive i against every
    other positive, and anchor i against each negative column. self_negatives=True keeps anchor i's own anchor
    and positive i's own positive in those two blocks, subject to the filter like any column, as
    sentence-transformers did before 6.3 (the filter drops them unless the threshold is at least 1, e.g. with a
    negative margin; kept, their constant logit 1 / temperature only flattens the row's gradient). A column
    leaves row i's partition function when its guide similarity exceeds the guide's anchor-positive similarity
    g_i minus the margin ("absolute": g_i - margin; "relative": g_i - |g_i| * margin) by more than 2^-16
    (contract.FILTER_TIE_ALLOWANCE: a column tied with it in exact arithmetic, a copy of the positive at margin 0,
    stays whatever the rounding; sentence-transformers drops every column above it, however little); the target
    column always stays. The guide's embeddings
    (guide_anchors, guide_positives, guide_negatives: same rows, any width) carry no gradient.
    gather_across_devices: with torch.distributed initialised, the positives and negatives (and their guide
    embeddings) come from every rank; the anchors stay local, as in sentence-transformers.

    Args:
        anchors, positives: [B, D]; negatives: [B, D] tensors (hard-negative columns), one guide tensor each.
        backend: "auto" (default), "torch", "triton" or "cuda".
    """
    # a check that fails here on one rank before the gathers fails on every rank (distributed.refused_together)
    # (a call that does not gather, the common one, skips the context manager, its cost per call and its file: a
    # call reaches its op through four files, tests/test_structure.py)
    sharing = gather_across_devices is not False
    with refused_together(gather_across_devices, anchors) if sharing else contextlib.nullcontext():
        temperature = check_scale("temperature", temperature, divides=True)
        margin = check_scalar("margin", margin)
        check_choice("margin_strategy", margin_strategy, MARGIN_STRATEGIES)
        contrast_anchors = check_flag("contrast_anchors", contrast_anchors)
        contrast_positives = check_flag("contrast_positives", contrast_positives)
        self_negatives = check_flag("self_negatives", self_negatives)
        gather_across_devices = check_flag("gather_across_devices", gather_across_devices)
        # the four tensors before the columns: arguments given out of their order (the negatives third) are named
        # where they went wrong, not as negatives that are no tuple
        for name, t in (("anchors", anchors), ("positives", positives), ("guide_anchors", guide_anchors),
                        ("guide_positives", guide_positives)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a [B, D] tensor; got {type(t).__name__}: gist_loss takes (anchors, "
                                "positives, guide_anchors, guide_positives, negatives=(), guide_negatives=()), the "
                                "guide model's embeddings before the negatives")
        negatives = check_columns("negatives", negatives)
        guide_negatives = check_columns("guide_negatives", guide_negatives)
        anchors, positives, *negatives = promote_embeddings(anchors, positives, *negatives)
        guide_anchors, guide_positives, *guide_negatives = promote_embeddings(guide_anchors, guide_positives,
                                                                                     *guide_negatives)
        if len(negatives) != len(guide_negatives):
            raise ValueError(f"every negative column needs its guide embeddings: {len(negatives)} negatives, "
                             f"{len(guide_negatives)} guide_negatives")
        named = [("positives", positives), *((f"negatives[{i}]", t) for i, t in enumerate(negatives))]
        guide_named = [("guide_positives", guide_positives),
                       *((f"guide_negatives[{i}]", t) for i, t in enumerate(guide_negatives))]

        def check_this_ranks() -> None:
            check_embedding_group(("anchors", anchors), *named)
            check_embedding_group(("guide_anchors", guide_anchors), *guide_named)
            # a guide model on another device than the model (its embeddings stay there): named here, not as the
            # op's filter arguments
            check_same_device(("anchors", anchors), ("guide_anchors", guide_anchors))
            for name, t in named:
                check_same_shape("anchors", anchors, name, t)
            # the guide's anchors against the model's first, so that a guide tensor of the wrong size is the one named
            if guide_anchors.shape[0] != anchors.shape[0]:
                raise ValueError(f"guide_anchors must have the anchors' {anchors.shape[0]} rows, "
                                 f"got {guide_anchors.shape[0]}")
            for name, t in guide_named:
                check_same_shape("guide_anchors", guide_anchors, name, t)

        rank, world_size = gathering_rank_and_world_size() if gather_across_devices else (0, 1)
        gathered = None
        if gather_across_devices and world_size > 1:
            # This rank's checks settled with every rank's before anything is gathered: the anchors (and their guide
            # embeddings) are not gathered, so a refusal seen by one rank alone would leave the others waiting.
            everything = all_gather_many_with_grad(
                named + [(name, t.detach()) for name, t in guide_named], local_check=check_this_ranks,
                options=dict(loss="gist_loss", temperature=temperature, margin_strategy=margin_strategy, margin=margin,
                             contrast_anchors=contrast_anchors, contrast_positives=contrast_positives,
                             self_negatives=self_negatives))
            model_side, guide_side = everything[:len(named)], everything[len(named):]
            gathered = (rank, model_side[0], model_side[1:], guide_side[0], guide_side[1:])
        else:
            check_this_ranks()
    return gist(resolve_backend(backend, anchors), anchors, positives, negatives, guide_anchors.detach(),
                guide_positives.detach(), [t.detach() for t in guide_negatives], temperature=temperature,
                margin_strategy=margin_strategy, margin=margin, contrast_anchors=contrast_anchors,
                contrast_positives=contrast_positives, self_negatives=self_negatives, gathered=gathered)


# The formulas


def margin_threshold(positive: torch.Tensor, strategy: str, margin: float,
                     magnitude: torch.Tensor | None = None) -> torch.Tensor:
    """Where a false-negative filter starts: columns scoring above this leave the partition function.
    "absolute": positive - margin; "relative": positive - |positive| * margin (GIST's two strategies); plus the
    allowance for ties, contract.FILTER_TIE_ALLOWANCE, times `magnitude` where the scores are dot products (each
    row's |q_i| |p_i|, the scale of their rounding; broadcast against positive's last dimension)."""
    positive = positive.detach()
    if strategy == "absolute":
        threshold = positive - margin
    else:
        # a margin past the scores' dtype's range is inf there, and a positive score of 0 times inf NaN: a threshold
        # no column exceeds, the filter off. Clamped to the largest number, that product is 0, as in exact arithmetic
        largest = torch.finfo(positive.dtype).max
        threshold = positive - positive.abs() * min(max(margin, -largest), largest)
    allowance = FILTER_TIE_ALLOWANCE if magnitude is None else FILTER_TIE_ALLOWANCE * magnitude
    return (threshold + allowance).to(threshold.dtype)


def contrastive(ops: Ops, queries: torch.Tensor, candidates: torch.Tensor, tau: float,
                nested: Nested | None = None) -> torch.Tensor:
    """Mean cross-entropy of query i among the candidates (logits tau * cos), target candidates[i]."""
    if nested is not None and nested.stacked:
        return nested.over_layers(lambda layer, sub: contrastive(ops, queries[layer], candidates[layer], tau, sub))
    loss = ops.similarity_xent(queries, candidates.to(queries.dtype), tau, "diagonal", dims=nested_dims(nested))
    return combined(loss, nested)


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


def loss_over_the_positive(relative_log_partitions: list[torch.Tensor], holds_positive: list[bool],
                           joint: bool) -> torch.Tensor:
    """Each row's loss from its blocks' log partitions relative to its positive logit, x_b = lse_b - l_pos, in
    which the positive was left out of every block: a block that held it (holds_positive[b]; e.g. query_to_doc,
    and doc_to_query, whose target is the same pair) gets its exp(0) = 1 back here. joint: log(m + sum_b exp(x_b))
    for the m blocks that held it, as logaddexp(logsumexp_b x_b, log m): no 1 + exp(x) is rounded before its log,
    which kept a small loss's digits only to float32's 1.2e-7 (a row whose other columns are all gone, every
    x_b = -inf, has the loss log m); per direction: the mean over the blocks of log(1 + exp(x_b)) where b held it,
    else x_b.

    Why not lse_b - l_pos with the positive inside: each op returns its gradient in its input's dtype, and where the
    loss is small the positive's softmax weight is ~1, so the log partition's gradient and the positive score's
    nearly cancel: with 16-bit rows each was rounded before they met, and the gradients had ~100% relative error
    (bf16, loss ~1e-3). Left out, the positive's weight in the op is gone; every term the ops return is scaled by
    the (small) weight of the columns that are not the positive, and no two large terms cancel."""
    x = torch.stack(relative_log_partitions)
    if joint:
        held = sum(holds_positive)
        # logsumexp over the blocks, -inf for a row of -inf only, whose gradient is then 0 (torch's is NaN there)
        gone = torch.isneginf(x).all(dim=0)
        lse = torch.logsumexp(torch.where(gone, torch.zeros_like(x), x), dim=0).masked_fill(gone, -math.inf)
        return lse if held == 0 else torch.logaddexp(lse, torch.full_like(lse, math.log(held)))
    return torch.stack([torch.logaddexp(x_b, torch.zeros_like(x_b)) if holds else x_b
                        for x_b, holds in zip(x, holds_positive)]).mean(dim=0)


def _rows_for(ops: Ops, *rows: torch.Tensor) -> list[torch.Tensor]:
    """The rows as float32 where they are 16-bit CPU tensors the PyTorch backend computes (one differentiable cast
    each), else as they are. The PyTorch backend computes 16-bit CPU rows in float32 anyway, so the cast costs one
    copy (the ops then make none), and the gradients of the loss's several ops (log partitions, positive scores)
    then add in float32 and are rounded to 16 bits once, not once per op. Triton reads 16-bit rows as they are (a
    cast would double its bytes and put its products in float32), on a GPU as under the interpreter, so there each
    op rounds its own term: `loss_over_the_positive` keeps those terms from cancelling."""
    if ops.name not in ("torch", "auto"):
        return list(rows)
    return [t.float() if t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16) else t for t in rows]


def _norm_products(a: torch.Tensor, b: torch.Tensor, dims: tuple[int, ...] | None = None) -> torch.Tensor:
    """|a_i| |b_i| per row, in float64: the scale of the rounding of the dot products a_i . c_j where c_j is b_i
    or a copy of it; [k, rows] of every prefix's with dims (each prefix's filter compares its own products). Not
    in the compute dtype: a float32 row's norm overflows from |x| ~ 1.8e19 (its squares do), where every dot
    product may still fit, and an infinite tie allowance switched that row's filter off."""

    def products(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return (torch.linalg.vector_norm(x, dim=-1, dtype=torch.float64)
                * torch.linalg.vector_norm(y, dim=-1, dtype=torch.float64))

    return products(a, b) if dims is None else torch.stack([products(a[:, :d], b[:, :d]) for d in dims])


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
    (all_gather_with_grad; all queries None where no direction scores the queries as columns); this rank's rows
    are scored against them, its row i's positive being column rank * B + i. Two paths: the standard and the
    per-direction symmetric losses without hardness or filter are the similarity_xent op (one kernel computes
    each row's partition and positive); everything else combines per-row log partitions of similarity_lse blocks
    with the positive scores; so do dot-product logits (similarity="dot"), which similarity_xent does not
    compute. nested: both paths compute every prefix in one pass of their op (the second, per prefix on the
    truncated embeddings where the backend that would compute similarity_lse without dims lacks them:
    `Ops.takes_in_one_call`).
    """
    # the options every path passes on unchanged, by name
    options = dict(scale=scale, directions=directions, partition_mode=partition_mode, hardness_mode=hardness_mode,
                   hardness_strength=hardness_strength, false_negative_margin=false_negative_margin,
                   false_negative_strategy=false_negative_strategy)
    if nested is not None and nested.stacked:
        if gathered is not None:
            raise ValueError("stacked layers (layer_weights) do not combine with gather_across_devices yet")
        return nested.over_layers(lambda layer, sub: multiple_negatives(
            ops, queries[layer], positives[layer], [t[layer] for t in negatives], similarity=similarity, nested=sub,
            **options))
    hard = hardness_mode is not None and hardness_strength > 0.0
    plain = (set(directions) == {"query_to_doc"} or partition_mode == "per_direction") and not hard and (
        similarity == "cosine")
    rank, all_queries, all_positives, all_negatives = gathered or (0, queries, positives, negatives)
    if plain and false_negative_margin is None:
        # logsumexp over the columns does not depend on their order: with this rank's positives first, row i's
        # target is column i, the op's "diagonal" target, gathered or not
        own_first = [positives] if gathered is None else _own_rows_first(positives, all_positives, rank)
        columns = [*own_first, *(t.to(positives.dtype) for t in all_negatives)]
        # one block of columns is passed as it is: a cat would copy it and add an autograd node for nothing
        loss = contrastive(ops, queries, columns[0] if len(columns) == 1 else torch.cat(columns), scale, nested)
        if "doc_to_query" in directions:
            query_columns = queries if gathered is None else torch.cat(_own_rows_first(queries, all_queries, rank))
            loss = (loss + contrastive(ops, positives, query_columns, scale, nested)) / 2
        return loss
    if nested is None:
        return multiple_negatives_rows(ops, queries, positives, negatives, gathered=gathered, similarity=similarity,
                                       **options).mean()

    if ops.takes_in_one_call("similarity_lse", queries, positives.to(queries.dtype), scale, dims=nested.dims):
        return nested.combine(multiple_negatives_rows(ops, queries, positives, negatives, gathered=gathered,
                                                      similarity=similarity, dims=nested.dims,
                                                      **options).mean(dim=-1))

    def truncated(d):  # one pass per prefix
        cut = [None if t is None else t[:, :d] for t in (queries, positives, all_queries, all_positives)]
        negatives_cut, all_negatives_cut = [t[:, :d] for t in negatives], [t[:, :d] for t in all_negatives]
        return multiple_negatives_rows(
            ops, cut[0], cut[1], negatives_cut, similarity=similarity,
            gathered=None if gathered is None else (rank, cut[2], cut[3], all_negatives_cut), **options).mean()

    return nested.combine(torch.stack([truncated(d) for d in nested.dims]))


def multiple_negatives_rows(ops: Ops, queries: torch.Tensor, positives: torch.Tensor, negatives: list[torch.Tensor],
                            scale: float, directions: tuple = ("query_to_doc",), partition_mode: str = "joint",
                            hardness_mode: str | None = None, hardness_strength: float = 0.0,
                            false_negative_margin: float | None = None, false_negative_strategy: str = "absolute",
                            gathered: tuple | None = None, similarity: str = "cosine",
                            dims: tuple[int, ...] | None = None) -> torch.Tensor:
    """The loss of each query [B] of multiple_negatives (same arguments), from per-row log partitions of
    similarity_lse blocks and the positive scores: log_partition_i - scale * s(queries_i, positives_i), the positive
    left out of the blocks and added back in closed form (`loss_over_the_positive`). Dot products are not bounded:
    each block gives its partition relative to the positive logit (the op's `reference`: the pair's other text), so
    that logits beyond the compute dtype whose difference is not still give the exact loss (a row whose positive
    dominates: 0), not inf - inf. dims: the losses [k, B] of every prefix, each op called once for all of them."""
    queries, positives, *negatives = _rows_for(ops, queries, positives, *negatives)
    if gathered is not None:
        rank, all_queries, all_positives, all_negatives = gathered
        gathered = (rank, None if all_queries is None else _rows_for(ops, all_queries)[0],
                    *_rows_for(ops, all_positives), _rows_for(ops, *all_negatives))
    rank, all_queries, all_positives, all_negatives = gathered or (0, queries, positives, negatives)
    negative_columns = [t.to(positives.dtype) for t in all_negatives]
    offset, world_rows = rank * queries.shape[0], all_positives.shape[0]
    documents = torch.cat([all_positives, *negative_columns])  # row i's positive: column offset + i
    relative = similarity == "dot"
    positive = None if relative and false_negative_margin is None else positive_scores(ops, queries, positives,
                                                                                         similarity, dims)
    threshold = None
    if false_negative_margin is not None:
        magnitude = None if similarity == "cosine" else _norm_products(queries, positives, dims)
        threshold = margin_threshold(positive, false_negative_strategy, false_negative_margin, magnitude)

    def block(anchors, columns, partners, **options):
        """The log partition of a block relative to the positive logit (every block leaves the positive out)."""
        filtering = {} if threshold is None else dict(filter_q=anchors.detach(), filter_c=columns.detach(),
                                                      filter_threshold=threshold)
        lse = ops.similarity_lse(anchors, columns.to(anchors.dtype), scale, target_offset=offset, **options,
                                 **filtering, normalize=not relative, dims=dims,
                                 reference=partners.to(anchors.dtype) if relative else None)
        return lse if relative else lse - scale * positive

    hard = hardness_mode is not None and hardness_strength > 0.0
    penalty = dict(penalty=hardness_strength, penalty_on=HARDNESS_MODES[hardness_mode]) if hard else {}
    # (block, whether its target column is the positive pair), the positive left out of each
    blocks = [(block(queries, documents, positives, period=world_rows, exclude="target", **penalty), True)]
    if "query_to_query" in directions:
        blocks.append((block(queries, all_queries, positives, exclude="target"), False))
    if "doc_to_query" in directions:
        blocks.append((block(positives, all_queries, queries, exclude="target"), True))
    if "doc_to_doc" in directions:
        blocks.append((block(positives, documents, queries, period=world_rows, exclude="own"), False))
    return loss_over_the_positive([x for x, _ in blocks], [holds for _, holds in blocks],
                                  joint=partition_mode == "joint")


def gist(ops: Ops, anchors: torch.Tensor, positives: torch.Tensor, negatives: list[torch.Tensor],
         guide_anchors: torch.Tensor, guide_positives: torch.Tensor, guide_negatives: list[torch.Tensor],
         temperature: float, margin_strategy: str = "absolute", margin: float = 0.0, contrast_anchors: bool = True,
         contrast_positives: bool = True, self_negatives: bool = False, gathered: tuple | None = None) -> torch.Tensor:
    """sentence-transformers' GISTEmbedLoss on checked inputs (see gist_loss). gathered: None, or (rank, all
    positives, all negatives, all guide positives, all guide negatives) from every rank (the anchors stay
    local, as in sentence-transformers)."""
    anchors, positives, *negatives = _rows_for(ops, anchors, positives, *negatives)
    if gathered is not None:
        gathered = (gathered[0], *_rows_for(ops, gathered[1]), _rows_for(ops, *gathered[2]), *gathered[3:])
    rank, all_positives, all_negatives, all_guide_positives, all_guide_negatives = gathered or (
        0, positives, negatives, guide_positives, guide_negatives)
    scale = 1.0 / temperature
    cos_positive = positive_scores(ops, anchors, positives)
    guide_positive = positive_scores(ops, guide_anchors, guide_positives)
    threshold = margin_threshold(guide_positive, margin_strategy, margin)

    def block(rows, columns, guide_rows, guide_columns, exclude="none", target_offset=rank * anchors.shape[0]):
        """The log partition of a block relative to the positive logit; row i's target column: target_offset + i
        (this rank's rows among gathered columns; a local block's from 0)."""
        return ops.similarity_lse(rows, columns.to(rows.dtype), scale, target_offset=target_offset,
                                  exclude=exclude, filter_q=guide_rows,
                                  filter_c=guide_columns.to(guide_rows.dtype),
                                  filter_threshold=threshold) - scale * cos_positive

    # the positive (the anchor-positive block's target, which the filter never drops) is left out and added back
    log_partitions = [block(anchors, all_positives, guide_anchors, all_guide_positives, exclude="target")]
    own = "none" if self_negatives else "target"  # row i's own anchor (positive) among the anchors (positives)
    if contrast_anchors:  # the anchors are never gathered: anchor i is column i
        log_partitions.append(block(anchors, anchors, guide_anchors, guide_anchors, exclude=own, target_offset=0))
    if contrast_positives:
        log_partitions.append(block(positives, all_positives, guide_positives, all_guide_positives, exclude=own))
    for negative, guide_negative in zip(all_negatives, all_guide_negatives):
        log_partitions.append(block(anchors, negative, guide_anchors, guide_negative))
    return loss_over_the_positive(log_partitions, [True] + [False] * (len(log_partitions) - 1), joint=True).mean()
