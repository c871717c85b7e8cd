"""The Triton backend: fused kernels for the three ops of angle_kernels.dispatch.

    pair_scores(x, with_angle)                    -> pair_scores.py (one pass forward, one pass backward)
    ranking_loss(scores, labels)                  -> ranking.py (sort + fused log-space scans, or one tiled
                                                     O(N^2)-time launch for small N)
    similarity_xent(q, c, scale, target, ...)     -> similarity_xent.py (flash-style online logsumexp)

Importing this package never fails (it costs the import of triton, about 0.3 s): `is_available()` says whether
the kernels can run here (CUDA, or CPU tensors under TRITON_INTERPRET=1). Implements
`angle_kernels.contract.Backend`: inputs arrive validated by `angle_kernels.dispatch`.
"""

from __future__ import annotations

import torch

from ..dispatch import triton_interpreting


def is_available() -> tuple[bool, str]:
    """(True, "") when triton imports and there is a CUDA device or TRITON_INTERPRET=1; else (False, why)."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # a broken or missing triton must not break `import angle_kernels`
        return False, f"triton does not import: {type(exc).__name__}: {exc}"
    if _IMPORT_ERROR is not None:
        return False, f"the Triton kernels do not import: {type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR}"
    if triton_interpreting():
        return True, ""
    if torch.cuda.is_available():
        return True, ""
    return False, "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on CPU through the interpreter)"


# The kernel modules are imported here, eagerly, on purpose: each submodule shares its name with the op it
# exports (pair_scores.py -> pair_scores), and importing a submodule sets the package attribute of that name
# to the module. Importing them first and binding the functions afterwards keeps `triton_ops.pair_scores`
# the function. A missing or broken triton must not make this import fail: the ops then raise, and
# is_available() reports why.
try:
    from .pair_scores import pair_scores
    from .ranking import ranking_loss
    from .similarity_xent import similarity_xent

    _IMPORT_ERROR: Exception | None = None
except Exception as exc:  # noqa: BLE001
    _IMPORT_ERROR = exc

    def _unavailable(*args, **kwargs):
        raise RuntimeError(f"the Triton backend is not available: {type(_IMPORT_ERROR).__name__}: {_IMPORT_ERROR}")

    pair_scores = ranking_loss = similarity_xent = _unavailable


__all__ = ["is_available", "pair_scores", "ranking_loss", "similarity_xent"]
