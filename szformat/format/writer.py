"""Streaming, atomic writer of .szt files.

Payloads are written one tensor at a time into a temporary file beside the target, each at the next aligned
offset; the header goes after the last payload and the preamble is patched last. Only a finished file is fsynced
and renamed over the target, so a failed or interrupted write leaves neither an output file nor a temporary one.
"""

from __future__ import annotations

import enum
import operator
import os
from pathlib import Path
from typing import Sequence

import torch

from ..checksum import crc32
from ..codec.gate import EncodedTensor
from ..errors import ConversionError, WriteError
from . import constants as C
from .atomic import AtomicFile
from .header import Header, TensorEntry, validate_metadata, validate_name, validate_shape


class WriterState(enum.Enum):
    """Where a :class:`SztWriter` is: each method checks it before touching the file."""

    OPEN = "open"          # temp file created, preamble placeholder written, payloads may follow
    FINISHED = "finished"  # header written, file renamed into place
    ABORTED = "aborted"    # temp file removed


class SztWriter:
    """Write tensors to a .szt file, one at a time.

    Use as a context manager: leaving the block normally finishes the file, leaving it with an exception (a
    ``KeyboardInterrupt`` too) removes the temporary file and leaves any existing target untouched. With
    ``overwrite=False`` an existing target is never replaced: :meth:`finish` raises OutputExistsError instead.

    Example:
        >>> with SztWriter("model.szt", metadata={"format": "pt"}) as w:  # doctest: +SKIP
        ...     w.add("weight", "BF16", (4, 4), encode_tensor(raw_bytes, "BF16"))
    """

    def __init__(self, path: str | os.PathLike, *, metadata: dict[str, str] | None = None,
                 alignment: int = C.DEFAULT_ALIGNMENT, overwrite: bool = True):
        if type(alignment) is not int or not C.MIN_ALIGNMENT <= alignment <= C.MAX_ALIGNMENT \
                or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two in [{C.MIN_ALIGNMENT}, {C.MAX_ALIGNMENT}], "
                             f"got {alignment!r}")
        if metadata is not None:
            try:
                validate_metadata(metadata)
            except ValueError as e:
                raise ConversionError(f"{e}, as in safetensors", path=path) from None
        self.path = Path(path)
        self.alignment = alignment
        self.metadata = None if metadata is None else dict(metadata)
        self._entries: list[TensorEntry] = []
        self._names: set[str] = set()
        self._file = AtomicFile(self.path, overwrite=overwrite)
        self._cursor = 0
        self.state = WriterState.OPEN
        self._write(bytes(C.PREAMBLE_SIZE))

    def __enter__(self) -> "SztWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.finish()
        else:
            self.abort()

    def add(self, name: str, dtype: str, shape: Sequence[int], encoded: EncodedTensor) -> TensorEntry:
        """Append one tensor's stored bytes; returns the header entry it will have.

        Raises:
            ConversionError: the name, dtype, shape or encoded bytes break a rule of the format (nothing is written;
                the writer stays open).
        """
        self._expect_open()
        payload = encoded.payload.detach().cpu().contiguous().reshape(-1).view(torch.uint8)
        shape = self._check_entry(name, dtype, shape, encoded, payload.numel())
        self._write(bytes(C.pad_to(self._cursor, self.alignment) - self._cursor))
        entry = TensorEntry(
            name=name, dtype=dtype, shape=shape, encoding=encoded.encoding,
            offset=self._cursor, length=payload.numel(), raw_length=encoded.raw_length,
            crc32=encoded.crc32, raw_crc32=encoded.raw_crc32, layout=encoded.layout, codebook=encoded.codebook,
            raw_reason=encoded.raw_reason)
        self._write(memoryview(payload.numpy()))
        self._entries.append(entry)
        self._names.add(name)
        return entry

    def _check_entry(self, name: str, dtype: str, shape: Sequence[int], encoded: EncodedTensor,
                     length: int) -> tuple[int, ...]:
        """The header rules a reader enforces, checked before a byte of this tensor is written; the shape as ints."""
        def refuse(reason: str):
            return ConversionError(reason, path=self.path, tensor=name if isinstance(name, str) else None)

        try:
            validate_name(name)
        except ValueError as e:
            raise refuse(str(e)) from None
        if name in self._names:
            raise refuse("tensor name was already written to this file")
        if len(self._entries) >= C.MAX_TENSORS:
            raise refuse(f"a file holds at most {C.MAX_TENSORS} tensors")
        if dtype not in C.DTYPES:
            raise refuse(f"unknown dtype {dtype!r}")
        try:
            shape = tuple(operator.index(d) for d in shape)
        except TypeError:
            raise refuse(f"shape {list(shape)!r} holds something other than integers") from None
        try:
            numel = validate_shape(shape)
        except ValueError as e:
            raise refuse(str(e)) from None
        if encoded.raw_length != numel * C.itemsize(dtype):
            raise refuse(f"{encoded.raw_length} raw bytes do not match shape {list(shape)} of {dtype}")
        if encoded.encoding == C.ENCODING_RAW:
            consistent = length == encoded.raw_length and encoded.crc32 == encoded.raw_crc32
        elif encoded.encoding == C.ENCODING_SPLITZIP:
            layout = encoded.layout
            consistent = (dtype == "BF16" and encoded.codebook is not None and layout is not None
                          and layout.n == numel and layout.comp_bytes == length)
        else:
            raise refuse(f"unknown encoding {encoded.encoding!r}")
        if not consistent:
            raise refuse(f"the {encoded.encoding} payload of {length} bytes does not match the tensor it claims")
        return shape

    def finish(self) -> Path:
        """Write header and preamble, fsync, and move the file into place atomically."""
        self._expect_open()
        try:
            header = Header(tensors=self._entries, metadata=self.metadata).to_bytes()
            if len(header) > C.MAX_HEADER_BYTES:
                raise WriteError(f"header of {len(header)} bytes exceeds the format's limit of {C.MAX_HEADER_BYTES}",
                                 path=self.path)
            header_offset = self._cursor
            self._write(header)
            preamble = C.PREAMBLE.pack(C.MAGIC, C.VERSION_MAJOR, C.VERSION_MINOR, 0, header_offset, len(header),
                                       crc32(header), self.alignment, self._cursor)
            self._file.write(preamble, at=0)
            self._file.commit()
        except BaseException:
            self.abort()
            raise
        self.state = WriterState.FINISHED
        return self.path

    def abort(self) -> None:
        """Drop everything written so far; the target path is left as it was."""
        if self.state is not WriterState.OPEN:
            return
        self.state = WriterState.ABORTED
        self._file.abort()

    @property
    def entries(self) -> list[TensorEntry]:
        """Header entries of the tensors added so far, in file order."""
        return list(self._entries)

    def _expect_open(self) -> None:
        if self.state is not WriterState.OPEN:
            raise RuntimeError(f"writer for {self.path} is {self.state.value}; expected it open")

    def _write(self, data) -> None:
        try:
            self._file.write(data)
        except WriteError:
            self.abort()
            raise
        self._cursor += len(data) if not isinstance(data, memoryview) else data.nbytes

