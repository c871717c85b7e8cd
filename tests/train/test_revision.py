"""--revision: the branch, tag or commit of a Hugging Face Hub model (angle-train's --model, angle-eval's MODEL) reaches
every load (config, tokenizer, weights, the sentence-transformers files), the exports record it (angle_train.json's
base_revision, peft's adapter_config.json revision), and their adapters load the base at it; refused where there is no
Hub repository to pick a version of, and named where the repository has no such revision. The Hub is a local tiny BERT
served under a hub name, its loaders recording the revision each load asked for. No network."""

from __future__ import annotations

import json
import shutil

import httpx
import pytest
import torch
from huggingface_hub.errors import RevisionNotFoundError
from train_helpers import make_encoder, run_config

from angle_train import evaluate
from angle_train.config import TrainConfig
from angle_train.export import load_pretrained, save_pretrained
from angle_train.models import load_encoder
from angle_train.tiny import demo_examples, demo_sts_examples
from angle_train.trainer import train

HUB = "owner/tiny-model"


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """HUB served from a saved tiny BERT: a list of (loader, revision asked for) as each load of it is made; revision
    "missing" is one the repository does not have."""
    import huggingface_hub
    import transformers

    encoder, tokenizer = make_encoder("bert", dtype=torch.float32)
    snapshot = tmp_path / "hub-snapshot"
    encoder.backbone.save_pretrained(snapshot)
    tokenizer.save_pretrained(snapshot)
    asked = []

    def served(loader, original):
        def from_pretrained(name, *args, **kwargs):
            if name != HUB:
                return original(name, *args, **kwargs)
            revision = kwargs.pop("revision", None)
            asked.append((loader, revision))
            if revision == "missing":
                raise RevisionNotFoundError("404 revision not found", response=httpx.Response(
                    404, request=httpx.Request("GET", f"https://huggingface.co/api/models/{HUB}/revision/missing")))
            loaded = original(str(snapshot), *args, **kwargs)
            config = getattr(loaded, "config", loaded)  # the name it was loaded by, as the Hub's loads record it
            if hasattr(config, "_name_or_path"):
                config._name_or_path = HUB
            if "name_or_path" in vars(loaded):  # a model's, which peft records as its adapters' base
                loaded.name_or_path = HUB
            return loaded
        return from_pretrained

    for cls in (transformers.AutoConfig, transformers.AutoTokenizer, transformers.AutoModel):
        monkeypatch.setattr(cls, "from_pretrained", served(cls.__name__, cls.from_pretrained))

    def snapshot_download(name, *, allow_patterns=None, revision=None, **kwargs):
        asked.append(("snapshot_download", revision))
        return str(snapshot)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    return asked


LOADS = {"AutoConfig", "AutoTokenizer", "AutoModel", "snapshot_download"}


def test_the_revision_reaches_every_load_and_the_exports_adapters_load_their_base_at_it(hub, tmp_path, capsys):
    result = train(run_config(tmp_path / "run", model=HUB, revision="v1.0", lora=True, lora_r=4, max_steps=1,
                              batch_size=4, save_final=True), train_examples=(demo_examples(8, seed=1), "B"))
    assert {loader for loader, _ in hub} == LOADS and {revision for _, revision in hub} == {"v1.0"}
    assert result.encoder.revision == "v1.0"
    final = tmp_path / "run" / "final"
    assert json.loads((final / "angle_train.json").read_text())["base_revision"] == "v1.0"
    assert json.loads((final / "adapter" / "adapter_config.json").read_text())["revision"] == "v1.0"
    assert "--revision v1.0" in (final / "README.md").read_text()  # the run's command

    best = save_pretrained(result.encoder, result.tokenizer, str(tmp_path / "best"), max_length=16, adapter_only=True,
                           base_model=HUB)  # as a LoRA run's best/ is written
    assert json.loads((tmp_path / "best" / "adapter_config.json").read_text())["revision"] == "v1.0"
    for adapter in (best, str(final / "adapter")):  # an adapter-only export; a final/adapter with its export's record
        hub.clear()
        reloaded = load_pretrained(adapter)[0]
        assert {revision for _, revision in hub} == {"v1.0"} and reloaded.revision == "v1.0"

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"text1": e.texts[0], "text2": e.texts[1], "label": e.label}) + "\n"
                             for e in demo_sts_examples(24)))
    for adapter in (best, shutil.copytree(final / "adapter", tmp_path / "peft-adapter")):
        hub.clear()  # angle-eval: an adapter-only export; a peft adapter folder alone (its adapter_config.json's)
        assert evaluate.main([str(adapter), str(pairs), "--progress", "0"]) == 0
        assert {revision for _, revision in hub} == {"v1.0"}
    hub.clear()  # training on from the adapter, without --model: its base at the revision it records
    again = run_config(tmp_path / "again", lora=True, lora_path=best, max_steps=1, batch_size=4)
    train(again, train_examples=(demo_examples(8, seed=1), "B"))
    assert (again.model, again.revision) == (HUB, "v1.0") and {revision for _, revision in hub} == {"v1.0"}
    hub.clear()
    assert evaluate.main([HUB, str(pairs), "--progress", "0", "--revision", "v2"]) == 0
    assert {loader for loader, _ in hub} == LOADS and {revision for _, revision in hub} == {"v2"}
    capsys.readouterr()


def test_a_revision_the_repository_does_not_have_is_named_with_the_setting_that_gave_it(hub):
    with pytest.raises(ValueError, match=rf"^--revision missing: --model {HUB} has no such branch, tag or commit on "
                                         "the Hugging Face Hub$"):
        load_encoder(HUB, revision="missing", given_as="--model", revision_given_as="--revision")
    with pytest.raises(ValueError, match=rf"^revision=missing: name_or_path={HUB} has no such branch"):
        load_encoder(HUB, revision="missing")


def test_a_revision_without_a_hub_repository_to_pick_it_from_is_refused(tmp_path, capsys):
    for model, what in (("builtin:tiny-bert", "built in"), (str(tmp_path), "a local folder")):
        with pytest.raises(ValueError, match=rf"^--revision picks a version of a Hugging Face Hub repository, and "
                                             rf"--model {model} is {what}: leave out --revision$"):
            train(run_config(tmp_path / "out", model=model, revision="v1", max_steps=1, batch_size=4))
        assert not (tmp_path / "out").exists()  # before the run's folder is made
    with pytest.raises(ValueError, match="--revision must name a branch, a tag or a commit"):
        TrainConfig(model=HUB, revision=" ").validate()
    encoder, tokenizer = make_encoder("bert", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"^--revision v1 picks the version of --model's repository that angle_train "
                                         r"loads, and train\(\) was given a model in its place"):
        train(run_config(tmp_path / "run", revision="v1", max_steps=1, batch_size=4), model=(encoder, tokenizer),
              train_examples=(demo_examples(8, seed=1), "B"))
    for argv, said in (([str(tmp_path), "x.csv", "--revision", "v1"], "--revision picks a version of a Hugging Face "
                                                                      f"Hub repository, and MODEL {tmp_path} is a "
                                                                      "local folder"),
                       ([HUB, "x.csv", "--revision", ""], "--revision must name a branch, a tag or a commit")):
        (tmp_path / "config.json").write_text("{}")
        with pytest.raises(SystemExit) as exit_info:
            evaluate.main(argv)
        assert exit_info.value.code == 2 and said in capsys.readouterr().err
