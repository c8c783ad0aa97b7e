"""Sharded-checkpoint indexes: read and check one, write one, list the shards of a .szt checkpoint.

A checkpoint split over several files has an index beside them in the shape transformers and diffusers write
(``model.safetensors.index.json``; ``model.szt.index.json`` for .szt shards): ``{"metadata": {..., "total_size":
N}, "weight_map": {tensor: shard file}}``, shard names relative to the index's folder (``spec/szt-v1.md``,
"Sharded checkpoints"). The same reader serves both suffixes, so the converter's safetensors inputs and the
loaders' .szt checkpoints are held to the same rules.
"""

from __future__ import annotations

import json
import os
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Mapping, NamedTuple

from .._collector import collector_paused
from .._lazy import atomic
from ..errors import FormatError, ShardIndexError, listing, short_repr
from . import constants as C
from .reader import SztFile

__all__ = ["INDEX_TAIL", "SEVERAL_INDEXES", "Shard", "ShardIndex", "check_index", "check_shard", "checkpoint_shards",
           "index_problems", "load_checkpoint", "open_shard", "read_index", "shard_path", "write_index"]

INDEX_TAIL = ".index.json"
"""What follows the weight-file suffix in an index's name (``model.szt`` + ``.index.json``)."""


@dataclass(frozen=True)
class ShardIndex:
    """A parsed index: its ``metadata`` object and its ``weight_map`` (tensor name -> shard name)."""

    metadata: dict[str, Any]
    weight_map: dict[str, str]

    def shard_names(self) -> list[str]:
        """The shards the weight map names, in first-mention order, without repeats."""
        return list(dict.fromkeys(self.weight_map.values()))

    def renamed(self, rename: Callable[[str], str], total_size: int) -> "ShardIndex":
        """The same index with every shard renamed and ``total_size`` set."""
        return ShardIndex({**self.metadata, "total_size": total_size},
                          {name: rename(shard) for name, shard in self.weight_map.items()})


def read_index(path: str | os.PathLike) -> ShardIndex:
    """Parse and validate an index file.

    Raises:
        ShardIndexError: not a JSON object, a key repeated in one object, no ``weight_map`` object of strings, a
            ``metadata`` that is not an object, or a shard name that is not a file inside the index's folder.
    """
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f, object_pairs_hook=_unique_keys)
    except ShardIndexError as e:
        raise e.with_context(path=path) from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ShardIndexError(f"sharded index is not valid JSON ({e})", path=path) from None
    except ValueError as e:  # an integer past Python's digit limit for int(str)
        raise ShardIndexError(f"sharded index cannot be read ({str(e).split(';')[0]})", path=path) from None
    if not isinstance(obj, dict) or not isinstance(obj.get("weight_map"), dict):
        raise ShardIndexError("sharded index has no 'weight_map' object", path=path)
    metadata = obj.get("metadata", {})
    if not isinstance(metadata, dict):
        raise ShardIndexError("sharded index 'metadata' must be an object", path=path)
    for tensor, shard in obj["weight_map"].items():
        if not isinstance(shard, str) or not _is_relative_file(shard):
            raise ShardIndexError(f"weight_map names {short_repr(shard)}, not a file inside the index's folder",
                                  path=path, tensor=tensor)
        if "\0" in shard:
            raise ShardIndexError(f"weight_map names {shard!r}, which holds a NUL character: no file has such a name",
                                  path=path, tensor=tensor)
        try:
            os.fsencode(shard)
        except UnicodeError:  # a lone surrogate (JSON escapes allow one): not a name this file system can hold
            raise ShardIndexError(f"weight_map names {shard!r}, which is not a file name this system can encode",
                                  path=path, tensor=tensor) from None
    return ShardIndex(metadata, obj["weight_map"])


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """A JSON object as a dict, refusing a repeated key: ``json`` would keep the last one silently."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ShardIndexError(f"sharded index holds the key {short_repr(key)} twice")
        obj[key] = value
    return obj


def _is_relative_file(name: str) -> bool:
    """A ``/``-separated path below the index's folder: not absolute, no ``\\``, no empty, ``.`` or ``..`` part."""
    return bool(name) and "\\" not in name and all(p not in ("", ".", "..") for p in name.split("/"))


def write_index(path: str | os.PathLike, index: ShardIndex) -> Path:
    """Write an index atomically, laid out as transformers writes it: keys sorted, two-space indent, a trailing
    newline. Sorted keys make the bytes depend on the content alone, so converting twice gives equal files.

    Raises:
        WriteError: the file cannot be written; an existing ``path`` is left as it was, and no temporary remains.
    """
    path = Path(path)
    text = json.dumps({"metadata": index.metadata, "weight_map": index.weight_map}, indent=2, sort_keys=True,
                      ensure_ascii=False)
    with atomic.AtomicFile(path) as file:
        file.write((text + "\n").encode("utf-8"))
        file.commit()
    return path


def shard_path(index_name: str, shard: str) -> str:
    """The relative path of ``shard`` named by the index at relative path ``index_name``."""
    return posixpath.join(posixpath.dirname(index_name), shard)


def index_problems(index: ShardIndex, shards: Mapping[str, Collection[str] | None],
                   index_name: str) -> Iterator[tuple[str | None, str]]:
    """``(tensor, problem)``: one for each missing shard (``tensor`` None: the problem names the shard and its
    tensors), then one for each tensor of the weight map that is not in the shard it names, then for each tensor a
    shard of the index holds that the weight map does not map to that shard (a loader following the index would
    leave it out).

    ``shards`` maps the relative path of each shard present to the names of its tensors, or to ``None`` for a shard
    that could not be read (a problem reported on its own, so its tensors are not reported again).
    """
    missing: dict[str, list[str]] = {}
    for tensor, shard in index.weight_map.items():
        if shard_path(index_name, shard) not in shards:
            missing.setdefault(shard, []).append(tensor)
    for shard, tensors in missing.items():
        yield None, (f"the index names shard {shard!r}, which is missing ({len(tensors)} tensor(s): "
                     f"{listing([repr(t) for t in tensors])})")
    for tensor, shard in index.weight_map.items():
        path = shard_path(index_name, shard)
        if path in shards and shards[path] is not None and tensor not in shards[path]:
            yield tensor, f"the index maps this tensor to shard {shard!r}, which does not hold it"
    for shard in index.shard_names():
        for tensor in shards.get(shard_path(index_name, shard)) or ():
            if index.weight_map.get(tensor) != shard:
                yield tensor, _unmapped(index, shard, tensor)


def _unmapped(index: ShardIndex, shard: str, tensor: str) -> str:
    elsewhere = index.weight_map.get(tensor)
    mapped = "omits it" if elsewhere is None else f"maps it to shard {elsewhere!r}"
    return f"shard {shard!r} holds this tensor, and the index's weight_map {mapped}"


def check_index(index: ShardIndex, index_path: str | os.PathLike, shards: Mapping[str, Collection[str]],
                index_name: str) -> None:
    """Raise ShardIndexError for the first tensor of the weight map that is not in the shard it names."""
    for tensor, problem in index_problems(index, shards, index_name):
        raise ShardIndexError(problem, path=index_path, tensor=tensor)


SEVERAL_INDEXES = "folder holds several sharded indexes; pass the file or index to load"


class Shard(NamedTuple):
    """One .szt file of a checkpoint to load: the tensors to take from it and what listed it.

    ``names`` is ``None`` when every tensor is taken (the file is not named by an index); ``listed_by`` is the index
    or folder that named the file, ``None`` when it was given itself.
    """

    path: Path
    names: list[str] | None
    listed_by: Path | None

    def label(self) -> str:
        """The file as the index or folder names it."""
        base = self.listed_by.parent if self.names is not None else self.listed_by
        return self.path.name if base is None else Path(os.path.relpath(self.path, base)).as_posix()


def checkpoint_shards(path: str | os.PathLike) -> list[Shard]:
    """The .szt files of a checkpoint and the tensors to take from each.

    ``path`` is a .szt file, a sharded index (``*.szt.index.json``), or a folder holding one index or else .szt
    files. Shards are checked by name only (see :func:`read_index`), not resolved: in the Hugging Face cache each
    one is a link to a blob outside the index's folder.

    Raises:
        ShardIndexError: the index is not valid.
        FormatError: a folder with several indexes or no .szt file.
    """
    path = Path(path)
    if path.is_dir():
        indexes = sorted(path.glob("*" + C.INDEX_SUFFIX))
        if len(indexes) == 1:
            return checkpoint_shards(indexes[0])
        files = sorted(path.glob("*" + C.FILE_SUFFIX))
        if len(indexes) > 1:
            raise FormatError(SEVERAL_INDEXES, path=path)
        if not files:
            raise FormatError(f"folder holds no {C.FILE_SUFFIX} file; pass the file or index to load", path=path)
        return [Shard(f, None, path) for f in files]
    if not path.name.endswith(C.INDEX_SUFFIX):
        return [Shard(path, None, None)]
    shards: dict[str, list[str]] = {}
    for name, shard in read_index(path).weight_map.items():
        shards.setdefault(shard, []).append(name)
    return [Shard(path.parent / shard, names, path) for shard, names in sorted(shards.items())]


def open_shard(shard: Shard) -> SztFile:
    """Open one file of :func:`checkpoint_shards` and check it holds what its index says, no more, no less.

    Raises:
        ShardIndexError: the file an index names cannot be opened (missing, a loop of links, a name too long...),
            lacks a tensor the index maps to it, or holds one the index does not map to it.
        FormatError: a file a folder holds cannot be opened, or is not valid .szt.
        OSError: the file given itself cannot be opened.
    """
    try:
        file = SztFile(shard.path)
    except OSError as e:
        if shard.listed_by is None:
            raise
        reason = f"{e.strerror or e}"
        if shard.names is None:
            raise FormatError(f"{shard.label()!r} in this folder cannot be opened ({reason})",
                              path=shard.listed_by) from e
        raise ShardIndexError(f"the index names shard {shard.label()!r}, which cannot be opened ({reason})",
                              path=shard.listed_by, tensor=shard.names[0]) from e
    try:
        check_shard(shard, file.entries)
    except BaseException:
        file.close()
        raise
    return file


def check_shard(shard: Shard, held: Collection[str]) -> None:
    """Check that an opened shard holding ``held`` (in file order) has exactly the tensors its index maps to it.

    Raises:
        ShardIndexError: the index maps a tensor to this shard and the shard does not hold it, or the shard holds a
            tensor the index does not map to it.
    """
    if shard.names is None:
        return
    wanted = set(shard.names)
    for name in shard.names:
        if name not in held:
            raise ShardIndexError(f"the index maps this tensor to shard {shard.label()!r}, which does not hold it",
                                  path=shard.listed_by, tensor=name)
    for name in held:
        if name not in wanted:
            raise ShardIndexError(f"shard {shard.label()!r} holds this tensor, and the index's weight_map does not "
                                  "map it to that shard", path=shard.listed_by, tensor=name)


def load_checkpoint(load_shard: Callable[[SztFile, list[str] | None], dict[str, Any]],
                    path: str | os.PathLike) -> dict[str, Any]:
    """Every tensor of a checkpoint (file, sharded index or folder), one shard at a time, by name.

    ``load_shard(file, names)`` gives ``names`` (``None``: all) of one open shard: loaded on whatever device it
    serves, or anything else it makes of them (their entries, say).

    Raises:
        ShardIndexError: the index is malformed, names a shard that cannot be opened, or does not match what a
            shard holds.
        FormatError: a shard is not valid .szt, or two shards hold one tensor.
    """
    tensors: dict[str, Any] = {}
    with collector_paused():
        for shard in checkpoint_shards(path):
            with open_shard(shard) as file:
                loaded = load_shard(file, shard.names)
            for name, tensor in loaded.items():
                if name in tensors:
                    raise FormatError("tensor appears in more than one shard", path=shard.path, tensor=name)
                tensors[name] = tensor
    return tensors
