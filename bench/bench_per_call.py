#!/usr/bin/env python
"""The per-call cost of a small loss call: ours against the eager formula, forward + backward, side by side.

At 256 pairs and D = 64 (the defaults) a call is a few hundred microseconds of arithmetic, so what this measures is
what every call pays besides it: argument checks, dispatch, the op's bookkeeping. Four loss families, each against
its eager formula (the N x N matrix written out in PyTorch, as the reference packages compute it):

    cosine_loss              CoSENT on pair scores and the ranking term   eager: cosines, the pairwise logsumexp
    in_batch_negative_loss   AnglE's in-batch negatives (similarity_xent) eager: masked 2N x 2N cross-entropy
    mnrl                     multiple_negatives_ranking_loss (similarity_xent) eager: N x N cross-entropy
    gist_loss                guided negatives (similarity_lse)             eager: three guided N x N blocks

Every round times each row once (so a machine whose speed drifts slows every contender alike); the table gives each
row's median over the rounds after the first ten with its interquartile range, and eager ÷ ours, the eager formula's
median over ours (above 1: ours is faster), the direction of bench_losses.py's and bench_training.py's ratios
(bench_matryoshka_ratios.py's columns are the other way: a loss's cost over its one-width baseline's). Target: our
call within 1.2x of the eager formula's time, eager ÷ ours at least 0.83. One thread by default (--threads), as the
per-call figures in the CHANGELOG were measured. `--losses` times only some
families: with one, its two rows alternate call after call, as in a training loop that calls one loss (with all
four, each call follows the other families' calls, which have evicted some of its data and code from the caches:
the fixed cost of a small call grows).

    python bench/bench_per_call.py [--pairs 256] [--dim 64] [--rounds 80] [--threads 1] [--losses mnrl,...] [--json]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

import angle_kernels as ak


def _cosine_matrix(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return F.normalize(a, dim=-1) @ F.normalize(b, dim=-1).T


def contenders(pairs: int, dim: int, seed: int = 0) -> dict[str, tuple]:
    """Row name -> (call, leaves), ours and the eager formula of each family on the same inputs."""
    gen = torch.Generator().manual_seed(seed)
    q, p = (torch.randn(pairs, dim, generator=gen).requires_grad_() for _ in range(2))
    guide_q, guide_p = (torch.randn(pairs, dim, generator=gen) for _ in range(2))
    y = torch.randn(2 * pairs, dim, generator=gen).requires_grad_()
    graded = torch.rand(pairs, generator=gen).repeat_interleave(2)
    positive = torch.ones(2 * pairs)
    partner = torch.arange(2 * pairs) ^ 1
    diagonal = torch.arange(pairs)

    def eager_cosine():
        cos = F.cosine_similarity(y[0::2], y[1::2]) * 20.0
        labels = graded[0::2]
        diff = cos[None, :] - cos[:, None] - (1 - (labels[:, None] > labels[None, :]).float()) * 1e12
        return torch.logsumexp(torch.cat([torch.zeros(1), diff.flatten()]), 0)

    def eager_in_batch():
        logits = _cosine_matrix(y, y) * 20.0
        return F.cross_entropy(logits.masked_fill(torch.eye(2 * pairs, dtype=torch.bool), float("-inf")), partner)

    def eager_mnrl():
        return F.cross_entropy(_cosine_matrix(q, p) * 20.0, diagonal)

    def eager_gist():  # sentence-transformers' GISTEmbedLoss, absolute margin 0, temperature 0.01
        ap, aa, pp = _cosine_matrix(q, p), _cosine_matrix(q, q), _cosine_matrix(p, p)
        guide_ap, guide_aa, guide_pp = (_cosine_matrix(guide_q, guide_p), _cosine_matrix(guide_q, guide_q),
                                        _cosine_matrix(guide_p, guide_p))
        guided = guide_ap.diagonal().view(-1, 1)
        ap = ap.masked_fill((guide_ap > guided) & ~torch.eye(pairs, dtype=torch.bool), float("-inf"))
        aa, pp = aa.masked_fill(guide_aa > guided, float("-inf")), pp.masked_fill(guide_pp > guided, float("-inf"))
        return F.cross_entropy(torch.cat([ap, aa, pp], dim=1) / 0.01, diagonal)

    return {
        "cosine_loss": (lambda: ak.cosine_loss(graded, y, 20.0), [y]),
        "eager cosine": (eager_cosine, [y]),
        "in_batch_negative_loss": (lambda: ak.in_batch_negative_loss(positive, y), [y]),
        "eager in-batch": (eager_in_batch, [y]),
        "mnrl": (lambda: ak.multiple_negatives_ranking_loss(q, p), [q, p]),
        "eager mnrl": (eager_mnrl, [q, p]),
        "gist_loss": (lambda: ak.gist_loss(q, p, guide_q, guide_p), [q, p]),
        "eager gist": (eager_gist, [q, p]),
    }


FAMILIES = {"cosine_loss": "eager cosine", "in_batch_negative_loss": "eager in-batch", "mnrl": "eager mnrl",
            "gist_loss": "eager gist"}  # ours -> its eager row


def timings(pairs: int = 256, dim: int = 64, rounds: int = 80, warm_rounds: int = 10,
            losses: tuple[str, ...] = tuple(FAMILIES)) -> dict[str, list[float]]:
    """Row name -> ms of forward + backward in each round after `warm_rounds` (all of them when there are no more),
    every row of the `losses` families (FAMILIES' keys) once per round."""
    rows = {name: row for name, row in contenders(pairs, dim).items()
            if name in losses or name in (FAMILIES[family] for family in losses)}
    times: dict[str, list[float]] = {name: [] for name in rows}
    for _ in range(rounds):
        for name, (call, leaves) in rows.items():
            for leaf in leaves:
                leaf.grad = None
            start = time.perf_counter()
            call().backward()
            times[name].append(time.perf_counter() - start)
    return {name: [x * 1e3 for x in (t[warm_rounds:] or t)] for name, t in times.items()}


def measure(pairs: int = 256, dim: int = 64, rounds: int = 80, warm_rounds: int = 10,
            losses: tuple[str, ...] = tuple(FAMILIES)) -> dict[str, float]:
    """Row name -> median ms of forward + backward over the rounds after `warm_rounds` (`timings`)."""
    return {name: statistics.median(t) for name, t in timings(pairs, dim, rounds, warm_rounds, losses).items()}


def _quartiles(times: list[float]) -> tuple[float, float]:
    if len(times) < 2:
        return times[0], times[0]
    q1, _, q3 = statistics.quantiles(times, n=4, method="inclusive")
    return q1, q3


def table(times: dict[str, list[float]]) -> str:
    """Each family's line: ours and the eager formula, median ms (interquartile range), and eager ÷ ours."""
    def cell(t):
        q1, q3 = _quartiles(t)
        return f"{statistics.median(t):.3f} ({q1:.3f}-{q3:.3f})"

    lines = ["| loss | ours ms: median (IQR) | eager ms: median (IQR) | eager ÷ ours (above 1: ours is faster) |",
             "|---|---|---|---|"]
    for ours, eager in FAMILIES.items():
        if ours in times:
            ratio = statistics.median(times[eager]) / statistics.median(times[ours])
            lines.append(f"| {ours} | {cell(times[ours])} | {cell(times[eager])} | {ratio:.2f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=256, help="N, the pairs of a call (default: %(default)s)")
    parser.add_argument("--dim", type=int, default=64, help="D, the embedding width (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=80,
                        help="rounds, each timing every row once; the first ten (all but the last, where there are "
                             "no more) are not counted (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--losses", default=",".join(FAMILIES),
                        help=f"comma-separated families to time, of {','.join(FAMILIES)} (default: all)")
    parser.add_argument("--json", action="store_true",
                        help="print the medians (ms) as JSON instead of the table (strict JSON: a median that is not "
                             "finite is null)")
    args = parser.parse_args(argv)
    for name in ("pairs", "dim", "rounds", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be a positive integer, got {getattr(args, name)}")
    losses = tuple(name.strip() for name in args.losses.split(",") if name.strip())
    unknown = [name for name in losses if name not in FAMILIES]
    if unknown or not losses:
        parser.error(f"--losses takes a comma-separated subset of {','.join(FAMILIES)}, got {args.losses!r}")
    torch.set_num_threads(args.threads)
    warm_rounds = min(10, args.rounds - 1)
    times = timings(args.pairs, args.dim, args.rounds, warm_rounds=warm_rounds, losses=losses)
    if args.json:
        # imported here, not above with torch: harness sets OMP_WAIT_POLICY for torch's threads, which these figures
        # were measured without
        import harness

        print(harness.json_text({name: statistics.median(t) for name, t in times.items()}, indent=None))
    else:
        print(f"{args.pairs} pairs, D = {args.dim}, {args.threads} thread(s), forward + backward: "
              f"{args.rounds} rounds, the first {warm_rounds} not counted\n")
        print(table(times))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
