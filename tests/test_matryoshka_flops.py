"""The torch backend's Matryoshka softmax losses do one width's matrix-product FLOPs (torch's FLOP counter).

MNRL with dims (768, 512, 256, 128, 64) at 64 pairs, D = 768, forward + backward, against the same call at one
width (768): the products of a dims call are cumulative over the prefixes' slices and its gradients are formed in
forward from the dot tiles it holds (torch_ops/similarity_xent.py, PrefixSimilarityXentFunction), so the counted
FLOPs stay within 10% of one width's. torch's counter has no formula for the in-place addmm_ the backends
accumulate gradients with: it is given the out-of-place one's (2 m k n).
"""

from __future__ import annotations

import torch

import angle_kernels
from angle_kernels.testing.helpers import flop_counter

DIMS = (768, 512, 256, 128, 64)


def _flops(loss, q, p, **options) -> int:
    q, p = q.detach().requires_grad_(), p.detach().requires_grad_()
    with flop_counter() as counter:
        loss(q, p, backend="torch", **options).backward()
    return counter.get_total_flops()


def test_dims_take_one_widths_flops():
    gen = torch.Generator().manual_seed(0)
    q, p = torch.randn(64, 768, generator=gen), torch.randn(64, 768, generator=gen)
    loss = angle_kernels.multiple_negatives_ranking_loss
    one_width = _flops(loss, q, p)
    nested = _flops(loss, q, p, dims=DIMS)
    assert one_width >= 6 * 64 * 64 * 768  # the counter sees the gradients' products
    assert nested <= 1.1 * one_width, f"dims: {nested / one_width:.3f}x one width's FLOPs"
    # with other prefix weights too, from the second call on (forward forms the gradients for the last direction)
    weights = (1.0, 0.5, 0.25, 0.25, 2.0)
    _flops(loss, q, p, dims=DIMS, dim_weights=weights)
    assert _flops(loss, q, p, dims=DIMS, dim_weights=weights) <= 1.1 * one_width


def test_dims_of_every_option_take_one_widths_flops(monkeypatch):
    """MNRL's options (GTE's four directions, hardness weighting) are similarity_lse blocks: with dims each block is
    one call for every prefix, its products cumulative over the slices (torch_ops/similarity_lse.py,
    PrefixSimilarityLseFunction), so the FLOPs stay within 10% of one width's on the same schedule (backward makes
    the score tiles again). A one-width call whose logits fit one tile keeps its softmax for backward instead
    (torch_ops/_similarity_lse_softmax.py) and makes 3/4 of those FLOPs: dims cost 4/3 of that."""
    from angle_kernels.torch_ops import common

    gen = torch.Generator().manual_seed(2)
    q, p = torch.randn(64, 768, generator=gen), torch.randn(64, 768, generator=gen)
    loss = angle_kernels.multiple_negatives_ranking_loss
    options = dict(directions=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"),
                   hardness_mode="in_batch_negatives", hardness_strength=3.0)
    unit = 64 * 64 * 768  # one block's multiply-adds
    kept = _flops(loss, q, p, **options)
    assert 4 * 6 * unit <= kept < 4 * 7 * unit  # four blocks, each forward's product and the two gradient products
    nested = _flops(loss, q, p, dims=DIMS, **options)
    monkeypatch.setattr(common, "CHUNK_ELEMENTS", 64 * 64 // 2)  # two row blocks per call: nothing kept
    recomputing = _flops(loss, q, p, **options)
    assert recomputing >= 4 * 8 * unit  # each block's product again in backward
    assert nested <= 1.1 * recomputing, f"dims: {nested / recomputing:.3f}x one width's FLOPs"


def test_dims_with_a_filter_compute_each_prefix_as_one_width_on_the_cpu():
    """With a false-negative filter the prefix walk's backward makes every prefix's filtered exponentials again,
    which on the CPU cost more than the products it saves (2x the time of one call per width): the CPU calls take
    each prefix by the one-width softmax form (torch_ops/similarity_lse_paths.py), whose products are the widths'
    sum, each keeping its softmax for backward."""
    gen = torch.Generator().manual_seed(3)
    q, p = torch.randn(64, 768, generator=gen), torch.randn(64, 768, generator=gen)
    loss = angle_kernels.multiple_negatives_ranking_loss
    options = dict(directions=("query_to_doc", "query_to_query"), false_negative_margin=0.1)
    kept = _flops(loss, q, p, **options)
    nested = _flops(loss, q, p, dims=DIMS, **options)
    per_width = sum(DIMS) / 768 * kept
    assert 0.95 * per_width <= nested <= 1.05 * per_width, f"dims: {nested / per_width:.3f}x the widths' sum"


def test_formed_gradients_equal_recomputed_ones():
    """Gradients formed in forward for the last call's grad_loss are used only for an equal one, and are then bit
    for bit those backward computes (so results never depend on which calls ran before: a resumed run equals an
    uninterrupted one)."""
    from angle_kernels.torch_ops import similarity_xent as torch_xent

    gen = torch.Generator().manual_seed(1)
    q = torch.randn(20, 16, generator=gen, dtype=torch.float32)
    dims = (4, 8, 16)
    upstreams = [torch.tensor(u) for u in ([1.0, 0.5, 2.0], [1.0, 0.5, 2.0], [3.0, 1.5, 6.0], [3.0, 1.5, 6.0],
                                           [1.0, 0.0, -1.0], [1.0, 1.0, 1.0])]

    def gradient(upstream):
        leaf = q.clone().requires_grad_()
        torch_xent.similarity_xent(leaf, None, 20.0, "partner", exclude_diagonal=True, dims=dims,
                                   path="default").backward(upstream)
        return leaf.grad

    torch_xent._LAST_UPSTREAM.clear()
    grads = [gradient(u) for u in upstreams]  # the second of each equal pair: formed in forward
    for upstream, got in zip(upstreams, grads):
        torch_xent._LAST_UPSTREAM.clear()  # nothing formed for it: computed in backward
        assert torch.equal(got, gradient(upstream)), upstream
