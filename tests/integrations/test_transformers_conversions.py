"""szformat.transformers.from_pretrained of checkpoints whose names transformers converts as it loads them.

Tiny random models saved in the naming their Hub checkpoints use: Mixtral and Qwen2-MoE with one tensor per expert
(the model holds each layer's experts fused in one tensor), ViT and Dinov2 in their older layouts (renamed; Dinov2's
fused SwiGLU projection split in two), BERT with TensorFlow's ``LayerNorm.gamma``/``beta``, and a user's
``key_mapping``. Each is converted with szconvert and must load bit-identical to transformers' own load of the
safetensors folder, with the same forward.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
import types
import weakref
from pathlib import Path

import pytest
import torch


import szformat
from szformat.errors import CheckpointMismatchError, DecodeRouteError
from szformat.integrations.model_folder import checkpoint_entries
from szformat.offload import OffloadEnvironment
from szformat.offload import install as offload_install
from support import assert_same_model, bert_config, bits, llama_config, reference, save_and_convert
import szformat.integrations.transformers as szt
from szformat.cli.main import main as szconvert

transformers = pytest.importorskip("transformers")

CONVERTS = importlib.util.find_spec("transformers.conversion_mapping") is not None
"""transformers 5 converts checkpoints on load; transformers 4's models hold the tensors as stored."""
EXPERTS = 11
"""More than 10, so experts ordered as text (``experts.10`` before ``experts.2``) would be caught."""
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA"))]
"""Where conversions run: on the device the weights are decoded to (the GPU route on CUDA)."""


def mixtral_config():
    return transformers.MixtralConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=EXPERTS,
                                      num_experts_per_tok=2, max_position_embeddings=64)


def qwen2_moe_config():
    return transformers.Qwen2MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=24,
                                       shared_expert_intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, num_experts=EXPERTS, num_experts_per_tok=2,
                                       max_position_embeddings=64)


def stored_names(folder: Path) -> set[str]:
    return set(checkpoint_entries(next(folder.glob("*.szt.index.json"), None) or folder / "model.szt"))


def safetensors_names(folder: Path) -> set[str]:
    from safetensors import safe_open

    names = set()
    for file in folder.glob("*.safetensors"):
        with safe_open(file, framework="pt") as f:
            names |= set(f.keys())
    return names


def assert_same_outputs(model, expected, inputs: torch.Tensor) -> None:
    with torch.no_grad():
        got, want = model(inputs), expected(inputs)
    key = "logits" if "logits" in want else "last_hidden_state"
    assert torch.equal(bits(got[key]), bits(want[key]))


@pytest.fixture(scope="module")
def mixtral(tmp_path_factory):
    """A Mixtral causal LM as its Hub checkpoints store it: ``block_sparse_moe.experts.N.w1/w2/w3``, in shards."""
    torch.manual_seed(10)
    folder = tmp_path_factory.mktemp("mixtral") / "mixtral"
    converted = save_and_convert(transformers.MixtralForCausalLM(mixtral_config()), folder, max_shard_size="60KB")
    shards = json.loads((converted / "model.szt.index.json").read_text())["weight_map"]
    assert len({file for name, file in shards.items() if ".layers.0.block_sparse_moe.experts." in name}) > 1
    names = stored_names(converted)
    assert f"model.layers.1.block_sparse_moe.experts.{EXPERTS - 1}.w3.weight" in names
    assert not any("gate_up_proj" in name for name in names)
    return folder, converted


@pytest.fixture(scope="module")
def qwen2_moe(tmp_path_factory):
    """A Qwen2-MoE causal LM with a shared expert, stored with ``mlp.experts.N.gate_proj/up_proj/down_proj``."""
    torch.manual_seed(11)
    folder = tmp_path_factory.mktemp("qwen2moe") / "qwen2moe"
    converted = save_and_convert(transformers.Qwen2MoeForCausalLM(qwen2_moe_config()), folder)
    assert "model.layers.0.mlp.experts.3.gate_proj.weight" in stored_names(converted)
    return folder, converted


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fixture", ["mixtral", "qwen2_moe"])
def test_per_expert_checkpoints_load_bit_identical_to_transformers(fixture, device, request):
    original, converted = request.getfixturevalue(fixture)
    expected = reference(transformers.AutoModelForCausalLM, original, device_map=device)
    model, info = szt.from_pretrained(converted, device=device, output_loading_info=True)
    assert_same_model(model, expected)
    assert info == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": [], "error_msgs": []}
    ids = torch.randint(0, 96, (2, 13), generator=torch.Generator().manual_seed(12)).to(device)
    assert_same_outputs(model, expected, ids)
    if CONVERTS:
        experts = model.model.layers[1].mlp.experts
        assert experts.gate_up_proj.shape[0] == EXPERTS and experts.down_proj.shape[0] == EXPERTS


def test_experts_cast_to_the_dtype_asked_for_as_transformers_casts_them(mixtral):
    original, converted = mixtral
    assert_same_model(szt.from_pretrained(converted, dtype=torch.float32),
                      reference(transformers.AutoModelForCausalLM, original, dtype=torch.float32))


@pytest.mark.skipif(not CONVERTS, reason="transformers 4 holds experts as stored")
def test_a_converted_model_saves_back_in_the_checkpoints_naming(mixtral, tmp_path):
    original, converted = mixtral
    szt.from_pretrained(converted).save_pretrained(tmp_path / "again")
    assert safetensors_names(tmp_path / "again") == safetensors_names(original)


@pytest.mark.skipif(not CONVERTS, reason="transformers 4 holds experts as stored")
def test_the_fused_tensor_is_the_one_copy_and_each_expert_is_dropped_once_copied(mixtral, monkeypatch):
    prepared = szt.prepare_model(mixtral[1])
    conversion = next(c for c in prepared.plan.conversions if "layers.0" in c.layer_name and "gate_up" in c.layer_name)
    decoded = szformat.load_file(prepared.checkpoint)
    tensors = {name: decoded.pop(name) for name in conversion.entries}
    decoded.clear()
    expected = torch.cat([torch.stack([tensors[f"model.layers.0.block_sparse_moe.experts.{e}.{w}.weight"]
                                       for e in range(EXPERTS)]) for w in ("w1", "w3")], dim=1)
    alive = [weakref.ref(tensor) for tensor in tensors.values()]
    seen = []
    original_copy = torch.Tensor.copy_

    def counting(destination, source, *args, **kwargs):
        seen.append(sum(ref() is not None for ref in alive))
        return original_copy(destination, source, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "copy_", counting)
    monkeypatch.setattr(torch, "stack", lambda *a, **k: pytest.fail("stacked a copy"))
    monkeypatch.setattr(torch, "cat", lambda *a, **k: pytest.fail("concatenated a copy"))
    (name, fused), = conversion.apply(tensors).items()
    monkeypatch.undo()
    assert name == "model.layers.0.mlp.experts.gate_up_proj" and tensors == {}
    assert seen == list(range(2 * EXPERTS, 0, -1))  # one copy per expert tensor, each freed before the next
    assert all(ref() is None for ref in alive)
    assert torch.equal(bits(fused), bits(expected))
    assert fused.untyped_storage().nbytes() == fused.numel() * fused.element_size()


@pytest.mark.skipif(not CONVERTS, reason="transformers 4 has no weight converters")
@pytest.mark.parametrize("operations, shapes", [
    (("merge", 0), [(6, 4)]),  # a down_proj
    (("merge", 0, "cat", 1), [(6, 4), (5, 4)]),  # a gate_up_proj
    (("merge", 1, "cat", 1), [(6, 4), (6, 4)]),
    (("merge", -1, "cat", 0), [(6, 4), (5, 4)]),
    (("cat", 0), [(6, 4), (3, 4)]),  # one tensor a pattern
    (("cat", -1), [(4, 6), (4, 3)]),
])
def test_fusing_in_place_gives_what_transformers_operations_give(operations, shapes, monkeypatch):
    from transformers.core_model_loading import Concatenate, MergeModulelist, WeightConverter

    from szformat.integrations.transformers_conversions import WeightConversion

    kinds = {"merge": MergeModulelist, "cat": Concatenate}
    ops = [kinds[kind](dim=dim) for kind, dim in zip(operations[::2], operations[1::2])]
    count = EXPERTS if operations[0] == "merge" else 1
    generator = torch.Generator().manual_seed(22)
    tensors = {f"m.experts.{e}.w{i}.weight": torch.randn(shape, generator=generator).to(torch.bfloat16)
               for i, shape in enumerate(shapes) for e in range(count)}
    sources = {f"experts.*.w{i}.weight": [f"m.experts.{e}.w{i}.weight" for e in range(count)]
               for i in range(len(shapes))}

    def conversion() -> WeightConversion:
        converter = WeightConverter(list(sources), "experts.fused", operations=copy.deepcopy(ops))
        model = types.SimpleNamespace(config=None)  # what the stack and concatenation never read
        made = WeightConversion(converter, "m.experts.fused", sources, torch.float32, model)
        made.find_targets(tensors)
        return made

    want = conversion()._convert({pattern: [tensors[name].float() for name in names]
                                  for pattern, names in sources.items()})
    fusing = conversion()
    monkeypatch.setattr(torch, "stack", lambda *a, **k: pytest.fail("stacked a copy"))
    monkeypatch.setattr(torch, "cat", lambda *a, **k: pytest.fail("concatenated a copy"))
    got = fusing.apply(dict(tensors))
    assert list(got) == list(want) == ["m.experts.fused"]
    assert got["m.experts.fused"].dtype == torch.float32
    assert torch.equal(got["m.experts.fused"], want["m.experts.fused"])


def test_old_vit_names_are_renamed_in_the_head_class_and_the_base_model(tmp_path):
    torch.manual_seed(13)
    config = transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48,
                                    image_size=16, patch_size=4, num_labels=5)
    converted = save_and_convert(transformers.ViTForImageClassification(config), tmp_path / "vit")
    assert "vit.encoder.layer.1.attention.attention.query.weight" in stored_names(converted)
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(14)).to(torch.bfloat16)
    head, base = transformers.AutoModelForImageClassification, transformers.AutoModel
    unused_head = ["classifier.bias", "classifier.weight"]
    for auto_class, kwargs, unexpected in ((head, {}, []), (base, {"add_pooling_layer": False}, unused_head)):
        expected = reference(auto_class, tmp_path / "vit", **kwargs)
        model, info = szt.from_pretrained(converted, auto_class, output_loading_info=True, **kwargs)
        assert_same_model(model, expected)
        assert info["missing_keys"] == [] and info["unexpected_keys"] == unexpected
        assert_same_outputs(model, expected, pixels)


@pytest.mark.parametrize("device", DEVICES)
def test_a_fused_projection_is_split_as_transformers_splits_it(tmp_path, device):
    """Dinov2's SwiGLU ``weights_in`` becomes ``gate_proj`` and ``up_proj``: transformers' own operation runs."""
    torch.manual_seed(15)
    config = transformers.Dinov2Config(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, image_size=16,
                                       patch_size=4, use_swiglu_ffn=True)
    converted = save_and_convert(transformers.Dinov2Model(config), tmp_path / "dinov2")
    assert "encoder.layer.0.mlp.weights_in.weight" in stored_names(converted)
    expected = reference(transformers.AutoModel, tmp_path / "dinov2", device_map=device)
    model, info = szt.from_pretrained(converted, device=device, output_loading_info=True)
    assert_same_model(model, expected)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []
    pixels = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(16)).to(device, torch.bfloat16)
    assert_same_outputs(model, expected, pixels)


def test_a_vision_language_checkpoint_in_its_earlier_layout_loads_bit_identical(tmp_path):
    """Llava's checkpoints hold ``language_model.model.*`` and ``vision_tower.*``, the model ``model.language_model.*``
    and ``model.vision_tower.*``: transformers 5's table for it, or transformers 4's
    ``_checkpoint_conversion_mapping``."""
    torch.manual_seed(20)
    vision = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                           num_attention_heads=4, image_size=16, patch_size=4, projection_dim=32)
    config = transformers.LlavaConfig(vision_config=vision, text_config=llama_config(), image_token_index=127,
                                      vision_feature_layer=-1)
    converted = save_and_convert(transformers.LlavaForConditionalGeneration(config), tmp_path / "llava")
    assert "language_model.model.layers.0.self_attn.q_proj.weight" in stored_names(converted)
    expected = reference(transformers.LlavaForConditionalGeneration, tmp_path / "llava")
    model, info = szt.from_pretrained(converted, output_loading_info=True)
    assert_same_model(model, expected)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []
    assert_same_outputs(model, expected, torch.randint(0, 120, (2, 7), generator=torch.Generator().manual_seed(21)))


@pytest.fixture(scope="module")
def legacy_bert(tmp_path_factory):
    """A BERT checkpoint with TensorFlow's names for LayerNorm tensors (``gamma``, ``beta``), as early ports have."""
    from safetensors.torch import load_file as load_safetensors, save_file as save_safetensors

    torch.manual_seed(17)
    folder = tmp_path_factory.mktemp("legacy") / "bert"
    model = transformers.BertModel(bert_config()).to(torch.bfloat16)
    model.save_pretrained(folder)
    weights = load_safetensors(folder / "model.safetensors")
    legacy = {name.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): tensor
              for name, tensor in weights.items()}
    assert sum(name.endswith("LayerNorm.gamma") for name in legacy) == 5
    save_safetensors(legacy, folder / "model.safetensors", metadata={"format": "pt"})
    assert szconvert([str(folder), str(folder) + "-szt", "--quiet"]) == 0
    return folder, Path(str(folder) + "-szt"), model


def test_legacy_layernorm_names_load_bit_identical_to_transformers(legacy_bert):
    original, converted, saved = legacy_bert
    expected = reference(transformers.AutoModel, original)
    assert torch.equal(bits(expected.embeddings.LayerNorm.weight), bits(saved.embeddings.LayerNorm.weight))
    model, info = szt.from_pretrained(converted, output_loading_info=True)
    assert_same_model(model, expected)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []
    ids = torch.randint(0, 96, (2, 9), generator=torch.Generator().manual_seed(18))
    assert_same_outputs(model, expected, ids)


def test_key_mapping_renames_as_in_transformers(tmp_path):
    from safetensors.torch import load_file as load_safetensors, save_file as save_safetensors

    torch.manual_seed(19)
    folder = tmp_path / "renamed"
    transformers.LlamaForCausalLM(llama_config()).to(torch.bfloat16).save_pretrained(folder)
    weights = load_safetensors(folder / "model.safetensors")
    save_safetensors({name.replace(".layers.", ".blocks."): t for name, t in weights.items()},
                     folder / "model.safetensors", metadata={"format": "pt"})
    assert szconvert([str(folder), str(tmp_path / "renamed-szt"), "--quiet"]) == 0
    key_mapping = {r"\.blocks\.": ".layers."}
    expected = reference(transformers.AutoModelForCausalLM, folder, key_mapping=key_mapping)
    model, info = szt.from_pretrained(tmp_path / "renamed-szt", key_mapping=key_mapping, output_loading_info=True)
    assert_same_model(model, expected)
    assert info["missing_keys"] == [] and info["unexpected_keys"] == []
    _, unmapped = szt.from_pretrained(tmp_path / "renamed-szt", output_loading_info=True)
    assert "model.layers.1.mlp.up_proj.weight" in unmapped["missing_keys"]
    assert "model.blocks.1.mlp.up_proj.weight" in unmapped["unexpected_keys"]


# -- what cannot be converted ------------------------------------------------------------------------------------


def rewritten(original: Path, folder: Path, change) -> Path:
    """``original``'s checkpoint with its weights passed through ``change`` (name -> tensor dict), converted."""
    from safetensors.torch import load_file as load_safetensors, save_file as save_safetensors

    folder.mkdir()
    shutil.copy(original / "config.json", folder)
    weights = {}
    for file in original.glob("*.safetensors"):
        weights |= load_safetensors(file)
    save_safetensors(change(weights), folder / "model.safetensors", metadata={"format": "pt"})
    converted = folder.with_name(folder.name + "-szt")
    assert szconvert([str(folder), str(converted), "--quiet"]) == 0
    return converted


@pytest.mark.skipif(not CONVERTS, reason="transformers 4 holds experts as stored")
def test_a_missing_expert_is_refused_before_anything_is_decoded(mixtral, tmp_path, no_decoding):
    missing = "model.layers.0.block_sparse_moe.experts.1."
    short = rewritten(mixtral[0], tmp_path / "short",
                      lambda weights: {name: t for name, t in weights.items() if not name.startswith(missing)})
    with pytest.raises(CheckpointMismatchError) as caught:
        szt.from_pretrained(short)
    message = str(caught.value)
    assert "\n" not in message and "2 shape mismatch(es)" in message
    assert f"model.layers.0.mlp.experts.gate_up_proj: checkpoint [{EXPERTS - 1}, 96, 32], model [{EXPERTS}, 96, 32]" \
        in message
    assert f"model.layers.0.mlp.experts.down_proj: checkpoint [{EXPERTS - 1}, 32, 48]" in message


@pytest.mark.skipif(not CONVERTS, reason="transformers 4 holds experts as stored")
def test_experts_that_cannot_be_stacked_are_refused_naming_the_fused_tensor(mixtral, tmp_path, no_decoding):
    odd = "model.layers.1.block_sparse_moe.experts.3.w1.weight"

    def narrower(weights):
        weights[odd] = weights[odd][:-1].clone()
        return weights

    with pytest.raises(CheckpointMismatchError) as caught:
        szt.from_pretrained(rewritten(mixtral[0], tmp_path / "odd", narrower))
    message = str(caught.value)
    assert "\n" not in message and "transformers cannot convert the" in message
    assert "model.layers.1.mlp.experts.gate_up_proj" in message and str(caught.value.path).endswith("odd-szt")


@pytest.mark.skipif(not CONVERTS, reason="transformers 4 holds experts as stored")
def test_offloading_refuses_a_tensor_transformers_converts(mixtral, monkeypatch, no_decoding):
    monkeypatch.setitem(offload_install.INSTALLERS, "accelerate", lambda installation: pytest.fail("installed"))
    env = OffloadEnvironment(cuda_available=True, versions={"accelerate": "1.15.0"})
    with pytest.raises(DecodeRouteError) as caught:
        szt.from_pretrained(mixtral[1], device="cuda:0", offload="accelerate", offload_options={"environment": env})
    message = str(caught.value)
    assert "\n" not in message and "offload route 'accelerate' cannot feed" in message
    assert "tensor 'model.layers.0.mlp.experts.gate_up_proj'" in message and "load without offload=" in message


def test_offloading_binds_a_renamed_tensor_to_its_stored_name(legacy_bert, monkeypatch):
    installed = []
    monkeypatch.setitem(offload_install.INSTALLERS, "accelerate", lambda installation: installed.append(installation))
    monkeypatch.setattr(szt, "place_buffers", lambda model, device, skip: None)  # no CUDA device in CI
    env = OffloadEnvironment(cuda_available=True, versions={"accelerate": "1.15.0"})
    szt.from_pretrained(legacy_bert[1], device="cuda:0", offload="accelerate", offload_options={"environment": env})
    entries = {tensor.entry: tensor.names for tensor in installed[0].binding}
    assert entries["embeddings.LayerNorm.gamma"] == ("embeddings.LayerNorm.weight",)
    assert entries["encoder.layer.1.output.LayerNorm.beta"] == ("encoder.layer.1.output.LayerNorm.bias",)
