"""The losses as functions (`angle_kernels.losses`, by family), importable from here as before."""

from .inputs import Dims, DimWeights, LayerWeights  # noqa: F401  (the public signatures' annotations)
from .losses.angle import angle_loss, contrastive_with_negative_loss, cosine_loss, in_batch_negative_loss
from .losses.arccse import arccon_loss, triplet_loss
from .losses.retrieval import gist_loss, multiple_negatives_ranking_loss

__all__ = [
    "cosine_loss",
    "angle_loss",
    "in_batch_negative_loss",
    "contrastive_with_negative_loss",
    "arccon_loss",
    "triplet_loss",
    "multiple_negatives_ranking_loss",
    "gist_loss",
]
