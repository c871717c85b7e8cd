#!/usr/bin/env python
"""Benchmark our losses against the reference (angle-emb 0.6.1) and sentence-transformers, side by side.

For every loss (cosine, angle, ibn, contrastive), size N, embedding size D and dtype, each provider (see
providers.py) gets the same inputs and is measured for one forward + backward pass:

* time: the median of several runs after a warm-up run. CPU: wall clock (time.perf_counter) with the
  thread count stated; CUDA: triton.testing.do_bench's median (it flushes the L2 cache between runs), or
  CUDA events when Triton is missing.
* peak extra memory: CPU: each case runs in a freshly forked child of this (compute-free) process; its
  peak RSS (VmHWM, reset through /proc/self/clear_refs once the inputs exist) minus the RSS right before
  the pass. CUDA: max_memory_allocated() minus memory_allocated() before the pass (inputs included in
  the latter), taken on a pass after a warm-up pass: the first call at a shape JIT-compiles and autotunes,
  and Triton's autotuner benchmarks with do_bench, whose 256 MB L2-flush buffer is not the loss's memory.
  Gradients of the inputs count as extra memory for every provider alike.
* on CUDA, the achieved bandwidth (cosine/angle: bytes that must move) or FLOP rate (ibn/contrastive:
  matmul FLOPs) as a fraction of the limits measured at the start of the run (device copy, matmul).

Sizes a provider cannot fit are skipped with a marker instead of being run: the eager baselines' N^2
memory is estimated first and compared with --max-ref-gb, and nothing runs that is estimated above 80 % of
the memory available. A size whose predicted run time (from the previous size) exceeds --max-run-seconds
is skipped too, and so is every case once --time-budget is spent. Out-of-memory errors become an "OOM"
marker.

Writes results.json and table.md to --out after every case (a run killed from outside keeps what it
measured), plot.png (time and memory vs N, log-log, one column per loss) at the end, and prints the table.
The same command runs unchanged on a CUDA machine (--device auto picks CUDA).

    python bench/bench_losses.py                       # defaults: about 2 minutes on a 2-core CPU
    python bench/bench_losses.py --losses cosine,angle --n 16384 --max-ref-gb 8
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import multiprocessing
import os
import re
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

# GNU OpenMP's threads spin while they wait for each other. On a machine shared with other jobs that turns
# every parallel op into a wait for a descheduled thread: one cosine fwd+bwd (N=1024, D=256, 2 threads)
# took 200 ms instead of 15 ms here. Passive waiting costs a few microseconds per op on an idle machine.
# Set before torch loads OpenMP; an explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

try:  # the installed package; else the checkout this script lives in
    import angle_kernels  # noqa: F401
except ImportError:
    sys.path.append(str(HERE.parent))

import providers as P  # noqa: E402

MB = 1e6
GB = 1e9


# --------------------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------------------


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.replace("_", "").split(",") if x]


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--losses", default=",".join(P.LOSSES), help="comma-separated subset of " + ",".join(P.LOSSES))
    parser.add_argument("--n", type=int_list, default=[256, 1024, 4096, 16384],
                        help="pair counts N for cosine and angle (their cost grows as N)")
    parser.add_argument("--n-quadratic", type=int_list, default=[256, 512, 1024],
                        help="pair/query counts N for ibn and contrastive (their cost grows as N^2 D)")
    parser.add_argument("--d", type=int_list, default=[768], help="embedding sizes D")
    parser.add_argument("--dtypes", default="float32", help="comma-separated: " + ",".join(P.DTYPES))
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    parser.add_argument("--providers", default="ours,reference,sentence-transformers",
                        help="families to include: ours (or some of our backends: ours-triton, ours-cuda, "
                             "ours-torch), reference, sentence-transformers")
    parser.add_argument("--angle-emb-loss", default=None,
                        help="angle-emb's loss.py or an angle-emb wheel (default: the installed package's loss.py)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="CPU threads (torch.set_num_threads)")
    parser.add_argument("--repeats", type=int, default=5, help="CPU: timed runs per case after the warm-up (at most)")
    parser.add_argument("--time-per-case", type=float, default=3.0,
                        help="CPU: stop timing a case after this many seconds once 3 runs are done")
    parser.add_argument("--max-run-seconds", type=float, default=10.0,
                        help="skip a size whose predicted single run (extrapolated from the previous size) is longer")
    parser.add_argument("--max-ref-gb", type=float, default=2.0,
                        help="skip a baseline (angle-emb, sentence-transformers) at sizes whose estimated extra memory exceeds this")
    parser.add_argument("--case-timeout", type=float, default=600.0, help="CPU: kill a case's child process after this many seconds")
    parser.add_argument("--time-budget", type=float, default=None,
                        help="seconds for the whole sweep: once spent (or when a case's predicted run would overrun "
                             "it), the remaining cases are recorded as skipped")
    parser.add_argument("--stat", default="median", choices=("median", "min"),
                        help="which time the table, ratios and plot show (both are in results.json); "
                             "min is steadier on a machine shared with other jobs")
    parser.add_argument("--allow-tf32", action="store_true", help="CUDA: let float32 matmuls use TF32 (all providers)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-check", action="store_true", help="skip the agreement check of all providers before the sweep")
    parser.add_argument("--no-plot", action="store_true")
    parser.add_argument("--out", default=None, help="output folder (default bench/results/<device>-<date>)")
    args = parser.parse_args(argv)
    args.losses = [x for x in args.losses.split(",") if x]
    for loss in args.losses:
        if loss not in P.LOSSES:
            parser.error(f"--losses: unknown loss {loss!r}; choose from {', '.join(P.LOSSES)}")
    args.dtypes = [x for x in args.dtypes.split(",") if x]
    for name in args.dtypes:
        if name not in P.DTYPES:
            parser.error(f"--dtypes: unknown dtype {name!r}; choose from {', '.join(P.DTYPES)}")
    args.providers = [x for x in args.providers.split(",") if x]
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: CUDA is not available here")
    return args


# --------------------------------------------------------------------------------------------------------
# CPU measurement: one forked child per case
# --------------------------------------------------------------------------------------------------------
# Why fork: a fresh process per size gives a clean heap and an honest peak RSS, and forking this parent
# (which has imported torch, angle_kernels, sentence-transformers and the reference once) saves about 10 s
# of imports per case. The parent never computes with torch: GNU OpenMP deadlocks in a forked child once
# the parent has run a parallel region, so everything that computes (probes, checks, cases) runs in a child.


def _proc_status_kb(field: str) -> int | None:
    try:
        match = re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def _reset_peak_rss() -> bool:
    """Make VmHWM (peak RSS) equal the current RSS (Linux >= 4.0). False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _peak_rss_bytes() -> int:
    hwm = _proc_status_kb("VmHWM")
    if hwm is not None:
        return hwm * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def _is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc)
    return "can't allocate memory" in text or "out of memory" in text.lower() or "DefaultCPUAllocator" in text


def _child_entry(writer, fn, args):
    try:
        payload = ("ok", fn(*args))
    except BaseException as exc:  # report everything, including MemoryError, to the parent
        kind = "oom" if _is_oom(exc) else "error"
        payload = (kind, f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=6))
    writer.send(payload)
    writer.close()


def call_in_fork(fn, *args, timeout: float = 600.0):
    """Run fn(*args) in a forked child; return ("ok", result) | ("oom"|"error", message, tb) | ("killed"|"timeout", msg)."""
    ctx = multiprocessing.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_entry, args=(writer, fn, args), daemon=True)
    proc.start()
    writer.close()
    payload = None
    if reader.poll(timeout):
        try:
            payload = reader.recv()
        except EOFError:
            payload = None
    proc.join(10)
    if proc.is_alive():  # only our own child, by its handle
        proc.kill()
        proc.join()
        if payload is None:
            return ("timeout", f"killed after {timeout:.0f} s (--case-timeout)")
    if payload is None:
        code = proc.exitcode
        if code is not None and code < 0 and -code == 9:
            return ("killed", "killed by SIGKILL (most likely the kernel's out-of-memory killer)")
        return ("killed", f"child exited with code {code} without a result")
    return payload


def _fwd_bwd(fn, leaves):
    for leaf in leaves:
        leaf.grad = None
    loss = fn()
    loss.backward()
    return loss


def _address_space_guard(headroom_bytes: int) -> None:
    """Cap this child's address space at its current size plus `headroom_bytes`.

    An allocation beyond it raises (reported as OOM) instead of waking the kernel's OOM killer on a
    machine shared with other jobs.
    """
    import resource

    vm = _proc_status_kb("VmSize")
    if vm is None:
        return
    limit = vm * 1024 + int(headroom_bytes)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def measure_cpu_case(provider, loss, n, d, dtype, threads, repeats, time_per_case, seed, headroom_bytes):
    """Runs in the forked child: warm up, build inputs, measure peak extra RSS and the median time."""
    torch.set_num_threads(threads)
    # Warm-up at a tiny size first, so one-time costs (lazy imports, thread pools) stay out of the numbers.
    tiny = P.build_inputs(loss, 8, min(d, 64), dtype, "cpu", seed + 1)
    _fwd_bwd(provider.make(loss, tiny), P.grad_leaves(tiny))
    del tiny

    inputs = P.build_inputs(loss, n, d, dtype, "cpu", seed)
    leaves = P.grad_leaves(inputs)
    fn = provider.make(loss, inputs)
    gc.collect()
    _address_space_guard(headroom_bytes)

    exact_peak = _reset_peak_rss()
    rss_before = (_proc_status_kb("VmRSS") or 0) * 1024 if exact_peak else _peak_rss_bytes()
    start = time.perf_counter()
    value = _fwd_bwd(fn, leaves)  # the first pass measures memory and is the warm-up of the timing
    first_run = time.perf_counter() - start
    extra = _peak_rss_bytes() - rss_before

    times = []
    budget_start = time.perf_counter()
    while len(times) < repeats:
        start = time.perf_counter()
        _fwd_bwd(fn, leaves)
        times.append(time.perf_counter() - start)
        if len(times) >= 3 and time.perf_counter() - budget_start > time_per_case:
            break
    if not times:  # --repeats 0: the warm-up is all there is
        times = [first_run]
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "times_s": times,
        "first_run_s": first_run,
        "extra_bytes": int(extra),
        "input_bytes": P.input_bytes(inputs),
        "peak_method": "VmHWM reset by clear_refs" if exact_peak else "ru_maxrss after inputs",
        "threads": torch.get_num_threads(),
        "loss_value": float(value.detach()),
    }


def probe_and_check_cpu(args, providers):
    """In a child: which of our backends work, and do all providers agree on a small input?"""
    torch.set_num_threads(args.threads)
    usable, missing = P.ours_backends("cpu", probe=True)
    working = [p for p in providers if p.family != "ours" or p.name[len("ours-"):] in usable]
    missing = {f"ours-{name}": why for name, why in missing.items()}
    checks = {}
    if not args.no_check:
        for loss in args.losses:
            checks[loss] = P.check_agreement(working, loss, "cpu", dtype=torch.float64)
    return [p.name for p in working], missing, checks


# --------------------------------------------------------------------------------------------------------
# CUDA measurement: in process
# --------------------------------------------------------------------------------------------------------


# A run at least this long is timed with a few CUDA-event runs instead of do_bench, which spends about 5 + 25/t
# + 100/t runs on estimating, warming and timing: dozens of seconds for the largest cases. At this length the
# L2 cache (50 MB) holds a negligible share of the bytes a run moves, so flushing it changes nothing.
SLOW_RUN_MS = 200.0
SLOW_RUN_REPEATS = 3


def _cuda_times_ms(run, grad_to_none=None, expected_ms: float | None = None) -> tuple[float, float, str]:
    """(median, min) time of run() in ms, warm-up excluded: triton's do_bench (which flushes the L2 cache
    before every run), else CUDA events around each run after a 256 MB write that evicts the L2. A run known
    to take at least SLOW_RUN_MS (expected_ms, from a warm-up) gets SLOW_RUN_REPEATS event-timed runs."""
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    slow = expected_ms is not None and expected_ms >= SLOW_RUN_MS
    if do_bench is not None and not slow:
        median, fastest = do_bench(run, grad_to_none=grad_to_none, quantiles=[0.5, 0.0])
        return float(median), float(fastest), "triton.testing.do_bench"
    flush = torch.empty(64 * 2**20, dtype=torch.int32, device="cuda")
    if not slow:
        run()
    times = []
    for _ in range(SLOW_RUN_REPEATS if slow else 20):
        flush.zero_()
        if grad_to_none:
            for t in grad_to_none:
                t.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    method = f"CUDA events, {len(times)} runs of >= {SLOW_RUN_MS:g} ms" if slow else "CUDA events (L2 flushed)"
    return statistics.median(times), min(times), method


# A measured CUDA case costs about a dozen runs (warm-up, memory run, do_bench's timing) plus one-time compiles:
# what a budget must expect of it, given the time of one run.
RUNS_PER_CASE = 12


def limit_rate(limits: dict, floor_kind: str, dtype_name: str) -> float | None:
    """The hardware limit a rate is a fraction of, measured in this run (measure_cuda_limits): the device copy
    bandwidth in B/s for a bytes floor, the matmul rate of the dtype in FLOP/s for a FLOPs floor; None when it
    was not measured (CPU, or a dtype without a measured matmul rate)."""
    if not limits:
        return None
    if floor_kind == "bytes":
        return limits["copy_GBps"] * GB
    return limits.get(f"matmul_{dtype_name}_TFLOPs", 0) * 1e12 or None


def warm_peak_extra_bytes(run, leaves, memory=None) -> tuple[object, int, float]:
    """(value, peak extra bytes, seconds of the measured run) of run() (forward + backward): one warm-up run,
    then the peak allocated memory of one more run above what was allocated before it.

    The warm-up absorbs the one-time costs of a new shape: JIT compiles and Triton's autotuning, which
    benchmarks with do_bench and its 256 MB L2-flush buffer; measured on the first call, those would count as
    the loss's memory. `memory` is torch.cuda (or a stand-in with the same four functions, for tests)."""
    memory = torch.cuda if memory is None else memory
    _fwd_bwd(run, leaves)
    memory.synchronize()
    for leaf in leaves:
        leaf.grad = None
    memory.reset_peak_memory_stats()
    before = memory.memory_allocated()
    started = time.perf_counter()
    value = _fwd_bwd(run, leaves)
    memory.synchronize()
    return value, int(memory.max_memory_allocated() - before), time.perf_counter() - started


def measure_cuda_case(provider, loss, n, d, dtype, seed):
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    inputs = P.build_inputs(loss, n, d, dtype, "cuda", seed)
    leaves = P.grad_leaves(inputs)
    fn = provider.make(loss, inputs)
    value, extra, run_s = warm_peak_extra_bytes(fn, leaves)
    median_ms, min_ms, method = _cuda_times_ms(lambda: _fwd_bwd(fn, leaves), grad_to_none=leaves,
                                               expected_ms=1e3 * run_s)
    return {
        "median_s": median_ms / 1e3,
        "min_s": min_ms / 1e3,
        "timing": method,
        "extra_bytes": extra,
        "loss_value": float(value.detach()),
    }


def measure_cuda_limits(dtypes) -> dict:
    """The device's copy bandwidth and matmul rates, measured now: the denominators of the achieved rates."""
    def copy_rate() -> float:
        src = torch.empty(2**28, dtype=torch.float32, device="cuda").normal_()  # 1 GiB, far larger than L2
        dst = torch.empty_like(src)
        median_ms, _, _ = _cuda_times_ms(lambda: dst.copy_(src))
        return 2 * src.numel() * 4 / (median_ms / 1e3) / GB  # read once + write once

    def matmul_rate(dtype: torch.dtype) -> float:
        size = 4096 if dtype == torch.float64 else 8192
        a = torch.randn(size, size, device="cuda").to(dtype)
        b = torch.randn(size, size, device="cuda").to(dtype)
        median_ms, _, _ = _cuda_times_ms(lambda: a @ b)
        return 2 * size**3 / (median_ms / 1e3) / 1e12

    limits = {"copy_GBps": copy_rate()}
    for name in dtypes:
        limits[f"matmul_{name}_TFLOPs"] = matmul_rate(P.DTYPES[name])
    limits["tf32_matmul_allowed"] = bool(torch.backends.cuda.matmul.allow_tf32)
    torch.cuda.empty_cache()
    return limits


# --------------------------------------------------------------------------------------------------------
# The sweep
# --------------------------------------------------------------------------------------------------------


def fmt_bytes(b: float) -> str:
    return f"{b / GB:.1f} GB" if b >= GB else f"{b / MB:.0f} MB" if b >= 10 * MB else f"{b / MB:.1f} MB"


def predicted_run_seconds(previous, loss, family, n) -> float | None:
    """Extrapolate a run time from the previous measured size: N^2 work for the quadratic losses and for
    the reference's cosine/angle (its N x N matrices), N otherwise."""
    if previous is None or previous[1] < 0.05:  # below 50 ms, overheads and noise dominate: no forecast
        return None
    prev_n, prev_s = previous
    power = 2 if (loss in P.QUADRATIC_LOSSES or family == "reference") else 1
    return prev_s * (n / prev_n) ** power


def mem_available_bytes() -> int | None:
    try:
        match = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
        return int(match.group(1)) * 1024 if match else None
    except OSError:
        return None


def sweep(args, providers, limits, on_row=None, deadline=None) -> list[dict]:
    """Every case, size by size with all providers of a size run back to back (so that a change in the
    machine's load between sizes hits every provider alike). on_row(results) runs after every case; no case
    starts past `deadline` (time.perf_counter()), or when its forecast would overrun it."""
    results = []
    for loss in args.losses:
        sizes = args.n if loss not in P.QUADRATIC_LOSSES else args.n_quadratic
        for dtype_name in args.dtypes:
            dtype = P.DTYPES[dtype_name]
            for d in args.d:
                previous = {}  # provider name -> (n, median seconds) of its last measured size
                for n in sorted(sizes):
                    for provider in providers:
                        if not provider.provides(loss):
                            continue
                        row = {"loss": loss, "n": n, "d": d, "dtype": dtype_name, "provider": provider.name,
                               "family": provider.family, "calls": provider.calls[loss]}
                        row.update(run_one(args, provider, loss, n, d, dtype, previous.get(provider.name), limits,
                                           deadline))
                        if row["status"] == "ok":
                            previous[provider.name] = (n, row["min_s"])  # the least noisy forecast
                        results.append(row)
                        print(progress_line(row), flush=True)
                        if on_row is not None:
                            on_row(results)
    return results


def run_one(args, provider, loss, n, d, dtype, previous, limits, deadline=None) -> dict:
    estimate = P.estimate_extra_bytes(provider, loss, n, d, dtype)
    out = {"estimate_bytes": estimate, "floor": P.work_floor(loss, n, d, dtype)}
    if deadline is not None:
        left = deadline - time.perf_counter()
        forecast = predicted_run_seconds(previous, loss, provider.family, n)
        if left <= 0 or (forecast is not None and RUNS_PER_CASE * forecast > left):
            return {**out, "status": "skipped", "note": f"skipped: --time-budget {args.time_budget:g} s spent"}
    if provider.family != "ours" and estimate > args.max_ref_gb * GB:
        return {**out, "status": "skipped", "note": f"skipped: needs ~{fmt_bytes(estimate)} (> --max-ref-gb {args.max_ref_gb:g})"}
    available = (torch.cuda.mem_get_info()[0] if args.device == "cuda" else mem_available_bytes())
    if available is not None and estimate > 0.8 * available:
        return {**out, "status": "skipped", "note": f"skipped: needs ~{fmt_bytes(estimate)}, {fmt_bytes(available)} free"}
    predicted = predicted_run_seconds(previous, loss, provider.family, n)
    if predicted is not None and predicted > args.max_run_seconds:
        return {**out, "status": "skipped", "note": f"skipped: ~{predicted:.0f} s per run (> --max-run-seconds {args.max_run_seconds:g})"}

    if args.device == "cpu":
        headroom = max(3 * estimate, 2 * GB)
        if available is not None:
            headroom = min(headroom, int(0.8 * available))
        payload = call_in_fork(measure_cpu_case, provider, loss, n, d, dtype, args.threads, args.repeats,
                               args.time_per_case, args.seed, headroom, timeout=args.case_timeout)
    else:
        try:
            payload = ("ok", measure_cuda_case(provider, loss, n, d, dtype, args.seed))
        except Exception as exc:
            payload = ("oom" if _is_oom(exc) else "error", f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=6))
        if payload[0] != "ok":  # outside the except block: the traceback no longer pins the case's tensors
            gc.collect()
            torch.cuda.empty_cache()

    if payload[0] == "ok":
        measured = payload[1]
        row = {**out, "status": "ok", **measured}
        row["time_s"] = measured[f"{args.stat}_s"]  # what the table, ratios and plot show
        floor = out["floor"]
        rate = floor["amount"] / row["time_s"]
        row["rate"] = rate
        row["rate_unit"] = "B/s" if floor["kind"] == "bytes" else "FLOP/s"
        # This row has no "dtype" key (the sweep adds it later): name the dtype from the argument.
        peak = limit_rate(limits, floor["kind"], str(dtype).removeprefix("torch."))
        row["rate_fraction"] = rate / peak if peak else None
        return row
    if payload[0] in ("oom", "killed"):
        return {**out, "status": "OOM", "note": f"OOM: {payload[1]}"}
    return {**out, "status": "error", "note": payload[1], "traceback": payload[2] if len(payload) > 2 else None}


def progress_line(row) -> str:
    head = f"  {row['loss']:<11} N={row['n']:<7} D={row['d']:<5} {row['dtype']:<8} {row['provider']:<22}"
    if row["status"] == "ok":
        return head + (f" {row['median_s'] * 1e3:10.2f} ms (min {row['min_s'] * 1e3:.2f})"
                       f"  +{fmt_bytes(row['extra_bytes'])}")
    return head + f" {row.get('note', row['status'])}"


# --------------------------------------------------------------------------------------------------------
# Reporting
# --------------------------------------------------------------------------------------------------------


def fmt_ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.3g} ms" if ms < 1000 else f"{seconds:.3g} s"


def fmt_rate(row) -> str:
    if row.get("status") != "ok":
        return ""
    if row["rate_unit"] == "B/s":
        text = f"{row['rate'] / GB:.3g} GB/s"
    else:
        text = f"{row['rate'] / 1e9:.3g} GFLOP/s" if row["rate"] < 1e12 else f"{row['rate'] / 1e12:.3g} TFLOP/s"
    if row.get("rate_fraction"):
        text += f" ({100 * row['rate_fraction']:.0f} %)"
    return text


def cell(row) -> str:
    if row is None:
        return "n/a"
    if row["status"] != "ok":
        return row.get("note", row["status"]).replace("|", "/")
    return f"{fmt_ms(row['time_s'])}, +{fmt_bytes(max(row['extra_bytes'], 0))}"


def ratio_cell(base, ours) -> str:
    """'time x, memory y': baseline / ours; > 1 means ours is faster / needs less."""
    if base is None or ours is None or base["status"] != "ok" or ours["status"] != "ok":
        return "—"
    time_ratio = base["time_s"] / ours["time_s"]
    # RSS moves in pages and reuses freed memory: below 1 MB a ratio of memory says nothing.
    if ours["extra_bytes"] >= MB and base["extra_bytes"] >= MB:
        mem = f"{base['extra_bytes'] / ours['extra_bytes']:.3g}x"
    else:
        mem = "—"
    return f"{time_ratio:.3g}x, {mem}"


def render_markdown(results, env, args, limits, checks, missing, provider_names, primary) -> str:
    lines = []
    device_name = env.get("gpu") or env.get("cpu")
    lines.append(f"# Loss benchmark: forward + backward, {args.device.upper()} ({device_name})")
    lines.append("")
    lines.append(f"- date (UTC): {env['date']}; command: `{env['command']}`")
    thread_text = (f"{env['threads']} threads of {env.get('logical_cpus')} logical CPUs, OMP_WAIT_POLICY={env.get('omp_wait_policy')}"
                   if args.device == "cpu" else "")
    lines.append(f"- torch {env['torch']}, triton {env.get('triton')}, sentence-transformers {env.get('sentence_transformers')}, "
                 f"angle-emb {env.get('angle_emb')}, angle_kernels {env.get('angle_kernels')}" + (f"; {thread_text}" if thread_text else ""))
    if args.device == "cuda":
        lines.append(f"- GPU {env.get('gpu')}, driver {env.get('driver')}, CUDA {env.get('cuda')}; measured limits: "
                     + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in limits.items()))
    runs = (f"up to {args.repeats} runs after a warm-up run (wall clock)" if args.device == "cpu"
            else "triton.testing.do_bench's runs (warm-up excluded, L2 flushed), or "
                 f"{SLOW_RUN_REPEATS} CUDA-event runs for a case whose run takes {SLOW_RUN_MS:g} ms or more")
    load = env.get("load_average_1min")
    if load and args.device == "cpu":
        busy = max(load.values()) > (env.get("logical_cpus") or 1)
        lines.append(f"- load average (1 min) at start / end of the sweep: {load['start']} / {load['end']}"
                     + (" — more runnable tasks than CPUs: other jobs shared the machine, so times are noisy "
                        "(memory numbers are not affected)" if busy else ""))
    lines.append(f"- time: {args.stat} of {runs}; "
                 "memory: peak extra over the inputs "
                 f"({'peak RSS of a fresh forked process' if args.device == 'cpu' else 'max_memory_allocated'}), gradients included")
    lines.append(f"- cells: `time, +extra memory`; ratio columns: `baseline time / {primary} time, baseline memory / {primary} memory` "
                 "(above 1: ours is faster / smaller)")
    if missing:
        lines.append("- not available here: " + "; ".join(f"{k} ({v})" for k, v in missing.items()))
    if checks:
        worst = []
        for loss, errs in checks.items():
            for name, err in errs.items():
                worst.append(f"{loss}/{name} vs {err['against']}: value {err['value']:.1e}, grad {err['grad']:.1e}")
        lines.append("- agreement check (N=24, D=32, " + ("float64" if args.device == "cpu" else "float32") + "): " + "; ".join(worst))
    lines.append("")

    index = {(r["loss"], r["n"], r["d"], r["dtype"], r["provider"]): r for r in results}
    for loss in args.losses:
        sizes = sorted(args.n if loss not in P.QUADRATIC_LOSSES else args.n_quadratic)
        names = [name for name in provider_names if any(k[0] == loss and k[4] == name for k in index)]
        baselines = [name for name in names if name != primary]
        for dtype_name in args.dtypes:
            for d in args.d:
                lines.append(f"## {loss} (D={d}, {dtype_name})")
                lines.append("")
                header = ["N"] + names + [f"{name} ÷ {primary}" for name in baselines if primary in names]
                header.append(f"{primary} achieved")
                lines.append("| " + " | ".join(header) + " |")
                lines.append("|" + "---|" * len(header))
                for n in sizes:
                    rows = {name: index.get((loss, n, d, dtype_name, name)) for name in names}
                    ours = rows.get(primary)
                    cells = [f"{n:,}"] + [cell(rows[name]) for name in names]
                    if primary in names:
                        cells += [ratio_cell(rows[name], ours) for name in baselines]
                    cells.append(fmt_rate(ours) if ours else "")
                    lines.append("| " + " | ".join(cells) + " |")
                lines.append("")
    return "\n".join(lines)


def size_label(n: float) -> str:
    n = int(round(n))
    if n >= 2**20 and n % 2**20 == 0:
        return f"{n // 2**20}M"
    if n >= 2**10 and n % 2**10 == 0:
        return f"{n // 2**10}k"
    return str(n)


COLORS = {"ours-triton": "#d62728", "ours-cuda": "#9467bd", "ours-torch": "#1f77b4",
          "angle-emb": "#ff7f0e", "sentence-transformers": "#2ca02c"}
MARKERS = {"ours-triton": "o", "ours-cuda": "D", "ours-torch": "o", "angle-emb": "s", "sentence-transformers": "^"}


def plot(results, args, env, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    losses = args.losses
    fig, axes = plt.subplots(2, len(losses), figsize=(4.2 * len(losses), 7.2), squeeze=False)
    series = sorted({(r["provider"], r["d"], r["dtype"]) for r in results},
                    key=lambda s: (list(COLORS).index(s[0]) if s[0] in COLORS else 99, s[1], s[2]))
    multi = len(args.d) > 1 or len(args.dtypes) > 1
    for col, loss in enumerate(losses):
        ax_time, ax_mem = axes[0][col], axes[1][col]
        skipped_notes = []
        for provider, d, dtype_name in series:
            rows = sorted((r for r in results if r["loss"] == loss and r["provider"] == provider
                           and r["d"] == d and r["dtype"] == dtype_name), key=lambda r: r["n"])
            ok = [r for r in rows if r["status"] == "ok"]
            label = provider + (f" D={d} {dtype_name}" if multi else "")
            style = dict(color=COLORS.get(provider), marker=MARKERS.get(provider, "o"), markersize=5, linewidth=1.6, label=label)
            if ok:
                ax_time.plot([r["n"] for r in ok], [r["time_s"] * 1e3 for r in ok], **style)
                ax_mem.plot([r["n"] for r in ok], [max(r["extra_bytes"], 0.1 * MB) / MB for r in ok], **style)
            not_run = [r for r in rows if r["status"] != "ok"]
            if not_run:
                first = not_run[0]
                reason = "OOM" if first["status"] == "OOM" else first.get("note", first["status"]).split(" (")[0]
                skipped_notes.append(f"{provider}: N≥{first['n']:,} {reason.replace('skipped: ', 'skip, ')}")
        ax_time.set_title(loss, fontsize=12, fontweight="bold")
        sizes = sorted(args.n if loss not in P.QUADRATIC_LOSSES else args.n_quadratic)
        for ax, ylabel in ((ax_time, f"{args.stat} time, fwd+bwd (ms)"), (ax_mem, "peak extra memory (MB)")):
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.xaxis.set_major_locator(FixedLocator(sizes))
            ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: size_label(v)))
            ax.xaxis.set_minor_locator(NullLocator())
            ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.set_xlim(sizes[0] / 1.4, sizes[-1] * 1.4)
            ax.grid(True, which="major", alpha=0.35)
            ax.grid(True, which="minor", alpha=0.1)
            ax.set_xlabel("N (pairs)" if loss != "contrastive" else "N (queries, 2N candidates)")
            if col == 0:
                ax.set_ylabel(ylabel)
        if skipped_notes:
            ax_mem.text(0.98, 0.03, "\n".join(skipped_notes), transform=ax_mem.transAxes, fontsize=7,
                        va="bottom", ha="right", color="#444444",
                        bbox=dict(boxstyle="round", facecolor="white", alpha=0.8, edgecolor="#cccccc"))
    handles = {}
    for ax in axes.flat:
        for h, l in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(l, h)
    fig.legend(list(handles.values()), list(handles.keys()), loc="lower center", ncol=len(handles), frameon=False)
    device_name = env.get("gpu") or env.get("cpu")
    thread_text = f", {env['threads']} threads" if args.device == "cpu" else ""
    dims = ",".join(str(d) for d in args.d)
    fig.suptitle(f"Forward + backward, D={dims}, {','.join(args.dtypes)}: {args.device.upper()} {device_name}{thread_text}, "
                 f"torch {env['torch']}", fontsize=11)
    fig.tight_layout(rect=(0, 0.05, 1, 0.96))
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    args = parse_args(argv)
    # --time-budget counts from here: probing the providers, the agreement check and the limits use it too.
    deadline = None if args.time_budget is None else time.perf_counter() + args.time_budget
    now = datetime.datetime.now(datetime.timezone.utc)
    out = Path(args.out) if args.out else HERE / "results" / f"{args.device}-{now:%Y-%m-%d}"
    out.mkdir(parents=True, exist_ok=True)

    if args.device == "cpu":
        # Import everything and build the provider objects here, computing nothing; then probe our
        # backends and check agreement in a child (see the note above call_in_fork).
        providers, missing = P.available_providers("cpu", args.angle_emb_loss, include=args.providers, probe=False)
        status = call_in_fork(probe_and_check_cpu, args, providers, timeout=args.case_timeout)
        if status[0] != "ok":
            print(f"provider probe failed: {status[1:]}", file=sys.stderr)
            return 1
        working, missing_ours, checks = status[1]
        providers = [p for p in providers if p.name in working]
        missing.update(missing_ours)
        limits = {}
    else:
        # fp32 matmuls in true fp32 for every provider (the project guide shared/docs/measuring.md: TF32 only behind a flag)
        torch.backends.cuda.matmul.allow_tf32 = args.allow_tf32
        torch.backends.cudnn.allow_tf32 = args.allow_tf32
        providers, missing = P.available_providers("cuda", args.angle_emb_loss, include=args.providers)
        checks = {}
        if not args.no_check:
            for loss in args.losses:
                checks[loss] = P.check_agreement(providers, loss, "cuda", dtype=torch.float32)
        limits = measure_cuda_limits(args.dtypes)

    primary = P.primary_ours(providers)
    primary_name = primary.name if primary else (providers[0].name if providers else "?")
    env = P.describe_environment(args.device)
    env["threads"] = args.threads if args.device == "cpu" else env["threads"]
    env["date"] = f"{now:%Y-%m-%d %H:%M}"
    env["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY")
    env["command"] = " ".join(["python", "bench/bench_losses.py"] + (sys.argv[1:] if argv is None else list(argv)))
    env["angle_emb"] = angle_emb_version(providers)

    print(f"# {args.device}: {env.get('gpu') or env.get('cpu')}, torch {env['torch']}, threads {env['threads']}")
    print(f"# providers: {', '.join(p.name for p in providers)}; ratios against {primary_name}")
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

    report = Report(out, env, args, limits, checks, missing, [p.name for p in providers], primary_name)
    results = sweep(args, providers, limits, on_row=lambda rows: report.write(rows, complete=False), deadline=deadline)
    elapsed = time.perf_counter() - started
    if load_before is not None:
        env["load_average_1min"] = {"start": round(load_before, 2), "end": round(os.getloadavg()[0], 2)}
    table = report.write(results, complete=True)
    if not args.no_plot:
        plot(results, args, env, out / "plot.png")
    print()
    print(table)
    print(f"\nsweep took {elapsed:.0f} s; wrote {out / 'table.md'}, {out / 'results.json'}"
          + ("" if args.no_plot else f", {out / 'plot.png'}"))
    return 0


class Report:
    """table.md and results.json in the output folder, rewritten as the sweep goes (a killed run keeps them)."""

    def __init__(self, out: Path, env, args, limits, checks, missing, provider_names, primary):
        self.out, self.env, self.args, self.limits = out, env, args, limits
        self.checks, self.missing, self.provider_names, self.primary = checks, missing, provider_names, primary
        self.started = time.perf_counter()

    def write(self, results: list[dict], complete: bool) -> str:
        table = render_markdown(results, self.env, self.args, self.limits, self.checks, self.missing,
                                self.provider_names, self.primary)
        payload = {"environment": self.env, "args": dict(vars(self.args)), "hardware_limits": self.limits,
                   "agreement_checks": self.checks, "not_available": self.missing, "ratios_against": self.primary,
                   "complete": complete, "sweep_seconds": time.perf_counter() - self.started, "results": results}
        write_text_atomic(self.out / "table.md", table + "\n")
        write_text_atomic(self.out / "results.json", json.dumps(payload, indent=1, default=str) + "\n")
        return table


def write_text_atomic(path: Path, text: str) -> None:
    """Replace path's contents in one step: a reader (or a kill) never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def angle_emb_version(providers) -> str | None:
    if not any(p.family == "reference" for p in providers):
        return None
    try:
        from importlib.metadata import version

        return version("angle-emb")
    except Exception:
        return "loss.py from " + next(p.notes.get("source", "?") for p in providers if p.family == "reference")


if __name__ == "__main__":
    sys.exit(main())
