"""``szconvert`` end to end: ``main([...])`` in process, the console entry point in a subprocess, and the Hub flags
against the loopback Hub (the real huggingface_hub client, no request leaves the machine)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import HfApi, constants
from safetensors.torch import save_file as save_safetensors

import szformat
from szformat.cli.main import main
from szformat.errors import ConversionError

from hub_server import LoopbackHub
from test_convert import (METADATA, RecordingBackend, assert_same_tensors, convert_module, flip_payload_byte, listing,
                          model_tensors, write_sharded)

REPO_ROOT = Path(szformat.__file__).resolve().parent.parent
OWNER_TOKEN = "hf_cli_owner_token"


@pytest.fixture
def model_file(tmp_path: Path) -> Path:
    path = tmp_path / "model.safetensors"
    save_safetensors(model_tensors(), path, metadata=METADATA)
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """``python -m szformat.cli ARGS`` in a fresh interpreter, as the console script runs it."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")])}
    env.pop("SZFORMAT_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "szformat.cli", *args], capture_output=True, text=True, env=env,
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
    ("exists", "szconvert: error: '{tmp}/taken.szt' exists; pass --overwrite to replace it"),
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


def test_verify_fails_naming_a_missing_shard(converted_shards, capsys):
    (converted_shards / "model-00002-of-00002.szt").unlink()
    index = json.loads((converted_shards / "model.szt.index.json").read_text())
    lost = sorted(t for t, s in index["weight_map"].items() if s == "model-00002-of-00002.szt")
    for path in (converted_shards / "model.szt.index.json", converted_shards):
        assert main(["verify", str(path)]) == 1
        captured = capsys.readouterr()
        assert captured.out == ""
        lines = captured.err.splitlines()
        assert lines[0].startswith(f"FAILED: {len(lost)} problem(s) in ")
        assert sorted(lines[1:]) == sorted(f"  model.szt.index.json: tensor {t!r}: the index names shard "
                                           f"'model-00002-of-00002.szt', which is missing" for t in lost)


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


# -- the Hub -----------------------------------------------------------------------------------------------------


@pytest.fixture
def hub(tmp_path, monkeypatch):
    """A loopback Hub that huggingface_hub talks to by default, with an empty cache and no saved token."""
    for var in ("HF_TOKEN", "HUGGING_FACE_HUB_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    home = tmp_path / "hf_home"
    for name, value in {"HF_HUB_DISABLE_XET": True, "HF_HUB_OFFLINE": False, "HF_HOME": str(home),
                        "HF_HUB_CACHE": str(home / "hub"), "HF_TOKEN_PATH": str(home / "token"),
                        "HF_STORED_TOKENS_PATH": str(home / "stored_tokens")}.items():
        monkeypatch.setattr(constants, name, value)
    server = LoopbackHub(tokens={OWNER_TOKEN: "alice"}).start()
    monkeypatch.setattr(constants, "ENDPOINT", server.endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        server.endpoint + "/{repo_id}/resolve/{revision}/{filename}")
    yield server
    server.stop()
    huggingface_hub.close_session()


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
    loaded = {}
    for shard in ("model-00001-of-00002.szt", "model-00002-of-00002.szt"):
        loaded.update(szformat.load_file(tmp_path / "out" / shard))
    assert_same_tensors(loaded, tensors)


def test_hub_source_needs_an_output(hub, capsys):
    assert main(["hf://alice/source"]) == 1
    assert error_line(capsys.readouterr().err) == "szconvert: error: give an output path: szconvert " \
                                                  "hf://alice/source ./out"
