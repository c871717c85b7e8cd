"""Every first-party function a GPU code path runs is inside that path's fingerprint (angle_kernels.fingerprints).

The fingerprint is computed statically, by following names from the path's roots; this test watches what really
runs. Each Triton code path is run through the interpreter (forward and backward) on calls that reach every
branch of its launchers: 16-, 32- and 64-bit inputs, with and without the options that select host code (groups,
margins,
weights, a second candidate set, the angle, huge rows, empty inputs), with a profiler that records every function
of the package that is called. Each must be a definition of the path's closure, or of its op's selector (which
chooses the path and belongs to none). The CUDA backend's Python side cannot run here; its closures are checked
statically (tests/test_fingerprints.py).
"""

from __future__ import annotations

import cProfile
import inspect
import threading
from pathlib import Path

import pytest
import torch

from angle_kernels.testing import triton_interpreter
from angle_kernels.testing.helpers import TRITON_DEVICE

pytest.importorskip("triton")
if TRITON_DEVICE.type != "cpu":
    pytest.skip("the traces run under the Triton interpreter", allow_module_level=True)

from angle_kernels import contract, dispatch, fingerprints, verify  # noqa: E402
from angle_kernels.triton_ops import (  # noqa: E402
    pair_scores_paths, ranking_loss, similarity_lse_paths, similarity_xent_dense, similarity_xent_paths,
)

PACKAGE_DIR = Path(fingerprints.__file__).resolve().parent
# The interpreter's wrapper that the root conftest.py switches on runs in every launch traced here: the tests' own
# harness, in no path.
HARNESS_FILES = {Path(triton_interpreter.__file__).resolve()}


def _definition_index() -> dict:
    """file -> [(first line, last line, (module, name))] of the package's top-level definitions."""
    source = fingerprints._Source(fingerprints.folder_tree())
    index = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        if path.resolve() in HARNESS_FILES:
            continue
        relative = path.relative_to(PACKAGE_DIR).with_suffix("")
        parts = list(relative.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        module = source.module(".".join(parts))
        spans = []
        for name, statements in module.defs.items():
            for statement in statements:
                spans.append((statement.lineno, statement.end_lineno, (module.name, name)))
        index[str(path)] = spans
    return index


_INDEX = _definition_index()


def _owner(code) -> tuple[str, str] | None:
    """The top-level definition of the package a code object belongs to (None: not the package's)."""
    spans = _INDEX.get(str(Path(code.co_filename).resolve()))
    if spans is None:
        return None
    line = code.co_firstlineno
    # a decorated definition's code starts at its `def` line, below the decorators (the statement's lineno)
    owners = [owner for first, last, owner in spans if first <= line <= last]
    if not owners:  # code the interpreter compiled again from a kernel's rewritten source: its lines may shift
        owners = [owner for _, _, owner in spans if owner[1] == code.co_name]
    if not owners:
        return (f"? {Path(code.co_filename).name}:{line}", code.co_name)
    return min(owners, key=lambda o: o[1] == fingerprints._REGISTRATIONS)


def _run_traced(calls) -> set:
    """The package's definitions that run during calls()."""
    # cProfile's profiler is C: it records the code of every Python frame that starts (the 'call' events a
    # sys.settrace function sees) with no Python call per frame, and no per-line bookkeeping, which a trace function
    # costs in every frame even when it asks for no line events (on Python 3.11 that was a third of the test's time;
    # the functions recorded are the same), and without the caller-callee table (subcalls=False: only each entry's
    # code is read below). Threads the calls start: a profile function that records their frames.
    profiler = cProfile.Profile(subcalls=False, builtins=False)
    thread_codes = set()

    def record_thread_frames(frame, event, arg):
        if event == "call":
            thread_codes.add(frame.f_code)

    threading.setprofile(record_thread_frames)
    profiler.enable()
    try:
        calls()
    finally:
        profiler.disable()
        threading.setprofile(None)
    # each entry's code: a code object, or a C function's name (none recorded with builtins=False)
    codes = {entry.code for entry in profiler.getstats() if not isinstance(entry.code, str)} | thread_codes
    seen = set()
    for code in codes:
        if code.co_name == "<module>":
            # a module's top level: an import (whose definitions and registrations the closure has by name), or the
            # interpreter executing a kernel's rewritten source to define it again
            continue
        owner = _owner(code)
        if owner is not None:
            seen.add(owner)
    return seen


def _validated(op: str, args, kwargs) -> tuple:
    """The op's arguments as the backends receive them: every one, by position, checked (contract.check_<op>'s
    call, its .args)."""
    bound = inspect.signature(getattr(dispatch.Ops, op)).bind(None, *args, **kwargs)
    bound.apply_defaults()
    bound.arguments.pop("reference", None)  # similarity_lse's keyword-only feature, checked apart (dispatch.Ops)
    return getattr(contract, f"check_{op}")(*list(bound.arguments.values())[1:]).args


def _forward_backward(function, args):
    outputs = function(*args)
    outputs = outputs if isinstance(outputs, tuple) else (outputs,)
    total = sum(o.double().sum() for o in outputs if o.requires_grad)
    if isinstance(total, torch.Tensor):
        total.backward()


def _calls_of(cases, dtypes):
    """Every case in every dtype it takes: (op, path, args, kwargs)."""
    found = []
    for case in cases:
        for dtype in dtypes:
            if dtype not in case.dtypes:
                continue
            gen = torch.Generator().manual_seed(0)
            leaves, arguments = case.build(gen, dtype, TRITON_DEVICE)
            leaves = [x.detach().requires_grad_() for x in leaves]
            args, kwargs = arguments(*leaves)
            found.append((case.op, case.path, args, kwargs))
    return found


def _extra_calls(dtype):
    """Calls that reach host branches the verification cases do not: no angle, huge rows, an empty batch, no
    gradient wanted, options of similarity_lse."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 16, generator=gen, dtype=torch.float64).to(dtype)
    huge = x.clone()
    huge[1] *= 2.0 ** 70 if dtype in (torch.float32, torch.float64, torch.bfloat16) else 1.0
    q = torch.randn(12, 32, generator=gen, dtype=torch.float64).to(dtype)
    c = torch.randn(20, 32, generator=gen, dtype=torch.float64).to(dtype)
    wide_q = torch.randn(12, 64, generator=gen, dtype=torch.float64).to(dtype)
    wide_c = torch.randn(20, 64, generator=gen, dtype=torch.float64).to(dtype)
    wide_x = torch.randn(5, 3, 66, generator=gen, dtype=torch.float64).to(dtype)
    wide_huge = wide_x.clone()
    wide_huge[1] *= 2.0 ** 70 if dtype in (torch.float32, torch.float64, torch.bfloat16) else 1.0
    leaf = lambda t: t.detach().clone().requires_grad_()  # noqa: E731
    ranking = []
    if dtype in (torch.float32, torch.float64):  # the ranking term takes float32/float64 scores
        for n in (40, 200):  # the pairwise tiles, then (above the lowered SMALL_N_MAX) sort and scan
            scores = torch.randn(n, generator=gen, dtype=torch.float64).to(dtype)
            labels = torch.randint(0, 5, (n,), generator=gen)
            ranking.append(("ranking_loss", "pairwise" if n <= 64 else "sort", (leaf(scores), labels), {}))
        ranking.append(("ranking_loss", "pairwise", (leaf(scores[:0]), labels[:0]), {}))
    return ranking + [
        ("pair_scores", "full", (leaf(x), False), {}),
        ("pair_scores", "full", (leaf(huge), True), {}),
        ("pair_scores", "full", (leaf(x[:0]), True), {}),
        ("pair_scores", "dims", (leaf(x), False), {"dims": (8, 16)}),
        ("pair_scores", "dims", (leaf(huge), True), {"dims": (8, 16)}),
        ("pair_scores", "dims_one_read", (leaf(wide_x), False), {"dims": (8, 64)}),
        ("pair_scores", "dims_one_read", (leaf(wide_huge), True), {"dims": (8, 66)}),
        ("pair_scores", "dims_one_read", (leaf(wide_x[:0]), True), {"dims": (64,)}),
        ("similarity_xent", "fused", (leaf(q), None, 20.0, "partner"), {}),
        ("similarity_xent", "fused", (q.detach(), c.detach(), 20.0, "diagonal"), {}),
        ("similarity_xent", "dims", (leaf(q), leaf(c), 20.0, "diagonal"), {"dims": (16, 32)}),
        ("similarity_xent", "dense", (leaf(wide_q), None, 20.0, "partner"), {}),
        ("similarity_xent", "dense", (wide_q.detach(), None, 20.0, "partner"), {"margin": 0.1}),
        ("similarity_xent", "dense_dims", (wide_q.detach(), None, 20.0, "partner"), {"margin": 0.1, "dims": (16, 64)}),
        ("similarity_lse", "fused", (leaf(q), leaf(c), 20.0), {"exclude": "target", "normalize": False}),
        ("similarity_lse", "fused", (leaf(q), leaf(c), 20.0), {"period": 12, "exclude": "own", "penalty": 1.0,
                                                               "penalty_on": "all"}),
        # the dense similarity_lse scheme: a separate filter (in float32: filter_q's compute dtype where they
        # differ), raw dot products, one side's gradient only; the fused kernels per prefix without a filter
        ("similarity_lse", "dense", (leaf(wide_q), leaf(wide_c), 20.0), {
            "filter_q": wide_q.float(), "filter_c": wide_c.double(), "filter_threshold": torch.zeros(12)}),
        ("similarity_lse", "dense", (wide_q.detach(), leaf(wide_c), 0.5), {"normalize": False, "exclude": "target"}),
        ("similarity_lse", "dense_dims", (leaf(wide_q), wide_c.detach(), 20.0), {
            "dims": (16, 64), "filter_q": wide_q.float(), "filter_c": wide_c.float(),
            "filter_threshold": torch.zeros(2, 12), "penalty": 1.0, "penalty_on": "other"}),
        ("similarity_lse", "fused_prefixes", (leaf(q), leaf(c), 0.5), {"dims": (8, 32), "normalize": False}),
    ]


def _allowed(backend: str, op: str, path: str) -> set:
    members = set(fingerprints.path_closure(backend, op, path).members)
    selector = fingerprints.SELECTORS.get((backend, op))
    if selector is not None:
        members |= fingerprints.closure([selector]).members
    router = fingerprints.ROUTERS.get((backend, op))
    if router is not None:  # the router itself, not what it calls (each path's launcher: its own closure)
        module, name = router.split(":")
        members.add((module, name))
    return members


@pytest.mark.slow  # about 35 s through the interpreter on one core, a third of it the calls themselves
def test_every_function_a_triton_path_runs_is_in_its_fingerprint(monkeypatch):
    # the selectors' thresholds lowered (they belong to no path): the dense scheme at the tiny cases' width, the
    # ranking term's sort path at 200 scores
    monkeypatch.setattr(similarity_xent_dense, "MIN_WIDTH", 64)
    monkeypatch.setattr(ranking_loss, "SMALL_N_MAX", 64)
    monkeypatch.setattr(pair_scores_paths, "ONE_READ_MIN_WIDTH", 64)  # the one-read pair scores from width 64
    monkeypatch.setattr(similarity_xent_paths, "DENSE_DIMS_MIN_WIDTH", 64)  # and the dense dims scheme
    monkeypatch.setattr(similarity_lse_paths, "DENSE_MIN_WIDTH", 64)  # and similarity_lse's dense scheme
    monkeypatch.setattr(similarity_lse_paths, "DENSE_DIMS_MIN_WIDTH", 64)
    # float16 differs from bfloat16 only inside functions both run (a constexpr, an operand dtype): the trace is of
    # which functions run
    dtypes = (torch.bfloat16, torch.float32, torch.float64)
    triton_paths = verify.verified.paths_of("triton")
    # the Triton backend's cases (the tiny ranking cases replaced by the ones below)
    cases = [case for case in verify.cases("tiny")
             if case.path in triton_paths.get(case.op, ()) and case.op != "ranking_loss"]
    calls = _calls_of(cases, dtypes) + [c for d in dtypes for c in _extra_calls(d)]
    triton_backend = dispatch.raw_backend("triton")
    ran: dict = {}
    for op, path, args, kwargs in calls:
        validated = _validated(op, args, kwargs)  # the dispatch layer's work, outside the trace
        choose = triton_backend.code_paths[op]
        assert choose is None or choose(*validated) == path, (op, path)
        function = getattr(triton_backend, op)
        ran.setdefault((op, path), set()).update(_run_traced(lambda: _forward_backward(function, validated)))
    declared = {(op, path) for op, paths in verify.verified.paths_of("triton").items() for path in paths}
    assert set(ran) == declared  # every path ran
    outside = {}
    for (op, path), functions in ran.items():
        missing = functions - _allowed("triton", op, path)
        if missing:
            outside[f"{op}/{path}"] = sorted(missing)
    assert not outside, f"ran but not in the path's fingerprint: {outside}"
    # the comparison can fail: a closure that skipped a helper its path runs leaves that helper outside
    code = fingerprints.PATH_CODE[("triton", "pair_scores", "full")]
    narrower = fingerprints.closure(code.roots, code.skips + ("new_output",))
    assert ("triton_ops._common", "new_output") in ran[("pair_scores", "full")] - narrower.members
    # and the trace sees the kernels themselves (the interpreter runs them as Python)
    assert ("triton_ops.similarity_xent_dense", "_dense_xent_grad_kernel") in ran[("similarity_xent", "dense")]
    assert ("triton_ops._similarity_tiles", "_dot_tile") in ran[("similarity_xent", "fused")]
