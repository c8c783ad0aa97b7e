"""The inverse conversion: .szt (a file, a sharded index or a converted folder) back to .safetensors.

Every tensor comes back bit for bit (both checksums are checked on the way), with the source ``__metadata__``
unchanged; folders get ``.safetensors`` shards and ``*.safetensors.index.json`` indexes again. A file that the
``safetensors`` package wrote comes back byte for byte.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..format import constants as C
from ..format.reader import SztFile
from .driver import TensorDone, run_pass
from .expand import decode_group, decoded_together, group_buffer, iter_raw_bytes, tensor_groups
from .report import ConversionReport
from .safetensors_writer import SafetensorsWriter
from .sources import SUFFIX


def decompress(source: str | os.PathLike, target: str | os.PathLike | None = None, *, overwrite: bool = False,
               progress: bool = False) -> ConversionReport:
    """Convert a .szt checkpoint back to safetensors.

    Args:
        source (`str` or `os.PathLike`): a .szt file (recognised by its magic bytes, whatever its name), a
            ``*.szt.index.json`` index, or a converted folder.
        target (`str` or `os.PathLike`, *optional*): for a single file, the ``.safetensors`` file or a folder to
            put it in (default: beside the source); else the output folder (required).
        overwrite (`bool`, *optional*): replace an existing output.
        progress (`bool`, *optional*): show a progress bar on stderr.

    Returns:
        `ConversionReport`: every tensor restored, with its stored and raw sizes, and the wall time.

    Raises:
        FileNotFoundError, OutputExistsError, WriteError: as in `convert`.
        FormatError (or a subclass): a .szt file is malformed or corrupted (nothing is written).
        ShardIndexError: an index is malformed or names a missing shard or tensor.

    Example:
        >>> decompress("model.szt")  # writes model.safetensors  # doctest: +SKIP
    """
    buffer = group_buffer()  # one for every shard: its pages are taken once

    def write_file(src: Path, dst: Path, tensor_done: TensorDone) -> None:
        with SztFile(src) as szt:
            entries = list(szt.entries.values())
            specs = [(e.name, e.dtype, e.shape) for e in entries]
            with SafetensorsWriter(dst, specs, szt.metadata, overwrite=overwrite) as writer:
                for group in tensor_groups(entries):  # decoded together on the loader's threads, or alone
                    if decoded_together(group):
                        for entry, raw in zip(group, decode_group(szt, group, buffer)):
                            writer.write(raw)
                            tensor_done(entry)
                        continue
                    (entry,) = group  # slice by slice: writing bounds it, not the decode (see raw_windows)
                    for chunk in iter_raw_bytes(szt, entry):
                        writer.write(chunk)
                    tensor_done(entry)

    return run_pass(source, target, old_suffix=C.FILE_SUFFIX, old_magic=C.MAGIC, new_suffix=SUFFIX,
                    read_sizes=_raw_sizes, write_file=write_file, overwrite=overwrite, progress=progress,
                    description="decompressing")


def _raw_sizes(path: Path) -> dict[str, int]:
    with SztFile(path) as szt:
        return {e.name: e.raw_length for e in szt.entries.values()}
