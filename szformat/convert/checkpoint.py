"""What a checkpoint path holds, and how its converted twin is laid out.

A path is one weight file, a sharded index (``*.safetensors.index.json`` or ``*.szt.index.json``) with its
shards, or a model folder. A folder is converted file by file, sub-folders included (a diffusers pipeline keeps
its ``transformer/``, ``text_encoder/``... layout): weight files change suffix, indexes are rewritten to name the
new shards, every other file (config, tokenizer, scheduler, model card) is copied; hidden files and folders
(``.git``, ``.cache``) are left out, and so are weights in other formats (``pytorch_model.bin``, ``.ckpt``,
``.onnx``...): the twin holds the weights once, in its own format. The same code serves both directions,
``.safetensors -> .szt`` and back.
"""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Callable

from ..errors import ConversionError, WriteError
from ..format.constants import MAGIC
from ..format.index import INDEX_TAIL, ShardIndex, check_index, read_index, shard_path, write_index
from ..paths import UNREADABLE, outside_the_folder
from .outputs import atomic_directory, check_output

OTHER_WEIGHT_FORMATS = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".onnx", ".onnx_data", ".gguf",
                        ".bin.index.json", ".pt.index.json")
"""Files a converted folder leaves out: weights in formats other than the one converted, and their indexes."""

WriteWeights = Callable[[Path, Path], None]
"""Writes the converted twin of one weight file: ``(source, destination)``."""


@dataclass(frozen=True)
class CheckpointFiles:
    """The files of a checkpoint as paths relative to ``root`` (POSIX separators), sorted.

    ``source`` is the path as given; ``single_file`` is true when it named one weight file: its output is a file,
    not a folder.
    """

    source: Path
    root: Path
    single_file: bool
    weights: tuple[str, ...]
    indexes: tuple[str, ...]
    others: tuple[str, ...]
    left_out: tuple[tuple[str, str], ...] = ()
    """Entries of the folder not copied, and why (links out of it, FIFOs, devices, linked folders)."""


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint ready to convert: raw tensor sizes of each weight file, validated indexes, other files."""

    files: CheckpointFiles
    sizes: dict[str, dict[str, int]]
    indexes: dict[str, ShardIndex]

    @property
    def raw_bytes(self) -> int:
        return sum(sum(s.values()) for s in self.sizes.values())


def renamed(name: str, old_suffix: str, new_suffix: str) -> str:
    """``model-00001-of-00002.safetensors`` -> ``model-00001-of-00002.szt``, and likewise for index names."""
    for tail in (old_suffix + INDEX_TAIL, old_suffix):
        if name.endswith(tail):
            return name[: -len(tail)] + new_suffix + tail[len(old_suffix):]
    return name


def find_files(path: str | os.PathLike, suffix: str, *, magic: bytes | None = None) -> CheckpointFiles:
    """List the files of the checkpoint at ``path`` whose weight files end with ``suffix``.

    A weight file named otherwise (``model.bin``, ``MODEL.SZT``) is recognised by its first bytes when ``magic`` is
    given: what a file holds decides what it is, as for every reader of the format. Inside a folder, names decide.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ConversionError: ``path`` is not a weight file, an index or a folder holding weight files.
        ShardIndexError: ``path`` is an index, and it is malformed.
    """
    path = Path(path)
    if path.is_dir():
        return _find_in_folder(path, suffix)
    if not path.exists():
        raise FileNotFoundError(errno.ENOENT, "no such file or folder", str(path))
    if path.name.endswith(suffix + INDEX_TAIL):  # the shards present; a missing one is the index's problem
        shards = sorted(s for s in read_index(path).shard_names() if _is_file(path.parent / s))
        return CheckpointFiles(path, path.parent, False, tuple(shards), (path.name,), ())
    if path.name.endswith(suffix) or (magic is not None and path.is_file() and _starts_with(path, magic)):
        return CheckpointFiles(path, path.parent, True, (path.name,), (), ())
    if magic is not None:
        raise ConversionError(f"not a {suffix} file (it does not start with the {suffix} magic bytes), nor a "
                              f"*{suffix}{INDEX_TAIL} index or a folder", path=path)
    raise ConversionError(f"expected a {suffix} file, a *{suffix}{INDEX_TAIL} index or a model folder"
                          f"{_what_it_is(path)}", path=path)


def _starts_with(path: Path, magic: bytes) -> bool:
    with open(path, "rb") as f:
        return f.read(len(magic)) == magic


def _what_it_is(path: Path) -> str:
    """A hint for a file given under a name that does not say what it holds: a .szt file, or safetensors data (an
    8-byte little-endian header length, then a JSON object) under another suffix."""
    try:
        with open(path, "rb") as f:
            head = f.read(9)
    except OSError:
        return ""
    if head[: len(MAGIC)] == MAGIC:
        return (f"; it is a .szt file already: 'szconvert decompress {path} OUT.safetensors' turns it back, "
                f"'szconvert info {path}' shows what it holds")
    if len(head) == 9 and head[8:] == b"{" and 0 < int.from_bytes(head[:8], "little") < path.stat().st_size:
        return f"; it holds safetensors data: rename it to {path.stem}.safetensors"
    return ""


def _find_in_folder(folder: Path, suffix: str) -> CheckpointFiles:
    """The folder's weight files, indexes and other files: regular files inside it (links resolved), the rest left
    out and said why; a weight file or index that breaks that rule is refused (the model would be incomplete)."""
    weights, indexes, others, left_out = [], [], [], []
    for directory, subdirs, names in os.walk(folder):
        for name in sorted(subdirs):
            problem = outside_the_folder(folder, Path(directory, name)) if not name.startswith(".") else None
            if problem:
                left_out.append((Path(directory, name).relative_to(folder).as_posix(), problem))
        subdirs[:] = sorted(d for d in subdirs if not d.startswith(".") and not Path(directory, d).is_symlink())
        for name in sorted(names):
            full = Path(directory, name)
            if name.startswith(".") or name.endswith(OTHER_WEIGHT_FORMATS):
                continue
            rel = full.relative_to(folder).as_posix()
            problem = outside_the_folder(folder, full)
            if name.endswith(suffix + INDEX_TAIL) or name.endswith(suffix):
                if problem and problem != UNREADABLE:  # an unreadable one is kept: opening it says exactly why
                    raise ConversionError(f"{rel} is {problem}; only files inside the folder are converted",
                                          path=folder)
                if not name.endswith(suffix):
                    if _is_file(full):
                        indexes.append(rel)
                else:
                    weights.append(rel)
            elif problem:
                left_out.append((rel, problem))
            else:
                others.append(rel)
    if not weights:
        raise ConversionError(f"folder holds no {suffix} file", path=folder)
    return CheckpointFiles(folder, folder, False, tuple(weights), tuple(indexes), tuple(others), tuple(left_out))


def _is_file(path: Path) -> bool:
    """Whether ``path`` is a file; ``False`` for a name no file can have (too long) rather than an error."""
    try:
        return path.is_file()
    except (OSError, ValueError):
        return False


def open_checkpoint(path: str | os.PathLike, suffix: str, read_sizes: Callable[[Path], dict[str, int]], *,
                    magic: bytes | None = None) -> Checkpoint:
    """Find the files of a checkpoint (as `find_files` does), read each weight file's header and check each index
    against its shards.

    ``read_sizes`` returns the raw byte size of each tensor of a weight file (and validates its header), so a bad
    file anywhere is refused before any output exists.
    """
    files = find_files(path, suffix, magic=magic)
    sizes = {rel: read_sizes(files.root / rel) for rel in files.weights}
    indexes = {}
    for rel in files.indexes:
        index = read_index(files.root / rel)
        check_index(index, files.root / rel, sizes, rel)
        indexes[rel] = index
    return Checkpoint(files, sizes, indexes)


def output_path(files: CheckpointFiles, target: str | os.PathLike | None, old_suffix: str, new_suffix: str) -> Path:
    """Where the converted twin goes: ``target`` as given, except for a single file, which goes beside its source
    when ``target`` is ``None`` and into ``target`` when that is an existing folder (as ``cp`` does). A file
    recognised by its content rather than its suffix (``model.bin``) gets its last suffix replaced.

    Raises:
        ConversionError: ``target`` is ``None`` for an index or a folder.
    """
    if files.single_file:
        name = renamed(files.weights[0], old_suffix, new_suffix)
        if name == files.weights[0]:
            name = PurePosixPath(name).with_suffix(new_suffix).name
        if target is None:
            return files.root / name
        return Path(target) / name if Path(target).is_dir() else Path(target)
    if target is None:
        raise ConversionError("a sharded checkpoint or a folder gives a folder: name the output folder",
                              path=files.source)
    return Path(target)


def write_checkpoint(checkpoint: Checkpoint, target: str | os.PathLike, *, old_suffix: str, new_suffix: str,
                     write_weights: WriteWeights, overwrite: bool = False, kept: list[str] | None = None) -> None:
    """Produce the converted twin of ``checkpoint`` at ``target``, atomically.

    A single weight file becomes a single file (``write_weights`` writes it atomically); anything else becomes a
    folder, built in a temporary folder beside ``target`` and renamed at the end, or, where ``target`` is a folder
    already, moved into it file by file; the files it held besides stay and are listed in ``kept``.
    """
    files = checkpoint.files
    target = Path(target)
    _refuse_overlap(files.source, target)
    if files.single_file:
        check_output(target, overwrite=overwrite)
        write_weights(files.root / files.weights[0], target)
        return
    rename = lambda name: renamed(name, old_suffix, new_suffix)  # noqa: E731
    with atomic_directory(target, overwrite=overwrite, kept=kept) as tmp:
        for rel in files.weights:
            destination = tmp / rename(rel)
            destination.parent.mkdir(parents=True, exist_ok=True)
            write_weights(files.root / rel, destination)
        for rel, index in checkpoint.indexes.items():
            shards = {shard_path(rel, s) for s in index.shard_names()}
            total = sum(sum(checkpoint.sizes[s].values()) for s in shards)
            destination = tmp / rename(rel)
            destination.parent.mkdir(parents=True, exist_ok=True)
            write_index(destination, index.renamed(rename, total))
        for rel in files.others:
            destination = tmp / rel
            destination.parent.mkdir(parents=True, exist_ok=True)
            try:
                shutil.copyfile(files.root / rel, destination)
            except OSError as e:
                raise WriteError(f"cannot copy {rel} into the output ({e.strerror or e})", path=target) from e


def _refuse_overlap(source: Path, target: Path) -> None:
    """The output must not be the input, hold it, or lie inside an input folder: it would be read while written,
    or replaced with the input still in it."""
    source, resolved = source.resolve(), target.resolve()
    if resolved == source or resolved in source.parents or (source.is_dir() and source in resolved.parents):
        raise ConversionError(f"the output {str(target)!r} overlaps the input; choose a path outside it",
                              path=source)
