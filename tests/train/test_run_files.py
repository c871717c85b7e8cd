"""The files a run keeps safe, at their edges: the output folder's lock (a stale lock whose pid was reused is taken
over; a run's release never removes another run's lock; a lock file without its host is refused in one line), and
the checkpoints' bookkeeping (a kept best of a checkpoint's own step stays; a damaged last good checkpoint is passed
over after a non-finite stop; a manifest must cover the state file; a swap of final/ or best/ that fails midway
leaves a whole copy; an empty metrics.jsonl is no earlier run)."""

from __future__ import annotations

import json
import os
import socket

import pytest

from angle_train import checkpoint, run_lock


def test_a_stale_lock_whose_pid_was_reused_is_taken_over(tmp_path, capsys):
    with open(tmp_path / run_lock.LOCK_FILE, "w") as f:  # a live pid of this host, recorded with another start
        json.dump({"host": socket.gethostname(), "pid": os.getppid(), "process_start": "1", "started": "then"}, f)
    lock = run_lock.acquire(str(tmp_path))
    assert "taking over the lock of a run that is gone" in capsys.readouterr().err
    lock.release()


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


def test_an_empty_metrics_file_is_no_earlier_run(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    assert checkpoint.earlier_run_outputs(str(tmp_path)) == []
