"""Helpers shared by the Triton kernels' launchers, and the few @triton.jit helpers every kernel file uses (no
kernels here)."""

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


# ----------------------------------------------------------------------------------------------------------
# Row scaling (inlined into the kernels). Finite rows can have squared norms and dot products beyond the
# accumulation dtype (float32 rows around 1.8e19, float64 around 1.3e154). Every cosine is invariant under a
# positive scaling of either row, so the kernels compute on x_s = s x with one power of two per row: s = 1 for
# rows whose largest magnitude is below 2 (they compute bit for bit as before), else 2^-floor(log2 max|x|), which
# brings the row's largest entry into [1, 2) (torch_ops/common.py states the same rule for the torch backend).
# Powers of two are exact: |x| = |x_s| / s, the clamp max(|x|, eps) is max(|x_s|, eps s) (`scaled_eps`), and
# dL/dx = s dL/dx_s. A kernel that reads a row in chunks finds s online: a running exponent per row, the sums of
# the chunks before multiplied by 2^(old - new) when a later chunk raises it (as an online softmax rescales its
# running sum). The exponents come from the floats' bits, exactly.
# ----------------------------------------------------------------------------------------------------------
@triton.jit
def row_exponent(largest, ACC: tl.constexpr):
    """max(0, floor(log2(largest))) as int32 for largest >= 0 in ACC, at most bias - 1 so that 2^-exponent stays a
    normal number: the row scale of a row (or chunk) whose largest magnitude is `largest` is 2^-row_exponent."""
    if ACC == tl.float64:
        exponent = ((largest.to(tl.int64, bitcast=True) >> 52) & 0x7FF) - 1023
        return tl.minimum(tl.maximum(exponent, 0), 1022).to(tl.int32)
    else:
        exponent = ((largest.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
        return tl.minimum(tl.maximum(exponent, 0), 126)


@triton.jit
def pow2(exponent, ACC: tl.constexpr):
    """2^exponent in ACC for an int32 exponent <= bias - 1, built from its bits (exact); 0 below the normal range."""
    if ACC == tl.float64:
        return (tl.maximum(exponent.to(tl.int64) + 1023, 0) << 52).to(tl.float64, bitcast=True)
    else:
        return (tl.maximum(exponent + 127, 0) << 23).to(tl.float32, bitcast=True)


@triton.jit
def raise_exponent(exponent, chunk_largest, ACC: tl.constexpr):
    """The online step: (the row's exponent after a chunk whose largest magnitude is chunk_largest, the factor
    2^(old - new) <= 1 that brings what was summed at the old scale to the new one, the new scale 2^-new)."""
    new = tl.maximum(exponent, row_exponent(chunk_largest, ACC))
    return new, pow2(exponent - new, ACC), pow2(-new, ACC)


@triton.jit
def scaled_eps(scale, EPS: tl.constexpr, ACC: tl.constexpr):
    """The norm clamp of a row scaled by `scale`: EPS * scale, floored at ACC's smallest normal number (so that a
    zero prefix of a huge row divides by a positive number)."""
    if ACC == tl.float64:
        return tl.maximum(scale * EPS, 2.2250738585072014e-308)
    else:
        return tl.maximum(scale * EPS, 1.1754943508222875e-38)


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
