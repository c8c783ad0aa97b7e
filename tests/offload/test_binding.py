"""Binding module tensors to checkpoint entries by name (szformat.offload.binding) and the checks
load_into_offloader makes before any byte moves."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
from torch import nn

import szformat
from szformat.errors import LISTED as LISTED_PER_PROBLEM
from szformat.errors import BindingError, DecodeRouteError, SzformatError
from szformat.format.reader import SztFile
from szformat.offload import OffloadEnvironment, bind_module, load_into_offloader


@dataclass(frozen=True)
class Entry:
    dtype: str
    shape: tuple[int, ...]
    raw_crc32: int | None = None


_NAMES = {dtype: name for name, dtype in [("BF16", torch.bfloat16), ("F32", torch.float32), ("I64", torch.int64),
                                          ("F16", torch.float16), ("U8", torch.uint8)]}


def entries_of(module: nn.Module) -> dict[str, Entry]:
    """What a checkpoint saved from ``module`` would list (state_dict keys: no non-persistent buffers)."""
    return {name: Entry(_NAMES[t.dtype], tuple(t.shape)) for name, t in module.state_dict().items()}


class Block(nn.Module):
    def __init__(self, width: int = 8):
        super().__init__()
        self.proj = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.register_buffer("scale", torch.ones(width))
        self.register_buffer("positions", torch.arange(width), persistent=False)


class TiedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def problem_line(message: str, title: str) -> str:
    line = next(line for line in message.splitlines() if line.strip().startswith(title))
    return line.split(": ", 1)[1]


def test_every_parameter_and_persistent_buffer_is_bound_to_its_own_name():
    module = nn.Sequential(Block(), Block()).to(torch.bfloat16)
    entries = entries_of(module)
    binding = bind_module(module, entries)
    assert {b.entry for b in binding} == set(entries)
    assert len(binding) == len(entries)
    for b in binding:
        assert b.names == (b.entry,)
        assert b.tensor is dict(module.named_parameters()).get(b.entry, dict(module.named_buffers()).get(b.entry))
    assert binding.entry_for("1.scale") == "1.scale"
    assert next(b for b in binding if b.entry == "0.scale").is_buffer
    assert not next(b for b in binding if b.entry == "0.proj.weight").is_buffer
    assert binding.missing == () and binding.unexpected == ()


def test_one_error_lists_missing_unexpected_shape_and_dtype_problems_with_the_file():
    module = Block().to(torch.bfloat16)
    entries = entries_of(module)
    del entries["norm.bias"]
    entries["head.weight"] = Entry("BF16", (8, 8))
    entries["proj.weight"] = Entry("BF16", (8, 4))
    entries["scale"] = Entry("F32", (8,))
    with pytest.raises(BindingError) as caught:
        bind_module(module, entries, path="/models/m.szt")
    message = str(caught.value)
    assert message.startswith("file '/models/m.szt': module does not match the checkpoint: 1 missing")
    assert problem_line(message, "missing from the checkpoint") == "norm.bias"
    assert problem_line(message, "unexpected in the checkpoint") == "head.weight"
    assert problem_line(message, "shape mismatch") == "proj.weight: module (8, 8), checkpoint (8, 4)"
    assert problem_line(message, "dtype mismatch") == "scale: module BF16, checkpoint F32"
    assert "module.to(torch.bfloat16)" in message
    assert caught.value.path == "/models/m.szt"
    assert isinstance(caught.value, KeyError) and isinstance(caught.value, SzformatError)


def test_long_lists_are_cut_with_a_count_of_the_rest():
    module = nn.ModuleList([nn.Linear(2, 2, bias=False) for _ in range(LISTED_PER_PROBLEM + 7)])
    with pytest.raises(BindingError) as caught:
        bind_module(module, {})
    listed = problem_line(str(caught.value), "missing from the checkpoint")
    names = listed.split("; ")
    assert names[:LISTED_PER_PROBLEM] == [f"{i}.weight" for i in range(LISTED_PER_PROBLEM)]
    assert names[-1] == "... and 7 more"
    assert f"{LISTED_PER_PROBLEM + 7} missing" in str(caught.value)


def test_non_strict_tolerates_missing_and_unexpected_and_reports_them():
    module = Block()
    entries = entries_of(module)
    del entries["proj.bias"]
    entries["extra"] = Entry("F32", (1,))
    binding = bind_module(module, entries, strict=False)
    assert binding.missing == ("proj.bias",)
    assert binding.unexpected == ("extra",)
    assert "proj.bias" not in {b.entry for b in binding}


def test_non_strict_still_refuses_shape_and_dtype_mismatches():
    module = Block()
    entries = entries_of(module)
    entries["norm.weight"] = Entry("F32", (9,))
    entries["proj.bias"] = Entry("BF16", (8,))
    with pytest.raises(BindingError) as caught:
        bind_module(module, entries, strict=False)
    message = str(caught.value)
    assert "norm.weight: module (8,), checkpoint (9,)" in message
    assert "proj.bias: module F32, checkpoint BF16" in message
    assert "missing" not in message and "unexpected" not in message


def test_dtype_names_this_torch_lacks_or_does_not_know_are_mismatches():
    module = nn.Linear(2, 2, bias=False)
    with pytest.raises(BindingError, match=re.escape("weight: module F32, checkpoint F4_E2M1")):
        bind_module(module, {"weight": Entry("F4_E2M1", (2, 2))})


@pytest.mark.parametrize("stored_name", ["embed.weight", "head.weight"])
def test_tied_weights_bind_once_to_whichever_name_the_checkpoint_holds(stored_name):
    module = TiedModel()
    binding = bind_module(module, {stored_name: Entry("F32", (10, 4))})
    assert len(binding) == 1
    (tied,) = binding.tensors
    assert tied.entry == stored_name
    assert tied.names == ("embed.weight", "head.weight")
    assert tied.aliases == tuple(n for n in tied.names if n != stored_name)
    assert tied.tensor is module.embed.weight
    assert binding.entry_for("head.weight") == binding.entry_for("embed.weight") == stored_name


def test_tied_weights_stored_under_both_names_must_hold_the_same_values():
    module = TiedModel()
    same = {"embed.weight": Entry("F32", (10, 4), 7), "head.weight": Entry("F32", (10, 4), 7)}
    assert bind_module(module, same).tensors[0].entry == "embed.weight"
    different = {"embed.weight": Entry("F32", (10, 4), 7), "head.weight": Entry("F32", (10, 4), 8)}
    with pytest.raises(BindingError, match="tied tensors stored with different values: embed.weight, head.weight"):
        bind_module(module, different)


def test_a_missing_tied_storage_names_its_aliases():
    with pytest.raises(BindingError) as caught:
        bind_module(TiedModel(), {})
    assert problem_line(str(caught.value), "missing") == "embed.weight (tied with head.weight)"


def test_tensors_sharing_memory_without_being_one_object_are_tied():
    module = nn.Sequential(nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False))
    module[1].weight = nn.Parameter(module[0].weight.data)  # another Parameter over the same memory
    binding = bind_module(module, {"1.weight": Entry("F32", (3, 3))})
    assert [b.names for b in binding] == [("0.weight", "1.weight")]


def test_a_submodule_registered_twice_is_one_storage_with_two_names():
    shared = nn.Linear(2, 2)
    module = nn.ModuleDict({"a": shared, "b": shared})
    binding = bind_module(module, {"a.weight": Entry("F32", (2, 2)), "a.bias": Entry("F32", (2,))})
    assert sorted(b.names for b in binding) == [("a.bias", "b.bias"), ("a.weight", "b.weight")]


def test_non_persistent_buffers_are_optional_but_bound_when_stored():
    module = Block()
    assert "positions" not in {b.entry for b in bind_module(module, entries_of(module))}
    with_positions = entries_of(module) | {"positions": Entry("I64", (8,))}
    binding = bind_module(module, with_positions)
    assert binding.entry_for("positions") == "positions"
    with pytest.raises(BindingError, match=re.escape("positions: module (8,), checkpoint (9,)")):
        bind_module(module, entries_of(module) | {"positions": Entry("I64", (9,))})


def test_meta_modules_bind_without_storage():
    with torch.device("meta"):
        module = nn.Sequential(Block(), TiedModel()).to(torch.bfloat16)
    entries = {k: v for k, v in entries_of(module).items() if k != "1.head.weight"}
    binding = bind_module(module, entries)
    assert len(binding) == len(entries)
    assert binding.entry_for("1.head.weight") == "1.embed.weight"
    with pytest.raises(BindingError, match="missing from the checkpoint: 0.norm.weight"):
        bind_module(module, {k: v for k, v in entries.items() if k != "0.norm.weight"})


def test_binding_reads_the_entries_of_a_real_szt_file(tmp_path):
    torch.manual_seed(3)
    module = nn.Sequential(Block(16), Block(16)).to(torch.bfloat16)
    path = tmp_path / "model.szt"
    szformat.save_file(module.state_dict(), path)
    with SztFile(path) as checkpoint:
        assert any(e.encoding == "splitzip" for e in checkpoint.entries.values())
        binding = bind_module(module, checkpoint.entries, path=path)
        assert {b.entry for b in binding} == set(module.state_dict())
        wider = nn.Sequential(Block(16), Block(32)).to(torch.bfloat16)
        with pytest.raises(BindingError) as caught:
            bind_module(wider, checkpoint.entries, path=path)
    assert str(path) in str(caught.value)
    assert "1.proj.weight: module (32, 32), checkpoint (16, 16)" in str(caught.value)


# -- load_into_offloader: what it checks before a route moves anything --------------------------------------------


def test_load_into_offloader_reports_binding_problems_before_choosing_a_route(tmp_path):
    path = tmp_path / "model.szt"
    szformat.save_file(Block().to(torch.bfloat16).state_dict(), path)
    with pytest.raises(BindingError, match="dtype mismatch"):
        load_into_offloader(path, Block(), environment=OffloadEnvironment())


def test_load_into_offloader_refuses_an_unavailable_route_after_binding(tmp_path):
    path = tmp_path / "model.szt"
    module = Block().to(torch.bfloat16)
    szformat.save_file(module.state_dict(), path)
    with pytest.raises(DecodeRouteError, match="offload route 'native' is unavailable: no CUDA device"):
        load_into_offloader(path, module, route="native", environment=OffloadEnvironment())


def test_load_into_offloader_needs_a_cuda_execution_device(tmp_path):
    with pytest.raises(ValueError, match=r"CUDA device \(route='resident' on the CPU too\); got device 'cpu'"):
        load_into_offloader(tmp_path / "absent.szt", Block(), device="cpu")
