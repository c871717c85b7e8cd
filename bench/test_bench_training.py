"""bench_training.py on CPU at toy scale: the generated data, the commands each contender gets, and one end-to-end
run (--smoke: a tiny BERT built into tmp_path, a few dozen pairs, 1 repetition of 1 and 2 steps) of angle-train and
SentenceTransformerTrainer. Nothing asserts on how long anything took beyond being positive and finite: a step of
the tiny model takes far less time than the noise of starting a process, so a step estimate may even be negative.
"""

from __future__ import annotations

import json
import math

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


def test_smoke_run_end_to_end(tmp_path, smoke_assets):
    out = tmp_path / "out"
    model, stsb = smoke_assets
    assert bt.main(["--smoke", "--model", model, "--stsb", stsb, "--settings", "cached256", "--contenders", "ours,st",
                    "--reps", "1", "--steps", "1,2", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert (out / "table.md").is_file() and "| cached256 | ours |" in (out / "table.md").read_text()
    runs = results["runs"]
    assert {(r["contender"], r["steps"]) for r in runs} == {("ours", 1), ("ours", 2), ("st", 1), ("st", 2)}
    for r in runs:
        assert r["ok"], r
        assert r["seconds"] > 0 and math.isfinite(r["seconds"]) and r["peak_rss_bytes"] > 0
    rows = {r["contender"]: r for r in results["summary"]}
    assert set(rows) == {"ours", "st"}
    for row in rows.values():
        assert len(row["estimates_s"]) == 1 and math.isfinite(row["step_s"])
    assert results["settings"]["cached256"]["token_budget"] > 0
    assert results["versions"]["sentence-transformers"] and results["machine"]["torch_threads"] >= 1
    assert not list(out.glob("cached256-*"))  # every run's temporary folder is gone
