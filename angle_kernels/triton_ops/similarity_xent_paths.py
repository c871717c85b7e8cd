"""The Triton backend's similarity_xent op: its code paths and the choice between them.

The op's paths: those of similarity_xent.py (the fused kernels at full width, the dense scheme for wide embeddings,
the fused prefix kernels for dims) and the dense scheme with dims (_similarity_xent_dense_dims.py), which takes
dims calls from DENSE_DIMS_MIN_WIDTH up. This module only chooses: `code_path`
names the path a call takes, and `similarity_xent` calls that path's launcher, similarity_xent.py's own entry
function for its three paths (which chooses among them the same way) or the dense dims scheme's. Each path is
verified on GPUs on its own (angle_kernels.verified), and its fingerprint is that of its launcher's code
(angle_kernels.fingerprints.PATH_CODE); the choice belongs to no path.
"""

from __future__ import annotations

from . import _similarity_xent_dense_dims
from . import similarity_xent as fused_and_dense

FEATURES = fused_and_dense.FEATURES  # the contract's optional features this op implements
PATHS = fused_and_dense.PATHS + ("dense_dims",)
# From this width up, dims calls take the dense dims scheme where its tiles fit; None: none do (a path switched off
# until a GPU run verifies it, triton_ops.AWAITING_VERIFICATION; `angle_kernels.verify` and the GPU op sweep switch
# it on at PROPOSED_DENSE_DIMS_MIN_WIDTH). Verified on an H200 (2026-11-28) and timed there against the prefix
# kernels in bf16 (bench/results/h200-2026-11-28/second-op-sweep): at D = 768 equal at 1,024 x 2,048 logits (4.68
# against 4.31 ms; best runs 4.14 and 4.12) and 1.6x faster at 4,096 x 8,192 (9.3 against 15.0 ms); at D = 4,096
# 2.5x and 6.4x faster.
DENSE_DIMS_MIN_WIDTH: int | None = 768
PROPOSED_DENSE_DIMS_MIN_WIDTH = 768


def code_path(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0, group_ids=None,
              dims=None) -> str:
    """The one of PATHS that computes this call: dims from DENSE_DIMS_MIN_WIDTH up, where its tiles fit
    (_similarity_xent_dense_dims.takes) -> the dense dims scheme; otherwise similarity_xent.py's choice (dims ->
    the prefix kernels; wide embeddings -> the dense scheme; else the fused kernels)."""
    columns = q.shape[0] if c is None else c.shape[0]
    if (DENSE_DIMS_MIN_WIDTH is not None and q.shape[1] >= DENSE_DIMS_MIN_WIDTH
            and _similarity_xent_dense_dims.takes(q.shape[1], columns, dims)):
        return "dense_dims"
    return fused_and_dense.code_path(q, c, scale, target, dims=dims)


def similarity_xent(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0, group_ids=None,
                    dims=None):
    """Softmax cross-entropy over cosine similarities on the path `code_path` names; see angle_kernels.dispatch."""
    if code_path(q, c, scale, target, dims=dims) == "dense_dims":
        return _similarity_xent_dense_dims.similarity_xent(q, c, scale, target, row_weights, exclude_diagonal,
                                                          margin, group_ids, dims)
    return fused_and_dense.similarity_xent(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids,
                                           dims)
