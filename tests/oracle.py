"""The test oracle: a float64, literal transcription of the formulas in docs/objective.md.

Nothing here is fast or memory-efficient on purpose. Every loss builds its full N x N (or 2N x 2N)
matrix and is written to be checked by eye against the spec, so that the package's O(N)-memory
algorithms (sorted prefix sums, online logsumexp, fused pair scores) can be judged against it.

Semantics are the ones the package adopts, which equal angle-emb 0.6.1 on valid inputs:
    * every norm ||x|| is replaced by max(||x||, 1e-12), F.normalize's epsilon, so zero vectors give
      finite values (the reference's angle loss divides by ||v||^2 without an epsilon);
    * excluded logits are -inf (the reference subtracts 1e12, which has the same effect);
    * everything is computed in float64, whatever dtype the inputs arrive in; the result is float64.

Gradients come from autograd through these formulas: call them on float64 leaves with
requires_grad=True and backpropagate.
"""

from __future__ import annotations

import contextlib
import math

import torch

EPS = 1e-12  # F.normalize's default epsilon

# The dtype every formula computes in: float64, except inside `computing_in(dtype)`, which runs the very same
# formulas in another dtype. That is "eager PyTorch in that dtype", the baseline of the flash-attention rule
# (an implementation's error may be at most 2x eager's own error in the same dtype).
_COMPUTE_DTYPE = torch.float64


@contextlib.contextmanager
def computing_in(dtype: torch.dtype):
    global _COMPUTE_DTYPE
    previous, _COMPUTE_DTYPE = _COMPUTE_DTYPE, dtype
    try:
        yield
    finally:
        _COMPUTE_DTYPE = previous


# ----------------------------------------------------------------------------------------------------
# small building blocks
# ----------------------------------------------------------------------------------------------------
def f64(x: torch.Tensor) -> torch.Tensor:
    """Cast to float64 (the compute dtype), keeping the autograd graph so gradients reach any leaf dtype."""
    return x.to(_COMPUTE_DTYPE)


def safe_norm(x: torch.Tensor) -> torch.Tensor:
    """Row norms [R, 1] with F.normalize's floor: max(||x||, eps)."""
    return torch.linalg.vector_norm(x, dim=1, keepdim=True).clamp_min(EPS)


def normalize(x: torch.Tensor) -> torch.Tensor:
    return x / safe_norm(x)


def pair_labels(y_true: torch.Tensor) -> torch.Tensor:
    """One label per pair from a zigzag y_true of shape [2N] or [2N, 1]: the rows 0, 2, 4, ..."""
    return f64(y_true.reshape(-1)[0::2])


def ranking_term(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """L = log(1 + sum over (i, j) with labels[i] < labels[j] of exp(s_i - s_j)), via the full matrix.

    Strict inequality: tied labels contribute nothing; all labels equal gives exactly log(1) = 0.
    """
    scores, labels = f64(scores), f64(labels)
    differences = scores[:, None] - scores[None, :]  # [i, j] = s_i - s_j
    counted = labels[:, None] < labels[None, :]  # [i, j] = label_i < label_j
    if not counted.any():  # no pair (i, j) with label_i < label_j: log(1 + 0), and a zero gradient
        return (scores * 0.0).sum()
    masked = torch.where(counted, differences, torch.full_like(differences, -math.inf))
    log_sum = torch.logsumexp(masked.reshape(-1), dim=0)  # log of the double sum
    # log(1 + sum) as logaddexp(0, log sum): log1p inside, so tiny losses (well-ranked batches at tau = 20,
    # L ~ 1e-6) keep full relative precision. The reference's logsumexp over [0, ...] loses it (3e-11
    # relative in float64, percent-level in float32 at L ~ 2e-6).
    return torch.logaddexp(torch.zeros((), dtype=_COMPUTE_DTYPE), log_sum)


# ----------------------------------------------------------------------------------------------------
# pair scores
# ----------------------------------------------------------------------------------------------------
def cosine_scores(y_pred: torch.Tensor, tau: float) -> torch.Tensor:
    """s_k = tau * cos(u_k, v_k) with u = y_pred[0::2], v = y_pred[1::2]."""
    x = f64(y_pred)
    u, v = x[0::2], x[1::2]
    return tau * (normalize(u) * normalize(v)).sum(dim=1)


def angle_scores(y_pred: torch.Tensor, tau: float, pooling_strategy: str = "sum") -> torch.Tensor:
    """The reference's complex division, term by term, with safe norms.

    u = a + i b, v = c + i d (first half real, second half imaginary);
    re = (a c + b d) / |v|^2, im = (b c - a d) / |v|^2 elementwise, both divided by |u| / |v|;
    pooled = sum(re) + sum(im) ('sum') or that sum / D ('mean'); s = tau * |pooled|.
    """
    x = f64(y_pred)
    dim = x.shape[1]
    if dim % 2:
        raise ValueError("angle scores need an even embedding dimension")
    u, v = x[0::2], x[1::2]
    a, b = u[:, : dim // 2], u[:, dim // 2 :]
    c, d = v[:, : dim // 2], v[:, dim // 2 :]
    norm_u, norm_v = safe_norm(u), safe_norm(v)
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


# ----------------------------------------------------------------------------------------------------
# the losses of angle_emb.loss
# ----------------------------------------------------------------------------------------------------
def cosine_loss(y_true: torch.Tensor, y_pred: torch.Tensor, tau: float = 20.0) -> torch.Tensor:
    return ranking_term(cosine_scores(y_pred, tau), pair_labels(y_true))


def angle_loss(
    y_true: torch.Tensor, y_pred: torch.Tensor, tau: float = 1.0, pooling_strategy: str = "sum"
) -> torch.Tensor:
    return ranking_term(angle_scores(y_pred, tau, pooling_strategy), pair_labels(y_true))


def in_batch_negative_loss(
    y_true: torch.Tensor,
    y_pred: torch.Tensor,
    tau: float = 20.0,
    negative_weights: float = 0.0,
    group_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Mean over the 2N rows of -log(probability of row i's positives) under softmax over j != i.

    logits[i, j] = tau * cos(x_i, x_j), the diagonal excluded. Row i (of a pair labelled 1) has its
    partner i xor 1 as target; rows of pairs labelled 0 have no target: they add 0 to the sum but
    count in the mean over 2N rows. With group_ids ([2N], one id per row, equal ids = identical texts),
    row i's positives are its partner plus every j != i with group_ids[j] in {group_ids[i],
    group_ids[partner]}, and the row's term is -log(sum of the positives' probabilities)
    (the contract of similarity_xent in angle_kernels/dispatch.py).

    negative_weights: the reference adds it to the partner logit of rows labelled 0, which have no
    target and so contribute 0 either way: it cannot change the loss. The oracle accepts and ignores it.
    """
    del negative_weights  # provably a no-op in the reference, see above
    x = normalize(f64(y_pred))
    rows = x.shape[0]
    labels = f64(y_true.reshape(-1))  # one label per row, 0 or 1
    logits = tau * (x @ x.T)
    not_self = ~torch.eye(rows, dtype=torch.bool)
    logits = torch.where(not_self, logits, torch.full_like(logits, -math.inf))

    index = torch.arange(rows)
    partner = index ^ 1
    positive = torch.zeros(rows, rows, dtype=torch.bool)
    positive[index, partner] = True
    if group_ids is not None:
        same_as_self = group_ids[None, :] == group_ids[:, None]
        same_as_partner = group_ids[None, :] == group_ids[partner][:, None]
        positive = positive | ((same_as_self | same_as_partner) & not_self)

    log_all = torch.logsumexp(logits, dim=1)
    log_positive = torch.logsumexp(torch.where(positive, logits, torch.full_like(logits, -math.inf)), dim=1)
    per_row = labels * (log_all - log_positive)
    return per_row.sum() / rows


def contrastive_with_negative_loss(
    text: torch.Tensor, pos: torch.Tensor, neg: torch.Tensor | None = None, tau: float = 20.0
) -> torch.Tensor:
    """Cross-entropy of query i over candidates [pos; neg] with target i, logits tau * cos."""
    q = normalize(f64(text))
    candidates = f64(pos) if neg is None else torch.cat([f64(pos), f64(neg)], dim=0)
    c = normalize(candidates)
    logits = tau * (q @ c.T)  # [B, B] or [B, 2B]
    batch = q.shape[0]
    target_logit = logits[torch.arange(batch), torch.arange(batch)]
    return (torch.logsumexp(logits, dim=1) - target_logit).mean()


# ----------------------------------------------------------------------------------------------------
# ArcCSE
# ----------------------------------------------------------------------------------------------------
def arccon_loss(
    h1: torch.Tensor,
    h2: torch.Tensor,
    margin_degrees: float = 10.0,
    tau: float = 0.05,
    sin_squared_floor: float | None = None,
) -> torch.Tensor:
    """ArcCon (ArcCSE Eq. 3): logits cos(h1_i, h2_j) / tau, the positive j = i with an additive angular
    margin: cos(min(arccos(cos_ii) + m, pi)) / tau; mean cross-entropy with target i.

    Written with arccos directly by default. The package's contract (angle_kernels/dispatch.py) computes
    cos(theta + m) = cos*cos(m) - sin*sin(m) with sin = sqrt(max(1 - cos^2, 1e-6)) so the gradient stays
    finite at |cos| = 1; the two agree except within ~1e-6 of |cos| = 1, which random inputs never reach.
    Pass sin_squared_floor=1e-6 to get the contract's form (for inputs with |cos| = 1).
    """
    margin = math.radians(margin_degrees)
    cos = normalize(f64(h1)) @ normalize(f64(h2)).T  # [N, N]
    n = cos.shape[0]
    diagonal = torch.arange(n)
    cos_positive = cos[diagonal, diagonal]
    if sin_squared_floor is None:
        theta = torch.arccos(cos_positive.clamp(-1.0, 1.0))
        positive_logit = torch.cos(torch.clamp(theta + margin, max=math.pi)) / tau
    else:
        sin_positive = torch.sqrt(torch.clamp(1 - cos_positive**2, min=sin_squared_floor))
        widened = cos_positive * math.cos(margin) - sin_positive * math.sin(margin)
        past_pi = cos_positive < -math.cos(margin)  # theta + m > pi: cos(pi) = -1
        positive_logit = torch.where(past_pi, torch.full_like(widened, -1.0), widened) / tau
    logits = cos / tau
    is_positive = torch.eye(n, dtype=torch.bool)
    logits = torch.where(is_positive, positive_logit[:, None].expand(n, n), logits)
    return (torch.logsumexp(logits, dim=1) - positive_logit).mean()


def triplet_loss(anchor: torch.Tensor, weak: torch.Tensor, strong: torch.Tensor, margin: float = 0.0) -> torch.Tensor:
    """ArcCSE Eq. 4: mean over triplets of max(0, cos(anchor, strong) - cos(anchor, weak) + margin)."""
    a, w, s = normalize(f64(anchor)), normalize(f64(weak)), normalize(f64(strong))
    per_triplet = (a * s).sum(dim=1) - (a * w).sum(dim=1) + margin
    return torch.clamp(per_triplet, min=0.0).mean()


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
) -> torch.Tensor:
    loss = torch.zeros((), dtype=_COMPUTE_DTYPE)
    if dataset_format == "A":
        # zigzag pairs with labels: weighted sum of the three pair losses (each only if its weight > 0)
        if cosine_w > 0:
            loss = loss + cosine_w * cosine_loss(labels, outputs, cosine_tau)
        if ibn_w > 0:
            loss = loss + ibn_w * in_batch_negative_loss(labels, outputs, ibn_tau)
        if angle_w > 0:
            loss = loss + angle_w * angle_loss(labels, outputs, angle_tau, angle_pooling_strategy)
        return loss
    if dataset_format == "B":
        # rows [query, positive, query, positive, ...]: in-batch contrastive only, labels unused
        return contrastive_with_negative_loss(outputs[0::2], outputs[1::2], None, ibn_tau)
    if dataset_format == "C":
        # rows [query, positive, negative, ...]
        query, positive, negative = outputs[0::3], outputs[1::3], outputs[2::3]
        dim = outputs.shape[1]
        positive_pairs = torch.stack([query, positive], dim=1).reshape(-1, dim)  # (q0, p0, q1, p1, ...)
        negative_pairs = torch.stack([query, negative], dim=1).reshape(-1, dim)  # (q0, n0, q1, n1, ...)
        pairs = torch.cat([positive_pairs, negative_pairs], dim=0)
        groups = query.shape[0]
        pair_rows_labels = torch.cat([torch.ones(2 * groups), torch.zeros(2 * groups)]).to(torch.float64)
        contrastive = torch.zeros((), dtype=_COMPUTE_DTYPE)
        if ibn_w > 0:
            contrastive = contrastive + ibn_w * contrastive_with_negative_loss(query, positive, None, ibn_tau)
        if cln_w > 0:
            contrastive = contrastive + cln_w * contrastive_with_negative_loss(query, positive, negative, ibn_tau)
        if contrastive > 0:  # the reference adds the halved sum only when it is positive
            loss = loss + contrastive / 2
        if angle_w > 0:
            loss = loss + angle_w * angle_loss(pair_rows_labels, pairs, angle_tau, angle_pooling_strategy)
        if cosine_w > 0:
            loss = loss + cosine_w * cosine_loss(pair_rows_labels, pairs, cosine_tau)
        return loss
    raise ValueError(f"unknown dataset_format {dataset_format!r}")
