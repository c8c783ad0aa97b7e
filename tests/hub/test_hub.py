"""Hub support against a loopback Hub: the real huggingface_hub client, real HTTP, no request leaves the machine.

huggingface_hub reads its endpoint, cache, token path, offline and Xet switches into ``huggingface_hub.constants``
at import, so the ``hub`` fixture patches those constants (not the environment) to the loopback server and to
``tmp_path``. Xet is off: its upload path needs a token service the loopback Hub does not have.
"""

from __future__ import annotations

import os
import json
import types
from pathlib import Path

import huggingface_hub
import pytest
import torch
from huggingface_hub import HfApi, constants
from huggingface_hub.utils import (EntryNotFoundError, RepositoryNotFoundError,
                                   RevisionNotFoundError)
from safetensors.torch import save_file as save_safetensors

import szformat
from szformat.errors import (FormatError, HubCheckpointNotFoundError, HubOfflineError, HubReferenceError,
                             HubRequestError, PushError, ShardIndexError)
from szformat.format.reader import SztFile
from szformat.hub import HubRef, hub_ref_from_arguments, parse_hub_ref, push_to_hub, resolve
from szformat.hub.card import checkpoint_stats
from szformat.hub.resolve import download_model_repo, download_safetensors_repo

from support import ALICE, BOB, card_of, close_hub_sessions, point_client_at, secret_outside


# -- test data ---------------------------------------------------------------------------------------------------


def make_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(48, 33, generator=g).to(torch.bfloat16),  # SplitZip-encoded
        "layer.bias": torch.randint(-1000, 1000, (7,), generator=g, dtype=torch.int32),  # stored raw
    }


def write_szt(path: Path, seed: int) -> dict[str, torch.Tensor]:
    path.parent.mkdir(parents=True, exist_ok=True)
    tensors = make_tensors(seed)
    szformat.save_file(tensors, path, metadata={"format": "pt"})
    return tensors


def write_sharded_folder(folder: Path, seed: int = 0) -> dict[str, torch.Tensor]:
    """Two shards, their index, copied config/tokenizer files, the source card (MIT) and a hidden cache folder."""
    first = write_szt(folder / "model-00001-of-00002.szt", seed)
    second = {f"second.{k}": v for k, v in make_tensors(seed + 1).items()}
    szformat.save_file(second, folder / "model-00002-of-00002.szt", metadata={"format": "pt"})
    weight_map = {**{k: "model-00001-of-00002.szt" for k in first}, **{k: "model-00002-of-00002.szt" for k in second}}
    (folder / "model.szt.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (folder / "config.json").write_text('{"hidden_size": 33}')
    (folder / "tokenizer.json").write_text('{"model": {}}')
    (folder / "README.md").write_text("---\nlicense: mit\n---\n# The source model\n")
    (folder / ".cache" / "huggingface").mkdir(parents=True)
    (folder / ".cache" / "huggingface" / "state.lock").write_text("local only")
    return {**first, **second}


def assert_same_tensors(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert actual[name].dtype == tensor.dtype and actual[name].shape == tensor.shape, name
        assert torch.equal(actual[name].reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8)), name


# -- references (no network) -----------------------------------------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("hf://alice/tiny", HubRef("alice/tiny")),
    ("hf://alice/tiny/", HubRef("alice/tiny")),
    ("hf://alice/tiny/model.szt", HubRef("alice/tiny", "model.szt")),
    ("hf://alice/tiny@v1.0/sub/dir/model.szt", HubRef("alice/tiny", "sub/dir/model.szt", "v1.0")),
    ("hf://alice/tiny@" + "a" * 40, HubRef("alice/tiny", "", "a" * 40)),
    ("hf://alice/tiny@refs/pr/12/model.szt", HubRef("alice/tiny", "model.szt", "refs/pr/12")),
    ("hf://alice/tiny@feature%2Fx/model.szt", HubRef("alice/tiny", "model.szt", "feature/x")),
    ("hf://models/alice/tiny", HubRef("alice/tiny")),
    ("hf://datasets/alice/tiny/model.szt", HubRef("alice/tiny", "model.szt", repo_type="dataset")),
])
def test_parse_hub_ref_round_trips(text, expected):
    ref = parse_hub_ref(text)
    assert ref == expected
    assert parse_hub_ref(str(ref)) == ref


@pytest.mark.parametrize("text, message", [
    ("hf://alice", "namespace/name"),
    ("hf://alice/", "namespace/name"),
    ("hf://alice/tiny@/model.szt", "empty revision"),
    ("hf://alice/ti ny/model.szt", "alphanumeric"),
    ("hf://alice/tiny/../secrets", "not a relative path"),
    ("hf://alice/tiny/a//b.szt", "not a relative path"),
    ("hf://alice/tiny/a\\b.szt", "not a relative path"),
])
def test_parse_hub_ref_refuses_malformed_references(text, message):
    with pytest.raises(HubReferenceError, match=message):
        parse_hub_ref(text)


def test_local_paths_pass_through_untouched(hub, tmp_path):
    assert resolve("checkpoints/model.szt") == Path("checkpoints/model.szt")
    assert resolve(tmp_path / "model.szt") == tmp_path / "model.szt"
    assert hub.requests == []


@pytest.mark.parametrize("args, kwargs, message", [
    (("model.szt",), {"revision": "main"}, "only apply to Hub references"),
    (("hf://alice/tiny",), {"repo_id": "alice/tiny"}, "not both"),
    (("hf://alice/tiny@v1/model.szt",), {"revision": "v2"}, "contradicts"),
    (("hf://alice/tiny/model.szt",), {"filename": "other.szt"}, "already names a file"),
    (("hf://alice/tiny",), {"repo_type": "dataset"}, "write the type in the reference"),
    ((None,), {}, "nothing to open"),
])
def test_contradicting_arguments_are_refused(hub, args, kwargs, message):
    with pytest.raises(HubReferenceError, match=message):
        resolve(*args, **kwargs)
    assert hub.requests == []


def test_keywords_complete_a_reference():
    assert hub_ref_from_arguments("hf://alice/tiny", filename="model.szt", revision="v1") == \
        HubRef("alice/tiny", "model.szt", "v1")
    assert hub_ref_from_arguments(None, repo_id="alice/tiny", filename="a/model.szt", repo_type="dataset") == \
        HubRef("alice/tiny", "a/model.szt", None, "dataset")


# -- push --------------------------------------------------------------------------------------------------------


def test_push_single_file_then_load_it_back(hub, tmp_path):
    tensors = write_szt(tmp_path / "model.szt", seed=1)
    info = push_to_hub(tmp_path / "model.szt", "alice/tiny", token=ALICE, base_model="alice/source")

    assert info.oid == hub.head("alice/tiny")
    remote = hub.files("alice/tiny")
    assert set(remote) == {".gitattributes", "model.szt", "README.md"}
    assert remote["model.szt"] == (tmp_path / "model.szt").read_bytes()

    local = resolve("hf://alice/tiny/model.szt")
    assert local.read_bytes() == (tmp_path / "model.szt").read_bytes()
    assert_same_tensors(szformat.load_file(local), tensors)


def test_model_card_states_metadata_sizes_and_how_to_load(hub, tmp_path):
    write_szt(tmp_path / "model.szt", seed=2)
    push_to_hub(tmp_path / "model.szt", "alice/tiny", token=ALICE, base_model="alice/source")

    card = card_of(hub, "alice/tiny")
    assert card.data.library_name == "szformat"
    assert card.data.tags == ["szt"]
    assert card.data.base_model == "alice/source"
    with SztFile(tmp_path / "model.szt") as szt:
        entries = list(szt.entries.values())
    original = sum(e.raw_length for e in entries)
    converted = (tmp_path / "model.szt").stat().st_size
    assert [e.encoding for e in entries] == ["splitzip", "raw"]
    assert f"| Original size (tensor bytes) | {original / 1e3:.2f} kB ({original:,} bytes) |" in card.text
    assert f"| Converted size (`.szt` files) | {converted / 1e3:.2f} kB ({converted:,} bytes) |" in card.text
    assert f"| Ratio | {converted / original:.3f} (" in card.text
    assert "| Tensors encoded (SplitZip) | 1 |" in card.text
    assert "| Tensors stored raw | 1 |" in card.text
    assert f"| szformat version | {szformat.__version__} |" in card.text
    assert "| Form | in memory (format 1.0)" in card.text
    assert 'szformat.load_file("hf://alice/tiny/model.szt", device="cuda")' in card.text


def test_model_card_says_a_checkpoint_is_at_rest_and_how_to_repack_it(hub, tmp_path):
    tensors = make_tensors(5)
    szformat.save_file(tensors, tmp_path / "model.szt", metadata={"format": "pt"}, at_rest="zstd")
    push_to_hub(tmp_path / "model.szt", "alice/rest", token=ALICE)
    card = card_of(hub, "alice/rest")
    assert "| Form | at rest (format 1.1" in card.text and "--at-rest none" in card.text
    assert_same_tensors(szformat.load_file("hf://alice/rest/model.szt"), tensors)  # the pull inflates


def test_checkpoint_stats_add_up_every_file(tmp_path):
    write_sharded_folder(tmp_path)
    shards = sorted(tmp_path.glob("*.szt"))
    stats = checkpoint_stats(shards)
    assert stats.files == 2
    assert stats.tensors_encoded == 2 and stats.tensors_raw == 2
    assert stats.converted_bytes == sum(p.stat().st_size for p in shards)
    assert stats.original_bytes == 2 * (48 * 33 * 2 + 7 * 4)


def test_push_folder_in_one_commit_and_again_without_a_commit(hub, tmp_path):
    folder = tmp_path / "model-szt"
    write_sharded_folder(folder)
    info = push_to_hub(folder, "alice/sharded", token=ALICE, commit_message="First upload")

    assert hub.commit_count("alice/sharded") == 2  # the repo's initial commit, then ours
    assert hub.state.repos["alice/sharded"].commits[info.oid].title == "First upload"
    remote = hub.files("alice/sharded")
    assert set(remote) == {".gitattributes", "README.md", "config.json", "tokenizer.json", "model.szt.index.json",
                           "model-00001-of-00002.szt", "model-00002-of-00002.szt"}
    for name in remote.keys() - {".gitattributes", "README.md"}:
        assert remote[name] == (folder / name).read_bytes(), name
    card = card_of(hub, "alice/sharded")
    assert card.data.license == "mit"  # carried from the source card, which the generated one replaces
    assert "# The source model" not in card.text
    assert "| `.szt` files | 2 |" in card.text
    assert 'szformat.load_file("hf://alice/sharded", device="cuda")' in card.text

    requests_before = len(hub.requests)
    again = push_to_hub(folder, "alice/sharded", token=ALICE)
    assert again.oid == info.oid
    assert hub.commit_count("alice/sharded") == 2
    assert not [r for r in hub.requests[requests_before:] if r[0] == "PUT"]  # no byte uploaded twice


def test_push_only_changed_files_on_update(hub, tmp_path):
    folder = tmp_path / "model-szt"
    write_sharded_folder(folder)
    push_to_hub(folder, "alice/sharded", token=ALICE)
    szformat.save_file({"second.layer.weight": make_tensors(9)["layer.weight"],
                        "second.layer.bias": make_tensors(9)["layer.bias"]}, folder / "model-00002-of-00002.szt")

    requests_before = len(hub.requests)
    info = push_to_hub(folder, "alice/sharded", token=ALICE)
    assert hub.commit_count("alice/sharded") == 3
    assert info.oid == hub.head("alice/sharded")
    assert len([r for r in hub.requests[requests_before:] if r[0] == "PUT"]) == 1
    assert hub.files("alice/sharded")["model-00002-of-00002.szt"] == (folder / "model-00002-of-00002.szt").read_bytes()


def test_push_to_a_new_branch_leaves_main_alone(hub, tmp_path):
    write_szt(tmp_path / "model.szt", seed=3)
    push_to_hub(tmp_path / "model.szt", "alice/tiny", token=ALICE)
    main_before = hub.head("alice/tiny")
    write_szt(tmp_path / "model.szt", seed=4)

    info = push_to_hub(tmp_path / "model.szt", "alice/tiny", token=ALICE, revision="dev")
    assert hub.head("alice/tiny") == main_before
    assert hub.head("alice/tiny", "dev") == info.oid
    assert hub.files("alice/tiny", "dev")["model.szt"] == (tmp_path / "model.szt").read_bytes()
    assert "hf://alice/tiny@dev/model.szt" in card_of(hub, "alice/tiny", "dev").text


def test_push_without_model_card_keeps_the_folder_readme(hub, tmp_path):
    folder = tmp_path / "model-szt"
    write_sharded_folder(folder)
    push_to_hub(folder, "alice/sharded", token=ALICE, model_card=False)
    assert hub.files("alice/sharded")["README.md"] == (folder / "README.md").read_bytes()


def test_push_private_repo_and_token_from_the_environment(hub, tmp_path, monkeypatch):
    write_szt(tmp_path / "model.szt", seed=5)
    monkeypatch.setenv("HF_TOKEN", ALICE)  # huggingface_hub's usual lookup, no token argument
    push_to_hub(tmp_path / "model.szt", "alice/secret", private=True)
    assert hub.is_private("alice/secret")


@pytest.mark.parametrize("layout, error, message", [
    ("empty folder", PushError, "holds no .szt file"),
    ("index without its shard", PushError, "absent from the folder: model-00002-of-00002.szt"),
    ("truncated shard", FormatError, "model-00001-of-00002.szt"),
    ("index file", PushError, "push the folder"),
    ("safetensors file", PushError, "only .szt files"),
    ("unparsable source card", PushError, "front matter cannot be parsed"),
])
def test_push_refuses_bad_input_before_any_request(hub, tmp_path, layout, error, message):
    folder = tmp_path / "out"
    folder.mkdir()
    target = folder
    if layout == "index without its shard":
        write_sharded_folder(folder)
        (folder / "model-00002-of-00002.szt").unlink()
    elif layout == "truncated shard":
        write_sharded_folder(folder)
        shard = folder / "model-00001-of-00002.szt"
        shard.write_bytes(shard.read_bytes()[:-100])
    elif layout == "index file":
        write_sharded_folder(folder)
        target = folder / "model.szt.index.json"
    elif layout == "unparsable source card":
        write_sharded_folder(folder)
        (folder / "README.md").write_text("---\nlicense: [mit\n---\n")
    elif layout == "safetensors file":
        target = folder / "model.safetensors"
        save_safetensors(make_tensors(0), target)
    with pytest.raises(error, match=message):
        push_to_hub(target, "alice/tiny", token=ALICE)
    assert hub.requests == []


def test_push_without_write_access_is_refused(hub, tmp_path):
    write_szt(tmp_path / "model.szt", seed=6)
    with pytest.raises(HubRequestError, match=r"^the Hub refused the request \(403") as info:
        push_to_hub(tmp_path / "model.szt", "alice/tiny", token=BOB)
    assert isinstance(info.value, OSError) and "\n" not in str(info.value)
    assert isinstance(info.value.__cause__, huggingface_hub.utils.HfHubHTTPError)
    assert "alice/tiny" not in hub.state.repos


def test_push_to_a_hub_that_does_not_answer_is_one_package_error(hub, tmp_path):
    """Not the HTTP client's ConnectError: a HubRequestError (an OSError) saying the Hub cannot be reached."""
    write_szt(tmp_path / "model.szt", seed=6)
    hub.stop()
    with pytest.raises(HubRequestError, match="^cannot reach the Hub at ") as info:
        push_to_hub(tmp_path / "model.szt", "alice/tiny", token=ALICE)
    assert isinstance(info.value, OSError) and "\n" not in str(info.value)


# -- pull --------------------------------------------------------------------------------------------------------


def test_sharded_repo_resolves_by_its_index(hub, tmp_path):
    folder = tmp_path / "model-szt"
    tensors = write_sharded_folder(folder)
    push_to_hub(folder, "alice/sharded", token=ALICE)
    # A shard the index does not name must not be downloaded.
    HfApi(token=ALICE).upload_file(path_or_fileobj=b"stale", path_in_repo="old-shard.szt", repo_id="alice/sharded")

    index = resolve("hf://alice/sharded")
    assert index.name == "model.szt.index.json"
    assert sorted(p.name for p in index.parent.iterdir()) == [
        "model-00001-of-00002.szt", "model-00002-of-00002.szt", "model.szt.index.json"]
    loaded = {}
    for shard in ("model-00001-of-00002.szt", "model-00002-of-00002.szt"):
        loaded.update(szformat.load_file(index.parent / shard))
    assert_same_tensors(loaded, tensors)
    assert resolve("hf://alice/sharded/model.szt.index.json") == index
    # The cached shards are links to blobs outside the snapshot folder, and the index still loads whole.
    assert_same_tensors(szformat.load_file("hf://alice/sharded"), tensors)


def test_repo_reference_falls_back_to_model_szt(hub, tmp_path):
    write_szt(tmp_path / "model.szt", seed=7)
    push_to_hub(tmp_path / "model.szt", "alice/tiny", token=ALICE)
    local = resolve("hf://alice/tiny")
    assert local.name == "model.szt"
    assert local.read_bytes() == (tmp_path / "model.szt").read_bytes()


def test_revision_pinning_loads_the_first_push(hub, tmp_path):
    first = write_szt(tmp_path / "model.szt", seed=10)
    first_commit = push_to_hub(tmp_path / "model.szt", "alice/tiny", token=ALICE).oid
    second = write_szt(tmp_path / "model.szt", seed=11)
    push_to_hub(tmp_path / "model.szt", "alice/tiny", token=ALICE)

    assert_same_tensors(szformat.load_file(resolve(f"hf://alice/tiny@{first_commit}/model.szt")), first)
    assert_same_tensors(szformat.load_file(resolve(repo_id="alice/tiny", filename="model.szt",
                                                   revision=first_commit)), first)
    assert_same_tensors(szformat.load_file(resolve("hf://alice/tiny/model.szt")), second)


def test_loaders_take_hub_references_and_keywords(hub, tmp_path):
    first = write_szt(tmp_path / "model.szt", seed=12)
    first_commit = push_to_hub(tmp_path / "model.szt", "alice/tiny", token=ALICE).oid
    second = write_szt(tmp_path / "model.szt", seed=13)
    push_to_hub(tmp_path / "model.szt", "alice/tiny", token=ALICE)

    assert_same_tensors(szformat.load_file(f"hf://alice/tiny@{first_commit}/model.szt"), first)
    assert_same_tensors(szformat.load_file("model.szt", repo_id="alice/tiny", revision=first_commit), first)
    with szformat.safe_open("model.szt", "pt", repo_id="alice/tiny") as f:
        assert_same_tensors({name: f.get_tensor(name) for name in f.keys()}, second)
    with pytest.raises(ValueError, match="only apply to Hub references"):
        szformat.load_file(tmp_path / "model.szt", revision=first_commit)


def test_hub_keywords_with_a_local_path_are_a_hub_reference_error(hub, tmp_path):
    path = tmp_path / "model.szt"
    write_szt(path, seed=14)
    for open_it in (szformat.load_file, lambda p, **kw: szformat.safe_open(p, "pt", **kw)):
        with pytest.raises(HubReferenceError, match="revision only apply to Hub references") as info:
            open_it(path, revision="main")
        assert info.value.path == str(path)
    assert hub.requests == []


def test_sharded_download_takes_every_shard_from_the_index_commit(hub, tmp_path):
    folder = tmp_path / "model-szt"
    write_sharded_folder(folder, seed=20)
    first_commit = push_to_hub(folder, "alice/sharded", token=ALICE).oid
    write_sharded_folder(tmp_path / "v2", seed=30)
    push_to_hub(tmp_path / "v2", "alice/sharded", token=ALICE)

    snapshot = resolve(f"hf://alice/sharded@{first_commit}").parent
    assert snapshot.name == first_commit
    for shard in ("model-00001-of-00002.szt", "model-00002-of-00002.szt"):
        assert (snapshot / shard).read_bytes() == (folder / shard).read_bytes()


def test_a_push_landing_mid_download_does_not_mix_shards(hub, tmp_path):
    folder = tmp_path / "model-szt"
    write_sharded_folder(folder, seed=40)
    first_commit = push_to_hub(folder, "alice/sharded", token=ALICE).oid
    write_sharded_folder(tmp_path / "v2", seed=50)
    newer = {name: (tmp_path / "v2" / name).read_bytes() for name in ("model-00001-of-00002.szt",
                                                                       "model-00002-of-00002.szt")}

    def push_newer_shards_once_the_index_is_read(method, path):
        if method == "GET" and path.endswith("/model.szt.index.json") and hub.head("alice/sharded") == first_commit:
            hub.commit_files("alice/sharded", newer)

    hub.after_request = push_newer_shards_once_the_index_is_read
    snapshot = resolve("hf://alice/sharded").parent
    assert hub.head("alice/sharded") != first_commit  # the race did happen
    assert snapshot.name == first_commit
    for shard in newer:
        assert (snapshot / shard).read_bytes() == (folder / shard).read_bytes()


@pytest.mark.parametrize("go_offline", ["HF_HUB_OFFLINE", "local_files_only", "server stopped"])
def test_cached_checkpoints_load_without_the_hub(hub, tmp_path, monkeypatch, go_offline):
    folder = tmp_path / "model-szt"
    tensors = write_sharded_folder(folder)
    push_to_hub(folder, "alice/sharded", token=ALICE)
    single = write_szt(tmp_path / "model.szt", seed=8)
    push_to_hub(tmp_path / "model.szt", "alice/tiny", token=ALICE)
    online_file = resolve("hf://alice/tiny/model.szt")
    online_index = resolve("hf://alice/sharded")

    requests_before = len(hub.requests)
    options = {}
    if go_offline == "HF_HUB_OFFLINE":
        monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
        close_hub_sessions()  # huggingface_hub 0.x reads it when it makes a session
    elif go_offline == "local_files_only":
        options["local_files_only"] = True
    else:
        hub.stop()
    assert resolve("hf://alice/tiny/model.szt", **options) == online_file
    assert resolve("hf://alice/sharded", **options) == online_index
    assert hub.requests[requests_before:] == []
    assert_same_tensors(szformat.load_file(online_file), single)
    assert szformat.load_file(online_index.parent / "model-00002-of-00002.szt").keys() <= tensors.keys()


def test_private_repo_needs_its_owners_token(hub, tmp_path, monkeypatch):
    tensors = write_szt(tmp_path / "model.szt", seed=12)
    push_to_hub(tmp_path / "model.szt", "alice/secret", token=ALICE, private=True)

    with pytest.raises(RepositoryNotFoundError):
        resolve("hf://alice/secret/model.szt")
    with pytest.raises(RepositoryNotFoundError):
        resolve("hf://alice/secret/model.szt", token=BOB)
    assert_same_tensors(szformat.load_file(resolve("hf://alice/secret/model.szt", token=ALICE)), tensors)

    monkeypatch.setenv("HF_TOKEN", ALICE)
    assert resolve("hf://alice/secret", cache_dir=tmp_path / "other-cache").is_file()


def test_errors_name_what_is_missing(hub, tmp_path):
    write_szt(tmp_path / "model.szt", seed=13)
    push_to_hub(tmp_path / "model.szt", "alice/tiny", token=ALICE)
    HfApi(token=ALICE).create_repo("alice/empty")

    with pytest.raises(RepositoryNotFoundError):
        resolve("hf://alice/nothing-here/model.szt")
    with pytest.raises(RepositoryNotFoundError):
        resolve("hf://alice/nothing-here")
    with pytest.raises(EntryNotFoundError, match="other.szt"):
        resolve("hf://alice/tiny/other.szt")
    with pytest.raises(RevisionNotFoundError):
        resolve("hf://alice/tiny@no-such-branch/model.szt")
    with pytest.raises(HubCheckpointNotFoundError, match="holds neither model.szt.index.json nor model.szt"):
        resolve("hf://alice/empty")
    with pytest.raises(HubOfflineError, match="downloads are off .*, and hf://alice/tiny/model.szt is not in the "
                                              "local cache") as offline:
        resolve("hf://alice/tiny/model.szt", local_files_only=True, cache_dir=tmp_path / "empty-cache")
    assert isinstance(offline.value, FileNotFoundError)


def test_hub_unreachable_and_nothing_cached_fails_at_once_in_one_line(hub, monkeypatch):
    sleeps = []
    # huggingface_hub retries a failed connection with backoff (about a minute) before giving up; record any wait.
    monkeypatch.setattr(huggingface_hub.utils._http, "time", types.SimpleNamespace(sleep=sleeps.append))
    hub.stop()
    for ref in ("hf://alice/tiny/model.szt", "hf://alice/tiny"):
        with pytest.raises(HubOfflineError, match=f"cannot reach the Hub at {constants.ENDPOINT} .*, and {ref} is "
                                                  "not in the local cache") as info:
            resolve(ref)
        assert "\n" not in str(info.value) and isinstance(info.value, FileNotFoundError)
    assert not sleeps  # one quick connection said it all: no retries


def test_malformed_index_on_the_hub_is_refused(hub):
    api = HfApi(token=ALICE)
    api.create_repo("alice/evil")
    index = {"weight_map": {"w": "../../../outside.szt"}}
    api.upload_file(path_or_fileobj=json.dumps(index).encode(), path_in_repo="model.szt.index.json",
                    repo_id="alice/evil")
    with pytest.raises(ShardIndexError, match="not a file inside the index's folder"):
        resolve("hf://alice/evil")


@pytest.mark.xfail(int(huggingface_hub.__version__.split(".")[0]) < 1, raises=ValueError, strict=True,
                   reason="huggingface_hub 0.x (0.25-0.36 checked) parses a commit's URL against the default endpoint "
                          "once the commit has landed")
def test_explicit_endpoint_reaches_a_hub_other_than_the_default(hub, tmp_path, monkeypatch):
    point_client_at(monkeypatch, "http://127.0.0.1:9")  # nothing listens there
    tensors = write_szt(tmp_path / "model.szt", seed=14)
    push_to_hub(tmp_path / "model.szt", "alice/tiny", token=ALICE, endpoint=hub.endpoint)
    local = resolve("hf://alice/tiny/model.szt", endpoint=hub.endpoint)
    assert_same_tensors(szformat.load_file(local), tensors)


# -- safetensors sources for szconvert hf://... --------------------------------------------------------------------


def upload_safetensors_repo(tmp_path: Path, repo_id: str) -> Path:
    source = tmp_path / "source"
    (source / "transformer").mkdir(parents=True)
    save_safetensors(make_tensors(0), source / "model.safetensors")
    save_safetensors(make_tensors(1), source / "transformer" / "diffusion_pytorch_model.safetensors")
    (source / "config.json").write_text("{}")
    (source / "tokenizer.model").write_bytes(b"spm")
    (source / "chat_template.jinja").write_text("{{ messages }}")
    (source / "modeling_custom.py").write_text("# model code for trust_remote_code\n")
    (source / "README.md").write_text("---\nlicense: apache-2.0\n---\n")
    (source / "pytorch_model.bin").write_bytes(b"pickle")
    (source / "model.onnx").write_bytes(b"onnx")
    api = HfApi(token=ALICE)
    api.create_repo(repo_id)
    api.upload_folder(folder_path=source, repo_id=repo_id)
    return source


def test_download_safetensors_repo_takes_weights_and_config_only(hub, tmp_path):
    source = upload_safetensors_repo(tmp_path, "alice/source")
    local = download_safetensors_repo("hf://alice/source")
    files = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    assert files == ["README.md", "chat_template.jinja", "config.json", "model.safetensors", "modeling_custom.py",
                     "tokenizer.model", "transformer/diffusion_pytorch_model.safetensors"]
    assert (local / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()

    sub = download_safetensors_repo("hf://alice/source/transformer")
    assert sub == local / "transformer"
    single = download_safetensors_repo("hf://alice/source/model.safetensors")
    assert single.read_bytes() == (source / "model.safetensors").read_bytes()


def test_download_safetensors_repo_needs_a_hub_reference(hub, tmp_path):
    with pytest.raises(HubReferenceError, match="not a Hub reference"):
        download_safetensors_repo(str(tmp_path))
    with pytest.raises(HubReferenceError, match="contradicts"):
        download_safetensors_repo(HubRef("alice/source", revision="v1"), revision="v2")
    assert hub.requests == []


def test_download_safetensors_repo_without_safetensors_is_refused(hub, tmp_path):
    api = HfApi(token=ALICE)
    api.create_repo("alice/pickles")
    api.upload_file(path_or_fileobj=b"pickle", path_in_repo="pytorch_model.bin", repo_id="alice/pickles")
    with pytest.raises(HubCheckpointNotFoundError, match="no .safetensors file"):
        download_safetensors_repo("hf://alice/pickles")


def test_pushing_a_differently_sharded_folder_deletes_the_old_shards_only(hub, tmp_path):
    """A re-conversion into one file replaces a sharded push: the old shards and index go in the same commit (the
    index would otherwise still be what ``hf://alice/model`` resolves), files that are not .szt stay."""
    sharded = tmp_path / "sharded"
    write_sharded_folder(sharded)
    push_to_hub(sharded, "alice/model", token=ALICE)
    HfApi(endpoint=hub.endpoint, token=ALICE).upload_file(path_or_fileobj=b"kept", path_in_repo="notes/NOTES.txt",
                                                          repo_id="alice/model")
    single = tmp_path / "single"
    single.mkdir()
    tensors = write_szt(single / "model.szt", seed=11)
    commits = hub.commit_count("alice/model")

    push_to_hub(single, "alice/model", token=ALICE)
    assert hub.commit_count("alice/model") == commits + 1
    assert set(hub.files("alice/model")) == {".gitattributes", "README.md", "notes/NOTES.txt", "config.json",
                                             "tokenizer.json", "model.szt"}
    assert_same_tensors(szformat.load_file("hf://alice/model"), tensors)
    push_to_hub(single, "alice/model", token=ALICE)  # nothing stale any more: no commit
    assert hub.commit_count("alice/model") == commits + 1


def test_download_model_repo_takes_the_converted_model_and_leaves_other_weights(hub, tmp_path):
    """What szformat.transformers / szformat.diffusers load from a repo: .szt weights and indexes, configs and
    tokenizers of every folder, one commit; an original left beside them in the repo is not fetched."""
    folder = tmp_path / "model"
    write_sharded_folder(folder)
    write_szt(folder / "text_encoder" / "model.szt", seed=5)
    (folder / "text_encoder" / "config.json").write_text("{}")
    save_safetensors(make_tensors(0), folder / "model.safetensors")
    push_to_hub(folder, "alice/model", token=ALICE)
    local = download_model_repo("hf://alice/model")
    files = sorted(p.relative_to(local).as_posix() for p in local.rglob("*") if p.is_file())
    assert files == ["README.md", "config.json", "model-00001-of-00002.szt", "model-00002-of-00002.szt",
                     "model.szt.index.json", "text_encoder/config.json", "text_encoder/model.szt", "tokenizer.json"]
    assert download_model_repo("hf://alice/model/text_encoder") == local / "text_encoder"
    with pytest.raises(HubReferenceError, match="names a file"):
        download_model_repo("hf://alice/model/model.szt")


LINKS = {  # name in the folder -> what it points to (None: made in the test), what the refusal says
    "environ.txt": ("/proc/self/environ", "outside the folder"),
    "hostname": ("/etc/hostname", "outside the folder"),
    "zero.bin": ("/dev/zero", "not a regular file"),
    "dangling.json": ("/nonexistent/file", "a link to nothing"),
}


@pytest.mark.parametrize("name", [*LINKS, "outside.txt", "linked-dir", "fifo"])
def test_push_refuses_a_folder_whose_entries_lead_outside_it(hub, tmp_path, monkeypatch, name):
    folder = tmp_path / "model-szt"
    write_sharded_folder(folder)
    outside = secret_outside(tmp_path, monkeypatch, "hf_secret_never_uploaded")
    if name in LINKS:
        os.symlink(LINKS[name][0], folder / name)
        expected = LINKS[name][1]
    elif name == "outside.txt":
        os.symlink(outside / "secret.txt", folder / name)
        expected = "outside the folder"
    elif name == "linked-dir":
        os.symlink(outside, folder / name)
        expected = "a linked folder"
    else:
        os.mkfifo(folder / name)
        expected = "not a regular file"
    with pytest.raises(PushError, match=f"remove {name} \\([^)]*{expected}"):
        push_to_hub(folder, "alice/links", token=ALICE)
    assert "alice/links" not in hub.state.repos or not hub.files("alice/links")  # nothing uploaded


def test_push_uploads_links_that_stay_inside_the_folder(hub, tmp_path):
    folder = tmp_path / "model-szt"
    write_sharded_folder(folder)
    os.symlink("config.json", folder / "config-copy.json")
    push_to_hub(folder, "alice/inside", token=ALICE)
    assert hub.files("alice/inside")["config-copy.json"] == (folder / "config.json").read_bytes()


# -- one-line errors whatever the HTTP client --------------------------------------------------------------------


class _TransportError(Exception):
    """Stands for the HTTP client's connection error class (requests' ``RequestException``, httpx's
    ``TransportError``), which huggingface_hub 0.x also raises for some refusals, a response attached."""

    def __init__(self, message: str, response=None):
        super().__init__(message)
        self.response = response


def test_a_refusal_raised_as_a_transport_error_is_reported_as_a_refusal(monkeypatch):
    from szformat.hub import client

    monkeypatch.setattr(client, "_transport_errors", lambda: (_TransportError,))
    refused = _TransportError("Invalid user token. If you didn't pass a user token, make sure you are properly "
                              "logged in", types.SimpleNamespace(status_code=401, reason="Unauthorized"))
    cause = Exception("401 Client Error")
    cause.server_message = "Invalid credentials in Authorization header"  # as HfHubHTTPError carries it
    refused.__cause__ = cause
    with pytest.raises(HubRequestError) as caught, client.one_line_errors():
        raise refused
    assert str(caught.value) == ("the Hub refused the request (401 Unauthorized): Invalid credentials in "
                                 "Authorization header")


def test_a_failed_connection_is_reported_with_the_operating_system_s_reason(monkeypatch):
    from szformat.hub import client

    monkeypatch.setattr(client, "_transport_errors", lambda: (_TransportError,))
    nested = ("(MaxRetryError(\"HTTPConnectionPool(host='127.0.0.1', port=9): Max retries exceeded with url: "
              "/api/whoami-v2 (Caused by NewConnectionError('<urllib3.connection.HTTPConnection object>: Failed to "
              "establish a new connection: [Errno 111] Connection refused'))\"), '(Request ID: 1a2b)')")
    for message, reason in [(nested, "[Errno 111] Connection refused"),
                            ("[Errno -3] Temporary failure in name resolution",
                             "[Errno -3] Temporary failure in name resolution"),
                            ("timed out", "timed out")]:
        with pytest.raises(HubRequestError) as caught, client.one_line_errors():
            raise _TransportError(message)
        assert str(caught.value) == f"cannot reach the Hub at {constants.ENDPOINT}: {reason}"
