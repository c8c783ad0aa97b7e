"""What a .szt checkpoint holds, file by file and tensor by tensor: the facts ``szconvert info`` prints, as text or
as JSON.

Two ratios are given. ``ratio`` is the true size ratio: the .szt file on disk (payloads, alignment padding, header)
against the .safetensors file it decompresses to (the source file, for a file the ``safetensors`` package wrote).
``payload_ratio`` counts tensor bytes alone; for a checkpoint of many small tensors the two differ widely, since
every payload starts on an aligned offset. A file in the at-rest form (format 1.1) also gets ``memory_ratio``: its
payloads once inflated (what loading moves and decodes) against the tensor bytes; ``payload_ratio`` is then the
at-rest one.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Iterable

from ..errors import ShardIndexError
from ..format import constants as C
from ..format.index import ShardIndex, check_index, read_index, shard_path
from ..format.reader import SztFile
from .checkpoint import CheckpointFiles, find_files
from .report import TensorRecord, format_bytes, format_table, size_change
from .safetensors_writer import safetensors_header
from .sources import HEADER_LENGTH

TABLE_HEADERS = ["name", "dtype", "shape", "encoding", "stored", "raw", "ratio", "coverage", "n_esc", "note"]
RIGHT_ALIGNED = {4, 5, 6, 7, 8}
METADATA_WIDTH = 116
SIZE_KEYS = ("tensor_count", "encoded_count", "raw_count", "at_rest_count", "raw_bytes", "memory_bytes",
             "stored_bytes", "file_bytes", "safetensors_bytes")


def describe(path: str | os.PathLike) -> dict[str, Any]:
    """``{"files": [...], "total": {...}}`` for a .szt file (recognised by its magic bytes, whatever its name), a
    ``*.szt.index.json`` sharded checkpoint or a converted folder.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ConversionError: ``path`` is no .szt checkpoint.
        FormatError (or a subclass): a .szt file is malformed.
        ShardIndexError: an index is malformed, names a missing shard, or maps a tensor to a shard without it.
    """
    files = find_files(path, C.FILE_SUFFIX, magic=C.MAGIC)
    indexes = {rel: read_index(files.root / rel) for rel in files.indexes}
    _refuse_missing_shards(files, indexes)
    described = [describe_file(files.root / rel, rel) for rel in files.weights]
    held = {file["file"]: {t["name"] for t in file["tensors"]} for file in described}
    for rel, index in indexes.items():
        check_index(index, files.root / rel, held, rel)
    total = {key: sum(f[key] for f in described) for key in SIZE_KEYS}
    total["dtypes"] = _by_dtype((t["dtype"], t["raw_bytes"], t["stored_bytes"])
                                for f in described for t in f["tensors"])
    return {"files": described, "total": total | _ratios(total)}


def describe_lines(description: dict[str, Any]) -> list[str]:
    """The text form of `describe`: each file's header, metadata and tensor table, then the total of several."""
    lines = []
    for file in description["files"]:
        lines += _file_lines(file) + [""]
    if len(description["files"]) > 1:
        first, *others = _summary_lines(description["total"])
        lines += [f"total: {len(description['files'])} files, {first}", *[f"  {line}" for line in others]]
    return lines


def _refuse_missing_shards(files: CheckpointFiles, indexes: dict[str, ShardIndex]) -> None:
    """A checkpoint whose index names absent shards is incomplete: showing the shards present would pass a part
    for the whole. Naming one .szt file still shows that file alone.

    Raises:
        ShardIndexError: naming the index and every shard of it that is missing.
    """
    present = set(files.weights)
    for rel, index in indexes.items():
        missing = [shard for shard in index.shard_names() if shard_path(rel, shard) not in present]
        if missing:
            raise ShardIndexError(f"the index names {len(missing)} missing shard(s): "
                                  f"{', '.join(map(repr, missing))}; name a {C.FILE_SUFFIX} file to see it alone",
                                  path=files.root / rel)


def describe_file(path: Path, name: str) -> dict[str, Any]:
    """The facts ``info`` shows about one .szt file, as a JSON-ready dict."""
    with SztFile(path) as szt:
        entries = list(szt.entries.values())
        records = [TensorRecord.from_entry(name, entry) for entry in entries]
        header, data_size = safetensors_header([(e.name, e.dtype, e.shape) for e in entries], szt.metadata)
        file = {"file": name, "version": "{}.{}".format(*szt.version), "alignment": szt.alignment,
                "file_bytes": path.stat().st_size, "safetensors_bytes": HEADER_LENGTH.size + len(header) + data_size,
                "metadata": szt.metadata}
    file.update(_counts(records))
    file.update(_ratios(file))
    file["tensors"] = [{k: v for k, v in dataclasses.asdict(r).items() if k != "file"} | {"ratio": r.ratio}
                       for r in records]
    return file


def _counts(records: list[TensorRecord]) -> dict[str, Any]:
    return {"tensor_count": len(records),
            "encoded_count": sum(r.encoding == C.ENCODING_SPLITZIP for r in records),
            "raw_count": sum(r.encoding == C.ENCODING_RAW for r in records),
            "at_rest_count": sum(r.memory_bytes is not None for r in records),
            "raw_bytes": sum(r.raw_bytes for r in records),
            "memory_bytes": sum(r.stored_bytes if r.memory_bytes is None else r.memory_bytes for r in records),
            "stored_bytes": sum(r.stored_bytes for r in records),
            "dtypes": _by_dtype((r.dtype, r.raw_bytes, r.stored_bytes) for r in records)}


def _by_dtype(tensors: Iterable[tuple[str, int, int]]) -> dict[str, dict[str, Any]]:
    """Raw and stored bytes of each dtype's tensors (``(dtype, raw, stored)`` each), and their ratio: what each
    dtype gained (at rest, every dtype may shrink; in memory, BF16 alone)."""
    dtypes: dict[str, dict[str, Any]] = {}
    for dtype, raw, stored in tensors:
        sizes = dtypes.setdefault(dtype, {"tensors": 0, "raw_bytes": 0, "stored_bytes": 0})
        sizes["tensors"] += 1
        sizes["raw_bytes"] += raw
        sizes["stored_bytes"] += stored
    for sizes in dtypes.values():
        sizes["ratio"] = sizes["stored_bytes"] / sizes["raw_bytes"] if sizes["raw_bytes"] else 1.0
    return dict(sorted(dtypes.items(), key=lambda item: -item[1]["raw_bytes"]))


def _ratios(sizes: dict[str, Any]) -> dict[str, float]:
    def of_raw(nbytes: int) -> float:
        return nbytes / sizes["raw_bytes"] if sizes["raw_bytes"] else 1.0

    return {"ratio": sizes["file_bytes"] / sizes["safetensors_bytes"], "payload_ratio": of_raw(sizes["stored_bytes"]),
            "memory_ratio": of_raw(sizes["memory_bytes"])}


def _summary_lines(counts: dict[str, Any]) -> list[str]:
    """Sizes and ratios; a file with tensors at rest shows its payloads in memory (what loading moves and decodes)
    and at rest (what is stored) apart."""
    payloads = f"payloads {format_bytes(counts['raw_bytes'])} raw -> "
    if counts["at_rest_count"]:
        payloads += (f"{format_bytes(counts['memory_bytes'])} in memory (ratio {counts['memory_ratio']:.4f}) -> "
                     f"{format_bytes(counts['stored_bytes'])} at rest (ratio {counts['payload_ratio']:.4f}, "
                     f"{counts['at_rest_count']} tensors through zstd)")
    else:
        payloads += (f"{format_bytes(counts['stored_bytes'])} stored, ratio {counts['payload_ratio']:.4f} (tensor "
                     "bytes alone)")
    dtypes = ", ".join(f"{dtype} {sizes['ratio']:.4f} of {format_bytes(sizes['raw_bytes'])}"
                       for dtype, sizes in counts["dtypes"].items())
    return [f"{counts['tensor_count']} tensors ({counts['encoded_count']} encoded, {counts['raw_count']} raw), ratio "
            f"{counts['ratio']:.4f} on disk ({size_change(counts['ratio'])}): {format_bytes(counts['file_bytes'])} "
            f"against {format_bytes(counts['safetensors_bytes'])} as .safetensors", payloads,
            f"by dtype (stored / raw): {dtypes or 'none'}"]


def _shorten(text: str) -> str:
    """Long metadata values (some checkpoints carry whole configs) are cut; ``--json`` shows them whole."""
    return text if len(text) <= METADATA_WIDTH else text[: METADATA_WIDTH - 3] + "..."


def _file_lines(file: dict[str, Any]) -> list[str]:
    metadata = file["metadata"]
    lines = [f"{file['file']}: szt {file['version']}, alignment {file['alignment']}, "
             f"{format_bytes(file['file_bytes'])} on disk",
             *[f"  {line}" for line in _summary_lines(file)],
             "  metadata:" + ("" if metadata else " none")]
    lines += [f"    {_shorten(f'{key} = {json.dumps(value, ensure_ascii=False)}')}" for key, value in
              (metadata or {}).items()]
    rows = [[t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar", t["encoding"],
             format_bytes(t["stored_bytes"]), format_bytes(t["raw_bytes"]), f"{t['ratio']:.3f}",
             "-" if t["coverage"] is None else f"{t['coverage']:.4f}", "-" if t["n_esc"] is None else str(t["n_esc"]),
             t["reason"] or ""] for t in file["tensors"]]
    return lines + ["  " + line for line in format_table(TABLE_HEADERS, rows, right=RIGHT_ALIGNED)]
