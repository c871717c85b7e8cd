"""A check on first use: a GPU code path verified at large size on some GPU, checked here before it computes.

`backend="auto"` computes a call on a GPU backend whose code path is verified on this GPU and software
(`angle_kernels.verified`). A path the table does not cover here, but whose code (its fingerprint) passed the
project's large-size checks on some GPU (`verified.checked_elsewhere`), may compute too, once this kind of call has
passed a first-use check here. Paths never verified at large size anywhere are never trusted this way: faults that
depend on size (32-bit offsets, grids past a limit) are the large-size run's to find, not a check on one call's
inputs.

A kind of call: (backend, op, code path, dtype of the first input, `bucket`) under this process's identity
(`verified.identity_here`: every field of verified.MATCH_FIELDS[backend]) and the version of the check (CHECKER:
records of an older check, whose faults a later one fixed, no longer match and the kind is checked again). The
bucket is what selects the compiled kernels and the autotuner's config for the call: a check speaks for the kernels
it ran, so it covers exactly the calls that run the same ones (see `bucket`).

The first call of a kind looks for its record in the user's cache (`angle_kernels.user_cache`, section "checks");
without one it checks the call under the cache's lock, re-reading the cache first (another process of the same job
may just have recorded it: that record is then used and nothing is checked), and records the outcome. The answer is
kept for the process. A pass: the GPU path computes that kind of call from then on. A failure (a wrong result): the
PyTorch backend computes it, with one RuntimeWarning per kind and process saying what failed; the record keeps later
processes from checking again (`python -m angle_kernels.verify --forget-failed` removes the failed checks' records).
Only results are recorded: where the GPU path raises (a compiler missing, the GPU out of memory while loading a
kernel) or the check itself cannot run (out of memory, a failing float64 product), this process computes the kind
on PyTorch, with the warning, and the next process checks again.

The check (`run_check`): on detached copies of the call's own inputs, the GPU path's op against the PyTorch backend
in float64 on the same rounded values, outputs and the gradients of sum_k <output_k, w_k> for weights w drawn from a
seeded generator on the device (the same for both), judged by the reference's rule (`float64_ops.allowed_error`: the
tolerances of float64 and float32, the half-precision rule for bfloat16 and float16). Eager PyTorch's own error,
which the rule needs for every dtype but float64, is measured on a sample of the call (its first rows, pairs or
scores; `sample`), where the reference's N x N matrices stay a few MB. NaN or Inf never passes.

Bounds (`checked_part`): a call whose float64 copies exceed ELEMENT_BUDGET elements, or whose float64 reference
exceeds FLOP_BUDGET, is checked on a part of it that takes the same code path and bucket (its first rows, groups or
scores); when no such part fits, the call stays on PyTorch without a record. docs/verification.md states what
that costs a first call.

Never while torch.compile traces or a CUDA graph is captured (`tracing`): there only records count; nothing is
checked and nothing is recorded. ANGLE_KERNELS_SELF_CHECK=0 turns the checks off (only verifications count; records
are not read); 1, the default, turns them on; any other value is a ValueError at the first call that asks.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import json
import math
import os
import time
from dataclasses import dataclass, replace

import torch

from . import contract, float64_ops, user_cache, user_warnings, verified
from ._runtime import SELF_CHECK_ENV, self_check_setting, triton_interpreting

ENV = SELF_CHECK_ENV
# The check's version, part of every kind: bumped by a change of the check that could change an outcome, so that
# the records of the check before it (a fault in it fixed) no longer match. 2: errors are no longer recorded.
CHECKER = 2
# Budgets of one check (docs/verification.md, "A check on first use"): the elements of the float64 copies of the
# checked inputs (1 GiB; their gradients as much again) and the FLOPs of the float64 reference (the torch backend's
# 6 M Mc D of the similarity ops; the linear ops are bounded by their elements). About half a second of an H100's
# float64 products at most; the package's target sizes (2N = 32,768 rows, D = 768 .. 4,096) fit whole or as a part.
ELEMENT_BUDGET = 1 << 27
FLOP_BUDGET = 1 << 44
# Eager PyTorch's error is measured on at most this many rows (and columns) of a similarity op or scores of the
# ranking term, or this many elements of pair_scores' input: the reference's N x N matrices stay a few MB.
SAMPLE_ROWS = 512
SAMPLE_ELEMENTS = 1 << 20
SEED = 0
# The differentiable inputs of each op (fields of its validated call, contract.check_<op>): the check's leaves.
LEAVES = {"pair_scores": ("x",), "ranking_loss": ("scores",), "similarity_xent": ("q", "c"),
          "similarity_lse": ("q", "c")}
# The code paths whose fp32 products are torch's (torch.mm: torch.backends.cuda.matmul.allow_tf32 applies)
TORCH_PRODUCT_PATHS = ("dense", "dense_dims")


@dataclass(frozen=True)
class Outcome:
    """Whether the GPU path may compute a kind of call and, when it may not after a check or for want of one, why
    (after "<backend>: " in a warning)."""

    computes: bool
    why: str = ""
    record: dict | None = None  # the record in the user's cache it comes from


# Per process: the outcome of each kind of call (a plain dict: after the first call of a kind, a lookup) and the
# setting, once read.
_outcomes: dict = {}
_enabled: bool | None = None


def forget() -> None:
    """Drop what this process has decided (tests; a process that removed the records)."""
    global _enabled
    _outcomes.clear()
    _enabled = None


def enabled() -> bool:
    """ANGLE_KERNELS_SELF_CHECK: unset or 1, checks on; 0, off; anything else raises ValueError naming it."""
    global _enabled
    if _enabled is None:
        _enabled = self_check_setting()
    return _enabled


def tracing(device: torch.device) -> bool:
    """Whether torch.compile is tracing (torch.compiler.is_compiling, torch._dynamo's on older torch) or the
    current CUDA stream is capturing a graph: then no check may run."""
    compiler = getattr(torch, "compiler", None)
    is_compiling = getattr(compiler, "is_compiling", None)
    if is_compiling is None:
        is_compiling = getattr(getattr(torch, "_dynamo", None), "is_compiling", lambda: False)
    if is_compiling():
        return True
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


# ---------------------------------------------------------------------------------------------------------
# Kinds of call
# ---------------------------------------------------------------------------------------------------------
def _pow2(n: int) -> int:
    """The autotune bucket of a row count: its next power of two (_similarity_tiles._autotune_bucket)."""
    return 1 << max(n - 1, 0).bit_length()


def _int_class(n: int) -> str:
    """How Triton specialises an integer argument (a size, a stride): 1, a multiple of 16, or neither; each class
    compiles a kernel of its own."""
    return "1" if n == 1 else "16" if n % 16 == 0 else "n"


def _layout(t: torch.Tensor | None) -> str | None:
    """The specialisation classes of a tensor argument's strides, and whether its start is 16-byte aligned
    relative to its storage (Triton specialises pointers on 16-byte alignment; allocations are aligned)."""
    if t is None:
        return None
    aligned = t.storage_offset() * t.element_size() % 16 == 0
    return ".".join(_int_class(s) for s in t.stride()) + ("" if aligned else ".unaligned")


def _precision(dtype: torch.dtype, path: str) -> str:
    """Whether fp32 products run in TF32 (a kernel variant, and another accuracy): the fused kernels follow
    ANGLE_KERNELS_ALLOW_TF32 (_similarity_tiles._dot_precision), the dense schemes' products (torch.mm, one width
    and dims) torch's switch."""
    if dtype != torch.float32:
        return "ieee"
    if path in TORCH_PRODUCT_PATHS:
        return "tf32" if torch.backends.cuda.matmul.allow_tf32 else "ieee"
    allowed = os.environ.get("ANGLE_KERNELS_ALLOW_TF32", "0") not in ("", "0") and not triton_interpreting()
    return "tf32" if allowed else "ieee"


def bucket(backend: str, op: str, path: str, call: contract.Call) -> dict:
    """What selects the compiled kernels and the autotuned config of a validated call.

    Triton: the similarity ops' autotune key (each op module's _TUNE_KEY: the power-of-two buckets of M and Mc, D,
    the variant flags, the dot precision; KP, the prefixes' power of two, with dims) with the flags that are
    constexprs outside the key (similarity_lse's exclusion, periodicity, filter), pair_scores' (K, D, with_angle,
    dims: constexprs of its kernels), nothing more for the ranking term but its labels' dtype; and for each the
    specialisation classes of the integer arguments and strides the kernels take (`_int_class`, `_layout`). CUDA
    (kernels compiled ahead, templated on the dtype): the op's variant flags and shapes that choose a kernel. The
    torch backend's GPU path (cuBLAS products, eager tile code): the variant flags, and with dims or not (another
    autograd Function)."""
    if op == "similarity_xent":
        q, c, dims = call.q, call.c, call.dims
        m, d = q.shape
        mc = m if c is None else c.shape[0]
        found = {"partner": call.target == "partner", "exclude_diagonal": call.exclude_diagonal,
                 "groups": call.group_ids is not None, "margin": call.margin != 0.0, "symmetric": c is None}
        if backend == "triton":
            found.update(M=_pow2(m), Mc=_pow2(mc), D=d, precision=_precision(q.dtype, path),
                         sizes=_int_class(m) + "." + _int_class(mc), q=_layout(q), c=_layout(c))
            if dims is not None:
                found["KP"] = _pow2(len(dims))
        if backend == "torch":
            found["dims"] = dims is not None
        return found
    if op == "similarity_lse":
        q, c, filter_q, filter_c, dims = call.q, call.c, call.filter_q, call.filter_c, call.dims
        has_filter = filter_q is not None
        found = {"exclude": call.exclude, "penalty_on": call.penalty_on if call.penalty != 0.0 else "none",
                 "periodic": call.period > 0, "filter": has_filter,
                 "filter_keeps_target": call.filter_keeps_target and has_filter, "normalize": call.normalize,
                 "dims": None if dims is None else list(dims)}
        if backend == "triton":
            (m, d), mc = q.shape, c.shape[0]
            found.update(M=_pow2(m), Mc=_pow2(mc), D=d, DF=filter_q.shape[1] if has_filter else 0,
                         precision=_precision(q.dtype, path),
                         filter_dtypes=[str(t.dtype) for t in (filter_q, filter_c)] if has_filter else None,
                         sizes=".".join(_int_class(n) for n in (m, mc, call.target_offset, call.period)),
                         q=_layout(q), c=_layout(c), filter_q=_layout(filter_q), filter_c=_layout(filter_c))
        return found
    if op == "pair_scores":
        x, dims = call.x, call.dims
        found = {"K": x.shape[1], "D": x.shape[2], "with_angle": call.with_angle,
                 "dims": None if dims is None else list(dims), "x": _layout(x)}
        if backend == "triton" and dims is not None:  # the prefix kernels take the number of groups
            found["groups"] = _int_class(x.shape[0])
        return found
    found = {"labels": str(call.labels.dtype)}  # ranking_loss
    if backend == "triton":
        found["sizes"] = _int_class(call.scores.shape[0])
    return found


def kind_of(candidate, op: str, call: contract.Call) -> dict:
    """The kind of call (module docstring), as a record stores it."""
    path = candidate.code_path(op, call)
    ident = verified.identity_here(candidate.name, op, path, call.device)
    kind = {"backend": candidate.name, "op": op, "path": path, "dtype": str(call.dtype).replace("torch.", ""),
            "bucket": bucket(candidate.name, op, path, call), "checker": CHECKER,
            **{name: ident.get(name) for name in verified.MATCH_FIELDS[candidate.name]}}
    return json.loads(json.dumps(kind))  # as it reads back from the cache (tuples become lists)


def _matches(record: dict, kind: dict) -> bool:
    return all(record.get(name) == value for name, value in kind.items())


def _recorded(kind: dict) -> dict | None:
    """The first record of this kind in the user's cache (the first one recorded wins)."""
    return next((r for r in user_cache.read()["checks"] if _matches(r, kind)), None)


# ---------------------------------------------------------------------------------------------------------
# The decision dispatch asks for
# ---------------------------------------------------------------------------------------------------------
def may_check(backend: str, op: str, path: str, device: torch.device) -> bool:
    """Whether a code path not verified here may compute after first-use checks: they are on, and its code passed
    the project's large-size checks on some GPU."""
    return enabled() and verified.checked_elsewhere(backend, op, path, device)


def decide(candidate, op: str, call: contract.Call, path: str) -> Outcome:
    """Whether `candidate` (a dispatch.Ops of a GPU backend whose code path `path` for the call is not verified
    here) may compute this validated call of `op` on its GPU: by this kind of call's check or record. Checks the
    first call of a kind (module docstring); later calls of it are a lookup."""
    device = call.device
    if not may_check(candidate.name, op, path, device):
        return Outcome(False)
    if tracing(device):  # this process's or recorded outcomes only, and nothing kept: an eager call checks its kind
        try:
            outcome = _outcomes.get(_key(candidate, op, call, path))
            record = None if outcome is not None else _recorded(kind_of(candidate, op, call))
        except Exception:  # noqa: BLE001 (symbolic shapes: no bucket to look up)
            outcome = record = None
        if outcome is not None:  # decided by an eager call of this process (recorded or not: an unwritable cache)
            return outcome
        if record is None:
            return Outcome(False, f"{_unverified(candidate, op, path, device)}, and under torch.compile tracing or "
                                  "CUDA-graph capture no first-use check runs (a call outside them checks its kind)")
        return _from_record(record)
    key = _key(candidate, op, call, path)
    outcome = _outcomes.get(key)
    if outcome is None:
        kind = kind_of(candidate, op, call)
        outcome = _check_or_recorded(candidate, op, call, kind)
        if outcome is None:  # this call cannot be checked; the next of its kind may be
            return Outcome(False, f"{_unverified(candidate, op, path, device)}, and this call's inputs are empty or "
                                  "not all finite (the next call of its kind is checked)")
        _outcomes[key] = outcome
        if not outcome.computes:
            _tell(candidate.name, op, kind, outcome)
    return outcome


def _key(candidate, op: str, call: contract.Call, path: str) -> tuple:
    """The kind of call as this process's key of `_outcomes`."""
    return (candidate.name, op, path, call.dtype, _frozen(bucket(candidate.name, op, path, call)), call.device.index)


def reason(candidate, op: str, call: contract.Call, path: str) -> str:
    """Why `candidate` does not compute this call on its code path `path`, when `decide` says so, for dispatch's
    warning (after "<backend>: ")."""
    outcome = decide(candidate, op, call, path)
    if outcome.why:
        return outcome.why
    if not enabled() and verified.checked_elsewhere(candidate.name, op, path, call.device):
        return f"{_unverified(candidate, op, path, call.device)} (first-use checks are off: {ENV}=0)"
    return _unverified(candidate, op, path, call.device)


def _unverified(candidate, op: str, path: str, device: torch.device) -> str:
    return (f"its code path {path!r} has not passed a correctness run on "
            f"{verified.describe(candidate.name, op, path, device)}")


def _tell(backend: str, op: str, kind: dict, outcome: Outcome) -> None:
    """One RuntimeWarning per process and kind of call that the PyTorch backend computes instead of a GPU path
    verified elsewhere."""
    failed = outcome.record is not None
    user_warnings.warn(
        f"angle_kernels: backend='auto' computes {op} with the PyTorch backend for calls like this one "
        f"({kind['dtype']}; {', '.join(f'{name}={value}' for name, value in kind['bucket'].items())}): {backend}: "
        f"{outcome.why}. "
        + ("`python -m angle_kernels.verify --forget-failed` removes the records of failed checks (the next call "
           "of this kind checks again); " if failed else "")
        + "`python -m angle_kernels.verify` runs the full checks on this GPU and records what passes (shown once per "
          "process for each kind of call).", RuntimeWarning)


def _frozen(value):
    """A bucket as a dict key."""
    if isinstance(value, dict):
        return tuple(sorted((k, _frozen(v)) for k, v in value.items()))
    return tuple(value) if isinstance(value, list) else value


def _from_record(record: dict, recorded: bool = True,
                 unrecorded: str = "not recorded: the user's cache cannot be written") -> Outcome:
    """The outcome a check's record says (`recorded`: it is in the user's cache, not only in this process; else
    `unrecorded` says why not)."""
    kept = record if recorded else None
    if record.get("pass") is True:
        return Outcome(True, record=kept)
    if record.get("error"):
        failed = f"it raised {record['error']}"
    else:
        errors, allowed = (value if isinstance(value, dict) else {}
                           for value in (record.get("errors"), record.get("allowed")))
        failed = "; ".join(f"{kind} error {_number(errors.get(kind)):.2e} > allowed {_number(allowed.get(kind)):.2e}"
                           for kind in ("value", "grad")
                           if not _number(errors.get(kind)) <= _number(allowed.get(kind))) or "failed"
    part = f", checked on {record['part']}" if record.get("part") else ""
    where = f"recorded {record.get('date')} in {user_cache.cache_file()}" if recorded else unrecorded
    return Outcome(False, f"its code path {record.get('path')!r} failed its first-use check for this kind of call on "
                          f"{record.get('gpu')} ({failed}{part}; {where})", kept)


def _number(value) -> float:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def _check_or_recorded(candidate, op: str, call: contract.Call, kind: dict) -> Outcome | None:
    """This kind's recorded outcome, or the outcome of checking this call (recorded); None when this call cannot
    be checked but a later one of its kind may (empty inputs, or not all finite)."""
    record = _recorded(kind)
    if record is not None:
        return _from_record(record)
    chosen = checked_part(candidate, op, call)
    if chosen is None:
        return Outcome(False, f"{_unverified(candidate, op, kind['path'], call.device)}, and calls of this kind are "
                              f"too large for a first-use check (at most {ELEMENT_BUDGET:,} float64 elements and "
                              f"{FLOP_BUDGET:.1e} float64 FLOPs), even on a part of the same code path and bucket")
    part, what = chosen
    try:
        if not _checkable(op, part):
            return None
    except Exception as exc:  # noqa: BLE001 (out of memory in the scan: a check must never fail the loss call)
        return _not_checked(candidate, op, kind, call, exc)
    unrecordable = None  # why the outcome cannot be recorded (an OSError), when it cannot
    with contextlib.ExitStack() as stack:
        try:
            stack.enter_context(user_cache.locked())
        except OSError as exc:  # a cache folder that cannot be written: check, and keep the answer for this process
            unrecordable = exc
        recording = unrecordable is None
        record = _recorded(kind) if recording else None
        if record is not None:  # another process of the job checked this kind while this one waited
            return _from_record(record)
        try:
            result = run_check(candidate, op, part)
        except Exception as exc:  # noqa: BLE001 (the reference or the check's own work: no fault of the path)
            return _not_checked(candidate, op, kind, call, exc)
        ident = verified.identity_here(candidate.name, op, kind["path"], call.device)
        record = {**kind, "gpu": ident.get("gpu"), **result, "part": what, "date": datetime.date.today().isoformat()}
        if "error" in record:  # the path raised: perhaps this process's environment, not the code; never recorded
            return _from_record(record, recorded=False,
                                unrecorded="not recorded: an error is this process's alone, the next one checks again")
        if recording:
            try:
                user_cache.update(lambda contents: contents["checks"].append(record))
            except OSError as exc:
                unrecordable, recording = exc, False
    if unrecordable is not None:
        user_cache.warn_unrecorded(unrecordable)
    return _from_record(record, recorded=recording)


def _not_checked(candidate, op: str, kind: dict, call: contract.Call, exc: Exception) -> Outcome:
    """The outcome of a check that could not run (its own work raised: out of memory, a failing float64 product):
    the PyTorch backend for this kind of call in this process, nothing recorded."""
    what = ("ran out of GPU memory" if isinstance(exc, torch.cuda.OutOfMemoryError) else
            f"could not run ({type(exc).__name__}: {str(exc)[:200]})")
    return Outcome(False, f"{_unverified(candidate, op, kind['path'], call.device)}, and its first-use check {what} "
                          "(this process keeps the PyTorch backend for this kind of call; nothing is recorded)")


def _leaves(op: str, call: contract.Call) -> list[torch.Tensor]:
    """The call's leaves (LEAVES) that it has (similarity_xent's c may be None)."""
    return [leaf for leaf in (getattr(call, name) for name in LEAVES[op]) if leaf is not None]


def _tensors(call: contract.Call) -> dict[str, torch.Tensor]:
    """The call's tensor arguments by name."""
    return {name: value for name, value in zip(call._names, call.args) if isinstance(value, torch.Tensor)}


def _checkable(op: str, call: contract.Call) -> bool:
    """Whether a call can be checked: its leaves hold elements (an empty call checks nothing) and every floating
    tensor of it (row weights, filter thresholds, labels too) is finite: a NaN the caller passes is no fault of the
    code path, and a record of it would keep the path off for good. On detached tensors: nothing is saved for
    autograd (inside torch.utils.checkpoint, a tensor saved by the first call only would fail its recomputation)."""
    return all(leaf.numel() > 0 for leaf in _leaves(op, call)) and all(
        bool(torch.isfinite(t.detach()).all()) for t in _tensors(call).values() if t.is_floating_point())


# ---------------------------------------------------------------------------------------------------------
# What is checked: the call, or a part of it in the same code path and bucket
# ---------------------------------------------------------------------------------------------------------
def first_rows(op: str, call: contract.Call, rows: int, columns: int | None = None) -> contract.Call:
    """The call on the first `rows` rows of q (with their row weights, group ids, filter rows and thresholds), and
    with `columns` the first rows of c (and of filter_c); pair_scores: the first groups; ranking_loss: the first
    scores and labels. Views: strides and alignment are the call's."""
    def head(t, n):
        return t if t is None or n is None else t[:n]

    if op == "similarity_xent":
        return replace(call, q=head(call.q, rows), row_weights=head(call.row_weights, rows),
                       group_ids=head(call.group_ids, rows), c=head(call.c, columns))
    if op == "similarity_lse":
        threshold = call.filter_threshold  # [M], or [k, M] with dims
        if threshold is not None and rows is not None:
            threshold = threshold[..., :rows]
        return replace(call, q=head(call.q, rows), filter_q=head(call.filter_q, rows), filter_threshold=threshold,
                       c=head(call.c, columns), filter_c=head(call.filter_c, columns))
    if op == "pair_scores":
        return replace(call, x=head(call.x, rows))
    return replace(call, scores=head(call.scores, rows), labels=head(call.labels, rows))


def _cost(op: str, call: contract.Call) -> tuple[int, int]:
    """(elements of the float64 copies of the leaves, FLOPs of the float64 reference) of a call."""
    elements = sum(leaf.numel() for leaf in _leaves(op, call))
    if op not in ("similarity_xent", "similarity_lse"):
        return elements, 0  # linear in the elements
    q, c = call.q, call.c
    m, width = q.shape
    mc = m if c is None else c.shape[0]
    if op == "similarity_xent" and call.dims is not None:
        width = sum(call.dims)  # one product per prefix
    if op == "similarity_lse" and call.filter_q is not None:
        width += call.filter_q.shape[1] // 3  # the filter's products: forward only
    return elements, 6 * m * mc * width


def _fewest_like(n: int, at_least: int = 1, even: bool = False) -> int:
    """The fewest rows k <= n in n's power-of-two bucket and specialisation class (even ones when `even`), from
    at_least: just over half the bucket."""
    start = max(at_least, _pow2(n) // 2 + 1)
    for k in range(start, min(n, start + 64) + 1):
        if _pow2(k) == _pow2(n) and _int_class(k) == _int_class(n) and not (even and k % 2):
            return k
    return n


def _most_like(n: int, cap: int) -> int:
    """The most rows k <= min(n, cap) in n's specialisation class (0 when none)."""
    k = min(n, cap)
    if _int_class(n) == "1" or k < 1:
        return min(k, 1)
    if _int_class(n) == "16":
        return k - k % 16
    return k if k % 16 else k - 1


def _parts(op: str, call: contract.Call):
    """(part, what it is) candidates for the check, the whole call first, then smaller ones."""
    yield call, None
    if op in ("similarity_xent", "similarity_lse"):
        q, c = call.q, call.c
        m = q.shape[0]
        partner = op == "similarity_xent" and call.target == "partner"
        rows = _fewest_like(m, even=partner)
        if c is None:
            yield first_rows(op, call, rows), f"the first {rows:,} of {m:,} rows"
            return
        mc = c.shape[0]
        yield first_rows(op, call, rows), f"the first {rows:,} of {m:,} rows of q"
        columns = _fewest_like(mc, at_least=rows)
        yield (first_rows(op, call, rows, columns),
               f"the first {rows:,} of {m:,} rows of q and {columns:,} of {mc:,} rows of c")
        return
    first = call.x if op == "pair_scores" else call.scores  # [G, K, D] groups or [N] scores
    whole = first.shape[0]
    per_row = max(1, first[:1].numel())
    rows = _most_like(whole, ELEMENT_BUDGET // per_row)
    if 0 < rows < whole:
        unit = "groups" if op == "pair_scores" else "scores"
        yield first_rows(op, call, rows), f"the first {rows:,} of {whole:,} {unit}"


def checked_part(candidate, op: str, call: contract.Call) -> tuple[contract.Call, str | None] | None:
    """(the call to check, what it is: None for the whole call) for a call of `candidate`: the call itself when it
    fits ELEMENT_BUDGET and FLOP_BUDGET, else the first part of `_parts` that fits and takes the same code path and
    bucket; None when none does."""
    path = candidate.code_path(op, call)
    same = bucket(candidate.name, op, path, call)
    for part, what in _parts(op, call):
        elements, flops = _cost(op, part)
        if elements > ELEMENT_BUDGET or flops > FLOP_BUDGET:
            continue
        if candidate.code_path(op, part) == path and bucket(candidate.name, op, path, part) == same:
            return part, what
    return None


def sample(op: str, call: contract.Call) -> contract.Call:
    """The first rows of a call (columns too: at most SAMPLE_ROWS of each), pairs (SAMPLE_ELEMENTS of input) or
    scores (SAMPLE_ROWS), where eager PyTorch's error is measured: its reference matrices stay a few MB."""
    if op in ("similarity_xent", "similarity_lse"):
        columns = None if call.c is None else min(call.c.shape[0], SAMPLE_ROWS)
        return first_rows(op, call, min(call.q.shape[0], SAMPLE_ROWS), columns)
    if op == "pair_scores":
        return first_rows(op, call, max(1, SAMPLE_ELEMENTS // max(1, call.x[:1].numel())))
    return first_rows(op, call, SAMPLE_ROWS)


# ---------------------------------------------------------------------------------------------------------
# The check
# ---------------------------------------------------------------------------------------------------------
def _torch_op(op: str):
    """The PyTorch backend's own op (torch_ops, as dispatch.raw_backend("torch") names it)."""
    return getattr(importlib.import_module("angle_kernels.torch_ops").load_ops()[op], op)


@contextlib.contextmanager
def _isolated(device: torch.device):
    """Autograd on, autocast off (the float64 reference must stay float64), and the check's saved tensors under its
    own hooks (`_saved`), whatever the caller's mode: inside a region of torch.utils.checkpoint (or save_on_cpu) the
    caller's saved-tensor hooks would pack the check's tensors, and its backward would start the region's
    recomputation."""
    with (torch.inference_mode(False), torch.enable_grad(), torch.autocast(device.type, enabled=False),
          torch.autograd.graph.saved_tensors_hooks(_saved, _as_is)):
        yield


def _saved(tensor: torch.Tensor) -> torch.Tensor:
    """A saved tensor kept as a detached view (the input itself would make a reference cycle through a saved
    output's grad_fn, which a backward that raises never breaks: the check's copies would outlive it)."""
    return tensor.detach()


def _as_is(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _fresh(value: torch.Tensor) -> torch.Tensor:
    """A copy of `value` in the layout the kernels are specialised on (`_layout`), which a clone would make
    contiguous and aligned: strides of the same classes (1, a multiple of 16, or neither), as compact as those
    allow (a prefix y[:, :64] of wide rows is not copied with the rows' whole width), and its start's 16-byte
    alignment (the storage offset modulo 16 bytes). A clone where the layout cannot be copied (overlapping elements,
    e.g. an expanded tensor)."""
    strides = _compact_strides(value.shape, value.stride())
    if value.numel() == 0 or strides is None:
        return value.clone()
    extent = 1 + sum((size - 1) * stride for size, stride in zip(value.shape, strides))
    offset = value.storage_offset() % max(1, 16 // value.element_size())  # allocations start 16-byte aligned
    storage = torch.empty(offset + extent, dtype=value.dtype, device=value.device)
    fresh = storage.as_strided(value.shape, strides, offset)
    try:
        return fresh.copy_(value)
    except RuntimeError:  # elements that share memory
        return value.clone()


def _outputs_and_grads(function, op: str, call: contract.Call, to: torch.dtype | None, weights=None, gen=None):
    """function(*call.args) with fresh leaves (copies of the call's, converted `to` a dtype; in the call's layout
    when not converted), and the gradients of sum_k <output_k, weights_k> with respect to them (weights drawn from gen
    when not given). The call's other tensors: made outside inference mode where they are inference tensors (an
    autograd Function cannot save those), and a filter that is the rows of a leaf (a filter on the model's own
    scores: the kernels take their own-filter route for it) made the fresh leaf's, when not converted."""
    leaves, others = {}, {}
    for name in LEAVES[op]:
        value = getattr(call, name)
        if value is not None:
            leaf = value.detach()
            leaves[name] = (_fresh(leaf) if to is None else leaf.to(to, copy=True)).requires_grad_()
    originals = {name: getattr(call, name) for name in leaves}
    for name, value in _tensors(call).items():
        if name in leaves:
            continue
        # filter_q is q's rows before c's (q may be c: a query_to_query block passes one tensor four times)
        own_first = sorted(leaves, key=lambda leaf_name: leaf_name != {"filter_q": "q", "filter_c": "c"}.get(name))
        same_rows = next((leaves[leaf_name] for leaf_name in own_first if _same_rows(value, originals[leaf_name])),
                         None)
        if same_rows is not None and to is None:
            others[name] = same_rows.detach()
        elif value.is_inference():
            others[name] = value.clone()
    outputs = function(*replace(call, **leaves, **others).args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    if weights is None:
        weights = [torch.randn(o.shape, generator=gen, dtype=torch.float64, device=o.device) for o in outputs]
    torch.autograd.backward([(o.double() * w).sum() for o, w in zip(outputs, weights) if o.requires_grad])
    return [o.detach() for o in outputs], [leaf.grad for leaf in leaves.values()], weights


def _compact_strides(shape, strides) -> list[int] | None:
    """The smallest strides, innermost first, that keep each stride's class (`_int_class`) and let no two elements
    share memory; None where that is not possible (a stride of 0 or below, a class "1" stride outside)."""
    compact, reach = list(strides), 1
    for dim in sorted(range(len(shape)), key=lambda i: strides[i]):
        if shape[dim] == 1:
            continue  # any stride: the kernels never step along it
        if strides[dim] <= 0:
            return None
        stride, wanted = reach, _int_class(strides[dim])
        while _int_class(stride) != wanted:
            if wanted == "1" or stride > reach + 16:
                return None
            stride += 1
        compact[dim], reach = stride, stride * shape[dim]
    return compact


def _same_rows(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors are the same elements of the same memory (a detached view of the other)."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype and a.device == b.device)


def error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """float64_ops.rel_err's measure, ||out - ref|| / ||ref|| in float64 (||out|| where ref is 0), computed on the
    device; entries equal in both count as no error, so an lse of -inf in both (a row with no kept column) is
    right. NaN, or an infinity in one only, gives NaN or Inf: never within an allowed error."""
    out = out.detach().to(torch.float64).reshape(-1)
    ref = ref.detach().to(device=out.device, dtype=torch.float64).reshape(-1)
    if out.shape != ref.shape:
        return math.inf
    same = out == ref
    diff = torch.linalg.vector_norm(torch.where(same, 0.0, out - ref))
    scale = torch.linalg.vector_norm(torch.where(same & ref.isinf(), 0.0, ref))
    return float(diff / scale) if scale > 0 else float(diff)


def _errors(got, want) -> dict:
    return {"value": max(error(o, w) for o, w in zip(got[0], want[0])),
            "grad": max(error(g, w) for g, w in zip(got[1], want[1]))}


def run_check(candidate, op: str, call: contract.Call) -> dict:
    """Check `candidate`'s own op (its raw backend's, no dispatch) on this validated call against the PyTorch
    backend in float64: {"pass", "errors", "allowed", "eager", "seconds"}, or {"pass": False, "error"} when the GPU
    path raises (but for running out of memory). Raises what the reference raises."""
    device, dtype = call.device, call.dtype
    started = time.perf_counter()
    gen = torch.Generator(device=device).manual_seed(SEED)
    with _isolated(device):
        try:
            got = _outputs_and_grads(getattr(candidate.backend, op), op, call, None, gen=gen)
        except torch.cuda.OutOfMemoryError:
            raise
        except Exception as exc:  # noqa: BLE001 (a GPU path that cannot run this call fails its check)
            return {"pass": False, "error": f"{type(exc).__name__}: {exc}"[:300],
                    "seconds": round(time.perf_counter() - started, 3)}
        weights = got[2]
        exact = _outputs_and_grads(_torch_op(op), op, call, torch.float64, weights)
        errors = _errors(got[:2], exact[:2])
        del got, exact
        eager = None
        if dtype != torch.float64:
            few = sample(op, call)
            with float64_ops.computing_in(dtype):
                in_dtype = _outputs_and_grads(getattr(float64_ops, op), op, few, None, gen=gen)
            exact_few = _outputs_and_grads(getattr(float64_ops, op), op, few, torch.float64, in_dtype[2])
            eager = _errors(in_dtype[:2], exact_few[:2])
    allowed = {kind: float64_ops.allowed_error(dtype, kind, None if eager is None else eager[kind])
               for kind in ("value", "grad")}
    passed = all(errors[kind] <= allowed[kind] for kind in ("value", "grad"))
    return {"pass": passed, "errors": errors, "allowed": allowed, "eager": eager,
            "seconds": round(time.perf_counter() - started, 3)}
