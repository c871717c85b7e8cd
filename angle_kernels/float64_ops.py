"""The four ops in float64: literal transcriptions of the contract, nothing fast or memory-efficient.

The semantics of the ops are stated in `angle_kernels.dispatch`; this module transcribes them as directly as
PyTorch allows, so that they can be checked by eye: every op builds its full matrix (N x N, M x Mc), and
gradients come from autograd through the formulas. It is the oracle the backends are held to, in two places:

    * `python -m angle_kernels.verify`, which checks the GPU backends on the local GPU from an installed
      package (the tests are not installed);
    * the test suite and the benchmarks (angle_kernels.testing.oracle re-exports this module and adds the public
      losses, transcribed from angle-emb's formulas). Two modules, not one: this one ships with the package for
      the GPU checks, the losses' transcriptions stay with the tests (they judge the package's own assembly).

Semantics are the ones the package adopts, which equal angle-emb 0.6.1 on valid inputs: every norm ||x|| is
replaced by max(||x||, 1e-12), F.normalize's epsilon; excluded logits are -inf.

Everything computes in float64 whatever dtype the inputs arrive in, on the inputs' device. Inside
`computing_in(dtype)` the very same formulas run in another dtype instead: that is "eager PyTorch in that
dtype", the baseline of the half-precision rule (a backend's error against float64 may be at most twice eager's).
Nested prefixes (dims) are the contract's definition: one call per truncated input, stacked.

Imports nothing but torch and the contract's constants.
"""

from __future__ import annotations

import contextlib
import math

import torch

from .contract import MARGIN_SIN_SQUARED_FLOOR
from .contract import NORM_EPS as EPS

# How a result is judged against these transcriptions, by the tests and by `angle_kernels.verify` (the rule is stated
# here, once): float64 and float32 inputs against tolerances on the outputs (VALUE_TOL) and the
# gradients (GRAD_TOL), float32 computed against float64 on the same float32 values; bfloat16 / float16 inputs by
# the half-precision rule: an error against float64 at most twice eager PyTorch's own error in that dtype (these
# formulas inside `computing_in(dtype)`), plus HALF_RULE_FLOOR, a relative 1e-6 (what float32 accumulation may
# cost) for the cases where eager happens to be exact. float32 cases that float32 cannot resolve (eager float32
# misses the tolerance too) are held to the half rule.
VALUE_TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
GRAD_TOL = {torch.float64: 1e-8, torch.float32: 1e-4}
HALF_RULE_FLOOR = 1e-6


def allowed_error(dtype: torch.dtype, kind: str, eager_error: float | None = None) -> float:
    """The largest relative error a result of `kind` ("value" or "grad") computed from `dtype` inputs may have:
    the tolerance for float64/float32 (float32: or the half rule, when eager float32 misses the tolerance too),
    the half rule for 16-bit dtypes (eager_error is eager PyTorch's error in that dtype; needed there)."""
    tolerance = (VALUE_TOL if kind == "value" else GRAD_TOL).get(dtype)
    half_rule = None if eager_error is None else 2 * eager_error + HALF_RULE_FLOOR
    if dtype == torch.float64:
        return tolerance
    if dtype == torch.float32:
        return tolerance if half_rule is None or eager_error <= tolerance else max(tolerance, half_rule)
    if half_rule is None:
        raise ValueError(f"the half-precision rule for {dtype} needs eager PyTorch's error")
    return half_rule


_compute_dtype = torch.float64


@contextlib.contextmanager
def computing_in(dtype: torch.dtype):
    """Run every formula of this module in `dtype` instead of float64 (inputs are cast to it on entry)."""
    global _compute_dtype
    previous, _compute_dtype = _compute_dtype, dtype
    try:
        yield
    finally:
        _compute_dtype = previous


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """The one error measure: ||out - ref|| / ||ref|| over the whole tensor, in float64.

    A zero reference gives ||out|| (an absolute error). NaN or Inf in `out` gives NaN or Inf, which fails
    every `<=` comparison.
    """
    out = out.detach().to(torch.float64).reshape(-1).cpu()
    ref = ref.detach().to(torch.float64).reshape(-1).cpu()
    if out.shape != ref.shape:
        raise ValueError(f"rel_err: shapes differ, {tuple(out.shape)} vs {tuple(ref.shape)}")
    scale = torch.linalg.vector_norm(ref)
    diff = torch.linalg.vector_norm(out - ref)
    return float(diff / scale) if scale > 0 else float(diff)


# ----------------------------------------------------------------------------------------------------
# building blocks (vectors along the last dimension)
# ----------------------------------------------------------------------------------------------------
def current_dtype() -> torch.dtype:
    """The dtype the formulas compute in now: float64, or computing_in's."""
    return _compute_dtype


def in_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """x cast to the compute dtype, keeping the autograd graph so gradients reach leaves of any dtype."""
    return x.to(_compute_dtype)


def dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return (a * b).sum(dim=-1)


def norm(x: torch.Tensor) -> torch.Tensor:
    """max(||x||, eps) along the last dimension."""
    return torch.linalg.vector_norm(x, dim=-1).clamp_min(EPS)


def cosine(u: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """u . v / (max(|u|, eps) * max(|v|, eps)), for broadcastable [..., D] tensors."""
    return dot(u, v) / (norm(u) * norm(v))


def normalize(x: torch.Tensor) -> torch.Tensor:
    return x / norm(x)[..., None]


def cosine_matrix(q: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """[i, j] = cos(q_i, c_j) for q [M, D] and c [Mc, D]."""
    return normalize(q) @ normalize(c).T


def dot_matrix(q: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """[i, j] = q_i . c_j (util.dot_score)."""
    return q @ c.T


def masked_logsumexp(values: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """logsumexp over the last dimension of the entries where `keep` is True."""
    return torch.logsumexp(values.masked_fill(~keep, -math.inf), dim=-1)


def log_partition_ratio(values: torch.Tensor, columns: torch.Tensor, positives: torch.Tensor) -> torch.Tensor:
    """logsumexp over `columns` minus logsumexp over `positives` (a subset of them, one entry at least) along the
    last dimension, as softplus(lse over the other columns - lse over the positives): a row whose positives
    dominate keeps the digits of its small value, which the difference of two logsumexps rounds away at the
    logits' magnitude (in float64, ~5e-11 of a loss near 1e-6 at scale 20; with several positives of similar
    logits, duplicate texts, most of it at larger scales). 0 for a row without other columns."""
    others = columns & ~positives
    has_others = others.any(dim=-1)
    safe = others | ~has_others[..., None]  # rows without other columns: any finite entries, result discarded
    lse_others = torch.logsumexp(values.masked_fill(~safe, -math.inf), dim=-1)
    lse_positives = torch.logsumexp(values.masked_fill(~positives, -math.inf), dim=-1)
    # log(1 + e^x), exact on both sides (F.softplus returns x itself from x = 20); each branch on inputs where it is
    # finite, so that neither gives the other's gradient a NaN
    x = lse_others - lse_positives
    above, below = x.clamp_min(0), x.clamp_max(0)
    softplus = torch.where(x > 0, above + torch.log1p(torch.exp(-above)), torch.log1p(torch.exp(below)))
    return torch.where(has_others, softplus, torch.zeros_like(lse_positives))


# ----------------------------------------------------------------------------------------------------
# the ops (angle_kernels/dispatch.py)
# ----------------------------------------------------------------------------------------------------
def _per_prefix(op, dims, x, *args, **kwargs):
    """The contract's nested prefixes: op on x[..., :d] for every d in dims, each output stacked on a new axis 0."""
    outputs = [op(x[..., :d], *args, **kwargs) for d in dims]
    if isinstance(outputs[0], tuple):
        return tuple(torch.stack(parts) for parts in zip(*outputs))
    return torch.stack(outputs)


def pair_scores(x: torch.Tensor, with_angle: bool, dims: tuple[int, ...] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [G, K, D]: pair k of group g is (u, v) = (x[g, 0], x[g, k]). Returns cos and angle, [G, K - 1]
    ([len(dims), G, K - 1] with dims).

    cos = u . v / P and angle = (u . v + b . c - a . d) / P, with P = max(|u|, eps) * max(|v|, eps) and a, b
    the halves of u, c, d those of v. Without the angle the second output is zeros (and D may be odd).
    """
    if dims is not None:
        return _per_prefix(pair_scores, dims, x, with_angle)
    x = in_compute_dtype(x)
    u, v = x[:, :1, :], x[:, 1:, :]  # the anchor broadcasts over the K - 1 others
    cos = cosine(u, v)
    if not with_angle:
        return cos, torch.zeros_like(cos)
    dim = x.shape[-1]
    if dim % 2:
        raise ValueError(f"the angle score needs an even D, got D = {dim}")
    half = dim // 2
    a, b = u[..., :half], u[..., half:]
    c, d = v[..., :half], v[..., half:]
    angle = (dot(u, v) + dot(b, c) - dot(a, d)) / (norm(u) * norm(v))
    return cos, angle


def ranking_loss(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log(1 + sum over (i, j) with labels[i] < labels[j] of exp(scores[i] - scores[j])), from the full matrix.

    Strict inequality: tied labels contribute nothing; all labels equal gives exactly log(1) = 0. Labels are
    compared as given, never rounded to the compute dtype (that could tie distinct labels).
    """
    scores = in_compute_dtype(scores)
    counted = labels[:, None] < labels[None, :]  # [i, j] = label_i < label_j
    if not counted.any():  # log(1 + 0), with a zero gradient
        return (scores * 0.0).sum()
    log_sum = masked_logsumexp((scores[:, None] - scores[None, :]).reshape(-1), counted.reshape(-1))
    # log(1 + S) as logaddexp(0, log S): tiny losses (well-ranked batches at tau = 20 reach L ~ 1e-6) keep full
    # relative precision. The reference's logsumexp over [0, ...] does not (3e-11 relative in float64 there,
    # percent-level in float32).
    return torch.logaddexp(torch.zeros_like(log_sum), log_sum)


def widened_cosine(cos: torch.Tensor, margin: float) -> torch.Tensor:
    """cos(min(arccos(cos) + margin, pi)) in the contract's form: cos * cos(m) - sin * sin(m) with
    sin = sqrt(max(1 - cos^2, 1e-6)), and cos(pi) = -1 once arccos(cos) + m > pi, i.e. cos < -cos(m)."""
    sin = torch.sqrt(torch.clamp(1 - cos * cos, min=MARGIN_SIN_SQUARED_FLOOR))
    widened = cos * math.cos(margin) - sin * math.sin(margin)
    return torch.where(cos < -math.cos(margin), -torch.ones_like(cos), widened)


def similarity_xent(
    q: torch.Tensor,
    c: torch.Tensor | None,
    scale: float,
    target: str,
    row_weights: torch.Tensor | None = None,
    exclude_diagonal: bool = False,
    margin: float = 0.0,
    group_ids: torch.Tensor | None = None,
    dims: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """(1 / M) sum_i w_i (logsumexp_{j in C_i} l_ij - logsumexp_{j in P_i} l_ij), from the full M x Mc logits
    (with dims, [len(dims)]: one loss per prefix).

    l_ij = scale * cos(q_i, c_j), except l_{i, t_i} = scale * widened_cosine(cos(q_i, c_{t_i}), margin);
    t_i = i xor 1 ("partner") or i ("diagonal"); c = None means c is q. C_i: every column, without i when
    exclude_diagonal. P_i: t_i, plus with group_ids every j in C_i whose id equals that of i or of t_i.
    """
    if dims is not None:
        return torch.stack([similarity_xent(q[:, :d], None if c is None else c[:, :d], scale, target, row_weights,
                                            exclude_diagonal, margin, group_ids) for d in dims])
    cos = cosine_matrix(in_compute_dtype(q), in_compute_dtype(q if c is None else c))  # [M, Mc]
    rows, cols = cos.shape
    i = torch.arange(rows, device=cos.device)[:, None]
    j = torch.arange(cols, device=cos.device)[None, :]
    t = i ^ 1 if target == "partner" else i
    is_target = j == t
    logits = scale * torch.where(is_target, widened_cosine(cos, margin), cos)

    columns = torch.ones_like(is_target)
    if exclude_diagonal:
        columns = columns & (j != i)
    positives = is_target
    if group_ids is not None:
        ids = group_ids.to(cos.device)
        same_text = (ids[None, :] == ids[:, None]) | (ids[None, :] == ids[t.reshape(-1)][:, None])
        positives = positives | (same_text & columns)

    per_row = log_partition_ratio(logits, columns, positives)
    weights = torch.ones_like(per_row) if row_weights is None else in_compute_dtype(row_weights.to(cos.device))
    return (weights * per_row).sum() / rows


def similarity_lse(
    q: torch.Tensor,
    c: torch.Tensor,
    scale: float,
    target_offset: int = 0,
    period: int = 0,
    exclude: str = "none",
    penalty: float = 0.0,
    penalty_on: str = "none",
    filter_q: torch.Tensor | None = None,
    filter_c: torch.Tensor | None = None,
    filter_threshold: torch.Tensor | None = None,
    filter_keeps_target: bool = False,
    normalize: bool = True,
    dims: tuple[int, ...] | None = None,
) -> torch.Tensor:
    """lse_i = logsumexp over the kept columns of l_ij, from the full M x Mc logits (see dispatch.py).

    dims: the [k, M] of k calls on the prefixes q[:, :d_p], c[:, :d_p] (the filter embeddings cut alike, the
    threshold's row p), stacked: what the contract says dims is.

    cos_ij is the cosine, or the plain dot product q_i . c_j when not normalize (also in the filter).
    t_i = target_offset + i; own: j % period == t_i (period 0: j == t_i).
    l_ij = scale * cos_ij + penalty * detach(cos_ij) on the hardness set ("other": not own; "own": own, not
    the target; "all": not the target). Dropped: the target ("target") or the own columns ("own"), and, with a
    filter, every j with cos(filter_q_i, filter_c_j) > filter_threshold_i (but the target when
    filter_keeps_target).
    """
    if dims is not None:
        has_filter = filter_threshold is not None
        return torch.stack([similarity_lse(
            q[:, :d], c[:, :d], scale, target_offset, period, exclude, penalty, penalty_on,
            filter_q[:, :d] if has_filter else None, filter_c[:, :d] if has_filter else None,
            filter_threshold[p] if has_filter else None, filter_keeps_target, normalize) for p, d in enumerate(dims)])
    similarity = cosine_matrix if normalize else dot_matrix
    cos = similarity(in_compute_dtype(q), in_compute_dtype(c))  # [M, Mc]
    rows, cols = cos.shape
    i = torch.arange(rows, device=cos.device)[:, None]
    j = torch.arange(cols, device=cos.device)[None, :]
    t = i + target_offset
    is_target = j == t
    is_own = (j % period == t) if period > 0 else is_target
    hard = {"none": torch.zeros_like(is_target), "other": ~is_own, "own": is_own & ~is_target,
            "all": ~is_target}[penalty_on]
    logits = scale * cos + torch.where(hard, penalty * cos.detach(), torch.zeros_like(cos))
    keep = {"none": torch.ones_like(is_target), "target": ~is_target, "own": ~is_own}[exclude]
    if filter_threshold is not None:
        guide = similarity(in_compute_dtype(filter_q.detach()), in_compute_dtype(filter_c.detach()))
        too_close = guide > in_compute_dtype(filter_threshold.detach())[:, None]
        if filter_keeps_target:
            too_close = too_close & ~is_target
        keep = keep & ~too_close
    return masked_logsumexp(logits, keep)
