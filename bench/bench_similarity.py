#!/usr/bin/env python
"""The similarity family: in-batch negatives (`ibn`) and contrastive with negatives (`contrastive`), built on
the op similarity_xent, and the options of multiple_negatives_ranking_loss (`mnrl_gte`: every direction in one
partition; `mnrl_hardness`; `mnrl_false_negatives`; `mnrl_dot`: util.dot_score logits), built on
similarity_lse. Their cost grows as N^2 D whatever the implementation.

Inputs: ibn, N pairs in the zigzag layout (y_true [2N, 1] 0/1, 80 % ones; y_pred [2N, D]), 2N rows against
each other; contrastive, text, pos, neg [N, D], N queries against 2N candidates. Providers: ours, angle-emb's
`in_batch_negative_loss` / `contrastive_with_negative_loss`, and for contrastive sentence-transformers'
`MultipleNegativesRankingLoss` on (anchor, positive, negative), all at tau (scale) 20; `LOSSES` says exactly
what each calls. sentence-transformers has no in-batch-negative loss over labelled pairs.

Op (the GPU run's op sweep): similarity_xent as in-batch negatives over 2N rows, with row weights and the
diagonal excluded.

    python bench/bench_similarity.py [options of bench_losses.py]     this family's loss sweep
"""

from __future__ import annotations

import sys

import harness
import providers as P
import torch
from harness import Implementation, LossBench, OpBench

POSITIVE_SHARE = 0.8  # pairs labelled 1 (the rest have no target and serve only as negatives)


def ibn_inputs(n: int, d: int, dtype: torch.dtype, device, seed: int = 0) -> dict:
    generator = torch.Generator(device=device).manual_seed(seed)
    pair_labels = torch.rand(n, generator=generator, device=device) < POSITIVE_SHARE
    return harness.zigzag_inputs(pair_labels, d, dtype, generator)


def contrastive_inputs(n: int, d: int, dtype: torch.dtype, device, seed: int = 0) -> dict:
    generator = torch.Generator(device=device).manual_seed(seed)
    return {name: harness.random_embeddings(generator, n, d, dtype, device) for name in ("text", "pos", "neg")}


# Our makers import angle_kernels when a case is built: a package that does not import is then reported as a
# missing provider (providers.ours_backends) instead of stopping every other provider's sweep.
def ours_ibn(backend: str, x: dict):
    import angle_kernels as ak

    return lambda: ak.in_batch_negative_loss(x["y_true"], x["y_pred"], tau=P.TAU, backend=backend)


def ours_contrastive(backend: str, x: dict):
    import angle_kernels as ak

    return lambda: ak.contrastive_with_negative_loss(x["text"], x["pos"], x["neg"], tau=P.TAU, backend=backend)


def reference_ibn(reference, x: dict):
    return lambda: reference.in_batch_negative_loss(x["y_true"], x["y_pred"], tau=P.TAU)


def reference_contrastive(reference, x: dict):
    return lambda: reference.contrastive_with_negative_loss(x["text"], x["pos"], x["neg"], tau=P.TAU)


def sentence_transformers_contrastive(st_losses, x: dict):
    loss = st_losses.MultipleNegativesRankingLoss(P.PrecomputedEmbeddings(), scale=P.TAU)
    return lambda: loss(P.columns(x["text"], x["pos"], x["neg"]), None)


# The eager baselines' peak extra bytes per element of their N x N-like matrices (float32, forward + backward),
# rounded up from bench_losses.py on CPU at D = 768 (2026-11-21): the reference's in-batch-negative loss
# needed +356 MB at N = 2048 (21 bytes per (2N)^2 element); the cross-entropy losses +139 MB (reference) and
# +179 MB (sentence-transformers) at N = 2048 (10-16 bytes per N x 2N element).
LOSSES = [
    LossBench(
        name="ibn", grows="N^2", size_label="N (pairs)", embedding_rows=lambda n: 2 * n, build_inputs=ibn_inputs,
        work_floor=lambda n, d, dtype: harness.similarity_floor(2 * n, 2 * n, d),
        implementations={
            "ours": Implementation(f"angle_kernels.in_batch_negative_loss(tau={P.TAU:g})", ours_ibn),
            "reference": Implementation(f"angle_emb.loss.in_batch_negative_loss(tau={P.TAU:g})", reference_ibn),
        },
        eager_matrix_elements=lambda n: (2 * n) ** 2, bytes_per_element={"reference": 22.0},
    ),
    LossBench(
        name="contrastive", grows="N^2", size_label="N (queries, 2N candidates)", embedding_rows=lambda n: 3 * n,
        build_inputs=contrastive_inputs, work_floor=lambda n, d, dtype: harness.similarity_floor(n, 2 * n, d),
        implementations={
            "ours": Implementation(
                f"angle_kernels.contrastive_with_negative_loss(tau={P.TAU:g})", ours_contrastive),
            "reference": Implementation(
                f"angle_emb.loss.contrastive_with_negative_loss(tau={P.TAU:g})", reference_contrastive),
            "sentence-transformers": Implementation(
                f"MultipleNegativesRankingLoss(scale={P.TAU:g}) on (anchor, positive, negative)",
                sentence_transformers_contrastive),
        },
        eager_matrix_elements=lambda n: n * 2 * n,
        bytes_per_element={"reference": 12.0, "sentence-transformers": 16.0},
    ),
]


# The in-batch-negative family's options, on the contrastive inputs: N queries, N positives, one hard-negative
# column; sentence-transformers' MultipleNegativesRankingLoss with the same options is the eager baseline. It
# has no false-negative filter: that row is ours alone (its cost against the plain loss: the `contrastive` row).
ALL_DIRECTIONS = ("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc")
FAMILY_OPTIONS = {
    "mnrl_gte": dict(directions=ALL_DIRECTIONS),
    "mnrl_hardness": dict(hardness_mode="in_batch_negatives", hardness_strength=9.0),
    "mnrl_false_negatives": dict(false_negative_margin=0.05, false_negative_strategy="relative"),
    "mnrl_dot": dict(similarity="dot"),
}
# sentence-transformers' options for the same losses (a similarity_fct by its name in sentence_transformers.util)
FAMILY_ST_OPTIONS = {"mnrl_gte": FAMILY_OPTIONS["mnrl_gte"], "mnrl_hardness": FAMILY_OPTIONS["mnrl_hardness"],
                     "mnrl_dot": dict(similarity_fct="dot_score")}


def ours_family(option: str):
    def make(backend: str, x: dict):
        import angle_kernels as ak

        return lambda: ak.multiple_negatives_ranking_loss(x["text"], x["pos"], (x["neg"],), scale=P.TAU,
                                                          backend=backend, **FAMILY_OPTIONS[option])

    return make


def sentence_transformers_family(option: str):
    def make(st_losses, x: dict):
        from sentence_transformers import util

        options = dict(FAMILY_ST_OPTIONS[option])
        if "similarity_fct" in options:
            options["similarity_fct"] = getattr(util, options["similarity_fct"])
        loss = st_losses.MultipleNegativesRankingLoss(P.PrecomputedEmbeddings(), scale=P.TAU, **options)
        return lambda: loss(P.columns(x["text"], x["pos"], x["neg"]), None)

    return make


def _family_bench(option: str, blocks: int) -> LossBench:
    """`blocks`: score blocks of N x 2N (query_to_doc, doc_to_doc) or N x N (query_to_query, doc_to_query) the
    option computes, in units of N x 2N."""
    implementations = {"ours": Implementation(
        f"angle_kernels.multiple_negatives_ranking_loss({FAMILY_OPTIONS[option]})", ours_family(option))}
    if option in FAMILY_ST_OPTIONS:
        implementations["sentence-transformers"] = Implementation(
            f"MultipleNegativesRankingLoss(scale={P.TAU:g}, {FAMILY_ST_OPTIONS[option]})",
            sentence_transformers_family(option))
    return LossBench(
        name=option, grows="N^2", size_label="N (queries, 2N documents)", embedding_rows=lambda n: 3 * n,
        build_inputs=contrastive_inputs,
        work_floor=lambda n, d, dtype: harness.similarity_floor(n, int(blocks * 2 * n), d),
        implementations=implementations, eager_matrix_elements=lambda n: int(blocks * n * 2 * n),
        bytes_per_element={"sentence-transformers": 16.0} if option in FAMILY_ST_OPTIONS else {},
    )


LOSSES += [_family_bench("mnrl_gte", 3.0), _family_bench("mnrl_hardness", 1.0),
           _family_bench("mnrl_false_negatives", 1.0), _family_bench("mnrl_dot", 1.0)]


def setup_in_batch_negatives(ops, backend, n, d, dtype, device, generator):
    """similarity_xent over M = 2N rows against each other: partner targets, 20 % of rows without one."""
    m = 2 * n
    x = harness.random_embeddings(generator, m, d, dtype, device)
    row_weights = (torch.rand(m, device=device, generator=generator) > 0.2).float()

    def run():
        return ops.similarity_xent(x, None, P.TAU, "partner", row_weights=row_weights, exclude_diagonal=True)

    floor = {**harness.similarity_floor(m, m, d), "executed": harness.similarity_flops_executed(backend, m, m, d)}
    return run, [x], floor


def setup_similarity_lse(ops, backend, n, d, dtype, device, generator):
    """similarity_lse of N queries against their N documents and N hard negatives (period N: MNRL's
    query-to-document block) with a hardness penalty on the other columns, each row's lse weighted by a random
    number: the op every MNRL option is built on, at the shape of similarity_xent(dims)'s rows (N x 2N)."""
    q = harness.random_embeddings(generator, n, d, dtype, device)
    c = harness.random_embeddings(generator, 2 * n, d, dtype, device)
    weights = torch.randn(n, device=device, generator=generator)

    def run():
        return (ops.similarity_lse(q, c, P.TAU, period=n, penalty=2.0, penalty_on="other") * weights).sum()

    m, mc = n, 2 * n
    return run, [q, c], {**harness.similarity_floor(m, mc, d),
                         "executed": harness.similarity_lse_flops_executed(backend, m, mc, d)}


OPS = [
    # D = 384 (MiniLM's width) too: below the Triton dense scheme's MIN_WIDTH its fused kernels take the call, which
    # the MNRL headline measured 1.1x slower than the torch backend there (bench/results/h200-2026-12-04b/first);
    # the sweep times both Triton schemes at every width, so its rows say from which width the dense scheme is faster
    OpBench("similarity_xent(ibn)", sizes=(1024, 4096, 16384, 65536), dims=(384, 768, 4096),
            dtypes=("bfloat16", "float32"), grows="N^2", setup=setup_in_batch_negatives,
            memory_bytes=lambda n, d, dtype: 3 * 2 * n * d * 4,  # x, dx and float32 workspaces of 2N x D
            triton_schemes=True, cuda_schemes=True),
    # both triton schemes: the fused kernels and the dense products (the target: within 1.3x of similarity_xent's
    # dense scheme at the same shape, the similarity_xent(one width) rows)
    OpBench("similarity_lse", sizes=(1024, 4096, 16384), dims=(768, 4096), dtypes=("bfloat16", "float32"),
            grows="N^2", setup=setup_similarity_lse,
            memory_bytes=lambda n, d, dtype: 3 * 3 * n * d * 4, triton_schemes=True),
]


if __name__ == "__main__":
    import loss_sweep

    names = [loss.name for loss in LOSSES]
    sys.exit(loss_sweep.main(["--losses", ",".join(names), *sys.argv[1:]], {loss.name: loss for loss in LOSSES}, names))
