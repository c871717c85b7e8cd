"""Helpers shared by the Triton kernels' launchers (no kernels here)."""

from __future__ import annotations

import os
from typing import Any, Callable, NamedTuple

import torch
import triton
import triton.language as tl

POISON_OUTPUTS_ENV = "ANGLE_KERNELS_POISON_OUTPUTS"
# "first": every autotuned kernel runs its first config only (no tuning runs). For test runs on a GPU, whose time
# goes to compiling every variant the tests reach; read when an op module is imported. Default "all".
AUTOTUNE_ENV = "ANGLE_KERNELS_AUTOTUNE"


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


class Tuning(NamedTuple):
    """What an autotuned kernel's launch declares to the autotuner, by argument name.

    On a GPU, triton.autotune runs every config several times on the same buffers at the first call of each key
    (then resets `reset_to_zero` once more and runs the chosen config for the result): a kernel that adds into a
    buffer the launcher zeroed must name it in `reset_to_zero`, one that modifies an input in place must name it
    in `restore_value`, or that first call returns the sum of all those runs. The same lists go to
    triton.autotune (`tuned_kernel`) and to the test that replays the autotuner's sequence under the interpreter
    (tests/ops/test_autotune_side_effects.py): a kernel that needs them and lacks them fails there, on CPU.
    """

    reset_to_zero: tuple[str, ...] = ()
    restore_value: tuple[str, ...] = ()


class TunedKernel(NamedTuple):
    """An autotuned tile kernel: the @triton.jit function, its GPU configs and autotune key, its launch's
    `Tuning`, and the launcher (triton.autotune over the configs on a GPU; the kernel itself under the
    interpreter, which runs one config given by the launch)."""

    kernel: Any
    configs: tuple
    key: tuple
    tuning: Tuning
    launcher: Any

    def launch(self, grid_of: Callable[[dict], tuple], interpreter_blocks: dict, *args, **constexprs) -> None:
        """Launch over the grid `grid_of(meta)`: with the autotuner's chosen config on a GPU, with
        `interpreter_blocks` (BLOCK_* sizes) and 4 warps under the interpreter."""
        if self.launcher is self.kernel:
            self.launcher[grid_of](*args, **constexprs, **interpreter_blocks, num_warps=4)
        else:
            self.launcher[grid_of](*args, **constexprs)


def autotune_all_configs() -> bool:
    """False when ANGLE_KERNELS_AUTOTUNE=first asks for each kernel's first config only (see AUTOTUNE_ENV)."""
    value = os.environ.get(AUTOTUNE_ENV, "all").strip().lower()
    if value not in ("all", "first"):
        raise ValueError(f"{AUTOTUNE_ENV} must be 'all' or 'first', got {value!r}")
    return value == "all"


def tuned_kernel(kernel, configs: list, key: list, tuning: Tuning = Tuning(), interpreting: bool = False
                 ) -> TunedKernel:
    """`kernel` autotuned on `key` over `configs` with `tuning`'s declarations; under the interpreter (which
    cannot autotune more than one config) the kernel itself, launched with the blocks its launcher picks."""
    if interpreting:
        return TunedKernel(kernel, tuple(configs), tuple(key), tuning, kernel)
    used = configs if autotune_all_configs() else configs[:1]
    return TunedKernel(kernel, tuple(configs), tuple(key), tuning, autotuner(kernel, used, key, tuning))


def autotuner(kernel, configs, key, tuning: Tuning):
    """triton.autotune over `configs` on `key`, given `tuning`'s declarations."""
    return triton.autotune(configs=list(configs), key=list(key), reset_to_zero=list(tuning.reset_to_zero) or None,
                           restore_value=list(tuning.restore_value) or None)(kernel)
