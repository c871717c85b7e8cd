"""LoRA adapters not written by angle-train's exports: one saved from a decoder LM with its LM head (as angle-emb and
most LoRA trainers save theirs) attaches to the base model without it, layer names and all; one that fits no layer is
refused instead of leaving the base model's embeddings in silence; angle-eval scores an adapter folder on its base
model (adapter_config.json's, or --base-model)."""

import json
import re

import pytest
import torch

from angle_train.evaluate import main
from angle_train.models import ADAPTER_CONFIG, load_encoder, prepare_tokenizer
from angle_train.tiny import build_tokenizer, demo_sts_examples

TEXTS = ["a small red car", "the dog is black and big", "box"]


def causal_lm(folder, *, layers: int = 2, width: int = 32) -> str:
    """A random tiny LlamaForCausalLM (LM head included) and its tokenizer saved to `folder`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_tokenizer()
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=width, intermediate_size=2 * width,
                         num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def pairs_file(folder):
    """A format-A file of 24 scored pairs in `folder`, for angle-eval."""
    pairs = folder / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"text1": e.texts[0], "text2": e.texts[1], "label": e.label}) + "\n"
                             for e in demo_sts_examples(24)), encoding="utf-8")
    return pairs


def lora_export(folder):
    """(base, final, encoder, tokenizer): a LoRA encoder (non-zero adapter) over a tiny causal LM in folder/base, with
    mean pooling, bidirectional attention and the AnglE prompt, exported whole to folder/final (the adapter alone in
    final/adapter), as a LoRA run's final/."""
    from angle_train.data import ANGLE_PROMPT, Prompts
    from angle_train.export import save_pretrained
    from angle_train.models import LoraSettings

    base = causal_lm(folder / "base")
    encoder, tokenizer = load_encoder(base, pooling="avg", bidirectional=True,
                                      lora=LoraSettings(r=4, alpha=8, dropout=0.0))
    with torch.no_grad():  # the adapter's B starts at zero: the adapter would change nothing
        for name, weight in encoder.named_parameters():
            if "lora_B" in name:
                weight.normal_(generator=torch.Generator().manual_seed(0))
    encoder.prompts = Prompts(text=ANGLE_PROMPT)
    final = save_pretrained(encoder, tokenizer, str(folder / "final"), max_length=16, base_model=base)
    return base, final, encoder, tokenizer


def causal_adapter(base: str, folder, targets="all-linear", seed: int = 1, alpha: float = 8, rslora: bool = False):
    """(the adapter's folder, the causal LM with it): a LoRA adapter of rank 4 with non-zero weights
    (init_lora_weights=False, drawn from `seed`) saved from the LlamaForCausalLM in `base`, as peft saves it: layer
    names under the LM's `model.`; rslora: an rsLoRA adapter (peft's use_rslora: scaled by alpha / sqrt(4))."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(LlamaForCausalLM.from_pretrained(base),
                           LoraConfig(r=4, lora_alpha=alpha, target_modules=targets, init_lora_weights=False,
                                      use_rslora=rslora))
    model.save_pretrained(folder)
    return str(folder), model.eval()


def test_an_adapter_saved_with_its_lm_head_attaches_to_the_base_model(tmp_path):
    base = causal_lm(tmp_path / "base")
    adapter, model = causal_adapter(base, tmp_path / "adapter")
    assert any(name.startswith("model.") for name in json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
               ["target_modules"])
    encoder, tokenizer = load_encoder(base, lora_path=adapter)
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch, output_hidden_states=True).hidden_states[-1][:, -1]  # left padding: the last token
        torch.testing.assert_close(encoder.eval()(batch["input_ids"], batch["attention_mask"]), hidden)
    assert any(p.requires_grad for p in encoder.parameters())  # trainable, as load_encoder's adapters always were


def test_building_and_attaching_adapters_shows_no_deprecation_warning_meant_for_peft(tmp_path):
    """peft reads transformers' deprecated `is_gradient_checkpointing` as it wraps a model (peft 0.21, transformers
    5): the FutureWarning it raised at every LoRA run's start is left out, and only it."""
    import warnings

    from angle_train.models import LoraSettings, peft_wrapping

    base = causal_lm(tmp_path / "base")
    adapter, _ = causal_adapter(base, tmp_path / "adapter")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load_encoder(base, lora=LoraSettings(r=4, alpha=8))
        load_encoder(base, lora_path=adapter)
        with peft_wrapping():
            warnings.warn("another FutureWarning", FutureWarning)
    said = [str(w.message) for w in caught]
    assert not [text for text in said if "is_gradient_checkpointing" in text], said
    assert "another FutureWarning" in said


def test_an_adapter_that_fits_no_layer_of_the_base_is_refused(tmp_path):
    deeper = causal_lm(tmp_path / "deeper", layers=3)
    adapter, _ = causal_adapter(deeper, tmp_path / "adapter", targets=["q_proj", "v_proj"])
    with pytest.raises(ValueError, match=r"does not fit LlamaModel: 4 of its weights fit no layer of the model, 0 of "
                                         r"the layers it adapts have no weights in it \(e\.g\. "
                                         r"base_model\.model\.layers\.2\..*its adapter_config.json names .*deeper"):
        load_encoder(causal_lm(tmp_path / "base"), lora_path=adapter)


def test_an_adapter_of_another_width_or_architecture_is_refused_in_one_line(tmp_path, capsys):
    """An adapter trained on a wider LLaMA, or attached to a BERT: torch's "Error(s) in loading state_dict for
    PeftModel: size mismatch" and peft's NoMatchingPeftModuleError escaped as tracebacks (angle-eval --base-model,
    angle-train --lora-path); refused as an adapter that fits no layer is, naming the adapter, a mismatch and the
    base it was trained on."""
    from angle_train.tiny import build_backbone

    adapter, _ = causal_adapter(causal_lm(tmp_path / "wide", width=64), tmp_path / "adapter", targets=["q_proj"])
    base = causal_lm(tmp_path / "base")
    with pytest.raises(ValueError, match=r"does not fit LlamaModel: its weights have other shapes than the model's "
                                         r"layers \(size mismatch for .*q_proj.*torch.Size\(\[4, 64\]\).*"
                                         r"torch.Size\(\[4, 32\]\)\); it was trained on another model \(its "
                                         r"adapter_config.json names .*wide\)$"):
        load_encoder(base, lora_path=adapter)
    bert = tmp_path / "bert"
    tokenizer = build_tokenizer()
    build_backbone("builtin:tiny-bert", len(tokenizer), hidden_size=32).save_pretrained(bert)
    tokenizer.save_pretrained(bert)
    with pytest.raises(ValueError, match=r"does not fit BertModel: the model has none of the layers it adapts "
                                         r"\(q_proj\); it was trained on another model"):
        load_encoder(str(bert), lora_path=adapter)
    with pytest.raises(SystemExit) as exit_info:
        main([adapter, str(pairs_file(tmp_path)), "--base-model", base])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "angle-eval: error: the LoRA adapter" in err and "Traceback" not in err


def test_angle_eval_scores_an_adapter_folder_on_its_base_model(tmp_path, capsys):
    base = causal_lm(tmp_path / "base")
    adapter, model = causal_adapter(base, tmp_path / "adapter")
    merged = tmp_path / "merged"  # the same model as one folder, the adapter merged into the weights
    model.merge_and_unload().save_pretrained(merged)
    prepare_tokenizer(build_tokenizer(), is_decoder=True).save_pretrained(merged)
    pairs = pairs_file(tmp_path)
    scores = {}
    for name, args in (("adapter", [adapter]), ("merged", [str(merged)]), ("moved", [adapter, "--base-model", base])):
        out = tmp_path / f"{name}.json"
        assert main([*args, str(pairs), "--json", str(out)]) == 0
        scores[name] = json.loads(out.read_text())["pairs"]
    assert scores["adapter"] == pytest.approx(scores["merged"], abs=1e-9) == scores["moved"]
    assert f"the LoRA adapter {adapter} on its base model {base}" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:  # a whole model has no base to take
        main([str(merged), str(pairs), "--base-model", base])
    assert exit_info.value.code == 2
    assert "--base-model" in capsys.readouterr().err


def test_a_lora_exports_adapter_folder_embeds_with_the_exports_pooling_attention_and_prompts(tmp_path, capsys,
                                                                                             monkeypatch):
    """A LoRA run's final/adapter holds peft's files alone; angle-eval and load_pretrained apply it with what its
    export (final/angle_train.json) records, and embed as final/ does. They took it for a bare adapter: the decoder
    default (last token, causal attention, no prompt) in place of the run's mean pooling, bidirectional attention
    and AnglE prompt, and scored another model without a word. angle-eval looks the export up once per model (it
    was looked up again as the model loaded)."""
    from angle_train import export
    from angle_train.export import load_pretrained

    base, final, encoder, tokenizer = lora_export(tmp_path)
    adapter = str(tmp_path / "final" / "adapter")
    whole, alone = load_pretrained(final)[0], load_pretrained(adapter)[0]
    assert (alone.pooling, alone.bidirectional, alone.prompts) == ("avg", True, encoder.prompts)
    torch.testing.assert_close(alone.encode(TEXTS, tokenizer), whole.encode(TEXTS, tokenizer), rtol=1e-5, atol=1e-5)
    pairs, scores, looked_up = pairs_file(tmp_path), {}, []
    find_export = export.adapter_export_meta
    monkeypatch.setattr(export, "adapter_export_meta", lambda folder: looked_up.append(folder) or find_export(folder))
    for name, model in (("final", final), ("adapter", adapter)):
        out = tmp_path / f"{name}.json"
        assert main([model, str(pairs), "--json", str(out)]) == 0
        scores[name] = json.loads(out.read_text())["pairs"]
    assert scores["adapter"] == pytest.approx(scores["final"], abs=1e-6)
    assert looked_up == [adapter]  # final/ is a whole model: no adapter's export to look up
    err = capsys.readouterr().err
    assert (f"the LoRA adapter {adapter} on its base model {base}, with its export's pooling, attention and prompts "
            f"({tmp_path / 'final' / 'angle_train.json'})") in err


@pytest.mark.parametrize("targets", [["q_proj", "v_proj"], None])  # None: every linear layer
def test_a_decoders_exported_adapter_loads_over_its_causal_lm_as_angle_emb_loads_one(tmp_path, targets):
    """A decoder LM's adapter angle-train exports (final/adapter, an adapter-only best/) is named as if saved from the
    model with its LM head, as angle-emb and most LoRA trainers save theirs: peft's PeftModel over the
    LlamaForCausalLM (angle-emb's is_llm=True) and AutoPeftModel apply it. It was named as the headless model the
    Encoder holds (`layers.0...`), which they left unadapted in silence but for a peft warning (the base model's
    embeddings). transformers' AutoModel, sentence-transformers and load_encoder embed with it as the encoder did."""
    from peft import AutoPeftModel, PeftModel
    from safetensors import safe_open
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel, LlamaForCausalLM

    from angle_train.export import save_pretrained
    from angle_train.models import LoraSettings

    base = causal_lm(tmp_path / "base")
    encoder, tokenizer = load_encoder(base, pooling="last", lora=LoraSettings(r=4, alpha=8, dropout=0.0,
                                                                              target_modules=targets))
    with torch.no_grad():  # the adapter's B starts at zero: the adapter would change nothing
        for name, weight in encoder.named_parameters():
            if "lora_B" in name:
                weight.normal_(generator=torch.Generator().manual_seed(0))
    expected = encoder.eval().encode(TEXTS, tokenizer)
    best = save_pretrained(encoder, tokenizer, str(tmp_path / "best"), max_length=16, adapter_only=True,
                           base_model=base)
    save_pretrained(encoder, tokenizer, str(tmp_path / "final"), max_length=16, base_model=base)
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")  # left padding: the last token is each text's last
    for adapter in (best, str(tmp_path / "final" / "adapter")):
        with safe_open(f"{adapter}/adapter_model.safetensors", framework="pt") as f:
            assert all(key.startswith("base_model.model.model.layers.") for key in f.keys())
        config = json.loads((tmp_path / adapter / ADAPTER_CONFIG).read_text())
        assert config["auto_mapping"] in (None, {"base_model_class": "LlamaForCausalLM",
                                                 "parent_library": "transformers.models.llama.modeling_llama"})
        with torch.no_grad():
            for model in (PeftModel.from_pretrained(LlamaForCausalLM.from_pretrained(base), adapter),
                          AutoPeftModel.from_pretrained(adapter)):
                hidden = model.eval()(**batch, output_hidden_states=True).hidden_states[-1][:, -1]
                torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(AutoModel.from_pretrained(adapter).eval()(**batch).last_hidden_state[:, -1],
                                       expected, rtol=1e-5, atol=1e-5)
        reloaded, reloaded_tokenizer = load_encoder(base, pooling="last", lora_path=adapter)
        torch.testing.assert_close(reloaded.eval().encode(TEXTS, reloaded_tokenizer), expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.as_tensor(SentenceTransformer(best, device="cpu").encode(TEXTS)), expected,
                               rtol=1e-5, atol=1e-5)


def test_only_a_lora_exports_own_adapter_folder_takes_its_exports_settings(tmp_path, monkeypatch):
    """adapter_export_meta finds the export of final/adapter by any spelling of its path (relative, with a trailing
    slash), and none for an adapter folder that is no whole-model LoRA export's adapter/: its own angle_train.json
    (an adapter-only export), no export beside it, an adapter-only or a full fine-tuning export beside it, another
    folder name, no adapter_config.json."""
    from angle_train.models import adapter_export_meta

    def folder(path, *, meta=None, adapter=True):
        path.mkdir(parents=True)
        if adapter:
            (path / ADAPTER_CONFIG).write_text("{}")
        if meta is not None:
            (path.parent / "angle_train.json").write_text(json.dumps(meta))
        return str(path)

    lora_whole = {"lora": True, "adapter_only": False}
    final = folder(tmp_path / "run" / "final" / "adapter", meta=lora_whole)
    expected = str(tmp_path / "run" / "final" / "angle_train.json")
    assert adapter_export_meta(final) == adapter_export_meta(final + "/") == expected
    monkeypatch.chdir(tmp_path / "run" / "final")
    assert [adapter_export_meta(name) for name in ("adapter", "adapter/", "./adapter")] == ["angle_train.json"] * 3
    (tmp_path / "run" / "final" / "adapter" / "angle_train.json").write_text(json.dumps(lora_whole))
    assert adapter_export_meta(final) is None
    assert adapter_export_meta(folder(tmp_path / "peft" / "adapter")) is None
    assert adapter_export_meta(folder(tmp_path / "best" / "adapter", meta={"lora": True, "adapter_only": True})) is None
    assert adapter_export_meta(folder(tmp_path / "full" / "adapter", meta={"lora": False})) is None
    assert adapter_export_meta(folder(tmp_path / "named" / "lora", meta=lora_whole)) is None
    assert adapter_export_meta(folder(tmp_path / "empty" / "adapter", meta=lora_whole, adapter=False)) is None


def test_training_continues_an_exported_adapter_with_its_exports_pooling_and_attention(tmp_path, capsys,
                                                                                       monkeypatch):
    """--lora-path to an adapter angle-train exported (final/adapter, or an adapter-only best/) continues it with the
    pooling and attention its export records, and says the prompts it was trained with, as --model does with an
    export; the run pooled the last token with causal attention (the decoder defaults) in silence, training the adapter
    on other embeddings than those it had learned. The run looks the export up once (it was looked up again as the
    model loaded)."""
    from angle_train import trainer
    from angle_train.export import save_pretrained
    from angle_train.trainer import build_encoder, train
    from train_helpers import run_config

    base, final, encoder, tokenizer = lora_export(tmp_path)
    adapter = str(tmp_path / "final" / "adapter")
    looked_up, find_settings = [], trainer.adapter_settings_file
    monkeypatch.setattr(trainer, "adapter_settings_file",
                        lambda folder: looked_up.append(folder) or find_settings(folder))
    result = train(run_config(tmp_path / "out", lora=True, lora_path=adapter, max_steps=1, batch_size=4))
    assert looked_up == [adapter]
    assert (result.encoder.pooling, result.encoder.bidirectional) == ("avg", True)
    out, record = capsys.readouterr().out, str(tmp_path / "final" / "angle_train.json")
    assert f"pooling avg (the adapter's {record}) | bidirectional attention (the adapter's {record})" in out
    assert f"note: {record} records the prompts it was trained with (--prompt 'Summarize sentence" in out
    best = save_pretrained(encoder, tokenizer, str(tmp_path / "best"), max_length=16, adapter_only=True,
                           base_model=base)
    continued, _ = build_encoder(run_config(tmp_path / "out2", lora=True, lora_path=best), torch.device("cpu"))
    assert (continued.pooling, continued.pooling_source) == ("avg", f"the adapter's {best}/angle_train.json")
    given, _ = build_encoder(run_config(tmp_path / "out3", lora=True, lora_path=best, pooling="max"),
                             torch.device("cpu"))
    assert given.pooling == "max"  # --pooling still decides


def test_angle_eval_finds_a_relative_base_from_the_working_folder_and_names_base_model_elsewhere(
        tmp_path, monkeypatch, capsys):
    """peft (and angle-emb) record the base as it was named, a path relative to the folder training ran in: angle-eval
    takes it from the working folder, as peft does, and from another folder refuses it naming --base-model and the
    folder of that name above the adapter (which may be another model: nothing records the folder it was relative to);
    transformers took it for a hub name and said it was no valid repo id."""
    project = tmp_path / "project"
    monkeypatch.chdir(project.mkdir() or project)
    base = causal_lm(project / "models" / "base")
    adapter, _ = causal_adapter(base, project / "runs" / "adapter")
    config = json.loads((project / "runs" / "adapter" / ADAPTER_CONFIG).read_text())
    (project / "runs" / "adapter" / ADAPTER_CONFIG).write_text(
        json.dumps({**config, "base_model_name_or_path": "./models/base"}))
    pairs = pairs_file(tmp_path)
    assert main([adapter, str(pairs)]) == 0
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as exit_info:
        main([adapter, str(pairs)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert (f"MODEL {adapter} holds a LoRA adapter of the local model ./models/base (its {ADAPTER_CONFIG}'s "
            f"base_model_name_or_path), a path relative to the folder it was trained from, which is no folder from "
            f"the working folder {tmp_path}") in err
    assert f"a folder of that name at {project}/./models/base (from {project}, above the adapter's)" in err
    assert err.rstrip().endswith("which may be it: give the base with --base-model")
    assert main([adapter, str(pairs), "--base-model", base]) == 0


def test_training_continues_from_an_adapter_on_the_base_its_config_names(tmp_path, capsys):
    """--lora-path: the run's LoRA starts from the adapter's weights (its step-0 embeddings are the adapted causal
    LM's, not the base model's), with the adapter's rank, alpha, dropout and layers, on the base model its
    adapter_config.json names where --model is not given; config.json, the model card's command and its LoRA line
    record them. Before, an adapter folder as --model was refused, and no flag took one."""
    from angle_train.trainer import build_encoder, train
    from train_helpers import run_config

    base = causal_lm(tmp_path / "base")
    adapter, model = causal_adapter(base, tmp_path / "adapter")
    cfg = run_config(tmp_path / "out", lora=True, lora_path=adapter, max_steps=1, batch_size=4, lr=1e-3,
                     save_final=True).validate()
    assert (cfg.model, cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout) == (base, 4, 8, 0.0)
    assert cfg.lora_targets == ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"]
    encoder, tokenizer = build_encoder(cfg, torch.device("cpu"))
    batch = tokenizer(TEXTS, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch, output_hidden_states=True).hidden_states[-1][:, -1]
        torch.testing.assert_close(encoder.eval()(batch["input_ids"], batch["attention_mask"]), hidden)
    result = train(cfg)
    recorded = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (recorded["lora_path"], recorded["model"], recorded["lora_r"]) == (adapter, base, 4)
    card = (tmp_path / "out" / "final" / "README.md").read_text()
    assert f"--lora-path {adapter}" in card and f"rank 4, alpha 8, dropout 0 on down_proj" in card
    assert f"training continued from the adapter `{adapter}`" in card
    trained = next(p for n, p in result.encoder.named_parameters() if "lora_B" in n)
    start = next(p for n, p in model.named_parameters() if "lora_B" in n)
    assert trained.shape == start.shape and not torch.equal(trained, start)  # it trained from there


def test_lora_flags_that_contradict_the_adapter_are_refused_naming_them(tmp_path):
    from angle_train.config import TrainConfig

    base = causal_lm(tmp_path / "base")
    adapter, _ = causal_adapter(base, tmp_path / "adapter", targets=["q_proj", "v_proj"])
    for settings, said in (({"lora_r": 8}, "--lora-r 8: the adapter of --lora-path .* has --lora-r 4"),
                           ({"lora_alpha": 16}, "--lora-alpha 16: .* has --lora-alpha 8"),
                           ({"lora_targets": ["q_proj"]}, "--lora-targets q_proj: .* has --lora-targets q_proj v_proj, "
                                                          "and the run continues training it with its own settings: "
                                                          "leave out")):
        with pytest.raises(ValueError, match=said):
            TrainConfig(lora=True, lora_path=adapter, **settings).validate()
    same = TrainConfig(model=base, lora=True, lora_path=adapter, lora_r=4, lora_targets=["v_proj,q_proj"]).validate()
    assert (same.lora_r, same.lora_targets) == (4, ["q_proj", "v_proj"])
    # a layer named twice is the adapter's layers still (it was refused as another --lora-targets)
    twice = TrainConfig(model=base, lora=True, lora_path=adapter, lora_targets=["q_proj", "v_proj,q_proj"]).validate()
    assert twice.lora_targets == ["q_proj", "v_proj"]
    assert TrainConfig(lora=True, lora_targets=["v_proj", "q_proj,v_proj"]).validate().lora_targets == ["v_proj",
                                                                                                        "q_proj"]
    with pytest.raises(ValueError, match="--lora-path sets up LoRA adapters, which train only with --lora 1"):
        TrainConfig(lora_path=adapter).validate()
    with pytest.raises(FileNotFoundError, match=f"--lora-path {base}: no {ADAPTER_CONFIG} there; expected a local "):
        TrainConfig(lora=True, lora_path=base).validate()
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    (tmp_path / "adapter" / ADAPTER_CONFIG).write_text(json.dumps({**config, "base_model_name_or_path": None}))
    with pytest.raises(ValueError, match=f"--lora-path {adapter} is a LoRA adapter whose {ADAPTER_CONFIG} names no "
                                         "base model: give the model it was trained on with --model"):
        TrainConfig(lora=True, lora_path=adapter).validate()


def test_a_lora_flag_given_with_its_default_value_is_given(tmp_path, capsys):
    """With --lora-path, --lora-r 16 and --lora-alpha 32 (the defaults) given are compared with the adapter's as any
    other value is, and --lora-dropout 0.05 given replaces its dropout; from the command line and from Python alike.
    They were taken for flags left out: the adapter's rank and alpha replaced them in silence, and its dropout the
    given one. Left out, the adapter's values are the run's, and the recorded command makes the same settings."""
    import shlex

    from angle_train.cli import config_from_args
    from angle_train.config import TrainConfig

    base = causal_lm(tmp_path / "base")
    adapter, _ = causal_adapter(base, tmp_path / "adapter", targets=["q_proj", "v_proj"])  # rank 4, alpha 8, dropout 0
    common = ["--lora", "1", "--lora-path", adapter]
    for flag, value, setting in (("--lora-r", "16", "--lora-r 4"), ("--lora-alpha", "32", "--lora-alpha 8")):
        said = f"{flag} {value}: the adapter of --lora-path {adapter} has {setting}, and the run continues"
        with pytest.raises(ValueError, match=said):
            TrainConfig(lora=True, lora_path=adapter, **{flag[2:].replace("-", "_"): int(value)}).validate()
        with pytest.raises(SystemExit):
            config_from_args([*common, flag, value])
        assert said in capsys.readouterr().err
    cfg = config_from_args([*common, "--lora-dropout", "0.05"])
    assert (cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout) == (4, 8, 0.05)
    assert TrainConfig(lora=True, lora_path=adapter, lora_dropout=0.05).validate() == cfg
    assert cfg.validate() == cfg  # validated again, as train() does: the same settings
    command = cfg.command_line()
    assert "--lora-r 4 --lora-alpha 8 --lora-rslora 0 --lora-dropout 0.05" in command  # the adapter's, as if given
    assert config_from_args(shlex.split(command)[1:]) == cfg
    left_out = config_from_args(common)
    assert (left_out.lora_r, left_out.lora_alpha, left_out.lora_dropout) == (4, 8, 0.0)
    assert "--lora-dropout 0.0" in left_out.command_line()


def test_lora_dropout_replaces_the_dropout_of_the_adapter_it_continues(tmp_path, capsys):
    """Dropout is no part of an adapter's weights: --lora-dropout with --lora-path trains the adapter with it (peft's
    dropout on each adapted layer's input), says so in a note and in the start line's LoRA settings (the adapter's
    otherwise, its fractional alpha in full), and config.json, the model card and the trained adapter's
    adapter_config.json record it. It was refused as contradicting the adapter's."""
    from angle_train.trainer import build_encoder, train
    from train_helpers import run_config

    base = causal_lm(tmp_path / "base")
    adapter, _ = causal_adapter(base, tmp_path / "adapter", targets=["q_proj", "v_proj"], alpha=6.4)
    cfg = run_config(tmp_path / "out", lora=True, lora_path=adapter, lora_dropout=0.25, max_steps=1, batch_size=4,
                     save_final=True).validate()
    assert (cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout) == (4, 6.4, 0.25)
    encoder, _ = build_encoder(cfg, torch.device("cpu"))
    dropouts = [module.lora_dropout["default"] for module in encoder.modules() if hasattr(module, "lora_dropout")]
    assert len(dropouts) == 4 and all(isinstance(each, torch.nn.Dropout) and each.p == 0.25 for each in dropouts)
    train(cfg)
    out = capsys.readouterr().out
    assert (f"angle_train: note: --lora-dropout 0.25 replaces the dropout 0 of the adapter of --lora-path {adapter} "
            f"(its {ADAPTER_CONFIG}'s lora_dropout)") in out
    # the start line: the adapter's settings, a fractional alpha in full, and the dropout that replaced its own
    assert (f" trainable | LoRA from the adapter {adapter}: rank 4, alpha 6.4 (scale 1.6), dropout 0.25 "
            "(--lora-dropout; the adapter's 0) on q_proj, v_proj | ") in out
    final = tmp_path / "out" / "final"
    assert json.loads((tmp_path / "out" / "config.json").read_text())["lora_dropout"] == 0.25
    assert json.loads((final / "adapter" / ADAPTER_CONFIG).read_text())["lora_dropout"] == 0.25
    assert "- LoRA: rank 4, alpha 6.4, dropout 0.25 on q_proj, v_proj" in (final / "README.md").read_text()


def test_the_start_lines_give_the_lora_settings_and_the_optimisation(tmp_path, capsys):
    """The start line gives the LoRA settings a run trains with, from the flags and config.LORA_DEFAULTS: rank,
    alpha (a fractional one too) and the scale alpha / rank, dropout and the layers; the line after it the
    optimizer's settings, the precision and the seed. They were shown nowhere as a run started (a --lora-path run's:
    test_lora_dropout_replaces_the_dropout_of_the_adapter_it_continues)."""
    from angle_train.trainer import train
    from train_helpers import run_config

    train(run_config(tmp_path / "out", model=causal_lm(tmp_path / "base"), lora=True, lora_r=8, lora_alpha=16.5,
                     max_steps=1, batch_size=4, max_length=16, lr=1e-3, warmup=0, schedule="constant",
                     weight_decay=0.0, max_grad_norm=0.0, bf16=True, seed=3))
    lines = capsys.readouterr().out.splitlines()
    header = next(index for index, line in enumerate(lines) if " trainable | " in line)
    assert ("| LoRA rank 8, alpha 16.5 (scale 2.06), dropout 0.05 on every linear layer (down_proj, gate_proj, "
            "k_proj, o_proj, q_proj, up_proj, v_proj) |") in lines[header]
    assert lines[header + 1] == ("angle_train: AdamW lr 0.001 (constant, warmup 0 steps), weight decay 0, no gradient "
                                 "clipping | float32 weights, forward autocast to bfloat16 | sdpa attention | seed 3")


def test_an_rslora_adapter_continues_as_rslora_and_is_named_so(tmp_path):
    """An rsLoRA --lora-path adapter (peft's use_rslora) is scaled by alpha / sqrt(r), 8 / 2 = 4 here, not alpha / r:
    the run continues it so (its export's adapter_config.json too), and the start line, the model card's LoRA line and
    --lora-alpha's help say so. They said alpha / r alone: rank 4, alpha 8 read as a scale of 2."""
    from angle_train.cli import build_parser
    from angle_train.export import save_pretrained
    from angle_train.trainer import build_encoder, lora_description, lora_start_words
    from train_helpers import run_config

    base = causal_lm(tmp_path / "base", layers=1)
    adapter, _ = causal_adapter(base, tmp_path / "adapter", targets=["q_proj"], rslora=True)
    cfg = run_config(tmp_path / "out", lora=True, lora_path=adapter).validate()
    encoder, tokenizer = build_encoder(cfg, torch.device("cpu"))
    assert {scale for module in encoder.modules() if hasattr(module, "lora_A") for scale in module.scaling.values()} \
        == {4.0}
    assert lora_start_words(cfg, encoder, given_model=False).startswith(
        f"LoRA from the adapter {adapter}: rank 4, alpha 8, rsLoRA (scale 4), dropout 0 on q_proj")
    assert lora_description(encoder, adapter_only=True).startswith("- LoRA: rank 4, alpha 8, rsLoRA, dropout 0 on ")
    save_pretrained(encoder, tokenizer, str(tmp_path / "final"), max_length=16, base_model=base)
    assert json.loads((tmp_path / "final" / "adapter" / ADAPTER_CONFIG).read_text())["use_rslora"] is True
    assert "scale = alpha / r; alpha / sqrt(r) for an rsLoRA adapter" in " ".join(build_parser().format_help().split())


def test_lora_rslora_builds_rslora_adapters_scaled_by_alpha_over_sqrt_r(tmp_path):
    """--lora-rslora 1 builds the adapters with peft's use_rslora: scaled by alpha / sqrt(r), 8 / sqrt(4) = 4 here,
    where the default scales by alpha / r, 2; the start line, config.json's record and the model card's command say
    so, and the help says what it does and its default. Refused without --lora 1, as the other LoRA settings are.
    Before, no flag asked for a new rsLoRA adapter (--lora-rslora was an unknown flag)."""
    from dataclasses import asdict

    from angle_train.cli import build_parser, config_from_args
    from angle_train.config import TrainConfig
    from angle_train.trainer import build_encoder, lora_config, lora_start_words

    cfg = config_from_args(["--lora", "1", "--lora-r", "4", "--lora-alpha", "8", "--lora-rslora", "1",
                            "--output-dir", str(tmp_path / "out")]).validate()
    encoder, _ = build_encoder(cfg, torch.device("cpu"))
    assert lora_config(encoder).use_rslora is True
    assert {scale for module in encoder.modules() if hasattr(module, "lora_A") for scale in module.scaling.values()} \
        == {8 / 4 ** 0.5}
    assert lora_start_words(cfg, encoder, given_model=False).startswith("LoRA rank 4, alpha 8, rsLoRA (scale 4), ")
    assert asdict(cfg)["lora_rslora"] is True and " --lora-rslora 1 " in cfg.command_line()
    plain = config_from_args(["--lora", "1", "--lora-r", "4", "--lora-alpha", "8"]).validate()
    assert plain.lora_rslora is False and "--lora-rslora" not in plain.command_line()
    assert lora_config(build_encoder(plain, torch.device("cpu"))[0]).use_rslora is False
    with pytest.raises(ValueError, match="^--lora-rslora sets up LoRA adapters, which train only with --lora 1"):
        TrainConfig(lora_rslora=True).validate()
    help_text = " ".join(build_parser().format_help().split())
    assert ("--lora-rslora [0|1] rank-stabilised LoRA: scale the adapters' update by alpha / sqrt(r) instead of "
            "alpha / r, so that its size stays steady as r grows") in help_text
    assert "(peft's use_rslora; default: 0, alpha / r; with --lora-path, the adapter's)" in help_text


def test_lora_rslora_of_a_lora_path_adapter_is_its_own(tmp_path):
    """With --lora-path the adapter's use_rslora is the run's, as its rank and alpha are: taken where --lora-rslora is
    left out, and a given --lora-rslora that differs (its default 0 too) is refused naming the flag; the same value
    is taken."""
    from angle_train.config import TrainConfig

    base = causal_lm(tmp_path / "base", layers=1)
    rslora, _ = causal_adapter(base, tmp_path / "rslora", targets=["q_proj"], rslora=True)
    plain, _ = causal_adapter(base, tmp_path / "plain", targets=["q_proj"])
    assert TrainConfig(lora=True, lora_path=rslora).validate().lora_rslora is True
    assert TrainConfig(lora=True, lora_path=plain).validate().lora_rslora is False
    assert TrainConfig(lora=True, lora_path=rslora, lora_rslora=True).validate().lora_rslora is True
    for adapter, given, has in ((rslora, False, 1), (plain, True, 0)):
        with pytest.raises(ValueError, match=f"^--lora-rslora {int(given)}: the adapter of --lora-path {adapter} has "
                                             f"--lora-rslora {has}, and the run continues training it with its own "
                                             "settings: leave out --lora-rslora$"):
            TrainConfig(lora=True, lora_path=adapter, lora_rslora=given).validate()


def test_lora_path_to_a_whole_model_export_names_its_adapter_folder(tmp_path):
    """--lora-path RUN/final (a LoRA run's whole-model export, its adapter in final/adapter) is refused naming the
    adapter's folder, where it said only that the folder has no adapter_config.json."""
    from angle_train.config import TrainConfig

    adapter = tmp_path / "final" / "adapter"
    adapter.mkdir(parents=True)
    (adapter / ADAPTER_CONFIG).write_text("{}")
    with pytest.raises(FileNotFoundError, match=rf"--lora-path {re.escape(str(tmp_path / 'final'))}: no "
                                                rf"adapter_config.json there: the folder is a whole-model export, its "
                                                rf"adapter is in {re.escape(str(adapter))}: give --lora-path"):
        TrainConfig(lora=True, lora_path=str(tmp_path / "final")).validate()


def test_an_adapter_that_does_not_fit_the_model_is_refused_naming_lora_path(tmp_path):
    from angle_train.trainer import train
    from train_helpers import make_encoder, run_config

    adapter, _ = causal_adapter(causal_lm(tmp_path / "deeper", layers=3), tmp_path / "adapter", targets=["q_proj"])
    cfg = run_config(tmp_path / "out", model=causal_lm(tmp_path / "base"), lora=True, lora_path=adapter, max_steps=1,
                     batch_size=4)
    with pytest.raises(ValueError, match=f"^--lora-path {adapter}: the LoRA adapter {adapter} does not fit LlamaModel"):
        train(cfg)
    with pytest.raises(ValueError, match=f"^--lora-path {adapter} attaches an adapter to --model's base model, and "
                                         r"train\(\) was given a model in its place"):
        train(cfg, model=make_encoder("llama"))


def test_a_resume_compares_the_starting_adapter_by_its_contents(tmp_path, monkeypatch, capsys):
    """The adapter a run started from is recorded by its absolute path (config.json) and its contents (the
    checkpoints): a resume from another working folder with another adapter under the same relative name (same
    shapes, so the checkpoint's weights would fit), or without one, is refused naming --lora-path; the same adapter
    copied elsewhere resumes, its dropout edited too (no part of its weights). It was recorded as given: the relative
    name was compared as text, and took the other adapter. A checkpoint written before resumes as it did."""
    import shutil

    from angle_train.checkpoint import finished_checkpoints, write_manifest
    from angle_train.trainer import train
    from train_helpers import run_config

    base = causal_lm(tmp_path / "base")
    adapter, _ = causal_adapter(base, tmp_path / "first" / "adapter", targets=["q_proj", "v_proj"])
    other, _ = causal_adapter(base, tmp_path / "second" / "adapter", targets=["q_proj", "v_proj"], seed=2)
    settings = {"model": base, "lora": True, "batch_size": 4, "save_every": 1}
    monkeypatch.chdir(tmp_path / "first")
    train(run_config(tmp_path / "out", lora_path="adapter", max_steps=1, **settings))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["lora_path"] == adapter
    monkeypatch.chdir(tmp_path / "second")
    for lora_path, said in (("adapter", f"--lora-path: '{adapter}' -> '{other}' \\(another adapter: its contents "
                                        "[0-9a-f]{16} -> [0-9a-f]{16}\\)"),
                            (None, f"--lora-path: '{adapter}' -> None\\), and")):  # no adapter: no contents
        with pytest.raises(ValueError, match=f"these settings differ from the checkpoint's \\({said}"):
            train(run_config(tmp_path / "out", lora_path=lora_path, max_steps=2, resume="auto", lora_r=4,
                             lora_targets=["q_proj", "v_proj"], lora_alpha=8, lora_dropout=0.0, **settings))
    moved = str(shutil.copytree(tmp_path / "first" / "adapter", tmp_path / "moved"))
    # its dropout edited: no part of the weights (--lora-dropout replaces it), so the same adapter
    config_path = tmp_path / "moved" / ADAPTER_CONFIG
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "lora_dropout": 0.25}))
    train(run_config(tmp_path / "out", lora_path=moved, max_steps=2, resume="auto", **settings))
    out = capsys.readouterr().out
    assert "resumed from" in out and "--lora-dropout 0.0 -> 0.25" in out
    # a checkpoint of the earlier format, which recorded --lora-path as given and not the adapter's contents, resumes
    # as it did: --lora-path compared by where it leads, a relative one from the working folder
    checkpoint = finished_checkpoints(str(tmp_path / "out"))[-1]
    state = torch.load(f"{checkpoint}/state.pt", weights_only=True)
    del state["base_model"]["adapter"]
    state["config"]["lora_path"] = "adapter"
    torch.save(state, f"{checkpoint}/state.pt")
    write_manifest(checkpoint)
    monkeypatch.chdir(tmp_path / "first")
    with pytest.raises(ValueError, match=f"checkpoint's \\(--lora-path: 'adapter' -> '{other}'\\), and they decide"):
        train(run_config(tmp_path / "out", lora_path=other, max_steps=3, resume="auto", **settings))
    train(run_config(tmp_path / "out", lora_path="adapter", max_steps=3, resume="auto", **settings))
    assert "resumed from" in capsys.readouterr().out


def test_a_start_in_what_the_run_writes_into_its_output_dir_is_refused_before_anything_is_deleted(
        tmp_path, monkeypatch):
    """An adapter (--lora-path) or a model (--model) in the run's own --output-dir outputs (its best/, final/, a
    checkpoint), named by a relative path or through a link, is refused naming the flag and --output-dir, before
    --overwrite 1 deletes it: the run replaces best/ and final/, so it would record as its start a folder holding other
    weights, and a resume was refused as another adapter. They were read, then deleted with the earlier run."""
    import shutil

    from angle_train.trainer import train
    from train_helpers import run_config

    base = causal_lm(tmp_path / "base")
    out = tmp_path / "runs" / "a"
    adapter, _ = causal_adapter(base, out / "best", targets=["q_proj", "v_proj"])
    shutil.copytree(base, out / "final")
    (tmp_path / "link").symlink_to(out / "best")
    monkeypatch.chdir(tmp_path)
    for settings, flag, named, held in (({"model": base, "lora_path": "runs/a/best"}, "--lora-path", "runs/a/best",
                                         "best"),
                                        ({"model": base, "lora_path": "link"}, "--lora-path", "link", "best"),
                                        ({"model": "runs/a/final"}, "--model", "runs/a/final", "final")):
        named = tmp_path / named if flag == "--lora-path" else named  # recorded by its absolute path
        said = (f"^{flag} {re.escape(str(named))} lies in runs/a/{held}, which the run in --output-dir runs/a writes "
                rf"\(it replaces best/ and final/ and prunes its checkpoints; --overwrite 1 deletes them first\): copy "
                f"it out of runs/a and give {flag} the copy, or choose another --output-dir$")
        with pytest.raises(ValueError, match=said):
            train(run_config("runs/a", lora=flag == "--lora-path", overwrite=True, max_steps=1, batch_size=4,
                             **settings))
    assert sorted(path.name for path in out.iterdir()) == ["best", "final"]  # nothing deleted
    assert adapter == str(out / "best")


def test_an_adapter_config_without_its_lora_settings_is_refused_naming_the_file_and_setting(
        tmp_path, monkeypatch, capsys):
    """An adapter_config.json without the rank, alpha or layers its weights are read with, or with one in a form that
    cannot be it, is refused by angle-train (--lora-path), angle-eval (MODEL) and load_encoder naming the file, the
    setting and what it must be, before any model loads: it was a KeyError or TypeError from the settings' reading,
    or peft's default rank and alpha taken in silence."""
    from transformers import AutoModel

    from angle_train.config import TrainConfig

    base, adapter = str(tmp_path / "base"), str(tmp_path / "adapter")  # refused before either is read further
    path = tmp_path / "adapter" / ADAPTER_CONFIG
    path.parent.mkdir()
    config = {"peft_type": "LORA", "base_model_name_or_path": base, "r": 4, "lora_alpha": 8, "lora_dropout": 0.0,
              "target_modules": ["q_proj", "v_proj"], "task_type": None}
    monkeypatch.setattr(AutoModel, "from_pretrained", lambda *args, **kwargs: pytest.fail("the model loaded"))
    for name, value, said in (("r", None, "has no 'r'; expected the adapter's rank, a whole number of at least 1"),
                              ("r", "4", "has 'r': \"4\"; expected the adapter's rank"),
                              ("r", 0, "has 'r': 0; expected the adapter's rank"),
                              ("lora_alpha", None, "has no 'lora_alpha'; expected the adapter's scale numerator"),
                              ("lora_alpha", [8], r"has 'lora_alpha': \[8\]; expected .* a positive number"),
                              ("lora_dropout", 1.5, "has 'lora_dropout': 1.5; expected .* a number from 0 to below 1"),
                              ("target_modules", None, "has no 'target_modules'; expected the layers it adapts")):
        path.write_text(json.dumps({key: each for key, each in {**config, name: value}.items()
                                    if key != name or value is not None}))
        said = f"{path} {said}"
        with pytest.raises(ValueError, match=f"^--lora-path {adapter}: {said}"):
            TrainConfig(lora=True, lora_path=adapter).validate()
        with pytest.raises(ValueError, match=f"^the LoRA adapter {adapter}: {said}"):
            load_encoder(base, lora_path=adapter)
        with pytest.raises(SystemExit) as exit_info:
            main([adapter, str(tmp_path / "pairs.jsonl")])
        assert exit_info.value.code == 2 and re.search(f"MODEL {adapter}: {said}", capsys.readouterr().err)
