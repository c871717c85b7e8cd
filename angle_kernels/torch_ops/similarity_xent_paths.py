"""The torch backend's similarity_xent: which code computes a call (the op module `load_ops` names).

Code paths (PATHS, `code_path`: torch_ops/similarity_xent.py's): "default" and, for 16-bit rows on a GPU with
mixed-dtype products, "mixed". On CPU tensors the "default" path computes in the softmax form
(_similarity_xent_softmax.py: about half the passes over each block's logits, what a CPU call pays for, and a small
loss's digits kept; with dims too; rows against themselves from a few tiles on by the triangular schedule of
_similarity_xent_symmetric.py); every other call, on any other device or path, computes by similarity_xent.py
(the blocked form: SimilarityXentFunction, PrefixSimilarityXentFunction with dims, the Mixed Functions on "mixed"),
the code the GPU op sweeps timed, whose fingerprint their times carry (angle_kernels.measured: an edit there would
retire them). Both forms are exact to the float64 reference on every case of the CPU suite
(tests/ops/test_similarity_xent.py runs each).
"""

from __future__ import annotations

from . import _similarity_xent_softmax, similarity_xent as blocked
from .similarity_xent import FEATURES, PATHS, code_path  # noqa: F401  (the op module's declarations)


def similarity_xent(q, c, scale, target, row_weights=None, exclude_diagonal=False, margin=0.0, group_ids=None,
                    dims=None, path=None):
    """The op on the code path `path` (PATHS; by default the one `code_path` names): "default" on CPU tensors in
    the softmax form, everything else by similarity_xent.py."""
    if path is None:
        path = code_path(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids, dims)
    if path == "default" and q.device.type == "cpu":
        return _similarity_xent_softmax.similarity_xent(q, c, scale, target, row_weights, exclude_diagonal, margin,
                                                        group_ids, dims)
    return blocked.similarity_xent(q, c, scale, target, row_weights, exclude_diagonal, margin, group_ids, dims,
                                   path=path)
