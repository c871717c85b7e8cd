#!/usr/bin/env python
"""angle-train's per-step data preparation on the CPU: one batch of PAIRS pairs (format B, 2 texts a pair) cut into
forward passes, their tensors made (padded or packed) and their token counts, as `trainer.prepare_batches` does for
every step, under each way of cutting passes:

    one padded pass              plain backprop (the GPU default)
    chunks of 512 texts          --chunk-size 512
    16,384-token passes          --chunk-tokens 16384 (padding included)
    packed, 16,384-token passes  --chunk-tokens 16384 --pack 128 (real tokens)
    one packed pass              plain backprop with --pack 128 (the CPU default)

On a GPU the trainer makes the next step's passes on a background thread while a step runs (the next epoch's first
step's too), so this time costs a step only where it exceeds the step's device time, and on a run's first step (or a
resumed run's), which has no step before it to make them. The texts are
synthetic token ids of uniformly random lengths (--min-tokens .. --max-tokens, STS-B's range by default), the
batch a random draw of the dataset's examples. Every round times each setting once; the table gives each setting's
median over the rounds, with the fastest and slowest. --checkout DIR times another checkout's angle_train (a
before-and-after comparison: run both, alternating).

    python bench/bench_data_prep.py [--pairs 32768] [--rounds 5] [--threads 1] [--checkout DIR] [--json]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import time

SETTINGS = {
    "one padded pass": {},
    "chunks of 512 texts": {"rows": 512},
    "16,384-token passes": {"tokens": 16384},
    "packed, 16,384-token passes": {"tokens": 16384, "pack_width": 128},
    "one packed pass": {"pack_width": 128},
}


class LengthTokenizer:
    """A tokenizer for texts "LENGTH WORD": LENGTH ids (with [CLS] and [SEP]) derived from the text."""

    def __call__(self, texts, **_options):
        return {"input_ids": [[101] + [1000 + (hash(text) + j) % 20000 for j in range(int(text.split()[0]) - 2)]
                              + [102] for text in texts]}


def make_dataset(pairs: int, min_tokens: int, max_tokens: int, seed: int = 0):
    from angle_train.data import Example, TokenizedPairs

    rng = random.Random(seed)
    examples = [Example(texts=(f"{rng.randint(min_tokens, max_tokens)} query",
                               f"{rng.randint(min_tokens, max_tokens)} document"), label=1.0) for _ in range(pairs)]
    return TokenizedPairs(examples, "B", LengthTokenizer(), max_length=max_tokens)


def measure(pairs: int, rounds: int, min_tokens: int, max_tokens: int) -> dict[str, list[float]]:
    """Seconds of each setting's preparation of one batch, per round."""
    dataset = make_dataset(pairs, min_tokens, max_tokens)
    indices = list(range(pairs))
    random.Random(1).shuffle(indices)
    times = {name: [] for name in SETTINGS}
    for _ in range(rounds):
        for name, options in SETTINGS.items():
            start = time.perf_counter()
            plan = dataset.batch(indices).plan(**options)
            plan.tensors(0, "right")
            plan.token_counts()
            times[name].append(time.perf_counter() - start)
    return times


def table(times: dict[str, list[float]], pairs: int) -> str:
    lines = [f"| {pairs:,} pairs | median s | fastest-slowest s |", "|---|---|---|"]
    for name, each in times.items():
        lines.append(f"| {name} | {statistics.median(each):.3f} | {min(each):.3f}-{max(each):.3f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=32768, help="pairs in the batch (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds, each timing every setting once (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default: %(default)s)")
    parser.add_argument("--min-tokens", type=int, default=8,
                        help="a text's fewest tokens, its two special tokens included (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=52,
                        help="a text's most tokens (default: %(default)s; 8 to 52 is STS-B's range)")
    parser.add_argument("--checkout", help="a checkout whose angle_train to time (its root folder; default: the "
                                           "angle_train this Python imports)")
    parser.add_argument("--json", action="store_true",
                        help="print each setting's times as JSON instead of the table (strict JSON: a time that is not "
                             "finite is null)")
    args = parser.parse_args(argv)
    for name in ("pairs", "rounds", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be a positive integer, got {getattr(args, name)}")
    if not 3 <= args.min_tokens <= args.max_tokens:
        parser.error(f"--min-tokens and --max-tokens: 3 <= min <= max (two special tokens and a word), got "
                     f"{args.min_tokens} and {args.max_tokens}")
    if args.checkout:
        if not os.path.isfile(os.path.join(args.checkout, "angle_train", "data.py")):
            parser.error(f"--checkout: {args.checkout!r} holds no angle_train/data.py")
        if "angle_train" in sys.modules:
            parser.error("--checkout: angle_train is already imported in this process")
        sys.path.insert(0, args.checkout)
    import torch

    torch.set_num_threads(args.threads)
    times = measure(args.pairs, args.rounds, args.min_tokens, args.max_tokens)
    if args.json:
        # bench/'s writer, whichever checkout's angle_train was timed; imported here, after the timing: harness sets
        # OMP_WAIT_POLICY for torch's threads, which these figures were measured without
        import harness

        print(harness.json_text(times, indent=None))
    else:
        print(table(times, args.pairs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
