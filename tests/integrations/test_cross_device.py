"""gather_across_devices=True on the fused sentence-transformers drop-ins and on gist_loss, in 2 and 3 real
processes (gloo, CPU).

Each world size is spawned once (a module fixture); every rank holds its slice of one fixed float64 batch and
runs every case, then writes what it got. The tests then check, per case and rank:

* our in-batch drop-in (CASES) with gather_across_devices=True gives the sentence-transformers parent's loss
  (run in the same processes with the same options) and the same embedding gradients, to a relative 1e-10,
  and ran fused;
* one process on the concatenated batch without gathering (the parent class) gives the mean over ranks of
  the losses, and rank r's embedding gradient divided by the world size is that process's gradient of rank
  r's rows (what DDP's averaging of parameter gradients makes of the gather's summed backward);
* GIST (GIST_CASES: absolute and relative margins, contrast_anchors and contrast_positives on and off, no,
  one or two negative columns; guide embeddings narrower than the model's): gist_loss with
  gather_across_devices=True, and our GISTEmbedLoss (CachedGISTEmbedLoss for two negative columns) drop-in,
  give sentence-transformers' loss of the same class run in the same processes with gather_across_devices=
  True, value and gradients of the rank's anchors, positives and negatives, to a relative 1e-10; the guide
  removes, on every rank, some columns of other ranks (planted near-duplicates), so the filter is exercised
  across ranks; in one case (a negative margin) it keeps, on every rank, some rows' own anchor and positive
  columns, which the installed parent's rule (sentence-transformers >= 6.3 leaves them out) then decides;
* GIST without contrast_anchors: the one-process check above, against sentence-transformers' loss. With
  contrast_anchors it does not hold: the anchors are not gathered, so a rank's anchor-anchor block holds its
  own anchors only (in sentence-transformers as here);
* angle_kernels.distributed.all_gather_with_grad, by the list all_gather and all_reduce (gloo's) and by the
  single-tensor all_gather and reduce-scatter (NCCL's): values, the gradient (the sum over ranks of the
  cotangents of the rank's rows), no in-place change of a cotangent another branch also receives, and unequal row
  counts, row shapes or dtypes refused with a ValueError on every rank (no hang: the group still works);
* the fused path with gathering never makes a tensor of the full B x (world_size * B * columns) score matrix
  (every tensor recorded by a dispatch mode during forward and backward, with the op's tile shrunk below B
  rows, is embedding-shaped or at most one tile), while the parent's path does.

The losses run their own forward: the in-batch ones on an identity "model" whose input is the embedding, the
GIST ones on stubs whose outputs are given embeddings (the model's the leaf "x", the guide's "g"; both carry
the same tokenizer and maximum length, as GIST's constructors require, so nothing is re-tokenised). So the
cached losses run their whole GradCache path (embed without gradients, loss and backward to the cached
embeddings, re-embed and inject), and the gradient of the leaf is the embedding gradient.
"""

from __future__ import annotations

import contextlib
import datetime
import os

import pytest
import torch

from angle_kernels.testing.helpers import ShapeRecorder, outputs_of_ranks
from angle_kernels.testing.oracle import rel_err

pytest.importorskip("sentence_transformers")

ROWS = 4  # per rank
DIM = 6
TOL = 1e-10
SYMMETRIC = {"directions": ("query_to_doc", "doc_to_query"), "partition_mode": "per_direction"}

# name: (class name, constructor kwargs, columns: queries, positives, then hard-negative columns)
CASES = {
    "mnrl": ("MultipleNegativesRankingLoss", {}, 2),
    "mnrl_hard_negative": ("MultipleNegativesRankingLoss", {"scale": 10.0}, 3),
    "mnrl_symmetric": ("MultipleNegativesRankingLoss", SYMMETRIC, 3),
    "cached": ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 3}, 3),
    "cached_symmetric": ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 2, **SYMMETRIC}, 2),
    # the symmetric classes, which pass gather_across_devices on to the parent themselves
    "mnsrl": ("MultipleNegativesSymmetricRankingLoss", {}, 2),
    "cached_mnsrl": ("CachedMultipleNegativesSymmetricRankingLoss", {"mini_batch_size": 3}, 2),
    # the similarity_lse path: every direction in one partition, hardness on the own hard negatives
    "mnrl_gte_hard": ("MultipleNegativesRankingLoss", {"directions": ("query_to_doc", "query_to_query",
                                                                      "doc_to_query", "doc_to_doc"),
                                                       "hardness_mode": "hard_negatives", "hardness_strength": 3.0}, 3),
    "cached_in_batch_hardness": ("CachedMultipleNegativesRankingLoss", {"mini_batch_size": 3,
                                                                        "hardness_mode": "in_batch_negatives",
                                                                        "hardness_strength": 5.0}, 2),
}

# GIST at the functional level. name: (gist_loss options, negative columns). sentence-transformers' GISTEmbedLoss
# takes at most one negative column; its CachedGISTEmbedLoss (the same loss, computed by mini-batches of
# GIST_MINI_BATCH anchors) takes several, so it is the reference of the case with two.
GUIDE_DIM = 5
GIST_MINI_BATCH = 3
GIST_CASES = {
    "gist_pairs": ({"temperature": 0.05}, 0),
    "gist_relative_negative": ({"margin_strategy": "relative", "margin": 0.1, "contrast_anchors": False}, 1),
    "gist_absolute_negative": ({"margin": 0.05, "contrast_positives": False, "temperature": 0.02}, 1),
    "gist_two_negatives": ({"margin_strategy": "relative", "margin": -0.05, "contrast_anchors": False,
                            "contrast_positives": False, "temperature": 0.05}, 2),
    # the threshold reaches 1 on some rows of every rank: the filter keeps their own anchor and positive columns,
    # which sentence-transformers >= 6.3 leaves out (the anchor-anchor block's local, the positive-positive's gathered)
    "gist_own_columns": ({"margin": -0.15, "temperature": 0.05}, 0),
}

# The score-matrix check: B rows per rank, queries, positives and one negative column; the torch backend's
# tile is cut to CHUNK_ELEMENTS elements, fewer than B rows of the (world_size * 2B)-column matrix.
MEMORY_ROWS, MEMORY_DIM, MEMORY_CHUNK = 6, 7, 48


def batch(world: int, columns: int, rows: int = ROWS, dim: int = DIM, seed: int = 0) -> list[torch.Tensor]:
    """The whole batch: `columns` float64 tensors of world * rows rows (rank r holds rows r*rows..)."""
    gen = torch.Generator().manual_seed(1000 * seed + 10 * world + columns)
    return [torch.randn(world * rows, dim, generator=gen, dtype=torch.float64) for _ in range(columns)]


class _Embed(torch.nn.Module):
    """The identity as a sentence "model": the feature "x" is the embedding (a leaf the test reads .grad of)."""

    def forward(self, features):
        return {"sentence_embedding": features["x"] * 1.0}


def identity_model():
    return torch.nn.Sequential(_Embed())  # the cached loss indexes model[0]


def loss_and_grads(loss, columns: list[torch.Tensor]):
    """The loss value and the gradient of each embedding column, through the loss's own entry point: the
    cached loss's forward (GradCache) or compute_loss_from_embeddings."""
    leaves = [c.clone().requires_grad_(True) for c in columns]
    if hasattr(loss, "calculate_loss"):
        value = loss([{"x": x} for x in leaves], None)
    else:
        value = loss.compute_loss_from_embeddings(leaves, None)
    value.backward()
    return value.detach(), [x.grad for x in leaves]


def _st_losses():
    try:
        from sentence_transformers.sentence_transformer import losses
    except ImportError:  # pragma: no cover - older layout
        from sentence_transformers import losses
    return losses


def gist_batch(world: int, negatives: int, rows: int = ROWS) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The whole GIST batch, world * rows float64 rows a column (rank r holds rows r*rows..): the model's
    anchors, positives and `negatives` negative columns (DIM wide) and the guide's (GUIDE_DIM wide). The guide
    repeats, nearly, anchor i (every even i) as another rank's positive and as a negative of another row, so
    that it removes columns on every rank, columns of other ranks among them."""
    n = world * rows
    gen = torch.Generator().manual_seed(500 + 10 * world + negatives)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    anchors, guide_anchors = randn(n, DIM), randn(n, GUIDE_DIM)
    model = [anchors, anchors + 1.5 * randn(n, DIM), *(randn(n, DIM) for _ in range(negatives))]
    guide = [guide_anchors, guide_anchors + 0.5 * randn(n, GUIDE_DIM), *(randn(n, GUIDE_DIM) for _ in range(negatives))]
    for i in range(0, n, 2):  # positive i + rows + 1 is on the next rank; negative i + rows + 1 + k on any
        for k, column in enumerate(guide[1:]):
            column[(i + rows + 1 + k) % n] = guide_anchors[i] + 0.01 * randn(GUIDE_DIM)
    return model, guide


def _guide_thresholds(world: int, case: str) -> tuple[list[torch.Tensor], torch.Tensor, torch.Tensor]:
    """The whole batch's unit guide columns (anchors, positives, negatives...), each row's filter threshold (from the
    guide's anchor-positive similarity g and the case's margin, GISTEmbed's rule) and the rank owning each row."""
    options, negatives = GIST_CASES[case]
    unit = [torch.nn.functional.normalize(g, dim=1) for g in gist_batch(world, negatives)[1]]
    g = (unit[0] * unit[1]).sum(1)
    margin = options.get("margin", 0.0)
    threshold = g - g.abs() * margin if options.get("margin_strategy") == "relative" else g - margin
    return unit, threshold, torch.arange(world * ROWS) // ROWS


def removed_from_other_ranks(world: int, case: str) -> list[int]:
    """Per rank: how many (row, column) pairs of its rows' positive-positive, anchor-positive and
    anchor-negative blocks the guide removes with a column of another rank (GISTEmbed's rule, on the whole
    batch): the gathered comparisons exercise the filter across ranks only when this is not zero."""
    unit, threshold, owner = _guide_thresholds(world, case)
    blocks = [unit[0] @ unit[1].T, *(unit[0] @ u.T for u in unit[2:])]
    if GIST_CASES[case][0].get("contrast_positives", True):
        blocks.append(unit[1] @ unit[1].T)
    other_rank = owner[:, None] != owner[None, :]  # never a row's own positive
    removed = sum((block > threshold[:, None]) & other_rank for block in blocks)
    return [int(removed[owner == rank].sum()) for rank in range(world)]


def rows_keeping_their_own_columns(world: int, case: str) -> list[int]:
    """Per rank: how many of its rows have a threshold of at least 1, so that the guide's filter keeps their own
    column of the anchor-anchor and positive-positive blocks (guide similarity 1); only self_negatives decides."""
    _, threshold, owner = _guide_thresholds(world, case)
    return [int((threshold[owner == rank] >= 1).sum()) for rank in range(world)]


def _tokenizer():
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")))


class _Given(torch.nn.Module):
    """A sentence "model" whose embedding is the feature `key`."""

    def __init__(self, key: str):
        super().__init__()
        self.key = key

    def forward(self, features):
        return {"sentence_embedding": features[self.key] * 1.0}


def given(key: str, tokenizer) -> torch.nn.Sequential:
    """The model ("x": the embedding, a leaf the test reads .grad of) or the guide ("g") of the GIST losses, with
    the tokenizer and maximum length their constructors ask for: the same for both, so nothing is re-tokenised
    and the guide embeds the features the model does."""
    model = torch.nn.Sequential(_Given(key))  # the cached loss indexes model[0]
    model.tokenizer, model.max_seq_length = tokenizer, 16
    return model


def gist_class(negatives: int) -> tuple[str, dict]:
    """The sentence-transformers class that takes `negatives` negative columns, and its extra arguments."""
    return ("GISTEmbedLoss", {}) if negatives <= 1 else ("CachedGISTEmbedLoss", {"mini_batch_size": GIST_MINI_BATCH})


def gist_loss_and_grads(loss, model: list[torch.Tensor], guide: list[torch.Tensor]):
    """The loss value and the gradient of each model column, through the loss's forward (the cached one's whole
    GradCache path) on the given embeddings."""
    leaves = [c.clone().requires_grad_(True) for c in model]
    value = loss([{"x": x, "g": g} for x, g in zip(leaves, guide)], None)
    value.backward()
    return value.detach(), [x.grad for x in leaves]


# --------------------------------------------------------------------------------------------------------
# What each rank runs
# --------------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def counting(function: str):
    """Counts (the yielded list's length) the calls of the loss formula `function` (angle_kernels.losses), the
    computing half of the drop-ins' fused path."""
    import pytest

    from angle_kernels import terms
    from angle_kernels.testing.helpers import patch_formula

    calls, original = [], getattr(terms, function)

    def counted(*args, **kwargs):
        calls.append(None)
        return original(*args, **kwargs)

    with pytest.MonkeyPatch.context() as monkeypatch:
        patch_formula(monkeypatch, function, counted)
        yield calls


def _rank_cases(rank: int, world: int) -> dict:
    from angle_kernels.integrations import sentence_transformers as ours

    st_losses = _st_losses()
    out = {}
    with counting("multiple_negatives") as calls:
        for name, (class_name, kwargs, columns) in CASES.items():
            local = [c[rank * ROWS:(rank + 1) * ROWS] for c in batch(world, columns)]
            drop_in = getattr(ours, class_name)(identity_model(), gather_across_devices=True, **kwargs)
            parent = getattr(st_losses, class_name)(identity_model(), gather_across_devices=True, **kwargs)
            calls.clear()
            got = loss_and_grads(drop_in, local)
            fused_calls = len(calls)
            ref = loss_and_grads(parent, local)
            assert len(calls) == fused_calls  # the parent never reaches our code
            out[name] = {"ours": got, "parent": ref, "fused_calls": fused_calls,
                         "uses_fused_path": drop_in.uses_fused_path}
    return out


def _rank_gist(rank: int, world: int) -> dict:
    """Per case: gist_loss with gather_across_devices=True, sentence-transformers' loss (GISTEmbedLoss, or
    CachedGISTEmbedLoss for two negative columns) and our drop-in of it, each with its value and the gradients
    of the rank's model columns."""
    import angle_kernels.functional as ak_functional
    from angle_kernels.integrations import sentence_transformers as ours

    st_losses, tokenizer = _st_losses(), _tokenizer()
    out = {}
    for name, (options, negatives) in GIST_CASES.items():
        model, guide = ([c[rank * ROWS:(rank + 1) * ROWS] for c in side] for side in gist_batch(world, negatives))
        leaves = [c.clone().requires_grad_(True) for c in model]
        value = ak_functional.gist_loss(leaves[0], leaves[1], guide[0], guide[1], leaves[2:], guide[2:],
                                        self_negatives=ours._PARENT_GIST_SELF_NEGATIVES, gather_across_devices=True,
                                        **options)
        value.backward()
        class_name, extra = gist_class(negatives)
        losses = {label: getattr(module, class_name)(given("x", tokenizer), given("g", tokenizer),
                                                     gather_across_devices=True, **extra, **options)
                  for label, module in (("parent", st_losses), ("drop_in", ours))}
        with counting("gist") as calls:
            parent = gist_loss_and_grads(losses["parent"], model, guide)
            parent_calls = len(calls)
            drop_in = gist_loss_and_grads(losses["drop_in"], model, guide)
        out[name] = {"functional": (value.detach(), [x.grad for x in leaves]), "parent": parent,
                     "drop_in": drop_in, "parent_calls": parent_calls, "fused_calls": len(calls) - parent_calls}
    return out


def _rank_gather(rank: int, world: int) -> dict:
    from angle_kernels import distributed
    from angle_kernels.distributed import all_gather_with_grad

    out = {}
    # both ways of the collectives: the list all_gather and all_reduce (gloo's, by default), and the single-tensor
    # all_gather and reduce-scatter of the SINGLE_TENSOR_BACKENDS (NCCL's), which gloo has too
    for way, backends in (("list", distributed.SINGLE_TENSOR_BACKENDS), ("single", ("gloo",))):
        called = []
        with pytest.MonkeyPatch.context() as monkeypatch:
            monkeypatch.setattr(distributed, "SINGLE_TENSOR_BACKENDS", backends)
            original = distributed._collective
            monkeypatch.setattr(distributed, "_collective",
                                lambda single, older: called.append(single) or original(single, older))
            x = (torch.arange(2 * 3, dtype=torch.float64).view(2, 3) + 10 * rank).requires_grad_(True)
            cotangent = gather_cotangent(rank, world)
            side = torch.zeros(2 * world, 3, dtype=torch.float64, requires_grad=True)
            side_branch = side * 1.0  # made before the gather: autograd runs the gather's backward first
            gathered = all_gather_with_grad(x)
            ((gathered + side_branch) * cotangent).sum().backward()  # the addition hands one cotangent to both
        out[way] = {"value": gathered.detach(), "grad": x.grad, "side_grad": side.grad, "called": called}

    refusals = {}
    for what, tensor in (("rows", torch.zeros(rank + 1, 3)), ("row shape", torch.zeros(2, 3 + rank)),
                         ("dtype", torch.zeros(2, 3, dtype=torch.float64 if rank else torch.float32))):
        try:
            all_gather_with_grad(tensor)
            refusals[what] = None
        except ValueError as exc:
            refusals[what] = str(exc)
    out["refusals"] = refusals
    out["after"] = all_gather_with_grad(torch.full((1, 2), float(rank))).detach()  # the group still works

    # the tensors multiple_negatives_ranking_loss gathers: the queries only where a direction scores them
    import angle_kernels.functional as ak_functional

    q, p, n = (c[rank * ROWS:(rank + 1) * ROWS] for c in batch(world, 3))
    gathers = {}
    for directions in (("query_to_doc",), ("query_to_doc", "query_to_query"), ("query_to_doc", "doc_to_query")):
        rows = []
        with pytest.MonkeyPatch.context() as monkeypatch:
            apply = distributed._AllGatherWithGrad.apply
            monkeypatch.setattr(distributed._AllGatherWithGrad, "apply", lambda t: rows.append(t) or apply(t))
            ak_functional.multiple_negatives_ranking_loss(q, p, (n,), directions=directions,
                                                          gather_across_devices=True)
        gathers[directions] = [next(name for name, c in (("q", q), ("p", p), ("n", n)) if c is t) for t in rows]
    out["gathers"] = gathers
    return out


def _rank_refusals(rank: int, world: int) -> dict:
    """Inputs that one rank alone refuses (or that differ between ranks) in the losses that gather: every rank must
    raise, none be left waiting in a collective (the group's 60 s timeout would turn a wait into another error)."""
    import angle_kernels.functional as ak_functional

    (anchors, positives, negative), (guide_anchors, guide_positives, guide_negative) = (
        [c[rank * ROWS:(rank + 1) * ROWS] for c in side] for side in gist_batch(world, 1))
    last = rank == world - 1
    calls = {
        # GIST's anchors and guide_anchors are not gathered: only their own rank can see what is wrong with them
        "gist_nan_anchor": lambda: ak_functional.gist_loss(
            anchors.clone().index_fill_(0, torch.tensor([1]), float("nan")) if last else anchors, positives,
            guide_anchors, guide_positives, gather_across_devices=True),
        "gist_short_guide_anchors": lambda: ak_functional.gist_loss(
            anchors, positives, guide_anchors[:-1] if rank == 0 else guide_anchors, guide_positives,
            gather_across_devices=True),
        # as many hard-negative columns on every rank, or the ranks' gathers no longer pair up
        "mnrl_negative_columns": lambda: ak_functional.multiple_negatives_ranking_loss(
            anchors, positives, (negative,) if rank == 0 else (), gather_across_devices=True),
        # query_to_doc leaves the queries on their rank: checked there, before the gathers
        "mnrl_nan_query": lambda: ak_functional.multiple_negatives_ranking_loss(
            anchors.clone().index_fill_(0, torch.tensor([1]), float("nan")) if last else anchors, positives,
            gather_across_devices=True),
        "mnrl_rows": lambda: ak_functional.multiple_negatives_ranking_loss(
            anchors[:-1] if last else anchors, positives[:-1] if last else positives, gather_across_devices=True),
    }
    # refused by the checks that run before the gathers (the options, the structure of the arguments)
    calls.update({
        "mnrl_scale": lambda: ak_functional.multiple_negatives_ranking_loss(
            anchors, positives, scale=float("nan") if last else 20.0, gather_across_devices=True),
        "mnrl_directions": lambda: ak_functional.multiple_negatives_ranking_loss(
            anchors, positives, directions=("query_to_dok",) if last else ("query_to_doc",),
            gather_across_devices=True),
        "mnrl_negatives_not_a_list": lambda: ak_functional.multiple_negatives_ranking_loss(
            anchors, positives, negative if last else (negative,), gather_across_devices=True),
        "gist_temperature": lambda: ak_functional.gist_loss(
            anchors, positives, guide_anchors, guide_positives, temperature=0.0 if last else 0.05,
            gather_across_devices=True),
    })
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = None
        except (TypeError, ValueError) as exc:
            out[name] = str(exc)
    fine = ak_functional.gist_loss(anchors, positives, guide_anchors, guide_positives, (negative,),
                                   (guide_negative,), gather_across_devices=True)
    out["after"] = bool(torch.isfinite(fine))  # the group still works
    return out


def _rank_score_shapes(rank: int, world: int) -> dict:
    """Shapes of the 2-D tensors that are neither embedding-shaped ([rows, D], or its transpose) nor at most
    one tile."""
    import angle_kernels.torch_ops.common as torch_common
    from angle_kernels.integrations import sentence_transformers as ours

    st_losses = _st_losses()
    local = [c[rank * MEMORY_ROWS:(rank + 1) * MEMORY_ROWS]
             for c in batch(world, 3, rows=MEMORY_ROWS, dim=MEMORY_DIM, seed=1)]
    saved = torch_common.CHUNK_ELEMENTS
    torch_common.CHUNK_ELEMENTS = MEMORY_CHUNK
    out = {}
    try:
        for label, cls in (("ours", ours.MultipleNegativesRankingLoss),
                           ("parent", st_losses.MultipleNegativesRankingLoss)):
            loss = cls(identity_model(), gather_across_devices=True, **SYMMETRIC)
            leaves = [c.clone().requires_grad_(True) for c in local]
            recorder = ShapeRecorder()
            with recorder.mode:
                value = loss.compute_loss_from_embeddings(leaves, None)
                recorder.phase = "backward"
                value.backward()
            shapes = [(phase, s) for phase, s in recorder.shapes if len(s) == 2 and MEMORY_DIM not in s]
            out[label] = {
                "too_big": sorted({s for _, s in shapes if s[0] * s[1] > MEMORY_CHUNK}),
                "tiles": sum(1 for _, s in shapes if s[0] < MEMORY_ROWS),  # row blocks (forward or backward)
            }
    finally:
        torch_common.CHUNK_ELEMENTS = saved
    return out


def _rank_main(rank: int, world: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    # a timeout turns a rank left waiting in a collective into an error instead of a hung test run
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    try:
        result = {"cases": _rank_cases(rank, world), "gist": _rank_gist(rank, world),
                  "gather": _rank_gather(rank, world), "refusals": _rank_refusals(rank, world),
                  "shapes": _rank_score_shapes(rank, world)}
        torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()  # no rank tears gloo down while another still talks to it
    finally:
        dist.destroy_process_group()


def gather_cotangent(rank: int, world: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(77 + rank)
    return torch.randn(2 * world, 3, generator=gen, dtype=torch.float64)


# --------------------------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[2, 3], ids=["world2", "world3"])
def ranks(request, tmp_path_factory):
    """(world size, [what each rank wrote]): the processes run once per world size."""
    world = request.param
    out_dir = tmp_path_factory.mktemp(f"cross_device_{world}")
    return world, outputs_of_ranks(_rank_main, out_dir, world)


@pytest.mark.parametrize("case", list(CASES))
def test_same_loss_and_embedding_gradients_as_the_parent_on_every_rank(ranks, case):
    world, results = ranks
    for rank, result in enumerate(results):
        got = result["cases"][case]
        assert got["uses_fused_path"] and got["fused_calls"] > 0, "the fused path did not run"
        (value, grads), (ref_value, ref_grads) = got["ours"], got["parent"]
        assert rel_err(value, ref_value) < TOL, (rank, value.item(), ref_value.item())
        assert len(grads) == len(ref_grads) == CASES[case][2]
        for column, (grad, ref) in enumerate(zip(grads, ref_grads)):
            assert rel_err(grad, ref) < TOL, f"rank {rank}, column {column}: {rel_err(grad, ref):.2e}"


@pytest.mark.parametrize("case", list(CASES))
def test_ranks_together_equal_one_process_on_the_whole_batch(ranks, case):
    world, results = ranks
    class_name, kwargs, columns = CASES[case]
    single = getattr(_st_losses(), class_name)(identity_model(), **kwargs)  # no gathering, one process
    value, grads = loss_and_grads(single, batch(world, columns))
    mean = torch.stack([result["cases"][case]["ours"][0] for result in results]).mean()
    assert rel_err(mean, value) < TOL, (mean.item(), value.item())
    for rank, result in enumerate(results):
        for column, grad in enumerate(result["cases"][case]["ours"][1]):
            ref = grads[column][rank * ROWS:(rank + 1) * ROWS]
            assert rel_err(grad / world, ref) < TOL, f"rank {rank}, column {column}"


@pytest.mark.parametrize("case", list(GIST_CASES))
def test_gist_same_loss_and_embedding_gradients_as_sentence_transformers_on_every_rank(ranks, case):
    world, results = ranks
    removed = removed_from_other_ranks(world, case)
    own_kept = rows_keeping_their_own_columns(world, case)
    for rank, result in enumerate(results):
        assert removed[rank] > 0, f"rank {rank}: the guide removes no column of another rank"
        if case == "gist_own_columns":
            assert own_kept[rank] > 0, f"rank {rank}: the filter drops every row's own column"
        got = result["gist"][case]
        assert got["parent_calls"] == 0 and got["fused_calls"] > 0, "the drop-in did not run fused"
        ref_value, ref_grads = got["parent"]
        assert len(ref_grads) == 2 + GIST_CASES[case][1]
        for label in ("functional", "drop_in"):
            value, grads = got[label]
            assert rel_err(value, ref_value) < TOL, (label, rank, value.item(), ref_value.item())
            assert len(grads) == len(ref_grads)
            for column, (grad, ref) in enumerate(zip(grads, ref_grads)):
                assert rel_err(grad, ref) < TOL, f"{label}, rank {rank}, column {column}: {rel_err(grad, ref):.2e}"


# The anchors are not gathered, so a rank's anchor-anchor block holds its own anchors only: with contrast_anchors
# the ranks together are not one process on the whole batch (in sentence-transformers as here).
@pytest.mark.parametrize("case", [name for name, (options, _) in GIST_CASES.items()
                                  if not options.get("contrast_anchors", True)])
def test_gist_ranks_together_equal_one_process_on_the_whole_batch(ranks, case):
    world, results = ranks
    options, negatives = GIST_CASES[case]
    class_name, extra = gist_class(negatives)
    tokenizer = _tokenizer()
    single = getattr(_st_losses(), class_name)(given("x", tokenizer), given("g", tokenizer), **extra, **options)
    value, grads = gist_loss_and_grads(single, *gist_batch(world, negatives))  # no gathering, one process
    mean = torch.stack([result["gist"][case]["functional"][0] for result in results]).mean()
    assert rel_err(mean, value) < TOL, (mean.item(), value.item())
    for rank, result in enumerate(results):
        for column, grad in enumerate(result["gist"][case]["functional"][1]):
            ref = grads[column][rank * ROWS:(rank + 1) * ROWS]
            assert rel_err(grad / world, ref) < TOL, f"rank {rank}, column {column}"


def test_all_gather_with_grad(ranks):
    world, results = ranks
    rows = [torch.arange(6, dtype=torch.float64).view(2, 3) + 10 * r for r in range(world)]
    cotangents = [gather_cotangent(r, world) for r in range(world)]
    for rank, result in enumerate(results):
        got = result["gather"]
        for way, collectives in (("list", []), ("single", ["all_gather_single", "reduce_scatter_single"])):
            assert got[way]["called"] == collectives, (way, got[way]["called"])
            assert torch.equal(got[way]["value"], torch.cat(rows)), way
            expected = sum(c[2 * rank:2 * rank + 2] for c in cotangents)
            assert rel_err(got[way]["grad"], expected) < 1e-15, way
            assert torch.equal(got[way]["side_grad"], cotangents[rank]), f"{way}: the backward changed a cotangent"
        refusals = got["refusals"]
        assert refusals["rows"] is not None and f"rows per rank {list(range(1, world + 1))}" in refusals["rows"]
        assert refusals["row shape"] is not None and "row shape" in refusals["row shape"]
        assert refusals["dtype"] is not None and "dtypes that differ" in refusals["dtype"]
        assert torch.equal(got["after"], torch.arange(world, dtype=torch.float32)[:, None].expand(world, 2))
        # the queries were gathered for query_to_doc too, which scores no other rank's queries
        assert got["gathers"] == {("query_to_doc",): ["p", "n"], ("query_to_doc", "query_to_query"): ["q", "p", "n"],
                                  ("query_to_doc", "doc_to_query"): ["q", "p", "n"]}, got["gathers"]


def test_a_refusal_on_one_rank_is_a_refusal_on_every_rank(ranks):
    """Before: GIST's checks of the anchors and guide_anchors (not gathered) ran on each rank alone after the
    gathers, so the rank with a NaN or a short guide tensor raised and the others waited in backward's collective
    (a 30-minute timeout by default); a different count of hard-negative columns left every rank waiting."""
    world, results = ranks
    for rank, result in enumerate(results):
        got = result["refusals"]
        last = rank == world - 1
        nan = got["gist_nan_anchor"]
        assert nan is not None, rank
        assert ("anchors contains NaN" in nan) if last else (f"rank(s) [{world - 1}] refused" in nan), (rank, nan)
        short = got["gist_short_guide_anchors"]
        assert short is not None, rank
        assert ("guide_anchors must have the anchors' 4 rows, got 3" in short) if rank == 0 else (
            "rank(s) [0] refused" in short), (rank, short)
        counts = got["mnrl_negative_columns"]
        # the documents only: query_to_doc scores no other rank's queries, so they are not gathered
        assert counts is not None and f"tensors per rank {[2] + [1] * (world - 1)}" in counts, (rank, counts)
        nan = got["mnrl_nan_query"]
        assert nan is not None, rank
        assert ("queries contains NaN" in nan) if last else (f"rank(s) [{world - 1}] refused" in nan), (rank, nan)
        rows = got["mnrl_rows"]
        assert rows is not None and f"rows per rank {[ROWS] * (world - 1) + [ROWS - 1]}" in rows, (rank, rows)
        assert got["after"]


def test_a_refusal_before_the_gathers_on_one_rank_is_a_refusal_on_every_rank(ranks):
    """Before: the checks that run before the gathers (the scale, the directions, the list of negative columns, GIST's
    temperature) raised on the rank that refused alone, and the others waited for it in the gathers' first
    collective until the process group's timeout. Now the refusal joins that collective: every rank raises."""
    world, results = ranks
    own = {"mnrl_scale": "scale must be finite, got nan", "mnrl_directions": "directions must be a non-empty tuple",
           "mnrl_negatives_not_a_list": "negatives must be a tuple or list",
           "gist_temperature": "temperature must be > 0, got 0.0"}
    for rank, result in enumerate(results):
        for case, message in own.items():
            got = result["refusals"][case]
            assert got is not None, (rank, case)
            expected = message if rank == world - 1 else f"rank(s) [{world - 1}] refused"
            assert expected in got, (rank, case, got)
        assert result["refusals"]["after"]  # the group still works


def test_gathering_without_a_process_group_says_so_once(monkeypatch):
    """gather_across_devices=True where torch.distributed is not initialised (a job whose process group was never
    set up) computes this process's loss, as sentence-transformers' gathering does, with a warning, once."""
    import warnings

    import angle_kernels as ak
    from angle_kernels import distributed

    monkeypatch.setattr(distributed, "_warned_not_distributed", False)
    q, p, g = torch.randn(3, 4, 6, generator=torch.Generator().manual_seed(9), dtype=torch.float64).unbind(0)
    with pytest.warns(UserWarning, match="gather_across_devices=True, but torch.distributed is not initialised"):
        gathered = ak.multiple_negatives_ranking_loss(q, p, gather_across_devices=True)
    assert gathered == ak.multiple_negatives_ranking_loss(q, p)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ak.gist_loss(q, p, g, p, gather_across_devices=True) == ak.gist_loss(q, p, g, p)


def test_all_gather_with_grad_is_the_identity_without_a_process_group():
    from angle_kernels.distributed import all_gather_with_grad, rank_and_world_size

    x = torch.randn(3, 2, requires_grad=True)
    assert all_gather_with_grad(x) is x and rank_and_world_size() == (0, 1)
    with pytest.raises(TypeError, match="torch.Tensor"):
        all_gather_with_grad([1.0, 2.0])


def test_gathered_fused_path_never_builds_the_score_matrix(ranks):
    world, results = ranks
    full = (MEMORY_ROWS, world * MEMORY_ROWS * 2)  # this rank's queries x (all positives and negatives)
    for rank, result in enumerate(results):
        ours, parent = result["shapes"]["ours"], result["shapes"]["parent"]
        assert ours["too_big"] == [], f"rank {rank}: the fused path made {ours['too_big']}"
        assert ours["tiles"] > 0, "the recorder saw no tile of a row block"
        assert full in parent["too_big"], "the recorder missed the parent's score matrix"


def test_gathering_is_fused_and_only_other_similarities_fall_back():
    from angle_kernels.integrations import sentence_transformers as ours
    from sentence_transformers import util as st_util

    model = identity_model()
    for cls in (ours.MultipleNegativesRankingLoss, ours.CachedMultipleNegativesRankingLoss):
        assert cls(model, gather_across_devices=True).uses_fused_path
        assert cls(model, gather_across_devices=True, **SYMMETRIC).uses_fused_path
        assert cls(model, gather_across_devices=True, hardness_mode="all_negatives",
                   hardness_strength=2.0).uses_fused_path
        assert cls(model, gather_across_devices=True, directions=("query_to_doc", "doc_to_query")).uses_fused_path
        assert cls(model, gather_across_devices=True, similarity_fct=st_util.dot_score).uses_fused_path
        assert not cls(model, gather_across_devices=True, similarity_fct=st_util.euclidean_sim).uses_fused_path


@pytest.mark.parametrize("backend, cuda, single", [
    ("nccl", True, True), ("gloo", False, False), ("gloo", True, False), ("mpi", True, False),
    # init_process_group() without a backend: per device, or not chosen before the first collective ("undefined"),
    # where NCCL serves CUDA tensors (the list collectives took them: twice the backward's bytes)
    ("cpu:gloo,cuda:nccl", True, True), ("cpu:gloo,cuda:nccl", False, False), ("undefined", True, True),
    ("undefined", False, False),
])
def test_the_single_tensor_collectives_serve_nccls_cuda_tensors(monkeypatch, backend, cuda, single):
    import types

    import torch.distributed as dist

    from angle_kernels import distributed

    monkeypatch.setattr(dist, "get_backend", lambda group=None: backend)
    assert distributed._single_tensor_collectives(types.SimpleNamespace(is_cuda=cuda)) is single


# --------------------------------------------------------------------------------------------------------
# Ranks that call a gathering loss differently: two processes of their own (the last case needs a short timeout)
# --------------------------------------------------------------------------------------------------------
ONE_SIDED_TIMEOUT_S = 2


def _rank_configurations(rank: int, world: int, store: str, out_dir: str) -> None:
    """Each case calls a gathering loss with options (or gradients) that differ between the ranks, and records what
    each rank raised; then, in a group with a short timeout, rank 0 gathers while rank 1 does not."""
    import time

    import torch.distributed as dist

    import angle_kernels.functional as ak_functional
    from angle_kernels.integrations import sentence_transformers as ours

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    q, p, n = (c[rank * ROWS:(rank + 1) * ROWS] for c in batch(world, 3))
    (anchors, positives), (guide_anchors, guide_positives) = (
        [c[rank * ROWS:(rank + 1) * ROWS] for c in side] for side in gist_batch(world, 0))
    first = rank == 0

    def mnrl(**options):
        leaves = [c.clone().requires_grad_(True) for c in (q, p, n)]
        value = ak_functional.multiple_negatives_ranking_loss(leaves[0], leaves[1], (leaves[2],),
                                                              gather_across_devices=True, **options)
        if value.requires_grad:  # the gather's backward collectives too: a wait there would be a timeout
            value.backward()
        return value

    def without_gradients_on_rank_0():
        with torch.no_grad() if first else contextlib.nullcontext():
            return mnrl()

    calls = {
        # the same tensors gathered (the queries, for either direction), another loss
        "directions": lambda: mnrl(directions=("query_to_doc", "query_to_query") if first
                                   else ("query_to_doc", "doc_to_query")),
        # the queries gathered on rank 1 only
        "directions_gathers": lambda: mnrl(directions=("query_to_doc",) if first else ("query_to_doc", "doc_to_query")),
        "scale": lambda: mnrl(scale=20.0 if first else 10.0),
        "hardness": lambda: mnrl(hardness_mode="in_batch_negatives" if first else None,
                                 hardness_strength=5.0 if first else 0.0),
        "gist_contrast_anchors": lambda: ak_functional.gist_loss(
            anchors, positives, guide_anchors, guide_positives, contrast_anchors=first, gather_across_devices=True),
        "drop_in_scale": lambda: ours.MultipleNegativesRankingLoss(
            identity_model(), scale=20.0 if first else 10.0, gather_across_devices=True).compute_loss_from_embeddings(
            [q, p], None),
        # rank 0 would make no backward collective: rank 1 would wait in its own
        "gradients": without_gradients_on_rank_0,
        # allowed: the widths make no collective (MatryoshkaLoss's n_dims_per_step draws them on each rank)
        "dims": lambda: mnrl(dims=(3, 6) if first else (2, 6)),
    }
    out = {}
    for name, call in calls.items():
        try:
            out[name] = ("ok", bool(torch.isfinite(call())))
        except (TypeError, ValueError) as exc:
            out[name] = (type(exc).__name__, str(exc))
    out["after"] = bool(torch.isfinite(mnrl()))  # the group still works
    dist.barrier()
    dist.destroy_process_group()

    # gathering on rank 0 only: rank 1 never joins; rank 0's wait ends at the group's timeout, with a message
    dist.init_process_group("gloo", init_method=f"file://{store}-one-sided", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=ONE_SIDED_TIMEOUT_S))
    done = os.path.join(out_dir, "one_sided_done")
    try:
        value = ak_functional.multiple_negatives_ranking_loss(q, p, gather_across_devices=first)
        out["one_sided"] = ("ok", bool(torch.isfinite(value)))
    except RuntimeError as exc:
        out["one_sided"] = (type(exc).__name__, str(exc))
    if first:
        open(done, "w").close()
    else:  # stays in the group (no collective) until rank 0 has timed out, as a rank busy training would
        deadline = time.monotonic() + 30
        while not os.path.exists(done) and time.monotonic() < deadline:
            time.sleep(0.05)
    torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    with contextlib.suppress(RuntimeError):  # the group is broken by the timeout
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def configurations(tmp_path_factory):
    return outputs_of_ranks(_rank_configurations, tmp_path_factory.mktemp("configurations"))


@pytest.mark.parametrize("case, option", [("directions", "directions"), ("directions_gathers", "directions"),
                                          ("scale", "scale"), ("hardness", "hardness_mode"),
                                          ("gist_contrast_anchors", "contrast_anchors"), ("drop_in_scale", "scale")])
def test_ranks_that_call_a_loss_with_other_options_all_raise_naming_the_option(configurations, case, option):
    """Before: options that left the gathered tensors alike (the directions that both gather the queries, the scale,
    the hardness, GIST's contrast_anchors, a drop-in's scale) trained each rank on another loss in silence, and
    directions that gathered other tensors were refused as "tensors per rank [2, 3]". Now every rank raises a
    ValueError naming the option, the ranks on each side and its own value."""
    for rank, result in enumerate(configurations):
        kind, message = result[case]
        assert kind == "ValueError", (rank, case, kind, message)
        assert "every rank must call the loss with the same options" in message, (rank, message)
        assert f"{option} (ranks [0] against [1]; rank {rank} has " in message, (rank, message)
        assert "tensors per rank" not in message
    assert all(result["after"] for result in configurations)


def test_a_rank_without_the_gathers_backward_makes_every_rank_raise(configurations):
    """Before: rank 0 under torch.no_grad made no backward collective, and rank 1 waited for it in its own until
    the group's timeout. Now both raise, saying which tensors each takes with gradients."""
    for rank, result in enumerate(configurations):
        kind, message = result["gradients"]
        assert kind == "ValueError", (rank, kind, message)
        assert "the ranks [0] against [1] differ" in message, message
        assert (f"this is rank {rank}: with gradients " + ("[], grad mode off" if rank == 0 else
                                                           "['positives', 'negatives[0]'], grad mode on")) in message


def test_matryoshka_widths_may_differ_between_ranks(configurations):
    """The dims make no collective (the full-width columns are gathered once), and MatryoshkaLoss's
    n_dims_per_step draws them on each rank: they are not compared."""
    assert [result["dims"] for result in configurations] == [("ok", True), ("ok", True)]


def test_a_rank_that_does_not_gather_leaves_the_others_a_timeout_that_says_why(configurations):
    """No agreement can reach a rank that gathers nothing (gather_across_devices=False there): the gathering rank
    waits until the group's timeout, whose error now says what makes ranks miss a gather."""
    kind, message = configurations[0]["one_sided"]
    assert kind == "RuntimeError", (kind, message)
    assert "rank 0 waited for the other ranks to agree to gather ['positives']" in message, message
    assert "gather_across_devices=True on every rank" in message and "TORCH_DISTRIBUTED_DEBUG=DETAIL" in message
    assert configurations[1]["one_sided"] == ("ok", True)


# What gloo raised in two processes (a 2 s group timeout; a peer process that exited), NCCL's error type, and an
# error of another kind. expected: whether the agreement explains it as ranks that did not come.
COLLECTIVE_ERRORS = [
    (RuntimeError, "[third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:129] Timed out waiting 2000ms for send "
                   "operation to complete", True),
    (RuntimeError, "[third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4510. "
                   "This is typically caused by a remote worker crashing.", True),
    (RuntimeError, "[third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error [127.0.0.1]:4510: Connection reset "
                   "by peer", True),
    ("DistBackendError", "NCCL communicator was aborted on rank 1.", True),
    ("DistBackendError", "[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=3, "
                         "OpType=ALLGATHER) ran for 600000 milliseconds before timing out.", True),
    ("DistNetworkError", "failed to recv, got 0 bytes", True),
    ("DistBackendError", "NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled cuda error, NCCL version 2.21.5\n"
                         "Last error:\nCuda failure 'out of memory'", False),
    (RuntimeError, "CUDA error: an illegal memory access was encountered", False),
]


@pytest.mark.parametrize("error, message, explained", COLLECTIVE_ERRORS,
                         ids=["timeout", "peer_gone", "peer_reset", "nccl_aborted", "nccl_watchdog", "store",
                              "nccl_cuda_error", "other"])
def test_only_a_wait_that_ended_is_explained_as_ranks_that_did_not_come(monkeypatch, error, message, explained):
    """The agreement's collective failing for another reason (a device's error) was reported as ranks that did not
    come to it, the real error at the end of advice about gathering calls; it is now raised as it came. A timeout or
    a broken group still gets the advice."""
    import torch.distributed as dist

    from angle_kernels import distributed

    raised = (getattr(dist, error) if isinstance(error, str) else error)(message)

    def all_gather(records, mine):
        raise raised

    monkeypatch.setattr(distributed, "is_distributed", lambda: True)
    monkeypatch.setattr(distributed, "_agreements", distributed._agreements)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 0)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    with pytest.raises(RuntimeError) as caught:
        distributed.all_gather_many_with_grad([("positives", torch.zeros(2, 3))])
    if explained:
        assert caught.value is not raised and caught.value.__cause__ is raised
        assert "rank 0 waited for the other ranks to agree to gather ['positives']" in str(caught.value)
        assert str(caught.value).endswith(message)
    else:
        assert caught.value is raised
