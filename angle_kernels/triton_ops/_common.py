"""Helpers shared by the Triton kernels' launchers (no kernels here)."""

from __future__ import annotations

import os

import torch
import triton.language as tl

# F.normalize's epsilon: a norm below it is replaced by it, so a zero vector has cosine 0 with everything.
NORM_EPS = 1e-12

POISON_OUTPUTS_ENV = "ANGLE_KERNELS_POISON_OUTPUTS"


def interpreting() -> bool:
    """True when kernels run through the Triton interpreter (TRITON_INTERPRET=1) instead of a GPU."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def poison_outputs() -> bool:
    """True when ANGLE_KERNELS_POISON_OUTPUTS is set to anything but "" or "0" (read at every call)."""
    return os.environ.get(POISON_OUTPUTS_ENV, "0") not in ("", "0")


def new_output(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A floating-point tensor for a kernel to write every element of: uninitialised (torch.empty).

    With ANGLE_KERNELS_POISON_OUTPUTS=1 it is filled with NaN instead, a debug switch: on by default under
    pytest so an element a kernel forgets to write still fails a test (the tests check that every output is
    finite). It is off in production because the fill is a full extra write of the output: for the
    bandwidth-bound pair-score backward, about 50% over its floor. Outputs whose contract is zeros (e.g. the
    angle scores with with_angle=False) are allocated with torch.zeros, not with this.
    """
    if poison_outputs():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


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
