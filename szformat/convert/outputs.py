"""Converter outputs that appear whole or not at all, and may replace what is there only when asked.

Built on :mod:`szformat.format.atomic` (temporaries beside the target, renamed at the end). On top of it the
converter refuses an existing output unless ``overwrite`` is set: checked first, so no work is wasted, and settled
at the end by a rename that never replaces (of two conversions racing to one output, one wins, the other gets
:class:`~szformat.errors.OutputExistsError`). It replaces a folder as well as a file: a model folder is built in a
temporary folder and renamed at the end.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

from ..errors import OutputExistsError, WriteError
from ..format.atomic import AtomicFile, create_beside, fsync_directory, publish, remove, temporary_name


def check_output(target: Path, *, overwrite: bool) -> None:
    """Raise OutputExistsError if ``target`` exists and may not be replaced."""
    if not overwrite and (target.exists() or target.is_symlink()):
        raise OutputExistsError(target)


def _move_into_place(tmp: Path, target: Path, *, overwrite: bool) -> None:
    """Rename ``tmp`` to ``target``: without ``overwrite`` only if nothing is there, in one step; with it, a file
    replaces a file in one step, and where a folder is involved the existing target is set aside first (no single
    rename replaces a folder) and removed once ``tmp`` is in place."""
    if not overwrite:
        publish(tmp, target)
        fsync_directory(target.parent)
        return
    old = None
    if (target.exists() or target.is_symlink()) and (tmp.is_dir() or target.is_dir()):
        old = temporary_name(target)
        os.rename(target, old)
    try:
        os.replace(tmp, target)
    except BaseException:
        if old is not None:
            os.rename(old, target)
        raise
    if old is not None:
        remove(old)
    fsync_directory(target.parent)


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike, *, overwrite: bool = False) -> Iterator[Path]:
    """Yield a fresh temporary folder beside ``target``; on success it becomes ``target``, on any exception it goes.

    Raises:
        OutputExistsError: ``target`` exists and ``overwrite`` is false (checked first and again at the rename).
        WriteError: the folder cannot be created or renamed.
    """
    target = Path(target)
    check_output(target, overwrite=overwrite)
    tmp, _ = create_beside(target, os.mkdir, kind="folder")
    try:
        yield tmp
    except BaseException:
        remove(tmp)
        raise
    try:
        _move_into_place(tmp, target, overwrite=overwrite)
    except BaseException as e:
        remove(tmp)
        if isinstance(e, OSError) and not isinstance(e, OutputExistsError):
            raise WriteError(f"cannot move the finished folder into place ({e.strerror or e})", path=target) from e
        raise


class OutputFile(AtomicFile):
    """An :class:`AtomicFile` that refuses an existing ``target`` unless ``overwrite`` is set, and then replaces
    a folder too."""

    def __init__(self, target: str | os.PathLike, *, overwrite: bool = False):
        check_output(Path(target), overwrite=overwrite)
        super().__init__(target, overwrite=overwrite)

    def _move_into_place(self) -> None:
        _move_into_place(self.tmp, self.target, overwrite=self.overwrite)
