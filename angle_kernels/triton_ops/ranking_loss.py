"""The CoSENT ranking term and its gradient in Triton, exact, in O(N) memory.

    L = log(1 + S),   S = sum over (i, j) with label_i < label_j of exp(s_i - s_j)

S factorises as sum_j exp(-s_j + log A_j) with log A_j = logsumexp_{i: label_i < label_j} s_i, and the
gradient needs the mirror image log B_k = logsumexp_{j: label_j > label_k} (-s_j):

    dL/ds_k = exp(s_k + log B_k - L) - exp(log A_k - s_k - L)

Both exponentials are shares of S / (1 + S), at most 1: nothing overflows at any tau. Ties (strict
inequality) contribute nothing; all labels equal gives log S = -inf and L = 0 exactly.

Two ways to get log A and log B:

* Large N (sort path): sort by label once (torch.sort, stable), then log A at sorted position p is the
  inclusive log-space prefix sum of s read just before p's tie group, and log B the inclusive suffix sum of
  -s read just after it (group bounds from torch.searchsorted on the sorted labels). The N-length scans run
  in float64: in float32 they drift at large N (gradient error 4e-5 at 1M pairs, 7e-4 at 16M), in float64
  they are exact to rounding at no measurable cost (they are bandwidth-trivial). They are a classic
  three-phase parallel scan: `_ranking_block_scan_kernel` scans each BLOCK of positions locally and writes
  the block totals; the (N / BLOCK)-long scan of the totals is a tiny torch.logcumsumexp; then
  `_ranking_gather_fwd_kernel` combines a local scan value with its block's carry at the two group bounds,
  writes log A, log B and a per-block logsumexp of log A - s (the loss's partial sums).
* Small N (tiled path): `_ranking_pairwise_fwd_kernel` compares each block of rows against every column
  block, with an online (running-max) logsumexp per row, in O(N^2) time and O(N) memory: one launch, no
  sort. For fp32 scores it exponentiates in fp32 (MUFU rate); the sums are at most N <= 4096 terms long.
  Its error is that of fp32 exponentials of score differences: about |s| x 1e-7 relative (gradient error
  4e-6 measured at N = 300 with tau = 20 scores), well inside the fp32 tolerance of 1e-4. float64 scores are
  exponentiated in float64.

`_ranking_bwd_kernel` then writes the gradient in one elementwise pass (scattering through the sort order).

The floor: the op reads N scores and labels and writes N gradients: bytes are negligible; for large N the
time is torch.sort (a radix sort, a few passes over 12-16 bytes per element), for small N it is launch
latency. Hence the crossover below.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch.autograd.function import once_differentiable

from ._common import CompileCase, new_output

# Crossover between the tiled O(N^2) launch and the sort path. NOT MEASURED (no GPU was available when it
# was written): it must be measured on a GPU with bench/gpu_suite.py and updated. The reasoning behind the
# value: the sort path costs about nine small launches (sort, gather, two searchsorted, two scan kernels, a
# tiny logcumsumexp, a logsumexp, the gather kernel), about 40 us when latency-bound; the tiled path costs
# 2 N^2 exponentials at about 132 SMs x 16 per clock x 1.98 GHz (plus as many compare/select/FMA), roughly
# N^2 / 1e12 s: 17 us at N = 4096, 67 us at 8192. They meet around N = 6000; 4096 keeps a margin.
SMALL_N_MAX = 4096
# The code paths a call can take, each verified on GPUs on its own (angle_kernels.verified).
PATHS = ("pairwise", "sort")


def code_path(scores, labels) -> str:
    """The one of PATHS that computes this call: the pairwise tiles up to SMALL_N_MAX scores, else sort and scan."""
    return "pairwise" if scores.shape[0] <= SMALL_N_MAX else "sort"


_PAIRWISE_BLOCK_ROWS = 32
_PAIRWISE_BLOCK_COLS = 128
# 16 elements per thread per [32, 128] tile. Compiled for sm_90: 128 registers (fp32 scores) / 248 (fp64),
# no spills; with 4 warps the same tile needs 254 / 255 registers and fp64 spills 384 bytes.
_PAIRWISE_WARPS = 8
_SCAN_BLOCK = 1024
_BWD_BLOCK = 1024


@triton.jit
def _lse_combine(x, y):
    """log(exp(x) + exp(y)), with -inf as the empty sum (associative: usable in tl.associative_scan)."""
    top = tl.maximum(x, y)
    safe_top = tl.where(top == float("-inf"), 0.0, top)
    return safe_top + tl.log(tl.exp(x - safe_top) + tl.exp(y - safe_top))


@triton.jit
def _ranking_pairwise_fwd_kernel(
    scores_ptr,  # [N], float32 or float64
    labels_ptr,  # [N], any real dtype
    log_a_ptr,  # [N] float64 out: logsumexp of s_i over label_i < label_row
    log_b_ptr,  # [N] float64 out: logsumexp of -s_j over label_j > label_row
    partial_ptr,  # [cdiv(N, BLOCK_ROWS)] float64 out: logsumexp over the block's rows of log_a - s
    N,
    ACC: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    row_ok = rows < N
    row_label = tl.load(labels_ptr + rows, mask=row_ok, other=0)
    row_score = tl.load(scores_ptr + rows, mask=row_ok, other=0.0).to(ACC)

    max_a = tl.full([BLOCK_ROWS], float("-inf"), ACC)
    sum_a = tl.zeros([BLOCK_ROWS], ACC)
    max_b = tl.full([BLOCK_ROWS], float("-inf"), ACC)
    sum_b = tl.zeros([BLOCK_ROWS], ACC)
    for start in range(0, N, BLOCK_COLS):
        cols = start + tl.arange(0, BLOCK_COLS).to(tl.int64)
        col_ok = cols < N
        col_label = tl.load(labels_ptr + cols, mask=col_ok, other=0)
        col_score = tl.load(scores_ptr + cols, mask=col_ok, other=0.0).to(ACC)
        smaller = (col_label[None, :] < row_label[:, None]) & col_ok[None, :]
        larger = (col_label[None, :] > row_label[:, None]) & col_ok[None, :]
        # A: sum of exp(s_col) over smaller labels, online in the running max.
        vals_a = tl.where(smaller, col_score[None, :], float("-inf"))
        new_max_a = tl.maximum(max_a, tl.max(vals_a, axis=1))
        safe_a = tl.where(new_max_a == float("-inf"), 0.0, new_max_a)
        sum_a = sum_a * tl.exp(max_a - safe_a) + tl.sum(tl.exp(vals_a - safe_a[:, None]), axis=1)
        max_a = new_max_a
        # B: sum of exp(-s_col) over larger labels.
        vals_b = tl.where(larger, -col_score[None, :], float("-inf"))
        new_max_b = tl.maximum(max_b, tl.max(vals_b, axis=1))
        safe_b = tl.where(new_max_b == float("-inf"), 0.0, new_max_b)
        sum_b = sum_b * tl.exp(max_b - safe_b) + tl.sum(tl.exp(vals_b - safe_b[:, None]), axis=1)
        max_b = new_max_b

    # An empty sum (no smaller / larger label) is log 0 = -inf; log(1) in the unused branch avoids log(0).
    log_a = tl.where(sum_a > 0, max_a + tl.log(tl.where(sum_a > 0, sum_a, 1.0)), float("-inf"))
    log_b = tl.where(sum_b > 0, max_b + tl.log(tl.where(sum_b > 0, sum_b, 1.0)), float("-inf"))
    log_a = log_a.to(tl.float64)
    log_b = log_b.to(tl.float64)
    tl.store(log_a_ptr + rows, log_a, mask=row_ok)
    tl.store(log_b_ptr + rows, log_b, mask=row_ok)
    terms = tl.where(row_ok, log_a - row_score.to(tl.float64), float("-inf"))
    tl.store(partial_ptr + pid, tl.reduce(terms, 0, _lse_combine))


@triton.jit
def _ranking_block_scan_kernel(
    sorted_scores_ptr,  # [N] float64, sorted by label
    local_prefix_ptr,  # [N] float64 out: inclusive log-space prefix of s within the block
    local_suffix_ptr,  # [N] float64 out: inclusive log-space suffix of -s within the block
    block_prefix_total_ptr,  # [num_blocks] out: logsumexp of s over the block
    block_suffix_total_ptr,  # [num_blocks] out: logsumexp of -s over the block
    N,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    pos = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = pos < N
    s = tl.load(sorted_scores_ptr + pos, mask=ok, other=0.0)
    up = tl.where(ok, s, float("-inf"))
    down = tl.where(ok, -s, float("-inf"))
    prefix = tl.associative_scan(up, 0, _lse_combine)
    suffix = tl.associative_scan(down, 0, _lse_combine, reverse=True)
    tl.store(local_prefix_ptr + pos, prefix, mask=ok)
    tl.store(local_suffix_ptr + pos, suffix, mask=ok)
    tl.store(block_prefix_total_ptr + pid, tl.reduce(up, 0, _lse_combine))
    tl.store(block_suffix_total_ptr + pid, tl.reduce(down, 0, _lse_combine))


@triton.jit
def _ranking_gather_fwd_kernel(
    sorted_scores_ptr,  # [N] float64
    group_start_ptr,  # [N] int64: first sorted position of this position's tie group
    group_end_ptr,  # [N] int64: one past its last
    local_prefix_ptr,
    local_suffix_ptr,
    carry_prefix_ptr,  # [num_blocks] float64: logsumexp of s over all blocks before block b
    carry_suffix_ptr,  # [num_blocks] float64: logsumexp of -s over all blocks after block b
    log_a_ptr,  # [N] float64 out (sorted order)
    log_b_ptr,  # [N] float64 out (sorted order)
    partial_ptr,  # [num_blocks] float64 out
    N,
    SCAN_BLOCK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pid = tl.program_id(0)
    pos = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = pos < N
    s = tl.load(sorted_scores_ptr + pos, mask=ok, other=0.0)
    start = tl.load(group_start_ptr + pos, mask=ok, other=0)
    end = tl.load(group_end_ptr + pos, mask=ok, other=N)
    # log A: global inclusive prefix at start - 1 = carry of its scan block combined with the local value.
    has_a = ok & (start > 0)
    a_pos = tl.where(has_a, start - 1, 0)
    a_local = tl.load(local_prefix_ptr + a_pos, mask=has_a, other=float("-inf"))
    a_carry = tl.load(carry_prefix_ptr + a_pos // SCAN_BLOCK, mask=has_a, other=float("-inf"))
    log_a = tl.where(has_a, _lse_combine(a_local, a_carry), float("-inf"))
    # log B: global inclusive suffix at end.
    has_b = ok & (end < N)
    b_pos = tl.where(has_b, end, 0)
    b_local = tl.load(local_suffix_ptr + b_pos, mask=has_b, other=float("-inf"))
    b_carry = tl.load(carry_suffix_ptr + b_pos // SCAN_BLOCK, mask=has_b, other=float("-inf"))
    log_b = tl.where(has_b, _lse_combine(b_local, b_carry), float("-inf"))
    tl.store(log_a_ptr + pos, log_a, mask=ok)
    tl.store(log_b_ptr + pos, log_b, mask=ok)
    terms = tl.where(ok, log_a - s, float("-inf"))
    tl.store(partial_ptr + pid, tl.reduce(terms, 0, _lse_combine))


@triton.jit
def _ranking_bwd_kernel(
    scores_ptr,  # [N] float64 (sorted order on the sort path)
    log_a_ptr,
    log_b_ptr,
    order_ptr,  # [N] int64: original index of each position (read only HAS_ORDER)
    loss_ptr,  # 0-dim float64: L
    grad_loss_ptr,  # 0-dim: upstream gradient
    grad_ptr,  # [N] out, scores' dtype, original order
    N,
    HAS_ORDER: tl.constexpr,
    BLOCK: tl.constexpr,
):
    pos = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = pos < N
    loss = tl.load(loss_ptr)
    grad_loss = tl.load(grad_loss_ptr).to(tl.float64)
    s = tl.load(scores_ptr + pos, mask=ok, other=0.0)
    log_a = tl.load(log_a_ptr + pos, mask=ok, other=float("-inf"))
    log_b = tl.load(log_b_ptr + pos, mask=ok, other=float("-inf"))
    grad = (tl.exp(s + log_b - loss) - tl.exp(log_a - s - loss)) * grad_loss
    if HAS_ORDER:
        dest = tl.load(order_ptr + pos, mask=ok, other=0)
    else:
        dest = pos
    tl.store(grad_ptr + dest, grad.to(grad_ptr.dtype.element_ty), mask=ok)


def _log_sums_tiled(scores: torch.Tensor, labels: torch.Tensor):
    n = scores.shape[0]
    log_a = new_output((n,), torch.float64, scores.device)
    log_b = new_output((n,), torch.float64, scores.device)
    blocks = triton.cdiv(n, _PAIRWISE_BLOCK_ROWS)
    partial = new_output((blocks,), torch.float64, scores.device)
    acc = tl.float64 if scores.dtype == torch.float64 else tl.float32
    _ranking_pairwise_fwd_kernel[(blocks,)](
        scores, labels, log_a, log_b, partial, n,
        ACC=acc, BLOCK_ROWS=_PAIRWISE_BLOCK_ROWS, BLOCK_COLS=_PAIRWISE_BLOCK_COLS, num_warps=_PAIRWISE_WARPS,
    )
    return log_a, log_b, partial


def _log_sums_sorted(scores64: torch.Tensor, labels: torch.Tensor):
    n = scores64.shape[0]
    device = scores64.device
    sorted_labels, order = torch.sort(labels, stable=True)
    sorted_scores = scores64[order].contiguous()
    group_start = torch.searchsorted(sorted_labels, sorted_labels, right=False)
    group_end = torch.searchsorted(sorted_labels, sorted_labels, right=True)

    scan_blocks = triton.cdiv(n, _SCAN_BLOCK)
    local_prefix = new_output((n,), torch.float64, device)
    local_suffix = new_output((n,), torch.float64, device)
    prefix_totals = new_output((scan_blocks,), torch.float64, device)
    suffix_totals = new_output((scan_blocks,), torch.float64, device)
    _ranking_block_scan_kernel[(scan_blocks,)](
        sorted_scores, local_prefix, local_suffix, prefix_totals, suffix_totals, n,
        BLOCK=_SCAN_BLOCK, num_warps=8,
    )
    # Exclusive carries: block b's prefix carry sums blocks < b, its suffix carry blocks > b.
    neg_inf = torch.full((1,), float("-inf"), dtype=torch.float64, device=device)
    carry_prefix = torch.cat([neg_inf, torch.logcumsumexp(prefix_totals, 0)[:-1]])
    carry_suffix = torch.cat([torch.logcumsumexp(suffix_totals.flip(0), 0).flip(0)[1:], neg_inf])

    log_a = new_output((n,), torch.float64, device)
    log_b = new_output((n,), torch.float64, device)
    gather_blocks = triton.cdiv(n, _SCAN_BLOCK)
    partial = new_output((gather_blocks,), torch.float64, device)
    _ranking_gather_fwd_kernel[(gather_blocks,)](
        sorted_scores, group_start, group_end, local_prefix, local_suffix, carry_prefix, carry_suffix,
        log_a, log_b, partial, n, SCAN_BLOCK=_SCAN_BLOCK, BLOCK=_SCAN_BLOCK, num_warps=8,
    )
    return sorted_scores, order, log_a, log_b, partial


class RankingLossFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: torch.Tensor, labels: torch.Tensor):
        n = scores.shape[0]
        ctx.out_dtype = scores.dtype
        if n == 0:
            ctx.empty = True
            return torch.zeros((), dtype=scores.dtype, device=scores.device)
        ctx.empty = False
        scores = scores.detach().contiguous()
        labels = labels.detach().contiguous()
        if code_path(scores, labels) == "pairwise":
            log_a, log_b, partial = _log_sums_tiled(scores, labels)
            kept_scores, order = scores.to(torch.float64), None
        else:
            kept_scores, order, log_a, log_b, partial = _log_sums_sorted(scores.to(torch.float64), labels)
        log_s = torch.logsumexp(partial, dim=0)  # -inf when no pair has label_i < label_j
        loss = torch.logaddexp(log_s, torch.zeros_like(log_s))  # log(1 + S)
        ctx.save_for_backward(kept_scores, log_a, log_b, loss, order)
        return loss.to(scores.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor):
        if ctx.empty:
            return torch.zeros(0, dtype=ctx.out_dtype, device=grad_loss.device), None
        kept_scores, log_a, log_b, loss, order = ctx.saved_tensors
        n = kept_scores.shape[0]
        grad = new_output((n,), ctx.out_dtype, kept_scores.device)
        has_order = order is not None
        _ranking_bwd_kernel[(triton.cdiv(n, _BWD_BLOCK),)](
            kept_scores, log_a, log_b, order if has_order else log_a, loss, grad_loss.contiguous(), grad, n,
            HAS_ORDER=has_order, BLOCK=_BWD_BLOCK, num_warps=4,
        )
        return grad, None


def ranking_loss(scores: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log(1 + sum_{label_i < label_j} exp(s_i - s_j)); see angle_kernels.dispatch for the contract."""
    return RankingLossFunction.apply(scores, labels)


# ----------------------------------------------------------------------------------------------------------
# The specialisations CI compiles for sm_90 without a GPU (triton_ops._compile_check)
# ----------------------------------------------------------------------------------------------------------
def compile_cases(full: bool) -> list[CompileCase]:
    """Every kernel for float32 and float64 scores (the scans work in float64 either way); `full` adds nothing."""
    del full
    index_pointers = {"order_ptr": "i64", "group_start_ptr": "i64", "group_end_ptr": "i64"}
    cases = []
    for scores_dtype, acc in (("fp32", tl.float32), ("fp64", tl.float64)):
        cases.append(CompileCase(
            _ranking_pairwise_fwd_kernel, f"scores={scores_dtype}", "fp64",
            dict(ACC=acc, BLOCK_ROWS=_PAIRWISE_BLOCK_ROWS, BLOCK_COLS=_PAIRWISE_BLOCK_COLS), _PAIRWISE_WARPS,
            pointers={"scores_ptr": scores_dtype, "labels_ptr": "i64"}))
        cases.append(CompileCase(_ranking_bwd_kernel, f"grad={scores_dtype}", "fp64",
                                 dict(HAS_ORDER=True, BLOCK=_BWD_BLOCK), 4,
                                 pointers={**index_pointers, "grad_ptr": scores_dtype}))
    cases.append(CompileCase(_ranking_block_scan_kernel, "fp64", "fp64", dict(BLOCK=_SCAN_BLOCK), 8))
    cases.append(CompileCase(_ranking_gather_fwd_kernel, "fp64", "fp64",
                             dict(SCAN_BLOCK=_SCAN_BLOCK, BLOCK=_SCAN_BLOCK), 8, pointers=index_pointers))
    return cases
