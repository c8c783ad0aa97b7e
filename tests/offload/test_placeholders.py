"""What the offload routes stand on, on the CPU: placeholders that hold no memory, checkpoints opened whole (sharded
indexes included), and whole-tensor decoding from the file, bit for bit."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

import szformat
from szformat.errors import PayloadError, ShardIndexError
from szformat.format.constants import TORCH_TO_DTYPE
from szformat.offload import bind_module
from szformat.offload.binding import module_tensor, snapshot_tensors
from szformat.offload.shards import Checkpoint
from szformat.offload.decoding import CheckpointDecoder
from szformat.offload.placeholders import PLACEHOLDER_ALIGNMENT, Placeholders


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


@dataclass(frozen=True)
class Entry:
    dtype: str
    shape: tuple[int, ...]


def entries_of(module: nn.Module) -> dict[str, Entry]:
    return {name: Entry(TORCH_TO_DTYPE[t.dtype], tuple(t.shape)) for name, t in module.state_dict().items()}


class Wide(nn.Module):
    def __init__(self, rows: int, device: str = "cpu"):
        super().__init__()
        self.first = nn.Linear(4096, rows, bias=False, device=device, dtype=torch.bfloat16)
        self.second = nn.Linear(4096, rows, device=device, dtype=torch.bfloat16)
        self.tied = self.first  # one submodule under two names
        self.register_buffer("steps", torch.zeros(3, dtype=torch.int64, device=device))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_gib_of_placeholders_costs_no_resident_memory():
    module = Wide(65536, device="meta")  # 2 x 512 MiB of BF16 weights
    entries = entries_of(module)
    binding = bind_module(module, entries)
    before = rss_bytes()
    placeholders = Placeholders(binding)
    placeholders.install(module, binding)
    assert float(module.second.weight.detach()[-1].float().sum()) == 0.0  # reading maps the zero page
    assert rss_bytes() - before < 64 << 20
    assert placeholders.size >= 1 << 30
    placeholders.close()


def test_placeholders_replace_meta_tensors_keep_ties_and_sit_on_their_own_pages():
    module = Wide(8, device="meta")
    entries = entries_of(module)
    binding = bind_module(module, entries)
    placeholders = Placeholders(binding)
    placeholders.install(module, binding)
    assert module.first.weight is module.tied.weight and isinstance(module.first.weight, nn.Parameter)
    assert module.first.weight.device.type == "cpu" and module.first.weight.dtype == torch.bfloat16
    assert module.steps.dtype == torch.int64 and tuple(module.steps.shape) == (3,)
    pointers = sorted(placeholders.views[b.entry].data_ptr() for b in binding)
    assert len(pointers) == 4 and all((b - a) % PLACEHOLDER_ALIGNMENT == 0 for a, b in zip(pointers, pointers[1:]))
    assert all(placeholders.contains(module_tensor(module, b.names[0])) for b in binding)


def test_materialized_tensors_keep_their_identity_and_a_snapshot_restores_them():
    module = Wide(8)
    weight = module.second.weight
    original = weight.detach().clone()
    entries = entries_of(module)
    binding = bind_module(module, entries)
    restore = snapshot_tensors(module, [name for b in binding for name in b.names])
    placeholders = Placeholders(binding)
    placeholders.install(module, binding)
    assert module.second.weight is weight and placeholders.contains(weight) and not weight.detach().any()
    restore()
    assert module.second.weight is weight and torch.equal(weight.detach(), original)


@pytest.fixture()
def sharded(tmp_path):
    torch.manual_seed(5)
    first = {"a.weight": torch.randn(40, 24).to(torch.bfloat16), "a.bias": torch.randn(40).to(torch.bfloat16)}
    second = {"b.weight": torch.randn(7, 13).to(torch.bfloat16), "b.steps": torch.arange(5)}
    szformat.save_file(first, tmp_path / "model-00001-of-00002.szt")
    szformat.save_file(second, tmp_path / "model-00002-of-00002.szt")
    weight_map = {**{k: "model-00001-of-00002.szt" for k in first}, **{k: "model-00002-of-00002.szt" for k in second}}
    (tmp_path / "model.szt.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tmp_path, {**first, **second}


def test_a_sharded_checkpoint_opens_whole_from_its_index_or_its_folder(sharded):
    folder, tensors = sharded
    for path in (folder / "model.szt.index.json", folder):
        with Checkpoint(path) as checkpoint:
            assert set(checkpoint.entries) == set(tensors) and len(checkpoint.files) == 2
            assert checkpoint.file("b.steps").path.name == "model-00002-of-00002.szt"
            assert checkpoint.raw_bytes == sum(t.numel() * t.element_size() for t in tensors.values())
            with pytest.raises(KeyError, match="'absent' is not in"):
                checkpoint.file("absent")


def test_an_index_that_points_a_tensor_to_the_wrong_shard_is_refused(sharded):
    folder, _ = sharded
    index = folder / "model.szt.index.json"
    content = json.loads(index.read_text())
    content["weight_map"]["b.weight"] = "model-00001-of-00002.szt"
    index.write_text(json.dumps(content))
    with pytest.raises(ShardIndexError, match="maps this tensor to shard 'model-00001-of-00002.szt', which does not "
                                              "hold it") as caught:
        Checkpoint(index)
    assert "b.weight" in str(caught.value) and "model-00001-of-00002.szt" in str(caught.value)


def test_a_checkpoint_with_an_escape_stream_out_of_order_is_refused_when_opened(tmp_path):
    """The device routes' kernels check no escape stream, so the checkpoint is checked once, when it opens."""
    vectors = Path(__file__).resolve().parents[2] / "spec" / "vectors"
    with Checkpoint(vectors / "alignment_64.szt") as checkpoint:  # tensor a has two escapes
        assert checkpoint.entries["a"].layout.n_esc == 2
    with pytest.raises(PayloadError, match="not strictly ascending") as caught:
        Checkpoint(vectors / "refuse_escape_order.szt")
    assert caught.value.tensor == "a"


def test_cpu_decoding_gives_every_tensor_bit_for_bit(sharded):
    folder, tensors = sharded
    with Checkpoint(folder) as checkpoint:
        decoder = CheckpointDecoder(checkpoint, torch.device("cpu"), "cpu")
        loaded = decoder.load(tensors)
    assert set(loaded) == set(tensors)
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape
        assert torch.equal(loaded[name].view(-1).view(torch.uint8), tensor.view(-1).view(torch.uint8)), name
    assert decoder.bytes_moved == 0
