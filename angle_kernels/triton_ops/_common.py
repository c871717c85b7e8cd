"""Helpers shared by the Triton kernels' launchers (no kernels here)."""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import torch
import triton.language as tl

POISON_OUTPUTS_ENV = "ANGLE_KERNELS_POISON_OUTPUTS"


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


def acc_dtype_of(dtype: torch.dtype):
    """The Triton accumulation dtype for inputs of `dtype`."""
    return tl.float64 if dtype == torch.float64 else tl.float32


class CompileCase(NamedTuple):
    """One specialisation of a kernel as its launcher launches it, which `_compile_check` compiles for a GPU
    target without a GPU. Each kernel file lists its cases in `compile_cases(full)`, next to the launcher whose
    choices they repeat. Pointer arguments are `*pointer_dtype` unless named in `pointers` (Triton type names:
    "fp32", "bf16", "i64", ...); other runtime arguments are i32."""

    kernel: Any  # the @triton.jit function
    label: str
    pointer_dtype: str
    constexprs: dict
    num_warps: int
    num_stages: int = 3
    pointers: dict | None = None
