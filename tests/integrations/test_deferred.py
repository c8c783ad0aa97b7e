"""Deferred checkpoint tensors (``integrations/deferred.py``): what vLLM's weight loaders do to them (narrow the
first dimension, copy into a parameter) decodes straight into the target, only the rows kept; anything else decodes
first and gets exactly the tensor; metadata never decodes; bad bytes are refused by name when they are used."""

from __future__ import annotations

import random

import pytest
import torch

import szformat
from szformat.convert import convert
from szformat.errors import ChecksumMismatchError
from szformat.format.reader import SztFile
from szformat.integrations.deferred import DecodeCounter, DeferredTensor
from szformat.loading.host_reader import HostReader

from fakes import FakeOps, ReferenceCodec
from support import write_at_rest, write_sharded


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "proj.weight": (torch.randn(96, 40, generator=g) * 0.02).to(torch.bfloat16),
        "odd.weight": (torch.randn(33, 7, generator=g) * 0.05).to(torch.bfloat16),
        "norm.weight": torch.randn(40, generator=g).to(torch.bfloat16),
        "scale": torch.tensor(0.25, dtype=torch.bfloat16),
        "f32": torch.randn(12, 5, generator=g),
        "ids": torch.arange(30, dtype=torch.int64).reshape(6, 5),
    }


@pytest.fixture(params=["in-memory", "at rest"])
def checkpoint(request, tmp_path):
    tensors = _tensors(random.randrange(1 << 30))
    path = tmp_path / "model.szt"
    if request.param == "at rest":
        write_at_rest(tensors, path)
    else:
        szformat.save_file(tensors, path)
    return path, tensors


@pytest.fixture
def deferred_of():
    """``(DeferredTensor, DecodeCounter)`` of tensor ``name`` of a file, the files closed after the test."""
    files = []

    def make(path, name):
        files.append(SztFile(path))
        counter = DecodeCounter()
        return DeferredTensor(HostReader(files[-1], verify=True), files[-1].entry(name), counter), counter

    yield make
    for file in files:
        file.close()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                       b.reshape(-1).view(torch.uint8))


def test_metadata_is_read_without_decoding(checkpoint, deferred_of):
    path, tensors = checkpoint
    for name, tensor in tensors.items():
        deferred, counter = deferred_of(path, name)
        assert deferred.shape == tensor.shape and deferred.dtype == tensor.dtype and deferred.dim() == tensor.dim()
        assert deferred.numel() == tensor.numel() and deferred.size() == tensor.size()
        assert name in repr(deferred)
        assert counter.decoded == 0


def test_a_copy_into_a_parameter_decodes_straight_into_it(checkpoint, deferred_of):
    path, tensors = checkpoint
    for name, tensor in tensors.items():
        deferred, counter = deferred_of(path, name)
        target = torch.full_like(tensor, 7) if tensor.is_floating_point() else torch.zeros_like(tensor)
        address = target.data_ptr()
        assert target.copy_(deferred) is target and target.data_ptr() == address
        assert _same(target, tensor), name
        assert counter.decoded == tensor.numel() * tensor.element_size()


@pytest.mark.parametrize("start, length", [(0, 48), (48, 48), (5, 1), (0, 96), (95, 1), (10, 0)])
def test_narrowed_rows_decode_only_themselves(checkpoint, deferred_of, start, length):
    path, tensors = checkpoint
    deferred, counter = deferred_of(path, "proj.weight")
    rows = deferred.narrow(0, start, length)
    assert isinstance(rows, DeferredTensor) and rows.shape == (length, 40) and counter.decoded == 0
    target = torch.empty(length, 40, dtype=torch.bfloat16)
    target.copy_(rows)
    assert _same(target, tensors["proj.weight"][start: start + length])
    assert counter.decoded == length * 40 * 2
    twice = deferred.narrow(0, start, length).narrow(0, 0, length // 2) if length > 1 else None
    if twice is not None:
        half = torch.empty(length // 2, 40, dtype=torch.bfloat16)
        half.copy_(twice)
        assert _same(half, tensors["proj.weight"][start: start + length // 2])


def test_anything_else_decodes_first_and_gets_exactly_the_tensor(checkpoint, deferred_of):
    path, tensors = checkpoint
    weight = tensors["proj.weight"]
    deferred, counter = deferred_of(path, "proj.weight")
    assert _same(deferred.t().contiguous(), weight.t().contiguous())
    assert _same(deferred.float(), weight.float())
    assert _same(torch.cat([deferred, deferred]), torch.cat([weight, weight]))
    assert counter.decoded == weight.numel() * 2  # decoded once, kept
    as_float = torch.empty(96, 40)
    other, _ = deferred_of(path, "proj.weight")
    as_float.copy_(other)  # a cast on the way: decoded, then copied by torch
    assert _same(as_float, weight.float())
    rows, _ = deferred_of(path, "odd.weight")
    assert _same(rows.narrow(0, 30, 3).reshape(-1), tensors["odd.weight"][30:].reshape(-1))
    scalar, _ = deferred_of(path, "scale")
    assert scalar.item() == 0.25 and _same(scalar.view(1), tensors["scale"].view(1))


@pytest.mark.parametrize("reads", ["mapped", "through a buffer"])
@pytest.mark.parametrize("rows, cols", [((0, 96), (0, 20)), ((0, 96), (20, 20)), ((7, 60), (3, 17)), ((5, 5), (0, 40))])
def test_columns_of_a_matrix_are_decoded_into_the_target(checkpoint, deferred_of, monkeypatch, rows, cols, reads):
    """A row-parallel shard (narrow on the second dimension, before or after the rows): with even column bounds only
    the columns are decoded (straight from the mapping, or a few rows at a time through a buffer: blocks smaller
    than the matrix here), else whole rows a few at a time and the columns copied out; either way into the target,
    which nothing else wrote."""
    from szformat.loading import host_decode, host_reader

    if reads == "mapped" and not host_decode.mapped_reads(True):
        pytest.skip("stored bytes are copied out with pread here")
    if reads == "through a buffer":
        monkeypatch.setattr(host_decode, "mapped_reads", lambda checked: False)
    monkeypatch.setattr(host_reader, "COLUMN_BLOCK_BYTES", 7 * 40 * 2)  # seven rows a block
    calls, real = [], host_reader.PayloadDecoder.decode_columns

    def counted(self, *args, **kwargs):
        calls.append(kwargs.get("streams"))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(host_reader.PayloadDecoder, "decode_columns", counted)
    path, tensors = checkpoint
    weight = tensors["proj.weight"]
    with SztFile(path) as f:
        at_rest = f.entry("proj.weight").at_rest is not None
    for order in ("rows first", "columns first"):
        calls.clear()
        deferred, counter = deferred_of(path, "proj.weight")
        if order == "rows first":
            shard = deferred.narrow(0, rows[0], rows[1] - rows[0]).narrow(1, cols[0], cols[1] - cols[0])
        else:
            shard = deferred.narrow(-1, cols[0], cols[1] - cols[0]).narrow(0, rows[0], rows[1] - rows[0])
        assert isinstance(shard, DeferredTensor) and shard.shape == (rows[1] - rows[0], cols[1] - cols[0])
        target = torch.full(shard.shape, 3.0, dtype=torch.bfloat16)
        target.copy_(shard)
        assert _same(target, weight[rows[0]: rows[1], cols[0]: cols[1]].contiguous()), order
        decoded_width = cols[1] - cols[0] if cols[0] % 2 == cols[1] % 2 == 0 else 40  # else whole rows
        assert counter.decoded == (rows[1] - rows[0]) * decoded_width * 2
        if decoded_width != 40:  # one call over the mapping, or one per block of rows read (at rest: inflated)
            mapped = reads == "mapped" and not at_rest
            blocks = 1 if mapped else -(-(rows[1] - rows[0]) // 7)
            assert len(calls) == blocks and all((streams is not None) == mapped for streams in calls)
        assert _same(shard.contiguous(), target)  # materialized the same way


def test_a_narrow_outside_the_tensor_is_refused_as_torch_refuses_it(checkpoint, deferred_of):
    path, tensors = checkpoint
    deferred, _ = deferred_of(path, "proj.weight")
    for dim, start, length in ((0, 90, 7), (1, 35, 6), (0, -1, 2)):
        with pytest.raises((RuntimeError, IndexError)) as real:
            tensors["proj.weight"].narrow(dim, start, length)
        with pytest.raises(type(real.value)):
            deferred.narrow(dim, start, length)


def test_decoding_into_a_tensor_of_the_wrong_size_is_refused_naming_the_tensor(checkpoint):
    from szformat.loading.host_decode import decode_entries

    path, _ = checkpoint
    with SztFile(path) as f:
        for wrong in (torch.empty(96, 39, dtype=torch.bfloat16), torch.empty(40, 96, dtype=torch.bfloat16).t()):
            with pytest.raises(ValueError, match="proj.weight: decoding into a tensor needs a contiguous CPU tensor"):
                decode_entries(f, [f.entry("proj.weight")], check_stored=[True], check_decoded=True, outs=[wrong])


def test_stored_bytes_that_fail_their_checksum_are_refused_when_used_naming_the_tensor(tmp_path, deferred_of):
    tensors = _tensors(1)
    path = tmp_path / "model.szt"
    szformat.save_file(tensors, path)
    data = bytearray(path.read_bytes())
    with SztFile(path) as f:
        entry = f.entry("proj.weight")
        data[entry.offset + entry.length // 2] ^= 0x20
    bad = tmp_path / "bad.szt"
    bad.write_bytes(bytes(data))
    for use in (lambda d: torch.empty(96, 40, dtype=torch.bfloat16).copy_(d),
                lambda d: torch.empty(10, 40, dtype=torch.bfloat16).copy_(d.narrow(0, 50, 10)),
                lambda d: torch.empty(96, 20, dtype=torch.bfloat16).copy_(d.narrow(1, 20, 20)),  # columns alone
                lambda d: torch.empty(96, 5, dtype=torch.bfloat16).copy_(d.narrow(1, 3, 5)),  # through whole rows
                lambda d: d.sum()):
        deferred, _ = deferred_of(bad, "proj.weight")
        with pytest.raises(ChecksumMismatchError, match="proj.weight") as info:
            use(deferred)
        assert "bad.szt" in str(info.value)


def test_szt_weights_on_the_cpu_counts_what_a_rank_decodes(checkpoint):
    """Every tensor handed out is counted once; a rank that keeps half the rows of a matrix decodes only those."""
    from szformat.integrations.vllm import szt_weights

    path, tensors = checkpoint
    counter = DecodeCounter()
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    loaded = {}
    for name, deferred in szt_weights(path, torch.device("cpu"), counter=counter):
        kept = deferred.narrow(0, 48, 48) if name == "proj.weight" else deferred
        target = torch.empty(kept.shape, dtype=kept.dtype)
        target.copy_(kept)
        loaded[name] = target
    assert counter.handed_out == total
    assert counter.decoded == total - 48 * 40 * 2
    assert _same(loaded.pop("proj.weight"), tensors["proj.weight"][48:])
    assert all(_same(loaded[name], tensors[name]) for name in loaded)


def test_tensors_used_after_their_files_closed_are_refused_naming_the_file(checkpoint):
    """Without ``files`` the iterator closes each file when it ends: a tensor kept past it raises ClosedFileError;
    with ``files`` they stay usable until the caller closes it."""
    import contextlib

    from szformat.errors import ClosedFileError
    from szformat.integrations.vllm import szt_weights

    path, tensors = checkpoint
    kept = dict(szt_weights(path, torch.device("cpu")))
    with pytest.raises(ClosedFileError, match="model.szt"):
        torch.empty(96, 40, dtype=torch.bfloat16).copy_(kept["proj.weight"])
    with contextlib.ExitStack() as files:
        kept = dict(szt_weights(path, torch.device("cpu"), files=files))
        target = torch.empty(96, 40, dtype=torch.bfloat16)
        target.copy_(kept["proj.weight"])
        assert _same(target, tensors["proj.weight"])
    with pytest.raises(ClosedFileError):
        kept["norm.weight"].sum()


@pytest.fixture(params=["in-memory", "at rest"])
def sharded(request, tmp_path):
    """A converted two-shard checkpoint (index and shards) in either form, and its tensors."""
    tensors = write_sharded(tmp_path / "st", seed=random.randrange(1 << 30))
    convert(tmp_path / "st", tmp_path / "szt", at_rest=1 if request.param == "at rest" else None)
    return tmp_path / "szt", tensors


def _device_weights(monkeypatch, fake: bool):
    """``szt_weights``, whose CUDA branch is served on the CPU by fakes when ``fake`` (or where there is no CUDA),
    else by the device: the loads it asks for are recorded."""
    from szformat.integrations import vllm
    from szformat.loading import StagingConfig, device_loader

    loads, events = [], []

    class Recording(device_loader.DeviceLoader):
        def __init__(self, device, *, verify):
            faked = fake or not torch.cuda.is_available()
            super().__init__("cpu" if faked else device, verify=verify, ops=FakeOps() if faked else None,
                             codec=ReferenceCodec() if faked else None, staging=StagingConfig(slot_bytes=8192))

        def load(self, file, names):
            loads.append([file.entry(n).raw_length for n in names])
            return super().load(file, names)

        def release(self, file):
            events.append(("release", file.path.name))
            super().release(file)

        def close(self):
            events.append(("close",))
            super().close()

    monkeypatch.setattr(device_loader, "DeviceLoader", Recording)
    return vllm.szt_weights, loads, events


@pytest.mark.parametrize("device", ["cuda-faked", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA device"))])
def test_szt_weights_on_a_gpu_rank_loads_batches_of_the_budget(sharded, monkeypatch, device):
    """A CUDA rank gets every tensor of every shard bit for bit, decoded in loads of at most ``batch_bytes`` raw
    bytes (one tensor alone where it is larger), each shard released after its last batch and the loader closed."""
    path, tensors = sharded
    szt_weights, loads, events = _device_weights(monkeypatch, fake=device == "cuda-faked")
    budget = 4096
    got = {name: tensor.cpu() for name, tensor in szt_weights(path, torch.device("cuda"), batch_bytes=budget)}
    assert got.keys() == tensors.keys()
    assert all(_same(got[name], tensors[name]) for name in tensors)
    assert sum(len(batch) for batch in loads) == len(tensors) and len(loads) > 2
    assert all(sum(batch) <= budget or len(batch) == 1 for batch in loads)
    assert events == [("release", "model-00001-of-00002.szt"), ("release", "model-00002-of-00002.szt"), ("close",)]


def test_a_gpu_rank_that_stops_early_closes_its_loader(sharded, monkeypatch):
    """vLLM failing on a name mid-load closes the iterator: the loader (its pinned slots, its threads) goes too."""
    path, _ = sharded
    szt_weights, _, events = _device_weights(monkeypatch, fake=True)
    weights = szt_weights(path, torch.device("cuda"), batch_bytes=4096)
    next(weights)
    weights.close()
    assert events == [("close",)]
