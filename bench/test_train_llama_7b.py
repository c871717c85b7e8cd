"""train_llama_7b.py on its 2-layer --tiny model on CPU: argument checks, results saved after every setting,
the time budget, resuming, and the loss dtype. The GPU numbers themselves are not tested here."""

from __future__ import annotations

import json
import math
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
