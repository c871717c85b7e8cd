#!/usr/bin/env python
"""Benchmark our losses against the reference (angle-emb 0.6.1), sentence-transformers and eager PyTorch.

The loss sweep. For every loss (by default cosine, angle, ibn, contrastive: the main job's table; the ArcCSE
losses arccon and triplet on request), size N, embedding size D and dtype, each provider (providers.py) gets
the same inputs and is measured for one forward + backward pass with the shared harness (harness.py):

* time: the median (or min) of several runs after a warm-up run. CPU: wall clock with the thread count
  stated, the providers of a size taking turns (one run each per round, each in a fresh process after its
  warm-up pass; a shared machine's changing load falls on all of them alike); CUDA: triton.testing.do_bench's
  median (it flushes the L2 cache between runs), or CUDA events for a slow case or when Triton is missing. On
  CUDA each case's first call (its compiles and autotuning) runs before and apart, its time recorded as cold_s;
  --warm-up-budget gives those first calls an allowance of their own within --time-budget.
* peak extra memory: CPU: each round of a case runs in a freshly forked child of this (compute-free) process
  (the table shows the median of the rounds'); its peak RSS (VmHWM, reset through /proc/self/clear_refs once
  the inputs exist) minus the RSS right before the pass. CUDA: max_memory_allocated() minus memory_allocated()
  before the pass (inputs included in the latter), taken on a pass after a warm-up pass: the first call at a
  shape JIT-compiles and autotunes, and Triton's autotuner benchmarks with do_bench, whose 256 MB L2-flush
  buffer is not the loss's memory. Gradients of the inputs count as extra memory for every provider alike.
* the achieved bandwidth (memory-bound losses: bytes that must move) or FLOP rate (similarity losses: matmul
  FLOPs), and its fraction of the limits measured at the start of the run (copy bandwidth, matmul rate).

Sizes a provider cannot fit are skipped with a marker instead of being run: the eager baselines' N^2
memory is estimated first and compared with --max-ref-gb, and nothing runs that is estimated above 80 % of
the memory available. A size whose predicted run time (from the previous size) exceeds --max-run-seconds
is skipped too, and so is every case once --time-budget is spent. Out-of-memory errors become an "OOM"
marker. Under a budget every loss gets its smallest sizes before any loss gets a larger one.

Writes results.json and table.md to --out after every row (a run killed from outside keeps what it
measured), plot.png (time and memory vs N, log-log, one column per loss) at the end, and prints the table.
The same command runs unchanged on a CUDA machine (--device auto picks CUDA). This module holds the registry of
every family's losses; the sweep itself is loss_sweep.py, which each family's module also runs over its own losses:
bench_ranking.py, bench_similarity.py, bench_arccse.py, bench_matryoshka.py.

    python bench/bench_losses.py                       # defaults: a few minutes on a 2-core CPU
    python bench/bench_losses.py --losses cosine,angle --n 16384 --max-ref-gb 8
    python bench/bench_losses.py --losses arccon,triplet
"""

from __future__ import annotations

import sys

import harness  # noqa: F401  (first: sets OMP_WAIT_POLICY before torch loads)
import bench_arccse
import bench_matryoshka
import bench_ranking
import bench_similarity
import loss_sweep

FAMILIES = (bench_ranking, bench_similarity, bench_arccse, bench_matryoshka)
LOSSES = {loss.name: loss for family in FAMILIES for loss in family.LOSSES}
OPS = {bench.name: bench for family in FAMILIES for bench in family.OPS}  # the GPU op sweep's benchmarks, by name
DEFAULT_LOSSES = ("cosine", "angle", "ibn", "contrastive")  # the main job's table and plot


def parse_args(argv=None):
    """The sweep's options (loss_sweep.parse_args), --losses among every family's losses."""
    return loss_sweep.parse_args(argv, LOSSES, DEFAULT_LOSSES)


def main(argv=None) -> int:
    """The sweep (loss_sweep.main) over the losses --losses names among every family's."""
    return loss_sweep.main(argv, LOSSES, DEFAULT_LOSSES)


if __name__ == "__main__":
    sys.exit(main())
