"""The shared harness (harness.py), checked on CPU: timing rules, memory measurement, hardware limits, work
floors, forked children and report files. Nothing here asserts on wall time."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import angle_kernels
import harness

HERE = Path(__file__).resolve().parent


def test_time_cpu_stops_after_the_minimum_runs_once_its_time_is_spent():
    calls = []
    timing = harness.time_cpu(lambda: calls.append(1), repeats=50, time_per_case=0.0, min_runs=3)
    assert len(calls) == len(timing.times_s) == 3
    assert timing.min_s <= timing.median_s and timing.method == "wall clock"
    calls.clear()
    timing = harness.time_cpu(lambda: calls.append(1), repeats=7, time_per_case=3600.0)
    assert len(calls) == 7
    with pytest.raises(ValueError, match="repeats"):
        harness.time_cpu(lambda: None, repeats=0)


class FakeCudaMemory:
    """torch.cuda's four memory functions, over counters the tests' "losses" move; `allocated`: the bytes held before
    the run (its inputs)."""

    def __init__(self, allocated: int = 0):
        self.allocated = self.peak = allocated

    def synchronize(self):
        pass

    def reset_peak_memory_stats(self):
        self.peak = self.allocated

    def memory_allocated(self):
        return self.allocated

    def max_memory_allocated(self):
        return self.peak


def test_cuda_memory_is_measured_on_a_warm_run():
    """The first call at a shape compiles and autotunes (Triton's autotuner allocates do_bench's 256 MB
    L2-flush buffer): the reported peak must be that of a later run, not of the first."""

    memory = FakeCudaMemory()
    calls = []
    leaf = torch.zeros(3, requires_grad=True)

    def run():  # the first call holds 256 MB for a while (autotuning), every call 10 MB (the loss's workspace)
        transient = (256 if not calls else 0) * 2**20 + 10 * 2**20
        memory.peak = max(memory.peak, memory.allocated + transient)
        calls.append(1)
        return (leaf * 2).sum()

    value, extra, seconds = harness.cuda_warm_peak_extra_bytes(run, [leaf], memory)
    assert len(calls) == 2 and extra == 10 * 2**20 and seconds >= 0
    assert leaf.grad is not None and float(value.detach()) == 0.0


_CPU_MEASUREMENT = """
import torch
import harness

leaf = torch.ones(4, requires_grad=True)
grads_seen = []

def run():
    grads_seen.append(leaf.grad)
    held = torch.ones(16 * 2**20)  # 64 MB, written
    return (leaf * held[:4]).sum()

measured = harness.measure_fwd_bwd(run, [leaf], "cpu", repeats=3, time_per_case=60.0)
print(measured["extra_bytes"], len(measured["times_s"]), measured["loss_value"],
      all(grad is None for grad in grads_seen))
"""


def test_cpu_measurement_sees_what_a_pass_allocates():
    """The peak RSS of the pass over the RSS before it: a pass that holds 64 MB must show at least most of it
    and not much more (the process's whole RSS is not the pass's),
    and the gradients are reset between runs. Measured in a fresh process: RSS is a property of the whole
    process, and memory earlier tests freed (but malloc kept) would make the pass's pages look resident."""
    import subprocess

    # `python -c` puts its working directory first on the path: bench/, for `import harness`
    out = subprocess.run([sys.executable, "-c", _CPU_MEASUREMENT], cwd=HERE, capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    extra_bytes, runs, loss_value, grads_were_reset = int(out[0]), int(out[1]), float(out[2]), out[3]
    assert 48 * 2**20 <= extra_bytes < 128 * 2**20, out  # the pass's own memory, not the process's RSS
    assert runs == 3 and loss_value == 4.0
    assert grads_were_reset == "True"  # fwd_bwd resets them: nothing accumulates


_CPU_MEASUREMENT_AFTER_A_WARM_UP = """
import torch
import harness

leaf = torch.ones(8 * 2**20, requires_grad=True)  # its gradient: 32 MB
run = lambda: (leaf * 2).sum()
harness.fwd_bwd(run, [leaf])  # a caller's warm-up leaves the gradient allocated
print(harness.measure_fwd_bwd(run, [leaf], "cpu", repeats=0)["extra_bytes"])
"""


def test_cpu_measurement_counts_the_gradients_after_a_callers_warm_up():
    """A warm-up pass leaves each leaf's gradient allocated; read as memory already there, the measured pass (which
    frees it first and allocates a new one) showed no gradient at all (bench_matryoshka_ratios: every row short by
    its gradient's size). The leaves' gradients are dropped before the memory before the pass is read."""
    import subprocess

    out = subprocess.run([sys.executable, "-c", _CPU_MEASUREMENT_AFTER_A_WARM_UP], cwd=HERE, capture_output=True,
                         text=True, timeout=120, check=True).stdout.split()
    assert int(out[0]) >= 28 * 2**20, out


def test_a_forked_child_reports_results_errors_oom_and_timeouts():
    assert harness.call_in_fork(pow, 2, 10, timeout=60) == ("ok", 1024)
    status, message, _ = harness.call_in_fork(int, "not a number", timeout=60)
    assert status == "error" and message.startswith("ValueError")

    def exhaust():
        raise MemoryError("simulated")

    assert harness.call_in_fork(exhaust, timeout=60)[0] == "oom"
    assert harness.call_in_fork(time.sleep, 30, timeout=0.5)[0] == "timeout"


def test_out_of_memory_is_recognised_in_torchs_wordings():
    assert harness.is_oom(MemoryError())
    assert harness.is_oom(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1 GB"))
    assert harness.is_oom(RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not harness.is_oom(RuntimeError("shape mismatch"))


def test_limits_are_measured_and_looked_up_by_kind_and_dtype():
    limits = harness.measure_limits("cpu", ["float32", "float64"], copy_bytes=2**22, matmul_size=128)
    assert limits["copy_GBps"] > 0 and limits["matmul_float32_TFLOPs"] > 0 and limits["matmul_float64_TFLOPs"] > 0
    assert harness.limit_rate(limits, "bytes", "bfloat16") == limits["copy_GBps"] * 1e9
    assert harness.limit_rate(limits, "flops", "float64") == limits["matmul_float64_TFLOPs"] * 1e12
    assert harness.limit_rate(limits, "flops", "bfloat16") is None  # not measured: no fraction, not a wrong one
    assert harness.limit_rate({}, "bytes", "float32") is None
    text = harness.describe_limits(limits)
    assert "copy" in text and "float32 matmul" in text and "float64 matmul" in text


def test_achieved_rate_is_the_floor_over_the_time_as_a_fraction_of_the_limit():
    limits = {"copy_GBps": 100.0, "matmul_bfloat16_TFLOPs": 500.0}
    rate = harness.achieved_rate({"kind": "bytes", "amount": 50e9}, 1.0, limits, "float32")
    assert rate == {"rate": 50e9, "rate_unit": "B/s", "rate_fraction": 0.5}
    rate = harness.achieved_rate({"kind": "flops", "amount": 1e12}, 0.01, limits, "bfloat16")
    assert rate["rate_unit"] == "FLOP/s" and rate["rate_fraction"] == pytest.approx(0.2)
    assert harness.fmt_rate(rate["rate"], rate["rate_unit"], rate["rate_fraction"]) == "100 TFLOP/s (20 %)"
    assert harness.fmt_rate(2e9, "B/s", 0.0123) == "2 GB/s (1.2 %)"
    assert harness.fmt_rate(2e9, "B/s") == "2 GB/s"


def test_work_floors_follow_the_measuring_guide():
    """The work floors: pair scores read 2N x D twice and write it once; in-batch negatives over
    M = 2N rows need 6 M^2 D FLOPs; every backend executes at least that."""
    n, d = 1000, 768
    assert harness.pair_scores_floor(2 * n, d, torch.bfloat16) == {"kind": "bytes", "amount": 3 * 2 * n * d * 2}
    assert harness.similarity_floor(2 * n, 2 * n, d) == {"kind": "flops", "amount": 6 * (2 * n) ** 2 * d}
    assert harness.ranking_floor(n, torch.float32, torch.int64)["amount"] == n * (4 + 4 + 8)
    for backend in ("torch", "triton", "cuda"):
        assert harness.similarity_flops_executed(backend, 2 * n, 2 * n, d) >= 6 * (2 * n) ** 2 * d
        assert harness.similarity_flops_executed(backend, 2 * n, 2 * n, d, dims=(d // 2, d)) >= 6 * (2 * n) ** 2 * d


def test_the_executed_flops_are_the_products_the_torch_backend_launches():
    """similarity_lse (one width and dims) and similarity_xent (one width), forward + backward on the torch
    backend's blocked forms (the code its GPU calls run, which the sweeps time; similarity_xent's dims take its
    16-bit "mixed" Function there, which only a GPU runs): the matrix products they launch (torch's FLOP counter:
    mm, addmm, addmm_; its bmm are the rows' norms, batched GEMVs outside the formulas) are what harness's
    executed-FLOPs formulas say (similarity_lse with dims was counted per prefix, 2.25x the products at D = 768: the
    torch and cuda rows of similarity_lse(dims) reported 2.25x their fraction of the matmul rate)."""
    from angle_kernels.testing.helpers import flop_counter
    from angle_kernels.torch_ops import similarity_lse as blocked_lse, similarity_xent as blocked_xent

    aten = torch.ops.aten
    m, mc, d = 24, 48, 64
    generator = torch.Generator().manual_seed(0)
    q, c = torch.randn(m, d, generator=generator), torch.randn(mc, d, generator=generator)
    lse_weights = {dims: torch.randn(m if dims is None else (len(dims), m), generator=generator)
                   for dims in (None, (16, 32, 64))}

    def lse(dims):
        return lambda q, c: (blocked_lse.similarity_lse(q, c, 20.0, 0, m, "none", 2.0, "other", None, None, None,
                                                        False, True, dims) * lse_weights[dims]).sum()

    cases = [("similarity_lse", None, lse(None), harness.similarity_lse_flops_executed),
             ("similarity_lse", (16, 32, 64), lse((16, 32, 64)), harness.similarity_lse_flops_executed),
             ("similarity_xent", None, lambda q, c: blocked_xent.similarity_xent(q, c, 20.0, "diagonal"),
              harness.similarity_flops_executed)]
    for name, dims, call, formula in cases:
        leaves = [q.clone().requires_grad_(), c.clone().requires_grad_()]
        with flop_counter() as counter:
            call(*leaves).backward()
        counts = counter.get_flop_counts()["Global"]
        products = sum(counts.get(op, 0) for op in (aten.mm, aten.addmm, aten.addmm_))
        assert products == formula("torch", m, mc, d, dims), (name, dims)


def test_reports_are_replaced_in_one_step(tmp_path):
    path = tmp_path / "table.md"
    harness.write_text_atomic(path, "old\n")
    harness.write_json_atomic(tmp_path / "results.json", {"a": 1, "path": tmp_path})
    harness.write_text_atomic(path, "new\n")
    assert path.read_text() == "new\n" and '"a": 1' in (tmp_path / "results.json").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["results.json", "table.md"]  # no .tmp left behind


def test_a_report_whose_writer_fails_stays_as_it_was_with_nothing_beside_it(tmp_path):
    path = tmp_path / "plot.png"
    path.write_bytes(b"old")
    with pytest.raises(OSError, match="No space"):
        with harness.written_aside(path) as partial:
            partial.write_bytes(b"half a pn")
            raise OSError(28, "No space left on device")  # as a savefig that runs out of disk
    assert path.read_bytes() == b"old" and [p.name for p in tmp_path.iterdir()] == ["plot.png"]


def strict_json(text: str):
    """`text` read as a strict parser (jq, JavaScript's JSON.parse) reads it: NaN and Infinity are no JSON."""
    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=refuse)


def test_the_json_files_are_strict_with_null_for_a_number_that_is_not_finite(tmp_path):
    """json.dumps wrote NaN and Infinity (a NaN loss_value in results.json, an infinite difference), which strict
    parsers refuse: they are written as null, in lists and nested objects too."""
    payload = {"loss_value": math.nan, "rows": [{"max_rel_diff": math.inf}, -math.inf, 1.5], "path": tmp_path}
    harness.write_json_atomic(tmp_path / "results.json", payload)
    assert strict_json((tmp_path / "results.json").read_text()) == {
        "loss_value": None, "rows": [{"max_rel_diff": None}, None, 1.5], "path": str(tmp_path)}
    assert strict_json(harness.json_text(payload, indent=None)) == strict_json(harness.json_text(payload))


def test_the_environment_names_the_checkout_measured(tmp_path):
    """The tables recorded angle_kernels' version, the same across commits: the environment names the package's folder
    and its checkout's commit, with its uncommitted changes; a folder git tracks nothing of is "unknown"."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed")

    def git(*args):
        subprocess.run(["git", "-C", str(tmp_path), "-c", "user.name=bench", "-c", "user.email=bench@example.com",
                        *args], check=True, capture_output=True)

    package = tmp_path / "angle_kernels"
    package.mkdir()
    (package / "__init__.py").write_text("")
    assert harness.checkout_commit(package) == "unknown"  # not a git checkout (the temporary folder is in none)
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "first")
    head = subprocess.run(["git", "-C", str(tmp_path), "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True, check=True).stdout.strip()
    (tmp_path / "notes.txt").write_text("untracked: no change of the code")
    assert harness.checkout_commit(package) == head
    (package / "__init__.py").write_text("VALUE = 1\n")
    assert harness.checkout_commit(package) == f"{head} + uncommitted changes"
    (tmp_path / "venv").mkdir()  # an installed package in an untracked folder of a checkout is no part of it
    assert harness.checkout_commit(tmp_path / "venv") == "unknown"
    env = harness.describe_environment("cpu")
    assert env["angle_kernels_path"] == str(Path(angle_kernels.__file__).parent)
    assert env["angle_kernels_commit"] == harness.checkout_commit(Path(angle_kernels.__file__).parent)


def test_the_environment_names_versions_without_importing_what_the_run_did_not(monkeypatch):
    """sentence-transformers' version comes from its installed metadata where the run never imported it (its
    import, transformers' and peft's with it, took seconds of every sweep, which named nothing more than its
    version); a module imported already gives its own, and one whose import is blocked (None in sys.modules) none."""
    import importlib
    import importlib.metadata

    imported = []
    import_module = importlib.import_module

    def refusing(name, *args, **kwargs):
        imported.append(name)
        if name == "sentence_transformers":
            raise ImportError("imported to name a version")
        return import_module(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "sentence_transformers", raising=False)
    monkeypatch.setattr(importlib, "import_module", refusing)
    env = harness.describe_environment("cpu")
    assert "sentence_transformers" not in imported, imported
    assert env["sentence_transformers"] == importlib.metadata.version("sentence-transformers")
    assert env["torch"] == torch.__version__ and env["angle_kernels"] == angle_kernels.__version__
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)
    assert harness.installed_version("sentence_transformers", "sentence-transformers") is None
    assert harness.installed_version("torch", "no-such-distribution") == torch.__version__
    assert harness.installed_version("no_such_module", "no-such-distribution") is None


def test_markdown_table_keeps_its_columns():
    lines = harness.markdown_table(["N", "ours"], [[16, "error: a | b"], [32, "1 ms"]])
    assert lines == ["| N | ours |", "|---|---|", "| 16 | error: a / b |", "| 32 | 1 ms |"]


def test_cuda_peak_extra_is_above_what_was_allocated_before_the_run():
    """Inputs already allocated (memory_allocated() > 0 before the pass) are not the loss's extra memory."""
    memory = FakeCudaMemory(allocated=50 * 2**20)  # the inputs
    leaf = torch.zeros(3, requires_grad=True)

    def run():
        memory.peak = max(memory.peak, memory.allocated + 10 * 2**20)
        return (leaf * 2).sum()

    _, extra, _ = harness.cuda_warm_peak_extra_bytes(run, [leaf], memory)
    assert extra == 10 * 2**20



def test_the_sizes_and_times_in_reports_are_written_in_readable_units():
    """A table cell of 25 MB read "25.0 MB" or "0.025 GB", or half a second "0.5 s", if these formats broke."""
    assert [harness.fmt_bytes(b) for b in (5e9, 25e6, 2.5e6)] == ["5.0 GB", "25 MB", "2.5 MB"]
    assert [harness.fmt_seconds(s) for s in (0.0123, 0.5, 2.5)] == ["12.3 ms", "500 ms", "2.5 s"]
    assert harness.fmt_rate(5e11, "FLOP/s") == "500 GFLOP/s" and harness.fmt_rate(2e12, "FLOP/s") == "2 TFLOP/s"



def test_a_child_killed_by_a_signal_or_exiting_without_a_result_is_reported_killed():
    """The kernel's OOM killer sends SIGKILL: the sweep then records the case as out of memory, not as an error."""
    import os
    import signal

    status, message = harness.call_in_fork(lambda: os.kill(os.getpid(), signal.SIGKILL), timeout=60)
    assert status == "killed" and "SIGKILL" in message
    assert harness.call_in_fork(lambda: os._exit(3), timeout=60) == (
        "killed", "child exited with code 3 without a result")



def test_a_measurement_reports_the_median_and_the_fastest_of_its_timed_runs(monkeypatch):
    """measure_fwd_bwd passes on time_cpu's median and min as they are: the sweep's --stat picks one of them."""
    monkeypatch.setattr(harness, "time_cpu", lambda run, repeats, time_per_case: harness.Timing(
        median_s=2.0, min_s=1.0, times_s=[1.0, 2.0, 3.0], method="wall clock"))
    leaf = torch.ones(4, requires_grad=True)
    measured = harness.measure_fwd_bwd(lambda: (leaf * 2).sum(), [leaf], "cpu", repeats=3)
    assert (measured["median_s"], measured["min_s"], measured["times_s"]) == (2.0, 1.0, [1.0, 2.0, 3.0])
