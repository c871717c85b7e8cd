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

# From this widest prefix up, dims calls take the one-read kernels; None: none do. The one-read kernels await their
# first GPU verification: until a GPU run has verified them (docs/gpu-runs.md), every dims call stays on the verified
# prefix kernels, so that `auto` keeps computing it on Triton (an unverified path would send it to PyTorch).
# `angle_kernels.verify` and the GPU op sweep switch them on at PROPOSED_ONE_READ_MIN_WIDTH
# (triton_ops.awaiting_verification_on): the widths where the prefix kernels were measured at 6.2x one width's time
# (bench/results/h100-80gb-hbm3-2026-11-26/second: D = 768 and 4,096).
ONE_READ_MIN_WIDTH: int | None = None
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
