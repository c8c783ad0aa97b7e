"""The msgpack header of a .szt file: the schema of a tensor entry, and its validation.

Parsing checks every field before any payload byte is read through it: types, dtype names, overflow-checked
shape products, lengths implied by dtype and encoding, the escape-stream offsets of SplitZip payloads, and the
placement rule (each payload starts at the first aligned offset after the previous one, in header order, and the
header follows the last payload), so payloads can neither overlap, nor leave the file, nor hide bytes.
The name, shape and metadata rules are shared with the writer, so it cannot write a file this reader refuses.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import msgpack

from .._collector import collector_paused
from .._lazy import at_rest, torch
from ..checksum import crc32, crc32_combine, crc32_join
from ..codec.codebook import Codebook
from ..codec.layout import CHUNK_SIZE, N_CODES, PayloadLayout, payload_layout
from ..errors import (DecodeRouteError, HeaderError, InvalidOffsetError, SzformatError, UnknownEncodingError,
                      UnsupportedVersionError, short_repr)
from . import constants as C

try:
    from . import _msgpack_check
except ImportError:  # built without a C compiler: every header goes through the checking hooks
    _msgpack_check = None
try:
    from . import _entries
except ImportError:  # built without a C compiler: every entry is parsed by _parse_entry
    _entries = None

_U32 = (1 << 32) - 1


@dataclass(frozen=True)
class BlockChecksums:
    """1.3: the CRC-32 of each ``size`` stored bytes of a tensor (the last block shorter), in order. A read of part of
    a payload checks the blocks it touches instead of reading the whole payload for the entry's ``crc32``; the
    blocks' CRCs, joined in order, give that ``crc32`` (:meth:`joined`), which binds the table to it."""

    size: int
    crcs: tuple[int, ...]

    @classmethod
    def of(cls, parts: Sequence[memoryview], size: int) -> "BlockChecksums":
        """The table of the stored bytes ``parts`` (consecutive pieces, flat bytes), in blocks of ``size``."""
        crcs, crc, filled = [], 0, 0
        for part in parts:
            part = memoryview(part).cast("B")
            at = 0
            while at < len(part):
                take = min(size - filled, len(part) - at)
                crc = crc32(part[at: at + take], crc)
                at, filled = at + take, filled + take
                if filled == size:
                    crcs.append(crc)
                    crc, filled = 0, 0
        if filled:
            crcs.append(crc)
        return cls(size=size, crcs=tuple(crcs))

    def joined(self, length: int) -> int:
        """The CRC-32 of all ``length`` stored bytes, from the blocks' CRCs."""
        return crc32_join((crc, min(self.size, length - i * self.size)) for i, crc in enumerate(self.crcs))

    def covering(self, length: int, spans: Iterable[tuple[int, int]]) -> list[tuple[int, int, int]]:
        """The blocks holding any byte of ``spans`` (ranges of the ``length`` stored bytes), as runs of adjacent
        blocks in order: ``(start, stop, crc)``, ``crc`` their CRC-32s joined (one check per run, not per block)."""
        blocks: set[int] = set()
        for lo, hi in spans:
            if lo < hi:
                blocks.update(range(lo // self.size, (hi - 1) // self.size + 1))
        runs: list[tuple[int, int, int]] = []
        for i in sorted(blocks):
            start, stop = i * self.size, min((i + 1) * self.size, length)
            if runs and runs[-1][1] == start:
                first, _, crc = runs[-1]
                runs[-1] = (first, stop, crc32_combine(crc, self.crcs[i], stop - start))
            else:
                runs.append((start, stop, self.crcs[i]))
        return runs

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "crc32": list(self.crcs)}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor as the header describes it.

    ``offset`` and ``length`` locate the stored bytes in the file; ``raw_length`` is the size of the tensor's own
    bytes. ``crc32`` checks the stored bytes, ``raw_crc32`` the decoded bytes. For ``splitzip`` entries ``layout``
    and ``codebook`` are set, and ``at_rest`` when the payload is stored through the 1.1 at-rest stage (then
    ``length`` counts the stored bytes and :attr:`memory_length` the in-memory payload's); for ``raw`` entries
    ``raw_reason`` may say why the codec did not take it, and ``at_rest`` is set when the tensor's bytes are stored as
    byte planes (1.2; ``length`` the stored bytes, :attr:`memory_length` the raw ones). ``blocks`` (1.3) holds the
    CRC-32 of each block of the stored bytes, for reads of part of them.
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
    at_rest: at_rest.ZstdStage | at_rest.PlanesStage | None = None
    blocks: BlockChecksums | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def memory_length(self) -> int:
        """Bytes of the payload once inflated: what GPU routes move and decode (``length`` without a stage)."""
        if self.at_rest is None:
            return self.length
        return self.raw_length if self.encoding == C.ENCODING_RAW else self.layout.comp_bytes

    @property
    def byte_planes(self) -> bool:
        """Whether this is a raw tensor stored at rest as byte planes (1.2): inflated, then joined into elements."""
        return self.at_rest is not None and isinstance(self.at_rest, at_rest.PlanesStage)

    def segments(self) -> list[at_rest.Segment]:
        """The pieces of the stored bytes of a tensor with an at-rest stage, in in-memory order."""
        if self.byte_planes:
            return self.at_rest.segments(self.raw_length)
        return at_rest.segments(self.layout, self.at_rest)

    def torch_dtype(self, path: str | os.PathLike) -> torch.dtype:
        """The torch dtype to decode into.

        Raises:
            DecodeRouteError: this torch lacks the dtype (wide unsigned and float8 ones are recent), naming
                ``path``, the file holding this entry, and the tensor.
        """
        dtype = C.DTYPES[self.dtype][0]
        if dtype is None:
            raise DecodeRouteError(f"dtype {self.dtype} has no torch equivalent in torch {torch.__version__}",
                                   path=path, tensor=self.name)
        return dtype

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
            if self.at_rest is not None:
                encoding["at_rest"] = self.at_rest.to_dict()
        else:
            encoding = {"name": C.ENCODING_RAW}
            if self.raw_reason:
                encoding["configuration"] = {"reason": self.raw_reason}
            if self.at_rest is not None:
                encoding["at_rest"] = self.at_rest.to_dict()
        entry = {
            "name": self.name, "dtype": self.dtype, "shape": list(self.shape), "encoding": encoding,
            "offset": self.offset, "length": self.length, "raw_length": self.raw_length,
            "crc32": self.crc32, "raw_crc32": self.raw_crc32,
        }
        if self.blocks is not None:
            entry["block_crc32"] = self.blocks.to_dict()
        return entry


@dataclass
class Header:
    """The parsed header: tensors in file order, the source ``__metadata__``, required features, and (1.1) the
    alignment of payloads smaller than the file's alignment."""

    tensors: list[TensorEntry]
    metadata: dict[str, str] | None = None
    required_features: list[str] = field(default_factory=list)
    small_alignment: int | None = None

    def to_bytes(self) -> bytes:
        obj: dict[str, Any] = {"tensors": [t.to_dict() for t in self.tensors]}
        if self.metadata is not None:
            obj["metadata"] = dict(self.metadata)
        if self.required_features:
            obj["required_features"] = list(self.required_features)
        if self.small_alignment is not None:
            obj["small_alignment"] = self.small_alignment
        return msgpack.packb(obj, use_bin_type=True)


def payload_alignment(length: int, alignment: int, small_alignment: int | None) -> int:
    """Where a payload of ``length`` stored bytes may start: a multiple of the file's ``alignment``, or, in a file
    with ``small_alignment`` (1.1), of that smaller one for a payload shorter than :data:`C.SMALL_PAYLOAD_LIMIT`
    (the padding before a larger one costs at most ``alignment / SMALL_PAYLOAD_LIMIT`` = 0.4 % of it)."""
    return small_alignment if small_alignment is not None and length < C.SMALL_PAYLOAD_LIMIT else alignment


# ---------------------------------------------------------------------------------------------------------------
# Rules shared by reader and writer (each raises ValueError with the reason; callers add file and tensor)
# ---------------------------------------------------------------------------------------------------------------


def validate_small_alignment(value: object, alignment: int, what: str = "small_alignment") -> None:
    """Format 1.1: payloads under 1 MiB start at multiples of ``value``, a power of two in [16, ``alignment``);
    raise ValueError naming it ``what`` otherwise."""
    if type(value) is not int or not C.MIN_SMALL_ALIGNMENT <= value < alignment or value & (value - 1):
        raise ValueError(f"{what} must be a power of two in [{C.MIN_SMALL_ALIGNMENT}, {alignment}), got {value!r}")


def validate_name(name: object) -> None:
    """A tensor name is a non-empty UTF-8 string of at most MAX_NAME_BYTES, without NUL, not ``__metadata__``."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"a tensor name must be a non-empty string, got {short_repr(name)}")
    try:
        encoded = name.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"tensor name {short_repr(name)} is not valid Unicode (lone surrogate)") from None
    if len(encoded) > C.MAX_NAME_BYTES:
        raise ValueError(f"tensor name is {len(encoded)} bytes long, more than the limit of {C.MAX_NAME_BYTES}")
    if "\x00" in name:
        raise ValueError(f"tensor name {short_repr(name)} contains a NUL character")
    if name == C.RESERVED_NAME:
        raise ValueError(f"{C.RESERVED_NAME!r} is reserved and cannot name a tensor")


def validate_shape(shape: object) -> int:
    """Check a shape (a list or tuple of at most MAX_NDIM non-negative ints, each and their product at most
    MAX_ELEMENTS); its numel."""
    if not isinstance(shape, (list, tuple)):
        raise ValueError(f"shape must be a list of sizes, got {short_repr(shape)}")
    if len(shape) > C.MAX_NDIM:
        raise ValueError(f"shape has {len(shape)} dimensions, more than the limit of {C.MAX_NDIM}")
    for d in shape:
        if type(d) is not int or not 0 <= d <= C.MAX_ELEMENTS:
            raise ValueError(f"shape {short_repr(list(shape))} holds {short_repr(d)}, not an integer in "
                             f"[0, {C.MAX_ELEMENTS}]")
    numel = math.prod(shape)
    if numel > C.MAX_ELEMENTS:
        raise ValueError(f"shape {short_repr(list(shape))} has more elements than the limit of {C.MAX_ELEMENTS}")
    return numel


def validate_metadata(metadata: object) -> None:
    """``__metadata__`` is a map of at most MAX_METADATA_ENTRIES valid UTF-8 strings to strings, as in safetensors."""
    if metadata is None:
        raise ValueError("metadata is nil; a file without metadata leaves the key out (safetensors' __metadata__ is "
                         "a map of strings to strings)")
    if not isinstance(metadata, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                                 for k, v in metadata.items()):
        raise ValueError("metadata must be a map of strings to strings")
    if len(metadata) > C.MAX_METADATA_ENTRIES:
        raise ValueError(f"metadata has {len(metadata)} entries, more than the limit of {C.MAX_METADATA_ENTRIES}")
    for k, v in metadata.items():
        try:
            k.encode("utf-8"), v.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"metadata entry {short_repr(k)} is not valid Unicode (lone surrogate)") from None


# ---------------------------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------------------------


@collector_paused()
def parse_header(
    raw: bytes | memoryview,
    *,
    path: str | os.PathLike,
    alignment: int,
    header_offset: int,
) -> Header:
    """Decode and validate a header; payloads must tile ``[PREAMBLE_SIZE, header_offset)`` as the rules say."""
    obj = _unpack(raw, path=path)
    if not isinstance(obj, dict):
        raise HeaderError(f"header must be a map, got {type(obj).__name__}", path=path)

    features = obj.get("required_features", [])
    if not isinstance(features, list) or not all(isinstance(f, str) for f in features):
        raise HeaderError("'required_features' must be a list of strings", path=path)
    if len(set(features)) != len(features):
        twice = next(f for i, f in enumerate(features) if f in features[:i])
        raise HeaderError(f"'required_features' lists {twice!r} twice", path=path)
    unknown = sorted(set(features) - C.FEATURES)
    if unknown:
        raise UnsupportedVersionError(
            f"file needs format features {unknown} that this reader does not implement; upgrade szformat", path=path)
    small_alignment = obj.get("small_alignment")
    if small_alignment is not None:
        if C.FEATURE_SMALL_ALIGNMENT not in features:
            raise HeaderError(f"'small_alignment' is set but {C.FEATURE_SMALL_ALIGNMENT!r} is not among the "
                              "required features", path=path)
        try:
            validate_small_alignment(small_alignment, alignment, "'small_alignment'")
        except ValueError as e:
            raise HeaderError(str(e), path=path) from None
    elif C.FEATURE_SMALL_ALIGNMENT in features:
        raise HeaderError(f"required feature {C.FEATURE_SMALL_ALIGNMENT!r} is listed without 'small_alignment'",
                          path=path)

    metadata = obj.get("metadata")
    if "metadata" in obj:  # nil is not "no metadata": that is the key left out
        try:
            validate_metadata(metadata)
        except ValueError as e:
            raise HeaderError(f"'metadata': {e}", path=path) from None

    tensors = obj.get("tensors")
    if not isinstance(tensors, list):
        raise HeaderError("header has no 'tensors' list", path=path)
    if len(tensors) > C.MAX_TENSORS:
        raise HeaderError(f"header lists {len(tensors)} tensors, more than the limit of {C.MAX_TENSORS}", path=path)

    entries: list[TensorEntry] = []
    seen: set[str] = set()
    cursor = C.PREAMBLE_SIZE
    for index, (item, entry) in enumerate(zip(tensors, _plain_entries(tensors))):
        if entry is None:
            entry = _parse_entry(item, index=index, path=path)
        if entry.at_rest is not None:
            feature = C.FEATURE_AT_REST_PLANES if entry.encoding == C.ENCODING_RAW else C.FEATURE_AT_REST_ZSTD
            if feature not in features:
                raise HeaderError(f"tensor has an at-rest stage but {feature!r} is not among the required features",
                                  path=path, tensor=entry.name)
        if entry.name in seen:
            raise HeaderError("tensor name appears twice in the header", path=path, tensor=entry.name)
        seen.add(entry.name)
        expected = C.pad_to(cursor, payload_alignment(entry.length, alignment, small_alignment))
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
    return Header(tensors=entries, metadata=metadata, required_features=list(features),
                  small_alignment=small_alignment)


def _unpack(raw: bytes | memoryview, *, path) -> Any:
    """msgpack-decode a header with limits: string keys, no duplicate map keys, bounded lengths, container count
    and nesting.

    Where the C check (``_msgpack_check.plain``) finds a header keeps all of those rules, msgpack parses it as it
    is, which gives the same object as :func:`_checking_hooks` in about a fifth of the time; any other header goes
    through those hooks, which say what is wrong, and its nesting is checked once afterwards (msgpack itself stops
    past about a thousand levels).
    """
    budget = len(raw) // C.HEADER_BYTES_PER_CONTAINER + 8
    checked = _msgpack_check is not None and _msgpack_check.plain(raw, C.MAX_HEADER_DEPTH, budget)
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True, max_array_len=C.MAX_TENSORS,
                              max_map_len=C.MAX_METADATA_ENTRIES,
                              **({} if checked else _checking_hooks(budget, path=path)))
    except SzformatError:
        raise
    except UnicodeDecodeError as e:
        raise HeaderError(f"header holds a string that is not valid UTF-8 ({e})", path=path) from None
    except Exception as e:  # msgpack raises several unrelated types for malformed data (ExtraData, StackError, ...)
        raise HeaderError(f"header is not valid msgpack or breaks a size limit ({type(e).__name__}: {e})",
                          path=path) from None
    if not checked:
        _check_depth(obj, path=path)
    return obj


def _checking_hooks(budget: int, *, path) -> dict[str, Callable]:
    """msgpack's ``object_pairs_hook`` and ``list_hook`` for a header the C check did not pass: they run once per map
    and array, so they do only what must happen while the header is built (refuse a repeated or non-string key,
    which the finished dict no longer shows; stop a flood of more than ``budget`` containers before it costs
    memory). A 100,000-tensor header parses in about a third of the time the per-container bookkeeping took."""
    containers = itertools.count(1)

    def spent() -> None:
        raise HeaderError(f"header holds more than one map or array per {C.HEADER_BYTES_PER_CONTAINER} bytes; "
                          "refusing it as a decompression bomb", path=path)

    def pairs_hook(pairs: list[tuple[Any, Any]]) -> dict:
        if next(containers) > budget:
            spent()
        mapping = dict(pairs)
        if len(mapping) != len(pairs) or not set(map(type, mapping)) <= _STR:
            _refuse_keys(pairs, mapping, path=path)
        return mapping

    def list_hook(items: list) -> list:
        if next(containers) > budget:
            spent()
        return items

    return {"object_pairs_hook": pairs_hook, "list_hook": list_hook}


_STR = {str}
_INT = {int}
_CONTAINERS = (dict, list)


def _refuse_keys(pairs: list[tuple[Any, Any]], mapping: dict, *, path) -> None:
    """Raise HeaderError for the map ``pairs``: a key that is not a string, or one that appears twice."""
    for key, _ in pairs:
        if type(key) is not str:
            raise HeaderError(f"a map in the header has the key {short_repr(key)}, not a string (msgpack str)",
                              path=path)
    seen: set = set()
    twice = next(k for k, _ in pairs if k in seen or seen.add(k))
    name = mapping.get("name")
    tensor = name if "dtype" in mapping and isinstance(name, str) and len(name) <= C.MAX_NAME_BYTES else None
    raise HeaderError(f"a map in the header holds the key {short_repr(twice)} twice", path=path, tensor=tensor)


def _check_depth(obj: Any, *, path) -> None:
    """Refuse a header whose maps and arrays nest deeper than MAX_HEADER_DEPTH (the top one counted): walked with
    a stack of its own, level by level, so a deep header costs no recursion."""
    level, current = 0, [obj] if type(obj) in _CONTAINERS else []
    while current:
        level += 1
        if level > C.MAX_HEADER_DEPTH:
            raise HeaderError(f"header nests maps and arrays deeper than {C.MAX_HEADER_DEPTH} levels (the top map "
                              "counted)", path=path)
        below = []
        for container in current:
            below += [child for child in (container.values() if type(container) is dict else container)
                      if type(child) in _CONTAINERS]
        current = below


def _int(obj: dict, key: str, *, path, tensor, lo: int = 0, hi: int = 1 << 63) -> int:
    value = obj.get(key)
    if type(value) is not int or not lo <= value <= hi:
        raise HeaderError(f"field {key!r} must be an integer in [{lo}, {hi}], got {short_repr(value)}", path=path,
                          tensor=tensor)
    return value


_ENTRY_DEFAULTS = {f.name: f.default for f in dataclasses.fields(TensorEntry) if f.default is not dataclasses.MISSING}

def _entry(**fields: Any) -> TensorEntry:
    """A :class:`TensorEntry` of checked ``fields``, the others at their defaults, made without the frozen
    dataclass's generated ``__init__``: it sets each of the 14 fields through ``object.__setattr__``, a fifth of a
    small tensor's parse, and checks nothing the parser has not. ``_entries.plain_entries`` makes its records so."""
    entry = object.__new__(TensorEntry)
    entry.__dict__.update(_ENTRY_DEFAULTS, **fields)
    return entry


_PLAIN_RULES = (C.ITEMSIZE, C.MAX_NAME_BYTES, C.RESERVED_NAME, C.MAX_NDIM, C.MAX_ELEMENTS, CHUNK_SIZE,
                PayloadLayout.max_elements(CHUNK_SIZE), C.MIN_BLOCK_CRC_SIZE, C.MAX_BLOCK_CRC_SIZE)
"""The constants ``_entries.plain_entries`` checks entries against."""


_RECORDS = (TensorEntry, _ENTRY_DEFAULTS, Codebook, BlockChecksums, payload_layout)
"""What ``_entries.plain_entries`` makes a plain entry of: records made as :func:`_entry` makes them, the layout
as here."""


def _plain_entries(tensors: list) -> list[TensorEntry | None]:
    """Per item of a header's ``tensors``, the entry :func:`_parse_entry` would make of it, where the C extension
    found it keeps every rule (``_entries.plain_entries``: a tenth of :func:`_parse_entry`'s time), else None (parse
    it with :func:`_parse_entry`, which says what is wrong, if anything)."""
    if _entries is None:
        return [None] * len(tensors)
    return _entries.plain_entries(tensors, _PLAIN_RULES, _RECORDS)


def _parse_entry(item: Any, *, index: int, path) -> TensorEntry:
    if not isinstance(item, dict):
        raise HeaderError(f"tensor entry #{index} must be a map", path=path)
    name = item.get("name")
    try:
        validate_name(name)
    except ValueError as e:
        raise HeaderError(f"tensor entry #{index}: {e}", path=path) from None

    dtype = item.get("dtype")
    if not isinstance(dtype, str) or dtype not in C.ITEMSIZE:
        raise HeaderError(f"unknown dtype {short_repr(dtype)}", path=path, tensor=name)
    shape = item.get("shape")
    try:
        numel = validate_shape(shape)
    except ValueError as e:
        raise HeaderError(str(e), path=path, tensor=name) from None

    offset = _int(item, "offset", path=path, tensor=name)
    length = _int(item, "length", path=path, tensor=name)
    raw_length = _int(item, "raw_length", path=path, tensor=name)
    crc32 = _int(item, "crc32", path=path, tensor=name, hi=_U32)
    raw_crc32 = _int(item, "raw_crc32", path=path, tensor=name, hi=_U32)
    if raw_length != numel * C.itemsize(dtype):
        raise HeaderError(f"raw_length {raw_length} does not match shape {short_repr(shape)} of {dtype}", path=path,
                          tensor=name)

    encoding = item.get("encoding")
    if not isinstance(encoding, dict) or not isinstance(encoding.get("name"), str):
        raise HeaderError("'encoding' must be a map with a string 'name'", path=path, tensor=name)
    config = encoding.get("configuration", {})
    if not isinstance(config, dict):
        raise HeaderError("encoding 'configuration' must be a map", path=path, tensor=name)
    common = dict(name=name, dtype=dtype, shape=tuple(shape), offset=offset, length=length, raw_length=raw_length,
                  crc32=crc32, raw_crc32=raw_crc32)
    if "block_crc32" in item:
        common["blocks"] = _parse_blocks(item["block_crc32"], length=length, path=path, tensor=name)

    if encoding["name"] == C.ENCODING_RAW:
        stage = None
        if "at_rest" in encoding:  # 1.2: byte planes; the stored bytes and their checksum differ from the raw ones
            try:
                stage = at_rest.parse_planes(encoding["at_rest"], itemsize=C.itemsize(dtype), raw_length=raw_length,
                                             length=length)
            except at_rest.AtRestError as e:
                error = UnknownEncodingError if e.unknown_codec else HeaderError
                raise error(str(e), path=path, tensor=name) from None
        elif length != raw_length:
            raise HeaderError(f"raw payload length {length} differs from raw_length {raw_length}", path=path,
                              tensor=name)
        elif crc32 != raw_crc32:
            raise HeaderError(f"raw payload has two different checksums (crc32 {crc32:#010x}, raw_crc32 "
                              f"{raw_crc32:#010x}) for the same bytes", path=path, tensor=name)
        reason = config.get("reason")
        if "reason" in config and not isinstance(reason, str):
            raise HeaderError(f"raw 'reason' must be a string, got {short_repr(reason)}", path=path, tensor=name)
        return _entry(encoding=C.ENCODING_RAW, raw_reason=reason, at_rest=stage, **common)
    if encoding["name"] == C.ENCODING_SPLITZIP:
        staged = "at_rest" in encoding
        layout, codebook = _parse_splitzip(config, dtype=dtype, numel=numel, length=None if staged else length,
                                           path=path, tensor=name)
        stage = None
        if staged:
            try:
                stage = at_rest.parse_at_rest(encoding["at_rest"], layout=layout, length=length)
            except at_rest.AtRestError as e:
                error = UnknownEncodingError if e.unknown_codec else HeaderError
                raise error(str(e), path=path, tensor=name) from None
        return _entry(encoding=C.ENCODING_SPLITZIP, layout=layout, codebook=codebook, at_rest=stage, **common)
    raise UnknownEncodingError(
        f"encoding {short_repr(encoding['name'])} is not known to this reader "
        f"(known: {', '.join(map(repr, C.ENCODINGS))}); "
        "the file needs a newer szformat", path=path, tensor=name)


def _parse_blocks(value: Any, *, length: int, path, tensor: str) -> BlockChecksums:
    """1.3's ``block_crc32``: a block size and one CRC-32 per block of the ``length`` stored bytes. Whether they join
    to the entry's ``crc32`` is checked where a read first relies on them (a join per block, at most a few ms for a
    whole large file, kept off the header's parse)."""
    if not isinstance(value, dict):
        raise HeaderError(f"'block_crc32' must be a map, got {short_repr(value)}", path=path, tensor=tensor)
    size = _int(value, "size", path=path, tensor=tensor, lo=C.MIN_BLOCK_CRC_SIZE, hi=C.MAX_BLOCK_CRC_SIZE)
    if size & (size - 1):
        raise HeaderError(f"block_crc32 size must be a power of two, got {size}", path=path, tensor=tensor)
    crcs = value.get("crc32")
    count = -(-length // size)
    if not isinstance(crcs, list) or len(crcs) != count or not set(map(type, crcs)) <= _INT \
            or (crcs and not (min(crcs) >= 0 and max(crcs) <= _U32)):
        raise HeaderError(f"block_crc32 must list {count} CRC-32s (one per {size} stored bytes of {length}), got "
                          f"{short_repr(crcs)}", path=path, tensor=tensor)
    return BlockChecksums(size=size, crcs=tuple(crcs))


def _parse_splitzip(config: dict, *, dtype: str, numel: int, length: int | None, path, tensor: str):
    """The layout and codebook of a ``splitzip`` configuration; ``length`` (the stored bytes, ``None`` when an
    at-rest stage accounts for them) must be the layout's ``comp_bytes``."""
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
    if n > PayloadLayout.max_elements(chunk_size):
        raise HeaderError(f"splitzip n={n} is more than the {PayloadLayout.max_elements(chunk_size)} elements whose "
                          f"chunk ids fit an int32 (2^31 chunks of {chunk_size})", path=path, tensor=tensor)
    layout = payload_layout(n, n_esc)
    if length is not None and length != layout.comp_bytes:
        raise HeaderError(f"payload length {length} differs from the {layout.comp_bytes} bytes its layout needs "
                          f"(n={n}, n_esc={n_esc})", path=path, tensor=tensor)
    streams = config.get("streams")
    expected = layout.stream_offsets()
    if not isinstance(streams, dict) or streams != expected or not set(map(type, streams.values())) <= _INT:
        raise HeaderError(f"stream offsets {short_repr(streams)} differ from the frozen layout {expected!r}", path=path,
                          tensor=tensor)
    lut = config.get("codebook")
    n_used = _int(config, "n_codes_used", path=path, tensor=tensor, hi=N_CODES)
    if not isinstance(lut, list) or len(lut) != N_CODES or not set(map(type, lut)) <= _INT:
        raise HeaderError(f"splitzip codebook must be a list of {N_CODES} integers, got {short_repr(lut)}", path=path,
                          tensor=tensor)
    if any(lut[n_used:]):
        raise HeaderError(f"codebook entries past n_codes_used={n_used} must be 0, got {short_repr(lut[n_used:])}",
                          path=path, tensor=tensor)
    coverage = config.get("coverage")
    if not isinstance(coverage, float) or not 0.0 <= coverage <= 1.0:
        raise HeaderError(f"splitzip coverage must be a float in [0, 1], got {short_repr(coverage)}", path=path,
                          tensor=tensor)
    try:
        codebook = Codebook(dec_lut=tuple(lut), n_used=n_used, coverage=coverage)
    except ValueError as e:
        raise HeaderError(f"invalid codebook: {e}", path=path, tensor=tensor) from None
    return layout, codebook
