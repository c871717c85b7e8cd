"""The training loop's bookkeeping at its edges: a run whose length is not a multiple of its intervals, a run
without dev data or without --save-best, data that makes exactly one step, fractional epochs, a warm-up of one step,
the learning-rate curve's warm-up corner, the peak-memory figure's unit, the built-in graded data's scale, the note on
16-bit trainable weights."""

from __future__ import annotations

import re
import resource
import types

import pytest
import torch
from train_helpers import make_encoder, run_config

from angle_train import tracking, trainer
from angle_train.config import TrainConfig
from angle_train.data import DataError, Example
from angle_train.evaluate import RetrievalSet
from angle_train.models import Encoder, recomputes_activations
from angle_train.tiny import demo_examples, demo_sts_examples
from angle_train.trainer import (
    build_encoder, build_loss, count_steps, dev_description, dev_set_of, half_precision_weights_note, lr_curve,
    make_optimizer, make_schedule, small_dev_set_note, train, warmup_steps,
)


def test_the_last_step_is_scored_and_logged_and_no_best_is_kept_without_save_best(tmp_path):
    """5 steps, evaluating and logging every 2: the last step (5) is still scored and logged (its model could be
    the best; the final row is what the run ends on). With save_best off, best/ is never written and the result
    names no best path. The peak memory is in GiB: a CPU process holding torch is well past 50 MiB."""
    cfg = run_config(tmp_path, model="builtin:tiny-bert", batch_size=8, max_steps=5, eval_every=2, log_every=2,
                     max_length=16, cosine_w=1.0, ibn_w=0.0, angle_w=1.0, save_best=False)
    result = train(cfg, train_examples=(demo_sts_examples(64, seed=4), "A"), dev_examples=demo_sts_examples(32))
    assert [e["step"] for e in result.evals] == [2, 4, 5]
    assert [r["step"] for r in tracking.read_metrics(str(tmp_path / "metrics.jsonl")) if "loss" in r] == [2, 4, 5]
    assert not (tmp_path / "best").exists() and result.best_path is None
    peak = result.history[-1]["peak_mem_gb"]
    assert 0.05 < peak <= resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20 + 1e-6


def test_data_of_exactly_one_step_trains_and_no_dev_data_names_no_best_metric(tmp_path, capsys):
    """8 examples at batch size 4 with 2 accumulated batches are one optimizer step, taken (not refused) and told as
    one; a run without dev data has no best metric (None, as TrainResult documents)."""
    cfg = run_config(tmp_path, model="builtin:tiny-bert", batch_size=4, grad_accum=2, epochs=1, max_length=16)
    result = train(cfg, train_examples=(demo_examples(8), "B"))
    assert [r["step"] for r in result.history] == [1]
    printed = capsys.readouterr().out
    assert "| 1 step of 4x2 pairs |" in printed and "done: 1 step |" in printed
    assert result.best_metric is None and result.best_score is None


def test_fractional_epochs_round_down_and_a_warmup_of_one_is_one_step():
    """--epochs 1.5 over 3 steps an epoch is 4 whole steps (not 5); --warmup 1 is one step (values >= 1 count steps,
    below 1 a fraction of the run, rounded up as Hugging Face's Trainer rounds it: 0.1 of 5 steps was none)."""
    assert count_steps(TrainConfig(batch_size=4, epochs=1.5), n_examples=12, world_size=1) == 4
    assert warmup_steps(TrainConfig(warmup=1.0), total_steps=100) == 1
    assert warmup_steps(TrainConfig(warmup=0.1), total_steps=100) == 10
    assert warmup_steps(TrainConfig(warmup=0.1), total_steps=5) == 1
    assert warmup_steps(TrainConfig(warmup=0.25), total_steps=10) == 3
    assert warmup_steps(TrainConfig(warmup=0.0), total_steps=10) == 0


def test_a_share_of_the_steps_is_taken_as_written_not_as_floats_round_it():
    """--epochs 0.29 of 100 steps an epoch is 29 steps, and --warmup 0.07 of 100 steps 7: float arithmetic made them
    28.999999999999996 (cut to 28) and 7.000000000000001 (rounded up to 8)."""
    assert count_steps(TrainConfig(batch_size=2, epochs=0.29), n_examples=200, world_size=1) == 29
    assert count_steps(TrainConfig(batch_size=2, epochs=0.57), n_examples=200, world_size=1) == 57
    assert warmup_steps(TrainConfig(warmup=0.07), total_steps=100) == 7
    assert warmup_steps(TrainConfig(warmup=0.29), total_steps=100) == 29


def test_the_learning_rate_curve_holds_the_warmups_corner_off_its_grid():
    """The curves' learning-rate panel samples a long schedule every total // 2000 steps; the warmup's end (its
    peak) is among the points even where the grid misses it: 5,003 steps sampled every 2, a warmup of 7."""
    cfg = TrainConfig(warmup=7, lr=1e-3)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=cfg.lr)
    run = types.SimpleNamespace(cfg=cfg, total_steps=5003, scheduler=make_schedule(cfg, optimizer, 5003))
    curve = dict(lr_curve(run))
    assert 7 in curve and curve[7] == max(curve.values()) and 5003 in curve


def test_the_builtin_graded_pairs_are_labelled_on_the_sts_scale():
    """builtin:demo-sts labels are how many of three attributes two phrases share, on STS's 0-5 scale."""
    labels = {example.label for example in demo_sts_examples(256)}
    assert labels <= {0.0, 5.0 / 3, 10.0 / 3, 5.0} and max(labels) == pytest.approx(5.0)


def test_16_bit_trainable_weights_are_noted_with_the_share_adamw_steps_cannot_move():
    """bfloat16 weights updated by AdamW at lr 2e-5 with no float32 copy: a step moves a weight only below 2 lr / eps
    (0.0051) in magnitude. The note names that bound and the share of weights above it, and one real step leaves
    exactly those unchanged; LoRA's float32 adapters and float32 weights get no note."""
    layer = torch.nn.Linear(4, 1, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        layer.weight.copy_(torch.tensor([[0.001, -0.004, 0.01, -1.0]]))
    cfg = TrainConfig(model="builtin:tiny-bert", model_dtype="bfloat16", lr=2e-5, weight_decay=0.0)
    note = half_precision_weights_note(cfg, layer)
    assert re.search(r"4 trainable weights are bfloat16 \(--model-dtype bfloat16\).*--lr 2e-05.*larger than 0\.0051 in "
                     r"magnitude, 50% of these.*--model-dtype float32 --bf16.*--lora 1", note), note
    before = layer.weight.detach().clone()
    optimizer = make_optimizer(cfg, layer, torch.device("cpu"))
    layer(torch.ones(1, 4, dtype=torch.bfloat16)).sum().backward()
    optimizer.step()
    assert (layer.weight.detach() != before).tolist() == [[True, True, False, False]]
    assert "(--model-dtype float32 --fp16)" in half_precision_weights_note(cfg, layer.half())
    assert half_precision_weights_note(cfg, layer.float()) is None


def test_a_run_with_16_bit_trainable_weights_says_so_and_a_lora_run_does_not(tmp_path, capsys):
    data = (demo_examples(16, seed=2), "B")
    train(run_config(tmp_path / "full", model="builtin:tiny-bert", model_dtype="bfloat16", batch_size=8, max_steps=1,
                     max_length=16), train_examples=data)
    assert re.search(r"note: [\d,]+ trainable weights are bfloat16", capsys.readouterr().out)
    train(run_config(tmp_path / "lora", model="builtin:tiny-llama", model_dtype="bfloat16", lora=True, lora_r=4,
                     batch_size=8, max_steps=1, max_length=16), train_examples=data)
    assert "trainable weights are" not in capsys.readouterr().out


def test_a_fraction_of_an_epoch_shorter_than_one_step_is_one_step():
    """--epochs 0.1 over 3 steps an epoch is one step, not a run of none."""
    assert count_steps(TrainConfig(batch_size=4, epochs=0.1), n_examples=12, world_size=1) == 1


def test_every_loss_setting_reaches_the_loss():
    """Each loss flag, set apart from its default and from the others, is what the run's loss uses: the scales
    (--cosine-tau, --ibn-tau, --angle-tau), --ibn-partition and --false-negative-margin, and ArcCSE's --triplet-w."""
    cfg = TrainConfig(cosine_tau=5.0, ibn_tau=30.0, angle_tau=7.0, ibn_partition="gte", false_negative_margin=0.1)
    loss = build_loss(cfg, "B")
    assert (loss.cosine_tau, loss.ibn_tau, loss.angle_tau) == (5.0, 30.0, 7.0)
    assert loss.ibn_partition == "gte" and loss.false_negative_margin == 0.1
    objective = build_loss(TrainConfig(objective="arccse", triplet_w=0.35), None)
    assert objective.loss.triplet_weight == 0.35


def test_the_model_flags_reach_the_built_in_model():
    """--fp16 and --bf16 autocast the built-in model's forward pass, --gradient-checkpointing switches it on, and
    --model-dtype gives its weights' dtype."""
    cpu = torch.device("cpu")
    encoder, _ = build_encoder(TrainConfig(model="builtin:tiny-bert", fp16=True), cpu)
    assert encoder.autocast == "fp16" and recomputes_activations(encoder.backbone) is False
    encoder, _ = build_encoder(TrainConfig(model="builtin:tiny-bert", bf16=True, gradient_checkpointing=True), cpu)
    assert encoder.autocast == "bf16" and recomputes_activations(encoder.backbone) is True
    encoder, _ = build_encoder(TrainConfig(model="builtin:tiny-bert", model_dtype="float64"), cpu)
    assert encoder.autocast is None and next(encoder.parameters()).dtype == torch.float64


def test_dev_data_that_cannot_give_a_score_is_refused_naming_it():
    """dev_examples of three texts (no scored pair) and a retrieval set of one query are refused before the model
    loads, naming dev_examples; rows repeating one query are one query (every document is its positive: its recall
    and nDCG are the same whatever the model); two distinct queries are enough."""
    triplets = [Example(("a red car", "a car", "a blue boat"), 1.0)] * 2
    with pytest.raises(ValueError, match=r"dev_examples: scored pairs \(text1, text2, label\) are needed"):
        dev_set_of(triplets, TrainConfig())
    for queries, documents in ((["a red car"], ["a car"]), (["a red car"] * 3, ["a car", "the car", "a red one"])):
        with pytest.raises(DataError, match=rf"^dev_examples: {len(queries)} \(query, positive\) row\(s\) of 1 "
                                            r"distinct query; retrieval needs at least 2 distinct queries"):
            dev_set_of(RetrievalSet("dev", queries, documents), TrainConfig())
    two = RetrievalSet("dev", ["a red car", "a blue boat", "a red car"], ["a car", "a boat", "the car"])
    assert dev_set_of(two, TrainConfig()) is two


def test_a_small_retrieval_dev_set_is_noted_by_its_distinct_queries():
    """The small-dev-set note counts a retrieval set's distinct queries, not its rows: 40 rows of 20 queries (each
    given twice, with two positives) are 20 queries, noted as such; 30 distinct queries are not noted."""
    repeated = RetrievalSet("dev", [f"query {i % 20}" for i in range(40)], [f"document {i}" for i in range(40)])
    assert small_dev_set_note(repeated, "dev_examples") == (
        "angle_train: note: dev_examples has 20 distinct queries: a dev score over fewer than 30 is noisy, so best/ is "
        "picked partly by chance; a larger dev set picks it more reliably")
    enough = RetrievalSet("dev", [f"query {i}" for i in range(30)], [f"document {i}" for i in range(30)])
    assert small_dev_set_note(enough, "dev_examples") is None


def test_the_model_card_describes_a_retrieval_dev_set_as_the_evaluation_ranks_it():
    """The model card counted a retrieval dev set's (query, positive) rows: a query given with two positives, or a
    row given twice, counted as two. It says what was evaluated: the distinct queries, the documents of the corpus
    (each distinct positive once) and the relevant (query, document) pairs."""
    rows = RetrievalSet("dev", ["q1", "q1", "q2", "q2", "q3"], ["doc a", "doc b", "doc a", "doc a", "doc c"])
    assert dev_description(rows) == ("3 distinct queries, 3 documents in the corpus, 4 relevant (query, document) "
                                     "pairs")
    assert dev_description(dev_set_of(demo_sts_examples(12), run_config("unused"))) == "12 scored pairs"


def _write_scored(path, labels) -> str:
    """An STS-B file (tab-separated, score in field 5) of one pair of distinct texts per label."""
    path.write_text("".join(f"main-captions\tMSRvid\t2012test\t{i:04d}\t{label:.3f}\ta man plays guitar number {i}"
                            f"\tsomeone is playing music {i}\n" for i, label in enumerate(labels)), encoding="utf-8")
    return str(path)


def test_a_dev_set_too_small_to_rank_models_is_refused_and_a_small_one_is_noted(tmp_path, capsys, monkeypatch):
    """Spearman's rho over 2 scored pairs is +1 or -1 whatever the model: a 2-pair --dev-data picked best/ by a
    coin's toss, in silence. It is refused before the model loads, naming the flag and the count, as a dev set whose
    gold scores are all equal is (no correlation at all: NaN); a dev set of fewer than 30 pairs is noted as noisy,
    and one of 30 trains in silence."""
    from angle_train import trainer

    loaded = trainer.build_encoder
    monkeypatch.setattr(trainer, "build_encoder", lambda *args: pytest.fail("the model loaded before the refusal"))
    two = _write_scored(tmp_path / "two.csv", [1.0, 4.0])
    with pytest.raises(DataError, match=rf"^--dev-data {re.escape(two)}: 2 rated pair\(s\); a Spearman correlation "
                                        r"needs at least 3 \(over 2 it is \+1 or -1 whatever the model\)$"):
        train(run_config(tmp_path / "run", dev_data=two))
    constant = _write_scored(tmp_path / "constant.csv", [3.0] * 8)
    with pytest.raises(DataError, match=rf"^--dev-data {re.escape(constant)}: every gold score is 3, so the Spearman "
                                        "correlation is undefined"):
        train(run_config(tmp_path / "run", dev_data=constant))
    monkeypatch.setattr(trainer, "build_encoder", loaded)
    settings = dict(batch_size=8, max_steps=1, max_length=12)
    few = _write_scored(tmp_path / "few.csv", [i % 5 for i in range(6)])
    train(run_config(tmp_path / "few", dev_data=few, **settings))
    assert (f"angle_train: note: --dev-data {few} has 6 scored pairs: a dev score over fewer than 30 is noisy, so "
            "best/ is picked partly by chance; a larger dev set picks it more reliably\n") in capsys.readouterr().out
    train(run_config(tmp_path / "enough", dev_data=_write_scored(tmp_path / "enough.csv", [i % 5 for i in range(30)]),
                     **settings))
    assert "is noisy" not in capsys.readouterr().out


def test_the_dev_score_reads_the_texts_cut_at_max_length(tmp_path):
    """The dev evaluation embeds the dev texts as training reads them, cut at --max-length, not at the longer
    --export-max-length the exports record for inference."""
    from angle_train.evaluate import StsSet, dev_inputs, scores_of_embeddings

    dev = [Example((" ".join([ex.texts[0]] * 4), ex.texts[1]), ex.label) for ex in demo_sts_examples(16)]
    cfg = run_config(tmp_path, model="builtin:tiny-bert", batch_size=8, max_steps=1, max_length=8,
                     export_max_length=32, cosine_w=1.0, ibn_w=0.0, angle_w=1.0)
    result = train(cfg, train_examples=(demo_sts_examples(16, seed=4), "A"), dev_examples=dev)
    dev_set = StsSet("dev", dev)

    def score(length):
        embeddings = [result.encoder.encode(texts, result.tokenizer, prompt_name=role, max_length=length)
                      for texts, role in dev_inputs(dev_set)]
        return scores_of_embeddings(dev_set, embeddings, [])["dev_spearman"]

    assert score(8) != pytest.approx(score(32), abs=1e-6)  # the cut changes the score
    assert result.evals[-1]["dev_spearman"] == pytest.approx(score(8), abs=1e-6)


def test_a_batch_that_does_not_split_over_the_processes_names_the_flag(tmp_path):
    """--batch-size 7 over 2 processes: the one line names the flag and what to give (it said batch_size)."""
    from angle_train.trainer import count_steps

    with pytest.raises(ValueError, match=r"^--batch-size 7 must be divisible by the number of processes \(2\): each "
                                         r"takes an equal share; use a multiple of 2$"):
        count_steps(run_config(tmp_path, batch_size=7), n_examples=100, world_size=2)
    assert count_steps(run_config(tmp_path, batch_size=8, max_steps=3), n_examples=100, world_size=2) == 3


def test_a_batch_that_does_not_split_is_refused_with_max_steps_before_the_model_loads(tmp_path, monkeypatch):
    """--batch-size 7 --max-steps 3 over 2 processes: each took 3 of the 7 pairs and the seventh of every batch was
    trained by no process, without a word (only a run counted in --epochs was checked). Now refused, before the
    model loads (the process group pretended: 2 processes)."""
    from angle_train import distributed, trainer
    from angle_train.tiny import demo_examples

    monkeypatch.setattr(distributed, "init_distributed", lambda *args, **kwargs: distributed.DistInfo(0, 2))
    monkeypatch.setattr(trainer, "build_encoder", lambda *args: pytest.fail("the model loaded"))
    with pytest.raises(ValueError, match=r"^--batch-size 7 must be divisible by the number of processes \(2\)"):
        trainer.train(run_config(tmp_path, batch_size=7, max_steps=3, model="builtin:tiny-bert"),
                      train_examples=(demo_examples(24), "B"))


def test_without_a_progress_bar_no_empty_line_precedes_the_dev_scores(tmp_path, capsys):
    """The line break before a dev score or a skipped step's line ends the progress bar's line: with --progress 0
    there is none to end, and each such line came after an empty one."""
    from angle_train.tiny import demo_examples, demo_sts_examples
    from angle_train.trainer import train

    train(run_config(tmp_path, batch_size=8, max_steps=2, eval_every=1, max_length=12),
          train_examples=(demo_examples(16), "B"), dev_examples=demo_sts_examples(12))
    out = capsys.readouterr().out
    assert re.search(r"^step 1: dev Spearman ", out, flags=re.MULTILINE) and "\n\n" not in out


def test_dev_examples_replace_the_dev_flags_and_the_source_they_name_is_not_checked(tmp_path):
    """train()'s dev_examples replace --dev-data, whose source is then not read: yet a --dev-split given with a
    --dev-data file, or with a built-in dev set, was refused as a split of that source, and --columns was taken as
    reading the --dev-data file (so kept with built-in training data, where nothing reads it). The split is refused
    where its source is read, and --columns where nothing reads it."""
    from test_cli_errors import write_stsb

    dev_file = str(write_stsb(tmp_path / "dev.csv"))
    data, dev = (demo_examples(16), "B"), demo_sts_examples(12)
    for i, dev_data in enumerate((dev_file, "builtin:demo-sts")):
        result = train(run_config(tmp_path / f"run-{i}", batch_size=8, max_steps=1, max_length=12, dev_data=dev_data,
                                  dev_split="test"), train_examples=data, dev_examples=dev)
        assert [row["step"] for row in result.evals] == [1]
    with pytest.raises(ValueError, match="^--dev-split test says which split of a Hugging Face dataset to read"):
        train(run_config(tmp_path / "read", batch_size=8, max_steps=1, dev_data=dev_file, dev_split="test"),
              train_examples=data)
    with pytest.raises(ValueError, match="^--columns says how to read a file or dataset, and --train-data builtin:demo "
                                         "is built in: leave out --columns"):
        train(run_config(tmp_path / "columns", batch_size=8, max_steps=1, dev_data=dev_file, columns=["text1=s1"]),
              dev_examples=dev)


def _set_up_given(tmp_path, model, **settings):
    """trainer.setup of a one-step run of `model` (given to train()), closed again: its Run."""
    run = trainer.setup(run_config(tmp_path, batch_size=8, max_steps=1, max_length=12, **settings), model=model,
                        train_examples=(demo_examples(8, seed=4), "B"))
    run.data_ahead.close()
    run.log.close()
    run.lock.release()
    return run


def test_the_settings_a_given_model_can_take_apply_to_it(tmp_path, capsys):
    """--fp16, --pooling and --gradient-checkpointing with a model given to train() apply to it as to the model
    angle_train loads (they were ignored: no autocast with loss scaling on, the model's own pooling, no
    checkpointing); a given model's own autocast, no flag given, is the run's: fp16 gets its loss scaling."""
    run = _set_up_given(tmp_path / "flags", make_encoder("bert", dtype=torch.float32, layers=1), fp16=True,
                        pooling="avg", gradient_checkpointing=True)
    assert (run.encoder.autocast, run.encoder.pooling) == ("fp16", "avg") and run.scaler.is_enabled()
    assert run.encoder.backbone.is_activation_checkpointing
    assert "pooling avg (--pooling)" in capsys.readouterr().out
    model = make_encoder("bert", dtype=torch.float32, layers=1)
    model[0].autocast = "fp16"
    run = _set_up_given(tmp_path / "own", model)
    assert run.cfg.fp16 and run.scaler.is_enabled()


@pytest.mark.parametrize("lora, settings, refusal", [
    (False, {"model_dtype": "bfloat16"}, r"--model-dtype bfloat16 casts the weights of the model angle_train loads, "
     r"and the model given to train\(\) has float32 weights, which train\(\) does not cast: cast the model yourself"),
    (False, {"lora": True}, r"--lora 1 adds LoRA adapters to the model angle_train loads, and the model given to "
     r"train\(\) has none, which train\(\) does not add: build them yourself"),
    (True, {"lora": True, "lora_r": 16}, r"--lora-r 16: the adapters of the model given to train\(\) have --lora-r 4, "
     r"and train\(\) trains them as they are"),
    (True, {"lora": True, "lora_targets": ["query"]}, r"--lora-targets query: the adapters of the model given to "
     r"train\(\) have --lora-targets dense key query value"),
    (True, {"lora": True, "lora_rslora": True}, r"--lora-rslora 1: the adapters of the model given to train\(\) have "
     r"--lora-rslora 0, and train\(\) trains them as they are"),
])
def test_settings_a_given_model_cannot_take_are_refused_before_any_work(tmp_path, lora, settings, refusal):
    """--model-dtype and the LoRA settings shape the model angle_train loads; a model given to train() kept its own
    weights' dtype and adapters in silence, and config.json recorded the LoRA defaults as the run's. A setting it
    cannot take is refused before the output folder is made; the same values as the model's, and the defaults, are
    not (LoRA r 16 is the default, left out here)."""
    model = make_encoder("bert", dtype=torch.float32, layers=1, lora=lora)
    with pytest.raises(ValueError, match=f"^{refusal}"):
        _set_up_given(tmp_path / "refused", model, **settings)
    assert not (tmp_path / "refused").exists()
    same = {"model_dtype": "float32", "lora_r": 4, "lora_rslora": False,
            "lora_targets": ["key", "value", "query", "dense"]}
    if "lora" not in settings or lora:
        taken = _set_up_given(tmp_path / "taken", model,
                              **{name: same.get(name, value) for name, value in settings.items()})
        # a LoRA run records the adapters' own settings (config.json, the checkpoints), not the defaults
        assert not lora or (taken.cfg.lora_r, taken.cfg.lora_alpha, taken.cfg.lora_rslora,
                            taken.cfg.lora_dropout) == (4, 8, False, 0.0)


@pytest.mark.parametrize("own_autocast", [False, True])
def test_fp16_is_refused_for_a_given_model_with_float16_trainable_weights(tmp_path, own_autocast):
    """--fp16 (or, with neither flag, a given model's own fp16 autocast, which the run takes) scales the loss, and
    torch's GradScaler cannot unscale the float16 gradients of float16 trainable weights: the run failed at its first
    optimizer step, its output folder made. It is refused before any work, as --model-dtype float16 with --fp16 is;
    float16 weights frozen under float32 LoRA adapters train with it."""
    model = make_encoder("bert", dtype=torch.float16, layers=1)
    model[0].autocast = "fp16" if own_autocast else None
    given = r'--fp16 \(the autocast "fp16" of the model given to train\(\)\)' if own_autocast else "--fp16"
    with pytest.raises(ValueError, match=f"^{given}: the model given to train\\(\\) has float16 trainable weights, "
                                         "and float16 weights take float16 gradients, which --fp16's loss scaling "
                                         "cannot unscale: cast its trainable weights to float32 .* or train with "
                                         "--bf16$"):
        _set_up_given(tmp_path / "refused", model, **({} if own_autocast else {"fp16": True}))
    assert not (tmp_path / "refused").exists()
    if not own_autocast:
        lora = make_encoder("bert", dtype=torch.float16, layers=1, lora=True)
        for weight in lora[0].parameters():
            if weight.requires_grad:
                weight.data = weight.data.float()
        assert _set_up_given(tmp_path / "lora", lora, fp16=True).scaler.is_enabled()


def test_gradient_checkpointing_is_refused_for_a_given_backbone_without_it(tmp_path):
    encoder = Encoder(torch.nn.Linear(2, 2), pooling="cls", is_decoder=False, pad_token_id=0)
    with pytest.raises(ValueError, match=r"^--gradient-checkpointing: the backbone of the model given to train\(\) "
                                         r"\(Linear\) is no transformers model that supports gradient checkpointing"):
        _set_up_given(tmp_path, (encoder, None), gradient_checkpointing=True)


def test_a_given_model_refused_at_setup_keeps_its_own_settings(tmp_path):
    """train() sets the run's pooling, autocast, prompts and gradient checkpointing on a model given to it before its
    last checks; a refused run left them there, and a second train() after the fix (--pooling left out) trained with
    the refused pooling in silence. The setup puts them back when it refuses."""
    from angle_train.data import Prompts
    from angle_train.models import recomputes_activations
    from angle_train.trainer import train

    encoder, tokenizer = make_encoder("llama", dtype=torch.float32)  # a causal decoder: first-token pooling refused
    encoder.eval()
    before = (encoder.pooling, encoder.autocast, encoder.prompts, encoder.max_length, encoder.bidirectional,
              encoder.attention_implementation)
    cfg = run_config(tmp_path / "run", pooling="cls", bf16=True, gradient_checkpointing=True, prompt="query: {text}",
                     attention="eager", max_steps=1, batch_size=4)
    with pytest.raises(ValueError, match="pooling"):
        train(cfg, model=(encoder, tokenizer), train_examples=(demo_examples(8, seed=1), "B"))
    assert (encoder.pooling, encoder.autocast, encoder.prompts, encoder.max_length, encoder.bidirectional,
            encoder.attention_implementation) == before
    assert before[0] == "last" and before[2] == Prompts() and before[5] == "sdpa"
    assert not recomputes_activations(encoder.backbone) and not encoder.training
