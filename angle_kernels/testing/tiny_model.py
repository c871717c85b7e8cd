"""A tiny BERT sentence encoder built offline (no downloads): a word-level tokenizer made from a fixed word
list, a 1-layer BERT from a config, wrapped as a SentenceTransformer (Transformer + mean Pooling).

Dropout is 0 so that two forward passes over the same batch give the same embeddings: the tests compare
two losses on the same model and batch, value and parameter gradients.
"""

from __future__ import annotations

from pathlib import Path

import torch

SENTENCES = [
    "a man is playing a guitar", "a man plays the guitar on stage", "a woman is slicing an onion",
    "someone cuts an onion in the kitchen", "the cat sleeps on the sofa", "a dog runs across the park",
    "two kids are playing football", "children kick a ball outside", "the sun sets over the sea",
    "a plane lands at the airport", "the chef cooks pasta", "a bird sings in the tree",
    "people walk along the beach", "a train leaves the station", "the girl reads a book",
    "a boy rides a bicycle", "heavy rain falls on the city", "the market is full of fruit",
    "an old man feeds the pigeons", "the baby laughs at the puppy", "a woman paints a portrait",
    "the team celebrates the win", "snow covers the mountain road", "a student writes on the board",
]

SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
HIDDEN = 32


def build_tiny_model_dir(directory: Path, seed: int = 0, layers: int = 1) -> Path:
    """Write a tiny BERT of `layers` layers and its tokenizer to `directory` (loadable with from_pretrained) and
    return it."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    words = sorted({w for s in SENTENCES for w in s.split()})
    vocab = {token: i for i, token in enumerate(SPECIAL + words)}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    tokenizer.normalizer = normalizers.Lowercase()
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]", pad_token="[PAD]",
                                   cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]", model_max_length=32)
    config = BertConfig(vocab_size=len(vocab), hidden_size=HIDDEN, num_hidden_layers=layers, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=40, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    torch.manual_seed(seed)
    model = BertModel(config)
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory)
    fast.save_pretrained(directory)
    return directory


def load_sentence_transformer(directory: Path):
    """The tiny BERT as a SentenceTransformer (mean pooling), on CPU."""
    from sentence_transformers import SentenceTransformer

    try:
        from sentence_transformers.base.modules.transformer import Transformer
        from sentence_transformers.sentence_transformer.modules.pooling import Pooling
    except ImportError:  # older layout
        from sentence_transformers.models import Pooling, Transformer

    transformer = Transformer(str(directory), max_seq_length=32)
    pooling = Pooling(HIDDEN, "mean")
    return SentenceTransformer(modules=[transformer, pooling], device="cpu")
