"""The CUDA C++ backend: the three ops of angle_kernels.dispatch as torch.library custom ops backed by the
kernels in csrc/ (pair_scores.cu, ranking.cu, similarity_xent.cu; binding in csrc/bindings.cpp).

    pair_scores(x, with_angle) -> (cos, angle)
    ranking_loss(scores, labels) -> loss
    similarity_xent(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0, group_ids=None)
    is_available(allow_build=True) -> (bool, reason)

Semantics are exactly the contract in `angle_kernels.dispatch`. Inputs: CUDA tensors, float32 / float64 /
float16 / bfloat16 (float32 accumulation; float64 stays float64). The ops are `torch.ops.angle_kernels.cuda_*`
(see `_library`); they have fake implementations and autograd formulas, so they work under
torch.compile(fullgraph=True). Importing this module never fails on a CPU-only machine: `is_available()`
then says why the backend cannot run.
"""

from __future__ import annotations

import torch

try:
    from . import _library
except Exception as exc:  # never break `import angle_kernels` because of this optional backend
    _library = None
    _LIBRARY_ERROR = f"defining the angle_kernels::cuda_* ops failed: {type(exc).__name__}: {exc}"
else:
    _LIBRARY_ERROR = ""

SUPPORTED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
TARGETS = ("partner", "diagonal")


def is_available(allow_build: bool = True) -> tuple[bool, str]:
    """(True, "") when the CUDA kernels can run here, else (False, the reason).

    With allow_build=True (the default) this JIT-builds them from a source checkout when there is no prebuilt
    extension (minutes of nvcc, once per process); allow_build=False answers without compiling, as
    backend="auto" asks (see `_extension`).
    """
    if _library is None:
        return False, _LIBRARY_ERROR
    from . import _extension

    return _extension.load(allow_build=allow_build)


def _op(name: str):
    return getattr(torch.ops.angle_kernels, name)


def _check_float_tensor(t, name: str, dims: int) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float32, float64, float16 or bfloat16 for the cuda backend, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(t.shape)}")


def pair_scores(x: torch.Tensor, with_angle: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sum-pooled angle scores of the pairs (x[g, 0], x[g, k]); x is [G, K, D]. See dispatch."""
    _check_float_tensor(x, "x", 3)
    if x.shape[1] < 2:
        raise ValueError(f"x must be [G, K, D] with K >= 2, got shape {tuple(x.shape)}")
    if x.shape[2] < 1:
        raise ValueError("x must have D >= 1 features")
    if with_angle and x.shape[2] % 2 != 0:
        raise ValueError(f"the angle score splits x's features into two halves: D must be even, got {x.shape[2]}")
    cos, angle, _stats = _op("cuda_pair_scores_fwd")(x, bool(with_angle))
    return cos, angle


def _labels_for_sort(labels: torch.Tensor) -> torch.Tensor:
    """Labels in a dtype whose sort and equality are exact: float64 for floats, int64 for integers/bools."""
    if labels.dtype.is_complex:
        raise TypeError(f"labels must be real numbers, got {labels.dtype}")
    if labels.dtype.is_floating_point:
        return labels.to(torch.float64)
    return labels.to(torch.int64)


def ranking_loss(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log(1 + sum over label_i < label_j of exp(s_i - s_j)); scores [N] float32/float64. See dispatch."""
    if not isinstance(scores, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError("scores and labels must be torch.Tensors")
    if scores.dtype not in (torch.float32, torch.float64):
        raise TypeError(f"scores must be float32 or float64, got {scores.dtype}")
    if scores.dim() != 1:
        raise ValueError(f"scores must be 1-D, got shape {tuple(scores.shape)}")
    if labels.dim() != 1 or labels.shape[0] != scores.shape[0]:
        raise ValueError(f"labels must be [N] like scores ([{scores.shape[0]}]), got shape {tuple(labels.shape)}")
    if labels.device != scores.device:
        raise ValueError(f"labels must be on scores' device {scores.device}, got {labels.device}")
    loss, _order, _first, _past = _op("cuda_ranking_fwd")(scores, _labels_for_sort(labels))
    return loss


def similarity_xent(
    q: torch.Tensor,
    c: torch.Tensor | None,
    scale: float,
    target: str,
    row_weights: torch.Tensor | None = None,
    exclude_diagonal: bool = False,
    margin: float = 0.0,
    group_ids: torch.Tensor | None = None,
) -> torch.Tensor:
    """Softmax cross-entropy over scaled cosines, flash-style (never M x Mc in memory). See dispatch."""
    _check_float_tensor(q, "q", 2)
    rows, dim = q.shape
    if rows < 1 or dim < 1:
        raise ValueError(f"q must be [M >= 1, D >= 1], got shape {tuple(q.shape)}")
    if c is not None:
        _check_float_tensor(c, "c", 2)
        if c.shape[1] != dim or c.shape[0] < 1:
            raise ValueError(f"c must be [Mc >= 1, {dim}] to match q, got shape {tuple(c.shape)}")
        if c.dtype != q.dtype:
            raise TypeError(f"c must have q's dtype {q.dtype}, got {c.dtype}")
        if c.device != q.device:
            raise ValueError(f"c must be on q's device {q.device}, got {c.device}")
    cols = rows if c is None else c.shape[0]
    if target not in TARGETS:
        raise ValueError(f"target must be 'partner' or 'diagonal', got {target!r}")
    last_target = (rows - 1) ^ 1 if target == "partner" else rows - 1
    if last_target >= cols:
        raise ValueError(f"target {target!r} needs column {last_target}, but there are only {cols} columns")
    if exclude_diagonal and target == "diagonal":
        raise ValueError("exclude_diagonal=True cannot be combined with target='diagonal' (it removes the target)")
    margin = float(margin)
    if not 0.0 <= margin <= torch.pi:
        raise ValueError(f"margin must be in [0, pi] radians, got {margin}")
    if row_weights is not None:
        if not isinstance(row_weights, torch.Tensor) or not row_weights.dtype.is_floating_point:
            raise TypeError("row_weights must be a floating-point tensor")
        if row_weights.shape != (rows,):
            raise ValueError(f"row_weights must be [{rows}], got shape {tuple(row_weights.shape)}")
    if group_ids is not None:
        if c is not None:
            raise ValueError("group_ids is only supported with c=None (the symmetric in-batch case)")
        if not isinstance(group_ids, torch.Tensor) or group_ids.dtype.is_floating_point or group_ids.dtype.is_complex:
            raise TypeError("group_ids must be an integer tensor")
        if group_ids.shape != (rows,):
            raise ValueError(f"group_ids must be [{rows}], got shape {tuple(group_ids.shape)}")
        group_ids = group_ids.to(torch.int64)
    outputs = _op("cuda_similarity_xent_fwd")(
        q, c, float(scale), target, row_weights, bool(exclude_diagonal), margin, group_ids
    )
    return outputs[0]


__all__ = ["pair_scores", "ranking_loss", "similarity_xent", "is_available"]
