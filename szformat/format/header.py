"""The msgpack header of a .szt file: the schema of a tensor entry, and its validation.

Parsing checks every field before any payload byte is read through it: types, dtype names, overflow-checked
shape products, lengths implied by dtype and encoding, the escape-stream offsets of SplitZip payloads, and the
placement rule (each payload starts at the first aligned offset after the previous one, in header order, and the
header follows the last payload), so payloads can neither overlap, nor leave the file, nor hide bytes.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import msgpack

from ..codec.codebook import Codebook
from ..codec.layout import CHUNK_SIZE, N_CODES, PayloadLayout
from ..errors import HeaderError, InvalidOffsetError, UnknownEncodingError, UnsupportedVersionError
from . import constants as C

_U32 = (1 << 32) - 1


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the header describes it.

    ``offset`` and ``length`` locate the stored bytes in the file; ``raw_length`` is the size of the tensor's own
    bytes. ``crc32`` checks the stored bytes, ``raw_crc32`` the decoded bytes. For ``splitzip`` entries ``layout``
    and ``codebook`` are set; for ``raw`` entries ``raw_reason`` may say why the codec did not take it.
    """

    name: str
    dtype: str
    shape: tuple[int, ...]
    encoding: str
    offset: int
    length: int
    raw_length: int
    crc32: int
    raw_crc32: int
    layout: PayloadLayout | None = None
    codebook: Codebook | None = None
    raw_reason: str | None = None

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def to_dict(self) -> dict[str, Any]:
        if self.encoding == C.ENCODING_SPLITZIP:
            assert self.layout is not None and self.codebook is not None
            encoding: dict[str, Any] = {"name": C.ENCODING_SPLITZIP, "configuration": {
                "chunk_size": self.layout.chunk_size,
                "n": self.layout.n,
                "n_esc": self.layout.n_esc,
                "codebook": list(self.codebook.dec_lut),
                "n_codes_used": self.codebook.n_used,
                "coverage": float(self.codebook.coverage),
                "streams": self.layout.stream_offsets(),
            }}
        else:
            encoding = {"name": C.ENCODING_RAW}
            if self.raw_reason:
                encoding["configuration"] = {"reason": self.raw_reason}
        return {
            "name": self.name, "dtype": self.dtype, "shape": list(self.shape), "encoding": encoding,
            "offset": self.offset, "length": self.length, "raw_length": self.raw_length,
            "crc32": self.crc32, "raw_crc32": self.raw_crc32,
        }


@dataclass
class Header:
    """The parsed header: tensors in file order, the source ``__metadata__``, required features."""

    tensors: list[TensorEntry]
    metadata: dict[str, str] | None = None
    required_features: list[str] = field(default_factory=list)

    def to_bytes(self) -> bytes:
        obj: dict[str, Any] = {"tensors": [t.to_dict() for t in self.tensors]}
        if self.metadata is not None:
            obj["metadata"] = dict(self.metadata)
        if self.required_features:
            obj["required_features"] = list(self.required_features)
        return msgpack.packb(obj, use_bin_type=True)


def parse_header(
    raw: bytes | memoryview,
    *,
    path: str | os.PathLike,
    alignment: int,
    header_offset: int,
) -> Header:
    """Decode and validate a header; payloads must tile ``[PREAMBLE_SIZE, header_offset)`` as the rules say."""
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
    except UnicodeDecodeError as e:
        raise HeaderError(f"header holds a string that is not valid UTF-8 ({e})", path=path) from None
    except Exception as e:  # msgpack raises several unrelated types for malformed data
        raise HeaderError(f"header is not valid msgpack ({type(e).__name__}: {e})", path=path) from None
    if not isinstance(obj, dict):
        raise HeaderError(f"header must be a map, got {type(obj).__name__}", path=path)

    features = obj.get("required_features", [])
    if not isinstance(features, list) or not all(isinstance(f, str) for f in features):
        raise HeaderError("'required_features' must be a list of strings", path=path)
    unknown = sorted(set(features) - C.FEATURES)
    if unknown:
        raise UnsupportedVersionError(
            f"file needs format features {unknown} that this reader does not implement; upgrade szformat", path=path)

    metadata = obj.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or len(metadata) > C.MAX_METADATA_ENTRIES or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise HeaderError("'metadata' must be a map of strings to strings", path=path)

    tensors = obj.get("tensors")
    if not isinstance(tensors, list):
        raise HeaderError("header has no 'tensors' list", path=path)
    if len(tensors) > C.MAX_TENSORS:
        raise HeaderError(f"header lists {len(tensors)} tensors, more than the limit of {C.MAX_TENSORS}", path=path)

    entries: list[TensorEntry] = []
    seen: set[str] = set()
    cursor = C.PREAMBLE_SIZE
    for index, item in enumerate(tensors):
        entry = _parse_entry(item, index=index, path=path)
        if entry.name in seen:
            raise HeaderError("tensor name appears twice in the header", path=path, tensor=entry.name)
        seen.add(entry.name)
        expected = C.pad_to(cursor, alignment)
        if entry.offset != expected:
            raise InvalidOffsetError(
                f"payload offset {entry.offset} is not where the placement rule puts it ({expected}): payloads "
                "overlap, are out of order, or leave a hole", path=path, tensor=entry.name)
        cursor = entry.offset + entry.length
        if cursor > header_offset:
            raise InvalidOffsetError(
                f"payload [{entry.offset}, {cursor}) runs past the payload region, which ends at {header_offset}",
                path=path, tensor=entry.name)
        entries.append(entry)
    if cursor != header_offset:
        raise InvalidOffsetError(
            f"{header_offset - cursor} bytes between the last payload and the header are not explained", path=path)
    return Header(tensors=entries, metadata=metadata, required_features=list(features))


def _int(obj: dict, key: str, *, path, tensor, lo: int = 0, hi: int = 1 << 63) -> int:
    value = obj.get(key)
    if type(value) is not int or not lo <= value <= hi:
        raise HeaderError(f"field {key!r} must be an integer in [{lo}, {hi}], got {value!r}", path=path, tensor=tensor)
    return value


def _parse_entry(item: Any, *, index: int, path) -> TensorEntry:
    if not isinstance(item, dict):
        raise HeaderError(f"tensor entry #{index} must be a map", path=path)
    name = item.get("name")
    if not isinstance(name, str) or not name:
        raise HeaderError(f"tensor entry #{index} has no name", path=path)
    if len(name.encode("utf-8", "surrogatepass")) > C.MAX_NAME_BYTES:
        raise HeaderError(f"tensor entry #{index} has a name longer than {C.MAX_NAME_BYTES} bytes", path=path)

    dtype = item.get("dtype")
    if not isinstance(dtype, str) or dtype not in C.DTYPES:
        raise HeaderError(f"unknown dtype {dtype!r}", path=path, tensor=name)
    shape = item.get("shape")
    if not isinstance(shape, list) or len(shape) > C.MAX_NDIM:
        raise HeaderError(f"shape must be a list of at most {C.MAX_NDIM} sizes", path=path, tensor=name)
    numel = 1
    for d in shape:
        if type(d) is not int or d < 0:
            raise HeaderError(f"shape {shape!r} holds something other than a non-negative integer", path=path,
                              tensor=name)
        numel *= d
        if numel > C.MAX_ELEMENTS:
            raise HeaderError(f"shape {shape!r} has more elements than the limit of {C.MAX_ELEMENTS}", path=path,
                              tensor=name)

    offset = _int(item, "offset", path=path, tensor=name)
    length = _int(item, "length", path=path, tensor=name)
    raw_length = _int(item, "raw_length", path=path, tensor=name)
    crc32 = _int(item, "crc32", path=path, tensor=name, hi=_U32)
    raw_crc32 = _int(item, "raw_crc32", path=path, tensor=name, hi=_U32)
    if raw_length != numel * C.itemsize(dtype):
        raise HeaderError(f"raw_length {raw_length} does not match shape {shape} of {dtype}", path=path, tensor=name)

    encoding = item.get("encoding")
    if not isinstance(encoding, dict) or not isinstance(encoding.get("name"), str):
        raise HeaderError("'encoding' must be a map with a 'name'", path=path, tensor=name)
    config = encoding.get("configuration", {})
    if not isinstance(config, dict):
        raise HeaderError("encoding 'configuration' must be a map", path=path, tensor=name)
    common = dict(name=name, dtype=dtype, shape=tuple(shape), offset=offset, length=length, raw_length=raw_length,
                  crc32=crc32, raw_crc32=raw_crc32)

    if encoding["name"] == C.ENCODING_RAW:
        if length != raw_length:
            raise HeaderError(f"raw payload length {length} differs from raw_length {raw_length}", path=path,
                              tensor=name)
        reason = config.get("reason")
        return TensorEntry(encoding=C.ENCODING_RAW, raw_reason=reason if isinstance(reason, str) else None, **common)
    if encoding["name"] == C.ENCODING_SPLITZIP:
        layout, codebook = _parse_splitzip(config, dtype=dtype, numel=numel, length=length, path=path, tensor=name)
        return TensorEntry(encoding=C.ENCODING_SPLITZIP, layout=layout, codebook=codebook, **common)
    raise UnknownEncodingError(
        f"encoding {encoding['name']!r} is not known to this reader (known: {C.ENCODING_SPLITZIP!r}, "
        f"{C.ENCODING_RAW!r}); the file needs a newer szformat", path=path, tensor=name)


def _parse_splitzip(config: dict, *, dtype: str, numel: int, length: int, path, tensor: str):
    if dtype != "BF16":
        raise HeaderError(f"splitzip encodes BF16 only, entry has dtype {dtype}", path=path, tensor=tensor)
    chunk_size = _int(config, "chunk_size", path=path, tensor=tensor, lo=1, hi=65536)
    if chunk_size != CHUNK_SIZE:
        raise UnsupportedVersionError(f"splitzip chunk size {chunk_size} is not supported (only {CHUNK_SIZE})",
                                      path=path, tensor=tensor)
    n = _int(config, "n", path=path, tensor=tensor)
    n_esc = _int(config, "n_esc", path=path, tensor=tensor)
    if n != numel:
        raise HeaderError(f"splitzip n={n} differs from the shape's {numel} elements", path=path, tensor=tensor)
    if n_esc > n:
        raise HeaderError(f"splitzip n_esc={n_esc} exceeds n={n}", path=path, tensor=tensor)
    layout = PayloadLayout(n=n, n_esc=n_esc, chunk_size=chunk_size)
    if length != layout.comp_bytes:
        raise HeaderError(f"payload length {length} differs from the {layout.comp_bytes} bytes its layout needs "
                          f"(n={n}, n_esc={n_esc})", path=path, tensor=tensor)
    if config.get("streams") != layout.stream_offsets():
        raise HeaderError(f"stream offsets {config.get('streams')!r} differ from the frozen layout "
                          f"{layout.stream_offsets()!r}", path=path, tensor=tensor)
    lut = config.get("codebook")
    n_used = _int(config, "n_codes_used", path=path, tensor=tensor, hi=N_CODES)
    coverage = config.get("coverage")
    if not isinstance(lut, list) or len(lut) != N_CODES or any(type(v) is not int for v in lut) \
            or not isinstance(coverage, float):
        raise HeaderError("splitzip codebook must be 16 integers with a float coverage", path=path, tensor=tensor)
    try:
        codebook = Codebook(dec_lut=tuple(lut), n_used=n_used, coverage=coverage)
    except ValueError as e:
        raise HeaderError(f"invalid codebook: {e}", path=path, tensor=tensor) from None
    return layout, codebook
