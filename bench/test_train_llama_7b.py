"""train_llama_7b.py on its 2-layer --tiny model on CPU: argument checks, results saved after every setting,
the time budget, resuming, and the loss dtype. The GPU numbers themselves are not tested here."""

from __future__ import annotations

import json
import math
import types
from pathlib import Path

import pytest
import torch

import train_llama_7b as T

HERE = Path(__file__).resolve().parent

REAL_MEASURE = T.measure  # the spies below wrap this one, never an earlier spy

# 5 settings: plain 2, 4, 8, then grad cache 8 and 16 pairs.
SMALL = ["--tiny", "--seq-len", "8", "--plain-start", "2", "--plain-max", "8", "--gc-batches", "8,16"]


def args_for(out, *extra):
    return ["--out", str(out), *SMALL, *extra]


def load(out) -> dict:
    return json.loads((Path(out) / "results.json").read_text())


class Killed(Exception):
    """Stands for the command being killed at its time limit in the middle of a setting."""


def spy_measure(monkeypatch, replace=None):
    """Record (mode, pairs) of every measure() call; `replace(mode, pairs, real_row)` may change the result."""
    calls = []

    def measure(encoder, optimizer, loss_fn, pairs, args, config, device, chunk_rows):
        mode = "grad_cache" if chunk_rows else "plain"
        calls.append((mode, pairs))
        row = REAL_MEASURE(encoder, optimizer, loss_fn, pairs, args, config, device, chunk_rows)
        return replace(mode, pairs, row) if replace else row

    monkeypatch.setattr(T, "measure", measure)
    return calls


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--steps", "0", "--steps: expected a whole number >= 1; got 0"),
        ("--seq-len", "-4", "--seq-len: expected a whole number >= 1"),
        ("--gc-batches", "16,8", "--gc-batches: expected positive integers in increasing order"),
        ("--chunk-size", "3", "--chunk-size: expected 0 or a positive even integer"),
        ("--time-budget", "0", "--time-budget: expected a positive number of seconds"),
        ("--plain-max", "1", "--plain-max (1) is smaller than --plain-start (2)"),
    ],
)
def test_bad_arguments_are_refused_by_name(tmp_path, capsys, flag, value, message):
    with pytest.raises(SystemExit) as exit_info:
        T.main(args_for(tmp_path, flag, value))
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "results.json").exists()


def test_results_are_on_disk_after_every_setting(tmp_path, monkeypatch):
    """A command killed during the second setting keeps the first one."""

    def killed_at_the_second(mode, pairs, row):
        if (mode, pairs) == ("plain", 4):
            raise Killed
        return row

    spy_measure(monkeypatch, killed_at_the_second)
    with pytest.raises(Killed):
        T.main(args_for(tmp_path))
    results = load(tmp_path)
    assert [r["pairs"] for r in results["plain"]] == [2]
    assert results["plain"][0]["pairs_per_s"] > 0
    assert "| plain | 2 |" in (tmp_path / "results.md").read_text()


def test_time_budget_stops_before_a_setting_that_would_not_fit(tmp_path, monkeypatch, capsys):
    """On a fake clock where a plain step takes 5 s per pair: plain 2 (20 s with its warm-up) and plain 4
    (40 s) fit in 100 s; plain 8 (estimated 80 s) would end past it, so the run stops and says how to go on."""
    monkeypatch.chdir(HERE.parent)  # the printed command names the script relative to the working directory
    clock = {"t": 0.0}
    monkeypatch.setattr(T, "now", lambda: clock["t"])

    def five_seconds_per_pair(mode, pairs, row):
        row = dict(row, step_s=5.0 * pairs, pairs_per_s=0.2, tokens_per_s=0.2 * 16)
        clock["t"] += 2 * row["step_s"]  # warm-up + one timed step
        return row

    calls = spy_measure(monkeypatch, five_seconds_per_pair)
    assert T.main(args_for(tmp_path, "--time-budget", "100")) == 0  # a normal end: bench/gpu_suite.py expects 0
    assert calls == [("plain", 2), ("plain", 4)]
    results = load(tmp_path)
    assert [r["pairs"] for r in results["plain"]] == [2, 4]
    assert results["left"] == ["plain 8", "grad cache 8", "grad cache 16"]
    out = capsys.readouterr().out
    assert "stopped: plain 8 pairs (estimated 80 s) does not fit in the 40 s left of --time-budget 100 s" in out
    command = " ".join(["python bench/train_llama_7b.py", *args_for(tmp_path, "--time-budget", "100")])
    assert f"to continue, run the same command again:\n  {command}" in out
    assert "done:" not in out


def test_a_setting_longer_than_any_run_is_recorded_as_not_run(tmp_path, monkeypatch):
    """Repeating the command must end: a batch estimated above the whole budget is skipped, not waited for."""
    clock = {"t": 0.0}
    monkeypatch.setattr(T, "now", lambda: clock["t"])
    calls = spy_measure(monkeypatch, lambda mode, pairs, row: dict(row, step_s=30.0 * pairs, pairs_per_s=1 / 30))
    assert T.main(args_for(tmp_path, "--time-budget", "200")) == T.DONE
    # plain 4: 2 x 120 s > 200 s, and the plain sweep ends there; grad cache 8 and 16: longer still.
    assert calls == [("plain", 2)]
    results = load(tmp_path)
    assert [n["setting"] for n in results["not_run"]] == ["plain 4", "grad cache 8", "grad cache 16"]
    assert results["left"] == []


def test_resume_skips_recorded_settings_and_refuses_other_settings(tmp_path, monkeypatch, capsys):
    # First command: plain 8 runs out of memory (recorded, ends the plain sweep), then the command is killed
    # during grad cache 8.
    def oom_then_killed(mode, pairs, row):
        if mode == "plain" and pairs == 8:
            return None
        if mode == "grad_cache":
            raise Killed
        return row

    calls = spy_measure(monkeypatch, oom_then_killed)
    with pytest.raises(Killed):
        T.main(args_for(tmp_path))
    assert calls == [("plain", 2), ("plain", 4), ("plain", 8), ("grad_cache", 8)]
    assert load(tmp_path)["plain"][-1] == {"pairs": 8, "oom": True}

    # The same command again: only what is left runs, and the plain results are still known to it.
    calls = spy_measure(monkeypatch)
    assert T.main(args_for(tmp_path)) == T.DONE
    assert calls == [("grad_cache", 8), ("grad_cache", 16)]
    results = load(tmp_path)
    assert [r["pairs"] for r in results["plain"]] == [2, 4, 8]
    assert [r["pairs"] for r in results["grad_cache"]] == [8, 16]
    assert results["largest_plain_batch"] == 4
    assert results["chunk_rows"] == 4  # texts of the largest plain batch that fit (4 pairs = 8 texts) / 2
    assert results["loss_dtype"] == "float32"  # the CPU default
    assert all(r["overhead_vs_best_plain"] is not None for r in results["grad_cache"])
    assert "done: nothing left to run" in capsys.readouterr().out

    # Once more: nothing to measure.
    calls = spy_measure(monkeypatch)
    assert T.main(args_for(tmp_path)) == T.DONE
    assert calls == []

    # Other settings into the same folder: refused, the results untouched.
    before = (tmp_path / "results.json").read_text()
    assert T.main(args_for(tmp_path, "--seq-len", "16")) == T.ERROR
    assert "seq_len: 8 there, 16 now" in capsys.readouterr().err
    assert T.main(args_for(tmp_path, "--loss-dtype", "bfloat16")) == T.ERROR
    assert "loss_dtype: 'float32' there, 'bfloat16' now" in capsys.readouterr().err
    assert (tmp_path / "results.json").read_text() == before

    # ... unless asked to start over.
    calls = spy_measure(monkeypatch)
    assert T.main(args_for(tmp_path, "--seq-len", "16", "--plain-max", "2", "--gc-batches", "4", "--restart")) == 0
    assert calls == [("plain", 2), ("grad_cache", 4)]
    assert load(tmp_path)["settings"]["seq_len"] == 16


def test_bfloat16_loss_gets_bfloat16_embeddings_and_gradients_reach_the_model(tmp_path, monkeypatch):
    import angle_train.grad_cache as grad_cache

    seen_dtypes, grads_reach_model = [], []
    real_build_loss = T.build_loss

    def build_loss(impl):
        loss_fn = real_build_loss(impl)

        def spy(labels, embeddings):
            seen_dtypes.append(embeddings.dtype)
            return loss_fn(labels, embeddings)

        return spy

    def checking(step):
        def wrapped(model, *a, **kw):
            loss = step(model, *a, **kw)
            lora = [p for name, p in model.named_parameters() if "lora_" in name]
            grads_reach_model.append((step.__name__, any(p.grad is not None and p.grad.abs().sum() > 0 for p in lora)))
            return loss

        return wrapped

    monkeypatch.setattr(T, "build_loss", build_loss)
    monkeypatch.setattr(grad_cache, "plain_step", checking(grad_cache.plain_step))
    monkeypatch.setattr(grad_cache, "grad_cache_step", checking(grad_cache.grad_cache_step))
    argv = ["--out", str(tmp_path), "--tiny", "--seq-len", "8", "--plain-start", "4", "--plain-max", "4",
            "--gc-batches", "8", "--loss-dtype", "bfloat16"]
    assert T.main(argv) == T.DONE
    # plain: warm-up + timed step; grad cache: warm-up step, warm-up loss over all rows, timed step.
    assert seen_dtypes == [torch.bfloat16] * 5
    assert grads_reach_model == [("plain_step", True)] * 2 + [("grad_cache_step", True)] * 2
    results = load(tmp_path)
    assert results["loss_dtype"] == "bfloat16"
    assert results["settings"]["loss_dtype"] == "bfloat16"
    assert all(math.isfinite(r["loss"]) for r in results["plain"] + results["grad_cache"])


@pytest.mark.parametrize(
    "flag, value, message",
    [
        ("--gc-batches", "8,8", "--gc-batches: expected positive integers in increasing order"),
        ("--gc-batches", "0,8", "--gc-batches: expected positive integers in increasing order"),
        ("--time-budget", "inf", "--time-budget: expected a positive number of seconds"),
    ],
)
def test_more_bad_arguments_are_refused_by_name(tmp_path, capsys, flag, value, message):
    with pytest.raises(SystemExit):
        T.parse_args(args_for(tmp_path, flag, value))
    assert message in capsys.readouterr().err


def test_chunk_size_zero_is_accepted():
    """0 is the documented default: chunks as large as the largest plain batch."""
    assert T.parse_args(["--out", "x", "--chunk-size", "0"]).chunk_size == 0


def test_the_warm_up_batch_holds_every_chunk_shape_of_the_step():
    """Plain steps warm up on the whole batch; a grad-cache step on one full chunk plus the last, partial one."""
    assert T.warmup_pairs(10, None) == 10
    assert T.warmup_pairs(3, 8) == 3  # one chunk holds the whole batch
    assert T.warmup_pairs(10, 8) == 6  # 20 texts: chunks of 8, 8 and 4 -> 8 + 4 texts
    assert T.warmup_pairs(8, 8) == 4  # 16 texts: two full chunks -> one


def test_a_settings_row_is_the_median_step_in_pairs_and_tokens_per_second(monkeypatch):
    """On a stand-in clock where the timed steps take 1, 5 and 2 s: the row's step is the median, 2 s; a pair is
    two texts of --seq-len tokens."""
    clock = {"now": 0.0}
    seconds = [100.0, 1.0, 5.0, 2.0]  # the warm-up step, then the timed ones

    def one_step(encoder, optimizer, loss_fn, ids, mask, labels, chunk_rows):
        assert ids.shape == (2 * 4, 8)
        clock["now"] += seconds.pop(0)
        return 0.5

    monkeypatch.setattr(T, "one_step", one_step)
    monkeypatch.setattr(T, "time", types.SimpleNamespace(perf_counter=lambda: clock["now"]))
    optimizer = types.SimpleNamespace(zero_grad=lambda set_to_none: None)
    args = types.SimpleNamespace(steps=3, seq_len=8)
    config = types.SimpleNamespace(vocab_size=100, hidden_size=16)
    row = T.measure(None, optimizer, None, 4, args, config, torch.device("cpu"), None)
    assert row == {"pairs": 4, "pairs_per_s": 2.0, "tokens_per_s": 32.0, "step_s": 2.0, "peak_gb": None, "loss": 0.5}

    def out_of_memory(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(T, "one_step", out_of_memory)
    assert T.measure(None, optimizer, None, 4, args, config, torch.device("cpu"), None) is None


@pytest.mark.parametrize("flag, value, key", [("--lora-r", "8", "lora_r"), ("--steps", "2", "steps"),
                                              ("--chunk-size", "4", "chunk_size"),
                                              ("--plain-start", "4", "plain_start"),
                                              ("--loss-impl", "reference", "loss_impl"),
                                              ("--size", "1b", "model_config")])
def test_results_made_with_another_setting_are_refused(tmp_path, flag, value, key):
    """Every setting a measurement depends on must match for a re-run to continue the stored results."""
    env = {"torch": "2.x", "triton": None}
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"settings": T.settings_of(T.parse_args(["--out", "x"]), "float32", env)}))
    stored, refusal = T.load_results(str(path), T.settings_of(T.parse_args(["--out", "x"]), "float32", env), False)
    assert stored is not None and refusal is None
    other = T.settings_of(T.parse_args(["--out", "x", flag, value]), "float32", env)
    stored, refusal = T.load_results(str(path), other, False)
    assert stored is None and f"{key}: " in refusal
    assert T.load_results(str(path), other, True) == (None, None)  # --restart


@pytest.mark.parametrize("content, message", [("{not json", "cannot be read"), ('{"plain": []}', "has no 'settings'")])
def test_unusable_stored_results_are_refused(tmp_path, content, message):
    path = tmp_path / "results.json"
    path.write_text(content)
    stored, refusal = T.load_results(str(path), {"seq_len": 64}, False)
    assert stored is None and message in refusal and "--restart" in refusal


def test_summary_and_table_of_stored_rows():
    """The overhead is against the plain batch with the best throughput (not the largest); a batch out of memory
    counts for neither largest batch, and is listed as such."""
    row = {"tokens_per_s": 1.0, "step_s": 1.0, "peak_gb": None}
    results = {"settings": {"lora_r": 32, "seq_len": 64, "loss_dtype": "float32"}, "environment": {}, "loss": "x",
               "chunk_rows": 4, "not_run": [], "left": ["grad cache 32"],
               "plain": [dict(row, pairs=2, pairs_per_s=20.0), dict(row, pairs=4, pairs_per_s=16.0),
                         {"pairs": 8, "oom": True}],
               "grad_cache": [dict(row, pairs=16, pairs_per_s=12.0), {"pairs": 32, "oom": True}]}
    T.summarise(results)
    assert results["best_plain_pairs_per_s"] == 20.0
    assert results["grad_cache"][0]["overhead_vs_best_plain"] == pytest.approx(0.4)
    assert results["largest_plain_batch"] == 4 and results["largest_grad_cache_batch"] == 16
    text = T.markdown(results)
    assert "| grad cache (4 texts/chunk) | 16 | 12.0 | 1 | 1.00 | n/a | 40.0% |" in text
    assert "| plain | 8 | out of memory | | | | |" in text and "| plain | 2 | 20.0 | 1 | 1.00 | n/a |  |" in text
    assert "Not measured yet: grad cache 32" in text
    # the model's size in the title: the --tiny model's read "0.0B"
    assert "on a 3.4M LLaMA" in T.markdown({**results, "model": {"parameters": 3_400_000}})
    assert "on a 6.7B LLaMA" in T.markdown({**results, "model": {"parameters": 6_738_000_000}})


def test_estimates_scale_the_nearest_smaller_batch():
    """A step is estimated from the largest smaller batch measured of its sweep; the first grad-cache batch from
    the best plain throughput at 1.5x the cost; a setting adds its warm-up to its timed steps."""
    results = {"plain": [{"pairs": 2, "step_s": 1.0, "pairs_per_s": 2.0},
                         {"pairs": 4, "step_s": 3.0, "pairs_per_s": 4 / 3}, {"pairs": 8, "oom": True}],
               "grad_cache": []}
    assert T.step_estimate(results, "plain", 16) == pytest.approx(12.0)  # 3 s at 4 pairs
    assert T.step_estimate(results, "grad_cache", 16) == pytest.approx(12.0)  # 1.5 x 16 pairs / 2 pairs/s
    assert T.step_estimate({"plain": [], "grad_cache": []}, "plain", 2) is None
    assert T.setting_estimate(results, "grad_cache", 16, steps=2, chunk_rows=8) == pytest.approx(12.0 * (2 + 4 / 16))


@pytest.mark.parametrize("estimate, elapsed, ran_any, verdict", [
    (None, 10.0, False, "run"), (None, 120.0, False, "run"), (None, 120.0, True, "stop"),
    (96.0, 0.0, False, "too long"), (50.0, 60.0, False, "run"), (50.0, 60.0, True, "stop"), (30.0, 60.0, True, "run"),
])
def test_decide_against_the_budget(estimate, elapsed, ran_any, verdict):
    """Budget 100 s, start-up 5 s: a setting above 95 s fits no run; one that fits a fresh run but not what is left
    stops this one, unless nothing ran yet (a run always measures something)."""
    assert T.decide(estimate, elapsed, startup=5.0, budget=100.0, ran_any=ran_any) == verdict


def test_the_settings_left_summarise_the_plain_sweep(tmp_path):
    plan = T.plan_of(T.parse_args(args_for(tmp_path)))
    assert T.left_after({"plain": [], "grad_cache": []}, plan, set()) == [
        "plain 2..8 (doubling until OOM)", "grad cache 8", "grad cache 16"]


def test_the_command_to_continue_drops_restart(tmp_path, monkeypatch, capsys):
    """Repeating --restart would throw away what the stopped run measured."""
    monkeypatch.chdir(HERE.parent)
    clock = {"t": 0.0}
    monkeypatch.setattr(T, "now", lambda: clock["t"])

    def ten_seconds_per_pair(mode, pairs, row):
        clock["t"] += 2 * 10.0 * pairs
        return dict(row, step_s=10.0 * pairs, pairs_per_s=0.1)

    spy_measure(monkeypatch, ten_seconds_per_pair)
    assert T.main(args_for(tmp_path, "--time-budget", "100", "--restart")) == 0
    command = " ".join(["python bench/train_llama_7b.py", *args_for(tmp_path, "--time-budget", "100")])
    assert f"to continue, run the same command again:\n  {command}\n" in capsys.readouterr().out


def test_grad_cache_chunks_stay_the_same_across_runs(tmp_path, monkeypatch):
    """A later run that finds a larger plain batch keeps the chunk of the grad-cache rows already recorded; a
    chunk holds whole pairs (an odd largest plain batch gives one text fewer)."""
    spy_measure(monkeypatch)
    base = ["--out", str(tmp_path / "a"), "--tiny", "--seq-len", "8", "--plain-start", "2"]
    assert T.main([*base, "--plain-max", "4", "--gc-batches", "8"]) == T.DONE
    assert T.main([*base, "--plain-max", "8", "--gc-batches", "8,16"]) == T.DONE
    results = load(tmp_path / "a")
    assert results["largest_plain_batch"] == 8
    assert results["chunk_rows"] == 4 and [r["chunk_rows"] for r in results["grad_cache"]] == [4, 4]
    odd = ["--out", str(tmp_path / "b"), "--tiny", "--seq-len", "8", "--plain-start", "3", "--plain-max", "3"]
    assert T.main([*odd, "--gc-batches", "4"]) == T.DONE
    assert load(tmp_path / "b")["chunk_rows"] == 2


def test_without_a_gpu_only_the_tiny_model_runs(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(T, "build", lambda args, device: pytest.fail("built the model on the CPU"))
    assert T.main(["--out", str(tmp_path)]) == T.ERROR
    assert "no GPU: the 7B benchmark needs one" in capsys.readouterr().out
    assert not (tmp_path / "results.json").exists()


def test_the_tiny_model_takes_cpu_sized_batches_unless_given_others():
    """--tiny took the 7B run's batches (plain up to 65,536 pairs, gradient cache 1,024 to 65,536): on 2 CPU cores
    its 8,192-pair step took 72 s, and the documented smoke test needed a dozen 8-minute invocations."""
    tiny = T.parse_args(["--out", "x", "--tiny"])
    assert (tiny.plain_max, tiny.gc_batches) == (64, [64, 128])
    assert [pairs for _, pairs in T.plan_of(tiny)] == [16, 32, 64, 64, 128]
    gpu = T.parse_args(["--out", "x"])
    assert (gpu.plain_max, gpu.gc_batches) == (65536, [1024, 4096, 16384, 32768, 65536])
    given = T.parse_args(["--out", "x", "--tiny", "--plain-max", "256", "--gc-batches", "512"])
    assert (given.plain_max, given.gc_batches) == (256, [512])
