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
      so then wrap the texts yourself or load the folder with `load_pretrained` (a note says so);
    * angle_train.json: pooling, prompts, bidirectional attention (then no sentence-transformers files: it would
      load the model causal), max length, padding side, for `load_pretrained`; for a Matryoshka-trained
      model also `matryoshka_dims`, the prefix widths it was trained at, largest first. Truncation is a load-time
      choice in sentence-transformers (`SentenceTransformer(path, truncate_dim=256)`, which does not read a saved
      value), and `encoder.encode(texts, tokenizer, dim=256)` here.
With `adapter_only=True` (LoRA only) it writes just the peft adapter (adapter_config.json,
adapter_model.safetensors) and angle_train.json: small, for best-checkpoint keeping on LLMs.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import json
import os

from .data import Prompts, prompt_prefix

ST_POOLING_KEYS = {"cls": "pooling_mode_cls_token", "avg": "pooling_mode_mean_tokens", "max": "pooling_mode_max_tokens",
                   "last": "pooling_mode_lasttoken"}
META_FILE = "angle_train.json"


def is_peft_model(module) -> bool:
    return hasattr(module, "peft_config") and hasattr(module, "merge_and_unload")


def _write_json(path: str, obj) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")


def save_pretrained(encoder, tokenizer, path: str, *, max_length: int, adapter_only: bool = False,
                    merge_in_place: bool = False, base_model: str | None = None, matryoshka_dims=None,
                    state_dict: dict | None = None) -> str:
    """Write the folder described in the module docstring (with encoder.prompts); returns path.

    merge_in_place=True merges LoRA weights into the live model (no copy: for the end of training on a large
    model); otherwise a copy is merged and the encoder keeps training unchanged. state_dict: the backbone's
    weights to write in place of its own (a sharded model's, gathered by sharding.full_state_dict).
    """
    os.makedirs(path, exist_ok=True)
    backbone = encoder.backbone
    meta = {"pooling": encoder.pooling, "is_decoder": encoder.is_decoder, "bidirectional": encoder.bidirectional,
            "padding_side": encoder.padding_side,
            "prompt": encoder.prompts.text, "prompts": dataclasses.asdict(encoder.prompts), "max_length": max_length,
            "base_model": base_model,
            "lora": is_peft_model(backbone), "adapter_only": adapter_only,
            "matryoshka_dims": sorted(matryoshka_dims, reverse=True) if matryoshka_dims else None}
    if adapter_only:
        if not is_peft_model(backbone):
            raise ValueError("adapter_only=True needs a LoRA (peft) model")
        backbone.save_pretrained(path)
        tokenizer.save_pretrained(path)
        _write_json(os.path.join(path, META_FILE), meta)
        return path
    if is_peft_model(backbone):
        backbone.save_pretrained(os.path.join(path, "adapter"))
        if merge_in_place:
            backbone = encoder.backbone = backbone.merge_and_unload()
        else:
            backbone = copy.deepcopy(backbone).merge_and_unload()
    with unused_modules_back(backbone, encoder.unused_modules, state_dict) as state_dict:
        backbone.save_pretrained(path, **({"state_dict": state_dict} if state_dict is not None else {}))
    tokenizer.save_pretrained(path)
    _write_json(os.path.join(path, META_FILE), meta)
    if encoder.bidirectional:
        print(f"note: {path} is a Hugging Face folder only: sentence-transformers would load the model with its "
              "causal mask, not the bidirectional attention it was trained with (load_pretrained restores it)")
    elif encoder.pooling in ST_POOLING_KEYS:
        _write_sentence_transformers_files(path, encoder, encoder.embedding_dim, max_length)
    else:
        print(f"note: pooling {encoder.pooling!r} has no sentence-transformers equivalent; "
              f"{path} is a Hugging Face folder only")
    return path


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


def _write_sentence_transformers_files(path: str, encoder, hidden_size: int, max_length: int) -> None:
    _write_json(os.path.join(path, "modules.json"), [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    ])
    _write_json(os.path.join(path, "sentence_bert_config.json"), {"max_seq_length": max_length, "do_lower_case": False})
    prompts = encoder.prompts.as_dict()
    prefixes = {role: prompt_prefix(template) for role, template in prompts.items()}
    if None in prefixes.values():
        print(f"note: a prompt of {prompts} puts text after '{{text}}', which sentence-transformers' prefix prompts "
              f"cannot express; {path} records it in {META_FILE} only (load_pretrained applies it)")
        prefixes = {}
    _write_json(os.path.join(path, "config_sentence_transformers.json"), {
        "prompts": prefixes, "default_prompt_name": "text" if "text" in prefixes else None,
        "similarity_fn_name": "cosine"})
    pooling = {"word_embedding_dimension": hidden_size, "pooling_mode_mean_sqrt_len_tokens": False,
               "pooling_mode_weightedmean_tokens": False, "include_prompt": True}
    pooling.update({key: name == encoder.pooling for name, key in ST_POOLING_KEYS.items()})
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    _write_json(os.path.join(path, "1_Pooling", "config.json"), pooling)


def load_pretrained(path: str, *, device="cpu", base_model: str | None = None, **kwargs):
    """(encoder, tokenizer, meta) from a folder written by save_pretrained (full model or adapter only)."""
    from .models import load_encoder

    with open(os.path.join(path, META_FILE), encoding="utf-8") as f:
        meta = json.load(f)
    bidirectional = meta.get("bidirectional", False)
    if meta.get("adapter_only"):
        base = base_model or meta.get("base_model")
        if base is None:
            raise ValueError(f"{path} holds only a LoRA adapter; pass base_model= (the model it was trained on)")
        if base.startswith("builtin:"):
            raise ValueError("an adapter trained on a built-in random model cannot be reloaded without its base")
        encoder, tokenizer = load_encoder(base, pooling=meta["pooling"], lora_path=path, device=device,
                                          is_decoder=meta["is_decoder"], bidirectional=bidirectional, **kwargs)
    else:
        encoder, tokenizer = load_encoder(path, pooling=meta["pooling"], device=device, is_decoder=meta["is_decoder"],
                                          bidirectional=bidirectional, **kwargs)
    # exports written before per-role prompts have only "prompt" (every text's)
    encoder.prompts = Prompts(**meta.get("prompts", {"text": meta.get("prompt")}))
    return encoder, tokenizer, meta
