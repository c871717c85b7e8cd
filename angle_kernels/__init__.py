"""angle_kernels: fused, memory-efficient AnglE and ArcCSE losses for training text embedding models.

A drop-in for `angle_emb.loss` / `angle_emb.AngleLoss` (angle-emb 0.6.1): same names, arguments, defaults and
zigzag layout, computed without any N x N matrix by fused Triton kernels (CUDA tensors), a CUDA C++
extension, or an exact pure-PyTorch path (any device).

    import angle_kernels as ak
    loss = ak.cosine_loss(y_true, y_pred)                      # CoSENT
    loss = ak.AngleLoss(cosine_w=1, ibn_w=0, angle_w=1, dataset_format="A")(labels, outputs)

See `help(angle_kernels.losses)` for the losses (by family), `angle_kernels.dispatch` for the ops and backends, and
`angle_kernels.inputs` for input validation (and how to switch its device syncs off).
"""

from . import functional, losses  # noqa: F401  (functional: the losses' former module, kept)
from ._version import __version__
from .inputs import input_checks, input_checks_enabled, set_input_checks
from .dispatch import BACKENDS, resolve_backend
from .losses import *  # noqa: F403  (the losses: losses.__all__)
from .modules import AngleLoss, ArcCSELoss

__all__ = [
    "__version__",
    *losses.__all__,
    "AngleLoss",
    "ArcCSELoss",
    "set_input_checks",
    "input_checks",
    "input_checks_enabled",
    "resolve_backend",
    "BACKENDS",
]
