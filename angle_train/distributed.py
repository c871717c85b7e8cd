"""Several processes (torchrun, DDP): in-batch negatives that span every rank.

Each rank embeds its own slice of the optimizer-step batch; `gather_with_grad` concatenates the slices
of all ranks (rank order, so the zigzag layout survives) and every rank computes the same loss on the
whole batch. Backward: every rank holds the full gradient dL/d(all embeddings); the all-reduce (sum) in
`_GatherWithGrad.backward` followed by DDP's averaging of parameter gradients over ranks yields exactly
dL/d(parameters) of one process training on the concatenated batch.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device_type: str) -> DistInfo:
    """Join the process group torchrun describes in the environment (RANK, WORLD_SIZE, LOCAL_RANK)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistInfo()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    info = DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))
    if device_type == "cuda":
        torch.cuda.set_device(info.local_rank)
    return info


def wrap_ddp(module: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """DistributedDataParallel without per-forward buffer broadcasts (our buffers never change)."""
    import inspect

    kwargs = {"device_ids": [device.index]} if device.type == "cuda" else {}
    params = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    kwargs["forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"] = False
    return torch.nn.parallel.DistributedDataParallel(module, **kwargs)


def barrier(info: DistInfo) -> None:
    """Wait until every process gets here (nothing to wait for when there is one)."""
    if info.enabled:
        dist.barrier()


def broadcast_from_main(value, info: DistInfo):
    """The main process's `value` (any picklable object), on every process."""
    if not info.enabled:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def _single_process() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1


class _GatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        world_size = dist.get_world_size()
        parts = [torch.empty_like(x) for _ in range(world_size)]
        dist.all_gather(parts, x.contiguous())
        ctx.rank, ctx.rows = dist.get_rank(), x.shape[0]
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous()
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows]


def gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """All ranks' x concatenated in rank order, differentiable; x itself when not distributed.

    Every rank must pass the same number of rows (the loop gives each rank an equal slice of the batch).
    """
    if _single_process():
        return x
    return _GatherWithGrad.apply(x)


def gather_labels(labels: torch.Tensor) -> torch.Tensor:
    if _single_process():
        return labels
    parts = [torch.empty_like(labels) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, labels.contiguous())
    return torch.cat(parts)


def no_sync(model: torch.nn.Module, skip_sync: bool):
    """DDP's no_sync() when skip_sync (gradients accumulate locally, no all-reduce); a no-op otherwise."""
    if skip_sync and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()
