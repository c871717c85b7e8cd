"""Hugging Face Hub names that cannot be loaded, said in one line that names the flag or argument that gave them.

A model or dataset name that is no local path is looked up on the Hugging Face Hub by transformers, datasets and
huggingface_hub, which fail after their retries with their own words and no word of where the name came from
(transformers: "We couldn't connect to 'https://huggingface.co' to load the files..."; datasets: "Couldn't reach
'NAME' on the Hub (LocalEntryNotFoundError)"). `hub_lookup` wraps such a load and turns the two failures a user
meets into errors that name the flag (--model, --train-data, MODEL...) and the name, and say what to do:

- HubUnreachable (a ConnectionError): the Hub could not be reached (no network, or HF_HUB_OFFLINE=1) and the name
  is not in the local Hugging Face cache;
- HubNotFound (a FileNotFoundError): the Hub has no repository of that name (or a private one, without a login),
  or the name is no valid repository id, and there is no local path of that name either.

Both are OSErrors, which the commands show as one line (cli_common.is_user_error); the library's own error stays
attached as the cause (--debug shows it). Any other failure of the load propagates as it was raised.
"""

from __future__ import annotations

import contextlib
import os

# The classes, by name, of the errors that mean the Hub was not asked or did not answer: huggingface_hub's (its
# offline mode; a file neither downloaded nor in the cache) and its HTTP client's (httpx / httpx2 ConnectError,
# ConnectTimeout, ReadTimeout... under TimeoutException; requests' of older versions; datasets' ConnectionError).
# Matched by name along each class's MRO, as the client package changes between huggingface_hub versions. Not
# TimeoutError: filelock's Timeout (a cache lock held elsewhere) is one.
UNREACHABLE_CLASSES = {"OfflineModeIsEnabled", "LocalEntryNotFoundError", "ConnectError", "TimeoutException",
                       "ConnectTimeout", "ConnectionError"}
# The Hub answered that it has no such repository (or one the caller may not see: private, without a token)
NOT_FOUND_CLASSES = {"RepositoryNotFoundError"}
# It refused the name as a repository id before asking (huggingface_hub.errors.HFValidationError)
INVALID_ID_CLASSES = {"HFValidationError"}
# Not a missing repository: one the user has to ask access to (its own message says how); left as raised
GATED_CLASSES = {"GatedRepoError"}
KINDS = ("model", "dataset")


class HubLookupError(OSError):
    """A Hub name that could not be loaded (HubUnreachable, HubNotFound); `name` and `given_as` as hub_lookup's."""

    def __init__(self, message: str, *, name: str, given_as: str | None):
        super().__init__(message)
        self.name = name
        self.given_as = given_as


class HubUnreachable(HubLookupError, ConnectionError):
    """The Hugging Face Hub could not be reached (or HF_HUB_OFFLINE=1 kept it from being asked), and the name is not
    in the local cache."""


class HubNotFound(HubLookupError, FileNotFoundError):
    """The name is neither an existing local path nor a repository on the Hugging Face Hub (or no valid id of one)."""


def _chain(exc: BaseException):
    """`exc` and the errors it was raised from or while handling (__cause__, then __context__), each once."""
    seen, todo = set(), [exc]
    while todo:
        error = todo.pop(0)
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        yield error
        todo += [error.__cause__, error.__context__]


def _first(errors: list[BaseException], class_names: set[str]) -> BaseException | None:
    """The first of `errors` with a class (or a base class) named in `class_names`."""
    for error in errors:
        if any(cls.__name__ in class_names for cls in type(error).__mro__):
            return error
    return None


def raised_from(exc: BaseException, class_names: set[str]) -> BaseException | None:
    """The first of `exc` and the errors it was raised from or while handling (_chain) whose class, or a base class,
    is named in `class_names`; None where none is."""
    return _first(list(_chain(exc)), class_names)


def _cache_text() -> str:
    """Where the Hugging Face cache is, in the environment variable's words that set it."""
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover - huggingface_hub comes with transformers and datasets
        return f"HF_HOME={os.environ.get('HF_HOME', '~/.cache/huggingface')}"
    home, cache = constants.HF_HOME, constants.HF_HUB_CACHE
    if os.path.abspath(cache).startswith(os.path.abspath(home) + os.sep):
        return f"HF_HOME={home}"
    return f"HF_HUB_CACHE={cache}"


def _offline_mode() -> bool:
    """Whether HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE, HF_DATASETS_OFFLINE) keeps the libraries off the Hub."""
    try:
        from huggingface_hub import constants
    except ImportError:  # pragma: no cover
        return False
    return bool(constants.HF_HUB_OFFLINE) or os.environ.get("HF_DATASETS_OFFLINE", "").lower() in ("1", "true", "yes")


def _reason(errors: list[BaseException]) -> str:
    """Why the Hub could not be reached, in a few words: offline mode, or the network error at the bottom."""
    if _offline_mode() or _first(errors, {"OfflineModeIsEnabled"}) is not None:
        return "HF_HUB_OFFLINE=1 is set, so it was not asked"
    # the client's own error (datasets' ConnectionError and huggingface_hub's LocalEntryNotFoundError only say that
    # the Hub could not be reached, and datasets raises its own without the client's below it)
    network = [error for error in errors if type(error) is not ConnectionError and any(
        cls.__name__ in UNREACHABLE_CLASSES - {"LocalEntryNotFoundError"} for cls in type(error).__mro__)]
    text = " ".join(str(network[-1]).split()) if network else ""
    if not text or len(text) > 120 or "huggingface.co/docs" in text:
        return "no network, or the Hub did not answer"
    return text


def given_label(given_as: str | None, name: str) -> str:
    """The message's opening: `--model NAME`, `model=NAME` (an argument), `NAME` (nothing named)."""
    if not given_as:
        return name
    return f"{given_as}{name}" if given_as.endswith("=") else f"{given_as} {name}"


def hub_error(exc: BaseException, name: str, *, kind: str = "model", given_as: str | None = None
              ) -> HubLookupError | None:
    """The HubUnreachable or HubNotFound that `exc` (raised loading the Hub name `name`, or an error it was raised
    from) means, or None where it means neither (a gated repository, a missing file in a repository, a bug)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
    if isinstance(exc, HubLookupError):
        return None  # already said, by a hub_lookup inside
    errors = list(_chain(exc))
    if _first(errors, GATED_CLASSES) is not None:
        return None
    label = given_label(given_as, name)
    # hub_lookup reaches here only for a name that is no existing path: the local path was checked first
    local = (f"neither a local {'folder' if kind == 'model' else 'file or folder'} (there is none at "
             f"{os.path.abspath(name)})")
    if _first(errors, NOT_FOUND_CLASSES) is not None:
        return HubNotFound(f"{label}: {local} nor a {kind} repository on the Hugging Face Hub (the Hub has none of "
                           "that name, or it is private: log in with `hf auth login` to load a private one); check "
                           "the spelling (NAME or OWNER/NAME)", name=name, given_as=given_as)
    invalid = _first(errors, INVALID_ID_CLASSES)
    if invalid is not None:
        return HubNotFound(f"{label}: {local} nor a valid Hugging Face Hub repository id (NAME or OWNER/NAME: "
                           f"{' '.join(str(invalid).split())})", name=name, given_as=given_as)
    if _first(errors, UNREACHABLE_CLASSES) is not None:
        remedy = ("download it once with network (HF_HUB_OFFLINE unset), or give the path of a local copy"
                  if _offline_mode() else
                  "download it once with network, or set HF_HUB_OFFLINE=1 to skip the Hub and its retries")
        return HubUnreachable(f"{label}: the Hugging Face Hub could not be reached ({_reason(errors)}), and the "
                              f"{kind} is not in the local Hugging Face cache ({_cache_text()}); {remedy}",
                              name=name, given_as=given_as)
    return None


@contextlib.contextmanager
def hub_lookup(name: str, *, kind: str = "model", given_as: str | None = None):
    """Inside: the load of the model or dataset `name` (kind: "model", "dataset"); where the Hub could not be reached
    and the name is not cached, HubUnreachable, and where the Hub has no such repository (or the name is no valid
    id), HubNotFound, each naming `given_as` (the flag, e.g. "--model"; an argument as "model="; None: the name
    alone) and `name` (hub_error). A name that is an existing local path is loaded as ever: nothing is reworded."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(KINDS)}; got {kind!r}")
    if os.path.exists(name):
        yield
        return
    try:
        yield
    except Exception as exc:
        error = hub_error(exc, name, kind=kind, given_as=given_as)
        if error is None:
            raise
        raise error from exc


def name_given_as(exc: HubLookupError, given_as: str) -> None:
    """`exc`, raised without naming where the name came from (given_as None), now naming `given_as` (its message
    re-worded in place: its traceback still ends where it was raised)."""
    if exc.given_as is None:
        exc.args = (f"{given_label(given_as, exc.name)}{str(exc)[len(exc.name):]}",)
        exc.given_as = given_as
