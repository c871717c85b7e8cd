"""The Triton backend: fused kernels for the ops of angle_kernels.dispatch.

Each kernel file reads top to bottom: what it computes, the bytes and FLOPs it must move, the kernels, the
autograd.Function, the launcher.

One module per op, named after it (`contract.OPS`), plus the modules an op launches from (similarity_xent_dense:
the dense scheme of similarity_xent; _similarity_tiles: the tile library of the similarity family, see
docs/triton-similarity.md). `load_ops()` names the op modules; `dispatch` calls it only once `is_available()` says
the kernels can run here (CUDA, or CPU tensors under TRITON_INTERPRET=1), so importing this package never fails and
costs nothing without triton. Inputs arrive validated by `angle_kernels.dispatch`.
"""

from __future__ import annotations

from types import ModuleType

import torch

from .._runtime import triton_interpreting


def is_available() -> tuple[bool, str]:
    """(True, "") when triton imports and there is a CUDA device or TRITON_INTERPRET=1; else (False, why)."""
    try:
        import triton  # noqa: F401
    except Exception as exc:  # a broken or missing triton must not break `import angle_kernels`
        return False, f"triton does not import: {type(exc).__name__}: {exc}"
    if triton_interpreting():
        return True, ""
    if torch.cuda.is_available():
        return True, ""
    return False, "no CUDA device (set TRITON_INTERPRET=1 to run the kernels on CPU through the interpreter)"


def load_ops() -> dict[str, ModuleType]:
    """This backend's op modules by op name (`contract.OPS`): each defines the function named after its op (the
    launcher), its PATHS and, with several, code_path."""
    from . import pair_scores, ranking_loss, similarity_lse, similarity_xent

    return {"pair_scores": pair_scores, "ranking_loss": ranking_loss, "similarity_xent": similarity_xent,
            "similarity_lse": similarity_lse}
