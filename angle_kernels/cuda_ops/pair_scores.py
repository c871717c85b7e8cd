"""pair_scores on the CUDA kernels of csrc/pair_scores.cu: ops, fake implementations, autograd, and the op.

    cuda_pair_scores_fwd(x, with_angle)  -> cos [G, K-1], angle [G, K-1], stats [G, K-1, 6]
    cuda_pair_scores_bwd(grad_cos, grad_angle, x, stats, with_angle) -> dx [G, K, D]
    cuda_pair_scores_dims_fwd(x, with_angle, dims)  -> cos [k, G, K-1], angle [k, G, K-1], stats [k, G, K-1, 6]
    cuda_pair_scores_dims_bwd(grad_cos, grad_angle, x, stats, with_angle, dims) -> dx [G, K, D]

The dims ops compute every prefix x[..., :d_i] in one read of each row (csrc/pair_scores.cu, nested prefixes), at
most MAX_PREFIXES widths per call: longer dims are computed in calls of MAX_PREFIXES prefixes each.
"""

from __future__ import annotations

import torch

from ..contract import compute_dtype
from ._library import define, op

FEATURES = ("dims",)  # the optional features this op implements (contract.OPTIONAL_FEATURES)
PATHS = ("full", "dims")  # the single-width kernels, the prefix kernels: each verified on GPUs on its own

PAIR_STATS = 6  # |u_s|, |v_s|, cos, w, s_u, s_v per pair: the scaled rows' norms and scales (csrc/pair_scores.cu)
MAX_PREFIXES = 32  # prefix widths per call of the dims ops (csrc/pair_scores.cu, kMaxPrefixes)

FWD = define("cuda_pair_scores_fwd", "(Tensor x, bool with_angle) -> (Tensor, Tensor, Tensor)")
BWD = define(
    "cuda_pair_scores_bwd", "(Tensor grad_cos, Tensor grad_angle, Tensor x, Tensor stats, bool with_angle) -> Tensor"
)
DIMS_FWD = define("cuda_pair_scores_dims_fwd", "(Tensor x, bool with_angle, int[] dims) -> (Tensor, Tensor, Tensor)")
DIMS_BWD = define(
    "cuda_pair_scores_dims_bwd",
    "(Tensor grad_cos, Tensor grad_angle, Tensor x, Tensor stats, bool with_angle, int[] dims) -> Tensor",
)


def code_path(x, with_angle, dims=None) -> str:
    """The one of PATHS that computes this call: the prefix kernels with dims, else the single-width ones."""
    return "full" if dims is None else "dims"


def _scores_fake(x, leading: tuple[int, ...]):
    groups, group_size, _ = x.shape
    acc = compute_dtype(x.dtype)
    pairs = (*leading, groups, group_size - 1)
    return x.new_empty(pairs, dtype=acc), x.new_empty(pairs, dtype=acc), x.new_empty((*pairs, PAIR_STATS), dtype=acc)


@torch.library.register_fake(FWD)
def _fwd_fake(x, with_angle):
    return _scores_fake(x, ())


@torch.library.register_fake(BWD)
def _bwd_fake(grad_cos, grad_angle, x, stats, with_angle):
    return x.new_empty(x.shape)


@torch.library.register_fake(DIMS_FWD)
def _dims_fwd_fake(x, with_angle, dims):
    return _scores_fake(x, (len(dims),))


@torch.library.register_fake(DIMS_BWD)
def _dims_bwd_fake(grad_cos, grad_angle, x, stats, with_angle, dims):
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    x, with_angle, *dims = inputs  # dims: the dims ops' third input
    _, _, stats = output
    ctx.with_angle = with_angle
    ctx.dims = dims[0] if dims else None
    ctx.save_for_backward(x, stats)
    ctx.mark_non_differentiable(stats)


def _backward(ctx, grad_cos, grad_angle, _grad_stats):
    x, stats = ctx.saved_tensors
    scores_shape = stats.shape[:-1]  # [G, K-1], or [k, G, K-1] with dims
    acc = compute_dtype(x.dtype)
    if grad_cos is None:
        grad_cos = x.new_zeros(scores_shape, dtype=acc)
    if grad_angle is None:
        grad_angle = x.new_zeros(scores_shape, dtype=acc)
    if ctx.dims is None:
        return op("cuda_pair_scores_bwd")(grad_cos, grad_angle, x, stats, ctx.with_angle), None
    return op("cuda_pair_scores_dims_bwd")(grad_cos, grad_angle, x, stats, ctx.with_angle, ctx.dims), None, None


torch.library.register_autograd(FWD, _backward, setup_context=_setup_context)
torch.library.register_autograd(DIMS_FWD, _backward, setup_context=_setup_context)


def _single_width(x, with_angle):
    cos, angle, _stats = op("cuda_pair_scores_fwd")(x, with_angle)
    return cos, angle


def _prefixes(x, with_angle, dims):
    dims = list(dims)
    parts = [op("cuda_pair_scores_dims_fwd")(x, with_angle, dims[start:start + MAX_PREFIXES])
             for start in range(0, len(dims), MAX_PREFIXES)]
    if len(parts) == 1:
        return parts[0][0], parts[0][1]
    return torch.cat([cos for cos, _, _ in parts]), torch.cat([angle for _, angle, _ in parts])


def pair_scores(x: torch.Tensor, with_angle: bool, dims=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, angle) of the pairs (x[g, 0], x[g, k]) of x [G, K, D], or of every prefix x[..., :d] (d in dims, outputs
    [k, G, K-1]); see angle_kernels.dispatch."""
    if dims is None:
        return _single_width(x, with_angle)
    return _prefixes(x, with_angle, dims)
