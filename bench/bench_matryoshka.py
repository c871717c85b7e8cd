#!/usr/bin/env python
"""Matryoshka: a loss on k = 5 nested prefixes of the embeddings (D, 2D/3, D/3, D/6, D/12; for D = 768 the usual
768, 512, 256, 128, 64), weights 1, against sentence-transformers' MatryoshkaLoss over its own loss (one inner
loss call per dimension). `matryoshka_cosine`: CoSENT on the ranking family's inputs; `matryoshka_mnrl`:
MultipleNegativesRankingLoss on the contrastive inputs (query, positive, hard negative). The single
full-width losses are the `cosine` and `contrastive` rows of the same sweep: their ratio to these rows is the
cost of the k - 1 extra dimensions (target: at most 1.3x).

Ops (the GPU run's op sweep): pair_scores and similarity_xent with the k = 5 nested prefixes, against the same
floor as the full width (the prefixes come from one read of the embeddings: the bytes and the matmul FLOPs of
the widest prefix).

    python bench/bench_matryoshka.py [options of bench_losses.py]     this family's loss sweep
"""

from __future__ import annotations

import sys

import bench_ranking
import bench_similarity
import harness
import providers as P
import torch
from harness import Implementation, LossBench, OpBench


def nested_dims(d: int) -> tuple[int, ...]:
    """The k = 5 prefix widths of a D-wide embedding (fewer for a tiny D), widest first as sentence-transformers
    users list them; the narrower ones even (the angle score halves each prefix)."""
    narrower = {max(2, w - w % 2) for w in (2 * d // 3, d // 3, d // 6, d // 12)}
    return tuple(sorted({d} | {w for w in narrower if w < d}, reverse=True))


def ours_cosine(backend: str, x: dict):
    import angle_kernels as ak

    dims = nested_dims(x["y_pred"].shape[1])
    return lambda: ak.cosine_loss(x["y_true"], x["y_pred"], tau=P.TAU, dims=dims, backend=backend)


def ours_mnrl(backend: str, x: dict):
    import angle_kernels as ak

    dims = nested_dims(x["text"].shape[1])
    return lambda: ak.multiple_negatives_ranking_loss(x["text"], x["pos"], (x["neg"],), scale=P.TAU, dims=dims,
                                                      backend=backend)


def sentence_transformers_cosine(st_losses, x: dict):
    model = P.PrecomputedEmbeddings()
    loss = st_losses.MatryoshkaLoss(model, st_losses.CoSENTLoss(model, scale=P.TAU), nested_dims(x["y_pred"].shape[1]))
    y_pred, labels = x["y_pred"], x["y_true"][0::2, 0]
    return lambda: loss(P.columns(y_pred[0::2], y_pred[1::2]), labels)


def sentence_transformers_mnrl(st_losses, x: dict):
    model = P.PrecomputedEmbeddings()
    loss = st_losses.MatryoshkaLoss(model, st_losses.MultipleNegativesRankingLoss(model, scale=P.TAU),
                                    nested_dims(x["text"].shape[1]))
    return lambda: loss(P.columns(x["text"], x["pos"], x["neg"]), None)


LOSSES = [
    LossBench(
        name="matryoshka_cosine", grows="N", size_label="N (pairs)", embedding_rows=lambda n: 2 * n,
        build_inputs=bench_ranking.zigzag_graded_inputs, work_floor=bench_ranking.pairs_floor,
        implementations={
            "ours": Implementation(f"angle_kernels.cosine_loss(tau={P.TAU:g}, dims=5 prefixes)", ours_cosine),
            "sentence-transformers": Implementation(
                f"MatryoshkaLoss(CoSENTLoss(scale={P.TAU:g}), 5 dims)", sentence_transformers_cosine),
        },
    ),
    LossBench(
        name="matryoshka_mnrl", grows="N^2", size_label="N (queries, 2N candidates)", embedding_rows=lambda n: 3 * n,
        build_inputs=bench_similarity.contrastive_inputs,
        work_floor=lambda n, d, dtype: harness.similarity_floor(n, 2 * n, d),
        implementations={
            "ours": Implementation(f"angle_kernels.multiple_negatives_ranking_loss(scale={P.TAU:g}, dims=5 prefixes)",
                                   ours_mnrl),
            "sentence-transformers": Implementation(
                f"MatryoshkaLoss(MultipleNegativesRankingLoss(scale={P.TAU:g}), 5 dims)", sentence_transformers_mnrl),
        },
        # the parent's loop builds one N x 2N score matrix per dimension, one at a time
        eager_matrix_elements=lambda n: n * 2 * n, bytes_per_element={"sentence-transformers": 16.0},
    ),
]


def setup_nested_pair_scores(ops, backend, n, d, dtype, device, generator):
    """cos + angle of N zigzag pairs at every prefix, each weighted by a random number (both gradients flow)."""
    dims = tuple(sorted(nested_dims(d)))
    x = torch.randn(n, 2, d, device=device, generator=generator).to(dtype).requires_grad_()
    weights = torch.randn(len(dims), n, 1, device=device, generator=generator)

    def run():
        cos, angle = ops.pair_scores(x, True, dims)
        return ((cos + angle) * weights).sum()

    return run, [x], bench_ranking.pairs_floor(n, d, dtype)


def setup_nested_similarity_xent(ops, backend, n, d, dtype, device, generator):
    """similarity_xent of N queries against 2N candidates (diagonal targets) at every prefix, summed."""
    dims = tuple(sorted(nested_dims(d)))
    q = torch.randn(n, d, device=device, generator=generator).to(dtype).requires_grad_()
    c = torch.randn(2 * n, d, device=device, generator=generator).to(dtype).requires_grad_()

    def run():
        return ops.similarity_xent(q, c, P.TAU, "diagonal", dims=dims).sum()

    m, mc = n, 2 * n
    executed = harness.similarity_flops_executed(backend, m, mc, d, dims)
    return run, [q, c], {**harness.similarity_floor(m, mc, d), "executed": executed}


def setup_one_width_similarity_xent(ops, backend, n, d, dtype, device, generator):
    """setup_nested_similarity_xent's loss at the full width alone (no dims): the same shape, so that a sweep
    times the prefixes' cost against one width's in the same run."""
    q = torch.randn(n, d, device=device, generator=generator).to(dtype).requires_grad_()
    c = torch.randn(2 * n, d, device=device, generator=generator).to(dtype).requires_grad_()

    def run():
        return ops.similarity_xent(q, c, P.TAU, "diagonal")

    m, mc = n, 2 * n
    return run, [q, c], {**harness.similarity_floor(m, mc, d),
                         "executed": harness.similarity_flops_executed(backend, m, mc, d)}


def setup_nested_similarity_lse(ops, backend, n, d, dtype, device, generator):
    """bench_similarity.setup_similarity_lse's op at every prefix (k = 5 at D = 768 and 4,096), each prefix's row
    weighted by a random number: against the "similarity_lse" rows (one width, the same N x 2N shape)."""
    dims = tuple(sorted(nested_dims(d)))
    q = harness.random_embeddings(generator, n, d, dtype, device)
    c = harness.random_embeddings(generator, 2 * n, d, dtype, device)
    weights = torch.randn(len(dims), n, device=device, generator=generator)

    def run():
        lse = ops.similarity_lse(q, c, P.TAU, period=n, penalty=2.0, penalty_on="other", dims=dims)
        return (lse * weights).sum()

    m, mc = n, 2 * n
    return run, [q, c], {**harness.similarity_floor(m, mc, d),
                         "executed": harness.similarity_lse_flops_executed(backend, m, mc, d, dims)}


OPS = [
    # both triton schemes: the kernels per prefix and the one-read kernels
    OpBench("pair_scores(dims)", sizes=(16384, 262144), dims=(768, 4096), dtypes=("bfloat16", "float32"),
            grows="N", setup=setup_nested_pair_scores,
            memory_bytes=lambda n, d, dtype: 6 * n * d * harness.element_bytes(dtype), triton_schemes=True),
    # both triton schemes: the fused prefix kernels and the dense dims scheme
    OpBench("similarity_xent(dims)", sizes=(1024, 4096, 16384), dims=(768, 4096), dtypes=("bfloat16", "float32"),
            grows="N^2", setup=setup_nested_similarity_xent,
            memory_bytes=lambda n, d, dtype: 3 * 3 * n * d * 4, triton_schemes=True),
    # one width at the dims rows' shape (N x 2N), bf16: the ratio the Matryoshka targets are stated in
    OpBench("similarity_xent(one width)", sizes=(1024, 4096, 16384), dims=(768, 4096), dtypes=("bfloat16",),
            grows="N^2", setup=setup_one_width_similarity_xent,
            memory_bytes=lambda n, d, dtype: 3 * 3 * n * d * 4, triton_schemes=True),
    # both triton schemes: the fused kernels per prefix and the dense dims scheme (one pass), against the
    # "similarity_lse" rows (bench_similarity.py: one width at the same shape)
    OpBench("similarity_lse(dims)", sizes=(1024, 4096, 16384), dims=(768, 4096), dtypes=("bfloat16",),
            grows="N^2", setup=setup_nested_similarity_lse,
            memory_bytes=lambda n, d, dtype: 3 * 3 * n * d * 4, triton_schemes=True),
]


if __name__ == "__main__":
    import loss_sweep

    names = [loss.name for loss in LOSSES]
    sys.exit(loss_sweep.main(["--losses", ",".join(names), *sys.argv[1:]], {loss.name: loss for loss in LOSSES}, names))
