"""Matrix products of 16-bit operands with float32 accumulation, shared by the backends that form their products
with torch (the PyTorch backend's "mixed" paths, the CUDA backend's similarity_lse).

On a GPU whose torch has matrix products of bfloat16/float16 operands with float32 accumulation and output
(`mixed_products`: `torch.mm(..., out_dtype=torch.float32)`), 16-bit operands are taken as they are, at the tensor
cores' rate. Elsewhere (the CPU, where the tests run these paths, or an older torch) they are converted to float32
first: the same values and the same accumulation, at the float32 rate. `product_into` forms every product: in the
operands' dtype where that is the output's, else by `_mixed_product_into`. (The Triton dense scheme keeps its own
copy, triton_ops/similarity_xent_dense.py, inside its verified code.)
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .contract import compute_dtype

# The most elements a temporary product takes where a sum cannot go straight into its output (a GPU's piece size,
# torch_ops/common.ACCELERATOR_CHUNK_ELEMENTS: 128 MB of float32).
TEMPORARY_ELEMENTS = 1 << 25
MIXED_DTYPES = (torch.bfloat16, torch.float16)


class MixedProducts(NamedTuple):
    """What this torch offers on a device for products of 16-bit operands with float32 results."""

    mm: bool  # torch.mm(a, b, out_dtype=torch.float32, out=...): CUDA only, recent torch
    addmm_into_fp32: bool  # torch.addmm(c, a, b, out_dtype=torch.float32, out=c) with a float32 c: some releases
    # require c in the operands' dtype


_mixed_products: dict[torch.device, MixedProducts] = {}


def mixed_products(device: torch.device) -> MixedProducts:
    """MixedProducts on `device`, asked once per device by 1 x 1 products (a sync, once). Nothing off CUDA, and
    nothing while torch.compile traces before the question was asked (asked then, it would break the graph)."""
    if device not in _mixed_products:
        if device.type != "cuda" or not hasattr(torch.ops.aten.mm, "dtype_out"):
            found = MixedProducts(False, False)
        elif torch.compiler.is_compiling():
            return MixedProducts(False, False)
        else:
            one = torch.ones(1, 1, dtype=torch.bfloat16, device=device)
            out = torch.ones(1, 1, device=device)
            try:
                mm = torch.mm(one, one, out_dtype=torch.float32, out=out).item() == 1.0
            except (RuntimeError, NotImplementedError):
                mm = False
            try:
                addmm = mm and torch.addmm(out, one, one, out_dtype=torch.float32, out=out).item() == 2.0
            except (RuntimeError, NotImplementedError):
                addmm = False
            found = MixedProducts(mm, addmm)
        _mixed_products[device] = found
    return _mixed_products[device]


def products(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b, a new [rows of a, columns of b] tensor in the compute dtype (product_into)."""
    if a.dtype == compute_dtype(a.dtype):
        return a @ b
    out = torch.empty(a.shape[0], b.shape[1], dtype=compute_dtype(a.dtype), device=a.device)
    _mixed_product_into(out, a, b, None)
    return out


def product_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, add: torch.Tensor | None = None) -> None:
    """out = add + a @ b (add: None, out itself, or another tensor of out's shape) in out's dtype, the compute
    dtype: operands in that dtype as they are, 16-bit operands accumulated in float32 (_mixed_product_into). Under
    torch.compile, which takes no `out=` view with gaps (a column slice), through a temporary of out's size."""
    if torch.compiler.is_compiling() and not out.is_contiguous():
        product = torch.empty(out.shape, dtype=out.dtype, device=out.device)
        product_into(product, a, b)
        out.copy_(product if add is None else product.add_(add))
        return
    if a.dtype != out.dtype:
        _mixed_product_into(out, a, b, add)
    elif add is None:
        torch.mm(a, b, out=out)
    else:
        torch.addmm(add, a, b, out=out)


def _mixed_product_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, add: torch.Tensor | None) -> None:
    """out = add + a @ b for 16-bit a and b and a float32 out: cuBLAS's mixed-dtype products where this torch has
    them on out's device (the branch only a GPU takes); elsewhere (the CPU, where the tests run the mixed paths) the
    operands converted to float32 first, exactly the products mm(out_dtype=float32) computes, but for the order of
    the float32 accumulation."""
    offered = mixed_products(out.device)
    if not offered.mm:
        a, b = a.to(out.dtype), b.to(out.dtype)
        if add is None:
            torch.mm(a, b, out=out)
        else:
            torch.addmm(add, a, b, out=out)
    elif add is None:
        torch.mm(a, b, out_dtype=out.dtype, out=out)
    elif offered.addmm_into_fp32:
        torch.addmm(add, a, b, out_dtype=out.dtype, out=out)
    elif not _same_elements(add, out):
        torch.mm(a, b, out_dtype=out.dtype, out=out)
        out.add_(add)
    else:  # a sum into out: the product of a piece of rows at a time in a temporary, then added
        step = max(1, TEMPORARY_ELEMENTS // max(1, out.shape[1]))
        for r in range(0, out.shape[0], step):
            out[r:r + step].add_(torch.mm(a[r:r + step], b, out_dtype=out.dtype))


def _same_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether a and b are the same elements (one view, or two view objects of it: out[:n] taken twice)."""
    return a is b or (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride())
