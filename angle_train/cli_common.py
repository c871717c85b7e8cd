"""What both command lines (angle-train: cli.py, angle-eval: evaluate.py) share: one-line errors for the mistakes
a user fixes (a missing install extra among them), --version's text, the booleans flags take and the device."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import importlib.util
import re
from importlib.metadata import PackageNotFoundError, version

import torch

from angle_kernels import __version__

TRUE_WORDS = {"1", "true", "yes", "y", "on"}
FALSE_WORDS = {"0", "false", "no", "n", "off"}

# The exceptions a user fixes by changing a flag, a file or the environment (is_user_error): main() shows them as
# one line, `PROG: error: MESSAGE`, with argparse's status 2; --debug shows their traceback instead.
#   OSError from anywhere (FileNotFoundError, PermissionError, a full disk, the Hub out of reach): it is about a
#     file, a folder or the network, and its message names it.
#   ValueError raised by angle_train's or angle_kernels' own code: their checks of the settings, the data and the
#     checkpoints raise ValueError (DataError and UnsafeCheckpointError are ValueErrors) with a message that names the
#     flag, or the file and line. A ValueError raised inside torch, transformers or numpy more likely means a bug
#     here, and keeps its traceback.
# Not TypeError: angle_train's deliberate ones guard its Python API (a prompt that is not a string), which the
# command line cannot reach (a config file's setting that is not a text where one is expected is refused as the file
# is read), while an accidental one (a bad call, None where a number was meant) is the commonest bug. Any other
# exception is a bug too and propagates.
USER_ERROR_PACKAGES = ("angle_train", "angle_kernels")
# The import names of the packages of the `train` extra (pyproject.toml) the commands import. A ModuleNotFoundError
# for one of them is the user's to fix by installing the extra (install_hint); any other is a bug.
TRAIN_EXTRA_MODULES = ("transformers", "tokenizers", "safetensors", "huggingface_hub", "scipy", "tqdm", "yaml",
                       "datasets", "peft", "matplotlib", "tomli")
# Those every run of either command imports: checked at start-up (check_train_extra), not found missing minutes in.
REQUIRED_MODULES = ("transformers", "tokenizers", "safetensors", "scipy")


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line, `PROG: error: MESSAGE` (status 2), without the usage block
    before it: angle-train's usage runs to dozens of lines, which buried the message (--help still shows it)."""

    def error(self, message: str):
        message = " ".join(str(message).split())
        if message.startswith(UNRECOGNIZED):  # argparse's words for flags it does not know: say the close ones
            message += did_you_mean(message[len(UNRECOGNIZED):].split(), self.flag_names())
        invalid = INVALID_CHOICE.match(message)
        if invalid:  # a flag's word that is none of its choices: the one meant, where it is clear
            flag, value, choices = invalid.groups()
            several = getattr(self._option_string_actions.get(flag), "nargs", None) in ("+", "*")
            message += choice_hint(flag, value, [choice.strip(" '") for choice in choices.split(",")], several=several)
        self.exit(2, f"{self.prog}: error: {message}\n")

    def flag_names(self) -> list:
        """The long flags this parser takes (--help's), as did_you_mean's choices."""
        return [flag for flag in self._option_string_actions if flag.startswith("--")]


# argparse's messages for words it did not take, before the words (its wording since Python 3.2), and for a word
# that is none of a flag's choices (the choices quoted, or not: Python 3.12.8 and later)
UNRECOGNIZED = "unrecognized arguments: "
INVALID_CHOICE = re.compile(r"argument (--[\w-]+)(?:/-\w)?: invalid choice: '(.*)' \(choose from (.*)\)$")


def did_you_mean(words, choices) -> str:
    """'; did you mean X?' naming the choice closest to each of the unknown `words` (flags, --config keys) that has
    a close one, `X (for WORD)` each where several have; '' where none has: a misspelling (--lerning-rate,
    batch_sise) is answered, a name of something else is not. Case is not counted (Avg: avg, --Batch-Size). A word
    that is no flag among flags (a stray value) is passed over."""
    flags = any(choice.startswith("-") for choice in choices)
    folded = {}  # the choices by their lower case, the first of any two that differ only in case
    for choice in choices:
        folded.setdefault(choice.lower(), choice)
    answers = {}
    for word in words:
        name = word.split("=", 1)[0]  # --lr=0.1: the flag's name
        if flags and not name.startswith("-"):
            continue
        close = difflib.get_close_matches(name.lower(), list(folded), n=1, cutoff=0.75)
        if close:
            answers[name] = folded[close[0]]
    if not answers:
        return ""
    if len(answers) == 1:
        return f"; did you mean {next(iter(answers.values()))}?"
    return "; did you mean " + ", ".join(f"{choice} (for {name})" for name, choice in answers.items()) + "?"


def comma_separated(item):
    """The numbers in one word of a number list (angle-train's number-list settings, angle-eval's --dims), `item`:
    "32,64" (or "32, 64", quoted as one word) as ["32", "64"], as the same numbers given as words of their own; any
    other item as it is. A comma with no number on one side of it ("32,", "32,,64") is refused: a number was left
    out."""
    if not isinstance(item, str) or "," not in item:
        return [item]
    parts = [part.strip() for part in item.split(",")]
    if not all(parts):
        raise ValueError(f"expected numbers, by spaces or commas (32 64, or 32,64); got {item!r}")
    return parts


def choice_hint(flag: str, value: str, choices, *, several: bool = False) -> str:
    """What follows the refusal of `value`, none of `flag`'s `choices`: for a flag that takes `several` choices, the
    words of a comma-separated list of them (tensorboard,wandb: --report-to tensorboard wandb); for --pooling, a
    sentence-transformers pooling name's counterpart (mean: avg); else the closest choice (did_you_mean: Cosine,
    cosine), else ''."""
    parts = [part.strip() for part in value.split(",")]
    if several and len(parts) > 1 and all(part in choices for part in parts):
        return f"; several are separate values: {flag} {' '.join(parts)}"
    if flag == "--pooling":
        from .st_folder import our_pooling

        ours = our_pooling(value)
        if ours in choices:
            return f"; sentence-transformers' {value!r} pooling is {ours!r} here"
    return did_you_mean([value], choices)


def is_user_error(exc: BaseException) -> bool:
    """Whether `exc` is the user's to fix (the rules above USER_ERROR_PACKAGES)."""
    if isinstance(exc, OSError):
        return True
    if not isinstance(exc, ValueError):
        return False
    innermost = exc.__traceback__
    while innermost.tb_next is not None:
        innermost = innermost.tb_next
    return module_of(innermost.tb_frame.f_globals).split(".")[0] in USER_ERROR_PACKAGES


def module_of(frame_globals: dict) -> str:
    """The import name of the module whose globals these are: `python -m angle_train.cli` (torchrun's form) runs
    the module as "__main__", its import name then in its __spec__."""
    name = frame_globals.get("__name__", "")
    spec = frame_globals.get("__spec__")
    return spec.name if name == "__main__" and spec is not None else name


def install_hint(modules) -> str:
    """What to install when these modules of the train extra are missing."""
    return (f"{', '.join(modules)} {'is' if len(modules) == 1 else 'are'} not installed: angle-train and angle-eval "
            "need the train extra: pip install 'angle_kernels[train]'")


def missing_extra_module(exc: ImportError) -> str | None:
    """The train extra's module whose absence `exc` reports (itself or the error it was raised from), or None."""
    while exc is not None:
        name = (getattr(exc, "name", None) or "").split(".")[0]
        if isinstance(exc, ModuleNotFoundError) and name in TRAIN_EXTRA_MODULES:
            return name
        exc = exc.__cause__ if isinstance(exc.__cause__, ImportError) else None
    return None


def check_train_extra() -> None:
    """Refuse to start without the train extra's packages every run needs (REQUIRED_MODULES), naming the extra."""
    missing = [name for name in REQUIRED_MODULES if importlib.util.find_spec(name) is None]
    if missing:
        raise ModuleNotFoundError(install_hint(missing), name=missing[0])


@contextlib.contextmanager
def user_errors_exit(parser: argparse.ArgumentParser, *, debug: bool):
    """Inside: a user error (is_user_error; a missing package of the train extra, missing_extra_module) ends the
    program as a bad flag does, one line and status 2, or with `debug` propagates with its traceback, as any other
    exception does. Under torchrun each process that meets the error exits so, and torchrun reports the failed
    processes."""
    try:
        yield
    except ImportError as exc:
        module = missing_extra_module(exc)
        if debug or module is None:
            raise
        parser.error(str(exc) if "pip install" in str(exc) else install_hint([module]))
    except (OSError, ValueError) as exc:
        if debug or not is_user_error(exc):
            raise
        parser.error(str(exc))


def resolve_device(requested: str | None) -> torch.device:
    """The device a command runs on: the one asked for (--device), else CUDA when there is a CUDA device, else the
    CPU; angle-train and angle-eval choose the same way."""
    return torch.device(requested or ("cuda" if torch.cuda.is_available() else "cpu"))


def version_text(prog: str) -> str:
    """`PROG VERSION (torch X, transformers Y)`, for --version and bug reports; transformers' version comes from its
    installed package's metadata, without importing it (which takes seconds)."""
    try:
        transformers_version = version("transformers")
    except PackageNotFoundError:
        transformers_version = "not installed"
    return f"{prog} {__version__} (torch {torch.__version__}, transformers {transformers_version})"


def parse_bool(text) -> bool:
    if isinstance(text, bool):
        return text
    word = str(text).strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise argparse.ArgumentTypeError(f"expected a boolean (1/0, true/false, yes/no, on/off); got {text!r}")
