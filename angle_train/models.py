"""Models: a Hugging Face base model plus pooling, as one module that maps token ids to embeddings.

`load_encoder` takes a hub name or a local path. Encoders (BERT, RoBERTa, MiniLM...) and decoder-only
LMs (LLaMA, Qwen, Mistral...) are both loaded with `AutoModel`, which gives the base model *without*
the LM head: no vocabulary logits are ever computed, which for a 32k-128k vocabulary is most of the
activation memory of an LLM forward pass at short sequence lengths.

Fine-tuning is either full (every parameter trains) or LoRA through peft (imported only when asked
for, so angle_train works without peft). The default LoRA targets are "all-linear": every nn.Linear
of the base model; there is no head to exclude because none is loaded.

The `Encoder` module owns autocast (bf16/fp16 on the fly, float32 embeddings out) so every caller
(plain step, gradient cache, evaluation, export) embeds the same way.

Bidirectional attention (`bidirectional=True`, decoder LMs only, as LLM2Vec, BiLLM and NV-Embed train them): every
token attends to every real token of its text, before and after it; padding stays masked out as a key. The mask
is transformers' own `create_bidirectional_mask` for the model's attention implementation (sdpa, eager, flex),
passed to the model as a prepared 4D mask (which the model uses as it is instead of building its causal one); the
attention modules' `is_causal` is switched off too, for the kernels that take no mask (flash attention).

Packed rows (`forward(..., packed=data.PackedTexts)`, angle-train's `--pack`): several texts share a row with no
padding between them. A 4D mask keeps them apart (a token attends to its own text's tokens only: block-diagonal,
causal within a block for a decoder LM that is not bidirectional), position ids restart at each text (after the
padding row for RoBERTa-style tables: `position_offset`), and before pooling each text's hidden states are gathered
back into a right-padded row of its own, so every pooling strategy below reads the same tokens as in a padded
batch. It needs an attention implementation that takes the mask as given (sdpa, eager); `packing_problem` checks a
model before training uses it.

Pooling turns the per-token hidden states [B, L, H] into one embedding per text [B, H]. Every strategy
honours the attention mask, so padding never leaks into an embedding, and works for both padding sides:
right padding (BERT-style encoders) puts the real tokens first, left padding (decoder-only LLMs, so that
the last real token sits at the last position) puts them last.

    cls      the first real token (position 0 with right padding; the first masked-in position with left)
    avg      the mean over real tokens
    cls_avg  (cls + avg) / 2
    max      the element-wise max over real tokens
    last     the last real token (what a causal LM has read the whole text at)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import warnings
from dataclasses import dataclass

import torch
from torch import nn

from . import st_folder
from .data import PackedTexts, Prompts, TokenRows, encode_texts, names_local_path, pad_batch, prompted_texts
from .hub import given_label, hub_lookup, raised_from

# ------------------------------------------------------------------------------------------------ pooling

POOLING_STRATEGIES = ("cls", "cls_avg", "avg", "max", "last")


def first_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the first real token of each row: argmax returns the first maximum, i.e. the first 1."""
    return attention_mask.int().argmax(dim=1)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """Index of the last real token of each row, for either padding side (the first 1 seen from the right)."""
    length = attention_mask.shape[1]
    return length - 1 - attention_mask.int().flip(dims=[1]).argmax(dim=1)


def right_padded(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded rows [B, L] moved to right padding: each row turned left by its count of padding tokens."""
    length = attention_mask.shape[1]
    padding = length - attention_mask.long().sum(dim=1, keepdim=True)
    moved = (torch.arange(length, device=attention_mask.device) + padding) % length
    return input_ids.gather(1, moved), attention_mask.gather(1, moved)


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, strategy: str) -> torch.Tensor:
    """Pool hidden states [B, L, H] with attention_mask [B, L] (1 = real token) into [B, H]. `max` takes each
    feature's largest value over a text's own tokens, as sentence-transformers' max pooling does; angle-emb 0.6.1's
    multiplies the padding by 0 instead, so a padded text's feature whose tokens are all negative pools to 0 there,
    and its embedding depends on the longer texts in its batch (equal where no text is padded)."""
    if strategy not in POOLING_STRATEGIES:
        raise ValueError(f"pooling must be one of {POOLING_STRATEGIES}; got {strategy!r}")
    if hidden.dim() != 3 or attention_mask.shape != hidden.shape[:2]:
        raise ValueError(
            f"hidden must be [B, L, H] and attention_mask [B, L]; got {tuple(hidden.shape)} and "
            f"{tuple(attention_mask.shape)}"
        )
    if not bool((attention_mask.sum(dim=1) > 0).all()):
        raise ValueError("attention_mask has a row without any real token; every text needs at least one token")
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    if strategy == "cls":
        return hidden[rows, first_token_index(attention_mask)]
    if strategy == "last":
        return hidden[rows, last_token_index(attention_mask)]
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    if strategy == "max":
        return hidden.masked_fill(mask == 0, torch.finfo(hidden.dtype).min).amax(dim=1)
    mean = (hidden * mask).sum(dim=1) / mask.sum(dim=1)
    if strategy == "avg":
        return mean
    return (hidden[rows, first_token_index(attention_mask)] + mean) / 2  # cls_avg


# ------------------------------------------------------------------------------------------------ models

# Model types loaded as decoder-only LMs when the config does not name a *ForCausalLM architecture.
DECODER_MODEL_TYPES = {
    "llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
    "phi", "phi3", "gpt2", "gpt_neox", "falcon", "olmo", "olmo2", "stablelm", "starcoder2", "cohere", "granite",
}

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
# The attention implementations that take the packed rows' 4D mask (Encoder._packed_mask).
PACKING_ATTENTION = ("sdpa", "eager")
# The attention implementations a run or an evaluation may ask for (--attention), by transformers' names; without it,
# the model keeps the one transformers chose as it loaded it (sdpa where the model has it, else eager). The flash
# attention ones need their package (flash-attn) and a GPU.
ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flex_attention")
# Those that compute in float16 or bfloat16 only (flash-attn's kernels: transformers casts float32 queries to the
# autocast's dtype, else to the weights', and the kernel refuses float32 at the first forward)
SIXTEEN_BIT_ATTENTION = ("flash_attention_2", "flash_attention_3")
# The largest relative difference between packed and padded embeddings that is rounding (Encoder.packing_problem),
# by compute dtype.
PACKING_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 1e-2}


@dataclass
class LoraSettings:
    """LoRA hyper-parameters; `target_modules=None` means every linear layer of the base model; `rslora`:
    rank-stabilised LoRA (peft's use_rslora), the update scaled by alpha / sqrt(r) instead of alpha / r."""

    r: int = 16
    alpha: float = 32  # any positive number (peft's scale is alpha / r, or alpha / sqrt(r) with rslora)
    dropout: float = 0.05
    target_modules: list[str] | None = None
    rslora: bool = False


def is_decoder_config(config) -> bool:
    """True for decoder-only (causal) LMs, which pad on the left and pool the last token by default."""
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(
            f"encoder-decoder models ({config.model_type}) are not supported; use an encoder or a decoder-only LM"
        )
    architectures = getattr(config, "architectures", None) or []
    return any(name.endswith("ForCausalLM") for name in architectures) or config.model_type in DECODER_MODEL_TYPES


def first_token_pooling_problem(encoder, pooling_source: str) -> str | None:
    """Why `encoder`'s pooling cannot tell texts apart, or None: a causal decoder's first token attends to itself
    alone, so first-token pooling (cls) gives every text starting with the same token (a BOS, a prompt) one
    embedding. pooling_source: where the pooling came from, in the message's words. Training refuses it before
    tokenising (trainer.check_model_settings), angle-eval before embedding a text (evaluate.main)."""
    if not (encoder.is_decoder and not encoder.bidirectional and encoder.pooling == "cls"):
        return None
    return (f"pooling cls ({pooling_source}) on a causal decoder LM: its first token sees no other token, so every "
            "text starting with the same token (a BOS token, a prompt) gets one embedding")


class Encoder(nn.Module):
    """Base model + pooling: forward(input_ids, attention_mask) -> float32 embeddings [B, H]."""

    def __init__(
        self,
        backbone: nn.Module,
        *,
        pooling: str,
        is_decoder: bool,
        pad_token_id: int,
        autocast: str | None = None,
        bidirectional: bool = False,
    ):
        super().__init__()
        if pooling not in POOLING_STRATEGIES:
            raise ValueError(f"pooling must be one of {POOLING_STRATEGIES}; got {pooling!r}")
        if autocast is not None and autocast not in AUTOCAST_DTYPES:
            raise ValueError(f"autocast must be None, 'bf16' or 'fp16'; got {autocast!r}")
        self.backbone = backbone
        self.pooling = pooling
        # where the pooling came from, in words for the run header and angle-eval (load_encoder, wrap_backbone)
        self.pooling_source = "given"
        # the Hub revision (branch, tag or commit) the base model was loaded at (load_encoder), or None: its main
        # branch, a local folder, a model given to train(); recorded by the exports (export.save_pretrained), whose
        # adapters load their base at it
        self.revision: str | None = None
        # the folder of the loaded model's sentence-transformers files (load_encoder: st_folder.find_folder's), or
        # None: kept for the length to encode at (its max_seq_length) and the trainer's exports, which for a hub name
        # would fetch them again (a model given to train() keeps its own: --model names nothing there)
        self.st_files = None
        self.is_decoder = is_decoder
        self.padding_side = "left" if is_decoder else "right"
        self.pad_token_id = pad_token_id
        self.autocast = autocast
        self.bidirectional = bidirectional
        # Espresso training (see all_layers_out): forward returns every layer's pooled embeddings [L, B, H]
        self.layer_stack = False
        # the prompts the model was trained with, by role: set by the trainer and by export.load_pretrained
        self.prompts = Prompts()
        # the tokens per text its export records for inference (angle_train.json's max_length: sentence-transformers'
        # max_seq_length, angle-eval's default), set by export.load_pretrained: encode()'s default; None: 512
        self.max_length: int | None = None
        # modules of the base model that the embeddings never use (BERT's pooler: wrap_backbone), by their attribute
        # name in the backbone: not trained, not moved, in a dict so that they are no submodules; put back for the
        # exports (export.save_pretrained)
        self.unused_modules: dict[str, nn.Module] = {}

    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def embedding_dim(self) -> int:
        """The width of the embeddings: every pooling strategy keeps the hidden size."""
        return self.backbone.config.hidden_size

    def _autocast(self):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=AUTOCAST_DTYPES[self.autocast])

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                packed: PackedTexts | None = None) -> torch.Tensor:
        """Embeddings [B, H] of the rows of input_ids [B, L] (attention_mask: 1 = real token), or with `packed`
        (data.PackedTexts: several texts per row) of each text, in the layout's text order (module docstring)."""
        kwargs = {}
        if packed is not None:
            inputs = {"input_ids": input_ids, "attention_mask": self._packed_mask(packed.text_of_token)}
            kwargs["position_ids"] = packed.position_ids + self.position_offset
        else:
            if self._left_padding_gives_nan(attention_mask):
                input_ids, attention_mask = right_padded(input_ids, attention_mask)
            inputs = {"input_ids": input_ids, "attention_mask": attention_mask}
            if self.is_decoder:
                # With left padding the real tokens do not start at position 0: count positions from the
                # first real token, so a text gets the same rotary positions whatever its batch mates.
                kwargs["position_ids"] = (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
            if self.bidirectional:
                inputs = self._bidirectional_inputs(input_ids, attention_mask)
        if self.is_decoder:
            kwargs["use_cache"] = False
        with self._autocast():
            out = self.backbone(**inputs, output_hidden_states=self.layer_stack, **kwargs)
        if not self.layer_stack:
            return self._pool(out.last_hidden_state, attention_mask, packed)
        # hidden states 0 .. L - 2 (0: the embedding layer's output) and the last, as angle-emb's Espresso takes them
        layers = [*out.hidden_states[:self.num_layers - 1], out.last_hidden_state]
        return torch.stack([self._pool(hidden, attention_mask, packed) for hidden in layers])

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype the base model computes in: its weights', or autocast's."""
        return next(self.parameters()).dtype if self.autocast is None else AUTOCAST_DTYPES[self.autocast]

    def _left_padding_gives_nan(self, attention_mask: torch.Tensor) -> bool:
        """Whether this batch would come out of the base model as NaN: transformers' eager attention takes its
        softmax in float32, where a float64 model's masked scores (float64's most negative number) become -inf, so a
        query that may see no key gives NaN; under a causal mask a left-padded row's padding tokens see none, and
        their NaN reaches the real tokens through the values (0 x NaN). forward moves such rows to right padding,
        where each padding token sees its row's real tokens: the real tokens' outputs are the same (causal attention
        never looks ahead, positions count from the first real token) and pooling reads either side."""
        return (self.is_decoder and not self.bidirectional and self.attention_implementation == "eager"
                and self.compute_dtype == torch.float64 and not bool(attention_mask[:, 0].all()))

    def _pool(self, hidden: torch.Tensor, attention_mask: torch.Tensor, packed: PackedTexts | None) -> torch.Tensor:
        """pool() in float32; packed rows are first unpacked to one right-padded row per text, so every pooling
        strategy reads a text's tokens exactly as in a padded batch."""
        if packed is None:
            return pool(hidden.float(), attention_mask, self.pooling)
        per_text = hidden.flatten(0, 1)[packed.token_index]  # [texts, longest, H]
        return pool(per_text.float(), packed.token_mask, self.pooling)

    def _packed_mask(self, text_of_token: torch.Tensor) -> torch.Tensor:
        """The 4D attention mask [rows, 1, L, L] of packed rows: a token attends to the tokens of its own text only
        (and, in a causal decoder, to those before it); padding attends to itself, so no row of the softmax is
        empty. sdpa takes it as booleans (True = attend), eager attention adds it to the scores (0 or the most
        negative float)."""
        same_text = text_of_token.unsqueeze(2) == text_of_token.unsqueeze(1)
        allowed = (same_text & (text_of_token >= 0).unsqueeze(2)) | torch.eye(
            text_of_token.shape[1], dtype=torch.bool, device=text_of_token.device)
        if self.is_decoder and not self.bidirectional:
            allowed &= torch.ones_like(allowed[0], dtype=torch.bool).tril()
        allowed = allowed.unsqueeze(1)
        if self.attention_implementation == "sdpa":
            return allowed
        return torch.zeros(allowed.shape, device=allowed.device).masked_fill(~allowed, torch.finfo(torch.float32).min)

    @property
    def attention_implementation(self) -> str | None:
        """The base model's attention implementation (transformers' name: sdpa, eager...); settable."""
        return getattr(self.backbone.config, "_attn_implementation", None)

    @attention_implementation.setter
    def attention_implementation(self, name: str) -> None:
        """Switch the base model's attention (transformers' set_attn_implementation, which a model built on its
        attention interface takes at any time): ImportError where the implementation's package is missing (flash-attn),
        ValueError where transformers has no such implementation for the model, or the model cannot switch (remote
        code that picks its attention classes as it is built; transformers only logs a warning then)."""
        if name == self.attention_implementation:
            return
        self.backbone.set_attn_implementation(name)
        if self.attention_implementation != name:
            raise ValueError(f"{type(self.backbone).__name__} cannot switch its attention once loaded: load it with "
                             f"from_pretrained(..., attn_implementation={name!r})")

    @torch.no_grad()
    def packing_problem(self, seqs: TokenRows | list[list[int]], width: int) -> str | None:
        """Why packed rows (data.PackedTexts) cannot go through this model, or None when they can. They need an
        attention that takes a 4D mask (sdpa or eager; flash and flex attention take other forms of it), and a
        model that honours the mask and the position ids as given: checked by embedding `seqs` (a few texts of
        the training data) both ways, without dropout, so an architecture that builds its own mask or positions
        is caught before it trains on wrong embeddings."""
        if self.attention_implementation not in PACKING_ATTENTION:
            return (f"packed rows need {' or '.join(PACKING_ATTENTION)} attention; this model uses "
                    f"{self.attention_implementation!r}")
        was_training = self.training
        self.eval()
        try:
            padded = self(*pad_batch(seqs, self.pad_token_id, self.padding_side, self.device))
            input_ids, layout = PackedTexts.build(seqs, width, self.pad_token_id)
            packed = self(input_ids.to(self.device), layout.attention_mask.to(self.device), layout.to(self.device))
        finally:
            self.train(was_training)
        # rounding only: float32 differs by ~1e-6 of the norm, bf16 by ~1e-2; wrong positions or a leaking mask by
        # a large fraction of it
        error = float((packed - padded).norm(dim=-1).max() / padded.norm(dim=-1).min())
        tolerance = PACKING_TOLERANCE.get(self.compute_dtype, PACKING_TOLERANCE[torch.float32])
        if not error <= tolerance:
            return (f"packed rows embed differently from padded ones on this model (relative difference {error:.2g} "
                    f"> {tolerance:g}): it does not take the packed rows' attention mask or position ids as given")
        return None

    @property
    def position_offset(self) -> int:
        """The first position id of a text: 0, or after the padding row of a learned table that numbers positions
        from there (RoBERTa, XLM-R: padding_idx + 1), as the model itself counts when it is not given positions."""
        table = position_table(self.backbone)
        return 0 if table is None or table.padding_idx is None else table.padding_idx + 1

    @property
    def bidirectional(self) -> bool:
        """Whether a decoder LM attends both ways (module docstring); settable."""
        return self._bidirectional

    @bidirectional.setter
    def bidirectional(self, on: bool) -> None:
        if on and not self.is_decoder:
            raise ValueError("bidirectional=True removes a decoder LM's causal mask; this model is an encoder, whose "
                             "attention is bidirectional already")
        self._bidirectional = bool(on)
        if self.is_decoder:
            for module in self.backbone.modules():
                if hasattr(module, "is_causal"):  # attention layers: read by the kernels that take no mask
                    module.is_causal = not on

    def _bidirectional_inputs(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict:
        """The token embeddings and a 4D mask in which each token sees every real token of its row (module
        docstring); the embeddings are computed here because the mask factory needs their dtype and shape."""
        try:
            from transformers.masking_utils import create_bidirectional_mask
        except ImportError as exc:  # pragma: no cover - depends on the installed transformers
            raise ImportError("bidirectional attention needs a transformers release with "
                              "masking_utils.create_bidirectional_mask (pip install -U transformers)") from exc
        embeds = self.backbone.get_input_embeddings()(input_ids)
        mask = create_bidirectional_mask(config=self.backbone.config, inputs_embeds=embeds,
                                         attention_mask=attention_mask, allow_is_bidirectional_skip=False)
        return {"inputs_embeds": embeds, "attention_mask": attention_mask if mask is None else mask}

    @property
    def num_layers(self) -> int:
        """The base model's transformer layers (the rows of a layer stack)."""
        return self.backbone.config.num_hidden_layers

    @contextlib.contextmanager
    def all_layers_out(self, enabled: bool = True):
        """Inside (when enabled), forward returns the stack [num_layers, B, H]: the pooled hidden states 0 .. L - 2
        and the pooled last hidden state; outside, the last layer's embeddings [B, H] as usual."""
        previous, self.layer_stack = self.layer_stack, enabled
        try:
            yield
        finally:
            self.layer_stack = previous

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Only the parameters that train (all of them, or the LoRA adapters): what a checkpoint must keep."""
        names = {name for name, p in self.named_parameters() if p.requires_grad}
        return {k: v for k, v in self.state_dict().items() if k in names}

    @torch.no_grad()
    def encode(self, texts, tokenizer, *, batch_size: int = 64, max_length: int | None = None,
               prompt: str | None = None, prompt_name: str = "text", normalize: bool = False,
               dim: int | None = None) -> torch.Tensor:
        """Embed a list of strings for inference: batched, longest-first (less padding), original order out.
        max_length: tokens per text, prompt included (default: encoding_length). prompt: a template for these texts
        ('' for none); by default the model's own prompt for `prompt_name` ('text', 'query' or 'document':
        data.Prompts), as in training. dim: keep the first `dim` features (a Matryoshka-trained model's prefix);
        normalize applies after the cut, so the prefix has unit norm."""
        if isinstance(texts, str):
            texts = [texts]
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int of at least 1, got {batch_size!r}")
        check_dim(dim, self.embedding_dim)  # before the forward passes, not after them
        if not texts:  # as sentence-transformers: no rows (the tokenizer cannot take an empty batch)
            return torch.empty(0, dim or self.embedding_dim, dtype=torch.float32)
        max_length = self.encoding_length(max_length)
        template = self.prompts.for_role(prompt_name) if prompt is None else prompt
        texts, _ = prompted_texts(texts, template, tokenizer, max_length)
        # a fast tokenizer's ids read from its backend's encodings, as training reads them (data.encode_texts)
        ids = encode_texts(texts, tokenizer, truncation=True, max_length=max_length,
                           add_special_tokens=True)["input_ids"]
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        was_training = self.training
        self.eval()
        out = torch.empty(len(ids), self.embedding_dim, dtype=torch.float32)
        try:  # a pass that fails (out of memory) leaves the model in the mode it was given in
            for start in range(0, len(order), batch_size):
                rows = order[start:start + batch_size]
                input_ids, mask = pad_batch([ids[i] for i in rows], self.pad_token_id, self.padding_side, self.device)
                out[rows] = self(input_ids, mask).cpu()
        finally:
            self.train(was_training)
        out = truncate(out, dim)
        return torch.nn.functional.normalize(out, dim=-1) if normalize else out

    def encoding_length(self, max_length: int | None = None) -> int:
        """The tokens per text encode() keeps: `max_length`, else the length the model's export records
        (self.max_length, as sentence-transformers and angle-eval read it), else 512 or the model's position limit if
        lower. A length beyond the position table (position_limit) is refused: the model cannot read it."""
        limit = position_limit(self.backbone)
        if max_length is None:
            length = self.max_length or 512
            return length if limit is None else min(length, limit)
        if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
            raise ValueError(f"max_length must be a positive int or None; got {max_length!r}")
        if limit is not None and max_length > limit:
            raise ValueError(f"max_length {max_length} is longer than the model can read: its position table holds "
                             f"{limit} positions; use max_length={limit} or less")
        return max_length


# The names transformers gives a learned absolute position table: BERT, RoBERTa, ELECTRA, DistilBERT, MPNet, ALBERT
# and DeBERTa with position_biased_input (`position_embeddings`), GPT-2 and GPT-Neo (`wpe`), OPT and BART
# (`embed_positions`, an offset of 2 rows before position 0), CLIP's text tower (`position_embedding`). A table is
# found by its name, not by its size: DeBERTa-v3's relative-position buckets (`rel_embeddings`, 2 x 256 rows) have
# the size of its max_position_embeddings, but no length limit.
POSITION_TABLE_NAMES = ("position_embeddings", "wpe", "embed_positions", "position_embedding")


def position_table(backbone: nn.Module) -> nn.Embedding | None:
    """The model's learned absolute position table (POSITION_TABLE_NAMES), or None (rotary, relative: no table). A
    table wrapped by peft (LoRA on it) is its `base_layer`."""
    for name, module in backbone.named_modules():
        parts = name.split(".")
        own_name = parts[-2] if parts[-1] == "base_layer" and len(parts) > 1 else parts[-1]
        if own_name in POSITION_TABLE_NAMES and isinstance(module, nn.Embedding):
            return module
    return None


def configured_positions(backbone: nn.Module) -> int | None:
    """The config's max_position_embeddings (GPT-2's n_positions), or None where it gives no positive int."""
    positions = getattr(getattr(backbone, "config", None), "max_position_embeddings", None)
    return positions if isinstance(positions, int) and not isinstance(positions, bool) and positions > 0 else None


def absolute_if_local(name_or_path: str | None) -> str | None:
    """A model name that is a local folder here as its absolute path, which names that folder from any working folder
    (a relative one names another, or none, once the working folder changes); a hub name (or None) as it is."""
    return os.path.abspath(name_or_path) if name_or_path and os.path.isdir(name_or_path) else name_or_path


def recorded_base(base: str, *, adapter: str, record: str, remedy: str, label: str = "") -> str:
    """The base model an adapter folder's record names (`record` says which: its adapter_config.json's or
    angle_train.json's; `label` goes before the folder in the message), checked before anything loads. A relative
    path is looked up from the working folder, as peft and transformers look it up, and nowhere else: an adapter
    records its base as it was named when it was trained (peft, angle-emb, angle_train before it recorded local bases
    absolute), relative to a working folder nothing records, so a folder of that name found elsewhere may be another
    model; it is named in the refusal, not loaded. A name that is no folder here and can be a hub id (NAME or
    OWNER/NAME, data.names_local_path) is the hub's, as before (angle-emb's adapters record hub names); one that can
    only be a local path is refused naming `remedy`, where transformers said it was no valid repo id."""
    if os.path.isdir(base) or not names_local_path(base):
        return base
    # relative to the adapter's folder and those above it: where a run's output folder often sits below the folder it
    # was started from (runs/NAME/final, the base in ../models/NAME)
    above, near = os.path.dirname(os.path.abspath(adapter)), None
    while not os.path.isabs(base):
        if os.path.isdir(os.path.join(above, base)):
            near = os.path.join(above, base)
            break
        if os.path.dirname(above) == above:
            break
        above = os.path.dirname(above)
    where = ("which is no longer there" if os.path.isabs(base) else
             f"a path relative to the folder it was trained from, which is no folder from the working folder "
             f"{os.getcwd()} (where a relative base is looked up, as peft does)")
    found = f"; there is a folder of that name at {near} (from {above}, above the adapter's), which may be it" \
        if near else ""
    raise FileNotFoundError(f"{label}{adapter} holds a LoRA adapter of the local model {base} ({record}), "
                            f"{where}{found}: {remedy}")


def position_limit(backbone: nn.Module) -> int | None:
    """The most tokens the model can read at once where it has a hard limit, or None. A learned position table
    (position_table) fails on longer inputs: its rows, less those before position 0: the offset its forward adds to
    every position id (OPT, BART: `offset`, 2) or the rows up to the padding row of an architecture that numbers
    positions after it (RoBERTa, XLM-R: padding_idx + 1 onwards). Rotary models (LLaMA, Mistral, Qwen) and relative
    ones (DeBERTa-v3, T5) have no table and no hard limit."""
    table = position_table(backbone)
    if table is None:
        return None
    offset = getattr(table, "offset", 0)
    return table.num_embeddings - (offset if isinstance(offset, int) else 0) - (
        0 if table.padding_idx is None else table.padding_idx + 1)


def trained_context(backbone: nn.Module) -> int | None:
    """The tokens a rotary-position model (LLaMA, Mistral, Qwen: a *RotaryEmbedding module, no position table) was
    trained to read at once, its config's max_position_embeddings; None for any other model. Past it the model still
    runs (rotary positions have no table to run out of), but at positions it never saw in training."""
    if not any(type(module).__name__.endswith("RotaryEmbedding") for module in backbone.modules()):
        return None
    return configured_positions(backbone)


def past_trained_context_note(backbone: nn.Module, flag: str, length: int, model: str) -> str | None:
    """One line saying that `flag` `length` reaches past a rotary model's trained context (trained_context), or None
    where it does not: not an error (the model runs there), but its embeddings of such long texts are untested."""
    context = trained_context(backbone)
    if context is None or length <= context:
        return None
    return (f"note: {flag} {length} reaches past the {context} tokens {model} was trained to read (its config's "
            "max_position_embeddings): rotary positions run there, but texts longer than that are read at positions "
            "it never saw in training")


def use_attention(encoder: Encoder, name: str, *, flag: str = "--attention") -> None:
    """Set `encoder`'s attention implementation to `name` (ATTENTION_IMPLEMENTATIONS), or raise a ValueError naming
    `flag`: a flash attention on a model that computes in float32 or float64, its package missing (flash-attn), or a
    model that has no such implementation or cannot switch."""
    if name in SIXTEEN_BIT_ATTENTION and encoder.compute_dtype not in (torch.float16, torch.bfloat16):
        dtype = str(encoder.compute_dtype).removeprefix("torch.")
        raise ValueError(f"{flag} {name} computes in float16 or bfloat16, and the model computes in {dtype} (its "
                         "weights, no autocast): use sdpa, or a 16-bit autocast (--bf16 1)")
    try:
        encoder.attention_implementation = name
    except (ImportError, ValueError) as exc:
        raise ValueError(f"{flag} {name}: {exc}") from None


def check_dim(dim: int | None, width: int) -> None:
    """dim: None (every feature) or a prefix width 1 <= dim <= width."""
    if dim is not None and (isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= width):
        raise ValueError(f"dim must be None or an int from 1 to the embedding width {width}; got {dim!r}")


def truncate(embeddings: torch.Tensor, dim: int | None) -> torch.Tensor:
    """The first `dim` features of each embedding [..., D] (Matryoshka truncation); dim=None keeps them all."""
    check_dim(dim, embeddings.shape[-1])
    return embeddings if dim is None else embeddings[..., :dim]


def prepare_tokenizer(tokenizer, is_decoder: bool):
    """Decoder LMs pad on the left (so the last position is the last real token) and often lack a pad token."""
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError("the tokenizer has neither a pad token nor an eos token to pad with")
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left" if is_decoder else "right"
    return tokenizer


def takes_gradient_checkpointing(backbone: nn.Module) -> bool:
    """Whether transformers can recompute `backbone`'s activations in backward (enable_gradient_checkpointing): a
    transformers model whose class supports it (a peft model answers for its base model)."""
    return bool(getattr(backbone, "supports_gradient_checkpointing", False)) and any(
        hasattr(backbone, name) for name in ("activation_checkpointing_enable", "gradient_checkpointing_enable"))


def enable_gradient_checkpointing(backbone: nn.Module) -> None:
    """Recompute `backbone`'s activations in backward (--gradient-checkpointing), non-reentrant: the inputs need not
    require gradients (frozen embeddings under LoRA)."""
    # transformers 5.x renamed it activation_checkpointing_enable, the old name kept with a FutureWarning at every
    # run; the versions before the rename have only the old one
    enable = getattr(backbone, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        backbone.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def disable_gradient_checkpointing(backbone: nn.Module) -> None:
    """Undo enable_gradient_checkpointing (by either name, as it enables)."""
    disable = getattr(backbone, "activation_checkpointing_disable", None)
    if disable is not None:
        disable()
    else:
        backbone.gradient_checkpointing_disable()


def recomputes_activations(backbone: nn.Module) -> bool | None:
    """Whether `backbone` recomputes its activations in backward (enable_gradient_checkpointing), None where it cannot
    say (no transformers model); by the name transformers 5 reads without a FutureWarning, else the old one."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if hasattr(type(backbone), name) or name in getattr(backbone, "__dict__", {}):
            return bool(getattr(backbone, name))
    base = getattr(backbone, "base_model", None)  # peft's wrapper: its model's
    return recomputes_activations(base.model) if base is not None and hasattr(base, "model") else None


def wrap_backbone(
    backbone: nn.Module,
    *,
    pooling: str | None,
    pad_token_id: int,
    is_decoder: bool | None = None,
    lora: LoraSettings | None = None,
    gradient_checkpointing: bool = False,
    autocast: str | None = None,
    bidirectional: bool = False,
) -> Encoder:
    """Turn an already built base model (loaded or made from a config) into a trainable Encoder."""
    if is_decoder is None:
        is_decoder = is_decoder_config(backbone.config)
    # BERT-style models carry a pooler (dense + tanh on [CLS]) that our pooling never reads: drop it so its
    # parameters neither train nor trip DDP's unused-parameter check, and keep its weights for the exports, which
    # then hold every weight the architecture has (loading them warns of no missing weight).
    dropped = {}
    if getattr(backbone, "pooler", None) is not None:
        dropped["pooler"] = backbone.pooler.requires_grad_(False)
        backbone.pooler = None
    if gradient_checkpointing:
        enable_gradient_checkpointing(backbone)
    if lora is not None:
        try:
            from peft import LoraConfig, get_peft_model
        except ImportError as exc:  # pragma: no cover - depends on the environment
            raise ImportError("LoRA needs peft: pip install peft (or the angle_kernels[train] extra)") from exc
        if lora.target_modules:
            check_lora_targets(backbone, lora.target_modules)
        config = LoraConfig(
            r=lora.r,
            lora_alpha=lora.alpha,
            lora_dropout=lora.dropout,
            target_modules=lora.target_modules or "all-linear",
            bias="none",
            use_rslora=lora.rslora,
        )
        with peft_wrapping():
            backbone = get_peft_model(backbone, config)
    source = "--pooling" if pooling else f"the default for {'decoder LMs' if is_decoder else 'encoders'}"
    pooling = pooling or ("last" if is_decoder else "cls")
    encoder = Encoder(backbone, pooling=pooling, is_decoder=is_decoder, pad_token_id=pad_token_id, autocast=autocast,
                      bidirectional=bidirectional)
    encoder.unused_modules = dropped
    encoder.pooling_source = source
    return encoder


class LoraTargetError(ValueError):
    """LoRA target module names that match no layer of the model, or a layer LoRA cannot adapt."""


# The layer types peft's LoRA adapts (its torch.nn ones, and transformers' Conv1D: GPT-2's linear layers), by name.
LORA_LAYER_TYPES = ("Linear", "Embedding", "Conv1d", "Conv2d", "Conv3d", "Conv1D", "MultiheadAttention")


def check_lora_targets(backbone: nn.Module, targets: list[str]) -> None:
    """Refuse target module names as peft would match them (a module whose name is the target or ends with
    '.' + target) that match no module of `backbone`, or a module of a type LoRA cannot adapt (a norm, an activation,
    a whole block), naming the layers it can adapt; peft would refuse them with a traceback once it starts."""
    names = [(name, module) for name, module in backbone.named_modules() if name]
    adaptable = sorted({name.rsplit(".", 1)[-1] for name, module in names
                        if type(module).__name__ in LORA_LAYER_TYPES})
    for target in targets:
        matched = [(name, module) for name, module in names if name == target or name.endswith("." + target)]
        wrong = next((type(module).__name__ for _, module in matched
                      if type(module).__name__ not in LORA_LAYER_TYPES), None)
        if not matched or wrong:
            problem = f"names a {wrong}, which LoRA cannot adapt" if matched else "matches no module of the model"
            raise LoraTargetError(f"{target!r} {problem}; expected names of its linear (or embedding) layers: "
                                  f"{', '.join(adaptable) or 'none'}")


def export_pooling(meta_path: str, pooling) -> str | None:
    """The pooling an export's angle_train.json (`meta_path`) names, or None where it names none. One this version
    does not know (a newer export's) is refused: the folder's other files cannot stand in for it (a cls_avg export has
    none), and a default would embed differently in silence."""
    if pooling is not None and pooling not in POOLING_STRATEGIES:
        raise ValueError(f"{meta_path} names the pooling {pooling!r}, which this version does not know (it knows "
                         f"{', '.join(POOLING_STRATEGIES)}): give its pooling with --pooling (pooling= in Python)")
    return pooling


def export_prompts(meta: dict) -> Prompts:
    """The prompts an export's angle_train.json (`meta`, read) records; exports written before per-role prompts have
    only "prompt" (every text's)."""
    return Prompts(**meta.get("prompts", {"text": meta.get("prompt")}))


def _own_meta(name_or_path: str) -> dict:
    """The angle_train.json of a model's folder that is an angle_train export; {} for any other model."""
    meta = os.path.join(name_or_path, st_folder.META_FILE)
    return st_folder.read_json(meta) if os.path.isfile(meta) else {}


def own_pooling(name_or_path: str, st_files: str | None) -> tuple[str, str] | None:
    """(pooling, the file that names it) of a model's folder: an angle_train export's angle_train.json (every strategy;
    cls_avg and bidirectional exports have no sentence-transformers files; `export_pooling`), else the Pooling module
    of its sentence-transformers files (`st_files`: st_folder.find_folder's folder, or None); None when neither names
    one."""
    meta = os.path.join(name_or_path, st_folder.META_FILE)
    pooling = export_pooling(meta, _own_meta(name_or_path).get("pooling"))
    if pooling is not None:
        return pooling, st_folder.META_FILE
    return st_folder.pooling(st_files) if st_files else None


def own_bidirectional(name_or_path: str) -> bool:
    """Whether a model's folder is an angle_train export trained with bidirectional attention (its
    angle_train.json)."""
    return _own_meta(name_or_path).get("bidirectional") is True


def own_prompts(name_or_path: str) -> Prompts:
    """The prompts a model's folder that is an angle_train export was trained with (its angle_train.json); none for
    any other model."""
    return export_prompts(_own_meta(name_or_path))


def own_lowercasing(st_files: str | None) -> bool:
    """Whether a model's sentence-transformers files (`st_files`: st_folder.find_folder's folder, or None) say its
    texts are lowercased before tokenisation (sentence_bert_config.json's do_lower_case: true, which
    sentence-transformers applies whatever the tokenizer does)."""
    return st_files is not None and st_folder.settings(st_files).get("do_lower_case") is True


def lowercase_first(tokenizer) -> None:
    """Make the tokenizer lowercase every text before anything else it does, as sentence-transformers' Transformer
    module does for do_lower_case: a fast tokenizer gets a Lowercase normaliser first in its pipeline (where it has
    none; sentence-transformers 6's way, saved with the tokenizer, so an export lowercases wherever it is loaded), a
    slow one its do_lower_case switched on. Training, evaluation and encode() then read the texts as
    sentence-transformers does (it lowercased them while angle_train trained on the cased texts)."""
    if not tokenizer.is_fast:
        try:
            tokenizer.do_lower_case = True
        except AttributeError:  # a read-only property, as sentence-transformers finds on some slow tokenizers
            tokenizer.basic_tokenizer.do_lower_case = True
        return
    from tokenizers.normalizers import Lowercase, Sequence

    backend = tokenizer.backend_tokenizer
    normalizer = backend.normalizer
    steps = list(normalizer) if isinstance(normalizer, Sequence) else [] if normalizer is None else [normalizer]
    if not any(isinstance(step, Lowercase) for step in steps):
        backend.normalizer = Sequence([Lowercase(), *steps])


# peft's record of an adapter: its LoRA settings and the base model it was trained on (base_model_name_or_path)
ADAPTER_CONFIG = "adapter_config.json"
# the folder of a whole-model LoRA export that holds its adapter alone (peft's files), beside the merged weights
ADAPTER_FOLDER = "adapter"


class AdapterFitError(ValueError):
    """A LoRA adapter whose weights do not fit the layers of the base model it is attached to."""


class AdapterConfigError(ValueError):
    """A LoRA adapter's adapter_config.json that lacks a setting its weights are read with, or gives it in a form that
    cannot be one."""


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# The settings of adapter_config.json that a LoRA adapter's weights are read with: (whether peft always writes it,
# whether a value is one, what is expected). Without its rank and alpha peft takes its defaults (8 and 8): other
# weight shapes, or the same ones at another scale, in silence; the dropout is peft's PEFT_LORA_DROPOUT when it is not
# there.
PEFT_LORA_DROPOUT = 0.0
LORA_ADAPTER_FIELDS = {
    "r": (True, lambda value: isinstance(value, int) and not isinstance(value, bool) and value >= 1,
          "the adapter's rank, a whole number of at least 1"),
    "lora_alpha": (True, lambda value: _is_number(value) and value > 0,
                   "the adapter's scale numerator (the update is scaled by lora_alpha / r), a positive number"),
    "lora_dropout": (False, lambda value: _is_number(value) and 0 <= value < 1,
                     "the dropout on the adapter's input in training, a number from 0 to below 1"),
    "target_modules": (True, lambda value: (isinstance(value, str) and bool(value)) or (
        isinstance(value, list) and bool(value) and all(isinstance(name, str) and name for name in value)),
        "the layers it adapts, a list of layer names or one regular expression"),
}


def read_adapter_config(adapter_folder: str, *, label: str = "the LoRA adapter ") -> dict:
    """The adapter_config.json of the peft adapter in `adapter_folder`, read; a LoRA one's settings that its weights
    are read with (LORA_ADAPTER_FIELDS) checked first, so that one missing or malformed is refused naming the file,
    the setting and what it must be, before any model loads (peft's KeyError or TypeError named neither, or it took
    a default in silence). label: the messages' words before the folder ("--lora-path ", "MODEL ")."""
    path = os.path.join(adapter_folder, ADAPTER_CONFIG)
    config = st_folder.read_json(path)
    if config.get("peft_type") != "LORA":  # another kind of adapter: peft reads its own settings
        return config
    for name, (required, valid, expected) in LORA_ADAPTER_FIELDS.items():
        if name not in config and not required:
            continue
        problem = f"has no {name!r}" if name not in config else f"has {name!r}: {json.dumps(config[name])}"
        if name not in config or not valid(config[name]):
            raise AdapterConfigError(f"{label}{adapter_folder}: {path} {problem}; expected {expected} (peft "
                                     "writes it with the adapter's weights)")
    return config


# peft's files of an adapter's weights (safetensors, or the pickled state dict of older versions)
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


# Keys of an adapter's adapter_config.json that are no part of the adapter a run starts from (adapter_fingerprint):
# where its base was found (the base is compared as --model), and the dropout peft applies to the adapted layers'
# input in training, which --lora-dropout replaces
ADAPTER_CONFIG_NOT_THE_ADAPTER = ("base_model_name_or_path", "lora_dropout")


def adapter_fingerprint(adapter_folder: str) -> str:
    """A fingerprint of the adapter in `adapter_folder`: its adapter_config.json's settings (without
    ADAPTER_CONFIG_NOT_THE_ADAPTER) and the bytes of its weights' files (ADAPTER_WEIGHTS). A copy or a move of the
    adapter has its fingerprint, and so has the adapter with another dropout; another adapter of the same settings
    and shapes, or the folder's files replaced since, another."""
    config = read_adapter_config(adapter_folder)
    for key in ADAPTER_CONFIG_NOT_THE_ADAPTER:
        config.pop(key, None)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for name in ADAPTER_WEIGHTS:
        path = os.path.join(adapter_folder, name)
        if os.path.isfile(path):
            digest.update(f"|{name}|".encode())
            st_folder.hash_file(path, digest)
    return digest.hexdigest()[:16]


def adapted_layer_names(target_modules) -> list[str]:
    """The names of the layers a LoRA config adapts, without their paths: an adapter trained on "all-linear" records
    every layer's full path (model.layers.0.self_attn.q_proj), read as its name (q_proj); a regular expression (one
    text, as peft takes it) is kept as it is."""
    if isinstance(target_modules, str):
        return [target_modules]
    return sorted({name.rsplit(".", 1)[-1] for name in target_modules})


def adapter_config_base(adapter_folder: str, *, label: str, flag: str) -> str:
    """The base model the LoRA adapter in `adapter_folder` was trained on, as its adapter_config.json records it
    (base_model_name_or_path); refused where it names none, or (recorded_base) a local folder not found, saying to
    give the base with `flag`. label: the messages' words before the folder ("MODEL ", "--lora-path ")."""
    base = st_folder.read_json(os.path.join(adapter_folder, ADAPTER_CONFIG)).get("base_model_name_or_path")
    if not base:
        raise ValueError(f"{label}{adapter_folder} is a LoRA adapter whose {ADAPTER_CONFIG} names no base model: give "
                         f"the model it was trained on with {flag}")
    return recorded_base(base, adapter=adapter_folder, label=label, remedy=f"give the base with {flag}",
                         record=f"its {ADAPTER_CONFIG}'s base_model_name_or_path")


def adapter_export_meta(folder: str) -> str | None:
    """The angle_train.json of the whole-model LoRA export whose adapter alone `folder` is (a LoRA run's
    final/adapter: peft's files, with nothing of how the run embedded texts), which records the pooling, attention,
    prompts and length the adapter was trained with; None for any other folder."""
    meta_file = os.path.normpath(os.path.join(folder, os.pardir, st_folder.META_FILE))
    own_meta = os.path.join(folder, st_folder.META_FILE)  # an adapter-only export: its own settings
    if (os.path.basename(os.path.abspath(folder)) != ADAPTER_FOLDER or os.path.isfile(own_meta)
            or not os.path.isfile(os.path.join(folder, ADAPTER_CONFIG)) or not os.path.isfile(meta_file)):
        return None
    meta = st_folder.read_json(meta_file)
    return meta_file if meta.get("lora") and not meta.get("adapter_only") else None


# The default of an argument that names a file or folder the caller may have looked up already (build_encoder's
# lora_settings, load_pretrained's export_meta_file, save_pretrained's base_files): not given, the function looks it
# up itself; given, None included (a lookup that found nothing), nothing is looked up again
LOOK_UP = object()


def adapter_settings_file(lora_path: str) -> str | None:
    """The angle_train.json that records how the adapter in `lora_path` embedded texts in training (pooling, attention,
    prompts): its own (an adapter-only export, a LoRA run's best/) or its export's (final/adapter:
    adapter_export_meta); None for an adapter angle_train did not export (angle-emb's, peft's)."""
    own = os.path.join(lora_path, st_folder.META_FILE)
    return own if os.path.isfile(own) else adapter_export_meta(lora_path)


@contextlib.contextmanager
def peft_wrapping():
    """Inside: peft building its model around a backbone. peft (0.21) reads the backbone's
    `is_gradient_checkpointing`, which transformers 5 deprecates with a FutureWarning on every LoRA run's start that
    names neither package's fix nor anything the user can change: that one warning is left out, every other shown."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
        yield


def attach_adapter(backbone: nn.Module, lora_path: str, *, dropout: float | None = None) -> nn.Module:
    """`backbone` (a base model without LM head, as AutoModel loads it) with the peft adapter of the folder `lora_path`,
    trainable; dropout: the LoRA dropout it trains with (None: the adapter's own), no part of its weights, peft's
    setting of the adapter's layers as it builds them. An adapter saved from the model with its LM head (a
    *ForCausalLM, as angle-emb and most LoRA trainers save theirs) names its layers under the head's wrapper
    (`model.layers.0...`, the base model's `base_model_prefix`): those names are read without it. An adapter weight
    that fits no layer of the base model is refused: peft only warns of it and leaves that layer's adapter at its
    initial value (often zero: the base model's embeddings, in silence)."""
    from peft import PeftConfig, PeftModel
    from peft.utils import load_peft_weights, set_peft_model_state_dict
    from peft.utils.error import NoMatchingPeftModuleError

    read_adapter_config(lora_path)  # its settings checked before peft reads them
    config = PeftConfig.from_pretrained(lora_path)
    weights = load_peft_weights(lora_path, device="cpu")
    prefix = getattr(backbone, "base_model_prefix", "")
    outer = f"base_model.model.{prefix}."
    if prefix and weights and all(key.startswith(outer) for key in weights) and not hasattr(backbone, prefix):
        weights = {"base_model.model." + key[len(outer):]: value for key, value in weights.items()}
        if isinstance(config.target_modules, (list, set, tuple)):  # full module paths, as "all-linear" records them
            config.target_modules = sorted(name.removeprefix(prefix + ".") for name in config.target_modules)
    config.inference_mode = False
    if dropout is not None:
        config.lora_dropout = dropout
    does_not_fit = f"the LoRA adapter {lora_path} does not fit {type(backbone).__name__}"
    trained_on = f"it was trained on another model (its {ADAPTER_CONFIG} names {config.base_model_name_or_path})"
    try:
        with peft_wrapping():
            model = PeftModel(backbone, config)
    except NoMatchingPeftModuleError:  # another architecture: peft's message lists every module name it looked for
        targets = ([config.target_modules] if isinstance(config.target_modules, str)
                   else sorted(config.target_modules or ()))
        named = ", ".join(targets[:3]) + (f", ... ({len(targets)} in all)" if len(targets) > 3 else "")
        raise AdapterFitError(f"{does_not_fit}: the model has none of the layers it adapts ({named}); "
                              f"{trained_on}") from None
    try:
        result = set_peft_model_state_dict(model, weights)
    except RuntimeError as exc:  # torch's "size mismatch for <weight>: ..." (the same layers, another width)
        mismatch = next((line.strip() for line in str(exc).splitlines() if "size mismatch" in line), str(exc))
        raise AdapterFitError(f"{does_not_fit}: its weights have other shapes than the model's layers "
                              f"({mismatch.rstrip('.')}); {trained_on}") from None
    missing = [key for key in result.missing_keys if "lora_" in key]
    if missing or result.unexpected_keys:
        unfit = (result.unexpected_keys or missing)[0]
        raise AdapterFitError(f"{does_not_fit}: {len(result.unexpected_keys)} of its weights fit no layer of the "
                              f"model, {len(missing)} of the layers it adapts have no weights in it (e.g. {unfit}); "
                              f"{trained_on}")
    return model


def ships_own_code(backbone: nn.Module) -> bool:
    """Whether `backbone` was loaded from a folder that ships its own Python code (config.json's auto_map), which its
    exports keep and their loaders run only where trusted (trust_remote_code=True)."""
    return bool(getattr(backbone.config, "auto_map", None))


@contextlib.contextmanager
def untrusted_code_named(name_or_path: str, given_as: str | None):
    """Inside: the load of a model; transformers' refusal of a model that ships its own Python code (config.json's
    auto_map: custom architectures, gte-base-en-v1.5's or nomic-embed's) that the caller did not trust, reworded to
    name the model as `given_as` gave it (hub.given_label) and the setting that trusts it."""
    try:
        yield
    except ValueError as exc:
        if "trust_remote_code=True" not in str(exc):
            raise
        raise ValueError(f"{given_label(given_as, name_or_path)} ships its own model code (config.json's auto_map), "
                         "which runs only when trusted, with your permissions: read it, then add --trust-remote-code "
                         "(trust_remote_code=True in Python)") from None


@contextlib.contextmanager
def missing_revision_named(name_or_path: str, revision: str | None, *, given_as: str | None, revision_given_as: str):
    """Inside: the load of a model at `revision`; the Hub's answer that the repository has no such branch, tag or
    commit (huggingface_hub's RevisionNotFoundError, below transformers' OSError) reworded to name the revision as
    `revision_given_as` gave it, and the model as `given_as` did."""
    try:
        yield
    except OSError as exc:
        if revision is None or raised_from(exc, {"RevisionNotFoundError"}) is None:
            raise
        raise ValueError(f"{given_label(revision_given_as, revision)}: {given_label(given_as, name_or_path)} has no "
                         "such branch, tag or commit on the Hugging Face Hub") from None


def load_encoder(
    name_or_path: str,
    *,
    pooling: str | None = None,
    lora: LoraSettings | None = None,
    lora_path: str | None = None,
    lora_dropout: float | None = None,
    gradient_checkpointing: bool = False,
    autocast: str | None = None,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    is_decoder: bool | None = None,
    trust_remote_code: bool = False,
    bidirectional: bool = False,
    revision: str | None = None,
    given_as: str | None = "name_or_path=",
    revision_given_as: str = "revision=",
):
    """Load (encoder, tokenizer) from a hub name or local folder; `lora_path` resumes/evaluates an adapter, trained with
    `lora_dropout` (None: the adapter's own; attach_adapter). pooling:
    None takes the folder's own (own_pooling), else the default (cls for encoders, last for decoder LMs);
    encoder.pooling_source says which. The tokenizer lowercases the texts where the folder's sentence-transformers
    settings say so (own_lowercasing, lowercase_first). A hub name that cannot be loaded (the Hub out of reach and
    the model not cached, or no such repository) raises hub.HubUnreachable / hub.HubNotFound naming `given_as`
    (the flag or argument that gave `name_or_path`: "--model", "MODEL"...). `revision`: the hub repository's branch,
    tag or commit (None: its main branch), recorded as encoder.revision; one the repository does not have is refused
    naming `revision_given_as` (--revision, or the record that gave it)."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    # loaded by its absolute path, the model records that (its config's name_or_path, peft's record of its base,
    # st_files): given to train() after a change of working folder, a relative one named no folder where its exports
    # recorded their base and read its sentence-transformers files
    name_or_path = absolute_if_local(name_or_path)
    if lora_path is not None:
        read_adapter_config(lora_path)  # its settings checked before the model loads
    # a local folder: loaded as ever; a model whose own code is not trusted: named with the setting that trusts it
    at = {"revision": revision} if revision is not None else {}
    with (hub_lookup(name_or_path, kind="model", given_as=given_as), untrusted_code_named(name_or_path, given_as),
          missing_revision_named(name_or_path, revision, given_as=given_as, revision_given_as=revision_given_as)):
        config = AutoConfig.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **at)
        st_files = st_folder.find_folder(name_or_path, revision=revision)  # once: for a hub name, a fetch of its files
        folder_pooling = own_pooling(name_or_path, st_files) if pooling is None else None
        pooling = folder_pooling[0] if folder_pooling else pooling
        if is_decoder is None:
            is_decoder = is_decoder_config(config)
        tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code,
                                                                    **at), is_decoder)
        if own_lowercasing(st_files):
            lowercase_first(tokenizer)
        kwargs = {"dtype": dtype} if dtype is not None else {}
        backbone = AutoModel.from_pretrained(name_or_path, trust_remote_code=trust_remote_code, **kwargs, **at)
    if lora_path is not None:
        backbone = attach_adapter(backbone, lora_path, dropout=lora_dropout)
        lora = None  # the adapter is already attached
    encoder = wrap_backbone(backbone, pooling=pooling, pad_token_id=tokenizer.pad_token_id, is_decoder=is_decoder,
                            lora=lora, gradient_checkpointing=gradient_checkpointing, autocast=autocast,
                            bidirectional=bidirectional)
    if folder_pooling:
        encoder.pooling_source = f"the model folder's {folder_pooling[1]}"
    encoder.st_files = st_files
    encoder.revision = revision
    return encoder.to(device), tokenizer
