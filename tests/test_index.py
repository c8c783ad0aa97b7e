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
from szformat.format.index import (ShardIndex, check_shard, checkpoint_shards, index_problems, read_index,
                                   write_index)

ROOT = Path(__file__).resolve().parents[1]


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


def test_index_problems_and_check_shard_name_what_is_missing(tmp_path):
    index = ShardIndex({}, {"a": "s1.szt", "b": "s1.szt", "c": "s2.szt", "d": "s3.szt"})
    shards = {"sub/s1.szt": {"a"}, "sub/s2.szt": None}  # s2 unreadable: reported on its own
    assert list(index_problems(index, shards, "sub/model.szt.index.json")) == [
        ("b", "the index maps this tensor to shard 's1.szt', which does not hold it"),
        ("d", "the index names shard 's3.szt', which is missing")]
    check_shard(tmp_path / "s1.szt", None, {"a"})
    check_shard(tmp_path / "s1.szt", ["a"], {"a", "z"})
    with pytest.raises(ShardIndexError, match="maps this tensor to a shard that does not hold it") as caught:
        check_shard(tmp_path / "s1.szt", ["a", "b"], {"a"})
    assert caught.value.tensor == "b" and caught.value.path == str(tmp_path / "s1.szt")


def test_checkpoint_shards_of_a_file_an_index_and_a_folder(tmp_path):
    assert checkpoint_shards(tmp_path / "model.szt") == [(tmp_path / "model.szt", None)]
    (tmp_path / "b.szt").write_bytes(b"")
    (tmp_path / "a.szt").write_bytes(b"")
    assert checkpoint_shards(tmp_path) == [(tmp_path / "a.szt", None), (tmp_path / "b.szt", None)]
    path = forge(tmp_path, {"weight_map": {"x": "s2.szt", "y": "s1.szt", "z": "s2.szt"}})
    expected = [(tmp_path / "s1.szt", ["y"]), (tmp_path / "s2.szt", ["x", "z"])]
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
