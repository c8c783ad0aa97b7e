"""Memory-mapped, lazy reader of .szt files.

One read-only shared mapping per file (``MAP_SHARED``/``PROT_READ``: the kind a GPU driver can register for direct
DMA), one bounds-checked slice helper, and every header field validated before a byte is read through it.
Payloads are exposed as zero-copy uint8 views; decoding is the caller's choice of route.
"""

from __future__ import annotations

import mmap
import os
import warnings
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch

from ..codec.codebook import Codebook
from ..codec.layout import PayloadLayout
from ..errors import (ChecksumMismatchError, FormatError, HeaderTooLargeError, InvalidOffsetError, TruncatedFileError,
                      UnsupportedVersionError)
from . import constants as C
from .header import Header, TensorEntry, parse_header


@dataclass(frozen=True)
class PayloadDescriptor:
    """Where one tensor's stored bytes are, and how to expand them: what a GPU route needs to move and decode it."""

    path: Path
    name: str
    dtype: str
    shape: tuple[int, ...]
    encoding: str
    offset: int
    length: int
    raw_length: int
    layout: PayloadLayout | None
    codebook: Codebook | None


class SztFile:
    """An open .szt file: validated header, tensor entries in file order, zero-copy payload views.

    Args:
        path (`str` or `os.PathLike`): the file to open.

    Raises:
        FormatError (or a subclass): the file is not a valid .szt file this reader understands.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._mmap: mmap.mmap | None = None
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            preamble = f.read(C.PREAMBLE_SIZE)
            if len(preamble) < C.PREAMBLE_SIZE:
                if preamble[: len(C.MAGIC)] != C.MAGIC[: len(preamble)] or not preamble:
                    raise FormatError("not a .szt file (bad magic)", path=path)
                raise TruncatedFileError(f"file ends after {len(preamble)} bytes, inside the preamble", path=path)
            (magic, major, minor, flags, header_offset, header_length, header_crc, alignment,
             file_length) = C.PREAMBLE.unpack(preamble)
            self._check_preamble(magic, major, minor, flags, header_offset, header_length, alignment, file_length,
                                 size, preamble)
            self._mmap = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self.version = (major, minor)
        self.alignment = alignment
        raw_header = self._mmap[header_offset: header_offset + header_length]
        if zlib.crc32(raw_header) != header_crc:
            self.close()
            raise ChecksumMismatchError(
                f"header checksum mismatch (stored {header_crc:#010x}, computed {zlib.crc32(raw_header):#010x})",
                path=path)
        try:
            self.header: Header = parse_header(raw_header, path=self.path, alignment=alignment,
                                               header_offset=header_offset)
        except BaseException:
            self.close()
            raise
        self.entries: dict[str, TensorEntry] = {t.name: t for t in self.header.tensors}

    def _check_preamble(self, magic, major, minor, flags, header_offset, header_length, alignment, file_length,
                        size, preamble) -> None:
        path = self.path
        if magic != C.MAGIC:
            raise FormatError("not a .szt file (bad magic)", path=path)
        if major not in C.READER_SUPPORTED_MAJORS:
            raise UnsupportedVersionError(
                f"format version {major}.{minor} is not supported (this reader knows major "
                f"{', '.join(map(str, C.READER_SUPPORTED_MAJORS))}); upgrade szformat", path=path)
        if flags != 0:
            raise UnsupportedVersionError(f"file sets preamble flags {flags:#x} that this reader does not know",
                                          path=path)
        if preamble[C.PREAMBLE_SIZE - 16:] != bytes(16):
            raise UnsupportedVersionError("reserved preamble bytes are set; the file needs a newer reader", path=path)
        if header_length > C.MAX_HEADER_BYTES:
            raise HeaderTooLargeError(f"header length {header_length} exceeds the limit of {C.MAX_HEADER_BYTES}",
                                      path=path)
        if alignment < C.MIN_ALIGNMENT or alignment > C.MAX_ALIGNMENT or alignment & (alignment - 1):
            raise FormatError(f"alignment {alignment} is not a power of two in [{C.MIN_ALIGNMENT}, "
                              f"{C.MAX_ALIGNMENT}]", path=path)
        if header_offset < C.PREAMBLE_SIZE or header_offset + header_length != file_length:
            raise InvalidOffsetError(f"header [{header_offset}, {header_offset + header_length}) does not end the "
                                     f"file of {file_length} bytes the preamble announces", path=path)
        if size < file_length:
            raise TruncatedFileError(f"file holds {size} bytes, the preamble announces {file_length}", path=path)
        if size > file_length:
            raise InvalidOffsetError(f"{size - file_length} unexplained bytes after the end the preamble announces",
                                     path=path)

    # -- access --------------------------------------------------------------------------------------------------

    def __enter__(self) -> "SztFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release the mapping. Payload views still alive keep it mapped until they are freed."""
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # zero-copy views are alive; the mapping goes when the last of them does
            self._mmap = None

    @property
    def metadata(self) -> dict[str, str] | None:
        return self.header.metadata

    def entry(self, name: str) -> TensorEntry:
        try:
            return self.entries[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} is not in {self.path}") from None

    def descriptor(self, name: str) -> PayloadDescriptor:
        e = self.entry(name)
        return PayloadDescriptor(path=self.path, name=e.name, dtype=e.dtype, shape=e.shape, encoding=e.encoding,
                                 offset=e.offset, length=e.length, raw_length=e.raw_length, layout=e.layout,
                                 codebook=e.codebook)

    def payload(self, name: str, *, verify: bool = False) -> torch.Tensor:
        """Zero-copy uint8 view of a tensor's stored bytes; valid while the file (or the view) is alive.

        With ``verify`` the stored bytes are checked against the header's CRC-32 first.
        """
        e = self.entry(name)
        view = self._slice(e.offset, e.length)
        if verify:
            check_crc(view, e.crc32, what="stored bytes", path=self.path, tensor=name)
        return view

    @property
    def buffer(self) -> mmap.mmap:
        """The whole mapping, for routes that register it with a device driver."""
        if self._mmap is None:
            raise ValueError(f"{self.path} is closed")
        return self._mmap

    def _slice(self, offset: int, length: int) -> torch.Tensor:
        mm = self.buffer
        if offset < 0 or length < 0 or offset + length > len(mm):
            raise InvalidOffsetError(f"range [{offset}, {offset + length}) is outside the file", path=self.path)
        if length == 0:
            return torch.empty(0, dtype=torch.uint8)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only mapping: torch warns that the tensor is not writable
            return torch.frombuffer(mm, dtype=torch.uint8, count=length, offset=offset)


def check_crc(data: torch.Tensor, expected: int, *, what: str, path, tensor: str) -> None:
    """Raise ChecksumMismatchError unless the CRC-32 of a flat uint8 CPU tensor is ``expected``."""
    actual = zlib.crc32(memoryview(data.numpy())) if data.numel() else 0
    if actual != expected:
        raise ChecksumMismatchError(f"CRC-32 of the {what} is {actual:#010x}, the header records {expected:#010x}",
                                    path=path, tensor=tensor)
