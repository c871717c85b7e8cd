"""Helpers shared by the integration tests (a plain module: test modules cannot import from conftest.py
reliably when several conftest.py files are collected in one run)."""

from __future__ import annotations

import torch


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (a zero reference gives ||out||); NaN never passes a `<`."""
    out = out.detach().to(torch.float64).reshape(-1)
    ref = ref.detach().to(torch.float64).reshape(-1)
    scale = torch.linalg.vector_norm(ref)
    diff = torch.linalg.vector_norm(out - ref)
    return float(diff / scale) if scale > 0 else float(diff)
