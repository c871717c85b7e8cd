"""The base model's attention implementation: --attention (angle-train's flag, TrainConfig.attention, angle-eval's
flag) reaches the model it trains or scores, is put back on a model given to train() when the run is refused, and is
refused before any work where it cannot run (flash attention without a GPU or its package, a model that cannot switch);
and an attention that turns padding into NaN (eager in float64) gives each text its own embedding. Tiny models, CPU."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch
from train_helpers import make_encoder, run_config

from angle_train import preflight
from angle_train.data import pad_batch
from angle_train.evaluate import main as angle_eval
from angle_train.models import use_attention
from angle_train.tiny import demo_examples, demo_sts_examples
from angle_train.trainer import train

TEXTS = ["a small red car", "the dog is black and big", "box"]


def test_the_attention_asked_for_reaches_the_model_trained_and_the_one_scored(tmp_path, capsys):
    """A run with --attention eager trains through eager attention and says so on its start line; angle-eval's
    --attention switches the export it scores (which does not record the training's: without the flag it is
    transformers' choice, sdpa)."""
    sts = tmp_path / "pairs.jsonl"
    sts.write_text("".join(json.dumps({"text1": e.texts[0], "text2": e.texts[1], "label": e.label}) + "\n"
                           for e in demo_sts_examples(24)))
    result = train(run_config(tmp_path / "run", model="builtin:tiny-llama", attention="eager", max_steps=1,
                              batch_size=4, save_final=True), train_examples=(demo_examples(8, seed=1), "B"))
    assert result.encoder.attention_implementation == "eager"
    assert "| float32 weights | eager attention | seed 42" in capsys.readouterr().out
    for flags, attention in (([], "sdpa"), (["--attention", "eager"], "eager")):
        assert angle_eval([str(tmp_path / "run" / "final"), str(sts), "--progress", "0", *flags]) == 0
        assert f"), {attention} attention\n" in capsys.readouterr().err


def test_a_flash_attention_that_cannot_run_here_is_refused_before_any_work():
    """flash_attention_2 / _3 on a CPU run, or without their package, are refused naming --attention before the model
    loads (transformers found the missing package once the model had loaded, in its own words)."""
    with pytest.raises(ValueError, match=r"^--attention flash_attention_2 runs on CUDA GPUs, and this run is on cpu"):
        preflight.check_attention("flash_attention_2", "cpu")
    for name, module in (("flash_attention_2", "flash_attn"), ("flash_attention_3", "flash_attn_interface")):
        if importlib.util.find_spec(module) is None:
            with pytest.raises(ValueError, match=rf"^--attention {name} needs .*which this Python environment does "
                                                 "not have: install it, or use sdpa"):
                preflight.check_attention(name, "cuda")
    preflight.check_attention("eager", "cpu")  # the others are the model's to take (use_attention)
    preflight.check_attention(None, "cpu")


def test_flash_attention_on_a_model_computing_in_float32_is_refused_naming_the_flag():
    """flash-attn's kernels take float16 and bfloat16 alone: on a model computing in float32 (a float32 export scored
    by angle-eval, a float32 model given to train() without --bf16) the first forward failed inside them. Refused
    before the switch; with an autocast, the check passes to the package's (absent here: transformers' ImportError,
    reworded to name the flag)."""
    encoder, _ = make_encoder("llama", dtype=torch.float32)
    with pytest.raises(ValueError, match=r"^--attention flash_attention_2 computes in float16 or bfloat16, and the "
                                         r"model computes in float32 \(its weights, no autocast\)"):
        use_attention(encoder, "flash_attention_2")
    encoder.autocast = "bf16"
    if importlib.util.find_spec("flash_attn") is None:
        with pytest.raises(ValueError, match=r"^--attention flash_attention_2: .*FlashAttention2"):
            use_attention(encoder, "flash_attention_2")
    assert encoder.attention_implementation == "sdpa"


def test_a_model_that_cannot_switch_its_attention_is_refused_naming_the_flag(monkeypatch):
    """transformers only logs a warning where a model (remote code that picks its attention classes as it is built)
    cannot switch, and the run went on with the old attention: refused, naming the flag and the way to load it."""
    encoder, _ = make_encoder("llama", dtype=torch.float32)
    monkeypatch.setattr(encoder.backbone, "set_attn_implementation", lambda name: None)
    with pytest.raises(ValueError, match=r"^--attention eager: LlamaModel cannot switch its attention once loaded: "
                                         r"load it with from_pretrained\(\.\.\., attn_implementation='eager'\)$"):
        use_attention(encoder, "eager")
    assert encoder.attention_implementation == "sdpa"
    use_attention(encoder, "sdpa")  # what it has: nothing to switch


def test_a_float64_decoder_with_eager_attention_embeds_left_padded_rows_without_nan():
    """transformers' eager attention takes its softmax in float32, where a float64 model's masked scores are -inf: a
    left-padded row's padding tokens see no key under the causal mask, and their NaN reached the real tokens. The
    Encoder moves such rows to right padding: each text's embedding, and its gradient, is then that of the text
    embedded alone, as with sdpa attention."""
    embeddings = {}
    for attention in ("eager", "sdpa"):
        encoder, tokenizer = make_encoder("llama", dtype=torch.float64, pooling="avg")
        encoder.backbone.set_attn_implementation(attention)
        assert encoder.attention_implementation == attention
        embeddings[attention] = encoder.encode(TEXTS, tokenizer)
        alone = torch.cat([encoder.encode([text], tokenizer) for text in TEXTS])
        torch.testing.assert_close(embeddings[attention], alone, rtol=1e-6, atol=1e-6)
        ids = [tokenizer(text)["input_ids"] for text in TEXTS]
        input_ids, mask = pad_batch(ids, encoder.pad_token_id, encoder.padding_side, encoder.device)
        assert not mask[:, 0].all()  # left padding, as a decoder's batches have it
        encoder(input_ids, mask).square().sum().backward()
        assert all(torch.isfinite(p.grad).all() for p in encoder.parameters() if p.grad is not None)
    torch.testing.assert_close(embeddings["eager"], embeddings["sdpa"], rtol=1e-6, atol=1e-6)
