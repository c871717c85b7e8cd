"""The ops every loss is built from, and the choice of backend that computes them.

Every public loss in `angle_kernels.functional` is assembled from a few differentiable ops. Each backend
(`torch_ops`: pure PyTorch, any device; `triton_ops`: fused Triton kernels for CUDA tensors; `cuda_ops`:
the CUDA C++ extension in `csrc/`) implements them with exactly the semantics below (a backend may lack an op
for a while: the cuda backend has no similarity_lse yet; see `Ops`), as
`torch.autograd.Function`s with explicit backward passes, and must agree with the others to the
tolerances of the input dtype.

Common conventions (the numbers and checks in code: `angle_kernels.contract`)
    * Norms use F.normalize's epsilon: ||x|| is replaced by max(||x||, 1e-12), so a zero vector has
      cosine 0 with everything and never produces NaN.
    * "Compute dtype": float64 inputs compute and return float64; float32, bfloat16 and float16 inputs
      accumulate in float32 and return float32. Gradients come back in the dtype of the input they
      belong to.
    * No op ever materialises an N x N matrix.
    * Every op's inputs are validated once, here (`Ops`, through `contract.check_<op>`), whatever the
      backend: shapes, dtypes, devices and options, never values (no device sync). Backends trust them.

pair_scores(x, with_angle) -> (cos, angle)
    x: [G, K, D] (K >= 2). Pair k of group g is (u, v) = (x[g, 0], x[g, k]) for k = 1 .. K-1.
    The zigzag layout [2N, D] is x.view(N, 2, D); format C's [query, positive, negative] rows are
    x.view(B, 3, D).
    cos[g, k-1]   = u . v / (max(|u|, eps) * max(|v|, eps))
    angle[g, k-1] = (u . v + b . c - a . d) / (max(|u|, eps) * max(|v|, eps))
        where a, b are the first and second halves of u and c, d those of v: this is the reference's
        sum-pooled complex division before abs() and tau. Requires an even D. With with_angle=False the
        second output is all zeros, does not depend on x, and D may be odd.
    Both outputs: [G, K-1] in the compute dtype. Backward takes (grad_cos, grad_angle) and returns dx
    [G, K, D] in x's dtype (the anchor row accumulates the gradient of all its pairs).

ranking_loss(scores, labels) -> loss
    scores: [N] float32/float64; labels: [N], any real dtype, same device.
    loss = log(1 + sum over (i, j) with labels[i] < labels[j] of exp(scores[i] - scores[j]))
    Strict inequality: tied labels contribute nothing; all labels equal gives exactly 0.
    Returns a 0-dim tensor of scores' dtype; gradient with respect to scores only.

similarity_xent(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0,
                group_ids=None) -> loss
    q: [M, D]; c: [Mc, D], or None meaning c is q itself (the symmetric in-batch-negative case).
    l[i, j] = scale * cos(q_i, c_j), except at the target column t_i, where
        l[i, t_i] = scale * cos(min(arccos(cos(q_i, c_t)) + margin, pi))     (margin in radians, 0..pi)
        with sin(theta) = sqrt(max(1 - cos^2, 1e-6)) so the gradient stays finite as |cos| -> 1;
        margin == 0 leaves the target logit as scale * cos.
    target: "partner" (t_i = i xor 1, the zigzag pair partner) or "diagonal" (t_i = i).
    Columns C_i: all j < Mc, without j == i when exclude_diagonal.
    Positives P_i: {t_i}, plus, when group_ids ([M] int64, only with c=None) is given, every column
        j in C_i with group_ids[j] == group_ids[i] or group_ids[j] == group_ids[t_i] (identical texts
        count as positives, not negatives).
    loss = (1 / M) * sum_i w_i * (logsumexp_{j in C_i} l[i, j] - logsumexp_{j in P_i} l[i, j])
        with w = row_weights ([M], float, 0 for rows without a target) or all ones.
    Returns a 0-dim tensor in the compute dtype. Backward gives dq (and dc unless c is None), in the
    inputs' dtypes. Extra memory O(M + Mc) rows: per-row logsumexps, with the tiles recomputed in backward
    (triton's fused kernels, cuda), or the gradients formed in forward while a block of whole rows is held
    (torch; triton's dense scheme for wide embeddings).

similarity_lse(q, c, scale, target_offset=0, period=0, exclude="none", penalty=0.0, penalty_on="none",
               filter_q=None, filter_c=None, filter_threshold=None, filter_keeps_target=False,
               normalize=True) -> lse
    The per-row log partition function of a block of in-batch scores, the building block of the
    in-batch-negative family (joint and per-direction partitions, hardness weighting, guided and
    false-negative filtering): each loss combines a few of these [M] vectors and its positive scores.
    q: [M, D]; c: [Mc, D], same dtype and device. Row i's target column is t_i = target_offset + i (it may
    lie outside 0 .. Mc-1: then no column is the target). With period > 0, row i's "own" columns are the
    j with j % period == t_i (the target and, e.g., the row's own hard negatives laid out period apart);
    with period == 0 only j == t_i is own.
    Scores: s(x, y) = cos(x, y) when normalize, else the raw dot product x . y (util.dot_score's logits).
    Logits: l[i, j] = scale * s(q_i, c_j) + penalty * stop_gradient(s(q_i, c_j)) * H[i, j], where the
        hardness set H (penalty_on) is "none": no column; "other": the columns that are not own; "own": the
        own columns but the target; "all": every column but the target.
    Kept columns K_i: every j < Mc, minus the target when exclude="target", minus every own column when
        exclude="own", and, when filter_threshold ([M], float) is given, minus every j with
        s(filter_q_i, filter_c_j) > filter_threshold[i] (filter_q [M, D'] and filter_c [Mc, D'], any float
        dtype, e.g. a guide model's embeddings, or q and c themselves for a filter on the model's own
        scores), except the target when filter_keeps_target. The filter and the penalty carry no gradient.
    lse[i] = logsumexp_{j in K_i} l[i, j], -inf when K_i is empty. Returns [M] in the compute dtype.
    Backward takes grad_lse [M] and gives dq and dc (inputs' dtypes); rows with lse = -inf contribute
    nothing. O(M + Mc) extra memory: tiled, per-row state only; backward recomputes tiles.

Nested prefixes (Matryoshka): pair_scores(x, with_angle, dims) and similarity_xent(..., dims)
    dims=None, or k strictly increasing widths d_1 < ... < d_k <= D (a tuple of ints): the op is computed on
    every prefix x[..., :d_i] of its embeddings at once, exactly as k calls on the truncated inputs would
    compute it (each prefix with its own norms; the angle score at prefix d splits x[..., :d] in halves, so
    with_angle needs every d_i even), and its outputs gain a leading axis of k: pair_scores returns
    ([k, G, K-1], [k, G, K-1]), similarity_xent [k] (one loss per prefix). Backward adds each prefix's
    gradient into its leading columns. The point is one read of the embeddings for all k prefixes (a kernel
    walking D in chunks has every prefix's dot products and norms as running sums) and O(k) extra state per
    row. dims is an optional feature: a backend's op declares it (see contract.OPTIONAL_FEATURES); a call
    that uses it on a backend whose op lacks it goes, under "auto", to the torch backend (a RuntimeWarning
    once per process, backend and feature) and raises a ValueError naming the feature otherwise.

Stacked layers (layer-wise / Espresso training, functional's layer_weights) are not a feature of the ops: a
    stack [L, G, K, D] of pair groups is pair_scores on [L * G, K, D] (one call for every layer and prefix), and
    the softmax ops, whose rows must not see another layer's columns, are called once per layer.

Calling the ops
    angle_kernels.dispatch.pair_scores(x, with_angle, *, backend=None), .ranking_loss(scores, labels, *,
    backend=None), .similarity_xent(..., *, backend=None) and .similarity_lse(..., *, backend=None) validate
    and run an op on the chosen backend; resolve_backend(...) returns the `Ops` of a backend, whose methods do
    the same without choosing again. An op the backend does not implement goes, when "auto" chose the
    backend, to the torch backend (a RuntimeWarning once per process and op), and raises a ValueError naming
    the op when the backend was chosen explicitly.

Choosing the backend
    resolve_backend(requested, *tensors) -> Ops: requested is None/"auto", "torch", "triton" or "cuda"; None
    falls back to the environment variable ANGLE_KERNELS_BACKEND, then "auto". "auto" picks "triton"
    for CUDA tensors when Triton works, else "cuda" when the extension is already compiled (prebuilt by
    setup.py, or JIT-built earlier in this process), else "torch"; CPU tensors use "torch". For CUDA
    tensors each GPU backend it passes over costs a RuntimeWarning, once per process and backend, with the
    reason (choosing a backend explicitly silences it). "auto" never starts the JIT build of csrc/ (minutes of
    nvcc inside a loss call); an explicit "cuda" does when no compiled extension is found. An explicit
    backend that cannot run raises RuntimeError with the reason. "triton" on CPU tensors runs the kernels
    under the Triton interpreter and is allowed only when TRITON_INTERPRET=1.
"""

from __future__ import annotations

import importlib
import os
import types
import warnings

import torch

from . import contract

BACKENDS = ("torch", "triton", "cuda")


class Ops:
    """A backend behind the contract: each op checks its inputs (`contract`), then calls the backend's op."""

    def __init__(self, name: str, backend: contract.Backend, fallback: Ops | None = None):
        self.name = name
        self.backend = backend
        self.fallback = fallback  # where "auto" sends an op this backend does not implement (see _implementing)

    def __repr__(self) -> str:
        return f"Ops({self.name!r})"

    def pair_scores(self, x, with_angle, dims=None):
        args = contract.check_pair_scores(x, with_angle, dims)
        return self._implementing("pair_scores", _features(dims=dims)).pair_scores(*args)

    def ranking_loss(self, scores, labels):
        return self._implementing("ranking_loss").ranking_loss(*contract.check_ranking_loss(scores, labels))

    def similarity_xent(self, q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0,
                        group_ids=None, dims=None):
        args = contract.check_similarity_xent(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids,
                                              dims)
        return self._implementing("similarity_xent", _features(dims=dims)).similarity_xent(*args)

    def similarity_lse(self, q, c, scale, target_offset=0, period=0, exclude="none", penalty=0.0,
                       penalty_on="none", filter_q=None, filter_c=None, filter_threshold=None,
                       filter_keeps_target=False, normalize=True):
        args = contract.check_similarity_lse(q, c, scale, target_offset, period, exclude, penalty, penalty_on,
                                             filter_q, filter_c, filter_threshold, filter_keeps_target, normalize)
        return self._implementing("similarity_lse").similarity_lse(*args)

    def _implementing(self, op: str, features: tuple[str, ...] = ()) -> contract.Backend:
        """This backend if it implements `op` with the optional `features` the call uses; else, when "auto"
        chose it, its fallback (saying so once per process); else a ValueError naming the op or feature."""
        lacking = None
        if getattr(self.backend, op) is None:
            lacking = op
        else:
            missing = [f for f in features if f not in self.backend.features[op]]
            if missing:
                lacking = f"{op} with {missing[0]}="
        if lacking is None:
            return self.backend
        if self.fallback is None:
            raise ValueError(f"backend {self.name!r} does not implement {lacking} yet; choose another backend "
                             "('torch' implements every op and feature)")
        if (self.name, lacking) not in _warned_fallbacks:
            _warned_fallbacks.add((self.name, lacking))
            warnings.warn(f"angle_kernels: the {self.name!r} backend does not implement {lacking} yet; "
                          f"backend='auto' computes it with the {self.fallback.name!r} backend", RuntimeWarning,
                          stacklevel=4)
        return self.fallback._implementing(op, features)


_ENV_VAR = "ANGLE_KERNELS_BACKEND"
_PACKAGES = {name: f"angle_kernels.{name}_ops" for name in BACKENDS}
# What "auto" tries for CUDA tensors, in order, before the PyTorch path.
_AUTO_GPU_BACKENDS = ("triton", "cuda")


def raw_backend(name: str) -> contract.Backend:
    """Backend `name`'s own ops, which trust their inputs (the losses call them through `Ops`, tests directly),
    found by the convention stated at contract.OPS, and `features`: op -> the optional features its module
    declares (contract.OPTIONAL_FEATURES). Imports the op modules; does not ask whether they can run."""
    package = _PACKAGES[name]
    modules = {op: _module_or_none(f"{package}.{op}") for op in contract.OPS}
    ops = {op: None if module is None else getattr(module, op) for op, module in modules.items()}
    features = {op: frozenset(getattr(module, "FEATURES", ())) for op, module in modules.items()}
    return types.SimpleNamespace(is_available=importlib.import_module(package).is_available, features=features,
                                 **ops)


def _module_or_none(module_name: str):
    """The op's module, or None when the backend has no module for it (an op it does not implement yet)."""
    try:
        return importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise  # a module the op's module imports is missing: a broken backend, not a missing op
        return None


def _features(**options) -> tuple[str, ...]:
    """The names of the optional features a call uses (those given a value other than None)."""
    return tuple(name for name, value in options.items() if value is not None)


# Backend name -> (its Ops, "") or (None, why it is unavailable), as found when that backend was asked for
# explicitly: the CUDA extension may then be JIT-built. "auto" asks without building, and its answers live
# apart in _loaded_without_build so that "not compiled yet" never becomes the answer to an explicit request;
# an explicit answer, once there, is final for "auto" too (a build that succeeded is usable, one that failed
# means no prebuilt extension either). Plain dicts rather than functools.lru_cache so that torch.compile can
# trace resolve_backend: once a backend is loaded, looking it up is a constant.
_TORCH_OPS = Ops("torch", raw_backend("torch"))
_loaded: dict[str, tuple[Ops | None, str]] = {"torch": (_TORCH_OPS, "")}
_loaded_without_build: dict[str, tuple[Ops | None, str]] = {}
# The GPU backends "auto" has already warned about passing over, and the (backend, op) pairs it has sent to a
# fallback backend (one warning per process each).
_warned_fallbacks: set = set()
# The Ops "auto" returns for CUDA tensors: the GPU backend's, with the torch backend for the ops it lacks.
_auto_ops: dict[str, Ops] = {}


def _probe(backend: str, allow_build: bool) -> tuple[Ops | None, str]:
    """Ask an optional backend whether it works here; if it does, import its ops."""
    package = _PACKAGES[backend]
    try:
        module = importlib.import_module(package)
        if backend == "cuda":  # the only backend that can compile on load (a JIT build of csrc/)
            available, why = module.is_available(allow_build=allow_build)
        else:
            available, why = module.is_available()
        ops = Ops(backend, raw_backend(backend)) if available else None
    except Exception as exc:  # an optional backend must never break the losses: report it as the reason
        return None, f"importing or probing {package} raised {type(exc).__name__}: {exc}"
    return (ops, "") if available else (None, why)


def _load(backend: str, allow_build: bool) -> tuple[Ops | None, str]:
    """The backend's Ops or why it cannot run, probed once per kind of request (see _loaded)."""
    if backend in _loaded:
        return _loaded[backend]
    answers = _loaded if allow_build else _loaded_without_build
    if backend not in answers:
        answers[backend] = _probe(backend, allow_build)
    return answers[backend]


def _warn_auto_fallback(backend: str, why: str) -> None:
    """Tell the user, once per process, that "auto" passed over a GPU backend for CUDA tensors, and why."""
    if backend in _warned_fallbacks:
        return
    _warned_fallbacks.add(backend)
    warnings.warn(
        f"angle_kernels: backend='auto' does not use the {backend!r} backend for these CUDA tensors: {why}. "
        "It falls back to the next of 'triton', 'cuda' (only if already compiled), 'torch'. Choose a backend "
        f"with backend='torch'|'triton'|'cuda' or the environment variable {_ENV_VAR} to silence this warning.",
        RuntimeWarning,
        stacklevel=3,
    )


def triton_interpreting() -> bool:
    """True when TRITON_INTERPRET asks Triton to run kernels through its interpreter (CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def resolve_backend(requested: str | None, *tensors: torch.Tensor) -> Ops:
    """Return the Ops of the backend that computes ops on `tensors` (see the module docstring)."""
    name = requested if requested is not None else os.environ.get(_ENV_VAR, "auto")
    name = name.strip().lower() if isinstance(name, str) else name
    if name not in BACKENDS + ("auto",):
        source = "backend" if requested is not None else _ENV_VAR
        raise ValueError(f"{source} must be one of 'auto', 'torch', 'triton', 'cuda'; got {name!r}")
    on_cuda = getattr(tensors[0], "is_cuda", None)
    if on_cuda is None:
        raise TypeError(f"the ops take torch.Tensors, got {type(tensors[0]).__name__}")

    if name == "auto":
        if not on_cuda:
            return _TORCH_OPS
        for candidate in _AUTO_GPU_BACKENDS:
            ops, why = _load(candidate, allow_build=False)
            if ops is not None:
                if candidate not in _auto_ops:
                    _auto_ops[candidate] = Ops(candidate, ops.backend, fallback=_TORCH_OPS)
                return _auto_ops[candidate]
            _warn_auto_fallback(candidate, why)
        return _TORCH_OPS

    if name == "cuda" and not on_cuda:
        raise ValueError("backend 'cuda' needs CUDA tensors; the inputs are on " f"{tensors[0].device}")
    if name == "triton" and not on_cuda and not triton_interpreting():
        raise ValueError(
            "backend 'triton' on CPU tensors runs only under the Triton interpreter: set TRITON_INTERPRET=1 "
            "before importing triton, or use backend='torch'"
        )
    ops, why = _load(name, allow_build=True)
    if ops is None:
        raise RuntimeError(f"backend {name!r} is not available here: {why}")
    return ops


def _named_tensor(name: str, value):
    """The tensor that chooses the backend; anything else is a TypeError naming the argument."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def pair_scores(x, with_angle, dims=None, *, backend: str | None = None):
    """(cos, angle) of the pairs (x[g, 0], x[g, k]) of x [G, K, D], per prefix with dims (see the module
    docstring)."""
    return resolve_backend(backend, _named_tensor("x", x)).pair_scores(x, with_angle, dims)


def ranking_loss(scores, labels, *, backend: str | None = None):
    """log(1 + sum over label_i < label_j of exp(s_i - s_j)) (see the module docstring)."""
    return resolve_backend(backend, _named_tensor("scores", scores)).ranking_loss(scores, labels)


def similarity_xent(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0, group_ids=None,
                    dims=None, *, backend: str | None = None):
    """Softmax cross-entropy over scaled cosines, never M x Mc in memory, per prefix with dims (see the module
    docstring)."""
    return resolve_backend(backend, _named_tensor("q", q)).similarity_xent(
        q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids, dims
    )


def similarity_lse(q, c, scale, target_offset=0, period=0, exclude="none", penalty=0.0, penalty_on="none",
                   filter_q=None, filter_c=None, filter_threshold=None, filter_keeps_target=False, normalize=True,
                   *, backend: str | None = None):
    """Per-row log partition functions [M] of scale * cos(q, c) (or of dot products: normalize=False) with
    exclusions, hardness and filters (see the module docstring)."""
    return resolve_backend(backend, _named_tensor("q", q)).similarity_lse(
        q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c, filter_threshold,
        filter_keeps_target, normalize)
