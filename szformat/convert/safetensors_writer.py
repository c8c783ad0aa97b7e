"""Streaming, atomic writer of .safetensors files, for decompression.

The safetensors layout: an 8-byte little-endian header length, a compact JSON header (``__metadata__`` first, then
each tensor's ``dtype``, ``shape`` and ``data_offsets`` relative to the data region) padded with spaces to a
multiple of 8, then the tensors' bytes back to back. Since every size is known from the .szt header, the header
goes first and the bytes stream after it. Serialized as the ``safetensors`` package does (tensors in data order,
no spaces, UTF-8 unescaped), a file it wrote comes back byte for byte.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Sequence


from .._lazy import torch
from ..errors import ConversionError
from ..format import constants as C
from .outputs import OutputFile
from .sources import HEADER_LENGTH, METADATA_KEY

TensorSpec = tuple[str, str, Sequence[int]]
"""``(name, dtype, shape)`` of one tensor, in the order its bytes will be written."""


def safetensors_header(tensors: Sequence[TensorSpec], metadata: dict[str, str] | None) -> tuple[bytes, int]:
    """The padded JSON header for ``tensors`` laid out back to back, and the size of their data region."""
    obj: dict[str, object] = {}
    if metadata is not None:
        obj[METADATA_KEY] = metadata
    offset = 0
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * C.itemsize(dtype)
        obj[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    header = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    return header + b" " * (-len(header) % 8), offset


class SafetensorsWriter:
    """Write a .safetensors file whose tensors are declared up front and whose bytes arrive in slices.

    Example:
        >>> with SafetensorsWriter("out.safetensors", [("w", "BF16", (2, 2))], {"format": "pt"}) as w:  # doctest: +SKIP
        ...     w.write(raw_bytes)
    """

    def __init__(self, path: str | os.PathLike, tensors: Sequence[TensorSpec], metadata: dict[str, str] | None, *,
                 overwrite: bool = False):
        self.path = Path(path)
        names = [name for name, _, _ in tensors]
        if len(set(names)) != len(names) or METADATA_KEY in names:
            raise ConversionError(f"tensor names must be unique and not {METADATA_KEY!r}", path=path)
        header, self._data_size = safetensors_header(tensors, metadata)
        self._written = 0
        self._file = OutputFile(self.path, overwrite=overwrite)
        self._file.write(HEADER_LENGTH.pack(len(header)) + header)

    def __enter__(self) -> "SafetensorsWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self._file.abort()

    def write(self, data: torch.Tensor) -> None:
        """Append raw tensor bytes (a flat uint8 CPU tensor), continuing where the last call stopped."""
        if self._written + data.numel() > self._data_size:
            self._file.abort()
            raise ConversionError(f"more tensor bytes than the {self._data_size} the header declares",
                                  path=self.path)
        self._file.write(memoryview(data.numpy()))
        self._written += data.numel()

    def finish(self) -> Path:
        """Check that every declared byte was written, then move the file into place; returns its path."""
        if self._written != self._data_size:
            self._file.abort()
            raise ConversionError(f"{self._written} tensor bytes written, the header declares {self._data_size}",
                                  path=self.path)
        return self._file.commit()
