"""``szconvert`` end to end: ``main([...])`` in process, the console entry point in a subprocess, and the Hub flags
against the loopback Hub (the real huggingface_hub client, no request leaves the machine)."""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from huggingface_hub import HfApi
from safetensors.torch import load_file as load_safetensors, save_file as save_safetensors

import szformat
from szformat.format.reader import SztFile
from szformat.cli.main import main
from szformat.convert.report import format_bytes
from szformat.errors import ConversionError

from hub_server import HubError
from support import (ALICE, METADATA, RecordingBackend, assert_same_tensors, flip_payload_byte, listing, model_tensors,
                     write_sharded)
convert_module = importlib.import_module("szformat.convert.convert")  # the package exports convert()

REPO_ROOT = Path(szformat.__file__).resolve().parent.parent
OWNER_TOKEN = ALICE  # the "alice" of the loopback Hub (conftest's hub fixture)


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_safetensors(model_tensors(), path, metadata=METADATA)
    return path


def cli_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("SZFORMAT_DEBUG", None)
    return env


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m szformat.cli ARGS`` in a fresh interpreter, as the console script runs it."""
    return subprocess.run([sys.executable, "-m", "szformat.cli", *args], capture_output=True, text=True,
                          env=cli_env(), timeout=300)


def run_python(script: str, *args: str) -> subprocess.CompletedProcess:
    """``python -c SCRIPT ARGS`` in a fresh interpreter, with this checkout's szformat importable."""
    return subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, env=cli_env(),
                          timeout=300)


def error_line(stderr: str) -> str:
    """The one line a known error prints; fails if there is more (a traceback)."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert lines[0].startswith("szconvert: error: "), stderr
    return lines[0]


# -- convert -----------------------------------------------------------------------------------------------------


def test_convert_is_the_default_command_and_prints_the_report(model_file, tmp_path, capsys):
    assert main([str(model_file), str(tmp_path / "out.szt")]) == 0
    out = capsys.readouterr().out
    assert_same_tensors(szformat.load_file(tmp_path / "out.szt"), model_tensors())
    assert out.splitlines()[0] == f"Wrote {tmp_path / 'out.szt'}"
    assert "Converted 10 tensors in 1 file(s)" in out
    assert "1 x dtype F32 is not encoded" in out and "ratio 0." in out and "MB/s" in out and "coverage  min" in out
    assert "--cast" not in out  # 192 bytes of F32 in a BF16 model: no reason to suggest a lossy cast


def test_convert_subcommand_with_the_default_output(model_file, tmp_path, capsys):
    assert main(["convert", str(model_file)]) == 0
    assert listing(tmp_path) == ["model.safetensors", "model.szt"]


def test_quiet_prints_nothing(model_file, tmp_path, capsys):
    assert main([str(model_file), str(tmp_path / "out.szt"), "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")
    assert (tmp_path / "out.szt").is_file()


def test_progress_bar_only_on_a_terminal(model_file, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    assert main([str(model_file), str(tmp_path / "a.szt")]) == 0
    assert "converting" in capsys.readouterr().err
    assert main([str(model_file), str(tmp_path / "b.szt"), "--quiet"]) == 0
    assert capsys.readouterr() == ("", "")
    monkeypatch.setattr(sys.stderr, "isatty", lambda: False)
    assert main(["verify", str(tmp_path / "a.szt")]) == 0
    assert capsys.readouterr().err == ""


def test_sharded_checkpoint_and_folder_from_the_command_line(tmp_path, capsys):
    tensors = write_sharded(tmp_path / "src")
    (tmp_path / "src" / "config.json").write_text("{}")
    assert main([str(tmp_path / "src" / "model.safetensors.index.json"), str(tmp_path / "from-index"), "-q"]) == 0
    assert main([str(tmp_path / "src"), str(tmp_path / "from-folder"), "-q"]) == 0
    assert listing(tmp_path / "from-index") == ["model-00001-of-00002.szt", "model-00002-of-00002.szt",
                                                "model.szt.index.json"]
    assert listing(tmp_path / "from-folder") == ["config.json"] + listing(tmp_path / "from-index")
    loaded = {}
    for shard in ("model-00001-of-00002.szt", "model-00002-of-00002.szt"):
        loaded.update(szformat.load_file(tmp_path / "from-folder" / shard))
    assert_same_tensors(loaded, tensors)


@pytest.mark.parametrize("case, expected", [
    ("missing", "szconvert: error: no such file or folder: '{tmp}/missing.safetensors'"),
    ("bad header", "szconvert: error: file '{tmp}/bad.safetensors': header is not valid JSON"),
    ("bad dtype", "szconvert: error: file '{tmp}/q.safetensors', tensor 'w': dtype 'Q4_K' is not supported"),
    ("exists", "szconvert: error: file '{tmp}/taken.szt': exists; pass --overwrite to replace it"),
    ("folder without output", "szconvert: error: file '{tmp}/folder': a sharded checkpoint or a folder gives a "
                              "folder: name the output folder"),
    ("push flags without push", "szconvert: error: --private, --revision only apply to an upload: add "
                                "--push-to-hub USER/REPO"),
])
def test_known_errors_print_one_line_and_exit_1(tmp_path, capsys, case, expected):
    (tmp_path / "bad.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    header = b'{"w":{"dtype":"Q4_K","shape":[2],"data_offsets":[0,1]}}'
    (tmp_path / "q.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + b"\x00")
    save_safetensors({"w": torch.ones(2)}, tmp_path / "good.safetensors")
    (tmp_path / "taken.szt").write_bytes(b"keep")
    write_sharded(tmp_path / "folder")
    argv = {
        "missing": [str(tmp_path / "missing.safetensors")],
        "bad header": [str(tmp_path / "bad.safetensors")],
        "bad dtype": [str(tmp_path / "q.safetensors")],
        "exists": [str(tmp_path / "good.safetensors"), str(tmp_path / "taken.szt")],
        "folder without output": [str(tmp_path / "folder")],
        "push flags without push": [str(tmp_path / "good.safetensors"), "--private", "--revision", "dev"],
    }[case]
    before = listing(tmp_path)
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert error_line(captured.err).startswith(expected.format(tmp=tmp_path))
    assert listing(tmp_path) == before
    assert (tmp_path / "taken.szt").read_bytes() == b"keep"


def test_debug_variable_shows_the_traceback(tmp_path, monkeypatch):
    (tmp_path / "bad.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{broken}")
    monkeypatch.setenv("SZFORMAT_DEBUG", "1")
    with pytest.raises(ConversionError, match="not valid JSON"):
        main([str(tmp_path / "bad.safetensors")])


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error printed without CUDA")
def test_device_cuda_without_a_gpu(model_file, tmp_path, capsys):
    assert main([str(model_file), str(tmp_path / "gpu.szt"), "--device", "cuda"]) == 1
    assert "needs a CUDA GPU" in error_line(capsys.readouterr().err)
    assert not (tmp_path / "gpu.szt").exists()


def test_device_flag_reaches_the_codec(model_file, tmp_path, monkeypatch, capsys):
    """``--device cuda`` with a stand-in GPU codec: the stand-in encodes, and the bytes equal the CPU conversion."""
    backend = RecordingBackend()
    requested = []
    monkeypatch.setattr(convert_module, "codec_for", lambda device: requested.append(device) or (backend, "cpu"))
    assert main([str(model_file), str(tmp_path / "gpu.szt"), "--device", "cuda", "-q"]) == 0
    monkeypatch.undo()
    assert main([str(model_file), str(tmp_path / "cpu.szt"), "-q"]) == 0
    bf16_nonempty = [t for t in model_tensors().values() if t.dtype == torch.bfloat16 and t.numel()]
    assert requested == ["cuda"] and len(backend.encoded) == len(bf16_nonempty)
    assert (tmp_path / "gpu.szt").read_bytes() == (tmp_path / "cpu.szt").read_bytes()


def test_interrupt_exits_130_and_leaves_nothing(model_file, tmp_path, monkeypatch, capsys):
    calls = []

    def interrupted(*args, **kwargs):
        calls.append(args[1])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    real = convert_module.write_tensor
    monkeypatch.setattr(convert_module, "write_tensor", interrupted)
    assert main([str(model_file), str(tmp_path / "out.szt")]) == 130
    assert capsys.readouterr().err.strip() == "szconvert: interrupted; no partial output was left"
    assert listing(tmp_path) == ["model.safetensors"]


def test_usage_errors_and_help(capsys):
    with pytest.raises(SystemExit) as info:
        main(["convert", "--help"])
    assert info.value.code == 0
    help_text = capsys.readouterr().out
    assert "examples:" in help_text and "--push-to-hub" in help_text and "szconvert model.safetensors" in help_text
    with pytest.raises(SystemExit) as info:
        main(["convert"])
    assert info.value.code == 2
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["-q", "{src}", "{out}"],
    ["{src}", "-q", "{out}"],
    ["convert", "{src}", "-q", "{out}"],
    ["-q", "convert", "{src}", "{out}"],
    ["--device", "cpu", "{src}", "--overwrite", "{out}", "--quiet"],
    ["--token", "verify", "{src}", "{out}", "-q"],  # the value of an option is never taken for a command
    ["convert", "-q", "--", "{src}", "{out}"],
])
def test_options_go_before_between_and_after_paths(model_file, tmp_path, capsys, argv):
    assert main([arg.format(src=model_file, out=tmp_path / "o.szt") for arg in argv]) == 0
    assert capsys.readouterr() == ("", "")
    assert_same_tensors(szformat.load_file(tmp_path / "o.szt"), model_tensors())


def test_options_anywhere_in_every_command(model_file, tmp_path, capsys):
    szt, back = str(tmp_path / "m.szt"), str(tmp_path / "back.safetensors")
    assert main([str(model_file), szt, "-q"]) == 0
    assert main(["-q", "verify", szt]) == 0 and main(["verify", szt, "-q"]) == 0
    assert main(["decompress", szt, "-q", back]) == 0 and main(["-q", "decompress", szt, back, "--overwrite"]) == 0
    assert capsys.readouterr() == ("", "")
    assert Path(back).read_bytes() == model_file.read_bytes()
    assert main(["--json", "info", szt]) == 0
    assert json.loads(capsys.readouterr().out)["total"]["tensor_count"] == 10


def test_a_usage_error_shows_the_usage_of_its_command(model_file, capsys):
    with pytest.raises(SystemExit) as info:
        main([str(model_file), "--bogus"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: szconvert convert [-h]")
    assert err.splitlines()[-1] == "szconvert convert: error: unrecognized arguments: --bogus"


# -- what compresses: ratios and casts ---------------------------------------------------------------------------


def test_report_and_info_give_the_true_size_ratio(tmp_path, capsys):
    """Many small tensors: every payload starts on a 4096-byte boundary, so the file is much larger than its
    payloads, and larger than its source."""
    g = torch.Generator().manual_seed(7)
    tensors = {f"layers.{i}.weight": (torch.randn(24, 16, generator=g) * 0.02).to(torch.bfloat16) for i in range(40)}
    source, szt = tmp_path / "small.safetensors", tmp_path / "small.szt"
    save_safetensors(tensors, source)
    assert main([str(source), str(szt)]) == 0
    report = capsys.readouterr().out.splitlines()
    assert main(["info", str(szt), "--json"]) == 0
    total = json.loads(capsys.readouterr().out)["total"]
    raw_bytes = sum(t.numel() * 2 for t in tensors.values())
    ratio, payload_ratio = szt.stat().st_size / source.stat().st_size, total["stored_bytes"] / raw_bytes
    assert payload_ratio < 0.9 < 2 < ratio
    assert (total["file_bytes"], total["safetensors_bytes"], total["raw_bytes"]) == (
        szt.stat().st_size, source.stat().st_size, raw_bytes)  # a file safetensors wrote: its size comes back
    assert (total["ratio"], total["payload_ratio"]) == (pytest.approx(ratio), pytest.approx(payload_ratio))
    sizes = f"{format_bytes(source.stat().st_size)} -> {format_bytes(szt.stat().st_size)}"
    assert f"  on disk   {sizes}: ratio {ratio:.4f} ({ratio:.1f} times as large; headers and alignment padding " \
           "included)" in report
    assert f"  payloads  {format_bytes(raw_bytes)} -> {format_bytes(total['stored_bytes'])}: ratio " \
           f"{payload_ratio:.4f} (tensor bytes alone)" in report
    assert main(["info", str(szt)]) == 0
    assert capsys.readouterr().out.splitlines()[1:3] == [
        f"  40 tensors ({total['encoded_count']} encoded, {total['raw_count']} raw), ratio {ratio:.4f} on disk "
        f"({ratio:.1f} times as large): {format_bytes(szt.stat().st_size)} against "
        f"{format_bytes(source.stat().st_size)} as .safetensors",
        f"  payloads {format_bytes(raw_bytes)} raw -> {format_bytes(total['stored_bytes'])} stored, ratio "
        f"{payload_ratio:.4f} (tensor bytes alone)"]


def f32_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    tensors = {"dense.weight": torch.randn(64, 48, generator=g) * 0.05, "dense.bias": torch.randn(48, generator=g),
               "norm.weight": torch.randn(48, generator=g).half(), "norm.scale": torch.randn(4, generator=g).double(),
               "position_ids": torch.arange(16), "already.bf16": torch.randn(32, 32, generator=g).to(torch.bfloat16)}
    save_safetensors(tensors, path, metadata={"format": "pt"})
    return tensors


def test_an_f32_checkpoint_report_says_nothing_compressed_and_suggests_the_cast(tmp_path, capsys):
    tensors = {name: t for name, t in f32_checkpoint(tmp_path / "all.safetensors").items() if name != "already.bf16"}
    save_safetensors(tensors, tmp_path / "f32.safetensors")
    assert main([str(tmp_path / "f32.safetensors")]) == 0
    floats = sum(t.numel() * t.element_size() for t in tensors.values() if t.is_floating_point())
    assert capsys.readouterr().out.splitlines()[-4:] == [
        "  nothing was compressed: in the in-memory form only BF16 tensors compress, and this checkpoint has none",
        f"  note      only BF16 tensors compress in the in-memory form: 1 F16, 2 F32, 1 F64 tensor(s) "
        f"({format_bytes(floats)}) stored as they are",
        "            --at-rest zstd stores them exactly as byte planes (about 0.82-0.85 of raw, inflated on load);",
        "            --cast bf16 casts them to BF16 first (lossy: the output is then not bit-exact to the source)"]
    assert main([str(tmp_path / "f32.safetensors"), str(tmp_path / "rest.szt"), "--at-rest", "zstd"]) == 0
    shown = capsys.readouterr().out
    assert "only BF16" not in shown and "--cast" not in shown  # at rest, the F32 tensors were stored as planes
    with SztFile(tmp_path / "rest.szt") as f:
        assert f.byte_planes and f.entry("dense.weight").length < f.entry("dense.weight").raw_length
    with pytest.raises(SystemExit):
        main(["convert", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "What compresses: in the in-memory form, BF16 tensors only" in help_text and "--cast {bf16}" in help_text
    assert "The at-rest form (--at-rest zstd) stores every dtype losslessly" in help_text
    assert "Or, for such a checkpoint, --cast bf16 casts its F16/F32/F64 tensors to BF16 first" in help_text


def test_cast_bf16_encodes_the_cast_tensors_and_records_the_cast(tmp_path, capsys):
    tensors = f32_checkpoint(tmp_path / "mixed.safetensors")
    szt = tmp_path / "mixed.szt"
    assert main([str(tmp_path / "mixed.safetensors"), str(szt), "--cast", "bf16"]) == 0
    assert capsys.readouterr().out.splitlines()[-2:] == [
        "  cast      1 F16, 2 F32, 1 F64 tensor(s) cast to BF16 (--cast bf16)",
        "            lossy: the output is not bit-exact to the source; verify checks the cast values"]
    cast = {name: t.to(torch.bfloat16) if t.is_floating_point() else t for name, t in tensors.items()}
    assert_same_tensors(szformat.load_file(szt), cast)
    with szformat.safe_open(szt, framework="pt") as f:
        assert f.metadata() == {"format": "pt", "szformat.cast": "F16,F32,F64->BF16"}
        assert f.descriptor("dense.weight").encoding == "splitzip"
    assert main(["verify", str(szt)]) == 0
    assert main(["decompress", str(szt), str(tmp_path / "back.safetensors")]) == 0
    capsys.readouterr()
    assert_same_tensors(load_safetensors(tmp_path / "back.safetensors"), cast)


# -- decompress, info, verify ------------------------------------------------------------------------------------


def test_decompress_gives_back_the_original_file(model_file, tmp_path, capsys):
    assert main([str(model_file), str(tmp_path / "m.szt"), "-q"]) == 0
    assert main(["decompress", str(tmp_path / "m.szt"), str(tmp_path / "back.safetensors")]) == 0
    assert (tmp_path / "back.safetensors").read_bytes() == model_file.read_bytes()
    out = capsys.readouterr().out
    assert "Decompressed 10 tensors in 1 file(s)" in out and "stored ->" in out


def test_info_shows_header_sizes_and_every_tensor(model_file, tmp_path, capsys):
    main([str(model_file), str(tmp_path / "m.szt"), "-q"])
    assert main(["info", str(tmp_path / "m.szt")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("m.szt: szt 1.0, alignment 4096,")
    assert "10 tensors (5 encoded, 5 raw)" in out and "ratio 0." in out
    assert '\n  metadata:\n' in out and '\n    format = "pt"\n' in out
    assert '\n    note = "ünïcode \\"quoted\\" / \\\\ \\u0001"\n' in out
    header = next(line for line in out.splitlines() if line.strip().startswith("name"))
    assert header.split() == ["name", "dtype", "shape", "encoding", "stored", "raw", "ratio", "coverage", "n_esc",
                              "note"]
    rows = {line.split()[0]: line.split() for line in out.splitlines()[7:] if line.strip()}
    assert rows["embed.weight"][:4] == ["embed.weight", "BF16", "64x48", "splitzip"]
    assert rows["layers.0.norm.bias"][3] == "raw" and rows["layers.0.norm.bias"][-4:] == ["F32", "is", "not",
                                                                                          "encoded"]
    assert rows["scale"][2] == "scalar" and rows["noise"][-4] == "coverage" and rows["noise"][-2:] == ["<", "0.99"]


def test_info_json_of_a_folder(tmp_path, capsys):
    write_sharded(tmp_path / "src")
    main([str(tmp_path / "src"), str(tmp_path / "out"), "-q"])
    assert main(["info", str(tmp_path / "out"), "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert [f["file"] for f in info["files"]] == ["model-00001-of-00002.szt", "model-00002-of-00002.szt"]
    assert info["total"]["tensor_count"] == 10 and info["total"]["encoded_count"] == 5
    assert info["total"]["raw_bytes"] == sum(t.numel() * t.element_size() for t in model_tensors().values())
    tensor = next(t for f in info["files"] for t in f["tensors"] if t["name"] == "layers.0.attn.k.weight")
    assert tensor["encoding"] == "splitzip" and tensor["n_esc"] > 0 and 0.99 <= tensor["coverage"] < 1
    assert tensor["stored_bytes"] < tensor["raw_bytes"] == 32 * 48 * 2


@pytest.fixture
def converted_shards(tmp_path: Path) -> Path:
    """A converted two-shard checkpoint: ``model-0000{1,2}-of-00002.szt`` and ``model.szt.index.json``."""
    write_sharded(tmp_path / "src")
    main([str(tmp_path / "src"), str(tmp_path / "out"), "-q"])
    return tmp_path / "out"


@pytest.mark.parametrize("given", ["index", "folder"])
def test_info_refuses_an_index_whose_shards_are_missing(converted_shards, capsys, given):
    (converted_shards / "model-00002-of-00002.szt").unlink()
    path = converted_shards / "model.szt.index.json" if given == "index" else converted_shards
    assert main(["info", str(path), "--json"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert error_line(captured.err) == (f"szconvert: error: file '{converted_shards}/model.szt.index.json': the "
                                        f"index names 1 missing shard(s): 'model-00002-of-00002.szt'; name a .szt "
                                        f"file to see it alone")
    assert main(["info", str(converted_shards / "model-00001-of-00002.szt")]) == 0  # the shard present, alone
    assert capsys.readouterr().out.startswith("model-00001-of-00002.szt: szt 1.0")


def test_info_names_every_missing_shard(converted_shards, capsys):
    for shard in ("model-00001-of-00002.szt", "model-00002-of-00002.szt"):
        (converted_shards / shard).unlink()
    (converted_shards / "other.szt").write_bytes(b"")  # no shard of the index: not read before the refusal
    assert main(["info", str(converted_shards)]) == 1
    assert error_line(capsys.readouterr().err).endswith(
        "the index names 2 missing shard(s): 'model-00001-of-00002.szt', 'model-00002-of-00002.szt'; name a .szt "
        "file to see it alone")


def test_info_refuses_an_index_mapping_a_tensor_to_the_wrong_shard(converted_shards, capsys):
    index_path = converted_shards / "model.szt.index.json"
    index = json.loads(index_path.read_text())
    tensor, shard = next((t, s) for t, s in index["weight_map"].items() if s == "model-00001-of-00002.szt")
    index["weight_map"][tensor] = "model-00002-of-00002.szt"
    index_path.write_text(json.dumps(index))
    assert main(["info", str(converted_shards)]) == 1
    assert error_line(capsys.readouterr().err) == (
        f"szconvert: error: file '{index_path}', tensor '{tensor}': the index maps this tensor to shard "
        f"'model-00002-of-00002.szt', which does not hold it")


def test_verify_fails_naming_a_missing_shard_in_one_line(converted_shards, tmp_path, capsys):
    (converted_shards / "model-00002-of-00002.szt").unlink()
    index = json.loads((converted_shards / "model.szt.index.json").read_text())
    lost = [t for t, s in index["weight_map"].items() if s == "model-00002-of-00002.szt"]
    problem = (f"model.szt.index.json: the index names shard 'model-00002-of-00002.szt', which is missing "
               f"({len(lost)} tensor(s): {', '.join(map(repr, lost))})")
    for path in (converted_shards / "model.szt.index.json", converted_shards):
        assert main(["verify", str(path)]) == 1
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err.splitlines()[0].startswith("FAILED: 1 problem(s) in ")
        assert captured.err.splitlines()[1:] == [f"  {problem}"]
    assert main(["decompress", str(converted_shards), str(tmp_path / "back")]) == 1
    assert error_line(capsys.readouterr().err).endswith(problem.split(": ", 1)[1])


def test_verify_exit_codes_and_bad_tensor_names(model_file, tmp_path, capsys):
    main([str(model_file), str(tmp_path / "m.szt"), "-q"])
    assert main(["verify", str(tmp_path / "m.szt")]) == 0
    assert capsys.readouterr().out.startswith("OK: 10 tensors")
    flip_payload_byte(tmp_path / "m.szt", "embed.weight")
    assert main(["verify", str(tmp_path / "m.szt"), "--quiet"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.splitlines()[0].startswith("FAILED: 1 problem(s) in 10 tensors")
    assert "m.szt: tensor 'embed.weight': CRC-32 of the stored bytes" in captured.err


@pytest.mark.parametrize("name", ["out.bin", "UPPER.SZT", "weights"])
def test_szt_files_are_recognised_by_their_magic_whatever_their_name(model_file, tmp_path, capsys, name):
    szt = tmp_path / name
    assert main([str(model_file), str(szt), "-q"]) == 0
    assert main(["info", str(szt)]) == 0
    assert capsys.readouterr().out.startswith(f"{name}: szt 1.0, alignment 4096")
    assert main(["verify", str(szt), "-q"]) == 0
    assert main(["decompress", str(szt), "-q"]) == 0  # the last suffix is replaced
    back = tmp_path / (name.split(".")[0] + ".safetensors")
    assert back.read_bytes() == model_file.read_bytes()


@pytest.mark.parametrize("command", ["info", "verify", "decompress"])
def test_a_file_without_the_magic_is_named_as_not_szt(model_file, tmp_path, capsys, command):
    (tmp_path / "notes.bin").write_bytes(b"just some bytes")
    for path in (model_file, tmp_path / "notes.bin"):
        assert main([command, str(path)]) == 1
        assert error_line(capsys.readouterr().err) == (
            f"szconvert: error: file '{path}': not a .szt file (it does not start with the .szt magic bytes), nor a "
            f"*.szt.index.json index or a folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "notes.bin"]


# -- the console entry point -------------------------------------------------------------------------------------


def test_console_entry_point_in_a_subprocess(model_file, tmp_path):
    done = run_cli(str(model_file), str(tmp_path / "m.szt"))
    assert done.returncode == 0, done.stderr
    assert "Converted 10 tensors" in done.stdout and done.stderr == ""  # no progress bar: stderr is a pipe
    verified = run_cli("verify", str(tmp_path / "m.szt"))
    assert verified.returncode == 0 and verified.stdout.startswith("OK: 10 tensors")
    failed = run_cli(str(tmp_path / "missing.safetensors"), str(tmp_path / "x.szt"))
    assert failed.returncode == 1
    assert error_line(failed.stderr) == f"szconvert: error: no such file or folder: '{tmp_path}/missing.safetensors'"
    usage = run_cli("--help")
    assert usage.returncode == 0 and "examples:" in usage.stdout


@pytest.mark.parametrize("args, status", [(["info", "{szt}"], 141), (["info", "{szt}", "--json"], 141),
                                          (["--help"], 0 if sys.version_info >= (3, 11) else 141)])
def test_a_closed_pipe_ends_the_command_quietly(tmp_path, args, status):
    """``szconvert info m.szt | head``, the reader gone early: no error, no traceback, and the status a shell
    reports for a command stopped by a closed pipe. The 1000 tensors make ``info`` print more than a pipe holds
    (64 KiB), so its writes fail however late the reading end closes. From Python 3.11 on, argparse drops a help
    text it cannot write and exits 0; before, the write fails as ``info``'s do."""
    save_safetensors({f"layers.{i}.weight": torch.ones(4, dtype=torch.bfloat16) for i in range(1000)},
                     tmp_path / "m.safetensors")
    main([str(tmp_path / "m.safetensors"), str(tmp_path / "m.szt"), "-q"])
    argv = [sys.executable, "-m", "szformat", *(arg.format(szt=tmp_path / "m.szt") for arg in args)]
    process = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=cli_env())
    process.stdout.close()  # the reading end, without reading anything
    stderr = process.stderr.read()
    assert process.wait(timeout=300) == status and stderr == b""


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["convert", "--help"], ["info", "--help"]])
def test_help_and_version_do_not_import_torch(args):
    script = ("import sys\n"
              "from szformat.cli.main import main\n"
              "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
              "print(sorted(m for m in ('torch', 'huggingface_hub', 'numpy', 'triton') if m in sys.modules))")
    done = run_python(script, *args)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "[]"


def test_version_names_the_codecs_this_install_runs(monkeypatch, capsys):
    from importlib import metadata

    from szformat import _versions as versions
    from szformat.codec import cpu_kernel, gpu

    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [f"szconvert (szformat) {szformat.__version__}", f"CPU codec: {cpu_kernel.KERNEL}"]
    if gpu.triton_missing() is None:
        assert lines[2] == f"GPU codec: Triton {metadata.version('triton')}"
    monkeypatch.setattr(gpu, "triton_missing", lambda: "Triton 3.0.0 is older than 3.2")
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.splitlines()[2] == "GPU codec: none (Triton 3.0.0 is older than 3.2)"
    monkeypatch.setattr(gpu, "triton_missing", lambda: None)  # a Triton another distribution provides
    monkeypatch.setattr(versions, "installed_version", lambda name: None)
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.splitlines()[2] == "GPU codec: Triton"


@pytest.mark.parametrize("form", ["in-memory", "at-rest"])
def test_info_reads_headers_without_torch(tmp_path, form):
    """``szconvert info`` answers from the headers: neither torch nor NumPy is imported (2-3 s and 200 MB)."""
    path = tmp_path / "m.szt"
    szformat.save_file(model_tensors(), path, metadata=METADATA, **({"at_rest": "zstd"} if form == "at-rest" else {}))
    script = ("import sys\n"
              "from szformat.cli.main import main\n"
              "assert main(sys.argv[1:]) == 0\n"
              "print(sorted(m for m in ('torch', 'numpy', 'triton') if m in sys.modules))")
    for args in (["info", str(path)], ["info", str(path), "--json"]):
        done = run_python(script, *args)
        assert done.returncode == 0, done.stderr
        assert "embed.weight" in done.stdout and done.stdout.splitlines()[-1] == "[]"


def test_import_szformat_is_light_and_its_functions_still_load():
    done = run_python("import sys, szformat\n"
                      "print('torch' in sys.modules, sorted(szformat.__all__) == sorted(set(dir(szformat)) & "
                      "set(szformat.__all__)))\n"
                      "from szformat import load_file\n"
                      "print('torch' in sys.modules, load_file is szformat.load_file, szformat.save_file.__module__)")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == ["False True", "True True szformat.api"]


def test_a_cpu_load_does_not_import_the_device_pipeline(tmp_path):
    """A load onto the CPU pays for the modules it runs, not the GPU loader's (a third of a fresh process's first
    ``load_file``), nor, for a file in the in-memory form, the at-rest stage's, the encoder's or the writer's;
    ``szformat.loading``'s names still resolve on first use."""
    path = tmp_path / "m.szt"
    szformat.save_file(model_tensors(), path)
    device = ("szformat.loading.device_loader", "szformat.loading.staging_pool", "szformat.loading.slot_decoder",
              "szformat.loading.device_route", "triton", "szformat.format.at_rest", "szformat.codec.gate", "zstandard",
              "szformat.format.atomic")
    done = run_python("import sys, szformat\n"
                      "with szformat.safe_open(sys.argv[1], 'pt') as f:\n"
                      "    f.get_tensor(next(iter(f.keys())))\n"
                      "tensors = szformat.load_file(sys.argv[1])\n"
                      f"print(len(tensors), sorted(m for m in {device!r} if m in sys.modules))\n"
                      "import szformat.loading as loading\n"
                      "print(loading.StagingConfig.__module__, loading.SlotDecoder.__module__, "
                      "sorted(loading.__all__) == sorted(set(dir(loading)) & set(loading.__all__)))", str(path))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [f"{len(model_tensors())} []",
                                        "szformat.loading.device_loader szformat.loading.slot_decoder True"]


def test_a_name_the_lazy_packages_do_not_define_is_an_attribute_error():
    import szformat.format
    import szformat.loading

    for package in (szformat, szformat.format, szformat.loading):
        assert not hasattr(package, "no_such_name")
        with pytest.raises(AttributeError, match=f"module '{package.__name__}' has no attribute 'no_such_name'"):
            package.no_such_name  # noqa: B018


def test_python_m_szformat_runs_szconvert():
    done = subprocess.run([sys.executable, "-m", "szformat", "--help"], capture_output=True, text=True,
                          env=cli_env(), timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: szconvert [-h] [--version] COMMAND ...")


@pytest.mark.parametrize("command, message", [
    ("decompress", "szconvert: interrupted; no partial output was left\n"),
    ("verify", "szconvert: interrupted\n"),  # a command that writes nothing does not speak of outputs
])
def test_ctrl_c_while_torch_loads_prints_one_line(model_file, tmp_path, command, message):
    """The interrupt arrives while the command imports torch (a second or two at every start; ``verify`` imports it
    for a file the C kernels do not check alone: one at rest)."""
    main([str(model_file), str(tmp_path / "m.szt"), "-q"] + (["--at-rest", "zstd"] if command == "verify" else []))
    script = ("import sys\n"
              "class CtrlC:\n"
              "    def find_spec(self, name, path=None, target=None):\n"
              "        if name == 'torch':\n            raise KeyboardInterrupt\n"
              "sys.meta_path.insert(0, CtrlC())\n"
              "from szformat.cli.main import main\n"
              "sys.exit(main(sys.argv[1:]))")
    args = [str(tmp_path / "m.szt")] + ([str(tmp_path / "back.safetensors")] if command == "decompress" else [])
    done = run_python(script, command, *args)
    assert (done.returncode, done.stdout, done.stderr) == (130, "", message)


# -- the Hub -----------------------------------------------------------------------------------------------------


def test_hub_repo_is_converted_and_pushed(hub, tmp_path, capsys):
    tensors = write_sharded(tmp_path / "src")
    (tmp_path / "src" / "config.json").write_text('{"hidden_size": 48}')
    api = HfApi(token=OWNER_TOKEN)
    api.create_repo("alice/source")
    api.upload_folder(folder_path=tmp_path / "src", repo_id="alice/source")

    argv = ["hf://alice/source", str(tmp_path / "out"), "--push-to-hub", "alice/converted", "--private",
            "--revision", "szt", "--commit-message", "szt weights", "--token", OWNER_TOKEN]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Converted 10 tensors in 2 file(s), copied 1 other file(s)" in out and "Pushed to " in out
    assert listing(tmp_path / "out") == ["config.json", "model-00001-of-00002.szt", "model-00002-of-00002.szt",
                                         "model.szt.index.json"]
    repo = hub.state.repos["alice/converted"]
    assert repo.private and repo.find_commit("szt").title == "szt weights"
    pushed = hub.files("alice/converted", "szt")
    for name in listing(tmp_path / "out"):
        assert pushed[name] == (tmp_path / "out" / name).read_bytes(), name
    assert "README.md" in pushed
    loaded, staged = {}, []
    for shard in ("model-00001-of-00002.szt", "model-00002-of-00002.szt"):
        loaded.update(szformat.load_file(tmp_path / "out" / shard))
        with SztFile(tmp_path / "out" / shard) as f:  # a push writes the at-rest form by default
            assert f.version == (1, 1)
            staged.append(f.at_rest)
    assert any(staged)
    assert_same_tensors(loaded, tensors)
    assert_same_tensors(szformat.load_file("hf://alice/converted@szt", token=OWNER_TOKEN), tensors)  # the pull


def test_hub_source_needs_an_output(hub, capsys):
    assert main(["hf://alice/source"]) == 1
    assert error_line(capsys.readouterr().err) == "szconvert: error: give an output path: szconvert " \
                                                  "hf://alice/source ./out"


@pytest.mark.parametrize("case", ["no token", "bad token", "other namespace", "Hub down"])
def test_push_problems_are_found_before_converting(hub, model_file, tmp_path, capsys, case):
    argv = [str(model_file), str(tmp_path / "out.szt"), "--push-to-hub",
            "bob/model-szt" if case == "other namespace" else "alice/model-szt"]
    argv += [] if case == "no token" else ["--token", "hf_not_a_token" if case == "bad token" else OWNER_TOKEN]
    if case == "Hub down":
        hub.stop()
    expected = {
        "no token": "pushing to 'alice/model-szt' needs a Hub token: pass one (--token), set HF_TOKEN or run "
                    "'hf auth login'",
        "bad token": "the Hub refused the request (401 Unauthorized): Invalid ",  # the client's words or the Hub's
        "other namespace": "the token belongs to 'alice', who cannot write to 'bob/model-szt' (namespaces: alice)",
        "Hub down": f"cannot reach the Hub at {hub.endpoint}: [Errno 111] Connection refused",
    }[case]
    before = listing(tmp_path)
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    line = error_line(captured.err)
    assert line.startswith(f"szconvert: error: {expected}") and (case == "bad token" or line.endswith(expected))
    assert listing(tmp_path) == before  # nothing was converted
    assert not hub.state.repos


def test_the_repo_is_created_before_converting(hub, model_file, tmp_path, capsys):
    created = []

    def convert(*args, **kwargs):
        created.append(sorted(hub.state.repos))
        return convert_module.convert(*args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("szformat.convert.convert", convert)  # the function the package exports, which the CLI calls
        assert main([str(model_file), str(tmp_path / "out.szt"), "--push-to-hub", "alice/model-szt", "--private",
                     "--token", OWNER_TOKEN, "-q"]) == 0
    assert created == [["alice/model-szt"]] and hub.is_private("alice/model-szt")
    assert hub.files("alice/model-szt")["out.szt"] == (tmp_path / "out.szt").read_bytes()


def test_a_refused_push_or_download_is_one_line(hub, model_file, tmp_path, capsys):
    def refuse_uploads(method: str, path: str) -> None:
        if path.endswith("/preupload/main"):
            raise HubError(403, "Storage quota exceeded")

    hub.after_request = refuse_uploads
    assert main([str(model_file), str(tmp_path / "out.szt"), "--push-to-hub", "alice/model-szt", "--token",
                 OWNER_TOKEN]) == 1
    captured = capsys.readouterr()
    assert "Converted 10 tensors" in captured.out  # converted, then refused
    assert error_line(captured.err) == ("szconvert: error: the Hub refused the request (403 Forbidden): Storage quota "
                                        "exceeded")
    assert main(["hf://alice/missing", str(tmp_path / "from-hub"), "--token", OWNER_TOKEN]) == 1
    assert error_line(capsys.readouterr().err) == ("szconvert: error: the Hub refused the request (404 Not Found): "
                                                   "Repository not found")
    hub.stop()
    assert main(["hf://alice/model-szt", str(tmp_path / "from-hub"), "--token", OWNER_TOKEN]) == 1
    assert error_line(capsys.readouterr().err) == (f"szconvert: error: cannot reach the Hub at {hub.endpoint} "
                                                   "(Connection refused), and hf://alice/model-szt is not in the "
                                                   "local cache")


def test_files_named_for_something_else_get_a_hint(model_file, tmp_path, capsys):
    """A .szt file given to convert, and safetensors data named .bin: say what each is and what to do."""
    szt, data = tmp_path / "m.szt", tmp_path / "model.bin"
    assert main([str(model_file), str(szt), "-q"]) == 0
    data.write_bytes(model_file.read_bytes())
    assert main([str(szt), str(tmp_path / "again.szt")]) == 1
    assert error_line(capsys.readouterr().err).endswith(
        f"it is a .szt file already: 'szconvert decompress {szt} OUT.safetensors' turns it back, "
        f"'szconvert info {szt}' shows what it holds")
    assert main([str(data)]) == 1
    assert error_line(capsys.readouterr().err).endswith("it holds safetensors data: rename it to model.safetensors")


def test_info_and_verify_take_several_paths(model_file, tmp_path, capsys):
    first, second, truncated = tmp_path / "a.szt", tmp_path / "b.szt", tmp_path / "t.szt"
    assert main([str(model_file), str(first), "-q"]) == 0
    assert main([str(model_file), str(second), "-q"]) == 0
    assert main(["info", str(first), str(second), "--json"]) == 0
    described = json.loads(capsys.readouterr().out)
    assert [d["files"][0]["file"] for d in described] == ["a.szt", "b.szt"]
    truncated.write_bytes(first.read_bytes()[:1000])
    assert main(["verify", str(first), str(truncated), "-q"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"{truncated}: FAILED: 1 problem(s) in 0 tensors (0 B raw) in 1 file(s) "
                                        "(1 would not open), ")
    assert main(["verify", str(first), str(second)]) == 0
    assert [line.split(": OK: ")[0] for line in capsys.readouterr().out.splitlines()] == [str(first), str(second)]


def test_a_major_version_below_1_is_damage_not_a_newer_file(model_file, tmp_path, capsys):
    path = tmp_path / "m.szt"
    assert main([str(model_file), str(path), "-q"]) == 0
    data = bytearray(path.read_bytes())
    data[8:10] = (0).to_bytes(2, "little")
    path.write_bytes(data)
    assert main(["info", str(path)]) == 1
    assert error_line(capsys.readouterr().err).endswith("format version 0.0 is not supported (this reader knows "
                                                        "major 1); no version of the format has that major: the "
                                                        "file is damaged or not a .szt file")


def test_a_mistyped_command_is_suggested_not_reported_as_a_missing_file(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["verfiy", "m.szt"]) == 2
    assert capsys.readouterr().err == ("szconvert: error: 'verfiy' is neither a command nor a file; "
                                       "did you mean 'szconvert verify'?\n")
    assert main(["nothere.safetensors"]) == 1  # a missing file that looks like no command stays a missing file
    assert "no such file or folder: 'nothere.safetensors'" in capsys.readouterr().err


def test_a_signal_after_the_output_is_complete_reports_it_kept_and_succeeds(model_file, tmp_path, capsys,
                                                                             monkeypatch):
    """Interrupted while the report is printed: the output is in place and whole, so the run says so and exits 0
    (a script that retries on failure would otherwise run into "exists")."""
    import szformat.cli.convert as convert_command

    def interrupted(lines):
        raise KeyboardInterrupt

    monkeypatch.setattr(convert_command, "print_lines", interrupted)
    target = tmp_path / "out.szt"
    assert main([str(model_file), str(target)]) == 0
    assert capsys.readouterr().err == f"szconvert: interrupted after the output was complete: {target} (kept)\n"
    assert szformat.load_file(target).keys() == model_tensors().keys()
    monkeypatch.undo()
    assert main([str(model_file), str(tmp_path / "other.szt"), "--overwrite", "-q"]) == 0  # a later run: no mix-up
