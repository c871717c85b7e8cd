"""What the CUDA dense schemes (cuda_ops/similarity_lse.py, cuda_ops/similarity_xent_dense.py) have in common on
the host: the gradient op's operand dtypes and fake outputs, the prefixes' column slices, tiles and unit slices, and
backward's running sum over the prefixes, from the widest down (csrc/dense_types.h, DenseRunning)."""

from __future__ import annotations

from typing import Callable, Iterator

import torch

from ..products import product_into

# The gradient op's operand_dtype strings (csrc/dense_binding.h parses the same ones).
OPERAND_DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16,
                  "bfloat16": torch.bfloat16}


def grad_schema(tile_args: str, row_state: str, option_args: str) -> str:
    """The gradient op's schema: the tile arguments, the rows' statistics (row_state) and coef, the running sum and
    its ratios, the options, then the radial, running-sum and operand switches (csrc/dense_binding.h)."""
    return (f"({tile_args}, {row_state}, Tensor coef, Tensor? running, Tensor? row_ratio, Tensor? col_ratio, "
            f"int row0, {option_args}, bool radial, bool keep_running, str operand_dtype) "
            "-> (Tensor, Tensor, Tensor, Tensor)")


def operand_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def grad_fake(dots: torch.Tensor, keep_running: bool, operand_dtype: str) -> tuple:
    """The gradient op's outputs as the binding allocates them: the tile rounded to the operand dtype, the running
    sum, the row and column radial sums."""
    n, mc = dots.shape
    operand = OPERAND_DTYPES[operand_dtype]
    rounded = not keep_running or operand != dots.dtype  # else the products take the running sum itself
    grad = dots.new_empty((n if rounded else 0, mc), dtype=operand)
    return grad, dots.new_empty((n if keep_running else 0, mc)), dots.new_empty((n,)), dots.new_empty((mc,))


def column_slices(dims: tuple) -> list:
    """The column slices [d_i-1, d_i) of the prefixes d_1 < ... < d_k."""
    return list(zip((0,) + dims[:-1], dims))


def prefix_tiles(out: torch.Tensor, rows: torch.Tensor, columns: torch.Tensor, slices: list) -> None:
    """out[i] = rows[:, :d_i] @ columns[:, :d_i]^T for every prefix i (out [k, b, Mc]): each the previous one plus
    its slice's product."""
    for i, (lo, hi) in enumerate(slices):
        product_into(out[i], rows[:, lo:hi], columns[:, lo:hi].T, add=out[i - 1] if i > 0 else None)


def unit_slices(rows, slices: list, dtype: torch.dtype) -> torch.Tensor:
    """The scaled rows' slices s_j (rows.scaled), each times the inverse norm of the prefix it ends (rows.inv),
    computed in `dtype` and rounded to the rows' dtype (entries at most 1: a slice is part of its prefix); columns
    past the widest prefix are not read."""
    out = torch.empty_like(rows.scaled)
    for j, (lo, hi) in enumerate(slices):
        out[:, lo:hi] = rows.scaled[:, lo:hi].to(dtype) * rows.inv[j][:, None]
    return out


def running_sums(k: int, grad: Callable, q_ratio: torch.Tensor, c_ratio: torch.Tensor) -> Iterator[tuple]:
    """One row block's gradient tiles from the widest prefix down: grad(j, running, row_ratio, col_ratio) runs the
    gradient op of prefix j, folding in the running sum of prefix j + 1 (None for the widest) taken into prefix j's
    frame by q_ratio[j], c_ratio[j], and keeping its own for prefix j - 1. Yields (j, the running sum of prefix j in
    the operand dtype, its row radial sums, its column radial sums). Each tile is let go before the next prefix's
    op runs, so that no more than one running sum and one rounded tile are alive besides the new ones."""
    running = None
    for j in reversed(range(k)):
        folded = (None, None, None) if running is None else (running, q_ratio[j], c_ratio[j])
        rounded, running, row_radial, col_radial = grad(j, *folded)
        products = rounded if rounded.numel() else running  # else the op left the rounding to the running sum
        del rounded
        yield j, products, row_radial, col_radial
        del products
