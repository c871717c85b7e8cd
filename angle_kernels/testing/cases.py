"""The loss cases that the Matryoshka and the layer-wise tests share (tests/test_matryoshka_losses.py and
tests/test_layerwise_losses.py): the public losses and loss modules that take nested prefixes (dims) and layer
weights, each with the op whose `dims` feature it needs and how it draws its inputs and calls ours and the oracle.

LOSS_CASES: name -> (op, make). make(draw, kwargs) -> (inputs, ours(*inputs, backend), oracle of one call):
`draw` (a `Draw`) gives the inputs their shape, `kwargs` are the keyword arguments of our call (dims, dim_weights,
layer_weights; the modules take layer_weights in forward, the rest at construction). Each test file combines the
oracle's calls its own way: a weighted sum over the prefixes, or over the layers and prefixes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import angle_kernels as ak
from angle_kernels.testing import oracle
from angle_kernels.testing.helpers import randn


@dataclass(frozen=True)
class Draw:
    """How a case draws its inputs from `gen`: tensors lead + [rows, width] in `dtype` (lead: () for one embedding
    matrix per input, (layers,) for a stack of layers); `pairs` zigzag pairs for the pair losses, `rows` rows per
    input for the others (`mnrl_rows` for multiple_negatives_ranking_loss)."""

    gen: torch.Generator
    dtype: torch.dtype
    lead: tuple[int, ...]
    width: int
    pairs: int
    rows: int
    mnrl_rows: int

    def embeddings(self, rows: int) -> torch.Tensor:
        return randn(self.gen, *self.lead, rows, self.width, dtype=self.dtype)

    def zigzag(self, binary: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Labels [2 * pairs] (each pair's label on both its rows; 0 or 1 when binary) and zigzag embeddings."""
        labels = torch.rand(self.pairs, generator=self.gen)
        labels = (labels > 0.4).double() if binary else labels
        return labels.repeat_interleave(2), self.embeddings(2 * self.pairs)

    def inputs(self, count: int, rows: int | None = None) -> list[torch.Tensor]:
        return [self.embeddings(self.rows if rows is None else rows) for _ in range(count)]


def _cosine(draw, kwargs):
    y_true, y_pred = draw.zigzag()
    return ([y_pred], lambda x, backend: ak.cosine_loss(y_true, x, **kwargs, backend=backend),
            lambda x: oracle.cosine_loss(y_true, x))


def _angle(draw, kwargs):
    y_true, y_pred = draw.zigzag()
    return ([y_pred], lambda x, backend: ak.angle_loss(y_true, x, 20.0, "mean", **kwargs, backend=backend),
            lambda x: oracle.angle_loss(y_true, x, 20.0, "mean"))


def _in_batch(draw, kwargs):
    y_true, y_pred = draw.zigzag(binary=True)
    return ([y_pred], lambda x, backend: ak.in_batch_negative_loss(y_true, x, **kwargs, backend=backend),
            lambda x: oracle.in_batch_negative_loss(y_true, x))


def _contrastive(draw, kwargs):
    return (draw.inputs(3), lambda q, p, n, backend: ak.contrastive_with_negative_loss(
                q, p, n, **kwargs, backend=backend),
            oracle.contrastive_with_negative_loss)


def _arccon(draw, kwargs):
    return (draw.inputs(2), lambda a, b, backend: ak.arccon_loss(a, b, **kwargs, backend=backend),
            oracle.arccon_loss)


def _triplet(draw, kwargs):
    return (draw.inputs(3), lambda a, w, s, backend: ak.triplet_loss(a, w, s, 0.1, **kwargs, backend=backend),
            lambda a, w, s: oracle.triplet_loss(a, w, s, 0.1))


def _mnrl(options):
    def make(draw, kwargs):
        return (draw.inputs(3, rows=draw.mnrl_rows), lambda q, p, n, backend: ak.multiple_negatives_ranking_loss(
                    q, p, (n,), **kwargs, backend=backend, **options),
                lambda q, p, n: oracle.multiple_negatives_ranking_loss(q, p, (n,), 20.0, **options))
    return make


def _split(kwargs):
    """AngleLoss / ArcCSELoss take dims at construction and layer_weights in forward: (construction, forward)."""
    construction = dict(kwargs)
    forward = {"layer_weights": construction.pop("layer_weights")} if "layer_weights" in construction else {}
    return construction, forward


def _angle_module(dataset_format, **options):
    """AngleLoss in `dataset_format` with its cosine and angle terms and the default in-batch term, or that term with
    `options` (ibn_partition, the false-negative filter)."""
    def make(draw, kwargs):
        construction, forward = _split(kwargs)
        if dataset_format == "A":
            labels, outputs = draw.zigzag(binary=True)
        else:
            labels, outputs = torch.zeros(18), draw.embeddings(18)
        weights = dict(cosine_w=1.0, angle_w=0.5, dataset_format=dataset_format, **options)
        module = ak.AngleLoss(**weights, **construction)

        def ours(x, backend):
            module.backend = backend
            return module(labels, x, **forward)
        return [outputs], ours, lambda x: oracle.angle_loss_module(labels, x, **weights)
    return make


def _arccse_module(draw, kwargs):
    inputs = draw.inputs(5)
    construction, forward = _split(kwargs)
    module = ak.ArcCSELoss(**construction)

    def ours(*xs, backend):
        module.backend = backend
        return module(*xs, **forward)
    return inputs, ours, oracle.arccse_loss


LOSS_CASES = {
    "cosine_loss": ("pair_scores", _cosine),
    "angle_loss": ("pair_scores", _angle),
    "triplet_loss": ("pair_scores", _triplet),
    "in_batch_negative_loss": ("similarity_xent", _in_batch),
    "contrastive_with_negative_loss": ("similarity_xent", _contrastive),
    "arccon_loss": ("similarity_xent", _arccon),
    "mnrl_standard": ("similarity_xent", _mnrl({})),
    "mnrl_symmetric": ("similarity_xent", _mnrl(dict(directions=("query_to_doc", "doc_to_query"),
                                                      partition_mode="per_direction"))),
    # the similarity_lse blocks (every prefix in one call where the backend's similarity_lse has dims)
    "mnrl_gte_hardness": ("similarity_lse", _mnrl(dict(directions=("query_to_doc", "query_to_query",
                                                                   "doc_to_query", "doc_to_doc"),
                                                       hardness_mode="in_batch_negatives", hardness_strength=3.0))),
    "mnrl_false_negatives": ("similarity_lse", _mnrl(dict(directions=("query_to_doc", "doc_to_query"),
                                                          false_negative_margin=0.1))),
    "AngleLoss_A": ("pair_scores", _angle_module("A")),
    # format A's in-batch term on the similarity_lse blocks: GTE's partition, AnglE's with the filter
    "AngleLoss_A_gte": ("similarity_lse", _angle_module("A", ibn_partition="gte")),
    "AngleLoss_A_filter": ("similarity_lse", _angle_module("A", false_negative_margin=0.1)),
    "AngleLoss_B": ("similarity_xent", _angle_module("B")),
    "AngleLoss_C": ("pair_scores", _angle_module("C")),
    "ArcCSELoss": ("pair_scores", _arccse_module),
}
# The modules whose pair_scores cases also call similarity_xent (so need its dims feature too).
MODULES_WITH_BOTH_OPS = ("AngleLoss_A", "AngleLoss_C", "ArcCSELoss")
