"""Byte planes at rest (.szt 1.2): raw tensors of every dtype stored as zstd frames of their byte planes.

Bit-exactness against the source on every read path (whole tensors, slices, threads, decompress, verify, repack,
the GPU loader's reader threads), the writer's choices, forged headers refused by name, corrupt frames and
verbatim planes caught by their checks, and a 1.1 reader refusing a 1.2 file by feature.
"""

from __future__ import annotations

import random

import pytest
import torch

import szformat
from szformat.convert import decompress, repack, verify
from szformat.errors import (ChecksumMismatchError, HeaderError, PayloadError, UnknownEncodingError,
                             UnsupportedVersionError)
from szformat.format import at_rest
from szformat.format import constants as C
from szformat.format.reader import SztFile
from szformat.format.writer import tensor_bytes
from support import Forge, assert_same_tensors, peak_memory, refused, write_at_rest

FRAME = at_rest.MIN_FRAME_SIZE


def _floats(n: int, seed: int) -> torch.Tensor:
    """Weights-like FP32 with specials: zeros, subnormals, both infinities, NaNs with payloads, huge values."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * 0.05
    specials = torch.tensor([0.0, -0.0, 1e-42, -3e-45, float("inf"), float("-inf"), float("nan"), 3e38])
    x[torch.randperm(n, generator=g)[:16]] = specials.repeat(2)
    bits = x.view(torch.int32)
    bits[:4] = torch.tensor([0x7FC00001, 0x7F800ABC, -0x00400001, 0x7FFFFFFF], dtype=torch.int32)  # NaN payloads
    return x


def _wide_bf16(n: int, seed: int) -> torch.Tensor:
    """BF16 over 40 binades: the SplitZip gate refuses it (a Top-16 codebook covers about 0.4), yet its exponent
    plane still shrinks."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * torch.exp2(torch.randint(-20, 20, (n,), generator=g).float())).bfloat16()


def source(seed: int) -> dict[str, torch.Tensor]:
    """Every kind of raw tensor the stage takes, in odd sizes spanning several frames of 4 KiB."""
    f32 = _floats(3 * 1777, seed)
    return {
        "f32": f32.reshape(3, 1777),
        "f16": _floats(4099, seed + 1).to(torch.float16),
        "bf16_wide": _wide_bf16(2049, seed),
        "f64": _floats(1025, seed + 2).double().reshape(5, 205),
        "e4m3": _floats(9001, seed + 3).to(torch.float8_e4m3fn),
        "e5m2": _floats(5003, seed + 4).to(torch.float8_e5m2),
        "i32": torch.randint(0, 3000, (3001,), dtype=torch.int32, generator=torch.Generator().manual_seed(seed)),
        "mask": torch.rand(7000, generator=torch.Generator().manual_seed(seed)) > 0.7,
        "zeros": torch.zeros(20000),  # would inflate more than 8x: stays raw
        "tiny": torch.randn(3),  # a frame would not be smaller: stays raw
        "empty": torch.zeros(0, 4),
        "w": (torch.randn(64, 96, generator=torch.Generator().manual_seed(seed)) * 0.02).to(torch.bfloat16),
    }


STAGED = ["f32", "f16", "bf16_wide", "f64", "e4m3", "e5m2", "i32", "mask"]


@pytest.fixture(scope="module")
def seed() -> int:
    return random.randrange(1 << 30)


@pytest.fixture(scope="module")
def tensors(seed) -> dict[str, torch.Tensor]:
    return source(seed)


@pytest.fixture(scope="module")
def valid_file(tmp_path_factory, tensors):
    return write_at_rest(tensors, tmp_path_factory.mktemp("planes") / "valid.szt")


def test_the_writer_stages_what_shrinks_and_announces_1_2(valid_file):
    with SztFile(valid_file) as f:
        assert f.version == (1, 2) and f.byte_planes
        assert C.FEATURE_AT_REST_PLANES in f.header.required_features
        for name in STAGED:
            e = f.entry(name)
            assert e.encoding == "raw" and isinstance(e.at_rest, at_rest.PlanesStage), name
            assert e.length < e.raw_length == e.memory_length, name
            assert e.crc32 != e.raw_crc32, name
        assert f.entry("f32").at_rest.transform == "sign_last" and f.entry("f16").at_rest.transform == "sign_last"
        assert f.entry("i32").at_rest.transform == "bytes" and f.entry("e4m3").at_rest.transform == "bytes"
        for name in ("zeros", "tiny", "empty"):
            assert f.entry(name).at_rest is None, name
        assert isinstance(f.entry("w").at_rest, at_rest.ZstdStage)
        segments = f.entry("f32").segments()
        assert len(segments) == -(-3 * 1777 * 4 // FRAME) and segments[-1].memory_length < FRAME


def test_a_file_without_raw_tensors_at_rest_stays_1_1(tmp_path):
    path = write_at_rest({"w": torch.randn(64, 96).to(torch.bfloat16)}, tmp_path / "bf16.szt")
    with SztFile(path) as f:
        assert f.version == (1, 1) and C.FEATURE_AT_REST_PLANES not in f.header.required_features


@pytest.mark.parametrize("verify_bytes", [True, False])
@pytest.mark.parametrize("threads", [1, 2])
def test_load_file_is_exact(valid_file, tensors, verify_bytes, threads, monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    assert_same_tensors(szformat.load_file(valid_file, verify=verify_bytes), tensors)


def test_slices_inflate_only_the_frames_they_cover(valid_file, tensors, monkeypatch):
    inflated = []
    real = at_rest._inflate_plane_frames
    monkeypatch.setattr(at_rest, "_inflate_plane_frames", lambda stored, run, out, dctx: (
        inflated.extend(seg.memory for seg in run), real(stored, run, out, dctx)))
    with szformat.safe_open(valid_file, "pt") as f:
        for name in STAGED:
            t = tensors[name]
            rows = t.shape[0]
            for lo, hi in [(0, 1), (rows // 2, rows // 2 + 1), (rows - 1, rows), (1, rows)]:
                got = f.get_slice(name)[lo:hi]
                assert torch.equal(got.view(torch.uint8), t[lo:hi].contiguous().view(torch.uint8)), (name, lo, hi)
        inflated.clear()
        f.get_slice("e4m3")[100:200]  # bytes 100-200: inside the first frame
        assert inflated == [0]
        assert torch.equal(f.get_tensor("f16").view(torch.int16), tensors["f16"].view(torch.int16))


def test_decompress_verify_and_repack_are_exact(valid_file, tensors, tmp_path):
    from safetensors.torch import load_file
    assert not verify(valid_file).problems
    assert_same_tensors(load_file(decompress(valid_file, tmp_path / "out.safetensors").output), tensors)
    memory = repack(valid_file, tmp_path / "memory.szt", at_rest=None).output
    with SztFile(memory) as f:
        assert f.version == (1, 0) and not f.at_rest
    assert_same_tensors(szformat.load_file(memory), tensors)
    again = repack(memory, tmp_path / "again.szt", at_rest=1).output
    assert again.read_bytes() == szformat_at_rest_bytes(tensors, tmp_path)
    small = repack(memory, tmp_path / "small.szt", at_rest=1, frame_size=4096).output
    with SztFile(small) as f:
        assert {e.at_rest.frame_size for e in f.entries.values() if e.at_rest is not None} == {4096}
    assert_same_tensors(szformat.load_file(small), tensors)


def szformat_at_rest_bytes(tensors: dict[str, torch.Tensor], tmp_path) -> bytes:
    """What ``save_file(at_rest="zstd")`` writes for ``tensors`` (repack gives the same bytes)."""
    path = tmp_path / "saved.szt"
    szformat.save_file(tensors, path, {"format": "pt"}, at_rest="zstd")
    return path.read_bytes()


def test_info_shows_each_dtype_ratio(valid_file, capsys):
    from szformat.cli.main import main as szconvert
    from szformat.convert.info import describe
    dtypes = describe(valid_file)["files"][0]["dtypes"]
    with SztFile(valid_file) as f:
        f32 = [e for e in f.header.tensors if e.dtype == "F32"]
    assert dtypes["F32"]["tensors"] == len(f32) == 4  # f32, zeros, tiny, empty
    assert dtypes["F32"]["ratio"] == sum(e.length for e in f32) / sum(e.raw_length for e in f32) < 1
    assert dtypes["F8_E4M3"]["ratio"] < 0.95 and dtypes["I32"]["ratio"] < 0.6 and dtypes["BF16"]["ratio"] < 0.9
    assert szconvert(["info", str(valid_file)]) == 0
    shown = capsys.readouterr().out
    assert "by dtype (stored / raw): " in shown and f"F32 {dtypes['F32']['ratio']:.4f}" in shown


@pytest.mark.parametrize("frame_size", [FRAME, 3 * FRAME, 1 << 20])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                   torch.float8_e4m3fn, torch.int64, torch.uint8])
def test_every_dtype_and_frame_size_round_trips_through_the_stage(dtype, frame_size):
    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    n = random.Random(seed).randrange(frame_size // 2, 3 * frame_size)  # elements: one frame or several
    high = 16 if dtype == torch.uint8 else 1 << 20  # integers whose planes shrink, within the 8x bound
    x = _floats(n, seed).to(dtype) if dtype.is_floating_point else torch.randint(0, high, (n,), generator=g).to(dtype)
    raw = tensor_bytes(x)
    staged = at_rest.compress_planes(raw, C.TORCH_TO_DTYPE[dtype], x.element_size(), frame_size=frame_size)
    assert staged is not None, f"seed {seed}: the stage did not pay"
    parts, stage = staged
    stored = torch.frombuffer(bytearray(b"".join(bytes(p) for p in parts)), dtype=torch.uint8)
    assert stage.planes and sum(stage.planes) == stored.numel()
    back = at_rest.inflate(stored, stage.segments(raw.numel()), raw.numel())
    assert torch.equal(back, raw), f"seed {seed}"
    lo = random.Random(seed).randrange(raw.numel())
    part = at_rest.inflate(stored, stage.segments(raw.numel()), raw.numel(), start=lo, stop=raw.numel())
    assert torch.equal(part, raw[lo:]), f"seed {seed}"


def test_real_trained_weights_round_trip_smaller(tmp_path):
    from tools import fetch_minilm
    path = fetch_minilm.default_dest() / "minilm-fp32" / "model.safetensors"
    if not path.exists():
        pytest.skip("MiniLM's FP32 weights are not fetched (python -m tools.fetch_minilm)")
    from safetensors.torch import load_file
    published = load_file(path)
    subset = dict(list(published.items())[:12])
    for dtype in (torch.float32, torch.float16, torch.float8_e4m3fn):
        tensors = {k: v.to(dtype) for k, v in subset.items()}
        out = write_at_rest(tensors, tmp_path / f"{dtype}.szt".replace("torch.", ""), frame_size=1 << 20)
        assert_same_tensors(szformat.load_file(out), tensors)
        raw = sum(t.numel() * t.element_size() for t in tensors.values())
        assert out.stat().st_size < 0.9 * raw, dtype


# ---------------------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------------------


def _stage(forge: Forge, name: str) -> dict:
    return forge.entry(name)["encoding"]["at_rest"]["configuration"]


def test_a_1_1_reader_refuses_a_1_2_file_by_feature(valid_file, monkeypatch):
    monkeypatch.setattr(C, "FEATURES", frozenset({C.FEATURE_AT_REST_ZSTD, C.FEATURE_SMALL_ALIGNMENT}))
    refused(valid_file, UnsupportedVersionError, "at_rest_planes")


@pytest.mark.parametrize("change, error, reason", [
    (lambda f: f.header["required_features"].remove(C.FEATURE_AT_REST_PLANES), HeaderError,
     "'at_rest_planes' is not among the required features"),
    (lambda f: _stage(f, "f32").__setitem__("transform", "rot13"), HeaderError, "'transform' must be one of"),
    (lambda f: _stage(f, "e4m3").__setitem__("transform", "sign_last"), HeaderError, "at least two bytes"),
    (lambda f: _stage(f, "f32").__setitem__("frame_size", FRAME + 2), HeaderError, "not a multiple"),
    (lambda f: _stage(f, "f32").__setitem__("frame_size", 100), HeaderError, "'frame_size' must be"),
    (lambda f: _stage(f, "f32")["planes"].pop(), HeaderError, "'planes' must list"),
    (lambda f: _stage(f, "f32")["planes"].__setitem__(0, 0), HeaderError, "between 1 and"),
    (lambda f: _stage(f, "f32")["planes"].__setitem__(0, "1024"), HeaderError, "'planes' must list"),
    (lambda f: _stage(f, "f32")["planes"].__setitem__(0, True), HeaderError, "'planes' must list"),
    (lambda f: _stage(f, "f32")["planes"].__setitem__(0, FRAME // 4 + 1), HeaderError, "plane 0 is stored in"),
    (lambda f: _stage(f, "f32")["planes"].__setitem__(-1, FRAME // 4), HeaderError, "is stored in"),
    (lambda f: _stage(f, "f32")["planes"].__setitem__(1, _stage(f, "f32")["planes"][1] - 1), HeaderError,
     "add up to"),
    (lambda f: _stage(f, "f32").__setitem__("level", "1"), HeaderError, "zstd_planes 'level' must be an integer"),
    (lambda f: f.entry("f32")["encoding"]["at_rest"].__setitem__("configuration", []), HeaderError,
     "zstd_planes 'configuration' must be a map"),
    (lambda f: f.entry("f32")["encoding"]["at_rest"].__setitem__("name", "zstd"), HeaderError,
     "'zstd' does not apply to a raw tensor"),
    (lambda f: f.entry("f32")["encoding"]["at_rest"].__setitem__("name", "brotli_planes"), UnknownEncodingError,
     "'brotli_planes' is not known"),
    (lambda f: f.entry("w")["encoding"]["at_rest"].__setitem__("name", "zstd_planes"), HeaderError,
     "does not apply to a splitzip payload"),
])
def test_forged_stages_are_refused_at_open(valid_file, tmp_path, change, error, reason):
    forge = Forge.load(valid_file)
    change(forge)
    tensor = "w" if "splitzip" in reason else "e4m3" if "two bytes" in reason else "f32"
    refused(forge.write(tmp_path / "bad.szt", minor=2), error, reason, tensor=tensor)


def test_a_planes_bomb_is_refused_before_anything_is_allocated(valid_file, tmp_path):
    """f32's planes claim a tensor of 2^27 elements (512 MiB) from its 21 kB of stored bytes."""
    forge = Forge.load(valid_file)
    e = forge.entry("f32")
    n = 1 << 27
    e["shape"], e["raw_length"] = [n], 4 * n
    frame_size = at_rest.MAX_FRAME_SIZE
    planes = 4 * (4 * n // frame_size)
    _stage(forge, "f32").update(frame_size=frame_size, planes=[1] * (planes - 1) + [e["length"] - (planes - 1)])
    bad = forge.write(tmp_path / "bad.szt", minor=2)
    assert peak_memory(lambda: pytest.raises(HeaderError, SztFile, bad)) < 64 << 20
    refused(bad, HeaderError, "decompression bomb", tensor="f32")


def _plane(forge: Forge, name: str, compressed: bool) -> tuple[int, int, int]:
    """The index of the first compressed (or verbatim) plane of ``name``, where it starts in the stored bytes, and
    its stored length."""
    config = _stage(forge, name)
    plane = config["frame_size"] // C.itemsize(forge.entry(name)["dtype"])
    index = next(i for i, length in enumerate(config["planes"]) if (length < plane) == compressed)
    return index, sum(config["planes"][:index]), config["planes"][index]


def test_a_corrupt_plane_frame_is_a_payload_error_naming_the_tensor(valid_file, tmp_path):
    forge = Forge.load(valid_file)
    _, start, length = _plane(forge, "f32", compressed=True)
    byte = forge.body[forge.entry("f32")["offset"] + start + length // 2]
    forge.payload_at("f32", start + length // 2, bytes([byte ^ 0x21]))
    bad = forge.write(tmp_path / "bad.szt", minor=2)
    refused(bad, PayloadError, "zstd frame", tensor="f32", verify=False)
    with szformat.safe_open(bad, "pt") as f, pytest.raises(PayloadError, match="f32"):
        f.get_slice("f32")[0:1]


def test_a_verbatim_plane_changed_is_caught_by_the_checksums(valid_file, tmp_path, tensors):
    forge = Forge.load(valid_file)
    _, start, _ = _plane(forge, "f32", compressed=False)
    offset = forge.entry("f32")["offset"] + start
    forge.body[offset], forge.body[offset + 1] = forge.body[offset] ^ 1, forge.body[offset + 1]
    stale = forge.write(tmp_path / "stale.szt", minor=2)  # stored CRC-32 not recomputed
    refused(stale, ChecksumMismatchError, "CRC-32 of the stored bytes", tensor="f32")
    forge.payload_at("f32", start, bytes([forge.body[offset]]))  # recomputes the stored CRC-32
    fixed = forge.write(tmp_path / "fixed.szt", minor=2)
    refused(fixed, ChecksumMismatchError, "CRC-32 of the decoded bytes", tensor="f32")
    assert verify(fixed).problems


def test_a_truncated_plane_frame_is_an_error_not_a_crash(valid_file, tmp_path):
    forge = Forge.load(valid_file)
    config = _stage(forge, "f32")
    plane = FRAME // 4
    first, second = [i for i, length in enumerate(config["planes"]) if length < plane][:2]
    config["planes"][first] -= 3  # the first frame ends inside its last block; the sum stays right
    config["planes"][second] += 3
    bad = forge.write(tmp_path / "bad.szt", minor=2)
    refused(bad, PayloadError, "zstd frame", tensor="f32", verify=False)


def test_frames_compressed_on_several_threads_are_the_same_bytes():
    raw = tensor_bytes(_floats(5 * FRAME // 4 * 3 + 7, random.randrange(1 << 30)))
    one = at_rest.compress_planes(raw, "F32", 4, frame_size=FRAME, threads=1)
    four = at_rest.compress_planes(raw, "F32", 4, frame_size=FRAME, threads=4)
    assert one[1] == four[1] and [bytes(p) for p in one[0]] == [bytes(p) for p in four[0]]
    assert len(one[1].planes) == 4 * 16 and one[1].planes[-4:] == (7, 7, 7, 7)  # a last frame of 7 elements


def test_an_empty_tensor_with_a_stage_is_refused(valid_file, tmp_path):
    forge = Forge.load(valid_file)
    forge.entry("empty")["encoding"]["at_rest"] = forge.entry("f32")["encoding"]["at_rest"]
    forge.header["required_features"] = sorted(set(forge.header["required_features"]))
    refused(forge.write(tmp_path / "bad.szt", minor=2), HeaderError, "an empty tensor has no at-rest stage",
            tensor="empty")


def test_a_writer_frame_size_that_is_not_whole_elements_still_stores_whole_elements(tmp_path, tensors):
    """A frame size any splitzip stream takes (4097) holds no whole number of FP32 elements: the planes' frames
    are cut at the multiple of the element size below it."""
    subset = {name: tensors[name] for name in ("f32", "f64", "e4m3", "w")}
    path = write_at_rest(subset, tmp_path / "odd.szt", frame_size=FRAME + 1)
    with SztFile(path) as f:
        assert f.entry("f32").at_rest.frame_size == FRAME and f.entry("f64").at_rest.frame_size == FRAME
        assert f.entry("e4m3").at_rest.frame_size == FRAME + 1 and f.entry("w").at_rest.frame_size == FRAME + 1
    assert_same_tensors(szformat.load_file(path), subset)


def test_one_byte_elements_inflate_in_place_whether_a_frame_is_compressed_or_verbatim():
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    noise = torch.randint(0, 256, (FRAME,), generator=g, dtype=torch.uint8)  # a frame zstd cannot shrink
    small = torch.randint(0, 16, (FRAME + 100,), generator=g, dtype=torch.uint8)  # frames it can
    raw = torch.cat([noise, small])
    parts, stage = at_rest.compress_planes(raw, "U8", 1, frame_size=FRAME)
    assert stage.planes[0] == FRAME and stage.planes[1] < FRAME  # verbatim, then compressed
    stored = torch.frombuffer(bytearray(b"".join(bytes(p) for p in parts)), dtype=torch.uint8)
    assert torch.equal(at_rest.inflate(stored, stage.segments(raw.numel()), raw.numel()), raw)
    part = at_rest.inflate(stored, stage.segments(raw.numel()), raw.numel(), start=FRAME - 5, stop=FRAME + 7)
    assert torch.equal(part, raw[FRAME - 5: FRAME + 7])
