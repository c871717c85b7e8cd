"""pytest-benchmark cases for the loss providers, at small sizes, plus checks of the loss sweep itself.

    pytest bench/ -q                      # CI: every case runs a few rounds; nothing asserts on time
    pytest bench/ --benchmark-only        # only the timed cases, with pytest-benchmark's statistics
    pytest bench/ --benchmark-only --benchmark-columns=median,iqr,rounds -k "cosine"

The sweep over sizes, with memory, is bench_losses.py (loss_sweep.py); these cases are the quick, always-runnable
counterpart (one small size per loss, forward + backward, every provider that is installed).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile
import types
import zipfile
from pathlib import Path

import pytest
import torch

import bench_losses
import harness
import loss_sweep
import providers as P

HERE = Path(__file__).resolve().parent

LOSSES = bench_losses.LOSSES
SMALL = {"cosine": (256, 128), "angle": (256, 128), "ibn": (128, 128), "contrastive": (128, 128),
         "arccon": (128, 128), "triplet": (256, 128), "mnrl_gte": (128, 128), "mnrl_hardness": (128, 128),
         "mnrl_false_negatives": (128, 128), "mnrl_dot": (128, 128),
         "matryoshka_cosine": (256, 96), "matryoshka_mnrl": (128, 96)}
# The provider of each family that runs on CPU
PROVIDER_OF_FAMILY = {"ours": "ours-torch", "reference": "angle-emb", "sentence-transformers": "sentence-transformers",
                      "eager": "eager-pytorch"}
CASES = [(loss, PROVIDER_OF_FAMILY[family]) for loss in LOSSES for family in LOSSES[loss].implementations]


@pytest.fixture(scope="module")
def all_providers():
    providers, missing = P.available_providers("cpu", list(LOSSES.values()))
    return {p.name: p for p in providers}, missing


def provider_or_skip(all_providers, name):
    providers, missing = all_providers
    if name not in providers:
        pytest.skip(f"{name} is not available: {missing.get(name, 'not installed')}")
    return providers[name]


def test_every_loss_has_a_small_case_and_ours():
    assert set(SMALL) == set(LOSSES) and set(bench_losses.DEFAULT_LOSSES) <= set(LOSSES)
    assert all("ours" in loss.implementations for loss in LOSSES.values())
    assert all(set(loss.implementations) <= set(P.FAMILIES) for loss in LOSSES.values())


@pytest.mark.parametrize(("loss", "name"), CASES)
def test_forward_backward(benchmark, all_providers, loss, name):
    provider = provider_or_skip(all_providers, name)
    n, d = SMALL[loss]
    inputs = LOSSES[loss].build_inputs(n, d, torch.float32, "cpu", seed=list(LOSSES).index(loss))
    leaves = harness.grad_leaves(inputs)
    fn = provider.make(loss, inputs)

    def setup():
        for leaf in leaves:
            leaf.grad = None

    def run():
        value = fn()
        value.backward()
        return value

    benchmark.extra_info.update({"loss": loss, "provider": name, "n": n, "d": d, "dtype": "float32",
                                 "threads": torch.get_num_threads()})
    value = benchmark.pedantic(run, setup=setup, rounds=5, warmup_rounds=1)
    assert torch.isfinite(value).item()
    assert all(leaf.grad is not None and torch.isfinite(leaf.grad).all() for leaf in leaves)


@pytest.mark.parametrize("loss", LOSSES)
def test_providers_compute_the_same_loss(all_providers, loss):
    """The side-by-side comparison is only fair if every provider computes the same thing: values and
    gradients agree to float64 rounding (this is what validates the sentence-transformers adapter and the
    eager baselines' settings)."""
    providers, _ = all_providers
    active = [p for p in providers.values() if p.provides(loss)]
    if len(active) < 2:
        pytest.skip(f"fewer than two providers of {loss} are installed")
    errors = P.check_agreement(active, LOSSES[loss], "cpu", n=37, d=34, dtype=torch.float64, seed=7)
    assert set(errors) == {p.name for p in active[1:]}
    for name, err in errors.items():
        assert err["value"] < 1e-12, (name, err)
        assert err["grad"] < 1e-10, (name, err)


def test_eager_baselines_compute_in_the_inputs_dtype(all_providers):
    """eager-pytorch is eager PyTorch in the benchmarked dtype, not the float64 oracle: in float32 it differs
    from float64 by float32 rounding, and its result is float32."""
    eager = provider_or_skip(all_providers, "eager-pytorch")
    for name in ("arccon", "triplet"):
        inputs = LOSSES[name].build_inputs(64, 32, torch.float32, "cpu", seed=3)
        value = eager.make(name, inputs)()
        exact = eager.make(name, {k: v.double() for k, v in inputs.items()})()
        assert value.dtype == torch.float32 and exact.dtype == torch.float64
        assert 0 < abs(value.item() - exact.item()) < 1e-5 * abs(exact.item())


@pytest.mark.parametrize("loss", LOSSES.values(), ids=lambda loss: loss.name)
def test_every_loss_counts_the_floor_of_the_op_it_costs(loss):
    """Losses whose cost grows as N^2 D are matmul bound (a FLOPs floor); the others move bytes. Their inputs
    hold the embedding rows the memory estimate assumes."""
    floor = loss.work_floor(64, 16, torch.float32)
    assert floor["kind"] == ("flops" if loss.grows == "N^2" else "bytes") and floor["amount"] > 0
    inputs = loss.build_inputs(64, 16, torch.float32, "cpu", 0)
    rows = sum(t.shape[0] for t in harness.grad_leaves(inputs))
    assert rows == loss.embedding_rows(64)
    assert all(t.shape[-1] == 16 and t.abs().sum() > 0 for t in harness.grad_leaves(inputs))


def test_adapter_feeds_sentence_transformers_the_given_embeddings(all_providers):
    """PrecomputedEmbeddings must hand each column's tensor through untouched: CoSENTLoss on two columns
    equals its compute_loss_from_embeddings on the same tensors, and the gradient reaches them."""
    provider_or_skip(all_providers, "sentence-transformers")
    losses = P.sentence_transformers_losses()
    gen = torch.Generator().manual_seed(3)
    u = torch.randn(9, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    v = torch.randn(9, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    labels = torch.randint(0, 3, (9,), generator=gen).to(torch.float64)
    loss = losses.CoSENTLoss(P.PrecomputedEmbeddings(), scale=P.TAU)
    through_forward = loss(P.columns(u, v), labels)
    direct = loss.compute_loss_from_embeddings([u, v], labels)
    assert torch.equal(through_forward, direct)
    through_forward.backward()
    assert u.grad is not None and v.grad is not None and u.grad.abs().sum() > 0


def test_reference_loads_from_a_wheel(tmp_path, monkeypatch):
    """On the GPU image only the angle-emb wheel is carried: its loss.py must load from the zip."""
    try:
        installed = P.find_reference_loss_file()
    except FileNotFoundError:
        pytest.skip("angle-emb is not installed")
    wheel = tmp_path / "angle_emb-0.6.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(installed, "angle_emb/loss.py")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temporary"))
    (tmp_path / "temporary").mkdir()
    from_wheel = P.load_reference_module(str(wheel))
    from_file = P.load_reference_module(str(installed))
    assert not any((tmp_path / "temporary").iterdir()), "loading from a wheel left files behind"
    assert from_wheel.__bench_source__ == f"{wheel}!angle_emb/loss.py"
    gen = torch.Generator().manual_seed(5)
    y_pred = torch.randn(12, 8, generator=gen)
    y_true = torch.tensor([0.0, 0.0, 1.0, 1.0, 2.0, 2.0] * 2).unsqueeze(1)
    assert torch.equal(from_wheel.cosine_loss(y_true, y_pred), from_file.cosine_loss(y_true, y_pred))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        P.find_reference_loss_file(str(tmp_path / "missing.py"))
    empty_wheel = tmp_path / "empty-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(empty_wheel, "w") as zf:
        zf.writestr("other/loss.py", "")
    with pytest.raises(FileNotFoundError, match="holds no angle_emb/loss.py"):
        P.load_reference_module(str(empty_wheel))


def test_memory_estimates_grow_as_the_baselines_do():
    """The skip decision rests on these: quadratic for the eager baselines, linear for ours."""
    cosine, arccon = LOSSES["cosine"], LOSSES["arccon"]
    ref = P.Provider("angle-emb", "reference", None, {"cosine": cosine})
    ours = P.Provider("ours-torch", "ours", "torch", {"cosine": cosine, "arccon": arccon})
    eager = P.Provider("eager-pytorch", "eager", None, {"arccon": arccon})

    def estimate(provider, loss, n):
        return loss_sweep.estimate_extra_bytes(provider, loss, n, 768, torch.float32)

    small, large = estimate(ref, cosine, 4096), estimate(ref, cosine, 16384)
    assert 8 < large / small <= 16  # N^2 term plus a linear part
    assert estimate(ours, cosine, 16384) == 4 * estimate(ours, cosine, 4096)
    assert estimate(ours, arccon, 16384) == 4 * estimate(ours, arccon, 4096)
    assert 8 < estimate(eager, arccon, 16384) / estimate(eager, arccon, 4096) <= 16
    # the reference's cosine loss at N = 16384 needs about 4.1 GB (measured directly): the estimate errs high
    assert 4.1e9 < estimate(ref, cosine, 16384) < 8e9
    # eager ArcCon needed +117 MB at N = 2048 (bench_arccse.py): the estimate errs high, not wildly
    assert 117e6 < estimate(eager, arccon, 2048) < 4 * 117e6


def test_a_budget_cuts_the_largest_sizes_not_whole_losses():
    """Every selected loss gets its first size before any loss gets its second, and so on."""
    args = bench_losses.parse_args(["--losses", "cosine,ibn,arccon,triplet", "--n", "16,64,256",
                                    "--n-quadratic", "8,32", "--device", "cpu"])
    schedule = [(loss.name, n) for loss, n in loss_sweep.size_schedule(args, [LOSSES[name] for name in args.losses])]
    assert schedule == [("cosine", 16), ("ibn", 8), ("arccon", 8), ("triplet", 16),
                        ("cosine", 64), ("ibn", 32), ("arccon", 32), ("triplet", 64),
                        ("cosine", 256), ("triplet", 256)]


# The script's runs that the tests below check, by name: each test's arguments (and --out, a folder of its own).
# --time-budget 0 measures nothing: one run without matplotlib serves both the budget's test and the plot's (what
# is measured does not reach the plot's code, which says why there is none).
SCRIPT_RUNS = {
    "end_to_end": ("--losses", "cosine,ibn", "--n", "16,64", "--n-quadratic", "16", "--d", "32",
                   "--providers", "ours,reference", "--repeats", "3", "--max-ref-gb", "0.00005"),
    "nothing_fits_without_matplotlib": ("--losses", "cosine,triplet", "--n", "16,64", "--d", "32", "--providers",
                                        "ours", "--time-budget", "0", "--no-check"),
}
# The runs made as on a machine without some optional packages: their imports fail (sys.modules[name] = None)
HIDDEN_PACKAGES = {"nothing_fits_without_matplotlib": "matplotlib"}
# The CPU's limits measured at smaller sizes than a sweep's (harness.COPY_BYTES, MATMUL_SIZES: 256 MiB copies and
# matmuls of 2048 and 4096, most of a tiny run's time): the same measurement, and a rate to take fractions of
SMALL_LIMITS = {"copy_bytes": 2**22, "matmul_sizes": (256,)}
# python -c RUN PACKAGES LIMITS SCRIPT ARGS...: runs SCRIPT as `python SCRIPT ARGS...` would, with PACKAGES' imports
# failing and the CPU's limits measured at LIMITS' sizes (JSON)
RUN = ("import json, os, runpy, sys; sys.modules.update(dict.fromkeys(filter(None, sys.argv[1].split(',')))); "
       "limits = json.loads(sys.argv[2]); del sys.argv[:3]; sys.path.insert(0, os.path.dirname(sys.argv[0])); "
       "import harness; harness.COPY_BYTES['cpu'] = limits['copy_bytes']; "
       "harness.MATMUL_SIZES['cpu'] = tuple(limits['matmul_sizes']); runpy.run_path(sys.argv[0], run_name='__main__')")


@pytest.fixture(scope="module")
def script_runs(tmp_path_factory):
    """run(name) -> (the finished run of bench_losses.py with SCRIPT_RUNS[name], its --out folder). Every run
    starts at the first call, side by side: each is mostly one process's imports and waits, which overlap. (In a
    pytest-xdist worker, only the run asked for: the workers already run side by side, and the other test may be
    another worker's.)

    A subprocess: the script forks one child per case, which is only safe from a process that has not yet run a
    parallel (OpenMP) torch op, and this pytest process has."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    started = {}

    def run(name: str) -> tuple[subprocess.CompletedProcess, Path]:
        for each in [name] if os.environ.get("PYTEST_XDIST_WORKER") else SCRIPT_RUNS:
            if each not in started:
                folder = tmp_path_factory.mktemp(each)
                cmd = [sys.executable, "-c", RUN, HIDDEN_PACKAGES.get(each, ""), json.dumps(SMALL_LIMITS),
                       str(HERE / "bench_losses.py"), *SCRIPT_RUNS[each], "--out", str(folder / "out")]
                with open(folder / "stdout.txt", "w") as stdout, open(folder / "stderr.txt", "w") as stderr:
                    started[each] = (subprocess.Popen(cmd, stdout=stdout, stderr=stderr, env=env), folder)
        proc, folder = started[name]
        returncode = proc.wait(timeout=240)
        return (subprocess.CompletedProcess(proc.args, returncode, (folder / "stdout.txt").read_text(),
                                            (folder / "stderr.txt").read_text()), folder / "out")

    yield run
    for proc, _ in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_script_end_to_end(script_runs):
    """bench_losses.py at tiny sizes writes a table, JSON and a plot, and skips what exceeds the budget."""
    proc, out = script_runs("end_to_end")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = (out / "table.md").read_text()
    data = json.loads((out / "results.json").read_text())
    assert (out / "plot.png").stat().st_size > 10_000
    rows = {(r["loss"], r["n"], r["provider"]): r for r in data["results"]}
    # the reference's N^2 estimate at N=64 (~65 kB) exceeds the 50 kB budget: skipped with a marker
    assert rows[("cosine", 64, "angle-emb")]["status"] == "skipped"
    assert "skipped: needs" in rows[("cosine", 64, "angle-emb")]["note"]
    assert rows[("cosine", 16, "angle-emb")]["status"] == "ok"
    ours = rows[("cosine", 16, "ours-torch")]
    assert ours["status"] == "ok" and ours["median_s"] > 0 and len(ours["times_s"]) == 3
    assert ours["rounds"] == 3 and len(ours["extra_bytes_rounds"]) == 3  # one timed run per round, in turn
    # the CPU's limits were measured in this run, and the achieved rate is a fraction of them
    assert data["hardware_limits"]["copy_GBps"] > 0 and data["hardware_limits"]["matmul_float32_TFLOPs"] > 0
    assert 0 < ours["rate_fraction"] and rows[("ibn", 16, "ours-torch")]["rate_unit"] == "FLOP/s"
    assert "| 16 |" in table and "÷ ours-torch" in table and "measured limits: copy" in table
    for err in data["agreement_checks"]["cosine"].values():
        assert err["value"] < 1e-12 and err["grad"] < 1e-10


def test_sweep_writes_its_outputs_after_every_case(tmp_path, monkeypatch):
    """A sweep killed from outside (the GPU machine stops a command at 10 minutes) keeps what it measured."""
    args = bench_losses.parse_args(["--losses", "cosine", "--n", "16,32", "--d", "8", "--providers", "ours",
                                    "--device", "cpu", "--out", str(tmp_path), "--no-plot"])
    provider = P.Provider("ours-torch", "ours", "torch", {"cosine": LOSSES["cosine"]})
    measured = []

    def fake_run_one(args, provider, loss, n, d, dtype, previous, limits, deadline=None, budget=None,
                     repeats=None, measured_s=None):
        if n > 16:  # during the second size's rounds
            raise KeyboardInterrupt("the machine's time limit")
        measured.append(n)
        return {"status": "ok", "median_s": 0.01, "min_s": 0.01, "time_s": 0.01, "extra_bytes": 1000,
                "floor": loss.work_floor(n, d, dtype), "rate": 1.0, "rate_unit": "B/s", "rate_fraction": None}

    monkeypatch.setattr(loss_sweep, "run_one", fake_run_one)
    env = {"date": "now", "command": "test", "torch": torch.__version__, "threads": 1, "cpu": "test"}
    losses = [LOSSES["cosine"]]
    report = loss_sweep.Report(tmp_path, env, args, losses, {}, {}, {}, ["ours-torch"], "ours-torch")
    with pytest.raises(KeyboardInterrupt):
        loss_sweep.sweep(args, losses, [provider], {}, on_row=lambda rows: report.write(rows, complete=False))
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["complete"] is False and [r["n"] for r in data["results"]] == [16]
    assert data["results"][0]["rounds"] == 5 and len(measured) == 5  # --repeats' rounds, gathered in one row
    assert "| 16 |" in (tmp_path / "table.md").read_text()


def test_time_budget_skips_what_does_not_fit(script_runs):
    """--time-budget 0: nothing is measured, every case is marked, and the outputs are still complete."""
    proc, out = script_runs("nothing_fits_without_matplotlib")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert data["complete"] is True and len(data["results"]) == 4
    assert all(r["status"] == "skipped" and "--time-budget" in r["note"] for r in data["results"])


def test_a_sweep_without_matplotlib_writes_its_table_and_says_why_there_is_no_plot(script_runs):
    """matplotlib is optional (the bench extra): without it, a sweep measured every case, wrote its table and JSON,
    then ended in an ImportError traceback (exit status 1) where it draws the plot."""
    proc, out = script_runs("nothing_fits_without_matplotlib")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    assert "# no plot.png: matplotlib is not available (" in proc.stdout and "pip install matplotlib" in proc.stdout
    assert (out / "table.md").exists() and (out / "results.json").exists() and not (out / "plot.png").exists()
    assert "plot.png" not in proc.stdout.splitlines()[-1]  # the last line lists what was written


def test_the_default_output_folder_never_is_an_existing_one(tmp_path):
    """The default --out is bench/results/<device>-<date>, where the project's runs are committed: a second sweep on
    the same day (or one on the day of a committed run) wrote its files over the first's. It takes the next letter."""
    assert loss_sweep.unused_results_folder(tmp_path, "cpu-2026-11-26") == tmp_path / "cpu-2026-11-26"
    (tmp_path / "cpu-2026-11-26").mkdir()
    (tmp_path / "cpu-2026-11-26b").mkdir()
    assert loss_sweep.unused_results_folder(tmp_path, "cpu-2026-11-26") == tmp_path / "cpu-2026-11-26c"


def test_the_table_says_when_the_agreement_check_had_nothing_to_compare():
    """With our backend alone (or every baseline missing) the header's agreement line ended in a colon; and a
    package that is not installed had the version "None"."""
    table = _table([_ok_row("cosine", 16, "ours-torch", "ours", 0.001)], ["ours-torch"], "ours-torch",
                   {"sentence_transformers": None}, checks={"cosine": {}})
    assert "agreement check (N=24, D=32, float64): nothing to compare: no provider besides ours-torch ran" in table
    assert "sentence-transformers not installed, angle-emb not run" in table


def test_a_case_in_process_times_its_first_call_apart_and_charges_each_part():
    """The CUDA sweep's case (measure_in_process), here on CPU: one untimed first call (cold_s: compiles and
    autotuning on a GPU) charged to the warm-up, then the warm runs charged to the timed runs."""
    providers, _ = P.available_providers("cpu", [LOSSES["cosine"]], include=["ours-torch"], probe=False)
    budget = harness.SweepBudget(60, warm_up_s=20)
    row = loss_sweep.measure_in_process(providers[0], LOSSES["cosine"], 16, 8, torch.float32, 0, "cpu", budget)
    assert row["cold_s"] > 0 and row["median_s"] > 0
    summary = budget.summary()
    assert summary["warm_up"] == {"allowed_s": 20, "spent_s": pytest.approx(row["cold_s"], abs=0.05), "cases": 1}
    assert summary["timed"]["allowed_s"] == 40 and summary["timed"]["cases"] == 1


def test_the_size_flags_help_names_every_loss_they_size(capsys):
    """--n's and --n-quadratic's help name the losses each sizes, from the losses' own growth: they named three each,
    leaving out MNRL's options and the Matryoshka losses; a family's sweep (bench_arccse.py) names its own."""
    import bench_arccse

    for losses in (LOSSES, {loss.name: loss for loss in bench_arccse.LOSSES}):
        with pytest.raises(SystemExit):
            loss_sweep.parse_args(["--help"], losses, list(losses))
        text = " ".join(capsys.readouterr().out.split())
        for flag, grows in (("--n N", "N"), ("--n-quadratic N_QUADRATIC", "N^2")):
            pattern = re.escape(f"{flag} sizes N of the losses whose cost grows as {grows}") + r"(?: D)? \(([^)]*)\)"
            named = re.search(pattern, text).group(1)
            assert named.split(", ") == [name for name, loss in losses.items() if loss.grows == grows], named
    assert {"matryoshka_cosine", "mnrl_dot", "matryoshka_mnrl"} <= set(LOSSES)


def test_the_warm_up_budget_skips_a_case_before_it_runs_and_needs_cuda_and_a_time_budget(capsys):
    args = bench_losses.parse_args(["--losses", "cosine", "--providers", "ours", "--device", "cpu"])
    args.warm_up_budget, args.time_budget = 5.0, 100.0
    providers, _ = P.available_providers("cpu", [LOSSES["cosine"]], include=["ours-torch"], probe=False)
    spent = harness.SweepBudget(100, warm_up_s=5)
    spent.charge("warm_up", 5)
    row = loss_sweep.run_one(args, providers[0], LOSSES["cosine"], 16, 8, torch.float32, None, {}, budget=spent)
    assert row["status"] == "skipped" and "warm-up allowance spent (0 of 5 s left; a first call ~15 s)" in row["note"]
    short = harness.SweepBudget(100, warm_up_s=10)  # unspent, but short of a first call's compiles (FIRST_CALL_S)
    row = loss_sweep.run_one(args, providers[0], LOSSES["cosine"], 16, 8, torch.float32, None, {}, budget=short)
    assert row["status"] == "skipped" and "(10 of 10 s left; a first call ~15 s)" in row["note"]
    dozen_runs = harness.SweepBudget(30, warm_up_s=5)  # 25 s for the timed runs: not a dozen of a 3 s forecast
    row = loss_sweep.run_one(args, providers[0], LOSSES["cosine"], 16, 8, torch.float32, (8, 1.5), {},
                             budget=dozen_runs)
    assert row["status"] == "skipped" and "--time-budget" in row["note"]
    no_time = harness.SweepBudget(5, warm_up_s=5)  # everything to the warm-up: nothing left for timed runs
    row = loss_sweep.run_one(args, providers[0], LOSSES["cosine"], 16, 8, torch.float32, (8, 0.001), {},
                             budget=no_time)
    assert row["status"] == "skipped" and "--time-budget" in row["note"]
    for argv in (["--device", "cpu", "--warm-up-budget", "5", "--time-budget", "10"], ["--warm-up-budget", "5"]):
        with pytest.raises(SystemExit):
            bench_losses.parse_args(argv)
    assert "--warm-up-budget splits --time-budget" in capsys.readouterr().err


def test_providers_can_be_narrowed_to_some_of_our_backends():
    """The GPU run leaves out a backend that failed its probe: it must not even be probed (a CUDA error in it
    would lose the process's CUDA context for every other provider)."""
    losses = list(LOSSES.values())
    providers, missing = P.available_providers("cpu", losses, include=["ours-torch"], probe=False)
    assert [p.name for p in providers] == ["ours-torch"] and missing == {}
    assert P.ours_backends("cpu", probe=False, only={"triton"}) == (
        [], {"triton": "not benchmarked on cpu: triton on CPU tensors runs in its interpreter"})


def test_a_backend_named_but_never_benchmarked_on_the_device_is_said():
    """--providers ours-triton on a CPU: the column is absent, and the header says why (it was dropped unsaid)."""
    providers, missing = P.available_providers("cpu", [LOSSES["cosine"]], include=["ours-triton", "ours-cuda",
                                                                                   "reference"], probe=False)
    assert [p.name for p in providers] == ["angle-emb"]
    assert missing == {"ours-cuda": "not benchmarked on cpu",
                       "ours-triton": "not benchmarked on cpu: triton on CPU tensors runs in its interpreter"}


def test_a_family_without_any_of_the_selected_losses_is_left_out():
    """The main job's losses have no eager provider, the ArcCSE losses neither angle-emb nor sentence-transformers:
    the tables list only providers that have the loss."""
    main_job = [LOSSES[name] for name in bench_losses.DEFAULT_LOSSES]
    providers, _ = P.available_providers("cpu", main_job, probe=False)
    assert "eager" not in {p.family for p in providers}
    providers, _ = P.available_providers("cpu", [LOSSES["arccon"], LOSSES["triplet"]], probe=False)
    assert {p.family for p in providers} == {"ours", "eager"}


def test_ratios_are_taken_against_what_auto_computes_with(monkeypatch):
    """primary_ours: the torch backend, unless on CUDA a GPU backend is verified for every op and code path
    (angle_kernels.verified), as backend='auto' decides; a partly verified backend is not what auto runs."""
    from angle_kernels import verified

    ours = {name: P.Provider(f"ours-{name}", "ours", name, {}) for name in ("triton", "cuda", "torch")}
    everything = list(ours.values())
    monkeypatch.setattr(verified, "covers_every_path", lambda backend, device: False)
    assert P.primary_ours(everything, "cuda").name == "ours-torch"
    assert P.primary_ours(everything, "cpu").name == "ours-torch"
    monkeypatch.setattr(verified, "covers_every_path", lambda backend, device: backend == "cuda")
    assert P.primary_ours(everything, "cuda").name == "ours-cuda"
    assert P.primary_ours(everything, "cpu").name == "ours-torch"
    assert P.primary_ours([ours["triton"]], "cuda").name == "ours-triton"  # the only one of ours there is
    assert P.primary_ours([], "cuda") is None


def _ok_row(loss, n, provider, family, seconds, times=None):
    """A measured row of the sweep's results as run_one writes it (for the table's tests)."""
    return {"loss": loss, "n": n, "d": 8, "dtype": "float32", "provider": provider, "family": family,
            "status": "ok", "median_s": seconds, "min_s": min(times or [seconds]), "time_s": seconds,
            "times_s": times or [], "extra_bytes": 2_000_000, "rate": 1e9, "rate_unit": "B/s", "rate_fraction": None}


def _table(results, provider_names, primary, env=None, checks=None):
    args = bench_losses.parse_args(["--losses", "cosine", "--n", "16", "--d", "8", "--device", "cpu"])
    env = {"date": "now", "command": "test", "torch": torch.__version__, "threads": 1, "cpu": "test", **(env or {})}
    return loss_sweep.render_markdown(results, env, args, [LOSSES["cosine"]], {}, checks or {}, {}, provider_names,
                                      primary)


def test_a_sweep_without_our_backends_says_what_its_ratios_compare():
    """--providers reference,sentence-transformers: the ratios are against angle-emb, and the header said "above 1:
    ours is faster" of a table without ours; it names the provider the ratios are against."""
    results = [_ok_row("cosine", 16, "angle-emb", "reference", 0.002),
               _ok_row("cosine", 16, "sentence-transformers", "sentence-transformers", 0.004)]
    table = _table(results, ["angle-emb", "sentence-transformers"], "angle-emb")
    assert "ours is faster" not in table
    assert "(above 1: angle-emb is faster / smaller; no backend of ours ran" in table
    assert "| sentence-transformers ÷ angle-emb |" in table
    ours = _table([_ok_row("cosine", 16, "ours-torch", "ours", 0.001), *results],
                  ["ours-torch", "angle-emb", "sentence-transformers"], "ours-torch")
    assert "(above 1: ours is faster / smaller)" in ours


def test_the_table_gives_each_time_with_its_spread():
    """The table showed the median alone (the runs were only in results.json): each cell gives the timed runs'
    min-max beside it, or the fastest run where the timer kept no runs (triton's do_bench), and the header says so."""
    results = [_ok_row("cosine", 16, "ours-torch", "ours", 0.0012, times=[0.0015, 0.001, 0.0012]),
               _ok_row("cosine", 16, "angle-emb", "reference", 0.002)]
    results[1]["min_s"] = 0.0018  # do_bench's median and fastest, no runs
    table = _table(results, ["ours-torch", "angle-emb"], "ours-torch")
    assert "| 16 | 1.2 ms (1-1.5 ms), +2.0 MB | 2 ms (min 1.8 ms), +2.0 MB | 1.67x, 1x |" in table
    assert "cells: `time (spread), +extra memory`, the spread being the timed runs' min-max" in table
    assert harness.fmt_seconds_range(0.9, 1.2) == "0.9-1.2 s" and harness.fmt_seconds_range(0.5, 0.9) == "500-900 ms"


def test_the_header_names_the_checkout_measured():
    """The header's angle_kernels version is the same across commits: its folder and commit follow it (a results.json
    from before they were recorded renders without them)."""
    env = {"angle_kernels": "0.1.0", "angle_kernels_path": "/src/angle_kernels",
           "angle_kernels_commit": "8b7ea56 + uncommitted changes"}
    table = _table([_ok_row("cosine", 16, "ours-torch", "ours", 0.001)], ["ours-torch"], "ours-torch", env)
    assert "angle_kernels 0.1.0 (/src/angle_kernels, commit 8b7ea56 + uncommitted changes); " in table
    older = _table([_ok_row("cosine", 16, "ours-torch", "ours", 0.001)], ["ours-torch"], "ours-torch",
                   {"angle_kernels": "0.1.0"})
    assert "angle_kernels 0.1.0; " in older


def test_committed_loss_sweeps_still_render():
    """The results.json of sweeps committed before the spread was shown render with it (their rows hold the runs)."""
    folder = HERE / "results" / "cpu-2026-11-26-losses"
    data = json.loads((folder / "results.json").read_text())
    args = argparse.Namespace(**data["args"])
    losses = [LOSSES[name] for name in args.losses]
    table = loss_sweep.render_markdown(data["results"], data["environment"], args, losses, data["hardware_limits"],
                                       data["agreement_checks"], data["not_available"],
                                       sorted({r["provider"] for r in data["results"]}), data["ratios_against"])
    assert "ms (" in table and "| N |" in table


def test_a_backend_covers_every_path_only_when_each_is_verified(monkeypatch):
    from angle_kernels import verified

    paths = verified.paths_of("triton")
    assert paths["similarity_xent"] == ("fused", "dense", "dims", "dense_dims")
    missing = ("similarity_xent", "dims")
    monkeypatch.setattr(verified, "is_verified", lambda b, op, path, device: (op, path) != missing)
    assert not verified.covers_every_path("triton", torch.device("cuda", 0))
    monkeypatch.setattr(verified, "is_verified", lambda b, op, path, device: True)
    assert verified.covers_every_path("triton", torch.device("cuda", 0))
    # a path that no call takes until a GPU run verifies it (switched off: triton_ops.paths_awaiting_verification)
    # is not needed; switched on, it is
    from angle_kernels.cuda_ops import similarity_xent_paths as cuda_xent_paths
    from angle_kernels.triton_ops import similarity_lse_paths

    awaiting = ("similarity_lse", "dense_dims")
    monkeypatch.setattr(verified, "is_verified", lambda b, op, path, device: (op, path) != awaiting)
    assert not verified.covers_every_path("triton", torch.device("cuda", 0))
    monkeypatch.setattr(similarity_lse_paths, "DENSE_DIMS_MIN_WIDTH", None)
    assert verified.covers_every_path("triton", torch.device("cuda", 0))
    # nor is one of the CUDA backend's (cuda_ops.paths_awaiting_verification: its similarity_xent dense scheme)
    awaiting = ("similarity_xent", "dense")
    monkeypatch.setattr(verified, "is_verified", lambda b, op, path, device: (op, path) != awaiting)
    assert not verified.covers_every_path("cuda", torch.device("cuda", 0))
    monkeypatch.setattr(cuda_xent_paths, "DENSE_MIN_WIDTH", None)
    assert verified.covers_every_path("cuda", torch.device("cuda", 0))


_SMALL_PRODUCT_CASE = """
import torch
import bench_losses, harness, loss_sweep, providers

loss = bench_losses.LOSSES["ibn"]
ours = next(p for p in providers.available_providers("cpu", [loss], probe=False)[0] if p.name == "ours-torch")
print(harness.call_in_fork(lambda: loss_sweep.measure_cpu_case(ours, loss, 32, 64, torch.float32, 2, 1, 0.1, 0,
                                                                2 * 10**9)["extra_bytes"], timeout=120))
"""


def test_a_small_product_case_measures_no_one_time_blas_workspace():
    """The child's warm-up makes one product large enough for the BLAS's one-time GEMM workspace, which the tiny
    warm-up loss does not reach: the first measured product case had counted it (in-batch negatives at 32 pairs,
    D = 64, two threads: 3.5 MB against 0.1 MB on one machine's MKL, 0.48 MB against 0.08 MB on another's). Run as
    the sweep runs it, forked from a process that has computed nothing: this test's own process (a pytest worker) may
    have run a parallel region with two threads (a test marked all_threads), after which GNU OpenMP deadlocks in a
    forked child that starts one (harness.call_in_fork)."""
    out = subprocess.run([sys.executable, "-c", _SMALL_PRODUCT_CASE], cwd=HERE, capture_output=True, text=True,
                         timeout=300, check=True).stdout.strip().splitlines()
    status, extra = ast.literal_eval(out[-1])
    assert status == "ok" and extra < 2**18, (status, extra)


def _stand_in_bench(**makes):
    """The contrastive loss's inputs (text, pos, neg), computed by the given stand-in formulas, one per family."""
    return dataclasses.replace(LOSSES["contrastive"], implementations={
        family: harness.Implementation(family, make) for family, make in makes.items()})


def test_agreement_reports_the_worst_gradient_and_a_provider_that_fails():
    """One input's gradient off is reported, whichever input it is; a provider that raises is reported as
    infinitely wrong, with its error, instead of stopping the check."""
    def exact(context, x):
        return lambda: (x["text"] * x["pos"]).sum() + x["neg"].sum()

    def neg_gradient_doubled(context, x):  # the same value
        return lambda: (x["text"] * x["pos"]).sum() + 2 * x["neg"].sum() - x["neg"].detach().sum()

    def failing(context, x):
        raise RuntimeError("no kernel for this shape")

    bench = _stand_in_bench(ours=exact, reference=neg_gradient_doubled, eager=failing)
    providers = [P.Provider("ours-torch", "ours", "torch", {bench.name: bench}),
                 P.Provider("angle-emb", "reference", None, {bench.name: bench}),
                 P.Provider("eager-pytorch", "eager", None, {bench.name: bench})]
    errors = P.check_agreement(providers, bench, "cpu", n=5, d=4)
    assert set(errors) == {"angle-emb", "eager-pytorch"}
    assert errors["angle-emb"]["value"] < 1e-12 and errors["angle-emb"]["grad"] == pytest.approx(1.0)
    assert errors["angle-emb"]["against"] == "ours-torch"
    assert errors["eager-pytorch"]["value"] == errors["eager-pytorch"]["grad"] == float("inf")
    assert errors["eager-pytorch"]["error"] == "RuntimeError: no kernel for this shape"
    assert P.check_agreement([], bench) == {}


def test_probing_finds_a_backend_that_fails_and_no_probe_computes_nothing(monkeypatch):
    """probe=False lists the backends without running one (the CPU sweep's parent must not compute); a probed
    backend that fails is left out with the reason."""
    import angle_kernels

    def broken(*args, **kwargs):
        raise RuntimeError("broken build")

    monkeypatch.setattr(angle_kernels, "cosine_loss", broken)
    assert P.ours_backends("cpu", probe=False) == (["torch"], {})
    assert P.ours_backends("cpu") == ([], {"torch": "RuntimeError: broken build"})


@pytest.mark.parametrize("locations", [None, "an empty folder"])
def test_an_angle_emb_without_its_loss_file_is_reported_as_missing(tmp_path, monkeypatch, locations):
    """A module named angle_emb that is no package, or a package without loss.py: the hint to install it."""
    spec = types.SimpleNamespace(submodule_search_locations=None if locations is None else [str(tmp_path)])
    monkeypatch.setattr(P.importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(FileNotFoundError, match="angle-emb is not installed"):
        P.find_reference_loss_file()


def test_the_reference_provider_names_the_file_it_runs(all_providers):
    reference = provider_or_skip(all_providers, "angle-emb")
    assert reference.notes["source"] == str(P.find_reference_loss_file())


def test_an_angle_emb_loss_path_that_holds_no_loss_file_is_refused_before_the_sweep(tmp_path, capsys):
    """It was taken, and the table said angle-emb was "not available", as if it were not installed: a mistyped path
    went unnoticed until the sweep had run without its reference."""
    not_a_wheel = tmp_path / "angle_emb-0.6.1-py3-none-any.whl"
    not_a_wheel.write_text("not a zip")
    empty_wheel = tmp_path / "empty-0.0.0-py3-none-any.whl"
    with zipfile.ZipFile(empty_wheel, "w") as zf:
        zf.writestr("other/loss.py", "")
    for given, message in ((tmp_path / "missing.whl", "does not exist"), (tmp_path, "is a folder"),
                           (not_a_wheel, "is no wheel"), (empty_wheel, "holds no angle_emb/loss.py")):
        with pytest.raises(SystemExit) as exit_info:
            bench_losses.parse_args(["--device", "cpu", "--angle-emb-loss", str(given)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert f"--angle-emb-loss: {given}" in err and message in err, err
    loss_file = tmp_path / "loss.py"
    loss_file.write_text("")
    assert bench_losses.parse_args(["--device", "cpu", "--angle-emb-loss", str(loss_file)]).angle_emb_loss == str(
        loss_file)


@pytest.mark.parametrize("flags, message", [
    (["--n", "0"], "--n takes positive sizes"),
    (["--n-quadratic", "256,-1"], "--n-quadratic takes positive sizes"),
    (["--d", "0"], "--d takes positive sizes"),
    (["--threads", "0"], "--threads must be a positive integer"),
    (["--repeats", "0"], "--repeats must be a positive integer"),
    (["--providers", "ours,bogus"], "--providers: unknown provider 'bogus'"),
    (["--providers", ","], "--providers names none"),
    (["--losses", ","], "--losses names none"),
    (["--max-ref-gb", "-1"], "--max-ref-gb must be 0 or more"),
    (["--time-per-case", "nan"], "--time-per-case must be 0 or more"),
    (["--case-timeout", "0"], "--case-timeout must be more than 0 seconds"),
])
def test_bad_flags_are_refused_naming_the_flag_before_the_sweep(capsys, flags, message):
    """Each was taken: sizes of 0 made a cell of our loss's ValueError, --threads 0 a traceback from the probe,
    --repeats 0 a header saying "median of up to 0 runs", an unknown provider an empty sweep."""
    with pytest.raises(SystemExit):
        bench_losses.parse_args(["--device", "cpu", *flags])
    assert message in capsys.readouterr().err


def test_a_plot_panel_within_a_decade_still_labels_its_axis():
    """The panels labelled only decades (1, 10, 100 ms): one whose values lie between two (a single size, 3-8 ms)
    showed no value on its axis at all."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, (within, across) = plt.subplots(1, 2)
    within.set_yscale("log")
    within.plot([256], [3.0], "o")
    within.plot([256], [8.0], "o")
    across.set_yscale("log")
    across.plot([256, 1024], [3.0, 40.0], "o")
    for ax in (within, across):
        loss_sweep.label_y_ticks(ax, FuncFormatter(lambda v, _: f"{v:g}"), NullFormatter())
    fig.canvas.draw()

    def labels(ax):
        low, high = ax.get_ylim()
        ticks = [*ax.yaxis.get_majorticklabels(), *ax.yaxis.get_minorticklabels()]
        return {t.get_text() for t in ticks if t.get_text() and low <= t.get_position()[1] <= high}
    assert {"3", "4", "5", "6", "7", "8"} <= labels(within)
    assert labels(across) == {"10"}
    plt.close(fig)


def test_the_plot_title_wraps_to_a_narrow_figure(tmp_path, monkeypatch):
    """The title is one long line: a sweep of one or two losses, whose figure is 4.2 or 8.4 inches wide, had both ends
    of it cut off (the CPU's name, the torch version)."""
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    args = bench_losses.parse_args(["--losses", "cosine", "--n", "16", "--d", "8", "--device", "cpu"])
    env = {"torch": torch.__version__, "threads": 2, "cpu": "Intel(R) Xeon(R) Processor @ 2.60GHz"}
    loss_sweep.plot([_ok_row("cosine", 16, "ours-torch", "ours", 0.001)], args, [LOSSES["cosine"]], env,
                    tmp_path / "plot.png")
    title = figures[0]._suptitle.get_text()
    assert "\n" in title and title.replace("\n", " ").endswith(f"torch {torch.__version__}")
    assert max(len(line) for line in title.splitlines()) <= 12 * figures[0].get_figwidth()
    monkeypatch.undo()
    plt.close(figures[0])


def test_a_plot_killed_mid_write_leaves_the_previous_plot_whole(tmp_path, monkeypatch):
    """plot.png was written in place, unlike table.md and results.json: a sweep killed while matplotlib wrote it left
    half a png over the previous row's whole one."""
    from matplotlib.figure import Figure

    def killed_mid_write(self, fname, **kwargs):
        Path(fname).write_bytes(b"\x89PNG half")
        raise KeyboardInterrupt

    previous = tmp_path / "plot.png"
    previous.write_bytes(b"the previous row's plot")
    monkeypatch.setattr(Figure, "savefig", killed_mid_write)
    args = bench_losses.parse_args(["--losses", "cosine", "--n", "16", "--d", "8", "--device", "cpu"])
    env = {"torch": torch.__version__, "threads": 2, "cpu": "a CPU"}
    with pytest.raises(KeyboardInterrupt):
        loss_sweep.plot([_ok_row("cosine", 16, "ours-torch", "ours", 0.001)], args, [LOSSES["cosine"]], env, previous)
    assert previous.read_bytes() == b"the previous row's plot"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plot.png"]  # no half a png left beside it


def test_a_plot_of_a_sweep_that_measured_nothing_is_written(tmp_path):
    """Every case skipped (--time-budget 0, or a budget the agreement check spent): the sweep wrote its table and
    JSON, then ended in matplotlib's ValueError (a legend of no entries) where it draws the plot, exit status 1."""
    args = bench_losses.parse_args(["--losses", "cosine", "--n", "16", "--d", "8", "--device", "cpu"])
    env = {"torch": torch.__version__, "threads": 2, "cpu": "a CPU"}
    skipped = {**_ok_row("cosine", 16, "ours-torch", "ours", 0.001), "status": "skipped",
               "note": "skipped: --time-budget 0 s spent"}
    loss_sweep.plot([skipped], args, [LOSSES["cosine"]], env, tmp_path / "plot.png")
    assert (tmp_path / "plot.png").read_bytes()[:4] == b"\x89PNG"


def test_an_output_folder_that_cannot_take_the_results_is_refused_before_work(tmp_path, capsys):
    """--out naming a file, or a folder of committed results, failed in mkdir's traceback or rewrote the committed
    table.md, results.json and plot.png."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    committed = next(p.parent for p in sorted((harness.HERE / "results").glob("*/table.md")))
    for out, said in ((a_file, "is a file, not a folder"), (committed, "would overwrite committed results")):
        with pytest.raises(SystemExit):
            bench_losses.parse_args(["--losses", "cosine", "--device", "cpu", "--out", str(out)])
        assert f"--out {out}: {said}" in capsys.readouterr().err
