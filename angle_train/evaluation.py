"""Evaluation: Spearman correlation between cosine similarity and gold scores on an STS-style set."""

from __future__ import annotations

import torch

from .data import Example


def sts_spearman(encoder, tokenizer, examples: list[Example], *, batch_size: int = 128, max_length: int = 512,
                 prompt: str | None = None) -> float:
    """Spearman's rho (scipy) of cos(embed(text1), embed(text2)) against the labels, in [-1, 1]."""
    from scipy.stats import spearmanr

    if not examples or len(examples[0].texts) != 2:
        raise ValueError("STS evaluation needs format-A examples (text1, text2, label)")
    first = encoder.encode([ex.texts[0] for ex in examples], tokenizer, batch_size=batch_size,
                           max_length=max_length, prompt=prompt)
    second = encoder.encode([ex.texts[1] for ex in examples], tokenizer, batch_size=batch_size,
                            max_length=max_length, prompt=prompt)
    cosine = torch.nn.functional.cosine_similarity(first, second, dim=-1)
    return float(spearmanr(cosine.numpy(), [ex.label for ex in examples]).statistic)
