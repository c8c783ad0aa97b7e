"""Block checksums (format 1.3): the CRC-32 of each block of a tensor's stored bytes, so a read of part of a tensor
checks the blocks it reads instead of the whole payload."""

from __future__ import annotations

import zlib
from pathlib import Path

import pytest
import torch

from szformat import safe_open, save_file
from szformat.convert.verify import BLOCKS_APART, verify
from szformat.errors import ChecksumMismatchError, ConversionError, HeaderError
from szformat.format import constants as C
from szformat.format.reader import SztFile
from szformat.format.writer import SztWriter, block_size_for, writer_form, write_tensor
from szformat.loading import host_decode
from support import Forge, refused

BLOCK = 4096


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _source(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": (torch.randn(64, 512, generator=g) * 0.02).to(torch.bfloat16),   # SplitZip, 13 blocks
            "f": torch.randn(64, 250, generator=g),                               # raw F32, 16 blocks
            "s": torch.randn(8, generator=g).to(torch.bfloat16)}                  # one block: no table


def _write(path: Path, tensors: dict[str, torch.Tensor], *, at_rest: int | None = None) -> Path:
    dtypes = {torch.bfloat16: "BF16", torch.float32: "F32"}
    with SztWriter(path, block_size=BLOCK, frame_size=BLOCK, **writer_form(at_rest)) as writer:
        for name, t in tensors.items():
            write_tensor(writer, name, dtypes[t.dtype], t.shape, t.contiguous().view(-1).view(torch.uint8))
    return path


def _reads(monkeypatch, reads: str) -> None:
    """SplitZip rows of the in-memory form read through the mapping (where the C kernels guard it) or with pread."""
    if reads == "mapped" and not host_decode.mapped_reads(True):
        pytest.skip("stored bytes are copied out with pread here")
    if reads == "pread":
        monkeypatch.setattr(host_decode, "mapped_reads", lambda checked: False)


def _flip(path: Path, name: str, at: int) -> None:
    """Flip a bit of stored byte ``at`` of tensor ``name``, every checksum left as it was."""
    with SztFile(path) as f:
        where = f.entry(name).offset + at
    data = bytearray(path.read_bytes())
    data[where] ^= 0x10
    path.write_bytes(bytes(data))


def test_the_writer_gives_each_long_payload_a_table_of_its_blocks(tmp_path):
    """Each block's CRC-32 is zlib's of those stored bytes, the table joins to ``crc32``, a payload of one block has
    none, and a file with a table is a 1.3 file (one without is written as before)."""
    path = _write(tmp_path / "b.szt", _source(1))
    with SztFile(path) as f:
        assert f.version == (1, C.BLOCK_CRC_MINOR)
        assert f.entry("s").blocks is None
        data = path.read_bytes()
        for name in ("w", "f"):
            e = f.entry(name)
            stored = data[e.offset: e.offset + e.length]
            assert e.blocks.size == BLOCK and len(e.blocks.crcs) == -(-e.length // BLOCK) > 1
            assert list(e.blocks.crcs) == [zlib.crc32(stored[i: i + BLOCK]) for i in range(0, e.length, BLOCK)]
            assert e.blocks.joined(e.length) == e.crc32
    save_file({"s": torch.ones(8)}, tmp_path / "small.szt")
    with SztFile(tmp_path / "small.szt") as f:
        assert f.version == (1, 0) and f.entry("s").blocks is None


@pytest.mark.parametrize("length", [(1 << 20) + 1, 1_500_000, 6_000_000, (32 << 20) - 1, 32 << 20, 5 << 30])
def test_the_writers_blocks_are_about_a_32nd_of_a_payload_from_64_kib_to_1_mib(length):
    size = block_size_for(length)
    assert size & (size - 1) == 0 and 64 << 10 <= size <= 1 << 20
    assert -(-length // size) <= 32 if length <= 32 << 20 else size == 1 << 20
    assert size == 64 << 10 or -(-length // (size // 2)) > 32  # no smaller size keeps to 32 blocks
    assert block_size_for(length, 4096) == 4096


def test_save_file_gives_a_payload_of_a_few_mib_blocks_of_a_32nd(tmp_path):
    """A rank of a tensor-parallel load keeping half the rows of a 1.5 MB payload checks about half of it."""
    save_file({"w": torch.randn(1024, 1024).to(torch.bfloat16)}, tmp_path / "w.szt")
    with SztFile(tmp_path / "w.szt") as f:
        e = f.entry("w")
        assert e.blocks.size == 64 << 10 and len(e.blocks.crcs) == -(-e.length // (64 << 10))
        half = e.blocks.covering(e.length, [(e.layout.off_pk, e.layout.off_pk + 256 * 1024),
                                            (e.layout.off_sm, e.layout.off_sm + 512 * 1024)])
        assert sum(hi - lo for lo, hi, _ in half) < 0.6 * e.length


@pytest.mark.parametrize("size", [0, 4095, 6000, 1 << 31, True])
def test_the_writer_refuses_a_block_size_the_format_does_not_allow(tmp_path, size):
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        SztWriter(tmp_path / "x.szt", block_size=size)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("reads", ["mapped", "pread"])
@pytest.mark.parametrize("name", ["w", "f"])
def test_a_slice_checks_the_blocks_it_reads_and_only_those(tmp_path, monkeypatch, reads, name):
    """A byte flipped in a block the slice does not read leaves the slice bit-exact (the whole tensor is refused);
    one flipped in a block it reads refuses the slice, naming the block, the tensor and the file."""
    _reads(monkeypatch, reads)
    source = _source(2)
    path = _write(tmp_path / "b.szt", source)
    with SztFile(path) as f:
        e = f.entry(name)
    last = e.length - 1 if name == "f" else e.layout.off_sm + e.layout.n - 1  # the last row's bytes
    _flip(path, name, last)
    with safe_open(path, framework="pt") as f:
        assert torch.equal(_bits(f.get_slice(name)[0:4]), _bits(source[name][0:4]))
        assert torch.equal(_bits(f.get_slice(name)[2:3]), _bits(source[name][2:3]))  # checked again, still right
        with pytest.raises(ChecksumMismatchError, match="CRC-32 of the stored bytes"):
            f.get_tensor(name)
        with pytest.raises(ChecksumMismatchError, match=r"stored bytes \[\d+, \d+\)") as info:
            f.get_slice(name)[60:64]
    assert (info.value.tensor, info.value.path) == (name, str(path))


def test_a_slice_of_byte_planes_at_rest_checks_the_blocks_of_the_frames_it_reads(tmp_path):
    """At rest (1.2 byte planes, frames of 4 KiB of raw bytes) a slice reads the frames holding its rows: a flipped
    stored byte in the last frame leaves the first rows bit-exact, and refuses the last rows by their block before
    zstd sees the frame."""
    source = {"f": _source(8)["f"]}
    path = _write(tmp_path / "b.szt", source, at_rest=3)
    with SztFile(path) as f:
        e = f.entry("f")
        assert e.byte_planes and e.blocks is not None
    _flip(path, "f", e.length - 1)
    with safe_open(path, framework="pt") as f:
        assert torch.equal(_bits(f.get_slice("f")[0:4]), _bits(source["f"][0:4]))
        with pytest.raises(ChecksumMismatchError, match=r"stored bytes \[\d+, \d+\)") as info:
            f.get_slice("f")[60:64]
    assert info.value.tensor == "f"


@pytest.mark.parametrize("at_rest", [None, 3])
def test_slices_and_whole_tensors_with_tables_are_bit_exact(tmp_path, at_rest):
    source = _source(3)
    path = _write(tmp_path / "b.szt", source, at_rest=at_rest)
    with safe_open(path, framework="pt") as f:
        for name, t in source.items():
            assert torch.equal(_bits(f.get_tensor(name)), _bits(t))
            for a, b in [(0, 1), (5, 17), (t.shape[0] - 3, t.shape[0])]:
                assert torch.equal(_bits(f.get_slice(name)[a:b]), _bits(t[a:b])), (name, a, b)


def test_a_table_that_does_not_join_to_crc32_refuses_partial_reads_and_verify_says_so(tmp_path):
    """Blocks whose CRC-32s do not join to the entry's ``crc32``: a slice is refused before it trusts any block,
    ``verify`` names the tensor, and a whole read (checked against ``crc32``) is unaffected."""
    source = _source(4)
    forge = Forge.load(_write(tmp_path / "b.szt", source))
    table = forge.entry("w")["block_crc32"]["crc32"]
    table[0], table[1] = table[1], table[0]
    bad = forge.write(tmp_path / "bad.szt")
    with safe_open(bad, framework="pt") as f:
        with pytest.raises(ChecksumMismatchError, match="block checksums, joined,") as info:
            f.get_slice("w")[0:2]
        assert info.value.tensor == "w"
        assert torch.equal(_bits(f.get_tensor("w")), _bits(source["w"]))
    report = verify(bad)
    assert [(p.tensor, p.message) for p in report.problems] == [("w", BLOCKS_APART)]


@pytest.mark.parametrize("table, reason", [
    ([1, 2], "'block_crc32' must be a map"),
    ({"crc32": []}, "field 'size' must be an integer"),
    ({"size": 6000, "crc32": []}, "block_crc32 size must be a power of two"),
    ({"size": 2048, "crc32": []}, "field 'size' must be an integer in [4096"),
    ({"size": 4096, "crc32": [0]}, "block_crc32 must list 13 CRC-32s"),
    ({"size": 4096, "crc32": [True] * 13}, "block_crc32 must list 13 CRC-32s"),
    ({"size": 4096, "crc32": [1 << 32] * 13}, "block_crc32 must list 13 CRC-32s"),
    ({"size": 4096, "crc32": [-1] * 13}, "block_crc32 must list 13 CRC-32s"),
])
def test_a_malformed_table_is_refused_when_the_file_opens(tmp_path, table, reason):
    forge = Forge.load(_write(tmp_path / "b.szt", _source(5)))
    forge.entry("w")["block_crc32"] = table
    refused(forge.write(tmp_path / "bad.szt"), HeaderError, reason, tensor="w")


def test_a_file_whose_table_an_older_reader_ignores_reads_the_same_without_it(tmp_path):
    """The key is optional: the same file with every table removed reads bit for bit, checked against ``crc32``."""
    source = _source(6)
    forge = Forge.load(_write(tmp_path / "b.szt", source))
    for entry in forge.header["tensors"]:
        entry.pop("block_crc32", None)
    plain = forge.write(tmp_path / "plain.szt")
    with safe_open(plain, framework="pt") as f:
        for name, t in source.items():
            assert f.get_slice(name)[0:2].equal(t[0:2]) and f.get_tensor(name).equal(t)


def test_the_writer_refuses_blocks_that_would_not_join(tmp_path, monkeypatch):
    """The writer checks its own table against the encoder's CRC-32 before a byte of the tensor is written."""
    from szformat.format import header

    monkeypatch.setattr(header.BlockChecksums, "joined", lambda self, length: 0)
    with pytest.raises(ConversionError, match="do not join") as info:
        _write(tmp_path / "b.szt", {"w": _source(7)["w"]})
    assert info.value.tensor == "w"
    assert not list(tmp_path.iterdir())
