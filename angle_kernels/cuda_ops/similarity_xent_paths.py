"""The CUDA backend's similarity_xent op: its code paths and the choice between them.

The op's paths: the fused kernels of similarity_xent.py ("fused", full width) and the dense scheme of
similarity_xent_dense.py ("dense" at one width, "dense_dims" with dims). This module only chooses: `code_path` names
the path a call takes, and `similarity_xent` calls that path's launcher, similarity_xent.py's own entry function for
"fused" or the dense scheme's. Each path is verified on GPUs on its own (angle_kernels.verified), and its fingerprint
is that of its launcher's code and of its CUDA sources (angle_kernels.fingerprints: PATH_CODE, CSRC_SOURCES); the
choice belongs to no path.

The switches. One-width calls take the dense scheme from DENSE_MIN_WIDTH up, where its tiles fit
(similarity_xent_dense.takes); None: none do. `angle_kernels.verify` and the GPU op sweep switch it on at
PROPOSED_DENSE_MIN_WIDTH (cuda_ops.awaiting_verification_on): the Triton dense scheme's MIN_WIDTH. Verified on an
H200 (2026-11-28) and timed there against the fused kernels in bf16 (bench/results/h200-2026-12-04/second-cuda):
in-batch negatives 2.1-32x faster at D = 768 (2.4 against 5.2 ms at 2,048 x 2,048 logits; 17.3 against 548 at
32,768 x 32,768) and 11-61x at D = 4,096; with ArcCon's margin (D = 768) 4.4x and 29x faster at 4,096 and 16,384
rows, and 1.9x slower at 1,024 (4.2 against 2.2 ms, where `auto` takes the Triton backend's 1.7). Hence 768. Dims
calls take the dense dims scheme at every width: it is the one path of this backend that computes them (the fused
kernels have no dims), so the op declares dims (FEATURES) and every dims call is computable here.
"""

from __future__ import annotations

import torch

from . import similarity_xent as fused
from . import similarity_xent_dense as dense

FEATURES = ("dims",)  # the contract's optional features this op implements: dims, on the dense dims scheme
PATHS = fused.PATHS + dense.PATHS
DENSE_MIN_WIDTH: int | None = 768
PROPOSED_DENSE_MIN_WIDTH = 768


def code_path(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0, group_ids=None,
              dims=None) -> str:
    """The one of PATHS that computes this call: dims -> the dense dims scheme; one width from DENSE_MIN_WIDTH up, or
    at any width under torch.use_deterministic_algorithms(True), where the dense scheme's tiles fit -> the dense
    scheme; otherwise the fused kernels."""
    if dims is not None:
        return "dense_dims"
    columns = q.shape[0] if c is None else c.shape[0]
    if not dense.takes(q.shape[1], columns):
        return "fused"
    if DENSE_MIN_WIDTH is not None and q.shape[1] >= DENSE_MIN_WIDTH:
        return "dense"
    # The fused backward adds into its gradients with float atomics (order-dependent bits; under torch's
    # deterministic mode it raises, as torch's own such ops do); the dense scheme reduces in a fixed order.
    return "dense" if torch.are_deterministic_algorithms_enabled() else "fused"


def similarity_xent(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0, group_ids=None,
                    dims=None, path=None):
    """Softmax cross-entropy over cosine similarities on the path `code_path` names, or on `path` when given (any
    path that computes the call: "dense" at any width; see angle_kernels.dispatch)."""
    chosen = code_path(q, c, scale, target, dims=dims) if path is None else path
    if (chosen == "dense_dims") != (dims is not None) or chosen not in PATHS:
        raise ValueError(f"the cuda backend's similarity_xent has no code path {chosen!r} for dims={dims!r}; its "
                         f"paths: {PATHS} (dims: dense_dims)")
    if chosen == "dense_dims":
        return dense.similarity_xent_dims(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids, dims)
    if chosen == "dense":
        return dense.similarity_xent(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids)
    return fused.similarity_xent(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids)
