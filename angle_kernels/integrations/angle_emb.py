"""Make the angle-emb trainer (angle-emb 0.6.1) compute its losses with angle_kernels, reversibly.

    from angle_kernels.integrations import angle_emb as ak_angle_emb

    ak_angle_emb.patch()                  # from now on AnglE.fit / AngleTrainer use angle_kernels
    angle.fit(train_ds=..., ...)
    ak_angle_emb.unpatch()                # the originals are back

    with ak_angle_emb.patched(backend="torch"):   # or for one block
        angle.fit(...)

What `patch()` swaps (and `unpatch()` restores, object for object):

* the four loss functions `cosine_loss`, `angle_loss`, `in_batch_negative_loss` and
  `contrastive_with_negative_loss` in `angle_emb.loss`, in `angle_emb.angle` (which imported them by name
  and whose `AngleLoss.__call__` looks them up there at call time) and in the `angle_emb` package namespace;
* `AngleLoss` in `angle_emb.angle` and `angle_emb`, replaced by `angle_kernels.AngleLoss` (same arguments,
  also accepts and ignores extra keyword arguments). `AngleTrainer.__init__` builds its loss from
  `angle_emb.angle.AngleLoss`, so trainers created while patched hold ours; a trainer created before
  `patch()` keeps the reference's AngleLoss object, whose calls still reach the patched functions.

Not reached: names that user code imported before `patch()` (`from angle_emb.loss import cosine_loss`
binds the original function to that name). Import the module (`angle_emb.loss.cosine_loss`) or patch first.

The results equal the reference's on valid inputs (values and gradients, to floating-point rounding). Where
the reference silently misbehaves, angle_kernels raises instead (README, "Deviations from the reference"):
labels outside {0, 1} with the in-batch-negative term (ibn_w > 0), NaN/Inf inputs, an odd embedding size
for the angle term. Zero vectors give finite losses instead of NaN.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading
from types import ModuleType

from .. import functional as _functional
from ..modules import AngleLoss as _AngleLoss

__all__ = ["patch", "unpatch", "patched", "is_patched", "PATCHED_NAMES"]

LOSS_FUNCTIONS = ("cosine_loss", "angle_loss", "in_batch_negative_loss", "contrastive_with_negative_loss")
PATCHED_NAMES = LOSS_FUNCTIONS + ("AngleLoss",)
# where angle-emb 0.6.1 holds those names: its loss module, the trainer's module, the package namespace
_MODULES = ("angle_emb.loss", "angle_emb.angle", "angle_emb")

_lock = threading.Lock()
_originals: dict[tuple[str, str], object] = {}  # (module name, attribute) -> the object patch() replaced


def _import_angle_emb() -> list[ModuleType]:
    try:
        return [importlib.import_module(name) for name in _MODULES]
    except ImportError as exc:
        raise ImportError(
            "angle_kernels.integrations.angle_emb needs the angle-emb package (pip install --no-deps "
            f"angle-emb==0.6.1 plus its import-time dependencies): {exc}"
        ) from exc


def _replacements(backend: str | None) -> dict[str, object]:
    """Our objects for each patched name, with `backend` bound when one is given."""
    out: dict[str, object] = {}
    for name in LOSS_FUNCTIONS:
        ours = getattr(_functional, name)
        if backend is None:
            out[name] = ours
        else:
            out[name] = functools.wraps(ours)(functools.partial(ours, backend=backend))
    if backend is None:
        out["AngleLoss"] = _AngleLoss
    else:
        out["AngleLoss"] = type("AngleLoss", (_AngleLoss,), {
            "__init__": lambda self, *args, **kwargs: _AngleLoss.__init__(self, *args, backend=backend, **kwargs),
            "__doc__": _AngleLoss.__doc__,
            "__module__": _AngleLoss.__module__,
        })
    return out


def is_patched() -> bool:
    """Whether angle-emb currently computes with angle_kernels (patch() is in effect)."""
    return bool(_originals)


def patch(backend: str | None = None) -> None:
    """Make angle-emb's losses and AngleLoss those of angle_kernels (see the module docstring).

    Args:
        backend: angle_kernels backend for every patched loss ("auto", "torch", "triton", "cuda"); None
            (default) means each call chooses ("auto", or the ANGLE_KERNELS_BACKEND environment variable).

    Calling patch() again while patched re-binds the backend; the saved originals stay the reference's.
    Raises ImportError when angle-emb is not installed.
    """
    modules = _import_angle_emb()
    replacements = _replacements(backend)
    with _lock:
        for module in modules:
            for name in PATCHED_NAMES:
                if not hasattr(module, name):
                    continue
                _originals.setdefault((module.__name__, name), getattr(module, name))
                setattr(module, name, replacements[name])


def unpatch() -> None:
    """Restore every object patch() replaced; a no-op when not patched."""
    with _lock:
        for (module_name, name), original in _originals.items():
            setattr(importlib.import_module(module_name), name, original)
        _originals.clear()


@contextlib.contextmanager
def patched(backend: str | None = None):
    """Context manager: angle-emb uses angle_kernels inside the block.

    On exit the originals come back, unless patch() was already in effect on entry (then it stays patched,
    with the backend this block set).
    """
    was_patched = is_patched()
    patch(backend)
    try:
        yield
    finally:
        if not was_patched:
            unpatch()
