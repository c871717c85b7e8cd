"""Helpers shared by the top-level tests (oracle, parity, gradcheck, fuzz, bad-input and memory tests).

A plain module rather than conftest.py: pytest imports every folder's conftest.py under the one name
"conftest" (the last loaded wins sys.modules["conftest"]), so `from conftest import ...` would find another
folder's conftest. tests/conftest.py provides the fixtures and imports these.

Error measure everywhere: rel_err(out, ref) = ||out - ref|| / ||ref|| over the whole tensor, computed in
float64 (NaN in `out` makes it NaN, and NaN never passes a `<=` comparison).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import zlib
from pathlib import Path
from types import ModuleType

import torch

# Tolerances from shared/docs/measuring.md: float32 loss values far below 1e-5 and gradients below 1e-4;
# float64 is held much tighter (the only error left is the order of summation).
VALUE_TOL = {torch.float64: 1e-10, torch.float32: 1e-5}
GRAD_TOL = {torch.float64: 1e-8, torch.float32: 1e-4}


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| over the whole tensor, in float64. A zero reference gives ||out||."""
    out = out.detach().to(torch.float64).reshape(-1)
    ref = ref.detach().to(torch.float64).reshape(-1)
    assert out.shape == ref.shape, f"shape mismatch {tuple(out.shape)} vs {tuple(ref.shape)}"
    scale = torch.linalg.vector_norm(ref)
    diff = torch.linalg.vector_norm(out - ref)
    return float(diff / scale) if scale > 0 else float(diff)


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "", atol: float = 0.0) -> None:
    """||out - ref|| <= tol * ||ref|| + atol, with an informative message; NaN/Inf in `out` always fails.

    atol is only for comparisons against a reference with a known absolute rounding floor (angle-emb's
    logsumexp over [0, ...] has an absolute error of ~1e-16 in float64 whatever the loss's size).
    """
    assert torch.isfinite(out.detach()).all(), f"{what}: non-finite values in the output"
    out64, ref64 = out.detach().to(torch.float64).reshape(-1), ref.detach().to(torch.float64).reshape(-1)
    assert out64.shape == ref64.shape, f"{what}: shape mismatch {tuple(out.shape)} vs {tuple(ref.shape)}"
    diff = float(torch.linalg.vector_norm(out64 - ref64))
    scale = float(torch.linalg.vector_norm(ref64))
    assert diff <= tol * scale + atol, (
        f"{what}: relative error {rel_err(out, ref):.3e} (abs {diff:.3e}, |ref| {scale:.3e}) exceeds {tol:.1e}"
        + (f" + atol {atol:.1e}" if atol else "")
    )


def seed_from(*parts) -> int:
    """A stable 31-bit seed from any test parameters (stable across processes, unlike hash())."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def randn(gen: torch.Generator, *shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def zigzag_labels(gen: torch.Generator, n_pairs: int, kind: str = "graded") -> torch.Tensor:
    """Labels [2N] (float32), the pair's label repeated on both rows.

    kind: 'graded' (continuous, no ties), 'ties' (3 levels, heavy ties), 'binary' (0/1),
    'ones' (all 1), 'zeros' (all 0), 'equal' (all the same non-binary value).
    """
    if kind == "graded":
        per_pair = torch.rand(n_pairs, generator=gen, dtype=torch.float64) * 5.0
    elif kind == "ties":
        per_pair = torch.randint(0, 3, (n_pairs,), generator=gen).to(torch.float64)
    elif kind == "binary":
        per_pair = torch.randint(0, 2, (n_pairs,), generator=gen).to(torch.float64)
    elif kind == "ones":
        per_pair = torch.ones(n_pairs, dtype=torch.float64)
    elif kind == "zeros":
        per_pair = torch.zeros(n_pairs, dtype=torch.float64)
    elif kind == "equal":
        per_pair = torch.full((n_pairs,), 2.5, dtype=torch.float64)
    else:
        raise ValueError(kind)
    return per_pair.repeat_interleave(2).to(torch.float32)


def load_reference_loss_module() -> ModuleType | None:
    """angle_emb.loss from the installed angle-emb package; None when it is not installed.

    The package import pulls in datasets, transformers and more (about 10 s); when that import fails
    but the package files are present, angle_emb/loss.py (which needs only torch) is loaded by path.
    """
    try:
        return importlib.import_module("angle_emb.loss")
    except Exception:
        pass
    spec = importlib.util.find_spec("angle_emb")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "loss.py"
    if not path.exists():
        return None
    module_spec = importlib.util.spec_from_file_location("_angle_emb_reference_loss", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def grads_of(fn, *inputs: torch.Tensor):
    """Run fn on detached leaf copies of `inputs` (requires_grad), backprop the scalar result; return
    (value, [grad per input])."""
    leaves = [x.detach().clone().requires_grad_(True) for x in inputs]
    value = fn(*leaves)
    if not value.requires_grad:  # e.g. AngleLoss with every weight 0: a constant, no graph to walk
        return value.detach(), [torch.zeros_like(leaf) for leaf in leaves]
    value.backward()
    grads = [leaf.grad if leaf.grad is not None else torch.zeros_like(leaf) for leaf in leaves]
    return value.detach(), grads


def env_flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


def _within(out: torch.Tensor, ref: torch.Tensor, tol: float) -> bool:
    return bool(torch.isfinite(out.detach()).all()) and rel_err(out, ref) <= tol


def check_against_oracle(ours_fn, oracle_fn, inputs, dtype, what, value_tol=None, grad_tol=None):
    """Ours on `inputs` cast to `dtype` (float32 or float64) against the float64 oracle on the same values:
    the loss (0-dim, dtype) and the gradient of every input (in its dtype), relative error over the tensor.

    float32 cases that the formulas cannot resolve in float32 at all pass at the flash-attention rule: when
    eager float32 (the oracle's very formulas run in float32) misses the tolerance too, ours may be at most 2x
    eager's error. Example: a contrastive loss of 1e-14 is logsumexp(l) - l_target for logits of size 20, with
    an absolute rounding floor of ~1e-6 in any float32 implementation. Well-conditioned cases never reach it
    (eager's float32 error there is ~1e-7).
    Returns (ours_value, oracle_value).
    """
    import oracle  # tests/oracle.py

    inputs = [x.to(dtype) for x in inputs]
    value_tol = value_tol or VALUE_TOL[dtype]
    grad_tol = grad_tol or GRAD_TOL[dtype]
    ours_value, ours_grads = grads_of(ours_fn, *inputs)
    true_value, true_grads = grads_of(oracle_fn, *[x.to(torch.float64) for x in inputs])
    assert ours_value.dim() == 0, f"{what}: loss must be 0-dim, got {tuple(ours_value.shape)}"
    assert ours_value.dtype == dtype, f"{what}: loss dtype {ours_value.dtype}, expected {dtype}"
    for g, x in zip(ours_grads, inputs):
        assert g.dtype == x.dtype, f"{what}: gradient dtype {g.dtype}, expected {x.dtype}"
    pairs = [("value", ours_value, true_value, value_tol)]
    pairs += [(f"grad of input {k}", g, t, grad_tol) for k, (g, t) in enumerate(zip(ours_grads, true_grads))]
    eager = None
    for name, out, ref, tol in pairs:
        if _within(out, ref, tol):
            continue
        if dtype != torch.float32:
            assert_close(out, ref, tol, f"{what} {name}")
        if eager is None:
            with oracle.computing_in(torch.float32):
                eager_value, eager_grads = grads_of(oracle_fn, *inputs)
            eager = {"value": eager_value, **{f"grad of input {k}": g for k, g in enumerate(eager_grads)}}
        eager_err = rel_err(eager[name], ref)
        assert eager_err > tol and torch.isfinite(out).all() and rel_err(out, ref) <= 2 * eager_err, (
            f"{what} {name}: relative error {rel_err(out, ref):.3e} exceeds {tol:.1e} "
            f"(eager float32's own error here: {eager_err:.3e})"
        )
    return ours_value, true_value
