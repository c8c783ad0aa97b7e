"""Outputs that appear whole or not at all: a temporary file or folder beside the target, renamed at the end.

A failure, a full disk or Ctrl-C before the rename removes the temporary and leaves the target as it was. The
temporaries are named ``.<target name>.<random>.tmp`` and created with the ordinary mode (the umask applies), so the
renamed output has the permissions any new file or folder would.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
from pathlib import Path
from typing import Callable, Iterator, TypeVar

from ..errors import WriteError

T = TypeVar("T")


def check_output(target: Path, *, overwrite: bool) -> None:
    """Raise FileExistsError if ``target`` exists and may not be replaced."""
    if not overwrite and (target.exists() or target.is_symlink()):
        raise FileExistsError(errno.EEXIST, "output exists", str(target))


def _temporary_name(target: Path) -> Path:
    return target.parent / f".{target.name}.{secrets.token_hex(6)}.tmp"


def _create(target: Path, make: Callable[[Path], T]) -> tuple[Path, T]:
    """Create a fresh temporary beside ``target`` with ``make(path)`` (which fails if the path exists); returns the
    path and what ``make`` returned. WriteError if that is impossible."""
    for _ in range(100):
        tmp = _temporary_name(target)
        try:
            return tmp, make(tmp)
        except FileExistsError:
            continue
        except OSError as e:
            raise WriteError(f"cannot create a temporary beside the output ({e.strerror or e})", path=target) from e
    raise WriteError("cannot find a free temporary name beside the output", path=target)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _move_into_place(tmp: Path, target: Path, *, overwrite: bool) -> None:
    """Rename ``tmp`` to ``target``. A file replaces a file in one step; where a folder is involved, the existing
    target is set aside first (no single rename replaces a folder) and removed once ``tmp`` is in place."""
    check_output(target, overwrite=overwrite)
    old = None
    if (target.exists() or target.is_symlink()) and (tmp.is_dir() or target.is_dir()):
        old = _temporary_name(target)
        os.rename(target, old)
    try:
        os.replace(tmp, target)
    except BaseException:
        if old is not None:
            os.rename(old, target)
        raise
    if old is not None:
        _remove(old)
    _fsync_directory(target.parent)


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary folder beside ``target``; on success it becomes ``target``, on any exception it goes.

    Raises:
        FileExistsError: ``target`` exists and ``overwrite`` is false (checked first and again at the rename).
        WriteError: the folder cannot be created or renamed.
    """
    target = Path(target)
    check_output(target, overwrite=overwrite)
    tmp, _ = _create(target, os.mkdir)
    try:
        yield tmp
    except BaseException:
        _remove(tmp)
        raise
    try:
        _move_into_place(tmp, target, overwrite=overwrite)
    except BaseException as e:
        _remove(tmp)
        if isinstance(e, OSError) and not isinstance(e, FileExistsError):
            raise WriteError(f"cannot move the finished folder into place ({e.strerror or e})", path=target) from e
        raise


class AtomicFile:
    """A binary file written under a temporary name and renamed over ``target`` by :meth:`commit`.

    Used as a context manager, leaving the block with an exception (``KeyboardInterrupt`` too) removes the
    temporary; a write error (a full disk) raises WriteError and removes it as well.
    """

    def __init__(self, target: str | os.PathLike, *, overwrite: bool = False):
        self.target = Path(target)
        self._overwrite = overwrite
        check_output(self.target, overwrite=overwrite)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
        self.tmp, fd = _create(self.target, lambda p: os.open(p, flags, 0o666))
        self._file = os.fdopen(fd, "wb")
        self._done = False

    def __enter__(self) -> "AtomicFile":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def write(self, data) -> None:
        try:
            self._file.write(data)
        except OSError as e:
            self.abort()
            raise WriteError(f"cannot write ({e.strerror or e}); nothing was left behind", path=self.target) from e

    def commit(self) -> Path:
        """Flush, fsync and rename the file into place."""
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            _move_into_place(self.tmp, self.target, overwrite=self._overwrite)
        except BaseException as e:
            self.abort()
            if isinstance(e, OSError) and not isinstance(e, FileExistsError):
                raise WriteError(f"cannot finish the file ({e.strerror or e})", path=self.target) from e
            raise
        self._done = True
        return self.target

    def abort(self) -> None:
        """Close and remove the temporary; the target is left as it was."""
        if self._done:
            return
        self._done = True
        try:
            self._file.close()
        finally:
            self.tmp.unlink(missing_ok=True)


def _fsync_directory(directory: Path) -> None:
    """Make a rename durable where the platform allows opening a folder (not on Windows)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
