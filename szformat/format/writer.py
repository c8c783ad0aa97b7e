"""Streaming, atomic writer of .szt files.

Payloads are written one tensor at a time into a temporary file beside the target, each at the next aligned
offset (with ``small_alignment``, a 1.1 feature, payloads under 1 MiB at the next multiple of that);
with ``at_rest`` (a zstd level, 1.1) SplitZip payloads are stored through the at-rest stage where it makes them
smaller; the header goes after the last payload and the preamble is patched last. Only a finished file is fsynced
and renamed over the target, so a failed or interrupted write leaves neither an output file nor a temporary one.
"""

from __future__ import annotations

import enum
import operator
import os
from pathlib import Path
from typing import Any, Iterable, Sequence

from .._lazy import torch
from ..checksum import crc32
from ..codec.codebook import COVERAGE_GATE
from ..codec.gate import EncodedTensor, encode_tensor
from ..errors import ConversionError, RoundTripError, RoundTripMismatch, WriteError
from . import at_rest as at_rest_stage
from . import constants as C
from .atomic import AtomicFile
from .header import (BlockChecksums, Header, TensorEntry, payload_alignment, validate_metadata, validate_name,
                     validate_shape, validate_small_alignment)


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

    Args:
        path (`str` or `os.PathLike`): the file to write.
        metadata (`dict[str, str]`, *optional*): the source's ``__metadata__``, carried unchanged.
        alignment (`int`, *optional*): where payloads start (4096 by default).
        at_rest (`int`, *optional*): a zstd level: SplitZip payloads go through the at-rest stage (format 1.1) where
            it makes them smaller. :func:`writer_form` gives the options of each form.
        frame_size (`int`, *optional*): in-memory bytes per zstd frame of the at-rest stage (1 MiB by default).
        raw_bytes (`int`, *optional*): the raw bytes of all the tensors the file will hold, when known: the tensors
            in the last ``at_rest.TAIL_BYTES`` of a file larger than them get frames of ``at_rest.TAIL_FRAME_SIZE``
            (a GPU load's last inflation is then short), when that is smaller than ``frame_size``.
        small_alignment (`int`, *optional*): 1.1: where payloads under 1 MiB start (16 in the at-rest form).
        compress_header (`bool`, *optional*): 1.1: store the header through zstd when that makes it smaller.
        block_size (`int`, *optional*): 1.3: a tensor whose stored bytes are longer than this gets the CRC-32 of
            each block of them (:func:`block_size_for`), blocks of at most this many bytes (``C.BLOCK_CRC_SIZE``,
            1 MiB, by default; a power of two of at least 4096).

    Example:
        >>> with SztWriter("model.szt", metadata={"format": "pt"}) as w:  # doctest: +SKIP
        ...     w.add("weight", "BF16", (4, 4), encode_tensor(raw_bytes, "BF16"))
    """

    def __init__(self, path: str | os.PathLike, *, metadata: dict[str, str] | None = None,
                 alignment: int = C.DEFAULT_ALIGNMENT, overwrite: bool = True, at_rest: int | None = None,
                 frame_size: int = at_rest_stage.DEFAULT_FRAME_SIZE, raw_bytes: int | None = None,
                 small_alignment: int | None = None, compress_header: bool = False,
                 block_size: int = C.BLOCK_CRC_SIZE):
        if type(alignment) is not int or not C.MIN_ALIGNMENT <= alignment <= C.MAX_ALIGNMENT \
                or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two in [{C.MIN_ALIGNMENT}, {C.MAX_ALIGNMENT}], "
                             f"got {alignment!r}")
        if small_alignment is not None:
            validate_small_alignment(small_alignment, alignment)
        at_rest_stage.check_frame_size(frame_size)
        if type(block_size) is not int or not C.MIN_BLOCK_CRC_SIZE <= block_size <= C.MAX_BLOCK_CRC_SIZE \
                or block_size & (block_size - 1):
            raise ValueError(f"block_size must be a power of two in [{C.MIN_BLOCK_CRC_SIZE}, "
                             f"{C.MAX_BLOCK_CRC_SIZE}], got {block_size!r}")
        if metadata is not None:
            try:
                validate_metadata(metadata)
            except ValueError as e:
                raise ConversionError(f"{e}, as in safetensors", path=path) from None
        self.path = Path(path)
        self.alignment = alignment
        self.at_rest = at_rest
        self.frame_size = frame_size
        self.raw_bytes = raw_bytes
        self._raw_written = 0
        self.small_alignment = small_alignment
        self.compress_header = compress_header
        self.block_size = block_size
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
        parts, length, crc, stage = self._stored(encoded, payload, dtype)
        blocks = None
        if length > self.block_size:
            blocks = BlockChecksums.of(parts, block_size_for(length, self.block_size))
            if blocks.joined(length) != crc:
                raise ConversionError(f"the block checksums of the {length} stored bytes do not join to their "
                                      f"CRC-32 {crc:#010x}", path=self.path, tensor=name)
        start = C.pad_to(self._cursor, payload_alignment(length, self.alignment, self.small_alignment))
        self._write(bytes(start - self._cursor))
        entry = TensorEntry(
            name=name, dtype=dtype, shape=shape, encoding=encoded.encoding,
            offset=self._cursor, length=length, raw_length=encoded.raw_length,
            crc32=crc, raw_crc32=encoded.raw_crc32, layout=encoded.layout, codebook=encoded.codebook,
            raw_reason=encoded.raw_reason, at_rest=stage, blocks=blocks)
        for part in parts:
            self._write(part)
        self._raw_written += encoded.raw_length
        self._entries.append(entry)
        self._names.add(name)
        return entry

    @property
    def coverage_gate(self) -> float:
        """The coverage under which a BF16 tensor is stored raw in this file's form (see ``at_rest.py``)."""
        return COVERAGE_GATE if self.at_rest is None else at_rest_stage.AT_REST_COVERAGE_GATE

    def _stored(self, encoded: EncodedTensor, payload: torch.Tensor, dtype: str
                ) -> tuple[list, int, int, at_rest_stage.ZstdStage | at_rest_stage.PlanesStage | None]:
        """The bytes to store (as pieces, in order), their length, their CRC-32 and their at-rest stage: when this
        writer has one, a SplitZip payload through the zstd stage or a raw tensor (of ``dtype``) as byte planes,
        where that makes it smaller; the payload as it is otherwise."""
        whole = [memoryview(payload.numpy())]
        if self.at_rest is None or not payload.numel():
            return whole, payload.numel(), encoded.crc32, None
        frame_size = self._frame_size(encoded.raw_length)
        if encoded.encoding == C.ENCODING_RAW:
            itemsize = C.itemsize(dtype)  # frames of whole elements (4096, a multiple of every size, bounds it below)
            staged = at_rest_stage.compress_planes(payload, dtype, itemsize, level=self.at_rest,
                                                   frame_size=frame_size - frame_size % itemsize)
            if staged is None:
                return whole, payload.numel(), encoded.crc32, None
            parts, stage = staged
        else:
            parts, stage = at_rest_stage.compress(payload, encoded.layout, level=self.at_rest, frame_size=frame_size)
        length = sum(len(part) for part in parts)
        if length >= payload.numel():
            return whole, payload.numel(), encoded.crc32, None
        crc = 0
        for part in parts:
            crc = crc32(part, crc)
        return parts, length, crc, stage

    def _frame_size(self, raw_length: int) -> int:
        """The frame size of the next tensor, of ``raw_length`` raw bytes: :data:`at_rest.TAIL_FRAME_SIZE` where
        it reaches into the last :data:`at_rest.TAIL_BYTES` of a file larger than them, is no larger than them and
        larger than one such frame (a tensor of one frame keeps its header as it was), else ``frame_size``."""
        tail = at_rest_stage.TAIL_BYTES
        if self.raw_bytes is None or self.raw_bytes <= tail or not at_rest_stage.TAIL_FRAME_SIZE < raw_length <= tail:
            return self.frame_size
        if self._raw_written + raw_length <= self.raw_bytes - tail:
            return self.frame_size
        return min(self.frame_size, at_rest_stage.TAIL_FRAME_SIZE)

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
        if dtype not in C.ITEMSIZE:
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
            features = self._features()
            header = Header(tensors=self._entries, metadata=self.metadata, required_features=features,
                            small_alignment=self.small_alignment).to_bytes()
            if len(header) > C.MAX_HEADER_BYTES:
                raise WriteError(f"header of {len(header)} bytes exceeds the format's limit of {C.MAX_HEADER_BYTES}",
                                 path=self.path)
            flags = 0
            if self.compress_header:
                stored = at_rest_stage.compress_frame(header)
                if len(stored) < len(header) <= C.header_inflate_limit(len(stored)):
                    header, flags = stored, C.FLAG_HEADER_ZSTD
            header_offset = self._cursor
            self._write(header)
            blocks = any(entry.blocks is not None for entry in self._entries)
            minor = max([C.FEATURE_MINOR[f] for f in features]
                        + [1 if flags else 0, C.BLOCK_CRC_MINOR if blocks else 0])
            preamble = C.PREAMBLE.pack(C.MAGIC, C.VERSION_MAJOR, minor, flags, header_offset, len(header),
                                       crc32(header), self.alignment, self._cursor)
            self._file.write(preamble, at=0)
            self._file.commit()
        except BaseException:
            self.abort()
            raise
        self.state = WriterState.FINISHED
        return self.path

    def _features(self) -> list[str]:
        """The 1.1 and 1.2 features this file uses (none: it is a 1.0 file, which every 1.x reader reads)."""
        features = []
        staged = {entry.encoding for entry in self._entries if entry.at_rest is not None}
        if C.ENCODING_SPLITZIP in staged:
            features.append(C.FEATURE_AT_REST_ZSTD)
        if C.ENCODING_RAW in staged:
            features.append(C.FEATURE_AT_REST_PLANES)
        if self.small_alignment is not None:
            features.append(C.FEATURE_SMALL_ALIGNMENT)
        return features

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


def writer_form(at_rest: int | None) -> dict[str, Any]:
    """The :class:`SztWriter` options of a form: the in-memory form (``None``: a 1.0 file) or the at-rest form at
    zstd level ``at_rest``, whose small payloads are also packed at ``DEFAULT_SMALL_ALIGNMENT`` and whose header is
    stored through zstd (the file is 1.1 anyway, and on a checkpoint of many small tensors page padding and the
    header would otherwise cost a few percent of the file)."""
    if at_rest is None:
        return {"at_rest": None, "small_alignment": None, "compress_header": False}
    return {"at_rest": at_rest, "small_alignment": C.DEFAULT_SMALL_ALIGNMENT, "compress_header": True}


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The raw bytes of a tensor as a flat uint8 CPU tensor (a view where possible)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def block_size_for(length: int, largest: int = C.BLOCK_CRC_SIZE) -> int:
    """The block size of the 1.3 block checksums of ``length`` stored bytes: about 1/``C.BLOCKS_PER_PAYLOAD`` of
    them, a power of two, at least ``C.MIN_WRITTEN_BLOCK_SIZE`` and at most ``largest``. A tensor-parallel rank of a
    model whose payloads are a few MiB then checks little more than its part (with 1 MiB blocks, a rank keeping half
    the rows of a 1.5 MB payload checked all of it)."""
    target = max(C.MIN_WRITTEN_BLOCK_SIZE, -(-length // C.BLOCKS_PER_PAYLOAD))
    return min(largest, 1 << (target - 1).bit_length())


def write_tensor(writer: SztWriter, name: str, dtype: str, shape: Iterable[int], raw: torch.Tensor,
                 **encode_kw: Any) -> TensorEntry:
    """Encode (with the round-trip check, and the coverage gate of the writer's form) and append one tensor; a
    mismatch aborts the whole file."""
    try:
        encoded = encode_tensor(raw, dtype, gate=writer.coverage_gate, **encode_kw)
    except RoundTripMismatch as e:
        raise RoundTripError(str(e), path=writer.path, tensor=name) from None
    return writer.add(name, dtype, tuple(shape), encoded)
