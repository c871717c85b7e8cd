"""Fixtures for the integration tests (sentence-transformers, angle-emb, torch.compile).

Tests that need sentence-transformers or angle-emb skip cleanly when the library is not installed. The
tiny model is built offline once per session (angle_kernels.testing.tiny_model): no downloads; `model64` and
`guide64` load it in float64 once per test module, `fused_calls` counts the integration's computing halves.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from angle_kernels.testing.tiny_model import build_tiny_model_dir

    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny_bert"))


@pytest.fixture(scope="session")
def st_module():
    """sentence-transformers, or a clean skip."""
    return pytest.importorskip("sentence_transformers")


@pytest.fixture(scope="session")
def angle_emb_package():
    """The angle_emb package with angle_emb.angle and angle_emb.loss (its import pulls in transformers, peft,
    datasets and bitsandbytes: angle_kernels.testing.helpers.import_angle_emb_package), or a clean skip."""
    from angle_kernels.testing.helpers import import_angle_emb_package

    try:
        return import_angle_emb_package()
    except Exception as exc:  # ImportError, or a dependency failing at import time
        pytest.skip(f"angle-emb cannot be imported: {type(exc).__name__}: {exc}")


# the computing halves the sentence-transformers integration calls (angle_kernels.terms)
FUSED_FUNCTIONS = ("ranking_terms", "contrastive", "multiple_negatives", "gist")


@pytest.fixture(scope="module")
def model64(tiny_model_dir):
    """The tiny model as a SentenceTransformer in float64 (so a drop-in and its parent agree to rounding)."""
    from angle_kernels.testing.tiny_model import load_sentence_transformer

    return load_sentence_transformer(tiny_model_dir).to(torch.float64)


@pytest.fixture(scope="module")
def guide64(tiny_model_dir):
    """A guide that is a perturbed copy of the model: related similarities, so it filters some columns."""
    from angle_kernels.testing.tiny_model import load_sentence_transformer

    guide = load_sentence_transformer(tiny_model_dir).to(torch.float64)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in guide.parameters():
            p.add_(0.3 * p.std().nan_to_num() * torch.randn(p.shape, generator=gen, dtype=p.dtype))
    return guide


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts of the calls of each computing half (FUSED_FUNCTIONS) made during the test, by name."""
    from angle_kernels import terms
    from angle_kernels.testing.helpers import patch_formula

    calls = {name: 0 for name in FUSED_FUNCTIONS}
    for name in FUSED_FUNCTIONS:
        original = getattr(terms, name)

        def counting(*args, _original=original, _name=name, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        patch_formula(monkeypatch, name, counting)
    return calls
