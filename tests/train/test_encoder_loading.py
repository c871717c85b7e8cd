"""angle_train.models as a user meets it: the documented defaults (pooling, LoRA on every linear layer, a decoder
guessed from an unlisted *ForCausalLM architecture), the settings that must reach the model (dtype, is_decoder,
LoRA's rank, alpha and dropout, gradient checkpointing, bidirectional attention's is_causal flags), a base's
do_lower_case read as it says, pad = eos for tokenizers without a pad token, adapter exports that reload trainable,
and the packing check's tolerance. Tiny models built from configs, no network."""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from types import SimpleNamespace

import pytest
import torch
from train_helpers import adapter_only_export, make_encoder

from angle_train.export import META_FILE, load_pretrained, save_pretrained
from angle_train.models import (
    LoraSettings, is_decoder_config, load_encoder, prepare_tokenizer, recomputes_activations, wrap_backbone,
)
from angle_train.tiny import build_backbone, build_tokenizer

TEXTS = ["a small red car", "the dog is black and big", "box"]


def test_bidirectional_switches_the_attention_modules_causal_flag_off_and_back():
    """The kernels that take no mask (flash attention) read each attention module's is_causal: bidirectional=True must
    switch it off in every layer, and switching bidirectional off again must restore the causal attention."""
    encoder, _ = make_encoder("llama", dtype=torch.float32)
    flagged = [module for module in encoder.backbone.modules() if hasattr(module, "is_causal")]
    assert flagged and all(module.is_causal for module in flagged)
    encoder.bidirectional = True
    assert all(module.is_causal is False for module in flagged)
    encoder.bidirectional = False
    assert all(module.is_causal is True for module in flagged)


def test_the_default_pooling_is_cls_for_encoders_and_last_for_decoder_lms():
    """pooling=None: the documented defaults (module docstring, load_encoder), and the run header's words for them."""
    bert, _ = make_encoder("bert", dtype=torch.float32)
    llama, _ = make_encoder("llama", dtype=torch.float32)
    assert (bert.pooling, bert.pooling_source) == ("cls", "the default for encoders")
    assert (llama.pooling, llama.pooling_source) == ("last", "the default for decoder LMs")


def _cased_st_folder(tmp_path, do_lower_case):
    """A tiny BERT saved as a sentence-transformers folder over a cased tokenizer, its sentence_bert_config.json's
    do_lower_case as given; no angle_train.json (a model from elsewhere)."""
    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    tokenizer.backend_tokenizer.normalizer = None  # cased
    folder = save_pretrained(encoder, tokenizer, str(tmp_path / "base"), max_length=16)
    os.remove(os.path.join(folder, META_FILE))
    settings = os.path.join(folder, "sentence_bert_config.json")
    with open(settings) as f:
        written = json.load(f)
    with open(settings, "w") as f:
        json.dump({**written, "do_lower_case": do_lower_case}, f)
    return folder


def test_do_lower_case_false_keeps_the_texts_cased(tmp_path):
    """sentence-transformers models commonly say do_lower_case: false (all-MiniLM-L6-v2 does): their texts must not be
    lowercased; only true lowercases."""
    _, tok = load_encoder(_cased_st_folder(tmp_path, False))
    assert tok("Red Car")["input_ids"] != tok("red car")["input_ids"]


def test_load_encoder_loads_the_weights_in_the_dtype_asked_for(tmp_path):
    """angle-train --model-dtype reaches load_encoder as dtype=: the weights must be loaded in it (a bf16 7B model
    loaded in float32 takes twice the memory), and without it in the folder's own float32."""
    encoder, tokenizer = make_encoder("bert", dtype=torch.float32)
    folder = save_pretrained(encoder, tokenizer, str(tmp_path / "model"), max_length=16)
    loaded, _ = load_encoder(folder, dtype=torch.bfloat16)
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    loaded, _ = load_encoder(folder)
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}


def test_an_adapter_export_reloads_with_trainable_adapters(tmp_path):
    """load_encoder's lora_path 'resumes/evaluates an adapter': an adapter-only export loaded with load_pretrained has
    its LoRA weights trainable (and only those), so training can go on from it."""
    pytest.importorskip("peft")
    _, adapter = adapter_only_export(str(tmp_path))
    reloaded, _, meta = load_pretrained(adapter)
    assert meta["adapter_only"]
    trainable = [name for name, p in reloaded.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in name for name in trainable)


def test_an_adapter_export_reloads_over_the_base_model_named_by_the_caller(tmp_path):
    """base_model= names the base to load the adapter over, whatever base the export records (here a folder moved
    since)."""
    pytest.importorskip("peft")
    base, adapter = adapter_only_export(str(tmp_path))
    moved = os.path.join(str(tmp_path), "moved-base")
    os.rename(base, moved)
    reloaded, tokenizer, meta = load_pretrained(adapter, base_model=moved)
    assert meta["adapter_only"]
    assert reloaded.encode(TEXTS, tokenizer).shape == (len(TEXTS), reloaded.embedding_dim)


def test_an_adapter_records_its_local_base_absolute_and_a_base_gone_is_named(tmp_path, monkeypatch):
    """peft records the base as it was named (a path relative to the training's folder): the adapter's
    adapter_config.json records it absolute, as angle_train.json does, so that peft and sentence-transformers find it
    from anywhere (they took "base" for a hub name). A base moved since is refused naming it, where transformers said
    the path was no valid repo id."""
    pytest.importorskip("peft")
    monkeypatch.chdir(tmp_path)
    encoder, tokenizer = make_encoder("bert", dtype=torch.float32)
    save_pretrained(encoder, tokenizer, "base", max_length=16)
    lora_encoder, lora_tokenizer = load_encoder("base", lora=LoraSettings(r=4, alpha=8, dropout=0.0))
    save_pretrained(lora_encoder, lora_tokenizer, "adapter", max_length=16, adapter_only=True, base_model="base")
    save_pretrained(lora_encoder, lora_tokenizer, "merged", max_length=16, base_model="base")
    for folder in ("adapter", os.path.join("merged", "adapter")):
        with open(os.path.join(folder, "adapter_config.json")) as f:
            assert json.load(f)["base_model_name_or_path"] == os.path.abspath("base")
    os.rename("base", "moved")
    with pytest.raises(FileNotFoundError, match=f"^adapter holds a LoRA adapter of the local model "
                                                f"{re.escape(os.path.abspath('base'))} .*no longer there"):
        load_pretrained("adapter")


def test_an_adapter_recording_its_base_relative_loads_from_its_folder_and_is_refused_elsewhere(tmp_path, monkeypatch):
    """An adapter export that records its base as a relative path (written before angle_train recorded local bases
    absolute) loads it from the working folder, as peft does; from another one, the path names no folder and can be
    no hub id: refused naming base_model= and the folder of that name above the adapter, where transformers said the
    path was no valid repo id. A relative base is never taken from anywhere but the working folder: nothing records
    the folder it was relative to."""
    pytest.importorskip("peft")
    project, other = tmp_path / "project", tmp_path / "other"
    other.mkdir()
    monkeypatch.chdir(project.mkdir() or project)
    encoder, tokenizer = make_encoder("bert", dtype=torch.float32)
    save_pretrained(encoder, tokenizer, "models/base", max_length=16)
    lora_encoder, lora_tokenizer = load_encoder("models/base", lora=LoraSettings(r=4, alpha=8, dropout=0.0))
    adapter = str(project / "runs" / "a" / "best")
    save_pretrained(lora_encoder, lora_tokenizer, adapter, max_length=16, adapter_only=True, base_model="models/base")
    meta = json.loads((project / "runs" / "a" / "best" / META_FILE).read_text())
    (project / "runs" / "a" / "best" / META_FILE).write_text(json.dumps({**meta, "base_model": "./models/base"}))
    assert load_pretrained(adapter)[2]["adapter_only"]
    monkeypatch.chdir(other)
    with pytest.raises(FileNotFoundError, match=(
            f"^{re.escape(adapter)} holds a LoRA adapter of the local model ./models/base \\(its {META_FILE}'s "
            f"base_model\\), a path relative to the folder it was trained from, which is no folder from the working "
            f"folder {re.escape(str(other))} .*; there is a folder of that name at "
            f"{re.escape(os.path.join(str(project), './models/base'))} \\(from {re.escape(str(project))}, above the "
            "adapter's\\), which may be it: pass base_model= \\(the model it was trained on\\)$")):
        load_pretrained(adapter)
    assert load_pretrained(adapter, base_model=str(project / "models" / "base"))[2]["adapter_only"]
    shutil.rmtree(project / "models")  # found nowhere: refused all the same
    with pytest.raises(FileNotFoundError, match=r"no folder from the working folder [^;]*: pass base_model="):
        load_pretrained(adapter)


def test_load_pretrained_given_a_runs_output_folder_names_its_models(tmp_path):
    """A run's output folder (its settings in config.json, final/ and best/, no angle_train.json) given to
    load_pretrained raised a bare FileNotFoundError for angle_train.json: it is named as a run's folder, with the
    models it holds, as angle-eval names it."""
    run = tmp_path / "run"
    encoder, tokenizer = make_encoder("bert", dtype=torch.float32)
    for name in ("final", "best"):
        save_pretrained(encoder, tokenizer, str(run / name), max_length=16)
    (run / "config.json").write_text(json.dumps({"output_dir": str(run), "train_data": "pairs.jsonl"}))
    with pytest.raises(ValueError, match=f"^load_pretrained: {re.escape(str(run))} is an angle-train run's output "
                                         f"folder, not a model: its models are in {re.escape(str(run / 'final'))} "
                                         f"and {re.escape(str(run / 'best'))}$"):
        load_pretrained(str(run))
    assert load_pretrained(str(run / "final"))[2]["pooling"] == encoder.pooling


def test_a_causal_lm_architecture_not_in_the_list_is_a_decoder():
    """A model type angle_train does not list (a new or remote-code LLM) whose config names a *ForCausalLM
    architecture is a decoder LM: left padding and last-token pooling, not an encoder's first-token pooling."""
    config = SimpleNamespace(model_type="brand_new_lm", architectures=["BrandNewLMForCausalLM"],
                             is_encoder_decoder=False)
    assert is_decoder_config(config) is True
    assert is_decoder_config(SimpleNamespace(model_type="brand_new_encoder", architectures=["BrandNewModel"])) is False
    with pytest.raises(ValueError, match="encoder-decoder"):
        is_decoder_config(SimpleNamespace(model_type="t5", architectures=["T5Model"], is_encoder_decoder=True))


def test_load_encoder_honours_is_decoder_when_given(tmp_path):
    """is_decoder= (load_pretrained passes the export's) overrides the guess from the config: the padding side
    follows it."""
    encoder, tokenizer = make_encoder("bert", dtype=torch.float32)
    folder = save_pretrained(encoder, tokenizer, str(tmp_path / "model"), max_length=16)
    loaded, tok = load_encoder(folder, is_decoder=True)
    assert loaded.is_decoder and loaded.padding_side == "left" and tok.padding_side == "left"


def test_a_tokenizer_without_a_pad_token_pads_with_eos():
    """LLaMA-style tokenizers have no pad token: prepare_tokenizer pads with the eos token, so an Encoder built on it
    has a pad id; with neither it says so."""
    tokenizer = build_tokenizer()
    tokenizer.pad_token = None
    assert tokenizer.pad_token_id is None
    prepare_tokenizer(tokenizer, is_decoder=True)
    assert tokenizer.pad_token_id == tokenizer.eos_token_id is not None and tokenizer.padding_side == "left"
    backbone = build_backbone("builtin:tiny-llama", len(tokenizer), hidden_size=32, layers=1)
    encoder = wrap_backbone(backbone, pooling=None, pad_token_id=tokenizer.pad_token_id, is_decoder=True)
    assert encoder.encode(TEXTS, tokenizer).shape == (3, 32)
    bare = build_tokenizer()
    bare.pad_token = None
    bare.eos_token = None
    with pytest.raises(ValueError, match="neither a pad token nor an eos token"):
        prepare_tokenizer(bare, is_decoder=True)


def test_the_packing_check_refuses_a_small_difference_and_a_nan():
    """packing_problem's bound is the compute dtype's rounding (1e-4 of the norm in float32): packed embeddings 5e-4
    off, or NaN, are a model that does not take packed rows as given, not rounding."""
    from train_helpers import demo_batch

    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    seqs = demo_batch(tokenizer, 4, "B").seqs
    assert encoder.packing_problem(seqs, 64) is None
    pool = type(encoder)._pool
    for off in (1 + 5e-4, float("nan")):
        encoder._pool = lambda hidden, mask, packed, off=off: pool(encoder, hidden, mask, packed) * (
            off if packed is not None else 1.0)
        assert "embed differently" in encoder.packing_problem(seqs, 64), off


def test_lora_adapts_every_linear_layer_by_default():
    """LoraSettings(target_modules=None) means every nn.Linear of the base model ("all-linear", module docstring), not
    peft's per-architecture default (attention q and v only)."""
    pytest.importorskip("peft")
    encoder, _ = make_encoder("llama", dtype=torch.float32, lora=True)
    adapted = {name.split(".lora_A.")[0].rsplit(".", 1)[-1] for name, _ in encoder.named_parameters()
               if ".lora_A." in name}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_gradient_checkpointing_is_switched_on_when_asked_for():
    """--gradient-checkpointing reaches wrap_backbone: the base model must recompute its activations (the memory a
    long-sequence LLM run counts on), and not without it; through transformers' current name, without the
    deprecation warning its old one gives."""
    tokenizer = prepare_tokenizer(build_tokenizer(), True)
    for asked in (True, False):
        backbone = build_backbone("builtin:tiny-llama", len(tokenizer), hidden_size=32, layers=1)
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            encoder = wrap_backbone(backbone, pooling=None, pad_token_id=tokenizer.pad_token_id, is_decoder=True,
                                    gradient_checkpointing=asked)
        assert recomputes_activations(encoder.backbone) is asked


def test_the_lora_settings_reach_the_adapters():
    """--lora-r, --lora-alpha and --lora-dropout set the adapters' rank, scaling (alpha / r) and dropout."""
    pytest.importorskip("peft")
    tokenizer = prepare_tokenizer(build_tokenizer(), True)
    backbone = build_backbone("builtin:tiny-llama", len(tokenizer), hidden_size=32, layers=1)
    encoder = wrap_backbone(backbone, pooling=None, pad_token_id=tokenizer.pad_token_id, is_decoder=True,
                            lora=LoraSettings(r=4, alpha=16, dropout=0.25))
    config = encoder.backbone.peft_config["default"]
    assert (config.r, config.lora_alpha, config.lora_dropout) == (4, 16, 0.25)
    layer = encoder.backbone.base_model.model.layers[0].self_attn.q_proj
    assert layer.scaling["default"] == 4.0 and layer.lora_dropout["default"].p == 0.25


def test_a_fractional_lora_alpha_reaches_the_adapters_and_the_model_card_in_full():
    """A --lora-alpha that is not whole scales the adapters by alpha / r, and the model card's LoRA line gives it in
    full, as its recorded command does (six significant digits read 20.000001 as 20)."""
    pytest.importorskip("peft")
    from angle_train.trainer import lora_description

    tokenizer = prepare_tokenizer(build_tokenizer(), True)
    backbone = build_backbone("builtin:tiny-llama", len(tokenizer), hidden_size=32, layers=1)
    encoder = wrap_backbone(backbone, pooling=None, pad_token_id=tokenizer.pad_token_id, is_decoder=True,
                            lora=LoraSettings(r=4, alpha=20.000001, dropout=0.0, target_modules=["q_proj"]))
    assert encoder.backbone.base_model.model.layers[0].self_attn.q_proj.scaling["default"] == 20.000001 / 4
    assert lora_description(encoder, adapter_only=True).startswith("- LoRA: rank 4, alpha 20.000001, dropout 0 on ")


def test_an_unknown_autocast_is_refused_when_the_encoder_is_built():
    """autocast takes 'bf16' or 'fp16' (or None): another name is refused at once, not at the first forward pass."""
    from angle_train.models import Encoder

    backbone = build_backbone("builtin:tiny-bert", 64, hidden_size=32, layers=1)
    with pytest.raises(ValueError, match="autocast must be None, 'bf16' or 'fp16'; got 'bfloat16'"):
        Encoder(backbone, pooling="cls", is_decoder=False, pad_token_id=0, autocast="bfloat16")


def test_a_lora_encoders_trainable_state_is_its_adapters_alone():
    """A LoRA run trains the adapters alone (no bias of the base model), and its checkpoints keep them
    (trainable_state_dict), not the frozen base weights."""
    pytest.importorskip("peft")
    encoder, _ = make_encoder("bert", dtype=torch.float32, lora=True)
    trained = [name for name, p in encoder.named_parameters() if p.requires_grad]
    assert trained and all(".lora_" in name for name in trained)
    assert sorted(encoder.trainable_state_dict()) == sorted(trained)


def test_encoding_no_texts_gives_no_rows_of_the_width_asked_for():
    """encode([]) gives an empty [0, D] tensor, as sentence-transformers does, and [0, dim] with a Matryoshka dim."""
    encoder, tokenizer = make_encoder("bert", dtype=torch.float32)
    assert encoder.encode([], tokenizer).shape == (0, 32)
    assert encoder.encode([], tokenizer, dim=8).shape == (0, 8)


def test_the_position_limit_leaves_out_the_rows_up_to_a_roberta_tables_padding_row():
    """RoBERTa numbers positions after its padding row (padding_idx + 1 onwards): of a 40-row table, 38 positions
    can be read."""
    from transformers import RobertaConfig, RobertaModel

    from angle_train.models import position_limit

    config = RobertaConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64, max_position_embeddings=40, pad_token_id=1)
    assert position_limit(RobertaModel(config)) == 38


def test_a_base_whose_settings_do_not_say_do_lower_case_keeps_the_texts_cased(tmp_path):
    """sentence_bert_config.json without do_lower_case: sentence-transformers does not lowercase, and neither does
    training on it."""
    folder = _cased_st_folder(tmp_path, False)
    settings = os.path.join(folder, "sentence_bert_config.json")
    with open(settings) as f:
        written = json.load(f)
    del written["do_lower_case"]
    with open(settings, "w") as f:
        json.dump(written, f)
    _, tok = load_encoder(folder)
    assert tok("Red Car")["input_ids"] != tok("red car")["input_ids"]


def test_an_export_naming_a_pooling_this_version_does_not_know_is_refused(tmp_path):
    """An angle_train.json whose pooling this version does not know (a newer export's) is refused naming the file,
    the value and --pooling, not embedded with the folder's other pooling or the default; --pooling loads it."""
    from angle_train.evaluate import load_model

    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    folder = save_pretrained(encoder, tokenizer, str(tmp_path / "export"), max_length=16)
    meta = os.path.join(folder, META_FILE)
    with open(meta) as f:
        written = json.load(f)
    with open(meta, "w") as f:
        json.dump({**written, "pooling": "weighted_mean"}, f)
    for load in (load_encoder, load_pretrained, load_model):  # angle-train --model, the API, angle-eval
        with pytest.raises(ValueError, match=f"{re.escape(meta)} names the pooling 'weighted_mean', which this "
                                             "version does not know .*--pooling"):
            load(folder)
    assert load_encoder(folder, pooling="max")[0].pooling == "max"
    assert load_pretrained(folder, pooling="max")[0].pooling == "max"
    loaded = load_model(folder, pooling="max")[0]
    assert (loaded.pooling, loaded.pooling_source) == ("max", "--pooling")



def test_an_encoding_that_fails_leaves_the_model_in_training_mode():
    """encode() embeds in eval mode and puts the model's mode back; a pass that raised (out of memory in a training's
    evaluation, caught by the caller) left a training model in eval mode, its dropout off for the steps after."""
    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, dropout=0.1)
    encoder.train()

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("out of memory")

    encoder.backbone.forward = out_of_memory
    with pytest.raises(torch.OutOfMemoryError):
        encoder.encode(TEXTS, tokenizer)
    assert encoder.training and encoder.backbone.training


def test_a_decoders_export_records_left_padding_in_its_tokenizer_config(tmp_path):
    """A decoder's export pads on the left, as angle_train.json says: its tokenizer_config.json says so too.
    transformers writes only the settings the tokenizer was loaded with, so a base tokenizer without a padding_side
    (most LLaMA folders) was saved padding on the right, and code pooling a padded batch's last position read a pad
    token."""
    from transformers import AutoTokenizer

    tokenizer = build_tokenizer()
    tokenizer.init_kwargs.pop("padding_side", None)  # as loaded from a folder whose config has none
    assert AutoTokenizer.from_pretrained(tokenizer.save_pretrained(tmp_path / "base")[0].rsplit("/", 1)[0]
                                         ).padding_side == "right"
    prepare_tokenizer(tokenizer, is_decoder=True)
    backbone = build_backbone("builtin:tiny-llama", len(tokenizer), hidden_size=32, layers=1)
    encoder = wrap_backbone(backbone, pooling=None, pad_token_id=tokenizer.pad_token_id, is_decoder=True)
    folder = save_pretrained(encoder, tokenizer, str(tmp_path / "final"), max_length=16)
    with open(os.path.join(folder, META_FILE), encoding="utf-8") as f:
        assert json.load(f)["padding_side"] == "left"
    assert AutoTokenizer.from_pretrained(folder).padding_side == "left"
    bert, bert_tokenizer = make_encoder("bert", dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(save_pretrained(bert, bert_tokenizer, str(tmp_path / "bert"),
                                                         max_length=16)).padding_side == "right"
