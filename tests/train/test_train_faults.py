"""Training faults other than damaged checkpoints (those: test_checkpoint_faults.py): a non-finite step is skipped
and leaves everything as it was, too many in a row stop the run naming the last good checkpoint (which pruning
keeps), no checkpoint holds a non-finite weight, SIGTERM finishes the step and writes a checkpoint from which resume
is bit-identical, a second signal stops at once, out of memory names what to change and --auto-chunk retries with
half the chunk. Every process agrees under DDP (2 gloo processes)."""

import contextlib
import copy
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from train_helpers import free_port, make_encoder, rank_of_a_job, run_config, without_curves

from angle_kernels import AngleLoss
from angle_kernels.testing.helpers import start_ranks
from angle_train import faults
from angle_train.checkpoint import checkpoint_problem, finished_checkpoints, save_checkpoint
from angle_train import tracking
from angle_train.tracking import CURVES_METADATA_KEY, DEV_METRICS
from angle_train.tiny import demo_examples
from angle_train.trainer import optimizer_step, setup, train

DATA = (demo_examples(32, seed=4), "B")
REPO = Path(__file__).resolve().parents[2]


# the tests whose claims include what curves.png shows; the others' runs draw none (train_helpers.without_curves)
DRAWING_CURVES = ("test_a_row_of_skipped_steps_is_written_as_strict_json",
                  "test_a_dev_evaluation_without_a_finite_score_is_never_the_best")


@pytest.fixture(autouse=True)
def _no_curves(request, monkeypatch):
    if request.node.originalname not in DRAWING_CURVES:
        without_curves(monkeypatch)


def _in_a_process_of_its_own(check, tmp_path) -> str:
    """What `check` (a function of this module, run in a process of its own: a signal test whose old rule ended the
    process) printed. The process is forked from start_ranks' server, which imported torch and angle_train once a
    session (a fresh interpreter took 3-4 s a test to import them); it raises what the process raised, and
    ProcessExitedException where it ended otherwise than by returning."""
    start_ranks(_printing_to_a_file, (check, str(tmp_path / "stdout.txt")), nprocs=1)
    return (tmp_path / "stdout.txt").read_text()


def _printing_to_a_file(rank, check, path):
    with open(path, "w") as out, contextlib.redirect_stdout(out):
        check()


def _config(out, **overrides):
    base = {"batch_size": 8, "max_steps": 4, "lr": 1e-2, "warmup": 0, "log_every": 1, "max_length": 12, "seed": 3}
    return run_config(out, **{**base, **overrides})


def _state(run) -> dict:
    """Everything a skipped step must leave alone."""
    return {"weights": copy.deepcopy(run.encoder.state_dict()), "optimizer": copy.deepcopy(run.optimizer.state_dict()),
            "scheduler": copy.deepcopy(run.scheduler.state_dict()), "lr": run.scheduler.get_last_lr()}


def _assert_same_state(a: dict, b: dict) -> None:
    for name, value in a["weights"].items():
        assert torch.equal(value, b["weights"][name]), name
    for key, value in a["optimizer"]["state"].items():
        for field, tensor in value.items():
            assert torch.equal(torch.as_tensor(tensor), torch.as_tensor(b["optimizer"]["state"][key][field])), field
    assert a["scheduler"] == b["scheduler"] and a["lr"] == b["lr"]


class PoisonedLoss:
    """AngleLoss whose value is NaN at the steps in `bad` (the loop sets `step` before each one via on_step)."""

    def __init__(self, bad, first_step: int = 1):
        self.loss, self.bad, self.step = AngleLoss(dataset_format="B"), set(bad), first_step

    def __call__(self, labels, embeddings):
        value = self.loss(labels, embeddings)
        return value * float("nan") if self.step in self.bad else value

    def on_step(self, step, row):
        self.step = step + 1


# ------------------------------------------------------------------------------------------- non-finite steps
@pytest.mark.parametrize("poison", ["gradient", "loss"])
def test_a_non_finite_step_is_skipped_and_changes_nothing(tmp_path, poison):
    loss_fn = PoisonedLoss(bad=[2] if poison == "loss" else [])
    run = setup(_config(tmp_path), model=make_encoder(), train_examples=DATA, loss_fn=loss_fn)
    try:
        loss_fn.on_step(*[optimizer_step(run)["step"], None])
        before, batch = _state(run), run.position.batch
        weight = next(p for p in run.encoder.parameters() if p.requires_grad)
        hook = weight.register_hook(lambda g: g * float("nan")) if poison == "gradient" else None
        row = optimizer_step(run)
        if hook is not None:
            hook.remove()
        loss_fn.on_step(row["step"], row)
        assert row["skipped"] and row["bad_steps"] == 1 and run.position.bad_streak == 1
        _assert_same_state(before, _state(run))
        assert run.position.batch == batch + 1  # the batch counts as consumed: the next step sees new data
        row = optimizer_step(run)
        assert not row["skipped"] and run.position.bad_streak == 0 and run.position.bad_steps == 1
        assert all(torch.isfinite(p).all() for p in run.encoder.parameters())
    finally:
        run.log.close()


def test_an_fp16_gradient_overflow_is_the_loss_scalers_to_skip():
    """With fp16 loss scaling an overflowing gradient is routine (the scaler skips the update and lowers the scale):
    no bad step. Without it, or with a non-finite loss, the step is a bad one."""
    assert faults.is_finite_step(1.0, math.inf, loss_scaling=True)
    assert not faults.is_finite_step(1.0, math.inf, loss_scaling=False)
    assert not faults.is_finite_step(math.nan, 1.0, loss_scaling=True)


def test_one_non_finite_embedding_makes_the_step_non_finite():
    """A single NaN among finite embeddings (one text's overflow) gives a NaN loss, so the step is skipped."""
    loss_fn = faults.SkipNonFiniteEmbeddings(lambda labels, embeddings: embeddings.sum())
    embeddings = torch.ones(4, 3)
    assert loss_fn(None, embeddings).item() == 12.0 and not loss_fn.seen
    embeddings[1, 2] = math.nan
    assert math.isnan(loss_fn(None, embeddings).item()) and loss_fn.seen


def test_resume_after_a_skipped_step_is_exact(tmp_path):
    """The skipped step is in the checkpointed position (its batch consumed, the schedule not advanced): resuming
    from a checkpoint written after it ends bit-identical to the uninterrupted run."""
    poisoned = PoisonedLoss(bad=[2])
    full = train(_config(tmp_path / "full", save_every=2), model=make_encoder(), train_examples=DATA,
                 loss_fn=poisoned, on_step=poisoned.on_step)
    assert [row["skipped"] for row in full.history] == [False, True, False, False]
    again = PoisonedLoss(bad=[2], first_step=3)
    out = tmp_path / "resumed"
    out.mkdir()
    os.symlink(tmp_path / "full" / "checkpoints", out / "checkpoints")  # the run's checkpoints, resumed elsewhere
    resumed = train(_config(out, save_every=2, resume=str(tmp_path / "full" / "checkpoints" / "step-00000002")),
                    model=make_encoder(), train_examples=DATA, loss_fn=again, on_step=again.on_step)
    assert [row["loss"] for row in resumed.history] == [row["loss"] for row in full.history[2:]]
    for name, value in full.encoder.state_dict().items():
        assert torch.equal(resumed.encoder.state_dict()[name], value), name


def test_a_skipped_steps_loss_stays_out_of_the_logged_mean(tmp_path):
    """Step 2's gradients are NaN (its loss is finite): the step is skipped, and the row logged for steps 1-2 (every
    2 steps) is step 1's loss alone, not the mean with the skipped step's."""
    encoder, tokenizer = make_encoder()
    weight = next(p for p in encoder.parameters() if p.requires_grad)
    hooks = []

    def on_step(step, row):
        if step == 1:
            hooks.append(weight.register_hook(lambda g: g * float("nan")))
        elif step == 2:
            hooks.pop().remove()

    result = train(_config(tmp_path, log_every=2), model=(encoder, tokenizer), train_examples=DATA, on_step=on_step)
    assert [row["skipped"] for row in result.history] == [False, True, False, False]
    assert math.isfinite(result.history[1]["loss"]) and result.history[1]["loss"] != result.history[0]["loss"]
    logged = tracking.read_metrics(str(tmp_path / "metrics.jsonl"))
    first = next(row for row in logged if row["step"] == 2 and "loss" in row)
    assert first["loss"] == pytest.approx(result.history[0]["loss"], rel=1e-12)


def _strict_json_rows(path) -> list[dict]:
    """The rows of a metrics.jsonl, each line read as strict JSON: NaN, Infinity and -Infinity are no JSON values
    (jq and JavaScript's JSON.parse refuse them; Python's json module alone takes them)."""

    def refuse(constant):
        raise ValueError(f"{constant} is not JSON")

    return [json.loads(line, parse_constant=refuse) for line in Path(path).read_text().splitlines()]


def test_a_row_of_skipped_steps_is_written_as_strict_json(tmp_path):
    """Step 2's loss is NaN: its row (one step a row) holds a loss and a gradient norm that are not finite, written
    as null (json.dumps wrote NaN, and the line was no JSON); the curves leave a gap there and the run's model card
    is written."""
    poisoned = PoisonedLoss(bad=[2])
    result = train(_config(tmp_path, max_steps=3, max_bad_steps=5), model=make_encoder(), train_examples=DATA,
                   loss_fn=poisoned, on_step=poisoned.on_step)
    assert [row["skipped"] for row in result.history] == [False, True, False]
    assert math.isnan(result.history[1]["loss"])
    rows = _strict_json_rows(tmp_path / "metrics.jsonl")
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert rows[1]["skipped"] and rows[1]["loss"] is None and rows[1]["grad_norm"] is None
    assert all(isinstance(rows[i]["loss"], float) for i in (0, 2))
    assert math.isnan(tracking.number_at(tracking.read_metrics(str(tmp_path / "metrics.jsonl"))[1], "loss"))
    if result.curves_path is not None:  # with matplotlib: the skipped row is a point of the loss curve, a gap
        from PIL import Image

        with Image.open(result.curves_path) as image:
            assert json.loads(image.text[CURVES_METADATA_KEY])["steps"] == [1, 2, 3]


def test_too_many_bad_steps_in_a_row_stop_the_run(tmp_path):
    """The run stops naming step 1's checkpoint: step 2's weights (in the step-2 and step-3 checkpoints) gave the
    failing steps."""
    poisoned = PoisonedLoss(bad=[3, 4, 5])
    with pytest.raises(faults.NonFiniteTrainingError, match=r"2 optimizer steps in a row .*step 4.*last good "
                       r"checkpoint .* is \S*step-00000001;"):
        train(_config(tmp_path, max_steps=6, save_every=1, max_bad_steps=2, save_final=True), model=make_encoder(),
              train_examples=DATA, loss_fn=poisoned, on_step=poisoned.on_step)
    done = finished_checkpoints(str(tmp_path))
    assert done[-1].endswith("step-00000003") and checkpoint_problem(done[-1]) is None
    assert not (tmp_path / "final").exists()
    state = torch.load(os.path.join(done[-1], "state.pt"), weights_only=True)
    assert all(torch.isfinite(w).all() for w in state["model"].values())
    assert state["position"]["bad_streak"] == 1


def test_a_run_shorter_than_the_bad_step_limit_whose_every_step_was_skipped_stops(tmp_path, capsys):
    """Every step of a 2-step run skipped (--max-bad-steps 5 is never reached): the run stops as at the limit, no
    final/ of the weights it started from written as if trained; where an earlier step was taken it ends, its last
    line saying that the last logged steps gave no finite loss (it printed a skipped step's loss as "the mean of the
    last 0 steps")."""
    poisoned = PoisonedLoss(bad=[1, 2])
    with pytest.raises(faults.NonFiniteTrainingError, match=r"^2 optimizer steps in a row \(the last: step 2, .*No "
                                                            r"checkpoint is known to be good"):
        train(_config(tmp_path / "none", max_steps=2, max_bad_steps=5, save_final=True), model=make_encoder(),
              train_examples=DATA, loss_fn=poisoned, on_step=poisoned.on_step)
    assert not (tmp_path / "none" / "final").exists()
    poisoned = PoisonedLoss(bad=[3, 4])
    capsys.readouterr()
    result = train(_config(tmp_path / "some", max_steps=4, log_every=2, max_bad_steps=5), model=make_encoder(),
                   train_examples=DATA, loss_fn=poisoned, on_step=poisoned.on_step)
    assert [row["skipped"] for row in result.history] == [False, False, True, True]
    said = capsys.readouterr().out
    assert "done: 4 steps | no finite loss (the steps of the last metrics row were skipped) |" in said


def test_checkpoints_written_while_steps_fail_never_push_out_the_last_good_one(tmp_path):
    """--keep-checkpoints 2, a checkpoint every step, steps 4-6 non-finite: the checkpoints of steps 3-5 hold
    weights that gave non-finite steps, and pruned by step alone they pushed out step 2's, the last one a finite
    step was taken from. It stays, the error names it, and a run resumed from it trains on."""
    poisoned = PoisonedLoss(bad=[4, 5, 6])
    settings = {"max_steps": 8, "save_every": 1, "keep_checkpoints": 2, "max_bad_steps": 3}
    good = os.path.join(str(tmp_path), "checkpoints", "step-00000002")
    with pytest.raises(faults.NonFiniteTrainingError, match=f"last good checkpoint .* is {good};"):
        train(_config(tmp_path, **settings), model=make_encoder(), train_examples=DATA, loss_fn=poisoned,
              on_step=poisoned.on_step)
    assert [os.path.basename(path) for path in finished_checkpoints(str(tmp_path))] == [
        "step-00000002", "step-00000004", "step-00000005"]
    assert checkpoint_problem(good) is None
    assert torch.load(os.path.join(good, "state.pt"), weights_only=True)["position"]["bad_streak"] == 0
    clean = PoisonedLoss(bad=[], first_step=3)
    resumed = train(_config(tmp_path, **settings, resume=good), model=make_encoder(), train_examples=DATA,
                    loss_fn=clean, on_step=clean.on_step)
    assert [row["skipped"] for row in resumed.history] == [False] * 6
    # once a step from a newer checkpoint is finite, the older good one goes: --keep-checkpoints again
    assert [os.path.basename(path) for path in finished_checkpoints(str(tmp_path))] == [
        "step-00000007", "step-00000008"]


def test_the_checkpoint_a_run_resumed_from_becomes_its_last_good_one(tmp_path):
    """A run stopped at step 3 resumes from its step-2 checkpoint; the resumed step 3 is finite, so step 2's
    checkpoint is the last good one when steps 4 and 5 fail: the error names it (not the one recorded before the
    resume), and it is kept."""
    from angle_train.trainer import StopTraining

    settings = {"max_steps": 8, "save_every": 2, "keep_checkpoints": 1, "max_bad_steps": 2}
    clean = PoisonedLoss(bad=[])

    def stop_after_step_3(step, row):
        clean.on_step(step, row)
        if step == 3:
            raise StopTraining

    train(_config(tmp_path, **settings), model=make_encoder(), train_examples=DATA, loss_fn=clean,
          on_step=stop_after_step_3)
    good = os.path.join(str(tmp_path), "checkpoints", "step-00000002")
    poisoned = PoisonedLoss(bad=[4, 5], first_step=3)
    with pytest.raises(faults.NonFiniteTrainingError, match=f"last good checkpoint .* is {good};"):
        train(_config(tmp_path, **settings, resume="auto"), model=make_encoder(), train_examples=DATA,
              loss_fn=poisoned, on_step=poisoned.on_step)
    assert checkpoint_problem(good) is None


def test_resume_auto_after_a_non_finite_stop_takes_the_last_good_checkpoint(tmp_path, capsys):
    """Steps 4-6 non-finite stop the run; `--resume auto` took the newest checkpoint (step 5), whose weights gave
    those steps, where the error named step 2's. It now resumes from step 2 (stopped-non-finite.json names it), sets
    the newer ones aside, removes the file and trains on."""
    poisoned = PoisonedLoss(bad=[4, 5, 6])
    settings = {"max_steps": 8, "save_every": 1, "keep_checkpoints": 2, "max_bad_steps": 3}
    with pytest.raises(faults.NonFiniteTrainingError):
        train(_config(tmp_path, **settings), model=make_encoder(), train_examples=DATA, loss_fn=poisoned,
              on_step=poisoned.on_step)
    assert json.loads((tmp_path / "stopped-non-finite.json").read_text()) == {
        "step": 6, "good_checkpoint": "step-00000002"}
    clean = PoisonedLoss(bad=[], first_step=3)
    resumed = train(_config(tmp_path, **settings, resume="auto"), model=make_encoder(), train_examples=DATA,
                    loss_fn=clean, on_step=clean.on_step)
    out = capsys.readouterr().out
    assert "stopped after non-finite steps: resuming from its last good checkpoint" in out
    assert [row["step"] for row in resumed.history] == [3, 4, 5, 6, 7, 8]
    assert not any(row["skipped"] for row in resumed.history)
    assert not (tmp_path / "stopped-non-finite.json").exists()
    set_aside = tmp_path / "set-aside" / "after-step-00000002" / "checkpoints"
    assert sorted(os.listdir(set_aside)) == ["step-00000004", "step-00000005"]


class OverflowingForward:
    """Wraps an encoder's forward pass so that it overflows (Inf and NaN embeddings, as an fp16 activation overflow
    gives) during the optimizer steps in `bad` (the loop says which step comes next via on_step)."""

    def __init__(self, encoder, bad):
        self.forward, self.bad, self.step = encoder.forward, set(bad), 1
        encoder.forward = self

    def __call__(self, *inputs):  # (input_ids, attention_mask[, packed])
        out = self.forward(*inputs)
        return out * float("inf") if self.step in self.bad else out  # +-Inf, NaN where a feature is 0

    def on_step(self, step, row):
        self.step = step + 1


@pytest.mark.parametrize("objective", ["angle", "arccse"])
def test_non_finite_embeddings_skip_the_step_and_the_run_goes_on(tmp_path, objective, capsys):
    """The loss's own input check (a ValueError for direct callers) does not stop training: the step whose forward
    pass overflowed is skipped like a non-finite loss, said so in the log, and the run finishes."""
    encoder, tokenizer = make_encoder()
    poisoned = OverflowingForward(encoder, bad=[2])
    data = DATA if objective == "angle" else [text for ex in DATA[0] for text in ex.texts]
    result = train(_config(tmp_path, objective=objective, save_final=True), train_examples=data,
                   model=(encoder, tokenizer), on_step=poisoned.on_step)
    assert [row["skipped"] for row in result.history] == [False, True, False, False]
    assert "step 2: skipped, non-finite embeddings" in capsys.readouterr().out
    assert (tmp_path / "final").is_dir() and all(torch.isfinite(p).all() for p in result.encoder.parameters())


@pytest.mark.parametrize("dev, broken", [("retrieval", "nan"), ("sts", "nan"), ("sts", "collapsed")])
@pytest.mark.filterwarnings("ignore:An input array is constant")  # scipy, on the collapsed model's cosines
def test_a_dev_evaluation_without_a_finite_score_is_never_the_best(tmp_path, monkeypatch, capsys, dev, broken):
    """Dev embeddings holding NaN (weights that overflowed, finite but huge) or all alike (collapsed: every cosine
    equal, Spearman undefined) give no score: never a best, not even at the first evaluation (a NaN best stood for
    good, no score comparing above it; NaN embeddings once scored dev nDCG@10 1.0 and were exported as best/). The
    log says why and the run goes on; the next finite score is the best, and curves.png leaves the NaNs out."""
    from angle_train import trainer
    from angle_train.checkpoint import best_record
    from angle_train.evaluate import RetrievalSet
    from angle_train.tiny import demo_sts_examples

    pairs = demo_examples(12, seed=5)
    dev_set = (RetrievalSet("dev", [ex.texts[0] for ex in pairs], [ex.texts[1] for ex in pairs]) if dev == "retrieval"
               else demo_sts_examples(12, seed=5))
    embed = trainer.dev_embeddings

    def broken_at_steps_1_and_3(run):
        embeddings = embed(run)
        if run.position.step not in (1, 3):
            return embeddings
        return [rows * math.nan if broken == "nan" else torch.ones_like(rows) for rows in embeddings]

    monkeypatch.setattr(trainer, "dev_embeddings", broken_at_steps_1_and_3)
    result = train(_config(tmp_path, max_steps=3, eval_every=1), model=make_encoder(), train_examples=DATA,
                   dev_examples=dev_set)
    metric = "dev_ndcg@10" if dev == "retrieval" else "dev_spearman"
    first, second, third = (row[metric] for row in result.evals)
    assert math.isnan(first) and math.isfinite(second) and math.isnan(third)
    assert [row[f"best_{metric}"] for row in result.evals] == [None, second, second]
    assert result.best_score == second and best_record(str(tmp_path / "best")) == {"step": 2, metric: second}
    out = capsys.readouterr().out
    why = ("24 of 24 dev embeddings hold NaN or Inf (an overflow in the encoder's forward pass)" if broken == "nan"
           else "every dev cosine is equal, so the correlation is undefined (the embeddings collapsed)")
    assert f"step 1: no dev score: {why}" in out and "not a best model, no best model yet; training goes on" in out
    assert f"step 3: no dev score: {why}; not a best model, the best stays {DEV_METRICS[metric]} {second:.4f} " \
           "(step 2)\n" in out  # the last step: nothing is said of training going on
    if result.curves_path is not None:  # with matplotlib
        from PIL import Image

        with Image.open(result.curves_path) as image:
            assert json.loads(image.text[CURVES_METADATA_KEY])["dev_steps"] == [2]
    # metrics.jsonl holds the evaluations without a score as null: every line is JSON
    logged = [row for row in _strict_json_rows(tmp_path / "metrics.jsonl") if metric in row]
    assert [row[metric] for row in logged] == [None, second, None]
    assert "| 1 | nan |" in (tmp_path / "best" / "README.md").read_text()  # the model card's table reads them


@pytest.mark.parametrize("weight", [0, -1], ids=["first", "last"])
def test_no_checkpoint_is_written_from_non_finite_weights(tmp_path, weight):
    """One NaN in any trainable weight, the first or the last, refuses the checkpoint."""
    run = setup(_config(tmp_path), model=make_encoder(), train_examples=DATA)
    run.log.close()
    with torch.no_grad():
        [p for p in run.encoder.parameters() if p.requires_grad][weight].view(-1)[0] = float("nan")
    with pytest.raises(ValueError, match="refusing to write checkpoint .* holds NaN or Inf"):
        save_checkpoint(run.cfg, run.position, run.dist_info, encoder=run.encoder, optimizer=run.optimizer,
                        scheduler=run.scheduler, scaler=run.scaler)
    assert not (tmp_path / "checkpoints").exists() or not os.listdir(tmp_path / "checkpoints")


# ---------------------------------------------------------------------------------------------------- signals
def test_a_second_signal_stops_at_once(monkeypatch):
    """Whatever handler was installed before (here one that ignores SIGINT): the second SIGINT raises
    KeyboardInterrupt at once, and the earlier handler is back afterwards. (The repeat comes at once here: the window
    in which it would be the first one's copy is set to nothing.)"""
    def earlier(signum, frame):
        pass

    monkeypatch.setattr(faults.StopSignals, "SAME_REQUEST_S", 0.0)
    previous = signal.signal(signal.SIGINT, earlier)
    try:
        with faults.StopSignals() as signals:
            signal.raise_signal(signal.SIGINT)
            assert signals.requested == "SIGINT"
            with pytest.raises(KeyboardInterrupt):
                signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) is earlier
    finally:
        signal.signal(signal.SIGINT, previous)


def test_leaving_puts_back_the_earlier_handlers():
    """Whether no signal came or one did, the handlers of SIGINT and SIGTERM installed before are back afterwards."""
    def earlier(signum, frame):
        pass

    previous = {sig: signal.signal(sig, earlier) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        for signals_sent in ([], [signal.SIGTERM]):
            with faults.StopSignals():
                for sig in signals_sent:
                    signal.raise_signal(sig)
                assert signal.getsignal(signal.SIGTERM) is not earlier
            assert all(signal.getsignal(sig) is earlier for sig in previous)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _sigterm_twice_where_it_was_ignored():
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    faults.StopSignals.SAME_REQUEST_S = 0.0
    with faults.StopSignals() as signals:
        signal.raise_signal(signal.SIGTERM)
        assert signals.requested == "SIGTERM"
        signal.raise_signal(signal.SIGTERM)


def test_a_second_sigterm_terminates_the_process(tmp_path):
    """In a process of its own: the first SIGTERM is recorded, the second terminates the process (status -SIGTERM)
    even though it ignored SIGTERM before."""
    with pytest.raises(torch.multiprocessing.ProcessExitedException) as ended:
        _in_a_process_of_its_own(_sigterm_twice_where_it_was_ignored, tmp_path)
    assert ended.value.signal_name == "SIGTERM", ended.value


def _sigterm_twice_at_once():
    with faults.StopSignals() as signals:
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGTERM)
        assert signals.requested == "SIGTERM"


def test_a_signal_repeated_at_once_is_the_same_request(tmp_path, monkeypatch, capsys):
    """A scheduler that signals every process of a job (Slurm, systemd) reaches each torchrun worker twice,
    directly and as torchrun passes it on: the copy ended every worker mid-step, with no checkpoint. A repeat of the
    first signal within StopSignals.SAME_REQUEST_S is that request again, said in a line (in a process of its own:
    the old rule terminated it); after that window, or another signal at any time (torchrun's SIGTERM after a second
    Ctrl-C), stops at once."""
    said = _in_a_process_of_its_own(_sigterm_twice_at_once, tmp_path)
    assert "SIGTERM again within 2 s: taken as the same request" in said
    with faults.StopSignals():
        signal.raise_signal(signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    monkeypatch.setenv(faults.StopSignals.LAUNCHER_ENV, "job")  # a torchrun worker: a SIGINT's copy comes too
    with faults.StopSignals():
        signal.raise_signal(signal.SIGINT)
        monkeypatch.setattr(faults.StopSignals, "SAME_REQUEST_S", 0.0)  # the window has passed
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert "SIGINT again: stopping at once" in capsys.readouterr().out


def test_a_copy_that_comes_after_the_checkpoint_is_the_same_request(monkeypatch, capsys):
    """Leaving on a preemption put the earlier handlers back at once, and a launcher's copy of the signal that came
    after the checkpoint took the earlier action (SIGTERM's default: exit status 143 where the run said 75). Within
    StopSignals.SAME_REQUEST_S the copy is the same request; after it, the earlier handler is back and acts."""
    calls = []

    def earlier(signum, frame):
        calls.append(signum)

    previous = signal.signal(signal.SIGTERM, earlier)
    try:
        with pytest.raises(faults.Preempted):
            with faults.StopSignals():
                signal.raise_signal(signal.SIGTERM)
                raise faults.Preempted("SIGTERM", "checkpoints/step-00000001")
        signal.raise_signal(signal.SIGTERM)
        assert not calls and "SIGTERM again within 2 s: taken as the same request" in capsys.readouterr().out
        monkeypatch.setattr(faults.StopSignals, "SAME_REQUEST_S", 0.0)  # the window has passed
        signal.raise_signal(signal.SIGTERM)
        assert calls == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is earlier
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_angle_train_ignores_stop_signals_while_it_exits_after_a_preemption(monkeypatch):
    """Python's finalization puts back the default action of every signal with a Python handler: a copy of the
    signal arriving while the process ended (0.1-1 s after the checkpoint, on a tiny model) terminated it with
    status 143. The CLI ignores the stop signals from the preemption to its end, and exits 75."""
    from angle_train import cli, trainer

    def preempted(cfg):
        raise faults.Preempted("SIGTERM", "checkpoints/step-00000001")

    monkeypatch.setattr(trainer, "train", preempted)
    previous = {sig: signal.getsignal(sig) for sig in faults.StopSignals.SIGNALS}
    try:
        assert cli.main(["--model", "builtin:tiny-bert", "--max-steps", "1"]) == faults.EXIT_PREEMPTED
        assert all(signal.getsignal(sig) == signal.SIG_IGN for sig in faults.StopSignals.SIGNALS)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_a_second_ctrl_c_at_once_stops_at_once_outside_torchrun(monkeypatch, capsys):
    """A person's second Ctrl-C, however soon, stops at once: the terminal sends SIGINT once, so a repeat is no copy
    (it was taken for one within StopSignals.SAME_REQUEST_S, and ignored). A torchrun worker, which the keyboard's
    SIGINT does not reach (torchrun passes it on), takes a repeat within the window as a copy, as of SIGTERM."""
    monkeypatch.delenv(faults.StopSignals.LAUNCHER_ENV, raising=False)
    with faults.StopSignals() as signals:
        signal.raise_signal(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGINT)
    assert signals.requested == "SIGINT"
    assert "SIGINT again: stopping at once" in capsys.readouterr().out
    monkeypatch.setenv(faults.StopSignals.LAUNCHER_ENV, "job")
    with faults.StopSignals() as signals:
        signal.raise_signal(signal.SIGINT)
        signal.raise_signal(signal.SIGINT)
    assert signals.requested == "SIGINT"
    assert "SIGINT again within 2 s: taken as the same request" in capsys.readouterr().out


def _sighup_heeded_unless_ignored():
    with faults.StopSignals() as signals:
        signal.raise_signal(signal.SIGHUP)
        assert signals.requested == "SIGHUP", signals.requested
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    with faults.StopSignals() as signals:
        signal.raise_signal(signal.SIGHUP)
        assert signals.requested is None, signals.requested
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN


def test_sighup_stops_as_sigterm_does_unless_it_is_ignored(tmp_path):
    """A closed terminal or ssh session: torchrun passes SIGHUP on to its processes, even when started with nohup,
    and they ended at once with no checkpoint. SIGHUP is now the first signal as SIGTERM is (in a process of its own:
    it terminated it); one that is ignored on entry (nohup, for a single process) stays ignored."""
    said = _in_a_process_of_its_own(_sighup_heeded_unless_ignored, tmp_path)
    assert "SIGHUP: finishing this optimizer step, then writing a checkpoint" in said


class SignalWhileExporting:
    """save_pretrained that writes part of the export, then receives SIGTERM (as a preempted job does)."""

    def __init__(self, real):
        self.real = real

    def __call__(self, encoder, tokenizer, path, **kwargs):
        os.makedirs(path, exist_ok=True)
        Path(path, "config.json").write_text("{}")
        signal.raise_signal(signal.SIGTERM)
        return self.real(encoder, tokenizer, path, **kwargs)


def test_sigterm_during_the_final_export_checkpoints_and_resume_exports_the_same_model(tmp_path, monkeypatch):
    """SIGTERM while final/ is written: the export is abandoned (no final/, no final.tmp), a checkpoint of the last
    step is written (with the default --save-every 0 there was none) and the run stops resumable (faults.Preempted:
    status 75 from the CLI); --resume auto then only exports: the same final/ as an uninterrupted run."""
    from angle_train import checkpoint
    from angle_train.export import load_pretrained

    def outside_the_loop(signum, frame):  # where the loop's handlers are not installed, fail the test, not pytest
        raise AssertionError("SIGTERM arrived outside StopSignals")

    full = train(_config(tmp_path / "full", save_final=True), model=make_encoder(), train_examples=DATA)
    previous = signal.signal(signal.SIGTERM, outside_the_loop)
    try:
        monkeypatch.setattr(checkpoint, "save_pretrained", SignalWhileExporting(checkpoint.save_pretrained))
        with pytest.raises(faults.Preempted) as stopped:
            train(_config(tmp_path / "run", save_final=True), model=make_encoder(), train_examples=DATA)
    finally:
        signal.signal(signal.SIGTERM, previous)
    monkeypatch.undo()
    assert stopped.value.checkpoint.endswith("step-00000004") and checkpoint_problem(stopped.value.checkpoint) is None
    assert not (tmp_path / "run" / "final").exists() and not (tmp_path / "run" / "final.tmp").exists()
    resumed = train(_config(tmp_path / "run", save_final=True, resume="auto"), model=make_encoder(),
                    train_examples=DATA)
    assert resumed.history == [] and resumed.final_path == str(tmp_path / "run" / "final")
    expected = load_pretrained(full.final_path)[0].state_dict()
    got = load_pretrained(resumed.final_path)[0].state_dict()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


CLI_FLAGS = ("--model", "builtin:tiny-bert", "--train-data", "builtin:demo", "--batch-size", "16", "--max-steps",
             "8", "--lr", "3e-3", "--max-length", "12", "--log-every", "1", "--progress", "0", "--device", "cpu",
             "--seed", "5")
# angle-train's main (the flags after the first argument) in a process whose step 4 waits for a signal: it starts
# once the loop's handler has taken one, sent after this process has written the file named by the first argument.
# The signal comes mid-run however fast the run is (sent once step 3 was logged, it raced the remaining steps, which
# had to be hundreds to be sure to lose on a busy machine).
WAITING_FOR_A_SIGNAL = """
import pathlib, signal, sys, time
from angle_train import cli, trainer

real_step = trainer.optimizer_step

def step_once_signalled(run):
    if run.position.step == 3:
        signals = signal.getsignal(signal.SIGTERM).__self__  # the loop's faults.StopSignals
        pathlib.Path(sys.argv[1]).touch()
        deadline = time.monotonic() + 120  # no signal taken: the run goes on, ends with status 0 and fails the test
        while signals.requested is None and time.monotonic() < deadline:
            time.sleep(0.01)
    return real_step(run)

trainer.optimizer_step = step_once_signalled
sys.exit(cli.main(sys.argv[2:]))
"""


def _cli(out, waiting):
    """WAITING_FOR_A_SIGNAL's command line: angle-train's, in a process that touches `waiting` (a path) at step 4."""
    return [sys.executable, "-c", WAITING_FOR_A_SIGNAL, str(waiting), *CLI_FLAGS, "--output-dir", str(out)]


def _final_weights(out):
    from safetensors.torch import load_file

    return load_file(str(next(Path(out, "final").glob("*.safetensors"))))


def test_sigterm_checkpoints_and_resume_is_bit_identical(tmp_path, capsys):
    """A real angle-train process: SIGTERM mid-run (at the start of step 4: WAITING_FOR_A_SIGNAL) finishes the
    step, writes a checkpoint and exits with status 75; --resume auto then ends with the weights of an uninterrupted
    run, bit for bit. (The uninterrupted run is angle-train's main in this process, on one thread as the others,
    while the stopped one starts; so is the resumed run, which reads only the stopped run's folder: a process of its
    own would add an interpreter's start, 3-4 s, and prove no more.)"""
    from angle_train import cli

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    out, waiting = tmp_path / "stopped", tmp_path / "waiting-at-step-4"
    process = subprocess.Popen(_cli(out, waiting), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True)
    try:
        assert cli.main([*CLI_FLAGS, "--output-dir", str(tmp_path / "full")]) == 0, capsys.readouterr().out[-2000:]
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and process.poll() is None and not waiting.exists():
            time.sleep(0.05)
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == faults.EXIT_PREEMPTED, output[-2000:]
    assert "SIGTERM: finishing this optimizer step" in output
    done = finished_checkpoints(str(out))
    assert len(done) == 1 and checkpoint_problem(done[0]) is None
    stopped_at = int(done[0].rsplit("-", 1)[1])
    assert stopped_at == 4 and not (out / "final").exists()

    capsys.readouterr()  # the uninterrupted run's output
    status = cli.main([*CLI_FLAGS, "--output-dir", str(out), "--resume", "auto"])
    resumed = capsys.readouterr()
    assert status == 0, resumed.err[-2000:]
    assert f"resumed from {done[0]} at step {stopped_at}" in resumed.out
    expected, got = _final_weights(tmp_path / "full"), _final_weights(out)
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name


# ------------------------------------------------------------------------------------------------ out of memory
def _oom_above(encoder, rows: int, seen: list):
    """Make the encoder raise torch.OutOfMemoryError on forward passes of more than `rows` padded texts (the tests
    below train with --pack 0: the halving does not depend on the layout of a pass, their counts of texts do)."""
    forward = encoder.forward

    def limited(input_ids, attention_mask):
        seen.append(input_ids.shape[0])
        if input_ids.shape[0] > rows:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (simulated)")
        return forward(input_ids, attention_mask)

    encoder.forward = limited
    return encoder


def test_out_of_memory_names_what_to_change(tmp_path):
    encoder, tokenizer = make_encoder()
    with pytest.raises(torch.OutOfMemoryError) as error:
        train(_config(tmp_path, chunk_size=8, pack=0), model=(_oom_above(encoder, 4, []), tokenizer),
              train_examples=DATA)
    message = str(error.value)
    for needed in ("optimizer step 1", "--batch-size 8", "16 texts on this process, 8 texts per forward pass",
                   "--max-length 12", "--chunk-size", "--gradient-checkpointing", "--auto-chunk"):
        assert needed in message, needed
    assert "simulated" in str(error.value.__cause__)


def test_auto_chunk_halves_a_token_budget_and_gives_the_same_training(tmp_path):
    """--chunk-tokens 400 (all 16 texts of at most 12 tokens in one pass), halved until no pass holds more than
    the 4 texts that fit: the same training as that budget from the start (dropout off)."""
    seen = []
    encoder, tokenizer = make_encoder()
    cfg = _config(tmp_path / "auto", chunk_tokens=400, auto_chunk=True, pack=0)
    auto = train(cfg, model=(_oom_above(encoder, 4, seen), tokenizer), train_examples=DATA)
    halvings = [400 // 2**k for k in range(1, 5)]
    assert cfg.chunk_tokens in halvings and seen[:2] == [16, 16]  # 400 and 200: every text in one pass
    last_failure = max(i for i, rows in enumerate(seen) if rows > 4)
    assert last_failure == halvings.index(cfg.chunk_tokens)  # one failed pass per budget tried, then none
    assert seen[last_failure + 1:] and max(seen[last_failure + 1:]) <= 4
    fixed = train(_config(tmp_path / "fixed", chunk_tokens=cfg.chunk_tokens, pack=0), model=make_encoder(),
                  train_examples=DATA)
    for a, b in zip(auto.history, fixed.history, strict=True):
        assert abs(a["loss"] - b["loss"]) <= 1e-9 * abs(b["loss"])
    for name, value in fixed.encoder.state_dict().items():
        torch.testing.assert_close(auto.encoder.state_dict()[name], value, rtol=1e-9, atol=1e-12, msg=name)


def test_an_auto_chunk_retry_draws_the_dropout_masks_of_the_smaller_chunks(tmp_path):
    """Memory runs out part-way through a step, after forward passes that drew dropout masks: the retry with half
    the chunk starts from the random state the step started from, so with dropout on it trains as chunks of 4 from
    the start would (the out-of-memory errors above come before any mask is drawn)."""

    def oom_after_forward_above(encoder, rows):
        forward = encoder.forward

        def limited(input_ids, attention_mask):
            out = forward(input_ids, attention_mask)  # its dropout masks drawn
            if input_ids.shape[0] > rows:
                raise torch.OutOfMemoryError("CUDA out of memory (simulated, after the forward pass)")
            return out

        encoder.forward = limited
        return encoder

    settings = dict(max_steps=2, pack=0, save_every=0)
    encoder, tokenizer = make_encoder(dropout=0.2)
    auto = train(_config(tmp_path / "auto", auto_chunk=True, **settings),
                 model=(oom_after_forward_above(encoder, 4), tokenizer), train_examples=DATA)
    fixed = train(_config(tmp_path / "fixed", chunk_size=4, **settings), model=make_encoder(dropout=0.2),
                  train_examples=DATA)
    assert [a["loss"] for a in auto.history] == pytest.approx([b["loss"] for b in fixed.history], rel=1e-9)
    for name, value in fixed.encoder.state_dict().items():
        torch.testing.assert_close(auto.encoder.state_dict()[name], value, rtol=1e-9, atol=1e-12, msg=name)


def test_auto_chunk_halves_the_chunk_and_gives_the_same_training(tmp_path):
    """From plain backprop (16 texts a pass) to chunks of 8, then 4: the gradient cache makes the result that of
    chunks of 4 from the start (dropout off), and the later steps keep the chunk that fit."""
    seen = []
    encoder, tokenizer = make_encoder()
    auto = train(_config(tmp_path / "auto", auto_chunk=True, pack=0), model=(_oom_above(encoder, 4, seen), tokenizer),
                 train_examples=DATA)
    assert seen[:3] == [16, 8, 4] and set(seen[3:]) == {4}
    fixed = train(_config(tmp_path / "fixed", chunk_size=4, pack=0), model=make_encoder(), train_examples=DATA)
    for a, b in zip(auto.history, fixed.history):
        assert abs(a["loss"] - b["loss"]) <= 1e-9 * abs(b["loss"])
    for name, value in fixed.encoder.state_dict().items():
        torch.testing.assert_close(auto.encoder.state_dict()[name], value, rtol=1e-9, atol=1e-12, msg=name)


# -------------------------------------------------------------------------------------- 2 processes (gloo)
def _rank_main(rank, world, port, out_dir, case):
    out = {}
    with rank_of_a_job(rank, world, port):
        if case == "auto_chunk":
            try:
                setup(_config(out_dir, auto_chunk=True), model=make_encoder(), train_examples=DATA)
            except ValueError as exc:
                out["error"] = str(exc)
        elif case == "nan_on_rank1":
            run = setup(_config(out_dir), model=make_encoder(), train_examples=DATA)
            optimizer_step(run)
            before = _state(run)
            weight = next(p for p in run.encoder.parameters() if p.requires_grad)
            hook = weight.register_hook(lambda g: g * float("nan")) if rank == 1 else None
            row = optimizer_step(run)
            if hook is not None:
                hook.remove()
            _assert_same_state(before, _state(run))
            out.update(skipped=row["skipped"], weights=run.encoder.state_dict())
            run.log.close()
        elif case == "sigterm_on_rank1":
            def on_step(step, row):
                if step == 2 and rank == 1:
                    signal.raise_signal(signal.SIGTERM)
            try:
                train(_config(out_dir, max_steps=5), model=make_encoder(), train_examples=DATA, on_step=on_step)
            except faults.Preempted as exc:
                out["checkpoint"] = exc.checkpoint
        torch.save(out, os.path.join(out_dir, f"{case}-rank{rank}.pt"))


@pytest.mark.parametrize("case", ["nan_on_rank1", "sigterm_on_rank1", "auto_chunk"])
def test_every_process_agrees(tmp_path, case):
    """A NaN in one process's gradient skips the step on both (same weights, unchanged); SIGTERM to one process
    stops both after the same step with one checkpoint holding both processes' RNG states; --auto-chunk is refused
    under DDP."""
    start_ranks(_rank_main, (2, free_port(), str(tmp_path), case))
    got = [torch.load(tmp_path / f"{case}-rank{rank}.pt", weights_only=False) for rank in range(2)]
    if case == "nan_on_rank1":
        assert got[0]["skipped"] and got[1]["skipped"]
        for name, value in got[0]["weights"].items():
            assert torch.equal(value, got[1]["weights"][name]), name
    elif case == "sigterm_on_rank1":
        assert got[0]["checkpoint"] == got[1]["checkpoint"] and got[0]["checkpoint"].endswith("step-00000002")
        folder = Path(got[0]["checkpoint"])
        assert checkpoint_problem(str(folder)) is None
        assert (folder / "rng-rank0.pt").exists() and (folder / "rng-rank1.pt").exists()
    else:
        assert all("--auto-chunk works with one process" in g["error"] for g in got)


def test_a_stopped_run_names_the_batches_of_its_last_bad_step(tmp_path, capsys):
    """With --grad-accum 2 a step's data is two batches, named as a range: step 2 took batches 2-3 of epoch 0, and
    the skip line and the error both say so."""
    poisoned = PoisonedLoss(bad=[2])
    with pytest.raises(faults.NonFiniteTrainingError, match=r"\(the last: step 2, data at epoch 0, batches 2-3\)"):
        train(_config(tmp_path, batch_size=4, grad_accum=2, max_bad_steps=1), model=make_encoder(),
              train_examples=DATA, loss_fn=poisoned, on_step=poisoned.on_step)
    assert "step 2: skipped, non-finite loss" in capsys.readouterr().out


def test_a_last_good_checkpoint_gone_from_the_folder_is_not_named(tmp_path):
    """The last good checkpoint (step 1's) removed before the run stops: the error names no checkpoint to resume
    from rather than a folder that is not there."""
    import shutil

    from angle_train.checkpoint import checkpoint_path

    poisoned = PoisonedLoss(bad=[3, 4])

    def on_step(step, row):
        poisoned.on_step(step, row)
        if step == 3:
            shutil.rmtree(checkpoint_path(str(tmp_path), 1))

    with pytest.raises(faults.NonFiniteTrainingError, match="No checkpoint is known to be good") as caught:
        train(_config(tmp_path, save_every=1, max_bad_steps=2), model=make_encoder(), train_examples=DATA,
              loss_fn=poisoned, on_step=on_step)
    assert "step-00000001" not in str(caught.value)


def test_auto_chunk_gives_up_at_one_text_a_pass(tmp_path):
    """Out of memory at every pass size: --auto-chunk halves the pass down to one text, then stops with the
    out-of-memory error that says what to change, rather than starting over from the whole batch."""
    encoder, tokenizer = make_encoder()
    seen = []

    def always_out_of_memory(input_ids, attention_mask):
        seen.append(input_ids.shape[0])
        if len(seen) > 20:
            raise RuntimeError("still retrying after 20 passes")
        raise torch.OutOfMemoryError("CUDA out of memory (simulated)")

    encoder.forward = always_out_of_memory
    with pytest.raises(torch.OutOfMemoryError, match="optimizer step 1"):
        train(_config(tmp_path, auto_chunk=True, pack=0), model=(encoder, tokenizer), train_examples=DATA)
    assert seen == [16, 8, 4, 2, 1]
