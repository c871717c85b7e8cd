"""The files a run keeps safe, at their edges: the output folder's lock (a stale lock whose pid was reused is taken
over; a live process of another user keeps its lock; others wait while one run decides about the lock; a run's
release never removes another run's lock; a lock file without its host is refused in one line), and the checkpoints'
bookkeeping (a kept best of a checkpoint's own step stays; best/ on resume is the checkpoint's best or none; a
damaged last good checkpoint is passed over after a non-finite stop; a manifest must cover the state file; a swap of
final/ or best/ leaves one whole copy, also when it fails midway, and a kill while a kept best goes back to best/
leaves it for the next resume; a checkpoint, best/ and final/ are synced to disk before their rename and their
folder after it, before an older copy or checkpoint is removed, by their regular files only; a sync failing after
the rename reports the checkpoint in place, one failing before it leaves no final.tmp; the folders a run creates
(checkpoints/, set-aside/), moves a line of training between and deletes an earlier run from are synced; an empty
metrics.jsonl is no earlier run; the output folder a run creates is synced in its parent; a move to another file
system is synced whole before its source goes, and one that fails keeps its source), and the small files replaced
whole (atomic_files.written_aside: synced, then swapped in, a link written through, the permissions kept, a link
left as the aside file not written through; a write that fails leaves the previous file and no aside file behind:
the record of a non-finite stop, the lock a run takes over, the run's config.json; a lock taken over whose folder
cannot be synced is not kept; a run's start removes the aside files killed writes left)."""

from __future__ import annotations

import errno
import fcntl
import json
import os
import shutil
import socket
import stat

import pytest
import torch
from train_helpers import full_disk_midway, make_encoder, run_config

from angle_train import atomic_files, checkpoint, run_lock, trainer
from angle_train.distributed import DistInfo
from angle_train.tiny import demo_examples


@pytest.mark.parametrize("process_start", ["1", "0"])
def test_a_stale_lock_whose_pid_was_reused_is_taken_over(tmp_path, capsys, process_start):
    """The start time told apart is /proc/PID/stat's field 22 (the one before it is always 0)."""
    with open(tmp_path / run_lock.LOCK_FILE, "w") as f:  # a live pid of this host, recorded with another start
        json.dump({"host": socket.gethostname(), "pid": os.getppid(), "process_start": process_start,
                   "started": "then"}, f)
    lock = run_lock.acquire(str(tmp_path))
    assert "taking over the lock of a run that is gone" in capsys.readouterr().err
    lock.release()


def test_the_lock_of_a_live_process_of_another_user_is_kept(tmp_path, monkeypatch):
    """A process this user may not signal (os.kill: PermissionError) is alive: its run holds the folder."""
    (tmp_path / run_lock.LOCK_FILE).write_text(json.dumps({"host": socket.gethostname(), "pid": 1, "started": "then"}))

    def not_permitted(pid, signal):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(run_lock.os, "kill", not_permitted)
    with pytest.raises(run_lock.OutputDirLocked, match="in use by another run .process 1 on this host"):
        run_lock.acquire(str(tmp_path))


def test_no_other_run_shares_the_folder_while_one_decides_about_the_lock(tmp_path):
    """While one run reads, judges and writes the lock file, the folder's flock is exclusive: no other run holds it,
    even to read, so two runs that find the same stale lock cannot both take it."""
    fd = os.open(tmp_path, os.O_RDONLY)
    try:
        with run_lock._folder_flock(str(tmp_path)):
            with pytest.raises(BlockingIOError):
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    finally:
        os.close(fd)


def test_a_runs_release_leaves_another_runs_lock(tmp_path):
    first = run_lock.acquire(str(tmp_path))
    os.remove(first.path)  # removed by hand, as the refusal advises once a run is thought gone
    second = run_lock.acquire(str(tmp_path))
    first.release()
    assert os.path.exists(second.path)
    second.release()


def test_a_lock_file_without_its_host_is_refused_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(run_lock, "UNREADABLE_RETRY_S", 0.1)
    (tmp_path / run_lock.LOCK_FILE).write_text(json.dumps({"pid": 1}))
    with pytest.raises(run_lock.OutputDirLocked, match="unreadable"):
        run_lock.acquire(str(tmp_path))


def test_the_best_of_a_kept_checkpoints_own_step_stays(tmp_path):
    out = str(tmp_path)
    os.makedirs(checkpoint.checkpoint_path(out, 4))
    kept = checkpoint.kept_best_path(out, 4)  # the best of step 4, set aside when best/ was replaced
    os.makedirs(kept)
    (tmp_path / os.path.relpath(kept, out) / checkpoint.META_FILE).write_text(json.dumps({"best": {"step": 4}}))
    os.makedirs(tmp_path / "best")
    (tmp_path / "best" / checkpoint.META_FILE).write_text(json.dumps({"best": {"step": 6}}))
    checkpoint.prune_kept_bests(out)
    assert os.path.isdir(kept)


def _best(folder, record: dict | None) -> None:
    """folder as a best/ export whose metadata records `record` (None: no step, as an older angle_train wrote it)."""
    os.makedirs(folder)
    with open(os.path.join(folder, checkpoint.META_FILE), "w") as f:
        json.dump({} if record is None else {"best": record}, f)


def test_a_best_written_after_a_checkpoint_that_knows_none_is_removed_on_resume(tmp_path):
    """A killed run evaluated for the first time after its step-2 checkpoint: resumed from it, best/ (step 5's) is
    no model the resumed run knows of."""
    out = str(tmp_path)
    _best(tmp_path / "best", {"step": 5, "dev_spearman": 0.4})
    position = checkpoint.Position(step=2)
    assert checkpoint.reconcile_best(run_config(out), checkpoint.checkpoint_path(out, 2), position) == "ok"
    assert not (tmp_path / "best").exists()


def test_a_best_recording_no_step_is_removed_when_the_checkpoints_best_is_missing(tmp_path):
    """The checkpoint's best (step 2) is nowhere to be found: best/, recording no step, cannot be shown to be it and
    is removed rather than reported as the run's best."""
    out = str(tmp_path)
    _best(tmp_path / "best", None)
    position = checkpoint.Position(step=4, best=0.5, best_step=2)
    assert checkpoint.reconcile_best(run_config(out), checkpoint.checkpoint_path(out, 4), position) == "missing"
    assert not (tmp_path / "best").exists()


def test_a_checkpoint_from_before_best_steps_were_recorded_leaves_best_as_it_is(tmp_path):
    """A checkpoint of an older angle_train knows its best score but not its step: its best/ (recording no step
    either) stays."""
    out = str(tmp_path)
    _best(tmp_path / "best", None)
    position = checkpoint.Position(step=4, best=0.5, best_step=None)
    assert checkpoint.reconcile_best(run_config(out), checkpoint.checkpoint_path(out, 4), position) == "ok"
    assert (tmp_path / "best").is_dir()


class _Killed(BaseException):
    """A kill, raised where the process would have died."""


def test_a_kill_while_a_kept_best_goes_back_leaves_it_for_the_next_resume(tmp_path, monkeypatch):
    """On resume the checkpoint's kept best (checkpoints/best-step-2) goes back to best/, replacing the killed run's
    best of step 5. A kill before any of the renames that takes (each raising in turn): the next resume still finds
    the kept best and puts it in place. It was staged as best.tmp, where a kill between its two renames left the only
    copy for the next export to delete."""
    position = checkpoint.Position(step=4, best=0.5, best_step=2)
    renames = []
    real_replace = os.replace

    def counted(src, dst):
        renames.append(dst)
        real_replace(src, dst)

    def resumed(out: str) -> str:
        return checkpoint.reconcile_best(run_config(out), checkpoint.checkpoint_path(out, 4), position)

    def killed_run(out) -> None:
        _best(checkpoint.kept_best_path(str(out), 2), {"step": 2, "dev_spearman": 0.5})
        _best(out / "best", {"step": 5, "dev_spearman": 0.6})

    killed_run(tmp_path / "whole")
    monkeypatch.setattr(checkpoint.os, "replace", counted)
    assert resumed(str(tmp_path / "whole")) == "ok"
    assert checkpoint.best_holds(str(tmp_path / "whole" / "best"), position)
    for kill_at in range(len(renames)):
        out = tmp_path / f"killed-before-rename-{kill_at}"
        killed_run(out)
        done = iter(range(kill_at))

        def killed(src, dst):
            if next(done, None) is None:
                raise _Killed
            real_replace(src, dst)

        monkeypatch.setattr(checkpoint.os, "replace", killed)
        with pytest.raises(_Killed):
            resumed(str(out))
        monkeypatch.setattr(checkpoint.os, "replace", real_replace)
        shutil.rmtree(out / "best.tmp", ignore_errors=True)  # as the next export does (checkpoint._export)
        assert resumed(str(out)) == "ok", f"killed before rename {kill_at}"
        assert checkpoint.best_holds(str(out / "best"), position)


def test_a_damaged_last_good_checkpoint_is_passed_over(tmp_path):
    out = str(tmp_path)
    done = [checkpoint.checkpoint_path(out, s) for s in (2, 4)]
    for path in done:
        os.makedirs(path)
    with open(os.path.join(done[0], checkpoint.STATE_FILE), "wb") as f:
        f.write(b"x")  # step 2, the last good one: no manifest
    checkpoint.record_non_finite_stop(out, 5, done[0])
    assert checkpoint._last_good_after_a_non_finite_stop(out, done) is None  # the newest whole one, then


def test_a_manifest_must_cover_the_state_file(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    checkpoint.write_manifest(str(tmp_path))  # written before the state file
    (tmp_path / checkpoint.STATE_FILE).write_bytes(b"")
    assert checkpoint.checkpoint_problem(str(tmp_path)) == f"manifest.json does not list {checkpoint.STATE_FILE}"


def test_a_swap_that_fails_midway_leaves_a_whole_copy(tmp_path, monkeypatch):
    final, tmp = str(tmp_path / "final"), str(tmp_path / "final.tmp")
    os.makedirs(final)
    os.makedirs(tmp)
    replace = os.replace

    def dies_before_the_new_copy_is_in(src, dst):
        if src == tmp:
            raise OSError("killed here")
        replace(src, dst)

    monkeypatch.setattr(checkpoint.os, "replace", dies_before_the_new_copy_is_in)
    with pytest.raises(OSError):
        checkpoint._swap_in(tmp, final)
    assert sorted(os.listdir(tmp_path)) == ["final.old", "final.tmp"]


def test_a_swap_leaves_the_new_copy_alone(tmp_path):
    final, tmp = tmp_path / "final", tmp_path / "final.tmp"
    for folder, text in ((final, "old"), (tmp, "new")):
        folder.mkdir()
        (folder / "model.safetensors").write_text(text)
    checkpoint._swap_in(str(tmp), str(final))
    assert sorted(os.listdir(tmp_path)) == ["final"] and (final / "model.safetensors").read_text() == "new"


def _disk_calls(monkeypatch) -> list[tuple[str, ...]]:
    """("sync", path), ("rename", source, destination) and ("remove", path) for each os.fsync, os.replace and
    shutil.rmtree of an existing path from now on, in order (the path of a synced descriptor read back from
    /proc/self/fd: Linux)."""
    calls, fsync, replace, rmtree = [], os.fsync, os.replace, shutil.rmtree

    def synced(fd):
        calls.append(("sync", os.readlink(f"/proc/self/fd/{fd}")))
        fsync(fd)

    def renamed(source, destination):
        calls.append(("rename", os.path.realpath(source), os.path.realpath(destination)))
        replace(source, destination)

    def removed(path, *args, **kwargs):
        if os.path.exists(path):
            calls.append(("remove", os.path.realpath(path)))
        rmtree(path, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", synced)
    monkeypatch.setattr(os, "replace", renamed)
    monkeypatch.setattr(shutil, "rmtree", removed)
    return calls


def _synced_before_renamed_in(calls: list, tmp: str, final: str) -> int:
    """Check that every file and folder of the folder `final` (written as `tmp`) was synced before the rename of
    `tmp` to `final`, and the parent folder after it; the index of that parent sync in `calls`."""
    renamed_at = calls.index(("rename", tmp, final))
    synced_before = {path for kind, path, *_ in calls[:renamed_at] if kind == "sync"}
    tree = {os.path.join(tmp, os.path.relpath(os.path.join(root, name), final))
            for root, folders, files in os.walk(final) for name in folders + files}
    assert tree and tree | {tmp} <= synced_before
    return calls.index(("sync", os.path.dirname(final)), renamed_at)


def _checkpoint_saver(out: str, *, keep_checkpoints: int):
    """save(step): a checkpoint of a one-layer model into `out` (save_checkpoint on the main process)."""
    encoder, _ = make_encoder("bert", dtype=torch.float32, layers=1)
    optimizer = torch.optim.SGD(encoder.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    cfg = run_config(out, keep_checkpoints=keep_checkpoints)

    def save(step):
        return checkpoint.save_checkpoint(cfg, checkpoint.Position(step=step), DistInfo(), encoder=encoder,
                                          optimizer=optimizer, scheduler=scheduler,
                                          scaler=torch.amp.GradScaler("cpu", enabled=False))
    return save


def test_a_checkpoint_is_on_disk_before_older_ones_are_removed(tmp_path, monkeypatch):
    """A power loss right after the rename must find step-4 whole where its name survived, and step-2 (beyond
    --keep-checkpoints 1) removed only once the rename itself is on disk: otherwise no good checkpoint is left."""
    out = str(os.path.realpath(tmp_path))
    save = _checkpoint_saver(out, keep_checkpoints=1)
    older = save(2)
    calls = _disk_calls(monkeypatch)
    newer = save(4)
    parent_synced_at = _synced_before_renamed_in(calls, newer + ".tmp", newer)
    assert calls.index(("remove", older)) > parent_synced_at
    assert checkpoint.finished_checkpoints(out) == [newer]


def test_a_swapped_in_export_is_on_disk_before_the_old_copy_goes(tmp_path, monkeypatch):
    """final/ (and best/) with a subfolder, as a sentence-transformers export has: the new copy's every file and
    folder synced before the rename, the output folder after it, and only then the old copy removed."""
    out = os.path.realpath(tmp_path)
    final, tmp = os.path.join(out, "final"), os.path.join(out, "final.tmp")
    for folder, text in ((final, "old"), (tmp, "new")):
        os.makedirs(os.path.join(folder, "1_Pooling"))
        for name in ("model.safetensors", os.path.join("1_Pooling", "config.json")):
            with open(os.path.join(folder, name), "w") as f:
                f.write(text)
    calls = _disk_calls(monkeypatch)
    checkpoint._swap_in(tmp, final)
    parent_synced_at = _synced_before_renamed_in(calls, tmp, final)
    assert calls.index(("remove", final + ".old")) > parent_synced_at
    with open(os.path.join(final, "1_Pooling", "config.json")) as f:
        assert f.read() == "new"


def test_a_checkpoint_whose_rename_cannot_be_synced_is_reported_in_place(tmp_path, monkeypatch):
    """An I/O error syncing the output's checkpoints/ folder after step-4's rename: step-4 is whole and in place (its
    files were synced), so the error says so, rather than that its write failed and that it is the "previous"
    checkpoint, and step-2 stays until the rename is known to be on disk."""
    out = str(os.path.realpath(tmp_path))
    save = _checkpoint_saver(out, keep_checkpoints=1)
    older = save(2)
    newer = checkpoint.checkpoint_path(out, 4)

    def io_error(folder):
        raise OSError(errno.EIO, os.strerror(errno.EIO))
    monkeypatch.setattr(checkpoint, "sync_folder", io_error)
    with pytest.raises(OSError, match=rf"^\[Errno {errno.EIO}\] {newer} is written and in place, but its rename "
                                      r"could not be synced to disk \(Input/output error\): a power loss may still "
                                      r"undo it, and nothing older was removed$"):
        save(4)
    assert checkpoint.finished_checkpoints(out) == [older, newer]
    assert checkpoint.checkpoint_problem(newer) is None


def test_an_export_whose_files_cannot_be_synced_leaves_the_previous_one_and_no_tmp(tmp_path, monkeypatch):
    """final/ (as best/) written as final.tmp: a sync of its files that fails (ENOSPC found at write-back) fails the
    export as a write does, leaving the previous final/ and no final.tmp beside it."""
    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, layers=1)
    cfg = run_config(tmp_path)
    final = checkpoint.save_final(cfg, encoder, tokenizer, base_model=None)
    before = {name: (tmp_path / "final" / name).read_bytes() for name in os.listdir(final)
              if os.path.isfile(os.path.join(final, name))}

    def no_space(folder):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(checkpoint, "sync_tree", no_space)
    with pytest.raises(OSError, match="No space left on device"):
        checkpoint.save_final(cfg, encoder, tokenizer, base_model=None)
    assert sorted(os.listdir(tmp_path)) == ["final"]
    assert {name: (tmp_path / "final" / name).read_bytes() for name in before} == before


def test_a_tree_is_synced_by_its_regular_files_only(tmp_path, monkeypatch):
    """A FIFO (whose open for reading waits for a writer: the save hung), a socket or a link in a folder written whole
    is not opened to be synced: its entry is synced with its folder."""
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "model.safetensors").write_text("weights")
    os.mkfifo(tmp_path / "sub" / "pipe")
    os.symlink("model.safetensors", tmp_path / "sub" / "link")
    os.symlink("sub", tmp_path / "folder-link")
    synced_files = []
    monkeypatch.setattr(atomic_files, "_sync_file", lambda path: synced_files.append(os.path.relpath(path, tmp_path)))
    kinds = _synced_kinds(monkeypatch)
    atomic_files.sync_tree(str(tmp_path))
    assert synced_files == [os.path.join("sub", "model.safetensors")] and kinds == ["folder", "folder"]


def test_a_subfolder_that_cannot_be_listed_fails_the_sync_of_its_tree(tmp_path, monkeypatch):
    """Its files cannot be synced: an error, not a tree reported synced with them skipped."""
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text("{}")
    scandir = os.scandir

    def unreadable(path="."):
        if os.path.basename(path) == "1_Pooling":
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return scandir(path)
    monkeypatch.setattr(os, "scandir", unreadable)
    with pytest.raises(PermissionError, match="1_Pooling"):
        atomic_files.sync_tree(str(tmp_path))


def test_a_best_kept_for_a_checkpoint_is_on_disk_before_best_is_replaced(tmp_path, monkeypatch):
    out = os.path.realpath(tmp_path)
    os.makedirs(checkpoint.checkpoint_path(out, 4))
    _best(os.path.join(out, "best"), {"step": 4, "dev_spearman": 0.5})
    calls = _disk_calls(monkeypatch)
    checkpoint._keep_best_of_checkpoints(out)
    kept = checkpoint.kept_best_path(out, 4)
    assert calls == [("rename", os.path.join(out, "best"), kept), ("sync", os.path.dirname(kept))]


def _synced_folders(calls: list) -> set[str]:
    return {path for kind, path, *_ in calls if kind == "sync" and os.path.isdir(path)}


def test_a_made_folder_is_on_disk_in_its_parent(tmp_path, monkeypatch):
    """Each folder created has its entry synced (its parent's sync), and a folder already there costs no sync."""
    root = os.path.realpath(tmp_path)
    calls = _disk_calls(monkeypatch)
    atomic_files.made_folder(os.path.join(root, "set-aside", "after-step-00000002", "checkpoints"))
    made = os.path.join(root, "set-aside", "after-step-00000002")
    assert calls == [("sync", made), ("sync", os.path.dirname(made)), ("sync", root)]
    calls.clear()
    atomic_files.made_folder(made)
    assert calls == []


def test_the_first_checkpoint_makes_its_checkpoints_folder_durable(tmp_path, monkeypatch):
    """checkpoints/ is created with the first checkpoint: its entry in the output folder is on disk before the
    checkpoint is renamed into it, or a power loss could leave no checkpoints/ (and so none to resume from)."""
    out = str(os.path.realpath(tmp_path))
    save = _checkpoint_saver(out, keep_checkpoints=2)
    calls = _disk_calls(monkeypatch)
    first = save(2)
    assert calls.index(("sync", out)) < calls.index(("rename", first + ".tmp", first))
    calls.clear()
    save(4)
    assert ("sync", out) not in calls  # checkpoints/ is there: only the renames into it are synced


def test_a_line_set_aside_is_on_disk_where_it_moved(tmp_path, monkeypatch):
    """A resume from step 2 moves step-4, final/ and the rows of step 4 into set-aside/after-step-00000002/: the
    folders that lost or gained an entry and the rows' file are synced, so that a power loss neither brings the left
    line back beside the resumed one nor loses it."""
    out = str(os.path.realpath(tmp_path))
    for name in ("checkpoints/step-00000002", "checkpoints/step-00000004", "final"):
        os.makedirs(os.path.join(out, name))
    with open(os.path.join(out, "metrics.jsonl"), "w") as f:
        f.write('{"step": 2, "loss": 1.0}\n{"step": 4, "loss": 0.5}\n')
    calls = _disk_calls(monkeypatch)
    folder = checkpoint.set_aside_later_line(out, 2)
    assert folder == os.path.join(out, "set-aside", "after-step-00000002")
    assert sorted(os.listdir(folder)) == ["checkpoints", "final", "metrics.jsonl"]
    assert {out, os.path.join(out, "checkpoints"), os.path.join(out, "set-aside"), folder,
            os.path.join(folder, "checkpoints")} <= _synced_folders(calls)
    assert ("sync", os.path.join(folder, "metrics.jsonl.tmp")) in calls  # its rows' contents, before the rename
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        assert f.read() == '{"step": 4, "loss": 0.5}\n'


def test_an_overwritten_run_is_deleted_on_disk(tmp_path, monkeypatch):
    """--overwrite 1: the output folder is synced once everything of the earlier run is removed, and what is no
    run's output stays."""
    out = str(os.path.realpath(tmp_path))
    for name in ("checkpoints/step-00000002", "best", "final.tmp"):
        os.makedirs(os.path.join(out, name))
    for name in ("metrics.jsonl", "notes.txt"):
        with open(os.path.join(out, name), "w") as f:
            f.write("{}\n")
    calls = _disk_calls(monkeypatch)
    checkpoint.remove_earlier_run(out)
    assert os.listdir(out) == ["notes.txt"]
    assert calls[-1] == ("sync", out) and calls.count(("sync", out)) == 1


def test_an_empty_metrics_file_is_no_earlier_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    assert checkpoint.earlier_run_outputs(str(tmp_path)) == []


def _synced_kinds(monkeypatch, fails_for=None) -> list[str]:
    """The kinds ("file", "folder") of what os.fsync is asked to sync from now on, in order; an OSError (errno,
    message) `fails_for[kind]` is raised for that kind once recorded."""
    kinds, fsync = [], os.fsync

    def recorded(fd):
        kind = "folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        kinds.append(kind)
        if fails_for and kind in fails_for:
            raise OSError(*fails_for[kind])
        fsync(fd)

    monkeypatch.setattr(os, "fsync", recorded)
    return kinds


def test_a_file_written_aside_is_synced_then_swapped_in(tmp_path, monkeypatch):
    path = tmp_path / "stopped-non-finite.json"
    path.write_text("old")
    kinds = _synced_kinds(monkeypatch)
    with atomic_files.written_aside(str(path)) as f:
        f.write("new")
        assert sorted(os.listdir(tmp_path)) == ["stopped-non-finite.json", "stopped-non-finite.json.tmp"]
        assert path.read_text() == "old"  # until the block ends
    assert path.read_text() == "new" and os.listdir(tmp_path) == ["stopped-non-finite.json"]
    assert kinds == ["file", "folder"]  # the contents, then the rename, reach the disk


def test_a_folder_that_cannot_be_synced_leaves_the_write_in_place(tmp_path, monkeypatch):
    """A file system without fsync of a folder (EINVAL) still gets the file: the rename is as durable as it gets
    there, and the write is not reported as failed."""
    _synced_kinds(monkeypatch, fails_for={"folder": (22, "Invalid argument")})
    with atomic_files.written_aside(str(tmp_path / "f.json"), aside=str(tmp_path / "f.json.mine")) as f:
        f.write("new")
    assert (tmp_path / "f.json").read_text() == "new" and os.listdir(tmp_path) == ["f.json"]


@pytest.mark.parametrize("binary", [False, True])
@pytest.mark.parametrize("before", ["old", None])
def test_a_write_aside_that_raises_leaves_the_previous_file_and_nothing_else(tmp_path, before, binary):
    path = tmp_path / "metrics.jsonl"
    if before is not None:
        path.write_text(before)
    failure = ValueError("not JSON")
    with pytest.raises(ValueError) as raised:
        with atomic_files.written_aside(str(path), binary=binary) as f:
            f.write(b"half a fi" if binary else "half a fi")
            raise failure
    assert raised.value is failure
    assert os.listdir(tmp_path) == ([] if before is None else ["metrics.jsonl"])
    assert before is None or path.read_text() == before


def test_a_binary_file_written_aside_holds_the_bytes_written(tmp_path):
    path = tmp_path / "curves.png"
    path.write_bytes(b"old")
    with atomic_files.written_aside(str(path), binary=True) as f:
        f.write(b"\x89PNG\r\n\x1a\n")
    assert path.read_bytes() == b"\x89PNG\r\n\x1a\n" and os.listdir(tmp_path) == ["curves.png"]


def test_a_link_written_aside_is_written_through(tmp_path):
    """angle-eval --json results.json where results.json links into a shared folder: the target gets the new results
    and the link stays (the link was replaced by a file, and the target read by a pipeline kept the old results)."""
    (tmp_path / "shared").mkdir()
    target, link = tmp_path / "shared" / "scores.json", tmp_path / "results.json"
    target.write_text("old")
    os.symlink(os.path.join("shared", "scores.json"), link)
    with atomic_files.written_aside(str(link)) as f:
        f.write("new")
    assert os.path.islink(link) and target.read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["results.json", "shared"] and os.listdir(target.parent) == ["scores.json"]


def test_a_link_left_as_the_aside_file_is_not_written_through(tmp_path):
    """A NAME.tmp already there (a killed write's, here a link) is replaced: the new contents never reach the file
    it links to, and NAME becomes a file, not that link."""
    other, path = tmp_path / "other.json", tmp_path / "results.json"
    other.write_text("kept")
    os.symlink("other.json", tmp_path / "results.json.tmp")
    with atomic_files.written_aside(str(path)) as f:
        f.write("new")
    assert other.read_text() == "kept" and not os.path.islink(path) and path.read_text() == "new"
    assert sorted(os.listdir(tmp_path)) == ["other.json", "results.json"]


@pytest.fixture
def umask_022():
    previous = os.umask(0o022)
    yield
    os.umask(previous)


@pytest.mark.parametrize("mode", [0o600, 0o640, 0o444])
def test_a_file_written_aside_keeps_its_permissions(tmp_path, umask_022, mode):
    """A file made private (`chmod 600 config.json`, an angle-eval --json file) stays private when it is written
    again: the file renamed over it had the umask's mode (0o644 here), readable by everyone. A new file gets the
    umask's mode."""
    path = tmp_path / "results.json"
    path.write_text("old")
    os.chmod(path, mode)
    with atomic_files.written_aside(str(path)) as f:
        f.write("new")
    assert path.read_text() == "new" and stat.S_IMODE(os.stat(path).st_mode) == mode
    with atomic_files.written_aside(str(tmp_path / "new.json")) as f:
        f.write("new")
    assert stat.S_IMODE(os.stat(tmp_path / "new.json").st_mode) == 0o644


def test_settings_that_fail_to_be_written_leave_the_runs_config_json(tmp_path, monkeypatch):
    """A start or resume that cannot write config.json (a full disk midway) leaves the settings that were there, which
    --config and the check of a run's folder (not a model: its models are in final/ and best/) read back, and no
    config.json.tmp."""
    earlier = json.dumps({"output_dir": str(tmp_path), "train_data": "pairs.jsonl", "lr": 2e-5}, indent=2)
    (tmp_path / "config.json").write_text(earlier)
    full_disk_midway(monkeypatch, json, "dump")
    with pytest.raises(OSError, match="No space left on device"):
        trainer.RunLog(run_config(tmp_path), True, torch.device("cpu"), total_steps=4, start_step=2)
    assert (tmp_path / "config.json").read_text() == earlier
    assert os.listdir(tmp_path) == ["config.json"]


def test_a_non_finite_stop_record_that_fails_to_serialise_leaves_the_previous_one(tmp_path):
    out = str(tmp_path)
    checkpoint.record_non_finite_stop(out, 5, checkpoint.checkpoint_path(out, 2))
    before = (tmp_path / checkpoint.NON_FINITE_STOP).read_text()
    with pytest.raises(TypeError, match="not JSON serializable"):
        checkpoint.record_non_finite_stop(out, {5}, None)  # json.dump raises midway, after '{"step": '
    assert (tmp_path / checkpoint.NON_FINITE_STOP).read_text() == before
    assert os.listdir(tmp_path) == [checkpoint.NON_FINITE_STOP]


def test_a_lock_taken_over_that_cannot_be_written_stays_as_it_was(tmp_path, monkeypatch):
    """A take-over whose record cannot reach the disk (an I/O error) leaves the lock that was there, and none of
    the new record's file beside it."""
    left = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": "then"})  # this process's
    (tmp_path / run_lock.LOCK_FILE).write_text(left)
    _synced_kinds(monkeypatch, fails_for={"file": (5, "Input/output error")})
    with pytest.raises(OSError, match="Input/output error"):
        run_lock.acquire(str(tmp_path))
    assert os.listdir(tmp_path) == [run_lock.LOCK_FILE]
    assert (tmp_path / run_lock.LOCK_FILE).read_text() == left


def test_a_lock_taken_over_whose_rename_cannot_be_synced_is_not_kept(tmp_path, monkeypatch):
    """An I/O error syncing the folder after the new record was renamed over the gone run's lock: the run does not
    start, so it holds no lock (its record removed), and the error is raised."""
    left = json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": "then"})  # this process's
    (tmp_path / run_lock.LOCK_FILE).write_text(left)
    _synced_kinds(monkeypatch, fails_for={"folder": (errno.EIO, "Input/output error")})
    with pytest.raises(OSError, match="Input/output error"):
        run_lock.acquire(str(tmp_path))
    assert os.listdir(tmp_path) == []


def test_the_output_folder_a_run_creates_is_on_disk_in_its_parent(tmp_path, monkeypatch):
    """The run's files are synced into its output folder: the folder's own entry, and that of a parent made with
    it, are synced too, or a power loss could lose the folder with all of them."""
    root = os.path.realpath(tmp_path)
    out = os.path.join(root, "runs", "first")
    calls = _disk_calls(monkeypatch)
    run_lock.acquire(out).release()
    assert calls[:2] == [("sync", os.path.join(root, "runs")), ("sync", root)]


def test_a_runs_start_removes_the_files_killed_writes_left(tmp_path):
    """NAME.tmp beside a file the run replaces whole, and the record of a killed take-over of the lock, are removed
    when a run starts in the folder; a link or a folder of such a name, and any other file, stay."""
    out = tmp_path / "run"
    out.mkdir()
    for name in ("metrics.jsonl.tmp", "profile.json.tmp", f"{checkpoint.NON_FINITE_STOP}.tmp", "notes.tmp",
                 f"{run_lock.LOCK_FILE}.{'0' * 32}", f"{run_lock.LOCK_FILE}.backup"):
        (out / name).write_text("{")
    os.symlink("notes.tmp", out / "curves.png.tmp")
    (out / "best.tmp").mkdir()
    cfg = run_config(out, batch_size=4, max_steps=1, max_length=12)
    run = trainer.setup(cfg, model=make_encoder("bert", layers=1), train_examples=(demo_examples(8, seed=4), "B"))
    run.data_ahead.close()
    run.log.close()
    run.lock.release()
    assert sorted(os.listdir(out)) == sorted([f"{run_lock.LOCK_FILE}.backup", "best.tmp", "config.json",
                                              "curves.png.tmp", "notes.tmp"])


def _moves_across_file_systems(monkeypatch, calls: list) -> None:
    """os.rename and os.replace fail with EXDEV, as between two file systems, for all but a NAME.tmp (a copy staged
    beside its place, or a file written aside); each rename made is recorded in `calls`."""
    rename = os.rename

    def renamed(source, destination):
        if not str(source).endswith(".tmp"):
            raise OSError(errno.EXDEV, "Invalid cross-device link", source)
        calls.append(("rename", os.path.realpath(source), os.path.realpath(destination)))
        rename(source, destination)

    monkeypatch.setattr(os, "rename", renamed)
    monkeypatch.setattr(os, "replace", renamed)


def test_a_line_set_aside_on_another_file_system_is_on_disk_before_its_source_goes(tmp_path, monkeypatch):
    """set-aside/ on another disk: each checkpoint moved there is copied whole, synced and renamed into place, its
    folder synced, before the original is deleted (a copy and delete had deleted it with the copy in memory only)."""
    out = str(os.path.realpath(tmp_path))
    for step in (2, 4):
        os.makedirs(checkpoint.checkpoint_path(out, step))
        with open(os.path.join(checkpoint.checkpoint_path(out, step), "state.pt"), "w") as f:
            f.write("weights")
    calls = _disk_calls(monkeypatch)
    _moves_across_file_systems(monkeypatch, calls)
    folder = checkpoint.set_aside_later_line(out, 2)
    source = checkpoint.checkpoint_path(out, 4)
    moved = os.path.join(folder, "checkpoints", os.path.basename(source))
    synced_in_place = _synced_before_renamed_in(calls, moved + ".tmp", moved)
    assert synced_in_place < calls.index(("remove", source)) < calls.index(("sync", os.path.dirname(source)))
    with open(os.path.join(moved, "state.pt")) as f:
        assert f.read() == "weights"
    assert os.listdir(os.path.join(out, "checkpoints")) == ["step-00000002"]
    assert os.listdir(os.path.join(folder, "checkpoints")) == ["step-00000004"]


def test_a_move_to_another_file_system_that_fails_keeps_its_source(tmp_path, monkeypatch):
    """A copy to another disk that fails (a full disk while syncing it) leaves the source and nothing at, or
    beside, the destination; the error is raised."""
    source = tmp_path / "best"
    source.mkdir()
    (source / "model.safetensors").write_text("weights")
    _moves_across_file_systems(monkeypatch, [])
    _synced_kinds(monkeypatch, fails_for={"file": (errno.ENOSPC, "No space left on device")})
    with pytest.raises(OSError, match="No space left"):
        atomic_files.move_durably(str(source), str(tmp_path / "kept"))
    assert os.listdir(tmp_path) == ["best"] and (source / "model.safetensors").read_text() == "weights"
