"""szformat.diffusers.from_pretrained against diffusers' own from_pretrained of the safetensors original.

A tiny Stable-Diffusion-shaped pipeline (UNet, VAE, CLIP text encoder, a tokenizer written here, a scheduler), saved
with save_pretrained in BF16 and converted with szconvert: every component's parameters and buffers bit-identical to
diffusers' load, and a 2-step pipeline call giving the same image tensor. Also through the loopback Hub.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():  # transformers and diffusers import Triton: in interpreter mode from the first import
    os.environ.setdefault("TRITON_INTERPRET", "1")

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")

import szformat
import szformat.api
import szformat.integrations.diffusers as szd
import szformat.integrations.transformers as szt
from szformat.cli.main import main as szconvert
from szformat.errors import CheckpointMismatchError, ModelFolderError, UnknownArchitectureError
from szformat.integrations.model_folder import load_weights
from szformat.offload import OffloadEnvironment
from szformat.offload import install as offload_install
from support import ALICE, assert_same_model, bits, card_of


def tiny_tokenizer(folder: Path) -> "transformers.CLIPTokenizer":
    """A CLIP tokenizer over single letters (no merges): enough for a prompt, built without a download."""
    folder.mkdir(parents=True)
    vocab = {"<|startoftext|>": 0, "!": 1, "<|endoftext|>": 2}
    for i, letter in enumerate("abcdefghijklmnopqrstuvwxyz"):
        vocab[letter], vocab[letter + "</w>"] = 3 + 2 * i, 4 + 2 * i
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return transformers.CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=16)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """The original pipeline folder and its szconvert twin."""
    root = tmp_path_factory.mktemp("pipe")
    torch.manual_seed(0)
    unet = diffusers.UNet2DConditionModel(
        block_out_channels=(4, 8), layers_per_block=1, sample_size=8, in_channels=4, out_channels=4,
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"), up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
        cross_attention_dim=32, norm_num_groups=2)
    vae = diffusers.AutoencoderKL(block_out_channels=[4, 8], in_channels=3, out_channels=3, latent_channels=4,
                                  down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                                  norm_num_groups=2)
    text_encoder = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        bos_token_id=0, eos_token_id=2, pad_token_id=1, hidden_size=32, intermediate_size=37, num_attention_heads=4,
        num_hidden_layers=2, vocab_size=56))
    pipe = diffusers.StableDiffusionPipeline(
        unet=unet, vae=vae, text_encoder=text_encoder, tokenizer=tiny_tokenizer(root / "tok"),
        scheduler=diffusers.DDIMScheduler(), safety_checker=None, feature_extractor=None,
        requires_safety_checker=False)
    for model in (unet, vae, text_encoder):
        model.to(torch.bfloat16)
    pipe.save_pretrained(root / "sd")
    assert szconvert([str(root / "sd"), str(root / "sd-szt"), "--quiet"]) == 0
    return root / "sd", root / "sd-szt"


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    """An SD3-shaped pipeline: a DiT whose positional table is a floating persistent buffer, two CLIP encoders with
    projection, no T5 (the pipeline pads its place with zeros)."""
    root = tmp_path_factory.mktemp("sd3")
    torch.manual_seed(2)
    transformer = diffusers.SD3Transformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=1, attention_head_dim=8,
        num_attention_heads=2, joint_attention_dim=64, caption_projection_dim=16, pooled_projection_dim=64,
        pos_embed_max_size=16)
    vae = diffusers.AutoencoderKL(block_out_channels=[4, 8], in_channels=3, out_channels=3, latent_channels=4,
                                  down_block_types=["DownEncoderBlock2D"] * 2, up_block_types=["UpDecoderBlock2D"] * 2,
                                  norm_num_groups=2, use_quant_conv=False, use_post_quant_conv=False,
                                  scaling_factor=1.5305, shift_factor=0.0609)
    clip = lambda: transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(  # noqa: E731
        bos_token_id=0, eos_token_id=2, pad_token_id=1, hidden_size=32, intermediate_size=37, projection_dim=32,
        num_attention_heads=4, num_hidden_layers=1, vocab_size=56))
    tokenizer = tiny_tokenizer(root / "tok")
    pipe = diffusers.StableDiffusion3Pipeline(
        transformer=transformer, vae=vae, text_encoder=clip(), text_encoder_2=clip(), tokenizer=tokenizer,
        tokenizer_2=tokenizer, text_encoder_3=None, tokenizer_3=None,
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler())
    for model in (transformer, vae, pipe.text_encoder, pipe.text_encoder_2):
        model.to(torch.bfloat16)
    pipe.save_pretrained(root / "sd3")
    assert szconvert([str(root / "sd3"), str(root / "sd3-szt"), "--quiet"]) == 0
    return root / "sd3", root / "sd3-szt"


SD3_OPTIONS = dict(text_encoder_3=None, tokenizer_3=None)  # saved as [null, null]: diffusers wants them named


def image(pipe) -> torch.Tensor:
    extra = dict(guidance_scale=1.0, max_sequence_length=8) if isinstance(
        pipe, diffusers.StableDiffusion3Pipeline) else {}
    return pipe("a cat", num_inference_steps=2, height=16, width=16, output_type="pt",
                generator=torch.Generator().manual_seed(0), **extra).images


def assert_same_pipeline(actual, expected) -> None:
    assert type(actual) is type(expected)
    for name, component in expected.components.items():
        if isinstance(component, torch.nn.Module):
            assert_same_model(getattr(actual, name), component)
    assert actual.scheduler.config == expected.scheduler.config
    assert actual.tokenizer("a cat").input_ids == expected.tokenizer("a cat").input_ids


def test_the_converted_folder_keeps_configs_tokenizer_scheduler_and_no_original_weights(pipeline):
    def listing(folder):
        return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())

    original = listing(pipeline[0])  # the tokenizer's files are what the installed transformers saves
    assert [name for name in original if name.startswith("tokenizer/")]
    assert listing(pipeline[1]) == sorted(name.replace(".safetensors", ".szt") for name in original)
    assert {"text_encoder/model.szt", "unet/diffusion_pytorch_model.szt", "vae/diffusion_pytorch_model.szt",
            "scheduler/scheduler_config.json", "model_index.json"} <= set(listing(pipeline[1]))


@pytest.mark.parametrize("which", ["pipeline", "sd3"])
def test_pipeline_is_bit_identical_and_gives_the_same_image(which, request):
    original, converted = request.getfixturevalue(which)
    options = SD3_OPTIONS if which == "sd3" else {}
    expected = diffusers.DiffusionPipeline.from_pretrained(original, torch_dtype=torch.bfloat16, **options)
    pipe = szd.from_pretrained(converted, torch_dtype=torch.bfloat16, **options)
    assert_same_pipeline(pipe, expected)
    models = [model for model in pipe.components.values() if isinstance(model, torch.nn.Module)]
    assert models and all(model.dtype == torch.bfloat16 for model in models)
    assert torch.equal(bits(image(pipe)), bits(image(expected)))


def test_without_torch_dtype_the_dtypes_are_diffusers_own(pipeline):
    """diffusers builds its models in float32 when no dtype is asked for; transformers keeps the config's (5) or
    builds in float32 too (4)."""
    expected = diffusers.DiffusionPipeline.from_pretrained(pipeline[0])
    pipe = szd.from_pretrained(pipeline[1], diffusers.StableDiffusionPipeline)
    assert_same_pipeline(pipe, expected)
    text_dtype = torch.bfloat16 if int(transformers.__version__.split(".")[0]) >= 5 else torch.float32
    assert (pipe.unet.dtype, pipe.vae.dtype, pipe.text_encoder.dtype) == (torch.float32, torch.float32, text_dtype)


def test_loads_from_the_hub(hub, pipeline):  # noqa: F811
    original, converted = pipeline
    szformat.push_to_hub(converted, "alice/tiny-sd", token=ALICE)
    expected = diffusers.DiffusionPipeline.from_pretrained(original, torch_dtype=torch.bfloat16)
    assert_same_pipeline(szd.from_pretrained("hf://alice/tiny-sd", torch_dtype=torch.bfloat16), expected)
    card = card_of(hub, "alice/tiny-sd").text
    assert ('szformat.diffusers.from_pretrained("hf://alice/tiny-sd", device="cuda", torch_dtype=torch.bfloat16)'
            in card)


@pytest.mark.parametrize("which", ["pipeline", "sd3"])
def test_offload_puts_the_denoiser_behind_the_route_and_loads_the_rest(which, request, monkeypatch):
    """The SD3 DiT computes its positional table (a persistent buffer) in float32: it is bound in the dtype it is
    stored in, as diffusers loads it."""
    pipeline = request.getfixturevalue(which)
    installed = []

    def install(installation):
        installed.append(installation)
        return "handle"

    monkeypatch.setitem(offload_install.INSTALLERS, "accelerate", install)
    loaded: list[str] = []

    def load_on_the_cpu(model, checkpoint, plan, expected, *, device, verify, staging, loading):
        loaded.append(checkpoint.parent.name)
        load_weights(model, checkpoint, plan, expected, device=torch.device("cpu"), verify=verify, staging=staging)

    for module in (szd, szt):  # no CUDA device in CI: the components that are not offloaded load to the CPU
        monkeypatch.setattr(module, "place_buffers", lambda model, device, skip=frozenset(): None)
        monkeypatch.setattr(module, "load_weights", load_on_the_cpu)
    monkeypatch.setattr(szd, "prefetching", lambda device, **kwargs: contextlib.nullcontext())
    env = OffloadEnvironment(cuda_available=True, versions={"accelerate": "1.15.0"})
    options = SD3_OPTIONS if which == "sd3" else {}
    pipe = szd.from_pretrained(pipeline[1], device="cuda:0", offload="accelerate", torch_dtype=torch.bfloat16,
                               offload_options={"environment": env}, **options)
    denoiser = "transformer" if which == "sd3" else "unet"
    assert [i.module for i in installed] == [getattr(pipe, denoiser)] and pipe.szformat_offload == {denoiser: "handle"}
    assert len(installed[0].binding) == len(getattr(pipe, denoiser).state_dict())
    assert {t.dtype for t in getattr(pipe, denoiser).state_dict().values()} == {torch.bfloat16}
    assert sorted(loaded) == (["text_encoder", "text_encoder_2", "vae"] if which == "sd3" else ["text_encoder", "vae"])


def test_prefetched_components_load_beside_the_builds_and_are_bit_identical(sd3,
                                                                            prefetch_on_the_cpu):
    original, converted = sd3
    pipe = szd.from_pretrained(converted, torch_dtype=torch.bfloat16, **SD3_OPTIONS)
    assert len(prefetch_on_the_cpu) == 4 and all(t.startswith("szformat-prefetch") for t, _ in prefetch_on_the_cpu)
    assert_same_pipeline(pipe, diffusers.DiffusionPipeline.from_pretrained(original, torch_dtype=torch.bfloat16,
                                                                           **SD3_OPTIONS))


# -- bad input ---------------------------------------------------------------------------------------------------


@pytest.fixture
def copy(pipeline, tmp_path):
    shutil.copytree(pipeline[1], tmp_path / "p")
    return tmp_path / "p"


def test_a_missing_component_is_refused_before_anything_is_decoded(copy, no_decoding):
    shutil.rmtree(copy / "vae")
    with pytest.raises(ModelFolderError, match=r"component 'vae' \(AutoencoderKL\) .* has no folder vae/"):
        szd.from_pretrained(copy)


def test_a_safetensors_pipeline_is_pointed_to_szconvert(pipeline, no_decoding):
    with pytest.raises(ModelFolderError, match="text_encoder, unet, vae hold safetensors weights.*szconvert"):
        szd.from_pretrained(pipeline[0])


def test_a_folder_without_model_index_is_refused(copy, no_decoding):
    with pytest.raises(ModelFolderError, match="single model folder, not a pipeline"):
        szd.from_pretrained(copy / "unet")
    (copy / "model_index.json").unlink()
    with pytest.raises(ModelFolderError, match="no model_index.json"):
        szd.from_pretrained(copy)


def test_an_unknown_component_class_is_refused(copy, no_decoding):
    index = json.loads((copy / "model_index.json").read_text())
    index["unet"] = ["diffusers", "NoSuchModel"]
    (copy / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(UnknownArchitectureError, match="NoSuchModel"):
        szd.from_pretrained(copy)


def test_a_component_that_does_not_fit_its_config_is_refused_with_every_name(copy, no_decoding):
    config = json.loads((copy / "unet" / "config.json").read_text())
    (copy / "unet" / "config.json").write_text(json.dumps({**config, "cross_attention_dim": 24}))
    with pytest.raises(CheckpointMismatchError) as caught:
        szd.from_pretrained(copy)
    message = str(caught.value)
    assert "\n" not in message and "UNet2DConditionModel" in message and "shape mismatch" in message
    for projection in ("to_k", "to_v"):
        for block in ("down_blocks.1.attentions.0", "up_blocks.0.attentions.0"):
            assert f"{block}.transformer_blocks.0.attn2.{projection}.weight: checkpoint [8, 32], model [8, 24]" \
                in message, (block, projection)


def test_a_component_refused_after_others_started_loading_releases_their_loads(copy,
                                                                              prefetch_on_the_cpu):
    """Components are checked in order while their loads run: the loads started before the refusal are waited for
    and dropped, and the refused component's own load too."""
    config = json.loads((copy / "vae" / "config.json").read_text())
    (copy / "vae" / "config.json").write_text(json.dumps({**config, "latent_channels": 3}))
    with pytest.raises(CheckpointMismatchError, match="AutoencoderKL"):
        szd.from_pretrained(copy)
    assert prefetch_on_the_cpu and all(tensors == {} for _, tensors in prefetch_on_the_cpu)


def test_offload_components_need_a_route_and_components_with_weights(pipeline, no_decoding):
    with pytest.raises(ValueError, match=r"offload_components= needs offload="):
        szd.from_pretrained(pipeline[1], offload_components=["unet"])
    with pytest.raises(ValueError, match="offload_components names"):
        szd.from_pretrained(pipeline[1], offload="accelerate", offload_components=["scheduler"])


def test_a_pipeline_without_weights_or_a_component_config_is_refused(copy, no_decoding):
    (copy / "vae" / "config.json").unlink()
    with pytest.raises(ModelFolderError, match="no config.json in the component folder"):
        szd.from_pretrained(copy)
    index = json.loads((copy / "model_index.json").read_text())
    (copy / "model_index.json").write_text(json.dumps({k: v for k, v in index.items()
                                                       if k not in ("unet", "vae", "text_encoder")}))
    with pytest.raises(ModelFolderError, match="no component holds .szt weights"):
        szd.from_pretrained(copy)


@pytest.mark.parametrize("which", ["pipeline", "sd3"])
def test_offload_resident_gives_the_same_image_on_the_cpu(which, request):
    """The denoiser kept compressed and expanded block by block (the CPU decoder here): a 2-step image equal to the
    plain pipeline's, bit for bit."""
    original, converted = request.getfixturevalue(which)
    options = SD3_OPTIONS if which == "sd3" else {}
    expected = diffusers.DiffusionPipeline.from_pretrained(original, torch_dtype=torch.bfloat16, **options)
    pipe = szd.from_pretrained(converted, device="cpu", offload="resident", torch_dtype=torch.bfloat16,
                               offload_options={"min_tensor_bytes": 0, "min_leaf_bytes": 0}, **options)
    denoiser = "transformer" if which == "sd3" else "unet"
    handle = pipe.szformat_offload[denoiser]
    with handle, torch.no_grad():
        assert handle.route.name == "resident" and handle.counters()["resident_stored_bytes"] > 0
        assert torch.equal(image(pipe), image(expected))
