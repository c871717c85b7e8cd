"""What angle-train and angle-eval check of what they are given before any work: the --device, a flash --attention
(check_attention), a local model folder (before it loads) and the loaded tokenizer (before any text is encoded). Each
problem is a ValueError naming the flag or the file, which both commands show as one line (exit status 2).

A model folder (`check_model_folder`) is refused when it
    is an angle-train run's output folder (its config.json holds the run's settings, not a model's): the error names
    the run's final/ and best/, the folders that hold its models;
    has a damaged angle_train.json or config.json (not JSON, or not an object), or damaged sentence-transformers
    files (modules.json, its Pooling module's config.json, sentence_bert_config.json...: st_folder.check);
    has a damaged weights file (*.safetensors whose header is cut short or does not cover the file's tensors);
    has no tokenizer files: transformers would then build a vocabulary of the special tokens alone, every word would
    read as unknown, and the scores would be those of a model reading nothing, without an error.
A loaded tokenizer (`check_tokenizer`) is refused when its vocabulary is far smaller than the model's embedding table
(the same failure, seen from the other side, for a model that is not a local folder) and when --max-length leaves
no room for text beside the special tokens it adds (a tokenizer cannot truncate below them: the setting would be
silently exceeded, and long texts would end in a tensor-size error).
"""

from __future__ import annotations

import fnmatch
import importlib.util
import os

import torch

from . import st_folder
from .models import ADAPTER_CONFIG

# The files a tokenizer is read from (any one suffices): transformers' fast tokenizer file, WordPiece/BPE
# vocabularies, sentencepiece and tiktoken models.
TOKENIZER_FILE_PATTERNS = ("tokenizer.json", "tokenizer.model", "vocab.*", "merges.txt", "*.model", "*.tiktoken",
                           "spiece.*", "sentencepiece*", "tekken.json")
# A tokenizer whose vocabulary is below this fraction of the model's embedding rows lost its vocabulary (models pad
# their tables to a multiple of 64 or 128 and reserve rows: a few percent more rows than tokens, never twice as many).
SMALLEST_VOCABULARY_FRACTION = 0.5


def check_device(name: str | None, flag: str = "--device") -> None:
    """Refuse a --device that is not a device name, or names a device this machine does not have (a CUDA device on
    a machine without one, cuda:7 on a machine with 2), before any work. None: the default choice (always there)."""
    if name is None:
        return
    try:
        device = torch.device(name)
    except (RuntimeError, ValueError, TypeError):
        raise ValueError(f"{flag} {name}: not a device; use cpu, cuda or cuda:N (or mps)") from None
    if device.type == "cpu":
        return
    backend = getattr(torch, device.type, None)  # torch.cuda, torch.mps, torch.xpu...
    available = getattr(backend, "is_available", None)
    if available is None or not available():
        raise ValueError(f"{flag} {name}: this machine has no {device.type} device that torch {torch.__version__} can "
                         "use; use --device cpu")
    count = getattr(backend, "device_count", lambda: 1)()
    if device.index is not None and device.index >= count:
        raise ValueError(f"{flag} {name}: this machine has {count} {device.type} device(s), {device.type}:0 to "
                         f"{device.type}:{count - 1}")


# The module each flash attention implementation needs, and its package's words (transformers' checks:
# is_flash_attn_2_available, is_flash_attn_3_available).
FLASH_ATTENTION_MODULES = {
    "flash_attention_2": ("flash_attn", "the flash-attn package (pip install flash-attn --no-build-isolation)"),
    "flash_attention_3": ("flash_attn_interface", "FlashAttention 3's flash_attn_interface (flash-attention's hopper/ "
                                                  "build, for H100 / H200 GPUs)"),
}


def check_attention(name: str | None, device: str | None, flag: str = "--attention") -> None:
    """Refuse a flash attention implementation (`name`) that cannot run here before any work: on a device other
    than a CUDA GPU (`device`: the --device given, None: the default, cuda where there is one), or without its
    package. Other implementations, and a model that has no such implementation, are checked as the model takes it
    (models.use_attention)."""
    if name not in FLASH_ATTENTION_MODULES:
        return
    device_type = torch.device(device).type if device else ("cuda" if torch.cuda.is_available() else "cpu")
    if device_type != "cuda":
        raise ValueError(f"{flag} {name} runs on CUDA GPUs, and this run is on {device_type}: use sdpa, or leave out "
                         f"{flag}")
    module, package = FLASH_ATTENTION_MODULES[name]
    if importlib.util.find_spec(module) is None:
        raise ValueError(f"{flag} {name} needs {package}, which this Python environment does not have: install it, "
                         "or use sdpa")


def _json_object(file: str, flag: str, folder: str) -> dict | None:
    """The JSON object in `file`, None when there is no such file; a file that is not one is refused."""
    if not os.path.isfile(file):
        return None
    try:
        return st_folder.read_json(file)
    except ValueError as exc:
        raise ValueError(f"{flag} {folder}: {exc}") from None


def is_run_settings(config: dict | None) -> bool:
    """Whether a config.json holds an angle-train run's settings (trainer.RunLog writes them) rather than a model's."""
    return config is not None and "model_type" not in config and {"output_dir", "train_data"} <= config.keys()


def check_model_to_train(path: str, revision: str | None = None) -> None:
    """angle-train's --model: a local folder must hold a whole model (config.json), which check_model_folder's
    folders without one (an adapter alone, a folder of something else) do not: transformers failed on them with a
    traceback. angle-eval takes an adapter (with its base model's name recorded) and has its own check. A `revision`
    is checked as check_revision checks it."""
    check_revision(revision, path, "--model")
    check_model_folder(path, "--model")
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return
    if os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
        raise ValueError(f"--model {path} holds a LoRA adapter without its base model (a LoRA run's best/ or a "
                         "checkpoint's adapter): continue training the adapter with --lora 1 --lora-path "
                         f"{path} (on the base model its {ADAPTER_CONFIG} names, or on --model), train from a whole "
                         "model, the run's final/ (the adapter merged into its base), or give the base model and "
                         "resume the run with --resume")
    raise ValueError(f"--model {path}: not a model folder (no config.json): give a Hugging Face model's folder or hub "
                     "name, or an angle-train run's final/ or best/")


def check_revision(revision: str | None, model: str, given_as: str, aside: str = "") -> None:
    """A --revision needs a Hub repository to pick it from: refused for a built-in model or a local folder (`model`,
    named as `given_as` gave it: --model, MODEL), which would load as they are; `aside`: words after the model's."""
    if revision is not None and (model.startswith("builtin:") or os.path.exists(model)):
        raise ValueError(f"--revision picks a version of a Hugging Face Hub repository, and {given_as} {model} is "
                         f"{'built in' if model.startswith('builtin:') else 'a local folder'}{aside}: leave out "
                         "--revision")


def check_model_folder(path: str, flag: str) -> None:
    """Refuse a local model folder that cannot be used as given (the module docstring), before it loads; anything
    that is not a folder here (a hub name, a path found missing elsewhere) is left alone."""
    if not os.path.isdir(path):
        return
    config = _json_object(os.path.join(path, "config.json"), flag, path)
    meta = _json_object(os.path.join(path, st_folder.META_FILE), flag, path)
    if meta is None and (config is None or is_run_settings(config)):
        models = [os.path.join(path, name) for name in ("final", "best") if os.path.isdir(os.path.join(path, name))]
        if is_run_settings(config) or models:
            where = (f"its model{'s are' if len(models) > 1 else ' is'} in {' and '.join(models)}" if models else
                     "it holds no final/ or best/ model yet")
            raise ValueError(f"{flag} {path} is an angle-train run's output folder, not a model: {where}")
        return  # not a model folder at all: the commands' own checks say so
    if os.path.isfile(os.path.join(path, st_folder.MODULES_FILE)):  # read for the pooling, and by exports from it
        try:
            st_folder.check(path)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{flag} {path}: {exc}") from None
    for name in sorted(os.listdir(path)):
        if name.endswith(".safetensors"):
            _check_safetensors(os.path.join(path, name), flag, path)
    names = os.listdir(path)
    if not any(fnmatch.fnmatch(name, pattern) for name in names for pattern in TOKENIZER_FILE_PATTERNS):
        raise ValueError(f"{flag} {path}: no tokenizer files (tokenizer.json, vocab.txt, a sentencepiece .model...): "
                         "transformers would build a vocabulary of special tokens alone and read every word as "
                         "unknown. Copy the tokenizer files of the model it was trained from into it")


def _check_safetensors(file: str, flag: str, folder: str) -> None:
    """A safetensors file whose header is whole and covers every tensor it lists (a truncated copy is not)."""
    from safetensors import safe_open

    try:
        with safe_open(file, "pt"):
            pass
    except Exception as exc:  # safetensors' own error type (SafetensorError) derives from Exception only
        raise ValueError(f"{flag} {folder}: the weights file {file} is damaged ({exc}); copy it again from where it "
                         "came from") from None


def check_tokenizer(tokenizer, encoder, model: str, max_length: int, flag: str = "--max-length") -> None:
    """The loaded tokenizer against its model and --max-length (module docstring)."""
    table = encoder.backbone.get_input_embeddings()
    rows = getattr(table, "num_embeddings", None)
    if rows and len(tokenizer) < SMALLEST_VOCABULARY_FRACTION * rows:
        raise ValueError(f"the tokenizer of {model} has {len(tokenizer)} tokens for a model of {rows} token "
                         "embeddings: its vocabulary files are missing or not its own")
    special = tokenizer.num_special_tokens_to_add(pair=False)
    if max_length < special + 1:
        raise ValueError(f"{flag} {max_length} leaves no room for text: the tokenizer of {model} adds {special} "
                         f"special token(s) to every text; use {flag} {special + 1} or more")
