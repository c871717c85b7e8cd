"""angle_kernels.user_cache: a file every `auto` call on a GPU may read, so it never raises and never hangs.

Checked: every malformed file (wrong JSON shape, invalid JSON or UTF-8, deep nesting, another format version, an
oversized file, a FIFO, a folder) reads as empty with one warning per process; updates from concurrent processes
are all kept (the lock) and a reader never sees half a file (the atomic replace); `python -m angle_kernels.verify
--list` and `--forget` show and clear it.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import threading
import warnings

import pytest
import torch

from angle_kernels import user_cache
from angle_kernels.testing.helpers import runtime_warnings


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv(user_cache.CACHE_ENV, str(tmp_path / "cache"))
    user_cache._warned.clear()
    yield user_cache.cache_file()
    user_cache._warned.clear()


def read_warning(path) -> tuple[dict, list[str]]:
    return runtime_warnings(user_cache.read, path)


EMPTY = {"format": user_cache.FORMAT, "verified": [], "checks": []}


@pytest.mark.parametrize("text, why", [
    ("[]", "a JSON list"),
    ("null", "a JSON NoneType"),
    ("3.5", "a JSON float"),
    ('"a string"', "a JSON str"),
    ("{not json", "not JSON"),
    ('{"format": 1, "entries": []}', "format 1"),
    ('{"verified": []}', "format None"),
    ("[" * 100_000 + "]" * 100_000, "not JSON"),  # past the parser's recursion limit
    ('{"format": 2, "checks": [' + "[" * 20 + "]" * 20 + "]}", "nested deeper"),
])
def test_a_malformed_file_reads_as_empty_with_one_warning(cache, text, why):
    cache.parent.mkdir(parents=True)
    cache.write_text(text)
    contents, warned = read_warning(cache)
    assert contents == EMPTY
    assert len(warned) == 1 and why in warned[0] and str(cache) in warned[0]
    assert read_warning(cache) == (EMPTY, [])  # once per process


def test_bytes_that_are_not_utf8(cache):
    cache.parent.mkdir(parents=True)
    cache.write_bytes(b'{"format": 2, "verified": [\xff\xfe]}')
    contents, warned = read_warning(cache)
    assert contents == EMPTY and len(warned) == 1


def test_sections_of_the_wrong_shape_keep_only_their_records(cache):
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"format": user_cache.FORMAT, "verified": {"a": 1}, "checks": [1, "x", {"op": "y"}]}))
    contents, warned = read_warning(cache)
    assert contents["verified"] == [] and contents["checks"] == [{"op": "y"}] and warned == []


def test_an_oversized_file_is_not_read(cache, monkeypatch):
    monkeypatch.setattr(user_cache, "MAX_BYTES", 100)
    cache.parent.mkdir(parents=True)
    cache.write_text(json.dumps({"format": user_cache.FORMAT, "verified": [{"pad": "x" * 200}]}))
    contents, warned = read_warning(cache)
    assert contents == EMPTY and "more than 100" in warned[0]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_a_fifo_does_not_hang_the_reader(cache):
    cache.parent.mkdir(parents=True)
    os.mkfifo(cache)
    done = []
    reader = threading.Thread(target=lambda: done.append(read_warning(cache)), daemon=True)
    reader.start()
    reader.join(timeout=10)
    assert done, "reading a FIFO blocked"
    contents, warned = done[0]
    assert contents == EMPTY and "not a regular file" in warned[0]


def test_a_folder_in_its_place(cache):
    cache.mkdir(parents=True)
    contents, warned = read_warning(cache)
    assert contents == EMPTY and "not a regular file" in warned[0]


def test_an_update_replaces_an_unusable_file_and_keeps_the_other_section(cache):
    cache.parent.mkdir(parents=True)
    cache.write_text("[1, 2]")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        user_cache.update(lambda c: c["checks"].append({"op": "x"}))
    user_cache.update(lambda c: c["verified"].append({"op": "y"}))
    assert read_warning(cache) == ({**EMPTY, "verified": [{"op": "y"}], "checks": [{"op": "x"}]}, [])
    assert sorted(p.name for p in cache.parent.iterdir()) == [cache.name, cache.name + ".lock"]  # no temporaries


def _append_records(folder: str, worker: int, count: int) -> None:
    os.environ[user_cache.CACHE_ENV] = folder
    for i in range(count):
        user_cache.update(lambda c: c["checks"].append({"worker": worker, "i": i}))


def test_concurrent_writers_keep_every_record(cache):
    """Four processes append 25 records each, with readers in between: the lock keeps all 100, and no read sees a
    partial file."""
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    workers = [context.Process(target=_append_records, args=(str(cache.parent), w, 25)) for w in range(4)]
    for worker in workers:
        worker.start()
    seen = 0
    while any(worker.is_alive() for worker in workers):
        contents, warned = read_warning(cache)
        assert warned == []
        seen = max(seen, len(contents["checks"]))
    for worker in workers:
        worker.join()
        assert worker.exitcode == 0
    records = user_cache.read()["checks"]
    assert sorted((r["worker"], r["i"]) for r in records) == [(w, i) for w in range(4) for i in range(25)]


def test_the_lock_is_reentrant_within_a_process(cache):
    with user_cache.locked():
        user_cache.update(lambda c: c["verified"].append({"op": "inside"}))
    assert user_cache.read()["verified"] == [{"op": "inside"}]


def test_verify_lists_and_forgets_the_cache(cache, capsys):
    def add(contents):
        contents["verified"].append({"backend": "triton", "op": "pair_scores", "path": "full", "gpu": "H100",
                                     "capability": "9.0", "torch": "2.13", "triton": "3.6", "fingerprint": "ab" * 8,
                                     "sizes": "standard"})
        contents["checks"].append({"backend": "triton", "op": "similarity_xent", "path": "dense", "dtype": "bfloat16",
                                   "bucket": {"D": 768}, "pass": False, "gpu": "H200", "fingerprint": "cd" * 8})

    user_cache.update(add)
    from angle_kernels import verify

    def command(*argv) -> str:
        assert verify.main(list(argv)) == 0
        return capsys.readouterr().out

    listed = command("--list")
    assert "1 verifications, 1 first-use checks" in listed and str(cache) in listed
    assert "verified  triton pair_scores full on H100 (sm_90" in listed and "abababab" in listed
    assert "FAILED    triton similarity_xent dense bfloat16 [D=768] on H200" in listed
    assert f"removed {cache}" in command("--forget") and not cache.exists()
    assert "nothing to remove" in command("--forget")
    assert "0 verifications, 0 first-use checks" in command("--list")


def test_verify_list_of_a_cache_it_cannot_read_exits_1(tmp_path, monkeypatch, capsys):
    """A cache that is there but cannot be read (a folder path through a file; a file without read permission) was
    listed as "0 verifications, 0 first-use checks" with exit status 0, which a script takes for fact: the status is
    1, as the documented rule and --forget-failed on the same file say. A damaged file is read (as empty, warned)."""
    from angle_kernels import verify

    (tmp_path / "a_file").write_text("not a folder")
    monkeypatch.setenv(user_cache.CACHE_ENV, str(tmp_path / "a_file"))
    assert verify.main(["--list"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"cannot list the cache: {tmp_path / 'a_file' / 'verified.json'}: cannot stat it") and \
        "Not a directory" in err
    monkeypatch.setenv(user_cache.CACHE_ENV, str(tmp_path / "readable"))
    (tmp_path / "readable").mkdir()
    (tmp_path / "readable" / "verified.json").write_text("{damaged")

    def refused(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    status, said = runtime_warnings(verify.main, ["--list"])
    assert status == 0
    assert "0 verifications, 0 first-use checks" in capsys.readouterr().out
    assert any("it is not JSON this package wrote" in text for text in said)
    monkeypatch.setattr("builtins.open", refused)  # as a file of another user without read permission reads
    assert verify.main(["--list"]) == 1
    assert "it cannot be read (PermissionError" in capsys.readouterr().err


def test_the_cache_directory_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv(user_cache.CACHE_ENV, str(tmp_path / "mine"))
    assert user_cache.cache_dir() == tmp_path / "mine"
    monkeypatch.delenv(user_cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert user_cache.cache_dir() == tmp_path / "xdg" / "angle_kernels"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert user_cache.cache_dir() == tmp_path / "home" / ".cache" / "angle_kernels"


def test_a_relative_xdg_cache_home_is_ignored(monkeypatch, tmp_path):
    """The XDG specification: a relative path in XDG_CACHE_HOME is invalid (before: each working directory got a
    cache of its own, and a first-use check was run and recorded again in every one)."""
    monkeypatch.delenv(user_cache.CACHE_ENV, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert user_cache.cache_dir() == tmp_path / "home" / ".cache" / "angle_kernels"


def test_without_a_home_directory_nothing_is_read_or_written(monkeypatch, tmp_path):
    """HOME unset and no passwd entry (a container under an arbitrary user id): Path.home() raises. The cache is
    then absent, with one warning (before: every `auto` call on a GPU raised RuntimeError from the cache path)."""
    for name in (user_cache.CACHE_ENV, "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(user_cache.Path, "home", staticmethod(no_home))
    user_cache._warned.clear()
    with pytest.raises(OSError, match="home directory is unknown"):
        user_cache.cache_dir()
    contents, warned = read_warning(None)
    assert contents == EMPTY and len(warned) == 1 and "no cache is read or written" in warned[0]
    assert read_warning(None) == (EMPTY, [])  # once per process
    user_cache._warned.clear()


def test_a_newer_versions_file_is_left_as_it_is(cache):
    """A cache written in a later format (another environment sharing the folder, a downgrade) is not used and
    not replaced: an update raises OSError, which the first-use check and verify treat as an unwritable cache
    (before: replaced, its records lost)."""
    cache.parent.mkdir(parents=True)
    newer = json.dumps({"format": user_cache.FORMAT + 1, "verified": [{"op": "theirs"}]})
    cache.write_text(newer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert user_cache.read() == EMPTY
        with pytest.raises(OSError, match=f"format {user_cache.FORMAT + 1} by a later version"):
            user_cache.update(lambda c: c["checks"].append({"op": "ours"}))
    assert cache.read_text() == newer
    cache.write_text('{"format": 1}')  # an older one is replaced
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        user_cache.update(lambda c: c["checks"].append({"op": "ours"}))
    assert user_cache.read()["checks"] == [{"op": "ours"}]


def test_a_failed_write_leaves_no_temporary_file(tmp_path):
    target = tmp_path / "out.json"
    target.mkdir()  # os.replace cannot put a file over a folder
    with pytest.raises(OSError):
        user_cache.write_json_atomic(target, {"a": 1})
    with pytest.raises(TypeError):
        user_cache.write_json_atomic(tmp_path / "other.json", {"a": object()})  # not JSON
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out.json"]


def test_verify_checks_out_before_any_check_and_forget_creates_nothing(cache, capsys, tmp_path, monkeypatch):
    """--out's path is refused before anything runs, on a machine with a GPU or without: a folder, or a file under a
    file; without a GPU the command exits NOTHING_VERIFIED and makes no folder."""
    from angle_kernels import verify, verified

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "a file").write_text("")
    for out, message in ((tmp_path, "is a folder"), (tmp_path / "a file" / "x.json", "no folder")):
        with pytest.raises(SystemExit):
            verify.main(["--out", str(out)])
        assert message in capsys.readouterr().err
    assert verify.main(["--forget"]) == 0 and "nothing to remove" in capsys.readouterr().out
    assert not cache.parent.exists()  # no folder or lock file made to find nothing
    assert verified.write_cache([], []) == cache  # what verify prints as where it recorded
    assert verify.main(["--out", str(tmp_path / "new" / "x.json")]) == verify.NOTHING_VERIFIED
    assert not (tmp_path / "new").exists()  # made only where checks run


def _hold_the_lock(folder: str, holding, release) -> None:
    os.environ[user_cache.CACHE_ENV] = folder
    with user_cache.locked():
        holding.set()
        release.wait(30)


def test_a_lock_held_past_the_wait_is_an_oserror_not_a_hang(cache):
    """A process that holds the lock and never lets go (stopped by a job scheduler, a debugger): the waiter gives up
    after the wait with an OSError naming the lock file, which first-use checks and verify treat as an unwritable
    cache (before: a blocking flock, waiting for ever); once it is let go, the lock is taken at once."""
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    holding, release = context.Event(), context.Event()
    holder = context.Process(target=_hold_the_lock, args=(str(cache.parent), holding, release))
    holder.start()
    try:
        assert holding.wait(30)
        with pytest.raises(OSError, match=r"verified\.json\.lock has been held by another process for 0.2 s"):
            with user_cache.locked(wait_seconds=0.2):
                pass
    finally:
        release.set()
        holder.join(30)
    assert holder.exitcode == 0
    with user_cache.locked(wait_seconds=5):
        pass


@pytest.mark.skipif(not hasattr(os, "umask"), reason="no umask here")
@pytest.mark.parametrize("umask", [0o022, 0o002])
def test_the_file_takes_the_mode_the_umask_gives_a_new_file(cache, umask):
    """A shared cache folder: the file is readable as far as the umask lets a new file be (a temporary file's own
    0o600 locked the group out, and their next update replaced the unreadable file, losing its records)."""
    old = os.umask(umask)
    try:
        user_cache.update(lambda contents: contents["checks"].append({"op": "mine"}))
    finally:
        os.umask(old)
    assert cache.stat().st_mode & 0o777 == 0o666 & ~umask


def test_a_file_that_cannot_be_read_is_reported_as_such_and_never_replaced(cache, monkeypatch):
    """Another user's file in a shared folder (mode 0600): reported as unreadable, not as "not JSON", and an update
    raises OSError (an unwritable cache to its callers) instead of replacing it and losing its records."""
    user_cache.update(lambda contents: contents["checks"].append({"op": "theirs"}))
    real_open = open

    def unreadable(path, mode="r", *args, **kwargs):
        if str(path) == str(cache) and "r" in mode:
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, mode, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(user_cache, "open", unreadable, raising=False)
        contents, warned = read_warning(cache)
        assert contents == EMPTY and len(warned) == 1 and "it cannot be read (PermissionError" in warned[0]
        with pytest.raises(OSError, match="cannot be read .*left as it is"):
            user_cache.update(lambda contents: contents["checks"].append({"op": "ours"}))
    assert user_cache.read()["checks"] == [{"op": "theirs"}]


@pytest.mark.skipif(not hasattr(os, "symlink"), reason="no symbolic links here")
def test_a_path_whose_status_cannot_be_read_is_never_replaced(cache):
    """A cache path whose status cannot be read (here a symbolic link to itself: too many levels of links) reads as
    empty with a warning, and an update raises OSError instead of putting a file in the link's place."""
    cache.parent.mkdir(parents=True)
    os.symlink(cache, cache)
    contents, warned = read_warning(cache)
    assert contents == EMPTY and len(warned) == 1 and "cannot stat it" in warned[0]
    with pytest.raises(OSError, match="cannot stat it.*left as it is"):
        user_cache.update(lambda contents: contents["checks"].append({"op": "ours"}))
    assert os.path.islink(cache) and os.readlink(cache) == str(cache)


def test_a_cache_broken_again_after_forget_warns_again(cache):
    """forget() starts the file afresh: a file broken again at the same path is reported again on the next read
    (not taken as the one this process already warned about)."""
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")
    assert len(read_warning(cache)[1]) == 1
    assert user_cache.forget() and not cache.exists()
    cache.write_text("[]")
    contents, warned = read_warning(cache)
    assert contents == EMPTY and len(warned) == 1 and "a JSON list" in warned[0]


def test_a_write_that_fails_as_it_flushes_leaves_no_temporary_file(tmp_path, monkeypatch):
    """A full disk: the error comes when the written text is flushed, after json.dump returned."""
    real_open = open

    class FullDisk:
        def __init__(self, handle):
            self.handle = handle

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.handle.close()
            raise OSError(28, "No space left on device")

        def write(self, text):
            return self.handle.write(text)

    monkeypatch.setattr(user_cache, "open", lambda *args, **kwargs: FullDisk(real_open(*args, **kwargs)),
                        raising=False)
    with pytest.raises(OSError, match="No space left"):
        user_cache.write_json_atomic(tmp_path / "out.json", {"a": 1})
    assert list(tmp_path.iterdir()) == []


def test_forget_failed_keeps_every_passing_check_and_verification(cache, capsys):
    user_cache.update(lambda contents: contents.update(
        verified=[{"op": "verified"}],
        checks=[{"op": "passed", "pass": True}, {"op": "failed", "pass": False}, {"op": "odd", "pass": "true"}]))
    from angle_kernels import verify

    assert verify.main(["--forget-failed"]) == 0
    assert f"removed 2 failed first-use check(s) from {cache}" in capsys.readouterr().out
    assert user_cache.read() == {"format": user_cache.FORMAT, "verified": [{"op": "verified"}],
                                 "checks": [{"op": "passed", "pass": True}]}
    # a file an update would replace (not JSON, an older format): its records are someone's; left as it is
    for text in ("{not json", '{"format": 1, "verified": [{"op": "older"}]}'):
        cache.write_text(text)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            assert verify.main(["--forget-failed"]) == 1
        assert "left as it is" in capsys.readouterr().err and cache.read_text() == text


def test_verify_list_marks_the_first_use_checks_an_older_checker_made(cache, capsys):
    """--list says which first-use checks the current checker made (used) and which an older one made (not used)."""
    from angle_kernels import first_use, verify

    def add(contents):
        for checker in (first_use.CHECKER, first_use.CHECKER - 1):
            contents["checks"].append({"backend": "triton", "op": "pair_scores", "path": f"made by {checker}",
                                       "dtype": "float32", "bucket": {}, "pass": True, "checker": checker})

    user_cache.update(add)
    assert verify.main(["--list"]) == 0
    current, older = [line for line in capsys.readouterr().out.splitlines() if line.startswith("passed")]
    assert f"made by {first_use.CHECKER} " in current and "an older check's: not used" not in current
    assert f"made by {first_use.CHECKER - 1} " in older and "an older check's: not used" in older
