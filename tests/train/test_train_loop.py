"""The loop end to end on tiny models: the loss falls, evaluation keeps the best model, exports load back."""

import json
import math
import os

import pytest
import torch
from train_helpers import run_config

from angle_train.export import load_pretrained, save_pretrained
from angle_train.tiny import demo_examples, demo_sts_examples
from angle_train.trainer import train


def _config(out, **overrides):
    base = {"batch_size": 16, "max_steps": 24, "lr": 3e-3, "warmup": 2, "log_every": 4, "max_length": 16,
            "pooling": "avg"}
    return run_config(out, **{**base, **overrides})


def _mean(xs):
    return sum(xs) / len(xs)


@pytest.mark.parametrize(
    "overrides",
    [
        {"model": "builtin:tiny-bert"},
        # LoRA on a LLaMA, gradient cache and gradient checkpointing
        {
            "model": "builtin:tiny-llama",
            "lora": True,
            "lora_r": 8,
            "lr": 5e-3,
            "chunk_size": 10,
            "gradient_checkpointing": True,
        },
    ],
    ids=["bert-full", "llama-lora-gradcache"],
)
def test_a_few_steps_lower_the_loss(tmp_path, overrides):
    result = train(_config(tmp_path, **overrides), train_examples=(demo_examples(400), "B"))
    losses = [r["loss"] for r in result.history]
    assert len(losses) == 24 and all(math.isfinite(x) for x in losses)
    assert _mean(losses[-4:]) < 0.7 * _mean(losses[:4]), losses
    row = result.history[-1]
    assert row["pairs_per_s"] > 0 and row["tokens_per_s"] > row["pairs_per_s"] and row["peak_mem_gb"] > 0


def test_batches_made_ahead_on_a_thread_train_exactly_as_batches_made_at_their_step(tmp_path, monkeypatch):
    """Each step's batches are cut into passes and padded or packed on a background thread while the step before
    runs (trainer.step_data), the next epoch's first ones too (its order computed on the thread as next_batches
    computes it; they were made at their step, on the main thread); only the run's first step makes its own.
    Training (with dropout, the gradient cache, grad_accum 2 and two epochs) is the same to the bit as making every
    step's batches at the step."""
    import threading

    from angle_train import trainer

    def on_data_thread(name: str) -> list[bool]:
        """Whether each call of trainer.<name> ran on the data thread, in call order."""
        calls, real = [], getattr(trainer, name)

        def recording(*args, **kwargs):
            calls.append(threading.current_thread().name.startswith("angle-train-data"))
            return real(*args, **kwargs)

        monkeypatch.setattr(trainer, name, recording)
        return calls

    made_on_thread, ordered_on_thread = on_data_thread("prepare_batches"), on_data_thread("batch_order")
    settings = {"model": "builtin:tiny-bert", "chunk_size": 6, "grad_accum": 2, "max_steps": 0, "epochs": 2,
                "batch_size": 8, "log_every": 1}
    data = (demo_examples(50), "B")  # 6 batches an epoch: 3 steps
    ahead = train(_config(tmp_path / "ahead", **settings), train_examples=data)
    assert made_on_thread == [False] + [True] * 5
    # the second epoch's order: made once, on the thread, and kept for next_batches (setup's calls come before)
    assert ordered_on_thread[ordered_on_thread.index(True):] == [True]
    made_on_thread.clear()
    monkeypatch.setattr(trainer.OneAhead, "start", lambda self, key, make: None)
    at_step = train(_config(tmp_path / "at_step", **settings), train_examples=data)
    assert made_on_thread == [False] * 6
    assert [r["loss"] for r in ahead.history] == [r["loss"] for r in at_step.history]
    for name, value in at_step.encoder.state_dict().items():
        assert torch.equal(ahead.encoder.state_dict()[name], value), name


def test_format_a_with_eval_keeps_the_best_model(tmp_path):
    cfg = _config(
        tmp_path,
        model="builtin:tiny-bert",
        cosine_w=1.0,
        ibn_w=0.0,
        angle_w=1.0,
        eval_every=6,
        max_steps=12,
        save_final=True,
    )
    result = train(cfg, train_examples=(demo_sts_examples(200, seed=4), "A"), dev_examples=demo_sts_examples(64))
    assert [e["step"] for e in result.evals] == [6, 12]
    assert result.best_spearman == max(e["dev_spearman"] for e in result.evals)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert sum("dev_spearman" in r for r in rows) == 2 and sum("loss" in r for r in rows) == 3
    best, tokenizer, meta = load_pretrained(result.best_path)
    assert meta["pooling"] == "avg"
    from angle_train.evaluate import sts_spearman

    assert sts_spearman(best, tokenizer, demo_sts_examples(64), max_length=16) == pytest.approx(
        result.best_spearman, abs=1e-5
    )
    assert os.path.isfile(tmp_path / "final" / "modules.json")


def test_a_lora_runs_best_model_is_its_adapter_alone(tmp_path):
    """best/ of a LoRA run is written at every new best: the adapter alone (over the base --model names), not a
    merged copy of the whole model."""
    result = train(_config(tmp_path, model="builtin:tiny-llama", lora=True, lora_r=4, max_steps=2, eval_every=1),
                   train_examples=(demo_examples(32), "B"), dev_examples=demo_sts_examples(12, seed=5))
    assert result.best_path == str(tmp_path / "best")
    assert (tmp_path / "best" / "adapter_config.json").is_file()
    assert not (tmp_path / "best" / "model.safetensors").exists()
    with open(tmp_path / "best" / "angle_train.json") as f:
        assert json.load(f)["adapter_only"]


def test_query_positive_dev_data_picks_the_best_model_by_retrieval(tmp_path):
    """(query, positive) dev data (format B: angle-eval scores it by retrieval) was refused by --dev-data, so a
    retrieval run had no dev score to pick its best model by. It is scored by nDCG@10 of retrieving each query's own
    positive among every dev positive (recall@1 and @10 logged), at every trained width, and best/ is the model of
    the best nDCG@10; a resume with scored pairs as dev data is refused (Spearman against nDCG@10)."""
    from angle_train.evaluate import read_dataset, retrieval_metrics

    dev_file = tmp_path / "dev.jsonl"
    dev_file.write_text("".join(json.dumps({"query": ex.texts[0], "positive": ex.texts[1]}) + "\n"
                                for ex in demo_examples(40, seed=9)), encoding="utf-8")
    dev = read_dataset(str(dev_file))
    cfg = _config(tmp_path / "run", eval_every=3, max_steps=6, save_every=3, save_final=False, eval_on_start=True,
                  matryoshka_dims=[32, 16], dev_data=str(dev_file), query_prompt="query: ")
    result = train(cfg, train_examples=(demo_examples(96), "B"))
    assert [row["step"] for row in result.evals] == [0, 3, 6]
    assert result.best_metric == "dev_ndcg@10" and result.best_spearman is None
    assert result.best_score == max(row["dev_ndcg@10"] for row in result.evals)
    assert {"dev_ndcg@10", "dev_ndcg@10@16", "dev_recall@1", "dev_recall@10", "best_dev_ndcg@10"} <= set(
        result.evals[-1])
    best, tokenizer, _ = load_pretrained(result.best_path)
    queries = best.encode(dev.queries, tokenizer, prompt_name="query", max_length=16)
    documents = best.encode(dev.documents, tokenizer, prompt_name="document", max_length=16)
    best_row = next(row for row in result.evals if row["dev_ndcg@10"] == result.best_score)
    metrics, narrow = retrieval_metrics(queries, documents), retrieval_metrics(queries[:, :16], documents[:, :16])
    assert metrics["ndcg@10"] == pytest.approx(best_row["dev_ndcg@10"], abs=1e-6)
    assert metrics["recall@1"] == pytest.approx(best_row["dev_recall@1"], abs=1e-6)
    assert narrow["ndcg@10"] == pytest.approx(best_row["dev_ndcg@10@16"], abs=1e-6)
    card = (tmp_path / "run" / "best" / "README.md").read_text(encoding="utf-8")
    assert "the best model by dev nDCG@10" in card
    assert "40 distinct queries, 40 documents in the corpus, 40 relevant (query, document) pairs" in card
    if result.curves_path:  # with matplotlib: the dev panel draws the nDCG@10 rows
        from PIL import Image

        from angle_train.tracking import CURVES_METADATA_KEY

        with Image.open(result.curves_path) as image:
            assert json.loads(image.text[CURVES_METADATA_KEY])["dev_steps"] == [0, 3, 6]
    with pytest.raises(ValueError, match="picked by dev nDCG@10, and this dev data is scored by dev Spearman"):
        train(_config(tmp_path / "run", eval_every=3, max_steps=6, save_final=False, matryoshka_dims=[32, 16],
                      query_prompt="query: ", resume="auto"),
              train_examples=(demo_examples(96), "B"), dev_examples=demo_sts_examples(20))


def test_bf16_autocast_and_the_angle_prompt():
    from train_helpers import make_encoder

    from angle_train.data import ANGLE_PROMPT, apply_prompt

    assert apply_prompt("a cat", ANGLE_PROMPT) == 'Summarize sentence "a cat" in one word:"'
    assert apply_prompt("a cat", "query: ") == "query: a cat"
    encoder, tokenizer = make_encoder("llama", dtype=torch.float32)
    encoder.eval()
    exact = encoder.encode(TEXTS, tokenizer, prompt=ANGLE_PROMPT)
    encoder.autocast = "bf16"
    low = encoder.encode(TEXTS, tokenizer, prompt=ANGLE_PROMPT)
    assert low.dtype == torch.float32
    assert 0 < (low - exact).norm() / exact.norm() < 0.05  # bf16 ran (not identical) and stayed close


TEXTS = ["a small red car", "the dog is black and big", "it was a golden kite , very long", "box"]


def test_export_is_loadable_by_sentence_transformers(tmp_path):
    st = pytest.importorskip("sentence_transformers")
    from train_helpers import make_encoder

    encoder, tokenizer = make_encoder("bert", dtype=torch.float32, pooling="avg")
    encoder.eval()
    path = save_pretrained(encoder, tokenizer, str(tmp_path / "bert"), max_length=32)
    ours = encoder.encode(TEXTS, tokenizer, batch_size=3)
    model = st.SentenceTransformer(path, device="cpu")
    theirs = torch.as_tensor(model.encode(TEXTS, convert_to_numpy=True))
    torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)
    reloaded, tok, _ = load_pretrained(path)
    torch.testing.assert_close(reloaded.encode(TEXTS, tok), ours, rtol=1e-5, atol=1e-6)


def test_an_export_keeps_the_pooler_training_dropped(tmp_path, capfd):
    """BERT's pooler (dense + tanh on [CLS]) never trains (no embedding reads it), but an export without it makes
    every load warn that its weights are missing: the export writes the base model's pooler back."""
    from transformers import AutoModel, BertConfig, BertModel
    from train_helpers import make_encoder

    from angle_train.models import wrap_backbone

    _, tokenizer = make_encoder("bert")
    config = BertConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=64, pad_token_id=tokenizer.pad_token_id)
    backbone = BertModel(config)  # with its pooler
    pooler = {name: value.clone() for name, value in backbone.pooler.state_dict().items()}
    encoder = wrap_backbone(backbone, pooling="avg", pad_token_id=tokenizer.pad_token_id)
    assert not any("pooler" in name for name, _ in encoder.named_parameters())  # nothing of it trains
    path = save_pretrained(encoder, tokenizer, str(tmp_path / "bert"), max_length=32)
    loaded, info = AutoModel.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    for name, value in pooler.items():
        torch.testing.assert_close(loaded.pooler.state_dict()[name], value, rtol=0, atol=0)
    assert encoder.backbone.pooler is None  # and the live model is as it was
    st = pytest.importorskip("sentence_transformers")
    capfd.readouterr()
    st.SentenceTransformer(path, device="cpu")
    loading = capfd.readouterr()
    assert "MISSING" not in loading.out + loading.err and "newly initialized" not in loading.out + loading.err
    # an export of the reloaded model keeps it too
    reloaded, tok, _ = load_pretrained(path)
    again = save_pretrained(reloaded, tok, str(tmp_path / "again"), max_length=32)
    assert not AutoModel.from_pretrained(again, output_loading_info=True)[1]["missing_keys"]


def test_the_builtin_bert_exports_with_every_weight(tmp_path):
    """builtin:tiny-bert was built without BERT's pooler, so every load of its exports said its weights were missing
    (transformers' load report, in sentence-transformers too). It has one now, drawn after the other weights: those
    are the ones it had (the numbers every run on it gave stay as they were)."""
    from transformers import AutoModel, BertModel
    from train_helpers import make_encoder

    from angle_train.tiny import build_backbone

    backbone = build_backbone("builtin:tiny-bert", 100, hidden_size=32, layers=2, dropout=0.0, seed=3)
    assert backbone.pooler is not None
    with torch.random.fork_rng(devices=[]):  # the model as it was built before, from the same seed
        torch.manual_seed(3)
        before = BertModel(backbone.config, add_pooling_layer=False).state_dict()
    now = backbone.state_dict()
    assert set(now) - set(before) == {"pooler.dense.weight", "pooler.dense.bias"}
    assert all(torch.equal(now[name], value) for name, value in before.items())
    path = save_pretrained(*make_encoder("bert", dtype=torch.float32), str(tmp_path / "tiny"), max_length=16)
    assert not AutoModel.from_pretrained(path, output_loading_info=True)[1]["missing_keys"]


def test_lora_export_merges_the_adapter(tmp_path):
    pytest.importorskip("peft")
    from train_helpers import make_encoder

    encoder, tokenizer = make_encoder("llama", dtype=torch.float32, lora=True)
    with torch.no_grad():  # make the adapter non-trivial (LoRA's B starts at zero)
        for name, p in encoder.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    encoder.eval()
    ours = encoder.encode(TEXTS, tokenizer, batch_size=2)
    path = save_pretrained(encoder, tokenizer, str(tmp_path / "llama"), max_length=32)
    assert os.path.isfile(os.path.join(path, "adapter", "adapter_config.json"))
    reloaded, tok, meta = load_pretrained(path)
    assert meta["lora"] and meta["pooling"] == "last" and tok.padding_side == "left"
    torch.testing.assert_close(reloaded.encode(TEXTS, tok, batch_size=4), ours, rtol=1e-4, atol=1e-5)
    # the live model is untouched by the export (a copy was merged)
    torch.testing.assert_close(encoder.encode(TEXTS, tokenizer, batch_size=2), ours, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_cpu_optimizer_is_fused_adamw_with_the_default_update(dtype):
    """make_optimizer asks for fused AdamW on CPU (one kernel instead of torch's per-parameter loop): three steps of
    it on the same gradients leave the weights where the unfused default leaves them, to rounding."""
    from train_helpers import make_encoder

    from angle_train.trainer import make_optimizer

    cfg = run_config("unused", lr=1e-2, weight_decay=0.1)
    fused_model, _ = make_encoder("bert", dtype=dtype)
    plain_model, _ = make_encoder("bert", dtype=dtype)
    plain_model.load_state_dict(fused_model.state_dict())
    fused = make_optimizer(cfg, fused_model, torch.device("cpu"))
    assert fused.defaults["fused"] is True
    params = list(plain_model.parameters())
    plain = torch.optim.AdamW([{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},  # as it groups
                               {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}],
                              lr=1e-2, foreach=False)
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        for a, b in zip(fused_model.parameters(), plain_model.parameters()):
            a.grad = torch.randn(a.shape, generator=generator, dtype=dtype)
            b.grad = a.grad.clone()
        fused.step()
        plain.step()
    names = dict(plain_model.named_parameters())
    for name, value in fused_model.named_parameters():
        torch.testing.assert_close(value, names[name], msg=name)
