"""The training objective: AnglE's loss over every embedding of an optimizer-step batch.

The loss is called as `loss(labels, embeddings)` with embeddings [rows, D] in the data layout (zigzag for
formats A and B, stride 3 for C) and labels [rows]. Two implementations compute the same objective:

    angle_kernels  this project's `AngleLoss` (fused / memory-efficient, O(N) memory: the one to train with)
    reference      the eager functions of angle-emb 0.6.1 (`angle_emb.loss`, O(N^2) memory), assembled the
                   way its `AngleLoss` class does; for side-by-side checks. Only that one file is loaded, so
                   the heavy `angle_emb` package import (datasets, bitsandbytes...) is not needed.
"""

from __future__ import annotations

import importlib.util
from dataclasses import asdict, dataclass
from typing import Callable

import torch

LOSS_IMPLEMENTATIONS = ("auto", "angle_kernels", "reference")


@dataclass
class LossWeights:
    """AngleLoss's weights and temperatures; the defaults are angle-emb 0.6.1's."""

    cosine_w: float = 0.0
    ibn_w: float = 1.0
    cln_w: float = 1.0
    angle_w: float = 0.02
    cosine_tau: float = 20.0
    ibn_tau: float = 20.0
    angle_tau: float = 20.0
    angle_pooling_strategy: str = "sum"


def load_reference_loss_module():
    """angle_emb/loss.py loaded by file path (it needs only torch)."""
    spec = importlib.util.find_spec("angle_emb")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("the reference loss needs the angle-emb package (pip install --no-deps angle-emb==0.6.1)")
    path = f"{next(iter(spec.submodule_search_locations))}/loss.py"
    module_spec = importlib.util.spec_from_file_location("_angle_emb_reference_loss", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def reference_angle_loss(weights: LossWeights, fmt: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """angle-emb 0.6.1's AngleLoss.__call__, format by format, on its own eager functions."""
    ref = load_reference_loss_module()
    w = weights

    def loss_fn(labels: torch.Tensor, outputs: torch.Tensor) -> torch.Tensor:
        labels = labels.reshape(-1, 1)
        loss = outputs.new_zeros(())
        if fmt == "A":
            if w.cosine_w > 0:
                loss = loss + w.cosine_w * ref.cosine_loss(labels, outputs, w.cosine_tau)
            if w.ibn_w > 0:
                loss = loss + w.ibn_w * ref.in_batch_negative_loss(labels, outputs, w.ibn_tau)
            if w.angle_w > 0:
                loss = loss + w.angle_w * ref.angle_loss(labels, outputs, w.angle_tau,
                                                         pooling_strategy=w.angle_pooling_strategy)
            return loss
        if fmt == "B":
            return ref.contrastive_with_negative_loss(outputs[0::2], outputs[1::2], neg=None, tau=w.ibn_tau)
        query, positive, negative = outputs[0::3], outputs[1::3], outputs[2::3]
        dim = outputs.shape[1]
        pairs = torch.cat((torch.stack((query, positive), 1).reshape(-1, dim),
                           torch.stack((query, negative), 1).reshape(-1, dim)))
        pair_labels = torch.cat((torch.ones(2 * len(query), 1), torch.zeros(2 * len(query), 1))).to(outputs.device)
        contrastive = outputs.new_zeros(())
        if w.ibn_w > 0:
            contrastive = contrastive + w.ibn_w * ref.contrastive_with_negative_loss(query, positive, tau=w.ibn_tau)
        if w.cln_w > 0:
            contrastive = contrastive + w.cln_w * ref.contrastive_with_negative_loss(query, positive, negative,
                                                                                     tau=w.ibn_tau)
        loss = loss + contrastive / 2
        if w.angle_w > 0:
            loss = loss + w.angle_w * ref.angle_loss(pair_labels, pairs, w.angle_tau,
                                                     pooling_strategy=w.angle_pooling_strategy)
        if w.cosine_w > 0:
            loss = loss + w.cosine_w * ref.cosine_loss(pair_labels, pairs, w.cosine_tau)
        return loss

    return loss_fn


def angle_kernels_available() -> bool:
    try:
        from angle_kernels import AngleLoss  # noqa: F401
    except ImportError:
        return False
    return True


def build_loss(weights: LossWeights, fmt: str, implementation: str = "auto"
               ) -> tuple[Callable[[torch.Tensor, torch.Tensor], torch.Tensor], str]:
    """Return (loss_fn(labels, embeddings), the implementation chosen).

    angle_kernels picks its backend itself (Triton/CUDA on GPU tensors, PyTorch on CPU); the environment
    variable ANGLE_KERNELS_BACKEND overrides that choice.
    """
    if implementation not in LOSS_IMPLEMENTATIONS:
        raise ValueError(f"loss implementation must be one of {LOSS_IMPLEMENTATIONS}; got {implementation!r}")
    if fmt not in ("A", "B", "C"):
        raise ValueError(f"format must be 'A', 'B' or 'C'; got {fmt!r}")
    if implementation == "auto":
        implementation = "angle_kernels" if angle_kernels_available() else "reference"
    if implementation == "reference":
        return reference_angle_loss(weights, fmt), "reference"
    from angle_kernels import AngleLoss

    return AngleLoss(**asdict(weights), dataset_format=fmt), "angle_kernels"
