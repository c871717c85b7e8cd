"""A CPU model of the CUDA dense similarity_xent tile kernels (csrc/similarity_xent_dense.cu), under the real
orchestration.

The CUDA backend's dense similarity_xent scheme (angle_kernels/cuda_ops/similarity_xent_dense.py: its paths "dense"
and "dense_dims") makes the dot-product tiles with torch products and hands each row block to two ops,
cuda_similarity_xent_dense_stats and cuda_similarity_xent_dense_grad. Here those two ops are replaced
(monkeypatched at the module's `_stats` and `_grad`) by PyTorch transcriptions of their kernels and binding, and the
op (through the backend's op module, similarity_xent_paths, on the path it names) is checked against
angle_kernels.float64_ops.similarity_xent (float64; with dims, its k calls on the truncated inputs) on CPU tensors,
forward and backward, for every option of the contract (partner and diagonal targets, exclude_diagonal, group ids,
the margin, row weights, c None or given), odd shapes, several row blocks, huge rows, and float64 / float32 /
bfloat16 / float16 inputs. What each part mirrors in csrc/similarity_xent_dense.cu:

    _logit          xent_row and xent_logit: the cosine P row_inv col_inv, the target (i ^ 1 or i), the diagonal
                    left out, the target's margin logit (margin_logit: the clamped sin through rsqrt, pinned at -1
                    past pi, its slope), the positives (target, or a column of C_i in i's or t_i's group, a target
                    past the rows counting as group 0).
    _stats_kernel   _xent_dense_stats_kernel: one block per row (vectorised over the blocks), thread x reading
                    columns x, x + 256, ..., its online states over C_i and P_i (OnlineLse.add) and its target logit,
                    the warp's butterfly merge (offsets 16 .. 1: OnlineLse.merge_lanes, warp_sum), thread 0 merging
                    the 8 warps' in order, and max + log(max(sum, 1)) (the target logit without groups).
    _grad_kernel    _xent_dense_grad_kernel: the grid of 256-column by 16-row tiles (the rows' state staged in shared
                    memory per block: the same values, read from the vectors here), the element's G (softmax over C_i
                    minus that over P_i or the target's 1, times coef, scale and the margin's slope, 0 off C_i), with
                    dims the running sum R = G + ratios R_previous (DenseRunning) and its fp32 copy, the rounding to
                    the operand type, the radial terms G cos, each thread's column sum in row order, each row's warp
                    sums (butterfly) and the 8 warps' sum in order, and the per-tile partials.
    _stats, _grad   the binding (csrc/similarity_xent_dense.cpp): its checks of shapes, dtypes and contiguity, the
                    target's parsing, cos and sin of the margin in double, the partials reduced over the tiles
                    (at::sum), zeros without radial sums, the [0] results (no running sum; no rounded copy of an fp32
                    running sum).

The accumulation types are the kernels' (float32, float64 for float64 inputs) and the thread and block counts are
read from the .cu file and its types header. It is a model of the kernels, not a proof: CUDA's expf, logf and
rsqrtf, the compiler's fused multiply-adds, the real reduction hardware, memory accesses out of bounds and races
are not modelled (the GPU run's tests and `angle_kernels.verify` check those). The torch products are the real
orchestration's, on CPU (16-bit operands converted to fp32 first: the same values and accumulation).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from angle_kernels import float64_ops
from angle_kernels.contract import MARGIN_SIN_SQUARED_FLOOR, check_similarity_xent
from angle_kernels.cuda_ops import similarity_xent_dense as cuda_dense
from angle_kernels.cuda_ops import similarity_xent_paths
from angle_kernels.testing.helpers import HUGE_OP_MAGNITUDES, check_against_oracle, huge_magnitude_id, huge_row_factors
from dense_tile_models import NEG_INF, WARP, GradGrid, constant, grad_binding
from test_similarity_xent import CASES, DIMS_CASES, _dims_inputs, _inputs

CSRC = Path(__file__).resolve().parents[2] / "csrc"
CU = (CSRC / "similarity_xent_dense.cu").read_text()
TYPES = (CSRC / "similarity_xent_dense_types.h").read_text()


STATS_THREADS = constant(CU, "kXentStatsThreads")
GRAD_ROWS, GRAD_COLS = constant(TYPES, "kXentGradRows"), constant(TYPES, "kXentGradCols")
SIN_SQ_FLOOR = float(re.search(r"constexpr double kXentSinSqFloor = ([0-9.e+-]+);", CU).group(1))


# ----------------------------------------------------------------------------------------------------------
# The element: xent_row, margin_logit and xent_logit
# ----------------------------------------------------------------------------------------------------------
def _margin_logit(cos, cos_m, sin_m):
    sin_sq = 1 - cos * cos
    clamped = torch.clamp_min(sin_sq, SIN_SQ_FLOOR)
    inv_sin = torch.rsqrt(clamped)
    past_pi = cos < -cos_m
    slope = cos_m + torch.where(sin_sq > SIN_SQ_FLOOR, cos * sin_m * inv_sin, torch.zeros_like(cos))
    value = cos * cos_m - clamped * inv_sin * sin_m
    return torch.where(past_pi, -torch.ones_like(cos), value), torch.where(past_pi, torch.zeros_like(cos), slope)


def _logit(t: dict, local: torch.Tensor, col: torch.Tensor):
    """(valid, cos, logit, is_target, positive, slope) for local rows `local` [R, 1] and columns `col` [.., C] (in
    range), as xent_row and xent_logit."""
    acc = t["dots"].dtype
    row = t["row0"] + local
    target = row ^ 1 if t["partner"] else row
    cos = t["dots"][local, col] * t["row_inv"][row] * t["col_inv"][col]
    valid = ~(col == row) if t["exclude_diagonal"] else torch.ones_like(col == row)
    is_target = valid & (col == target)
    scale = torch.tensor(t["scale"], dtype=acc)
    logit = torch.where(valid, cos * scale, torch.full_like(cos, NEG_INF))
    slope = torch.ones_like(cos)
    if t["has_margin"]:
        cos_m, sin_m = torch.tensor(t["cos_m"], dtype=acc), torch.tensor(t["sin_m"], dtype=acc)
        value, target_slope = _margin_logit(cos, cos_m, sin_m)
        logit = torch.where(is_target, value * scale, logit)
        slope = torch.where(is_target, target_slope, slope)
    positive = is_target
    if t["groups"] is not None:
        groups = t["groups"]
        group_row = groups[row]
        group_target = torch.where(target < t["rows"], groups[torch.clamp_max(target, t["rows"] - 1)], 0)
        group_col = groups[col]
        positive = positive | (valid & ((group_col == group_row) | (group_col == group_target)))
    return valid, cos, logit, is_target, positive, slope


def _online_add(m, s, x, add):
    """OnlineLse.add where `add`."""
    greater = x > m
    new_s = torch.where(greater, s * torch.exp(m - x) + 1, s + torch.exp(x - m))
    return torch.where(add & greater, x, m), torch.where(add, new_s, s)


def _online_merge(m, s, other_m, other_s):
    """OnlineLse.merge."""
    top = torch.maximum(m, other_m)
    empty = top == NEG_INF
    merged = s * torch.exp(m - top) + other_s * torch.exp(other_m - top)
    return torch.where(empty, m, top), torch.where(empty, s, merged)


# ----------------------------------------------------------------------------------------------------------
# The kernels
# ----------------------------------------------------------------------------------------------------------
def _stats_kernel(t: dict):
    """_xent_dense_stats_kernel on every block at once: blocks are rows [n, 1], threads lanes [1, STATS_THREADS]."""
    acc = t["dots"].dtype
    n, cols = t["n_rows"], t["cols"]
    local = torch.arange(n)[:, None]
    lanes = torch.arange(STATS_THREADS)[None, :]
    m_all = torch.full((n, STATS_THREADS), NEG_INF, dtype=acc)
    s_all = torch.zeros((n, STATS_THREADS), dtype=acc)
    m_pos, s_pos = m_all.clone(), s_all.clone()
    target_logit = torch.zeros((n, STATS_THREADS), dtype=acc)
    col = lanes.clone()
    while bool((col < cols).any()):
        active = col < cols  # the thread's loop condition
        safe_col = torch.where(active, col, torch.zeros_like(col))
        valid, _cos, logit, is_target, positive, _slope = _logit(t, local, safe_col)
        live = active & valid
        m_all, s_all = _online_add(m_all, s_all, logit, live)
        if t["groups"] is not None:
            m_pos, s_pos = _online_add(m_pos, s_pos, logit, live & positive)
        else:
            target_logit = target_logit + torch.where(live & is_target, logit, torch.zeros_like(logit))
        col = col + STATS_THREADS
    for offset in (16, 8, 4, 2, 1):  # __shfl_xor_sync within each warp
        partner = lanes[0] ^ offset
        m_all, s_all = _online_merge(m_all, s_all, m_all[:, partner], s_all[:, partner])
        m_pos, s_pos = _online_merge(m_pos, s_pos, m_pos[:, partner], s_pos[:, partner])
        target_logit = target_logit + target_logit[:, partner]
    warps = [x[:, ::WARP] for x in (m_all, s_all, m_pos, s_pos, target_logit)]  # lane 0 of each warp
    m_all, s_all, m_pos, s_pos, target_logit = (x[:, 0] for x in warps)
    for other in range(1, STATS_THREADS // WARP):  # thread 0 merges the warps in order
        m_all, s_all = _online_merge(m_all, s_all, warps[0][:, other], warps[1][:, other])
        m_pos, s_pos = _online_merge(m_pos, s_pos, warps[2][:, other], warps[3][:, other])
        target_logit = target_logit + warps[4][:, other]
    lse_all = m_all + torch.log(torch.clamp_min(s_all, 1.0))
    lse_pos = m_pos + torch.log(torch.clamp_min(s_pos, 1.0)) if t["groups"] is not None else target_logit
    return lse_all, lse_pos


def _grad_kernel(t: dict, lse_all, lse_pos, coef, running: dict, radial: bool, out_dtype):
    """_xent_dense_grad_kernel on the whole grid at once: the tile's rows [row tiles * 16, 1] (y, k), its columns
    [1, column tiles * 256] (x, threadIdx.x). running: DenseRunning (previous, keep_next, row_ratio, col_ratio);
    out_dtype None: no rounded tile (grad null). Returns (rounded R or None, next R or None, row and column
    partials)."""
    acc = t["dots"].dtype
    grid = GradGrid(t["n_rows"], t["cols"], GRAD_ROWS, GRAD_COLS)
    n, cols, ok, safe_local, safe_col = grid.n, grid.cols, grid.ok, grid.safe_local, grid.safe_col
    valid, cos, logit, is_target, positive, slope = _logit(t, safe_local, safe_col)
    row = t["row0"] + safe_local
    live = ok & valid
    safe_logit = torch.where(live, logit, torch.zeros_like(logit))
    if t["groups"] is not None:
        p_pos = torch.where(positive, torch.exp(safe_logit - lse_pos[row]), torch.zeros_like(cos))
    else:
        p_pos = torch.where(is_target, torch.ones_like(cos), torch.zeros_like(cos))
    g = coef[row] * torch.tensor(t["scale"], dtype=acc) * (torch.exp(safe_logit - lse_all[row]) - p_pos)
    g = torch.where(is_target, g * slope, g)
    g = torch.where(live, g, torch.zeros_like(g))
    h, following = grid.fold(g, running, row)  # R_j = G_j + ratios R_j+1
    grad = None if out_dtype is None else h.to(out_dtype)[:n, :cols].contiguous()
    if not radial:
        return grad, following, None, None
    return grad, following, *grid.radial(torch.where(live, g * cos, torch.zeros_like(g)))


# ----------------------------------------------------------------------------------------------------------
# The binding
# ----------------------------------------------------------------------------------------------------------
def _tiles(dots, row_inv, col_inv, groups, row0, scale, target, exclude_diagonal, margin) -> dict:
    n_rows, cols = dots.shape
    assert dots.dtype in (torch.float32, torch.float64) and dots.stride(1) == 1 and dots.stride(0) >= cols
    assert 0 <= row0 and row0 + n_rows <= row_inv.numel() and col_inv.numel() == cols
    for vector in (row_inv, col_inv):
        assert vector.dtype == dots.dtype and vector.is_contiguous() and vector.dim() == 1
    if groups is not None:
        assert groups.dtype == torch.int64 and groups.is_contiguous() and groups.numel() == row_inv.numel() == cols
    assert target in ("partner", "diagonal")
    return dict(dots=dots, row_inv=row_inv, col_inv=col_inv, groups=groups, row0=row0, n_rows=n_rows,
                rows=row_inv.numel(), cols=cols, scale=scale, cos_m=math.cos(margin), sin_m=math.sin(margin),
                partner=target == "partner", exclude_diagonal=exclude_diagonal, has_margin=margin != 0.0)


def emulated_stats(*args):
    return _stats_kernel(_tiles(*args))


def emulated_grad(dots, row_inv, col_inv, groups, lse_all, lse_pos, coef, running, row_ratio, col_ratio, row0, scale,
                  target, exclude_diagonal, margin, radial, keep_running, operand_dtype):
    t = _tiles(dots, row_inv, col_inv, groups, row0, scale, target, exclude_diagonal, margin)
    for state in (lse_all, lse_pos, coef):
        assert state.shape == (row_inv.numel(),) and state.dtype == dots.dtype and state.is_contiguous()
    return grad_binding(lambda running, radial, out_dtype: _grad_kernel(t, lse_all, lse_pos, coef, running, radial,
                                                                        out_dtype),
                        dots, row_inv, col_inv, running, row_ratio, col_ratio, radial, keep_running, operand_dtype)


@pytest.fixture
def emulated(monkeypatch):
    """The CUDA op's orchestration on CPU with the kernels' models, row blocks of at most 20 rows (several blocks,
    each with a partial 16-row gradient tile), and the dense scheme taking one-width calls at every width."""
    monkeypatch.setattr(cuda_dense, "_stats", emulated_stats)
    monkeypatch.setattr(cuda_dense, "_grad", emulated_grad)
    monkeypatch.setattr(cuda_dense, "MAX_BLOCK_ROWS", 20)
    monkeypatch.setattr(similarity_xent_paths, "DENSE_MIN_WIDTH", 1)
    return similarity_xent_paths.similarity_xent


def _prefix_reference(q, c=None, dims=None, **kwargs):
    """The reference, or with dims its k calls on the truncated inputs, stacked: what the contract says dims is."""
    if dims is None:
        return float64_ops.similarity_xent(q, c, **kwargs)
    return torch.stack([float64_ops.similarity_xent(q[:, :d], None if c is None else c[:, :d], **kwargs) for d in dims])


def _checked(q, c, kwargs) -> tuple:
    """The op's arguments through the contract's checks, in normal form, as dispatch passes them (positional)."""
    options = dict(dict(row_weights=None, exclude_diagonal=False, margin=0.0, group_ids=None), **kwargs)
    return check_similarity_xent(q, c, **options).args


def _check(op, q, c, kwargs, what, magnitude=None):
    """The op (through the contract's checks, as dispatch calls it; on the path its selector names, which must be
    the dense scheme's) against the reference on (q, c)."""
    def huge(x):
        return x if magnitude is None else x * huge_row_factors(x, magnitude)

    def ours(q, c=None):
        args = _checked(huge(q), None if c is None else huge(c), kwargs)
        assert similarity_xent_paths.code_path(*args) == ("dense" if kwargs.get("dims") is None else "dense_dims")
        return op(*args)

    if c is None:
        return check_against_oracle(lambda q: ours(q), lambda q: _prefix_reference(q, None, **kwargs), [q], what)
    return check_against_oracle(ours, lambda q, c: _prefix_reference(q, c, **kwargs), [q, c], what)


DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(CASES))
def test_emulated_dense_against_the_reference(emulated, name, dtype):
    q, c, kwargs = _inputs(name, dtype)
    _check(emulated, q, c, kwargs, f"{name} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", sorted(DIMS_CASES))
def test_emulated_dims_against_the_reference(emulated, name, dtype):
    """dims: the prefixes' tiles as running sums of slice products, the statistics per prefix, and backward's running
    sum R_j from the widest prefix down (the kernel's DenseRunning), each slice's products in its prefix's frame and
    every prefix's radial terms, against the reference's calls on the truncated inputs."""
    q, c, kwargs = _dims_inputs(name, dtype)
    _check(emulated, q, c, kwargs, f"{name} {dtype} dims={kwargs['dims']}")


@pytest.mark.parametrize("dims", [(7,), (3, 17, 33), (2, 5, 9, 20, 33)], ids=lambda d: f"k={len(d)}")
def test_emulated_dims_one_three_and_five_prefixes(emulated, dims):
    """k = 1, 3 and 5 prefixes (the last ending at the full width or short of it) with a margin and a candidate set."""
    q, c, kwargs = _inputs("contrastive_with_negatives", torch.float64)
    kwargs.update(dims=dims, margin=math.radians(10))
    _check(emulated, q, c, kwargs, f"dims={dims}")


@pytest.mark.parametrize("dtype, magnitude", HUGE_OP_MAGNITUDES, ids=[huge_magnitude_id(c) for c in HUGE_OP_MAGNITUDES])
@pytest.mark.parametrize("name", ["in_batch_negatives", "arccon", "dims"])
def test_emulated_huge_rows(emulated, name, dtype, magnitude):
    """Rows around 1.8e19 (float32, bfloat16) and 1e300 (float64) mixed with ordinary ones: the scaled rows' dots,
    the kernels' inverse norms of scaled rows, the backward's unit rows and the scales applied at the end give the
    reference's values and gradients."""
    if name == "dims":
        q, c, kwargs = _dims_inputs("contrastive_with_negatives", dtype)
    else:
        q, c, kwargs = _inputs(name, dtype)
    _check(emulated, q, c, kwargs, f"{name} {dtype} x{magnitude:g}", magnitude=magnitude)


def test_emulated_blocks_of_five_rows(emulated, monkeypatch):
    """Row blocks smaller than a gradient tile, with every option on (row0 > 0 in every index), both paths."""
    monkeypatch.setattr(cuda_dense, "MAX_BLOCK_ROWS", 5)
    q, c, kwargs = _inputs("margin_on_partners", torch.float64)
    _check(emulated, q, c, kwargs, "blocks of 5 rows")
    _check(emulated, q, c, dict(kwargs, dims=(3, 10, 16)), "blocks of 5 rows, dims")


def test_emulated_forward_without_gradients(emulated):
    """Inputs that need no gradient: forward forms none (with_grad False) and gives the same loss."""
    q, c, kwargs = _inputs("contrastive", torch.float64)
    args = _checked(q, c, kwargs)
    assert torch.allclose(emulated(*args), float64_ops.similarity_xent(q, c, **kwargs), rtol=1e-12, atol=0)


def test_the_selector_takes_the_dense_scheme_from_its_measured_width(monkeypatch):
    """Verified and timed on an H200 (similarity_xent_paths' account): one-width calls take the dense scheme from
    DENSE_MIN_WIDTH, 768, up where its tiles fit, the fused kernels below; dims always the dense dims scheme (the
    backend's one path for them). Switched off (None), every one-width call keeps the fused kernels, and the checks'
    switch (awaiting_verification_on) turns it on at the proposed width, 768."""
    from angle_kernels import cuda_ops

    wide = torch.zeros(8, 1024)
    assert similarity_xent_paths.DENSE_MIN_WIDTH == similarity_xent_paths.PROPOSED_DENSE_MIN_WIDTH == 768
    assert not cuda_ops.paths_awaiting_verification()
    assert similarity_xent_paths.code_path(wide, None, 20.0, "partner") == "dense"
    assert similarity_xent_paths.code_path(wide[:, :768], None, 20.0, "partner") == "dense"
    assert similarity_xent_paths.code_path(wide[:, :767], None, 20.0, "partner") == "fused"
    assert similarity_xent_paths.code_path(wide[:, :8], None, 20.0, "partner", dims=(4, 8)) == "dense_dims"
    monkeypatch.setattr(similarity_xent_paths, "DENSE_MIN_WIDTH", None)
    assert similarity_xent_paths.code_path(wide, None, 20.0, "partner") == "fused"
    assert similarity_xent_paths.code_path(wide[:, :8], None, 20.0, "partner", dims=(4, 8)) == "dense_dims"
    assert ("similarity_xent", "dense") in cuda_ops.paths_awaiting_verification()
    with cuda_ops.awaiting_verification_on():
        assert similarity_xent_paths.code_path(wide, None, 20.0, "partner") == "dense"
        assert similarity_xent_paths.code_path(wide[:, :512], None, 20.0, "partner") == "fused"
        fits = int(cuda_dense.TILE_ELEMENTS // (cuda_dense.MIN_BLOCK_ROWS * 1.5))  # c's columns a block holds
        q = torch.empty(2, 1024, device="meta")
        assert similarity_xent_paths.code_path(q, torch.empty(fits, 1024, device="meta"), 20.0, "diagonal") == "dense"
        assert similarity_xent_paths.code_path(q, torch.empty(fits + 1, 1024, device="meta"), 20.0,
                                               "diagonal") == "fused"
        at = 768  # the Triton dense scheme's MIN_WIDTH: from that width on, not past it
        assert similarity_xent_paths.code_path(wide[:, :at], None, 20.0, "partner") == "dense"
        assert similarity_xent_paths.code_path(wide[:, :at - 1], None, 20.0, "partner") == "fused"
        assert not cuda_ops.paths_awaiting_verification()
    assert similarity_xent_paths.DENSE_MIN_WIDTH is None
    assert similarity_xent_paths.code_path(wide, None, 20.0, "partner") == "fused"


def test_deterministic_mode_takes_the_dense_scheme():
    """Under torch.use_deterministic_algorithms(True) a one-width call takes the dense scheme at any width (its
    reductions have a fixed order; the fused backward adds with float atomics), where its tiles fit; outside it,
    the verified fused kernels as before."""
    narrow = torch.zeros(8, 64)
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert similarity_xent_paths.code_path(narrow, None, 20.0, "partner") == "dense"
        assert similarity_xent_paths.code_path(narrow, narrow, 20.0, "diagonal") == "dense"
        assert similarity_xent_paths.code_path(narrow, None, 20.0, "partner", dims=(32, 64)) == "dense_dims"
    finally:
        torch.use_deterministic_algorithms(previous)
    assert similarity_xent_paths.code_path(narrow, None, 20.0, "partner") == "fused"


def test_the_model_reads_the_kernels_constants():
    assert STATS_THREADS % WARP == 0 and GRAD_COLS % WARP == 0 and GRAD_ROWS >= 1
    assert re.search(r"constexpr int kXentGradThreads = kXentGradCols;", CU)
    assert SIN_SQ_FLOOR == MARGIN_SIN_SQUARED_FLOOR
