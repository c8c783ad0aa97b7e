"""Move a .szt checkpoint between its in-memory form (1.0) and its at-rest form (1.1) without re-encoding.

The SplitZip payloads are kept as they are (:func:`..format.forms.rewrite_form`), so codebooks, escapes and the
decoded tensors stay identical; every stored payload is checked against its CRC-32 on the way; the output appears
whole or not at all. (Converting with ``--at-rest`` may encode a few more tensors than repacking keeps: the
at-rest form's coverage gate is lower.)
"""

from __future__ import annotations

import os
from pathlib import Path

from ..format import constants as C
from ..format.at_rest import DEFAULT_FRAME_SIZE
from ..format.forms import rewrite_form
from ..format.reader import SztFile
from .decompress import _raw_sizes
from .driver import TensorDone, run_pass
from .report import ConversionReport


def repack(source: str | os.PathLike, target: str | os.PathLike, *, at_rest: int | None, overwrite: bool = False,
           progress: bool = False, frame_size: int = DEFAULT_FRAME_SIZE) -> ConversionReport:
    """Write ``source`` (a .szt file, index or converted folder) to ``target`` in the at-rest form at zstd level
    ``at_rest`` in frames of ``frame_size`` in-memory bytes, or in the in-memory form when ``at_rest`` is ``None``.

    Raises:
        FormatError (or a subclass): a .szt file is malformed or its stored bytes are corrupt (nothing is written).
        FileNotFoundError, FileExistsError, WriteError, ShardIndexError: as in `convert`.

    Example:
        >>> repack("model-szt/", "model-szt-at-rest/", at_rest=1)  # doctest: +SKIP
    """
    def write_file(src: Path, dst: Path, tensor_done: TensorDone) -> None:
        with SztFile(src) as szt:
            rewrite_form(szt, dst, at_rest=at_rest, overwrite=overwrite, on_tensor=tensor_done, frame_size=frame_size)

    return run_pass(source, target, old_suffix=C.FILE_SUFFIX, old_magic=C.MAGIC, new_suffix=C.FILE_SUFFIX,
                    read_sizes=_raw_sizes, write_file=write_file, overwrite=overwrite, progress=progress,
                    description="repacking")
