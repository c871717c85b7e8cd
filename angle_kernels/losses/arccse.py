"""The ArcCSE losses (Zhang et al., ACL 2022), from the public functions to the op calls.

    arccon_loss    the additive angular margin contrastive loss (Eq. 3): one similarity_xent call with a margin
    triplet_loss   the triplet loss of the weak and strong views (Eq. 4): one pair-score pass

Each public function checks its arguments (`angle_kernels.inputs`), resolves the backend and calls its formula,
written once here; `ArcCSELoss` (angle_kernels.modules) calls the formulas directly. Shared conventions:
angle_kernels.losses.
"""

from __future__ import annotations

import torch

from ..contract import loss_entry
from ..dispatch import Ops, resolve_backend
from ..inputs import (
    Dims,
    DimWeights,
    LayerWeights,
    Nested,
    check_arccon_options,
    check_layer_stack,
    check_margin_fits,
    check_nested,
    check_scaled_weights_fit,
    check_scalar,
    check_triplets,
    check_two_views,
    combined,
    nested_dims,
    promote_embeddings,
)
from .angle import pair_score_table

__all__ = ["arccon_loss", "triplet_loss"]


@loss_entry
def arccon_loss(
    h1: torch.Tensor,
    h2: torch.Tensor,
    margin_degrees: float = 10.0,
    tau: float = 0.05,
    *,
    dims: Dims | None = None,
    dim_weights: DimWeights | None = None,
    layer_weights: LayerWeights | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """ArcCon, the additive angular margin contrastive loss of ArcCSE (Zhang et al., ACL 2022, Eq. 3).

    h1[i] and h2[i] are two views of sentence i. Row i's logits are cos(h1_i, h2_j) / tau over all j, except
    the positive j = i, whose angle is widened by the margin: cos(min(theta_ii + margin, pi)) / tau. The loss
    is the mean cross-entropy with target i. The margin's gradient is kept finite as |cos| -> 1 by
    flooring sin^2(theta) at 1e-6.

    Args:
        h1, h2: [N, D] embeddings of the two views.
        margin_degrees: the additive angular margin, in DEGREES (10 in the paper), between 0 and 180.
        tau: temperature (> 0).
        dims, dim_weights, layer_weights: Matryoshka and layer-wise training (see angle_kernels.losses).
        backend: "auto" (default), "torch", "triton" or "cuda".
    """
    margin, tau = check_arccon_options(margin_degrees, tau)
    h1, h2 = promote_embeddings(h1, h2)
    layers, first = check_layer_stack(layer_weights, ("h1", h1), ("h2", h2))
    check_two_views(*first)
    nested = check_nested(dims, dim_weights, h1.shape[-1], layer_weights=layer_weights, layers=layers,
                          embeddings=h1)
    check_scaled_weights_fit(h1, ("1 / tau", 1.0 / tau), nested=nested)
    return arccon(resolve_backend(backend, h1), h1, h2, margin, tau, nested)


@loss_entry
def triplet_loss(
    anchor: torch.Tensor,
    weak: torch.Tensor,
    strong: torch.Tensor,
    margin: float = 0.0,
    *,
    dims: Dims | None = None,
    dim_weights: DimWeights | None = None,
    layer_weights: LayerWeights | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """ArcCSE's triplet loss (Eq. 4): mean over triplets of max(0, cos(anchor, strong) - cos(anchor, weak) + margin).

    `weak` is the lightly masked view (20% of tokens masked), `strong` the heavily masked one (40%): the anchor
    should stay closer to the weak view. ArcCSE adds it to ArcCon with weight 0.1.

    Args:
        anchor, weak, strong: [N, D] embeddings.
        margin: additive margin on the cosine difference; at most half of the compute dtype's largest number over
            the rows (float32's for 16- and 32-bit embeddings: 1.7e38 / N), where the mean's sum stays finite.
        dims, dim_weights, layer_weights: Matryoshka and layer-wise training (see angle_kernels.losses).
        backend: "auto" (default), "torch", "triton" or "cuda".
    """
    margin = check_scalar("margin", margin)
    anchor, weak, strong = promote_embeddings(anchor, weak, strong)
    layers, first = check_layer_stack(layer_weights, ("anchor", anchor), ("weak", weak), ("strong", strong))
    check_triplets(*first)
    check_margin_fits("margin", margin, rows=first[0].shape[0], dtype=anchor.dtype)
    nested = check_nested(dims, dim_weights, anchor.shape[-1], layer_weights=layer_weights, layers=layers,
                          embeddings=anchor)
    return triplet(resolve_backend(backend, anchor), anchor, weak, strong, margin, nested)


# The formulas


def arccon(ops: Ops, h1: torch.Tensor, h2: torch.Tensor, margin: float, tau: float,
           nested: Nested | None = None) -> torch.Tensor:
    """ArcCon on checked views; margin in radians."""
    if nested is not None and nested.stacked:
        return nested.over_layers(lambda layer, sub: arccon(ops, h1[layer], h2[layer], margin, tau, sub))
    return combined(ops.similarity_xent(h1, h2.to(h1.dtype), 1.0 / tau, "diagonal", margin=margin,
                                         dims=nested_dims(nested)), nested)


def triplet(ops: Ops, anchor: torch.Tensor, weak: torch.Tensor, strong: torch.Tensor, margin: float,
            nested: Nested | None = None) -> torch.Tensor:
    """mean(max(0, cos(anchor, strong) - cos(anchor, weak) + margin)) on checked triplets, one pair-score pass
    (for every prefix and layer at once when nested)."""
    groups = torch.stack((anchor, weak.to(anchor.dtype), strong.to(anchor.dtype)), dim=-2)
    if nested is None:
        cos, _ = ops.pair_scores(groups, False)
        return torch.relu(cos[:, 1] - cos[:, 0] + margin).mean()
    cos, _ = pair_score_table(ops, groups, False, nested)
    per_term = torch.relu(cos[..., 1] - cos[..., 0] + margin).mean(dim=-1)  # [L, k]
    return nested.weighted_sum(lambda layer, i: per_term[layer, i])
