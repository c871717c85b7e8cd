"""The losses, as functions: drop-in replacements for `angle_emb.loss` (angle-emb 0.6.1) plus ArcCSE's.

Names, arguments, defaults and the zigzag layout are the reference's: `y_pred` is [2N, D] with the two texts
of pair k on rows 2k and 2k+1, and `y_true` is [2N] or [2N, 1] with the pair's label on both rows. Each loss
is assembled from the three ops described in `angle_kernels.dispatch`, computed by the backend chosen with
the keyword-only `backend` argument ("auto", "torch", "triton", "cuda"; default: the environment variable
ANGLE_KERNELS_BACKEND, else "auto"). No loss materialises an N x N matrix.

Every loss returns a 0-dim tensor: float64 for float64 inputs, float32 otherwise (bfloat16/float16 inputs are
accumulated in float32). Where the reference misbehaves, these functions do the safe thing (README:
"Deviations from the reference"): zero vectors give finite values, labels outside {0, 1} for the in-batch
negative loss raise ValueError, fp16 norms above 256 do not overflow, bad input raises ValueError/TypeError.

Each loss is two halves, and each formula is written once, in its computing half:
    * the public function checks its arguments (`checks`, `check_zigzag`), resolves the backend, and calls
    * the computing half (`ranking_terms`, `in_batch_negatives`, `contrastive`, `arccon`, `triplet`), which
      takes checked inputs and a `dispatch.Ops`. `AngleLoss`, `ArcCSELoss` and the integrations check their
      own inputs once and call these halves directly.
"""

from __future__ import annotations

import math

import torch

from . import checks
from .contract import compute_dtype
from .dispatch import Ops, resolve_backend

__all__ = [
    "cosine_loss",
    "angle_loss",
    "in_batch_negative_loss",
    "contrastive_with_negative_loss",
    "arccon_loss",
    "triplet_loss",
]

POOLING_STRATEGIES = ("sum", "mean")


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


def check_group_ids(group_ids, rows: int, y_pred: torch.Tensor) -> torch.Tensor | None:
    """Optional text ids of the rows, one per row of y_pred: returned as int64."""
    if group_ids is None:
        return None
    if not isinstance(group_ids, torch.Tensor) or group_ids.is_floating_point() or group_ids.is_complex():
        raise TypeError("group_ids must be an integer torch.Tensor of text ids, one per row of y_pred")
    if tuple(group_ids.shape) != (rows,):
        raise ValueError(f"group_ids must have shape [{rows}] (one id per row of y_pred), got {tuple(group_ids.shape)}")
    checks.check_same_device(("y_pred", y_pred), ("group_ids", group_ids))
    return group_ids.long()


def check_arccon_options(margin_degrees, tau) -> tuple[float, float]:
    """ArcCon's margin (degrees, 0..180) and temperature (> 0), returned as (margin in radians, tau)."""
    margin = checks.check_scalar("margin_degrees", margin_degrees)
    if not 0.0 <= margin <= 180.0:
        raise ValueError(f"margin_degrees must be between 0 and 180 degrees, got {margin}")
    return math.radians(margin), checks.check_scalar("tau", tau, positive=True)


def check_two_views(h1, h2) -> None:
    checks.check_embedding_group(("h1", h1), ("h2", h2))
    checks.check_same_shape("h1", h1, "h2", h2)


def check_triplets(anchor, weak, strong) -> None:
    checks.check_embedding_group(("anchor", anchor), ("weak", weak), ("strong", strong))
    checks.check_same_shape("anchor", anchor, "weak", weak)
    checks.check_same_shape("anchor", anchor, "strong", strong)


# ------------------------------------------------------------------------------------------------------------
# Computing halves: each formula once, on checked inputs, with the ops of a resolved backend
# ------------------------------------------------------------------------------------------------------------
def as_pairs(y_pred: torch.Tensor) -> torch.Tensor:
    """The zigzag rows [2N, D] as pairs [N, 2, D] (a view when y_pred is contiguous)."""
    rows, dim = y_pred.shape
    return y_pred.reshape(rows // 2, 2, dim)


def ranking_terms(
    ops: Ops,
    groups: torch.Tensor,
    labels: torch.Tensor,
    *,
    cosine_tau: float | None = None,
    angle_tau: float | None = None,
    pooling_strategy: str = "sum",
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The CoSENT ranking term of the cosine scores and of the angle scores, from one pair-score pass.

    groups: [G, K, D]; pair (g, k) is (groups[g, 0], groups[g, k]) and labels ([(K-1) * G]) are ordered
    pair-major: all pairs k = 1 first, then k = 2, ... (zigzag batches: K = 2, one label per pair). A term is
    computed when its tau is given, else returned as None. The angle score is tau * |pool(angle)|, with
    'mean' pooling dividing the sum-pooled score by D (the reference's complex division, see dispatch).
    """
    with_angle = angle_tau is not None
    cos, angle = ops.pair_scores(groups, with_angle)
    cosine_term = angle_term = None
    if cosine_tau is not None:
        cosine_term = ops.ranking_loss(cosine_tau * cos.T.reshape(-1), labels)
    if with_angle:
        pooled = angle.T.reshape(-1)
        if pooling_strategy == "mean":
            pooled = pooled / groups.shape[2]
        angle_term = ops.ranking_loss(angle_tau * pooled.abs(), labels)
    return cosine_term, angle_term


def in_batch_negatives(
    ops: Ops, labels: torch.Tensor, y_pred: torch.Tensor, tau: float, group_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """in_batch_negative_loss on checked inputs (labels: 0/1, one per row; group_ids: int64 or None)."""
    positive = labels == 1
    # The reference gives row i a target only when both it and its partner are labelled 1.
    row_weights = (positive & positive.view(-1, 2).flip(1).reshape(-1)).to(compute_dtype(y_pred.dtype))
    return ops.similarity_xent(
        y_pred, None, tau, "partner", row_weights=row_weights, exclude_diagonal=True, group_ids=group_ids
    )


def contrastive(ops: Ops, queries: torch.Tensor, candidates: torch.Tensor, tau: float) -> torch.Tensor:
    """Mean cross-entropy of query i among the candidates (logits tau * cos), target candidates[i]."""
    return ops.similarity_xent(queries, candidates.to(queries.dtype), tau, "diagonal")


def arccon(ops: Ops, h1: torch.Tensor, h2: torch.Tensor, margin: float, tau: float) -> torch.Tensor:
    """ArcCon on checked views; margin in radians."""
    return ops.similarity_xent(h1, h2.to(h1.dtype), 1.0 / tau, "diagonal", margin=margin)


def triplet(ops: Ops, anchor: torch.Tensor, weak: torch.Tensor, strong: torch.Tensor, margin: float) -> torch.Tensor:
    """mean(max(0, cos(anchor, strong) - cos(anchor, weak) + margin)) on checked triplets, one pair-score pass."""
    cos, _ = ops.pair_scores(torch.stack((anchor, weak.to(anchor.dtype), strong.to(anchor.dtype)), dim=1), False)
    return torch.relu(cos[:, 1] - cos[:, 0] + margin).mean()


# ------------------------------------------------------------------------------------------------------------
# The public losses: check, resolve the backend, compute
# ------------------------------------------------------------------------------------------------------------
def cosine_loss(y_true: torch.Tensor, y_pred: torch.Tensor, tau: float = 20.0, *, backend: str | None = None) -> torch.Tensor:
    """CoSENT: rank pairs by cosine similarity (AnglE paper, Eq. 1).

    loss = log(1 + sum over pairs (i, j) with label_i < label_j of exp(tau * (cos_i - cos_j)))

    Args:
        y_true: [2N] or [2N, 1] labels in zigzag order (any real values; only their order matters; ties add
            nothing).
        y_pred: [2N, D] embeddings, pair k on rows 2k and 2k+1.
        tau: scale of the cosine (20 in the paper).
        backend: "auto" (default), "torch", "triton" or "cuda".

    O(N log N) time and O(N) extra memory (the reference builds N x N matrices).
    """
    tau = checks.check_scalar("tau", tau)
    labels = check_zigzag(y_true, y_pred)
    ops = resolve_backend(backend, y_pred)
    return ranking_terms(ops, as_pairs(y_pred), labels[0::2], cosine_tau=tau)[0]


def angle_loss(
    y_true: torch.Tensor,
    y_pred: torch.Tensor,
    tau: float = 1.0,
    pooling_strategy: str = "sum",
    *,
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
        pooling_strategy: 'sum' or 'mean'.
        backend: "auto" (default), "torch", "triton" or "cuda".
    """
    tau = checks.check_scalar("tau", tau)
    checks.check_choice("pooling_strategy", pooling_strategy, POOLING_STRATEGIES)
    labels = check_zigzag(y_true, y_pred)
    check_angle_dim(y_pred.shape[1])
    ops = resolve_backend(backend, y_pred)
    return ranking_terms(ops, as_pairs(y_pred), labels[0::2], angle_tau=tau, pooling_strategy=pooling_strategy)[1]


def in_batch_negative_loss(
    y_true: torch.Tensor,
    y_pred: torch.Tensor,
    tau: float = 20.0,
    negative_weights: float = 0.0,
    *,
    group_ids: torch.Tensor | None = None,
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
        backend: "auto" (default), "torch", "triton" or "cuda".
    """
    tau = checks.check_scalar("tau", tau)
    checks.check_scalar("negative_weights", negative_weights)
    labels = check_zigzag(y_true, y_pred)
    checks.check_binary_labels("y_true", labels, "in_batch_negative_loss")
    group_ids = check_group_ids(group_ids, y_pred.shape[0], y_pred)
    return in_batch_negatives(resolve_backend(backend, y_pred), labels, y_pred, tau, group_ids)


def contrastive_with_negative_loss(
    text: torch.Tensor,
    pos: torch.Tensor,
    neg: torch.Tensor | None = None,
    tau: float = 20.0,
    *,
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
        backend: "auto" (default), "torch", "triton" or "cuda".
    """
    tau = checks.check_scalar("tau", tau)
    checks.check_embedding_group(("text", text), ("pos", pos), *((("neg", neg),) if neg is not None else ()))
    checks.check_same_shape("text", text, "pos", pos)
    candidates = pos if neg is None else torch.cat((pos, neg.to(pos.dtype)), dim=0)
    return contrastive(resolve_backend(backend, text), text, candidates, tau)


def arccon_loss(
    h1: torch.Tensor,
    h2: torch.Tensor,
    margin_degrees: float = 10.0,
    tau: float = 0.05,
    *,
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
        backend: "auto" (default), "torch", "triton" or "cuda".
    """
    margin, tau = check_arccon_options(margin_degrees, tau)
    check_two_views(h1, h2)
    return arccon(resolve_backend(backend, h1), h1, h2, margin, tau)


def triplet_loss(
    anchor: torch.Tensor,
    weak: torch.Tensor,
    strong: torch.Tensor,
    margin: float = 0.0,
    *,
    backend: str | None = None,
) -> torch.Tensor:
    """ArcCSE's triplet loss (Eq. 4): mean over triplets of max(0, cos(anchor, strong) - cos(anchor, weak) + margin).

    `weak` is the lightly masked view (20% of tokens masked), `strong` the heavily masked one (40%): the anchor
    should stay closer to the weak view. ArcCSE adds it to ArcCon with weight 0.1.

    Args:
        anchor, weak, strong: [N, D] embeddings.
        margin: additive margin on the cosine difference.
        backend: "auto" (default), "torch", "triton" or "cuda".
    """
    margin = checks.check_scalar("margin", margin)
    check_triplets(anchor, weak, strong)
    return triplet(resolve_backend(backend, anchor), anchor, weak, strong, margin)
