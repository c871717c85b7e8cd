"""Pooling: turn a model's per-token hidden states [B, L, H] into one embedding per text [B, H].

Every strategy honours the attention mask, so padding never leaks into an embedding, and works for
both padding sides: right padding (BERT-style encoders) puts the real tokens first, left padding
(decoder-only LLMs, so that the last real token sits at the last position) puts them last.

    cls      the first real token (position 0 with right padding; the first masked-in position with left)
    avg      the mean over real tokens
    cls_avg  (cls + avg) / 2
    max      the element-wise max over real tokens
    last     the last real token (what a causal LM has read the whole text at)
"""

from __future__ import annotations

import torch

POOLING_STRATEGIES = ("cls", "cls_avg", "avg", "max", "last")


def first_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the first real token of each row: argmax returns the first maximum, i.e. the first 1."""
    return attention_mask.int().argmax(dim=1)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real token of each row, for either padding side (the first 1 seen from the right)."""
    length = attention_mask.shape[1]
    return length - 1 - attention_mask.int().flip(dims=[1]).argmax(dim=1)


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, strategy: str) -> torch.Tensor:
    """Pool hidden states [B, L, H] with attention_mask [B, L] (1 = real token) into [B, H]."""
    if strategy not in POOLING_STRATEGIES:
        raise ValueError(f"pooling must be one of {POOLING_STRATEGIES}; got {strategy!r}")
    if hidden.dim() != 3 or attention_mask.shape != hidden.shape[:2]:
        raise ValueError(
            f"hidden must be [B, L, H] and attention_mask [B, L]; got {tuple(hidden.shape)} and "
            f"{tuple(attention_mask.shape)}"
        )
    if not bool((attention_mask.sum(dim=1) > 0).all()):
        raise ValueError("attention_mask has a row without any real token; every text needs at least one token")
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    if strategy == "cls":
        return hidden[rows, first_token_index(attention_mask)]
    if strategy == "last":
        return hidden[rows, last_token_index(attention_mask)]
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    if strategy == "max":
        return hidden.masked_fill(mask == 0, torch.finfo(hidden.dtype).min).amax(dim=1)
    mean = (hidden * mask).sum(dim=1) / mask.sum(dim=1)
    if strategy == "avg":
        return mean
    return (hidden[rows, first_token_index(attention_mask)] + mean) / 2  # cls_avg
