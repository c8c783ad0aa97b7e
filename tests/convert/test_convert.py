"""Conversion safetensors <-> .szt: sources, single files, sharded checkpoints, model folders, atomicity, verify.

Every test builds its checkpoints in ``tmp_path`` with the safetensors package (or forges the bytes with
``struct.pack`` where a malformed file is the point), converts them, and compares tensors bit for bit (int16 or
uint8 views), files byte for byte.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import re
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open as safetensors_open
from safetensors.torch import load_file as load_safetensors
from safetensors.torch import save_file as save_safetensors

import szformat
from szformat.codec import cpu
from szformat.codec import gpu as gpu_codec
from szformat.convert import convert, decompress, verify
from szformat.convert import expand
from szformat.convert.device import codec_for
from szformat.convert.sources import SafetensorsSource, read_safetensors_header
from szformat.errors import (ChecksumMismatchError, ConversionError, DecodeRouteError, RoundTripError, ShardIndexError,
                             WriteError)
from szformat.format import constants as C
from szformat.format.reader import SztFile

from fakes import CorruptingKernels, flip_in_last_slice
from support import (METADATA, Forge, RecordingBackend, assert_same_tensors, bf16_weights, flip_payload_byte, listing,
                     model_tensors, secret_outside, with_outliers, write_pipeline, write_sharded)

convert_module = importlib.import_module("szformat.convert.convert")  # the package exports convert()
checkpoint_module = importlib.import_module("szformat.convert.checkpoint")
sources_module = importlib.import_module("szformat.convert.sources")
verify_module = importlib.import_module("szformat.convert.verify")
decompress_module = importlib.import_module("szformat.convert.decompress")
MINILM_DIR = Path(os.environ.get("SZFORMAT_MINILM_DIR", "~/.cache/szformat/minilm")).expanduser() / "minilm-bf16"
"""Where tools/fetch_minilm.py puts the BF16 model folder."""

# -- test data ---------------------------------------------------------------------------------------------------


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones too) -> its bytes."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_safetensors(model_tensors(), path, metadata=METADATA)
    return path


# -- reading safetensors -----------------------------------------------------------------------------------------


def forge(path: Path, header: object, data: bytes = b"", *, length: int | None = None) -> Path:
    """A .safetensors file with this header (JSON-encoded unless bytes) and data; ``None``: a 3-byte file."""
    if header is None:
        path.write_bytes(b"\x01\x02\x03")
        return path
    raw = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(raw) if length is None else length) + raw + data)
    return path


@pytest.mark.parametrize("header, data, length, message", [
    (None, b"", None, "too short for a safetensors header"),
    (b"{}", b"", 10**9, "exceeds safetensors' limit"),
    (b"{}", b"", 50, "runs past the end of the file"),
    (b"\xff\xfe", b"", None, "not valid UTF-8"),
    (b"{not json", b"", None, "not valid JSON"),
    (b"[1, 2]", b"", None, "must be a JSON object"),
    (b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
     b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}', bytes(4), None, "key 'a' twice"),
    ({"__metadata__": {"format": 1}}, b"", None, "__metadata__: metadata must be a map of strings"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, bytes(4), None, "needs 8"),
    ({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, bytes(4), None, "not an integer"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, bytes(4), None, "0 <= begin <= end"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8), None, "leaves a hole at 0"),
    ({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
      "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, bytes(8), None, "overlaps the previous"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(6), None, "cover 4 bytes of a data"),
    ({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(2), None, "cover 4 bytes of a data"),
    ({"a": "F32"}, b"", None, "must be an object"),
    ({"": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(4), None, "non-empty string"),
])
def test_malformed_safetensors_are_refused_with_the_reason(tmp_path, header, data, length, message):
    path = forge(tmp_path / "bad.safetensors", header, data, length=length)
    with pytest.raises(ConversionError, match="bad.safetensors") as info:
        read_safetensors_header(path)
    assert message in str(info.value)


def test_unsupported_dtype_names_the_tensor_and_the_dtype(tmp_path):
    path = forge(tmp_path / "q.safetensors", {"w": {"dtype": "Q4_K", "shape": [2], "data_offsets": [0, 1]}},
                 bytes(1))
    with pytest.raises(ConversionError, match=r"tensor 'w': dtype 'Q4_K' is not supported") as info:
        convert(path, tmp_path / "q.szt")
    assert info.value.tensor == "w" and info.value.path == str(path)
    assert listing(tmp_path) == ["q.safetensors"]


def test_source_streams_raw_bytes_in_data_order_and_keeps_metadata(model_file):
    expected = model_tensors()
    with SafetensorsSource(model_file) as source:
        assert source.metadata == METADATA
        seen = [(t, raw.clone()) for t, raw in source.tensors()]
    assert sorted(t.name for t, _ in seen) == sorted(expected)
    for tensor, raw in seen:
        assert torch.equal(raw, expected[tensor.name].reshape(-1).view(torch.uint8)), tensor.name
    begins = [t.begin for t, _ in seen]
    assert begins == sorted(begins)


@pytest.mark.parametrize("when", ["emptied before mapping", "before mapping", "while streaming"])
def test_a_source_that_shrinks_is_a_conversion_error_not_a_crash(model_file, tmp_path, monkeypatch, when,
                                                                  source_reads):
    path = tmp_path / "shrinks.safetensors"
    path.write_bytes(model_file.read_bytes())
    header = read_safetensors_header(path)
    second = header.tensors[1]  # in data order: it loses its bytes
    cut = 0 if when == "emptied before mapping" else header.data_start + second.begin
    if when.endswith("before mapping"):  # the file shrinks between the header read and the mapping
        real = sources_module.read_safetensors_header

        def read_then_shrink(p):
            checked = real(p)
            os.truncate(p, cut)
            return checked

        monkeypatch.setattr(sources_module, "read_safetensors_header", read_then_shrink)
    with pytest.raises(ConversionError, match="shrank") as info:
        with SafetensorsSource(path) as source:
            for _ in source.tensors():
                if when == "while streaming":
                    os.truncate(path, cut)
    # the first tensor whose bytes are gone is named (the first of all when the file was emptied)
    assert info.value.tensor == (header.tensors[0].name if cut == 0 else second.name)
    assert "shrinks.safetensors" in str(info.value)


@pytest.mark.parametrize("torch_has_them", [True, False])
def test_dtypes_torch_has_no_type_for_pass_through_byte_for_byte(tmp_path, monkeypatch, torch_has_them):
    """U16, U32, U64 and F8_E8M0 bytes go through as raw bytes, without torch interpreting them: convert, verify
    and decompress work on them whether this torch has their types or not (torch 2.4 has none of them)."""
    if not torch_has_them:
        monkeypatch.setattr(C, "DTYPES", {**C.DTYPES, **{name: (None, C.itemsize(name))
                                                          for name in ("U16", "U32", "U64", "F8_E8M0")}})
    header = {"u16": {"dtype": "U16", "shape": [3], "data_offsets": [0, 6]},
              "u32": {"dtype": "U32", "shape": [1], "data_offsets": [6, 10]},
              "u64": {"dtype": "U64", "shape": [1], "data_offsets": [10, 18]},
              "e8m0": {"dtype": "F8_E8M0", "shape": [2, 1], "data_offsets": [18, 20]}}
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    source = forge(tmp_path / "odd.safetensors", raw, bytes(range(20)))
    report = convert(source, tmp_path / "odd.szt")
    assert {r.encoding for r in report.records} == {"raw"}
    assert verify(tmp_path / "odd.szt").ok
    decompress(tmp_path / "odd.szt", tmp_path / "back.safetensors")
    assert (tmp_path / "back.safetensors").read_bytes() == source.read_bytes()
    if not torch_has_them:  # what has no torch type cannot be loaded as a tensor: said, naming the tensor
        with pytest.raises(DecodeRouteError, match=r"tensor 'u16': dtype U16 has no torch equivalent"):
            szformat.load_file(tmp_path / "odd.szt")


# -- single files ------------------------------------------------------------------------------------------------


def test_single_file_converts_bit_for_bit_with_metadata(model_file, tmp_path):
    report = convert(model_file)
    target = tmp_path / "model.szt"
    assert report.output == target and listing(tmp_path) == ["model.safetensors", "model.szt"]
    assert_same_tensors(szformat.load_file(target), model_tensors())
    with SztFile(target) as szt:
        assert szt.metadata == METADATA
        encodings = {e.name: e.encoding for e in szt.entries.values()}
    assert {k for k, v in encodings.items() if v == "splitzip"} == {
        "embed.weight", "layers.0.attn.q.weight", "layers.0.attn.k.weight", "layers.0.mlp.up.weight",
        "layers.0.norm.weight"}
    assert report.files_written == 1 and len(report.records) == 10
    assert [r.n_esc > 0 for r in report.records if r.name == "layers.0.attn.k.weight"] == [True]


def test_report_counts_reasons_ratio_and_coverage(model_file, tmp_path):
    report = convert(model_file, tmp_path / "m.szt")
    assert len(report.encoded) == 5 and len(report.stored_raw) == 5
    reasons = {reason: n for reason, n, _ in report.raw_reasons()}
    assert reasons == {"dtype F32 is not encoded": 1, "dtype I64 is not encoded": 1, "empty": 1,
                       "payload not smaller": 1, "coverage < 0.99": 1}
    assert report.stored_bytes < report.raw_bytes
    assert report.payload_ratio == pytest.approx(report.stored_bytes / report.raw_bytes)
    assert (report.source_file_bytes, report.output_file_bytes) == (model_file.stat().st_size,
                                                                    (tmp_path / "m.szt").stat().st_size)
    assert report.ratio == pytest.approx(report.output_file_bytes / report.source_file_bytes)
    text = "\n".join(report.summary())
    assert re.search(r"encoded +5 tensors", text) and re.search(r"raw +5 tensors", text)
    assert "1 x coverage < 0.99" in text and "1 x dtype F32 is not encoded" in text
    assert f"ratio {report.ratio:.4f}" in text and f"ratio {report.payload_ratio:.4f}" in text
    coverages = sorted(r.coverage for r in report.encoded)
    assert coverages[0] < 0.999
    assert f"min {coverages[0]:.4f}, median {coverages[2]:.4f}" in text
    assert re.search(r"time +\d+\.\d s, \d+\.\d MB/s", text)


def test_cast_bf16_rounds_as_torch_does_from_any_byte_offset(tmp_path):
    """safetensors packs tensors back to back, so in a file written by hand an F32 tensor may start at an odd byte;
    its values exercise round-to-nearest-even: ties both ways, NaN, infinities, signed zeros, subnormals, overflow."""
    g = torch.Generator().manual_seed(5)
    tensors = {
        "h": torch.tensor([1.0, -2.5, 65504.0], dtype=torch.float16),  # 6 bytes: what follows is misaligned
        "w": torch.cat([torch.tensor([1 + 2 ** -8, 1 + 3 * 2 ** -8, float("nan"), float("inf"), -float("inf"), -0.0,
                                      1e-40, -1e-45, 3.4e38]), torch.randn(500, generator=g) * 0.02]),
        "d": torch.randn(7, generator=g, dtype=torch.float64),
        "ids": torch.arange(3, dtype=torch.int32),
    }
    header, data, offset = {}, b"", 0
    for name, t in tensors.items():
        raw = t.view(torch.uint8).numpy().tobytes()
        dtype = {torch.float16: "F16", torch.float32: "F32", torch.float64: "F64", torch.int32: "I32"}[t.dtype]
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        data, offset = data + raw, offset + len(raw)
    encoded = json.dumps(header).encode()
    (tmp_path / "odd.safetensors").write_bytes(struct.pack("<Q", len(encoded)) + encoded + data)
    assert header["w"]["data_offsets"][0] % 4 != 0

    report = convert(tmp_path / "odd.safetensors", tmp_path / "odd.szt", cast="bf16")
    assert report.cast_from == {"F16": 1, "F32": 1, "F64": 1}
    loaded = szformat.load_file(tmp_path / "odd.szt")
    for name, t in tensors.items():
        expected = t.to(torch.bfloat16) if t.is_floating_point() else t
        assert loaded[name].dtype == expected.dtype and torch.equal(loaded[name].view(torch.uint8),
                                                                    expected.view(torch.uint8)), name
    assert [r.encoding for r in report.records if r.name == "w"] == ["splitzip"]
    with pytest.raises(ConversionError, match="cast='fp8' is not supported; the one cast is 'bf16'"):
        convert(tmp_path / "odd.safetensors", tmp_path / "fp8.szt", cast="fp8")


def test_cast_of_a_sharded_checkpoint_gives_the_index_the_cast_size(tmp_path):
    tensors = write_sharded(tmp_path / "src")
    report = convert(tmp_path / "src", tmp_path / "out", cast="bf16")
    assert report.cast_from == {"F32": 1}
    cast_size = sum(t.numel() * (2 if t.is_floating_point() else t.element_size()) for t in tensors.values())
    index = json.loads((tmp_path / "out" / "model.szt.index.json").read_text())
    assert index["metadata"]["total_size"] == cast_size == report.raw_bytes
    with szformat.safe_open(tmp_path / "out" / "model-00001-of-00002.szt", framework="pt") as f:
        assert f.metadata()["szformat.cast"] == "F32->BF16"
    with szformat.safe_open(tmp_path / "out" / "model-00002-of-00002.szt", framework="pt") as f:
        assert "szformat.cast" not in (f.metadata() or {})  # nothing of its own was cast
    assert verify(tmp_path / "out").ok


def test_single_file_into_an_existing_folder_keeps_its_name(model_file, tmp_path):
    (tmp_path / "out").mkdir()
    assert convert(model_file, tmp_path / "out").output == tmp_path / "out" / "model.szt"
    assert decompress(tmp_path / "out" / "model.szt", tmp_path / "out").output == tmp_path / "out" / "model.safetensors"
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == model_file.read_bytes()


def test_conversion_is_deterministic(model_file, tmp_path):
    convert(model_file, tmp_path / "a.szt")
    convert(model_file, tmp_path / "b.szt")
    assert (tmp_path / "a.szt").read_bytes() == (tmp_path / "b.szt").read_bytes()


def test_existing_output_is_kept_unless_overwrite(model_file, tmp_path):
    target = tmp_path / "model.szt"
    target.write_bytes(b"precious")
    with pytest.raises(FileExistsError):
        convert(model_file, target)
    assert target.read_bytes() == b"precious"
    convert(model_file, target, overwrite=True)
    assert_same_tensors(szformat.load_file(target), model_tensors())


# -- decompression -----------------------------------------------------------------------------------------------


def test_decompress_restores_the_safetensors_file_byte_for_byte(model_file, tmp_path):
    convert(model_file, tmp_path / "model.szt")
    report = decompress(tmp_path / "model.szt", tmp_path / "back.safetensors")
    back = tmp_path / "back.safetensors"
    assert back.read_bytes() == model_file.read_bytes()
    assert_same_tensors(load_safetensors(back), model_tensors())
    with safetensors_open(back, "pt") as f:
        assert f.metadata() == METADATA
    assert report.raw_bytes == sum(t.numel() * t.element_size() for t in model_tensors().values())
    assert "Decompressed 10 tensors in 1 file(s)" in report.restored_summary()[0]


def test_decompress_without_metadata_writes_none(tmp_path):
    (tmp_path / "src").mkdir()
    save_safetensors({"w": bf16_weights((10, 10), 3)}, tmp_path / "src" / "plain.safetensors")
    convert(tmp_path / "src" / "plain.safetensors", tmp_path / "plain.szt")
    decompress(tmp_path / "plain.szt")  # default output: beside it
    assert (tmp_path / "plain.safetensors").read_bytes() == (tmp_path / "src" / "plain.safetensors").read_bytes()
    with safetensors_open(tmp_path / "plain.safetensors", "pt") as f:
        assert f.metadata() is None


def test_decompress_of_a_corrupted_file_fails_and_leaves_nothing(model_file, tmp_path):
    convert(model_file, tmp_path / "model.szt")
    flip_payload_byte(tmp_path / "model.szt", "layers.0.mlp.up.weight")
    with pytest.raises(ChecksumMismatchError, match="layers.0.mlp.up.weight"):
        decompress(tmp_path / "model.szt", tmp_path / "out.safetensors")
    assert listing(tmp_path) == ["model.safetensors", "model.szt"]


def test_decompress_streams_large_tensors_in_slices(tmp_path, monkeypatch):
    """Slices smaller than a tensor (and of an odd size) give the same bytes as one piece."""
    monkeypatch.setattr(expand, "SLICE_BYTES", 1002)
    tensors = {"w": bf16_weights((77, 131), 4), "r": torch.randn(700)}
    save_safetensors(tensors, tmp_path / "m.safetensors")
    convert(tmp_path / "m.safetensors")
    with SztFile(tmp_path / "m.szt") as szt:
        sizes = [chunk.numel() for chunk in expand.iter_raw_bytes(szt, szt.entry("w"))]
    assert max(sizes) == 1002 and sum(sizes) == 77 * 131 * 2
    decompress(tmp_path / "m.szt", tmp_path / "back.safetensors")
    assert (tmp_path / "back.safetensors").read_bytes() == (tmp_path / "m.safetensors").read_bytes()


# -- sharded checkpoints and folders -----------------------------------------------------------------------------


def test_sharded_checkpoint_converts_to_a_folder_with_a_rewritten_index(tmp_path):
    tensors = write_sharded(tmp_path / "src")
    report = convert(tmp_path / "src" / "model.safetensors.index.json", tmp_path / "out")
    assert listing(tmp_path / "out") == ["model-00001-of-00002.szt", "model-00002-of-00002.szt",
                                         "model.szt.index.json"]
    index = json.loads((tmp_path / "out" / "model.szt.index.json").read_text())
    source_index = json.loads((tmp_path / "src" / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"total_size": source_index["metadata"]["total_size"]}
    assert index["weight_map"] == {k: v.replace(".safetensors", ".szt") for k, v in source_index["weight_map"].items()}
    loaded = {}
    for shard in ("model-00001-of-00002.szt", "model-00002-of-00002.szt"):
        loaded.update(szformat.load_file(tmp_path / "out" / shard))
    assert_same_tensors(loaded, tensors)
    assert report.files_written == 2 and report.files_copied == 0

    decompress(tmp_path / "out" / "model.szt.index.json", tmp_path / "back")
    for shard in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"):
        assert (tmp_path / "back" / shard).read_bytes() == (tmp_path / "src" / shard).read_bytes()
    assert json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text()) == source_index


def test_model_folder_converts_recursively_and_decompresses_to_the_same_files(tmp_path):
    expected = write_pipeline(tmp_path / "pipe")
    report = convert(tmp_path / "pipe", tmp_path / "pipe-szt")
    out = tmp_path / "pipe-szt"
    assert listing(out) == [
        "model_index.json", "text_encoder", "text_encoder/model.szt", "tokenizer", "tokenizer/tokenizer.json",
        "transformer", "transformer/config.json", "transformer/diffusion_pytorch_model-00001-of-00002.szt",
        "transformer/diffusion_pytorch_model-00002-of-00002.szt",
        "transformer/diffusion_pytorch_model.szt.index.json"]
    assert (out / "model_index.json").read_bytes() == (tmp_path / "pipe" / "model_index.json").read_bytes()
    assert_same_tensors(szformat.load_file(out / "text_encoder" / "model.szt"), expected["text_encoder"])
    index = json.loads((out / "transformer" / "diffusion_pytorch_model.szt.index.json").read_text())
    assert set(index["weight_map"].values()) == {"diffusion_pytorch_model-00001-of-00002.szt",
                                                 "diffusion_pytorch_model-00002-of-00002.szt"}
    assert report.files_written == 3 and report.files_copied == 3

    decompress(out, tmp_path / "back")
    original = {k: v for k, v in tree(tmp_path / "pipe").items() if not k.startswith(".")}
    back = tree(tmp_path / "back")
    assert back.keys() == original.keys()
    for name, data in original.items():
        if name.endswith(".index.json"):
            assert json.loads(back[name]) == json.loads(data), name
        else:
            assert back[name] == data, name


def test_folder_conversion_leaves_weights_of_other_formats_out(tmp_path):
    """A repo often holds its weights twice (safetensors and a pickle); the converted folder holds them once."""
    write_pipeline(tmp_path / "pipe")
    (tmp_path / "pipe" / "scheduler").mkdir()
    (tmp_path / "pipe" / "scheduler" / "scheduler_config.json").write_text('{"_class_name": "DDIMScheduler"}')
    for name in ("text_encoder/pytorch_model.bin", "text_encoder/pytorch_model.bin.index.json",
                 "transformer/diffusion_pytorch_model.ckpt", "model.onnx", "flax_model.msgpack"):
        (tmp_path / "pipe" / name).write_bytes(b"weights")
    convert(tmp_path / "pipe", tmp_path / "pipe-szt")
    kept = listing(tmp_path / "pipe-szt")
    assert "scheduler/scheduler_config.json" in kept and "tokenizer/tokenizer.json" in kept
    assert not [name for name in kept if name.endswith((".bin", ".ckpt", ".onnx", ".msgpack", ".bin.index.json"))]


def test_folder_conversion_is_deterministic(tmp_path):
    write_pipeline(tmp_path / "pipe")
    convert(tmp_path / "pipe", tmp_path / "a")
    convert(tmp_path / "pipe", tmp_path / "b")
    assert tree(tmp_path / "a") == tree(tmp_path / "b")


def test_existing_output_folder_is_replaced_only_with_overwrite(tmp_path):
    write_sharded(tmp_path / "src")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old.txt").write_text("old")
    with pytest.raises(FileExistsError):
        convert(tmp_path / "src", tmp_path / "out")
    assert listing(tmp_path / "out") == ["old.txt"]
    report = convert(tmp_path / "src", tmp_path / "out", overwrite=True)
    assert "old.txt" in listing(tmp_path / "out") and "model.szt.index.json" in listing(tmp_path / "out")
    assert (tmp_path / "out" / "old.txt").read_text() == "old"  # the user's file is theirs
    assert report.kept == ["old.txt"]
    assert "  kept      1 file(s) already in the output folder: old.txt" in report.summary()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


def test_overwrite_replaces_what_a_conversion_writes_and_keeps_the_users_files(tmp_path):
    write_sharded(tmp_path / "src")
    (tmp_path / "src" / "config.json").write_text('{"new": true}')
    out = tmp_path / "out"
    convert(tmp_path / "src", out)
    (out / "config.json").write_text('{"old": true}')
    (out / "notes").mkdir()
    (out / "notes" / "MY_NOTES.txt").write_text("mine")
    convert(tmp_path / "src", out, overwrite=True)
    assert (out / "config.json").read_text() == '{"new": true}'
    assert (out / "notes" / "MY_NOTES.txt").read_text() == "mine"
    with szformat.safe_open(out / "model-00001-of-00002.szt", framework="pt") as f:
        assert f.keys()


def test_an_existing_empty_output_folder_is_used_without_overwrite(tmp_path):
    write_sharded(tmp_path / "src")
    (tmp_path / "out").mkdir()
    report = convert(tmp_path / "src", tmp_path / "out")
    assert "model.szt.index.json" in listing(tmp_path / "out") and report.kept == []
    with pytest.raises(FileExistsError):  # no longer empty
        convert(tmp_path / "src", tmp_path / "out")


def test_links_in_a_model_folder_are_not_followed_out_of_it(tmp_path, monkeypatch):
    """A link to /proc/self/environ put the environment, Hub token included, into the output; now only regular
    files inside the folder are copied, and the report says what was left out and why."""
    src = tmp_path / "src"
    write_sharded(src)
    outside = secret_outside(tmp_path, monkeypatch, "hf_secret_never_copied")
    links = {"environ.txt": "/proc/self/environ", "hostname": "/etc/hostname", "zero.txt": "/dev/zero",
             "outside.txt": outside / "secret.txt", "linked-dir": outside, "dangling.json": "/nonexistent"}
    for name, where in links.items():
        os.symlink(where, src / name)
    os.mkfifo(src / "fifo")
    os.symlink("config.json", src / "config-link.json")
    (src / "config.json").write_text("{}")
    report = convert(src, tmp_path / "out")
    out = tmp_path / "out"
    assert not any(b"hf_secret_never_copied" in p.read_bytes() for p in out.rglob("*") if p.is_file())
    assert not {*links, "fifo"} & set(listing(out))
    assert (out / "config-link.json").read_text() == "{}"  # a link inside the folder is copied as its file
    reasons = dict(report.left_out)
    assert set(reasons) == {*links, "fifo"}
    assert "outside the folder" in reasons["environ.txt"] and "outside the folder" in reasons["outside.txt"]
    assert "not a regular file" in reasons["zero.txt"] and "not a regular file" in reasons["fifo"]
    assert reasons["linked-dir"] == "a linked folder (not followed)"
    assert any(line.startswith("  not copied: environ.txt") for line in report.summary())


def test_a_weight_file_linked_from_outside_the_folder_is_refused(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    save_safetensors(model_tensors(), tmp_path / "elsewhere.safetensors")
    os.symlink(tmp_path / "elsewhere.safetensors", src / "model.safetensors")
    with pytest.raises(ConversionError, match="model.safetensors is a link to .*, outside the folder"):
        convert(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("break_index, message", [
    (lambda index: index["weight_map"].update({"ghost": "model-00001-of-00002.safetensors"}),
     "tensor 'ghost': the index maps this tensor to shard 'model-00001-of-00002.safetensors', which does not hold"),
    (lambda index: index["weight_map"].update({"ghost": "model-00003-of-00002.safetensors"}),
     "names shard 'model-00003-of-00002.safetensors', which is missing"),
    (lambda index: index["weight_map"].update({"ghost": "../elsewhere.safetensors"}),
     "not a file inside the index's folder"),
    (lambda index: index.pop("weight_map"), "no 'weight_map' object"),
])
def test_inconsistent_index_is_refused_before_anything_is_written(tmp_path, break_index, message):
    write_sharded(tmp_path / "src")
    index_path = tmp_path / "src" / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    break_index(index)
    index_path.write_text(json.dumps(index))
    for source in (index_path, tmp_path / "src"):
        with pytest.raises(ShardIndexError) as info:
            convert(source, tmp_path / "out")
        assert message in str(info.value)
        assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]


def test_inputs_that_are_not_checkpoints_are_refused(tmp_path):
    with pytest.raises(FileNotFoundError):
        convert(tmp_path / "missing.safetensors", tmp_path / "x.szt")
    (tmp_path / "weights.bin").write_bytes(b"pickle")
    with pytest.raises(ConversionError, match="expected a .safetensors file"):
        convert(tmp_path / "weights.bin", tmp_path / "x.szt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConversionError, match="folder holds no .safetensors file"):
        convert(tmp_path / "empty", tmp_path / "x")


def test_output_overlapping_the_input_is_refused(tmp_path):
    write_sharded(tmp_path / "src")
    with pytest.raises(ConversionError, match="overlaps the input"):
        convert(tmp_path / "src", tmp_path / "src" / "converted")
    with pytest.raises(ConversionError, match="overlaps the input"):
        convert(tmp_path / "src" / "model.safetensors.index.json", tmp_path, overwrite=True)
    with pytest.raises(ConversionError, match="name the output folder"):
        convert(tmp_path / "src")
    assert listing(tmp_path / "src") == sorted(p.name for p in (tmp_path / "src").iterdir())
    assert not [p for p in tmp_path.rglob("*.tmp")]


# -- atomicity ---------------------------------------------------------------------------------------------------


def fail_after(count: int, error: BaseException):
    """A stand-in for write_tensor that writes ``count`` tensors, then raises ``error``."""
    real = convert_module.write_tensor
    calls = []

    def write_tensor(*args, **kwargs):
        calls.append(args[1])
        if len(calls) > count:
            raise error
        return real(*args, **kwargs)

    return write_tensor


@pytest.mark.parametrize("error", [RuntimeError("injected"), KeyboardInterrupt()])
@pytest.mark.parametrize("layout", ["file", "folder"])
def test_failure_mid_run_leaves_no_output_and_no_temporary(tmp_path, monkeypatch, error, layout):
    if layout == "file":
        save_safetensors(model_tensors(), tmp_path / "model.safetensors")
        source, target = tmp_path / "model.safetensors", tmp_path / "model.szt"
    else:
        write_pipeline(tmp_path / "pipe")
        source, target = tmp_path / "pipe", tmp_path / "out"
    before = listing(tmp_path)
    monkeypatch.setattr(convert_module, "write_tensor", fail_after(12 if layout == "folder" else 3, error))
    with pytest.raises(type(error)):
        convert(source, target)
    assert listing(tmp_path) == before


class DiskFull:
    """A writable file that takes ``budget`` bytes, then fails like a full disk."""

    def __init__(self, file, budget: int):
        self._file, self._budget = file, budget

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if size > self._budget:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._budget -= size
        return self._file.write(data)

    def __getattr__(self, name):
        return getattr(self._file, name)


def fill_disk_after(monkeypatch, budget: int) -> None:
    """Every file opened for writing through ``os.fdopen`` (both writers do) takes ``budget`` bytes, then fails."""
    real_fdopen = os.fdopen

    def fdopen(fd, mode="r", *args, **kwargs):
        file = real_fdopen(fd, mode, *args, **kwargs)
        return DiskFull(file, budget) if "w" in mode else file

    monkeypatch.setattr(os, "fdopen", fdopen)


def test_disk_full_during_conversion_leaves_nothing(tmp_path, monkeypatch):
    write_pipeline(tmp_path / "pipe")
    before = listing(tmp_path)
    fill_disk_after(monkeypatch, 9000)
    with pytest.raises(WriteError, match="No space left on device") as info:
        convert(tmp_path / "pipe", tmp_path / "out")
    assert isinstance(info.value, OSError)
    assert listing(tmp_path) == before


def test_disk_full_during_decompression_leaves_nothing(model_file, tmp_path, monkeypatch):
    convert(model_file, tmp_path / "model.szt")
    before = listing(tmp_path)
    fill_disk_after(monkeypatch, 5000)
    with pytest.raises(WriteError, match="No space left on device"):
        decompress(tmp_path / "model.szt", tmp_path / "back.safetensors")
    assert listing(tmp_path) == before


def test_disk_full_while_copying_the_other_files_is_a_write_error(tmp_path, monkeypatch):
    write_pipeline(tmp_path / "pipe")
    before = listing(tmp_path)

    def copyfile(src, dst, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(checkpoint_module.shutil, "copyfile", copyfile)
    with pytest.raises(WriteError, match="No space left on device") as info:
        convert(tmp_path / "pipe", tmp_path / "out")
    assert isinstance(info.value, OSError) and "model_index.json" in str(info.value)
    assert listing(tmp_path) == before


# -- devices and backends ----------------------------------------------------------------------------------------


def test_injected_backend_gives_the_same_bytes_as_the_cpu(model_file, tmp_path):
    backend = RecordingBackend()
    convert(model_file, tmp_path / "cpu.szt")
    convert(model_file, tmp_path / "backend.szt", backend=backend)
    assert (tmp_path / "backend.szt").read_bytes() == (tmp_path / "cpu.szt").read_bytes()
    bf16_nonempty = [t.numel() for t in model_tensors().values() if t.dtype == torch.bfloat16 and t.numel()]
    assert sorted(backend.encoded) == sorted(bf16_nonempty)


def test_round_trip_mismatch_aborts_the_conversion(model_file, tmp_path):
    with pytest.raises(RoundTripError, match="does not decode bit for bit") as info:
        convert(model_file, tmp_path / "bad.szt", backend=RecordingBackend(corrupt=True))
    assert info.value.tensor is not None
    assert listing(tmp_path) == ["model.safetensors"]


def test_cpu_round_trip_check_catches_a_bad_byte_in_a_late_slice(tmp_path, monkeypatch):
    """The CPU encoder checks slice by slice as it writes; a wrong byte in its last slice must still stop the file."""
    monkeypatch.setattr(cpu, "SLICE_PAIRS", 64)
    monkeypatch.setattr(cpu, "WHOLE_ENCODE_ELEMENTS", 0)  # the sliced path, which larger tensors take
    pairs_left = flip_in_last_slice(monkeypatch, 50 * 70 // 2, "sm", 0x80)
    save_safetensors({"w": bf16_weights((50, 70), 5)}, tmp_path / "m.safetensors")
    with pytest.raises(RoundTripError, match="tensor 'w': SplitZip payload does not decode bit for bit"):
        convert(tmp_path / "m.safetensors")
    assert pairs_left == [0]
    assert listing(tmp_path) == ["m.safetensors"]


@pytest.mark.skipif(cpu._native is None, reason="the C kernels' whole-payload encoder")
def test_cpu_round_trip_check_catches_a_bad_byte_from_the_whole_payload_encoder(tmp_path, monkeypatch):
    """A small tensor is written by one C call and checked by decoding it whole: a wrong byte stops the file."""
    monkeypatch.setattr(cpu, "_native", CorruptingKernels(lambda layout: layout.off_sm + layout.n - 1, 0x80))
    save_safetensors({"w": bf16_weights((50, 70), 5)}, tmp_path / "m.safetensors")
    with pytest.raises(RoundTripError, match="tensor 'w': SplitZip payload does not decode bit for bit"):
        convert(tmp_path / "m.safetensors")
    assert listing(tmp_path) == ["m.safetensors"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error raised without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error(model_file, tmp_path):
    with pytest.raises(DecodeRouteError, match="needs a CUDA GPU"):
        convert(model_file, tmp_path / "gpu.szt", device="cuda")
    with pytest.raises(DecodeRouteError, match="'cpu' or 'cuda'"):
        codec_for("meta")
    assert listing(tmp_path) == ["model.safetensors"]


@pytest.mark.skipif(gpu_codec.triton_missing() is not None, reason="needs a Triton the GPU codec runs on")
def test_triton_codec_under_the_interpreter_gives_the_cpu_bytes(model_file, tmp_path):
    """The real GPU codec module as the backend, its kernels run by the Triton interpreter on CPU tensors (in a
    fresh interpreter: TRITON_INTERPRET must be set before the kernels are first imported)."""
    convert(model_file, tmp_path / "cpu.szt")
    script = ("import sys, szformat.codec.gpu as gpu; from szformat.convert import convert; "
              "convert(sys.argv[1], sys.argv[2], backend=gpu, device='cpu')")
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join([str(Path(szformat.__file__).resolve().parent.parent),
                                          os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", script, str(model_file), str(tmp_path / "triton.szt")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "triton.szt").read_bytes() == (tmp_path / "cpu.szt").read_bytes()


def test_cuda_selects_the_gpu_codec_module_when_cuda_and_triton_are_there(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_codec, "triton_missing", lambda: None)
    assert codec_for("cuda:0") == (gpu_codec, torch.device("cuda:0"))
    monkeypatch.setattr(gpu_codec, "triton_missing", lambda: "Triton 3.0.0 is older than 3.2")
    with pytest.raises(DecodeRouteError, match=re.escape("cuda needs Triton: Triton 3.0.0 is older than 3.2")):
        codec_for("cuda")


# -- verification ------------------------------------------------------------------------------------------------


def check_through_the_loader(monkeypatch) -> None:
    """``verify`` decodes every file as ``load_file`` does, on its threads (the C kernels check every file they can
    otherwise)."""
    monkeypatch.setattr(verify_module, "_problems_in_kernels", lambda szt, entries, threads: None)


@pytest.fixture
def through_the_loader(monkeypatch):
    check_through_the_loader(monkeypatch)


@pytest.fixture(params=["C kernels, one thread", "C kernels, four threads", "loader"])
def verify_route(request, monkeypatch):
    """Each test of what ``verify`` finds runs every way a file can be checked: the same problems either way. Four
    threads are given a tensor or more each (however few bytes), so the shares are checked side by side, each
    dropping the pages it read as it goes, as a large file's are (``cpu_kernel.worth_releasing``)."""
    if request.param == "loader":
        check_through_the_loader(monkeypatch)
    elif request.param == "C kernels, four threads":
        monkeypatch.setattr(verify_module, "_cpus", lambda: 4)
        monkeypatch.setattr(verify_module, "THREAD_BYTES", 1)
        monkeypatch.setattr(cpu.cpu_kernel, "RELEASE_BYTES", 0)
    else:
        monkeypatch.setattr(verify_module, "_cpus", lambda: 1)
    return request.param


def test_verify_passes_a_good_checkpoint(tmp_path, verify_route):
    write_pipeline(tmp_path / "pipe")
    convert(tmp_path / "pipe", tmp_path / "out")
    report = verify(tmp_path / "out")
    assert report.ok and report.files == 3 and report.tensors == 20
    assert report.summary()[0].startswith("OK: 20 tensors")


def test_verify_names_every_bad_tensor_and_file(tmp_path, verify_route):
    write_pipeline(tmp_path / "pipe")
    convert(tmp_path / "pipe", tmp_path / "out")
    out = tmp_path / "out"
    flip_payload_byte(out / "text_encoder" / "model.szt", "layers.0.mlp.up.weight")
    flip_payload_byte(out / "text_encoder" / "model.szt", "layers.0.norm.bias")
    shard = out / "transformer" / "diffusion_pytorch_model-00002-of-00002.szt"
    shard.write_bytes(shard.read_bytes()[:-3])  # truncated: it no longer opens
    report = verify(out)
    assert {(p.file, p.tensor) for p in report.problems} == {
        ("text_encoder/model.szt", "layers.0.mlp.up.weight"), ("text_encoder/model.szt", "layers.0.norm.bias"),
        ("transformer/diffusion_pytorch_model-00002-of-00002.szt", None)}
    assert not report.ok
    text = "\n".join(report.summary())
    assert text.startswith("FAILED: 3 problem(s) in 16 tensors") and "CRC-32 of the stored bytes" in text
    assert "diffusion_pytorch_model-00002-of-00002.szt: file holds" in text and "the preamble announces" in text

    shard.unlink()
    problems = {(p.file, p.tensor): p.message for p in verify(out).problems}
    index = "transformer/diffusion_pytorch_model.szt.index.json"
    assert [t for f, t in problems if f == index] == [None]  # one problem for the shard, naming its tensors
    assert problems[(index, None)].startswith("the index names shard 'diffusion_pytorch_model-00002-of-00002.szt', "
                                              "which is missing (4 tensor(s): ")
    assert all(repr(t) in problems[(index, None)] for t in ("position_ids", "noise", "scale", "empty"))


def skip_unless_the_kernels_check_mappings() -> None:
    from szformat.codec import cpu_kernel

    if cpu_kernel.native is None or not cpu_kernel.checksums_in_kernel() or not cpu_kernel.native.guards_mapped_reads():
        pytest.skip("the C kernels cannot check a file from its mapping here")


NO_TORCH_VERIFY = """
import sys
from szformat.convert.verify import verify
report = verify(sys.argv[1])
print(sorted(p.tensor for p in report.problems), "torch" in sys.modules)
"""


def test_a_small_file_is_checked_without_torch_and_every_problem_named_as_the_loader_names_it(tmp_path, monkeypatch):
    """The C kernels alone check a small file, in a process that never imports torch, and name each bad tensor with
    the reason the loader's path gives: stored bytes altered, an escape stream broken (its stored CRC-32 made right
    again), decoded bytes that differ from ``raw_crc32`` (the header edited, its CRC-32 made right), a raw tensor's
    bytes altered; the good tensors pass."""
    skip_unless_the_kernels_check_mappings()
    tensors = {name: with_outliers(bf16_weights((64, 48), seed=k)) for k, name in enumerate("abcg")}
    tensors["raw"] = torch.arange(300, dtype=torch.int32)
    path = tmp_path / "model.szt"
    szformat.save_file(tensors, path)
    forge = Forge.load(path)
    forge.payload_at("a", 10, bytes([forge.body[forge.entry("a")["offset"] + 10] ^ 0x40]), fix_crc=False)
    streams = forge.entry("b")["encoding"]["configuration"]["streams"]
    forge.payload_at("b", streams["local_pos"], b"\xff\xff")  # a position past its chunk
    forge.entry("c")["raw_crc32"] ^= 1
    forge.payload_at("raw", 0, b"\x07", fix_crc=False)
    bad = forge.write(tmp_path / "bad.szt")

    by_kernels = [(p.tensor, p.message) for p in verify(bad).problems]
    monkeypatch.setattr(verify_module, "THREAD_BYTES", 1)
    assert by_kernels == [(p.tensor, p.message) for p in verify(bad, threads=3).problems]
    check_through_the_loader(monkeypatch)
    assert by_kernels == [(p.tensor, p.message) for p in verify(bad).problems]
    assert [tensor for tensor, _ in by_kernels] == ["a", "b", "c", "raw"]
    (_, a), (_, b), (_, c), (_, raw) = by_kernels
    assert a.startswith("CRC-32 of the stored bytes") and raw.startswith("CRC-32 of the stored bytes")
    assert "escape" in b and c.startswith("CRC-32 of the decoded bytes")
    root = str(Path(__file__).parents[2])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    for checked, expected in ((path, "[] False"), (bad, "['a', 'b', 'c', 'raw'] False")):
        done = subprocess.run([sys.executable, "-c", NO_TORCH_VERIFY, str(checked)], env=env, capture_output=True,
                              text=True, timeout=120)
        assert (done.returncode, done.stdout.strip()) == (0, expected), done.stderr


def test_a_page_the_kernels_cannot_read_leaves_the_file_to_the_loader(tmp_path, monkeypatch):
    """Where a guarded call cannot read a page (a file cut short meanwhile, a failing disk), the C kernels' check
    gives the file to the loader's path, which names the tensor whose page it was: here it reads them all."""
    from szformat.codec import cpu_kernel
    from szformat.loading import host_decode

    skip_unless_the_kernels_check_mappings()
    real = cpu_kernel.native

    class LosingAPage:
        def __getattr__(self, name):
            return getattr(real, name)

        def check_payloads(self, *args):
            raise EOFError("a page could not be read")

    path = tmp_path / "model.szt"
    szformat.save_file({"w": bf16_weights((64, 48), seed=3)}, path)
    loaded = []
    real_decode = host_decode.decode_entries
    monkeypatch.setattr(host_decode, "decode_entries", lambda file, entries, **kw: loaded.append(
        [e.name for e in entries]) or real_decode(file, entries, **kw))
    monkeypatch.setattr(cpu_kernel, "native", LosingAPage())
    assert verify(path).ok and loaded == [["w"]]
    szformat.save_file({f"w{k}": bf16_weights((64, 48), seed=k) for k in range(4)}, path)
    monkeypatch.setattr(verify_module, "THREAD_BYTES", 1)  # a share per thread: the page lost on one of them
    loaded.clear()
    assert verify(path, threads=3).ok and loaded == [["w0", "w1", "w2", "w3"]]


def test_verify_checks_small_tensors_together_and_each_alone_only_where_needed(tmp_path, monkeypatch,
                                                                              through_the_loader):
    """Tensors are decoded in groups of GROUP_BYTES on the loader's threads; a tensor larger than that, and each
    tensor of a group that failed, are checked alone, so every bad tensor is still named and nothing else."""
    from szformat.loading import host_decode

    monkeypatch.setattr(expand, "GROUP_BYTES", 3072)
    tensors = {f"t{k}": bf16_weights((20, 25), seed=k) for k in range(6)}  # 1,000 bytes each
    tensors["large"] = bf16_weights((80, 25), seed=9)  # 4,000 bytes: alone
    tensors["raw"] = torch.arange(200, dtype=torch.int32)  # stored raw, 800 bytes
    path = tmp_path / "model.szt"
    szformat.save_file(tensors, path)
    with SztFile(path) as f:
        order = list(f.entries)
        groups = [[e.name for e in g] for g in expand.tensor_groups(list(f.entries.values()))]
    together, alone = [], []
    real_decode, real_alone = host_decode.decode_entries, verify_module._checked_alone
    monkeypatch.setattr(host_decode, "decode_entries", lambda file, entries, **kw: together.append(
        [e.name for e in entries]) or real_decode(file, entries, **kw))
    monkeypatch.setattr(verify_module, "_checked_alone", lambda szt, entry, buffer: alone.append(entry.name)
                        or real_alone(szt, entry, buffer))
    assert [n for g in groups for n in g] == order and all(len(g) <= 3 for g in groups) and ["large"] in groups
    assert verify(path).ok
    assert together == [g for g in groups if g != ["large"]] and alone == ["large"]

    bad = next(g for g in groups if len(g) > 1)
    flip_payload_byte(path, bad[-1])
    together.clear(), alone.clear()
    report = verify(path)
    assert [(p.tensor, "CRC-32 of the stored bytes" in p.message) for p in report.problems] == [(bad[-1], True)]
    assert alone == [n for g in groups if g in (bad, ["large"]) for n in g]  # the failed group's tensors, each alone


def test_decompress_writes_grouped_and_large_tensors_in_order(tmp_path, monkeypatch):
    """Tensors decoded together on the loader's threads and a tensor too large for a group (slice by slice) land
    in the safetensors file in order, byte for byte."""
    monkeypatch.setattr(expand, "GROUP_BYTES", 3072)
    tensors = {f"t{k}": bf16_weights((20, 25), seed=k) for k in range(4)}
    tensors["large"] = bf16_weights((80, 25), seed=9)
    tensors["raw"] = torch.arange(200, dtype=torch.int32)
    source = tmp_path / "model.safetensors"
    save_safetensors(tensors, source)
    convert(source, tmp_path / "model.szt")
    alone = []
    real = expand.iter_raw_bytes
    monkeypatch.setattr(decompress_module, "iter_raw_bytes", lambda szt, entry: alone.append(entry.name)
                        or real(szt, entry))
    decompress(tmp_path / "model.szt", tmp_path / "back.safetensors")
    assert alone == ["large"]
    assert (tmp_path / "back.safetensors").read_bytes() == source.read_bytes()


@pytest.mark.parametrize("at_rest", [None, 3])
def test_verify_checks_large_tensors_in_windows_where_it_can(tmp_path, monkeypatch, at_rest, through_the_loader):
    """A SplitZip tensor too large for a group in the in-memory form is checked in windows of the group's buffer on
    the loader's threads, others slice by slice; a bad one is named either way."""
    from szformat.loading import host_decode

    monkeypatch.setattr(expand, "GROUP_BYTES", 3072)
    tensors = {"t": bf16_weights((20, 25), seed=1), "large": bf16_weights((80, 25), seed=9),
               "large_raw": torch.arange(1000, dtype=torch.int32)}
    source = tmp_path / "model.safetensors"
    save_safetensors(tensors, source)
    path = tmp_path / "model.szt"
    convert(source, path, at_rest=at_rest)
    windows, slices = [], []
    real_windows, real_slices = host_decode.decode_windows, expand.iter_raw_bytes
    monkeypatch.setattr(host_decode, "decode_windows", lambda szt, entry, buffer: windows.append(entry.name)
                        or real_windows(szt, entry, buffer))
    monkeypatch.setattr(expand, "iter_raw_bytes", lambda szt, entry: slices.append(entry.name)
                        or real_slices(szt, entry))
    assert verify(path).ok
    assert (windows, sorted(slices)) == ((["large"], ["large_raw"]) if at_rest is None else
                                         ([], ["large", "large_raw"]))
    flip_payload_byte(path, "large")
    assert [(p.tensor, "stored bytes" in p.message) for p in verify(path).problems] == [("large", True)]


def test_verify_and_decompress_take_one_buffer_advised_huge_for_every_shard(tmp_path, monkeypatch,
                                                                           through_the_loader):
    """The group buffer is made once per call, however many shards, and its pages advised huge before they are
    first written."""
    from szformat.loading import host_pages

    advised, made = [], []
    real_advise, real_buffer = host_pages.advise_huge_pages, expand.group_buffer
    monkeypatch.setattr(host_pages, "advise_huge_pages", lambda t: advised.append(t.numel()) or real_advise(t))
    monkeypatch.setattr(decompress_module, "group_buffer", lambda: made.append("decompress") or real_buffer())
    monkeypatch.setattr(verify_module, "group_buffer", lambda: made.append("verify") or real_buffer())
    write_sharded(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "out")
    advised.clear()
    assert verify(tmp_path / "out").ok
    decompress(tmp_path / "out", tmp_path / "back")
    assert made == ["verify", "decompress"] and advised.count(expand.GROUP_BYTES) == 2
    assert len(list((tmp_path / "back").glob("*.safetensors"))) == 2


def test_verify_and_decompress_a_file_of_empty_tensors(tmp_path, verify_route):
    path = tmp_path / "empty.szt"
    szformat.save_file({"e": torch.zeros(0, 3, dtype=torch.bfloat16), "f": torch.zeros(0)}, path)
    report = verify(path)
    assert report.ok and report.tensors == 2 and report.raw_bytes == 0
    decompress(path, tmp_path / "back.safetensors")
    assert {k: tuple(v.shape) for k, v in load_safetensors(tmp_path / "back.safetensors").items()} == \
        {"e": (0, 3), "f": (0,)}


def test_verify_of_a_single_file_and_of_an_index(tmp_path, model_file):
    convert(model_file, tmp_path / "model.szt")
    assert verify(tmp_path / "model.szt").ok
    write_sharded(tmp_path / "src")
    convert(tmp_path / "src", tmp_path / "out")
    assert verify(tmp_path / "out" / "model.szt.index.json").tensors == 10


# -- real weights ------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not MINILM_DIR.is_dir(), reason="run tools/fetch_minilm.py to fetch the MiniLM checkpoint")
def test_real_minilm_weights_convert_and_come_back_bit_for_bit(tmp_path):
    report = convert(MINILM_DIR, tmp_path / "minilm-szt")
    assert report.encoded and report.payload_ratio < report.ratio < 0.9
    assert (f"ratio {report.ratio:.4f} ({(1 - report.ratio) * 100:.1f} % smaller; headers and alignment padding "
            "included)") in "\n".join(report.summary())
    assert verify(tmp_path / "minilm-szt").ok
    decompress(tmp_path / "minilm-szt", tmp_path / "back")
    for source in MINILM_DIR.rglob("*.safetensors"):
        rel = source.relative_to(MINILM_DIR)
        assert (tmp_path / "back" / rel).read_bytes() == source.read_bytes(), rel


MINILM_FP32 = MINILM_DIR.parent / "minilm-fp32" / "model.safetensors"


@pytest.mark.skipif(not MINILM_FP32.is_file(), reason="run tools/fetch_minilm.py to fetch the MiniLM checkpoint")
def test_real_minilm_fp32_cast_equals_the_bf16_checkpoint_torch_made(tmp_path):
    """tools/fetch_minilm.py made the BF16 checkpoint with ``tensor.to(torch.bfloat16)``: --cast bf16 of the FP32
    original gives the same tensors, and a file at about 3/8 of the FP32 one."""
    report = convert(MINILM_FP32, tmp_path / "cast.szt", cast="bf16")
    assert report.cast_from == {"F32": 103} and report.ratio < 0.4
    assert_same_tensors(szformat.load_file(tmp_path / "cast.szt"), load_safetensors(MINILM_DIR / "model.safetensors"))


@pytest.mark.parametrize("dtype", ["float8_e4m3fnuz", "float8_e5m2fnuz"])
def test_safetensors_fnuz_fp8_tensors_pass_through_raw_bit_for_bit(tmp_path, dtype):
    torch_dtype = getattr(torch, dtype, None)
    if torch_dtype is None:
        pytest.skip(f"this torch has no {dtype}")
    g = torch.Generator().manual_seed(1)
    fp8 = torch.randint(0, 256, (33, 7), dtype=torch.uint8, generator=g).view(torch_dtype)
    tensors = {"fp8": fp8, "w": (torch.randn(64, 64, generator=g) * 0.02).to(torch.bfloat16)}
    try:
        save_safetensors(tensors, tmp_path / "m.safetensors")
    except KeyError:  # safetensors < 0.5 has no name for it
        pytest.skip(f"this safetensors cannot save {dtype}")
    convert(tmp_path / "m.safetensors", tmp_path / "m.szt")
    with szformat.safe_open(tmp_path / "m.szt", framework="pt") as f:
        assert f.entry("fp8").encoding == "raw" and f.entry("fp8").dtype == dtype.replace("float8_", "F8_").upper()
        back = f.get_tensor("fp8")
    assert back.dtype == torch_dtype and torch.equal(back.view(torch.uint8), fp8.view(torch.uint8))


def test_the_report_says_what_the_at_rest_form_gives_when_page_padding_costs(tmp_path):
    g = torch.Generator().manual_seed(3)
    save_safetensors({f"w{i}": (torch.randn(300, generator=g) * 0.02).to(torch.bfloat16) for i in range(200)},
                     tmp_path / "small.safetensors")
    save_safetensors({"w": (torch.randn(1024, 1024, generator=g) * 0.02).to(torch.bfloat16)},
                     tmp_path / "big.safetensors")
    small = convert(tmp_path / "small.safetensors", tmp_path / "small.szt").summary()
    hint = [line for line in small if line.startswith("  hint ")]
    assert len(hint) == 1 and "of the source's size is page padding" in hint[0]
    assert any("--at-rest zstd packs payloads under 1 MiB at 16 bytes" in line for line in small)
    assert not [line for line in convert(tmp_path / "big.safetensors", tmp_path / "big.szt").summary()
                if line.startswith("  hint ")]
    at_rest = convert(tmp_path / "small.safetensors", tmp_path / "rest.szt", at_rest=3).summary()
    assert not [line for line in at_rest if line.startswith("  hint ")]


def test_a_source_truncated_while_it_is_converted_is_refused_naming_the_tensor_not_sigbus(tmp_path, source_reads):
    """A file that shrank gives pread a short read, and the mapping's reader a size it checks before each tensor:
    the same error either way, never a touch past the file's end."""
    path = tmp_path / "m.safetensors"
    save_safetensors({"a": torch.ones(4096, dtype=torch.bfloat16), "b": torch.ones(4096, dtype=torch.bfloat16)},
                     path)
    with sources_module.SafetensorsSource(path) as source:
        tensors = source.tensors()
        first, _ = next(tensors)
        os.truncate(path, path.stat().st_size - 4096)
        with pytest.raises(ConversionError, match=r"tensor 'b': file shrank to \d+ bytes after it was opened; "
                                                  r"bytes \[\d+, \d+\) were to be read while it was converted"):
            next(tensors)


def test_verify_deals_tensors_to_threads_by_bytes_largest_first():
    """The kernels' check gives each thread about the same bytes: the largest tensors first, each to the share with
    the fewest bytes so far; never an empty share, never more shares than tensors."""
    from types import SimpleNamespace

    entries = [SimpleNamespace(name=f"t{k}", raw_length=n) for k, n in enumerate([5, 100, 60, 40, 30, 30, 1])]
    shares = verify_module._shares(entries, 3)
    assert [[e.raw_length for e in share] for share in shares] == [[100], [60, 30], [40, 30, 5, 1]]
    assert sorted(e.name for share in shares for e in share) == sorted(e.name for e in entries)
    assert len(verify_module._shares(entries[:2], 8)) == 2 and verify_module._shares([], 4) == []


def test_a_tensor_of_several_units_with_escapes_is_checked_by_the_kernels(tmp_path, monkeypatch):
    """A tensor of more than one unit of the kernels' work, escapes in each (they are listed a unit at a time, so no
    count of them sends a file elsewhere): checked by the kernels, and a broken escape value of its second unit is
    found there, with the reason the loader gives."""
    from szformat.loading import host_decode

    skip_unless_the_kernels_check_mappings()
    unit = cpu._native.UNIT_ELEMENTS
    weights = bf16_weights((unit + 3,), seed=5)
    weights[::150] = 2.0 ** (-100 + torch.arange(0, weights[::150].numel()) % 20).float()  # rare exponents: escapes
    path = tmp_path / "model.szt"
    szformat.save_file({"w": weights}, path)
    with SztFile(path) as f:
        entry = f.entry("w")
    layout = entry.layout
    assert entry.encoding != C.ENCODING_RAW and layout.n_esc > 2 * (unit // 150) // 3
    loaded = []
    real_decode = host_decode.decode_entries
    monkeypatch.setattr(host_decode, "decode_entries", lambda file, entries, **kw: loaded.append(
        [e.name for e in entries]) or real_decode(file, entries, **kw))
    assert verify(path).ok and loaded == []
    data = bytearray(path.read_bytes())
    data[entry.offset + layout.off_ev + layout.n_esc - 2] ^= 0x01  # an escape of the second unit
    path.write_bytes(bytes(data))
    report = verify(path)
    assert loaded == [] and [(p.tensor, "stored bytes" in p.message) for p in report.problems] == [("w", True)]


def test_verify_runs_on_omp_num_threads_where_it_is_set(monkeypatch):
    """Without importing torch, the kernels' check takes the thread count torch would: ``OMP_NUM_THREADS`` where it
    is a count, else the CPUs the process may run on."""
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert verify_module._cpus() == 3
    every = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    for unusable in ("0", "four", ""):
        monkeypatch.setenv("OMP_NUM_THREADS", unusable)
        assert verify_module._cpus() == every
