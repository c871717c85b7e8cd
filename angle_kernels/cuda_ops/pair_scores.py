"""pair_scores on the CUDA kernels of csrc/pair_scores.cu: ops, fake implementations, autograd, and the op.

    cuda_pair_scores_fwd(x, with_angle)  -> cos [G, K-1], angle [G, K-1], stats [G, K-1, 6]
    cuda_pair_scores_bwd(grad_cos, grad_angle, x, stats, with_angle) -> dx [G, K, D]
"""

from __future__ import annotations

import torch

from ..contract import compute_dtype
from ._library import define, op

PATHS = ("full",)  # the one code path (no dims), verified on GPUs on its own (angle_kernels.verified)

PAIR_STATS = 6  # |u_s|, |v_s|, cos, w, s_u, s_v per pair: the scaled rows' norms and scales (csrc/pair_scores.cu)

FWD = define("cuda_pair_scores_fwd", "(Tensor x, bool with_angle) -> (Tensor, Tensor, Tensor)")
BWD = define(
    "cuda_pair_scores_bwd", "(Tensor grad_cos, Tensor grad_angle, Tensor x, Tensor stats, bool with_angle) -> Tensor"
)


@torch.library.register_fake(FWD)
def _fwd_fake(x, with_angle):
    groups, group_size, _ = x.shape
    acc = compute_dtype(x.dtype)
    pairs = (groups, group_size - 1)
    return x.new_empty(pairs, dtype=acc), x.new_empty(pairs, dtype=acc), x.new_empty((*pairs, PAIR_STATS), dtype=acc)


@torch.library.register_fake(BWD)
def _bwd_fake(grad_cos, grad_angle, x, stats, with_angle):
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    x, with_angle = inputs
    _, _, stats = output
    ctx.with_angle = with_angle
    ctx.save_for_backward(x, stats)
    ctx.mark_non_differentiable(stats)


def _backward(ctx, grad_cos, grad_angle, _grad_stats):
    x, stats = ctx.saved_tensors
    pairs_shape = (x.shape[0], x.shape[1] - 1)
    acc = compute_dtype(x.dtype)
    if grad_cos is None:
        grad_cos = x.new_zeros(pairs_shape, dtype=acc)
    if grad_angle is None:
        grad_angle = x.new_zeros(pairs_shape, dtype=acc)
    return op("cuda_pair_scores_bwd")(grad_cos, grad_angle, x, stats, ctx.with_angle), None


torch.library.register_autograd(FWD, _backward, setup_context=_setup_context)


def pair_scores(x: torch.Tensor, with_angle: bool, dims=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, angle) of the pairs (x[g, 0], x[g, k]) of x [G, K, D]; see angle_kernels.dispatch."""
    cos, angle, _stats = op("cuda_pair_scores_fwd")(x, with_angle)
    return cos, angle
