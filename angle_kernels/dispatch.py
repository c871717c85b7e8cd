"""The ops every loss is built from, and the choice of backend that computes them.

Every public loss in `angle_kernels.functional` is assembled from four differentiable ops. Their semantics, the
contract every backend is held to (to the tolerances of the input dtype), are the docstrings of the functions
`pair_scores`, `ranking_loss`, `similarity_xent` and `similarity_lse` below. The backends implement them as
`torch.autograd.Function`s with explicit backward passes: `torch_ops` (pure PyTorch, any device), `triton_ops`
(fused Triton kernels for CUDA tensors), `cuda_ops` (the CUDA C++ extension in csrc/).

Common conventions (the numbers and checks in code: `angle_kernels.contract`)
    * Norms use F.normalize's epsilon: ||x|| is replaced by max(||x||, 1e-12), so a zero vector has
      cosine 0 with everything and never produces NaN.
    * Finite inputs never overflow a cosine: rows whose squared norms or dot products would exceed the compute
      dtype (float32 rows around 1.8e19, float64 around 1.3e154) are computed scaled by a power of two per row
      (exact; torch_ops/common.py). Raw dot products (similarity_lse with normalize=False) overflow where their
      true values do; its optional `reference` keeps the value of a loss exact there (the torch backend).
    * "Compute dtype": float64 inputs compute and return float64; float32, bfloat16 and float16 inputs
      accumulate in float32 and return float32. Gradients come back in the dtype of the input they belong to.
      Inside a torch.autocast region an op computes as outside it (`Ops` switches autocast off while it runs:
      `contract.outside_autocast`), and the public ops below called there give the gradients of a backward called
      after the region should backward be called inside it (`contract.recorded`); the ops have first derivatives
      only (their backward passes are kernels or gradients formed in forward; the losses and the public ops below
      refuse a second derivative with an error: `contract.first_derivatives_only`).
    * No op ever materialises an N x N matrix.
    * Every op's inputs are validated once, here (`Ops`, through `contract.check_<op>`), whatever the
      backend: shapes, dtypes, devices and options, never values (no device sync). Backends trust them.
    * Optional features (`contract.OPTIONAL_FEATURES`; today dims, the nested prefixes of pair_scores,
      similarity_xent and similarity_lse, and similarity_lse's reference): an op module declares those its op
      implements in FEATURES. A call with dims goes to a backend that has them; one with reference stays where it
      is, and a backend without it subtracts the reference logit from the op's value.

Calling the ops: `pair_scores(..., backend=None)`, `ranking_loss`, `similarity_xent` and `similarity_lse` validate
and run an op on the chosen backend; `resolve_backend(requested, *tensors)` returns the `Ops` of a backend, whose
methods do the same without choosing again and whose `computes(op, *args)` says which backend and code path would
compute a call. `raw_backend(name)` is a backend's own, unvalidated ops, as its package's `load_ops()` names them.

Choosing the backend: `requested` is "auto", "torch", "triton" or "cuda"; None means $ANGLE_KERNELS_BACKEND, then
"auto".
    * "auto" is the torch backend on CPU tensors. On CUDA tensors it may compute a call on each GPU backend
      (triton, and cuda when its extension is already compiled) that implements it and whose code path for it has
      passed its correctness run on this hardware and software (`angle_kernels.verified`) or, verified at large size
      on some GPU, passed a check of the first call of its kind here (`angle_kernels.first_use`), on the torch
      backend's GPU path for the call where it has one and that path may compute by the same rule (16-bit
      products: torch_ops/similarity_xent.py's "mixed"), and on the torch backend's default path, always; among
      those, the one measured fastest for the call's size on this GPU (`angle_kernels.measured`), else the first in
      the order triton, cuda, torch (its GPU path, then its default one). Computing on torch because no GPU code
      path may costs one RuntimeWarning per process. It never starts the JIT build of csrc/.
    * An explicit backend runs what it is asked: an unverified GPU code path costs a RuntimeWarning once per
      (backend, op, path); "cuda" JIT-builds csrc/ when no compiled extension is found; "triton" on CPU tensors
      runs under the Triton interpreter, only with TRITON_INTERPRET=1. A backend that cannot run raises
      RuntimeError with the reason; an op or feature it does not implement, a ValueError naming it. "torch" on CUDA
      tensors takes its GPU path only where that path is verified here (`TorchOps`), never unverified code: it is
      the choice of the arithmetic the CPU suite verifies (docs/dispatch.md).

Why it works this way, and the path from a loss to a kernel: docs/dispatch.md.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import os
import types

import torch

from . import contract, first_use, measured, user_warnings, verified
from ._runtime import check_gpu_settings, triton_interpreting  # also dispatch.triton_interpreting, as before

BACKENDS = ("torch", "triton", "cuda")


class Ops:
    """A backend behind the contract: each op checks its inputs (`contract`), then calls the backend's op. On CUDA
    tensors a GPU backend's code path that has not passed its correctness run on this GPU (`verified`) still runs,
    with a RuntimeWarning once per process and (backend, op, path)."""

    def __init__(self, name: str, backend: contract.Backend):
        self.name = name
        self.backend = backend

    def __repr__(self) -> str:
        return f"Ops({self.name!r})"

    # Each op runs with autocast off (contract.outside_autocast): it computes in its compute dtype in any region;
    # compiled inside one, with AOTAutograd tracing backward under it, outside the graph instead
    # (contract.untraced_under_autocast, as the losses: contract.loss_entry), as its backward passes need.

    @contract.untraced_under_autocast
    def pair_scores(self, x, with_angle, dims=None):
        call = contract.check_pair_scores(x, with_angle, dims)
        with contract.outside_autocast(x):
            return self._computing("pair_scores", call).pair_scores(*call.args)

    @contract.untraced_under_autocast
    def ranking_loss(self, scores, labels):
        call = contract.check_ranking_loss(scores, labels)
        with contract.outside_autocast(scores):
            return self._computing("ranking_loss", call).ranking_loss(*call.args)

    @contract.untraced_under_autocast
    def similarity_xent(self, q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0,
                        group_ids=None, dims=None):
        call = contract.check_similarity_xent(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids,
                                              dims)
        with contract.outside_autocast(q):
            return self._computing("similarity_xent", call).similarity_xent(*call.args)

    @contract.untraced_under_autocast
    def similarity_lse(self, q, c, scale, target_offset=0, period=0, exclude="none", penalty=0.0,
                       penalty_on="none", filter_q=None, filter_c=None, filter_threshold=None,
                       filter_keeps_target=False, normalize=True, dims=None, reference=None):
        call = contract.check_similarity_lse(q, c, scale, target_offset, period, exclude, penalty, penalty_on,
                                             filter_q, filter_c, filter_threshold, filter_keeps_target, normalize,
                                             dims)
        reference = contract.check_lse_reference(q, normalize, reference)
        with contract.outside_autocast(q):
            return self._similarity_lse(call, reference)

    def _similarity_lse(self, call: contract.SimilarityLseCall, reference: torch.Tensor | None):
        # reference does not steer the choice: a backend whose op lacks it computes the same value by subtraction
        backend = self._computing("similarity_lse", call)
        args = _each_tensor_once(call.args)
        if reference is None:
            return backend.similarity_lse(*args)
        if "reference" in backend.features["similarity_lse"]:
            return backend.similarity_lse(*args, reference=reference)  # keyword-only (OPTIONAL_FEATURES)
        q = call.q
        dtype = contract.compute_dtype(q.dtype)  # exact while the logits fit the compute dtype (else inf - inf)
        widths = [q.shape[1]] if call.dims is None else call.dims
        logits = torch.stack([call.scale * torch.linalg.vecdot(q[:, :d].to(dtype), reference[:, :d].to(dtype))
                              for d in widths])
        return backend.similarity_lse(*args) - (logits[0] if call.dims is None else logits)

    def takes_in_one_call(self, op: str, *args, **kwargs) -> bool:
        """Whether the optional features a call of `op` uses (kwargs, e.g. dims) are computed in one call where the
        call would run without them: this backend implements them, and for "auto" the backend it chooses with them
        is a GPU backend's, or the PyTorch backend's default path where it would compute the call without them
        too (so that a loss never moves a call from a GPU kernel to PyTorch for a feature; it then makes one call
        per prefix instead)."""
        features = _features(**{name: kwargs.get(name) for name in contract.OPTIONAL_FEATURES})
        return self.lacking(op, features) is None

    def computes(self, op: str, *args, **kwargs) -> tuple[str, str]:
        """(backend, code path) that would compute `op` on these arguments (the op's own, validated the same way);
        for "auto", after the first-use check the call would run (`first_use`)."""
        if op not in contract.OPS:  # getattr(Ops, op) said only "type object 'Ops' has no attribute ..."
            raise ValueError(f"op must be one of {', '.join(map(repr, contract.OPS))}; got {op!r}")
        call = self._checked(op, args, kwargs)
        chosen = self._choose(op, call)
        return chosen.name, chosen.code_path(op, call)

    def _checked(self, op: str, args: tuple, kwargs: dict) -> contract.Call:
        """The validated call of `op` with these arguments (similarity_lse's reference left out: it does not steer
        the choice)."""
        bound = inspect.signature(getattr(Ops, op)).bind(self, *args, **kwargs)
        bound.apply_defaults()
        bound.arguments.pop("reference", None)
        values = list(bound.arguments.values())[1:]
        return getattr(contract, f"check_{op}")(*values)

    def code_path(self, op: str, call: contract.Call) -> str:
        """The code path (the op module's PATHS) a validated call takes on this backend."""
        choose = self.backend.code_paths[op]
        return choose(*call.args) if choose is not None else self.backend.paths[op][0]

    def is_verified(self, op: str, call: contract.Call) -> bool:
        """Whether this backend's code path for the call has passed its correctness run on the call's GPU."""
        return verified.is_verified(self.name, op, self.code_path(op, call), call.device)

    def lacking(self, op: str, features: tuple[str, ...] = ()) -> str | None:
        """What of `op` with `features` this backend does not implement ("op" or "op with feature="), or None."""
        if getattr(self.backend, op) is None:
            return op
        missing = [f for f in features if f not in self.backend.features[op]]
        return f"{op} with {missing[0]}=" if missing else None

    def _choose(self, op: str, call: contract.Call) -> Ops:
        lacking = self.lacking(op, call.features)
        if lacking is not None:
            raise ValueError(f"backend {self.name!r} does not implement {lacking} yet; choose another backend "
                             "('torch' implements every op and feature)")
        return self

    def _computing(self, op: str, call: contract.Call) -> contract.Backend:
        """The backend that computes this call: this one (see _choose), warning when it is unverified here."""
        chosen = self._choose(op, call)
        if chosen.name in verified.GPU_BACKENDS and call.is_cuda:
            path = chosen.code_path(op, call)
            if not verified.is_verified(chosen.name, op, path, call.device):
                _warn_unverified(chosen, op, call, path)
        return chosen.backend


class AutoOps(Ops):
    """backend="auto" for CUDA tensors: each call on the backend `measured.fastest` picks among the GPU backends of
    `candidates` (those that load here: triton, then cuda) that implement it and whose code path for it is verified
    on this GPU (`verified`) or passes its first-use check, the torch backend's GPU path where the call has one, by
    the same rule (`_gpu_paths`), and the torch backend's default path; on that, when no GPU code path may compute
    the call, saying so once per process (`reasons`: why the unloaded GPU backends are missing)."""

    def __init__(self, candidates: list[Ops], reasons: dict[str, str]):
        super().__init__("auto", _TORCH_OPS.backend)
        self.candidates = candidates
        self.reasons = reasons

    def __repr__(self) -> str:
        return f"AutoOps({[c.name for c in self.candidates]!r})"

    def _gpu_paths(self, op: str, call: contract.Call) -> dict[Ops, str]:
        """Who may be asked to compute the call on a GPU code path, each with the code path it takes for the call
        (decided here, once per call): the candidates that implement it, then the torch backend's GPU path
        (`_TORCH_GPU_OPS`) where the call has one (a 16-bit call: "mixed"); the torch backend's default path needs
        no asking."""
        found = {candidate: candidate.code_path(op, call) for candidate in self.candidates
                 if candidate.lacking(op, call.features) is None}
        torch_path = _TORCH_GPU_OPS.code_path(op, call)
        if verified.needs_verification("torch", torch_path):
            found[_TORCH_GPU_OPS] = torch_path
        return found

    @staticmethod
    def _verified_for(op: str, call: contract.Call, paths: dict[Ops, str]) -> list[Ops]:
        """The GPU code paths for the call (`_gpu_paths`) verified on this GPU."""
        return [candidate for candidate, path in paths.items()
                if verified.is_verified(candidate.name, op, path, call.device)]

    @staticmethod
    def _checkable_for(op: str, call: contract.Call, paths: dict[Ops, str], verified_here: list[Ops]) -> list[Ops]:
        """The GPU code paths for the call not verified for it here that may compute it after a first-use check of
        its kind (their code passed the large-size checks on some GPU: `first_use.may_check`)."""
        return [candidate for candidate, path in paths.items()
                if candidate not in verified_here and first_use.may_check(candidate.name, op, path, call.device)]

    def _choose(self, op: str, call: contract.Call) -> Ops:
        return self._choice(op, call, self._gpu_paths(op, call))[0]

    def takes_in_one_call(self, op: str, *args, **kwargs) -> bool:
        call = self._checked(op, args, kwargs)
        if not call.features:
            return True
        plain = self._checked(op, args, {k: v for k, v in kwargs.items() if k not in contract.OPTIONAL_FEATURES})
        return self._choose(op, call) is not _TORCH_OPS or self._choose(op, plain) is _TORCH_OPS

    def _choice(self, op: str, call: contract.Call, paths: dict[Ops, str]) -> tuple[Ops, bool]:
        """(the backend that computes the call, whether some GPU backend may compute it), given the GPU code paths
        for it (`_gpu_paths`). The fastest of the verified candidates, the checkable ones and torch
        (`measured.fastest`); a checkable one is checked only when it is the one chosen (`first_use.decide`: the
        first call of its kind), and when this kind of call failed its check the choice is made again without it:
        nothing is checked that would not compute."""
        verified_here = self._verified_for(op, call, paths)
        checkable = self._checkable_for(op, call, paths, verified_here)
        fallback = {_TORCH_OPS: _TORCH_OPS.code_path(op, call)}
        while True:
            allowed = {c: path for c, path in paths.items() if c in verified_here or c in checkable}
            chosen = measured.fastest(op, call, {**allowed, **fallback})
            if chosen not in checkable or first_use.decide(chosen, op, call, paths[chosen]).computes:
                return chosen, bool(allowed)
            checkable.remove(chosen)

    def _computing(self, op: str, call: contract.Call) -> contract.Backend:
        paths = self._gpu_paths(op, call)
        chosen, gpu_allowed = self._choice(op, call, paths)
        if chosen is _TORCH_OPS and not gpu_allowed and not _warned_auto_on_gpu:
            self._warn_torch_on_gpu(op, call, paths)
        return chosen.backend

    def _warn_torch_on_gpu(self, op: str, call: contract.Call, paths: dict[Ops, str]) -> None:
        global _warned_auto_on_gpu
        _warned_auto_on_gpu = True
        why = dict(self.reasons)
        for candidate in self.candidates:
            lacking = candidate.lacking(op, call.features)
            why[candidate.name] = (f"it does not implement {lacking} yet" if lacking is not None else
                                   first_use.reason(candidate, op, call, paths[candidate]))
        if _TORCH_GPU_OPS in paths:
            why["torch"] = first_use.reason(_TORCH_GPU_OPS, op, call, paths[_TORCH_GPU_OPS])
        user_warnings.warn(
            f"angle_kernels: backend='auto' computes {op} with the PyTorch backend on this GPU, as it does every op "
            "and code path no GPU backend has passed a correctness run for on matching hardware and software, or a "
            "first-use check for the kind of call (" + "; ".join(f"{name}: {reason}" for name, reason in why.items())
            + "). `python -m angle_kernels.verify` "
            "runs those checks on this GPU in a few minutes and records what passes, which 'auto' then uses. Choose "
            f"a backend with backend='torch'|'triton'|'cuda' or {_ENV_VAR} to silence this warning (shown once per "
            "process).", RuntimeWarning)


class TorchOps(Ops):
    """backend="torch" for CUDA tensors: each call on the torch backend's GPU path (`_TORCH_GPU_OPS`) where the call
    has one and it is verified on this GPU (`verified`: the project's table or `python -m angle_kernels.verify`'s
    records), else on its default path; no warning either way. Never a first-use check: an explicit "torch" is the
    choice of the arithmetic the CPU suite verifies, and takes the faster one only where a full verification covers
    it (docs/dispatch.md)."""

    def __init__(self):
        super().__init__("torch", _TORCH_OPS.backend)

    def _choose(self, op: str, call: contract.Call) -> Ops:
        return _TORCH_GPU_OPS if _TORCH_GPU_OPS.is_verified(op, call) else _TORCH_OPS

    def _computing(self, op: str, call: contract.Call) -> contract.Backend:
        return self._choose(op, call).backend


_ENV_VAR = "ANGLE_KERNELS_BACKEND"
_REQUESTABLE = BACKENDS + ("auto",)  # what a call may ask for (_requested_name, on every call)
# Backend name -> its package, imported when the backend is first asked for. Each package's __init__ names its op
# modules in load_ops(): angle_kernels/torch_ops/__init__.py, triton_ops/__init__.py, cuda_ops/__init__.py.
_PACKAGES = {"torch": "angle_kernels.torch_ops", "triton": "angle_kernels.triton_ops", "cuda": "angle_kernels.cuda_ops"}
# What "auto" tries for CUDA tensors, in order, before the PyTorch path.
_AUTO_GPU_BACKENDS = ("triton", "cuda")


def _each_tensor_once(args: tuple) -> tuple:
    """A call's arguments with every tensor passed again (similarity_lse's q as its c: the query-to-query block, GIST's
    anchors against themselves and their guide's likewise) passed the second time as a view of itself, inside
    torch.compile traces: dynamo cannot trace an autograd.Function.apply that takes one tensor twice ("duplicate
    tensor input"). A view is the same data, and its gradient reaches the tensor. Outside traces, args as they are."""
    if not torch.compiler.is_compiling():
        return args
    passed: list[torch.Tensor] = []
    distinct = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            if any(arg is earlier for earlier in passed):
                arg = arg.view_as(arg)
            passed.append(arg)
        distinct.append(arg)
    return tuple(distinct)


def raw_backend(name: str) -> contract.Backend:
    """Backend `name`'s own ops, which trust their inputs (the losses call them through `Ops`, tests directly): the
    op modules its package's load_ops() returns (an op it does not name is one it lacks: None), with what they
    declare: `features` (op -> the optional features it implements, contract.OPTIONAL_FEATURES), `paths` (op -> its
    code paths, PATHS: one, "default", when it declares none) and `code_paths` (op -> its code_path function, None
    with one path). Imports the op modules; does not ask whether they can run."""
    package = importlib.import_module(_PACKAGES[name])
    found = package.load_ops()
    modules = {op: found.get(op) for op in contract.OPS}
    ops = {op: None if module is None else getattr(module, op) for op, module in modules.items()}
    features = {op: frozenset(getattr(module, "FEATURES", ())) for op, module in modules.items()}
    paths = {op: tuple(getattr(module, "PATHS", ("default",))) for op, module in modules.items()}
    code_paths = {op: getattr(module, "code_path", None) for op, module in modules.items()}
    return types.SimpleNamespace(is_available=package.is_available, features=features, paths=paths,
                                 code_paths=code_paths, **ops)


def _held_to(backend: contract.Backend, path: str) -> contract.Backend:
    """`backend` with every op held to the code path `path`: the op functions of modules that declare several paths
    called with path=path, and `path` as every op's one code path."""
    ops = {op: functools.partial(fn, path=path) if fn is not None and len(backend.paths[op]) > 1 else fn
           for op, fn in ((op, getattr(backend, op)) for op in contract.OPS)}
    return types.SimpleNamespace(**{**vars(backend), **ops, "paths": {op: (path,) for op in contract.OPS},
                                    "code_paths": {op: None for op in contract.OPS}})


def _features(**options) -> tuple[str, ...]:
    """The names of the optional features a call uses (those given a value other than None)."""
    return tuple(name for name, value in options.items() if value is not None)


# Backend name -> (its Ops, "") or (None, why it is unavailable), as found when that backend was asked for
# explicitly: the CUDA extension may then be JIT-built. "auto" asks without building, and its answers live
# apart in _loaded_without_build so that "not compiled yet" never becomes the answer to an explicit request;
# an explicit answer, once there, is final for "auto" too (a build that succeeded is usable, one that failed
# means no prebuilt extension either). Plain dicts rather than functools.lru_cache so that torch.compile can
# trace resolve_backend: once a backend is loaded, looking it up is a constant.
# The torch backend twice: held to its default path (float32/float64 products, allowed everywhere: what "auto" falls
# back to, and an explicit "torch" on CPU tensors), and on the path its op modules name (`code_path`: on a GPU, 16-bit
# products), which "auto" and an explicit "torch" on CUDA tensors take where it may compute (AutoOps, TorchOps).
_TORCH_OPS = Ops("torch", _held_to(raw_backend("torch"), verified.ALWAYS_ALLOWED["torch"]))
_TORCH_GPU_OPS = Ops("torch", raw_backend("torch"))
_TORCH_ON_GPU = TorchOps()
_loaded: dict[str, tuple[Ops | None, str]] = {"torch": (_TORCH_OPS, "")}
_loaded_without_build: dict[str, tuple[Ops | None, str]] = {}
# The (backend, op, path) an explicit GPU backend has warned about computing unverified, and whether "auto" has
# said that it computes on the torch backend on a GPU (one warning per process each).
_warned_unverified: set = set()
_warned_auto_on_gpu = False
# The AutoOps of each set of loadable GPU backends.
_auto_ops: dict[tuple[str, ...], AutoOps] = {}


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


def _warn_unverified(ops: Ops, op: str, call: contract.Call, path: str) -> None:
    """Tell the user, once per process and (backend, op, path), that an explicitly chosen GPU backend runs code
    (`path`, the call's code path) that has not passed its correctness run on this GPU."""
    if (ops.name, op, path) in _warned_unverified:
        return
    _warned_unverified.add((ops.name, op, path))
    user_warnings.warn(
        f"angle_kernels: backend={ops.name!r} computes {op} on its code path {path!r}, which has not passed a "
        f"correctness run on {verified.describe(ops.name, op, path, call.device)}. backend='auto' would compute it "
        + ("after a check of the first call of each kind here (its code passed the large-size checks on another GPU)"
           if first_use.may_check(ops.name, op, path, call.device) else "with the PyTorch backend")
        + "; `python -m angle_kernels.verify` checks the GPU backends on this GPU and records what passes (shown once "
        "per process for each backend, op and code path).", RuntimeWarning)


def _requested_name(requested: str | None) -> str:
    """The backend a call asks for, lower-case: `requested`, or for None $ANGLE_KERNELS_BACKEND, else "auto"; one of
    'auto', 'torch', 'triton', 'cuda' in any case, with spaces around it. Anything else raises ValueError naming where
    it came from (the `backend` argument or the variable)."""
    if requested is None:
        # the variable set but empty (`ANGLE_KERNELS_BACKEND= cmd`, a blank line in an env file) counts as unset, as
        # an empty ANGLE_KERNELS_CHECK_INPUTS does: refusing it failed every loss call
        value, source, expected = os.environ.get(_ENV_VAR, "").strip() or "auto", _ENV_VAR, "one of"
    else:
        value, source, expected = requested, "backend", "None or one of"
    name = value.strip().lower() if isinstance(value, str) else None
    if name not in _REQUESTABLE:
        shown = repr(value) if not isinstance(value, torch.Tensor) else f"a tensor of shape {tuple(value.shape)}"
        raise ValueError(f"{source} must be {expected} 'auto', 'torch', 'triton', 'cuda'; got {shown}")
    return name


def check_backend(backend: str | None) -> str | None:
    """A backend argument checked where it is given (a module's or a drop-in's constructor, patch()), not at its first
    call, after the model and data have loaded, as resolve_backend reads it (None: ANGLE_KERNELS_BACKEND, which is
    checked now too, else "auto"); returned as given, so a None still reads the variable at each call."""
    _requested_name(backend)
    return backend


def resolve_backend(requested: str | None, *tensors: torch.Tensor) -> Ops:
    """Return the Ops of the backend that computes ops on `tensors` (see the module docstring)."""
    name = _requested_name(requested)
    if not tensors:  # the backend depends on where the inputs are: the choice cannot be made without them
        raise TypeError("resolve_backend(requested, *tensors) takes the tensors the ops will compute on (their "
                        f"device decides the backend), e.g. resolve_backend({name!r}, embeddings); got none")
    on_cuda = getattr(tensors[0], "is_cuda", None)
    if on_cuda is None:
        raise TypeError(f"the ops take torch.Tensors, got {type(tensors[0]).__name__}")
    if on_cuda and name in ("auto", "triton"):  # the Triton backend's and the first-use checks' settings, before
        check_gpu_settings()  # any work (at the first call, not only where a path reads them)

    if name == "auto":
        if not on_cuda:
            return _TORCH_OPS
        candidates, reasons = [], {}
        for candidate in _AUTO_GPU_BACKENDS:
            ops, why = _load(candidate, allow_build=False)
            if ops is not None:
                candidates.append(ops)
            else:
                reasons[candidate] = why
        key = tuple(ops.name for ops in candidates)
        if key not in _auto_ops:
            _auto_ops[key] = AutoOps(candidates, reasons)
        return _auto_ops[key]

    # a refusal names where the backend came from: a variable exported for GPU jobs also reaches CPU runs, which
    # pass no backend argument to look for
    asked = f"backend {name!r}" + ("" if requested is not None else f" (from {_ENV_VAR})")
    if name == "cuda" and not on_cuda:
        raise ValueError(f"{asked} needs CUDA tensors; the inputs are on {tensors[0].device}")
    if name == "triton" and importlib.util.find_spec("triton") is None:  # no setting helps: say what to install
        raise RuntimeError(f"{asked} needs the triton package, which is not installed: pip install "
                           "'angle_kernels[triton]' (a CUDA build of torch brings it), or use backend='torch'")
    if name == "triton" and not on_cuda and not triton_interpreting():
        raise ValueError(
            f"{asked} on CPU tensors runs only under the Triton interpreter: set TRITON_INTERPRET=1 "
            "before importing triton, or use backend='torch'"
        )
    if name == "torch" and on_cuda:
        return _TORCH_ON_GPU
    ops, why = _load(name, allow_build=True)
    if ops is None:
        raise RuntimeError(f"{asked} is not available here: {why}")
    return ops


def path_ops(name: str, *tensors: torch.Tensor) -> Ops:
    """Backend `name`'s Ops computing every call on the code path its op modules name, verified here or not: what
    `python -m angle_kernels.verify` checks. resolve_backend's for triton and cuda; for torch, its GPU paths (which an
    explicit "torch" takes only where verified)."""
    return _TORCH_GPU_OPS if name == "torch" else resolve_backend(name, *tensors)


def _named_tensor(name: str, value):
    """The tensor that chooses the backend; anything else is a TypeError naming the argument."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def pair_scores(x, with_angle, dims=None, *, backend: str | None = None):
    """(cos, angle) of the pairs (x[g, 0], x[g, k]) of x [G, K, D], per prefix with dims. The contract:

    pair_scores(x, with_angle, dims=None) -> (cos, angle)
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
        dims: nested prefixes (Matryoshka). None, or k strictly increasing widths d_1 < ... < d_k <= D (a tuple of
        ints): the op is computed on every prefix x[..., :d_i] at once, exactly as k calls on the truncated inputs
        would compute it (each prefix with its own norms; the angle score at prefix d splits x[..., :d] in halves, so
        with_angle needs every d_i even), and the outputs gain a leading axis of k: ([k, G, K-1], [k, G, K-1]).
        Backward adds each prefix's gradient into its leading columns. An optional feature (module docstring).
    """
    ops = resolve_backend(backend, _named_tensor("x", x))
    return contract.recorded(ops.pair_scores(x, with_angle, dims), first=x, inputs=(x,))


def ranking_loss(scores, labels, *, backend: str | None = None):
    """log(1 + sum over label_i < label_j of exp(s_i - s_j)). The contract:

    ranking_loss(scores, labels) -> loss
        scores: [N] float32/float64; labels: [N], any real dtype, same device.
        loss = log(1 + sum over (i, j) with labels[i] < labels[j] of exp(scores[i] - scores[j]))
        Strict inequality: tied labels contribute nothing; all labels equal gives exactly 0.
        Returns a 0-dim tensor of scores' dtype; gradient with respect to scores only.
    """
    ops = resolve_backend(backend, _named_tensor("scores", scores))
    return contract.recorded(ops.ranking_loss(scores, labels), first=scores, inputs=(scores, labels))


def similarity_xent(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0, group_ids=None,
                    dims=None, *, backend: str | None = None):
    """Softmax cross-entropy over scaled cosines, never M x Mc in memory, per prefix with dims. The contract:

    similarity_xent(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0,
                    group_ids=None, dims=None) -> loss
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
        dims: nested prefixes, as pair_scores' (each prefix q[:, :d_i], c[:, :d_i] with its own norms, exactly as k
        calls on the truncated inputs): the loss is [k], one per prefix. An optional feature (module docstring).
    """
    ops = resolve_backend(backend, _named_tensor("q", q))
    return contract.recorded(
        ops.similarity_xent(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids, dims),
        first=q, inputs=(q, c, row_weights))


def similarity_lse(q, c, scale, target_offset=0, period=0, exclude="none", penalty=0.0, penalty_on="none",
                   filter_q=None, filter_c=None, filter_threshold=None, filter_keeps_target=False, normalize=True,
                   dims=None, *, reference=None, backend: str | None = None):
    """Per-row log partition functions [M] of scaled cosines (or dot products) with exclusions, hardness and
    filters, per prefix with dims. The contract:

    similarity_lse(q, c, scale, target_offset=0, period=0, exclude="none", penalty=0.0, penalty_on="none",
                   filter_q=None, filter_c=None, filter_threshold=None, filter_keeps_target=False,
                   normalize=True, dims=None) -> lse
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
        Optional feature reference (keyword-only; raw dot products): rows r [M, D] in q's dtype; the op then
        returns lse[i] - scale * q_i . r_i (and the gradient of r too), computed so that it is exact where the
        logits overflow the compute dtype and their difference does not (huge rows whose positive dominates give
        0, not inf - inf); where r_i is the row of row i's target column its logit is the target column's own.
        Finite inputs never give NaN through it; a value beyond the dtype is +-inf.
        dims: nested prefixes, as pair_scores' (optional feature): returns [k, M], row p the lse of the prefixes
            q[:, :d_p], c[:, :d_p] (each with its own norms), exactly as k calls on the truncated inputs; the filter
            embeddings are cut the same way (at least d_k wide), filter_threshold is then [k, M] (row p for prefix
            p) and reference is cut too. Backward takes grad [k, M].
    """
    ops = resolve_backend(backend, _named_tensor("q", q))
    return contract.recorded(
        ops.similarity_lse(q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c,
                           filter_threshold, filter_keeps_target, normalize, dims, reference=reference),
        first=q, inputs=(q, c, filter_q, filter_c, filter_threshold, reference))
