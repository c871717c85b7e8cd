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
    if (q.device.type == "cpu" and not normalize and dims is None
            and _similarity_lse_softmax.takes_dot_products(q, c, reference, scale, penalty, filter_q, filter_c,
                                                           filter_threshold)):
        return _similarity_lse_softmax.dot_similarity_lse(q, c, scale, target_offset, period, exclude, penalty,
                                                          penalty_on, filter_q, filter_c, filter_threshold,
                                                          filter_keeps_target, reference=reference)
    return blocked.similarity_lse(q, c, scale, target_offset, period, exclude, penalty, penalty_on, filter_q,
                                  filter_c, filter_threshold, filter_keeps_target, normalize, dims=dims,
                                  reference=reference)
