"""Converter outputs that appear whole or not at all, and may replace what is there only when asked.

Built on :mod:`szformat.format.atomic` (temporaries beside the target, renamed at the end). On top of it the
converter refuses an existing output unless ``overwrite`` is set: checked first, so no work is wasted, and settled
at the end by a rename that never replaces (of two conversions racing to one output, one wins, the other gets
:class:`~szformat.errors.OutputExistsError`). It replaces a folder as well as a file: a model folder is built in a
temporary folder and renamed at the end. An existing folder is never replaced whole: the files of the new output
are moved into it one by one (each replacing its namesake in one step), and every other file there, the user's
own, stays where it is (:func:`atomic_directory` lists them). An existing empty folder is taken as it is.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterator

from ..errors import OutputExistsError, WriteError
from ..format.atomic import AtomicFile, create_beside, fsync_directory, publish, published, remove, temporary_name


def check_output(target: Path, *, overwrite: bool, folder: bool = False) -> None:
    """Raise OutputExistsError if ``target`` exists and may not be replaced (an empty folder may, for a ``folder``
    output)."""
    if overwrite or not (target.exists() or target.is_symlink()):
        return
    if folder and _is_empty_folder(target):
        return
    raise OutputExistsError(target)


def _is_empty_folder(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and next(path.iterdir(), None) is None


def _merge_into(tmp: Path, target: Path, *, overwrite: bool) -> list[str]:
    """Move every file of folder ``tmp`` into the existing folder ``target`` (with ``overwrite`` replacing its
    namesake in one step, without it only where there is none), then remove ``tmp``; returns the files ``target``
    held that the output did not replace, relative to it."""
    written = set()
    for directory, _, names in os.walk(tmp):
        for name in sorted(names):
            source = Path(directory, name)
            rel = source.relative_to(tmp)
            destination = target / rel
            destination.parent.mkdir(parents=True, exist_ok=True)
            if overwrite:
                os.replace(source, destination)
            else:
                try:
                    publish(source, destination, record=False)
                except OutputExistsError:  # another writer is filling the folder too
                    raise OutputExistsError(target) from None
            written.add(rel.as_posix())
    remove(tmp)
    fsync_directory(target)
    published(target)
    return sorted(p.relative_to(target).as_posix() for p in target.rglob("*")
                  if (p.is_file() or p.is_symlink()) and p.relative_to(target).as_posix() not in written)


def _move_into_place(tmp: Path, target: Path, *, overwrite: bool) -> None:
    """Rename ``tmp`` to ``target``: without ``overwrite`` only if nothing is there, in one step; with it, a file
    replaces a file in one step, and where a folder is involved the existing target is set aside first (no single
    rename replaces a folder) and removed once ``tmp`` is in place."""
    if not overwrite:
        publish(tmp, target)
        fsync_directory(target.parent)
        return
    old = None
    if target.is_symlink() or (target.exists() and not (tmp.is_dir() and target.is_dir())):
        old = temporary_name(target)
        os.rename(target, old)
    try:
        os.replace(tmp, target)
    except BaseException:
        if old is not None:
            os.rename(old, target)
        raise
    published(target)
    if old is not None:
        remove(old)
    fsync_directory(target.parent)


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike, *, overwrite: bool = False,
                     kept: list[str] | None = None) -> Iterator[Path]:
    """Yield a fresh temporary folder beside ``target``; on success it becomes ``target``, on any exception it goes.

    Where ``target`` is a folder already (with ``overwrite``, or empty), the files of the output are moved into it
    one by one and the files it held besides are left there, listed in ``kept`` when given.

    Raises:
        OutputExistsError: ``target`` exists, is not an empty folder, and ``overwrite`` is false (checked first and
            again at the rename).
        WriteError: the folder cannot be created or renamed.
    """
    target = Path(target)
    check_output(target, overwrite=overwrite, folder=True)
    tmp, _ = create_beside(target, os.mkdir, kind="folder")
    try:
        yield tmp
    except BaseException:
        remove(tmp)
        raise
    try:
        if target.is_dir() and not target.is_symlink() and (overwrite or _is_empty_folder(target)):
            left = _merge_into(tmp, target, overwrite=overwrite)
            if kept is not None:
                kept.extend(left)
        else:
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
