"""A model folder's sentence-transformers files, read: where they are, the pooling they name, the modules after the
pooling and the settings an export keeps from its base model.

A sentence-transformers folder holds the Hugging Face model (module 0, path "") and, listed in modules.json, the
modules applied to its output in order: a Pooling module (1_Pooling/config.json), then often Normalize (unit
embeddings), sometimes Dense layers (their own weights in their own folders); sentence_bert_config.json holds
max_seq_length (the truncation length), config_sentence_transformers.json the prompts and the similarity function.
angle_train trains the Hugging Face model under the pooling; `load_encoder` takes the pooling from here by default,
and `export.save_pretrained` keeps the rest of the base model's files.
"""

from __future__ import annotations

import json
import os

# angle_train's own record in the folders it exports (pooling, prompts, max length, trained widths: export.py)
META_FILE = "angle_train.json"
MODULES_FILE = "modules.json"
SETTINGS_FILE = "sentence_bert_config.json"
CONFIG_FILE = "config_sentence_transformers.json"
# angle_train's pooling strategies and the keys of sentence-transformers' Pooling config.json that switch them on
POOLING_KEYS = {"cls": "pooling_mode_cls_token", "avg": "pooling_mode_mean_tokens", "max": "pooling_mode_max_tokens",
                "last": "pooling_mode_lasttoken"}
# its newer one-word `pooling_mode`, by the same strategies
POOLING_MODES = {"cls": "cls", "mean": "avg", "max": "max", "lasttoken": "last"}
# A length at or past this is no limit (transformers' VERY_LARGE_INTEGER, int(1e30), is the tokenizers' unset length)
NO_LIMIT = 10**9
# What a hub model's folder needs for the above, fetched with its weights (the modules' folders: 1_Pooling, 2_Dense...;
# the tokenizer's and the model's configs, where sentence-transformers 6 reads the maximum length: max_seq_length)
HUB_FILES = [MODULES_FILE, SETTINGS_FILE, CONFIG_FILE, "[0-9]_*/*", "tokenizer_config.json", "config.json"]


def our_pooling(name: str) -> str | None:
    """angle_train's pooling strategy for a sentence-transformers pooling name (its one-word pooling_mode, "mean",
    or its config key, with or without "pooling_mode_": "mean_tokens"), or None where `name` is none of theirs."""
    name = name.strip().lower()
    if name in POOLING_MODES:
        return POOLING_MODES[name]
    by_key = {key: strategy for strategy, key in POOLING_KEYS.items()}
    return by_key.get(name if name.startswith("pooling_mode_") else f"pooling_mode_{name}")


def find_folder(name_or_path: str, revision: str | None = None) -> str | None:
    """The local folder holding the model's sentence-transformers files (modules.json), or None when it has none:
    the folder itself, or for a hub name its files at `revision` (None: the main branch) in the Hugging Face cache
    (fetched there, as transformers fetches the weights; None when they cannot be)."""
    if os.path.isdir(name_or_path):
        return name_or_path if os.path.isfile(os.path.join(name_or_path, MODULES_FILE)) else None
    if name_or_path.startswith("builtin:"):
        return None
    try:
        from huggingface_hub import snapshot_download

        folder = snapshot_download(name_or_path, allow_patterns=HUB_FILES, revision=revision)
    except Exception:  # offline and not cached, no such repository: a model without sentence-transformers files
        return None
    return folder if os.path.isfile(os.path.join(folder, MODULES_FILE)) else None


def hash_file(path: str, digest):
    """`digest` (a hashlib hash) updated with the bytes of the file `path`, read a megabyte at a time (a model's or an
    adapter's weights need not fit in memory), and returned: checkpoint manifests' SHA-256 of each file, an adapter's
    fingerprint (models.adapter_fingerprint). About 2 s a gigabyte (SHA-256, one loaded core of a shared machine)."""
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest


def read_json(path: str, kind: type = dict):
    """The JSON value in `path`, of type `kind` (dict: an object, list: an array); a file that is not JSON, or holds
    another value, is refused with a ValueError naming it (json's own error names no file)."""
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:  # JSONDecodeError is a ValueError
        raise ValueError(f"{path} is damaged (not valid JSON: {exc})") from None
    if not isinstance(value, kind):
        names = {dict: "an object", list: "an array"}
        raise ValueError(f"{path} is damaged (a JSON {type(value).__name__}, not {names[kind]})")
    return value


def modules(folder: str) -> list[dict]:
    """modules.json's entries ({"idx", "name", "path", "type"}), in order."""
    path = os.path.join(folder, MODULES_FILE)
    listed = read_json(path, list)
    if not all(isinstance(module, dict) for module in listed):
        raise ValueError(f"{path} is damaged (its entries must be JSON objects)")
    return listed


def pooling_module(folder: str) -> dict | None:
    """The Pooling module's entry of modules.json, or None."""
    return next((module for module in modules(folder) if module.get("type", "").endswith(".Pooling")), None)


def pooling(folder: str) -> tuple[str, str] | None:
    """(angle_train's pooling strategy, the file that names it) of the folder's Pooling module, or None when it has
    none or one angle_train has no strategy for (weighted mean, mean / sqrt(length), several modes concatenated)."""
    module = pooling_module(folder)
    if module is None:
        return None
    relative = os.path.join(module.get("path", ""), "config.json")
    config = read_json(os.path.join(folder, relative))
    if isinstance(config.get("pooling_mode"), str):
        mode = POOLING_MODES.get(config["pooling_mode"])
        return (mode, relative) if mode else None
    switched_on = [key for key, value in config.items() if key.startswith("pooling_mode_") and value is True]
    strategies = [strategy for strategy, key in POOLING_KEYS.items() if switched_on == [key]]
    return (strategies[0], relative) if strategies else None


def settings(folder: str) -> dict:
    """sentence_bert_config.json ({"max_seq_length", "do_lower_case"}), or {}."""
    return _optional(folder, SETTINGS_FILE)


def max_seq_length(folder: str) -> int | None:
    """The length sentence-transformers truncates the folder's texts to: sentence_bert_config.json's max_seq_length;
    else (where sentence-transformers 6 saves it) the tokenizer's model_max_length, capped at the model's position
    table (config.json's max_position_embeddings), as it reads them; None when neither says."""
    length = settings(folder).get("max_seq_length")
    if type(length) is int and length > 0:
        return length
    limits = [_optional(folder, "tokenizer_config.json").get("model_max_length"),
              _optional(folder, "config.json").get("max_position_embeddings")]
    # no limit: -1 (XLNet's positions), int(1e30) (transformers' model_max_length when none was set)
    limits = [limit for limit in limits if type(limit) is int and 0 < limit < NO_LIMIT]
    return min(limits) if limits else None


def _optional(folder: str, name: str) -> dict:
    path = os.path.join(folder, name)
    return read_json(path) if os.path.isfile(path) else {}


def config(folder: str) -> dict:
    """config_sentence_transformers.json (prompts, default_prompt_name, similarity_fn_name...), or {}."""
    return _optional(folder, CONFIG_FILE)


def modules_after_pooling(folder: str) -> list[dict]:
    """The modules.json entries after the Pooling module (Normalize, Dense...), in order; [] without one."""
    listed = modules(folder)
    module = pooling_module(folder)
    return [] if module is None else listed[listed.index(module) + 1:]


def check(folder: str) -> None:
    """Read every sentence-transformers file the commands use (modules.json, the Pooling module's config, the two
    settings files): a damaged one is a ValueError naming it, found before the model loads rather than midway."""
    pooling(folder)
    settings(folder)
    config(folder)
