"""Small files a run replaces whole (its metrics after a resume, a checkpoint's manifest, the record of a non-finite
stop, the output folder's lock, its config.json, profile.json and curves.png; an export's JSON files and model card;
angle-eval's --json results): written beside their place and swapped in, so that a reader, a kill or a power
loss finds the old contents or the new ones, never half a file, and a write that fails leaves nothing behind.
Folders written whole (a checkpoint, best/, final/) are made durable the same way before they are renamed into
place (sync_tree) and after (sync_folder of their parent): checkpoint._swap_in. A folder a run creates to rename into
(checkpoints/, set-aside/) is made durable in its parent (made_folder), and the folders a move or a deletion changes
are synced after it (checkpoint.set_aside_later_line, checkpoint.remove_earlier_run). A folder moved to another
file system is copied and synced whole before its source is removed (move_durably). What a killed write left (a
NAME.tmp, the lock's take-over record) is removed at a run's start where it is a regular file (remove_regular_file).
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import stat

# What fsync of a folder raises on a file system that cannot sync one: the rename is then as durable as it gets there
_CANNOT_SYNC_A_FOLDER = (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP)


@contextlib.contextmanager
def written_aside(path: str, *, aside: str | None = None, encoding: str | None = None, binary: bool = False):
    """A text file open for writing beside `path` (`aside`, NAME.tmp unless given) for the block to write the new
    contents into. Once the block ends without an exception the file is flushed and synced to disk, then renamed
    over `path` in one step, and the folder is synced (POSIX), so that the rename too survives a power loss. When
    the block, the sync or the rename raises, the aside file is removed and `path` keeps its previous contents (or
    stays absent); the error is raised on. binary: the file is open for bytes (an image), not text. A link at
    `path` is written through, as open() writes it: its target is replaced (NAME.tmp beside the target, on its file
    system) and the link stays, rather than the link being replaced by a file and the target left stale. A file
    replaced keeps its permission bits (a `chmod 600` stays private), as one written in place kept them; a new file
    gets the umask's. An aside file already there (left by a write that was killed) is removed and the new one
    created exclusively: a link left at NAME.tmp is never written through to its target."""
    if aside is None:
        path = os.path.realpath(path)
        aside = path + ".tmp"
    try:
        kept_mode = stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        kept_mode = None
    with contextlib.suppress(FileNotFoundError):
        os.remove(aside)  # a folder there raises, naming it
    try:
        with open(aside, "xb" if binary else "x", encoding=encoding) as file:
            if kept_mode is not None:  # before a byte is written: the aside file is never more readable than `path`
                os.chmod(aside, kept_mode)
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(aside, path)
    except BaseException:
        with contextlib.suppress(OSError):  # the write's own error is the one to see
            os.remove(aside)
        raise
    sync_folder(os.path.dirname(path) or os.curdir)


def move_durably(source: str, destination: str) -> None:
    """Move the file or folder `source` to `destination` (not there yet): one rename where both lie on one file
    system. Across file systems (a checkpoints/ or set-aside/ linked to another disk: the rename fails with EXDEV)
    `source` is copied to DESTINATION.tmp, which is synced whole (sync_tree), renamed into place and its folder
    synced, and only then is `source` removed and its folder synced: a power loss at any point leaves `source` or
    a whole `destination`, where a plain copy and delete (shutil.move) could remove `source` while its copy was
    still in memory only. A copy that fails (a full disk) removes DESTINATION.tmp and raises, `source` kept. The
    caller syncs the folders of a same-system rename (sync_folder), as after any rename."""
    try:
        os.replace(source, destination)
        return
    except OSError as error:
        if error.errno != errno.EXDEV:
            raise
    staged = destination + ".tmp"
    is_folder = os.path.isdir(source) and not os.path.islink(source)
    _remove(staged)  # a copy killed midway
    try:
        if is_folder:
            shutil.copytree(source, staged, symlinks=True)
            sync_tree(staged)
        else:
            shutil.copy2(source, staged, follow_symlinks=False)
            if stat.S_ISREG(os.lstat(staged).st_mode):
                _sync_file(staged)
        os.replace(staged, destination)
    except BaseException:
        _remove(staged)
        raise
    sync_folder(os.path.dirname(destination) or os.curdir)
    if is_folder:
        shutil.rmtree(source)
    else:
        os.remove(source)
    sync_folder(os.path.dirname(source) or os.curdir)


def _remove(path: str) -> None:
    """Remove the file, link or folder tree at `path`, if anything is there."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):  # nothing there; otherwise the copy or the rename names the path
            os.remove(path)


def remove_regular_file(path: str) -> None:
    """Delete `path` where it is a regular file: the leftover of a killed write, removed at a run's start. A link (to
    a file or not: not followed), a folder or any other file there is not such a leftover and stays; nothing there
    (removed meanwhile, or never written) is fine. lstat, not os.path.isfile and islink: one look at the entry."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISREG(os.lstat(path).st_mode):
            os.remove(path)


def sync_tree(folder: str) -> None:
    """Flush every file under `folder` to disk, then each folder of the tree, the deepest first and `folder` last
    (POSIX), so that a rename of `folder` into place, once synced too (sync_folder of its parent), survives a power
    loss with every file whole: a file system may otherwise persist the rename before the files' data, leaving the
    folder in place with empty or partial files. Only regular files are opened: links are not followed and a FIFO,
    socket or device (whose open can block or act) holds no data of the folder's; their entries are synced with
    their folder. A folder that cannot be listed raises (its files would go unsynced), as a file that cannot be
    opened does."""
    for root, _, files in os.walk(folder, topdown=False, onerror=_raise):
        for name in files:
            path = os.path.join(root, name)
            if stat.S_ISREG(os.lstat(path).st_mode):
                _sync_file(path)
        sync_folder(root)


def _raise(error: OSError) -> None:
    raise error


def _sync_file(path: str) -> None:
    # Windows syncs (FlushFileBuffers) only a handle open for writing; POSIX any open file, so read-only there
    fd = os.open(path, os.O_RDONLY if os.name == "posix" else os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def made_folder(path: str) -> None:
    """Create the folder `path` and its missing parents (as os.makedirs with exist_ok), then sync the parent of each
    folder created (POSIX), so that a power loss keeps the new folders too: a rename into a new folder, synced in it
    (sync_folder), is lost with the folder where the folder's own entry in its parent never reached the disk."""
    created, missing = [], os.path.abspath(path)
    while not os.path.isdir(missing):
        created.append(missing)
        missing = os.path.dirname(missing)
    os.makedirs(path, exist_ok=True)
    for folder in created:  # the deepest first: its parent is among those created, or the folder that was there
        sync_folder(os.path.dirname(folder))


def sync_folder(folder: str) -> None:
    """Make a rename in `folder` durable: a folder's entries reach the disk when the folder itself is synced. POSIX
    only: elsewhere (Windows) a folder cannot be opened to sync it."""
    if os.name != "posix":
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as error:
        if error.errno not in _CANNOT_SYNC_A_FOLDER:
            raise
    finally:
        os.close(fd)
