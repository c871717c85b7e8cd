"""A run killed mid-way and resumed from its last checkpoint reproduces the uninterrupted run exactly."""

import json

import pytest
import torch

from angle_train.config import TrainConfig
from angle_train.tiny import demo_examples
from angle_train.trainer import StopTraining, train

CASES = {
    # full fine-tuning, dropout on, plain backprop; 40 examples / 16 per batch: epochs end every 2 steps
    "bert-plain": {"model": "builtin:tiny-bert"},
    # LoRA on a LLaMA, gradient cache (chunks of 6 texts) and 2 accumulated batches per step
    "llama-lora-gradcache": {
        "model": "builtin:tiny-llama",
        "lora": True,
        "lora_r": 4,
        "chunk_size": 6,
        "grad_accum": 2,
    },
}


def _config(out, **overrides):
    base = {
        "train_data": "builtin:demo",
        "batch_size": 8,
        "max_steps": 7,
        "lr": 3e-3,
        "warmup": 2,
        "save_every": 3,
        "keep_checkpoints": 1,
        "output_dir": str(out),
        "progress": False,
        "save_final": False,
        "log_every": 1,
        "max_length": 12,
        "device": "cpu",
        "seed": 7,
    }
    base.update(overrides)
    return TrainConfig(**base)


def _weights(result):
    return {k: v.clone() for k, v in result.encoder.state_dict().items()}


@pytest.mark.parametrize("case", list(CASES))
def test_kill_and_resume_reproduces_the_uninterrupted_run(tmp_path, case):
    data = (demo_examples(20, seed=3), "B")
    full = train(_config(tmp_path / "full", **CASES[case]), train_examples=data)

    def kill_after_step_5(step, row):
        if step == 5:  # the last checkpoint is step 3: steps 4 and 5 are lost and must be redone identically
            raise StopTraining

    killed = train(_config(tmp_path / "run", **CASES[case]), train_examples=data, on_step=kill_after_step_5)
    assert [r["step"] for r in killed.history] == [1, 2, 3, 4, 5]
    resumed = train(_config(tmp_path / "run", resume="auto", **CASES[case]), train_examples=data)
    assert [r["step"] for r in resumed.history] == [4, 5, 6, 7]

    full_losses = [r["loss"] for r in full.history]
    assert [r["loss"] for r in killed.history] == full_losses[:5]
    assert [r["loss"] for r in resumed.history] == full_losses[3:]  # bit-identical, not merely close
    assert [r["lr"] for r in resumed.history] == [r["lr"] for r in full.history[3:]]
    a, b = _weights(full), _weights(resumed)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == list(range(1, 8))  # no step lost or logged twice


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path):
    data = (demo_examples(20, seed=3), "B")
    train(_config(tmp_path / "bert", model="builtin:tiny-bert", max_steps=3), train_examples=data)
    with pytest.raises(ValueError, match="lacks trainable weights"):
        train(
            _config(
                tmp_path / "llama",
                model="builtin:tiny-llama",
                max_steps=3,
                resume=str(tmp_path / "bert" / "checkpoints" / "step-00000003"),
            ),
            train_examples=data,
        )
