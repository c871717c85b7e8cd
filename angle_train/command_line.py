"""What both command lines (angle-train: cli.py, angle-eval: evaluate.py) share: one-line errors for the mistakes
a user fixes, --version's text and the booleans flags take."""

from __future__ import annotations

import argparse
import contextlib
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


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse's parser whose errors are one line, `PROG: error: MESSAGE` (status 2), without the usage block
    before it: angle-train's usage runs to dozens of lines, which buried the message (--help still shows it)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {' '.join(str(message).split())}\n")


def is_user_error(exc: BaseException) -> bool:
    """Whether `exc` is the user's to fix (the rules above USER_ERROR_PACKAGES)."""
    if isinstance(exc, OSError):
        return True
    if not isinstance(exc, ValueError):
        return False
    innermost = exc.__traceback__
    while innermost.tb_next is not None:
        innermost = innermost.tb_next
    return innermost.tb_frame.f_globals.get("__name__", "").split(".")[0] in USER_ERROR_PACKAGES


@contextlib.contextmanager
def user_errors_exit(parser: argparse.ArgumentParser, *, debug: bool):
    """Inside: a user error (is_user_error) ends the program as a bad flag does, one line and status 2, or with
    `debug` propagates with its traceback, as any other exception does. Under torchrun each process that meets
    the error exits so, and torchrun reports the failed processes."""
    try:
        yield
    except (OSError, ValueError) as exc:
        if debug or not is_user_error(exc):
            raise
        parser.error(str(exc))


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
