"""similarity_xent on the CUDA kernels of csrc/similarity_xent.cu: ops, fake implementations, autograd, and the op.

    cuda_similarity_xent_fwd(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids)
        -> loss [], lse_all [M], lse_pos [M], q_norm [2M], c_norm [2Mc, or 0 when c is None]
    (q_norm, c_norm: the norms of the rows scaled by their powers of two, then the scales: csrc/similarity_xent.cu)
    cuda_similarity_xent_bwd(grad_loss, q, c, lse_all, lse_pos, q_norm, c_norm, scale, target, row_weights,
                             exclude_diagonal, margin, group_ids) -> dq [M, D], dc [Mc, D] (or [0] when c is None)
"""

from __future__ import annotations

import torch

from ..contract import compute_dtype
from ._library import define, op

PATHS = ("fused",)  # the one code path (no dims), verified on GPUs on its own (angle_kernels.verified)

FWD = define(
    "cuda_similarity_xent_fwd",
    "(Tensor q, Tensor? c, float scale, str target, Tensor? row_weights, bool exclude_diagonal, float margin, "
    "Tensor? group_ids) -> (Tensor, Tensor, Tensor, Tensor, Tensor)",
)
BWD = define(
    "cuda_similarity_xent_bwd",
    "(Tensor grad_loss, Tensor q, Tensor? c, Tensor lse_all, Tensor lse_pos, Tensor q_norm, Tensor c_norm, "
    "float scale, str target, Tensor? row_weights, bool exclude_diagonal, float margin, Tensor? group_ids) "
    "-> (Tensor, Tensor)",
)


@torch.library.register_fake(FWD)
def _fwd_fake(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids):
    acc = compute_dtype(q.dtype)
    rows = q.shape[0]
    cols = 0 if c is None else c.shape[0]
    per_row = q.new_empty((rows,), dtype=acc)
    return q.new_empty((), dtype=acc), per_row, per_row.new_empty((rows,)), per_row.new_empty((2 * rows,)), \
        per_row.new_empty((2 * cols,))


@torch.library.register_fake(BWD)
def _bwd_fake(grad_loss, q, c, lse_all, lse_pos, q_norm, c_norm, scale, target, row_weights, exclude_diagonal,
              margin, group_ids):
    dc = q.new_empty((0,)) if c is None else c.new_empty(c.shape)
    return q.new_empty(q.shape), dc


def _setup_context(ctx, inputs, output):
    q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids = inputs
    _loss, lse_all, lse_pos, q_norm, c_norm = output
    ctx.has_c = c is not None
    ctx.options = (scale, target, exclude_diagonal, margin)
    ctx.save_for_backward(q, c, lse_all, lse_pos, q_norm, c_norm, row_weights, group_ids)
    ctx.mark_non_differentiable(lse_all, lse_pos, q_norm, c_norm)


def _backward(ctx, grad_loss, *_unused):
    q, c, lse_all, lse_pos, q_norm, c_norm, row_weights, group_ids = ctx.saved_tensors
    if grad_loss is None:
        return (None,) * 8
    scale, target, exclude_diagonal, margin = ctx.options
    dq, dc = op("cuda_similarity_xent_bwd")(
        grad_loss, q, c, lse_all, lse_pos, q_norm, c_norm, scale, target, row_weights, exclude_diagonal, margin,
        group_ids,
    )
    return dq, (dc if ctx.has_c else None), None, None, None, None, None, None


torch.library.register_autograd(FWD, _backward, setup_context=_setup_context)


def similarity_xent(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0, group_ids=None,
                    dims=None):
    """Softmax cross-entropy over scaled cosines, flash-style (never M x Mc in memory); see angle_kernels.dispatch."""
    outputs = op("cuda_similarity_xent_fwd")(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids)
    return outputs[0]
