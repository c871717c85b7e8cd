"""ranking_loss on the CUDA kernels of csrc/ranking_loss.cu: ops, fake implementations, autograd, and the op.

    cuda_ranking_fwd(scores, labels)  -> loss [], order [N], group_first [N], group_past [N]
    cuda_ranking_bwd(grad_loss, scores, order, group_first, group_past) -> grad_scores [N]

The binding sorts the labels with at::sort, so they arrive in a dtype whose order and equality are exact:
float64 for floating labels, int64 for integers.
"""

from __future__ import annotations

import torch

from ._library import define, op

PATHS = ("sort",)  # the one code path, verified on GPUs on its own (angle_kernels.verified)

FWD = define("cuda_ranking_fwd", "(Tensor scores, Tensor labels) -> (Tensor, Tensor, Tensor, Tensor)")
BWD = define(
    "cuda_ranking_bwd",
    "(Tensor grad_loss, Tensor scores, Tensor order, Tensor group_first, Tensor group_past) -> Tensor",
)


@torch.library.register_fake(FWD)
def _fwd_fake(scores, labels):
    n = scores.shape[0]
    index = scores.new_empty((n,), dtype=torch.int64)
    return scores.new_empty(()), index, index.new_empty((n,)), index.new_empty((n,))


@torch.library.register_fake(BWD)
def _bwd_fake(grad_loss, scores, order, group_first, group_past):
    return scores.new_empty(scores.shape)


def _setup_context(ctx, inputs, output):
    scores, _labels = inputs
    _loss, order, group_first, group_past = output
    ctx.save_for_backward(scores, order, group_first, group_past)
    ctx.mark_non_differentiable(order, group_first, group_past)


def _backward(ctx, grad_loss, *_unused):
    scores, order, group_first, group_past = ctx.saved_tensors
    if grad_loss is None:
        return None, None
    return op("cuda_ranking_bwd")(grad_loss, scores, order, group_first, group_past), None


torch.library.register_autograd(FWD, _backward, setup_context=_setup_context)


def ranking_loss(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log(1 + sum over label_i < label_j of exp(s_i - s_j)); see angle_kernels.dispatch."""
    exact_labels = labels.to(torch.float64 if labels.is_floating_point() else torch.int64)
    loss, _order, _first, _past = op("cuda_ranking_fwd")(scores, exact_labels)
    return loss
