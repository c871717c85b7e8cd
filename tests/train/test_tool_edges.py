"""The commands' promises at their edges: angle-eval's `--prompt ''` (no prompt) and `--pooling` over an export's
own, a SICK row too short and a --max-length equal to the position table; the settings' whole numbers and positive
weights; angle-train's exit statuses (3: non-finite steps, 75: preempted) as numbers, a stop asked before the final
export abandoning it; preflight's bounds (room for one token of text, a padded embedding table, the last CUDA device,
a device type without a backend) and its model-folder checks; an export over a LoRA export leaving no adapter behind."""

from __future__ import annotations

import os

import pytest
import torch
from train_helpers import make_encoder

from angle_train import evaluate, faults, preflight
from angle_train.data import DataError, Prompts
from angle_train.export import META_FILE, save_pretrained


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A cls-pooled export whose text prompt is 'query: '."""
    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="cls")
    encoder.prompts = Prompts(text="query: {text}")
    return save_pretrained(encoder, tokenizer, str(tmp_path_factory.mktemp("export") / "model"), max_length=16)


def test_angle_eval_prompt_empty_is_no_prompt(export, tmp_path, monkeypatch):
    sts = tmp_path / "sts.csv"
    sts.write_text("sentence1,sentence2,score\na red car,a blue car,3.0\na dog,a cat,1.0\na big tree,a tree,4.0\n")
    seen = {}

    def records_the_prompt(encoder, tokenizer, datasets, **kwargs):
        seen["prompt"] = encoder.prompts.for_role("text")
        return {}

    monkeypatch.setattr(evaluate, "evaluate", records_the_prompt)
    assert evaluate.main([export, str(sts), "--prompt", "", "--progress", "0"]) == 0
    assert seen["prompt"] in (None, "")
    evaluate.main([export, str(sts), "--progress", "0"])
    assert seen["prompt"] == "query: {text}"  # without the flag, the export's own


def test_angle_eval_pooling_overrides_an_exports(export):
    encoder, _, meta = evaluate.load_model(export, pooling="avg")
    assert meta["pooling"] == "cls" and (encoder.pooling, encoder.pooling_source) == ("avg", "--pooling")


def test_a_sick_row_too_short_is_a_data_error_naming_its_line(tmp_path):
    path = tmp_path / "SICK_test.txt"
    path.write_text("\t".join(evaluate.SICK_HEADER) + "\n1\tA man walks\tA man is walking\n")
    with pytest.raises(DataError, match="line 2"):
        evaluate.read_sick(str(path))


def test_a_max_length_equal_to_the_position_table_is_taken(export, monkeypatch):
    import angle_train.models as models

    encoder, tokenizer, meta = evaluate.load_model(export)
    limit = models.position_limit(encoder.backbone)
    assert evaluate.encoding_length(limit, meta, encoder, tokenizer, "m") == limit
    with pytest.raises(ValueError, match="longer than m can read"):
        evaluate.encoding_length(limit + 1, meta, encoder, tokenizer, "m")
    # a length from the export's angle_train.json is named as that, not as a flag that was never given
    with pytest.raises(ValueError, match=rf"^max_length {limit + 1} \(the export's angle_train.json\) is longer"):
        evaluate.encoding_length(None, {**meta, "max_length": limit + 1}, encoder, tokenizer, "m")


def test_angle_eval_encodes_a_sentence_transformers_model_at_its_max_seq_length(tmp_path):
    """A sentence-transformers folder that is no export (all-MiniLM-L6-v2: max_seq_length 256) was encoded at 512,
    where sentence-transformers cuts at its max_seq_length, and its export (which records that length) at 256: a base
    and its fine-tune were scored at different lengths. Its max_seq_length is the default now, within the position
    table; --max-length still wins."""
    import json

    from angle_train.models import position_limit

    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    folder = save_pretrained(encoder, tokenizer, str(tmp_path / "st"), max_length=16)
    os.remove(os.path.join(folder, META_FILE))  # a plain sentence-transformers folder
    settings = os.path.join(folder, "sentence_bert_config.json")
    for saved, expected in ((9, 9), (10_000, None)):
        with open(settings, "w") as f:
            json.dump({"max_seq_length": saved, "do_lower_case": False}, f)
        loaded, loaded_tokenizer, meta = evaluate.load_model(folder)
        expected = expected or position_limit(loaded.backbone)  # a folder may claim more than the model reads
        assert evaluate.encoding_length(None, meta, loaded, loaded_tokenizer, folder) == expected
        assert evaluate.encoding_length(7, meta, loaded, loaded_tokenizer, folder) == 7


def test_list_settings_take_whole_numbers_and_positive_weights():
    from angle_train.config import TrainConfig

    with pytest.raises(ValueError, match="64.5"):
        TrainConfig(matryoshka_dims=[64.5, 32]).validate()
    with pytest.raises(ValueError, match="matryoshka-weights"):
        TrainConfig(matryoshka_dims=[64, 32], matryoshka_weights=[1.0, 0.0]).validate()


@pytest.mark.parametrize("error, status, stream", [
    (faults.NonFiniteTrainingError("5 non-finite steps in a row"), 3, "err"),  # a failure: on stderr
    (faults.Preempted("SIGTERM", "a checkpoint"), 75, "out"),  # a stop asked for, to resume
])
def test_angle_train_exit_statuses_are_the_documented_numbers(tmp_path, monkeypatch, capsys, error, status, stream):
    from angle_train import cli, trainer

    def train(cfg):
        raise error

    monkeypatch.setattr(trainer, "train", train)
    assert cli.main(["--output-dir", str(tmp_path / "run"), "--device", "cpu"]) == status
    assert getattr(capsys.readouterr(), stream).startswith(f"angle-train: {error}")


def test_a_stop_asked_before_the_final_export_abandons_it():
    stops = faults.StopSignals()
    stops.requested = "SIGTERM"  # arrived during the last optimizer step
    with pytest.raises(faults.Interrupted):
        with stops.interrupting():
            pass


def test_preflight_bounds(monkeypatch):
    class Tokenizer:
        def __init__(self, tokens=100):
            self.tokens = tokens

        def __len__(self):
            return self.tokens

        def num_special_tokens_to_add(self, pair=False):
            return 2

    embeddings = torch.nn.Embedding(100, 4)
    encoder = type("E", (), {"backbone": type("B", (), {"get_input_embeddings": lambda self: embeddings})()})()
    preflight.check_tokenizer(Tokenizer(), encoder, "m", 3)  # one token of text
    with pytest.raises(ValueError, match="leaves no room for text"):
        preflight.check_tokenizer(Tokenizer(), encoder, "m", 2)
    # a table padded past the vocabulary (to a multiple of 64 or 128, reserved rows) is no lost vocabulary
    padded = torch.nn.Embedding(128, 4)
    padded_encoder = type("E", (), {"backbone": type("B", (), {"get_input_embeddings": lambda self: padded})()})()
    preflight.check_tokenizer(Tokenizer(100), padded_encoder, "m", 16)
    preflight.check_tokenizer(Tokenizer(64), padded_encoder, "m", 16)
    with pytest.raises(ValueError, match="the tokenizer of m has 63 tokens for a model of 128 token embeddings"):
        preflight.check_tokenizer(Tokenizer(63), padded_encoder, "m", 16)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    preflight.check_device("cuda:1")
    with pytest.raises(ValueError, match=r"--device cuda:2: this machine has 2 cuda device\(s\), cuda:0 to cuda:1$"):
        preflight.check_device("cuda:2")
    # a device type torch names but has no backend module for here (no torch.xla): refused, not left to fail later
    assert getattr(torch, "xla", None) is None
    with pytest.raises(ValueError, match="--device xla: this machine has no xla device that torch"):
        preflight.check_device("xla")


def test_model_folder_checks_name_the_runs_model_and_read_every_weights_file(tmp_path):
    """A run's output folder names its final/ and best/, or says it holds no model yet; a folder whose only
    tokenizer file is a WordPiece vocab.txt is a model folder; every *.safetensors shard is checked, not only
    model.safetensors; a config.json is a run's settings only with both output_dir and train_data."""
    import json
    import re

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"output_dir": str(run), "train_data": "pairs.jsonl"}))
    with pytest.raises(ValueError, match="is an angle-train run's output folder, not a model: it holds no final/ or "
                                         "best/ model yet"):
        preflight.check_model_folder(str(run), "--model")
    (run / "best").mkdir()
    (run / "final").mkdir()
    with pytest.raises(ValueError, match=re.escape(f"not a model: its models are in {run / 'final'} and "
                                                   f"{run / 'best'}") + "$"):
        preflight.check_model_folder(str(run), "--model")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (model / "vocab.txt").write_text("[PAD]\n[UNK]\n[CLS]\n[SEP]\nred\n")
    preflight.check_model_folder(str(model), "--model")
    (model / "model-00002-of-00002.safetensors").write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{")
    with pytest.raises(ValueError, match="the weights file .*model-00002-of-00002.safetensors is damaged"):
        preflight.check_model_folder(str(model), "--model")
    assert not preflight.is_run_settings({"output_dir": "out"})  # another program's settings
    assert preflight.is_run_settings({"output_dir": "out", "train_data": "pairs.jsonl"})


def test_an_export_over_a_lora_export_leaves_no_adapter(tmp_path):
    folder = tmp_path / "model"
    (folder / "adapter").mkdir(parents=True)
    (folder / "adapter" / "adapter_config.json").write_text("{}")
    (folder / META_FILE).write_text("{}")  # an earlier (LoRA) export
    save_pretrained(*make_encoder("bert", dtype=torch.float32), str(folder), max_length=16)
    assert not os.path.exists(folder / "adapter")
