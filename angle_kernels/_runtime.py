"""Facts about this process that the dispatcher and the backends both read.

Below the backends and `dispatch` (it imports nothing of the package), so a backend asks here instead of reaching
up into the dispatcher.
"""

from __future__ import annotations

import os


def triton_interpreting() -> bool:
    """True when TRITON_INTERPRET asks Triton to run kernels through its interpreter (CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


# Settings whose readers are in code paths GPU runs verified (a change of a reader would void those verifications), so
# their values are checked here, at every `auto` or Triton call on GPU tensors (dispatch.resolve_backend), against
# what the readers understand: a value they would misread is an error naming the variable before any work.
SELF_CHECK_ENV = "ANGLE_KERNELS_SELF_CHECK"  # first_use.enabled: checks on first use on (1, the default) or off (0)
ALLOW_TF32_ENV = "ANGLE_KERNELS_ALLOW_TF32"  # triton_ops._similarity_tiles._dot_precision: "" and "0" off, else on
POISON_OUTPUTS_ENV = "ANGLE_KERNELS_POISON_OUTPUTS"  # triton_ops._common.poison_outputs: the same reading
AUTOTUNE_ENV = "ANGLE_KERNELS_AUTOTUNE"  # triton_ops._common.autotune_all_configs: "all" or "first"
_settings_checked: tuple | None = None  # the values last checked (a call is then one lookup of each)


def self_check_setting() -> bool:
    """ANGLE_KERNELS_SELF_CHECK: unset or 1, checks on; 0, off; anything else raises ValueError naming it."""
    value = os.environ.get(SELF_CHECK_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{SELF_CHECK_ENV} must be 0 (no first-use checks: only verified code paths compute on the "
                         f"GPU) or 1 (the default: check a verified code path's first call on this GPU), got {value!r}")
    return value == "1"


def check_gpu_settings() -> None:
    """The settings of the Triton backend and of `auto`'s first-use checks (dispatch calls this where either may
    compute): ValueError naming the variable where ANGLE_KERNELS_ALLOW_TF32 or ANGLE_KERNELS_POISON_OUTPUTS is not
    0, 1 or empty (their readers take any other value, "false" included, as on), ANGLE_KERNELS_AUTOTUNE not 'all'
    or 'first' (its reader raises at Triton's import, which `auto` would take for a Triton that cannot run,
    computing every call on PyTorch), or ANGLE_KERNELS_SELF_CHECK not 0 or 1 (read only where a path is not
    verified: a job script would fail on one GPU and run on another). Read at the call: a compiled graph, which
    does not guard on the environment, keeps the values of its first call."""
    global _settings_checked
    values = tuple(os.environ.get(name) for name in (ALLOW_TF32_ENV, POISON_OUTPUTS_ENV, AUTOTUNE_ENV, SELF_CHECK_ENV))
    if values == _settings_checked:
        return
    tf32, poison, autotune, _ = values
    self_check_setting()
    if not _reads_as_meant(tf32):
        raise ValueError(f"{ALLOW_TF32_ENV} must be 1 (TF32 products for float32 inputs in the fused Triton kernels), "
                         f"or 0 or unset (IEEE float32 products, the default); got {tf32!r}")
    if not _reads_as_meant(poison):
        raise ValueError(f"{POISON_OUTPUTS_ENV} must be 1 (the Triton kernels' outputs filled with NaN first: a debug "
                         f"switch, ~50% slower backward passes) or 0 or unset (the default); got {poison!r}")
    if autotune is not None and autotune.strip().lower() not in ("all", "first"):
        raise ValueError(f"{AUTOTUNE_ENV} must be 'all' (the default: every kernel autotuned) or 'first' (each "
                         f"kernel's first config, no tuning runs); got {autotune!r}")
    _settings_checked = values


def _reads_as_meant(value: str | None) -> bool:
    """Whether an on/off setting that its reader takes as off when "" or "0" and as on otherwise says what it
    means: unset, "", "0", or "1" (spaces around it allowed: read as on, which it says)."""
    return value is None or value in ("", "0") or value.strip() == "1"
