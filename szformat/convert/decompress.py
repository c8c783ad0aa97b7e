"""The inverse conversion: .szt (a file, a sharded index or a converted folder) back to .safetensors.

Every tensor comes back bit for bit (both checksums are checked on the way), with the source ``__metadata__``
unchanged; folders get ``.safetensors`` shards and ``*.safetensors.index.json`` indexes again. A file that the
``safetensors`` package wrote comes back byte for byte.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from ..format import constants as C
from ..format.reader import SztFile
from .checkpoint import open_checkpoint, output_path, write_checkpoint
from .expand import iter_raw_bytes
from .progress import progress_bar
from .report import ConversionReport, TensorRecord
from .safetensors_writer import SafetensorsWriter
from .sources import SUFFIX


def decompress(source: str | os.PathLike, target: str | os.PathLike | None = None, *, overwrite: bool = False,
               progress: bool = False) -> ConversionReport:
    """Convert a .szt checkpoint back to safetensors.

    Args:
        source (`str` or `os.PathLike`): a ``.szt`` file, a ``*.szt.index.json`` index, or a converted folder.
        target (`str` or `os.PathLike`, *optional*): for a single file, the ``.safetensors`` file or a folder to
            put it in (default: beside the source); else the output folder (required).
        overwrite (`bool`, *optional*): replace an existing output.
        progress (`bool`, *optional*): show a progress bar on stderr.

    Returns:
        `ConversionReport`: every tensor restored, with its stored and raw sizes, and the wall time.

    Raises:
        FileNotFoundError, FileExistsError, WriteError: as in `convert`.
        FormatError (or a subclass): a .szt file is malformed or corrupted (nothing is written).
        ConversionError: an index is malformed or names a missing shard or tensor.

    Example:
        >>> decompress("model.szt")  # writes model.safetensors  # doctest: +SKIP
    """
    started = time.perf_counter()
    checkpoint = open_checkpoint(source, C.FILE_SUFFIX, _raw_sizes)
    target = output_path(checkpoint.files, target, C.FILE_SUFFIX, SUFFIX)
    report = ConversionReport(output=target, files_copied=len(checkpoint.files.others))
    with progress_bar(checkpoint.raw_bytes, enabled=progress, description="decompressing") as bar:
        def write_weights(src: Path, dst: Path) -> None:
            name = src.relative_to(checkpoint.files.root).as_posix()
            with SztFile(src) as szt:
                entries = list(szt.entries.values())
                specs = [(e.name, e.dtype, e.shape) for e in entries]
                with SafetensorsWriter(dst, specs, szt.metadata, overwrite=overwrite) as writer:
                    for entry in entries:
                        for chunk in iter_raw_bytes(szt, entry):
                            writer.write(chunk)
                            bar.update(chunk.numel())
                        report.records.append(TensorRecord.from_entry(name, entry))
            report.files_written += 1

        write_checkpoint(checkpoint, target, old_suffix=C.FILE_SUFFIX, new_suffix=SUFFIX,
                         write_weights=write_weights, overwrite=overwrite)
    report.seconds = time.perf_counter() - started
    return report


def _raw_sizes(path: Path) -> dict[str, int]:
    with SztFile(path) as szt:
        return {e.name: e.raw_length for e in szt.entries.values()}
