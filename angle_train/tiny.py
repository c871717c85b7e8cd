"""Built-in tiny models, tokenizer and dataset: everything the demo and the tests need, made offline.

    builtin:tiny-bert    a 2-layer BERT (hidden 64) built from a config, random weights
    builtin:tiny-llama   a 2-layer LLaMA (hidden 64, grouped-query attention), random weights
    builtin:demo         ~1,000 synthetic (query, positive) pairs, format B: "a small red car" should find
                         "the car is red and small" among the other positives of its batch
    builtin:demo-sts     256 synthetic scored pairs, format A: the label (0-5) grows with the attributes (size,
                         colour, noun) two phrases share

The tokenizer is a word-level WordPiece vocabulary over the demo's words plus BERT's special tokens.
"""

from __future__ import annotations

import itertools
import random

from .data import Example

BUILTIN_MODELS = ("builtin:tiny-bert", "builtin:tiny-llama")
BUILTIN_DATASETS = ("builtin:demo", "builtin:demo-sts")

COLORS = ["red", "green", "blue", "yellow", "black", "white", "orange", "purple", "brown", "pink", "grey", "golden"]
SIZES = ["small", "big", "tiny", "huge", "long", "short"]
NOUNS = [
    "car",
    "boat",
    "house",
    "tree",
    "dog",
    "cat",
    "bird",
    "chair",
    "table",
    "lamp",
    "phone",
    "book",
    "cup",
    "hat",
    "shoe",
    "ball",
    "door",
    "bike",
    "train",
    "plane",
    "horse",
    "fish",
    "apple",
    "bottle",
    "clock",
    "kite",
    "box",
    "bag",
    "coat",
    "ring",
]
GLUE = ["a", "the", "is", "and", "it", "was", "very", "not"]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]


def build_tokenizer(words=None, *, padding_side: str = "right"):
    """A fast WordPiece tokenizer over `words` (default: the demo vocabulary), [CLS] text [SEP] framing."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = list(dict.fromkeys(words or (GLUE + COLORS + SIZES + NOUNS)))
    vocab = {tok: i for i, tok in enumerate(SPECIAL + words)}
    tok = Tokenizer(models.WordPiece(vocab=vocab, unk_token="[UNK]", max_input_chars_per_word=100))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B [SEP]",
        special_tokens=[("[CLS]", vocab["[CLS]"]), ("[SEP]", vocab["[SEP]"])],
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
        eos_token="[SEP]",
        bos_token="[CLS]",
        padding_side=padding_side,
        model_max_length=512,
    )


def build_backbone(
    name: str, vocab_size: int, *, hidden_size: int = 64, layers: int = 2, dropout: float = 0.1, seed: int = 0
):
    """A randomly initialised base model (no head) of the named built-in architecture."""
    import torch
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaModel
    from transformers.models.bert.modeling_bert import BertPooler

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "builtin:tiny-bert":
            config = BertConfig(
                vocab_size=vocab_size,
                hidden_size=hidden_size,
                num_hidden_layers=layers,
                num_attention_heads=4,
                intermediate_size=2 * hidden_size,
                max_position_embeddings=128,
                hidden_dropout_prob=dropout,
                attention_probs_dropout_prob=dropout,
                pad_token_id=0,
            )
            model = BertModel(config, add_pooling_layer=False)
            # BERT's pooler, which the Encoder sets aside (models.wrap_backbone) and the exports keep: they then load
            # in transformers and sentence-transformers with every weight BertModel has. Drawn after every other
            # weight, which stay as they were without it.
            model.pooler = BertPooler(config)
            return model
        if name == "builtin:tiny-llama":
            config = LlamaConfig(
                vocab_size=vocab_size,
                hidden_size=hidden_size,
                intermediate_size=2 * hidden_size,
                num_hidden_layers=layers,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=128,
                attention_dropout=dropout,
                pad_token_id=0,
                bos_token_id=2,
                eos_token_id=3,
            )
            return LlamaModel(config)
    raise ValueError(f"unknown built-in model {name!r}; choose from {BUILTIN_MODELS}")


def demo_examples(n: int = 1024, seed: int = 0) -> list[Example]:
    """Format B pairs: (adjectives + noun) -> the same facts said another way."""
    rng = random.Random(seed)
    combos = list(itertools.product(SIZES, COLORS, NOUNS))
    rng.shuffle(combos)
    out = []
    for size, color, noun in combos[:n]:
        query = f"a {size} {color} {noun}"
        positive = rng.choice(
            [
                f"the {noun} is {color} and {size}",
                f"it was a {color} {noun} , very {size}",
                f"the {size} {noun} is {color}",
            ]
        )
        out.append(Example((query, positive)))
    return out


def demo_sts_examples(n: int = 256, seed: int = 1) -> list[Example]:
    """Format A pairs with a graded label in [0, 5]: how many of (size, color, noun) two phrases share."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a = (rng.choice(SIZES), rng.choice(COLORS), rng.choice(NOUNS))
        b = tuple(x if rng.random() < 0.5 else rng.choice(pool) for x, pool in zip(a, (SIZES, COLORS, NOUNS)))
        shared = sum(x == y for x, y in zip(a, b))
        out.append(Example((f"a {a[0]} {a[1]} {a[2]}", f"the {b[2]} is {b[1]} and {b[0]}"), 5.0 * shared / 3))
    return out


def builtin_examples(name: str):
    """(examples, format) for a built-in dataset name."""
    if name == "builtin:demo":
        return demo_examples(), "B"
    if name == "builtin:demo-sts":
        return demo_sts_examples(), "A"
    raise ValueError(f"unknown built-in dataset {name!r}; choose from {BUILTIN_DATASETS}")
