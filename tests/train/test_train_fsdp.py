"""--fsdp (issue 14, item 3): full fine-tuning sharded over 2 gloo processes (FSDP2) = one process training on the
whole batch, with the gradient cache and cross-device negatives; sharded checkpoints resume exactly and are checked
against their manifest before torch.distributed.checkpoint reads them; exports hold the whole weights."""

import os

import pytest
import torch
import torch.multiprocessing as mp
from train_helpers import free_port, make_encoder, run_config

from angle_train.checkpoint import checkpoint_path, checkpoint_problem

pytest.importorskip("torch.distributed.fsdp")


def _config(out_dir, **settings):
    return run_config(out_dir, batch_size=8, max_steps=4, chunk_size=3, lr=1e-3, warmup=0, log_every=1,
                      max_length=12, pooling="avg", save_every=2, **settings)


def _examples():
    from angle_train.tiny import demo_examples, demo_sts_examples

    return (demo_examples(24, seed=2), "B"), demo_sts_examples(16, seed=3)


def _rank_main(rank, world, port, out_dir, settings, stop_after):
    import torch.distributed as dist

    from angle_train.trainer import StopTraining, train

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))

    def on_step(step, row):
        if step == stop_after:
            raise StopTraining

    try:
        train_examples, dev_examples = _examples()
        result = train(_config(out_dir, fsdp=True, **settings), model=make_encoder("bert", dropout=0.0),
                       train_examples=train_examples, dev_examples=dev_examples, on_step=on_step)
        torch.save({"losses": [r["loss"] for r in result.history], "best": result.best_spearman},
                   os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears gloo down while the other still talks to it
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _spawn(out_dir, stop_after=0, **settings):
    mp.spawn(_rank_main, args=(2, free_port(), str(out_dir), settings, stop_after), nprocs=2, join=True)
    return [torch.load(os.path.join(out_dir, f"rank{rank}.pt")) for rank in range(2)]


def _weights(folder):
    from angle_train.export import load_pretrained

    return load_pretrained(str(folder))[0].state_dict()


def test_fsdp_run_equals_single_process_and_resumes_exactly(tmp_path):
    """Steps 1-2 sharded, stopped, resumed from the sharded checkpoint for steps 3-4: every loss, the dev scores and
    the final and best exports equal one unsharded process's uninterrupted run (float64: to 1e-9)."""
    from angle_train.trainer import train

    train_examples, dev_examples = _examples()
    single = train(_config(tmp_path / "single", save_final=True, eval_every=2), model=make_encoder("bert"),
                   train_examples=train_examples, dev_examples=dev_examples)
    expected = [r["loss"] for r in single.history]

    first = _spawn(tmp_path / "fsdp", stop_after=2, eval_every=2)
    checkpoint = checkpoint_path(str(tmp_path / "fsdp"), 2)
    files = set(os.listdir(checkpoint))
    assert {"state.pt", "rng-rank0.pt", "rng-rank1.pt", ".metadata", "manifest.json"} <= files
    assert sum(name.endswith(".distcp") for name in files) == 2  # one shard file per process
    second = _spawn(tmp_path / "fsdp", resume="auto", save_final=True, eval_every=2)
    for rank in range(2):
        losses = first[rank]["losses"] + second[rank]["losses"]
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(expected), rtol=1e-9, atol=1e-12)
        assert second[rank]["best"] == pytest.approx(single.best_spearman, abs=1e-9)
    for folder in ("final", "best"):
        ours, theirs = _weights(tmp_path / "fsdp" / folder), _weights(tmp_path / "single" / folder)
        for name, value in theirs.items():
            torch.testing.assert_close(ours[name], value, rtol=1e-9, atol=1e-12, msg=f"{folder}: {name}")

    # a shard damaged after it was written fails the manifest, before DCP would read (and unpickle) anything
    shard = os.path.join(checkpoint, sorted(n for n in files if n.endswith(".distcp"))[1])
    with open(shard, "r+b") as f:
        f.seek(16)
        f.write(b"\x00\x01\x02")
    assert "does not match its checksum" in checkpoint_problem(checkpoint)


def test_fsdp_refusals(tmp_path):
    from angle_train.cli import config_from_args
    from angle_train.trainer import train

    with pytest.raises(SystemExit):
        config_from_args(["--fsdp", "--lora"])
    train_examples, _ = _examples()
    with pytest.raises(ValueError, match="launch with torchrun"):
        train(_config(tmp_path, fsdp=True), model=make_encoder("bert"), train_examples=train_examples)
