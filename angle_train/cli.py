"""`angle-train`: the command line. Every TrainConfig field is a flag; a YAML/TOML/JSON file can set them too.

Precedence: built-in defaults < --config file < flags on the command line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import MISSING, fields

from .cli_common import (OneLineErrorParser, check_train_extra, did_you_mean, parse_bool, user_errors_exit,
                         version_text)
from .config import TrainConfig, checked_setting, flag_of, setting_kind
from .data import has_suffix
from .distributed import leave_process_group
from .tracking import DEV_METRICS

EXAMPLES = """\
examples:
  # the built-in demo: a tiny BERT on synthetic pairs, no download, seconds on a laptop CPU
  python -m angle_train.demo

  # the built-in defaults (tiny BERT, built-in pairs) with your own output folder
  angle-train --output-dir runs/first

  # fine-tune a sentence encoder on STS-B-style graded pairs (cosine + angle terms, no in-batch negatives)
  angle-train --model sentence-transformers/all-MiniLM-L6-v2 --train-data sts-train.csv --dev-data sts-dev.csv \\
      --pooling avg --max-length 64 --cosine-w 1 --ibn-w 0 --angle-w 1 --lr 5e-5 --batch-size 16 --eval-every 100

  # LoRA on a LLaMA-family LLM with the AnglE prompt, bf16, 32k pairs per step through the gradient cache
  torchrun --nproc-per-node 8 -m angle_train.cli --model meta-llama/Llama-2-7b-hf --lora 1 --lora-r 32 \\
      --prompt angle --bf16 1 --train-data nli.jsonl --batch-size 32768 --chunk-size 512 --lr 2e-4

  # Matryoshka: every listed prefix of the embeddings trained; dev Spearman reported at each width
  angle-train --model sentence-transformers/all-MiniLM-L6-v2 --train-data sts-train.csv --dev-data sts-dev.csv \\
      --pooling avg --cosine-w 1 --ibn-w 0 --angle-w 1 --matryoshka-dims 384 256 128 64 32

  # the same settings from a file (keys are the flag names, with - or _), a flag still wins
  angle-train --config run.yaml --lr 1e-4

booleans take a value: --bf16 1 / --bf16 0 (also true/false, yes/no, on/off); a bare --bf16 means on.
data formats: A = text1,text2,label   B = query,positive   C = query,positive,negative (.jsonl, .csv, .tsv,
the STS-B TSV layout, or a Hugging Face dataset). Outputs: OUTPUT_DIR/metrics.jsonl, best/, final/
(a Hugging Face + sentence-transformers folder), checkpoints/ (resume with --resume auto); a folder that holds an
earlier run is refused unless --overwrite 1 (which deletes that run's outputs) or --resume.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="angle-train",
        description="Fine-tune a text embedding model (BERT-style encoder or LLM with LoRA) with the AnglE "
                    "objective: in-batch negatives across GPUs, a gradient cache for very large batches, exact "
                    "resume, Spearman evaluation, export to Hugging Face / sentence-transformers.",
        epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", metavar="FILE", help="YAML, TOML or JSON file of settings (keys = flag names)")
    parser.add_argument("--debug", type=parse_bool, nargs="?", const=True, default=False, metavar="0|1",
                        help="show the traceback of a mistake in the settings, files or data (default: one line)")
    parser.add_argument("--version", action="version", version=version_text("angle-train"))
    groups = {}
    for f in fields(TrainConfig):
        group_name = f.metadata.get("group", "other")
        if group_name not in groups:
            groups[group_name] = parser.add_argument_group(group_name)
        flag = flag_of(f.name)
        kind = setting_kind(f)
        default = f.default_factory() if f.default is MISSING else f.default
        shown = " ".join(map(str, default)) if isinstance(default, list) else default
        default_text = f" (default: {shown})" if default is not None and default != [] else ""
        kwargs = {"dest": f.name, "default": argparse.SUPPRESS, "help": f.metadata["help"] + default_text}
        if "choices" in f.metadata:
            kwargs["choices"] = f.metadata["choices"]
        if kind == "bool":
            kwargs.update(type=parse_bool, nargs="?", const=True, metavar="0|1")
        elif kind == "list":
            # at least one value: a bare flag (an empty shell variable after it) is a mistake, not a default
            kwargs.update(nargs="+", metavar=f.metadata.get("metavar", "NAME"))
        elif kind == "int":
            kwargs.update(type=int)
        elif kind == "float":
            kwargs.update(type=float)
        groups[group_name].add_argument(flag, *f.metadata.get("aliases", ()), **kwargs)
    return parser


def read_config_file(path: str) -> dict:
    """The settings of a YAML, TOML or JSON file. A missing file, another suffix, a syntax error or a file that is
    not a mapping raises FileNotFoundError or ValueError naming --config and the file."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"--config {path}: no such file")
    if has_suffix(path, (".yaml", ".yml")):  # in any case: RUN.YAML as run.yaml, as the data files are read
        import yaml

        language, load, syntax_error = "YAML", yaml.safe_load, yaml.YAMLError
    elif has_suffix(path, ".toml"):
        try:
            import tomllib
        except ImportError:  # Python < 3.11
            import tomli as tomllib

        language, load, syntax_error = "TOML", tomllib.load, tomllib.TOMLDecodeError
    elif has_suffix(path, ".json"):
        language, load, syntax_error = "JSON", json.load, json.JSONDecodeError
    else:
        raise ValueError(f"--config {path}: use a .yaml, .yml, .toml or .json file")
    with open(path, "rb") as f:  # bytes: tomllib needs them; json and yaml detect UTF-8/16/32 in them
        try:
            data = load(f)
        except (syntax_error, UnicodeDecodeError) as exc:  # raised in the parsers' code: reworded to name --config
            raise ValueError(f"--config {path}: not valid {language}: {exc}") from None
    if data is None:  # an empty YAML file
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"--config {path}: expected a mapping of settings (name: value); got {type(data).__name__}")
    return data


def config_from_args(argv=None) -> TrainConfig:
    """The TrainConfig of a command line. A bad flag, --config file or setting ends the program with one line
    and status 2 (with --debug, a bad file or setting raises its error instead)."""
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    with user_errors_exit(parser, debug=args.pop("debug")):
        return config_from_settings(parser, args)


def config_from_settings(parser: argparse.ArgumentParser, args: dict) -> TrainConfig:
    """The TrainConfig of parsed flags (`args`: the flags given, and --config): the --config file's settings, then
    the flags over them; a bad setting in the file is a parser error, a bad combination a ValueError (validate)."""
    by_name = {f.name: f for f in fields(TrainConfig)}
    for f in fields(TrainConfig):  # config-file keys may use a flag's alias too (text_prompt sets prompt)
        by_name.update({alias[2:].replace("-", "_"): f for alias in f.metadata.get("aliases", ())})
    values, keys = {}, {}
    if args.get("config"):
        for key, value in read_config_file(args.pop("config")).items():
            name = key.replace("-", "_")
            if name not in by_name:
                parser.error(f"--config: unknown setting {key!r}"
                             + did_you_mean([name], sorted(n for n in by_name if not n.startswith("_"))))
            name = by_name[name].name  # an alias (text_prompt) sets its field (prompt)
            if name in keys:  # batch-size and batch_size, or prompt and text_prompt: the later one won, silently
                parser.error(f"--config: the settings {keys[name]!r} and {key!r} are one setting ({name}); keep one")
            keys[name] = key
            kind = setting_kind(by_name[name])
            if value is None:  # YAML null / JSON null: "off", for the settings whose default is off (None)
                if by_name[name].default is not None:
                    parser.error(f"--config: setting {key!r} cannot be null (its default is "
                                 f"{by_name[name].default!r})")
                values[name] = None
                continue
            try:  # its choices too: argparse checks the flags' values, not the file's
                value = checked_setting(by_name[name], value)
            except (TypeError, ValueError, argparse.ArgumentTypeError) as exc:
                parser.error(f"--config: setting {key!r}: {exc}")
            # an empty list other than the default, as the flag without words: no command line could give it
            # (the run's recorded command would end in a bare flag); a run's config.json gives empty defaults
            if kind == "list" and not value and by_name[name].default_factory() != []:
                parser.error(f"--config: setting {key!r}: expected at least one value (leave the setting out for "
                             f"its default, {by_name[name].default_factory()!r})")
            values[name] = value
    args.pop("config", None)
    values.update(args)
    return TrainConfig(**values).validate()


def main(argv=None) -> int:
    """Train as the flags say. Exit status: 0 done; 2 a mistake in the settings, files or data (one line on stderr,
    the traceback with --debug); 3 too many non-finite steps in a row; 75 stopped by SIGTERM / SIGINT / SIGHUP after
    writing a checkpoint (resume with --resume auto)."""
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    from . import faults
    from .trainer import train

    with user_errors_exit(parser, debug=args.pop("debug")):
        check_train_extra()
        try:
            result = train(config_from_settings(parser, args))
        except faults.Preempted as exc:
            faults.ignore_stop_signals_while_exiting()
            print(f"angle-train: {exc}", flush=True)
            return faults.EXIT_PREEMPTED
        except faults.NonFiniteTrainingError as exc:
            print(f"angle-train: {exc}", file=sys.stderr, flush=True)
            return faults.EXIT_NON_FINITE
    if result.final_path:
        print(f"final model: {result.final_path}")
    if result.best_path:
        print(f"best model ({DEV_METRICS[result.best_metric]} {result.best_score:.4f}): {result.best_path}")
    del result  # the run's model and tensors, before the process group goes (leave_process_group)
    leave_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
