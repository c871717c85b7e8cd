"""angle_train: a lean training loop for AnglE (and ArcCSE) embedding fine-tuning (BERT-style encoders and LLMs).

    trainer.py      train(): setup, one optimizer step, evaluate, save, finish; logging and throughput
    checkpoint.py   resumable checkpoints (atomic, code-free loading, exact resume), best/; safe_loading.py: the
                    code-free reads it shares with sharding.py; atomic_files.py: small files written aside,
                    synced and swapped in (metrics on resume, manifests, the lock taken over)
    config.py       TrainConfig: every setting, its default and its help text
    models.py       pooling (cls, cls_avg, avg, max, last) + base model = Encoder; LoRA, checkpointing, autocast,
                    bidirectional attention for decoder LMs
    data.py         files and datasets in formats A/B/C, prompts per role, tokenisation, padding, batch order
    hub.py          Hugging Face Hub names that cannot be loaded (out of reach and not cached, no such
                    repository), said naming the flag that gave them
    grad_cache.py   plain backprop and the gradient cache (dropout RNG replay)
    profiling.py    --profile: the phases of one optimizer step
    distributed.py  DDP helpers: all-gather with gradients, no_sync, barrier
    sharding.py     --fsdp: FSDP2 sharding, sharded checkpoints (torch.distributed.checkpoint), full weights
    arccse.py       --objective arccse: raw sentences, masked copies, the five-block batch and its loss
    faults.py       non-finite steps, SIGTERM/SIGINT/SIGHUP, out-of-memory advice
    evaluate.py     the `angle-eval` command: STS Spearman in the paper's setting (sts_spearman, also the
                    trainer's dev score), retrieval metrics
    export.py       Hugging Face / LoRA adapter / sentence-transformers folders
    cli.py          the `angle-train` command;  demo.py: `python -m angle_train.demo`; cli_common.py: what
                    both commands share (one-line errors, --version, booleans)
    tiny.py         built-in tiny models, tokenizer and datasets (offline demo and tests)

The loss is angle_kernels.AngleLoss. Heavy imports (transformers, peft, scipy) happen inside the functions
that need them.
"""

from .config import TrainConfig
from .data import ANGLE_PROMPT, DataError, Example, Prompts, load_examples
from .models import POOLING_STRATEGIES, pool

__all__ = [
    "ANGLE_PROMPT",
    "POOLING_STRATEGIES",
    "DataError",
    "Example",
    "Prompts",
    "TrainConfig",
    "load_encoder",
    "load_examples",
    "load_pretrained",
    "pool",
    "save_pretrained",
    "train",
]


def __getattr__(name):  # lazy: `import angle_train` stays light
    if name == "train":
        from .trainer import train
        return train
    if name == "load_encoder":
        from .models import load_encoder
        return load_encoder
    if name in ("save_pretrained", "load_pretrained"):
        from . import export
        return getattr(export, name)
    raise AttributeError(name)
