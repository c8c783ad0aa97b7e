"""The installed-engine routes of load_into_offloader on the CPU: accelerate's hooks and diffusers' group offloading
fed from a .szt file with the CPU decoder, checked bit for bit against the module loaded the ordinary way."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import szformat
from szformat.format.reader import SztFile
from szformat.offload import OffloadEnvironment, Route, bind_module
from szformat.offload.shards import Checkpoint
from szformat.offload.install import Installation

accelerate_hooks = pytest.importorskip("szformat.offload.accelerate_hooks", exc_type=ImportError)
group_offload = pytest.importorskip("szformat.offload.group_offload", exc_type=ImportError)

CPU = torch.device("cpu")


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Tiny(nn.Module):
    """Blocks in a ModuleList (what group offloading cuts), plus top-level tensors and a buffer."""

    def __init__(self, width: int = 48, vocab: int = 97):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(3))
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))
        self.register_buffer("positions", torch.arange(width), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(x * self.scale + self.positions.to(x.dtype) * 0)


@pytest.fixture(params=[None, "zstd"], ids=["in-memory", "at-rest"])
def stored(tmp_path, request):
    """A seeded model in BF16, its reference output, and its .szt file (in each form: an at-rest file is
    inflated into host memory when the checkpoint opens)."""
    torch.manual_seed(11)
    model = Tiny().to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05)
    ids = torch.randint(0, 97, (2, 7))
    with torch.no_grad():
        expected = model(ids)
    path = tmp_path / "tiny.szt"
    szformat.save_file({k: v.contiguous() for k, v in model.state_dict().items()}, path, at_rest=request.param)
    return path, ids, expected


def fresh_module() -> Tiny:
    torch.manual_seed(99)  # different values: only the checkpoint can make the output right
    return Tiny().to(torch.bfloat16)


def install(function, path, module, route: str, **options):
    checkpoint = Checkpoint(path)
    binding = bind_module(module, checkpoint.entries, path=path)
    return function(Installation(checkpoint, module, binding, Route(route, "cpu", "test"), CPU,
                                 OffloadEnvironment(), options))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


def test_the_checkpoint_is_stored_compressed(stored):
    path, _, _ = stored
    with Checkpoint(path) as checkpoint:
        assert any(e.encoding == "splitzip" for e in checkpoint.entries.values())
        assert checkpoint.stored_bytes < checkpoint.raw_bytes


def test_an_at_rest_checkpoint_is_held_in_its_in_memory_form_until_closed(tmp_path):
    tensors = {"w": (torch.randn(256, 64) * 0.02).to(torch.bfloat16), "b": torch.zeros(3),
               "f": torch.randn(64, 100) * 0.02}  # FP32: byte planes at rest (1.2)
    path, memory = tmp_path / "rest.szt", tmp_path / "memory.szt"
    szformat.save_file(tensors, path, at_rest="zstd")
    szformat.save_file(tensors, memory)
    with SztFile(path) as f:
        assert f.byte_planes
    checkpoint = Checkpoint(path)
    (held,) = checkpoint.files
    assert not held.at_rest and held.path != path and held.path.read_bytes() == memory.read_bytes()
    assert checkpoint.entries["w"].at_rest is None and checkpoint.entries["f"].at_rest is None
    checkpoint.close()
    assert not held.path.exists()


def test_accelerate_hooks_compute_the_reference_output_from_the_checkpoint(stored):
    path, ids, expected = stored
    module = fresh_module()
    offloaded = install(accelerate_hooks.install_accelerate_hooks, path, module, "accelerate")
    with torch.no_grad():
        first, second = module(ids), module(ids)
    assert same_bits(first, expected) and same_bits(second, expected)
    # between forwards the parameters are back on meta: no weight lives outside the file
    assert all(p.device.type == "meta" for p in module.parameters())
    assert offloaded.counters() == {"h2d_bytes": 0}  # CPU decoding copies nothing to a device
    offloaded.close()


def test_accelerate_weights_map_decodes_each_lookup_and_serves_module_own_tensors(stored):
    path, _, _ = stored
    with Checkpoint(path) as checkpoint:
        from szformat.offload.decoding import CheckpointDecoder

        decoder = CheckpointDecoder(checkpoint, CPU, "cpu")
        own = {"extra": torch.ones(2)}
        weights = accelerate_hooks.SztWeightsMap({"head.weight": "embed.weight"}, decoder, own)
        assert set(weights) == {"head.weight", "extra"} and len(weights) == 2
        reference = szformat.load_file(path)["embed.weight"]
        assert same_bits(weights["head.weight"], reference)
        assert weights["head.weight"].data_ptr() != weights["head.weight"].data_ptr()  # decoded anew each time
        assert weights["extra"] is own["extra"]
        with pytest.raises(KeyError):
            weights["absent"]


def test_accelerate_refuses_engine_options(stored):
    path, _, _ = stored
    with pytest.raises(ValueError, match="takes no engine options, got num_blocks_per_group"):
        install(accelerate_hooks.install_accelerate_hooks, path, fresh_module(), "accelerate", num_blocks_per_group=2)


@pytest.mark.parametrize("offload_type", ["block_level", "leaf_level"])
def test_group_offloading_computes_the_reference_output_from_the_checkpoint(stored, offload_type):
    path, ids, expected = stored
    module = fresh_module()
    offloaded = install(group_offload.install_group_offloading, path, module, "diffusers_group",
                        offload_type=offload_type)
    with torch.no_grad():
        first, second = module(ids), module(ids)
    assert same_bits(first, expected) and same_bits(second, expected)
    offloaded.close()


def test_group_offloading_returns_weights_to_placeholders_between_forwards(stored):
    path, ids, _ = stored
    module = fresh_module()
    offloaded = install(group_offload.install_group_offloading, path, module, "diffusers_group")
    loads = []
    groups = group_offload._groups(module)
    assert len(groups) == 4  # three blocks and the top-level tensors
    for group in groups:
        original = group.onload_
        group.onload_ = lambda original=original: (loads.append(1), original())[1]
    with torch.no_grad():
        module(ids)
    assert len(loads) == 4
    weight = module.blocks[1].up.weight
    # offloaded: the CPU view of an untouched page, no value from the file or the fresh init
    assert weight.device.type == "cpu" and not weight.detach().abs().sum()
    assert module.embed.weight is module.head.weight  # still tied
    offloaded.close()
    assert not any(hasattr(m, "_diffusers_hook") and m._diffusers_hook.hooks for m in module.modules())


def test_group_offloading_names_unknown_options(stored):
    path, _, _ = stored
    with pytest.raises(ValueError, match="unknown diffusers group offloading options: bogus"):
        install(group_offload.install_group_offloading, path, fresh_module(), "diffusers_group", bogus=1)


def test_group_offloading_takes_the_options_the_installed_diffusers_has(stored, monkeypatch):
    """diffusers 0.35's ``apply_group_offloading`` has no ``block_modules``: left at its default it is not passed;
    asked for, it is refused by name before anything is installed."""
    path, _, _ = stored
    real, calls = group_offload.apply_group_offloading, []

    def without_block_modules(module, onload_device, offload_device=torch.device("cpu"), offload_type="block_level",
                              num_blocks_per_group=None, non_blocking=False, use_stream=False, record_stream=False,
                              low_cpu_mem_usage=False, offload_to_disk_path=None):
        calls.append(offload_type)
        return real(module, onload_device, offload_device, offload_type=offload_type,
                    num_blocks_per_group=num_blocks_per_group, use_stream=use_stream, record_stream=record_stream,
                    low_cpu_mem_usage=low_cpu_mem_usage)

    monkeypatch.setattr(group_offload, "apply_group_offloading", without_block_modules)
    install(group_offload.install_group_offloading, path, fresh_module(), "diffusers_group").close()
    assert calls == ["block_level"]
    with pytest.raises(ValueError, match=r"group offloading has no option 'block_modules': a newer diffusers has"):
        install(group_offload.install_group_offloading, path, fresh_module(), "diffusers_group",
                block_modules=["blocks"])
    assert calls == ["block_level"]


def test_a_failed_install_gives_the_module_its_tensors_back(stored, monkeypatch):
    path, ids, _ = stored
    module = fresh_module()
    with torch.no_grad():
        before = module(ids)

    def fail(*args, **kwargs):
        raise RuntimeError("engine refused")

    monkeypatch.setattr(group_offload, "apply_group_offloading", fail)
    with pytest.raises(RuntimeError, match="engine refused"):
        install(group_offload.install_group_offloading, path, module, "diffusers_group")
    with torch.no_grad():
        assert same_bits(module(ids), before)


def test_load_into_offloader_routes_to_the_installer_and_returns_its_handle(stored, monkeypatch):
    """The public entry point binds, selects and hands everything to the route's installer."""
    path, _, _ = stored
    seen = {}

    def fake_installer(installation):
        seen["installation"] = installation
        return "handle"

    monkeypatch.setitem(szformat.offload.install.INSTALLERS, "accelerate", fake_installer)
    env = OffloadEnvironment(cuda_available=True, versions={"accelerate": "1.15.0"})
    result = szformat.load_into_offloader(path, fresh_module(), route="accelerate", environment=env, device="cuda:0")
    installation = seen["installation"]
    assert result == "handle"
    assert installation.route.name == "accelerate" and installation.route.decoder == "cpu"
    assert installation.device == torch.device("cuda:0") and installation.options == {}
    assert {name for b in installation.binding for name in b.names} == set(installation.checkpoint.entries)


def test_cpu_decoding_names_file_and_tensor_when_torch_lacks_the_dtype(tmp_path, monkeypatch):
    from szformat.errors import DecodeRouteError
    from szformat.format import constants as C
    from szformat.format.reader import SztFile
    from szformat.offload.decoding import decode_on_cpu

    path = tmp_path / "m.szt"
    szformat.save_file({"w": torch.randn(64, 64).to(torch.bfloat16)}, path)
    monkeypatch.setitem(C.DTYPES, "BF16", (None, 2))
    with SztFile(path) as f, pytest.raises(DecodeRouteError, match="dtype BF16 has no torch equivalent") as info:
        decode_on_cpu(f, f.entry("w"))
    assert info.value.tensor == "w" and "m.szt" in str(info.value)
