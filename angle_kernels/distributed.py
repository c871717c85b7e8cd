"""The differentiable all-gather the package's cross-device negatives use (torch.distributed).

`all_gather_with_grad(x)` concatenates the `x` of every rank, in rank order, and keeps the graph: in
backward, rank r receives the sum over all ranks of the cotangents of its own rows (the gradient of a
reduce-scatter), so a loss computed on every rank from gathered tensors gives each rank's embeddings the
gradient of the SUM of the ranks' losses. Under DDP, which averages parameter gradients over ranks, that is
the gradient of the mean of the ranks' losses.

Users:
  * angle_kernels.integrations.sentence_transformers: MultipleNegativesRankingLoss and its cached version
    with gather_across_devices=True (each rank scores its own queries against every rank's documents).
  * angle_train (distributed.py, grad_cache.py): every rank computes the loss of the whole gathered batch.

Without an initialised process group, or with one process, it is the identity (no copy, no collective).
"""

from __future__ import annotations

import zlib

import torch

__all__ = ["all_gather_with_grad", "is_distributed", "rank_and_world_size"]


def is_distributed() -> bool:
    """True when torch.distributed is initialised with more than one process."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def rank_and_world_size() -> tuple[int, int]:
    """(rank, world size) of the default process group; (0, 1) when not distributed."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _check_same_layout(x: torch.Tensor, world_size: int) -> None:
    """Every rank must pass the same row count, row shape and dtype: dist.all_gather of unequal tensors
    hangs or silently mixes up rows. One small all_gather of (rows, dims, elements per row, dtype) finds a
    mismatch, on every rank at once, so that all of them raise the same error instead of some hanging."""
    import torch.distributed as dist

    row_elements = 1
    for size in x.shape[1:]:
        row_elements *= size
    dtype_code = zlib.crc32(str(x.dtype).encode())  # the same on every process (unlike hash())
    mine = torch.tensor([x.shape[0] if x.dim() else -1, x.dim(), row_elements, dtype_code], dtype=torch.int64,
                        device=x.device)
    layouts = [torch.empty_like(mine) for _ in range(world_size)]
    dist.all_gather(layouts, mine)
    layouts = [tuple(int(v) for v in layout.tolist()) for layout in layouts]
    if all(layout == layouts[0] for layout in layouts):
        return
    rows = [layout[0] for layout in layouts]
    if len(set(rows)) > 1:
        raise ValueError(
            "all_gather_with_grad needs the same number of rows on every rank, got rows per rank "
            f"{rows} (this is rank {dist.get_rank()}, shape {tuple(x.shape)}); give every process an equal "
            "slice of the batch (e.g. drop the last incomplete batch)"
        )
    raise ValueError(
        "all_gather_with_grad needs tensors of the same row shape and dtype on every rank, got "
        f"(dims, elements per row) {[layout[1:3] for layout in layouts]} and dtypes that "
        f"{'differ' if len({layout[3] for layout in layouts}) > 1 else 'agree'} "
        f"(this is rank {dist.get_rank()}: shape {tuple(x.shape)}, {x.dtype})"
    )


class _AllGatherWithGrad(torch.autograd.Function):
    """Forward: dist.all_gather, concatenated in rank order. Backward: all_reduce(sum) of the cotangent of
    the whole output, then this rank's rows (a reduce-scatter written with all_reduce, which every backend,
    gloo included, implements)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        world_size = dist.get_world_size()
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world_size)]
        dist.all_gather(parts, x.contiguous())
        ctx.rank, ctx.rows = dist.get_rank(), x.shape[0]
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        # A copy, reduced in place: autograd may hand the same cotangent tensor to other nodes too (the
        # backward of an addition passes its gradient to both operands), so it must not be overwritten.
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows]


def all_gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """The `x` of every rank concatenated along dim 0 in rank order ([world_size * rows, ...]), differentiable.

    Backward gives this rank's `x` the sum over all ranks of the cotangents of its rows. Every rank must call
    it (and, later, backward through it) in the same order, with the same number of rows, row shape and dtype;
    a mismatch raises a ValueError on every rank. Returns `x` itself when torch.distributed is not initialised
    or has one process.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"all_gather_with_grad expects a torch.Tensor, got {type(x).__name__}")
    if not is_distributed():
        return x
    import torch.distributed as dist

    _check_same_layout(x, dist.get_world_size())  # first: a refusal must happen on every rank, or some hang
    if x.dim() == 0:
        raise ValueError("all_gather_with_grad concatenates along dim 0: x must have at least one dimension")
    return _AllGatherWithGrad.apply(x)
