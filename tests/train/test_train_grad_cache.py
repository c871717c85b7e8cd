"""The gradient cache gives the same parameter gradients as plain backprop (float64, tight tolerance)."""

import contextlib

import pytest
import torch
from train_helpers import (
    assert_same_grads, demo_batch, graded_or_contrastive_loss, grads_in_passes, make_encoder, param_grads, run_config,
)

from angle_kernels import AngleLoss
from angle_train.cli import config_from_args
from angle_train.data import Batch, pad_batch
from angle_train.grad_cache import RngState, grad_cache_step, plain_step
from angle_train.trainer import build_loss


def _chunks(encoder, batch, rows):
    return [pad_batch(c, encoder.pad_token_id, encoder.padding_side) for c in batch.chunks(rows)]


def _grads(encoder, step, chunks, labels, loss_fn, seed):
    encoder.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    loss = step(encoder, chunks, labels, loss_fn)
    return loss, param_grads(encoder), torch.get_rng_state()


@pytest.mark.parametrize("arch, lora", [("bert", False), ("llama", True)])
def test_grad_cache_equals_plain_backprop_with_dropout(arch, lora):
    """Dropout ON: equality needs the second pass to replay the first pass's dropout masks."""
    encoder, tokenizer = make_encoder(arch, dropout=0.2, lora=lora)
    encoder.train()
    batch = demo_batch(tokenizer, 12, "B")
    loss_fn = AngleLoss(dataset_format="B")
    chunks = _chunks(encoder, batch, 7)  # 24 rows -> chunks of 7, 7, 7, 3 (a pair split across chunks)
    loss_p, plain, rng_p = _grads(encoder, plain_step, chunks, batch.labels, loss_fn, seed=5)
    loss_c, cached, rng_c = _grads(encoder, grad_cache_step, chunks, batch.labels, loss_fn, seed=5)
    torch.testing.assert_close(loss_c, loss_p, rtol=1e-12, atol=0)
    assert_same_grads(cached, plain)
    assert torch.equal(rng_p, rng_c)  # the generator ends where plain backprop leaves it


def test_without_rng_replay_the_gradients_differ(monkeypatch):
    """Negative control: the test above can fail (dropout masks drawn afresh in pass 2 change the gradient)."""
    encoder, tokenizer = make_encoder("bert", dropout=0.2)
    encoder.train()
    batch = demo_batch(tokenizer, 8, "B")
    loss_fn = AngleLoss(dataset_format="B")
    chunks = _chunks(encoder, batch, 6)
    _, plain, _ = _grads(encoder, plain_step, chunks, batch.labels, loss_fn, seed=5)
    monkeypatch.setattr(RngState, "replay", lambda self: contextlib.nullcontext())
    _, cached, _ = _grads(encoder, grad_cache_step, chunks, batch.labels, loss_fn, seed=5)
    diff = max((cached[n] - plain[n]).abs().max().item() for n in plain)
    assert diff > 1e-6


@pytest.mark.parametrize("arch, fmt", [("bert", "A"), ("llama", "B")])
def test_grad_cache_in_chunks_equals_one_plain_pass_over_the_whole_batch(arch, fmt):
    """No dropout: chunked re-embedding with per-chunk padding = one forward/backward of the padded batch."""
    encoder, tokenizer = make_encoder(arch, dropout=0.0)
    batch = demo_batch(tokenizer, 10, fmt)
    loss_fn = graded_or_contrastive_loss(fmt)
    loss_p, plain, _ = _grads(encoder, plain_step, _chunks(encoder, batch, None), batch.labels, loss_fn, seed=0)
    loss_c, cached, _ = _grads(encoder, grad_cache_step, _chunks(encoder, batch, 3), batch.labels, loss_fn, seed=0)
    torch.testing.assert_close(loss_c, loss_p, rtol=1e-10, atol=1e-12)
    assert_same_grads(cached, plain)


@pytest.mark.parametrize("arch, fmt, flags", [
    ("bert", "A", ["--cosine-w", "1", "--ibn-w", "0", "--angle-w", "1"]),  # the ranking terms (graded labels)
    ("llama", "B", []),  # the contrastive term
])
def test_matryoshka_grad_cache_equals_plain_backprop(arch, fmt, flags):
    """--matryoshka-dims: the loss sees the gathered embeddings whole, so the gradient cache (--chunk-size) still
    equals plain backprop, dropout included."""
    encoder, tokenizer = make_encoder(arch, dropout=0.2)
    encoder.train()
    batch = demo_batch(tokenizer, 10, fmt)
    loss_fn = build_loss(config_from_args([*flags, "--matryoshka-dims", "32", "8", "16",
                                           "--matryoshka-weights", "1", "0.5", "2"]), fmt)
    chunks = _chunks(encoder, batch, 3)  # the same chunks for both: dropout draws its masks per chunk shape
    loss_p, plain, _ = _grads(encoder, plain_step, chunks, batch.labels, loss_fn, seed=3)
    loss_c, cached, _ = _grads(encoder, grad_cache_step, chunks, batch.labels, loss_fn, seed=3)
    torch.testing.assert_close(loss_c, loss_p, rtol=1e-12, atol=0)
    assert_same_grads(cached, plain)
    # the widths change this batch's loss, so the equality above is about the Matryoshka loss
    full_width, _, _ = _grads(encoder, plain_step, chunks, batch.labels, build_loss(config_from_args(flags), fmt),
                              seed=3)
    assert abs(float(full_width) - float(loss_p)) > 1e-3


def test_grad_cache_float32_close_to_plain():
    encoder, tokenizer = make_encoder("bert", dropout=0.1, dtype=torch.float32)
    batch = demo_batch(tokenizer, 16, "B")
    loss_fn = AngleLoss(dataset_format="B")
    chunks = _chunks(encoder, batch, 8)
    _, plain, _ = _grads(encoder, plain_step, chunks, batch.labels, loss_fn, seed=1)
    _, cached, _ = _grads(encoder, grad_cache_step, chunks, batch.labels, loss_fn, seed=1)
    for name in plain:
        torch.testing.assert_close(cached[name], plain[name], rtol=1e-4, atol=1e-6, msg=name)


# ------------------------------------------------------------------ length-sorted passes and token budgets


def test_a_pass_plan_sorts_within_dropout_groups_and_keeps_every_row_once():
    seqs = [[7] * n for n in (5, 2, 9, 3, 7, 1, 4, 6)]
    batch = Batch(seqs, torch.zeros(8), dropout_rows=5)
    plan = batch.plan(tokens=14)
    assert sorted(plan.order.tolist()) == list(range(8))
    lengths = [[len(s) for s in seqs] for seqs, _ in plan.passes]
    # dropout rows (5, 2, 9, 3, 7) then the rest (1, 4, 6), each longest first, at most 14 padded tokens a pass
    # (the 9-token row alone: a second row would make 18)
    assert lengths == [[9], [7, 5], [3, 2], [6, 4], [1]]
    assert [dropout for _, dropout in plan.passes] == [True, True, True, False, False]
    restore = plan.restore_index().tolist()
    embedded = [row for seqs, _ in plan.passes for row in seqs]
    assert [embedded[i] for i in restore] == seqs  # restore puts the embedded rows back in batch order
    assert plan.token_counts() == (37, 9 + 2 * 7 + 2 * 3 + 2 * 6 + 1)
    # a row longer than the budget still gets its pass; without sorting the order is kept
    assert [[len(s) for s in c] for c, _ in batch.plan(tokens=4).passes][0] == [9]
    unsorted = batch.plan(rows=2, sort=False)
    assert unsorted.restore_index() is None and unsorted.passes == batch.passes(2)
    with pytest.raises(ValueError, match="not both"):
        batch.plan(rows=2, tokens=8)
    for wrong in (-1, 9):
        with pytest.raises(ValueError, match=f"dropout_rows must be between 0 and the batch's 8 rows, got {wrong}"):
            Batch(seqs, torch.zeros(8), dropout_rows=wrong)


def _scanned_runs(lengths, max_rows, max_tokens, padded):
    """Runs (start, stop) as a scan row by row takes them: a row joins the run unless that makes the run's tokens
    (rows x its longest when padded, else their sum) exceed max_tokens or its rows exceed max_rows."""
    runs, start = [], 0
    while start < len(lengths):
        stop = start + 1
        while stop < len(lengths) and not (max_rows and stop - start >= max_rows):
            run = lengths[start:stop + 1]
            if max_tokens and (len(run) * max(run) if padded else sum(run)) > max_tokens:
                break
            stop += 1
        runs.append((start, stop))
        start = stop
    return runs


@pytest.mark.parametrize("seed", range(3))
def test_runs_cut_by_tensor_search_are_those_of_a_row_by_row_scan(seed):
    """_cut finds each run's end by a search over a window of its running cost: the runs of a scan row by row, for
    sorted and unsorted lengths, empty texts, texts over the budget, row limits, and runs longer than the first
    window (64 rows), which must grow."""
    import random

    from angle_train.data import _cut

    rng = random.Random(seed)
    for case in range(300):
        count = rng.choice([0, 1, 2, rng.randint(3, 40), rng.randint(100, 600)])
        lengths = [rng.choice([0, rng.randint(1, 8), rng.randint(1, 120)]) for _ in range(count)]
        if case % 2:
            lengths.sort(reverse=True)  # as the plan sorts a group before cutting it
        max_rows = rng.choice([None, 0, 1, rng.randint(2, 300)])
        max_tokens = rng.choice([None, 0, rng.randint(1, 60), rng.randint(100, 5000)])
        for padded in (True, False):
            expected = _scanned_runs(lengths, max_rows, max_tokens, padded)
            got = _cut(torch.tensor(lengths, dtype=torch.long), max_rows, max_tokens, padded=padded)
            assert got == expected, (lengths, max_rows, max_tokens, padded)
    # a budget past int64 (the costs' dtype) bounds nothing: one run, not an overflow's run per row
    for budget in (10**19, 10**30):
        assert _cut(torch.tensor([5, 3, 9]), None, budget) == [(0, 3)]


def test_a_span_of_rows_is_the_rows_taken_and_views_rows_in_tensors():
    from angle_train.data import TokenRows

    built = TokenRows([[1, 2, 3], [], [4], [5, 6]])  # arrays (extend): a span is a copy
    taken = built.take([3, 0, 1, 2])  # tensors: a span is a view
    for rows in (built, taken):
        for start in range(5):
            for stop in range(start, 5):
                assert list(rows.span(start, stop)) == list(rows)[start:stop], (start, stop)
    assert taken.span(1, 3)._flat.untyped_storage().data_ptr() == taken._flat.untyped_storage().data_ptr()


def test_a_pass_plan_of_many_rows_cuts_and_restores_as_rows_sorted_one_by_one():
    """A plan's passes at the sizes the trainer cuts (thousands of rows, runs of hundreds): each group sorted
    longest first with ties in batch order, cut as the row-by-row scan cuts, every row once, restore its inverse."""
    import random

    rng = random.Random(0)
    seqs = [[rng.randint(5, 99)] * rng.randint(2, 60) for _ in range(3000)]
    batch = Batch(seqs, torch.zeros(len(seqs)), dropout_rows=1000)
    for options, padded in (({"tokens": 4096}, True), ({"tokens": 4096, "pack_width": 128}, False),
                            ({"rows": 256}, True)):
        plan = batch.plan(**options)
        expected_passes, expected_order = [], []
        for group, dropout in ((range(1000), True), (range(1000, 3000), False)):
            group = sorted(group, key=lambda i: -len(seqs[i]))
            for start, stop in _scanned_runs([len(seqs[i]) for i in group], options.get("rows"),
                                             options.get("tokens"), padded):
                expected_passes.append(([seqs[i] for i in group[start:stop]], dropout))
            expected_order += group
        assert [(list(rows), dropout) for rows, dropout in plan.passes] == expected_passes, options
        assert plan.order.tolist() == expected_order
        restore = plan.restore_index()
        assert plan.order[restore].tolist() == list(range(len(seqs)))


@pytest.mark.parametrize("arch, fmt, cut", [("bert", "A", {"rows": 3}), ("llama", "B", {"tokens": 40}),
                                            ("llama", "A", {"tokens": 25})])
def test_sorted_passes_give_the_gradients_of_one_plain_pass(arch, fmt, cut):
    """Dropout off, float64: the gradient cache over length-sorted passes (rows or a token budget), their
    embeddings put back in batch order before the loss, gives plain backprop's loss and gradients."""
    encoder, tokenizer = make_encoder(arch, dropout=0.0)
    batch = demo_batch(tokenizer, 10, fmt)
    loss_fn = graded_or_contrastive_loss(fmt)
    plan = batch.plan(**cut)
    assert plan.restore_index() is not None and len(plan.passes) > 2  # the test needs a real reordering
    loss_p, plain, _ = _grads(encoder, plain_step, _chunks(encoder, batch, None), batch.labels, loss_fn, seed=0)
    loss_c, cached = grads_in_passes(encoder, grad_cache_step, plan, batch.labels, loss_fn, seed=0)
    torch.testing.assert_close(loss_c, loss_p, rtol=1e-10, atol=1e-12)
    assert_same_grads(cached, plain)
    # plain backprop in the same sorted sub-batches (--pass-tokens): the same too
    loss_s, sub_batches = grads_in_passes(encoder, plain_step, plan, batch.labels, loss_fn, seed=0)
    torch.testing.assert_close(loss_s, loss_p, rtol=1e-10, atol=1e-12)
    assert_same_grads(sub_batches, plain)


def test_sorted_passes_without_restoring_the_order_give_other_gradients():
    """Negative control for the test above: the loss pairs rows by position, so skipping `restore` changes it."""
    encoder, tokenizer = make_encoder("bert", dropout=0.0)
    batch = demo_batch(tokenizer, 10, "B")
    loss_fn = graded_or_contrastive_loss("B")
    plan = batch.plan(rows=3)
    loss_p, _, _ = _grads(encoder, plain_step, _chunks(encoder, batch, None), batch.labels, loss_fn, seed=0)
    chunks, _ = plan.tensors(encoder.pad_token_id, encoder.padding_side)
    loss_wrong = grad_cache_step(encoder, chunks, batch.labels, loss_fn)
    assert abs(float(loss_wrong) - float(loss_p)) > 1e-6


def test_sorted_passes_with_dropout_equal_plain_backprop_over_the_same_passes():
    """Dropout on: the gradient cache over sorted token-budget passes replays each pass's masks, so it equals
    plain backprop over the same passes."""
    encoder, tokenizer = make_encoder("bert", dropout=0.2)
    encoder.train()
    batch = demo_batch(tokenizer, 12, "B")
    loss_fn = AngleLoss(dataset_format="B")
    plan = batch.plan(tokens=30)
    loss_p, plain = grads_in_passes(encoder, plain_step, plan, batch.labels, loss_fn, seed=5)
    loss_c, cached = grads_in_passes(encoder, grad_cache_step, plan, batch.labels, loss_fn, seed=5)
    torch.testing.assert_close(loss_c, loss_p, rtol=1e-12, atol=0)
    assert_same_grads(cached, plain)


def test_sort_passes_0_cuts_the_chunks_in_batch_order(tmp_path, capsys):
    """--sort-passes 0 fills each chunk with texts in batch order, so its passes carry more padding than the chunks
    of the same batches sorted by length (the default): the rows' real-token shares show it, and the run header says
    how the chunks are cut and estimates that share over the epoch's batches."""
    import re

    from angle_train.tiny import demo_examples
    from angle_train.trainer import train

    share = {}
    for sort in (True, False):
        cfg = run_config(tmp_path / str(sort), batch_size=8, max_steps=4, chunk_size=4, pack=0, sort_passes=sort,
                         max_length=16, seed=3)
        result = train(cfg, model=make_encoder("bert"), train_examples=(demo_examples(32, seed=4), "B"))
        share[sort] = [row["useful_tokens"] for row in result.history]  # the 4 steps: the whole epoch
        header = capsys.readouterr().out
        assert ("grad cache, chunks of 4 texts, texts sorted by length (" in header) == sort
        estimate = int(re.search(r"\((\d+)% of the tokens real\)", header).group(1)) / 100
        assert estimate < 1 and estimate == pytest.approx(sum(share[sort]) / 4, abs=0.03)
    assert sum(share[True]) > sum(share[False])
