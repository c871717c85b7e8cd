"""`angle-eval`: the AnglE paper's evaluation of an embedding model, from datasets in their original layouts.

    angle-eval MODEL PATH [PATH ...] [--pooling P] [--max-length L] [--prompt T] [--query-prompt T]
               [--doc-prompt T] [--columns NAME=COLUMN ...] [--dims D ... | trained] [--batch-size B] [--device D]
               [--base-model BASE] [--revision REV] [--json OUT] [--bf16 0|1 | --fp16 0|1] [--attention A]
               [--trust-remote-code 0|1]
               [--progress 0|1] [--debug] [--version]

MODEL is an `angle_train` export (a folder with angle_train.json: its pooling, prompts and maximum length are
used unless overridden), or a hub name / local folder of a Hugging Face model (pooling as --pooling says, else as
its sentence-transformers files say, else the encoder default; the choice is printed), or a local folder of a LoRA
adapter (peft's adapter_config.json: angle-train's final/adapter, or an adapter angle-emb trained on an LLM), which
is applied to the base model its adapter_config.json names, or to --base-model (as angle-emb's pretrained_lora_path
on a model); a run's final/adapter with the pooling, attention and prompts its export (final/angle_train.json)
records. --base-model also names the base of an adapter-only export (a LoRA run's best/) kept elsewhere. The
device is --device, else CUDA when there is one, as for angle-train; the forward pass runs in the weights' dtype, or
autocast to bfloat16 (--bf16) or float16 (--fp16), as angle-train's flags and dev evaluation do. Each PATH is read in
the layout it is distributed in:

    STS12 .. STS16   a year's folder as SentEval lays it out (STS.input.SUBSET.txt with STS.gs.SUBSET.txt) or
                     as originally released (STS2016.input.SUBSET.txt / STS2016.gs.SUBSET.txt); a pair whose gold
                     line is empty is skipped (STS13-16 leave some unrated). The name comes from the folder
                     (STS12-en-test -> STS12) or the files (STS2016.* -> STS16).
    STS-B            an STS Benchmark file (sts-test.csv: tab-separated, score in field 5, texts in 6 and 7);
                     another split is named after its file ("STS-B (sts-dev)")
    SICK-R           SICK_test_annotated.txt (pair_ID, sentence_A, sentence_B, relatedness_score, ...)
    retrieval        a format-B file (query or anchor, positive: JSONL / CSV): every distinct positive is a
                     document of the corpus (a text given twice is one document), every distinct query a query,
                     whose relevant documents are all the positives given for it (a query on two rows with two
                     positives has two);
                     recall@1, recall@10 and nDCG@10 (cosine) as sentence-transformers' InformationRetrievalEvaluator
                     defines them; the queries take the query prompt, the documents the document prompt (data.Prompts).
                     At least 2 distinct queries: over one, every document is one of its positives, so the metrics
                     are the same whatever the model
    pairs            a format-A file (text1, text2, label: JSONL / CSV), scored as STS-B is

JSONL / CSV / TSV files with other column names are read with --columns (angle-train's): e.g. text1=sent_a
text2=sent_b label=similarity. Given once, it maps every PATH; files of different layouts take it once per PATH, in
the PATHs' order, '' for a PATH read by its own column names or in a fixed layout (STS year folder, STS-B, SICK: a
mapping given for one of them alone is refused):
angle-eval MODEL a.csv b.jsonl --columns text1=sent_a text2=sent_b label=score --columns query=q positive=p.

The STS score is Spearman's rho x 100 between cosine similarity and the gold scores, in SentEval's "all" setting: one
correlation over every pair of a year's subsets together, each distinct text embedded once (a pair given twice ties
exactly, whatever --batch-size). In retrieval a document scoring the same as one of a query's positives, and not one
itself, ranks above it: a tie is never a win (sentence-transformers' InformationRetrievalEvaluator breaks ties by corpus
id), so embeddings that are all alike rank every positive last, not first. A score that cannot be computed
(embeddings holding NaN or Inf, or cosines all equal) is NaN: a line on stderr names the dataset, and the exit status
is 1. `--json OUT` writes {dataset name: score} (the retrieval metrics as {name:
{"recall@1": ..., ...}}; a NaN as null). `--dims 256 64` scores the first 256 and 64 features of every embedding too (a
Matryoshka model's widths; `--dims trained`: those an angle_train export was trained at), from the same embeddings,
under "name@256" and "name@64" (a row per width in the table). The trainer's dev evaluation uses the same scores
(dev_scores: the Spearman of scored pairs, the retrieval metrics of (query, positive) pairs). A progress bar per dataset
counts the texts embedded, on stderr when it is a terminal (--progress 1 / 0: always / never). A mistake in the
arguments, files or data is one line on stderr and status 2 (its traceback with --debug).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import json
import math
import os
import re
import sys
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import torch

from . import preflight, st_folder
from .atomic_files import written_aside
from .cli_common import (
    OneLineErrorParser, check_train_extra, comma_separated, parse_bool, resolve_device, user_errors_exit,
    version_text,
)
from .data import (
    DataError, Example, Prompts, check_label, check_text, data_files_in, errors_naming, is_saved_dataset,
    load_examples, names_local_path, open_text, parse_columns, read_stsb,
)
from .models import (
    ADAPTER_CONFIG, ATTENTION_IMPLEMENTATIONS, POOLING_STRATEGIES, adapter_config_base, check_dim,
    first_token_pooling_problem, read_adapter_config, truncate, use_attention,
)
from .tracking import finite_or_none

YEAR_FOLDER = re.compile(r"STS(1[2-6])")
ORIGINAL_FILES = re.compile(r"STS20(1[2-6])\.input\.(.+)\.txt$")
SENTEVAL_FILES = re.compile(r"STS\.input\.(.+)\.txt$")
SICK_HEADER = ("pair_ID", "sentence_A", "sentence_B", "relatedness_score")


class PairTexts(NamedTuple):
    """What a scored set embeds: each distinct text once, in the order it first appears (text1s, then text2s), and
    each pair's two texts as indices into them."""
    texts: list[str]
    first: torch.Tensor  # [pairs] int64
    second: torch.Tensor  # [pairs] int64


def pair_texts(examples: list[Example]) -> PairTexts:
    """The distinct texts of format-A examples, each embedded once: a text given twice (a pair repeated, a sentence
    paired with itself or with several others) has one embedding, so pairs of the same texts score the same cosine
    and tie in the Spearman ranking whatever the batch size. Embedded once per occurrence, its copies were padded in
    different batches and differed in the last bits, and the batch size decided which of them ranked first."""
    index: dict[str, int] = {}
    first = [index.setdefault(ex.texts[0], len(index)) for ex in examples]
    second = [index.setdefault(ex.texts[1], len(index)) for ex in examples]
    return PairTexts(list(index), torch.tensor(first, dtype=torch.long), torch.tensor(second, dtype=torch.long))


@dataclass
class StsSet:
    """Scored pairs. The examples are not changed once pairs() is called (it is computed once)."""
    name: str
    examples: list[Example]  # format A: (text1, text2), gold score

    def pairs(self) -> PairTexts:
        """The distinct texts the set embeds, and each pair's two as indices into them (pair_texts)."""
        return self._pairs

    @functools.cached_property
    def _pairs(self) -> PairTexts:
        return pair_texts(self.examples)


class Corpus(NamedTuple):
    """What a RetrievalSet ranks: each distinct text once, in the order it first appears."""
    queries: list[str]
    documents: list[str]
    relevant: torch.Tensor  # [pairs, 2] int64: (query, document) for each distinct pair (retrieval_metrics' relevant)


@dataclass
class RetrievalSet:
    """(query, positive) rows: documents[i] is a positive of queries[i]. The lists are not changed once corpus() is
    called (it is computed once)."""
    name: str
    queries: list[str]
    documents: list[str]

    def __post_init__(self):
        if len(self.queries) != len(self.documents):
            raise ValueError(f"RetrievalSet {self.name!r}: {len(self.queries)} queries and {len(self.documents)} "
                             "documents; documents[i] is the positive of queries[i], so they must be as many")

    def corpus(self) -> Corpus:
        """The distinct queries and documents, and which documents each query finds relevant: every positive given
        for its text. One text is one document (two queries with the same positive, a passage answering both or a
        row given twice, made two copies of it that scored exactly alike, and as a tie is never a win each lost rank 1
        to the copy), and one text is one query whose relevant documents are all its positives (a query given on two
        rows with two positives was two queries, each counting the other's positive a miss)."""
        return self._corpus

    @functools.cached_property
    def _corpus(self) -> Corpus:
        queries, documents, pairs = {}, {}, {}
        for query, document in zip(self.queries, self.documents):
            pairs.setdefault((queries.setdefault(query, len(queries)), documents.setdefault(document, len(documents))))
        return Corpus(list(queries), list(documents), torch.tensor(list(pairs), dtype=torch.long).view(-1, 2))


# ------------------------------------------------------------------------------------------------- reading
def read_dataset(path: str, *, columns: dict | None = None, where: str | None = None,
                 columns_refused: str | None = None) -> StsSet | RetrievalSet:
    """The dataset at `path`, recognised by its layout (module docstring); a DataError says what was expected.
    columns: the names of a JSONL/CSV file's columns (data.load_examples); an STS year folder, STS-B or SICK file is
    read in its fixed layout without them (a mapping given for every file), and refuses them where they were given
    for this path alone (`columns_refused`: what the refusal advises, e.g. to give '' for it). A scored set must
    allow a Spearman correlation that ranks something: at least FEWEST_SCORED_PAIRS rated pairs, not every gold
    score equal (before any model loads, not a NaN or a meaningless +-1 after); a retrieval set at least
    FEWEST_RANKED_QUERIES distinct queries (check_ranked); `where` names the set in those refusals (default: path)."""
    dataset = _read_dataset(path, columns=columns, columns_refused=columns_refused)
    if isinstance(dataset, StsSet):
        check_scored(dataset, where or path)
    else:
        check_ranked(dataset, where or path)
    return dataset


# The fewest rated pairs a Spearman correlation is scored on: over 2 pairs it is +1 or -1 whatever the model (two
# distinct values are always in the same or the opposite order), so it tells no model from another, and the trainer
# would pick best/ by a coin's toss; over 1 or none it is undefined.
FEWEST_SCORED_PAIRS = 3


def check_scored(dataset: StsSet, where: str, hint: str = "") -> None:
    """Refuse (DataError, naming `where`) a scored set that cannot give a Spearman correlation that ranks something:
    fewer than FEWEST_SCORED_PAIRS rated pairs, or every gold score equal (`hint` follows that message)."""
    labels = {ex.label for ex in dataset.examples}
    if len(dataset.examples) < FEWEST_SCORED_PAIRS:
        raise DataError(f"{where}: {len(dataset.examples)} rated pair(s); a Spearman correlation needs at least "
                        f"{FEWEST_SCORED_PAIRS} (over 2 it is +1 or -1 whatever the model)")
    if len(labels) == 1:
        raise DataError(f"{where}: every gold score is {labels.pop():g}, so the Spearman correlation is undefined"
                        + hint)


# The fewest distinct queries a retrieval score is computed over: the documents are the positives given, so every
# document is relevant to a set's one query, and its recall@k and nDCG@10 are the same whatever the model. Rows
# repeating one query are that one query (RetrievalSet.corpus).
FEWEST_RANKED_QUERIES = 2


def check_ranked(dataset: RetrievalSet, where: str) -> None:
    """Refuse (DataError, naming `where`) a retrieval set of fewer than FEWEST_RANKED_QUERIES distinct queries."""
    queries = len(dataset.corpus().queries)
    if queries < FEWEST_RANKED_QUERIES:
        raise DataError(f"{where}: {len(dataset.queries)} (query, positive) row(s) of {queries} distinct "
                        f"quer{'y' if queries == 1 else 'ies'}; retrieval needs at least {FEWEST_RANKED_QUERIES} "
                        "distinct queries (over one, every document is one of its positives, so recall@k and nDCG@10 "
                        "are the same whatever the model)")


def _read_dataset(path: str, *, columns: dict | None = None, columns_refused: str | None = None
                  ) -> StsSet | RetrievalSet:
    def fixed(layout: str) -> None:  # a mapping given for this file alone would be ignored: refused
        if columns and columns_refused:
            mapping = ", ".join(f"{name}={column}" for name, column in columns.items())
            raise DataError(f"{path}: --columns maps its columns ({mapping}), but it is {layout}, read in its fixed "
                            f"layout, which takes no mapping: {columns_refused}")

    if is_saved_dataset(path):  # its dataset_dict.json / state.json were named as data files of a year folder
        raise DataError(f"{path}: a Hugging Face dataset saved by save_to_disk, which angle-eval does not read (it "
                        "reads data files and STS year folders; angle-train's --dev-data reads this folder): write "
                        "the split to score as JSON Lines (the dataset's to_json(OUT)) and give that file")
    if os.path.isdir(path):
        fixed("an STS year folder")
        return read_sts_year(path)
    if not os.path.isfile(path):
        raise DataError(f"{path}: no such file or folder")
    with open_text(path) as f:
        first = f.readline().rstrip("\n").rstrip("\r").split("\t")
    if tuple(first[:4]) == SICK_HEADER:
        fixed("a SICK file")
        return StsSet("SICK-R", read_sick(path))
    stem = os.path.splitext(os.path.basename(path))[0]
    if len(first) >= 7:
        try:
            float(first[4])
        except ValueError:
            pass
        else:  # the paper's STS-B is the test split; another split keeps its file name
            fixed("an STS-B file")
            return StsSet("STS-B" if stem == "sts-test" else f"STS-B ({stem})", read_stsb(path))
    return dataset_of(stem, *load_examples(path, columns=columns))


def dataset_of(name: str, examples: list[Example], fmt: str) -> StsSet | RetrievalSet:
    """Examples as what is scored: format A as scored pairs, formats B and C as retrieval (a query's relevant
    documents are the positives given for it: RetrievalSet.corpus; a negative is not used)."""
    if fmt == "A":
        return StsSet(name, examples)
    return RetrievalSet(name, [ex.texts[0] for ex in examples], [ex.texts[1] for ex in examples])


def read_sts_year(folder: str) -> StsSet:
    """An STS12-16 year folder (SentEval's or the original file names): every subset's rated pairs, in file order."""
    files = sorted(glob.glob(os.path.join(folder, "*.input.*.txt")))
    subsets = []
    year = YEAR_FOLDER.search(os.path.basename(os.path.normpath(folder)))
    for file in files:
        name = os.path.basename(file)
        original, senteval = ORIGINAL_FILES.match(name), SENTEVAL_FILES.match(name)
        if original:
            year = year or original
            gold = os.path.join(folder, f"STS20{original.group(1)}.gs.{original.group(2)}.txt")
        elif senteval:
            gold = os.path.join(folder, f"STS.gs.{senteval.group(1)}.txt")
        else:
            continue
        if not os.path.isfile(gold):
            raise DataError(f"{file}: no gold file {os.path.basename(gold)} next to it")
        subsets.append((file, gold))
    if not subsets:
        data_files = data_files_in(folder)
        raise DataError(f"{folder}: no STS.input.*.txt / STS20xx.input.*.txt files (an STS12-16 year folder)"
                        + (f"; its data files are read one at a time: {', '.join(data_files[:4])}" if data_files
                           else ""))
    examples = []
    for file, gold in subsets:
        with open_text(file) as f:
            pairs = [line.rstrip("\n").rstrip("\r").split("\t") for line in f]
        with open_text(gold) as f:
            scores = [line.strip() for line in f]
        if len(scores) != len(pairs):
            raise DataError(f"{gold}: {len(scores)} gold lines for {len(pairs)} pairs in {os.path.basename(file)}")
        for number, (fields, score) in enumerate(zip(pairs, scores), start=1):
            if not score:  # an unrated pair
                continue
            if len(fields) < 2:
                raise DataError(f"{file}, line {number}: expected two tab-separated sentences")
            # no header: the sentences are named as read_stsb names an STS-B file's
            texts = tuple(check_text(text, f"{file}, line {number}", column)
                          for text, column in zip(fields, ("text1", "text2")))
            examples.append(Example(texts, check_label(score, f"{gold}, line {number}")))
    name = f"STS{year.group(1)}" if year else os.path.basename(os.path.normpath(folder))
    return StsSet(name, examples)


def read_sick(path: str) -> list[Example]:
    examples = []
    with open_text(path) as f:
        next(f)
        for number, line in enumerate(f, start=2):
            if not line.strip():
                continue
            row, where = line.rstrip("\n").rstrip("\r").split("\t"), f"{path}, line {number}"
            if len(row) < 4:
                raise DataError(f"{where}: expected at least 4 tab-separated fields; got {len(row)}")
            texts = (check_text(row[1], where, SICK_HEADER[1]), check_text(row[2], where, SICK_HEADER[2]))
            examples.append(Example(texts, check_label(row[3], where, SICK_HEADER[3])))
    return examples


# ------------------------------------------------------------------------------------------------- scoring
RETRIEVAL_METRICS = ("recall@1", "recall@10", "ndcg@10")


def non_finite_rows(*embeddings: torch.Tensor) -> int:
    """How many of the embeddings (rows of each tensor) hold a NaN or an Inf."""
    return sum(int((~torch.isfinite(rows)).any(dim=-1).sum()) for rows in embeddings)


def retrieval_metrics(queries: torch.Tensor, documents: torch.Tensor, *, relevant: torch.Tensor | None = None,
                      block: int = 1024) -> dict:
    """recall@1, recall@10 and nDCG@10 of cosine retrieval, each query ranking every document, averaged over the
    queries. relevant: the documents each query finds relevant: None, document i for query i; an int64 tensor
    [queries], query i's one relevant document relevant[i]; or [pairs, 2], (query, document) pairs (Corpus.relevant),
    a query with several relevant documents. With several, the metrics are sentence-transformers'
    InformationRetrievalEvaluator's: recall@k the share of a query's relevant documents in its first k, nDCG@10 the
    discounted gain of those in the first 10 over the gain of all of them ranked first. Rows are processed in blocks
    (no queries x documents matrix at once). A document that is not relevant and scores the same as a relevant one
    ranks above it: a tie is never a win, so embeddings that are all alike (a collapsed model) rank every relevant
    document last, not first. Embeddings holding NaN or Inf have no cosine to rank by: every metric is then NaN
    (angle-eval's exit status 1; never the trainer's best)."""
    n_queries = queries.shape[0]
    pairs = relevant_pairs(relevant, n_queries, documents.shape[0])
    if non_finite_rows(queries, documents):
        return dict.fromkeys(RETRIEVAL_METRICS, math.nan)
    queries = torch.nn.functional.normalize(queries.double(), dim=-1)
    documents = torch.nn.functional.normalize(documents.double(), dim=-1)
    query = pairs[:, 0]
    counts = torch.bincount(query, minlength=n_queries)  # each query's relevant documents
    ends = counts.cumsum(0)  # pairs are sorted by query: query q's are pairs[ends[q] - counts[q]:ends[q]]
    # the pairs' bookkeeping on the CPU (a number or two a pair), the scores where the embeddings are
    own = torch.empty(len(pairs), dtype=torch.float64)  # each pair's score
    beaten = torch.empty(len(pairs), dtype=torch.long)  # the documents not relevant that score at least as much
    for start in range(0, n_queries, block):
        stop = min(start + block, n_queries)
        first, last = int(ends[start] - counts[start]), int(ends[stop - 1])
        rows, columns = (query[first:last] - start).to(queries.device), pairs[first:last, 1].to(queries.device)
        scores = queries[start:stop] @ documents.T
        scored = scores[rows, columns]
        own[first:last] = scored.cpu()
        scores[rows, columns] = -math.inf  # a query's relevant documents do not push each other down
        for at in range(0, last - first, block):  # a query's pairs at a time, up to `block`: [block, documents]
            upto = min(at + block, last - first)
            beaten[first + at:first + upto] = (scores[rows[at:upto]] >= scored[at:upto, None]).sum(dim=1).cpu()
    # 0 = ranked first: a query's k-th best relevant document (k from 0) follows the k before it and the documents
    # not relevant that score at least its score
    by_score = torch.argsort(-own, stable=True)
    by_score = by_score[torch.argsort(query[by_score], stable=True)]
    rank = torch.empty_like(beaten)
    rank[by_score] = torch.arange(len(pairs)) - (ends - counts)[query[by_score]]
    rank = (rank + beaten).double()

    def per_query(values: torch.Tensor) -> torch.Tensor:
        return torch.zeros(n_queries, dtype=torch.float64).index_add_(0, query, values)

    found = counts.double()
    gain = torch.where(rank < 10, 1.0 / torch.log2(rank + 2.0), torch.zeros_like(rank))
    ideal = (1.0 / torch.log2(torch.arange(10, dtype=torch.float64) + 2.0)).cumsum(0)[counts.clamp(max=10) - 1]
    return {"recall@1": float((per_query((rank < 1).double()) / found).mean()),
            "recall@10": float((per_query((rank < 10).double()) / found).mean()),
            "ndcg@10": float((per_query(gain) / ideal).mean())}


def relevant_pairs(relevant: torch.Tensor | None, n_queries: int, n_documents: int) -> torch.Tensor:
    """retrieval_metrics' `relevant` as distinct (query, document) pairs [pairs, 2], sorted by query; a ValueError
    for an index out of range or a query without a relevant document (it has nothing to find)."""
    if relevant is None:
        relevant = torch.arange(n_queries)
    relevant = torch.as_tensor(relevant).long().cpu()
    if relevant.dim() == 1:
        relevant = torch.stack([torch.arange(len(relevant)), relevant], dim=1)
    if relevant.dim() != 2 or relevant.shape[1] != 2:
        raise ValueError("relevant must be None, one document per query [queries] or (query, document) pairs "
                         f"[pairs, 2]; got the shape {list(relevant.shape)}")
    for column, (what, limit) in enumerate((("query", n_queries), ("document", n_documents))):
        if len(relevant) and not 0 <= int(relevant[:, column].min()) <= int(relevant[:, column].max()) < limit:
            raise ValueError(f"relevant names a {what} index outside 0..{limit - 1} (there are {limit})")
    pairs = torch.unique(relevant, dim=0)  # sorted, by query first
    missing = (torch.bincount(pairs[:, 0], minlength=n_queries) == 0).nonzero().flatten().tolist()
    if missing:
        raise ValueError(f"relevant gives no relevant document for the queries {missing[:5]}"
                         + (f" ({len(missing)} in all)" if len(missing) > 5 else "") + ": each needs at least one")
    return pairs


def sts_spearman(encoder, tokenizer, examples: list[Example], *, batch_size: int = 128, max_length: int | None = None,
                 prompt: str | None = None, dim: int | None = None) -> float:
    """Spearman's rho (scipy) of cos(embed(text1), embed(text2)) against the labels of format-A examples; prompt: a
    template for both texts (default: the encoder's text prompt); dim: the cosine of the first `dim` features only
    (a Matryoshka prefix; None: the whole embeddings)."""
    return sts_spearman_by_dim(encoder, tokenizer, examples, [dim], batch_size=batch_size, max_length=max_length,
                               prompt=prompt)[dim]


def sts_spearman_by_dim(encoder, tokenizer, examples: list[Example], dims, *, batch_size: int = 128,
                        max_length: int | None = None, prompt: str | None = None,
                        pairs: PairTexts | None = None) -> dict:
    """{dim: sts_spearman(..., dim=dim)} for each of dims (None: the whole embeddings), the texts embedded once.
    pairs: the examples' pair_texts where the caller holds them (StsSet.pairs(): evaluate counted its progress bar's
    texts with them), else built here."""
    if not examples or len(examples[0].texts) != 2:
        raise ValueError("STS evaluation needs format-A examples (text1, text2, label)")
    for dim in dims:
        check_dim(dim, encoder.embedding_dim)  # before embedding the texts, not after
    if pairs is None:
        pairs = pair_texts(examples)
    embeddings = encoder.encode(pairs.texts, tokenizer, batch_size=batch_size, max_length=max_length, prompt=prompt)
    return spearman_by_dim(embeddings[pairs.first], embeddings[pairs.second], [ex.label for ex in examples], dims)


def spearman_by_dim(first: torch.Tensor, second: torch.Tensor, labels: list[float], dims) -> dict:
    """{dim: Spearman's rho of cos(first[:, :dim], second[:, :dim]) against the labels} (dim None: whole rows); NaN
    where an embedding holds NaN or Inf (no cosine to correlate, as retrieval_metrics says) or every cosine is equal
    (scipy's undefined correlation)."""
    from scipy.stats import ConstantInputWarning, spearmanr

    scores = {}
    for dim in dims:
        first_rows, second_rows = truncate(first, dim), truncate(second, dim)
        if non_finite_rows(first_rows, second_rows):
            scores[dim] = math.nan
            continue
        cosine = torch.nn.functional.cosine_similarity(first_rows, second_rows, dim=-1)
        with warnings.catch_warnings():  # every cosine equal: the NaN, which angle-eval and the trainer report in words
            warnings.simplefilter("ignore", ConstantInputWarning)
            scores[dim] = float(spearmanr(cosine.numpy(), labels).statistic)
    return scores


def dev_metric(dataset: StsSet | RetrievalSet) -> str:
    """The key of the dev score a run picks its best model by (tracking.DEV_METRICS): Spearman for scored pairs,
    nDCG@10 for (query, positive) pairs."""
    return "dev_spearman" if isinstance(dataset, StsSet) else "dev_ndcg@10"


def dev_scores(encoder, tokenizer, dataset: StsSet | RetrievalSet, dims, *, batch_size: int = 128,
               max_length: int | None = None) -> dict[str, float]:
    """A training run's dev evaluation as its metrics row holds it, each text embedded once: dev_metric(dataset) at
    the full width and as KEY@d at each of the narrower widths `dims`; for retrieval also dev_recall@1 and
    dev_recall@10 at the full width. Spearman as sts_spearman_by_dim; retrieval as retrieval_metrics, with the
    encoder's query and document prompts (as angle-eval scores a format-B file)."""
    for dim in dims:
        check_dim(dim, encoder.embedding_dim)  # before embedding the texts, not after
    embeddings = [encoder.encode(texts, tokenizer, prompt_name=role, batch_size=batch_size, max_length=max_length)
                  for texts, role in dev_inputs(dataset)]
    return scores_of_embeddings(dataset, embeddings, dims)


def dev_inputs(dataset: StsSet | RetrievalSet) -> list[tuple[list[str], str]]:
    """The texts a dev evaluation embeds, as (texts, prompt role) groups: the scored pairs' distinct texts
    (pair_texts: the text prompt), or the distinct queries and documents (Corpus: the query and document prompts)."""
    if isinstance(dataset, StsSet):
        return [(dataset.pairs().texts, "text")]
    corpus = dataset.corpus()
    return [(corpus.queries, "query"), (corpus.documents, "document")]


def scores_of_embeddings(dataset: StsSet | RetrievalSet, embeddings: list[torch.Tensor], dims) -> dict[str, float]:
    """dev_scores from the embeddings of dev_inputs' groups."""
    metric = dev_metric(dataset)
    if isinstance(dataset, StsSet):
        (embedded,), pairs = embeddings, dataset.pairs()  # the one dev_inputs took its texts from
        scores = spearman_by_dim(embedded[pairs.first], embedded[pairs.second], [ex.label for ex in dataset.examples],
                                 [None, *dims])
        return {metric if dim is None else f"{metric}@{dim}": score for dim, score in scores.items()}
    queries, documents = embeddings
    relevant = dataset.corpus().relevant  # the one dev_inputs took its texts from: computed once
    full = retrieval_metrics(queries, documents, relevant=relevant)
    scores = {metric: full["ndcg@10"], "dev_recall@1": full["recall@1"], "dev_recall@10": full["recall@10"]}
    for dim in dims:
        scores[f"{metric}@{dim}"] = retrieval_metrics(truncate(queries, dim), truncate(documents, dim),
                                                      relevant=relevant)["ndcg@10"]
    return scores


@contextlib.contextmanager
def encoding_progress(encoder, texts: int, description: str, progress: bool | None = None):
    """A tqdm bar on stderr counting the texts `encoder` embeds inside the with block, out of `texts`. progress:
    True or False, or None: shown when stderr is a terminal (not in a log file or a pipe). It counts at the
    encoder's forward (a hook), which leaves Encoder.encode's batching as it is."""
    if not shows_progress(progress):
        yield
        return
    from tqdm.auto import tqdm

    bar = tqdm(total=texts, desc=description, unit="text", file=sys.stderr, dynamic_ncols=True)

    def count(module, inputs, embeddings) -> None:  # returns None: a value returned would replace the embeddings
        bar.update(embeddings.shape[-2])  # one embedding per text: [texts, D], or [layers, texts, D] for a stack

    hook = encoder.register_forward_hook(count)
    try:
        yield
    finally:
        hook.remove()
        bar.close()


def shows_progress(progress: bool | None) -> bool:
    """Whether --progress shows progress bars: True or False as given, None (not given) where stderr is a terminal,
    not a log file or a pipe."""
    return sys.stderr.isatty() if progress is None else progress


@contextlib.contextmanager
def library_progress_bars(enabled: bool | None):
    """Inside, unless `enabled` (True, or None where stderr is a terminal: shows_progress), the progress bars of
    transformers (loading weights, "Writing model shards") and huggingface_hub (downloads) are off: --progress 0, or
    angle-eval's default into a log file, prints none. As they were after."""
    if shows_progress(enabled):
        yield
        return
    switches = []
    with contextlib.suppress(ImportError):
        from transformers.utils import logging as transformers_logging

        switches.append((transformers_logging.is_progress_bar_enabled(), transformers_logging.enable_progress_bar))
        transformers_logging.disable_progress_bar()
    with contextlib.suppress(ImportError):
        from huggingface_hub.utils import are_progress_bars_disabled, disable_progress_bars, enable_progress_bars

        switches.append((not are_progress_bars_disabled(), enable_progress_bars))
        disable_progress_bars()
    try:
        yield
    finally:
        for was_on, switch_on in switches:
            if was_on:
                switch_on()


def evaluate(encoder, tokenizer, datasets, *, batch_size: int = 128, max_length: int | None = None,
             progress: bool | None = None, dims=()) -> dict:
    """{name: Spearman x 100} for the STS sets and {name: {metric: value}} for the retrieval sets, with the
    encoder's prompts (encoder.prompts: the text prompt for STS pairs, the query and document prompts for
    retrieval). dims: narrower widths (Matryoshka prefixes) scored too, from the same embeddings (each text embedded
    once), under "name@d" as the trainer's dev_spearman@d. progress: a bar per dataset (encoding_progress; None:
    when stderr is a terminal)."""
    names = [dataset.name for dataset in datasets]
    if len(set(names)) != len(names):
        raise ValueError(f"two datasets have the same name ({names}): evaluate each year folder or file once")
    widths = [None, *dims]
    for dim in dims:
        check_dim(dim, encoder.embedding_dim)  # before any text is embedded
    keys = [name if dim is None else f"{name}@{dim}" for name in names for dim in widths]
    if len(set(keys)) != len(keys):  # a width twice, or a dataset named as another's truncated width
        raise ValueError(f"the datasets {names} at the widths {list(dims)} give two results one name; pass each "
                         "width once (and rename a file named NAME@WIDTH)")
    results = {}
    for dataset in datasets:
        if isinstance(dataset, StsSet):
            pairs = dataset.pairs()
            with encoding_progress(encoder, len(pairs.texts), dataset.name, progress):
                scores = sts_spearman_by_dim(encoder, tokenizer, dataset.examples, widths, batch_size=batch_size,
                                             max_length=max_length, pairs=pairs)
            scores = {dim: 100.0 * score for dim, score in scores.items()}
        else:
            embed = {"batch_size": batch_size, "max_length": max_length}
            corpus = dataset.corpus()
            with encoding_progress(encoder, len(corpus.queries) + len(corpus.documents), dataset.name, progress):
                queries = encoder.encode(corpus.queries, tokenizer, prompt_name="query", **embed)
                documents = encoder.encode(corpus.documents, tokenizer, prompt_name="document", **embed)
            scores = {dim: retrieval_metrics(truncate(queries, dim), truncate(documents, dim),
                                             relevant=corpus.relevant) for dim in widths}
        results.update({dataset.name if dim is None else f"{dataset.name}@{dim}": score
                        for dim, score in scores.items()})
    return results


def check_model(model: str) -> None:
    """Refuse a MODEL that can only be a local path but is not a model folder, before anything loads: transformers
    would look a missing path up on the Hub and fail with a message about repo ids, or fail on a folder without
    config.json (a run's OUTPUT_DIR, a dataset given first) with a traceback."""
    from .export import META_FILE

    if model.startswith("builtin:"):  # angle-train's random demo models: nothing trained to score
        raise ValueError(f"MODEL {model}: angle-train's built-in models are random weights built for a run; score a "
                         "trained one (an angle-train run's OUTPUT_DIR/final, a local folder or a hub name)")
    if names_local_path(model) and not os.path.exists(model):
        raise FileNotFoundError(f"MODEL {model}: no such folder (a local path, not a Hugging Face hub name: nothing "
                                "was looked up on the Hub)")
    if os.path.exists(model) and not any(os.path.isfile(os.path.join(model, name))
                                         for name in ("config.json", META_FILE, ADAPTER_CONFIG)):
        raise ValueError(f"MODEL {model}: not a model folder (no config.json, {META_FILE} or {ADAPTER_CONFIG}); an "
                         "angle-train run keeps its models in OUTPUT_DIR/final and OUTPUT_DIR/best, and MODEL comes "
                         "before the datasets: angle-eval MODEL PATH [PATH ...]")


def adapter_base(model: str, base_model: str | None) -> str | None:
    """The base model to apply MODEL's LoRA adapter to where MODEL is a folder of one (peft's adapter_config.json,
    no config.json or angle_train.json): `base_model` (--base-model), else the base its adapter_config.json names;
    None for any other MODEL, where --base-model is refused unless MODEL is an adapter-only export (a LoRA run's
    best/), whose base load_pretrained takes it for."""
    from .export import META_FILE

    meta = os.path.join(model, META_FILE)
    if os.path.isfile(meta):
        if base_model is not None and not st_folder.read_json(meta).get("adapter_only"):
            raise ValueError(f"--base-model {base_model}: MODEL {model} is a whole model (its {META_FILE} records no "
                             "adapter-only export); --base-model names the base of a LoRA adapter: leave it out")
        return None
    config = os.path.join(model, ADAPTER_CONFIG)
    if not os.path.isfile(config) or os.path.isfile(os.path.join(model, "config.json")):
        if base_model is not None:
            raise ValueError(f"--base-model {base_model}: MODEL {model} is not a local LoRA adapter folder (no "
                             f"{ADAPTER_CONFIG} there; an adapter on the Hub is read once downloaded to a folder); "
                             "--base-model names the base of one: leave it out")
        return None
    read_adapter_config(model, label="MODEL ")  # its LoRA settings checked before anything loads
    return base_model or adapter_config_base(model, label="MODEL ", flag="--base-model")


def load_model(model: str, *, pooling: str | None = None, device: str | torch.device = "cpu",
               base_model: str | None = None, trust_remote_code: bool = False, revision: str | None = None):
    """(encoder, tokenizer, settings) for an angle_train export, a Hugging Face model or a LoRA adapter folder (on
    adapter_base's base model); the pooling `pooling`, else the export's, else the model folder's own
    (models.load_encoder); encoder.pooling_source says which. A hub name that cannot be loaded raises
    hub.HubUnreachable / hub.HubNotFound naming MODEL, --base-model or the adapter's record of its base. `revision`
    (--revision): the branch, tag or commit of a hub MODEL; an adapter's base loads at the revision its
    adapter_config.json records (peft's "revision"), unless --base-model names another base."""
    from .export import META_FILE, adapter_export_meta, load_pretrained
    from .models import load_encoder

    base = adapter_base(model, base_model)
    base_given_as = "--base-model" if base_model is not None else \
        f"MODEL {model}'s {ADAPTER_CONFIG} records the base model"
    # a LoRA run's final/adapter: peft's files alone, embedding as trained only with the export's settings around it
    export_meta = adapter_export_meta(model) if base is not None else None
    if base is not None:
        print(f"angle-eval: the LoRA adapter {model} on its base model {base}"
              + (f", with its export's pooling, attention and prompts ({export_meta})" if export_meta else ""),
              file=sys.stderr, flush=True)
    if os.path.isfile(os.path.join(model, META_FILE)) or export_meta:
        encoder, tokenizer, meta = load_pretrained(model, device=device, pooling=pooling, export_meta_file=export_meta,
                                                   base_model=base if export_meta else base_model,
                                                   base_given_as=base_given_as if export_meta else "--base-model",
                                                   given_as="MODEL", trust_remote_code=trust_remote_code)
        encoder.pooling_source = f"the export's {export_meta or META_FILE}" if pooling is None else "--pooling"
        return encoder, tokenizer, meta
    if base is not None:
        recorded = None if base_model is not None else read_adapter_config(model, label="MODEL ").get("revision")
        encoder, tokenizer = load_encoder(base, pooling=pooling, device=device, lora_path=model,
                                          trust_remote_code=trust_remote_code, given_as=base_given_as,
                                          revision=recorded,
                                          revision_given_as=f"MODEL {model}'s {ADAPTER_CONFIG} records the revision")
        return encoder, tokenizer, {}
    encoder, tokenizer = load_encoder(model, pooling=pooling, device=device, trust_remote_code=trust_remote_code,
                                      given_as="MODEL", revision=revision, revision_given_as="--revision")
    return encoder, tokenizer, {}


def table(results: dict, dims=()) -> str:
    """evaluate's results: the STS scores as a table, a column per dataset and their average, and a row per width
    when `dims` (evaluate's) adds truncated ones; a line per retrieval result."""
    truncated = {f"{name}@{dim}" for name in results for dim in dims}
    sts = [name for name, value in results.items() if not isinstance(value, dict) and name not in truncated]
    rows = {"all": {name: results[name] for name in sts}} | {f"@{d}": {n: results[f"{n}@{d}"] for n in sts}
                                                             for d in dims}
    lines = []
    if sts:
        average, label = len(sts) > 1, len(rows) > 1
        header = ["dims"] * label + sts + ["Avg."] * average
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        for width, scores in rows.items():
            cells = list(scores.values()) + [sum(scores.values()) / len(scores)] * average
            lines.append("| " + " | ".join([width] * label + [f"{c:.2f}" for c in cells]) + " |")
    for name, metrics in results.items():
        if isinstance(metrics, dict):
            lines.append(f"{name}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    return "\n".join(lines)


def positive_int(text: str) -> int:
    """argparse's type for --batch-size and --max-length: 0 would fail deep in the encoding with a bare message."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1; got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1; got {value}")
    return value


def widths_or_trained(text: str) -> list:
    """argparse's type for a word of --dims: widths >= 1 or 'trained', one or several by commas (`64,32` as `64 32`);
    main() joins the words' lists."""
    malformed = argparse.ArgumentTypeError(f"expected widths (whole numbers >= 1, or 'trained'), by spaces or commas "
                                           f"(64 32, or 64,32); got {text!r}")
    try:
        parts = comma_separated(text)
    except ValueError:
        raise malformed from None
    if not all(part == "trained" or part.lstrip("+-").isdigit() for part in parts):  # 64;32, 64.5: not a width list
        raise malformed
    return [part if part == "trained" else positive_int(part) for part in parts]


def narrower_widths(requested, meta: dict, width: int, model: str) -> list:
    """The widths below the embeddings' `width` that --dims asks for, largest first ('trained': the widths the export
    was trained at, angle_train.json's matryoshka_dims); the full width is always scored."""
    dims = set()
    for value in requested:
        if value == "trained":
            if not meta.get("matryoshka_dims"):
                raise ValueError(f"--dims trained: {model} records no trained widths (an angle_train export of a run "
                                 "with --matryoshka-dims or --espresso does); give the widths as numbers")
            dims.update(meta["matryoshka_dims"])
        elif value > width:
            raise ValueError(f"--dims {value} is wider than the embeddings of {model} ({width} features)")
        else:
            dims.add(value)
    return sorted((d for d in dims if d < width), reverse=True)


def columns_of_paths(given: list[list[str]], paths: list[str]) -> list[dict]:
    """The column mapping of each PATH: --columns given once maps every PATH, given once per PATH the i-th maps the
    i-th (files of different layouts in one command; '' maps none); any other count is refused, naming the flag,
    before anything is read: which mapping is whose would be a guess."""
    mappings = [parse_columns(items) for items in given] or [{}]
    if len(mappings) == 1:
        return mappings * len(paths)
    if len(mappings) != len(paths):
        raise ValueError(f"--columns given {len(mappings)} times for {len(paths)} PATH(s): give it once (it maps every "
                         "PATH) or once per PATH, in their order ('' for a PATH read by its own column names)")
    return mappings


def build_parser() -> argparse.ArgumentParser:
    # the docstring's first paragraph, then after the flags all but its usage block (argparse writes its own)
    paragraphs = __doc__.split("\n\n")
    parser = OneLineErrorParser(prog="angle-eval", description=paragraphs[0], epilog="\n\n".join(paragraphs[2:]),
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="an angle_train export, or a hub name / local folder of a Hugging Face model")
    parser.add_argument("paths", nargs="+", metavar="PATH", help="datasets in their original layouts (see below)")
    parser.add_argument("--pooling", choices=POOLING_STRATEGIES, default=None,
                        help=f"how token states make the embedding: {', '.join(POOLING_STRATEGIES)} (default: the "
                        "export's, else the model folder's "
                        "sentence-transformers pooling, else cls for encoders and last for decoder LMs; the choice "
                        "is printed)")
    parser.add_argument("--max-length", type=positive_int, default=None,
                        help="truncate every text to this many tokens, prompt included (default: the export's, else "
                        "the sentence-transformers folder's max_seq_length, else 512; those two no longer than the "
                        "model's position table)")
    parser.add_argument("--prompt", default=None, help="the text prompt, for STS pairs (default: the export's); "
                        "'{text}' marks the text, '' is none; also the queries' and documents' where neither the "
                        "export nor the next two give theirs")
    parser.add_argument("--query-prompt", default=None,
                        help="the retrieval queries' prompt (default: the export's; '' for none)")
    parser.add_argument("--doc-prompt", default=None,
                        help="the retrieval documents' prompt (default: the export's; '' for none)")
    parser.add_argument("--columns", nargs="+", action="append", default=[], metavar="NAME=COLUMN",
                        help="the columns of JSONL/CSV/TSV PATHs to read under the format's names (text1, text2, "
                        "label, query, positive), as angle-train's --columns: PATH ... --columns text1=sent_a "
                        "text2=sent_b label=similarity. Given once it maps every PATH; given once per PATH, in their "
                        "order, each maps its own ('' for a PATH read by its own names, and for an STS year folder, "
                        "STS-B or SICK file)")
    parser.add_argument("--dims", nargs="+", type=widths_or_trained, default=[], metavar="D",
                        help="also score the first D features of every embedding (Matryoshka widths), each text "
                        "embedded once; results under NAME@D; 'trained': the widths an angle_train export was "
                        "trained at")
    parser.add_argument("--revision", default=None, metavar="REV",
                        help="the version of a hub MODEL to load: a branch, a tag or a commit hash (default: its main "
                             "branch)")
    parser.add_argument("--trust-remote-code", type=parse_bool, nargs="?", const=True, default=False, metavar="0|1",
                        help="run the Python code MODEL's folder or hub repository ships (config.json's auto_map); it "
                             "runs with your permissions: read it first")
    parser.add_argument("--bf16", type=parse_bool, nargs="?", const=True, default=False, metavar="0|1",
                        help="autocast the forward pass to bfloat16, as angle-train's --bf16 (embeddings float32)")
    parser.add_argument("--fp16", type=parse_bool, nargs="?", const=True, default=False, metavar="0|1",
                        help="autocast the forward pass to float16, as angle-train's --fp16")
    parser.add_argument("--attention", choices=ATTENTION_IMPLEMENTATIONS, default=None,
                        help="the model's attention implementation, by transformers' name (flash_attention_2 and _3: "
                             "a GPU, their package flash-attn, and --bf16 / --fp16 or 16-bit weights; default: "
                             "transformers' choice for the model)")
    parser.add_argument("--batch-size", type=positive_int, default=128,
                        help="texts per forward pass (default: 128)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1... (default: cuda if available, as "
                        "angle-train)")
    parser.add_argument("--base-model", default=None, metavar="BASE",
                        help="the base model (hub name or local folder) of a MODEL that is a LoRA adapter: a peft "
                        "adapter folder (default: the base its adapter_config.json names) or a LoRA run's "
                        "adapter-only best/ (default: the base it was trained on)")
    parser.add_argument("--json", dest="json_out", default=None, help="write the results there")
    parser.add_argument("--progress", type=parse_bool, nargs="?", const=True, default=None, metavar="0|1",
                        help="a progress bar per dataset on stderr, and transformers' own as the model loads "
                             "(default: when stderr is a terminal)")
    parser.add_argument("--debug", type=parse_bool, nargs="?", const=True, default=False, metavar="0|1",
                        help="show the traceback of a mistake in the arguments, files or data (default: one line)")
    parser.add_argument("--version", action="version", version=version_text("angle-eval"))
    return parser


def encoding_length(requested: int | None, meta: dict, encoder, tokenizer, model: str) -> int:
    """The tokens per text the evaluation encodes: --max-length, else the export's, else the max_seq_length of the
    sentence-transformers folder load_model found (encoder.st_files; as sentence-transformers encodes the model: it
    was 512 here, so a base model and its export were scored at different lengths), else 512; the last two no longer
    than the model's position limit. Checked before any text is encoded: within the position limit (as angle-train
    checks it) and with room for text beside the tokenizer's special tokens (preflight.check_tokenizer). A
    --max-length past a rotary model's trained context is noted on stderr, as angle-train notes it
    (models.past_trained_context_note)."""
    from .models import past_trained_context_note, position_limit

    limit = position_limit(encoder.backbone)
    st_files = None if meta else encoder.st_files
    own = (st_folder.max_seq_length(st_files) if st_files else None) or 512
    length = requested or meta.get("max_length") or min(own, limit or own)
    if limit is not None and length > limit:
        given = f"--max-length {length}" if requested else f"max_length {length} (the export's angle_train.json)"
        raise ValueError(f"{given} is longer than {model} can read: its position table holds {limit} positions; use "
                         f"--max-length {limit} or less")
    preflight.check_tokenizer(tokenizer, encoder, model, length)
    note = requested and past_trained_context_note(encoder.backbone, "--max-length", requested, model)
    if note:
        print(f"angle-eval: {note}", file=sys.stderr, flush=True)
    return length


def main(argv=None) -> int:
    """Evaluate as the arguments say. Exit status: 0 done; 1 a score is not finite; 2 a mistake in the arguments,
    files or data (one line on stderr, the traceback with --debug)."""
    parser = build_parser()
    args = parser.parse_args(argv)
    args.dims = [width for word in args.dims for width in word]  # each word's widths (widths_or_trained)
    with user_errors_exit(parser, debug=args.debug):
        check_train_extra()
        if args.bf16 and args.fp16:
            parser.error("choose at most one of --bf16 and --fp16")
        preflight.check_device(args.device)
        preflight.check_attention(args.attention, args.device)
        check_model(args.model)
        if args.revision is not None and not args.revision.strip():
            parser.error("--revision must name a branch, a tag or a commit of MODEL's repository; got an empty text")
        preflight.check_revision(args.revision, args.model, "MODEL", aside=" (an adapter's base loads at the "
                                 "revision its adapter_config.json records)")
        preflight.check_model_folder(args.model, "MODEL")
        adapter_base(args.model, args.base_model)  # a --base-model that would be ignored, before the datasets load
        columns = columns_of_paths(args.columns, args.paths)
        # a mapping of every PATH passes over such files, but one of the only PATH is for it alone
        per_path = ("give '' for this PATH (a mapping given out of the PATHs' order?)" if len(args.columns) > 1
                    else "leave out --columns" if len(args.paths) == 1 else None)
        datasets = []
        for path, mapping in zip(args.paths, columns):
            with errors_naming(path, "PATH"):
                datasets.append(read_dataset(path, columns=mapping, columns_refused=per_path))
        names = [dataset.name for dataset in datasets]
        if len(set(names)) != len(names):
            parser.error(f"two PATHs give datasets of the same name ({', '.join(names)}): pass each once")
        json_folder = os.path.dirname(os.path.abspath(args.json_out)) if args.json_out else None
        if json_folder and not os.path.isdir(json_folder):  # found out now, not after the evaluation
            raise FileNotFoundError(f"--json {args.json_out}: no folder {json_folder} to write it in")
        if args.json_out and os.path.isdir(args.json_out):  # the same: its write failed after the evaluation
            raise IsADirectoryError(f"--json {args.json_out}: a folder; give the path of a file to write, such as "
                                    f"{os.path.join(args.json_out, 'results.json')}")
        with library_progress_bars(args.progress):
            encoder, tokenizer, meta = load_model(args.model, pooling=args.pooling,
                                                  device=resolve_device(args.device), base_model=args.base_model,
                                                  trust_remote_code=args.trust_remote_code, revision=args.revision)
        if args.bf16 or args.fp16:
            encoder.autocast = "bf16" if args.bf16 else "fp16"
        if args.attention:
            use_attention(encoder, args.attention)
        autocast = f", forward autocast to {'bfloat16' if args.bf16 else 'float16'}" if encoder.autocast else ""
        print(f"angle-eval: pooling {encoder.pooling} ({encoder.pooling_source}), {encoder.attention_implementation} "
              f"attention{autocast}", file=sys.stderr, flush=True)
        first_token = first_token_pooling_problem(encoder, encoder.pooling_source)
        if first_token:  # refused as training refuses it, before a text is embedded (the score would be NaN or chance)
            raise ValueError(f"{first_token}; use --pooling last (decoders' default) or avg")
        saved = encoder.prompts
        encoder.prompts = Prompts(text=saved.text if args.prompt is None else args.prompt,
                                  query=saved.query if args.query_prompt is None else args.query_prompt,
                                  document=saved.document if args.doc_prompt is None else args.doc_prompt)
        dims = narrower_widths(args.dims, meta, encoder.embedding_dim, args.model)
        results = evaluate(encoder, tokenizer, datasets, batch_size=args.batch_size,
                           max_length=encoding_length(args.max_length, meta, encoder, tokenizer, args.model),
                           progress=args.progress, dims=dims)
        print(table(results, dims=dims))
        if args.json_out:  # strict JSON: an undefined score (constant cosines: NaN) is null
            with written_aside(args.json_out, encoding="utf-8") as f:  # the previous results, or these: never half
                json.dump(finite_or_none(results), f, indent=2, allow_nan=False)
                f.write("\n")
    unscored = [name for name, value in results.items() if not _all_finite(value)]
    for name in unscored:
        print(f"angle-eval: {name}: no score (NaN): the model's embeddings hold NaN or Inf, or their cosines are all "
              "equal", file=sys.stderr, flush=True)
    return 1 if unscored else 0


def _all_finite(value) -> bool:
    """Whether every number in `value` (a score, or a retrieval result's dict of them) is finite."""
    if isinstance(value, dict):
        return all(_all_finite(v) for v in value.values())
    return not isinstance(value, float) or math.isfinite(value)


if __name__ == "__main__":
    sys.exit(main())
