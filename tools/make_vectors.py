"""Generate (or check) the golden vectors of the .szt format in ``spec/vectors/``.

Each case is a small ``.safetensors`` source, written byte for byte by this script from integer bit patterns of a
SplitMix64 generator (no floating point, no library random stream that could change between versions), and the
``.szt`` file szformat's writer makes from it: in the in-memory form (format 1.0), or for the ``at_rest`` cases in
the at-rest form (format 1.1: zstd frames, small payloads packed, header through zstd). ``SHA256SUMS`` and
``vectors.json`` record the expected hashes; ``vectors.json`` also lists each tensor's dtype, shape, encoding,
escape count and the SHA-256 of its raw bytes. Forged files follow: a case's ``.szt`` file edited (:class:`Parts`)
into one a reader must still read (``read_*.szt``) or must refuse (``refuse_*.szt``, with the stage, error class and
reason). A new case is one more entry of :func:`cases` or :func:`forged_cases`.

Usage:
    python tools/make_vectors.py            # (re)write spec/vectors/
    python tools/make_vectors.py --check    # regenerate in a temporary folder and compare; exit 1 on a difference
    python tools/make_vectors.py --out DIR  # write (or with --check, compare) another folder
"""

from __future__ import annotations

import argparse
import hashlib
import json
import struct
import sys
import tempfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import msgpack
import numpy as np
import zstandard

ROOT = Path(__file__).resolve().parents[1]

import torch  # noqa: E402

from szformat.api import load_file, safe_open  # noqa: E402
from szformat.checksum import crc32_join  # noqa: E402
from szformat.codec.layout import PayloadLayout  # noqa: E402
from szformat.errors import SzformatError  # noqa: E402
from szformat.format import at_rest as A  # noqa: E402
from szformat.format import constants as C  # noqa: E402
from szformat.format.reader import SztFile  # noqa: E402
from szformat.format.header import payload_alignment  # noqa: E402
from szformat.format.writer import SztWriter, tensor_bytes, write_tensor, writer_form  # noqa: E402  # noqa: E402

DEFAULT_OUT = ROOT / "spec" / "vectors"

# ---------------------------------------------------------------------------------------------------------------
# Deterministic bit patterns
# ---------------------------------------------------------------------------------------------------------------

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def splitmix64(seed: int, count: int) -> np.ndarray:
    """``count`` outputs of SplitMix64 started at ``seed`` (uint64): the same on every platform and version."""
    z = np.arange(1, count + 1, dtype=np.uint64) * _GOLDEN + np.uint64(seed)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def random_bytes(seed: int, count: int) -> bytes:
    return splitmix64(seed, -(-count // 8)).astype("<u8").tobytes()[:count]


def bf16_bits(seed: int, n: int, exponents: list[int], *, rare: tuple[int, ...] = (), rare_per_mille: int = 0,
              forced_rare: tuple[int, ...] = ()) -> bytes:
    """BF16 elements with random sign and mantissa and exponents drawn from ``exponents`` (repeats weigh more).

    About ``rare_per_mille`` elements per thousand, and those at ``forced_rare`` positions, take an exponent from
    ``rare`` instead: with 16 or more common exponents these are the escapes.
    """
    w = splitmix64(seed, n)
    table = np.array(exponents, dtype=np.uint64)
    exponent = table[(w >> np.uint64(8)) % np.uint64(len(exponents))]
    if rare:
        rare_table = np.array(rare, dtype=np.uint64)
        pick = rare_table[(w >> np.uint64(40)) % np.uint64(len(rare))]
        is_rare = (w >> np.uint64(24)) % np.uint64(1000) < np.uint64(rare_per_mille)
        is_rare[list(forced_rare)] = True
        exponent = np.where(is_rare, pick, exponent)
    return _bf16(w, exponent)


def round_robin_bf16(seed: int, n: int, exponents: list[int]) -> bytes:
    """BF16 elements whose exponents cycle through ``exponents``: equal counts, so the codebook tie rule decides."""
    return _bf16(splitmix64(seed, n), np.array(exponents, dtype=np.uint64)[np.arange(n) % len(exponents)])


def _bf16(w: np.ndarray, exponent: np.ndarray) -> bytes:
    """BF16 bytes with the given exponents, the sign from bit 0 of ``w`` and the mantissa from its bits 1..7."""
    bits = ((w & np.uint64(1)) << np.uint64(15)) | (exponent << np.uint64(7)) | ((w >> np.uint64(1)) & np.uint64(0x7F))
    return bits.astype("<u2").tobytes()


# ---------------------------------------------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------------------------------------------

WEIGHTS = [124] * 12 + [123] * 10 + [125] * 9 + [122] * 7 + [126] * 6 + [121] * 5 + [120] * 4 + [127] * 3 \
    + [119] * 2 + [118, 117, 116, 115, 128, 114, 129]
"""64 draws over 16 exponents with a bell-shaped weight, like a trained weight matrix's."""
ESCAPES = (0, 255, 1, 60, 200, 140)
"""Exponents outside the codebook: zero/subnormals, Inf/NaN (with payloads), tiny and huge values."""


@dataclass
class Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    raw: bytes


@dataclass
class Case:
    name: str
    description: str
    tensors: list[Tensor]
    metadata: dict[str, str] | None = None
    alignment: int = C.DEFAULT_ALIGNMENT
    expect: dict[str, str] = field(default_factory=dict)
    """tensor name -> expected encoding: checked when generating, so a case keeps covering what it says."""
    at_rest: int | None = None
    """zstd level of the at-rest form (format 1.1); ``None``: the in-memory form (1.0)."""
    frame_size: int = A.DEFAULT_FRAME_SIZE
    expect_streams: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """tensor name -> the streams its at-rest stage compresses (``()``: no stage; for byte planes, the transform),
    checked when generating."""
    block_size: int = C.BLOCK_CRC_SIZE
    """Stored bytes per block of the 1.3 block checksums (tensors with more stored bytes than one get a table)."""
    expect_blocks: dict[str, int] = field(default_factory=dict)
    """tensor name -> the number of blocks in its table (0: none), checked when generating."""


FLOAT_FIELDS = {"F32": (np.uint32, 23, 0xFF, (118, 119, 120, 121, 122, 123, 124, 125)),
                "F16": (np.uint16, 10, 0x1F, (8, 9, 10, 11, 12, 13, 14)),
                "F8_E4M3": (np.uint8, 3, 0xF, (2, 3, 4, 5, 6, 7))}
"""Element type, exponent shift and mask, and the exponents :func:`float_bits` draws, per float dtype: a spread like
trained weights' (a few adjacent binades), so the exponent plane shrinks and the mantissa planes stay verbatim."""


def float_bits(seed: int, dtype: str, n: int) -> bytes:
    """``n`` elements of ``dtype`` with random signs and mantissas and exponents drawn from ``FLOAT_FIELDS``."""
    kind, shift, mask, exponents = FLOAT_FIELDS[dtype]
    words = np.frombuffer(random_bytes(seed, n * np.dtype(kind).itemsize), kind).copy()
    picks = np.frombuffer(random_bytes(seed + 1, n), np.uint8) % len(exponents)
    exponent = np.asarray(exponents, kind)[picks]
    words = (words & kind(~(mask << shift) & np.iinfo(kind).max)) | (exponent << kind(shift)).astype(kind)
    return words.tobytes()


def _sized(seed: int, dtype: str, shape: tuple[int, ...]) -> bytes:
    count = int(np.prod(shape, dtype=np.int64)) * C.itemsize(dtype)
    data = random_bytes(seed, count)
    return bytes(b & 1 for b in data) if dtype == "BOOL" else data


def cases() -> list[Case]:
    n_big = 40 * 103
    return [
        Case("bf16_escapes", "BF16 with escapes: zeros, subnormals, Inf/NaN payloads, in several chunks, "
             "at the first and the last element",
             [Tensor("layers.0.weight", "BF16", (40, 103),
                     bf16_bits(1, n_big, WEIGHTS, rare=ESCAPES, rare_per_mille=5, forced_rare=(0, 1023, 1024,
                                                                                             n_big - 1))),
              Tensor("layers.0.bias", "BF16", (256,), bf16_bits(2, 256, WEIGHTS, rare=ESCAPES, rare_per_mille=8))],
             expect={"layers.0.weight": "splitzip", "layers.0.bias": "splitzip"}),
        Case("bf16_odd", "odd element counts: padding nibble, an escape as the last (odd) element, fewer than 16 "
             "exponents with equal counts (the tie rule orders the codebook), and a tensor too small to compress",
             [Tensor("odd", "BF16", (3, 341), round_robin_bf16(3, 1023, [130, 120, 125, 110, 127])),
              Tensor("odd_escapes", "BF16", (2049,), bf16_bits(4, 2049, WEIGHTS, rare=ESCAPES, rare_per_mille=3,
                                                              forced_rare=(2048,))),
              Tensor("single", "BF16", (1,), bf16_bits(5, 1, [127]))],
             expect={"odd": "splitzip", "odd_escapes": "splitzip", "single": "raw"}),
        Case("all_raw", "every tensor raw: BF16 noise (low coverage), F32, and BF16 whose payload is not smaller",
             [Tensor("noise", "BF16", (64, 32), random_bytes(6, 64 * 32 * 2)),
              Tensor("f32", "F32", (17, 5), random_bytes(7, 17 * 5 * 4)),
              Tensor("tiny", "BF16", (3,), bf16_bits(8, 3, [127, 126]))],
             expect={"noise": "raw", "f32": "raw", "tiny": "raw"}),
        Case("mixed_dtypes", "one tensor of every dtype; only the BF16 one is compressed (FP8 stays raw)",
             [Tensor(f"t.{dtype.lower()}", dtype, shape, _sized(100 + i, dtype, shape)) for i, (dtype, shape) in
              enumerate([("F32", (8, 3)), ("F16", (11,)), ("F8_E4M3", (16,)), ("F8_E5M2", (5,)), ("F8_E8M0", (4,)),
                         ("I64", (4,)), ("BOOL", (9,)), ("U8", (13,)), ("I8", (6,)), ("I16", (3,)), ("U16", (3,)),
                         ("I32", (7,)), ("U32", (2,)), ("U64", (2,)), ("F64", (2,)), ("C64", (3,))])]
             + [Tensor("t.bf16", "BF16", (33, 64), bf16_bits(9, 33 * 64, WEIGHTS, rare=ESCAPES, rare_per_mille=2))],
             expect={"t.f8_e4m3": "raw", "t.bf16": "splitzip"}),
        Case("empty_scalar", "scalars, empty tensors between payloads, and an empty __metadata__",
             [Tensor("scalar_bf16", "BF16", (), bf16_bits(10, 1, [127])),
              Tensor("empty_bf16", "BF16", (0,), b""),
              Tensor("scalar_f32", "F32", (), random_bytes(11, 4)),
              Tensor("empty_2d", "F32", (0, 7), b""),
              Tensor("empty_rows", "I64", (3, 0), b""),
              Tensor("after_empty", "BF16", (2, 600), bf16_bits(12, 1200, WEIGHTS)),
              Tensor("scalar_bool", "BOOL", (), b"\x01"),
              Tensor("empty_last", "U8", (0,), b"")],
             metadata={}, expect={"empty_bf16": "raw", "after_empty": "splitzip"}),
        Case("metadata", "source __metadata__ carried through unchanged, non-ASCII included",
             [Tensor("model.embed", "BF16", (16, 64), bf16_bits(13, 1024, WEIGHTS)),
              Tensor("model.norm", "F16", (4,), random_bytes(14, 8))],
             metadata={"format": "pt", "note": "ünïcödé ✓ 模型", "empty": ""}, expect={"model.embed": "splitzip"}),
        Case("alignment_64", "a non-default alignment of 64: payloads at multiples of 64",
             [Tensor("a", "BF16", (300,), bf16_bits(15, 300, WEIGHTS, rare=ESCAPES, rare_per_mille=10)),
              Tensor("b", "U8", (5,), random_bytes(16, 5)),
              Tensor("c", "BF16", (7, 77), bf16_bits(17, 539, WEIGHTS))],
             alignment=64, expect={"a": "splitzip", "c": "splitzip"}),
        Case("no_tensors", "the smallest legal file: no tensors, the header right after the preamble",
             [], metadata={"format": "pt"}),
        Case("at_rest_zstd", "1.1 at-rest form with the writer's defaults: pk as zstd frames, the escape streams too "
             "where they hold 4 KiB (a tensor under the in-memory coverage gate, over the at-rest one), a SplitZip "
             "payload too small for the stage, raw tensors, payloads packed at 16 bytes, the header through zstd",
             [Tensor("w", "BF16", (40, 103), bf16_bits(18, 4120, WEIGHTS, rare=ESCAPES, rare_per_mille=4)),
              Tensor("escapes", "BF16", (20000,), bf16_bits(19, 20000, WEIGHTS, rare=ESCAPES, rare_per_mille=40)),
              Tensor("small", "BF16", (24,), bf16_bits(20, 24, WEIGHTS)),
              Tensor("ids", "I64", (5,), random_bytes(21, 40)),
              Tensor("norm", "F32", (7,), random_bytes(22, 28))],
             metadata={"format": "pt"}, at_rest=A.DEFAULT_LEVEL,
             expect={"w": "splitzip", "escapes": "splitzip", "small": "splitzip", "ids": "raw", "norm": "raw"},
             expect_streams={"w": ("pk",), "escapes": ("pk", "chunk_id", "local_pos", "esc_val"), "small": ()}),
        Case("at_rest_frames", "1.1 at-rest form in frames of 4 KiB (the smallest size): pk in 6 frames, the last "
             "one shorter, and an odd element count",
             [Tensor("long", "BF16", (45001,), bf16_bits(23, 45001, WEIGHTS, rare=ESCAPES, rare_per_mille=1,
                                                          forced_rare=(45000,)))],
             at_rest=A.DEFAULT_LEVEL, frame_size=A.MIN_FRAME_SIZE, expect={"long": "splitzip"},
             expect_streams={"long": ("pk",)}),
        Case("at_rest_planes", "1.2 at-rest form of raw tensors as byte planes in frames of 4 KiB: FP32 and FP16 "
             "(transform sign_last: exponent plane through zstd, mantissa planes verbatim; the last frame shorter), "
             "FP8 E4M3 (one plane), small I32 (transform bytes: the zero high planes shrink), BF16 noise the "
             "SplitZip gate refused (stays raw: its planes do not shrink), a small F32 the stage does not pay for",
             [Tensor("f32", "F32", (2, 1100), float_bits(24, "F32", 2200)),
              Tensor("f16", "F16", (3001,), float_bits(26, "F16", 3001)),
              Tensor("f8", "F8_E4M3", (50, 100), float_bits(28, "F8_E4M3", 5000)),
              Tensor("ids", "I32", (1100,), np.frombuffer(random_bytes(30, 2200), np.uint16).astype(np.int32)
                     .tobytes()),
              Tensor("noise", "BF16", (16, 32), random_bytes(31, 16 * 32 * 2)),
              Tensor("norm", "F32", (16,), float_bits(32, "F32", 16))],
             at_rest=A.DEFAULT_LEVEL, frame_size=A.MIN_FRAME_SIZE,
             expect={"f32": "raw", "f16": "raw", "f8": "raw", "ids": "raw", "noise": "raw", "norm": "raw"},
             expect_streams={"f32": ("sign_last",), "f16": ("sign_last",), "f8": ("bytes",), "ids": ("bytes",),
                             "noise": (), "norm": ()}),
        Case("block_crc32", "1.3 block checksums in blocks of 4 KiB (the smallest size): a SplitZip payload of "
             "3 blocks (the last one shorter), a raw F32 tensor of 4 blocks, a payload of exactly one block (no "
             "table: a table is for payloads longer than a block)",
             [Tensor("w", "BF16", (48, 128), bf16_bits(33, 6144, WEIGHTS, rare=ESCAPES, rare_per_mille=2)),
              Tensor("f32", "F32", (3200,), float_bits(34, "F32", 3200)),
              Tensor("one", "U8", (4096,), random_bytes(35, 4096))],
             block_size=C.MIN_BLOCK_CRC_SIZE, expect={"w": "splitzip", "f32": "raw", "one": "raw"},
             expect_blocks={"w": 3, "f32": 4, "one": 0}),
        Case("at_rest_zeros", "1.1 at-rest form of an all-zero BF16 tensor: its pk frame shrinks about 180x, and "
             "the payload stays within the 8x expansion bound because sm is stored verbatim",
             [Tensor("zeros", "BF16", (64, 128), bytes(2 * 64 * 128))],
             at_rest=A.DEFAULT_LEVEL, expect={"zeros": "splitzip"}, expect_streams={"zeros": ("pk",)}),
    ]


# ---------------------------------------------------------------------------------------------------------------
# safetensors, written and read by hand (the library's writer output differs between its versions)
# ---------------------------------------------------------------------------------------------------------------


def write_safetensors(path: Path, tensors: list[Tensor], metadata: dict[str, str] | None) -> None:
    """A safetensors file: ``__metadata__`` first, tensors in list order, header padded with spaces to 8 bytes."""
    header: dict = {} if metadata is None else {"__metadata__": metadata}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(t.raw)]}
        offset += len(t.raw)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"".join(t.raw for t in tensors))


def read_safetensors(path: Path) -> tuple[list[Tensor], dict[str, str] | None]:
    """Tensors of a safetensors file in data order, and its ``__metadata__``."""
    data = path.read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8: 8 + size])
    metadata = header.pop("__metadata__", None)
    body = data[8 + size:]
    entries = sorted(header.items(), key=lambda item: item[1]["data_offsets"][0])
    tensors = [Tensor(name, e["dtype"], tuple(e["shape"]), body[e["data_offsets"][0]: e["data_offsets"][1]])
               for name, e in entries]
    return tensors, metadata


def convert(source: Path, target: Path, *, alignment: int = C.DEFAULT_ALIGNMENT, at_rest: int | None = None,
            frame_size: int = A.DEFAULT_FRAME_SIZE, block_size: int = C.BLOCK_CRC_SIZE) -> None:
    """The .szt file of a safetensors file: its tensors in data order, each through szformat's encoder and gate,
    in the in-memory form, or in the at-rest form at zstd level ``at_rest`` in frames of ``frame_size``; block
    checksums (1.3) of ``block_size`` bytes."""
    tensors, metadata = read_safetensors(source)
    with SztWriter(target, metadata=metadata, alignment=alignment, frame_size=frame_size, block_size=block_size,
                   **writer_form(at_rest)) as writer:
        for t in tensors:
            raw = torch.frombuffer(bytearray(t.raw), dtype=torch.uint8) if t.raw else torch.empty(0, dtype=torch.uint8)
            write_tensor(writer, t.name, t.dtype, t.shape, raw)


# ---------------------------------------------------------------------------------------------------------------
# Forged files: made by editing a generated file, for what no writer of this version makes
# ---------------------------------------------------------------------------------------------------------------

STAGES = ("open", "decode", "verify")
"""When a reader must refuse a file, at the latest: ``open`` (the preamble and header checks, before any tensor is
handed out), ``decode`` (the escape-stream checks, when the tensor is decoded, CRC checks on or off), ``verify``
(the CRC-32 checks of stored and decoded bytes)."""


@dataclass(frozen=True)
class Refusal:
    """Why a reader must refuse a forged file: szformat's error class, the stage, a fragment of its message."""

    error: str
    stage: str
    reason: str


PREAMBLE_FIELDS = ("magic", "major", "minor", "flags", "header_offset", "header_length", "header_crc32", "alignment",
                   "file_length")
"""The preamble's fields in :data:`szformat.format.constants.PREAMBLE` order (its 16 reserved bytes aside)."""


@dataclass
class Parts:
    """A .szt file taken apart: preamble fields, the bytes before the header, and the header object.

    :meth:`to_bytes` puts it back together with the header packed again and ``header_length``, ``header_crc32`` and
    ``file_length`` recomputed; ``preamble`` overrides any field after that, ``header_bytes`` replaces the packed
    header, ``trailing`` is appended.
    """

    body: bytearray
    header: dict
    fields: dict[str, Any]
    preamble: dict[str, Any] = field(default_factory=dict)
    header_bytes: bytes | None = None
    trailing: bytes = b""

    @classmethod
    def of(cls, data: bytes) -> "Parts":
        fields = dict(zip(PREAMBLE_FIELDS, C.PREAMBLE.unpack(data[: C.PREAMBLE_SIZE])))
        end = fields["header_offset"]
        header = data[end:]
        if fields["flags"] & C.FLAG_HEADER_ZSTD:  # a 1.1 header stored through zstd: packed the same way again
            header = zstandard.ZstdDecompressor().decompress(header)
        return cls(bytearray(data[:end]), msgpack.unpackb(header), fields)

    def entry(self, name: str) -> dict:
        return next(e for e in self.header["tensors"] if e["name"] == name)

    def config(self, name: str) -> dict:
        return self.entry(name)["encoding"]["configuration"]

    def patch(self, name: str, at: int, new: bytes, *, fix_crc: bool = True) -> None:
        """Overwrite payload bytes of tensor ``name`` from ``at``; recompute its stored-bytes CRC unless told not to."""
        e = self.entry(name)
        start = e["offset"] + at
        self.body[start: start + len(new)] = new
        if fix_crc:
            e["crc32"] = zlib.crc32(self.body[e["offset"]: e["offset"] + e["length"]])

    def read(self, name: str, at: int, fmt: str) -> tuple:
        return struct.unpack_from(fmt, self.body, self.entry(name)["offset"] + at)

    def to_bytes(self) -> bytes:
        header = msgpack.packb(self.header) if self.header_bytes is None else self.header_bytes
        if self.header_bytes is None and self.fields["flags"] & C.FLAG_HEADER_ZSTD:
            header = A.compress_frame(header)
        fields = {**self.fields, "header_offset": len(self.body), "header_length": len(header),
                  "header_crc32": zlib.crc32(header), "file_length": len(self.body) + len(header), **self.preamble}
        reserved = fields.pop("reserved", bytes(C.PREAMBLE_SIZE - C.RESERVED_OFFSET))
        preamble = C.PREAMBLE.pack(*(fields[k] for k in PREAMBLE_FIELDS))[: C.RESERVED_OFFSET] + reserved
        return preamble + bytes(self.body[C.PREAMBLE_SIZE:]) + header + self.trailing


@dataclass
class Forged:
    """A file made from case ``base``'s .szt file by ``edit``: a reader must decode it to ``base``'s tensors and
    metadata, or, with a ``refusal``, refuse it."""

    name: str
    description: str
    base: str
    edit: Callable[[Parts], None]
    refusal: Refusal | None = None

    @property
    def file(self) -> str:
        return f"{'refuse' if self.refusal else 'read'}_{self.name}.szt"


def _set(**values: Any) -> Callable[[Parts], None]:
    """An edit that sets preamble fields (and ``reserved``, the 16 reserved bytes)."""
    return lambda parts: parts.preamble.update(values)


def _entry(tensor: str, **values: Any) -> Callable[[Parts], None]:
    """An edit that sets keys of the entry of ``tensor``."""
    return lambda parts: parts.entry(tensor).update(values)


def _config(tensor: str, **values: Any) -> Callable[[Parts], None]:
    """An edit that sets keys of the encoding configuration of ``tensor``."""
    return lambda parts: parts.config(tensor).update(values)


def _top(**values: Any) -> Callable[[Parts], None]:
    """An edit that sets top-level header keys."""
    return lambda parts: parts.header.update(values)


def _nested(depth: int) -> Any:
    """A value that is ``depth`` maps and arrays deep, taking turns."""
    value: Any = "leaf"
    for level in range(depth):
        value = {"next": value} if level % 2 else [value]
    return value


def _unknown_keys(parts: Parts) -> None:
    """Keys no reader of 1.0 knows, in every map that may hold them, one of them as deep as a header may nest."""
    parts.header["added_later"] = {"note": "ignored"}
    a = parts.entry("a")
    a["added_later"] = [1, 2.5, None, True, b"bytes"]
    a["encoding"]["added_later"] = _nested(C.MAX_HEADER_DEPTH - 4)  # top, tensors, entry, encoding: 16 in all
    a["encoding"]["configuration"]["added_later"] = {"level": 3}
    parts.config("b")["added_later"] = "ignored"


def _omitted_configuration(parts: Parts) -> None:
    del parts.entry("noise")["encoding"]["configuration"]
    parts.config("f32").clear()


def _not_canonical(parts: Parts) -> None:
    """Break the writer-only payload rules: padding bytes and the padding nibble set, escaped elements' nibbles set.

    None of them changes the decoded tensor; the stored-bytes CRC is recomputed.
    """
    c = parts.config("odd_escapes")
    n, n_esc, s = c["n"], c["n_esc"], c["streams"]
    for start, stop in (((n + 1) // 2, s["sm"]), (s["sm"] + n, s["chunk_id"]), (s["local_pos"] + 2 * n_esc,
                                                                                   s["esc_val"])):
        parts.patch("odd_escapes", start, b"\xa5" * (stop - start))
    for j in range(n_esc):
        (chunk,), (local,) = parts.read("odd_escapes", s["chunk_id"] + 4 * j, "<i"), \
            parts.read("odd_escapes", s["local_pos"] + 2 * j, "<H")
        p = chunk * 1024 + local
        (byte,) = parts.read("odd_escapes", p // 2, "B")
        parts.patch("odd_escapes", p // 2, bytes([byte | (0x0F if p % 2 else 0xF0)]))
    (last,) = parts.read("odd_escapes", n // 2, "B")
    parts.patch("odd_escapes", n // 2, bytes([last | 0x0F]))  # n is odd: the low nibble is padding


def _escapes(parts: Parts, name: str) -> tuple[dict, list[int], list[int]]:
    s, n_esc = parts.config(name)["streams"], parts.config(name)["n_esc"]
    return s, list(parts.read(name, s["chunk_id"], f"<{n_esc}i")), list(parts.read(name, s["local_pos"],
                                                                                    f"<{n_esc}H"))


def _escape_edit(change: Callable[[list[int], list[int]], None]) -> Callable[[Parts], None]:
    """An edit of tensor ``a``'s escape positions (chunk ids, local positions), its stored-bytes CRC recomputed."""
    def edit(parts: Parts) -> None:
        s, chunk, local = _escapes(parts, "a")
        change(chunk, local)
        parts.patch("a", s["chunk_id"], struct.pack(f"<{len(chunk)}i", *chunk))
        parts.patch("a", s["local_pos"], struct.pack(f"<{len(local)}H", *local))
    return edit


def _swap_escapes(chunk: list[int], local: list[int]) -> None:
    chunk[0], chunk[1], local[0], local[1] = chunk[1], chunk[0], local[1], local[0]


def _repeated_key(parts: Parts) -> None:
    """Tensor ``b``'s entry holds ``dtype`` twice (msgpack allows it; the format does not)."""
    entries = [msgpack.packb(e) for e in parts.header["tensors"]]
    b = parts.entry("b")
    pairs = [*b.items(), ("dtype", b["dtype"])]
    entries[1] = bytes([0x80 | len(pairs)]) + b"".join(msgpack.packb(k) + msgpack.packb(v) for k, v in pairs)
    parts.header_bytes = b"\x81" + msgpack.packb("tensors") + bytes([0x90 | len(entries)]) + b"".join(entries)


def _too_many_elements(parts: Parts) -> None:
    n = PayloadLayout.max_elements() + 1
    _entry("c", shape=[n], raw_length=2 * n)(parts)
    _config("c", n=n)(parts)


def _truncated(parts: Parts) -> None:
    """The preamble announces a header one byte longer than the file holds."""
    header_length = len(msgpack.packb(parts.header)) + 1
    parts.preamble.update(header_length=header_length, file_length=len(parts.body) + header_length)


def _hole(parts: Parts) -> None:
    """Tensor ``c`` one alignment unit later than the placement rule puts it, with the bytes moved along."""
    c = parts.entry("c")
    payload = bytes(parts.body[c["offset"]:])
    del parts.body[c["offset"]:]
    parts.body += bytes(parts.fields["alignment"]) + payload
    c["offset"] += parts.fields["alignment"]


def _flip_stored_byte(parts: Parts) -> None:
    (byte,) = parts.read("c", parts.config("c")["streams"]["sm"], "B")
    parts.patch("c", parts.config("c")["streams"]["sm"], bytes([byte ^ 0x80]), fix_crc=False)


def _at_rest(parts: Parts, tensor: str) -> dict:
    """The ``at_rest`` map of ``tensor``'s encoding."""
    return parts.entry(tensor)["encoding"]["at_rest"]


def _frame_at(parts: Parts, tensor: str, index: int) -> tuple[int, int]:
    """Where frame ``index`` of ``tensor``'s stage starts in its stored bytes, and its length (the frames of this
    generator's cases start the stored bytes: ``pk`` is listed first)."""
    frames = _at_rest(parts, tensor)["configuration"]["frames"]
    return sum(frames[:index]), frames[index]


def _at_rest_unknown_keys(parts: Parts) -> None:
    """Keys no 1.1 reader knows, in an at-rest map and its configuration."""
    stage = _at_rest(parts, "escapes")
    stage["added_later"] = {"note": "ignored"}
    stage["configuration"]["added_later"] = [1, None]


def _planes_unknown_keys(parts: Parts) -> None:
    """Keys no 1.2 reader knows in a byte-plane stage and its configuration; ``level`` (informational) dropped."""
    stage = _at_rest(parts, "f16")
    stage["added_later"] = {"note": "ignored"}
    stage["configuration"]["added_later"] = [1, None]
    del stage["configuration"]["level"]


def _move_a_frame_byte(parts: Parts) -> None:
    """One byte of frame 0 counted in frame 1: every sum still right, each frame ending early or running on."""
    frames = _at_rest(parts, "escapes")["configuration"]["frames"]
    frames[0] -= 1
    frames[1] += 1


def _corrupt_frame(parts: Parts) -> None:
    """A byte in the middle of a frame changed, the stored CRC-32 recomputed: zstd's checksum must catch it."""
    start, length = _frame_at(parts, "escapes", 0)
    (byte,) = parts.read("escapes", start + length // 2, "B")
    parts.patch("escapes", start + length // 2, bytes([byte ^ 0x5A]))


def _frame_bomb(parts: Parts) -> None:
    """Frame 0 replaced by a frame (padded to the same length) that declares 64 MiB of zeros."""
    start, length = _frame_at(parts, "escapes", 0)
    bomb = A.compress_frame(bytes(64 << 20), level=19)
    assert len(bomb) <= length
    parts.patch("escapes", start, bomb + bytes(length - len(bomb)))


def restage_zeros(parts: Parts, name: str, numel: int, streams: tuple[str, ...],
                  frame_size: int = A.DEFAULT_FRAME_SIZE) -> None:
    """Make ``name``, an all-zero BF16 tensor stored at rest and the last payload of the file, an all-zero tensor of
    ``numel`` elements whose ``streams`` are zstd frames of ``frame_size`` (the others verbatim), every checksum
    right. With ``sm`` among them a few bytes can stand for gigabytes: a decompression bomb for the readers."""
    e = parts.entry(name)
    layout = PayloadLayout(n=numel, n_esc=0)
    full = A.compress_frame(bytes(frame_size))
    pieces: list[bytes] = []
    frames: list[int] = []
    for stream, start, stop in A.stream_extents(layout):
        if stream not in streams:
            pieces.append(bytes(stop - start))
            continue
        for memory in range(start, stop, frame_size):
            size = min(frame_size, stop - memory)
            pieces.append(full if size == frame_size else A.compress_frame(bytes(size)))
            frames.append(len(pieces[-1]))
    stored = b"".join(pieces)
    cursor = max([C.PREAMBLE_SIZE] + [t["offset"] + t["length"] for t in parts.header["tensors"] if t is not e])
    offset = C.pad_to(cursor, payload_alignment(len(stored), parts.fields["alignment"],
                                                parts.header.get("small_alignment")))
    del parts.body[cursor:]
    parts.body += bytes(offset - cursor) + stored
    e["offset"] = offset
    mib = zlib.crc32(bytes(1 << 20))
    raw_crc = crc32_join([(mib, 1 << 20)] * (2 * numel >> 20) + [(zlib.crc32(bytes(2 * numel % (1 << 20))),
                                                                 2 * numel % (1 << 20))])
    e.update(shape=[numel], raw_length=2 * numel, length=len(stored), crc32=zlib.crc32(stored), raw_crc32=raw_crc)
    e["encoding"]["configuration"].update(n=numel, streams=layout.stream_offsets())
    e["encoding"]["at_rest"]["configuration"].update(streams=list(streams), frame_size=frame_size, frames=frames)


def _plane_at(parts: Parts, tensor: str, index: int) -> tuple[int, int]:
    """Where plane ``index`` (counted over all frames) of ``tensor``'s byte planes starts in its stored bytes, and
    its stored length."""
    planes = _at_rest(parts, tensor)["configuration"]["planes"]
    return sum(planes[:index]), planes[index]


def _compressed_plane(parts: Parts, tensor: str) -> int:
    """The index of the first plane of ``tensor`` stored as a zstd frame (shorter than its in-memory bytes)."""
    config = _at_rest(parts, tensor)["configuration"]
    itemsize = C.itemsize(parts.entry(tensor)["dtype"])
    plane = config["frame_size"] // itemsize
    return next(i for i, length in enumerate(config["planes"]) if length < plane)


def _longer_plane(parts: Parts) -> None:
    """f32's first verbatim plane counted one byte longer than it is, the plane after it one shorter."""
    config = _at_rest(parts, "f32")["configuration"]
    plane = config["frame_size"] // 4
    index = next(i for i, length in enumerate(config["planes"]) if length == plane)
    config["planes"][index] += 1
    config["planes"][index + 1] -= 1


def _corrupt_plane(parts: Parts) -> None:
    """A byte in the middle of f32's first compressed plane changed, the stored CRC-32 recomputed."""
    start, length = _plane_at(parts, "f32", _compressed_plane(parts, "f32"))
    (byte,) = parts.read("f32", start + length // 2, "B")
    parts.patch("f32", start + length // 2, bytes([byte ^ 0x5A]))


def _swap_verbatim_plane(parts: Parts) -> None:
    """Two bytes of f32's first verbatim plane swapped, the stored CRC-32 recomputed: no zstd checksum covers a
    verbatim plane, so only the decoded bytes' CRC-32 can catch it."""
    config = _at_rest(parts, "f32")["configuration"]
    plane = config["frame_size"] // 4
    start, _ = _plane_at(parts, "f32", next(i for i, length in enumerate(config["planes"]) if length == plane))
    a, b = parts.read("f32", start, "BB")
    assert a != b
    parts.patch("f32", start, bytes([b, a]))


def _expansion_bomb(parts: Parts) -> None:
    """``zeros`` restaged with ``sm`` compressed too: its payload becomes over 200 times its stored bytes."""
    restage_zeros(parts, "zeros", 64 * 128, ("pk", "sm"))


def forged_cases() -> list[Forged]:
    """Files a reader must read although this writer never makes them, then files it must refuse (one broken rule
    each; every checksum but the one a case is about recomputed, so each file reaches the check it targets)."""
    reads = [
        Forged("minor_version", "a later minor version (1.9): any minor of a known major is read", "alignment_64",
               _set(minor=9)),
        Forged("unknown_keys", "keys a 1.0 reader does not know, in the top map, an entry, an encoding and both "
               "kinds of configuration, one of them nested as deep as a header may (16 levels)", "alignment_64",
               _unknown_keys),
        Forged("omitted_configuration", "raw tensors whose configuration is omitted, or an empty map", "all_raw",
               _omitted_configuration),
        Forged("payload_not_canonical", "a payload that breaks the writer-only rules (padding bytes and the padding "
               "nibble set, escaped elements' nibbles set): decoding does not read them", "bf16_odd",
               _not_canonical),
        Forged("at_rest_unknown_keys", "1.1: keys no reader knows in an at-rest map and its configuration",
               "at_rest_zstd", _at_rest_unknown_keys),
        Forged("planes_unknown_keys", "1.2: keys no reader knows in a byte-plane stage and its configuration, and "
               "the writer's informational level left out", "at_rest_planes", _planes_unknown_keys),
    ]
    r = Refusal
    refusals = [
        Forged("bad_magic", "the magic's fourth byte changed", "alignment_64", _set(magic=b"\x89SZX\r\n\x1a\n"),
               r("FormatError", "open", "bad magic")),
        Forged("major_2", "major version 2", "alignment_64", _set(major=2), r("UnsupportedVersionError", "open",
                                                                             "format version 2.0")),
        Forged("flags", "a preamble flag no version defines (bit 1; 1.1 defines bit 0, the header through zstd)",
               "alignment_64", _set(flags=2), r("UnsupportedVersionError", "open", "flags 0x2")),
        Forged("reserved", "a reserved preamble byte set", "alignment_64", _set(reserved=bytes(15) + b"\x01"),
               r("UnsupportedVersionError", "open", "reserved preamble bytes")),
        Forged("header_too_large", "header_length past 100 MiB", "alignment_64",
               _set(header_length=C.MAX_HEADER_BYTES + 1), r("HeaderTooLargeError", "open", "exceeds the limit")),
        Forged("alignment", "alignment 100, not a power of two", "alignment_64", _set(alignment=100),
               r("FormatError", "open", "alignment 100")),
        Forged("truncated", "the file one byte shorter than its preamble announces", "alignment_64", _truncated,
               r("TruncatedFileError", "open", "the preamble announces")),
        Forged("trailing_bytes", "a byte after the header", "alignment_64", lambda parts: setattr(parts, "trailing",
                                                                                                 b"\x00"),
               r("InvalidOffsetError", "open", "unexplained bytes")),
        Forged("header_crc", "header_crc32 off by one bit", "alignment_64",
               lambda parts: parts.preamble.update(header_crc32=zlib.crc32(msgpack.packb(parts.header)) ^ 1),
               r("ChecksumMismatchError", "open", "header checksum mismatch")),
        Forged("header_extra_bytes", "a nil after the header's one msgpack object", "alignment_64",
               lambda parts: setattr(parts, "header_bytes", msgpack.packb(parts.header) + b"\xc0"),
               r("HeaderError", "open", "ExtraData")),
        Forged("repeated_key", "an entry holding the key dtype twice", "alignment_64", _repeated_key,
               r("HeaderError", "open", "holds the key 'dtype' twice")),
        Forged("metadata_nil", "metadata present as nil (a file without metadata leaves the key out)",
               "alignment_64", _top(metadata=None), r("HeaderError", "open", "metadata is nil")),
        Forged("metadata_not_strings", "a metadata value that is an integer", "metadata",
               lambda parts: parts.header["metadata"].update(format=1),
               r("HeaderError", "open", "map of strings to strings")),
        Forged("required_feature", "a required feature no reader implements", "alignment_64",
               _top(required_features=["example-unknown-feature"]),
               r("UnsupportedVersionError", "open", "example-unknown-feature")),
        Forged("unknown_encoding", "an encoding name no reader knows", "alignment_64",
               lambda parts: parts.entry("b")["encoding"].update(name="example-unknown-encoding"),
               r("UnknownEncodingError", "open", "example-unknown-encoding")),
        Forged("configuration_nil", "an encoding whose configuration is nil", "alignment_64",
               lambda parts: parts.entry("b")["encoding"].update(configuration=None),
               r("HeaderError", "open", "'configuration' must be a map")),
        Forged("reason_nil", "a raw configuration whose reason is nil", "alignment_64", _config("b", reason=None),
               r("HeaderError", "open", "'reason' must be a string")),
        Forged("name_bin", "a tensor name stored as msgpack bin, not str", "alignment_64", _entry("b", name=b"b"),
               r("HeaderError", "open", "non-empty string")),
        Forged("key_bin", "an entry holding the key dtype also as msgpack bin", "alignment_64",
               lambda parts: parts.entry("b").update({b"dtype": "U8"}),
               r("HeaderError", "open", "not a string (msgpack str)")),
        Forged("feature_repeated", "required_features listing one feature twice", "at_rest_zstd",
               lambda parts: parts.header.update(required_features=parts.header["required_features"] * 2),
               r("HeaderError", "open", "twice")),
        Forged("nesting_17", "an unknown key whose value nests 17 levels, the top map counted", "alignment_64",
               _top(example_unknown_key=_nested(C.MAX_HEADER_DEPTH)),
               r("HeaderError", "open", "deeper than 16 levels")),
        Forged("name_reserved", "a tensor named __metadata__", "alignment_64", _entry("b", name="__metadata__"),
               r("HeaderError", "open", "is reserved")),
        Forged("name_repeated", "two tensors named a", "alignment_64", _entry("c", name="a"),
               r("HeaderError", "open", "appears twice")),
        Forged("unknown_dtype", "dtype F4", "alignment_64", _entry("b", dtype="F4"),
               r("HeaderError", "open", "unknown dtype 'F4'")),
        Forged("bool_as_integer", "a length written as true", "alignment_64", _entry("b", length=True),
               r("HeaderError", "open", "'length' must be an integer")),
        Forged("raw_length", "raw_length that does not match the shape", "alignment_64", _entry("b", raw_length=6),
               r("HeaderError", "open", "does not match shape")),
        Forged("raw_two_checksums", "a raw tensor whose crc32 and raw_crc32 differ", "alignment_64",
               lambda parts: parts.entry("b").update(raw_crc32=parts.entry("b")["crc32"] ^ 1),
               r("HeaderError", "open", "two different checksums")),
        Forged("hole", "a payload one alignment unit past where the placement rule puts it", "alignment_64", _hole,
               r("InvalidOffsetError", "open", "placement rule")),
        Forged("splitzip_not_bf16", "a splitzip tensor of dtype F16", "alignment_64", _entry("c", dtype="F16"),
               r("HeaderError", "open", "BF16 only")),
        Forged("chunk_size", "chunk size 2048", "alignment_64", _config("c", chunk_size=2048),
               r("UnsupportedVersionError", "open", "chunk size 2048")),
        Forged("too_many_elements", "a splitzip tensor of 2^41 + 1 elements: chunk ids would not fit an int32",
               "alignment_64", _too_many_elements, r("HeaderError", "open", "fit an int32")),
        Forged("length", "a splitzip length that is not the layout's", "alignment_64",
               lambda parts: parts.entry("c").update(length=parts.entry("c")["length"] + 4),
               r("HeaderError", "open", "differs from the")),
        Forged("streams", "a sixth key in streams", "alignment_64",
               lambda parts: parts.config("c")["streams"].update(extra=0),
               r("HeaderError", "open", "stream offsets")),
        Forged("codebook_tail", "a codebook entry past n_codes_used that is not 0", "bf16_odd",
               lambda parts: parts.config("odd")["codebook"].__setitem__(15, 1),
               r("HeaderError", "open", "past n_codes_used")),
        Forged("escape_chunk_id", "an escape chunk id past the last chunk", "alignment_64",
               _escape_edit(lambda chunk, local: chunk.__setitem__(1, 1)),
               r("PayloadError", "decode", "chunk id out of range")),
        Forged("escape_local_pos", "an escape local position of 1024", "alignment_64",
               _escape_edit(lambda chunk, local: local.__setitem__(1, 1024)),
               r("PayloadError", "decode", "outside its chunk")),
        Forged("escape_past_n", "an escape at element n", "alignment_64",
               _escape_edit(lambda chunk, local: local.__setitem__(1, 300)),
               r("PayloadError", "decode", "past the tensor's 300 elements")),
        Forged("escape_order", "two escapes out of order", "alignment_64", _escape_edit(_swap_escapes),
               r("PayloadError", "decode", "not strictly ascending")),
        Forged("stored_crc", "a flipped payload bit, crc32 left as it was", "alignment_64", _flip_stored_byte,
               r("ChecksumMismatchError", "verify", "CRC-32 of the stored bytes")),
        Forged("raw_crc", "raw_crc32 off by one bit (refused where the decoded bytes are checked, as a reader SHOULD)",
               "alignment_64",
               lambda parts: parts.entry("c").update(raw_crc32=parts.entry("c")["raw_crc32"] ^ 1),
               r("ChecksumMismatchError", "verify", "CRC-32 of the decoded bytes")),
        Forged("at_rest_codec", "1.1: an at-rest codec no reader knows", "at_rest_zstd",
               lambda parts: _at_rest(parts, "w").update(name="example-unknown-codec"),
               r("UnknownEncodingError", "open", "example-unknown-codec")),
        Forged("at_rest_feature", "1.1: an at-rest stage in a file that does not require at_rest_zstd",
               "at_rest_zstd", _top(required_features=[C.FEATURE_SMALL_ALIGNMENT]),
               r("HeaderError", "open", "not among the required features")),
        Forged("at_rest_frame_count", "1.1: a frame list one frame short", "at_rest_zstd",
               lambda parts: _at_rest(parts, "escapes")["configuration"]["frames"].pop(),
               r("HeaderError", "open", "lists 3 frames")),
        Forged("at_rest_frame_lengths", "1.1: frame lengths that lie about where frames end (their sum right)",
               "at_rest_zstd", _move_a_frame_byte, r("PayloadError", "decode", "zstd frame")),
        Forged("at_rest_frame_corrupt", "1.1: a corrupt zstd frame whose stored CRC-32 is right", "at_rest_zstd",
               _corrupt_frame, r("PayloadError", "decode", "zstd frame is corrupt")),
        Forged("at_rest_bomb", "1.1: a frame that declares 64 MiB where the layout gives it 10 kB", "at_rest_zstd",
               _frame_bomb, r("PayloadError", "decode", "declares 67108864 bytes")),
        Forged("at_rest_expansion", "1.1: an all-zero tensor whose pk and sm are both zstd frames: 46 stored bytes "
               "for a 12,288-byte payload, past the 8x bound", "at_rest_zeros", _expansion_bomb,
               r("HeaderError", "open", "decompression bomb")),
        Forged("planes_feature", "1.2: byte planes in a file that does not require at_rest_planes", "at_rest_planes",
               _top(required_features=[C.FEATURE_SMALL_ALIGNMENT]),
               r("HeaderError", "open", "'at_rest_planes' is not among the required features")),
        Forged("planes_codec_on_splitzip", "1.2: the byte-plane stage named on a splitzip tensor", "at_rest_zstd",
               lambda parts: _at_rest(parts, "w").update(name=A.AT_REST_PLANES),
               r("HeaderError", "open", "does not apply to a splitzip payload")),
        Forged("planes_count", "1.2: a plane list one plane short", "at_rest_planes",
               lambda parts: _at_rest(parts, "f32")["configuration"]["planes"].pop(),
               r("HeaderError", "open", "'planes' must list")),
        Forged("planes_transform", "1.2: a transform no reader knows", "at_rest_planes",
               lambda parts: _at_rest(parts, "f16")["configuration"].update(transform="example-unknown"),
               r("HeaderError", "open", "'transform' must be one of")),
        Forged("planes_too_long", "1.2: a plane stored in more bytes than it has (the next one shorter, the sum "
               "right)", "at_rest_planes", _longer_plane, r("HeaderError", "open", "between 1 and")),
        Forged("planes_corrupt", "1.2: a corrupt zstd frame of a plane whose stored CRC-32 is right",
               "at_rest_planes", _corrupt_plane, r("PayloadError", "decode", "zstd frame is corrupt")),
        Forged("planes_verbatim_swap", "1.2: two bytes of a verbatim plane swapped, the stored CRC-32 right "
               "(refused where the decoded bytes are checked)", "at_rest_planes", _swap_verbatim_plane,
               r("ChecksumMismatchError", "verify", "CRC-32 of the decoded bytes")),
        Forged("header_bomb", "1.1: a header through zstd that declares 64 MiB (past 16 times its size + 1 MiB)",
               "at_rest_zstd", lambda parts: setattr(parts, "header_bytes", A.compress_frame(bytes(64 << 20), 19)),
               r("HeaderError", "open", "more than the limit")),
        Forged("small_alignment", "1.1: small_alignment 8, under the 16 the batched decoder needs", "at_rest_zstd",
               _top(small_alignment=8), r("HeaderError", "open", "'small_alignment' must be")),
        Forged("block_crc32_count", "1.3: a block-checksum table one block short", "block_crc32",
               lambda parts: parts.entry("w")["block_crc32"]["crc32"].pop(),
               r("HeaderError", "open", "block_crc32 must list 3 CRC-32s")),
        Forged("block_crc32_size", "1.3: a block size that is no power of two", "block_crc32",
               lambda parts: parts.entry("f32")["block_crc32"].update(size=5000),
               r("HeaderError", "open", "block_crc32 size must be a power of two")),
    ]
    return reads + refusals


def observed_refusal(path: Path) -> tuple[str, SzformatError] | None:
    """The stage at which szformat's reader refuses a file and its error; None when it reads every tensor."""
    try:
        with SztFile(path):
            pass
    except SzformatError as e:
        return "open", e
    for stage, verify in (("decode", False), ("verify", True)):
        try:
            load_file(path, verify=verify)
        except SzformatError as e:
            return stage, e
    return None


# ---------------------------------------------------------------------------------------------------------------
# Generating and checking
# ---------------------------------------------------------------------------------------------------------------


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def generate(out: Path) -> None:
    """Write every case, every forged file, ``vectors.json`` and ``SHA256SUMS`` into ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    listing, files = [], [out / "vectors.json"]
    written = {}
    for case in cases():
        source, target = out / f"{case.name}.safetensors", out / f"{case.name}.szt"
        write_safetensors(source, case.tensors, case.metadata)
        convert(source, target, alignment=case.alignment, at_rest=case.at_rest, frame_size=case.frame_size,
                block_size=case.block_size)
        listing.append(_describe(case, source, target))
        files += [source, target]
        written[case.name] = listing[-1]
    reads, refusals = [], []
    for forged in forged_cases():
        target = out / forged.file
        parts = Parts.of((out / written[forged.base]["szt"]["file"]).read_bytes())
        forged.edit(parts)
        target.write_bytes(parts.to_bytes())
        files.append(target)
        if forged.refusal is None:
            reads.append(_describe_read(forged, written[forged.base], target))
        else:
            refusals.append(_describe_refusal(forged, target))
    (out / "vectors.json").write_text(json.dumps({
        "format": "szt", "version": f"{C.VERSION_MAJOR}.{C.VERSION_MINOR}",
        "generator": "tools/make_vectors.py", "cases": listing, "read_cases": reads, "refuse_cases": refusals},
        indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
    (out / "SHA256SUMS").write_text("".join(f"{sha256(p.read_bytes())}  {p.name}\n"
                                            for p in sorted(files, key=lambda p: p.name)))


def _describe(case: Case, source: Path, target: Path) -> dict:
    """The case's record in vectors.json; also checks that the file decodes to its source and covers its case."""
    decoded = load_file(target)
    with SztFile(target) as szt:
        version = "{}.{}".format(*szt.version)
    tensors = []
    with safe_open(target, framework="pt") as f:
        assert f.metadata() == case.metadata, case.name
        assert f.keys() == [t.name for t in case.tensors], case.name
        for t in case.tensors:
            entry = f.entry(t.name)
            planes = entry.encoding == "raw" and entry.at_rest is not None
            streams = [entry.at_rest.transform] if planes else list(entry.at_rest.streams) if entry.at_rest else []
            assert bytes(tensor_bytes(decoded[t.name]).numpy()) == t.raw, (case.name, t.name)
            assert case.expect.get(t.name, entry.encoding) == entry.encoding, (case.name, t.name, entry.encoding)
            assert list(case.expect_streams.get(t.name, streams)) == streams, (case.name, t.name, streams)
            blocks = len(entry.blocks.crcs) if entry.blocks else 0
            assert case.expect_blocks.get(t.name, blocks) == blocks, (case.name, t.name, blocks)
            record = {
                "name": t.name, "dtype": t.dtype, "shape": list(t.shape), "encoding": entry.encoding,
                "n_esc": entry.layout.n_esc if entry.layout else None, "offset": entry.offset,
                "length": entry.length, "raw_sha256": sha256(t.raw)}
            if case.at_rest is not None and planes:
                record["at_rest_transform"] = entry.at_rest.transform
                record["at_rest_planes"] = list(entry.at_rest.planes)
            elif case.at_rest is not None:
                record["at_rest_streams"] = streams
                record["at_rest_frames"] = len(entry.at_rest.frames) if entry.at_rest else 0
            if entry.blocks is not None:
                record["blocks"] = len(entry.blocks.crcs)
            tensors.append(record)
    form = {} if case.at_rest is None else {"at_rest": {"level": case.at_rest, "frame_size": case.frame_size}}
    if any(t.get("blocks") for t in tensors):
        form["block_size"] = case.block_size
    return {
        "name": case.name, "description": case.description, "version": version, "alignment": case.alignment,
        **form, "metadata": case.metadata,
        "source": {"file": source.name, "sha256": sha256(source.read_bytes())},
        "szt": {"file": target.name, "sha256": sha256(target.read_bytes())},
        "tensors": tensors,
    }


def _describe_read(forged: Forged, base: dict, target: Path) -> dict:
    """A read case's record; also checks that szformat decodes the file to its base's tensors and metadata."""
    decoded = load_file(target)
    with safe_open(target, framework="pt") as f:
        assert f.metadata() == base["metadata"], forged.name
    assert list(decoded) == [t["name"] for t in base["tensors"]], forged.name
    for t in base["tensors"]:
        assert sha256(bytes(tensor_bytes(decoded[t["name"]]).numpy())) == t["raw_sha256"], (forged.name, t["name"])
    return {"name": forged.name, "description": forged.description, "base": forged.base,
            "szt": {"file": target.name, "sha256": sha256(target.read_bytes())}}


def _describe_refusal(forged: Forged, target: Path) -> dict:
    """A refuse case's record; also checks that szformat refuses the file as the case says."""
    refusal = forged.refusal
    assert refusal is not None and refusal.stage in STAGES, forged.name
    observed = observed_refusal(target)
    assert observed is not None, f"{forged.name}: szformat reads the file"
    stage, error = observed
    assert (stage, type(error).__name__) == (refusal.stage, refusal.error), (forged.name, stage, repr(error))
    assert refusal.reason in str(error), (forged.name, str(error))
    return {"name": forged.name, "description": forged.description, "base": forged.base,
            "szt": {"file": target.name, "sha256": sha256(target.read_bytes())},
            "stage": refusal.stage, "error": refusal.error, "reason": refusal.reason}


def check(folder: Path) -> list[str]:
    """Differences between ``folder`` and freshly generated vectors (empty when they agree)."""
    problems = []
    with tempfile.TemporaryDirectory() as tmp:
        fresh = Path(tmp)
        generate(fresh)
        expected = {p.name for p in fresh.iterdir()}
        present = {p.name for p in folder.iterdir()} if folder.is_dir() else set()
        problems += [f"{name}: missing" for name in sorted(expected - present)]
        problems += [f"{name}: not a generated file" for name in sorted(present - expected)]
        for name in sorted(expected & present):
            if (folder / name).read_bytes() != (fresh / name).read_bytes():
                problems.append(f"{name}: differs from what the generator writes now")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="vectors folder (default: spec/vectors)")
    parser.add_argument("--check", action="store_true", help="compare the folder with fresh vectors; write nothing")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.out)
        for problem in problems:
            print(f"{args.out}/{problem}", file=sys.stderr)
        print("golden vectors: " + (f"{len(problems)} difference(s)" if problems else "all match"))
        return 1 if problems else 0
    generate(args.out)
    print(f"wrote {len(cases())} cases and {len(forged_cases())} forged files to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
