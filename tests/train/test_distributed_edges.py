"""Distributed training's helpers and the ArcCSE objective where a mistake would train quietly wrong: the main
process's value broadcast to every process, a fresh DDP wrapper starting every process from the main process's
weights, a scalar refused on every rank, a gather's local check run without a process group, ArcCSE's five blocks
joined over the processes in rank order, both views embedded with dropout, every process's sentences counted in
the set-up note, masked spans placed uniformly (to the sentence's end), and block counts checked. Two gloo
processes on CPU for the collectives."""

from __future__ import annotations

import datetime
import os

import pytest
import torch

from train_helpers import make_encoder

from angle_kernels.testing.helpers import outputs_of_ranks
from angle_train.cli_common import is_user_error


ARCCSE_SENTENCES = ["box", "the cat", "it was a golden kite , very long", "the big house is not white at all"]


def _no_permission(rank: int) -> None:
    if rank == 0:
        raise PermissionError(13, "Permission denied", "/run/metrics.jsonl")


def _a_users_mistake(rank: int) -> None:
    from angle_train.config import TrainConfig

    if rank == 0:
        TrainConfig(batch_size=0).validate()  # angle_train's own check: a ValueError the user fixes


def _a_bug(rank: int) -> None:
    if rank == 1:
        len(None)


def _worker(rank: int, world: int, store: str, out_dir: str) -> None:
    import torch.distributed as dist

    from angle_kernels.distributed import all_gather_many_with_grad, all_gather_with_grad
    from angle_train import distributed as td

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=30))
    try:
        info = td.DistInfo(rank, world, rank)
        out = {}
        # the main process's value on every process (the trainer's best score, restore_best's action)
        out["broadcast"] = td.broadcast_from_main(("main says", rank), info)
        # a fresh DDP wrapper starts every process from the main process's weights
        torch.manual_seed(1000 + rank)
        model = torch.nn.Linear(3, 2)
        td.wrap_ddp(model, torch.device("cpu"))
        out["ddp_weight"] = model.weight.detach().clone()
        # a 0-dim tensor is refused with the documented ValueError on every rank (no collective left waiting)
        try:
            all_gather_with_grad(torch.tensor(float(rank)))
            out["scalar"] = None
        except Exception as exc:  # noqa: BLE001 - the type is what is checked
            out["scalar"] = type(exc).__name__
        # a later tensor (not the first) whose rows differ between the ranks: refused on every rank, not gathered
        try:
            all_gather_many_with_grad([("a", torch.zeros(2, 3)), ("b", torch.zeros(2 + rank, 3))])
            out["later_rows"] = None
        except Exception as exc:  # noqa: BLE001 - the type and message are what is checked
            out["later_rows"] = f"{type(exc).__name__}: {exc}"
        # what one process alone does fails: every process stops, the others with its error naming it
        out["stopped"] = []
        for failing in (_no_permission, _a_users_mistake, _a_bug):
            try:
                with td.stopping_together(info):
                    failing(rank)
                out["stopped"].append(None)
            except Exception as exc:  # noqa: BLE001 - the type, message and kind are what is checked
                out["stopped"].append((type(exc).__name__, str(exc), is_user_error(exc)))
        out["after"] = all_gather_with_grad(torch.full((1, 2), float(rank))).detach()  # the group still works
        # ArcCSE's setup counts: every process's share counted (the sentences cut are all in rank 1's share)

        from angle_train.arccse import TokenizedSentences

        _, tokenizer = make_encoder("bert")
        data = TokenizedSentences(ARCCSE_SENTENCES, tokenizer, max_length=6, mask_rates=(0.2, 0.4), seed=0,
                                  processes=info)
        out["arccse"] = (data.cut, data.too_short, len(data))
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
        td.leave_process_group()  # every rank waits, then leaves as angle-train does
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    return outputs_of_ranks(_worker, tmp_path_factory.mktemp("two_ranks"))


def test_a_failure_on_one_process_stops_every_process_with_its_error(two_ranks):
    """distributed.stopping_together: the process that failed raises its own error, the others the same one naming
    it, of a kind the command lines treat alike (an OSError with its errno and a ValueError of angle_train's: one
    line; a bug: a traceback), and the group still works after it."""
    mistake = "--batch-size must be >= 1"
    own, elsewhere = two_ranks[0]["stopped"], two_ranks[1]["stopped"]
    assert own[0] == ("PermissionError", "[Errno 13] Permission denied: '/run/metrics.jsonl'", True)
    assert elsewhere[0] == ("PermissionError", "[Errno 13] Permission denied: '/run/metrics.jsonl' on process 0", True)
    assert own[1][0] == "ValueError" and own[1][1].startswith(mistake) and own[1][2]
    assert elsewhere[1] == ("ValueError", f"{own[1][1]} on process 0", True)
    assert elsewhere[2] == ("TypeError", "object of type 'NoneType' has no len()", False)
    assert own[2] == ("RuntimeError", "TypeError: object of type 'NoneType' has no len() on process 1", False)


def test_broadcast_from_main_gives_rank_0s_value_everywhere(two_ranks):
    """The trainer's best score and step, and restore_best's action, are the main process's on every process."""
    assert [r["broadcast"] for r in two_ranks] == [("main says", 0), ("main says", 0)]


def test_a_fresh_ddp_wrapper_syncs_the_main_process_weights(two_ranks):
    """wrap_ddp on processes whose weights differ: every process starts from the main process's weights (without
    DDP's initial broadcast, processes that started apart would train apart)."""
    torch.manual_seed(1000)
    expected = torch.nn.Linear(3, 2).weight.detach()
    for r in two_ranks:
        torch.testing.assert_close(r["ddp_weight"], expected, rtol=0, atol=0)


def test_a_scalar_is_refused_with_a_value_error_on_every_rank(two_ranks):
    """A 0-dim tensor is refused with the documented ValueError on every rank, not an IndexError from the gather,
    and the group still gathers afterwards."""
    assert [r["scalar"] for r in two_ranks] == ["ValueError", "ValueError"]
    assert all(r["after"].tolist() == [[0.0, 0.0], [1.0, 1.0]] for r in two_ranks)


def test_a_later_tensor_whose_rows_differ_between_ranks_is_refused_on_every_rank(two_ranks):
    """all_gather_many_with_grad compares every tensor's layout across the ranks, not only the first one's: a second
    tensor with more rows on one rank is a ValueError on both ranks (not a hang or mixed-up rows in the gather)."""
    for r in two_ranks:
        assert r["later_rows"] is not None and r["later_rows"].startswith("ValueError"), r["later_rows"]
        assert "the ranks' differ" in r["later_rows"] and "('b', (" in r["later_rows"], r["later_rows"]


def test_all_gather_many_runs_the_local_check_without_a_process_group():
    """Without a process group, all_gather_many_with_grad still runs its local_check (as documented), then returns
    the tensors themselves."""
    from angle_kernels.distributed import all_gather_many_with_grad

    def refuse():
        raise ValueError("this rank's inputs are wrong")

    with pytest.raises(ValueError, match="inputs are wrong"):
        all_gather_many_with_grad([("x", torch.zeros(2, 3))], local_check=refuse)
    x = torch.zeros(2, 3)
    assert all_gather_many_with_grad([("x", x)], local_check=lambda: None)[0] is x


def test_all_gather_many_refuses_what_is_not_a_tensor_by_name():
    """A list or number among the tensors to gather is a TypeError naming it, with or without a process group (not
    returned as it is, to fail later in the loss)."""
    from angle_kernels.distributed import all_gather_many_with_grad

    with pytest.raises(TypeError, match="expects tensors, got list for pos"):
        all_gather_many_with_grad([("x", torch.zeros(2, 3)), ("pos", [1.0, 2.0])])


def test_arccse_objective_hands_the_loss_each_block_joined_over_the_processes():
    """The loss gets the five blocks h1, h2, anchor, weak, strong, each joined over the processes in rank order
    (strong taken for weak would make the triplet term a constant: dropped from training in silence)."""
    from angle_train.arccse import ArcCSEObjective

    world, n, dim = 2, 3, 4
    # row value = 100 * rank + 10 * block + sentence
    embeddings = torch.tensor([[100 * r + 10 * b + i] * dim for r in range(world) for b in range(5) for i in range(n)],
                              dtype=torch.float64)
    seen = []
    ArcCSEObjective(lambda *blocks: seen.extend(blocks) or torch.zeros(()), world_size=world)(
        torch.ones(len(embeddings)), embeddings)
    assert len(seen) == 5
    for b, block in enumerate(seen):
        assert block[:, 0].tolist() == [100 * r + 10 * b + i for r in range(world) for i in range(n)], b


def test_arccse_batches_embed_both_views_with_dropout():
    """Both views (h1 and h2) are embedded with dropout: the positive pair differs by two dropout masks, not one."""

    from angle_train.arccse import ARCCON_BLOCKS, BLOCKS, TokenizedSentences

    _, tokenizer = make_encoder("bert")
    sentences = ["a small red car", "the dog is black and big", "a tiny green bird"]
    for blocks in (BLOCKS, ARCCON_BLOCKS):
        data = TokenizedSentences(sentences, tokenizer, max_length=32, mask_rates=(0.2, 0.4), seed=0, blocks=blocks)
        batch = data.batch([0, 2])
        assert batch.dropout_rows == 4 and len(batch.seqs) == blocks * 2


def test_arccse_setup_counts_every_processs_sentences(two_ranks):
    """The set-up note's "N of M texts cut" counts every process's share, not the main process's alone."""

    from angle_train.arccse import TokenizedSentences

    _, tokenizer = make_encoder("bert")
    one = TokenizedSentences(ARCCSE_SENTENCES, tokenizer, max_length=6, mask_rates=(0.2, 0.4), seed=0)
    assert "2 of 4 texts cut" in one.cut
    assert [r["arccse"] for r in two_ranks] == [(one.cut, one.too_short, 4)] * 2


def test_a_span_may_end_at_the_sentences_last_token():
    """A masked span is placed uniformly over the maskable tokens: it may end at the sentence's last one."""
    import random

    from angle_train.arccse import mask_span

    starts = {mask_span([0, 5, 6, 0], range(1, 3), 0.5, 9, random.Random(i)).index(9) for i in range(40)}
    assert starts == {1, 2}


def test_tokenized_sentences_refuses_a_block_count_it_cannot_lay_out():
    """A block count other than ArcCSE's or ArcCon's is refused, naming blocks."""
    from angle_train.arccse import TokenizedSentences

    class Tok:
        mask_token_id = 1

    with pytest.raises(ValueError, match="blocks must be"):
        TokenizedSentences(["a b"], Tok(), max_length=8, mask_rates=(0.2, 0.4), seed=0, blocks=3)
