"""The triangular schedule of similarity_xent's rows against themselves (torch_ops/_similarity_xent_symmetric.py)
against the softmax form it replaces for those calls (torch_ops/_similarity_xent_softmax.py), on the CPU: AnglE's
in-batch negatives over M rows (target "partner", own column out, scale 20), float32, called through their autograd
Functions in one process, the two alternating call after call; the first round of each point is a warm-up. Prints
one line per point: the median milliseconds of each over the rounds after the first, their spreads (min-max), and
softmax form / schedule.

    python bench/results/cpu-2026-12-04-symmetric-xent/compare.py THREADS [--tiles 256,512,1024,2048] [--no-grad]
        [--points 1024x64,1024x768]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from angle_kernels.torch_ops import _similarity_xent_softmax as softmax_form
from angle_kernels.torch_ops import _similarity_xent_symmetric as schedule

POINTS = [(2048, 64), (2048, 768), (4096, 384), (8192, 64), (8192, 384), (8192, 768), (16384, 768)]


def call(function, x: torch.Tensor, gradients: bool) -> float:
    x = x.detach().requires_grad_(gradients)
    start = time.perf_counter()
    with torch.set_grad_enabled(gradients):
        loss = function.apply(x, None, 20.0, "partner", None, True, 0.0, None, gradients)
        if gradients:
            loss.backward()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("threads", type=int)
    parser.add_argument("--tiles", default="512", help="the schedule's MAX_TILE values to time, comma-separated")
    parser.add_argument("--no-grad", action="store_true", help="forward only (no gradients formed)")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--points", default=None, help="MxD,... instead of POINTS")
    args = parser.parse_args()
    points = POINTS if args.points is None else [tuple(map(int, p.split("x"))) for p in args.points.split(",")]
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} thread(s), float32, "
          f"{'forward only' if args.no_grad else 'forward + backward'}")
    for m, d in points:
        x = torch.randn(m, d, generator=torch.Generator().manual_seed(m + d))
        rounds = max(3, args.rounds if m * m * d <= 8192 * 8192 * 384 else args.rounds // 2)
        for tile in (int(t) for t in args.tiles.split(",")):
            schedule.MAX_TILE = tile
            times = {"softmax form": [], "schedule": []}
            for _ in range(rounds):
                times["softmax form"].append(call(softmax_form.SoftmaxSimilarityXentFunction, x, not args.no_grad))
                times["schedule"].append(call(schedule.SymmetricSimilarityXentFunction, x, not args.no_grad))
            stats = {name: (statistics.median(t[1:]) * 1e3, min(t[1:]) * 1e3, max(t[1:]) * 1e3)
                     for name, t in times.items()}
            a, b = stats["softmax form"], stats["schedule"]
            print(f"M={m:6d} D={d:4d} T={tile:5d}: softmax form {a[0]:8.1f} ms ({a[1]:.1f}-{a[2]:.1f}), schedule "
                  f"{b[0]:8.1f} ms ({b[1]:.1f}-{b[2]:.1f}), ratio {a[0] / b[0]:.2f}", flush=True)


if __name__ == "__main__":
    main()
