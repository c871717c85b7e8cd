"""The losses, as functions: drop-in replacements for `angle_emb.loss` (angle-emb 0.6.1) plus ArcCSE's.

Names, arguments, defaults and the zigzag layout are the reference's: `y_pred` is [2N, D] with the two texts
of pair k on rows 2k and 2k+1, and `y_true` is [2N] or [2N, 1] with the pair's label on both rows. Each loss
is assembled from the ops described in `angle_kernels.dispatch`, computed by the backend chosen with
the keyword-only `backend` argument ("auto", "torch", "triton", "cuda"; default: the environment variable
ANGLE_KERNELS_BACKEND, else "auto"). No loss materialises an N x N matrix.

Every loss returns a 0-dim tensor: float64 for float64 inputs, float32 otherwise (bfloat16/float16 inputs are
accumulated in float32). Embeddings of different float dtypes in one loss are promoted to their common dtype
(checks.promote_embeddings: float32 with float64 computes, and returns, float64). Where the reference misbehaves,
these functions do the safe thing (README: "Deviations from the reference"): zero vectors give finite values,
labels outside {0, 1} for the in-batch negative loss raise ValueError, fp16 norms above 256 do not overflow,
finite rows whose squared norms or dot products overflow the compute dtype are scaled by powers of two (every
backend, exact: the cosines do not change), bad input raises ValueError/TypeError, and every tau, scale and
temperature must be finite and > 0 (checks.check_scale, one rule for all). Meta tensors give meta outputs.

Matryoshka training: every loss but gist_loss takes `dims` (prefix widths d_1, ..., d_k <= D, in any order) and
`dim_weights` (default 1 each) and returns sum_i dim_weights[i] * loss(embeddings[..., :dims[i]]), the loss of
sentence-transformers' MatryoshkaLoss, computed from one read of the embeddings by the ops' nested-prefix
feature (see angle_kernels.dispatch) rather than one loss call per width.

Layer-wise (Espresso / 2D-Matryoshka) training: with `layer_weights`, every embedding argument is a stack
[L, rows, D] of L layers' embeddings (the same rows, e.g. the pooled hidden states of L layers) and the loss is
sum_l layer_weights[l] * loss(embeddings[l]) (each with its dims, weighted by layer_weights[l] * dim_weights[i]);
with dims, layer_weights may also give a row of len(dims) weights per layer (replacing dim_weights: Espresso
weights the final width of the earlier layers 0), and a term weighted 0 is not computed. The pair-score losses
(cosine, angle, triplet and the ranking terms of AngleLoss) score every layer and prefix in one op call; the
softmax losses run one op call per layer (for all of its prefixes).

Layers: each public function here checks its arguments with `angle_kernels.options` (and `checks`), resolves
the backend and calls one formula of `angle_kernels.terms` (the computing layer: `ranking_terms`,
`in_batch_negatives`, `contrastive`, `arccon`, `triplet`, `multiple_negatives`, `gist`), where each formula is
written once. `AngleLoss`, `ArcCSELoss` and the integrations check their own inputs once with `options` and
call `terms` directly. Imports go downward only: functional -> terms -> options -> checks, contract,
distributed (and functional, terms -> dispatch).
"""

from __future__ import annotations

import torch

from . import checks, terms
from .dispatch import resolve_backend
from .distributed import all_gather_with_grad, rank_and_world_size
from .options import (
    MARGIN_STRATEGIES,
    POOLING_STRATEGIES,
    Dims,
    DimWeights,
    LayerWeights,
    check_angle_dim,
    check_arccon_options,
    check_group_ids,
    check_layer_stack,
    check_multiple_negatives,
    check_nested,
    check_triplets,
    check_two_views,
    check_zigzag,
)

__all__ = [
    "cosine_loss",
    "angle_loss",
    "in_batch_negative_loss",
    "contrastive_with_negative_loss",
    "arccon_loss",
    "triplet_loss",
    "multiple_negatives_ranking_loss",
    "gist_loss",
]

# Dims, DimWeights and LayerWeights (options' type aliases of the Matryoshka and layer-wise keywords) annotate the
# public signatures below and are importable from here, where typing.get_type_hints resolves them.


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
        dims, dim_weights, layer_weights: Matryoshka and layer-wise training (see the module docstring).
        backend: "auto" (default), "torch", "triton" or "cuda".

    O(N log N) time and O(N) extra memory (the reference builds N x N matrices).
    """
    tau = checks.check_scale("tau", tau)
    layers, (first,) = check_layer_stack(layer_weights, ("y_pred", y_pred))
    labels = check_zigzag(y_true, first)
    nested = check_nested(dims, dim_weights, first.shape[1], layer_weights=layer_weights, layers=layers)
    ops = resolve_backend(backend, y_pred)
    return terms.ranking_terms(ops, terms.as_pairs(y_pred), labels[0::2], cosine_tau=tau, nested=nested)[0]


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
    that by D. The scores are ranked with the CoSENT term, as in cosine_loss.

    Args:
        y_true: [2N] or [2N, 1] labels in zigzag order.
        y_pred: [2N, D] embeddings with an even D.
        tau: scale of the score (the function's default is the reference's 1.0; AngleLoss uses 20).
        pooling_strategy: 'sum' or 'mean' ('mean' divides by each prefix's own width).
        dims, dim_weights, layer_weights: Matryoshka and layer-wise training (see the module docstring); every
            width even.
        backend: "auto" (default), "torch", "triton" or "cuda".
    """
    tau = checks.check_scale("tau", tau)
    checks.check_choice("pooling_strategy", pooling_strategy, POOLING_STRATEGIES)
    layers, (first,) = check_layer_stack(layer_weights, ("y_pred", y_pred))
    labels = check_zigzag(y_true, first)
    check_angle_dim(first.shape[1])
    nested = check_nested(dims, dim_weights, first.shape[1], even=True, layer_weights=layer_weights, layers=layers)
    ops = resolve_backend(backend, y_pred)
    return terms.ranking_terms(ops, terms.as_pairs(y_pred), labels[0::2], angle_tau=tau,
                               pooling_strategy=pooling_strategy, nested=nested)[1]


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
        dims, dim_weights, layer_weights: Matryoshka and layer-wise training (see the module docstring).
        backend: "auto" (default), "torch", "triton" or "cuda".
    """
    tau = checks.check_scale("tau", tau)
    checks.check_scalar("negative_weights", negative_weights)
    layers, (first,) = check_layer_stack(layer_weights, ("y_pred", y_pred))
    labels = check_zigzag(y_true, first)
    checks.check_binary_labels("y_true", labels, "in_batch_negative_loss")
    group_ids = check_group_ids(group_ids, first.shape[0], first)
    nested = check_nested(dims, dim_weights, first.shape[1], layer_weights=layer_weights, layers=layers)
    return terms.in_batch_negatives(resolve_backend(backend, y_pred), labels, y_pred, tau, group_ids, nested=nested)


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
        pos: [B, D] positive embeddings (pos[i] belongs to text[i]).
        neg: optional [B', D] extra negative candidates (usually one hard negative per query).
        tau: logit scale.
        dims, dim_weights, layer_weights: Matryoshka and layer-wise training (see the module docstring).
        backend: "auto" (default), "torch", "triton" or "cuda".
    """
    tau = checks.check_scale("tau", tau)
    text, pos, neg = checks.promote_embeddings(text, pos, neg)
    named = [("text", text), ("pos", pos), *((("neg", neg),) if neg is not None else ())]
    layers, first = check_layer_stack(layer_weights, *named)
    checks.check_embedding_group(*((name, t) for (name, _), t in zip(named, first)))
    checks.check_same_shape("text", first[0], "pos", first[1])
    nested = check_nested(dims, dim_weights, text.shape[-1], layer_weights=layer_weights, layers=layers)
    candidates = pos if neg is None else torch.cat((pos, neg.to(pos.dtype)), dim=-2)
    return terms.contrastive(resolve_backend(backend, text), text, candidates, tau, nested)


def arccon_loss(
    h1: torch.Tensor,
    h2: torch.Tensor,
    margin_degrees: float = 10.0,
    tau: float = 0.05,
    *,
    dims: Dims | None = None,
    dim_weights: DimWeights | None = None,
    layer_weights: LayerWeights | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """ArcCon, the additive angular margin contrastive loss of ArcCSE (Zhang et al., ACL 2022, Eq. 3).

    h1[i] and h2[i] are two views of sentence i. Row i's logits are cos(h1_i, h2_j) / tau over all j, except
    the positive j = i, whose angle is widened by the margin: cos(min(theta_ii + margin, pi)) / tau. The loss
    is the mean cross-entropy with target i. The margin's gradient is kept finite as |cos| -> 1 by
    flooring sin^2(theta) at 1e-6.

    Args:
        h1, h2: [N, D] embeddings of the two views.
        margin_degrees: the additive angular margin, in DEGREES (10 in the paper), between 0 and 180.
        tau: temperature (> 0).
        dims, dim_weights, layer_weights: Matryoshka and layer-wise training (see the module docstring).
        backend: "auto" (default), "torch", "triton" or "cuda".
    """
    margin, tau = check_arccon_options(margin_degrees, tau)
    h1, h2 = checks.promote_embeddings(h1, h2)
    layers, first = check_layer_stack(layer_weights, ("h1", h1), ("h2", h2))
    check_two_views(*first)
    nested = check_nested(dims, dim_weights, h1.shape[-1], layer_weights=layer_weights, layers=layers)
    return terms.arccon(resolve_backend(backend, h1), h1, h2, margin, tau, nested)


def triplet_loss(
    anchor: torch.Tensor,
    weak: torch.Tensor,
    strong: torch.Tensor,
    margin: float = 0.0,
    *,
    dims: Dims | None = None,
    dim_weights: DimWeights | None = None,
    layer_weights: LayerWeights | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """ArcCSE's triplet loss (Eq. 4): mean over triplets of max(0, cos(anchor, strong) - cos(anchor, weak) + margin).

    `weak` is the lightly masked view (20% of tokens masked), `strong` the heavily masked one (40%): the anchor
    should stay closer to the weak view. ArcCSE adds it to ArcCon with weight 0.1.

    Args:
        anchor, weak, strong: [N, D] embeddings.
        margin: additive margin on the cosine difference.
        dims, dim_weights, layer_weights: Matryoshka and layer-wise training (see the module docstring).
        backend: "auto" (default), "torch", "triton" or "cuda".
    """
    margin = checks.check_scalar("margin", margin)
    anchor, weak, strong = checks.promote_embeddings(anchor, weak, strong)
    layers, first = check_layer_stack(layer_weights, ("anchor", anchor), ("weak", weak), ("strong", strong))
    check_triplets(*first)
    nested = check_nested(dims, dim_weights, anchor.shape[-1], layer_weights=layer_weights, layers=layers)
    return terms.triplet(resolve_backend(backend, anchor), anchor, weak, strong, margin, nested)


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
    """InfoNCE with in-batch negatives, every option of sentence-transformers 6.2's MultipleNegativesRankingLoss
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
    "all_negatives" (every column but the positive), as sentence-transformers defines them.
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
    dims, dim_weights: Matryoshka (see the module docstring). The standard and symmetric losses compute every
    prefix in one pass; the other options (joint partitions, hardness, the filter, dot products) one pass per
    prefix for now.

    Args:
        queries, positives: [B, D]; negatives: any number of [B, D] tensors (hard-negative columns).
        backend: "auto" (default), "torch", "triton" or "cuda".
    """
    call = check_multiple_negatives(
        queries, positives, negatives, scale=scale, directions=directions, partition_mode=partition_mode,
        hardness_mode=hardness_mode, hardness_strength=hardness_strength, false_negative_margin=false_negative_margin,
        false_negative_strategy=false_negative_strategy, similarity=similarity,
        gather_across_devices=gather_across_devices, dims=dims, dim_weights=dim_weights, layer_weights=layer_weights)
    return terms.multiple_negatives(resolve_backend(backend, call.queries), *call)


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
    gather_across_devices: bool = False,
    backend: str | None = None,
) -> torch.Tensor:
    """GISTEmbed (Solatorio, 2024) as sentence-transformers 6.2's GISTEmbedLoss computes it: InfoNCE whose
    in-batch negatives are filtered by a guide model, without any B x B score matrix.

    Row i's logits (cos / temperature) are anchor i against every positive (its own, column i, is the target),
    plus, with contrast_anchors, against every anchor, with contrast_positives, positive i against every
    positive, and anchor i against each negative column. A column leaves row i's partition function when its
    guide similarity exceeds the guide's anchor-positive similarity g_i minus the margin ("absolute": g_i -
    margin; "relative": g_i - |g_i| * margin); the target column always stays. The guide's embeddings
    (guide_anchors, guide_positives, guide_negatives: same rows, any width) carry no gradient.
    gather_across_devices: with torch.distributed initialised, the positives and negatives (and their guide
    embeddings) come from every rank; the anchors stay local, as in sentence-transformers.

    Args:
        anchors, positives: [B, D]; negatives: [B, D] tensors (hard-negative columns), one guide tensor each.
        backend: "auto" (default), "torch", "triton" or "cuda".
    """
    temperature = checks.check_scale("temperature", temperature)
    margin = checks.check_scalar("margin", margin)
    checks.check_choice("margin_strategy", margin_strategy, MARGIN_STRATEGIES)
    for name, value in (("contrast_anchors", contrast_anchors), ("contrast_positives", contrast_positives),
                        ("gather_across_devices", gather_across_devices)):
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    negatives = checks.check_columns("negatives", negatives)
    guide_negatives = checks.check_columns("guide_negatives", guide_negatives)
    anchors, positives, *negatives = checks.promote_embeddings(anchors, positives, *negatives)
    guide_anchors, guide_positives, *guide_negatives = checks.promote_embeddings(guide_anchors, guide_positives,
                                                                                 *guide_negatives)
    if len(negatives) != len(guide_negatives):
        raise ValueError(f"every negative column needs its guide embeddings: {len(negatives)} negatives, "
                         f"{len(guide_negatives)} guide_negatives")
    named = [("positives", positives), *((f"negatives[{i}]", t) for i, t in enumerate(negatives))]
    guide_named = [("guide_positives", guide_positives),
                   *((f"guide_negatives[{i}]", t) for i, t in enumerate(guide_negatives))]
    rank, world_size = rank_and_world_size()
    gathered = None
    if gather_across_devices and world_size > 1:
        model_side = [all_gather_with_grad(t) for _, t in named]
        with torch.no_grad():
            guide_side = [all_gather_with_grad(t) for _, t in guide_named]
        checks.check_embedding_group(("anchors", anchors), *((n, t) for (n, _), t in zip(named, model_side)))
        checks.check_embedding_group(("guide_anchors", guide_anchors),
                                     *((n, t) for (n, _), t in zip(guide_named, guide_side)))
        gathered = (rank, model_side[0], model_side[1:], guide_side[0], guide_side[1:])
    else:
        checks.check_embedding_group(("anchors", anchors), *named)
        checks.check_embedding_group(("guide_anchors", guide_anchors), *guide_named)
    for name, t in named:
        checks.check_same_shape("anchors", anchors, name, t)
    for name, t in guide_named:
        checks.check_same_shape("guide_anchors", guide_anchors, name, t)
    if guide_anchors.shape[0] != anchors.shape[0]:
        raise ValueError(f"guide_anchors must have the anchors' {anchors.shape[0]} rows, got {guide_anchors.shape[0]}")
    return terms.gist(resolve_backend(backend, anchors), anchors, positives, negatives, guide_anchors.detach(),
                      guide_positives.detach(), [t.detach() for t in guide_negatives], temperature, margin_strategy,
                      margin, contrast_anchors, contrast_positives, gathered)
