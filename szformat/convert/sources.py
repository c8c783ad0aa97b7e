"""Reading .safetensors files for conversion: a strict header parser and a tensor-by-tensor stream of raw bytes.

The header is parsed here rather than by the ``safetensors`` package so that the bytes of every dtype pass
through untouched, including dtypes this torch build has no type for (``U16``, ``F8_E8M0``...). The rules are
safetensors' own: an 8-byte little-endian header length, a JSON object of at most 100 MB, an optional
``__metadata__`` map of strings, and tensors whose ``data_offsets`` tile the data region exactly, with no hole and
no overlap. Names, shapes and metadata are also checked against the .szt rules, so a file that cannot be
converted is refused before anything is written.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import warnings
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator


from .._lazy import torch
from .._reused import ReusedBuffer
from ..errors import ConversionError, SzformatError, TruncatedFileError
from ..format import constants as C
from ..format.header import validate_metadata, validate_name, validate_shape
from ..format.reader import pread_exactly
from .pages import CoveredMapping, drop_pages

SUFFIX = ".safetensors"
HEADER_LENGTH = struct.Struct("<Q")
MAX_HEADER_BYTES = 100 * 1024 * 1024
"""safetensors refuses headers above this size too (HeaderTooLarge)."""
METADATA_KEY = "__metadata__"


@dataclass(frozen=True)
class SourceTensor:
    """One tensor of a .safetensors file: ``begin`` and ``end`` are offsets in the data region (after the header)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated header: tensors in data order, the ``__metadata__`` map (``None`` when the file has none)."""

    tensors: tuple[SourceTensor, ...]
    metadata: dict[str, str] | None
    data_start: int

    @property
    def sizes(self) -> dict[str, int]:
        """Raw bytes of each tensor, by name."""
        return {t.name: t.nbytes for t in self.tensors}


def read_safetensors_header(path: str | os.PathLike) -> SafetensorsHeader:
    """Read and validate the header of a .safetensors file.

    Raises:
        ConversionError: the file is not a valid .safetensors file, or holds something .szt cannot store.
        OSError: the file cannot be read.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(HEADER_LENGTH.size)
        if len(prefix) < HEADER_LENGTH.size:
            raise ConversionError(f"file of {size} bytes is too short for a safetensors header", path=path)
        (length,) = HEADER_LENGTH.unpack(prefix)
        if length > MAX_HEADER_BYTES:
            raise ConversionError(f"header length {length} exceeds safetensors' limit of {MAX_HEADER_BYTES}; "
                                  "this is not a .safetensors file", path=path)
        if HEADER_LENGTH.size + length > size:
            raise ConversionError(f"header length {length} runs past the end of the file ({size} bytes); the file "
                                  "is truncated or not a .safetensors file", path=path)
        raw = f.read(length)
    data_start = HEADER_LENGTH.size + length
    return parse_safetensors_header(raw, path=path, data_start=data_start, data_size=size - data_start)


def parse_safetensors_header(raw: bytes, *, path: str | os.PathLike, data_start: int,
                             data_size: int) -> SafetensorsHeader:
    """Validate the JSON header of a .safetensors file whose data region holds ``data_size`` bytes."""
    obj = _load_json(raw, path=path)
    metadata = obj.pop(METADATA_KEY, None)
    if metadata is not None:
        try:
            validate_metadata(metadata)
        except ValueError as e:
            raise ConversionError(f"{METADATA_KEY}: {e}", path=path) from None
    if len(obj) > C.MAX_TENSORS:
        raise ConversionError(f"header lists {len(obj)} tensors, more than the limit of {C.MAX_TENSORS}", path=path)
    tensors = sorted((_parse_tensor(name, info, path=path) for name, info in obj.items()),
                     key=lambda t: (t.begin, t.end))
    cursor = 0
    for t in tensors:
        if t.begin != cursor:
            problem = "overlaps the previous tensor" if t.begin < cursor else f"leaves a hole at {cursor}"
            raise ConversionError(f"data_offsets [{t.begin}, {t.end}] {problem}", path=path, tensor=t.name)
        cursor = t.end
    if cursor != data_size:
        raise ConversionError(f"tensors cover {cursor} bytes of a data region of {data_size}; the file is truncated "
                              "or holds unexplained bytes", path=path)
    return SafetensorsHeader(tuple(tensors), metadata, data_start)


def _load_json(raw: bytes, *, path) -> dict[str, Any]:
    def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        mapping = dict(pairs)
        if len(mapping) != len(pairs):
            seen: set[str] = set()
            twice = next(k for k, _ in pairs if k in seen or seen.add(k))
            raise ConversionError(f"header holds the key {twice!r} twice", path=path)
        return mapping

    try:
        obj = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys)
    except UnicodeDecodeError as e:
        raise ConversionError(f"header is not valid UTF-8 ({e}); this is not a .safetensors file", path=path) from None
    except (json.JSONDecodeError, RecursionError) as e:
        raise ConversionError(f"header is not valid JSON ({e}); this is not a .safetensors file", path=path) from None
    if not isinstance(obj, dict):
        raise ConversionError(f"header must be a JSON object, got {type(obj).__name__}", path=path)
    return obj


def _parse_tensor(name: str, info: Any, *, path) -> SourceTensor:
    try:
        validate_name(name)
    except ValueError as e:
        raise ConversionError(str(e), path=path) from None
    if not isinstance(info, dict):
        raise ConversionError("header entry must be an object with dtype, shape and data_offsets", path=path,
                              tensor=name)
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in C.ITEMSIZE:
        raise ConversionError(f"dtype {dtype!r} is not supported (supported: {', '.join(C.ITEMSIZE)})", path=path,
                              tensor=name)
    try:
        numel = validate_shape(shape)
    except ValueError as e:
        raise ConversionError(str(e), path=path, tensor=name) from None
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)
            and 0 <= offsets[0] <= offsets[1]):
        raise ConversionError(f"data_offsets must be [begin, end] with 0 <= begin <= end, got {offsets!r}",
                              path=path, tensor=name)
    begin, end = offsets
    expected = numel * C.itemsize(dtype)
    if end - begin != expected:
        raise ConversionError(f"data_offsets [{begin}, {end}] hold {end - begin} bytes, shape {shape} of {dtype} "
                              f"needs {expected}", path=path, tensor=name)
    return SourceTensor(name, dtype, tuple(shape), begin, end)


class SafetensorsSource:
    """An open .safetensors file whose tensors are read one at a time, in data order.

    Each tensor's bytes are views of a mapping of the file, covered (:class:`~.pages.CoveredMapping`): should another
    process truncate the file meanwhile, what it lost reads as zeros, where it would kill the process with SIGBUS,
    and the tensor is refused (:meth:`reading`). Where mappings cannot be covered (another OS than Linux, no C
    kernels), the bytes are copied out with ``pread`` into one buffer reused from tensor to tensor, and a file that
    shrank gives a short read: that copy took 0.8 of the 2.3-2.9 CPU-seconds a 2.2 GB conversion spent; read
    through the mapping, its payloads encoded into one reused buffer, the conversion takes x 0.86-0.88 the CPU
    (``bench/RESULTS.md``, "Conversion"). Where ``preadv`` is missing (Windows, which cannot truncate a mapped
    file) the mapping is read uncovered.

    Example:
        >>> with SafetensorsSource("model.safetensors") as src:  # doctest: +SKIP
        ...     for tensor, raw in src.tensors():
        ...         print(tensor.name, raw.numel())
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.header = read_safetensors_header(self.path)
        self._mmap: mmap.mmap | None = None
        self._cover: CoveredMapping | None = None
        self._file = open(self.path, "rb")
        try:
            if self.header.tensors and self.header.tensors[-1].end:
                self._map()
            self._version = self._stat()
        except BaseException:
            self.close()
            raise

    def _map(self) -> None:
        """Map the file where the mapping is covered here, or where there is no ``preadv`` to read it with; where
        it cannot be mapped (a file system without mappings, a file emptied meanwhile: pread's short read then
        names the first tensor), read it with ``preadv``."""
        try:
            self._mmap = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        except (OSError, ValueError) as e:
            if hasattr(os, "preadv"):
                return
            if isinstance(e, ValueError):
                raise ConversionError("file shrank while it was opened", path=self.path) from None
            raise
        self._cover = CoveredMapping.of(self._mmap)
        if self._cover is None and hasattr(os, "preadv"):
            self._mmap.close()
            self._mmap = None

    @property
    def metadata(self) -> dict[str, str] | None:
        return self.header.metadata

    def __enter__(self) -> "SafetensorsSource":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Let go of the mapping. It is unmapped when the last yielded view is freed, not before: torch views hold a
        reference to the mapping but no buffer export, so ``mmap.close()`` would unmap memory they still point to."""
        if self._cover is not None:
            self._cover.close()
            self._cover = None
        self._mmap = None
        self._file.close()

    def _stat(self) -> tuple[int, int]:
        st = os.fstat(self._file.fileno())
        return st.st_size, st.st_mtime_ns

    @contextmanager
    def reading(self, tensor: SourceTensor) -> Iterator[None]:
        """Wrap the use of one tensor's bytes, and raise ConversionError naming the file and the tensor if they may
        have changed meanwhile: the file's size or modification time moved, a page of the mapping was lost (and
        read as zeros), or the codec failed as only bytes changing under it make it fail (a plain ``ValueError``:
        the layout counted in one pass no longer fits the next). Another process writing the file is the usual
        cause; what was read may mix old and new bytes, so none of it may be kept.
        """
        try:
            yield
        except ValueError as e:
            if isinstance(e, SzformatError) and not self._changed_since_opened():
                raise  # the tensor breaks a rule of the output, or the codec a promise: the source is not to blame
            raise self._changed(tensor, f" ({e})" if not isinstance(e, SzformatError) else "") from e
        if self._changed_since_opened():
            raise self._changed(tensor, "")

    def _changed_since_opened(self) -> bool:
        return self._stat() != self._version or (self._cover is not None and self._cover.lost)

    def _changed(self, tensor: SourceTensor, detail: str) -> ConversionError:
        return ConversionError(f"the file changed while it was converted{detail}; convert it again once nothing "
                               "writes to it", path=self.path, tensor=tensor.name)

    def tensors(self) -> Iterator[tuple[SourceTensor, torch.Tensor]]:
        """Yield each tensor with its raw bytes as a flat uint8 tensor (a view of the mapping, whose pages are
        dropped after the step, or of a buffer reused from tensor to tensor), valid until the next step, so memory
        stays bounded by the largest tensor however large the file is.

        Raises:
            ConversionError: the file shrank since its header was read.
        """
        buffer = ReusedBuffer()
        for tensor in self.header.tensors:
            offset = self.header.data_start + tensor.begin
            if tensor.nbytes == 0:
                yield tensor, torch.empty(0, dtype=torch.uint8)
                continue
            if self._mmap is None:
                raw = buffer.take(tensor.nbytes)
                try:
                    pread_exactly(self._file.fileno(), raw, offset, path=self.path, tensor=tensor.name)
                except TruncatedFileError as e:
                    raise ConversionError(f"{e.reason} while it was converted", path=self.path,
                                          tensor=tensor.name) from None
                yield tensor, raw
                continue
            size = self._mmap.size()
            if size < offset + tensor.nbytes:  # past the new end: zeros (covered) or SIGBUS, never the bytes
                raise ConversionError(f"file shrank to {size} bytes after it was opened; bytes [{offset}, "
                                      f"{offset + tensor.nbytes}) were to be read while it was converted",
                                      path=self.path, tensor=tensor.name)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # read-only mapping: torch warns that the tensor is not writable
                raw = torch.frombuffer(self._mmap, dtype=torch.uint8, count=tensor.nbytes, offset=offset)
            yield tensor, raw
            del raw
            drop_pages(self._mmap, offset, tensor.nbytes)

