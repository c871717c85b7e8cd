"""`--objective arccse`: ArcCSE's unsupervised training from raw sentences (Zhang et al., ACL 2022).

Every sentence is embedded five times, the rows of a batch of n sentences laid out in five blocks of n:

    h1, h2    the sentence twice, with dropout: independent masks make the two views of ArcCon's positive pair
    anchor    the sentence, dropout off
    weak      a copy with a contiguous span of --mask-rates[0] (20%) of its tokens replaced by the mask token
    strong    a copy with a span of --mask-rates[1] (40%) masked; both triplet copies with dropout off

and the loss is angle_kernels.ArcCSELoss: ArcCon (additive angular margin, in-batch negatives: the other
sentences' second views, across every process) + lambda * the triplet loss, which asks cos(anchor, weak) to
exceed cos(anchor, strong). Batch.dropout_rows tells the steps (plain or gradient cache, whose RNG replay
reproduces both views exactly) to embed the last three blocks in eval mode. With --triplet-w 0 (ArcCon alone) a batch
is the two views' blocks only: the three triplet blocks would be embedded for a term that weighs nothing.

Masks are drawn once, when the sentences are tokenised, from a generator seeded by (seed, sentence index): the
same on every process, in every epoch and after a resume. The span covers round(rate x n) of the sentence's n
tokens (special tokens excluded), anywhere in it; a sentence too short for a rate (the span would be 0 tokens)
keeps its tokens for that copy, and setup reports how many there are.
"""

from __future__ import annotations

import math
import os
import random

import torch

from .data import (
    Batch,
    DataError,
    Prompts,
    TokenRows,
    prompted_texts,
    gather_token_rows,
    share_of,
    check_read_columns_once,
    check_text,
    DELIMITED_SUFFIXES,
    JSONL_SUFFIXES,
    delimited_rows,
    delimiter_of,
    has_suffix,
    first_line_is_stsb,
    jsonl_rows,
    open_hf_dataset,
    open_text,
    cut_note,
    read_stsb,
    shows_nothing,
    tokenize_in_chunks,
)

# ------------------------------------------------------------------------------------------------ reading


TEXT_COLUMN = "text"  # --text-column's default


def refuse_column(column: str | None, source_has_none: str) -> None:
    """A DataError naming --text-column where a column was named (not None) for a source that has no columns,
    `source_has_none` saying which: the column would be ignored, and the run trained on what it did not name."""
    if column is not None:
        raise DataError(f"--text-column {column}: {source_has_none}, with no column to choose; leave out "
                        "--text-column")


def load_sentences(source: str, *, column: str | None = None, split: str = "train", split_flag: str = "split",
                   split_default: str = "train") -> tuple[list[str], int]:
    """(sentences, blank lines skipped) from a .txt file (one sentence per line), a .jsonl/.csv/.tsv file's
    `column`, a Hugging Face dataset's (a save_to_disk folder or a hub name), or an STS Benchmark file (the distinct
    sentences of its pairs, labels unused). `column` None reads TEXT_COLUMN; a column named for a .txt or STS-B
    file, which have none, is a DataError (refuse_column). A blank line of a .txt file (or one of invisible
    characters alone, data.shows_nothing) is a separator, not a sentence (counted); an empty or missing text anywhere
    else is a DataError. `split`, `split_flag`, `split_default`: a Hugging Face dataset's split, as
    data.open_hf_dataset's."""
    named = TEXT_COLUMN if column is None else column  # the column read where the source has columns
    if os.path.isfile(source):
        if first_line_is_stsb(source):
            refuse_column(column, f"{source} is an STS Benchmark file, whose pairs' texts are the sentences")
            sentences, skipped = list(dict.fromkeys(t for ex in read_stsb(source) for t in ex.texts)), 0
        elif has_suffix(source, ".txt"):
            refuse_column(column, f"{source} is a .txt file of one sentence a line")
            with open_text(source) as f:
                lines = [line.rstrip("\n").rstrip("\r") for line in f]
            sentences = [line for line in lines if not shows_nothing(line)]  # a line that looks blank is one
            skipped = len(lines) - len(sentences)
        elif has_suffix(source, JSONL_SUFFIXES):
            sentences, skipped = _jsonl_column(source, named), 0
        elif has_suffix(source, DELIMITED_SUFFIXES):
            sentences, skipped = _delimited_column(source, named), 0
        else:
            raise DataError(f"{source}: unknown file type for sentences; use .txt, .jsonl, .csv or .tsv")
    else:
        sentences, skipped = _dataset_column(source, named, split, split_flag=split_flag,
                                             split_default=split_default), 0
    if not sentences:
        raise DataError(f"{source}: no sentences")
    return sentences, skipped


def _jsonl_column(path: str, column: str) -> list[str]:
    sentences = []
    for where, row in jsonl_rows(path):
        if column not in row:
            raise DataError(f"{where}: no {column!r} field (--text-column); has {sorted(row)}")
        sentences.append(check_text(row[column], where, column))
    return sentences


def _delimited_column(path: str, column: str) -> list[str]:
    def check_header(fieldnames):
        if column not in fieldnames:
            raise DataError(f"{path}, line 1 (header): no column {column!r} (--text-column); has {fieldnames}")
        check_read_columns_once(fieldnames, [column], f"{path}, line 1 (header)")

    rows = delimited_rows(path, delimiter_of(path), check_header)
    return [check_text(row[column], where, column) for where, row in rows]


def _dataset_column(name_or_path: str, column: str, split: str, *, split_flag: str, split_default: str
                    ) -> list[str]:
    dataset = open_hf_dataset(name_or_path, split, split_flag=split_flag, split_default=split_default)
    if column not in dataset.column_names:
        raise DataError(f"{name_or_path} [{split}]: no column {column!r} (--text-column); has {dataset.column_names}")
    return [check_text(value, f"{name_or_path} [{split}], row {i}", column)
            for i, value in enumerate(dataset[column])]


# ------------------------------------------------------------------------------------------------ masking


def span_length(n_tokens: int, rate: float) -> int:
    """Tokens a span of `rate` covers in a sentence of n_tokens: rate x n rounded half up."""
    return math.floor(rate * n_tokens + 0.5)


def mask_span(ids: list[int], maskable: range, rate: float, mask_id: int, rng: random.Random) -> list[int]:
    """A copy of `ids` whose tokens in one contiguous span of span_length(len(maskable), rate) positions, placed
    uniformly inside `maskable`, are mask_id (no span: the copy is unchanged)."""
    k = span_length(len(maskable), rate)
    out = list(ids)
    if k == 0:
        return out
    start = maskable.start + rng.randrange(len(maskable) - k + 1)
    out[start:start + k] = [mask_id] * k
    return out


def prompt_words(template: str | None) -> tuple[str, str] | None:
    """(the prompt's words before the sentence, after it) of a template (data.apply_prompt's), None where none are
    around it: no prompt, '{text}' alone, or '{text}' twice (whose copies are the whole text)."""
    if not template:
        return None
    head, found, tail = template.partition("{text}")
    if not found:  # a prefix
        return template, ""
    if "{text}" in tail or not (head or tail):
        return None
    return head, tail


def sentence_chars(prompted: str, template: str | None) -> tuple[int, int]:
    """(first, end) characters of the sentence inside its prompted text: between the prompt's words (prompt_words);
    the whole text where there are none."""
    words = prompt_words(template)
    return (0, len(prompted)) if words is None else (len(words[0]), len(prompted) - len(words[1]))


def maskable_positions(special: list[int], offsets: list[tuple[int, int]] | None, chars: tuple[int, int],
                       trim: tuple[int, int] = (0, 0)) -> range:
    """The token positions a span may cover: from the first to the last of the sentence's own tokens, never a special
    token or the prompt's. With `offsets` (a fast tokenizer's character spans), the tokens inside the sentence's
    characters `chars`; without, the words (non-special tokens) less `trim`: the prompt's token counts before and
    after the text, counted apart (a slow tokenizer has no offsets)."""
    words = [j for j, flag in enumerate(special) if not flag
             and (offsets is None or chars[0] <= offsets[j][0] and offsets[j][1] <= chars[1])]
    if offsets is None:
        words = words[trim[0]:len(words) - trim[1]]
    return range(words[0], words[-1] + 1) if words else range(0)


# ------------------------------------------------------------------------------------------------ dataset

BLOCKS = 5  # h1, h2, anchor, weak, strong
ARCCON_BLOCKS = 2  # h1, h2: a triplet weight of 0 (ArcCon alone) embeds no triplet


def blocks_of(triplet_weight: float) -> int:
    """The blocks of a batch: five, or ArcCon's two where the triplet term weighs 0 (its three blocks were embedded
    and thrown away: 2.5x the encoder's work)."""
    return BLOCKS if triplet_weight != 0 else ARCCON_BLOCKS


class TokenizedSentences:
    """Sentences tokenised once, each with its two masked copies (module docstring); batches in the five-block
    layout, or the two views alone (`blocks` = ARCCON_BLOCKS). The interface the trainer uses is TokenizedPairs's."""

    def __init__(self, sentences: list[str], tokenizer, *, max_length: int, mask_rates: tuple[float, float],
                 seed: int, prompt: str | Prompts | None = None, processes=None, blocks: int = BLOCKS):
        """processes (a distributed.DistInfo, every process calling with the same sentences): each process
        tokenises and masks its share of the sentences and the shares are gathered (TokenizedPairs). blocks: the
        rows of a sentence in a batch (blocks_of)."""
        if blocks not in (BLOCKS, ARCCON_BLOCKS):
            raise ValueError(f"blocks must be {BLOCKS} or {ARCCON_BLOCKS}, got {blocks!r}")
        self.blocks = blocks
        if tokenizer.mask_token_id is None:
            raise ValueError("--objective arccse masks tokens with the tokenizer's mask token, and this tokenizer has "
                             "none (decoder LMs usually do not): train ArcCSE with a masked-LM encoder (BERT, "
                             "RoBERTa, MiniLM...)")
        template = Prompts.coerce(prompt).for_role("text")
        share = share_of(len(sentences), processes)
        texts, prompt_cut = prompted_texts(sentences[share.start:share.stop], template, tokenizer, max_length)
        ids_rows, weak_rows, strong_rows = TokenRows(), TokenRows(), TokenRows()  # 4 bytes a token (TokenRows)
        too_short = [0, 0]  # sentences whose span at each rate is 0 tokens
        # A prompt's words are not the sentence's: the spans cover the sentence's tokens only, found by the
        # tokenizer's character offsets (fast tokenizers) or by the prompt's own token counts (slow ones).
        around = prompt_words(template)
        offsets_too = around is not None and getattr(tokenizer, "is_fast", False)
        trim = (0, 0)
        if around is not None and not offsets_too:
            trim = tuple(len(tokenizer(part, add_special_tokens=False)["input_ids"]) if part else 0
                         for part in around)
        reaching = torch.zeros(len(texts), dtype=torch.bool)  # the sentences cut by truncation
        for chunk, specials, offsets, cut in tokenize_in_chunks(texts, tokenizer, special_tokens_mask=True,
                                                                offsets=offsets_too, truncation=True,
                                                                max_length=max_length, add_special_tokens=True):
            reaching[len(ids_rows):len(ids_rows) + len(chunk)] = torch.tensor(cut, dtype=torch.bool)
            copies = []  # (weak, strong) of each sentence of the chunk
            for k, (ids, special) in enumerate(zip(chunk, specials)):
                row = len(ids_rows) + len(copies)  # its index in this process's share (and in `texts`)
                maskable = maskable_positions(special, None if offsets is None else offsets[k],
                                              sentence_chars(texts[row], template), trim)
                sentence = share.start + row  # its index in `sentences`: the masks' seed
                rng = random.Random(f"arccse-masks:{seed}:{sentence}")
                copies.append([mask_span(ids, maskable, rate, tokenizer.mask_token_id, rng) for rate in mask_rates])
                for i, rate in enumerate(mask_rates):
                    too_short[i] += span_length(len(maskable), rate) == 0
            ids_rows.extend(chunk)
            weak_rows.extend(weak for weak, _ in copies)
            strong_rows.extend(strong for _, strong in copies)
        # the sentences cut: by the prompt's room (a decoded cut may come back shorter) or by truncation
        reaching[prompt_cut] = True
        # gathered with the rows: one row of three counts per process
        counts = TokenRows([too_short + [int(reaching.sum())]])
        self.ids, self.weak, self.strong, counts = gather_token_rows([ids_rows, weak_rows, strong_rows, counts],
                                                                     processes)
        self.too_short = [sum(each[i] for each in counts) for i in range(2)]
        self._lengths = self.ids.length_tensor()
        self.lengths = self._lengths.tolist()
        self.cut = cut_note(sum(each[2] for each in counts), len(self.lengths), max_length)
        self.mask_rates = tuple(mask_rates)

    def __len__(self) -> int:
        return len(self.ids)

    def describe(self) -> str:
        if self.blocks == ARCCON_BLOCKS:
            return f"{len(self):,} sentences (ArcCon alone, the triplet weight 0: no masked copy embedded{self.cut})"
        rates = " / ".join(f"{r:.0%}" for r in self.mask_rates)
        return (f"{len(self):,} sentences (ArcCSE: spans of {rates} masked; {self.too_short[0]:,} / "
                f"{self.too_short[1]:,} too short to mask at those rates keep their tokens{self.cut})")

    def lengths_of(self, indices: list[int]) -> list[int]:
        """Real (unpadded) token counts of the rows `batch(indices)` makes, in its order (block by block; a masked view
        keeps its sentence's length)."""
        return self._lengths[torch.as_tensor(indices, dtype=torch.long)].repeat(self.blocks).tolist()

    def batch(self, indices: list[int]) -> Batch:
        views = self.ids.take(indices)
        blocks = [views, views] if self.blocks == ARCCON_BLOCKS else [
            views, views, views, self.weak.take(indices), self.strong.take(indices)]
        seqs = TokenRows.concat(blocks)
        return Batch(seqs, torch.ones(len(seqs)), dropout_rows=2 * len(indices))


# ------------------------------------------------------------------------------------------------ loss


class ArcCSEObjective:
    """loss_fn(labels, embeddings) for the trainer: the gathered embeddings are every process's five blocks in
    rank order; ArcCSELoss gets each block joined over the processes (so every sentence's negatives are the other
    sentences' second views on all of them). The labels are unused (all ones)."""

    def __init__(self, loss, world_size: int, blocks: int = BLOCKS):
        self.loss, self.world_size, self.blocks = loss, world_size, blocks

    def __call__(self, labels: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        if embeddings.dim() != 2 or embeddings.shape[0] % (self.blocks * self.world_size):
            raise ValueError(f"ArcCSE embeddings must be [rows, D] with rows a multiple of {self.blocks} x processes "
                             f"({self.world_size}); got {tuple(embeddings.shape)}")
        blocks = embeddings.unflatten(0, (self.world_size, self.blocks, -1))  # [processes, block, n, D]
        return self.loss(*(blocks[:, k].flatten(0, 1) for k in range(self.blocks)))  # h1, h2[, anchor, weak, strong]
