"""The training loop's bookkeeping at its edges: a run whose length is not a multiple of its intervals, a run
without dev data or without --save-best, data that makes exactly one step, fractional epochs, a warm-up of one step,
the learning-rate curve's warm-up corner, the peak-memory figure's unit, the built-in graded data's scale."""

from __future__ import annotations

import resource
import types

import pytest
import torch
from train_helpers import run_config

from angle_train import tracking
from angle_train.config import TrainConfig
from angle_train.tiny import demo_examples, demo_sts_examples
from angle_train.trainer import count_steps, lr_curve, make_schedule, train, warmup_steps


def test_the_last_step_is_scored_and_logged_and_no_best_is_kept_without_save_best(tmp_path):
    """5 steps, evaluating and logging every 2: the last step (5) is still scored and logged (its model could be
    the best; the final row is what the run ends on). With save_best off, best/ is never written and the result
    names no best path. The peak memory is in GiB: a CPU process holding torch is well past 50 MiB."""
    cfg = run_config(tmp_path, model="builtin:tiny-bert", batch_size=8, max_steps=5, eval_every=2, log_every=2,
                     max_length=16, cosine_w=1.0, ibn_w=0.0, angle_w=1.0, save_best=False)
    result = train(cfg, train_examples=(demo_sts_examples(64, seed=4), "A"), dev_examples=demo_sts_examples(32))
    assert [e["step"] for e in result.evals] == [2, 4, 5]
    assert [r["step"] for r in tracking.read_metrics(str(tmp_path / "metrics.jsonl")) if "loss" in r] == [2, 4, 5]
    assert not (tmp_path / "best").exists() and result.best_path is None
    peak = result.history[-1]["peak_mem_gb"]
    assert 0.05 < peak <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20 + 1e-6


def test_data_of_exactly_one_step_trains_and_no_dev_data_names_no_best_metric(tmp_path):
    """8 examples at batch size 4 with 2 accumulated batches are one optimizer step, taken (not refused); a run
    without dev data has no best metric (None, as TrainResult documents)."""
    cfg = run_config(tmp_path, model="builtin:tiny-bert", batch_size=4, grad_accum=2, epochs=1, max_length=16)
    result = train(cfg, train_examples=(demo_examples(8), "B"))
    assert [r["step"] for r in result.history] == [1]
    assert result.best_metric is None and result.best_score is None


def test_fractional_epochs_round_down_and_a_warmup_of_one_is_one_step():
    """--epochs 1.5 over 3 steps an epoch is 4 whole steps (not 5); --warmup 1 is one step (values >= 1 count steps,
    below 1 a fraction of the run)."""
    assert count_steps(TrainConfig(batch_size=4, epochs=1.5), n_examples=12, world_size=1) == 4
    assert warmup_steps(TrainConfig(warmup=1.0), total_steps=100) == 1
    assert warmup_steps(TrainConfig(warmup=0.1), total_steps=100) == 10


def test_the_learning_rate_curve_holds_the_warmups_corner_off_its_grid():
    """The curves' learning-rate panel samples a long schedule every total // 2000 steps; the warmup's end (its
    peak) is among the points even where the grid misses it: 5,003 steps sampled every 2, a warmup of 7."""
    cfg = TrainConfig(warmup=7, lr=1e-3)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    run = types.SimpleNamespace(cfg=cfg, total_steps=5003, scheduler=make_schedule(cfg, optimizer, 5003))
    curve = dict(lr_curve(run))
    assert 7 in curve and curve[7] == max(curve.values()) and 5003 in curve


def test_the_builtin_graded_pairs_are_labelled_on_the_sts_scale():
    """builtin:demo-sts labels are how many of three attributes two phrases share, on STS's 0-5 scale."""
    labels = {example.label for example in demo_sts_examples(256)}
    assert labels <= {0.0, 5.0 / 3, 10.0 / 3, 5.0} and max(labels) == pytest.approx(5.0)
