"""Checkpoints: everything a killed run needs to continue exactly, and the best model so far.

    OUTPUT_DIR/checkpoints/step-00000300/   every --save-every steps; the newest --keep-checkpoints are kept
        state.pt         trainable weights, optimizer, LR schedule, loss scaler, data position, settings
        rng-rank{r}.pt   process r's random generators (python, numpy, torch, CUDA), so that dropout draws
                         the masks the uninterrupted run would have drawn
    OUTPUT_DIR/best/                        the model with the best dev Spearman so far (an export: export.py)

A folder is written as NAME.tmp and swapped in only once complete, so a run killed while writing leaves
the previous checkpoint or best model on disk, never a half-written one.

Reading a checkpoint never runs code from it. Unpickling an arbitrary object can call any function its
author chose, and a checkpoint folder may come from someone else, so both files hold only tensors and plain
Python values (numpy's generator state is stored as a list, not an array) and are read with
torch.load(weights_only=True); a file holding anything else is refused with UnsafeCheckpointError.

Two starts are refused because they would silently skip or repeat training data: a fresh run in an
output folder that holds another run's checkpoints, and a resume whose data settings (RESUME_MUST_MATCH)
differ from the checkpoint's.
"""

from __future__ import annotations

import os
import pickle
import random
import re
import shutil
from dataclasses import asdict, dataclass

import numpy
import torch

from .config import TrainConfig
from .distributed import DistInfo, barrier
from .export import is_peft_model, save_pretrained

# Settings that fix which examples make up the batch at a saved position, or the LR schedule's length.
RESUME_MUST_MATCH = ("train_data", "train_split", "data_format", "batch_size", "grad_accum", "bucket", "seed",
                     "epochs", "max_steps")

STATE_FILE = "state.pt"
CHECKPOINT_NAME = re.compile(r"step-(\d+)")  # a complete checkpoint; NAME.tmp and NAME.old are not


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holding objects that only running code from the file could rebuild."""


@dataclass
class Position:
    """Where the run stands: optimizer steps done, the epoch and the index of the batch the next step starts
    at, and the best dev Spearman so far (None before the first evaluation)."""

    step: int = 0
    epoch: int = 0
    batch: int = 0
    best: float | None = None


# ------------------------------------------------------------------------------------------------ folders


def checkpoint_path(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, "checkpoints", f"step-{step:08d}")


def finished_checkpoints(output_dir: str) -> list[str]:
    """The complete checkpoint folders of output_dir, oldest first."""
    root = os.path.join(output_dir, "checkpoints")
    if not os.path.isdir(root):
        return []
    steps = {}
    for name in os.listdir(root):
        match = CHECKPOINT_NAME.fullmatch(name)
        if match:
            steps[os.path.join(root, name)] = int(match.group(1))
    return sorted(steps, key=steps.get)


def checkpoint_to_resume(cfg: TrainConfig) -> str | None:
    """The checkpoint this run continues from (cfg.resume: a folder, or "auto" for the newest), or None.

    Starting afresh where an earlier run left checkpoints is refused: the new run's checkpoints would sort
    before the old run's, so pruning would delete each of them as soon as it is written, and a later
    `--resume auto` would continue the old run.
    """
    done = finished_checkpoints(cfg.output_dir)
    if cfg.resume == "auto":
        return done[-1] if done else None
    if cfg.resume:
        return cfg.resume
    if done:
        raise ValueError(f"output_dir {cfg.output_dir} already holds checkpoints of an earlier run (latest: "
                         f"{done[-1]}): pass --resume auto to continue it, or choose a new --output-dir")
    return None


def _swap_in(tmp: str, final: str) -> None:
    """Put the complete folder `tmp` in the place of `final`. The old copy is moved aside rather than deleted
    until the new one is in place, so whenever the process is killed one complete copy remains on disk."""
    old = final + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if os.path.exists(final):
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)


# ------------------------------------------------------------------------------------------- save and load


def save_checkpoint(cfg: TrainConfig, position: Position, dist_info: DistInfo, *, encoder, optimizer, scheduler,
                    scaler) -> str:
    """Write checkpoints/step-N (N = position.step), then delete the oldest beyond cfg.keep_checkpoints.

    Every process calls this: the main process writes the shared state, each process its own RNG state.
    """
    path = checkpoint_path(cfg.output_dir, position.step)
    tmp = path + ".tmp"
    if dist_info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while writing it
        os.makedirs(tmp)
        torch.save({"model": encoder.trainable_state_dict(), "optimizer": optimizer.state_dict(),
                    "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(),
                    "position": asdict(position), "config": asdict(cfg)},
                   os.path.join(tmp, STATE_FILE))
    barrier(dist_info)  # the folder exists before the other processes write into it
    torch.save(_rng_state(), os.path.join(tmp, _rng_file(dist_info.rank)))
    barrier(dist_info)  # every process's file is complete before the folder is swapped in
    if dist_info.is_main:
        _swap_in(tmp, path)
        if cfg.keep_checkpoints > 0:
            for old in finished_checkpoints(cfg.output_dir)[:-cfg.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
    barrier(dist_info)
    return path


def load_checkpoint(path: str, cfg: TrainConfig, dist_info: DistInfo, *, encoder, optimizer, scheduler, scaler
                    ) -> Position:
    """Restore what save_checkpoint wrote into the given objects and this process's generators; return the
    position to continue from. Both files are read and checked before anything is changed."""
    state = _read_tensors_and_plain_values(os.path.join(path, STATE_FILE))
    _refuse_changed_data_settings(path, state["config"], cfg)
    missing = set(encoder.trainable_state_dict()) - set(state["model"])
    if missing:
        raise ValueError(f"checkpoint {path} lacks trainable weights, e.g. {sorted(missing)[:3]}: another model?")
    rng_file = os.path.join(path, _rng_file(dist_info.rank))
    if not os.path.exists(rng_file):
        raise ValueError(f"checkpoint {path} has no RNG state for rank {dist_info.rank}: resume with the same "
                         "number of processes")
    rng_state = _read_tensors_and_plain_values(rng_file)
    encoder.load_state_dict(state["model"], strict=False)
    optimizer.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    if state["scaler"]:  # empty when fp16 loss scaling was off
        scaler.load_state_dict(state["scaler"])
    _set_rng_state(rng_state)
    return Position(**state["position"])


def _read_tensors_and_plain_values(file: str):
    """torch.load that rebuilds only tensors and plain Python values, so reading the file cannot run code."""
    try:
        return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch names what it refused in the lines that mention GLOBAL (the pickle opcode that imports a callable)
        found = "; ".join(line.strip() for line in str(exc).splitlines() if "GLOBAL" in line)
        raise UnsafeCheckpointError(
            f"refusing to load {file}: it holds Python objects other than tensors and plain values"
            f"{f' ({found})' if found else ''}, and rebuilding them would run code that came with the file. "
            "angle_train never writes such objects, so this file was written or changed by something else; "
            "resume only from checkpoints you trust") from None


def _refuse_changed_data_settings(path: str, saved: dict, cfg: TrainConfig) -> None:
    current = asdict(cfg)
    changed = {k: (saved.get(k), current[k]) for k in RESUME_MUST_MATCH if saved.get(k) != current[k]}
    if changed:
        detail = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
        raise ValueError(f"cannot resume from {path}: these settings differ from the checkpoint's ({detail}); "
                         "resuming would skip or repeat training data. Resume with the checkpoint's settings, "
                         "or start a new run in a new --output-dir")


def _rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def _rng_state() -> dict:
    """This process's generators as tensors and plain values (numpy's key array as a list of ints)."""
    kind, keys, index, has_gauss, cached_gaussian = numpy.random.get_state()
    state = {"python": random.getstate(), "torch": torch.get_rng_state(),
             "numpy": (kind, keys.tolist(), index, has_gauss, cached_gaussian)}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    numpy.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ------------------------------------------------------------------------------------------------- best/


def save_best(cfg: TrainConfig, encoder, tokenizer, prompt: str | None) -> str:
    """Export the model to output_dir/best (only the adapter for LoRA), replacing the previous best once the
    new one is complete."""
    best = os.path.join(cfg.output_dir, "best")
    shutil.rmtree(best + ".tmp", ignore_errors=True)  # left by a run killed while writing it
    save_pretrained(encoder, tokenizer, best + ".tmp", max_length=cfg.max_length, prompt=prompt,
                    adapter_only=is_peft_model(encoder.backbone), base_model=cfg.model,
                    matryoshka_dims=cfg.matryoshka_dims)
    _swap_in(best + ".tmp", best)
    return best
