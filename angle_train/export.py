"""Export: a trained Encoder as Hugging Face files, a LoRA adapter, and a sentence-transformers folder.

`save_pretrained(encoder, tokenizer, path)` writes one folder that is at the same time
    * a Hugging Face model folder (config.json, model.safetensors, tokenizer files): AutoModel loads it;
      a LoRA model is merged into its base weights first;
    * a sentence-transformers folder (modules.json, sentence_bert_config.json, 1_Pooling/config.json):
      `SentenceTransformer(path)` embeds exactly like `encoder.encode` (pooling `cls_avg` has no
      sentence-transformers equivalent, so that folder is left out for it, with a note). The prompts (data.Prompts)
      go into config_sentence_transformers.json's `prompts` ({"text", "query", "document"}, default "text"):
      `st.encode(q, prompt_name="query")` = `encoder.encode(q, tokenizer, prompt_name="query")`. Its prompts are
      prefixes only: a template with text after '{text}' (the AnglE prompt) is recorded only in angle_train.json,
      so then load the folder with `load_pretrained` (a note says so); texts wrapped in the template by hand embed
      right only within the max length: of a longer one sentence-transformers cuts the end, the prompt's close,
      where `encode` cuts the text and keeps the prompt (data.prompted_texts). When the base
      model (`base_model`) is a sentence-transformers folder, the export keeps what training did not change
      (st_folder): its modules after the pooling (Normalize: unit embeddings; Dense layers as the base had them,
      untrained, with a note), its pooling config (when the pooling is the same), its max_seq_length (unless
      `export_max_length` says otherwise; a longer training length wins) and its similarity function; the
      prompts are always the run's (none: no prompts and no default, as training embedded the texts), and the
      pooling always includes the prompt's tokens (as the Encoder pools);
    * README.md, the model card (`model_card`: the trainer's, with the command, data, loss, steps and scores);
    * angle_train.json: pooling, prompts, bidirectional attention (then no sentence-transformers files: it would
      load the model causal), max length (for inference, as sentence-transformers' max_seq_length; the training
      length as train_max_length), padding side, for `load_pretrained`; for a Matryoshka-trained
      model also `matryoshka_dims`, the prefix widths it was trained at, largest first. Truncation is a load-time
      choice in sentence-transformers (`SentenceTransformer(path, truncate_dim=256)`, which does not read a saved
      value), and `encoder.encode(texts, tokenizer, dim=256)` here.
A folder without the sentence-transformers files (cls_avg, bidirectional) still loads in `SentenceTransformer(path)`,
without an error, as a plain Hugging Face model (mean pooling, a decoder's causal attention), whose embeddings are
not the trained model's: `load_pretrained` is the way to load it.
With `adapter_only=True` (LoRA only) it writes the peft adapter (adapter_config.json, adapter_model.safetensors) in
place of the model's weights: small, for best-checkpoint keeping on LLMs (a decoder LM's adapter named as saved from
the model with its LM head, as angle-emb loads one: _name_layers_under_lm_head). The rest is as above, so that
`SentenceTransformer(path)` loads the base model the adapter names (adapter_config.json's base_model_name_or_path),
applies the adapter, and pools as trained; without the sentence-transformers files it pooled by its default (mean)
and added no prompt, in silence.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os
import shutil

from . import st_folder
from .atomic_files import written_aside
from .st_folder import META_FILE
from .data import prompt_prefix
from .models import ADAPTER_CONFIG, ADAPTER_FOLDER, LOOK_UP, absolute_if_local, adapter_export_meta, position_limit

ST_POOLING_KEYS = st_folder.POOLING_KEYS
CARD_FILE = "README.md"


def is_peft_model(module) -> bool:
    return hasattr(module, "peft_config") and hasattr(module, "merge_and_unload")


def loaded_name(backbone) -> str | None:
    """The hub name or folder a model was loaded by (of a LoRA model, its base's, as peft records it in its adapters'
    adapter_config.json), or None for one that has none (built from its config)."""
    if is_peft_model(backbone):
        name = backbone.peft_config[backbone.active_adapter].base_model_name_or_path
    else:
        name = backbone.config.name_or_path
    return name or None


def _write_json(path: str, obj) -> None:
    """Replaced whole: a write that fails (a full disk) leaves the file that was there, never half a file that
    load_pretrained, sentence-transformers or peft would read (adapter_config.json is rewritten in place)."""
    with written_aside(path, encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def save_pretrained(encoder, tokenizer, path: str, *, max_length: int, adapter_only: bool = False,
                    merge_in_place: bool = False, base_model: str | None = None, matryoshka_dims=None,
                    state_dict: dict | None = None, export_max_length: int | None = None,
                    model_card: str | None = None, extra_meta: dict | None = None,
                    base_files: str | None | object = LOOK_UP) -> str:
    """Write the folder described in the module docstring (with encoder.prompts); returns path.

    max_length: the length the model was trained at; the folder records export_max_length, else the base model's
    max_seq_length or max_length, whichever is longer, for inference. merge_in_place=True merges LoRA weights into
    the live model (no copy: for the end of training on a large model); otherwise a copy is merged and the encoder
    keeps training unchanged. state_dict: the backbone's weights to write in place of its own (a sharded model's,
    gathered by sharding.full_state_dict). model_card: README.md's text. extra_meta: more entries of
    angle_train.json (best/'s "best": the step and dev score that made it the best). base_files: base_model's
    sentence-transformers folder where the caller has found it (the trainer: Encoder.st_files; None: it has none),
    else looked up here (for a hub name, a fetch of its files).
    """
    os.makedirs(path, exist_ok=True)
    # a training's best/ is written again at each new best score: its notes (the prompts, a Hugging Face folder only)
    # are given the first time
    earlier_prompts = _recorded_prompts(_shown(path))  # None: no earlier export there
    same_prompts = earlier_prompts == dataclasses.asdict(encoder.prompts)
    noted_unloadable = earlier_prompts is not None and not os.path.isfile(os.path.join(_shown(path),
                                                                                       st_folder.MODULES_FILE))
    base_model = absolute_if_local(base_model)  # a local base, recorded so that it loads from anywhere
    if not (base_model and os.path.realpath(base_model) == os.path.realpath(path)):  # (its files are read below)
        _clear_earlier_export(path)
    backbone = encoder.backbone
    base = base_files if base_files is not LOOK_UP else (
        st_folder.find_folder(base_model, revision=encoder.revision) if base_model else None)
    inference_length = encoding_length(max_length, base, export_max_length, position_limit(backbone))
    meta = {"pooling": encoder.pooling, "is_decoder": encoder.is_decoder, "bidirectional": encoder.bidirectional,
            "padding_side": encoder.padding_side,
            "prompt": encoder.prompts.text, "prompts": dataclasses.asdict(encoder.prompts),
            "max_length": inference_length, "train_max_length": max_length, "base_model": base_model,
            "base_revision": encoder.revision,
            "lora": is_peft_model(backbone), "adapter_only": adapter_only,
            "matryoshka_dims": sorted(matryoshka_dims, reverse=True) if matryoshka_dims else None,
            **(extra_meta or {})}
    if adapter_only:
        if not is_peft_model(backbone):
            raise ValueError("adapter_only=True needs a LoRA (peft) model")
        _save_adapter(backbone, path, base_model=base_model, revision=encoder.revision, is_decoder=encoder.is_decoder)
    else:
        if is_peft_model(backbone):
            _save_adapter(backbone, os.path.join(path, ADAPTER_FOLDER), base_model=base_model,
                          revision=encoder.revision, is_decoder=encoder.is_decoder)
            if merge_in_place:
                backbone = encoder.backbone = backbone.merge_and_unload()
            else:
                backbone = copy.deepcopy(backbone).merge_and_unload()
        with unused_modules_back(backbone, encoder.unused_modules, state_dict) as state_dict:
            backbone.save_pretrained(path, **({"state_dict": state_dict} if state_dict is not None else {}))
    tokenizer.save_pretrained(path)
    _record_padding_side(path, tokenizer.padding_side)
    _write_json(os.path.join(path, META_FILE), meta)
    _write_card(path, model_card)
    unloadable = sentence_transformers_cannot_load(encoder)
    if unloadable:
        if not noted_unloadable:
            print(f"note: {_shown(path)} is a Hugging Face folder only: {unloadable}")
    else:
        _write_sentence_transformers_files(path, encoder, encoder.embedding_dim, inference_length, base,
                                           note_prompts=not same_prompts)
    return path


def _recorded_prompts(path: str) -> dict | None:
    """The prompts (as angle_train.json records them) of the export in `path`, or None where there is none."""
    try:
        return st_folder.read_json(os.path.join(path, META_FILE)).get("prompts")
    except (OSError, ValueError):  # none, or a damaged one, which this export replaces
        return None


def _record_padding_side(path: str, side: str) -> None:
    """The side the tokenizer pads on (a decoder's left: models.prepare_tokenizer) written into the
    tokenizer_config.json just saved in `path`, where transformers left it out (it writes only the settings the
    tokenizer was loaded with): the folder's tokenizer padded on the right, which code that pools a padded batch's last
    position (as angle_train.json's padding_side says it may) read a pad token of."""
    config_path = os.path.join(path, "tokenizer_config.json")
    if not os.path.isfile(config_path):
        return
    config = st_folder.read_json(config_path)
    if config.get("padding_side", "right") != side:
        _write_json(config_path, {**config, "padding_side": side})


def _save_adapter(backbone, folder: str, *, base_model: str | None, revision: str | None, is_decoder: bool) -> None:
    """peft's files of the LoRA model `backbone` in `folder`, its base model recorded (_record_base); a decoder LM's
    as saved from the model with its LM head (_name_layers_under_lm_head)."""
    backbone.save_pretrained(folder)
    if is_decoder:
        _name_layers_under_lm_head(folder, backbone.get_base_model())
    _record_base(folder, base_model, revision)


def _name_layers_under_lm_head(adapter_folder: str, base) -> None:
    """Rewrite the adapter in `adapter_folder`, saved from `base` (a decoder LM without its head, as the Encoder holds
    it: its layers `layers.0...`), as if saved from the model with its LM head (a *ForCausalLM, which holds `base` as
    its `base_model_prefix`: `model.layers.0...`), as angle-emb and most LoRA trainers save decoder adapters: peft's
    PeftModel over the *ForCausalLM (angle-emb's `is_llm=True`, AutoPeftModel) applies only adapters named so, and
    leaves the layers of one named otherwise unadapted (the base model's embeddings, with a warning). transformers'
    and sentence-transformers' loaders, and models.attach_adapter, read either naming. A model that has no
    *ForCausalLM class keeps its names."""
    from safetensors import safe_open
    from safetensors.torch import save
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    prefix = getattr(base, "base_model_prefix", "")
    head_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(base.config), None)
    weights_file = os.path.join(adapter_folder, "adapter_model.safetensors")
    if not prefix or head_class is None or hasattr(base, prefix) or not os.path.isfile(weights_file):
        return
    outer = "base_model.model."
    with safe_open(weights_file, framework="pt") as f:
        metadata = f.metadata()
        weights = {outer + prefix + "." + key[len(outer):] if key.startswith(outer) else key: f.get_tensor(key)
                   for key in f.keys()}
    with written_aside(weights_file, binary=True) as f:
        f.write(save(weights, metadata=metadata))
    config_path = os.path.join(adapter_folder, ADAPTER_CONFIG)
    config = st_folder.read_json(config_path)
    # target_modules stay as they are: peft matches a module path's end, so "layers.0.self_attn.q_proj" (as every
    # linear layer is recorded) names the layer in both models, where "model.layers.0..." names none in the headless
    if config.get("auto_mapping"):  # the class AutoPeftModel loads the adapter's base as
        config["auto_mapping"] = {"base_model_class": head_class.__name__, "parent_library": head_class.__module__}
    _write_json(config_path, config)


def _record_base(adapter_folder: str, base_model: str | None, revision: str | None) -> None:
    """The base model recorded in the adapter's adapter_config.json as angle_train.json records it: a local one
    absolute (peft records the name the model was loaded by, a path relative to the training's working folder, which
    peft and sentence-transformers then took for a Hugging Face hub name anywhere else), and a hub one's `revision`
    (peft's "revision", at which peft and sentence-transformers load the base; None: its main branch)."""
    local = bool(base_model and os.path.isdir(base_model))
    if not local and revision is None:
        return
    config_path = os.path.join(adapter_folder, ADAPTER_CONFIG)
    config = st_folder.read_json(config_path)
    if local:
        config["base_model_name_or_path"] = base_model
    if revision is not None:
        config["revision"] = revision
    _write_json(config_path, config)


def sentence_transformers_cannot_load(encoder) -> str | None:
    """Why sentence-transformers cannot load `encoder`'s export as it was trained (then the export writes none of its
    files), or None."""
    if encoder.bidirectional:
        return ("sentence-transformers would load the model with its causal mask, not the bidirectional attention it "
                "was trained with (load_pretrained restores it)")
    if encoder.pooling not in ST_POOLING_KEYS:
        return f"pooling {encoder.pooling!r} has no sentence-transformers equivalent"
    return None


def prefix_prompts(encoder) -> dict[str, str] | None:
    """{role: prefix} of the encoder's prompts as sentence-transformers' prompts express them, or None where a
    prompt puts text after '{text}' (which they cannot)."""
    prefixes = {role: prompt_prefix(template) for role, template in encoder.prompts.as_dict().items()}
    return None if None in prefixes.values() else prefixes


@contextlib.contextmanager
def unused_modules_back(backbone, modules: dict, state_dict: dict | None):
    """Inside: the modules training dropped (Encoder.unused_modules: BERT's pooler, as the base model had it) are
    part of `backbone` again, and of `state_dict` when one is given, so that an export holds every weight its
    architecture has and loading it misses none. Yields the state dict to save (None: the backbone's own)."""
    if not modules:
        yield state_dict
        return
    dtype = next(backbone.parameters()).dtype
    for name, module in modules.items():
        setattr(backbone, name, module.to(dtype))
    try:
        if state_dict is not None:
            state_dict = {**state_dict, **{f"{name}.{key}": value for name, module in modules.items()
                                           for key, value in module.state_dict().items()}}
        yield state_dict
    finally:
        for name in modules:
            setattr(backbone, name, None)


def _write_card(path: str, text: str | None) -> None:
    if text:
        with written_aside(os.path.join(path, CARD_FILE), encoding="utf-8") as f:
            f.write(text)


def _clear_earlier_export(path: str) -> None:
    """Remove what an earlier export into `path` wrote that this one may not write again (its sentence-transformers
    files and module folders, its adapter and card): left behind, they made sentence-transformers load the folder
    as the earlier model (causal where this one is bidirectional, its pooling where this one has none). Only in a
    folder that holds an export (angle_train.json); the weights and tokenizer files are written over anyway."""
    if not os.path.isfile(os.path.join(path, META_FILE)):
        return
    try:
        folders = [module["path"] for module in st_folder.modules(path) if module.get("path")]
    except (OSError, ValueError):  # no modules.json, or a damaged one
        folders = []
    inside = os.path.realpath(path) + os.sep
    for name in (st_folder.MODULES_FILE, st_folder.SETTINGS_FILE, st_folder.CONFIG_FILE, CARD_FILE, ADAPTER_FOLDER,
                 "1_Pooling", *folders):
        target = os.path.join(path, name)
        if not os.path.realpath(target).startswith(inside):  # a module path reaching out of the folder
            continue
        if os.path.isdir(target):
            shutil.rmtree(target)
        elif os.path.isfile(target):
            os.remove(target)


def encoding_length(max_length: int, base: str | None, export_max_length: int | None = None,
                    limit: int | None = None) -> int:
    """The length an export records for inference (and a trained encoder's encode() cuts texts at): export_max_length,
    else the training length max_length or the base model's max_seq_length (`base`: its sentence-transformers
    folder, or None), whichever is longer; the base's no longer than the model can read (`limit`: position_limit):
    a folder may claim more (sentence-transformers then fails on a longer text, where the two flags are refused)."""
    inherited = (st_folder.max_seq_length(base) if base else None) or 0
    if limit is not None:
        inherited = min(inherited, limit)
    return export_max_length or max(max_length, inherited)


def _shown(path: str) -> str:
    """The folder a note names: an export written as NAME.tmp (checkpoint._export) is NAME once complete."""
    return path[:-len(".tmp")] if path.endswith(".tmp") else path


def _write_sentence_transformers_files(path: str, encoder, hidden_size: int, max_length: int,
                                       base: str | None, note_prompts: bool = True) -> None:
    """modules.json, sentence_bert_config.json, config_sentence_transformers.json and the Pooling module's config:
    the encoder's, over the base model's (`base`: its sentence-transformers folder, or None) where it has them.
    note_prompts: say so where the prompts have no sentence-transformers form (False: the folder replaced had the
    same prompts, and the note was given then)."""
    base_modules = st_folder.modules(base) if base else []
    usable = (len(base_modules) >= 2 and base_modules[0].get("path") == ""
              and base_modules[0].get("type", "").endswith(".Transformer") and st_folder.pooling_module(base))
    after = st_folder.modules_after_pooling(base) if usable else []
    pooling_entry = st_folder.pooling_module(base) if usable else \
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}
    _write_json(os.path.join(path, "modules.json"), [base_modules[0] if usable else
                                                      {"idx": 0, "name": "0", "path": "",
                                                       "type": "sentence_transformers.models.Transformer"},
                                                      pooling_entry, *after])
    for module in after:  # Normalize (often no files), Dense (its config and weights): as the base has them
        source = os.path.join(base, module.get("path", ""))
        if module.get("path") and os.path.isdir(source):
            shutil.copytree(source, os.path.join(path, module["path"]), dirs_exist_ok=True)
    changing = [module["type"].rsplit(".", 1)[-1] for module in after if not module["type"].endswith(".Normalize")]
    if changing:
        print(f"note: {_shown(path)} keeps the base model's {', '.join(changing)} module(s) after the pooling as the "
              "base had them: angle-train trains the transformer under the pooling (its dev scores are of the pooled "
              "embeddings), not these", flush=True)
    _write_json(os.path.join(path, st_folder.SETTINGS_FILE),
                {"do_lower_case": False, **(st_folder.settings(base) if usable else {}), "max_seq_length": max_length})
    prefixes = prefix_prompts(encoder)
    if prefixes is None:
        if note_prompts:
            print(f"note: the prompts ({encoder.prompts.described()}) put text after '{{text}}', which "
                  f"sentence-transformers' prefix prompts cannot express; {_shown(path)} records them in {META_FILE} "
                  "only (load_pretrained applies them)")
        prefixes = {}
    config = {"similarity_fn_name": "cosine", **(st_folder.config(base) if usable else {})}
    # the run's prompts, never the base's: a base's default prompt would be added to every text training never saw
    config.update(prompts=prefixes, default_prompt_name="text" if "text" in prefixes else None)
    _write_json(os.path.join(path, st_folder.CONFIG_FILE), config)
    pooling_folder = os.path.join(path, pooling_entry["path"])
    os.makedirs(pooling_folder, exist_ok=True)
    base_pooling = st_folder.pooling(base) if usable else None
    if base_pooling and base_pooling[0] == encoder.pooling:  # the base's settings kept, but the prompt's tokens
        with open(os.path.join(base, base_pooling[1]), encoding="utf-8") as f:  # pooled, as the Encoder pools them
            _write_json(os.path.join(pooling_folder, "config.json"), {**json.load(f), "include_prompt": True})
        return
    pooling = {"word_embedding_dimension": hidden_size, "pooling_mode_mean_sqrt_len_tokens": False,
               "pooling_mode_weightedmean_tokens": False, "include_prompt": True}
    pooling.update({key: name == encoder.pooling for name, key in ST_POOLING_KEYS.items()})
    _write_json(os.path.join(pooling_folder, "config.json"), pooling)


def load_pretrained(path: str, *, device="cpu", base_model: str | None = None, pooling: str | None = None,
                    export_meta_file: str | None | object = LOOK_UP, base_given_as: str = "base_model=",
                    given_as: str = "path=", **kwargs):
    """(encoder, tokenizer, meta) from a folder written by save_pretrained (full model or adapter only), or from the
    adapter/ folder of a whole-model LoRA export, applied to its base model with the export's settings (meta: the
    export's); `pooling` replaces the export's (meta keeps the export's own). export_meta_file:
    adapter_export_meta(path) where the caller has looked it up (angle-eval names it before the model loads), else
    looked up here. A base model on the Hub that cannot be loaded (models.load_encoder) is named as `base_given_as`
    says where `base_model` gave it (angle-eval: --base-model), else as the record that names it; the export itself
    (a whole model that ships its own code, untrusted) as `given_as` says (angle-eval: MODEL)."""
    from .models import export_pooling, export_prompts, load_encoder, recorded_base
    from .preflight import check_model_folder

    if export_meta_file is LOOK_UP:
        export_meta_file = adapter_export_meta(path)
    meta_file = export_meta_file or os.path.join(path, META_FILE)
    if not os.path.isfile(meta_file):
        check_model_folder(path, "load_pretrained:")  # a run's output folder: named, with the models it holds
    with open(meta_file, encoding="utf-8") as f:
        meta = json.load(f)
    pooling = pooling or export_pooling(meta_file, meta["pooling"])
    bidirectional = meta.get("bidirectional", False)
    if meta.get("adapter_only") or export_meta_file:
        base = base_model or meta.get("base_model")
        if base is None:
            raise ValueError(f"{path} holds only a LoRA adapter; pass base_model= (the model it was trained on)")
        if base.startswith("builtin:"):
            raise ValueError("an adapter trained on a built-in random model cannot be reloaded without its base")
        if base_model is None:
            record = f"{export_meta_file}'s base_model" if export_meta_file else f"its {META_FILE}'s base_model"
            base = recorded_base(base, adapter=path, record=record,
                                 remedy="pass base_model= (the model it was trained on)")
        given_as = base_given_as if base_model is not None else f"{meta_file} records the base model"
        if base_model is None and meta.get("base_revision") is not None:  # the recorded base, at its revision
            kwargs = {"revision": meta["base_revision"],
                      "revision_given_as": f"{meta_file} records the base model's revision", **kwargs}
        encoder, tokenizer = load_encoder(base, pooling=pooling, lora_path=path, device=device,
                                          is_decoder=meta["is_decoder"], bidirectional=bidirectional,
                                          given_as=given_as, **kwargs)
    else:
        encoder, tokenizer = load_encoder(path, pooling=pooling, device=device, is_decoder=meta["is_decoder"],
                                          bidirectional=bidirectional, given_as=given_as, **kwargs)
    encoder.prompts = export_prompts(meta)
    encoder.max_length = meta.get("max_length")  # encode()'s default, as sentence-transformers' max_seq_length
    return encoder, tokenizer, meta
