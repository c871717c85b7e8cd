"""How fast each backend measured on a GPU, and the rule `backend="auto"` uses to choose among those it may use.

On CUDA tensors `auto` may compute a call on every GPU backend whose code path for it is verified there
(`angle_kernels.verified`), and always on the PyTorch backend. Being verified says nothing about speed: on an H100
the CUDA extension measured slower than PyTorch on the similarity losses and, from 65,536 scores, on the ranking
term, and PyTorch beat both GPU backends on the smallest in-batch-negative batches (all launch-bound). So:

    Among the backends that may compute the call, `auto` takes the one with the lowest time at the nearest point
    measured for this op, variant, dtype and GPU (its compute capability), counting the times of the code path the
    call takes with the code installed here; a time within TIE of the fastest counts as equal to it, and equals go
    by the fixed order: triton, cuda, torch (its GPU path, then its default one; torch before cuda for the ops of
    AFTER_TORCH: the similarity ops, whose CUDA schemes measured slower than torch at the smallest sizes). A backend
    without such a time at the point (not timed there, or timed on another code path or on code changed since) is
    taken to be no faster than the backends before it in the fixed order: where the first backend of that order has
    no time, the fixed order decides; else the point decides among those it timed (`point_choice`), so a time an
    edit retired leaves the others' comparison standing. Points equally near the call each decide so, and when they
    disagree the fixed order decides (never the order of the table). Without such a point (another GPU or dtype, a
    size or width more than SPAN times away from every measured one, an op or variant never measured), the fixed
    order decides.

A point is (op, variant, size, width, times, fingerprints): the median time in ms of forward + backward per code
path it timed, keyed "backend/path" (the op module's PATHS: the torch backend's "default", or its "mixed" 16-bit
products on a GPU), and the fingerprint of the code each time measured, keyed the same way (`code_fingerprint`: the
rule of angle_kernels.fingerprints, and for cuda also the op's CUDA sources the extension was built from). A time counts
for a call only while this installation runs the code it measured: an edit to a path's code retires its times
until a GPU run measures them again, exactly as it voids the path's verification. Sizes (`call_point`): pairs for
pair_scores, scores for ranking_loss, logits (M x Mc) for similarity_xent and similarity_lse; width is D (1 for
ranking_loss).
Variants: "full", "dims" (nested prefixes), "margin" (similarity_xent with an angular margin, ArcCon); a
similarity_lse call with dims and a filter (MNRL's false-negative filter, GIST) is "dims filtered", which no sweep
has timed, so the fixed order decides it: the CUDA dense dims scheme takes a filter's products in row blocks of other
sizes in forward than in backward past a size, where a score at its threshold can be decided differently in the two
(docs/gpu-runs.md), so its times without a filter must not send filtered calls there. (At one width both passes
block the rows alike: filtered one-width calls keep the "full" points.)

The points are those of the op sweeps committed under bench/results/ (`python bench/speed_table.py` prints them,
paths and fingerprints included, from a run's second.json), each run cited beside its rows. Next runs replace them.

What the table is worth against the fixed order (`python bench/speed_table.py --decisions`, from the points
below, each call at a point and each set of backends auto may use there):
    * With Triton among them (sm_90 today: every Triton path is verified), on the paths calls take, the H200's
      points send to CUDA (where its path is verified: sm_90, torch 2.11, CUDA 13.0) the full-width pair scores at
      every timed size (16,384 to 1M pairs, D = 768 and 4,096: 0.44-12.5 ms against Triton's 0.65-15.1, 0.63
      against 1.04 at 262,144 pairs, D = 768, Triton and torch timed again beside them), the pair scores with dims at
      262,144 pairs, D = 768 (1.49 ms against the prefix kernels' 6.78), similarity_lse with dims from 4,096 x 8,192
      logits at D = 4,096 and at 16,384 x 32,768 (10.0 against the dense dims scheme's 11.4; 54 against 71 at
      D = 768) and the ranking term from about 16,000 to 2M scores (0.72 against Triton's sort path's 1.24 at
      65,536, 0.63 against 1.18 at 1M; past 2M the H100's 4M point, with CUDA's old code, leaves the fixed order);
      to torch Matryoshka in-batch negatives at 1,024 x 2,048 logits, D = 4,096 (its 16-bit products 5.35 against
      the dense dims scheme's 6.62) and, without CUDA, the ranking term near 65,536 scores (1.10 against
      1.24); everywhere else Triton measured fastest or within TIE of it.
    * Without Triton (its path unverified or unloaded where CUDA's is verified), the points decide between CUDA and
      torch where they apply (CUDA's pair scores and ranking term faster at every point; its similarity schemes
      slower at most points up to 4M logits, faster at most from 16M), and the fixed order elsewhere (AFTER_TORCH).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch

from . import contract, verified

TIE = 0.10  # times this close to the fastest count as equal: the same op's time moves by a few % between runs
SPAN = 16.0  # a measured point speaks for sizes (and widths) up to this factor away from its own


class Candidate(Protocol):
    """What the rule needs of a backend (dispatch.Ops): its name (the code path it takes for a call comes with it:
    `fastest`)."""

    name: str


# (op, variant, size, width, {backend/path: ms}, {backend/path: fingerprint}); bf16 embeddings, forward + backward,
# median of triton.testing.do_bench. Triton and torch: bench/results/h100-80gb-hbm3-2026-11-26/second (op_sweep,
# sources at commit 7ab8295); CUDA: bench/results/h100-80gb-hbm3-2026-11-26b/gpu (cuda_op_sweep, sources at
# a0dd5ba), the same machine type and versions. Those runs did not record paths and fingerprints: `python
# bench/speed_table.py --commit 7ab8295 .../second/second.json --commit a0dd5ba .../gpu/second.json` computed them
# from the sources at those commits. Since then the torch backend's pair_scores and similarity_xent (its larger GPU
# blocks, torch_ops/common.py) and the CUDA pair_scores and ranking_loss kernels (rewritten) changed: their times
# no longer count; the Triton paths, the torch ranking term and the CUDA similarity_xent are unchanged.
_H100_BF16_EMBEDDINGS = (
    ("pair_scores", "dims", 16384, 768,
     {"triton/dims": 0.712, "torch/default": 30.6},
     {"triton/dims": "11ab4505b78faacc", "torch/default": "16a527b64105e2aa"}),
    ("pair_scores", "dims", 16384, 4096,
     {"triton/dims": 1.94, "torch/default": 119.0},
     {"triton/dims": "11ab4505b78faacc", "torch/default": "16a527b64105e2aa"}),
    ("pair_scores", "dims", 262144, 768,
     {"triton/dims": 6.72, "torch/default": 365.0},
     {"triton/dims": "11ab4505b78faacc", "torch/default": "16a527b64105e2aa"}),
    ("pair_scores", "dims", 262144, 4096,
     {"triton/dims": 30.0, "torch/default": 1370.0},
     {"triton/dims": "11ab4505b78faacc", "torch/default": "16a527b64105e2aa"}),
    ("pair_scores", "full", 16384, 768,
     {"triton/full": 0.579, "torch/default": 7.57, "cuda/full": 0.565},
     {"triton/full": "efb179d27d83ab85", "torch/default": "16a527b64105e2aa",
      "cuda/full": "651d5f038fa54119+089992e506c212ee"}),
    ("pair_scores", "full", 16384, 4096,
     {"triton/full": 0.585, "torch/default": 18.7, "cuda/full": 0.591},
     {"triton/full": "efb179d27d83ab85", "torch/default": "16a527b64105e2aa",
      "cuda/full": "651d5f038fa54119+089992e506c212ee"}),
    ("pair_scores", "full", 262144, 768,
     {"triton/full": 1.09, "torch/default": 61.6, "cuda/full": 1.6},
     {"triton/full": "efb179d27d83ab85", "torch/default": "16a527b64105e2aa",
      "cuda/full": "651d5f038fa54119+089992e506c212ee"}),
    ("pair_scores", "full", 262144, 4096,
     {"triton/full": 4.62, "torch/default": 344.0, "cuda/full": 7.88},
     {"triton/full": "efb179d27d83ab85", "torch/default": "16a527b64105e2aa",
      "cuda/full": "651d5f038fa54119+089992e506c212ee"}),
    ("pair_scores", "full", 1048576, 768,
     {"triton/full": 4.29, "torch/default": 232.0, "cuda/full": 6.25},
     {"triton/full": "efb179d27d83ab85", "torch/default": "16a527b64105e2aa",
      "cuda/full": "651d5f038fa54119+089992e506c212ee"}),
    # Matryoshka: N queries against 2N candidates at 3 (D = 768) or 4 (D = 4,096) prefixes
    ("similarity_xent", "dims", 2097152, 768,
     {"triton/dims": 4.31, "torch/default": 22.4},
     {"triton/dims": "51903531b5c5fc92", "torch/default": "30bf9959ddb60941"}),
    ("similarity_xent", "dims", 2097152, 4096,
     {"triton/dims": 16.3, "torch/default": 20.8},
     {"triton/dims": "51903531b5c5fc92", "torch/default": "30bf9959ddb60941"}),
    ("similarity_xent", "dims", 33554432, 768,
     {"triton/dims": 14.8, "torch/default": 191.0},
     {"triton/dims": "51903531b5c5fc92", "torch/default": "30bf9959ddb60941"}),
    ("similarity_xent", "dims", 33554432, 4096,
     {"triton/dims": 71.5, "torch/default": 149.0},
     {"triton/dims": "51903531b5c5fc92", "torch/default": "30bf9959ddb60941"}),
    ("similarity_xent", "dims", 536870912, 768,
     {"triton/dims": 149.0, "torch/default": 2600.0},
     {"triton/dims": "51903531b5c5fc92", "torch/default": "30bf9959ddb60941"}),
    ("similarity_xent", "dims", 536870912, 4096,
     {"triton/dims": 767.0, "torch/default": 2910.0},
     {"triton/dims": "51903531b5c5fc92", "torch/default": "30bf9959ddb60941"}),
    # in-batch negatives: N pairs, M = Mc = 2N rows (N = 1,024, 4,096, 16,384)
    ("similarity_xent", "full", 4194304, 768,
     {"triton/fused": 1.95, "triton/dense": 1.77, "torch/default": 1.47, "cuda/fused": 4.99},
     {"triton/fused": "45d6ada46e5358f5", "triton/dense": "5ef298652026e4ee", "torch/default": "30bf9959ddb60941",
      "cuda/fused": "9039d98ffeec4bf3+76c163ff636742a4"}),
    ("similarity_xent", "full", 4194304, 4096,
     {"triton/fused": 6.53, "triton/dense": 1.27, "torch/default": 2.81, "cuda/fused": 25.9},
     {"triton/fused": "45d6ada46e5358f5", "triton/dense": "5ef298652026e4ee", "torch/default": "30bf9959ddb60941",
      "cuda/fused": "9039d98ffeec4bf3+76c163ff636742a4"}),
    ("similarity_xent", "full", 67108864, 768,
     {"triton/fused": 5.58, "triton/dense": 2.01, "torch/default": 14.0, "cuda/fused": 40.4},
     {"triton/fused": "45d6ada46e5358f5", "triton/dense": "5ef298652026e4ee", "torch/default": "30bf9959ddb60941",
      "cuda/fused": "9039d98ffeec4bf3+76c163ff636742a4"}),
    ("similarity_xent", "full", 67108864, 4096,
     {"triton/fused": 28.5, "triton/dense": 4.55, "torch/default": 46.8, "cuda/fused": 252.0},
     {"triton/fused": "45d6ada46e5358f5", "triton/dense": "5ef298652026e4ee", "torch/default": "30bf9959ddb60941",
      "cuda/fused": "9039d98ffeec4bf3+76c163ff636742a4"}),
    ("similarity_xent", "full", 1073741824, 768,
     {"triton/fused": 84.2, "triton/dense": 16.8, "torch/default": 203.0, "cuda/fused": 535.0},
     {"triton/fused": "45d6ada46e5358f5", "triton/dense": "5ef298652026e4ee", "torch/default": "30bf9959ddb60941",
      "cuda/fused": "9039d98ffeec4bf3+76c163ff636742a4"}),
    ("similarity_xent", "full", 1073741824, 4096,
     {"triton/fused": 447.0, "triton/dense": 52.2, "torch/default": 692.0, "cuda/fused": 2880.0},
     {"triton/fused": "45d6ada46e5358f5", "triton/dense": "5ef298652026e4ee", "torch/default": "30bf9959ddb60941",
      "cuda/fused": "9039d98ffeec4bf3+76c163ff636742a4"}),
    # ArcCon: N rows against the N rows of the other view
    ("similarity_xent", "margin", 1048576, 768,
     {"triton/fused": 1.8, "triton/dense": 2.62, "torch/default": 3.67, "cuda/fused": 2.16},
     {"triton/fused": "45d6ada46e5358f5", "triton/dense": "5ef298652026e4ee", "torch/default": "30bf9959ddb60941",
      "cuda/fused": "9039d98ffeec4bf3+76c163ff636742a4"}),
    ("similarity_xent", "margin", 16777216, 768,
     {"triton/fused": 2.91, "triton/dense": 2.13, "torch/default": 4.82, "cuda/fused": 13.7},
     {"triton/fused": "45d6ada46e5358f5", "triton/dense": "5ef298652026e4ee", "torch/default": "30bf9959ddb60941",
      "cuda/fused": "9039d98ffeec4bf3+76c163ff636742a4"}),
    ("similarity_xent", "margin", 268435456, 768,
     {"triton/fused": 21.7, "triton/dense": 5.94, "torch/default": 54.3, "cuda/fused": 145.0},
     {"triton/fused": "45d6ada46e5358f5", "triton/dense": "5ef298652026e4ee", "torch/default": "30bf9959ddb60941",
      "cuda/fused": "9039d98ffeec4bf3+76c163ff636742a4"}),
)

# The ranking term's float32 scores (what the losses give it), the same runs: up to 4,096 scores the Triton
# backend takes its pairwise tiles, above them sort and scan (triton_ops/ranking_loss.py SMALL_N_MAX).
_H100_FP32_SCORES = (
    ("ranking_loss", "full", 4096, 1,
     {"triton/pairwise": 0.499, "torch/default": 1.13, "cuda/sort": 0.483},
     {"triton/pairwise": "a0e64ba30d279396", "torch/default": "e463ec94d83b8b79",
      "cuda/sort": "4b85a09f9216361e+249cdc38bcd80eed"}),
    ("ranking_loss", "full", 65536, 1,
     {"triton/sort": 1.29, "torch/default": 1.01, "cuda/sort": 2.9},
     {"triton/sort": "9d8df70c3ad9fcb7", "torch/default": "e463ec94d83b8b79",
      "cuda/sort": "4b85a09f9216361e+249cdc38bcd80eed"}),
    ("ranking_loss", "full", 1048576, 1,
     {"triton/sort": 0.93, "torch/default": 1.18, "cuda/sort": 44.4},
     {"triton/sort": "9d8df70c3ad9fcb7", "torch/default": "e463ec94d83b8b79",
      "cuda/sort": "4b85a09f9216361e+249cdc38bcd80eed"}),
    ("ranking_loss", "full", 4194304, 1,
     {"triton/sort": 1.96, "torch/default": 2.11, "cuda/sort": 184.0},
     {"triton/sort": "9d8df70c3ad9fcb7", "torch/default": "e463ec94d83b8b79",
      "cuda/sort": "4b85a09f9216361e+249cdc38bcd80eed"}),
)

# The op sweeps on an H200 (the same compute capability), `python bench/speed_table.py` over four runs in the order
# they ran (a later time of a path replaces an earlier one), each with its own paths and fingerprints:
# bench/results/h200-2026-11-28/second-op-sweep (sources at 14e83fd with 40ac9b5's fix of the checks' selection:
# Triton and torch, up to 16,384 rows of in-batch negatives; larger points are the H100's), then, sources at
# 97c3de1, bench/results/h200-2026-12-04/second-ops (`--ops 'pair_scores(dims),similarity_lse(dims)'`: Triton's
# one-read pair scores against the prefix kernels, similarity_lse's dense dims scheme against the fused kernels per
# prefix, and torch) and bench/results/h200-2026-12-04/second-cuda (the CUDA backend's verified paths, its
# similarity_xent on both schemes), then bench/results/h200-2026-12-04b/second-pair-scores (sources at c6c9642,
# `--ops pair_scores`: Triton's and torch's full-width pair scores timed again, the torch code having changed after
# the first run; with these its points count).
_H200_BF16_EMBEDDINGS = (
    ("pair_scores", "dims", 16384, 768,
     {"triton/dims_one_read": 0.87, "torch/default": 6.16, "triton/dims": 0.629, "cuda/dims": 0.872},
     {"triton/dims_one_read": "fdceae6baa083c7a", "torch/default": "5d3ad5126ea2e4f3",
      "triton/dims": "11ab4505b78faacc", "cuda/dims": "827753944930c13a+f2009f8c30ce51fb"}),
    ("pair_scores", "dims", 16384, 4096,
     {"triton/dims_one_read": 0.989, "torch/default": 14.8, "triton/dims": 1.94, "cuda/dims": 1.45},
     {"triton/dims_one_read": "fdceae6baa083c7a", "torch/default": "5d3ad5126ea2e4f3",
      "triton/dims": "11ab4505b78faacc", "cuda/dims": "827753944930c13a+f2009f8c30ce51fb"}),
    ("pair_scores", "dims", 262144, 768,
     {"triton/dims_one_read": 5.07, "torch/default": 42.1, "triton/dims": 6.78, "cuda/dims": 1.49},
     {"triton/dims_one_read": "fdceae6baa083c7a", "torch/default": "5d3ad5126ea2e4f3",
      "triton/dims": "11ab4505b78faacc", "cuda/dims": "827753944930c13a+f2009f8c30ce51fb"}),
    ("pair_scores", "dims", 262144, 4096,
     {"triton/dims_one_read": 14.6, "torch/default": 171.0, "triton/dims": 30.2, "cuda/dims": 21.1},
     {"triton/dims_one_read": "fdceae6baa083c7a", "torch/default": "5d3ad5126ea2e4f3",
      "triton/dims": "11ab4505b78faacc", "cuda/dims": "827753944930c13a+f2009f8c30ce51fb"}),
    ("pair_scores", "full", 16384, 768,
     {"triton/full": 0.649, "torch/default": 2.26, "cuda/full": 0.442},
     {"triton/full": "efb179d27d83ab85", "torch/default": "5d3ad5126ea2e4f3",
      "cuda/full": "6a8db345bda6e7d2+f2009f8c30ce51fb"}),
    ("pair_scores", "full", 16384, 4096,
     {"triton/full": 0.768, "torch/default": 6.89, "cuda/full": 0.55},
     {"triton/full": "efb179d27d83ab85", "torch/default": "5d3ad5126ea2e4f3",
      "cuda/full": "6a8db345bda6e7d2+f2009f8c30ce51fb"}),
    ("pair_scores", "full", 262144, 768,
     {"triton/full": 1.04, "torch/default": 21.2, "cuda/full": 0.632},
     {"triton/full": "efb179d27d83ab85", "torch/default": "5d3ad5126ea2e4f3",
      "cuda/full": "6a8db345bda6e7d2+f2009f8c30ce51fb"}),
    ("pair_scores", "full", 262144, 4096,
     {"triton/full": 3.79, "torch/default": 109.0, "cuda/full": 3.16},
     {"triton/full": "efb179d27d83ab85", "torch/default": "5d3ad5126ea2e4f3",
      "cuda/full": "6a8db345bda6e7d2+f2009f8c30ce51fb"}),
    ("pair_scores", "full", 1048576, 768,
     {"triton/full": 3.74, "torch/default": 84.0, "cuda/full": 2.4},
     {"triton/full": "efb179d27d83ab85", "torch/default": "5d3ad5126ea2e4f3",
      "cuda/full": "6a8db345bda6e7d2+f2009f8c30ce51fb"}),
    ("pair_scores", "full", 1048576, 4096,
     {"triton/full": 15.1, "torch/default": 508.0, "cuda/full": 12.5},
     {"triton/full": "efb179d27d83ab85", "torch/default": "5d3ad5126ea2e4f3",
      "cuda/full": "6a8db345bda6e7d2+f2009f8c30ce51fb"}),
    ("similarity_lse", "dims", 2097152, 768,
     {"triton/fused_prefixes": 11.1, "triton/dense_dims": 6.67, "torch/default": 7.29, "cuda/dense_dims": 10.6},
     {"triton/fused_prefixes": "09b0e7b72e8d98c5", "triton/dense_dims": "b409e85b230bf86a",
      "torch/default": "82899cd9bc80d6e2", "cuda/dense_dims": "6711b448b53e809c+e218dc84321aba71"}),
    ("similarity_lse", "dims", 2097152, 4096,
     {"triton/fused_prefixes": 19.0, "triton/dense_dims": 6.23, "torch/default": 7.18, "cuda/dense_dims": 6.0},
     {"triton/fused_prefixes": "09b0e7b72e8d98c5", "triton/dense_dims": "b409e85b230bf86a",
      "torch/default": "82899cd9bc80d6e2", "cuda/dense_dims": "6711b448b53e809c+e218dc84321aba71"}),
    ("similarity_lse", "dims", 33554432, 768,
     {"triton/fused_prefixes": 14.2, "triton/dense_dims": 7.69, "torch/default": 37.6, "cuda/dense_dims": 11.4},
     {"triton/fused_prefixes": "09b0e7b72e8d98c5", "triton/dense_dims": "b409e85b230bf86a",
      "torch/default": "82899cd9bc80d6e2", "cuda/dense_dims": "6711b448b53e809c+e218dc84321aba71"}),
    ("similarity_lse", "dims", 33554432, 4096,
     {"triton/dense_dims": 11.4, "torch/default": 47.3, "triton/fused_prefixes": 74.0, "cuda/dense_dims": 10.0},
     {"triton/dense_dims": "b409e85b230bf86a", "torch/default": "82899cd9bc80d6e2",
      "triton/fused_prefixes": "09b0e7b72e8d98c5", "cuda/dense_dims": "6711b448b53e809c+e218dc84321aba71"}),
    ("similarity_lse", "dims", 536870912, 768,
     {"triton/fused_prefixes": 109.0, "triton/dense_dims": 70.9, "torch/default": 453.0, "cuda/dense_dims": 54.3},
     {"triton/fused_prefixes": "09b0e7b72e8d98c5", "triton/dense_dims": "b409e85b230bf86a",
      "torch/default": "82899cd9bc80d6e2", "cuda/dense_dims": "6711b448b53e809c+e218dc84321aba71"}),
    ("similarity_lse", "dims", 536870912, 4096,
     {"triton/fused_prefixes": 749.0, "triton/dense_dims": 142.0, "torch/default": 794.0, "cuda/dense_dims": 126.0},
     {"triton/fused_prefixes": "09b0e7b72e8d98c5", "triton/dense_dims": "b409e85b230bf86a",
      "torch/default": "82899cd9bc80d6e2", "cuda/dense_dims": "6711b448b53e809c+e218dc84321aba71"}),
    ("similarity_lse", "full", 2097152, 768,
     {"triton/fused": 1.92, "triton/dense": 3.14, "torch/default": 3.52, "cuda/dense": 4.25},
     {"triton/fused": "7734c06fbe9d86d2", "triton/dense": "81a85b600be697cc", "torch/default": "82899cd9bc80d6e2",
      "cuda/dense": "6711b448b53e809c+e218dc84321aba71"}),
    ("similarity_lse", "full", 2097152, 4096,
     {"triton/fused": 5.15, "triton/dense": 2.64, "torch/default": 3.48, "cuda/dense": 4.0},
     {"triton/fused": "7734c06fbe9d86d2", "triton/dense": "81a85b600be697cc", "torch/default": "82899cd9bc80d6e2",
      "cuda/dense": "6711b448b53e809c+e218dc84321aba71"}),
    ("similarity_lse", "full", 33554432, 768,
     {"triton/fused": 4.49, "triton/dense": 4.34, "torch/default": 6.71, "cuda/dense": 5.5},
     {"triton/fused": "7734c06fbe9d86d2", "triton/dense": "81a85b600be697cc", "torch/default": "82899cd9bc80d6e2",
      "cuda/dense": "6711b448b53e809c+e218dc84321aba71"}),
    ("similarity_lse", "full", 33554432, 4096,
     {"triton/fused": 21.5, "triton/dense": 4.25, "torch/default": 25.3, "cuda/dense": 5.63},
     {"triton/fused": "7734c06fbe9d86d2", "triton/dense": "81a85b600be697cc", "torch/default": "82899cd9bc80d6e2",
      "cuda/dense": "6711b448b53e809c+e218dc84321aba71"}),
    ("similarity_xent", "dims", 2097152, 768,
     {"triton/dims": 4.31, "triton/dense_dims": 4.68, "torch/default": 4.54, "torch/mixed": 6.47,
      "cuda/dense_dims": 7.12},
     {"triton/dims": "51903531b5c5fc92", "triton/dense_dims": "baec28435cd67c56", "torch/default": "382d011fd3adc6d7",
      "torch/mixed": "b33166b630c71c45", "cuda/dense_dims": "8f6f75b12223eca5+41fc678dc111ff10"}),
    ("similarity_xent", "dims", 2097152, 4096,
     {"triton/dims": 16.7, "triton/dense_dims": 6.62, "torch/default": 5.77, "torch/mixed": 5.35,
      "cuda/dense_dims": 7.1},
     {"triton/dims": "51903531b5c5fc92", "triton/dense_dims": "baec28435cd67c56", "torch/default": "382d011fd3adc6d7",
      "torch/mixed": "b33166b630c71c45", "cuda/dense_dims": "8f6f75b12223eca5+41fc678dc111ff10"}),
    ("similarity_xent", "dims", 33554432, 768,
     {"triton/dims": 15.0, "triton/dense_dims": 9.32, "torch/default": 16.3, "torch/mixed": 23.1,
      "cuda/dense_dims": 11.5},
     {"triton/dims": "51903531b5c5fc92", "triton/dense_dims": "baec28435cd67c56", "torch/default": "382d011fd3adc6d7",
      "torch/mixed": "b33166b630c71c45", "cuda/dense_dims": "8f6f75b12223eca5+41fc678dc111ff10"}),
    ("similarity_xent", "dims", 33554432, 4096,
     {"triton/dims": 73.3, "triton/dense_dims": 11.4, "torch/default": 39.9, "torch/mixed": 18.1,
      "cuda/dense_dims": 12.9},
     {"triton/dims": "51903531b5c5fc92", "triton/dense_dims": "baec28435cd67c56", "torch/default": "382d011fd3adc6d7",
      "torch/mixed": "b33166b630c71c45", "cuda/dense_dims": "8f6f75b12223eca5+41fc678dc111ff10"}),
    ("similarity_xent", "full", 2097152, 768,
     {"triton/fused": 1.68, "triton/dense": 2.42, "torch/default": 2.65, "torch/mixed": 2.45, "cuda/dense": 2.78},
     {"triton/fused": "45d6ada46e5358f5", "triton/dense": "5ef298652026e4ee", "torch/default": "382d011fd3adc6d7",
      "torch/mixed": "b33166b630c71c45", "cuda/dense": "abc9b7c6cb7c3b46+41fc678dc111ff10"}),
    ("similarity_xent", "full", 2097152, 4096,
     {"triton/fused": 4.75, "triton/dense": 2.0, "torch/default": 2.09, "torch/mixed": 2.14, "cuda/dense": 2.77},
     {"triton/fused": "45d6ada46e5358f5", "triton/dense": "5ef298652026e4ee", "torch/default": "382d011fd3adc6d7",
      "torch/mixed": "b33166b630c71c45", "cuda/dense": "abc9b7c6cb7c3b46+41fc678dc111ff10"}),
    ("similarity_xent", "full", 4194304, 768,
     {"triton/fused": 1.91, "triton/dense": 1.66, "torch/default": 1.88, "torch/mixed": 1.62, "cuda/fused": 5.15,
      "cuda/dense": 2.4},
     {"triton/fused": "45d6ada46e5358f5", "triton/dense": "5ef298652026e4ee", "torch/default": "382d011fd3adc6d7",
      "torch/mixed": "b33166b630c71c45", "cuda/fused": "9039d98ffeec4bf3+76c163ff636742a4",
      "cuda/dense": "abc9b7c6cb7c3b46+41fc678dc111ff10"}),
    ("similarity_xent", "full", 4194304, 4096,
     {"triton/fused": 6.66, "triton/dense": 1.33, "torch/default": 2.75, "torch/mixed": 1.76, "cuda/fused": 26.8,
      "cuda/dense": 2.45},
     {"triton/fused": "45d6ada46e5358f5", "triton/dense": "5ef298652026e4ee", "torch/default": "382d011fd3adc6d7",
      "torch/mixed": "b33166b630c71c45", "cuda/fused": "9039d98ffeec4bf3+76c163ff636742a4",
      "cuda/dense": "abc9b7c6cb7c3b46+41fc678dc111ff10"}),
    ("similarity_xent", "full", 33554432, 768,
     {"triton/fused": 3.97, "triton/dense": 2.1, "torch/default": 4.54, "torch/mixed": 4.56, "cuda/dense": 3.08},
     {"triton/fused": "45d6ada46e5358f5", "triton/dense": "5ef298652026e4ee", "torch/default": "382d011fd3adc6d7",
      "torch/mixed": "b33166b630c71c45", "cuda/dense": "abc9b7c6cb7c3b46+41fc678dc111ff10"}),
    ("similarity_xent", "full", 33554432, 4096,
     {"triton/fused": 20.8, "triton/dense": 3.51, "torch/default": 18.8, "torch/mixed": 3.89, "cuda/dense": 3.4},
     {"triton/fused": "45d6ada46e5358f5", "triton/dense": "5ef298652026e4ee", "torch/default": "382d011fd3adc6d7",
      "torch/mixed": "b33166b630c71c45", "cuda/dense": "abc9b7c6cb7c3b46+41fc678dc111ff10"}),
    ("similarity_xent", "full", 67108864, 768,
     {"triton/fused": 5.02, "triton/dense": 1.74, "torch/default": 8.76, "torch/mixed": 3.45, "cuda/fused": 41.6,
      "cuda/dense": 2.72},
     {"triton/fused": "45d6ada46e5358f5", "triton/dense": "5ef298652026e4ee", "torch/default": "382d011fd3adc6d7",
      "torch/mixed": "b33166b630c71c45", "cuda/fused": "9039d98ffeec4bf3+76c163ff636742a4",
      "cuda/dense": "abc9b7c6cb7c3b46+41fc678dc111ff10"}),
    ("similarity_xent", "full", 67108864, 4096,
     {"triton/fused": 27.8, "triton/dense": 4.23, "torch/default": 36.0, "torch/mixed": 5.26, "cuda/fused": 256.0,
      "cuda/dense": 4.18},
     {"triton/fused": "45d6ada46e5358f5", "triton/dense": "5ef298652026e4ee", "torch/default": "382d011fd3adc6d7",
      "torch/mixed": "b33166b630c71c45", "cuda/fused": "9039d98ffeec4bf3+76c163ff636742a4",
      "cuda/dense": "abc9b7c6cb7c3b46+41fc678dc111ff10"}),
    ("similarity_xent", "full", 1073741824, 768,
     {"triton/fused": 80.4, "triton/dense": 15.7, "cuda/fused": 548.0, "cuda/dense": 17.3},
     {"triton/fused": "45d6ada46e5358f5", "triton/dense": "5ef298652026e4ee",
      "cuda/fused": "9039d98ffeec4bf3+76c163ff636742a4", "cuda/dense": "abc9b7c6cb7c3b46+41fc678dc111ff10"}),
    ("similarity_xent", "margin", 1048576, 768,
     {"triton/fused": 1.82, "triton/dense": 1.71, "torch/default": 2.36, "torch/mixed": 2.57, "cuda/fused": 2.24,
      "cuda/dense": 4.19},
     {"triton/fused": "45d6ada46e5358f5", "triton/dense": "5ef298652026e4ee", "torch/default": "382d011fd3adc6d7",
      "torch/mixed": "b33166b630c71c45", "cuda/fused": "9039d98ffeec4bf3+76c163ff636742a4",
      "cuda/dense": "abc9b7c6cb7c3b46+41fc678dc111ff10"}),
    ("similarity_xent", "margin", 16777216, 768,
     {"triton/fused": 2.94, "triton/dense": 1.97, "torch/default": 3.31, "torch/mixed": 3.73, "cuda/fused": 14.1,
      "cuda/dense": 3.25},
     {"triton/fused": "45d6ada46e5358f5", "triton/dense": "5ef298652026e4ee", "torch/default": "382d011fd3adc6d7",
      "torch/mixed": "b33166b630c71c45", "cuda/fused": "9039d98ffeec4bf3+76c163ff636742a4",
      "cuda/dense": "abc9b7c6cb7c3b46+41fc678dc111ff10"}),
)

_H200_FP32_SCORES = (
    ("ranking_loss", "full", 4096, 1,
     {"triton/pairwise": 0.434, "torch/default": 0.937, "cuda/sort": 0.756},
     {"triton/pairwise": "a0e64ba30d279396", "torch/default": "e463ec94d83b8b79",
      "cuda/sort": "4b85a09f9216361e+d5b614b1855acd82"}),
    ("ranking_loss", "full", 65536, 1,
     {"triton/sort": 1.24, "torch/default": 1.1, "cuda/sort": 0.719},
     {"triton/sort": "9d8df70c3ad9fcb7", "torch/default": "e463ec94d83b8b79",
      "cuda/sort": "4b85a09f9216361e+d5b614b1855acd82"}),
    ("ranking_loss", "full", 1048576, 1,
     {"triton/sort": 1.18, "torch/default": 1.18, "cuda/sort": 0.632},
     {"triton/sort": "9d8df70c3ad9fcb7", "torch/default": "e463ec94d83b8b79",
      "cuda/sort": "4b85a09f9216361e+d5b614b1855acd82"}),
)


def _replacing(newer: tuple, older: tuple) -> tuple:
    """The points of `newer`, and those of `older` at the places (op, variant, size, width) `newer` did not measure:
    a later run of the same compute capability replaces an earlier one's points where it measured."""
    measured_again = {point[:4] for point in newer}
    return newer + tuple(point for point in older if point[:4] not in measured_again)


# (capability, dtype of the op's first input) -> the points measured there.
MEASURED: dict[tuple[str, torch.dtype], tuple] = {
    ("9.0", torch.bfloat16): _replacing(_H200_BF16_EMBEDDINGS, _H100_BF16_EMBEDDINGS),
    ("9.0", torch.float32): _replacing(_H200_FP32_SCORES, _H100_FP32_SCORES)}


def call_point(op: str, call: contract.Call) -> tuple[str, int, int] | None:
    """(variant, size, width) of a validated call (contract.check_<op>), or None for an op no sweep measures."""
    if op == "pair_scores":
        groups, k, width = call.x.shape
        return ("dims" if call.dims else "full"), groups * (k - 1), width
    if op == "ranking_loss":
        return "full", call.scores.shape[0], 1
    if op == "similarity_xent":
        q, c = call.q, call.c
        columns = q.shape[0] if c is None else c.shape[0]
        variant = "dims" if call.dims else "margin" if call.margin > 0 else "full"
        return variant, q.shape[0] * columns, q.shape[1]
    if op == "similarity_lse":
        variant = "dims" if call.dims else "full"
        if call.dims and call.filter_threshold is not None:  # untimed: the dense dims schemes' filter flaw (above)
            variant = "dims filtered"
        return variant, call.q.shape[0] * call.c.shape[0], call.q.shape[1]
    return None


def capability(device: torch.device) -> str | None:
    """The compute capability ("major.minor") of a CUDA device; None for any other device (nothing measured)."""
    if device.type != "cuda":
        return None
    return ".".join(map(str, torch.cuda.get_device_capability(device)))


def joined_fingerprint(backend: str, code: dict) -> str | None:
    """A path's code fields (verified.CODE_FIELDS: the path's fingerprint and, for cuda, its op's CUDA sources')
    as the one string a point records, joined by "+"; None when one is unknown."""
    values = [code.get(name) for name in verified.CODE_FIELDS.get(backend, ("fingerprint",))]
    return None if None in values else "+".join(values)


# (backend, op, path) -> code_fingerprint, once per process. A plain dict, as in dispatch (torch.compile traces it).
_installed: dict[tuple[str, str, str], str | None] = {}


def code_fingerprint(backend: str, op: str, path: str) -> str | None:
    """The fingerprint of this installation's code for a path, as points record it (verified.code_identity; for
    cuda the build the loaded extension reports), or None when it cannot be told (no usable time then)."""
    key = (backend, op, path)
    if key not in _installed:
        try:
            _installed[key] = joined_fingerprint(backend, verified.code_identity(backend, op, path))
        except Exception:  # noqa: BLE001 (choosing a backend must not fail on this question)
            _installed[key] = None
    return _installed[key]


def nearest_points(op: str, call: contract.Call) -> list[tuple]:
    """The points measured nearest to this call (same GPU, dtype, op and variant; size and width within SPAN): all
    those at the least distance, the distance of log size plus that of log width; none for an empty call."""
    where = call_point(op, call)
    if where is None:
        return []
    variant, size, width = where
    if size <= 0:  # an empty call: nothing to choose by
        return []
    nearest, least = [], math.inf
    for point in MEASURED.get((capability(call.device), call.dtype), ()):
        p_op, p_variant, p_size, p_width = point[:4]
        if (p_op, p_variant) != (op, variant):
            continue
        size_ratio, width_ratio = abs(math.log(size / p_size)), abs(math.log(width / p_width))
        if max(size_ratio, width_ratio) > math.log(SPAN):
            continue
        distance = size_ratio + width_ratio
        if math.isclose(distance, least, rel_tol=1e-9, abs_tol=1e-12):
            nearest.append(point)
        elif distance < least:
            nearest, least = [point], distance
    return nearest


def point_choice(times: list[tuple[Candidate, float | None]]) -> Candidate:
    """What one point says among candidates in the fixed order, each with its time there (None: not timed there, or
    timed on code changed since): the first candidate where it has no time (the fixed order decides), else the
    quickest timed one, a time within TIE of it counting as equal and equals going by the fixed order. A candidate
    without a time behind a timed one is taken to be no faster than it, as the fixed order ranks them, so it never
    displaces the quickest measured one: a time an edit retired leaves the other candidates' comparison standing."""
    first, first_ms = times[0]
    if first_ms is None:
        return first
    timed = [(candidate, ms) for candidate, ms in times if ms is not None]
    quickest = min(ms for _, ms in timed)
    return next(candidate for candidate, ms in timed if ms <= quickest * (1 + TIE))


def _decision(point: tuple, op: str, keys: list[str], allowed: list[Candidate]) -> Candidate:
    """What one point says about `allowed` (in the fixed order, each on its path, `keys`): `point_choice` over their
    times there that measured this installation's code."""
    times, prints = point[4], point[5]
    usable = []
    for candidate, key in zip(allowed, keys):
        ms = times.get(key)
        current = ms is not None and prints.get(key) is not None and prints[key] == code_fingerprint(
            candidate.name, op, key.partition("/")[2])
        usable.append((candidate, ms if current else None))
    return point_choice(usable)


# Exceptions to the fixed order, where no time of the current code decides: torch comes before them. The CUDA
# backend's similarity ops, timed on an H200 (bench/results/h200-2026-12-04/second-cuda, bf16): slower than the
# torch backend at most points up to 4M logits (similarity_xent's dense scheme 2.40 ms against torch's 16-bit
# products' 1.62 at 2,048 x 2,048 logits, D = 768; similarity_lse 4.25 against 3.52 at 1,024 x 2,048, and with dims
# 10.6 against 7.29), equal to 8.3x faster from 16M logits up; below the points, where launches dominate, torch is
# the safer guess. The CUDA pair scores (7-28x faster than torch at every point with dims; 5.1-41x at full width)
# and ranking term (1.2-1.9x, 4,096 to 1M scores) keep their place in the fixed
# order, before torch.
AFTER_TORCH = {("cuda", "similarity_xent"), ("cuda", "similarity_lse")}


def fixed_order(op: str, allowed: list[Candidate]) -> list[Candidate]:
    """`allowed` (triton, cuda, torch: its GPU path, then its default one) with the exceptions of AFTER_TORCH moved
    behind torch (behind both of its paths)."""
    late = [c for c in allowed if (c.name, op) in AFTER_TORCH]
    rest = [c for c in allowed if c not in late]
    at = len(rest)  # behind the last torch entry (a loop: torch.compile cannot trace max(generator, default=))
    for i, candidate in enumerate(rest):
        if candidate.name == "torch":
            at = i + 1
    return rest[:at] + late + rest[at:]


def fastest(op: str, call: contract.Call, paths: dict[Candidate, str]) -> Candidate:
    """The backend of `paths` (those that may compute the call, in the fixed order: triton, cuda, torch; each with
    the code path it takes for the call) that computes the call: the rule of the module docstring, with the
    exceptions of AFTER_TORCH."""
    allowed = fixed_order(op, list(paths))
    if len(allowed) == 1:
        return allowed[0]
    nearest = nearest_points(op, call)
    if not nearest:
        return allowed[0]
    keys = [f"{candidate.name}/{paths[candidate]}" for candidate in allowed]
    decided = {id(choice): choice for choice in (_decision(point, op, keys, allowed) for point in nearest)}
    return next(iter(decided.values())) if len(decided) == 1 else allowed[0]
