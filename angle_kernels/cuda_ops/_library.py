"""The torch.library ops of the CUDA backend: schemas, fake implementations and autograd formulas.

Defined here in Python, not in csrc/bindings.cpp, so that they exist on every machine (CPU-only ones too):
torch.compile can trace them through their fake implementations, and tests can inspect them. The CUDA
kernels are attached to them by the compiled extension (`TORCH_LIBRARY_IMPL(angle_kernels, CUDA, m)`),
loaded by `angle_kernels.cuda_ops._extension`.

The ops carry a `cuda_` prefix so they cannot collide with ops other backends define under the same
`angle_kernels` namespace. Each forward op returns, besides its results, the small O(N) state its backward
op needs; the public wrappers in `angle_kernels.cuda_ops` hide that state.

    cuda_pair_scores_fwd(x, with_angle)            -> cos [G, K-1], angle [G, K-1], stats [G, K-1, 4]
    cuda_pair_scores_bwd(grad_cos, grad_angle, x, stats, with_angle) -> dx [G, K, D]
    cuda_ranking_fwd(scores, labels)               -> loss [], order [N], group_first [N], group_past [N]
    cuda_ranking_bwd(grad_loss, scores, order, group_first, group_past) -> grad_scores [N]
    cuda_similarity_xent_fwd(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids)
                                                   -> loss [], lse_all [M], lse_pos [M], q_norm [M], c_norm [Mc or 0]
    cuda_similarity_xent_bwd(grad_loss, q, c, lse_all, lse_pos, q_norm, c_norm, scale, target, row_weights,
                             exclude_diagonal, margin, group_ids) -> dq [M, D], dc [Mc, D] (or [0] when c is None)
"""

from __future__ import annotations

import torch

NAMESPACE = "angle_kernels"

SCHEMAS = {
    "cuda_pair_scores_fwd": "(Tensor x, bool with_angle) -> (Tensor, Tensor, Tensor)",
    "cuda_pair_scores_bwd": (
        "(Tensor grad_cos, Tensor grad_angle, Tensor x, Tensor stats, bool with_angle) -> Tensor"
    ),
    "cuda_ranking_fwd": "(Tensor scores, Tensor labels) -> (Tensor, Tensor, Tensor, Tensor)",
    "cuda_ranking_bwd": (
        "(Tensor grad_loss, Tensor scores, Tensor order, Tensor group_first, Tensor group_past) -> Tensor"
    ),
    "cuda_similarity_xent_fwd": (
        "(Tensor q, Tensor? c, float scale, str target, Tensor? row_weights, bool exclude_diagonal, "
        "float margin, Tensor? group_ids) -> (Tensor, Tensor, Tensor, Tensor, Tensor)"
    ),
    "cuda_similarity_xent_bwd": (
        "(Tensor grad_loss, Tensor q, Tensor? c, Tensor lse_all, Tensor lse_pos, Tensor q_norm, Tensor c_norm, "
        "float scale, str target, Tensor? row_weights, bool exclude_diagonal, float margin, Tensor? group_ids) "
        "-> (Tensor, Tensor)"
    ),
}

PAIR_STATS = 4  # |u|, |v|, cos, w per pair (csrc/pair_scores.cu)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 computes in float64; float32, bfloat16 and float16 accumulate in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# One FRAGMENT library for all definitions; kept alive for the life of the process.
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")


def _define_all() -> None:
    for name, schema in SCHEMAS.items():
        _LIB.define(name + schema)


_define_all()


def _op(name: str):
    return getattr(getattr(torch.ops, NAMESPACE), name).default


# ---------------------------------------------------------------------------------------------------------
# Fake (meta) implementations: shapes and dtypes only, for torch.compile and FakeTensorMode.
# ---------------------------------------------------------------------------------------------------------
@torch.library.register_fake(f"{NAMESPACE}::cuda_pair_scores_fwd")
def _pair_scores_fwd_fake(x, with_angle):
    groups, group_size, _ = x.shape
    acc = compute_dtype(x.dtype)
    pairs = (groups, group_size - 1)
    return x.new_empty(pairs, dtype=acc), x.new_empty(pairs, dtype=acc), x.new_empty((*pairs, PAIR_STATS), dtype=acc)


@torch.library.register_fake(f"{NAMESPACE}::cuda_pair_scores_bwd")
def _pair_scores_bwd_fake(grad_cos, grad_angle, x, stats, with_angle):
    return x.new_empty(x.shape)


@torch.library.register_fake(f"{NAMESPACE}::cuda_ranking_fwd")
def _ranking_fwd_fake(scores, labels):
    n = scores.shape[0]
    return (
        scores.new_empty(()),
        scores.new_empty((n,), dtype=torch.int64),
        scores.new_empty((n,), dtype=torch.int64),
        scores.new_empty((n,), dtype=torch.int64),
    )


@torch.library.register_fake(f"{NAMESPACE}::cuda_ranking_bwd")
def _ranking_bwd_fake(grad_loss, scores, order, group_first, group_past):
    return scores.new_empty(scores.shape)


@torch.library.register_fake(f"{NAMESPACE}::cuda_similarity_xent_fwd")
def _similarity_xent_fwd_fake(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids):
    acc = compute_dtype(q.dtype)
    rows = q.shape[0]
    cols = 0 if c is None else c.shape[0]
    return (
        q.new_empty((), dtype=acc),
        q.new_empty((rows,), dtype=acc),
        q.new_empty((rows,), dtype=acc),
        q.new_empty((rows,), dtype=acc),
        q.new_empty((cols,), dtype=acc),
    )


@torch.library.register_fake(f"{NAMESPACE}::cuda_similarity_xent_bwd")
def _similarity_xent_bwd_fake(
    grad_loss, q, c, lse_all, lse_pos, q_norm, c_norm, scale, target, row_weights, exclude_diagonal, margin, group_ids
):
    dc = q.new_empty((0,)) if c is None else c.new_empty(c.shape)
    return q.new_empty(q.shape), dc


# ---------------------------------------------------------------------------------------------------------
# Autograd: each forward op's backward is its _bwd op. Gradients flow to x / scores / q and c only.
# ---------------------------------------------------------------------------------------------------------
def _pair_scores_setup(ctx, inputs, output):
    x, with_angle = inputs
    _, _, stats = output
    ctx.with_angle = with_angle
    ctx.save_for_backward(x, stats)
    ctx.mark_non_differentiable(stats)


def _pair_scores_backward(ctx, grad_cos, grad_angle, _grad_stats):
    x, stats = ctx.saved_tensors
    pairs_shape = (x.shape[0], x.shape[1] - 1)
    acc = compute_dtype(x.dtype)
    if grad_cos is None:
        grad_cos = x.new_zeros(pairs_shape, dtype=acc)
    if grad_angle is None:
        grad_angle = x.new_zeros(pairs_shape, dtype=acc)
    dx = _op("cuda_pair_scores_bwd")(grad_cos, grad_angle, x, stats, ctx.with_angle)
    return dx, None


torch.library.register_autograd(
    f"{NAMESPACE}::cuda_pair_scores_fwd", _pair_scores_backward, setup_context=_pair_scores_setup
)


def _ranking_setup(ctx, inputs, output):
    scores, _labels = inputs
    _loss, order, group_first, group_past = output
    ctx.save_for_backward(scores, order, group_first, group_past)
    ctx.mark_non_differentiable(order, group_first, group_past)


def _ranking_backward(ctx, grad_loss, *_unused):
    scores, order, group_first, group_past = ctx.saved_tensors
    if grad_loss is None:
        return None, None
    return _op("cuda_ranking_bwd")(grad_loss, scores, order, group_first, group_past), None


torch.library.register_autograd(f"{NAMESPACE}::cuda_ranking_fwd", _ranking_backward, setup_context=_ranking_setup)


def _similarity_xent_setup(ctx, inputs, output):
    q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids = inputs
    _loss, lse_all, lse_pos, q_norm, c_norm = output
    ctx.has_c = c is not None
    ctx.options = (scale, target, exclude_diagonal, margin)
    ctx.save_for_backward(q, c, lse_all, lse_pos, q_norm, c_norm, row_weights, group_ids)
    ctx.mark_non_differentiable(lse_all, lse_pos, q_norm, c_norm)


def _similarity_xent_backward(ctx, grad_loss, *_unused):
    q, c, lse_all, lse_pos, q_norm, c_norm, row_weights, group_ids = ctx.saved_tensors
    if grad_loss is None:
        return (None,) * 8
    scale, target, exclude_diagonal, margin = ctx.options
    dq, dc = _op("cuda_similarity_xent_bwd")(
        grad_loss, q, c, lse_all, lse_pos, q_norm, c_norm, scale, target, row_weights, exclude_diagonal, margin,
        group_ids,
    )
    return dq, (dc if ctx.has_c else None), None, None, None, None, None, None


torch.library.register_autograd(
    f"{NAMESPACE}::cuda_similarity_xent_fwd", _similarity_xent_backward, setup_context=_similarity_xent_setup
)
