"""The torch backend's similarity_lse: which code computes a call (the op module `load_ops` names).

On CPU tensors, cosines at full width without `reference` compute in the softmax form (_similarity_lse_softmax.py:
unit rows, torch's fused softmax, fewer passes over each block's tiles: what a CPU call pays for), and so do raw dot
products at full width (with or without `reference`) where its `takes_dot_products` accepts them; every other call,
on any other device, with dims, or of dot products it does not take, computes by similarity_lse.py (the blocked form:
SimilarityLseFunction, PrefixSimilarityLseFunction), the code the GPU op sweeps timed, whose fingerprint their times
carry (angle_kernels.measured: an edit there would retire them). Both forms are exact to the float64 reference on
every case of the CPU suite (tests/ops/test_similarity_lse.py runs each).
"""

from __future__ import annotations

import torch

from . import _similarity_lse_softmax, similarity_lse as blocked
from .similarity_lse import FEATURES  # noqa: F401  (the op module's declarations)


def similarity_lse(q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c,
                   filter_threshold, filter_keeps_target, normalize, dims=None, reference=None):
    """The op (similarity_lse.py's contract): the softmax form for CPU calls of cosines at full width without
    reference and of the dot products at full width it takes, the blocked form for everything else."""
    if q.device.type == "cpu" and normalize and dims is None and reference is None:
        return _similarity_lse_softmax.similarity_lse(q, c, scale, target_offset, period, exclude, penalty,
                                                      penalty_on, filter_q, filter_c, filter_threshold,
                                                      filter_keeps_target)
    if q.device.type == "cpu" and normalize and dims is not None and reference is None and filter_threshold is not None:
        return _filtered_prefixes_one_by_one(q, c, scale, target_offset, period, exclude, penalty, penalty_on,
                                             filter_q, filter_c, filter_threshold, filter_keeps_target, dims)
    if (q.device.type == "cpu" and not normalize and dims is None
            and _similarity_lse_softmax.takes_dot_products(q, c, reference, scale, penalty, filter_q, filter_c,
                                                           filter_threshold)):
        return _similarity_lse_softmax.dot_similarity_lse(q, c, scale, target_offset, period, exclude, penalty,
                                                          penalty_on, filter_q, filter_c, filter_threshold,
                                                          filter_keeps_target, reference=reference)
    return blocked.similarity_lse(q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q,
                                  filter_c, filter_threshold, filter_keeps_target, normalize, dims=dims,
                                  reference=reference)


def _filtered_prefixes_one_by_one(q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q, filter_c,
                                  filter_threshold, filter_keeps_target, dims):
    """A CPU call of cosines with dims and a filter: each prefix by the softmax form on the truncated inputs, the
    rows stacked [k, M]. The blocked form's prefix walk does one width's products, but with a filter its backward
    makes every prefix's filtered exponentials again, and on the CPU that costs more than the products it saves:
    MNRL with a false-negative filter and 4-5 widths took 1.4-2x the time of one call per width (512-4,096 queries,
    D = 256 and 768, one thread), where the softmax form of a call whose logits fit one tile keeps its softmax for
    backward. Without a filter the walk is as fast or faster (hardness at 4,096 queries: 1.14 s against 1.38 s)."""
    rows = []
    for p, d in enumerate(dims):
        rows.append(_similarity_lse_softmax.similarity_lse(
            q[:, :d], c[:, :d], scale, target_offset, period, exclude, penalty, penalty_on,
            None if filter_q is None else filter_q[:, :d], None if filter_c is None else filter_c[:, :d],
            filter_threshold[p], filter_keeps_target))
    return torch.stack(rows)
