"""The differentiable all-gather the package's cross-device negatives use (torch.distributed).

`all_gather_with_grad(x)` concatenates the `x` of every rank, in rank order, and keeps the graph: in
backward, rank r receives the sum over all ranks of the cotangents of its own rows (the gradient of a
reduce-scatter), so a loss computed on every rank from gathered tensors gives each rank's embeddings the
gradient of the SUM of the ranks' losses. Under DDP, which averages parameter gradients over ranks, that is
the gradient of the mean of the ranks' losses.

`all_gather_many_with_grad(named, local_check)` gathers a loss's columns the same way after one small collective
for all of them, in which the ranks agree that they may (every rank's own checks passed, the same tensors
everywhere, the same of them taking the gather's backward, the same options of the loss): a refusal on one rank is a
refusal on every rank, none is left waiting in a collective.
`refused_together` extends that to a loss's own checks that run before it gathers (its options, the structure of
its arguments).

Users:
  * the losses with gather_across_devices=True (multiple_negatives_ranking_loss, gist_loss: the columns at once),
    and so the sentence-transformers drop-ins (each rank scores its own queries against every rank's documents).
  * angle_train (distributed.py, grad_cache.py): every rank computes the loss of the whole gathered batch.

Without an initialised process group, or with one process, it is the identity (no copy, no collective).

What no agreement can catch: a rank that makes no gather at all (gather_across_devices=False there, or one loss
call fewer per step) never joins one, so the ranks that gather wait for it in theirs until the process group's
timeout; with gloo that timeout then raises a RuntimeError saying so (NCCL's watchdog ends the process instead).
TORCH_DISTRIBUTED_DEBUG=DETAIL has torch check every collective's kind and shapes across the ranks, which finds it
at the cost of a collective per collective.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Callable, Iterator, Mapping

import torch

from . import user_warnings

__all__ = ["all_gather_many_with_grad", "all_gather_with_grad", "gathering_rank_and_world_size", "is_distributed",
           "rank_and_world_size", "refused_together"]


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


_warned_not_distributed = False


def gathering_rank_and_world_size() -> tuple[int, int]:
    """rank_and_world_size for a loss asked to gather across devices (gather_across_devices=True); warns once per
    process where torch.distributed is not initialised: the loss then takes this process's batch only (a job whose
    process group was never set up would train without the other ranks' negatives), as sentence-transformers'
    gathering does, which warns the same."""
    global _warned_not_distributed
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) and not _warned_not_distributed:
        _warned_not_distributed = True
        user_warnings.warn("gather_across_devices=True, but torch.distributed is not initialised: the loss takes "
                           "this process's batch only (expected with one process; otherwise initialise the process "
                           "group before the first loss call)")
    return rank_and_world_size()


def _layout(x: torch.Tensor) -> list[int]:
    """(rows, dims, elements per row, dtype code) of a tensor to gather: the same on every process for the same
    layout (the dtype by crc32 of its name, unlike hash())."""
    row_elements = 1
    for size in x.shape[1:]:
        row_elements *= size
    return [x.shape[0] if x.dim() else -1, x.dim(), row_elements, _checksum(str(x.dtype))]


# How many entries of a call's `options` the agreement compares, each by its own checksum (so that a refusal names
# the one that differs): a fixed number, as every rank's record must have the same length (a rank that only
# refuses, refused_together, passes none).
OPTION_SLOTS = 12


def _checksum(text: str) -> int:
    """crc32 of `text`: the same on every process (unlike hash(), salted per process)."""
    return zlib.crc32(text.encode())


def _option_checksums(options: Mapping[str, object] | None) -> list[int]:
    """One checksum per entry of `options` (of its name and repr), then -1 up to OPTION_SLOTS."""
    entries = list((options or {}).items())
    if len(entries) > OPTION_SLOTS:
        raise ValueError(f"options: the agreement compares at most {OPTION_SLOTS} entries, got {len(entries)}")
    return [_checksum(f"{name}={value!r}") for name, value in entries] + [-1] * (OPTION_SLOTS - len(entries))


def _by_value(values: list[int]) -> str:
    """The ranks grouped by their value, in rank order of each group's first: "[0, 2] against [1]"."""
    groups: dict[int, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return " against ".join(str(ranks) for ranks in groups.values())


# The process-group backends whose single-tensor collectives the gather uses: all_gather straight into the
# output, and a reduce-scatter in backward, which moves half the bytes of an all-reduce and needs no copy of the
# cotangent. Gloo's reduce-scatter is an all-reduce underneath and older gloo builds lack both, so every other
# backend takes the list all_gather and an all_reduce, which all implement.
SINGLE_TENSOR_BACKENDS = ("nccl",)


def _single_tensor_collectives(x: torch.Tensor) -> bool:
    """Whether the gather of `x` takes the single-tensor collectives: a group of a SINGLE_TENSOR_BACKENDS backend, or
    a CUDA tensor in a group whose backend for CUDA is NCCL: one per device ("cpu:gloo,cuda:nccl"), or one not
    chosen yet ("undefined": init_process_group() without a backend picks NCCL for CUDA at the first collective)."""
    import torch.distributed as dist

    backend = str(dist.get_backend()).lower()
    return backend in SINGLE_TENSOR_BACKENDS or (x.is_cuda and ("nccl" in backend or backend == "undefined"))


def _collective(single: str, older: str):
    """torch.distributed's collective named `single` (torch 2.13's names), else `older` (its name before)."""
    import torch.distributed as dist

    return getattr(dist, single, None) or getattr(dist, older)


class _AllGatherWithGrad(torch.autograd.Function):
    """Forward: every rank's x concatenated in rank order. Backward: this rank's rows of the sum over ranks of
    the output's cotangent: a reduce-scatter on the SINGLE_TENSOR_BACKENDS, elsewhere an all_reduce of the whole
    cotangent and this rank's rows of it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        world_size = dist.get_world_size()
        ctx.rank, ctx.rows, ctx.single = dist.get_rank(), x.shape[0], _single_tensor_collectives(x)
        if ctx.single:
            out = x.new_empty((world_size * x.shape[0], *x.shape[1:]))
            _collective("all_gather_single", "all_gather_into_tensor")(out, x.contiguous())
            return out
        parts = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(world_size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=0)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        import torch.distributed as dist

        if ctx.single:  # reads the cotangent, writes only its own output
            out = grad.new_empty((ctx.rows, *grad.shape[1:]))
            _collective("reduce_scatter_single", "reduce_scatter_tensor")(out, grad.contiguous(),
                                                                         op=dist.ReduceOp.SUM)
            return out
        # A copy, reduced in place: autograd may hand the same cotangent tensor to other nodes too (the
        # backward of an addition passes its gradient to both operands), so it must not be overwritten.
        grad = grad.clone(memory_format=torch.contiguous_format)
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad[ctx.rank * ctx.rows:(ctx.rank + 1) * ctx.rows]


def all_gather_many_with_grad(named: list[tuple[str, torch.Tensor]],
                              local_check: Callable[[], None] | None = None, *,
                              device: torch.device | str | None = None,
                              options: Mapping[str, object] | None = None) -> list[torch.Tensor]:
    """Each tensor of `named` ((name, tensor) pairs) gathered as all_gather_with_grad gathers one, after ONE small
    collective for all of them (not one per tensor) in which the ranks agree that they may: `local_check` (this
    rank's checks of what the other ranks cannot see, e.g. its inputs that are not gathered) passed on every rank,
    every rank passes the same `options`, and every rank gathers as many tensors, with the same rows, row shapes
    and dtypes, the same of them taking the gather's backward (requiring grad, with grad mode on: a rank without
    that backward would leave the others waiting in its collective). Otherwise every rank raises, none is left
    waiting in a collective: a rank whose check failed, its own error; the others a ValueError naming it; options or
    a layout that differ, the same ValueError on every rank, naming what differs and the ranks on each side.
    Without torch.distributed (or with one process): `local_check`, then the tensors themselves. `device`: where the
    agreement's small tensor lives when `named` is empty (a rank that only refuses, `refused_together`); otherwise
    the first tensor's device. `options`: the call's configuration that every rank must share (name: value, at
    most OPTION_SLOTS entries, e.g. a loss's name and options), compared entry by entry by checksums of their reprs
    in the same collective."""
    global _agreements
    tensors = [t for _, t in named]
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"all_gather_many_with_grad expects tensors, got {type(t).__name__} for {name}")
    if not is_distributed():
        if local_check is not None:
            local_check()
        return tensors
    import torch.distributed as dist

    option_checksums = _option_checksums(options)
    refusal = None
    if local_check is not None:
        try:
            local_check()
        except Exception as exc:  # settled with the other ranks first, then raised
            refusal = exc
    # dist.all_gather of unequal tensors hangs or silently mixes up rows: one small all_gather of (refused, count,
    # a checksum of every tensor's layout, the first tensor's layout, which tensors take the gather's backward
    # collective, the options' checksums) finds a mismatch on every rank at once
    everything = repr(tuple((tuple(t.shape), str(t.dtype)) for t in tensors))
    backward = [torch.is_grad_enabled() and t.requires_grad for t in tensors]
    mine = torch.tensor([refusal is not None, len(tensors), _checksum(everything),
                         *(_layout(tensors[0]) if tensors else [-1, -1, -1, -1]), _checksum(repr(backward)),
                         *option_checksums],
                        dtype=torch.int64, device=tensors[0].device if tensors else (device or "cpu"))
    records = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    _agreements += 1  # this rank has joined the agreement: a later refusal is no longer refused_together's to share
    rank = dist.get_rank()
    try:
        dist.all_gather(records, mine)
    except RuntimeError as exc:
        if not _ranks_did_not_come(exc):  # another failure (a device's error): its own message says what it is
            raise
        # the one place to say what usually causes a wait that ended so
        raise RuntimeError(
            f"rank {rank} waited for the other ranks to agree to gather {[name for name, _ in named]} and they did "
            "not come: every rank must make the same gathering calls in the same order (each loss with "
            "gather_across_devices=True on every rank, as many calls per step); a rank that gathers nothing never "
            "joins, and only the process group's timeout ends the wait (TORCH_DISTRIBUTED_DEBUG=DETAIL checks every "
            f"collective across the ranks). The collective's error: {exc}") from exc
    records = [[int(v) for v in record.tolist()] for record in records]
    if refusal is not None:
        raise refusal
    refused = [r for r, record in enumerate(records) if record[0]]
    if refused:
        raise ValueError(f"rank(s) {refused} refused their inputs (their error says why); rank {rank} raises too "
                         "rather than wait for them in the next collective")
    differ = [i for i in range(OPTION_SLOTS) if len({record[-OPTION_SLOTS + i] for record in records}) > 1]
    if differ:
        entries = list((options or {}).items())
        said = [f"{entries[i][0]} (ranks {_by_value([record[-OPTION_SLOTS + i] for record in records])}; rank "
                f"{rank} has {entries[i][1]!r})" if i < len(entries) else f"option {i + 1} (rank {rank} has none)"
                for i in differ]
        raise ValueError(f"every rank must call the loss with the same options; they differ in {'; '.join(said)}")
    counts = [record[1] for record in records]
    if len(set(counts)) > 1:
        raise ValueError(f"every rank must gather the same tensors: tensors per rank {counts} (this is rank {rank}: "
                         f"{[name for name, _ in named]})")
    firsts = [record[3:7] for record in records]  # the first tensor's (rows, dims, elements per row, dtype)
    rows = [first[0] for first in firsts]
    if len(set(rows)) > 1:
        raise ValueError(
            f"all_gather_with_grad needs the same number of rows on every rank, got rows per rank {rows} (this is "
            f"rank {rank}, shape {tuple(tensors[0].shape)}); give every process an equal slice of the batch (e.g. "
            "drop the last incomplete batch)")
    if any(first != firsts[0] for first in firsts):
        raise ValueError(
            "all_gather_with_grad needs tensors of the same row shape and dtype on every rank, got "
            f"(dims, elements per row) {[first[1:3] for first in firsts]} and dtypes that "
            f"{'differ' if len({first[3] for first in firsts}) > 1 else 'agree'} "
            f"(this is rank {rank}: shape {tuple(tensors[0].shape)}, {tensors[0].dtype})")
    if len({record[2] for record in records}) > 1:
        raise ValueError(
            "all_gather_with_grad needs tensors of the same rows, row shape and dtype on every rank; the ranks' "
            f"differ (this is rank {rank}: {[(name, tuple(t.shape), t.dtype) for name, t in named]})")
    if len({record[7] for record in records}) > 1:
        taking = [name for (name, _), takes in zip(named, backward) if takes]
        raise ValueError(
            "every rank must gather the same tensors with gradients (requires_grad, grad mode on): the gather's "
            "backward is a collective, and a rank without it would leave the others waiting there; the ranks "
            f"{_by_value([record[7] for record in records])} differ (this is rank {rank}: with gradients "
            f"{taking}, grad mode {'on' if torch.is_grad_enabled() else 'off'})")
    for name, t in named:
        if t.dim() == 0:
            raise ValueError(f"all_gather_with_grad concatenates along dim 0: {name} must have at least one "
                             "dimension")
    return [_AllGatherWithGrad.apply(t) for t in tensors]


# What the collectives raise where the other ranks did not come: gloo's RuntimeError when the group's timeout ends
# the wait ("Timed out waiting 1800000ms for recv operation to complete") or a peer process is gone ("Connection
# closed by peer"), NCCL's DistBackendError (its watchdog's timeout, an aborted communicator, a remote rank gone),
# DistNetworkError (the store or the network between the ranks).
# Words of the errors a collective raises when the other ranks did not come to it: gloo's and NCCL's timeouts ("Timed
# out waiting 2000ms", the watchdog's "ran for 600000 milliseconds before timing out"), a peer gone ("Connection closed
# by peer", "Connection reset by peer") and NCCL's communicator aborted after one of those. NCCL raises the same
# DistBackendError type for its other failures (a CUDA error inside a collective, an invalid argument): the type alone
# says nothing of why.
_WAIT_ENDED = ("timed out", "timeout", "timing out", "connection closed by peer", "connection reset by peer",
               "communicator was aborted")


def _ranks_did_not_come(error: RuntimeError) -> bool:
    """Whether `error`, raised by a collective, says that the other ranks did not come to it (a timeout, a group
    broken by a rank gone), rather than failing for another reason (a device's error, a bad argument)."""
    import torch.distributed as dist

    if isinstance(error, dist.DistNetworkError):  # the store or a socket: the group lost a rank
        return True
    message = str(error).lower()
    return any(words in message for words in _WAIT_ENDED)


# How many agreements (all_gather_many_with_grad's collective) this process has joined: refused_together shares a
# refusal with the other ranks only where the refusing call never reached its own.
_agreements = 0


def _refusing(error: Exception) -> Callable[[], None]:
    def check() -> None:
        raise error
    return check


@contextlib.contextmanager
def refused_together(gathering: object, hint: object = None) -> Iterator[None]:
    """Around a loss's checks that run before it gathers (its options, the structure of its arguments): where
    `gathering` and torch.distributed runs several processes, an exception raised inside before this rank joined
    all_gather_many_with_grad's agreement joins it now, as a refusal, so that the other ranks, waiting there to
    gather, raise a ValueError naming this rank instead of waiting for it until the process group's timeout (a
    scale, a directions name or a column list that one rank alone refuses). `hint`: a tensor argument of the call,
    whose device the agreement's small tensor takes (CUDA tensors under NCCL); when it is not a tensor (the refusal
    may be of that very argument), the current CUDA device in a group of NCCL alone, else the CPU.
    Exceptions raised after this rank joined the agreement propagate as they are."""
    try:
        gathering = bool(gathering)  # the loss checks the flag itself, inside
    except Exception:
        gathering = False
    if not (gathering and is_distributed()):
        yield
        return
    joined = _agreements
    try:
        yield
    except Exception as exc:
        if _agreements != joined:
            raise
        device = hint.device if isinstance(hint, torch.Tensor) else _agreement_device()
        all_gather_many_with_grad([], _refusing(exc), device=device)  # raises exc, after the other ranks heard it
        raise


def _agreement_device() -> torch.device:
    """Where a refusal with no tensor to go by meets the other ranks: the current CUDA device where the group's one
    backend is NCCL (which gathers no CPU tensor), else the CPU."""
    import torch.distributed as dist

    if str(dist.get_backend()).lower() in SINGLE_TENSOR_BACKENDS and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_gather_with_grad(x: torch.Tensor) -> torch.Tensor:
    """The `x` of every rank concatenated along dim 0 in rank order ([world_size * rows, ...]), differentiable.

    Backward gives this rank's `x` the sum over all ranks of the cotangents of its rows. Every rank must call
    it (and, later, backward through it) in the same order, with the same number of rows, row shape and dtype;
    a mismatch raises a ValueError on every rank. Returns `x` itself when torch.distributed is not initialised
    or has one process.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"all_gather_with_grad expects a torch.Tensor, got {type(x).__name__}")
    return all_gather_many_with_grad([("x", x)])[0]  # the layout agreed first: a refusal on every rank, or some hang
