"""Checkpoints: everything a killed run needs to continue exactly; the best and the final model.

    OUTPUT_DIR/checkpoints/step-00000300/   every --save-every steps; the newest --keep-checkpoints are kept, and the
                                            last good one too (Position.good_checkpoint: prune_checkpoints)
        state.pt         trainable weights, optimizer, LR schedule, loss scaler, data position, settings
        rng-rank{r}.pt   process r's random generators (python, numpy, torch, CUDA), so that dropout draws
                         the masks the uninterrupted run would have drawn
        --fsdp: state.pt without weights and optimizer; instead each process's shards of both, written by
        torch.distributed.checkpoint: __{r}_0.distcp per process and .metadata (sharding.py)
        manifest.json    the size and SHA-256 of every other file, written last
    OUTPUT_DIR/best/                        the model with the best dev score so far (an export: export.py)
    OUTPUT_DIR/checkpoints/best-step-N/     a best/ that a newer best replaced, kept while a kept checkpoint knows it
                                            as the best (so that a resume can put it back: reconcile_best)
    OUTPUT_DIR/final/                       the model after the last step (an export)
    OUTPUT_DIR/set-aside/after-step-N/      what a resume from step N moved out of the way: the checkpoints after
                                            step N (another line of training), with their bests, final/ and metrics
                                            rows (set_aside_later_line)
    OUTPUT_DIR/stopped-non-finite.json      the last good checkpoint of a run that non-finite steps stopped, for
                                            `--resume auto` (NON_FINITE_STOP)

A folder is written as NAME.tmp and swapped in only once complete, so a run killed while writing leaves
the previous checkpoint or export on disk (or none), never a half-written one. A write that fails (a full disk)
removes NAME.tmp and raises an OSError that names the previous checkpoint, which is intact. Its files and folders
are synced to disk before the rename and the rename before anything older is removed (_swap_in), so that a power
loss leaves the new folder whole where its name survived, or the previous one.

The manifest catches what the rename cannot: a folder damaged later (a truncated copy, a disk error, a file
edited or deleted). `--resume auto` resumes from the newest checkpoint whose files match their manifest and
says which newer ones it skipped and why (and sets them aside: set_aside_later_line); `--resume PATH` to a folder
that does not match is an error. A folder without a manifest (damaged, or written by a version that did not write
one) does not match.

Reading a checkpoint never runs code from it. Unpickling an arbitrary object can call any function its
author chose, and a checkpoint folder may come from someone else (who can rewrite its manifest too), so state.pt
and rng-rank{r}.pt hold only tensors and plain Python values (numpy's generator state is stored as a list, not
an array) and are read with torch.load(weights_only=True). --fsdp's files are read the same way: the entries of
the .distcp files with torch.load(weights_only=True), and .metadata with an unpickler that admits only the
classes DCP writes there (sharding.py), in place of DCP's own pickle.load and torch.load(weights_only=False). A
file holding anything else is refused with UnsafeCheckpointError (safe_loading.py), which names it, before
anything in it runs. A manifest names only files of its own folder: one naming another path (../x, /x, sub/x,
a link out of the folder) does not match, and nothing it names is read.

Three starts are refused: a fresh run, or a resume from another output folder's checkpoint, in an output folder that
holds an earlier run (unless --overwrite: it would replace or orphan that run's outputs); a resume whose data
settings (RESUME_MUST_MATCH) differ from the checkpoint's (it would silently skip or repeat training data; a data
file moved, renamed or copied is the same data where the checkpoint records its contents: _moved_data; the names of
training examples given to train() in either run are not compared, their record is: TRAIN_DATA_SETTINGS); and one
whose run ends before the checkpoint's step. The optimizer and schedule settings (RESUME_APPLIES), the run's length
among them (a finished run can be extended), may change on resume and take effect from the resumed step: the
learning rate there is the one the new settings' schedule gives at that step (as if the run had used them from the
start), AdamW's moments carry over, and the run says which settings changed; so do the loss's settings and the
precision (RESUME_NOTED). Other dev data than the one that measured the checkpoint's best score is refused
(RESUME_DEV_SETTINGS; the same file edited since too: Position.dev_fingerprint), and so is another model than the
checkpoint's: other settings of what the weights compute (RESUME_MODEL_SETTINGS), or a --model whose config or frozen
weights differ from those the checkpoint records (base_model_record: a local folder of the model a hub name names
resumes; another model of the same shapes, or a folder whose files changed since, does not; under another transformers
version a config written another way is said, the model type and frozen weights deciding: _compare_base_model).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass, field

import numpy
import torch
import transformers

from .atomic_files import made_folder, move_durably, remove_regular_file, sync_folder, sync_tree, written_aside
from .config import PROMPT_SETTINGS, TrainConfig, default_of, flag_of, flag_words, prompts_of
from .data import FORMATS, has_no_splits, parse_columns
from .distributed import DistInfo, failures_of_processes, on_process, raise_first_failure, stopping_together
from .export import is_peft_model, save_pretrained
from .faults import check_finite_weights
from .models import adapter_fingerprint
from .safe_loading import is_file_name, read_tensors_and_plain_values
from .sharding import load_sharded, save_sharded
from . import st_folder
from .st_folder import META_FILE
from .tracking import DEV_METRICS, metrics_row

# Settings that fix which examples make up the batch at a saved position.
RESUME_MUST_MATCH = ("train_data", "train_split", "data_format", "batch_size", "grad_accum", "bucket", "seed",
                     "objective", "text_column", "mask_rates")
# Those of them that name and read --train-data (the source, its split, the format and ArcCSE's column it is read by):
# training examples given to train() replace them, so they are compared only where both runs read --train-data, and
# the examples by the checkpoint's record of them otherwise (Position.data_record)
TRAIN_DATA_SETTINGS = ("train_data", "train_split", "data_format", "text_column")

# Settings of the optimizer and the learning-rate schedule that a resumed run applies from the step it resumes at
# (load_checkpoint); the others are read from the settings at every step, or fixed by RESUME_MUST_MATCH. The run's
# length (--max-steps, --epochs) is among them: it moves where the schedule ends, and the batches a step takes depend
# only on the seed, the epoch and the position in it (a longer run goes on through the same order), so a finished run
# can be extended; a length that ends before the checkpoint's step is refused.
RESUME_APPLIES = ("lr", "weight_decay", "warmup", "schedule", "max_grad_norm", "max_steps", "epochs")

STATE_FILE = "state.pt"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
CHECKPOINT_NAME = re.compile(r"step-(\d+)")  # a complete checkpoint; NAME.tmp and NAME.old are not


@dataclass
class Position:
    """Where the run stands: optimizer steps done, the epoch and the index of the batch the next step starts
    at, the best dev score so far (None before the first evaluation; best_metric: which, tracking.DEV_METRICS) and
    the step it was measured at, the steps
    skipped as non-finite (in all, and in a row up to now), and the losses of the steps since the last metrics row
    (whose mean the next row logs: restored on resume, so that a resumed run logs what an uninterrupted one does),
    and the step of the last good checkpoint of output_dir: the newest one whose weights a finite step was taken
    from (trainer.trust_checkpoint; None before there is one). Checkpoints written before best_step, loss_window,
    good_checkpoint, data_record, dev_fingerprint and resumes existed load with their defaults."""

    step: int = 0
    epoch: int = 0
    batch: int = 0
    best: float | None = None
    bad_steps: int = 0
    bad_streak: int = 0
    best_step: int | None = None
    loss_window: list = field(default_factory=list)
    best_metric: str = "dev_spearman"
    good_checkpoint: int | None = None
    # what the batches of `epoch` are made from: {"examples": count, "contents": data.data_fingerprint of them,
    # "order": data.order_fingerprint of the epoch's batches, "order_version": data.ORDER_VERSION, "format": their
    # data format (None: ArcCSE's sentences), "given": true where they were given to train() as train_examples, not
    # read from --train-data} (trainer.data_record; earlier versions recorded a "fingerprint",
    # data.sampled_data_fingerprint's, for "contents", and no "format", "given" or "order_version"); a resume that
    # would make them of other examples, in another format or in another order, is refused (load_checkpoint). None:
    # written before it was recorded.
    data_record: dict | None = None
    # trainer.dev_set_fingerprint of the dev set that scores the run (the one that measured `best`): a resume with the
    # same --dev-data edited since is refused (_refuse_another_dev_set). None: no dev set yet, or written before it
    # was recorded.
    dev_fingerprint: str | None = None
    # each resume that changed settings, oldest first: {"step": the step it resumed at, "changed": "--flag old -> new,
    # ..."} (load_checkpoint; the model cards list them under the command, which is the last run's). Empty: none, or
    # written before they were recorded.
    resumes: list = field(default_factory=list)


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
    """The checkpoint this run continues from (cfg.resume: a folder, or "auto" for the newest one that matches
    its manifest), or None for a fresh start.

    A fresh start where an earlier run left anything (earlier_run_outputs) is refused unless cfg.overwrite: it
    would replace that run's final/ and metrics and leave its best/ beside the new run's, and with checkpoints
    left the new run's would sort before the old run's, so pruning would delete each of them as soon as it is
    written, and a later `--resume auto` would continue the old run. (`--resume auto` where nothing is left to
    resume is such a fresh start.) So is a resume from a checkpoint of another output folder (`--resume PATH
    --output-dir B`): the resumed run would replace B's best/, final/ and checkpoints and append to its metrics.

    An output folder whose config.json is not a run's settings (a model folder) is refused either way: the run
    would replace that file, and --overwrite delete it.
    """
    check_not_a_model_folder(cfg.output_dir)
    done = finished_checkpoints(cfg.output_dir)
    if cfg.resume == "auto":
        good = _last_good_after_a_non_finite_stop(cfg.output_dir, done)
        if good is not None:
            return good
        skipped = []
        for path in reversed(done):
            problem = checkpoint_problem(path)
            if problem is None:
                for newer, why in skipped:
                    print(f"skipping damaged checkpoint {newer}: {why}", flush=True)
                return path
            skipped.append((path, problem))
        if skipped and not cfg.overwrite:
            detail = "; ".join(f"{path}: {why}" for path, why in skipped)
            raise ValueError(f"--resume auto: no checkpoint in {cfg.output_dir} matches its manifest ({detail}). "
                             "Pass --overwrite 1 to start afresh there, or choose a new --output-dir")
    elif cfg.resume:
        problem = checkpoint_problem(cfg.resume)
        if problem is not None:
            raise ValueError(f"cannot resume from {cfg.resume}: {not_a_checkpoint(cfg.resume) or problem}")
        if not is_own_checkpoint(cfg.output_dir, cfg.resume):
            _refuse_earlier_run_for_another_runs_checkpoint(cfg, done)
        return cfg.resume
    left = earlier_run_outputs(cfg.output_dir)
    if left and not cfg.overwrite:
        if done and cfg.resume != "auto":
            options = f"pass --resume auto to continue it (latest checkpoint: {done[-1]}), --overwrite 1 to delete it"
        else:
            # the default --save-every 0 writes a checkpoint only when a signal stops the run: a finished or failed
            # run of it leaves none, which the user learns here, with the flag that would have left them (and the
            # value the earlier run had, where its config.json says)
            earlier = _earlier_save_every(cfg.output_dir)
            had = f"; it ran with --save-every {earlier}" if earlier is not None else ""
            options = ("it left no checkpoint to resume from (a run writes them every --save-every N steps; with the "
                       f"default, 0, only when a signal stops it{had}); pass --overwrite 1 to delete it")
        raise ValueError(f"--output-dir {cfg.output_dir} holds an earlier run ({', '.join(left)}): {options} and "
                         "start afresh, or choose a new --output-dir")
    return None


def _refuse_earlier_run_for_another_runs_checkpoint(cfg: TrainConfig, done: list[str]) -> None:
    """--resume PATH to a checkpoint of another output folder: refused where output_dir holds an earlier run, as a
    fresh start is (checkpoint_to_resume), unless --overwrite, which deletes that run once the resume has passed its
    checks (trainer._setup); and refused with --overwrite too when the checkpoint lies among what it would delete."""
    left = earlier_run_outputs(cfg.output_dir)
    if not left:
        return
    if not cfg.overwrite:
        own = f", or --resume auto to continue it (latest checkpoint: {done[-1]})" if done else ""
        raise ValueError(f"--output-dir {cfg.output_dir} holds an earlier run ({', '.join(left)}), and {cfg.resume} "
                         "is not one of its checkpoints: resumed there, it would replace that run's outputs and mix "
                         "both runs' metrics. Choose a new --output-dir, pass --overwrite 1 to delete that run "
                         f"first{own}")
    if run_output_holding(cfg.resume, cfg.output_dir):
        raise ValueError(f"--overwrite 1 would delete {cfg.resume}, the checkpoint to resume from, with the "
                         f"earlier run in {cfg.output_dir}: choose a new --output-dir")


def refuse_starts_among_run_outputs(cfg: TrainConfig, *, model: bool = True) -> None:
    """A --model or --lora-path in what a run writes into --output-dir (run_output_holding: a run's best/, final/, a
    checkpoint) is refused before anything is loaded or deleted: the run replaces best/ and final/ and prunes its
    checkpoints, and --overwrite 1 deletes them all before it trains, so the run would record as its start a folder
    that holds other weights, or none (a --resume of it refused as another model or adapter). model: False where
    train() was given the model in place of --model's."""
    for flag, name in (("--model", cfg.model if model else None), ("--lora-path", cfg.lora_path)):
        output = name and os.path.exists(name) and run_output_holding(name, cfg.output_dir)
        if output:
            raise ValueError(f"{flag} {name} lies in {output}, which the run in --output-dir {cfg.output_dir} writes "
                             "(it replaces best/ and final/ and prunes its checkpoints; --overwrite 1 deletes them "
                             f"first): copy it out of {cfg.output_dir} and give {flag} the copy, or choose another "
                             "--output-dir")


def _earlier_save_every(output_dir: str) -> int | None:
    """The --save-every of the run whose settings output_dir/config.json holds, or None where that file is missing,
    unreadable or holds none (an earlier version's, another program's)."""
    try:
        value = st_folder.read_json(os.path.join(output_dir, "config.json")).get("save_every")
    except (OSError, ValueError):
        return None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def check_not_a_model_folder(output_dir: str) -> None:
    """Refuse an output_dir holding a config.json that is not an angle-train run's settings (a model's, or another
    program's): a run writes its settings to output_dir/config.json."""
    from .preflight import is_run_settings

    path = os.path.join(output_dir, "config.json")
    if not os.path.isfile(path):
        return
    try:
        config = st_folder.read_json(path)
    except ValueError:
        return  # not a model's (a model's is JSON): a run's, cut short while written, which --overwrite replaces
    if not is_run_settings(config):
        raise ValueError(f"--output-dir {output_dir} holds a config.json that is not an angle-train run's settings "
                         "(a model folder?): a run writes its settings there (and --overwrite deletes them): choose "
                         "another --output-dir")


# What a run writes into its output_dir; --overwrite deletes these (and their .tmp/.old leftovers), nothing else:
# wandb/ too, whose offline runs a later `wandb sync` would upload as if they were the new run's.
# Written when --max-bad-steps non-finite steps in a row stop the run (main process), naming its last good checkpoint
# (Position.good_checkpoint); `--resume auto` continues from that one, and a resume removes the file.
NON_FINITE_STOP = "stopped-non-finite.json"
SET_ASIDE_DIR = "set-aside"
# The run's files replaced whole (atomic_files.written_aside): a run killed while writing one leaves NAME.tmp beside it
RUN_FILES_WRITTEN_ASIDE = ("metrics.jsonl", "config.json", "profile.json", "curves.png", NON_FINITE_STOP)
RUN_OUTPUTS = ("checkpoints", "best", "final", "tensorboard", "wandb", SET_ASIDE_DIR, *RUN_FILES_WRITTEN_ASIDE)


def record_non_finite_stop(output_dir: str, step: int, good_checkpoint: str | None) -> None:
    """The run stops at `step` after non-finite steps in a row: NON_FINITE_STOP names its last good checkpoint
    (None: none is known), for `--resume auto`."""
    with written_aside(os.path.join(output_dir, NON_FINITE_STOP)) as f:
        json.dump({"step": step, "good_checkpoint": None if good_checkpoint is None
                   else os.path.basename(good_checkpoint)}, f)


def clear_non_finite_stop(output_dir: str) -> None:
    """A resumed run continues a line of training: the stop NON_FINITE_STOP recorded is behind it."""
    with contextlib.suppress(FileNotFoundError):
        os.remove(os.path.join(output_dir, NON_FINITE_STOP))


def _last_good_after_a_non_finite_stop(output_dir: str, done: list[str]) -> str | None:
    """For `--resume auto` after a run stopped by non-finite steps in a row (NON_FINITE_STOP): its last good
    checkpoint, when it is among `done` and matches its manifest, rather than the newest: the newer ones hold the
    weights those steps started from, which the update before them may have spoiled (the resume sets them aside).
    None otherwise (the newest is taken, as after any other stop)."""
    try:
        with open(os.path.join(output_dir, NON_FINITE_STOP)) as f:
            name = json.load(f).get("good_checkpoint")
    except (OSError, ValueError, AttributeError):
        return None
    good = next((path for path in done if os.path.basename(path) == name), None)
    if good is None or checkpoint_problem(good) is not None:
        print(f"--resume auto: the run in {output_dir} stopped after non-finite steps, and its last good checkpoint "
              f"({name or 'none known'}) is not there to resume from: resuming from the newest one", flush=True)
        return None
    if good != done[-1]:
        print(f"--resume auto: the run in {output_dir} stopped after non-finite steps: resuming from its last good "
              f"checkpoint {good} (a finite step was taken from its weights), not the newest, {done[-1]}, whose "
              "weights those steps started from; the newer ones are set aside", flush=True)
    return good


def earlier_run_outputs(output_dir: str) -> list[str]:
    """What an earlier run left in output_dir that a fresh start would replace or orphan: its checkpoints, best/,
    final/ and logged steps (a config.json alone, from a run that stopped before its first step, is nothing)."""
    found = []
    if finished_checkpoints(output_dir):
        found.append("checkpoints/")
    found += [f"{name}/" for name in ("best", "final") if os.path.isdir(os.path.join(output_dir, name))]
    metrics = os.path.join(output_dir, "metrics.jsonl")
    if os.path.isfile(metrics) and os.path.getsize(metrics) > 0:
        found.append("metrics.jsonl")
    return found


def run_output_paths(output_dir: str) -> list[str]:
    """The paths of what a run writes into output_dir (RUN_OUTPUTS, with their .tmp/.old leftovers), there or not."""
    return [os.path.join(output_dir, name + suffix) for name in RUN_OUTPUTS for suffix in ("", ".tmp", ".old")]


def run_output_holding(path: str, output_dir: str) -> str | None:
    """The run output of output_dir (run_output_paths) that `path` is or lies in, relative paths and links resolved
    (a link elsewhere to output_dir/best/ lies in it), or None."""
    where = os.path.realpath(path)
    return next((output for output in run_output_paths(output_dir)
                 if os.path.commonpath([where, os.path.realpath(output)]) == os.path.realpath(output)), None)


def remove_earlier_run(output_dir: str) -> None:
    """--overwrite: delete what an earlier run wrote into output_dir (RUN_OUTPUTS), leaving any other file alone.
    The deletions are synced to disk (output_dir, once all are done) before the new run writes a file: otherwise a
    power loss could bring part of the old run back beside the new one's files (its checkpoints, its metrics)."""
    removed = [path for path in run_output_paths(output_dir) if os.path.exists(path)]
    for path in removed:
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)
    if removed:
        sync_folder(output_dir)


def remove_unfinished_writes(output_dir: str) -> None:
    """At a run's start (main process, the folder's lock held): delete the NAME.tmp files that a run killed while
    replacing one of its files (RUN_FILES_WRITTEN_ASIDE) left beside it, which no later write of the same file may
    ever remove (no profile.json where this run profiles no step, say). Only regular files of those names: a folder
    NAME.tmp (a checkpoint, best/ or final/ being written) is deleted by the next write of it, and a link or any
    other file is not the run's to delete."""
    for name in RUN_FILES_WRITTEN_ASIDE:
        remove_regular_file(os.path.join(output_dir, name + ".tmp"))


def set_aside_later_line(output_dir: str, step: int) -> str | None:
    """On a resume from output_dir's own checkpoint of `step` (main process, once the checkpoint is loaded): move
    the checkpoints of later steps out of the way, into OUTPUT_DIR/set-aside/after-step-N/ (-2, -3... when that
    exists), laid out as an output folder: checkpoints/ with the kept bests of later steps, best/ when a later step
    measured it, final/, and metrics.jsonl with the rows of later steps (the resumed run drops them from its own,
    as every resume does). Returns that folder, or None when no checkpoint is later (nothing is moved then).

    Later checkpoints belong to the line of training being left: a rollback (`--resume PATH` to an older
    checkpoint, say with a lower --lr), or checkpoints `--resume auto` skipped as damaged. Left in place they sorted
    after the resumed run's own: pruning deleted its new checkpoints first, a checkpoint of the same step replaced
    the left line's, and a later `--resume auto` continued the left line. Moved, never deleted: a set-aside
    checkpoint can be resumed into a new --output-dir (which finds its best model beside it when a step after N
    measured it; reconcile_best)."""
    later = [path for path in finished_checkpoints(output_dir) if _step_of(path) > step]
    if not later:
        return None
    name = os.path.join(output_dir, SET_ASIDE_DIR, f"after-step-{step:08d}")
    folder, copies = name, 1
    while os.path.exists(folder):
        copies += 1
        folder = f"{name}-{copies}"
    made_folder(os.path.join(folder, "checkpoints"))  # set-aside/ too, the first time: each entry synced
    rows = _metrics_rows_after(os.path.join(output_dir, "metrics.jsonl"), step)
    if rows:  # on disk before the resumed run drops these rows from its own metrics.jsonl
        with written_aside(os.path.join(folder, "metrics.jsonl"), binary=True) as f:
            f.writelines(rows)
    later += [path for best_step, path in sorted(_kept_bests(output_dir).items()) if best_step > step]
    for path in later:
        move_durably(path, os.path.join(folder, "checkpoints", os.path.basename(path)))
    moved = [os.path.basename(path) for path in later]
    best = os.path.join(output_dir, "best")
    record = best_record(best)
    if record is not None and record["step"] > step:
        move_durably(best, os.path.join(folder, "best"))
        moved.append("best/")
    if os.path.isdir(os.path.join(output_dir, "final")):  # written at the last step, past this one
        move_durably(os.path.join(output_dir, "final"), os.path.join(folder, "final"))
        moved.append("final/")
    # the moves on disk (each folder that lost or gained an entry) before the resumed run writes its first
    # checkpoint: a power loss must not bring the left line back beside it, nor lose the checkpoints moved
    for changed in (os.path.join(folder, "checkpoints"), folder, os.path.join(output_dir, "checkpoints"), output_dir):
        sync_folder(changed)
    print(f"resuming from step {step}: moved what {output_dir} held from later steps ({', '.join(moved)}"
          f"{f', {len(rows)} metrics rows' if rows else ''}) to {folder}, set aside rather than deleted", flush=True)
    return folder


def _metrics_rows_after(path: str, step: int) -> list[bytes]:
    """The lines of a metrics.jsonl whose rows are of a step after `step` (each with its newline)."""
    if not os.path.isfile(path):
        return []
    with open(path, "rb") as f:
        return [line if line.endswith(b"\n") else line + b"\n" for line in f
                if (row := metrics_row(line)) is not None and row["step"] > step]


def _swap_in(tmp: str, final: str, *, synced: bool = False) -> None:
    """Put the complete folder `tmp` (NAME.tmp, or a kept best going back: reconcile_best) in the place of `final`.
    The old copy is moved aside rather than deleted until the new one is in place, so whenever the process is killed
    one complete copy remains on disk; `tmp` moves in one rename, under its own name until then (from another
    file system, a kept best going back: copied and synced whole first, atomic_files.move_durably). Every file
    and folder of `tmp` is synced to disk before the rename (by the caller where `synced`) and the parent folder
    after it, before the old copy goes (and before the caller prunes older checkpoints): after a power loss the new
    folder is whole where its name survived, and the old copy is gone only once the new one is on disk. A sync
    that fails after the rename raises an OSError saying that `final` is in place (the old copy is kept as
    FINAL.old): the new folder is there, only its rename may not survive a power loss."""
    old = final + ".old"
    shutil.rmtree(old, ignore_errors=True)
    if not synced:
        sync_tree(tmp)
    if os.path.exists(final):
        os.replace(final, old)
    move_durably(tmp, final)  # a rename; a copy synced whole where a kept best goes back from another file system
    parent = os.path.dirname(final) or os.curdir
    try:
        sync_folder(parent)
    except OSError as exc:
        kept = f"; the copy it replaced is kept as {old}" if os.path.exists(old) else ""
        raise OSError(exc.errno, f"{final} is written and in place, but its rename could not be synced to disk "
                                 f"({exc.strerror or exc}): a power loss may still undo it{kept}, and nothing "
                                 f"older was removed") from exc
    shutil.rmtree(old, ignore_errors=True)


# -------------------------------------------------------------------------------------------- manifests


def _sha256(file: str) -> str:
    return st_folder.hash_file(file, hashlib.sha256()).hexdigest()


def write_manifest(folder: str) -> None:
    """Record the size and SHA-256 of every file of `folder` in its manifest, written last (and atomically, so a
    manifest that exists is whole)."""
    files = {name: {"bytes": os.path.getsize(os.path.join(folder, name)), "sha256": _sha256(os.path.join(folder, name))}
             for name in sorted(os.listdir(folder)) if name != MANIFEST_FILE}
    with written_aside(os.path.join(folder, MANIFEST_FILE)) as f:
        json.dump({"format": MANIFEST_FORMAT, "files": files}, f, indent=1)


def not_a_checkpoint(path: str) -> str | None:
    """What `path`, given to --resume, is where it is something other than a checkpoint folder (a run's output folder,
    its checkpoints/ folder, an export, a file), with the --resume to give instead; None where it is none of these."""
    if os.path.isfile(path):
        folder = os.path.dirname(os.path.abspath(path))
        return ("it is a file; --resume takes a checkpoint folder" +
                (f" (its folder: --resume {folder})" if os.path.isfile(os.path.join(folder, MANIFEST_FILE)) else ""))
    if not os.path.isdir(path):
        return None
    run_checkpoints = finished_checkpoints(path)
    if run_checkpoints:
        return (f"it is a run's output folder, not one of its checkpoints: --resume auto (with --output-dir {path}) "
                f"continues its newest, or give one (newest: --resume {run_checkpoints[-1]})")
    inside = (finished_checkpoints(os.path.dirname(os.path.abspath(path)))
              if os.path.basename(os.path.normpath(path)) == "checkpoints" else [])
    if inside:
        return (f"it is the folder of a run's checkpoints: give one of them (newest: --resume {inside[-1]}), or "
                "--resume auto with that run's --output-dir")
    if os.path.isfile(os.path.join(path, META_FILE)) and not os.path.exists(os.path.join(path, STATE_FILE)):
        adapter_only = st_folder.read_json(os.path.join(path, META_FILE)).get("adapter_only")
        start_from = "its run's final/ (this holds a LoRA adapter alone)" if adapter_only else path
        return ("it is an exported model, not a checkpoint (no optimizer state or position): train from it with "
                f"--model {start_from} (a new run), or resume one of its run's checkpoints "
                "(OUTPUT_DIR/checkpoints/step-N)")
    return None


def checkpoint_problem(folder: str) -> str | None:
    """Why `folder` is not a complete checkpoint matching its manifest, or None when it is: every file the
    manifest lists is a file of the folder itself, present with its size and checksum, and the state file is among
    them."""
    if not os.path.isdir(folder):
        return "no such folder"
    try:
        with open(os.path.join(folder, MANIFEST_FILE)) as f:
            manifest = json.load(f)
        files = manifest["files"]
        if manifest.get("format") != MANIFEST_FORMAT or not isinstance(files, dict):
            return f"{MANIFEST_FILE} has an unknown layout"
    except FileNotFoundError:
        return f"no {MANIFEST_FILE} (damaged, or written by a version of angle_train that wrote none)"
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{MANIFEST_FILE} is unreadable ({type(exc).__name__})"
    if STATE_FILE not in files:
        return f"{MANIFEST_FILE} does not list {STATE_FILE}"
    # Every name must be a file of this folder itself (write_manifest lists nothing else), checked before any file
    # is opened: a manifest naming ../x, /x or sub/x, or a link out of the folder, would have another file hashed.
    real_folder = os.path.realpath(folder)
    for name, expected in files.items():
        if not is_file_name(name):
            return f"{MANIFEST_FILE} names {name!r}, which is not a file name of the folder"
        if os.path.dirname(os.path.realpath(os.path.join(folder, name))) != real_folder:
            return f"{MANIFEST_FILE} names {name!r}, which is a link to a file outside the folder"
        if not isinstance(expected, dict):
            return f"{MANIFEST_FILE} has an unknown layout"
    for name, expected in files.items():
        file = os.path.join(folder, name)
        if not os.path.isfile(file):
            return f"{name} is missing"
        size = os.path.getsize(file)
        if size != expected.get("bytes"):
            return f"{name} has {size} bytes, the manifest says {expected.get('bytes')}"
        if _sha256(file) != expected.get("sha256"):
            return f"{name} does not match its checksum"
    return None


# ------------------------------------------------------------------------------------------- save and load


def save_checkpoint(cfg: TrainConfig, position: Position, dist_info: DistInfo, *, encoder, optimizer, scheduler,
                    scaler, sharded: bool = False, base_model: dict | None = None) -> str:
    """Write checkpoints/step-N (N = position.step), then delete the oldest beyond cfg.keep_checkpoints but the last
    good one (prune_checkpoints). base_model: the run's base_model_record, which a resume compares.

    Every process calls this: the main process writes the shared state, each process its own RNG state (and,
    sharded, its own shards of the weights and optimizer state).
    """
    path = checkpoint_path(cfg.output_dir, position.step)
    # every process: each holds the same weights, or (sharded) checks its shards and all refuse together
    check_finite_weights(encoder, f"checkpoint {path}", dist_info=dist_info if sharded else None)
    tmp = path + ".tmp"
    if dist_info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while writing it
    # each block ends with every process waiting for the others (the folder exists before they write into it; every
    # process's file is complete before the manifest records them) and stopping together where a write failed
    with _failed_write_cleaned(tmp, cfg.output_dir, dist_info):
        if dist_info.is_main:
            made_folder(os.path.dirname(tmp))  # checkpoints/ at the first one: on disk, as the renames into it are
            os.makedirs(tmp)
            weights = {} if sharded else {"model": encoder.trainable_state_dict(), "optimizer": optimizer.state_dict()}
            _save_file({**weights, "sharded": sharded, "scheduler": scheduler.state_dict(),
                        "scaler": scaler.state_dict(), "position": asdict(position), "config": asdict(cfg),
                        "base_model": base_model},
                       os.path.join(tmp, STATE_FILE))
    with _failed_write_cleaned(tmp, cfg.output_dir, dist_info):
        if sharded:
            save_sharded(tmp, encoder, optimizer)
        _save_file(_rng_state(), os.path.join(tmp, _rng_file(dist_info.rank)))
    with _failed_write_cleaned(tmp, cfg.output_dir, dist_info):
        if dist_info.is_main:
            write_manifest(tmp)
            sync_tree(tmp)  # can fail as a write does (ENOSPC of delayed allocation, EIO)
    with stopping_together(dist_info):  # every process waits for the folder's rename, and stops where it failed
        if dist_info.is_main:
            _swap_in(tmp, path, synced=True)  # a failure after the rename is no failed write: the checkpoint is there
            prune_checkpoints(cfg.output_dir, keep=cfg.keep_checkpoints, good_step=position.good_checkpoint)
    return path


def _save_file(obj, path: str) -> None:
    """torch.save(obj) into the file `path`, written through a Python file so that a full disk (a quota, an I/O
    error) raises the file's OSError, errno kept, which _failed_write_cleaned reports: PyTorch's zip writer turns a
    failed write into a RuntimeError of its own ('unexpected pos ...', no errno), with the file's OSError as its
    context where the file is a Python one (a path's C++ stream keeps no errno)."""
    try:
        with open(path, "wb") as file:
            torch.save(obj, file)
    except RuntimeError as exc:
        cause = exc.__context__
        while cause is not None and not isinstance(cause, OSError):
            cause = cause.__context__
        if cause is None:
            raise
        raise OSError(cause.errno, cause.strerror or str(cause)) from exc


def prune_checkpoints(output_dir: str, *, keep: int, good_step: int | None) -> None:
    """Delete the checkpoints older than the newest `keep` (0: none), except the last good one (good_step:
    Position.good_checkpoint), then the kept bests no kept checkpoint knows (main process).

    The newest checkpoints are not known to be good: the update before one of them may have left weights that are
    finite but so large that every later step is non-finite (found only at the next step), and the checkpoints
    written while those steps are skipped hold the same weights. Pruned by step alone, they pushed the last good
    checkpoint out, and the run stopped with nothing to resume from but weights that could not train."""
    if keep > 0:
        for old in finished_checkpoints(output_dir)[:-keep]:
            if _step_of(old) != good_step:
                shutil.rmtree(old, ignore_errors=True)
    prune_kept_bests(output_dir)


def _step_of(checkpoint: str) -> int:
    return int(CHECKPOINT_NAME.fullmatch(os.path.basename(checkpoint)).group(1))


def is_own_checkpoint(output_dir: str, checkpoint: str) -> bool:
    """Whether `checkpoint` is one of output_dir's own (OUTPUT_DIR/checkpoints/step-N, also through links), rather
    than another output folder's."""
    parent = os.path.dirname(os.path.abspath(checkpoint))
    return (CHECKPOINT_NAME.fullmatch(os.path.basename(os.path.normpath(checkpoint))) is not None
            and os.path.realpath(parent) == os.path.realpath(os.path.join(output_dir, "checkpoints")))


@contextlib.contextmanager
def _failed_write_cleaned(tmp: str, output_dir: str, dist_info: DistInfo):
    """Inside: this process's part of the writing of the checkpoint folder `tmp` (a collective: every process enters,
    and leaves once every process has done its part). A write that fails on any process (ENOSPC, a quota, an I/O
    error) has the main process remove the partial folder, once no process writes into it any more, and every
    process raise an OSError that says the previous checkpoint is untouched, naming the process that failed where
    others did not. A process that removed the folder on its own failure and stopped pulled it from under another
    still writing (which then failed on 'Parent directory ... does not exist'), and one whose partner failed waited
    at the next collective until its connection broke. Any other exception (a bug) stops every process too, as
    distributed.stopping_together does, the partial folder left for the next save to remove."""
    own = None
    try:
        yield
    except Exception as exc:
        own = exc
    failed = failures_of_processes(dist_info, own)
    if not failed:
        return
    rank, failure = failed[0]
    if failure.kind != "OSError":  # no failed write but a bug: raised as stopping_together raises it, the folder
        raise_first_failure(own=own, failed=failed)  # left as a killed run leaves it
    if dist_info.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    # (sharded: every process, naming its own)
    where = on_process(rank) if len(failed) < dist_info.world_size else ""
    done = finished_checkpoints(output_dir)
    kept = f"the previous checkpoint {done[-1]} is intact" if done else "no earlier checkpoint exists"
    raise OSError(failure.errno, f"could not write checkpoint {tmp} ({failure.text}{where}); the partial folder was "
                                 f"removed and {kept}. Free space (or lower --keep-checkpoints) and resume with "
                                 "--resume auto") from own


def load_checkpoint(path: str, cfg: TrainConfig, dist_info: DistInfo, *, encoder, optimizer, scheduler, scaler,
                    data_record: Callable[[int], dict] | None = None, total_steps: int | None = None,
                    dev_fingerprint: str | None = None, dev_metric: str | None = None, dev_given: bool = False,
                    train_given: bool = False, base_model: dict | None = None) -> Position:
    """Restore what save_checkpoint wrote into the given objects and this process's generators; return the
    position to continue from. Both files are read and checked before anything is changed. data_record(epoch):
    this run's Position.data_record for an epoch, checked against the checkpoint's (_refuse_other_data);
    total_steps: this run's length, refused where it ends before the checkpoint's step; dev_fingerprint: this run's
    Position.dev_fingerprint (None: no dev set) and dev_metric the score it gives (tracking.DEV_METRICS), checked
    against the checkpoint's (_refuse_another_dev_set); dev_given: the dev set was given to train() (dev_examples),
    not read from --dev-data; train_given: the training examples were given to train() (train_examples), not read
    from --train-data; base_model: this run's base_model_record, checked against the checkpoint's
    (_compare_base_model)."""
    state = read_tensors_and_plain_values(os.path.join(path, STATE_FILE))
    refuse_other_process_count(path, dist_info.world_size)
    position = Position(**state["position"])
    current_data = None if data_record is None or position.data_record is None else data_record(position.epoch)
    # the training data the names of TRAIN_DATA_SETTINGS read in both runs; given to train() in either, they name
    # nothing of it, and the examples are compared by their record alone
    train_named = not train_given and not (position.data_record or {}).get("given")
    moved = _moved_data(state["config"], cfg, position, current_data if train_named else None,
                        None if dev_given else dev_fingerprint)
    _refuse_changed_data_settings(path, state["config"], cfg, moved=moved, train_named=train_named)
    if total_steps is not None and position.step > total_steps:
        _refuse_shorter_run(path, cfg, position.step, total_steps)
    if current_data is not None:
        _refuse_other_data(path, state["config"], cfg, position, current_data, train_given=train_given,
                           train_named=train_named)
    recorded_model = state.get("base_model")
    # the adapters the runs started from, where both records hold them (checkpoints written before record none)
    adapters = None if recorded_model is None or base_model is None or "adapter" not in recorded_model else (
        recorded_model["adapter"], base_model.get("adapter"))
    _refuse_another_model(path, state["config"], cfg, model_given=any(
        record is not None and record.get("given") for record in (recorded_model, base_model)), adapters=adapters)
    _refuse_another_dev_set(path, state["config"], position, cfg, dev_fingerprint, moved=moved, dev_metric=dev_metric,
                            dev_given=dev_given)
    changed = _changed_optimizer_settings(state["config"], cfg)
    sharded = state.get("sharded", False)
    if sharded != cfg.fsdp:
        raise ValueError(f"checkpoint {path} was written {'with' if sharded else 'without'} --fsdp; resume it "
                         f"{'with' if sharded else 'without'} --fsdp (and the same number of processes)")
    if not sharded:
        _refuse_other_weights(path, state["config"], cfg, state["model"], encoder.trainable_state_dict())
    base_model_note = _compare_base_model(path, state["config"], cfg, recorded_model, base_model,
                                          config_class=type(encoder.backbone.config))
    rng_state = read_tensors_and_plain_values(os.path.join(path, _rng_file(dist_info.rank)))
    settings = [dict(group) for group in optimizer.param_groups]  # as this run built them, before loading over them
    if sharded:  # DCP's files, through readers that refuse anything but what DCP writes (sharding.py)
        # what to do instead is looked up (the run's checkpoints listed) only where a file cannot be read
        load_sharded(path, encoder, optimizer, instead=lambda: _instead_of_resuming(path))
    else:
        encoder.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
    _apply_optimizer_settings(optimizer, scheduler, state["scheduler"], settings)
    if state["scaler"]:  # empty when fp16 loss scaling was off
        scaler.load_state_dict(state["scaler"])
    _set_rng_state(rng_state)
    if dist_info.is_main:
        for name, (old, new) in moved.items():
            print(f"{MOVED_DATA[name]} moved: {old} -> {new}, same content", flush=True)
    if base_model_note and dist_info.is_main:
        print(base_model_note, flush=True)
    noted = {k: (state["config"][k], v) for k, v in asdict(cfg).items()
             if k in RESUME_NOTED and k in state["config"] and state["config"][k] != v}
    # each group's changes in words once, for its line and for the record (RESUME_APPLIES and RESUME_NOTED are
    # apart: the record lists each setting once)
    changed_shown, noted_shown = _changes_shown(changed), _changes_shown(noted)
    if changed and dist_info.is_main:
        print(f"resuming with changed settings ({changed_shown}): from step {position.step} on, the "
              "learning rate is the one the new settings' schedule gives there", flush=True)
    if noted and dist_info.is_main:
        print(f"resuming with changed settings ({noted_shown}): they apply from step {position.step} on", flush=True)
    if changed or noted:  # kept with the next checkpoints, for the model cards
        position.resumes.append({"step": position.step,
                                 "changed": ", ".join(shown for shown in (changed_shown, noted_shown) if shown)})
    return position


def _instead_of_resuming(path: str) -> str:
    """What to do instead of resuming from the checkpoint `path` where a file of it cannot be read: resume from the
    checkpoint of its run before it (a later resume from there sets the later ones aside: set_aside_later_line), where
    there is one, or start afresh."""
    name = CHECKPOINT_NAME.fullmatch(os.path.basename(os.path.normpath(path)))
    run = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    earlier = [done for done in finished_checkpoints(run) if name and _step_of(done) < int(name.group(1))]
    afresh = "start afresh (--overwrite 1 without --resume, or a new --output-dir)"
    if earlier:
        return f"resume from the checkpoint before it (--resume {earlier[-1]}) or {afresh}"
    return f"no earlier checkpoint of its run is left: {afresh}"


# Settings that decide what the checkpoint's weights compute, beyond their names and shapes (_refuse_other_weights):
# resumed under others, a run went on training another model under the checkpoint's name (an adapter trained at two
# scales recorded with the second: --lora-alpha, --lora-rslora; a base model swapped under its adapter), silently.
RESUME_MODEL_SETTINGS = ("model", "lora_path", "lora_alpha", "lora_rslora", "pooling", "bidirectional",
                         *PROMPT_SETTINGS.values())
# Settings a resumed run may change, said when it does: they apply from the resumed step on (the loss's and LoRA's
# dropout among them: the model card's command then names settings that trained only the steps from there, and the
# card lists the resume's changes under it: Position.resumes).
RESUME_NOTED = ("max_length", "model_dtype", "bf16", "fp16", "lora_dropout", "cosine_w", "ibn_w", "cln_w", "angle_w",
                "cosine_tau", "ibn_tau", "angle_tau", "ibn_partition", "false_negative_margin",
                "false_negative_strategy", "matryoshka_dims", "matryoshka_weights", "espresso", "espresso_dim",
                "arccon_margin", "arccon_tau", "triplet_w")
# The dev data a checkpoint's best score was measured on: scores on other dev data do not compare with it.
RESUME_DEV_SETTINGS = ("dev_data", "dev_split")


def _saved_dev_column_map(saved: dict) -> dict:
    """TrainConfig.dev_column_map of a checkpoint's settings (which passed its checks): --dev-columns, else
    --columns."""
    return parse_columns(saved.get("dev_columns") or saved.get("columns") or [])


def _refuse_another_dev_set(path: str, saved: dict, position: Position, cfg: TrainConfig,
                            dev_fingerprint: str | None = None, moved: dict | None = None, *,
                            dev_metric: str | None = None, dev_given: bool = False) -> None:
    """A resume with other dev data than the one that measured the checkpoint's best score is refused: the run would
    compare scores on the new data with that score (and keep, or replace, best/ by it). Without dev data the best
    stays the checkpoint's. A dev set of the other kind (dev_metric: scored pairs against (query, positive) pairs) is
    refused as such: it would compare nDCG@10 with Spearman. The dev set is compared by its contents
    (dev_fingerprint: this run's Position.dev_fingerprint, of its texts and scores as read): a dev file edited in
    place is other dev data; another name of the checkpoint's contents (`moved`: _moved_data), or another split or
    other columns that read its examples, is the same, as is a split recorded with a dev file, which read it whole
    (_ineffective_splits). The settings that name and read the dev data are compared only where both runs read
    --dev-data: dev data given to train() (dev_given, or a checkpoint that names none) is not what they name, and is
    compared by its contents alone, where the checkpoint records them."""
    named = bool(cfg.dev_data) and not dev_given  # this run's dev set is the one --dev-data names
    if position.best is None or not (named or dev_given):
        return
    where = f"--dev-data {cfg.dev_data}" if named else "dev_examples"
    if dev_metric is not None and dev_metric != position.best_metric:
        raise ValueError(f"cannot resume from {path} with {where}: the checkpoint's best model was picked by "
                         f"{DEV_METRICS[position.best_metric]}, and this dev data is scored by "
                         f"{DEV_METRICS[dev_metric]}; resume with dev data of the checkpoint's kind")
    recorded = position.dev_fingerprint  # None: a checkpoint written before it was recorded, nothing to compare
    same_examples = _same_dev_examples(position, dev_fingerprint)
    changed = {}
    if named and saved.get("dev_data"):
        # the split is compared as a setting only where the examples cannot be: another split that reads the
        # checkpoint's examples (a dataset whose "dev" split is its "validation") is the same dev data; and only where
        # it reads something: a dev file is read whole whatever split a checkpoint records (_ineffective_splits)
        changed = {k: values for k, values in _differing_settings(saved, cfg, RESUME_DEV_SETTINGS).items()
                   if k not in (moved or {})
                   and not (k == "dev_split" and (same_examples or k in _ineffective_splits(cfg)))}
        # the columns the dev data is read by (--dev-columns, else --columns; checkpoints written before
        # --dev-columns record none), compared as mappings where the examples cannot be: the same written in other
        # words is the same dev data
        read_by = (_saved_dev_column_map(saved), cfg.dev_column_map())
        if read_by[0] != read_by[1] and not same_examples:
            changed["dev_columns"] = read_by
    detail = ", ".join(f"{flag_of(k)}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
    if not changed and None not in (recorded, dev_fingerprint) and not same_examples:
        contents = "its contents" if named else "their texts and scores"
        detail = f"{where}: {contents} differ from the checkpoint's, fingerprint {recorded} -> {dev_fingerprint}"
    if detail:
        without = "--dev-data" if named else "dev_examples"
        raise ValueError(f"cannot resume from {path} with other dev data ({detail}): its best model (step "
                         f"{position.best_step}, {position.best_metric} {position.best:.4f}) was picked on the "
                         f"checkpoint's, and scores on other data do not compare with it. Resume with the checkpoint's "
                         f"dev data, or without {without} (the best stays the checkpoint's), or start a new run in a "
                         "new --output-dir")


def _same_dev_examples(position: Position, dev_fingerprint: str | None) -> bool:
    """Whether this run's dev set (dev_fingerprint) is the checkpoint's: the fingerprint is of the examples as read
    (texts and scores after the column mapping: trainer.dev_set_fingerprint), so equal ones are the same dev set
    whatever file or columns they were read from. False where either side records none."""
    return None not in (position.dev_fingerprint, dev_fingerprint) and position.dev_fingerprint == dev_fingerprint


# Keys of a model's config that say where it was loaded from or how it runs, not which model it is: a local snapshot of
# a hub model records another _name_or_path (and may name another head in architectures), and --model-dtype may change
# on resume (RESUME_NOTED)
CONFIG_NOT_THE_MODEL = ("_name_or_path", "_commit_hash", "transformers_version", "torch_dtype", "dtype",
                        "_attn_implementation", "_attn_implementation_autoset", "architectures", "use_cache")
SAMPLED_VALUES = 64  # of each frozen weight tensor, spread over it: base_model_record's fingerprint


def base_model_record(encoder, *, given: bool = False, lora_path: str | None = None) -> dict:
    """What identifies the model a run trains beyond the weights its checkpoints hold, recorded in them and compared
    on resume (_compare_base_model): the model's config (as JSON, without CONFIG_NOT_THE_MODEL) with the transformers
    version that wrote it, and a fingerprint of its frozen weights (LoRA's base model; none with full fine-tuning,
    whose every weight a checkpoint holds) from SAMPLED_VALUES values of each tensor with its name, shape and dtype:
    cheap at any size (a hash of every value would read the whole model), and two models that share config and shapes
    still differ in nearly every value. given: the model was given to train(), not named by --model (the messages say
    so). lora_path: the adapter the run's LoRA started from (--lora-path), recorded by its absolute path and contents
    (models.adapter_fingerprint; None: a new adapter), compared by its contents on resume (_refuse_another_model).
    Taken before --fsdp shards the weights."""
    digest, dtypes = hashlib.sha256(), set()
    with torch.no_grad():
        for name, weight in sorted(encoder.named_parameters()):
            if weight.requires_grad:
                continue
            flat = weight.detach().reshape(-1)
            at = torch.linspace(0, flat.numel() - 1, min(flat.numel(), SAMPLED_VALUES)).long().to(flat.device)
            values = flat[at].cpu().contiguous().view(torch.uint8).numpy().tobytes()  # bf16 has no numpy dtype
            digest.update(f"{name}|{tuple(weight.shape)}|{weight.dtype}|".encode() + values)
            dtypes.add(str(weight.dtype))
    return {"config": _config_json(encoder.backbone.config), "transformers_version": transformers.__version__,
            "weights": digest.hexdigest()[:16], "weights_dtype": ",".join(sorted(dtypes)), "given": given,
            "adapter": lora_path and {"path": os.path.abspath(lora_path), "contents": adapter_fingerprint(lora_path)}}


def _config_json(config) -> str:
    """A model's config as base_model_record records it: its to_dict() without CONFIG_NOT_THE_MODEL, as JSON."""
    kept = {k: v for k, v in config.to_dict().items() if k not in CONFIG_NOT_THE_MODEL}
    # a value JSON cannot write is recorded by its type: its str() may hold a memory address, other in every process
    return json.dumps(kept, sort_keys=True, default=lambda value: f"<{type(value).__name__}>")


def _as_this_version_writes(config: dict, config_class) -> dict:
    """A config another transformers version recorded (base_model_record's), read and written again by this one's
    `config_class` (the loaded model's), as it reads the model's config.json: a newer version writes some settings in
    another form (LLaMA's rope_scaling as rope_parameters, with rope_theta in it) and a default it once left unset
    explicitly (head_dim: None -> 8). A config this version cannot read is compared as recorded."""
    try:
        return json.loads(_config_json(config_class.from_dict(dict(config))))
    except (TypeError, ValueError, KeyError, AttributeError):  # a form this version no longer reads: as recorded
        return config


def _compare_base_model(path: str, saved: dict, cfg: TrainConfig, recorded: dict | None, current: dict | None, *,
                        config_class) -> str | None:
    """A resume whose model is another than the checkpoint's (base_model_record) is refused: its model type or frozen
    weights differ (compared where both are in the same dtype: another --model-dtype gives other values of the same
    model), or its config does, under the transformers version that wrote the checkpoint's. --model's name is
    compared by where it leads (_same_setting), which cannot tell a hub name's model from a local folder, nor see a
    folder whose files changed since; this can. Config keys that one side lacks are left out.

    Under another transformers version (or one the checkpoint does not record) the checkpoint's config is first
    written as this version writes it (_as_this_version_writes), and a difference left is said in a note (returned),
    not refused: a version may write the same model's config in a form this one does not turn back, and the weights
    decide (the frozen ones' fingerprint; with full fine-tuning the checkpoint holds every weight). Checkpoints written
    before the record, and runs given a model without one, compare the names and the trained weights alone."""
    if recorded is None or current is None:
        return None
    old, new = json.loads(recorded["config"]), json.loads(current["config"])
    written_by, this_version = recorded.get("transformers_version"), current["transformers_version"]
    other_type = old.get("model_type") != new.get("model_type")  # another architecture, whatever writes it
    if written_by != this_version and not other_type:
        old = _as_this_version_writes(old, config_class)
    changed = sorted(k for k in old.keys() & new.keys() if old[k] != new[k])
    shown = ", ".join(f"{k}: {old[k]!r} -> {new[k]!r}" for k in changed[:3]) + (", ..." if len(changed) > 3 else "")
    weights_compared = recorded["weights_dtype"] == current["weights_dtype"]
    problems = []
    if changed and (written_by == this_version or other_type):
        problems.append(f"its config differs ({shown})")
    if weights_compared and recorded["weights"] != current["weights"]:
        problems.append(f"its frozen weights differ (fingerprint {recorded['weights']} -> {current['weights']})")
    model = "the model given to train()" if current.get("given") else f"--model {cfg.model}"
    if problems:
        trained = ("the model given to train()" if recorded.get("given") else f"--model {saved.get('model')!r}")
        advice = "Give train() the checkpoint's model" if current.get("given") else \
            "Give --model the checkpoint's model (a local folder of it is fine)"
        raise ValueError(f"cannot resume from {path} (--resume) with {model}: it is not the model the checkpoint "
                         f"trained ({trained}): {'; '.join(problems)}. {advice}, or start a new run in a new "
                         "--output-dir")
    if not changed:
        return None
    weights = ("its frozen weights match the checkpoint's" if weights_compared and recorded["weights_dtype"] else
               "its frozen weights are in another dtype, not compared" if recorded["weights_dtype"] else
               "the checkpoint holds every weight the run trains")
    writer = f"transformers {written_by}" if written_by else "a transformers version it does not record"
    return (f"resuming with {model}, whose config differs from the checkpoint's ({shown}), which {writer} wrote "
            f"and this run's {this_version} reads: another version may "
            f"write the same model's settings another way, so the model type and the weights decide ({weights}); "
            "check that these settings are the model's own")


def _refuse_another_model(path: str, saved: dict, cfg: TrainConfig, *, model_given: bool = False,
                          adapters: tuple[dict | None, dict | None] | None = None) -> None:
    """A resume whose settings make the weights compute something else (RESUME_MODEL_SETTINGS) is refused. --model's
    name is left out where a model was given to train() in its place, in this run or the checkpoint's (model_given):
    it names nothing that trained or trains, and the model itself is compared (_compare_base_model: its config and
    frozen weights; _refuse_other_weights: its trained weights' names and shapes). --lora-path is compared by the
    adapter's contents where both runs record them (`adapters`: the checkpoint's base_model_record's "adapter" and
    this run's): a copy or a move of the adapter is the same, another adapter under the same name is not; by its name
    (_same_setting) where the checkpoint was written before they were recorded (adapters None)."""
    current = asdict(cfg)
    changed = {k: (saved[k], current[k]) for k in RESUME_MODEL_SETTINGS
               if k in saved and not (k == "model" and model_given) and not (k == "lora_path" and adapters)
               and not _same_setting(k, saved[k], current[k])}
    contents = adapters and tuple((record or {}).get("contents") for record in adapters)
    if contents and contents[0] != contents[1]:
        changed["lora_path"] = tuple(record and record["path"] for record in adapters)
    # the prompts by the templates each role of a text gets, not by how they are spelled: a name or the template it
    # stands for ('angle', 'Prompts.A'), a --query-prompt that is the --prompt it would default to
    if prompts_of(saved).as_dict() == cfg.prompts().as_dict():
        changed = {k: values for k, values in changed.items() if k not in PROMPT_SETTINGS.values()}
    if changed:
        detail = ", ".join(f"{flag_of(k)}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
        if contents and "lora_path" in changed and None not in contents:  # (the last of them; not for no adapter)
            detail += f" (another adapter: its contents {contents[0]} -> {contents[1]})"
        raise ValueError(f"cannot resume from {path}: these settings differ from the checkpoint's ({detail}), and "
                         "they decide what its weights compute. Resume with the checkpoint's settings, or start a new "
                         "run in a new --output-dir")


# The settings that name a local file or folder where one is there (else a Hugging Face hub name, or builtin:NAME)
LOCAL_PATH_SETTINGS = ("model", "train_data", "dev_data", "lora_path")
# The switches whose None (not given) is off: a checkpoint's false (written before they took None) is the same
OFF_WHEN_NONE = ("bidirectional",)


def _same_setting(name: str, saved, current) -> bool:
    """Whether a setting's value is the checkpoint's. A local path (LOCAL_PATH_SETTINGS) by where it is: a relative
    path, an absolute one or a link to the same file or folder is the same; a local --model folder also matches a
    checkpoint's --model that leads nowhere here (a relative path from another working directory, a folder moved
    since the checkpoint, or a hub name whose snapshot it is): the name alone cannot tell, so the model it loads is
    compared with the checkpoint's (its config and frozen weights: _compare_base_model; its trained weights
    must fit too: _refuse_other_weights). A switch of OFF_WHEN_NONE by whether it is on. Other values, hub names among
    them, are compared as text."""
    if saved == current:
        return True
    if name in OFF_WHEN_NONE:
        return bool(saved) == bool(current)
    local = name in LOCAL_PATH_SETTINGS and isinstance(saved, str) and isinstance(current, str)
    if not local or not os.path.exists(current):
        return False
    if not os.path.exists(saved):
        return name == "model"
    return os.path.realpath(saved) == os.path.realpath(current)


# The settings that shape the trainable weights of a LoRA run: a checkpoint's adapters fit only the same ones.
LORA_SHAPE_SETTINGS = ("lora", "lora_r", "lora_targets")


def _refuse_other_weights(path: str, saved_cfg: dict, cfg: TrainConfig, saved: dict, current: dict) -> None:
    """Refuse a checkpoint whose trainable weights do not fit this run's (other names or shapes), before anything
    is loaded: with LoRA settings that differ from the checkpoint's, naming them; else as another model's."""
    missing, extra = set(current) - set(saved), set(saved) - set(current)
    reshaped = sorted(k for k in set(current) & set(saved) if tuple(saved[k].shape) != tuple(current[k].shape))
    if not (missing or extra or reshaped):
        return
    now = asdict(cfg)
    changed = {k: (saved_cfg[k], now[k]) for k in LORA_SHAPE_SETTINGS if k in saved_cfg and saved_cfg[k] != now[k]}
    if changed:
        detail = ", ".join(f"{k}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
        flags = ", ".join(" ".join(flag_words(k, old)) if old != [] else f"no {flag_of(k)}"
                          for k, (old, _) in changed.items())
        raise ValueError(f"cannot resume from {path}: its LoRA settings differ from the flags ({detail}), so its "
                         f"trained weights do not fit this model; resume with the checkpoint's ({flags}), or start a "
                         "new run in a new --output-dir")
    if missing:
        raise ValueError(f"checkpoint {path} lacks trainable weights, e.g. {sorted(missing)[:3]}: another model?")
    example = reshaped[0] if reshaped else min(extra)
    raise ValueError(f"checkpoint {path} holds trainable weights this model does not have in that shape (e.g. "
                     f"{example}): another model?")


def _changes_shown(changed: dict) -> str:
    """'--flag old -> new, ...' for {setting: (the checkpoint's value, this run's)}; a setting not given (None: --epochs
    beside --max-steps, no --max-steps) reads "not given", not Python's None."""
    def shown(value) -> str:
        return "not given" if value is None else repr(value)

    return ", ".join(f"{flag_of(k)} {shown(old)} -> {shown(new)}" for k, (old, new) in changed.items())


def _changed_optimizer_settings(saved: dict, cfg: TrainConfig) -> dict:
    """{setting: (checkpoint's value, this run's)} of the RESUME_APPLIES settings that differ. --epochs not given
    (None: --max-steps sets the length) is its default there: a checkpoint that recorded the default 1.0 for it
    (before a given --epochs was told apart from none) did not change it."""
    current = asdict(cfg)

    def value(settings: dict, name: str):
        return default_of(name) if name == "epochs" and settings[name] is None else settings[name]

    return {k: (saved.get(k), current[k]) for k in RESUME_APPLIES
            if k in saved and value(saved, k) != value(current, k)}


def _apply_optimizer_settings(optimizer, scheduler, saved_schedule: dict, settings: list[dict]) -> None:
    """Restore the schedule's position (saved_schedule) with this run's settings: each parameter group's
    hyper-parameters as this run built them (`settings`: lr, weight decay... per group, before the checkpoint's were
    loaded over them), the schedule's peak its --lr, and the learning rate the one this run's schedule gives at the
    saved step. With unchanged settings that is the saved learning rate, bit for bit."""
    scheduler.load_state_dict(saved_schedule)  # the step count; its peak (base_lrs) is replaced below
    scheduler.base_lrs = [group["initial_lr"] for group in settings]
    lrs = [base * factor(scheduler.last_epoch) for base, factor in zip(scheduler.base_lrs, scheduler.lr_lambdas)]
    for group, built, lr in zip(optimizer.param_groups, settings, lrs):
        group.update({key: value for key, value in built.items() if key != "params"}, lr=lr)
    scheduler._last_lr = lrs  # what get_last_lr() reports until the next step


def _differing_settings(saved: dict, cfg: TrainConfig, names: tuple[str, ...]) -> dict:
    """{setting: (the checkpoint's value, this run's)} of those of `names` that differ (_same_setting: a local path
    by where it is; a setting the checkpoint does not record counts as None there)."""
    current = asdict(cfg)
    return {k: (saved.get(k), current[k]) for k in names if not _same_setting(k, saved.get(k), current[k])}


# The data settings a checkpoint records the contents of (_moved_data), as its lines name the data
MOVED_DATA = {"train_data": "training data", "dev_data": "dev data"}


def _moved_data(saved: dict, cfg: TrainConfig, position: Position, current: dict | None,
                dev_fingerprint: str | None) -> dict:
    """{setting: (the checkpoint's value, this run's)} of --train-data and --dev-data where they name other data than
    the checkpoint's (a file moved, renamed or copied: _same_setting compares where a path leads) whose contents are
    the ones the checkpoint recorded: every example's fingerprint (Position.data_record's "contents"; `current`: this
    run's record) or the dev set's (Position.dev_fingerprint). The same contents make the same batches and scores,
    whatever the name. A checkpoint that records only the sampled fingerprint of earlier versions, or none, compares
    the names alone, as it did."""
    record = position.data_record or {}
    same = {"train_data": current is not None and "contents" in record
            and (record["examples"], record["contents"]) == (current["examples"], current["contents"]),
            "dev_data": _same_dev_examples(position, dev_fingerprint)}
    return {name: values for name, values in _differing_settings(saved, cfg, tuple(MOVED_DATA)).items()
            if same[name] and all(values)}  # a name on both sides: data given to train() as objects has none


def _ineffective_splits(cfg: TrainConfig) -> set[str]:
    """The split settings that read nothing in this run: --train-split with a --train-data file, --dev-split with a
    --dev-data file (data.has_no_splits: read whole). A run started before such a split was refused
    (trainer.check_split_settings) recorded the one it was given, to no effect; compared, the split refused the resume
    without the flag as other data, and with it the run is refused before the data is read."""
    return {name for name, source in (("train_split", cfg.train_data), ("dev_split", cfg.dev_data))
            if has_no_splits(source)}


def _refuse_changed_data_settings(path: str, saved: dict, cfg: TrainConfig, moved: dict | None = None, *,
                                  train_named: bool = True) -> None:
    """The data settings (RESUME_MUST_MATCH) against the checkpoint's, but for data found the same by contents under
    another name (`moved`: _moved_data), a split that reads nothing here (_ineffective_splits), and the settings that
    name and read --train-data (TRAIN_DATA_SETTINGS) unless both runs read it (train_named): training examples given
    to train() in either are compared by the checkpoint's record of them (_refuse_other_data)."""
    settled = {*(moved or {}), *_ineffective_splits(cfg), *(() if train_named else TRAIN_DATA_SETTINGS)}
    changed = {k: values for k, values in _differing_settings(saved, cfg, RESUME_MUST_MATCH).items()
               if k not in settled}
    if changed:
        detail = ", ".join(f"{flag_of(k)}: {old!r} -> {new!r}" for k, (old, new) in changed.items())
        raise ValueError(f"cannot resume from {path}: these settings differ from the checkpoint's ({detail}); "
                         "resuming would skip or repeat training data. Resume with the checkpoint's settings, "
                         "or start a new run in a new --output-dir")


def _refuse_shorter_run(path: str, cfg: TrainConfig, step: int, total_steps: int) -> None:
    """A resume whose run ends before the checkpoint's step is refused: it would have nothing to train and report
    the checkpoint's later step as the end of a shorter run."""
    length = f"--max-steps {cfg.max_steps}" if cfg.max_steps else f"--epochs {cfg.epochs:g}"
    raise ValueError(f"cannot resume from {path}: it is at step {step}, and this run ends at step {total_steps} "
                     f"({length}). Resume with a run of at least {step} steps (--max-steps {step} or more), or start "
                     "a new run in a new --output-dir")


def _refuse_other_data(path: str, saved: dict, cfg: TrainConfig, position: Position, current: dict, *,
                       train_given: bool = False, train_named: bool = True) -> None:
    """A resume whose epoch would be made of other examples, or of the same ones in another order, is refused: the
    run would go on through batches that train some examples twice and skip others, in silence. The settings that
    fix both are compared by name first (RESUME_MUST_MATCH); what they name can still change under them (a file
    edited or replaced, --columns, or with --bucket the token counts the order sorts by, which --max-length
    changes). Where either run was given its examples (train_given: this one; train_named: both read --train-data)
    this record is all that compares them, their format (--data-format's part) included, and the refusal names
    train_examples, or the --train-data this run reads."""
    record = position.data_record
    common = "Resume with the checkpoint's data and settings, or start a new run in a new --output-dir"
    # "contents": every example's fingerprint; "fingerprint": the sampled one of checkpoints written before it
    kind = "contents" if "contents" in record else "fingerprint"
    if (record["examples"], record[kind]) != (current["examples"], current[kind]):
        named = _differing_settings(saved, cfg, ("columns",)) if train_named else {}
        detail = "".join(f"; {flag_of(k)} {old!r} -> {new!r}" for k, (old, new) in named.items())
        counts = (f"({record['examples']:,} examples, fingerprint {record[kind]}; now {current['examples']:,}, "
                  f"fingerprint {current[kind]}{detail}): the batches of epoch {position.epoch} would be made of "
                  "other examples, training some twice and skipping others")
        if train_named:
            raise ValueError(f"cannot resume from {path}: the training data differ from the checkpoint's {counts} "
                             f"(the data file edited or replaced, or read with other --columns). {common}")
        if train_given:
            raise ValueError(f"cannot resume from {path} with train_examples: they differ from the checkpoint's "
                             f"training data {counts}. Give train_examples the checkpoint's examples, or start a new "
                             "run in a new --output-dir")
        raise ValueError(f"cannot resume from {path} with --train-data {cfg.train_data}: it holds other examples than "
                         f"the checkpoint's training data {counts} (given to train() as train_examples). Give "
                         "--train-data the checkpoint's examples, or start a new run in a new --output-dir")
    # the format makes the same examples other batches (format A's texts are scored pairs, B's and C's a query and
    # its positive): compared by name as --data-format where both runs read --train-data, by this record otherwise
    # (not recorded by earlier versions)
    if not train_named and "format" in record and record["format"] != current["format"]:
        current_words, recorded_words = (f"format {fmt} ({', '.join(FORMATS[fmt])})"
                                         for fmt in (current["format"], record["format"]))
        which = (f"with train_examples in {current_words}" if train_given else
                 f"with --train-data {cfg.train_data} read in {current_words}")
        fix = (f"Give train_examples in the checkpoint's format, (examples, {record['format']!r})" if train_given else
               f"Resume with --data-format {record['format']}")
        raise ValueError(f"cannot resume from {path} {which}: the checkpoint's training data are the same examples in "
                         f"{recorded_words}, and the batches of epoch {position.epoch} would train them as another "
                         f"kind of example. {fix}, or start a new run in a new --output-dir")
    if record["order"] != current["order"]:
        if cfg.bucket and record.get("order_version", 1) != current["order_version"]:
            raise ValueError(
                f"cannot resume from {path}: it was written by an earlier angle-train, whose --bucket left out the "
                "longest examples of each epoch's last bucket where the examples do not fill whole batches; this "
                "one leaves out a random choice of them, so with --bucket the batches of epoch "
                f"{position.epoch} come out in another order than the checkpoint's, which would train some examples "
                "twice and skip others. Finish the run with the angle-train that wrote the checkpoint, or start a "
                "new run in a new --output-dir")
        named = _differing_settings(saved, cfg, ("max_length",))
        detail = "".join(f", {flag_of(k)} {old!r} -> {new!r}" for k, (old, new) in named.items())
        raise ValueError(
            f"cannot resume from {path}: the same training data, but the batches of epoch {position.epoch} come "
            f"out in another order than the checkpoint's (--bucket {cfg.bucket} sorts them by the texts' token "
            f"counts{detail}), which would train some examples twice and skip others. {common}")


def _rng_file(rank: int) -> str:
    return f"rng-rank{rank}.pt"


def refuse_other_process_count(path: str, world_size: int) -> None:
    """Refuse to resume the checkpoint at `path` with another number of processes than wrote it (each process's data
    slice and random state continue from its own). Every process sees the same files, so all refuse together, before
    any collective a refusal would leave waiting; the trainer asks as soon as it knows the number, before the model
    loads (load_checkpoint asks again)."""
    written_by = _writers(path)
    if written_by != world_size:
        raise ValueError(f"checkpoint {path} was written by {written_by} process(es) and this run has {world_size}: "
                         f"resume with {written_by} (each process's data slice and random state continue from its "
                         "own)")


def _writers(path: str) -> int:
    """How many processes wrote the checkpoint at `path`: each writes its own _rng_file."""
    return sum(re.fullmatch(r"rng-rank\d+\.pt", name) is not None for name in os.listdir(path))


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
#
# best/ records the step and the dev score that made it the best (angle_train.json's "best"), and a checkpoint the
# best it knew (Position.best, best_step). A run resumed from a checkpoint must end with a best/ of that history: the
# killed run may have replaced best/ after the checkpoint, with a model the resumed run never produces. So a best/
# that a finished checkpoint knew as the best is not deleted when a newer best replaces it: it is moved to
# checkpoints/best-step-N, and deleted once no kept checkpoint knows it (prune_kept_bests). On resume, reconcile_best
# puts the checkpoint's best back in best/ (from there, or from the output folder the checkpoint belongs to when the
# run resumes into another one).

BEST_RECORD_KEY = "best"  # angle_train.json of best/: {"step": N, METRIC: score} (tracking.DEV_METRICS' key)
KEPT_BEST_NAME = re.compile(r"best-step-(\d+)")


def kept_best_path(output_dir: str, step: int) -> str:
    return os.path.join(output_dir, "checkpoints", f"best-step-{step:08d}")


def best_record(folder: str) -> dict | None:
    """The {"step", METRIC} a best/ export records (None: no such folder, or one written without it)."""
    try:
        with open(os.path.join(folder, META_FILE), encoding="utf-8") as f:
            record = json.load(f).get(BEST_RECORD_KEY)
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(record, dict) or not isinstance(record.get("step"), int):
        return None
    return record


def best_holds(folder: str, position: Position) -> bool:
    """Whether `folder` is the export of the best model `position` knows (its step and score)."""
    record = best_record(folder)
    return (record is not None and position.best is not None and record["step"] == position.best_step
            and record.get(position.best_metric) == position.best)


def _kept_bests(output_dir: str) -> dict[int, str]:
    root = os.path.join(output_dir, "checkpoints")
    names = os.listdir(root) if os.path.isdir(root) else []
    return {int(match.group(1)): os.path.join(root, name) for name in names
            if (match := KEPT_BEST_NAME.fullmatch(name))}


def _checkpoint_steps(output_dir: str) -> list[int]:
    return [_step_of(path) for path in finished_checkpoints(output_dir)]


def _keep_best_of_checkpoints(output_dir: str) -> None:
    """Before best/ is replaced: move it to checkpoints/best-step-N when a finished checkpoint was written while it
    was the best (a checkpoint of step N or later: every earlier checkpoint predates it)."""
    best = os.path.join(output_dir, "best")
    record = best_record(best)
    if record is None or not any(step >= record["step"] for step in _checkpoint_steps(output_dir)):
        return
    kept = kept_best_path(output_dir, record["step"])
    if os.path.exists(kept):
        shutil.rmtree(best)
    else:
        move_durably(best, kept)  # copied and synced whole where checkpoints/ is on another file system
        sync_folder(os.path.dirname(kept))  # its new entry on disk before the new best/ takes its old place


def prune_kept_bests(output_dir: str) -> None:
    """Delete the kept bests (checkpoints/best-step-N) that no kept checkpoint knows as its best: a checkpoint knows
    the best of step N if it was written at step N or later and before the next best."""
    kept = _kept_bests(output_dir)
    if not kept:
        return
    current = best_record(os.path.join(output_dir, "best"))
    best_steps = set(kept) | ({current["step"]} if current else set())
    steps = _checkpoint_steps(output_dir)
    for step, path in kept.items():
        following = min((s for s in best_steps if s > step), default=math.inf)
        if not any(step <= s < following for s in steps):
            shutil.rmtree(path, ignore_errors=True)


def save_best(cfg: TrainConfig, encoder, tokenizer, state_dict: dict | None = None, *, base_model: str | None,
              model_card: str | None = None, step: int | None = None, score: float | None = None,
              metric: str = "dev_spearman") -> str:
    """Export the model to output_dir/best (only the adapter for LoRA: best_is_adapter_only), replacing the previous
    best once the new one is complete (kept as checkpoints/best-step-N while a checkpoint knows it). state_dict: a
    sharded (--fsdp) encoder's whole weights (sharding.full_state_dict); base_model: the model trained from, as the
    export records it (_export); model_card: its README.md; step and score: the evaluation that made it the best,
    recorded in its angle_train.json under the key of its dev score `metric`."""
    record = None if step is None else {"step": step, metric: score}
    return _export(cfg, encoder, tokenizer, "best", "the best model",
                   adapter_only=best_is_adapter_only(encoder, base_model), state_dict=state_dict,
                   base_model=base_model, model_card=model_card, record=record)


def best_is_adapter_only(encoder, base_model: str | None) -> bool:
    """Whether best/ holds a LoRA model's adapter alone (small, for LLMs): not where no base model is named to load
    it over (a model given to train() that was built from its config), which then gets its merged weights."""
    return is_peft_model(encoder.backbone) and base_model is not None


def reconcile_best(cfg: TrainConfig, resume_from: str, position: Position) -> str:
    """On resume (main process, with --save-best): make output_dir/best the export of the checkpoint's best model.
    Returns "ok" (best/ holds it now, or the checkpoint knows no best), "export" (it can only be rebuilt from the
    checkpoint's weights, which are that model: the caller exports them) or "missing" (nowhere to be found: best/ is
    then removed rather than left holding another model, and written again when this run's dev score beats the
    checkpoint's). A checkpoint of an older angle_train records no best step: its best/ (recording none either) is
    then left as it is; where the checkpoint names its best's step, a best/ that records none is not that model and
    goes as any other."""
    best = os.path.join(cfg.output_dir, "best")
    record = best_record(best)
    if position.best is None or position.best_step is None:
        if position.best is None and record is not None and record["step"] > position.step:
            _remove_stale_best(best, record, "no best model yet")  # a killed run's, written after the checkpoint
        return "ok"
    if best_holds(best, position):
        return "ok"
    metric = DEV_METRICS[position.best_metric]  # the run's kind of dev score, named in the messages
    source_dir = _output_dir_of(resume_from)
    candidates = [kept_best_path(cfg.output_dir, position.best_step)]
    if source_dir is not None and os.path.realpath(source_dir) != os.path.realpath(cfg.output_dir):
        candidates += [os.path.join(source_dir, "best"), kept_best_path(source_dir, position.best_step)]
    for source in candidates:
        if best_holds(source, position):
            if source == candidates[0]:
                # this folder's own: renamed straight into place (kept again when a newer best replaces it), never
                # staged as best.tmp, which the next export deletes: a kill at any point leaves it under one name
                _swap_in(source, best)
            else:
                tmp = best + ".tmp"
                shutil.rmtree(tmp, ignore_errors=True)
                shutil.copytree(source, tmp)  # another run's folder: copied, never taken from it
                _swap_in(tmp, best)
            print(f"best/: restored the checkpoint's best model (step {position.best_step}, {metric} "
                  f"{position.best:.4f}) from {source}", flush=True)
            return "ok"
    if position.best_step == position.step:
        return "export"
    if record is not None or os.path.isdir(best):
        _remove_stale_best(best, record, f"the checkpoint's best is step {position.best_step}")
    print(f"angle-train: warning: the best model of {resume_from} (step {position.best_step}, {metric} "
          f"{position.best:.4f}) is neither in {best} nor beside the checkpoint; {best} is written again when this "
          f"run's {metric} beats it", file=sys.stderr, flush=True)
    return "missing"


def _remove_stale_best(best: str, record: dict | None, why: str) -> None:
    what = f"step {record['step']}" if record else "no recorded step"
    print(f"best/: removed {best} ({what}): it is not the best model of the checkpoint resumed from ({why})",
          flush=True)
    shutil.rmtree(best)


def _output_dir_of(checkpoint: str) -> str | None:
    """The output folder a checkpoint folder (OUTPUT_DIR/checkpoints/step-N) belongs to, or None."""
    parent = os.path.dirname(os.path.abspath(checkpoint))
    return os.path.dirname(parent) if os.path.basename(parent) == "checkpoints" else None


def _os_error_code(exc: BaseException) -> int | None:
    """The errno of a failed write that safetensors (the weights of an export) reports as its own SafetensorError,
    no OSError ('Error while serializing: I/O error: No space left on device (os error 28)', the errno in Rust's
    words), so that a full disk is the one-line OSError every other refused write is; None for anything else."""
    match = re.search(r"\(os error (\d+)\)", str(exc)) if type(exc).__name__ == "SafetensorError" else None
    return None if match is None else int(match.group(1))


def save_final(cfg: TrainConfig, encoder, tokenizer, state_dict: dict | None = None, *, base_model: str | None,
               while_writing=contextlib.nullcontext, model_card: str | None = None) -> str:
    """Export the final model to output_dir/final (a LoRA model merged into its base), written as final.tmp and
    swapped in once complete, as best/ is. base_model: the model trained from, as the export records it (_export).
    while_writing(): a context around the writing of final.tmp (the loop's StopSignals.interrupting, so that a
    signal abandons the export); a write that ends in an exception leaves no final.tmp behind."""
    return _export(cfg, encoder, tokenizer, "final", "the final model", adapter_only=False, state_dict=state_dict,
                   base_model=base_model, while_writing=while_writing, model_card=model_card)


def _export(cfg: TrainConfig, encoder, tokenizer, name: str, what: str, *, adapter_only: bool, state_dict,
            base_model: str | None, while_writing=contextlib.nullcontext, model_card: str | None = None,
            record: dict | None = None) -> str:
    """Write the export `name` (best, final) as save_pretrained does. base_model, recorded in its angle_train.json
    and a LoRA adapter's adapter_config.json, and loaded under an adapter-only best/: --model, or the name a model
    given to train() was loaded by (export.loaded_name; None where it has none), never --model for a given model,
    which names nothing it was trained from."""
    path = os.path.join(cfg.output_dir, name)
    check_finite_weights(encoder, f"{what} to {path}", state_dict=state_dict)
    tmp = path + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # left by a run killed while writing it
    try:
        with while_writing():
            save_pretrained(encoder, tokenizer, tmp, max_length=cfg.max_length, adapter_only=adapter_only,
                            merge_in_place=False, base_model=base_model, state_dict=state_dict,
                            matryoshka_dims=cfg.trained_widths(encoder.embedding_dim),
                            export_max_length=cfg.export_max_length, model_card=model_card,
                            extra_meta=None if record is None else {BEST_RECORD_KEY: record},
                            base_files=encoder.st_files)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        code = _os_error_code(exc)
        if code is None:
            raise
        raise OSError(code, f"could not write {what} to {tmp} ({os.strerror(code)}): the partial folder was removed "
                            f"and {path} left as it was") from exc
    try:
        if name == "best":
            _keep_best_of_checkpoints(cfg.output_dir)
        _swap_in(tmp, path)  # its sync of tmp can fail as a write does (ENOSPC, EIO)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path
