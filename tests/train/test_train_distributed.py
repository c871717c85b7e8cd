"""Two gloo processes with all-gathered embeddings = one process on the concatenated batch."""

import os
import re

import pytest
import torch
from train_helpers import (
    as_torchrun_rank, assert_ranks_match, demo_batch, free_port, graded_or_contrastive_loss, make_encoder, param_grads,
    rank_of_a_job, run_config,
)

from angle_kernels.testing.helpers import start_ranks
from angle_train.cli import config_from_args
from angle_train.data import pad_batch
from angle_train.distributed import wrap_ddp
from angle_train.grad_cache import grad_cache_step, plain_step
from angle_train.trainer import build_loss

N_PAIRS = 8  # 4 pairs per rank
# AngleLoss's in-batch-negative options, as angle-train's flags: GTE's joint partition, the false-negative filter
GTE_FILTERED = ("--ibn-partition", "gte", "--false-negative-margin", "0.1")
# Matryoshka: three widths (in no order), then their weights
MATRYOSHKA = ("--matryoshka-dims", "8", "32", "16", "--matryoshka-weights", "2", "1", "0.5")
# Espresso: the encoder's layer stacks [L, rows, D], gathered along the rows (its own loss: test_train_espresso.py)
ESPRESSO = ("--espresso", "--espresso-dim", "8")


# the single-process runs here draw no curves.png (rank processes are forked without the fixture)
pytestmark = pytest.mark.usefixtures("no_curves")


def _setup(arch, fmt, flags=()):
    """The model, the batch and the loss: for angle-train flags, the AngleLoss the trainer builds from them."""
    encoder, tokenizer = make_encoder(arch, dropout=0.0)
    batch = demo_batch(tokenizer, N_PAIRS, fmt)
    cfg = config_from_args(list(flags))
    encoder.layer_stack = cfg.espresso  # as the trainer's all_layers_out does around its steps
    loss_fn = build_loss(cfg, fmt, encoder) if flags else graded_or_contrastive_loss(fmt)
    return encoder, batch, loss_fn


def _rank_main(rank, world, port, arch, fmt, chunk_rows, flags, out_dir):
    with rank_of_a_job(rank, world, port, join=True):
        encoder, batch, loss_fn = _setup(arch, fmt, flags)
        model = wrap_ddp(encoder, torch.device("cpu"))
        rows = len(batch.seqs) // world
        seqs = batch.seqs[rank * rows:(rank + 1) * rows]
        labels = batch.labels[rank * rows:(rank + 1) * rows]
        chunks = [pad_batch(c, encoder.pad_token_id, encoder.padding_side)
                  for c in ([seqs] if chunk_rows is None else [seqs[i:i + chunk_rows]
                                                              for i in range(0, len(seqs), chunk_rows)])]
        step = plain_step if chunk_rows is None else grad_cache_step
        loss = step(model, chunks, labels, loss_fn)
        torch.save({"loss": loss, "grads": param_grads(encoder)}, os.path.join(out_dir, f"rank{rank}.pt"))


def _command_rank(rank, world, port, out_dir):
    import torch.distributed as dist

    from angle_train import cli

    as_torchrun_rank(rank, world, port)
    status = cli.main(["--model", "builtin:tiny-bert", "--train-data", "builtin:demo", "--device", "cpu",
                       "--batch-size", "8", "--max-steps", "2", "--progress", "0", "--save-final", "0",
                       "--output-dir", out_dir])
    torch.save({"status": status, "left": not dist.is_initialized()}, os.path.join(out_dir, f"command{rank}.pt"))


def _outcome_of_a_run(rank, world, port, out_dir, examples, **settings):
    """This process as rank `rank` trains on `examples` (format B) with `settings` (run_config's) and saves what came
    of it to out_dir/outcome{rank}.pt: "trained", or the error it raised as "TYPE: message"; the group is left."""
    import torch.distributed as dist

    from angle_train.trainer import train

    as_torchrun_rank(rank, world, port)
    try:
        train(run_config(out_dir, batch_size=8, max_length=12, **settings), model=make_encoder("bert"),
              train_examples=(examples, "B"))
        outcome = "trained"
    except Exception as exc:
        outcome = f"{type(exc).__name__}: {exc}"
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save(outcome, os.path.join(out_dir, f"outcome{rank}.pt"))


def _disagreeing_rank(rank, world, port, out_dir):
    from angle_train.tiny import demo_examples

    examples = demo_examples(24 if rank == 0 else 20, seed=2)  # process 1 reads another (shorter) file
    _outcome_of_a_run(rank, world, port, out_dir, examples, max_steps=2)


def _rank_with_a_full_disk(rank, world, port, out_dir):
    """Trains 2 steps, a checkpoint after each; process 1's second checkpoint file meets a full disk."""
    import errno

    from angle_train import checkpoint
    from angle_train.tiny import demo_examples

    rng_state, saves = checkpoint._rng_state, []

    def no_space_at_the_second_save():
        saves.append(1)
        if rank == 1 and len(saves) == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return rng_state()
    checkpoint._rng_state = no_space_at_the_second_save
    _outcome_of_a_run(rank, world, port, out_dir, demo_examples(24, seed=2), max_steps=2, save_every=1)


def _rank_whose_main_cannot_clear_the_folder(rank, world, port, out_dir):
    """Trains with --overwrite over an earlier run's metrics.jsonl; on process 0 the sync of the output folder after
    the earlier run's files are removed (checkpoint.remove_earlier_run, the main process's alone) fails."""
    import errno

    from angle_train import checkpoint
    from angle_train.tiny import demo_examples

    sync_folder = checkpoint.sync_folder

    def failing_for_the_output_folder(path):
        if rank == 0 and os.path.samefile(path, out_dir):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        sync_folder(path)
    checkpoint.sync_folder = failing_for_the_output_folder
    _outcome_of_a_run(rank, world, port, out_dir, demo_examples(24, seed=2), max_steps=1, overwrite=True)


def test_a_failure_of_the_main_process_alone_stops_every_process_with_its_error(tmp_path):
    """What the main process alone does before the processes meet again (here the clearing of the output folder for
    --overwrite) failed on it: it stopped with the error, and the others waited for it at the next collective until
    the connection broke (process 1: gloo's 'Connection closed by peer' traceback) or --ddp-timeout ran out (a hang:
    the timeout fails the test). Now every process stops at once, the others with the main process's error naming
    it."""
    (tmp_path / "metrics.jsonl").write_text("{}\n")  # an earlier run's, which --overwrite removes
    start_ranks(_rank_whose_main_cannot_clear_the_folder, (2, free_port(), str(tmp_path)), timeout_s=60)
    outcomes = [torch.load(tmp_path / f"outcome{rank}.pt") for rank in range(2)]
    assert outcomes == ["OSError: [Errno 5] Input/output error",
                        "OSError: [Errno 5] Input/output error on process 0"], outcomes


def test_processes_that_read_different_data_are_refused_together(tmp_path):
    """Each process reads the data (and finds its checkpoint) on its own: processes that disagree trained on
    mismatched slices and then hung where one planned fewer steps. Now every process refuses, before training."""
    start_ranks(_disagreeing_rank, (2, free_port(), str(tmp_path)))
    for rank in range(2):
        outcome = torch.load(tmp_path / f"outcome{rank}.pt")
        assert outcome.startswith("ValueError: the processes disagree"), outcome
        assert "examples: process 0 24, process 1 20" in outcome, outcome


def test_a_finished_command_leaves_the_process_group(tmp_path):
    """angle-train under torchrun leaves its process group when its run is done (a barrier, then
    destroy_process_group): left to the interpreter's exit, a gloo worker thread sometimes freed the last
    collective's tensors during shutdown and aborted a finished run (SIGABRT, torchrun's exit status 1)."""
    start_ranks(_command_rank, (2, free_port(), str(tmp_path)))
    for rank in range(2):
        assert torch.load(tmp_path / f"command{rank}.pt") == {"status": 0, "left": True}


def test_a_checkpoint_write_that_fails_on_one_process_stops_every_process_with_its_error(tmp_path):
    """A full disk on one process while the processes write a checkpoint: that process removed the partial folder
    and stopped, pulling the folder from under the others (process 0: 'RuntimeError: Parent directory ... does not
    exist'), or left them waiting at the next collective until its connection broke (a gloo traceback; under NCCL,
    --ddp-timeout). Now the processes learn of it together: every one stops with the failed write's OSError, which
    names the process and the intact previous checkpoint, and the main process removes the partial folder."""
    start_ranks(_rank_with_a_full_disk, (2, free_port(), str(tmp_path)))
    for rank in range(2):
        outcome = torch.load(tmp_path / f"outcome{rank}.pt")
        assert re.fullmatch(r"OSError: \[Errno 28\] could not write checkpoint .*step-00000002.tmp \(No space left on "
                            r"device on process 1\); the partial folder was removed and the previous checkpoint "
                            r".*step-00000001 is intact\..*", outcome), (rank, outcome)
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-00000001"]


@pytest.mark.parametrize("arch, fmt, chunk_rows, flags", [("bert", "A", None, ()), ("llama", "B", 3, ()),
                                                        ("bert", "B", 3, GTE_FILTERED), ("bert", "B", 3, MATRYOSHKA),
                                                        ("llama", "B", 3, ESPRESSO)],
                         ids=["bert-A-None", "llama-B-3", "bert-B-3-gte-filtered", "bert-B-3-matryoshka",
                              "llama-B-3-espresso"])
def test_two_process_all_gather_equals_single_process(tmp_path, arch, fmt, chunk_rows, flags):
    """chunk_rows=None: plain backprop; 3: gradient cache with no_sync on all but the last chunk. flags: the loss
    options of angle-train's command line (the default AngleLoss of the format without)."""
    start_ranks(_rank_main, (2, free_port(), arch, fmt, chunk_rows, flags, str(tmp_path)))
    encoder, batch, loss_fn = _setup(arch, fmt, flags)
    chunks = [pad_batch(batch.seqs, encoder.pad_token_id, encoder.padding_side)]
    if flags and flags != ESPRESSO:  # each option changes this batch's loss (none, then one option more at a time)
        with torch.no_grad():
            embeddings = encoder(*chunks[0])
        starts = [i for i, word in enumerate(flags) if word.startswith("--")]
        values = [float(build_loss(config_from_args(list(flags[:end])), fmt)(batch.labels, embeddings))
                  for end in [*starts, len(flags)]]
        assert all(abs(a - b) > 1e-3 for a, b in zip(values, values[1:])), values
    loss = plain_step(encoder, chunks, batch.labels, loss_fn)
    single = param_grads(encoder)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        torch.testing.assert_close(got["loss"], loss, rtol=1e-10, atol=1e-12)
        assert got["grads"].keys() == single.keys()
        for name, grad in single.items():
            # DDP averages over ranks; the all-gather's backward sums: together the global gradient
            torch.testing.assert_close(got["grads"][name], grad, rtol=1e-8, atol=1e-11, msg=name)


def _trainer_rank_main(rank, world, port, out_dir):
    from angle_train.tiny import demo_examples
    from angle_train.trainer import train

    with rank_of_a_job(rank, world, port):
        result = train(_trainer_config(out_dir), model=make_encoder("bert", dropout=0.0),
                       train_examples=(demo_examples(24, seed=2), "B"))
        torch.save({"losses": [r["loss"] for r in result.history], "weights": result.encoder.state_dict()},
                   os.path.join(out_dir, f"trainer-rank{rank}.pt"))


def _trainer_config(out_dir):
    return run_config(out_dir, batch_size=8, max_steps=3, chunk_size=3, lr=1e-3, warmup=0, save_every=3, log_every=1,
                      max_length=12, pooling="avg")


def test_two_process_training_run_equals_single_process(tmp_path):
    """The whole loop under DDP (data slicing, gradient cache, AdamW steps, checkpoint) = one process."""
    from angle_train.tiny import demo_examples
    from angle_train.trainer import train

    start_ranks(_trainer_rank_main, (2, free_port(), str(tmp_path / "ddp")))
    single = train(_trainer_config(str(tmp_path / "single")), model=make_encoder("bert", dropout=0.0),
                   train_examples=(demo_examples(24, seed=2), "B"))
    assert_ranks_match(tmp_path / "ddp", "trainer-rank{rank}.pt", single)
    checkpoint = tmp_path / "ddp" / "checkpoints" / "step-00000003"
    assert (checkpoint / "rng-rank0.pt").exists() and (checkpoint / "rng-rank1.pt").exists()


def _tokenising_rank(rank, world, port, out_dir):
    from angle_train.arccse import TokenizedSentences
    from angle_train.data import TokenizedPairs
    from angle_train.distributed import DistInfo
    from angle_train.tiny import demo_examples

    with rank_of_a_job(rank, world, port, join=True):
        _, tokenizer = make_encoder("bert")
        tokenised = []  # the texts this process's tokenizer was given
        counting = lambda texts, **options: tokenised.extend(texts) or tokenizer(texts, **options)  # noqa: E731
        counting.mask_token_id = tokenizer.mask_token_id
        processes = DistInfo(rank, world)
        examples = demo_examples(11)  # 22 texts: 8 on process 0, 7 and 7; 7 sentences: 3, 2 and 2
        pairs = TokenizedPairs(examples, "B", counting, max_length=12, processes=processes)
        pair_texts = len(tokenised)
        sentences = TokenizedSentences([ex.texts[0] for ex in examples[:7]], counting, max_length=8,
                                       mask_rates=(0.05, 0.4), seed=3, processes=processes)
        torch.save({"pairs": (pairs.rows._flat.tolist(), pairs.rows._ends.tolist(), pairs.lengths, pairs.cut),
                    "sentences": [(rows._flat.tolist(), rows._ends.tolist()) for rows in
                                  (sentences.ids, sentences.weak, sentences.strong)]
                    + [sentences.too_short, sentences.lengths, sentences.cut],
                    "tokenised": (pair_texts, len(tokenised) - pair_texts)}, os.path.join(out_dir, f"rank{rank}.pt"))


def test_each_process_tokenises_its_share_and_every_process_gets_the_whole_dataset(tmp_path):
    """Under torchrun every process tokenised every text (1M pairs: the whole tokenising time in each of a node's
    processes at once); now each tokenises its share of the texts (and ArcCSE's masked copies) and the shares are
    gathered: the same token rows, lengths and counts as one process makes, with 22 texts and 7 sentences over 3
    processes (shares that do not divide evenly)."""
    from angle_train.arccse import TokenizedSentences
    from angle_train.data import TokenizedPairs
    from angle_train.tiny import demo_examples

    start_ranks(_tokenising_rank, (3, free_port(), str(tmp_path)), nprocs=3)
    _, tokenizer = make_encoder("bert")
    examples = demo_examples(11)
    pairs = TokenizedPairs(examples, "B", tokenizer, max_length=12)
    sentences = TokenizedSentences([ex.texts[0] for ex in examples[:7]], tokenizer, max_length=8,
                                   mask_rates=(0.05, 0.4), seed=3)
    assert sentences.too_short == [7, 0]  # every sentence too short to mask at 5%: counts summed over the processes
    for rank, shares in enumerate([(8, 3), (7, 2), (7, 2)]):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["tokenised"] == shares
        assert got["pairs"] == (pairs.rows._flat.tolist(), pairs.rows._ends.tolist(), pairs.lengths, pairs.cut)
        assert got["sentences"] == [(rows._flat.tolist(), rows._ends.tolist()) for rows in
                                    (sentences.ids, sentences.weak, sentences.strong)] + [
            sentences.too_short, sentences.lengths, sentences.cut]


def _resuming_rank(rank, world, port, out_dir, stop_after, resume):
    """Trains 4 steps of 12 pairs (a checkpoint every 2), or stops after `stop_after`; saves losses and weights."""
    from angle_train.tiny import demo_examples
    from angle_train.trainer import StopTraining, train

    def on_step(step, row):
        if step == stop_after:
            raise StopTraining

    with rank_of_a_job(rank, world, port):
        cfg = run_config(out_dir, batch_size=12, max_steps=4, save_every=2, lr=1e-3, warmup=0, log_every=1,
                         max_length=12, resume="auto" if resume else None)
        result = train(cfg, model=make_encoder("bert"), train_examples=(demo_examples(48, seed=2), "B"),
                       on_step=on_step)
        tag = "resumed" if resume else "stopped" if stop_after else "whole"
        torch.save({"losses": [r["loss"] for r in result.history], "weights": result.encoder.state_dict()},
                   os.path.join(out_dir, f"{tag}-rank{rank}.pt"))


def test_three_process_resume_is_bit_identical_to_the_uninterrupted_run(tmp_path):
    """DDP sums each gradient bucket over 3 or more processes in an order that depends on the bucket layout, which
    a new wrapper lays out in parameter order and then by readiness: a run resumed from a checkpoint (a new wrapper)
    summed its first step in another order than the uninterrupted run (weights apart by 5e-16 in float64 after 6
    steps, 7e-6 in float32 after 40). Every checkpoint now starts the next step with a new wrapper."""
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    start_ranks(_resuming_rank, (3, free_port(), str(whole), 0, False), nprocs=3)
    start_ranks(_resuming_rank, (3, free_port(), str(parts), 2, False), nprocs=3)
    start_ranks(_resuming_rank, (3, free_port(), str(parts), 0, True), nprocs=3)
    want = torch.load(whole / "whole-rank0.pt")
    assert torch.load(parts / "stopped-rank0.pt")["losses"] == want["losses"][:2]
    for rank in range(3):
        got = torch.load(parts / f"resumed-rank{rank}.pt")
        assert got["losses"] == want["losses"][2:]
        assert all(torch.equal(got["weights"][name], weight) for name, weight in want["weights"].items()), rank


def test_the_process_group_waits_ddp_timeout_seconds(monkeypatch, capsys):
    """torch's default (10 minutes with NCCL) stopped a job whose main process evaluated, exported or wrote a
    whole-model checkpoint for longer while the others waited; --ddp-timeout (default 1800 s, as the Hugging Face
    Trainer's) sets the group's timeout."""
    import datetime

    import torch.distributed as dist

    from angle_train import distributed

    made = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **options: made.update(options))
    monkeypatch.setattr(dist, "get_rank", lambda: 0)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    cfg = config_from_args(["--ddp-timeout", "7200"])
    distributed.init_distributed("cpu", timeout_s=cfg.ddp_timeout)
    assert made == {"backend": "gloo", "timeout": datetime.timedelta(hours=2)}
    assert config_from_args([]).ddp_timeout == 1800
    with pytest.raises(SystemExit):
        config_from_args(["--ddp-timeout", "0"])
    assert "--ddp-timeout must be >= 1; got 0" in capsys.readouterr().err


def test_each_process_joins_with_torchruns_ranks_and_its_devices_backend(monkeypatch):
    """A single process (WORLD_SIZE 1 or unset) joins no group; under torchrun a process joins NCCL's group on CUDA
    (gloo on CPU) and takes the GPU of its LOCAL_RANK, which on a second machine is not its RANK."""
    import torch.distributed as dist

    from angle_train import distributed

    made, devices = [], []
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **options: made.append(options["backend"]))
    monkeypatch.setattr(dist, "get_rank", lambda: 5)
    monkeypatch.setattr(dist, "get_world_size", lambda: 8)
    monkeypatch.setattr(torch.cuda, "set_device", devices.append)
    for world in ("1", None):
        if world is None:
            monkeypatch.delenv("WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("WORLD_SIZE", world)
        assert distributed.init_distributed("cuda") == distributed.DistInfo() and not made
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert distributed.init_distributed("cuda") == distributed.DistInfo(rank=5, world_size=8, local_rank=1)
    assert made == ["nccl"] and devices == [1]
    assert distributed.init_distributed("cpu").local_rank == 1 and made == ["nccl", "gloo"] and devices == [1]


def test_any_process_that_disagrees_is_named(monkeypatch):
    """One process of three reading other data (the middle one here) refuses the run, naming every process's value."""
    import torch.distributed as dist

    from angle_train import distributed

    facts = [{"examples": 24, "steps": 3}, {"examples": 20, "steps": 3}, {"examples": 24, "steps": 3}]
    monkeypatch.setattr(dist, "all_gather_object", lambda gathered, mine: gathered.__setitem__(slice(None), facts))
    with pytest.raises(ValueError, match=r"the processes disagree \(examples: process 0 24, process 1 20, process 2 "
                                         r"24\)"):
        distributed.check_processes_agree(distributed.DistInfo(rank=0, world_size=3), facts[0])
    facts[1] = facts[0]
    distributed.check_processes_agree(distributed.DistInfo(rank=0, world_size=3), facts[0])


def test_gradient_accumulation_turns_the_gradient_sync_off_under_ddp_and_fsdp():
    """no_sync: DDP's no_sync() for a chunk that skips the sync, FSDP's gradient sync off for the block and on again
    after it; a no-op when the chunk syncs."""
    from angle_train.distributed import no_sync

    class DDPLike:
        def no_sync(self):
            return "ddp no_sync"

    class FSDPLike:
        def __init__(self):
            self.calls = []

        def set_requires_gradient_sync(self, value):
            self.calls.append(value)

    assert no_sync(DDPLike(), skip_sync=True) == "ddp no_sync"
    fsdp = FSDPLike()
    with no_sync(fsdp, skip_sync=False):
        assert fsdp.calls == []
    with no_sync(fsdp, skip_sync=True):
        assert fsdp.calls == [False]
    assert fsdp.calls == [False, True]


@pytest.mark.parametrize("device, local_rank, refusal", [
    ("cuda:1", 0, "--device cuda:1: under torchrun each process takes the GPU of its LOCAL_RANK"),
    ("cuda", 2, "--device cuda: process 2 of this machine (LOCAL_RANK) has no GPU; the machine has 2 visible (cuda:0 "
                "to cuda:1): launch at most 2 a machine (torchrun --nproc-per-node 2)")])
def test_a_process_without_its_own_gpu_is_refused_before_joining_the_group(tmp_path, monkeypatch, device, local_rank,
                                                                           refusal):
    """Under torchrun each process trains on the GPU of its LOCAL_RANK: --device cuda:1 was replaced by it without a
    word, and a third process on a machine of 2 GPUs joined the group, then stopped in torch's 'invalid device
    ordinal' traceback. Both are refused, naming --device, before the process group is joined (on a CPU machine here:
    2 CUDA devices pretended)."""
    import torch.distributed as dist

    from angle_train.tiny import demo_examples
    from angle_train.trainer import train

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(dist, "init_process_group", lambda **options: pytest.fail("joined the process group"))
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    with pytest.raises(ValueError, match=re.escape(refusal)):
        train(run_config(tmp_path, device=device, batch_size=6, max_steps=1), model=make_encoder("bert"),
              train_examples=(demo_examples(12), "B"))


def _evaluating_rank(rank, world, port, out_dir):
    """Two steps with an evaluation after each on 21 scored pairs and on 13 (query, positive) pairs; saves the
    evaluations and how many texts this process embedded for them."""
    from angle_train.evaluate import RetrievalSet
    from angle_train.models import Encoder
    from angle_train.tiny import demo_examples, demo_sts_examples
    from angle_train.trainer import train

    embedded = []
    encode = Encoder.encode
    Encoder.encode = lambda self, texts, *args, **kwargs: embedded.append(len(texts)) or encode(self, texts, *args,
                                                                                                **kwargs)
    pairs = demo_examples(13, seed=4)
    try:
        with rank_of_a_job(rank, world, port):
            results = {}
            for name, dev in (("sts", demo_sts_examples(21, seed=3)),
                              ("retrieval", RetrievalSet("dev", [ex.texts[0] for ex in pairs],
                                                         [ex.texts[1] for ex in pairs]))):
                embedded.clear()
                result = train(run_config(os.path.join(out_dir, name), batch_size=8, max_steps=2, eval_every=1,
                                          max_length=12, save_best=False), model=make_encoder("bert"),
                               train_examples=(demo_examples(24, seed=2), "B"), dev_examples=dev)
                results[name] = {"evals": result.evals, "embedded": sum(embedded)}
            torch.save(results, os.path.join(out_dir, f"evals-rank{rank}.pt"))
    finally:
        Encoder.encode = encode


def test_each_process_embeds_its_share_of_the_dev_texts(tmp_path):
    """Under DDP the main process embedded every dev text while the others waited at their next collective; now each
    embeds its share of every group of texts (21 scored pairs: 21 + 21 of their 42 distinct texts; 13 queries and 13
    documents), and the main process scores the gathered embeddings: the same evaluations as one process."""
    from angle_train.evaluate import RetrievalSet
    from angle_train.tiny import demo_examples, demo_sts_examples
    from angle_train.trainer import train

    start_ranks(_evaluating_rank, (2, free_port(), str(tmp_path / "ddp")))
    pairs = demo_examples(13, seed=4)
    for name, dev, shares in (("sts", demo_sts_examples(21, seed=3), (21, 21)),
                              ("retrieval", RetrievalSet("dev", [ex.texts[0] for ex in pairs],
                                                         [ex.texts[1] for ex in pairs]), (14, 12))):
        single = train(run_config(tmp_path / "single" / name, batch_size=8, max_steps=2, eval_every=1, max_length=12,
                                  save_best=False), model=make_encoder("bert"),
                       train_examples=(demo_examples(24, seed=2), "B"), dev_examples=dev)
        for rank in range(2):
            got = torch.load(tmp_path / "ddp" / f"evals-rank{rank}.pt")[name]
            assert got["embedded"] == 2 * shares[rank], (name, rank)  # two evaluations
            if rank == 0:
                assert [row.keys() for row in got["evals"]] == [row.keys() for row in single.evals]
                for row, want in zip(got["evals"], single.evals):
                    assert row == pytest.approx(want, abs=1e-9), name
