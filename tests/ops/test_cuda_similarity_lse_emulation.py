"""A CPU model of the CUDA similarity_lse tile kernels (csrc/similarity_lse.cu), run under the real orchestration.

The CUDA backend's similarity_lse (angle_kernels/cuda_ops/similarity_lse.py) makes the dot-product tiles with torch
products and hands each row block to two ops, cuda_similarity_lse_stats and cuda_similarity_lse_grad. Here those
two ops are replaced (monkeypatched at the module's `_stats` and `_grad`) by PyTorch transcriptions of their
kernels and binding, and the op is checked against angle_kernels.float64_ops.similarity_lse (float64) on CPU tensors,
forward and backward, for every option of the contract, odd shapes, several row blocks, rows that keep no column,
huge rows, and float32 / float64 / bfloat16 / float16 inputs. What each part mirrors in csrc/similarity_lse.cu:

    _logit          lse_row and lse_logit: the score v = P row_inv col_inv, the target and own columns (period),
                    exclude, the filter on the block's own scores or on a second tile (compared in the filter's
                    compute type), the hardness penalty, the anchor-scale logit w.
    _stats_kernel   _lse_stats_kernel: one block per row (vectorised over the blocks), thread x reading columns
                    x, x + 256, ... with the running remainder col % period advanced by the stride's, the online
                    state (lse_add, lse_exp: 1 where x == m), the warp's butterfly merge (offsets 16 .. 1,
                    lse_merge), warp 0 merging the 8 warps' states in order, and the final m a + log(sum), -inf for
                    an empty row.
    _grad_kernel    _lse_grad_kernel: the grid of 256-column by 16-row tiles (the rows' state staged in shared
                    memory per block: the same values, read from the vectors here), the element's G (0 off the kept
                    columns and on rows whose m is -inf), with dims the running sum H = G + ratios H_previous
                    (DenseRunning) and its fp32 copy, the rounding to the operand type, the radial terms (of the
                    rounded G with one width, of G per prefix), each thread's column sum in row order, each row's
                    warp sums (butterfly) and the 8 warps' sum in order, and the per-tile partials.
    _stats, _grad   the binding (csrc/similarity_lse.cpp): its checks of shapes, dtypes and contiguity, which filter a
                    call has, penalty 0 as no penalty, the partials reduced over the tiles (at::sum), zeros without
                    radial sums, the [0] results (no running sum; no rounded copy of an fp32 running sum).

Registered as the ops' CPU kernels, the models also let torch.compile(fullgraph=True) trace the op through its fake
implementations and run it (test_compiled_fullgraph_equals_eager).

The accumulation types are the kernels' (float32, float64 for float64 inputs; the filter in its own compute type)
and the thread and block counts are read from the .cu file. It is a model of the kernels, not a proof: CUDA's expf
and logf, the compiler's fused multiply-adds, the real reduction hardware, memory accesses out of bounds and races
are not modelled (the GPU run's tests and `angle_kernels.verify` check those). The torch products are the real
orchestration's, on CPU (16-bit operands converted to fp32 first: the same values and accumulation).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from angle_kernels import float64_ops
from angle_kernels.contract import check_similarity_lse
from angle_kernels.cuda_ops import similarity_lse as cuda_lse
from angle_kernels.testing.helpers import (
    HUGE_OP_MAGNITUDES, assert_close, check_against_oracle, huge_magnitude_id, huge_row_factors, leaf_like,
)
from dense_tile_models import NEG_INF, WARP, GradGrid, constant, grad_binding
from test_similarity_lse import CASES, DIMS_CASES, _dims_inputs, _inputs

CU = (Path(__file__).resolve().parents[2] / "csrc" / "similarity_lse.cu").read_text()
TYPES = (Path(__file__).resolve().parents[2] / "csrc" / "similarity_lse_types.h").read_text()


STATS_THREADS = constant(CU, "kLseStatsThreads")
GRAD_ROWS, GRAD_COLS = constant(TYPES, "kLseGradRows"), constant(TYPES, "kLseGradCols")


# ----------------------------------------------------------------------------------------------------------
# The element: lse_row and lse_logit
# ----------------------------------------------------------------------------------------------------------
def _logit(t: dict, local: torch.Tensor, col: torch.Tensor, col_mod: torch.Tensor):
    """(kept, v, w) for local rows `local` [R, 1] and columns `col` [.., C] (in range), as lse_logit."""
    row = t["row0"] + local
    target = row + t["target_offset"]
    acc = t["dots"].dtype
    score = t["dots"][local, col] * t["row_inv"][row] * t["col_inv"][col]
    is_target = col == target
    own = (col_mod == target) if t["period"] > 0 else is_target
    kept = {"none": torch.ones_like(is_target), "target": ~is_target, "own": ~own}[t["exclude"]]
    if t["filter"] != "none":
        threshold = t["threshold"][row]
        if t["filter"] == "own":
            dropped = score.to(threshold.dtype) > threshold
        else:
            guide = t["filter_dots"][local, col]
            dropped = guide * t["filter_row_inv"][row] * t["filter_col_inv"][col] > threshold
        if t["filter_keeps_target"]:
            dropped = dropped & ~is_target
        kept = kept & ~dropped
    logit = score * torch.tensor(t["scale"], dtype=acc)
    hard = {"none": torch.zeros_like(is_target), "other": ~own, "own": own & ~is_target, "all": ~is_target}[
        t["penalty_on"]]
    logit = torch.where(hard, logit + torch.tensor(t["penalty"], dtype=acc) * score, logit)
    return kept, score, logit


def _lse_exp(x, m, a):
    return torch.where(x == m, torch.ones_like(x), torch.exp((x - m) * a))


def _lse_merge(m, s, other_m, other_s, a):
    top = torch.maximum(m, other_m)
    both_empty = top == NEG_INF
    merged = (torch.where(m == NEG_INF, torch.zeros_like(s), s * _lse_exp(m, top, a))
              + torch.where(other_m == NEG_INF, torch.zeros_like(s), other_s * _lse_exp(other_m, top, a)))
    return torch.where(both_empty, m, top), torch.where(both_empty, s, merged)


# ----------------------------------------------------------------------------------------------------------
# The kernels
# ----------------------------------------------------------------------------------------------------------
def _stats_kernel(t: dict):
    """_lse_stats_kernel on every block at once: blocks are rows [n, 1], threads lanes [1, STATS_THREADS]."""
    acc = t["dots"].dtype
    n, cols, period = t["n_rows"], t["cols"], t["period"]
    local = torch.arange(n)[:, None]
    a = t["row_unscale"][t["row0"] + local]  # [n, 1]
    lanes = torch.arange(STATS_THREADS)[None, :]
    m = torch.full((n, STATS_THREADS), NEG_INF, dtype=acc)
    s = torch.zeros((n, STATS_THREADS), dtype=acc)
    step = STATS_THREADS % period if period > 0 else 0
    col = lanes.clone()
    col_mod = col % period if period > 0 else torch.zeros_like(col)
    while bool((col < cols).any()):
        active = col < cols  # the thread's loop condition
        safe_col = torch.where(active, col, torch.zeros_like(col))
        kept, _v, w = _logit(t, local, safe_col, col_mod)
        add = active & kept & (w > NEG_INF)
        greater = w > m
        s = torch.where(add, torch.where(greater, s * _lse_exp(m, w, a) + 1, s + _lse_exp(w, m, a)), s)
        m = torch.where(add & greater, w, m)
        if period > 0:  # the running remainder, as the kernel advances it
            col_mod = col_mod + step
            col_mod = torch.where(col_mod >= period, col_mod - period, col_mod)
        col = col + STATS_THREADS
    for offset in (16, 8, 4, 2, 1):  # __shfl_xor_sync within each warp
        partner = lanes[0] ^ offset
        m, s = _lse_merge(m, s, m[:, partner], s[:, partner], a)
    warp_m, warp_s = m[:, ::WARP], s[:, ::WARP]  # lane 0 of each warp, into shared memory
    m, s = warp_m[:, :1], warp_s[:, :1]
    for other in range(1, STATS_THREADS // WARP):  # thread 0 merges the warps in order
        m, s = _lse_merge(m, s, warp_m[:, other:other + 1], warp_s[:, other:other + 1], a)
    m, s = m[:, 0], s[:, 0]
    empty = m == NEG_INF
    spread = torch.where(empty, torch.zeros_like(s), torch.log(torch.where(empty, torch.ones_like(s), s)))
    lse = torch.where(empty, torch.full_like(m, NEG_INF), m * a[:, 0] + spread)
    return lse, m, spread


def _grad_kernel(t: dict, top, log_sum, coef, running: dict, radial: bool, out_dtype: torch.dtype | None):
    """_lse_grad_kernel on the whole grid at once: the tile's rows [row tiles * 16, 1] (y, k), its columns
    [1, column tiles * 256] (x, threadIdx.x). running: DenseRunning (previous, keep_next, row_ratio, col_ratio);
    out_dtype None: no rounded tile (grad null). Returns (rounded H or None, next H or None, row and column
    partials)."""
    acc = t["dots"].dtype
    grid = GradGrid(t["n_rows"], t["cols"], GRAD_ROWS, GRAD_COLS)
    n, cols, ok, safe_local, safe_col = grid.n, grid.cols, grid.ok, grid.safe_local, grid.safe_col
    col_mod = safe_col % t["period"] if t["period"] > 0 else torch.zeros_like(safe_col)
    kept, v, w = _logit(t, safe_local, safe_col, col_mod)
    row = t["row0"] + safe_local
    m = top[row]
    a = t["row_unscale"][row]
    live = ok & kept & (m > NEG_INF)
    g = torch.where(live, coef[row] * torch.tensor(t["scale"], dtype=acc)
                    * torch.exp((w - torch.where(live, m, 0.0)) * a - log_sum[row]), torch.zeros_like(v))
    h, following = grid.fold(g, running, row)  # H_j = G_j + ratios H_j+1
    rounded = None if out_dtype is None else h.to(out_dtype)
    grad = None if rounded is None else rounded[:n, :cols].contiguous()
    if not radial:
        return grad, following, None, None
    one_width = running["previous"] is None and following is None  # the rounded G; a prefix's radial sums take G
    radial_g = rounded.to(acc) if one_width else g
    term = torch.where(ok & (g != 0), radial_g * torch.where(ok, v, 0.0), torch.zeros_like(g))
    return grad, following, *grid.radial(term)


# ----------------------------------------------------------------------------------------------------------
# The binding
# ----------------------------------------------------------------------------------------------------------
def _tiles(dots, row_inv, col_inv, row_unscale, filter_dots, filter_row_inv, filter_col_inv, threshold, row0,
           target_offset, period, scale, penalty, exclude, penalty_on, filter_keeps_target) -> dict:
    n_rows, cols = dots.shape
    assert dots.dtype in (torch.float32, torch.float64) and dots.stride(1) == 1
    assert 0 <= row0 and row0 + n_rows <= row_inv.numel() and col_inv.numel() == cols
    for vector in (row_inv, col_inv, row_unscale):
        assert vector.dtype == dots.dtype and vector.is_contiguous()
    kind = "separate" if filter_dots is not None else "own" if threshold is not None else "none"
    if kind == "separate":
        assert filter_dots.shape == dots.shape and filter_dots.dtype == threshold.dtype == filter_row_inv.dtype
    if kind == "own":
        assert threshold.dtype == dots.dtype
    return dict(dots=dots, row_inv=row_inv, col_inv=col_inv, row_unscale=row_unscale, filter=kind,
                filter_dots=filter_dots, filter_row_inv=filter_row_inv, filter_col_inv=filter_col_inv,
                threshold=threshold, filter_keeps_target=filter_keeps_target and kind != "none", row0=row0,
                n_rows=n_rows, cols=cols, target_offset=target_offset, period=period, scale=scale, penalty=penalty,
                exclude=exclude, penalty_on="none" if penalty == 0.0 else penalty_on)


def emulated_stats(*args):
    return _stats_kernel(_tiles(*args))


def emulated_grad(dots, row_inv, col_inv, row_unscale, filter_dots, filter_row_inv, filter_col_inv, threshold, top,
                  log_sum, coef, running, row_ratio, col_ratio, row0, target_offset, period, scale, penalty, exclude,
                  penalty_on, filter_keeps_target, radial, keep_running, operand_dtype):
    t = _tiles(dots, row_inv, col_inv, row_unscale, filter_dots, filter_row_inv, filter_col_inv, threshold, row0,
               target_offset, period, scale, penalty, exclude, penalty_on, filter_keeps_target)
    for state in (top, log_sum, coef):
        assert state.shape == (row_inv.numel(),) and state.dtype == dots.dtype
    return grad_binding(lambda running, radial, out_dtype: _grad_kernel(t, top, log_sum, coef, running, radial,
                                                                        out_dtype),
                        dots, row_inv, col_inv, running, row_ratio, col_ratio, radial, keep_running, operand_dtype)


@pytest.fixture
def emulated(monkeypatch):
    """The CUDA op's orchestration on CPU with the kernels' models, row blocks of at most 20 rows (several blocks,
    each with a partial 16-row gradient tile)."""
    monkeypatch.setattr(cuda_lse, "_stats", emulated_stats)
    monkeypatch.setattr(cuda_lse, "_grad", emulated_grad)
    monkeypatch.setattr(cuda_lse, "MAX_BLOCK_ROWS", 20)
    return cuda_lse.similarity_lse


def _call(op, kwargs):
    """The op on (q, c) with the case's options, through the contract's checks as dispatch calls it (the filter's
    threshold in its compute dtype; the op function with its code path, as a backend held to it calls it);
    own_filter=True: the filter is the call's own q and c."""
    def run(q, c):
        options = dict(kwargs)
        if options.pop("own_filter", False):
            options.update(filter_q=q.detach(), filter_c=c.detach())
        options = {"filter_q": None, "filter_c": None, "filter_threshold": None, **options}
        args = check_similarity_lse(q, c, **options).args
        return op(*args, path=cuda_lse.code_path(*args))
    return run


def _is_self_filter(name: str) -> bool:
    return "self_filter" in CASES[name][3]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_emulated_kernels_against_the_reference(emulated, name, dtype):
    q, c, kwargs = _inputs(name, dtype)
    if not torch.isfinite(float64_ops.similarity_lse(q.double(), c.double(), **kwargs)).all():
        pytest.skip("a row keeps no column in this dtype's draw (test_emulated_rows_that_keep_no_column)")
    ours = dict(kwargs)
    if _is_self_filter(name):  # the filter is the op's own q and c (the very tensors), as the losses pass them
        ours.update(own_filter=True)
        ours.pop("filter_q"), ours.pop("filter_c")
    check_against_oracle(_call(emulated, ours), lambda q, c: float64_ops.similarity_lse(q, c, **kwargs), [q, c],
                         f"{name} {dtype}")


def test_emulated_rows_that_keep_no_column(emulated):
    """Rows whose every column is filtered: lse -inf, no gradient from them, no NaN; the other rows exact."""
    q, c, kwargs = _inputs("guided_no_target_kept", torch.float64)
    kwargs["filter_threshold"] = kwargs["filter_threshold"].clone()
    kwargs["filter_threshold"][[1, 4]] = -2.0
    weights = torch.linspace(0.5, 1.5, q.shape[0], dtype=torch.float64)
    leaves, exact_leaves = [leaf_like(q), leaf_like(c)], [leaf_like(q), leaf_like(c)]
    lse = _call(emulated, kwargs)(*leaves)
    exact = float64_ops.similarity_lse(*exact_leaves, **kwargs)
    for out, x in ((lse, leaves), (exact, exact_leaves)):
        torch.where(torch.isfinite(out), out, torch.zeros_like(out)).mul(weights).sum().backward()
    empty = torch.isneginf(exact.detach())
    assert empty[[1, 4]].all() and not empty.all()
    assert torch.equal(torch.isneginf(lse.detach()), empty)
    assert_close(lse.detach()[~empty], exact.detach()[~empty], 1e-10, "finite rows")
    for ours, ref, what in zip(leaves, exact_leaves, ("dq", "dc")):
        assert torch.isfinite(ours.grad).all(), what
        assert_close(ours.grad, ref.grad, 1e-8, what)
    assert torch.count_nonzero(leaves[0].grad[empty]) == 0


@pytest.mark.parametrize("dtype, magnitude", HUGE_OP_MAGNITUDES, ids=[huge_magnitude_id(c) for c in HUGE_OP_MAGNITUDES])
@pytest.mark.parametrize("name", ["everything", "false_negative_filter"])
def test_emulated_huge_rows(emulated, name, dtype, magnitude):
    """Cosines of rows around 1.8e19 (float32, bfloat16) and 1e300 (float64) mixed with ordinary ones, in q, c and
    a filter's embeddings: the scaled rows' dots, the kernels' inverse norms of scaled rows, the backward's unit
    rows and the scales applied at the end give the oracle's values and gradients of the ordinary rows."""
    q, c, kwargs = _inputs(name, dtype)
    options = dict(kwargs)
    for key in ("filter_q", "filter_c"):
        if key in options and name != "false_negative_filter":
            guide = options[key]
            options[key] = guide * huge_row_factors(guide, magnitude if guide.dtype == torch.float64 else 2.0**100)
    if name == "false_negative_filter":
        options.pop("filter_q"), options.pop("filter_c")
        options.update(own_filter=True)

    def huge(x):
        return x * huge_row_factors(x, magnitude)

    def ours(q, c):
        return _call(emulated, options)(huge(q), huge(c))

    check_against_oracle(ours, lambda q, c: float64_ops.similarity_lse(q, c, **kwargs), [q, c],
                         f"{name} {dtype} x{magnitude:g}")


@pytest.mark.parametrize("dtype, magnitude", [(torch.float32, 2.0**40), (torch.bfloat16, 2.0**40),
                                              (torch.float64, 2.0**400)], ids=str)
def test_emulated_huge_dot_products(emulated, dtype, magnitude):
    """Raw dot products of huge rows (most rows of q and c times `magnitude`, every fifth not) with a scale that
    brings the logits back to size, and a filter on the model's own scores: the tiles' dots of the scaled rows, the
    scores in their anchor row's scale (1 / s_j on the columns, the threshold times s_i), the logits brought back by
    1 / s_i, against the float64 oracle on the same rows."""
    q, c, kwargs = _inputs("dot_everything", dtype)
    q, c = q * huge_row_factors(q, magnitude), c * huge_row_factors(c, magnitude)
    dots = q.double() @ c.double().T  # the filter drops about the top fifth of each row's columns
    kwargs.update(scale=0.3 / magnitude**2, penalty=0.2 / magnitude**2, filter_q=None, filter_c=None, own_filter=True,
                  filter_threshold=torch.quantile(dots, 0.8, dim=1).float())
    oracle_kwargs = {k: v for k, v in kwargs.items() if k != "own_filter"}
    oracle_kwargs.update(filter_q=q, filter_c=c)
    exact = float64_ops.similarity_lse(q.double(), c.double(), **oracle_kwargs)
    assert torch.isfinite(exact).all()
    check_against_oracle(_call(emulated, kwargs), lambda q, c: float64_ops.similarity_lse(q, c, **oracle_kwargs),
                         [q, c], f"huge dots {dtype}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("name", list(DIMS_CASES))
def test_emulated_dims_against_the_reference(emulated, name, dtype):
    """dims: the prefixes' tiles as running sums of slice products, the statistics per prefix, and backward's running
    sum H_j from the widest prefix down (the kernel's DenseRunning), each slice's products in its prefix's frame and
    every prefix's radial terms, against the oracle's calls on the truncated inputs."""
    q, c, kwargs = _dims_inputs(name, dtype)
    if not torch.isfinite(float64_ops.similarity_lse(q.double(), c.double(), **kwargs)).all():
        pytest.skip("a row keeps no column in this dtype's draw")
    ours = dict(kwargs)
    if _is_self_filter(name):
        ours.update(own_filter=True)
        ours.pop("filter_q"), ours.pop("filter_c")
    check_against_oracle(_call(emulated, ours), lambda q, c: float64_ops.similarity_lse(q, c, **kwargs), [q, c],
                         f"{name} {dtype} dims")


@pytest.mark.parametrize("dtype, magnitude", HUGE_OP_MAGNITUDES, ids=[huge_magnitude_id(c) for c in HUGE_OP_MAGNITUDES])
@pytest.mark.parametrize("name", ["everything", "several_tiles"])
def test_emulated_dims_huge_rows(emulated, name, dtype, magnitude):
    """dims with huge rows: one scale per row for all its prefixes, each prefix's norms of the scaled rows."""
    q, c, kwargs = _dims_inputs(name, dtype)
    if not torch.isfinite(float64_ops.similarity_lse(q.double(), c.double(), **kwargs)).all():
        pytest.skip("a row keeps no column in this dtype's draw")
    options = dict(kwargs)
    for key in ("filter_q", "filter_c"):
        if key not in options:
            continue
        guide = options[key]
        options[key] = guide * huge_row_factors(guide, magnitude if guide.dtype == torch.float64 else 2.0**100)

    def ours(q, c):
        return _call(emulated, options)(q * huge_row_factors(q, magnitude), c * huge_row_factors(c, magnitude))

    check_against_oracle(ours, lambda q, c: float64_ops.similarity_lse(q, c, **kwargs), [q, c],
                         f"{name} dims {dtype} x{magnitude:g}")


@pytest.mark.parametrize("name", ["dot_query_to_doc", "guided", "false_negative_filter"])
def test_emulated_dims_narrower_than_the_rows(emulated, name):
    """dims ending short of D: the columns past the widest prefix get no gradient (cosines and dot products, the
    filter cut alike), and the prefixes' values are the oracle's."""
    q, c, kwargs = _inputs(name, torch.float64)
    dims = (3, 17, 29)
    if "filter_q" in kwargs:
        kwargs["filter_threshold"] = torch.stack([kwargs["filter_threshold"] - 0.1] * len(dims))
    kwargs["dims"] = dims
    if not torch.isfinite(float64_ops.similarity_lse(q, c, **kwargs)).all():
        pytest.skip("a row keeps no column in this draw")
    ours = dict(kwargs)
    if _is_self_filter(name):
        ours.update(own_filter=True)
        ours.pop("filter_q"), ours.pop("filter_c")
    check_against_oracle(_call(emulated, ours), lambda q, c: float64_ops.similarity_lse(q, c, **kwargs), [q, c],
                         f"{name} dims {dims}")


def test_emulated_blocks_of_five_rows(emulated, monkeypatch):
    """Row blocks smaller than a gradient tile, with every option on (row0 > 0 in every index)."""
    monkeypatch.setattr(cuda_lse, "MAX_BLOCK_ROWS", 5)
    q, c, kwargs = _inputs("everything", torch.float64)
    check_against_oracle(_call(emulated, kwargs), lambda q, c: float64_ops.similarity_lse(q, c, **kwargs), [q, c],
                         "everything, blocks of 5 rows")


def test_the_model_reads_the_kernels_constants():
    assert STATS_THREADS % WARP == 0 and GRAD_COLS % WARP == 0 and GRAD_ROWS >= 1
    assert re.search(r"constexpr int kLseGradThreads = kLseGradCols;", CU)


@pytest.fixture
def emulated_on_cpu():
    """The kernels' models registered as the ops' CPU kernels (torch.library), so that the real ops dispatch to them:
    what torch.compile traces through the fake implementations and then runs."""
    lib = torch.library.Library("angle_kernels", "IMPL")
    lib.impl("cuda_similarity_lse_stats", emulated_stats, "CPU")
    lib.impl("cuda_similarity_lse_grad", emulated_grad, "CPU")
    yield
    lib._destroy()


@pytest.mark.parametrize("dims, own_filter", [((8, 16), False), (None, True)], ids=["dims_guided", "own_filter"])
def test_compiled_fullgraph_equals_eager(emulated_on_cpu, dims, own_filter):
    """torch.compile(fullgraph=True) captures the op, forward and backward, in one graph (the ops' fake
    implementations, the autograd function, the column slices of dims) and computes what eager does."""
    gen = torch.Generator().manual_seed(5)
    q, c = (torch.randn(n, 16, generator=gen).to(torch.bfloat16) for n in (10, 14))
    guide = [torch.randn(n, 16, generator=gen) for n in (10, 14)]
    threshold = torch.full((10,) if dims is None else (len(dims), 10), 0.3)

    def loss(q, c):
        fq, fc = (q.detach(), c.detach()) if own_filter else guide
        return cuda_lse.similarity_lse(q, c, 20.0, 0, 7, "own", 1.0, "other", fq, fc, threshold, True, True,
                                       dims).sum()

    results = []
    for fn in (loss, torch.compile(loss, fullgraph=True, backend="aot_eager")):
        leaves = [leaf_like(q), leaf_like(c)]
        value = fn(*leaves)
        value.backward()
        results.append((value.detach(), leaves[0].grad, leaves[1].grad))
    for eager, compiled in zip(*results):
        assert_close(compiled.double(), eager.double(), 1e-6, "compiled against eager")
