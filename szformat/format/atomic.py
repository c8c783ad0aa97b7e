"""Outputs that appear whole or not at all: a temporary beside the target, fsynced and renamed over it at the end.

A failure, a full disk or Ctrl-C before the rename removes the temporary and leaves the target as it was. The
temporaries are named ``.<target name>.<random>.tmp`` and created with the ordinary mode (the umask applies):
``tempfile.mkstemp`` would make a file only its owner can read, and the rename would carry that over to the output.
"""

from __future__ import annotations

import os
import secrets
import shutil
from pathlib import Path
from typing import Callable, TypeVar

from ..errors import SzformatError, WriteError

__all__ = ["AtomicFile", "create_beside", "fsync_directory", "remove", "temporary_name"]

T = TypeVar("T")


def temporary_name(target: Path) -> Path:
    """A fresh ``.<name>.<random>.tmp`` path beside ``target``."""
    return target.parent / f".{target.name}.{secrets.token_hex(6)}.tmp"


def create_beside(target: Path, make: Callable[[Path], T], *, kind: str = "file") -> tuple[Path, T]:
    """Create a temporary ``kind`` beside ``target`` with ``make(path)``, which must fail if the path exists.

    Returns the path and what ``make`` returned.

    Raises:
        WriteError: nothing can be created there (a missing folder, no permission, no free name).
    """
    for _ in range(100):
        tmp = temporary_name(target)
        try:
            return tmp, make(tmp)
        except FileExistsError:
            continue
        except OSError as e:
            raise WriteError(f"cannot create a temporary {kind} beside the output ({e.strerror or e})",
                             path=target) from e
    raise WriteError(f"cannot find a free temporary {kind} name beside the output", path=target)


def fsync_directory(directory: Path) -> None:
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


def remove(path: Path) -> None:
    """Remove a temporary file or folder, whatever it holds."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class AtomicFile:
    """A binary file written under a temporary name and renamed over ``target`` by :meth:`commit`.

    Used as a context manager, leaving the block with an exception (``KeyboardInterrupt`` too) removes the
    temporary; a write error (a full disk) raises WriteError and removes it as well.

    Example:
        >>> with AtomicFile("out.bin") as f:  # doctest: +SKIP
        ...     f.write(b"data")
        ...     f.commit()
    """

    def __init__(self, target: str | os.PathLike):
        self.target = Path(target)
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0)
        self.tmp, fd = create_beside(self.target, lambda p: os.open(p, flags, 0o666))
        self._file = os.fdopen(fd, "wb")
        self._done = False

    def __enter__(self) -> "AtomicFile":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()

    def write(self, data, *, at: int | None = None) -> None:
        """Append ``data``; with ``at``, overwrite the bytes written earlier from that offset (a placeholder)."""
        try:
            if at is None:
                self._file.write(data)
            else:
                end = self._file.tell()
                self._file.seek(at)
                self._file.write(data)
                self._file.seek(end)
        except OSError as e:
            self.abort()
            raise WriteError(f"cannot write ({e.strerror or e}); nothing was left behind", path=self.target) from e

    def commit(self) -> Path:
        """Flush, fsync and rename the file into place, then fsync its folder."""
        try:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            self._move_into_place()
        except BaseException as e:
            self.abort()
            if isinstance(e, OSError) and not isinstance(e, (FileExistsError, SzformatError)):
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
        except OSError:
            pass  # flushing bytes that are about to be removed failed again (a full disk); the file is closed anyway
        finally:
            self.tmp.unlink(missing_ok=True)

    def _move_into_place(self) -> None:
        """Replace the target, a file or nothing, in one step."""
        os.replace(self.tmp, self.target)
        fsync_directory(self.target.parent)
