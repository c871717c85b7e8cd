"""Check the GPU backends on this GPU and record what passes, so that backend="auto" uses it.

    python -m angle_kernels.verify [--backend all|triton|cuda|torch[,...]] [--sizes standard|large] [--out FILE]
    python -m angle_kernels.verify --list | --forget | --forget-failed

For every GPU backend that can run here (triton; cuda only when its extension is already built: this command
never builds it; torch: its GPU path, 16-bit products), every op it implements and every code path of that op that
needs a verification (the op module's PATHS, see `angle_kernels.verified`; not the torch backend's default path),
on fresh random inputs on the GPU, forward and backward: the backend against
`angle_kernels.float64_ops` in float64, computed on the GPU from the same rounded inputs, judged by the reference's
rule (`float64_ops.allowed_error`): float64 and float32 against tolerances, bfloat16 and float16 at most twice
eager PyTorch's own error in that dtype. Every case runs twice: its first call compiles and autotunes (the
autotuner runs every config several times on the call's own buffers, and the result must still be right), the
second must be right too.

A code path passes when every case of it passes in every dtype (bfloat16, float32, float16, then float64: in
that order, so a time limit cuts the rarest first); it is then recorded in the user's cache
(`angle_kernels.user_cache`), and a path that fails loses any earlier record for this GPU and software. Paths whose
checks did not all run (--time-limit) are neither. Takes a few minutes on an H100, most of it compiling and
autotuning. `--sizes large` uses the sizes of the project's own GPU run (scripts/gpu_check.sh first, which runs
one process per dtype and turns their merged results into the entries for the project's table,
`verified.VERIFIED`).

`--list` prints what the user's cache holds (these verifications and the first-use checks of
`angle_kernels.first_use`) and where; `--forget` removes it, so that every path is checked again; `--forget-failed`
removes only the first-use checks that failed.

Exit status: 0 when every check that ran passed (none left to run under --unverified-only included), 1 when a check
failed (or --list, --forget, --forget-failed could not read or change the cache), 2 for a bad option, 69 when
nothing could be verified here: no CUDA device, or none of the backends asked for can run (nothing is checked,
recorded or written to --out).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from . import first_use, float64_ops, user_cache, verified
from .contract import SCORE_DTYPES, compute_dtype  # ranking_loss takes scores in SCORE_DTYPES only
from .dispatch import path_ops, resolve_backend

# The order dtypes are checked in: what training uses first.
DTYPES = (torch.bfloat16, torch.float32, torch.float16, torch.float64)
# The exit status where nothing could be verified (sysexits' EX_UNAVAILABLE): neither 0, which a script calling this
# on a machine without a GPU would take for "verified", nor 1, a check that failed
NOTHING_VERIFIED = 69
HALF_DTYPES = (torch.bfloat16, torch.float16)  # the torch backend's GPU path takes only these
# Above this many elements of its N x N matrix the reference ranking term is replaced by the torch backend in
# float64 (itself held to the reference by the test suite): the sort path exists only at large N.
REFERENCE_MAX_ELEMENTS = 2**26


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


@dataclass(frozen=True)
class Case:
    """One check of an op's code path: `build(gen, dtype, device)` returns (leaves, arguments), where
    arguments(*leaves) gives the op's (args, kwargs) with those leaves in place; the op is called by name on a
    backend's Ops or on the reference module, which take the same arguments."""

    op: str
    path: str
    name: str
    build: Callable
    dtypes: tuple = DTYPES


def _randn(gen, *shape, dtype, device):
    return torch.randn(*shape, generator=gen, dtype=torch.float64, device=device).to(dtype)


def _signs(gen, *shape, device):
    """float32 entries +-1, equally likely."""
    return torch.randint(0, 2, shape, generator=gen, device=device).mul_(2).sub_(1).to(torch.float32)


def _grid_rows(gen, rows: int, d: int, dtype, device) -> torch.Tensor:
    """[rows, d] of +-1 entries, each row times a power of two (1/2, 1 or 2): every prefix of width w of two rows
    has a cosine m / w (m an integer of w's parity), exact in every dtype, whatever the rows' norms."""
    scale = torch.pow(2.0, torch.randint(-1, 2, (rows, 1), generator=gen, device=device).to(torch.float32))
    return (_signs(gen, rows, d, device=device) * scale).to(dtype)


def _between_cosines(width: int, near: float) -> float:
    """A threshold halfway between two neighbouring cosines of _grid_rows' prefixes of `width`, near `near`: 1 / width
    from either, far beyond any dtype's rounding of them."""
    numerator = round(near * width)
    return (numerator + (1 if (numerator - width) % 2 == 0 else 0)) / width


def _pair_case(path: str, groups: int, k: int, d: int, dims=None) -> Case:
    def build(gen, dtype, device):
        return [_randn(gen, groups, k, d, dtype=dtype, device=device)], lambda x: ((x, True), {"dims": dims})

    return Case("pair_scores", path, f"G={groups} K={k} D={d}" + (f" dims={dims}" if dims else ""), build)


def _ranking_case(path: str, n: int) -> Case:
    def build(gen, dtype, device):
        scores = 5 * _randn(gen, n, dtype=dtype, device=device)
        labels = torch.randint(0, 6, (n,), generator=gen, device=device)
        return [scores], lambda s: ((s, labels), {})

    return Case("ranking_loss", path, f"N={n}", build, SCORE_DTYPES)


def _xent_case(path: str, m: int, mc: int | None, d: int, dims=None, dtypes=DTYPES) -> Case:
    """In-batch negatives (mc None: c is q; partner targets, duplicate texts, zero-weighted rows) or the
    contrastive loss with an ArcCon-style angular margin (diagonal targets, candidates c)."""
    def build(gen, dtype, device):
        q = _randn(gen, m, d, dtype=dtype, device=device)
        if mc is None:
            options = dict(target="partner", exclude_diagonal=True, dims=dims,
                           group_ids=torch.randint(0, max(1, m // 2), (m,), generator=gen, device=device),
                           row_weights=(torch.rand(m, generator=gen, device=device) > 0.2).to(compute_dtype(dtype)))
            return [q], lambda q: ((q, None, 20.0), options)
        c = _randn(gen, mc, d, dtype=dtype, device=device)
        return [q, c], lambda q, c: ((q, c, 20.0), dict(target="diagonal", margin=math.radians(10), dims=dims))

    shape = f"M={m}" + ("" if mc is None else f" Mc={mc}") + f" D={d}" + (f" dims={dims}" if dims else "")
    return Case("similarity_xent", path, ("ibn " if mc is None else "contrastive ") + shape, build, dtypes)


def _lse_case(path: str, m: int, mc: int, d: int, dims=None, guided: bool = False) -> Case:
    """A query block against its documents and hard negatives laid out m apart (period), with a hardness penalty
    on the other columns and a false-negative filter on the model's own scores (with dims: each prefix's). The
    embeddings are _grid_rows, their cosines exact in every dtype, and each prefix's threshold lies between two of
    them: with random embeddings hundreds of the filter's scores (250M with five prefixes) lie within float32
    rounding of the threshold, where the backend (in the inputs' dtype) and the float64 reference keep different
    columns, and the check judges the ties, not the kernels (an H200 run found the float32 gradients of every
    dims path off by 4e-4, eager PyTorch's by 2e-4, while float64 agreed to 1e-15). guided:
    raw dot products (normalize=False) with a guide model's filter instead (float32 embeddings of the same width,
    dropping about the top sixth of each row's columns; the target kept), excluding the own columns. The guide's
    entries are +-1: its dot products are integers, exact in float32 as in float64, and the thresholds (square
    roots) either integers or far from any, so that no filter score sits within float32 rounding of its threshold
    (among 50M scores some would: the backend, filtering in float32 as the guide's dtype says, and the float64
    reference would then keep different columns, and the check would judge the tie, not the kernel)."""
    def build(gen, dtype, device):
        rows = (m,) if dims is None else (len(dims), m)
        options = {} if dims is None else {"dims": dims}
        if guided:  # one standard deviation of a guide's dot product over each width
            q = _randn(gen, m, d, dtype=dtype, device=device)
            c = _randn(gen, mc, d, dtype=dtype, device=device)
            fq = _signs(gen, m, d, device=device)
            fc = _signs(gen, mc, d, device=device)
            widths = torch.tensor([d] if dims is None else list(dims), dtype=torch.float32, device=device)
            threshold = widths.sqrt()[:, None].expand(len(widths), m).reshape(rows).contiguous()
            return [q, c], lambda q, c: ((q, c, 2.0 / math.sqrt(d)), dict(
                period=m, exclude="own", penalty=0.5 / math.sqrt(d), penalty_on="all", filter_q=fq, filter_c=fc,
                filter_threshold=threshold, filter_keeps_target=True, normalize=False, **options))
        q, c = _grid_rows(gen, m, d, dtype, device), _grid_rows(gen, mc, d, dtype, device)
        cuts = [_between_cosines(w, 0.1) for w in ([d] if dims is None else dims)]
        threshold = torch.tensor(cuts, dtype=compute_dtype(dtype), device=device)[:, None].expand(len(cuts), m)
        threshold = threshold.reshape(rows).contiguous()
        return [q, c], lambda q, c: ((q, c, 20.0), dict(
            period=m, penalty=2.0, penalty_on="other", filter_q=q.detach(), filter_c=c.detach(),
            filter_threshold=threshold, filter_keeps_target=True, **options))

    name = ("guided dots " if guided else "") + f"M={m} Mc={mc} D={d}" + (f" dims={dims}" if dims else "")
    return Case("similarity_lse", path, name, build)


def cases(sizes: str = "standard") -> list[Case]:
    """Every op and code path's cases at `sizes`: "standard" (a few minutes on an H100 with the compiles),
    "large" (the project's GPU run: past the interpreter's reach, seconds each), "tiny" (the CPU tests, through
    the Triton interpreter; its dense cases, at width 64, take the dense scheme only where a test lowers the
    scheme's MIN_WIDTH, its one-read pair-score cases the one-read kernels only where a test lowers their
    ONE_READ_MIN_WIDTH, its ranking sort case, at 150 scores, the sort path only where a test lowers its
    SMALL_N_MAX, and three scan blocks only where it lowers the scan's block from 1,024 scores to 64)."""
    tiny = sizes == "tiny"
    # (tiny: two groups: the pair-score kernels run one program per group, and a second program already reads at a
    # later group's offsets; under the interpreter each program costs a fraction of a second)
    pairs = {"tiny": 2, "standard": 16384, "large": 131072}[sizes]
    rows = {"tiny": 24, "standard": 2048, "large": 8192}[sizes]
    d, wide = {"tiny": (32, 64), "standard": (768, 1024), "large": (768, 4096)}[sizes]
    # The fused kernels' full-width cases sit below the dense scheme's MIN_WIDTH (768: wider inputs take the
    # dense scheme), at a common small-encoder width; tests/ops/test_verify.py checks every case takes its path.
    narrow = 32 if tiny else 512
    # Matryoshka at its usual five widths (the prefix kernels' KP = 8 specialisation) and at three (KP = 4): on the
    # prefix kernels below the dense scheme's MIN_WIDTH, on the dense dims scheme from it up (at MIN_WIDTH and at
    # the wide width)
    at_d = ((8, 16, 32), (4, 8, 16, 24, 32)) if tiny else ((64, 256, 768), (64, 128, 256, 512, 768))
    dims, five = at_d if tiny else ((64, 256, narrow), (64, 128, 256, 384, narrow))
    dense_dims = [(rows, None, wide, (8, 16, 64) if tiny else (64, 256, wide)),
                  (rows // 2, rows, wide, (4, 8, 16, 32, 64) if tiny else (64, 128, 256, 512, wide))]
    if not tiny:
        dense_dims += [(rows, None, d, at_d[0]), (rows // 2, rows, d, at_d[1])]
    # the pair scores of every prefix in one read (from ONE_READ_MIN_WIDTH, 768, up): five widths at 768 and at the
    # wide width (format C triples there); the prefix kernels' case below it
    scaled = tuple(wide // 2**i for i in (4, 3, 2, 1, 0))
    one_read = [_pair_case("dims_one_read", pairs, 2, wide if tiny else d,
                           dims=(4, 8, 16, 40, 64) if tiny else at_d[1]),
                _pair_case("dims_one_read", max(1, pairs // 4), 3, wide, dims=scaled)]
    # similarity_lse on the dense scheme (from its proposed width, 768, up: at it and at the wide width; raw dot
    # products with a guide's filter at the wide width), with dims in one pass at three and five widths; the fused
    # kernels below it, once and per prefix (the dims calls the dense scheme does not take). The CUDA backend's
    # similarity_lse has the dense scheme alone (its paths "dense" and "dense_dims"): it takes the dense cases at
    # every width
    lse_at = ((8, 16, 64), (4, 8, 16, 32, 64)) if tiny else ((64, 256, wide), (64, 128, 256, 512, wide))
    lse_dense = [_lse_case("dense", rows // 2, 3 * (rows // 2), wide),
                 _lse_case("dense", rows // 2, 3 * (rows // 2), wide, guided=True),
                 _lse_case("dense_dims", rows // 2, 3 * (rows // 2), wide, dims=lse_at[0]),
                 _lse_case("dense_dims", rows // 2, 3 * (rows // 2), wide, dims=lse_at[1]),
                 _lse_case("fused_prefixes", rows // 2, 3 * (rows // 2), narrow, dims=dims)]
    if not tiny:
        lse_dense += [_lse_case("dense", rows // 2, 3 * (rows // 2), d),
                      _lse_case("dense_dims", rows // 2, 3 * (rows // 2), d, dims=at_d[1])]
    # the dense scheme from its MIN_WIDTH (768) up, not only at the wide width. The CUDA backend's dense scheme
    # takes the same "dense" cases (switched on at its proposed width, 768) and its dense dims scheme, which takes
    # every dims call there, the "dense_dims" ones: in-batch negatives and the contrastive loss with a margin, four
    # row blocks at large sizes, every dtype
    at_min_width = [] if tiny else [_xent_case("dense", rows, None, d)]
    # the torch backend's 16-bit products (its "mixed" path, bf16 and fp16 only): in-batch negatives, the
    # contrastive loss with a margin at the wide width, Matryoshka at three and five widths; more than one row block
    # at large sizes (the GPU's blocks hold 2^25 logits: 4,096 rows of 8,192 columns)
    mixed = [_xent_case("mixed", rows, None, d, dtypes=HALF_DTYPES),
             _xent_case("mixed", rows // 2, rows, wide, dtypes=HALF_DTYPES),
             _xent_case("mixed", rows, None, d, dims=at_d[0], dtypes=HALF_DTYPES),
             _xent_case("mixed", rows // 2, rows, d, dims=at_d[1], dtypes=HALF_DTYPES)]
    return [
        _pair_case("full", pairs, 2, d),
        _pair_case("full", max(1, pairs // 4), 3, d),
        _pair_case("dims", pairs, 2, narrow, dims=dims),
        # format C triples at five widths; widths off the 16-byte vectors (the CUDA kernels' per-element path)
        _pair_case("dims", max(1, pairs // 4), 3, narrow, dims=five),
        _pair_case("dims", max(1, pairs // 4), 2, narrow, dims=(6, 12, 26) if tiny else (60, 250, narrow)),
        *one_read,
        _ranking_case("pairwise", 40 if tiny else 3000),
        # (tiny: three scan blocks of 64 scores where the test lowers the block, the last one partial: the first, a
        # middle one with both carries, the last; the interpreter scans one score at a time, 0.2 s per 64)
        _ranking_case("sort", {"tiny": 150, "standard": 6000, "large": 2_000_000}[sizes]),
        _xent_case("fused", rows, None, narrow),
        _xent_case("fused", rows // 2, rows, narrow),
        _xent_case("dense", rows, None, wide),
        _xent_case("dense", rows // 2, rows, wide),
        *at_min_width,
        _xent_case("dims", rows, None, narrow, dims=dims),
        _xent_case("dims", rows // 2, rows, narrow, dims=five),
        *[_xent_case("dense_dims", m, mc, width, dims=prefixes) for m, mc, width, prefixes in dense_dims],
        _lse_case("fused", rows // 2, 3 * (rows // 2), narrow),
        *lse_dense,
        *mixed,
    ]


# ---------------------------------------------------------------------------------------------------------
# Running a check
# ---------------------------------------------------------------------------------------------------------
def _outputs_and_grads(ops, case: Case, arguments, leaves, weights=None, gen=None):
    """The op's outputs on `ops` and the gradients of sum_k <output_k, weights_k> with respect to fresh copies
    of leaves (weights drawn from gen when not given); returns (outputs, grads, weights)."""
    fresh = [x.detach().clone().requires_grad_() for x in leaves]
    args, kwargs = arguments(*fresh)
    outputs = getattr(ops, case.op)(*args, **kwargs)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    if weights is None:
        weights = [torch.randn(o.shape, generator=gen, dtype=torch.float64, device=o.device) for o in outputs]
    sum((o.double() * w).sum() for o, w in zip(outputs, weights)).backward()
    return [o.detach() for o in outputs], [x.grad for x in fresh], weights


def _errors(got, want) -> dict:
    return {"value": max(float64_ops.rel_err(o, w) for o, w in zip(got[0], want[0])),
            "grad": max(float64_ops.rel_err(g, w) for g, w in zip(got[1], want[1]))}


def _reference_for(case: Case, leaves: list):
    """(the float64 reference of the case, its name): this package's reference, or for a ranking term too large
    for its N x N matrix, the torch backend in float64."""
    if case.op == "ranking_loss" and leaves[0].shape[0] ** 2 > REFERENCE_MAX_ELEMENTS:
        return resolve_backend("torch", leaves[0]), "torch float64"
    return float64_ops, "reference"


def check(ops, case: Case, dtype: torch.dtype, device, seed: int = 0) -> dict:
    """Run one case on `ops` in `dtype`, twice, against the float64 reference: the errors of both calls (and of
    eager PyTorch in that dtype), the allowed errors, and pass."""
    gen = torch.Generator(device=device).manual_seed(seed)
    started = time.perf_counter()
    leaves, arguments = case.build(gen, dtype, device)
    args, kwargs = arguments(*leaves)
    taken = ops.computes(case.op, *args, **kwargs)[1]
    if taken != case.path:
        return {"pass": False, "error": f"the inputs take the code path {taken!r}, not {case.path!r}"}
    exact_ops, against = _reference_for(case, leaves)
    # float64 copies of the same rounded values: the reference's gradients stay float64
    exact = _outputs_and_grads(exact_ops, case, arguments, [x.double() for x in leaves], gen=gen)
    weights = exact[2]
    first = _outputs_and_grads(ops, case, arguments, leaves, weights)
    second = _outputs_and_grads(ops, case, arguments, leaves, weights)
    eager = None
    if dtype != torch.float64 and against == "reference":
        with float64_ops.computing_in(dtype):
            eager = _errors(_outputs_and_grads(float64_ops, case, arguments, leaves, weights), exact)
    result = {"against": against, "first": _errors(first, exact), "second": _errors(second, exact), "eager": eager}
    result["allowed"] = {kind: float64_ops.allowed_error(dtype, kind, None if eager is None else eager[kind])
                         for kind in ("value", "grad")}
    result["pass"] = all(result[call][kind] <= result["allowed"][kind]
                         for call in ("first", "second") for kind in ("value", "grad"))
    result["seconds"] = round(time.perf_counter() - started, 2)
    return result


def unverified_cases(backend: str, case_list: list[Case], device,
                     table: tuple[dict, ...] | None = None) -> tuple[list[Case], list[str]]:
    """(the cases of `case_list` whose code path on `backend` the project's table does not cover on `device` with
    this installation's code, the "backend op path" names of the covered paths left out)."""
    table = verified.VERIFIED if table is None else table
    paths = verified.paths_of(backend)
    kept, covered = [], []
    for case in case_list:
        if case.path not in paths.get(case.op, ()):
            kept.append(case)  # a path this backend lacks (run_checks leaves it out): it has no identity
            continue
        ident = verified.identity(backend, case.op, case.path, device)
        if any(verified.covers(entry, backend, case.op, case.path, ident) for entry in table):
            name = f"{backend} {case.op} {case.path}"
            covered += [] if name in covered else [name]
        else:
            kept.append(case)
    return kept, covered


def run_checks(backend: str, device, case_list: list[Case], dtypes=DTYPES, deadline: float | None = None,
               on_result=None) -> list[dict]:
    """Every case of `case_list` on `backend` in every one of its dtypes, dtype by dtype (see DTYPES), until the
    monotonic `deadline`; on_result(results) after each. Cases of ops or paths the backend lacks are left out. The
    backend computes on the paths its op modules name, verified or not (dispatch.path_ops)."""
    ops = path_ops(backend, torch.empty(0, device=device))
    with _paths_to_check(backend):
        return _run_checks(ops, backend, device, case_list, dtypes, deadline, on_result)


def _paths_to_check(backend: str):
    """The GPU backend's paths that await their first verification (triton_ops.AWAITING_VERIFICATION,
    cuda_ops.AWAITING_VERIFICATION) switched on, so they take their cases."""
    if backend == "triton":
        from .triton_ops import awaiting_verification_on
    elif backend == "cuda":
        from .cuda_ops import awaiting_verification_on
    else:
        return contextlib.nullcontext()
    return awaiting_verification_on()


def _run_checks(ops, backend: str, device, case_list: list[Case], dtypes, deadline, on_result) -> list[dict]:
    results = []
    for dtype in dtypes:
        for case in case_list:
            if dtype not in case.dtypes or getattr(ops.backend, case.op) is None:
                continue
            if case.path not in ops.backend.paths[case.op]:
                continue
            result = {"backend": backend, "op": case.op, "path": case.path, "case": case.name,
                      "dtype": _dtype_name(dtype), "dtypes_required": [_dtype_name(d) for d in case.dtypes]}
            if deadline is not None and time.monotonic() > deadline:
                result.update({"pass": None, "error": "not run: time limit"})
            else:
                try:
                    result.update(check(ops, case, dtype, device))
                except Exception as exc:  # noqa: BLE001 (a failure is a result; a lost CUDA context stops below)
                    result.update({"pass": False, "error": f"{type(exc).__name__}: {exc}"[:500]})
            results.append(result)
            if on_result is not None:
                on_result(results)
            if any(marker in result.get("error", "") for marker in ("CUDA error", "illegal memory access")):
                return results  # every later CUDA call of this process would fail too
    return results


def outcomes(results: list[dict]) -> dict[tuple[str, str, str], str]:
    """(backend, op, path) -> "failed" (a check failed), "passed" (its checks ran and passed in every dtype its
    cases require), or "incomplete" (checks left out, or dtypes not run: results of several runs, one per
    dtype, can be merged before this is asked)."""
    found: dict = {}
    ran: dict = {}
    for r in results:
        key = (r["backend"], r["op"], r["path"])
        state = "failed" if r["pass"] is False else "incomplete" if r["pass"] is None else "passed"
        for worse in ("failed", "incomplete"):
            if worse in (found.get(key), state):
                state = worse
                break
        found[key] = state
        required, done = ran.setdefault(key, (set(), set()))
        required.update(r.get("dtypes_required", ()))
        if r["pass"] is True:
            done.add(r["dtype"])
    for key, (required, done) in ran.items():
        if found[key] == "passed" and not required <= done:
            found[key] = "incomplete"
    return found


def entries_from(results: list[dict], identity_of, evidence: str, sizes: str) -> tuple[list[dict], list[dict]]:
    """(passed, failed) verification entries of the results, checked at `sizes`; identity_of(backend, op, path)
    gives the identity."""
    passed, failed = [], []
    for (backend, op, path), state in outcomes(results).items():
        if state == "incomplete":
            continue
        dtypes = sorted({r["dtype"] for r in results if (r["backend"], r["op"], r["path"]) == (backend, op, path)})
        made = verified.entry(backend, op, path, identity_of(backend, op, path), evidence, dtypes, sizes)
        (passed if state == "passed" else failed).append(made)
    return passed, failed


# ---------------------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------------------
def _runnable_backends(wanted: list[str]) -> tuple[list[str], dict[str, str]]:
    """The GPU backends to check, and why the others are left out (cuda: only an already built extension)."""
    usable, why_not = [], {}
    for name in verified.GPU_BACKENDS if "all" in wanted else wanted:
        if name == "torch":  # its GPU path runs wherever torch has CUDA
            ok, why = True, ""
        elif name == "cuda":
            from .cuda_ops import _extension

            ok, why = _extension.load(allow_build=False)
        else:
            from .triton_ops import is_available

            ok, why = is_available()
        if ok:
            usable.append(name)
        else:
            why_not[name] = why
    return usable, why_not


def _row(r: dict) -> str:
    """One check as a line of the console's table."""
    head = f"{r['backend']:<7} {r['op']:<16} {r['path']:<9} {r['dtype']:<9} {r['case']:<40}"
    if r.get("error"):
        return head + f" {'FAIL' if r['pass'] is False else '--'}: {r['error']}"
    first, allowed = r["first"], r["allowed"]
    return head + (f" value {first['value']:.1e} grad {first['grad']:.1e} (allowed {allowed['value']:.1e} / "
                   f"{allowed['grad']:.1e}; 2nd call {r['second']['value']:.1e} / {r['second']['grad']:.1e})  "
                   f"{'ok' if r['pass'] else 'FAIL'}  {r['seconds']:.1f} s")


def describe_cache() -> str:
    """The user's cache in words: where it is, each verification and each first-use check, one line each."""
    where = user_cache.cache_file()
    contents = user_cache.read(where, unreadable_raises=True)  # "0 verifications" only where there are none
    lines = [f"{where}: {len(contents['verified'])} verifications, {len(contents['checks'])} first-use checks"]
    for e in contents["verified"]:
        backend = e.get("backend")
        compiler = f", {backend} {e.get(backend)}" if backend in ("triton", "cuda") else ""
        lines.append(f"verified  {e.get('backend')} {e.get('op')} {e.get('path')} on {e.get('gpu')} "
                     f"(sm_{str(e.get('capability')).replace('.', '')}, torch {e.get('torch')}{compiler}; "
                     f"code {e.get('fingerprint')}) at {e.get('sizes')} sizes, {e.get('date')}")
    for r in contents["checks"]:
        bucket = r.get("bucket") if isinstance(r.get("bucket"), dict) else {}
        bucket = ", ".join(f"{k}={v}" for k, v in sorted(bucket.items()))
        stale = "" if r.get("checker") == first_use.CHECKER else ", an older check's: not used"
        lines.append(f"{'passed' if r.get('pass') is True else 'FAILED'}    {r.get('backend')} {r.get('op')} "
                     f"{r.get('path')} {r.get('dtype')} [{bucket}] on {r.get('gpu')} (code {r.get('fingerprint')}"
                     f"{stale}), {r.get('date')}")
    return "\n".join(lines)


def _backend_names(value: str) -> list[str]:
    """--backend's value: "all", or GPU backends, comma-separated."""
    names = [name.strip() for name in value.split(",")]
    unknown = [name for name in names if name not in ("all", *verified.GPU_BACKENDS)]
    if unknown:
        raise argparse.ArgumentTypeError(f"not a GPU backend: {', '.join(map(repr, unknown))} (all, "
                                         f"{', '.join(verified.GPU_BACKENDS)})")
    return names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m angle_kernels.verify", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--backend", type=_backend_names, default=["all"],
                        help=f"all (the default), or one or more of {', '.join(verified.GPU_BACKENDS)}, "
                             "comma-separated")
    parser.add_argument("--sizes", choices=("standard", "large"), default="standard")
    parser.add_argument("--dtypes", default=",".join(_dtype_name(d) for d in DTYPES),
                        help="comma-separated, in the order to check them (default: %(default)s); a path is "
                             "recorded only when every dtype of its cases has run")
    parser.add_argument("--time-limit", type=float, default=None, help="seconds; checks not started by then are "
                        "left out (their paths are neither recorded nor revoked)")
    parser.add_argument("--out", type=Path, default=None,
                        help="also write every check and the passed/failed entries there, as JSON, as it goes")
    parser.add_argument("--no-record", action="store_true", help="do not update the user's cache")
    parser.add_argument("--unverified-only", action="store_true",
                        help="leave out the code paths the project's table (verified.VERIFIED) already covers on "
                             "this GPU with this code: the project's GPU run checks what changed")
    cache = parser.add_mutually_exclusive_group()
    cache.add_argument("--list", action="store_true", help="print the user's cache (verifications and first-use "
                       "checks) and exit")
    cache.add_argument("--forget", action="store_true", help="remove the user's cache and exit: every verification "
                       "and first-use check recorded in it, for every process sharing it; every path is checked again")
    cache.add_argument("--forget-failed", action="store_true", help="remove only the records of first-use checks "
                       "that failed and exit: the next call of each such kind checks again")
    args = parser.parse_args(argv)
    if args.list:
        try:
            print(describe_cache())
        except OSError as exc:  # no folder for the cache (no home directory), or a cache that cannot be read
            print(f"cannot list the cache: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.forget:
        try:
            where = user_cache.cache_file()
            print(f"removed {where}" if user_cache.forget() else f"nothing to remove: {where} does not exist")
        except OSError as exc:
            print(f"cannot remove the cache: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.forget_failed:
        try:
            where = user_cache.cache_file()
            print(f"removed {user_cache.forget_failed_checks()} failed first-use check(s) from {where}")
        except OSError as exc:
            print(f"cannot change the cache: {exc}", file=sys.stderr)
            return 1
        return 0
    if args.time_limit is not None and not args.time_limit > 0:
        parser.error("--time-limit must be a positive number of seconds")
    if args.out is not None and args.out.is_dir():
        parser.error(f"--out {args.out} is a folder; give the path of a file to write")
    if args.out is not None:  # a path no folder can be made for is refused here, on any machine, though made later
        existing = next(folder for folder in (args.out.parent, *args.out.parent.parents) if folder.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK):
            parser.error(f"--out {args.out}: no folder {args.out.parent} that can be written ({existing} is "
                         f"{'not a folder' if not existing.is_dir() else 'not writable'})")
    dtypes = []
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name.strip(), None)
        if dtype not in DTYPES:
            parser.error(f"--dtypes: {name.strip()!r} is not one of {', '.join(_dtype_name(d) for d in DTYPES)}")
        dtypes.append(dtype)
    if not torch.cuda.is_available():  # before --out's folder is made: nothing is written
        print(f"no CUDA device: nothing to verify (the GPU backends run only on CUDA tensors; on CPU the test suite "
              f"checks them through the Triton interpreter); exit status {NOTHING_VERIFIED}")
        return NOTHING_VERIFIED
    device = torch.device("cuda", torch.cuda.current_device())
    # what this command exists to settle: dispatch's "not verified here" warnings would only repeat it
    warnings.filterwarnings("ignore", message=r"angle_kernels: backend=.* has not passed a correctness run")
    usable, why_not = _runnable_backends(args.backend)
    for name, why in why_not.items():
        print(f"not checked: {name}: {why}")
    if not usable:
        print(f"nothing to verify: none of the backends asked for can run here; exit status {NOTHING_VERIFIED}")
        return NOTHING_VERIFIED
    if args.out is not None:  # found out now, not after minutes of checks; made only where checks run
        with contextlib.suppress(OSError):
            args.out.parent.mkdir(parents=True, exist_ok=True)
        if not args.out.parent.is_dir() or not os.access(args.out.parent, os.W_OK):
            parser.error(f"--out {args.out}: no folder {args.out.parent} that can be written")
    deadline = None if args.time_limit is None else time.monotonic() + args.time_limit
    report = {"gpu": torch.cuda.get_device_name(device), "sizes": args.sizes, "not_checked": why_not,
              "results": [], "passed": [], "failed": []}

    def on_result(results):
        print(_row(results[-1]), flush=True)
        report["results"] = done + results
        if args.out is not None:
            user_cache.write_json_atomic(args.out, report)

    done: list[dict] = []
    for backend in usable:
        case_list = cases(args.sizes)
        if args.unverified_only:
            case_list, covered = unverified_cases(backend, case_list, device)
            report.setdefault("already_verified", []).extend(covered)
            for key in covered:
                print(f"already verified (the project's table): {key}")
        done += run_checks(backend, device, case_list, dtypes, deadline=deadline, on_result=on_result)
    passed, failed = entries_from(done, lambda backend, op, path: verified.identity(backend, op, path, device),
                                  f"python -m angle_kernels.verify --sizes {args.sizes}", args.sizes)
    report.update(results=done, passed=passed, failed=failed)
    if args.out is not None:
        user_cache.write_json_atomic(args.out, report)
    for state, made in (("passed", passed), ("FAILED", failed)):
        for e in made:
            sm = e["capability"].replace(".", "")
            print(f"{state}: {e['backend']} {e['op']} {e['path']} on {e['gpu']} (sm_{sm})")
    for (backend, op, path), state in outcomes(done).items():
        if state == "incomplete":
            print(f"not verified (checks left out by the time limit): {backend} {op} {path}")
    if not args.no_record and (passed or failed):
        try:
            where = verified.write_cache(passed, failed)
            print(f"recorded in {where}: backend='auto' uses the passed code paths from the next process on")
        except OSError as exc:  # a cache a later version wrote, no home directory, a folder that cannot be written
            print(f"not recorded in the user's cache: {exc}" + (f" (the results are in {args.out})" if args.out
                                                                   else ""), file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
