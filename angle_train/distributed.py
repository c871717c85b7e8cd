"""Several processes (torchrun, DDP): in-batch negatives that span every rank.

Each rank embeds its own slice of the optimizer-step batch; `all_gather_rows` (on the package's one
differentiable all-gather, angle_kernels.distributed.all_gather_with_grad) concatenates the slices of all ranks
along the rows (rank order, so the zigzag layout survives; layer stacks [L, rows, D] too) and every rank computes
the same loss on the whole batch.
Backward: every rank holds the full gradient dL/d(all embeddings); the gather's backward (the sum over ranks
of the gradients of each rank's own rows) followed by DDP's averaging of parameter gradients over ranks
yields exactly dL/d(parameters) of one process training on the concatenated batch. Every rank must embed
the same number of rows (the loop slices the batch equally; a mismatch raises a ValueError on every rank).
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from angle_kernels.distributed import all_gather_with_grad, is_distributed

from .cli_common import is_user_error


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


def init_distributed(device_type: str, timeout_s: int = 1800) -> DistInfo:
    """Join the process group torchrun describes in the environment (RANK, WORLD_SIZE, LOCAL_RANK), whose collectives
    wait timeout_s seconds for every process (a group the caller made keeps its own)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size <= 1:
        return DistInfo()
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo",
                                timeout=datetime.timedelta(seconds=timeout_s))
    info = DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))
    if device_type == "cuda":
        torch.cuda.set_device(info.local_rank)
    return info


def check_process_device(device: torch.device) -> None:
    """Under torchrun each process trains on the GPU of its LOCAL_RANK (init_distributed). Refused before the process
    group is joined: a --device naming one GPU, which every process left for its own without a word, and a process
    whose LOCAL_RANK this machine has no GPU for (more processes a machine than GPUs: torch's 'invalid device
    ordinal' traceback once the group was joined)."""
    if device.type != "cuda" or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    if device.index is not None:
        raise ValueError(f"--device {device}: under torchrun each process takes the GPU of its LOCAL_RANK (the first "
                         "process of a machine cuda:0, the next cuda:1, ...): give --device cuda, and choose the GPUs "
                         "with CUDA_VISIBLE_DEVICES")
    local_rank, count = int(os.environ.get("LOCAL_RANK", "0")), torch.cuda.device_count()
    if local_rank >= count:
        raise ValueError(f"--device cuda: process {local_rank} of this machine (LOCAL_RANK) has no GPU; the machine "
                         f"has {count} visible (cuda:0 to cuda:{count - 1}): launch at most {count} a machine "
                         f"(torchrun --nproc-per-node {count})")


def check_processes_agree(info: DistInfo, facts: dict) -> None:
    """Refuse, on every process alike, a run whose processes disagree on what they train from (`facts`: the
    checkpoint they resume, the number of examples, a fingerprint of the data, the number of steps): each process
    reads the data and finds the checkpoint on its own, and a disagreement trained silently on mismatched slices,
    then hung where one process planned fewer steps (or started fresh beside others that resumed)."""
    if not info.enabled:
        return
    gathered = all_gather_objects(info, facts)
    differing = [key for key in facts if any(other[key] != gathered[0][key] for other in gathered)]
    if differing:
        detail = "; ".join(f"{key}: " + ", ".join(f"process {rank} {other[key]!r}" for rank, other in
                                                   enumerate(gathered)) for key in differing)
        raise ValueError(f"the processes disagree ({detail}): every process must read the same training data and "
                         "see the same --output-dir (on several machines: a shared file system)")


def all_gather_objects(info: DistInfo, value) -> list:
    """Every process's `value` (any picklable object), in rank order; [value] when there is one process. A collective:
    every process calls it."""
    if not info.enabled:
        return [value]
    gathered: list = [None] * info.world_size
    dist.all_gather_object(gathered, value)
    return gathered


def on_process(rank: int) -> str:
    """' on process RANK': the words that name the process `rank` after what failed there, in every message that
    says which process failed."""
    return f" on process {rank}"


@dataclass(frozen=True)
class Failure:
    """An exception raised on one process, as the other processes learn of it: gathered as this plain record, never as
    the exception itself (one that cannot be pickled failed the gather on its own process, leaving the others
    waiting). kind: "OSError" for any OSError, else the exception's type name; errno: an OSError's; text: its
    message, without OSError's "[Errno N] "; users: one the user fixes (cli_common.is_user_error)."""
    kind: str
    errno: int | None
    text: str
    users: bool

    @classmethod
    def of(cls, exc: BaseException) -> Failure:
        errno = exc.errno if isinstance(exc, OSError) else None
        text = str(exc).removeprefix(f"[Errno {errno}] ") if errno is not None else str(exc)
        kind = "OSError" if isinstance(exc, OSError) else type(exc).__name__
        return cls(kind=kind, errno=errno, text=text, users=is_user_error(exc))

    def raised_elsewhere(self, rank: int) -> Exception:
        """The error a process raises for this failure of process `rank`, with its message naming the process: an
        OSError with its errno, a ValueError for one the user fixes (the command lines' one line and status 2 for
        either), anything else (a bug) a RuntimeError naming its type, with a traceback."""
        said = f"{self.text}{on_process(rank)}"
        if self.kind == "OSError":
            return OSError(said) if self.errno is None else OSError(self.errno, said)
        if self.users:
            return ValueError(said)
        return RuntimeError(f"{self.kind}: {said}")


def failures_of_processes(info: DistInfo, own: BaseException | None) -> list[tuple[int, Failure]]:
    """(rank, Failure) of each process whose `own` exception is not None, in rank order. A collective: every process
    calls it, failed or not."""
    gathered = all_gather_objects(info, None if own is None else Failure.of(own))
    return [(rank, failure) for rank, failure in enumerate(gathered) if failure is not None]


def raise_first_failure(*, own: BaseException | None, failed: list[tuple[int, Failure]]) -> None:
    """Stop every process on the failures that failures_of_processes gathered: raise `own`, this process's exception,
    as it would be raised alone (traceback and message unchanged) where this process failed, else the first failed
    process's error naming that process (Failure.raised_elsewhere); return where no process failed."""
    if own is not None:
        raise own
    if failed:
        rank, failure = failed[0]
        raise failure.raised_elsewhere(rank)


@contextlib.contextmanager
def stopping_together(info: DistInfo):
    """Inside: work that not every process does, or that may fail on one alone (the main process's clearing of the
    output folder, its exports, metrics.jsonl), before the processes meet again. A collective: every process enters,
    and leaves once every process is done. An exception raised inside on any process stops every process: the one
    that raised it raises it as it would alone (traceback and message unchanged), the others the same error naming
    that process (Failure.raised_elsewhere), where they had waited at their next collective until the connection
    broke or --ddp-timeout ran out (30 minutes by default)."""
    own = None
    try:
        yield
    except Exception as exc:
        own = exc
    raise_first_failure(own=own, failed=failures_of_processes(info, own))


# How long leave_process_group releases the GIL after its barrier (its docstring says why).
_WORKERS_GRACE_S = 0.05


def leave_process_group() -> None:
    """At the end of a command's run: wait for every process, then leave the process group that init_distributed
    joined. Left to the interpreter's exit, a gloo worker thread could free the last collective's tensors during
    shutdown and abort the process (SIGABRT after a finished run: torchrun then reports the run failed); the garbage
    collection first drops what the run held.

    After the barrier returns, gloo's worker thread still holds the barrier's work object, and freeing it takes the
    GIL (the work keeps the thread-local Python state of its call); a group destroyed at that moment, the GIL held,
    joins that thread and both wait forever (seen in a two-process test: a DDP model freed on return dropped the
    group's last reference). A short sleep releases the GIL so the worker finishes first."""
    if not dist.is_initialized():
        return
    gc.collect()
    dist.barrier()
    time.sleep(_WORKERS_GRACE_S)
    dist.destroy_process_group()


def launched_rank() -> int:
    """This process's rank as torchrun's environment gives it (RANK; 0 for a single process), known before the
    process group is joined (init_distributed)."""
    return int(os.environ.get("RANK", "0")) if int(os.environ.get("WORLD_SIZE", "1")) > 1 else 0


def wrap_ddp(module: torch.nn.Module, device: torch.device, *, equal_weights: bool = False) -> torch.nn.Module:
    """DistributedDataParallel without per-forward buffer broadcasts (our buffers never change). equal_weights: the
    processes' weights are known to be equal (a new wrapper mid-run), so the main process's are not broadcast (the
    whole model, frozen weights included: 14 GB for a 7B model in 16 bits) where torch can skip it."""
    import inspect

    kwargs = {"device_ids": [device.index]} if device.type == "cuda" else {}
    params = inspect.signature(torch.nn.parallel.DistributedDataParallel.__init__).parameters
    kwargs["forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers"] = False
    if equal_weights and "init_sync" in params:
        kwargs["init_sync"] = False
    return torch.nn.parallel.DistributedDataParallel(module, **kwargs)


def broadcast_from_main(value, info: DistInfo):
    """The main process's `value` (any picklable object), on every process."""
    if not info.enabled:
        return value
    holder = [value]
    dist.broadcast_object_list(holder, src=0)
    return holder[0]


def all_gather_flat(info: DistInfo, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Every process's 1-D CPU tensors (of any lengths; the same count and dtypes on every process), as
    [process][i] in rank order, through a gloo group (NCCL gathers GPU tensors only, and start-up data has no
    business in GPU memory). A collective: every process calls it."""
    group = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    sizes = torch.tensor([t.numel() for t in tensors])
    all_sizes = [torch.empty_like(sizes) for _ in range(info.world_size)]
    dist.all_gather(all_sizes, sizes, group=group)
    gathered = [[] for _ in range(info.world_size)]
    for i, tensor in enumerate(tensors):
        longest = max(int(size[i]) for size in all_sizes)
        padded = torch.zeros(longest, dtype=tensor.dtype)
        padded[:tensor.numel()] = tensor
        parts = [torch.empty_like(padded) for _ in range(info.world_size)]
        dist.all_gather(parts, padded, group=group)
        for rank, part in enumerate(parts):
            gathered[rank].append(part[:int(all_sizes[rank][i])])
    if group is not None:
        dist.destroy_process_group(group)
    return gathered


def all_gather_rows(embeddings: torch.Tensor) -> torch.Tensor:
    """Every rank's embeddings joined along the rows (dim -2) in rank order, differentiable: [rows, D] along dim
    0, a layer stack [L, rows, D] (Espresso) along dim 1; `embeddings` itself when not distributed."""
    if not is_distributed() or embeddings.dim() == 2:
        return all_gather_with_grad(embeddings)
    return all_gather_with_grad(embeddings.movedim(-2, 0).contiguous()).movedim(0, -2)


def gather_labels(labels: torch.Tensor) -> torch.Tensor:
    """All ranks' labels concatenated in rank order (no gradient); labels itself when not distributed."""
    if not is_distributed():
        return labels
    parts = [torch.empty_like(labels) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, labels.contiguous())
    return torch.cat(parts)


def no_sync(model: torch.nn.Module, skip_sync: bool):
    """When skip_sync, gradients accumulate locally: DDP's no_sync() (no all-reduce), or FSDP's gradient sync off
    (no reduce-scatter) for the block; a no-op otherwise."""
    if skip_sync and hasattr(model, "no_sync"):
        return model.no_sync()
    if skip_sync and hasattr(model, "set_requires_gradient_sync"):
        return _fsdp_gradient_sync_off(model)
    return contextlib.nullcontext()


@contextlib.contextmanager
def _fsdp_gradient_sync_off(model: torch.nn.Module):
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
