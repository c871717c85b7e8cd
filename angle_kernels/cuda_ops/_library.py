"""The torch.library namespace of the CUDA backend, shared by its op modules.

The op schemas are defined in Python, not in csrc/, so that they exist on every machine (CPU-only ones too):
torch.compile traces them through their fake implementations, and tests inspect them. Each op module
(`cuda_ops/<op>.py`) defines its forward and backward ops here with `define`, registers their fake
implementations and autograd formula, and wraps them as the backend's op. The CUDA kernels are attached to the
schemas by the compiled extension (`TORCH_LIBRARY_IMPL(angle_kernels, CUDA, m)` in each op's `csrc/<op>.cpp`),
loaded by `_extension`.

The ops carry a `cuda_` prefix so they cannot collide with ops other backends define under the same
`angle_kernels` namespace. Each forward op returns, besides its results, the small O(N) state its backward op
needs; the backend's op hides that state.
"""

from __future__ import annotations

import torch

NAMESPACE = "angle_kernels"

# One FRAGMENT library for all definitions; kept alive for the life of the process.
_LIB = torch.library.Library(NAMESPACE, "FRAGMENT")


def define(name: str, schema: str) -> str:
    """Define the op `angle_kernels::<name>` with `schema`; returns its qualified name."""
    _LIB.define(name + schema)
    return f"{NAMESPACE}::{name}"


def op(name: str):
    """The defined op `angle_kernels::<name>` (its default overload)."""
    return getattr(getattr(torch.ops, NAMESPACE), name).default
