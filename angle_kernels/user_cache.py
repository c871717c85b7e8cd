"""The user's cache: one JSON file of what this machine has learnt about its GPU backends.

    $ANGLE_KERNELS_CACHE_DIR/verified.json   (else $XDG_CACHE_HOME/angle_kernels/, else ~/.cache/angle_kernels/)
    {"format": 2, "verified": [entries], "checks": [records]}

* "verified": entries `python -m angle_kernels.verify` recorded (angle_kernels.verified.entry);
* "checks": the outcomes of first-use checks (angle_kernels.first_use), one per checked kind of call.

Every `backend="auto"` call on a GPU may read it (once per process), so reading never raises and never hangs: a
missing file is empty; a file that is not a regular file (a FIFO would block the reader), larger than MAX_BYTES,
not valid JSON, nested deeper than the format allows, of another shape, or of another format version is treated as
empty, with one RuntimeWarning per process saying why. Sections hold lists of JSON objects; anything else in a
section is dropped.

Writes (`update`) read, change and replace the file under an exclusive lock (`locked`: fcntl.flock on a lock file
beside it; where fcntl does not exist the lock is a no-op), writing a temporary file in the same folder and
renaming it over the old one: a reader never sees half a file, and concurrent writers never lose each other's
changes. `forget()` removes the file. `python -m angle_kernels.verify --list` / `--forget` show and clear it.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
import threading
import warnings
from pathlib import Path
from typing import Callable, Iterator

CACHE_ENV = "ANGLE_KERNELS_CACHE_DIR"
CACHE_FILE = "verified.json"
FORMAT = 2
SECTIONS = ("verified", "checks")
MAX_BYTES = 8 << 20  # a few thousand records are tens of KB: anything near this is not ours
_MAX_DEPTH = 8  # {"checks": [{"errors": {"value": 1.0}}]} is 4 deep

_warned: set = set()


def cache_dir() -> Path:
    """$ANGLE_KERNELS_CACHE_DIR, else $XDG_CACHE_HOME/angle_kernels, else ~/.cache/angle_kernels; an OSError where
    none is set and the home directory is unknown (HOME unset and no passwd entry: a container run under an
    arbitrary user id)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "angle_kernels"
    try:
        home = Path.home()
    except (RuntimeError, KeyError) as exc:
        raise OSError(f"no folder for the cache: {CACHE_ENV} and XDG_CACHE_HOME are unset and the home directory "
                      f"is unknown ({exc})") from None
    return home / ".cache" / "angle_kernels"


def cache_file() -> Path:
    return cache_dir() / CACHE_FILE


def _empty() -> dict:
    return {"format": FORMAT, **{section: [] for section in SECTIONS}}


def _depth(value, limit: int) -> int:
    """The nesting depth of a JSON value, counting no further than limit + 1 (no recursion)."""
    deepest, todo = 0, [(value, 1)]
    while todo:
        item, depth = todo.pop()
        deepest = max(deepest, depth)
        if deepest > limit:
            break
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else ()
        todo.extend((child, depth + 1) for child in children)
    return deepest


def _load(path: Path) -> tuple[dict, str | None, int | None]:
    """(the cache's contents, None, None) or (empty contents, why the file was not used, its format where that is
    a later one than FORMAT: a later version's file, which update() leaves as it is)."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return _empty(), None, None
    except OSError as exc:
        return _empty(), f"cannot stat it ({exc})", None
    if not stat.S_ISREG(info.st_mode):
        return _empty(), "it is not a regular file", None
    if info.st_size > MAX_BYTES:
        return _empty(), f"it holds {info.st_size} bytes, more than {MAX_BYTES}", None
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_BYTES + 1)
        data = json.loads(raw.decode("utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as exc:
        return _empty(), f"it is not JSON this package wrote ({type(exc).__name__}: {str(exc)[:100]})", None
    if not isinstance(data, dict):
        return _empty(), f"it holds a JSON {type(data).__name__}, not an object", None
    found = data.get("format")
    if found != FORMAT:
        later = found if isinstance(found, int) and not isinstance(found, bool) and found > FORMAT else None
        why = (f"it was written in format {found!r}, this version reads format {FORMAT} (its records are not used: "
               "`python -m angle_kernels.verify --forget` removes it)")
        return _empty(), why, later
    if _depth(data, _MAX_DEPTH) > _MAX_DEPTH:
        return _empty(), f"it is nested deeper than {_MAX_DEPTH} levels", None
    contents = _empty()
    for section in SECTIONS:
        value = data.get(section, [])
        if isinstance(value, list):
            contents[section] = [item for item in value if isinstance(item, dict)]
    return contents, None, None


def read(path: Path | None = None) -> dict:
    """The cache's contents ({"format", "verified", "checks"}); empty when there is none or it is unusable (one
    RuntimeWarning per process and file saying why), or when there is no folder for it (`cache_dir`)."""
    try:
        path = path or cache_file()
    except OSError as exc:
        if "" not in _warned:
            _warned.add("")
            warnings.warn(f"angle_kernels: no cache is read or written: {exc}", RuntimeWarning, stacklevel=2)
        return _empty()
    contents, why, _ = _load(path)
    if why is not None and str(path) not in _warned:
        _warned.add(str(path))
        warnings.warn(f"angle_kernels: ignoring the cache {path}: {why}", RuntimeWarning, stacklevel=2)
    return contents


# The locks this process holds (path -> depth): `locked` is re-entrant, so a holder may `update` (a second flock of
# the same file from this process would wait for itself). Threads of the process take turns through _threads.
_held: dict[str, int] = {}
_threads = threading.RLock()


@contextlib.contextmanager
def locked(path: Path | None = None) -> Iterator[None]:
    """Hold the cache's exclusive lock (other processes that update or check through it wait); re-entrant within
    the process."""
    path = path or cache_file()
    with _threads:
        if _held.get(str(path)):
            _held[str(path)] += 1
            try:
                yield
            finally:
                _held[str(path)] -= 1
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            import fcntl
        except ImportError:  # no flock on this platform: writes stay atomic, concurrent updates may lose one
            fcntl = None
        with open(path.parent / (path.name + ".lock"), "a") as handle:
            if fcntl is not None:
                fcntl.flock(handle, fcntl.LOCK_EX)
            _held[str(path)] = 1
            try:
                yield
            finally:
                _held[str(path)] = 0
                if fcntl is not None:
                    fcntl.flock(handle, fcntl.LOCK_UN)


def update(change: Callable[[dict], dict | None], path: Path | None = None) -> dict:
    """Apply `change` to the cache's contents under its lock and write the result atomically; returns it. `change`
    edits the dict in place (or returns a new one). An unusable file is replaced, but for one a later version of
    the package wrote (a newer format: another environment's records, kept): an OSError, as for a folder that
    cannot be written."""
    path = path or cache_file()
    with locked(path):
        contents, _, newer = _load(path)
        if newer is not None:
            raise OSError(f"{path} was written in format {newer} by a later version of angle_kernels (this one writes "
                          f"format {FORMAT}): left as it is")
        changed = change(contents)
        contents = contents if changed is None else changed
        contents["format"] = FORMAT
        write_json_atomic(path, contents)
    return contents


def forget(path: Path | None = None) -> bool:
    """Remove the cache file (under its lock); True when there was one (none: nothing is created)."""
    path = path or cache_file()
    if not os.path.lexists(path):
        return False
    with locked(path):
        try:
            path.unlink()
        except FileNotFoundError:
            return False
    _warned.discard(str(path))
    return True


def write_json_atomic(path: Path, data) -> None:
    """`data` as JSON in `path` (its folder created), written aside and renamed: a reader never sees half a file,
    and a write that fails (a full disk, `path` a folder) leaves no temporary file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", dir=path.parent, prefix=f".{path.stem}-", suffix=".json", delete=False,
                                     encoding="utf-8") as tmp:
        try:
            json.dump(data, tmp, indent=1)
        except BaseException:
            tmp.close()
            os.unlink(tmp.name)
            raise
    try:
        os.replace(tmp.name, path)
    except BaseException:
        os.unlink(tmp.name)
        raise
