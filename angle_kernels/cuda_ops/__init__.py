"""The CUDA C++ backend: the three ops of angle_kernels.dispatch as torch.library custom ops backed by the
kernels in csrc/ (binding: csrc/bindings.cpp), organised by op like the other backends:

    pair_scores(x, with_angle)                    -> pair_scores.py    (csrc/pair_scores.cu)
    ranking_loss(scores, labels)                  -> ranking.py        (csrc/ranking.cu)
    similarity_xent(q, c, scale, target, ...)     -> similarity_xent.py (csrc/similarity_xent.cu)
    is_available(allow_build=True) -> (bool, reason)

Implements `angle_kernels.contract.Backend`: inputs arrive validated by `angle_kernels.dispatch`, as CUDA
tensors (float32 / float64 / float16 / bfloat16; float32 accumulation, float64 stays float64). The ops are
`torch.ops.angle_kernels.cuda_*` (`_library`); they have fake implementations and autograd formulas, so they work
under torch.compile(fullgraph=True). Importing this package never fails on a CPU-only machine: `is_available()`
then says why the backend cannot run.
"""

from __future__ import annotations

# The op modules are imported eagerly and their functions bound afterwards: each submodule shares its name with
# the op it exports, and importing a submodule sets the package attribute of that name to the module.
try:
    from .pair_scores import pair_scores
    from .ranking import ranking_loss
    from .similarity_xent import similarity_xent
except Exception as exc:  # never break `import angle_kernels` because of this optional backend
    _LIBRARY_ERROR = f"defining the angle_kernels::cuda_* ops failed: {type(exc).__name__}: {exc}"

    def _unavailable(*args, **kwargs):
        raise RuntimeError(f"the CUDA backend is not available: {_LIBRARY_ERROR}")

    pair_scores = ranking_loss = similarity_xent = _unavailable
else:
    _LIBRARY_ERROR = ""


def is_available(allow_build: bool = True) -> tuple[bool, str]:
    """(True, "") when the CUDA kernels can run here, else (False, the reason).

    With allow_build=True (the default) this JIT-builds them from a source checkout when there is no prebuilt
    extension (minutes of nvcc, once per process); allow_build=False answers without compiling, as
    backend="auto" asks (see `_extension`).
    """
    if _LIBRARY_ERROR:
        return False, _LIBRARY_ERROR
    from . import _extension

    return _extension.load(allow_build=allow_build)


__all__ = ["pair_scores", "ranking_loss", "similarity_xent", "is_available"]
