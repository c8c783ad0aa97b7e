"""Reading one open .szt file on the CPU, tensor by tensor or rows at a time: what ``safe_open`` runs.

Whole tensors go through :func:`.host_decode.decode_entries` (several threads, checksums in cache). A slice
(:class:`TensorSlice`) decodes only the rows it covers: for the in-memory form only the bytes of those rows are kept,
for the at-rest form (SplitZip streams or byte planes) only the frames holding them are read and inflated. Stored
bytes are copied out of the file (``pread``) or, for SplitZip streams of the in-memory form where the C kernels
guard it (``host_decode.mapped_reads``), read through the mapping by calls that catch the fault of a lost page: a
file truncated meanwhile is an error, never SIGBUS. Each stored payload's CRC-32 is checked once per open file. A
slice checks what it reads: where the entry has block checksums (format 1.3), the blocks holding the bytes it reads;
else the whole payload's CRC-32 on its first read (the rest of the payload read through a small buffer only to be
checksummed, or checksummed through the mapping). Its bytes are checksummed as they land, in the cache.
"""

from __future__ import annotations

import math
import operator
import threading
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .._lazy import at_rest
from ..checksum import crc32
from ..codec.cpu import PayloadDecoder, guarded_crc32
from ..format import constants as C
from ..format.header import TensorEntry
from ..format.payloads import (allocation_errors, decode_entry, decode_entry_columns, decode_entry_with_crc,
                               inflate_entry, payload_errors)
from ..format.reader import SztFile, check_crc, compare_crc
from . import host_decode, host_pages

__all__ = ["HostReader", "TensorSlice", "SCRATCH_BYTES", "rows_per_block"]

SCRATCH_BYTES = 256 << 20
"""Stored bytes up to this size are read into a buffer each reading thread keeps while the file is open."""

COLUMN_BLOCK_BYTES = 4 << 20
"""Raw bytes of whole rows read at a time when only some of a matrix's columns are kept and its rows go through a
buffer (:func:`rows_per_block`): read whole, a 70B model's 470 MB ``down_proj`` would pass the 256 MiB a
tensor-parallel load may add to vLLM's peak."""

CHECK_PIECE = 1 << 20
"""Bytes read at a time when a part of a tensor is read and checked: the bytes of the blocks checked (or of the whole
payload) that the part does not need go through a buffer of this size that stays in the cache, only to be
checksummed."""


class HostReader:
    """The CPU reads of one open file: whole tensors, or rows of one; the stored bytes of each tensor CRC-checked
    the first time they are read when ``verify`` is on.

    Args:
        file (`SztFile`): the open file (the caller closes it).
        verify (`bool`): check CRC-32s (stored bytes once per tensor; decoded bytes of every whole tensor).
    """

    def __init__(self, file: SztFile, *, verify: bool):
        self.file = file
        self.verify = verify
        self.verified: set[str] = set()
        self._tables_joined: set[str] = set()
        self._scratch = threading.local()

    def release(self) -> None:
        """Drop the read buffers this reader's threads keep."""
        self._scratch = threading.local()

    def tensors(self, names: Sequence[str], outs: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
        """Tensors ``names``, decoded on the CPU (several threads; see :mod:`.host_decode`), into ``outs`` (per
        name a contiguous tensor of its raw size, or ``None``) where given."""
        entries = [self.file.entry(name) for name in names]
        check_stored = [self.verify and name not in self.verified for name in names]
        tensors = host_decode.decode_entries(self.file, entries, check_stored=check_stored,
                                             check_decoded=self.verify, outs=outs)
        if self.verify:
            self.verified.update(names)
        return tensors

    def _unchecked(self, entry: TensorEntry) -> bool:
        return self.verify and entry.name not in self.verified

    def _read_spans(self, entry: TensorEntry, spans: Sequence[tuple[int, int]], out: torch.Tensor,
                    base: int = 0) -> None:
        """Read the stored bytes ``spans`` (apart, in any order) of a tensor into ``out`` (byte ``b`` at
        ``out[b - base]``), checked on the way when ``verify`` is on (:meth:`_checks`): each piece checksummed as it
        lands in the cache, the bytes of a checked range outside the spans read through a small buffer only for
        that. A rank of a tensor-parallel load so writes only its part of a tensor to memory, not the whole payload.

        Read (:meth:`SztFile.read`), not touched through the mapping: a file truncated meanwhile is a
        TruncatedFileError rather than SIGBUS.
        """
        name = entry.name
        if not self._unchecked(entry):
            for begin, end in spans:
                self.file.read(name, begin, end, out=out[begin - base: end - base])
            return
        spans = sorted(spans)
        checks = self._checks(entry, spans)
        for check in checks:
            self._compare(entry, self._read_range(name, check[0], check[1], spans, out, base), check)
        self._checked(entry, checks)

    def _read_range(self, name: str, lo: int, hi: int, spans: list[tuple[int, int]], out: torch.Tensor,
                    base: int) -> int:
        """Read stored bytes ``[lo, hi)`` of tensor ``name`` piece by piece, those inside ``spans`` (sorted) into
        ``out`` and the others through a small buffer; the CRC-32 of them all."""
        passing = self._buffer(CHECK_PIECE, "passing")
        crc, cursor = 0, lo
        for begin, end in [(max(b, lo), min(e, hi)) for b, e in spans if b < hi and e > lo] + [(hi, hi)]:
            while cursor < end:
                inside = cursor >= begin
                stop = min(end if inside else begin, cursor + CHECK_PIECE)
                piece = out[cursor - base: stop - base] if inside else passing[: stop - cursor]
                crc = crc32(memoryview(self.file.read(name, cursor, stop, out=piece).numpy()), crc)
                cursor = stop
        return crc

    def _checks(self, entry: TensorEntry, spans: Sequence[tuple[int, int]]) -> list[tuple[int, int, int]]:
        """What a read of the stored bytes ``spans`` of a tensor checks, as ``(start, stop, crc)``: where its entry
        has block checksums (1.3) the runs of blocks holding them, once the table is seen to join to the entry's
        ``crc32``; else the whole payload."""
        blocks = entry.blocks
        if blocks is None:
            return [(0, entry.length, entry.crc32)]
        if entry.name not in self._tables_joined:
            compare_crc(blocks.joined(entry.length), entry.crc32, what="block checksums, joined,",
                        path=self.file.path, tensor=entry.name)
            self._tables_joined.add(entry.name)
        return blocks.covering(entry.length, spans)

    def _compare(self, entry: TensorEntry, actual: int, check: tuple[int, int, int]) -> None:
        lo, hi, expected = check
        what = "stored bytes" if (lo, hi) == (0, entry.length) else f"stored bytes [{lo}, {hi})"
        compare_crc(actual, expected, what=what, path=self.file.path, tensor=entry.name)

    def _checked(self, entry: TensorEntry, checks: list[tuple[int, int, int]]) -> None:
        """Remember a tensor whose every stored byte is now checked: its later reads check nothing."""
        if len(checks) == 1 and checks[0][:2] == (0, entry.length):
            self.verified.add(entry.name)

    def _buffer(self, nbytes: int, role: str = "stored") -> torch.Tensor:
        """A uint8 buffer to read stored bytes into (``role`` ``"stored"``) or inflate a payload stored at rest into
        (``"memory"``) and decode them from: up to :data:`SCRATCH_BYTES`, one per role this thread keeps while the
        file is open (a fresh one costs a page fault and a zeroed page per 4 KiB, about as much again as reading
        into it); larger, zeroed memory whose pages cost only when written."""
        if nbytes > SCRATCH_BYTES:
            return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))
        buffers = self._scratch.__dict__.setdefault("buffers", {})
        buffer = buffers.get(role)
        if buffer is None or buffer.numel() < nbytes:
            buffer = buffers[role] = torch.empty(nbytes, dtype=torch.uint8)
        return buffer[:nbytes]

    def _payload(self, entry: TensorEntry, ranges: list[tuple[int, int]], whole: bool) -> torch.Tensor:
        """The in-memory payload of a tensor (a SplitZip payload, or the bytes of a raw tensor stored as byte
        planes), with at least its bytes ``ranges`` in place: read whole or only those bytes, the whole payload's
        CRC-32 checked the first time when ``verify`` is on (:meth:`_read_spans`); for a payload stored at rest,
        the stored bytes of the frames holding them, inflated."""
        stored = self._buffer(entry.length)
        if whole:
            spans = [(0, entry.length)]
        else:  # only the bytes these rows need (at rest: the frames and verbatim pieces holding them)
            spans = ranges if entry.at_rest is None else at_rest.stored_ranges(entry.segments(), ranges)
        self._read_spans(entry, spans, stored)
        if entry.at_rest is None:
            return stored
        payload = self._buffer(entry.memory_length, "memory")
        return inflate_entry(self.file.path, entry, stored, payload, ranges=None if whole else ranges)

    def rows(self, entry: TensorEntry, row_start: int, row_stop: int, out: torch.Tensor | None = None
             ) -> torch.Tensor:
        """Rows ``[row_start, row_stop)`` of a tensor (the whole tensor for scalars), decoded on the CPU, into
        ``out`` (a contiguous tensor of their dtype and shape) when given."""
        with allocation_errors(self.file.path, entry.name):
            return self._rows(entry, row_start, row_stop, out)

    def _rows(self, entry: TensorEntry, row_start: int, row_stop: int, out: torch.Tensor | None) -> torch.Tensor:
        dtype = entry.torch_dtype(self.file.path)
        row_shape = entry.shape[1:]
        row_numel = math.prod(row_shape)
        start, stop = row_start * row_numel, row_stop * row_numel
        shape = (row_stop - row_start, *row_shape) if entry.shape else ()
        target = None if out is None else out.reshape(-1).view(torch.uint8)  # the raw bytes land there
        if target is not None:
            host_pages.advise_huge_pages(target)
        if entry.encoding == C.ENCODING_RAW and entry.at_rest is None:  # the stored bytes are the tensor's bytes
            itemsize = C.itemsize(entry.dtype)
            begin, end = start * itemsize, stop * itemsize
            raw = target if target is not None else host_pages.empty(end - begin, torch.uint8)
            host_pages.populate(raw)
            self._read_spans(entry, [(begin, end)], raw, base=begin)
            return raw.view(dtype).reshape(shape)
        whole = (start, stop) == (0, entry.numel)
        if entry.byte_planes:  # the frames holding these rows, inflated
            itemsize = C.itemsize(entry.dtype)
            begin, end = start * itemsize, stop * itemsize
            raw = _copied(self._payload(entry, [(begin, end)], whole)[begin:end], target)
            if self.verify and whole:
                check_crc(raw, entry.raw_crc32, what="decoded bytes", path=self.file.path, tensor=entry.name)
            return raw.view(dtype).reshape(shape)
        out = host_pages.empty(stop - start, torch.bfloat16) if out is None else out.reshape(-1)
        host_pages.populate(out)
        mapped = host_decode.mapped_reads(self._unchecked(entry))
        if mapped and not whole and entry.at_rest is None and start % 2 == 0:
            self._mapped_decode(entry, start, stop, lambda decoder, streams: decoder.decode(start, stop, out,
                                                                                           streams=streams))
            return out.reshape(shape)
        payload = self._payload(entry, entry.layout.byte_ranges(start, stop), whole)
        if self.verify and whole:
            compare_crc(decode_entry_with_crc(self.file.path, entry, payload, out), entry.raw_crc32,
                        what="decoded bytes", path=self.file.path, tensor=entry.name)
        else:
            decode_entry(self.file.path, entry, payload, out, start=start, stop=stop)
        return out.reshape(shape)

    def _mapped_decode(self, entry: TensorEntry, start: int, stop: int,
                       decode: Callable[[PayloadDecoder, tuple[memoryview, memoryview]], None]) -> None:
        """Decode from elements ``[start, stop)`` (``start`` even) of a SplitZip tensor in the in-memory form straight
        from the file's mapping by the C kernels' guarded calls (``host_decode.mapped_reads``): only the bytes around
        the streams are read, with ``verify`` what these elements read is checked through the mapping (the blocks
        holding it, or the whole payload the first time: :meth:`_checks`), then ``decode(decoder, streams)`` is
        handed the payload's decoder and these elements' ``pk`` and ``sm`` bytes as views of the mapping. A rank of a
        tensor-parallel load so copies nothing it does not keep."""
        file, name = self.file, entry.name
        around = host_decode.read_around_streams(file, entry, self._buffer(host_decode.around_streams_length(entry)))
        try:
            if self._unchecked(entry):
                checks = self._checks(entry, host_decode.spans_read(entry, start, stop))
                for check in checks:
                    self._compare(entry, guarded_crc32(file.mapped(name, check[0], check[1])), check)
                self._checked(entry, checks)
            with payload_errors(file.path, name):
                decoder = PayloadDecoder.around_streams(around, entry.layout, entry.codebook)
            decode(decoder, host_decode.mapped_streams(file, entry, start, stop))
        except EOFError:  # a guarded call could not read a page of the mapping
            raise file.mapped_read_error(name) from None

    def columns(self, entry: TensorEntry, rows: tuple[int, int], cols: tuple[int, int], out: torch.Tensor
                ) -> torch.Tensor:
        """Columns ``cols`` of rows ``rows`` of a SplitZip matrix, decoded on the CPU into ``out`` (contiguous, of
        their dtype and shape); only those columns are decoded (see :meth:`columns_decodable`): straight from the
        file's mapping where the C kernels guard it, else through a buffer :data:`COLUMN_BLOCK_BYTES` of rows at a
        time."""
        width = entry.shape[1]
        flat = out.reshape(-1)
        with allocation_errors(self.file.path, entry.name):
            host_pages.advise_huge_pages(flat)  # written whole
            host_pages.populate(flat)
            if host_decode.mapped_reads(self._unchecked(entry)) and entry.at_rest is None:
                self._mapped_decode(entry, rows[0] * width, rows[1] * width, lambda decoder, streams:
                                    decoder.decode_columns(rows, width, cols, flat, streams=streams))
                return out
            step = rows_per_block(entry)
            kept = cols[1] - cols[0]
            for row in range(rows[0], rows[1], step):
                block = (row, min(row + step, rows[1]))
                payload = self._payload(entry, entry.layout.byte_ranges(block[0] * width, block[1] * width), False)
                part = flat[(block[0] - rows[0]) * kept: (block[1] - rows[0]) * kept]
                decode_entry_columns(self.file.path, entry, payload, part, rows=block, cols=cols)
            return out

    @staticmethod
    def columns_decodable(entry: TensorEntry, cols: tuple[int, int]) -> bool:
        """Whether :meth:`columns` takes these columns of ``entry``: a SplitZip matrix whose width and column
        bounds are even (each row's piece whole pairs of elements)."""
        return (entry.encoding == C.ENCODING_SPLITZIP and len(entry.shape) == 2
                and entry.shape[1] % 2 == 0 and cols[0] % 2 == 0 and cols[1] % 2 == 0)


def rows_per_block(entry: TensorEntry) -> int:
    """Rows of a matrix read at a time when some of its columns are kept through a buffer: those of
    :data:`COLUMN_BLOCK_BYTES` of raw bytes, at least one."""
    return max(1, COLUMN_BLOCK_BYTES // max(1, entry.shape[1] * C.itemsize(entry.dtype)))


def _copied(source: torch.Tensor, target: torch.Tensor | None) -> torch.Tensor:
    """``source`` (bytes in a read buffer) copied into ``target``, or into a tensor of its own."""
    out = target if target is not None else host_pages.empty(source.numel(), source.dtype)
    host_pages.populate(out)
    return out.copy_(source)


class TensorSlice:
    """Lazy handle on one tensor; indexing the first dimension decodes only the rows it covers.

    Indexing follows ``torch.Tensor`` exactly: ``f.get_slice(name)[index]`` equals ``f.get_tensor(name)[index]``.
    """

    def __init__(self, reader: HostReader, entry: TensorEntry, device: torch.device):
        self._reader = reader
        self._entry = entry
        self._device = device

    def get_shape(self) -> list[int]:
        """The tensor's shape, read from the header (nothing is decoded)."""
        return list(self._entry.shape)

    def get_dtype(self) -> str:
        """The tensor's safetensors dtype name (``"BF16"``, ``"F32"``...)."""
        return self._entry.dtype

    def __getitem__(self, index: Any) -> torch.Tensor:
        entry = self._entry
        first, rest = (index[0], index[1:]) if isinstance(index, tuple) and index else (index, ())
        if not entry.shape:
            picked = self._reader.rows(entry, 0, 1)[index]
        elif isinstance(first, slice) and (first.step is None or (_as_int(first.step) or 0) > 0):
            row_start, row_stop, step = first.indices(entry.shape[0])
            rows = self._reader.rows(entry, row_start, max(row_start, row_stop))
            picked = rows[(slice(None, None, step), *rest)]
        elif _as_int(first) is not None:
            row = _as_int(first)
            row = row + entry.shape[0] if row < 0 else row
            if not 0 <= row < entry.shape[0]:
                raise IndexError(f"index {first} is out of bounds for dimension 0 with size {entry.shape[0]}")
            picked = self._reader.rows(entry, row, row + 1)[(0, *rest)]
        else:  # Ellipsis, None, lists, tensors, negative steps: let torch interpret the whole tensor
            picked = self._reader.rows(entry, 0, entry.shape[0])[index]
        return picked.to(self._device)


def _as_int(index: Any) -> int | None:
    """``index`` as a Python int when it is an integer index (not a bool: torch reads those as masks)."""
    if isinstance(index, (bool, torch.Tensor)) or index is None:
        return None
    try:
        return operator.index(index)
    except TypeError:
        return None
