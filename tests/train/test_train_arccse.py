"""--objective arccse (issue 15): ArcCSE from raw sentences. The masked copies (rates, contiguous spans, seeded), the
readers, dropout on for the two views and off for the triplets, the gradient cache = plain backprop with the same
passes (float64, dropout on), exact resume, 2 gloo processes = 1, and the command line from a text file."""

import json
import os
import re

import pytest
import torch
from train_helpers import (assert_ranks_match, free_port, make_encoder, param_grads, rank_of_a_job, run_config,
                           slow_bert_tokenizer)

from angle_kernels.testing.helpers import start_ranks
from angle_train.arccse import BLOCKS, ArcCSEObjective, TokenizedSentences, load_sentences, span_length
from angle_train.data import DataError, pad_batch
from angle_train.grad_cache import embed, grad_cache_step, plain_step

SENTENCES = ["a small red car", "the dog is black and big", "it was a golden kite , very long", "box",
             "the big house is not white", "a tiny green bird", "it was a very long train", "the cat"]


def _sentences(tokenizer, seed=0, rates=(0.2, 0.4)):
    return TokenizedSentences(SENTENCES, tokenizer, max_length=32, mask_rates=rates, seed=seed)


def test_masked_copies_have_one_contiguous_span_of_the_rate_inside_the_sentence():
    _, tokenizer = make_encoder("bert")
    data = _sentences(tokenizer, rates=(0.2, 0.5))
    mask_id = tokenizer.mask_token_id
    for original, weak, strong in zip(data.ids, data.weak, data.strong):
        words = len(original) - 2  # [CLS] ... [SEP]
        for copy, rate in ((weak, 0.2), (strong, 0.5)):
            masked = [j for j, (a, b) in enumerate(zip(original, copy)) if a != b]
            assert len(copy) == len(original) and len(masked) == span_length(words, rate)
            assert all(copy[j] == mask_id for j in masked)
            if masked:
                assert masked == list(range(masked[0], masked[-1] + 1))  # contiguous
                assert 1 <= masked[0] and masked[-1] <= words  # never [CLS] or [SEP]
    # "box" (1 word) and "the cat" (2) are too short for 20%, neither for 50% (round half up: 1 x 0.5 -> 1)
    assert data.too_short == [2, 0]
    assert span_length(5, 0.2) == 1 and span_length(10, 0.4) == 4 and span_length(2, 0.25) == 1


@pytest.mark.parametrize("prompt", ["a red box is {text}", "query: ", "{text} means in one word:",
                                    "it is {text} ; so"])
@pytest.mark.parametrize("slow", [False, True], ids=["fast", "slow"])
def test_a_prompts_words_are_never_masked(tmp_path, prompt, slow):
    """With --prompt the spans cover the sentence's own tokens, never the prompt's, and their length is the rate of
    the sentence's tokens: they covered the prompted text (the 40% copy of an 11-token sentence in "a red box is
    {text}" masked 6 tokens, "a red box is the dog" among them). Fast tokenizers by their character offsets, slow
    ones by the prompt's token counts."""
    _, tokenizer = make_encoder("bert")
    if slow:
        tokenizer = slow_bert_tokenizer(tmp_path, tokenizer)
        if tokenizer is None:
            pytest.skip("this transformers has no Python (slow) BERT tokenizer")
    assert tokenizer.is_fast is not slow
    sentences = ["the dog was not a cat and it was very big", "a small red car", "it was a golden kite"] * 4
    data = TokenizedSentences(sentences, tokenizer, max_length=48, mask_rates=(0.2, 0.4), seed=3, prompt=prompt)
    head = prompt.partition("{text}")[0] if "{text}" in prompt else prompt
    before = len(tokenizer(head, add_special_tokens=False)["input_ids"]) if head else 0
    for sentence, original, weak, strong in zip(sentences, data.ids, data.weak, data.strong):
        own = len(tokenizer(sentence, add_special_tokens=False)["input_ids"])
        for copy, rate in ((weak, 0.2), (strong, 0.4)):
            masked = [j for j, (a, b) in enumerate(zip(original, copy)) if a != b]
            assert len(masked) == span_length(own, rate), (sentence, rate)
            assert masked and 1 + before <= masked[0] and masked[-1] < 1 + before + own, (sentence, masked)


def test_masks_are_a_function_of_the_seed():
    _, tokenizer = make_encoder("bert")
    first, again, other = _sentences(tokenizer, seed=1), _sentences(tokenizer, seed=1), _sentences(tokenizer, seed=2)
    assert first.strong == again.strong and first.weak == again.weak
    assert first.strong != other.strong


def test_reading_sentences(tmp_path):
    (tmp_path / "s.txt").write_text("a red car\n\nthe dog\n  \nbox\n")
    assert load_sentences(str(tmp_path / "s.txt")) == (["a red car", "the dog", "box"], 2)
    (tmp_path / "s.jsonl").write_text('{"sentence": "a red car"}\n{"sentence": "the dog"}\n')
    assert load_sentences(str(tmp_path / "s.jsonl"), column="sentence") == (["a red car", "the dog"], 0)
    (tmp_path / "s.csv").write_text("id,text\n1,a red car\n2,the dog\n")
    assert load_sentences(str(tmp_path / "s.csv")) == (["a red car", "the dog"], 0)
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": ["a red car", "box"]}).save_to_disk(str(tmp_path / "hf"))
    assert load_sentences(str(tmp_path / "hf")) == (["a red car", "box"], 0)
    with pytest.raises(DataError, match="no column 'sentence'"):
        load_sentences(str(tmp_path / "s.csv"), column="sentence")
    (tmp_path / "bad.jsonl").write_text('{"text": "a red car"}\n{"text": " "}\n')
    with pytest.raises(DataError, match="line 2: column 'text' is an empty text"):
        load_sentences(str(tmp_path / "bad.jsonl"))


def test_reading_sentences_from_files_named_in_upper_case(tmp_path):
    """A file's suffix is read in any case (S.TXT, S.TSV, S.JSONL as some Windows tools name them): each was refused
    as an unknown file type for sentences."""
    (tmp_path / "S.TXT").write_text("a red car\n\nthe dog\n")
    assert load_sentences(str(tmp_path / "S.TXT")) == (["a red car", "the dog"], 1)
    (tmp_path / "S.TSV").write_text("id\ttext\n1\ta red car, fast\n")
    assert load_sentences(str(tmp_path / "S.TSV")) == (["a red car, fast"], 0)
    (tmp_path / "S.JSONL").write_text('{"text": "the dog"}\n')
    assert load_sentences(str(tmp_path / "S.JSONL")) == (["the dog"], 0)


def test_reading_sentences_by_file_type(tmp_path):
    """A .json file is read as JSON lines, a .tsv file split at tabs; an STS Benchmark file gives each distinct
    sentence of its pairs once; a line without the text column, a header naming it twice, and a file without a
    sentence (blank lines only) are DataErrors."""
    (tmp_path / "s.json").write_text('{"text": "a red car"}\n{"text": "the dog"}\n')
    assert load_sentences(str(tmp_path / "s.json")) == (["a red car", "the dog"], 0)
    (tmp_path / "s.tsv").write_text("id\ttext\n1\ta red car, fast\n2\tthe dog\n")
    assert load_sentences(str(tmp_path / "s.tsv")) == (["a red car, fast", "the dog"], 0)
    (tmp_path / "sts.csv").write_text("g\tx\t2012\t1\t4.0\ta red car\tthe dog\ng\tx\t2012\t2\t1.5\tthe dog\tbox\n")
    assert load_sentences(str(tmp_path / "sts.csv")) == (["a red car", "the dog", "box"], 0)
    (tmp_path / "nofield.jsonl").write_text('{"text": "a red car"}\n{"sentence": "the dog"}\n')
    with pytest.raises(DataError, match=r"nofield.jsonl, line 2: no 'text' field \(--text-column\)"):
        load_sentences(str(tmp_path / "nofield.jsonl"))
    (tmp_path / "twice.csv").write_text("text,text\na red car,the dog\n")
    with pytest.raises(DataError, match=r"the column name\(s\) \['text'\] appear more than once"):
        load_sentences(str(tmp_path / "twice.csv"))
    (tmp_path / "blank.txt").write_text("\n \n")
    with pytest.raises(DataError, match="blank.txt: no sentences"):
        load_sentences(str(tmp_path / "blank.txt"))


def test_a_prompt_holding_the_text_twice_has_no_words_around_one_sentence():
    """'{text}' twice in a prompt makes both copies the text: no prompt words around the sentence, so the spans may
    cover all of it; one '{text}' has the words before and after it, a prompt without one is a prefix."""
    from angle_train.arccse import prompt_words

    assert prompt_words("{text} means {text}") is None and prompt_words("{text}") is None
    assert prompt_words("it is {text} ; so") == ("it is ", " ; so") and prompt_words("query: ") == ("query: ", "")


def test_the_setup_note_and_token_counts_of_each_layout():
    """The set-up note gives the sentences too short for each rate in the rates' order and the texts cut (ArcCon
    alone too); lengths_of gives the token counts of a batch's rows (the tokens a step trains on)."""
    from angle_train.arccse import ARCCON_BLOCKS

    _, tokenizer = make_encoder("bert")
    for blocks in (BLOCKS, ARCCON_BLOCKS):
        data = TokenizedSentences(SENTENCES, tokenizer, max_length=6, mask_rates=(0.5, 0.9), seed=0, blocks=blocks)
        batch = data.batch([3, 0])
        assert data.lengths_of([3, 0]) == [len(row) for row in batch.seqs] == [3, 6] * blocks  # row by row
        # "a small red car" and "a tiny green bird" are 6 tokens: whole
        assert data.cut == "; 4 of 8 texts cut at --max-length 6" and data.cut in data.describe()
    data = _sentences(tokenizer, rates=(0.2, 0.4))
    assert data.too_short == [2, 1] and "2 / 1 too short to mask" in data.describe()


def test_the_arccse_objective_refuses_rows_it_cannot_split_into_blocks():
    """Embeddings whose rows are not whole blocks on every process are refused, naming the layout."""
    with pytest.raises(ValueError, match=r"rows a multiple of 5 x processes \(2\); got \(15, 4\)"):
        ArcCSEObjective(lambda *blocks: None, world_size=2)(torch.ones(15), torch.zeros(15, 4))


def test_malformed_sentence_files(tmp_path):
    """Other tools' encodings: a byte-order mark is dropped, bytes that are not UTF-8 are a DataError with the line."""
    (tmp_path / "bom.txt").write_text("\ufeffa red car\nthe dog\n", encoding="utf-8")
    assert load_sentences(str(tmp_path / "bom.txt")) == (["a red car", "the dog"], 0)
    (tmp_path / "bom.csv").write_text("\ufefftext,id\na red car,1\n", encoding="utf-8")
    assert load_sentences(str(tmp_path / "bom.csv")) == (["a red car"], 0)
    (tmp_path / "latin1.txt").write_bytes("a red car\nun caf\u00e9\n".encode("cp1252"))
    with pytest.raises(DataError, match=r"latin1.txt, line 2: not UTF-8: the bytes b'\\xe9' at byte offset 16"):
        load_sentences(str(tmp_path / "latin1.txt"))
    (tmp_path / "short.csv").write_text("id,text\n1,a red car\n2\n")
    with pytest.raises(DataError, match=r"short.csv, line 3: fewer fields \(1\) than the header's 2"):
        load_sentences(str(tmp_path / "short.csv"))


def _batch_chunks(encoder, batch, rows=None):
    return [(*pad_batch(c, encoder.pad_token_id, encoder.padding_side), dropout) for c, dropout in batch.passes(rows)]


def _captured_blocks(encoder, batch, rows=None):
    """The five blocks the loss receives in one plain step."""
    seen = {}

    def capture(labels, embeddings):
        seen["blocks"] = embeddings.detach().unflatten(0, (BLOCKS, -1))
        return embeddings.sum() * 0

    plain_step(encoder, _batch_chunks(encoder, batch, rows), batch.labels, capture)
    return seen["blocks"]


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_the_two_views_differ_by_dropout_alone_and_the_triplets_have_none(dropout):
    encoder, tokenizer = make_encoder("bert", dropout=dropout)
    encoder.train()
    data = _sentences(tokenizer)
    batch = data.batch(list(range(len(SENTENCES))))
    torch.manual_seed(0)
    h1, h2, anchor, weak, strong = _captured_blocks(encoder, batch, rows=5)
    assert torch.equal(h1, h2) == (dropout == 0.0)
    encoder.eval()  # dropout off, for the expected triplet embeddings
    with torch.no_grad():
        for rows, got in ((data.ids, anchor), (data.weak, weak), (data.strong, strong)):
            expected = encoder(*pad_batch(rows, encoder.pad_token_id, encoder.padding_side))
            torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    if dropout == 0.0:  # no dropout anywhere: the views are the anchor
        torch.testing.assert_close(h1, anchor, rtol=1e-12, atol=1e-12)


def test_embed_restores_train_mode_after_an_eval_pass():
    encoder, tokenizer = make_encoder("bert", dropout=0.2)
    encoder.train()
    ids, mask = pad_batch(tokenizer(SENTENCES[:2])["input_ids"], encoder.pad_token_id, "right")
    embed(encoder, (ids, mask, False))
    assert encoder.training and all(m.training for m in encoder.modules())


def test_gradient_cache_equals_plain_backprop_with_dropout():
    """Both views reproduced by the RNG replay: the gradient cache's gradients equal plain backprop of the same
    passes (float64, dropout 0.2, chunks of 7 rows across the dropout/no-dropout boundary)."""
    from angle_kernels import ArcCSELoss

    encoder, tokenizer = make_encoder("bert", dropout=0.2)
    encoder.train()
    batch = _sentences(tokenizer).batch(list(range(len(SENTENCES))))
    chunks = _batch_chunks(encoder, batch, rows=7)
    loss_fn = ArcCSEObjective(ArcCSELoss(), world_size=1)
    results = []
    for step in (plain_step, grad_cache_step):
        encoder.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        loss = step(encoder, chunks, batch.labels, loss_fn)
        results.append((loss, param_grads(encoder)))
    (plain_loss, plain_grads), (cache_loss, cache_grads) = results
    torch.testing.assert_close(cache_loss, plain_loss, rtol=1e-12, atol=1e-12)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(cache_grads[name], grad, rtol=1e-9, atol=1e-12, msg=name)


def test_a_triplet_weight_of_zero_embeds_the_two_views_alone():
    """--triplet-w 0 (ArcCon alone) embedded the three triplet blocks and threw them away (2.5x the encoder's work):
    its batches are the two views' blocks, and the loss and gradients are those of the five-block layout with the
    triplet term at weight 0 (the same dropout masks: the views come first in both). The header and the model card
    say ArcCon alone, naming no masked copy."""
    from angle_kernels import ArcCSELoss
    from angle_train.arccse import ARCCON_BLOCKS, blocks_of

    assert blocks_of(0.0) == ARCCON_BLOCKS and blocks_of(0.1) == BLOCKS
    encoder, tokenizer = make_encoder("bert", dropout=0.2)
    encoder.train()
    indices = list(range(len(SENTENCES)))
    results = []
    for blocks in (BLOCKS, ARCCON_BLOCKS):
        data = TokenizedSentences(SENTENCES, tokenizer, max_length=32, mask_rates=(0.2, 0.4), seed=0, blocks=blocks)
        batch = data.batch(indices)
        assert len(batch.seqs) == blocks * len(indices) == len(data.lengths_of(indices))
        assert ("ArcCon alone" in data.describe()) is (blocks == ARCCON_BLOCKS)
        loss_fn = ArcCSEObjective(ArcCSELoss(triplet_weight=0.0), world_size=1, blocks=blocks)
        encoder.zero_grad(set_to_none=True)
        torch.manual_seed(3)
        loss = plain_step(encoder, _batch_chunks(encoder, batch, rows=7), batch.labels, loss_fn)
        results.append((loss, param_grads(encoder)))
    (five_loss, five_grads), (two_loss, two_grads) = results
    torch.testing.assert_close(two_loss, five_loss, rtol=1e-12, atol=1e-12)
    for name, grad in five_grads.items():
        torch.testing.assert_close(two_grads[name], grad, rtol=1e-9, atol=1e-12, msg=name)

    from angle_train.config import TrainConfig
    from angle_train.trainer import loss_description

    # the header and the model card named the masked copies' rates (" + 0 x triplet (masked copies at [0.2, 0.4])")
    # of a run that makes none
    assert loss_description(TrainConfig(objective="arccse", triplet_w=0.0), None, "ArcCSELoss", 32) == (
        "ArcCSELoss: ArcCon (margin 10 degrees, tau 0.05) alone (triplet weight 0: no masked copies)")
    assert loss_description(TrainConfig(objective="arccse", triplet_w=0.5), None, "ArcCSELoss", 32) == (
        "ArcCSELoss: ArcCon (margin 10 degrees, tau 0.05) + 0.5 x triplet (masked copies at [0.2, 0.4])")


def test_a_text_column_for_sentences_without_columns_is_refused(tmp_path):
    """A .txt file (one sentence a line), an STS-B file and a built-in dataset have no column to choose: --text-column
    was ignored in silence and the run trained on the whole lines or the pairs' texts. Refused naming the flag; where
    a source has columns, no column given reads 'text'."""
    from angle_train.config import TrainConfig
    from angle_train.trainer import read_sentences

    (tmp_path / "s.txt").write_text("a red car\nthe dog\n")
    (tmp_path / "sts.csv").write_text("g\tx\t2012\t1\t4.0\ta red car\tthe dog\n")
    for name, kind in (("s.txt", "a .txt file of one sentence a line"), ("sts.csv", "an STS Benchmark file")):
        path = str(tmp_path / name)
        with pytest.raises(DataError, match=re.escape(f"--text-column sentence: {path} is {kind}")):
            read_sentences(TrainConfig(objective="arccse", train_data=path, text_column="sentence"))
        assert load_sentences(path)[0][:2] == ["a red car", "the dog"]  # read without a column
    with pytest.raises(DataError, match=r"--text-column sentence: builtin:demo-sts is a built-in dataset .*leave out"):
        read_sentences(TrainConfig(objective="arccse", train_data="builtin:demo-sts", text_column="sentence"))
    (tmp_path / "s.jsonl").write_text('{"text": "a red car", "sentence": "box"}\n')
    assert load_sentences(str(tmp_path / "s.jsonl")) == (["a red car"], 0)
    assert read_sentences(TrainConfig(objective="arccse", train_data=str(tmp_path / "s.jsonl"),
                                      text_column="sentence")) == ["box"]


def _config(out_dir, **settings):
    return run_config(out_dir, objective="arccse", batch_size=8, max_steps=4, chunk_size=9, lr=1e-3, warmup=0,
                      max_length=16, log_every=1, **settings)


def test_resume_is_exact(tmp_path):
    from angle_train.trainer import StopTraining, train

    def stop_at_2(step, row):
        if step == 2:
            raise StopTraining

    sentences = SENTENCES * 3
    whole = train(_config(tmp_path / "whole"), model=make_encoder("bert", dropout=0.1), train_examples=sentences)
    train(_config(tmp_path / "parts", save_every=2), model=make_encoder("bert", dropout=0.1),
          train_examples=sentences, on_step=stop_at_2)
    resumed = train(_config(tmp_path / "parts", save_every=2, resume="auto"), model=make_encoder("bert", dropout=0.1),
                    train_examples=sentences)
    assert [r["loss"] for r in resumed.history] == [r["loss"] for r in whole.history][2:]
    for name, value in whole.encoder.state_dict().items():
        assert torch.equal(resumed.encoder.state_dict()[name], value), name
    # the masks drawn depend on the rates: other ones would train other copies of the epoch's sentences; the column
    # sentences are read from names nothing where they are given to train(), and is not compared
    with pytest.raises(ValueError, match=r"cannot resume .*differ from the checkpoint's \(--mask-rates: \[0.2, 0.4\] "
                                         r"-> \[0.1, 0.3\]\)"):
        train(_config(tmp_path / "parts", save_every=2, resume="auto", mask_rates=[0.1, 0.3], text_column="sentence"),
              model=make_encoder("bert", dropout=0.1), train_examples=sentences)


def _rank_main(rank, world, port, out_dir):
    from angle_train.trainer import train

    with rank_of_a_job(rank, world, port):
        result = train(_config(out_dir), model=make_encoder("bert"), train_examples=SENTENCES * 3)
        torch.save({"losses": [r["loss"] for r in result.history], "weights": result.encoder.state_dict()},
                   os.path.join(out_dir, f"rank{rank}.pt"))


def test_two_processes_share_negatives_and_equal_one(tmp_path):
    """2 gloo processes, 4 sentences each, every block gathered: the losses and weights of one process on all 8."""
    from angle_train.trainer import train

    start_ranks(_rank_main, (2, free_port(), str(tmp_path / "ddp")))
    single = train(_config(tmp_path / "single"), model=make_encoder("bert"), train_examples=SENTENCES * 3)
    assert_ranks_match(tmp_path / "ddp", "rank{rank}.pt", single)


def test_command_line_from_a_text_file(tmp_path, capsys):
    from angle_train import cli
    from angle_train.export import load_pretrained

    text = tmp_path / "wiki.txt"
    text.write_text("\n".join(SENTENCES * 4) + "\n\n")
    out = tmp_path / "run"
    assert cli.main(["--objective", "arccse", "--train-data", str(text), "--dev-data", "builtin:demo-sts",
                     "--batch-size", "6", "--max-steps", "5", "--chunk-size", "16", "--output-dir", str(out),
                     "--progress", "0", "--device", "cpu", "--mask-rates", "0.2", "0.4"]) == 0
    printed = capsys.readouterr().out
    assert "32 sentences (ArcCSE" in printed and "1 blank line(s)" in printed and "dev Spearman" in printed
    # they are sentences, not examples; 5 steps of 6 reach the epoch's end (32 // 6)
    assert "each epoch leaves out 2 of the 32 sentences (6.2%" in printed
    assert re.search(r"done: 5 steps \|.* sentences/s, ", printed) and "pairs/s" not in printed
    with open(out / "config.json") as f:
        assert json.load(f)["objective"] == "arccse"
    # metrics.jsonl keeps pairs_per_s (read since the first version) and names the rate by its unit beside it
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rated = [row for row in rows if "pairs_per_s" in row]
    assert rated and all(row["sentences_per_s"] == row["pairs_per_s"] for row in rated)
    assert "each 6 x 1 sentences" in (out / "final" / "README.md").read_text()
    encoder, tokenizer, _ = load_pretrained(str(out / "final"))
    assert encoder.encode(SENTENCES, tokenizer).shape == (len(SENTENCES), encoder.embedding_dim)


def test_refusals(tmp_path):
    from angle_train.cli import config_from_args
    from angle_train.trainer import train

    for flags in (["--mask-rates", "0.4", "0.2"], ["--mask-rates", "0.2"], ["--objective", "arccse", "--espresso"],
                  ["--arccon-tau", "0"]):
        with pytest.raises(SystemExit):
            config_from_args(flags)
    encoder, tokenizer = make_encoder("bert")
    tokenizer.mask_token = None
    with pytest.raises(ValueError, match="has none"):
        train(_config(tmp_path), model=(encoder, tokenizer), train_examples=SENTENCES)


@pytest.mark.parametrize("rates", [["0", "0"], ["0", "0.4"]])
def test_a_weak_rate_of_zero_is_refused_while_the_triplet_term_weighs(rates, capsys):
    """A weak rate of 0 leaves the weak copy the sentence itself, embedded as the anchor is (dropout off): the triplet
    term max(0, cos(anchor, strong) - cos(anchor, weak)) was 0 at every step, its three blocks embedded for nothing,
    without a word. Refused naming --mask-rates, as one sentence a batch is; with --triplet-w 0 no copy is embedded,
    and it is accepted."""
    from angle_kernels.losses.arccse import triplet_loss
    from angle_train.cli import config_from_args

    encoder, tokenizer = make_encoder("bert")
    encoder.eval()
    data = TokenizedSentences(SENTENCES, tokenizer, max_length=32, mask_rates=[float(r) for r in rates], seed=0)
    n = len(SENTENCES)
    with torch.no_grad():
        embeddings = encoder(*pad_batch(data.batch(list(range(n))).seqs, encoder.pad_token_id, encoder.padding_side))
    anchor, weak, strong = embeddings[2 * n:3 * n], embeddings[3 * n:4 * n], embeddings[4 * n:]
    assert torch.equal(anchor, weak) and triplet_loss(anchor, weak, strong).item() == 0.0
    with pytest.raises(SystemExit):
        config_from_args(["--objective", "arccse", "--mask-rates", *rates])
    assert (f"--mask-rates {' '.join(rates)}: a weak rate of 0 leaves the weak copy unmasked, the sentence itself, so "
            "the triplet term") in capsys.readouterr().err
    assert config_from_args(["--objective", "arccse", "--mask-rates", *rates, "--triplet-w", "0"]).triplet_w == 0

@pytest.mark.parametrize("triplet_w", ["0.1", "0"])
def test_one_sentence_a_batch_is_refused(tmp_path, capsys, triplet_w):
    """ArcCon's negatives are the other sentences of the batch: with one sentence its loss was exactly 0 at every step
    (the triplet term's too, most steps), and the run trained on without a word."""
    from angle_train.cli import config_from_args
    from angle_train.trainer import train

    said = "--batch-size 1 with --objective arccse: ArcCon compares each sentence's two views with the other"
    with pytest.raises(SystemExit):
        config_from_args(["--objective", "arccse", "--batch-size", "1", "--triplet-w", triplet_w])
    assert said in capsys.readouterr().err
    with pytest.raises(ValueError, match=re.escape(said)):
        train(run_config(tmp_path, objective="arccse", batch_size=1, triplet_w=float(triplet_w), max_steps=1),
              model=make_encoder("bert"), train_examples=SENTENCES)
    assert config_from_args(["--objective", "arccse", "--batch-size", "2"]).batch_size == 2
