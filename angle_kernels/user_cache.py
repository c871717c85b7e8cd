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
changes. A lock held by a process that does not let go (stopped: a suspended job, a debugger) is waited for at most
LOCK_WAIT_SECONDS, then `locked` raises OSError, as for a folder that cannot be written: the caller goes on without
recording, and says so once per process (`warn_unrecorded`). The file takes the permissions the process's umask
gives a new file (a folder shared by a group stays readable by it), and a file that exists but cannot be read is
never replaced by `update`. `forget()` removes the file, `forget_failed_checks()` only the first-use checks that
failed. `python -m angle_kernels.verify --list` / `--forget` / `--forget-failed` show and clear it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

from . import user_warnings

CACHE_ENV = "ANGLE_KERNELS_CACHE_DIR"
CACHE_FILE = "verified.json"
FORMAT = 2
SECTIONS = ("verified", "checks")
MAX_BYTES = 8 << 20  # a few thousand records are tens of KB: anything near this is not ours
_MAX_DEPTH = 8  # {"checks": [{"errors": {"value": 1.0}}]} is 4 deep
# A first-use check runs under the lock (0.1-0.5 s; up to ~15 s on GPUs whose float64 is slow), and a rank may wait
# for the checks of a few kinds in turn: a holder that keeps it longer than this has stopped.
LOCK_WAIT_SECONDS = 120.0

_warned: set = set()


def cache_dir() -> Path:
    """$ANGLE_KERNELS_CACHE_DIR, else $XDG_CACHE_HOME/angle_kernels, else ~/.cache/angle_kernels; an OSError where
    none is set and the home directory is unknown (HOME unset and no passwd entry: a container run under an
    arbitrary user id). A relative XDG_CACHE_HOME is ignored, as the XDG specification asks: it would give each
    working directory a cache of its own."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = Path(os.environ.get("XDG_CACHE_HOME", "")).expanduser()
    if xdg.is_absolute():
        return xdg / "angle_kernels"
    try:
        home = Path.home()
    except (RuntimeError, KeyError) as exc:
        raise OSError(f"no folder for the cache: {CACHE_ENV} and XDG_CACHE_HOME are unset and the home directory "
                      f"is unknown ({exc})") from None
    return home / ".cache" / "angle_kernels"


def cache_file() -> Path:
    return cache_dir() / CACHE_FILE


def warn_unrecorded(why: OSError) -> None:
    """One RuntimeWarning per process and cache file when an outcome cannot be recorded in it (`why`: the folder
    cannot be written, its lock is held past the wait, a later version's file): without it every process would pay
    the same checks again and never say so. Nothing where there is no folder for the cache (`read` said so)."""
    try:
        path = cache_file()
    except OSError:
        return
    _warn_once(f"unrecorded {path}", f"the outcomes of first-use checks are not recorded in the cache {path} ({why}), "
               f"so every process checks the first call of each kind again: set {CACHE_ENV} to a folder this user can "
               "write (or `python -m angle_kernels.verify --forget` removes a file a later version wrote) to keep them")


def _warn_once(key: str, message: str) -> None:
    """A RuntimeWarning saying `message`, once per process for `key` (_warned; `forget` clears a file's key)."""
    if key not in _warned:
        _warned.add(key)
        user_warnings.warn(f"angle_kernels: {message}", RuntimeWarning)


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


def _load(path: Path) -> tuple[dict, str | None, str | None]:
    """(the cache's contents, None, None) or (empty contents, why the file was not used, why update() must leave it
    as it is, or None where update() may replace it): a later version's file (its records are another
    environment's) and a file this process cannot read (another user's: replacing it would lose their records)."""
    try:
        info = path.stat()
    except FileNotFoundError:
        return _empty(), None, None
    except OSError as exc:
        why = f"cannot stat it ({exc})"
        return _empty(), why, why
    if not stat.S_ISREG(info.st_mode):
        return _empty(), "it is not a regular file", None
    if info.st_size > MAX_BYTES:
        return _empty(), f"it holds {info.st_size} bytes, more than {MAX_BYTES}", None
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_BYTES + 1)
    except OSError as exc:
        why = f"it cannot be read ({type(exc).__name__}: {str(exc)[:100]})"
        return _empty(), why, why
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        return _empty(), f"it is not JSON this package wrote ({type(exc).__name__}: {str(exc)[:100]})", None
    if not isinstance(data, dict):
        return _empty(), f"it holds a JSON {type(data).__name__}, not an object", None
    found = data.get("format")
    if found != FORMAT:
        later = isinstance(found, int) and not isinstance(found, bool) and found > FORMAT
        why = (f"it was written in format {found!r}, this version reads format {FORMAT} (its records are not used: "
               "`python -m angle_kernels.verify --forget` removes the file, every record in it)")
        keep = (f"it was written in format {found} by a later version of angle_kernels (this one writes format "
                f"{FORMAT})") if later else None
        return _empty(), why, keep
    if _depth(data, _MAX_DEPTH) > _MAX_DEPTH:
        return _empty(), f"it is nested deeper than {_MAX_DEPTH} levels", None
    contents = _empty()
    for section in SECTIONS:
        value = data.get(section, [])
        if isinstance(value, list):
            contents[section] = [item for item in value if isinstance(item, dict)]
    return contents, None, None


def read(path: Path | None = None, *, unreadable_raises: bool = False) -> dict:
    """The cache's contents ({"format", "verified", "checks"}); empty when there is none or it is unusable (one
    RuntimeWarning per process and file saying why), or when there is no folder for it (`cache_dir`).
    unreadable_raises: an OSError instead where the file is there but cannot be read (its permissions, a path
    through a file), whose records are then unknown rather than none (`verify --list`)."""
    try:
        path = path or cache_file()
    except OSError as exc:
        if unreadable_raises:
            raise
        _warn_once("", f"no cache is read or written: {exc}")
        return _empty()
    contents, why, unreadable = _load(path)
    if unreadable is not None and unreadable_raises:
        raise OSError(f"{path}: {unreadable}")
    if why is not None:
        _warn_once(str(path), f"ignoring the cache {path}: {why}")
    return contents


# The locks this process holds (path -> depth): `locked` is re-entrant, so a holder may `update` (a second flock of
# the same file from this process would wait for itself). Threads of the process take turns through _threads.
_held: dict[str, int] = {}
_threads = threading.RLock()


@contextlib.contextmanager
def locked(path: Path | None = None, wait_seconds: float | None = None) -> Iterator[None]:
    """Hold the cache's exclusive lock (other processes that update or check through it wait); re-entrant within
    the process. OSError when another process has held it for `wait_seconds` (default LOCK_WAIT_SECONDS) of this
    one's waiting."""
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
        lock_file = path.parent / (path.name + ".lock")
        with open(lock_file, "a") as handle:
            if fcntl is not None:
                _take(fcntl, handle, lock_file, LOCK_WAIT_SECONDS if wait_seconds is None else wait_seconds)
            _held[str(path)] = 1
            try:
                yield
            finally:
                _held[str(path)] = 0
                if fcntl is not None:
                    fcntl.flock(handle, fcntl.LOCK_UN)


def _take(fcntl, handle, lock_file: Path, wait_seconds: float) -> None:
    """flock(LOCK_EX) on the open lock file, polled so that a holder that never lets go costs at most wait_seconds
    (then OSError)."""
    deadline, pause = time.monotonic() + wait_seconds, 0.001
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise OSError(f"{lock_file} has been held by another process for {wait_seconds:g} s (stopped or "
                              "hung): the cache is neither read under the lock nor written") from None
            time.sleep(pause)
            pause = min(2 * pause, 0.01)  # short: a holder that lets go hands the lock on at once


def update(change: Callable[[dict], dict | None], path: Path | None = None, *, replace_unusable: bool = True
           ) -> dict:
    """Apply `change` to the cache's contents under its lock and write the result atomically; returns it. `change`
    edits the dict in place (or returns a new one). An unusable file is replaced (unless `replace_unusable` is
    False: a change that keeps the others' records must not drop them), but for one a later version of the package
    wrote (a newer format: another environment's records) or one this process cannot read: an OSError, as for a
    folder that cannot be written."""
    path = path or cache_file()
    with locked(path):
        contents, unusable, keep = _load(path)
        if keep is None and unusable is not None and not replace_unusable:
            keep = unusable
        if keep is not None:
            raise OSError(f"{path}: {keep}: left as it is")
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


def forget_failed_checks(path: Path | None = None) -> int:
    """Remove the records of first-use checks that did not pass (under its lock), keeping every other record and
    verification; the number removed."""
    path = path or cache_file()
    if not os.path.lexists(path):
        return 0
    removed = []

    def drop(contents: dict) -> None:
        kept = [record for record in contents["checks"] if record.get("pass") is True]
        removed.append(len(contents["checks"]) - len(kept))
        contents["checks"] = kept

    update(drop, path, replace_unusable=False)  # a file update() would replace holds records of its own
    return removed[0]


def write_json_atomic(path: Path, data) -> None:
    """`data` as JSON in `path` (its folder created), written aside and renamed: a reader never sees half a file,
    and a write that fails (a full disk, `path` a folder) leaves no temporary file behind. The file gets the mode
    the umask gives a new file (0o666 less the umask), as `open` would: a temporary file's own 0o600 would lock the
    other users of a shared cache folder out of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.parent / f".{path.stem}-{os.getpid()}-{secrets.token_hex(4)}.json"
    try:
        with open(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "w", encoding="utf-8") as handle:
            json.dump(data, handle, indent=1)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temporary)
        raise
