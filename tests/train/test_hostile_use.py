"""angle-train and angle-eval under hostile use: two runs into one folder, settings changed on resume, model folders
that are not what they seem (a run's folder, damaged metadata or weights, no tokenizer files), --max-length and
--device that cannot be honoured, corrupt metrics.jsonl lines, a wandb that would wait, --overwrite refused late,
CPU out-of-memory with --auto-chunk, a signal after the final export. Nothing is lost and nothing is silent: each
ends in one line naming the flag or file, a warning, or a run that does what it says. In-process, tiny models."""

import dataclasses
import errno
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import types

import pytest
import torch
from test_cli_errors import assert_one_line_error, run, write_stsb
from train_helpers import make_encoder, run_config

from angle_train import checkpoint, distributed, tracking
from angle_train.export import save_pretrained
from angle_train.tiny import demo_examples
from angle_train.trainer import StopTraining, setup, train

DATA = (demo_examples(20, seed=3), "B")
LOCK_FILE = ".angle-train.lock"  # run_lock.LOCK_FILE, the name the docs give
# a one-step angle-train run on the built-in model and data: what each refusal below would otherwise have run
QUICK = ["--device", "cpu", "--progress", "0", "--max-steps", "1", "--batch-size", "8", "--max-length", "12",
         "--save-final", "0"]


def _config(out, **overrides):
    base = {"batch_size": 8, "max_steps": 4, "lr": 3e-3, "warmup": 1, "save_every": 2, "keep_checkpoints": 2,
            "log_every": 1, "max_length": 12, "seed": 7}
    return run_config(out, **{**base, **overrides})


def _lock(folder, *, host=None, pid):
    folder.mkdir(parents=True, exist_ok=True)
    record = {"host": host or socket.gethostname(), "pid": pid, "started": "2026-01-01 00:00:00"}
    (folder / LOCK_FILE).write_text(json.dumps(record))


def assert_last_line_error(program: str, status: int, err: str, said: str) -> None:
    """A mistake found once the model is loaded: status 2 and the error as stderr's last line (transformers' loading
    bars and the run's notes come before it)."""
    assert status == 2, err
    assert err.splitlines()[-1].startswith(f"{program}: error: ") and said in err.splitlines()[-1], err


def _dead_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


# ------------------------------------------------------------------------------------------ one run per folder
def test_a_folder_in_use_by_another_run_is_refused_before_anything_is_written(tmp_path, capsys):
    out = tmp_path / "run"
    _lock(out, pid=os.getppid())  # a live process of this host: the run that holds the folder
    status, stdout, stderr = run("angle-train", ["--output-dir", str(out), *QUICK], capsys)
    assert_one_line_error("angle-train", status, stdout, stderr, f"--output-dir {out} is in use by another run "
                          f"(process {os.getppid()} on this host, since 2026-01-01 00:00:00)")
    assert sorted(os.listdir(out)) == [LOCK_FILE]


def test_a_run_holding_the_folder_in_another_process_refuses_the_second(tmp_path, capsys):
    """Two processes: one takes the folder's lock as a run does (run_lock.acquire) and keeps running; angle-train
    into the same folder is refused naming it, and writes nothing."""
    out = tmp_path / "run"
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from angle_train import run_lock; "
                               "run_lock.acquire(sys.argv[1]); print('held', flush=True); time.sleep(120)", str(out)],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        status, stdout, stderr = run("angle-train", ["--output-dir", str(out), *QUICK], capsys)
        assert_one_line_error("angle-train", status, stdout, stderr, f"--output-dir {out} is in use by another run "
                              f"(process {holder.pid} on this host")
        assert sorted(os.listdir(out)) == [LOCK_FILE]
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.parametrize("pid_here", ["alive", "dead"])
def test_a_lock_from_another_host_is_never_broken(tmp_path, capsys, pid_here):
    """Whether a process of that number runs on this host says nothing about the run on the other one."""
    out = tmp_path / "run"
    _lock(out, host="node-17", pid=os.getpid() if pid_here == "alive" else _dead_pid())
    status, stdout, stderr = run("angle-train", ["--output-dir", str(out), *QUICK], capsys)
    assert_one_line_error("angle-train", status, stdout, stderr, "process")
    assert "on host node-17" in stderr and f"remove {out / LOCK_FILE} once that run is gone" in stderr
    assert sorted(os.listdir(out)) == [LOCK_FILE]


def test_a_stale_lock_of_this_host_is_taken_over_with_a_warning(tmp_path, capsys):
    out = tmp_path / "run"
    gone = _dead_pid()
    _lock(out, pid=gone)
    train(_config(out, max_steps=1, save_every=0), train_examples=DATA)
    err = capsys.readouterr().err
    assert f"warning: taking over the lock of a run that is gone (process {gone} on {socket.gethostname()}" in err
    assert (out / "metrics.jsonl").exists() and not (out / LOCK_FILE).exists()  # released at the end


@pytest.mark.parametrize("folder_made_before", [False, True])
def test_the_lock_is_released_when_a_start_is_refused(tmp_path, folder_made_before):
    """The folder a refused run created for its lock, empty again, is gone too; an empty one the user made stays."""
    if folder_made_before:
        (tmp_path / "run").mkdir()
    with pytest.raises(ValueError, match="--batch-size 1 with format B"):
        train(_config(tmp_path / "run", batch_size=1), train_examples=DATA)
    assert (tmp_path / "run").exists() == folder_made_before
    assert not folder_made_before or os.listdir(tmp_path / "run") == []


def test_only_the_main_process_of_a_job_takes_the_lock(monkeypatch):
    # a RANK left in the environment of a single process (no WORLD_SIZE, or 1) is no job's rank: it takes the lock
    for env, rank in (({}, 0), ({"WORLD_SIZE": "2", "RANK": "1"}, 1), ({"WORLD_SIZE": "2", "RANK": "0"}, 0),
                      ({"RANK": "1"}, 0), ({"WORLD_SIZE": "1", "RANK": "1"}, 0)):
        for name in ("WORLD_SIZE", "RANK"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        assert distributed.launched_rank() == rank


# ------------------------------------------------------------------------------------------------------ resume
def test_resume_applies_changed_optimizer_settings_from_the_resumed_step(tmp_path, capsys):
    """--lr, --weight-decay and --schedule changed on resume take effect from the resumed step: the learning rate
    is the one the new settings' schedule gives there (as a run with them from the start has it), and config.json
    records what is in force."""
    train(_config(tmp_path / "run"), train_examples=DATA, on_step=lambda step, row: step == 2 and _stop())
    new = {"lr": 1e-3, "weight_decay": 0.2, "schedule": "constant"}
    fresh = train(_config(tmp_path / "fresh", **new), train_examples=DATA)
    capsys.readouterr()
    resumed = train(_config(tmp_path / "run", resume="auto", **new), train_examples=DATA)
    assert [r["step"] for r in resumed.history] == [3, 4]
    assert [r["lr"] for r in resumed.history] == [r["lr"] for r in fresh.history[2:]] == [1e-3, 1e-3]
    assert "resuming with changed settings (--lr 0.003 -> 0.001, --weight-decay 0.01 -> 0.2, --schedule 'linear' " \
           "-> 'constant')" in capsys.readouterr().out
    assert {k: v for k, v in json.loads((tmp_path / "run" / "config.json").read_text()).items() if k in new} == new
    run = setup(_config(tmp_path / "run", resume="auto", **new), train_examples=DATA)
    run.log.close()
    assert [g["weight_decay"] for g in run.optimizer.param_groups] == [0.2, 0.0]


def test_resume_applies_a_changed_warmup_and_gradient_clipping(tmp_path, capsys):
    """--warmup changed on resume: the learning rate at the resumed steps is the new schedule's (still warming up
    at step 3 of 4); --max-grad-norm is read at every step; both are what config.json records."""
    train(_config(tmp_path / "run"), train_examples=DATA, on_step=lambda step, row: step == 2 and _stop())
    new = {"warmup": 4, "max_grad_norm": 0.5}
    fresh = train(_config(tmp_path / "fresh", **new), train_examples=DATA)
    capsys.readouterr()
    resumed = train(_config(tmp_path / "run", resume="auto", **new), train_examples=DATA)
    assert [r["lr"] for r in resumed.history] == [r["lr"] for r in fresh.history[2:]]
    assert resumed.history[0]["lr"] < 3e-3  # in the new warmup, where the old schedule had reached its peak
    assert "(--warmup 1.0 -> 4.0, --max-grad-norm 1.0 -> 0.5)" in capsys.readouterr().out
    recorded = json.loads((tmp_path / "run" / "config.json").read_text())
    assert {k: recorded[k] for k in new} == new


def test_a_checkpoint_recording_the_default_epochs_with_max_steps_changed_no_setting(tmp_path):
    """A checkpoint written when --epochs not given was recorded as its default (1.0) resumes a run with the same
    --max-steps and no --epochs (None now) without a changed --epochs: the same run length, nothing to say; a given
    --epochs that differs still is one."""
    cfg = _config(tmp_path / "run")
    cfg.validate()
    assert cfg.epochs is None
    recorded = {**dataclasses.asdict(cfg), "epochs": 1.0}
    assert checkpoint._changed_optimizer_settings(recorded, cfg) == {}
    assert checkpoint._changed_optimizer_settings({**recorded, "epochs": 3.0}, cfg) == {"epochs": (3.0, None)}


def test_a_resume_says_a_setting_left_out_is_not_given(tmp_path, capsys):
    """--epochs given beside --max-steps, then left out on resume: the changed-settings line says "not given", not
    Python's None."""
    train(_config(tmp_path / "run", epochs=2.0), train_examples=DATA, on_step=lambda step, row: step == 2 and _stop())
    capsys.readouterr()
    train(_config(tmp_path / "run", resume="auto"), train_examples=DATA)
    assert "resuming with changed settings (--epochs 2.0 -> not given)" in capsys.readouterr().out


def _stop():
    raise StopTraining


# --------------------------------------------------------------------------------------------- model folders
@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """A random tiny BERT exported as angle-train exports it (128 positions), and an STS-B file."""
    folder = tmp_path_factory.mktemp("hostile")
    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    save_pretrained(encoder, tokenizer, str(folder / "model"), max_length=16)
    return folder / "model", write_stsb(folder / "sts-test.csv")


def _copy(export, tmp_path, name="model"):
    return shutil.copytree(export[0], tmp_path / name)


def _damage(folder, how: str) -> str:
    """Damage an export as `how` says; the flag's value then (the folder, or the run folder holding it)."""
    if how == "run folder":
        run_dir = folder.parent / "run"
        run_dir.mkdir()
        (run_dir / "config.json").write_text(json.dumps({"output_dir": str(run_dir), "train_data": "x.jsonl"}))
        folder.rename(run_dir / "final")
        return str(run_dir)
    if how == "meta not JSON":
        (folder / "angle_train.json").write_text('{"pooling": "avg",')
    elif how == "meta a list":
        (folder / "angle_train.json").write_text("[1, 2]")
    elif how == "weights truncated":
        weights = folder / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:2000])
    elif how == "no tokenizer files":
        for name in ("tokenizer.json", "tokenizer_config.json"):
            (folder / name).unlink()
    elif how == "modules not JSON":
        (folder / "modules.json").write_text('[{"idx": 0,')
    elif how == "pooling config a list":
        (folder / "1_Pooling" / "config.json").write_text("[true]")
    return str(folder)


DAMAGE = {"run folder": "is an angle-train run's output folder, not a model: its model is in {}",
          "meta not JSON": "angle_train.json is damaged (not valid JSON",
          "meta a list": "angle_train.json is damaged (a JSON list, not an object)",
          "weights truncated": "the weights file {}/model.safetensors is damaged",
          "no tokenizer files": "no tokenizer files (tokenizer.json, vocab.txt",
          # the sentence-transformers files, read for the folder's pooling and by an export from it
          "modules not JSON": "modules.json is damaged (not valid JSON",
          "pooling config a list": "1_Pooling/config.json is damaged (a JSON list, not an object)"}


@pytest.mark.parametrize("how", list(DAMAGE))
@pytest.mark.parametrize("program", ["angle-eval", "angle-train"])
def test_model_folders_are_checked_before_use(program, how, export, tmp_path, capsys):
    model = _damage(_copy(export, tmp_path), how)
    said = DAMAGE[how].format(os.path.join(model, "final") if how == "run folder" else model)
    argv = ([model, str(export[1])] if program == "angle-eval" else
            ["--model", model, "--output-dir", str(tmp_path / "out"), *QUICK])
    status, out, err = run(program, argv, capsys)
    assert_one_line_error(program, status, out, err, said)
    assert f"{'MODEL' if program == 'angle-eval' else '--model'} {model}" in err  # the flag and the folder


def test_max_length_below_the_special_tokens_is_refused(tmp_path, capsys):
    argv = ["--output-dir", str(tmp_path / "out"), *QUICK, "--max-length", "1"]
    status, _, err = run("angle-train", argv, capsys)
    assert_last_line_error("angle-train", status, err, "--max-length 1 leaves no room for text: the tokenizer of "
                           "builtin:tiny-bert adds 2 special token(s) to every text; use --max-length 3 or more")


@pytest.mark.parametrize("length, said", [
    ("200", "--max-length 200 is longer than {} can read: its position table holds 128 positions; use --max-length "
            "128 or less"),
    ("1", "--max-length 1 leaves no room for text: the tokenizer of {} adds 2 special token(s) to every text"),
], ids=["past_the_positions", "below_the_special_tokens"])
def test_angle_eval_checks_the_max_length_before_encoding(length, said, export, capsys, monkeypatch):
    from angle_train import models

    encoded = []
    monkeypatch.setattr(models.Encoder, "encode", lambda *args, **kwargs: encoded.append(1))
    argv = [str(export[0]), str(export[1]), "--max-length", length]
    status, _, err = run("angle-eval", argv, capsys)
    assert_last_line_error("angle-eval", status, err, said.format(export[0]))
    assert encoded == []


def test_a_max_length_past_a_rotary_models_trained_context_is_noted(export, tmp_path, capsys):
    """A rotary model (LLaMA: no position table to run out of) reads a --max-length past its config's
    max_position_embeddings without an error, at positions it never saw in training: both commands said nothing.
    Now each notes it in one line and goes on; a length within the trained context says nothing."""
    from angle_train import cli, evaluate

    past = ("--max-length 200 reaches past the 128 tokens {} was trained to read (its config's "
            "max_position_embeddings)")
    argv = ["--output-dir", str(tmp_path / "out"), *QUICK, "--model", "builtin:tiny-llama"]
    assert cli.main([*argv, "--max-length", "200"]) == 0
    out = capsys.readouterr().out
    assert [line for line in out.splitlines() if "reaches past" in line] == [
        "angle_train: note: " + past.format("builtin:tiny-llama") + ": rotary positions run there, but texts longer "
        "than that are read at positions it never saw in training"]
    encoder, tokenizer = make_encoder("llama", dtype=torch.float32)
    model = save_pretrained(encoder, tokenizer, str(tmp_path / "llama"), max_length=16)
    assert evaluate.main([model, str(export[1]), "--max-length", "200"]) == 0
    assert "angle-eval: note: " + past.format(model) in capsys.readouterr().err
    assert evaluate.main([model, str(export[1]), "--max-length", "128"]) == 0
    assert "reaches past" not in capsys.readouterr().err


def test_a_tokenizer_without_its_vocabulary_is_refused(export, tmp_path):
    """A model whose tokenizer files are missing where the folder check cannot see them (a hub model's cache, a
    model given to train()): transformers' stand-in of special tokens alone is told from the embedding table."""
    from transformers import AutoTokenizer

    from angle_train.models import load_encoder

    folder = _copy(export, tmp_path)
    encoder, _ = load_encoder(str(folder))
    _damage(folder, "no tokenizer files")
    stand_in = AutoTokenizer.from_pretrained(str(folder))
    with pytest.raises(ValueError, match=rf"the tokenizer of the model given to train\(\) \({re.escape(str(folder))}\) "
                       rf"has {len(stand_in)} tokens "
                       "for a model of 61 token embeddings"):
        train(_config(tmp_path / "run", max_steps=1), model=(encoder, stand_in), train_examples=DATA)


@pytest.mark.parametrize("device", ["bogus", "cuda", "cuda:7"])
@pytest.mark.parametrize("program", ["angle-eval", "angle-train"])
def test_a_device_this_machine_lacks_is_refused_before_work(program, device, export, tmp_path, capsys):
    if device == "cuda" and torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    if device == "cuda:7" and torch.cuda.device_count() > 7:
        pytest.skip("this machine has 8 CUDA devices")
    argv = ([str(export[0]), str(export[1])] if program == "angle-eval" else
            ["--output-dir", str(tmp_path / "out"), *QUICK])
    status, out, err = run(program, [*argv, "--device", device], capsys)
    assert_one_line_error(program, status, out, err, f"--device {device}: ")
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ corrupt files
def test_corrupt_metrics_lines_are_dropped_with_a_warning_on_resume(tmp_path, capsys):
    out = tmp_path / "run"
    train(_config(out, max_steps=3), train_examples=DATA)
    metrics = out / "metrics.jsonl"
    rows = metrics.read_bytes().splitlines(keepends=True)
    metrics.write_bytes(b"".join([rows[0], b"5\n", b'{"step": "x"}\n', b"\xff\xfe not UTF-8\n", *rows[1:]]))
    capsys.readouterr()
    resumed = train(_config(out, max_steps=3, resume="auto"), train_examples=DATA)
    assert [r["step"] for r in resumed.history] == [3]
    assert f"warning: {metrics}: dropped 3 line(s) that are not metrics rows (line 2, 3, 4)" in capsys.readouterr().err
    assert [json.loads(line)["step"] for line in metrics.read_text().splitlines()] == [1, 2, 3]


def test_a_dev_score_that_is_not_a_number_does_not_stop_the_export(tmp_path):
    """A metrics row whose fields are not numbers (a hand-edited line) is a row all the same (its step is one): the
    final export's model card, which lists the dev scores, leaves it out rather than failing after the last step."""
    out = tmp_path / "run"
    train(_config(out), train_examples=DATA, on_step=lambda step, row: step == 2 and _stop())
    with open(out / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 1, "dev_spearman": "x"}) + "\n")
    result = train(_config(out, resume="auto", save_final=True), train_examples=DATA)
    card = (out / "final" / "README.md").read_text()
    assert result.final_path == str(out / "final") and "4 optimizer steps" in card and "| 1 |" not in card


# ------------------------------------------------------------------------------------------------------ tracking
def test_bad_wandb_mode_is_refused_before_the_model_loads(tmp_path, capsys, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "bogus")
    argv = ["--output-dir", str(tmp_path / "out"), *QUICK, "--report-to", "wandb"]
    assert_one_line_error("angle-train", *run("angle-train", argv, capsys),
                          "WANDB_MODE=bogus is not a mode wandb takes")


def test_wandb_goes_offline_at_once_when_its_server_does_not_answer(monkeypatch, capsys):
    with socket.socket() as s:  # a port nothing listens on: connections are refused
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", f"http://127.0.0.1:{port}")
    start = time.monotonic()
    assert tracking.wandb_mode() == "offline"
    assert time.monotonic() - start < 5
    assert f"wandb server http://127.0.0.1:{port} did not answer" in capsys.readouterr().out


def test_wandb_logs_offline_when_its_online_start_fails(tmp_path, monkeypatch, capsys):
    """A server that accepts the connection and then does not answer: wandb.init, given WANDB_INIT_TIMEOUT_S, fails
    (wandb's errors have no common base), and the run logs offline with a note instead of ending in a traceback."""
    modes = []

    def init(*, mode, **options):
        modes.append(mode)
        if mode != "offline":
            raise TimeoutError(f"run initialization has timed out after {tracking.WANDB_INIT_TIMEOUT_S} sec.")
        return "an offline run"

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init, Settings=dict))
    monkeypatch.setenv("WANDB_MODE", "online")
    monkeypatch.setattr(tracking, "server_answers", lambda url, timeout: True)
    reporter = tracking.WandbReporter(str(tmp_path), {})
    assert modes == ["online", "offline"] and (reporter.mode, reporter.run) == ("offline", "an offline run")
    assert "note: wandb could not start online (TimeoutError: " in capsys.readouterr().out


# ------------------------------------------------------------------------------------ overwrite, memory, signals
@pytest.mark.parametrize("refused, said", [
    ({"batch_size": 1}, "--batch-size 1 with format B"),  # found with the data, before the model loads
    ({"max_length": 1}, "--max-length 1 leaves no room for text"),  # found once the model is loaded
], ids=["data", "model"])
def test_overwrite_removes_the_earlier_run_only_once_the_new_one_passed_its_checks(refused, said, tmp_path):
    out = tmp_path / "run"
    train(_config(out, max_steps=2, save_every=0, save_final=True), train_examples=DATA)
    (out / "curves.png").write_bytes(b"the earlier run's curves")
    (out / "wandb" / "offline-run-1").mkdir(parents=True)
    before = sorted(os.listdir(out))
    with pytest.raises(ValueError, match=said):
        train(_config(out, overwrite=True, **refused), train_examples=DATA)
    assert sorted(os.listdir(out)) == before and (out / "final").is_dir()  # the refused start deleted nothing
    train(_config(out, max_steps=1, save_every=0, overwrite=True), train_examples=DATA)
    assert not (out / "wandb").exists() and not (out / "final").exists()
    assert not (out / "curves.png").exists() or (out / "curves.png").read_bytes() != b"the earlier run's curves"


@pytest.mark.parametrize("overwrite", [False, True])
def test_an_output_dir_that_is_a_model_folder_is_refused_before_anything_is_written(overwrite, tmp_path):
    """--output-dir pointing at a model's folder: the run wrote its settings over the model's config.json (and
    --overwrite deleted it); now refused, the folder untouched. A run's own config.json, and a damaged one (a run's
    write cut short), are the run's to replace."""
    model = save_pretrained(*make_encoder("bert", dtype=torch.float32), str(tmp_path / "model"), max_length=12)
    before = {name: (tmp_path / "model" / name).read_bytes() for name in sorted(os.listdir(model))
              if (tmp_path / "model" / name).is_file()}
    with pytest.raises(ValueError, match="holds a config.json that is not an angle-train run's settings"):
        train(_config(model, max_steps=1, overwrite=overwrite), train_examples=DATA)
    assert {name: (tmp_path / "model" / name).read_bytes() for name in before} == before
    assert sorted(os.listdir(model)) == sorted(os.listdir(tmp_path / "model"))
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "config.json").write_text('{"output_dir": ')
    train(_config(tmp_path / "cut", max_steps=1, save_every=0, overwrite=overwrite), train_examples=DATA)
    train(_config(tmp_path / "cut", max_steps=1, save_every=0, overwrite=True), train_examples=DATA)


def test_auto_chunk_recovers_from_cpu_out_of_memory(tmp_path):
    """The CPU allocator reports a failed allocation as a RuntimeError: --auto-chunk halves the pass as on a GPU."""
    encoder, tokenizer = make_encoder()
    forward, seen = encoder.forward, []

    def limited(input_ids, attention_mask):
        seen.append(input_ids.shape[0])
        if input_ids.shape[0] > 4:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
                               "you tried to allocate 8589934592 bytes. Error code 12 (Cannot allocate memory)")
        return forward(input_ids, attention_mask)

    encoder.forward = limited
    auto = train(_config(tmp_path / "auto", auto_chunk=True, pack=0, max_steps=2, save_every=0),
                 model=(encoder, tokenizer), train_examples=DATA)
    assert seen[:3] == [16, 8, 4] and set(seen[3:]) == {4}
    fixed = train(_config(tmp_path / "fixed", chunk_size=4, pack=0, max_steps=2, save_every=0), model=make_encoder(),
                  train_examples=DATA)
    assert [r["loss"] for r in auto.history] == pytest.approx([r["loss"] for r in fixed.history], rel=1e-9)


def test_a_signal_after_the_final_export_says_the_run_is_complete(tmp_path, capsys, monkeypatch):
    def outside_the_loop(signum, frame):  # where the loop's handlers are not installed, fail the test, not pytest
        raise AssertionError("SIGTERM arrived outside StopSignals")

    def signal_while_drawing(*args, **kwargs):
        signal.raise_signal(signal.SIGTERM)

    monkeypatch.setattr(tracking, "plot_curves", signal_while_drawing)
    previous = signal.signal(signal.SIGTERM, outside_the_loop)
    try:
        result = train(_config(tmp_path, max_steps=2, save_every=0, save_final=True), train_examples=DATA)
    finally:
        signal.signal(signal.SIGTERM, previous)
    out = capsys.readouterr().out
    assert f"SIGTERM: the run is complete (final model: {tmp_path / 'final'}); nothing left to checkpoint" in out
    assert "writing a checkpoint" not in out and result.final_path == str(tmp_path / "final")


def test_a_full_disk_at_the_curves_leaves_a_finished_run_finished(tmp_path, capsys, monkeypatch):
    """curves.png is drawn after final/ is in place: a write that fails there (a full disk) is a note, not an error
    turning a finished run into a failed one (its models and metrics.jsonl are written)."""
    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tracking, "plot_curves", disk_full)
    result = train(_config(tmp_path, max_steps=2, save_every=0, save_final=True), train_examples=DATA)
    assert result.final_path == str(tmp_path / "final") and result.curves_path is None
    assert "note: no curves.png (No space left on device)" in capsys.readouterr().out
