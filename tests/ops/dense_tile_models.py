"""What the CPU models of the CUDA dense schemes' tile kernels (test_cuda_similarity_lse_emulation.py,
test_cuda_similarity_xent_dense_emulation.py) have in common: the constants read from the sources, the gradient
kernel's grid, its running sum over the prefixes (csrc/dense_types.h, DenseRunning) and its radial partial sums, and
the gradient binding's checks and results (csrc/dense_binding.h)."""

from __future__ import annotations

import re
from typing import Callable

import torch

from angle_kernels.cuda_ops._dense_tiles import OPERAND_DTYPES

WARP = 32
NEG_INF = float("-inf")


def constant(text: str, name: str) -> int:
    return int(re.search(rf"constexpr int {name} = (\d+);", text).group(1))


class GradGrid:
    """The gradient kernel's whole grid of grad_rows x grad_cols tiles over a [n, cols] tile: its rows
    [row tiles * grad_rows, 1] (`local`), its columns [1, column tiles * grad_cols] (`col`), which of them lie in the
    tile (`ok`), and both clamped into it (`safe_local`, `safe_col`) for the reads."""

    def __init__(self, n: int, cols: int, grad_rows: int, grad_cols: int):
        self.n, self.cols, self.grad_rows, self.grad_cols = n, cols, grad_rows, grad_cols
        self.row_tiles, self.col_tiles = -(-n // grad_rows), -(-cols // grad_cols)
        self.local = torch.arange(self.row_tiles * grad_rows)[:, None]
        self.col = torch.arange(self.col_tiles * grad_cols)[None, :]
        self.ok = (self.local < n) & (self.col < cols)
        self.safe_local = torch.where(self.local < n, self.local, 0)
        self.safe_col = torch.where(self.col < cols, self.col, 0)

    def fold(self, g: torch.Tensor, running: dict, row: torch.Tensor) -> tuple:
        """(the running sum H = G + row_ratio col_ratio H_previous, the previous sum read at the same element; its
        fresh [n_rows, cols] copy or None without keep_next)."""
        h = g
        if running["previous"] is not None:
            previous = running["previous"][self.safe_local, self.safe_col]
            col_ratio = torch.where(self.col < self.cols, running["col_ratio"][self.safe_col], 0.0)
            h = torch.where(self.ok, h + previous * running["row_ratio"][row] * col_ratio, h)
        following = h[:self.n, :self.cols].contiguous() if running["keep_next"] else None
        return h, following

    def radial(self, term: torch.Tensor) -> tuple:
        """The radial sums of `term` over the grid, as the kernel and binding form them: (per row, per column)."""
        acc = term.dtype
        per_tile = term.reshape(self.row_tiles, self.grad_rows, self.col_tiles * self.grad_cols)
        col_sum = torch.zeros((self.row_tiles, self.col_tiles * self.grad_cols), dtype=acc)
        for k in range(self.grad_rows):  # each thread's column sum, in row order
            col_sum = col_sum + per_tile[:, k]
        col_partial = col_sum[:, :self.cols]
        lanes = term.reshape(self.row_tiles * self.grad_rows, self.col_tiles, self.grad_cols // WARP, WARP)
        for offset in (16, 8, 4, 2, 1):  # warp_sum: the butterfly
            lanes = lanes + lanes[..., torch.arange(WARP) ^ offset]
        warp_sums = lanes[..., 0]  # [rows, column tiles, warps]
        row_sum = warp_sums[..., 0]
        for other in range(1, self.grad_cols // WARP):  # threads 0..15 sum the warps in order
            row_sum = row_sum + warp_sums[..., other]
        row_partial = row_sum.T[:, :self.n]  # [column tiles, n_rows]
        return row_partial.sum(0), col_partial.sum(0)  # the binding's at::sum over the tiles


def grad_binding(kernel: Callable, dots, row_inv, col_inv, running, row_ratio, col_ratio, radial: bool,
                 keep_running: bool, operand_dtype: str) -> tuple:
    """The gradient binding around kernel(running: dict, radial, out_dtype or None), which returns (rounded tile or
    None, next running sum or None, row and column radial sums or None): the operand dtype and running sum checked,
    the [0] results (no running sum; no rounded copy of a running sum in the tile's type), zeros without radial."""
    n, cols = dots.shape
    out_dtype = OPERAND_DTYPES[operand_dtype]
    assert (dots.dtype == torch.float64) == (out_dtype == torch.float64)
    assert (running is None) == (row_ratio is None) == (col_ratio is None)
    if running is not None:
        assert running.shape == dots.shape and running.is_contiguous() and running.dtype == dots.dtype
        assert row_ratio.shape == row_inv.shape and col_ratio.shape == col_inv.shape
    rounded = not keep_running or out_dtype != dots.dtype
    grad, following, row_radial, col_radial = kernel(
        dict(previous=running, keep_next=keep_running, row_ratio=row_ratio, col_ratio=col_ratio), radial,
        out_dtype if rounded else None)
    empty = dots.new_empty((0, cols))
    if not radial:
        row_radial, col_radial = torch.zeros(n, dtype=dots.dtype), torch.zeros(cols, dtype=dots.dtype)
    return (grad if rounded else empty.to(out_dtype)), (following if keep_running else empty), row_radial, col_radial
