"""Checkpoints: a run killed mid-way and resumed reproduces the uninterrupted run exactly; resuming refuses
what would skip or repeat data, another model's weights, and files that would run code when loaded."""

import dataclasses
import json
import os
import random
import re
import shutil

import numpy
import pytest
import torch
from train_helpers import make_encoder, run_config, version_1_epoch_batches

from angle_train.checkpoint import (
    Position, checkpoint_path, checkpoint_problem, load_checkpoint, save_checkpoint, write_manifest,
)
from angle_train.distributed import DistInfo
from angle_train.safe_loading import UnsafeCheckpointError
from angle_train.data import Example, data_fingerprint, order_fingerprint, sampled_data_fingerprint
from angle_train import tracking
from angle_train.tiny import demo_examples, demo_sts_examples
from angle_train.trainer import StopTraining, make_optimizer, make_schedule, train

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


pytestmark = pytest.mark.usefixtures("no_curves")


def _config(out, **overrides):
    base = {"batch_size": 8, "max_steps": 7, "lr": 3e-3, "warmup": 2, "save_every": 3, "keep_checkpoints": 1,
            "log_every": 1, "max_length": 12, "seed": 7}
    return run_config(out, **{**base, **overrides})


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
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        f.write('{"step": 6, "lo')  # a metrics row torn by the kill
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
    train(_config(tmp_path / "bert", model="builtin:tiny-bert", pooling="avg", max_steps=3), train_examples=data)
    with pytest.raises(ValueError, match="--model: 'builtin:tiny-bert' -> 'builtin:tiny-llama'.*decide what its "
                                         "weights compute"):
        train(
            _config(
                tmp_path / "llama",
                model="builtin:tiny-llama",
                max_steps=3,
                resume=str(tmp_path / "bert" / "checkpoints" / "step-00000003"),
            ),
            train_examples=data,
        )
    checkpoint = str(tmp_path / "bert" / "checkpoints" / "step-00000003")
    with pytest.raises(ValueError, match="lacks trainable weights"):  # a model given to train(): by its weights
        train(_config(tmp_path / "llama2", max_steps=3, resume=checkpoint), model=make_encoder("llama", pooling="avg"),
              train_examples=data)


@pytest.mark.parametrize("change", [dict(lora_alpha=64), dict(pooling="avg"), dict(bidirectional=True),
                                    dict(prompt="angle"), dict(query_prompt="query: {text}"),
                                    dict(doc_prompt="passage: {text}"), dict(model="base-moved")])
def test_resume_refuses_settings_that_change_what_the_weights_compute(tmp_path, change, capsys, monkeypatch):
    """A LoRA run resumed with another --lora-alpha, --pooling, --bidirectional, --prompt, --query-prompt or
    --doc-prompt (or another base model) went on silently, training another model under the checkpoint's name (its
    adapter recorded with the new alpha). They are refused; --model's folder is compared by where it is (a relative
    path, a folder moved since the checkpoint: the same model), and a changed --max-length is said, as it applies from
    the resumed step on, and --lora-alpha 32.0 is the checkpoint's 32."""
    from angle_train.models import prepare_tokenizer
    from angle_train.tiny import build_backbone, build_tokenizer

    base, tokenizer = tmp_path / "base", prepare_tokenizer(build_tokenizer(), True)
    build_backbone("builtin:tiny-llama", len(tokenizer), hidden_size=32, layers=2).save_pretrained(base)
    tokenizer.save_pretrained(base)
    data = (demo_examples(20, seed=3), "B")
    settings = dict(model=str(base), lora=True, lora_r=4, pooling="last", max_steps=4)
    train(_config(tmp_path / "run", **settings), train_examples=data, on_step=_stop_at(3))  # a checkpoint at step 3
    if change.get("model") == "base-moved":  # the folder moved, resumed from elsewhere by a relative path
        base.rename(tmp_path / "moved")
        monkeypatch.chdir(tmp_path)
        # --lora-alpha 32.0 is the checkpoint's 32 (the default) as a flag reads it: not another scale
        resumed = train(_config(tmp_path / "run", **{**settings, "model": "moved", "max_length": 10, "lora_alpha": 32.0,
                                                      "resume": "auto"}), train_examples=data)
        assert [row["step"] for row in resumed.history] == [4]
        assert "resuming with changed settings (--max-length 12 -> 10)" in capsys.readouterr().out
        return
    with pytest.raises(ValueError, match=f"cannot resume from .*{next(iter(change)).replace('_', '-')}"):
        train(_config(tmp_path / "run", **{**settings, **change, "resume": "auto"}), train_examples=data)


def test_a_lora_alpha_that_is_not_whole_trains_resumes_and_exports(tmp_path):
    """--lora-alpha 16.5 (peft takes any positive alpha): the run resumes with 16.5 and is refused with 16 (the
    checkpoint's weights at another scale), and exports an adapter that loads scaled by 16.5 / r, recorded as 16.5 in
    config.json, its adapter_config.json, the model card's command and its LoRA line."""
    from peft.tuners.lora import LoraLayer

    from angle_train import load_pretrained

    data = (demo_examples(20, seed=3), "B")
    settings = dict(model=_base_model(tmp_path / "base"), lora=True, lora_r=4, lora_alpha=16.5, max_steps=4,
                    save_final=True)
    train(_config(tmp_path / "run", **settings), train_examples=data, on_step=_stop_at(3))  # a checkpoint at step 3
    with pytest.raises(ValueError, match=r"cannot resume from .*\(--lora-alpha: 16\.5 -> 16\)"):
        train(_config(tmp_path / "run", **{**settings, "lora_alpha": 16, "resume": "auto"}), train_examples=data)
    resumed = train(_config(tmp_path / "run", **{**settings, "resume": "auto"}), train_examples=data)
    assert [row["step"] for row in resumed.history] == [4]
    final = tmp_path / "run" / "final"
    for written in (tmp_path / "run" / "config.json", final / "adapter" / "adapter_config.json"):
        assert json.loads(written.read_text())["lora_alpha"] == 16.5, written
    card = (final / "README.md").read_text()
    assert "--lora-r 4 --lora-alpha 16.5 " in card and "- LoRA: rank 4, alpha 16.5, dropout 0.05 on " in card
    adapter = load_pretrained(str(final / "adapter"))[0]
    assert {layer.scaling["default"] for layer in adapter.modules() if isinstance(layer, LoraLayer)} == {16.5 / 4}


def test_a_resume_with_another_lora_rslora_is_refused():
    """--lora-rslora scales the checkpoint's adapters (alpha / sqrt(r) against alpha / r) without changing their
    shapes, so its weights would load and train on at another scale: a resume with another value is refused as
    another --lora-alpha is, naming the flag (the checkpoint's settings compared before anything loads); the same
    value, and a checkpoint written before the setting was recorded, resume."""
    from angle_train.checkpoint import _refuse_another_model
    from angle_train.config import TrainConfig

    saved = dataclasses.asdict(TrainConfig(lora=True, lora_rslora=True).validate())
    with pytest.raises(ValueError, match=r"^cannot resume from ckpt: these settings differ from the checkpoint's "
                                         r"\(--lora-rslora: True -> False\), and they decide what its weights "
                                         "compute"):
        _refuse_another_model("ckpt", saved, TrainConfig(lora=True).validate())
    _refuse_another_model("ckpt", saved, TrainConfig(lora=True, lora_rslora=True).validate())
    _refuse_another_model("ckpt", {k: v for k, v in saved.items() if k != "lora_rslora"},
                          TrainConfig(lora=True).validate())


def _base_model(folder, seed=0, **config) -> str:
    """A tiny LLaMA (its weights drawn from `seed`, its config updated by `config`) saved with its tokenizer in
    `folder`, a --model folder."""
    from angle_train.models import prepare_tokenizer
    from angle_train.tiny import build_backbone, build_tokenizer

    tokenizer = prepare_tokenizer(build_tokenizer(), True)
    backbone = build_backbone("builtin:tiny-llama", len(tokenizer), hidden_size=32, layers=2, seed=seed)
    backbone.config.update(config)
    backbone.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def test_resume_refuses_another_model_under_a_name_that_leads_nowhere_or_in_a_folder_changed_since(tmp_path):
    """A checkpoint whose --model leads nowhere here (a hub name, a folder moved since) took any local folder as
    --model, the trained weights' names and shapes alone deciding: a LoRA run went on over another base model of the
    same shapes, silently. The checkpoint records the model's config and a fingerprint of its frozen weights now: a
    folder of the same model resumes; another model, or the checkpoint's own folder with other files in it since, is
    refused naming --resume and --model."""
    data = (demo_examples(20, seed=3), "B")
    settings = dict(model=_base_model(tmp_path / "base"), lora=True, lora_r=4, pooling="last", max_steps=4)
    train(_config(tmp_path / "run", **settings), train_examples=data, on_step=_stop_at(3))
    checkpoint = str(tmp_path / "run" / "checkpoints" / "step-00000003")
    (tmp_path / "base").rename(tmp_path / "snapshot")  # the checkpoint's --model leads nowhere now, as a hub name
    others = {"weights": _base_model(tmp_path / "other-weights", seed=1),
              "config": _base_model(tmp_path / "other-config", rms_norm_eps=1e-3)}
    for kind, other in others.items():
        with pytest.raises(ValueError, match=f"cannot resume from {re.escape(checkpoint)} \\(--resume\\) with --model "
                                             f"{re.escape(other)}: it is not the model the checkpoint trained .*its "
                                             f"{'frozen weights differ' if kind == 'weights' else 'config differs'}"):
            train(_config(tmp_path / f"into-{kind}", **{**settings, "model": other, "resume": checkpoint}),
                  train_examples=data)
    resumed = train(_config(tmp_path / "into-snapshot", **{**settings, "model": str(tmp_path / "snapshot"),
                                                              "resume": checkpoint}), train_examples=data)
    assert [row["step"] for row in resumed.history] == [4]
    shutil.copytree(others["weights"], tmp_path / "base")  # the checkpoint's own folder, holding another model
    with pytest.raises(ValueError, match="it is not the model the checkpoint trained .*frozen weights differ"):
        train(_config(tmp_path / "into-changed", **{**settings, "resume": checkpoint}), train_examples=data)


def _record_base_model(checkpoint: str, version: str, **config) -> None:
    """Rewrite a checkpoint's record of its model (checkpoint.base_model_record) as transformers `version` wrote it,
    its config's keys set to `config` (None: left out), and its manifest to match."""
    state = torch.load(os.path.join(checkpoint, "state.pt"), weights_only=True)
    written = json.loads(state["base_model"]["config"])
    written.update(config)
    state["base_model"].update(transformers_version=version, config=json.dumps(
        {k: v for k, v in written.items() if v is not None or k == "head_dim"}, sort_keys=True))
    torch.save(state, os.path.join(checkpoint, "state.pt"))
    write_manifest(checkpoint)


def test_resume_under_another_transformers_version_takes_its_model_whose_config_it_wrote_another_way(tmp_path,
                                                                                                      capsys):
    """The checkpoint's config was compared key by key with the model's as this transformers version writes it: after
    an upgrade that writes the same model's config another way (LLaMA's rope_scaling and rope_theta as
    rope_parameters, head_dim unset made explicit), a resume of the same model was refused with no way on. The
    checkpoint records the transformers version: under another one its config is first written as this version
    writes it, and a difference left is said in a line, the model type and the frozen weights deciding. Another
    model's weights are refused as before, and so is a config that differs under the same version. A model given to
    train() is named as such (the refusal said --model and the flag's default)."""
    from transformers import __version__

    from angle_train import checkpoint as checkpoints
    from angle_train.trainer import build_encoder

    data = (demo_examples(20, seed=3), "B")
    settings = dict(model=_base_model(tmp_path / "base"), lora=True, lora_r=4, pooling="last", max_steps=4)
    train(_config(tmp_path / "run", **settings), train_examples=data, on_step=_stop_at(3))
    checkpoint = str(tmp_path / "run" / "checkpoints" / "step-00000003")
    (tmp_path / "base").rename(tmp_path / "snapshot")  # leads nowhere, as a hub name: the model it loads decides
    settings["model"] = str(tmp_path / "snapshot")
    older = dict(rope_parameters=None, rope_scaling=None, rope_theta=10000.0, head_dim=None)  # as 4.44 writes it
    _record_base_model(checkpoint, __version__, **older)  # the same version: compared key by key
    with pytest.raises(ValueError, match=r"it is not the model the checkpoint trained .*: its config differs "
                                         r"\(head_dim: None -> 8\)\. Give --model the checkpoint's model"):
        train(_config(tmp_path / "same-version", **settings, resume=checkpoint), train_examples=data)
    _record_base_model(checkpoint, "4.44.2", **older)
    capsys.readouterr()
    resumed = train(_config(tmp_path / "upgraded", **settings, resume=checkpoint), train_examples=data)
    assert [row["step"] for row in resumed.history] == [4] and "config differs" not in capsys.readouterr().out
    _record_base_model(checkpoint, "4.44.2", rms_norm_eps=1e-5)  # a difference this version does not turn back
    resumed = train(_config(tmp_path / "noted", **settings, resume=checkpoint), train_examples=data)
    assert [row["step"] for row in resumed.history] == [4]
    assert (f"resuming with --model {settings['model']}, whose config differs from the checkpoint's (rms_norm_eps: "
            f"1e-05 -> 1e-06), which transformers 4.44.2 wrote and this run's {__version__} reads: another version may "
            "write the same model's settings another way, so the model type and the weights decide (its frozen "
            "weights match the checkpoint's)") in capsys.readouterr().out
    other = {**settings, "model": _base_model(tmp_path / "other", seed=1)}
    with pytest.raises(ValueError, match=r"with --model .*other: it is not the model the checkpoint trained "
                                         r"\(--model '.*base'\): its frozen weights differ"):
        train(_config(tmp_path / "other-weights", **other, resume=checkpoint), train_examples=data)
    given = build_encoder(_config(tmp_path / "given", **other), torch.device("cpu"))
    with pytest.raises(ValueError, match=r"with the model given to train\(\): it is not the model the checkpoint "
                                         r"trained \(--model '.*base'\): its frozen weights differ .*\. Give train\(\) "
                                         "the checkpoint's model, or start a new run"):
        train(_config(tmp_path / "given", **settings, resume=checkpoint), train_examples=data, model=given)
    record = {"config": json.dumps({"model_type": "bert", "hidden_size": 32}), "transformers_version": "4.44.2",
              "weights": "0", "weights_dtype": ""}
    with pytest.raises(ValueError, match=r"its config differs \(model_type: 'bert' -> 'llama'\)"):
        checkpoints._compare_base_model("ck", {"model": "m"}, _config(tmp_path / "x", **settings), record, {
            **record, "config": json.dumps({"model_type": "llama", "hidden_size": 32}),
            "transformers_version": __version__}, config_class=type(given[0].backbone.config))


def test_resume_compares_the_prompts_by_their_templates_and_says_a_changed_lora_dropout(tmp_path, capsys):
    """A prompt spelled another way (--prompt angle, then Prompts.A or the template itself; a --query-prompt that is
    the --prompt it defaults to) was refused as a change of what the weights compute: the templates each role of a
    text gets are compared now, and another one is still refused. A changed --lora-dropout applied from the resumed
    step without a word: it is said now, as a changed loss setting is."""
    from angle_train.data import ANGLE_PROMPT

    data = (demo_examples(20, seed=3), "B")
    settings = dict(model="builtin:tiny-llama", lora=True, lora_r=4, pooling="last", prompt="angle", max_length=32,
                    max_steps=4)
    train(_config(tmp_path / "run", **settings), train_examples=data, on_step=_stop_at(3))
    checkpoint = str(tmp_path / "run" / "checkpoints" / "step-00000003")
    for i, same in enumerate([dict(prompt="Prompts.A"), dict(prompt=ANGLE_PROMPT),
                              dict(query_prompt="angle", doc_prompt=ANGLE_PROMPT)]):
        resumed = train(_config(tmp_path / f"same-{i}", **{**settings, **same, "resume": checkpoint}),
                        train_examples=data)
        assert [row["step"] for row in resumed.history] == [4]
    with pytest.raises(ValueError, match=r"cannot resume from .*\(--prompt: 'angle' -> 'Prompts.B'\)"):
        train(_config(tmp_path / "other", **{**settings, "prompt": "Prompts.B", "resume": checkpoint}),
              train_examples=data)
    capsys.readouterr()
    train(_config(tmp_path / "dropout", **{**settings, "lora_dropout": 0.3, "resume": checkpoint}),
          train_examples=data)
    assert "resuming with changed settings (--lora-dropout 0.05 -> 0.3): they apply from step 3 on" in (
        capsys.readouterr().out)


def test_a_checkpoint_killed_while_being_written_is_never_resumed_from(tmp_path, monkeypatch):
    import angle_train.checkpoint as checkpoint

    data = (demo_examples(20, seed=3), "B")
    real_rng_state = checkpoint._rng_state

    def killed_at_step_6():
        if os.path.exists(os.path.join(checkpoint_path(str(tmp_path), 6) + ".tmp", "state.pt")):
            raise StopTraining  # the kill lands after state.pt is written, before the RNG file
        return real_rng_state()

    monkeypatch.setattr(checkpoint, "_rng_state", killed_at_step_6)
    killed = train(_config(tmp_path, keep_checkpoints=2), train_examples=data)
    assert [r["step"] for r in killed.history] == [1, 2, 3, 4, 5, 6]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-00000003", "step-00000006.tmp"]
    monkeypatch.setattr(checkpoint, "_rng_state", real_rng_state)
    resumed = train(_config(tmp_path, keep_checkpoints=2, resume="auto"), train_examples=data)
    assert [r["step"] for r in resumed.history] == [4, 5, 6, 7]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-00000003", "step-00000006"]


def test_a_new_run_or_other_data_settings_are_refused_where_a_run_left_checkpoints(tmp_path):
    data = (demo_examples(20, seed=3), "B")
    train(_config(tmp_path, max_steps=3), train_examples=data)
    with pytest.raises(ValueError, match="holds an earlier run .checkpoints.*--resume auto"):
        train(_config(tmp_path, max_steps=3), train_examples=data)
    with pytest.raises(ValueError, match=r"cannot resume .*--batch-size: 8 -> 4.*would skip or repeat training data"):
        train(_config(tmp_path, max_steps=3, batch_size=4, resume="auto"), train_examples=data)
    with pytest.raises(ValueError, match=r"cannot resume .*--grad-accum: 1 -> 2.*would skip or repeat training data"):
        train(_config(tmp_path, max_steps=3, grad_accum=2, resume="auto"), train_examples=data)


@pytest.mark.parametrize("shorter,first,longer,refusal,change", [
    ({"max_steps": 3}, {"max_steps": 4}, {"max_steps": 6}, "ends at step 3 (--max-steps 3)", "--max-steps 4 -> 6"),
    ({"max_steps": 0, "epochs": 1.0}, {"max_steps": 0, "epochs": 2.0}, {"max_steps": 0, "epochs": 3.0},  # 2 steps
     "ends at step 2 (--epochs 1)", "--epochs 2.0 -> 3.0"),                                            # an epoch
])
def test_a_finished_run_is_extended_by_a_longer_resume_and_a_shorter_one_is_refused(tmp_path, capsys, shorter, first,
                                                                                    longer, refusal, change):
    """Resumed with a larger --max-steps (or --epochs), a finished run goes on through the batches a run of that
    length takes from the start (at a constant learning rate: the same losses and weights, bit for bit), saying what
    changed; a length that ends before the checkpoint's step is refused before anything is written."""
    data = (demo_examples(20, seed=3), "B")
    constant = {"schedule": "constant", "warmup": 0, "save_every": 2, "save_final": True}
    full = train(_config(tmp_path / "full", **longer, **constant), train_examples=data)
    train(_config(tmp_path / "run", **first, **constant), train_examples=data)
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    with pytest.raises(ValueError, match=rf"it is at step 4, and this run {re.escape(refusal)}.*--max-steps 4 or more"):
        train(_config(tmp_path / "run", resume="auto", **shorter, **constant), train_examples=data)
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics
    capsys.readouterr()
    extended = train(_config(tmp_path / "run", resume="auto", **longer, **constant), train_examples=data)
    assert f"resuming with changed settings ({change}): from step 4 on" in capsys.readouterr().out
    assert [r["step"] for r in extended.history] == [5, 6]
    assert [(r["loss"], r["lr"]) for r in extended.history] == [(r["loss"], r["lr"]) for r in full.history[4:]]
    a, b = _weights(full), _weights(extended)
    assert all(torch.equal(a[k], b[k]) for k in a)
    rows = tracking.read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3, 4, 5, 6]
    # the model card's command is the last run's: it lists what each resume changed, and from which step (its card
    # named the longer run's settings alone, as if the first steps had been trained with them)
    card = (tmp_path / "run" / "final" / "README.md").read_text()
    assert f"Resumed with changed settings: at step 4, {change} (the command above is the last run's)." in card
    further = {k: v + 2 if k == "max_steps" and v else v + 1.0 if k == "epochs" else v for k, v in longer.items()}
    train(_config(tmp_path / "run", resume="auto", **further, **constant, lr=1e-4), train_examples=data)
    card = (tmp_path / "run" / "final" / "README.md").read_text()
    flag, _ = change.split(" ", 1)
    further_change = f"--lr 0.003 -> 0.0001, {flag} {'6 -> 8' if flag == '--max-steps' else '3.0 -> 4.0'}"
    assert f"Resumed with changed settings: at step 4, {change}; at step 6, {further_change} (the command" in card


def test_resume_auto_with_nothing_to_resume_says_it_starts_afresh(tmp_path, capsys):
    """--resume auto into a folder without checkpoints (a requeued job's first launch) trains from step 0, as it should,
    and says so: it started afresh without a word, where a resumed run names its checkpoint."""
    data = (demo_examples(20, seed=3), "B")
    train(_config(tmp_path / "run", max_steps=1, resume="auto"), train_examples=data)
    assert f"--resume auto: no checkpoint in {tmp_path / 'run'}; training from step 0" in capsys.readouterr().out
    train(_config(tmp_path / "plain", max_steps=1), train_examples=data)
    assert "--resume auto" not in capsys.readouterr().out


def test_the_refusal_of_a_run_without_checkpoints_says_its_save_every(tmp_path):
    """An earlier run that saved every 5 steps and stopped at step 2 left no checkpoint: the refusal says what its
    config.json gives, --save-every 5, so the user sees why none is there (no value where the file gives none)."""
    data = (demo_examples(20, seed=3), "B")
    train(_config(tmp_path, max_steps=2, save_every=5), train_examples=data)
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())
    with pytest.raises(ValueError, match=r"only when a signal stops it; it ran with --save-every 5\); pass "
                                         r"--overwrite 1"):
        train(_config(tmp_path, max_steps=2, resume="auto"), train_examples=data)
    config = json.loads((tmp_path / "config.json").read_text())
    del config["save_every"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"only when a signal stops it\); pass --overwrite 1"):
        train(_config(tmp_path, max_steps=2), train_examples=data)


def test_a_finished_run_is_refused_unless_overwrite_is_asked(tmp_path, capsys):
    """With the defaults (no checkpoints), a second run into a finished run's folder is refused, with or without
    --resume auto (nothing to resume); --overwrite deletes that run's outputs (best/ too, and the record of a
    non-finite stop and the checkpoints a resume set aside), and nothing else."""
    data = (demo_examples(20, seed=3), "B")
    first = train(_config(tmp_path, max_steps=2, save_every=0, save_final=True), train_examples=data)
    (tmp_path / "best").mkdir()  # as an evaluated run leaves it
    (tmp_path / "notes.txt").write_text("mine")
    for resume in (None, "auto"):
        with pytest.raises(ValueError, match=r"holds an earlier run \(best/, final/, metrics.jsonl\): it left no "
                                             r"checkpoint to resume from \(a run writes them every --save-every N "
                                             r"steps; with the default, 0, only when a signal stops it; it "
                                             r"ran with --save-every 0\).*"
                                             r"--overwrite 1"):
            train(_config(tmp_path, max_steps=2, save_every=0, resume=resume), train_examples=data)
    assert (tmp_path / "best").is_dir() and len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    (tmp_path / "set-aside" / "after-step-00000001").mkdir(parents=True)  # as a rollback leaves them
    (tmp_path / "stopped-non-finite.json").write_text('{"step": 2, "good_checkpoint": null}')
    again = train(_config(tmp_path, max_steps=1, save_every=0, save_final=True, overwrite=True), train_examples=data)
    assert not (tmp_path / "best").exists() and (tmp_path / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "set-aside").exists() and not (tmp_path / "stopped-non-finite.json").exists()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 1
    assert again.final_path == first.final_path and (tmp_path / "final" / "config.json").exists()


def test_resuming_another_folders_checkpoint_into_an_earlier_run_is_refused_unless_overwrite_is_asked(tmp_path):
    """--resume PATH (run A's checkpoint) --output-dir B, where B holds a finished run: refused as a fresh start there
    is (it replaced B's checkpoints and final/ and mixed both runs' rows in B's metrics.jsonl); --overwrite deletes
    B's run once the resume has passed its checks, and never the checkpoint it resumes from."""
    data = (demo_examples(20, seed=3), "B")
    settings = {"max_steps": 4, "save_every": 2, "save_final": True}
    train(_config(tmp_path / "a", **settings), train_examples=data)
    train(_config(tmp_path / "b", **settings, seed=8), train_examples=data)
    a_checkpoint = str(tmp_path / "a" / "checkpoints" / "step-00000002")
    b_metrics = (tmp_path / "b" / "metrics.jsonl").read_text()
    b_final = (tmp_path / "b" / "final" / "model.safetensors").read_bytes()
    with pytest.raises(ValueError, match=r"holds an earlier run \(checkpoints/, final/, metrics.jsonl\).*is not "
                                         r"one of its checkpoints.*--overwrite 1.*--resume auto.*step-00000004"):
        train(_config(tmp_path / "b", **settings, resume=a_checkpoint), train_examples=data)
    assert (tmp_path / "b" / "metrics.jsonl").read_text() == b_metrics
    assert (tmp_path / "b" / "final" / "model.safetensors").read_bytes() == b_final
    with pytest.raises(ValueError, match="--batch-size: 8 -> 4"):  # refused by the checkpoint: B's run left whole
        train(_config(tmp_path / "b", **settings, batch_size=4, resume=a_checkpoint, overwrite=True),
              train_examples=data)
    assert (tmp_path / "b" / "metrics.jsonl").read_text() == b_metrics
    nested = tmp_path / "b" / "checkpoints" / "copied" / "step-00000002"
    shutil.copytree(a_checkpoint, nested)
    with pytest.raises(ValueError, match="--overwrite 1 would delete .*the checkpoint to resume from"):
        train(_config(tmp_path / "b", **settings, resume=str(nested), overwrite=True), train_examples=data)
    shutil.rmtree(nested.parent)
    resumed = train(_config(tmp_path / "b", **settings, resume=a_checkpoint, overwrite=True), train_examples=data)
    assert [row["step"] for row in resumed.history] == [3, 4]
    with open(tmp_path / "b" / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == [3, 4]
    assert os.listdir(tmp_path / "b" / "checkpoints") == ["step-00000004"]
    assert os.path.isdir(a_checkpoint)


def test_a_resume_through_the_api_refuses_dev_data_of_the_other_kind(tmp_path):
    """train(dev_examples=...) resuming a run whose best model was picked by Spearman (scored pairs) with
    (query, positive) dev data is refused, as --dev-data is: nDCG@10 would be compared with Spearman."""
    from angle_train.evaluate import read_dataset

    data = (demo_sts_examples(40, seed=4), "A")
    settings = dict(model="builtin:tiny-bert", max_steps=4, save_every=2, eval_every=2, cosine_w=1.0, ibn_w=0.0,
                    angle_w=1.0)
    train(_config(tmp_path / "run", **settings), train_examples=data, dev_examples=demo_sts_examples(24),
          on_step=_stop_at(3))  # a checkpoint at step 2, after the best
    dev_file = tmp_path / "dev.jsonl"
    dev_file.write_text("".join(json.dumps({"query": ex.texts[0], "positive": ex.texts[1]}) + "\n"
                                for ex in demo_examples(12, seed=9)), encoding="utf-8")
    with pytest.raises(ValueError, match="cannot resume from .*dev data of the checkpoint's kind"):
        train(_config(tmp_path / "run", **settings, resume="auto"), train_examples=data,
              dev_examples=read_dataset(str(dev_file)))


def test_a_resume_through_the_api_compares_the_dev_examples_and_the_model_given_not_the_names_of_the_flags(tmp_path):
    """train(dev_examples=...) and train(model=...) replace --dev-data and --model, and the resume compared those
    names, which say nothing of what was given: other dev examples resumed without a word (the best model then
    picked across two dev sets), and the same model given under another --model name was refused by that name. The
    dev set is compared by its fingerprint (texts and scores), given or named on either side, and a model given by
    its config and weights."""
    from test_cli_errors import write_stsb

    data = (demo_examples(20, seed=3), "B")
    first = dict(model=make_encoder("bert", pooling="avg"), train_examples=data)
    train(_best_config(tmp_path / "run"), dev_examples=DEV, on_step=_stop_at(3), **first)

    def resume(given_model=None, dev_examples=DEV, **settings):
        return train(_best_config(tmp_path / "run", resume="auto", **settings), train_examples=data,
                     model=given_model or make_encoder("bert", pooling="avg"), dev_examples=dev_examples)

    with pytest.raises(ValueError, match=r"cannot resume from .* with other dev data \(dev_examples: their texts and "
                                         r"scores differ from the checkpoint's, fingerprint \w+ -> \w+\): its best "
                                         r"model \(step .* or without dev_examples \(the best"):
        resume(dev_examples=demo_sts_examples(12, seed=6))
    with pytest.raises(ValueError, match=r"other dev data \(--dev-data .*sts.csv: its contents differ from the "
                                         r"checkpoint's, fingerprint"):  # a file of other pairs, the checkpoint's given
        resume(dev_examples=None, dev_data=str(write_stsb(tmp_path / "sts.csv")))
    with pytest.raises(ValueError, match=r"with the model given to train\(\): it is not the model the checkpoint "
                                         r"trained \(the model given to train\(\)\): its config differs"):
        resume(given_model=make_encoder("bert", pooling="avg", dropout=0.1))
    # the same dev examples and the same model, under names the checkpoint's settings do not hold: resumed
    resumed = resume(dev_examples=list(DEV), model="builtin:tiny-llama", dev_data="builtin:demo-sts")
    assert [row["step"] for row in resumed.history] == [3, 4]


def test_a_resume_through_the_api_compares_the_training_examples_given_not_the_names_of_the_data_flags(tmp_path,
                                                                                                     capsys):
    """train(train_examples=...) replaces --train-data and the flags that read it, but the resume compared their names,
    which say nothing of what was given: the same examples under another --train-data, --train-split or --data-format
    were refused as data that would skip or repeat training data, and other examples under other names were refused by
    those names. Where either run was given its examples, the checkpoint's record of them (every example's
    fingerprint) decides, and a refusal names train_examples (or the --train-data this run reads)."""
    data = (demo_examples(24, seed=3), "B")
    train(_config(tmp_path / "run"), train_examples=data, on_step=_stop_at(4))  # a checkpoint at step 3
    checkpoint = str(tmp_path / "run" / "checkpoints" / "step-00000003")
    named = dict(train_data="someone/pairs", train_split="validation", data_format="B")
    with pytest.raises(ValueError, match=r"cannot resume from .*step-00000003 with train_examples: they differ from "
                                         r"the checkpoint's training data \(24 examples, fingerprint \w+; now 24, "
                                         r"fingerprint \w+\).* Give train_examples the checkpoint's examples"):
        train(_config(tmp_path / "run", resume="auto", **named), train_examples=(demo_examples(24, seed=4), "B"))
    other = _write_pairs(tmp_path / "other.jsonl", demo_examples(24, seed=4))
    with pytest.raises(ValueError, match=r"with --train-data .*other.jsonl: it holds other examples than the "
                                         r"checkpoint's training data \(24 examples"):
        train(_config(tmp_path / "from-file", train_data=other, resume=checkpoint))
    # a file of the checkpoint's examples, and the examples again under other names: resumed, no name said moved
    same = _write_pairs(tmp_path / "pairs.jsonl", demo_examples(24, seed=3))
    capsys.readouterr()
    from_file = train(_config(tmp_path / "from-file", train_data=same, resume=checkpoint))
    assert [row["step"] for row in from_file.history] == [4, 5, 6, 7]
    assert " moved: " not in capsys.readouterr().out
    resumed = train(_config(tmp_path / "run", resume="auto", **named), train_examples=data)
    assert [row["step"] for row in resumed.history] == [4, 5, 6, 7]


def test_a_resume_refuses_the_training_examples_given_in_another_format(tmp_path, monkeypatch):
    """train(train_examples=(examples, format)): the format decides what the examples train as (format A's texts are
    scored pairs, B's a query and its positive), but where either run was given its examples the resume compared the
    examples alone, and the same ones in another format went on in silence. Checkpoints record the format: another
    is refused naming train_examples, or --data-format where this run reads --train-data; a checkpoint of an earlier
    version, which records none, still resumes."""
    import angle_train.trainer as trainer

    labelled = [Example(texts=e.texts, label=float(i % 2)) for i, e in enumerate(demo_examples(24, seed=3))]
    train(_config(tmp_path / "run"), train_examples=(labelled, "A"), on_step=_stop_at(4))  # a checkpoint at step 3
    with pytest.raises(ValueError, match=r"cannot resume from .*step-00000003 with train_examples in format B "
                                         r"\(query, positive\): the checkpoint's training data are the same "
                                         r"examples in format A \(text1, text2, label\).* Give train_examples in "
                                         r"the checkpoint's format, \(examples, 'A'\)"):
        train(_config(tmp_path / "run", resume="auto"), train_examples=(labelled, "B"))
    resumed = train(_config(tmp_path / "run", resume="auto"), train_examples=(labelled, "A"))
    assert [row["step"] for row in resumed.history] == [4, 5, 6, 7]

    pairs = demo_examples(24, seed=3)  # a file of the same examples in format A: labelled 1, as format B's are
    train(_config(tmp_path / "given"), train_examples=(pairs, "B"), on_step=_stop_at(4))
    scored = tmp_path / "scored.jsonl"
    scored.write_text("".join(json.dumps({"text1": e.texts[0], "text2": e.texts[1], "label": 1}) + "\n"
                              for e in pairs))
    checkpoint = str(tmp_path / "given" / "checkpoints" / "step-00000003")
    with pytest.raises(ValueError, match=r"with --train-data .*scored.jsonl read in format A \(text1, text2, "
                                         r"label\): the checkpoint's training data are the same examples in format B "
                                         r"\(query, positive\).* Resume with --data-format B"):
        train(_config(tmp_path / "from-file", train_data=str(scored), resume=checkpoint))

    written = trainer.data_record  # a checkpoint of the version that recorded no format
    monkeypatch.setattr(trainer, "data_record", lambda *args, **kwargs: {
        key: value for key, value in written(*args, **kwargs).items() if key != "format"})
    train(_config(tmp_path / "older"), train_examples=(labelled, "A"), on_step=_stop_at(4))
    monkeypatch.setattr(trainer, "data_record", written)
    resumed = train(_config(tmp_path / "older", resume="auto"), train_examples=(labelled, "B"))
    assert [row["step"] for row in resumed.history] == [4, 5, 6, 7]


def test_overwrite_with_resume_auto_continues_its_own_run_and_keeps_it(tmp_path):
    """--resume auto --overwrite 1 in a folder holding this run's own checkpoints resumes it: --overwrite clears
    another run's files, never the run being continued (its metrics rows and checkpoints stay)."""
    data = (demo_examples(20, seed=3), "B")
    settings = dict(model="builtin:tiny-bert", max_steps=5, save_every=2, keep_checkpoints=3)
    train(_config(tmp_path, **settings), train_examples=data, on_step=_stop_at(3))  # a checkpoint at step 2
    resumed = train(_config(tmp_path, **settings, resume="auto", overwrite=True), train_examples=data)
    assert [row["step"] for row in resumed.history] == [3, 4, 5]
    rows = tracking.read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [row["step"] for row in rows if "loss" in row] == [1, 2, 3, 4, 5]
    assert os.path.isdir(checkpoint_path(str(tmp_path), 2))


def test_a_rollback_sets_the_later_checkpoints_aside_and_resume_auto_follows_the_new_line(tmp_path, capsys):
    """A finished run (checkpoints 2, 4, 6), rolled back to step 2 with another --lr and killed after its own
    checkpoint 4: the first run's checkpoints 4 and 6 sorted after it, so `--resume auto` continued the first run
    from its step 6. The rollback moves them (with that run's final/ and metrics rows of later steps) to
    set-aside/after-step-00000002/, where they stay whole, and `--resume auto` continues the new line."""
    data = (demo_examples(20, seed=3), "B")
    settings = {"max_steps": 6, "save_every": 2, "keep_checkpoints": 0, "save_final": True}

    def steps(path):
        with open(path) as f:
            return [json.loads(line)["step"] for line in f]

    train(_config(tmp_path, **settings), train_examples=data)
    capsys.readouterr()
    rollback = train(_config(tmp_path, **settings, lr=1e-3, resume=str(checkpoint_path(str(tmp_path), 2))),
                     train_examples=data, on_step=_stop_at(5))
    assert [row["step"] for row in rollback.history] == [3, 4, 5]
    aside = tmp_path / "set-aside" / "after-step-00000002"
    assert f"moved what {tmp_path} held from later steps" in capsys.readouterr().out
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-00000002", "step-00000004"]
    assert sorted(os.listdir(aside / "checkpoints")) == ["step-00000004", "step-00000006"]
    assert all(checkpoint_problem(str(path)) is None for path in (aside / "checkpoints").iterdir())
    assert (aside / "final" / "model.safetensors").exists() and not (tmp_path / "final").exists()
    assert steps(aside / "metrics.jsonl") == [3, 4, 5, 6] and steps(tmp_path / "metrics.jsonl") == [1, 2, 3, 4, 5]
    resumed = train(_config(tmp_path, **settings, lr=1e-3, resume="auto"), train_examples=data)
    assert [row["step"] for row in resumed.history] == [5, 6]
    assert f"resumed from {checkpoint_path(str(tmp_path), 4)} at step 4" in capsys.readouterr().out
    assert steps(tmp_path / "metrics.jsonl") == [1, 2, 3, 4, 5, 6]
    assert sorted(os.listdir(aside / "checkpoints")) == ["step-00000004", "step-00000006"]


def test_resuming_a_run_at_its_last_step_only_finishes_it(tmp_path, capsys):
    data = (demo_examples(20, seed=3), "B")
    train(_config(tmp_path, max_steps=2, save_every=2), train_examples=data)
    capsys.readouterr()
    resumed = train(_config(tmp_path, max_steps=2, save_every=2, resume="auto"), train_examples=data)
    out = capsys.readouterr().out
    assert resumed.history == [] and "had already reached its last step (2)" in out and "nan" not in out


def test_resume_given_a_run_folder_an_export_or_a_file_says_which_checkpoint_to_give(tmp_path):
    """--resume's likely slips (the run's output folder, its checkpoints/ folder, its final/ export, a checkpoint's
    state file) say what was given and the --resume to give instead, not that the checkpoint is damaged."""
    data = (demo_examples(20, seed=3), "B")
    run = tmp_path / "run"
    train(_config(run, max_steps=2, save_every=1, keep_checkpoints=0, save_final=True), train_examples=data)
    newest = run / "checkpoints" / "step-00000002"
    for given, said in ((run, f"a run's output folder, not one of its checkpoints: --resume auto (with --output-dir "
                              f"{run}) continues its newest, or give one (newest: --resume {newest})"),
                        (run / "checkpoints", f"the folder of a run's checkpoints: give one of them (newest: --resume "
                                              f"{newest})"),
                        (run / "final", f"an exported model, not a checkpoint (no optimizer state or position): "
                                        f"train from it with --model {run / 'final'}"),
                        (newest / "state.pt", f"a file; --resume takes a checkpoint folder (its folder: --resume "
                                              f"{newest})")):
        with pytest.raises(ValueError) as refused:
            train(_config(tmp_path / "other", max_steps=3, resume=str(given)), train_examples=data)
        assert str(refused.value).startswith(f"cannot resume from {given}: it is ") and said in str(refused.value)


def test_resume_given_a_lora_runs_adapter_export_points_to_a_whole_model(tmp_path):
    """A LoRA run's best/ holds the adapter alone, which --model refuses: --resume given it names the run's final/
    to train from, not the adapter."""
    from angle_train.checkpoint import not_a_checkpoint

    best = tmp_path / "best"
    best.mkdir()
    (best / "angle_train.json").write_text(json.dumps({"adapter_only": True, "pooling": "last"}))
    said = not_a_checkpoint(str(best))
    assert "train from it with --model its run's final/ (this holds a LoRA adapter alone)" in said
    (best / "angle_train.json").write_text(json.dumps({"adapter_only": False, "pooling": "last"}))
    assert f"train from it with --model {best} (a new run)" in not_a_checkpoint(str(best))


def test_metrics_rows_survive_a_failure_while_they_are_rewritten(tmp_path, monkeypatch):
    """On resume the rows after the checkpoint are dropped by writing a new file and renaming it: a write that
    fails (a full disk, found here when the new rows are synced to disk) leaves every row where it was, where
    truncating the file in place would lose them, and no metrics.jsonl.tmp behind."""
    from angle_train import trainer

    metrics = tmp_path / "metrics.jsonl"
    rows = "".join(json.dumps({"step": step, "loss": 1.0}) + "\n" for step in range(1, 6))
    metrics.write_text(rows)

    def full_disk(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        trainer._drop_rows_after(str(metrics), 3)
    assert metrics.read_text() == rows
    assert os.listdir(tmp_path) == ["metrics.jsonl"]


class RunsCodeWhenUnpickled:
    """What a hostile checkpoint file can hold: unpickling it calls os.mkdir(marker), standing in for any code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


@pytest.mark.parametrize("planted", ["state.pt", "rng-rank0.pt"])
def test_resume_refuses_a_checkpoint_file_that_would_run_code(tmp_path, planted):
    data = (demo_examples(20, seed=3), "B")
    train(_config(tmp_path / "run", max_steps=3), train_examples=data)
    hostile = tmp_path / "run" / "checkpoints" / "step-00000003" / planted
    marker = tmp_path / "the-planted-code-ran"
    torch.save({"model": RunsCodeWhenUnpickled(str(marker))}, hostile)
    # whoever can plant a file can rewrite the manifest too: it guards against damage, not against an attacker
    write_manifest(str(hostile.parent))
    torch.load(hostile, weights_only=False)  # control: loading it the permissive way does run the code
    assert marker.is_dir()
    marker.rmdir()

    with pytest.raises(UnsafeCheckpointError) as refused:
        train(_config(tmp_path / "run", max_steps=3, resume="auto"), train_examples=data)
    message = str(refused.value)
    assert f"refusing to load {hostile}" in message, message
    assert "other than tensors and plain values" in message and "run code" in message, message
    assert "mkdir" in message, message  # names what the file would have called
    assert not marker.exists()


def test_a_checkpoint_restores_every_random_generator(tmp_path):
    """Python's, numpy's and torch's generators continue from the saved state (numpy's is stored as a list)."""
    cfg = run_config(tmp_path, max_steps=3)
    encoder, _ = make_encoder("bert")
    optimizer = make_optimizer(cfg, encoder, torch.device("cpu"))
    trainables = {"encoder": encoder, "optimizer": optimizer, "scheduler": make_schedule(cfg, optimizer, 3),
                  "scaler": torch.amp.GradScaler("cpu", enabled=False)}
    random.seed(1)
    numpy.random.seed(2)
    torch.manual_seed(3)
    path = save_checkpoint(cfg, Position(step=3, epoch=1, batch=2, best=0.5), DistInfo(), **trainables)

    def draws():
        return random.random(), numpy.random.normal(), torch.rand(()).item()

    after_save = draws()
    position = load_checkpoint(path, cfg, DistInfo(), **trainables)
    assert draws() == after_save
    assert position == Position(step=3, epoch=1, batch=2, best=0.5)


def test_a_resumes_changed_settings_are_put_in_words_once(tmp_path, capsys, monkeypatch):
    """The settings a resume changes are said in two lines (those the schedule applies, those noted) and recorded
    together for the model cards (Position.resumes): each group is put in words once, where the record formatted
    them all a second time."""
    from angle_train import checkpoint

    saved_cfg = run_config(tmp_path, max_steps=3, lr=3e-3, max_length=12)
    encoder, _ = make_encoder("bert")

    def trainables(cfg):
        optimizer = make_optimizer(cfg, encoder, torch.device("cpu"))
        return {"encoder": encoder, "optimizer": optimizer, "scheduler": make_schedule(cfg, optimizer, 3),
                "scaler": torch.amp.GradScaler("cpu", enabled=False)}

    path = save_checkpoint(saved_cfg, Position(step=2, epoch=0, batch=2), DistInfo(), **trainables(saved_cfg))
    capsys.readouterr()
    worded = []
    changes_shown = checkpoint._changes_shown
    monkeypatch.setattr(checkpoint, "_changes_shown", lambda changed: worded.append(list(changed))
                        or changes_shown(changed))
    cfg = run_config(tmp_path, max_steps=3, lr=1e-3, max_length=10)
    position = load_checkpoint(path, cfg, DistInfo(), **trainables(cfg))
    out = capsys.readouterr().out
    assert "resuming with changed settings (--lr 0.003 -> 0.001): from step 2 on" in out
    assert "resuming with changed settings (--max-length 12 -> 10): they apply from step 2 on" in out
    assert position.resumes == [{"step": 2, "changed": "--lr 0.003 -> 0.001, --max-length 12 -> 10"}]
    assert worded == [["lr"], ["max_length"]]


# ------------------------------------------------------------------------------- best/ and logging on resume

DEV = demo_sts_examples(12, seed=5)


def _scripted_dev_scores(monkeypatch, scores: list[float], metric: str = "dev_spearman"):
    """Each evaluation's dev score (`metric`: the dev data's kind, tracking.DEV_METRICS) taken in turn from `scores`
    (the models are random: the order of bests is what the tests are about)."""
    from angle_train import trainer

    left = list(scores)
    monkeypatch.setattr(trainer, "scores_of_embeddings", lambda dev_set, embeddings, dims:
                        {metric: left.pop(0), **{f"{metric}@{dim}": left.pop(0) for dim in dims}})


def _best_config(out, **overrides):
    return _config(out, **{"max_steps": 4, "save_every": 2, "keep_checkpoints": 0, "eval_every": 1, **overrides})


def _stop_at(last):
    def on_step(step, row):
        if step == last:
            raise StopTraining
    return on_step


def _record(folder):
    with open(os.path.join(folder, "angle_train.json")) as f:
        return json.load(f).get("best")


def _files(folder):
    return {name: (folder / name).read_bytes() for name in os.listdir(folder) if name.endswith(".safetensors")}


@pytest.mark.parametrize("kept", [True, False])
def test_resume_puts_back_the_checkpoints_best_that_a_killed_run_replaced(tmp_path, monkeypatch, kept):
    """Killed after best/ was replaced at step 3, past the step-2 checkpoint whose best is step 2's model: the resumed
    run, which never beats it, ends with step 2's model in best/ (the superseded best kept beside the checkpoints,
    or, when that copy is gone, the checkpoint's own weights exported), as the score it reports says."""
    data = (demo_examples(20, seed=3), "B")
    _scripted_dev_scores(monkeypatch, [0.1, 0.3, 0.5])
    train(_best_config(tmp_path), train_examples=data, dev_examples=DEV, on_step=_stop_at(3))
    assert _record(tmp_path / "best") == {"step": 3, "dev_spearman": 0.5}
    step_2_best = _files(tmp_path / "checkpoints" / "best-step-00000002")
    if not kept:
        import shutil
        shutil.rmtree(tmp_path / "checkpoints" / "best-step-00000002")
    _scripted_dev_scores(monkeypatch, [0.2, 0.2])
    resumed = train(_best_config(tmp_path, resume="auto"), train_examples=data, dev_examples=DEV)
    assert [r["step"] for r in resumed.history] == [3, 4]
    assert resumed.best_spearman == 0.3 and resumed.best_path == str(tmp_path / "best")
    assert _record(tmp_path / "best") == {"step": 2, "dev_spearman": 0.3}
    if kept:
        assert _files(tmp_path / "best") == step_2_best
    else:  # the step-2 checkpoint's weights are step 2's model
        state = torch.load(tmp_path / "checkpoints" / "step-00000002" / "state.pt", weights_only=True)["model"]
        from safetensors.torch import load_file
        exported = load_file(tmp_path / "best" / "model.safetensors")
        assert all(torch.equal(exported[name.removeprefix("backbone.")], value) for name, value in state.items())
    # the step-4 checkpoint knows step 2's best too: nothing left beside the checkpoints but the checkpoints
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-00000002", "step-00000004"]


def test_a_resume_without_dev_data_reports_the_checkpoints_best(tmp_path, monkeypatch, capsys):
    """Resumed without --dev-data, a run whose checkpoint knows a best model reports it (and its kind of score): the
    result took the metric from the dev data only, and the command's summary line raised KeyError after training."""
    from angle_train import cli, trainer

    data = (demo_examples(20, seed=3), "B")
    _scripted_dev_scores(monkeypatch, [0.1, 0.3, 0.5])
    train(_best_config(tmp_path), train_examples=data, dev_examples=DEV, on_step=_stop_at(2))
    resumed = train(_best_config(tmp_path, resume="auto", eval_every=0), train_examples=data)  # nothing to evaluate
    assert (resumed.best_metric, resumed.best_spearman, resumed.best_score) == ("dev_spearman", 0.3, 0.3)
    monkeypatch.setattr(trainer, "train", lambda cfg: resumed)  # the command's summary lines for that result
    assert cli.main(["--output-dir", str(tmp_path / "summary"), "--max-steps", "1"]) == 0
    assert "best model (dev Spearman 0.3000)" in capsys.readouterr().out


@pytest.mark.parametrize("best_kept", [True, False])
def test_a_run_resumed_from_before_best_steps_were_recorded_reports_its_best_folder(tmp_path, monkeypatch,
                                                                                     best_kept):
    """A checkpoint of an older angle_train knows its best score but not its step, and its best/ records none: the
    resumed run that never beats the score leaves that best/ as it is and reports it as the best model's path (and
    claims none where best/ is gone)."""
    from angle_train import checkpoint

    data = (demo_examples(20, seed=3), "B")
    _scripted_dev_scores(monkeypatch, [0.1, 0.3, 0.5])
    written = checkpoint.asdict
    monkeypatch.setattr(checkpoint, "asdict", lambda obj: {key: value for key, value in written(obj).items()
                                                           if not (isinstance(obj, Position) and key == "best_step")})
    train(_best_config(tmp_path), train_examples=data, dev_examples=DEV, on_step=_stop_at(2))
    monkeypatch.setattr(checkpoint, "asdict", written)
    meta_path = tmp_path / "best" / checkpoint.META_FILE
    meta = json.loads(meta_path.read_text())
    assert meta.pop(checkpoint.BEST_RECORD_KEY) == {"step": 2, "dev_spearman": 0.3}
    meta_path.write_text(json.dumps(meta))  # as an older angle_train wrote it
    best_files = _files(tmp_path / "best")
    if not best_kept:
        shutil.rmtree(tmp_path / "best")
    _scripted_dev_scores(monkeypatch, [0.2, 0.2])
    resumed = train(_best_config(tmp_path, resume="auto"), train_examples=data, dev_examples=DEV)
    assert [r["step"] for r in resumed.history] == [3, 4] and resumed.best_spearman == 0.3
    if best_kept:
        assert resumed.best_path == str(tmp_path / "best") and _files(tmp_path / "best") == best_files
    else:
        assert resumed.best_path is None and not (tmp_path / "best").exists()


@pytest.mark.parametrize("source_best", [True, False])
def test_resuming_into_a_new_folder_reports_only_a_best_model_it_holds(tmp_path, monkeypatch, capsys, source_best):
    """--resume PATH into another --output-dir: the checkpoint's best model is copied from the folder the checkpoint
    belongs to; where it is gone, no best path is claimed (a warning says so) until the run beats its score."""
    data = (demo_examples(20, seed=3), "B")
    _scripted_dev_scores(monkeypatch, [0.5, 0.3, 0.2, 0.1])
    first = train(_best_config(tmp_path / "run1"), train_examples=data, dev_examples=DEV)
    assert first.best_path == str(tmp_path / "run1" / "best")
    if not source_best:
        import shutil
        shutil.rmtree(tmp_path / "run1" / "best")
    _scripted_dev_scores(monkeypatch, [0.2, 0.1])
    capsys.readouterr()
    resumed = train(_best_config(tmp_path / "run2", resume=str(tmp_path / "run1" / "checkpoints" / "step-00000002")),
                    train_examples=data, dev_examples=DEV)
    assert resumed.best_spearman == 0.5
    if source_best:
        assert resumed.best_path == str(tmp_path / "run2" / "best")
        assert _record(tmp_path / "run2" / "best") == {"step": 1, "dev_spearman": 0.5}
        assert os.path.isdir(tmp_path / "run1" / "best")  # copied, not taken
    else:
        assert resumed.best_path is None and not (tmp_path / "run2" / "best").exists()
        assert "warning: the best model of" in capsys.readouterr().err


def test_resume_messages_about_the_best_model_name_the_runs_dev_score(tmp_path, monkeypatch, capsys):
    """A run that picks best/ by dev nDCG@10 ((query, positive) dev data) says so when a resume restores its best
    model and when it warns that the model is gone (both said dev Spearman, whatever the run's score)."""
    import shutil

    from angle_train.evaluate import RetrievalSet

    data, pairs = (demo_examples(20, seed=3), "B"), demo_examples(12, seed=5)
    dev = RetrievalSet("dev", [ex.texts[0] for ex in pairs], [ex.texts[1] for ex in pairs])
    _scripted_dev_scores(monkeypatch, [0.5, 0.3, 0.2, 0.1], metric="dev_ndcg@10")
    train(_best_config(tmp_path / "run1"), train_examples=data, dev_examples=dev)  # best: step 1
    step_2 = str(tmp_path / "run1" / "checkpoints" / "step-00000002")
    capsys.readouterr()
    _scripted_dev_scores(monkeypatch, [0.2, 0.1], metric="dev_ndcg@10")
    train(_best_config(tmp_path / "run2", resume=step_2), train_examples=data, dev_examples=dev)
    assert (f"best/: restored the checkpoint's best model (step 1, dev nDCG@10 0.5000) from "
            f"{tmp_path / 'run1' / 'best'}") in capsys.readouterr().out
    shutil.rmtree(tmp_path / "run1" / "best")
    _scripted_dev_scores(monkeypatch, [0.2, 0.1], metric="dev_ndcg@10")
    train(_best_config(tmp_path / "run3", resume=step_2), train_examples=data, dev_examples=dev)
    warning = capsys.readouterr().err
    assert f"the best model of {step_2} (step 1, dev nDCG@10 0.5000) is neither in" in warning
    assert "written again when this run's dev nDCG@10 beats it" in warning


def test_resumed_metrics_rows_average_the_same_steps_as_the_uninterrupted_run(tmp_path, capsys):
    """A row's loss is the mean over the steps since the previous row: the steps before the checkpoint included, so
    that metrics.jsonl and the closing line of a resumed run are the uninterrupted run's."""
    data = (demo_examples(20, seed=3), "B")
    settings = {"max_steps": 8, "log_every": 4, "save_every": 3, "keep_checkpoints": 0}

    def rows(folder):
        with open(folder / "metrics.jsonl") as f:
            return [(row["step"], row["loss"]) for row in map(json.loads, f)]

    def closing_line():
        return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("done:")).split(" | ")[1]

    train(_config(tmp_path / "full", **settings), train_examples=data)
    full_line = closing_line()
    train(_config(tmp_path / "run", **settings), train_examples=data, on_step=_stop_at(5))
    capsys.readouterr()
    resumed = train(_config(tmp_path / "run", resume="auto", **settings), train_examples=data)
    assert [r["step"] for r in resumed.history] == [4, 5, 6, 7, 8]  # from the step-3 checkpoint
    assert rows(tmp_path / "run") == rows(tmp_path / "full") and len(rows(tmp_path / "full")) == 2
    assert closing_line() == full_line


def test_resume_refuses_other_dev_data_and_says_a_changed_loss_setting(tmp_path, capsys):
    """The checkpoint's best score was measured on its dev data: resumed with another dev set, the run compared
    scores on the new data with it and kept best/ by that (dev Spearman 0.7739 against 0.8373 from the old set,
    reported as the run's best); refused now. A changed loss setting was taken silently, the model card's command
    naming settings that trained only the later steps: said now, as it applies from the resumed step on."""
    from test_cli_errors import write_stsb

    data = (demo_examples(20, seed=3), "B")
    train(_best_config(tmp_path / "run", dev_data="builtin:demo-sts"), train_examples=data, on_step=_stop_at(2))
    other = write_stsb(tmp_path / "other-sts.csv")
    with pytest.raises(ValueError, match="cannot resume from .* with other dev data \\(--dev-data: "
                                         "'builtin:demo-sts' -> .*other-sts.csv'\\): its best model \\(step"):
        train(_best_config(tmp_path / "run", dev_data=str(other), resume="auto"), train_examples=data)
    from angle_train import checkpoint

    def resume(saved_settings, **settings):  # the dev data's check of a resume, on a checkpoint of these settings
        saved = {**dataclasses.asdict(_best_config(tmp_path / "run", dev_data=str(other))), **saved_settings}
        checkpoint._refuse_another_dev_set("ck", saved, Position(step=2, best=0.5, best_step=2),
                                           _best_config(tmp_path / "run", dev_data=str(other), **settings))

    with pytest.raises(ValueError, match="cannot resume from ck with other dev data \\(--dev-columns: \\{\\} -> "
                                         "\\{'text1': 'text2', 'text2': 'text1'\\}\\)"):  # the pairs read otherwise
        resume({"dev_columns": []}, dev_columns=["text1=text2", "text2=text1"])
    # the same mapping in other words, or from --columns before --dev-columns was recorded: the same dev data
    resume({"dev_columns": ["text1=text2", "text2=text1"]}, dev_columns=["text1=text2,text2=text1"])
    saved_before = {"columns": ["text1=text2", "text2=text1"]}  # no "dev_columns": written before the flag
    resume(saved_before, columns=["text1=text2", "text2=text1"])
    resume(saved_before, dev_columns=["text1=text2", "text2=text1"])
    resumed = train(_best_config(tmp_path / "run", dev_data="builtin:demo-sts", ibn_tau=10.0, resume="auto"),
                    train_examples=data)
    assert [row["step"] for row in resumed.history] == [3, 4]
    assert "resuming with changed settings (--ibn-tau 20.0 -> 10.0): they apply from step 2 on" in (
        capsys.readouterr().out)


@pytest.mark.parametrize("before, after", [([32, 16], []), ([], [32, 16])])
def test_resume_with_or_without_matryoshka_dims_says_the_changed_loss(tmp_path, capsys, before, after):
    """--matryoshka-dims left out on resume (or added) changes the loss from the resumed step on, as any loss setting
    does: said in a line, not refused (the weights fit either way)."""
    data = (demo_examples(20, seed=3), "B")
    train(_config(tmp_path / "run", max_steps=4, matryoshka_dims=before), train_examples=data, on_step=_stop_at(3))
    resumed = train(_config(tmp_path / "run", max_steps=4, matryoshka_dims=after, resume="auto"), train_examples=data)
    assert [row["step"] for row in resumed.history] == [4]
    assert (f"resuming with changed settings (--matryoshka-dims {before} -> {after}): they apply from step 3 on"
            in capsys.readouterr().out)


def test_resume_takes_other_dev_columns_that_read_the_checkpoints_dev_examples(tmp_path):
    """Other --dev-columns were refused as other dev data even where they read the same pairs and scores (a column
    holding a copy of another): the checkpoint's dev fingerprint is of the examples as read, so the same fingerprint
    is the same dev set, and the run resumes. Columns that read other examples (the texts swapped) stay refused."""
    from test_cli_errors import PAIRS

    dev = tmp_path / "dev.csv"
    dev.write_text("s1,s2,score,s1_copy\n" + "".join(f"{a},{b},{i * 0.9:.3f},{a}\n"
                                                       for i, (a, b) in enumerate(PAIRS)), encoding="utf-8")
    data = (demo_examples(20, seed=3), "B")
    train(_best_config(tmp_path / "run", dev_data=str(dev), dev_columns=["text1=s1", "text2=s2", "label=score"]),
          train_examples=data, on_step=_stop_at(3))
    with pytest.raises(ValueError, match=r"cannot resume from .* with other dev data \(--dev-columns: "):
        train(_best_config(tmp_path / "run", dev_data=str(dev), dev_columns=["text1=s2", "text2=s1", "label=score"],
                           resume="auto"), train_examples=data)
    resumed = train(_best_config(tmp_path / "run", dev_data=str(dev), resume="auto",
                                 dev_columns=["text1=s1_copy", "text2=s2", "label=score"]), train_examples=data)
    assert [row["step"] for row in resumed.history] == [3, 4]


def test_resume_takes_another_split_that_reads_the_checkpoints_dev_examples(tmp_path, monkeypatch):
    """--dev-split names the dev data as --dev-data does: another split of the same Hugging Face dataset with other
    examples is other dev data, refused as another dataset is. A split that reads the checkpoint's examples (a
    dataset whose "dev" split is its "validation") was refused too: the dev fingerprint is of the examples as read, so
    the same fingerprint resumes, as other --dev-columns do. A checkpoint that records no fingerprint compares the
    split's name, as before."""
    from angle_train import checkpoint, trainer
    from angle_train.evaluate import StsSet

    splits = {"validation": DEV, "dev": DEV, "test": demo_sts_examples(12, seed=6)}
    monkeypatch.setattr(trainer, "read_dev_data",
                        lambda source, split, columns=None, columns_refused=None: StsSet(split, splits[split]))
    data = (demo_examples(20, seed=3), "B")
    train(_best_config(tmp_path / "run", dev_data="someone/sts-pairs"), train_examples=data, on_step=_stop_at(3))
    with pytest.raises(ValueError, match=r"cannot resume from .* with other dev data \(--dev-split: 'validation' -> "
                                         r"'test'\): its best model \(step"):
        train(_best_config(tmp_path / "run", dev_data="someone/sts-pairs", dev_split="test", resume="auto"),
              train_examples=data)
    resumed = train(_best_config(tmp_path / "run", dev_data="someone/sts-pairs", dev_split="dev", resume="auto"),
                    train_examples=data)
    assert [row["step"] for row in resumed.history] == [3, 4]
    saved = dataclasses.asdict(_best_config(tmp_path / "run", dev_data="someone/sts-pairs"))
    older = Position(step=2, best=0.5, best_step=2)  # no dev_fingerprint: written before it was recorded
    with pytest.raises(ValueError, match=r"other dev data \(--dev-split: 'validation' -> 'dev'\)"):
        checkpoint._refuse_another_dev_set("ck", saved, older, _best_config(
            tmp_path / "run", dev_data="someone/sts-pairs", dev_split="dev"), "0123456789abcdef")


def test_resume_refuses_a_dev_file_edited_in_place(tmp_path):
    """The dev data was compared by its name only: a dev file edited in place (its scores given to other pairs)
    resumed without a word, and the best model was picked across two dev sets. The checkpoint records the dev set's
    fingerprint: a resume over other contents is refused, with the file put back it resumes, and a checkpoint written
    before the fingerprint was recorded has nothing to compare."""
    from test_cli_errors import PAIRS, write_stsb

    from angle_train import checkpoint

    data, dev = (demo_examples(20, seed=3), "B"), write_stsb(tmp_path / "dev.csv")
    train(_best_config(tmp_path / "run", dev_data=str(dev)), train_examples=data, on_step=_stop_at(3))
    original = dev.read_text()
    write_stsb(dev, list(reversed(PAIRS)))
    with pytest.raises(ValueError, match=r"cannot resume from .*step-00000002 with other dev data \(--dev-data "
                                         r".*dev.csv: its contents differ from the checkpoint's, fingerprint \w+ -> "
                                         r"\w+\): its best model \(step"):
        train(_best_config(tmp_path / "run", dev_data=str(dev), resume="auto"), train_examples=data)
    dev.write_text(original)
    resumed = train(_best_config(tmp_path / "run", dev_data=str(dev), resume="auto"), train_examples=data)
    assert [row["step"] for row in resumed.history] == [3, 4]
    settings = _best_config(tmp_path / "run", dev_data=str(dev))
    older = Position(step=2, best=0.5, best_step=2)  # no dev_fingerprint: written before it was recorded
    checkpoint._refuse_another_dev_set("ck", dataclasses.asdict(settings), older, settings, "0123456789abcdef")


def test_a_checkpoint_from_before_any_evaluation_resumes_with_other_dev_data(tmp_path):
    """A checkpoint written before the first evaluation knows no best score to compare: it resumes with other dev
    data, which then picks the best model."""
    from test_cli_errors import write_stsb

    data = (demo_examples(20, seed=3), "B")
    settings = dict(max_steps=4, save_every=2, eval_every=4)
    train(_config(tmp_path / "run", dev_data="builtin:demo-sts", **settings), train_examples=data,
          on_step=_stop_at(3))
    other = write_stsb(tmp_path / "other-sts.csv")
    resumed = train(_config(tmp_path / "run", dev_data=str(other), resume="auto", **settings), train_examples=data)
    assert [row["step"] for row in resumed.history] == [3, 4] and [row["step"] for row in resumed.evals] == [4]


def _write_pairs(path, examples, extra_column=None) -> str:
    """Format B examples as a JSONL file (with `extra_column`: each row's positive again, reversed, under that name)."""
    with open(path, "w") as f:
        for e in examples:
            row = {"query": e.texts[0], "positive": e.texts[1]}
            if extra_column:
                row[extra_column] = " ".join(reversed(e.texts[1].split()))
            f.write(json.dumps(row) + "\n")
    return str(path)


def test_resume_refuses_training_data_that_changed_under_the_same_name(tmp_path):
    """The data settings were compared by name only: a file edited (rows appended) or read with other --columns
    resumed without a word, and the epoch's recomputed order over the new data trained some examples twice and
    skipped others. The checkpoint records the examples' count and fingerprint; a resume over other ones is refused,
    and with the data put back it resumes where it stopped."""
    path = _write_pairs(tmp_path / "pairs.jsonl", demo_examples(24, seed=3), extra_column="p2")
    train(_config(tmp_path / "run", train_data=path), on_step=_stop_at(4))
    original = open(path).read()
    with open(path, "a") as f:
        f.write(original.splitlines(keepends=True)[0] * 8)
    with pytest.raises(ValueError, match=r"cannot resume from .*step-00000003: the training data differ from the "
                                         r"checkpoint's \(24 examples, fingerprint \w+; now 32, fingerprint "
                                         r"\w+\).*training some twice and skipping others"):
        train(_config(tmp_path / "run", train_data=path, resume="auto"))
    with open(path, "w") as f:
        f.write(original)
    with pytest.raises(ValueError, match=r"the training data differ from the checkpoint's \(24 examples.*now 24, "
                                         r"fingerprint \w+; --columns \[\] -> \['positive=p2'\]\)"):
        train(_config(tmp_path / "run", train_data=path, columns=["positive=p2"], resume="auto"))
    resumed = train(_config(tmp_path / "run", train_data=path, resume="auto"))
    assert [row["step"] for row in resumed.history] == [4, 5, 6, 7]


def test_resume_takes_the_same_data_files_by_another_path(tmp_path, monkeypatch):
    """--train-data and --dev-data were compared as text: the same files named by relative paths, then by absolute
    ones or through a link, were refused as data that would skip or repeat training data. Local paths are compared by
    where they lead, as --model's folder is; another file of other contents is refused as before."""
    from test_cli_errors import write_stsb

    monkeypatch.chdir(tmp_path)
    _write_pairs(tmp_path / "pairs.jsonl", demo_examples(24, seed=3))
    write_stsb(tmp_path / "dev.csv")
    os.symlink("pairs.jsonl", tmp_path / "link.jsonl")
    _write_pairs(tmp_path / "other.jsonl", demo_examples(24, seed=4))
    train(_best_config(tmp_path / "run", train_data="pairs.jsonl", dev_data="dev.csv"), on_step=_stop_at(3))
    with pytest.raises(ValueError, match=r"\(--train-data: 'pairs.jsonl' -> 'other.jsonl'\); resuming would skip"):
        train(_best_config(tmp_path / "run", train_data="other.jsonl", dev_data="dev.csv", resume="auto"))
    resumed = train(_best_config(tmp_path / "run", train_data=str(tmp_path / "link.jsonl"),
                                 dev_data=str(tmp_path / "dev.csv"), resume="auto"))
    assert [row["step"] for row in resumed.history] == [3, 4]


def test_resume_takes_a_renamed_or_copied_data_file_of_the_checkpoints_contents(tmp_path, monkeypatch, capsys):
    """A checkpoint records the contents of its training and dev data (every example's fingerprint, the dev set's),
    yet a data file moved, renamed or copied was refused by its name, as data that would skip or repeat training
    data. It resumes now, each such file said in one line; a file of other contents is refused as before, and so is
    any other name for a checkpoint that records only the sampled fingerprint of earlier versions (an edit between
    its samples would pass it)."""
    from test_cli_errors import write_stsb

    import angle_train.trainer as trainer

    monkeypatch.chdir(tmp_path)
    _write_pairs(tmp_path / "pairs.jsonl", demo_examples(24, seed=3))
    write_stsb(tmp_path / "dev.csv")
    train(_best_config(tmp_path / "run", train_data="pairs.jsonl", dev_data="dev.csv"), on_step=_stop_at(3))
    os.mkdir(tmp_path / "moved")
    os.rename(tmp_path / "pairs.jsonl", tmp_path / "moved" / "renamed.jsonl")
    shutil.copy(tmp_path / "dev.csv", tmp_path / "dev-copy.csv")
    capsys.readouterr()
    resumed = train(_best_config(tmp_path / "run", train_data="moved/renamed.jsonl", dev_data="dev-copy.csv",
                                 resume="auto"))
    assert [row["step"] for row in resumed.history] == [3, 4]
    said = [line for line in capsys.readouterr().out.splitlines() if " moved: " in line]
    assert said == ["training data moved: pairs.jsonl -> moved/renamed.jsonl, same content",
                    "dev data moved: dev.csv -> dev-copy.csv, same content"]

    written = trainer.data_record  # a checkpoint of the version that recorded the sampled fingerprint alone
    monkeypatch.setattr(trainer, "data_record", lambda count, fingerprint, order, fmt=None, sampled=None, given=False: {
        "examples": count, "fingerprint": sampled_data_fingerprint(demo_examples(24, seed=3)),
        "order": order_fingerprint(order)})
    train(_best_config(tmp_path / "older", train_data="moved/renamed.jsonl", dev_data="dev.csv"), on_step=_stop_at(3))
    monkeypatch.setattr(trainer, "data_record", written)
    shutil.copy(tmp_path / "moved" / "renamed.jsonl", tmp_path / "copy.jsonl")
    with pytest.raises(ValueError, match=r"\(--train-data: 'moved/renamed.jsonl' -> 'copy.jsonl'\); resuming would "
                                         "skip or repeat training data"):
        train(_best_config(tmp_path / "older", train_data="copy.jsonl", dev_data="dev.csv", resume="auto"))


def test_a_checkpoint_that_records_a_split_given_with_a_data_file_resumes_without_it(tmp_path, monkeypatch):
    """A run started before --train-split / --dev-split with a data file were refused read the files whole, the
    split ignored, and its checkpoints record the split. Resumed with the same command it is refused before the data
    is read, saying to leave the flags out; left out, the recorded split was refused as other training data ("would
    skip or repeat training data") and other dev data, and nothing resumed it. A split that reads nothing here is not
    compared: the run resumes where it stopped. A split of a dataset that has splits is compared as before."""
    from test_cli_errors import write_stsb

    from angle_train import checkpoint, trainer

    pairs = _write_pairs(tmp_path / "pairs.jsonl", demo_examples(24, seed=3))
    dev = str(write_stsb(tmp_path / "dev.csv"))
    splits = {"train_split": "test", "dev_split": "test"}
    with monkeypatch.context() as patch:  # the code before the refusal
        patch.setattr(trainer, "check_split_settings", lambda cfg, **given: None)
        train(_best_config(tmp_path / "run", train_data=pairs, dev_data=dev, **splits), on_step=_stop_at(3))
    with pytest.raises(ValueError, match=r"^--train-split test says which split .* leave out --train-split; --resume "
                                         r"takes a checkpoint of a run that gave --train-split without it \(that run "
                                         r"read the file whole too\)$"):
        train(_best_config(tmp_path / "run", train_data=pairs, dev_data=dev, resume="auto", **splits))
    resumed = train(_best_config(tmp_path / "run", train_data=pairs, dev_data=dev, resume="auto"))
    assert [row["step"] for row in resumed.history] == [3, 4]
    saved = {**dataclasses.asdict(_best_config(tmp_path / "run", train_data=pairs, dev_data=dev)), **splits}
    older = Position(step=2, best=0.5, best_step=2)  # no dev fingerprint: written before it was recorded
    checkpoint._refuse_another_dev_set("ck", saved, older, _best_config(tmp_path / "run", dev_data=dev),
                                       "0123456789abcdef")
    hub = {**saved, "train_data": "someone/pairs"}
    with pytest.raises(ValueError, match=r"\(--train-split: 'test' -> 'train'\); resuming would skip or repeat"):
        checkpoint._refuse_changed_data_settings("ck", hub, _best_config(tmp_path / "run", train_data="someone/pairs"))


def test_the_fp16_loss_scale_resumes_where_it_was(tmp_path):
    """An fp16 run's loss scale, backed off after overflows, and its growth tracker are in its checkpoints: a resumed
    run goes on from them (restarting at 65,536 redid the overflow-and-skip steps the run had already paid for)."""
    cfg = _config(tmp_path, max_steps=3)
    encoder, _ = make_encoder()
    optimizer = make_optimizer(cfg, encoder, torch.device("cpu"))
    scheduler = make_schedule(cfg, optimizer, 3)
    scaler = torch.amp.GradScaler("cpu", enabled=True)
    scaler.scale(torch.tensor(1.0))  # the scale exists once a loss has been scaled
    scaler.update(new_scale=1024.0)
    path = save_checkpoint(cfg, Position(step=3), DistInfo(), encoder=encoder, optimizer=optimizer,
                           scheduler=scheduler, scaler=scaler)
    resumed = torch.amp.GradScaler("cpu", enabled=True)
    load_checkpoint(path, cfg, DistInfo(), encoder=encoder, optimizer=optimizer, scheduler=scheduler, scaler=resumed)
    assert resumed.state_dict() == scaler.state_dict() and resumed.get_scale() == 1024.0


def test_a_resumed_run_does_not_score_step_0_again(tmp_path):
    """--eval-on-start scores the model before the first step; a resumed run starts later and does not (it scored
    the checkpoint's step a second time, and metrics.jsonl held that step's dev row twice)."""
    settings = dict(batch_size=8, max_steps=4, save_every=2, eval_every=2, log_every=1, eval_on_start=True)
    data, dev = (demo_examples(40, seed=3), "B"), demo_sts_examples(12, seed=5)
    first = train(_config(tmp_path, **settings), train_examples=data, dev_examples=dev, on_step=_stop_at(3))
    resumed = train(_config(tmp_path, resume="auto", **settings), train_examples=data, dev_examples=dev)
    assert [row["step"] for row in first.evals] == [0, 2] and [row["step"] for row in resumed.evals] == [4]
    rows = tracking.read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [row["step"] for row in rows if "dev_spearman" in row] == [0, 2, 4]


def test_resume_refuses_a_change_to_any_one_example(tmp_path):
    """The fingerprint took at most 1,000 evenly spaced examples: past 2,000, an edit to one between them (every
    other one at 2,500) resumed in silence into batches of other texts. Every example counts now."""
    examples = demo_examples(2160, seed=3) + demo_examples(340, seed=4)  # 2,160: the demo's distinct pairs
    train(_config(tmp_path / "run"), train_examples=(examples, "B"), on_step=_stop_at(4))
    edited = list(examples)
    edited[1] = Example(texts=(edited[1].texts[0], "a text that was not there"), label=edited[1].label)
    with pytest.raises(ValueError, match=r"with train_examples: they differ from the checkpoint's training data "
                                         r"\(2,500 examples, fingerprint \w+; now 2,500, fingerprint \w+\)"):
        train(_config(tmp_path / "run", resume="auto"), train_examples=(edited, "B"))
    resumed = train(_config(tmp_path / "run", resume="auto"), train_examples=(examples, "B"))
    assert [row["step"] for row in resumed.history] == [4, 5, 6, 7]


def test_a_checkpoint_recording_the_sampled_fingerprint_still_resumes(tmp_path, monkeypatch):
    """Checkpoints of the version before recorded a fingerprint of 1,000 sampled examples ("fingerprint", not
    "contents"): they resume over the same data and refuse other data by that one."""
    import angle_train.trainer as trainer

    examples = demo_examples(24, seed=3)
    written = trainer.data_record
    monkeypatch.setattr(trainer, "data_record", lambda count, fingerprint, order, fmt=None, sampled=None, given=False: {
        "examples": count, "fingerprint": sampled_data_fingerprint(examples), "order": order_fingerprint(order)})
    train(_config(tmp_path / "run"), train_examples=(examples, "B"), on_step=_stop_at(4))
    monkeypatch.setattr(trainer, "data_record", written)
    with pytest.raises(ValueError, match=r"they differ from the checkpoint's training data \(24 examples"):
        train(_config(tmp_path / "run", resume="auto"), train_examples=(demo_examples(24, seed=4), "B"))
    resumed = train(_config(tmp_path / "run", resume="auto"), train_examples=(examples, "B"))
    assert [row["step"] for row in resumed.history] == [4, 5, 6, 7]


def test_the_data_fingerprint_tells_apart_any_one_change():
    examples = demo_examples(2160, seed=1) + demo_examples(840, seed=2)
    prints = {data_fingerprint(examples)}
    for i in (1, 1499, 2999):
        changed = list(examples)
        changed[i] = Example(texts=changed[i].texts, label=changed[i].label + 1.0)
        prints.add(data_fingerprint(changed))
    prints.add(data_fingerprint(examples[:-1]))
    prints.add(data_fingerprint(["ab", "c"]))
    prints.add(data_fingerprint(["a", "bc"]))
    prints.add(data_fingerprint([Example(texts=("a", "b|1:c"))]))
    prints.add(data_fingerprint([Example(texts=("a", "b", "c"))]))
    assert len(prints) == 9
    assert data_fingerprint(list(examples)) == data_fingerprint(examples)


def test_a_bucketed_checkpoint_of_the_earlier_order_is_refused_naming_the_change(tmp_path, monkeypatch):
    """A --bucket checkpoint written by the version whose --bucket left out the longest examples of the epoch's last
    run (ORDER_VERSION 1, recording no version) cannot continue its epoch in this version's order: refused naming
    --bucket and the change, not as another order of the same data. Without --bucket the orders are the same and
    such a checkpoint resumes as before."""
    import angle_train.trainer as trainer

    data = (demo_examples(60, seed=5), "B")  # 7 batches of 8 and 4 examples left out
    written, ordered = trainer.data_record, trainer.batch_order
    monkeypatch.setattr(trainer, "data_record", lambda *args, **kwargs: {
        key: value for key, value in written(*args, **kwargs).items() if key != "order_version"})
    monkeypatch.setattr(trainer, "batch_order", lambda cfg, dataset, epoch: version_1_epoch_batches(
        len(dataset), cfg.batch_size, seed=cfg.seed, epoch=epoch, lengths=dataset.lengths, bucket_size=cfg.bucket))
    for run, bucket in (("bucketed", 2), ("plain", 0)):
        train(_config(tmp_path / run, bucket=bucket), train_examples=data, on_step=_stop_at(4))
    monkeypatch.setattr(trainer, "data_record", written)
    monkeypatch.setattr(trainer, "batch_order", ordered)
    with pytest.raises(ValueError, match=r"cannot resume from .*step-00000003: it was written by an earlier "
                                         r"angle-train, whose --bucket left out the longest examples of each epoch's "
                                         r"last bucket .* Finish the run with the angle-train that wrote the "
                                         r"checkpoint, or start a new run in a new --output-dir"):
        train(_config(tmp_path / "bucketed", bucket=2, resume="auto"), train_examples=data)
    resumed = train(_config(tmp_path / "plain", resume="auto"), train_examples=data)
    assert [row["step"] for row in resumed.history] == [4, 5, 6, 7]


def test_resume_with_bucketing_refuses_a_max_length_that_reorders_the_epoch(tmp_path, capsys):
    """With --bucket, the epoch's order sorts by token counts, which --max-length changes: a resume with another one
    (a setting a resume may change, with a note) went through another order of the same epoch, in silence (11 of
    64 examples trained twice, 11 never). Refused now; without --bucket the order does not depend on it, and the
    resume takes it from the resumed step on, as before."""
    data = (demo_examples(64, seed=5), "B")
    train(_config(tmp_path / "bucketed", bucket=2), train_examples=data, on_step=_stop_at(4))
    with pytest.raises(ValueError, match=r"cannot resume from .*: the same training data, but the batches of epoch 0 "
                                         r"come out in another order than the checkpoint's \(--bucket 2 sorts them by "
                                         r"the texts' token counts, --max-length 12 -> 5\)"):
        train(_config(tmp_path / "bucketed", bucket=2, max_length=5, resume="auto"), train_examples=data)
    train(_config(tmp_path / "plain"), train_examples=data, on_step=_stop_at(4))
    resumed = train(_config(tmp_path / "plain", max_length=5, resume="auto"), train_examples=data)
    assert [row["step"] for row in resumed.history] == [4, 5, 6, 7]
    assert "resuming with changed settings (--max-length 12 -> 5): they apply from step 3 on" in capsys.readouterr().out
