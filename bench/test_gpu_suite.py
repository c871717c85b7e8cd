"""The staged GPU run's machinery, checked on CPU: the dry run, budgets, logs that survive a kill, records
written after every step, the summary. (What the stages measure needs a GPU: scripts/gpu_check.sh.)"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import gpu_suite  # noqa: E402
import harness  # noqa: E402

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the dry run is what happens without a CUDA device")


def test_help_and_readme_state_every_stage_with_its_budget(capsys):
    """The budgets live in gpu_suite.STAGES; the --help text and the README's table repeat them for readers,
    and must say the same."""
    with pytest.raises(SystemExit) as exit_info:
        gpu_suite.parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    readme = (HERE.parent / "README.md").read_text()
    for stage, spec in gpu_suite.STAGES.items():
        assert re.search(rf"^\s+{stage}\s+{spec.budget_s:.0f} s\s", text, re.M), f"--help: stage {stage}"
        assert re.search(rf"gpu_check.sh {stage} OUT/{stage}[^|]*\| {spec.budget_s:.0f} s \|", readme), f"README: {stage}"
    assert "summary" in text and "--resume-from" in text
    total = sum(gpu_suite.STAGES[stage].budget_s for stage in "abcd")
    assert total <= 21 * 60 and f"at most {total // 60:.0f} minutes" in readme


def test_bad_arguments_are_refused(capsys):
    for argv in (["z", "out"], ["a", "out", "--budget", "0"], ["a", "out", "--workers", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            gpu_suite.parse_args(argv)
        assert exit_info.value.code == 2
    assert "--budget must be a positive" in capsys.readouterr().err


@no_gpu
@pytest.mark.parametrize("stage", ["a", "b", "c", "d", "e", "all"])
def test_every_stage_exits_cleanly_without_a_gpu(stage, tmp_path, capsys):
    assert gpu_suite.main([stage, str(tmp_path / "out")]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()  # a dry run leaves nothing to mistake for results


@no_gpu
def test_gpu_check_script_dry_run(tmp_path):
    script = HERE.parent / "scripts" / "gpu_check.sh"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(script), "c", str(tmp_path / "out")], capture_output=True, text=True,
                          timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device" in proc.stdout
    assert "no CUDA device" in (tmp_path / "out" / "console_c.log").read_text()  # the console is teed
    usage = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "STAGE OUT_DIR" in usage.stdout


def test_a_killed_command_keeps_its_log(tmp_path):
    """The old suite wrote the pytest log only when pytest returned: a command killed at the machine's limit
    kept nothing. Lines reach the log as they are printed, and the budget kills the whole process group."""
    log = tmp_path / "child.log"
    child = "import time; print('first result', flush=True); time.sleep(60); print('after ' + 'the kill')"
    started = time.monotonic()
    result = gpu_suite.run_logged([sys.executable, "-c", child], log, timeout_s=3)
    assert time.monotonic() - started < 30
    assert result["timed_out"] and result["returncode"] != 0 and result["last_line"] == "first result"
    text = log.read_text()
    assert "first result" in text and "after the kill" not in text and "killed after 3 s" in text
    not_started = gpu_suite.run_logged([sys.executable, "-c", "print(1)"], tmp_path / "late.log", timeout_s=0)
    assert not_started["timed_out"] and "no time left" in (tmp_path / "late.log").read_text()


def test_a_finished_command_reports_its_exit_code(tmp_path):
    result = gpu_suite.run_logged([sys.executable, "-c", "print('out'); raise SystemExit(3)"], tmp_path / "x.log", 60)
    assert result == {**result, "returncode": 3, "timed_out": False, "last_line": "out"}


def test_deadline_counts_from_its_start():
    start = time.monotonic() - 100
    deadline = gpu_suite.Deadline(130, start)
    assert 25 < deadline.left() <= 30
    assert deadline.fits(20) and not deadline.fits(40)


def test_stage_record_is_on_disk_after_every_step(tmp_path):
    record = gpu_suite.StageRecord(tmp_path, "a", 330, ["a", str(tmp_path)])
    assert json.loads((tmp_path / "stage_a.json").read_text())["status"] == "running"
    record.step("large_checks", {"status": "running", "checks": {
        "pair_scores fp64": {"errors": {"dx": 1e-15}, "against": "oracle", "tolerance": 1e-10, "rule": None,
                             "pass": True},
        "similarity bf16 ibn": {"errors": {"dq": [3e-3, 2e-3]}, "against": "oracle", "tolerance": None,
                                "rule": "ours <= 2 x eager", "pass": True},
        "arccon": {"skipped": "needs ~40 s, 12 s left in the budget"}}})
    on_disk = json.loads((tmp_path / "stage_a.json").read_text())
    assert set(on_disk["steps"]["large_checks"]["checks"]) == {"pair_scores fp64", "similarity bf16 ibn", "arccon"}
    markdown = (tmp_path / "stage_a.md").read_text()
    assert "| pair_scores fp64 | pass | oracle | dx 1.0e-15 (tol 1e-10) |" in markdown
    assert "dq 3.0e-03 / 2.0e-03" in markdown and "| arccon | skipped |" in markdown
    record.finish("ok")
    assert json.loads((tmp_path / "stage_a.json").read_text())["status"] == "ok"


def test_a_failing_step_is_recorded_and_the_stage_goes_on(tmp_path):
    record = gpu_suite.StageRecord(tmp_path, "c", 300, ["c", str(tmp_path)])

    def broken():
        raise RuntimeError("kernel launch failed")

    result = gpu_suite.guarded(record, "limits", broken)
    assert result["status"] == "error" and "kernel launch failed" in result["error"]
    assert gpu_suite.guarded(record, "op_sweep", lambda: {"rows": []})["status"] == "ok"
    steps = json.loads((tmp_path / "stage_c.json").read_text())["steps"]
    assert steps["limits"]["status"] == "error" and steps["op_sweep"]["status"] == "ok"


def test_op_sweep_covers_every_op_before_the_large_sizes():
    """Under a budget the sweep must reach every op and dtype at small sizes before spending time on the
    largest: all cases of size rank r come before any of rank r + 1. Every family's ops are in it."""
    cases = gpu_suite.op_cases()
    ranks = [case[0] for case in cases]
    assert ranks == sorted(ranks)
    first_rank = {(bench.name, dtype) for rank, bench, n, d, dtype in cases if rank == 0}
    assert first_rank == {(bench.name, dtype) for _, bench, _, _, dtype in cases}
    assert {"pair_scores", "ranking_loss", "similarity_xent(ibn)", "similarity_xent(arccon)"} <= {
        bench.name for _, bench, _, _, _ in cases}


def tiny(bench):
    """The op benchmark at sizes the CPU measures in a moment."""
    return dataclasses.replace(bench, sizes=(8, 16), dims=(6,) if bench.dims != (1,) else (1,))


def test_op_sweep_measures_every_op_at_tiny_sizes_on_cpu(tmp_path):
    """Stage c's sweep code (each op's setup, the shared measurement, floors and fractions of the limits, the
    records) on CPU with the torch backend: a bug here would otherwise first show on the GPU."""
    record = gpu_suite.StageRecord(tmp_path, "c", 300, ["c", str(tmp_path)])
    limits = {"copy_GBps": 10.0, "matmul_float32_TFLOPs": 0.1}  # no bfloat16 rate: its fractions stay None
    ops = [tiny(bench) for bench in gpu_suite.all_ops()]
    result = gpu_suite.op_sweep(record, gpu_suite.Deadline(600, time.monotonic()), limits, [("torch",)],
                                device="cpu", ops=ops)
    rows = result["rows"]
    assert len(rows) == sum(len(b.sizes) * len(b.dims) * len(b.dtypes) for b in ops)
    assert all(row["status"] == "ok" and row["ms"] > 0 for row in rows), [r for r in rows if r["status"] != "ok"]
    for row in rows:
        assert (row["fraction_needed"] is None) == (row["dtype"] == "bfloat16" and row["floor"]["kind"] == "flops")
        if row["op"].startswith("similarity") and row["dtype"] == "float32":
            assert 0 < row["fraction_needed"] <= row["fraction_executed"]
    on_disk = json.loads((tmp_path / "stage_c.json").read_text())["steps"]["op_sweep"]["rows"]
    assert len(on_disk) == len(rows)
    assert "| pair_scores | 8 | 6 | bfloat16 | torch |" in (tmp_path / "stage_c.md").read_text()


def test_op_sweep_measures_both_triton_schemes_of_similarity_xent(tmp_path, monkeypatch):
    """The triton backend's full-width similarity_xent gets a row per scheme, each forced (its grad_fn says which
    ran), with the FLOPs that scheme executes; the other ops one "triton" row. Under the interpreter on CPU."""
    import angle_kernels.triton_ops.similarity_xent_dense as dense
    from angle_kernels.dispatch import triton_interpreting

    if not triton_interpreting():
        pytest.skip("runs the triton backend on CPU tensors: needs TRITON_INTERPRET=1 (the root conftest's default)")
    ran = []
    original = harness.measure_fwd_bwd

    def spying(run, leaves, device):
        ran.append(type(run().grad_fn).__name__)
        return original(run, leaves, device)

    ops = [dataclasses.replace(tiny(bench), sizes=(8,), dtypes=("float32",))
           for bench in gpu_suite.all_ops() if bench.name in ("similarity_xent(ibn)", "pair_scores")]
    record = gpu_suite.StageRecord(tmp_path, "c", 300, ["c", str(tmp_path)])
    limits = {"copy_GBps": 10.0, "matmul_float32_TFLOPs": 0.1}
    monkeypatch.setattr(harness, "measure_fwd_bwd", spying)
    width = dense.MIN_WIDTH
    rows = gpu_suite.op_sweep(record, gpu_suite.Deadline(600, time.monotonic()), limits, [("triton",)],
                              device="cpu", ops=ops)["rows"]
    assert dense.MIN_WIDTH == width  # the forcing is undone
    labels = {(row["op"], row["backend"]): row for row in rows}
    assert set(labels) == {("similarity_xent(ibn)", "triton-fused"), ("similarity_xent(ibn)", "triton-dense"),
                           ("pair_scores", "triton")}, rows
    assert all(row["status"] == "ok" for row in rows), rows
    fused_row = labels["similarity_xent(ibn)", "triton-fused"]
    dense_row = labels["similarity_xent(ibn)", "triton-dense"]
    assert fused_row["floor"]["executed"] == 10 * 16 * 16 * 6 and dense_row["floor"]["executed"] == 6 * 16 * 16 * 6
    assert ran.count("SimilarityXentFunctionBackward") == 1 and ran.count("DenseSimilarityXentFunctionBackward") == 1


def test_the_test_stages_run_the_op_tests():
    """Stage a runs every backend's op tests but the CUDA one's, plus the Triton compile check; stage b the
    CUDA backend's. Both select by the op tests' backend ids, and the paths must exist in this checkout."""
    for args, selection in ((gpu_suite.PYTEST_TRITON, "not cuda"), (gpu_suite.PYTEST_CUDA, "cuda")):
        assert args[args.index("-k") + 1] == selection
        paths = [a for i, a in enumerate(args) if a != "-k" and (i == 0 or args[i - 1] != "-k")]
        assert "tests/ops" in paths
        for path in paths:
            assert (HERE.parent / path).exists(), path


def test_summary_gathers_the_stages_of_separate_commands(tmp_path):
    for stage in ("b", "a"):
        folder = tmp_path / stage
        folder.mkdir()
        record = gpu_suite.StageRecord(folder, stage, gpu_suite.STAGES[stage].budget_s, [stage, str(folder)])
        record.step("environment", {"status": "ok", "gpu": "NVIDIA H100", "capability": "9.0", "torch": "2.11"})
        record.finish("ok")
    assert gpu_suite.main(["summary", str(tmp_path)]) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert summary.index("| a |") < summary.index("| b |")
    assert "a/stage_a.json" in summary and "## Stage b" in summary and "NVIDIA H100 (sm_90)" in summary
    with pytest.raises(SystemExit, match="no stage_"):
        gpu_suite.summarize(tmp_path / "a" / "missing")


def test_a_step_that_fails_midway_keeps_what_it_recorded(tmp_path):
    record = gpu_suite.StageRecord(tmp_path, "a", 330, ["a", str(tmp_path)])

    first = {"pass": True, "errors": {"loss": 1e-16}, "against": "oracle"}

    def checks_then_crash():
        record.step("large_checks", {"status": "running", "checks": {"first": first}})
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    result = gpu_suite.guarded(record, "large_checks", checks_then_crash)
    assert result["status"] == "error" and "illegal memory access" in result["error"]
    assert result["checks"] == {"first": first}


TINY_CHECKS = {
    "pair_scores": [(5, 2, 8), (3, 3, 6)],
    "ranking": [40, 4500],  # both paths of the ranking kernels: tiled (N <= 4096) and sorted
    "similarity": [
        ("ibn M=12 D=10", 12, None, 10, dict(target="partner", exclude_diagonal=True), True),
        ("contrastive M=6 Mc=12 D=8", 6, 12, 8, dict(target="diagonal"), False),
        ("arccon M=6 D=8", 6, 6, 8, dict(target="diagonal", margin=0.1745), False),
    ],
}


@no_gpu
def test_large_checks_run_end_to_end_at_tiny_sizes(tmp_path):
    """The GPU stage's check code (kernels vs the float64 oracle, the 2x-eager rule for bf16/fp16, the
    records) at tiny sizes on CPU, with the Triton kernels through the interpreter: a bug here would otherwise
    first show on the GPU, and cost its time."""
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        pytest.skip("needs the Triton interpreter (the root conftest turns it on without a CUDA device)")
    record = gpu_suite.StageRecord(tmp_path, "a", 330, ["a", str(tmp_path)])
    deadline = gpu_suite.Deadline(600, time.monotonic())
    result = gpu_suite.guarded(record, "large_checks",
                               lambda: gpu_suite.large_checks(record, deadline, TINY_CHECKS, device="cpu"))
    checks = result["checks"]
    assert len(checks) == 2 + 4 + 3 * 3 and result["failed"] == [] and result["status"] == "ok", checks
    assert checks["similarity bfloat16 ibn M=12 D=10"]["rule"].startswith("ours <= 2 x eager")
    assert set(checks["similarity float16 contrastive M=6 Mc=12 D=8"]["errors"]) == {"loss", "dq", "dc"}
    # the float64 oracle is the reference wherever its N x N matrix is affordable
    assert checks["ranking float32 N=40"]["against"] == "oracle"
    assert checks["ranking float32 N=4500"]["against"] == "torch float64"
    assert checks["pair_scores fp64 G=5 K=2 D=8"]["against"] == "oracle"
    on_disk = json.loads((tmp_path / "stage_a.json").read_text())["steps"]["large_checks"]
    assert on_disk["status"] == "ok" and set(on_disk["checks"]) == set(checks)
    skipped = gpu_suite.large_checks(record, gpu_suite.Deadline(5, time.monotonic()), TINY_CHECKS, device="cpu")
    assert all("skipped" in check for check in skipped["checks"].values())  # 5 s fits none of them


def test_the_cuda_probe_is_valid_python():
    """Stages b-d run it in a subprocess on the GPU; a typo would cost a GPU command to find."""
    compile(gpu_suite._CUDA_PROBE, "_CUDA_PROBE", "exec")
