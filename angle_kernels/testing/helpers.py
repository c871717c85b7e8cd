"""The helpers every test shares: seeds, inputs, the backends under test, the checks against the oracle, and
the start of multi-process tests' processes.

A plain module rather than conftest.py: pytest imports every folder's conftest.py under the one name
"conftest" (the last loaded wins sys.modules["conftest"]), so `from conftest import ...` would find another
folder's conftest. tests/conftest.py provides the fixtures and imports these; the error measure, rel_err,
lives in angle_kernels.testing.oracle with the oracle (bench/ uses it too). Needs hypothesis (the fuzz settings
and strategies); pytest only in the helpers that skip a case, which import it when they run.

How results are judged (the rule angle_kernels.float64_ops states, above VALUE_TOL), by `check_against_oracle`:
    * float64 inputs: VALUE_TOL / GRAD_TOL against the float64 oracle (only summation order differs);
    * float32 inputs: the same tables, against the oracle in float64 on the same float32 values;
    * bfloat16 / float16 inputs: the half-precision rule, `assert_half_rule`: the error against float64 at
      most 2x eager PyTorch's own error in the same dtype, eager being the oracle's very formulas run in that
      dtype (oracle.computing_in). Float32 cases that float32 cannot resolve at all (eager float32 misses the
      tolerance too) are held to the same rule.
"""

from __future__ import annotations

import importlib
import importlib.util
import math
import os
import sys
import time
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from angle_kernels.float64_ops import GRAD_TOL, HALF_RULE_FLOOR, VALUE_TOL  # noqa: F401  (re-exported to the tests)
from angle_kernels.testing import oracle
from angle_kernels.testing.oracle import rel_err

# VALUE_TOL, GRAD_TOL: the tolerances (float32 loss values far below 1e-5 and gradients
# below 1e-4; float64 much tighter: only the order of summation differs), stated once, with the reference, since
# `angle_kernels.verify` judges by them too.
HALF_DTYPES = (torch.bfloat16, torch.float16)
# Against angle-emb run in float64: its log(1 + S) is a logsumexp over [0, ...] and its cross-entropies are
# logsumexp(l) - l_target, both with an absolute rounding error of ~1e-16 however small the loss (a well-ranked
# batch at tau = 20 has L ~ 1e-6): the value_atol of check_against_oracle for parity checks.
REFERENCE_ATOL = 1e-15

# HALF_RULE_FLOOR, the half-precision rule's only slack beyond "2x eager": a relative error of 1e-6, what float32
# accumulation may cost. It matters only where eager in bf16/fp16 is exact by luck (a zero gradient, a loss that
# happens to round onto a representable value), where 2x eager's error would demand more than float32 can give.


# ----------------------------------------------------------------------------------------------------
# seeds and inputs
# ----------------------------------------------------------------------------------------------------
def seed_from(*parts) -> int:
    """A stable 31-bit seed from any test parameters (stable across processes, unlike hash())."""
    return zlib.crc32(repr(parts).encode()) & 0x7FFFFFFF


def generator(*parts) -> torch.Generator:
    """A CPU generator seeded from `parts`: fresh inputs per test case, reproducible per test case."""
    return torch.Generator().manual_seed(seed_from(*parts))


def randn(gen: torch.Generator, *shape, dtype=torch.float32, scale: float = 1.0) -> torch.Tensor:
    """Standard normal values drawn in float64, times `scale`, then rounded to `dtype` (CPU)."""
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def zigzag_labels(gen: torch.Generator, n_pairs: int, kind: str = "graded") -> torch.Tensor:
    """Labels [2N] (float32), the pair's label repeated on both rows (but for 'mixed').

    kind: 'graded' (continuous, no ties), 'ties' (3 levels, heavy ties), 'binary' (0/1),
    'ones' (all 1), 'zeros' (all 0), 'equal' (all the same non-binary value), 'mixed' (0/1 per row: the two
    rows of a pair may disagree, which the in-batch-negative loss reads as no target for either).
    """
    if kind == "mixed":
        return torch.randint(0, 2, (2 * n_pairs,), generator=gen).to(torch.float32)
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


# Hypothesis settings of the fuzz tests, bounded for CI: derandomized (the same examples every run), no example
# database, a fixed number of examples per test.
FUZZ = settings(max_examples=80, deadline=None, derandomize=True, database=None,
                suppress_health_check=[HealthCheck.too_slow])


@st.composite
def label_sets(draw, n_pairs):
    """One label per pair, repeated on both rows: [2N] float64 with a structure hypothesis picks (continuous,
    a few levels, binary, or all equal)."""
    kind = draw(st.sampled_from(["continuous", "levels", "equal", "binary"]))
    if kind == "continuous":
        values = draw(st.lists(st.floats(-5, 5, allow_nan=False, width=32), min_size=n_pairs, max_size=n_pairs))
    elif kind == "levels":
        levels = draw(st.integers(2, 6))
        values = draw(st.lists(st.integers(0, levels - 1), min_size=n_pairs, max_size=n_pairs))
    elif kind == "binary":
        values = draw(st.lists(st.integers(0, 1), min_size=n_pairs, max_size=n_pairs))
    else:
        values = [draw(st.floats(-3, 3, allow_nan=False, width=32))] * n_pairs
    return torch.tensor(values, dtype=torch.float64).repeat_interleave(2)


def fuzz_embeddings(seed: int, rows: int, dim: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """Random rows for the fuzz tests; for one seed in five, row 1 is row 0 halved (an exactly collinear pair)."""
    x = randn(torch.Generator().manual_seed(seed), rows, dim, dtype=torch.float64, scale=scale)
    if rows > 2 and seed % 5 == 0:
        x[1] = x[0] * 0.5
    return x.to(dtype)


# Finite inputs whose squared norms and dot products overflow the compute dtype (float32 and bfloat16 rows past
# ~1.8e19, float64 past ~1.3e154): (dtype, magnitude) pairs. Not beyond ~2^100 in float32/bfloat16: the gradients,
# ~1 / |x|, would fall among the subnormal numbers (below 2^-126), where no implementation keeps the tolerances.
HUGE_MAGNITUDES = [(torch.float32, 2.0**64), (torch.float32, 2.0**100), (torch.bfloat16, 2.0**64),
                   (torch.bfloat16, 2.0**100), (torch.float64, 2.0**996)]
# The op tests' share of them (each Triton case costs interpreter time): one per dtype.
HUGE_OP_MAGNITUDES = [(torch.float32, 2.0**64), (torch.bfloat16, 2.0**100), (torch.float64, 2.0**996)]


def huge_magnitude_id(case) -> str:
    dtype, magnitude = case
    return f"{str(dtype).replace('torch.', '')}-2^{int(math.log2(magnitude))}"


def moved_to(device: torch.device, value):
    """`value` with its tensors moved to `device`: a tensor, or a tuple or dict of them and other things (left as
    they are): the arguments of an op call, for the backend's device."""
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, tuple):
        return tuple(moved_to(device, v) for v in value)
    if isinstance(value, dict):
        return {k: moved_to(device, v) for k, v in value.items()}
    return value


def huge_row_factors(x: torch.Tensor, magnitude: float) -> torch.Tensor:
    """Per-row powers of two for x [..., D], shaped [..., 1] in x's dtype: `magnitude` on most rows, 1 on every fifth
    (flattened order), so that scaled and unscaled rows meet. Every cosine is invariant under them: a loss of
    x * factors is the loss of x, and its gradient with respect to x (the factors applied inside the differentiated
    function) is the gradient of x's loss, so the float64 oracle on x judges it at the usual tolerances."""
    factors = torch.full((x[..., 0].numel(),), magnitude, dtype=torch.float64, device=x.device)
    factors[::5] = 1.0
    return factors.reshape(*x.shape[:-1], 1).to(x.dtype)


def float64_cannot_resolve(loss: torch.Tensor) -> bool:
    """True for a softmax cross-entropy loss in (0, 1e-6): it is logsumexp(l) - l_target of logits of size up
    to tau, and its gradient (softmax minus target, ~loss in size) is known in float64 only to ~1e-16 absolute,
    more than the 1e-8 relative tolerance whatever the implementation. The fuzz tests skip such float64 draws
    (float32 ones are judged by eager float32's own error, see check_against_oracle)."""
    return 0.0 < float(loss) < 1e-6


def runtime_warnings(fn, *args, **kwargs) -> tuple:
    """(fn(*args, **kwargs), the messages of the RuntimeWarnings it gave), each of the package's filed under the line
    of the test that called this helper (angle_kernels.user_warnings: this file is the package's, which the walk to
    the caller's line passes)."""
    caller = sys._getframe(1).f_code.co_filename
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args, **kwargs)
    runtime = [w for w in caught if issubclass(w.category, RuntimeWarning)]
    misplaced = [f"{w.filename}:{w.lineno}" for w in runtime if "angle_kernels" in str(w.message)
                 and w.filename != caller]
    assert not misplaced, f"warnings filed elsewhere than {caller}: {misplaced}"
    return result, [str(w.message) for w in runtime]


def env_flag(name: str) -> bool:
    return os.environ.get(name, "0") not in ("", "0")


# ----------------------------------------------------------------------------------------------------
# the backends under test
# ----------------------------------------------------------------------------------------------------
BACKEND_NAMES = ("torch", "triton", "cuda")

# Where the Triton kernels run in this session: CPU tensors through the interpreter, or CUDA tensors through
# the compiler. The root conftest.py decided it (TRITON_INTERPRET) before anything imported triton.
TRITON_DEVICE = torch.device("cpu" if env_flag("TRITON_INTERPRET") else "cuda")


@dataclass(frozen=True)
class Backend:
    """One backend under test: its name, the op interface dispatch gives for it, and where its tensors live."""

    name: str
    ops: object  # what angle_kernels.dispatch.resolve_backend returns: pair_scores, ranking_loss, similarity_xent
    device: torch.device

    @property
    def interpreted(self) -> bool:
        """True for the Triton backend (or a scheme of it a test names "triton-...") on CPU tensors: its kernels run
        through the interpreter, program by program."""
        return self.name.startswith("triton") and self.device.type == "cpu"


# The pair-score kernels run one program per group, each the same work on its own rows: their constexprs and branches
# come from K, D, dims, the dtype and with_angle, never from the number of groups. Through the interpreter every
# program runs in Python (a second or more for a wide row), so there the op tests run a case on two of its groups,
# which still show a second program reading and writing at a later group's offsets; compiled, a case keeps its own.
INTERPRETED_PAIR_GROUPS = 2


def pair_groups(groups: int, interpreted: bool) -> int:
    """How many groups a pair-score case runs on: `groups`, or at most INTERPRETED_PAIR_GROUPS where the Triton
    kernels run through the interpreter (`interpreted`: Backend.interpreted, or TRITON_DEVICE on the CPU)."""
    return min(groups, INTERPRETED_PAIR_GROUPS) if interpreted else groups


def backend_or_skip(name: str) -> Backend:
    """The backend `name` on its device, or a pytest skip that says why it cannot run here.

    Only a missing dependency skips: no triton installed, no CUDA device, no compiled CUDA extension. A
    backend whose own code fails to import or load fails the test (an import bug is not a skip).
    """
    import pytest

    from angle_kernels.dispatch import resolve_backend

    if name == "torch":
        device = torch.device("cpu")
    elif name == "triton":
        try:
            import triton  # noqa: F401
        except Exception as exc:  # noqa: BLE001  (any broken install counts as "not available")
            pytest.skip(f"triton is not available: {type(exc).__name__}: {exc}")
        device = TRITON_DEVICE
    elif name == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("the cuda backend needs a CUDA device; there is none here")
        device = torch.device("cuda")
        try:
            return Backend(name, resolve_backend(name, torch.empty(0, device=device)), device)
        except RuntimeError as exc:  # dispatch's "not available here: <why>" (e.g. the extension is not built)
            pytest.skip(str(exc))
    else:
        raise ValueError(f"unknown backend {name!r}")
    return Backend(name, resolve_backend(name, torch.empty(0, device=device)), device)


def across_backends(cases, interpreted_triton_runs, case_id=lambda *case: "-".join(map(str, case))):
    """pytest params (backend name, *case) of every case on every backend, for a test that parametrises the
    `backend` fixture itself (indirect=["backend"]), with the ids the fixture's own params would give: the
    backend's name, "-", case_id(*case) ("triton-cosine_loss-torch.float32"). Under the Triton interpreter
    (TRITON_DEVICE on the CPU) only the cases for which interpreted_triton_runs(*case) is true run on the triton
    backend: an interpreted case costs seconds where the same front-end code on the torch backend costs
    milliseconds. The compiled Triton backend (a CUDA device) runs every case."""
    import pytest

    interpreted = TRITON_DEVICE.type == "cpu"
    return [pytest.param(name, *case, id=f"{name}-{case_id(*case)}")
            for name in BACKEND_NAMES for case in cases
            if not (name == "triton" and interpreted) or interpreted_triton_runs(*case)]



def in_turn(items, dtypes):
    """An across_backends rule: item k of `items` runs in dtypes[k % len(dtypes)] alone, so that the items together
    meet every dtype (one dtype a case where the same front-end code is checked in every dtype on another backend)."""
    items = list(items)
    return lambda item, dtype: dtype == dtypes[items.index(item) % len(dtypes)]

# ----------------------------------------------------------------------------------------------------
# running a function and its backward
# ----------------------------------------------------------------------------------------------------
class ShapeRecorder:
    """The shape of every tensor each op returns while `.mode` is entered (a TorchDispatchMode), tagged with
    `.phase` ("forward" until a test sets it to "backward"): how the memory tests see that no fused path makes
    an N x N tensor."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_flatten

        recorder = self
        self.phase, self.shapes = "forward", []

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                result = func(*args, **(kwargs or {}))
                for t in tree_flatten(result)[0]:
                    if isinstance(t, torch.Tensor):
                        recorder.shapes.append((recorder.phase, tuple(t.shape)))
                return result

        self.mode = Mode()


def _addmm_in_place_flops(self_shape, a_shape, b_shape, out_shape=None, **kwargs) -> int:
    return 2 * a_shape[0] * a_shape[1] * b_shape[1]


def flop_counter():
    """torch's FLOP counter (torch.utils.flop_counter.FlopCounterMode, nothing displayed), given a formula for the
    in-place addmm_ the backends accumulate gradients with, which it has none for: the out-of-place one's, 2 m k n.
    `get_total_flops()` and, per op, `get_flop_counts()["Global"]` after the block."""
    from torch.utils.flop_counter import FlopCounterMode

    return FlopCounterMode(display=False, custom_mapping={torch.ops.aten.addmm_: _addmm_in_place_flops})


def skip_unless_implemented(backend: Backend, op: str) -> None:
    """Skip a case of a backend that does not implement `op` yet (a backend may lack an op: dispatch.raw_backend)."""
    import pytest

    if getattr(backend.ops.backend, op) is None:
        pytest.skip(f"the {backend.name} backend does not implement {op} yet")


def skip_unless_feature(backend: Backend, op: str, feature: str) -> None:
    """Skip a case of a backend whose `op` lacks the optional `feature` (contract.OPTIONAL_FEATURES: an op module
    declares the ones it implements in FEATURES; dispatch.raw_backend collects them)."""
    import pytest

    skip_unless_implemented(backend, op)
    if feature not in backend.ops.backend.features[op]:
        pytest.skip(f"the {backend.name} backend's {op} does not implement {feature}= yet")


def leaf_like(x: torch.Tensor, device=None, dtype=None) -> torch.Tensor:
    """A fresh leaf requiring grad with x's values and x's strides (clone() would make a non-dense layout
    contiguous), on `device` and in `dtype` (default: x's)."""
    leaf = torch.empty_strided(x.shape, x.stride(), dtype=dtype or x.dtype, device=device or x.device)
    leaf.copy_(x.detach())
    return leaf.requires_grad_(True)


class IgnoresIncomingGradient(torch.autograd.Function):
    """The identity, whose backward passes ones on instead of the gradient it receives: around an op's outputs, a
    backward that ignores its upstream gradient, which checks drawing random backward weights (cotangent) must fail."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return torch.ones_like(grad)


def cotangent(output: torch.Tensor, index: int) -> torch.Tensor:
    """The fixed random weight (float64, CPU) each output is multiplied by before backward: the same for every
    implementation of the same output, and never 1, so a backward that ignores its incoming gradient fails."""
    return torch.randn(output.shape, generator=generator("cotangent", tuple(output.shape), index), dtype=torch.float64)


def outputs_and_grads(fn, leaves: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Run fn(*leaves) (a tensor or a tuple of tensors) and backpropagate sum_k <output_k, cotangent_k>.

    Returns the outputs and the gradient of every leaf (zeros for a leaf the outputs do not depend on),
    detached and on the CPU.
    """
    outputs = fn(*leaves)
    outputs = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
    total = sum((out.double() * cotangent(out, k).to(out.device)).sum() for k, out in enumerate(outputs))
    if isinstance(total, torch.Tensor) and total.requires_grad:
        grads = torch.autograd.grad(total, leaves, allow_unused=True)
    else:  # e.g. AngleLoss with every weight 0: a constant
        grads = [None] * len(leaves)
    grads = [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves)]
    return [out.detach().cpu() for out in outputs], [g.detach().cpu() for g in grads]


def grads_of(fn, *inputs: torch.Tensor):
    """The value of a scalar fn on fresh leaves copied from `inputs`, and the gradient of every input (the
    value's own backward, no cotangent): (value, [grad per input]), on the inputs' device."""
    leaves = [leaf_like(x) for x in inputs]
    value = fn(*leaves)
    if not value.requires_grad:  # e.g. AngleLoss with every weight 0: a constant, no graph to walk
        return value.detach(), [torch.zeros_like(leaf) for leaf in leaves]
    grads = torch.autograd.grad(value, leaves, allow_unused=True)
    return value.detach(), [torch.zeros_like(x) if g is None else g for g, x in zip(grads, leaves)]


# ----------------------------------------------------------------------------------------------------
# judging results
# ----------------------------------------------------------------------------------------------------
def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float, what: str = "", atol: float = 0.0) -> None:
    """||out - ref|| <= tol * ||ref|| + atol, with an informative message; NaN/Inf in `out` always fails.

    atol is only for comparisons against a reference with a known absolute rounding floor (angle-emb's
    logsumexp over [0, ...] has an absolute error of ~1e-16 in float64 whatever the loss's size).
    """
    assert torch.isfinite(out.detach()).all(), f"{what}: non-finite values in the output"
    out64, ref64 = out.detach().to(torch.float64).reshape(-1).cpu(), ref.detach().to(torch.float64).reshape(-1).cpu()
    assert out64.shape == ref64.shape, f"{what}: shape mismatch {tuple(out.shape)} vs {tuple(ref.shape)}"
    diff = float(torch.linalg.vector_norm(out64 - ref64))
    scale = float(torch.linalg.vector_norm(ref64))
    assert diff <= tol * scale + atol, (
        f"{what}: relative error {rel_err(out, ref):.3e} (abs {diff:.3e}, |ref| {scale:.3e}) exceeds {tol:.1e}"
        + (f" + atol {atol:.1e}" if atol else "")
    )


def assert_half_rule(out: torch.Tensor, eager: torch.Tensor | None, exact: torch.Tensor, what: str = "") -> None:
    """The half-precision rule (flash-attention's): `out`'s error against the float64 `exact` is at most 2x
    the error of `eager`, the same computation done by eager PyTorch in the input's dtype (+ HALF_RULE_FLOOR).

    eager=None where eager PyTorch cannot compute the case at all (a zero vector in float16: the norm's
    epsilon underflows to 0 and eager returns NaN; norms above 256 overflow its squares): the baseline is then
    the exact result correctly rounded to out's dtype, a stricter one, since no result stored in that dtype
    has a smaller error. Entries whose exact value lies beyond out's dtype range must come back as infinities
    of the same sign and are left out of the error; NaN never passes.
    """
    out, exact = out.detach().cpu(), exact.detach().to(torch.float64).cpu()
    assert not torch.isnan(out).any(), f"{what}: NaN in the output"
    beyond_range = torch.isinf(exact.to(out.dtype))  # what correct rounding to out's dtype turns into infinity
    if beyond_range.any():
        expected = torch.where(exact > 0, math.inf, -math.inf)
        assert torch.equal(out[beyond_range].double(), expected[beyond_range]), (
            f"{what}: entries beyond {out.dtype}'s range must be infinities of the exact value's sign")
    out, exact = out[~beyond_range], exact[~beyond_range]
    assert torch.isfinite(out).all(), f"{what}: non-finite values where the exact result is within range"
    if eager is None:
        baseline, baseline_err = f"correct rounding to {out.dtype}", rel_err(exact.to(out.dtype), exact)
    else:
        eager = eager.detach().cpu()[~beyond_range]
        assert torch.isfinite(eager).all(), (
            f"{what}: the eager baseline is not finite: pass eager=None where eager {eager.dtype} cannot compute it")
        baseline, baseline_err = f"eager {eager.dtype}", rel_err(eager, exact)
    err = rel_err(out, exact)
    assert err <= 2 * baseline_err + HALF_RULE_FLOOR, (
        f"{what}: relative error {err:.3e} exceeds 2x the error of {baseline} ({baseline_err:.3e})")


def _within(out: torch.Tensor, ref: torch.Tensor, tol: float, atol: float) -> bool:
    diff = float(torch.linalg.vector_norm(out.double() - ref.double()))
    return diff <= tol * float(torch.linalg.vector_norm(ref.double())) + atol


def check_against_oracle(ours_fn, oracle_fn, inputs, what, device="cpu", value_tol=None, grad_tol=None,
                         value_atol=0.0):
    """Ours against the exact result on the same values: every output and the gradient of every input.

    oracle_fn: a function of angle_kernels.testing.oracle, or of the reference package (angle-emb): run on the inputs in
    float64 it is the exact result; run on them in their own dtype (inside oracle.computing_in(dtype), which
    makes the oracle's formulas compute in that dtype) it is eager PyTorch's, the half-precision rule's baseline.
    inputs: the differentiable tensors, already in the dtype under test (ours gets leaves with their strides,
    on `device`; oracle_fn gets the values on the CPU). Everything else the functions need (labels, options)
    they take from their closure. Outputs must come in the compute dtype, gradients in their input's dtype;
    NaN or Inf never passes. value_atol: an absolute slack on the outputs, only for an exact result with a
    known absolute rounding floor (angle-emb's logsumexp over [0, ...]: ~1e-16 in float64 whatever the loss).
    Returns (ours outputs, exact outputs).
    """
    dtype = inputs[0].dtype
    result_dtype = torch.float64 if dtype == torch.float64 else torch.float32  # dispatch's "compute dtype"
    ours_out, ours_grads = outputs_and_grads(ours_fn, [leaf_like(x, device=device) for x in inputs])
    exact_out, exact_grads = outputs_and_grads(oracle_fn, [leaf_like(x, device="cpu", dtype=torch.float64)
                                                           for x in inputs])
    for k, (out, ref) in enumerate(zip(ours_out, exact_out)):
        assert out.shape == ref.shape, f"{what} output {k}: shape {tuple(out.shape)}, expected {tuple(ref.shape)}"
        assert out.dtype == result_dtype, f"{what} output {k}: {out.dtype} for {dtype} inputs"
    for k, (grad, x) in enumerate(zip(ours_grads, inputs)):
        assert grad.dtype == x.dtype, f"{what} gradient of input {k}: {grad.dtype}, expected {x.dtype}"

    checks = [(f"output {k}", out, ref, value_tol or VALUE_TOL.get(dtype), value_atol)
              for k, (out, ref) in enumerate(zip(ours_out, exact_out))]
    checks += [(f"gradient of input {k}", g, ref, grad_tol or GRAD_TOL.get(dtype), 0.0)
               for k, (g, ref) in enumerate(zip(ours_grads, exact_grads))]
    eager = None
    for name, out, ref, tol, atol in checks:
        assert torch.isfinite(out).all(), f"{what} {name}: non-finite values (an element never written?)"
        if dtype == torch.float64:
            assert_close(out, ref, tol, f"{what} {name}", atol=atol)
            continue
        if dtype == torch.float32 and _within(out, ref, tol, atol):
            continue
        if eager is None:  # the same computation in the input dtype: eager PyTorch's own error
            with oracle.computing_in(dtype):
                eager_out, eager_grads = outputs_and_grads(oracle_fn, [leaf_like(x, device="cpu") for x in inputs])
            eager = dict(zip([c[0] for c in checks], eager_out + eager_grads))
        if dtype == torch.float32:  # the tolerance is out of float32's reach only if eager misses it too
            assert not _within(eager[name], ref, tol, atol), (
                f"{what} {name}: relative error {rel_err(out, ref):.3e} exceeds {tol:.1e}, "
                f"which eager float32 meets ({rel_err(eager[name], ref):.3e})")
        assert_half_rule(out, eager[name], ref, f"{what} {name}")
    return ours_out, exact_out


# ----------------------------------------------------------------------------------------------------
# processes
# ----------------------------------------------------------------------------------------------------
# What the rank processes of the multi-process tests import: loaded once, in the server start_ranks forks them
# from (a module that is not installed is left out by the server).
RANK_PRELOAD = ("torch", "torch.distributed", "torch.distributed.checkpoint", "torch.distributed.fsdp",
                "angle_kernels", "angle_train.trainer", "sentence_transformers")


def start_ranks(fn, args: tuple = (), nprocs: int = 2, *, timeout_s: float | None = None) -> None:
    """torch.multiprocessing.spawn(fn, args, nprocs), each process forked from a server that has imported
    RANK_PRELOAD (multiprocessing's "forkserver"), and raises what a process raised, as spawn does. timeout_s: the
    processes still running after that many seconds are killed and a TimeoutError raised (a hang fails the test).

    A spawned process imports torch, transformers and the test module afresh, which on two cores took 4-5 s of a
    2-process test whose own work takes half a second (14 s for 3 processes that import sentence-transformers); a
    forked one finds them imported (the server's own start, once per session, about as long as one spawn). Each
    process gets this process's environment, working directory and sys.path at the call, as a spawned one does;
    only the preloaded modules were imported once, under the environment of the first call. The processes cannot
    be forked from the test process itself: it has run parallel torch ops, and OpenMP's threads do not survive a
    fork; the server runs none."""
    import multiprocessing

    import torch.multiprocessing

    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"  # (Windows)
    if method == "forkserver":
        multiprocessing.get_context(method).set_forkserver_preload(list(RANK_PRELOAD))  # before its first start
    context = torch.multiprocessing.start_processes(_in_environment, args=(dict(os.environ), fn, args),
                                                    nprocs=nprocs, join=False, start_method=method)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while not context.join(None if deadline is None else max(0.0, deadline - time.monotonic())):
        if deadline is not None and time.monotonic() >= deadline:
            running = [rank for rank, process in enumerate(context.processes) if process.is_alive()]
            for process in context.processes:
                process.kill()
            raise TimeoutError(f"process(es) {running} of {nprocs} still running after {timeout_s} s")


def outputs_of_ranks(fn, out_dir, world: int = 2) -> list:
    """start_ranks(fn, (world, STORE, OUT_DIR), nprocs=world), each process rendezvousing through the file STORE in
    `out_dir` and writing what it found to OUT_DIR/rank{r}.pt (torch.save): those, by rank."""
    import torch

    start_ranks(fn, (world, os.path.join(out_dir, "store"), str(out_dir)), nprocs=world)
    return [torch.load(os.path.join(out_dir, f"rank{rank}.pt")) for rank in range(world)]


def _in_environment(rank: int, environ: dict, fn, args: tuple) -> None:
    os.environ.clear()
    os.environ.update(environ)
    fn(rank, *args)


# ----------------------------------------------------------------------------------------------------
# the reference package
# ----------------------------------------------------------------------------------------------------
# Importing the angle_emb package (angle_emb/__init__.py imports angle.py, its trainer) pulls in transformers, peft,
# datasets, scikit-learn and bitsandbytes (angle.py imports bitsandbytes at the top, so the package import fails
# without it), about 10 s. The losses need only angle_emb/loss.py, which needs only torch: that file is loaded by
# path. The full package is imported only for what lives in angle.py (AngleLoss, the trainers), by
# import_angle_emb_package.
BITSANDBYTES_CPU_LOGGER = "bitsandbytes.backends.cpu.ops"  # logs "Failed to load CPU gemm_4bit_forward ..."


def reference_loss_path() -> Path | None:
    """angle_emb/loss.py of the installed angle-emb package (found without importing it); None when absent."""
    spec = importlib.util.find_spec("angle_emb")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(list(spec.submodule_search_locations)[0]) / "loss.py"
    return path if path.exists() else None


def load_reference_loss_module() -> ModuleType | None:
    """angle_emb/loss.py (angle-emb 0.6.1's losses) loaded by path, without importing the angle_emb package;
    None when angle-emb is not installed.

    A module of its own (not sys.modules["angle_emb.loss"]): it computes with the reference's code even while
    angle_kernels.integrations.angle_emb has patched the package's names."""
    path = reference_loss_path()
    if path is None:
        return None
    module_spec = importlib.util.spec_from_file_location("_angle_emb_reference_loss", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


def import_angle_emb_package() -> ModuleType:
    """The angle_emb package with angle_emb.angle and angle_emb.loss imported (raises what the import raises).

    bitsandbytes, which angle.py imports, logs a warning on CPUs with AVX512-BF16 when its optional `kernels`
    package is missing ("Failed to load CPU gemm_4bit_forward from kernels-community: ..."): no test uses
    4-bit kernels, so that logger is quieted while the package is imported (and restored afterwards)."""
    import logging

    logger = logging.getLogger(BITSANDBYTES_CPU_LOGGER)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        angle_emb = importlib.import_module("angle_emb")
        importlib.import_module("angle_emb.angle")
        importlib.import_module("angle_emb.loss")
    finally:
        logger.setLevel(level)
    return angle_emb


def patch_formula(monkeypatch, name: str, replacement) -> None:
    """Replace the loss formula `name` (e.g. "ranking_terms") wherever a caller looks it up: its family module of
    angle_kernels.losses, the family modules that import it, and angle_kernels.terms (its alias): the tests that
    count a formula's calls see every caller's."""
    import angle_kernels.terms
    from angle_kernels.losses import angle, arccse, retrieval

    for module in (angle, arccse, retrieval, angle_kernels.terms):
        if hasattr(module, name):
            monkeypatch.setattr(module, name, replacement)
