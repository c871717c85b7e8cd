"""Bidirectional attention for decoder LMs (issue 14, item 1): on, a token's embedding depends on the tokens after
it; off, it does not; either way padding never changes an embedding (left or right padding, alone or in a batch),
for LLaMA, Mistral and Qwen2 architectures under the eager and SDPA attention implementations."""

import os
import shutil

import pytest
import torch
from train_helpers import make_encoder, run_config

from angle_train.data import pad_batch
from angle_train.models import prepare_tokenizer, wrap_backbone
from angle_train.tiny import build_tokenizer

TEXTS = ["a small red car", "the dog is black and big", "it was a golden kite , very long", "box"]


def decoder(arch: str, attn: str, *, bidirectional: bool, pooling: str = "avg"):
    """(encoder, tokenizer): a random 2-layer decoder LM of the named architecture, float32, built from its config.
    (Not float64: transformers' eager attention takes its softmax in float32, where a float64 mask's minimum is
    -inf, so a causal model's fully masked padding rows become NaN and spread through the next layer's values.)"""
    import transformers

    tokenizer = prepare_tokenizer(build_tokenizer(), is_decoder=True)
    config_class = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                    "qwen2": transformers.Qwen2Config}[arch]
    config = config_class(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                          pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    backbone = transformers.AutoModel.from_config(config, attn_implementation=attn)
    encoder = wrap_backbone(backbone, pooling=pooling, pad_token_id=tokenizer.pad_token_id, is_decoder=True,
                            bidirectional=bidirectional)
    return encoder.eval(), tokenizer


def embed(encoder, seqs, side: str) -> torch.Tensor:
    with torch.no_grad():
        return encoder(*pad_batch(seqs, encoder.pad_token_id, side))


ARCHS = [(arch, attn) for arch in ("llama", "mistral", "qwen2") for attn in ("eager", "sdpa")]


@pytest.mark.parametrize("arch,attn", ARCHS)
def test_the_first_token_sees_later_tokens_only_when_bidirectional(arch, attn):
    """Two texts that differ only in their last word: the first token's hidden state (pooling 'cls') differs with
    bidirectional attention and is identical under the causal mask."""
    for bidirectional in (False, True):
        encoder, tokenizer = decoder(arch, attn, bidirectional=bidirectional, pooling="cls")
        seqs = tokenizer(["a small red car", "a small red boat"])["input_ids"]
        first = embed(encoder, seqs, "left")
        same = torch.equal(first[0], first[1])
        assert same != bidirectional, f"bidirectional={bidirectional}: first-token embeddings equal: {same}"


@pytest.mark.parametrize("arch,attn", ARCHS)
@pytest.mark.parametrize("bidirectional", [False, True])
def test_padding_never_changes_an_embedding(arch, attn, bidirectional):
    """Each text alone (no padding) = in a batch padded on the left = padded on the right (mean pooling reads every
    real token's state, so a padding token seen as a key anywhere would show)."""
    encoder, tokenizer = decoder(arch, attn, bidirectional=bidirectional)
    seqs = tokenizer(TEXTS)["input_ids"]
    alone = torch.cat([embed(encoder, [seq], "left") for seq in seqs])
    for side in ("left", "right"):
        torch.testing.assert_close(embed(encoder, seqs, side), alone, rtol=1e-5, atol=1e-6,
                                   msg=f"{side} padding changed an embedding")


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_eager_and_sdpa_agree_on_bidirectional_attention(arch):
    seqs = decoder(arch, "eager", bidirectional=True)[1](TEXTS)["input_ids"]
    eager = embed(decoder(arch, "eager", bidirectional=True)[0], seqs, "left")
    sdpa = embed(decoder(arch, "sdpa", bidirectional=True)[0], seqs, "left")
    torch.testing.assert_close(sdpa, eager, rtol=1e-5, atol=1e-6)
    causal = embed(decoder(arch, "eager", bidirectional=False)[0], seqs, "left")
    assert not torch.allclose(causal, eager)


def test_an_encoder_refuses_bidirectional():
    from angle_train.models import Encoder

    with pytest.raises(ValueError, match="attention is bidirectional already"):
        Encoder(make_encoder("bert")[0].backbone, pooling="cls", is_decoder=False, pad_token_id=0, bidirectional=True)
    with pytest.raises(ValueError, match="attention is bidirectional already"):
        make_encoder("bert")[0].bidirectional = True


def test_first_token_pooling_of_a_causal_decoder_is_refused_before_training(tmp_path):
    """A causal decoder's first token sees itself alone: --pooling cls gave every text one embedding (the BOS
    token's, or the prompt's first word's), and the run trained at a constant loss, said only by the dev check's
    "embeddings collapsed". Refused before training, naming the pooling and the way out; with --bidirectional the
    first token sees the text, and the run trains."""
    from angle_train.trainer import train

    cfg = run_config(tmp_path / "causal", model="builtin:tiny-llama", pooling="cls", max_steps=1, batch_size=8)
    with pytest.raises(ValueError, match=r"^pooling cls \(--pooling\) on a causal decoder LM: .*use pooling last "):
        train(cfg)
    with pytest.raises(ValueError, match=r"^pooling cls \(the model given to train\(\)\) on a causal decoder"):
        train(run_config(tmp_path / "causal", max_steps=1, batch_size=8), model=make_encoder("llama", pooling="cls"))
    assert not os.path.exists(tmp_path / "causal" / "metrics.jsonl")
    cfg = run_config(tmp_path / "both", model="builtin:tiny-llama", pooling="cls", bidirectional=True, max_steps=1,
                     batch_size=8)
    assert train(cfg).encoder.pooling == "cls"


def test_first_and_mean_token_pooling_of_a_causal_decoder_is_noted(tmp_path, capsys):
    """--pooling cls_avg on a causal decoder trains (its mean half reads the text) and says at start-up that the other
    half, the first token's state, is the same for every text that starts with that token; with --bidirectional the
    first token reads the text, and nothing is said."""
    from angle_train.trainer import train

    said = ("angle_train: note: pooling cls_avg (--pooling) on a causal decoder LM: half of each embedding is the "
            "first token's state, which sees no other token, the same for every text that starts with that token")
    train(run_config(tmp_path / "causal", model="builtin:tiny-llama", pooling="cls_avg", max_steps=1, batch_size=8))
    assert said in capsys.readouterr().out
    train(run_config(tmp_path / "both", model="builtin:tiny-llama", pooling="cls_avg", bidirectional=True,
                     max_steps=1, batch_size=8))
    assert "note: pooling cls_avg" not in capsys.readouterr().out


def test_training_with_lora_exports_and_reloads_a_bidirectional_model(tmp_path, capsys):
    """angle-train --model builtin:tiny-llama --bidirectional --lora: the final export records the switch,
    load_pretrained restores it (same embeddings; a causal reload would differ), and no sentence-transformers files
    are written (it would load the model causal)."""
    pytest.importorskip("peft")
    from angle_train.export import load_pretrained
    from angle_train.trainer import train

    cfg = run_config(tmp_path, model="builtin:tiny-llama", bidirectional=True, lora=True, lora_r=4, pooling="avg",
                     max_steps=2, batch_size=8, save_final=True)
    result = train(cfg)
    assert result.encoder.bidirectional
    ours = result.encoder.encode(TEXTS, result.tokenizer)
    reloaded, tokenizer, meta = load_pretrained(result.final_path)
    assert meta["bidirectional"] and reloaded.bidirectional
    torch.testing.assert_close(reloaded.encode(TEXTS, tokenizer), ours, rtol=1e-5, atol=1e-6)
    reloaded.bidirectional = False
    assert not torch.allclose(reloaded.encode(TEXTS, tokenizer), ours, rtol=1e-3, atol=1e-4)  # causal again
    assert not os.path.exists(os.path.join(result.final_path, "modules.json"))
    assert "sentence-transformers would load the model with its causal mask" in capsys.readouterr().out


def test_the_hugging_face_folder_only_note_is_given_once_per_folder(tmp_path, capsys):
    """A training's best/ is written again at each new best score (as best.tmp, swapped into place): the note that
    sentence-transformers cannot load it was printed at every one of them; now at the first, and once for final/."""
    from angle_train.export import save_pretrained

    encoder, tokenizer = make_encoder("llama", dtype=torch.float32, pooling="avg")
    encoder.bidirectional = True
    best, staged = tmp_path / "best", tmp_path / "best.tmp"
    for _ in range(3):
        save_pretrained(encoder, tokenizer, str(staged), max_length=16)
        if best.exists():
            shutil.rmtree(best)
        os.replace(staged, best)
    save_pretrained(encoder, tokenizer, str(tmp_path / "final"), max_length=16)
    out = capsys.readouterr().out
    assert out.count(f"note: {best} is a Hugging Face folder only: ") == 1
    assert out.count(f"note: {tmp_path / 'final'} is a Hugging Face folder only: ") == 1


def test_training_from_a_bidirectional_export_keeps_its_attention(tmp_path, capsys):
    """--model FOLDER of an export trained with bidirectional attention, without --bidirectional: its causal mask came
    back in silence (the review's step-0 dev nDCG@10 fell from the export's 0.74 to 0.30), and the next export recorded
    it causal. The folder's attention is kept, as its pooling is, said in the start-up line and recorded."""
    pytest.importorskip("peft")
    from angle_train.trainer import train

    first = train(run_config(tmp_path / "first", model="builtin:tiny-llama", bidirectional=True, lora=True, lora_r=4,
                             pooling="avg", max_steps=1, batch_size=8, save_final=True))
    capsys.readouterr()
    again = run_config(tmp_path / "again", model=first.final_path, max_steps=1, batch_size=8)
    result = train(again)
    assert result.encoder.bidirectional and again.bidirectional
    out = capsys.readouterr().out
    assert "pooling avg (the model folder's angle_train.json) | bidirectional attention (the model folder's " \
           "angle_train.json)" in out
    # --bidirectional 0 given: the run trains causal as asked (it was ignored: the export's attention won in silence),
    # said in a note, recorded
    causal = run_config(tmp_path / "causal", model=first.final_path, bidirectional=False, max_steps=1, batch_size=8)
    result = train(causal)
    assert not result.encoder.bidirectional and causal.bidirectional is False
    out = capsys.readouterr().out
    assert ("angle_train: note: --bidirectional 0 trains the model with its causal mask, and the model folder's "
            "angle_train.json records that it was trained with bidirectional attention") in out
    assert "| bidirectional attention (" not in out
    assert "--bidirectional 0" in causal.command_line() and "--bidirectional 1" in again.command_line()


def test_a_model_given_to_train_keeps_its_attention_unless_bidirectional_is_given(tmp_path):
    """A bidirectional model given to train() trains bidirectional, and its run records so (config.json said false);
    bidirectional=False given switches it causal (it was ignored), and a refused run puts it back."""
    from angle_train.tiny import demo_examples
    from angle_train.trainer import train

    encoder, tokenizer = make_encoder("llama", dtype=torch.float32, pooling="avg")
    encoder.bidirectional = True
    data = (demo_examples(8, seed=1), "B")
    kept = run_config(tmp_path / "kept", max_steps=1, batch_size=4)
    assert train(kept, model=(encoder, tokenizer), train_examples=data).encoder.bidirectional and kept.bidirectional
    causal = run_config(tmp_path / "causal", bidirectional=False, max_steps=1, batch_size=4)
    assert not train(causal, model=(encoder, tokenizer), train_examples=data).encoder.bidirectional
    encoder.bidirectional = True
    with pytest.raises(ValueError, match="pooling"):  # refused at setup (first-token pooling on a causal decoder)
        train(run_config(tmp_path / "refused", bidirectional=False, pooling="cls", max_steps=1, batch_size=4),
              model=(encoder, tokenizer), train_examples=data)
    assert encoder.bidirectional


def test_a_checkpoint_written_when_the_switch_defaulted_to_false_resumes_without_it():
    """--bidirectional's default became None (not given) so that an explicit 0 can be told from it: a checkpoint whose
    config.json says false, as runs without the flag wrote before, is the same setting as a run without the flag now;
    one that was bidirectional is not."""
    from angle_train.checkpoint import _same_setting

    assert _same_setting("bidirectional", False, None) and _same_setting("bidirectional", None, False)
    assert not _same_setting("bidirectional", True, None) and not _same_setting("bidirectional", True, False)
