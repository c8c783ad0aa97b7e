"""Sharded-checkpoint indexes: forged indexes for each refusal, the smallest legal one, the writer's bytes and
atomicity, and how a file, an index or a folder becomes a list of shards."""

from __future__ import annotations

import json
import os
import random
import re
from pathlib import Path

import pytest
import torch

import szformat
from szformat.errors import FormatError, ShardIndexError, WriteError
from szformat.format import index as index_module
from szformat.format.index import (Shard, ShardIndex, check_shard, checkpoint_shards, index_problems, read_index,
                                   write_index)

ROOT = Path(__file__).resolve().parents[2]


def forge(folder: Path, content: bytes | str | dict, name: str = "model.szt.index.json") -> Path:
    path = folder / name
    if isinstance(content, dict):
        content = json.dumps(content)
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    return path


def test_smallest_legal_index_parses(tmp_path):
    assert read_index(forge(tmp_path, {"weight_map": {}})) == ShardIndex({}, {})


def test_the_example_of_the_spec_parses(tmp_path):
    spec = (ROOT / "spec" / "szt-v1.md").read_text(encoding="utf-8")
    section = spec[spec.index("## Sharded checkpoints"):]
    example = re.search(r"```json\n(.*?)\n```", section, re.S).group(1)
    index = read_index(forge(tmp_path, example))
    assert index.weight_map == {"lm_head.weight": "model-00002-of-00002.szt"}
    assert index.metadata == {"total_size": 16060522496}


@pytest.mark.parametrize("content, message, tensor", [
    (b"\xff\xfe{}", "not valid JSON", None),
    ('{"weight_map": {', "not valid JSON", None),
    ("[" * 100_000 + "]" * 100_000, "not valid JSON", None),
    ("[]", "no 'weight_map' object", None),
    ('{"metadata": {}}', "no 'weight_map' object", None),
    ('{"weight_map": ["w"]}', "no 'weight_map' object", None),
    ('{"metadata": [], "weight_map": {}}', "'metadata' must be an object", None),
    ('{"weight_map": {"w": 3}}', "weight_map names 3, not a file inside the index's folder", "w"),
    ('{"weight_map": {"w": "a.szt", "w": "b.szt"}}', "holds the key 'w' twice", None),
    ('{"weight_map": {}, "weight_map": {"w": "../x.szt"}}', "holds the key 'weight_map' twice", None),
])
def test_malformed_index_is_refused_naming_the_file(tmp_path, content, message, tensor):
    path = forge(tmp_path, content)
    with pytest.raises(ShardIndexError) as caught:
        read_index(path)
    assert isinstance(caught.value, FormatError) and isinstance(caught.value, ValueError)
    assert caught.value.path == str(path) and caught.value.tensor == tensor
    assert message in str(caught.value) and str(path) in str(caught.value)


@pytest.mark.parametrize("shard", ["", "/abs/model.szt", "../model.szt", "sub/../../model.szt", "./model.szt",
                                   "sub//model.szt", "sub/", "..\\model.szt", "sub\\model.szt"])
def test_shard_outside_the_index_folder_is_refused(tmp_path, shard):
    path = forge(tmp_path, {"weight_map": {"a": "model.szt", "b": shard}})
    with pytest.raises(ShardIndexError, match="not a file inside the index's folder") as caught:
        read_index(path)
    assert caught.value.tensor == "b"
    with pytest.raises(ShardIndexError, match="not a file inside the index's folder"):
        checkpoint_shards(path)


def test_shards_in_sub_folders_and_any_characters_are_legal(tmp_path):
    weight_map = {"a": "shards/model-00001.szt", "b": "шард ü.szt", "c": "model..2.szt"}
    index = read_index(forge(tmp_path, {"metadata": {"total_size": 3}, "weight_map": weight_map}))
    assert index.weight_map == weight_map and index.shard_names() == list(weight_map.values())


def test_written_index_is_sorted_indented_and_reads_back(tmp_path):
    index = ShardIndex({"total_size": 10, "format": "pt"}, {"b": "s2.szt", "é": "s1.szt", "a": "s1.szt"})
    path = write_index(tmp_path / "model.szt.index.json", index)
    assert path.read_bytes() == (
        '{\n  "metadata": {\n    "format": "pt",\n    "total_size": 10\n  },\n'
        '  "weight_map": {\n    "a": "s1.szt",\n    "b": "s2.szt",\n    "é": "s1.szt"\n  }\n}\n').encode()
    assert read_index(path) == index
    shuffled = ShardIndex(dict(reversed(index.metadata.items())), dict(reversed(index.weight_map.items())))
    assert write_index(tmp_path / "again.json", shuffled).read_bytes() == path.read_bytes()


def test_failed_index_write_leaves_the_old_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "model.szt.index.json"
    path.write_text("old")

    def refuse(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(index_module.os, "replace", refuse)
    with pytest.raises(WriteError, match="No space left") as caught:
        write_index(path, ShardIndex({}, {"w": "model.szt"}))
    assert caught.value.path == str(path)
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == [path.name]
    with pytest.raises(WriteError):
        write_index(tmp_path / "missing" / "model.szt.index.json", ShardIndex({}, {}))
    assert not (tmp_path / "missing").exists()


def test_index_problems_and_check_shard_name_what_is_missing_or_left_out(tmp_path):
    index = ShardIndex({}, {"a": "s1.szt", "b": "s1.szt", "c": "s2.szt", "d": "s3.szt", "e": "s2.szt"})
    shards = {"sub/s1.szt": ["a", "e", "f"], "sub/s2.szt": None}  # s2 unreadable: reported on its own
    assert list(index_problems(index, shards, "sub/model.szt.index.json")) == [
        (None, "the index names shard 's3.szt', which is missing (1 tensor(s): 'd')"),
        ("b", "the index maps this tensor to shard 's1.szt', which does not hold it"),
        ("e", "shard 's1.szt' holds this tensor, and the index's weight_map maps it to shard 's2.szt'"),
        ("f", "shard 's1.szt' holds this tensor, and the index's weight_map omits it")]
    index_path = tmp_path / "sub" / "model.szt.index.json"
    check_shard(Shard(tmp_path / "s1.szt", None, None), {"a"})
    check_shard(Shard(tmp_path / "sub" / "s1.szt", ["a"], index_path), ["a"])
    with pytest.raises(ShardIndexError, match="maps this tensor to shard 's1.szt', which does not hold it") as caught:
        check_shard(Shard(tmp_path / "sub" / "s1.szt", ["a", "b"], index_path), ["a"])
    assert caught.value.tensor == "b" and caught.value.path == str(index_path)
    with pytest.raises(ShardIndexError, match="holds this tensor, and the index's weight_map does not") as caught:
        check_shard(Shard(tmp_path / "sub" / "s1.szt", ["a"], index_path), ["a", "z"])
    assert caught.value.tensor == "z" and caught.value.path == str(index_path)


def test_checkpoint_shards_of_a_file_an_index_and_a_folder(tmp_path):
    assert checkpoint_shards(tmp_path / "model.szt") == [(tmp_path / "model.szt", None, None)]
    (tmp_path / "b.szt").write_bytes(b"")
    (tmp_path / "a.szt").write_bytes(b"")
    assert checkpoint_shards(tmp_path) == [(tmp_path / "a.szt", None, tmp_path), (tmp_path / "b.szt", None, tmp_path)]
    path = forge(tmp_path, {"weight_map": {"x": "s2.szt", "y": "s1.szt", "z": "s2.szt"}})
    expected = [(tmp_path / "s1.szt", ["y"], path), (tmp_path / "s2.szt", ["x", "z"], path)]
    assert checkpoint_shards(path) == expected and checkpoint_shards(tmp_path) == expected
    forge(tmp_path, {"weight_map": {}}, "other.szt.index.json")
    with pytest.raises(FormatError, match="folder holds several sharded indexes"):
        checkpoint_shards(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FormatError, match="folder holds no .szt file"):
        checkpoint_shards(tmp_path / "empty")


def test_shards_linked_from_outside_the_folder_load(tmp_path):
    """The Hugging Face cache layout: ``snapshots/<sha>/*.szt`` are links to ``blobs/<hash>``."""
    torch.manual_seed(random.randrange(1 << 30))
    tensors = {"a.weight": torch.randn(33, 7).to(torch.bfloat16), "b.steps": torch.arange(5)}
    (tmp_path / "blobs").mkdir()
    snapshot = tmp_path / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    for i, name in enumerate(tensors):
        szformat.save_file({name: tensors[name]}, tmp_path / "blobs" / f"blob{i}")
        try:
            os.symlink(f"../../blobs/blob{i}", snapshot / f"model-0000{i + 1}-of-00002.szt")
        except (OSError, NotImplementedError):
            pytest.skip("this platform cannot create symbolic links")
    write_index(snapshot / "model.szt.index.json",
                ShardIndex({}, {name: f"model-0000{i + 1}-of-00002.szt" for i, name in enumerate(tensors)}))
    for path in (snapshot / "model.szt.index.json", snapshot):
        loaded = szformat.load_file(path)
        assert loaded.keys() == tensors.keys()
        assert all(torch.equal(loaded[k].view(torch.uint8), tensors[k].view(torch.uint8)) for k in tensors)


# -- a broken sharded checkpoint: load_file refuses it, verify reports it, both naming index and shard or tensor --

S1, S2 = "model-00001-of-00002.szt", "model-00002-of-00002.szt"


def _sharded_checkpoint(folder: Path) -> dict:
    folder.mkdir()
    szformat.save_file({"a": torch.randn(8, 8).to(torch.bfloat16), "b": torch.arange(4)}, folder / S1)
    szformat.save_file({"c": torch.randn(16).to(torch.bfloat16)}, folder / S2)
    return {"metadata": {}, "weight_map": {"a": S1, "b": S1, "c": S2}}


def _missing(folder, index):
    (folder / S2).unlink()


def _nul(folder, index):
    index["weight_map"]["c"] = "model-0000\x002-of-00002.szt"


def _surrogate(folder, index):
    index["weight_map"]["c"] = "\ud800.szt"  # JSON may escape a lone surrogate; no file name holds one


def _too_long(folder, index):
    index["weight_map"]["c"] = "x" * 300 + ".szt"


def _loop(folder, index):
    (folder / S2).unlink()
    os.symlink(S2, folder / S2)


def _omitted(folder, index):
    del index["weight_map"]["b"]


def _two_indexes(folder, index):
    forge(folder, index, "other.szt.index.json")


@pytest.mark.parametrize("damage, error, message, tensor, problem", [
    (_missing, ShardIndexError, f"the index names shard '{S2}', which cannot be opened (No such file", "c",
     ("model.szt.index.json", None, f"the index names shard '{S2}', which is missing (1 tensor(s): 'c')")),
    (_nul, ShardIndexError, "weight_map names 'model-0000\\x002-of-00002.szt', which holds a NUL character", "c",
     ("model.szt.index.json", "c", "weight_map names 'model-0000\\x002-of-00002.szt', which holds a NUL")),
    (_surrogate, ShardIndexError, "weight_map names '\\ud800.szt', which is not a file name this system can encode",
     "c", ("model.szt.index.json", "c", "weight_map names '\\ud800.szt', which is not a file name")),
    (_too_long, ShardIndexError, f"the index names shard '{'x' * 300}.szt', which cannot be opened (File name too "
     "long)", "c", ("model.szt.index.json", None, f"the index names shard '{'x' * 300}.szt', which is missing")),
    (_loop, ShardIndexError, f"the index names shard '{S2}', which cannot be opened (Too many levels of symbolic "
     "links)", "c", (S2, None, "Too many levels of symbolic links")),
    (_omitted, ShardIndexError, f"shard '{S1}' holds this tensor, and the index's weight_map does not map it", "b",
     ("model.szt.index.json", "b", f"shard '{S1}' holds this tensor, and the index's weight_map omits it")),
    (_two_indexes, FormatError, "folder holds several sharded indexes; pass the file or index to load", None,
     (".", None, "folder holds several sharded indexes; pass the file or index to load (model.szt.index.json, "
      "other.szt.index.json)")),
])
def test_a_broken_sharded_checkpoint_is_refused_by_load_and_reported_by_verify(tmp_path, capsys, damage, error,
                                                                               message, tensor, problem):
    from szformat.cli.main import main
    from szformat.convert import verify

    folder = tmp_path / "ckpt"
    index = _sharded_checkpoint(folder)
    try:
        damage(folder, index)
    except (OSError, NotImplementedError):
        pytest.skip("this platform cannot create that file")
    index_path = forge(folder, index)
    targets = [folder] if damage is _two_indexes else [index_path, folder]
    for target in targets:
        with pytest.raises(error) as caught:
            szformat.load_file(target)
        assert message in caught.value.reason
        assert caught.value.path == str(folder if damage is _two_indexes else index_path)
        assert caught.value.tensor == tensor and str(caught.value).count("\n") == 0

        report = verify(target)
        expected = problem if target == folder or problem[0] != S2 else \
            ("model.szt.index.json", None, f"the index names shard '{S2}', which is missing")
        assert [(p.file, p.tensor, p.message[: len(expected[2])]) for p in report.problems] == [expected]
        assert main(["verify", str(target)]) == 1
        err = capsys.readouterr().err
        assert err.startswith("FAILED: 1 problem(s)") and expected[2] in err


def test_an_integer_past_the_digit_limit_is_the_package_error_naming_the_index(tmp_path):
    path = tmp_path / "model.szt.index.json"
    path.write_text('{"metadata": {"total_size": ' + "9" * 5000 + '}, "weight_map": {}}')
    with pytest.raises(ShardIndexError, match=r"model\.szt\.index\.json.*cannot be read \(Exceeds the limit"):
        read_index(path)
