"""Packed rows (--pack): several texts per row, no padding between them, a block-diagonal attention mask and
positions restarting per text. They must embed exactly as padded rows do (float64, every pooling strategy, encoder,
causal and bidirectional decoder, RoBERTa's offset positions, Espresso's layer stack) and give plain backprop's
gradients through both steps; the start-up check must catch a model that does not honour them."""

import dataclasses

import pytest
import torch
from train_helpers import (
    assert_same_grads, demo_batch, graded_or_contrastive_loss, grads_in_passes, make_encoder, param_grads, run_config,
)

from angle_train.config import CPU_PACK_WIDTH, CPU_PASS_TOKENS, TrainConfig
from angle_train.data import Batch, PackedTexts, pack_rows, pad_batch
from angle_train.grad_cache import grad_cache_step, plain_step
from angle_train.models import POOLING_STRATEGIES, wrap_backbone
from angle_train.trainer import setup, train

WIDTH = 24  # rows of the tests' packed passes: the built-in texts are 5-12 tokens, so 2-4 texts a row


def test_pack_rows_fills_rows_first_fit_by_decreasing_length():
    # 27 tokens, rows of at most 10: 9 + 1, 7 + 3, 5 + 2 process 3 x 10; rows of 9 (9, 7 + 2, 5 + 3 + 1) 3 x 9
    assert pack_rows([5, 2, 9, 3, 7, 1], 10) == [[2], [4, 1], [0, 3, 5]]
    assert pack_rows([12, 3], 10) == [[0], [1]]  # a text longer than a row has a row of its own
    # 21 tokens in rows of at most 16: 16 + 5 processes 2 x 16, 11 + 10 (rows of 11) 2 x 11
    assert pack_rows([6, 5, 5, 5], 16) == [[0, 1], [2, 3]]
    # never more than one padded pass: rows of 24 (24 + 14) or of 19 (16 + 15 + 7) process 48, 5 x 8 = 40
    assert pack_rows([8, 8, 8, 7, 7], 24) == [[0], [1], [2], [3], [4]]
    # five 1-token texts in rows of at most 4: rows of 4 (4 + 1) process 2 x 4, of 3 or 2 six; each alone 5 x 1
    assert pack_rows([1, 1, 1, 1, 1], 4) == [[0], [1], [2], [3], [4]]
    # 16 tokens in rows of at most 8: rows of 8 (5 + 2, 5, 4) or of 5 (four rows) process 21 and 20; rows of 6, the
    # total shared among three, process 18 (5, 5, 4 + 2)
    assert pack_rows([2, 4, 5, 5], 8) == [[2], [3], [1, 0]]
    assert pack_rows([0, 0, 0], 8) == [[0, 1, 2]]  # empty texts only (a division by 0 before): one row


@pytest.mark.parametrize("seed", range(20))
def test_packing_never_processes_more_than_one_padded_pass(seed):
    rng = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 60, (int(torch.randint(1, 40, (1,), generator=rng)),), generator=rng).tolist()
    rows = pack_rows(lengths, 64)
    assert sorted(t for row in rows for t in row) == list(range(len(lengths)))
    assert len(rows) * max(sum(lengths[t] for t in row) for row in rows) <= len(lengths) * max(lengths)


def test_packed_layout_puts_each_text_where_its_index_says():
    seqs = [[11, 12, 13], [21, 22], [31, 32, 33, 34], [41]]
    input_ids, layout = PackedTexts.build(seqs, 5, pad_id=0)
    # rows: [2, 3] (4 + 1 tokens) and [0, 1] (3 + 2): no padding at all
    assert input_ids.tolist() == [[31, 32, 33, 34, 41], [11, 12, 13, 21, 22]]
    assert layout.text_of_token.tolist() == [[2, 2, 2, 2, 3], [0, 0, 0, 1, 1]]
    assert layout.position_ids.tolist() == [[0, 1, 2, 3, 0], [0, 1, 2, 0, 1]]
    for text, seq in enumerate(seqs):
        got = input_ids.flatten()[layout.token_index[text]][layout.token_mask[text].bool()]
        assert got.tolist() == seq


def _embed_both(encoder, seqs, width=WIDTH):
    packed_ids, layout = PackedTexts.build(seqs, width, encoder.pad_token_id)
    assert packed_ids.shape[0] < len(seqs)  # the test needs rows that hold several texts
    packed = encoder(packed_ids, layout.attention_mask, layout)
    padded = encoder(*pad_batch(seqs, encoder.pad_token_id, encoder.padding_side))
    return packed, padded


@pytest.mark.parametrize("pooling", POOLING_STRATEGIES)
@pytest.mark.parametrize("arch", ["bert", "llama", "llama-bidirectional"])
def test_packed_rows_embed_like_padded_rows(arch, pooling):
    encoder, tokenizer = make_encoder(arch.split("-")[0], pooling=pooling)
    encoder.bidirectional = arch.endswith("bidirectional")
    seqs = demo_batch(tokenizer, 6, "B").seqs
    packed, padded = _embed_both(encoder, seqs)
    torch.testing.assert_close(packed, padded, rtol=1e-10, atol=1e-12)
    # and the gradients of the weights through either layout
    weights = torch.randn_like(padded)
    grads = []
    for out in (packed, padded):
        encoder.zero_grad(set_to_none=True)
        (out * weights).sum().backward(retain_graph=True)
        grads.append(param_grads(encoder))
    for name in grads[1]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-9, atol=1e-12, msg=name)


def test_a_leaking_mask_or_wrong_positions_change_the_embeddings():
    """Negative controls for the test above: it compares embeddings that do depend on the mask and positions."""
    encoder, tokenizer = make_encoder("bert", pooling="avg")
    seqs = demo_batch(tokenizer, 6, "B").seqs
    _, padded = _embed_both(encoder, seqs)
    packed_ids, layout = PackedTexts.build(seqs, WIDTH, encoder.pad_token_id)
    mask = layout.attention_mask
    from_zero = dataclasses.replace(layout, position_ids=torch.zeros_like(layout.position_ids))
    assert (encoder(packed_ids, mask, from_zero) - padded).abs().max() > 1e-2
    encoder._packed_mask = lambda text_of_token: (text_of_token >= 0)[:, None, None, :]  # every real token
    assert (encoder(packed_ids, mask, layout) - padded).abs().max() > 1e-4


def test_roberta_positions_start_after_the_padding_row():
    from transformers import RobertaConfig, RobertaModel

    _, tokenizer = make_encoder("bert")
    config = RobertaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64, pad_token_id=tokenizer.pad_token_id, max_position_embeddings=64,
                           hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    encoder = wrap_backbone(RobertaModel(config).double(), pooling="avg", pad_token_id=tokenizer.pad_token_id,
                            is_decoder=False)
    assert encoder.position_offset == tokenizer.pad_token_id + 1
    packed, padded = _embed_both(encoder, demo_batch(tokenizer, 6, "B").seqs)
    torch.testing.assert_close(packed, padded, rtol=1e-10, atol=1e-12)


def test_the_layer_stack_of_packed_rows_is_that_of_padded_rows():
    encoder, tokenizer = make_encoder("bert", pooling="avg", layers=3)
    with encoder.all_layers_out():
        packed, padded = _embed_both(encoder, demo_batch(tokenizer, 6, "B").seqs)
    assert packed.shape[0] == 3
    torch.testing.assert_close(packed, padded, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("arch, fmt, cut", [("bert", "A", {}), ("bert", "B", {"rows": 5}),
                                            ("llama", "B", {"tokens": 40}), ("llama", "A", {"rows": 4})])
def test_packed_passes_give_the_gradients_of_one_padded_pass(arch, fmt, cut):
    """Dropout off, float64: plain backprop and the gradient cache over packed passes (one, rows or a budget of
    real tokens) give one padded pass's loss and gradients."""
    encoder, tokenizer = make_encoder(arch, dropout=0.0)
    batch = demo_batch(tokenizer, 10, fmt)
    loss_fn = graded_or_contrastive_loss(fmt)
    loss_ref, reference = grads_in_passes(encoder, plain_step, batch.plan(sort=False), batch.labels, loss_fn, seed=0)
    packed = batch.plan(**cut, pack_width=WIDTH)
    assert packed.token_counts()[1] < batch.plan(sort=False).token_counts()[1]  # packing removed padding
    for step in (plain_step, grad_cache_step):
        loss, grads = grads_in_passes(encoder, step, packed, batch.labels, loss_fn, seed=0)
        torch.testing.assert_close(loss, loss_ref, rtol=1e-10, atol=1e-12)
        assert_same_grads(grads, reference)


def test_a_token_budget_counts_real_tokens_when_packing():
    seqs = [[7] * n for n in (5, 2, 9, 3, 7, 1, 4, 6)]
    plan = Batch(seqs, torch.zeros(8)).plan(tokens=14, pack_width=14)
    # sorted, then cut at 14 real tokens: [9] (9 + 7 > 14), [7, 6], [5, 4, 3, 2], [1]; each pass fits one row
    assert [[len(s) for s in c] for c, _ in plan.passes] == [[9], [7, 6], [5, 4, 3, 2], [1]]
    assert plan.token_counts() == (37, 37)


def test_packed_passes_with_dropout_equal_plain_backprop_over_the_same_passes():
    """Dropout on: the gradient cache replays each packed pass's masks."""
    encoder, tokenizer = make_encoder("bert", dropout=0.2)
    encoder.train()
    batch = demo_batch(tokenizer, 12, "B")
    loss_fn = graded_or_contrastive_loss("B")
    plan = batch.plan(tokens=60, pack_width=WIDTH)
    assert len(plan.passes) > 1
    loss_p, plain = grads_in_passes(encoder, plain_step, plan, batch.labels, loss_fn, seed=5)
    loss_c, cached = grads_in_passes(encoder, grad_cache_step, plan, batch.labels, loss_fn, seed=5)
    torch.testing.assert_close(loss_c, loss_p, rtol=1e-12, atol=0)
    assert_same_grads(cached, plain)


def test_the_start_up_check_finds_models_that_cannot_take_packed_rows(monkeypatch):
    encoder, tokenizer = make_encoder("bert", pooling="avg")
    seqs = demo_batch(tokenizer, 4, "B").seqs
    assert encoder.packing_problem(seqs, WIDTH) is None
    monkeypatch.setattr(type(encoder), "attention_implementation", property(lambda self: "flash_attention_2"))
    assert "sdpa or eager" in encoder.packing_problem(seqs, WIDTH)
    monkeypatch.undo()
    encoder._packed_mask = lambda text_of_token: (text_of_token >= 0)[:, None, None, :]
    assert "embed differently" in encoder.packing_problem(seqs, WIDTH)


def _tiny_model(**settings):
    return make_encoder("bert", dropout=0.1, dtype=torch.float32, **settings)


def test_packing_is_the_cpu_default_and_falls_back_when_the_model_cannot(tmp_path, capsys):
    cfg = run_config(tmp_path / "a", batch_size=8, max_steps=1)
    run = setup(cfg, model=_tiny_model())
    assert cfg.pack == CPU_PACK_WIDTH and cfg.pass_tokens == 0
    assert f"packed into rows of {CPU_PACK_WIDTH} tokens" in capsys.readouterr().out
    del run
    leaky = _tiny_model()
    leaky[0]._packed_mask = lambda text_of_token: (text_of_token >= 0)[:, None, None, :]
    cfg = run_config(tmp_path / "b", batch_size=8, max_steps=1)
    setup(cfg, model=leaky)
    out = capsys.readouterr().out
    assert cfg.pack == 0 and cfg.pass_tokens == CPU_PASS_TOKENS
    assert "padded passes, not packed rows" in out and f"sub-batches of up to {CPU_PASS_TOKENS} tokens" in out
    with pytest.raises(ValueError, match="--pack 64: packed rows embed differently"):
        setup(run_config(tmp_path / "c", batch_size=8, max_steps=1, pack=64), model=leaky)
    with pytest.raises(ValueError, match="choose one"):
        setup(run_config(tmp_path / "d", pack=64, pass_tokens=256), model=_tiny_model())


@pytest.mark.parametrize("device, settings, resolved", [
    ("cpu", {}, (CPU_PACK_WIDTH, 0)),
    ("cpu", {"pass_tokens": 256}, (0, 256)),  # padded sub-batches asked for: not packed on top
    ("cpu", {"pack": 0}, (0, CPU_PASS_TOKENS)),
    ("cpu", {"pack": 0, "chunk_size": 8}, (0, 0)),  # the gradient cache's chunks are the passes
    ("cpu", {"pack": 0, "chunk_tokens": 256}, (0, 0)),
    ("cuda", {}, (0, 0)),  # one padded pass on a GPU, until measured there
])
def test_the_pass_defaults_follow_the_device_and_the_flags_given(device, settings, resolved):
    """--pack and --pass-tokens left out take the device's default, never one that fights a flag given: packed rows
    on top of --pass-tokens, or sub-batches inside the gradient cache's chunks."""
    cfg = TrainConfig(**settings).validate()
    cfg.resolve_passes(device)
    assert (cfg.pack, cfg.pass_tokens) == resolved


def test_a_packed_run_trains_like_a_padded_one(tmp_path):
    """End to end without dropout, float64: packed (the CPU default) and padded passes train to the same losses."""
    losses = {}
    for pack in (None, 0):
        result = train(run_config(tmp_path / str(pack), batch_size=8, max_steps=3, lr=1e-3, pack=pack,
                                  pass_tokens=None if pack is None else 0),
                       model=make_encoder("bert", dropout=0.0))
        losses[pack] = [row["loss"] for row in result.history]
    torch.testing.assert_close(torch.tensor(losses[None]), torch.tensor(losses[0]), rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("seed", range(3))
def test_first_fit_finds_the_first_row_with_room_as_a_scan_would(seed):
    """_first_fit_decreasing places the texts a length at a time (tensor ops): the rows a scan of every row for
    every text would give, texts longer than the width and empty ones included."""
    import random

    from angle_train.data import _first_fit_decreasing

    def scanned(lengths, width):
        rows, free = [], []
        for text in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
            r = next((r for r, room in enumerate(free) if lengths[text] <= room), None)
            if r is None:
                rows.append([text])
                free.append(width - lengths[text])
            else:
                rows[r].append(text)
                free[r] -= lengths[text]
        return rows

    rng = random.Random(seed)
    for _ in range(100):
        width = rng.randint(1, 64)
        lengths = [rng.randint(0, 80) for _ in range(rng.randint(1, 300))]
        packing = _first_fit_decreasing(lengths, width)
        assert packing.rows() == scanned(lengths, width), (width, lengths)
        fullest = max(sum(lengths[t] for t in row) for row in packing.rows())
        assert packing.processed_tokens == len(packing.rows()) * fullest
    lengths = [rng.randint(0, 140) for _ in range(1000)]  # a pass's worth: rows of 128, a few texts too long
    assert _first_fit_decreasing(lengths, 128).rows() == scanned(lengths, 128)


def test_packed_layout_built_at_once_is_the_layout_text_by_text():
    """PackedTexts.build scatters every text's tokens with a few tensor ops (it made a few small tensors per text:
    2 s of a 32,768-pair step's data preparation at --chunk-size 256); the same tensors as placing the texts one
    by one."""
    import random

    def text_by_text(seqs, width, pad_id):
        lengths = [len(seq) for seq in seqs]
        rows = pack_rows(lengths, width)
        fullest = max(sum(lengths[t] for t in row) for row in rows)
        ids = torch.full((len(rows), fullest), pad_id, dtype=torch.long)
        text_of_token = torch.full((len(rows), fullest), -1, dtype=torch.long)
        position_ids = torch.zeros((len(rows), fullest), dtype=torch.long)
        token_index = torch.zeros((len(seqs), max(lengths)), dtype=torch.long)
        token_mask = torch.zeros((len(seqs), max(lengths)), dtype=torch.long)
        for r, row in enumerate(rows):
            start = 0
            for text in row:
                end = start + lengths[text]
                ids[r, start:end] = torch.tensor(seqs[text])
                text_of_token[r, start:end] = text
                position_ids[r, start:end] = torch.arange(lengths[text])
                token_index[text, :lengths[text]] = torch.arange(r * fullest + start, r * fullest + end)
                token_mask[text, :lengths[text]] = 1
                start = end
        return ids, (text_of_token, position_ids, token_index, token_mask)

    rng = random.Random(0)
    for _ in range(100):
        seqs = [[rng.randint(0, 999) for _ in range(rng.randint(0, 70))] for _ in range(rng.randint(1, 60))]
        width = rng.randint(4, 64)
        want_ids, want_layout = text_by_text(seqs, width, 7)
        for rows in (None, pack_rows([len(seq) for seq in seqs], width)):  # packed here, or rows given as lists
            ids, layout = PackedTexts.build(seqs, width, pad_id=7, rows=rows)
            assert torch.equal(ids, want_ids)
            assert all(torch.equal(got, want) for got, want in zip(
                (layout.text_of_token, layout.position_ids, layout.token_index, layout.token_mask), want_layout))


def test_the_headers_real_token_estimate_reads_at_most_65536_examples(monkeypatch):
    """The run header's estimate of the real tokens (expected_useful_tokens) cuts the epoch's first 64 batches'
    passes, but no more than 65,536 examples of them (at least one batch): at 32,768 pairs a batch, 64 batches'
    passes took half a minute of start-up."""
    from angle_train.data import TokenizedPairs
    from angle_train.distributed import DistInfo
    from angle_train.tiny import demo_examples
    from angle_train.trainer import batch_order, expected_useful_tokens

    _, tokenizer = make_encoder()
    dataset = TokenizedPairs(demo_examples(80), "B", tokenizer, max_length=16)
    taken = []
    batch = dataset.batch
    monkeypatch.setattr(dataset, "batch", lambda indices: taken.append(len(indices)) or batch(indices))
    for batch_size, examples, expected in ((8, 65_536, [8] * 10), (4, 65_536, [4] * 20), (8, 24, [8] * 3),
                                           (8, 4, [8])):
        taken.clear()
        cfg = run_config("unused", batch_size=batch_size, pack=CPU_PACK_WIDTH)
        fraction = expected_useful_tokens(cfg, dataset, batch_order(cfg, dataset, 0), DistInfo(), batches=64,
                                          examples=examples)
        assert taken == expected and 0 < fraction <= 1
    taken.clear()
    cfg = run_config("unused", batch_size=8)
    expected_useful_tokens(cfg, dataset, batch_order(cfg, dataset, 0), DistInfo(), batches=2)
    assert taken == [8, 8]
