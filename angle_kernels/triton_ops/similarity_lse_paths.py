"""The Triton backend's similarity_lse op: its code paths and the choice between them.

The op's paths: the fused kernels of similarity_lse.py ("fused", one width), the blocked dense products of
_similarity_lse_dense.py at one width ("dense") and at every prefix of dims in one pass ("dense_dims"), and the
fused kernels once per prefix ("fused_prefixes", `fused_prefixes` below: the dims calls the dense scheme does not
take). The dense scheme at one width takes calls from DENSE_MIN_WIDTH up, the dense dims scheme dims calls from
DENSE_DIMS_MIN_WIDTH up (filtered ones only where its two passes block the filter's rows alike:
`_filter_blocks_agree`); the other dims calls take the fused kernels per prefix. This module only chooses:
`code_path` names the path a call takes, and `similarity_lse` calls that path's launcher (similarity_lse.py's own
entry function, unchanged, for "fused"). Each path is verified on GPUs on its own (angle_kernels.verified), and its
fingerprint is that of its launcher's code (angle_kernels.fingerprints.PATH_CODE); the choice belongs to no path.
"""

from __future__ import annotations

import torch

from . import _similarity_lse_dense
from . import similarity_lse as fused

FEATURES = ("dims",)  # the contract's optional features this op implements
PATHS = fused.PATHS + ("dense", "dense_dims", "fused_prefixes")

# From these widths up, one-width calls take the dense scheme and dims calls the dense dims scheme, where their
# tiles fit (_similarity_lse_dense.takes); None: none do. `angle_kernels.verify` and the GPU op sweep switch them on
# at the PROPOSED widths (triton_ops.awaiting_verification_on): the dense similarity_xent scheme's MIN_WIDTH, from
# which that scheme was measured faster than the fused kernels (similarity_xent_dense.MIN_WIDTH; the same tile work
# per logit here).
# One width: verified on an H200 (2026-11-28) and timed there against the fused kernels in bf16
# (bench/results/h200-2026-11-28/second-op-sweep): at D = 768 slower at 1,024 x 2,048 logits (3.14 against 1.92 ms)
# and equal at 4,096 x 8,192 (4.34 against 4.49); at D = 4,096 faster at both (2.64 against 5.15, 4.25 against
# 21.5). The fused kernels' time grows with D, the dense scheme's hardly: linear between the two widths, the dense
# scheme overtakes them by D = 1,800 at the smaller shape and by 800 at the larger, hence 2,048 (no width between
# 768 and 4,096 is timed yet).
DENSE_MIN_WIDTH: int | None = 2048
PROPOSED_DENSE_MIN_WIDTH = 768
# With dims: both paths verified on an H200 (2026-12-04) and timed there in bf16 (bench/results/h200-2026-12-04/
# second-ops, five prefixes from 64): the dense dims scheme faster than the fused kernels per prefix at every size at
# D = 768 (6.7 against 11.1 ms at 1,024 x 2,048 logits, 7.7 against 14.2 at 4,096 x 8,192, 71 against 109 at
# 16,384 x 32,768) and 3.0-6.5x faster at D = 4,096.
DENSE_DIMS_MIN_WIDTH: int | None = 768
PROPOSED_DENSE_DIMS_MIN_WIDTH = 768


def code_path(q, c, scale, target_offset=0, period=0, exclude="none", penalty=0.0, penalty_on="none",
              filter_q=None, filter_c=None, filter_threshold=None, filter_keeps_target=False, normalize=True,
              dims=None) -> str:
    """The one of PATHS that computes this call: from the dense scheme's width up where its tiles fit -> "dense"
    (one width) or "dense_dims"; otherwise the fused kernels, once ("fused") or per prefix ("fused_prefixes")."""
    has_filter = filter_threshold is not None
    if dims is None:
        if (DENSE_MIN_WIDTH is not None and q.shape[1] >= DENSE_MIN_WIDTH
                and _similarity_lse_dense.takes(c.shape[0], 1, has_filter)):
            return "dense"
        return "fused"
    if (DENSE_DIMS_MIN_WIDTH is not None and q.shape[1] >= DENSE_DIMS_MIN_WIDTH
            and _similarity_lse_dense.takes(c.shape[0], len(dims), has_filter)
            and (not has_filter or _filter_blocks_agree(q.shape[0], c.shape[0], len(dims)))):
        return "dense_dims"
    return "fused_prefixes"


def _filter_blocks_agree(m: int, mc: int, k: int) -> bool:
    """Whether the dense dims scheme's forward and backward take the filter's products in row blocks of one size (its
    own filter or a separate one). Where they do not, cuBLAS may round a filter score differently in the two, and a
    score at its threshold (a duplicate text's guide score in a GIST batch) kept in forward can be dropped in
    backward: such calls take the fused kernels per prefix (docs/gpu-runs.md, the defects found without a GPU)."""
    rows = _similarity_lse_dense.block_rows
    return all(rows(m, mc, 1, separate) == rows(m, mc, k, separate) for separate in (False, True))


def fused_prefixes(q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c,
                   filter_threshold, filter_keeps_target, normalize, dims):
    """[k, M]: the fused kernels (similarity_lse.py's entry function) on each prefix's truncated inputs, the filter
    cut like q and c and compared with its row of filter_threshold [k, M]; autograd sums the prefixes' gradients."""
    def cut(x, d):
        return None if x is None else x[:, :d]

    def threshold(i):
        return None if filter_threshold is None else filter_threshold[i]

    return torch.stack([
        fused.similarity_lse(q[:, :d], c[:, :d], scale, target_offset, period, exclude, penalty, penalty_on,
                             cut(filter_q, d), cut(filter_c, d), threshold(i), filter_keeps_target, normalize)
        for i, d in enumerate(dims)])


def similarity_lse(q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c,
                   filter_threshold, filter_keeps_target, normalize, dims=None, path=None):
    """Per-row logsumexps of scaled cosines (or dot products), [M], or [k, M] with dims, on the code path `path`
    (PATHS), by default the one `code_path` names; see angle_kernels.dispatch."""
    args = (q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c, filter_threshold,
            filter_keeps_target, normalize)
    if path is None:
        path = code_path(*args, dims=dims)
    if path not in PATHS or (path in ("dense_dims", "fused_prefixes")) != (dims is not None):
        raise ValueError(f"the triton backend's similarity_lse has no code path {path!r} for dims={dims!r}; its "
                         f"paths: {PATHS} (dims: dense_dims, fused_prefixes)")
    if path == "dense":
        return _similarity_lse_dense.similarity_lse(*args)
    if path == "dense_dims":
        return _similarity_lse_dense.similarity_lse_dims(*args, dims)
    if path == "fused_prefixes":
        return fused_prefixes(*args, dims)
    return fused.similarity_lse(*args)
