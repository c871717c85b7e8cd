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
                                    "--device", "cpu", "--no-plot"])
    provider = P.Provider("ours-torch", "ours", "torch", {"cosine": bench_losses.LOSSES["cosine"]})
    seen = []

    def fake_run_one(args, provider, loss, n, d, dtype, previous, limits, deadline=None, budget=None):
        seen.append(previous)
        return {"status": "ok", "median_s": 0.5, "min_s": 0.1, "time_s": 0.5, "extra_bytes": 0}

    monkeypatch.setattr(loss_sweep, "run_one", fake_run_one)
    monkeypatch.setattr(loss_sweep, "progress_line", lambda row: "")
    loss_sweep.sweep(args, [bench_losses.LOSSES["cosine"]], [provider], {})
    assert seen == [None, (16, 0.1)]
