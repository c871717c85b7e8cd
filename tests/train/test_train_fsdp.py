"""--fsdp (issue 14, item 3): full fine-tuning sharded over 2 gloo processes (FSDP2) = one process training on the
whole batch, with the gradient cache and cross-device negatives; sharded checkpoints resume exactly and are checked
against their manifest before torch.distributed.checkpoint reads them; exports hold the whole weights. A planted
`.metadata` or `.distcp` (issue 29, item 1) is refused by name before any code in it runs."""

import dataclasses
import errno
import io
import json
import os
import pickle
import re
import shutil
import warnings

import pytest
import torch
from train_helpers import free_port, make_encoder, rank_of_a_job, run_config

from angle_kernels.testing.helpers import start_ranks
from angle_train.checkpoint import (MANIFEST_FILE, Position, checkpoint_path, checkpoint_problem, checkpoint_to_resume,
                                   finished_checkpoints, load_checkpoint, save_checkpoint, write_manifest)
from angle_train.distributed import DistInfo
from angle_train.safe_loading import UnsafeCheckpointError

pytest.importorskip("torch.distributed.fsdp")


# the single-process runs here draw no curves.png (rank processes are forked without the fixture)
pytestmark = pytest.mark.usefixtures("no_curves")


def _config(out_dir, **settings):
    return run_config(out_dir, batch_size=8, max_steps=4, chunk_size=3, lr=1e-3, warmup=0, log_every=1,
                      max_length=12, pooling="avg", save_every=2, **settings)


def _examples():
    from angle_train.tiny import demo_examples, demo_sts_examples

    return (demo_examples(24, seed=2), "B"), demo_sts_examples(16, seed=3)


def _rank_main(rank, world, port, out_dir, settings, stop_after, arch="bert"):
    from angle_train.trainer import StopTraining, train

    def on_step(step, row):
        if step == stop_after:
            raise StopTraining

    with rank_of_a_job(rank, world, port):
        train_examples, dev_examples = _examples()
        result = train(_config(out_dir, fsdp=True, **settings), model=make_encoder(arch, dropout=0.0),
                       train_examples=train_examples, dev_examples=dev_examples, on_step=on_step)
        torch.save({"losses": [r["loss"] for r in result.history], "best": result.best_spearman},
                   os.path.join(out_dir, f"rank{rank}.pt"))


def _rank_records_its_error(rank, world, port, out_dir, settings):
    """_rank_main, writing what it raised to OUT_DIR/error{rank}.txt: every process's error, not the first one's."""
    try:
        _rank_main(rank, world, port, out_dir, settings, stop_after=0)
    except Exception as exc:
        with open(os.path.join(out_dir, f"error{rank}.txt"), "w") as f:
            f.write(f"{type(exc).__name__}: {exc}")


def _spawn(out_dir, stop_after=0, arch="bert", **settings):
    start_ranks(_rank_main, (2, free_port(), str(out_dir), settings, stop_after, arch))
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

    # one truncated after the manifest was checked (written here afresh to match it): every process says so in one
    # line, naming the checkpoint, the file and the checkpoint to resume from instead (none: it is the first)
    os.truncate(shard, os.path.getsize(shard) // 2)
    write_manifest(checkpoint)
    start_ranks(_rank_records_its_error, (2, free_port(), str(tmp_path / "fsdp"), {"resume": checkpoint}))
    for rank in range(2):
        with open(tmp_path / "fsdp" / f"error{rank}.txt") as f:
            error = f.read()
        assert re.fullmatch(rf"ValueError: cannot resume from {re.escape(checkpoint)}: its {os.path.basename(shard)} "
                            r"cannot be read on process \d \(\w+Error[^;\n]*\); no earlier "
                            r"checkpoint of its run is left: start afresh \(--overwrite 1 without --resume, or a new "
                            r"--output-dir\)", error), error

    # a hostile .metadata (with a manifest rewritten to match) is refused on both processes; its code never runs
    newest = finished_checkpoints(str(tmp_path / "fsdp"))[-1]
    marker = tmp_path / "the-planted-code-ran"
    _plant(newest, "metadata: code inside the real metadata", str(marker))
    with pytest.raises(Exception, match=r"(?s)UnsafeCheckpointError: refusing to load .*\.metadata.*mkdir"):
        _spawn(tmp_path / "fsdp", resume="auto", save_final=True, eval_every=2)
    assert not marker.exists()


def test_fsdp_trains_every_weight_of_a_llama_with_packing(tmp_path):
    """A LLaMA-style model, its texts packed into rows: the packing check's forward once ran after sharding and left
    FSDP's root unit (token embeddings, final norm) unsharded, so the optimizer held tensors FSDP then replaced:
    they never trained, the losses left one process's from step 2 and the sharded checkpoint raised KeyError."""
    from angle_train.trainer import train

    train_examples, dev_examples = _examples()
    settings = dict(save_final=True, eval_every=2, pack=128)
    single = train(_config(tmp_path / "single", **settings), model=make_encoder("llama"),
                   train_examples=train_examples, dev_examples=dev_examples)
    sharded = _spawn(tmp_path / "fsdp", arch="llama", **settings)
    for rank in range(2):
        torch.testing.assert_close(torch.tensor(sharded[rank]["losses"]),
                                   torch.tensor([r["loss"] for r in single.history]), rtol=1e-9, atol=1e-12)
    ours, theirs = _weights(tmp_path / "fsdp" / "final"), _weights(tmp_path / "single" / "final")
    initial = make_encoder("llama")[0].state_dict()
    for name, value in theirs.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-9, atol=1e-12, msg=f"final: {name}")
    assert all(not torch.equal(ours[name], initial[name]) for name in ours if "embed_tokens" in name or
               name.endswith("norm.weight")), "the root unit's weights did not train"


def test_fsdp_refusals(tmp_path):
    from angle_train.cli import config_from_args
    from angle_train.trainer import train

    with pytest.raises(SystemExit):
        config_from_args(["--fsdp", "--lora"])
    train_examples, _ = _examples()
    with pytest.raises(ValueError, match="launch with torchrun"):
        train(_config(tmp_path, fsdp=True), model=make_encoder("bert"), train_examples=train_examples)


def test_each_transformer_block_is_its_own_fsdp_unit(monkeypatch):
    """shard makes every block Hugging Face keeps whole (_no_split_modules: BertEmbeddings, each BertLayer) an FSDP
    unit, then the encoder the root: one unit for the whole model would gather every weight at once, the memory --fsdp
    is there to save."""
    import torch.distributed.fsdp

    from angle_train import sharding

    units = []
    monkeypatch.setattr(torch.distributed.fsdp, "fully_shard", units.append)
    encoder, _ = make_encoder("bert")
    assert sharding.shard(encoder) is encoder
    blocks = [m for m in encoder.backbone.modules() if type(m).__name__ in ("BertEmbeddings", "BertLayer")]
    assert sum(type(m).__name__ == "BertLayer" for m in blocks) >= 2 and units == [*blocks, encoder]


# ------------------------------------------------------------------ planted .metadata and .distcp files (one process)


class RunsCodeWhenUnpickled:
    """What a hostile file can hold: unpickling it calls os.mkdir(marker), standing in for any code."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def _sets_an_attribute_of_dcp_metadata_class() -> bytes:
    """A pickle that runs no function of its own but, through BUILD applied to a class, sets an attribute `planted` on
    DCP's Metadata class (any later checkpoint load in the process would see the change)."""
    name = b"planted"
    return (b"\x80\x02ctorch.distributed.checkpoint.metadata\nMetadata\n"  # PROTO 2, GLOBAL the class
            b"N}X" + len(name).to_bytes(4, "little") + name + b"\x88s\x86b.")  # BUILD (None, {name: True}); STOP


def _plant(folder: str, kind: str, marker: str) -> str:
    """Rewrite the sharded checkpoint `folder` as an attacker would (a hostile object in DCP's files, the manifest
    rewritten to match); return the name of the file the load must refuse."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata_file, shard_file = os.path.join(folder, ".metadata"), os.path.join(folder, "__0_0.distcp")
    with open(metadata_file, "rb") as f:
        metadata = pickle.load(f)  # the real file, written by this test
    hostile_file = ".metadata"
    if kind == "metadata: a hostile object":
        data = pickle.dumps(RunsCodeWhenUnpickled(marker))
    elif kind == "metadata: code inside the real metadata":  # loads as a valid Metadata, after running the code
        metadata.planner_data["planted"] = RunsCodeWhenUnpickled(marker)
        data = pickle.dumps(metadata)
    elif kind == "metadata: changes a class":
        data = _sets_an_attribute_of_dcp_metadata_class()
    elif kind in ("metadata: a shard outside the folder", "metadata: a shard linked out of the folder"):
        shutil.copy(shard_file, os.path.join(folder, "..", "__0_0.distcp"))
        shard = "../__0_0.distcp"  # DCP would read it
        if kind == "metadata: a shard linked out of the folder":  # a link the manifest does not list
            shard = "__9_0.distcp"
            os.symlink(os.path.join("..", "__0_0.distcp"), os.path.join(folder, shard))
        metadata.storage_data = {index: dataclasses.replace(info, relative_path=shard)
                                 for index, info in metadata.storage_data.items()}
        data = pickle.dumps(metadata)
    else:  # a .distcp entry replaced by a hostile one, appended to the shard file; .metadata points to it
        hostile_file = "__0_0.distcp"
        wanted = BytesStorageMetadata if kind == "distcp: optimizer settings" else None
        fqn = next(fqn for fqn, entry in metadata.state_dict_metadata.items()
                   if (wanted is None) != isinstance(entry, BytesStorageMetadata))
        blob = io.BytesIO()
        torch.save(RunsCodeWhenUnpickled(marker), blob)
        offset = os.path.getsize(shard_file)
        with open(shard_file, "ab") as f:
            f.write(blob.getvalue())
        metadata.storage_data = {
            index: dataclasses.replace(info, offset=offset, length=len(blob.getvalue())) if index.fqn == fqn else info
            for index, info in metadata.storage_data.items()}
        data = pickle.dumps(metadata)
    with open(metadata_file, "wb") as f:
        f.write(data)
    write_manifest(folder)  # whoever can plant a file can rewrite the manifest too
    if kind == "metadata: a shard linked out of the folder":
        with open(os.path.join(folder, MANIFEST_FILE)) as f:
            manifest = json.load(f)
        del manifest["files"]["__9_0.distcp"]
        with open(os.path.join(folder, MANIFEST_FILE), "w") as f:
            json.dump(manifest, f)
    return os.path.join(folder, hostile_file)


SINGLE_PROCESS_DCP = "torch.distributed is disabled"  # DCP's warning when it saves or loads without a process group


def _trainables(cfg, seed=0):
    from angle_train.trainer import make_optimizer, make_schedule

    encoder, _ = make_encoder("bert", seed=seed)
    optimizer = make_optimizer(cfg, encoder, torch.device("cpu"))
    return {"encoder": encoder, "optimizer": optimizer, "scheduler": make_schedule(cfg, optimizer, 4),
            "scaler": torch.amp.GradScaler("cpu", enabled=False)}


@pytest.fixture(scope="module")
def sharded_run(tmp_path_factory):
    """An output folder holding a sharded checkpoint (step 2) written by one process: DCP without a process group
    writes the same files as under FSDP (.metadata, one __0_0.distcp), with one shard per tensor. Also the weights and
    optimizer state it holds."""
    out = tmp_path_factory.mktemp("sharded")
    cfg = _config(out, fsdp=True)
    trainables = _trainables(cfg)
    for p in trainables["encoder"].parameters():
        p.grad = torch.full_like(p, 0.5)
    trainables["optimizer"].step()  # AdamW state beside the settings (param_groups: DCP's non-tensor entries)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", SINGLE_PROCESS_DCP)
        save_checkpoint(cfg, Position(step=2, epoch=0, batch=2), DistInfo(), sharded=True, **trainables)
    return out, trainables["encoder"].state_dict(), trainables["optimizer"].state_dict()


def _resume(out, **settings):
    """--resume auto's steps in this process: the checkpoint checkpoint_to_resume picks, loaded by load_checkpoint."""
    cfg = _config(out, fsdp=True, resume="auto", **settings)
    path = checkpoint_to_resume(cfg)
    trainables = _trainables(cfg, seed=1)
    position = load_checkpoint(path, cfg, DistInfo(), **trainables)
    return position, trainables


@pytest.mark.filterwarnings(f"ignore:{SINGLE_PROCESS_DCP}")
def test_a_sharded_checkpoint_loads_exactly_in_one_process(sharded_run, tmp_path):
    """The control for the refusals below: what DCP writes is admitted by the restricted readers."""
    out, weights, optimizer = sharded_run
    shutil.copytree(out, tmp_path / "run")
    position, trainables = _resume(tmp_path / "run")
    assert position == Position(step=2, epoch=0, batch=2)
    for name, value in trainables["encoder"].state_dict().items():
        assert torch.equal(value, weights[name]), name
    loaded = trainables["optimizer"].state_dict()
    assert loaded["param_groups"] == optimizer["param_groups"]
    for key, state in optimizer["state"].items():
        for name, value in state.items():
            assert torch.equal(loaded["state"][key][name], value), (key, name)


@pytest.mark.filterwarnings(f"ignore:{SINGLE_PROCESS_DCP}")
def test_a_full_disk_while_the_shards_are_written_leaves_the_previous_checkpoint_intact(sharded_run, tmp_path,
                                                                                        monkeypatch):
    """DCP gathers a write's error on any process into a CheckpointException (a BaseException) on every process: a
    full disk while the shards were written stopped an --fsdp run with DCP's traceback (exit status 1) and left the
    partial step-N.tmp; now it is the failed checkpoint write a run without --fsdp reports (an OSError naming the
    intact previous checkpoint, no partial folder), and --resume auto continues from that checkpoint."""
    from torch.distributed.checkpoint import filesystem

    out, _, _ = sharded_run
    shutil.copytree(out, tmp_path / "run")
    cfg = _config(tmp_path / "run", fsdp=True)

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(filesystem, "_write_item", no_space)
    with pytest.raises(OSError, match=r"could not write checkpoint .*step-00000004.tmp \(No space left on device\);"
                                      r" the partial folder was removed and the previous checkpoint .*step-00000002 "
                                      r"is intact") as raised:
        save_checkpoint(cfg, Position(step=4, epoch=0, batch=4), DistInfo(), sharded=True, **_trainables(cfg))
    assert raised.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == ["step-00000002"]
    assert _resume(tmp_path / "run")[0] == Position(step=2, epoch=0, batch=2)


@pytest.mark.filterwarnings(f"ignore:{SINGLE_PROCESS_DCP}")
@pytest.mark.parametrize("damage", ["missing shard", "truncated shard", "missing metadata", "truncated metadata"])
def test_an_unreadable_dcp_file_is_one_error_naming_it_and_the_checkpoint_before(sharded_run, tmp_path, damage):
    """A shard file or .metadata missing or truncated after the manifest was checked (a disk error, a copy still under
    way) stopped a resume with DCP's traceback of every process (or a FileNotFoundError), naming neither the
    checkpoint nor a way on; now it is one line naming both, with the checkpoint before it to resume from instead."""
    out, _, _ = sharded_run
    shutil.copytree(out, tmp_path / "run")
    previous = finished_checkpoints(str(tmp_path / "run"))[-1]
    newest = checkpoint_path(str(tmp_path / "run"), 4)
    shutil.copytree(previous, newest)
    file = os.path.join(newest, "__0_0.distcp" if damage.endswith("shard") else ".metadata")
    if damage.startswith("missing"):
        os.remove(file)
        why = r"it is missing"
    else:
        os.truncate(file, os.path.getsize(file) // 2)
        why = r"RuntimeError: PytorchStreamReader [^;\n]*" if damage.endswith("shard") else r"UnpicklingError: [^;\n]*"
    cfg = _config(tmp_path / "run", fsdp=True, resume=newest)
    with pytest.raises(ValueError) as raised:
        load_checkpoint(newest, cfg, DistInfo(), **_trainables(cfg, seed=1))
    assert re.fullmatch(rf"cannot resume from {re.escape(newest)}: its {re.escape(os.path.basename(file))} cannot be "
                        rf"read \({why}\); resume from the checkpoint before it \(--resume {re.escape(previous)}\) or "
                        r"start afresh \(--overwrite 1 without --resume, or a new --output-dir\)",
                        str(raised.value)), str(raised.value)
    assert not isinstance(raised.value, UnsafeCheckpointError) and raised.value.__cause__ is not None


@pytest.mark.filterwarnings(f"ignore:{SINGLE_PROCESS_DCP}")
def test_a_readable_sharded_checkpoint_resumes_without_listing_its_runs_checkpoints(sharded_run, tmp_path,
                                                                                   monkeypatch):
    """The checkpoint to resume from instead is looked up only where a file cannot be read: a checkpoint whose files
    all read resumes where its run's checkpoints/ cannot be listed (a folder others may enter but not list)."""
    out, weights, _ = sharded_run
    shutil.copytree(out, tmp_path / "run")
    path = finished_checkpoints(str(tmp_path / "run"))[-1]
    unlisted, listdir = os.path.dirname(path), os.listdir

    def refusing_the_checkpoints_folder(folder="."):
        if os.path.realpath(folder) == os.path.realpath(unlisted):
            raise PermissionError(errno.EACCES, "Permission denied", folder)
        return listdir(folder)

    monkeypatch.setattr(os, "listdir", refusing_the_checkpoints_folder)
    cfg = _config(tmp_path / "run", fsdp=True, resume=path)
    trainables = _trainables(cfg, seed=1)
    assert load_checkpoint(path, cfg, DistInfo(), **trainables).step == 2
    for name, value in trainables["encoder"].state_dict().items():
        torch.testing.assert_close(value, weights[name], rtol=0, atol=0)


@pytest.mark.filterwarnings(f"ignore:{SINGLE_PROCESS_DCP}")
@pytest.mark.parametrize("kind", ["metadata: a hostile object", "metadata: code inside the real metadata",
                                  "metadata: changes a class", "metadata: a shard outside the folder",
                                  "metadata: a shard linked out of the folder",
                                  "distcp: optimizer settings", "distcp: a tensor"])
def test_a_planted_dcp_file_is_refused_by_name_before_its_code_runs(sharded_run, tmp_path, kind):
    """Issue 29, item 1: DCP itself reads .metadata with pickle.load and non-tensor entries of a .distcp with
    torch.load(weights_only=False); angle_train reads both through loaders that admit only what DCP writes."""
    from torch.distributed.checkpoint.metadata import Metadata

    out, _, _ = sharded_run
    shutil.copytree(out, tmp_path / "run")
    marker = tmp_path / "the-planted-code-ran"
    hostile = _plant(finished_checkpoints(str(tmp_path / "run"))[-1], kind, str(marker))
    try:
        with pytest.raises(UnsafeCheckpointError) as refused:
            _resume(tmp_path / "run")
        message = str(refused.value)
        assert f"refusing to load {hostile}" in message, message
        if kind == "metadata: a shard outside the folder":
            assert "'../__0_0.distcp', outside the checkpoint folder" in message, message
        elif kind == "metadata: a shard linked out of the folder":
            assert "'__9_0.distcp', outside the checkpoint folder" in message, message
        elif kind == "metadata: changes a class":
            assert "Metadata" in message, message
        else:
            assert "mkdir" in message, message  # names what the file would have called
        assert not marker.exists()
        assert not hasattr(Metadata, "planted")
    finally:
        if hasattr(Metadata, "planted"):  # undo the unfixed loader's change, for the tests after this one
            del Metadata.planted
