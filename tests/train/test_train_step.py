"""One optimizer step's arithmetic, against values computed by hand from the same batches: with --grad-accum the
step's loss is the mean of its batches' losses and its gradient their mean (AdamW's first steps barely depend on the
gradient's scale, so a factor of grad_accum in it changes the weights too little for the other tests to see);
--max-grad-norm bounds the gradient AdamW steps with; the schedules follow their formulas; training goes on in
train mode after a dev evaluation (encode() sets eval mode); the logged tokens/s counts real tokens; a dev score
equal to the best is not a new best."""

from __future__ import annotations

import math

import pytest
import torch
from train_helpers import make_encoder, run_config

from angle_train import grad_cache, trainer
from angle_train.tiny import demo_examples, demo_sts_examples


def _norm(tensors) -> float:
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t) for t in tensors])))


@pytest.mark.parametrize("max_grad_norm", [0.0, 1e-4])
def test_a_step_over_accumulated_batches_is_their_mean_and_clipped(tmp_path, max_grad_norm):
    cfg = run_config(tmp_path / "run", batch_size=4, grad_accum=2, max_steps=1, lr=1e-3, warmup=0, max_length=12,
                     seed=3, max_grad_norm=max_grad_norm, log_every=1)
    run = trainer.setup(cfg, model=make_encoder("bert"), train_examples=(demo_examples(16, seed=4), "B"))
    try:
        losses, gradients = [], []
        for batch in trainer.prepare_batches(run, run.epoch_order[:2], options=trainer.plan_options(cfg)):
            run.optimizer.zero_grad(set_to_none=True)
            losses.append(float(grad_cache.plain_step(run.model, batch.chunks, batch.labels, run.loss_fn,
                                                      restore=batch.restore)))
            gradients.append([p.grad.clone() for p in run.encoder.parameters() if p.grad is not None])
        run.optimizer.zero_grad(set_to_none=True)
        mean_gradient = [(a + b) / 2 for a, b in zip(*gradients)]
        stepped_with = []  # the norm of the gradients AdamW steps with
        run.optimizer.register_step_pre_hook(lambda optimizer, args, kwargs: stepped_with.append(_norm(
            [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None])))
        row = trainer.optimizer_step(run)
    finally:
        run.data_ahead.close()
        run.log.close()
        run.lock.release()
    assert row["loss"] == pytest.approx(sum(losses) / 2, rel=1e-9)
    assert row["grad_norm"] == pytest.approx(_norm(mean_gradient), rel=1e-9)  # measured before clipping
    if max_grad_norm:
        assert row["grad_norm"] > 2 * max_grad_norm
        # torch's clipping divides by the norm + 1e-6: at most the bound, within that of it
        assert len(stepped_with) == 1 and max_grad_norm * 0.99 < stepped_with[0] <= max_grad_norm
    else:  # 0: no clipping
        assert stepped_with == [pytest.approx(row["grad_norm"], rel=1e-9)]


@pytest.mark.parametrize("schedule", ["linear", "cosine", "constant"])
def test_the_schedules_follow_their_formulas(tmp_path, schedule):
    """The learning rate after each of 10 steps, 2 of them warming up ((k + 1) / 3 of the rate at step k < 2), then
    decaying over the other 8: linear 1 - p, cosine (1 + cos(pi p)) / 2 at p = (k - 2) / 8."""
    cfg = run_config(tmp_path, schedule=schedule, warmup=2, lr=1.0, max_steps=10)
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    scheduler = trainer.make_schedule(cfg, optimizer, 10)
    rates = [scheduler.get_last_lr()[0]]
    for _ in range(9):
        optimizer.step()
        scheduler.step()
        rates.append(scheduler.get_last_lr()[0])
    decay = {"linear": lambda p: 1 - p, "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
             "constant": lambda p: 1.0}[schedule]
    expected = [1 / 3, 2 / 3] + [decay((k - 2) / 8) for k in range(2, 10)]
    assert rates == pytest.approx(expected, rel=1e-12, abs=1e-15)


def test_training_goes_on_in_train_mode_after_each_evaluation(tmp_path):
    """The dev evaluation embeds with encode(), which switches dropout off for it: the steps after it must train with
    dropout again (ArcCSE's two views of a sentence differ by their dropout masks only)."""
    encoder, tokenizer = make_encoder("bert", dropout=0.2)
    modes = []
    trainer.train(run_config(tmp_path, batch_size=8, max_steps=3, eval_every=1, max_length=12, seed=3),
                  model=(encoder, tokenizer), train_examples=(demo_examples(32, seed=4), "B"),
                  dev_examples=demo_sts_examples(12, seed=5), on_step=lambda step, row: modes.append(encoder.training))
    assert modes == [True, True, True]
    encoder.eval()
    encoder.encode(["a red car"], tokenizer)
    assert not encoder.training  # encode() puts back the mode it found


@pytest.mark.parametrize("grad_accum", [1, 2])
def test_the_logged_tokens_are_the_real_ones(tmp_path, grad_accum):
    """tokens/s counts the texts' real tokens, not the padding the encoder also processed: per pair, a row's
    tokens_per_s / pairs_per_s is the step's real tokens per pair (padded batches here, so padding is there), every
    pair of the step's accumulated batches counted once."""
    seen = []
    next_batches = trainer.next_batches

    def spy(run):
        batches = next_batches(run)
        seen.append(sum(sum(run.dataset.lengths_of(b)) for b in batches) / sum(len(b) for b in batches))
        return batches

    cfg = run_config(tmp_path, batch_size=8, grad_accum=grad_accum, max_steps=3, log_every=1, max_length=12, seed=3,
                     pack=0)
    trainer.next_batches = spy
    try:
        result = trainer.train(cfg, model=make_encoder("bert"), train_examples=(demo_examples(48, seed=4), "B"))
    finally:
        trainer.next_batches = next_batches
    assert all(row["useful_tokens"] < 1 for row in result.history)  # there was padding to leave out
    assert [row["tokens_per_s"] / row["pairs_per_s"] for row in result.history] == pytest.approx(seen, rel=1e-9)


def test_a_dev_score_equal_to_the_best_is_not_a_new_best():
    assert not trainer.improves(0.5, 0.5)
    assert trainer.improves(0.5 + 1e-12, 0.5) and trainer.improves(0.5, None) and trainer.improves(0.5, math.nan)
    assert not trainer.improves(math.nan, 0.5) and not trainer.improves(0.4, 0.5)
