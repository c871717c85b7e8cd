"""angle-eval and angle_train.evaluate beyond the distribution layouts (test_angle_eval.py): SICK-R's pairs and
scores, the table's average, each prompt flag reaching its role, a prompt applied to both texts of an STS pair,
an adapter-only LoRA export scored from its recorded base, and each distinct text of scored pairs found and embedded
once.
Tiny models built from configs, no network."""

from __future__ import annotations

import json
import os

import pytest
import torch
from train_helpers import adapter_only_export, make_encoder

from angle_train.export import save_pretrained

PAIRS = [("a man plays a guitar", "a man is playing the guitar"), ("the cat sleeps", "a dog runs in the park"),
         ("two kids play football", "children kick a ball"), ("a plane lands", "the chef cooks pasta")]


def test_sick_pairs_are_read_as_sentence_a_and_sentence_b_with_the_relatedness_score(tmp_path):
    """SICK-R is scored on (sentence_A, sentence_B) against relatedness_score: the pairs themselves, not only their
    number, must come out of the file."""
    from angle_train.evaluate import read_dataset

    sick = tmp_path / "SICK_test_annotated.txt"
    sick.write_text("pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment\n"
                    + "".join(f"{i}\t{a}\t{b}\t{1 + i * 0.7:.1f}\tNEUTRAL\n" for i, (a, b) in enumerate(PAIRS))
                    + "\n", encoding="utf-8")  # a blank line at the end: skipped
    dataset = read_dataset(str(sick))
    assert dataset.name == "SICK-R"
    assert [(ex.texts, ex.label) for ex in dataset.examples] == [
        (pair, pytest.approx(1 + i * 0.7)) for i, pair in enumerate(PAIRS)]


def test_the_table_average_is_the_mean_of_the_datasets_scores():
    """The Avg. column angle-eval prints (the number papers report) is the mean of the STS columns, at each width."""
    from angle_train.evaluate import table

    printed = table({"STS12": 70.0, "STS13": 80.0, "STS12@8": 60.0, "STS13@8": 66.0}, dims=[8])
    lines = printed.splitlines()
    assert lines[0] == "| dims | STS12 | STS13 | Avg. |"
    assert lines[2] == "| all | 70.00 | 80.00 | 75.00 |"
    assert lines[3] == "| @8 | 60.00 | 66.00 | 63.00 |"
    assert table({"STS12": 70.0}) == "| STS12 |\n|---|\n| 70.00 |"  # one dataset at one width: no Avg., no dims


def test_angle_eval_gives_each_role_its_own_prompt_flag(tmp_path, monkeypatch):
    """--prompt, --query-prompt and --doc-prompt each set their own role's prompt for the evaluation; '' is none,
    over the export's own."""
    from angle_train import evaluate
    from angle_train.data import Prompts

    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    export = save_pretrained(encoder, tokenizer, str(tmp_path / "model"), max_length=16)
    retrieval = tmp_path / "nq-mini.jsonl"
    retrieval.write_text("".join(json.dumps({"query": a, "positive": b}) + "\n" for a, b in PAIRS), encoding="utf-8")
    seen = []
    monkeypatch.setattr(evaluate, "evaluate", lambda encoder, *a, **k: (seen.append(encoder.prompts), {})[1])
    assert evaluate.main([export, str(retrieval), "--prompt", "T: ", "--query-prompt", "Q: ",
                          "--doc-prompt", "D: "]) == 0
    (prompts,) = seen
    assert (prompts.text, prompts.query, prompts.document) == ("T: ", "Q: ", "D: ")
    encoder.prompts = Prompts(query="search: {text}", document="passage: {text}")
    export = save_pretrained(encoder, tokenizer, str(tmp_path / "prompted"), max_length=16)
    assert evaluate.main([export, str(retrieval), "--query-prompt", "", "--doc-prompt", ""]) == 0
    assert (seen[-1].for_role("query"), seen[-1].for_role("document")) == (None, None)


def test_sts_spearman_applies_a_given_prompt_to_both_texts():
    """sts_spearman(prompt=...) embeds text1 and text2 with the same template: the score is that of the cosines of the
    prompted texts on both sides."""
    from scipy.stats import spearmanr

    from angle_train.data import Example
    from angle_train.evaluate import sts_spearman

    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    examples = [Example(pair, float(i)) for i, pair in enumerate(PAIRS)]
    prompt = "a very big {text}"
    first = encoder.encode([a for a, _ in PAIRS], tokenizer, prompt=prompt)
    second = encoder.encode([b for _, b in PAIRS], tokenizer, prompt=prompt)
    cosine = torch.nn.functional.cosine_similarity(first, second)
    expected = spearmanr(cosine.numpy(), [ex.label for ex in examples]).statistic
    assert sts_spearman(encoder, tokenizer, examples, prompt=prompt) == pytest.approx(expected, abs=1e-12)


def test_a_json_path_that_cannot_be_written_is_refused_before_the_model_loads(tmp_path, monkeypatch, capsys):
    """--json naming a folder failed at the end ("[Errno 21] Is a directory"), after the whole evaluation, its results
    printed but not written; refused before the model loads, as a --json in a missing folder is."""
    from angle_train import evaluate

    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"text1": a, "text2": b, "label": float(i)}) + "\n"
                             for i, (a, b) in enumerate(PAIRS)), encoding="utf-8")
    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    model = save_pretrained(encoder, tokenizer, str(tmp_path / "model"), max_length=16)
    capsys.readouterr()  # the save's progress bars
    monkeypatch.setattr(evaluate, "load_model", lambda *a, **k: pytest.fail("the model loaded"))
    for json_out, said in ((tmp_path, f"--json {tmp_path}: a folder; give the path of a file to write, such as "
                                      f"{tmp_path / 'results.json'}"),
                           (tmp_path / "missing" / "r.json", f"--json {tmp_path / 'missing' / 'r.json'}: no folder "
                                                             f"{tmp_path / 'missing'} to write it in")):
        with pytest.raises(SystemExit) as exit_info:
            evaluate.main([str(model), str(pairs), "--json", str(json_out)])
        assert exit_info.value.code == 2
        assert capsys.readouterr().err.strip().splitlines()[-1] == f"angle-eval: error: {said}"


def test_angle_eval_scores_an_adapter_only_export(tmp_path):
    """A LoRA run's adapter-only export (angle_train.json, the adapter and the tokenizer: no config.json) is a model
    folder angle-eval takes: load_pretrained attaches it to its recorded base."""
    pytest.importorskip("peft")
    from angle_train import evaluate

    _, adapter = adapter_only_export(str(tmp_path))
    assert not os.path.exists(os.path.join(adapter, "config.json"))
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps({"text1": a, "text2": b, "label": float(i)}) + "\n"
                             for i, (a, b) in enumerate(PAIRS)), encoding="utf-8")
    assert evaluate.main([adapter, str(pairs)]) == 0


def test_a_text_given_twice_is_embedded_once_so_its_pairs_tie_whatever_the_batch_size():
    """A pair repeated with another gold score, and a sentence paired with several others, were embedded once per
    occurrence: the copies were padded in different batches, their cosines differed in the last bits, and the batch
    size decided which of the repeated pairs ranked first (all-MiniLM-L6-v2 on 44 pairs: 9.28, 9.32 and 9.28 at
    --batch-size 1, 3 and 64). Each distinct text is now embedded once, in one call, by angle-eval and by the dev
    evaluation alike, so the repeated pairs tie exactly (9.28 at every batch size there)."""
    from angle_train.data import Example
    from angle_train.evaluate import StsSet, dev_inputs, scores_of_embeddings, sts_spearman

    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    long_text = " ".join(a for a, _ in PAIRS * 3)  # batches of 3 pad the copies of PAIRS[0] to different lengths
    examples = ([Example(pair, float(i)) for i, pair in enumerate(PAIRS)] + [Example(PAIRS[0], 4.5)]
                + [Example((long_text, PAIRS[0][0]), 2.5), Example((PAIRS[1][0], long_text), 0.5)])
    embedded = []
    with pytest.MonkeyPatch.context() as patch:
        encode = type(encoder).encode
        patch.setattr(type(encoder), "encode", lambda self, texts, *a, **k: embedded.append(list(texts))
                      or encode(self, texts, *a, **k))
        scores = {size: sts_spearman(encoder, tokenizer, examples, batch_size=size) for size in (1, 3, 64)}
    distinct = list(dict.fromkeys([ex.texts[0] for ex in examples] + [ex.texts[1] for ex in examples]))
    assert embedded == [distinct] * 3  # one call each, every text once
    assert scores[1] == scores[3] == scores[64]
    dev_set = StsSet("dev", examples)
    assert [texts for texts, _ in dev_inputs(dev_set)] == [distinct]
    rows = encoder.encode(distinct, tokenizer, batch_size=3)
    assert scores_of_embeddings(dev_set, [rows], [])["dev_spearman"] == pytest.approx(scores[3], abs=1e-12)


def test_evaluate_pairs_the_texts_of_a_scored_set_once(monkeypatch):
    """evaluate() counts its progress bar's texts with the set's distinct texts (StsSet.pairs) and scores with the
    same ones: sts_spearman_by_dim built them a second time (a dict pass over every example) for each scored set."""
    from angle_train import evaluate as evaluation
    from angle_train.data import Example

    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    examples = [Example(pair, float(i)) for i, pair in enumerate(PAIRS)]
    built = []
    pair_texts = evaluation.pair_texts
    monkeypatch.setattr(evaluation, "pair_texts", lambda given: built.append(len(given)) or pair_texts(given))
    results = evaluation.evaluate(encoder, tokenizer, [evaluation.StsSet("pairs", examples)], batch_size=3,
                                  progress=False)
    assert built == [len(examples)]
    assert results["pairs"] == 100.0 * evaluation.sts_spearman(encoder, tokenizer, examples, batch_size=3)
