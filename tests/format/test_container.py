"""The container: the writer's stages and refusals, alignment and placement, atomic output, determinism, and the
spec's tables against the constants."""

from __future__ import annotations

import dataclasses
import errno
import io
import math
import os
import re
import struct
import zlib
from pathlib import Path

import msgpack
import pytest
import torch

from szformat.format.writer import tensor_bytes, write_tensor
from szformat.codec.layout import PayloadLayout
from szformat.codec.gate import EncodedTensor, encode_tensor
from szformat.errors import ConversionError, DecodeRouteError, HeaderError, SzformatError, WriteError
from szformat.format import constants as C
from szformat.format.header import Header, parse_header
from szformat.format.reader import SztFile
from szformat.format.writer import SztWriter, WriterState

ROOT = Path(__file__).resolve().parents[2]


def bf16_weight(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, cols, generator=g) * 0.02).to(torch.bfloat16)


def encoded(t: torch.Tensor, dtype: str) -> EncodedTensor:
    return encode_tensor(tensor_bytes(t), dtype)


def write(path: Path, tensors: dict[str, tuple[str, torch.Tensor]], **kw) -> Path:
    with SztWriter(path, **kw) as w:
        for name, (dtype, t) in tensors.items():
            write_tensor(w, name, dtype, t.shape, tensor_bytes(t))
    return path


TENSORS = {
    "a": ("BF16", bf16_weight(64, 96, seed=1)),
    "empty": ("F32", torch.zeros(0, 4)),
    "b": ("U8", torch.arange(7, dtype=torch.uint8)),
    "c": ("BF16", bf16_weight(3, 1001, seed=2)),
    "scalar": ("F64", torch.tensor(2.5, dtype=torch.float64)),
}


def temporaries(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if p.name.endswith(".tmp")]


# ---------------------------------------------------------------------------------------------------------------
# Preamble, placement, alignment
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("alignment", [64, 4096, 65536])
def test_payloads_follow_the_placement_rule(tmp_path, alignment):
    path = write(tmp_path / "m.szt", TENSORS, alignment=alignment)
    data = path.read_bytes()
    magic, major, minor, flags, h_off, h_len, h_crc, align, file_len = struct.unpack_from("<8sHHIQQIIQ", data)
    assert (magic, major, minor, flags, align) == (C.MAGIC, 1, 0, 0, alignment)
    assert data[48:64] == bytes(16)
    assert h_off + h_len == file_len == len(data) and zlib.crc32(data[h_off:]) == h_crc
    cursor = 64
    for e in msgpack.unpackb(data[h_off:])["tensors"]:
        assert e["offset"] % alignment == 0
        assert e["offset"] == -(-cursor // alignment) * alignment
        assert data[cursor: e["offset"]] == bytes(e["offset"] - cursor)  # zero padding
        cursor = e["offset"] + e["length"]
    assert cursor == h_off


def test_a_file_without_tensors_has_its_header_right_after_the_preamble(tmp_path):
    path = write(tmp_path / "none.szt", {}, metadata={"k": "v"})
    data = path.read_bytes()
    assert struct.unpack_from("<Q", data, 16)[0] == 64
    assert msgpack.unpackb(data[64:]) == {"tensors": [], "metadata": {"k": "v"}}


def test_preamble_struct_matches_the_offsets_of_the_spec():
    fields = C.PREAMBLE.pack(C.MAGIC, 0x0102, 0x0304, 0x05060708, 0x1111, 0x2222, 0x3333, 0x4444, 0x5555)
    assert len(fields) == C.PREAMBLE_SIZE == 64
    assert fields[8:10] == b"\x02\x01" and fields[10:12] == b"\x04\x03" and fields[12:16] == b"\x08\x07\x06\x05"
    assert struct.unpack_from("<QQIIQ", fields, 16) == (0x1111, 0x2222, 0x3333, 0x4444, 0x5555)
    assert fields[C.RESERVED_OFFSET:] == bytes(16)


def _spec_table(heading: str) -> list[list[str]]:
    """Rows of the first markdown table after ``heading`` in spec/szt-v1.md, cells stripped, header row dropped."""
    text = (ROOT / "spec" / "szt-v1.md").read_text(encoding="utf-8")
    section = text[text.index(heading):]
    rows = []
    for line in section.splitlines()[1:]:
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip("|").split("|")])
        elif rows:
            break
    return rows[2:]


def test_spec_preamble_table_agrees_with_the_constants():
    rows = _spec_table("## Preamble")
    layout = [(int(r[0]), int(r[1]), r[3].strip("`")) for r in rows]
    assert layout == [(0, 8, "magic"), (8, 2, "major"), (10, 2, "minor"), (12, 4, "flags"), (16, 8, "header_offset"),
                      (24, 8, "header_length"), (32, 4, "header_crc32"), (36, 4, "alignment"),
                      (40, 8, "file_length"), (48, 16, "reserved")]
    assert sum(size for _, size, _ in layout) == C.PREAMBLE.size
    magic_cell = rows[0][4]
    assert bytes.fromhex(magic_cell.split("`")[1]) == C.MAGIC
    assert str(C.MAX_HEADER_BYTES) in rows[5][4] and str(C.MAX_ALIGNMENT) in rows[7][4]


def test_spec_dtype_table_agrees_with_the_constants():
    listed = {}
    for size, names in _spec_table("### Dtypes"):
        for name in re.findall(r"`([A-Z0-9_]+)`", names):
            listed[name] = int(size)
    assert listed == {name: size for name, (_, size) in C.DTYPES.items()}


def test_spec_limits_agree_with_the_constants():
    limits = {r[0]: r[1] for r in _spec_table("## Limits")}
    assert limits["tensors per file"] == f"{C.MAX_TENSORS:,}"
    assert limits["dimensions of a shape"] == str(C.MAX_NDIM)
    assert limits["tensor name"] == f"{C.MAX_NAME_BYTES:,} UTF-8 bytes"
    assert limits["entries of any msgpack map, `metadata`"] == f"{C.MAX_METADATA_ENTRIES:,}"
    assert limits["each dimension, elements of a tensor"] == "2^56" and C.MAX_ELEMENTS == 1 << 56
    assert str(C.HEADER_BYTES_PER_CONTAINER) in limits["maps and arrays in the header"]
    assert limits["nesting of maps and arrays"].startswith(f"{C.MAX_HEADER_DEPTH} levels")
    assert limits["elements of a `splitzip` tensor"].startswith("2^41") and PayloadLayout.max_elements() == 1 << 41


def _depth(value) -> int:
    if isinstance(value, (dict, list)):
        return 1 + max(map(_depth, value.values() if isinstance(value, dict) else value), default=0)
    return 0


def test_a_written_header_nests_as_deep_as_the_spec_says(tmp_path):
    path = write(tmp_path / "m.szt", TENSORS, metadata={"format": "pt"})
    data = path.read_bytes()
    header = msgpack.unpackb(data[struct.unpack_from("<Q", data, 16)[0]:])
    assert _depth(header) == 6 <= C.MAX_HEADER_DEPTH
    assert "A 1.0 header nests 6" in (ROOT / "spec" / "szt-v1.md").read_text(encoding="utf-8")


# ---------------------------------------------------------------------------------------------------------------
# Header schema
# ---------------------------------------------------------------------------------------------------------------


def test_header_round_trips_through_msgpack(tmp_path):
    path = write(tmp_path / "m.szt", TENSORS, metadata={"format": "pt"})
    with SztFile(path) as f:
        header = f.header
        again = parse_header(header.to_bytes(), path=path, alignment=f.alignment,
                             header_offset=struct.unpack_from("<Q", path.read_bytes(), 16)[0])
    assert again == header
    assert [t.name for t in header.tensors] == list(TENSORS)
    entry = header.tensors[0]
    assert entry.encoding == "splitzip" and entry.layout.n == 64 * 96 and entry.codebook.n_used <= 16


def test_parsed_entries_are_what_the_dataclass_would_make(tmp_path):
    """The parser builds its entries without TensorEntry's generated __init__: each must hold exactly the fields,
    defaults included, that __init__ gives, and stay frozen."""
    path = write(tmp_path / "m.szt", TENSORS)
    with SztFile(path) as f:
        entries = f.header.tensors
    assert {e.encoding for e in entries} == {"splitzip", "raw"}
    for entry in entries:
        made = dataclasses.replace(entry)  # through __init__
        assert vars(entry) == vars(made) and entry == made and hash(entry) == hash(made)
        with pytest.raises(dataclasses.FrozenInstanceError):
            entry.length = 0


def test_a_header_is_parsed_with_the_collector_paused(tmp_path, monkeypatch, collector_on):
    """The unpacked tree, freed once parsed, would otherwise set off collections of the whole process; the collector
    is on again after a parse, or a refusal, and stays off where the program turned it off."""
    import gc

    import szformat.format.header as header_module

    tensors = {f"layers.{i}.weight": ("BF16", torch.full((4,), float(i), dtype=torch.bfloat16)) for i in range(20)}
    path = write(tmp_path / "m.szt", tensors)
    with SztFile(path) as f:
        raw, alignment = f.header.to_bytes(), f.alignment
    offset = struct.unpack_from("<Q", path.read_bytes(), 16)[0]
    collecting: list[bool] = []
    for made_by in ("_parse_entry", "_plain_entries"):  # the C extension's entries, or the Python parser's
        real = getattr(header_module, made_by)
        monkeypatch.setattr(header_module, made_by, lambda *args, real=real, **kwargs:
                            collecting.append(gc.isenabled()) or real(*args, **kwargs))
    parse_header.__wrapped__(raw, path=path, alignment=alignment, header_offset=offset)
    assert collecting and all(collecting)  # the control: unpaused
    collecting.clear()
    assert len(parse_header(raw, path=path, alignment=alignment, header_offset=offset).tensors) == 20
    assert collecting and not any(collecting) and gc.isenabled()
    with pytest.raises(HeaderError, match="header must be a map"):
        parse_header(msgpack.packb([1, 2]), path=path, alignment=alignment, header_offset=offset)
    assert gc.isenabled()
    gc.disable()
    parse_header(raw, path=path, alignment=alignment, header_offset=offset)
    assert not gc.isenabled()


def test_header_key_order_is_what_the_spec_lists(tmp_path):
    path = write(tmp_path / "m.szt", TENSORS, metadata={"format": "pt"})
    data = path.read_bytes()
    header = msgpack.unpackb(data[struct.unpack_from("<Q", data, 16)[0]:])
    assert list(header) == ["tensors", "metadata"]
    assert list(header["tensors"][0]) == ["name", "dtype", "shape", "encoding", "offset", "length", "raw_length",
                                          "crc32", "raw_crc32"]
    assert list(header["tensors"][0]["encoding"]["configuration"]) == [
        "chunk_size", "n", "n_esc", "codebook", "n_codes_used", "coverage", "streams"]
    assert header["tensors"][2]["encoding"] == {"name": "raw", "configuration": {"reason": "dtype U8 is not encoded"}}


def test_entry_torch_dtype_names_file_and_tensor_when_torch_lacks_it(tmp_path, monkeypatch):
    path = write(tmp_path / "m.szt", TENSORS)
    with SztFile(path) as f:
        entry = f.entry("a")
    assert entry.torch_dtype(path) is torch.bfloat16
    monkeypatch.setitem(C.DTYPES, "BF16", (None, 2))
    with pytest.raises(DecodeRouteError, match="dtype BF16 has no torch equivalent") as info:
        entry.torch_dtype(path)
    assert info.value.tensor == "a" and "m.szt" in str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# Writer stages and refusals
# ---------------------------------------------------------------------------------------------------------------


def test_writer_stages(tmp_path):
    path = tmp_path / "m.szt"
    w = SztWriter(path)
    assert w.state is WriterState.OPEN and not path.exists() and len(temporaries(tmp_path)) == 1
    entry = write_tensor(w, "a", "U8", (3,), torch.arange(3, dtype=torch.uint8))
    assert entry.offset == C.DEFAULT_ALIGNMENT and w.entries == [entry]
    assert w.finish() == path
    assert w.state is WriterState.FINISHED and path.exists() and temporaries(tmp_path) == []
    with pytest.raises(RuntimeError, match="is finished; expected it open"):
        write_tensor(w, "b", "U8", (1,), torch.zeros(1, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="is finished"):
        w.finish()
    w.abort()  # no effect once finished
    assert path.exists()


def test_abort_removes_the_temporary_file_and_keeps_the_target(tmp_path):
    path = tmp_path / "m.szt"
    path.write_bytes(b"old contents")
    w = SztWriter(path)
    write_tensor(w, "a", "U8", (3,), torch.arange(3, dtype=torch.uint8))
    w.abort()
    assert w.state is WriterState.ABORTED and temporaries(tmp_path) == []
    assert path.read_bytes() == b"old contents"
    with pytest.raises(RuntimeError, match="is aborted"):
        w.finish()


def test_an_exception_in_the_with_block_leaves_nothing(tmp_path):
    path = tmp_path / "m.szt"
    with pytest.raises(KeyboardInterrupt):
        with SztWriter(path) as w:
            write_tensor(w, "a", "U8", (3,), torch.arange(3, dtype=torch.uint8))
            raise KeyboardInterrupt
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("alignment", [32, 100, 1 << 22, 4096.0, True, "4096"])
def test_writer_refuses_bad_alignment(tmp_path, alignment):
    with pytest.raises(ValueError, match="alignment must be a power of two"):
        SztWriter(tmp_path / "m.szt", alignment=alignment)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("metadata", [{"a": 1}, {1: "a"}, ["a"], {"a": "\udc80"}])
def test_writer_refuses_bad_metadata(tmp_path, metadata):
    with pytest.raises(ConversionError, match="metadata"):
        SztWriter(tmp_path / "m.szt", metadata=metadata)
    assert list(tmp_path.iterdir()) == []


U8 = torch.arange(4, dtype=torch.uint8)


@pytest.mark.parametrize("name, dtype, shape, reason", [
    ("", "U8", (4,), "non-empty string"),
    (3, "U8", (4,), "non-empty string"),
    ("a\x00", "U8", (4,), "NUL"),
    ("\udc80", "U8", (4,), "lone surrogate"),
    ("__metadata__", "U8", (4,), "reserved"),
    ("x" * (C.MAX_NAME_BYTES + 1), "U8", (4,), "more than the limit"),
    ("dup", "U8", (4,), "already written"),
    ("t", "U9", (4,), "unknown dtype 'U9'"),
    ("t", "U8", (5,), "do not match shape [5] of U8"),
    ("t", "U8", (-4,), "not an integer in"),
    ("t", "U8", (4.0,), "holds something other than integers"),
    ("t", "U8", (1,) * 33 + (4,), "more than the limit of 32"),
])
def test_writer_refuses_a_bad_tensor_and_stays_usable(tmp_path, name, dtype, shape, reason):
    path = tmp_path / "m.szt"
    with SztWriter(path) as w:
        write_tensor(w, "dup", "U8", (4,), U8)
        with pytest.raises(ConversionError, match=re.escape(reason)) as info:
            w.add(name, dtype, shape, encode_tensor(U8, "U8"))
        assert "m.szt" in str(info.value) and isinstance(info.value, ValueError)
        write_tensor(w, "after", "U8", (4,), U8)
    with SztFile(path) as f:
        assert list(f.entries) == ["dup", "after"]


def test_writer_refuses_an_encoded_tensor_that_contradicts_itself(tmp_path):
    good = encoded(bf16_weight(8, 64, seed=3), "BF16")
    assert good.encoding == "splitzip"
    with SztWriter(tmp_path / "m.szt") as w:
        short = EncodedTensor("raw", U8[:3], 4, good.raw_crc32, good.raw_crc32)
        with pytest.raises(ConversionError, match="raw payload of 3 bytes does not match", ) as info:
            w.add("short", "U8", (4,), short)
        assert info.value.tensor == "short"
        with pytest.raises(ConversionError, match="splitzip payload"):
            w.add("not_bf16", "F16", (8, 64), good)
        with pytest.raises(ConversionError, match="unknown encoding 'zstd'"):
            w.add("z", "U8", (4,), EncodedTensor("zstd", U8, 4, 0, 0))


def test_header_over_the_limit_aborts_the_file(tmp_path, monkeypatch):
    path = tmp_path / "m.szt"
    monkeypatch.setattr(C, "MAX_HEADER_BYTES", 100)
    with pytest.raises(WriteError, match="exceeds the format's limit of 100"):
        write(path, {f"t{i}": ("U8", U8) for i in range(10)})
    assert list(tmp_path.iterdir()) == []


def test_a_failing_rename_leaves_nothing_and_keeps_the_target(tmp_path, monkeypatch):
    path = tmp_path / "m.szt"
    path.write_bytes(b"old")

    def refuse(*args):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(WriteError, match="cannot finish the file") as info:
        write(path, TENSORS)
    assert isinstance(info.value, OSError) and isinstance(info.value, SzformatError)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.szt"] and path.read_bytes() == b"old"


class _DiskFullRaw(io.RawIOBase):
    """A raw file that takes ``budget`` bytes, then fails every write like a full disk (flushes on close too)."""

    def __init__(self, fd: int, budget: int):
        self._fd, self._budget = fd, budget

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        return os.lseek(self._fd, offset, whence)

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if size > self._budget:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._budget -= size
        return os.write(self._fd, data)

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
        super().close()


@pytest.mark.parametrize("budget", [0, 100, 200])
def test_a_full_disk_is_a_write_error_even_when_buffered_bytes_cannot_be_flushed(tmp_path, monkeypatch, budget):
    path = tmp_path / "m.szt"
    path.write_bytes(b"old")
    monkeypatch.setattr(os, "fdopen", lambda fd, mode="r", *a, **kw: io.BufferedWriter(_DiskFullRaw(fd, budget)))
    with pytest.raises(WriteError, match="No space left on device") as info:
        write(path, TENSORS)
    assert isinstance(info.value, OSError)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.szt"] and path.read_bytes() == b"old"


def test_a_missing_folder_is_a_write_error(tmp_path):
    with pytest.raises(WriteError, match="cannot create a temporary file"):
        SztWriter(tmp_path / "absent" / "m.szt")


def test_output_permissions_follow_the_umask(tmp_path):
    old = os.umask(0o027)
    try:
        path = write(tmp_path / "m.szt", {"b": ("U8", U8)})
    finally:
        os.umask(old)
    assert path.stat().st_mode & 0o777 == 0o640


# ---------------------------------------------------------------------------------------------------------------
# Determinism
# ---------------------------------------------------------------------------------------------------------------


def test_the_same_tensors_give_the_same_bytes(tmp_path):
    first = write(tmp_path / "one.szt", TENSORS, metadata={"format": "pt"})
    second = write(tmp_path / "two.szt", {k: (d, t.clone()) for k, (d, t) in TENSORS.items()},
                   metadata={"format": "pt"})
    assert first.read_bytes() == second.read_bytes()


def test_entries_record_the_checksums_of_their_bytes(tmp_path):
    path = write(tmp_path / "m.szt", TENSORS)
    data = path.read_bytes()
    with SztFile(path) as f:
        for name, (_, t) in TENSORS.items():
            e = f.entry(name)
            assert zlib.crc32(data[e.offset: e.offset + e.length]) == e.crc32
            assert zlib.crc32(tensor_bytes(t).numpy()) == e.raw_crc32
            assert e.raw_length == t.numel() * t.element_size() == math.prod(e.shape) * C.itemsize(e.dtype)


def test_header_dataclass_defaults():
    assert msgpack.unpackb(Header(tensors=[]).to_bytes()) == {"tensors": []}
    assert msgpack.unpackb(Header(tensors=[], metadata={}).to_bytes()) == {"tensors": [], "metadata": {}}


def test_unknown_keys_may_nest_16_levels_and_no_deeper():
    """The spec: 16 levels, the top map counted, inside unknown keys' values too; deeper is refused."""
    def header(depth: int) -> bytes:
        pad = msgpack.packb("pad") + msgpack.packb("x" * 400)  # room for the containers under the header's budget
        return (b"\x83" + pad + msgpack.packb("tensors") + b"\x90" + msgpack.packb("later") + b"\x91" * (depth - 1)
                + b"\xc0")

    assert parse_header(header(16), path="x.szt", alignment=64, header_offset=64).tensors == []
    with pytest.raises(HeaderError, match=r"nests maps and arrays deeper than 16 levels \(the top map counted\)"):
        parse_header(header(17), path="x.szt", alignment=64, header_offset=64)
