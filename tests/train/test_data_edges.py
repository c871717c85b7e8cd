"""angle_train's data reading at its edges: what a file, a dataset or the Python API may hold and how each is read or
refused (naming the line, the column or the argument), and the fingerprints and epoch orders a checkpoint records,
which a resume recomputes and must find unchanged."""

import json
import re

import pytest
from train_helpers import version_1_epoch_batches, write_data_file

from angle_train.data import DataError, Example, load_examples


def test_a_mapping_may_name_a_column_that_is_called_like_another_name(tmp_path):
    """--columns query=text1 positive=text2 reads a pairs file's text1/text2 as query/positive: the mapped columns
    are not also read under their own names (which refused the file: 'format B does not read text1, text2')."""
    path = write_data_file(tmp_path, "pairs.jsonl", json.dumps({"text1": "a question", "text2": "its answer"}) + "\n")
    examples, fmt = load_examples(path, columns={"query": "text1", "positive": "text2"})
    assert fmt == "B" and [e.texts for e in examples] == [("a question", "its answer")]


def test_data_files_named_in_upper_case_are_read_by_their_suffix(tmp_path):
    """TRAIN.JSONL, PAIRS.CSV and PAIRS.TSV (as some Windows tools save them) are read as their lower-case suffixes
    are, a .TSV split at its tabs: each was refused as an "unknown file type; use .jsonl, .csv, .tsv"."""
    jsonl = write_data_file(tmp_path, "TRAIN.JSONL", json.dumps({"query": "a question", "positive": "its answer"}))
    assert load_examples(jsonl) == ([Example(("a question", "its answer"))], "B")
    csv_file = write_data_file(tmp_path, "PAIRS.CSV", 'text1,text2,label\n"x, y",z,0.5\n')
    assert load_examples(csv_file) == ([Example(("x, y", "z"), 0.5)], "A")
    tsv = write_data_file(tmp_path, "PAIRS.TSV", 'query\tpositive\n"x, y\tz\n')
    assert load_examples(tsv) == ([Example(('"x, y', "z"))], "B")


def test_a_lone_surrogate_escape_is_refused_with_the_line_and_the_key(tmp_path):
    """A JSON \\ud800 escape without its pair (an emoji cut in half) is valid JSON but no text: angle-train failed
    later with "'utf-8' codec can't encode character '\\ud800'", naming no file or line, and angle-eval with a
    tokenizers traceback. Refused with the line and the key; a paired escape (an emoji) is read."""
    path = write_data_file(tmp_path, "cut.jsonl", '{"query": "a \\ud83d\\ude00 smile", "positive": "y"}\n'
                                                  '{"query": "a", "positive": "cut \\ud83d"}\n')
    with pytest.raises(DataError, match=r"^.*cut.jsonl, line 2: the value of 'positive' holds a lone surrogate escape "
                                        r"\(\\ud83d at character 4: .*fix or remove it$"):
        load_examples(path)
    path = write_data_file(tmp_path, "emoji.jsonl", '{"query": "a \\ud83d\\ude00 smile", "positive": "y"}\n')
    assert load_examples(path) == ([Example(("a \U0001f600 smile", "y"))], "B")
    path = write_data_file(tmp_path, "key.jsonl", '{"query": "a", "positive": "y", "\\udc00": "z"}\n')
    with pytest.raises(DataError, match=r"line 1: a key holds a lone surrogate escape \(\\udc00 at character 0"):
        load_examples(path)


def test_a_json_key_given_twice_is_refused(tmp_path):
    """A JSON line naming a key twice is refused with the line and the key (as a CSV header naming a column twice
    is): json keeps the last value in silence, so the pair (a, b) was trained as (c, b)."""
    path = write_data_file(tmp_path, "twice.jsonl", '{"query": "x", "positive": "y"}\n'
                                                    '{"query": "a", "positive": "b", "query": "c"}\n')
    with pytest.raises(DataError, match=r"twice.jsonl, line 2: the key 'query' appears more than once in an object, "
                                        r"so only its last value would be read: rename or remove the others$"):
        load_examples(path)
    escaped = write_data_file(tmp_path, "escaped.jsonl", '{"query": "a", "positive": "b", "q\\u0075ery": "c"}\n')
    with pytest.raises(DataError, match=r"escaped.jsonl, line 1: the key 'query' appears more than once"):
        load_examples(escaped)


def test_a_key_given_twice_inside_a_column_is_no_reason_to_refuse_the_row(tmp_path):
    """Only a row's own keys are its columns: an object inside a column that no format reads (metadata beside the
    texts) naming a key twice leaves the row as it was read (it was refused as a key given twice)."""
    path = write_data_file(tmp_path, "meta.jsonl", '{"query": "a", "positive": "b", "meta": {"k": 1, "k": 2}}\n')
    assert load_examples(path) == ([Example(("a", "b"))], "B")


def test_a_label_with_a_digit_separator_is_refused(tmp_path):
    """A label of "1_0" is refused with its line: Python's float() reads it as 10 (a digit separator), where in a
    data file it is a typo."""
    path = write_data_file(tmp_path, "sep.csv", "text1,text2,label\nx,y,1.0\nx,z,1_0\n")
    with pytest.raises(DataError, match=r"sep.csv, line 3: bad label '1_0' \(must be a finite number\)$"):
        load_examples(path)
    # the ways a number is written in a data file are read as before
    written = write_data_file(tmp_path, "numbers.csv", 'text1,text2,label\nx,y," 1.0 "\nx,z,+1\nx,w,1e-3\nx,v,-.5\n')
    assert [example.label for example in load_examples(written)[0]] == [1.0, 1.0, 0.001, -0.5]


def test_a_json_boolean_label_is_refused(tmp_path):
    """A label of true/false is not a similarity score (a column of flags put where the score belongs): refused with
    the line, as other non-numbers are, not trained as 1.0 / 0.0."""
    path = write_data_file(tmp_path, "bool.jsonl", '{"text1": "x", "text2": "y", "label": 1}\n'
                                          '{"text1": "x", "text2": "y", "label": true}\n')
    with pytest.raises(DataError, match=r"bool.jsonl, line 2: bad label true \(a boolean, not a number: where it is "
                                        r"a 0/1 similarity label, write it as 1 or 0\)$"):
        load_examples(path)


def test_a_csv_whose_detected_format_leaves_a_label_unread_is_refused(tmp_path):
    """The refusal of a column the detected format does not read holds for CSV/TSV headers as for JSONL rows: a
    query,positive,label CSV was format B with its labels (0: not a match) dropped in silence."""
    for name, text in (("qp_label.csv", "query,positive,label\na,b,0\n"),
                       ("qp_label.tsv", "query\tpositive\tlabel\na\tb\t0\n")):
        with pytest.raises(DataError, match=r"line 1 \(header\): format B \(query, positive, detected from the "
                                            r"columns\) does not read the column\(s\) 'label'"):
            load_examples(write_data_file(tmp_path, name, text))
        examples, fmt = load_examples(str(tmp_path / name), fmt="B")  # given, the format reads what it reads
        assert fmt == "B" and examples[0].texts == ("a", "b")


def test_the_stsb_layout_refuses_another_format(tmp_path):
    """An STS-B file is format A: --data-format B or C on one is refused, not overridden in silence."""
    path = write_data_file(tmp_path, "sts.csv", "g\tx\t2012\t1\t2.0\ta\tb\n")
    for fmt in ("B", "C"):
        with pytest.raises(DataError, match=r"sts.csv: the STS-B layout is format A .*got format='%s'" % fmt):
            load_examples(path, fmt=fmt)
        with pytest.raises(DataError, match="the STS-B layout is format A"):
            load_examples(path, fmt=fmt, layout="stsb")
    assert load_examples(path, fmt="A")[1] == "A"


def test_the_data_fingerprint_covers_every_item_past_the_first_chunk():
    """data_fingerprint hashes the items 4,096 at a time: an edit to any one, at a chunk's edge too, changes it (a
    resume over edited data is refused by it)."""
    from angle_train.data import Example, data_fingerprint

    examples = [Example((f"q{i}", f"p{i}")) for i in range(8200)]
    base = data_fingerprint(examples)
    for i in (4095, 4096, 8191, 8192, 8199):
        changed = list(examples)
        changed[i] = Example((f"q{i}", "edited"))
        assert data_fingerprint(changed) != base, i


def test_tokenized_pairs_refuse_examples_with_another_count_of_texts():
    """Examples given from Python whose texts do not match the format are refused by index: a triplet under format B
    had its negative dropped in silence (a pair under C failed later, without saying which example)."""
    from angle_train.data import Example, TokenizedPairs
    from angle_train.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    pairs = [Example(("a dog", "a puppy")), Example(("a car", "a truck"))]
    with pytest.raises(DataError, match="example 1 has 3 texts; format B needs 2"):
        TokenizedPairs([pairs[0], Example(("a cat", "a kitten", "a house"))], "B", tokenizer, max_length=16)
    with pytest.raises(DataError, match="example 0 has 2 texts; format C needs 3"):
        TokenizedPairs(pairs, "C", tokenizer, max_length=16)
    assert len(TokenizedPairs(pairs, "B", tokenizer, max_length=16)) == 2


def test_a_jsonl_line_with_tabs_is_read_as_json_not_as_stsb(tmp_path):
    """A .jsonl file is JSON whatever its whitespace: a line with tabs between its tokens (7 tab-separated fields,
    the 5th a number) is not taken for the STS-B layout, which read its punctuation as the texts."""
    line = '{"text1": "a",\t"text2": "b",\t"label":\t\t5\t,"x": 1\t}'
    assert len(line.split("\t")) == 7 and json.loads(line) == {"text1": "a", "text2": "b", "label": 5, "x": 1}
    examples, fmt = load_examples(write_data_file(tmp_path, "tabs.jsonl", line + "\n"))
    assert fmt == "A" and examples[0].texts == ("a", "b") and examples[0].label == 5.0


def test_a_batch_refuses_more_dropout_rows_than_it_has():
    from angle_train.data import Batch

    import torch

    with pytest.raises(ValueError, match="dropout_rows must be between 0 and the batch's 3 rows, got 4"):
        Batch([[1, 2], [3], [4, 5, 6]], torch.ones(3), dropout_rows=4)
    with pytest.raises(ValueError, match="dropout_rows must be between 0"):
        Batch([[1, 2], [3], [4, 5, 6]], torch.ones(3), dropout_rows=-1)
    assert Batch([[1, 2], [3], [4, 5, 6]], torch.ones(3), dropout_rows=3).dropout_rows == 3


@pytest.mark.parametrize("line, kind", [('["query", "positive"]', "list"), ("null", "NoneType"), ('"text"', "str"),
                                        ("3", "int")])
def test_a_jsonl_line_that_is_not_an_object_is_named(tmp_path, line, kind):
    """Every line of a JSONL file must be a JSON object: any other value is a DataError naming the line and what it
    is (a list of the column names crashed with a TypeError, a string was split into one-letter columns)."""
    path = write_data_file(tmp_path, "rows.jsonl", '{"query": "a", "positive": "b"}\n' + line + "\n")
    with pytest.raises(DataError, match=rf"rows.jsonl, line 2: each line must be a JSON object; got {kind}"):
        load_examples(path)


def test_a_json_array_of_records_is_said_to_be_unread(tmp_path):
    """A .json file holding one array of records (a common export) is not JSON Lines: the refusal says so."""
    path = write_data_file(tmp_path, "rows.json", json.dumps([{"query": "a", "positive": "b"}] * 2) + "\n")
    with pytest.raises(DataError, match=r"rows.json, line 1: each line must be a JSON object; got list \(a file "
                                        r"holding one JSON array of records is not read: write one record a line"):
        load_examples(path)


def test_dcp_metadata_naming_a_torch_function_is_refused_by_name(tmp_path):
    """read_dcp_metadata admits from torch only its dtypes (TensorProperties' dtype): a .metadata naming a torch
    function (torch.is_tensor here, harmless; torch.save or torch.set_default_dtype would write files or change the
    process) is refused by name before the function is called."""
    import pickle

    import torch

    from angle_train.safe_loading import UnsafeCheckpointError
    from angle_train.sharding import read_dcp_metadata

    class CallsATorchFunction:
        def __reduce__(self):
            return torch.is_tensor, (1,)

    (tmp_path / ".metadata").write_bytes(pickle.dumps(CallsATorchFunction()))
    with pytest.raises(UnsafeCheckpointError, match=r"it names torch.is_tensor, which DCP's metadata never holds"):
        read_dcp_metadata(str(tmp_path))


def test_dcp_metadata_setting_attributes_of_a_shared_enum_member_is_refused(tmp_path):
    """A .metadata that builds one of DCP's memory-format Enum members (shared by the whole process) and then sets an
    attribute on it is refused by name before the attribute is set: BUILD is admitted on DCP's records alone."""
    from torch.distributed.checkpoint.metadata import _MEM_FORMAT_ENCODING

    from angle_train.safe_loading import UnsafeCheckpointError
    from angle_train.sharding import read_dcp_metadata

    name = b"planted"
    (tmp_path / ".metadata").write_bytes(
        b"\x80\x02ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\nK\x00\x85R"  # the member of value 0
        b"}X" + len(name).to_bytes(4, "little") + name + b"\x88sb.")  # BUILD {name: True} on it; STOP
    member = _MEM_FORMAT_ENCODING(0)
    try:
        with pytest.raises(UnsafeCheckpointError, match=r"it sets attributes of .*_MEM_FORMAT_ENCODING"):
            read_dcp_metadata(str(tmp_path))
        assert not hasattr(member, "planted")
    finally:
        vars(member).pop("planted", None)


def test_the_sampled_fingerprint_is_the_one_earlier_checkpoints_recorded():
    """sampled_data_fingerprint must compute exactly what earlier versions recorded as a checkpoint's "fingerprint"
    (their data_record): any change to it refuses every resume from such a checkpoint. Pinned values, and the
    algorithm written out: the count, then every (position, item) of at most ~1,000 evenly spaced ones."""
    import hashlib

    from angle_train.data import Example, sampled_data_fingerprint

    def written_out(items):
        step = max(1, len(items) // 1000)
        digest = hashlib.sha256(str(len(items)).encode())
        for i in range(0, len(items), step):
            digest.update(repr((i, items[i])).encode())
        return digest.hexdigest()[:16]

    for n in (3, 999, 2500, 2997):
        examples = [Example((f"q{i}", f"p{i}"), label=float(i % 5)) for i in range(n)]
        assert sampled_data_fingerprint(examples) == written_out(examples), n
    assert sampled_data_fingerprint([Example(("a", "b"), 0.5), Example(("c", "d"), 1.0)]) == "e1355718dec391aa"
    assert sampled_data_fingerprint([Example((f"q{i}", f"p{i}")) for i in range(2500)]) == "938cf9170bdec9b4"


def test_a_hf_dataset_whose_detected_format_leaves_a_label_unread_is_refused(tmp_path):
    """As for files: a saved dataset with query, positive and label columns is not format B with its labels dropped
    in silence; --data-format B (a Hub dataset cannot drop a column) reads its pairs."""
    datasets = pytest.importorskip("datasets")
    folder = str(tmp_path / "ds")
    datasets.Dataset.from_dict({"query": ["a", "b"], "positive": ["c", "d"], "label": [1, 0]}).save_to_disk(folder)
    with pytest.raises(DataError, match=r"format B \(query, positive, detected from the columns\) does not read the "
                                        r"column\(s\) 'label'"):
        load_examples(folder)
    examples, fmt = load_examples(folder, fmt="B")
    assert fmt == "B" and [e.texts for e in examples] == [("a", "c"), ("b", "d")]


@pytest.mark.parametrize("value, shown", [("5", "int 5"), ('["a"]', "list ['a']"), ("true", "bool True")])
def test_a_text_that_is_not_a_string_is_named(tmp_path, value, shown):
    """A JSON text column holding a number, a list or a boolean is a DataError naming the line, the column and the
    value (it crashed with an AttributeError, or reached the tokenizer)."""
    path = write_data_file(tmp_path, "t.jsonl",
                           '{"query": "a", "positive": "b"}\n{"query": %s, "positive": "b"}\n' % value)
    with pytest.raises(DataError, match=rf"t.jsonl, line 2: column 'query' must be a string; got {re.escape(shown)}"):
        load_examples(path)


def test_stsb_blank_lines_are_skipped_wherever_they_stand(tmp_path):
    """Blank lines in an STS-B file (at its start, between lines, at its end) are skipped as in JSONL: the layout is
    still detected and every data line read."""
    lines = ["g\tx\t2012\t1\t4.0\ta\tb", "g\tx\t2012\t2\t1.5\tc\td"]
    path = write_data_file(tmp_path, "sts.csv", "\n" + lines[0] + "\n\n" + lines[1] + "\n\n")
    examples, fmt = load_examples(path)
    assert fmt == "A" and [(e.texts, e.label) for e in examples] == [(("a", "b"), 4.0), (("c", "d"), 1.5)]


def test_an_epoch_of_exactly_one_batch_is_trained():
    """A dataset of exactly batch_size examples is one full batch (fewer is refused): not 'fewer than one batch'."""
    from angle_train.data import epoch_batches

    batches = epoch_batches(8, 8, seed=0, epoch=0)
    assert len(batches) == 1 and sorted(batches[0]) == list(range(8))
    with pytest.raises(ValueError, match="the dataset has 7 examples, fewer than one batch of 8"):
        epoch_batches(7, 8, seed=0, epoch=0)


def test_dcp_metadata_whose_storage_data_is_not_a_dict_is_refused(tmp_path):
    """A .metadata holding DCP's Metadata record with storage_data of another type is refused as unsafe, naming the
    file (it crashed with an AttributeError)."""
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    from angle_train.safe_loading import UnsafeCheckpointError
    from angle_train.sharding import read_dcp_metadata

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={}, storage_data=["x.distcp"])))
    with pytest.raises(UnsafeCheckpointError, match=r"refusing to load .*\.metadata: it holds a Metadata"):
        read_dcp_metadata(str(tmp_path))


@pytest.mark.parametrize("path", [5, None], ids=["a number", "none"])
def test_dcp_metadata_pointing_at_something_other_than_a_file_name_is_refused(tmp_path, path):
    """A .metadata whose shard entry is not a file name at all (a number, None) is refused as unsafe, naming the file
    and the entry, not a TypeError from the name check."""
    import pickle

    from torch.distributed.checkpoint.metadata import Metadata

    from angle_train.safe_loading import UnsafeCheckpointError
    from angle_train.sharding import read_dcp_metadata

    (tmp_path / ".metadata").write_bytes(pickle.dumps(Metadata(state_dict_metadata={}, storage_data={"w": path})))
    with pytest.raises(UnsafeCheckpointError, match=rf"refusing to load .*\.metadata: it points DCP at {path!r}, "
                                                    "outside the checkpoint folder"):
        read_dcp_metadata(str(tmp_path))


def test_a_max_length_that_the_prompt_fills_exactly_is_refused():
    """--max-length equal to the prompt's own tokens (special ones included) leaves a text no token: refused, not
    every text cut to nothing (all examples the bare prompt). One token more keeps a token of the text."""
    from angle_train.data import ANGLE_PROMPT, prompted_texts
    from angle_train.tiny import build_tokenizer

    tokenizer = build_tokenizer()
    head, _, tail = ANGLE_PROMPT.partition("{text}")
    fixed = tokenizer.num_special_tokens_to_add(pair=False) + len(
        tokenizer(head + tail, add_special_tokens=False)["input_ids"])
    with pytest.raises(ValueError, match=rf"--max-length {fixed} leaves no room for a text in the prompt"):
        prompted_texts(["a small red car", "a dog"], ANGLE_PROMPT, tokenizer, fixed)
    texts, cut = prompted_texts(["a small red car"], ANGLE_PROMPT, tokenizer, fixed + 1)
    assert texts == ['Summarize sentence "a" in one word:"'] and cut == [0]


@pytest.mark.parametrize("text, line", [('query,positive\na,b\nc,"d"e\n', 3),
                                        ('query,positive\na,b\nc,"d\n', 3),
                                        ('query,positive\na,"b\nc"x,d\ne,f\n', 3)])
def test_a_csv_syntax_error_names_the_line_it_is_on(tmp_path, text, line):
    """A malformed CSV record (text after a closing quote, a quote never closed, a bad record spanning two lines) is
    a DataError naming the line the error is on, never read with its quotes dropped: the reader's own line count
    named the line before it, or the line its record began on."""
    with pytest.raises(DataError, match=rf"q.csv, line {line}: "):
        load_examples(write_data_file(tmp_path, "q.csv", text))


def test_a_quote_never_closed_names_the_line_that_opened_it(tmp_path):
    """A quote opened and never closed reads every line after it into one field, and the reader stops at the file's
    end: the error names that line and the line the record began on, where the quote is (only the end was named:
    line 100,001 of a file whose line 90,002 opens a quote)."""
    rows = "".join(f"q{i},p{i}\n" for i in range(6))
    text = "query,positive\na,b\n\n\"c d,e\n" + rows
    with pytest.raises(DataError, match=r"q.csv, line 10: unexpected end of data \(in the record that begins at line "
                                        r"4: a quoted field opened there runs on to line 10; close its quote"):
        load_examples(write_data_file(tmp_path, "q.csv", text))


def test_bad_arguments_of_the_data_api_are_refused():
    """Arguments out of their documented values are errors naming the argument, not taken as another value."""
    import torch

    from angle_train.data import Batch, Example, TokenizedPairs, pad_batch

    with pytest.raises(ValueError, match="layout must be None or 'stsb'; got 'STSB'"):
        load_examples("anything.csv", layout="STSB")
    with pytest.raises(ValueError, match="side must be 'left' or 'right'; got 'center'"):
        pad_batch([[1, 2], [3]], pad_id=0, side="center")
    with pytest.raises(ValueError, match="a row count or a token budget, not both"):
        Batch([[1, 2], [3]], torch.ones(2)).plan(rows=1, tokens=10)
    with pytest.raises(ValueError, match="format must be one of 'A', 'B', 'C'; got 'b'"):
        TokenizedPairs([Example(("a", "b"))], "b", tokenizer=None, max_length=8)


def test_the_epoch_order_and_its_fingerprint_are_those_checkpoints_recorded():
    """A checkpoint records its epoch's order fingerprint and a resume recomputes the order from (seed, epoch): the
    order must be the one every earlier version made (pinned here; any change to the seeding or the shuffles refuses
    every resume of an existing run), and the fingerprint must cover every batch, the last one too."""
    from angle_train.data import epoch_batches, order_fingerprint

    assert epoch_batches(10, 3, seed=7, epoch=2) == [[5, 8, 7], [9, 3, 2], [0, 1, 4]]
    assert epoch_batches(24, 4, seed=7, epoch=2) == [[16, 19, 5, 23], [20, 13, 6, 7], [17, 8, 4, 15], [11, 1, 18, 10],
                                                    [0, 14, 21, 3], [2, 9, 12, 22]]
    assert epoch_batches(12, 3, seed=1, epoch=0, lengths=[i % 4 for i in range(12)], bucket_size=2) == [
        [2, 10, 11], [6, 7, 3], [4, 8, 5], [0, 9, 1]]
    assert order_fingerprint([[0, 1], [2, 3]]) == "a1e03200f1f82ad2"
    assert order_fingerprint([[0, 1], [3, 2]]) == "92dd7580bfd5a67a"  # the last batch's order counts


def test_bucketing_leaves_out_the_examples_an_unbucketed_epoch_does():
    """The examples short of a last full batch are the tail of the epoch's shuffled order, a random choice, with
    --bucket as without: --bucket sorted the last run of examples by length before leaving them out, so an epoch left
    out the longest of that run (a run of 60 examples in batches of 8 and runs of 2 batches: 4 of the longest 12,
    every epoch). Orders without --bucket are those of ORDER_VERSION 1, which checkpoints hold."""
    from angle_train.data import epoch_batches

    lengths = list(range(60))  # each example's length its index: all distinct
    left_out_lengths = []
    for seed, epoch in [(0, 0), (1, 3), (7, 2), (42, 9)] + [(5, e) for e in range(20)]:
        plain = epoch_batches(60, 8, seed=seed, epoch=epoch)
        assert plain == version_1_epoch_batches(60, 8, seed=seed, epoch=epoch)
        bucketed = epoch_batches(60, 8, seed=seed, epoch=epoch, lengths=lengths, bucket_size=2)
        kept = sorted(i for batch in bucketed for i in batch)
        assert kept == sorted(i for batch in plain for i in batch) and len(kept) == 56
        left_out_lengths += [lengths[i] for i in set(range(60)) - set(kept)]
    # a random choice: their mean length is near the data's (29.5), where the longest 4 of 12 average about 48
    assert 20 < sum(left_out_lengths) / len(left_out_lengths) < 40


def test_the_columns_flag_takes_items_separated_by_commas_and_refuses_half_ones():
    """--columns reads NAME=COLUMN items, several in one separated by commas (spaces around them dropped); an item
    without its name or its column, or a bare string from Python, is refused naming it, not read as another mapping."""
    from angle_train.data import parse_columns

    assert parse_columns(["text1=sent_a , text2=sent_b", "label=similarity"]) == {
        "text1": "sent_a", "text2": "sent_b", "label": "similarity"}
    for item in ("=sent_a", "text1="):
        with pytest.raises(ValueError, match=rf"--columns {item}: expected NAME=COLUMN"):
            parse_columns([item])
    with pytest.raises(ValueError, match=r"--columns: expected NAME=COLUMN items; got 'text1=sent_a'"):
        parse_columns("text1=sent_a")


def test_a_column_mapped_to_two_names_is_refused():
    """--columns query=a positive=a trained on (x, x) pairs without a word: a column mapped to two names is refused,
    naming both and the column, for --columns and --dev-columns alike, before anything is read."""
    from angle_train.config import TrainConfig
    from angle_train.data import parse_columns

    said = r"query=a positive=a: the column 'a' is mapped to both query and positive; map each name to a column"
    with pytest.raises(DataError, match=rf"^--columns {said}"):
        parse_columns(["query=a", "positive=a"])
    with pytest.raises(ValueError, match=rf"^--dev-columns {said}"):
        TrainConfig(dev_data="dev.jsonl", dev_columns=["query=a,positive=a"]).validate()


def test_the_stsb_layout_is_detected_by_its_score_whatever_its_ids(tmp_path):
    """An STS-B file is told by its score (field 4) and its seven fields: ids that are not numbers (field 3) leave it
    the STS-B layout."""
    path = write_data_file(tmp_path, "sts.csv", "g\tx\t2012\tid-a\t4.0\ta\tb\ng\tx\t2012\tid-b\t1.5\tc\td\n")
    examples, fmt = load_examples(path)
    assert fmt == "A" and [(e.texts, e.label) for e in examples] == [(("a", "b"), 4.0), (("c", "d"), 1.5)]


def test_a_json_file_is_read_as_json_lines_and_another_file_type_is_refused(tmp_path):
    """A .json file is read as a .jsonl one (one object a line); a file of another type (not the STS-B layout) is a
    DataError naming the types read, not handed to the Hugging Face loader as a dataset name."""
    examples, fmt = load_examples(write_data_file(tmp_path, "pairs.json", '{"query": "a", "positive": "b"}\n'))
    assert fmt == "B" and examples[0].texts == ("a", "b")
    with pytest.raises(DataError, match=r"pairs.txt: unknown file type; use .jsonl, .csv, .tsv or the STS-B layout"):
        load_examples(write_data_file(tmp_path, "pairs.txt", '{"query": "a", "positive": "b"}\n'))


def test_a_bad_row_of_a_hf_dataset_is_named_by_its_index(tmp_path):
    """A saved dataset's rows have no lines: a row that cannot be read is named by its index (from 0, as
    dataset[i] takes it) and the split."""
    datasets = pytest.importorskip("datasets")
    folder = str(tmp_path / "ds")
    datasets.Dataset.from_dict({"query": ["a", "b", "c"], "positive": ["d", None, "f"]}).save_to_disk(folder)
    with pytest.raises(DataError, match=r"ds \[train\], row 1: column 'positive' is null"):
        load_examples(folder)


def test_a_hf_datasets_columns_the_format_does_not_read_are_not_decoded(tmp_path, monkeypatch):
    """Only the columns the format reads are read, a block of rows at a time: every column of every row was decoded,
    so a dataset with an audio column beside its texts needed an audio decoder to train on the texts (and decoded
    every row's audio). Rows keep their order and, in any block, their index."""
    datasets = pytest.importorskip("datasets")
    from angle_train import data

    queries, positives = [f"query {i}" for i in range(5)], [f"positive {i}" for i in range(5)]
    folder = str(tmp_path / "ds")
    datasets.Dataset.from_dict({"query": queries, "audio": [{"bytes": b"not audio", "path": None}] * 5,
                                "positive": positives}).cast_column("audio", datasets.Audio()).save_to_disk(folder)
    monkeypatch.setattr(data, "HF_ROWS_AT_ONCE", 2, raising=False)  # blocks of 2 rows: 3 blocks
    examples, fmt = load_examples(folder)
    assert fmt == "B" and [ex.texts for ex in examples] == list(zip(queries, positives))
    folder = str(tmp_path / "bad")
    datasets.Dataset.from_dict({"query": queries, "positive": positives[:3] + [""] + positives[4:]}).save_to_disk(
        folder)
    with pytest.raises(DataError, match=r"bad \[train\], row 3: column 'positive' is an empty text"):
        load_examples(folder)


def test_the_data_fingerprint_is_the_one_checkpoints_recorded():
    """A checkpoint records data_fingerprint (its data_record's "contents") and a resume recomputes it: any change
    to how it is computed refuses every resume of an existing run over unchanged data. Pinned values, of pairs with
    labels and of ArcCSE's sentences."""
    from angle_train.data import Example, data_fingerprint

    assert data_fingerprint([Example(("a", "b"), 0.5), Example(("c", "d"), 1.0)]) == "90a707f214bb64a3"
    assert data_fingerprint([Example(("q", "p", "n"))]) == "af3faef2d940e4a0"
    assert data_fingerprint(["a sentence", "another"]) == "755204e2ff9f17a7"


@pytest.mark.parametrize("name, head, said", [
    ("pairs.jsonl.gz", None, r"a gzip-compressed file, not a text file .*: decompress it first: gunzip -k "),
    ("pairs.parquet", b"PAR1\x15\x04\x15\x94\x08\x15", r"a Parquet file, not a text file .*: write it as JSON Lines"),
    ("data-00000-of-00001.arrow", b"\xff\xff\xff\xff\xb8\x01\x00\x00", r"an Arrow file, not a text file .*: give the "
                                                                       r"dataset folder save_to_disk wrote it in"),
    ("data.arrow", b"ARROW1\x00\x00", r"an Arrow file, not a text file .*: give the dataset folder save_to_disk wrote"),
    ("pairs.zip", b"PK\x03\x04\x14\x00\x00\x00", r"a zip archive, not a text file .*: unpack it first"),
    ("pairs.jsonl", None, r"a gzip-compressed file"),  # named as JSON Lines, compressed all the same
])
def test_a_file_that_is_not_text_is_named_as_what_it_is(tmp_path, name, head, said):
    """A Parquet, Arrow or compressed file given where a data file is read (angle-train's --train-data and
    --dev-data, angle-eval, ArcCSE's sentences) is refused saying what it is and what to do: its first bytes were
    reported as "not UTF-8 ... (it may be Latin-1 / Windows-1252)", which sent the user to re-encode a binary file."""
    import gzip

    from angle_train.arccse import load_sentences
    from angle_train.evaluate import read_dataset

    path = tmp_path / name
    path.write_bytes(gzip.compress(b'{"query": "a", "positive": "b"}\n') if head is None else head + bytes(range(256)))
    for read in (load_examples, read_dataset, load_sentences):
        with pytest.raises(DataError, match=rf"^{re.escape(str(path))}: {said}") as refused:
            read(str(path))
        assert "Latin-1" not in str(refused.value) and "\n" not in str(refused.value)
        # every kind of text file some reader takes is listed: ArcCSE's sentences and angle-eval's STS files are .txt
        assert "(data files are read as UTF-8 text: .jsonl, .csv, .tsv, .txt or the STS-B layout)" in str(
            refused.value)


def test_dev_data_reads_a_saved_dataset_folder_and_its_split(tmp_path):
    """--dev-data reads a folder save_to_disk wrote as --train-data does (a DatasetDict's --dev-split, "validation" by
    default; a Dataset's rows): it was taken for an STS year folder and refused, naming its dataset_dict.json as a
    data file to give. angle-eval, which reads files, refuses such a folder saying what it is."""
    datasets = pytest.importorskip("datasets")
    from angle_train.evaluate import RetrievalSet, StsSet, read_dataset
    from angle_train.trainer import read_dev_data

    scored = {"text1": ["a", "b", "c"], "text2": ["d", "e", "f"], "label": [0.0, 2.5, 5.0]}
    pairs = {"query": ["a", "b"], "positive": ["c", "d"]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({k: v[:1] for k, v in scored.items()}),
                          "validation": datasets.Dataset.from_dict(scored)}).save_to_disk(str(tmp_path / "dd"))
    datasets.Dataset.from_dict(pairs).save_to_disk(str(tmp_path / "ds"))
    dev = read_dev_data(str(tmp_path / "dd"), "validation")
    assert isinstance(dev, StsSet) and [(e.texts, e.label) for e in dev.examples] == [
        (("a", "d"), 0.0), (("b", "e"), 2.5), (("c", "f"), 5.0)]
    with pytest.raises(DataError, match=r"^--dev-split test: .*dd has no split 'test' \(its splits: 'train', "
                                        r"'validation'\)$"):
        read_dev_data(str(tmp_path / "dd"), "test")
    dev = read_dev_data(str(tmp_path / "ds"), "validation")
    assert isinstance(dev, RetrievalSet) and (dev.queries, dev.documents) == (["a", "b"], ["c", "d"])
    for name in ("dd", "ds"):
        with pytest.raises(DataError, match=rf"{name}: a Hugging Face dataset saved by save_to_disk, which angle-eval "
                                            r"does not read .*--dev-data reads this folder"):
            read_dataset(str(tmp_path / name))


def test_a_text_of_invisible_characters_alone_is_refused_as_an_empty_one(tmp_path):
    """A text of zero-width spaces, a word joiner, a byte-order mark or a Hangul filler shows nothing, yet str.strip()
    keeps those characters, so it was trained as a sentence where a blank one is refused: now refused the same way,
    naming the line and column (a label of them is an empty label). A text holding a visible character beside them
    (an emoji joined by U+200D) is read as it is; in ArcCSE's .txt sentences such a line is a blank separator."""
    from angle_train.arccse import load_sentences

    for name, text, refused in [
            ("zw.jsonl", '{"query": "a", "positive": "b"}\n{"query": "x", "positive": "\\u200b\\u200b"}\n',
             "zw.jsonl, line 2: column 'positive' is an empty text: '\\u200b\\u200b' holds only invisible characters"),
            ("joiner.csv", "text1,text2,label\na,b,1\nc,\u2060 \ufeff\u200c,2\n",
             "joiner.csv, line 3: column 'text2' is an empty text: '\\u2060 \\ufeff\\u200c' holds only invisible"),
            ("filler.jsonl", '{"query": "\\u3164", "positive": "b"}\n', "filler.jsonl, line 1: column 'query' is an "
                                                                          "empty text: '\\u3164' holds only"),
            ("label.csv", "text1,text2,label\na,b,\u200b\n", "label.csv, line 2: label is empty (expected a number")]:
        with pytest.raises(DataError, match=re.escape(refused)):
            load_examples(write_data_file(tmp_path, name, text))
    emoji = "\U0001F469\u200d\U0001F4BB"
    examples, _ = load_examples(write_data_file(tmp_path, "emoji.jsonl", json.dumps({"query": emoji, "positive": "b"})
                                                + "\n"))
    assert examples[0].texts == (emoji, "b")
    assert load_sentences(write_data_file(tmp_path, "s.txt", "a red car\n\u200b\u200b\nthe dog\n")) == (
        ["a red car", "the dog"], 1)
    with pytest.raises(DataError, match=re.escape("s.jsonl, line 1: column 'text' is an empty text: '\\u200b'")):
        load_sentences(write_data_file(tmp_path, "s.jsonl", '{"text": "\\u200b"}\n'))


def test_a_split_is_refused_naming_its_flag_where_the_saved_dataset_has_no_such_split(tmp_path):
    """A split missing from a DatasetDict folder is refused naming the flag that asked for it (--train-split,
    --dev-split: the message named the folder alone) and the splits there are. A folder of one Dataset (save_to_disk
    of a Dataset) has no splits: it was read whole whatever split was asked for; now it is read whole for the flag's
    default or the split it was saved from, and another split is refused naming the flag."""
    datasets = pytest.importorskip("datasets")
    from angle_train.arccse import load_sentences
    from angle_train.config import TrainConfig
    from angle_train.trainer import read_data, read_dev_data, read_sentences

    pairs = {"query": ["a", "b"], "positive": ["c", "d"]}
    datasets.DatasetDict({"train": datasets.Dataset.from_dict(pairs),
                          "test": datasets.Dataset.from_dict(pairs)}).save_to_disk(str(tmp_path / "dd"))
    datasets.Dataset.from_dict(pairs).save_to_disk(str(tmp_path / "ds"))
    datasets.Dataset.from_dict(pairs, split="test").save_to_disk(str(tmp_path / "test-split"))
    datasets.Dataset.from_dict({"text": ["a red car", "box"]}).save_to_disk(str(tmp_path / "sentences"))
    dd, ds, saved_test, sentences = (str(tmp_path / name) for name in ("dd", "ds", "test-split", "sentences"))
    with pytest.raises(DataError, match=rf"^--train-split dev: {re.escape(dd)} has no split 'dev' \(its splits: "
                                        r"'train', 'test'\)$"):
        read_data(dd, None, "dev", split_setting="train_split")
    with pytest.raises(DataError, match=r"^--dev-split validation: .*dd has no split 'validation' \(its splits: "):
        read_dev_data(dd, "validation")  # the default, not given: named all the same
    one = r"holds one dataset \(save_to_disk of a Dataset, not of a DatasetDict\), which has no split 'test'"
    with pytest.raises(DataError, match=rf"^--train-split test: {re.escape(ds)} {one}: leave --train-split at its "
                                        r"default \('train'\) to read it whole, or save the DatasetDict"):
        read_data(ds, None, "test", split_setting="train_split")
    with pytest.raises(DataError, match=r"^--dev-split test: .* leave --dev-split at its default \('validation'\)"):
        read_dev_data(ds, "test")
    with pytest.raises(DataError, match=r"^--dev-split dev: .*test-split holds one dataset \(save_to_disk of a "
                                        r"Dataset, saved from the split 'test', not of a DatasetDict\)"):
        read_dev_data(saved_test, "dev")
    with pytest.raises(DataError, match=r"^--train-split test: .*sentences holds one dataset"):
        read_sentences(TrainConfig(objective="arccse", train_data=sentences, train_split="test"))
    with pytest.raises(DataError, match=r"^split test: .*ds holds one dataset .*leave split at its default"):
        load_examples(ds, split="test")
    # read whole: at the flag's default, or at the split the Dataset was saved from
    assert [e.texts for e in read_data(ds, None, "train", split_setting="train_split")[0]] == [("a", "c"), ("b", "d")]
    assert read_dev_data(ds, "validation").queries == ["a", "b"]
    assert read_dev_data(saved_test, "test").queries == ["a", "b"]
    assert load_sentences(sentences) == (["a red car", "box"], 0)
    assert read_dev_data(dd, "test").queries == ["a", "b"]
    # a hub dataset: the datasets package's refusal, named by the flag
    def load_dataset(name, split):
        raise ValueError(f'Unknown split "{split}". Should be one of [\'train\', \'test\'].')

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(datasets, "load_dataset", load_dataset)
        with pytest.raises(DataError, match=r"^--dev-split validation: someone/pairs has no split 'validation' "
                                            r"\(Unknown split \"validation\". Should be one of \['train', "
                                            r"'test'\]\.\)$"):
            read_dev_data("someone/pairs", "validation")


@pytest.mark.parametrize("classes, refused", [
    (["entailment", "neutral", "contradiction"], r"label is a ClassLabel of 3 classes \(0 = entailment, 1 = neutral, "
                                                 r"2 = contradiction\): categories, whose numbers are no similarity"),
    (["entailment", "not_entailment"], r"label is a ClassLabel \(0 = entailment, 1 = not_entailment\) whose class 1 "
                                       r"names the pairs that are not similar"),
    (["duplicate", "non_duplicate"], r"label is a ClassLabel \(0 = duplicate, 1 = non_duplicate\) whose class 1"),
    (["yes", "no"], r"label is a ClassLabel \(0 = yes, 1 = no\) whose class 1"),
    (["entailment", "contradiction"], r"label is a ClassLabel \(0 = entailment, 1 = contradiction\) whose class 1"),
    (["entails", "Neutral"], r"label is a ClassLabel \(0 = entails, 1 = Neutral\) whose class 1"),
    (["not_equivalent", "equivalent"], None),
    (["abnormal", "normal"], None),  # words that start as a negation does are none
    (["plain", "notable"], None),
    (["0", "1", "2"], None),
    (None, None),  # an integer label (Value("int64")), not a ClassLabel
])
def test_a_hf_class_label_is_read_as_a_score_only_where_its_numbers_are_one(tmp_path, classes, refused):
    """A format-A label column that is a ClassLabel holds each class's number: NLI's classes were trained as graded
    scores with contradiction the most similar, and RTE's not_entailment (a two-class NLI's contradiction or neutral)
    as the similar pair of a 0/1 label, in silence. Classes named by their numbers, two whose 1 is the similar pair
    (MRPC, QQP), and integer labels are read as before."""
    datasets = pytest.importorskip("datasets")
    folder = str(tmp_path / "ds")
    label_feature = datasets.Value("int64") if classes is None else datasets.ClassLabel(names=classes)
    features = datasets.Features({"text1": datasets.Value("string"), "text2": datasets.Value("string"),
                                  "label": label_feature})
    labels = [index % len(classes or [0, 1]) for index in range(4)]
    datasets.Dataset.from_dict({"text1": list("abcd"), "text2": list("efgh"), "label": labels},
                               features=features).save_to_disk(folder)
    if refused:
        with pytest.raises(DataError, match=rf"ds \[train\]: {refused}"):
            load_examples(folder)
    else:
        examples, fmt = load_examples(folder)
        assert fmt == "A" and [example.label for example in examples] == labels


def test_a_two_class_label_flipped_as_its_refusal_says_is_read_with_the_similar_pairs_as_1(tmp_path):
    """The refusal of a ClassLabel whose 1 is the pair that is not similar gives the code that flips it; dataset.map
    alone, as it said before, kept the column a ClassLabel of the same classes, refused again. The column is cast to
    a float first, and the flipped dataset is read with RTE's entailed pairs as 1."""
    datasets = pytest.importorskip("datasets")
    features = datasets.Features({"sentence1": datasets.Value("string"), "sentence2": datasets.Value("string"),
                                  "score": datasets.ClassLabel(names=["entailment", "not_entailment"])})
    dataset = datasets.Dataset.from_dict({"sentence1": list("abcd"), "sentence2": list("efgh"),
                                          "score": [0, 1, 1, 0]}, features=features)
    dataset.save_to_disk(str(tmp_path / "rte"))
    with pytest.raises(DataError, match=r"label \('score'\) is a ClassLabel") as refused:
        load_examples(str(tmp_path / "rte"))
    flip = re.search(r"flip it first \((.+)\)$", str(refused.value)).group(1)
    flipped = eval(flip, {"dataset": dataset, "datasets": datasets})  # the code the message gives, as given
    flipped.save_to_disk(str(tmp_path / "flipped"))
    examples, _ = load_examples(str(tmp_path / "flipped"))
    assert [example.label for example in examples] == [1.0, 0.0, 0.0, 1.0]


def test_the_model_card_names_the_splits_read_from_a_saved_dataset_dict(tmp_path):
    """A save_to_disk folder of a DatasetDict given as --train-data and --dev-data: the model card named the folder
    alone (`dd`), not which of its splits trained and scored the model; it names them as the run chose them
    (--train-split, --dev-split). A data file, which has no splits, a save_to_disk folder of one Dataset, which has
    none either and is read whole (the card said "(split `train`)"), and a built-in dataset are named alone."""
    datasets = pytest.importorskip("datasets")
    import torch
    from train_helpers import make_encoder, run_config

    from angle_train.tiny import demo_sts_examples
    from angle_train.trainer import train

    def columns(examples):
        return {"text1": [ex.texts[0] for ex in examples], "text2": [ex.texts[1] for ex in examples],
                "label": [ex.label for ex in examples]}

    folder = str(tmp_path / "dd")
    splits = {"train": columns(demo_sts_examples(16)), "dev": columns(demo_sts_examples(8, seed=2))}
    datasets.DatasetDict({name: datasets.Dataset.from_dict(rows) for name, rows in splits.items()}).save_to_disk(folder)
    train(run_config(tmp_path / "run", train_data=folder, dev_data=folder, dev_split="dev", batch_size=8, max_steps=1,
                     max_length=12, save_final=True, ibn_w=0.0, cosine_w=1.0),
          model=make_encoder("bert", dtype=torch.float32))
    card = (tmp_path / "run" / "final" / "README.md").read_text()
    assert f"- data: `{folder}` (split `train`), 16 examples in format A" in card
    assert f"; dev: `{folder}` (split `dev`), 8 scored pairs" in card
    one = str(tmp_path / "one")
    datasets.Dataset.from_dict(splits["train"]).save_to_disk(one)
    train(run_config(tmp_path / "read-whole", train_data=one, dev_data="builtin:demo-sts", batch_size=8, max_steps=1,
                     max_length=12, save_final=True, ibn_w=0.0, cosine_w=1.0),
          model=make_encoder("bert", dtype=torch.float32))
    card = (tmp_path / "read-whole" / "final" / "README.md").read_text()
    assert f"- data: `{one}`, 16 examples" in card and "; dev: `builtin:demo-sts`, " in card and "(split" not in card


def test_a_tsv_file_written_with_csv_quoting_is_noted_once_and_read_literally(tmp_path, capsys):
    """pandas' to_csv(sep="\\t") quotes a text holding a quote, doubling it: read literally (the documented choice for
    .tsv files) the quotes train with the text, and nothing said so. A note names the file and the first such line
    once, and how to read the file CSV-quoted; what is read does not change. Quotes that are no CSV quoting (a field
    that does not open and close with one, or holds no doubled one) are not noted."""
    from angle_train.arccse import load_sentences

    quoted = write_data_file(tmp_path, "quoted.tsv", 'text1\ttext2\tlabel\nplain\tb\t0\n"He said ""hi"""\ta\t1\n'
                                                     '"x ""y"""\tb\t2\n')
    examples, _ = load_examples(quoted)
    assert [ex.texts[0] for ex in examples] == ["plain", '"He said ""hi"""', '"x ""y"""']
    notes = capsys.readouterr().err.splitlines()
    assert len(notes) == 1 and notes[0].startswith(f"angle_train: note: {quoted}, line 3: a field in double quotes "
                                                   "holding doubled quotes")
    assert "a .tsv file is read literally, so the quotes are part of the text that trains" in notes[0]
    assert f"pandas.read_csv({quoted!r}, sep=\"\\t\", keep_default_na=False).to_json(OUT" in notes[0]
    sentences = write_data_file(tmp_path, "s.tsv", 'text\n"a ""b"""\n')
    assert load_sentences(sentences) == (['"a ""b"""'], 0)
    assert capsys.readouterr().err.startswith(f"angle_train: note: {sentences}, line 2: ")
    literal = write_data_file(tmp_path, "literal.tsv", 'text1\ttext2\tlabel\nsay ""a""\t"b"\t1\nc ""d""\t"e"\t2\n')
    load_examples(literal)
    load_examples(write_data_file(tmp_path, "quoted.csv", 'text1,text2,label\n"He said ""hi""",a,1\nb,c,0\n'))
    assert capsys.readouterr().err == ""


def test_a_missing_local_path_is_refused_at_once_from_python(tmp_path, monkeypatch):
    """load_examples and load_sentences given a local path that does not exist (a .jsonl name, a path of folders)
    looked it up on the Hugging Face Hub, retrying for about 20 s before a ConnectionError; they refuse it at once
    with a FileNotFoundError naming it, as angle-train refuses such a --train-data (one rule: names_local_path). A
    hub name (OWNER/NAME) is still looked up."""
    datasets = pytest.importorskip("datasets")
    from angle_train.arccse import load_sentences

    looked_up = []

    def load_dataset(name, **kwargs):  # the Hub, out of reach after its retries
        looked_up.append(name)
        raise ConnectionError(f"Couldn't reach '{name}' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for name in ("train.jsonl", "data/train.jsonl", "./pairs", str(tmp_path / "missing" / "pairs.csv")):
        with pytest.raises(FileNotFoundError, match=rf"^{re.escape(name)}: no such file or folder \(a local path, not "
                                                    r"a Hugging Face hub name: nothing was looked up on the Hub\)$"):
            load_examples(name)
        with pytest.raises(ValueError, match=re.escape(f"{name}: no such file or folder")):
            load_sentences(name)
    assert looked_up == []
    with pytest.raises(ConnectionError):
        load_examples("owner/pairs")
    assert looked_up == ["owner/pairs"]


def test_a_missing_path_says_why_it_was_read_as_one(tmp_path, monkeypatch):
    """`~` reaches Python unexpanded (a shell expands it at a word's start only: not in --train-data=~/x or a config
    file), and OWNER/NAME is read as a path where OWNER is a folder here: both were refused as "no such file or
    folder" alone, although the file exists under the home folder and the name is a hub id."""
    from angle_train.data import MissingLocalPath, refuse_missing_local_path

    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    (tmp_path / "home").mkdir()
    (tmp_path / "home" / "pairs.jsonl").write_text("")
    (tmp_path / "BAAI").mkdir()
    monkeypatch.chdir(tmp_path)
    home_file = str(tmp_path / "home" / "pairs.jsonl")
    with pytest.raises(MissingLocalPath, match=re.escape(f"--train-data ~/pairs.jsonl: no such file or folder (~ is "
                                                         f"not expanded here; give {home_file})")):
        refuse_missing_local_path("~/pairs.jsonl", "--train-data")
    with pytest.raises(MissingLocalPath, match=re.escape("nothing was looked up on the Hub; BAAI is a folder here: "
                                                         "run from another folder to load the hub's BAAI/bge-small)")):
        refuse_missing_local_path("BAAI/bge-small", "--model")
    for name in ("BAAI/pairs.jsonl", "./BAAI/x", "BAAI/final"):  # paths whatever folders are here: no hub advice
        with pytest.raises(MissingLocalPath, match=r"nothing was looked up on the Hub\)$"):
            refuse_missing_local_path(name)
