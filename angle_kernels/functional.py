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

Each loss is two halves, and each formula is written once, in its computing half:
    * the public function checks its arguments (`checks`, `check_zigzag`), resolves the backend, and calls
    * the computing half (`ranking_terms`, `in_batch_negatives`, `contrastive`, `arccon`, `triplet`,
      `multiple_negatives`, `gist`), which
      takes checked inputs and a `dispatch.Ops`. `AngleLoss`, `ArcCSELoss` and the integrations check their
      own inputs once and call these halves directly.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Union

import torch

from . import checks
from .contract import check_dims, compute_dtype
from .dispatch import Ops, resolve_backend
from .distributed import all_gather_with_grad, rank_and_world_size

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

POOLING_STRATEGIES = ("sum", "mean")

# The types of the Matryoshka and layer-wise keywords of every loss (see the module docstring), named for the
# annotations: dims, the prefix widths, a tuple or list of ints (another sequence, e.g. a range, raises
# TypeError); dim_weights, one real number per dim; layer_weights, one real number per layer of the stack or, with
# dims, one row of weights per layer (one per dim), or a tensor holding either.
Dims = Union[tuple[int, ...], list[int]]
DimWeights = Sequence[float]
LayerWeights = Union[Sequence[float], Sequence[Sequence[float]], torch.Tensor]


# ------------------------------------------------------------------------------------------------------------
# Checking halves: what the public losses (and the front ends built on the computing halves) check
# ------------------------------------------------------------------------------------------------------------
def check_zigzag(
    y_true: torch.Tensor, y_pred: torch.Tensor, names: tuple[str, str] = ("y_true", "y_pred")
) -> torch.Tensor:
    """Check a zigzag batch (structure and device first, values last) and return its labels, one per row [2N].

    names: what the caller calls (y_true, y_pred), for the error messages (AngleLoss: labels, outputs)."""
    checks.check_embeddings(
        names[1], y_pred, rows_multiple_of=2, layout="zigzag pairs on rows 2k and 2k+1", check_values=False
    )
    labels = checks.check_labels(names[0], y_true, y_pred.shape[0], y_pred.device)
    checks.check_finite(names[1], y_pred)
    return labels


def check_angle_dim(dim: int, name: str = "y_pred") -> None:
    if dim % 2:
        raise ValueError(
            f"angle_loss splits each embedding into real and imaginary halves, so {name} needs an even number of "
            f"columns; got {dim}"
        )


def check_group_ids(group_ids: torch.Tensor | None, rows: int, y_pred: torch.Tensor) -> torch.Tensor | None:
    """Optional text ids of the rows, one per row of y_pred: returned as int64."""
    if group_ids is None:
        return None
    if not isinstance(group_ids, torch.Tensor) or group_ids.is_floating_point() or group_ids.is_complex():
        raise TypeError("group_ids must be an integer torch.Tensor of text ids, one per row of y_pred")
    if tuple(group_ids.shape) != (rows,):
        raise ValueError(f"group_ids must have shape [{rows}] (one id per row of y_pred), got {tuple(group_ids.shape)}")
    checks.check_same_device(("y_pred", y_pred), ("group_ids", group_ids))
    return group_ids.long()


def check_arccon_options(margin_degrees: float, tau: float) -> tuple[float, float]:
    """ArcCon's margin (degrees, 0..180) and temperature (> 0), returned as (margin in radians, tau)."""
    margin = checks.check_scalar("margin_degrees", margin_degrees)
    if not 0.0 <= margin <= 180.0:
        raise ValueError(f"margin_degrees must be between 0 and 180 degrees, got {margin}")
    return math.radians(margin), checks.check_scale("tau", tau)


def check_two_views(h1: torch.Tensor, h2: torch.Tensor) -> None:
    checks.check_embedding_group(("h1", h1), ("h2", h2))
    checks.check_same_shape("h1", h1, "h2", h2)


def check_triplets(anchor: torch.Tensor, weak: torch.Tensor, strong: torch.Tensor) -> None:
    checks.check_embedding_group(("anchor", anchor), ("weak", weak), ("strong", strong))
    checks.check_same_shape("anchor", anchor, "weak", weak)
    checks.check_same_shape("anchor", anchor, "strong", strong)


@dataclass(frozen=True)
class Nested:
    """Matryoshka and layer-wise (Espresso) training: the loss on every prefix x[..., :d] of the embeddings (dims;
    None: the full width only), of every layer of a stack [L, rows, D] when `stacked`, weighted and summed:
    sum over (l, i) of table[l][i] * loss(x[l, ..., :dims[i]]), as sentence-transformers' MatryoshkaLoss (one
    layer) and Matryoshka2dLoss / AdaptiveLayerLoss (the layers' weights times the prefixes') do. dims ascend: the
    ops' contract; each row of the table follows them. Unstacked inputs have a one-row table."""

    dims: tuple[int, ...] | None
    table: tuple[tuple[float, ...], ...]  # [L][k]: L = 1 unstacked, k = 1 without dims
    stacked: bool = False

    @property
    def weights(self) -> tuple[float, ...]:
        """The prefixes' weights of unstacked inputs."""
        return self.table[0]

    def combine(self, per_prefix: torch.Tensor) -> torch.Tensor:
        """sum_i weights[i] * per_prefix[i] for the [k] losses of the prefixes of unstacked inputs (a 0-dim loss
        of the full width times its weight)."""
        weights = torch.tensor(self.weights, dtype=per_prefix.dtype, device=per_prefix.device)
        return per_prefix @ weights if per_prefix.dim() else per_prefix * weights[0]

    def terms(self) -> list[tuple[int, int, float]]:
        """(layer l, prefix i, weight) of every term with a non-zero weight: only those are computed (Espresso
        weights the final width of the earlier layers 0)."""
        return [(layer, i, weight) for layer, row in enumerate(self.table) for i, weight in enumerate(row) if weight]

    def weighted_sum(self, term: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
        """sum over self.terms() of weight * term(l, i)."""
        total = None
        for layer, i, weight in self.terms():
            total = weight * term(layer, i) if total is None else total + weight * term(layer, i)
        return total

    def over_layers(self, loss_of_layer: Callable[[int, Nested | None], torch.Tensor]) -> torch.Tensor:
        """A stack's loss from a loss of one layer: sum over the layers l of loss_of_layer(l, nested_l), nested_l
        the unstacked Nested of layer l's non-zero weights (None when the layer's only term is its full width,
        whose weight then multiplies the loss)."""
        total = None
        for layer, row in enumerate(self.table):
            if self.dims is None:
                value = row[0] * loss_of_layer(layer, None) if row[0] != 0 else None
            else:
                keep = [i for i, weight in enumerate(row) if weight != 0]
                value = loss_of_layer(layer, Nested(tuple(self.dims[i] for i in keep), (tuple(row[i] for i in keep),)))\
                    if keep else None
            if value is not None:
                total = value if total is None else total + value
        return total


def check_nested(dims: Dims | None, dim_weights: DimWeights | None, width: int, even: bool = False, *,
                 layer_weights: LayerWeights | None = None, layers: int | None = None) -> Nested | None:
    """dims: None (the plain loss) or distinct prefix widths <= width in any order (sentence-transformers users
    list them largest first); dim_weights: None (all 1) or one finite number per dim, in dims' order. even: the
    angle score needs even widths. Returned sorted ascending, the weights permuted alike.

    layer_weights / layers: a stack of `layers` layers' embeddings [L, rows, D] (check_layer_stack gives L) and
    its weights: one number per layer (times the prefixes' dim_weights), or, with dims, one row of len(dims)
    numbers per layer (in dims' order; they replace dim_weights, which must then be None). At least one weight
    is non-zero."""
    if layer_weights is None:
        if dims is None:
            if dim_weights is not None:
                raise ValueError("dim_weights needs dims (the prefix widths they weight)")
            return None
        dims, weights = _checked_prefixes(dims, dim_weights)
        order = sorted(range(len(dims)), key=dims.__getitem__)
        return Nested(check_dims(tuple(dims[i] for i in order), width, even), (tuple(weights[i] for i in order),))
    if not isinstance(layer_weights, (tuple, list, torch.Tensor)) or len(layer_weights) != layers:
        raise ValueError(f"layer_weights must have one entry per layer of the stack ({layers}), got {layer_weights!r}")
    layer_weights = layer_weights.tolist() if isinstance(layer_weights, torch.Tensor) else list(layer_weights)
    rows_given = any(isinstance(row, (tuple, list)) for row in layer_weights)
    if rows_given and (dims is None or dim_weights is not None):
        raise ValueError("layer_weights given as rows (one weight per layer and dim) need dims and replace "
                         "dim_weights (leave it None)")
    if dims is None:
        table = [[checks.check_scalar(f"layer_weights[{layer}]", w)] for layer, w in enumerate(layer_weights)]
        order = [0]
    else:
        dims, dim_weights = _checked_prefixes(dims, None if rows_given else dim_weights)
        table = []
        for layer, row in enumerate(layer_weights):
            if rows_given:
                if not isinstance(row, (tuple, list)) or len(row) != len(dims):
                    raise ValueError(f"layer_weights[{layer}] must have one weight per dim ({len(dims)}), got {row!r}")
                table.append([checks.check_scalar(f"layer_weights[{layer}][{i}]", w) for i, w in enumerate(row)])
            else:
                scale = checks.check_scalar(f"layer_weights[{layer}]", row)
                table.append([scale * w for w in dim_weights])
        order = sorted(range(len(dims)), key=dims.__getitem__)
        dims = check_dims(tuple(dims[i] for i in order), width, even)
    if not any(w != 0 for row in table for w in row):
        raise ValueError("layer_weights: every (layer, dim) weight is 0, which leaves no loss to compute")
    return Nested(dims, tuple(tuple(row[i] for i in order) for row in table), stacked=True)


def _checked_prefixes(dims: Dims, dim_weights: DimWeights | None) -> tuple[list[int], list[float]]:
    """dims as a list of distinct Python ints and their weights (1 each when dim_weights is None), in the order
    given; the widths' range is check_dims'."""
    if not isinstance(dims, (tuple, list)) or not dims:
        raise TypeError(f"dims must be None or a non-empty sequence of ints, got {dims!r}")
    weights = [1.0] * len(dims) if dim_weights is None else list(dim_weights)
    if len(weights) != len(dims):
        raise ValueError(f"dim_weights must have one weight per dim: {len(dims)} dims, {len(weights)} weights")
    weights = [checks.check_scalar(f"dim_weights[{i}]", w) for i, w in enumerate(weights)]
    for i, d in enumerate(dims):
        if isinstance(d, bool) or not isinstance(d, int):
            raise TypeError(f"dims[{i}] must be a Python int, got {type(d).__name__}")
    if len(set(dims)) != len(dims):
        raise ValueError(f"dims must be distinct, got {tuple(dims)}")
    return list(dims), weights


def check_layer_stack(layer_weights: LayerWeights | None,
                      *named: tuple[str, torch.Tensor]) -> tuple[int | None, list[torch.Tensor]]:
    """Layer-wise inputs: with layer_weights None, (None, the tensors) unchanged. Otherwise every tensor must be a
    stack [L, rows, D] of L layers' embeddings (the same L): the values of layers 1.. are checked here and
    (L, the first layers) returned, for the caller's usual checks of a single layer's embeddings."""
    tensors = [t for _, t in named]
    if layer_weights is None:
        return None, tensors
    layers = None
    for name, t in named:
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: with layer_weights, embeddings are a stack [L, rows, D] of the layers' "
                             f"embeddings; got {shape}")
        if layers is None:
            layers = t.shape[0]
        if t.shape[0] != layers or layers == 0:
            raise ValueError(f"{name}: every stack needs the same number L >= 1 of layers ({layers}), got "
                             f"{t.shape[0]}")
    for name, t in named:
        checks.check_finite(name, t[1:])
    return layers, [t[0] for t in tensors]


def espresso_layer_weights(n_layers: int, compression_size: int,
                           width: int) -> tuple[tuple[int, ...], list[list[float]]]:
    """(dims, layer_weights rows) of Espresso (ESE) as angle-emb 0.6.1's AngleESETrainer weighs it, for a stack of
    n_layers pooled layers (hidden states 0 .. n_layers - 2, the last hidden state last): the last layer weighs
    1 at the compressed width and 1 at the full width; earlier layer i weighs 1 / (1 + ln(1 + i)) / (n_layers - 1)
    at the compressed width (the reference's per-layer loss, averaged over the earlier layers) and 0 at the full
    width. A compression size >= width keeps the whole width (the reference's slice is then the full embedding,
    so the last layer's loss counts twice)."""
    if isinstance(n_layers, bool) or not isinstance(n_layers, int) or n_layers < 2:
        raise ValueError(f"n_layers: Espresso needs a model of at least 2 layers, got {n_layers!r}")
    if isinstance(compression_size, bool) or not isinstance(compression_size, int) or compression_size < 1:
        raise ValueError(f"compression_size must be a positive int, got {compression_size!r}")
    earlier = [1.0 / (1.0 + math.log(1 + i)) / (n_layers - 1) for i in range(n_layers - 1)]
    if compression_size >= width:
        return (width,), [[w] for w in earlier] + [[2.0]]
    return (compression_size, width), [[w, 0.0] for w in earlier] + [[1.0, 1.0]]


# ------------------------------------------------------------------------------------------------------------
# Computing halves: each formula once, on checked inputs, with the ops of a resolved backend
# ------------------------------------------------------------------------------------------------------------
DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
PARTITION_MODES = ("joint", "per_direction")
# sentence-transformers' hardness modes -> the columns of the query-to-document block similarity_lse penalises
HARDNESS_MODES = {"in_batch_negatives": "other", "hard_negatives": "own", "all_negatives": "all"}
MARGIN_STRATEGIES = ("absolute", "relative")
# the similarity of the in-batch family's logits: "cosine" (util.cos_sim) or the raw dot product (util.dot_score)
SIMILARITIES = ("cosine", "dot")
# AngleLoss's in-batch-negative partitions -> the directions of multiple_negatives in one softmax per query:
# AnglE's query -> documents, or GTE's improved contrastive loss
IBN_PARTITIONS = {"angle": ("query_to_doc",), "gte": DIRECTIONS}


def check_in_batch_options(directions: tuple[str, ...] | list[str], partition_mode: str, hardness_mode: str | None,
                           hardness_strength: float, false_negative_margin: float | None,
                           false_negative_strategy: str,
                           similarity: str = "cosine") -> tuple[tuple[str, ...], float, float | None]:
    """The options of multiple_negatives_ranking_loss as sentence-transformers 6.2 checks them, plus the
    false-negative filter's; returned normalised (directions a tuple, floats)."""
    directions = tuple(directions) if isinstance(directions, (tuple, list)) else directions
    if not isinstance(directions, tuple) or not directions or not set(directions) <= set(DIRECTIONS):
        raise ValueError(f"directions must be a non-empty tuple of {DIRECTIONS}, got {directions!r}")
    if "query_to_doc" not in directions:
        raise ValueError("directions must include 'query_to_doc' (it holds the positive pair)")
    checks.check_choice("partition_mode", partition_mode, PARTITION_MODES)
    if partition_mode == "per_direction" and set(directions) & {"query_to_query", "doc_to_doc"}:
        raise ValueError("partition_mode='per_direction' needs every direction to contain the positive pair: "
                         "'query_to_query' and 'doc_to_doc' do not; use partition_mode='joint'")
    if hardness_mode is not None:
        checks.check_choice("hardness_mode", hardness_mode, tuple(HARDNESS_MODES))
    hardness_strength = checks.check_scalar("hardness_strength", hardness_strength)
    if hardness_strength < 0:
        raise ValueError(f"hardness_strength must be >= 0, got {hardness_strength}")
    checks.check_choice("similarity", similarity, SIMILARITIES)
    return directions, hardness_strength, check_false_negative_filter(false_negative_margin, false_negative_strategy)


def check_false_negative_filter(false_negative_margin: float | None,
                                false_negative_strategy: str) -> float | None:
    """The positive-aware false-negative filter's options (multiple_negatives_ranking_loss, AngleLoss): the margin,
    None (off) or a finite real returned as a float, and its strategy."""
    if false_negative_margin is not None:
        false_negative_margin = checks.check_scalar("false_negative_margin", false_negative_margin)
    checks.check_choice("false_negative_strategy", false_negative_strategy, MARGIN_STRATEGIES)
    return false_negative_margin


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


def positive_scores(ops: Ops, a: torch.Tensor, b: torch.Tensor, similarity: str = "cosine") -> torch.Tensor:
    """s(a_i, b_i) per row in the compute dtype: the cosine (one pair-score pass) or the dot product."""
    if similarity == "cosine":
        return ops.pair_scores(torch.stack((a, b.to(a.dtype)), dim=1), False)[0][:, 0]
    dtype = compute_dtype(a.dtype)
    return torch.linalg.vecdot(a.to(dtype), b.to(dtype))


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
    (similarity="dot"), which similarity_xent does not compute. nested: the first path computes every prefix
    in one pass of the op; the second runs once per prefix on the truncated embeddings (similarity_lse has no
    dims yet).
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

    def truncated(d):  # similarity_lse has no dims yet: one pass per prefix
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
                            gathered: tuple | None = None, similarity: str = "cosine") -> torch.Tensor:
    """The loss of each query [B] of multiple_negatives (same arguments), from per-row log partitions of
    similarity_lse blocks and the positive scores: log_partition_i - scale * s(queries_i, positives_i)."""
    rank, all_queries, all_positives, all_negatives = gathered or (0, queries, positives, negatives)
    negative_columns = [t.to(positives.dtype) for t in all_negatives]
    offset, world_rows = rank * queries.shape[0], all_queries.shape[0]
    documents = torch.cat([all_positives, *negative_columns])  # row i's positive: column offset + i
    positive = positive_scores(ops, queries, positives, similarity)
    threshold = None
    if false_negative_margin is not None:
        threshold = margin_threshold(positive, false_negative_strategy, false_negative_margin)

    def block(anchors, columns, **options):
        filtering = {} if threshold is None else dict(filter_q=anchors.detach(), filter_c=columns.detach(),
                                                      filter_threshold=threshold, filter_keeps_target=True)
        return ops.similarity_lse(anchors, columns.to(anchors.dtype), scale, target_offset=offset, **options,
                                  **filtering, normalize=similarity == "cosine")

    hard = hardness_mode is not None and hardness_strength > 0.0
    penalty = dict(penalty=hardness_strength, penalty_on=HARDNESS_MODES[hardness_mode]) if hard else {}
    log_partitions = [block(queries, documents, period=world_rows, **penalty)]  # query_to_doc
    if "query_to_query" in directions:
        log_partitions.append(block(queries, all_queries, exclude="target"))
    if "doc_to_query" in directions:
        log_partitions.append(block(positives, all_queries))
    if "doc_to_doc" in directions:
        log_partitions.append(block(positives, documents, period=world_rows, exclude="own"))
    stacked = torch.stack(log_partitions)
    log_z = torch.logsumexp(stacked, dim=0) if partition_mode == "joint" else stacked.mean(dim=0)
    return log_z - scale * positive


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


# ------------------------------------------------------------------------------------------------------------
# The public losses: check, resolve the backend, compute
# ------------------------------------------------------------------------------------------------------------
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
    return ranking_terms(ops, as_pairs(y_pred), labels[0::2], cosine_tau=tau, nested=nested)[0]


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
    return ranking_terms(ops, as_pairs(y_pred), labels[0::2], angle_tau=tau, pooling_strategy=pooling_strategy,
                         nested=nested)[1]


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
    return in_batch_negatives(resolve_backend(backend, y_pred), labels, y_pred, tau, group_ids, nested=nested)


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
    return contrastive(resolve_backend(backend, text), text, candidates, tau, nested)


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
    return arccon(resolve_backend(backend, h1), h1, h2, margin, tau, nested)


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
    return triplet(resolve_backend(backend, anchor), anchor, weak, strong, margin, nested)


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
    scale = checks.check_scale("scale", scale)
    queries, positives, *negatives = checks.promote_embeddings(queries, positives, *negatives)
    directions, hardness_strength, false_negative_margin = check_in_batch_options(
        directions, partition_mode, hardness_mode, hardness_strength, false_negative_margin, false_negative_strategy,
        similarity)
    if not isinstance(gather_across_devices, bool):
        raise TypeError(f"gather_across_devices must be a bool, got {type(gather_across_devices).__name__}")
    named = [("queries", queries), ("positives", positives)]
    named += [(f"negatives[{i}]", t) for i, t in enumerate(negatives)]
    layers, first = check_layer_stack(layer_weights, *named)
    if layers is not None:
        if gather_across_devices:
            raise ValueError("stacked layers (layer_weights) do not combine with gather_across_devices yet")
        named = [(name, t) for (name, _), t in zip(named, first)]
    rank, world_size = rank_and_world_size()
    gathered = None
    if gather_across_devices and world_size > 1:
        # Checked after gathering: every rank sees the same values, so a NaN on one rank makes all of them
        # raise (rather than one raising and the others waiting in the next collective).
        everything = [all_gather_with_grad(t) for _, t in named]
        checks.check_embedding_group(*((name, t) for (name, _), t in zip(named, everything)))
        gathered = (rank, everything[0], everything[1], everything[2:])
    else:
        checks.check_embedding_group(*named)
    for name, t in named[1:]:
        checks.check_same_shape("queries", named[0][1], name, t)
    nested = check_nested(dims, dim_weights, queries.shape[-1], layer_weights=layer_weights, layers=layers)
    return multiple_negatives(resolve_backend(backend, queries), queries, positives, list(negatives), scale,
                              directions, partition_mode, hardness_mode, hardness_strength, false_negative_margin,
                              false_negative_strategy, gathered, similarity, nested)


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
    return gist(resolve_backend(backend, anchors), anchors, positives, negatives, guide_anchors.detach(),
                guide_positives.detach(), [t.detach() for t in guide_negatives], temperature, margin_strategy, margin,
                contrast_anchors, contrast_positives, gathered)
