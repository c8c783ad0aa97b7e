"""Every number of the .szt container: magic, versions, preamble layout, alignment, hard limits, dtype table.

The reader, the writer and ``spec/szt-v1.md`` say the same thing; this module is where the code says it.
"""

from __future__ import annotations

import struct
from typing import Any

from ..codec.layout import ENCODING_RAW, ENCODING_SPLITZIP

MAGIC = b"\x89SZT\r\n\x1a\n"
"""Eight bytes at offset 0. The high byte and the CR LF / ^Z / LF tail catch text-mode and 7-bit transfers."""

VERSION_MAJOR = 1
VERSION_MINOR = 3
"""The minor version of a file with a 1.3 block-checksum table (:data:`BLOCK_CRC_MINOR`); a file without one is
written as before: 1.2 with byte planes at rest, 1.1 with only 1.1 features, 1.0 with none, byte for byte."""
READER_SUPPORTED_MAJORS = (1,)
"""A reader refuses any other major version. Minor versions of a known major only add optional header fields, and
features a reader must implement, announced in ``required_features``."""

FEATURE_AT_REST_ZSTD = "at_rest_zstd"
"""1.1: some SplitZip payloads are stored with streams as zstd frames (``encoding.at_rest``; see ``at_rest.py``), so
a 1.0 reader refuses such a file by name."""
FEATURE_SMALL_ALIGNMENT = "small_alignment"
"""1.1: payloads shorter than SMALL_PAYLOAD_LIMIT start at multiples of the header's ``small_alignment``."""
FEATURE_AT_REST_PLANES = "at_rest_planes"
"""1.2: some raw tensors are stored as byte planes through zstd (``encoding.at_rest`` of a ``raw`` entry), so a 1.0
or 1.1 reader refuses such a file by name."""
FEATURES: frozenset[str] = frozenset({FEATURE_AT_REST_ZSTD, FEATURE_SMALL_ALIGNMENT, FEATURE_AT_REST_PLANES})
FEATURE_MINOR = {FEATURE_AT_REST_ZSTD: 1, FEATURE_SMALL_ALIGNMENT: 1, FEATURE_AT_REST_PLANES: 2}
"""The minor version that introduced each feature: a file is written with the highest its features need."""
"""Names of optional features this reader implements; a file listing any other in ``required_features`` is refused."""

BLOCK_CRC_MINOR = 3
"""1.3: an entry whose stored bytes span more than one block carries ``block_crc32``, the CRC-32 of each block, so a
read of part of a tensor checks the blocks it reads instead of reading the whole payload for ``crc32``. Not a
required feature: a reader that ignores the key checks ``crc32`` as before and reads the file right."""
BLOCK_CRC_SIZE = 1 << 20
"""The largest block of a ``block_crc32`` table the writer makes, and the stored bytes past which an entry gets one
(5 header bytes per block)."""
BLOCKS_PER_PAYLOAD = 32
MIN_WRITTEN_BLOCK_SIZE = 64 << 10
"""The writer's blocks are about 1/BLOCKS_PER_PAYLOAD of a payload (a power of two, at least MIN_WRITTEN_BLOCK_SIZE,
at most the writer's largest), so a read of part of a tensor checks at most about two such parts more than it reads
per span of bytes, whatever the tensor's size, for at most 32 blocks per tensor under 32 MiB."""
MIN_BLOCK_CRC_SIZE = 4096
MAX_BLOCK_CRC_SIZE = 1 << 30
"""A block size is a power of two in [MIN_BLOCK_CRC_SIZE, MAX_BLOCK_CRC_SIZE]."""

FLAG_HEADER_ZSTD = 1
"""1.1 preamble flag: the header is stored as one zstd frame (content size and checksum included) holding the
msgpack header; ``header_crc32`` covers the stored frame. A flag, not a required feature, because a 1.0 reader
must refuse the file before it tries to read the header: 1.0 refuses every flag."""
KNOWN_FLAGS = FLAG_HEADER_ZSTD
HEADER_INFLATE_FACTOR = 16
"""A zstd header may inflate to at most this many times its stored bytes plus 1 MiB (and at most MAX_HEADER_BYTES):
a real header shrinks 4-10x (an MoE header of 18,432 near-identical entries: 15x), and parsing costs memory up to
~24x the msgpack bytes (two-character strings), so a small file must not make a reader build a large header. The
writer stores a header that shrinks more as plain msgpack."""

PREAMBLE = struct.Struct("<8sHHIQQIIQ16x")
"""magic, major, minor, flags, header_offset, header_length, header_crc32, alignment, file_length, 16 reserved bytes.

Byte offsets: magic 0, major 8, minor 10, flags 12, header_offset 16, header_length 24, header_crc32 32,
alignment 36, file_length 40, reserved 48..63. Little-endian throughout.
"""
PREAMBLE_SIZE = PREAMBLE.size  # 64
RESERVED_OFFSET = 48
"""The last 16 preamble bytes are reserved: written as zero, and a reader refuses a file where any is set."""

DEFAULT_ALIGNMENT = 4096
"""Payloads start at multiples of this: page-aligned for mmap, O_DIRECT and host registration."""
MIN_ALIGNMENT = 64
MAX_ALIGNMENT = 1 << 21
MIN_SMALL_ALIGNMENT = 16
"""The batched GPU decoder reads every payload at a 16-byte multiple (vector loads); no payload may start between."""
DEFAULT_SMALL_ALIGNMENT = 16
"""1.1 writers place payloads shorter than SMALL_PAYLOAD_LIMIT at multiples of this: on checkpoints of many small
tensors page padding would otherwise be a visible share of the file (MobileNetV2, 314 tensors: 17 % of it)."""
SMALL_PAYLOAD_LIMIT = 1 << 20
"""In a file with ``small_alignment``, payloads of at least this many stored bytes keep the file's alignment (page
alignment for mmap, O_DIRECT and registration where it matters); shorter ones take ``small_alignment``."""

MAX_HEADER_BYTES = 100 * 1024 * 1024
MAX_TENSORS = 1_000_000
MAX_NDIM = 32
MAX_NAME_BYTES = 4096
MAX_ELEMENTS = 1 << 56
"""Overflow-checked cap on the element count of one tensor, and on each dimension (shape products above it are
refused)."""
MAX_METADATA_ENTRIES = 100_000
MAX_HEADER_DEPTH = 16
"""Maps and arrays a header may nest, the top map counted: writers stay within it and readers accept it. A 1.0
header nests 6 deep (top map, ``tensors``, an entry, its ``encoding``, the ``configuration``, ``streams`` or
``codebook``); the margin is for what minor versions add (an at-rest stage under the encoding takes one more)."""
HEADER_BYTES_PER_CONTAINER = 16
"""A header may hold at most one msgpack map or array per this many bytes. A real tensor entry spends more than
25 bytes per container; the cap keeps a hostile header of empty containers from growing ~60x in memory."""

RESERVED_NAME = "__metadata__"
"""Not a valid tensor name: safetensors reserves it, so a .szt file must too for the inverse conversion to exist."""

ENCODINGS = (ENCODING_SPLITZIP, ENCODING_RAW)
"""Encodings a v1 reader knows; any other name in a tensor entry is refused."""

INDEX_SUFFIX = ".szt.index.json"
FILE_SUFFIX = ".szt"

ITEMSIZE: dict[str, int] = {
    "BOOL": 1, "U8": 1, "I8": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "F64": 8,
    "I64": 8, "U64": 8, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "F8_E4M3FNUZ": 1, "F8_E5M2FNUZ": 1, "C64": 8,
}
"""safetensors dtype name -> bytes per element: every dtype a .szt file may hold, in safetensors' order."""

_TORCH_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16", "F16": "float16",
    "BF16": "bfloat16", "I32": "int32", "U32": "uint32", "F32": "float32", "F64": "float64", "I64": "int64",
    "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2", "F8_E8M0": "float8_e8m0fnu",
    "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz", "C64": "complex64",
}
"""safetensors dtype name -> the torch attribute of the same dtype (wide unsigned and float8 ones are recent)."""


def __getattr__(name: str) -> Any:
    """``DTYPES`` and ``TORCH_TO_DTYPE``, built at first use: they hold torch dtypes, and reading a header must not
    import torch.

    ``DTYPES``: safetensors dtype name -> (torch dtype, or None where this torch lacks it; bytes per element).
    ``TORCH_TO_DTYPE``: torch dtype -> safetensors dtype name.
    """
    if name not in ("DTYPES", "TORCH_TO_DTYPE"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import torch

    dtypes = {key: (getattr(torch, _TORCH_NAMES[key], None), size) for key, size in ITEMSIZE.items()}
    globals().update(DTYPES=dtypes, TORCH_TO_DTYPE={dt: key for key, (dt, _) in dtypes.items() if dt is not None})
    return globals()[name]


def itemsize(dtype: str) -> int:
    """Bytes per element of a safetensors dtype name (KeyError for unknown names)."""
    return ITEMSIZE[dtype]


def header_inflate_limit(stored_length: int) -> int:
    """The most bytes a zstd-stored header of ``stored_length`` bytes may inflate to."""
    return min(MAX_HEADER_BYTES, HEADER_INFLATE_FACTOR * stored_length + (1 << 20))


def pad_to(offset: int, alignment: int) -> int:
    """``offset`` rounded up to a multiple of ``alignment``."""
    return -(-offset // alignment) * alignment
