"""What every backend may assume: the shared constants, the compute dtype, and each op's input validation.

The semantics of the ops are stated once, in `angle_kernels.dispatch`. This module holds what that
statement needs in code: the numbers it names (the norm epsilon, the margin's sin^2 floor), the compute-dtype
rule, the `Backend` protocol the backends implement, and one validation function per op, which returns the
validated call as that op's frozen dataclass (`Call`: fields by name, `.args` in the backends' positional order).
Dispatch calls the validation for every backend before it calls the op (`dispatch.Ops`), so a backend trusts its
inputs: it never re-checks shapes, dtypes, devices or option values, and it gets them in a normal form (Python
floats and bools, int64 group ids, no bool labels).

The checks here read only metadata (shapes, dtypes, devices): they never force a device sync. Checks that read
values (NaN/Inf, label values) belong to the public losses (`angle_kernels.inputs`).

The CUDA sources repeat the two constants (`csrc/common.cuh` kNormEps, `csrc/similarity_xent.cu`
kSinSqFloor): tests/ops/test_contract.py reads them from there and holds them equal to these.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import numbers
import operator
import sys
from typing import Callable, ClassVar, Protocol, TypeVar

import torch
from typing_extensions import ParamSpec  # typing's from Python 3.10; torch depends on typing_extensions

from . import user_warnings

# F.normalize's epsilon: ||x|| is replaced by max(||x||, NORM_EPS), so a zero vector has cosine 0 with everything.
NORM_EPS = 1e-12
# The margin logit uses sin(theta) = sqrt(max(1 - cos^2, this)): its gradient stays finite as |cos| -> 1.
MARGIN_SIN_SQUARED_FLOOR = 1e-6
# A false-negative filter (GIST's guide; MNRL's and AngleLoss's false_negative_margin) drops a column whose score
# exceeds its row's threshold by more than this (times |q_i| |p_i| for dot products): a column tied with the
# threshold in exact arithmetic stays, as the strict inequality has it. A text repeated in the batch makes such ties
# (the duplicate of row i's positive scores exactly the positive's score), which the two computations round apart:
# the threshold comes from a pair score, the column from a tile of products (measured up to 10 float32 roundings of
# 2^-24 apart; this is 256 of them), so without it the duplicate's fate would be the rounding's.
FILTER_TIE_ALLOWANCE = 2.0**-16

EMBEDDING_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
SCORE_DTYPES = (torch.float32, torch.float64)
TARGETS = ("partner", "diagonal")
LSE_EXCLUDES = ("none", "target", "own")
LSE_PENALTIES = ("none", "other", "own", "all")
# The ops, by name. A backend is a package whose __init__ defines is_available() and load_ops(), and which has one
# module per op, named after the op and defining a function of that name (torch_ops/ranking_loss.py ->
# ranking_loss); load_ops() imports the op modules and returns them by these names (docs/dispatch.md).
OPS = ("pair_scores", "ranking_loss", "similarity_xent", "similarity_lse")
# The optional features of the contract: an op module lists those its op implements in FEATURES (a tuple of these
# names); dispatch sends a call that uses a feature its backend's op lacks elsewhere (see dispatch.Ops). Every op
# function still takes the whole argument list (dims last, positional, as `Backend` writes it), and gets None for
# a feature it does not declare; reference, added after the backends' functions were written, is passed by keyword,
# and only to the ops that declare it.
#   dims: nested prefixes (Matryoshka) for pair_scores, similarity_xent and similarity_lse.
#   reference: similarity_lse's value relative to each row's logit with a reference row (raw dot products), exact
#     where the logits overflow the compute dtype; keyword-only; dispatch subtracts the logit for an op without it.
OPTIONAL_FEATURES = ("dims", "reference")


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 stays float64; float32, bfloat16 and float16 accumulate (and return results) in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def outside_autocast(tensor: torch.Tensor):
    """A context in which torch.autocast is off for `tensor`'s device type (a no-op context where it is not on).

    The losses and the ops compute in the compute dtype whatever autocast region they are called in (the AMP recipe
    puts the loss inside one): autocast would run their products in 16 bits, mixing dtypes inside the backends'
    autograd Functions, round loss terms to 16 bits, and refuse to stack bfloat16 rows in a float16 region. Their
    16-bit inputs still compute as 16-bit inputs do anywhere. Backward is autograd's: called inside a region (which
    PyTorch advises against), the backends' backward passes would run under autocast, unless the nodes run it
    outside (`backward_outside_autocast`, which loss_entry and the public ops apply: `recorded`)."""
    if autocast_enabled(tensor.device.type):
        return torch.autocast(device_type=tensor.device.type, enabled=False)
    return contextlib.nullcontext()


def autocast_enabled(device_type: str) -> bool:
    """Whether a torch.autocast region is on for `device_type` in this thread. Whether autocast exists for a device
    type is asked of torch once per process (`_autocast_available`): every loss call asks this two or three times."""
    available = _autocast_available.get(device_type)
    if available is None:
        available = _autocast_available[device_type] = torch.amp.is_autocast_available(device_type)
    return available and torch.is_autocast_enabled(device_type)


_autocast_available: dict[str, bool] = {}  # device type -> whether torch.autocast exists for it (autocast_enabled)


def backward_outside_autocast(result, device_type: str, inputs) -> None:
    """Where a loss was computed inside an autocast region: every autograd node of `result` (a tensor or a tuple of
    them) between it and `inputs` (the call's arguments: tensors, or lists or tuples of them) gets a pre-hook that
    switches autocast off for `device_type` while the node's backward runs, so that a backward() called inside the
    region (PyTorch's recipe calls it after the region, but the loss and its backward in one region are common)
    computes the loss's gradients as one called after it: the backends' backward passes would run their products
    under autocast (16-bit gradients, or a dtype mismatch: angle_loss's). Autograd gives every node it runs the
    thread's settings of the backward() call, so the switch lasts one node, and the nodes of the inputs (the
    model's) run in the region as eager autograd runs them: the walk stops at them, and at the leaves' gradient
    accumulators (which outlive the call: a hook there would stay for every later backward)."""
    roots = result if isinstance(result, tuple) else (result,)
    tensors = [t for value in inputs for t in (value if isinstance(value, (list, tuple)) else (value,))
               if isinstance(t, torch.Tensor)]
    stops = {t.grad_fn for t in tensors if t.grad_fn is not None}
    hook = functools.partial(_autocast_off, device_type)
    pending = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen = set()
    while pending:
        node = pending.pop()
        # hasattr(node, "variable"): a leaf's AccumulateGrad, the only node that names its tensor
        if node is None or node in seen or node in stops or hasattr(node, "variable"):
            continue
        seen.add(node)
        node.register_prehook(hook)
        pending.extend(next_node for next_node, _ in node.next_functions)


def _autocast_off(device_type: str, grad_outputs) -> None:
    """A node's pre-hook (backward_outside_autocast): autocast off for `device_type` while the node runs."""
    if torch.is_autocast_enabled(device_type):
        torch.set_autocast_enabled(device_type, False)


def backward_traced_under_autocast(*tensors: torch.Tensor) -> bool:
    """Whether torch.compile is tracing this call, whose backward it will trace too (grad mode on, one of `tensors`
    requiring grad), inside an autocast region for the first tensor's device type, with AOTAutograd set to trace
    backward passes under an autocast (_backward_pass_autocast). The backends' backward passes would then be traced
    with their products under autocast, which eager autograd never does for a backward called outside the region:
    16-bit gradients, or a dtype mismatch between the products' operands. The losses and ops then compute outside
    the graph (`call_outside_the_graph`)."""
    if not (torch.compiler.is_compiling() and torch.is_grad_enabled()):
        return False
    tensors = [t for t in tensors if isinstance(t, torch.Tensor)]  # anything else: the op's checks name it
    if not any(t.requires_grad for t in tensors):
        return False
    device_type = tensors[0].device.type
    return (torch.amp.is_autocast_available(device_type) and torch.is_autocast_enabled(device_type)
            and _backward_pass_autocast() != "off")


def _backward_pass_autocast():
    """AOTAutograd's torch._functorch.config.backward_pass_autocast: "same_as_forward" (the default: backward traced
    under the forward's autocast), "off", or a list of autocast arguments to trace backward under. torch before 2.9
    has no such setting and traces backward under the forward's autocast: "same_as_forward"."""
    return getattr(torch._functorch.config, "backward_pass_autocast", "same_as_forward")


_AUTOCAST_BACKWARD_ADVICE = (
    "an angle_kernels loss or op compiled inside a torch.autocast region: AOTAutograd would trace its backward under "
    "an autocast (torch._functorch.config.backward_pass_autocast is not 'off'; its default is 'same_as_forward'), "
    "which its backward passes do not support, so it computes outside the compiled graph (a graph break). To trace "
    "it whole, set torch._functorch.config.backward_pass_autocast = 'off' (torch 2.9 or later: backward traced as "
    "eager autograd runs a backward called outside the region), or call the loss outside the region")
_warned_autocast_backward = False


def _call_warning_once(function: Callable, *args, **kwargs):
    global _warned_autocast_backward
    if not _warned_autocast_backward:
        _warned_autocast_backward = True
        user_warnings.warn(_AUTOCAST_BACKWARD_ADVICE)
    return function(*args, **kwargs)


def _never_compiled(function: Callable, reason: str) -> Callable:
    """torch.compiler.disable(function), with `reason` where torch takes one (2.8 and later: an error under
    fullgraph=True then gives it)."""
    if "reason" in inspect.signature(torch.compiler.disable).parameters:
        return torch.compiler.disable(function, reason=reason)
    return torch.compiler.disable(function)


def __getattr__(name: str) -> Callable:
    """The module's `call_outside_the_graph`, made at its first use: `function(*args, **kwargs)` run eagerly between
    compiled graphs (for `backward_traced_under_autocast`): its forward as outside the region, its backward by
    autograd as eager code's. Warns once per process; under fullgraph=True, torch.compile raises instead, with the
    advice as its reason. Made at first use because torch.compiler.disable imports torch._dynamo, 1.5-2.5 s that an
    import of angle_kernels would otherwise pay (more than torch's own import) where nothing compiles. The callers
    read it as an attribute of this module (`_this_module.call_outside_the_graph`), not as a global name: a trace
    then reads it with getattr, which runs this function outside the trace. (Not a decorator: a decorated definition
    of this module would join the fingerprint of every GPU path that reaches the module.)"""
    if name == "call_outside_the_graph":
        made = globals()[name] = _never_compiled(_call_warning_once, _AUTOCAST_BACKWARD_ADVICE)
        return made
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


_this_module = sys.modules[__name__]


def untraced_under_autocast(function: Callable[_Args, _Result]) -> Callable[_Args, _Result]:
    """`function` (a loss's computing function, an op of dispatch.Ops) run outside the compiled graph
    (`call_outside_the_graph`) where torch.compile traces it with a backward under autocast
    (`backward_traced_under_autocast` of its tensor arguments, given directly or in a list or tuple)."""

    @functools.wraps(function)
    def called(*args: _Args.args, **kwargs: _Args.kwargs) -> _Result:
        if torch.compiler.is_compiling() and backward_traced_under_autocast(*_arguments_flat(args, kwargs)):
            return _this_module.call_outside_the_graph(function, *args, **kwargs)
        return function(*args, **kwargs)

    return called


def _arguments_flat(args: tuple, kwargs: dict) -> list:
    """A call's arguments with every list or tuple among them replaced by its items (where its tensors are)."""
    return [t for value in (*args, *kwargs.values()) for t in (value if isinstance(value, (list, tuple)) else (value,))]


def _refuse_second_derivatives(grad_outputs: tuple) -> None:
    """A loss's pre-hook on the autograd node that made it, run as its backward starts: refuses a second derivative
    (the backends' backward passes compute gradients with untracked ops, formed in forward, or kernels, so a second
    derivative through them, create_graph, e.g. a gradient penalty, would silently count their gradients as
    constants; autograd runs backward, its hooks included, under grad mode only when asked to differentiate it:
    create_graph=True), and warns once where backward runs inside an autocast region
    (_warn_backward_inside_autocast)."""
    _refuse_second_derivatives_only(grad_outputs)
    for grad in grad_outputs:
        if grad is not None:  # None: an output of the node that backward skips
            if autocast_enabled(grad.device.type):
                _warn_backward_inside_autocast()
            return


def _refuse_second_derivatives_only(grad_outputs: tuple) -> None:
    """The hook of a result whose nodes leave autocast regions in backward (backward_outside_autocast): nothing to
    warn about there."""
    if torch.is_grad_enabled():
        raise RuntimeError("angle_kernels' losses have first derivatives only: backward with create_graph=True "
                           "(second derivatives, e.g. a gradient penalty) is not supported")
    if _is_legacy_batched is not None and any(grad is not None and _is_legacy_batched(grad) for grad in grad_outputs):
        # a backward vmapped over a batch of upstream gradients (autograd's own vmap: its upstream gradients are
        # batched tensors, which the hook sees as the single gradient each batch entry is)
        raise RuntimeError("angle_kernels' losses take one upstream gradient per backward: a batched backward "
                           "(torch.autograd.grad(..., is_grads_batched=True), "
                           "torch.autograd.functional.jacobian(..., vectorize=True)) is not supported (it failed "
                           "inside the backends' backward passes, or in vmap's batching rules); take one backward "
                           "per upstream gradient (jacobian's default vectorize=False)")


_warned_backward_inside_autocast = False


def _warn_backward_inside_autocast() -> None:
    """Backward called inside a torch.autocast region (PyTorch advises against it: autocast is meant for the forward
    pass), of a loss or public op computed outside one (whose nodes backward_outside_autocast did not reach),
    runs the backends' backward passes with their products under autocast: gradients rounded to 16 bits, or,
    where a product mixes a 16-bit operand with a float32 one, a dtype-mismatch error with nothing naming autocast."""
    global _warned_backward_inside_autocast
    if not _warned_backward_inside_autocast:
        _warned_backward_inside_autocast = True
        user_warnings.warn("backward() of an angle_kernels loss or op called inside a torch.autocast region: its "
                           "backward passes then run their products under autocast (gradients rounded to 16 bits, or "
                           "a dtype-mismatch error). Call backward() after the region, as PyTorch's AMP recipe does; "
                           "the loss itself may stay inside it")


def _without_inference_tensors(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """The arguments with every inference tensor (made under torch.inference_mode: SentenceTransformer.encode's
    cached positives, a frozen teacher's or guide's embeddings), directly or in a list or tuple, replaced by a normal
    copy, for a call whose result autograd records: the backends save their inputs for backward, which autograd
    refuses for an inference tensor ("Inference tensors cannot be saved for backward"), where eager formulas of
    such a side compute. A copy only where one is given; everything else is passed on as it is."""
    # a plain loop over the arguments, a tensor asked directly: every call of a loss in training runs this scan
    for value in (*args, *kwargs.values()):
        if (value.is_inference() if isinstance(value, torch.Tensor) else
                isinstance(value, (list, tuple)) and any(map(_is_inference, value))):
            break
    else:
        return args, kwargs

    def usable(value):  # defined only where a copy is made: a function made per call costs every call
        if _is_inference(value):
            return value.clone()
        if isinstance(value, (list, tuple)) and any(map(_is_inference, value)):
            copied = [usable(v) for v in value]
            return copied if isinstance(value, list) else tuple(copied)
        return value

    return tuple(map(usable, args)), {name: usable(v) for name, v in kwargs.items()}


def _is_inference(value) -> bool:
    return isinstance(value, torch.Tensor) and value.is_inference()


def first_derivatives_only(result, *, backward_leaves_autocast: bool = False):
    """`result` (a tensor, or a tuple of them: a loss's, or a public op's) with every tensor that autograd records
    refusing a second derivative (_refuse_second_derivatives, a pre-hook on the node that made it: no node is
    added); not inside torch.compile traces, whose tracing would run it. backward_leaves_autocast: its nodes run
    their backward outside autocast regions (backward_outside_autocast), so a backward inside one is not warned
    about. A node's pre-hook rather than Tensor.register_hook, whose Python adds a torch-function check, an import
    and the tensor's own hook dictionary on the node to every call; one hook per node (a public op's outputs share
    theirs), and none on a leaf, which no op's backward computes."""
    if torch.compiler.is_compiling():
        return result
    return _refusing_second_derivatives(
        result, _refuse_second_derivatives_only if backward_leaves_autocast else _refuse_second_derivatives)


def _refusing_second_derivatives(result, hook: Callable[[tuple], None]):
    """first_derivatives_only outside a trace: `hook` on the node of every tensor of `result` autograd records."""
    if isinstance(result, torch.Tensor):  # a loss's: one tensor, without the walk a tuple takes
        if result.grad_fn is not None:
            result.grad_fn.register_prehook(hook)
        return result
    hooked = []
    for tensor in result if isinstance(result, tuple) else (result,):
        node = tensor.grad_fn if isinstance(tensor, torch.Tensor) else None
        if node is not None and node not in hooked:
            hooked.append(node)
            node.register_prehook(hook)
    return result


def recorded(result, first: torch.Tensor, inputs):
    """`result` (a tensor or a tuple of them), computed by a loss or a public op from `inputs` (its arguments:
    tensors, or lists or tuples of them) whose tensor `first` names the device, as autograd should keep it:
    refusing a second derivative (first_derivatives_only), and, computed inside an autocast region for that device
    with grad mode on, with each node it made running its backward outside the region, should backward() be called
    there (backward_outside_autocast). Outside a region this costs the check alone. Not while torch.compile traces:
    a compiled call's backward is AOTAutograd's (untraced_under_autocast)."""
    if not torch.compiler.is_compiling() and torch.is_grad_enabled() and autocast_enabled(first.device.type):
        backward_outside_autocast(result, first.device.type, inputs)
        return first_derivatives_only(result, backward_leaves_autocast=True)
    return first_derivatives_only(result)


_Args = ParamSpec("_Args")
_Result = TypeVar("_Result")


def loss_entry(loss: Callable[_Args, _Result]) -> Callable[_Args, _Result]:
    """A loss function (or forward) as the public losses, the modules' forwards and the integrations' computing
    halves run: outside_autocast of its first tensor argument (one directly, or the first of a list or tuple of
    them), so that every op and every step of the formulas between them computes as outside a region, and, called
    inside a region, its backward too, should backward() be called there (backward_outside_autocast); and its
    result, where autograd records it, refuses a second derivative with a clear error (_refuse_second_derivatives,
    a pre-hook on its node, so no node is added; not inside torch.compile traces, whose tracing would run it);
    outside the compiled graph where a backward would be traced under autocast (untraced_under_autocast)."""

    @functools.wraps(loss)
    def computed(*args: _Args.args, **kwargs: _Args.kwargs) -> _Result:
        compiling = torch.compiler.is_compiling()  # asked once: every call pays for each asking
        # untraced_under_autocast's rule, asked here rather than by a wrapper of its own around this one
        if compiling and backward_traced_under_autocast(*_arguments_flat(args, kwargs)):
            return _this_module.call_outside_the_graph(computed, *args, **kwargs)
        if not compiling and _inside_a_torch_func_transform():
            raise RuntimeError(f"{loss.__qualname__}: angle_kernels' losses do not support torch.func transforms "
                               "(grad, vmap, vjp, jacrev, ...): their backends' autograd Functions have no "
                               "setup_context. Take gradients with loss.backward() or torch.autograd.grad, and "
                               "per-example losses by calling the loss on each example")
        if not compiling and _inside_a_dual_level():  # rare
            _refuse_dual_tensors(loss, args, kwargs)
        # is_compiling first: dynamo cannot trace is_inference_mode_enabled (a graph break), and a trace holds none
        if not compiling and torch.is_grad_enabled() and not torch.is_inference_mode_enabled():
            args, kwargs = _without_inference_tensors(args, kwargs)
        first = _first_tensor(args, kwargs)
        if first is None or not autocast_enabled(first.device.type):
            # no region to leave (the common case; or no tensor argument): recorded() would only add the guard, and
            # outside_autocast's context would do nothing; asking once saves a small call both askings
            result = loss(*args, **kwargs)
            return result if compiling else _refusing_second_derivatives(result, _refuse_second_derivatives)
        with outside_autocast(first):
            result = loss(*args, **kwargs)
        return recorded(result, first=first, inputs=(*args, *kwargs.values()))

    return computed


def _first_tensor(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A call's first tensor argument (one given directly, or the first of a list or tuple of them), or None."""
    for value in (*args, *kwargs.values()):
        first = value[0] if isinstance(value, (list, tuple)) and value else value
        if isinstance(first, torch.Tensor):
            return first
    return None


def _inside_a_dual_level() -> bool:
    """Whether a torch.autograd.forward_ad.dual_level() is entered, where dual tensors can carry tangents. torch has no
    public way to ask: forward_ad keeps the level in its module global _current_level (-1 outside; the torch versions
    pyproject.toml allows, 2.4 to 2.13, have it). A torch without it answers False: a dual tensor then fails inside an
    op with torch's own error, as before the refusal, and no loss call fails for the missing name."""
    return getattr(torch.autograd.forward_ad, "_current_level", -1) >= 0


def _refuse_dual_tensors(loss: Callable, args: tuple, kwargs: dict) -> None:
    """A RuntimeError naming the loss and its argument that carries a forward-mode tangent (a dual tensor of
    torch.autograd.forward_ad), directly or in a list or tuple: the backends' autograd Functions have no jvp, and
    torch's own error there ("You must implement the jvp function for custom autograd.Function") named neither the
    loss nor what to use instead."""
    import torch.autograd.forward_ad as forward_ad

    named = inspect.signature(loss).bind_partial(*args, **kwargs).arguments
    for name, value in named.items():
        for tensor in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(tensor, torch.Tensor) and forward_ad.unpack_dual(tensor).tangent is not None:
                raise RuntimeError(
                    f"{loss.__qualname__}: {name} is a dual tensor (torch.autograd.forward_ad), and angle_kernels' "
                    "losses do not support forward-mode AD: their backends' autograd Functions have no jvp. Take "
                    "gradients in reverse mode, with loss.backward() or torch.autograd.grad")


def _inside_a_torch_func_transform() -> bool:
    """Whether a torch.func transform (grad, vmap, ...) is running: its interpreter stack is not empty. Refused at the
    loss's entry, where the transform failed deep inside (inside an op, naming setup_context; under vmap in the value
    checks, "calling .item() on a Tensor")."""
    return _peek_interpreter_stack is not None and _peek_interpreter_stack() is not None


# private; present from torch 2.1. Looked up once: every loss call asks
_peek_interpreter_stack = getattr(torch._C._functorch, "peek_interpreter_stack", None)
# private: whether a tensor is one of the batched tensors autograd's is_grads_batched backward runs on
_is_legacy_batched = getattr(torch._C._functorch, "is_legacy_batchedtensor", None)


class Backend(Protocol):
    """What dispatch assembles from a backend package (see OPS). The ops take validated inputs."""

    features: dict[str, frozenset]  # op -> the OPTIONAL_FEATURES its module declares

    def is_available(self) -> tuple[bool, str]: ...

    def pair_scores(self, x: torch.Tensor, with_angle: bool,
                    dims: tuple[int, ...] | None) -> tuple[torch.Tensor, torch.Tensor]: ...

    def ranking_loss(self, scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor: ...

    def similarity_xent(
        self,
        q: torch.Tensor,
        c: torch.Tensor | None,
        scale: float,
        target: str,
        row_weights: torch.Tensor | None,
        exclude_diagonal: bool,
        margin: float,
        group_ids: torch.Tensor | None,
        dims: tuple[int, ...] | None,
    ) -> torch.Tensor: ...

    def similarity_lse(
        self,
        q: torch.Tensor,
        c: torch.Tensor,
        scale: float,
        target_offset: int,
        period: int,
        exclude: str,
        penalty: float,
        penalty_on: str,
        filter_q: torch.Tensor | None,
        filter_c: torch.Tensor | None,
        filter_threshold: torch.Tensor | None,
        filter_keeps_target: bool,
        normalize: bool,
        dims: tuple[int, ...] | None,
        *,
        reference: torch.Tensor | None = None,  # only where the op declares the feature
    ) -> torch.Tensor: ...


# ------------------------------------------------------------------------------------------------------------
# Validation, one function per op. Each raises TypeError/ValueError naming the argument, and returns the call:
# its arguments in the normal form the backends expect, by name (one frozen dataclass per op, beside its check).
# ------------------------------------------------------------------------------------------------------------
class Call:
    """What every op's validated call offers: the op's name, the positional arguments its backend functions take,
    and the device (is_cuda), dtype and optional features that choose the backend. Each op's call is a frozen
    dataclass of its arguments by name, `class <Op>Call(Call, op="<op>")`; the semantics of the fields: the op's
    docstring in `angle_kernels.dispatch`."""

    op: ClassVar[str]
    _names: ClassVar[tuple[str, ...]]
    _values: ClassVar[Callable[[Call], tuple]]

    def __init_subclass__(cls, op: str, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.op = op
        # Made a dataclass here rather than by a decorator: angle_kernels.fingerprints counts a decorated top-level
        # definition as a registration that runs with its module, so a decorator would enter every GPU path that
        # reaches this module (compute_dtype, NORM_EPS) into its fingerprint and void its verifications.
        # eq=False: equality (and hash) by identity; field-wise equality would compare tensors element by element.
        dataclasses.dataclass(frozen=True, eq=False)(cls)
        # read on every op call: the fields' names, found once per class (a plain tuple: torch.compile traces it),
        # and a getter of their values in that order (C's loop, not a generator's: ~0.5 us of every op call)
        cls._names = tuple(field.name for field in dataclasses.fields(cls))
        getter = operator.attrgetter(*cls._names)  # one name gives a value, not a tuple of one
        cls._values = getter if len(cls._names) > 1 else staticmethod(lambda call: (getter(call),))

    @property
    def args(self) -> tuple:
        """The arguments in the backends' positional order (`Backend`): the fields' order. Not dataclasses.astuple,
        which deep-copies the tensors."""
        if torch.compiler.is_compiling():  # dynamo cannot call an attrgetter made outside its trace (fullgraph)
            return tuple(getattr(self, name) for name in self._names)
        return self._values(self)

    @property
    def _leading(self) -> torch.Tensor:
        """The first argument, the tensor whose device and dtype the call's are (x, scores or q)."""
        return getattr(self, self._names[0])

    @property
    def device(self) -> torch.device:
        return self._leading.device

    @property
    def dtype(self) -> torch.dtype:
        return self._leading.dtype

    @property
    def is_cuda(self) -> bool:
        return self._leading.is_cuda

    @property
    def features(self) -> tuple[str, ...]:
        """The optional features (OPTIONAL_FEATURES) the call uses, which steer the choice of backend: dims when
        given. reference is no field of a call: it never steers the choice (dispatch.Ops.similarity_lse)."""
        return ("dims",) if getattr(self, "dims", None) is not None else ()


def _tensor(name: str, t, dims: int | None, dtypes: tuple[torch.dtype, ...] | None = None) -> torch.Size:
    """t is a tensor of `dims` dimensions (any number for None) and one of `dtypes` (any for None); returns its shape,
    for the caller's checks: every read of a tensor's metadata is a torch call, which each op call pays for."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtypes is not None and t.dtype not in dtypes:
        allowed = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must be one of {allowed}, got {t.dtype}")
    shape = t.shape
    if dims is not None and len(shape) != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(shape)}")
    return shape


def _on_device_of(name: str, t: torch.Tensor, ref_name: str, device: torch.device) -> None:
    """t is on `device`, the device of the argument `ref_name` (read once by the caller for all its checks)."""
    if t.device != device:
        raise ValueError(f"{name} must be on {ref_name}'s device {device}, got {t.device}")


def _real_number(name: str, value) -> float:
    # a float or an int (bool is neither type) skips the abstract-class check, ~1 us of a small call each
    if type(value) not in (float, int) and (isinstance(value, bool) or not isinstance(value, numbers.Real)):
        raise TypeError(f"{name} must be a real Python number, got {type(value).__name__}")
    value = float(value)
    if not -math.inf < value < math.inf:  # not math.isfinite: dynamo cannot trace it on a float it made symbolic
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def check_dims(dims, width: int, even: bool = False, name: str = "dims") -> tuple[int, ...] | None:
    """None, or a non-empty strictly increasing tuple of prefix widths 1 <= d_1 < ... < d_k <= width (even ones
    when `even`: the angle score splits each prefix in halves)."""
    if dims is None:
        return None
    if not isinstance(dims, (tuple, list)) or not dims:
        raise TypeError(f"{name} must be None or a non-empty tuple of ints, got {dims!r}")
    widths = tuple(_integer(f"{name}[{i}]", d, 1) for i, d in enumerate(dims))
    if any(b <= a for a, b in zip(widths, widths[1:])):
        raise ValueError(f"{name} must be strictly increasing, got {widths}")
    if widths[-1] > width:
        raise ValueError(f"{name} must not exceed the embedding width {width}, got {widths}")
    if even and any(d % 2 for d in widths):
        raise ValueError(f"{name}: the angle score splits each prefix in halves and needs even widths, got {widths}")
    return widths


class PairScoresCall(Call, op="pair_scores"):
    """A validated call of pair_scores (`check_pair_scores`)."""

    x: torch.Tensor
    with_angle: bool
    dims: tuple[int, ...] | None


def check_pair_scores(x, with_angle, dims=None) -> PairScoresCall:
    """x: [G, K, D] floating, K >= 2, D >= 1 (even when with_angle); G may be 0; dims: see check_dims."""
    shape = _tensor("x", x, 3, EMBEDDING_DTYPES)
    if shape[1] < 2 or shape[2] < 1:
        raise ValueError(f"x must be [G, K, D] with K >= 2 and D >= 1, got shape {tuple(shape)}")
    if not isinstance(with_angle, bool):
        raise TypeError(f"with_angle must be a bool, got {type(with_angle).__name__}")
    if with_angle and shape[2] % 2:
        raise ValueError(f"x: the angle score splits each vector in halves and needs an even D, got D={shape[2]}")
    return PairScoresCall(x, with_angle, check_dims(dims, shape[2], even=with_angle))


class RankingLossCall(Call, op="ranking_loss"):
    """A validated call of ranking_loss (`check_ranking_loss`)."""

    scores: torch.Tensor
    labels: torch.Tensor


def check_ranking_loss(scores, labels) -> RankingLossCall:
    """scores: [N] float32/float64; labels: [N] real, on scores' device. Bool labels come back as int64."""
    shape = _tensor("scores", scores, 1, SCORE_DTYPES)
    labels_shape = _tensor("labels", labels, 1)
    if labels.is_complex():
        raise TypeError(f"labels must be real numbers, got {labels.dtype}")
    if labels_shape != shape:
        raise ValueError(f"labels must have the shape of scores {tuple(shape)}, got {tuple(labels_shape)}")
    _on_device_of("labels", labels, "scores", scores.device)
    if labels.dtype == torch.bool:
        labels = labels.to(torch.int64)
    return RankingLossCall(scores, labels)


class SimilarityXentCall(Call, op="similarity_xent"):
    """A validated call of similarity_xent (`check_similarity_xent`)."""

    q: torch.Tensor
    c: torch.Tensor | None
    scale: float
    target: str
    row_weights: torch.Tensor | None
    exclude_diagonal: bool
    margin: float
    group_ids: torch.Tensor | None
    dims: tuple[int, ...] | None


def check_similarity_xent(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids,
                          dims=None) -> SimilarityXentCall:
    """The arguments of similarity_xent, checked against the contract and returned in normal form."""
    m, d = _tensor("q", q, 2, EMBEDDING_DTYPES)
    if m == 0 or d == 0:
        raise ValueError(f"q must be a non-empty [M, D] tensor, got shape {(m, d)}")
    mc, device = m, q.device
    if c is not None:
        mc, dc = _tensor("c", c, 2, EMBEDDING_DTYPES)
        if mc == 0 or dc != d:
            raise ValueError(f"c must be a non-empty [Mc, D={d}] tensor like q, got shape {(mc, dc)}")
        if c.dtype != q.dtype:
            raise TypeError(f"c must have q's dtype {q.dtype}, got {c.dtype}")
        _on_device_of("c", c, "q", device)
    scale = _real_number("scale", scale)
    margin = _real_number("margin", margin)
    if not 0.0 <= margin <= math.pi:
        raise ValueError(f"margin must be between 0 and pi radians, got {margin}")
    if target not in TARGETS:
        raise ValueError(f"target must be 'partner' or 'diagonal', got {target!r}")
    if not isinstance(exclude_diagonal, bool):
        raise TypeError(f"exclude_diagonal must be a bool, got {type(exclude_diagonal).__name__}")
    if target == "partner" and (m % 2 or mc < m):
        raise ValueError(f"target='partner' needs an even M <= Mc, got M={m}, Mc={mc}")
    if target == "diagonal":
        if mc < m:
            raise ValueError(f"target='diagonal' needs M <= Mc, got M={m}, Mc={mc}")
        if exclude_diagonal:
            raise ValueError("target='diagonal' with exclude_diagonal=True would exclude every target column")
    if row_weights is not None:
        weights_shape = _tensor("row_weights", row_weights, 1)
        if not row_weights.is_floating_point():
            raise TypeError(f"row_weights must be floating point, got {row_weights.dtype}")
        if row_weights.requires_grad:  # the backward gives dq and dc only: a learned weight would never change
            raise TypeError("row_weights must not require grad: similarity_xent takes the row weights as constants "
                            "and gives them no gradient; pass row_weights.detach()")
        if weights_shape[0] != m:
            raise ValueError(f"row_weights must be [M={m}], got shape {tuple(weights_shape)}")
        _on_device_of("row_weights", row_weights, "q", device)
    if group_ids is not None:
        if c is not None:
            raise ValueError("group_ids is supported only in the symmetric case (c=None)")
        ids_shape = _tensor("group_ids", group_ids, 1)
        if group_ids.is_floating_point() or group_ids.is_complex() or group_ids.dtype == torch.bool:
            raise TypeError(f"group_ids must be an integer tensor, got {group_ids.dtype}")
        if ids_shape[0] != m:
            raise ValueError(f"group_ids must be [M={m}], got shape {tuple(ids_shape)}")
        _on_device_of("group_ids", group_ids, "q", device)
        group_ids = group_ids.to(torch.int64)
    return SimilarityXentCall(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids,
                              check_dims(dims, d))


def _integer(name: str, value, minimum: int) -> int:
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise TypeError(f"{name} must be a Python int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return int(value)


class SimilarityLseCall(Call, op="similarity_lse"):
    """A validated call of similarity_lse (`check_similarity_lse`), without its keyword-only reference
    (`check_lse_reference`)."""

    q: torch.Tensor
    c: torch.Tensor
    scale: float
    target_offset: int
    period: int
    exclude: str
    penalty: float
    penalty_on: str
    filter_q: torch.Tensor | None
    filter_c: torch.Tensor | None
    filter_threshold: torch.Tensor | None
    filter_keeps_target: bool
    normalize: bool
    dims: tuple[int, ...] | None


def check_similarity_lse(q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c,
                         filter_threshold, filter_keeps_target, normalize=True, dims=None) -> SimilarityLseCall:
    """The arguments of similarity_lse, checked against the contract and returned in normal form (the filter
    inputs detached, its threshold contiguous in filter_q's compute dtype, in which the filter compares). With
    dims the filter embeddings are cut to each prefix like q and c (at least d_k wide) and the threshold is
    [k, M], one row per prefix."""
    (m, d), (mc, dc) = _tensor("q", q, 2, EMBEDDING_DTYPES), _tensor("c", c, 2, EMBEDDING_DTYPES)
    if m == 0 or d == 0 or mc == 0 or dc != d:
        raise ValueError(f"q and c must be non-empty [M, D] and [Mc, D], got shapes {(m, d)} and {(mc, dc)}")
    if c.dtype != q.dtype:
        raise TypeError(f"c must have q's dtype {q.dtype}, got {c.dtype}")
    device = q.device
    _on_device_of("c", c, "q", device)
    scale = _real_number("scale", scale)
    target_offset = _integer("target_offset", target_offset, 0)
    period = _integer("period", period, 0)
    if exclude not in LSE_EXCLUDES:
        raise ValueError(f"exclude must be one of {LSE_EXCLUDES}, got {exclude!r}")
    penalty = _real_number("penalty", penalty)
    if penalty_on not in LSE_PENALTIES:
        raise ValueError(f"penalty_on must be one of {LSE_PENALTIES}, got {penalty_on!r}")
    for name, flag in (("filter_keeps_target", filter_keeps_target), ("normalize", normalize)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    given = [t is not None for t in (filter_q, filter_c, filter_threshold)]
    if any(given) and not all(given):
        raise ValueError("filter_q, filter_c and filter_threshold go together: give all three or none")
    dims = check_dims(dims, d)
    if all(given):
        filter_q_shape = _tensor("filter_q", filter_q, 2, EMBEDDING_DTYPES)
        filter_c_shape = _tensor("filter_c", filter_c, 2, EMBEDDING_DTYPES)
        if filter_q_shape[0] != m or filter_c_shape[0] != mc or filter_q_shape[1] != filter_c_shape[1]:
            raise ValueError(f"filter_q and filter_c must be [M={m}, D'] and [Mc={mc}, D'], got "
                             f"shapes {tuple(filter_q_shape)} and {tuple(filter_c_shape)}")
        if dims is not None and filter_q_shape[1] < dims[-1]:
            raise ValueError(f"with dims, filter_q and filter_c are cut to each prefix like q and c: they must be at "
                             f"least {dims[-1]} wide, got width {filter_q_shape[1]}")
        rows = (m,) if dims is None else (len(dims), m)
        threshold_shape = _tensor("filter_threshold", filter_threshold, None)
        if not filter_threshold.is_floating_point() or tuple(threshold_shape) != rows:
            shape = f"[M={m}]" if dims is None else f"[k={len(dims)}, M={m}] (one row per prefix)"
            raise ValueError(f"filter_threshold must be a float {shape} tensor, got {filter_threshold.dtype} of shape "
                             f"{tuple(threshold_shape)}")
        for name, t in (("filter_q", filter_q), ("filter_c", filter_c), ("filter_threshold", filter_threshold)):
            _on_device_of(name, t, "q", device)
        filter_threshold = filter_threshold.detach().to(compute_dtype(filter_q.dtype)).contiguous()
        filter_q, filter_c = filter_q.detach(), filter_c.detach()
    return SimilarityLseCall(q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c,
                             filter_threshold, filter_keeps_target, normalize, dims)


def check_lse_reference(q, normalize: bool, reference) -> torch.Tensor | None:
    """similarity_lse's optional reference rows: None, or [M, D] in q's dtype and on its device (raw dot products
    only)."""
    if reference is None:
        return None
    _tensor("reference", reference, 2, EMBEDDING_DTYPES)
    if reference.shape != q.shape:
        raise ValueError(f"reference must have q's shape {tuple(q.shape)}, got {tuple(reference.shape)}")
    if reference.dtype != q.dtype:
        raise TypeError(f"reference must have q's dtype {q.dtype}, got {reference.dtype}")
    _on_device_of("reference", reference, "q", q.device)
    if normalize:
        raise ValueError("reference is for raw dot products (normalize=False)")
    return reference
