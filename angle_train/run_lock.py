"""One run per output folder: OUTPUT_DIR/.angle-train.lock, taken by a run (its main process under torchrun) before
it writes anything there and removed when it ends.

Two runs writing into one folder interleave their metrics rows and leave the settings of one beside the checkpoints
of the other, so a second run is refused while the first holds the lock, with one line naming the holder (host,
process, since when). The lock file is created exclusively (O_CREAT | O_EXCL, which shared file systems honour
too) and holds {"host", "pid", "started", "process_start"}. A lock whose process is gone is stale:

    same host, process gone (or its pid reused by another process: a different start time)
                              taken over, with a warning naming the run that left it (it crashed or was killed)
    another host              never broken: nothing here can tell whether that run is alive; the error says to
                              remove the file once that run is gone
    unreadable                a lock being written is retried for a moment; one that stays unreadable is refused
                              like another host's, naming the file

Deciding and taking over happen under an flock of the folder, so two runs that find the same stale lock do not both
take it (where the file system has no flock, the exclusive create alone still keeps two fresh starts apart).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import socket
import sys
import time
import uuid

from .atomic_files import made_folder, remove_regular_file, written_aside

LOCK_FILE = ".angle-train.lock"
# How long an empty or half-written lock file is read again before it counts as damaged: its writer holds it for
# microseconds between the exclusive create and the write.
UNREADABLE_RETRY_S = 1.0
# The record a run taking over the lock writes beside it (LOCK_FILE.TOKEN, RunLock.token) and renames over it
_TAKE_OVER_RECORD = re.compile(re.escape(LOCK_FILE) + r"\.[0-9a-f]{32}")


class OutputDirLocked(ValueError):
    """Another run holds the output folder's lock (a ValueError: the CLIs show it as one line, exit status 2)."""


def _process_start(pid: int) -> str | None:
    """The start time of process `pid` in clock ticks since boot (/proc/PID/stat, field 22), which tells a live
    process from another one that reused its pid; None where /proc is not there."""
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8", errors="replace") as f:
            stat = f.read()
    except OSError:
        return None
    return stat.rsplit(")", 1)[-1].split()[19]  # fields after the command name (which may hold spaces) start at 3


def _is_running(pid: int, process_start: str | None) -> bool:
    """Whether process `pid` of this host is the one that took the lock (alive, and started when it was)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by another user
        pass
    now = _process_start(pid)
    return process_start is None or now is None or now == process_start


class RunLock:
    """The lock of one output folder, held by this process (acquire() returns it; release() removes the file)."""

    def __init__(self, output_dir: str, created_folder: bool):
        self.output_dir, self.path = output_dir, os.path.join(output_dir, LOCK_FILE)
        self.created_folder = created_folder
        self.token = uuid.uuid4().hex
        self.record = {"host": socket.gethostname(), "pid": os.getpid(), "process_start": _process_start(os.getpid()),
                       "started": time.strftime("%Y-%m-%d %H:%M:%S"), "token": self.token}

    def _create(self) -> bool:
        """Create the lock file with this run's record; False when one exists."""
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(self.record, f)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _read_holder(self) -> dict | None:
        """The record of the lock there (None once it is gone); an empty or invalid one is read again for a moment
        (its writer may be between the create and the write), then raises OutputDirLocked naming the file."""
        deadline = time.monotonic() + UNREADABLE_RETRY_S
        while True:
            try:
                with open(self.path, encoding="utf-8", errors="replace") as f:
                    holder = json.loads(f.read())
                if isinstance(holder, dict) and isinstance(holder.get("pid"), int) and holder.get("host"):
                    return holder
            except FileNotFoundError:
                return None
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise OutputDirLocked(
                    f"--output-dir {self.output_dir}: its lock file {self.path} is unreadable, so another run may be "
                    f"using the folder; remove {self.path} if none is, or choose another --output-dir")
            time.sleep(0.05)

    def acquire(self) -> RunLock:
        with _folder_flock(self.output_dir):
            while not self._create():
                holder = self._read_holder()
                if holder is None:  # released between the two steps
                    continue
                if holder.get("token") == self.token:
                    return self
                here = holder["host"] == self.record["host"]
                if here and holder["pid"] == self.record["pid"]:
                    # left by this process (a run set up with trainer.setup and never finished): no other run is
                    # using the folder, so it is this run's now
                    self._take_over()
                    return self
                if here and not _is_running(holder["pid"], holder.get("process_start")):
                    print(f"angle-train: warning: taking over the lock of a run that is gone (process {holder['pid']} "
                          f"on {holder['host']}, started {holder.get('started', '?')}): {self.path}",
                          file=sys.stderr, flush=True)
                    self._take_over()
                    return self
                where = "this host" if here else f"host {holder['host']}"
                advice = ("wait for it to finish" if here else
                          f"wait for it to finish (a lock from another host is never broken here: remove {self.path} "
                          "once that run is gone)")
                raise OutputDirLocked(
                    f"--output-dir {self.output_dir} is in use by another run (process {holder['pid']} on {where}, "
                    f"since {holder.get('started', '?')}): {advice}, or choose another --output-dir")
        return self

    def _take_over(self) -> None:
        """Replace the lock there with this run's record, in one step: no moment without a lock. The record is
        written beside it under a name of this run's own (its token), which no other run taking over writes to.
        A take-over that fails leaves no lock of this run's: written_aside raises after its rename too, where the
        folder cannot be synced, and a run that does not start must not hold the folder. The lock replaced was of a
        run that is gone, so the folder is left as free as it was."""
        try:
            with written_aside(self.path, aside=f"{self.path}.{self.token}", encoding="utf-8") as f:
                json.dump(self.record, f)
        except BaseException:
            self._remove_if_ours()
            raise

    def _remove_if_ours(self) -> None:
        """Remove the lock file if it holds this run's record (never another run's)."""
        try:
            with open(self.path, encoding="utf-8") as f:
                ours = json.load(f).get("token") == self.token
        except (OSError, ValueError, AttributeError):
            ours = False
        if ours:
            with contextlib.suppress(OSError):
                os.remove(self.path)

    def release(self) -> None:
        """Remove the lock if it is still this run's, and the output folder if this run created it and left it
        empty (a run refused by a later check leaves no trace)."""
        self._remove_if_ours()
        if self.created_folder:
            with contextlib.suppress(OSError):
                os.rmdir(self.output_dir)  # only when empty


@contextlib.contextmanager
def _folder_flock(folder: str):
    """An exclusive flock of `folder` for the few steps of deciding about the lock (a no-op where unsupported)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        yield
        return
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the flock


def acquire(output_dir: str) -> RunLock:
    """Take the lock of output_dir (created if missing, its entry synced to disk in its parent: made_folder, as the
    run's files synced into it are lost with the folder otherwise) for this run, or raise OutputDirLocked naming
    its holder. Once taken, the records that runs killed while taking over the lock left beside it are removed."""
    created = not os.path.isdir(output_dir)
    made_folder(output_dir)
    lock = RunLock(output_dir, created)
    try:
        lock.acquire()
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                os.rmdir(output_dir)
        raise
    _remove_take_over_leftovers(output_dir)
    return lock


def _remove_take_over_leftovers(output_dir: str) -> None:
    """Delete the files LOCK_FILE.TOKEN (RunLock._take_over writes its record there before the rename) of runs
    killed in between: with the lock held, no other run is taking it over. Regular files of that exact name only."""
    for name in os.listdir(output_dir):
        if _TAKE_OVER_RECORD.fullmatch(name):
            remove_regular_file(os.path.join(output_dir, name))
