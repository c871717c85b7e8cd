"""The float64 oracle of the tests and benchmarks: literal transcriptions, nothing fast or memory-efficient.

Two levels, both written to be checked by eye:
    * the four ops, with the signatures and semantics of the contract in angle_kernels/dispatch.py's
      docstring: pair_scores, ranking_loss, similarity_xent, similarity_lse. Every one builds its full matrix
      (N x N, M x Mc), so that the package's O(N)-memory algorithms can be judged against it. They live in the
      package, as `angle_kernels.float64_ops` (so that `python -m angle_kernels.verify` has them where the tests
      are not installed), and are re-exported here;
    * the public losses, transcribed from the REFERENCE formulas (angle-emb 0.6.1's angle_emb.loss and
      AngleLoss; the ArcCSE paper, Zhang et al., ACL 2022), not from the way the package assembles
      them out of its ops. They reuse the building blocks below (a cosine is a cosine) and the ranking term,
      which is the same formula in the reference and in the op contract.

Semantics are the ones the package adopts, which equal angle-emb 0.6.1 on valid inputs: every norm ||x|| is
replaced by max(||x||, 1e-12), F.normalize's epsilon (the reference's angle loss divides by ||v||^2 without
one); excluded logits are -inf (the reference subtracts 1e12, to the same effect).

Everything computes in float64 whatever dtype the inputs arrive in, on the inputs' device. Inside
`computing_in(dtype)` the very same formulas run in another dtype instead: that is "eager PyTorch in that
dtype", the baseline of the half-precision rule. Gradients come from autograd through these formulas.

This module (angle_kernels.testing.oracle) is imported by the tests and by bench/: it imports nothing but torch
and angle_kernels.float64_ops, in particular neither pytest nor the test helpers.
"""

from __future__ import annotations

import math

import torch

from angle_kernels.contract import FILTER_TIE_ALLOWANCE

# The op level (building blocks, the four ops, the error measure and computing_in) is the package's own float64
# reference, which `python -m angle_kernels.verify` uses on GPUs where the tests are not installed.
from angle_kernels.float64_ops import (  # noqa: F401  (re-exported: the tests' and benchmarks' oracle)
    EPS,
    MARGIN_SIN_SQUARED_FLOOR,
    computing_in,
    cosine,
    cosine_matrix,
    current_dtype,
    dot,
    dot_matrix,
    in_compute_dtype,
    log_partition_ratio,
    masked_logsumexp,
    norm,
    normalize,
    pair_scores,
    ranking_loss,
    rel_err,
    similarity_lse,
    similarity_xent,
    widened_cosine,
)


def margin_threshold(positive: torch.Tensor, strategy: str, margin: float, magnitude=1.0) -> torch.Tensor:
    """Where a false-negative filter starts, from each row's positive score c (no gradient): c - margin
    ("absolute") or c - |c| * margin ("relative"), plus FILTER_TIE_ALLOWANCE times `magnitude` (1 for cosines,
    |q_i| |p_i| for dot products): columns scoring above it are dropped, those tied with it (within the allowance)
    kept."""
    c = positive.detach()
    return (c - margin if strategy == "absolute" else c - c.abs() * margin) + FILTER_TIE_ALLOWANCE * magnitude


# ----------------------------------------------------------------------------------------------------
# the losses of angle_emb.loss (zigzag rows: pair k is rows 2k and 2k + 1)
# ----------------------------------------------------------------------------------------------------
def pair_labels(y_true: torch.Tensor) -> torch.Tensor:
    """One label per pair from a zigzag y_true of shape [2N] or [2N, 1]: the rows 0, 2, 4, ..."""
    return y_true.reshape(-1)[0::2]


def cosine_scores(y_pred: torch.Tensor, tau: float) -> torch.Tensor:
    """s_k = tau * cos(u_k, v_k) with u = y_pred[0::2], v = y_pred[1::2]."""
    x = in_compute_dtype(y_pred)
    return tau * cosine(x[0::2], x[1::2])


def angle_scores(y_pred: torch.Tensor, tau: float, pooling_strategy: str = "sum") -> torch.Tensor:
    """The reference's complex division, term by term, with safe norms.

    u = a + i b, v = c + i d (first half real, second half imaginary);
    re = (a c + b d) / |v|^2, im = (b c - a d) / |v|^2 elementwise, both divided by |u| / |v|;
    pooled = sum(re) + sum(im) ('sum') or that sum / D ('mean'); s = tau * |pooled|.
    """
    x = in_compute_dtype(y_pred)
    dim = x.shape[1]
    if dim % 2:
        raise ValueError("angle scores need an even embedding dimension")
    u, v = x[0::2], x[1::2]
    a, b = u[:, : dim // 2], u[:, dim // 2 :]
    c, d = v[:, : dim // 2], v[:, dim // 2 :]
    norm_u, norm_v = norm(u)[:, None], norm(v)[:, None]
    re = (a * c + b * d) / norm_v**2
    im = (b * c - a * d) / norm_v**2
    re = re / (norm_u / norm_v)
    im = im / (norm_u / norm_v)
    both = torch.cat([re, im], dim=1)  # [N, D]
    if pooling_strategy == "sum":
        pooled = both.sum(dim=1)
    elif pooling_strategy == "mean":
        pooled = both.sum(dim=1) / dim
    else:
        raise ValueError(f"unknown pooling_strategy {pooling_strategy!r}")
    return tau * pooled.abs()


def cosine_loss(y_true: torch.Tensor, y_pred: torch.Tensor, tau: float = 20.0) -> torch.Tensor:
    return ranking_loss(cosine_scores(y_pred, tau), pair_labels(y_true))


def angle_loss(
    y_true: torch.Tensor, y_pred: torch.Tensor, tau: float = 1.0, pooling_strategy: str = "sum"
) -> torch.Tensor:
    return ranking_loss(angle_scores(y_pred, tau, pooling_strategy), pair_labels(y_true))


def in_batch_negative_loss(
    y_true: torch.Tensor,
    y_pred: torch.Tensor,
    tau: float = 20.0,
    negative_weights: float = 0.0,
    group_ids: torch.Tensor | None = None,
    partition: str = "angle",
    false_negative_margin: float | None = None,
    false_negative_strategy: str = "absolute",
) -> torch.Tensor:
    """Mean over the 2N rows of -log(probability of row i's positives) under softmax over j != i.

    logits[i, j] = tau * cos(x_i, x_j), the diagonal excluded. Row i (of a pair whose two rows are labelled 1)
    has its partner i xor 1 as target; the rows of other pairs have no target: they add 0 to the sum but
    count in the mean over 2N rows. With group_ids ([2N], one id per row, equal ids = identical texts),
    row i's positives are its partner plus every j != i with group_ids[j] in {group_ids[i],
    group_ids[partner]}, and the row's term is -log(sum of the positives' probabilities)
    (the package's extension: the AnglE paper's detection of identical sentences, which angle-emb dropped).

    negative_weights: the reference adds it to the partner logit of rows labelled 0, which have no
    target and so contribute 0 either way: it cannot change the loss. The oracle accepts and ignores it.

    AngleLoss's options (the package's, without group_ids):
    false_negative_margin: row i also drops every column j but its partner with cos(x_i, x_j) above
    margin_threshold(cos(x_i, x_partner)).
    partition="gte": GTE's joint partition per pair k (rows a = 2k, b = 2k + 1): the union of the two rows'
    columns (q_k against every document and every other query, d_k against every query and every other
    document), so the pair's term is log(Z_a + Z_b) - tau * cos(x_a, x_b); pairs labelled 1 summed, divided
    by the N pairs.
    """
    del negative_weights  # provably a no-op in the reference, see above
    x = in_compute_dtype(y_pred)
    rows = x.shape[0]
    labels = in_compute_dtype(y_true.reshape(-1))  # one label per row, 0 or 1
    not_self = ~torch.eye(rows, dtype=torch.bool, device=x.device)
    cos = cosine_matrix(x, x)
    logits = (tau * cos).masked_fill(~not_self, -math.inf)

    index = torch.arange(rows, device=x.device)
    partner = index ^ 1
    if false_negative_margin is not None:
        threshold = margin_threshold(cos[index, partner], false_negative_strategy, false_negative_margin)
        too_close = (cos.detach() > threshold[:, None]) & (index[None, :] != partner[:, None])
        logits = logits.masked_fill(too_close, -math.inf)
    if partition == "gte":
        log_z = torch.logaddexp(torch.logsumexp(logits[0::2], dim=1), torch.logsumexp(logits[1::2], dim=1))
        per_pair = labels[0::2] * labels[1::2] * (log_z - tau * cos[index[0::2], partner[0::2]])
        return per_pair.sum() / (rows // 2)
    positive = torch.zeros(rows, rows, dtype=torch.bool, device=x.device)
    positive[index, partner] = True
    if group_ids is not None:
        ids = group_ids.to(x.device)
        same_as_self = ids[None, :] == ids[:, None]
        same_as_partner = ids[None, :] == ids[partner][:, None]
        positive = positive | ((same_as_self | same_as_partner) & not_self)

    # logsumexp over the columns minus over the positives, as softplus of the other columns' against the positives':
    # a row whose positives dominate keeps the digits of its small loss
    kept = torch.isfinite(logits.detach())  # the columns neither the diagonal nor the filter removed
    # a row has its target when both rows of its pair are labelled 1 (the reference's rule: a pair labelled (1, 0)
    # gives neither row one)
    has_target = labels * labels[partner]
    per_row = has_target * log_partition_ratio(logits, kept, positive & kept)
    return per_row.sum() / rows


def contrastive_with_negative_loss(
    text: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor | None = None, tau: float = 20.0
) -> torch.Tensor:
    """Cross-entropy of query i over candidates [pos; neg] with target i, logits tau * cos."""
    candidates = pos if neg is None else torch.cat([in_compute_dtype(pos), in_compute_dtype(neg)], dim=0)
    logits = tau * cosine_matrix(in_compute_dtype(text), in_compute_dtype(candidates))  # [B, B] or [B, 2B]
    batch = torch.arange(logits.shape[0], device=logits.device)
    return (torch.logsumexp(logits, dim=1) - logits[batch, batch]).mean()


ALL_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")  # GTE's joint partition


def multiple_negatives_ranking_loss(
    queries: torch.Tensor,
    positives: torch.Tensor,
    negatives=(),
    scale: float = 20.0,
    directions=("query_to_doc",),
    partition_mode: str = "joint",
    hardness_mode: str | None = None,
    hardness_strength: float = 0.0,
    false_negative_margin: float | None = None,
    false_negative_strategy: str = "absolute",
    similarity: str = "cosine",
    reduction: str = "mean",
) -> torch.Tensor:
    """sentence-transformers 6.3's MultipleNegativesRankingLoss (one process), from the full score blocks, plus
    the package's false-negative filter: in every block, a column whose cosine with the row's anchor exceeds
    t_i = c_i - margin ("absolute") or c_i - |c_i| * margin ("relative"), c_i = cos(q_i, p_i), is dropped,
    except the row's positive pair (column i of query_to_doc and of doc_to_query). similarity="dot": every
    cosine above is the plain dot product instead (util.dot_score). reduction="none": each row's loss [B] (the
    gradients of rows whose terms are huge and cancel, taken one row at a time, then keep the other rows' small
    contributions that a sum over rows in one backward would absorb)."""
    score_matrix = cosine_matrix if similarity == "cosine" else dot_matrix
    q, p = in_compute_dtype(queries), in_compute_dtype(positives)
    docs = torch.cat([p, *(in_compute_dtype(n) for n in negatives)], dim=0)  # [B (1 + k), D]
    b = q.shape[0]
    i = torch.arange(b)[:, None]
    j = torch.arange(docs.shape[0])[None, :]
    own_doc = j % b == i  # the row's positive and its own hard negatives
    blocks = {"query_to_doc": (score_matrix(q, docs), own_doc & (j == i), torch.zeros_like(own_doc))}
    if "query_to_query" in directions:
        blocks["query_to_query"] = (score_matrix(q, q), torch.zeros(b, b, dtype=torch.bool), torch.eye(b) > 0)
    if "doc_to_query" in directions:
        blocks["doc_to_query"] = (score_matrix(p, q), torch.eye(b) > 0, torch.zeros(b, b, dtype=torch.bool))
    if "doc_to_doc" in directions:
        blocks["doc_to_doc"] = (score_matrix(p, docs), torch.zeros_like(own_doc), own_doc)
    positive_cos = cosine(q, p) if similarity == "cosine" else dot(q, p)
    logits = {}
    for name, (cos, is_positive, removed) in blocks.items():
        block = scale * cos
        if name == "query_to_doc" and hardness_mode is not None and hardness_strength > 0:
            penalised = {"in_batch_negatives": ~own_doc, "hard_negatives": own_doc & (j >= b),
                         "all_negatives": ~(own_doc & (j == i))}[hardness_mode]
            block = block + torch.where(penalised, hardness_strength * cos.detach(), torch.zeros_like(cos))
        drop = removed
        if false_negative_margin is not None:
            magnitude = 1.0 if similarity == "cosine" else norm(q) * norm(p)
            t = margin_threshold(positive_cos, false_negative_strategy, false_negative_margin, magnitude)
            drop = drop | ((cos.detach() > t[:, None]) & ~is_positive)
        logits[name] = block.masked_fill(drop, -math.inf)
    if partition_mode == "joint":
        log_z = torch.logsumexp(torch.cat(list(logits.values()), dim=1), dim=1)
    else:
        log_z = sum(torch.logsumexp(block, dim=1) for block in logits.values()) / len(logits)
    rows = log_z - scale * positive_cos
    return rows if reduction == "none" else rows.mean()


def gist_loss(anchors, positives, guide_anchors, guide_positives, negatives=(), guide_negatives=(),
              temperature: float = 0.01, margin_strategy: str = "absolute", margin: float = 0.0,
              contrast_anchors: bool = True, contrast_positives: bool = True,
              self_negatives: bool = False) -> torch.Tensor:
    """GISTEmbed (one process), from the full score blocks: anchor-positive, anchor-anchor, positive-positive
    and anchor-negative cosines / temperature; a column whose guide cosine exceeds g_i - margin ("absolute")
    or g_i - |g_i| * margin ("relative"), g_i the guide's anchor-positive cosine, is dropped, except the
    anchor-positive target; the diagonal of the anchor-anchor and positive-positive blocks (a row against its own
    copy) is dropped too unless self_negatives; cross-entropy with target column i of the first block."""
    a, p = in_compute_dtype(anchors), in_compute_dtype(positives)
    ga, gp = in_compute_dtype(guide_anchors.detach()), in_compute_dtype(guide_positives.detach())
    threshold = margin_threshold(cosine(ga, gp), margin_strategy, margin)
    diagonal = torch.eye(a.shape[0], dtype=torch.bool, device=a.device)
    nothing = torch.zeros_like(diagonal)
    own = nothing if self_negatives else diagonal
    pairs = [(a, p, ga, gp, diagonal, nothing)]  # (..., always kept, always dropped)
    if contrast_anchors:
        pairs.append((a, a, ga, ga, nothing, own))
    if contrast_positives:
        pairs.append((p, p, gp, gp, nothing, own))
    for n, gn in zip(negatives, guide_negatives):
        pairs.append((a, in_compute_dtype(n), ga, in_compute_dtype(gn.detach()), nothing, nothing))
    blocks = []
    for rows, columns, guide_rows, guide_columns, kept, dropped in pairs:
        drop = ((cosine_matrix(guide_rows, guide_columns) > threshold[:, None]) & ~kept) | dropped
        blocks.append((cosine_matrix(rows, columns) / temperature).masked_fill(drop, -math.inf))
    logits = torch.cat(blocks, dim=1)
    return (torch.logsumexp(logits, dim=1) - cosine(a, p) / temperature).mean()


# ----------------------------------------------------------------------------------------------------
# ArcCSE (the paper's formulas: the package is not checked against the authors' code)
# ----------------------------------------------------------------------------------------------------
def arccon_loss(h1: torch.Tensor, h2: torch.Tensor, margin_degrees: float = 10.0, tau: float = 0.05) -> torch.Tensor:
    """ArcCon (ArcCSE Eq. 3): logits cos(h1_i, h2_j) / tau, the positive j = i with an additive angular
    margin: cos(min(arccos(cos_ii) + m, pi)) / tau; mean cross-entropy with target i.

    Written with arccos, as in the paper. The package's contract computes the margin logit as
    widened_cosine() does (sin^2 floored at 1e-6, so the gradient stays finite at |cos| = 1); the two agree
    except within ~1e-6 of |cos| = 1, which random inputs never reach (use similarity_xent there).
    """
    margin = math.radians(margin_degrees)
    cos = cosine_matrix(in_compute_dtype(h1), in_compute_dtype(h2))  # [N, N]
    n = cos.shape[0]
    diagonal = torch.arange(n, device=cos.device)
    theta = torch.arccos(cos[diagonal, diagonal].clamp(-1.0, 1.0))
    positive_logit = torch.cos(torch.clamp(theta + margin, max=math.pi)) / tau
    is_positive = torch.eye(n, dtype=torch.bool, device=cos.device)
    logits = torch.where(is_positive, positive_logit[:, None].expand(n, n), cos / tau)
    # logsumexp - positive_logit as softplus of the other logits' logsumexp against it: a loss near 1e-6 keeps its
    # digits
    return log_partition_ratio(logits, torch.ones_like(is_positive), is_positive).mean()


def triplet_loss(anchor: torch.Tensor, weak: torch.Tensor, strong: torch.Tensor, margin: float = 0.0) -> torch.Tensor:
    """ArcCSE Eq. 4: mean over triplets of max(0, cos(anchor, strong) - cos(anchor, weak) + margin).

    max(0, x) as torch.relu differentiates it, as the losses do: a triplet whose hinge is exactly 0 (weak and strong
    equal, margin 0) counts as met and takes no gradient. torch.clamp(min=0) passes the gradient there (its
    derivative at the bound is 1), which no loss computes."""
    a, w, s = in_compute_dtype(anchor), in_compute_dtype(weak), in_compute_dtype(strong)
    return torch.relu(cosine(a, s) - cosine(a, w) + margin).mean()


def arccse_loss(h1, h2, anchor=None, weak=None, strong=None, margin_degrees=10.0, tau=0.05, triplet_weight=0.1,
                triplet_margin=0.0) -> torch.Tensor:
    """ArcCSE's objective L = L_arc + lambda * L_tri (the triplet term only when its three inputs are given)."""
    loss = arccon_loss(h1, h2, margin_degrees, tau)
    if anchor is not None:
        loss = loss + triplet_weight * triplet_loss(anchor, weak, strong, triplet_margin)
    return loss


# ----------------------------------------------------------------------------------------------------
# AngleLoss, assembled exactly as angle_emb 0.6.1's AngleLoss.__call__
# ----------------------------------------------------------------------------------------------------
def angle_loss_module(
    labels: torch.Tensor,
    outputs: torch.Tensor,
    *,
    dataset_format: str,
    cosine_w: float = 0.0,
    ibn_w: float = 1.0,
    cln_w: float = 1.0,
    angle_w: float = 0.02,
    cosine_tau: float = 20.0,
    ibn_tau: float = 20.0,
    angle_tau: float = 20.0,
    angle_pooling_strategy: str = "sum",
    ibn_partition: str = "angle",
    false_negative_margin: float | None = None,
    false_negative_strategy: str = "absolute",
) -> torch.Tensor:
    """The reference's AngleLoss, plus the package's options of the in-batch-negative terms: ibn_partition
    "gte" (GTE's joint partition) and the false-negative filter (false_negative_margin, None = off), in format
    A as in_batch_negative_loss states them, in formats B and C as multiple_negatives_ranking_loss does
    ("gte": all four directions; format C's cln term with the negatives as its hard-negative column)."""
    filtering = dict(false_negative_margin=false_negative_margin, false_negative_strategy=false_negative_strategy)

    def contrastive_term(query, positive, negative=None):
        if ibn_partition == "angle" and false_negative_margin is None:  # the reference's term
            return contrastive_with_negative_loss(query, positive, negative, ibn_tau)
        directions = ALL_DIRECTIONS if ibn_partition == "gte" else ("query_to_doc",)
        return multiple_negatives_ranking_loss(query, positive, () if negative is None else (negative,), ibn_tau,
                                               directions, **filtering)

    loss = torch.zeros((), dtype=current_dtype(), device=outputs.device)
    if dataset_format == "A":
        # zigzag pairs with labels: weighted sum of the three pair losses (each only if its weight > 0)
        if cosine_w > 0:
            loss = loss + cosine_w * cosine_loss(labels, outputs, cosine_tau)
        if ibn_w > 0:
            loss = loss + ibn_w * in_batch_negative_loss(labels, outputs, ibn_tau, partition=ibn_partition,
                                                         **filtering)
        if angle_w > 0:
            loss = loss + angle_w * angle_loss(labels, outputs, angle_tau, angle_pooling_strategy)
        return loss
    if dataset_format == "B":
        # rows [query, positive, query, positive, ...]: in-batch contrastive only, labels unused
        return contrastive_term(outputs[0::2], outputs[1::2])
    if dataset_format == "C":
        # rows [query, positive, negative, ...]
        query, positive, negative = outputs[0::3], outputs[1::3], outputs[2::3]
        dim = outputs.shape[1]
        positive_pairs = torch.stack([query, positive], dim=1).reshape(-1, dim)  # (q0, p0, q1, p1, ...)
        negative_pairs = torch.stack([query, negative], dim=1).reshape(-1, dim)  # (q0, n0, q1, n1, ...)
        pairs = torch.cat([positive_pairs, negative_pairs], dim=0)
        groups = query.shape[0]
        pair_rows_labels = torch.cat([torch.ones(2 * groups), torch.zeros(2 * groups)]).to(outputs.device)
        contrastive = torch.zeros((), dtype=current_dtype(), device=outputs.device)
        if ibn_w > 0:
            contrastive = contrastive + ibn_w * contrastive_term(query, positive)
        if cln_w > 0:
            contrastive = contrastive + cln_w * contrastive_term(query, positive, negative)
        if contrastive > 0:  # the reference adds the halved sum only when it is positive
            loss = loss + contrastive / 2
        if angle_w > 0:
            loss = loss + angle_w * angle_loss(pair_rows_labels, pairs, angle_tau, angle_pooling_strategy)
        if cosine_w > 0:
            loss = loss + cosine_w * cosine_loss(pair_rows_labels, pairs, cosine_tau)
        return loss
    raise ValueError(f"unknown dataset_format {dataset_format!r}")
