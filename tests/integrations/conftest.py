"""Fixtures for the integration tests (sentence-transformers, angle-emb, torch.compile).

Tests that need sentence-transformers or angle-emb skip cleanly when the library is not installed. The
tiny model is built offline once per session (angle_kernels.testing.tiny_model): no downloads.
"""

from __future__ import annotations

from pathlib import Path

import pytest


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
