"""``szconvert info``: what a .szt file (or a converted folder or index) holds, file by file and tensor by tensor."""

from __future__ import annotations

import argparse
import dataclasses
import json
from pathlib import Path
from typing import Any

from ..errors import ShardIndexError
from ..format import constants as C
from ..format.index import ShardIndex, check_index, read_index, shard_path
from ..format.reader import SztFile
from ..convert.checkpoint import CheckpointFiles, find_files
from ..convert.report import TensorRecord, format_bytes, format_table
from ._common import add_command, print_lines

NAME = "info"

EXAMPLES = """\
examples:
  szconvert info model.szt
  szconvert info ./model-szt                        every .szt file of a converted folder, and the total
  szconvert info model.szt --json                   the same as JSON, for scripts

Exit status: 1 when an index names a shard that is missing, or a tensor its shard does not hold.
"""

TABLE_HEADERS = ["name", "dtype", "shape", "encoding", "stored", "raw", "ratio", "coverage", "n_esc", "note"]
RIGHT_ALIGNED = {4, 5, 6, 7, 8}
METADATA_WIDTH = 116


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = add_command(
        subparsers, NAME, run, help="show the header, sizes and tensors of .szt files", examples=EXAMPLES,
        description="Show the format version, alignment, metadata, sizes and compression ratio of a .szt file, "
                    "a *.szt.index.json sharded checkpoint or a converted folder, and a table of its tensors.")
    parser.add_argument("path", help="a .szt file, a *.szt.index.json or a converted folder")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")


def run(args: argparse.Namespace) -> int:
    files = find_files(args.path, C.FILE_SUFFIX)
    indexes = {rel: read_index(files.root / rel) for rel in files.indexes}
    _refuse_missing_shards(files, indexes)
    described = [describe_file(files.root / rel, rel) for rel in files.weights]
    held = {file["file"]: {t["name"] for t in file["tensors"]} for file in described}
    for rel, index in indexes.items():
        check_index(index, files.root / rel, held, rel)
    total = _totals(described)
    if args.json:
        print(json.dumps({"files": described, "total": total}, indent=2, ensure_ascii=False))
        return 0
    for file in described:
        print_lines(_file_lines(file) + [""])
    if len(described) > 1:
        print_lines([f"total: {len(described)} files, " + _summary_text(total)])
    return 0


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
        records = [TensorRecord.from_entry(name, entry) for entry in szt.entries.values()]
        file = {"file": name, "version": "{}.{}".format(*szt.version), "alignment": szt.alignment,
                "file_bytes": path.stat().st_size, "metadata": szt.metadata}
    file.update(_counts(records))
    file["tensors"] = [{k: v for k, v in dataclasses.asdict(r).items() if k != "file"} | {"ratio": r.ratio}
                       for r in records]
    return file


def _counts(records: list[TensorRecord]) -> dict[str, Any]:
    raw_bytes = sum(r.raw_bytes for r in records)
    stored_bytes = sum(r.stored_bytes for r in records)
    return {"tensor_count": len(records),
            "encoded_count": sum(r.encoding == C.ENCODING_SPLITZIP for r in records),
            "raw_count": sum(r.encoding == C.ENCODING_RAW for r in records),
            "raw_bytes": raw_bytes, "stored_bytes": stored_bytes,
            "ratio": stored_bytes / raw_bytes if raw_bytes else 1.0}


def _totals(files: list[dict[str, Any]]) -> dict[str, Any]:
    keys = ("tensor_count", "encoded_count", "raw_count", "raw_bytes", "stored_bytes", "file_bytes")
    total = {key: sum(f[key] for f in files) for key in keys}
    total["ratio"] = total["stored_bytes"] / total["raw_bytes"] if total["raw_bytes"] else 1.0
    return total


def _summary_text(counts: dict[str, Any]) -> str:
    return (f"{counts['tensor_count']} tensors ({counts['encoded_count']} encoded, {counts['raw_count']} raw), "
            f"{format_bytes(counts['raw_bytes'])} raw -> {format_bytes(counts['stored_bytes'])} stored, "
            f"ratio {counts['ratio']:.4f}")


def _shorten(text: str) -> str:
    """Long metadata values (some checkpoints carry whole configs) are cut; ``--json`` shows them whole."""
    return text if len(text) <= METADATA_WIDTH else text[: METADATA_WIDTH - 3] + "..."


def _file_lines(file: dict[str, Any]) -> list[str]:
    metadata = file["metadata"]
    lines = [f"{file['file']}: szt {file['version']}, alignment {file['alignment']}, "
             f"{format_bytes(file['file_bytes'])} on disk",
             f"  {_summary_text(file)}",
             "  metadata:" + ("" if metadata else " none")]
    lines += [f"    {_shorten(f'{key} = {json.dumps(value, ensure_ascii=False)}')}" for key, value in
              (metadata or {}).items()]
    rows = [[t["name"], t["dtype"], "x".join(map(str, t["shape"])) or "scalar", t["encoding"],
             format_bytes(t["stored_bytes"]), format_bytes(t["raw_bytes"]), f"{t['ratio']:.3f}",
             "-" if t["coverage"] is None else f"{t['coverage']:.4f}", "-" if t["n_esc"] is None else str(t["n_esc"]),
             t["reason"] or ""] for t in file["tensors"]]
    return lines + ["  " + line for line in format_table(TABLE_HEADERS, rows, right=RIGHT_ALIGNED)]
