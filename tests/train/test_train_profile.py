"""--profile (issue 14, item 5): one optimizer step broken down by phase, printed and written to profile.json;
outside the profiled step the phase marks cost nothing and change nothing."""

import json

import pytest
import torch
from train_helpers import demo_batch, graded_or_contrastive_loss, make_encoder, param_grads, run_config

from angle_train.config import CPU_PACK_WIDTH
from angle_train.data import pad_batch
from angle_train.grad_cache import plain_step
from angle_train.profiling import PHASES, phase, profiling


def profiled_run(tmp_path, **settings):
    from angle_train.tiny import demo_examples
    from angle_train.trainer import train

    cfg = run_config(tmp_path, profile=True, max_steps=3, batch_size=8, **settings)
    train(cfg, model=make_encoder("bert", dtype=torch.float32), train_examples=(demo_examples(64), "B"))
    with open(tmp_path / "profile.json") as f:
        return json.load(f)


def test_plain_backprop_profile(tmp_path, capsys):
    profile = profiled_run(tmp_path)
    assert profile["step"] == 2 and profile["total_s"] > 0 and profile["chunk_size"] == 0
    phases = profile["phases"]
    assert list(phases) == ["data", "encoder forward", "all-gather", "loss", "encoder backward", "optimizer", "other"]
    assert all(phases[name]["calls"] == 1 for name in PHASES if name in phases)
    assert sum(p["share"] for p in phases.values()) == pytest.approx(1.0, abs=1e-9)
    assert all(p["seconds"] >= 0 for p in phases.values())
    out = capsys.readouterr().out
    assert "profile of step 2" in out and "encoder backward" in out
    assert 0 < profile["useful_tokens"] <= 1 and f"real tokens: {profile['useful_tokens']:.0%}" in out
    header = f"plain backprop, packed into rows of {CPU_PACK_WIDTH} tokens"
    assert header in out and "% of the tokens real)" in out


def test_gradient_cache_profile_counts_every_chunk_and_batch(tmp_path):
    profile = profiled_run(tmp_path, chunk_size=4, grad_accum=2)
    phases = profile["phases"]
    chunks = 2 * (8 * 2 // 4)  # grad_accum batches x (16 texts / 4 per chunk)
    assert phases["encoder re-forward"]["calls"] == chunks and phases["encoder backward"]["calls"] == chunks
    assert phases["encoder forward"]["calls"] == chunks and phases["loss"]["calls"] == 2
    assert phases["optimizer"]["calls"] == 1
    # the chunks are packed (the CPU default): less padding than one padded pass over the batch
    plain = profiled_run(tmp_path / "plain", pack=0, pass_tokens=0)
    assert profile["pack"] and profile["useful_tokens"] > plain["useful_tokens"]


def test_phases_do_nothing_outside_a_profiled_step():
    with phase("no such phase"):  # not even checked: no profile is active
        pass
    with profiling(torch.device("cpu")) as profile:
        with phase("loss"):
            pass
        with pytest.raises(ValueError, match="unknown phase"), phase("no such phase"):
            pass
        with pytest.raises(RuntimeError, match="a step is already being profiled"), profiling(torch.device("cpu")):
            pass
    assert list(profile.seconds) == ["loss"]
    with profiling(torch.device("cpu"), enabled=False) as nothing:
        assert nothing is None


def test_the_printed_table_gives_each_phase_its_share_of_the_step():
    """The table --profile prints: each phase's milliseconds and share of the step, in step order, then the time no
    phase covers."""
    from angle_train.profiling import StepProfile

    profile = StepProfile(torch.device("cpu"))
    profile.add("optimizer", 0.2)  # added first: the rows are in step order all the same
    profile.add("loss", 0.5)
    profile.add("loss", 0.5)
    profile.total = 2.0
    lines = profile.table(step=7).splitlines()
    assert lines[0] == "profile of step 7: 2000.0 ms"
    assert [line.split() for line in lines[2:]] == [["loss", "1000.0", "50.0%", "2"],
                                                   ["optimizer", "200.0", "10.0%", "1"], ["other", "800.0", "40.0%"]]


def test_plain_step_gradients_equal_one_backward_call():
    """plain_step backpropagates in two calls (loss to the embeddings, then the encoder): the same gradients as
    one backward of the whole graph."""
    torch.manual_seed(0)
    encoder, tokenizer = make_encoder("bert", dropout=0.0)
    batch = demo_batch(tokenizer, 8)
    ids, mask = pad_batch(batch.seqs, encoder.pad_token_id, "right")
    loss_fn = graded_or_contrastive_loss("B")
    loss = loss_fn(batch.labels, encoder(ids, mask))
    loss.backward()
    expected = param_grads(encoder)
    encoder.zero_grad(set_to_none=True)
    ours = plain_step(encoder, [(ids, mask)], batch.labels, loss_fn)
    assert ours == loss.detach()
    for name, grad in param_grads(encoder).items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-12, atol=1e-14, msg=name)


def test_a_run_of_one_step_profiles_that_step(tmp_path):
    """--profile times the run's second step; a run of one step has none, and its only step is profiled instead."""
    from angle_train.tiny import demo_examples
    from angle_train.trainer import train

    cfg = run_config(tmp_path, profile=True, max_steps=1, batch_size=8)
    train(cfg, model=make_encoder("bert", dtype=torch.float32), train_examples=(demo_examples(16), "B"))
    with open(tmp_path / "profile.json") as f:
        assert json.load(f)["step"] == 1
