"""The training loop: one optimizer step = grad_accum loss computations over batch_size pairs each.

    for each optimizer step:
        for each of grad_accum batches:          # data order: a pure function of (seed, epoch)
            this rank's slice of the batch -> chunks of chunk_size texts (or one chunk)
            plain backprop or gradient cache     # grad_cache.py; embeddings gathered across ranks
        clip, AdamW step, schedule step
        every log_every: metrics.jsonl (+ TensorBoard); every eval_every: dev Spearman, keep the best;
        every save_every: a checkpoint that resumes exactly (weights, optimizer, schedule, RNG, data position)

The progress bar shows the loss, pairs/s, tokens/s (real tokens, padding excluded) and peak memory.
"""

from __future__ import annotations

import json
import math
import os
import random
import resource
import shutil
import time
from dataclasses import asdict, dataclass, field

import torch

from . import distributed
from .config import TrainConfig
from .data import ANGLE_PROMPT, TokenizedPairs, epoch_batches, load_examples, pad_batch
from .evaluation import sts_spearman
from .export import is_peft_model, save_pretrained
from .grad_cache import grad_cache_step, plain_step
from .models import LoraSettings, load_encoder, prepare_tokenizer, wrap_backbone
from .objective import LossWeights, build_loss
from .tiny import BUILTIN_DATASETS, BUILTIN_MODELS, build_backbone, build_tokenizer, builtin_examples

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class StopTraining(Exception):
    """Raised by an on_step callback to end the run at once, as if the process had been killed."""


@dataclass
class TrainResult:
    history: list[dict] = field(default_factory=list)  # one row per optimizer step: step, loss, lr, ...
    evals: list[dict] = field(default_factory=list)  # step, spearman
    best_spearman: float | None = None
    best_path: str | None = None
    final_path: str | None = None
    encoder: object = None
    tokenizer: object = None
    loss_impl: str = ""


# ------------------------------------------------------------------------------------------------- setup


def resolve_prompt(prompt: str | None) -> str | None:
    return ANGLE_PROMPT if prompt == "angle" else prompt


def build_encoder(cfg: TrainConfig, device: torch.device):
    autocast = "bf16" if cfg.bf16 else "fp16" if cfg.fp16 else None
    lora = LoraSettings(cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.lora_targets or None) if cfg.lora else None
    if cfg.model in BUILTIN_MODELS:
        is_decoder = cfg.model == "builtin:tiny-llama"
        tokenizer = prepare_tokenizer(build_tokenizer(), is_decoder)
        backbone = build_backbone(cfg.model, len(tokenizer), seed=cfg.seed).to(DTYPES[cfg.model_dtype])
        encoder = wrap_backbone(backbone, pooling=cfg.pooling, pad_token_id=tokenizer.pad_token_id,
                                is_decoder=is_decoder, lora=lora, gradient_checkpointing=cfg.gradient_checkpointing,
                                autocast=autocast)
        return encoder.to(device), tokenizer
    return load_encoder(cfg.model, pooling=cfg.pooling, lora=lora, gradient_checkpointing=cfg.gradient_checkpointing,
                        autocast=autocast, dtype=DTYPES[cfg.model_dtype], device=device)


def read_data(source: str, fmt: str | None, split: str):
    if source in BUILTIN_DATASETS:
        return builtin_examples(source)
    return load_examples(source, fmt=fmt, split=split)


def make_optimizer(cfg: TrainConfig, model: torch.nn.Module, device: torch.device) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    fused = device.type == "cuda"  # fused AdamW: one kernel for all parameters
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, fused=fused or None)


def make_schedule(cfg: TrainConfig, optimizer, total_steps: int):
    warmup = int(cfg.warmup * total_steps) if cfg.warmup < 1 else int(cfg.warmup)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        if cfg.schedule == "constant":
            return 1.0
        progress = (step - warmup) / max(1, total_steps - warmup)
        if cfg.schedule == "cosine":
            return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
        return max(0.0, 1.0 - progress)

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def peak_memory_gb(device: torch.device) -> float:
    """Peak GPU memory allocated by tensors, or the process's peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


# ------------------------------------------------------------------------------------------- checkpoints


def _rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy

        state["numpy"] = numpy.random.get_state()
    except ImportError:  # pragma: no cover
        pass
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


def save_checkpoint(path: str, encoder, optimizer, scheduler, scaler, position: dict, dist_info, cfg: TrainConfig
                    ) -> None:
    """Everything a resumed run needs; rank 0 writes the shared state, every rank its own RNG state."""
    tmp = path + ".tmp"
    if dist_info.is_main:
        os.makedirs(tmp, exist_ok=True)
        torch.save({"model": encoder.trainable_state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "position": position,
                    "config": asdict(cfg)},
                   os.path.join(tmp, "state.pt"))
    if dist_info.enabled:
        torch.distributed.barrier()
    torch.save(_rng_state(), os.path.join(tmp, f"rng-rank{dist_info.rank}.pt"))
    if dist_info.enabled:
        torch.distributed.barrier()
    if dist_info.is_main:
        if os.path.exists(path):
            shutil.rmtree(path)
        os.replace(tmp, path)  # a checkpoint folder exists only once it is complete
    if dist_info.enabled:
        torch.distributed.barrier()


def latest_checkpoint(output_dir: str) -> str | None:
    root = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(root):
        return None
    done = sorted(d for d in os.listdir(root) if d.startswith("step-") and not d.endswith(".tmp"))
    return os.path.join(root, done[-1]) if done else None


# Settings that fix which examples make up the batch at a saved position, or the LR schedule's length: a resumed
# run with other values would silently skip or repeat data, so resuming refuses them.
RESUME_MUST_MATCH = ("train_data", "train_split", "data_format", "batch_size", "grad_accum", "bucket", "seed",
                     "epochs", "max_steps")


def load_checkpoint(path: str, encoder, optimizer, scheduler, scaler, dist_info, cfg: TrainConfig | None = None
                    ) -> dict:
    state = torch.load(os.path.join(path, "state.pt"), map_location="cpu", weights_only=False)
    if cfg is not None:
        saved, current = state.get("config", {}), asdict(cfg)
        changed = {k: (saved.get(k), current[k]) for k in RESUME_MUST_MATCH if saved.get(k) != current[k]}
        if changed:
            detail = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
            raise ValueError(f"cannot resume from {path}: these settings differ from the checkpoint's ({detail}); "
                             "resuming would skip or repeat training data. Resume with the checkpoint's settings, "
                             "or start a new run in a new --output-dir")
    missing = set(encoder.trainable_state_dict()) - set(state["model"])
    if missing:
        raise ValueError(f"checkpoint {path} lacks trainable weights, e.g. {sorted(missing)[:3]}: another model?")
    encoder.load_state_dict(state["model"], strict=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if state.get("scaler"):
        scaler.load_state_dict(state["scaler"])
    rng_file = os.path.join(path, f"rng-rank{dist_info.rank}.pt")
    if not os.path.exists(rng_file):
        raise ValueError(f"checkpoint {path} has no RNG state for rank {dist_info.rank}: resume with the same "
                         "number of processes")
    _set_rng_state(torch.load(rng_file, weights_only=False))
    return state["position"]


def _prune_checkpoints(output_dir: str, keep: int) -> None:
    root = os.path.join(output_dir, "checkpoints")
    done = sorted(d for d in os.listdir(root) if d.startswith("step-") and not d.endswith(".tmp"))
    for old in done[:-keep] if keep > 0 else []:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)


# -------------------------------------------------------------------------------------------------- train


def train(cfg: TrainConfig, *, model=None, train_examples=None, dev_examples=None, on_step=None) -> TrainResult:
    """Run training as configured (the Python API; the CLI calls this).

    Overrides for library use and tests: model=(encoder, tokenizer) replaces cfg.model; train_examples
    ((examples, format)) and dev_examples (a list of format-A examples) replace the data paths;
    on_step(step, row) is called after every optimizer step and may raise StopTraining."""
    cfg.validate()
    device = torch.device(cfg.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dist_info = distributed.init_distributed(device.type)
    if dist_info.enabled and device.type == "cuda":
        device = torch.device("cuda", dist_info.local_rank)
    main = dist_info.is_main
    prompt = resolve_prompt(cfg.prompt)

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # same model (and LoRA) initialisation on every rank
    encoder, tokenizer = build_encoder(cfg, device) if model is None else (model[0].to(device), model[1])
    torch.manual_seed(cfg.seed + dist_info.rank)  # distinct dropout masks per rank

    examples, fmt = train_examples if train_examples is not None else read_data(cfg.train_data, cfg.data_format,
                                                                                   cfg.train_split)
    dataset = TokenizedPairs(examples, fmt, tokenizer, max_length=cfg.max_length, prompt=prompt)
    if dev_examples is None and cfg.dev_data:
        dev_examples, _dev_fmt = read_data(cfg.dev_data, "A", cfg.dev_split)
    weights = LossWeights(cfg.cosine_w, cfg.ibn_w, cfg.cln_w, cfg.angle_w, cfg.cosine_tau, cfg.ibn_tau, cfg.angle_tau)
    loss_fn, loss_impl = build_loss(weights, fmt, cfg.loss_impl)

    if cfg.batch_size % dist_info.world_size:
        raise ValueError(f"batch_size {cfg.batch_size} must be divisible by the number of processes "
                         f"{dist_info.world_size}")
    per_rank = cfg.batch_size // dist_info.world_size
    batches_per_epoch = len(epoch_batches(len(dataset), cfg.batch_size, seed=cfg.seed, epoch=0))
    steps_per_epoch = batches_per_epoch // cfg.grad_accum
    if steps_per_epoch == 0:
        raise ValueError(f"one optimizer step needs {cfg.batch_size * cfg.grad_accum} examples; the data has "
                         f"{len(dataset)}")
    total_steps = cfg.max_steps or max(1, int(cfg.epochs * steps_per_epoch))

    model = encoder
    if dist_info.enabled:
        model = distributed.wrap_ddp(encoder, device)
    optimizer = make_optimizer(cfg, encoder, device)
    scheduler = make_schedule(cfg, optimizer, total_steps)
    # fp16 gradients underflow without loss scaling; with enabled=False every scaler call is a no-op.
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.fp16)

    position = {"step": 0, "epoch": 0, "batch": 0, "best": None}
    resume_from = latest_checkpoint(cfg.output_dir) if cfg.resume == "auto" else cfg.resume
    if not cfg.resume and latest_checkpoint(cfg.output_dir):
        # A new run here would prune the old run's (higher-numbered) checkpoints against its own, deleting its
        # own as soon as it writes them, and a later --resume auto would pick up the old run: refuse instead.
        raise ValueError(f"output_dir {cfg.output_dir} already holds checkpoints of an earlier run (latest: "
                         f"{latest_checkpoint(cfg.output_dir)}): pass --resume auto to continue it, or choose a new "
                         "--output-dir")
    if resume_from:
        position = load_checkpoint(resume_from, encoder, optimizer, scheduler, scaler, dist_info, cfg)
    os.makedirs(cfg.output_dir, exist_ok=True)
    metrics_path = os.path.join(cfg.output_dir, "metrics.jsonl")
    if main:
        with open(os.path.join(cfg.output_dir, "config.json"), "w") as f:
            json.dump(asdict(cfg), f, indent=2)
        _truncate_metrics(metrics_path, position["step"])
    tensorboard = _tensorboard(cfg.output_dir) if main else None

    result = TrainResult(encoder=encoder, tokenizer=tokenizer, loss_impl=loss_impl, best_spearman=position["best"])
    if main:
        n_trainable = sum(p.numel() for p in encoder.parameters() if p.requires_grad)
        n_total = sum(p.numel() for p in encoder.parameters())
        print(f"angle_train: {cfg.model} | {n_trainable:,}/{n_total:,} trainable | {len(dataset):,} examples "
              f"(format {fmt}) | {total_steps} steps of {cfg.batch_size}x{cfg.grad_accum} pairs | "
              f"{f'grad cache, chunks of {cfg.chunk_size} texts' if cfg.chunk_size else 'plain backprop'} | "
              f"{dist_info.world_size} process(es) on {device} | loss: {loss_impl}", flush=True)
        if resume_from:
            print(f"resumed from {resume_from} at step {position['step']}", flush=True)

    bar = _progress(cfg, total_steps, position["step"]) if main else None
    step_fn = grad_cache_step if cfg.chunk_size else plain_step
    window_pairs = window_tokens = 0
    window_start = time.perf_counter()
    encoder.train()
    try:
        while position["step"] < total_steps:
            batches = epoch_batches(len(dataset), cfg.batch_size, seed=cfg.seed, epoch=position["epoch"],
                                    lengths=dataset.lengths, bucket_size=cfg.bucket)
            while position["step"] < total_steps and position["batch"] + cfg.grad_accum <= len(batches):
                loss_sum = 0.0
                for j in range(cfg.grad_accum):
                    indices = batches[position["batch"] + j]
                    batch = dataset.batch(indices[dist_info.rank * per_rank:(dist_info.rank + 1) * per_rank])
                    chunks = [pad_batch(c, encoder.pad_token_id, encoder.padding_side, device)
                              for c in batch.chunks(cfg.chunk_size)]
                    loss_scale = scaler.scale(torch.tensor(1.0 / cfg.grad_accum, device=device))
                    loss = step_fn(model, chunks, batch.labels.to(device), loss_fn, loss_scale=loss_scale,
                                   sync=j == cfg.grad_accum - 1)
                    loss_sum += loss.item()
                    window_pairs += len(indices)
                    window_tokens += sum(dataset.lengths_of(indices))
                grad_norm = None
                scaler.unscale_(optimizer)
                if cfg.max_grad_norm > 0:
                    grad_norm = float(torch.nn.utils.clip_grad_norm_(encoder.parameters(), cfg.max_grad_norm))
                scaler.step(optimizer)  # skipped by the scaler if fp16 gradients overflowed
                scaler.update()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                position["step"] += 1
                position["batch"] += cfg.grad_accum
                step = position["step"]
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                elapsed = time.perf_counter() - window_start
                row = {"step": step, "epoch": position["epoch"], "loss": loss_sum / cfg.grad_accum,
                       "lr": scheduler.get_last_lr()[0], "grad_norm": grad_norm,
                       "pairs_per_s": window_pairs / elapsed, "tokens_per_s": window_tokens / elapsed,
                       "peak_mem_gb": peak_memory_gb(device)}
                result.history.append(row)
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{row['loss']:.4f}", pairs_s=f"{row['pairs_per_s']:.1f}",
                                    tok_s=f"{row['tokens_per_s']:.0f}", mem=f"{row['peak_mem_gb']:.2f}G")
                if main and (step % max(1, cfg.log_every) == 0 or step == total_steps):
                    _write_metrics(metrics_path, row, tensorboard)
                    window_pairs = window_tokens = 0
                    window_start = time.perf_counter()
                if dev_examples and ((cfg.eval_every and step % cfg.eval_every == 0) or step == total_steps):
                    _evaluate(cfg, encoder, tokenizer, dev_examples, prompt, position, result, metrics_path,
                              tensorboard, dist_info)
                if cfg.save_every and step % cfg.save_every == 0:
                    save_checkpoint(os.path.join(cfg.output_dir, "checkpoints", f"step-{step:08d}"), encoder,
                                    optimizer, scheduler, scaler, dict(position), dist_info, cfg)
                    if main:
                        _prune_checkpoints(cfg.output_dir, cfg.keep_checkpoints)
                if on_step is not None:
                    on_step(step, row)
            if position["step"] < total_steps:
                position["epoch"] += 1
                position["batch"] = 0
    except StopTraining:
        return result
    finally:
        if bar is not None:
            bar.close()
        if tensorboard is not None:
            tensorboard.close()

    result.best_spearman = position["best"]
    if main and position["best"] is not None and cfg.save_best:
        result.best_path = os.path.join(cfg.output_dir, "best")
    if main and cfg.save_final:
        result.final_path = save_pretrained(encoder, tokenizer, os.path.join(cfg.output_dir, "final"),
                                            max_length=cfg.max_length, prompt=prompt, merge_in_place=False,
                                            base_model=cfg.model)
    if main:
        last = result.history[-1] if result.history else {}
        print(f"done: {position['step']} steps | last loss {last.get('loss', float('nan')):.4f} | "
              f"{last.get('pairs_per_s', 0):.1f} pairs/s | {last.get('tokens_per_s', 0):.0f} tokens/s | "
              f"peak memory {peak_memory_gb(device):.2f} GB"
              + (f" | best dev Spearman {position['best']:.4f}" if position["best"] is not None else ""), flush=True)
    return result


def _evaluate(cfg, encoder, tokenizer, dev_examples, prompt, position, result, metrics_path, tensorboard, dist_info):
    """Dev Spearman on rank 0; the best model so far is exported to output_dir/best."""
    if dist_info.is_main:
        score = sts_spearman(encoder, tokenizer, dev_examples, batch_size=cfg.eval_batch_size,
                             max_length=cfg.max_length, prompt=prompt)
        encoder.train()
        row = {"step": position["step"], "dev_spearman": score}
        result.evals.append(row)
        improved = position["best"] is None or score > position["best"]
        if improved:
            position["best"] = score
            if cfg.save_best:
                # Written beside and swapped in, so a kill mid-write never destroys the previous best model.
                best_dir = os.path.join(cfg.output_dir, "best")
                shutil.rmtree(best_dir + ".tmp", ignore_errors=True)  # left by a run killed while writing it
                save_pretrained(encoder, tokenizer, best_dir + ".tmp", max_length=cfg.max_length,
                                prompt=prompt, adapter_only=is_peft_model(encoder.backbone), base_model=cfg.model)
                if os.path.exists(best_dir):
                    shutil.rmtree(best_dir)
                os.replace(best_dir + ".tmp", best_dir)
        row["best_dev_spearman"] = position["best"]
        _write_metrics(metrics_path, row, tensorboard)
        print(f"\nstep {position['step']}: dev Spearman {score:.4f}" + (" (best)" if improved else ""), flush=True)
    if dist_info.enabled:
        best = [position["best"]]
        torch.distributed.broadcast_object_list(best, src=0)
        position["best"] = best[0]


def _write_metrics(path: str, row: dict, tensorboard) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    if tensorboard is not None:
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)):
                tensorboard.add_scalar(key, value, row["step"])


def _truncate_metrics(path: str, step: int) -> None:
    """On resume, drop the rows a killed run wrote after its last checkpoint (they are about to be redone)."""
    if not os.path.exists(path):
        return
    def kept(line: str) -> bool:
        try:
            return json.loads(line)["step"] <= step
        except (ValueError, KeyError):  # a line torn by the kill: it belongs to the work being redone
            return False

    with open(path) as f:
        rows = [line if line.endswith("\n") else line + "\n" for line in f if line.strip() and kept(line)]
    with open(path, "w") as f:
        f.writelines(rows)


def _tensorboard(output_dir: str):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        return None
    return SummaryWriter(os.path.join(output_dir, "tensorboard"))


def _progress(cfg: TrainConfig, total: int, start: int):
    if not cfg.progress:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=start, desc="train", dynamic_ncols=True)
