"""Hostile and broken .szt files: each is refused with an szformat error naming the file, the tensor and the reason.

Files are forged in ``tmp_path`` from a valid file's parts (preamble fields, msgpack header object, payload bytes)
with ``struct.pack`` and msgpack, one broken field at a time; checksums are recomputed unless the case is about a
checksum, so each file reaches the check it targets.
"""

from __future__ import annotations

import os
import random
import struct
import time
import zlib
from pathlib import Path

import msgpack
import pytest
import torch

from szformat import SzformatError, load_file, safe_open, save_file
from szformat.errors import (ChecksumMismatchError, FormatError, HeaderError, HeaderTooLargeError,
                             InvalidOffsetError, PayloadError, TruncatedFileError, UnknownEncodingError,
                             UnsupportedVersionError)
from szformat.format import constants as C
from szformat.format.reader import SztFile
from support import Forge, PREAMBLE_FIELDS, peak_memory, read_everything, refused


# ---------------------------------------------------------------------------------------------------------------
# A valid file, taken apart
# ---------------------------------------------------------------------------------------------------------------


def _escape_heavy_bf16(rows: int, cols: int, seed: int) -> torch.Tensor:
    """BF16 values over 16 common exponents, and escapes (zero, subnormal, Inf, NaN, huge, tiny) in 3 chunks."""
    g = torch.Generator().manual_seed(seed)
    n = rows * cols
    exponent = torch.randint(112, 128, (n,), generator=g, dtype=torch.int32)
    sign_mantissa = torch.randint(0, 256, (n,), generator=g, dtype=torch.int32)
    bits = ((sign_mantissa & 0x80) << 8) | (exponent << 7) | (sign_mantissa & 0x7F)
    x = bits.to(torch.int16).view(torch.bfloat16)
    specials = torch.tensor([0.0, 1e-40, float("inf"), float("nan"), 1e30, -1e-30, 3e20, -2e-20])
    x[[0, 5, 1023, 1024, 1500, 2000, 2100, n - 1]] = specials.to(torch.bfloat16)
    return x.reshape(rows, cols)


SOURCE = {
    "w": _escape_heavy_bf16(8, 300, seed=1),
    "b": torch.arange(5, dtype=torch.float32),
}


@pytest.fixture(scope="module")
def valid_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("valid") / "valid.szt"
    save_file(SOURCE, path, {"format": "pt"}, alignment=64)
    return path


def test_the_forge_rebuilds_the_valid_file_exactly(valid_file, forge, bad):
    assert forge.write(bad).read_bytes() == valid_file.read_bytes()
    decoded = read_everything(bad)
    assert torch.equal(decoded["w"].view(torch.int16), SOURCE["w"].view(torch.int16))
    assert forge.entry("w")["encoding"]["configuration"]["n_esc"] >= 6  # the payload cases below need escapes


# ---------------------------------------------------------------------------------------------------------------
# The smallest legal files
# ---------------------------------------------------------------------------------------------------------------


def _smallest(header: dict) -> bytes:
    hb = msgpack.packb(header)
    return PREAMBLE_FIELDS.pack(C.MAGIC, 1, 0, 0, 64, len(hb), zlib.crc32(hb), 4096, 64 + len(hb)) + bytes(16) + hb


def test_smallest_legal_file_parses(tmp_path):
    path = tmp_path / "smallest.szt"
    path.write_bytes(_smallest({"tensors": []}))
    with safe_open(path, framework="pt") as f:
        assert f.keys() == [] and f.metadata() is None
    assert load_file(path) == {}


def test_smallest_file_with_one_empty_tensor_parses(tmp_path):
    entry = {"name": "e", "dtype": "F32", "shape": [0], "encoding": {"name": "raw"}, "offset": 4096, "length": 0,
             "raw_length": 0, "crc32": 0, "raw_crc32": 0}
    hb = msgpack.packb({"tensors": [entry]})
    data = PREAMBLE_FIELDS.pack(C.MAGIC, 1, 0, 0, 4096, len(hb), zlib.crc32(hb), 4096, 4096 + len(hb)) + bytes(16)
    path = tmp_path / "one_empty.szt"
    path.write_bytes(data + bytes(4096 - 64) + hb)
    t = load_file(path)["e"]
    assert t.dtype == torch.float32 and t.shape == (0,)


def test_empty_tensor_with_a_huge_dimension_is_legal(tmp_path):
    entry = {"name": "e", "dtype": "BF16", "shape": [C.MAX_ELEMENTS, 0, C.MAX_ELEMENTS], "encoding": {"name": "raw"},
             "offset": 4096, "length": 0, "raw_length": 0, "crc32": 0, "raw_crc32": 0}
    hb = msgpack.packb({"tensors": [entry]})
    data = PREAMBLE_FIELDS.pack(C.MAGIC, 1, 0, 0, 4096, len(hb), zlib.crc32(hb), 4096, 4096 + len(hb)) + bytes(16)
    path = tmp_path / "huge_empty.szt"
    path.write_bytes(data + bytes(4096 - 64) + hb)
    with safe_open(path, framework="pt") as f:
        assert f.get_tensor("e").shape == (C.MAX_ELEMENTS, 0, C.MAX_ELEMENTS)
        assert f.get_slice("e")[3:5].shape == (2, 0, C.MAX_ELEMENTS)


def test_newer_minor_version_and_unknown_keys_are_accepted(forge, bad):
    forge.header["added_in_1_1"] = {"anything": [1, 2]}
    forge.entry("w")["added_in_1_1"] = "ignored"
    forge.entry("w")["encoding"]["configuration"]["hint"] = 3
    decoded = read_everything(forge.write(bad, minor=7))
    assert torch.equal(decoded["w"].view(torch.int16), SOURCE["w"].view(torch.int16))


# ---------------------------------------------------------------------------------------------------------------
# The file as a whole and its preamble
# ---------------------------------------------------------------------------------------------------------------


def test_zero_length_file(bad):
    bad.write_bytes(b"")
    refused(bad, TruncatedFileError, "file is empty")


def test_file_shorter_than_the_preamble(bad):
    bad.write_bytes(C.MAGIC + b"\x01\x00")
    refused(bad, TruncatedFileError, "ends after 10 bytes, inside the preamble")


def test_short_file_that_is_not_szt(bad):
    bad.write_bytes(b"{\"a\": 1}")
    refused(bad, FormatError, "bad magic")


def test_bad_magic(forge, bad):
    refused(forge.write(bad, magic=b"\x89SZX\r\n\x1a\n"), FormatError, "not a .szt file (bad magic)")


def test_safetensors_file_is_not_szt(bad):
    from safetensors.torch import save_file as st_save
    st_save({"a": torch.zeros(3)}, bad)
    refused(bad, FormatError, "bad magic")


def test_unknown_major_version(forge, bad):
    e = refused(forge.write(bad, major=2, minor=3), UnsupportedVersionError, "format version 2.3", "major 1",
                "upgrade")
    assert isinstance(e, FormatError)


def test_unknown_flags(forge, bad):
    refused(forge.write(bad, flags=0x4), UnsupportedVersionError, "flags 0x4")


def test_reserved_bytes_set(forge, bad):
    refused(forge.write(bad, reserved=bytes(15) + b"\x01"), UnsupportedVersionError, "reserved preamble bytes")


def test_oversize_header_length_is_refused_before_reading(forge, bad):
    forged = forge.write(bad, header_length=1 << 40, file_length=len(forge.body) + (1 << 40))
    peak = peak_memory(lambda: refused(forged, HeaderTooLargeError, "exceeds the limit"))
    assert peak < 1 << 20


def test_header_length_zero(forge, bad):
    refused(forge.write(bad, header_length=0, file_length=len(forge.body)), HeaderError, "header length is 0")


@pytest.mark.parametrize("alignment", [0, 32, 100, 4097, 1 << 22])
def test_bad_alignment(forge, bad, alignment):
    refused(forge.write(bad, alignment=alignment), FormatError, f"alignment {alignment} is not a power of two")


def test_header_past_end_of_file(forge, bad):
    hb = msgpack.packb(forge.header)
    refused(forge.write(bad, header_length=len(hb) + 100, file_length=len(forge.body) + len(hb) + 100),
            TruncatedFileError, "the preamble announces")


def test_header_does_not_end_the_file(forge, bad):
    hb = msgpack.packb(forge.header)
    refused(forge.write(bad, file_length=len(forge.body) + len(hb) - 1), InvalidOffsetError,
            "does not end the file")


def test_header_offset_inside_the_preamble(forge, bad):
    hb = msgpack.packb(forge.header)
    refused(forge.write(bad, header_offset=10, file_length=10 + len(hb)), InvalidOffsetError, "header [10,")


@pytest.mark.parametrize("keep", [64, 100, 200, -1])
def test_truncated_file(valid_file, bad, keep):
    data = valid_file.read_bytes()
    bad.write_bytes(data[:keep])
    refused(bad, TruncatedFileError, f"file holds {len(data[:keep])} bytes")


def test_trailing_garbage(forge, bad):
    refused(forge.write(bad, trailing=b"\x00garbage"), InvalidOffsetError, "8 unexplained bytes after the end")


def test_header_checksum_mismatch(forge, bad):
    hb = msgpack.packb(forge.header)
    refused(forge.write(bad, header_crc32=zlib.crc32(hb) ^ 1), ChecksumMismatchError, "header checksum mismatch")


def test_directory_is_not_a_file(tmp_path):
    with pytest.raises(FormatError, match="not a regular file"):
        safe_open(tmp_path, "pt")


def test_folder_without_a_checkpoint_is_refused(tmp_path):
    refused(tmp_path, FormatError, "no .szt file")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_fifo_is_refused_without_waiting_for_a_writer(tmp_path):
    fifo = tmp_path / "pipe.szt"
    os.mkfifo(fifo)
    start = time.monotonic()
    refused(fifo, FormatError, "not a regular file")
    assert time.monotonic() - start < 5


# ---------------------------------------------------------------------------------------------------------------
# msgpack-level attacks on the header
# ---------------------------------------------------------------------------------------------------------------


def test_header_is_not_msgpack(forge, bad):
    refused(forge.write(bad, header_bytes=b"\xc1\xc1\xc1"), HeaderError, "not valid msgpack")


def test_header_with_trailing_bytes(forge, bad):
    refused(forge.write(bad, header_bytes=msgpack.packb(forge.header) + b"\x00"), HeaderError, "ExtraData")


def test_header_is_not_a_map(forge, bad):
    refused(forge.write(bad, header_bytes=msgpack.packb([1, 2, 3])), HeaderError, "header must be a map, got list")


def test_deeply_nested_header(forge, bad):
    depth = 100_000
    nested = b"\x82" + msgpack.packb("tensors") + b"\x90" + msgpack.packb("x") + b"\x91" * depth + b"\xc0"
    refused(forge.write(bad, header_bytes=nested), HeaderError, "not valid msgpack")


@pytest.mark.parametrize("prefix", [b"\xdd\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\xdb\xff\xff\xff\xff",
                                    b"\xc6\xff\xff\xff\xff"], ids=["array32", "map32", "str32", "bin32"])
def test_length_prefix_claiming_billions_of_elements(forge, bad, prefix):
    header = b"\x81" + msgpack.packb("tensors") + prefix + b"\x00" * 16
    forged = forge.write(bad, header_bytes=header)
    peak = peak_memory(lambda: refused(forged, HeaderError, "not valid msgpack"))
    assert peak < 1 << 20


def test_header_of_empty_containers_is_refused_as_a_bomb(forge, bad):
    n = 1_000_000  # a 1 MB header that would unpack into ~60 MB of empty lists
    header = b"\x82" + msgpack.packb("tensors") + b"\x90" + msgpack.packb("x") + b"\xdd" + struct.pack(">I", n) \
        + b"\x90" * n
    forged = forge.write(bad, header_bytes=header)
    peak = peak_memory(lambda: refused(forged, HeaderError, "decompression bomb"))
    assert peak < 24 << 20


def test_too_many_tensors(forge, bad):
    header = b"\x81" + msgpack.packb("tensors") + b"\xdd" + struct.pack(">I", C.MAX_TENSORS + 1) \
        + b"\x00" * (C.MAX_TENSORS + 1)
    refused(forge.write(bad, header_bytes=header), HeaderError, "exceeds max_array_len")


def _pack_with_duplicate(header: dict, tensor: str | None, key: str, value) -> bytes:
    """msgpack of ``header`` where one map (the entry of ``tensor``, or the top level) holds ``key`` twice."""
    packer = msgpack.Packer()

    def pairs(mapping, extra):
        return packer.pack_map_pairs(list(mapping.items()) + [(key, value)] if extra else list(mapping.items()))

    if tensor is None:
        return pairs(header, True)
    out = packer.pack_map_header(len(header))
    for k, v in header.items():
        out += packer.pack(k)
        if k == "tensors":
            out += packer.pack_array_header(len(v))
            for entry in v:
                out += pairs(entry, entry["name"] == tensor)
        else:
            out += packer.pack(v)
    return out


def test_duplicate_key_in_a_tensor_entry(forge, bad):
    offset = forge.entry("b")["offset"]
    header = _pack_with_duplicate(forge.header, "b", "offset", offset + 64)
    refused(forge.write(bad, header_bytes=header), HeaderError, "holds the key 'offset' twice", tensor="b")


def test_duplicate_key_at_top_level(forge, bad):
    header = _pack_with_duplicate(forge.header, None, "tensors", [])
    refused(forge.write(bad, header_bytes=header), HeaderError, "holds the key 'tensors' twice")


def _header_with_name_bytes(forge: Forge, name: bytes) -> bytes:
    """The header with tensor ``b`` renamed to the raw UTF-8 bytes ``name`` (possibly invalid) as a msgpack str."""
    marker = "B" * len(name)
    forge.entry("b")["name"] = marker
    packed = msgpack.packb(forge.header)
    tag = msgpack.packb(marker)[: -len(name)]
    assert packed.count(tag + marker.encode()) == 1
    return packed.replace(tag + marker.encode(), tag + name)


@pytest.mark.parametrize("name", [b"\xff\xfeab", b"w\xed\xa0\x80x", b"\xc0\xaf"], ids=["invalid", "surrogate",
                                                                                    "overlong"])
def test_name_that_is_not_utf8(forge, bad, name):
    refused(forge.write(bad, header_bytes=_header_with_name_bytes(forge, name)), HeaderError, "not valid UTF-8")


@pytest.mark.parametrize("name, reason", [
    ("a\x00b", "contains a NUL character"),
    ("", "non-empty string"),
    (b"bytes", "non-empty string"),
    (7, "non-empty string"),
    (None, "non-empty string"),
    ("__metadata__", "is reserved"),
    ("n" * (C.MAX_NAME_BYTES + 1), "more than the limit of 4096"),
    ("é" * (C.MAX_NAME_BYTES // 2 + 1), "more than the limit of 4096"),
])
def test_bad_tensor_name(forge, bad, name, reason):
    forge.entry("b")["name"] = name
    refused(forge.write(bad), HeaderError, "tensor entry #1", reason)


def test_name_of_4096_bytes_is_accepted(forge, bad):
    forge.entry("b")["name"] = "n" * C.MAX_NAME_BYTES
    assert list(read_everything(forge.write(bad))) == ["w", "n" * C.MAX_NAME_BYTES]


def test_duplicate_tensor_names(forge, bad):
    forge.entry("b")["name"] = "w"
    refused(forge.write(bad), HeaderError, "appears twice", tensor="w")


# ---------------------------------------------------------------------------------------------------------------
# Tensor entries
# ---------------------------------------------------------------------------------------------------------------


def test_entry_that_is_not_a_map(forge, bad):
    forge.header["tensors"].append(["not", "a", "map"])
    refused(forge.write(bad), HeaderError, "tensor entry #2 must be a map")


@pytest.mark.parametrize("key, value", [("tensors", None), ("tensors", {"w": 1}), ("metadata", {"a": 1}),
                                        ("metadata", {"a": {"b": "c"}}), ("metadata", ["a"]),
                                        ("required_features", "zstd"), ("required_features", [1])])
def test_bad_top_level_field(forge, bad, key, value):
    if value is None:
        del forge.header[key]
    else:
        forge.header[key] = value
    refused(forge.write(bad), HeaderError, repr(key) if key != "tensors" else "no 'tensors' list")


@pytest.mark.parametrize("key", ["metadata", "required_features"])
def test_nil_is_not_an_absent_key(forge, bad, key):
    forge.header[key] = None
    refused(forge.write(bad), HeaderError, repr(key))


def test_metadata_nil_says_to_leave_the_key_out(forge, bad):
    forge.header["metadata"] = None
    refused(forge.write(bad), HeaderError, "metadata is nil", "leaves the key out")


def test_raw_reason_nil_is_refused(forge, bad):
    forge.entry("b")["encoding"]["configuration"] = {"reason": None}
    refused(forge.write(bad), HeaderError, "raw 'reason' must be a string, got None", tensor="b")


@pytest.mark.parametrize("key", ["shape", "name", "dtype", "offset"])
def test_a_value_nested_a_thousand_levels_deep_gets_a_short_message(forge, bad, key):
    """Refused for its depth as it is parsed, before any repr() of it (which would raise RecursionError)."""
    nested = b"\x91" * 1000 + b"\xc0"
    entry = forge.entry("b")
    packed = [msgpack.packb(k) + (nested if k == key else msgpack.packb(v)) for k, v in entry.items()]
    entry_bytes = bytes([0x80 | len(packed)]) + b"".join(packed)
    pad = msgpack.packb("pad") + msgpack.packb("x" * 20_000)  # room for 1,000 containers under the header's budget
    header = (b"\x82" + pad + msgpack.packb("tensors") + b"\x92" + msgpack.packb(forge.header["tensors"][0])
              + entry_bytes)
    e = refused(forge.write(bad, header_bytes=header), HeaderError, "nests maps and arrays deeper than 16 levels")
    assert len(str(e)) < 300


def test_unknown_required_feature(forge, bad):
    forge.header["required_features"] = ["zstd-payloads", "fp4"]
    refused(forge.write(bad), UnsupportedVersionError, "['fp4', 'zstd-payloads']", "upgrade")


def test_unknown_dtype(forge, bad):
    forge.entry("b")["dtype"] = "F128"
    refused(forge.write(bad), HeaderError, "unknown dtype 'F128'", tensor="b")


@pytest.mark.parametrize("shape, reason", [
    ([-5], "not an integer in"),
    ([True, 5], "not an integer in"),
    ([5.0], "not an integer in"),
    (["5"], "not an integer in"),
    ([[5]], "not an integer in"),
    ([1] * 33 + [5], "more than the limit of 32"),
    ([0, 1 << 60], "not an integer in"),
    ([1 << 30, 1 << 30, 1 << 30], "more elements than the limit"),
    ([(1 << 64) - 1, (1 << 64) - 1], "not an integer in"),
    ("5", "shape must be a list"),
])
def test_bad_shape(forge, bad, shape, reason):
    forge.entry("b")["shape"] = shape
    refused(forge.write(bad), HeaderError, reason, tensor="b")


def test_shape_and_length_mismatch(forge, bad):
    forge.entry("b")["shape"] = [4]
    refused(forge.write(bad), HeaderError, "raw_length 20 does not match shape [4] of F32", tensor="b")


@pytest.mark.parametrize("key, value", [("offset", 64.0), ("offset", -64), ("length", True), ("length", "20"),
                                        ("raw_length", None), ("crc32", 1 << 32), ("raw_crc32", -1),
                                        ("offset", (1 << 64) - 1)])
def test_bad_integer_field(forge, bad, key, value):
    forge.entry("b")[key] = value
    refused(forge.write(bad), HeaderError, f"field {key!r} must be an integer", tensor="b")


# ---------------------------------------------------------------------------------------------------------------
# Placement: offsets out of range, overlapping, misaligned, holes
# ---------------------------------------------------------------------------------------------------------------


def test_offset_past_the_end_of_the_file(forge, bad):
    forge.entry("b")["offset"] = 1 << 40
    refused(forge.write(bad), InvalidOffsetError, "not where the placement rule puts it", tensor="b")


def test_overlapping_payloads(forge, bad):
    forge.entry("b")["offset"] = forge.entry("w")["offset"]
    refused(forge.write(bad), InvalidOffsetError, "overlap", tensor="b")


def test_misaligned_offset(forge, bad):
    forge.entry("b")["offset"] += 4
    refused(forge.write(bad), InvalidOffsetError, "not where the placement rule puts it", tensor="b")


def test_hole_between_payloads(forge, bad):
    e = forge.entry("b")
    forge.body[e["offset"]:e["offset"]] = bytes(64)
    e["offset"] += 64
    refused(forge.write(bad), InvalidOffsetError, "leave a hole", tensor="b")


def test_payloads_out_of_order(forge, bad):
    forge.header["tensors"].reverse()
    refused(forge.write(bad), InvalidOffsetError, "out of order", tensor="b")


def test_payload_runs_into_the_header(forge, bad):
    del forge.body[-4:]  # the header now starts inside the last payload
    refused(forge.write(bad), InvalidOffsetError, "runs past the payload region", tensor="b")


def test_unexplained_bytes_before_the_header(forge, bad):
    forge.body += bytes(100)
    refused(forge.write(bad), InvalidOffsetError, "100 bytes between the last payload and the header")


# ---------------------------------------------------------------------------------------------------------------
# Encodings
# ---------------------------------------------------------------------------------------------------------------


def test_unknown_encoding(forge, bad):
    forge.entry("b")["encoding"] = {"name": "zstd", "configuration": {"level": 3}}
    refused(forge.write(bad), UnknownEncodingError, "encoding 'zstd' is not known", "newer szformat", tensor="b")


@pytest.mark.parametrize("encoding", ["raw", {"configuration": {}}, {"name": 1}, {"name": "raw", "configuration": 5}])
def test_malformed_encoding(forge, bad, encoding):
    forge.entry("b")["encoding"] = encoding
    refused(forge.write(bad), HeaderError, "encoding", tensor="b")


def test_raw_length_differs_from_raw_length(forge, bad):
    forge.entry("b")["length"] = 16
    refused(forge.write(bad), HeaderError, "raw payload length 16 differs from raw_length 20", tensor="b")


def test_raw_with_two_checksums(forge, bad):
    forge.entry("b")["raw_crc32"] ^= 1
    refused(forge.write(bad), HeaderError, "two different checksums", tensor="b")


def test_raw_reason_not_a_string(forge, bad):
    forge.entry("b")["encoding"]["configuration"] = {"reason": 5}
    refused(forge.write(bad), HeaderError, "'reason' must be a string", tensor="b")


def _splitzip(forge: Forge) -> dict:
    return forge.entry("w")["encoding"]["configuration"]


def test_splitzip_on_a_dtype_other_than_bf16(forge, bad):
    forge.entry("w")["dtype"] = "F16"
    refused(forge.write(bad), HeaderError, "splitzip encodes BF16 only", tensor="w")


def test_splitzip_chunk_size_unsupported(forge, bad):
    _splitzip(forge)["chunk_size"] = 512
    refused(forge.write(bad), UnsupportedVersionError, "chunk size 512 is not supported", tensor="w")


def test_splitzip_n_differs_from_shape(forge, bad):
    _splitzip(forge)["n"] -= 1
    refused(forge.write(bad), HeaderError, "differs from the shape's 2400 elements", tensor="w")


@pytest.mark.parametrize("delta", [1, -1])
def test_splitzip_n_esc_inconsistent_with_length(forge, bad, delta):
    _splitzip(forge)["n_esc"] += delta
    refused(forge.write(bad), HeaderError, "bytes its layout needs", tensor="w")


def test_splitzip_n_esc_above_n(forge, bad):
    _splitzip(forge)["n_esc"] = 2401
    refused(forge.write(bad), HeaderError, "n_esc=2401 exceeds n=2400", tensor="w")


@pytest.mark.parametrize("streams", [None, {"pk": 0}, "bad", "shifted", "bool"])
def test_splitzip_stream_offsets_disagree_with_the_layout(forge, bad, streams):
    config = _splitzip(forge)
    if streams == "shifted":
        config["streams"]["sm"] += 4
    elif streams == "bool":
        config["streams"]["pk"] = False
    else:
        config["streams"] = streams
    refused(forge.write(bad), HeaderError, "differ from the frozen layout", tensor="w")


@pytest.mark.parametrize("change, reason", [
    (lambda c: c.update(codebook=c["codebook"][:15]), "list of 16 integers"),
    (lambda c: c["codebook"].__setitem__(3, 1.5), "list of 16 integers"),
    (lambda c: c["codebook"].__setitem__(3, 256), "invalid codebook"),
    (lambda c: c["codebook"].__setitem__(3, c["codebook"][2]), "must be distinct"),
    (lambda c: c.update(n_codes_used=17), "'n_codes_used' must be an integer in [0, 16]"),
    (lambda c: c.update(n_codes_used=c["n_codes_used"] - 1), "past n_codes_used"),
    (lambda c: c.update(coverage=1), "coverage must be a float"),
    (lambda c: c.update(coverage=float("nan")), "coverage must be a float"),
    (lambda c: c.update(coverage=1.5), "coverage must be a float"),
])
def test_splitzip_bad_codebook(forge, bad, change, reason):
    change(_splitzip(forge))
    refused(forge.write(bad), HeaderError, reason, tensor="w")


# ---------------------------------------------------------------------------------------------------------------
# SplitZip escape streams (checksums kept right, so the structural checks are what refuses them)
# ---------------------------------------------------------------------------------------------------------------


def _streams(forge: Forge) -> dict:
    return _splitzip(forge)["streams"]


def _escape_fields(forge: Forge) -> tuple[list[int], list[int]]:
    s, n_esc = _streams(forge), _splitzip(forge)["n_esc"]
    base = forge.entry("w")["offset"]
    chunk = struct.unpack(f"<{n_esc}i", forge.body[base + s["chunk_id"]: base + s["chunk_id"] + 4 * n_esc])
    local = struct.unpack(f"<{n_esc}H", forge.body[base + s["local_pos"]: base + s["local_pos"] + 2 * n_esc])
    return list(chunk), list(local)


def _set_escapes(forge: Forge, chunk: list[int], local: list[int]) -> None:
    s = _streams(forge)
    forge.payload_at("w", s["chunk_id"], struct.pack(f"<{len(chunk)}i", *chunk))
    forge.payload_at("w", s["local_pos"], struct.pack(f"<{len(local)}H", *local))


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("case, reason", [
    ("chunk_too_big", "chunk id out of range"),
    ("chunk_negative", "chunk id out of range"),
    ("local_too_big", "outside its chunk of 1024"),
    ("past_n", "past the tensor's 2400 elements"),
    ("not_ascending", "not strictly ascending"),
    ("repeated", "not strictly ascending"),
])
def test_bad_escape_stream(forge, bad, case, reason, verify):
    chunk, local = _escape_fields(forge)
    if case == "chunk_too_big":
        chunk[1] = 3
    elif case == "chunk_negative":
        chunk[0] = -1
    elif case == "local_too_big":
        local[1] = 1024
    elif case == "past_n":
        chunk[-1], local[-1] = 2, 2400 - 2048
    elif case == "not_ascending":
        chunk[1], local[1], chunk[2], local[2] = chunk[2], local[2], chunk[1], local[1]
    else:
        chunk[2], local[2] = chunk[1], local[1]
    _set_escapes(forge, chunk, local)
    refused(forge.write(bad), PayloadError, reason, tensor="w", verify=verify)


def test_bad_escape_stream_is_refused_by_a_slice_too(forge, bad):
    chunk, local = _escape_fields(forge)
    chunk[0] = 99
    _set_escapes(forge, chunk, local)
    with safe_open(forge.write(bad), framework="pt", verify=False) as f:
        with pytest.raises(PayloadError, match="chunk id out of range"):
            f.get_slice("w")[0:1]


# ---------------------------------------------------------------------------------------------------------------
# Checksums of the stored and of the decoded bytes
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tensor, where", [("w", "pk"), ("w", "sm"), ("w", "chunk_id"), ("w", "esc_val"), ("b", None)])
def test_stored_bytes_checksum_mismatch(forge, bad, tensor, where):
    start = _streams(forge)[where] if where else 0
    original = forge.body[forge.entry(tensor)["offset"] + start]
    forge.payload_at(tensor, start, bytes([original ^ 0x10]), fix_crc=False)
    refused(forge.write(bad), ChecksumMismatchError, "CRC-32 of the stored bytes", tensor=tensor)


def test_stored_bytes_checksum_is_checked_before_a_slice_is_used(forge, bad):
    forge.payload_at("w", _streams(forge)["sm"] + 2000, b"\x00", fix_crc=False)
    with safe_open(forge.write(bad), framework="pt") as f:
        with pytest.raises(ChecksumMismatchError, match="stored bytes"):
            f.get_slice("w")[0:1]  # row 0 is intact; the payload is not


def test_a_slice_cannot_check_the_decoded_bytes(forge, bad):
    """The decoded-bytes CRC-32 covers the whole tensor, so a slice returns what a payload edited with its stored
    CRC-32 recomputed decodes to, where get_tensor refuses it (as documented in safe_open and the README)."""
    forge.payload_at("w", _streams(forge)["sm"] + 310, bytes([forge.body[forge.entry("w")["offset"]
                                                                         + _streams(forge)["sm"] + 310] ^ 0x80]))
    with safe_open(forge.write(bad), framework="pt") as f:
        row = f.get_slice("w")[1]
        with pytest.raises(ChecksumMismatchError, match="decoded bytes"):
            f.get_tensor("w")
    want = SOURCE["w"][1].view(torch.int16)
    assert (row.view(torch.int16) != want).nonzero().reshape(-1).tolist() == [10]
    assert torch.equal(row[10], -SOURCE["w"][1][10])


def test_decoded_bytes_checksum_mismatch(forge, bad):
    forge.entry("w")["raw_crc32"] ^= 0x80000000
    refused(forge.write(bad), ChecksumMismatchError, "CRC-32 of the decoded bytes", tensor="w")
    with safe_open(bad, framework="pt") as f:  # a slice of every row is the whole tensor: checked as get_tensor is
        with pytest.raises(ChecksumMismatchError, match="tensor 'w': CRC-32 of the decoded bytes"):
            f.get_slice("w")[:]


def test_a_change_that_leaves_the_tensor_intact_is_still_caught_by_the_stored_checksum(forge, bad):
    first = forge.body[forge.entry("w")["offset"]]
    forge.payload_at("w", 0, bytes([first | 0xF0]), fix_crc=False)  # element 0 is an escape: its nibble is unused
    with safe_open(forge.write(bad), framework="pt", verify=False) as f:
        assert torch.equal(f.get_tensor("w").view(torch.int16), SOURCE["w"].view(torch.int16))
    refused(bad, ChecksumMismatchError, "stored bytes", tensor="w")


# ---------------------------------------------------------------------------------------------------------------
# The file changes under an open reader
# ---------------------------------------------------------------------------------------------------------------


def test_file_truncated_after_open_is_reported_not_sigbus(valid_file, tmp_path):
    path = tmp_path / "shrinks.szt"
    path.write_bytes(valid_file.read_bytes())
    with safe_open(path, framework="pt") as f:
        os.truncate(path, 100)
        with pytest.raises(TruncatedFileError, match="shrank to 100 bytes after it was opened") as info:
            f.get_tensor("w")
        assert info.value.tensor == "w" and "shrinks.szt" in str(info.value)


def test_readinto_a_memoryview_reads_what_read_does_and_is_held_to_the_same_bounds(valid_file, tmp_path):
    path = tmp_path / "shrinks.szt"
    path.write_bytes(valid_file.read_bytes())
    with SztFile(path) as f:
        length = f.entry("w").length
        out = memoryview(bytearray(length - 3))
        f.readinto("w", 3, out)
        assert bytes(out) == f.read("w", 3).numpy().tobytes() == f.payload("w")[3:].numpy().tobytes()
        with pytest.raises(ValueError, match="outside the"):
            f.readinto("w", 4, out)
        os.truncate(path, 100)
        with pytest.raises(TruncatedFileError, match="shrank to 100 bytes") as info:
            f.readinto("w", 0, out)
        assert info.value.tensor == "w"


def test_file_replaced_by_rename_does_not_affect_an_open_reader(valid_file, tmp_path):
    path = tmp_path / "replaced.szt"
    path.write_bytes(valid_file.read_bytes())
    with safe_open(path, framework="pt") as f:
        save_file({"other": torch.ones(3)}, path)
        assert torch.equal(f.get_tensor("w").view(torch.int16), SOURCE["w"].view(torch.int16))


# ---------------------------------------------------------------------------------------------------------------
# Random corruption
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("round_", range(4))
def test_random_corruption_never_gives_a_wrong_tensor(valid_file, tmp_path, round_):
    """Flip, overwrite, cut or extend random bytes: the reader raises SzformatError or returns the exact tensors."""
    seed = int.from_bytes(os.urandom(8), "little")
    rng = random.Random(seed)
    original = valid_file.read_bytes()
    path = tmp_path / "fuzz.szt"
    outcomes = {"refused": 0, "same": 0}
    for _ in range(75):
        data = bytearray(original)
        kind = rng.random()
        if kind < 0.7:
            for _ in range(rng.randint(1, 4)):
                data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif kind < 0.85:
            at = rng.randrange(len(data))
            data[at: at + 8] = rng.randbytes(8)
        elif kind < 0.95:
            del data[rng.randrange(len(data)):]
        else:
            data += rng.randbytes(rng.randint(1, 64))
        path.write_bytes(bytes(data))
        try:
            decoded = load_file(path)
        except SzformatError:
            outcomes["refused"] += 1
            continue
        assert decoded.keys() == SOURCE.keys(), f"seed {seed}"
        for name, t in SOURCE.items():
            assert torch.equal(decoded[name].view(torch.uint8), t.view(torch.uint8)), f"seed {seed}, tensor {name}"
        outcomes["same"] += 1
    assert outcomes["refused"] > 0, f"seed {seed}: {outcomes}"


def test_every_error_class_is_an_szformat_value_error():
    for error in (FormatError, HeaderError, HeaderTooLargeError, TruncatedFileError, InvalidOffsetError,
                  UnsupportedVersionError, UnknownEncodingError, PayloadError, ChecksumMismatchError):
        assert issubclass(error, SzformatError) and issubclass(error, ValueError)




def test_a_codebook_edited_with_the_header_crc_recomputed_is_refused_whole_and_sliced_as_the_spec_says(tmp_path):
    """No checksum but ``raw_crc32`` covers the codebook (spec, "What each checksum covers"): ``get_tensor``
    refuses the edit; ``get_slice``, which cannot check ``raw_crc32``, decodes under the edited codebook."""
    g = torch.Generator().manual_seed(11)
    w = (torch.randn(64, 32, generator=g) * 0.02).to(torch.bfloat16)
    save_file({"w": w}, tmp_path / "valid.szt")
    forge = Forge.load(tmp_path / "valid.szt")
    codebook = forge.entry("w")["encoding"]["configuration"]["codebook"]
    codebook[0], codebook[1] = codebook[1], codebook[0]  # the two most frequent exponents swapped
    edited = forge.write(tmp_path / "edited.szt")
    with safe_open(edited, framework="pt") as f:
        with pytest.raises(ChecksumMismatchError, match="tensor 'w': CRC-32 of the decoded bytes"):
            f.get_tensor("w")
        rows = f.get_slice("w")[0:4]
    assert rows.shape == (4, 32) and not torch.equal(rows, w[0:4])  # the documented limit, not a silent pass


def test_a_bin_map_key_is_refused_even_beside_its_str_twin(forge, bad):
    forge.entry("b")[b"dtype"] = "U8"
    refused(forge.write(bad), HeaderError, "has the key b'dtype', not a string (msgpack str)")


def test_a_required_feature_listed_twice_is_refused(forge, bad):
    forge.header["required_features"] = ["small_alignment", "small_alignment"]
    refused(forge.write(bad), HeaderError, "'required_features' lists 'small_alignment' twice")


def test_mapped_views_are_held_to_the_tensor_and_refused_once_the_file_shrank(valid_file, tmp_path):
    path = tmp_path / "shrinks.szt"
    path.write_bytes(valid_file.read_bytes())
    with SztFile(path) as f:
        length = f.entry("w").length
        assert bytes(f.mapped("w", 3, length)) == f.read("w", 3).numpy().tobytes()
        with pytest.raises(ValueError, match="outside the"):
            f.mapped("w", 0, length + 1)
        os.truncate(path, 100)
        with pytest.raises(TruncatedFileError, match="shrank to 100 bytes") as info:
            f.mapped("w", 0, length)
        assert info.value.tensor == "w"
