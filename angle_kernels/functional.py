"""The losses as functions (`angle_kernels.losses`, by family), importable from here as before."""

from .inputs import Dims, DimWeights, LayerWeights  # noqa: F401  (the public signatures' annotations)
from .losses import *  # noqa: F401,F403
from .losses import __all__  # noqa: F401  (the one list of the losses)
