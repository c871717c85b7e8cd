"""The losses' arguments as users pass them, checked: every bad one raises a ValueError or TypeError that names it.
(The ops' own contract, what a backend receives, is `angle_kernels.contract`.)

Tensors. Shape, dtype and device checks cost nothing and always run. The checks that read tensor values
(NaN/Inf in embeddings and labels, label values for the in-batch-negative loss) force a device-to-host sync on
GPUs; they are on by default and can be switched off for training loops that trust their inputs:

    angle_kernels.set_input_checks(False)            # for the whole process
    with angle_kernels.input_checks(False): ...      # for a block, in this thread (as torch.no_grad)
    ANGLE_KERNELS_CHECK_INPUTS=0                     # from the environment, read at import

Under torch.compile the value checks are skipped (they would need a host sync and break the graph); run a
step eagerly, or keep the eager path for validation, when inputs are untrusted. They also skip meta tensors
(shape-only: the losses then return meta outputs of the right shape, as torch ops do). Two rules every loss
shares are stated here once: `check_scale` (a logit scale or temperature is finite and > 0) and
`promote_embeddings` (embeddings of different float dtypes are promoted to a common dtype).

Options, what every front end (the functional losses, AngleLoss and ArcCSELoss, the integrations, angle_train)
parses before it calls a loss family's formulas (`angle_kernels.losses`):
* The option tables: POOLING_STRATEGIES, DIRECTIONS, PARTITION_MODES, HARDNESS_MODES (sentence-transformers'
  hardness modes -> the columns similarity_lse penalises), MARGIN_STRATEGIES, SIMILARITIES, IBN_PARTITIONS
  (AngleLoss's in-batch-negative partitions -> multiple_negatives' directions).
* The type aliases of the Matryoshka and layer-wise keywords (Dims, DimWeights, LayerWeights), named for the
  annotations of the public signatures.
* The checks of a loss's inputs (check_zigzag, check_angle_dim, check_group_ids, check_two_views,
  check_triplets) and of its options (check_arccon_options, check_in_batch_options,
  check_false_negative_filter). `check_multiple_negatives` is the whole of multiple_negatives_ranking_loss's (its
  inputs, options and Matryoshka keywords, and the gathering of its columns across devices), which the public
  loss and the sentence-transformers MNRL family share.
* Matryoshka and layer-wise (Espresso) training: `check_nested` parses dims / dim_weights / layer_weights into
  a `Nested` (the prefixes ascending, a table of weights per layer and prefix), the one form the formulas take;
  `check_layer_stack` checks stacked embeddings [L, rows, D]; `espresso_layer_weights` gives Espresso's dims and
  per-layer weights.

Each check exists once; a front end that has parsed an option passes the parsed value (e.g. a Nested) down
rather than parsing it again. This module imports only contract and distributed: nothing here computes a loss.
"""

from __future__ import annotations

import contextlib
import math
import numbers
import operator
import os
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple, Union

import torch

from . import user_warnings
from .contract import check_dims, compute_dtype
from .distributed import all_gather_many_with_grad, gathering_rank_and_world_size, refused_together

# ---------------------------------------------------------------------------------------------------------
# Tensors
# ---------------------------------------------------------------------------------------------------------

CHECK_INPUTS_ENV = "ANGLE_KERNELS_CHECK_INPUTS"
_SWITCH_WORDS = {"1": True, "true": True, "yes": True, "on": True,
                 "0": False, "false": False, "no": False, "off": False}


def _value_checks_setting() -> bool:
    """ANGLE_KERNELS_CHECK_INPUTS, read at import: unset or empty, on; 1/true/yes/on or 0/false/no/off (any case,
    spaces around it allowed); anything else a ValueError naming it (a typo must not decide whether inputs are
    checked)."""
    value = os.environ.get(CHECK_INPUTS_ENV, "").strip().lower()
    if value == "":
        return True
    if value not in _SWITCH_WORDS:
        raise ValueError(f"{CHECK_INPUTS_ENV} must be 1, true, yes or on (the default: NaN/Inf and label values "
                         f"checked) or 0, false, no or off (no value checks); got {os.environ[CHECK_INPUTS_ENV]!r}")
    return _SWITCH_WORDS[value]


_value_checks = _value_checks_setting()  # the process's setting (set_input_checks)
# input_checks blocks' setting, per thread (as torch.no_grad's): one process-wide value saved and restored by blocks
# in two threads was left off when the blocks overlapped, and a block turned the checks off in every thread
_block_setting = threading.local()


def set_input_checks(enabled: bool) -> bool:
    """Turn the value checks (NaN/Inf, label values) on or off for the whole process (outside input_checks blocks,
    which decide in their thread); returns the previous setting."""
    global _value_checks
    enabled = check_flag("enabled", enabled)
    previous, _value_checks = _value_checks, enabled
    return previous


def input_checks_enabled() -> bool:
    """Whether the value checks run now, in this thread: not inside a torch.compile trace, and switched on (by the
    innermost input_checks block of this thread, else by set_input_checks or ANGLE_KERNELS_CHECK_INPUTS)."""
    if torch.compiler.is_compiling():  # first: a trace reads no thread-local state
        return False
    block = getattr(_block_setting, "enabled", None)
    return _value_checks if block is None else block


@contextlib.contextmanager
def input_checks(enabled: bool):
    """Context manager: value checks on or off inside the block, in this thread only (as torch.no_grad), restored
    afterwards."""
    enabled = check_flag("enabled", enabled)
    previous = getattr(_block_setting, "enabled", None)
    _block_setting.enabled = enabled
    try:
        yield
    finally:
        _block_setting.enabled = previous


def _all_finite(*tensors: torch.Tensor) -> bool:
    """Whether every value of the tensors (one device) is finite, with one device-to-host sync for all of them. The
    tensors are read detached: the scan records nothing for autograd."""
    # One fused reduction per tensor and one sync: NaN or Inf anywhere makes a sum non-finite. A non-finite sum can
    # also come from finite values overflowing, so only then look element by element, a chunk at a time.
    # The totals are added into one (a NaN or Inf total makes it non-finite; an overflow of the addition only sends
    # the call to the element-wise look): one number read back, with the fewest ops a small call pays for. Plain
    # loops, not generators: every small call pays for the Python between its ops.
    scanned, total = [], None
    for t in tensors:
        if t.is_meta:  # no data to scan (shapes only)
            continue
        t = t.detach()
        scanned.append(t)
        part = t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)
        total = part if total is None else total + part
    if total is None or math.isfinite(total.item()):
        return True
    return all(bool(torch.isfinite(chunk).all()) for t in scanned for chunk in t.reshape(-1).split(1 << 24))


_PLAIN_NUMBERS = (float, int)


def check_scalar(name: str, value, *, positive: bool = False) -> float:
    """A real number given as a Python or numpy number, a one-element tensor that does not require grad, or a 0-d
    numpy array, returned as a float; bools (a flag passed by mistake) and learned values raise TypeError naming the
    argument, non-finite values (and, with positive, values <= 0) ValueError."""
    # Python's floats and ints (bool is neither type), the values every call passes, skip the conversions and the
    # abstract-class check: each numbers.Real isinstance cost a small loss call ~1 us
    if type(value) not in _PLAIN_NUMBERS:
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.requires_grad:
            value = value.item()
        if isinstance(value, torch.Tensor) and value.numel() == 1:  # requires grad: a learned value
            raise TypeError(f"{name} must be a real number, got a {type(value).__name__} that requires grad: the "
                            f"losses take {name} as a constant and give it no gradient (a learned {name} would never "
                            f"change); pass float({name}) to use its value")
        if type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():  # a 0-d array: its number
            value = value[()]
        if _is_bool(value) or not isinstance(value, numbers.Real):
            raise TypeError(f"{name} must be a real number, got {type_name(value)}")
    value = float(value)
    if not -math.inf < value < math.inf:  # not math.isfinite: dynamo cannot trace it on a float it made symbolic
        raise ValueError(f"{name} must be finite, got {value}")
    if positive and value <= 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    return value


def type_name(value) -> str:
    """The name of value's type as an error message gives it: builtins bare ("int"), others with their module
    ("numpy.int64", "numpy.bool"), so that a numpy bool is not reported as a "bool"."""
    kind = type(value)
    return kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"


def _is_bool(value) -> bool:
    """Whether value is a Python bool or numpy's (numpy.bool, numpy.bool_ before numpy 2), without importing numpy."""
    return isinstance(value, bool) or (type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"))


def check_flag(name: str, value) -> bool:
    """An on/off option: a bool, or numpy's bool (a config read with numpy), returned as a Python bool; anything
    else (0 and 1 included: a count or an index passed by mistake) raises TypeError naming the argument."""
    if _is_bool(value):
        return bool(value)
    raise TypeError(f"{name} must be a bool, got {type_name(value)}")


# The largest factor a logit may carry (scale, or 1 / temperature): 16- and 32-bit embeddings' logits are float32,
# and a loss takes differences of them (up to 2 x the factor) and sums of those: past about a quarter of float32's
# largest number (3.4e38) they overflowed into inf - inf, a silent NaN.
LARGEST_LOGIT_FACTOR = 8.5e37


def check_scale(name: str, value, *, divides: bool = False) -> float:
    """The one rule for every loss's logit scale or temperature (tau, scale, temperature, cosine_tau, ibn_tau,
    angle_tau): a finite real number > 0, returned as a float, whose factor on the logits (the value, or 1 / value
    where it `divides` them: a temperature) is at most LARGEST_LOGIT_FACTOR; anything else raises ValueError
    (TypeError for a non-number) naming the argument. angle-emb 0.6.1 accepts tau <= 0 (README: deviations)."""
    value = check_scalar(name, value, positive=True)
    if (1.0 / value if divides else value) > LARGEST_LOGIT_FACTOR:
        bound = (f">= {1.0 / LARGEST_LOGIT_FACTOR:.3g}: the logits are divided by it" if divides else
                 f"<= {LARGEST_LOGIT_FACTOR:.3g}: the logits are multiplied by it")
        raise ValueError(f"{name} must be {bound}, and past that they overflow float32; got {value:g}")
    return value


# The largest weight a loss term may carry: its compute dtype's largest number (contract.compute_dtype: float32 for
# 16- and 32-bit embeddings)
LARGEST_WEIGHT = {dtype: float(torch.finfo(dtype).max) for dtype in (torch.float32, torch.float64)}


def check_weight_fits(name: str, value: float, dtype: torch.dtype) -> None:
    """A weight of a loss term (a float: check_scalar's, or a product of those) on embeddings of `dtype`: it
    multiplies a term computed in the compute dtype, where a weight past that dtype's range is inf (before: an inf
    loss and NaN gradients); ValueError naming the argument and the range, before any compute."""
    computed_in = compute_dtype(dtype)
    if not abs(value) <= LARGEST_WEIGHT[computed_in]:
        precision = str(computed_in).removeprefix("torch.")
        raise ValueError(f"{name} must be within +-{LARGEST_WEIGHT[computed_in]:.6g} ({precision}'s range: the loss "
                         f"of {str(dtype).removeprefix('torch.')} embeddings is computed in {precision}, where a "
                         f"larger weight is inf); got {value:g}")


def check_scaled_weights_fit(embeddings: torch.Tensor, scale: tuple[str, float], *, nested: Nested | None = None,
                             weight: tuple[str, float] | None = None) -> None:
    """A term's weights times the factor its logits are multiplied by, on `embeddings`: scale is (name,
    factor) (tau, scale, 1 / temperature), weight a loss's (name, term weight), and nested's Matryoshka / layer
    weights count by the largest. The term's backward multiplies its upstream gradient (the weights) by the
    factor in the compute dtype, where check_weight_fits holds each weight alone: past the dtype's range the
    product is inf and the gradients NaN (inf x 0, inf - inf) while the loss stays finite (cosine_w 3e37 with tau
    20 on float32 embeddings). ValueError naming the factors and the range, before any compute."""
    names, product = [], abs(scale[1])
    if weight is not None:
        names.append(weight[0])
        product *= abs(weight[1])
    if nested is not None:
        largest = max(abs(w) for row in nested.table for w in row)
        if largest != 1:
            names.append("the largest dims or layer weight")
            product *= largest
    if product <= LARGEST_WEIGHT[torch.float32]:  # within every compute dtype's range: the dtype is not read
        return
    dtype = embeddings.dtype
    computed_in = compute_dtype(dtype)
    if not product <= LARGEST_WEIGHT[computed_in]:
        precision = str(computed_in).removeprefix("torch.")
        raise ValueError(f"{' x '.join(names + [scale[0]])} must be within {LARGEST_WEIGHT[computed_in]:.6g} "
                         f"({precision}'s range: the backward of the loss of {str(dtype).removeprefix('torch.')} "
                         f"embeddings multiplies the term's weight by its logits' factor in {precision}, where a "
                         f"larger product is inf and the gradients NaN); got {product:g}")


def check_margin_fits(name: str, value: float, *, rows: int, dtype: torch.dtype) -> None:
    """A hinge margin (a checked float) added to a cosine difference (within +-2) on each of `rows` rows of `dtype`
    embeddings, whose mean sums the rows' terms in the compute dtype: a positive margin is at most half of that
    dtype's largest number over the rows (the sum of the terms, each up to margin + 2, then stays below half of the
    largest number, with room for the additions' rounding; past it the sum was inf: an inf loss). A negative margin
    only turns terms off (max(0, .)), so any is taken. ValueError naming the argument, before any compute."""
    computed_in = compute_dtype(dtype)
    bound = LARGEST_WEIGHT[computed_in] / (2 * max(rows, 1)) - 2.0
    if value > bound:
        precision = str(computed_in).removeprefix("torch.")
        raise ValueError(f"{name} must be <= {bound:.6g} for {rows} rows of {str(dtype).removeprefix('torch.')} "
                         f"embeddings: each row's hinge term is up to {name} + 2, and their mean sums them in "
                         f"{precision}, where a larger sum is inf; got {value:g}")


def check_choice(name: str, value, choices: tuple) -> None:
    if value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}; got {value!r}")


EMBEDDING_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def check_embeddings(
    name: str, t, *, rows_multiple_of: int = 1, layout: str = "", check_values: bool = True
) -> torch.Tensor:
    """A [rows, D] floating tensor with rows > 0, D > 0, rows divisible by rows_multiple_of, finite values
    (the last only with check_values and while value checks are on)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in EMBEDDING_DTYPES:  # float8 too: it is floating, and failed inside with an op's argument name
        raise TypeError(f"{name} must be a floating-point tensor (float32, float64, bfloat16, float16), got {t.dtype}")
    check_dense(name, t)
    shape = t.shape  # read once: each read of a tensor's metadata is a torch call
    if len(shape) != 2:
        raise ValueError(f"{name} must be 2-D [rows, dim], got shape {tuple(shape)}")
    rows, dim = shape
    if rows == 0 or dim == 0:
        raise ValueError(f"{name} is empty (shape {tuple(shape)}): a loss needs at least one row and one column")
    if rows % rows_multiple_of:
        raise ValueError(
            f"{name} must have a multiple of {rows_multiple_of} rows ({layout}), got {rows} rows"
        )
    if check_values:
        check_finite(name, t)
    return t


def check_dense(name: str, t: torch.Tensor) -> None:
    """t laid out densely (strided), as every op reads its tensors: a sparse one failed inside, in a torch op that
    named neither the argument nor the layout ("reshape is not implemented for sparse tensors")."""
    layout = t.layout
    if layout != torch.strided:
        raise TypeError(f"{name} must be a dense (strided) tensor, got a {str(layout).removeprefix('torch.')} one: "
                        f"pass {name}.to_dense()")


def check_finite(name: str, t: torch.Tensor) -> None:
    if input_checks_enabled() and not _all_finite(t):
        raise ValueError(f"{name} contains NaN or Inf values")


def check_embedding_group(*named: tuple[str, torch.Tensor]) -> None:
    """Embedding tensors used together: each is [rows, D] and floating, all have the same D and live on one
    device, and only then (the one check that syncs) are their values checked."""
    for name, t in named:
        check_embeddings(name, t, check_values=False)
    first_name, first = named[0]
    for name, t in named[1:]:
        check_same_columns(first_name, first, name, t)
    check_same_device(*named)
    if input_checks_enabled() and not _all_finite(*[t for _, t in named]):  # one sync for the group
        for name, t in named:
            check_finite(name, t)  # names the first tensor at fault


def check_columns(name: str, columns):
    """A loss's hard-negative columns: a tuple or list of [B, D] tensors, one per column. A tensor itself is refused
    with what to pass: iterated, its rows would be read as columns, each of the wrong shape."""
    if isinstance(columns, torch.Tensor):
        raise TypeError(f"{name} must be a tuple or list of [B, D] tensors, one per hard-negative column; got a tensor "
                        f"of shape {tuple(columns.shape)}: pass ({name},) for one column")
    if not isinstance(columns, (tuple, list)):
        raise TypeError(f"{name} must be a tuple or list of [B, D] tensors, one per hard-negative column (() for "
                        f"none); got {type(columns).__name__}")
    return columns


def promote_embeddings(*tensors):
    """Embedding tensors used together in one loss, returned in one dtype: PROMOTED, never refused, by torch's type
    promotion (torch.promote_types: float32 with float64 computes in float64, bfloat16 with float32 in float32), so
    no input is silently narrowed to another's dtype. A tensor is cast (differentiably: its gradient comes back in
    its own dtype) only when its dtype differs; anything that is not a floating tensor is returned unchanged for
    the structure checks to name."""
    # one pass for the common case, a single dtype: each tensor's dtype read once (every read is a torch call), and
    # dtype.is_floating_point rather than a tensor's is_floating_point() (no torch call)
    if len({dtype for t in tensors if isinstance(t, torch.Tensor) for dtype in (t.dtype,)
            if dtype.is_floating_point}) <= 1:
        return list(tensors)
    floating = [t for t in tensors if isinstance(t, torch.Tensor) and t.is_floating_point()]
    common = floating[0].dtype
    for t in floating[1:]:
        common = torch.promote_types(common, t.dtype)
    return [t.to(common) if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != common else t
            for t in tensors]


# labels ranked as int64, exactly: bools, and the unsigned integers wider than 8 bits, which torch's searchsorted (the
# ranking's) does not take
_LABELS_AS_INT64 = (torch.bool, torch.uint16, torch.uint32)
_FLOAT8 = tuple(getattr(torch, name) for name in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz",
                                                  "float8_e8m0fnu") if hasattr(torch, name))


def check_labels(name: str, y, rows: int, device: torch.device, *, check_values: bool = True,
                 embeddings: str = "the embeddings") -> torch.Tensor:
    """y of shape [rows] or [rows, 1], real values on `device` (finite: with check_values, while value checks are
    on); returned flattened to [rows], bool, uint16 and uint32 labels as int64 and float8 ones as float32 (exact:
    the ranking sorts neither), uint64 refused. embeddings: the name of the argument whose rows and device y must
    match."""
    if not isinstance(y, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(y).__name__}")
    if y.is_complex():
        raise TypeError(f"{name} must hold real labels, got {y.dtype}")
    check_dense(name, y)
    if tuple(y.shape) not in ((rows,), (rows, 1)):
        raise ValueError(f"{name} must have shape [{rows}] or [{rows}, 1] to match the rows of {embeddings}, "
                         f"got {tuple(y.shape)}")
    check_same_device((name, y), (embeddings, device))
    y = y.reshape(rows)
    dtype = y.dtype  # read once: a small loss call's torch calls are counted (tests/test_loss_entry.py)
    if dtype in _LABELS_AS_INT64:
        y = y.to(torch.int64)
    elif dtype in _FLOAT8:  # torch sorts no 8-bit float
        y = y.to(torch.float32)
    elif dtype == torch.uint64:
        raise TypeError(f"{name} must be a float, bool or integer tensor other than uint64 (torch ranks no uint64 "
                        f"and int64 cannot hold all its values); pass {name}.long() or {name}.double()")
    if check_values and input_checks_enabled() and y.is_floating_point() and not _all_finite(y):
        raise ValueError(f"{name} contains NaN or Inf values")
    return y


def check_binary_labels(name: str, y: torch.Tensor, loss: str) -> None:
    """The in-batch-negative loss reads labels as 'pair is positive' (1) or 'negatives only' (0)."""
    if input_checks_enabled() and y.device.type != "meta" and not bool(((y == 0) | (y == 1)).all()):
        bad = y[(y != 0) & (y != 1)][:5].tolist()
        raise ValueError(
            f"{name} for {loss} must be 0 or 1 (1: the pair is a positive pair; 0: its rows serve only as "
            f"negatives); got values such as {bad}. Graded similarity labels belong to cosine_loss/angle_loss "
            "(with AngleLoss, set ibn_w=0). The reference silently truncates such labels to wrong targets."
        )


def check_same_device(*named) -> None:
    """named: (name, tensor or device) pairs that must all live on one device."""
    first_name, first = named[0]
    first = first.device if isinstance(first, torch.Tensor) else torch.device(first)
    for n, t in named[1:]:
        d = t.device if isinstance(t, torch.Tensor) else torch.device(t)
        if d != first:
            raise ValueError(f"{first_name} is on {first} but {n} is on {d}: all inputs must be on one device")


def check_same_columns(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    """b has a's width (its last dimension): embeddings of one encoder, compared or truncated alike."""
    if b.shape[-1] != a.shape[-1]:
        raise ValueError(f"{b_name} must have {a.shape[-1]} columns like {a_name}, got shape {tuple(b.shape)}")


def check_same_shape(a_name: str, a: torch.Tensor, b_name: str, b: torch.Tensor) -> None:
    if a.shape != b.shape:
        raise ValueError(f"{b_name} must have the shape of {a_name} {tuple(a.shape)}, got {tuple(b.shape)}")

# ---------------------------------------------------------------------------------------------------------
# Options
# ---------------------------------------------------------------------------------------------------------

# The option tables
POOLING_STRATEGIES = ("sum", "mean")
DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
PARTITION_MODES = ("joint", "per_direction")
# sentence-transformers' hardness modes -> the columns of the query-to-document block similarity_lse penalises
HARDNESS_MODES = {"in_batch_negatives": "other", "hard_negatives": "own", "all_negatives": "all"}
MARGIN_STRATEGIES = ("absolute", "relative")
# the similarity of the in-batch family's logits: "cosine" (util.cos_sim) or the raw dot product (util.dot_score)
SIMILARITIES = ("cosine", "dot")
# AngleLoss's in-batch-negative partitions -> the directions of multiple_negatives in one softmax per query:
# AnglE's query -> documents, or GTE's improved contrastive loss
IBN_PARTITIONS = {"angle": ("query_to_doc",), "gte": DIRECTIONS}
_DIRECTION_SET = frozenset(DIRECTIONS)  # made once: every MNRL call checks its directions against it
_DIRECTIONS_OF_QUERY_COLUMNS = frozenset({"query_to_query", "doc_to_query"})

# The types of the Matryoshka and layer-wise keywords of every loss (see angle_kernels.functional), named for
# the annotations: dims, the prefix widths, a tuple or list of ints (another sequence, e.g. a range, raises
# TypeError); dim_weights, one real number per dim; layer_weights, one real number per layer of the stack or, with
# dims, one row of weights per layer (one per dim), or a tensor holding either.
Dims = Union[tuple[int, ...], list[int]]
DimWeights = Sequence[float]
LayerWeights = Union[Sequence[float], Sequence[Sequence[float]], torch.Tensor]


def check_zigzag(
    y_true: torch.Tensor, y_pred: torch.Tensor, names: tuple[str, str] = ("y_true", "y_pred")
) -> torch.Tensor:
    """Check a zigzag batch (structure and device first, values last) and return its labels, one per row [2N].

    names: what the caller calls (y_true, y_pred), for the error messages (AngleLoss: labels, outputs)."""
    check_embeddings(
        names[1], y_pred, rows_multiple_of=2, layout="zigzag pairs on rows 2k and 2k+1", check_values=False
    )
    labels = check_labels(names[0], y_true, y_pred.shape[0], y_pred.device, check_values=False, embeddings=names[1])
    values = (labels, y_pred) if labels.is_floating_point() else (y_pred,)
    if input_checks_enabled() and not _all_finite(*values):  # one sync for both; then name the one at fault
        check_labels(names[0], labels, y_pred.shape[0], y_pred.device, embeddings=names[1])
        check_finite(names[1], y_pred)
    return labels


def check_angle_dim(dim: int, name: str = "y_pred") -> None:
    if dim % 2:
        raise ValueError(
            f"angle_loss splits each embedding into real and imaginary halves, so {name} needs an even number of "
            f"columns; got {dim}"
        )


def check_group_ids(group_ids: torch.Tensor | None, rows: int, y_pred: torch.Tensor) -> torch.Tensor | None:
    """Optional text ids of the rows, one per row of y_pred: returned as int64."""
    if group_ids is None:
        return None
    if (not isinstance(group_ids, torch.Tensor) or group_ids.is_floating_point() or group_ids.is_complex()
            or group_ids.dtype == torch.bool):  # a mask read as ids 0 and 1 would make most negatives positives
        raise TypeError("group_ids must be an integer torch.Tensor of text ids, one per row of y_pred, got "
                        + (f"a {group_ids.dtype} tensor" if isinstance(group_ids, torch.Tensor) else
                           type_name(group_ids)))
    if tuple(group_ids.shape) != (rows,):
        raise ValueError(f"group_ids must have shape [{rows}] (one id per row of y_pred), got {tuple(group_ids.shape)}")
    check_same_device(("y_pred", y_pred), ("group_ids", group_ids))
    return group_ids.long()


def check_arccon_options(margin_degrees: float, tau: float) -> tuple[float, float]:
    """ArcCon's margin (degrees, 0..180) and temperature (> 0), returned as (margin in radians, tau)."""
    margin = check_scalar("margin_degrees", margin_degrees)
    if not 0.0 <= margin <= 180.0:
        raise ValueError(f"margin_degrees must be between 0 and 180 degrees, got {margin}")
    return math.radians(margin), check_scale("tau", tau, divides=True)


def check_two_views(h1: torch.Tensor, h2: torch.Tensor) -> None:
    check_embedding_group(("h1", h1), ("h2", h2))
    check_same_shape("h1", h1, "h2", h2)


def check_triplets(anchor: torch.Tensor, weak: torch.Tensor, strong: torch.Tensor) -> None:
    check_embedding_group(("anchor", anchor), ("weak", weak), ("strong", strong))
    check_same_shape("anchor", anchor, "weak", weak)
    check_same_shape("anchor", anchor, "strong", strong)


@dataclass(frozen=True)
class Nested:
    """Matryoshka and layer-wise (Espresso) training: the loss on every prefix x[..., :d] of the embeddings (dims;
    None: the full width only), of every layer of a stack [L, rows, D] when `stacked`, weighted and summed:
    sum over (l, i) of table[l][i] * loss(x[l, ..., :dims[i]]), as sentence-transformers' MatryoshkaLoss (one
    layer) and Matryoshka2dLoss / AdaptiveLayerLoss (the layers' weights times the prefixes') do. dims ascend: the
    ops' contract; each row of the table follows them. Unstacked inputs have a one-row table."""

    dims: tuple[int, ...] | None
    table: tuple[tuple[float, ...], ...]  # [L][k]: L = 1 unstacked, k = 1 without dims
    stacked: bool = False

    @property
    def weights(self) -> tuple[float, ...]:
        """The prefixes' weights of unstacked inputs."""
        return self.table[0]

    def combine(self, per_prefix: torch.Tensor) -> torch.Tensor:
        """sum_i weights[i] * per_prefix[i] for the [k] losses of the prefixes of unstacked inputs (a 0-dim loss
        of the full width times its weight)."""
        weights = torch.tensor(self.weights, dtype=per_prefix.dtype, device=per_prefix.device)
        return per_prefix @ weights if per_prefix.dim() else per_prefix * weights[0]

    def terms(self) -> list[tuple[int, int, float]]:
        """(layer l, prefix i, weight) of every term with a non-zero weight: only those are computed (Espresso
        weights the final width of the earlier layers 0). Where every weight is 0 (sentence-transformers' Matryoshka
        accepts it, e.g. a step whose sampled dims all weigh 0), the first term with its weight 0: the loss is then
        0 with zero gradients, as the weighted sum of every term would be, not None."""
        terms = [(layer, i, weight) for layer, row in enumerate(self.table) for i, weight in enumerate(row) if weight]
        return terms or [(0, 0, 0.0)]

    def weighted_sum(self, term: Callable[[int, int], torch.Tensor]) -> torch.Tensor:
        """sum over self.terms() of weight * term(l, i)."""
        total = None
        for layer, i, weight in self.terms():
            total = weight * term(layer, i) if total is None else total + weight * term(layer, i)
        return total

    def over_layers(self, loss_of_layer: Callable[[int, Nested | None], torch.Tensor]) -> torch.Tensor:
        """A stack's loss from a loss of one layer: sum over the layers l of loss_of_layer(l, nested_l), nested_l
        the unstacked Nested of layer l's non-zero weights (None when the layer's only term is its full width,
        whose weight then multiplies the loss). Where every weight is 0, layer 0's first term weighted 0, as
        terms() gives."""
        if not any(weight for row in self.table for weight in row):
            return 0.0 * loss_of_layer(0, None if self.dims is None else Nested(self.dims[:1], ((1.0,),)))
        total = None
        for layer, row in enumerate(self.table):
            if self.dims is None:
                value = row[0] * loss_of_layer(layer, None) if row[0] != 0 else None
            else:
                keep = [i for i, weight in enumerate(row) if weight != 0]
                value = loss_of_layer(layer, Nested(tuple(self.dims[i] for i in keep), (tuple(row[i] for i in keep),)))\
                    if keep else None
            if value is not None:
                total = value if total is None else total + value
        return total


def combined(loss: torch.Tensor, nested: Nested | None) -> torch.Tensor:
    """An op's loss as the caller wants it: itself, or the weighted sum of its [k] per-prefix losses."""
    return loss if nested is None else nested.combine(loss)


def nested_dims(nested: Nested | None) -> tuple[int, ...] | None:
    """The prefixes an op computes for `nested` in one call (its dims), or None."""
    return None if nested is None else nested.dims


def check_nested(dims: Dims | None, dim_weights: DimWeights | None, width: int, even: bool = False, *,
                 layer_weights: LayerWeights | None = None, layers: int | None = None,
                 embeddings: torch.Tensor | None = None) -> Nested | None:
    """dims: None (the plain loss) or distinct prefix widths <= width in any order (sentence-transformers users
    list them largest first); dim_weights: None (all 1) or one finite number per dim, in dims' order. even: the
    angle score needs even widths. Returned sorted ascending, the weights permuted alike.

    layer_weights / layers: a stack of `layers` layers' embeddings [L, rows, D] (check_layer_stack gives L) and
    its weights: one number per layer (times the prefixes' dim_weights), or, with dims, one row of len(dims)
    numbers per layer (in dims' order; they replace dim_weights, which must then be None). Weights that are all 0
    give a loss of 0 with zero gradients, as all-zero dim_weights do (Nested.terms).

    embeddings: one of the call's (promoted) embeddings, where known: every weight (a layer's times a dim's) must fit
    its losses' compute dtype (check_weight_fits); their dtype is read only where there are weights, so that a plain
    call reads each fact of its inputs once."""
    if layer_weights is None:
        if dims is None:
            if dim_weights is not None:
                raise ValueError("dim_weights needs dims (the prefix widths they weight)")
            return None
        dims, weights = _checked_prefixes(dims, dim_weights)
        if embeddings is not None:
            for i, weight in enumerate(weights):
                check_weight_fits(f"dim_weights[{i}]", weight, embeddings.dtype)
        order = sorted(range(len(dims)), key=dims.__getitem__)
        return Nested(check_dims(tuple(dims[i] for i in order), width, even), (tuple(weights[i] for i in order),))
    layer_weights = _numpy_as_list(layer_weights)
    if not isinstance(layer_weights, (tuple, list, torch.Tensor)) or (
            isinstance(layer_weights, torch.Tensor) and layer_weights.dim() == 0) or len(layer_weights) != layers:
        raise ValueError(f"layer_weights must have one entry per layer of the stack ({layers}), got {layer_weights!r}")
    if isinstance(layer_weights, torch.Tensor) and layer_weights.requires_grad:  # .tolist() would drop its graph
        raise TypeError("layer_weights must be real numbers, got a tensor that requires grad: the losses take the "
                        "weights as constants and give them no gradient (learned weights would never change); pass "
                        "layer_weights.tolist() to use their values")
    layer_weights = layer_weights.tolist() if isinstance(layer_weights, torch.Tensor) else list(layer_weights)
    rows_given = any(isinstance(row, (tuple, list)) for row in layer_weights)
    if rows_given and (dims is None or dim_weights is not None):
        raise ValueError("layer_weights given as rows (one weight per layer and dim) need dims and replace "
                         "dim_weights (leave it None)")
    if dims is None:
        table = [[check_scalar(f"layer_weights[{layer}]", w)] for layer, w in enumerate(layer_weights)]
        names = [[f"layer_weights[{layer}]"] for layer in range(len(table))]
        order = [0]
    else:
        dim_weights_given = not rows_given and dim_weights is not None
        dims, dim_weights = _checked_prefixes(dims, None if rows_given else dim_weights)
        table, names = [], []
        for layer, row in enumerate(layer_weights):
            if rows_given:
                if not isinstance(row, (tuple, list)) or len(row) != len(dims):
                    raise ValueError(f"layer_weights[{layer}] must have one weight per dim ({len(dims)}), got {row!r}")
                table.append([check_scalar(f"layer_weights[{layer}][{i}]", w) for i, w in enumerate(row)])
                names.append([f"layer_weights[{layer}][{i}]" for i in range(len(dims))])
            else:
                scale = check_scalar(f"layer_weights[{layer}]", row)
                table.append([scale * w for w in dim_weights])
                names.append([f"layer_weights[{layer}] x dim_weights[{i}]" if dim_weights_given else
                              f"layer_weights[{layer}]" for i in range(len(dims))])
        order = sorted(range(len(dims)), key=dims.__getitem__)
        dims = check_dims(tuple(dims[i] for i in order), width, even)
    if embeddings is not None:
        for row, row_names in zip(table, names):
            for weight, name in zip(row, row_names):
                check_weight_fits(name, weight, embeddings.dtype)
    return Nested(dims, tuple(tuple(row[i] for i in order) for row in table), stacked=True)


def _checked_prefixes(dims: Dims, dim_weights: DimWeights | None) -> tuple[list[int], list[float]]:
    """dims as a list of distinct Python ints and their weights (1 each when dim_weights is None), in the order
    given; the widths' range is check_dims'."""
    dims = _numpy_as_list(dims)
    if isinstance(dims, torch.Tensor) and dims.dim() == 1 and not dims.is_floating_point():
        dims = dims.tolist()
    if not isinstance(dims, (tuple, list)) or not dims:
        raise TypeError(f"dims must be None or a non-empty sequence of ints, got {dims!r}")
    try:
        weights = [1.0] * len(dims) if dim_weights is None else list(dim_weights)
    except TypeError:  # a number, or anything else that is not a sequence
        raise TypeError(f"dim_weights must be None or a sequence of one weight per dim, got {dim_weights!r}") from None
    if len(weights) != len(dims):
        raise ValueError(f"dim_weights must have one weight per dim: {len(dims)} dims, {len(weights)} weights")
    weights = [check_scalar(f"dim_weights[{i}]", w) for i, w in enumerate(weights)]
    widths = [check_width(f"dims[{i}]", d) for i, d in enumerate(dims)]
    if len(set(widths)) != len(widths):
        raise ValueError(f"dims must be distinct, got {tuple(widths)}")
    return widths, weights


def _numpy_as_list(value):
    """A numpy array of one or more dimensions as nested Python lists (its numbers as Python's), else the value."""
    if type(value).__module__ == "numpy" and getattr(value, "ndim", 0) >= 1:
        return value.tolist()
    return value


def _count(value) -> int | None:
    """An integer as check_width takes it, as a Python int; None for anything else."""
    try:
        return check_width("", value)
    except TypeError:
        return None


def check_width(name: str, value) -> int:
    """A width given as an integer: a Python int, or one that converts exactly (operator.index: numpy's integers, a
    one-element integer tensor), returned as a Python int; bools and floats raise TypeError naming the argument."""
    if _is_bool(value) or (isinstance(value, torch.Tensor) and value.dtype == torch.bool):
        raise TypeError(f"{name} must be an int, got {type_name(value)}")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type_name(value)}") from None


def check_layer_stack(layer_weights: LayerWeights | None,
                      *named: tuple[str, torch.Tensor]) -> tuple[int | None, list[torch.Tensor]]:
    """Layer-wise inputs: with layer_weights None, (None, the tensors) unchanged. Otherwise every tensor must be a
    stack [L, rows, D] of L layers' embeddings (the same L): the values of layers 1.. are checked here and
    (L, the first layers) returned, for the caller's usual checks of a single layer's embeddings."""
    tensors = [t for _, t in named]
    if layer_weights is None:
        return None, tensors
    layers = None
    for name, t in named:
        if not isinstance(t, torch.Tensor) or t.dim() != 3:
            shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(f"{name}: with layer_weights, embeddings are a stack [L, rows, D] of the layers' "
                             f"embeddings; got {shape}")
        if layers is None:
            layers = t.shape[0]
        if t.shape[0] != layers or layers == 0:
            raise ValueError(f"{name}: every stack needs the same number L >= 1 of layers ({layers}), got "
                             f"{t.shape[0]}")
    for name, t in named:
        check_finite(name, t[1:])
    return layers, [t[0] for t in tensors]


def espresso_layer_weights(n_layers: int, compression_size: int,
                           width: int) -> tuple[tuple[int, ...], list[list[float]]]:
    """(dims, layer_weights rows) of Espresso (ESE) as angle-emb 0.6.1's AngleESETrainer weighs it, for a stack of
    n_layers pooled layers (hidden states 0 .. n_layers - 2, the last hidden state last): the last layer weighs
    1 at the compressed width and 1 at the full width; earlier layer i weighs 1 / (1 + ln(1 + i)) / (n_layers - 1)
    at the compressed width (the reference's per-layer loss, averaged over the earlier layers) and 0 at the full
    width. A compression size >= width keeps the whole width (the reference's slice is then the full embedding,
    so the last layer's loss counts twice)."""
    layers, size = _count(n_layers), _count(compression_size)  # numpy's and a tensor's ints too
    if layers is None or layers < 2:
        raise ValueError(f"n_layers: Espresso needs a model of at least 2 layers, got {n_layers!r}")
    if size is None or size < 1:
        raise ValueError(f"compression_size (AngleESETrainer's ese_compression_size) must be a positive int, got "
                         f"{compression_size!r}")
    n_layers, compression_size = layers, size
    earlier = [1.0 / (1.0 + math.log(1 + i)) / (n_layers - 1) for i in range(n_layers - 1)]
    if compression_size >= width:
        return (width,), [[w] for w in earlier] + [[2.0]]
    return (compression_size, width), [[w, 0.0] for w in earlier] + [[1.0, 1.0]]


def check_in_batch_options(directions: tuple[str, ...] | list[str], partition_mode: str, hardness_mode: str | None,
                           hardness_strength: float, false_negative_margin: float | None,
                           false_negative_strategy: str,
                           similarity: str = "cosine") -> tuple[tuple[str, ...], float, float | None]:
    """The options of multiple_negatives_ranking_loss as sentence-transformers 6.2 checks them, plus the
    false-negative filter's; returned normalised (directions a tuple, floats)."""
    directions = tuple(directions) if isinstance(directions, (tuple, list)) else directions
    if not isinstance(directions, tuple) or not directions or not _DIRECTION_SET.issuperset(directions):
        raise ValueError(f"directions must be a non-empty tuple of {DIRECTIONS}, got {directions!r}")
    if "query_to_doc" not in directions:
        raise ValueError("directions must include 'query_to_doc' (it holds the positive pair)")
    check_choice("partition_mode", partition_mode, PARTITION_MODES)
    if partition_mode == "per_direction" and set(directions) & {"query_to_query", "doc_to_doc"}:
        raise ValueError("partition_mode='per_direction' needs every direction to contain the positive pair: "
                         "'query_to_query' and 'doc_to_doc' do not; use partition_mode='joint'")
    if hardness_mode is not None:
        check_choice("hardness_mode", hardness_mode, tuple(HARDNESS_MODES))
    hardness_strength = check_scalar("hardness_strength", hardness_strength)
    if hardness_strength < 0:
        raise ValueError(f"hardness_strength must be >= 0, got {hardness_strength}")
    if hardness_mode is None and hardness_strength > 0:
        say_no_effect(f"hardness_strength={hardness_strength:g} has no effect without hardness_mode (None: no "
                      f"hardness weighting); give one of {tuple(HARDNESS_MODES)}")
    check_choice("similarity", similarity, SIMILARITIES)
    return directions, hardness_strength, check_false_negative_filter(false_negative_margin, false_negative_strategy)


def check_hardness_fits(*, scale: float, hardness_mode: str | None, hardness_strength: float) -> None:
    """A checked scale and hardness_strength together: with a hardness_mode, the penalised columns' logits are
    (scale + hardness_strength) x the similarity, so their sum is a logit factor, bound as check_scale bounds one."""
    if hardness_mode is not None and scale + hardness_strength > LARGEST_LOGIT_FACTOR:
        raise ValueError(f"hardness_strength + scale must be <= {LARGEST_LOGIT_FACTOR:.3g}: the penalised logits "
                         "are multiplied by their sum, and past that they overflow float32; got hardness_strength "
                         f"{hardness_strength:g} with scale {scale:g}")


def check_false_negative_filter(false_negative_margin: float | None,
                                false_negative_strategy: str) -> float | None:
    """The positive-aware false-negative filter's options (multiple_negatives_ranking_loss, AngleLoss): the margin,
    None (off) or a finite real returned as a float, and its strategy."""
    if false_negative_margin is not None:
        false_negative_margin = check_scalar("false_negative_margin", false_negative_margin)
    check_choice("false_negative_strategy", false_negative_strategy, MARGIN_STRATEGIES)
    if false_negative_margin is None and false_negative_strategy != MARGIN_STRATEGIES[0]:
        say_no_effect(f"false_negative_strategy={false_negative_strategy!r} has no effect without "
                      "false_negative_margin (None: no false-negative filter)")
    return false_negative_margin


_said_no_effect: set[str] = set()  # the notes say_no_effect gave in this process


def say_no_effect(note: str) -> None:
    """A UserWarning that an option does nothing as given, once per process: the options are checked on every call
    of a loss (every training step)."""
    if note not in _said_no_effect:
        _said_no_effect.add(note)
        user_warnings.warn(f"angle_kernels: {note}", UserWarning)


def _check_in_batch_columns(queries: torch.Tensor, positives: torch.Tensor, negatives: Sequence[torch.Tensor],
                            layer_weights: LayerWeights | None, gather_across_devices: bool,
                            gather_queries: bool = True,
                            options: dict | None = None) -> tuple[int | None, tuple | None]:
    """The embeddings of multiple_negatives_ranking_loss (already promoted to one dtype): stacks [L, rows, D]
    with layer_weights (check_layer_stack; not combined with gathering), every column [B, D] of the queries'
    shape, gathered with gradients from every rank first when gather_across_devices and torch.distributed runs
    several processes (the queries only when `gather_queries`: a direction scores other ranks' queries).
    `options`: the loss's options, which every rank must share (all_gather_many_with_grad's `options`), used
    only where the columns are gathered. Returns (L or None, gathered): gathered is None or (rank, all queries
    or None, all positives, all negatives), losses.retrieval.multiple_negatives' `gathered`."""
    gather_across_devices = check_flag("gather_across_devices", gather_across_devices)
    named = [("queries", queries), ("positives", positives)]
    named += [(f"negatives[{i}]", t) for i, t in enumerate(negatives)]
    layers, first = check_layer_stack(layer_weights, *named)
    if layers is not None:
        if gather_across_devices:
            raise ValueError("stacked layers (layer_weights) do not combine with gather_across_devices yet")
        named = [(name, t) for (name, _), t in zip(named, first)]
    # asked only when gathering: a call that does not gather never queries torch.distributed
    rank, world_size = gathering_rank_and_world_size() if gather_across_devices else (0, 1)
    gathered = None
    if gather_across_devices and world_size > 1:
        # Checked after gathering: every rank sees the same values, so a NaN on one rank makes all of them
        # raise (rather than one raising and the others waiting in the next collective).
        if gather_queries:
            everything = all_gather_many_with_grad(named, options=options)
            check_embedding_group(*((name, t) for (name, _), t in zip(named, everything)))
            gathered = (rank, everything[0], everything[1], everything[2:])
        else:
            def check_own_queries():
                """The queries that stay on this rank: checked here, before the ranks agree to gather (the
                columns' layout, which they agree on, and each column's shape = the queries')."""
                check_embedding_group(named[0])
                check_same_device(*named)
                for name, t in named[1:]:
                    check_same_shape("queries", named[0][1], name, t)
            everything = all_gather_many_with_grad(named[1:], check_own_queries, options=options)
            check_embedding_group(*((name, t) for (name, _), t in zip(named[1:], everything)))
            gathered = (rank, None, everything[0], everything[1:])
    else:
        check_embedding_group(*named)
    for name, t in named[1:]:
        check_same_shape("queries", named[0][1], name, t)
    return layers, gathered


class MultipleNegativesCall(NamedTuple):
    """multiple_negatives_ranking_loss's arguments, checked: the keywords of losses.retrieval.multiple_negatives."""

    queries: torch.Tensor
    positives: torch.Tensor
    negatives: list[torch.Tensor]
    scale: float
    directions: tuple[str, ...]
    partition_mode: str
    hardness_mode: str | None
    hardness_strength: float
    false_negative_margin: float | None
    false_negative_strategy: str
    gathered: tuple | None
    similarity: str
    nested: Nested | None


def check_multiple_negatives(queries: torch.Tensor, positives: torch.Tensor, negatives: Sequence[torch.Tensor], *,
                             scale: float, directions: tuple[str, ...] | list[str], partition_mode: str,
                             hardness_mode: str | None, hardness_strength: float,
                             false_negative_margin: float | None, false_negative_strategy: str, similarity: str,
                             gather_across_devices: bool, dims: Dims | None = None,
                             dim_weights: DimWeights | None = None, layer_weights: LayerWeights | None = None,
                             nested: Nested | None = None) -> MultipleNegativesCall:
    """Every check of multiple_negatives_ranking_loss, in its order: the scale; the embeddings promoted to one
    dtype; the options (check_in_batch_options); the columns [B, D] of the queries' shape, or stacks [L, rows, D]
    with layer_weights; then, when gather_across_devices and torch.distributed runs several processes, the
    columns gathered with gradients from every rank (the call's `gathered`); then dims / dim_weights /
    layer_weights parsed into a Nested. A front end that has parsed its Nested already (once per call) passes it
    as `nested` instead of dims, dim_weights and layer_weights: it is checked against these embeddings (its
    layers and its widest prefix), not parsed again. Under torch.distributed with gather_across_devices, a check
    that fails on one rank before the gathers fails on every rank (distributed.refused_together)."""
    # (a call that does not gather, the common one, skips the context manager, its cost per call and its file: a
    # call reaches its op through four files, tests/test_structure.py)
    sharing = gather_across_devices is not False
    with refused_together(gather_across_devices, queries) if sharing else contextlib.nullcontext():
        scale = check_scale("scale", scale)
        negatives = check_columns("negatives", negatives)
        queries, positives, *negatives = promote_embeddings(queries, positives, *negatives)
        directions, hardness_strength, false_negative_margin = check_in_batch_options(
            directions, partition_mode, hardness_mode, hardness_strength, false_negative_margin,
            false_negative_strategy, similarity)
        check_hardness_fits(scale=scale, hardness_mode=hardness_mode, hardness_strength=hardness_strength)
        if nested is not None:
            if dims is not None or dim_weights is not None or layer_weights is not None:
                raise ValueError("pass either a parsed nested or dims / dim_weights / layer_weights, not both")
            layer_weights = nested.table if nested.stacked else None
        # the other ranks' queries are columns of the query_to_query and doc_to_query directions only
        # the options every rank must share when gathering, made only then: they make the loss. Not the dims:
        # MatryoshkaLoss's n_dims_per_step draws them on each rank, and no collective depends on them. Both made
        # only where gathering is asked: a call that does not gather pays for neither
        layers, gathered = _check_in_batch_columns(
            queries, positives, negatives, layer_weights, gather_across_devices,
            gather_queries=sharing and not _DIRECTIONS_OF_QUERY_COLUMNS.isdisjoint(directions),
            options=dict(loss="multiple_negatives_ranking_loss", scale=scale, directions=directions,
                         partition_mode=partition_mode, hardness_mode=hardness_mode,
                         hardness_strength=hardness_strength, false_negative_margin=false_negative_margin,
                         false_negative_strategy=false_negative_strategy, similarity=similarity) if sharing else None)
    if nested is None:
        nested = check_nested(dims, dim_weights, queries.shape[-1], layer_weights=layer_weights, layers=layers,
                              embeddings=queries)
    elif nested.dims is not None:
        check_dims(nested.dims, queries.shape[-1])
    check_scaled_weights_fit(queries, ("scale", scale) if hardness_mode is None else
                             ("(scale + hardness_strength)", scale + hardness_strength), nested=nested)
    return MultipleNegativesCall(queries, positives, list(negatives), scale, directions, partition_mode,
                                 hardness_mode, hardness_strength, false_negative_margin, false_negative_strategy,
                                 gathered, similarity, nested)
