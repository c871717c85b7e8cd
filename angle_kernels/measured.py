"""How fast each backend measured on a GPU, and the rule `backend="auto"` uses to choose among those it may use.

On CUDA tensors `auto` may compute a call on every GPU backend whose code path for it is verified there
(`angle_kernels.verified`), and always on the PyTorch backend. Being verified says nothing about speed: on an H100
the CUDA extension is slower than PyTorch on the similarity losses and, from 65,536 scores, on the ranking term,
and PyTorch beats both GPU backends on the smallest in-batch-negative batches (all launch-bound). So:

    Among the backends that may compute the call, `auto` takes the one with the lowest time at the nearest point
    measured for this op, variant, dtype and GPU (its compute capability), provided every one of them was timed
    there; a time within TIE of the fastest counts as equal to it, and equals go by the fixed order: triton,
    cuda, torch. Without such a point (another GPU or dtype, a size or width more than SPAN times away from every
    measured one, an op or variant never measured), the fixed order decides.

A point is a (capability, op, variant, dtype, size, width) with the median time in ms of forward + backward per
backend, keyed "backend/path" where one backend's code paths were timed apart (the Triton similarity_xent's
fused and dense schemes), else "backend": a call's own code path is looked up first. Sizes (`call_point`): pairs
for pair_scores, scores for ranking_loss, logits (M x Mc) for similarity_xent; width is D (1 for ranking_loss).
Variants: "full", "dims" (nested prefixes), "margin" (similarity_xent with an angular margin, ArcCon).

The points are those of the op sweeps committed under bench/results/ (`python bench/speed_table.py` prints them
from a run's second.json), each run cited beside its rows. Next runs replace them.
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

TIE = 0.10  # times this close to the fastest count as equal: the same op's time moves by a few % between runs
SPAN = 16.0  # a measured point speaks for sizes (and widths) up to this factor away from its own


class Candidate(Protocol):
    """What the rule needs of a backend (dispatch.Ops): its name and the code path it takes for a call."""

    name: str

    def code_path(self, op: str, args: tuple) -> str: ...


# (op, variant, size, width, {backend or backend/path: ms}); bf16 embeddings, forward + backward, median of
# triton.testing.do_bench. Triton and torch: bench/results/h100-80gb-hbm3-2026-11-26/second (op_sweep); CUDA:
# bench/results/h100-80gb-hbm3-2026-11-26b/gpu (cuda_op_sweep), the same machine type and versions. The torch
# times predate the larger GPU blocks of the torch backend (torch_ops/common.py): slower than it is now.
_H100_BF16_EMBEDDINGS = (
    ("pair_scores", "full", 16384, 768, {"triton": 0.579, "torch": 7.57, "cuda": 0.565}),
    ("pair_scores", "full", 16384, 4096, {"triton": 0.585, "torch": 18.7, "cuda": 0.591}),
    ("pair_scores", "full", 262144, 768, {"triton": 1.09, "torch": 61.6, "cuda": 1.6}),
    ("pair_scores", "full", 262144, 4096, {"triton": 4.62, "torch": 344.0, "cuda": 7.88}),
    ("pair_scores", "full", 1048576, 768, {"triton": 4.29, "torch": 232.0, "cuda": 6.25}),
    ("pair_scores", "dims", 16384, 768, {"triton": 0.712, "torch": 30.6}),
    ("pair_scores", "dims", 16384, 4096, {"triton": 1.94, "torch": 119.0}),
    ("pair_scores", "dims", 262144, 768, {"triton": 6.72, "torch": 365.0}),
    ("pair_scores", "dims", 262144, 4096, {"triton": 30.0, "torch": 1370.0}),
    # in-batch negatives: N pairs, M = Mc = 2N rows (N = 1,024, 4,096, 16,384)
    ("similarity_xent", "full", 4194304, 768,
     {"triton/fused": 1.95, "triton/dense": 1.77, "torch": 1.47, "cuda": 4.99}),
    ("similarity_xent", "full", 4194304, 4096,
     {"triton/fused": 6.53, "triton/dense": 1.27, "torch": 2.81, "cuda": 25.9}),
    ("similarity_xent", "full", 67108864, 768,
     {"triton/fused": 5.58, "triton/dense": 2.01, "torch": 14.0, "cuda": 40.4}),
    ("similarity_xent", "full", 67108864, 4096,
     {"triton/fused": 28.5, "triton/dense": 4.55, "torch": 46.8, "cuda": 252.0}),
    ("similarity_xent", "full", 1073741824, 768,
     {"triton/fused": 84.2, "triton/dense": 16.8, "torch": 203.0, "cuda": 535.0}),
    ("similarity_xent", "full", 1073741824, 4096,
     {"triton/fused": 447.0, "triton/dense": 52.2, "torch": 692.0, "cuda": 2880.0}),
    # ArcCon: N rows against the N rows of the other view
    ("similarity_xent", "margin", 1048576, 768,
     {"triton/fused": 1.8, "triton/dense": 2.62, "torch": 3.67, "cuda": 2.16}),
    ("similarity_xent", "margin", 16777216, 768,
     {"triton/fused": 2.91, "triton/dense": 2.13, "torch": 4.82, "cuda": 13.7}),
    ("similarity_xent", "margin", 268435456, 768,
     {"triton/fused": 21.7, "triton/dense": 5.94, "torch": 54.3, "cuda": 145.0}),
    # Matryoshka: N queries against 2N candidates at 3 (D = 768) or 4 (D = 4,096) prefixes
    ("similarity_xent", "dims", 2097152, 768, {"triton": 4.31, "torch": 22.4}),
    ("similarity_xent", "dims", 2097152, 4096, {"triton": 16.3, "torch": 20.8}),
    ("similarity_xent", "dims", 33554432, 768, {"triton": 14.8, "torch": 191.0}),
    ("similarity_xent", "dims", 33554432, 4096, {"triton": 71.5, "torch": 149.0}),
    ("similarity_xent", "dims", 536870912, 768, {"triton": 149.0, "torch": 2600.0}),
    ("similarity_xent", "dims", 536870912, 4096, {"triton": 767.0, "torch": 2910.0}),
)

# The ranking term's float32 scores (what the losses give it), the same runs.
_H100_FP32_SCORES = (
    ("ranking_loss", "full", 4096, 1, {"triton": 0.499, "torch": 1.13, "cuda": 0.483}),
    ("ranking_loss", "full", 65536, 1, {"triton": 1.29, "torch": 1.01, "cuda": 2.9}),
    ("ranking_loss", "full", 1048576, 1, {"triton": 0.93, "torch": 1.18, "cuda": 44.4}),
    ("ranking_loss", "full", 4194304, 1, {"triton": 1.96, "torch": 2.11, "cuda": 184.0}),
)

# (capability, dtype of the op's first input) -> the points measured there.
MEASURED: dict[tuple[str, torch.dtype], tuple] = {("9.0", torch.bfloat16): _H100_BF16_EMBEDDINGS,
                                                  ("9.0", torch.float32): _H100_FP32_SCORES}


def call_point(op: str, args: tuple) -> tuple[str, int, int] | None:
    """(variant, size, width) of a call with the op's validated arguments (contract.check_<op>), or None for an op
    no sweep measures."""
    if op == "pair_scores":
        x, _, dims = args
        groups, k, width = x.shape
        return ("dims" if dims else "full"), groups * (k - 1), width
    if op == "ranking_loss":
        return "full", args[0].shape[0], 1
    if op == "similarity_xent":
        q, c, margin, dims = args[0], args[1], args[6], args[8]
        columns = q.shape[0] if c is None else c.shape[0]
        variant = "dims" if dims else "margin" if margin > 0 else "full"
        return variant, q.shape[0] * columns, q.shape[1]
    return None


def capability(device: torch.device) -> str | None:
    """The compute capability ("major.minor") of a CUDA device; None for any other device (nothing measured)."""
    if device.type != "cuda":
        return None
    return ".".join(map(str, torch.cuda.get_device_capability(device)))


def nearest_point(op: str, args: tuple) -> dict[str, float] | None:
    """The times measured nearest to this call (same GPU, dtype, op and variant; size and width within SPAN), or
    None. Nearness: the distance of log size plus that of log width."""
    where = call_point(op, args)
    if where is None:
        return None
    variant, size, width = where
    if size <= 0:  # an empty call: nothing to choose by
        return None
    points = MEASURED.get((capability(args[0].device), args[0].dtype), ())
    best, best_distance = None, math.inf
    for p_op, p_variant, p_size, p_width, times in points:
        if (p_op, p_variant) != (op, variant):
            continue
        size_ratio, width_ratio = abs(math.log(size / p_size)), abs(math.log(width / p_width))
        if max(size_ratio, width_ratio) > math.log(SPAN):
            continue
        if size_ratio + width_ratio < best_distance:
            best, best_distance = times, size_ratio + width_ratio
    return best


def fastest(op: str, args: tuple, allowed: list[Candidate]) -> Candidate:
    """The backend of `allowed` (in the fixed order: triton, cuda, torch) that computes the call: the rule of the
    module docstring."""
    if len(allowed) == 1:
        return allowed[0]
    times = nearest_point(op, args)
    if times is None:
        return allowed[0]
    timed = []
    for candidate in allowed:
        key = f"{candidate.name}/{candidate.code_path(op, args)}"
        ms = times.get(key, times.get(candidate.name))
        if ms is None:  # a backend not timed there: no comparison to make
            return allowed[0]
        timed.append((candidate, ms))
    quickest = min(ms for _, ms in timed)
    return next(candidate for candidate, ms in timed if ms <= quickest * (1 + TIE))
