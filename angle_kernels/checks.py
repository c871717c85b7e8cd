"""Input checks: every bad input raises a ValueError or TypeError that names the argument.

Shape, dtype and device checks cost nothing and always run. The checks that read tensor values (NaN/Inf in
embeddings and labels, label values for the in-batch-negative loss) force a device-to-host sync on GPUs; they
are on by default and can be switched off for training loops that trust their inputs:

    angle_kernels.set_input_checks(False)            # for the whole process
    with angle_kernels.input_checks(False): ...      # for a block
    ANGLE_KERNELS_CHECK_INPUTS=0                     # from the environment, read at import

Under torch.compile the value checks are skipped (they would need a host sync and break the graph); run a
step eagerly, or keep the eager path for validation, when inputs are untrusted. They also skip meta tensors
(shape-only: the losses then return meta outputs of the right shape, as torch ops do).

Two rules every loss shares are stated here once: `check_scale` (a logit scale or temperature is finite and
> 0) and `promote_embeddings` (embeddings of different float dtypes are promoted to a common dtype).
"""

from __future__ import annotations

import contextlib
import math
import numbers
import os

import torch

_value_checks = os.environ.get("ANGLE_KERNELS_CHECK_INPUTS", "1").strip().lower() not in ("0", "false", "no", "off")


def set_input_checks(enabled: bool) -> bool:
    """Turn the value checks (NaN/Inf, label values) on or off; returns the previous setting."""
    global _value_checks
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    previous, _value_checks = _value_checks, enabled
    return previous


def input_checks_enabled() -> bool:
    """Whether the value checks run now: switched on, and not inside a torch.compile trace."""
    return _value_checks and not torch.compiler.is_compiling()


@contextlib.contextmanager
def input_checks(enabled: bool):
    """Context manager: value checks on or off inside the block, restored afterwards."""
    previous = set_input_checks(enabled)
    try:
        yield
    finally:
        set_input_checks(previous)


def _all_finite(t: torch.Tensor) -> bool:
    # One fused reduction (a single sync): NaN or Inf anywhere makes the sum non-finite. A non-finite sum can
    # also come from finite values overflowing, so only then look element by element, a chunk at a time.
    if t.device.type == "meta":  # no data to scan (shape-only tensors); the device checks still apply
        return True
    total = t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)
    if bool(torch.isfinite(total)):
        return True
    flat = t.reshape(-1)
    return all(bool(torch.isfinite(chunk).all()) for chunk in flat.split(1 << 24))


def check_scalar(name: str, value, *, positive: bool = False) -> float:
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.requires_grad:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def check_scale(name: str, value) -> float:
    """The one rule for every loss's logit scale or temperature (tau, scale, temperature, cosine_tau, ibn_tau,
    angle_tau): a finite real number > 0, returned as a float; anything else raises ValueError (TypeError for a
    non-number) naming the argument. angle-emb 0.6.1 accepts tau <= 0 (README: deviations)."""
    return check_scalar(name, value, positive=True)


def check_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


def check_embeddings(
    name: str, t, *, rows_multiple_of: int = 1, layout: str = "", check_values: bool = True
) -> torch.Tensor:
    """A [rows, D] floating tensor with rows > 0, D > 0, rows divisible by rows_multiple_of, finite values
    (the last only with check_values and while value checks are on)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor (float32, float64, bfloat16, float16), got {t.dtype}")
    if t.dim() != 2:
        raise ValueError(f"{name} must be 2-D [rows, dim], got shape {tuple(t.shape)}")
    rows, dim = t.shape
    if rows == 0 or dim == 0:
        raise ValueError(f"{name} is empty (shape {tuple(t.shape)}): a loss needs at least one row and one column")
    if rows % rows_multiple_of:
        raise ValueError(
            f"{name} must have a multiple of {rows_multiple_of} rows ({layout}), got {rows} rows"
        )
    if check_values:
        check_finite(name, t)
    return t


def check_finite(name: str, t: torch.Tensor) -> None:
    if input_checks_enabled() and not _all_finite(t.detach()):
        raise ValueError(f"{name} contains NaN or Inf values")


def check_embedding_group(*named: tuple[str, torch.Tensor]) -> None:
    """Embedding tensors used together: each is [rows, D] and floating, all have the same D and live on one
    device, and only then (the one check that syncs) are their values checked."""
    for name, t in named:
        check_embeddings(name, t, check_values=False)
    first_name, first = named[0]
    for name, t in named[1:]:
        if t.shape[1] != first.shape[1]:
            raise ValueError(f"{name} must have {first.shape[1]} columns like {first_name}, got shape {tuple(t.shape)}")
    check_same_device(*named)
    for name, t in named:
        check_finite(name, t)


def check_columns(name: str, columns):
    """A loss's hard-negative columns: a tuple or list of [B, D] tensors, one per column. A tensor itself is refused
    with what to pass: iterated, its rows would be read as columns, each of the wrong shape."""
    if isinstance(columns, torch.Tensor):
        raise TypeError(f"{name} must be a tuple or list of [B, D] tensors, one per hard-negative column; got a tensor "
                        f"of shape {tuple(columns.shape)}: pass ({name},) for one column")
    return columns


def promote_embeddings(*tensors):
    """Embedding tensors used together in one loss, returned in one dtype: PROMOTED, never refused, by torch's type
    promotion (torch.promote_types: float32 with float64 computes in float64, bfloat16 with float32 in float32), so
    no input is silently narrowed to another's dtype. A tensor is cast (differentiably: its gradient comes back in
    its own dtype) only when its dtype differs; anything that is not a floating tensor is returned unchanged for
    the structure checks to name."""
    floating = [t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if len({t.dtype for t in floating}) <= 1:
        return list(tensors)
    common = floating[0].dtype
    for t in floating[1:]:
        common = torch.promote_types(common, t.dtype)
    return [t.to(common) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != common else t
            for t in tensors]


def check_labels(name: str, y, rows: int, device: torch.device) -> torch.Tensor:
    """y of shape [rows] or [rows, 1], real values on `device`; returned flattened to [rows]."""
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(y).__name__}")
    if y.is_complex():
        raise TypeError(f"{name} must hold real labels, got {y.dtype}")
    if tuple(y.shape) not in ((rows,), (rows, 1)):
        raise ValueError(f"{name} must have shape [{rows}] or [{rows}, 1] to match the embeddings, "
                         f"got {tuple(y.shape)}")
    check_same_device((name, y), ("the embeddings", device))
    y = y.reshape(rows)
    if y.dtype == torch.bool:
        y = y.to(torch.int64)
    if input_checks_enabled() and y.is_floating_point() and not _all_finite(y):
        raise ValueError(f"{name} contains NaN or Inf values")
    return y


def check_binary_labels(name: str, y: torch.Tensor, loss: str) -> None:
    """The in-batch-negative loss reads labels as 'pair is positive' (1) or 'negatives only' (0)."""
    if input_checks_enabled() and y.device.type != "meta" and not bool(((y == 0) | (y == 1)).all()):
        bad = y[(y != 0) & (y != 1)][:5].tolist()
        raise ValueError(
            f"{name} for {loss} must be 0 or 1 (1: the pair is a positive pair; 0: its rows serve only as "
            f"negatives); got values such as {bad}. Graded similarity labels belong to cosine_loss/angle_loss "
            "(with AngleLoss, set ibn_w=0). The reference silently truncates such labels to wrong targets."
        )


def check_same_device(*named) -> None:
    """named: (name, tensor or device) pairs that must all live on one device."""
    devices = [(n, t.device if isinstance(t, torch.Tensor) else torch.device(t)) for n, t in named]
    first_name, first = devices[0]
    for n, d in devices[1:]:
        if d != first:
            raise ValueError(f"{first_name} is on {first} but {n} is on {d}: all inputs must be on one device")


def check_same_shape(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{b_name} must have the shape of {a_name} {tuple(a.shape)}, got {tuple(b.shape)}")
