"""Sharded-checkpoint indexes (``model.safetensors.index.json`` and ``model.szt.index.json``): read, check, write.

Both have the shape transformers and diffusers write: ``{"metadata": {..., "total_size": N}, "weight_map":
{tensor: shard file}}``, shard names relative to the index's folder, ``total_size`` the raw bytes of all tensors.
"""

from __future__ import annotations

import json
import os
import posixpath
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Mapping

from ..errors import ConversionError

INDEX_TAIL = ".index.json"


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
        ConversionError: not JSON, no ``weight_map`` object of strings, or a shard path that is absolute or leaves
            the index's folder.
    """
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConversionError(f"sharded index is not valid JSON ({e})", path=path) from None
    if not isinstance(obj, dict) or not isinstance(obj.get("weight_map"), dict):
        raise ConversionError("sharded index has no 'weight_map' object", path=path)
    metadata = obj.get("metadata", {})
    if not isinstance(metadata, dict):
        raise ConversionError("sharded index 'metadata' must be an object", path=path)
    for tensor, shard in obj["weight_map"].items():
        if not isinstance(shard, str) or not _is_relative_file(shard):
            raise ConversionError(f"weight_map names {shard!r}, not a file inside the index's folder", path=path,
                                  tensor=tensor)
    return ShardIndex(metadata, obj["weight_map"])


def _is_relative_file(name: str) -> bool:
    parts = name.split("/")
    return bool(name) and "\\" not in name and not name.startswith("/") and all(p not in ("", ".", "..")
                                                                                for p in parts)


def shard_path(index_name: str, shard: str) -> str:
    """The relative path of ``shard`` named by the index at relative path ``index_name``."""
    return posixpath.join(posixpath.dirname(index_name), shard)


def index_problems(index: ShardIndex, shards: Mapping[str, Collection[str] | None],
                   index_name: str) -> Iterator[tuple[str, str]]:
    """``(tensor, problem)`` for each tensor of the weight map that is not in the shard it names.

    ``shards`` maps the relative path of each shard present to the names of its tensors, or to ``None`` for a shard
    that could not be read (a problem reported on its own, so its tensors are not reported again).
    """
    for tensor, shard in index.weight_map.items():
        path = shard_path(index_name, shard)
        if path not in shards:
            yield tensor, f"the index names shard {shard!r}, which is missing"
        elif shards[path] is not None and tensor not in shards[path]:
            yield tensor, f"the index maps this tensor to shard {shard!r}, which does not hold it"


def check_index(index: ShardIndex, index_path: str | os.PathLike, shards: Mapping[str, Collection[str]],
                index_name: str) -> None:
    """Raise ConversionError for the first tensor of the weight map that is not in the shard it names."""
    for tensor, problem in index_problems(index, shards, index_name):
        raise ConversionError(problem, path=index_path, tensor=tensor)


def write_index(path: str | os.PathLike, index: ShardIndex) -> None:
    """Write an index as transformers does (two-space indent, trailing newline)."""
    text = json.dumps({"metadata": index.metadata, "weight_map": index.weight_map}, indent=2, ensure_ascii=False)
    Path(path).write_text(text + "\n", encoding="utf-8")
