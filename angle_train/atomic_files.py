"""Small files a run replaces whole (its metrics after a resume, a checkpoint's manifest, the record of a non-finite
stop, the output folder's lock): written beside their place and swapped in, so that a reader, a kill or a power
loss finds the old contents or the new ones, never half a file, and a write that fails leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import errno
import os

# What fsync of a folder raises on a file system that cannot sync one: the rename is then as durable as it gets there
_CANNOT_SYNC_A_FOLDER = (errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP)


@contextlib.contextmanager
def written_aside(path: str, *, aside: str | None = None, encoding: str | None = None):
    """A text file open for writing beside `path` (`aside`, NAME.tmp unless given) for the block to write the new
    contents into. Once the block ends without an exception the file is flushed and synced to disk, then renamed
    over `path` in one step, and the folder is synced (POSIX), so that the rename too survives a power loss. When
    the block, the sync or the rename raises, the aside file is removed and `path` keeps its previous contents (or
    stays absent); the error is raised on."""
    aside = path + ".tmp" if aside is None else aside
    try:
        with open(aside, "w", encoding=encoding) as file:
            yield file
            file.flush()
            os.fsync(file.fileno())
        os.replace(aside, path)
    except BaseException:
        with contextlib.suppress(OSError):  # the write's own error is the one to see
            os.remove(aside)
        raise
    _sync_folder(os.path.dirname(path) or os.curdir)


def _sync_folder(folder: str) -> None:
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
