"""Peak extra memory of forward + backward, in fresh processes (CPU).

Each test's runs take a process of their own: run a small warm-up of each loss (so one-time library allocations
do not count), then for each run build its inputs (consecutive runs of the same size and kind of input share
one set: the two losses at a million pairs), reset the peak-RSS counter (Linux: write 5 to /proc/self/clear_refs),
take the current RSS as the baseline, run forward + backward once, and report the peak RSS (VmHWM) minus the
baseline; then free the run's result and gradient before the next. (resource.getrusage's ru_maxrss cannot be
used for the peak: Linux carries the parent's high-water mark across fork (and exec) into it, so a case would
report at least the peak of the process it started from.) The extra includes the gradient of the embeddings (one
input-sized tensor), which the reference allocates too. Where two runs of a process are compared, the one whose
larger reading would make the check easier runs second: any allocation a process makes once falls on the first.
The processes are forked (one per test and provider) from a server process (started with the measuring
environment below) that imports torch and angle_kernels and runs nothing else: each starts as a fresh process
would after its imports, without paying them (about 2 s a process on two cores).

What is asserted (float32, the measuring processes on the pytest worker's share of the cores, the root conftest.py's
`thread_share`: one thread under scripts/test.sh's two workers on two cores, two in a single process there; the
extra memory does not depend on it: 0.236 GB on two threads, 0.240 on one for the in-batch case):
* cosine_loss and angle_loss at N = 16,384 pairs, D = 768: ours needs under 1/10 of the reference's extra
  memory. The reference is measured at N = 2,048 and 4,096 and extrapolated with extra = a N + b N^2
  (the quadratic fit; +4.1 GB was measured directly for cosine at 16,384).
* in_batch_negative_loss at N = 16,384: ours under 1/10 of the reference's similarity matrix alone,
  4 * (2N)^2 bytes = 4.3 GB (the reference runs out of memory at 24 GB there), at D = 768 as the issue
  asks (its O(M^2 D) compute takes 45 s to 2 minutes on two cores). That covers the narrower widths: the
  torch backend's blocks of logits do not depend on D, the rest of its extra memory is O(M D). It is not
  measured at narrower widths and extrapolated: the peak is the largest of several moments' memory, each linear
  in D with its own mix of D-sized rows and D-free tiles, so a line through narrower widths can pass below
  D = 768's peak (at D = 128 a row buffer of M x D floats is the size of a 16 MiB tile; at 768, six times it).
* 1,048,576 pairs (D = 128, 1 GiB of inputs) run forward + backward for cosine and angle with finite results
  and extra memory linear in the input (under 2.5x its size). Skipped when the machine has less than 12 GB
  available.
* Scaling: extra memory grows about linearly in N: from N to 4N the ratio stays under 6 (quadratic: 16).

Every case here carries the `slow` marker (registered in pyproject.toml): each runs fresh processes, from
about a second to 2 min (the in-batch-negative case at N = 16,384, D = 768) on two idle cores. They run by default
and in CI; -m "not slow" skips them for a quick local loop.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from angle_kernels.testing.helpers import reference_loss_path

GB = 1e9

# The measuring server: imports torch and angle_kernels, then forks one child per case line read from stdin (the
# child runs `measure` and exits), and after each answers "EXIT <status>". It runs no torch op itself: a fork after
# one would leave the child an OpenMP pool whose threads did not survive the fork.
SERVER = r"""
import gc, importlib.util, json, os, resource, sys, time, traceback
import torch
import angle_kernels  # noqa: F401  (what the cases of ours import)

def serve():
    for line in sys.stdin:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                measure(json.loads(line))
            except BaseException:
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        print("EXIT " + str(os.waitstatus_to_exitcode(status)), flush=True)

def current_rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

def peak_rss():
    # VmHWM, the process's own high-water mark (the one clear_refs resets). ru_maxrss is not usable here:
    # Linux carries the parent's high-water mark across fork (and exec) into it (signal->maxrss), so a case
    # never reports less than the peak of the process it was started from.
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024

def reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False

def measure(args):
    # One input set serves consecutive runs of the same size and kind; each run is measured from its own baseline
    # after a peak reset, so a run reads what it adds to the live memory left by the runs before it.
    torch.set_num_threads(args["threads"])
    if args.get("chunk_elements"):  # a smaller tile budget (read at call time), the same blocks at a smaller scale
        from angle_kernels.torch_ops import common
        common.CHUNK_ELEMENTS = args["chunk_elements"]
    if args["provider"] == "ours":
        module = angle_kernels
    else:
        spec = importlib.util.spec_from_file_location("reference_loss", args["reference_path"])
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)

    def kind(loss):
        if loss == "multiple_negatives_ranking_loss":
            return "layers"
        return "in_batch" if loss == "in_batch_negative_loss" else "pairs"

    def make(loss, n, d, seed):  # (the loss's inputs, the tensor whose gradient it makes)
        g = torch.Generator().manual_seed(seed)
        if kind(loss) == "layers":  # queries and positives, layer stacks [L, n, d]
            q = torch.randn(args["layers"], n, d, generator=g).requires_grad_(True)
            return (q, torch.randn(args["layers"], n, d, generator=g)), q
        x = torch.randn(2 * n, d, generator=g).requires_grad_(True)
        if kind(loss) == "in_batch":
            per_pair = torch.randint(0, 2, (n,), generator=g).float()
        else:
            per_pair = torch.randint(0, 5, (n,), generator=g).float()  # heavy ties
        y = per_pair.repeat_interleave(2)
        return ((y if args["provider"] == "ours" else y[:, None]), x), x

    for run in args["runs"]:
        warm_inputs, _ = make(run["loss"], 64, args["d"], 1)
        getattr(module, run["loss"])(*warm_inputs, **run["options"]).backward()
        del warm_inputs
    inputs = x = made = None
    for run in args["runs"]:
        if made != (kind(run["loss"]), run["n"]):
            inputs = x = None  # freed before the next set is made
            inputs, x = make(run["loss"], run["n"], args["d"], 0)
            made = (kind(run["loss"]), run["n"])
        x.grad = None
        gc.collect()
        reset = reset_peak()
        peak_before = peak_rss()
        base = current_rss()
        start = time.perf_counter()
        out = getattr(module, run["loss"])(*inputs, **run["options"])
        out.backward()
        seconds = time.perf_counter() - start
        peak = peak_rss()
        finite = bool(torch.isfinite(out).item() and torch.isfinite(x.grad).all().item())
        # Without a peak reset, ru_maxrss may still hold an earlier, larger peak: then only a lower bound is known.
        extra = peak - base if reset or peak > peak_before else 0
        print("RESULT " + json.dumps(dict(extra=extra, base=base, peak=peak, reset=reset, seconds=seconds,
                                          finite=finite, loss=float(out), input_bytes=x.numel() * x.element_size())))
        del out

serve()
"""


def _reference_path() -> str | None:
    """angle_emb/loss.py, which the worker loads by path (the angle_emb package itself is never imported)."""
    path = reference_loss_path()
    return None if path is None else str(path)


class _Server:
    """The SERVER process and its answers (read by a thread, so that a case can be given a time limit)."""

    def __init__(self, folder: Path, threads: int):
        import angle_kernels

        package_root = str(Path(angle_kernels.__file__).resolve().parents[1])
        # A fixed glibc mmap threshold: every buffer above 128 KiB is its own mapping, returned to the system when
        # freed. (By default glibc raises the threshold to the size of the last freed buffer, up to 32 MiB, after
        # which freed tiles stay in the heap and RSS measures the allocator's caching instead of live memory.)
        # glibc reads it at the server's start; the forked cases inherit it.
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([package_root] + sys.path), OMP_NUM_THREADS=str(threads),
                   MALLOC_MMAP_THRESHOLD_=str(128 * 1024))
        self.stderr_path = folder / "server-stderr.txt"
        with open(self.stderr_path, "w") as stderr:
            self.proc = subprocess.Popen([sys.executable, "-c", SERVER], env=env, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)  # the server ended

    def run(self, args: dict, timeout: float) -> tuple[int | None, list[str], str]:
        """(the case's exit status, or None when the server ended or the time ran out; its output lines; what it
        wrote to stderr)."""
        errors_from = self.stderr_path.stat().st_size
        self.proc.stdin.write(json.dumps(args) + "\n")
        self.proc.stdin.flush()
        deadline, lines, status = time.monotonic() + timeout, [], None
        try:
            while (line := self.lines.get(timeout=max(0.0, deadline - time.monotonic()))) is not None:
                if line.startswith("EXIT "):
                    status = int(line[len("EXIT "):])
                    break
                lines.append(line)
        except queue.Empty:
            self.close()
        with open(self.stderr_path) as f:
            f.seek(errors_from)
            return status, lines, f.read()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self):
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)  # the server and a case still running
        self.proc.wait()


@pytest.fixture(scope="module")
def measure(tmp_path_factory, thread_share):
    """measure(provider, d, (loss, n[, options]), ...) -> the RESULT of each run, in order, all in one process (see
    SERVER): consecutive runs of the same size and kind of input share one input set."""
    folder = tmp_path_factory.mktemp("memory")
    server = None

    def run(provider: str, d: int, *runs: tuple, timeout: int = 600, layers: int = 1,
            chunk_elements: int | None = None) -> list[dict]:
        nonlocal server
        if server is None or not server.alive():
            server = _Server(folder, thread_share)
        runs = [dict(loss=r[0], n=r[1], options=r[2] if len(r) > 2 else {}) for r in runs]
        args = dict(provider=provider, d=d, runs=runs, threads=thread_share, reference_path=_reference_path(),
                    layers=layers, chunk_elements=chunk_elements)
        status, lines, errors = server.run(args, timeout)
        names = ", ".join(f"{r['loss']} N={r['n']}" for r in runs)
        assert status == 0, f"{provider} {names} D={d} failed (exit status {status}):\n{errors[-3000:]}"
        results = [json.loads(ln[len("RESULT "):]) for ln in lines if ln.startswith("RESULT ")]
        assert len(results) == len(runs), f"{provider} {names} D={d}: {len(results)} results:\n{errors[-3000:]}"
        for r, result in zip(runs, results):
            print(f"[memory] {provider:9s} {r['loss']:24s} N={r['n']:8d} D={d:4d}: extra {result['extra'] / GB:7.3f}"
                  f" GB, {result['seconds']:6.2f} s, peak reset: {result['reset']}")
        return results

    yield run
    if server is not None:
        server.proc.stdin.close()  # the server's loop ends
        try:
            server.proc.wait(timeout=60)
        finally:
            server.close()


def _available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


# Every case runs fresh subprocesses for seconds to minutes: all are `slow` (they still run by default and in CI).
pytestmark = [pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc and ru_maxrss (Linux)"),
              pytest.mark.slow]

N_TARGET = 16_384
D_TARGET = 768
PAIR_LOSSES = ("cosine_loss", "angle_loss")  # the same inputs (pairs with graded labels): measured side by side
REFERENCE_SIZES = (2048, 4096)  # N where the reference is measured, for its extra = a N + b N^2


def _each_loss_at_each_size(measure, provider: str, d: int, losses, sizes) -> dict:
    """{(loss, n): RESULT}: every loss at every size in one process, size by size in the order given (the losses at
    one size share its inputs)."""
    runs = [(loss, n) for n in sizes for loss in losses]
    return dict(zip(runs, measure(provider, d, *runs)))


@pytest.fixture(scope="module")
def ranking_extras(measure) -> dict:
    """{(provider, loss, n): RESULT} for the ranking losses: the reference at REFERENCE_SIZES, ours at N_TARGET."""
    if _reference_path() is None:
        pytest.skip("angle-emb is not installed")
    results = {}
    for provider, sizes in (("reference", REFERENCE_SIZES), ("ours", (N_TARGET,))):
        for (loss, n), result in _each_loss_at_each_size(measure, provider, D_TARGET, PAIR_LOSSES, sizes).items():
            results[provider, loss, n] = result
    return results


@pytest.mark.parametrize("loss", PAIR_LOSSES)
def test_ranking_losses_need_a_tenth_of_the_reference(loss, ranking_extras, record_property):
    small, large = REFERENCE_SIZES
    e_small, e_large = (ranking_extras["reference", loss, n]["extra"] for n in (small, large))
    # extra = a N + b N^2 through the two measurements
    b = (e_large - 2 * e_small) / (large * large - 2 * small * small)
    a = (e_small - b * small * small) / small
    assert b > 0, f"the reference's memory is expected to grow quadratically (fit b = {b})"
    reference_at_target = a * N_TARGET + b * N_TARGET**2
    ours = ranking_extras["ours", loss, N_TARGET]
    record_property("reference_extrapolated_bytes", reference_at_target)
    record_property("ours_extra_bytes", ours["extra"])
    assert ours["finite"]
    assert ours["extra"] < reference_at_target / 10, (
        f"{loss} N={N_TARGET}: ours {ours['extra'] / GB:.3f} GB vs reference (extrapolated from N={small}, {large}) "
        f"{reference_at_target / GB:.2f} GB: needs < 1/10"
    )


def test_in_batch_negatives_need_a_tenth_of_the_reference_matrix(measure, record_property):
    reference_lower_bound = 4 * (2 * N_TARGET) ** 2  # its float32 2N x 2N similarity matrix alone: 4.3 GB
    d = D_TARGET
    (ours,) = measure("ours", d, ("in_batch_negative_loss", N_TARGET))
    record_property("ours_extra_bytes", ours["extra"])
    assert ours["finite"]
    assert ours["extra"] < reference_lower_bound / 10, (
        f"ibn N={N_TARGET} D={d}: ours {ours['extra'] / GB:.3f} GB vs the reference's matrix alone "
        f"{reference_lower_bound / GB:.2f} GB: needs < 1/10"
    )


@pytest.fixture(scope="module")
def a_million_pairs(measure) -> dict:
    """{(loss, n): RESULT} at 1,048,576 pairs, D = 128: both losses on one set of inputs (making 1 GiB of normal
    deviates, on one thread, takes about as long as cosine_loss's forward + backward)."""
    if _available_bytes() < 12 * GB:
        pytest.skip(f"needs 12 GB available, the machine has {_available_bytes() / GB:.1f} GB")
    return _each_loss_at_each_size(measure, "ours", 128, PAIR_LOSSES, (1 << 20,))


@pytest.mark.parametrize("loss", PAIR_LOSSES)
def test_a_million_pairs(loss, a_million_pairs, record_property):
    n, d = 1 << 20, 128
    input_bytes = 2 * n * d * 4
    ours = a_million_pairs[loss, n]
    record_property("ours_extra_bytes", ours["extra"])
    record_property("ours_peak_rss_bytes", ours["peak"])
    print(f"[memory] {loss} N={n}: peak RSS {ours['peak'] / GB:.2f} GB (inputs {input_bytes / GB:.2f} GB)")
    assert ours["finite"], f"{loss} at N={n}: non-finite loss or gradient"
    assert ours["extra"] < 2.5 * input_bytes, (
        f"{loss} N={n}: extra {ours['extra'] / GB:.2f} GB for {input_bytes / GB:.2f} GB of inputs (gradient included)"
    )


GROWTH_SIZES = {"cosine_loss": 65_536, "angle_loss": 65_536, "in_batch_negative_loss": 1_024}  # N (and 4N), D = 128


@pytest.fixture(scope="module")
def growth_extras(measure) -> dict:
    """{(loss, n): RESULT} at N and 4N (GROWTH_SIZES): the pair losses in one process on shared inputs, the in-batch
    negatives in another; 4N first, so any one-time allocation of the process falls there (at N it would flatter the
    ratio)."""
    results = {}
    for losses in (PAIR_LOSSES, ("in_batch_negative_loss",)):
        n = GROWTH_SIZES[losses[0]]
        results.update(_each_loss_at_each_size(measure, "ours", 128, losses, (4 * n, n)))
    return results


@pytest.mark.parametrize("loss", list(GROWTH_SIZES))
def test_extra_memory_grows_linearly(loss, growth_extras):
    n = GROWTH_SIZES[loss]
    small, large = growth_extras[loss, n]["extra"], growth_extras[loss, 4 * n]["extra"]
    assert small > 0 and large > 0
    assert large / small < 6, f"{loss}: extra {small / GB:.3f} GB at N={n}, {large / GB:.3f} GB at N={4 * n}"


def test_matryoshka_needs_about_one_widths_memory(measure):
    """in_batch_negative_loss with dims (768, 512, 256, 128, 64) at 1,024 pairs, D = 768: peak extra memory within
    1.5x the same call at one width (the torch backend forms the dims gradients in forward, like one width)."""
    # one process, one input set; the nested call first: it takes any one-time allocation of the process
    nested_call = ("in_batch_negative_loss", 1024, dict(dims=[768, 512, 256, 128, 64]))
    nested, one = (r["extra"] for r in measure("ours", 768, nested_call, ("in_batch_negative_loss", 1024)))
    assert 0 < nested <= 1.5 * one, f"dims: extra {nested / GB:.4f} GB, one width {one / GB:.4f} GB"


def test_calls_awaiting_backward_keep_a_bounded_number_of_tiles(measure, record_property):
    """The torch backend's similarity_lse keeps a call's softmax tile for backward when the call's logits make one
    block (up to 2,048 x 2,048 on the CPU): every call of a loss kept its own, so MNRL with GTE's four directions over
    an 8-layer stack held 32 tiles of 16 MiB between forward and backward at 2,048 queries (481-577 MB in two
    measurements, against 129 MB at 4,096, which keeps none; 152 MB with the bound). The tiles kept at once now fit
    KEPT_TILES tile budgets in all: the queries that make one block need at most those more than twice as many,
    which keep none.

    Measured at a quarter of the CPU's tile budget (common.chunk_elements, read at call time: 1 << 20 logits, 4 MiB),
    1,024 queries against 2,048: the same blocks, the same kept tiles and the same budget rule, with a quarter of
    the products and softmax passes of 2,048 against 4,096 (the 32 tiles kept without the bound would be 128 MiB,
    against the bound's 16 MiB; the extra memory at 2,048 queries is recorded as a property)."""
    from angle_kernels.torch_ops import _similarity_lse_softmax

    tile_budget = 1 << 20  # elements: one block of 1,024 x 1,024 logits
    kept = _similarity_lse_softmax.KEPT_TILES * tile_budget * 4  # bytes of float32
    options = dict(directions=["query_to_doc", "query_to_query", "doc_to_query", "doc_to_doc"],
                   layer_weights=[1.0] * 8)
    one_block, two_blocks = 1024, 2048  # queries: one block of logits per call (kept), several (none kept)
    small, large = (r["extra"] for r in measure("ours", 64, ("multiple_negatives_ranking_loss", one_block, options),
                                                ("multiple_negatives_ranking_loss", two_blocks, options),
                                                layers=8, chunk_elements=tile_budget))
    record_property(f"extra_bytes_{one_block}_queries", small)
    record_property(f"extra_bytes_{two_blocks}_queries", large)
    assert 0 < small <= large + kept, (
        f"extra {small / GB:.3f} GB at {one_block:,} queries, {large / GB:.3f} GB at {two_blocks:,}")
