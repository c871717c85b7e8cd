"""Large-batch LoRA training of a 7B LLaMA-architecture model on one GPU: plain backprop vs gradient cache.

What it measures (random initialisation, bf16 weights and autocast, LoRA r=32 on every linear layer,
sequences of 64 tokens, AnglE's default objective on format-A pairs: in-batch negatives + angle term, computed
by angle_kernels over the whole optimizer-step batch):
  plain       one forward/backward over the whole batch: the batch doubles from --plain-start pairs until it
              runs out of memory -> the largest plain batch, its pairs/s and peak memory
  grad cache  the batch embedded in chunks of --chunk-size texts without a graph, loss on all embeddings, then
              re-embedded chunk by chunk with the cached gradients -> pairs/s and peak memory per batch size
              (--gc-batches), the largest that fits, and the overhead against the best plain throughput
Each setting runs one warm-up optimizer step and --steps timed ones (CUDA events). Results: DIR/results.json
and DIR/results.md (GPU, driver, torch, triton versions and the command line included).

    python bench/train_llama_7b.py --out bench/results/llama7b-h200
    python bench/train_llama_7b.py --out /tmp/smoke --tiny        # a 2-layer model: checks the script on CPU

Issue target: >= 32,768 pairs per optimizer step with <= 25% throughput overhead versus plain small batches.
A 7B optimizer step over 32,768 pairs takes minutes (~3.4 TFLOP per pair for two 64-token texts, forward
only); --time-limit stops raising the batch once one step would exceed it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

LLAMA_7B = {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 1000,
    "max_position_embeddings": 256,
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="folder for results.json and results.md")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (runs on CPU): smoke-test the script")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per text (default 64)")
    p.add_argument("--lora-r", type=int, default=32, help="LoRA rank (default 32; alpha = 2r)")
    p.add_argument("--plain-start", type=int, default=16, help="first plain batch in pairs; doubled until OOM")
    p.add_argument("--plain-max", type=int, default=65536, help="stop doubling the plain batch here")
    p.add_argument(
        "--chunk-size",
        type=int,
        default=0,
        help="texts per gradient-cache chunk (0: the rows of the largest plain batch that fit)",
    )
    p.add_argument(
        "--gc-batches",
        default="1024,4096,16384,32768,65536",
        help="gradient-cache batch sizes in pairs, comma-separated",
    )
    p.add_argument("--steps", type=int, default=1, help="timed optimizer steps per setting (after one warm-up)")
    p.add_argument(
        "--time-limit",
        type=float,
        default=420.0,
        help="skip a batch size whose estimated step time exceeds this many seconds",
    )
    p.add_argument("--loss-impl", default="angle_kernels", choices=["angle_kernels", "reference"])
    return p.parse_args(argv)


def build(args, device):
    import torch
    from transformers import LlamaConfig, LlamaModel

    from angle_train.models import LoraSettings, wrap_backbone

    config = LlamaConfig(
        **(TINY if args.tiny else LLAMA_7B), pad_token_id=0, bos_token_id=1, eos_token_id=2, attention_dropout=0.0
    )
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)  # build the weights directly in bf16 on the GPU: no fp32 copy of 7B
    try:
        with torch.device(device):
            backbone = LlamaModel(config)
    finally:
        torch.set_default_dtype(previous)
    encoder = wrap_backbone(
        backbone,
        pooling="last",
        pad_token_id=0,
        is_decoder=True,
        lora=LoraSettings(r=args.lora_r, alpha=2 * args.lora_r, dropout=0.0),
        autocast="bf16" if device.type == "cuda" else None,
    )
    return encoder.to(device), config


def random_batch(pairs: int, args, vocab: int, device, generator):
    import torch

    ids = torch.randint(3, vocab, (2 * pairs, args.seq_len), generator=generator).to(device)
    mask = torch.ones_like(ids)
    labels = torch.ones(2 * pairs, device=device)
    return ids, mask, labels


def one_step(encoder, optimizer, loss_fn, ids, mask, labels, chunk_rows: int | None):
    from angle_train.grad_cache import grad_cache_step, plain_step

    if chunk_rows:
        chunks = [(ids[i : i + chunk_rows], mask[i : i + chunk_rows]) for i in range(0, len(ids), chunk_rows)]
        loss = grad_cache_step(encoder, chunks, labels, loss_fn)
    else:
        loss = plain_step(encoder, [(ids, mask)], labels, loss_fn)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss)


def _print_row(label: str, pairs: int, row: dict | None) -> None:
    """One line of the sweep: throughput, step time and peak memory, or that the batch did not fit."""
    if row is None:
        result = "out of memory"
    else:
        result = f"{row['pairs_per_s']:9.1f} pairs/s  {row['step_s']:7.2f} s/step  peak {row['peak_gb']:6.1f} GB"
    print(f"{label} {pairs:>7} pairs: {result}", flush=True)


def measure(encoder, optimizer, loss_fn, pairs, args, vocab, device, chunk_rows):
    """(pairs/s, seconds per step, peak GB) for one setting, or None when it runs out of memory."""
    import torch

    gen = torch.Generator().manual_seed(pairs)
    cuda = device.type == "cuda"
    try:
        ids, mask, labels = random_batch(pairs, args, vocab, device, gen)
        one_step(encoder, optimizer, loss_fn, ids, mask, labels, chunk_rows)  # warm-up
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.steps):
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                loss = one_step(encoder, optimizer, loss_fn, ids, mask, labels, chunk_rows)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end) / 1000)
            else:
                t = time.perf_counter()
                loss = one_step(encoder, optimizer, loss_fn, ids, mask, labels, chunk_rows)
                times.append(time.perf_counter() - t)
        seconds = sorted(times)[len(times) // 2]
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        return {
            "pairs": pairs,
            "pairs_per_s": pairs / seconds,
            "tokens_per_s": 2 * pairs * args.seq_len / seconds,
            "step_s": seconds,
            "peak_gb": peak,
            "loss": loss,
        }
    except torch.cuda.OutOfMemoryError:
        return None
    finally:
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.empty_cache()


def environment(device) -> dict:
    import torch

    env = {"torch": torch.__version__, "python": platform.python_version(), "command": " ".join(sys.argv)}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name()
        try:
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                check=False,
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    return env


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    from angle_train.objective import LossWeights, build_loss

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.tiny:
        print("no GPU: the 7B benchmark needs one (use --tiny for a CPU smoke test)")
        return 2
    os.makedirs(args.out, exist_ok=True)
    encoder, config = build(args, device)
    trainable = sum(p.numel() for p in encoder.parameters() if p.requires_grad)
    total = sum(p.numel() for p in encoder.parameters())
    print(
        f"model: {total / 1e9:.2f} B parameters, {trainable / 1e6:.1f} M trainable (LoRA r={args.lora_r})", flush=True
    )
    optimizer = torch.optim.AdamW(
        [p for p in encoder.parameters() if p.requires_grad], lr=1e-4, fused=device.type == "cuda" or None
    )
    loss_fn, impl = build_loss(LossWeights(), "A", args.loss_impl)
    results = {
        "environment": environment(device),
        "model": {"parameters": total, "trainable": trainable, "config": {k: getattr(config, k) for k in LLAMA_7B}},
        "seq_len": args.seq_len,
        "lora_r": args.lora_r,
        "loss": impl,
        "plain": [],
        "grad_cache": [],
    }

    pairs = args.plain_start
    while pairs <= args.plain_max:
        row = measure(encoder, optimizer, loss_fn, pairs, args, config.vocab_size, device, None)
        _print_row("plain     ", pairs, row)
        if row is None:
            break
        results["plain"].append(row)
        if row["step_s"] * 2 > args.time_limit:
            break
        pairs *= 2
    best_plain = max(results["plain"], key=lambda r: r["pairs_per_s"]) if results["plain"] else None
    largest_plain = results["plain"][-1]["pairs"] if results["plain"] else 0
    chunk_rows = args.chunk_size or max(2, largest_plain)  # half the rows of the largest plain batch
    results["chunk_rows"] = chunk_rows

    for pairs in [int(x) for x in args.gc_batches.split(",") if x.strip()]:
        if best_plain and pairs / best_plain["pairs_per_s"] * 1.5 > args.time_limit:
            print(f"grad cache {pairs:>7} pairs: skipped (estimated step time above --time-limit)", flush=True)
            continue
        row = measure(encoder, optimizer, loss_fn, pairs, args, config.vocab_size, device, chunk_rows)
        _print_row("grad cache", pairs, row)
        if row is None:
            break
        if best_plain:
            row["overhead_vs_best_plain"] = 1 - row["pairs_per_s"] / best_plain["pairs_per_s"]
        results["grad_cache"].append(row)

    results["largest_plain_batch"] = largest_plain
    results["largest_grad_cache_batch"] = results["grad_cache"][-1]["pairs"] if results["grad_cache"] else 0
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    lines = [
        f"# LoRA r={args.lora_r} on a {total / 1e9:.1f}B LLaMA, seq len {args.seq_len}, loss {impl}",
        "",
        "```",
        json.dumps(results["environment"], indent=1),
        "```",
        "",
        "| mode | pairs/step | pairs/s | tokens/s | s/step | peak GB | overhead vs best plain |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, rows in (("plain", results["plain"]), (f"grad cache ({chunk_rows} texts/chunk)", results["grad_cache"])):
        for r in rows:
            overhead = r.get("overhead_vs_best_plain")
            lines.append(
                f"| {mode} | {r['pairs']} | {r['pairs_per_s']:.1f} | {r['tokens_per_s']:.0f} | "
                f"{r['step_s']:.2f} | {r['peak_gb']:.1f} | "
                f"{'' if overhead is None else f'{100 * overhead:.1f}%'} |"
            )
    table = "\n".join(lines) + "\n"
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write(table)
    print("\n" + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
