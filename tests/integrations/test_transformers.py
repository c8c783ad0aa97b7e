"""szformat.transformers.from_pretrained against transformers' own from_pretrained of the safetensors original.

Tiny models from small random configs, saved with save_pretrained in BF16 (sharded, so the index path runs),
converted with szconvert: every parameter and buffer must be bit-identical to transformers' own load, and so must a
forward. Also through the loopback Hub, and the real all-MiniLM-L6-v2 weights when they are cached.
"""

from __future__ import annotations

import importlib.util
import json
import os
import logging
import shutil
import subprocess
import re
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # transformers and diffusers import Triton: in interpreter mode from the first import
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

import szformat
import szformat.api
import szformat.integrations.transformers as szt
from szformat._install import install_hint
from szformat.cli.main import main as szconvert
from szformat.errors import (CheckpointMismatchError, HubReferenceError, ModelFolderError, SzformatError,
                             UnknownArchitectureError)
from szformat.format.reader import SztFile
from szformat.offload import OffloadEnvironment
from szformat.offload import install as offload_install
from support import ALICE, assert_same_model, bert_config, bits, card_of, llama_config, reference, save_and_convert


MINILM = Path.home() / ".cache" / "szformat" / "minilm" / "minilm-bf16"


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A tied Llama-style causal LM, saved in three shards."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama") / "llama"
    model = transformers.LlamaForCausalLM(llama_config(tie_word_embeddings=True))
    converted = save_and_convert(model, folder, max_shard_size="40KB")
    assert len(list(converted.glob("*.szt"))) > 1 and (converted / "model.szt.index.json").is_file()
    return folder, converted


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    """A BERT-style encoder (BertModel: no base-model prefix in its names)."""
    torch.manual_seed(1)
    folder = tmp_path_factory.mktemp("bert") / "bert"
    return folder, save_and_convert(transformers.BertModel(bert_config()), folder)


def test_causal_lm_is_bit_identical_to_the_transformers_load(llama):
    original, converted = llama
    expected = reference(transformers.AutoModelForCausalLM, original)
    model, info = szt.from_pretrained(converted, transformers.AutoModelForCausalLM, output_loading_info=True)
    assert_same_model(model, expected)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert info == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    ids = torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        assert torch.equal(bits(model(ids).logits), bits(expected(ids).logits))
    assert model.generation_config.to_dict() == expected.generation_config.to_dict()


def test_the_class_defaults_to_the_configs_architecture(llama):
    assert type(szt.from_pretrained(llama[1])) is transformers.LlamaForCausalLM


def test_a_causal_lm_checkpoint_loads_into_the_base_model_and_the_head_is_reported_unused(tmp_path):
    torch.manual_seed(4)
    converted = save_and_convert(transformers.LlamaForCausalLM(llama_config(tie_word_embeddings=False)),
                                 tmp_path / "untied")
    expected = reference(transformers.AutoModel, tmp_path / "untied")
    model, info = szt.from_pretrained(converted, transformers.AutoModel, output_loading_info=True)
    assert_same_model(model, expected)
    assert info["unexpected_keys"] == ["lm_head.weight"] and info["missing_keys"] == []


def test_bert_encoder_buffers_and_outputs_are_identical(bert):
    original, converted = bert
    expected = reference(transformers.AutoModel, original)
    model = szt.from_pretrained(converted, transformers.AutoModel)
    assert_same_model(model, expected)
    assert "embeddings.position_ids" in dict(model.named_buffers())
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        assert torch.equal(bits(model(ids).last_hidden_state), bits(expected(ids).last_hidden_state))


def test_a_base_checkpoint_in_a_head_class_initializes_and_reports_the_head(bert, caplog):
    original, converted = bert
    expected = reference(transformers.AutoModelForSequenceClassification, original, num_labels=3)
    with caplog.at_level(logging.WARNING, logger="szformat.transformers"):
        model, info = szt.from_pretrained(converted, transformers.AutoModelForSequenceClassification, num_labels=3,
                                          output_loading_info=True)
    assert info["missing_keys"] == ["classifier.weight", "classifier.bias"]
    assert "newly initialized" in caplog.text and "classifier.weight" in caplog.text
    assert model.classifier.weight.shape == (3, 32) and model.classifier.weight.device.type == "cpu"
    assert model.classifier.weight.std() > 0  # initialized, not left empty
    got, want = model.state_dict(), expected.state_dict()
    for name in want:
        if not name.startswith("classifier."):
            assert torch.equal(bits(got[name]), bits(want[name])), name


def test_dtype_casts_on_the_device(llama):
    model = szt.from_pretrained(llama[1], dtype=torch.float32)
    expected = reference(transformers.AutoModelForCausalLM, llama[0], dtype=torch.float32)
    assert_same_model(model, expected)


@pytest.mark.skipif(importlib.util.find_spec("transformers.initialization") is None,
                    reason="transformers < 5 has no flag for initialized weights")
def test_the_build_draws_no_values_into_parameters_on_meta(llama, monkeypatch):
    """Filling a tensor on meta stores nothing and costs about a millisecond a tensor: the build leaves the
    parameters to the checkpoint (buffers, computed as before, are checked by the bit-identical loads)."""
    filled = []
    for fill in ("normal_", "uniform_", "fill_", "zero_"):  # what torch.nn.init and _init_weights end in
        def recording(tensor, *args, _fill=getattr(torch.Tensor, fill), _name=fill, **kwargs):
            if tensor.device.type == "meta":
                filled.append(_name)
            return _fill(tensor, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, fill, recording)
    model = szt.from_pretrained(llama[1])
    assert filled == []
    assert_same_model(model, reference(transformers.AutoModelForCausalLM, llama[0]))


def test_the_model_is_matched_to_the_checkpoint_from_its_headers_alone(llama, tmp_path, monkeypatch):
    """Names and shapes are all the match needs: no payload is read (nor, at rest, inflated) before the load."""
    assert szconvert([str(llama[0]), str(tmp_path / "at-rest"), "--at-rest", "zstd", "--quiet"]) == 0

    def refuse(*args, **kwargs):
        raise AssertionError("a payload was read")

    monkeypatch.setattr(SztFile, "payload", refuse)
    monkeypatch.setattr(SztFile, "memory_payload", refuse)
    prepared = szt.prepare_model(tmp_path / "at-rest")
    assert set(prepared.plan.sources) == set(prepared.expected) - {"lm_head.weight"}  # tied to the embedding
    monkeypatch.undo()
    assert_same_model(szt.finish_model(prepared)[0], reference(transformers.AutoModelForCausalLM, llama[0]))


def test_variant_picks_its_file_and_the_default_leaves_variants_out(bert, tmp_path):
    original, converted = bert
    shutil.copytree(converted, tmp_path / "m")
    torch.manual_seed(7)
    other = transformers.BertModel(bert_config()).to(torch.bfloat16)
    szformat.save_file(other.state_dict(), tmp_path / "m" / "model.fp16.szt")
    assert_same_model(szt.from_pretrained(tmp_path / "m"), reference(transformers.AutoModel, original))
    variant = szt.from_pretrained(tmp_path / "m", variant="fp16")
    dense = lambda model: model.encoder.layer[1].output.dense.weight  # noqa: E731
    assert torch.equal(bits(dense(variant)), bits(dense(other)))
    with pytest.raises(ModelFolderError, match="no .szt checkpoint of variant 'bf16'"):
        szt.from_pretrained(tmp_path / "m", variant="bf16")
    shutil.copy(tmp_path / "m" / "model.szt", tmp_path / "m" / "model-copy.szt")
    with pytest.raises(ModelFolderError, match="several .szt checkpoints"):
        szt.from_pretrained(tmp_path / "m")


@pytest.mark.skipif(not (MINILM / "model.safetensors").is_file(), reason="run tools/fetch_minilm.py first")
def test_real_minilm_gives_the_same_embeddings_as_transformers(tmp_path):
    assert szconvert([str(MINILM), str(tmp_path / "minilm-szt"), "--quiet"]) == 0
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "minilm-szt")
    batch = tokenizer(["Lossless checkpoints, bit for bit.", "A second, longer sentence to pad the first one."],
                      padding=True, return_tensors="pt")
    expected = reference(transformers.AutoModel, MINILM)
    model = szt.from_pretrained(tmp_path / "minilm-szt")
    assert_same_model(model, expected)
    with torch.no_grad():
        assert torch.equal(bits(model(**batch).last_hidden_state), bits(expected(**batch).last_hidden_state))


def test_the_integrations_are_imported_only_when_used():
    code = ("import sys, szformat; assert not {'transformers', 'diffusers', 'accelerate'} & set(sys.modules); "
            "szformat.transformers.from_pretrained, szformat.diffusers.from_pretrained; "
            "assert not {'transformers', 'diffusers'} & set(sys.modules), 'imported before a call'")
    subprocess.run([sys.executable, "-c", code], check=True)


# -- bad input ---------------------------------------------------------------------------------------------------


def test_a_folder_without_config_is_refused(llama, tmp_path, no_decoding):
    shutil.copytree(llama[1], tmp_path / "m")
    (tmp_path / "m" / "config.json").unlink()
    with pytest.raises(ModelFolderError, match="no config.json"):
        szt.from_pretrained(tmp_path / "m")


def test_a_safetensors_folder_is_pointed_to_szconvert(llama, no_decoding):
    with pytest.raises(ModelFolderError, match="safetensors weights, not .szt.*szconvert"):
        szt.from_pretrained(llama[0])


def test_an_unknown_model_type_or_class_is_refused(llama, tmp_path, no_decoding):
    shutil.copytree(llama[1], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "architectures": ["NoSuchForCausalLM"]}))
    with pytest.raises(UnknownArchitectureError, match="NoSuchForCausalLM"):
        szt.from_pretrained(tmp_path / "m")
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "model_type": "no-such-model"}))
    with pytest.raises(UnknownArchitectureError, match="cannot read config.json"):
        szt.from_pretrained(tmp_path / "m")
    with pytest.raises(UnknownArchitectureError, match="cannot build"):
        szt.from_pretrained(llama[1], transformers.AutoModelForImageClassification)


def test_shapes_that_do_not_fit_are_all_listed_before_anything_is_decoded(llama, tmp_path, no_decoding):
    shutil.copytree(llama[1], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(CheckpointMismatchError) as caught:
        szt.from_pretrained(tmp_path / "m")
    message = str(caught.value)
    assert "\n" not in message and "6 shape mismatch(es)" in message
    for layer in (0, 1):
        for proj, shape in (("gate_proj", "[64, 32]"), ("up_proj", "[64, 32]"), ("down_proj", "[32, 64]")):
            assert f"model.layers.{layer}.mlp.{proj}.weight: checkpoint {shape}" in message


def test_missing_dependency_names_the_extra(monkeypatch, llama):
    monkeypatch.setitem(sys.modules, "accelerate", None)  # what an import of an absent package finds
    hint = re.escape(install_hint("transformers"))
    with pytest.raises(SzformatError, match=r"accelerate is not installed.*" + hint):
        szt.from_pretrained(llama[1])


# -- Hub and offloading ------------------------------------------------------------------------------------------


def test_loads_from_the_hub_by_reference_and_by_repo_id(hub, llama):  # noqa: F811
    original, converted = llama
    szformat.push_to_hub(converted, "alice/tiny-llama", token=ALICE)
    expected = reference(transformers.AutoModelForCausalLM, original)
    assert_same_model(szt.from_pretrained("hf://alice/tiny-llama"), expected)
    assert_same_model(szt.from_pretrained("alice/tiny-llama", revision="main"), expected)
    card = card_of(hub, "alice/tiny-llama").text
    assert 'szformat.transformers.from_pretrained("hf://alice/tiny-llama", device="cuda")' in card
    assert 'pip install "szformat[transformers]"' in card


def test_offload_binds_every_weight_under_its_checkpoint_name(monkeypatch, tmp_path):
    """A route gets the module with each tensor bound to its entry, prefixed names mapped, tied ones bound once;
    the installer is a stand-in (routes are tested on their own), so nothing runs on a GPU here."""
    torch.manual_seed(6)
    base = save_and_convert(transformers.LlamaModel(llama_config(tie_word_embeddings=True)), tmp_path / "base")
    installed = []

    def install(installation):
        installed.append(installation)
        return "handle"

    monkeypatch.setitem(offload_install.INSTALLERS, "accelerate", install)
    monkeypatch.setattr(szt, "place_buffers", lambda model, device, skip: None)  # no CUDA device in CI
    env = OffloadEnvironment(cuda_available=True, versions={"accelerate": "1.15.0"})
    model = szt.from_pretrained(base, transformers.LlamaForCausalLM, device="cuda:0", offload="accelerate",
                                offload_options={"environment": env})
    assert model.szformat_offload == "handle"
    binding = installed[0].binding
    entries = {tensor.entry: tensor.names for tensor in binding}
    assert entries["embed_tokens.weight"] == ("model.embed_tokens.weight", "lm_head.weight")
    assert "layers.1.mlp.down_proj.weight" in entries and binding.unexpected == ()
    assert all(t.device.type == "meta" for t in model.model.parameters())  # the route owns them, nothing decoded


def test_a_prefetched_load_runs_once_beside_the_build_and_is_bit_identical(llama, prefetch_on_the_cpu):
    original, converted = llama
    model = szt.from_pretrained(converted, transformers.AutoModelForCausalLM)
    assert [thread.startswith("szformat-prefetch") for thread, _ in prefetch_on_the_cpu] == [True]
    assert_same_model(model, reference(transformers.AutoModelForCausalLM, original))


def test_a_mismatch_found_while_the_load_runs_releases_what_it_loaded(llama, tmp_path, prefetch_on_the_cpu):
    shutil.copytree(llama[1], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(CheckpointMismatchError, match="6 shape mismatch"):
        szt.from_pretrained(tmp_path / "m")
    assert len(prefetch_on_the_cpu) == 1 and prefetch_on_the_cpu[0][1] == {}  # waited for, then dropped


def test_a_corrupt_payload_found_by_the_prefetched_load_is_raised_by_from_pretrained(bert, tmp_path,
                                                                                     prefetch_on_the_cpu):
    from szformat.errors import ChecksumMismatchError

    shutil.copytree(bert[1], tmp_path / "m")
    weights = tmp_path / "m" / "model.szt"
    data = bytearray(weights.read_bytes())
    with SztFile(weights) as f:
        name, entry = max(f.entries.items(), key=lambda item: item[1].length)
        data[entry.offset + 7] ^= 0x10
    weights.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError) as caught:
        szt.from_pretrained(tmp_path / "m")
    assert caught.value.tensor == name and caught.value.path is not None and "model.szt" in str(caught.value.path)


def test_a_refused_model_whose_prefetched_load_also_failed_reports_the_refusal(llama, tmp_path, prefetch_on_the_cpu):
    """The load's own error (a corrupt payload) is dropped with the load: the model's refusal is what is raised."""
    shutil.copytree(llama[1], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    for shard in (tmp_path / "m").glob("*.szt"):
        data = bytearray(shard.read_bytes())
        with SztFile(shard) as f:
            entry = max(f.entries.values(), key=lambda e: e.length)
            data[entry.offset + 7] ^= 0x10
        shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointMismatchError, match="6 shape mismatch"):
        szt.from_pretrained(tmp_path / "m")
    assert prefetch_on_the_cpu == []  # the load raised before returning anything


def test_what_is_not_a_converted_model_folder_is_refused_by_name(llama, tmp_path, no_decoding):
    shutil.copytree(llama[1], tmp_path / "m")
    with pytest.raises(HubReferenceError, match="revision only apply to Hub repos, and this is a local path"):
        szt.from_pretrained(tmp_path / "m", revision="main")
    with pytest.raises(ModelFolderError, match="got a file; pass its folder"):
        szt.from_pretrained(tmp_path / "m" / "config.json")
    with pytest.raises(ModelFolderError, match=r"no such folder \(nor a Hub repo id"):
        szt.from_pretrained(tmp_path / "missing")
    for weights in (tmp_path / "m").glob("*.szt*"):
        weights.unlink()
    with pytest.raises(ModelFolderError, match="no .szt weights in the folder"):
        szt.from_pretrained(tmp_path / "m")


def test_a_dtype_that_names_no_torch_dtype_is_refused(llama, no_decoding):
    with pytest.raises(ValueError, match="dtype must be 'auto', a torch.dtype or its name, got 'bfloat17'"):
        szt.from_pretrained(llama[1], dtype="bfloat17")


def test_the_auto_class_may_be_given_by_name(llama):
    original, converted = llama
    expected = reference(transformers.AutoModelForCausalLM, original)
    assert_same_model(szt.from_pretrained(converted, "AutoModelForCausalLM"), expected)
    with pytest.raises(UnknownArchitectureError, match="has no class 'AutoModelForNothing'"):
        szt.from_pretrained(converted, "AutoModelForNothing")
