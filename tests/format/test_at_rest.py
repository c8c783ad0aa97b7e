"""The at-rest form (.szt 1.1): zstd frames of the packed codes, small payloads packed, and every reader path.

Bit-exactness against the source on every path; forged files for every way the stage can be wrong, each refused
with the package's error naming file and tensor; a 1.0 reader (this reader without the 1.1 features and flag)
refusing a 1.1 file. The files forged here keep their header as msgpack (the writer's ``compress_header`` off) so
the forge can edit it; the header through zstd has cases of its own at the end.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import msgpack
import pytest
import torch
import zstandard
from safetensors.torch import save_file as st_save_file

import szformat
from szformat.cli.main import main as szconvert
from szformat.convert import decompress, repack, verify
from szformat.codec.layout import PayloadLayout
from szformat.errors import (ChecksumMismatchError, ConversionError, DecodeRouteError, HeaderError, PayloadError,
                             TensorAllocationError, UnknownEncodingError, UnsupportedVersionError)
from szformat.format import at_rest
from szformat.format import constants as C
from szformat.format.reader import SztFile
from szformat.format.writer import SztWriter, tensor_bytes, write_tensor, writer_form
from support import Forge, assert_same_tensors, peak_memory, refused, write_at_rest
from tools.make_vectors import Parts, restage_zeros


FRAME = at_rest.MIN_FRAME_SIZE


def _weights(rows: int, cols: int, seed: int) -> torch.Tensor:
    """Normal BF16 values like trained weights (their exponents cluster, so the packed codes compress), with
    escapes (zero, subnormal, Inf, NaN, huge) spread over several chunks."""
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows * cols, generator=g) * 0.02).to(torch.bfloat16)
    specials = torch.tensor([0.0, 1e-40, float("inf"), float("nan"), 1e30, -3e20], dtype=torch.bfloat16)
    x[torch.randperm(rows * cols, generator=g)[:24]] = specials.repeat(4)
    return x.reshape(rows, cols)


SOURCE = {
    "w": _weights(100, 400, seed=2),  # pk of 20,000 bytes: 5 frames of 4 KiB
    "small": _weights(3, 1000, seed=3),  # one frame
    "b": torch.arange(5, dtype=torch.float32),  # raw: no stage
    "empty": torch.zeros(0, 3, dtype=torch.bfloat16),
}


@pytest.fixture(scope="module")
def valid_file(tmp_path_factory) -> Path:
    return write_at_rest(SOURCE, tmp_path_factory.mktemp("at-rest") / "valid.szt")


# ---------------------------------------------------------------------------------------------------------------
# The form and its round trips
# ---------------------------------------------------------------------------------------------------------------


def test_the_valid_file_is_a_1_1_file_with_frames(valid_file):
    with SztFile(valid_file) as f:
        assert f.version == (1, 1) and f.at_rest
        assert sorted(f.header.required_features) == sorted([C.FEATURE_AT_REST_ZSTD, C.FEATURE_SMALL_ALIGNMENT])
        w = f.entry("w")
        assert w.at_rest.streams == ("pk",) and len(w.at_rest.frames) == 5
        assert w.length < w.memory_length == w.layout.comp_bytes
        assert f.entry("b").at_rest is None and f.entry("empty").at_rest is None
        assert f.entry("small").offset % 16 == 0 and f.entry("small").offset % 4096 != 0  # packed after "w"
        assert torch.equal(f.memory_payload("w"), szformat.codec.cpu.encode(SOURCE["w"])[0])


def test_every_cpu_path_is_exact(valid_file, tmp_path):
    assert_same_tensors(szformat.load_file(valid_file), SOURCE)
    assert_same_tensors(szformat.load_file(valid_file, verify=False), SOURCE)
    assert not verify(valid_file).problems
    restored = decompress(valid_file, tmp_path / "out.safetensors").output
    from safetensors.torch import load_file
    assert_same_tensors(load_file(restored), SOURCE)


def test_a_slice_inflates_only_the_frames_it_reads(valid_file, monkeypatch):
    inflated = []
    real = at_rest._inflate_frames
    monkeypatch.setattr(at_rest, "_inflate_frames", lambda stored, run, out, dctx: (
        inflated.extend(seg.memory_length for seg in run), real(stored, run, out, dctx)))
    with szformat.safe_open(valid_file, "pt") as f:
        rows = f.get_slice("w")[10:12]
        assert torch.equal(rows.view(torch.int16), SOURCE["w"][10:12].view(torch.int16))
        assert len(inflated) == 1  # rows 10-11: pk bytes 2000-2400, inside the first frame
        inflated.clear()
        assert torch.equal(f.get_slice("w")[99].view(torch.int16), SOURCE["w"][99].view(torch.int16))
        assert len(inflated) == 1
        inflated.clear()
        assert torch.equal(f.get_tensor("w").view(torch.int16), SOURCE["w"].view(torch.int16))
        assert len(inflated) == 5


def test_save_file_and_repack_move_between_the_forms_without_reencoding(tmp_path):
    memory, rest = tmp_path / "m.szt", tmp_path / "r.szt"
    szformat.save_file(SOURCE, memory, {"format": "pt"})
    szformat.save_file(SOURCE, rest, {"format": "pt"}, at_rest="zstd:3")
    with SztFile(memory) as f:
        assert f.version == (1, 0) and not f.at_rest and not f.header.required_features
    with SztFile(rest) as f:
        assert f.entry("w").at_rest.level == 3
    back = repack(rest, tmp_path / "back.szt", at_rest=None).output
    assert back.read_bytes() == memory.read_bytes()
    again = repack(memory, tmp_path / "again.szt", at_rest=3).output
    assert again.read_bytes() == rest.read_bytes()
    assert rest.stat().st_size < memory.stat().st_size
    with pytest.raises(ConversionError, match="not supported"):
        szformat.save_file(SOURCE, tmp_path / "x.szt", at_rest="lz4")


def test_the_command_line_converts_repacks_and_shows_both_ratios(tmp_path, capsys):
    from safetensors.torch import save_file
    source = tmp_path / "model.safetensors"
    save_file(SOURCE, source)
    assert szconvert([str(source), str(tmp_path / "rest.szt"), "--at-rest", "zstd:2", "-q"]) == 0
    assert szconvert(["repack", str(tmp_path / "rest.szt"), str(tmp_path / "memory.szt"), "--at-rest", "none",
                      "-q"]) == 0
    assert szconvert(["info", str(tmp_path / "rest.szt")]) == 0
    shown = capsys.readouterr().out
    assert "szt 1.1" in shown and "in memory (ratio 0." in shown and "at rest (ratio 0." in shown
    assert szconvert(["info", str(tmp_path / "memory.szt")]) == 0
    shown = capsys.readouterr().out
    assert "szt 1.0" in shown and "at rest" not in shown
    assert szconvert([str(source), str(tmp_path / "x.szt"), "--at-rest", "zstd:99"]) == 1
    assert "--at-rest: zstd level must be in" in capsys.readouterr().err


def test_repack_does_not_suggest_a_cast_it_cannot_make(tmp_path, capsys):
    """A checkpoint mostly of F32 is told about ``--cast bf16`` when converted; ``repack`` takes no such option."""
    from safetensors.torch import save_file
    source = tmp_path / "model.safetensors"
    save_file({"w": torch.randn(64, 64), "b": torch.randn(64, 64).to(torch.bfloat16)}, source)
    assert szconvert([str(source), str(tmp_path / "m.szt")]) == 0
    assert "--cast bf16" in capsys.readouterr().out
    assert szconvert(["repack", str(tmp_path / "m.szt"), str(tmp_path / "rest.szt")]) == 0
    shown = capsys.readouterr().out
    assert "Wrote" in shown and "--cast" not in shown


# ---------------------------------------------------------------------------------------------------------------
# A 1.0 reader, and forged 1.1 headers
# ---------------------------------------------------------------------------------------------------------------


def test_a_1_0_reader_refuses_a_1_1_file_by_feature(valid_file, monkeypatch):
    monkeypatch.setattr(C, "FEATURES", frozenset())  # what a 1.0 reader implements
    e = refused(valid_file, UnsupportedVersionError, "at_rest_zstd", "small_alignment", "upgrade szformat")
    assert "does not implement" in str(e)


def test_stage_without_its_required_feature(forge, bad):
    forge.header["required_features"].remove(C.FEATURE_AT_REST_ZSTD)
    refused(forge.write(bad, minor=1), HeaderError, "at_rest_zstd", "not among the required features", tensor="w")


def test_small_alignment_without_its_feature_or_out_of_range(forge, bad):
    forge.header["required_features"].remove(C.FEATURE_SMALL_ALIGNMENT)
    refused(forge.write(bad, minor=1), HeaderError, "'small_alignment' is set")
    forge.header["required_features"].append(C.FEATURE_SMALL_ALIGNMENT)
    forge.header["small_alignment"] = 4096
    refused(forge.write(bad, minor=1), HeaderError, "'small_alignment' must be a power of two")
    del forge.header["small_alignment"]
    refused(forge.write(bad, minor=1), HeaderError, "'small_alignment' is listed without 'small_alignment'")


def test_unknown_at_rest_codec(forge, bad):
    forge.entry("w")["encoding"]["at_rest"]["name"] = "brotli"
    refused(forge.write(bad, minor=1), UnknownEncodingError, "'brotli' is not known", tensor="w")


def test_at_rest_on_a_raw_tensor(forge, bad):
    forge.entry("b")["encoding"]["at_rest"] = forge.entry("w")["encoding"]["at_rest"]
    refused(forge.write(bad, minor=1), HeaderError, "'zstd' does not apply to a raw tensor", tensor="b")


@pytest.mark.parametrize("change, reason", [
    (lambda c: c["frames"].pop(), "lists 4 frames"),
    (lambda c: c["frames"].__setitem__(0, c["frames"][0] + 1), "add up to"),
    (lambda c: c["frames"].__setitem__(0, 0), "positive integers"),
    (lambda c: c.__setitem__("frame_size", 100), "'frame_size' must be"),
    (lambda c: c.__setitem__("frame_size", 1 << 40), "'frame_size' must be"),
    (lambda c: c.__setitem__("streams", ["sm", "pk"]), "payload order"),
    (lambda c: c.__setitem__("streams", ["pk", "pk"]), "distinct"),
    (lambda c: c.__setitem__("streams", ["exponents"]), "stream names"),
    (lambda c: c.__setitem__("level", "max"), "'level' must be"),
])
def test_frame_lists_that_do_not_fit_the_layout(forge, bad, change, reason):
    change(forge.entry("w")["encoding"]["at_rest"]["configuration"])
    refused(forge.write(bad, minor=1), HeaderError, reason, tensor="w")


def _frames(forge: Forge, name: str) -> list[tuple[int, int]]:
    """(offset in the file, length) of each zstd frame of tensor ``name``."""
    e = forge.entry(name)
    cursor, frames = e["offset"], []
    for length in e["encoding"]["at_rest"]["configuration"]["frames"]:
        frames.append((cursor, length))
        cursor += length
    return frames


def test_frame_lengths_that_lie_about_where_frames_end(forge, bad):
    """Moving a byte from frame 0 to frame 1 keeps every sum right: each frame then ends early or runs on."""
    config = forge.entry("w")["encoding"]["at_rest"]["configuration"]
    config["frames"][0] -= 1
    config["frames"][1] += 1
    refused(forge.write(bad, minor=1), PayloadError, "zstd frame", tensor="w", verify=False)


@pytest.mark.parametrize("verify", [True, False])
def test_a_corrupt_frame(forge, bad, verify):
    offset, length = _frames(forge, "w")[2]
    forge.body[offset + length // 2] ^= 0x5A  # the stored CRC no longer matches; zstd's checksum neither
    error = ChecksumMismatchError if verify else PayloadError
    refused(forge.write(bad, minor=1), error, tensor="w", verify=verify)


def test_a_corrupt_frame_with_a_matching_stored_crc(forge, bad):
    offset, length = _frames(forge, "w")[1]
    forge.payload_at("w", offset - forge.entry("w")["offset"] + length // 2,
                     bytes([forge.body[offset + length // 2] ^ 0x5A]))
    refused(forge.write(bad, minor=1), PayloadError, "zstd frame", tensor="w")


def _streamed(data: bytes) -> bytes:
    """A zstd frame written by a streaming compressor: no content size in its header."""
    compressor = zstandard.ZstdCompressor(write_checksum=True).compressobj()
    return compressor.compress(data) + compressor.flush()


def _replace_frame(forge: Forge, name: str, index: int, frame: bytes) -> None:
    """Put ``frame`` in place of frame ``index`` (the same length: padded or cut) and fix the stored CRC."""
    offset, length = _frames(forge, name)[index]
    frame = (frame + bytes(length))[:length]
    forge.payload_at(name, offset - forge.entry(name)["offset"], frame)


def test_a_decompression_bomb_is_refused_before_anything_is_allocated(forge, bad):
    """A frame claiming 64 MiB of content where the layout gives it 4 KiB: refused from its header."""
    bomb = zstandard.ZstdCompressor(level=19, write_checksum=True).compress(bytes(64 << 20))
    assert len(bomb) <= _frames(forge, "w")[0][1]
    _replace_frame(forge, "w", 0, bomb)
    path = forge.write(bad, minor=1)
    refused(path, PayloadError, "declares 67108864 bytes, the layout gives it 4096", tensor="w")
    assert peak_memory(lambda: pytest.raises(PayloadError, szformat.load_file, path)) < 4 << 20


def test_a_tiny_file_that_would_inflate_to_gigabytes_is_refused_from_its_header(tmp_path):
    """Every frame declares its true size and checksum, yet 48 kB of frames would inflate to 1.5 GiB and decode to
    2 GiB: the 8x bound on a staged payload refuses it at open, under a memory ceiling far below what it claims."""
    zeros = write_at_rest({"zeros": torch.zeros(4096, dtype=torch.bfloat16)}, tmp_path / "zeros.szt")
    parts = Parts.of(zeros.read_bytes())
    restage_zeros(parts, "zeros", 1 << 30, ("pk", "sm"))
    bomb = tmp_path / "bomb.szt"
    bomb.write_bytes(parts.to_bytes())
    assert bomb.stat().st_size < 100_000
    refused(bomb, HeaderError, "would inflate to 1610612736", "decompression bomb", tensor="zeros")
    script = f"""
import resource, sys, szformat
from szformat.errors import HeaderError
szformat.load_file({str(zeros)!r})  # every module a load needs imported before the ceiling is set
with open("/proc/self/status") as status:
    size = next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmSize:"))
resource.setrlimit(resource.RLIMIT_AS, (size + (256 << 20),) * 2)  # far under the 3.5 GiB the file claims
try:
    szformat.load_file({str(bomb)!r})
except HeaderError as e:
    sys.exit(0 if "decompression bomb" in str(e) else 1)
sys.exit(2)
"""
    assert subprocess.run([sys.executable, "-c", script], timeout=120).returncode == 0


def test_the_writer_keeps_a_staged_payload_within_the_bound():
    """Asked to compress ``sm`` too, the writer stores it verbatim where the bound would break (all zeros)."""
    layout = PayloadLayout(n=1 << 16, n_esc=0)
    parts, stage = at_rest.compress(torch.zeros(layout.comp_bytes, dtype=torch.uint8), layout, streams=("pk", "sm"))
    assert stage.streams == ("pk",)
    assert layout.comp_bytes <= at_rest.MAX_EXPANSION * sum(map(len, parts))
    noise = torch.randint(0, 256, (layout.comp_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    assert at_rest.compress(noise, layout, streams=("pk", "sm"))[1].streams == ("pk", "sm")  # within it: as asked


def test_an_allocation_that_fails_is_the_packages_error(valid_file, monkeypatch):
    """A valid file on a machine too small for a tensor: TensorAllocationError (a MemoryError) naming both."""
    import szformat.loading.host_reader as host_reader

    def empty(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory: you "
                           "tried to allocate 17179869184 bytes.")

    monkeypatch.setattr(host_reader.torch, "empty", empty)
    with szformat.safe_open(valid_file, "pt") as f, pytest.raises(TensorAllocationError) as info:
        f.get_tensor("w")
    assert isinstance(info.value, MemoryError) and info.value.tensor == "w" and "valid.szt" in str(info.value)
    assert "can't allocate memory" in str(info.value)


def test_a_frame_without_content_size_or_checksum(forge, bad):
    data = bytes(FRAME)
    _replace_frame(forge, "w", 0, _streamed(data))
    refused(forge.write(bad, minor=1), PayloadError, "does not declare its content size", tensor="w")
    unchecked = zstandard.ZstdCompressor(write_checksum=False).compress(data)
    _replace_frame(forge, "w", 0, unchecked)
    refused(forge.write(bad, minor=1), PayloadError, "carries no content checksum", tensor="w")


def test_a_frame_that_names_a_dictionary_or_asks_for_a_large_window(forge, bad):
    """Both refused from the frame header: frames are independent, and none needs a window past 64 MiB."""
    data = bytes(range(256)) * (FRAME // 256)
    samples = [bytes([i % 7]) * 100 + bytes(range(i % 50)) for i in range(2000)]
    dictionary = zstandard.train_dictionary(2048, samples)
    named = zstandard.ZstdCompressor(dict_data=dictionary, write_checksum=True).compress(data)
    _replace_frame(forge, "w", 0, named)
    refused(forge.write(bad, minor=1), PayloadError, f"names dictionary {dictionary.dict_id()}", tensor="w")
    single = at_rest.compress_frame(data)
    assert single[4] & 0x20  # the single-segment flag: no window descriptor, the window is the content
    wide = single[:4] + bytes([single[4] & ~0x20, 17 << 3]) + single[5:]  # a window descriptor of 2^27 bytes
    _replace_frame(forge, "w", 0, wide)
    refused(forge.write(bad, minor=1), PayloadError, "asks for a window of 134217728 bytes", tensor="w")


def test_not_a_zstd_frame(forge, bad):
    _replace_frame(forge, "w", 3, b"\x00" * 64)
    refused(forge.write(bad, minor=1), PayloadError, "not a zstd frame", tensor="w")


def test_frame_walker_refuses_truncated_frames():
    frame = zstandard.ZstdCompressor(write_checksum=True).compress(bytes(range(256)) * 64)
    assert at_rest.frame_compressed_size(memoryview(frame + b"junk")) == len(frame)
    for cut in (len(frame) - 1, len(frame) - 4, 8):
        with pytest.raises(at_rest.AtRestError):
            at_rest.frame_compressed_size(memoryview(frame[:cut]))


def test_a_run_of_frames_refuses_bytes_after_a_frame_within_its_length():
    """A task inflates its frames with one zstd reader, across frames, which would skip a skippable frame after the
    first one; the format allows no bytes after a frame within its recorded length, so the block walk refuses it."""
    contents = [bytes(range(256)) * 16, bytes(range(255, -1, -1)) * 16]
    frames = [at_rest.compress_frame(c) for c in contents]
    skippable = (0x184D2A50).to_bytes(4, "little") + (4).to_bytes(4, "little") + bytes(4)
    stored = memoryview(frames[0] + skippable + frames[1])
    run = [at_rest.Segment(0, 4096, 0, len(frames[0]) + len(skippable), True),
           at_rest.Segment(4096, 4096, len(frames[0]) + len(skippable), len(frames[1]), True)]
    out = bytearray(8192)
    assert at_rest.decompressor().stream_reader(stored, read_across_frames=True).readinto(out) == 8192
    assert bytes(out) == b"".join(contents)  # zstd alone takes it
    with pytest.raises(at_rest.AtRestError, match="bytes long, the header records"):
        at_rest._inflate_frames(stored, run, memoryview(out), at_rest.decompressor())
    run = [at_rest.Segment(0, 4096, 0, len(frames[0]), True),
           at_rest.Segment(4096, 4096, len(frames[0]), len(frames[1]), True)]
    out[:] = bytes(8192)
    at_rest._inflate_frames(memoryview(frames[0] + frames[1]), run, memoryview(out), at_rest.decompressor())
    assert bytes(out) == b"".join(contents)


def test_the_forge_rebuilds_the_valid_at_rest_file_exactly(valid_file, forge, bad):
    """The forged cases above start from the valid file itself, not from a look-alike."""
    assert forge.write(bad, minor=1).read_bytes() == valid_file.read_bytes()


# ---------------------------------------------------------------------------------------------------------------
# Headers stored through zstd (preamble flag 1)
# ---------------------------------------------------------------------------------------------------------------


def test_the_at_rest_form_stores_its_header_through_zstd(tmp_path):
    path = tmp_path / "h.szt"
    szformat.save_file(SOURCE, path, {"format": "pt"}, at_rest="zstd")
    with SztFile(path) as f:
        assert f.flags == C.FLAG_HEADER_ZSTD and f.metadata == {"format": "pt"}
        stored_header = f.file_length - f.header.tensors[-1].offset - f.header.tensors[-1].length
        assert stored_header < len(f.header.to_bytes())
    assert_same_tensors(szformat.load_file(path), SOURCE)


def test_a_1_0_reader_refuses_a_zstd_header_by_its_flag(forge, bad, monkeypatch):
    path = forge.write(bad, minor=1, flags=1, header_bytes=at_rest.compress_frame(msgpack.packb(forge.header)))
    assert_same_tensors(szformat.load_file(path), SOURCE)
    monkeypatch.setattr(C, "KNOWN_FLAGS", 0)  # what a 1.0 reader knows
    refused(path, UnsupportedVersionError, "preamble flags 0x1", "upgrade szformat")


def test_unknown_flags_next_to_the_header_flag(forge, bad):
    refused(forge.write(bad, minor=1, flags=3), UnsupportedVersionError, "preamble flags 0x2")


@pytest.mark.parametrize("stored, reason", [
    (b"\x92\x01\x02", "not a zstd frame"),
    (at_rest.compress_frame(b"\xc1"), "not valid msgpack"),
    (_streamed(b"\x80"), "does not declare its content size"),
    (zstandard.ZstdCompressor(write_checksum=False).compress(b"\x80"), "carries no content checksum"),
    (at_rest.compress_frame(msgpack.packb({"tensors": []}))[:-2], "zstd frame"),
])
def test_bad_zstd_headers(forge, bad, stored, reason):
    refused(forge.write(bad, minor=1, flags=1, header_bytes=stored), HeaderError, reason)


def test_a_header_bomb_is_refused_before_it_is_allocated(forge, bad):
    """A 4 KB frame declaring 64 MiB of header: more than 16x its size plus 1 MiB."""
    bomb = at_rest.compress_frame(bytes(64 << 20), level=19)
    path = forge.write(bad, minor=1, flags=1, header_bytes=bomb)
    refused(path, HeaderError, "declares 67108864 bytes, more than the limit")
    assert peak_memory(lambda: pytest.raises(HeaderError, szformat.load_file, path)) < 4 << 20


def test_a_header_of_small_strings_that_would_cost_far_more_than_its_file_is_refused(forge, bad):
    """A header of two-character strings under an unknown key inflates 17x: past the bound, refused before it is
    inflated (parsed, it would cost ~24x its msgpack bytes)."""
    strings = [f"{i % 2500:04x}"[:2] for i in range(1 << 20)]
    header = msgpack.packb({"tensors": forge.header["tensors"], "padding": strings})
    stored = at_rest.compress_frame(header, level=19)
    assert len(header) > C.HEADER_INFLATE_FACTOR * len(stored) + (1 << 20)
    refused(forge.write(bad, minor=1, flags=1, header_bytes=stored), HeaderError, "more than the limit")


def test_a_header_that_shrinks_past_the_bound_is_written_as_plain_msgpack(tmp_path):
    """20,000 empty tensors named alike make a header that zstd shrinks ~120x: the writer stores it as it is, and
    the file reads back."""
    tensors = {f"model.layers.{i}.weight": torch.zeros(0) for i in range(20_000)}
    path = write_at_rest(tensors, tmp_path / "many.szt")
    with SztFile(path) as f:
        assert f.flags == 0 and len(f.header.tensors) == 20_000


def test_descriptors_of_tensors_at_rest_are_refused(valid_file):
    """A descriptor tells a device route which stored bytes to expand: those of an at-rest tensor are not a payload."""
    with szformat.safe_open(valid_file, "pt") as f:
        with pytest.raises(DecodeRouteError, match="repack") as info:
            f.descriptor("w")
        assert info.value.tensor == "w" and info.value.path == str(valid_file)
        assert f.descriptor("b").length == 20  # a tensor stored as it is loaded still has one


def test_payloads_of_1_mib_or_more_keep_the_page_alignment(tmp_path):
    """Small payloads pack at 16 bytes; one of 1 MiB or more still starts on a page, after a small one."""
    noise = torch.randint(-32768, 32767, (600_000,), dtype=torch.int16, generator=torch.Generator().manual_seed(5))
    tensors = {"tiny": torch.arange(3, dtype=torch.float32), "large": noise.view(torch.bfloat16),
               "after": torch.ones(5, dtype=torch.float32)}
    path = tmp_path / "large.szt"
    szformat.save_file(tensors, path, at_rest="zstd")
    with SztFile(path) as f:
        large, after = f.entry("large"), f.entry("after")
        assert large.length >= C.SMALL_PAYLOAD_LIMIT and large.offset == 4096  # "tiny" ends at 76
        assert after.offset == -(-(large.offset + large.length) // 16) * 16
    assert_same_tensors(szformat.load_file(path), tensors)


def test_a_refused_frame_leaves_the_threads_context_usable():
    """Each thread reuses one zstd context: a frame refused midway must not spoil the next one it inflates."""
    data = bytes(range(256)) * 300
    frame = at_rest.compress_frame(data)
    broken = bytearray(frame)
    broken[len(broken) // 2] ^= 0xFF
    out = bytearray(len(data))
    with pytest.raises(at_rest.AtRestError, match="corrupt"):
        at_rest._inflate_frame(memoryview(bytes(broken)), memoryview(out), at_rest.decompressor())
    at_rest._inflate_frame(memoryview(frame), memoryview(out), at_rest.decompressor())
    assert bytes(out) == data


@pytest.mark.parametrize("options, message", [
    (dict(small_alignment=24), r"small_alignment must be a power of two in \[16, 4096\), got 24"),
    (dict(small_alignment=4096), r"small_alignment must be a power of two in \[16, 4096\), got 4096"),
    (dict(frame_size=1), r"frame_size must be an integer in \["),
    (dict(frame_size=1 << 40), r"frame_size must be an integer in \["),
])
def test_the_writer_refuses_what_a_reader_would(tmp_path, options, message):
    with pytest.raises(ValueError, match=message):
        SztWriter(tmp_path / "x.szt", alignment=4096, **options)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("option, message", [
    ("brotli", "at-rest codec 'brotli' is not supported; use 'zstd', 'zstd:LEVEL' or 'none'"),
    ("zstd:fast", "zstd level 'fast' is not an integer"),
    ("zstd:0", r"zstd level must be in \["),
])
def test_an_at_rest_option_that_names_no_stage_is_refused(option, message):
    with pytest.raises(ValueError, match=message):
        at_rest.parse_at_rest_option(option)


def test_the_tensors_that_end_a_file_are_stored_in_small_frames(tmp_path, monkeypatch):
    """A GPU load's last inflation lasts one frame's decode, so the tensors reaching into a file's last
    ``TAIL_BYTES`` (no larger than that, larger than one small frame) get frames of ``TAIL_FRAME_SIZE``: written so
    by ``save_file``, ``convert`` and ``repack``, which know the file's size; the others keep the frame size, and
    every tensor reads back bit for bit. A file no larger than ``TAIL_BYTES``, or of unknown size, gets none."""
    monkeypatch.setattr(at_rest, "TAIL_BYTES", 3 << 20)
    monkeypatch.setattr(at_rest, "TAIL_FRAME_SIZE", 256 << 10)
    g = torch.Generator().manual_seed(5)
    tensors = {
        "first.weight": torch.randn(1 << 18, generator=g) * 0.02,  # 1 MiB, ends before the last 3 MiB
        "large.weight": torch.randn(1 << 20, generator=g) * 0.02,  # 4 MiB, larger than them
        "into_the_tail.weight": (torch.randn(600_000, generator=g) * 0.02).to(torch.bfloat16),
        "one_frame.weight": (torch.randn(50_000, generator=g) * 0.1).half(),  # 100 KB: one frame either way
        "last.weight": torch.randn(300_000, generator=g) * 0.02,
    }
    default, tail = at_rest.DEFAULT_FRAME_SIZE, 256 << 10
    expected = {"first.weight": default, "large.weight": default, "into_the_tail.weight": tail,
                "one_frame.weight": default, "last.weight": tail}
    saved, repacked, converted = tmp_path / "saved.szt", tmp_path / "repacked.szt", tmp_path / "converted.szt"
    szformat.save_file(tensors, saved, at_rest="zstd")
    repack(saved, repacked, at_rest=1)
    st_save_file(tensors, tmp_path / "model.safetensors")
    assert szconvert([str(tmp_path / "model.safetensors"), str(converted), "--at-rest", "zstd", "--quiet"]) == 0
    for path in (saved, repacked, converted):
        with SztFile(path) as f:
            assert {name: e.at_rest.frame_size for name, e in f.entries.items()} == expected, path.name
        assert_same_tensors(szformat.load_file(path), tensors)
    with SztWriter(tmp_path / "unknown.szt", **writer_form(1)) as writer:  # the file's size not given
        for name, t in tensors.items():
            write_tensor(writer, name, C.TORCH_TO_DTYPE[t.dtype], t.shape, tensor_bytes(t))
    with SztFile(tmp_path / "unknown.szt") as f:
        assert {e.at_rest.frame_size for e in f.entries.values()} == {default}
    small = {name: tensors[name] for name in ("into_the_tail.weight", "last.weight")}  # 2.4 MiB: all of it "tail"
    szformat.save_file(small, tmp_path / "small.szt", at_rest="zstd")
    with SztFile(tmp_path / "small.szt") as f:
        assert {e.at_rest.frame_size for e in f.entries.values()} == {default}
    assert_same_tensors(szformat.load_file(tmp_path / "small.szt"), small)
