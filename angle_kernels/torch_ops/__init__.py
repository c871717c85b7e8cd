"""The pure-PyTorch backend: exact, O(N) extra memory (never an N x N matrix), runs on any device.

Implements `angle_kernels.contract.Backend`: inputs arrive validated by `angle_kernels.dispatch`."""

from .pair_scores import pair_scores
from .ranking import ranking_loss
from .similarity_xent import similarity_xent


def is_available() -> tuple[bool, str]:
    return True, ""


__all__ = ["pair_scores", "ranking_loss", "similarity_xent", "is_available"]
