"""The training loop. `train()` reads like a script; each named step below it is one function:

    run = setup(cfg)                   model, data, loss, optimizer, schedule, logging; resumed if asked
    while steps remain:
        row = optimizer_step(run)      grad_accum batches of batch_size pairs, then clip, AdamW, schedule
        run.log.step(row)              throughput and memory; metrics.jsonl (+ --report-to), progress bar
        evaluate(run)                  every eval_every steps and at the end: the dev score, keep the best
        save_checkpoint(...)           every save_every steps: a checkpoint that resumes exactly
    finish(run)                        export the final model, print a summary

Inside one optimizer step, for each of its grad_accum batches (the data order is a pure function of
(seed, epoch)): this process's slice of the batch is cut into forward passes (data.Batch.plan: its texts sorted by
length, then chunks of chunk_size texts or chunk_tokens tokens for the gradient cache, sub-batches of pass_tokens
tokens for plain backprop, or kept whole; with --pack each pass's texts packed into rows, no padding between them)
and backpropagated by plain backprop or the gradient cache
(grad_cache.py), with the embeddings put back in batch order and every process's gathered into one loss
(distributed.py).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import random
import resource
import shlex
import sys
import time
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Callable

import torch

from angle_kernels import AngleLoss, ArcCSELoss, __version__
from angle_kernels.inputs import check_nested, espresso_layer_weights
from angle_kernels.modules import computes_angle_term, computes_in_batch_term

from . import arccse, distributed, faults, preflight, run_lock, sharding, st_folder, tracking
from .atomic_files import written_aside
from .checkpoint import (
    Position, base_model_record, best_holds, best_is_adapter_only, checkpoint_path, checkpoint_to_resume,
    clear_non_finite_stop, finished_checkpoints, is_own_checkpoint, load_checkpoint, prune_checkpoints, reconcile_best,
    record_non_finite_stop, refuse_other_process_count, refuse_starts_among_run_outputs, remove_earlier_run,
    remove_unfinished_writes, save_best, save_checkpoint, save_final, set_aside_later_line,
)
from .cli_common import resolve_device
from .config import (
    FP16_WEIGHTS_CANNOT_UNSCALE, PROMPT_SETTINGS, TrainConfig, adapter_lora_settings, default_of, flag_of, flag_words,
    for_dev_columns, prompt_flags, whole_as_int,
)
from .data import (
    FORMATS, ORDER_VERSION, ROWS_PER_EXAMPLE, DataError, Example, OneAhead, PackedTexts, PassPlan, TokenizedPairs,
    data_fingerprint, epoch_batches, errors_naming, has_no_splits, holds_one_dataset, load_examples, order_fingerprint,
    repeated_items, sampled_data_fingerprint, share_of,
)
from .export import encoding_length, is_peft_model, loaded_name, prefix_prompts, sentence_transformers_cannot_load
from .evaluate import (
    RetrievalSet, StsSet, check_ranked, check_scored, dataset_of, dev_inputs, dev_metric, encoding_progress,
    library_progress_bars, non_finite_rows, read_dataset, scores_of_embeddings,
)
from .grad_cache import RngState, grad_cache_step, plain_step
from .models import (
    ADAPTER_CONFIG, AUTOCAST_DTYPES, LOOK_UP, PEFT_LORA_DROPOUT, AdapterFitError, LoraSettings, LoraTargetError,
    absolute_if_local, adapted_layer_names, adapter_settings_file, attach_adapter, disable_gradient_checkpointing,
    enable_gradient_checkpointing, export_pooling, first_token_pooling_problem,
    load_encoder, own_bidirectional, own_prompts, past_trained_context_note, position_limit, prepare_tokenizer,
    read_adapter_config, recomputes_activations, ships_own_code, takes_gradient_checkpointing, use_attention,
    wrap_backbone,
)
from .profiling import phase, profiling
from .tiny import BUILTIN_DATASETS, BUILTIN_MODELS, build_backbone, build_tokenizer, builtin_examples

FUSED_ADAMW_DEVICES = ("cuda", "cpu")
# Examples whose texts check packed rows against padded ones at start-up (check_packing): a few forward passes.
PACKING_CHECK_EXAMPLES = 8
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


class StopTraining(Exception):
    """Raised by an on_step callback to end the run at once, as if the process had been killed."""


@dataclass
class TrainResult:
    history: list[dict] = field(default_factory=list)  # one row per optimizer step: step, loss, lr, ...
    evals: list[dict] = field(default_factory=list)  # step, the dev score (best_metric's key), best_<key>, ...
    best_score: float | None = None  # the best dev score: Spearman, or nDCG@10 for (query, positive) dev data
    best_metric: str | None = None  # its key (tracking.DEV_METRICS), None without dev data
    best_path: str | None = None  # OUTPUT_DIR/best when it holds the model of best_score, else None
    final_path: str | None = None
    curves_path: str | None = None  # OUTPUT_DIR/curves.png (tracking.plot_curves), when drawn
    encoder: object = None
    tokenizer: object = None

    @property
    def best_spearman(self) -> float | None:
        """best_score where the dev data is scored pairs (Spearman), else None."""
        return self.best_score if self.best_metric == "dev_spearman" else None


def train(cfg: TrainConfig, *, model=None, train_examples=None, dev_examples=None, loss_fn=None, on_step=None
          ) -> TrainResult:
    """Run training as configured (the Python API; the CLI calls this).

    Overrides for library use and tests: model=(encoder, tokenizer) replaces cfg.model (--fp16 / --bf16, --pooling
    and --gradient-checkpointing apply to it; a --model-dtype or LoRA setting it cannot take is refused:
    refuse_settings_given_model_ignores); train_examples
    ((examples, format); with --objective arccse a list of sentences) and dev_examples (a list of format-A
    examples, or an evaluate.StsSet / RetrievalSet: (query, positive) pairs scored by nDCG@10) replace the data
    paths; loss_fn
    (called as loss_fn(labels, embeddings)) replaces angle_kernels.AngleLoss, e.g. to compare with another
    implementation; on_step(step, row) is called after every optimizer step and may raise StopTraining.

    Faults (faults.py): raises faults.Preempted after SIGTERM / SIGINT / SIGHUP (once the step in progress is done,
    or the final export abandoned, and a checkpoint written), faults.NonFiniteTrainingError after --max-bad-steps
    skipped steps in a row, and torch.OutOfMemoryError with what to change (unless --auto-chunk recovers). Settings,
    paths, the output folder and the data are checked before the model loads (setup).
    """
    with library_progress_bars(cfg.progress):  # --progress 0: transformers' loading and saving bars too
        return _train(cfg, model=model, train_examples=train_examples, dev_examples=dev_examples, loss_fn=loss_fn,
                      on_step=on_step)


def _train(cfg: TrainConfig, *, model, train_examples, dev_examples, loss_fn, on_step) -> TrainResult:
    run = setup(cfg, model=model, train_examples=train_examples, dev_examples=dev_examples, loss_fn=loss_fn)
    # --profile: the second step of this run (the first warms up the allocator and the kernels)
    profile_at = min(run.position.step + 2, run.total_steps) if cfg.profile else 0
    try:
        if run.resumed_from and cfg.save_best:
            with run.log.paused():
                restore_best(run)
        with faults.StopSignals() as signals:
            if run.dev_set and cfg.eval_on_start and run.position.step == 0:
                with run.log.paused():
                    evaluate(run)  # step 0: the score training has to beat
            while run.position.step < run.total_steps:
                with profiling(run.device, enabled=run.position.step + 1 == profile_at) as profile:
                    row = optimizer_step(run)
                # the main process's files of this step (profile.json, metrics.jsonl's row, due on the same steps
                # in every process): where they fail, every process stops (no collective on the other steps)
                with (distributed.stopping_together(run.dist_info)
                      if profile is not None or run.log.writes_row(row["step"]) else contextlib.nullcontext()):
                    if profile is not None:
                        report_profile(run, profile, row)
                    run.log.step(row)
                run.result.history.append(row)
                step = row["step"]
                with run.log.paused():  # pairs/s and tokens/s measure training, not evaluation or checkpoints
                    if not row["skipped"] and run.unverified_checkpoint is not None:
                        trust_checkpoint(run)
                    if run.dev_set and (every(cfg.eval_every, step) or step == run.total_steps):
                        evaluate(run)
                    saved = every(cfg.save_every, step)
                    if saved:
                        save(run)
                        fresh_gradient_buckets(run)
                if on_step is not None:
                    on_step(step, row)
                if faults.any_rank(signals.requested is not None, run.dist_info, run.device):
                    # preempted (on any process): stop here, at the same step everywhere, resumable
                    path = checkpoint_path(cfg.output_dir, step) if saved else save(run)
                    raise faults.Preempted(signals.requested or "a signal to another process", path)
            return finish(run, signals)
    except StopTraining:
        return run.result
    finally:
        run.data_ahead.close()
        run.log.close()
        if run.lock is not None:
            run.lock.release()


def report_profile(run: Run, profile, row: dict) -> None:
    """Print the profiled step's phases and write them to output_dir/profile.json (main process), with the
    fraction of the tokens its forward passes processed that were real text (the rest: padding)."""
    if not run.dist_info.is_main:
        return
    cfg, step, useful = run.cfg, row["step"], row["useful_tokens"]
    settings = {"batch_size": cfg.batch_size, "grad_accum": cfg.grad_accum, "chunk_size": cfg.chunk_size,
                "chunk_tokens": cfg.chunk_tokens, "pass_tokens": cfg.pass_tokens, "sort_passes": cfg.sort_passes,
                "pack": cfg.pack, "useful_tokens": useful, "processes": run.dist_info.world_size,
                "device": str(run.device), "model": run.model_name}
    path = os.path.join(cfg.output_dir, "profile.json")
    profile.save(path, step, **settings)
    print("\n" + profile.table(step) + f"\nreal tokens: {useful:.0%} of those the encoder processed (the rest is "
          f"padding)\n(written to {path})", flush=True)


def save(run: Run) -> str:
    """A resumable checkpoint of the run at its current position (the losses logged since the last metrics row
    included)."""
    run.position.loss_window = list(run.log.losses)
    run.position.data_record = data_record(len(run.dataset), run.data_fingerprint, run.epoch_order,
                                           fmt=getattr(run.dataset, "fmt", None), given="train_examples" in run.given)
    path = save_checkpoint(run.cfg, run.position, run.dist_info, encoder=run.encoder, optimizer=run.optimizer,
                           scheduler=run.scheduler, scaler=run.scaler, sharded=run.cfg.fsdp,
                           base_model=run.base_model)
    run.unverified_checkpoint = run.position.step
    return path


def data_record(examples: int, fingerprint: str, order: list[list[int]], *, fmt: str | None = None,
                sampled: str | None = None, given: bool = False) -> dict:
    """checkpoint.Position.data_record: the examples' count and data_fingerprint ("contents"), their epoch's batch
    order's and the version of epoch_batches that made it (data.ORDER_VERSION), and their data format ("format"; None:
    ArcCSE's sentences). sampled: the examples' sampled_data_fingerprint, the one earlier versions recorded
    ("fingerprint"), given where a checkpoint's record is compared with this one (it may be such a record), never
    written. given: the examples were given to train() (train_examples), not read from --train-data: a resume then
    compares no data flag's name with the checkpoint's (--data-format among them), and this record's format stands for
    --data-format."""
    record = {"examples": examples, "contents": fingerprint, "order": order_fingerprint(order),
              "order_version": ORDER_VERSION, "format": fmt, "given": given}
    return record if sampled is None else {**record, "fingerprint": sampled}


def dev_set_fingerprint(dev_set: StsSet | RetrievalSet) -> str:
    """checkpoint.Position.dev_fingerprint: data.data_fingerprint of the scored pairs, or of the queries followed by
    their documents."""
    return data_fingerprint(dev_set.examples if isinstance(dev_set, StsSet) else dev_set.queries + dev_set.documents)


def trust_checkpoint(run: Run) -> None:
    """After a finite step taken from the weights of the newest checkpoint (no finite step came between: the steps
    since it was written, if any, were skipped and changed nothing): that checkpoint is the last good one now
    (Position.good_checkpoint), which pruning keeps beyond --keep-checkpoints until a newer one is good, and the
    good one before it may go."""
    run.position.good_checkpoint, run.unverified_checkpoint = run.unverified_checkpoint, None
    with distributed.stopping_together(run.dist_info):
        if run.dist_info.is_main:
            prune_checkpoints(run.cfg.output_dir, keep=run.cfg.keep_checkpoints,
                              good_step=run.position.good_checkpoint)


def fresh_gradient_buckets(run: Run) -> None:
    """Under DDP, a new wrapper after a checkpoint, as a run resumed from it starts with: DDP groups the gradients
    into buckets in parameter order for its first backward, then by the order they became ready, and each bucket's
    all-reduce sums an element over 3 or more processes in an order that depends on where it sits (2 processes
    add a + b either way). With the same wrapper throughout, a resumed run's first step summed in another order
    than the uninterrupted run's (weights apart by rounding, growing with training); now both start each checkpoint's
    next step with a new wrapper (the weights, the same everywhere, are not broadcast again)."""
    if isinstance(run.model, torch.nn.parallel.DistributedDataParallel):
        run.model = distributed.wrap_ddp(run.encoder, run.device, equal_weights=True)


def every(interval: int, step: int) -> bool:
    """Whether a periodic action (interval 0 = never) is due after this step."""
    return interval > 0 and step % interval == 0


# ------------------------------------------------------------------------------------------------- setup


@dataclass
class Run:
    """Everything the steps share: built by setup(), advanced by the loop."""

    cfg: TrainConfig
    device: torch.device
    dist_info: distributed.DistInfo
    encoder: torch.nn.Module  # the Encoder itself (sharded in place with --fsdp): saved, evaluated and exported
    model: torch.nn.Module  # what the steps call: the encoder, or its DDP wrapper when there are several processes
    tokenizer: object
    dataset: TokenizedPairs | arccse.TokenizedSentences
    dev_set: StsSet | RetrievalSet | None  # what the dev evaluation scores (evaluate.dev_scores)
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    guarded_loss: faults.SkipNonFiniteEmbeddings  # loss_fn as the steps call it: NaN/Inf embeddings make a bad step
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    scaler: torch.amp.GradScaler
    total_steps: int
    position: Position
    epoch_order: list[list[int]]  # the batches of position.epoch: example indices, batch_size per batch
    data_fingerprint: str  # of the training examples (data.data_fingerprint): checkpoints record it (data_record)
    log: RunLog
    result: TrainResult
    lock: run_lock.RunLock | None = None  # the output folder's lock, held by the main process (setup)
    command: str = ""  # the angle-train command of the settings (TrainConfig.command_line): the model cards'
    loss_name: str = "AngleLoss"  # AngleLoss, ArcCSELoss, or the loss_fn given to train()
    given: tuple = ()  # which of train()'s model, train_examples, dev_examples replaced flags (the model cards)
    resumed_from: str | None = None  # the checkpoint the run continues from
    base_model: dict | None = None  # checkpoint.base_model_record of the model as loaded: checkpoints record it
    # the model the exports name as their base (checkpoint._export): --model, or the name a model given to train() was
    # loaded by (None: it has none)
    exports_base: str | None = None
    # the words the messages and profile.json name the model by: --model, or given_model_words for a model given to
    # train()
    model_name: str = ""
    # the step of output_dir's newest checkpoint of this run (written, or resumed from) until a finite step is taken
    # from its weights (trust_checkpoint), None after that
    unverified_checkpoint: int | None = None
    data_ahead: OneAhead = field(default_factory=OneAhead)  # the next step's batches, made while this one runs
    # (epoch, its batch_order) computed on data_ahead's thread for the next epoch's first batches: next_batches takes
    # it rather than shuffling again on the main thread (a tuple, set whole)
    next_epoch_order: tuple[int, list[list[int]]] | None = None


def setup(cfg: TrainConfig, *, model=None, train_examples=None, dev_examples=None, loss_fn=None) -> Run:
    """Take the output folder's lock (run_lock.py: one run per folder; the main process of a torchrun job), then
    build the run (_setup); a setup that fails releases the lock. The run's end releases it (train())."""
    given_lora = cfg.given_lora_settings()  # before validate() gives the others their defaults
    cfg.validate()
    if model is not None:  # before the lock and any work: a setting the model cannot take is refused
        refuse_settings_given_model_ignores(cfg, model[0], given_lora=given_lora)
    preflight.check_device(cfg.device)
    preflight.check_attention(cfg.attention, cfg.device)
    if model is None:
        preflight.check_model_to_train(cfg.model, cfg.revision)
    lock = output_dir_lock(cfg.output_dir) if distributed.launched_rank() == 0 else None
    given_settings = given_model_settings(model[0]) if model is not None else None
    try:
        run = _setup(cfg, model=model, train_examples=train_examples, dev_examples=dev_examples, loss_fn=loss_fn)
    except BaseException:
        if lock is not None:
            lock.release()
        if given_settings is not None:
            restore_given_model_settings(model[0], given_settings)
        raise
    run.lock = lock
    return run


# The settings of a model given to train() that the setup sets from the run's (apply_settings_to_given_model, _setup)
GIVEN_MODEL_SETTINGS = ("pooling", "autocast", "prompts", "max_length", "bidirectional", "attention_implementation",
                        "training")


def given_model_settings(encoder) -> dict:
    """What restore_given_model_settings puts back: GIVEN_MODEL_SETTINGS' values and whether the backbone recomputes
    its activations (--gradient-checkpointing)."""
    settings = {name: getattr(encoder, name) for name in GIVEN_MODEL_SETTINGS if hasattr(encoder, name)}
    settings["gradient_checkpointing"] = recomputes_activations(encoder.backbone)
    return settings


def restore_given_model_settings(encoder, settings: dict) -> None:
    """A model given to train() as it was given, after a setup that refused to train it: the refused run's --pooling,
    autocast, prompts, length, attention and gradient checkpointing were set on it, and a second train() after the
    fix (--pooling left out) trained with the refused pooling in silence. Its weights and device are as the setup
    left them (a resumed checkpoint's, the run's device)."""
    checkpointing = settings.pop("gradient_checkpointing")
    for name, value in settings.items():
        if name == "training":
            encoder.train(value)
        else:
            setattr(encoder, name, value)
    if checkpointing is False and recomputes_activations(encoder.backbone):
        disable_gradient_checkpointing(encoder.backbone)


def output_dir_lock(output_dir: str) -> run_lock.RunLock:
    """run_lock.acquire, with a folder that cannot be made (a file in its place or in its path, no permission)
    refused naming --output-dir."""
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"--output-dir {output_dir} is a file, not a folder: name a folder")
    try:
        return run_lock.acquire(output_dir)
    except (FileExistsError, NotADirectoryError, PermissionError) as exc:
        raise ValueError(f"--output-dir {output_dir}: the folder cannot be made or written ({exc.strerror}: "
                         f"{exc.filename})") from None


def _setup(cfg: TrainConfig, *, model=None, train_examples=None, dev_examples=None, loss_fn=None) -> Run:
    """Build everything the loop needs (see train() for the overrides) and restore a checkpoint if asked.

    Cheap checks come first, so a mistake fails in seconds, before the model loads: the settings, the paths, the
    output folder (an earlier run is not overwritten by accident), the data and what the data format needs; then
    the model, and what the model's limits need."""
    cfg.validate()
    # what train() was given in place of the flags (the model cards say so), before the flags fill them in
    given = tuple(name for name, value in (("model", model), ("train_examples", train_examples),
                                           ("dev_examples", dev_examples)) if value is not None)
    command = cfg.command_line()  # as given, before the defaults below are resolved: the model cards' record
    cfg.check_paths(model=model is None, train_data=train_examples is None, dev_data=dev_examples is None)
    refuse_starts_among_run_outputs(cfg, model=model is None)
    tracking.resolve_report_to(cfg.report_to)  # a tracker that cannot run: refused before the model loads
    resume_from = checkpoint_to_resume(cfg)
    device = resolve_device(cfg.device)
    packing_asked = cfg.pack is not None
    cfg.resolve_passes(device.type)
    distributed.check_process_device(device)
    dist_info = distributed.init_distributed(device.type, timeout_s=cfg.ddp_timeout)
    check_batch_shares(cfg, dist_info.world_size)  # before the model loads
    if resume_from:  # before the model loads: minutes for a large one
        refuse_other_process_count(resume_from, dist_info.world_size)
    if dist_info.enabled and device.type == "cuda":
        device = torch.device("cuda", dist_info.local_rank)
    if cfg.auto_chunk and dist_info.enabled:
        raise ValueError("--auto-chunk works with one process: an out-of-memory error on one rank would leave the "
                         "others waiting in the all-gather; set --chunk-size instead")
    if cfg.fsdp and not dist_info.enabled:
        raise ValueError("--fsdp shards the model over several processes: launch with torchrun "
                         "--nproc-per-node N (N >= 2), or leave out --fsdp on one")
    prompts = cfg.prompts()
    check_split_settings(cfg, train_examples_given=train_examples is not None,
                         dev_examples_given=dev_examples is not None)

    reading = time.perf_counter()
    if cfg.objective == "arccse":
        sentences, fmt = read_sentences(cfg, train_examples), None
        check_data_size(cfg, len(sentences), "sentences", train_examples is None)
    else:
        examples, fmt = train_examples or read_data(cfg.train_data, cfg.data_format, cfg.train_split,
                                                    cfg.column_map(), split_setting="train_split")
        check_format_settings(cfg, fmt)
        if loss_fn is None:
            check_labels(cfg, examples, fmt, train_examples is None)
        check_data_size(cfg, len(examples), "examples", train_examples is None)
    read_seconds = time.perf_counter() - reading
    dev_set = dev_set_of(dev_examples, cfg)
    check_data_settings(cfg, train_examples_given=train_examples is not None,
                        dev_examples_given=dev_examples is not None, dev_set=dev_set)
    dev_size_note = small_dev_set_note(dev_set, dev_set_name(dev_examples, cfg))
    dev_fingerprint = None if dev_set is None else dev_set_fingerprint(dev_set)

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)  # same model (and LoRA) initialisation on every rank
    # the export whose angle_train.json records how the model embeds: --model's, or that of an adapter angle_train
    # exported (--lora-path best/ or final/adapter), trained with its pooling, attention and prompts (_build_encoder)
    lora_settings = lora_settings_file(cfg) if model is None else None
    settings_folder = (os.path.dirname(lora_settings) or os.curdir) if lora_settings else cfg.model
    settings_file = f"the adapter's {lora_settings}" if lora_settings else f"the model folder's {st_folder.META_FILE}"
    prompts_record = lora_settings or f"{cfg.model}'s {st_folder.META_FILE}"
    # an export trained with bidirectional attention trains so again, as its pooling is kept: without the flag its
    # causal mask came back in silence (step 0's dev score fell from the export's own); a model given to train() keeps
    # its own; --bidirectional given decides (0 against the export's: said). Recorded in cfg where on (None: causal,
    # the flag not given, which the model card's command leaves out; an explicit 0 it keeps).
    exports_attention = model is None and own_bidirectional(settings_folder)
    folders_attention = cfg.bidirectional is None and exports_attention  # taken from the export: the start line says
    if cfg.bidirectional is None and (exports_attention or (model is not None and model[0].bidirectional)):
        cfg.bidirectional = True
    elif exports_attention and not cfg.bidirectional and dist_info.is_main:
        print(f"angle_train: note: --bidirectional 0 trains the model with its causal mask, and {settings_file} "
              "records that it was trained with bidirectional attention", flush=True)
    # an export's prompts are not taken over (a run may want others) but said where the run gives none: trained from it
    # without them, a model learns bare texts where it had learned prompted ones
    gives_prompts = any(getattr(cfg, name) is not None for name in PROMPT_SETTINGS.values())
    folders_prompt_flags = "" if model is not None or gives_prompts else prompt_flags(own_prompts(settings_folder))
    encoder, tokenizer = build_encoder(cfg, device, lora_settings=lora_settings) if model is None else (
        apply_settings_to_given_model(cfg, model[0]).to(device), model[1])
    encoder.prompts = prompts  # evaluation, best/ and final/ embed as training does
    # before --fsdp shards the weights; on the main process, which prints it
    weights_note = half_precision_weights_note(cfg, encoder) if dist_info.is_main else None
    # encode() on the trained encoder cuts texts where its exports' encode() will (the default, 512, was another), by
    # the model's sentence-transformers files as its loading found them (Encoder.st_files, the exports' base files:
    # checkpoint._export): --model's (for a hub name, a second lookup fetched them), or a given model's own, never
    # looked up under --model, which names nothing there (a folder of that name gave it another model's files)
    encoder.max_length = encoding_length(cfg.max_length, encoder.st_files, cfg.export_max_length,
                                         position_limit(encoder.backbone))
    encoder.bidirectional = bool(cfg.bidirectional)  # a model given to train() too
    torch.manual_seed(cfg.seed + dist_info.rank)  # distinct dropout masks per rank
    pooling_source = encoder.pooling_source if model is None else (
        "--pooling" if cfg.pooling is not None else "the model given to train()")
    # --model names nothing of a model given to train(): the exports name the model it was loaded by as their base
    # (named --model, a LoRA model's adapter-only best/ was loaded over that model), and so do the messages; a local
    # folder by its absolute path, as the working folder is now (it may change before the exports are written)
    exports_base = absolute_if_local(cfg.model if model is None else loaded_name(encoder.backbone))
    model_name = cfg.model if model is None else given_model_words(exports_base)
    check_model_settings(cfg, encoder, fmt, pooling_source=pooling_source, model_name=model_name)
    preflight.check_tokenizer(tokenizer, encoder, model_name, cfg.max_length)
    # a rotary model reads past its trained context without an error (a position table's limit is refused above):
    # said, before --fsdp wraps the backbone
    context_notes = [note for flag, length in (("--max-length", cfg.max_length),
                                               ("--export-max-length", cfg.export_max_length))
                     if length and (note := past_trained_context_note(encoder.backbone, flag, length, model_name))]
    cfg.pooling = encoder.pooling  # config.json and the checkpoints record the pooling the run uses
    pooling_note = first_token_pooling_note(encoder, pooling_source)
    items = sentences if cfg.objective == "arccse" else examples
    total_steps = count_steps(cfg, len(items), dist_info.world_size)
    fingerprint = data_fingerprint(items)
    distributed.check_processes_agree(dist_info, {
        "checkpoint to resume": resume_from and os.path.basename(resume_from), "examples": len(items),
        "data fingerprint": fingerprint, "steps": total_steps})
    if dist_info.is_main:  # said before it starts: at a million pairs, tokenising is the minutes of the start-up
        print(tokenising_line(cfg, len(items), fmt, None if train_examples is not None else read_seconds), flush=True)
    # each process tokenises its share of the texts, and every process gets all of them (the same data: above)
    if cfg.objective == "arccse":
        dataset = arccse.TokenizedSentences(sentences, tokenizer, max_length=cfg.max_length,
                                            mask_rates=cfg.mask_rates, seed=cfg.seed, prompt=prompts,
                                            processes=dist_info, blocks=arccse.blocks_of(cfg.triplet_w))
    else:
        dataset = TokenizedPairs(examples, fmt, tokenizer, max_length=cfg.max_length, prompt=prompts,
                                 processes=dist_info)
    # the packing check's forward runs on the whole model: after sharding, a forward outside training left FSDP's
    # root unit (a LLaMA's token embeddings and final norm) unsharded, and the optimizer held those plain tensors,
    # which FSDP replaced at the first backward: they never trained
    check_packing(cfg, encoder, dataset, device, packing_asked, dist_info)
    # of whole tensors: before --fsdp shards them
    base_model = base_model_record(encoder, given=model is not None, lora_path=cfg.lora_path)
    if cfg.fsdp:
        sharding.shard(encoder)  # before the optimizer, which holds the shards
    loss_name = ("ArcCSELoss" if cfg.objective == "arccse" else "AngleLoss") if loss_fn is None else \
        "the loss_fn given to train()"
    if loss_fn is None:
        loss_fn = build_loss(cfg, fmt, encoder, world_size=dist_info.world_size)

    optimizer = make_optimizer(cfg, encoder, device)
    scheduler = make_schedule(cfg, optimizer, total_steps)
    # fp16 gradients underflow without loss scaling; with enabled=False every scaler call is a no-op.
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.fp16)
    position, unverified_checkpoint = Position(), None
    continues_own_run = resume_from is not None and is_own_checkpoint(cfg.output_dir, resume_from)
    orders = {}  # epoch -> its batch order, made once

    def order_of(epoch: int) -> list[list[int]]:
        if epoch not in orders:
            orders[epoch] = batch_order(cfg, dataset, epoch)
        return orders[epoch]

    if resume_from:
        position = load_checkpoint(resume_from, cfg, dist_info, encoder=encoder, optimizer=optimizer,
                                   scheduler=scheduler, scaler=scaler,
                                   data_record=lambda epoch: data_record(
                                       len(items), fingerprint, order_of(epoch), fmt=fmt,
                                       sampled=sampled_data_fingerprint(items)),
                                   total_steps=total_steps, dev_fingerprint=dev_fingerprint,
                                   dev_metric=None if dev_set is None else dev_metric(dev_set),
                                   dev_given=dev_examples is not None, train_given=train_examples is not None,
                                   base_model=base_model)
        if continues_own_run:
            unverified_checkpoint = position.step
        else:
            position.good_checkpoint = None  # a step of the other folder's checkpoints, none of output_dir's
    # only now, with the flags, the data, the model and the checkpoint checked: a start refused by any of them
    # leaves the output folder as it was
    # nobody writes into output_dir while the main process clears it, and where that fails every process stops
    with distributed.stopping_together(dist_info):
        if cfg.overwrite and not continues_own_run and dist_info.is_main:
            # a fresh start, or a resume from another folder's checkpoint (checkpoint_to_resume)
            remove_earlier_run(cfg.output_dir)
        elif continues_own_run and dist_info.is_main:
            set_aside_later_line(cfg.output_dir, position.step)  # the checkpoints after it: another line of training
            clear_non_finite_stop(cfg.output_dir)
        if dist_info.is_main:
            remove_unfinished_writes(cfg.output_dir)  # a killed write's NAME.tmp beside the run's files
    if dev_set is not None:
        position.best_metric, position.dev_fingerprint = dev_metric(dev_set), dev_fingerprint

    if dist_info.is_main:
        n_trainable = sum(p.numel() for p in encoder.parameters() if p.requires_grad)
        n_total = sum(p.numel() for p in encoder.parameters())
        real_share = expected_useful_tokens(cfg, dataset, order_of(position.epoch), dist_info)
        print(f"angle_train: {model_name} | {n_trainable:,}/{n_total:,} trainable | "
              + (f"{lora_start_words(cfg, encoder, given_model=model is not None)} | "
                 if is_peft_model(encoder.backbone) else "") +
              f"{dataset.describe()} | "
              f"{total_steps} step{'s' * (total_steps != 1)} of {cfg.batch_size}x{cfg.grad_accum} "
              f"{batch_items(fmt)} | "
              f"{describe_passes(cfg)} ({real_share:.0%} of "
              f"the tokens real) | pooling {encoder.pooling} ({pooling_source}) | "
              + (f"bidirectional attention ({settings_file}) | " if folders_attention else "") +
              f"{dist_info.world_size} process(es) on {device}{', weights sharded (FSDP)' if cfg.fsdp else ''} | "
              f"loss: {loss_description(cfg, fmt, loss_name, encoder.embedding_dim)}", flush=True)
        print(f"angle_train: AdamW {schedule_words(cfg, total_steps)}, weight decay {cfg.weight_decay:g}, "
              + (f"gradient norm clipped at {cfg.max_grad_norm:g}" if cfg.max_grad_norm > 0 else "no gradient clipping")
              + f" | {precision_words(encoder, loss_scaling=cfg.fp16)} | {encoder.attention_implementation} attention"
              f" | seed {cfg.seed}", flush=True)
        if note := max_steps_note(cfg, len(items), dist_info.world_size):
            print(note, flush=True)
        unit = "sentences" if cfg.objective == "arccse" else "examples"
        if note := repeats_note(cfg, fmt, loss_name, repeated_items(items), len(items)):
            print(note, flush=True)
        if note := left_out_note(cfg, len(dataset), total_steps, unit):
            print(note, flush=True)
        if dev_set is not None and cfg.matryoshka_dims and encoder.embedding_dim not in cfg.matryoshka_dims:
            print(f"angle_train: note: --matryoshka-dims {' '.join(map(str, cfg.matryoshka_dims))} leaves out the "
                  f"full width ({encoder.embedding_dim}): it is not trained as an embedding of its own, yet best/ is "
                  f"chosen by its dev score; list {encoder.embedding_dim} among the widths to train it too",
                  flush=True)
        if cfg.espresso and cfg.espresso_dim >= encoder.embedding_dim:
            print(f"angle_train: note: --espresso-dim {cfg.espresso_dim} is not narrower than the model's "
                  f"{encoder.embedding_dim}-dimensional embeddings: no compressed width is trained (every layer at "
                  "the full width, the last one's loss counted twice, as angle-emb's AngleESETrainer does); give a "
                  f"--espresso-dim below {encoder.embedding_dim} to train one", flush=True)
        if model is not None and exports_base is None and is_peft_model(encoder.backbone) and cfg.save_best \
                and dev_set is not None:  # said, as best/ is larger than a LoRA run's usually is
            print("angle_train: note: the LoRA model given to train() records no model it was loaded by (built from "
                  "its config) for its adapter to be loaded over: best/ holds its merged weights, not the adapter "
                  "alone", flush=True)
        if weights_note:
            print(weights_note, flush=True)
        if note := adapter_dropout_note(cfg):
            print(note, flush=True)
        if pooling_note:
            print(pooling_note, flush=True)
        for note in context_notes:
            print(f"angle_train: {note}", flush=True)
        if dev_size_note:
            print(dev_size_note, flush=True)
        if folders_prompt_flags:
            print(f"angle_train: note: {prompts_record} records the prompts it was trained with "
                  f"({folders_prompt_flags}); this run gives no --prompt, --query-prompt or --doc-prompt and "
                  "trains without them: give those flags to keep them", flush=True)
        if resume_from:
            print(f"resumed from {resume_from} at step {position.step}", flush=True)
        elif cfg.resume == "auto":  # a requeued job's first launch, or a folder whose checkpoints are gone: said
            print(f"--resume auto: no checkpoint in {cfg.output_dir}; training from step 0", flush=True)
    encoder.train()
    with distributed.stopping_together(dist_info):  # the main process writes config.json, opens the reporters
        log = RunLog(cfg, dist_info.is_main, device, total_steps, position.step, position.loss_window,
                     unit=batch_items(fmt))
    return Run(cfg=cfg, device=device, dist_info=dist_info, encoder=encoder,
               model=distributed.wrap_ddp(encoder, device) if dist_info.enabled and not cfg.fsdp else encoder,
               tokenizer=tokenizer, dataset=dataset, dev_set=dev_set, loss_fn=loss_fn,
               guarded_loss=faults.SkipNonFiniteEmbeddings(loss_fn),
               optimizer=optimizer, scheduler=scheduler, scaler=scaler, total_steps=total_steps, position=position,
               epoch_order=order_of(position.epoch), data_fingerprint=fingerprint,
               log=log,
               result=TrainResult(encoder=encoder, tokenizer=tokenizer, best_score=position.best,
                                  # the dev set's, or a checkpoint's best's when resumed without dev data
                                  best_metric=position.best_metric if dev_set or position.best is not None else None),
               command=command, loss_name=loss_name, resumed_from=resume_from, data_ahead=OneAhead(device),
               base_model=base_model, exports_base=exports_base, model_name=model_name, given=given,
               unverified_checkpoint=unverified_checkpoint)


def refuse_settings_given_model_ignores(cfg: TrainConfig, encoder, *, given_lora: set[str]) -> None:
    """The settings angle_train applies as it builds --model's encoder that a model given to train() cannot take,
    refused naming the setting, where it differs from its default (a default asks for nothing) and from what the model
    has: ignored, they would leave the user believing the run trained as they asked. Applied to the model instead
    (apply_settings_to_given_model): --bf16 / --fp16, --pooling and --gradient-checkpointing where the backbone
    supports it; --fp16 not where the trainable weights are float16 (its loss scaling failed at the first optimizer
    step, as it would with --model-dtype float16, which TrainConfig refuses). given_lora: the LoRA settings of
    config.LORA_DEFAULTS the user gave (TrainConfig.given_lora_settings, before validate())."""
    if cfg.revision is not None:
        raise ValueError(f"--revision {cfg.revision} picks the version of --model's repository that angle_train loads, "
                         "and train() was given a model in its place: load the model at that revision yourself, or "
                         "leave out revision")
    weights = sorted({str(p.dtype).removeprefix("torch.") for p in encoder.parameters() if p.is_floating_point()})
    if cfg.changed("model_dtype") and weights != [cfg.model_dtype]:
        raise ValueError(f"--model-dtype {cfg.model_dtype} casts the weights of the model angle_train loads, and the "
                         f"model given to train() has {' and '.join(weights)} weights, which train() does not cast: "
                         f"cast the model yourself (encoder.to({DTYPES[cfg.model_dtype]})), or leave out model_dtype")
    # the run's loss scaling: --fp16, or with neither flag the given model's own fp16 autocast
    # (apply_settings_to_given_model)
    loss_scaled = cfg.fp16 or (not cfg.bf16 and encoder.autocast == "fp16")
    if loss_scaled and any(p.requires_grad and p.dtype == torch.float16 for p in encoder.parameters()):
        fp16 = "--fp16" if cfg.fp16 else '--fp16 (the autocast "fp16" of the model given to train())'
        raise ValueError(f"{fp16}: the model given to train() has float16 trainable weights, and "
                         f"{FP16_WEIGHTS_CANNOT_UNSCALE}: cast its trainable weights to float32 (the fp16 autocast "
                         "runs the forward in float16 all the same), or train with --bf16")
    if cfg.gradient_checkpointing and not takes_gradient_checkpointing(encoder.backbone):
        raise ValueError(f"--gradient-checkpointing: the backbone of the model given to train() "
                         f"({type(encoder.backbone).__name__}) is no transformers model that supports gradient "
                         "checkpointing: leave out gradient_checkpointing, or checkpoint its layers yourself")
    if not cfg.lora:
        return  # its LoRA settings are refused without it (TrainConfig._refuse_ignored_settings)
    if cfg.lora_path:
        raise ValueError(f"--lora-path {cfg.lora_path} attaches an adapter to --model's base model, and train() was "
                         "given a model in its place: attach the adapter to that model (models.attach_adapter), or "
                         "leave out --lora-path")
    if not is_peft_model(encoder.backbone):
        raise ValueError("--lora 1 adds LoRA adapters to the model angle_train loads, and the model given to train() "
                         "has none, which train() does not add: build them yourself (models.wrap_backbone(backbone, "
                         "lora=models.LoraSettings(...)), or peft.get_peft_model), or leave out lora and the LoRA "
                         "settings to train all its weights")
    for name, value in adapter_settings(encoder).items():
        setting = sorted(cfg.lora_targets) if name == "lora_targets" else getattr(cfg, name)
        asked = bool(cfg.lora_targets) if name == "lora_targets" else name in given_lora
        if asked and setting != value:
            raise ValueError(f"{flag_of(name)} {' '.join(flag_words(name, setting)[1:])}: the adapters of the model "
                             f"given to train() have {shlex.join(flag_words(name, value))}, and train() trains them "
                             f"as they are: build the adapters with it yourself, or leave out {flag_of(name)}")


def adapter_settings(encoder) -> dict:
    """The LoRA settings (TrainConfig's names) of the adapters of a peft `encoder`, read as a --lora-path adapter's
    are (config.adapter_lora_settings)."""
    return adapter_lora_settings(lora_config(encoder).to_dict())


def apply_settings_to_given_model(cfg: TrainConfig, encoder):
    """A model given to train() (an Encoder) with the settings angle_train applies as it builds --model's encoder that
    it can take as it is: --bf16 / --fp16 (the forward's autocast), --pooling and --attention where given, and
    --gradient-checkpointing (refuse_settings_given_model_ignores refused it where the backbone has none). A given
    model's own autocast, with neither flag given, is the run's: cfg records it, and --fp16's loss scaling follows;
    with --lora, so are its adapters' settings."""
    if cfg.bf16 or cfg.fp16:
        encoder.autocast = "bf16" if cfg.bf16 else "fp16"
    elif encoder.autocast is not None:
        cfg.bf16, cfg.fp16 = encoder.autocast == "bf16", encoder.autocast == "fp16"
    if cfg.pooling is not None:
        encoder.pooling = cfg.pooling
    if cfg.lora:  # the adapters' settings are the run's (config.json, the checkpoints), as an adapter's are
        for name, value in adapter_settings(encoder).items():  # with --lora-path
            setattr(cfg, name, value)
    if cfg.gradient_checkpointing:
        enable_gradient_checkpointing(encoder.backbone)
    if cfg.attention:
        use_attention(encoder, cfg.attention)
    return encoder


def given_model_words(name: str | None) -> str:
    """The messages' words for a model given to train(), with the name it was loaded by (export.loaded_name) where it
    has one."""
    return "the model given to train()" + (f" ({name})" if name else "")


# The loss weights a data format's loss does not read (angle_kernels.AngleLoss: format B's is the contrastive term
# alone, as angle-emb's), refused when set
FORMAT_IGNORES = {"A": ("cln_w",), "B": ("cosine_w", "ibn_w", "cln_w", "angle_w")}


def tokenising_line(cfg: TrainConfig, items: int, fmt: str | None, read_seconds: float | None) -> str:
    """The line a run prints before it tokenises its training texts (about 30 s before the header at a million short
    pairs on 2 CPU cores: the start-up was silent until then): how many texts, and how long reading and checking the
    data took (`read_seconds`; None: data given to train(), not read)."""
    texts = items * (1 if fmt is None else ROWS_PER_EXAMPLE[fmt])  # ArcCSE's sentences: one text each
    unit = "sentences" if cfg.objective == "arccse" else "examples"
    read = "" if read_seconds is None else f", read and checked in {read_seconds:.1f} s"
    return f"angle_train: tokenising {texts:,} texts at --max-length {cfg.max_length} ({items:,} {unit}{read})"


# The flag of the data each split setting chooses from
DATA_FLAGS = {"train_split": "--train-data", "dev_split": "--dev-data"}


def check_split_settings(cfg: TrainConfig, *, train_examples_given: bool, dev_examples_given: bool) -> None:
    """--train-split / --dev-split with a data file or a folder that save_to_disk did not write (an STS year folder),
    refused naming the flag before the data is read: such a source has no splits, is read whole, and the split asked
    for was ignored in silence. Data given to train() replaces the flags that name and read a source (train_examples
    --train-data and --train-split, dev_examples --dev-data and --dev-split), whose source is then not read."""
    train_data = None if train_examples_given else cfg.train_data
    dev_data = None if dev_examples_given else cfg.dev_data
    for name, source in (("train_split", train_data), ("dev_split", dev_data)):
        if cfg.changed(name) and has_no_splits(source):
            data_flag = DATA_FLAGS[name]
            # a run started before this check read the file whole with the flag given: its checkpoints resume
            # without it (checkpoint._ineffective_splits), which the advice says where a resume is asked for
            resumes = (f"; --resume takes a checkpoint of a run that gave {flag_of(name)} without it (that run read "
                       "the file whole too)") if cfg.resume else ""
            raise ValueError(f"{flag_of(name)} {getattr(cfg, name)} says which split of a Hugging Face dataset to "
                             f"read, and {data_flag} {source} is a data file or folder, which has no splits: leave out "
                             f"{flag_of(name)}{resumes}")


def check_data_settings(cfg: TrainConfig, *, train_examples_given: bool, dev_examples_given: bool, dev_set) -> None:
    """Data settings that would be ignored, refused naming the flag: how to read a file or dataset (--data-format,
    --train-split, and --columns unless a --dev-data file takes it) with built-in training data, --dev-split and
    --dev-columns with a built-in dev set (not read where dev_examples replace it), --eval-every without dev data."""
    if cfg.train_data in BUILTIN_DATASETS and not train_examples_given:
        # --columns reads a --dev-data file or dataset by column names too, unless --dev-columns does
        columns_read = (not dev_examples_given and bool(cfg.dev_data) and cfg.dev_data not in BUILTIN_DATASETS
                        and not cfg.dev_columns)
        for name in ("data_format", "train_split") + (() if columns_read else ("columns",)):
            if cfg.changed(name):
                raise ValueError(f"{flag_of(name)} says how to read a file or dataset, and --train-data "
                                 f"{cfg.train_data} is built in: leave out {flag_of(name)}")
    for name in ("dev_split", "dev_columns"):
        if cfg.dev_data in BUILTIN_DATASETS and not dev_examples_given and cfg.changed(name):
            raise ValueError(f"{flag_of(name)} says how to read a dev file or dataset, and --dev-data {cfg.dev_data} "
                             f"is built in: leave out {flag_of(name)}")
    if dev_set is None and cfg.changed("eval_every"):
        raise ValueError(f"--eval-every {cfg.eval_every} evaluates on the dev data, and this run has none: give "
                         "--dev-data, or leave out --eval-every")


def check_format_settings(cfg: TrainConfig, fmt: str) -> None:
    """What the data format needs of the settings, checked once the data is read (before the model loads)."""
    if fmt == "A" and (cfg.query_prompt or cfg.doc_prompt):
        raise ValueError("--query-prompt and --doc-prompt apply to the query and the positive/negative of formats "
                         "B and C; format A's two texts take --prompt (angle-emb's text_prompt)")
    if fmt in ("A", "B") and cfg.batch_size < 2:
        raise ValueError(f"--batch-size 1 with format {fmt}: every term of the loss compares a pair with the other "
                         "pairs of its batch (in-batch negatives, ranking), so one pair gives a loss of 0 and trains "
                         "nothing; use --batch-size 2 or more")
    # a weight set to 0 turns off a term the format does not compute anyway (accepted: a config shared between
    # formats); format B's one term is an in-batch-negative one, which --ibn-w does not weigh there
    ignored = [flag_of(name) for name in FORMAT_IGNORES.get(fmt, ())
               if cfg.changed(name) and (getattr(cfg, name) != 0 or (fmt, name) == ("B", "ibn_w"))]
    if ignored:
        raise ValueError(f"{', '.join(ignored)}: format {fmt} " + (
            "trains the contrastive term of each query against the positives only (angle-emb's format B), so the "
            "loss weights do not apply" if fmt == "B" else "has no hard negatives for --cln-w to weigh")
            + f": leave out {', '.join(ignored)}")
    weights = {"A": ("cosine_w", "ibn_w", "angle_w"), "C": ("cosine_w", "ibn_w", "cln_w", "angle_w")}.get(fmt, ())
    if weights and not any(getattr(cfg, name) > 0 for name in weights):
        flags = ", ".join(flag_of(name) for name in weights)
        raise ValueError(f"every loss weight of format {fmt} ({flags}) is 0: the loss would be 0 and train nothing")
    # the filter and the partition act on the in-batch terms: with those weighted 0 they changed nothing, while the
    # start line said "false negatives filtered"
    in_batch_options = [flag_of(name) for name in ("false_negative_margin", "ibn_partition") if cfg.changed(name)]
    if in_batch_options and not computes_in_batch_term(cfg.ibn_w, cfg.cln_w, fmt):
        weights = "--ibn-w" if fmt == "A" else "--ibn-w and --cln-w"
        verb = "act" if len(in_batch_options) > 1 else "acts"
        raise ValueError(f"{' and '.join(in_batch_options)} {verb} on the in-batch terms, which format {fmt} does not "
                         f"compute with {weights} 0: give {weights.replace(' and ', ' or ')} a weight above 0, or "
                         f"leave out {' and '.join(in_batch_options)}")


def check_data_size(cfg: TrainConfig, rows: int, what: str, from_file: bool) -> None:
    """Enough data for one optimizer step, checked before the model loads (epoch_batches would find out after)."""
    needed = cfg.batch_size * cfg.grad_accum
    if rows < needed:
        source = f"--train-data {cfg.train_data}" if from_file else "the training data"
        raise ValueError(f"{source} has {rows} {what}, fewer than one optimizer step takes (--batch-size "
                         f"{cfg.batch_size} x --grad-accum {cfg.grad_accum} = {needed}): lower --batch-size or "
                         "--grad-accum, or add data")


def check_labels(cfg: TrainConfig, examples: list[Example], fmt: str, from_file: bool) -> None:
    """Format A's labels against the loss weights, before the model loads: the in-batch-negative term (--ibn-w)
    takes 0/1 labels only, and graded ones (STS scores) would stop the run at its first step; and at least one
    weighted term must have something to learn from (the ranking terms, --cosine-w and --angle-w, two different
    labels; the in-batch-negative term a pair labelled 1), else every step's loss is 0 and the run trains nothing."""
    if fmt != "A":
        return
    source = f"--train-data {cfg.train_data}" if from_file else "the training data"
    if cfg.ibn_w > 0:
        graded = next((ex.label for ex in examples if ex.label not in (0.0, 1.0)), None)
        if graded is not None:
            raise ValueError(f"--ibn-w {cfg.ibn_w:g}: the in-batch-negative term needs 0/1 labels (a pair is similar "
                             f"or not), and {source} has graded labels (such as {graded:g}): train on them with the "
                             "ranking terms, --ibn-w 0 --cosine-w 1 --angle-w 1, or give 0/1 labels")
    labels = {ex.label for ex in examples}
    ranking = [flag for flag, weight in (("--cosine-w", cfg.cosine_w), ("--angle-w", cfg.angle_w)) if weight > 0]
    if (ranking and len(labels) > 1) or (cfg.ibn_w > 0 and 1.0 in labels):
        return
    needs = ([f"the ranking terms ({', '.join(ranking)}) need pairs with different labels"] if ranking else []) + (
        ["the in-batch-negative term (--ibn-w) needs pairs labelled 1"] if cfg.ibn_w > 0 else [])
    label = " or ".join(f"{value:g}" for value in sorted(labels))  # one value: graded labels are refused above
    raise ValueError(f"every label of {source} is {label}, and {' and '.join(needs)}: every step's loss would be 0 "
                     "and train nothing; check the label column, or weight a term these labels can train")


def check_model_settings(cfg: TrainConfig, encoder, fmt: str | None, *, pooling_source: str, model_name: str) -> None:
    """The settings against the loaded model, before any text is tokenised: --max-length and --export-max-length
    within the model's position limit (the second is what best/ and final/ tell sentence-transformers and angle-eval
    to encode: beyond the limit they would fail), --matryoshka-dims and --espresso within its width and layers, and a
    pooling that can tell texts apart: a causal decoder's first token attends to itself alone, so first-token pooling
    gave every text starting with the same token (a BOS, a prompt) one embedding, and trained nothing. model_name:
    the messages' words for the model (--model, or given_model_words)."""
    first_token = first_token_pooling_problem(encoder, pooling_source)
    if first_token:
        raise ValueError(f"{first_token}; use pooling last (decoders' default) or avg (--pooling), or bidirectional "
                         "attention (--bidirectional)")
    limit = position_limit(encoder.backbone)
    for flag, length in (("--max-length", cfg.max_length), ("--export-max-length", cfg.export_max_length)):
        if limit is not None and length is not None and length > limit:
            raise ValueError(f"{flag} {length} is longer than the model can read: its position table holds {limit} "
                             f"positions; use {flag} {limit} or less")
    if cfg.matryoshka_dims:
        check_matryoshka_dims(cfg, encoder.embedding_dim, fmt, model_name=model_name)
    if cfg.espresso:
        check_espresso(cfg, encoder, fmt, model_name=model_name)


def replaced_adapter_dropout(cfg: TrainConfig) -> float | None:
    """The dropout of the --lora-path adapter (its adapter_config.json's) that a --lora-dropout of another value
    replaces (TrainConfig._take_adapter_settings), or None."""
    if not cfg.lora_path:
        return None
    own = read_adapter_config(cfg.lora_path, label="--lora-path ").get("lora_dropout", PEFT_LORA_DROPOUT)
    return None if own == cfg.lora_dropout else own


def adapter_dropout_note(cfg: TrainConfig) -> str | None:
    """A note for a --lora-dropout that replaces the dropout of the --lora-path adapter, or None: the adapter's
    weights are the same, its training is not."""
    own = replaced_adapter_dropout(cfg)
    if own is None:
        return None
    return (f"angle_train: note: --lora-dropout {cfg.lora_dropout:g} replaces the dropout {own:g} of the adapter of "
            f"--lora-path {cfg.lora_path} (its {ADAPTER_CONFIG}'s lora_dropout): dropout is no part of its weights; "
            f"the run trains it, and its exports record it, with {cfg.lora_dropout:g}")


def first_token_pooling_note(encoder, pooling_source: str) -> str | None:
    """A note for cls_avg pooling on a causal decoder LM (cls alone is refused: check_model_settings): its first
    token's state, half of every embedding, sees no other token, so it is the same for every text that starts with
    that token (a BOS token, a prompt), pulling their embeddings together; the mean half alone tells them apart."""
    if not (encoder.is_decoder and not encoder.bidirectional and encoder.pooling == "cls_avg"):
        return None
    return (f"angle_train: note: pooling cls_avg ({pooling_source}) on a causal decoder LM: half of each embedding is "
            "the first token's state, which sees no other token, the same for every text that starts with that token "
            "(a BOS token, a prompt); only the mean half tells texts apart. --pooling avg or last (decoders' default) "
            "read the whole text, and so does the first token with --bidirectional")


def check_packing(cfg: TrainConfig, encoder, dataset, device: torch.device, asked: bool, dist_info) -> None:
    """With --pack, that the model embeds packed rows as it embeds padded ones (Encoder.packing_problem, on the
    first texts of the data). Packing asked for (--pack N) and impossible is an error; packing by default falls
    back to the padded passes, said in one line."""
    if not cfg.pack:
        return
    sample = dataset.batch(list(range(min(len(dataset), PACKING_CHECK_EXAMPLES)))).seqs
    problem = encoder.packing_problem(sample, cfg.pack)
    if problem is None:
        return
    if asked:
        raise ValueError(f"--pack {cfg.pack}: {problem}; use --pack 0")
    cfg.pack = cfg.pass_tokens = None
    cfg.resolve_passes(device.type, packing_works=False)
    if dist_info.is_main:
        print(f"angle_train: padded passes, not packed rows: {problem}", flush=True)


def build_loss(cfg: TrainConfig, fmt: str | None, encoder=None, world_size: int = 1
               ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """angle_kernels.AngleLoss for data format `fmt` with the run's weights, scales and in-batch-negative options;
    with --espresso, called on the encoder's layer stacks [L, rows, D] with Espresso's layer weights (the encoder
    gives the number of layers and the width). --objective arccse: angle_kernels.ArcCSELoss on the five-block
    layout of `world_size` processes (arccse.py)."""
    dims, dim_weights = tuple(cfg.matryoshka_dims) or None, tuple(cfg.matryoshka_weights) or None
    if cfg.objective == "arccse":
        loss = ArcCSELoss(margin_degrees=cfg.arccon_margin, tau=cfg.arccon_tau, triplet_weight=cfg.triplet_w,
                          dims=dims, dim_weights=dim_weights)
        return arccse.ArcCSEObjective(loss, world_size, blocks=arccse.blocks_of(cfg.triplet_w))
    layer_weights = None
    if cfg.espresso:
        dims, layer_weights = espresso_layer_weights(encoder.num_layers, cfg.espresso_dim, encoder.embedding_dim)
    loss = AngleLoss(cosine_w=cfg.cosine_w, ibn_w=cfg.ibn_w, cln_w=cfg.cln_w, angle_w=cfg.angle_w,
                     cosine_tau=cfg.cosine_tau, ibn_tau=cfg.ibn_tau, angle_tau=cfg.angle_tau, dataset_format=fmt,
                     ibn_partition=cfg.ibn_partition, false_negative_margin=cfg.false_negative_margin,
                     false_negative_strategy=cfg.false_negative_strategy, dims=dims, dim_weights=dim_weights)
    return loss if layer_weights is None else functools.partial(loss, layer_weights=layer_weights)


def _angle_term_needs_even_widths(cfg: TrainConfig, fmt: str | None) -> bool:
    """Whether the loss computes the angle term, whose score splits each prefix in halves (AngleLoss's rule: a
    positive --angle-w in formats A and C; format B has no angle term)."""
    return cfg.objective == "angle" and computes_angle_term(cfg.angle_w, fmt)


def check_espresso(cfg: TrainConfig, encoder, fmt: str | None, *, model_name: str) -> None:
    """--espresso against the loaded model (named model_name: --model, or given_model_words): at least 2 layers,
    and an even --espresso-dim for the angle term."""
    even = _angle_term_needs_even_widths(cfg, fmt)
    try:
        dims, _ = espresso_layer_weights(encoder.num_layers, cfg.espresso_dim, encoder.embedding_dim)
        check_nested(dims, None, encoder.embedding_dim, even=even)
    except ValueError as exc:
        raise ValueError(f"--espresso --espresso-dim {cfg.espresso_dim} does not fit {model_name} "
                         f"({encoder.num_layers} layers, embeddings of {encoder.embedding_dim} dimensions"
                         f"{'; --angle-w > 0 needs even widths' if even else ''}): {exc}") from None


def check_matryoshka_dims(cfg: TrainConfig, width: int, fmt: str | None, *, model_name: str) -> None:
    """--matryoshka-dims against the model's embedding width, once the model is loaded (named model_name: --model,
    or given_model_words): AngleLoss would check it only at the first step, with a message that cannot name the flag.
    The rules are AngleLoss's own."""
    even = _angle_term_needs_even_widths(cfg, fmt)
    try:
        check_nested(cfg.matryoshka_dims, cfg.matryoshka_weights or None, width, even=even)
    except ValueError as exc:
        raise ValueError(f"--matryoshka-dims {' '.join(map(str, cfg.matryoshka_dims))} does not fit {model_name}, "
                         f"whose embeddings have {width} dimensions{' (and --angle-w > 0)' if even else ''}: "
                         f"{exc}") from None


def lora_settings_file(cfg: TrainConfig) -> str | None:
    """The angle_train.json that records how --lora-path's adapter embedded texts (models.adapter_settings_file);
    None without --lora-path, or for an adapter angle_train did not export."""
    return adapter_settings_file(cfg.lora_path) if cfg.lora_path else None


def build_encoder(cfg: TrainConfig, device: torch.device, *, lora_settings: str | None | object = LOOK_UP):
    """(encoder, tokenizer) of --model with the run's settings, validated first (a TrainConfig made in Python takes
    its defaults there: a LoRA setting left out, None, the adapter's or config.LORA_DEFAULTS'); --lora-targets that
    cannot apply to it are refused naming the flag. lora_settings: lora_settings_file(cfg) where the caller has
    looked it up (train() reads the adapter's attention and prompts from it too), else looked up here."""
    cfg.validate()
    if lora_settings is LOOK_UP:
        lora_settings = lora_settings_file(cfg)
    try:
        return _build_encoder(cfg, device, lora_settings=lora_settings)
    except LoraTargetError as exc:
        raise ValueError(f"--lora-targets {' '.join(cfg.lora_targets)}: {exc}") from None
    except AdapterFitError as exc:
        raise ValueError(f"--lora-path {cfg.lora_path}: {exc}") from None


def _build_encoder(cfg: TrainConfig, device: torch.device, *, lora_settings: str | None):
    autocast = "bf16" if cfg.bf16 else "fp16" if cfg.fp16 else None
    # an adapter angle_train exported pools as it was trained (its export's angle_train.json), not by --model's
    # default; --pooling still decides
    lora_settings = lora_settings if cfg.pooling is None else None
    pooling = cfg.pooling
    if lora_settings:
        pooling = export_pooling(lora_settings, st_folder.read_json(lora_settings).get("pooling"))
    encoder, tokenizer = _load_backbone(cfg, device, pooling=pooling, autocast=autocast)
    if cfg.attention:
        use_attention(encoder, cfg.attention)
    if lora_settings and pooling:
        encoder.pooling_source = f"the adapter's {lora_settings}"
    return encoder, tokenizer


def _load_backbone(cfg: TrainConfig, device: torch.device, *, pooling: str | None, autocast: str | None):
    lora = LoraSettings(r=cfg.lora_r, alpha=cfg.lora_alpha, dropout=cfg.lora_dropout,
                        target_modules=cfg.lora_targets or None, rslora=cfg.lora_rslora) \
        if cfg.lora and not cfg.lora_path else None  # an adapter given is attached as it was trained
    if cfg.model in BUILTIN_MODELS:
        is_decoder = cfg.model == "builtin:tiny-llama"
        tokenizer = prepare_tokenizer(build_tokenizer(), is_decoder)
        backbone = build_backbone(cfg.model, len(tokenizer), seed=cfg.seed).to(DTYPES[cfg.model_dtype])
        if cfg.lora_path:
            backbone = attach_adapter(backbone, cfg.lora_path, dropout=cfg.lora_dropout)
        encoder = wrap_backbone(backbone, pooling=pooling, pad_token_id=tokenizer.pad_token_id,
                                is_decoder=is_decoder, lora=lora, gradient_checkpointing=cfg.gradient_checkpointing,
                                autocast=autocast, bidirectional=cfg.bidirectional)
        return encoder.to(device), tokenizer
    return load_encoder(cfg.model, pooling=pooling, lora=lora, lora_path=cfg.lora_path,
                        lora_dropout=cfg.lora_dropout if cfg.lora_path else None,
                        gradient_checkpointing=cfg.gradient_checkpointing, autocast=autocast,
                        dtype=DTYPES[cfg.model_dtype], device=device, bidirectional=cfg.bidirectional,
                        trust_remote_code=cfg.trust_remote_code, revision=cfg.revision, given_as="--model",
                        revision_given_as="--revision")


def read_data(source: str, fmt: str | None, split: str, columns: dict | None = None, *, split_setting: str):
    """The examples of --train-data or --dev-data; `split_setting`: the setting that gave `split` (train_split,
    dev_split), which a refusal of the split names by its flag, as a refusal of the source names its flag."""
    if source in BUILTIN_DATASETS:
        return builtin_examples(source)
    with errors_naming(source, DATA_FLAGS[split_setting]):
        return load_examples(source, fmt=fmt, split=split, columns=columns, split_flag=flag_of(split_setting),
                             split_default=default_of(split_setting))


def read_sentences(cfg: TrainConfig, sentences: list[str] | None = None) -> list[str]:
    """--objective arccse's sentences: `sentences` (train()'s train_examples), the texts of a built-in dataset, or
    --train-data's sentences (tokenised with their masked copies once the model's tokenizer is loaded)."""
    if sentences is not None:
        return sentences
    column = cfg.text_column if cfg.changed("text_column") else None
    if cfg.train_data in BUILTIN_DATASETS:
        arccse.refuse_column(column, f"{cfg.train_data} is a built-in dataset of pairs, whose texts are the sentences")
        examples, _ = builtin_examples(cfg.train_data)
        return list(dict.fromkeys(text for ex in examples for text in ex.texts))
    with errors_naming(cfg.train_data, DATA_FLAGS["train_split"]):
        sentences, blank = arccse.load_sentences(cfg.train_data, column=column, split=cfg.train_split,
                                                 split_flag=flag_of("train_split"),
                                                 split_default=default_of("train_split"))
    if blank:
        print(f"{cfg.train_data}: {blank:,} blank line(s) between sentences skipped", flush=True)
    return sentences


def read_dev_data(source: str, split: str, columns: dict | None = None, columns_refused: str | None = None
                  ) -> StsSet | RetrievalSet:
    """--dev-data: a file or folder in any layout angle-eval reads (an STS12-16 year folder, STS-B, SICK, format-A
    JSONL/CSV: scored pairs; format B/C JSONL/CSV: (query, positive) pairs, the positives given for a query its
    relevant documents among every distinct positive), else a built-in or Hugging Face dataset in any format (a hub
    name, or a folder save_to_disk wrote: its `split`, as --train-data's); `columns`: --columns, for the layouts read
    by column names (--dev-columns, or --columns; `columns_refused`: the advice where a file of a fixed layout, STS-B,
    SICK or a year folder, is given a mapping meant for it alone, evaluate.read_dataset)."""
    if has_no_splits(source):  # read whole, in angle-eval's layouts
        with errors_naming(source, DATA_FLAGS["dev_split"]):
            return read_dataset(source, columns=columns, where=f"--dev-data {source}", columns_refused=columns_refused)
    return dataset_of(os.path.basename(source.rstrip("/")), *read_data(source, None, split, columns,
                                                                         split_setting="dev_split"))


# A dev set of fewer pairs gives a noisy score: Spearman's rho over n pairs has a standard error of about
# sqrt(1.06 / (n - 3)) in Fisher's z (Fieller, Hartley and Pearson, 1957), 0.2 at 30 pairs and more below, so the
# score says little of the model beyond those pairs and best/ is picked partly by chance (recall@k and nDCG@10 over
# n distinct queries move in steps of about 1/n: a retrieval set counts its queries, not its rows).
NOISY_DEV_PAIRS = 30


def dev_set_of(dev_examples, cfg: TrainConfig) -> StsSet | RetrievalSet | None:
    """The dev set: train()'s dev_examples (format-A examples, or an StsSet / RetrievalSet), else --dev-data's, else
    None; refused when it cannot give a score that ranks models (evaluate.check_scored: fewer than 3 scored pairs, or
    gold scores all equal; evaluate.check_ranked: fewer than 2 distinct queries)."""
    where = dev_set_name(dev_examples, cfg)
    if dev_examples is None:
        if not cfg.dev_data:
            return None
        try:
            # --columns maps the dev data's columns too where it can; --dev-columns is meant for it alone
            dev_set = read_dev_data(cfg.dev_data, cfg.dev_split, cfg.dev_column_map(),
                                    columns_refused="leave out --columns" if cfg.dev_columns else None)
        except DataError as exc:  # columns it cannot read: the flag that maps the dev data's is --dev-columns
            if "--columns" not in str(exc):
                raise
            if cfg.columns and not cfg.dev_columns:
                raise DataError(f"{exc} (--columns maps the columns of --dev-data too: map the dev data's own with "
                                "--dev-columns)") from None
            raise for_dev_columns(exc) from None
    else:
        dev_set = dev_examples if isinstance(dev_examples, (StsSet, RetrievalSet)) else StsSet("dev", dev_examples)
    if isinstance(dev_set, StsSet):
        if any(len(ex.texts) != 2 for ex in dev_set.examples):
            raise ValueError(f"{where}: scored pairs (text1, text2, label) are needed for the dev Spearman")
        check_scored(dev_set, where, " (to score (query, positive) pairs by retrieval, pass an evaluate.RetrievalSet)")
    else:
        check_ranked(dev_set, where)
    return dev_set


def dev_set_name(dev_examples, cfg: TrainConfig) -> str:
    """The dev set as the run's lines name it: train()'s dev_examples, else --dev-data's file or dataset."""
    return f"--dev-data {cfg.dev_data}" if dev_examples is None else "dev_examples"


def small_dev_set_note(dev_set: StsSet | RetrievalSet | None, where: str) -> str | None:
    """A note for a dev set of fewer than NOISY_DEV_PAIRS scored pairs or distinct queries (its score picks best/
    partly by chance), else None; `where`: dev_set_name's."""
    if dev_set is None:
        return None
    scored = isinstance(dev_set, StsSet)
    count = len(dev_set.examples) if scored else len(dev_set.corpus().queries)
    if count >= NOISY_DEV_PAIRS:
        return None
    kind = "scored pairs" if scored else "distinct queries"
    return (f"angle_train: note: {where} has {count} {kind}: a dev score over fewer than {NOISY_DEV_PAIRS} is "
            "noisy, so best/ is picked partly by chance; a larger dev set picks it more reliably")


def check_batch_shares(cfg: TrainConfig, world_size: int) -> None:
    """Every process takes an equal share of each batch (own_share): a batch that does not split evenly would leave
    its last examples to no process, so it is refused, with --max-steps too."""
    if cfg.batch_size % world_size:
        raise ValueError(f"--batch-size {cfg.batch_size} must be divisible by the number of processes ({world_size}): "
                         f"each takes an equal share; use a multiple of {world_size}")


def count_steps(cfg: TrainConfig, n_examples: int, world_size: int) -> int:
    """The run's optimizer steps (max_steps, or whole steps over `epochs` passes); every process gets an equal
    share of each batch."""
    check_batch_shares(cfg, world_size)
    return cfg.max_steps or epoch_steps(cfg, n_examples, world_size)


def epoch_steps(cfg: TrainConfig, n_examples: int, world_size: int) -> int:
    """The whole optimizer steps of `epochs` passes over the data (at least one)."""
    steps_per_epoch = len(epoch_batches(n_examples, cfg.batch_size, seed=cfg.seed, epoch=0)) // cfg.grad_accum
    if steps_per_epoch == 0:
        raise ValueError(f"one optimizer step needs {cfg.batch_size * cfg.grad_accum} examples; the data has "
                         f"{n_examples}")
    return max(1, math.floor(decimal_product(cfg.epochs, steps_per_epoch)))


def decimal_product(share: float, steps: int) -> Fraction:
    """`share` (--epochs, a fractional --warmup) x `steps`, exact in the decimals the share is written in (its repr,
    which reads back as the same float): float arithmetic's 0.29 x 100 is 28.999999999999996, whole steps 28 where 29
    were asked for, and 0.07 x 100 is 7.000000000000001, rounded up to 8."""
    return Fraction(repr(float(share))) * steps


def max_steps_note(cfg: TrainConfig, n_examples: int, world_size: int) -> str | None:
    """The line saying that --max-steps, not a given --epochs, sets the run's length where the two disagree: the
    steps --max-steps asks for are taken (as Hugging Face's Trainer does), and a run that stops partway through its
    epochs or goes on past them would otherwise say nothing of it."""
    if not cfg.max_steps or cfg.epochs is None:  # --epochs given: its default value too (config._take_epochs)
        return None
    steps = epoch_steps(cfg, n_examples, world_size)
    if steps == cfg.max_steps:
        return None
    how = "ends the run before" if cfg.max_steps < steps else "runs the training past"
    return (f"angle_train: note: --max-steps {cfg.max_steps} {how} --epochs {cfg.epochs:g}'s {steps:,} "
            f"step{'s' * (steps != 1)}: --max-steps sets the run's length when both are given")


def examples_left_out(cfg: TrainConfig, n_examples: int) -> int:
    """The examples of each epoch no step takes: a step takes grad_accum whole batches of batch_size, and the epoch's
    last incomplete batch and the batches short of a whole step are dropped (epoch_batches, next_batches)."""
    per_step = cfg.batch_size * cfg.grad_accum
    return n_examples - (n_examples // cfg.batch_size // cfg.grad_accum) * per_step


def left_out_note(cfg: TrainConfig, n_examples: int, total_steps: int, unit: str) -> str | None:
    """The line saying how many of the `n_examples` (`unit`: examples, or ArcCSE's sentences) each epoch leaves out
    (examples_left_out), or None: none are, or the run's `total_steps` end before the first epoch does, so no epoch
    reaches the examples it would leave out (a --max-steps 3 run was told of an epoch's end it never reached)."""
    left = examples_left_out(cfg, n_examples)
    if not left or total_steps < n_examples // (cfg.batch_size * cfg.grad_accum):
        return None
    advice = "; a batch size closer to a divisor of the data leaves out fewer" if left > 0.05 * n_examples else ""
    return (f"angle_train: each epoch leaves out {left:,} of the {n_examples:,} {unit} ({left / n_examples:.1%}; "
            f"another {left:,} each epoch, in its shuffled order): they do not fill a step of "
            f"{cfg.batch_size}x{cfg.grad_accum}{advice}")


# The flags of the terms whose negatives are the batch's other rows, by data format (angle_kernels.AngleLoss: format
# A's in-batch-negative term; C's in-batch and hard-negative terms, whose negatives are every other row's positive
# and negative too); format B's one contrastive term reads no weight and is always on (FORMAT_IGNORES)
IN_BATCH_TERMS = {"A": ("ibn_w",), "B": (), "C": ("ibn_w", "cln_w")}
# What makes two examples of a format the same (repeated_items): every text and, in format A, the label
SAME_ITEM = {"A": "the same text1, text2 and label", "B": "the same query and positive",
             "C": "the same query, positive and negative"}


def repeats_note(cfg: TrainConfig, fmt: str | None, loss_name: str, repeats: int, count: int) -> str | None:
    """The line saying that `repeats` of the `count` training items (examples of format `fmt`; ArcCSE's sentences
    where fmt is None) repeat an earlier one exactly, or None for none. They are kept (training never drops data in
    silence) and said; where the loss has an in-batch term on (a weight above 0; format B's and ArcCon's always are;
    a loss_fn given to train() may have one), a copy landing in its original's batch is a false negative of that
    term, and the line says so, naming the term. Format A's ranking terms alone (--ibn-w 0) compare the labels of
    pairs, and a copy, of the same label, is no negative to them."""
    if not repeats:
        return None
    unit, same = ("sentences", "") if fmt is None else ("examples", f" ({SAME_ITEM[fmt]})")
    verb = "repeats" if repeats == 1 else "repeat"
    line = (f"angle_train: note: {repeats:,} of the {count:,} {unit} {verb} an earlier one exactly{same}; they are "
            "trained as given")
    if loss_name == "ArcCSELoss":
        terms = "ArcCon"
    elif loss_name != "AngleLoss":
        terms = "a loss with in-batch negatives"
    elif fmt == "B":
        terms = "the contrastive term"
    else:
        on = [flag_of(name) for name in IN_BATCH_TERMS[fmt] if getattr(cfg, name) > 0]
        if not on:
            return line + f" (a copy weighs as one more {unit[:-1]})"
        terms = (f"the in-batch-negative term ({on[0]})" if fmt == "A"
                 else f"the contrastive term{'s' * (len(on) > 1)} ({', '.join(on)})")
    return (line + f", and a copy in the same batch as its original is a false in-batch negative for {terms}: remove "
            "the copies to avoid it")


def batch_items(fmt: str | None) -> str:
    """What a batch holds, as the run's lines, progress bar, metrics and model card name it: ArcCSE's sentences (no
    data format), format C's triplets (query, positive, negative), else pairs."""
    return "sentences" if fmt is None else "triplets" if fmt == "C" else "pairs"


def half_precision_weights_note(cfg: TrainConfig, encoder: torch.nn.Module) -> str | None:
    """A note for a run whose trainable weights are 16-bit (--model-dtype bfloat16 or float16 without LoRA, whose
    adapters are float32), or None. AdamW updates them in place, with no float32 copy to accumulate into: a step,
    at most about --lr in size (Adam's ratio of moments is at most about 1), moves a weight w only where it exceeds
    half the gap between w's neighbours, eps |w| / 2, so on every weight larger than 2 lr / eps it rounds away
    (bfloat16 at --lr 2e-5: weights above 0.005, most of a pretrained encoder's). The note gives that share."""
    half = [p for p in encoder.parameters() if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)]
    if not half:
        return None
    dtype = half[0].dtype
    bound = 2 * cfg.lr / torch.finfo(dtype).eps
    total = sum(p.numel() for p in half)
    with torch.no_grad():
        rounded = sum(int((p.abs() > bound).sum()) for p in half)
    return (f"angle_train: note: {total:,} trainable weights are {str(dtype).removeprefix('torch.')} (--model-dtype "
            f"{cfg.model_dtype}), and AdamW updates them in that dtype, with no float32 copy: its steps, at most "
            f"about --lr {cfg.lr:g} in size, round away on weights larger than {bound:.2g} in magnitude, "
            f"{rounded / total:.0%} of these. Keep float32 weights and autocast the forward pass (--model-dtype "
            f"float32 {'--bf16' if dtype == torch.bfloat16 else '--fp16'}), or train LoRA adapters (--lora 1), which "
            "are float32")


def make_optimizer(cfg: TrainConfig, model: torch.nn.Module, device: torch.device) -> torch.optim.AdamW:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("the model has no trainable parameters")
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    # fused AdamW: one kernel over all parameters, on CUDA and on CPU (where the unfused default is torch's
    # per-parameter loop: the foreach kernels exist only on GPU backends); the same update to rounding
    fused = device.type in FUSED_ADAMW_DEVICES and all(p.is_floating_point() for p in params)
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=cfg.lr, fused=fused or None)


def warmup_steps(cfg: TrainConfig, total_steps: int) -> int:
    """The steps of --warmup: a number of steps, or below 1 a fraction of the run's steps rounded up, as Hugging Face's
    Trainer rounds it (TrainingArguments.get_warmup_steps), so that a short run given a fraction warms up (rounded
    down, 0.1 of 5 steps was none); the fraction taken as written (decimal_product: 0.07 of 100 steps is 7, where the
    Trainer's float product rounds up to 8)."""
    return math.ceil(decimal_product(cfg.warmup, total_steps)) if cfg.warmup < 1 else int(cfg.warmup)


def schedule_words(cfg: TrainConfig, total_steps: int) -> str:
    """The learning rate and its schedule in words, as the start line and the model card give them."""
    warmup = warmup_steps(cfg, total_steps)
    return f"lr {cfg.lr:g} ({cfg.schedule}, warmup {warmup} step{'s' * (warmup != 1)})"


def precision_words(encoder, *, loss_scaling: bool) -> str:
    """The start line's words for the precision the encoder trains in, read from the model itself (a model given to
    train() keeps its own): its weights' dtypes (a LoRA run's frozen base apart from its adapters), the forward
    pass's autocast, and gradient checkpointing (transformers marks each layer that recomputes its activations)."""
    def names(dtypes) -> str:
        return "/".join(sorted(str(dtype).removeprefix("torch.") for dtype in dtypes))

    trainable = {p.dtype for p in encoder.parameters() if p.requires_grad}
    frozen = {p.dtype for p in encoder.parameters() if not p.requires_grad}
    words = (f"{names(trainable)} weights" if frozen <= trainable else
             f"{names(trainable)} trainable weights, {names(frozen)} frozen")
    if encoder.autocast:
        words += f", forward autocast to {names([AUTOCAST_DTYPES[encoder.autocast]])}"
        words += " with loss scaling" if loss_scaling else ""
    if any(getattr(module, "gradient_checkpointing", False) is True for module in encoder.modules()):
        words += ", gradient checkpointing"
    return words


def make_schedule(cfg: TrainConfig, optimizer, total_steps: int):
    warmup = warmup_steps(cfg, total_steps)

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


# -------------------------------------------------------------------------------------- one optimizer step


def optimizer_step(run: Run) -> dict:
    """grad_accum loss computations, each backpropagated as soon as it is computed (the gradients add up), then
    one AdamW step, unless the loss or the gradient norm is not finite (faults.py): then the step is skipped
    (no update, the schedule waits) and its batches still count as consumed. Returns the step's metrics row."""
    cfg, position = run.cfg, run.position
    batches = next_batches(run)
    run.guarded_loss.seen = False
    loss, (real_tokens, padded_tokens) = accumulate_gradients(run, batches)
    with phase("optimizer"):
        run.scaler.unscale_(run.optimizer)
        params = [p for p in run.encoder.parameters() if p.grad is not None]
        # measured even without clipping; with --fsdp, over every process's shards
        total_norm = sharding.full_value(torch.nn.utils.get_total_norm([p.grad for p in params]))
        grad_norm = float(total_norm)
        finite = not faults.any_rank(not faults.is_finite_step(loss, grad_norm, run.scaler.is_enabled()),
                                     run.dist_info, run.device)
        if finite:
            if cfg.max_grad_norm > 0:
                torch.nn.utils.clip_grads_with_norm_(params, cfg.max_grad_norm, total_norm)
            run.scaler.step(run.optimizer)  # skipped by the scaler if fp16 gradients overflowed
            run.scheduler.step()
            position.bad_streak = 0
        else:
            skipped_at = (position.epoch, position.batch)
            position.bad_steps += 1
            position.bad_streak += 1
        run.scaler.update()
        run.optimizer.zero_grad(set_to_none=True)
    position.step += 1
    position.batch += cfg.grad_accum
    row = {"step": position.step, "epoch": position.epoch, "loss": loss, "lr": run.scheduler.get_last_lr()[0],
           "grad_norm": grad_norm, "skipped": not finite, "bad_steps": position.bad_steps,
           "useful_tokens": real_tokens / padded_tokens}
    if not finite:
        report_bad_step(run, row, skipped_at, len(batches))
    return row


def report_bad_step(run: Run, row: dict, data_position: tuple[int, int], n_batches: int) -> None:
    """Say which step was skipped and where its data was; stop the run after --max-bad-steps in a row, or at its last
    step where no step of it was taken (fewer steps than --max-bad-steps: it would end as if trained)."""
    position, limit = run.position, run.cfg.max_bad_steps
    epoch, batch = data_position
    where = f"epoch {epoch}, batch{'es' if n_batches > 1 else ''} {batch}" + (
        f"-{batch + n_batches - 1}" if n_batches > 1 else "")
    if run.dist_info.is_main:
        what = ("non-finite embeddings (an overflow in the encoder's forward pass)" if run.guarded_loss.seen else
                f"non-finite loss ({row['loss']}) or gradient norm ({row['grad_norm']})")
        print(f"{run.log.line_start}step {row['step']}: skipped, {what} on the data at {where}; weights, optimizer "
              f"state and learning rate unchanged ({position.bad_streak} in a row"
              f"{f', the run stops at {limit}' if limit else ''})", flush=True)
    # a run whose every step so far was skipped, ending now: its weights are the ones it started from
    none_taken = position.bad_streak == row["step"] == run.total_steps
    if limit and (position.bad_streak >= limit or none_taken):
        advice = ("a lower --lr, more --warmup, float32 or bf16 rather than fp16, or a look at the data at that "
                  "position")
        good = None if position.good_checkpoint is None else checkpoint_path(run.cfg.output_dir,
                                                                               position.good_checkpoint)
        known = good in finished_checkpoints(run.cfg.output_dir)
        if run.dist_info.is_main:
            record_non_finite_stop(run.cfg.output_dir, step=row["step"], good_checkpoint=good if known else None)
        if known:
            # not simply the newest checkpoint: the update before it may have left the weights these steps failed on
            ahead = (f"The last good checkpoint (a finite step was taken from its weights) is {good}; any newer one "
                     "holds the weights these steps started from. Resume from it (--resume auto takes it, or "
                     f"--resume {good}) with {advice}")
        else:
            ahead = ("No checkpoint is known to be good (none has had a finite step taken from its weights). Try "
                     f"{advice}")
        raise faults.NonFiniteTrainingError(
            f"{position.bad_streak} optimizer steps in a row (the last: step {row['step']}, data at {where}) had "
            f"non-finite embeddings, loss or gradient norm; none of them changed the weights. {ahead}")


def accumulate_gradients(run: Run, batches: list[list[int]]) -> tuple[float, tuple[int, int]]:
    """Backpropagate the step's grad_accum batches (the gradients add up); return their mean loss and this
    process's (real, padded) token counts of the forward passes.

    Out of memory (faults.is_out_of_memory: on a GPU, or an allocation the CPU allocator refused): with
    --auto-chunk (one process), the step starts again from its first batch with half the
    per-pass budget (--chunk-tokens if set, else --chunk-size; plain backprop becomes the gradient cache with half
    of this process's texts per pass), the random generators reset so dropout draws as it would have; without it,
    an error that says what to change."""
    cfg = run.cfg
    start = RngState(run.device)
    while True:
        try:
            loss, tokens = _backpropagate(run, batches)
            break
        except RuntimeError as exc:  # torch.OutOfMemoryError on GPUs; the CPU allocator raises a RuntimeError
            if not faults.is_out_of_memory(exc):
                raise
            run.optimizer.zero_grad(set_to_none=True)
            seqs = run.dataset.batch(own_share(cfg, run.dist_info, batches[0])).seqs
            per_pass = cfg.chunk_tokens or cfg.chunk_size or len(seqs)
            smallest = max(seqs.lengths()) if cfg.chunk_tokens else 1  # one text per pass
            if not cfg.auto_chunk or per_pass <= smallest:
                raise torch.OutOfMemoryError(faults.oom_message(cfg, run.position.step, per_pass, len(seqs))) from exc
        # retry, out of the except block: the failed attempt's frames (and the tensors they hold) are gone
        if cfg.chunk_tokens:
            cfg.chunk_tokens, flag, unit = per_pass // 2, "--chunk-tokens", "tokens"
        else:  # plain backprop (its sub-batches too) becomes the gradient cache
            cfg.chunk_size, cfg.pass_tokens, flag, unit = per_pass // 2, 0, "--chunk-size", "texts"
        print(f"{run.log.line_start}out of memory with {per_pass} {unit} per forward pass: retrying step "
              f"{run.position.step + 1} with {flag} {per_pass // 2}", flush=True)
        if run.device.type == "cuda":
            torch.cuda.empty_cache()
        start.restore()
    for indices in batches:
        run.log.count(pairs=len(indices), tokens=sum(run.dataset.lengths_of(indices)))
    return loss, tokens


def _backpropagate(run: Run, batches: list[list[int]]) -> tuple[float, tuple[int, int]]:
    cfg = run.cfg
    step_fn = grad_cache_step if cfg.chunk_size or cfg.chunk_tokens else plain_step
    loss_sum, real, padded = 0.0, 0, 0
    with run.encoder.all_layers_out(cfg.espresso):  # Espresso: every layer's embeddings, for the loss only
        for j in range(len(batches)):
            with phase("data"):  # the first: the wait for the step's batches, made while the step before ran
                if j == 0:
                    prepared = step_data(run, batches)
                batch = prepared[j]
                chunks = [tuple(_to(run.device, item) for item in chunk) for chunk in batch.chunks]
                restore, labels = _to(run.device, batch.restore), _to(run.device, batch.labels)
            loss_scale = run.scaler.scale(torch.tensor(1.0 / cfg.grad_accum, device=run.device))
            loss = step_fn(run.model, chunks, labels, run.guarded_loss, loss_scale=loss_scale,
                           sync=j == cfg.grad_accum - 1, restore=restore)  # DDP: one all-reduce, after the last batch
            loss_sum += loss.item()
            real, padded = real + batch.tokens[0], padded + batch.tokens[1]
    return loss_sum / cfg.grad_accum, (real, padded)


@dataclass
class PreparedBatch:
    """One batch of a step as the CPU makes it (prepare_batches): this process's share of its rows in passes."""

    labels: torch.Tensor  # [rows], batch order
    chunks: list[tuple]  # each pass: (input_ids, attention_mask, dropout[, PackedTexts]) (PassPlan.tensors)
    restore: torch.Tensor | None  # PassPlan.restore_index
    tokens: tuple[int, int]  # (real, processed) tokens of the passes (PassPlan.token_counts)


def step_data(run: Run, batches: list[list[int]]) -> list[PreparedBatch]:
    """This step's batches as the CPU makes them (prepare_batches), made on a background thread while the step
    before ran where that step started them for the same position and pass settings (run.data_ahead), else now;
    then the next step's are started: in this epoch, or the next epoch's first, whose order (a pure function of
    the seed and the epoch: batch_order) the thread computes and keeps for next_batches (at tens of thousands of
    pairs an epoch is a few steps, and its first step's batches were made on the main thread: 0.36 s of CPU at
    65,536)."""
    cfg, position = run.cfg, run.position
    options = plan_options(cfg)
    make = functools.partial(prepare_batches, run, options=options)
    prepared = run.data_ahead.get((position.epoch, position.batch, options), functools.partial(make, batches))
    after, accum = position.batch + cfg.grad_accum, cfg.grad_accum
    if position.step + 1 < run.total_steps:
        if after + accum <= len(run.epoch_order):
            run.data_ahead.start((position.epoch, after, options),
                                 functools.partial(make, run.epoch_order[after:after + accum]))
        else:  # next_batches begins the next epoch at its first batches
            run.data_ahead.start((position.epoch + 1, 0, options),
                                 functools.partial(_first_of_epoch, run, position.epoch + 1, accum, make))
    return prepared


def _first_of_epoch(run: Run, epoch: int, accum: int, make) -> list[PreparedBatch]:
    """The first `accum` batches of `epoch`, prepared (make): its order computed as next_batches computes it, and
    kept for it (run.next_epoch_order)."""
    order = batch_order(run.cfg, run.dataset, epoch)
    run.next_epoch_order = (epoch, order)
    return make(order[:accum])


def prepare_batches(run: Run, batches: list[list[int]], *, options: tuple) -> list[PreparedBatch]:
    """Each batch's share of this process, cut into passes (Batch.plan with these plan_options) as CPU tensors,
    in pinned memory when the device is a GPU (copied to it without blocking)."""
    pin = run.device.type == "cuda"
    prepared = []
    for indices in batches:
        batch = run.dataset.batch(own_share(run.cfg, run.dist_info, indices))
        plan = batch.plan(**dict(options))
        chunks, restore = plan.tensors(run.encoder.pad_token_id, run.encoder.padding_side)
        labels = batch.labels
        if pin:
            chunks = [tuple(item.pin_memory() if isinstance(item, (torch.Tensor, PackedTexts)) else item
                            for item in chunk) for chunk in chunks]
            labels, restore = labels.pin_memory(), None if restore is None else restore.pin_memory()
        prepared.append(PreparedBatch(labels, chunks, restore, plan.token_counts()))
    return prepared


def own_share(cfg: TrainConfig, dist_info, indices: list[int]) -> list[int]:
    """This process's share of a batch's examples: the rank-th of world_size equal slices (count_steps checks that
    the batch size divides)."""
    share = cfg.batch_size // dist_info.world_size
    return indices[dist_info.rank * share:(dist_info.rank + 1) * share]


def _to(device: torch.device, item):
    """A pass's tensor (or PackedTexts) on the device, copied without blocking; anything else as it is."""
    return item.to(device, non_blocking=True) if isinstance(item, (torch.Tensor, PackedTexts)) else item


def plan_options(cfg: TrainConfig) -> tuple:
    """Batch.plan's arguments under the current settings, as (name, value) pairs (a key of OneAhead)."""
    if cfg.pass_tokens:
        return (("tokens", cfg.pass_tokens),)  # sub-batches exist to cut padding: always sorted
    return (("rows", cfg.chunk_size), ("tokens", cfg.chunk_tokens), ("sort", cfg.sort_passes),
            ("pack_width", cfg.pack))


def pass_plan(cfg: TrainConfig, batch) -> PassPlan:
    """The forward passes of this process's share of a batch, as the settings cut them (data.Batch.plan)."""
    return batch.plan(**dict(plan_options(cfg)))


def describe_passes(cfg: TrainConfig) -> str:
    """The run header's words for how a batch is cut into forward passes."""
    order = ", texts sorted by length" if cfg.sort_passes else ""
    packed = f", packed into rows of {cfg.pack} tokens" if cfg.pack else ""
    if cfg.chunk_tokens:
        return f"grad cache, passes of up to {cfg.chunk_tokens} {'real ' if cfg.pack else ''}tokens{order}{packed}"
    if cfg.chunk_size:
        return f"grad cache, chunks of {cfg.chunk_size} texts{order}{packed}"
    if cfg.pass_tokens:
        return f"plain backprop in sub-batches of up to {cfg.pass_tokens} tokens, texts sorted by length"
    return f"plain backprop{packed}"


def expected_useful_tokens(cfg: TrainConfig, dataset, order: list[list[int]], dist_info, batches: int = 64,
                           examples: int = 65_536) -> float:
    """The fraction of the tokens the encoder will process that are real text, over this process's share of the
    first `batches` batches of an epoch's `order` (batch_order), or fewer batches of at most `examples` examples in
    all (at least one): the run header's estimate (each step's is in its metrics row), which at 32,768 pairs a batch
    took 64 steps' data preparation (30 s packed)."""
    real = padded = 0
    for indices in order[:max(1, min(batches, examples // cfg.batch_size))]:
        batch_real, batch_padded = pass_plan(cfg, dataset.batch(own_share(cfg, dist_info, indices))).token_counts()
        real, padded = real + batch_real, padded + batch_padded
    return real / padded if padded else 1.0


def next_batches(run: Run) -> list[list[int]]:
    """The next step's grad_accum batches. When the epoch has fewer left, the next epoch begins (its order
    recomputed from (seed, epoch): that is what lets a resumed run see exactly the batches it would have)."""
    position, accum = run.position, run.cfg.grad_accum
    if position.batch + accum > len(run.epoch_order):
        position.epoch += 1
        position.batch = 0
        ahead = run.next_epoch_order  # made on the data thread (_first_of_epoch), when it got that far
        run.epoch_order = ahead[1] if ahead is not None and ahead[0] == position.epoch else batch_order(
            run.cfg, run.dataset, position.epoch)
        run.next_epoch_order = None
    return run.epoch_order[position.batch:position.batch + accum]


def batch_order(cfg: TrainConfig, dataset: TokenizedPairs | arccse.TokenizedSentences, epoch: int) -> list[list[int]]:
    return epoch_batches(len(dataset), cfg.batch_size, seed=cfg.seed, epoch=epoch, lengths=dataset.lengths,
                         bucket_size=cfg.bucket)


# ------------------------------------------------------------------------------------------------ evaluate


def evaluate(run: Run) -> None:
    """The dev score (evaluate.dev_scores: Spearman for scored pairs, nDCG@10 for (query, positive) pairs), and at
    each narrower trained width too (KEY@d: --matryoshka-dims, --espresso-dim); a new best model by the full width's
    score is exported to output_dir/best. Every process then holds the best score, which is part of the position a
    checkpoint saves. A score that is not finite (dev embeddings holding NaN or Inf; a Spearman of cosines all equal)
    is never a best (improves): its row holds the NaN and the log says why (report_unscored)."""
    position, sharded = run.position, run.cfg.fsdp
    metric = position.best_metric
    width = run.encoder.embedding_dim
    truncated = run.cfg.truncated_widths(width)
    embeddings = dev_embeddings(run)
    improved = False
    with distributed.stopping_together(run.dist_info):  # scored by the main process alone (unless sharded)
        if embeddings is not None:
            scores = scores_of_embeddings(run.dev_set, embeddings, truncated)
            improved = improves(scores[metric], position.best)
    if sharded:  # the gather below is a collective: every process follows the main process's decision
        improved = distributed.broadcast_from_main(improved, run.dist_info)
    if improved and run.cfg.save_best:
        weights = sharding.full_state_dict(run.encoder) if sharded else None  # every process, when sharded
    # the main process's export of a new best and its report: where they fail, every process stops
    with distributed.stopping_together(run.dist_info):
        if improved and run.cfg.save_best and run.dist_info.is_main:
            save_best(run.cfg, run.encoder, run.tokenizer, state_dict=weights, base_model=run.exports_base,
                      model_card=model_card(run, "best", {"step": position.step, **scores}),
                      step=position.step, score=scores[metric], metric=metric)
        if run.dist_info.is_main:
            score = scores[metric]
            if improved:
                position.best, position.best_step = score, position.step
            row = {"step": position.step, **scores, f"best_{metric}": position.best}
            run.result.evals.append(row)
            run.log.write(row)
            print(f"{run.log.line_start}step {position.step}: {tracking.DEV_METRICS[metric]} {score:.4f}"
                  + (" (best)" if improved else "")
                  + "".join(f" | @{d} {scores[f'{metric}@{d}']:.4f}" for d in truncated), flush=True)
            if not math.isfinite(score):
                report_unscored(run, embeddings)
    position.best, position.best_step = distributed.broadcast_from_main((position.best, position.best_step),
                                                                        run.dist_info)


def improves(score: float, best: float | None) -> bool:
    """Whether a dev score makes a new best model. One that is not finite (the evaluation's NaN: dev embeddings
    holding NaN or Inf, or a Spearman of cosines all equal) never does: NaN compares false with every number, so a
    NaN first score would stay the best for good. A finite one beats a best that is not finite (a checkpoint written
    before this rule)."""
    return math.isfinite(score) and (best is None or not math.isfinite(best) or score > best)


def report_unscored(run: Run, embeddings: list[torch.Tensor]) -> None:
    """Say why the dev evaluation at this step gave no score, that best/ is left as it was, and what the run does:
    it goes on, as after a skipped step (faults.py): a model whose weights overflowed has its optimizer steps skipped
    too, and --max-bad-steps of them in a row stop the run."""
    position, metric, limit = run.position, tracking.DEV_METRICS[run.position.best_metric], run.cfg.max_bad_steps
    bad = non_finite_rows(*embeddings)
    why = (f"{bad} of {sum(len(rows) for rows in embeddings)} dev embeddings hold NaN or Inf (an overflow in the "
           "encoder's forward pass)" if bad else "every dev cosine is equal, so the correlation is undefined (the "
           "embeddings collapsed)")
    kept = ("no best model yet" if position.best is None else
            f"the best stays {metric} {position.best:.4f}" + (f" (step {position.best_step})"
                                                               if position.best_step is not None else ""))
    goes_on = "" if position.step >= run.total_steps else (
        "; training goes on: a step whose embeddings, loss or gradient norm are not finite is skipped"
        + (f", and {limit} in a row stop the run" if limit else ""))
    print(f"step {position.step}: no dev score: {why}; not a best model, {kept}{goes_on}", flush=True)


def dev_embeddings(run: Run) -> list[torch.Tensor] | None:
    """The embeddings of the dev texts (evaluate.dev_inputs' groups) on the main process, None on the others. Under
    DDP each process embeds its share of every group, gathered on the main process (a dev set takes 1 / processes of
    the time it took the main process alone, while the others waited); a sharded (--fsdp) encoder embeds every text on
    every process at once."""
    cfg, processes = run.cfg, run.dist_info
    groups = dev_inputs(run.dev_set)
    shared = processes.enabled and not cfg.fsdp
    shares = [share_of(len(texts), processes) if shared else range(len(texts)) for texts, _ in groups]
    # a bar with --progress 1 where stderr is a terminal, on the main process: the texts it embeds
    with encoding_progress(run.encoder, sum(map(len, shares)), "dev",
                           progress=None if cfg.progress and processes.is_main else False):
        mine = [run.encoder.encode(texts[share.start:share.stop], run.tokenizer, prompt_name=role,
                                   batch_size=cfg.eval_batch_size, max_length=cfg.max_length)
                for (texts, role), share in zip(groups, shares)]
    if shared:
        gathered = distributed.all_gather_flat(processes, [rows.reshape(-1) for rows in mine])
        mine = [torch.cat([each[i] for each in gathered]).view(-1, rows.shape[1]) for i, rows in enumerate(mine)]
    return mine if processes.is_main or cfg.fsdp else None


def restore_best(run: Run) -> None:
    """On resume: best/ made the export of the checkpoint's best model (checkpoint.reconcile_best), which a killed
    run may have replaced after the checkpoint, or which lives in another output folder when the run resumes into a
    new one. When only the checkpoint's own weights are that model (its best was measured at its step), they are
    exported here, as evaluate() would have."""
    with distributed.stopping_together(run.dist_info):  # the main process's folder work: every process stops with it
        action = reconcile_best(run.cfg, run.resumed_from, run.position) if run.dist_info.is_main else None
    action = distributed.broadcast_from_main(action, run.dist_info)
    if action != "export":
        return
    sharded = run.cfg.fsdp
    weights = sharding.full_state_dict(run.encoder) if sharded else None  # every process, when sharded
    with distributed.stopping_together(run.dist_info):
        if run.dist_info.is_main:
            position = run.position
            save_best(run.cfg, run.encoder, run.tokenizer, state_dict=weights, base_model=run.exports_base,
                      model_card=model_card(run, "best"), step=position.best_step, score=position.best,
                      metric=position.best_metric)
            print(f"best/: exported the checkpoint's best model (step {position.best_step}, "
                  f"{tracking.DEV_METRICS[position.best_metric]} {position.best:.4f}) from its weights", flush=True)


def model_card(run: Run, name: str, current: dict | None = None) -> str:
    """README.md of the export `name` (best or final): the base model, the command, the data, the loss, the steps,
    the dev scores so far (metrics.jsonl's, and `current`: the evaluation that made this best/; measured as training
    embeds, under its autocast, where angle-eval embeds without) and how to load it."""
    cfg, position = run.cfg, run.position
    path = run.log.metrics_path
    rows = tracking.read_metrics(path) if path and os.path.exists(path) else []
    metric = run.position.best_metric
    evals = [row for row in rows if tracking.has_numbers(row, metric)] + ([current] if current else [])
    fmt = getattr(run.dataset, "fmt", None)
    data = (f"{len(run.dataset):,} sentences (ArcCSE)" if fmt is None else
            f"{len(run.dataset):,} examples in format {fmt} ({', '.join(FORMATS[fmt])})")
    loss = loss_description(cfg, fmt, run.loss_name, run.encoder.embedding_dim)
    widths = cfg.truncated_widths(run.encoder.embedding_dim)  # a run of the full width alone offers no prefix

    def source(argument: str, flag_value, split: str | None = None) -> str:
        """What the flag names (with the split read, where it has splits: a hub name or a save_to_disk folder of a
        DatasetDict), or what train() was given in its place."""
        if argument in run.given:
            return f"the {argument.replace('_', ' ')} given to train()"
        has_splits = (flag_value not in BUILTIN_DATASETS and not has_no_splits(flag_value)
                      and not holds_one_dataset(flag_value))
        return f"`{flag_value}`" + (f" (split `{split}`)" if split is not None and has_splits else "")

    # a given model by the name it was loaded by, as the start-up line names it
    base = given_model_words(run.exports_base) if "model" in run.given else source("model", cfg.model)
    train_data = source("train_examples", cfg.train_data, cfg.train_split)
    dev_data = source("dev_examples", cfg.dev_data, cfg.dev_split)
    adapter_only = name == "best" and best_is_adapter_only(run.encoder, run.exports_base)  # as save_best writes it
    which = f"the best model by {tracking.DEV_METRICS[metric]}" if name == "best" else "the model after the last step"
    library = "peft" if adapter_only else \
        "transformers" if sentence_transformers_cannot_load(run.encoder) else "sentence-transformers"
    lines = ["---", f"library_name: {library}", "tags: [sentence-transformers, angle-train]", "---", "",
             f"# {os.path.basename(os.path.normpath(cfg.output_dir))}/{name}", "",
             f"A text embedding model fine-tuned from {base} with angle-train (angle_kernels {__version__}); "
             f"{which}.", "",
             "## Training", "", "```bash", run.command, "```", ""]
    if position.resumes:  # the command is the last run's: the settings a resume changed, and from which step
        lines += ["Resumed with changed settings: " + "; ".join(
            f"at step {resume['step']}, {resume['changed']}" for resume in position.resumes)
            + " (the command above is the last run's).", ""]
    if run.given:  # the command's --model / --train-data / --dev-data are then not what trained the model
        lines += [f"From Python: train() was given the {', '.join(g.replace('_', ' ') for g in run.given)} in place of "
                  "the flags above.", ""]
    lines += [f"- base model: {base}, pooling {run.encoder.pooling}, embeddings of {run.encoder.embedding_dim} "
              f"dimensions" + (f" (trained truncatable to {', '.join(map(str, widths))})" if widths else ""),
              *([lora_description(run.encoder, adapter_only, lora_path=cfg.lora_path)]
                if is_peft_model(run.encoder.backbone) else []),
              f"- data: {train_data}, {data}"
              + (f"; dev: {dev_data}, {dev_description(run.dev_set)}" if run.dev_set else ""),
              f"- loss: {loss}",
              f"- steps: {position.step} optimizer step{'s' * (position.step != 1)} of {run.total_steps}, each "
              f"{cfg.batch_size} x {cfg.grad_accum} {batch_items(fmt)}; {schedule_words(cfg, run.total_steps)}; "
              f"texts cut at {cfg.max_length} tokens",
              ""]
    if evals:
        label = tracking.DEV_METRICS[metric]
        what = ("cosine similarity against the gold scores" if metric == "dev_spearman" else
                "cosine retrieval of each query's positives among every distinct dev positive")
        lines += ["## Evaluation", "", f"{label[0].upper() + label[1:]} ({what}) on {dev_data}:",
                  "", f"| step | {tracking.DEV_METRICS[metric]} |", "|---|---|"]
        lines += [f"| {row['step']} | {tracking.number_at(row, metric):.4f} |" for row in evals]
        lines += [""]
    lines += ["## Usage", ""] + usage(run.encoder, widths, adapter_only=adapter_only) + [
        "`angle-eval path ...` gives STS and retrieval scores.", ""]
    return "\n".join(lines)


def loss_description(cfg: TrainConfig, fmt: str | None, loss_name: str, width: int) -> str:
    """The loss `loss_name` (AngleLoss, ArcCSELoss or a loss_fn given to train(), named only) on data format `fmt`
    and embeddings of `width` features, as the run's header and the model card give it: the weights and scales of
    the terms the format computes (format B's one contrastive term reads no weight: FORMAT_IGNORES), the
    in-batch-negative options that differ from AnglE's, and the widths (Matryoshka) or layers (Espresso) the loss is
    applied at. A card that listed format B's unread weights and left these out described another loss than the one
    trained; the header named the loss's class alone."""
    if loss_name == "ArcCSELoss":
        loss = f"ArcCSELoss: ArcCon (margin {cfg.arccon_margin:g} degrees, tau {cfg.arccon_tau:g})"
        # a triplet weight of 0 embeds no masked copy (arccse.blocks_of): naming their rates described copies never made
        loss += (f" + {cfg.triplet_w:g} x triplet (masked copies at {cfg.mask_rates})"
                 if arccse.blocks_of(cfg.triplet_w) == arccse.BLOCKS else " alone (triplet weight 0: no masked copies)")
    elif loss_name == "AngleLoss":
        weights = [w for w in ("cosine_w", "ibn_w", "cln_w", "angle_w") if w not in FORMAT_IGNORES.get(fmt, ())]
        loss = f"AngleLoss (format {fmt}): " + (
            ", ".join(f"{w}={getattr(cfg, w):g}" for w in weights)
            + f"; scales cosine_tau={cfg.cosine_tau:g}, ibn_tau={cfg.ibn_tau:g}, angle_tau={cfg.angle_tau:g}"
            if weights else f"the contrastive term of each query against the positives (no weights), "
                            f"ibn_tau={cfg.ibn_tau:g}")
        if cfg.ibn_partition != default_of("ibn_partition"):
            loss += f"; in-batch-negative partition {cfg.ibn_partition}"
        if cfg.false_negative_margin is not None:
            loss += (f"; false negatives filtered (margin {cfg.false_negative_margin:g}, "
                     f"{cfg.false_negative_strategy})")
    else:
        return loss_name
    if cfg.espresso:
        compressed = min(cfg.espresso_dim, width)
        earlier = "the earlier layers' losses weighted 1 / (1 + ln(1 + i)) and averaged"
        loss += (f"; Espresso: the last layer at widths {width} and {compressed}, every earlier one at {compressed}, "
                 f"{earlier}" if compressed < width else
                 f"; Espresso: every layer at width {width}, the last one's loss counted twice, {earlier}")
    elif cfg.matryoshka_dims:
        loss += f"; Matryoshka widths {', '.join(map(str, cfg.matryoshka_dims))}" + (
            f" weighted {', '.join(f'{w:g}' for w in cfg.matryoshka_weights)}" if cfg.matryoshka_weights else "")
    return loss


def lora_description(encoder, adapter_only: bool, *, lora_path: str | None = None) -> str:
    """The model card's line on the adapters of a LoRA encoder: their settings as peft holds them (the run's flags, a
    --lora-path adapter's own, or a model given to train()), the adapter the run started from (--lora-path), the
    frozen weights' dtype, and where the export keeps them (best/: the adapter alone; final/: merged into the
    weights, and the adapter alone in adapter/, as export.save_pretrained writes them)."""
    config = lora_config(encoder)
    frozen = next((p.dtype for p in encoder.parameters() if not p.requires_grad), None)
    where = ("this folder holds the adapter alone" if adapter_only else
             "merged into this folder's weights; the adapter alone is in `adapter/` (peft's files, which "
             "`angle-eval path/adapter` scores on its base model)")
    return (f"- LoRA: {lora_rank_and_alpha(config)}, dropout {config.lora_dropout:g} on "
            f"{', '.join(adapted_layer_names(config.target_modules))}"
            + (f", training continued from the adapter `{lora_path}`" if lora_path else "")
            + (f", the base model's weights frozen in {str(frozen).removeprefix('torch.')}" if frozen else "")
            + f"; {where}")


def lora_config(encoder):
    """The peft LoraConfig of a LoRA encoder's adapters (one adapter: angle_train trains and loads no other)."""
    return next(iter(encoder.backbone.peft_config.values()))


def lora_rank_and_alpha(config) -> str:
    """A LoRA config's rank and alpha in words; alpha as peft holds it, whole or not, in full (16.5; 32, not 32.0):
    the scale the weights were trained at, alpha / rank, or alpha / sqrt(rank) for an rsLoRA adapter (peft's
    use_rslora: --lora-rslora 1, a --lora-path adapter's or a model given to train()'s), said so."""
    return f"rank {config.r}, alpha {whole_as_int(config.lora_alpha)}" + (", rsLoRA" if config.use_rslora else "")


def lora_start_words(cfg: TrainConfig, encoder, *, given_model: bool) -> str:
    """The start line's words for a LoRA encoder's adapters, as peft built them: rank, alpha and the scale of the
    adapters' output (as peft's layers hold it: alpha / rank, or alpha / sqrt(rank) for an rsLoRA adapter), dropout
    and the layers adapted; and where they came from: the --lora-path adapter (with a --lora-dropout that replaced
    its dropout), or the flags and config.LORA_DEFAULTS, every linear layer where --lora-targets names none.
    given_model: a model given to train(), whose adapters are its own (train() takes no --lora-path with it)."""
    config = lora_config(encoder)
    scales = sorted({scale for module in encoder.modules() if isinstance(getattr(module, "scaling", None), dict)
                     for scale in module.scaling.values()})
    layers = ", ".join(adapted_layer_names(config.target_modules))
    if not (given_model or cfg.lora_targets):
        layers = f"every linear layer ({layers})"
    replaced = replaced_adapter_dropout(cfg)
    return ("LoRA " + (f"from the adapter {cfg.lora_path}: " if cfg.lora_path else "") + lora_rank_and_alpha(config)
            + (f" (scale {', '.join(f'{scale:.3g}' for scale in scales)})" if scales else "")
            + f", dropout {config.lora_dropout:g}"
            + (f" (--lora-dropout; the adapter's {replaced:g})" if replaced is not None else "") + f" on {layers}")


def dev_description(dev_set: StsSet | RetrievalSet) -> str:
    """The model card's words for the dev set's size: of a retrieval set, what it ranks (RetrievalSet.corpus): its
    rows counted a query given with several positives once per positive, and a positive shared by queries once per
    query, where the evaluation ranks each distinct text once."""
    if isinstance(dev_set, StsSet):
        return f"{len(dev_set.examples):,} scored pairs"
    corpus = dev_set.corpus()
    return (f"{len(corpus.queries):,} distinct queries, {len(corpus.documents):,} documents in the corpus, "
            f"{len(corpus.relevant):,} relevant (query, document) pairs")


def usage(encoder, widths, adapter_only: bool = False) -> list[str]:
    """The model card's usage lines for an export of `encoder`: sentence-transformers where it loads the model as
    trained (its prompts by name, its Matryoshka widths by truncate_dim), else angle_train.load_pretrained, which
    applies the pooling, prompts and attention the model was trained with. An adapter-only export (a LoRA run's
    best/) is loaded the same ways, over the base model its adapter names, which must then be at hand."""
    # a model that ships its own code (config.json's auto_map) loads only where trusted, in either library
    trusted = ", trust_remote_code=True" if ships_own_code(encoder.backbone) else ""
    own = ["from angle_train import load_pretrained", "",
           f'encoder, tokenizer, meta = load_pretrained("path/to/this/folder"{trusted})',
           'embeddings = encoder.encode(["A first sentence.", "A second one."], tokenizer)']
    base = (["This folder holds the LoRA adapter only: loading it loads the base model it was trained from (recorded "
             "in adapter_config.json and angle_train.json) and applies the adapter.", ""] if adapter_only else [])
    cannot = sentence_transformers_cannot_load(encoder)
    if cannot:
        return ["```python", *own, "```", "", *base, f"Not through sentence-transformers: {cannot}. It still loads "
                "this folder, without an error, as a plain Hugging Face model (mean pooling, a decoder's causal "
                "attention), and gives other embeddings than this model's.", ""]
    roles = prefix_prompts(encoder)
    lines = ["```python", "from sentence_transformers import SentenceTransformer", "",
             f'model = SentenceTransformer("path/to/this/folder"{trusted})']
    if roles and {"query", "document"} & roles.keys() and roles.get("query") != roles.get("document"):
        lines += ['query_embeddings = model.encode(["a question"], prompt_name="query")',
                  'document_embeddings = model.encode(["a passage"], prompt_name="document")']
    else:
        lines += ['embeddings = model.encode(["A first sentence.", "A second one."])']
    if widths:
        lines += [f"# a Matryoshka prefix: the first {min(widths)} dimensions, normalised",
                  f'small = SentenceTransformer("path/to/this/folder", truncate_dim={min(widths)}{trusted})',
                  'small_embeddings = small.encode(["A first sentence."], normalize_embeddings=True)']
    lines += ["```", ""]
    if roles is None:
        lines += [f"The prompts ({encoder.prompts.described()}) put text after '{{text}}', which "
                  "sentence-transformers' prompts cannot express: wrap the texts in them before `encode` (right "
                  "only for texts within the max length: of a longer one sentence-transformers cuts the end, the "
                  "prompt's close, where angle-train cuts the text and keeps the prompt), or load the model with "
                  "angle-train, which applies them:", "",
                  "```python", *own, "```", ""]
    else:
        lines += ["or `angle_train.load_pretrained(path)` (with its pooling, prompts and attention as trained).", ""]
    if trusted:
        lines += ["The model runs the Python code in this folder (config.json's auto_map): read it before trusting "
                  "it.", ""]
    return lines + base


# -------------------------------------------------------------------------------------------------- finish


def finish(run: Run, signals: faults.StopSignals) -> TrainResult:
    """After the last step: the final export and a summary line (main process). A signal during the export
    abandons it and stops the run resumable, as during a step: a checkpoint of the last step (on every process
    together), then faults.Preempted; `--resume auto` then only exports."""
    cfg, position, result = run.cfg, run.position, run.result
    result.best_score = position.best
    run.log.end_bar()
    # --fsdp: the whole weights, gathered from every process's shards (every process takes part)
    weights = sharding.full_state_dict(run.encoder) if cfg.fsdp and cfg.save_final else None
    interrupted = False
    with distributed.stopping_together(run.dist_info):  # a failed export stops every process
        if run.dist_info.is_main and cfg.save_final:
            try:
                result.final_path = save_final(cfg, run.encoder, run.tokenizer, state_dict=weights,
                                               base_model=run.exports_base, while_writing=signals.interrupting,
                                               model_card=model_card(run, "final"))
            except faults.Interrupted:
                interrupted = True
    if faults.any_rank(interrupted, run.dist_info, run.device):
        path = checkpoint_path(cfg.output_dir, position.step)
        if path not in finished_checkpoints(cfg.output_dir):
            path = save(run)
        raise faults.Preempted(signals.requested or "a signal to another process", path)
    signals.complete(f"final model: {result.final_path}" if result.final_path else f"all {run.total_steps} steps "
                     "done")
    with distributed.stopping_together(run.dist_info):  # the others wait for it as the process group is left
        if run.dist_info.is_main:
            report_finish(run)
    return result


def report_finish(run: Run) -> None:
    """The run's closing words (main process): best/ when it holds the reported best, curves.png, the summary line."""
    cfg, position, result = run.cfg, run.position, run.result
    best = os.path.join(cfg.output_dir, "best")
    # only a best/ that holds the reported best (a checkpoint from an older angle_train records no step: its best/)
    if position.best is not None and cfg.save_best and (
            best_holds(best, position) or (position.best_step is None and os.path.isdir(best))):
        result.best_path = best
    try:
        result.curves_path = tracking.plot_curves(run.log.metrics_path, os.path.join(cfg.output_dir, "curves.png"),
                                                  lr_curve=lr_curve(run))
    except OSError as exc:  # a picture of metrics.jsonl, which is written: a run whose models are in place is done
        print(f"note: no curves.png ({exc.strerror or exc}): metrics.jsonl holds the curves' numbers", flush=True)
    if not result.history:  # resumed from a checkpoint of the last step: nothing was left to train
        print(f"done: the run had already reached its last step ({position.step}) when it was resumed; nothing "
              f"left to train{f', final model exported to {result.final_path}' if result.final_path else ''}",
              flush=True)
        return
    last = result.history[-1]
    mean_loss, steps = run.log.last_loss or (last["loss"], 1)
    unit = batch_items(getattr(run.dataset, "fmt", None))
    loss = (f"loss {mean_loss:.4f} (mean of the last {steps} step{'s' * (steps != 1)})" if steps else
            "no finite loss (the steps of the last metrics row were skipped)")
    timed, seconds = run.log.run_steps, run.log.run_seconds or float("inf")
    print(f"done: {position.step} step{'s' * (position.step != 1)} | {loss} | {run.log.run_pairs / seconds:.1f} "
          f"{unit}/s, {run.log.run_tokens / seconds:.0f} tokens/s (over the {timed} step{'s' * (timed != 1)} trained"
          f"{' since the resume' if timed != position.step else ''}) | "
          f"peak memory {peak_memory_gb(run.device):.2f} GiB{'' if run.device.type == 'cuda' else ' (process RSS)'}"
          + (f" | best {tracking.DEV_METRICS[position.best_metric]} {position.best:.4f}"
             if position.best is not None else ""), flush=True)


def lr_curve(run: Run, points: int = 2000) -> list[tuple[int, float]]:
    """(step, learning rate after it) of the whole schedule as planned, from step 0 (the first step's rate) through
    the warmup to the last step: the curves' learning-rate panel (metrics rows come only every --log-every steps,
    which would cut the warmup short). At most about `points` steps, the schedule's corners (the warmup's end, the
    last step) among them: it is linear between them, cosine aside. A step skipped as non-finite delays the rates
    actually used by one step."""
    warmup, total = warmup_steps(run.cfg, run.total_steps), run.total_steps
    steps = sorted(set(range(0, total + 1, max(1, total // points))) | {min(warmup, total), total})
    rate = run.scheduler.base_lrs[0]
    return [(step, rate * run.scheduler.lr_lambdas[0](step)) for step in steps]


# ---------------------------------------------------------------------------------------------------- logging


class RunLog:
    """What a run reports. Every process measures pairs/s and tokens/s (real tokens, padding excluded) over the
    steps since the last metrics row, whose loss is the mean over those steps too, as the Hugging Face Trainer
    logs it (steps skipped as non-finite left out; TrainResult.history keeps each step's own); the main process
    writes config.json, metrics.jsonl (and the --report-to reporters: tracking.py) and the progress bar (loss,
    pairs/s, tokens/s, peak memory). The closing line's rates are the whole run's: every window's sums."""

    def __init__(self, cfg: TrainConfig, is_main: bool, device: torch.device, total_steps: int, start_step: int,
                 losses: list[float] | None = None, *, unit: str = "pairs"):
        self.log_every, self.total_steps, self.device = max(1, cfg.log_every), total_steps, device
        self.unit = unit  # what a batch holds (batch_items): the rate's name in the progress bar and the rows
        self.metrics_path = os.path.join(cfg.output_dir, "metrics.jsonl") if is_main else None
        self.reporters, self.bar = [], None
        self.last_loss: tuple[float, int] | None = None  # the last row's mean loss, over how many steps
        # every window's counts and training time summed: the closing line's rates (the last row's are one window's)
        self.run_pairs = self.run_tokens = self.run_steps = 0
        self.run_seconds = 0.0
        os.makedirs(cfg.output_dir, exist_ok=True)
        if is_main:
            # replaced whole: a resume that fails to write it leaves the run's settings (--config reads them back)
            with written_aside(os.path.join(cfg.output_dir, "config.json"), encoding="utf-8") as f:
                json.dump(asdict(cfg), f, indent=2)
            _drop_rows_after(self.metrics_path, start_step)
            self.reporters = tracking.open_reporters(tracking.resolve_report_to(cfg.report_to), cfg.output_dir,
                                                     asdict(cfg))
            self.bar = _progress(cfg, total_steps, start_step)
        self._start_window()
        # resumed: the losses of the steps since the last row the checkpointed run wrote (Position.loss_window)
        self.losses = list(losses or [])

    def _start_window(self) -> None:
        self.pairs = self.tokens = 0
        self.losses: list[float] = []
        self.window_start = time.perf_counter()

    def count(self, *, pairs: int, tokens: int) -> None:
        self.pairs += pairs
        self.tokens += tokens

    @property
    def line_start(self) -> str:
        """What a line printed during training starts with: a line break where the progress bar is shown, so that the
        line starts past the bar's; nothing without one (a break there is an empty line)."""
        return "\n" if self.bar is not None else ""

    @contextlib.contextmanager
    def paused(self):
        """The time spent inside (evaluation, checkpoints, restoring best/) is left out of the window: pairs/s and
        tokens/s measure the training steps (they had counted a dev evaluation into the next row's rate)."""
        started = time.perf_counter()
        try:
            yield
        finally:
            self.window_start += time.perf_counter() - started

    def step(self, row: dict) -> None:
        """Add throughput and peak memory to a step's row; write it every log_every steps and after the last."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        elapsed = time.perf_counter() - self.window_start
        # pairs_per_s is the examples (or sentences) a second whatever they are, the key read since the first
        # version; the rate under the unit's own name is beside it where the unit is another
        rate = self.pairs / elapsed
        row.update({"pairs_per_s": rate, f"{self.unit}_per_s": rate, "tokens_per_s": self.tokens / elapsed,
                    "peak_mem_gb": peak_memory_gb(self.device)})
        if not row.get("skipped") and math.isfinite(row["loss"]):
            self.losses.append(row["loss"])
        mean_loss = sum(self.losses) / len(self.losses) if self.losses else row["loss"]
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{mean_loss:.4f}", **{f"{self.unit}_s": f"{rate:.1f}"},
                                 tok_s=f"{row['tokens_per_s']:.0f}", mem=f"{row['peak_mem_gb']:.2f}G")
        self.run_steps += 1
        if self.writes_row(row["step"]):
            self.write({**row, "loss": mean_loss})
            self.last_loss = (mean_loss, len(self.losses))
            self.run_pairs, self.run_tokens = self.run_pairs + self.pairs, self.run_tokens + self.tokens
            self.run_seconds += elapsed
            self._start_window()

    def writes_row(self, step: int) -> bool:
        """Whether step() writes a row after this step: every log_every steps, and after the last."""
        return every(self.log_every, step) or step == self.total_steps

    def write(self, row: dict) -> None:
        """Append a row to metrics.jsonl and hand it to the --report-to reporters (main process only; a no-op
        elsewhere)."""
        if self.metrics_path is None:
            return
        with open(self.metrics_path, "a") as f:
            f.write(tracking.metrics_line(row))
        for reporter in self.reporters:
            reporter.log(row)

    def end_bar(self) -> None:
        """Close the progress bar once the last step is done: the final export's and the closing report's lines
        then print below the finished bar (closed at the run's end instead, tqdm drew it again under them, after the
        summary line had been printed onto the bar's own)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def close(self) -> None:
        self.end_bar()
        for reporter in self.reporters:
            reporter.close()


def peak_memory_gb(device: torch.device) -> float:
    """Peak GPU memory allocated by tensors, or the process's peak RSS on CPU, in GiB (2^30 bytes; metrics.jsonl's
    peak_mem_gb keeps its name, which scripts read)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux: KiB


def _drop_rows_after(path: str, step: int) -> None:
    """On resume, drop the rows a killed run wrote after its last checkpoint (they are about to be redone), and a
    last line without its newline (torn by the kill). Lines that are not metrics rows (tracking.metrics_row: not
    JSON, not UTF-8, no whole-number step) are dropped with a warning naming them."""
    if not os.path.exists(path):
        return
    with open(path, "rb") as f:
        *lines, _torn = f.read().split(b"\n")  # the last piece: empty after a final newline, else torn
    rows, unreadable = [], []
    for number, line in enumerate(lines, start=1):
        row = tracking.metrics_row(line) if line.strip() else {"step": -1}
        if row is None:
            unreadable.append(number)
        elif 0 <= row["step"] <= step:
            rows.append(line.decode("utf-8") + "\n")
    if unreadable:
        shown = ", ".join(map(str, unreadable[:10])) + (", ..." if len(unreadable) > 10 else "")
        print(f"angle-train: warning: {path}: dropped {len(unreadable)} line(s) that are not metrics rows (line "
              f"{shown})", file=sys.stderr, flush=True)
    with written_aside(path) as f:  # replaced whole, never truncated in place: a kill now loses no row
        f.writelines(rows)


def _progress(cfg: TrainConfig, total: int, start: int):
    if not cfg.progress:
        return None
    try:
        from tqdm.auto import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=start, desc="train", dynamic_ncols=True)
