"""The Triton backend's pair_scores op: its code paths and the choice between them.

The op's paths: those of pair_scores.py (the single-width kernels, "full", and the prefix kernels, "dims") and the
prefix scores in one read of each row (_pair_scores_one_read.py, "dims_one_read"), which takes the dims calls whose
widest prefix is at least ONE_READ_MIN_WIDTH. This module only chooses: `code_path` names the path a call takes,
and `pair_scores` calls that path's launcher, pair_scores.py's own entry function for its two paths (which chooses
between them the same way) or the one-read kernels'. Each path is verified on GPUs on its own
(angle_kernels.verified), and its fingerprint is that of its launcher's code (angle_kernels.fingerprints.PATH_CODE);
the choice belongs to no path.
"""

from __future__ import annotations

from . import _pair_scores_one_read
from . import pair_scores as full_and_prefix

FEATURES = full_and_prefix.FEATURES  # the contract's optional features this op implements
PATHS = full_and_prefix.PATHS + ("dims_one_read",)

# From this widest prefix up, dims calls take the one-read kernels; None: none do. `angle_kernels.verify` and the GPU
# op sweep switch them on at PROPOSED_ONE_READ_MIN_WIDTH (triton_ops.awaiting_verification_on): the widths where the
# prefix kernels were measured at 6.2x one width's time (bench/results/h100-80gb-hbm3-2026-11-26/second: D = 768 and
# 4,096). Verified on an H200 (2026-11-28) and timed there against the prefix kernels in bf16
# (bench/results/h200-2026-12-04/second-ops, dims 64..D): at D = 4,096 2.0x faster at 16,384 and 262,144 pairs (0.99
# against 1.94 ms, 14.6 against 30.2); at D = 768 slower at 16,384 (0.87 against 0.63) and faster at 262,144 (5.1
# against 6.8). At 16,384 pairs the prefix kernels' time grows with D (0.63 to 1.94 ms), the one read's hardly (0.87
# to 0.99): linear between the two widths, the one read overtakes them by D = 1,440 there, hence 2,048 (no width
# between 768 and 4,096 is timed).
ONE_READ_MIN_WIDTH: int | None = 2048
PROPOSED_ONE_READ_MIN_WIDTH = 768


def code_path(x, with_angle, dims=None) -> str:
    """The one of PATHS that computes this call: dims whose widest prefix is at least ONE_READ_MIN_WIDTH -> the
    one-read kernels; otherwise pair_scores.py's choice (dims -> the prefix kernels; else the single-width ones)."""
    if dims is not None and ONE_READ_MIN_WIDTH is not None and dims[-1] >= ONE_READ_MIN_WIDTH:
        return "dims_one_read"
    return full_and_prefix.code_path(x, with_angle, dims)


def pair_scores(x, with_angle, dims=None):
    """(cos, angle) of every pair of x [G, K, D], or of every prefix (dims), on the path `code_path` names; see
    angle_kernels.dispatch."""
    if code_path(x, with_angle, dims) == "dims_one_read":
        return _pair_scores_one_read.pair_scores(x, with_angle, dims)
    return full_and_prefix.pair_scores(x, with_angle, dims)
