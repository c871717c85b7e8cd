"""Damaged checkpoints and full disks: every checkpoint carries a manifest (sizes and SHA-256 of its files, written
last); `--resume auto` skips the folders that do not match it and resumes from the newest one that does, exactly;
`--resume PATH` to a damaged folder is an error; a write that fails leaves the previous checkpoint intact; a manifest
naming a file outside its folder is refused unread."""

import errno
import json
import os
import random
import shutil

import pytest
import torch
from train_helpers import make_encoder, run_config, writes_refused_beyond

import angle_train.checkpoint as checkpoint
from angle_train.checkpoint import MANIFEST_FILE, STATE_FILE, checkpoint_problem, finished_checkpoints, write_manifest
from angle_train.tiny import demo_examples
from angle_train.trainer import StopTraining, train

DATA = (demo_examples(20, seed=3), "B")


def _config(out, **overrides):
    base = {"model": "builtin:tiny-bert", "batch_size": 8, "max_steps": 7, "lr": 3e-3, "warmup": 2, "save_every": 2,
            "keep_checkpoints": 3, "log_every": 1, "max_length": 12, "seed": 7}
    return run_config(out, **{**base, **overrides})


def _stop_after(last_step):
    def on_step(step, row):
        if step == last_step:
            raise StopTraining
    return on_step


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the autouse fixture sets it for each test, which runs after this module fixture
    try:
        result = train(_config(tmp_path_factory.mktemp("full")), train_examples=DATA)
    finally:
        torch.set_num_threads(threads)
    return [r["loss"] for r in result.history], {k: v.clone() for k, v in result.encoder.state_dict().items()}


def _killed_run(out):
    """A run killed after step 5: checkpoints at steps 2 and 4, oldest first."""
    train(_config(out), train_examples=DATA, on_step=_stop_after(5))
    done = finished_checkpoints(str(out))
    assert [os.path.basename(p) for p in done] == ["step-00000002", "step-00000004"]
    assert all(checkpoint_problem(p) is None for p in done)
    return done


def test_every_checkpoint_has_a_manifest_of_its_files(tmp_path):
    newest = _killed_run(tmp_path)[-1]
    manifest = json.loads(open(os.path.join(newest, MANIFEST_FILE)).read())
    assert set(manifest["files"]) == {STATE_FILE, "rng-rank0.pt"}
    assert manifest["files"][STATE_FILE]["bytes"] == os.path.getsize(os.path.join(newest, STATE_FILE))


def test_truncations_at_random_offsets_are_all_detected(tmp_path):
    newest = _killed_run(tmp_path)[-1]
    state = os.path.join(newest, STATE_FILE)
    original = open(state, "rb").read()
    rng = random.Random(0)
    for offset in [0, 1, len(original) - 1, *rng.sample(range(2, len(original) - 1), 20)]:
        with open(state, "wb") as f:
            f.write(original[:offset])
        assert checkpoint_problem(newest) == f"{STATE_FILE} has {offset} bytes, the manifest says {len(original)}"
    with open(state, "wb") as f:  # the same size, one byte changed
        f.write(original[:100] + bytes([original[100] ^ 1]) + original[101:])
    assert checkpoint_problem(newest) == f"{STATE_FILE} does not match its checksum"


@pytest.mark.parametrize("damage", ["truncated state", "no manifest", "rng file deleted", "torn manifest"])
def test_resume_auto_skips_a_damaged_checkpoint_and_resumes_exactly_from_the_previous_one(tmp_path, capsys, damage,
                                                                                         uninterrupted):
    older, newest = _killed_run(tmp_path)
    if damage == "truncated state":
        with open(os.path.join(newest, STATE_FILE), "r+b") as f:
            f.truncate(1000)
    elif damage == "no manifest":
        os.remove(os.path.join(newest, MANIFEST_FILE))
    elif damage == "rng file deleted":
        os.remove(os.path.join(newest, "rng-rank0.pt"))
    else:
        with open(os.path.join(newest, MANIFEST_FILE), "r+b") as f:
            f.truncate(10)
    capsys.readouterr()
    resumed = train(_config(tmp_path, resume="auto"), train_examples=DATA)
    out = capsys.readouterr().out
    assert f"skipping damaged checkpoint {newest}" in out and f"resumed from {older} at step 2" in out
    # out of the way of the resumed run's checkpoints, not deleted
    assert os.path.isdir(tmp_path / "set-aside" / "after-step-00000002" / "checkpoints" / "step-00000004")
    losses, weights = uninterrupted
    assert [r["step"] for r in resumed.history] == [3, 4, 5, 6, 7]
    assert [r["loss"] for r in resumed.history] == losses[2:]  # bit-identical to the uninterrupted run
    for name, value in resumed.encoder.state_dict().items():
        assert torch.equal(value, weights[name]), name


def test_an_explicit_resume_from_a_damaged_checkpoint_is_an_error(tmp_path):
    newest = _killed_run(tmp_path)[-1]
    os.remove(os.path.join(newest, "rng-rank0.pt"))
    with pytest.raises(ValueError, match=r"cannot resume from .*step-00000004: rng-rank0.pt is missing"):
        train(_config(tmp_path, resume=newest), train_examples=DATA)


def test_resume_auto_with_every_checkpoint_damaged_is_an_error(tmp_path):
    """Nothing to resume from is an error; with --overwrite 1 as well, the damaged run is replaced by a fresh one."""
    for path in _killed_run(tmp_path):
        os.remove(os.path.join(path, MANIFEST_FILE))
    with pytest.raises(ValueError, match="no checkpoint in .* matches its manifest .*no manifest.json"):
        train(_config(tmp_path, resume="auto"), train_examples=DATA)
    fresh = train(_config(tmp_path, resume="auto", overwrite=True, max_steps=2), train_examples=DATA)
    assert [row["step"] for row in fresh.history] == [1, 2]


@pytest.mark.parametrize("failing_write", ["state", "rng", "manifest", "sync"])
def test_a_full_disk_leaves_the_previous_checkpoint_intact(tmp_path, monkeypatch, failing_write):
    """The second save (step 4) hits ENOSPC (sync: when its files are synced before the rename, as a file system
    that allocates blocks at write-back reports it): the run stops with an OSError naming the intact step-2
    checkpoint, no partial folder is left, and a later `--resume auto` continues from step 2."""
    saves = {"count": 0}
    real_save, real_manifest, real_sync_tree = torch.save, checkpoint.write_manifest, checkpoint.sync_tree

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def save(obj, file, *args, **kwargs):
        kind = "state" if str(getattr(file, "name", file)).endswith(STATE_FILE) else "rng"  # a path or a file
        if kind == "state":
            saves["count"] += 1
        if saves["count"] == 2 and kind == failing_write:
            no_space()
        return real_save(obj, file, *args, **kwargs)

    def manifest(folder):
        if saves["count"] == 2 and failing_write == "manifest":
            no_space()
        return real_manifest(folder)

    def sync_tree(folder):
        if saves["count"] == 2 and failing_write == "sync":
            no_space()
        return real_sync_tree(folder)
    monkeypatch.setattr(checkpoint.torch, "save", save)
    monkeypatch.setattr(checkpoint, "write_manifest", manifest)
    monkeypatch.setattr(checkpoint, "sync_tree", sync_tree)
    with pytest.raises(OSError, match=r"could not write checkpoint .*step-00000004.tmp .*No space left on device.*"
                                      r"previous checkpoint .*step-00000002 is intact") as raised:
        train(_config(tmp_path), train_examples=DATA)
    assert raised.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-00000002"]
    assert checkpoint_problem(str(tmp_path / "checkpoints" / "step-00000002")) is None
    resumed = train(_config(tmp_path, resume="auto"), train_examples=DATA, on_step=_stop_after(3))
    assert [r["step"] for r in resumed.history] == [3]


def test_a_file_system_that_refuses_a_write_midway_fails_the_checkpoint_write(tmp_path, monkeypatch):
    """A real refusal by the file system (the file size limit, EFBIG, as a full disk's ENOSPC comes: after part of the
    state file is written), not a mocked one: PyTorch's zip writer reported it as a RuntimeError of its own
    ('unexpected pos ...', no errno), so the run stopped with that traceback and left step-N.tmp holding the part
    written (on a full disk, the space a resume needs). Now it is the failed checkpoint write: an OSError with the
    file system's errno naming the intact previous checkpoint, no partial folder."""
    pytest.importorskip("resource")
    from angle_train import trainer

    real_save, saves = trainer.save_checkpoint, []

    def save_under_a_file_size_limit(*args, **kwargs):
        saves.append(1)
        if len(saves) < 2:
            return real_save(*args, **kwargs)
        with writes_refused_beyond(64 * 1024):  # the state file is larger
            return real_save(*args, **kwargs)
    monkeypatch.setattr(trainer, "save_checkpoint", save_under_a_file_size_limit)
    with pytest.raises(OSError, match=r"could not write checkpoint .*step-00000004.tmp \(File too large\);.*"
                                      r"previous checkpoint .*step-00000002 is intact") as raised:
        train(_config(tmp_path, max_steps=4), train_examples=DATA)
    assert raised.value.errno == errno.EFBIG
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-00000002"]


def test_a_file_system_that_refuses_the_exports_weights_midway_fails_with_an_os_error(tmp_path):
    """safetensors reported a refused write of an export's weights as its own SafetensorError (no OSError), so
    angle-train stopped with its traceback (exit status 1); now it is an OSError with the file system's errno (one
    line, exit status 2), and neither final.tmp nor final/ is left."""
    pytest.importorskip("resource")
    encoder, tokenizer = make_encoder("bert")  # its weights (float64) are larger than the limit below
    with writes_refused_beyond(64 * 1024), pytest.raises(OSError, match=r"could not write the final model to "
                                                                          r".*final.tmp \(File too large\)") as raised:
        checkpoint.save_final(_config(tmp_path), encoder, tokenizer, base_model=None)
    assert raised.value.errno == errno.EFBIG
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("place", ["../ (parent)", "absolute", "subfolder", "symlink to outside", "the parent itself",
                                   "a NUL byte"])
def test_a_manifest_naming_a_file_outside_its_folder_is_refused_unread(tmp_path, monkeypatch, place):
    """Issue 29, item 9: a manifest names only files of its own folder. One that names another file (a path with ../,
    an absolute path, a file in a subfolder, or a link to a file outside) is refused before any file is hashed, even
    when that file matches its checksum; so is '..', and a name with a NUL byte (no file can have one: it is refused,
    not an error from the file system)."""
    folder = tmp_path / "run" / "checkpoints" / "step-00000002"
    folder.mkdir(parents=True)
    torch.save({"position": {}}, folder / STATE_FILE)
    outside = tmp_path / "secret.bin"
    outside.write_bytes(b"not part of the checkpoint")
    if place == "../ (parent)":
        name, why = os.path.relpath(outside, folder), "is not a file name of the folder"
    elif place == "absolute":
        name, why = str(outside), "is not a file name of the folder"
    elif place == "subfolder":
        name, why = "sub/secret.bin", "is not a file name of the folder"
    elif place == "the parent itself":
        name, why = "..", "is not a file name of the folder"
    elif place == "a NUL byte":
        name, why = "secret\0.bin", "is not a file name of the folder"
    else:
        (folder / "secret.bin").symlink_to(outside)
        name, why = "secret.bin", "is a link to a file outside the folder"
    write_manifest(str(folder))
    if place == "subfolder":
        (folder / "sub").mkdir()
        shutil.copy(outside, folder / "sub" / "secret.bin")
    manifest = json.loads((folder / MANIFEST_FILE).read_text())
    manifest["files"].pop("secret.bin", None)
    manifest["files"][name] = {"bytes": outside.stat().st_size, "sha256": checkpoint._sha256(str(outside))}
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest))
    hashed = []
    real_sha256 = checkpoint._sha256
    monkeypatch.setattr(checkpoint, "_sha256", lambda file: hashed.append(file) or real_sha256(file))

    assert checkpoint_problem(str(folder)) == f"{MANIFEST_FILE} names {name!r}, which {why}"
    assert hashed == []


def test_a_checkpoint_resumes_only_with_the_number_of_processes_that_wrote_it(tmp_path, monkeypatch):
    """Each process's data slice and random state continue from its own: a checkpoint of one process refuses a run of
    two, on every rank alike (only the second had refused, leaving the first in a collective), and one written by two
    processes refuses a run of one (once accepted silently, dropping rank 1's state)."""
    from angle_train import trainer
    from angle_train.distributed import DistInfo

    newest = _killed_run(tmp_path)[-1]
    for rank in (0, 1):
        with pytest.raises(ValueError, match=r"written by 1 process\(es\) and this run has 2: resume with 1"):
            checkpoint.load_checkpoint(newest, _config(tmp_path), DistInfo(rank, 2, rank), encoder=None,
                                       optimizer=None, scheduler=None, scaler=None)
    shutil.copy(os.path.join(newest, "rng-rank0.pt"), os.path.join(newest, "rng-rank1.pt"))  # as two processes write
    with pytest.raises(ValueError, match=r"written by 2 process\(es\) and this run has 1: resume with 2"):
        checkpoint.load_checkpoint(newest, _config(tmp_path), DistInfo(), encoder=None, optimizer=None, scheduler=None,
                                   scaler=None)
    # a run refuses it before the model loads (minutes for a large one), not after loading it and tokenising the data
    write_manifest(newest)
    monkeypatch.setattr(trainer, "build_encoder", lambda *args: pytest.fail("the model loaded"))
    with pytest.raises(ValueError, match=r"written by 2 process\(es\) and this run has 1: resume with 2"):
        train(_config(tmp_path, resume="auto"), train_examples=DATA)
