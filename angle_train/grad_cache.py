"""One backward pass over a batch, two ways: plain backprop, or a gradient cache for huge batches.

Plain backprop keeps the activations of every text of the batch alive until the loss is known, so the
batch size is limited by activation memory. The gradient cache (Gao et al., "Scaling Deep Contrastive
Learning Batch Size under Memory Limited Setup", 2021) splits the work:
  1. embed the batch chunk by chunk without a graph (memory: one chunk's activations at a time), and
     remember the RNG state before each chunk;
  2. compute the loss on all embeddings (gathered across ranks) and backpropagate to the embeddings
     only: their gradients are the "cache" (memory: rows x D);
  3. re-embed each chunk with a graph, replaying the saved RNG state so dropout draws the same masks
     as in step 1, and backpropagate the cached gradient through it.
Step 3 computes sum_i (dL/de_i) . de_i/dtheta = dL/dtheta: the same gradient as plain backprop of the
same chunks, at the price of one extra forward pass. Under DDP, the parameter all-reduce is skipped
(no_sync) for every chunk but the last.

Embeddings are [rows, D], or a layer stack [L, rows, D] (Espresso training): chunks, caches and gathers join
them along the rows (dim -2) either way.
"""

from __future__ import annotations

import contextlib

import torch

from .distributed import all_gather_rows, gather_labels, no_sync
from .profiling import phase


class RngState:
    """The CPU and (if used) CUDA generator states, to replay dropout exactly."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cpu = torch.get_rng_state()
        self.cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None

    def restore(self) -> None:
        """Set the generators back to the saved states (a step retried from its start draws the same numbers)."""
        torch.set_rng_state(self.cpu)
        if self.cuda is not None:
            torch.cuda.set_rng_state(self.cuda, self.device)

    @contextlib.contextmanager
    def replay(self):
        """Inside: the generators start from the saved states. Outside: they are as before (fork_rng)."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type="cuda" if devices else "cpu"):
            torch.set_rng_state(self.cpu)
            if self.cuda is not None:
                torch.cuda.set_rng_state(self.cuda, self.device)
            yield


def embed(model, chunk) -> torch.Tensor:
    """The embeddings of a chunk (input_ids, attention_mask[, dropout[, packed]]): with dropout=False (ArcCSE's
    triplet encodings) the model runs in eval mode, so no dropout, and still builds its graph when gradients are on;
    `packed` (data.PackedTexts) says how the chunk's texts lie in its rows (models.Encoder.forward)."""
    ids, mask, *rest = chunk
    dropout = rest[0] if rest else True
    inputs = (ids, mask) if len(rest) < 2 else (ids, mask, rest[1])
    if dropout:
        return model(*inputs)
    was_training = model.training
    model.train(False)
    try:
        return model(*inputs)
    finally:
        model.train(was_training)


def plain_step(model, chunks, labels, loss_fn, loss_scale: float = 1.0, sync: bool = True,
               restore: torch.Tensor | None = None) -> torch.Tensor:
    """Embed every chunk with a graph, loss on all embeddings, backward. Returns the detached loss.

    `model` maps (input_ids, attention_mask[, packed]) to embeddings (the Encoder, or its DDP wrapper); `chunks`
    is a list of (input_ids, attention_mask[, dropout[, packed]]): see embed. One chunk is the usual case for
    padded rows. `restore` puts the chunks' rows back in the order of `labels` (data.PassPlan.restore_index:
    chunks of length-sorted rows); None: they are in that order. `sync=False` skips DDP's gradient
    all-reduce (gradient accumulation in progress). The backward runs in two calls, the loss's down to the
    embeddings, then the encoder's from their gradients (the same gradients as one call): the profile's phases.
    """
    with no_sync(model, skip_sync=not sync):
        with phase("encoder forward"):
            local = torch.cat([embed(model, chunk) for chunk in chunks], dim=-2)
        loss, grad = _loss_backward(local.detach(), labels, loss_fn, loss_scale, restore)
        with phase("encoder backward"):
            local.backward(grad)
    return loss


def _loss_backward(local: torch.Tensor, labels, loss_fn, loss_scale, restore: torch.Tensor | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(detached loss, its gradient with respect to `local`): the loss on every process's embeddings, of which
    `local` (detached from the encoder, rows in pass order: `restore` puts them in batch order) are this
    process's; the all-gather's backward (and the reordering's) is included."""
    local.requires_grad_(True)
    rows = local if restore is None else local.index_select(-2, restore)
    with phase("all-gather"):
        labels, embeddings = gather_labels(labels), all_gather_rows(rows)
    with phase("loss"):
        loss = loss_fn(labels, embeddings)
        (loss * loss_scale).backward()
    return loss.detach(), local.grad


def grad_cache_step(model, chunks, labels, loss_fn, loss_scale: float = 1.0, sync: bool = True,
                    restore: torch.Tensor | None = None) -> torch.Tensor:
    """Same gradients as plain_step(model, chunks, ...) with one chunk's activations in memory at a time.

    `sync=False` skips the DDP all-reduce on the last chunk too (gradient accumulation in progress); `restore`
    as plain_step's.
    """
    device = chunks[0][0].device  # a chunk: (input_ids, attention_mask[, dropout[, packed]]), as plain_step's
    rng_states, cached = [], []
    # Pass 1: embeddings only. The DDP wrapper is bypassed: no graph, nothing to synchronise.
    inner = getattr(model, "module", model)
    with torch.no_grad():
        for chunk in chunks:
            rng_states.append(RngState(device))
            with phase("encoder forward"):
                cached.append(embed(inner, chunk))
    # Loss on all embeddings; backward stops at the (gathered) embeddings.
    loss, cache = _loss_backward(torch.cat(cached, dim=-2), labels, loss_fn, loss_scale, restore)
    grads = cache.split([e.shape[-2] for e in cached], dim=-2)
    # Pass 2: re-embed with a graph, same dropout masks, inject the cached gradients.
    for i, (chunk, rng, grad) in enumerate(zip(chunks, rng_states, grads)):
        last = i == len(chunks) - 1
        with no_sync(model, skip_sync=not (last and sync)), rng.replay():
            with phase("encoder re-forward"):
                emb = embed(model, chunk)
            with phase("encoder backward"):
                emb.backward(grad)
    return loss
