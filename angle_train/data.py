"""Data: read pair files into examples, tokenise them once, and cut them into batches and forward passes (padded,
or packed into rows with several texts each: PassPlan, PackedTexts).

Formats (the column names a file must have; `label` may also be called `score`, `text1`/`text2` may also
be `sentence1`/`sentence2`, and `query` may be `anchor`, as sentence-transformers' datasets name them (ALIASES);
other names are mapped with `columns`, angle-train's --columns, e.g.
{"text1": "sent_a", "text2": "sent_b", "label": "similarity"}):
    A  text1, text2, label      graded or 0/1 similarity; rows of a batch are [t1, t2, t1, t2, ...] (zigzag)
    B  query, positive          rows [q, p, q, p, ...]; the other pairs of the batch are the negatives
    C  query, positive, negative  rows [q, p, n, q, p, n, ...] (stride 3)
Sources (by the file's suffix, in any case): a .jsonl file (one JSON object per line), a .csv / .tsv file with a
header row, the STS Benchmark layout (tab-separated, no header, score in field 4 and the texts in fields 5 and 6:
detected automatically, or forced with layout="stsb"), or a Hugging Face dataset (hub name or a folder made by
`save_to_disk`, read with the `datasets` package).

Every problem in a file raises `DataError` (a ValueError) naming the file and the line: missing columns, an empty
file, a null or empty label, a label that is not a finite number or is beyond +-LABEL_LIMIT, a null or empty text
(or one of invisible characters alone: shows_nothing), a malformed JSON line, a CSV row with more or fewer fields
than its header, a CSV syntax error (a quote never closed: the line it opened on too), a JSON line naming one of
its keys twice (json keeps the last value in silence), bytes that are not UTF-8
(with their byte offset; a Parquet, Arrow or compressed file named as such: BINARY_FILES). Local files are read as
UTF-8; a byte-order mark at the start (as spreadsheet programs write "CSV UTF-8") is dropped. `open_text`,
`check_label` and `check_text` hold these rules for every reader here, in angle_train.arccse and in
angle_train.evaluate.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import hashlib
import itertools
import json
import math
import os
import re
import random
import sys
import unicodedata
from array import array
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy
import torch

from .hub import HubLookupError, hub_lookup, name_given_as

ANGLE_PROMPT = 'Summarize sentence "{text}" in one word:"'
# Prompts by name: 'angle' is the paper's; Prompts.A/B/C are angle-emb 0.6's predefined ones (angle_emb.Prompts).
NAMED_PROMPTS = {
    "angle": ANGLE_PROMPT,
    "Prompts.A": ANGLE_PROMPT,
    "Prompts.B": 'You can only output one word. Summarize "{text}":"',
    "Prompts.C": "Represent this sentence for searching relevant passages: {text}",
}
FORMATS = {"A": ("text1", "text2", "label"), "B": ("query", "positive"), "C": ("query", "positive", "negative")}
ROWS_PER_EXAMPLE = {"A": 2, "B": 2, "C": 3}
# The role of each text of an example, which picks its prompt (Prompts): format A's texts are symmetric.
ROLES = {"A": ("text", "text"), "B": ("query", "document"), "C": ("query", "document", "document")}
# Other names of the format's columns: STS-B's (sentence1, sentence2, score) and sentence-transformers' (its Hub
# datasets' pairs and triplets, all-nli's among them, are anchor, positive[, negative])
ALIASES = {"sentence1": "text1", "sentence2": "text2", "score": "label", "anchor": "query"}
STSB_NAMES = {"text1": "text1", "text2": "text2", "label": "label"}  # read_stsb's rows, named by it
# The names a --columns mapping gives a file's columns (NAME=COLUMN); columns_hint says how to map them.
COLUMN_NAMES = ("text1", "text2", "label", "query", "positive", "negative")


# The folders angle-train writes models into (OUTPUT_DIR/final, best and checkpoints/step-N): OWNER/final is read as
# a run's folder, not a hub id, so a typo in it fails at once instead of after the Hub's retries.
RUN_FOLDER_NAMES = re.compile(r"final|best|step-\d+")
DATA_FILE_SUFFIXES = (".jsonl", ".json", ".csv", ".tsv", ".txt", ".parquet", ".arrow", ".gz")

def names_local_path(name: str) -> bool:
    """Whether a model or data name can only be a local path, never a Hugging Face hub id (NAME or OWNER/NAME):
    it exists, starts like a path (/, ./, ../, ~), ends like a data file (.jsonl, .csv...), has more than two
    parts, its first part is a folder here (data/train.jsonl), or it ends in a folder angle-train writes
    (RUN_FOLDER_NAMES: runs/final, out/best, run/step-40)."""
    if name.startswith("builtin:"):
        return False
    if os.path.exists(name) or os.path.isabs(name) or name.startswith(("./", "../", "~", ".\\", "..\\")):
        return True
    if has_suffix(name, DATA_FILE_SUFFIXES):
        return True
    parts = name.replace("\\", "/").split("/")
    if len(parts) == 2 and RUN_FOLDER_NAMES.fullmatch(parts[1]):
        return True
    return len(parts) > 2 or (len(parts) == 2 and os.path.isdir(parts[0]))


class MissingLocalPath(FileNotFoundError, ValueError):
    """A name that can only be a local path (names_local_path) and does not exist. A FileNotFoundError, and a
    ValueError as train()'s other refusals of its settings are."""


def refuse_missing_local_path(name: str, given_as: str | None = None) -> None:
    """MissingLocalPath for a name that can only be a local path (names_local_path) and does not exist, before
    anything is looked up: passed on to Hugging Face, a typo in a path was looked up on the Hub (retrying the network
    for about 20 s, then failing with a message about repo ids). `given_as`: the flag or argument that gave it."""
    if not name or not names_local_path(name) or os.path.exists(name):
        return
    why = "a local path, not a Hugging Face hub name: nothing was looked up on the Hub"
    home = os.path.expanduser(name)
    owner = name.replace("\\", "/").split("/")
    if name.startswith("~") and os.path.exists(home):  # only a shell expands ~, at a word's start (not --flag=~/x)
        why = f"~ is not expanded here; give {home}"
    elif (len(owner) == 2 and owner[0] not in (".", "..") and os.path.isdir(owner[0])
          and not has_suffix(name, DATA_FILE_SUFFIXES) and not RUN_FOLDER_NAMES.fullmatch(owner[1])):
        # a hub name OWNER/NAME whose OWNER is a folder here reads as a path: say why, and how to reach the Hub
        why += f"; {owner[0]} is a folder here: run from another folder to load the hub's {name}"
    raise MissingLocalPath(f"{f'{given_as} ' if given_as else ''}{name}: no such file or folder ({why})")


@contextlib.contextmanager
def errors_naming(source: str, given_as: str):
    """Inside: a DataError about `source` as a whole (its message begins "SOURCE: ": a folder that is no dataset, an
    empty file, an unknown file type, no examples) names where the user gave it, `given_as` (--train-data,
    --dev-data, angle-eval's PATH), as the refusals of the flags do. Those of a line or row name the file and line.
    So does a hub dataset that cannot be loaded (hub.HubLookupError: the Hub out of reach, no such dataset)."""
    try:
        yield
    except DataError as exc:
        if str(exc).startswith(f"{source}: "):
            exc.args = (f"{given_as} {exc}",)  # the same error re-raised: its traceback still ends at the check
        raise
    except HubLookupError as exc:
        if exc.name == source:
            name_given_as(exc, given_as)
        raise


def columns_hint(names=FORMATS["A"]) -> str:
    """How to map a file's columns onto `names` (those a format reads, or lacks): --columns NAME=COLUMN ..."""
    return (f"map yours with --columns, e.g. --columns {' '.join(f'{name}=COLUMN' for name in names)} (from Python: "
            f"columns={{{names[0]!r}: COLUMN, ...}})")


# The largest |label| a file may hold. Labels are graded similarity scores (STS 0-5, SICK 1-5) or 0/1; the losses
# only compare them (the ranking terms) or test them for 0 / 1 (the in-batch-negative term), on float32 batches
# (TokenizedPairs.batch). Past 3.4e38 a label becomes inf there and the loss refuses the whole batch without a line
# number; long before, float32 stops telling nearby labels apart (its spacing is 0.0625 at 1e6, 1 at 2**24). 1e6
# leaves room for any rating scale (percentages, 0-1000) with labels a tenth apart still distinct.
LABEL_LIMIT = 1e6


class DataError(ValueError):
    """A data file or dataset that cannot be used as given; the message names the file and line."""


@dataclass(frozen=True)
class Example:
    texts: tuple[str, ...]  # (text1, text2), (query, positive) or (query, positive, negative)
    label: float = 1.0  # format A's label; formats B and C have none and use 1.0


def apply_prompt(text: str, prompt: str | None) -> str:
    """'{text}' in the prompt is replaced by the text; a prompt without it is a prefix."""
    if not prompt:
        return text
    return prompt.replace("{text}", text) if "{text}" in prompt else prompt + text


def prompted_texts(texts: list[str], prompt: str | None, tokenizer, max_length: int) -> tuple[list[str], list[int]]:
    """(the texts in the prompt, the indices of those cut): each text in the prompt (apply_prompt), first cut so that
    the whole fits max_length tokens with the prompt's words after its '{text}' intact: the tokenizer's truncation,
    which cuts the end, then cuts none of them. A prompt that closes after the text (the AnglE prompt's ' in one
    word:"') lost that close on every text reaching --max-length, and last-token pooling then read a word of the text
    instead of the prompt's last token. (angle-emb 0.6.1 cuts the whole as this did; its 0.4 versions kept the
    prompt.) A text is cut at a token boundary and decoded. A prompt with nothing after '{text}' leaves the texts
    whole, truncation cutting their ends only; so does one with '{text}' twice (its text's copies are not cut). The
    texts are checked TOKENIZE_CHUNK at a time: the tokenizer's lists for all of them at once were the peak of
    tokenising a large dataset (tokenize_in_chunks)."""
    head, found, tail = (prompt or "").partition("{text}")
    if not (found and tail) or "{text}" in tail:
        return [apply_prompt(text, prompt) for text in texts], []
    fixed = tokenizer.num_special_tokens_to_add(pair=False) + len(
        tokenizer(head + tail, add_special_tokens=False)["input_ids"])
    if max_length <= fixed:
        raise ValueError(f"--max-length {max_length} leaves no room for a text in the prompt {prompt!r}, which takes "
                         f"{fixed} tokens with the special ones: use a longer --max-length")
    out, cut = [apply_prompt(text, prompt) for text in texts], []

    def over(indices: list[int]) -> list[int]:  # those whose filled prompt takes more than max_length tokens
        ids = encode_texts([out[i] for i in indices], tokenizer, add_special_tokens=True)["input_ids"] if indices \
            else []
        return [i for i, each in zip(indices, ids) if len(each) > max_length]

    for start in range(0, len(texts), TOKENIZE_CHUNK):
        long = over(list(range(start, min(start + TOKENIZE_CHUNK, len(texts)))))
        cut += long
        text_ids = dict(zip(long, encode_texts([texts[i] for i in long], tokenizer, add_special_tokens=False
                                               )["input_ids"] if long else []))
        room = max_length - fixed
        for _ in range(4):  # a cut text's tokens may merge with the prompt's at its edges: cut a token more if over
            for i in long:
                out[i] = apply_prompt(tokenizer.decode(text_ids[i][:room]), prompt)
            long, room = over(long), room - 1
            if not long:
                break
    return out, cut


def prompt_prefix(prompt: str) -> str | None:
    """The prompt as a plain prefix (what sentence-transformers' `prompts` can hold), or None when the text does not
    come last (the AnglE prompt closes a quote after it)."""
    if "{text}" not in prompt:
        return prompt
    head, _, tail = prompt.partition("{text}")
    return head if not tail else None


@dataclass(frozen=True)
class Prompts:
    """The prompt template of each role of a text (angle-emb 0.6's text_prompt / query_prompt / doc_prompt):

        text      every text without a prompt of its own: format A's two texts, STS evaluation, encode() by default
        query     the query of formats B and C (default: the text prompt)
        document  the positive and negative of formats B and C (default: the text prompt)

    A name of NAMED_PROMPTS stands for its template. '' is no prompt: for the query or the document, none even where
    there is a text prompt (None takes the text prompt)."""

    text: str | None = None
    query: str | None = None
    document: str | None = None

    def __post_init__(self):
        for role in ("text", "query", "document"):
            value = getattr(self, role)
            if value is not None and not isinstance(value, str):
                raise TypeError(f"the {role} prompt must be a string or None; got {type(value).__name__}")
            template = NAMED_PROMPTS.get(value, value)
            # '' stays '' for a query or document prompt where there is a text prompt: none, not the text prompt
            explicitly_none = role != "text" and template == "" and self.text is not None
            object.__setattr__(self, role, template if template or explicitly_none else None)

    def for_role(self, role: str) -> str | None:
        """The template applied to a text of this role (None: the text as it is)."""
        if role not in ("text", "query", "document"):
            raise ValueError(f"prompt name must be 'text', 'query' or 'document'; got {role!r}")
        own = getattr(self, role)
        return (own if own is not None else self.text) or None

    def as_dict(self) -> dict[str, str]:
        """{role: template} of every role that has a prompt, and '' for a query or document without one where the
        text prompt would otherwise apply (the form sentence-transformers' `prompts` take: the role has no prompt,
        not the default one)."""
        return {role: self.for_role(role) or "" for role in ("text", "query", "document")
                if self.for_role(role) or getattr(self, role) == ""}

    def described(self) -> str:
        """The templates in words, for notes and model cards: "`T` for every text" where every role takes one, else
        each role's ("text `T`, query `Q`, document none")."""
        templates = {role: self.for_role(role) for role in ("text", "query", "document")}
        if len(set(templates.values())) == 1:
            return f"`{templates['text']}` for every text" if templates["text"] else "none"
        return ", ".join(f"{role} `{template}`" if template else f"{role} none" for role, template in templates.items())

    @classmethod
    def coerce(cls, prompt: str | Prompts | None) -> Prompts:
        """A Prompts from a Prompts, or from one template (or name) for every text, or None (no prompt)."""
        return prompt if isinstance(prompt, Prompts) else cls(text=prompt)


# ----------------------------------------------------------------------------------------------- reading


def detect_format(names, where: str, columns=None, *, header: bool = False) -> str:
    """The format (A, B or C) whose names these are (column_names' keys); `columns`: the file's, for the message
    (`header`: a CSV/TSV file's header row: columns_in_words)."""
    for fmt in ("C", "A", "B"):
        if set(FORMATS[fmt]) <= set(names):
            return fmt
    raise DataError(
        f"{where}: cannot tell the format from the columns "
        f"{columns_in_words(columns if columns is not None else names, header=header)}; "
        f"expected text1,text2,label (A), query,positive (B) or query,positive,negative (C): {columns_hint()}"
    )


def columns_in_words(columns, *, header: bool = False, inside: bool = False) -> str:
    """A file's columns for a message, in the file's order (as the user sees them), and why they may not be the
    names they look like: a CSV/TSV header (`header`) with a field that is a number looks like data (a file written
    without its header row, whose first example was read as the names); else names with spaces around them (a
    header `text1, text2, label`), which are read as written, not stripped in silence. The note follows the list in
    parentheses, or after a semicolon where the list is `inside` parentheses already."""
    shown = [column for column in columns if column is not None]  # None: a CSV row's fields past its header's
    spaced = [column for column in shown if isinstance(column, str) and column != column.strip()]
    one = len(spaced) == 1
    if header and any(math.isfinite(number) for number in map(_number_or_none, shown) if number is not None):
        names = ", ".join(f"{','.join(FORMATS[fmt])} for {'format ' * (fmt == 'A')}{fmt}" for fmt in FORMATS)
        note = f"the first line looks like data, not a header: the file needs a header row naming its columns ({names})"
    elif spaced:
        whose = "the header's" if header else "the"
        note = (f"{whose} name{'' if one else 's'} {', '.join(map(repr, spaced))} {'has' if one else 'have'} spaces "
                f"around {'it' if one else 'them'}: remove them, or map {'it' if one else 'them'} with --columns")
    else:
        return f"{shown}"
    return f"{shown}; {note}" if inside else f"{shown} ({note})"


def check_columns(columns: dict | None) -> dict:
    """A --columns mapping {name: the file's column} with known names (COLUMN_NAMES), each column read under one name
    (two names of one column made every pair of one text twice, (x, x)), as a dict ({} for none)."""
    columns = dict(columns or {})
    names_of = {}
    for name, column in columns.items():
        if name not in COLUMN_NAMES:
            raise DataError(f"--columns {name}={column}: unknown name {name!r} (the names are "
                            f"{', '.join(COLUMN_NAMES)})")
        if column in names_of:
            raise DataError(f"--columns {names_of[column]}={column} {name}={column}: the column {column!r} is mapped "
                            f"to both {names_of[column]} and {name}; map each name to a column of its own")
        names_of[column] = name
    return columns


def parse_columns(items) -> dict:
    """The --columns flag's NAME=COLUMN items (several in one, comma-separated, too) as {name: the file's column},
    checked (check_columns); angle-train and angle-eval read it the same way."""
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"--columns: expected NAME=COLUMN items; got {items!r}")
    mapping = {}
    for item in (part for value in items for part in str(value).split(",") if part):
        name, equals, column = item.partition("=")
        if not equals or not name or not column:
            raise ValueError(f"--columns {item}: expected NAME=COLUMN (e.g. text1=sent_a)")
        mapping[name.strip()] = column.strip()
    return check_columns(mapping)


def column_names(columns: dict, present, where: str, *, header: bool = False) -> dict:
    """{the format's name: the file's column} of a file's (or a row's, or a dataset's) columns `present`: those a
    --columns mapping ({name: column}, check_columns) names, each checked present, then every other column that is a
    name of COLUMN_NAMES or an alias of one (ALIASES: sentence1 -> text1). A column a mapping displaced (the file's
    own "positive" under --columns positive=p2) is not read. Two columns giving one name unmapped (text1 and
    sentence1, label and score) are a DataError: one of them would have been read in silence. `header`: `present` is
    a CSV/TSV file's header row (columns_in_words)."""
    for name, column in columns.items():
        if column not in present:
            raise DataError(f"--columns {name}={column}: {where} has no column {column!r} (it has "
                            f"{columns_in_words(present, header=header, inside=True)})")
    names = dict(columns)
    mapped = set(columns.values())
    for column in dict.fromkeys(present):  # a name a CSV header repeats once (check_read_columns_once)
        name = ALIASES.get(column, column)
        if column is None or column in mapped or name not in COLUMN_NAMES or name in columns:
            continue
        if name in names:
            raise DataError(f"{where}: the columns {names[name]!r} and {column!r} both give {name}: say which with "
                            f"--columns {name}=COLUMN, or leave one out of the data")
        names[name] = column
    return names


def check_format_columns(names: dict, fmt: str, where: str, detected_at: str | None = None, *, present=None,
                         header: bool = False) -> None:
    """The names the format reads all present and, where the format was detected (`detected_at`: the row or header
    it was detected at; None: given, by --data-format, which then reads what it reads), no other name of
    COLUMN_NAMES: a format-B file's "label" column, or a later row's "negative" in a file whose first row made it
    format B, would be left unread in silence. `present`: the file's columns, for the message (None: the columns
    `names` reads); `header`: they are a CSV/TSV file's header row (columns_in_words)."""
    missing = [c for c in FORMATS[fmt] if c not in names]
    if missing:
        has = columns_in_words(names.values() if present is None else present, header=header, inside=True)
        raise DataError(f"{where}: missing column(s) {missing} for format {fmt} (has {has}): {columns_hint(missing)}")
    unread = [name for name in names if name not in FORMATS[fmt]]
    if unread and detected_at is not None:
        shown = ", ".join(repr(names[name]) if names[name] == name else f"{names[name]!r} ({name})" for name in unread)
        source = f", detected at {detected_at}" if detected_at != where else ", detected from the columns"
        raise DataError(f"{where}: format {fmt} ({', '.join(FORMATS[fmt])}{source}) does not read the column(s) "
                        f"{shown}: say which format the data is with --data-format (--data-format {fmt} reads "
                        f"{', '.join(FORMATS[fmt])} and leaves the rest unread), or leave them out of the data")


def check_read_columns_once(fieldnames, read: list, where: str) -> None:
    """The columns a reader reads (`read`) each named once in a CSV/TSV header: a dict row keeps the last of two
    columns of one name, so the first would be dropped in silence (a repeated name nobody reads is harmless)."""
    repeated = [column for column in dict.fromkeys(fieldnames) if column in read and fieldnames.count(column) > 1]
    if repeated:
        raise DataError(f"{where}: the column name(s) {repeated} appear more than once in the header, so only the "
                        "last of each would be read: rename or remove the others")


# Letters that are drawn as nothing (Hangul fillers, the blank Braille pattern): typed where a text must not be empty.
BLANK_LETTERS = frozenset("\u115f\u1160\u3164\uffa0\u2800")


def shows_nothing(text: str) -> bool:
    """Whether `text` has no visible character: every one whitespace, a format character (Unicode category Cf: the
    zero-width space U+200B, the joiners, the word joiner, a byte-order mark, a soft hyphen, the direction marks), a
    control character (Cc) or one of BLANK_LETTERS. str.strip() removes whitespace alone, so a text of zero-width
    spaces was taken as a sentence where a blank one is refused."""
    return all(ch.isspace() or ch in BLANK_LETTERS or unicodedata.category(ch) in ("Cf", "Cc") for ch in text)


def check_text(value, where: str, column: str) -> str:
    """A text field's value, or a DataError naming the place when it is not a string with a visible character."""
    if value is None:
        raise DataError(f"{where}: column {column!r} is null (expected a text)")
    if not isinstance(value, str):
        raise DataError(f"{where}: column {column!r} must be a string; got {type(value).__name__} {value!r}")
    if shows_nothing(value):
        invisible = (f": {ascii(value)} holds only invisible characters (zero-width, format, control or filler "
                     "characters)") if value.strip() else ""
        raise DataError(f"{where}: column {column!r} is an empty text{invisible}")
    return value


def _shown(value) -> str:
    """repr(value), with a long integer cut short (JSON allows integers of thousands of digits)."""
    if isinstance(value, int) and not isinstance(value, bool) and abs(value) >= 10 ** 20:
        digits = str(abs(value))
        return f"{'-' if value < 0 else ''}{digits[:6]}... (an integer of {len(digits)} digits)"
    return repr(value)


def check_label(value, where: str, column: str = "label") -> float:
    """A format-A label as a float, or a DataError naming the place: null, empty, not a finite number, or beyond
    +-LABEL_LIMIT (what the losses can use: see LABEL_LIMIT). `column`: the file's name for the label."""
    what = "label" if column == "label" else f"label ({column!r})"
    if value is None:
        raise DataError(f"{where}: {what} is null (expected a number: the pair's similarity score)")
    if isinstance(value, str) and shows_nothing(value):
        raise DataError(f"{where}: {what} is empty (expected a number: the pair's similarity score)")
    if isinstance(value, bool):  # a column of flags where the score belongs: not trained as 1.0 / 0.0 in silence
        raise DataError(f"{where}: bad {what} {str(value).lower()} (a boolean, not a number: where it is a 0/1 "
                        "similarity label, write it as 1 or 0)")
    try:
        # float() reads Python's digit separators, "1_0" as 10: in a data file that is a typo (of 1.0?), not a number
        label = math.nan if isinstance(value, str) and "_" in value else float(value)
    except (TypeError, ValueError, OverflowError):
        label = math.nan
    if not math.isfinite(label):
        raise DataError(f"{where}: bad {what} {_shown(value)} (must be a finite number)")
    if abs(label) > LABEL_LIMIT:
        raise DataError(
            f"{where}: bad {what} {_shown(value)}: a label must be at most {LABEL_LIMIT:g} in absolute value "
            "(labels are similarity scores, e.g. STS 0-5 or 0/1, compared as float32 by the loss)")
    return label


@contextlib.contextmanager
def open_text(path: str, newline: str | None = None):
    """`path` opened for reading as UTF-8 text, a byte-order mark at its start dropped (spreadsheet programs write
    one). Bytes that are not UTF-8, met anywhere in the with block, raise a DataError naming the file, the line, the
    byte offset and the bytes (the text file reads ahead, so the place is found again in the raw bytes)."""
    with open(path, encoding="utf-8-sig", newline=newline) as f:
        try:
            yield f
        except UnicodeDecodeError as exc:
            raise DataError(_where_not_utf8(path) or f"{path}: not UTF-8 text ({exc})") from None


# Files that are not text, told by their first bytes where a text file was expected: (magic, or a tuple of the
# magics of one kind, what it is, what to do with it; {path} is the file). Looked for only in a file that is not
# UTF-8: their bytes were reported as "not UTF-8 (it may be Latin-1)".
BINARY_FILES = (
    (b"PAR1", "a Parquet file", "write it as JSON Lines, pandas.read_parquet({path!r}).to_json(OUT, "
     "orient=\"records\", lines=True, force_ascii=False), or for angle-train save it as a dataset folder, "
     "datasets.Dataset.from_parquet({path!r}).save_to_disk(FOLDER)"),
    ((b"ARROW1", b"\xff\xff\xff\xff"), "an Arrow file",  # the file format's magic; the stream format's
     "give the dataset folder save_to_disk wrote it in, or write it as JSON Lines"),
    (b"\x1f\x8b", "a gzip-compressed file", "decompress it first: gunzip -k {path}"),
    (tuple(b"BZh%d" % level for level in range(1, 10)), "a bzip2-compressed file",
     "decompress it first: bunzip2 -k {path}"),
    (b"\xfd7zXZ\x00", "an xz-compressed file", "decompress it first: unxz -k {path}"),
    (b"\x28\xb5\x2f\xfd", "a zstd-compressed file", "decompress it first: unzstd {path}"),
    (b"PK\x03\x04", "a zip archive", "unpack it first: unzip {path}"),
)


def _where_not_utf8(path: str) -> str | None:
    """The first bytes of the file that are not UTF-8, by line and byte offset (a line at a time: a UTF-8 character
    never contains a newline byte), or None when they all are. A file that is not text at all (BINARY_FILES: Parquet,
    Arrow, compressed) is named as what it is."""
    with open(path, "rb") as f:
        head = f.read(8)
        if head[:2] in (b"\xff\xfe", b"\xfe\xff"):
            return (f"{path}, line 1: the file is UTF-16 (it starts with the byte-order mark {head[:2]!r}), not "
                    "UTF-8: save it as UTF-8 (spreadsheet programs: \"CSV UTF-8\")")
        for magic, what, advice in BINARY_FILES:
            if head.startswith(magic):
                return (f"{path}: {what}, not a text file (data files are read as UTF-8 text: .jsonl, .csv, .tsv, "
                        f".txt or the STS-B layout): {advice.format(path=path)}")
        f.seek(0)
        offset = 0
        for number, line in enumerate(f, start=1):
            try:
                line.decode("utf-8")
            except UnicodeDecodeError as exc:
                near = line[max(0, exc.start - 20):exc.end + 20].decode("utf-8", "replace").strip()
                return (f"{path}, line {number}: not UTF-8: the bytes {line[exc.start:exc.end]!r} at byte offset "
                        f"{offset + exc.start} (in {near!r}); save the file as UTF-8 (it may be Latin-1 / "
                        "Windows-1252)")
            offset += len(line)
    return None


def _example_from_row(row: dict, fmt: str, where: str, names: dict) -> Example:
    """The example of a row {the file's column: value}: the format's columns read by `names` ({name: the file's
    column}: column_names, checked against the format by check_format_columns)."""
    texts = [check_text(row[names[name]], where, names[name]) for name in FORMATS[fmt] if name != "label"]
    label = 1.0
    if fmt == "A":
        label = check_label(row[names["label"]], where, names["label"])
    return Example(tuple(texts), label)


def _is_stsb_line(line: str) -> bool:
    fields = line.rstrip("\n").split("\t")
    if len(fields) < 7:
        return False
    try:
        float(fields[4])
    except ValueError:
        return False
    return True


def read_stsb(path: str) -> list[Example]:
    """STS Benchmark TSV: no header, score in field 4, texts in 5 and 6, sometimes extra trailing fields.

    Split by hand: texts contain quote characters, and csv's default quoting would merge lines.
    """
    examples = []
    with open_text(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            fields = line.rstrip("\n").rstrip("\r").split("\t")
            where = f"{path}, line {number}"
            if len(fields) < 7:
                raise DataError(f"{where}: the STS-B layout needs at least 7 tab-separated fields; got {len(fields)}")
            examples.append(_example_from_row({"text1": fields[5], "text2": fields[6], "label": fields[4]}, "A",
                                              where, STSB_NAMES))
    return examples


class _ObjectNamingAKeyTwice(dict):
    """A JSON object's dict (json keeps the last value of a key) where the object names a key twice: `repeated`."""

    repeated: str


def _object_marking_a_repeated_key(pairs: list) -> dict:
    """A JSON object's dict, an _ObjectNamingAKeyTwice where it names a key twice: json keeps the last value of a key
    in silence, so {"query": "a", "positive": "b", "query": "c"} was trained as the pair (c, b). Marked, not raised:
    only a row's own keys are its columns, and an object inside a column no reader reads (a "meta" column) is no
    reason to refuse the file."""
    row = dict(pairs)
    if len(row) == len(pairs):
        return row
    seen = set()
    for key, _ in pairs:
        if key in seen:
            break
        seen.add(key)
    marked = _ObjectNamingAKeyTwice(row)
    marked.repeated = key
    return marked


# One decoder for every line (json.loads given a hook builds a decoder a call: twice the time of reading a line);
# the hook costs about 3% of reading a file.
_JSON_ROW = json.JSONDecoder(object_pairs_hook=_object_marking_a_repeated_key)


def jsonl_rows(path: str):
    """(where, row) for every non-blank line of a JSONL file: a JSON object each (naming each of its own keys once),
    or a DataError naming the line."""
    array_hint = " (a file holding one JSON array of records is not read: write one record a line, JSON Lines)"
    first = True  # the first non-blank line: where a file of one JSON array (pretty-printed or not) starts with "["
    with open_text(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where, starts_array, first = f"{path}, line {number}", first and line.lstrip().startswith("["), False
            try:
                row = _JSON_ROW.decode(line)
            except json.JSONDecodeError as exc:
                raise DataError(f"{where}: not valid JSON ({exc.msg}){array_hint if starts_array else ''}") from None
            except ValueError as exc:  # an integer of more than sys.get_int_max_str_digits() digits
                raise DataError(f"{where}: not usable JSON ({exc})") from None
            if not isinstance(row, dict):
                raise DataError(f"{where}: each line must be a JSON object; got {type(row).__name__}"
                                + (array_hint if starts_array else ""))
            if isinstance(row, _ObjectNamingAKeyTwice):
                raise DataError(f"{where}: the key {row.repeated!r} appears more than once in an object, so only its "
                                "last value would be read: rename or remove the others")
            if "\\u" in line:  # only a \u escape makes a lone surrogate (a file's bytes are decoded strictly)
                _check_no_lone_surrogate(row, where)
            yield where, row


def _check_no_lone_surrogate(value, where: str, what: str = "a value") -> None:
    """A DataError naming the key whose text holds a lone UTF-16 surrogate (a \\ud800-\\udfff escape without its
    pair, as an emoji cut in half leaves): valid JSON, but no text UTF-8 can write or a tokenizer can read, which
    failed later with "'utf-8' codec can't encode character", naming no file or line."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise DataError(f"{where}: {what} holds a lone surrogate escape (\\u{ord(value[exc.start]):04x} at "
                            f"character {exc.start}: half of a character written as a UTF-16 pair, as a cut emoji "
                            "leaves), which is no text: fix or remove it") from None
    elif isinstance(value, dict):
        for name, item in value.items():
            _check_no_lone_surrogate(name, where, "a key")
            _check_no_lone_surrogate(item, where, f"the value of {name!r}")
    elif isinstance(value, list):
        for item in value:
            _check_no_lone_surrogate(item, where, what)


def read_jsonl(path: str, fmt: str | None, columns: dict | None = None) -> tuple[list[Example], str]:
    """Each line's columns named and checked against the format (the first line's, unless `fmt`), once per set of
    keys (rows of one file mostly share theirs)."""
    examples, columns, checked, detected_at = [], check_columns(columns), {}, None
    for where, row in jsonl_rows(path):
        keys = tuple(row)
        names = checked.get(keys)
        if names is None:
            names = column_names(columns, keys, where)
            if fmt is None:
                fmt, detected_at = detect_format(names, where, keys), where
            check_format_columns(names, fmt, where, detected_at, present=keys)  # detected_at None: fmt was given
            checked[keys] = names
        examples.append(_example_from_row(row, fmt, where, names))
    return examples, fmt


def delimited_rows(path: str, delimiter: str, check_header=None):
    """(where, row) for every data row of a .csv / .tsv file with a header row; check_header(fieldnames) first sees
    the header (and raises DataError for one that will not do). TSV files rarely quote their fields but often
    contain quote characters: they are read literally. DataError for an empty file, a row with more or fewer fields
    than the header, a CSV syntax error, bytes that are not UTF-8."""
    quoting = csv.QUOTE_NONE if delimiter == "\t" else csv.QUOTE_MINIMAL
    fetched = 0  # lines handed to the reader: at a syntax error, the line it is on (reader.line_num counts the
    # lines of the records read before it: a bad record was named by the line before it, or the one its record began)
    begun = None  # the first line of the record being read (none yet: None); a quote never closed is found at the
    # file's end, far from the line that opened it (every line since read into one field)

    literal = quoting == csv.QUOTE_NONE
    noted = False  # whether the note on CSV quoting in a file read literally was printed (once a file)

    def counted(lines):
        nonlocal fetched, begun, noted
        for line in lines:
            fetched += 1
            if begun is None and line.strip():
                begun = fetched
            # substring tests first, at C speed: a line without a doubled quote and a field that opens with a quote
            # is not split (0.03-0.08 s of the 4 s that reading a 200,000-line TSV file takes, on a shared machine;
            # splitting each line that holds "" took 0.46 s)
            if (literal and not noted and '""' in line and (line[:1] == '"' or '\t"' in line)
                    and any(map(_is_csv_quoted, line.rstrip("\r\n").split("\t")))):
                noted = True
                print(f"angle_train: note: {path}, line {fetched}: a field in double quotes holding doubled quotes "
                      f"({_cut_short(line)}) looks CSV-quoted (as pandas' to_csv(sep=\"\\t\") writes); a .tsv file is "
                      "read literally, so the quotes are part of the text that trains. To read it CSV-quoted, write it "
                      f"as JSON Lines: pandas.read_csv({path!r}, sep=\"\\t\", keep_default_na=False).to_json(OUT, "
                      "orient=\"records\", lines=True, force_ascii=False)", file=sys.stderr, flush=True)
            yield line

    with open_text(path, newline="") as f, _csv_fields_of_any_size():
        reader = csv.DictReader(counted(f), delimiter=delimiter, quoting=quoting, strict=True)
        try:
            if not reader.fieldnames:
                raise DataError(f"{path}: the file is empty (expected a header row)")
            if check_header is not None:
                check_header(reader.fieldnames)
            width = len(reader.fieldnames)
            begun = None
            for row in reader:
                begun = None
                where = f"{path}, line {reader.line_num}"
                if None in row:
                    raise DataError(f"{where}: more fields than the header's {width}")
                if None in row.values():
                    given = sum(value is not None for value in row.values())
                    raise DataError(f"{where}: fewer fields ({given}) than the header's {width}")
                yield where, row
        except csv.Error as exc:
            spans = (f" (in the record that begins at line {begun}: a quoted field opened there runs on to line "
                     f"{fetched}; close its quote, and write a quote inside a quoted field as two, \"\")"
                     if begun is not None and begun < fetched else "")
            raise DataError(f"{path}, line {fetched}: {exc}{spans}") from None


def read_delimited(path: str, fmt: str | None, delimiter: str, columns: dict | None = None
                   ) -> tuple[list[Example], str]:
    columns, names = check_columns(columns), {}

    def check_header(fieldnames):
        nonlocal fmt, names
        where = f"{path}, line 1 (header)"
        names = column_names(columns, fieldnames, where, header=True)
        detected_at = None if fmt else where
        fmt = fmt or detect_format(names, where, fieldnames, header=True)
        check_format_columns(names, fmt, where, detected_at, present=fieldnames, header=True)
        check_read_columns_once(fieldnames, [names[name] for name in FORMATS[fmt]], where)

    examples = [_example_from_row(row, fmt, where, names)
                for where, row in delimited_rows(path, delimiter, check_header)]
    return examples, fmt


def _is_csv_quoted(field: str) -> bool:
    """Whether a field read literally looks CSV-quoted: in double quotes, holding a doubled one (CSV writes the text
    `he said "hi"` in quotes, each quote of it doubled)."""
    return len(field) > 2 and field[0] == field[-1] == '"' and '""' in field[1:-1]


def _cut_short(line: str, most: int = 80) -> str:
    """A line for a message: its first `most` characters, its line break dropped."""
    line = line.rstrip("\r\n")
    return repr(line if len(line) <= most else line[:most] + "...")


@contextlib.contextmanager
def _csv_fields_of_any_size():
    """csv's limit on a field's size (128 KiB by default, a process-wide setting) lifted while a file is read: a
    text the same reader takes from a JSONL file is taken from a CSV or TSV one too."""
    limit = csv.field_size_limit()
    csv.field_size_limit(2**31 - 1)
    try:
        yield
    finally:
        csv.field_size_limit(limit)


# The files load_examples reads by their suffix (STS-B's layout it tells by the first line).
JSONL_SUFFIXES, DELIMITED_SUFFIXES = (".jsonl", ".json"), (".csv", ".tsv")
READ_FILE_SUFFIXES = JSONL_SUFFIXES + DELIMITED_SUFFIXES


def delimiter_of(path: str) -> str:
    """The field separator of a .csv / .tsv file (its suffix in any case): a tab for .tsv, else a comma."""
    return "\t" if has_suffix(path, ".tsv") else ","


def has_suffix(path: str, suffixes: str | tuple[str, ...]) -> bool:
    """Whether `path` ends in one of `suffixes` (given in lower case), in any case: a file named TRAIN.JSONL or
    PAIRS.CSV (as some Windows tools save them) was refused as an "unknown file type; use .jsonl, .csv ..."."""
    return path.lower().endswith(suffixes)


def data_files_in(folder: str) -> list[str]:
    """The paths of the files in `folder` that load_examples reads by their suffix, sorted: what to name where a
    folder of them is given as one dataset."""
    return [os.path.join(folder, name) for name in sorted(os.listdir(folder)) if has_suffix(name, READ_FILE_SUFFIXES)]


# What save_to_disk writes in a dataset's folder: a DatasetDict's file, a Dataset's.
SAVED_DATASET_FILES = ("dataset_dict.json", "state.json")


def is_saved_dataset(path: str) -> bool:
    """Whether `path` is a folder a Hugging Face dataset was saved in (save_to_disk: SAVED_DATASET_FILES)."""
    return os.path.isdir(path) and any(os.path.isfile(os.path.join(path, name)) for name in SAVED_DATASET_FILES)


def holds_one_dataset(path: str | None) -> bool:
    """Whether `path` is a save_to_disk folder of one Dataset, not of a DatasetDict: it has no splits and is read whole
    (open_hf_dataset). Told apart by its files as datasets.load_from_disk tells them apart."""
    return bool(path) and all(os.path.isfile(os.path.join(path, name)) for name in ("dataset_info.json", "state.json"))


def has_no_splits(source: str | None) -> bool:
    """Whether a --train-data / --dev-data source is a data file or a folder save_to_disk did not write (an STS year
    folder): read whole, it has no splits, and a --train-split / --dev-split has no effect on it."""
    return bool(source) and os.path.exists(source) and not is_saved_dataset(source)


def open_hf_dataset(name_or_path: str, split: str, *, split_flag: str = "split", split_default: str = "train"):
    """One split of a Hugging Face dataset: a save_to_disk folder, or a hub name. `split_flag` names the setting that
    chose `split` in the messages (angle-train's --train-split, --dev-split); `split_default` is that setting's
    default. A folder of one Dataset (save_to_disk of a Dataset, not a DatasetDict) has no splits: it is read whole
    for the default split or the split it was saved from (Dataset.split), and another split is refused (it was read
    whole in silence, as if that split had been found). A name that can only be a local path and does not exist is
    a MissingLocalPath (refuse_missing_local_path), not looked up on the Hub; a hub name that cannot be loaded (the
    Hub out of reach and the dataset not cached, or no such dataset) a hub.HubUnreachable / hub.HubNotFound."""
    refuse_missing_local_path(name_or_path)
    try:
        import datasets
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError("reading Hugging Face datasets needs the `datasets` package: pip install "
                          "'angle_kernels[train]'") from exc
    if not os.path.isdir(name_or_path):
        try:
            with hub_lookup(name_or_path, kind="dataset"):  # named by the caller's errors_naming: --train-data...
                return datasets.load_dataset(name_or_path, split=split)
        except ValueError as exc:  # the datasets package's words (arrow_reader): 'Unknown split "dev". Should be ...'
            if not str(exc).startswith("Unknown split"):
                raise
            raise DataError(f"{split_flag} {split}: {name_or_path} has no split {split!r} ({exc})") from None
    if not is_saved_dataset(name_or_path):
        files = data_files_in(name_or_path)
        raise DataError(f"{name_or_path}: a folder, not a Hugging Face dataset saved by save_to_disk (no "
                        f"{' or '.join(SAVED_DATASET_FILES)}): give a data file" +
                        (f", e.g. one of {', '.join(files[:4])}" if files
                         else " (.jsonl, .csv, .tsv or an STS-B file)"))
    dataset = datasets.load_from_disk(name_or_path)
    if isinstance(dataset, datasets.DatasetDict):
        if split not in dataset:
            raise DataError(f"{split_flag} {split}: {name_or_path} has no split {split!r} (its splits: "
                            f"{', '.join(map(repr, dataset))})")
        return dataset[split]
    saved_from = None if dataset.split is None else str(dataset.split)
    if split not in (split_default, saved_from):
        raise DataError(f"{split_flag} {split}: {name_or_path} holds one dataset (save_to_disk of a Dataset"
                        + (f", saved from the split {saved_from!r}" if saved_from else "") + ", not of a DatasetDict), "
                        f"which has no split {split!r}: leave {split_flag} at its default ({split_default!r}) to read "
                        "it whole, or save the DatasetDict to read its splits")
    return dataset


def read_hf_dataset(name_or_path: str, fmt: str | None, split: str, columns: dict | None = None, *,
                    split_flag: str = "split", split_default: str = "train") -> tuple[list[Example], str]:
    dataset = open_hf_dataset(name_or_path, split, split_flag=split_flag, split_default=split_default)
    where = f"{name_or_path} [{split}]"
    names = column_names(check_columns(columns), dataset.column_names, where)
    detected_at = None if fmt else where
    fmt = fmt or detect_format(names, where, dataset.column_names)
    check_format_columns(names, fmt, where, detected_at, present=dataset.column_names)
    if fmt == "A":
        check_class_label(dataset.features.get(names["label"]), where, names["label"])
    # only the columns the format reads, a block of rows at a time: row by row, every column of every row was
    # decoded (an audio or image column the run never reads needed its decoder, and failed without it), and a million
    # pairs took 13.0 s to read where they take 8.5
    read = list(dict.fromkeys(names[name] for name in FORMATS[fmt]))
    examples, start = [], 0
    for block in dataset.select_columns(read).iter(batch_size=HF_ROWS_AT_ONCE):
        examples += [_example_from_row(dict(zip(read, values)), fmt, f"{where}, row {start + i}", names)
                     for i, values in enumerate(zip(*(block[column] for column in read)))]
        start += len(block[read[0]])
    return examples, fmt


# A class name that says "not similar": a negation (not_entailment, not_duplicate, non-paraphrase, no; not "none" or
# "nothing") or a word for pairs that are not similar (a two-class NLI label's contradiction or neutral, SciTail's
# neutral, different, false): where it is class 1 of a two-class label, the label's 1 marks the pairs that are not
# similar
NEGATED_CLASS = re.compile(r"^(?:(?:not|non|no)(?:[_\-\s]|$)|(?:contradiction|neutral|different|dissimilar|unrelated|"
                           r"false)$)", re.IGNORECASE)


def check_class_label(feature, where: str, column: str) -> None:
    """Refuse a format-A label column that is a Hugging Face ClassLabel whose class numbers are no similarity score:
    the rows hold each class's number (0, 1, 2...), which was trained and evaluated as the pair's score in silence.
    NLI's (entailment, neutral, contradiction) made entailment the least similar and contradiction the most, and
    GLUE RTE's (entailment, not_entailment) gave the in-batch-negative term its non-entailed pairs as the positives.
    Accepted: classes named by their own numbers ("0" .. "5"), and two classes whose 1 is no NEGATED_CLASS name
    (MRPC's not_equivalent / equivalent, QQP's not_duplicate / duplicate: 1 is the similar pair)."""
    try:
        from datasets import ClassLabel
    except ImportError:  # pragma: no cover - a dataset was read, so datasets is there
        return
    if not isinstance(feature, ClassLabel):
        return
    classes = list(feature.names)
    if all(_number_or_none(name) == index for index, name in enumerate(classes)):
        return
    what = "label" if column == "label" else f"label ({column!r})"
    listed = ", ".join(f"{index} = {name}" for index, name in enumerate(classes))
    # the column cast to float first: dataset.map alone keeps a ClassLabel column a ClassLabel (its values too), and
    # the mapped dataset was refused again
    cast = f"dataset.cast_column({column!r}, datasets.Value('float32'))"
    if len(classes) > 2:
        raise DataError(f"{where}: {what} is a ClassLabel of {len(classes)} classes ({listed}): categories, whose "
                        f"numbers are no similarity score; turn them into scores first ({cast}, then .map(...) to "
                        "the score of each class), or NLI classes into (query, positive, negative) triples (format C)")
    if len(classes) == 2 and NEGATED_CLASS.match(classes[1]):
        raise DataError(f"{where}: {what} is a ClassLabel ({listed}) whose class 1 names the pairs that are not "
                        f"similar, while a 0/1 label's 1 marks a similar pair; flip it first ({cast}.map(lambda row: "
                        f"{{{column!r}: 1 - row[{column!r}]}}))")


def _number_or_none(text: str) -> float | None:
    try:
        return float(text)
    except ValueError:
        return None


# Rows read_hf_dataset decodes at once: the transient lists of one block
HF_ROWS_AT_ONCE = 4096


def data_fingerprint(items: list) -> str:
    """A short hash of the training items (Examples or sentences), every one of them in order, each text and label
    with its length (no two lists of items make the same string): different for different data but by rare chance,
    however small the edit. The processes of a run compare theirs (distributed.check_processes_agree), and a
    checkpoint records it (checkpoint.Position.data_record). About 1.5 s a million pairs of short texts, one pass."""
    digest = hashlib.sha256(str(len(items)).encode())
    for start in range(0, len(items), 4096):
        digest.update("".join(_canonical_item(item) for item in items[start:start + 4096]).encode())
    return digest.hexdigest()[:16]


# repeated_items' hash of an item: two of 10 million rows share one by a chance of about 10**-25
REPEAT_KEY_BYTES = 16


def repeated_items(items: list) -> int:
    """How many of the training items repeat an earlier one exactly: an Example with the same texts and label (1 and
    1.0 are one label, as are 0.0 and -0.0), or the same sentence. A copy that falls in its original's batch is a
    negative of it for the in-batch (contrastive) terms, as is a copy of a positive text: the trainer says how many
    rows repeat (it trains them as given).

    Each item is a 16-byte hash of its canonical string (blake2b of _canonical_item's), the hashes sorted in one
    array: about 20 bytes a row at the peak, where a set of the items' tuples took about 100 (a gigabyte at 10 million
    pairs) and a set of the sentences 50, for about 3 s a million rows where the set took 1 s (2 loaded cores). Two
    different items share a hash by a chance of 2**-128."""
    if len(items) < 2:
        return 0
    keys = bytearray(REPEAT_KEY_BYTES * len(items))
    for start in range(0, len(items), 4096):
        chunk = items[start:start + 4096]
        keys[REPEAT_KEY_BYTES * start:REPEAT_KEY_BYTES * (start + len(chunk))] = b"".join(
            hashlib.blake2b(_canonical_item(item, label=_label_key).encode(), digest_size=REPEAT_KEY_BYTES).digest()
            for item in chunk)
    rows = numpy.frombuffer(keys, dtype=f"S{REPEAT_KEY_BYTES}")  # a byte string's order: equal hashes side by side
    rows.sort()
    words = rows.view("<u8").reshape(len(items), -1)
    return int(numpy.count_nonzero((words[1:] == words[:-1]).all(axis=1)))


def _label_key(label) -> str:
    """A label as repeated_items compares it: by its value, as Python's == does (1 and 1.0, 0.0 and -0.0 alike)."""
    return repr(float(label) + 0.0)


def _canonical_item(item, label=repr) -> str:
    """An item as a string that names its parts' count and each part's length: a sentence, or an Example's texts
    and label (written by `label`)."""
    parts = (item,) if isinstance(item, str) else (*item.texts, label(item.label))
    return f"{len(parts)}" + "".join(f"|{len(part)}:{part}" for part in parts)


def sampled_data_fingerprint(items: list) -> str:
    """The fingerprint the checkpoints of earlier versions recorded (their data_record's "fingerprint"; now
    "contents", data_fingerprint's): the count and at most 1,000 items, evenly spaced, with their positions. A
    resume from such a checkpoint compares this one, the only one it has."""
    step = max(1, len(items) // 1000)
    digest = hashlib.sha256(str(len(items)).encode())
    for i in range(0, len(items), step):
        digest.update(repr((i, items[i])).encode())
    return digest.hexdigest()[:16]


def order_fingerprint(batches: list[list[int]]) -> str:
    """A short hash of an epoch's batches (epoch_batches' example indices, in order): a checkpoint records the one
    of its epoch, and a resumed run's must equal it (checkpoint.load_checkpoint)."""
    return hashlib.sha256(array("q", itertools.chain.from_iterable(batches)).tobytes()).hexdigest()[:16]


def load_examples(source: str, *, fmt: str | None = None, split: str = "train", layout: str | None = None,
                  columns: dict | None = None, split_flag: str = "split", split_default: str = "train"
                  ) -> tuple[list[Example], str]:
    """Read `source` into (examples, format). `fmt` forces A/B/C; `layout="stsb"` forces the STS-B reader;
    `columns` maps the format's names to a JSONL/CSV/TSV file's or a dataset's columns ({"text1": "sent_a", ...}:
    angle-train's --columns); `split`: a Hugging Face dataset's (open_hf_dataset, with `split_flag` and
    `split_default`)."""
    if fmt is not None and fmt not in FORMATS:
        raise ValueError(f"format must be one of 'A', 'B', 'C' or None (detect); got {fmt!r}")
    if layout not in (None, "stsb"):
        raise ValueError(f"layout must be None or 'stsb'; got {layout!r}")
    is_file = os.path.isfile(source)
    if is_file and os.path.getsize(source) == 0:
        raise DataError(f"{source}: the file is empty")
    if layout == "stsb" or (is_file and not has_suffix(source, JSONL_SUFFIXES) and first_line_is_stsb(source)):
        if fmt not in (None, "A"):
            raise DataError(f"{source}: the STS-B layout is format A (text1, text2, label); got format={fmt!r}")
        examples, fmt = read_stsb(source), "A"
    elif is_file and has_suffix(source, JSONL_SUFFIXES):
        examples, fmt = read_jsonl(source, fmt, columns)
    elif is_file and has_suffix(source, DELIMITED_SUFFIXES):
        examples, fmt = read_delimited(source, fmt, delimiter_of(source), columns)
    elif is_file:
        raise DataError(f"{source}: unknown file type; use .jsonl, .csv, .tsv or the STS-B layout")
    else:
        examples, fmt = read_hf_dataset(source, fmt, split, columns, split_flag=split_flag,
                                        split_default=split_default)
    if not examples:
        raise DataError(f"{source}: no examples (the file has no data rows)")
    return examples, fmt


def first_line_is_stsb(path: str) -> bool:
    with open_text(path) as f:
        for line in f:
            if line.strip():
                return _is_stsb_line(line)
    return False


# ------------------------------------------------------------------------------------- tokens and batches


# Texts per tokenizer call: the tokenizer's lists for that many texts are the transient memory of tokenising.
TOKENIZE_CHUNK = 16384


class TokenRows:
    """The token ids of many texts, in one flat array of 32-bit ints with each text's end: 4 bytes a token, where
    a list of Python ints per text took about 70 (1M pairs: 7.9 GB resident after tokenising, for every process of
    a job). rows[i] is text i's ids as a list. A batch's rows are taken in a few tensor ops (take, concat) and
    become its passes' tensors the same way (flat: pad_batch, PackedTexts.build), with no list per text: a
    32,768-pair batch's padded passes took 1.2 s of Python loops on one thread.

    Rows built with extend live in growable arrays; rows made by take / concat live in tensors (extend turns
    them back into arrays)."""

    def __init__(self, rows=()):
        self._flat, self._ends = array("i"), array("q")
        self.extend(rows)

    @classmethod
    def from_flat(cls, flat: torch.Tensor, lengths: torch.Tensor) -> TokenRows:
        """Rows from their tokens end to end and each row's length, kept in arrays as rows built with extend."""
        rows = cls()
        rows._flat.frombytes(flat.to(torch.int32).numpy().tobytes())
        rows._ends.frombytes(torch.cumsum(lengths.to(torch.int64), 0).numpy().tobytes())
        return rows

    @classmethod
    def _of(cls, flat: torch.Tensor, ends: torch.Tensor) -> TokenRows:
        rows = cls()
        rows._flat, rows._ends = flat, ends
        return rows

    def extend(self, rows) -> None:
        if isinstance(self._flat, torch.Tensor):
            self._flat, self._ends = array("i", self._flat.tolist()), array("q", self._ends.tolist())
        for ids in rows:
            self._flat.extend(ids)
            self._ends.append(len(self._flat))

    def _tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the flat int32 tokens, the int64 ends): views of the arrays, valid until the next extend (an array
        that grows moves; torch.frombuffer does not hold it in place), so never kept."""
        if isinstance(self._flat, torch.Tensor):
            return self._flat, self._ends
        if not self._ends:  # frombuffer refuses an empty buffer
            return torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int64)
        flat = torch.frombuffer(self._flat, dtype=torch.int32) if self._flat else torch.empty(0, dtype=torch.int32)
        return flat, torch.frombuffer(self._ends, dtype=torch.int64)

    def __len__(self) -> int:
        return len(self._ends)

    def __getitem__(self, i: int | slice) -> list[int] | TokenRows:
        """Row i's ids as a list; a slice of the rows as TokenRows."""
        if isinstance(i, slice):
            return self.take(range(len(self))[i])
        ends = self._ends
        if i < 0:
            i += len(ends)
        return self._flat[int(ends[i - 1]) if i else 0:int(ends[i])].tolist()

    def __iter__(self):
        return (self[i] for i in range(len(self)))

    def length(self, i: int) -> int:
        return int(self._ends[i]) - (int(self._ends[i - 1]) if i else 0)

    def lengths(self) -> list[int]:
        """Every row's token count."""
        return self.length_tensor().tolist()

    def length_tensor(self) -> torch.Tensor:
        """Every row's token count, as an int64 tensor."""
        return self._row_lengths(self._tensors()[1])

    @staticmethod
    def _row_lengths(ends: torch.Tensor) -> torch.Tensor:
        return torch.diff(ends, prepend=torch.zeros(1, dtype=torch.int64))

    def take(self, indices) -> TokenRows:
        """Rows `indices` (from the end where negative, as a list's), in that order, as new rows: one gather of
        their tokens."""
        flat, ends = self._tensors()
        asked = torch.as_tensor(indices, dtype=torch.long).reshape(-1)
        index = torch.where(asked < 0, asked + len(ends), asked)
        if index.numel() and not 0 <= int(index.min()) <= int(index.max()) < len(ends):
            raise IndexError(f"rows {int(asked.min())}..{int(asked.max())} asked of {len(ends)}")
        stop = ends[index]
        lengths = stop - torch.where(index > 0, ends[(index - 1).clamp(min=0)], 0)
        new_ends = torch.cumsum(lengths, 0)
        total = int(new_ends[-1]) if index.numel() else 0
        # token t of new row r comes from old position stop[r] - (new_ends[r] - t): one shift per row
        source = torch.arange(total) + torch.repeat_interleave(stop - new_ends, lengths, output_size=total)
        return TokenRows._of(flat[source], new_ends)

    def span(self, start: int, stop: int) -> TokenRows:
        """Rows start .. stop - 1: views of these rows' tensors where they live in tensors (made by take or
        concat), else a copy (the arrays of rows built with extend move when they grow)."""
        if not isinstance(self._flat, torch.Tensor):
            return self.take(range(start, stop))
        first = int(self._ends[start - 1]) if start else 0
        last = int(self._ends[stop - 1]) if stop > start else first
        return TokenRows._of(self._flat[first:last], self._ends[start:stop] - first)

    @classmethod
    def concat(cls, parts: list[TokenRows]) -> TokenRows:
        """The rows of every part, in order."""
        pieces = [part._tensors() for part in parts]
        shifts = torch.cumsum(torch.tensor([0] + [int(ends[-1]) if len(ends) else 0 for _, ends in pieces]), 0)
        return cls._of(torch.cat([flat for flat, _ in pieces]),
                       torch.cat([ends + shift for (_, ends), shift in zip(pieces, shifts.tolist())]))

    def flat(self, dtype: torch.dtype = torch.long) -> tuple[torch.Tensor, torch.Tensor]:
        """(every token of every row in order, as int64 input ids or `dtype`; each row's length)."""
        flat, ends = self._tensors()
        return flat.to(dtype), self._row_lengths(ends)

    def __eq__(self, other) -> bool:
        if isinstance(other, TokenRows):
            (flat, ends), (other_flat, other_ends) = self._tensors(), other._tensors()
            return torch.equal(ends, other_ends) and torch.equal(flat, other_flat)
        return isinstance(other, list) and list(self) == other

    def __repr__(self) -> str:
        return f"TokenRows({list(self)!r})"


def as_token_rows(seqs: TokenRows | list[list[int]]) -> TokenRows:
    return seqs if isinstance(seqs, TokenRows) else TokenRows(seqs)


# The methods of transformers' fast tokenizer class that its call on a list of texts goes through: a class that
# overrides none of them returns its backend's encodings of the texts, converted one by one (encode_texts).
_BACKEND_CALL = ("__call__", "_encode_plus", "_convert_encoding", "set_truncation_and_padding")
# The options encode_texts hands to the backend as transformers' call would; any other goes through that call.
_BACKEND_OPTIONS = {"truncation", "max_length", "add_special_tokens", "return_special_tokens_mask",
                    "return_offsets_mapping"}


def encode_texts(texts: list[str], tokenizer, **options):
    """tokenizer(texts, **options) without the attention masks and token types nobody reads: the same input ids
    (and special-token masks and offsets where asked), and a fast tokenizer's encodings (truncated_texts reads
    them). A fast tokenizer's texts are encoded by its backend (the tokenizers library) in one batch call, as
    transformers' call does, and their ids read from the encodings directly: transformers' conversion of each
    encoding to lists took longer than the encoding itself (~60% of tokenising short texts). Transformers' call
    tokenises the first text, which sets the backend's truncation, padding and special-token handling as that call
    sets them for every text; a first text whose ids differ from the backend's (a tokenizer that changes the call's
    output some other way) sends every text through transformers' call."""
    call = dict(options, return_attention_mask=False, return_token_type_ids=False)
    if not _plain_backend_call(tokenizer) or not set(options) <= _BACKEND_OPTIONS:
        return tokenizer(texts, **call)
    from transformers import BatchEncoding

    first = tokenizer(texts[:1], **call)
    encodings = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=options.get("add_special_tokens",
                                                                                              True))
    fields = {"input_ids": "ids", "special_tokens_mask": "special_tokens_mask", "offset_mapping": "offsets"}
    if not set(first) <= set(fields) or any(first[key][0] != getattr(encodings[0], fields[key]) for key in first):
        return tokenizer(texts, **call)
    return BatchEncoding({key: [getattr(each, fields[key]) for each in encodings] for key in first},
                         encoding=encodings)


def _plain_backend_call(tokenizer) -> bool:
    """Whether `tokenizer` is a transformers fast tokenizer whose call on texts is its base class's (_BACKEND_CALL)."""
    from transformers import PreTrainedTokenizerFast

    return isinstance(tokenizer, PreTrainedTokenizerFast) and all(
        getattr(type(tokenizer), name, None) is getattr(PreTrainedTokenizerFast, name, None) for name in _BACKEND_CALL)


def tokenize_in_chunks(texts: list[str], tokenizer, *, special_tokens_mask: bool = False, offsets: bool = False,
                       **options):
    """(input ids, special-token masks or None, character offsets or None, which were cut) of `texts`, each a list per
    text, TOKENIZE_CHUNK texts per tokenizer call and without the attention masks and token types nobody reads: the
    tokenizer's lists for all the texts at once were the peak of tokenising a large dataset (yielded chunk by
    chunk). offsets: each token's character span in its text (a fast tokenizer's offset mapping). Which were cut:
    whether truncation (options' truncation and max_length) dropped tokens of the text (truncated_texts)."""
    for start in range(0, len(texts), TOKENIZE_CHUNK):
        chunk = texts[start:start + TOKENIZE_CHUNK]
        encoded = encode_texts(chunk, tokenizer, return_special_tokens_mask=special_tokens_mask,
                               return_offsets_mapping=offsets, **options)
        yield (encoded["input_ids"], encoded["special_tokens_mask"] if special_tokens_mask else None,
               encoded["offset_mapping"] if offsets else None, truncated_texts(chunk, encoded, tokenizer, **options))


def truncated_texts(texts: list[str], encoded, tokenizer, *, truncation=False, max_length=None, **options
                    ) -> list[bool]:
    """Whether truncation at max_length dropped tokens of each text the tokenizer `encoded` so. A text of exactly
    max_length tokens may be whole or cut: a fast tokenizer keeps what it cut (each encoding's overflowing parts);
    with a slow one, the texts at the limit are tokenised again one token longer. Counting every text that reached
    the limit as cut told of texts cut where --max-length just held the longest."""
    ids = encoded["input_ids"]
    if not truncation or max_length is None:
        return [False] * len(ids)
    encodings = getattr(encoded, "encodings", None)
    if encodings is not None:
        return [bool(each.overflowing) for each in encodings]
    cut = [False] * len(ids)
    at_limit = [i for i, each in enumerate(ids) if len(each) >= max_length]
    if at_limit:
        longer = tokenizer([texts[i] for i in at_limit], return_attention_mask=False, return_token_type_ids=False,
                           truncation=truncation, max_length=max_length + 1, **options)["input_ids"]
        for i, each in zip(at_limit, longer):
            cut[i] = len(each) > max_length
    return cut


def share_of(count: int, processes=None) -> range:
    """This process's contiguous share of `count` items (processes: a distributed.DistInfo; None or one process:
    all of them); the first count % world_size processes take one more."""
    if processes is None or not processes.enabled:
        return range(count)
    size, extra = divmod(count, processes.world_size)
    start = processes.rank * size + min(processes.rank, extra)
    return range(start, start + size + (processes.rank < extra))


def gather_token_rows(parts: list[TokenRows], processes=None) -> list[TokenRows]:
    """Each of `parts` joined over the processes in rank order (every process holding its share of the same rows:
    share_of); `parts` itself with one process. A collective: every process calls it."""
    if processes is None or not processes.enabled:
        return parts
    from .distributed import all_gather_flat

    gathered = all_gather_flat(processes, [t for rows in parts for t in rows.flat(torch.int32)])
    return [TokenRows.from_flat(torch.cat([mine[2 * i] for mine in gathered]),
                                torch.cat([mine[2 * i + 1] for mine in gathered])) for i in range(len(parts))]


def cut_note(cut: int, texts: int, max_length: int) -> str:
    """"; N of M texts cut at --max-length L" for a run's header, where truncation (or a prompt's room: prompted_texts)
    cut texts (truncated_texts: a text of exactly L tokens is not cut); "" where none is."""
    return f"; {cut:,} of {texts:,} texts cut at --max-length {max_length}" if cut else ""


class TokenizedPairs:
    """Examples tokenised once up front (truncated, unpadded; TokenRows); batches are padded when they are used."""

    def __init__(self, examples: list[Example], fmt: str, tokenizer, *, max_length: int,
                 prompt: str | Prompts | None = None, processes=None):
        """prompt: one template for every text, or Prompts (one per role: ROLES[fmt] says each text's role).
        processes (a distributed.DistInfo, every process calling with the same examples): each process tokenises
        its share of the texts and the shares are gathered, in 1 / processes of the time one process takes."""
        if fmt not in FORMATS:
            raise ValueError(f"format must be one of 'A', 'B', 'C'; got {fmt!r}")
        self.fmt = fmt
        self.rows_per_example = ROWS_PER_EXAMPLE[fmt]
        for i, ex in enumerate(examples):
            if len(ex.texts) != self.rows_per_example:
                raise DataError(f"example {i} has {len(ex.texts)} texts; format {fmt} needs {self.rows_per_example}")
        templates = [Prompts.coerce(prompt).for_role(role) for role in ROLES[fmt]]
        k = self.rows_per_example
        share = share_of(len(examples) * k, processes)  # of the texts, example after example
        flat, prompt_cut = [None] * len(share), torch.zeros(len(share), dtype=torch.bool)
        for j, template in enumerate(templates):  # this share's texts of each role, in their prompt
            rows = [r for r in share if r % k == j]
            texts, cut = prompted_texts([examples[r // k].texts[j] for r in rows], template, tokenizer, max_length)
            for r, text in zip(rows, texts):
                flat[r - share.start] = text
            prompt_cut[[rows[i] - share.start for i in cut]] = True
        mine, truncated = TokenRows(), []
        for ids, _, _, cut in tokenize_in_chunks(flat, tokenizer, truncation=True, max_length=max_length,
                                                 add_special_tokens=True):
            mine.extend(ids)
            truncated += cut
        del flat
        # the texts cut: by the prompt's room (a decoded cut may come back shorter) or by truncation
        cut_here = int((prompt_cut | torch.tensor(truncated, dtype=torch.bool)).sum())
        self.rows, counts = gather_token_rows([mine, TokenRows([[cut_here]])], processes)
        self.labels = torch.tensor([ex.label for ex in examples], dtype=torch.float32)  # [examples]
        self._text_lengths = self.rows.length_tensor().view(len(examples), self.rows_per_example)  # [examples, k]
        self.lengths = self._text_lengths.amax(1).tolist()  # each example's longest text
        self.cut = cut_note(sum(each[0] for each in counts), len(self.rows), max_length)

    def __len__(self) -> int:
        return len(self.labels)

    def describe(self) -> str:
        return f"{len(self):,} examples (format {self.fmt}{self.cut})"

    def lengths_of(self, indices: list[int]) -> list[int]:
        """Real (unpadded) token counts of all rows of these examples."""
        return self._text_lengths[torch.as_tensor(indices, dtype=torch.long)].reshape(-1).tolist()

    def batch(self, indices: list[int]) -> Batch:
        """The rows of these examples in the loss layout (zigzag or stride 3) and one label per row."""
        k = self.rows_per_example
        examples = torch.as_tensor(indices, dtype=torch.long)
        rows = (examples[:, None] * k + torch.arange(k)).reshape(-1)
        return Batch(self.rows.take(rows), self.labels[examples].repeat_interleave(k))


@dataclass
class Batch:
    seqs: TokenRows  # token ids per row, unpadded (a list of lists is taken too)
    labels: torch.Tensor  # [rows], the example's label on each of its rows
    # rows [0, dropout_rows) are embedded with dropout, the rest without (ArcCSE's triplets); None: every row with
    dropout_rows: int | None = None

    def __post_init__(self):
        self.seqs = as_token_rows(self.seqs)
        if self.dropout_rows is not None and not 0 <= self.dropout_rows <= len(self.seqs):
            raise ValueError(f"dropout_rows must be between 0 and the batch's {len(self.seqs)} rows, got "
                             f"{self.dropout_rows}")

    def chunks(self, rows_per_chunk: int | None) -> list[TokenRows]:
        """The rows in forward passes of at most rows_per_chunk (0 / None: one pass), in batch order."""
        return [seqs for seqs, _ in self.passes(rows_per_chunk)]

    def passes(self, rows_per_chunk: int | None) -> list[tuple[TokenRows, bool]]:
        """(rows, with dropout) of each forward pass, in batch order: chunks of at most rows_per_chunk rows, none
        of which mixes rows with and without dropout."""
        return self.plan(rows=rows_per_chunk, sort=False).passes

    def plan(self, *, rows: int | None = None, tokens: int | None = None, sort: bool = True,
             pack_width: int = 0) -> PassPlan:
        """The batch cut into forward passes (PassPlan): within each dropout group (passes never mix rows with and
        without dropout), the rows sorted by length, longest first, when `sort` (then a pass pads to little more
        than its own rows: the loss and its gradient are unchanged, the embeddings are put back in batch order
        before the loss), then cut into passes of at most `rows` rows or at most `tokens` tokens; neither: one
        pass per group. A pass's tokens are its rows x its longest row (padding included), or with `pack_width`
        its real tokens: each pass's texts are then packed into rows of that many tokens (PackedTexts), so a
        pass processes little more than its real tokens. A text longer than the budget has a pass of its own."""
        if rows and tokens:
            raise ValueError("a pass plan takes a row count or a token budget, not both")
        split = len(self.seqs) if self.dropout_rows is None else self.dropout_rows
        lengths = self.seqs.length_tensor()
        runs, orders = [], []  # each pass as (start, stop, dropout) in the order the rows are embedded
        for low, high, dropout in ((0, split, True), (split, len(self.seqs), False)):
            if sort and (rows or tokens):  # one pass pads to its longest row in any order
                group = low + torch.sort(lengths[low:high], descending=True, stable=True).indices
            else:
                group = torch.arange(low, high)
            runs += [(low + first, low + stop, dropout)
                     for first, stop in _cut(lengths[group], rows, tokens, padded=not pack_width)]
            orders.append(group)
        order = torch.cat(orders)
        if len(runs) == 1 and runs[0][1] == len(self.seqs) and torch.equal(order, torch.arange(len(order))):
            return PassPlan([(self.seqs, runs[0][2])], order, pack_width)  # one pass of every row in batch order
        embedded = self.seqs.take(order)  # one gather of every pass's tokens; each pass a view of its rows
        return PassPlan([(embedded.span(start, stop), dropout) for start, stop, dropout in runs], order, pack_width)


def _cut(lengths: torch.Tensor, max_rows: int | None, max_tokens: int | None,
         padded: bool = True) -> list[tuple[int, int]]:
    """Rows with these lengths cut in order into runs (start, stop) of at most max_rows rows or max_tokens tokens:
    padded tokens (rows x the run's longest) when `padded`, else real tokens (the sum of the lengths). A run takes
    rows while its tokens stay within the budget, and at least one row.

    A run's tokens only grow with each row it takes, so its length is a search over its running cost, computed
    for a window of rows at a time (doubled until the run ends inside it): a few tensor ops a run, where a step of
    Python per row held the GIL for 0.1-0.2 s a step at 65,536 pairs (the trainer cuts the next step's passes on
    a background thread while the device runs this one)."""
    count = len(lengths)
    most_rows = max_rows if max_rows and max_rows > 0 else count
    if not count:
        return []
    if not max_tokens:
        return [(start, min(start + most_rows, count)) for start in range(0, count, most_rows)]
    max_tokens = min(max_tokens, torch.iinfo(torch.int64).max)  # the costs are int64: a larger budget bounds nothing
    cuts, start, window = [], 0, 64
    while start < count:
        room = min(most_rows, count - start)  # the rows this run may take
        while True:
            size = min(window, room)
            run = lengths[start:start + size]
            cost = torch.arange(1, size + 1) * torch.cummax(run, 0).values if padded else torch.cumsum(run, 0)
            fits = int(torch.searchsorted(cost, max_tokens, right=True))  # the leading rows within the budget
            if fits < size or size == room:
                break
            window *= 2
        stop = start + max(1, fits)
        cuts.append((start, stop))
        window = max(64, 2 * (stop - start))
        start = stop
    return cuts


def pack_rows(lengths: list[int], width: int) -> list[list[int]]:
    """The texts (by index) in rows of at most `width` tokens (a text longer than that in a row of its own), so
    that rows x the fullest row, the tokens the encoder processes, is small: first fit by decreasing length into
    rows of `width`, or of the narrower widths that share the same total among fewer rows evenly (a pass of 38
    tokens in rows of 24 costs 2 x 24; in rows of 19 it may cost 2 x 19), or of the longest text's width,
    whichever processes the fewest. The last makes packing never cost more than one padded pass of the texts."""
    return _best_packing(torch.as_tensor(lengths, dtype=torch.long), width).rows()


def _best_packing(lengths: torch.Tensor, width: int) -> _Packing:
    """pack_rows' packing, as tensors, for the texts' lengths as an int64 tensor."""
    total, longest = int(lengths.sum()), int(lengths.max())
    if not total:  # empty texts only: one row holds them all
        return _Packing(torch.arange(len(lengths)), torch.zeros(len(lengths), dtype=torch.long),
                        torch.tensor([width]), width)
    fewest_rows = -(-total // width)
    candidates = {width, longest} | {max(longest, -(-total // rows)) for rows in range(fewest_rows, fewest_rows + 3)}
    packings = [_first_fit_decreasing(lengths, min(candidate, width)) for candidate in sorted(candidates)]
    return min(packings, key=lambda packing: packing.processed_tokens)


@dataclass
class _Packing:
    """Texts placed in rows (_first_fit_decreasing), as tensors."""

    order: torch.Tensor  # the texts in the order they were placed
    row_of: torch.Tensor  # the row of each, in that order
    room: torch.Tensor  # each row's free room (below 0 under a text longer than the width)
    width: int

    @property
    def processed_tokens(self) -> int:
        """The tokens the encoder processes for the texts in these rows: rows x the fullest row, from the rooms."""
        return len(self.room) * (self.width - int(self.room.min())) if len(self.room) else 0

    def placement(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(the texts row after row, each row's in placing order: a stable sort of the placed texts by row; the
        number of texts in each row)."""
        _, by_row = torch.sort(self.row_of, stable=True)
        return self.order[by_row], torch.bincount(self.row_of, minlength=len(self.room))

    def rows(self) -> list[list[int]]:
        """Each row's texts in placing order."""
        placed, texts_per_row = self.placement()
        texts, bounds = placed.tolist(), torch.cumsum(texts_per_row, 0).tolist()
        return [texts[low:high] for low, high in zip([0] + bounds[:-1], bounds)]


def _first_fit_decreasing(lengths: torch.Tensor | list[int], width: int) -> _Packing:
    """Each text (longest first, ties in index order) into the first row with room for it, or a new row (a text
    longer than the width: a row of its own that nothing joins).

    Computed a length at a time: texts of one length fill the rows in order, each row taking as many as its room
    holds (rooms only shrink, so a row passed over never takes one later), then new rows of width // length each.
    That is a few tensor ops per distinct length, where placing each text in turn cost Python steps per text
    (0.14-0.17 s for 65,536 texts, twice per pass for pack_rows' candidate widths)."""
    length = torch.as_tensor(lengths, dtype=torch.long)
    by_length, order = torch.sort(length, descending=True, stable=True)  # the order the texts are placed in
    distinct, counts = torch.unique_consecutive(by_length, return_counts=True)
    room = torch.empty(0, dtype=torch.long)  # each row's free room (below 0 under a text longer than the width)
    row_of = torch.empty(len(lengths), dtype=torch.long)  # each placed text's row, in placing order
    start = 0
    for need, count in zip(distinct.tolist(), counts.tolist()):
        placed = slice(start, start + count)
        start += count
        if need == 0:  # empty texts: all in the first row with room (none is needed), else a new row
            fits = torch.nonzero(room >= 0)
            row_of[placed] = int(fits[0]) if len(fits) else len(room)
            if not len(fits):
                room = torch.cat([room, torch.tensor([width])])
            continue
        ends = torch.cumsum(room.clamp(min=0) // need, 0)  # the texts rows 0..r hold together
        existing = min(count, int(ends[-1]) if len(ends) else 0)
        into_existing = torch.searchsorted(ends, torch.arange(existing), right=True)
        per_row = max(1, width // need)
        into_new = len(room) + torch.arange(count - existing) // per_row
        row_of[placed] = torch.cat([into_existing, into_new])
        room = room - need * torch.bincount(into_existing, minlength=len(room))
        room = torch.cat([room, width - need * torch.bincount(into_new - len(room), minlength=0)])
    return _Packing(order, row_of, room, width)


@dataclass
class PackedTexts:
    """How one forward pass's texts lie in packed rows (PassPlan with pack_width; read by models.Encoder): the
    input ids are [rows, width] with several texts per row and no padding between them.

    text_of_token [rows, width]: which text (0 .. texts - 1, in the pass's order) each position holds, -1 for the
    padding at the end of a row; position_ids [rows, width]: each token's position within its own text (0 for
    padding); token_index [texts, longest]: the flat index (row * width + column) of each text's tokens, in order,
    right-padded with 0; token_mask [texts, longest]: 1 where token_index is a real token."""

    text_of_token: torch.Tensor
    position_ids: torch.Tensor
    token_index: torch.Tensor
    token_mask: torch.Tensor

    @classmethod
    def build(cls, seqs: TokenRows | list[list[int]], width: int, pad_id: int,
              rows: list[list[int]] | _Packing | None = None) -> tuple[torch.Tensor, PackedTexts]:
        """(input_ids [rows, width'], layout) for these texts packed into rows of `width` tokens (`rows`: their
        pack_rows, or its packing, when already known); width' is the fullest row's length."""
        tokens, count = as_token_rows(seqs).flat()
        # the texts row after row, each text's row, and its first column: the tokens of the row's texts before it
        if rows is None or isinstance(rows, _Packing):
            placed, texts_per_row = (_best_packing(count, width) if rows is None else rows).placement()
        else:
            placed = torch.tensor(list(itertools.chain.from_iterable(rows)), dtype=torch.long)
            texts_per_row = torch.tensor([len(row) for row in rows], dtype=torch.long)
        row_count = len(texts_per_row)
        row_of = torch.repeat_interleave(torch.arange(row_count), texts_per_row)
        before = torch.cumsum(count[placed], 0) - count[placed]  # tokens placed before the text, in any row
        column = before - before[torch.cumsum(texts_per_row, 0) - texts_per_row][row_of]
        fullest = int((column + count[placed]).max())
        longest = int(count.max())
        first_slot = torch.empty(len(count), dtype=torch.long)  # flat index (row * fullest + column) of each
        first_slot[placed] = row_of * fullest + column  # text's first token
        # every text's tokens in text order, scattered at once (one tensor op each, not a few per text)
        text_of = torch.repeat_interleave(torch.arange(len(seqs)), count)
        position = torch.arange(int(count.sum())) - torch.repeat_interleave(torch.cumsum(count, 0) - count, count)
        slots = first_slot[text_of] + position
        input_ids = torch.full((row_count * fullest,), pad_id, dtype=torch.long)
        input_ids[slots] = tokens
        text_of_token = torch.full((row_count * fullest,), -1, dtype=torch.long)
        text_of_token[slots] = text_of
        position_ids = torch.zeros(row_count * fullest, dtype=torch.long)
        position_ids[slots] = position
        token_index = torch.zeros(len(seqs) * longest, dtype=torch.long)
        token_mask = torch.zeros(len(seqs) * longest, dtype=torch.long)
        token_index[text_of * longest + position] = slots
        token_mask[text_of * longest + position] = 1
        grid = (row_count, fullest)
        return input_ids.view(grid), cls(text_of_token.view(grid), position_ids.view(grid),
                                         token_index.view(len(seqs), longest), token_mask.view(len(seqs), longest))

    @property
    def attention_mask(self) -> torch.Tensor:
        """[rows, width] 1 on the texts' tokens, 0 on the padding at the end of a row (the usual 2D mask)."""
        return (self.text_of_token >= 0).long()

    def to(self, device, non_blocking: bool = False) -> PackedTexts:
        return PackedTexts(*(tensor.to(device, non_blocking=non_blocking) for tensor in
                             (self.text_of_token, self.position_ids, self.token_index, self.token_mask)))

    def pin_memory(self) -> PackedTexts:
        return PackedTexts(*(tensor.pin_memory() for tensor in
                             (self.text_of_token, self.position_ids, self.token_index, self.token_mask)))


@dataclass
class PassPlan:
    """A batch's rows in forward passes (Batch.plan)."""

    passes: list[tuple[TokenRows, bool]]  # (rows' token ids, with dropout) of each pass
    order: torch.Tensor  # the batch row of each embedded row, passes concatenated (int64)
    pack_width: int = 0  # > 0: each pass's texts packed into rows of this many tokens (PackedTexts)

    def restore_index(self) -> torch.Tensor | None:
        """Where each batch row sits among the embedded rows (embeddings[..., restore, :] is in batch order), as
        an int64 tensor, or None when the passes keep batch order."""
        in_order = torch.arange(len(self.order))
        if torch.equal(self.order, in_order):
            return None
        return torch.empty_like(self.order).index_copy_(0, self.order, in_order)

    def tensors(self, pad_id: int, side: str, device=None) -> tuple[list[tuple], torch.Tensor | None]:
        """What the steps take (grad_cache.plain_step / grad_cache_step): each pass as (input_ids, attention_mask,
        dropout), padded (pad_batch), or packed as (input_ids, attention_mask, dropout, PackedTexts); and
        restore_index as a tensor (None: batch order)."""
        chunks = []
        for i, (seqs, dropout) in enumerate(self.passes):
            if not self.pack_width:
                chunks.append((*pad_batch(seqs, pad_id, side, device), dropout))
                continue
            input_ids, layout = PackedTexts.build(seqs, self.pack_width, pad_id, self.packings[i])
            chunks.append((input_ids.to(device), layout.attention_mask.to(device), dropout, layout.to(device)))
        restore = self.restore_index()
        return chunks, None if restore is None else restore.to(device)

    def token_counts(self) -> tuple[int, int]:
        """(real tokens, tokens the encoder processes: every pass padded to its longest row, or its packed rows
        padded to the fullest)."""
        lengths = [seqs.length_tensor() for seqs, _ in self.passes]
        real = sum(int(each.sum()) for each in lengths)
        if not self.pack_width:
            return real, sum(len(each) * int(each.max()) for each in lengths)
        return real, sum(packing.processed_tokens for packing in self.packings)

    @functools.cached_property
    def packings(self) -> list[_Packing]:
        """With pack_width: each pass's texts in rows (pack_rows' packing), worked out once for both tensors() and
        token_counts()."""
        return [_best_packing(seqs.length_tensor(), self.pack_width) for seqs, _ in self.passes]


class OneAhead:
    """The next piece of work made on one background thread while the caller does the current one (the trainer:
    the next step's batches, cut into passes and padded or packed on the CPU, while the device runs this step;
    torch releases the GIL inside its ops). get(key, make) returns what was started for `key`, waiting for it if
    need be, or make() now where nothing or something else was started (the settings changed since: --auto-chunk
    halves a step's passes after an out-of-memory error); start(key, make) starts the next. An error raised by
    the work is raised by get().

    On a GPU the thread works on `device` (its pinned memory is made there: a new thread's GPU is the first, where
    every process of a job would otherwise make a CUDA context)."""

    def __init__(self, device: torch.device | None = None):
        on_gpu = {}
        if device is not None and device.type == "cuda":
            index = torch.cuda.current_device() if device.index is None else device.index
            on_gpu = {"initializer": torch.cuda.set_device, "initargs": (index,)}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="angle-train-data", **on_gpu)
        self._key, self._future = None, None

    def get(self, key, make):
        future = self._future if self._key == key else None
        self._key, self._future = None, None  # a future for another key is dropped (its result never read)
        return make() if future is None else future.result()

    def start(self, key, make) -> None:
        self._key, self._future = key, self._pool.submit(make)

    def close(self) -> None:
        """Stop: the work under way finishes (a step's data: under a second), nothing started is kept."""
        self._key, self._future = None, None
        self._pool.shutdown(wait=True, cancel_futures=True)


def pad_batch(seqs: TokenRows | list[list[int]], pad_id: int, side: str, device=None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic padding to the longest row of this batch: (input_ids, attention_mask), both [B, L] int64."""
    if side not in ("left", "right"):
        raise ValueError(f"side must be 'left' or 'right'; got {side!r}")
    if not len(seqs):
        raise ValueError("pad_batch needs at least one row")
    tokens, lengths = as_token_rows(seqs).flat()
    columns = torch.arange(int(lengths.max()))
    real = columns < lengths[:, None] if side == "right" else columns >= len(columns) - lengths[:, None]
    input_ids = torch.full(real.shape, pad_id, dtype=torch.long)
    input_ids[real] = tokens  # a mask's positions in row-major order: each row's tokens, row after row
    return input_ids.to(device), real.long().to(device)


# The version of epoch_batches' order that a checkpoint records (Position.data_record's "order_version"; none:
# version 1). Version 1's --bucket sorted the last run of examples by length before leaving out those short of a
# full batch, so an epoch left out the longest examples of that run; version 2 leaves out the tail of the shuffled
# order, a random choice, before sorting. Orders without --bucket are the same in both.
ORDER_VERSION = 2


def epoch_batches(n: int, batch_size: int, *, seed: int, epoch: int, lengths: list[int] | None = None,
                  bucket_size: int = 0) -> list[list[int]]:
    """The example indices of every full batch of one epoch, a pure function of (seed, epoch).

    Being a pure function is what makes resuming exact: a resumed run recomputes the epoch's order and
    skips the batches it already trained on. The examples short of a last full batch are left out: the tail
    of the shuffled order, a random choice. With `bucket_size` > 0 (and lengths), each run of
    bucket_size * batch_size of the shuffled examples kept is sorted by length before being cut into batches, and
    the batches are shuffled again: less padding, still random. (ORDER_VERSION: --bucket sorted before leaving any
    out, which left out the longest examples of the last run.)
    """
    if n < batch_size:
        raise ValueError(f"the dataset has {n} examples, fewer than one batch of {batch_size}")
    rng = random.Random(seed * 1_000_003 + epoch)
    order = list(range(n))
    rng.shuffle(order)
    del order[n - n % batch_size:]
    if bucket_size and lengths is not None:
        span = bucket_size * batch_size
        order = [i for s in range(0, len(order), span) for i in sorted(order[s:s + span], key=lambda i: lengths[i])]
    batches = [order[s:s + batch_size] for s in range(0, len(order), batch_size)]
    if bucket_size and lengths is not None:
        rng.shuffle(batches)
    return batches
