"""The angle-train command line: --help, booleans, config files, errors."""

import dataclasses
import json
import re
import subprocess
import sys

import pytest

from angle_train.cli import config_from_args, main
from angle_train.config import TrainConfig


def test_help_explains_itself():
    out = subprocess.run(
        [sys.executable, "-m", "angle_train.cli", "--help"], check=False, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    for needle in (
        "usage: angle-train",
        "--batch-size",
        "--chunk-size",
        "gradient cache",
        "--bf16 [0|1]",
        "examples:",
        "--resume",
        "format",
        "(default: 32)",
    ):
        assert needle in out.stdout, needle


def test_help_shows_list_defaults_as_words():
    """A list flag's default reads as the words to type (--mask-rates 0.2 0.4), and an empty one is not shown."""
    from angle_train.cli import build_parser

    text = " ".join(build_parser().format_help().split())  # argparse wraps the help at the terminal's width
    assert "(default: 0.2 0.4)" in text and "(default: none)" in text
    assert "(default: )" not in text and "(default: [" not in text


def test_every_flag_of_both_commands_says_what_it_does():
    """Every option of angle-train and angle-eval has a help text: angle-eval's --pooling and --batch-size had none,
    so --help gave neither their meaning nor their default."""
    from angle_train import evaluate
    from angle_train.cli import build_parser

    for parser in (build_parser(), evaluate.build_parser()):
        silent = [action.option_strings[0] for action in parser._actions
                  if action.option_strings and not (action.help or "").strip()]
        assert silent == [], f"{parser.prog}: {silent}"
    text = " ".join(evaluate.build_parser().format_help().split())
    assert "texts per forward pass (default: 128)" in text
    assert "how token states make the embedding: cls, cls_avg, avg, max, last (default: the export's" in text


@pytest.mark.parametrize(
    "argv, expected",
    [
        ([], False),
        (["--bf16"], True),
        (["--bf16", "1"], True),
        (["--bf16", "0"], False),
        (["--bf16", "false"], False),
        (["--bf16", "True"], True),
        (["--bf16", "off"], False),
        (["--bf16", "yes"], True),
        (["--bf16", "on"], True),
        (["--bf16", "no"], False),
        (["--bf16", " on "], True),  # from a quoted shell variable or a padded config value
    ],
)
def test_booleans_parse(argv, expected):
    assert config_from_args(argv).bf16 is expected


@pytest.mark.parametrize("argv, said", [
    (["--bf16", "maybe"], "expected a boolean"), (["--batch-size", "0"], "--batch-size must be >= 1"),
    (["--pooling", "mean"], "invalid choice"), (["--bf16", "1", "--fp16", "1"], "--bf16 and --fp16"),
    (["--chunk-size", "8", "--chunk-tokens", "512"], "--chunk-size (texts per pass) and --chunk-tokens"),
    (["--pass-tokens", "512", "--chunk-size", "8"], "leave out --pass-tokens"),
    (["--chunk-tokens", "-1"], "--chunk-tokens must be >= 0"),
    (["--ibn-partition", "joint"], "invalid choice"), (["--false-negative-strategy", "percent"], "invalid choice"),
    (["--false-negative-margin", "tight"], "invalid float"),
    # every number is range-checked, naming its flag (issue 29): NaN and infinities are never settings
    (["--warmup", "nan"], "--warmup must be a finite number"), (["--warmup", "-1"], "--warmup must be >= 0"),
    (["--epochs", "nan"], "--epochs must be a finite"), (["--epochs", "inf"], "--epochs must be a finite"),
    (["--epochs", "0"], "--epochs must be > 0"), (["--seed", str(2**70)], "--seed must be between 0 and"),
    (["--seed", "-1"], "--seed must be between 0 and"), (["--max-grad-norm", "nan"], "--max-grad-norm must be a"),
    (["--max-grad-norm", "-1"], "--max-grad-norm must be >= 0"), (["--lora-dropout", "nan"], "--lora-dropout must"),
    (["--lora-dropout", "1"], "--lora-dropout must be >= 0 and < 1"), (["--cosine-tau", "-20"], "--cosine-tau must"),
    (["--ibn-tau", "0"], "--ibn-tau must be > 0"), (["--angle-tau", "inf"], "--angle-tau must be a finite"),
    (["--lr", "inf"], "--lr must be a finite number"), (["--lr", "0"], "--lr must be > 0"),
    (["--eval-batch-size", "0"], "--eval-batch-size must be >= 1"), (["--ibn-w", "-1"], "--ibn-w must be >= 0"),
    (["--weight-decay", "nan"], "--weight-decay must be a finite"), (["--triplet-w", "-0.1"], "--triplet-w must be"),
    (["--lora-alpha", "0"], "--lora-alpha must be > 0"), (["--keep-checkpoints", "-1"], "--keep-checkpoints must"),
    (["--lora", "1", "--lora-alpha", "-0.5"], "--lora-alpha must be > 0; got -0.5"),
    (["--lora", "1", "--lora-alpha", "nan"], "--lora-alpha must be a finite number; got nan"),
    (["--lora", "1", "--lora-alpha", "inf"], "--lora-alpha must be a finite number; got inf"),
    (["--false-negative-margin", "nan"], "--false-negative-margin must be a finite number"),
    (["--arccon-tau", "0"], "--arccon-tau"), (["--espresso-dim", "0"], "--espresso-dim must be >= 1"),
    # past float32's range for the logits: the loss's own bound, with the flag named
    (["--cosine-tau", "1e38"], "--cosine-tau: cosine_tau must be <= 8.5e+37"), (["--ibn-tau", "9e37"], "--ibn-tau: "),
    (["--max-length", "0"], "--max-length must be >= 1"), (["--grad-accum", "0"], "--grad-accum must be >= 1"),
    (["--lora", "1", "--lora-r", "0"], "--lora-r must be >= 1"), (["--pass-tokens", "-1"], "--pass-tokens must be"),
    (["--pack", "-1"], "--pack must be >= 0"), (["--eval-every", "-1"], "--eval-every must be >= 0"),
    (["--export-max-length", "0"], "--export-max-length must be >= 1"), (["--cosine-w", "-1"], "--cosine-w must be"),
    (["--bucket", "-1"], "--bucket must be >= 0"),
    (["--seed", str(2**32)], "--seed must be between 0 and 4294967295; got 4294967296"),
    (["--pass-tokens", "512", "--chunk-tokens", "256"], "leave out --pass-tokens"),
    (["--mask-rates", "0.2", "1"], "--mask-rates: expected two fractions 0 <= weak <= strong < 1"),
    (["--device", ""], "--device must name a device (cpu, cuda, cuda:1...); got an empty text"),
    # settings that apply only with another one, which is off
    (["--lora-alpha", "64"], "--lora-alpha sets up LoRA adapters, which train only with --lora 1"),
    (["--lora-dropout", "0.1"], "--lora-dropout sets up LoRA adapters"),
    (["--lora-rslora", "1"], "--lora-rslora sets up LoRA adapters, which train only with --lora 1"),
    (["--lora", "1", "--lora-targets", "q_proj,"], "--lora-targets q_proj,: an empty layer name; expected names "
                                                   "separated by spaces or commas"),
    (["--lora", "1", "--lora-path", "missing-adapter"], "--lora-path missing-adapter: no such folder; expected a "
                                                        "local folder of a LoRA adapter"),
    (["--triplet-w", "0.5"], "--triplet-w is a setting of --objective arccse, and this run trains --objective angle"),
    (["--arccon-margin", "5"], "--arccon-margin is a setting of --objective arccse"),
    (["--mask-rates", "0.1", "0.3"], "--mask-rates is a setting of --objective arccse"),
    (["--model-dtype", "float16", "--bf16", "1"], "the weights are one 16-bit type and the autocast the other"),
    (["--objective", "arccse", "--columns", "text1=sentence"], "--columns maps pairs' columns"),
    (["--objective", "arccse", "--data-format", "A"], "from raw sentences: leave out --espresso and --data-format"),
])
def test_bad_values_are_rejected_naming_the_flag(argv, said, capsys):
    """At parse time, so before any model or data is loaded."""
    with pytest.raises(SystemExit) as exc:
        config_from_args(argv)
    assert exc.value.code == 2, argv
    assert said in capsys.readouterr().err, argv


def test_the_ends_of_each_range_are_settings():
    """A value at the edge of its flag's range is accepted: numpy's largest seed, a weak mask rate of 0 (with
    --triplet-w 0: ArcCon alone, whose copies are not embedded; the triplet term refuses it), a LoRA rank of 1, one
    pair per loss computation (format C's; formats A and B, checked with the data, and ArcCSE need two), no LoRA
    dropout."""
    cfg = config_from_args(["--seed", str(2**32 - 1), "--objective", "arccse", "--mask-rates", "0", "0.99",
                            "--triplet-w", "0", "--lora", "1", "--lora-r", "1", "--lora-dropout", "0"])
    assert (cfg.seed, cfg.mask_rates, cfg.lora_r, cfg.lora_dropout) == (2**32 - 1, [0.0, 0.99], 1, 0)
    assert config_from_args(["--batch-size", "1"]).batch_size == 1


def test_lora_alpha_takes_any_positive_number_and_a_whole_one_reads_as_written(tmp_path):
    """--lora-alpha takes what peft's LoraConfig takes (the scale is alpha / r): 16.5 from the flag, 0.5 from a
    --config file. A whole one stays whole, 48.0 as 48, in the recorded command and config.json (json.dumps of the
    settings); 32.0 is the default, 32."""
    cfg = config_from_args(["--lora", "1", "--lora-alpha", "16.5"])
    assert cfg.lora_alpha == 16.5 and "--lora-alpha 16.5 " in cfg.command_line()
    settings = tmp_path / "run.yaml"
    settings.write_text("lora: true\nlora_alpha: 0.5\n")
    assert config_from_args(["--config", str(settings)]).lora_alpha == 0.5
    whole = config_from_args(["--lora", "1", "--lora-alpha", "48.0"])
    assert json.dumps(whole.lora_alpha) == "48" and "--lora-alpha 48 " in whole.command_line()
    assert not config_from_args(["--lora", "1", "--lora-alpha", "32.0"]).changed("lora_alpha")
    huge = config_from_args(["--lora", "1", "--lora-alpha", "1e300"])  # whole, read with its exponent, not 301 digits
    assert json.dumps(huge.lora_alpha) == "1e+300" and "--lora-alpha 1e+300 " in huge.command_line()


def test_the_defaults_are_the_documented_ones():
    """A run without flags trains with angle-emb 0.6.1's loss weights and scales (the README's deviations table),
    evaluates before the first step, stops after 5 non-finite steps in a row and waits 1800 s at a collective."""
    cfg = config_from_args([])
    loss = {name: getattr(cfg, name) for name in ("cosine_w", "ibn_w", "cln_w", "angle_w", "cosine_tau", "ibn_tau",
                                                  "angle_tau")}
    assert loss == {"cosine_w": 0, "ibn_w": 1, "cln_w": 1, "angle_w": 0.02, "cosine_tau": 20, "ibn_tau": 20,
                    "angle_tau": 20}
    assert (cfg.eval_on_start, cfg.max_bad_steps, cfg.ddp_timeout) == (True, 5, 1800)
    assert (cfg.lora_r, cfg.lora_alpha, cfg.lora_dropout, cfg.report_to, cfg.progress) == (16, 32, 0.05, ["none"], True)


class NothingLoads:
    """Stands in for the model and data loaders (and the network) of angle_train.trainer: a check that is meant to
    come before them fails the test if they are reached."""

    def __init__(self, monkeypatch):
        import socket

        from angle_train import trainer

        for name in ("build_encoder", "read_data", "read_dev_data", "read_sentences"):
            monkeypatch.setattr(trainer, name, self.refuse(name))
        monkeypatch.setattr(socket.socket, "connect", self.refuse("the network"))

    @staticmethod
    def refuse(what):
        def called(*args, **kwargs):
            raise AssertionError(f"{what} was reached")
        return called


@pytest.mark.parametrize("argv, said", [
    (["--train-data", "data/nope.jsonl"], "--train-data data/nope.jsonl: no such file or folder"),
    (["--train-data", "nope.csv"], "--train-data nope.csv: no such file"),
    (["--dev-data", "./sts/dev.tsv"], "--dev-data ./sts/dev.tsv: no such file"),
    (["--model", "runs/first/final"], "--model runs/first/final: no such file or folder"),
    (["--model", "data/my-model"], "--model data/my-model: no such"),  # data/ exists: a folder here, not a hub owner
    (["--model", "/models/nope"], "--model /models/nope: no such"),
    (["--resume", "runs/x/checkpoints/step-00000010"], "--resume runs/x/checkpoints/step-00000010: no such"),
])
def test_a_missing_local_path_fails_before_anything_loads(argv, said, tmp_path, monkeypatch):
    """A path that does not exist is never passed on to Hugging Face, which would look it up on the Hub (retrying
    the network for ~30 s, then failing with a message about repo ids)."""
    from angle_train.trainer import train

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    NothingLoads(monkeypatch)
    with pytest.raises(ValueError, match="Hugging Face hub name") as error:
        train(config_from_args(["--output-dir", "out", "--device", "cpu", *argv]))
    assert said in str(error.value)


def test_hub_names_are_not_taken_for_paths(tmp_path, monkeypatch):
    from angle_train.data import names_local_path

    monkeypatch.chdir(tmp_path)
    for name in ("sentence-transformers/all-MiniLM-L6-v2", "bert-base-uncased", "mteb/stsbenchmark-sts",
                 "builtin:demo", "SeanLee97/angle-llama-7b-nli-v2"):
        assert not names_local_path(name), name
    for name in ("./model", "../data", "/abs/model", "~/model", "runs/a/final", "train.jsonl", "x/y.csv",
                 "PAIRS.JSONL"):
        assert names_local_path(name), name


@pytest.mark.parametrize("argv, said", [
    (["--batch-size", "1"], "--batch-size 1 with format B"),
    (["--data-format", "A", "--train-data", "pairs.csv", "--ibn-w", "0", "--angle-w", "0"],
     "every loss weight of format A (--cosine-w, --ibn-w, --angle-w) is 0"),
    (["--query-prompt", "query: ", "--data-format", "A", "--train-data", "pairs.csv"], "--query-prompt"),
])
def test_settings_the_data_cannot_train_are_refused_before_the_model_loads(argv, said, tmp_path, monkeypatch):
    from angle_train import trainer

    monkeypatch.chdir(tmp_path)
    (tmp_path / "pairs.csv").write_text("text1,text2,label\na b,a c,1\nd e,f g,0\n")
    monkeypatch.setattr(trainer, "build_encoder", NothingLoads.refuse("the model"))
    with pytest.raises(ValueError, match=re.escape(said)):
        trainer.train(config_from_args(["--output-dir", "out", "--device", "cpu", "--progress", "0", *argv]))


def test_max_length_beyond_the_models_position_table_is_refused_before_any_text_is_tokenised(tmp_path, monkeypatch):
    """The built-in tiny BERT has 128 positions (a RoBERTa would lose 2 to its padding offset): --max-length 129
    would fail at the first long batch, after minutes and again on every resume."""
    from angle_train import trainer

    monkeypatch.setattr(trainer, "TokenizedPairs", NothingLoads.refuse("tokenisation"))
    with pytest.raises(ValueError, match="--max-length 129 is longer than the model can read: its position table "
                                         "holds 128 positions"):
        trainer.train(config_from_args(["--output-dir", str(tmp_path), "--device", "cpu", "--max-length", "129"]))


def test_the_position_limit_of_each_architecture():
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaModel, RobertaConfig, RobertaModel

    from angle_train.models import position_limit

    small = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=50,
                 max_position_embeddings=40)
    assert position_limit(BertModel(BertConfig(**small))) == 40
    assert position_limit(RobertaModel(RobertaConfig(pad_token_id=1, **small))) == 38  # positions from pad + 1
    assert position_limit(LlamaModel(LlamaConfig(num_key_value_heads=2, **small))) is None  # rotary: no table


def test_a_table_the_size_of_the_positions_that_numbers_no_positions_gives_no_limit():
    """DeBERTa-v3's relative-position buckets (2 x position_buckets rows, here as many as max_position_embeddings)
    limit no length: it reads longer texts. LoRA on the token embeddings, as many rows as positions, leaves the
    position table the one found."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import BertConfig, BertModel, DebertaV2Config, DebertaV2Model

    from angle_train.models import position_limit

    deberta = DebertaV2Model(DebertaV2Config(
        hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vocab_size=50,
        max_position_embeddings=40, position_biased_input=False, relative_attention=True, position_buckets=20,
        pos_att_type=["p2c", "c2p"]))
    assert deberta.encoder.rel_embeddings.num_embeddings == 40
    assert position_limit(deberta) is None
    with torch.no_grad():
        deberta(torch.ones(1, 41, dtype=torch.long))  # reads past max_position_embeddings
    bert = BertModel(BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                                vocab_size=40, max_position_embeddings=40))
    lora = get_peft_model(bert, LoraConfig(r=2, target_modules=["word_embeddings", "query"]))
    assert position_limit(lora) == 40


def test_a_position_table_under_another_name_limits_the_length_as_its_config_says():
    """GPT-2's table is `wpe` (n_positions rows) and OPT's `embed_positions` (max_position_embeddings + 2 rows: it
    adds 2 to every position id): both had no limit, so a longer --max-length reached an IndexError inside the
    forward pass. The limit is the positions the model reads: all of them run, one more does not; angle-train's
    encoder and angle-eval refuse one more."""
    import torch
    from transformers import GPT2Config, GPT2Model, OPTConfig, OPTModel

    from angle_train import evaluate
    from angle_train.models import position_limit, wrap_backbone

    backbones = (
        GPT2Model(GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50, n_positions=40, bos_token_id=0,
                             eos_token_id=0)),
        OPTModel(OPTConfig(hidden_size=16, word_embed_proj_dim=16, num_hidden_layers=1, num_attention_heads=2,
                           ffn_dim=32, vocab_size=50, max_position_embeddings=40)),
    )
    for backbone in backbones:
        assert position_limit(backbone) == 40, type(backbone).__name__
        with torch.no_grad():
            backbone(torch.ones(1, 40, dtype=torch.long))
            with pytest.raises(IndexError):
                backbone(torch.ones(1, 41, dtype=torch.long))
        encoder = wrap_backbone(backbone, pooling="last", pad_token_id=1)
        with pytest.raises(ValueError, match="max_length 41 is longer than the model can read: its position table "
                                             "holds 40 positions"):
            encoder.encoding_length(41)
        with pytest.raises(ValueError, match="--max-length 41 is longer than m can read: its position table holds "
                                             "40 positions"):
            evaluate.encoding_length(41, {"max_length": 40}, encoder, None, "m")


def test_config_files_and_precedence(tmp_path):
    yaml_file = tmp_path / "run.yaml"
    yaml_file.write_text("lr: 1.0e-4\nbf16: 'off'\nlora: true\nlora-targets: [q_proj, v_proj]\nbatch_size: 64\n")
    cfg = config_from_args(["--config", str(yaml_file), "--batch-size", "8"])
    assert (cfg.lr, cfg.bf16, cfg.lora, cfg.lora_targets, cfg.batch_size) == (
        1e-4,
        False,
        True,
        ["q_proj", "v_proj"],
        8,
    )
    toml_file = tmp_path / "run.toml"
    toml_file.write_text('model = "builtin:tiny-llama"\nbf16 = 1\nepochs = 2\n')
    cfg = config_from_args(["--config", str(toml_file)])
    assert (cfg.model, cfg.bf16, cfg.epochs) == ("builtin:tiny-llama", True, 2.0)
    bad = tmp_path / "bad.yaml"
    bad.write_text("learning_rate: 1\n")
    with pytest.raises(SystemExit):
        config_from_args(["--config", str(bad)])


@pytest.mark.parametrize("name, text, expected", [
    ("run.yml", "batch_size: 8\n", {"batch_size": 8}),  # .yml, the other YAML suffix
    ("RUN.YAML", "batch_size: 8\n", {"batch_size": 8}),  # a suffix in upper case, as data files' are read
    ("Run.Toml", "batch_size = 8\n", {"batch_size": 8}),
    ("RUN.JSON", '{"batch_size": 8}', {"batch_size": 8}),
    (".yaml", "batch_size: 8\n", {"batch_size": 8}),  # a file named by its suffix alone, as before case was ignored
    ("empty.yaml", "", {}),  # nothing set yet: the defaults
    ("comments.yaml", "# lr: 1e-4\n", {}),
])
def test_config_files_read_by_suffix_and_empty_ones_keep_the_defaults(tmp_path, name, text, expected):
    path = tmp_path / name
    path.write_text(text)
    assert config_from_args(["--config", str(path)]) == dataclasses.replace(TrainConfig(), **expected).validate()


@pytest.mark.parametrize("text, got", [("- lr: 1.0e-4\n", "list"), ("lr\n", "str")])
def test_a_config_file_that_is_not_a_mapping_is_one_line(tmp_path, capsys, text, got):
    path, err = _config_file_error(tmp_path, capsys, text)
    assert f"--config {path}: expected a mapping of settings (name: value); got {got}" in err


def _config_file_error(tmp_path, capsys, text: str) -> tuple:
    """(the config file, angle-train's error) for a config file of this text, which must be refused: exit status 2,
    one line."""
    path = tmp_path / "run.yaml"
    path.write_text(text)
    with pytest.raises(SystemExit) as exited:
        config_from_args(["--config", str(path)])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and len(err.splitlines()) == 1
    return path, err


def test_null_in_a_config_file_means_off_where_off_is_the_default(tmp_path, capsys):
    """YAML null for a setting whose default is None (off) keeps it off; for any other setting it is an error
    naming the setting (it used to fail with float(None))."""
    off = tmp_path / "off.yaml"
    off.write_text("false_negative_margin: null\ndevice: null\n")
    cfg = config_from_args(["--config", str(off)])
    assert cfg.false_negative_margin is None and cfg.device is None
    wrong = tmp_path / "wrong.yaml"
    wrong.write_text("lr: null\n")
    with pytest.raises(SystemExit):
        config_from_args(["--config", str(wrong)])
    assert "setting 'lr' cannot be null" in capsys.readouterr().err


def test_main_runs_a_short_training(tmp_path, capsys):
    assert (
        main(
            [
                "--max-steps",
                "2",
                "--batch-size",
                "8",
                "--max-length",
                "12",
                "--output-dir",
                str(tmp_path),
                "--progress",
                "0",
                "--device",
                "cpu",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "pairs/s" in out and (tmp_path / "final" / "config.json").exists()
    assert f"final model: {tmp_path / 'final'}" in out.splitlines()  # where the model went, the run's last word


def test_loss_flags_reach_angle_loss(tmp_path):
    """--ibn-partition and the false-negative filter's flags (and their defaults) end up in the AngleLoss that
    setup() builds."""
    from angle_train.tiny import demo_examples
    from angle_train.trainer import setup
    from train_helpers import make_encoder

    base = ["--output-dir", str(tmp_path), "--device", "cpu", "--progress", "0"]
    flags = ["--ibn-partition", "gte", "--false-negative-margin", "0.1", "--false-negative-strategy", "relative"]
    for argv, expected in ((base, ("angle", None, "absolute")), (base + flags, ("gte", 0.1, "relative"))):
        run = setup(config_from_args(argv), model=make_encoder(), train_examples=(demo_examples(64), "B"))
        run.log.close()
        loss = run.loss_fn
        assert (loss.ibn_partition, loss.false_negative_margin, loss.false_negative_strategy) == expected, argv


def test_every_flag_in_the_readmes_commands_exists():
    """The angle-train and angle-eval commands written in the READMEs use flags the parsers know."""
    from pathlib import Path

    from angle_train import cli, evaluate

    root = Path(__file__).resolve().parents[2]
    known = {"angle-train": set(cli.build_parser()._option_string_actions),
             "angle-eval": set(evaluate.build_parser()._option_string_actions)}
    checked = 0
    for readme in (root / "README.md", root / "angle_train" / "README.md"):
        text = readme.read_text().replace("\\\n", " ")  # join continued lines
        for line in text.splitlines():
            command = re.search(r"(angle-train|angle_train\.cli|angle-eval)\b(.*)", line.split("#")[0])
            if not command or "[" in command.group(2):  # a usage synopsis, not a command
                continue
            name = "angle-eval" if command.group(1) == "angle-eval" else "angle-train"
            for flag in re.findall(r"(?<!\S)(--[a-z][a-z0-9-]*)", command.group(2)):
                where = readme.relative_to(root)
                assert flag in known[name], f"{where}: {name} has no flag {flag} ({line.strip()[:80]})"
                checked += 1
    assert checked > 50


@pytest.mark.parametrize("target, said", [
    ("nonexistent", "'nonexistent' matches no module of the model"),
    ("input_layernorm", "'input_layernorm' names a LlamaRMSNorm, which LoRA cannot adapt"),
])
def test_lora_targets_the_model_lacks_are_one_line(tmp_path, capsys, target, said):
    with pytest.raises(SystemExit) as exited:
        main(["--model", "builtin:tiny-llama", "--lora", "1", "--lora-targets", target, "--output-dir", str(tmp_path),
              "--max-steps", "1", "--batch-size", "8", "--device", "cpu", "--progress", "0"])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err and len(err.splitlines()) == 1
    assert err.startswith(f"angle-train: error: --lora-targets {target}: {said}") and "q_proj" in err
    assert not (tmp_path / "metrics.jsonl").exists()


@pytest.mark.parametrize("changed, said", [
    (["--lora-r", "8"], ("lora_r: 4 -> 8), so its trained weights do not fit this model; resume with the "
                         "checkpoint's (--lora-r 4)")),
    (["--lora-targets", "q_proj"], ("lora_targets: [] -> ['q_proj']), so its trained weights do not fit this model; "
                                    "resume with the checkpoint's (no --lora-targets)")),
])
def test_resume_with_other_lora_shapes_is_one_line(tmp_path, capsys, changed, said):
    common = ["--model", "builtin:tiny-llama", "--lora", "1", "--lora-r", "4", "--max-steps", "2", "--batch-size",
              "8", "--max-length", "12", "--save-every", "2", "--output-dir", str(tmp_path), "--device", "cpu",
              "--progress", "0", "--save-final", "0"]
    assert main(common) == 0
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        main([*common, *changed, "--resume", str(tmp_path / "checkpoints" / "step-00000002")])
    err = capsys.readouterr().err
    assert exited.value.code == 2 and "Traceback" not in err and len(err.splitlines()) == 1
    assert err.startswith("angle-train: error: cannot resume from ") and said in err


@pytest.mark.parametrize("text, expected", [
    ("matryoshka_dims: 32\n", {"matryoshka_dims": [32]}),  # one value, as `--matryoshka-dims 32`
    ("matryoshka_dims: [32]\nmatryoshka_weights: 1\n", {"matryoshka_dims": [32], "matryoshka_weights": [1.0]}),
    ("lora_targets: []\ncolumns: []\n", {"lora_targets": [], "columns": []}),  # empty defaults, as config.json has
])
def test_config_file_values_are_read_as_the_flags_read_them(tmp_path, text, expected):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    cfg = config_from_args(["--config", str(path)])
    assert {name: getattr(cfg, name) for name in expected} == expected


@pytest.mark.parametrize("text, said", [
    ("max_length: 100.7\n", "--config: setting 'max_length': invalid int value: 100.7"),
    ("seed: true\n", "--config: setting 'seed': invalid int value: True"),
    ("lr: true\n", "--config: setting 'lr': invalid float value: True"),
    ("objective: arccse\nmask_rates: 0.2\n", "--mask-rates: expected two fractions"),
    ("matryoshka_dims: [true]\n", "--config: setting 'matryoshka_dims': expected numbers"),
    ("lora_targets: 5\n", "--config: setting 'lora_targets': expected texts"),
    # an empty list, as a list flag without words: the run's recorded command ended in a bare --report-to
    ("report_to: []\n", "--config: setting 'report_to': expected at least one value"),
    # one setting under two of its names: the later one won, silently
    ("batch-size: 8\nbatch_size: 16\n", "--config: the settings 'batch-size' and 'batch_size' are one setting"),
    ("prompt: a\ntext_prompt: b\n", "--config: the settings 'prompt' and 'text_prompt' are one setting (prompt)"),
])
def test_config_file_values_the_flags_would_refuse_are_one_line(tmp_path, capsys, text, said):
    assert _config_file_error(tmp_path, capsys, text)[1].startswith(f"angle-train: error: {said}")


def test_the_recorded_command_makes_the_same_settings():
    """The command a model card records (flags that differ from the defaults, the model and the data always) run
    again gives the run's settings: a list as its words, a boolean as 1 or 0."""
    import shlex

    argv = ["--matryoshka-dims", "32", "16", "--bf16", "--sort-passes", "0", "--report-to", "tensorboard", "wandb"]
    cfg = config_from_args(argv)
    command = cfg.command_line()
    assert command == ("angle-train --model builtin:tiny-bert --bf16 1 --train-data builtin:demo --sort-passes 0 "
                       "--matryoshka-dims 32 16 --report-to tensorboard wandb")
    words = shlex.split(command)
    assert words[0] == "angle-train" and config_from_args(words[1:]) == cfg


def test_a_runs_config_json_is_a_config_file(tmp_path):
    """OUTPUT_DIR/config.json (every setting, empty lists included) read back with --config gives the same
    settings."""
    import dataclasses
    import json

    settings = dataclasses.replace(TrainConfig(), batch_size=8, report_to=["none"]).validate()
    path = tmp_path / "config.json"
    path.write_text(json.dumps(dataclasses.asdict(settings)))
    assert config_from_args(["--config", str(path)]) == settings


def test_lora_targets_take_commas_as_angle_emb_writes_them(tmp_path):
    """--lora-targets q_proj,v_proj (angle-emb's lora_target_modules form) names two layers, as q_proj v_proj does: a
    layer's name has no comma. It was one name, which matched no layer of the model."""
    from angle_train.trainer import train
    from train_helpers import run_config

    cfg = config_from_args(["--lora", "1", "--lora-targets", "q_proj,v_proj", "o_proj"])
    assert cfg.lora_targets == ["q_proj", "v_proj", "o_proj"]
    result = train(run_config(tmp_path, model="builtin:tiny-llama", lora=True, lora_targets=["q_proj,v_proj"],
                              max_steps=1, batch_size=4))
    assert result.encoder.backbone.peft_config["default"].target_modules == {"q_proj", "v_proj"}
