"""`python -m angle_train.demo`: train a tiny BERT on the built-in synthetic pairs and watch the loss fall.

No download, no GPU: the model (2 layers, hidden 64) is built from a config with random weights and the
data are ~1,000 generated (query, positive) pairs such as ("a small red car", "the car is red and small"),
trained with AnglE's in-batch-negative objective (format B). Runs in well under a minute on 2 idle CPU cores.
Pass any angle-train flag to change it, e.g. `python -m angle_train.demo --model builtin:tiny-llama`.
"""

from __future__ import annotations

import sys
import tempfile

from .cli import build_parser, config_from_args
from .cli_common import check_train_extra, user_errors_exit

DEMO_DEFAULTS = ["--model", "builtin:tiny-bert", "--train-data", "builtin:demo", "--batch-size", "64", "--epochs",
                 "2", "--lr", "3e-3", "--warmup", "0.1", "--max-length", "16", "--log-every", "8", "--pooling",
                 "avg", "--save-final", "0", "--device", "cpu"]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # without the train extra: angle-train's one line naming it (status 2), not an import's traceback
    with user_errors_exit(build_parser(), debug="--debug" in argv):
        check_train_extra()
        from .evaluate import sts_spearman
        from .tiny import demo_sts_examples
        from .trainer import train
    with tempfile.TemporaryDirectory() as tmp:
        cfg = config_from_args(DEMO_DEFAULTS + ["--output-dir", tmp] + argv)
        result = train(cfg)
    losses = [row["loss"] for row in result.history]
    k = max(1, len(losses) // 10)
    print("loss, averaged over tenths of the run: " + " ".join(f"{sum(losses[i:i + k]) / len(losses[i:i + k]):.3f}"
                                                              for i in range(0, len(losses), k)))
    last = result.history[-1]
    print(f"throughput (last {cfg.log_every} steps): {last['pairs_per_s']:.0f} pairs/s, "
          f"{last['tokens_per_s']:.0f} tokens/s, peak memory {last['peak_mem_gb']:.2f} GiB")
    rho = sts_spearman(result.encoder, result.tokenizer, demo_sts_examples(), max_length=cfg.max_length)
    print(f"Spearman on built-in graded pairs (shared attributes, 0-5): {rho:.3f}")
    first, final = sum(losses[:k]) / k, sum(losses[-k:]) / k
    print("the loss fell" if final < first else "WARNING: the loss did not fall", f"({first:.3f} -> {final:.3f})")
    return 0 if final < first else 1


if __name__ == "__main__":
    sys.exit(main())
