"""`--fsdp`: full fine-tuning with weights, gradients and AdamW state sharded over the processes (PyTorch's FSDP2,
`torch.distributed.fsdp.fully_shard`), for models too large for a full copy on every GPU as DDP keeps.

    shard(encoder)                   each transformer block (the model's `_no_split_modules`), then the whole
    full_value / local_value         a DTensor's whole value (a collective) / this process's shard of it
    full_state_dict(encoder)         the unsharded weights on the main process, in CPU memory, for an export
    save_sharded / load_sharded      every process writes / reads its own shards of the weights and the AdamW
                                     state with torch.distributed.checkpoint (DCP), inside a checkpoint folder

A sharded forward gathers each block's weights from every process, so every embedding pass (training,
evaluation, export) runs on all processes at once. The loss, the gradient cache and the cross-device negatives
are the same code as under DDP: the all-gather of embeddings is independent of how the weights are held. Gradient
accumulation turns FSDP's reduce-scatter off until a batch's last chunk (distributed.no_sync).

Security: DCP reads its `.metadata` file with pickle, which can run code written into it. The checkpoint's
manifest (checkpoint.py) is checked before DCP reads anything, which guards against damage, not against a
hostile file: load sharded checkpoints you trust only.
"""

from __future__ import annotations

import torch
from torch import nn


def transformer_blocks(backbone: nn.Module) -> list[nn.Module]:
    """The modules Hugging Face keeps whole when it splits a model across devices (`_no_split_modules`: BertLayer,
    LlamaDecoderLayer...): one FSDP unit each, so one block's weights are gathered at a time."""
    names = set(getattr(backbone, "_no_split_modules", None) or [])
    blocks = [m for m in backbone.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(f"--fsdp: {type(backbone).__name__} names no transformer block class in _no_split_modules; "
                         "cannot tell where to shard it")
    return blocks


def shard(encoder: nn.Module) -> nn.Module:
    """Shard the encoder in place over the default process group: each transformer block, then the rest (the
    embeddings, final norm) as the root unit. Parameters become DTensors; build the optimizer afterwards."""
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError as exc:  # pragma: no cover - depends on the installed torch
        raise ImportError("--fsdp needs PyTorch's FSDP2 (torch.distributed.fsdp.fully_shard, torch >= 2.6)") from exc
    for block in transformer_blocks(encoder.backbone):
        fully_shard(block)
    fully_shard(encoder)
    return encoder


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective: every process calls it); a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.full_tensor() if isinstance(tensor, DTensor) else tensor


def local_value(tensor: torch.Tensor) -> torch.Tensor:
    """This process's shard of a DTensor; a plain tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def full_state_dict(encoder: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded weights of the encoder's backbone (names as backbone.state_dict() gives them), on the main
    process, in CPU memory; {} on the others. Every process must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(encoder, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    prefix = "backbone."
    return {name[len(prefix):]: value for name, value in state.items() if name.startswith(prefix)}


def save_sharded(folder: str, encoder: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Write this process's shards of the weights and the AdamW state into `folder` (every process calls it;
    DCP writes one `__RANK_0.distcp` file per process and a `.metadata` file)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optimizer_state = get_state_dict(encoder, optimizer)
    dcp.save({"model": model_state, "optimizer": optimizer_state}, checkpoint_id=folder)


def load_sharded(folder: str, encoder: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Read what save_sharded wrote into the sharded encoder and its optimizer (every process calls it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optimizer_state = get_state_dict(encoder, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(encoder, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
