"""What a first run meets, from a user who knows sentence-transformers: the model folder's own pooling (said, and
overridable), the data's problems found before the model loads with the flag to change named, column names mapped
with --columns, a missing install extra named, the demo's flags and exit status and its built-in data, a missing local
folder never looked up on the Hub, and one way of choosing the device for angle-train and angle-eval. Tiny models:
seconds."""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import pytest
import torch
from train_helpers import make_encoder, run_config

from angle_train import cli, cli_common, evaluate, trainer
from angle_train.data import DataError, load_examples, names_local_path
from angle_train.evaluate import sts_spearman
from angle_train.export import META_FILE, save_pretrained
from angle_train.models import load_encoder
from angle_train.tiny import demo_examples, demo_sts_examples

PROGRAMS = {"angle-train": cli.main, "angle-eval": evaluate.main}


def run(program: str, argv, capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of the program's main(argv): its return value, or the status it exits with."""
    try:
        status = PROGRAMS[program](argv)
    except SystemExit as exit_info:
        status = exit_info.code
    captured = capsys.readouterr()
    return status, captured.out, captured.err


def one_line_error(program: str, status: int, err: str) -> str:
    assert status == 2 and "Traceback" not in err, err
    (line,) = err.strip().splitlines()
    assert line.startswith(f"{program}: error: "), err
    return line


def write_stsb(path, examples):
    """An STS Benchmark file (tab-separated, score in field 5, texts in 6 and 7)."""
    path.write_text("".join(f"main-captions\tMSRvid\t2012test\t{i:04d}\t{ex.label:.2f}\t{ex.texts[0]}\t{ex.texts[1]}\n"
                            for i, ex in enumerate(examples)), encoding="utf-8")
    return str(path)


@pytest.fixture(scope="module")
def st_folder(tmp_path_factory):
    """A tiny BERT saved as a sentence-transformers folder with mean pooling and no angle_train.json: a model from
    elsewhere, whose folder says how it pools."""
    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    folder = save_pretrained(encoder, tokenizer, str(tmp_path_factory.mktemp("st") / "model"), max_length=16)
    os.remove(os.path.join(folder, META_FILE))
    return folder


@pytest.fixture
def no_model_load(monkeypatch):
    """The model must not load: the checks under test come before it."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was loaded before the data was checked")

    monkeypatch.setattr(trainer, "build_encoder", refuse)


# ---------------------------------------------------------------------------------------------- pooling


def test_pooling_comes_from_the_model_folder(st_folder):
    encoder, _ = load_encoder(st_folder)
    assert encoder.pooling == "avg" and "1_Pooling" in encoder.pooling_source
    encoder, _ = load_encoder(st_folder, pooling="cls")
    assert (encoder.pooling, encoder.pooling_source) == ("cls", "--pooling")


def test_an_exports_pooling_comes_from_its_angle_train_json(tmp_path):
    """cls_avg has no sentence-transformers equivalent (nor has a bidirectional export any sentence-transformers
    files): training on from such an export takes its pooling from angle_train.json, not the encoder default."""
    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="cls_avg")
    folder = save_pretrained(encoder, tokenizer, str(tmp_path / "model"), max_length=16)
    assert not os.path.exists(os.path.join(folder, "modules.json"))
    encoder, _ = load_encoder(folder)
    assert (encoder.pooling, encoder.pooling_source) == ("cls_avg", f"the model folder's {META_FILE}")


def test_training_takes_the_folder_pooling_and_says_so(st_folder, tmp_path, capsys):
    result = trainer.train(run_config(tmp_path, model=st_folder, max_steps=1, batch_size=8, max_length=16),
                           train_examples=(demo_examples(16), "B"))
    assert result.encoder.pooling == "avg"
    assert "pooling avg (the model folder's 1_Pooling/config.json)" in capsys.readouterr().out
    assert json.loads((tmp_path / "config.json").read_text())["pooling"] == "avg"  # as the run used it


def test_the_model_folders_sentence_transformers_files_are_looked_up_once(st_folder, tmp_path, monkeypatch):
    """angle-train and angle-eval looked up the model's sentence-transformers files twice: as the model loaded (its
    pooling, its lowercasing) and again for the length to encode at (their max_seq_length), for a hub name a second
    fetch, and every export (best/, final/) a third. The length and the exports read the folder the loading found:
    one lookup, the same length (the folder's 16), the same exported files."""
    from angle_train import st_folder as st_files

    lookups, find_folder = [], st_files.find_folder

    def counted(name_or_path, revision=None):
        lookups.append(name_or_path)
        return find_folder(name_or_path, revision=revision)

    monkeypatch.setattr(st_files, "find_folder", counted)
    result = trainer.train(run_config(tmp_path, model=st_folder, max_steps=1, batch_size=8, max_length=12,
                                      save_final=True), train_examples=(demo_examples(16), "B"))
    assert lookups == [st_folder] and result.encoder.max_length == 16
    assert json.loads((tmp_path / "final" / "sentence_bert_config.json").read_text())["max_seq_length"] == 16
    lookups.clear()
    encoder, tokenizer, meta = evaluate.load_model(st_folder)
    assert evaluate.encoding_length(None, meta, encoder, tokenizer, st_folder) == 16 and lookups == [st_folder]


def test_a_model_given_to_train_keeps_its_own_sentence_transformers_files(st_folder, tmp_path, monkeypatch):
    """A model given to train() in place of --model had its sentence-transformers files looked up under --model's
    name, which names nothing there: a local folder of that name (here one whose max_seq_length is 16) gave the
    given model its length to encode at and its exports' files, and a model loaded with its own files (load_encoder)
    lost them under the default --model. The given model's own files (Encoder.st_files) are kept, and --model is not
    looked up, by the run or by its exports."""
    from angle_train import st_folder as st_files

    lookups, find_folder = [], st_files.find_folder

    def counted(name_or_path, revision=None):
        lookups.append(name_or_path)
        return find_folder(name_or_path, revision=revision)

    def exported_length(out):
        return json.loads((out / "final" / "sentence_bert_config.json").read_text())["max_seq_length"]

    monkeypatch.setattr(st_files, "find_folder", counted)
    data, settings = (demo_examples(16), "B"), dict(max_steps=1, batch_size=8, max_length=12, save_final=True)
    unrelated = trainer.train(run_config(tmp_path / "unrelated", model=st_folder, **settings),
                              model=make_encoder("bert", pooling="avg"), train_examples=data)
    assert lookups == [] and unrelated.encoder.max_length == 12 and exported_length(tmp_path / "unrelated") == 12
    loaded = load_encoder(st_folder)
    lookups.clear()
    own = trainer.train(run_config(tmp_path / "own", **settings), model=loaded, train_examples=data)
    assert lookups == [] and own.encoder.max_length == 16 and exported_length(tmp_path / "own") == 16


def test_a_lora_model_given_to_train_exports_over_its_own_base_never_model(st_folder, tmp_path, capsys):
    """The exports of a model given to train() named --model as their base (the default builtin:tiny-bert, or a
    folder left in a config), in angle_train.json and a LoRA adapter's adapter_config.json, so an adapter-only best/
    loaded its adapter over that model, or not at all. They name the model the given one was loaded by (peft's record
    of its base), and the start-up line says it; a LoRA model that has none (built from its config) gets its merged
    weights in best/, which load by themselves, with a note."""
    from angle_train.export import load_pretrained
    from angle_train.models import LoraSettings

    data, dev = (demo_examples(16), "B"), demo_sts_examples(12)
    settings = dict(max_steps=1, batch_size=8, max_length=12, save_final=True)
    texts = ["a small red ball", "the box is blue"]

    def trained(out, given, **flags):
        result = trainer.train(run_config(out, **settings, **flags), model=given, train_examples=data,
                               dev_examples=dev)
        return result.encoder.eval().encode(texts, result.tokenizer)

    def meta(folder):
        return json.loads((folder / META_FILE).read_text())

    encoder, tokenizer = load_encoder(st_folder, lora=LoraSettings(r=4, alpha=8, dropout=0.0))
    with torch.no_grad():  # an adapter that changes the embeddings (LoRA's B starts at zero)
        for name, weight in encoder.named_parameters():
            if "lora_B" in name:
                weight.normal_(0, 0.5)
    for out, flags in ((tmp_path / "default", {}), (tmp_path / "other", {"model": str(tmp_path)})):
        embeddings = trained(out, (encoder, tokenizer), **flags)
        assert f"angle_train: the model given to train() ({st_folder}) | " in capsys.readouterr().out
        best = out / "best"
        adapter = json.loads((best / "adapter_config.json").read_text())
        assert meta(best)["adapter_only"] and meta(best)["base_model"] == adapter["base_model_name_or_path"] == \
            st_folder and meta(out / "final")["base_model"] == st_folder
        reloaded, reloaded_tokenizer, _ = load_pretrained(str(best))
        torch.testing.assert_close(reloaded.encode(texts, reloaded_tokenizer), embeddings, rtol=1e-4, atol=1e-5)

    embeddings = trained(tmp_path / "unnamed", make_encoder("bert", dtype=torch.float32, lora=True))
    out = capsys.readouterr().out
    assert "angle_train: the model given to train() | " in out and "best/ holds its merged weights" in out
    best = tmp_path / "unnamed" / "best"
    assert not meta(best)["adapter_only"] and meta(best)["base_model"] is None and (best / "config.json").is_file()
    reloaded, reloaded_tokenizer, _ = load_pretrained(str(best))
    torch.testing.assert_close(reloaded.encode(texts, reloaded_tokenizer), embeddings, rtol=1e-4, atol=1e-5)


def test_a_model_given_to_train_is_named_where_its_width_does_not_fit(st_folder, tmp_path):
    """--matryoshka-dims and --espresso that do not fit a model given to train() named --model's default
    (builtin:tiny-bert), which names nothing there: they name the given model as the start-up line does."""
    given = load_encoder(st_folder)
    for flags, refusal, data in (
            ({"matryoshka_dims": [64, 16]}, "--matryoshka-dims 64 16", (demo_examples(16), "B")),
            ({"espresso": True, "espresso_dim": 15, "ibn_w": 0.0, "cosine_w": 1.0}, "--espresso --espresso-dim 15",
             (demo_sts_examples(16), "A"))):
        with pytest.raises(ValueError) as exc:
            trainer.train(run_config(tmp_path / "run", max_steps=1, batch_size=8, **flags), model=given,
                          train_examples=data)
        assert str(exc.value).startswith(f"{refusal} does not fit the model given to train() ({st_folder})")
        assert "builtin:" not in str(exc.value)


def test_profile_and_model_card_name_the_model_given_to_train(st_folder, tmp_path):
    """profile.json's "model" of a model given to train() was --model's default (builtin:tiny-bert), and the model
    card said it was fine-tuned from "the model given to train()" alone: both name it by the model it was loaded by,
    as the start-up line does."""
    words = f"the model given to train() ({st_folder})"
    trainer.train(run_config(tmp_path, profile=True, max_steps=1, batch_size=8, save_final=True),
                  model=load_encoder(st_folder), train_examples=(demo_examples(16), "B"))
    assert json.loads((tmp_path / "profile.json").read_text())["model"] == words
    card = (tmp_path / "final" / "README.md").read_text()
    assert f"fine-tuned from {words} with angle-train" in card and f"- base model: {words}, pooling" in card


def test_a_model_given_to_train_by_a_relative_folder_is_exported_over_that_folder(tmp_path, monkeypatch):
    """A model given to train() that was loaded by a relative folder path named no folder once the working folder
    changed: loaded by load_encoder, its export read its sentence-transformers files from it and failed
    (FileNotFoundError); loaded otherwise, its exports recorded the relative path as their base, a hub name
    anywhere else. The base is recorded by its absolute path, as a local --model is."""
    from transformers import AutoModel, AutoTokenizer

    from angle_train.models import prepare_tokenizer, wrap_backbone

    encoder, tokenizer = make_encoder("bert", dtype=torch.float32)
    save_pretrained(encoder, tokenizer, str(tmp_path / "model"), max_length=16)  # with sentence-transformers files
    (tmp_path / "elsewhere").mkdir()
    settings = dict(max_steps=1, batch_size=8, max_length=12, save_final=True)
    data = (demo_examples(16), "B")

    def base_of(out):
        return json.loads((out / "final" / META_FILE).read_text())["base_model"]

    monkeypatch.chdir(tmp_path)
    given = load_encoder("model")
    monkeypatch.chdir(tmp_path / "elsewhere")  # before train()
    trainer.train(run_config(tmp_path / "loaded", **settings), model=given, train_examples=data)
    assert base_of(tmp_path / "loaded") == str(tmp_path / "model")

    monkeypatch.chdir(tmp_path)
    tokenizer = prepare_tokenizer(AutoTokenizer.from_pretrained("model"), False)
    given = wrap_backbone(AutoModel.from_pretrained("model"), pooling="cls", pad_token_id=tokenizer.pad_token_id,
                          is_decoder=False)
    trainer.train(run_config(tmp_path / "wrapped", **settings), model=(given, tokenizer), train_examples=data,
                  on_step=lambda step, row: os.chdir(tmp_path / "elsewhere"))  # during train()
    assert base_of(tmp_path / "wrapped") == str(tmp_path / "model")


def test_angle_eval_takes_the_folder_pooling_and_says_so(st_folder, tmp_path, capsys):
    examples = demo_sts_examples(24)
    sts = write_stsb(tmp_path / "sts-test.csv", examples)
    scores = {}
    for pooling in ("avg", "cls"):
        flags = [] if pooling == "avg" else ["--pooling", "cls"]
        status, _, err = run("angle-eval", [st_folder, sts, "--json", str(tmp_path / "r.json"), *flags], capsys)
        assert status == 0, err
        source = "the model folder's 1_Pooling/config.json" if pooling == "avg" else "--pooling"
        assert f"angle-eval: pooling {pooling} ({source})" in err
        scores[pooling] = json.loads((tmp_path / "r.json").read_text())["STS-B"]
        encoder, tokenizer = load_encoder(st_folder, pooling=pooling)
        assert scores[pooling] == pytest.approx(100 * sts_spearman(encoder, tokenizer, examples), abs=1e-9)
    assert scores["avg"] != scores["cls"]


# ------------------------------------------------------------------------------------- data, before the model


def test_graded_labels_with_in_batch_negatives_name_the_flag_before_the_model_loads(tmp_path, no_model_load,
                                                                                     capsys):
    sts = write_stsb(tmp_path / "sts-train.csv", demo_sts_examples(16))
    argv = ["--train-data", sts, "--batch-size", "8", "--output-dir", str(tmp_path / "out"), "--device", "cpu",
            "--progress", "0"]
    line = one_line_error("angle-train", *run("angle-train", argv, capsys)[::2])
    assert "--ibn-w" in line and "graded labels" in line and "--ibn-w 0" in line
    with pytest.raises(AssertionError, match="the model was loaded"):  # with --ibn-w 0 the data passes
        run("angle-train", [*argv, "--ibn-w", "0", "--cosine-w", "1"], capsys)


@pytest.mark.parametrize("label, weights, named", [
    (0.0, [], ["--ibn-w", "labelled 1"]),  # the defaults: in-batch negatives (and the angle term) on all-0 pairs
    (3.0, ["--ibn-w", "0", "--cosine-w", "1"], ["--cosine-w", "different labels"]),
    (1.0, ["--ibn-w", "0", "--cosine-w", "1", "--angle-w", "1"], ["--cosine-w, --angle-w", "different labels"]),
])
def test_labels_no_weighted_term_can_learn_from_name_the_flags_before_the_model_loads(tmp_path, no_model_load, capsys,
                                                                                       label, weights, named):
    examples = [dataclasses.replace(example, label=label) for example in demo_sts_examples(16)]
    sts = write_stsb(tmp_path / "sts-train.csv", examples)
    argv = ["--train-data", sts, "--batch-size", "8", "--output-dir", str(tmp_path / "out"), "--device", "cpu",
            "--progress", "0", *weights]
    line = one_line_error("angle-train", *run("angle-train", argv, capsys)[::2])
    assert f"every label of --train-data {sts} is {label:g}" in line and all(n in line for n in named), line
    examples[0] = dataclasses.replace(examples[0], label=1.0 if label != 1.0 else 0.0)  # one to learn from
    write_stsb(tmp_path / "sts-train.csv", examples)
    with pytest.raises(AssertionError, match="the model was loaded"):
        run("angle-train", argv, capsys)


def test_too_few_rows_for_a_step_name_the_flags_before_the_model_loads(tmp_path, no_model_load, capsys):
    sts = write_stsb(tmp_path / "sts-train.csv", demo_sts_examples(6))
    argv = ["--train-data", sts, "--ibn-w", "0", "--cosine-w", "1", "--batch-size", "4", "--grad-accum", "2",
            "--output-dir", str(tmp_path / "out"), "--device", "cpu", "--progress", "0"]
    line = one_line_error("angle-train", *run("angle-train", argv, capsys)[::2])
    assert "6 examples" in line and "--batch-size 4" in line and "--grad-accum 2" in line


CSV = "sent_a,sent_b,similarity\na man plays a guitar,a man is playing music,4.2\nthe cat sleeps,a dog runs,0.4\n"
MAPPING = {"text1": "sent_a", "text2": "sent_b", "label": "similarity"}


def test_columns_map_a_files_names(tmp_path):
    csv = tmp_path / "pairs.csv"
    csv.write_text(CSV)
    with pytest.raises(DataError, match=r"--columns text1=COLUMN text2=COLUMN label=COLUMN"):
        load_examples(str(csv))
    examples, fmt = load_examples(str(csv), columns=MAPPING)
    assert fmt == "A" and examples[0].texts == ("a man plays a guitar", "a man is playing music")
    assert examples[1].label == 0.4
    jsonl = tmp_path / "pairs.jsonl"
    jsonl.write_text("".join(json.dumps({"q": a, "doc": b}) + "\n" for a, b in [("x y", "y z"), ("u v", "v w")]))
    examples, fmt = load_examples(str(jsonl), columns={"query": "q", "positive": "doc"})
    assert fmt == "B" and examples[1].texts == ("u v", "v w")
    with pytest.raises(DataError, match=r"--columns label=score: .*no column 'score'"):
        load_examples(str(csv), columns={**MAPPING, "label": "score"})
    # a format given by --data-format: the hint maps the names that format lacks
    with pytest.raises(DataError, match=r"for format B .*--columns query=COLUMN positive=COLUMN \(from Python: "
                                        r"columns=\{'query': COLUMN"):
        load_examples(str(csv), fmt="B", columns=MAPPING)
    with pytest.raises(DataError, match=r"missing column\(s\) \['negative'\] for format C .*"
                                        r"--columns negative=COLUMN \("):
        load_examples(str(jsonl), fmt="C", columns={"query": "q", "positive": "doc"})


def test_columns_map_a_hugging_face_datasets_names(tmp_path):
    datasets = pytest.importorskip("datasets")
    folder = str(tmp_path / "hf")
    datasets.Dataset.from_dict({"anchor": ["x y", "u v"], "pos": ["y z", "v w"]}).save_to_disk(folder)
    examples, fmt = load_examples(folder, columns={"query": "anchor", "positive": "pos"})
    assert fmt == "B" and examples[0].texts == ("x y", "y z")


def test_the_columns_flag(tmp_path, capsys):
    csv = tmp_path / "pairs.csv"
    csv.write_text("sent_a,sent_b,similarity\n" + "".join(f"{ex.texts[0]},{ex.texts[1]},{ex.label}\n"
                                                          for ex in demo_sts_examples(16)))
    base = ["--train-data", str(csv), "--ibn-w", "0", "--cosine-w", "1", "--batch-size", "8", "--max-steps", "1",
            "--output-dir", str(tmp_path / "out"), "--device", "cpu", "--progress", "0", "--save-final", "0"]
    assert run("angle-train", [*base, "--columns", "text1=sent_a", "text2=sent_b", "label=similarity"],
               capsys)[0] == 0
    line = one_line_error("angle-train", *run("angle-train", [*base, "--columns", "sent_a"], capsys)[::2])
    assert "--columns sent_a: expected NAME=COLUMN" in line
    line = one_line_error("angle-train", *run("angle-train", [*base, "--columns", "sentence=sent_a"], capsys)[::2])
    assert "--columns sentence=sent_a: unknown name 'sentence'" in line


def test_the_dev_data_takes_its_own_column_mapping(tmp_path, capsys):
    """--columns maps --dev-data too; --dev-columns maps it alone (STS-B's sentence1,sentence2,score beside a
    training file of other names), and a dev file the training mapping cannot read says so, naming --dev-columns."""
    train_csv, dev_csv = tmp_path / "pairs.csv", tmp_path / "dev.csv"
    rows = demo_sts_examples(16)
    train_csv.write_text("sent_a,sent_b,similarity\n" + "".join(f"{ex.texts[0]},{ex.texts[1]},{ex.label}\n"
                                                                for ex in rows))
    dev_csv.write_text("sentence1,sentence2,score\n" + "".join(f"{ex.texts[0]},{ex.texts[1]},{ex.label}\n"
                                                               for ex in rows[:8]))
    base = ["--train-data", str(train_csv), "--dev-data", str(dev_csv), "--ibn-w", "0", "--cosine-w", "1",
            "--batch-size", "8", "--max-steps", "1", "--device", "cpu", "--progress", "0", "--save-final", "0",
            "--columns", "text1=sent_a", "text2=sent_b", "label=similarity"]
    line = one_line_error("angle-train", *run("angle-train", [*base, "--output-dir", str(tmp_path / "a")],
                                                capsys)[::2])
    assert line.endswith("has no column 'sent_a' (it has ['sentence1', 'sentence2', 'score']) (--columns maps the "
                         "columns of --dev-data too: map the dev data's own with --dev-columns)")
    status, out, err = run("angle-train", [*base, "--output-dir", str(tmp_path / "b"), "--dev-columns",
                                           "text1=sentence1", "text2=sentence2", "label=score"], capsys)
    assert status == 0, err
    assert "best model (dev Spearman" in out
    line = one_line_error("angle-train", *run("angle-train", [*base, "--output-dir", str(tmp_path / "c"),
                                                              "--dev-columns", "text1=x"], capsys)[::2])
    assert "--dev-columns text1=x: " in line and "no column 'x'" in line
    line = one_line_error("angle-train", *run("angle-train", ["--dev-columns", "text1=x", "--output-dir",
                                                              str(tmp_path / "d")], capsys)[::2])
    assert "--dev-columns maps the columns of --dev-data: give --dev-data" in line
    line = one_line_error("angle-train", *run("angle-train", [*base, "--output-dir", str(tmp_path / "e"),
                                                              "--dev-columns", "text1"], capsys)[::2])
    assert "--dev-columns text1: expected NAME=COLUMN" in line


def test_angle_eval_reads_mapped_columns(st_folder, tmp_path, capsys):
    """angle-eval's --columns, as angle-train's: the hint of an unreadable header names a flag it has."""
    csv = tmp_path / "pairs.csv"
    csv.write_text("sent_a,sent_b,similarity\n" + "".join(f"{ex.texts[0]},{ex.texts[1]},{ex.label}\n"
                                                          for ex in demo_sts_examples(16)))
    line = one_line_error("angle-eval", *run("angle-eval", [st_folder, str(csv)], capsys)[::2])
    assert "--columns text1=COLUMN" in line
    argv = [st_folder, str(csv), "--json", str(tmp_path / "r.json"), "--columns", "text1=sent_a", "text2=sent_b",
            "label=similarity"]
    status, _, err = run("angle-eval", argv, capsys)
    assert status == 0, err
    assert set(json.loads((tmp_path / "r.json").read_text())) == {"pairs"}


# --------------------------------------------------------------------------------------------- installation


@pytest.mark.parametrize("module", ["tokenizers", "scipy"])  # scipy: the dev evaluation's, needed only at its end
@pytest.mark.parametrize("program", ["angle-train", "angle-eval"])
def test_a_missing_train_extra_is_named(program, module, st_folder, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, module, None)  # as after `pip install angle_kernels` without the extra
    sts = write_stsb(tmp_path / "sts-test.csv", demo_sts_examples(8))
    argv = {"angle-train": ["--output-dir", str(tmp_path / "out"), "--device", "cpu", "--progress", "0"],
            "angle-eval": [st_folder, sts]}[program]
    line = one_line_error(program, *run(program, argv, capsys)[::2])
    assert module in line and "pip install 'angle_kernels[train]'" in line


def test_the_demo_without_the_train_extra_names_it(monkeypatch, capsys):
    """python -m angle_train.demo (the README's first command after `pip install angle_kernels`) ended in an import's
    traceback without the train extra: it says what to install, as angle-train does (status 2)."""
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    from angle_train import demo

    with pytest.raises(SystemExit) as exit_info:
        demo.main([])
    assert exit_info.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "tokenizers" in line and "pip install 'angle_kernels[train]'" in line


@pytest.mark.parametrize("losses, status, said", [([3.0, 2.5, 2.0, 1.5], 0, "the loss fell (3.000 -> 1.500)"),
                                                  ([1.5, 2.0, 2.5, 3.0], 1, "WARNING: the loss did not fall")],
                         ids=["fell", "did-not-fall"])
def test_the_demo_takes_the_users_flags_and_exits_1_when_the_loss_did_not_fall(losses, status, said, monkeypatch,
                                                                               capsys):
    """The flags given to python -m angle_train.demo override its defaults (another model, batch size), and a run
    whose loss did not fall says so and exits with status 1 (a check a script can read), one that fell with 0."""
    import types

    from angle_train import demo

    configs = []

    def fake_train(cfg):
        configs.append(cfg)
        rows = [{"loss": loss, "pairs_per_s": 10.0, "tokens_per_s": 100.0, "peak_mem_gb": 0.0} for loss in losses]
        return types.SimpleNamespace(history=rows, encoder=None, tokenizer=None)

    monkeypatch.setattr(trainer, "train", fake_train)
    monkeypatch.setattr(evaluate, "sts_spearman", lambda *args, **kwargs: 0.5)
    assert demo.main(["--model", "builtin:tiny-llama", "--batch-size", "8", "--log-every", "2"]) == status
    assert (configs[0].model, configs[0].batch_size, configs[0].log_every) == ("builtin:tiny-llama", 8, 2)
    assert configs[0].train_data == "builtin:demo" and configs[0].device == "cpu"  # the demo's own defaults
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith(said)


def test_the_builtin_data_model_and_tokenizer_are_as_documented():
    """builtin:demo-sts grades a pair by the attributes it shares on 0-5 (all three: 5); building a tiny model leaves
    the global random generator where it was (a seeded run draws the same numbers with it); the tiny tokenizer
    lowercases, so 'The Red Car' reads as the demo's words, not as unknown ones."""
    from angle_train.tiny import build_backbone, build_tokenizer

    labels = {example.label for example in demo_sts_examples()}
    assert labels == {0.0, 5.0 / 3, 10.0 / 3, 5.0}
    torch.manual_seed(0)
    before = torch.get_rng_state()
    build_backbone("builtin:tiny-bert", 64, hidden_size=16, layers=1)
    assert torch.equal(torch.get_rng_state(), before)
    tokenizer = build_tokenizer()
    assert tokenizer("The Red CAR")["input_ids"] == tokenizer("the red car")["input_ids"]
    assert tokenizer.unk_token_id not in tokenizer("The Red CAR")["input_ids"]


def test_an_import_of_the_extra_failing_later_is_named(monkeypatch):
    parser = cli.build_parser()
    with pytest.raises(SystemExit) as exit_info, cli_common.user_errors_exit(parser, debug=False):
        raise ModuleNotFoundError("No module named 'datasets'", name="datasets")
    assert exit_info.value.code == 2
    with pytest.raises(ModuleNotFoundError), cli_common.user_errors_exit(parser, debug=False):
        raise ModuleNotFoundError("No module named 'not_ours'", name="not_ours")  # a bug: its traceback
    with pytest.raises(ModuleNotFoundError), cli_common.user_errors_exit(parser, debug=True):
        raise ModuleNotFoundError("No module named 'datasets'", name="datasets")  # --debug: the traceback


@pytest.mark.parametrize("error, cause", [
    (ModuleNotFoundError("No module named 'peft'", name="peft"), None),  # --lora 1 without peft
    # raised from the missing module's error, as transformers' lazy imports raise it
    (ImportError("cannot set up LoRA"), ModuleNotFoundError("No module named 'peft'", name="peft")),
])
def test_an_import_failing_for_a_module_of_the_extra_names_the_extra(error, cause, capsys):
    """Such a failure minutes into a run is one line naming the extra to install, not an import's traceback."""
    parser = cli.build_parser()
    with pytest.raises(SystemExit) as exit_info, cli_common.user_errors_exit(parser, debug=False):
        raise error from cause
    assert exit_info.value.code == 2
    assert "peft is not installed" in capsys.readouterr().err


# ------------------------------------------------------------------------------------ paths and the device


@pytest.mark.parametrize("name", ["out-nope/final", "out-nope/best", "out-nope/step-40"])
def test_an_output_folder_that_does_not_exist_is_never_looked_up_on_the_hub(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert names_local_path(name) and not names_local_path("sentence-transformers/all-MiniLM-L6-v2")
    line = one_line_error("angle-train", *run("angle-train", ["--model", name, "--device", "cpu"], capsys)[::2])
    assert f"--model {name}: no such file or folder" in line
    write_stsb(tmp_path / "sts-test.csv", demo_sts_examples(8))
    line = one_line_error("angle-eval", *run("angle-eval", [name, "sts-test.csv"], capsys)[::2])
    assert f"MODEL {name}: no such folder" in line


@pytest.mark.parametrize("cuda", [True, False])
def test_angle_eval_chooses_the_device_as_angle_train_does(cuda, st_folder, tmp_path, monkeypatch):
    """Both default to CUDA when there is one (TrainConfig.device's rule, cli_common.resolve_device)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    asked = {}

    def load_model(model, **settings):
        asked.update(settings)
        raise KeyboardInterrupt  # stop here: this machine may have no CUDA device

    monkeypatch.setattr(evaluate, "load_model", load_model)
    with pytest.raises(KeyboardInterrupt):
        evaluate.main([st_folder, write_stsb(tmp_path / "sts-test.csv", demo_sts_examples(8))])
    expected = "cuda" if cuda else "cpu"
    assert str(asked["device"]) == expected == str(cli_common.resolve_device(None))
    assert str(cli_common.resolve_device("cpu")) == "cpu"


def test_angle_eval_progress_0_prints_no_bar(st_folder, tmp_path, capsys):
    """--progress 0: no bar at all on stderr, transformers' own (loading the weights) included; --progress 1 shows
    them (so the first half can fail)."""
    sts = write_stsb(tmp_path / "sts-test.csv", demo_sts_examples(24))
    for progress in ("1", "0"):
        status, _, err = run("angle-eval", [st_folder, sts, "--progress", progress], capsys)
        assert status == 0, err
        assert ("%|" in err) == (progress == "1"), err


def test_the_columns_flag_reads_a_dev_file_of_a_run_on_built_in_data(tmp_path):
    """With built-in training data, --columns maps the --dev-data file's column names (that file is what it reads),
    and the run scores on that file; without a dev file to read, --columns is refused."""
    csv = tmp_path / "dev.csv"
    csv.write_text("sent_a,sent_b,similarity\n" + "".join(f"{ex.texts[0]},{ex.texts[1]},{ex.label}\n"
                                                          for ex in demo_sts_examples(16)))
    settings = {"model": "builtin:tiny-bert", "train_data": "builtin:demo", "batch_size": 8, "max_steps": 1,
                "max_length": 16, "columns": ["text1=sent_a", "text2=sent_b", "label=similarity"]}
    result = trainer.train(run_config(tmp_path / "out", dev_data=str(csv), **settings))
    assert [row["step"] for row in result.evals] == [1] and result.best_metric == "dev_spearman"
    with pytest.raises(ValueError, match="--columns says how to read a file or dataset, and --train-data builtin:demo"):
        trainer.train(run_config(tmp_path / "none", **settings))
