#!/usr/bin/env python
"""The ranking family: CoSENT (`cosine`) and AnglE (`angle`), built on the ops pair_scores and ranking_loss.

Inputs: N pairs in angle-emb's zigzag layout, y_true [2N, 1] with 6 label levels (heavy ties) and y_pred
[2N, D]. Providers: ours, angle-emb's `cosine_loss` / `angle_loss` (sum pooling), sentence-transformers'
`CoSENTLoss` / `AnglELoss`, all at tau (scale) 20; `LOSSES` says exactly what each calls.

Ops (the GPU run's op sweep): pair_scores of N zigzag pairs [N, 2, D] with the angle; ranking_loss over N
scores with 6 label levels.

    python bench/bench_ranking.py [options of bench_losses.py]     this family's loss sweep
"""

from __future__ import annotations

import sys

import harness
import providers as P
import torch
from harness import Implementation, LossBench, OpBench

LABEL_LEVELS = 6  # graded similarity labels (0-5, like STS-B): many ties, which the ranking term skips


def zigzag_graded_inputs(n: int, d: int, dtype: torch.dtype, device, seed: int = 0) -> dict:
    generator = torch.Generator(device=device).manual_seed(seed)
    pair_labels = torch.randint(0, LABEL_LEVELS, (n,), generator=generator, device=device)
    return harness.zigzag_inputs(pair_labels, d, dtype, generator)


def pairs_floor(n: int, d: int, dtype: torch.dtype) -> dict:
    return harness.pair_scores_floor(2 * n, d, dtype)


# Our makers import angle_kernels when a case is built: a package that does not import is then reported as a
# missing provider (providers.ours_backends) instead of stopping every other provider's sweep.
def ours_cosine(backend: str, x: dict):
    import angle_kernels as ak

    return lambda: ak.cosine_loss(x["y_true"], x["y_pred"], tau=P.TAU, backend=backend)


def ours_angle(backend: str, x: dict):
    import angle_kernels as ak

    return lambda: ak.angle_loss(x["y_true"], x["y_pred"], tau=P.TAU, pooling_strategy="sum", backend=backend)


def reference_cosine(reference, x: dict):
    return lambda: reference.cosine_loss(x["y_true"], x["y_pred"], tau=P.TAU)


def reference_angle(reference, x: dict):
    return lambda: reference.angle_loss(x["y_true"], x["y_pred"], tau=P.TAU, pooling_strategy="sum")


def sentence_transformers_pair_loss(loss_class: str):
    """CoSENTLoss or AnglELoss on the pairs' two columns, with one label per pair."""
    def make(st_losses, x: dict):
        loss = getattr(st_losses, loss_class)(P.PrecomputedEmbeddings(), scale=P.TAU)
        y_pred, labels = x["y_pred"], x["y_true"][0::2, 0]
        return lambda: loss(P.columns(y_pred[0::2], y_pred[1::2]), labels)

    return make


def pair_ranking_loss(name: str, implementations: dict, reference_bytes_per_element: float) -> LossBench:
    """cosine and angle differ only in the pair score: same inputs, floor and sizes. The reference builds the
    N x N matrix of score differences (and its masks); the others stay linear."""
    return LossBench(name=name, grows="N", size_label="N (pairs)", embedding_rows=lambda n: 2 * n,
                     build_inputs=zigzag_graded_inputs, work_floor=pairs_floor, implementations=implementations,
                     eager_matrix_elements=lambda n: n * n,
                     bytes_per_element={"reference": reference_bytes_per_element})


# The reference's peak extra memory per N x N element (float32, forward + backward), rounded up from
# bench_losses.py on CPU at D = 768 (2026-11-21): +306 MB (cosine) and +363 MB (angle) at N = 4096, about 14-18
# bytes per element after the linear part. +4.1 GB was measured for the cosine loss at
# N = 16384, where the estimate gives 5.1 GB: it errs high.
LOSSES = [
    pair_ranking_loss("cosine", {
        "ours": Implementation(f"angle_kernels.cosine_loss(tau={P.TAU:g})", ours_cosine),
        "reference": Implementation(f"angle_emb.loss.cosine_loss(tau={P.TAU:g})", reference_cosine),
        "sentence-transformers": Implementation(
            f"CoSENTLoss(scale={P.TAU:g})", sentence_transformers_pair_loss("CoSENTLoss")),
    }, reference_bytes_per_element=16.0),
    pair_ranking_loss("angle", {
        "ours": Implementation(f"angle_kernels.angle_loss(tau={P.TAU:g}, pooling_strategy='sum')", ours_angle),
        "reference": Implementation(
            f"angle_emb.loss.angle_loss(tau={P.TAU:g}, pooling_strategy='sum')", reference_angle),
        "sentence-transformers": Implementation(
            f"AnglELoss(scale={P.TAU:g})", sentence_transformers_pair_loss("AnglELoss")),
    }, reference_bytes_per_element=20.0),
]


def setup_pair_scores(ops, backend, n, d, dtype, device, generator):
    """cos + angle of N zigzag pairs, each weighted by a random number so that both gradients flow."""
    x = torch.randn(n, 2, d, device=device, generator=generator).to(dtype).requires_grad_()
    weights = torch.randn(n, 1, device=device, generator=generator)

    def run():
        cos, angle = ops.pair_scores(x, True)
        return ((cos + angle) * weights).sum()

    return run, [x], pairs_floor(n, d, dtype)


def setup_ranking_loss(ops, backend, n, d, dtype, device, generator):
    """The ranking term over N float32 scores (tau-sized spread) with int64 labels; d and dtype do not apply."""
    scores = (P.TAU * torch.randn(n, device=device, generator=generator)).requires_grad_()
    labels = torch.randint(0, LABEL_LEVELS, (n,), device=device, generator=generator)
    return lambda: ops.ranking_loss(scores, labels), [scores], harness.ranking_floor(n, scores.dtype, labels.dtype)


OPS = [
    OpBench("pair_scores", sizes=(16384, 262144, 1048576), dims=(768, 4096), dtypes=("bfloat16", "float32"),
            grows="N", setup=setup_pair_scores,
            memory_bytes=lambda n, d, dtype: 6 * n * d * harness.element_bytes(dtype)),  # x, dx and a copy
    OpBench("ranking_loss", sizes=(4096, 65536, 1048576, 4194304), dims=(1,), dtypes=("float32",),
            grows="N", setup=setup_ranking_loss, memory_bytes=lambda n, d, dtype: 64 * n),
]


if __name__ == "__main__":
    import loss_sweep

    names = [loss.name for loss in LOSSES]
    sys.exit(loss_sweep.main(["--losses", ",".join(names), *sys.argv[1:]], {loss.name: loss for loss in LOSSES}, names))
