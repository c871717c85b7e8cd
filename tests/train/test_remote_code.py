"""A model that ships its own Python code (config.json's auto_map: gte-base-en-v1.5, nomic-embed, jina's models):
angle-train and angle-eval run that code only with --trust-remote-code (TrainConfig.trust_remote_code, load_encoder's
and load_pretrained's trust_remote_code); without it they refuse in one line naming the model and the flag, before the
code runs. A trained one's export keeps the code, and scores where trusted. A tiny BERT under a custom model type,
written to a folder, no network."""

from __future__ import annotations

import json
import os

import pytest
from train_helpers import run_config

from angle_train import cli, evaluate
from angle_train.tiny import build_tokenizer, demo_examples, demo_sts_examples
from angle_train.trainer import train

# The folder's code: a BERT under another model type; importing it writes the file $RAN_MARKER names, so a test can
# tell whether the code ran.
CONFIG_CODE = '''import os

from transformers import BertConfig

open(os.environ["RAN_MARKER"], "a").close()


class TinyRemoteConfig(BertConfig):
    model_type = "tiny-remote"
'''
MODEL_CODE = '''from transformers import BertModel

from .configuration_tiny import TinyRemoteConfig


class TinyRemoteModel(BertModel):
    config_class = TinyRemoteConfig
'''


def remote_code_model(folder) -> str:
    """A model folder whose config.json names its own code for AutoConfig and AutoModel."""
    from transformers import BertConfig, BertModel

    tokenizer = build_tokenizer()
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=128)
    BertModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    with open(os.path.join(folder, "config.json")) as f:
        settings = json.load(f)
    settings.update(model_type="tiny-remote", auto_map={"AutoConfig": "configuration_tiny.TinyRemoteConfig",
                                                        "AutoModel": "modeling_tiny.TinyRemoteModel"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(settings, f)
    for name, code in (("configuration_tiny.py", CONFIG_CODE), ("modeling_tiny.py", MODEL_CODE)):
        with open(os.path.join(folder, name), "w") as f:
            f.write(code)
    return str(folder)


def test_untrusted_code_is_refused_naming_the_flag_before_it_runs_and_trusted_it_trains_and_scores(tmp_path, capsys,
                                                                                                   monkeypatch):
    model = remote_code_model(tmp_path / "remote-model")
    marker = tmp_path / "RAN"
    monkeypatch.setenv("RAN_MARKER", str(marker))
    capsys.readouterr()  # transformers' progress bar as it saved the folder
    argv = ["--model", model, "--output-dir", str(tmp_path / "refused"), "--device", "cpu", "--progress", "0",
            "--max-steps", "1", "--batch-size", "4"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert err == (f"angle-train: error: --model {model} ships its own model code (config.json's auto_map), which runs "
                   "only when trusted, with your permissions: read it, then add --trust-remote-code "
                   "(trust_remote_code=True in Python)\n")
    assert not marker.exists()

    result = train(run_config(tmp_path / "run", model=model, trust_remote_code=True, max_steps=1, batch_size=4,
                              save_final=True), train_examples=(demo_examples(8, seed=1), "B"))
    assert type(result.encoder.backbone).__name__ == "TinyRemoteModel" and marker.exists()
    final = tmp_path / "run" / "final"
    assert {"configuration_tiny.py", "modeling_tiny.py"} <= set(os.listdir(final))  # the export runs as it trained
    card = (final / "README.md").read_text()  # its usage lines load it trusted
    assert 'SentenceTransformer("path/to/this/folder", trust_remote_code=True)' in card
    assert "runs the Python code in this folder" in card

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"text1": e.texts[0], "text2": e.texts[1], "label": e.label}) + "\n"
                             for e in demo_sts_examples(24)))
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        evaluate.main([str(final), str(pairs), "--progress", "0"])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith(f"angle-eval: error: MODEL {final} ships its own model code")
    assert evaluate.main([str(final), str(pairs), "--progress", "0", "--trust-remote-code"]) == 0
    assert "| pairs |" in capsys.readouterr().out
