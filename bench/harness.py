"""The measuring machinery every benchmark in bench/ shares, written once: the CPU loss sweep (bench_losses.py)
and every stage of the GPU run (gpu_suite.py) time, measure memory, count work and write reports with it.

* running a case: `fwd_bwd` (forward + backward, gradients reset), `measure_fwd_bwd` (memory, then time)
* timing: CPU wall clock (`time_cpu`) and CUDA (`time_cuda`: triton.testing.do_bench, or CUDA events for a
  slow case), chosen by device in `time_run`
* memory: CPU peak RSS (VmHWM, reset through /proc/self/clear_refs) with an address-space cap; CUDA peak
  allocated memory of a warm run (`cuda_warm_peak_extra_bytes`)
* hardware limits: copy bandwidth and matmul rates, measured now on the device at hand (`measure_limits`)
* work floors: the bytes or FLOPs each op must move (`pair_scores_floor`, `ranking_floor`,
  `similarity_floor`), what a time is turned into a rate against
* what a benchmark is: `LossBench` (a loss and who provides it), `OpBench` (an op on every backend)
* reports: atomic writes, markdown tables, number formats; `describe_environment`; `call_in_fork`

The error measure is `rel_err` of angle_kernels.testing.oracle, whose float64 formulas are also the reference of the
large checks and, run in another dtype (`oracle.computing_in`), the eager baseline.

The benchmarks measure the angle_kernels that Python imports: the checkout, installed in editable mode
(scripts/setup.sh), or put on PYTHONPATH (scripts/gpu_check.sh does, on the GPU machine where nothing is installed).
A script here is run as `python bench/NAME.py`, which puts bench/ on the path for `import harness`.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import gc
import importlib
import importlib.util
import json
import multiprocessing
import os
import re
import statistics
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
REPO = HERE.parent

# GNU OpenMP's threads spin while they wait for each other. On a machine shared with other jobs that turns
# every parallel op into a wait for a descheduled thread: one cosine fwd+bwd (N=1024, D=256, 2 threads)
# took 200 ms instead of 15 ms here. Passive waiting costs a few microseconds per op on an idle machine.
# Set before torch loads OpenMP; an explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

MB = 1e6
GB = 1e9

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def element_bytes(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


# --------------------------------------------------------------------------------------------------------
# What a benchmark is
# --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Implementation:
    """How one family of providers computes a loss.

    calls: what is called, for the results' legend. make(context, inputs) returns a closure computing the
    scalar loss from `inputs`; the context is the provider's own: our backend's name, angle-emb's loss
    module, sentence-transformers' losses module, or angle_kernels.testing.oracle (see providers.py).
    """

    calls: str
    make: Callable[[Any, dict], Callable[[], torch.Tensor]]


@dataclass(frozen=True)
class LossBench:
    """One benchmarked loss: its inputs, the work it cannot avoid, and who provides it.

    grows: "N" or "N^2", how its cost grows with the size N; it picks the size list of the sweep (--n or
        --n-quadratic) and how a run time is extrapolated to the next size.
    size_label: what N counts, for the plot's axis.
    embedding_rows(n): how many embedding rows of D values the inputs hold (for memory estimates).
    build_inputs(n, d, dtype, device, seed) -> dict of the loss's tensors; the embeddings are leaves that
        require grad (`grad_leaves`).
    work_floor(n, d, dtype) -> the floor dict of the op the loss is built on (see "Work floors").
    implementations: provider family ("ours", "reference", "sentence-transformers", "eager") -> how it
        computes this loss.
    eager_matrix_elements(n): elements of the N x N-like matrices the baselines build (None: none do), and
        bytes_per_element: provider family -> peak extra bytes per such element, measured on this harness
        (float32, forward + backward) and rounded up; a family missing there stays linear. Together they
        estimate a baseline's memory before it runs, to skip a size that would not fit.
    """

    name: str
    grows: str
    size_label: str
    embedding_rows: Callable[[int], int]
    build_inputs: Callable[..., dict]
    work_floor: Callable[[int, int, torch.dtype], dict]
    implementations: dict[str, Implementation]
    eager_matrix_elements: Callable[[int], int] | None = None
    bytes_per_element: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class OpBench:
    """One op benchmarked on every backend (the GPU run's op sweep).

    sizes, dims, dtypes: the grid, smallest size first. grows: "N" or "N^2" (forecasts).
    setup(ops, backend, n, d, dtype, device, generator) -> (run, leaves, floor): run() computes a scalar
    from the op's outputs with backend module `ops`, leaves are the tensors it differentiates, and floor is
    the op's work floor, with "executed" FLOPs where the backend does more than the maths needs.
    memory_bytes(n, d, dtype): a rough upper estimate of what a case holds, to skip one that cannot fit.
    triton_schemes: the op is one the triton backend computes by two schemes (similarity_xent, similarity_lse: fused
    kernels or dense products; pair scores with dims: kernels per prefix or one read; see TRITON_SCHEMES); the
    sweep measures both on every case. cuda_schemes: the same for the cuda backend (similarity_xent at one width:
    CUDA_SCHEMES).
    """

    name: str
    sizes: tuple[int, ...]
    dims: tuple[int, ...]
    dtypes: tuple[str, ...]
    grows: str
    setup: Callable[..., tuple[Callable[[], torch.Tensor], list, dict]]
    memory_bytes: Callable[[int, int, torch.dtype], int]
    triton_schemes: bool = False
    cuda_schemes: bool = False


# The triton backend's two schemes, by the row label the sweeps give them, and the width from which it takes the
# one-pass scheme that forces each: "triton-fused", the kernels per width (similarity_xent's and similarity_lse's
# fused kernels; with dims, the prefix kernels, similarity_lse's once per prefix, and the pair scores' per-prefix
# kernels), or "triton-dense", one pass over every width (the dense products: similarity_xent_dense,
# _similarity_xent_dense_dims, _similarity_lse_dense, only where their tiles fit, see their `takes`; the one-read
# pair scores). The widths: similarity_xent_dense.MIN_WIDTH and the op modules' DENSE_*_MIN_WIDTH and
# ONE_READ_MIN_WIDTH.
TRITON_SCHEMES = {"triton-fused": sys.maxsize, "triton-dense": 0}
# The cuda backend's, likewise: similarity_xent at one width on its fused kernels ("cuda-fused") or its dense scheme
# ("cuda-dense", where its tiles fit): cuda_ops.similarity_xent_paths.DENSE_MIN_WIDTH.
CUDA_SCHEMES = {"cuda-fused": sys.maxsize, "cuda-dense": 0}


def _scheme_switches(label: str) -> list[tuple[object, str]]:
    """(module, width name) of every switch between the two schemes of the backend that `label` names."""
    if label in CUDA_SCHEMES:
        from angle_kernels.cuda_ops import similarity_xent_paths as cuda_similarity_xent_paths

        return [(cuda_similarity_xent_paths, "DENSE_MIN_WIDTH")]
    from angle_kernels.triton_ops import pair_scores_paths, similarity_lse_paths, similarity_xent_dense
    from angle_kernels.triton_ops import similarity_xent_paths

    return [(similarity_xent_dense, "MIN_WIDTH"), (similarity_xent_paths, "DENSE_DIMS_MIN_WIDTH"),
            (similarity_lse_paths, "DENSE_MIN_WIDTH"), (similarity_lse_paths, "DENSE_DIMS_MIN_WIDTH"),
            (pair_scores_paths, "ONE_READ_MIN_WIDTH")]


@contextlib.contextmanager
def forced_scheme(label: str):
    """Within the block, the backend's ops take the scheme `label` names (TRITON_SCHEMES, CUDA_SCHEMES) at every
    width; any other label changes nothing."""
    widths = {**TRITON_SCHEMES, **CUDA_SCHEMES}
    if label not in widths:
        yield
        return
    switches = _scheme_switches(label)
    saved = [getattr(module, name) for module, name in switches]
    for module, name in switches:
        setattr(module, name, widths[label])
    try:
        yield
    finally:
        for (module, name), value in zip(switches, saved):
            setattr(module, name, value)


def gpu_or_dry_run(parser, device: str, script: str) -> bool:
    """A GPU benchmark's device check, before any work (bench_first_use.py, profile_ops.py): `--device cpu`, its dry
    run, needs the Triton interpreter (a parser error naming TRITON_INTERPRET=1 otherwise); on cuda without a device,
    it prints how to dry-run `script` instead and returns False (the script then exits 0, having done nothing)."""
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--device cpu runs the Triton kernels through the interpreter: set TRITON_INTERPRET=1")
    if device == "cuda" and not torch.cuda.is_available():
        print("skipped: no CUDA device (torch.cuda.is_available() is False); the dry run: TRITON_INTERPRET=1 "
              f"python bench/{script} --device cpu --out DIR")
        return False
    return True


def random_embeddings(generator: torch.Generator, rows: int, d: int, dtype: torch.dtype,
                      device: str | torch.device) -> torch.Tensor:
    """A [rows, d] leaf that requires grad: standard normal drawn in float32 (never zeros), then cast, so that
    every dtype of a case gets the same values up to rounding."""
    x = torch.randn(rows, d, generator=generator, device=device, dtype=torch.float32)
    return x.to(dtype).requires_grad_(True)


def zigzag_inputs(pair_labels: torch.Tensor, d: int, dtype: torch.dtype, generator: torch.Generator) -> dict:
    """angle-emb's layout for N labelled pairs: y_true [2N, 1] (float32, each pair's label on both its rows)
    and y_pred [2N, D] (the two texts of pair k on rows 2k and 2k + 1)."""
    n = pair_labels.shape[0]
    return {"y_true": pair_labels.to(torch.float32).repeat_interleave(2).unsqueeze(1),
            "y_pred": random_embeddings(generator, 2 * n, d, dtype, pair_labels.device)}


def grad_leaves(inputs: dict) -> list[torch.Tensor]:
    """The input tensors that receive gradients (to reset `.grad` between runs and to compare gradients)."""
    return [t for t in inputs.values() if isinstance(t, torch.Tensor) and t.requires_grad]


def input_bytes(inputs: dict) -> int:
    return sum(t.numel() * t.element_size() for t in inputs.values() if isinstance(t, torch.Tensor))


# --------------------------------------------------------------------------------------------------------
# Work floors: what a forward + backward pass cannot avoid
# --------------------------------------------------------------------------------------------------------
# A floor is {"kind": "bytes" | "flops", "amount": ...}: bytes are set against the copy bandwidth, FLOPs
# against the matmul rate of the dtype. Each loss uses the floor of the op it is built on.


def pair_scores_floor(rows: int, d: int, dtype: torch.dtype) -> dict:
    """Pair scores over `rows` embedding rows: read them in forward and again in backward, write their
    gradient once. Memory bound."""
    return {"kind": "bytes", "amount": 3 * rows * d * element_bytes(dtype)}


def ranking_floor(n: int, scores_dtype: torch.dtype, labels_dtype: torch.dtype) -> dict:
    """The ranking term over n scores: read the scores and labels, write the scores' gradient."""
    return {"kind": "bytes", "amount": n * (2 * element_bytes(scores_dtype) + element_bytes(labels_dtype))}


def similarity_floor(m: int, mc: int, d: int) -> dict:
    """Cross-entropy over cosine logits of m rows against mc columns: 2 m mc d FLOPs forward, 2 for dq and 2 for
    dc in backward. Compute bound for D >= ~128."""
    return {"kind": "flops", "amount": 6 * m * mc * d}


def similarity_flops_executed(backend: str, m: int, mc: int, d: int, dims: tuple[int, ...] | None = None) -> int:
    """The FLOPs each backend executes for similarity_xent forward + backward, beside the 6 m mc d the maths
    needs. Triton's fused kernels ("triton-fused"): the dq and dc kernels each recompute the logit tiles
    (2 + 4 + 4); its dense scheme ("triton-dense") and torch: forward forms the gradients while it holds each
    block's logits (2 + 4); "triton" is the one of the two its similarity_xent takes at width d. CUDA's fused
    kernels ("cuda-fused"): one backward kernel recomputes once and forms dq and dc with atomics (2 + 2 + 4); its
    dense scheme ("cuda-dense") as Triton's; "cuda" is the one its similarity_xent takes. With nested prefixes (dims):
    Triton's fused prefix kernels ("triton-fused") recompute the tile in the dq and dc kernels (2 m mc d each) and
    form their gradient prefix by prefix (2 m mc sum(d_i) each); its dense dims scheme ("triton-dense",
    triton_ops/_similarity_xent_dense_dims.py) and torch on a GPU recompute the tiles in backward, their slice
    products costing what the full width's do (2 + 2 + 4); torch on the CPU forms them in forward (2 + 4) for the
    weights its last backward of the kind received (torch_ops/similarity_xent.py; the GPU sweeps count the GPU's)."""
    if backend in ("triton", "cuda"):  # the scheme the backend's similarity_xent takes at this shape
        paths = importlib.import_module(f"angle_kernels.{backend}_ops.similarity_xent_paths")
        rows, columns = torch.empty(m, d, device="meta"), torch.empty(mc, d, device="meta")
        path = paths.code_path(rows, columns, 1.0, "diagonal", dims=dims)
        backend += "-dense" if path in ("dense", "dense_dims") else "-fused"
    if dims is not None and backend == "triton-fused":
        return m * mc * (6 * d + 4 * sum(dims))
    units = {"triton-fused": 10, "cuda-fused": 8}.get(backend, 8 if dims is not None else 6)
    return units * m * mc * d


def similarity_lse_flops_executed(backend: str, m: int, mc: int, d: int, dims: tuple[int, ...] | None = None) -> int:
    """The FLOPs each backend executes for similarity_lse forward + backward (no filter), beside the 6 m mc d the
    maths needs (similarity_floor). Triton's fused kernels ("triton-fused"): the dq and dc kernels each recompute
    the logit tiles (2 + 4 + 4), with dims once per prefix (10 m mc sum(d_i)); its dense scheme ("triton-dense",
    triton_ops/_similarity_lse_dense.py, with dims in one pass) forms the tiles again in backward (2 + 2 + 4), the
    same with dims (cumulative slice products); "triton" is the one of the two its similarity_lse takes. torch and
    cuda: the tiles again in backward (2 + 2 + 4), with dims too (their prefixes' tiles are running sums of slice
    products: one width's products)."""
    if backend == "triton":
        from angle_kernels.triton_ops import similarity_lse_paths

        rows, columns = torch.empty(m, d, device="meta"), torch.empty(mc, d, device="meta")
        path = similarity_lse_paths.code_path(rows, columns, 1.0, dims=dims)
        backend = "triton-dense" if path in ("dense", "dense_dims") else "triton-fused"
    if backend == "triton-fused":
        return 10 * m * mc * (d if dims is None else sum(dims))
    return 8 * m * mc * d


# --------------------------------------------------------------------------------------------------------
# Running and timing a case
# --------------------------------------------------------------------------------------------------------


def fwd_bwd(fn: Callable[[], torch.Tensor], leaves: list[torch.Tensor]) -> torch.Tensor:
    """One forward + backward pass of fn(), the leaves' gradients reset first (so none accumulate)."""
    for leaf in leaves:
        leaf.grad = None
    loss = fn()
    loss.backward()
    return loss


def cold_call(run: Callable[[], torch.Tensor], leaves: list[torch.Tensor], device: str) -> float:
    """Seconds of the first call of a case, one forward + backward, waited for: on a GPU the compiles and the
    autotuning of every kernel it launches at that shape. The warm-up of a case, timed apart from its warm runs."""
    started = time.perf_counter()
    fwd_bwd(run, leaves)
    if device == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - started


# Where a sweep has less time than its warm-up allowance was sized for (a stage's --time-limit, or the seconds the
# agreement checks and the limits took before a loss sweep), the warm-up takes at most this share of what is left.
MAX_WARM_UP_SHARE = 2 / 3


def warm_up_within(allowance_s: float, seconds_left: float) -> float:
    """Seconds of a sweep's `seconds_left` its first calls may take: its allowance, at most MAX_WARM_UP_SHARE of
    them (the timed runs keep the rest)."""
    return min(allowance_s, MAX_WARM_UP_SHARE * max(0.0, seconds_left))


class SweepBudget:
    """A sweep's time in two allowances, each charged with its own seconds: "warm_up", every case's first call
    (`cold_call`: compiles and autotuning, whatever they cost), and "timed", its measured runs. The compiles never
    eat the time of the measurements (a GPU loss sweep once spent its whole budget compiling at its smallest size)
    and what they cost is on record. Both end by the sweep's end, `seconds` from now: the timed runs get what is
    left after the warm-up's allowance."""

    PARTS = ("warm_up", "timed")

    def __init__(self, seconds: float, warm_up_s: float):
        self.end = time.monotonic() + seconds
        left = max(0.0, seconds)
        self.allowed = {"warm_up": min(warm_up_s, left), "timed": max(0.0, left - warm_up_s)}
        self.spent = {"warm_up": 0.0, "timed": 0.0}
        self.calls = {"warm_up": 0, "timed": 0}

    def left(self, part: str) -> float:
        return min(self.allowed[part] - self.spent[part], self.end - time.monotonic())

    def fits(self, part: str, seconds: float) -> bool:
        return seconds <= self.left(part)

    def charge(self, part: str, seconds: float) -> None:
        self.spent[part] += seconds
        self.calls[part] += 1

    def summary(self) -> dict:
        return {part: {"allowed_s": round(self.allowed[part], 1), "spent_s": round(self.spent[part], 1),
                       "cases": self.calls[part]} for part in self.PARTS}


@contextlib.contextmanager
def charging(budget: SweepBudget | None, part: str):
    """The block's seconds charged to `part` of `budget` (none: nothing), whether it ends or raises."""
    started = time.monotonic()
    try:
        yield
    finally:
        if budget is not None:
            budget.charge(part, time.monotonic() - started)


@dataclass
class Timing:
    median_s: float
    min_s: float
    times_s: list[float]
    method: str


# Timed runs a CPU case gets before its time allowance may end them: time_cpu's, and the CPU loss sweep's rounds
# (loss_sweep.wants_another_round and its --time-per-case)
MIN_CPU_RUNS = 3


def time_cpu(run: Callable[[], object], repeats: int = 5, time_per_case: float = 3.0,
             min_runs: int = MIN_CPU_RUNS) -> Timing:
    """Wall clock of up to `repeats` runs of run(), warm-up excluded (the caller has run it once): once
    `min_runs` are done, it stops when `time_per_case` seconds are spent."""
    times: list[float] = []
    started = time.perf_counter()
    while len(times) < repeats:
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
        if len(times) >= min_runs and time.perf_counter() - started > time_per_case:
            break
    if not times:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    return Timing(statistics.median(times), min(times), times, "wall clock")


# A run at least this long is timed with a few CUDA-event runs instead of do_bench, which spends about
# 5 + 25/t + 100/t runs on estimating, warming and timing: dozens of seconds for the largest cases. At this
# length the L2 cache (50 MB) holds a negligible share of the bytes a run moves, so flushing it changes nothing.
SLOW_RUN_S = 0.2
SLOW_RUN_REPEATS = 3
# A measured CUDA case costs about a dozen runs (warm-up, memory run, do_bench's timing) plus one-time
# compiles: what a time budget must expect of it, given the time of one run.
RUNS_PER_CASE = 12


def time_cuda(run: Callable[[], object], grad_to_none: list | None = None, expected_s: float | None = None) -> Timing:
    """Median and min of run() on CUDA, warm-up excluded: triton's do_bench (which flushes the L2 cache before
    every run), else CUDA events around each run after a 256 MB write that evicts the L2. A run known to take
    at least SLOW_RUN_S (expected_s, from a warm run) gets SLOW_RUN_REPEATS event-timed runs."""
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    slow = expected_s is not None and expected_s >= SLOW_RUN_S
    if do_bench is not None and not slow:
        median_ms, fastest_ms = do_bench(run, grad_to_none=grad_to_none, quantiles=[0.5, 0.0])
        return Timing(median_ms / 1e3, fastest_ms / 1e3, [], "triton.testing.do_bench")
    flush = torch.empty(64 * 2**20, dtype=torch.int32, device="cuda")
    if not slow:
        run()
    times = []
    for _ in range(SLOW_RUN_REPEATS if slow else 20):
        flush.zero_()
        for leaf in grad_to_none or ():
            leaf.grad = None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    method = f"CUDA events, {len(times)} runs of >= {SLOW_RUN_S * 1e3:g} ms" if slow else "CUDA events (L2 flushed)"
    return Timing(statistics.median(times), min(times), times, method)


def timing_description(device: str, repeats: int) -> str:
    """How the loss sweep times a case on `device`, for report headers (loss_sweep.sweep)."""
    if device == "cpu":
        return (f"up to {repeats} runs, one per round, the providers of a size taking turns, each run in a fresh "
                "process after its warm-up pass (wall clock)")
    return ("triton.testing.do_bench's runs (warm-up excluded, L2 flushed), or "
            f"{SLOW_RUN_REPEATS} CUDA-event runs for a case whose run takes {SLOW_RUN_S * 1e3:g} ms or more")


# --------------------------------------------------------------------------------------------------------
# Memory
# --------------------------------------------------------------------------------------------------------


def _proc_status_kb(field_name: str) -> int | None:
    try:
        match = re.search(rf"^{field_name}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M)
    except OSError:
        return None
    return int(match.group(1)) if match else None


def release_free_heap() -> None:
    """Give the pages of freed heap memory back to the kernel (glibc's malloc_trim), where there is glibc.

    The CPU memory measure is a rise in RSS: memory that earlier work freed but malloc kept resident would be
    reused by the measured pass without raising RSS, and the pass would look lighter than it is (seen: a pass
    holding 64 MB measured as 0 bytes after a long test session). After the trim, every page the pass touches
    is a fresh one and counts."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim, the measure may read low
        pass


def reset_peak_rss() -> bool:
    """Make VmHWM (peak RSS) equal the current RSS (Linux >= 4.0). False where that is not possible."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def peak_rss_bytes() -> int:
    hwm = _proc_status_kb("VmHWM")
    if hwm is not None:
        return hwm * 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kB on Linux


def cap_address_space(headroom_bytes: int) -> None:
    """Cap this process's address space at its current size plus `headroom_bytes`: an allocation beyond it
    raises (reported as OOM) instead of waking the kernel's OOM killer on a machine shared with other jobs.
    Only for a throw-away child process: the cap cannot be lifted."""
    import resource

    vm = _proc_status_kb("VmSize")
    if vm is None:
        return
    limit = vm * 1024 + int(headroom_bytes)
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def mem_available_bytes() -> int | None:
    try:
        match = re.search(r"^MemAvailable:\s+(\d+) kB", Path("/proc/meminfo").read_text(), re.M)
    except OSError:
        return None
    return int(match.group(1)) * 1024 if match else None


def free_bytes(device: str) -> int | None:
    """Memory a case may still take on `device`: free CUDA memory, or the CPU's MemAvailable."""
    return torch.cuda.mem_get_info()[0] if device == "cuda" else mem_available_bytes()


def cuda_warm_peak_extra_bytes(run, leaves, memory=None) -> tuple[torch.Tensor, int, float]:
    """(value, peak extra bytes, seconds of the measured run) of run() (forward + backward): one warm-up run,
    then the peak allocated memory of one more run above what was allocated before it.

    The warm-up absorbs the one-time costs of a new shape: JIT compiles and Triton's autotuning, which
    benchmarks with do_bench and its 256 MB L2-flush buffer; measured on the first call, those would count as
    the loss's memory. `memory` is torch.cuda (or a stand-in with the same four functions, for tests)."""
    memory = torch.cuda if memory is None else memory
    fwd_bwd(run, leaves)
    memory.synchronize()
    for leaf in leaves:
        leaf.grad = None
    memory.reset_peak_memory_stats()
    before = memory.memory_allocated()
    started = time.perf_counter()
    value = fwd_bwd(run, leaves)
    memory.synchronize()
    return value, int(memory.max_memory_allocated() - before), time.perf_counter() - started


def measure_fwd_bwd(run, leaves, device: str, repeats: int = 5, time_per_case: float = 3.0,
                    address_space_headroom: int | None = None) -> dict:
    """Peak extra memory and time of forward + backward of run() on `device`, the inputs already built.

    CPU: the first pass measures the peak RSS above the RSS before it (VmHWM reset first; where it cannot be
    reset, the lifetime peak stands in) and is the warm-up of the timing; then `time_cpu`. With
    address_space_headroom the process's address space is capped first (forked children only: see
    cap_address_space). The caller warms up one-time costs (lazy imports, thread pools) at a tiny size.
    CUDA: `cuda_warm_peak_extra_bytes`, then `time_cuda` (its slow-case rule from the measured run).
    Gradients of the leaves count as extra memory.
    """
    if device == "cuda":
        value, extra, memory_run_s = cuda_warm_peak_extra_bytes(run, leaves)
        timing = time_cuda(lambda: fwd_bwd(run, leaves), grad_to_none=leaves, expected_s=memory_run_s)
        peak_method = "max_memory_allocated of a warm run"
    else:
        for leaf in leaves:  # gradients a caller's warm-up left would hide the measured pass's (it frees them first)
            leaf.grad = None
        gc.collect()
        release_free_heap()
        if address_space_headroom is not None:
            cap_address_space(address_space_headroom)
        exact_peak = reset_peak_rss()
        rss_before = (_proc_status_kb("VmRSS") or 0) * 1024 if exact_peak else peak_rss_bytes()
        started = time.perf_counter()
        value = fwd_bwd(run, leaves)
        memory_run_s = time.perf_counter() - started
        extra = peak_rss_bytes() - rss_before
        if repeats > 0:
            timing = time_cpu(lambda: fwd_bwd(run, leaves), repeats, time_per_case)
        else:  # the warm-up is all there is
            timing = Timing(memory_run_s, memory_run_s, [memory_run_s], "wall clock, one cold run")
        peak_method = "VmHWM reset by clear_refs" if exact_peak else "ru_maxrss after inputs"
    return {"median_s": timing.median_s, "min_s": timing.min_s, "times_s": timing.times_s, "timing": timing.method,
            "memory_run_s": memory_run_s, "extra_bytes": int(extra), "peak_method": peak_method,
            "loss_value": float(value.detach())}


def free_cuda_memory() -> None:
    """Return cached CUDA memory between cases and steps; after a CUDA error (a lost context) there is nothing
    to free, and saying so beats raising."""
    if not torch.cuda.is_available():
        return
    gc.collect()  # tensors that only a reference cycle still holds
    try:
        torch.cuda.empty_cache()
    except RuntimeError as exc:
        print(f"  (torch.cuda.empty_cache failed: {exc})", flush=True)


def is_oom(exc: BaseException) -> bool:
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    text = str(exc)
    return "can't allocate memory" in text or "out of memory" in text.lower() or "DefaultCPUAllocator" in text


# --------------------------------------------------------------------------------------------------------
# Hardware limits
# --------------------------------------------------------------------------------------------------------


def time_run(device: str, run: Callable[[], object]) -> Timing:
    """A plain (no autograd) run timed the device's way, after one warm-up run."""
    if device == "cuda":
        return time_cuda(run)
    run()
    return time_cpu(run, repeats=3, time_per_case=1.0)


# Sizes of the limit measurements: the copy far larger than the caches (1 GiB on a GPU, whose L2 is 50 MB;
# 256 MiB on a CPU), square matmuls large enough to reach the peak rate (float64 runs at a fraction of it). On a CPU
# the rate is the best of two sizes: on the AMD EPYC of bench/results/cpu-2026-11-25-fused-xent one 2048 matmul
# measured 132 GFLOP/s while the in-batch-negative loss ran its own products (exactly the FLOPs counted) at 163, so
# one size can miss the peak; a limit is the best the hardware shows.
COPY_BYTES = {"cuda": 2**30, "cpu": 2**28}
MATMUL_SIZES = {"cuda": (8192,), "cpu": (2048, 4096)}


def _copy_seconds(device: str, copy_bytes: int) -> float:
    """The fastest time of a copy of `copy_bytes` bytes on `device` (its buffers are freed on return)."""
    src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    return time_run(device, lambda: dst.copy_(src)).min_s


def measure_limits(device: str, dtypes, copy_bytes: int | None = None, matmul_size: int | None = None) -> dict:
    """The device's copy bandwidth (bytes read + written per second) and matmul rates of `dtypes` (names),
    measured now: the denominators of the achieved rates (`limit_rate`). Each is the fastest of its runs (a
    limit is what the hardware can do; on a shared CPU the median would count other jobs' time as its own).
    On CPU with torch's thread count."""
    copy_bytes = copy_bytes or COPY_BYTES[device]
    limits = {"copy_GBps": 2 * copy_bytes / _copy_seconds(device, copy_bytes) / GB}
    for name in dtypes:
        rates = []
        for size in (matmul_size,) if matmul_size else MATMUL_SIZES[device]:
            size = size // 2 if DTYPES[name] == torch.float64 else size
            a = torch.randn(size, size, device=device).to(DTYPES[name])
            b = torch.randn(size, size, device=device).to(DTYPES[name])
            rates.append(2 * size**3 / time_run(device, lambda: a @ b).min_s / 1e12)
        limits[f"matmul_{name}_TFLOPs"] = max(rates)
    if device == "cuda":
        limits["tf32_matmul_allowed"] = bool(torch.backends.cuda.matmul.allow_tf32)
        torch.cuda.empty_cache()
    else:
        limits["threads"] = torch.get_num_threads()
    return limits


def limit_rate(limits: dict, floor_kind: str, dtype: str) -> float | None:
    """The hardware limit a rate is a fraction of, from `measure_limits`: the copy bandwidth in B/s for a
    bytes floor, the matmul rate of the dtype (a name) in FLOP/s for a FLOPs floor; None when it was not
    measured."""
    if not limits:
        return None
    if floor_kind == "bytes":
        return limits["copy_GBps"] * GB
    return limits.get(f"matmul_{dtype}_TFLOPs", 0) * 1e12 or None


def describe_limits(limits: dict) -> str:
    parts = []
    for key, value in limits.items():
        if key == "copy_GBps":
            parts.append(f"copy {value:.4g} GB/s")
        elif key.startswith("matmul_"):
            parts.append(f"{key[len('matmul_'):-len('_TFLOPs')]} matmul {value:.4g} TFLOP/s")
        else:
            parts.append(f"{key} {value}")
    return ", ".join(parts)


# --------------------------------------------------------------------------------------------------------
# Forked children (CPU)
# --------------------------------------------------------------------------------------------------------
# Why fork: a fresh process per case gives a clean heap and an honest peak RSS, and forking a parent that has
# imported torch, angle_kernels, sentence-transformers and the reference once saves about 10 s of imports per
# case. The parent must never compute with torch: GNU OpenMP deadlocks in a forked child once the parent has
# run a parallel region, so everything that computes (probes, checks, cases) runs in a child.


def _child_entry(writer, fn, args):
    try:
        payload = ("ok", fn(*args))
    except BaseException as exc:  # report everything, including MemoryError, to the parent
        kind = "oom" if is_oom(exc) else "error"
        payload = (kind, f"{type(exc).__name__}: {exc}", traceback.format_exc(limit=6))
    writer.send(payload)
    writer.close()


def call_in_fork(fn, *args, timeout: float = 600.0):
    """Run fn(*args) in a forked child. Returns ("ok", result), ("oom" | "error", message, traceback), or
    ("killed" | "timeout", message)."""
    ctx = multiprocessing.get_context("fork")
    reader, writer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child_entry, args=(writer, fn, args), daemon=True)
    proc.start()
    writer.close()
    payload = None
    if reader.poll(timeout):  # a result, or the end of the pipe when the child died without one
        try:
            payload = reader.recv()
        except EOFError:
            payload = None
        proc.join(10)  # it is exiting: give it the time to
    if proc.is_alive():  # only our own child, by its handle
        proc.kill()
        proc.join()
        if payload is None:
            return ("timeout", f"killed after {timeout:.0f} s")
    if payload is None:
        code = proc.exitcode
        if code is not None and code < 0 and -code == 9:
            return ("killed", "killed by SIGKILL (most likely the kernel's out-of-memory killer)")
        return ("killed", f"child exited with code {code} without a result")
    return payload


# --------------------------------------------------------------------------------------------------------
# Reports
# --------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def written_aside(path: Path):
    """A path beside `path` (NAME.tmp) for the block to write the new contents into, by any writer (write_text, a
    figure's savefig); once the block ends without an exception, it replaces `path` in one step: a reader (or a kill)
    never sees half a file. When the block or the rename raises, the file written aside is removed (a failed savefig
    left plot.png.tmp in the results folder) and `path` keeps its previous contents (or stays absent); the error is
    raised on."""
    tmp = path.with_name(path.name + ".tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # the write's own error is the one to see
            tmp.unlink(missing_ok=True)
        raise


def output_folder_problem(flag: str, folder: Path, written: Path | None = None) -> str | None:
    """Why `folder` cannot take a benchmark's output (None where it can), checked before any work so that a run never
    measures for minutes and then fails to write: it must be a folder this process can write in, or one it can create
    (nothing is created here), and it may hold no file git tracks in this checkout (`written`, where given: that
    file must not be one): committed results (bench/results/*) are evidence, never rewritten or mixed with a later
    run's files."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        return f"{flag} {folder}: is a file, not a folder"
    existing = next(p for p in (folder.absolute(), *folder.absolute().parents) if p.exists())
    if not existing.is_dir():
        return f"{flag} {folder}: cannot create the folder: {existing} is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{flag} {folder}: cannot write in {existing}"
    committed = committed_files(folder if written is None else written)
    if committed:
        shown = ", ".join(committed[:3]) + (f" and {len(committed) - 3} more" if len(committed) > 3 else "")
        return f"{flag} {written or folder}: would overwrite committed results ({shown}); give a path of its own"
    return None


def committed_files(path: Path) -> list[str]:
    """The files under `path` (or `path` itself) that git tracks in this checkout, relative to it; none where git is
    missing or `path` lies outside the checkout."""
    import subprocess

    path = Path(path).resolve()
    if not path.is_relative_to(REPO):
        return []
    try:
        listed = subprocess.run(["git", "--no-optional-locks", "-C", str(REPO), "ls-files", "-z", "--",
                                 str(path.relative_to(REPO))], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return []
    return [name for name in listed.stdout.split("\0") if name] if listed.returncode == 0 else []


def write_text_atomic(path: Path, text: str) -> None:
    """Replace path's contents in one step (written_aside): a reader (or a kill) never sees half a file."""
    with written_aside(path) as tmp:
        tmp.write_text(text)


@functools.cache
def _own_tracking():
    """angle_train/tracking.py of the checkout bench/ is in, loaded by its path: a benchmark that times another
    checkout's angle_train (bench_data_prep.py --checkout) has imported that one as `angle_train`, and an older one
    lacks the helpers the reports are written with. The module imports nothing but the standard library."""
    path = REPO / "angle_train" / "tracking.py"
    spec = importlib.util.spec_from_file_location("_bench_own_angle_train_tracking", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def json_text(payload, indent: int | None = 1) -> str:
    """`payload` as strict JSON, what every JSON file and --json output of the benchmarks holds: a number that is not
    finite (a NaN loss, an infinite difference) written as null (angle_train's rule for its files:
    tracking.finite_or_none, this checkout's whatever angle_train is measured), where json.dumps wrote NaN or Infinity,
    which jq, JavaScript's JSON.parse and other strict parsers refuse; anything else that is not JSON (a path, a
    dtype) as its str. Its readers take null as a number that is missing or not finite."""
    return json.dumps(_own_tracking().finite_or_none(payload), indent=indent, default=str, allow_nan=False)


def write_json_atomic(path: Path, payload, indent: int | None = 1) -> None:
    write_text_atomic(path, json_text(payload, indent) + "\n")


def markdown_table(header: list[str], rows: list[list[str]]) -> list[str]:
    """A markdown table's lines; a '|' inside a cell would end the cell early, so it becomes '/'."""
    def line(cells):
        return "| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |"

    return [line(header), "|" + "---|" * len(header)] + [line(row) for row in rows]


def fmt_bytes(b: float) -> str:
    return f"{b / GB:.1f} GB" if b >= GB else f"{b / MB:.0f} MB" if b >= 10 * MB else f"{b / MB:.1f} MB"


def _seconds_unit(seconds: float) -> tuple[float, str]:
    """(scale, unit) a time is written in: milliseconds below a second, seconds from there."""
    return (1e3, "ms") if seconds < 1 else (1.0, "s")


def fmt_seconds(seconds: float) -> str:
    scale, unit = _seconds_unit(seconds)
    return f"{seconds * scale:.3g} {unit}"


def fmt_seconds_range(low: float, high: float) -> str:
    """'low-high unit', both in the unit of the higher one (a spread of times: `1.2-1.31 ms`)."""
    scale, unit = _seconds_unit(high)
    return f"{low * scale:.3g}-{high * scale:.3g} {unit}"


def achieved_rate(floor: dict, seconds: float, limits: dict, dtype: str) -> dict:
    """The floor's work over `seconds`, and its fraction of the measured limit (None where none was measured)."""
    rate = floor["amount"] / seconds
    peak = limit_rate(limits, floor["kind"], dtype)
    return {"rate": rate, "rate_unit": "B/s" if floor["kind"] == "bytes" else "FLOP/s",
            "rate_fraction": rate / peak if peak else None}


def fmt_rate(rate: float, unit: str, fraction: float | None = None) -> str:
    if unit == "B/s":
        text = f"{rate / GB:.3g} GB/s"
    else:
        text = f"{rate / 1e9:.3g} GFLOP/s" if rate < 1e12 else f"{rate / 1e12:.3g} TFLOP/s"
    if fraction is not None:
        percent = 100 * fraction
        text += f" ({percent:.0f} %)" if percent >= 10 else f" ({percent:.2g} %)"
    return text


# --------------------------------------------------------------------------------------------------------
# Environment
# --------------------------------------------------------------------------------------------------------


def describe_environment(device: str) -> dict:
    """What the numbers depend on: hardware, threads, library versions."""
    import importlib

    info = {"torch": torch.__version__, "device": device, "threads": torch.get_num_threads()}
    if device == "cpu":
        info["cpu"] = cpu_model()
        info["logical_cpus"] = os.cpu_count()
    else:
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = props.name
        info["gpu_memory_gb"] = round(props.total_memory / 1e9, 1)
        info["cuda"] = torch.version.cuda
        try:
            import subprocess

            info["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=20,
            ).stdout.strip()
        except Exception:
            info["driver"] = "unknown"
    for name, distribution in (("triton", "triton"), ("sentence_transformers", "sentence-transformers")):
        info[name] = installed_version(name, distribution)
    angle_kernels = importlib.import_module("angle_kernels")
    info["angle_kernels"] = angle_kernels.__version__
    # which code was measured: the version stays the same across commits
    package = Path(angle_kernels.__file__).parent
    info["angle_kernels_path"] = str(package)
    info["angle_kernels_commit"] = checkout_commit(package)
    return info


def installed_version(module: str, distribution: str) -> str | None:
    """The version of `module` as imported where it already is (None where its import is blocked: None in
    sys.modules), else its installed distribution's (None where it is not installed): read from the package's
    metadata rather than by importing it, as sentence-transformers' import (transformers, peft, ...) costs seconds
    of a run that never uses it."""
    import importlib.metadata

    if module in sys.modules:
        return getattr(sys.modules[module], "__version__", None)
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


# describe_environment's keys that say which checkout was measured (beside the machine and the versions)
CHECKOUT_KEYS = ("angle_kernels_path", "angle_kernels_commit")


def checkout_commit(folder: Path) -> str:
    """The git commit of the checkout whose tracked files `folder` holds: its short hash, with " + uncommitted
    changes" where a tracked file of its work tree differs from it; "unknown" where `folder` is no checkout's (an
    installed package: a virtual environment inside a checkout is no part of it, git tracks none of its files) or
    git is missing."""
    import subprocess

    def git(*args) -> subprocess.CompletedProcess:
        # no optional locks: a status of a checkout being committed to would otherwise take its index lock
        return subprocess.run(["git", "--no-optional-locks", "-C", str(folder), *args], capture_output=True,
                              text=True, timeout=20)

    try:
        head, tracked = git("rev-parse", "--short", "HEAD"), git("ls-files", "--", ".")
        if head.returncode != 0 or tracked.returncode != 0 or not tracked.stdout.strip():
            return "unknown"
        changed = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if changed.returncode != 0:
        return head.stdout.strip() + " (uncommitted changes unknown)"
    return head.stdout.strip() + (" + uncommitted changes" if changed.stdout.strip() else "")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"
