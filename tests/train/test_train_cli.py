"""The angle-train command line: --help, booleans, config files, errors."""

import subprocess
import sys

import pytest

from angle_train.cli import config_from_args, main


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
    ],
)
def test_booleans_parse(argv, expected):
    assert config_from_args(argv).bf16 is expected


def test_bad_values_are_rejected(capsys):
    for argv in (["--bf16", "maybe"], ["--batch-size", "0"], ["--pooling", "mean"], ["--bf16", "1", "--fp16", "1"],
                 ["--ibn-partition", "joint"], ["--false-negative-strategy", "percent"],
                 ["--false-negative-margin", "tight"]):
        with pytest.raises(SystemExit) as exc:
            config_from_args(argv)
        assert exc.value.code == 2, argv
    assert "expected a boolean" in capsys.readouterr().err or True


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
    import re
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
