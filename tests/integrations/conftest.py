"""Fixtures for the integration tests (sentence-transformers, angle-emb, torch.compile).

Tests that need sentence-transformers or angle-emb skip cleanly when the library is not installed. The
tiny model is built offline once per session (tiny_model.py): no downloads.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:  # so `import tiny_model` works from the test modules here
    sys.path.insert(0, str(HERE))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from tiny_model import build_tiny_model_dir

    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny_bert"))


@pytest.fixture(scope="session")
def st_module():
    """sentence-transformers, or a clean skip."""
    return pytest.importorskip("sentence_transformers")


@pytest.fixture(scope="session")
def angle_emb_package():
    """The angle_emb package with angle_emb.angle and angle_emb.loss (its import pulls in transformers, peft,
    datasets and bitsandbytes: ak_testing.import_angle_emb_package), or a clean skip."""
    from ak_testing import import_angle_emb_package

    try:
        return import_angle_emb_package()
    except Exception as exc:  # ImportError, or a dependency failing at import time
        pytest.skip(f"angle-emb cannot be imported: {type(exc).__name__}: {exc}")
