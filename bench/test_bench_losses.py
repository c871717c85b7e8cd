"""pytest-benchmark cases for the loss providers, at small sizes, plus checks of the harness itself.

    pytest bench/ -q                      # CI: every case runs a few rounds; nothing asserts on time
    pytest bench/ --benchmark-only        # only the timed cases, with pytest-benchmark's statistics
    pytest bench/ --benchmark-only --benchmark-columns=median,iqr,rounds -k "cosine"

The sweep over sizes, with memory, lives in bench_losses.py; these cases are the quick, always-runnable
counterpart (one small size per loss, forward + backward, every provider that is installed).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import providers as P  # noqa: E402

SMALL = {"cosine": (256, 128), "angle": (256, 128), "ibn": (128, 128), "contrastive": (128, 128)}


@pytest.fixture(scope="module")
def all_providers():
    providers, missing = P.available_providers("cpu")
    return {p.name: p for p in providers}, missing


def provider_or_skip(all_providers, name):
    providers, missing = all_providers
    if name not in providers:
        pytest.skip(f"{name} is not available: {missing.get(name, 'not installed')}")
    return providers[name]


PROVIDER_NAMES = ("ours-torch", "angle-emb", "sentence-transformers")


@pytest.mark.parametrize("loss", P.LOSSES)
@pytest.mark.parametrize("name", PROVIDER_NAMES)
def test_forward_backward(benchmark, all_providers, loss, name):
    provider = provider_or_skip(all_providers, name)
    if not provider.provides(loss):
        pytest.skip(f"{name} has no {loss} loss")
    n, d = SMALL[loss]
    inputs = P.build_inputs(loss, n, d, torch.float32, "cpu", seed=P.LOSSES.index(loss))
    leaves = P.grad_leaves(inputs)
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


@pytest.mark.parametrize("loss", P.LOSSES)
def test_providers_compute_the_same_loss(all_providers, loss):
    """The side-by-side comparison is only fair if every provider computes the same thing: values and
    gradients agree to float64 rounding (this is what validates the sentence-transformers adapter)."""
    providers, _ = all_providers
    active = [p for p in providers.values() if p.provides(loss)]
    if len(active) < 2:
        pytest.skip(f"fewer than two providers of {loss} are installed")
    errors = P.check_agreement(active, loss, "cpu", n=37, d=34, dtype=torch.float64, seed=7)
    assert set(errors) == {p.name for p in active[1:]}
    for name, err in errors.items():
        assert err["value"] < 1e-12, (name, err)
        assert err["grad"] < 1e-10, (name, err)


def test_adapter_feeds_sentence_transformers_the_given_embeddings(all_providers):
    """PrecomputedEmbeddings must hand each column's tensor through untouched: CoSENTLoss on two columns
    equals its compute_loss_from_embeddings on the same tensors, and the gradient reaches them."""
    provider_or_skip(all_providers, "sentence-transformers")
    try:
        from sentence_transformers.sentence_transformer import losses
    except ImportError:
        from sentence_transformers import losses

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


def test_reference_loads_from_a_wheel(tmp_path):
    """On the GPU image only the angle-emb wheel is carried: its loss.py must load from the zip."""
    try:
        installed = P.find_reference_loss_file()
    except FileNotFoundError:
        pytest.skip("angle-emb is not installed")
    wheel = tmp_path / "angle_emb-0.6.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(installed, "angle_emb/loss.py")
    from_wheel = P.load_reference_module(str(wheel))
    from_file = P.load_reference_module(str(installed))
    gen = torch.Generator().manual_seed(5)
    y_pred = torch.randn(12, 8, generator=gen)
    y_true = torch.tensor([0.0, 0.0, 1.0, 1.0, 2.0, 2.0] * 2).unsqueeze(1)
    assert torch.equal(from_wheel.cosine_loss(y_true, y_pred), from_file.cosine_loss(y_true, y_pred))
    with pytest.raises(FileNotFoundError, match="does not exist"):
        P.find_reference_loss_file(str(tmp_path / "missing.py"))


def test_memory_estimates_grow_as_the_baselines_do():
    """The skip decision rests on these: quadratic for the eager baselines, linear for ours."""
    ref = P.Provider("angle-emb", "reference", {"cosine": ""}, make=None)
    ours = P.Provider("ours-torch", "ours", {"cosine": ""}, make=None)
    small, large = (P.estimate_extra_bytes(ref, "cosine", n, 768, torch.float32) for n in (4096, 16384))
    assert 8 < large / small <= 16  # N^2 term plus a linear part
    small, large = (P.estimate_extra_bytes(ours, "cosine", n, 768, torch.float32) for n in (4096, 16384))
    assert large == 4 * small
    # the reference's cosine loss at N = 16384 needs about 4.1 GB (the project guide shared/docs/measuring.md): the estimate errs high
    assert 4.1e9 < P.estimate_extra_bytes(ref, "cosine", 16384, 768, torch.float32) < 8e9


def test_script_end_to_end(tmp_path):
    """bench_losses.py at tiny sizes writes a table, JSON and a plot, and skips what exceeds the budget.

    Runs as a subprocess: the script forks one child per case, which is only safe from a process that
    has not yet run a parallel (OpenMP) torch op, and this pytest process has.
    """
    out = tmp_path / "out"
    cmd = [sys.executable, str(HERE / "bench_losses.py"), "--losses", "cosine,ibn", "--n", "16,64",
           "--n-quadratic", "16", "--d", "32", "--providers", "ours,reference", "--repeats", "3",
           "--max-ref-gb", "0.00005", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    table = (out / "table.md").read_text()
    data = json.loads((out / "results.json").read_text())
    assert (out / "plot.png").stat().st_size > 10_000
    rows = {(r["loss"], r["n"], r["provider"]): r for r in data["results"]}
    # the reference's N^2 estimate at N=64 (~65 kB) exceeds the 50 kB budget: skipped with a marker
    assert rows[("cosine", 64, "angle-emb")]["status"] == "skipped"
    assert "skipped: needs" in rows[("cosine", 64, "angle-emb")]["note"]
    assert rows[("cosine", 16, "angle-emb")]["status"] == "ok"
    if ("cosine", 16, "ours-torch") in rows:  # ours imports in this checkout
        ours = rows[("cosine", 16, "ours-torch")]
        assert ours["status"] == "ok" and ours["median_s"] > 0 and len(ours["times_s"]) == 3
        assert "| 16 |" in table and "÷ ours-torch" in table
        for err in data["agreement_checks"]["cosine"].values():
            assert err["value"] < 1e-12 and err["grad"] < 1e-10


def test_cuda_memory_is_measured_on_a_warm_run():
    """The first call at a shape compiles and autotunes (Triton's autotuner allocates do_bench's 256 MB
    L2-flush buffer): the reported peak must be that of a later run, not of the first."""
    import bench_losses

    class FakeCudaMemory:  # torch.cuda's four memory functions, over a counter the "loss" below moves
        allocated = peak = 0

        def synchronize(self):
            pass

        def reset_peak_memory_stats(self):
            self.peak = self.allocated

        def memory_allocated(self):
            return self.allocated

        def max_memory_allocated(self):
            return self.peak

    memory = FakeCudaMemory()
    calls = []
    leaf = torch.zeros(3, requires_grad=True)

    def run():  # the first call holds 256 MB for a while (autotuning), every call 10 MB (the loss's workspace)
        transient = (256 if not calls else 0) * 2**20 + 10 * 2**20
        memory.peak = max(memory.peak, memory.allocated + transient)
        calls.append(1)
        return (leaf * 2).sum()

    value, extra, seconds = bench_losses.warm_peak_extra_bytes(run, [leaf], memory)
    assert len(calls) == 2 and extra == 10 * 2**20 and seconds >= 0
    assert leaf.grad is not None and float(value) == 0.0


def test_sweep_writes_its_outputs_after_every_case(tmp_path, monkeypatch):
    """A sweep killed from outside (the GPU machine stops a command at 10 minutes) keeps what it measured."""
    import bench_losses

    args = bench_losses.parse_args(["--losses", "cosine", "--n", "16,32", "--d", "8", "--providers", "ours",
                                    "--device", "cpu", "--out", str(tmp_path), "--no-plot"])
    provider = P.Provider("ours-torch", "ours", {"cosine": "angle_kernels.cosine_loss"}, make=None)
    measured = []

    def fake_run_one(args, provider, loss, n, d, dtype, previous, limits, deadline=None):
        if measured:
            raise KeyboardInterrupt("the machine's time limit")
        measured.append(n)
        return {"status": "ok", "median_s": 0.01, "min_s": 0.01, "time_s": 0.01, "extra_bytes": 1000,
                "floor": P.work_floor(loss, n, d, dtype), "rate": 1.0, "rate_unit": "B/s", "rate_fraction": None}

    monkeypatch.setattr(bench_losses, "run_one", fake_run_one)
    env = {"date": "now", "command": "test", "torch": torch.__version__, "threads": 1, "cpu": "test"}
    report = bench_losses.Report(tmp_path, env, args, {}, {}, {}, ["ours-torch"], "ours-torch")
    with pytest.raises(KeyboardInterrupt):
        bench_losses.sweep(args, [provider], {}, on_row=lambda rows: report.write(rows, complete=False))
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["complete"] is False and [r["n"] for r in data["results"]] == [16]
    assert "| 16 |" in (tmp_path / "table.md").read_text()


def test_time_budget_skips_what_does_not_fit(tmp_path):
    """--time-budget 0: nothing is measured, every case is marked, and the outputs are still complete."""
    out = tmp_path / "out"
    cmd = [sys.executable, str(HERE / "bench_losses.py"), "--losses", "cosine", "--n", "16,64", "--d", "32",
           "--providers", "ours", "--time-budget", "0", "--no-plot", "--no-check", "--out", str(out)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
    assert data["complete"] is True and len(data["results"]) == 2
    assert all(r["status"] == "skipped" and "--time-budget" in r["note"] for r in data["results"])


def test_providers_can_be_narrowed_to_some_of_our_backends():
    """The GPU run leaves out a backend that failed its probe: it must not even be probed (a CUDA error in it
    would lose the process's CUDA context for every other provider)."""
    providers, missing = P.available_providers("cpu", include=["ours-torch"], probe=False)
    assert [p.name for p in providers] == ["ours-torch"] and missing == {}
    assert P.ours_backends("cpu", probe=False, only={"triton"}) == ([], {})
