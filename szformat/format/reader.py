"""Memory-mapped, lazy reader of .szt files.

The preamble and the header are read with ordinary reads and validated in full (sizes against the file, the header
checksum, every tensor entry, the placement rule) before the file is mapped. Then one read-only shared mapping
(``MAP_SHARED``/``PROT_READ``: the kind a GPU driver can register for direct DMA) of exactly the validated length
serves every payload through one bounds-checked slice helper. Payloads are exposed as zero-copy uint8 views;
decoding is the caller's choice of route.

A mapped file that another process truncates while it is open makes the next access to a lost page raise SIGBUS,
which no Python code can catch. So ``safe_open`` and ``load_file`` on the CPU either copy the bytes out with
``pread`` (:meth:`SztFile.read`: a file that shrank gives a short read, reported as :class:`TruncatedFileError`) or
hand views of the mapping (:meth:`SztFile.mapped`) to C calls that catch the fault themselves and say so
(:meth:`SztFile.mapped_read_error` names the error): the copy costs a large load 15-25 % of its time
(``bench/RESULTS.md``). Zero-copy views of the
mapping (:meth:`SztFile.payload`, :attr:`SztFile.buffer`) remain for the routes that stream or hand bytes to a
device: the file size is re-checked before each view is handed out, but a view kept while the file is truncated
stays exposed. Replacing a
file (write elsewhere, then rename, as :class:`SztWriter` does) never affects an open reader.
"""

from __future__ import annotations

import mmap
import os
import stat
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


from .._lazy import at_rest, cpu_codec, torch
from ..checksum import crc32, tensor_crc32
from ..codec.codebook import Codebook
from ..codec.layout import PayloadLayout
from ..errors import (CheckpointNotFoundError, ChecksumMismatchError, ClosedFileError, DecodeRouteError, FormatError,
                      HeaderError, HeaderTooLargeError, InvalidOffsetError, PayloadError, TensorNotFoundError,
                      ReadError, TruncatedFileError, UnsupportedVersionError)
from . import constants as C
from .header import Header, TensorEntry, parse_header
from .payloads import inflate_entry


@dataclass(frozen=True)
class PayloadDescriptor:
    """Where one tensor's stored bytes are, and how to expand them: what a GPU route needs to move and decode it.

    ``crc32`` is the CRC-32 of the ``length`` stored bytes, ``raw_crc32`` that of the ``raw_length`` decoded bytes.
    """

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
    crc32: int | None = None
    raw_crc32: int | None = None


class SztFile:
    """An open .szt file: validated header, tensor entries in file order, zero-copy payload views.

    Args:
        path (`str` or `os.PathLike`): the file to open.

    Raises:
        FormatError (or a subclass): the file is not a valid .szt file this reader understands.
        OSError: the file cannot be opened.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._mmap: mmap.mmap | None = None
        # O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below as not a regular file.
        try:
            fd = os.open(self.path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
        except FileNotFoundError:
            raise CheckpointNotFoundError("no such file", path=path) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise FormatError("not a regular file", path=path)
            file = os.fdopen(fd, "rb")
        except BaseException:
            os.close(fd)
            raise
        with file as f:
            header_offset, header_length, header_crc = self._read_preamble(f, st.st_size)
            f.seek(header_offset)
            raw_header = f.read(header_length)
            if len(raw_header) != header_length:
                raise TruncatedFileError("file shrank while its header was read", path=path)
            crc = crc32(raw_header)
            if crc != header_crc:
                raise ChecksumMismatchError(
                    f"header checksum mismatch (stored {header_crc:#010x}, computed {crc:#010x})", path=path)
            if self.flags & C.FLAG_HEADER_ZSTD:
                raw_header = self._inflate_header(raw_header)
            self.header: Header = parse_header(raw_header, path=self.path, alignment=self.alignment,
                                               header_offset=header_offset)
            try:
                self._mmap = mmap.mmap(f.fileno(), self.file_length, access=mmap.ACCESS_READ)
            except ValueError:  # the file is now shorter than the mapping would be
                raise TruncatedFileError("file shrank while it was opened", path=path) from None
            self._reads = open(os.dup(f.fileno()), "rb", buffering=0)  # for read(): closes itself when collected
        self.entries: dict[str, TensorEntry] = {t.name: t for t in self.header.tensors}

    def _read_preamble(self, f, size: int) -> tuple[int, int, int]:
        """Read and check the 64-byte preamble in the order the spec gives; sets version, alignment, file_length."""
        path = self.path
        preamble = f.read(C.PREAMBLE_SIZE)
        if not preamble:
            raise TruncatedFileError("file is empty; a .szt file starts with a 64-byte preamble", path=path)
        if len(preamble) < C.PREAMBLE_SIZE:
            if preamble[: len(C.MAGIC)] != C.MAGIC[: len(preamble)]:
                raise FormatError("not a .szt file (bad magic)", path=path)
            raise TruncatedFileError(f"file ends after {len(preamble)} bytes, inside the preamble", path=path)
        (magic, major, minor, flags, header_offset, header_length, header_crc, alignment,
         file_length) = C.PREAMBLE.unpack(preamble)
        if magic != C.MAGIC:
            raise FormatError("not a .szt file (bad magic)", path=path)
        if major not in C.READER_SUPPORTED_MAJORS:
            known = ', '.join(map(str, C.READER_SUPPORTED_MAJORS))
            advice = ("no version of the format has that major: the file is damaged or not a .szt file"
                      if major < min(C.READER_SUPPORTED_MAJORS) else "upgrade szformat")
            raise UnsupportedVersionError(
                f"format version {major}.{minor} is not supported (this reader knows major {known}); {advice}",
                path=path)
        if flags & ~C.KNOWN_FLAGS:
            raise UnsupportedVersionError(f"file sets preamble flags {flags & ~C.KNOWN_FLAGS:#x} that this reader "
                                          "does not know; upgrade szformat", path=path)
        if preamble[C.RESERVED_OFFSET:] != bytes(C.PREAMBLE_SIZE - C.RESERVED_OFFSET):
            raise UnsupportedVersionError("reserved preamble bytes are set; the file needs a newer reader", path=path)
        if header_length > C.MAX_HEADER_BYTES:
            raise HeaderTooLargeError(f"header length {header_length} exceeds the limit of {C.MAX_HEADER_BYTES}",
                                      path=path)
        if header_length == 0:
            raise HeaderError("header length is 0; a header holds at least an empty tensor list", path=path)
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
        self.version = (major, minor)
        self.flags = flags
        self.alignment = alignment
        self.file_length = file_length
        return header_offset, header_length, header_crc

    def _inflate_header(self, stored: bytes) -> bytes:
        """The msgpack header held in a zstd-stored header (1.1), with its size bounded before it is allocated."""
        try:
            return bytes(at_rest.inflate_bounded(stored, C.header_inflate_limit(len(stored))))
        except at_rest.AtRestError as e:
            raise HeaderError(f"zstd-stored header: {e}", path=self.path) from None

    # -- access --------------------------------------------------------------------------------------------------

    def __enter__(self) -> "SztFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Release the mapping. Payload views still alive keep it mapped until the last of them is freed."""
        if self._mmap is not None:
            self._reads.close()
            try:
                self._mmap.close()
            except BufferError:
                pass  # zero-copy views are alive; the mapping goes when the last of them does
            self._mmap = None

    @property
    def metadata(self) -> dict[str, str] | None:
        """The source's ``__metadata__`` (``None`` when it had none)."""
        return self.header.metadata

    def entry(self, name: str) -> TensorEntry:
        """The header entry of tensor ``name``; KeyError naming the file if there is none."""
        try:
            return self.entries[name]
        except KeyError:
            raise TensorNotFoundError("no such tensor in this file", path=self.path, tensor=name) from None

    def descriptor(self, name: str) -> PayloadDescriptor:
        """Where the stored bytes of tensor ``name`` are and how to expand them.

        Raises:
            DecodeRouteError: the tensor is stored through the at-rest stage, so its stored bytes are not what a
                device expands (load it with ``load_file``/``safe_open``, or repack the file to its in-memory form).
        """
        e = self.entry(name)
        if e.at_rest is not None:
            raise DecodeRouteError("stored through the at-rest stage (zstd): its stored bytes are not the payload a "
                                   "device expands; load it with load_file or safe_open, or write the in-memory form "
                                   "with 'szconvert repack FILE OUT --at-rest none'", path=self.path, tensor=name)
        return PayloadDescriptor(path=self.path, name=e.name, dtype=e.dtype, shape=e.shape, encoding=e.encoding,
                                 offset=e.offset, length=e.length, raw_length=e.raw_length, layout=e.layout,
                                 codebook=e.codebook, crc32=e.crc32, raw_crc32=e.raw_crc32)

    def payload(self, name: str, *, verify: bool = False) -> torch.Tensor:
        """Zero-copy uint8 view of a tensor's stored bytes; valid while the file (or the view) is alive.

        With ``verify`` the stored bytes are checked against the header's CRC-32 first. Touching the view after
        another process truncated the file kills this one with SIGBUS; :meth:`read` copies the bytes safely.
        """
        e = self.entry(name)
        view = self._slice(e.offset, e.length, tensor=name)
        if verify:
            check_crc(view, e.crc32, what="stored bytes", path=self.path, tensor=name)
        return view

    def read(self, name: str, start: int = 0, stop: int | None = None, *,
             out: torch.Tensor | None = None) -> torch.Tensor:
        """Stored bytes ``[start, stop)`` of tensor ``name`` (all of them by default), copied out of the file.

        Read with ``pread`` into ``out`` (a flat contiguous uint8 CPU tensor of ``stop - start`` bytes) or a new
        tensor, so a file truncated by another process meanwhile gives TruncatedFileError where reading its mapping
        would kill the process with SIGBUS.

        Raises:
            TruncatedFileError: the file ends before those bytes.
        """
        e = self.entry(name)
        stop = e.length if stop is None else stop
        if not 0 <= start <= stop <= e.length:
            raise ValueError(f"byte range [{start}, {stop}) is outside the {e.length} stored bytes of {name!r}")
        if out is None:
            out = torch.empty(stop - start, dtype=torch.uint8)
        elif out.dtype != torch.uint8 or out.dim() != 1 or not out.is_contiguous() or out.numel() != stop - start:
            raise ValueError(f"out must be a flat contiguous uint8 tensor of {stop - start} bytes")
        self._read_into(e.offset + start, memoryview(out.numpy()), tensor=name)
        return out

    def readinto(self, name: str, start: int, out: memoryview) -> None:
        """Stored bytes ``[start, start + len(out))`` of tensor ``name`` into ``out`` (a writable byte memoryview),
        read as :meth:`read` reads them, but with no tensor made: a reader thread holds the GIL for each torch call,
        tens of microseconds right after a large read has left its caches cold.

        Raises:
            TruncatedFileError: the file ends before those bytes.
        """
        e = self.entry(name)
        if not 0 <= start <= start + len(out) <= e.length:
            raise ValueError(f"byte range [{start}, {start + len(out)}) is outside the {e.length} stored bytes of "
                             f"{name!r}")
        self._read_into(e.offset + start, out, tensor=name)

    def _read_into(self, offset: int, out: memoryview, *, tensor: str) -> None:
        if self._mmap is None:
            raise ClosedFileError("the file is closed", path=self.path)
        if not hasattr(os, "preadv"):  # Windows, where a file cannot be truncated while it is mapped
            if len(out):
                torch.frombuffer(out, dtype=torch.uint8).copy_(self._slice(offset, len(out), tensor=tensor))
            return
        pread_exactly(self._reads.fileno(), out, offset, path=self.path, tensor=tensor)

    def mapped(self, name: str, start: int, stop: int) -> memoryview:
        """Stored bytes ``[start, stop)`` of tensor ``name`` as a view of the file's mapping: no copy, for the C
        kernels' guarded calls only (``codec.cpu.PayloadDecoder.decode_range``), which turn the fault of a page the
        file no longer holds into EOFError; read anywhere else, such a page ends the process with SIGBUS.

        Raises:
            TruncatedFileError: the file is already shorter than when it was opened.
        """
        e = self.entry(name)
        if not 0 <= start <= stop <= e.length:
            raise ValueError(f"byte range [{start}, {stop}) is outside the {e.length} stored bytes of {name!r}")
        return self._mapping([e])[e.offset + start: e.offset + stop]

    def mapped_payloads(self, entries: Sequence[TensorEntry]) -> list[memoryview]:
        """The whole stored bytes of each of ``entries`` (of this file) as :meth:`mapped` gives them."""
        mapping = self._mapping(entries)
        return [mapping[e.offset: e.offset + e.length] for e in entries]

    def _mapping(self, entries: Sequence[TensorEntry]) -> memoryview:
        """The whole mapping, for :meth:`mapped` reads of ``entries``, once it is checked the file has not shrunk
        already; where it has, the error names the first of them whose stored bytes it lost (else the first)."""
        mm = self.buffer
        size = mm.size()
        if size < self.file_length:
            lost = next((e for e in entries if e.offset + e.length > size), entries[0] if entries else None)
            raise self.mapped_read_error(None if lost is None else lost.name)
        return memoryview(mm)

    def mapped_read_error(self, name: str | None = None) -> TruncatedFileError | ReadError:
        """The error for bytes that could not be read through the mapping (a guarded call's EOFError): the file
        shrank after it was opened, or, where it did not, its disk failed to deliver them."""
        size = os.fstat(self._reads.fileno()).st_size
        if size < self.file_length:
            return TruncatedFileError(f"file shrank to {size} bytes after it was opened ({self.file_length})",
                                      path=self.path, tensor=name)
        return ReadError("a page of the file could not be read (an I/O error)", path=self.path, tensor=name)

    def memory_payload(self, name: str, *, verify: bool = False, ranges: Sequence[tuple[int, int]] | None = None,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """The in-memory payload of a tensor: the stored bytes themselves (a zero-copy view) unless they went through
        the at-rest stage, which is then undone (into ``out``, flat uint8 of the in-memory size, when given), for
        ``ranges`` of the payload only when given (the rest of the buffer is left unwritten).

        With ``verify`` the stored bytes are checked against the header's CRC-32 first.

        Raises:
            PayloadError: a zstd frame is corrupt or does not inflate to its size (naming file and tensor).
        """
        e = self.entry(name)
        stored = self.payload(name, verify=verify)
        if e.at_rest is None:
            return stored
        return inflate_entry(self.path, e, stored, out, ranges=ranges)

    def check_escapes(self, name: str) -> None:
        """Raise PayloadError unless the escape stream of SplitZip tensor ``name`` is in range and strictly ascending
        (see :func:`check_escapes`); of a payload stored at rest, only the escape streams are inflated for it."""
        e = self.entry(name)
        ranges = [(e.layout.off_cid, e.layout.comp_bytes)] if e.at_rest is not None else None
        check_escapes(self.memory_payload(name, ranges=ranges), e.layout, path=self.path, tensor=name)

    @property
    def at_rest(self) -> bool:
        """Whether any tensor of this file is stored through an at-rest stage."""
        return any(e.at_rest is not None for e in self.header.tensors)

    @property
    def byte_planes(self) -> bool:
        """Whether any raw tensor of this file is stored as byte planes (1.2), inflated and then joined into its
        elements."""
        return any(e.byte_planes for e in self.header.tensors)

    @property
    def buffer(self) -> mmap.mmap:
        """The whole mapping, for routes that register it with a device driver.

        Take tensors or arrays of it through ``memoryview(buffer)``, as :meth:`payload` does: a memoryview holds a
        buffer export that keeps :meth:`close` from unmapping the pages while it lives; ``torch.frombuffer(buffer)``
        alone does not, and reading such a tensor after ``close()`` would crash the process.
        """
        if self._mmap is None:
            raise ClosedFileError("the file is closed", path=self.path)
        return self._mmap

    def _slice(self, offset: int, length: int, *, tensor: str | None = None) -> torch.Tensor:
        mm = self.buffer
        if offset < 0 or length < 0 or offset + length > len(mm):
            raise InvalidOffsetError(f"range [{offset}, {offset + length}) is outside the file", path=self.path,
                                     tensor=tensor)
        if length == 0:
            return torch.empty(0, dtype=torch.uint8)
        if mm.size() < self.file_length:  # reading a page past the new end would raise SIGBUS
            raise TruncatedFileError(f"file shrank to {mm.size()} bytes after it was opened ({self.file_length})",
                                     path=self.path, tensor=tensor)
        # Through a memoryview: the view holds a buffer export on the mapping, so close() cannot unmap the pages
        # under a live tensor (torch.frombuffer keeps its source object alive, but not an export of it).
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only mapping: torch warns that the tensor is not writable
            return torch.frombuffer(memoryview(mm)[offset: offset + length], dtype=torch.uint8)


def pread_exactly(fd: int, out: torch.Tensor | memoryview, offset: int, *, path: str | os.PathLike,
                  tensor: str | None = None) -> None:
    """Fill ``out`` (a flat contiguous uint8 CPU tensor, or a writable byte memoryview) with the bytes of file ``fd``
    from ``offset``, by ``preadv`` (the GIL is released while the kernel copies; one call may return fewer bytes
    than asked, so it loops).

    Raises:
        TruncatedFileError: the file ends first: it shrank after it was opened.
    """
    view = memoryview(out.numpy()) if isinstance(out, torch.Tensor) else out
    done = 0
    while done < len(view):
        count = os.preadv(fd, [view[done:]], offset + done)
        if count <= 0:
            raise TruncatedFileError(f"file shrank to {os.fstat(fd).st_size} bytes after it was opened; bytes "
                                     f"[{offset + done}, {offset + len(view)}) were to be read", path=path,
                                     tensor=tensor)
        done += count


def check_crc(data: torch.Tensor, expected: int, *, what: str, path: str | os.PathLike, tensor: str) -> None:
    """Raise ChecksumMismatchError unless the CRC-32 of a flat uint8 CPU tensor is ``expected``."""
    compare_crc(tensor_crc32(data), expected, what=what, path=path, tensor=tensor)


def compare_crc(actual: int, expected: int, *, what: str, path: str | os.PathLike, tensor: str) -> None:
    """Raise ChecksumMismatchError unless a CRC-32 taken (or joined from parts) is the one the header records."""
    if actual != expected:
        raise ChecksumMismatchError(f"CRC-32 of the {what} is {actual:#010x}, the header records {expected:#010x}",
                                    path=path, tensor=tensor)


def check_decoded_payload(entry: TensorEntry, stored_crc: int, decoded_crc: int, error: str | None, *,
                          path: str | os.PathLike, check_stored: bool, check_decoded: bool) -> None:
    """Raise for a SplitZip payload the C kernels decoded whole (``decode_payloads``: its stored bytes' CRC-32, its
    decoded bytes' CRC-32, and the message refusing its escape streams or None), in the order every reader
    reports: corrupt stored bytes as such whatever they broke, then the escape streams, then the decoded bytes.

    Raises:
        ChecksumMismatchError, PayloadError: naming ``path`` and the tensor.
    """
    if check_stored:
        compare_crc(stored_crc, entry.crc32, what="stored bytes", path=path, tensor=entry.name)
    if error is not None:
        raise PayloadError(error, path=path, tensor=entry.name)
    if check_decoded:
        compare_crc(decoded_crc, entry.raw_crc32, what="decoded bytes", path=path, tensor=entry.name)


def check_escapes(payload: torch.Tensor, layout: PayloadLayout, *, path: str | os.PathLike, tensor: str) -> None:
    """Raise PayloadError unless the escape stream of a SplitZip payload (flat uint8 CPU tensor) is in range and
    strictly ascending: the checks the spec asks of every reader before it decodes, checksums on or off."""
    try:
        cpu_codec.escape_positions(payload, layout)
    except ValueError as e:
        raise PayloadError(str(e), path=path, tensor=tensor) from None
