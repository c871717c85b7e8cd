#!/usr/bin/env python
"""The Matryoshka and layer-wise cost table: what k = 5 nested dims (and L layers of them) cost against the single
full-width loss, measured side by side in one run, forward + backward, time and peak extra memory.

For CoSENT (N pairs) and MultipleNegativesRankingLoss (N queries, a positive and a hard negative each; "mnrl-gte":
with GTE's four directions and hardness weighting, its blocks the similarity_lse op, no ST rows; "mnrl-filter": with
the false-negative filter, margin 0.1, the same op, no ST rows), at each D:

    single            our loss at the full width, one call                       (the 1.0x of every ratio)
    fused k=5         our loss with dims (bench_matryoshka.nested_dims): one call, one read of the embeddings
    ours k calls      our loss called once per truncated width, summed
    ST Matryoshka     sentence-transformers' MatryoshkaLoss over its own loss (one inner call per width)
    fused L x k       our loss on the stack [L, rows, D] with layer_weights and dims: one call
    ours L x k calls  our loss called once per layer and width
    ST L x Matryoshka sentence-transformers' MatryoshkaLoss once per layer: the loss part of its Matryoshka2dLoss
                      with n_layers_per_step=-1 (its AdaptiveLayerLoss calls the inner loss once per layer)

Target: the k-dim loss at most 1.3x the single loss (MNRL on CPU: 1.5x). The layer rows are compared with L times
the single loss. Timing: minimum of repeated runs (`harness.measure_fwd_bwd`); memory: peak extra bytes of a run.
With --interleave R, the rows chosen by --rows are instead timed in R rounds, each row once per round in a rotating
order (a machine whose speed drifts slows every contender alike), and the table gives each row's median, its spread
(min-max) and the ratio of the medians; no memory column.

    python bench/bench_matryoshka_ratios.py [--d 768 4096] [--pairs 4096] [--queries 1024] [--layers 12]
                                            [--dtype float32] [--device auto] [--out DIR]
                                            [--losses cosent mnrl mnrl-gte mnrl-filter] [--rows single "fused k=5"]
                                            [--interleave 15]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

import torch

import harness
import providers as P
from bench_matryoshka import nested_dims


def _cosine_inputs(n: int, d: int, layers: int | None, dtype, device, generator):
    shape = (2 * n, d) if layers is None else (layers, 2 * n, d)
    y_pred = torch.randn(*shape, generator=generator, device=device).to(dtype).requires_grad_()
    y_true = torch.randint(0, 5, (n,), generator=generator, device=device).float().repeat_interleave(2)
    return y_true, y_pred


def _mnrl_inputs(n: int, d: int, layers: int | None, dtype, device, generator):
    shape = (n, d) if layers is None else (layers, n, d)
    return [torch.randn(*shape, generator=generator, device=device).to(dtype).requires_grad_() for _ in range(3)]


# The rows of a table, in its order; "mnrl-gte" and "mnrl-filter" have no ST rows.
ROWS = ("single", "fused k=5", "ours k calls", "ST Matryoshka", "fused L x k", "ours L x k calls", "ST L x Matryoshka")


def cosine_rows(n: int, d: int, layers: int, dtype, device, generator, st_losses) -> dict:
    """name -> (run, leaves) of the CoSENT rows of the table."""
    import angle_kernels as ak

    dims = nested_dims(d)
    y_true, y_pred = _cosine_inputs(n, d, None, dtype, device, generator)
    _, stack = _cosine_inputs(n, d, layers, dtype, device, generator)
    rows = {
        "single": (lambda: ak.cosine_loss(y_true, y_pred, P.TAU), [y_pred]),
        "fused k=5": (lambda: ak.cosine_loss(y_true, y_pred, P.TAU, dims=dims), [y_pred]),
        "ours k calls": (lambda: sum(ak.cosine_loss(y_true, y_pred[:, :w], P.TAU) for w in dims), [y_pred]),
        "fused L x k": (lambda: ak.cosine_loss(y_true, stack, P.TAU, dims=dims, layer_weights=[1.0] * layers),
                        [stack]),
        "ours L x k calls": (lambda: sum(ak.cosine_loss(y_true, stack[layer, :, :w], P.TAU)
                                         for layer in range(layers) for w in dims), [stack]),
    }
    if st_losses is None:  # sentence-transformers not installed: no ST rows (main says so)
        return rows
    model = P.PrecomputedEmbeddings()
    st = st_losses.MatryoshkaLoss(model, st_losses.CoSENTLoss(model, scale=P.TAU), dims)

    def st_call(x):
        return st(P.columns(x[0::2], x[1::2]), y_true[0::2])
    st_rows = {"ST Matryoshka": (lambda: st_call(y_pred), [y_pred]),
               "ST L x Matryoshka": (lambda: sum(st_call(stack[layer]) for layer in range(layers)), [stack])}
    return {name: {**rows, **st_rows}[name] for name in ROWS}


# MNRL with GTE's four directions and hardness weighting: every block a similarity_lse call (the "mnrl-gte" rows)
GTE_OPTIONS = dict(directions=("query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"),
                   hardness_mode="in_batch_negatives", hardness_strength=3.0)
# MNRL with the false-negative filter (the "mnrl-filter" rows): its block a similarity_lse call with a filter
FILTER_OPTIONS = dict(false_negative_margin=0.1)


def mnrl_rows(n: int, d: int, layers: int, dtype, device, generator, st_losses, options: dict | None = None) -> dict:
    """name -> (run, leaves) of the MultipleNegativesRankingLoss rows of the table; with `options` (GTE_OPTIONS) our
    loss with those options, and no sentence-transformers rows."""
    import angle_kernels as ak

    dims = nested_dims(d)
    q, p, neg = _mnrl_inputs(n, d, None, dtype, device, generator)
    stack = _mnrl_inputs(n, d, layers, dtype, device, generator)

    def ours(a, b, c, **kwargs):
        return ak.multiple_negatives_ranking_loss(a, b, (c,), scale=P.TAU, **kwargs, **(options or {}))
    rows = _ours_only(ours, q, p, neg, stack, dims, layers)
    if options or st_losses is None:  # st_losses None: sentence-transformers not installed (main says so)
        return rows
    model = P.PrecomputedEmbeddings()
    st = st_losses.MatryoshkaLoss(model, st_losses.MultipleNegativesRankingLoss(model, scale=P.TAU), dims)
    st_rows = {"ST Matryoshka": (lambda: st(P.columns(q, p, neg), None), [q, p, neg]),
               "ST L x Matryoshka": (lambda: sum(st(P.columns(*(t[layer] for t in stack)), None)
                                                 for layer in range(layers)), stack)}
    return {name: {**rows, **st_rows}[name] for name in ROWS}


def _ours_only(ours, q, p, neg, stack, dims, layers) -> dict:
    """The rows of our loss (`ours`, its options bound) on the given inputs."""
    return {
        "single": (lambda: ours(q, p, neg), [q, p, neg]),
        "fused k=5": (lambda: ours(q, p, neg, dims=dims), [q, p, neg]),
        "ours k calls": (lambda: sum(ours(q[:, :w], p[:, :w], neg[:, :w]) for w in dims), [q, p, neg]),
        "fused L x k": (lambda: ours(*stack, dims=dims, layer_weights=[1.0] * layers), stack),
        "ours L x k calls": (lambda: sum(ours(*(t[layer, :, :w] for t in stack)) for layer in range(layers)
                                         for w in dims), stack),
    }


def measure(rows: dict, device: str, repeats: int, time_per_case: float) -> dict:
    results = {}
    for run, leaves in rows.values():  # one-time costs (lazy imports, thread pools) out of every measured run
        harness.fwd_bwd(run, leaves)
    for name, (run, leaves) in rows.items():
        results[name] = harness.measure_fwd_bwd(run, leaves, device, repeats=repeats, time_per_case=time_per_case)
        print(f"  {name:<18} {harness.fmt_seconds(results[name]['min_s']):>10} "
              f"{harness.fmt_bytes(results[name]['extra_bytes']):>10}", flush=True)
    return results


def measure_interleaved(rows: dict, device: str, rounds: int) -> dict:
    """name -> sorted seconds of `rounds` forward + backward runs, the rows taking turns (module docstring)."""
    names = list(rows)
    for run, leaves in rows.values():  # warm: one-time costs out of every timed run
        harness.fwd_bwd(run, leaves)
        harness.fwd_bwd(run, leaves)
    times = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            run, leaves = rows[name]
            if device == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            harness.fwd_bwd(run, leaves)
            if device == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - start)
    return {name: sorted(t) for name, t in times.items()}


def interleaved_table(loss: str, size: str, d: int, times: dict) -> list[str]:
    first = next(iter(times))
    base = statistics.median(times[first])
    body = [[name, harness.fmt_seconds(statistics.median(t)),
             f"{harness.fmt_seconds(t[0])} - {harness.fmt_seconds(t[-1])}",
             f"{statistics.median(t) / base:.2f}x"] for name, t in times.items()]
    return [f"### {loss}, {size}, D = {d}, dims {nested_dims(d)} ({len(times[first])} interleaved rounds)", "",
            *harness.markdown_table(["", "median", "spread (min - max)", f"/ {first}"], body), ""]


def table(loss: str, size: str, d: int, layers: int, results: dict) -> list[str]:
    single = results["single"]
    body = []
    for name, r in results.items():
        baseline = layers * single["min_s"] if "L x" in name else single["min_s"]
        body.append([name, harness.fmt_seconds(r["min_s"]), f"{r['min_s'] / single['min_s']:.2f}x",
                     f"{r['min_s'] / baseline:.2f}x", harness.fmt_bytes(r["extra_bytes"])])
    return [f"### {loss}, {size}, D = {d}, dims {nested_dims(d)}, L = {layers}", "",
            *harness.markdown_table(["", "time (min)", "/ single", "/ (L x) single", "peak extra memory"], body), ""]


def main(argv: list[str]) -> int:
    # the whole docstring: the rows and the usage line are what the flags choose among
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--d", type=int, nargs="+", default=[768, 4096],
                        help="embedding widths D, one table per loss and width (default: %(default)s)")
    parser.add_argument("--pairs", type=int, default=4096, help="CoSENT: N pairs (2N rows) (default: %(default)s)")
    parser.add_argument("--queries", type=int, default=1024,
                        help="MNRL: N queries (2N candidates) (default: %(default)s)")
    parser.add_argument("--layers", type=int, default=12,
                        help="L, the layers of the layer-wise rows (default: %(default)s)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"],
                        help="the embeddings' dtype (default: %(default)s)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: CUDA where it is available (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="CPU: timed runs of each row at most, the table giving the fastest (CUDA: do_bench's "
                             "runs) (default: %(default)s)")
    parser.add_argument("--time-per-case", type=float, default=3.0,
                        help=f"CPU: seconds; no more runs of a row once its runs took this long and "
                             f"{harness.MIN_CPU_RUNS} are done (default: %(default)s)")
    parser.add_argument("--out", type=Path, default=None,
                        help="also write the table to OUT/table.md (default: printed only)")
    parser.add_argument("--losses", nargs="+", default=["cosent", "mnrl"],
                        choices=["cosent", "mnrl", "mnrl-gte", "mnrl-filter"],
                        help="the tables to make (default: %(default)s)")
    parser.add_argument("--rows", nargs="+", default=None,
                        help="only these rows (e.g. single 'fused k=5'; default: every row)")
    parser.add_argument("--interleave", type=int, default=0, metavar="R",
                        help="time the rows in R interleaved rounds (medians, spreads) instead (default: 0, off)")
    args = parser.parse_args(argv)
    for flag in ("pairs", "queries", "layers", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be a positive integer, got {getattr(args, flag)}")
    if min(args.d) < 1:
        parser.error(f"--d takes positive widths, got {' '.join(map(str, args.d))}")
    if args.interleave < 0:
        parser.error(f"--interleave takes a number of rounds (0: off), got {args.interleave}")
    if not args.time_per_case >= 0:
        parser.error(f"--time-per-case must be 0 or more, got {args.time_per_case:g}")
    if args.out is not None:
        if problem := harness.output_folder_problem("--out", args.out):
            parser.error(problem)
        args.out.mkdir(parents=True, exist_ok=True)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    if device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    try:
        st_losses = P.sentence_transformers_losses()
    except ImportError as exc:  # an optional package: the table keeps our rows
        st_losses, no_st = None, f"sentence-transformers is not available ({type(exc).__name__}: {exc}): no ST rows"
        print(f"# {no_st}", flush=True)
    for key in args.losses if args.rows else ():  # every loss's rows known before any is measured
        with_st = key in ("cosent", "mnrl") and st_losses is not None
        rows = ROWS if with_st else tuple(name for name in ROWS if not name.startswith("ST"))
        unknown = [name for name in args.rows if name not in rows]
        if unknown:
            parser.error(f"--rows: no row {', '.join(map(repr, unknown))} for {key}; its rows: "
                         f"{', '.join(map(repr, rows))}")
    dtype = getattr(torch, args.dtype)
    generator = torch.Generator(device=device).manual_seed(0)
    lines = [f"# Matryoshka and layer-wise cost ({device}, {args.dtype}, forward + backward)", "",
             f"`python bench/bench_matryoshka_ratios.py {' '.join(argv)}`", "",
             f"Environment: {harness.describe_environment(device)}", ""]
    if st_losses is None:
        lines += [f"{no_st[0].upper()}{no_st[1:]}.", ""]
    for d in args.d:
        queries = f"N = {args.queries} queries, 2N candidates"
        for key, loss, make, size in (
                ("cosent", "CoSENT", cosine_rows, f"N = {args.pairs} pairs"),
                ("mnrl", "MultipleNegativesRankingLoss", mnrl_rows, queries),
                ("mnrl-gte", "MultipleNegativesRankingLoss, GTE directions and hardness",
                 functools.partial(mnrl_rows, options=GTE_OPTIONS), queries),
                ("mnrl-filter", "MultipleNegativesRankingLoss, false-negative filter",
                 functools.partial(mnrl_rows, options=FILTER_OPTIONS), queries)):
            if key not in args.losses:
                continue
            n = args.pairs if loss == "CoSENT" else args.queries
            print(f"{loss} {size} D={d}", flush=True)
            rows = make(n, d, args.layers, dtype, device, generator, st_losses)
            if args.rows:  # the table's ratios are to the single row: measured whenever a table is made
                wanted = args.rows if args.interleave or "single" in args.rows else ["single", *args.rows]
                unknown = [name for name in wanted if name not in rows]
                if unknown:
                    parser.error(f"--rows: no row {', '.join(map(repr, unknown))} for {key}; its rows: "
                                 f"{', '.join(map(repr, rows))}")
                rows = {name: rows[name] for name in wanted}
            if args.interleave:
                lines += interleaved_table(loss, size, d, measure_interleaved(rows, device, args.interleave))
            else:
                lines += table(loss, size, d, args.layers, measure(rows, device, args.repeats, args.time_per_case))
            del rows
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        harness.write_text_atomic(args.out / "table.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
