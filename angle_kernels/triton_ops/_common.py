"""Helpers shared by the Triton kernels' launchers (no kernels here)."""

from __future__ import annotations

import os

import torch
import triton.language as tl

# F.normalize's epsilon: a norm below it is replaced by it, so a zero vector has cosine 0 with everything.
NORM_EPS = 1e-12


def interpreting() -> bool:
    """True when kernels run through the Triton interpreter (TRITON_INTERPRET=1) instead of a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def torch_compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; float32, bfloat16 and float16 accumulate in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def acc_dtype_of(dtype: torch.dtype):
    """The Triton accumulation dtype for inputs of `dtype`."""
    return tl.float64 if dtype == torch.float64 else tl.float32


def check_device(t: torch.Tensor, name: str) -> None:
    """Triton kernels need CUDA tensors, or CPU tensors under the interpreter."""
    if t.is_cuda:
        return
    if t.device.type == "cpu" and interpreting():
        return
    raise ValueError(
        f"{name}: the Triton backend needs CUDA tensors (or CPU tensors with TRITON_INTERPRET=1); "
        f"got a tensor on {t.device}"
    )
