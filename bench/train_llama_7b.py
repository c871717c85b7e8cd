"""Large-batch LoRA training of a 7B LLaMA-architecture model on one GPU: plain backprop vs gradient cache.

What it measures (random initialisation, bf16 weights and autocast, LoRA r=32 on every linear layer,
sequences of 64 tokens, AnglE's default objective on format-A pairs: in-batch negatives + angle term, computed
by angle_kernels over the whole optimizer-step batch, on embeddings cast to --loss-dtype):
  plain       one forward/backward over the whole batch: the batch doubles from --plain-start pairs until it
              runs out of memory -> the largest plain batch, its pairs/s and peak memory
  grad cache  the batch embedded in chunks of --chunk-size texts without a graph, loss on all embeddings, then
              re-embedded chunk by chunk with the cached gradients -> pairs/s and peak memory per batch size
              (--gc-batches), the largest that fits, and the overhead against the best plain throughput
Each setting runs a warm-up and --steps timed optimizer steps (CUDA events). The plain warm-up is one full
step. The grad-cache warm-up runs every shape the timed step will: one step over a full chunk plus the last
(partial) chunk, and the loss over all the rows (Triton autotunes per row count); a full step at 32k pairs
takes minutes, and two of them would not fit in one 10-minute command.

One invocation runs for at most --time-budget seconds (480 by default, counted from the start, imports and
model build included), then stops between settings; run the same command again to continue. Results are
written after every setting (DIR/results.json and DIR/results.md, with GPU, driver, torch, triton and the
command line), so a command killed mid-setting loses only that setting. A re-run with the same --out skips
what is recorded (measured or out of memory) and refuses results made with other settings (--restart
discards them). Exit status 0 when it ends normally, done or not: the last lines say which.

    python bench/train_llama_7b.py --out bench/results/llama7b-h200      # repeat until it prints "done"
    python bench/train_llama_7b.py --out /tmp/smoke --tiny        # a 2-layer model: checks the script on CPU (a minute)

Issue target: >= 32,768 pairs per optimizer step with <= 25% throughput overhead versus plain small batches.
A 7B grad-cache step over 32,768 pairs takes minutes: ~1.7 TFLOP per pair (two 64-token texts) per forward,
three forwards' worth per pair (two forwards, one backward to the inputs; the LoRA weight gradients are small).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import harness  # first: sets OMP_WAIT_POLICY before torch loads; the atomic writes of the results

from angle_train.evaluate import positive_int  # argparse's type for counts

LLAMA_7B = {
    "hidden_size": 4096,
    "intermediate_size": 11008,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "vocab_size": 32000,
    "max_position_embeddings": 4096,
}
# The ~1B model of issue 28's 32,768-pair step: TinyLlama-1.1B's shape (grouped-query attention, 4 KV heads)
LLAMA_1B = {
    "hidden_size": 2048,
    "intermediate_size": 5632,
    "num_hidden_layers": 22,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "vocab_size": 32000,
    "max_position_embeddings": 2048,
}
MODELS = {"7b": LLAMA_7B, "1b": LLAMA_1B}
TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "vocab_size": 1000,
    "max_position_embeddings": 256,
}
# A grad-cache step costs two forwards and one backward per pair, a plain step one of each; with LoRA the
# backward is about one forward (gradients of the inputs; the adapters' own are small): 3/2 of a plain step.
GRAD_CACHE_COST = 1.5
# Exit statuses. A run that stops inside its budget with settings left exits 0 too: that is its normal end
# (bench/gpu_suite.py treats any other status as a failure); its last lines say what is left.
DONE, ERROR = 0, 2


def now() -> float:
    """The clock of the time budget (a function so the tests can run the budget logic on a fake clock)."""
    return time.monotonic()


# ----------------------------------------------------------------------------------------------- arguments


def chunk_size(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected 0 or a positive even integer, got {text!r}") from None
    # Even: a chunk holds whole pairs, so the warm-up batch (one full chunk + the last chunk) is whole pairs too.
    if value < 0 or value % 2:
        raise argparse.ArgumentTypeError(f"expected 0 or a positive even integer (texts, whole pairs), got {value}")
    return value


def batch_list(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1024,4096, got {text!r}") from None
    # Increasing: the sweep stops at the first batch that runs out of memory, larger ones would too.
    if not values or min(values) < 1 or any(a >= b for a, b in zip(values, values[1:])):
        raise argparse.ArgumentTypeError(f"expected positive integers in increasing order, got {text!r}")
    return values


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}")
    return value


# --plain-max's and --gc-batches' defaults: the 7B (or 1B) model's on a GPU, and --tiny's on a CPU, where a step of
# 64 pairs takes about half a second on 2 cores and one of 8,192 a minute
GPU_BATCHES = {"plain_max": 65536, "gc_batches": [1024, 4096, 16384, 32768, 65536]}
TINY_BATCHES = {"plain_max": 64, "gc_batches": [64, 128]}


def parse_args(argv):
    # allow_abbrev=False: the command printed to continue drops --restart, which an abbreviation would hide.
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    p.add_argument("--out", required=True, help="folder for results.json and results.md (a re-run continues there)")
    p.add_argument("--size", choices=sorted(MODELS), default="7b",
                   help="the model: 7b (LLaMA-2-7B's shape, the default) or 1b (TinyLlama-1.1B's)")
    p.add_argument("--tiny", action="store_true",
                   help="a 2-layer model (runs on CPU): smoke-test the script, at CPU-sized batches where "
                        f"--plain-max and --gc-batches are not given (--plain-max {TINY_BATCHES['plain_max']}, "
                        f"--gc-batches {','.join(map(str, TINY_BATCHES['gc_batches']))})")
    p.add_argument("--seq-len", type=positive_int, default=64, help="tokens per text (default 64)")
    p.add_argument("--lora-r", type=positive_int, default=32, help="LoRA rank (default 32; alpha = 2r)")
    p.add_argument("--plain-start", type=positive_int, default=16, help="first plain batch in pairs; doubled until OOM")
    p.add_argument("--plain-max", type=positive_int, default=None,
                   help="stop doubling the plain batch here (default 65536)")
    p.add_argument(
        "--chunk-size",
        type=chunk_size,
        default=0,
        help="texts per gradient-cache chunk, even (0: as many texts as the largest plain batch has pairs)",
    )
    p.add_argument(
        "--gc-batches",
        type=batch_list,
        default=None,
        help="gradient-cache batch sizes in pairs, comma-separated, increasing (default 1024,4096,16384,32768,65536)",
    )
    p.add_argument("--steps", type=positive_int, default=1, help="timed optimizer steps per setting (default 1)")
    p.add_argument(
        "--time-budget",
        type=positive_seconds,
        default=480.0,
        help="seconds this invocation may run, counted from its start (default 480: one 10-minute command)",
    )
    p.add_argument("--loss-impl", default="angle_kernels", choices=["angle_kernels", "reference"])
    p.add_argument(
        "--loss-dtype",
        choices=["bfloat16", "float32"],
        default=None,
        help="dtype the embeddings are cast to for the loss (default: bfloat16 on CUDA, float32 on CPU)",
    )
    p.add_argument("--restart", action="store_true", help="discard the results already in --out and start over")
    args = p.parse_args(argv)
    # the 7B batches' defaults would have the 2-layer model's CPU run take hours over a dozen invocations
    for flag, value in (TINY_BATCHES if args.tiny else GPU_BATCHES).items():
        if getattr(args, flag) is None:
            setattr(args, flag, value)
    if args.plain_max < args.plain_start:
        p.error(f"--plain-max ({args.plain_max}) is smaller than --plain-start ({args.plain_start})")
    return args


# ------------------------------------------------------------------------------------------ model and steps
def model_config(args) -> dict:
    return TINY if args.tiny else MODELS[args.size]


def build(args, device):
    import torch
    from transformers import LlamaConfig, LlamaModel

    from angle_train.models import LoraSettings, wrap_backbone

    config = LlamaConfig(
        **model_config(args), pad_token_id=0, bos_token_id=1, eos_token_id=2, attention_dropout=0.0
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


def build_loss(impl: str):
    """AnglE's default objective on format-A rows: angle_kernels.AngleLoss, or angle-emb 0.6.1's own AngleLoss
    (eager, N x N; it takes the labels as a column)."""
    if impl == "reference":
        from angle_emb import AngleLoss as ReferenceAngleLoss

        reference = ReferenceAngleLoss(dataset_format="A")
        return lambda labels, embeddings: reference(labels.reshape(-1, 1), embeddings)
    from angle_kernels import AngleLoss

    return AngleLoss(dataset_format="A")


def cast_loss(loss_fn, dtype):
    """The loss on embeddings cast to `dtype`. The Encoder returns float32 embeddings, which on a GPU would take
    the loss's exact-fp32 path; `.to` is differentiable, so the gradient still reaches the float32 embeddings."""

    def loss(labels, embeddings):
        return loss_fn(labels, embeddings.to(dtype))

    return loss


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


def warmup_pairs(pairs: int, chunk_rows: int | None) -> int:
    """Pairs of the warm-up batch: the whole batch for plain steps (every batch size has its own shapes); for
    the gradient cache, one full chunk plus the last chunk, which are all the model shapes of the step."""
    if not chunk_rows or 2 * pairs <= chunk_rows:
        return pairs
    return (chunk_rows + (2 * pairs) % chunk_rows) // 2


def measure(encoder, optimizer, loss_fn, pairs, args, config, device, chunk_rows):
    """(pairs/s, seconds per step, peak GB) for one setting, or None when it runs out of memory."""
    import torch

    gen = torch.Generator().manual_seed(pairs)
    cuda = device.type == "cuda"
    try:
        warm = warmup_pairs(pairs, chunk_rows)
        ids, mask, labels = random_batch(warm, args, config.vocab_size, device, gen)
        one_step(encoder, optimizer, loss_fn, ids, mask, labels, chunk_rows)
        if warm < pairs:  # the loss over all the rows: its first call at a row count autotunes on a GPU
            embeddings = torch.randn(2 * pairs, config.hidden_size, device=device, requires_grad=True)
            loss_fn(torch.ones(2 * pairs, device=device), embeddings).backward()
            del embeddings
        ids, mask, labels = random_batch(pairs, args, config.vocab_size, device, gen)
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
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else None  # None, not NaN: strict JSON
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


def environment(device, command: str) -> dict:
    import torch

    env = {"torch": torch.__version__, "python": platform.python_version(), "command": command}
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


# ------------------------------------------------------------------------------------------ results on disk
def settings_of(args, loss_dtype: str, env: dict) -> dict:
    """Everything a measurement depends on: a resumed run must match it, or its rows would mix two benchmarks.
    (--plain-max, --gc-batches and --time-budget only choose which settings run; they may change.)"""
    return {
        "model_config": model_config(args),
        "seq_len": args.seq_len,
        "lora_r": args.lora_r,
        "loss_impl": args.loss_impl,
        "loss_dtype": loss_dtype,
        "chunk_size": args.chunk_size,
        "plain_start": args.plain_start,
        "steps": args.steps,
        "gpu": env.get("gpu", "cpu"),  # GPU time comes in blocks that may land on an H100 or an H200
        "torch": env["torch"],
        "triton": env["triton"],
    }


def load_results(path: str, settings: dict, restart: bool) -> tuple[dict | None, str | None]:
    """(the stored results to continue, None), (None, None) to start fresh, or (None, why we refuse)."""
    if restart or not os.path.exists(path):
        return None, None
    try:
        with open(path) as f:
            stored = json.load(f)
    except (OSError, ValueError) as exc:
        return None, f"{path} cannot be read ({exc}); use another --out, or --restart to overwrite it"
    old = stored.get("settings") if isinstance(stored, dict) else None
    if old is None:
        return None, f"{path} has no 'settings' (an older version of this script?); use another --out or --restart"
    differences = [f"{k}: {old.get(k)!r} there, {v!r} now" for k, v in settings.items() if old.get(k) != v]
    if differences:
        return None, (
            f"{path} holds results made with other settings ({'; '.join(differences)}). Re-run with the same "
            "settings to continue them, use another --out, or pass --restart to discard them."
        )
    return stored, None


def measured(rows: list[dict]) -> list[dict]:
    return [r for r in rows if not r.get("oom")]


def stored_row(results: dict, mode: str, pairs: int) -> dict | None:
    return next((r for r in results[mode] if r["pairs"] == pairs), None)


def summarise(results: dict) -> None:
    """The numbers derived from the rows; recomputed on every save since a resumed run may add plain rows."""
    plain = measured(results["plain"])
    best = max(plain, key=lambda r: r["pairs_per_s"]) if plain else None
    for r in measured(results["grad_cache"]):
        r["overhead_vs_best_plain"] = 1 - r["pairs_per_s"] / best["pairs_per_s"] if best else None
    results["best_plain_pairs_per_s"] = best["pairs_per_s"] if best else None
    results["largest_plain_batch"] = max((r["pairs"] for r in plain), default=0)
    results["largest_grad_cache_batch"] = max((r["pairs"] for r in measured(results["grad_cache"])), default=0)


def gigabytes(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"  # n/a: no peak-memory counter on CPU


def markdown(results: dict) -> str:
    s = results["settings"]
    params = results.get("model", {}).get("parameters", 0)
    lines = [
        # the --tiny model's few million parameters read "0.0B" in billions
        f"# LoRA r={s['lora_r']} on a {f'{params / 1e9:.1f}B' if params >= 1e8 else f'{params / 1e6:.1f}M'} LLaMA, "
        f"seq len {s['seq_len']}, "
        f"loss {results['loss']} in {s['loss_dtype']}",
        "",
        "```",
        json.dumps(results["environment"], indent=1),
        "```",
        "",
        "| mode | pairs/step | pairs/s | tokens/s | s/step | peak GB | overhead vs best plain |",
        "|---|---|---|---|---|---|---|",
    ]
    chunk = results.get("chunk_rows")
    for mode, label in (("plain", "plain"), ("grad_cache", f"grad cache ({chunk} texts/chunk)")):
        for r in sorted(results[mode], key=lambda r: r["pairs"]):
            if r.get("oom"):
                lines.append(f"| {label} | {r['pairs']} | out of memory | | | | |")
                continue
            overhead = r.get("overhead_vs_best_plain")
            lines.append(
                f"| {label} | {r['pairs']} | {r['pairs_per_s']:.1f} | {r['tokens_per_s']:.0f} | "
                f"{r['step_s']:.2f} | {gigabytes(r['peak_gb'])} | "
                f"{'' if overhead is None else f'{100 * overhead:.1f}%'} |"
            )
    lines += [""] + [f"Not run: {n['setting']}: {n['why']}" for n in results["not_run"]]
    if results["left"]:
        lines.append(f"Not measured yet: {', '.join(results['left'])}")
    return "\n".join(lines) + "\n"


def save(out: str, results: dict) -> None:
    summarise(results)
    # harness.write_text_atomic: a kill while writing leaves the previous complete file, never a truncated one
    harness.write_json_atomic(Path(out, "results.json"), results, indent=2)
    harness.write_text_atomic(Path(out, "results.md"), markdown(results))


# ------------------------------------------------------------------------------------------------ the plan
def plan_of(args) -> list[tuple[str, int]]:
    """Every setting in order: plain batches doubling up to --plain-max (the sweep stops at the first that runs
    out of memory), then the gradient-cache batches."""
    plain, pairs = [], args.plain_start
    while pairs <= args.plain_max:
        plain.append(pairs)
        pairs *= 2
    return [("plain", p) for p in plain] + [("grad_cache", p) for p in args.gc_batches]


def describe(mode: str, pairs: int) -> str:
    return f"{'plain' if mode == 'plain' else 'grad cache'} {pairs}"


def step_estimate(results: dict, mode: str, pairs: int) -> float | None:
    """Seconds per step: step time grows about linearly with the pairs (an overestimate from a smaller batch,
    which uses the GPU less well). The first grad-cache batch is estimated from the best plain throughput."""
    smaller = [r for r in measured(results[mode]) if r["pairs"] < pairs]
    if smaller:
        r = max(smaller, key=lambda r: r["pairs"])
        return r["step_s"] * pairs / r["pairs"]
    plain = measured(results["plain"])
    if mode == "grad_cache" and plain:
        return GRAD_CACHE_COST * pairs / max(r["pairs_per_s"] for r in plain)
    return None


def setting_estimate(results: dict, mode: str, pairs: int, steps: int, chunk_rows: int | None) -> float | None:
    """Seconds for one setting: warm-up plus the timed steps."""
    step = step_estimate(results, mode, pairs)
    if step is None:
        return None
    return step * (steps + warmup_pairs(pairs, chunk_rows) / pairs)


def decide(estimate: float | None, elapsed: float, startup: float, budget: float, ran_any: bool) -> str:
    """'run', 'stop' (it fits a fresh invocation, not what is left of this one) or 'too long' (it cannot fit
    any invocation: recorded as not run, so that repeating the command ends)."""
    if estimate is None:  # nothing to estimate from yet: a first, small setting
        return "run" if not ran_any or elapsed < budget else "stop"
    if estimate > budget - startup:
        return "too long"
    if ran_any and estimate > budget - elapsed:
        return "stop"
    return "run"


def beyond_oom(results: dict, mode: str, pairs: int) -> bool:
    """True past a batch of the same sweep that ran out of memory: a larger one would too."""
    return any(r.get("oom") and r["pairs"] < pairs for r in results[mode])


def left_after(results: dict, plan: list, not_run: set) -> list[str]:
    """The settings of `plan` still to measure, plain ones summarised (the doubling stops at the first OOM)."""
    todo = [
        (m, p)
        for m, p in plan
        if (m, p) not in not_run and stored_row(results, m, p) is None and not beyond_oom(results, m, p)
    ]
    plain = [p for m, p in todo if m == "plain"]
    left = []
    if plain:
        left.append(f"plain {plain[0]}" if len(plain) == 1 else f"plain {plain[0]}..{plain[-1]} (doubling until OOM)")
    return left + [describe(m, p) for m, p in todo if m == "grad_cache"]


# ----------------------------------------------------------------------------------------------------- main
def main(argv=None) -> int:
    started = now()
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    script = os.path.relpath(os.path.abspath(__file__))
    # The command that continues this run: the same one, minus --restart (which would throw the results away).
    again = "python " + shlex.join([script] + [a for a in argv if a != "--restart"])
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu" and not args.tiny:
        print("no GPU: the 7B benchmark needs one (use --tiny for a CPU smoke test)")
        return ERROR
    loss_dtype = args.loss_dtype or ("bfloat16" if device.type == "cuda" else "float32")
    env = environment(device, "python " + shlex.join([script] + argv))
    settings = settings_of(args, loss_dtype, env)
    os.makedirs(args.out, exist_ok=True)
    results, refusal = load_results(os.path.join(args.out, "results.json"), settings, args.restart)
    if refusal:
        print(f"refusing to continue: {refusal}", file=sys.stderr)
        return ERROR
    results = results or {
        "settings": settings,
        "environment": env,
        "seq_len": args.seq_len,
        "lora_r": args.lora_r,
        "loss_dtype": loss_dtype,
        "plain": [],
        "grad_cache": [],
    }
    results["not_run"], results["left"] = [], []  # re-evaluated by this invocation (its budget may differ)

    plan = plan_of(args)
    done = [describe(m, p) for m, p in plan if stored_row(results, m, p) is not None]
    print(f"plan: {', '.join(left_after(results, plan, set())) or 'nothing'}", flush=True)
    print(f"      already recorded in {args.out}: {', '.join(done) or 'nothing'}", flush=True)
    print(
        f"      {args.steps} timed step(s) per setting after a warm-up; loss {args.loss_impl} in {loss_dtype}; "
        f"time budget {args.time_budget:.0f} s from the start of this command",
        flush=True,
    )

    encoder, config = build(args, device)
    trainable = sum(p.numel() for p in encoder.parameters() if p.requires_grad)
    total = sum(p.numel() for p in encoder.parameters())
    optimizer = torch.optim.AdamW(
        [p for p in encoder.parameters() if p.requires_grad], lr=1e-4, fused=device.type == "cuda" or None
    )
    loss_fn = cast_loss(build_loss(args.loss_impl), getattr(torch, loss_dtype))
    results["loss"] = args.loss_impl
    results["model"] = {"parameters": total, "trainable": trainable, "config": settings["model_config"]}
    startup = now() - started
    print(
        f"model: {total / 1e9:.2f} B parameters, {trainable / 1e6:.1f} M trainable (LoRA r={args.lora_r}); "
        f"ready after {startup:.0f} s",
        flush=True,
    )
    save(args.out, results)

    not_run = set()  # settings too long for any run of this budget (for plain: that one and all larger)
    ran, stopped = [], None
    for mode, pairs in plan:
        if (mode, pairs) in not_run or stored_row(results, mode, pairs) is not None or beyond_oom(results, mode, pairs):
            continue
        chunk_rows = None
        if mode == "grad_cache":
            # Kept once a grad-cache row is recorded: every grad-cache row uses the same chunk, even if a later
            # run (larger --plain-max) finds a larger plain batch.
            largest = max((r["pairs"] for r in measured(results["plain"])), default=0)
            chunk_rows = results.get("chunk_rows") or args.chunk_size or max(2, largest - largest % 2)
        estimate = setting_estimate(results, mode, pairs, args.steps, chunk_rows)
        elapsed = now() - started
        verdict = decide(estimate, elapsed, startup, args.time_budget, bool(ran))
        label = f"{describe(mode, pairs):>18} pairs:"
        if verdict == "too long":
            why = (
                f"estimated {estimate:.0f} s, more than one run can spend ({args.time_budget:.0f} s budget minus "
                f"{startup:.0f} s start-up); raise --time-budget if the command's time limit allows"
            )
            results["not_run"].append({"setting": describe(mode, pairs), "estimate_s": estimate, "why": why})
            print(f"{label} not run: {why}", flush=True)
            # The plain sweep ends here: a larger plain batch would take longer still.
            not_run |= {(m, p) for m, p in plan if m == mode and (p == pairs or (mode == "plain" and p > pairs))}
            continue
        if verdict == "stop":
            stopped = (mode, pairs, estimate, elapsed)
            break
        if estimate is not None:
            print(f"{label} running (estimated {estimate:.0f} s, {elapsed:.0f} s of the budget used)", flush=True)
        row = measure(encoder, optimizer, loss_fn, pairs, args, config, device, chunk_rows)
        ran.append(describe(mode, pairs))
        row = row or {"pairs": pairs, "oom": True}
        if chunk_rows:
            row["chunk_rows"] = results["chunk_rows"] = chunk_rows
        results[mode] = sorted(results[mode] + [row], key=lambda r: r["pairs"])
        results["left"] = left_after(results, plan, not_run)
        save(args.out, results)
        if row.get("oom"):
            print(f"{label} out of memory", flush=True)
        else:
            speed = f"{row['pairs_per_s']:9.1f} pairs/s  {row['step_s']:7.2f} s/step"
            print(f"{label} {speed}  peak {gigabytes(row['peak_gb'])} GB", flush=True)

    results["left"] = left_after(results, plan, not_run)
    save(args.out, results)
    print("\n" + markdown(results))
    print(f"this run ({now() - started:.0f} s): measured {', '.join(ran) or 'nothing'}")
    if stopped is None:
        print(f"done: nothing left to run; results in {os.path.join(args.out, 'results.json')} and results.md")
        return DONE
    mode, pairs, estimate, elapsed = stopped
    print(
        f"stopped: {describe(mode, pairs)} pairs"
        f"{'' if estimate is None else f' (estimated {estimate:.0f} s)'} does not fit in the "
        f"{max(0.0, args.time_budget - elapsed):.0f} s left of --time-budget {args.time_budget:.0f} s"
    )
    print(f"left: {', '.join(results['left'])}")
    print(f"to continue, run the same command again:\n  {again}")
    return DONE


if __name__ == "__main__":
    sys.exit(main())
