"""Rewrite one open .szt file in its in-memory form (1.0) or its at-rest form (1.1), payloads kept as they are.

A payload stored at rest is inflated, one that is not is compressed; codebooks, escapes and decoded tensors never
change. Each payload's stored bytes are checked against their CRC-32 before they are written again. Used by
``szconvert repack`` and by offloading, which keeps an at-rest checkpoint's in-memory form in host memory.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

from ..checksum import tensor_crc32
from ..codec.gate import EncodedTensor
from .at_rest import DEFAULT_FRAME_SIZE
from .header import TensorEntry
from .reader import SztFile
from .writer import SztWriter, writer_form

__all__ = ["rewrite_form"]


def rewrite_form(source: SztFile, target: str | os.PathLike, *, at_rest: int | None, overwrite: bool = True,
                 on_tensor: Callable[[TensorEntry], None] | None = None,
                 frame_size: int = DEFAULT_FRAME_SIZE) -> Path:
    """Write ``source`` to ``target`` (atomically; an existing target is replaced only with ``overwrite``) in the
    at-rest form at zstd level ``at_rest`` in frames of ``frame_size`` in-memory bytes, or in the in-memory form
    when it is ``None``; ``on_tensor(entry)`` follows each tensor written.

    Raises:
        ChecksumMismatchError, PayloadError: a stored payload is corrupt (nothing is written).
        WriteError: ``target`` cannot be written.
    """
    with SztWriter(target, metadata=source.metadata, alignment=source.alignment, overwrite=overwrite,
                   frame_size=frame_size, raw_bytes=sum(e.raw_length for e in source.header.tensors),
                   **writer_form(at_rest)) as writer:
        for entry in source.header.tensors:
            payload = source.memory_payload(entry.name, verify=True)
            crc = entry.crc32 if entry.at_rest is None else tensor_crc32(payload)
            encoded = EncodedTensor(entry.encoding, payload, entry.raw_length, entry.raw_crc32, crc,
                                    layout=entry.layout, codebook=entry.codebook, raw_reason=entry.raw_reason)
            written = writer.add(entry.name, entry.dtype, entry.shape, encoded)
            if on_tensor is not None:
                on_tensor(written)
    return Path(target)
