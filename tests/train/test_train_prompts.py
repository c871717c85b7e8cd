"""Query and document prompts (issue 14, item 2): each text gets the prompt of its role in formats A, B and C, the
prompts are saved with the exported model, and encode(), load_pretrained, sentence-transformers and angle-eval
apply them as training did."""

import json
import os

import pytest
import torch
from train_helpers import make_encoder, run_config

from angle_train.data import ANGLE_PROMPT, NAMED_PROMPTS, Example, Prompts, TokenizedPairs, prompt_prefix
from angle_train.export import load_pretrained, save_pretrained

# prompts of words the tiny tokenizer knows (an unknown word would become [UNK] whatever the prompt)
TEXT, QUERY, DOC = "the ", "it was {text}", "very very "
QUERIES = ["a small red car", "the big dog", "a golden kite", "box"]
DOCS = ["the car is red and small", "it was a black dog", "the kite is long", "a box"]


def test_each_role_takes_its_prompt_and_falls_back_to_the_text_prompt():
    prompts = Prompts(text=TEXT, query=QUERY)
    assert prompts.for_role("text") == TEXT
    assert prompts.for_role("query") == QUERY
    assert prompts.for_role("document") == TEXT  # no document prompt of its own
    assert Prompts(query=QUERY).for_role("document") is None
    assert prompts.as_dict() == {"text": TEXT, "query": QUERY, "document": TEXT}
    assert Prompts(text="angle").text == ANGLE_PROMPT
    assert Prompts(document="Prompts.C").document == NAMED_PROMPTS["Prompts.C"]
    assert Prompts(text="").as_dict() == {}
    with pytest.raises(ValueError, match="prompt name"):
        prompts.for_role("passage")
    with pytest.raises(TypeError, match="query prompt"):
        Prompts(query=3)


def test_an_empty_query_or_document_prompt_is_none_not_the_text_prompt(tmp_path):
    """--query-prompt '' (or --doc-prompt '') with a --prompt: that role's texts take no prompt, as '' means
    everywhere else, not the text prompt; the export keeps it so, for load_pretrained and for sentence-transformers
    (whose prompts then hold '' for the role)."""
    st = pytest.importorskip("sentence_transformers")
    from angle_train.cli import config_from_args

    prompts = Prompts(text=TEXT, query="")
    assert (prompts.for_role("text"), prompts.for_role("query"), prompts.for_role("document")) == (TEXT, None, TEXT)
    assert prompts.as_dict() == {"text": TEXT, "query": "", "document": TEXT}
    assert Prompts(query="", document="") == Prompts()  # without a text prompt, '' and None say the same
    assert config_from_args(["--prompt", TEXT, "--doc-prompt", ""]).prompts().for_role("document") is None

    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    encoder.eval()
    encoder.prompts = prompts
    torch.testing.assert_close(encoder.encode(QUERIES, tokenizer, prompt_name="query"),
                               encoder.encode(QUERIES, tokenizer, prompt=""), rtol=0, atol=0)
    path = save_pretrained(encoder, tokenizer, str(tmp_path / "model"), max_length=32)
    assert load_pretrained(path)[0].prompts == prompts
    model = st.SentenceTransformer(path, device="cpu")
    assert model.prompts == {"text": TEXT, "query": "", "document": TEXT}
    torch.testing.assert_close(torch.as_tensor(model.encode(QUERIES, prompt_name="query")),
                               encoder.encode(QUERIES, tokenizer, prompt=""), rtol=1e-4, atol=1e-5)


def test_a_prompt_is_a_prefix_only_when_the_text_comes_last():
    assert prompt_prefix("query: ") == "query: "
    assert prompt_prefix("query: {text}") == "query: "
    assert prompt_prefix(ANGLE_PROMPT) is None


# A prompt that closes after the text, in words the tiny tokenizer knows (the AnglE prompt's are mostly [UNK] there)
CLOSING = 'the red "{text}" in one big word:"'
LONG = " ".join(["the big red car drives on a long road and it was"] * 4)


def test_a_long_text_is_cut_and_the_prompt_after_it_kept():
    """A text reaching --max-length lost the prompt's words after it (truncation cuts the end), so last-token pooling
    read a word of the text, not the prompt's close; now the text is cut and the prompt whole, in training
    (TokenizedPairs, ArcCSE's sentences) and in encode(). A text that fits, or a prefix prompt, is as before."""
    from angle_train.arccse import TokenizedSentences
    from angle_train.data import prompted_texts

    encoder, tokenizer = make_encoder("llama", dtype=torch.float32, pooling="last")
    close = tokenizer(CLOSING.partition("{text}")[2], add_special_tokens=True)["input_ids"][1:]  # ... word:" [SEP]
    (short, long), cut = prompted_texts(["a red car", LONG], CLOSING, tokenizer, 20)
    assert short == CLOSING.replace("{text}", "a red car") and cut == [1]
    ids = tokenizer(long, truncation=True, max_length=20)["input_ids"]
    assert len(ids) == 20 and ids[-len(close):] == close and long.startswith('the red "the big red car ')
    assert prompted_texts([LONG], "query: ", tokenizer, 20) == (["query: " + LONG], [])  # a prefix: truncation
    with pytest.raises(ValueError, match="--max-length 8 leaves no room for a text in the prompt"):
        prompted_texts([LONG], CLOSING, tokenizer, 8)
    pairs = TokenizedPairs([Example((LONG, "a red car"), 1.0)], "B", tokenizer, max_length=20, prompt=CLOSING)
    assert pairs.batch([0]).seqs[0] == ids and "1 of 2 texts cut at --max-length 20" in pairs.describe()
    sentences = TokenizedSentences([LONG], make_encoder("bert")[1], max_length=20, mask_rates=(0.1, 0.3), seed=0,
                                   prompt=CLOSING)
    assert sentences.ids[0] == ids
    encoder.prompts = Prompts(text=CLOSING)
    torch.testing.assert_close(encoder.encode([LONG], tokenizer, max_length=20),
                               encoder.encode([long], tokenizer, max_length=20, prompt=""), rtol=0, atol=0)


def test_a_text_cut_for_the_prompt_is_counted_once_whatever_its_role_and_length():
    """The header's count of texts cut: a document cut for the prompt counts as the document (not as its query), and
    a cut text whose words then merge with the prompt's (shorter than --max-length) counts all the same, in pairs and
    in ArcCSE's sentences."""
    from angle_train.arccse import TokenizedSentences

    _, tokenizer = make_encoder("llama")
    pairs = TokenizedPairs([Example(("a red car", LONG), 1.0)], "B", tokenizer, max_length=20, prompt=CLOSING)
    assert [len(ids) for ids in pairs.batch([0]).seqs] == [15, 20]
    assert "1 of 2 texts cut at --max-length 20" in pairs.describe()
    merging = "the big{text} is red"  # 'big' and the text's first word make one word: one token fewer than counted
    pairs = TokenizedPairs([Example(("a red car", LONG), 1.0)], "B", tokenizer, max_length=20, prompt=merging)
    assert [len(ids) for ids in pairs.batch([0]).seqs] == [8, 19]
    assert "1 of 2 texts cut at --max-length 20" in pairs.describe()
    sentences = TokenizedSentences([LONG, "a red car"], make_encoder("bert")[1], max_length=20, mask_rates=(0.1, 0.3),
                                   seed=0, prompt=merging)  # ArcCSE's sentences alike
    assert sentences.lengths == [19, 8] and "1 of 2 texts cut at --max-length 20" in sentences.describe()


def test_every_text_of_every_tokenizer_call_is_cut_for_the_prompt(monkeypatch):
    """prompted_texts checks TOKENIZE_CHUNK texts a call: each long text is cut, wherever it falls in its call; a
    prompt whose words merge when side by side ('re' 'd' reads 'red') takes more tokens around a text than counted,
    and the text is cut a token more so that the prompt still fits whole; a prompt holding '{text}' twice leaves the
    texts whole (truncation cuts the end)."""
    from angle_train import data as data_module
    from angle_train.data import prompted_texts

    _, tokenizer = make_encoder("llama")
    monkeypatch.setattr(data_module, "TOKENIZE_CHUNK", 2)
    texts = ["a red car", LONG, LONG, "box", LONG]
    out, cut = prompted_texts(texts, CLOSING, tokenizer, 20)
    assert cut == [1, 2, 4]
    assert [len(ids) for ids in tokenizer(out)["input_ids"]] == [15, 20, 20, 13, 20]
    (merged,), cut = prompted_texts([", " * 30], "the re{text}d car", tokenizer, 20)
    ids = tokenizer(merged)["input_ids"]
    assert cut == [0] and len(ids) == 20 and ids[-2:] == tokenizer("car")["input_ids"][-2:]
    twice = "{text} and {text} is red"
    assert prompted_texts([LONG], twice, tokenizer, 20) == ([twice.replace("{text}", LONG)], [])


@pytest.mark.parametrize("fmt", ["A", "B", "C"])
def test_tokenized_pairs_apply_the_prompt_of_each_role(fmt):
    _, tokenizer = make_encoder("bert")
    texts = {"A": ("a red car", "the car is red"), "B": ("a red car", "the car is red"),
             "C": ("a red car", "the car is red", "a blue boat")}[fmt]
    prompts = Prompts(text=TEXT, query=QUERY, document=DOC)
    pairs = TokenizedPairs([Example(texts, 1.0)], fmt, tokenizer, max_length=32, prompt=prompts)
    expected = {"A": ["the a red car", "the the car is red"],
                "B": ["it was a red car", "very very the car is red"],
                "C": ["it was a red car", "very very the car is red", "very very a blue boat"]}[fmt]
    assert pairs.batch([0]).seqs == tokenizer(expected)["input_ids"]
    # one string is the text prompt of every role, as before per-role prompts
    single = TokenizedPairs([Example(texts, 1.0)], fmt, tokenizer, max_length=32, prompt=TEXT)
    assert single.batch([0]).seqs == tokenizer([TEXT + t for t in texts])["input_ids"]


def test_cli_flags_config_keys_and_the_text_prompt_alias(tmp_path):
    from angle_train.cli import config_from_args

    cfg = config_from_args(["--query-prompt", QUERY, "--doc-prompt", DOC, "--text-prompt", "angle"])
    assert cfg.prompts() == Prompts(text=ANGLE_PROMPT, query=QUERY, document=DOC)
    settings = tmp_path / "run.json"
    settings.write_text(json.dumps({"text_prompt": TEXT, "query-prompt": QUERY}))
    assert config_from_args(["--config", str(settings)]).prompts() == Prompts(text=TEXT, query=QUERY)


def test_format_a_refuses_query_and_document_prompts(tmp_path):
    from angle_train.tiny import demo_sts_examples
    from angle_train.trainer import train

    cfg = run_config(tmp_path, query_prompt=QUERY, max_steps=1, batch_size=4, cosine_w=1.0, ibn_w=0.0)
    with pytest.raises(ValueError, match="format A's two texts take --prompt"):
        train(cfg, model=make_encoder("bert", dtype=torch.float32),
              train_examples=(demo_sts_examples(16), "A"))


def test_training_exports_the_prompts_and_every_loader_applies_them(tmp_path, capsys):
    """Format B with query and document prompts: the final export's encode(prompt_name=...) embeds as training did,
    through load_pretrained and through sentence-transformers' own prompts."""
    st = pytest.importorskip("sentence_transformers")
    from angle_train.tiny import demo_examples
    from angle_train.trainer import train

    cfg = run_config(tmp_path, prompt=TEXT, query_prompt=QUERY, doc_prompt=DOC, pooling="avg", max_steps=2,
                     batch_size=8, save_final=True)
    result = train(cfg, model=make_encoder("bert", dtype=torch.float32), train_examples=(demo_examples(32), "B"))
    encoder, tokenizer = result.encoder, result.tokenizer
    encoder.eval()
    queries = encoder.encode(QUERIES, tokenizer, prompt_name="query")
    torch.testing.assert_close(queries, encoder.encode(QUERIES, tokenizer, prompt=QUERY), rtol=0, atol=0)
    assert not torch.allclose(queries, encoder.encode(QUERIES, tokenizer, prompt=""))  # the prompt matters

    reloaded, tok, _ = load_pretrained(result.final_path)
    assert reloaded.prompts == Prompts(text=TEXT, query=QUERY, document=DOC)
    for name, texts in (("query", QUERIES), ("document", DOCS), ("text", DOCS)):
        torch.testing.assert_close(reloaded.encode(texts, tok, prompt_name=name),
                                   encoder.encode(texts, tokenizer, prompt_name=name), rtol=1e-5, atol=1e-6)

    model = st.SentenceTransformer(result.final_path, device="cpu")
    assert model.prompts == {"text": TEXT, "query": "it was ", "document": DOC}
    for name, texts in (("query", QUERIES), ("document", DOCS)):
        theirs = torch.as_tensor(model.encode(texts, prompt_name=name))
        torch.testing.assert_close(theirs, encoder.encode(texts, tokenizer, prompt_name=name), rtol=1e-4, atol=1e-5)
    # sentence-transformers' default prompt is the text prompt, as encode()'s
    torch.testing.assert_close(torch.as_tensor(model.encode(DOCS)), encoder.encode(DOCS, tokenizer),
                               rtol=1e-4, atol=1e-5)


def test_training_from_an_export_names_its_prompts_where_the_run_gives_none(tmp_path, capsys):
    """Trained from an export (--model runs/X/final), a run takes its pooling and attention but not its prompts (a run
    may want others), and dropped them in silence: a fine-tune learned bare texts where the model had learned prompted
    ones. A note names them and the flags that keep them, where the run gives no prompt flag."""
    from angle_train.tiny import demo_examples
    from angle_train.trainer import train

    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    encoder.prompts = Prompts(query=QUERY, document="Prompts.C")
    export = save_pretrained(encoder, tokenizer, str(tmp_path / "export"), max_length=32)
    data = (demo_examples(16), "B")
    capsys.readouterr()
    train(run_config(tmp_path / "a", model=export, max_steps=1, batch_size=8), train_examples=data)
    notes = [line for line in capsys.readouterr().out.splitlines() if "records the prompts" in line]
    assert notes == [f"angle_train: note: {export}'s angle_train.json records the prompts it was trained with "
                     "(--query-prompt 'it was {text}' --doc-prompt 'Represent this sentence for searching relevant "
                     "passages: {text}'); this run gives no --prompt, --query-prompt or --doc-prompt and trains "
                     "without them: give those flags to keep them"]
    train(run_config(tmp_path / "b", model=export, query_prompt=QUERY, max_steps=1, batch_size=8), train_examples=data)
    assert "records the prompts" not in capsys.readouterr().out


def test_a_prompt_that_is_not_a_prefix_stays_out_of_the_sentence_transformers_config(tmp_path, capsys):
    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    encoder.prompts = Prompts(text="angle", query=QUERY)
    path = save_pretrained(encoder, tokenizer, str(tmp_path / "angle"), max_length=32)
    assert "cannot express" in capsys.readouterr().out
    with open(os.path.join(path, "config_sentence_transformers.json")) as f:
        assert json.load(f)["prompts"] == {}
    reloaded, _, meta = load_pretrained(path)
    assert reloaded.prompts == encoder.prompts and meta["prompt"] == ANGLE_PROMPT


def test_an_export_without_per_role_prompts_still_loads_its_prompt(tmp_path):
    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    path = save_pretrained(encoder, tokenizer, str(tmp_path / "old"), max_length=32)
    meta_path = os.path.join(path, "angle_train.json")
    with open(meta_path) as f:
        meta = json.load(f)
    del meta["prompts"]
    meta["prompt"] = TEXT
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    assert load_pretrained(path)[0].prompts == Prompts(text=TEXT)


def test_angle_eval_retrieval_uses_the_query_and_document_prompts(tmp_path):
    from angle_train.evaluate import RetrievalSet, evaluate, retrieval_metrics

    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    encoder.eval()
    encoder.prompts = Prompts(query=QUERY, document=DOC)
    ours = evaluate(encoder, tokenizer, [RetrievalSet("pairs", QUERIES, DOCS)])["pairs"]
    expected = retrieval_metrics(encoder.encode(QUERIES, tokenizer, prompt=QUERY),
                                 encoder.encode(DOCS, tokenizer, prompt=DOC))
    unprompted = retrieval_metrics(encoder.encode(QUERIES, tokenizer, prompt=""),
                                   encoder.encode(DOCS, tokenizer, prompt=""))
    assert ours == expected
    assert ours != unprompted  # the check can tell (4 random-model rankings differ with the prompts)


def test_a_prompt_sentence_transformers_cannot_hold_is_noted_once_per_folder_and_named_in_words(tmp_path, capsys):
    """A training's best/, written again at each new best score, notes the AnglE prompt once, in words (not as a dict
    of every role), as its model card names it; a folder that held other prompts is noted again."""
    from angle_train.trainer import usage

    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    encoder.prompts = Prompts(text="angle")
    folder = str(tmp_path / "best")
    for _ in range(3):
        save_pretrained(encoder, tokenizer, folder, max_length=16)
    notes = [line for line in capsys.readouterr().out.splitlines() if "cannot express" in line]
    assert notes == [f"note: the prompts (`{ANGLE_PROMPT}` for every text) put text after '{{text}}', which "
                     f"sentence-transformers' prefix prompts cannot express; {folder} records them in angle_train.json "
                     "only (load_pretrained applies them)"]
    assert f"The prompts (`{ANGLE_PROMPT}` for every text) put text after" in "\n".join(usage(encoder, []))
    encoder.prompts = Prompts(text="angle", query="query: {text}", document="")
    save_pretrained(encoder, tokenizer, folder, max_length=16)
    assert f"the prompts (text `{ANGLE_PROMPT}`, query `query: {{text}}`, document none) put" in capsys.readouterr().out
