#!/usr/bin/env python
"""The ArcCSE family (Zhang et al., ACL 2022): ArcCon (`arccon`, Eq. 3) and the triplet loss (`triplet`, Eq. 4),
built on similarity_xent with an angular margin and on pair_scores of [anchor, weak, strong] triplets.

Inputs: arccon, h1 and h2 [N, D], two views of N sentences; triplet, anchor, weak and strong [N, D]. Settings:
ArcCSELoss's defaults (margin 10 degrees, tau 0.05, triplet margin 0). Neither angle-emb nor
sentence-transformers has these losses. The baseline is eager PyTorch: angle_kernels.testing.oracle's literal
formulas (for ArcCon the full N x N cosine matrix, the margin on its diagonal, a logsumexp per row) computing in
the inputs' dtype (`oracle.computing_in`), which is what a plain PyTorch implementation does. ArcCon costs N^2 D
FLOPs like the similarity family; the triplet loss is memory bound like pair scores.

Op (the GPU run's op sweep): similarity_xent as ArcCon calls it, with the angular margin on the targets.

    python bench/bench_arccse.py [options of bench_losses.py]     this family's loss sweep
"""

from __future__ import annotations

import math
import sys

import harness
import torch
from harness import Implementation, LossBench, OpBench

# ArcCSELoss's defaults (the paper's settings)
MARGIN_DEGREES = 10.0
TAU = 0.05
TRIPLET_MARGIN = 0.0


def views(names):
    """Inputs of len(names) [N, D] embeddings, one per name."""
    def build(n: int, d: int, dtype: torch.dtype, device, seed: int = 0) -> dict:
        generator = torch.Generator(device=device).manual_seed(seed)
        return {name: harness.random_embeddings(generator, n, d, dtype, device) for name in names}

    return build


# Our makers import angle_kernels when a case is built: a package that does not import is then reported as a
# missing provider (providers.ours_backends) instead of stopping every other provider's sweep.
def ours_arccon(backend: str, x: dict):
    import angle_kernels as ak

    return lambda: ak.arccon_loss(x["h1"], x["h2"], MARGIN_DEGREES, TAU, backend=backend)


def ours_triplet(backend: str, x: dict):
    import angle_kernels as ak

    return lambda: ak.triplet_loss(x["anchor"], x["weak"], x["strong"], TRIPLET_MARGIN, backend=backend)


def eager_arccon(oracle, x: dict):
    def run():
        with oracle.computing_in(x["h1"].dtype):
            return oracle.arccon_loss(x["h1"], x["h2"], MARGIN_DEGREES, TAU)

    return run


def eager_triplet(oracle, x: dict):
    def run():
        with oracle.computing_in(x["anchor"].dtype):
            return oracle.triplet_loss(x["anchor"], x["weak"], x["strong"], TRIPLET_MARGIN)

    return run


LOSSES = [
    LossBench(
        name="arccon", grows="N^2", size_label="N (sentences, two views each)", embedding_rows=lambda n: 2 * n,
        build_inputs=views(("h1", "h2")), work_floor=lambda n, d, dtype: harness.similarity_floor(n, n, d),
        implementations={
            "ours": Implementation(
                f"angle_kernels.arccon_loss(margin_degrees={MARGIN_DEGREES:g}, tau={TAU:g})", ours_arccon),
            "eager": Implementation(
                f"angle_kernels.testing.oracle.arccon_loss(margin_degrees={MARGIN_DEGREES:g}, tau={TAU:g}) "
                "in the inputs' dtype", eager_arccon),
        },
        # The eager N x N matrices (cosines, logits, the positives' mask, their gradients): +39 MB at N = 1024
        # and +117 MB at N = 2048 (D = 768, float32, CPU, 2026-11-23), 25-31 bytes per element after the
        # linear part.
        eager_matrix_elements=lambda n: n * n, bytes_per_element={"eager": 32.0},
    ),
    LossBench(
        name="triplet", grows="N", size_label="N (triplets)", embedding_rows=lambda n: 3 * n,
        build_inputs=views(("anchor", "weak", "strong")),
        work_floor=lambda n, d, dtype: harness.pair_scores_floor(3 * n, d, dtype),
        implementations={
            "ours": Implementation(f"angle_kernels.triplet_loss(margin={TRIPLET_MARGIN:g})", ours_triplet),
            "eager": Implementation(
                f"angle_kernels.testing.oracle.triplet_loss(margin={TRIPLET_MARGIN:g}) in the inputs' dtype",
                eager_triplet),
        },
    ),
]


def setup_arccon(ops, backend, n, d, dtype, device, generator):
    """similarity_xent as ArcCon uses it: N rows against the N rows of the other view, diagonal targets with
    the angular margin (the kernels' margin branch)."""
    h1 = harness.random_embeddings(generator, n, d, dtype, device)
    h2 = harness.random_embeddings(generator, n, d, dtype, device)

    def run():
        return ops.similarity_xent(h1, h2, 1.0 / TAU, "diagonal", margin=math.radians(MARGIN_DEGREES))

    floor = {**harness.similarity_floor(n, n, d), "executed": harness.similarity_flops_executed(backend, n, n, d)}
    return run, [h1, h2], floor


OPS = [
    OpBench("similarity_xent(arccon)", sizes=(1024, 4096, 16384), dims=(768,), dtypes=("bfloat16", "float32"),
            grows="N^2", setup=setup_arccon,
            memory_bytes=lambda n, d, dtype: 4 * n * d * 4,  # h1, h2, their gradients, float32 workspaces
            triton_schemes=True, cuda_schemes=True),
]


if __name__ == "__main__":
    import loss_sweep

    names = [loss.name for loss in LOSSES]
    sys.exit(loss_sweep.main(["--losses", ",".join(names), *sys.argv[1:]], {loss.name: loss for loss in LOSSES}, names))
