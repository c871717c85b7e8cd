"""The pure-PyTorch backend: exact, O(N) extra memory (never an N x N matrix), runs on any device.

One module per op, named after it (`contract.OPS`): pair_scores.py, ranking_loss.py, similarity_xent.py,
similarity_lse.py; `load_ops()` names them (for similarity_xent and similarity_lse their routers,
similarity_xent_paths.py and similarity_lse_paths.py, which send CPU calls to the softmax forms) and `dispatch`
calls it. Inputs arrive validated by `angle_kernels.dispatch`."""

from __future__ import annotations

from types import ModuleType


def is_available() -> tuple[bool, str]:
    return True, ""


def load_ops() -> dict[str, ModuleType]:
    """This backend's op modules by op name (`contract.OPS`): each defines the function named after its op."""
    from . import pair_scores, ranking_loss, similarity_lse_paths, similarity_xent_paths

    return {"pair_scores": pair_scores, "ranking_loss": ranking_loss, "similarity_xent": similarity_xent_paths,
            "similarity_lse": similarity_lse_paths}
