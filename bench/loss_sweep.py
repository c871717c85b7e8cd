"""Benchmark our losses against the reference (angle-emb 0.6.1), sentence-transformers and eager PyTorch.

The loss sweep's machinery, over whichever losses it is given (name -> LossBench): bench_losses.py runs it over
every family's losses (its registry), and each family's module over its own (bench_ranking.py, bench_similarity.py,
bench_arccse.py, bench_matryoshka.py). Imports go one way: this module and the families import harness.py and
providers.py, bench_losses.py imports the families and this module, none of which imports it back.
bench_losses.py says what is measured and how.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import math
import os
import statistics
import sys
import textwrap
import time
import traceback
from pathlib import Path

import harness  # first: sets OMP_WAIT_POLICY before torch loads
import providers as P
import torch
from harness import GB, MB


# --------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------


# Our backends, by the suffix of their providers' names (ours-torch, ...): what --providers may name besides a family.
OUR_BACKENDS = ("torch", "triton", "cuda")
OUR_PROVIDERS = tuple(f"ours-{backend}" for backend in OUR_BACKENDS)


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.replace("_", "").split(",") if x]


def parse_args(argv, losses: dict, default_losses) -> argparse.Namespace:
    """The sweep's options; --losses names some of `losses` (name -> LossBench), `default_losses` by default."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--losses", default=",".join(default_losses),
                        help="comma-separated subset of " + ",".join(losses))
    def growing_as(grows):
        return ", ".join(name for name, loss in losses.items() if loss.grows == grows)

    parser.add_argument("--n", type=int_list, default=[256, 1024, 4096, 16384],
                        help=f"sizes N of the losses whose cost grows as N ({growing_as('N')})")
    parser.add_argument("--n-quadratic", type=int_list, default=[256, 512, 1024],
                        help=f"sizes N of the losses whose cost grows as N^2 D ({growing_as('N^2')})")
    parser.add_argument("--d", type=int_list, default=[768], help="embedding sizes D")
    parser.add_argument("--dtypes", default="float32", help="comma-separated: " + ",".join(harness.DTYPES))
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--providers", default=",".join(P.FAMILIES),
                        help="families to include: ours (or some of our backends: ours-triton, ours-cuda, "
                             "ours-torch), reference, sentence-transformers, eager")
    parser.add_argument("--angle-emb-loss", default=None,
                        help="angle-emb's loss.py or an angle-emb wheel (default: the installed package's loss.py); "
                             "a path given that holds neither is refused")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="CPU: timed runs per case (at most), one per round: the providers of a size take turns, "
                             "each run in a fresh process after its warm-up pass")
    parser.add_argument("--time-per-case", type=float, default=3.0,
                        help="CPU: no more rounds for a case whose timed runs took this many seconds, once "
                             f"{harness.MIN_CPU_RUNS} are done")
    parser.add_argument("--max-run-seconds", type=float, default=10.0,
                        help="skip a size whose predicted single run (extrapolated from the previous size) is longer")
    parser.add_argument("--max-ref-gb", type=float, default=2.0,
                        help="skip a baseline (angle-emb, sentence-transformers, eager) at sizes whose estimated "
                             "extra memory exceeds this")
    parser.add_argument("--case-timeout", type=float, default=600.0,
                        help="CPU: kill a case's child process after this many seconds")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds for the whole sweep: once spent (or when a case's predicted runs would overrun "
                             "it: on CUDA a dozen, on a CPU a round's warm-up pass and timed run and one more, "
                             "predicted from the case's earlier rounds, else the previous size's run, else runs at "
                             "smaller sizes in a process of their own), the remaining cases are recorded as skipped")
    parser.add_argument("--warm-up-budget", type=float, default=None,
                        help="CUDA, with --time-budget: seconds of it for the cases' first calls (one untimed call "
                             "per case before its timed runs: the compiles and the autotuning at its shape, recorded "
                             "as cold_s), charged apart from the timed runs, which get the rest; once either is "
                             "spent, the remaining cases are recorded as skipped")
    parser.add_argument("--stat", default="median", choices=("median", "min"),
                        help="which time the table, ratios and plot show (both are in results.json); "
                             "min is steadier on a machine shared with other jobs")
    parser.add_argument("--allow-tf32", action="store_true", help="CUDA: let float32 matmuls use TF32 (all providers)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-check", action="store_true",
                        help="skip the agreement check of all providers before the sweep")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--out", default=None,
                        help="output folder (default bench/results/<device>-<date>, with b, c, ... after the date "
                             "where that folder exists: a sweep never writes into an earlier one's results; a "
                             "folder that holds committed files is refused)")
    args = parser.parse_args(argv)
    args.losses = [x for x in args.losses.split(",") if x]
    for loss in args.losses:
        if loss not in losses:
            parser.error(f"--losses: unknown loss {loss!r}; choose from {', '.join(losses)}")
    args.dtypes = [x for x in args.dtypes.split(",") if x]
    for name in args.dtypes:
        if name not in harness.DTYPES:
            parser.error(f"--dtypes: unknown dtype {name!r}; choose from {', '.join(harness.DTYPES)}")
    args.providers = [x for x in args.providers.split(",") if x]
    known = (*P.FAMILIES, *OUR_PROVIDERS)
    unknown = [name for name in args.providers if name not in known]
    if unknown:
        parser.error(f"--providers: unknown provider {', '.join(map(repr, unknown))}; choose from {', '.join(known)}")
    for flag in ("losses", "dtypes", "providers"):
        if not getattr(args, flag):
            parser.error(f"--{flag} names none")
    if args.angle_emb_loss is not None:
        # a path given by hand that holds no loss.py is a mistake to fix before the sweep, not a reference to leave
        # out of the table as "not available" (as an angle-emb that is not installed is)
        try:
            P.find_reference_loss_file(args.angle_emb_loss)
        except FileNotFoundError as exc:
            parser.error(str(exc))
    for flag in ("n", "n_quadratic", "d"):
        values = getattr(args, flag)
        if not values or min(values) < 1:
            parser.error(f"--{flag.replace('_', '-')} takes positive sizes, got {values}")
    for flag in ("threads", "repeats"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag} must be a positive integer, got {getattr(args, flag)}")
    for flag in ("time_per_case", "max_run_seconds", "max_ref_gb", "case_timeout", "time_budget", "warm_up_budget"):
        value = getattr(args, flag)
        if value is not None and not value >= 0:  # NaN too
            parser.error(f"--{flag.replace('_', '-')} must be 0 or more, got {value:g}")
    if not args.case_timeout > 0:  # 0 would kill the providers' probe before the sweep starts
        parser.error(f"--case-timeout must be more than 0 seconds, got {args.case_timeout:g}")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    if args.warm_up_budget is not None and (args.device != "cuda" or args.time_budget is None):
        parser.error("--warm-up-budget splits --time-budget on CUDA (on a CPU each case runs in a process of its "
                     "own, warmed up at a tiny size first)")
    # the default folder is a new one under results/ (unused_results_folder); a folder given is checked before work
    if args.out and (problem := harness.output_folder_problem("--out", Path(args.out))):
        parser.error(problem)
    return args


def sizes_of(args, loss) -> list[int]:
    return sorted(args.n_quadratic if loss.grows == "N^2" else args.n)


# --------------------------------------------------------------------------------------------------------
# Measuring one case
# --------------------------------------------------------------------------------------------------------


def measure_cpu_case(provider, loss, n, d, dtype, threads, repeats, time_per_case, seed, headroom_bytes):
    """Runs in a forked child (harness.call_in_fork): warm up, build inputs, measure memory and time."""
    torch.set_num_threads(threads)
    # Warm-up at a tiny size first, so one-time costs (lazy imports, thread pools) stay out of the numbers; and one
    # product large enough for the BLAS's one-time GEMM workspace (~3.4 MB on MKL, first touched by products of 64
    # and more), which the tiny loss does not reach and the first measured product case would count.
    tiny = loss.build_inputs(8, min(d, 64), dtype, "cpu", seed + 1)
    harness.fwd_bwd(provider.make(loss.name, tiny), harness.grad_leaves(tiny))
    del tiny
    torch.ones(256, 256, dtype=dtype) @ torch.ones(256, 256, dtype=dtype)
    inputs = loss.build_inputs(n, d, dtype, "cpu", seed)
    measured = harness.measure_fwd_bwd(provider.make(loss.name, inputs), harness.grad_leaves(inputs), "cpu",
                                       repeats, time_per_case, address_space_headroom=headroom_bytes)
    return {**measured, "input_bytes": harness.input_bytes(inputs), "threads": torch.get_num_threads()}


def probe_cpu_case(provider, loss, n, d, dtype, threads, seed, deadline) -> float | None:
    """Runs in a forked child of its own (the probes' allocations would move the measured process's peak memory by
    up to 20 %): the forecast of one run of the case (probed_run_seconds), or None where a probe would not end by
    `deadline` (time.perf_counter())."""
    torch.set_num_threads(threads)

    def run_at(m):
        inputs = loss.build_inputs(m, d, dtype, "cpu", seed)
        return harness.cold_call(provider.make(loss.name, inputs), harness.grad_leaves(inputs), "cpu")

    return probed_run_seconds(run_at, n, growth_power(loss, provider.family),
                              fits=lambda seconds: seconds <= deadline - time.perf_counter())


def measure_in_process(provider, loss, n, d, dtype, seed, device: str = "cuda", budget=None) -> dict:
    """A case in this process (CUDA): its inputs, its first call (`cold_s`: compiles and autotuning at this shape,
    charged to `budget`'s warm-up, harness.SweepBudget), then its warm runs (charged to its timed runs)."""
    if device == "cuda":
        torch.cuda.synchronize()
    harness.free_cuda_memory()
    inputs = loss.build_inputs(n, d, dtype, device, seed)
    run, leaves = provider.make(loss.name, inputs), harness.grad_leaves(inputs)
    with harness.charging(budget, "warm_up"):
        cold_s = harness.cold_call(run, leaves, device)
    with harness.charging(budget, "timed"):
        measured = harness.measure_fwd_bwd(run, leaves, device)
    return {**measured, "cold_s": cold_s, "input_bytes": harness.input_bytes(inputs)}


def probe_check_and_limits_cpu(args, losses, providers):
    """In a child: which of our backends work, do all providers agree on a small input, and the CPU's limits."""
    torch.set_num_threads(args.threads)
    usable, missing = P.ours_backends("cpu", probe=True)
    working = [p for p in providers if p.family != "ours" or p.context in usable]
    missing = {f"ours-{name}": why for name, why in missing.items()}
    checks = {}
    if not args.no_check:
        for loss in losses:
            checks[loss.name] = P.check_agreement(working, loss, "cpu", dtype=torch.float64)
    return [p.name for p in working], missing, checks, harness.measure_limits("cpu", args.dtypes)


def estimate_extra_bytes(provider, loss, n: int, d: int, dtype: torch.dtype) -> int:
    """A rough upper estimate of the peak extra memory of one forward + backward pass.

    For the eager baselines this is dominated by their N^2 matrices (`LossBench.bytes_per_element`); for
    ours and sentence-transformers' sort-based CoSENT/AnglE it is a few copies of the embeddings.
    """
    elem = max(harness.element_bytes(dtype), 4)
    linear = 8 * loss.embedding_rows(n) * d * elem
    per_element = loss.bytes_per_element.get(provider.family)
    if per_element is None:
        return linear
    return int(per_element * loss.eager_matrix_elements(n)) + linear


# Below this a run's time is mostly overheads and noise, too little to extrapolate from
FORECAST_MIN_S = 0.05


def growth_power(loss, family) -> int:
    """How a run's time grows with N: N^2 work for the quadratic losses and for the eager baselines' N x N
    matrices, N otherwise."""
    return 2 if (loss.grows == "N^2" or loss.bytes_per_element.get(family)) else 1


def predicted_run_seconds(previous, loss, family, n, shortest_s: float = FORECAST_MIN_S) -> float | None:
    """Extrapolate a run time from the previous measured size (growth_power); none from a run under `shortest_s`
    (a run's overheads, which do not grow with N, scale into a forecast that errs high)."""
    if previous is None or previous[1] < shortest_s:
        return None
    prev_n, prev_s = previous
    return prev_s * (n / prev_n) ** growth_power(loss, family)


# The first probe of probed_run_seconds: a size whose run takes a few milliseconds at most
PROBE_N = 8


def probed_run_seconds(run_at, n: int, power: int, fits) -> float | None:
    """A forecast of one run at size `n` where nothing measured forecasts it (a case's first size, or a previous
    size's run under FORECAST_MIN_S), for a time budget: runs at doubling sizes from PROBE_N (run_at(m): the seconds
    of one run at m) up to n // 2, until one takes FORECAST_MIN_S, scaled to n by N^`power`. Each probe costs at most
    2^power times the one before, so the probes cost about twice the last at most; a probe whose forecast does not
    fit (`fits(seconds)`) is not run, and the forecast is None: the case does not fit either. Like a forecast from a
    previous size, it errs high by the overheads that do not grow with N, and low where the larger size runs slower
    per unit of work (out of the caches): in-batch negatives at N = 4096, D = 768, probed at 3.5 s a run, ran 4 s
    (the round's margin run, seconds_to_expect, is for that). The first probe runs twice, timed the second time: the
    process's first call pays one-off costs (lazy imports and initialisation) that, scaled by (n / m)^power, would
    forecast the case far slower than it runs and skip it under a budget it fits."""
    m = max(1, min(PROBE_N, n // 2))
    run_at(m)
    seconds = run_at(m)
    while seconds < FORECAST_MIN_S and 2 * m <= n // 2:
        if not fits(seconds * 2 ** power):
            return None
        m *= 2
        seconds = run_at(m)
    return seconds * (n / m) ** power


# What a first call needs at least of the warm-up's allowance when nothing smaller of the (loss, provider) was
# measured yet: a Triton loss's compiles and autotuning, about 15 s on an H100.
FIRST_CALL_S = 15.0


# What a CPU case's process costs besides its runs: the fork, the child's warm-up at a tiny size and its inputs (about
# 0.25 s a round for cosine from N = 16 to 16384 at D = 256 on 2 cores), twice that for a loaded machine; and the
# runs a time budget keeps beyond its warm-up pass and timed runs, for a load that rose since the previous size
CPU_PROCESS_S = 0.5
CPU_MARGIN_RUNS = 1


def seconds_to_expect(args, forecast: float, repeats: int) -> float:
    """What the time budget must have left for a case whose run is forecast at `forecast` seconds. On CUDA, a dozen
    runs (harness.RUNS_PER_CASE: do_bench's, with the warm-up and memory runs). On a CPU, what its process costs: its
    warm-up pass and `repeats` timed runs (in a round of the sweep, one), CPU_MARGIN_RUNS more and CPU_PROCESS_S."""
    if args.device != "cpu":
        return harness.RUNS_PER_CASE * forecast
    return (1 + repeats + CPU_MARGIN_RUNS) * forecast + CPU_PROCESS_S


def run_one(args, provider, loss, n, d, dtype, previous, limits, deadline=None, budget=None,
            repeats: int | None = None, measured_s: float | None = None) -> dict:
    """One case of one provider, or why it did not run. CPU: in a forked child, up to `repeats` timed runs
    (default --repeats) after its warm-up pass; the sweep calls it once per round with one run (`sweep`), with
    `measured_s`, the fastest run of the case's rounds so far, once it has one: the time budget's forecast of its
    next round. Where nothing forecasts a CPU round within a time budget, a process of probes does first
    (probe_cpu_case)."""
    repeats = args.repeats if repeats is None else repeats
    estimate = estimate_extra_bytes(provider, loss, n, d, dtype)
    out = {"estimate_bytes": estimate, "floor": loss.work_floor(n, d, dtype)}
    forecast = predicted_run_seconds(previous, loss, provider.family, n)
    budget_forecast = forecast if measured_s is None else measured_s
    if budget is not None:
        first_call = FIRST_CALL_S if previous is None else (forecast or 0.0) + 1.0
        if not budget.fits("warm_up", first_call):
            # The allowance is --warm-up-budget at most, less where the agreement check and the limits took the
            # sweep's time first (harness.warm_up_within): say what it was, not only the flag.
            left, allowed = max(0.0, budget.left("warm_up")), budget.allowed["warm_up"]
            return {**out, "status": "skipped", "note": f"skipped: warm-up allowance spent ({left:.0f} of "
                                                        f"{allowed:.0f} s left; a first call ~{first_call:.0f} s)"}
        if not budget.fits("timed", harness.RUNS_PER_CASE * (forecast or 0.0) + 1.0):
            return {**out, "status": "skipped", "note": f"skipped: --time-budget {args.time_budget:g} s spent"}
    elif deadline is not None:
        left = deadline - time.perf_counter()
        if left <= 0 or (budget_forecast is not None and seconds_to_expect(args, budget_forecast, repeats) > left):
            return {**out, "status": "skipped", "note": f"skipped: --time-budget {args.time_budget:g} s spent"}
    if provider.family != "ours" and estimate > args.max_ref_gb * GB:
        return {**out, "status": "skipped",
                "note": f"skipped: needs ~{harness.fmt_bytes(estimate)} (> --max-ref-gb {args.max_ref_gb:g})"}
    available = harness.free_bytes(args.device)
    if available is not None and estimate > 0.8 * available:
        return {**out, "status": "skipped",
                "note": f"skipped: needs ~{harness.fmt_bytes(estimate)}, {harness.fmt_bytes(available)} free"}
    if forecast is not None and forecast > args.max_run_seconds:
        return {**out, "status": "skipped",
                "note": f"skipped: ~{forecast:.0f} s per run (> --max-run-seconds {args.max_run_seconds:g})"}

    if args.device == "cpu":
        headroom = max(3 * estimate, 2 * GB)
        if available is not None:
            headroom = min(headroom, int(0.8 * available))
        if deadline is not None and budget_forecast is None:
            # nothing forecasts this round: the previous size's run, scaled, where it is too short to extrapolate
            # from (it scales high) and yet fits, else what a process of probes forecasts
            rough = predicted_run_seconds(previous, loss, provider.family, n, shortest_s=0.0)
            left = deadline - time.perf_counter()
            if rough is None or seconds_to_expect(args, rough, repeats) > left:
                # the probes' wait ends with the budget: probes still running then (stuck, or far slower than their
                # sizes' growth) say that the case, larger than any of them, does not fit either
                probes_until_spent = left < args.case_timeout
                probed = harness.call_in_fork(probe_cpu_case, provider, loss, n, d, dtype, args.threads, args.seed,
                                              deadline, timeout=min(args.case_timeout, max(0.0, left)))
                # a probe that failed otherwise forecasts nothing: the case itself runs, and its row says why it failed
                over = ((probed[0] == "timeout" and probes_until_spent)
                        or probed[0] == "ok" and (probed[1] is None or seconds_to_expect(args, probed[1], repeats)
                                                  > deadline - time.perf_counter()))
                if over:
                    return {**out, "status": "skipped", "note": f"skipped: --time-budget {args.time_budget:g} s spent",
                            "forecast_s": probed[1] if probed[0] == "ok" else None}
        payload = harness.call_in_fork(measure_cpu_case, provider, loss, n, d, dtype, args.threads, repeats,
                                       args.time_per_case, args.seed, headroom, timeout=args.case_timeout)
    else:
        try:
            payload = ("ok", measure_in_process(provider, loss, n, d, dtype, args.seed, args.device, budget))
        except Exception as exc:
            kind = "oom" if harness.is_oom(exc) else "error"
            payload = (kind, f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=6))
        if payload[0] != "ok":  # outside the except block: the traceback no longer pins the case's tensors
            harness.free_cuda_memory()

    if payload[0] == "ok":
        return shown_time({**out, "status": "ok", **payload[1]}, args, limits, dtype)
    if payload[0] in ("oom", "killed"):
        return {**out, "status": "OOM", "note": f"OOM: {payload[1]}"}
    if payload[0] == "timeout":
        return {**out, "status": "error", "note": f"{payload[1]} (--case-timeout)"}
    return {**out, "status": "error", "note": payload[1], "traceback": payload[2] if len(payload) > 2 else None}


# --------------------------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------------------------


def shown_time(row, args, limits, dtype) -> dict:
    """A measured row with the time the table, ratios and plot show (--stat's) and its achieved rate."""
    row["time_s"] = row[f"{args.stat}_s"]
    row.update(harness.achieved_rate(row["floor"], row["time_s"], limits, harness.dtype_name(dtype)))
    return row


def wants_another_round(args, rounds: list[dict]) -> bool:
    """Whether a provider whose rounds of a CPU case so far are `rounds` gets the next: up to --repeats rounds,
    while each measured; once harness.MIN_CPU_RUNS are done, only while its timed runs took --time-per-case seconds or
    less."""
    if len(rounds) >= args.repeats or (rounds and rounds[-1]["status"] != "ok"):
        return False
    spent = sum(sum(r.get("times_s") or [r["min_s"]]) for r in rounds)
    return len(rounds) < harness.MIN_CPU_RUNS or spent <= args.time_per_case


def merge_rounds(args, rounds: list[dict], limits, dtype) -> dict:
    """One row of a CPU case from its rounds (each a fresh process: a warm-up pass, which measures the peak extra
    memory, and one timed run): every timed run in times_s, their median and fastest; the median of the rounds' peak
    extra memory, every round's in extra_bytes_rounds. A round that failed (OOM, an error, a timeout) makes the row
    that failure; one skipped after some measured (--time-budget spent) ends the rounds and leaves their runs."""
    measured = [r for r in rounds if r["status"] == "ok"]
    failed = next((r for r in rounds if r["status"] != "ok"), None)
    if not measured or (failed is not None and failed["status"] != "skipped"):
        return failed
    times = [t for r in measured for t in (r.get("times_s") or [r["min_s"]])]
    extras = [r["extra_bytes"] for r in measured]
    row = {**measured[0], "median_s": statistics.median(times), "min_s": min(times), "times_s": times,
           "rounds": len(measured), "extra_bytes": int(statistics.median(extras)), "extra_bytes_rounds": extras,
           "timing": "wall clock, one run per round, each round a fresh process per provider, providers in turn"}
    return shown_time(row, args, limits, dtype)


def size_schedule(args, losses) -> list[tuple[object, int]]:
    """(loss, N) in the order they run: every loss's smallest size, then every loss's second size, and so on,
    so that a time budget cuts the largest sizes rather than whole losses."""
    ranked = [(rank, position, loss, n) for position, loss in enumerate(losses)
              for rank, n in enumerate(sizes_of(args, loss))]
    return [(loss, n) for _, _, loss, n in sorted(ranked, key=lambda item: item[:2])]


def sweep(args, losses, providers, limits, on_row=None, deadline=None, budget=None) -> list[dict]:
    """Every case, size by size with all providers of a size side by side (so that a change in the machine's load
    between sizes hits every provider alike). On a CPU, shared with other jobs whose load moves the times by tens of
    percent from one second to the next, the providers of a size take turns: round after round, each runs once in a
    fresh process (run_one with one timed run), until each has --repeats rounds (or harness.MIN_CPU_RUNS and
    --time-per-case seconds of runs, wants_another_round), and its row gathers its rounds (merge_rounds). On CUDA, a
    device of its own, each case runs once, do_bench's runs back to back. on_row(results) runs after every row; no
    case or round starts past `deadline` (time.perf_counter()), or when its forecast would overrun it
    (seconds_to_expect: on a CPU, what one round costs, forecast from the case's earlier rounds, else the previous
    size's, else probes: run_one), or, with a `budget` (harness.SweepBudget), when its first call or its timed runs
    would overrun their allowance."""
    results = []
    for dtype_name in args.dtypes:
        dtype = harness.DTYPES[dtype_name]
        for d in args.d:
            previous = {}  # (loss, provider name) -> (n, min seconds) of its last measured size
            for loss, n in size_schedule(args, losses):
                active = [provider for provider in providers if provider.provides(loss.name)]
                rounds = {provider.name: [] for provider in active}

                def measure(provider, repeats=None):
                    runs = [r["min_s"] for r in rounds[provider.name] if r["status"] == "ok"]
                    return run_one(args, provider, loss, n, d, dtype, previous.get((loss.name, provider.name)),
                                   limits, deadline, budget, repeats=repeats, measured_s=min(runs, default=None))

                if args.device == "cpu":
                    # every other round in reverse order (A B, B A, ...): a load that rises or falls through the
                    # rounds does not favour whoever always runs first
                    for turn_number in itertools.count():
                        turn = [p for p in active if wants_another_round(args, rounds[p.name])]
                        if not turn:
                            break
                        for provider in turn[::-1] if turn_number % 2 else turn:
                            rounds[provider.name].append(measure(provider, repeats=1))
                for provider in active:
                    row = {"loss": loss.name, "n": n, "d": d, "dtype": dtype_name, "provider": provider.name,
                           "family": provider.family, "calls": provider.calls(loss.name)}
                    row.update(merge_rounds(args, rounds[provider.name], limits, dtype) if args.device == "cpu"
                               else measure(provider))
                    if row["status"] == "ok":
                        previous[(loss.name, provider.name)] = (n, row["min_s"])  # the least noisy forecast
                    results.append(row)
                    print(progress_line(row), flush=True)
                    if on_row is not None:
                        on_row(results)
    return results


def progress_line(row) -> str:
    head = f"  {row['loss']:<11} N={row['n']:<7} D={row['d']:<5} {row['dtype']:<8} {row['provider']:<22}"
    if row["status"] == "ok":
        first = f"  (first call {row['cold_s']:.1f} s)" if "cold_s" in row else ""
        return head + (f" {row['median_s'] * 1e3:10.2f} ms (min {row['min_s'] * 1e3:.2f})"
                       f"  +{harness.fmt_bytes(row['extra_bytes'])}{first}")
    return head + f" {row.get('note', row['status'])}"


# --------------------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------------------


def time_text(row) -> str:
    """A measured row's time (--stat's) and its spread: the range of its timed runs where they were recorded (CPU
    wall clock, CUDA events), else the fastest run (triton's do_bench keeps only its median and fastest)."""
    shown = harness.fmt_seconds(row["time_s"])
    runs = row.get("times_s") or []
    if len(runs) >= 2:
        return f"{shown} ({harness.fmt_seconds_range(min(runs), max(runs))})"
    if row.get("min_s", row["time_s"]) < row["time_s"]:  # (a row of one run, or of a table made by hand, has none)
        return f"{shown} (min {harness.fmt_seconds(row['min_s'])})"
    return shown


def cell(row) -> str:
    if row is None:
        return "n/a"
    if row["status"] != "ok":
        return row.get("note", row["status"])
    return f"{time_text(row)}, +{harness.fmt_bytes(max(row['extra_bytes'], 0))}"


def ratio_cell(base, ours) -> str:
    """'time x, memory y': the baseline's over those of the provider the ratios are against (ours; with no backend of
    ours, the first provider, as render_markdown's header says); > 1 means that one is faster / needs less."""
    if base is None or ours is None or base["status"] != "ok" or ours["status"] != "ok":
        return "—"
    time_ratio = base["time_s"] / ours["time_s"]
    # RSS moves in pages and reuses freed memory: below 1 MB a ratio of memory says nothing.
    if ours["extra_bytes"] >= MB and base["extra_bytes"] >= MB:
        mem = f"{base['extra_bytes'] / ours['extra_bytes']:.3g}x"
    else:
        mem = "—"
    return f"{time_ratio:.3g}x, {mem}"


def rate_cell(row) -> str:
    if row is None or row.get("status") != "ok":
        return ""
    return harness.fmt_rate(row["rate"], row["rate_unit"], row.get("rate_fraction"))


def render_markdown(results, env, args, losses, limits, checks, missing, provider_names, primary) -> str:
    device_name = env.get("gpu") or env.get("cpu")
    lines = [f"# Loss benchmark: forward + backward, {args.device.upper()} ({device_name})", "",
             f"- date (UTC): {env['date']}; command: `{env['command']}`"]
    thread_text = (f"{env['threads']} threads of {env.get('logical_cpus')} logical CPUs, "
                   f"OMP_WAIT_POLICY={env.get('omp_wait_policy')}" if args.device == "cpu" else "")
    # where the results.json of a sweep from before it was recorded has no checkout, none is said
    checkout = (f" ({env['angle_kernels_path']}, commit {env['angle_kernels_commit']})"
                if "angle_kernels_commit" in env else "")
    # a package that is not installed (or a reference that did not run) has no version: None would read as one
    lines.append(f"- torch {env['torch']}, triton {env.get('triton') or 'not installed'}, sentence-transformers "
                 f"{env.get('sentence_transformers') or 'not installed'}, angle-emb "
                 f"{env.get('angle_emb') or 'not run'}, angle_kernels "
                 f"{env.get('angle_kernels')}{checkout}" + (f"; {thread_text}" if thread_text else ""))
    if args.device == "cuda":
        lines.append(f"- GPU {env.get('gpu')}, driver {env.get('driver')}, CUDA {env.get('cuda')}")
    if limits:
        lines.append(f"- measured limits: {harness.describe_limits(limits)}")
    load = env.get("load_average_1min")
    if load and args.device == "cpu":
        busy = max(load.values()) > (env.get("logical_cpus") or 1)
        lines.append(f"- load average (1 min) at start / end of the sweep: {load['start']} / {load['end']}"
                     + (" — more runnable tasks than CPUs: other jobs shared the machine, so times are noisy "
                        "(memory numbers are not affected)" if busy else ""))
    memory = "peak RSS of a fresh forked process" if args.device == "cpu" else "max_memory_allocated"
    lines.append(f"- time: {args.stat} of {harness.timing_description(args.device, args.repeats)}; "
                 f"memory: peak extra over the inputs ({memory}), gradients included")
    colds = [r["cold_s"] for r in results if "cold_s" in r]
    if colds:
        lines.append(f"- first calls (one untimed call per case before its timed runs: compiles, autotuning): "
                     f"{len(colds)} cases, {sum(colds):.1f} s in all, the longest {max(colds):.1f} s (cold_s in "
                     "results.json)")
    # --providers without any of our backends: the ratios are against the first provider (main's fallback), and
    # the header says so rather than calling it ours
    above_one = ("ours is faster / smaller" if primary in OUR_PROVIDERS else
                 f"{primary} is faster / smaller; no backend of ours ran, so the ratios are against the first provider")
    lines.append("- cells: `time (spread), +extra memory`, the spread being the timed runs' min-max (`min X` where "
                 "the timer kept only its median and its fastest run: triton's do_bench; every run is in results.json)")
    lines.append(f"- ratio columns: `baseline time / {primary} time, baseline memory / {primary} memory` (above 1: "
                 f"{above_one})")
    # only the limits measured: a row whose limit was not measured has no % (harness.achieved_rate)
    matmul_dtypes = [name for name in args.dtypes if f"matmul_{name}_TFLOPs" in limits]
    of_limits = ((["of the copy bandwidth above for GB/s"] if "copy_GBps" in limits else [])
                 + ([f"of the {'/'.join(matmul_dtypes)} matmul rate above for FLOP/s"] if matmul_dtypes else []))
    limit_text = (f"the % in brackets is {', '.join(of_limits)}" if of_limits
                  else "no % in brackets: no limit was measured")
    lines.append(f"- `{primary} achieved`: the work the loss cannot avoid (bytes moved, or matmul FLOPs) over its "
                 f"time; {limit_text}")
    if missing:
        lines.append("- not available here: " + "; ".join(f"{k} ({v})" for k, v in missing.items()))
    if checks:
        agreement = [f"{loss}/{name} vs {err['against']}: value {err['value']:.1e}, grad {err['grad']:.1e}"
                     for loss, errs in checks.items() for name, err in errs.items()]
        check_dtype = "float64" if args.device == "cpu" else "float32"
        lines.append(f"- agreement check (N=24, D=32, {check_dtype}): "
                     + ("; ".join(agreement) or f"nothing to compare: no provider besides {primary} ran"))
    lines.append("")

    index = {(r["loss"], r["n"], r["d"], r["dtype"], r["provider"]): r for r in results}
    for loss in losses:
        names = [name for name in provider_names if any(k[0] == loss.name and k[4] == name for k in index)]
        baselines = [name for name in names if name != primary]
        for dtype_name in args.dtypes:
            for d in args.d:
                header = ["N"] + names + [f"{name} ÷ {primary}" for name in baselines if primary in names]
                header.append(f"{primary} achieved (% of limit)")
                rows = []
                for n in sizes_of(args, loss):
                    by_provider = {name: index.get((loss.name, n, d, dtype_name, name)) for name in names}
                    ours = by_provider.get(primary)
                    cells = [f"{n:,}"] + [cell(by_provider[name]) for name in names]
                    if primary in names:
                        cells += [ratio_cell(by_provider[name], ours) for name in baselines]
                    rows.append(cells + [rate_cell(ours)])
                lines += [f"## {loss.name} (D={d}, {dtype_name})", "", *harness.markdown_table(header, rows), ""]
    return "\n".join(lines)


class Report:
    """table.md and results.json in the output folder, rewritten as the sweep goes (a killed run keeps them)."""

    def __init__(self, out: Path, env, args, losses, limits, checks, missing, provider_names, primary):
        self.out, self.env, self.args, self.losses, self.limits = out, env, args, losses, limits
        self.checks, self.missing, self.provider_names, self.primary = checks, missing, provider_names, primary
        self.started = time.perf_counter()
        self.budget: harness.SweepBudget | None = None  # --warm-up-budget's split of --time-budget, when given

    def write(self, results: list[dict], complete: bool) -> str:
        table = render_markdown(results, self.env, self.args, self.losses, self.limits, self.checks, self.missing,
                                self.provider_names, self.primary)
        payload = {"environment": self.env, "args": dict(vars(self.args)), "hardware_limits": self.limits,
                   "agreement_checks": self.checks, "not_available": self.missing, "ratios_against": self.primary,
                   "complete": complete, "sweep_seconds": time.perf_counter() - self.started, "results": results}
        if self.budget is not None:
            payload["budget"] = self.budget.summary()
        harness.write_text_atomic(self.out / "table.md", table + "\n")
        harness.write_json_atomic(self.out / "results.json", payload)
        return table


def size_label(n: float) -> str:
    n = int(round(n))
    if n >= 2**20 and n % 2**20 == 0:
        return f"{n // 2**20}M"
    if n >= 2**10 and n % 2**10 == 0:
        return f"{n // 2**10}k"
    return str(n)


COLORS = {"ours-triton": "#d62728", "ours-cuda": "#9467bd", "ours-torch": "#1f77b4",
          "angle-emb": "#ff7f0e", "sentence-transformers": "#2ca02c", "eager-pytorch": "#8c564b"}
MARKERS = {"ours-triton": "o", "ours-cuda": "D", "ours-torch": "o", "angle-emb": "s", "sentence-transformers": "^",
           "eager-pytorch": "v"}


def plotting_unavailable() -> str | None:
    """Why plot() cannot run here (matplotlib, an optional package, missing), or None: said before the sweep, so
    that a machine without it still gets its table and JSON and a notice rather than a traceback at the end."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def label_y_ticks(ax, formatter, no_labels) -> None:
    """Label a log axis's decades (1, 10, 100, ...) with `formatter`, and its other ticks (2, 3, ... 9 times a
    decade) too where its range holds no decade: a panel of one size, or of values within a factor of a few, had no
    value on its axis at all. `no_labels` (a NullFormatter) leaves the other ticks bare otherwise."""
    low, high = ax.get_ylim()  # the data's range, plotted already
    ax.yaxis.set_major_formatter(formatter)
    holds_a_decade = low > 0 and math.ceil(math.log10(low)) <= math.floor(math.log10(high))
    ax.yaxis.set_minor_formatter(no_labels if holds_a_decade else formatter)


def plot(results, args, losses, env, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    fig, axes = plt.subplots(2, len(losses), figsize=(4.2 * len(losses), 7.2), squeeze=False)
    series = sorted({(r["provider"], r["d"], r["dtype"]) for r in results},
                    key=lambda s: (list(COLORS).index(s[0]) if s[0] in COLORS else 99, s[1], s[2]))
    multi = len(args.d) > 1 or len(args.dtypes) > 1
    for col, loss in enumerate(losses):
        ax_time, ax_mem = axes[0][col], axes[1][col]
        skipped_notes = []
        for provider, d, dtype_name in series:
            rows = sorted((r for r in results if r["loss"] == loss.name and r["provider"] == provider
                           and r["d"] == d and r["dtype"] == dtype_name), key=lambda r: r["n"])
            ok = [r for r in rows if r["status"] == "ok"]
            label = provider + (f" D={d} {dtype_name}" if multi else "")
            style = dict(color=COLORS.get(provider), marker=MARKERS.get(provider, "o"), markersize=5, linewidth=1.6,
                         label=label)
            if ok:
                ax_time.plot([r["n"] for r in ok], [r["time_s"] * 1e3 for r in ok], **style)
                ax_mem.plot([r["n"] for r in ok], [max(r["extra_bytes"], 0.1 * MB) / MB for r in ok], **style)
            not_run = [r for r in rows if r["status"] != "ok"]
            if not_run:
                first = not_run[0]
                reason = "OOM" if first["status"] == "OOM" else first.get("note", first["status"]).split(" (")[0]
                skipped_notes.append(f"{provider}: N≥{first['n']:,} {reason.replace('skipped: ', 'skip, ')}")
        ax_time.set_title(loss.name, fontsize=12, fontweight="bold")
        sizes = sizes_of(args, loss)
        for ax, ylabel in ((ax_time, f"{args.stat} time, fwd+bwd (ms)"), (ax_mem, "peak extra memory (MB)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.xaxis.set_major_locator(FixedLocator(sizes))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: size_label(v)))
            ax.xaxis.set_minor_locator(NullLocator())
            label_y_ticks(ax, FuncFormatter(lambda v, _: f"{v:g}"), NullFormatter())
            ax.set_xlim(sizes[0] / 1.4, sizes[-1] * 1.4)
            ax.grid(True, which="major", alpha=0.35)
            ax.grid(True, which="minor", alpha=0.1)
            ax.set_xlabel(loss.size_label)
            if col == 0:
                ax.set_ylabel(ylabel)
        if skipped_notes:
            ax_mem.text(0.98, 0.03, "\n".join(skipped_notes), transform=ax_mem.transAxes, fontsize=7,
                        va="bottom", ha="right", color="#444444",
                        bbox=dict(boxstyle="round", facecolor="white", alpha=0.8, edgecolor="#cccccc"))
    handles = {}
    for ax in axes.flat:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    if handles:  # none where every case was skipped (a spent --time-budget): the panels say why, with no legend
        fig.legend(list(handles.values()), list(handles.keys()), loc="lower center", ncol=len(handles), frameon=False)
    device_name = env.get("gpu") or env.get("cpu")
    thread_text = f", {env['threads']} threads" if args.device == "cpu" else ""
    dims = ",".join(str(d) for d in args.d)
    title = (f"Forward + backward, D={dims}, {','.join(args.dtypes)}: {args.device.upper()} {device_name}"
             f"{thread_text}, torch {env['torch']}")
    # about 12 characters an inch at 11 points: a sweep of one or two losses has a figure too narrow for one line,
    # whose ends were cut off
    lines = textwrap.wrap(title, width=int(12 * fig.get_figwidth()))
    fig.suptitle("\n".join(lines), fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 0.96 - 0.03 * (len(lines) - 1)))
    # into a temporary file first, as the table and results.json are written: a kill mid-write leaves no half a png
    try:
        with harness.written_aside(path) as partial:
            fig.savefig(partial, dpi=110, format="png")
    finally:  # a figure left open holds its memory for the rest of the process
        plt.close(fig)


# --------------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------------


def main(argv, losses: dict, default_losses) -> int:
    """The sweep over the losses --losses names among `losses` (name -> LossBench; `default_losses` by default),
    with the rest of the command line `argv` (None: sys.argv[1:])."""
    args = parse_args(argv, losses, default_losses)
    # --time-budget counts from here: probing the providers, the agreement check and the limits use it too.
    deadline = None if args.time_budget is None else time.perf_counter() + args.time_budget
    now = datetime.datetime.now(datetime.timezone.utc)
    out = (Path(args.out) if args.out
           else unused_results_folder(harness.HERE / "results", f"{args.device}-{now:%Y-%m-%d}"))
    out.mkdir(parents=True, exist_ok=True)
    no_plot_why = None if args.no_plot else plotting_unavailable()
    if no_plot_why:
        print(f"# no plot.png: matplotlib is not available ({no_plot_why}); `pip install matplotlib` for it, or "
              "--no-plot to say so", flush=True)
        args.no_plot = True
    losses = [losses[name] for name in args.losses]

    if args.device == "cpu":
        # Import everything and build the provider objects here, computing nothing; then probe our backends,
        # check agreement and measure the limits in a child (see harness.call_in_fork).
        providers, missing = P.available_providers("cpu", losses, args.angle_emb_loss, include=args.providers,
                                                   probe=False)
        status = harness.call_in_fork(probe_check_and_limits_cpu, args, losses, providers, timeout=args.case_timeout)
        if status[0] != "ok":
            print(f"provider probe failed: {status[1:]}", file=sys.stderr)
            return 1
        working, missing_ours, checks, limits = status[1]
        providers = [p for p in providers if p.name in working]
        missing.update(missing_ours)
    else:
        # fp32 matmuls in true fp32 for every provider (TF32 only behind a flag)
        torch.backends.cuda.matmul.allow_tf32 = args.allow_tf32
        torch.backends.cudnn.allow_tf32 = args.allow_tf32
        providers, missing = P.available_providers("cuda", losses, args.angle_emb_loss, include=args.providers)
        checks = {}
        if not args.no_check:
            for loss in losses:
                checks[loss.name] = P.check_agreement(providers, loss, "cuda", dtype=torch.float32)
        limits = harness.measure_limits("cuda", args.dtypes)

    primary = P.primary_ours(providers, args.device)
    primary_name = primary.name if primary else (providers[0].name if providers else "?")
    env = harness.describe_environment(args.device)
    env["threads"] = args.threads if args.device == "cpu" else env["threads"]
    env["date"] = f"{now:%Y-%m-%d %H:%M}"
    env["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")
    env["command"] = " ".join(["python", "bench/bench_losses.py"] + (sys.argv[1:] if argv is None else list(argv)))
    env["angle_emb"] = angle_emb_version(providers)

    print(f"# {args.device}: {env.get('gpu') or env.get('cpu')}, torch {env['torch']}, threads {env['threads']}")
    print(f"# providers: {', '.join(p.name for p in providers)}; ratios against {primary_name}")
    print(f"# measured limits: {harness.describe_limits(limits)}")
    for name, why in missing.items():
        print(f"# not available: {name}: {why}")
    bad = []
    for loss, errs in checks.items():
        for name, err in errs.items():
            ok = err["value"] < 1e-5 and err["grad"] < 1e-4
            print(f"# check {loss:<11} {name:<22} vs {err['against']}: value {err['value']:.2e}, grad {err['grad']:.2e}"
                  + ("" if ok else "   <-- DISAGREES") + (f" ({err['error']})" if "error" in err else ""))
            if not ok:
                bad.append(f"{loss}/{name}")
    if bad:
        print(f"# WARNING: providers disagree on {', '.join(bad)}: their timings compare different computations")

    load_before = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    started = time.perf_counter()

    report = Report(out, env, args, losses, limits, checks, missing, [p.name for p in providers], primary_name)
    if args.warm_up_budget is not None:  # the rest of --time-budget, split (parse_args: CUDA, with --time-budget)
        # The agreement checks and the limits have taken their seconds: the warm-up gets its allowance out of what
        # is left, at most a share of it, so that the timed runs keep time (harness.warm_up_within)
        left = deadline - time.perf_counter()
        report.budget = harness.SweepBudget(left, harness.warm_up_within(args.warm_up_budget, left))
    if len(losses) > 1:  # size_schedule's order: the progress lines below alternate between the losses
        print("# progress: every loss at one size, then every loss at the next (a time budget cuts the largest sizes, "
              "not whole losses); the tables at the end group the results by loss", flush=True)
    results = sweep(args, losses, providers, limits, on_row=lambda rows: report.write(rows, complete=False),
                    deadline=deadline, budget=report.budget)
    elapsed = time.perf_counter() - started
    if load_before is not None:
        env["load_average_1min"] = {"start": round(load_before, 2), "end": round(os.getloadavg()[0], 2)}
    table = report.write(results, complete=True)
    if not args.no_plot:
        plot(results, args, losses, env, out / "plot.png")
    print()
    print(table)
    print(f"\nsweep took {elapsed:.0f} s; wrote {out / 'table.md'}, {out / 'results.json'}"
          + ("" if args.no_plot else f", {out / 'plot.png'}"))
    return 0


def unused_results_folder(parent: Path, name: str) -> Path:
    """parent/name, or the first of parent/name + b, c, ... that does not exist: the default output folder is dated,
    and a second sweep on the same day (or on the day of a committed run) must not rewrite the first one's files."""
    for suffix in ("", *"bcdefghijklmnopqrstuvwxyz"):
        if not (parent / f"{name}{suffix}").exists():
            return parent / f"{name}{suffix}"
    raise FileExistsError(f"{parent / name} and its 25 lettered successors exist: pass --out")


def angle_emb_version(providers) -> str | None:
    if not any(p.family == "reference" for p in providers):
        return None
    try:
        from importlib.metadata import version

        return version("angle-emb")
    except Exception:
        return "loss.py from " + next(p.notes.get("source", "?") for p in providers if p.family == "reference")
