"""Which shard files a sharded index (``model.szt.index.json``) names.

The index has the shape of ``model.safetensors.index.json``: ``{"metadata": {...}, "weight_map": {tensor: shard}}``,
shard names relative to the index's folder. Both the push side (refuse to publish an index whose shards are absent)
and the pull side (download exactly the shards the index names) need this list, validated, since a downloaded index
is untrusted input.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..errors import FormatError, HubReferenceError
from ..format.constants import FILE_SUFFIX, INDEX_SUFFIX
from .refs import check_repo_path

DEFAULT_FILE = "model" + FILE_SUFFIX
DEFAULT_INDEX = "model" + INDEX_SUFFIX
"""What a reference to a whole repo loads: the sharded index if the repo has one, else the single file."""


def read_shard_names(index_path: str | os.PathLike) -> list[str]:
    """Shard file names an index maps tensors to, sorted and without repeats.

    Raises:
        FormatError: the file is not JSON, has no ``weight_map`` object of string values, or names a shard path that
            is absolute or climbs out of the index's folder.
    """
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FormatError(f"sharded index is not valid JSON ({e})", path=index_path) from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise FormatError("sharded index has no 'weight_map' object naming the shards", path=index_path)
    shards = set()
    for tensor, shard in weight_map.items():
        if not isinstance(shard, str):
            raise FormatError(f"weight_map maps to {shard!r}, not a file name", path=index_path, tensor=tensor)
        try:
            name = check_repo_path(shard, what="weight_map entry")
        except HubReferenceError as e:
            raise FormatError(e.reason, path=index_path, tensor=tensor) from None
        if not name or shard.endswith("/"):
            raise FormatError(f"weight_map entry {shard!r} is not a file name", path=index_path, tensor=tensor)
        shards.add(name)
    return sorted(shards)


def is_index_name(filename: str | os.PathLike) -> bool:
    """Whether a file name is a sharded index (``*.szt.index.json``)."""
    return Path(filename).name.endswith(INDEX_SUFFIX)
