"""The loss formulas, importable from here as before: each is written once, in its family's module of
`angle_kernels.losses` (angle, arccse, retrieval)."""

from .inputs import combined, nested_dims  # noqa: F401
from .losses.angle import (  # noqa: F401
    as_pairs,
    in_batch_negatives,
    pair_score_table,
    positive_pairs,
    ranking_terms,
)
from .losses.arccse import arccon, triplet  # noqa: F401
from .losses.retrieval import (  # noqa: F401
    contrastive,
    gist,
    margin_threshold,
    multiple_negatives,
    multiple_negatives_rows,
    positive_scores,
)
