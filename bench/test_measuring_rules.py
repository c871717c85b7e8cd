"""The measuring rules every benchmark's figures rest on (bench/harness.py, bench/loss_sweep.py): a run's time is
the median of its runs; the hardware limits count a copy's bytes read and written and a matmul's 2 n^3 FLOPs over
the fastest run, at the best size; the executed FLOPs of the prefix schemes; the loss sweep's ratios (the
baseline's time over ours), its skips (--max-ref-gb for the references only, cases above 80% of free memory) and
its run-time forecasts (quadratic for eager baselines, from the previous size's fastest run). Fakes and fake clocks
on CPU: nothing is timed for real (peak memory's rule: test_harness.py)."""

from __future__ import annotations

import types

import pytest
import torch

import harness


def _fake_clock_and_run(durations):
    """A perf_counter that only run() advances, by each of `durations` in turn."""
    state = {"t": 100.0, "i": 0}

    def perf_counter():
        return state["t"]

    def run():
        state["t"] += durations[state["i"]]
        state["i"] += 1

    return perf_counter, run


def test_time_cpu_reports_the_median_not_the_mean(monkeypatch):
    perf_counter, run = _fake_clock_and_run([0.001, 0.001, 0.010])
    monkeypatch.setattr(harness, "time", types.SimpleNamespace(perf_counter=perf_counter))
    timing = harness.time_cpu(run, repeats=3, time_per_case=3600.0)
    assert timing.times_s == pytest.approx([0.001, 0.001, 0.010])
    assert timing.median_s == pytest.approx(0.001)  # one slow run (another job) does not move it
    assert timing.min_s == pytest.approx(0.001)


def test_limits_count_read_plus_write_and_2n3_flops_of_the_fastest_run_at_the_best_size(monkeypatch):
    """copy: bytes read + written (2x) over the fastest run; matmul: 2 n^3 over the fastest run, the best of
    the sizes, float64 at half the size."""
    timed = []

    def fake_time_run(device, run):
        timed.append(device)
        return harness.Timing(median_s=2.0, min_s=1.0, times_s=[1.0, 2.0, 3.0], method="fake")

    monkeypatch.setattr(harness, "time_run", fake_time_run)
    monkeypatch.setitem(harness.MATMUL_SIZES, "cpu", (8, 16))
    limits = harness.measure_limits("cpu", ["float32", "float64"], copy_bytes=2**20)
    assert limits["copy_GBps"] == pytest.approx(2 * 2**20 / 1.0 / 1e9)
    assert limits["matmul_float32_TFLOPs"] == pytest.approx(2 * 16**3 / 1.0 / 1e12)  # the larger size's rate
    assert limits["matmul_float64_TFLOPs"] == pytest.approx(2 * 8**3 / 1.0 / 1e12)  # float64 at half the size
    assert len(timed) == 1 + 2 * 2


def test_executed_flops_with_prefixes_and_of_the_fused_lse():
    m, mc, d, dims = 4, 6, 64, (16, 32, 64)
    # Triton's fused prefix kernels: 6 m mc d for the tiles plus 4 m mc sum(d_i) for the prefix gradients.
    assert harness.similarity_flops_executed("triton-fused", m, mc, d, dims) == m * mc * (6 * d + 4 * sum(dims))
    # torch (GPU) and the dense dims scheme recompute the tiles in backward: 2 + 2 + 4 at one width.
    assert harness.similarity_flops_executed("torch", m, mc, d, dims) == 8 * m * mc * d
    assert harness.similarity_flops_executed("triton-dense", m, mc, d, dims) == 8 * m * mc * d
    assert harness.similarity_flops_executed("torch", m, mc, d) == 6 * m * mc * d
    # similarity_lse's fused kernels run once per prefix: 10 m mc sum(d_i).
    assert harness.similarity_lse_flops_executed("triton-fused", m, mc, d, dims) == 10 * m * mc * sum(dims)
    assert harness.similarity_lse_flops_executed("triton-fused", m, mc, d) == 10 * m * mc * d


# ---- bench/loss_sweep.py (the sweep bench_losses.py runs) ----


def test_ratio_cell_is_baseline_over_ours():
    import loss_sweep

    ours = {"status": "ok", "time_s": 0.01, "extra_bytes": 2e6}
    base = {"status": "ok", "time_s": 0.03, "extra_bytes": 8e6}
    assert loss_sweep.ratio_cell(base, ours) == "3x, 4x"  # above 1: ours is faster / smaller
    assert loss_sweep.ratio_cell(base, {**ours, "status": "OOM"}) == "—"


def test_max_ref_gb_skips_baselines_only(monkeypatch):
    import bench_losses
    import loss_sweep

    args = bench_losses.parse_args(["--losses", "cosine", "--device", "cpu", "--max-ref-gb", "1e-9"])
    monkeypatch.setattr(loss_sweep.harness, "free_bytes", lambda device: None)
    monkeypatch.setattr(loss_sweep.harness, "call_in_fork", lambda *a, **k: (
        "ok", {"median_s": 0.02, "min_s": 0.01, "times_s": [0.01, 0.02, 0.03], "extra_bytes": 0}))
    loss = bench_losses.LOSSES["cosine"]
    ours = types.SimpleNamespace(family="ours")
    reference = types.SimpleNamespace(family="reference")
    row = loss_sweep.run_one(args, ours, loss, 16, 8, torch.float32, None, {})
    assert row["status"] == "ok" and row["time_s"] == 0.02  # measured, the median
    row = loss_sweep.run_one(args, reference, loss, 16, 8, torch.float32, None, {})
    assert row["status"] == "skipped" and "--max-ref-gb" in row["note"]  # an estimate, never shown as measured


def test_forecast_is_quadratic_for_an_eager_baseline_of_a_linear_loss():
    import loss_sweep

    loss = types.SimpleNamespace(grows="N", bytes_per_element={"eager": 12.0})
    assert loss_sweep.predicted_run_seconds((1000, 1.0), loss, "eager", 2000) == pytest.approx(4.0)
    assert loss_sweep.predicted_run_seconds((1000, 1.0), loss, "ours", 2000) == pytest.approx(2.0)
    assert loss_sweep.predicted_run_seconds((1000, 0.01), loss, "eager", 2000) is None


def test_a_case_estimated_above_80_percent_of_free_memory_is_skipped(monkeypatch):
    import bench_losses
    import loss_sweep

    args = bench_losses.parse_args(["--losses", "cosine", "--device", "cpu"])
    loss = bench_losses.LOSSES["cosine"]
    ours = types.SimpleNamespace(family="ours")
    estimate = loss_sweep.estimate_extra_bytes(ours, loss, 16, 8, torch.float32)
    monkeypatch.setattr(loss_sweep.harness, "free_bytes", lambda device: int(estimate / 0.9))
    monkeypatch.setattr(loss_sweep.harness, "call_in_fork", lambda *a, **k: pytest.fail("must not run"))
    row = loss_sweep.run_one(args, ours, loss, 16, 8, torch.float32, None, {})
    assert row["status"] == "skipped" and "free" in row["note"]


def test_the_sweep_forecasts_from_the_min_time_of_the_previous_size(monkeypatch):
    import bench_losses
    import loss_sweep
    import providers as P

    args = bench_losses.parse_args(["--losses", "cosine", "--n", "16,32", "--d", "8", "--providers", "ours",
                                    "--device", "cpu", "--no-plot", "--repeats", "2"])
    provider = P.Provider("ours-torch", "ours", "torch", {"cosine": bench_losses.LOSSES["cosine"]})
    seen, measured = [], []

    def fake_run_one(args, provider, loss, n, d, dtype, previous, limits, deadline=None, budget=None,
                     repeats=None, measured_s=None):
        seen.append(previous)
        measured.append(measured_s)
        return {"status": "ok", "median_s": 0.5, "min_s": 0.1 + len(seen) / 100, "time_s": 0.5, "extra_bytes": 0,
                "floor": loss.work_floor(n, d, dtype)}

    monkeypatch.setattr(loss_sweep, "run_one", fake_run_one)
    monkeypatch.setattr(loss_sweep, "progress_line", lambda row: "")
    loss_sweep.sweep(args, [bench_losses.LOSSES["cosine"]], [provider], {})
    assert seen == [None, None, (16, 0.11), (16, 0.11)]  # each size's two rounds
    # a size's later rounds are forecast, for a time budget, from its own rounds before them
    assert measured == [None, 0.11, None, 0.13]



def test_the_executed_flops_of_each_scheme_at_one_width():
    """The achieved FLOP rates of the GPU sweeps divide by these: a wrong count misstates every fraction of the
    matmul rate the README reports for that scheme."""
    m, mc, d = 4, 6, 64
    assert harness.similarity_flops_executed("triton-fused", m, mc, d) == 10 * m * mc * d
    assert harness.similarity_flops_executed("cuda-fused", m, mc, d) == 8 * m * mc * d
    assert harness.similarity_flops_executed("triton-dense", m, mc, d) == 6 * m * mc * d
    assert harness.similarity_lse_flops_executed("torch", m, mc, d, (16, 64)) == 8 * m * mc * d



def test_a_plain_run_is_timed_after_one_warm_up_run(monkeypatch):
    """The hardware limits are timed this way: without the warm-up, the first run's one-time costs would count."""
    ran, seen = [], {}

    def fake_time_cpu(run, repeats=5, time_per_case=3.0, min_runs=3):
        seen["runs_before_timing"] = len(ran)
        return harness.Timing(median_s=1.0, min_s=1.0, times_s=[1.0], method="fake")

    monkeypatch.setattr(harness, "time_cpu", fake_time_cpu)
    harness.time_run("cpu", lambda: ran.append(1))
    assert seen == {"runs_before_timing": 1}



def test_a_sweep_budget_splits_its_time_and_ends_by_the_sweeps_end(monkeypatch):
    """The warm-up gets its allowance and the timed runs the rest; both end when the sweep's seconds are spent, and
    a block that raises is charged too (else a failing case would cost nothing and the sweep overrun)."""
    clock = {"now": 1000.0}
    monkeypatch.setattr(harness, "time", types.SimpleNamespace(monotonic=lambda: clock["now"],
                                                               perf_counter=lambda: clock["now"]))
    budget = harness.SweepBudget(10.0, warm_up_s=4.0)
    assert budget.allowed == {"warm_up": 4.0, "timed": 6.0}
    assert harness.SweepBudget(3.0, warm_up_s=4.0).allowed == {"warm_up": 3.0, "timed": 0.0}
    with pytest.raises(RuntimeError), harness.charging(budget, "timed"):
        clock["now"] += 5.0
        raise RuntimeError("a case that failed")
    assert budget.left("timed") == pytest.approx(1.0) and budget.fits("timed", 1.0) and not budget.fits("timed", 1.5)
    assert budget.summary() == {"warm_up": {"allowed_s": 4.0, "spent_s": 0.0, "cases": 0},
                                "timed": {"allowed_s": 6.0, "spent_s": 5.0, "cases": 1}}
    clock["now"] += 4.0  # 9 s into a 10 s sweep: 1 s left, whatever the warm-up's allowance still holds
    assert budget.left("warm_up") == pytest.approx(1.0)



def test_the_warm_up_takes_at_most_its_share_of_what_is_left():
    assert harness.warm_up_within(10.0, 9.0) == pytest.approx(9.0 * harness.MAX_WARM_UP_SHARE)
    assert harness.warm_up_within(1.0, 9.0) == 1.0 and harness.warm_up_within(5.0, -1.0) == 0.0



def test_ratio_cells_show_three_digits_and_no_memory_ratio_below_a_megabyte():
    """A ratio of 1.234 must read 1.23x; a memory ratio over a pass that moved RSS by less than a page-noise MB
    says nothing and reads "—"; a negative RSS rise reads as +0."""
    import loss_sweep

    ours = {"status": "ok", "time_s": 0.01, "extra_bytes": 0.5e6}
    base = {"status": "ok", "time_s": 0.01234, "extra_bytes": 8e6}
    assert loss_sweep.ratio_cell(base, ours) == "1.23x, —"
    assert loss_sweep.cell({**ours, "extra_bytes": -3e5}) == "10 ms, +0.0 MB"



def test_the_table_divides_each_baseline_by_ours_and_states_our_fraction_of_the_limit():
    """The table the README copies: a baseline three times slower reads 3x in its ratio column (not 0.333x), our
    cell shows the achieved rate with its fraction of the measured limit, and the header sums the first calls."""
    import bench_losses
    import loss_sweep

    args = bench_losses.parse_args(["--losses", "cosine", "--n", "16", "--d", "8", "--device", "cpu"])
    common = {"loss": "cosine", "n": 16, "d": 8, "dtype": "float32"}
    results = [{**common, "provider": "ours-torch", "status": "ok", "time_s": 0.01, "extra_bytes": 2e6,
                "rate": 2e9, "rate_unit": "B/s", "rate_fraction": 0.25, "cold_s": 1.5},
               {**common, "provider": "angle-emb", "status": "ok", "time_s": 0.03, "extra_bytes": 8e6,
                "rate": 1e9, "rate_unit": "B/s", "rate_fraction": 0.125, "cold_s": 0.5}]
    env = {"date": "now", "command": "test", "torch": torch.__version__, "threads": 2, "cpu": "test",
           "logical_cpus": 4, "load_average_1min": {"start": 5.0, "end": 1.0}}
    table = loss_sweep.render_markdown(results, env, args, [bench_losses.LOSSES["cosine"]], {}, {}, {},
                                       ["ours-torch", "angle-emb"], "ours-torch")
    assert "| 16 | 10 ms, +2.0 MB | 30 ms, +8.0 MB | 3x, 4x | 2 GB/s (25 %) |" in table
    # which limit the % is of, in the column's header and a line of the table's header (it said neither)
    assert "| angle-emb ÷ ours-torch | ours-torch achieved (% of limit) |" in table
    assert "no % in brackets: no limit was measured" in table
    copy_only = loss_sweep.render_markdown(results, env, args, [bench_losses.LOSSES["cosine"]], {"copy_GBps": 8.0},
                                           {}, {}, ["ours-torch", "angle-emb"], "ours-torch")
    assert "the % in brackets is of the copy bandwidth above for GB/s\n" in copy_only  # no matmul rate was measured
    both = loss_sweep.render_markdown(results, env, args, [bench_losses.LOSSES["cosine"]],
                                      {"copy_GBps": 8.0, "matmul_float32_TFLOPs": 1.0}, {}, {},
                                      ["ours-torch", "angle-emb"], "ours-torch")
    assert ("the % in brackets is of the copy bandwidth above for GB/s, of the float32 matmul rate above for "
            "FLOP/s\n") in both
    assert "2 cases, 2.0 s in all, the longest 1.5 s" in table
    assert "other jobs shared the machine" in table  # the load exceeded the CPUs at the start of the sweep



def test_the_time_a_row_reports_is_the_stat_asked_for_median_by_default(monkeypatch):
    """--stat min makes the table, the ratios and the rate use each case's fastest run; without it, the median."""
    import bench_losses
    import loss_sweep

    monkeypatch.setattr(loss_sweep.harness, "free_bytes", lambda device: None)
    monkeypatch.setattr(loss_sweep.harness, "call_in_fork", lambda *a, **k: (
        "ok", {"median_s": 0.02, "min_s": 0.01, "times_s": [0.01, 0.02, 0.03], "extra_bytes": 0}))
    loss = bench_losses.LOSSES["cosine"]
    ours = types.SimpleNamespace(family="ours")
    for argv, expected in (([], 0.02), (["--stat", "min"], 0.01)):
        args = bench_losses.parse_args(["--losses", "cosine", "--device", "cpu", *argv])
        row = loss_sweep.run_one(args, ours, loss, 16, 8, torch.float32, None, {})
        assert row["time_s"] == expected and row["rate"] == pytest.approx(row["floor"]["amount"] / expected)



def test_a_size_forecast_too_long_is_skipped_before_it_runs(monkeypatch):
    """From the previous size's 1 s, cosine (linear) at twice the size is forecast 2 s: past --max-run-seconds 1 it
    is skipped, and so is a case whose process (its warm-up pass, its 5 timed runs and a margin) would overrun what
    --time-budget has left."""
    import bench_losses
    import loss_sweep

    monkeypatch.setattr(loss_sweep.harness, "free_bytes", lambda device: None)
    monkeypatch.setattr(loss_sweep.harness, "call_in_fork", lambda *a, **k: pytest.fail("must not run"))
    loss = bench_losses.LOSSES["cosine"]
    ours = types.SimpleNamespace(family="ours")
    args = bench_losses.parse_args(["--losses", "cosine", "--device", "cpu", "--max-run-seconds", "1"])
    row = loss_sweep.run_one(args, ours, loss, 16, 8, torch.float32, (8, 1.0), {})
    assert row["status"] == "skipped" and "--max-run-seconds" in row["note"]
    args = bench_losses.parse_args(["--losses", "cosine", "--device", "cpu", "--time-budget", "10"])
    row = loss_sweep.run_one(args, ours, loss, 16, 8, torch.float32, (8, 1.0), {},
                             deadline=loss_sweep.time.perf_counter() + 10.0)
    assert row["status"] == "skipped" and "--time-budget" in row["note"]



def test_a_cpu_round_needs_time_for_its_own_two_runs_and_a_cuda_case_for_a_dozen(monkeypatch):
    """Forecast at 2 s a run, a CPU round (a fresh process: its warm-up pass and one timed run) starts while what
    --time-budget has left holds those two runs, one more (CPU_MARGIN_RUNS) and CPU_PROCESS_S: 6.5 s. It was held to
    a CUDA case's dozen runs (harness.RUNS_PER_CASE, 24 s), so the last rounds were skipped with time left. A CUDA
    case (the GPU suite's) still needs its dozen."""
    import bench_losses
    import loss_sweep

    monkeypatch.setattr(loss_sweep.harness, "free_bytes", lambda device: None)
    forked = []
    monkeypatch.setattr(loss_sweep.harness, "call_in_fork", lambda *a, **k: (forked.append(1), (
        "ok", {"median_s": 2.0, "min_s": 2.0, "times_s": [2.0], "extra_bytes": 0}))[1])
    loss = bench_losses.LOSSES["cosine"]
    ours = types.SimpleNamespace(family="ours")
    args = bench_losses.parse_args(["--losses", "cosine", "--device", "cpu", "--time-budget", "60"])

    def one_round(left, repeats=1):
        return loss_sweep.run_one(args, ours, loss, 16, 8, torch.float32, (8, 1.0), {},
                                  deadline=loss_sweep.time.perf_counter() + left, repeats=repeats)

    assert one_round(10.0)["status"] == "ok" and forked == [1]
    row = one_round(6.0)
    assert row["status"] == "skipped" and "--time-budget" in row["note"] and forked == [1]
    assert one_round(10.0, repeats=5)["status"] == "skipped"  # a process of 5 timed runs needs 14.5 s
    assert loss_sweep.seconds_to_expect(args, 2.0, 1) == pytest.approx(6 + loss_sweep.CPU_PROCESS_S)

    args.device = "cuda"
    monkeypatch.setattr(loss_sweep, "measure_in_process", lambda *a, **k: {
        "median_s": 2.0, "min_s": 2.0, "times_s": [], "extra_bytes": 0})
    assert one_round(20.0)["status"] == "skipped"
    assert one_round(30.0)["status"] == "ok" and forked == [1]


def test_probes_double_the_size_until_a_run_is_long_enough_to_scale_from():
    """Where nothing forecasts a case, runs at 8, 16, ... pairs, up to half the case's size, until one takes
    FORECAST_MIN_S (50 ms), scaled to the case's size: from a run of 82.9 ms at 8,192 pairs, 663 ms at 65,536 (the
    run's 1 ms of overheads scaled with it: the forecast errs high). No probe runs whose own forecast does not fit.
    The first probe runs twice and its first run is not used: one-off costs of a process's first call (1 s here)
    scaled by (n / m)^power would forecast 8,192 times that."""
    import loss_sweep

    def linear(m):
        sizes.append(m)
        return 0.001 + 1e-5 * m + (1.0 if len(sizes) == 1 else 0.0)

    sizes = []
    assert loss_sweep.probed_run_seconds(linear, 65536, 1, fits=lambda s: True) == pytest.approx(0.08292 * 8)
    assert sizes == [8] + [8 * 2 ** k for k in range(11)] and loss_sweep.PROBE_N == 8
    sizes = []  # quadratic and short: up to half the size, scaled by 4
    assert loss_sweep.probed_run_seconds(linear, 64, 2, fits=lambda s: True) == pytest.approx(4 * (0.001 + 32e-5))
    assert sizes == [8, 8, 16, 32]
    sizes, asked = [], []  # the probe at 16 would take 2 x 1.08 ms: it does not fit, so neither does the case
    assert loss_sweep.probed_run_seconds(linear, 65536, 1, fits=lambda s: asked.append(s) or s < 0.002) is None
    assert sizes == [8, 8] and asked == [pytest.approx(2 * 0.00108)]
    sizes = []
    assert loss_sweep.probed_run_seconds(linear, 3, 1, fits=lambda s: True) == pytest.approx(3 * 0.00101)
    assert sizes == [1, 1]


def _forks_on_a_clock(monkeypatch, probe, run_s):
    """harness.call_in_fork and loss_sweep's clock faked: a probe process (probe_cpu_case) returns `probe` after
    0.5 s, a measuring one a run of `run_s` after 2 runs (its warm-up pass and timed run); the calls are listed."""
    import loss_sweep

    clock, calls = {"now": 100.0}, []

    def call_in_fork(fn, *args, **kwargs):
        calls.append(fn.__name__)
        if fn.__name__ == "probe_cpu_case":
            clock["now"] += 0.5
            return probe
        clock["now"] += 2 * run_s
        return "ok", {"median_s": run_s, "min_s": run_s, "times_s": [run_s], "extra_bytes": 0}

    monkeypatch.setattr(loss_sweep.harness, "free_bytes", lambda device: None)
    monkeypatch.setattr(loss_sweep.harness, "call_in_fork", call_in_fork)
    monkeypatch.setattr(loss_sweep, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    return clock, calls


def test_a_cpu_case_that_nothing_forecasts_runs_within_the_time_budget_only_if_its_probes_say_it_fits(monkeypatch):
    """A case's first size had no forecast, so its first round started whatever it cost while any of --time-budget
    was left (in-batch negatives at 4,096 pairs, D = 768: 13 s past a 16 s budget). It now starts only if what is
    left holds a round forecast by a process of probes (probe_cpu_case, apart from the measured one: their
    allocations would move its peak memory): forecast at 2 s, 6.5 s. A probe that fails forecasts nothing and the case
    runs (its row says why it fails); the previous size's run, scaled, spares the probes where it fits."""
    import bench_losses
    import loss_sweep

    loss, ours = bench_losses.LOSSES["cosine"], types.SimpleNamespace(family="ours")
    args = bench_losses.parse_args(["--losses", "cosine", "--device", "cpu", "--time-budget", "60"])

    def one_round(left, previous=None):
        return loss_sweep.run_one(args, ours, loss, 16, 8, torch.float32, previous, {},
                                  deadline=loss_sweep.time.perf_counter() + left, repeats=1)

    clock, calls = _forks_on_a_clock(monkeypatch, ("ok", 2.0), run_s=2.0)
    assert one_round(7.0)["status"] == "ok" and calls == ["probe_cpu_case", "measure_cpu_case"]
    calls.clear()
    row = one_round(6.9)  # 6.4 s left once the probes are done
    assert row["status"] == "skipped" and "--time-budget" in row["note"] and row["forecast_s"] == 2.0
    assert calls == ["probe_cpu_case"]
    clock, calls = _forks_on_a_clock(monkeypatch, ("ok", None), run_s=2.0)  # a probe would not have fitted
    assert one_round(100.0)["status"] == "skipped" and calls == ["probe_cpu_case"]
    clock, calls = _forks_on_a_clock(monkeypatch, ("oom", "OOM: ...", ""), run_s=2.0)
    assert one_round(100.0)["status"] == "ok" and calls == ["probe_cpu_case", "measure_cpu_case"]
    calls.clear()
    # 10 ms at 8 pairs, too short to extrapolate from, scales to 20 ms at 16: a round needs 0.56 s
    assert one_round(1.0, previous=(8, 0.01))["status"] == "ok" and calls == ["measure_cpu_case"]
    calls.clear()
    assert one_round(0.5, previous=(8, 0.01))["status"] == "ok" and calls == ["probe_cpu_case", "measure_cpu_case"]


def test_probes_that_outlast_the_time_budget_skip_the_case(monkeypatch):
    """The probes' process waited --case-timeout (600 s by default) whatever was left of --time-budget, and probes
    still running then (stuck, or far slower than their sizes' growth) forecast nothing, so the case ran after them,
    up to --case-timeout more. Their wait now ends with the budget, and probes that outlast it skip the case, which is
    larger than any of them; with more time left than --case-timeout, a probe's timeout still lets the case run."""
    import bench_losses
    import loss_sweep

    loss, ours = bench_losses.LOSSES["cosine"], types.SimpleNamespace(family="ours")
    args = bench_losses.parse_args(["--losses", "cosine", "--device", "cpu", "--time-budget", "60",
                                    "--case-timeout", "30"])
    clock, calls = _forks_on_a_clock(monkeypatch, ("timeout", "killed after 7 s"), run_s=2.0)
    faked, timeouts = loss_sweep.harness.call_in_fork, []

    def call_in_fork(fn, *a, timeout, **k):
        timeouts.append(timeout)
        return faked(fn, *a, **k)

    monkeypatch.setattr(loss_sweep.harness, "call_in_fork", call_in_fork)

    def one_round(left):
        return loss_sweep.run_one(args, ours, loss, 16, 8, torch.float32, None, {},
                                  deadline=loss_sweep.time.perf_counter() + left, repeats=1)

    row = one_round(7.0)
    assert row["status"] == "skipped" and "--time-budget" in row["note"] and row["forecast_s"] is None
    assert calls == ["probe_cpu_case"] and timeouts == [7.0]
    calls.clear(), timeouts.clear()
    assert one_round(100.0)["status"] == "ok" and calls == ["probe_cpu_case", "measure_cpu_case"]
    assert timeouts == [30.0, 30.0]


def test_a_first_size_s_later_rounds_are_forecast_from_its_first(monkeypatch):
    """With 8 s of --time-budget left, a case's first round (probed at 2 s) runs and takes 4 s: its second round,
    forecast from its own first, needs 6.5 s and does not start. Without a forecast it started while any time was
    left: 4 rounds, ending 0.5 s past the budget."""
    import bench_losses
    import loss_sweep
    import providers as P

    loss = bench_losses.LOSSES["cosine"]
    args = bench_losses.parse_args(["--losses", "cosine", "--n", "16", "--d", "8", "--providers", "ours",
                                    "--device", "cpu", "--no-plot", "--time-budget", "8"])
    provider = P.Provider("ours-torch", "ours", "torch", {"cosine": loss})
    clock, calls = _forks_on_a_clock(monkeypatch, ("ok", 2.0), run_s=2.0)
    monkeypatch.setattr(loss_sweep, "progress_line", lambda row: "")
    [row] = loss_sweep.sweep(args, [loss], [provider], {}, deadline=clock["now"] + 8.0)
    assert row["status"] == "ok" and row["rounds"] == 1 and calls == ["probe_cpu_case", "measure_cpu_case"]
    assert clock["now"] <= 100.0 + 8.0


def test_probes_forecast_a_run_in_a_process_of_their_own():
    """probe_cpu_case computes a forecast of the case's run (ours, cosine at 64 pairs) in a forked child."""
    import bench_losses
    import loss_sweep
    import providers as P

    loss = bench_losses.LOSSES["cosine"]
    ours = P.Provider("ours-torch", "ours", "torch", {"cosine": loss})
    status, forecast = harness.call_in_fork(loss_sweep.probe_cpu_case, ours, loss, 64, 8, torch.float32, 1, 0,
                                            loss_sweep.time.perf_counter() + 600, timeout=120)
    assert status == "ok" and forecast > 0


def test_a_killed_child_is_out_of_memory_and_a_timeout_an_error(monkeypatch):
    import bench_losses
    import loss_sweep

    args = bench_losses.parse_args(["--losses", "cosine", "--device", "cpu"])
    loss = bench_losses.LOSSES["cosine"]
    ours = types.SimpleNamespace(family="ours")
    monkeypatch.setattr(loss_sweep.harness, "free_bytes", lambda device: None)
    for payload, status in ((("killed", "killed by SIGKILL"), "OOM"), (("timeout", "killed after 600 s"), "error")):
        monkeypatch.setattr(loss_sweep.harness, "call_in_fork", lambda *a, payload=payload, **k: payload)
        row = loss_sweep.run_one(args, ours, loss, 16, 8, torch.float32, None, {})
        assert row["status"] == status, payload
    assert row["note"].endswith("(--case-timeout)")



def test_a_cpu_case_may_take_three_times_its_estimate_or_2_gb_within_free_memory(monkeypatch):
    """The child's address-space cap: three times the estimate, never below 2 GB (a tiny case's estimate would
    starve it), never above 80 % of what is free."""
    import bench_losses
    import loss_sweep

    args = bench_losses.parse_args(["--losses", "cosine", "--device", "cpu"])
    loss = bench_losses.LOSSES["cosine"]
    ours = types.SimpleNamespace(family="ours")
    headrooms = []
    monkeypatch.setattr(loss_sweep.harness, "call_in_fork", lambda fn, *a, **k: (headrooms.append(a[-1]), (
        "ok", {"median_s": 0.02, "min_s": 0.01, "times_s": [0.01], "extra_bytes": 0}))[1])
    for free in (100 * 2**30, 2**30):
        monkeypatch.setattr(loss_sweep.harness, "free_bytes", lambda device, free=free: free)
        loss_sweep.run_one(args, ours, loss, 16, 8, torch.float32, None, {})
    assert headrooms == [2 * harness.GB, int(0.8 * 2**30)]



def test_sweep_options_sort_sizes_refuse_unknown_dtypes_and_estimate_16_bit_as_float32():
    import bench_losses
    import loss_sweep

    args = bench_losses.parse_args(["--losses", "cosine", "--n", "64,16", "--device", "cpu"])
    assert loss_sweep.sizes_of(args, bench_losses.LOSSES["cosine"]) == [16, 64]
    with pytest.raises(SystemExit):
        bench_losses.parse_args(["--losses", "cosine", "--dtypes", "float8", "--device", "cpu"])
    ours = types.SimpleNamespace(family="ours")
    cosine = bench_losses.LOSSES["cosine"]
    assert (loss_sweep.estimate_extra_bytes(ours, cosine, 1024, 64, torch.bfloat16)
            == loss_sweep.estimate_extra_bytes(ours, cosine, 1024, 64, torch.float32))



def test_a_forecast_is_made_from_a_previous_run_of_50_ms_or_more():
    import loss_sweep

    loss = types.SimpleNamespace(grows="N", bytes_per_element={})
    assert loss_sweep.predicted_run_seconds((1000, 0.1), loss, "ours", 2000) == pytest.approx(0.2)
    assert loss_sweep.predicted_run_seconds((1000, 0.04), loss, "ours", 2000) is None


def test_the_cpu_sweep_interleaves_the_providers_of_a_size_round_by_round(monkeypatch):
    """On a CPU each provider of a size runs one timed run per round in turn (every other round in reverse), up to
    --repeats rounds; its row gathers the rounds' runs (median, fastest, every run) and the median of their peak extra
    memory. A provider skipped in its first round gets no more; one that fails in a later round is that failure; once
    three rounds are done, one whose runs took more than --time-per-case seconds gets no more."""
    import bench_losses
    import loss_sweep
    import providers as P

    args = bench_losses.parse_args(["--losses", "cosine", "--n", "16", "--d", "8", "--device", "cpu", "--no-plot",
                                    "--repeats", "4", "--time-per-case", "2"])
    loss = bench_losses.LOSSES["cosine"]
    names = ("ours-torch", "angle-emb", "sentence-transformers", "slow")
    providers = [P.Provider(name, "ours" if name == "ours-torch" else "reference", None, {"cosine": loss})
                 for name in (*names, "failing")]
    times = {"ours-torch": [0.3, 0.1, 0.2, 0.4], "slow": [1.0, 1.0, 1.0, 1.0]}
    calls = []

    def fake_run_one(args, provider, loss, n, d, dtype, previous, limits, deadline=None, budget=None,
                     repeats=None, measured_s=None):
        calls.append((provider.name, repeats))
        turn = sum(name == provider.name for name, _ in calls) - 1
        if provider.name == "angle-emb":
            return {"status": "skipped", "note": "skipped: needs ~9 GB (> --max-ref-gb 2)"}
        if provider.name == "failing" and turn == 1:
            return {"status": "OOM", "note": "OOM: killed by SIGKILL"}
        seconds = times.get(provider.name, [0.01] * 4)[turn]
        return {"status": "ok", "median_s": seconds, "min_s": seconds, "times_s": [seconds],
                "extra_bytes": [100, 300, 200, 900][turn], "floor": loss.work_floor(n, d, dtype)}

    monkeypatch.setattr(loss_sweep, "run_one", fake_run_one)
    monkeypatch.setattr(loss_sweep, "progress_line", lambda row: "")
    rows = {row["provider"]: row for row in loss_sweep.sweep(args, [loss], providers, {})}
    assert {repeats for _, repeats in calls} == {1}  # one timed run in each round's process
    order = [name for name, _ in calls]
    assert order == [*names, "failing",  # the first round, in table order
                     "failing", "slow", "sentence-transformers", "ours-torch",  # the second, reversed, angle-emb out
                     "ours-torch", "sentence-transformers", "slow",  # the third, without the failure
                     "sentence-transformers", "ours-torch"]  # the fourth: slow's 3 s are past --time-per-case
    ours = rows["ours-torch"]
    assert ours["times_s"] == [0.3, 0.1, 0.2, 0.4] and ours["rounds"] == 4
    assert ours["median_s"] == pytest.approx(0.25) and ours["min_s"] == 0.1 and ours["time_s"] == ours["median_s"]
    assert ours["extra_bytes"] == 250 and ours["extra_bytes_rounds"] == [100, 300, 200, 900]
    assert rows["slow"]["rounds"] == 3 and rows["sentence-transformers"]["rounds"] == 4
    assert rows["angle-emb"]["status"] == "skipped" and "--max-ref-gb" in rows["angle-emb"]["note"]
    assert rows["failing"]["status"] == "OOM"


def test_a_case_whose_later_round_finds_the_time_budget_spent_keeps_its_measured_rounds():
    import bench_losses
    import loss_sweep

    args = bench_losses.parse_args(["--losses", "cosine", "--device", "cpu"])
    floor = bench_losses.LOSSES["cosine"].work_floor(16, 8, torch.float32)
    measured = {"status": "ok", "median_s": 0.2, "min_s": 0.2, "times_s": [0.2], "extra_bytes": 10, "floor": floor}
    spent = {"status": "skipped", "note": "skipped: --time-budget 10 s spent"}
    row = loss_sweep.merge_rounds(args, [measured, {**measured, "times_s": [0.4]}, spent], {}, torch.float32)
    assert row["status"] == "ok" and row["times_s"] == [0.2, 0.4] and row["rounds"] == 2
    assert loss_sweep.merge_rounds(args, [spent], {}, torch.float32) == spent


def test_time_cpu_and_the_cpu_sweeps_rounds_take_the_same_minimum_of_runs(monkeypatch, capsys):
    """harness.MIN_CPU_RUNS is the one minimum of runs before a time allowance may end them: time_cpu's
    (time_per_case), the CPU loss sweep's rounds (--time-per-case) and what --time-per-case's help says."""
    import bench_losses
    import loss_sweep

    calls = []
    harness.time_cpu(lambda: calls.append(1), repeats=50, time_per_case=0.0)
    assert len(calls) == harness.MIN_CPU_RUNS
    monkeypatch.setattr(harness, "MIN_CPU_RUNS", 7)  # the sweep reads it when it runs, not a copy of its own
    args = bench_losses.parse_args(["--losses", "cosine", "--device", "cpu", "--repeats", "50",
                                    "--time-per-case", "0"])
    measured = {"status": "ok", "median_s": 0.2, "min_s": 0.2, "times_s": [0.2]}
    assert loss_sweep.wants_another_round(args, [measured] * 6)
    assert not loss_sweep.wants_another_round(args, [measured] * 7)
    with pytest.raises(SystemExit):
        bench_losses.parse_args(["--help"])
    assert "once 7 are done" in " ".join(capsys.readouterr().out.split())
