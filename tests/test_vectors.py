"""The golden vectors of ``spec/vectors/``: hashes, byte-exact writing, bit-exact reading, and the spec itself.

``_spec_decode`` is a second reader written from ``spec/szt-v1.md`` alone (struct, msgpack and numpy, nothing of
szformat); it must agree with szformat's reader on every vector, so the spec says what the code does.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import math
import shutil
import struct
import sys
import zlib
from pathlib import Path

import msgpack
import numpy as np
import pytest
from safetensors.torch import load_file as st_load_file

from szformat import load_file, safe_open
from szformat.api import tensor_bytes

ROOT = Path(__file__).resolve().parents[1]
VECTORS = ROOT / "spec" / "vectors"
LISTING = json.loads((VECTORS / "vectors.json").read_text(encoding="utf-8"))
CASES = {case["name"]: case for case in LISTING["cases"]}
READS = {case["name"]: case for case in LISTING["read_cases"]}
REFUSALS = {case["name"]: case for case in LISTING["refuse_cases"]}


def _load_generator():
    spec = importlib.util.spec_from_file_location("make_vectors", ROOT / "tools" / "make_vectors.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


make_vectors = _load_generator()
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
    assert sum(p.stat().st_size for p in VECTORS.iterdir()) < 1 << 20


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
    make_vectors.convert(VECTORS / listed["source"]["file"], target, alignment=listed["alignment"])
    assert target.read_bytes() == (VECTORS / listed["szt"]["file"]).read_bytes()


@pytest.mark.parametrize("name", CASES)
def test_the_converter_reproduces_each_szt_file_byte_for_byte(name, tmp_path):
    from szformat.convert.convert import convert

    listed = CASES[name]
    target = tmp_path / "out.szt"
    convert(VECTORS / listed["source"]["file"], target, alignment=listed["alignment"])
    assert target.read_bytes() == (VECTORS / listed["szt"]["file"]).read_bytes()


@pytest.mark.parametrize("name", CASES)
def test_reader_decodes_each_szt_file_to_its_source(name):
    listed = CASES[name]
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


def _spec_decode(path: Path) -> tuple[dict | None, dict[str, bytes]]:
    """Metadata and raw bytes of each tensor of a .szt file, following spec/szt-v1.md step by step."""
    data = path.read_bytes()
    magic, major, _minor, flags, h_off, h_len, h_crc, align, file_len = struct.unpack_from("<8sHHIQQIIQ", data)
    assert magic == b"\x89SZT\r\n\x1a\n" and major == 1 and flags == 0 and data[48:64] == bytes(16)
    assert h_off + h_len == file_len == len(data) and zlib.crc32(data[h_off:]) == h_crc
    header = msgpack.unpackb(data[h_off:], raw=False)
    out: dict[str, bytes] = {}
    cursor = 64
    for e in header["tensors"]:
        assert e["offset"] == -(-cursor // align) * align
        cursor = e["offset"] + e["length"]
        stored = data[e["offset"]: cursor]
        assert zlib.crc32(stored) == e["crc32"]
        if e["encoding"]["name"] == "raw":
            raw = stored
        else:
            raw = _spec_splitzip(stored, e["encoding"]["configuration"])
        assert len(raw) == math.prod(e["shape"]) * ITEMSIZE[e["dtype"]] == e["raw_length"]
        assert zlib.crc32(raw) == e["raw_crc32"]
        out[e["name"]] = raw
    assert cursor == h_off
    return header.get("metadata"), out


def _align4(x: int) -> int:
    return (x + 3) // 4 * 4


def _spec_splitzip(stored: bytes, config: dict) -> bytes:
    n, n_esc, chunk = config["n"], config["n_esc"], config["chunk_size"]
    off_sm = _align4((n + 1) // 2)
    off_cid = _align4(off_sm + n)
    off_lpos = off_cid + 4 * n_esc
    off_ev = _align4(off_lpos + 2 * n_esc)
    assert config["streams"] == {"pk": 0, "sm": off_sm, "chunk_id": off_cid, "local_pos": off_lpos,
                                 "esc_val": off_ev}
    assert len(stored) == off_ev + n_esc
    buf = np.frombuffer(stored, dtype=np.uint8)
    pk, sm = buf[: (n + 1) // 2].astype(np.uint16), buf[off_sm: off_sm + n].astype(np.uint16)
    code = np.stack([pk >> 4, pk & 0xF], axis=1).reshape(-1)[:n]
    exponent = np.array(config["codebook"], dtype=np.uint16)[code]
    chunk_id = np.frombuffer(stored, dtype="<i4", count=n_esc, offset=off_cid).astype(np.int64)
    local_pos = np.frombuffer(stored, dtype="<u2", count=n_esc, offset=off_lpos).astype(np.int64)
    position = chunk_id * chunk + local_pos
    assert np.all(local_pos < chunk) and np.all(position < n) and np.all(np.diff(position) > 0)
    exponent[position] = buf[off_ev: off_ev + n_esc]  # padding and escaped elements' nibbles are not read
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


# ---------------------------------------------------------------------------------------------------------------
# --check mode
# ---------------------------------------------------------------------------------------------------------------


def test_check_mode_passes_on_the_committed_vectors(capsys):
    assert make_vectors.main(["--check"]) == 0
    assert "all match" in capsys.readouterr().out


def test_check_mode_reports_changed_missing_and_extra_files(tmp_path, capsys):
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
