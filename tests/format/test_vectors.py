"""The golden vectors of ``spec/vectors/``: hashes, byte-exact writing, bit-exact reading, and the spec itself.

``_spec_decode`` is a second reader written from ``spec/szt-v1.md`` alone (struct, msgpack and numpy, nothing of
szformat); it must agree with szformat's reader on every vector, the forged ones too (it refuses each ``refuse_*``
file at the stage vectors.json gives), so the spec says what the code does.
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import struct
import zlib
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch
import zstandard
from safetensors.torch import load_file as st_load_file

from szformat import SzformatError, load_file, safe_open
from szformat.format import constants as C
from szformat.format.at_rest import DEFAULT_FRAME_SIZE
from szformat.format.reader import SztFile
from szformat.format.writer import tensor_bytes

from tools import make_vectors

ROOT = Path(__file__).resolve().parents[2]
VECTORS = ROOT / "spec" / "vectors"
LISTING = json.loads((VECTORS / "vectors.json").read_text(encoding="utf-8"))
CASES = {case["name"]: case for case in LISTING["cases"]}
READS = {case["name"]: case for case in LISTING["read_cases"]}
REFUSALS = {case["name"]: case for case in LISTING["refuse_cases"]}
NO_TORCH_TYPE = {name for name, (dtype, _) in C.DTYPES.items() if dtype is None}
"""Dtypes this torch has no type for (torch 2.4: F8_E8M0): the cases holding one cannot be loaded as tensors here."""


def _skip_without_torch_types(dtypes) -> None:
    lacking = sorted(set(dtypes) & NO_TORCH_TYPE)
    if lacking:
        pytest.skip(f"torch {torch.__version__} has no type for {', '.join(lacking)}")


GENERATED = {case.name: case for case in make_vectors.cases()}


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_sha256sums_lists_every_file_with_its_hash():
    lines = (VECTORS / "SHA256SUMS").read_text().splitlines()
    listed = dict(reversed(line.split("  ", 1)) for line in lines)
    present = {p.name for p in VECTORS.iterdir()} - {"SHA256SUMS"}
    assert set(listed) == present
    for name, digest in listed.items():
        assert _sha256(VECTORS / name) == digest, name


def test_vectors_json_hashes_agree_with_the_files():
    for case in LISTING["cases"]:
        for role in ("source", "szt"):
            assert _sha256(VECTORS / case[role]["file"]) == case[role]["sha256"], (case["name"], role)
    for case in [*LISTING["read_cases"], *LISTING["refuse_cases"]]:
        assert _sha256(VECTORS / case["szt"]["file"]) == case["szt"]["sha256"], case["name"]


def test_the_folder_stays_small():
    assert sum(p.stat().st_size for p in VECTORS.iterdir()) < 3 << 19  # 1.5 MiB


def test_the_cases_cover_what_the_spec_promises():
    tensors = [t for case in LISTING["cases"] for t in case["tensors"]]
    splitzip = [t for t in tensors if t["encoding"] == "splitzip"]
    assert any(t["n_esc"] for t in splitzip)
    assert any(math.prod(t["shape"]) % 2 for t in splitzip)
    assert any(t["n_esc"] and math.prod(t["shape"]) > 2 * 1024 for t in splitzip)  # escapes in several chunks
    assert any(all(t["encoding"] == "raw" for t in case["tensors"]) and case["tensors"]
               for case in LISTING["cases"])
    assert {"F32", "F16", "F8_E4M3", "I64", "BOOL", "U8", "BF16"} <= {t["dtype"] for t in tensors}
    assert all(t["encoding"] == "raw" for t in tensors if t["dtype"].startswith("F8"))
    assert any(t["shape"] == [] for t in tensors) and any(0 in t["shape"] for t in tensors)
    assert any(case["metadata"] for case in LISTING["cases"])
    assert any(case["alignment"] != 4096 for case in LISTING["cases"])
    assert any(not case["tensors"] for case in LISTING["cases"])


def test_the_1_2_case_covers_byte_planes():
    (case,) = [case for case in LISTING["cases"] if case["name"] == "at_rest_planes"]
    assert case["version"] == "1.2"
    staged = [t for t in case["tensors"] if "at_rest_transform" in t]
    assert {t["at_rest_transform"] for t in staged} == {"bytes", "sign_last"}
    assert {t["dtype"] for t in staged} >= {"F32", "F16", "F8_E4M3", "I32"}
    assert any(t["encoding"] == "raw" and "at_rest_transform" not in t for t in case["tensors"])  # no stage
    for t in staged:
        itemsize = {"F32": 4, "F16": 2, "F8_E4M3": 1, "I32": 4}[t["dtype"]]
        assert len(t["at_rest_planes"]) % itemsize == 0 and sum(t["at_rest_planes"]) == t["length"]
    assert any(t["at_rest_transform"] == "sign_last" and max(t["at_rest_planes"]) == 1024
               and min(t["at_rest_planes"]) < 1024 for t in staged)  # verbatim and compressed planes
    assert {"planes_feature", "planes_count", "planes_transform", "planes_too_long", "planes_corrupt",
            "planes_verbatim_swap", "planes_codec_on_splitzip"} <= set(REFUSALS)
    assert "planes_unknown_keys" in READS


def test_the_1_3_case_covers_block_checksums():
    """Tables of several blocks, the last one shorter (SplitZip and raw), and none for a payload of one block; each
    table right against the file's bytes, and joined, the entry's crc32."""
    (case,) = [case for case in LISTING["cases"] if "block_size" in case]
    assert case["version"] == "1.3" and case["block_size"] == 4096
    assert {t["encoding"] for t in case["tensors"] if t.get("blocks", 0) > 1} == {"splitzip", "raw"}
    assert any(t["length"] == case["block_size"] and "blocks" not in t for t in case["tensors"])
    assert any(t["length"] % case["block_size"] for t in case["tensors"] if "blocks" in t)
    path = VECTORS / case["szt"]["file"]
    data = path.read_bytes()
    with SztFile(path) as f:
        for t in case["tensors"]:
            entry = f.entry(t["name"])
            stored = data[entry.offset: entry.offset + entry.length]
            if "blocks" in t:
                assert list(entry.blocks.crcs) == [zlib.crc32(stored[i: i + 4096]) for i in range(0, len(stored), 4096)]
                assert len(entry.blocks.crcs) == t["blocks"] and entry.blocks.joined(entry.length) == entry.crc32
    assert {"block_crc32_count", "block_crc32_size"} <= set(REFUSALS)


def test_the_1_1_cases_cover_the_at_rest_form():
    rest = [case for case in LISTING["cases"] if "at_rest" in case and case["name"] != "at_rest_planes"]
    assert rest and all(case["version"] == "1.1" for case in rest)
    assert all(case["version"] == "1.0" for case in LISTING["cases"] if "at_rest" not in case
               and "block_size" not in case)
    tensors = [t for case in rest for t in case["tensors"]]
    assert any(t["at_rest_streams"] == ["pk"] and t["at_rest_frames"] > 1 for t in tensors)  # several frames
    assert any(len(t["at_rest_streams"]) == 4 for t in tensors)  # escape streams through zstd too
    assert any(t["encoding"] == "splitzip" and not t["at_rest_streams"] for t in tensors)  # no stage
    assert any(t["offset"] % 16 == 0 and t["offset"] % case["alignment"] for case in rest for t in case["tensors"])
    assert any(t["at_rest_frames"] and math.prod(t["shape"]) % 2 for t in tensors)
    assert {"at_rest_codec", "at_rest_feature", "at_rest_frame_lengths", "at_rest_frame_corrupt", "at_rest_bomb",
            "header_bomb"} <= set(REFUSALS)


def test_the_forged_files_cover_what_the_spec_promises():
    assert {"minor_version", "unknown_keys", "omitted_configuration"} <= set(READS)
    assert {case["stage"] for case in REFUSALS.values()} == set(make_vectors.STAGES)
    assert {case["error"] for case in REFUSALS.values()} == {
        "FormatError", "UnsupportedVersionError", "HeaderTooLargeError", "TruncatedFileError", "InvalidOffsetError",
        "ChecksumMismatchError", "HeaderError", "UnknownEncodingError", "PayloadError"}
    with safe_open(VECTORS / READS["minor_version"]["szt"]["file"], framework="pt") as f:
        assert f._file.version == (1, 9)


@pytest.mark.parametrize("name", READS)
def test_reader_decodes_each_read_case_to_its_base(name):
    case = READS[name]
    base = CASES[case["base"]]
    decoded = load_file(VECTORS / case["szt"]["file"])
    assert list(decoded) == [t["name"] for t in base["tensors"]]
    for t in base["tensors"]:
        assert hashlib.sha256(bytes(tensor_bytes(decoded[t["name"]]).numpy())).hexdigest() == t["raw_sha256"]
    with safe_open(VECTORS / case["szt"]["file"], framework="pt") as f:
        assert f.metadata() == base["metadata"]


@pytest.mark.parametrize("name", REFUSALS)
def test_reader_refuses_each_refuse_case_at_its_stage(name):
    case = REFUSALS[name]
    path = VECTORS / case["szt"]["file"]
    stage, error = make_vectors.observed_refusal(path)
    assert (stage, type(error).__name__) == (case["stage"], case["error"])
    assert isinstance(error, ValueError) and error.path == str(path)
    assert case["reason"] in str(error) and path.name in str(error)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (and Triton)")
@pytest.mark.parametrize("name", [n for n, case in REFUSALS.items() if n not in ("raw_crc", "planes_verbatim_swap")])
def test_gpu_route_refuses_each_refuse_case(name):
    """On the GPU route too (which does not check decoded bytes: ``raw_crc`` and ``planes_verbatim_swap``, whose
    stored CRC-32 was recomputed, are read there, as the spec allows)."""
    case = REFUSALS[name]
    with pytest.raises(SzformatError) as info:
        load_file(VECTORS / case["szt"]["file"], device="cuda", verify=case["stage"] == "verify")
    assert type(info.value).__name__ == case["error"] and case["reason"] in str(info.value)


@pytest.mark.parametrize("name", CASES)
def test_sources_are_regenerated_bit_for_bit(name, tmp_path):
    case = GENERATED[name]
    path = tmp_path / "source.safetensors"
    make_vectors.write_safetensors(path, case.tensors, case.metadata)
    assert path.read_bytes() == (VECTORS / CASES[name]["source"]["file"]).read_bytes()


@pytest.mark.parametrize("name", CASES)
def test_writer_reproduces_each_szt_file_byte_for_byte(name, tmp_path):
    listed = CASES[name]
    target = tmp_path / "out.szt"
    form = {"at_rest": listed["at_rest"]["level"], "frame_size": listed["at_rest"]["frame_size"]} \
        if "at_rest" in listed else {}
    if "block_size" in listed:
        form["block_size"] = listed["block_size"]
    make_vectors.convert(VECTORS / listed["source"]["file"], target, alignment=listed["alignment"], **form)
    assert target.read_bytes() == (VECTORS / listed["szt"]["file"]).read_bytes()


@pytest.mark.parametrize("name", [name for name, case in CASES.items()  # the converter's 1 MiB frames and blocks
                                  if case.get("at_rest", {}).get("frame_size", DEFAULT_FRAME_SIZE) == DEFAULT_FRAME_SIZE
                                  and case.get("block_size", C.BLOCK_CRC_SIZE) == C.BLOCK_CRC_SIZE])
def test_the_converter_reproduces_each_szt_file_byte_for_byte(name, tmp_path):
    from szformat.convert.convert import convert

    listed = CASES[name]
    target = tmp_path / "out.szt"
    convert(VECTORS / listed["source"]["file"], target, alignment=listed["alignment"],
            at_rest=listed["at_rest"]["level"] if "at_rest" in listed else None)
    assert target.read_bytes() == (VECTORS / listed["szt"]["file"]).read_bytes()


@pytest.mark.parametrize("name", CASES)
def test_reader_decodes_each_szt_file_to_its_source(name):
    listed = CASES[name]
    _skip_without_torch_types(t["dtype"] for t in listed["tensors"])
    source = st_load_file(VECTORS / listed["source"]["file"])
    decoded = load_file(VECTORS / listed["szt"]["file"])
    assert list(decoded) == [t["name"] for t in listed["tensors"]]
    assert decoded.keys() == source.keys()
    for t in listed["tensors"]:
        got, want = decoded[t["name"]], source[t["name"]]
        assert got.dtype == want.dtype and got.shape == want.shape
        raw = bytes(tensor_bytes(got).numpy())
        assert raw == bytes(tensor_bytes(want).numpy())
        assert hashlib.sha256(raw).hexdigest() == t["raw_sha256"]
    with safe_open(VECTORS / listed["szt"]["file"], framework="pt") as f:
        assert f.metadata() == listed["metadata"]
        assert [f.entry(t["name"]).encoding for t in listed["tensors"]] == [t["encoding"] for t in listed["tensors"]]


# ---------------------------------------------------------------------------------------------------------------
# A reader written from the spec alone
# ---------------------------------------------------------------------------------------------------------------

ITEMSIZE = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I16": 2, "U16": 2, "F16": 2,
            "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8, "C64": 8}


class Refused(Exception):
    """The spec's reader refuses a file; ``stage`` is ``open``, ``decode`` or ``verify``."""

    def __init__(self, stage: str, reason: str):
        super().__init__(f"{stage}: {reason}")
        self.stage = stage


def _require(condition: bool, reason: str, stage: str = "open") -> None:
    if not condition:
        raise Refused(stage, reason)


def _is_int(value, lo: int = 0, hi: int = 1 << 63) -> bool:
    return type(value) is int and lo <= value <= hi


def _no_repeats(pairs: list) -> dict:
    _require(all(type(k) is str for k, _ in pairs), "a map key that is not a string")
    _require(len({k for k, _ in pairs}) == len(pairs), "a map holds a key twice")
    return dict(pairs)


def _depth(value) -> int:
    """Levels of maps and arrays in ``value``, itself counted."""
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else None
    return 0 if children is None else 1 + max((_depth(child) for child in children), default=0)


def _spec_decode(path: Path, *, verify: bool = True) -> tuple[dict | None, dict[str, bytes]]:
    """Metadata and raw bytes of each tensor of a .szt file, following spec/szt-v1.md step by step ("Reader checks",
    the encodings' tables, "Checksums and conformance"); raises Refused where the spec says a reader refuses."""
    data = path.read_bytes()
    _require(len(data) >= 64, "shorter than the preamble")
    magic, major, _minor, flags, h_off, h_len, h_crc, align, file_len = struct.unpack_from("<8sHHIQQIIQ", data)
    _require(magic == b"\x89SZT\r\n\x1a\n", "magic")
    _require(major == 1 and flags in (0, 1) and data[48:64] == bytes(16), "version, flags or reserved bytes")
    _require(1 <= h_len <= 100 * 2**20, "header length")
    _require(align & (align - 1) == 0 and 64 <= align <= 2**21, "alignment")
    _require(h_off >= 64 and h_off + h_len == file_len == len(data), "header position or file size")
    _require(zlib.crc32(data[h_off:]) == h_crc, "header checksum")
    stored_header = data[h_off:]
    if flags & 1:  # 1.1: the header through zstd, one frame with its size (bounded) and a checksum
        stored_header = _spec_zstd_frame(stored_header, limit=min(100 << 20, 16 * h_len + (1 << 20)))
    try:
        header = msgpack.unpackb(stored_header, raw=False, strict_map_key=True, object_pairs_hook=_no_repeats)
    except (ValueError, TypeError, msgpack.ExtraData) as e:  # invalid UTF-8 is a ValueError too
        raise Refused("open", f"msgpack: {e}") from None
    _require(isinstance(header, dict), "top level")
    _require(_depth(header) <= 16, "nested deeper than 16 levels")
    features = header.get("required_features", [])
    _require(isinstance(features, list) and set(features) <= {"at_rest_zstd", "small_alignment", "at_rest_planes"}
             and len(set(features)) == len(features), "required features")  # those 1.1 and 1.2 define, each once
    small = header.get("small_alignment")
    _require(("small_alignment" in features) == ("small_alignment" in header)
             and (small is None or (_is_int(small, 16, align - 1) and small & (small - 1) == 0)), "small_alignment")
    metadata = header.get("metadata")
    _require("metadata" not in header or (isinstance(metadata, dict) and all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())), "metadata")
    _require(isinstance(header.get("tensors"), list), "tensors")
    entries, cursor, names = [], 64, set()
    for e in header["tensors"]:
        _require(isinstance(e, dict), "entry")
        name, dtype, shape = e.get("name"), e.get("dtype"), e.get("shape")
        _require(isinstance(name, str) and name and "\0" not in name and name != "__metadata__"
                 and len(name.encode()) <= 4096 and name not in names, "name")
        names.add(name)
        _require(dtype in ITEMSIZE and isinstance(shape, list) and len(shape) <= 32
                 and all(_is_int(d, 0, 2**56) for d in shape) and math.prod(shape) <= 2**56, "dtype or shape")
        numel = math.prod(shape)
        _require(all(_is_int(e.get(k)) for k in ("offset", "length", "raw_length"))
                 and all(_is_int(e.get(k), 0, 2**32 - 1) for k in ("crc32", "raw_crc32")), "integers")
        _require(e["raw_length"] == numel * ITEMSIZE[dtype], "raw_length")
        if "block_crc32" in e:  # 1.3: only its shape is checked here, a reader that reads whole payloads needs no more
            blocks = e["block_crc32"]
            _require(isinstance(blocks, dict) and _is_int(blocks.get("size"), 4096, 2**30)
                     and not blocks["size"] & (blocks["size"] - 1), "block size")
            crcs = blocks.get("crc32")
            _require(isinstance(crcs, list) and len(crcs) == -(-e["length"] // blocks["size"])
                     and all(_is_int(c, 0, 2**32 - 1) for c in crcs), "block checksums")
        encoding = e.get("encoding")
        _require(isinstance(encoding, dict) and isinstance(encoding.get("name"), str), "encoding")
        config = encoding.get("configuration", {})
        _require(isinstance(config, dict), "configuration")
        if encoding["name"] == "raw":
            _require(isinstance(config.get("reason", ""), str), "reason")
            if "at_rest" in encoding:  # 1.2: byte planes
                _require("at_rest_planes" in features, "byte planes not required")
                _spec_planes_config(encoding["at_rest"], ITEMSIZE[dtype], e["raw_length"], e["length"])
            else:
                _require(e["length"] == e["raw_length"] and e["crc32"] == e["raw_crc32"], "raw lengths or checksums")
        else:
            _require(encoding["name"] == "splitzip" and dtype == "BF16", "encoding name or splitzip dtype")
            if "at_rest" in encoding:
                _require("at_rest_zstd" in features, "at-rest stage not required")
                _spec_splitzip_config(config, numel, None)
                _spec_at_rest_config(encoding["at_rest"], config, e["length"])
            else:
                _spec_splitzip_config(config, numel, e["length"])
        a = small if small is not None and e["length"] < 1 << 20 else align
        _require(e["offset"] == -(-cursor // a) * a, "placement")
        cursor = e["offset"] + e["length"]
        _require(cursor <= h_off, "payload past the header")
        entries.append(e)
    _require(cursor == h_off, "bytes before the header")

    out: dict[str, bytes] = {}
    for e in entries:
        stored = data[e["offset"]: e["offset"] + e["length"]]
        _require(not verify or zlib.crc32(stored) == e["crc32"], "stored bytes checksum", "verify")
        if "at_rest" in e["encoding"] and e["encoding"]["name"] == "raw":
            stored = _spec_planes(stored, ITEMSIZE[e["dtype"]], e["raw_length"], e["encoding"]["at_rest"])
        elif "at_rest" in e["encoding"]:
            stored = _spec_inflate(stored, e["encoding"]["configuration"], e["encoding"]["at_rest"])
        raw = stored if e["encoding"]["name"] == "raw" else _spec_splitzip(stored, e["encoding"]["configuration"])
        _require(not verify or zlib.crc32(raw) == e["raw_crc32"], "decoded bytes checksum", "verify")
        out[e["name"]] = raw
    return metadata, out


def _align4(x: int) -> int:
    return (x + 3) // 4 * 4


def _spec_layout(n: int, n_esc: int) -> dict[str, int]:
    off_sm = _align4((n + 1) // 2)
    off_cid = _align4(off_sm + n)
    off_lpos = off_cid + 4 * n_esc
    return {"pk": 0, "sm": off_sm, "chunk_id": off_cid, "local_pos": off_lpos,
            "esc_val": _align4(off_lpos + 2 * n_esc)}


def _spec_splitzip_config(config: dict, numel: int, length: int | None) -> None:
    """The splitzip configuration table of the spec (``length`` None: an at-rest stage accounts for it)."""
    _require(_is_int(config.get("chunk_size")) and config["chunk_size"] == 1024, "chunk size")
    n, n_esc, n_used = config.get("n"), config.get("n_esc"), config.get("n_codes_used")
    _require(_is_int(n) and n == numel and n <= 2**41 and _is_int(n_esc) and n_esc <= n, "n or n_esc")
    streams = _spec_layout(n, n_esc)
    _require(length is None or length == streams["esc_val"] + n_esc, "length")
    _require(isinstance(config.get("streams"), dict) and config["streams"] == streams
             and all(_is_int(v) for v in config["streams"].values()), "streams")
    codebook = config.get("codebook")
    _require(_is_int(n_used, 0, 16) and isinstance(codebook, list) and len(codebook) == 16
             and all(_is_int(v, 0, 255) for v in codebook) and not any(codebook[n_used:])
             and len(set(codebook[:n_used])) == n_used, "codebook")
    _require(isinstance(config.get("coverage"), float) and 0 <= config["coverage"] <= 1, "coverage")


STREAMS = ["pk", "sm", "chunk_id", "local_pos", "esc_val"]


def _spec_extents(config: dict) -> list[tuple[str, int]]:
    """Each stream of a splitzip payload with its extent: to the next stream's offset, the last to comp_bytes."""
    s = config["streams"]
    bounds = [s[name] for name in STREAMS] + [s["esc_val"] + config["n_esc"]]
    return [(name, bounds[i + 1] - bounds[i]) for i, name in enumerate(STREAMS)]


def _spec_at_rest_config(stage: object, config: dict, length: int) -> None:
    """The at-rest table of the spec: codec, streams, frame size, one frame length per frame, the sum."""
    _require(isinstance(stage, dict) and stage.get("name") == "zstd" and isinstance(stage.get("configuration"), dict),
             "at-rest codec")
    c = stage["configuration"]
    streams, frame_size, frames = c.get("streams"), c.get("frame_size"), c.get("frames")
    _require(isinstance(streams, list) and streams and all(s in STREAMS for s in streams)
             and streams == sorted(set(streams), key=STREAMS.index), "at-rest streams")
    _require(_is_int(frame_size, 4096, 1 << 26) and isinstance(frames, list)
             and all(_is_int(f, 1) for f in frames), "frame size or frames")
    extents = dict(_spec_extents(config))
    _require(len(frames) == sum(-(-extents[s] // frame_size) for s in streams), "frame count")
    _require(sum(frames) + sum(n for s, n in extents.items() if s not in streams) == length, "stored length")
    _require(sum(extents.values()) <= 8 * length, "in-memory payload at most 8 times the stored bytes")


def _spec_zstd_frame(frame: bytes, *, limit: int, exact: bool = False) -> bytes:
    """The content of one whole zstd frame that declares its size (at most ``limit``, or exactly it) and carries a
    checksum; refused at ``open`` for a header, ``decode`` for a payload frame (``exact``)."""
    stage = "decode" if exact else "open"
    try:
        params = zstandard.get_frame_parameters(frame)
    except zstandard.ZstdError:
        raise Refused(stage, "not a zstd frame") from None
    size = params.content_size
    _require(size != zstandard.CONTENTSIZE_UNKNOWN and (size == limit if exact else size <= limit)
             and params.has_checksum, "frame size or checksum", stage)
    inflater = zstandard.ZstdDecompressor().decompressobj()
    try:
        content = inflater.decompress(frame)
    except zstandard.ZstdError:
        raise Refused(stage, "corrupt zstd frame") from None
    _require(inflater.eof and not inflater.unused_data and len(content) == size, "exactly one frame", stage)
    return content


def _spec_inflate(stored: bytes, config: dict, stage: dict) -> bytes:
    """The in-memory payload from the stored bytes of an at-rest stage (spec: "At-rest stage (1.1)")."""
    c = stage["configuration"]
    payload, cursor, lengths = bytearray(), 0, iter(c["frames"])
    for name, extent in _spec_extents(config):
        if name not in c["streams"]:
            payload += stored[cursor: cursor + extent]
            cursor += extent
            continue
        for start in range(0, extent, c["frame_size"]):
            length = next(lengths)
            payload += _spec_zstd_frame(stored[cursor: cursor + length], limit=min(c["frame_size"], extent - start),
                                        exact=True)
            cursor += length
    return bytes(payload)


def _spec_planes_config(stage: object, itemsize: int, raw_length: int, length: int) -> None:
    """The byte-plane table of the spec (1.2): codec, transform, frame size, one length per plane in its bounds,
    the sum, the 8x bound."""
    _require(isinstance(stage, dict) and stage.get("name") == "zstd_planes"
             and isinstance(stage.get("configuration"), dict), "byte-plane codec")
    c = stage["configuration"]
    transform, frame_size, planes = c.get("transform"), c.get("frame_size"), c.get("planes")
    _require(transform == "bytes" or (transform == "sign_last" and itemsize >= 2), "transform")
    _require(_is_int(frame_size, 4096, 1 << 26) and frame_size % itemsize == 0 and raw_length > 0, "frame size")
    frames = -(-raw_length // frame_size)
    _require(isinstance(planes, list) and len(planes) == frames * itemsize, "plane count")
    for i, stored in enumerate(planes):
        m = min(frame_size, raw_length - i // itemsize * frame_size) // itemsize
        _require(_is_int(stored, 1, m), "plane length")
    _require(sum(planes) == length and raw_length <= 8 * length, "stored length or the 8x bound")


def _spec_planes(stored: bytes, itemsize: int, raw_length: int, stage: dict) -> bytes:
    """A raw tensor's bytes from its byte planes (spec: "Byte planes (1.2)")."""
    c = stage["configuration"]
    lengths, cursor, out = iter(c["planes"]), 0, bytearray()
    for start in range(0, raw_length, c["frame_size"]):
        m = min(c["frame_size"], raw_length - start) // itemsize
        planes = []
        for _ in range(itemsize):
            length = next(lengths)
            piece = stored[cursor: cursor + length]
            planes.append(piece if length == m else _spec_zstd_frame(piece, limit=m, exact=True))
            cursor += length
        elements = np.frombuffer(b"".join(planes), np.uint8).reshape(itemsize, m).T.copy()
        if c["transform"] == "sign_last":  # undo the rotation left by one bit: rotate right by one
            width = 8 * itemsize
            words = [int.from_bytes(bytes(row), "little") for row in elements]
            words = [(w >> 1) | ((w & 1) << (width - 1)) for w in words]
            elements = np.frombuffer(b"".join(w.to_bytes(itemsize, "little") for w in words), np.uint8)
        out += elements.tobytes()
    return bytes(out)


def _spec_splitzip(stored: bytes, config: dict) -> bytes:
    n, n_esc, chunk = config["n"], config["n_esc"], config["chunk_size"]
    s = config["streams"]
    buf = np.frombuffer(stored, dtype=np.uint8)
    pk, sm = buf[: (n + 1) // 2].astype(np.uint16), buf[s["sm"]: s["sm"] + n].astype(np.uint16)
    code = np.stack([pk >> 4, pk & 0xF], axis=1).reshape(-1)[:n]
    exponent = np.array(config["codebook"], dtype=np.uint16)[code]
    chunk_id = np.frombuffer(stored, dtype="<i4", count=n_esc, offset=s["chunk_id"]).astype(np.int64)
    local_pos = np.frombuffer(stored, dtype="<u2", count=n_esc, offset=s["local_pos"]).astype(np.int64)
    position = chunk_id * chunk + local_pos
    _require(bool(np.all((chunk_id >= 0) & (chunk_id < -(-n // chunk)) & (local_pos < chunk) & (position < n))
                  and np.all(np.diff(position) > 0)), "escape stream", "decode")
    exponent[position] = buf[s["esc_val"]: s["esc_val"] + n_esc]  # padding and escaped nibbles are not read
    bits = ((sm & 0x80) << 8) | (exponent << 7) | (sm & 0x7F)
    return bits.astype("<u2").tobytes()


@pytest.mark.parametrize("name", CASES)
def test_a_reader_written_from_the_spec_agrees(name):
    listed = CASES[name]
    metadata, raw = _spec_decode(VECTORS / listed["szt"]["file"])
    assert metadata == listed["metadata"]
    assert list(raw) == [t["name"] for t in listed["tensors"]]
    for t in listed["tensors"]:
        assert hashlib.sha256(raw[t["name"]]).hexdigest() == t["raw_sha256"]


@pytest.mark.parametrize("name", READS)
def test_a_reader_written_from_the_spec_reads_each_read_case(name):
    base = CASES[READS[name]["base"]]
    metadata, raw = _spec_decode(VECTORS / READS[name]["szt"]["file"])
    assert metadata == base["metadata"]
    assert [hashlib.sha256(raw[t["name"]]).hexdigest() for t in base["tensors"]] == [
        t["raw_sha256"] for t in base["tensors"]]


@pytest.mark.parametrize("name", REFUSALS)
def test_a_reader_written_from_the_spec_refuses_each_refuse_case_at_its_stage(name):
    path = VECTORS / REFUSALS[name]["szt"]["file"]
    stage = REFUSALS[name]["stage"]
    if stage == "verify":
        _spec_decode(path, verify=False)  # read with checksums off
    with pytest.raises(Refused) as info:
        _spec_decode(path, verify=stage == "verify")
    assert info.value.stage == stage


# ---------------------------------------------------------------------------------------------------------------
# --check mode
# ---------------------------------------------------------------------------------------------------------------


def test_check_mode_passes_on_the_committed_vectors(capsys):
    _skip_without_torch_types(t["dtype"] for case in LISTING["cases"] for t in case["tensors"])
    assert make_vectors.main(["--check"]) == 0
    assert "all match" in capsys.readouterr().out


def test_check_mode_reports_changed_missing_and_extra_files(tmp_path, capsys):
    _skip_without_torch_types(t["dtype"] for case in LISTING["cases"] for t in case["tensors"])
    folder = tmp_path / "vectors"
    shutil.copytree(VECTORS, folder)
    data = bytearray((folder / "bf16_escapes.szt").read_bytes())
    data[5000] ^= 1
    (folder / "bf16_escapes.szt").write_bytes(bytes(data))
    (folder / "metadata.safetensors").unlink()
    (folder / "stray.bin").write_bytes(b"x")
    assert make_vectors.main(["--check", "--out", str(folder)]) == 1
    err = capsys.readouterr().err
    assert "bf16_escapes.szt: differs" in err
    assert "metadata.safetensors: missing" in err
    assert "stray.bin: not a generated file" in err
    assert "all_raw.szt" not in err


def test_inputs_do_not_depend_on_a_library_random_stream():
    """The generator's first outputs for seed 0 are SplitMix64's published ones, on any numpy version."""
    assert [hex(v) for v in make_vectors.splitmix64(0, 3)] == [
        "0xe220a8397b1dcdaf", "0x6e789e6aa1b965f4", "0x6c45d188009454f"]
