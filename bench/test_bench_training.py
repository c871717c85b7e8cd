"""bench_training.py on CPU at toy scale: the generated data, the commands each contender gets, and one end-to-end
run (--smoke: a tiny BERT built into tmp_path, a few dozen pairs, 1 repetition of 1 and 2 steps) of angle-train and
SentenceTransformerTrainer. Nothing asserts on how long anything took beyond being positive and finite: a step of
the tiny model takes far less time than the noise of starting a process, so a step estimate may even be negative.
"""

from __future__ import annotations

import contextlib
import json
import math
import random
import resource
import time
from pathlib import Path

import pytest

import bench_training as bt


@pytest.fixture(scope="module")
def smoke_assets(tmp_path_factory):
    folder = tmp_path_factory.mktemp("smoke")
    model, stsb = bt.build_smoke_assets(folder)
    return model, stsb


def test_generated_data_of_every_setting(smoke_assets):
    from transformers import AutoTokenizer

    from angle_train.data import load_examples

    model, stsb = smoke_assets
    examples, fmt = load_examples(f"{stsb}/sts-train.csv", layout="stsb")
    assert fmt == "A" and len(examples) == 48
    tokenizer = AutoTokenizer.from_pretrained(model)
    for setting in bt.SMOKE_SETTINGS.values():
        rows = bt.setting_rows(setting, examples, tokenizer)
        stats = bt.token_stats(rows, setting, tokenizer)
        assert set(rows[0]) == ({"text1", "text2", "label"} if setting.fmt == "A" else {"query", "positive"})
        assert stats["tokens_per_step"] == pytest.approx(setting.batch * stats["mean_tokens_per_pair"])
        assert ("token_budget" in stats) == (setting.chunk > 0)
        if setting.doc_tokens:
            lo, hi = setting.doc_tokens
            assert len(rows) == setting.pairs
            assert rows == bt.setting_rows(setting, examples, tokenizer)  # deterministic
            docs = [len(ids) for ids in tokenizer([r["positive"] for r in rows])["input_ids"]]
            assert max(docs) <= hi and sum(d >= lo for d in docs) >= 0.9 * len(docs)


def test_contender_commands_use_real_flags(tmp_path):
    from angle_train.cli import build_parser

    setting = bt.SETTINGS["cached256"]
    values = {"chunk": setting.chunk, "token_budget": 1234}
    for name, (kind, flags) in bt.CONTENDERS.items():
        flags = [f.format(**values) for f in flags]
        argv = bt.COMMANDS[kind](setting, flags, "/m", tmp_path / "d.jsonl", 3, tmp_path / "o")
        if kind == "ours":
            parsed = build_parser().parse_args(argv[3:])  # after: python -m angle_train.cli
            assert (parsed.save_final, parsed.save_best, parsed.eval_every, parsed.warmup) == (False, False, 0, 0)
            assert (parsed.batch_size, parsed.max_steps, parsed.ibn_w, parsed.cosine_w) == (256, 3, 1, 0)
        else:
            assert argv[2] == "st-train" and "--max-steps" in argv
    plain = bt.SETTINGS["plain16"]
    assert bt.applies(bt.CONTENDERS["st"][1], plain) and not bt.applies(bt.CONTENDERS["st-tokens"][1], plain)


def in_process_after_the_first_of_each_kind(children: list[list[str]]):
    """run_child's stand-in for the smoke run: each trainer's first run is a real child process (bt.run_child: the
    command line as the GPU machine launches it, its wall clock and peak RSS from os.wait4); the later ones run the
    same argv in this process (angle_train.cli.main, bt.st_train: the same training, losses and logs, written to
    the same files), which saves a process start and the imports of torch, transformers and sentence-transformers
    a run. `children`: the argv of every run that got a process of its own."""
    from angle_train import cli

    def run(argv, workdir, timeout, env=None):
        assert env is None  # the CPU runs' children take this process's environment: nothing to set in-process
        kind = "st" if "st-train" in argv else "ours"
        if not any(("st-train" in child) == (kind == "st") for child in children):
            children.append(argv)
            return bt.run_child(argv, workdir, timeout, env)
        log_path = workdir / "output.log"
        start = time.perf_counter()
        with open(log_path, "w") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            # argv[2:]: st-train's argv as bench_training.py's main reads it; argv[3:]: after -m angle_train.cli
            returncode = bt.main(argv[2:]) if kind == "st" else cli.main(argv[3:])
        seconds = time.perf_counter() - start
        return {"seconds": seconds, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "returncode": returncode, "timed_out": False,
                "tail": log_path.read_text(errors="replace").splitlines()[-8:]}

    return run


def test_smoke_run_end_to_end(tmp_path, smoke_assets, monkeypatch):
    """Both trainers for real, in both kinds of loss (CoSENT on scored pairs, in-batch negatives with a gradient
    cache): their losses are compared step by step, and with the same batches, the same loss and dropout off they
    agree (a batch of other rows, or another loss, moves them by far more than the target). Each trainer's first
    run is a child process as on the GPU machine, the rest run in this process
    (in_process_after_the_first_of_each_kind)."""
    out = tmp_path / "out"
    model, stsb = smoke_assets
    children: list[list[str]] = []
    monkeypatch.setattr(bt, "run_child", in_process_after_the_first_of_each_kind(children))
    assert bt.main(["--smoke", "--model", model, "--stsb", stsb, "--settings", "plain16,cached256", "--contenders",
                    "ours,st", "--reps", "1", "--steps", "1,2", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    table = (out / "table.md").read_text()
    assert "| cached256 | ours |" in table and "| plain16 | st |" in table
    runs = results["runs"]
    assert {(r["setting"], r["contender"], r["steps"]) for r in runs} == {
        (s, c, n) for s in ("plain16", "cached256") for c in ("ours", "st") for n in (1, 2)}
    for r in runs:
        assert r["ok"], r
        assert r["seconds"] > 0 and math.isfinite(r["seconds"]) and r["peak_rss_bytes"] > 0
        assert len(r["in_process"]["losses"]) == r["steps"]  # every step's loss logged
    rows = {(r["setting"], r["contender"]): r for r in results["summary"]}
    assert set(rows) == {(s, c) for s in ("plain16", "cached256") for c in ("ours", "st")}
    for row in rows.values():
        assert len(row["estimates_s"]) == 1 and math.isfinite(row["step_s"])
        apart = row["losses_vs_other_trainer"]
        assert apart["steps_compared"] == 1 + 2 and apart["same_batches"], apart
        assert apart["max_rel_diff"] <= bt.LOSS_TARGET and apart["within_target"], apart
    stats = results["settings"]
    for setting in ("plain16", "cached256"):
        assert stats[setting]["angle_train_tokenise_s"] > 0
        assert results["losses"][setting]["within_target"] and results["losses"][setting]["steps_compared"] == 3
        said = bt.said_apart(results["losses"][setting], results["dropout"])
        assert settings_row(table, setting).endswith(f"pairs | {bt.said_tokenising(stats[setting])} | {said} |")
    assert "(within 2%" in table and "Dropout: off in both trainers" in table
    trained = json.loads((Path(results["model_trained"]) / "config.json").read_text())
    assert trained["hidden_dropout_prob"] == trained["attention_probs_dropout_prob"] == 0.0
    assert results["settings"]["cached256"]["token_budget"] > 0
    assert results["versions"]["sentence-transformers"] and results["machine"]["torch_threads"] >= 1
    assert not list(out.glob("cached256-*"))  # every run's temporary folder is gone
    assert [child[2] for child in children] == ["angle_train.cli", "st-train"]  # a process of its own: each trainer


def test_losses_apart_finds_the_largest_difference():
    """The loss comparison pairs runs of the same repetition and length, finds the largest relative difference at
    a step both logged, and says when the st-train run read other batches than angle-train's."""
    def run(kind, rep, steps, losses, order="angle-train"):
        record = {"contender": kind, "kind": kind, "rep": rep, "steps": steps, "ok": True,
                  "in_process": {"losses": losses}}
        return {**record, "said": {"batch_order": order}} if kind == "st" else record

    ours = [run("ours", 1, 2, [2.0, 1.0]), run("ours", 2, 2, [2.0, 1.03])]
    theirs = [run("st", 1, 2, [2.0, 1.0]), run("st", 2, 2, [2.02, 1.0]), run("st", 1, 3, [9.0, 9.0, 9.0])]
    apart = bt.losses_apart(ours, theirs)
    assert apart["max_rel_diff"] == pytest.approx(0.03) and not apart["within_target"] and apart["same_batches"]
    assert apart["at"]["rep"] == 2 and apart["at"]["step"] == 2 and apart["steps_compared"] == 4
    assert bt.losses_apart(ours[:1], theirs[:1])["max_rel_diff"] == 0.0
    assert not bt.losses_apart(ours[:1], [run("st", 1, 2, [2.0, 1.0], order="own")])["same_batches"]
    assert bt.losses_apart(ours, [run("st", 1, 3, [1.0] * 3)]) is None  # no pair of the same length
    other_batches = bt.losses_apart(ours, [run("st", 2, 2, [2.5, 1.0], order="own")])
    said = bt.said_apart(other_batches, bt.DROPOUT_SAID["model"])
    assert said.startswith("20.00% (over 2%") and "other batches" in said and "dropout on" in said
    assert bt.said_apart(apart, bt.DROPOUT_SAID["off"]).startswith("3.00% (over 2%; at step 2 of a 2-step run")
    assert bt.relative_difference(float("nan"), 1.0) == math.inf


def test_losses_that_were_not_finite_read_back_from_the_results_as_null():
    """results.json and the sentence-transformers report are strict JSON: a NaN loss and the infinite difference it
    makes are null there, which a resumed run compares and renders as the NaN and infinity they were."""
    ours = [{"contender": "ours", "kind": "ours", "rep": 1, "steps": 2, "ok": True,
             "in_process": {"losses": [2.0, math.nan]}}]
    theirs = [{"contender": "st", "kind": "st", "rep": 1, "steps": 2, "ok": True,
               "said": {"batch_order": "angle-train"}, "in_process": {"losses": [2.0, 1.0]}}]
    stored_ours, stored_theirs = json.loads(bt.harness.json_text([ours, theirs]))
    assert stored_ours[0]["in_process"]["losses"] == [2.0, None]
    apart = bt.losses_apart(stored_ours, stored_theirs)
    assert apart["max_rel_diff"] == math.inf and not apart["within_target"]
    stored = json.loads(bt.harness.json_text(apart))
    assert stored["max_rel_diff"] is None
    assert bt.said_apart(stored).startswith("inf% (over 2%; at step 2 of a 2-step run")


def test_st_train_reads_angle_train_batches(tmp_path, smoke_assets, monkeypatch):
    """st-train's batches are angle-train's, step after step across epochs: the rows its collator receives are
    those of the batches angle-train's trainer takes (angle_train.trainer.next_batches, recorded in a real run of
    each trainer on the same file)."""
    import angle_train.trainer as trainer
    import sentence_transformers
    from angle_train import cli

    model, _ = smoke_assets
    rows = [{"query": f"query {i}", "positive": f"positive {i}"} for i in range(10)]
    data = tmp_path / "b.jsonl"
    bt.write_jsonl(data, rows)
    steps, batch = 7, 4  # 2 full batches an epoch: the run goes through 4 epochs
    ours: list[list[str]] = []
    next_batches = trainer.next_batches

    def recorded_batches(run):
        taken = next_batches(run)
        ours.extend([rows[i]["query"] for i in b] for b in taken)
        return taken

    monkeypatch.setattr(trainer, "next_batches", recorded_batches)
    setting = bt.replace(bt.SMOKE_SETTINGS["cached256"], batch=batch)
    argv = bt.ours_command(setting, ["--chunk-size", "2"], model, data, steps, tmp_path / "ours")
    assert cli.main(argv[3:]) == 0
    theirs: list[list[str]] = []
    collator = sentence_transformers.SentenceTransformerTrainer.data_collator_class
    collate = collator.__call__

    def collate_recorded(self, features, *args, **kwargs):
        theirs.append([f["anchor"] for f in features])
        return collate(self, features, *args, **kwargs)

    monkeypatch.setattr(collator, "__call__", collate_recorded)
    argv = bt.st_command(setting, ["--mini-batch-size", "2"], model, data, steps, tmp_path / "st")
    assert bt.st_train(argv[3:]) == 0
    assert len(ours) == steps and theirs[:steps] == ours


# ----------------------------------------------------------------------------------------------------------
# The GPU settings, dry-run on CPU: the trainers replaced by a stand-in that writes what each writes
# ----------------------------------------------------------------------------------------------------------

OURS_STEP_S, ST_STEP_S, FIRST_STEP_S, START_S = 0.1, 0.2, 1.0, 2.0


def settings_row(table: str, setting: str) -> str:
    """The setting's row of the table's second table (the settings'): the last line that starts with its name."""
    return [line for line in table.splitlines() if line.startswith(f"| {setting} |")][-1]


def _flag(argv, name):
    return argv[argv.index(name) + 1]


def stand_in_losses(argv, steps: int, batch: int) -> list[float]:
    """A stand-in trainer's losses: a function of the rows of each step's batch. angle-train's batches are its
    trainer's (angle_train.data.epoch_batches, epoch after epoch); st-train's are those too where it is asked to read
    them (--batch-order angle-train), else a seeded shuffle of its own (its trainer's random sampler)."""
    from angle_train.data import epoch_batches

    n = sum(1 for line in Path(_flag(argv, "--train-data")).read_text().splitlines() if line.strip())
    if "st-train" in argv and ("--batch-order" not in argv or _flag(argv, "--batch-order") != "angle-train"):
        order = list(range(n))
        random.Random(bt.SEED).shuffle(order)
        batches = [order[s:s + batch] for s in range(0, n - batch + 1, batch)]
    else:
        batches = [b for epoch in range(steps) for b in epoch_batches(n, batch, seed=bt.SEED, epoch=epoch)]
    return [1.0 + sum(batches[k % len(batches)]) / (n * batch) for k in range(steps)]


class VirtualClock:
    """time.monotonic for the time-budget tests: the real clock plus the seconds the stand-in trainers' runs say
    they took, so that those seconds count against a --time-budget without being waited for."""

    def __init__(self):
        self.real, self.ahead = time.monotonic, 0.0

    def __call__(self) -> float:
        return self.real() + self.ahead


def virtual_clock(monkeypatch) -> VirtualClock:
    """A VirtualClock put in place of time.monotonic for the test."""
    clock = VirtualClock()
    monkeypatch.setattr(time, "monotonic", clock)
    return clock


def resumable_gpu_command(out: Path, settings: str, *, reps: int, budget: int) -> list[str]:
    """The GPU settings' dry run on CPU with --resume inside a --time-budget: ours-packed against st."""
    return ["--gpu", "--smoke", "--device", "cpu", "--out", str(out), "--settings", settings,
            "--contenders", "ours-packed,st", "--reps", str(reps), "--time-budget", str(budget), "--resume"]


def stand_in_trainers(calls: list, stop_at: int | None = None, oom=lambda argv: False, killed=lambda argv: False,
                      seconds=None, clock: VirtualClock | None = None):
    """run_child's stand-in: for angle-train a metrics.jsonl row per step and its summary line, for st-train its
    report (or exit 4 for padding-free inputs, as without flash_attn); wall clock = START_S + the steps' seconds,
    or `seconds(argv)` where that is not None. Call number `stop_at`, and the runs `killed(argv)` picks, run past
    their time limit (a run the time budget kills: it takes all it was given); a run `oom(argv)` picks runs out of
    memory. With a `clock`, every run's seconds pass on it."""

    def run(argv, workdir, timeout, env=None):
        record = ran(argv, timeout)
        if clock is not None:
            clock.ahead += record["seconds"]
        return record

    def ran(argv, timeout):
        calls.append(argv)
        steps, batch = int(_flag(argv, "--max-steps")), int(_flag(argv, "--batch-size"))
        out = Path(_flag(argv, "--output-dir"))
        out.mkdir(parents=True, exist_ok=True)
        if len(calls) == stop_at or killed(argv):
            return {"seconds": timeout, "peak_rss_bytes": 1, "returncode": -9, "timed_out": True, "tail": ["..."]}
        if oom(argv):
            return {"seconds": START_S, "peak_rss_bytes": 1, "returncode": 1, "timed_out": False,
                    "tail": ["torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 16.00 GiB"]}
        record = {"peak_rss_bytes": 10**8, "returncode": 0, "timed_out": False, "tail": []}
        step_s = ST_STEP_S if "st-train" in argv else OURS_STEP_S
        times = [FIRST_STEP_S] + [step_s] * (steps - 1)
        losses = stand_in_losses(argv, steps, batch)
        if "st-train" in argv:
            if "--unpad-inputs" in argv:
                return {**record, "seconds": START_S, "returncode": bt.ST_UNSUPPORTED,
                        "tail": ["unsupported: flash_attn is not installed"]}
            order = _flag(argv, "--batch-order") if "--batch-order" in argv else "own"
            (out / "st_report.json").write_text(json.dumps({"global_step": steps, "step_seconds": times,
                                                            "losses": losses, "peak_memory_bytes": 2**30,
                                                            "batch_order": order}))
        else:
            rows = [{"step": k + 1, "loss": loss, "pairs_per_s": batch / t, "peak_mem_gb": 0.5}
                    for k, (t, loss) in enumerate(zip(times, losses))]
            (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
            record["tail"] = [f"done: {steps} steps | last loss 1.0000"]
        took = None if seconds is None else seconds(argv)
        return {**record, "seconds": START_S + steps * step_s if took is None else took}

    return run


def test_gpu_settings_dry_run_names_every_setting_and_contender(tmp_path, monkeypatch):
    """The GPU settings' code path on CPU (--gpu --smoke --device cpu): the tiny models (bert-base built from its
    config), generated data, every contender's command (parsed by the real parsers; angle-train's forward passes the
    same as on a GPU), warm-ups, the step times, the
    cold first step apart from the warm ones, a contender out of memory (not run again in that setting), and a
    table and results.json that name every setting and contender."""
    from angle_train.cli import build_parser, config_from_args

    calls = []

    def st_at_the_largest_batch(argv):
        return argv[2] == "st-train" and Path(_flag(argv, "--train-data")).stem == "bert-base-cached64k"

    monkeypatch.setattr(bt, "run_child", stand_in_trainers(calls, oom=st_at_the_largest_batch))
    out = tmp_path / "out"
    assert bt.main(["--gpu", "--smoke", "--device", "cpu", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    table = (out / "table.md").read_text()
    settings, contenders = list(bt.GPU_SMOKE_SETTINGS), list(bt.GPU_CONTENDERS)
    assert set(results["settings"]) == set(settings) and set(results["contenders"]) == set(contenders)
    assert results["data"].startswith("48 generated pairs") and set(results["models"]) == {"minilm", "bert-base"}
    assert all(m["attention"] == "sdpa" for m in results["models"].values())
    stats = results["settings"]
    for s in stats.values():  # angle-train's tokenising, timed apart, and its share of a step of an epoch
        assert s["angle_train_tokenise_s"] > 0 and s["steps_per_epoch"] == max(1, s["pairs"] // s["batch"])
        assert s["angle_train_tokenise_per_step_s"] == pytest.approx(s["angle_train_tokenise_s"] / s["steps_per_epoch"])
    rows = {(r["setting"], r["contender"]): r for r in results["summary"]}
    measured = ("ours-packed", "ours-padded", "st")
    assert set(rows) == {(s, c) for s in settings for c in measured}
    largest = rows.pop(("bert-base-cached64k", "st"))
    assert largest["failed_runs"] == 1 and largest["failure"] == "out of memory" and "step_s" not in largest
    assert sum(map(st_at_the_largest_batch, calls)) == 1  # its long run was not tried
    assert "| bert-base-cached64k | st | no estimate (1 runs failed: out of memory) |" in table
    for (setting, contender), row in rows.items():
        step = ST_STEP_S if contender == "st" else OURS_STEP_S
        assert row["step_s"] == pytest.approx(step) and row["in_process_step_s"] == pytest.approx(step)
        assert row["first_step_s"] == pytest.approx(FIRST_STEP_S)
        assert (row.get("first_step_empty_caches_s") is not None) == (contender != "st" or setting == settings[0])
        assert row.get("st_best_over_this") == (None if setting == "bert-base-cached64k" else
                                                pytest.approx(ST_STEP_S / step))
        # tokenising charged: angle-train's step plus its tokenising spread over an epoch; st's tokenises in its steps
        charged = step + (stats[setting]["angle_train_tokenise_per_step_s"] if contender != "st" else 0.0)
        assert row["step_s_tokenising_charged"] == pytest.approx(charged)
        assert row["pairs_per_s_tokenising_charged"] == pytest.approx(stats[setting]["batch"] / charged)
        assert (row["pairs_per_s_tokenising_charged"] < row["pairs_per_s"]) == (contender != "st")
        assert row.get("st_best_over_this_tokenising_charged") == (None if setting == "bert-base-cached64k" else
                                                                   pytest.approx(ST_STEP_S / charged))
        assert f"| {setting} | {contender} |" in table
        if setting != "bert-base-cached64k":  # there, st ran out of memory: nothing to compare with
            apart = row["losses_vs_other_trainer"]
            assert apart["max_rel_diff"] == 0.0 and apart["within_target"] and apart["same_batches"], apart
    for setting in settings:  # the two trainers' losses step by step, from the same batches
        if setting == "bert-base-cached64k":
            assert results["losses"][setting]["why"].startswith("not compared")
            continue
        apart = results["losses"][setting]
        assert apart["max_rel_diff"] == 0.0 and apart["within_target"] and apart["steps_compared"] == 2 * (1 + 2)
        said = bt.said_apart(apart, results["dropout"])
        assert settings_row(table, setting).endswith(f"pairs | {bt.said_tokenising(stats[setting])} | {said} |")
    assert all(x["contender"] == "st-unpadded" and x["unsupported"] for x in results["skipped"])
    assert {x["setting"] for x in results["skipped"]} == set(settings)
    assert "Absent: st-unpadded (every setting): unsupported: flash_attn is not installed" in table
    assert all(f"| {s} |" in table for s in settings) and "first step, empty caches" in table
    assert "pairs/s, tokenising charged" in table and "ST best / this, tokenising charged" in table
    assert bt.TOKENISING_SAID in table
    # every command as the trainers' own parsers read it
    ours = [build_parser().parse_args(argv[3:]) for argv in calls if argv[1:3] == ["-m", "angle_train.cli"]]
    st = [bt.st_parser().parse_args(argv[3:]) for argv in calls if argv[2] == "st-train"]
    assert ours and st and len(ours) + len(st) == len(calls)
    assert all(a.device == "cpu" and a.bf16 and a.log_every == 1 and a.model_dtype == "float32" for a in ours)
    assert {a.pack for a in ours} == {0, bt.DEFAULT_PACK_WIDTH}
    # the dry run's passes are the GPU run's: each command's --pack and --pass-tokens resolve alike on both devices
    for argv in calls:
        if argv[1:3] == ["-m", "angle_train.cli"]:
            passes = []
            for device in ("cpu", "cuda"):
                cfg = config_from_args(argv[3:])
                cfg.resolve_passes(device)
                passes.append((cfg.pack, cfg.pass_tokens))
            assert passes[0] == passes[1], (argv, passes)
    assert all(a.bf16 and a.log_losses and a.attention in ("sdpa", "flash_attention_2") for a in st)
    assert {Path(a.model).name for a in ours} == {"minilm-no-dropout", "bert-base-no-dropout"}
    assert not list(out.glob("*-cached*-*"))  # every run's temporary folder is gone


def test_gpu_settings_resume_after_the_time_budget_stops_them(tmp_path, monkeypatch):
    """A run killed at the end of its time allowance stops the command and abandons its round; --resume runs that
    round again whole and nothing recorded whole; results made otherwise are refused."""
    out = tmp_path / "out"
    argv = resumable_gpu_command(out, "minilm-plain64,bert-base-cached1k", reps=2, budget=300)
    calls = []
    clock = virtual_clock(monkeypatch)

    def sixth_is_slow(argv):  # minilm-plain64's st long run: 250 of the 300 s, so that the 9th run starts near the end
        return 250.0 if len(calls) == 6 else None

    monkeypatch.setattr(bt, "run_child", stand_in_trainers(calls, stop_at=9, seconds=sixth_is_slow, clock=clock))
    assert bt.main(argv) == 0
    first = json.loads((out / "results.json").read_text())
    # minilm-plain64: 2 warm-ups, rep 1's 4 runs; bert-base-cached1k: 1 warm-up (angle-train's), then its rep 1:
    # ours-packed's short run, and st's (the 9th) runs out of time: the round's 2 runs are abandoned
    assert len(calls) == 9 and first["left"] == ["bert-base-cached1k rep 1", "minilm-plain64 rep 2",
                                                 "bert-base-cached1k rep 2"]
    assert [r["stopped"] for r in first["runs"] if r.get("stopped")] == ["time budget"]
    assert sum(bool(r.get("abandoned")) for r in first["runs"]) == 2 and first["not_run"] == []
    calls.clear()
    monkeypatch.setattr(bt, "run_child", stand_in_trainers(calls, clock=clock))
    assert bt.main(argv) == 0
    second = json.loads((out / "results.json").read_text())
    assert second["left"] == [] and len(second["resumed_by"]) == 1
    # bert-base-cached1k: 2 warm-ups (this command's first) and rep 1; minilm-plain64: 1 warm-up and rep 2;
    # bert-base-cached1k rep 2. Nothing recorded whole runs again.
    assert len(calls) == 2 + 4 + 1 + 4 + 4
    assert [Path(_flag(a, "--train-data")).stem for a in calls].count("minilm-plain64") == 1 + 4
    rows = {(r["setting"], r["contender"]): r for r in second["summary"]}
    assert len(rows) == 4 and all(len(r["estimates_s"]) == 2 for r in rows.values())
    assert bt.main([*argv, "--pack-width", "64"]) == 2  # other settings: refused


def test_forecast_learns_from_a_killed_run():
    """A run killed at its time limit ran at least that long: a lower bound of its length's time and of every
    longer run's, also where no run of that length ended well."""
    def run(steps, seconds, ok=True):
        return {"steps": steps, "seconds": seconds, "ok": ok, "timed_out": not ok}

    ended = [run(1, 3.0), run(2, 5.0)]
    assert bt.forecast_seconds(ended, 4) == pytest.approx(9.0)
    assert bt.forecast_seconds([*ended, run(2, 40.0, ok=False)], 2) == 40.0
    assert bt.forecast_seconds([*ended, run(2, 40.0, ok=False)], 4) == 40.0
    assert bt.forecast_seconds([*ended, run(2, 40.0, ok=False)], 1) == 3.0  # a shorter run: not bounded by it
    assert bt.forecast_seconds([run(3, 7.0, ok=False)], 3) == 7.0 and bt.forecast_seconds([], 3) is None


def resumed_until_done(argv: list[str], out: Path, commands: int) -> list[dict]:
    """Up to `commands` runs of the same command line (--resume), until one says nothing is left: the results.json
    after each."""
    after = []
    for _ in range(commands):
        assert bt.main(argv) == 0
        after.append(json.loads((out / "results.json").read_text()))
        if not after[-1]["left"]:
            break
    return after


def test_resume_passes_a_round_too_long_for_any_command(tmp_path, monkeypatch):
    """A round whose run is killed at the end of the time budget although the round had the whole command to
    itself cannot be run by a command of that budget: it is recorded as not run, with why, and passed by the next
    command too, which measures the rounds after it and says done; before, every command ran it again and was
    killed in it again."""
    out = tmp_path / "out"
    argv = resumable_gpu_command(out, "minilm-plain64,minilm-cached1k", reps=1, budget=300)
    calls = []
    clock = virtual_clock(monkeypatch)

    def plain64_st_long_run(argv):  # longer than any command of this budget has
        return "st-train" in argv and Path(_flag(argv, "--train-data")).stem == "minilm-plain64" and \
            _flag(argv, "--max-steps") == "2"

    monkeypatch.setattr(bt, "run_child", stand_in_trainers(calls, killed=plain64_st_long_run, clock=clock))
    after = resumed_until_done(argv, out, commands=4)
    assert len(after) == 2 and after[-1]["left"] == []
    assert [(x["setting"], x["rep"]) for x in after[0]["not_run"]] == [("minilm-plain64", 1)]
    assert "first round" in after[0]["not_run"][0]["why"] and "reached the end" in after[0]["not_run"][0]["why"]
    assert after[0]["left"] == ["minilm-cached1k rep 1"] and after[1]["not_run"] == after[0]["not_run"]
    assert sum(plain64_st_long_run(a) for a in calls) == 1  # killed once, not once a command
    rows = {(r["setting"], r["contender"]): r for r in after[-1]["summary"]}
    assert all(len(rows["minilm-cached1k", c]["estimates_s"]) == 1 for c in ("ours-packed", "st"))
    calls.clear()
    assert bt.main(argv) == 0 and calls == []  # nothing left: a further command runs nothing
    table = (out / "table.md").read_text()
    assert "Not run: minilm-plain64 rep 1: the first round of a command of --time-budget 300 s" in table


def test_resume_passes_a_round_whose_warm_ups_exceed_their_allowance(tmp_path, monkeypatch):
    """The warm-up runs before a command's first setting, every contender's, must fit the warm-up allowance (a
    third of the budget). Where they cannot, the round is recorded as not run, with why, and the command ends
    instead of stopping in the warm-ups again every time: found by running them when nothing forecasts them, and by
    the forecast of every warm-up the round needs (not angle-train's alone) once they are known."""
    calls = []
    clock = virtual_clock(monkeypatch)

    def one_step_runs_are_slow(argv):  # the warm-ups (and any 1-step run): 7 s each
        return 7.0 if _flag(argv, "--max-steps") == "1" else None

    monkeypatch.setattr(bt, "run_child", stand_in_trainers(calls, seconds=one_step_runs_are_slow, clock=clock))

    def command(out, budget, reps=1):
        return resumable_gpu_command(out, "minilm-cached1k", reps=reps, budget=budget)

    # nothing forecasts the warm-ups: 7 s of angle-train's leaves 3 s of the 10, too little for st-train's
    after = resumed_until_done(command(tmp_path / "fresh", 30), tmp_path / "fresh", commands=3)
    assert len(after) == 1 and after[0]["left"] == [] and len(calls) == 1
    assert "warm-up allowance" in after[0]["not_run"][0]["why"]
    # the warm-ups known (7 s each, from a command of 60 s that fit them) and too long for a command of 30 s: the
    # forecast counts both contenders' and passes the round before running anything
    out = tmp_path / "known"
    assert bt.main(command(out, 60)) == 0
    assert json.loads((out / "results.json").read_text())["left"] == []
    calls.clear()
    after = resumed_until_done(command(out, 30, reps=2), out, commands=3)
    assert len(after) == 1 and after[0]["left"] == [] and calls == []
    assert after[0]["not_run"][0]["why"].startswith("its warm-up runs, estimated 14 s, exceed the warm-up allowance")


def test_gpu_suite_third_train_bench_runs_this_benchmark_resumably(tmp_path, monkeypatch):
    """`gpu_suite.py third --train-bench`: its one step runs this benchmark's GPU settings with --resume inside the
    step's limit (here in-process, as a dry run on CPU with the stand-in trainers), its data and models outside the
    packed folder; --resume-from copies the previous command's results.json, and a second command continues it."""
    import gpu_suite

    args = gpu_suite.parse_args(["third", str(tmp_path / "out"), "--train-bench"])
    with pytest.raises(SystemExit):
        gpu_suite.parse_args(["first", str(tmp_path / "out"), "--train-bench"])
    commands = []

    def run_logged(cmd, log_path, timeout_s, env=None, prefix=""):
        assert cmd[1] == "bench/bench_training.py" and timeout_s > float(cmd[cmd.index("--time-budget") + 1])
        commands.append(cmd)
        dry_run = ["--smoke", "--device", "cpu", "--settings", "minilm-plain64", "--contenders", "ours-packed,st"]
        returncode = bt.main([*cmd[2:], *dry_run, "--reps", str(len(commands))])
        return {"returncode": returncode, "timed_out": False, "seconds": 1.0, "last_line": "", "log": log_path.name}

    monkeypatch.setattr(gpu_suite, "run_logged", run_logged)
    monkeypatch.setattr(bt, "run_child", stand_in_trainers([]))
    steps = (("preflight", 0),) + gpu_suite.TRAIN_BENCH_STEPS
    for command, resume_from in enumerate((None, tmp_path / "first" / "work")):
        (tmp_path / f"out{command}").mkdir()
        record = gpu_suite.StageRecord(tmp_path / f"out{command}", "third", 520, ["third"],
                                       work=tmp_path / ("first" if command == 0 else "second") / "work")
        args.resume_from = resume_from and str(resume_from)
        gpu_suite.stage_train_bench(args, record, gpu_suite.Schedule(steps, time.monotonic()))
        step = record.data["steps"]["train_bench"]
        assert step["status"] == "ok" and step["done"], step
        results = json.loads((record.work / "train_bench" / "results.json").read_text())
        assert results["reps"] == command + 1 and len(results.get("resumed_by", [])) == command
        assert sorted(p.name for p in (record.work / "train_bench").iterdir()) == ["results.json", "table.md"]
    assert record.data["steps"]["resume"]["status"] == "ok"
    scratch = Path(commands[0][commands[0].index("--scratch") + 1])
    assert not scratch.exists()  # the data and models are gone with the step
