"""The losses, as functions, in three families: drop-in replacements for `angle_emb.loss` (angle-emb 0.6.1),
ArcCSE's and sentence-transformers'.

Names, arguments, defaults and the zigzag layout are the reference's: `y_pred` is [2N, D] with the two texts
of pair k on rows 2k and 2k+1, and `y_true` is [2N] or [2N, 1] with the pair's label on both rows. Each loss
is assembled from the ops described in `angle_kernels.dispatch`, computed by the backend chosen with
the keyword-only `backend` argument ("auto", "torch", "triton", "cuda"; default: the environment variable
ANGLE_KERNELS_BACKEND, else "auto"). No loss materialises an N x N matrix.

Every loss returns a 0-dim tensor: float64 for float64 inputs, float32 otherwise (bfloat16/float16 inputs are
accumulated in float32). Embeddings of different float dtypes in one loss are promoted to their common dtype
(inputs.promote_embeddings: float32 with float64 computes, and returns, float64). Where the reference misbehaves,
these functions do the safe thing (README: "Deviations from the reference"): zero vectors give finite values,
labels outside {0, 1} for the in-batch negative loss raise ValueError, fp16 norms above 256 do not overflow,
finite rows whose squared norms or dot products overflow the compute dtype are scaled by powers of two (every
backend, exact: the cosines do not change), bad input raises ValueError/TypeError, and every tau, scale and
temperature must be finite and > 0 (inputs.check_scale, one rule for all). Meta tensors give meta outputs.

Matryoshka training: every loss but gist_loss takes `dims` (prefix widths d_1, ..., d_k <= D, in any order) and
`dim_weights` (default 1 each) and returns sum_i dim_weights[i] * loss(embeddings[..., :dims[i]]), the loss of
sentence-transformers' MatryoshkaLoss, computed from one read of the embeddings by the ops' nested-prefix
feature (see angle_kernels.dispatch) rather than one loss call per width.

Layer-wise (Espresso / 2D-Matryoshka) training: with `layer_weights`, every embedding argument is a stack
[L, rows, D] of L layers' embeddings (the same rows, e.g. the pooled hidden states of L layers) and the loss is
sum_l layer_weights[l] * loss(embeddings[l]) (each with its dims, weighted by layer_weights[l] * dim_weights[i]);
with dims, layer_weights may also give a row of len(dims) weights per layer (replacing dim_weights: Espresso
weights the final width of the earlier layers 0), and a term weighted 0 is not computed. The pair-score losses
(cosine, angle, triplet and the ranking terms of AngleLoss) score every layer and prefix in one op call; the
softmax losses run one op call per layer (for all of its prefixes).

The families, each readable in one module from its public functions to the op calls:

    angle_kernels.losses.angle       cosine_loss, angle_loss, in_batch_negative_loss, contrastive_with_negative_loss
    angle_kernels.losses.arccse      arccon_loss, triplet_loss
    angle_kernels.losses.retrieval   multiple_negatives_ranking_loss, gist_loss (sentence-transformers' family)

A public function checks its arguments with `angle_kernels.inputs`, resolves the backend and calls its family's
formula, where each formula is written once; `AngleLoss`, `ArcCSELoss` and the integrations check their own
inputs once and call the formulas directly. Imports go downward only: losses -> inputs, dispatch, contract,
distributed.
"""

from .angle import angle_loss, contrastive_with_negative_loss, cosine_loss, in_batch_negative_loss
from .arccse import arccon_loss, triplet_loss
from .retrieval import gist_loss, multiple_negatives_ranking_loss

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
