"""TrainConfig: every setting of a run, with its default and a one-line help (the CLI is built from it)."""

from __future__ import annotations

import argparse
import math
import numbers
import os
import shlex
from dataclasses import MISSING, dataclass, field, fields

from angle_kernels.inputs import check_arccon_options, check_scale

from .arccse import TEXT_COLUMN
from .cli_common import choice_hint, comma_separated, did_you_mean, parse_bool
from .data import Prompts, parse_columns, refuse_missing_local_path
from .models import (
    ADAPTER_CONFIG, ADAPTER_FOLDER, ATTENTION_IMPLEMENTATIONS, PACKING_ATTENTION, PEFT_LORA_DROPOUT,
    SIXTEEN_BIT_ATTENTION, adapted_layer_names, adapter_config_base, read_adapter_config,
)

MAX_SEED = 2**32 - 1  # numpy's and many other generators' limit: a seed every library the run uses accepts
# Plain backprop's sub-batches on CPU (--pass-tokens): MiniLM on STS-B, 2 cores, forward + backward per step, one
# padded pass vs length-sorted sub-batches of at most this many tokens: 371 -> 291 ms at 16 pairs, 2199 -> 950 ms
# at 64 (256 to 1,024 tokens all within 10% of the best; on a GPU, big passes: one pass until measured there).
CPU_PASS_TOKENS = 512
# Packed rows on CPU (--pack): MiniLM on STS-B, 2 cores, forward + backward of a plain step through angle-train's own
# pass plans (bench/results/cpu-2026-11-26-training/packing/): length-sorted padded sub-batches of 512 tokens
# 351 ms at 16 pairs, packed rows of 128 tokens 212 ms (64: 222, 256: 233); at 64 pairs 911 vs 737 ms (64: 655,
# 256: 723, 512: 781: a row's attention grows with its width squared). On a GPU: padded passes until measured there.
CPU_PACK_WIDTH = 128
# The LoRA settings a run takes where neither their flag nor the --lora-path adapter gives one. Their fields default to
# None, "not given", so that a given value is known as given whatever it is: with --lora-path, `--lora-r 16` is
# compared with the adapter's rank as `--lora-r 8` is (`--lora-rslora 0` with its use_rslora alike), and
# `--lora-dropout 0.05` replaces its dropout (TrainConfig._take_adapter_settings)
LORA_DEFAULTS = {"lora_r": 16, "lora_alpha": 32, "lora_rslora": False, "lora_dropout": 0.05}
# The passes over the data a run takes where --epochs is not given and --max-steps does not set its length. The field
# defaults to None, "not given", as the LoRA settings do: `--epochs 1` given with --max-steps is compared with it (the
# note of trainer.max_steps_note) as `--epochs 2` is; left out with --max-steps, it stays None (_take_epochs)
DEFAULT_EPOCHS = 1.0

# Why float16 trainable weights cannot train under --fp16 (the CLI's --model-dtype float16, a model given to train()):
# torch's GradScaler refuses to unscale float16 gradients at the first optimizer step
FP16_WEIGHTS_CANNOT_UNSCALE = "float16 weights take float16 gradients, which --fp16's loss scaling cannot unscale"


def opt(default, help: str, **extra):
    """A config field with its --help text (kept next to the default so the two never drift apart)."""
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata={"help": help, **extra})
    return field(default=default, metadata={"help": help, **extra})


@dataclass
class TrainConfig:
    # ---- model
    model: str = opt("builtin:tiny-bert", "Hugging Face hub name or local folder of the base model (encoder or "
                     "decoder-only LM; loaded without LM head), or builtin:tiny-bert / builtin:tiny-llama",
                     group="model")
    revision: str = opt(None, "the version of --model's Hugging Face Hub repository to load: a branch, a tag or a "
                        "commit hash (default: its main branch); the exports record it, and their adapters load the "
                        "base model at it", group="model")
    pooling: str = opt(None, "cls, cls_avg, avg, max or last (default: the model folder's own, from its "
                       "sentence-transformers pooling config; else cls for encoders, last for decoder LMs)",
                       group="model", choices=["cls", "cls_avg", "avg", "max", "last"])
    max_length: int = opt(128, "truncate every text to this many tokens, prompt included (a text is cut, never the "
                          "prompt's words after it)", group="model",
                          at_least=1)
    prompt: str = opt(None, "template applied to every text without a prompt of its own (format A's texts, dev "
                      "evaluation; angle-emb's text_prompt); '{text}' marks the text (else it is a prefix); 'angle' "
                      "(= Prompts.A) selects the AnglE prompt 'Summarize sentence \"{text}\" in one word:\"' (for "
                      "LLMs); Prompts.B and Prompts.C are angle-emb's other prompts", group="model",
                      aliases=["--text-prompt"])
    query_prompt: str = opt(None, "template for the query of formats B and C (default: --prompt; '' for none); "
                            "saved with the model: encode(texts, tokenizer, prompt_name='query')", group="model")
    doc_prompt: str = opt(None, "template for the positive and negative of formats B and C (default: --prompt; '' "
                          "for none); saved with the model: encode(..., prompt_name='document')", group="model")
    model_dtype: str = opt("float32", "dtype of the weights: float32, bfloat16, float16 or float64", group="model",
                           choices=["float32", "bfloat16", "float16", "float64"])
    bf16: bool = opt(False, "autocast the forward pass to bfloat16 (embeddings and loss stay float32)", group="model")
    fp16: bool = opt(False, "autocast the forward pass to float16", group="model")
    bidirectional: bool = opt(None, "decoder LMs (LLaMA, Mistral, Qwen...): remove the causal mask, so every token "
                              "attends to the whole text (padding stays masked); kept with the exported model "
                              "(default: an angle_train export's own, from its angle_train.json; else 0)",
                              group="model")
    gradient_checkpointing: bool = opt(False, "recompute activations in backward (less memory, ~30%% slower)",
                                       group="model")
    trust_remote_code: bool = opt(False, "run the Python code a model's folder or hub repository ships (config.json's "
                                  "auto_map: custom architectures such as gte-base-en-v1.5's or nomic-embed's); it "
                                  "runs with your permissions: read it first", group="model")
    attention: str = opt(None, "the base model's attention implementation, by transformers' name: sdpa, eager, "
                         "flash_attention_2 or flash_attention_3 (a GPU, their package flash-attn, and --bf16 / "
                         "--fp16 or 16-bit weights), flex_attention (default: transformers' choice for the model, "
                         "sdpa where it has it); --pack takes sdpa or eager", group="model",
                         choices=list(ATTENTION_IMPLEMENTATIONS))
    lora: bool = opt(False, "train LoRA adapters instead of all weights (needs peft)", group="lora")
    lora_r: int = opt(None, f"LoRA rank (default: {LORA_DEFAULTS['lora_r']}; with --lora-path, the adapter's)",
                      group="lora", at_least=1)
    lora_alpha: float = opt(None, f"LoRA alpha, any number > 0 (16.5 too; scale = alpha / r; alpha / sqrt(r) for an "
                            f"rsLoRA adapter (--lora-rslora); default: {LORA_DEFAULTS['lora_alpha']}; with "
                            "--lora-path, the adapter's)", group="lora", above=0)
    lora_rslora: bool = opt(None, "rank-stabilised LoRA: scale the adapters' update by alpha / sqrt(r) instead of "
                            "alpha / r, so that its size stays steady as r grows, where alpha / r shrinks it and large "
                            "ranks learn little more than small ones (peft's use_rslora; default: 0, alpha / r; with "
                            "--lora-path, the adapter's)", group="lora")
    lora_dropout: float = opt(None, f"dropout on the LoRA branch (default: {LORA_DEFAULTS['lora_dropout']}; with "
                              "--lora-path, the adapter's)", group="lora", at_least=0, below=1)
    lora_targets: list = opt([],  # noqa: RUF009 (opt() builds a default_factory for lists)
                             "module names to adapt, separated by spaces or commas (q_proj v_proj, or angle-emb's "
                             "q_proj,v_proj; default: every linear layer)", group="lora")
    lora_path: str = opt(None, "continue training a LoRA adapter: a local folder of peft's files (an adapter "
                         "angle-emb trained, its pretrained_lora_path; a run's final/adapter or adapter-only best/), "
                         "whose weights start the run's LoRA and whose rank, alpha, rsLoRA scaling, dropout and "
                         "layers apply (a --lora-r, --lora-alpha, --lora-rslora or --lora-targets that differs is "
                         "refused; --lora-dropout replaces its dropout); --model defaults to the base model its "
                         "adapter_config.json names", group="lora")
    # ---- data
    train_data: str = opt("builtin:demo", ".jsonl/.csv/.tsv file, STS-B TSV, Hugging Face dataset (hub name or "
                          "save_to_disk folder), or builtin:demo ((query, positive) pairs) / builtin:demo-sts (scored "
                          "pairs)", group="data")
    train_split: str = opt("train", "split of a Hugging Face training dataset", group="data")
    data_format: str = opt(None, "A (text1,text2,label), B (query,positive), C (query,positive,negative); "
                           "default: detected from the columns", group="data", choices=["A", "B", "C"])
    columns: list = opt([],  # noqa: RUF009 (opt() builds a default_factory for lists)
                        "the columns of a JSONL/CSV/TSV file or Hugging Face dataset to read under the format's names "
                        "(text1, text2, label, query, positive, negative), e.g. text1=sent_a text2=sent_b "
                        "label=similarity; for --train-data and a --dev-data read by column names", group="data",
                        metavar="NAME=COLUMN")
    dev_data: str = opt(None, "dev set picking the best model: scored pairs (STS-style, format A) by Spearman, or "
                        "(query, positive) pairs (formats B/C) by nDCG@10 of retrieving each query's positives "
                        "among every distinct dev positive (recall@1 and @10 logged too)", group="data")
    dev_split: str = opt("validation", "split of a Hugging Face dev dataset", group="data")
    dev_columns: list = opt([],  # noqa: RUF009 (opt() builds a default_factory for lists)
                            "the columns of --dev-data, mapped as --columns maps the training data's (default: "
                            "--columns), e.g. text1=sentence1 text2=sentence2 label=score for STS-B's CSV beside a "
                            "training file of other names", group="data", metavar="NAME=COLUMN")
    bucket: int = opt(0, "length bucketing: sort runs of BUCKET batches by length (0 = off)", group="data",
                      at_least=0)
    # ---- batch and optimisation
    batch_size: int = opt(32, "pairs per loss computation, summed over all GPUs: the in-batch negatives",
                          group="optimisation", at_least=1)
    grad_accum: int = opt(1, "loss computations per optimizer step (each sees only its own batch_size pairs)",
                          group="optimisation", at_least=1)
    chunk_size: int = opt(0, "gradient cache: texts per forward pass (0 = plain backprop of the whole batch); "
                          "memory then grows with chunk_size, not batch_size", group="optimisation", at_least=0)
    chunk_tokens: int = opt(0, "gradient cache with a token budget per forward pass instead of --chunk-size: as many "
                            "texts as fit in N tokens, padding included (0 = off)", group="optimisation", at_least=0)
    sort_passes: bool = opt(True, "cut the gradient cache's passes from the batch's texts sorted by length (less "
                            "padding; the loss and its gradient are the same, dropout masks fall differently)",
                            group="optimisation")
    pass_tokens: int = opt(None, "plain backprop: forward the batch in length-sorted sub-batches of at most N tokens, "
                           "padding included, all kept for one backward (0 = one pass; default: 512 on CPU when its "
                           "passes are not packed (--pack 0), where it measured 1.3x faster at 16 pairs and 2.3x at 64 "
                           "on STS-B, one pass on GPU)",
                           group="optimisation", at_least=0)
    pack: int = opt(None, "pack each forward pass's texts into rows of N tokens, several texts per row and no "
                    "padding between them (a block-diagonal attention mask keeps them apart, positions restart per "
                    "text; the embeddings are those of a padded pass). Plain backprop then forwards the batch in one "
                    "packed pass, and --chunk-tokens counts real tokens. 0 = off; default: 128 on CPU, where it "
                    "measured 1.2-1.65x faster than sorted padded passes on STS-B, for models that take it (sdpa or "
                    "eager attention, checked at start-up), off on GPU",
                    group="optimisation", at_least=0)
    epochs: float = opt(None, f"passes over the training data (default: {DEFAULT_EPOCHS:g}; with --max-steps, "
                        "which sets the run's length, none)", group="optimisation", above=0)
    max_steps: int = opt(0, "stop after this many optimizer steps (0 = use epochs; given, it overrides --epochs)",
                         group="optimisation", at_least=0)
    lr: float = opt(2e-5, "peak learning rate (AdamW)", group="optimisation", above=0)
    weight_decay: float = opt(0.01, "AdamW weight decay (matrices only, not biases or norms)", group="optimisation",
                              at_least=0)
    warmup: float = opt(0.1, "warmup: a fraction of the steps if < 1 (rounded up, as Hugging Face's Trainer "
                        "rounds it: 0.1 of 5 steps is 1), else a number of steps",
                        group="optimisation", at_least=0)
    schedule: str = opt("linear", "learning-rate decay after warmup", group="optimisation",
                        choices=["linear", "cosine", "constant"])
    max_grad_norm: float = opt(1.0, "clip the gradient norm (0 = off)", group="optimisation", at_least=0)
    max_bad_steps: int = opt(5, "a step with a non-finite loss or gradient norm is skipped (no update, the schedule "
                             "waits); stop after this many in a row (0 = never stop)", group="optimisation", at_least=0)
    fsdp: bool = opt(False, "full fine-tuning with weights, gradients and AdamW state sharded over the processes "
                     "(PyTorch FSDP2), for models DDP cannot hold; launch with torchrun (2+ processes); not with "
                     "--lora (LoRA + DDP is the way for adapters)", group="optimisation")
    auto_chunk: bool = opt(False, "on out-of-memory, halve --chunk-tokens or --chunk-size (from plain backprop: half "
                           "the batch's texts) and retry the step (one process only). GPUs report every failed "
                           "allocation; on the CPU it works where the allocator refuses one, while Linux's "
                           "out-of-memory killer may end the process first", group="optimisation")
    seed: int = opt(42, "random seed (data order, dropout, LoRA init)", group="optimisation",
                    at_least=0, at_most=MAX_SEED)
    # ---- loss: angle_kernels.AngleLoss's weights and temperatures (defaults are angle-emb 0.6.1's)
    objective: str = opt("angle", "angle: AngleLoss on pairs (formats A/B/C); arccse: ArcCSE's unsupervised objective "
                         "from raw sentences (--train-data: .txt, one per line, or a --text-column): two dropout views "
                         "(ArcCon) and a triplet of the sentence and two masked copies", group="loss",
                         choices=["angle", "arccse"])
    arccon_margin: float = opt(10.0, "arccse: ArcCon's additive angular margin, in degrees", group="loss")
    arccon_tau: float = opt(0.05, "arccse: ArcCon's temperature", group="loss")
    triplet_w: float = opt(0.1, "arccse: lambda, the triplet loss's weight", group="loss", at_least=0)
    mask_rates: list = opt([0.2, 0.4],  # noqa: RUF009 (opt() builds a default_factory for lists)
                           "arccse: the fractions of a sentence's tokens masked (one contiguous span) in its weakly "
                           "and strongly masked copies, 0 < weak <= strong < 1 (a weak copy unmasked would make the "
                           "triplet term 0)", group="loss", metavar="RATE", items="number")
    text_column: str = opt(TEXT_COLUMN, "arccse: the column of a JSONL/CSV file or dataset holding the sentences",
                           group="data")
    cosine_w: float = opt(0.0, "weight of the cosine (CoSENT) ranking term", group="loss", at_least=0)
    ibn_w: float = opt(1.0, "weight of the in-batch-negative term (labels must be 0/1 in format A)", group="loss",
                       at_least=0)
    cln_w: float = opt(1.0, "weight of the hard-negative term (format C)", group="loss", at_least=0)
    angle_w: float = opt(0.02, "weight of the angle ranking term", group="loss", at_least=0)
    cosine_tau: float = opt(20.0, "scale of the cosine term", group="loss", above=0)
    ibn_tau: float = opt(20.0, "scale of the contrastive terms", group="loss", above=0)
    angle_tau: float = opt(20.0, "scale of the angle term", group="loss", above=0)
    ibn_partition: str = opt("angle", "in-batch-negative softmax: angle (AnglE's terms) or gte (GTE's joint partition: "
                             "query->documents, query->queries, document->queries, document->documents in one "
                             "softmax per pair)", group="loss", choices=["angle", "gte"])
    false_negative_margin: float = opt(None, "false-negative filter (default: off): an in-batch or hard negative "
                                       "scoring above the pair's positive cosine minus this margin leaves the "
                                       "in-batch-negative terms", group="loss")
    false_negative_strategy: str = opt("absolute", "the filter's threshold: absolute (cos_pos - margin) or relative "
                                       "(cos_pos - |cos_pos| * margin)", group="loss", choices=["absolute", "relative"])
    matryoshka_dims: list = opt([],  # noqa: RUF009 (opt() builds a default_factory for lists)
                                "Matryoshka training (default: off): prefix widths, e.g. 768 512 256 128 64 (or "
                                "768,512,...); every loss term on every prefix embeddings[:, :d], weighted and summed "
                                "(even widths while --angle-w > 0). Dev Spearman is then reported at each width too",
                                group="loss", metavar="DIM", items="number")
    matryoshka_weights: list = opt([],  # noqa: RUF009
                                   "weight of each --matryoshka-dims width, in the same order (default: 1 each)",
                                   group="loss", metavar="WEIGHT", items="number")
    espresso: bool = opt(False, "Espresso (ESE) layer-wise training, as angle-emb's AngleESETrainer weighs it: the "
                         "loss of the last layer at the full and the --espresso-dim width, plus every earlier "
                         "hidden state's (pooled) at the --espresso-dim width weighted 1 / (1 + ln(1 + i)), averaged; "
                         "one fused loss call for all layers (not with --matryoshka-dims)", group="loss")
    espresso_dim: int = opt(128, "the compressed width of --espresso", group="loss", at_least=1)
    # ---- evaluation, checkpoints, logging
    output_dir: str = opt("runs/angle", "where checkpoints, metrics.jsonl, best/ and final/ go", group="run")
    eval_every: int = opt(0, "evaluate on dev_data every N optimizer steps (0 = only at the end)", group="run",
                          at_least=0)
    eval_on_start: bool = opt(True, "with --dev-data, evaluate the model before the first step too (step 0): the "
                              "score training has to beat", group="run")
    eval_batch_size: int = opt(128, "texts per forward pass during evaluation", group="run", at_least=1)
    save_every: int = opt(0, "write a resumable checkpoint every N optimizer steps (0 = never)", group="run",
                          at_least=0)
    keep_checkpoints: int = opt(2, "how many resumable checkpoints to keep (0 = all), besides the last good one (the "
                                "newest a finite step was taken from)", group="run", at_least=0)
    save_best: bool = opt(True, "keep the model with the best dev score (Spearman, or nDCG@10 for (query, positive) "
                          "pairs) in output_dir/best", group="run")
    save_final: bool = opt(True, "export the final model to output_dir/final", group="run")
    export_max_length: int = opt(None, "the maximum length best/ and final/ record for inference (sentence-"
                                 "transformers' max_seq_length, angle-eval's default); default: the base model's "
                                 "max_seq_length when its folder has one, else --max-length", group="run",
                                 at_least=1)
    resume: str = opt(None, "a checkpoint folder to resume from, or 'auto' (the latest in output_dir); output_dir's "
                      "checkpoints of later steps are moved to output_dir/set-aside/", group="run")
    overwrite: bool = opt(False, "start afresh (or resume another output_dir's checkpoint) in an output_dir that "
                          "holds an earlier run (its checkpoints, best/, final/ or logged steps), deleting what that "
                          "run wrote; without it such a start is refused", group="run")
    log_every: int = opt(10, "write metrics every N optimizer steps (and after the last)", group="run", at_least=1)
    report_to: list = opt(["none"],  # noqa: RUF009 (opt() builds a default_factory for lists)
                          "where the metrics go besides OUTPUT_DIR/metrics.jsonl (always written): none, tensorboard, "
                          "wandb (offline without credentials), or all; optional packages: pip install "
                          "angle_kernels[tracking]", group="run", metavar="NAME", choices=["none", "all",
                                                                                          "tensorboard", "wandb"])
    progress: bool = opt(True, "show progress bars: training's, the dev evaluation's where stderr is a terminal, and "
                         "transformers' own as weights load and save (0: none of them)", group="run")
    profile: bool = opt(False, "time the phases of the run's second optimizer step (data, encoder forward, all-gather, "
                        "loss, encoder backward, optimizer), print them and write output_dir/profile.json",
                        group="run")
    device: str = opt(None, "cpu, cuda, cuda:1... (default: cuda if available); under torchrun cuda: each "
                             "process takes the GPU of its LOCAL_RANK", group="run")
    ddp_timeout: int = opt(1800, "under torchrun: seconds a process waits for the others at a collective before the "
                           "job stops with an error (the Hugging Face Trainer's ddp_timeout; torch's own is 10 minutes "
                           "with NCCL). The main process exports best/ and final/ and writes whole-model checkpoints "
                           "while the others wait: raise it where those take longer", group="run",
                           at_least=1)

    def __new__(cls, *args, **kwargs):
        """An unknown keyword is refused here, before the dataclass's __init__ (whose TypeError names it alone), with
        the setting it is closest to: TrainConfig(batch_sise=8) says `did you mean batch_size?`, as --config does."""
        settings = [f.name for f in fields(cls) if f.init]
        unknown = [name for name in kwargs if name not in settings]
        if unknown:
            raise TypeError(f"{cls.__name__}() got unknown setting{'s' * (len(unknown) > 1)} "
                            f"{', '.join(map(repr, unknown))}" + did_you_mean(unknown, settings))
        return super().__new__(cls)

    def validate(self) -> TrainConfig:
        """Refuse settings that cannot work, naming the flag, before anything is loaded. What depends on the data
        or the model is checked once they are read (trainer.setup)."""
        given_lora = self._take_lora_defaults()
        self._take_epochs()
        self._validate_kinds()
        self._validate_ranges()
        # peft's alpha is any positive number: a whole one kept an int, read as written (32, not 32.0) in config.json,
        # the model card and the adapter_config.json peft writes
        self.lora_alpha = whole_as_int(self.lora_alpha)
        for name in ("cosine_tau", "ibn_tau", "angle_tau"):  # AngleLoss's own rule (its bound too), the flag named
            try:
                check_scale(name, getattr(self, name))
            except ValueError as exc:
                raise ValueError(f"{flag_of(name)}: {exc}") from None
        if self.bf16 and self.fp16:
            raise ValueError("choose at most one of --bf16 and --fp16")
        if self.chunk_size and self.chunk_tokens:
            raise ValueError("choose at most one of --chunk-size (texts per pass) and --chunk-tokens (tokens per pass)")
        if self.pass_tokens and (self.chunk_size or self.chunk_tokens):  # only when given: None is the default
            raise ValueError("--pass-tokens cuts plain backprop's forward; with the gradient cache (--chunk-size or "
                             "--chunk-tokens) the chunks are the passes: leave out --pass-tokens")
        if self.pass_tokens and self.pack:
            raise ValueError("--pass-tokens cuts plain backprop's forward into padded sub-batches; --pack packs it "
                             "into rows with no padding: choose one")
        if self.attention in SIXTEEN_BIT_ATTENTION and not (self.bf16 or self.fp16
                                                            or self.model_dtype in ("bfloat16", "float16")):
            raise ValueError(f"--attention {self.attention} computes in float16 or bfloat16, and this run computes in "
                             f"{self.model_dtype}: add --bf16 1 (or --fp16 1), or load the weights in 16 bits "
                             "(--model-dtype bfloat16)")
        if self.pack and self.attention not in (None, *PACKING_ATTENTION):
            raise ValueError(f"--pack {self.pack}: packed rows take {' or '.join(PACKING_ATTENTION)} attention (a 4D "
                             f"mask), and --attention is {self.attention}: use --pack 0")
        self._validate_matryoshka()
        if self.espresso and self.matryoshka_dims:
            raise ValueError("--espresso trains its own two widths (--espresso-dim and the full one): leave out "
                             "--matryoshka-dims")
        if self.fsdp and self.lora:
            raise ValueError("--fsdp shards a full fine-tuning; with --lora the adapters are small: use DDP (leave "
                             "out --fsdp)")
        self._validate_arccse()
        self._split_lora_targets()
        self._refuse_ignored_settings()
        self._take_adapter_settings(given=given_lora)
        self.column_map()
        self.dev_column_map()
        return self

    def _validate_kinds(self) -> None:
        """Every setting of its field's kind (setting_value) and, where the field lists them, one of its choices, and
        the names of files, folders and models not empty. The parser converts and checks a flag's words, and cli a
        --config file's settings; a TrainConfig made in Python is checked here: schedule="Cosine" trained the linear
        schedule, objective="ArcCSE" AnglE's objective and bf16="no" turned the autocast on, in silence."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            flag = flag_of(f.name)
            try:
                value = checked_setting(f, value)
            except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
                raise ValueError(f"{flag}: {exc}") from None
            if f.name in NAMES and not value.strip():
                # an unset shell variable after the flag: "" started a fresh run for --resume, ran without
                # evaluation for --dev-data, and failed inside datasets or the Hub's id check for the others
                raise ValueError(f"{flag} must name {NAMES[f.name]}; got an empty text")
            setattr(self, f.name, value)

    def _validate_ranges(self) -> None:
        """Every number against the bounds its field declares (opt(..., at_least=, above=, below=, at_most=)): a
        float must be finite, a NaN or an infinity is never a setting."""
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or not {"at_least", "above", "below", "at_most"} & f.metadata.keys():
                continue
            flag = flag_of(f.name)
            kind = int if str(f.type) == "int" else float
            value = _number(flag, value, kind)
            if kind is float and not math.isfinite(value):
                raise ValueError(f"{flag} must be a finite number; got {value}")
            if not _within(value, f.metadata):
                raise ValueError(f"{flag} must be {_range_text(f.metadata)}; got {value}")
            setattr(self, f.name, value)
        if self.false_negative_margin is not None:
            self.false_negative_margin = _number("--false-negative-margin", self.false_negative_margin, float)
            if not math.isfinite(self.false_negative_margin):
                raise ValueError(f"--false-negative-margin must be a finite number; got {self.false_negative_margin}")

    def check_paths(self, *, model: bool = True, train_data: bool = True, dev_data: bool = True) -> None:
        """A --model, --train-data, --dev-data or --resume that can only mean a local path and does not exist is
        refused here, before anything is loaded (data.refuse_missing_local_path). The keywords leave out what train()
        was given as objects instead."""
        named = [("--model", self.model if model else None), ("--train-data", self.train_data if train_data else None),
                 ("--dev-data", self.dev_data if dev_data else None),
                 ("--resume", None if self.resume == "auto" else self.resume)]
        for flag, name in named:
            refuse_missing_local_path(name, flag)

    def resolve_passes(self, device_type: str, packing_works: bool = True) -> None:
        """Set the defaults of --pack and --pass-tokens for the device (the values the run uses and config.json
        records): packed rows where they measured faster and the model takes them (`packing_works`), else
        plain backprop's padded sub-batches on CPU."""
        if self.pack is None:  # not with --pass-tokens given: padded sub-batches asked for
            self.pack = CPU_PACK_WIDTH if device_type == "cpu" and packing_works and not self.pass_tokens else 0
        if self.pass_tokens is None:
            grad_cache = bool(self.chunk_size or self.chunk_tokens)
            self.pass_tokens = CPU_PASS_TOKENS if device_type == "cpu" and not grad_cache and not self.pack else 0

    def changed(self, name: str) -> bool:
        """Whether the setting `name` differs from its default (given by a flag, a --config file or train())."""
        return getattr(self, name) != default_of(name)

    def _split_lora_targets(self) -> None:
        """--lora-targets q_proj,v_proj (angle-emb's form) as q_proj v_proj: a layer's name has no comma (peft takes
        a list of names as the layers' names, never as patterns), so a comma can only separate two of them. A name
        given twice is one layer, kept once: compared with a --lora-path adapter's layers, the same layers are the
        same setting."""
        names = [name for item in self.lora_targets for name in item.split(",")]
        if any(not name.strip() for name in names):
            raise ValueError(f"--lora-targets {' '.join(self.lora_targets)}: an empty layer name; expected names "
                             "separated by spaces or commas (q_proj v_proj, or q_proj,v_proj)")
        self.lora_targets = list(dict.fromkeys(name.strip() for name in names))

    def _take_lora_defaults(self) -> set[str]:
        """The LoRA settings of LORA_DEFAULTS given (not None), returned; those not given set to their defaults, which
        an adapter's values replace (_take_adapter_settings). A validated config's are all given: validating it again
        compares them with the adapter's, which they are."""
        given = self.given_lora_settings()
        for name in LORA_DEFAULTS.keys() - given:
            setattr(self, name, LORA_DEFAULTS[name])
        return given

    def given_lora_settings(self) -> set[str]:
        """The LoRA settings of LORA_DEFAULTS given (not None): before validate() sets the others to their defaults."""
        return {name for name in LORA_DEFAULTS if getattr(self, name) is not None}

    def _take_epochs(self) -> None:
        """--epochs not given (None): DEFAULT_EPOCHS where they set the run's length; with --max-steps, which sets it,
        None still, so that a given --epochs, its default value too, is known as given (trainer.max_steps_note) in
        this run, config.json and a resume of it."""
        if self.epochs is None and not self.max_steps:
            self.epochs = DEFAULT_EPOCHS

    def _take_adapter_settings(self, *, given: set[str]) -> None:
        """--lora-path: the adapter's LoRA settings (rank, alpha, rsLoRA scaling, dropout, layers: those of the weights
        the run starts from) are the run's, recorded as if given (config.json, the checkpoints, the model card's
        command); a --lora-r, --lora-alpha, --lora-rslora or --lora-targets given with another value is refused,
        naming it, its default value as any other (`given`: the LORA_DEFAULTS settings given, _take_lora_defaults). A
        given --lora-dropout, which is no part of the weights (peft applies it to the adapter's input in training),
        replaces the adapter's. Without --model the base model is the one the adapter's adapter_config.json names
        (models.adapter_config_base), at the revision it records (unless --revision). The adapter's weights fitting
        the model is checked once it loads (models.attach_adapter)."""
        if not self.lora_path:
            return
        named = f"--lora-path {self.lora_path}"
        path = os.path.join(self.lora_path, ADAPTER_CONFIG)
        if not os.path.isfile(path):
            inner = os.path.join(self.lora_path, ADAPTER_FOLDER)
            if os.path.isfile(os.path.join(inner, ADAPTER_CONFIG)):  # a whole-model LoRA export (a run's final/)
                raise FileNotFoundError(f"{named}: no {ADAPTER_CONFIG} there: the folder is a whole-model export, "
                                        f"its adapter is in {inner}: give --lora-path {inner}")
            missing = f"no {ADAPTER_CONFIG} there" if os.path.isdir(self.lora_path) else "no such folder"
            raise FileNotFoundError(f"{named}: {missing}; expected a local folder of a LoRA adapter "
                                    "(peft's files: a run's final/adapter or adapter-only best/, an adapter angle-emb "
                                    "trained; one on the Hub is read once downloaded to a folder)")
        adapter = read_adapter_config(self.lora_path, label="--lora-path ")
        if adapter.get("peft_type") != "LORA":
            raise ValueError(f"{named}: a {adapter.get('peft_type')} adapter (its {ADAPTER_CONFIG}'s peft_type); "
                             "expected a LoRA one")
        for name, value in adapter_lora_settings(adapter).items():
            setting = getattr(self, name)
            if not (name in given if name in LORA_DEFAULTS else setting):  # not given: the adapter's
                setattr(self, name, value)
                continue
            if name == "lora_dropout":
                continue  # no part of the weights: a given one replaces the adapter's (trainer.adapter_dropout_note)
            if (sorted(setting) if name == "lora_targets" else setting) != value:
                raise ValueError(f"{flag_of(name)} {' '.join(flag_words(name, setting)[1:])}: the adapter of {named} "
                                 f"has {shlex.join(flag_words(name, value))}, and the run continues training it "
                                 f"with its own settings: leave out {flag_of(name)}")
            setattr(self, name, value)
        if not self.changed("model"):
            self.model = adapter_config_base(self.lora_path, label="--lora-path ", flag="--model")
            if self.revision is None:  # the base at the revision the adapter records (peft's), as peft loads it
                self.revision = adapter.get("revision")
        # recorded by its absolute path, which names the adapter from any working folder (config.json, the checkpoints,
        # the model card's command); a resume compares the adapter's contents (checkpoint.base_model_record)
        self.lora_path = os.path.abspath(self.lora_path)

    def _refuse_ignored_settings(self) -> None:
        """Settings that apply only with another one, refused where that one is off: silently ignored, they would
        leave the user believing a run trained as they asked."""
        if not self.lora:
            for name in LORA_SETTINGS:
                if self.changed(name):
                    raise ValueError(f"{flag_of(name)} sets up LoRA adapters, which train only with --lora 1: add "
                                     "--lora 1, or leave it out")
        if self.objective != "arccse":
            for name in ARCCSE_SETTINGS:
                if self.changed(name):
                    raise ValueError(f"{flag_of(name)} is a setting of --objective arccse, and this run trains "
                                     f"--objective {self.objective}: add --objective arccse, or leave it out")
        if self.warmup >= 1 and self.warmup != int(self.warmup):
            raise ValueError(f"--warmup {self.warmup:g}: a warmup of 1 or more is a number of steps, a whole one; a "
                             "fraction of the steps is below 1")
        half = {"float16": "--fp16", "bfloat16": "--bf16"}.get(self.model_dtype)
        autocast = "--bf16" if self.bf16 else "--fp16" if self.fp16 else None
        if half and autocast and (autocast != half or self.fp16):
            raise ValueError(f"--model-dtype {self.model_dtype} with {autocast}: "
                             + (FP16_WEIGHTS_CANNOT_UNSCALE if self.fp16 and half == "--fp16" else
                                "the weights are one 16-bit type and the autocast the other")
                             + f"; keep float32 weights (--model-dtype float32) with {autocast}, or leave out "
                             f"{autocast}")
        if self.changed("espresso_dim") and not self.espresso:
            raise ValueError("--espresso-dim is the compressed width of --espresso, which this run does not train: add "
                             "--espresso 1, or leave it out")
        if self.changed("false_negative_strategy") and self.false_negative_margin is None:
            raise ValueError("--false-negative-strategy sets the threshold of the false-negative filter, which is off "
                             "without --false-negative-margin: add a margin, or leave it out")

    def command_line(self) -> str:
        """The angle-train command that makes these settings: the flags of those that differ from the defaults (the
        model card's record of a run, however it was started: flags, a --config file or train() from Python); the
        model and the training data always, and with --lora-path the LoRA settings the run took (the adapter's, or a
        given --lora-dropout, which a default left out would not give: the adapter's would replace it)."""
        words = ["angle-train"]
        always = ("model", "train_data", *(LORA_DEFAULTS if self.lora_path else ()),
                  *(("epochs",) if self.max_steps else ()))  # given with --max-steps, its default too
        for f in fields(self):
            value = getattr(self, f.name)
            if (not self.changed(f.name) and f.name not in always) or value is None:
                continue
            words += flag_words(f.name, value)
        return shlex.join(words)

    def column_map(self) -> dict[str, str]:
        """--columns as {name: the file's column} (data.parse_columns)."""
        mapping = parse_columns(self.columns)
        if mapping and self.objective == "arccse":
            raise ValueError("--columns maps pairs' columns; --objective arccse reads one column: use --text-column")
        return mapping

    def dev_column_map(self) -> dict[str, str]:
        """--dev-columns as {name: the dev file's column}, or --columns's mapping where it is not given."""
        if not self.dev_columns:
            return self.column_map()
        if not self.dev_data:
            raise ValueError("--dev-columns maps the columns of --dev-data: give --dev-data, or leave it out")
        try:
            return parse_columns(self.dev_columns)
        except ValueError as exc:
            raise for_dev_columns(exc) from None

    def prompts(self) -> Prompts:
        """The prompt of each role of a text (data.Prompts), from --prompt, --query-prompt and --doc-prompt."""
        return prompts_of(vars(self))

    def _validate_arccse(self) -> None:
        if not isinstance(self.mask_rates, (list, tuple)):
            raise ValueError(f"--mask-rates: expected two numbers; got {self.mask_rates!r}")
        rates = [_number("--mask-rates", value, float, listed=True) for value in self.mask_rates]
        if len(rates) != 2 or not 0 <= rates[0] <= rates[1] < 1:
            raise ValueError(f"--mask-rates: expected two fractions 0 <= weak <= strong < 1; got {rates}")
        if self.objective == "arccse" and rates[0] == 0 and self.triplet_w > 0:
            # the weak copy is then the anchor's tokens, embedded alike (dropout off): cos(anchor, weak) is 1, and
            # max(0, cos(anchor, strong) - 1 + margin 0) is 0 at every step, for the price of three embedded blocks
            raise ValueError(f"--mask-rates {rates[0]:g} {rates[1]:g}: a weak rate of 0 leaves the weak copy unmasked, "
                             "the sentence itself, so the triplet term max(0, cos(anchor, strong) - cos(anchor, weak)) "
                             "is 0 and trains nothing while its three copies are still embedded; expected a weak rate "
                             "above 0 (the default is 0.2 0.4), or --triplet-w 0 for ArcCon alone (no copy embedded)")
        self.mask_rates = rates
        try:  # ArcCSELoss's own rules, with the flags named
            check_arccon_options(self.arccon_margin, self.arccon_tau)
        except ValueError as exc:
            raise ValueError(f"--arccon-margin / --arccon-tau: {exc}") from None
        if self.objective == "arccse" and (self.espresso or self.data_format):
            raise ValueError("--objective arccse trains from raw sentences: leave out --espresso and --data-format")
        if self.objective == "arccse" and self.batch_size < 2:  # as formats A and B (trainer.check_format_settings)
            raise ValueError("--batch-size 1 with --objective arccse: ArcCon compares each sentence's two views with "
                             "the other sentences of its batch (its negatives), so one sentence gives it a loss of 0 "
                             "and trains nothing; use --batch-size 2 or more")

    def trained_widths(self, width: int) -> list[int]:
        """The widths the run trains the embeddings (of `width` features) at: --matryoshka-dims, Espresso's
        compressed and full widths, or none besides the full one ([]): evaluated and exported as truncatable."""
        if self.espresso:
            return sorted({min(self.espresso_dim, width), width})
        return list(self.matryoshka_dims)

    def truncated_widths(self, width: int) -> list[int]:
        """The trained widths narrower than the embeddings' `width`, largest first: the prefixes the dev evaluation
        scores as KEY@d and the model card offers (the full width is no truncation of itself)."""
        return sorted((d for d in self.trained_widths(width) if d < width), reverse=True)

    def _validate_matryoshka(self) -> None:
        """Turn the flags' words (the CLI passes list items as strings) into ints and floats, or say which is wrong.
        The bound by the model's embedding width is checked once the model is loaded (trainer.setup)."""
        for flag, values in (("--matryoshka-dims", self.matryoshka_dims),
                             ("--matryoshka-weights", self.matryoshka_weights)):
            if not isinstance(values, (list, tuple)):  # a string would be read one character at a time
                raise ValueError(f"{flag}: expected a list of numbers; got {values!r}")
        dims = [_number("--matryoshka-dims", value, int, listed=True) for value in self.matryoshka_dims]
        weights = [_number("--matryoshka-weights", value, float, listed=True) for value in self.matryoshka_weights]
        if weights and not dims:
            raise ValueError("--matryoshka-weights needs --matryoshka-dims (the widths they weight)")
        if any(d < 1 for d in dims):
            raise ValueError(f"--matryoshka-dims must be positive widths; got {dims}")
        if len(set(dims)) != len(dims):
            raise ValueError(f"--matryoshka-dims must be distinct; got {dims}")
        if weights and len(weights) != len(dims):
            raise ValueError(f"--matryoshka-weights needs one weight per --matryoshka-dims width: {len(dims)} widths, "
                             f"{len(weights)} weights")
        if any(not math.isfinite(w) or w <= 0 for w in weights):
            raise ValueError(f"--matryoshka-weights must be finite and > 0 (leave a width out to not train it); "
                             f"got {weights}")
        self.matryoshka_dims, self.matryoshka_weights = dims, weights


# The settings that name a file, folder, model, dataset split, column or device, with what: never empty
# (TrainConfig._validate_kinds)
NAMES = {"model": "a model (a Hugging Face hub name or a local folder)", "train_data": "a file, folder or dataset",
         "dev_data": "a file, folder or dataset", "resume": "a checkpoint folder or 'auto'",
         "output_dir": "a folder", "train_split": "a dataset split", "dev_split": "a dataset split",
         "text_column": "a column", "device": "a device (cpu, cuda, cuda:1...)",
         "lora_path": "a LoRA adapter's folder", "revision": "a branch, a tag or a commit of --model's repository"}
# The setting that gives the prompt of each role of a text (data.Prompts' roles)
PROMPT_SETTINGS = {"text": "prompt", "query": "query_prompt", "document": "doc_prompt"}
# The settings that apply only with --lora 1, and only with --objective arccse (TrainConfig._refuse_ignored_settings)
LORA_SETTINGS = ("lora_r", "lora_alpha", "lora_rslora", "lora_dropout", "lora_targets", "lora_path")
ARCCSE_SETTINGS = ("text_column", "mask_rates", "arccon_margin", "arccon_tau", "triplet_w")


def prompts_of(settings: dict) -> Prompts:
    """The prompts (data.Prompts) of a run's settings, TrainConfig's fields as a dict (or as a checkpoint records
    them; one without a setting of PROMPT_SETTINGS, recorded before it existed, counts as None there)."""
    return Prompts(**{role: settings.get(name) for role, name in PROMPT_SETTINGS.items()})


def prompt_flags(prompts: Prompts) -> str:
    """The flags that give a run these prompts (prompts_of's inverse), as a shell reads them: each role's own."""
    return shlex.join(word for role, name in PROMPT_SETTINGS.items() if getattr(prompts, role) is not None
                      for word in flag_words(name, getattr(prompts, role)))


def default_of(name: str):
    """The default of the TrainConfig setting `name`: the value a run takes without it (a LoRA setting's
    LORA_DEFAULTS value, DEFAULT_EPOCHS: which their fields' None stands for)."""
    if name in LORA_DEFAULTS:
        return LORA_DEFAULTS[name]
    if name == "epochs":
        return DEFAULT_EPOCHS
    f = next(f for f in fields(TrainConfig) if f.name == name)
    return f.default_factory() if f.default is MISSING else f.default


def flag_of(name: str) -> str:
    """The command-line flag of the setting `name` ("lora_r" -> "--lora-r")."""
    return "--" + name.replace("_", "-")


def setting_kind(f) -> str:
    """A TrainConfig field's type as one word: bool, int, float, list or str (annotations are strings here)."""
    return str(f.type).split("|")[0].strip()


def setting_value(value, kind: str, items: str | None):
    """A setting's value for a field of `kind` given in a --config file or to TrainConfig in Python, taken as the flag
    takes its words: a bool from a boolean or one of the flags' words (1/0, true/false, yes/no, on/off); an int from
    a whole number or its text (a fraction or a boolean is refused, as `--seed 1.5` and `--seed true` are); a float
    from a number or its text (not a boolean); a text from a text (YAML reads `prompt: 5` or `device: no` as other
    types); a list from a list or tuple, or from one value, as the flag's one word, each item a number or a text for
    the number lists (`items: "number"`), a text for the others."""
    if kind == "bool":
        return parse_bool(value)
    if kind in ("int", "float"):
        convert = int if kind == "int" else float
        whole = isinstance(value, numbers.Integral) or (isinstance(value, str) and kind == "int")
        if _is_bool(value) or not (whole or (kind == "float" and isinstance(value, (numbers.Real, str)))):
            raise ValueError(f"invalid {kind} value: {value!r}")
        try:
            return convert(value)
        except ValueError:
            raise ValueError(f"invalid {kind} value: {value!r}") from None
    if kind == "list":
        values = list(value) if isinstance(value, (list, tuple)) else [value]
        allowed = (numbers.Real, str) if items == "number" else (str,)
        for item in values:
            if _is_bool(item) or not isinstance(item, allowed):
                raise TypeError(f"expected {'numbers' if items == 'number' else 'texts'} (a list, or one value); got "
                                f"{type(item).__name__} {item!r}")
        if items == "number":  # --matryoshka-dims 32,64 as --matryoshka-dims 32 64
            values = [part for item in values for part in comma_separated(item)]
        return values
    if kind == "str" and not isinstance(value, str):
        raise TypeError(f"expected a text; got {type(value).__name__} {value!r}")
    return value


def checked_setting(f, value):
    """A field's value from a --config file or from Python, taken as its flag takes its words (setting_value), and
    one of its choices where the field lists them; TypeError or ValueError otherwise, which the callers prefix with
    the setting's name (the parser checks a flag's words itself)."""
    kind = setting_kind(f)
    value = setting_value(value, kind, f.metadata.get("items"))
    choices = f.metadata.get("choices")
    for item in value if kind == "list" else [value]:
        if choices and item not in choices:
            raise ValueError(f"invalid choice {item!r} (choose from {', '.join(choices)})"
                             + choice_hint(flag_of(f.name), str(item), choices, several=kind == "list"))
    return value


def _is_bool(value) -> bool:
    """A Python or numpy boolean, which is never a number here (numpy's bool_ is no int subclass)."""
    return isinstance(value, bool) or type(value).__name__ == "bool_"


def adapter_lora_settings(adapter: dict) -> dict:
    """The LoRA settings, by TrainConfig's names, of an adapter's config (its adapter_config.json, or a peft
    LoraConfig's to_dict()): those of the weights it holds, which a run continuing it takes (--lora-path:
    TrainConfig._take_adapter_settings; a model given to train(): trainer.refuse_settings_given_model_ignores)."""
    return {"lora_r": adapter["r"], "lora_alpha": whole_as_int(adapter["lora_alpha"]),
            # peft scales by alpha / sqrt(r) where use_rslora is true, by alpha / r where it is false or absent
            # (adapters written before peft had it)
            "lora_rslora": bool(adapter.get("use_rslora", False)),
            "lora_dropout": adapter.get("lora_dropout", PEFT_LORA_DROPOUT),
            "lora_targets": adapted_layer_names(adapter["target_modules"])}


def whole_as_int(value: float) -> int | float:
    """A whole number as an int (32.0 -> 32), any other as it is (16.5): shown and written as it reads, whether it came
    as a flag's float, a config file's int or an adapter's float. From 1e16 on a float reads with its exponent (1e+16)
    and stays one: as an int it would spell out every digit of its binary value (1e300: 301 of them)."""
    return int(value) if float(value).is_integer() and abs(value) < 1e16 else value


def flag_words(name: str, value) -> list[str]:
    """The command-line words that give the setting `name` the value `value`: its flag, then a bool as 1 or 0, a
    list as its items, anything else as its text (["--lora-r", "4"])."""
    flag = flag_of(name)
    if isinstance(value, bool):
        return [flag, "1" if value else "0"]
    if isinstance(value, (list, tuple)):
        return [flag, *map(str, value)]
    return [flag, str(value)]


def for_dev_columns(exc: ValueError) -> ValueError:
    """A refusal of a column mapping, worded for --columns by the code that reads both mappings, reworded for
    --dev-columns (the mapping of --dev-data)."""
    return type(exc)(str(exc).replace("--columns", "--dev-columns"))




def _within(value, bounds: dict) -> bool:
    return (value >= bounds.get("at_least", -math.inf) and value > bounds.get("above", -math.inf)
            and value < bounds.get("below", math.inf) and value <= bounds.get("at_most", math.inf))


def _range_text(bounds: dict) -> str:
    """A field's bounds in words: ">= 0", "> 0 and < 1", "between 0 and 4294967295"."""
    if "at_least" in bounds and "at_most" in bounds:
        return f"between {bounds['at_least']} and {bounds['at_most']}"
    words = {"at_least": ">=", "above": ">", "below": "<", "at_most": "<="}
    return " and ".join(f"{sign} {bounds[key]}" for key, sign in words.items() if key in bounds)


def _number(flag: str, value, kind: type, *, listed: bool = False):
    """`value` (a CLI word, or a number from a config file) as an int or a float; bools and fractional ints are
    refused rather than silently truncated. `listed`: an item of a number list, whose refusal says how the items are
    separated where the item looks like several numbers separated otherwise (`--matryoshka-dims 32;64`)."""
    try:
        if isinstance(value, bool) or (kind is int and isinstance(value, float)):
            raise ValueError
        return kind(value)
    except (TypeError, ValueError):
        expected = "integers" if kind is int else "numbers"
        if listed and isinstance(value, str) and any(mark in value.strip() for mark in ";:/| \t"):
            expected += ", by spaces or commas (32 64, or 32,64)"
        raise ValueError(f"{flag}: expected {expected}; got {value!r}") from None
