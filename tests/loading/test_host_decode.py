"""CPU loading on independent threads: ranges decoded in parallel are bit for bit the reference decode, every torch
op runs on one intra-op thread, the caller's setting survives, and an error on any thread ends the load."""

from __future__ import annotations

import os
import threading
import time

import pytest
import safetensors.torch
import torch

from szformat import load_file, safe_open, save_file
from szformat.codec import cpu
from szformat.errors import ChecksumMismatchError, PayloadError, TensorAllocationError, TruncatedFileError
from szformat.format.constants import ENCODING_RAW
from szformat.format.reader import SztFile
from szformat.loading import host_decode, host_pages

SPECIALS = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x7FC0, 0xFFC1, 0x7FFF, 0x0001, 0x8001, 0x007F, 0x807F, 0x0080, 0x7F7F]
"""+-0, +-Inf, NaNs, subnormals, the extremes of the normal range."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _tensors() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    big = (torch.randn(20_001, generator=gen) * 0.02).to(torch.bfloat16)  # odd: the last range ends mid-pair
    positions = torch.randperm(big.numel(), generator=gen)[: 13 * 40]
    specials = torch.tensor([b - 0x10000 if b & 0x8000 else b for b in SPECIALS] * 40, dtype=torch.int16)
    big.view(torch.int16)[positions] = specials  # escapes, in many ranges
    return {
        "big": big.reshape(3, 6667),
        "wide": (torch.randn(64, 513, generator=gen) * 3).to(torch.bfloat16),
        "tiny": torch.tensor([1.5, -0.0, float("inf")], dtype=torch.bfloat16),
        "scalar": torch.tensor(2.25, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "raw_f32": torch.randn(1001, generator=gen),  # stored raw, copied in ranges of RAW_RANGE_BYTES
    }


@pytest.fixture
def small_ranges(monkeypatch):
    """Ranges of 1,024 elements (and 1,000 raw bytes), so a small file has dozens of them, and as many threads as
    asked for, however few bytes they decode; no tensor decoded by the C call of a batch (:class:`_Batch`, tested
    on its own below), so the ranges are Python's, as where that call cannot read through the mapping, and as
    ``verify`` and ``decompress`` take a large tensor a window at a time."""
    monkeypatch.setattr(host_decode, "_batched", lambda entry, checked: False)
    monkeypatch.setattr(host_decode, "RANGE_ELEMENTS", 1024)
    monkeypatch.setattr(host_decode, "RAW_RANGE_BYTES", 1000)
    monkeypatch.setattr(host_decode, "THREAD_BYTES", 1)


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _reads_through(monkeypatch, reads: str, verify: bool) -> list[tuple[str, int, int]]:
    """Make SplitZip streams of the in-memory form read through the mapping (``"mapped"``: skipped where the C
    kernels cannot guard it) or copied out with ``pread``; returns the ``(tensor, start, stop)`` of every element
    range the mapping then serves."""
    if reads == "mapped" and not host_decode.mapped_reads(verify):
        pytest.skip("stored bytes are copied out with pread here")
    if reads == "pread":
        monkeypatch.setattr(host_decode, "mapped_reads", lambda checked: False)
    mapped: list[tuple[str, int, int]] = []
    real = host_decode.mapped_streams
    monkeypatch.setattr(host_decode, "mapped_streams",
                        lambda file, entry, a, b: mapped.append((entry.name, a, b)) or real(file, entry, a, b))
    return mapped


@pytest.mark.parametrize("at_rest", [None, "zstd"])
@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("reads", ["mapped", "pread"])
def test_parallel_ranges_match_the_reference_decode_bit_for_bit(tmp_path, small_ranges, two_threads, monkeypatch,
                                                                 verify, at_rest, reads):
    """Ranges of the in-memory form decoded straight from the mapping (the C kernels' guarded call) or copied out
    with ``pread`` first (where that call is not available)."""
    mapped = _reads_through(monkeypatch, reads, verify)
    source = _tensors()
    path = tmp_path / "m.szt"
    save_file(source, path, at_rest=at_rest)
    calls: list[tuple[int, int]] = []  # (thread, its intra-op threads) for every range decoded
    method = "decode_checked" if verify else "decode"
    real = getattr(cpu.PayloadDecoder, method)

    def spy(self, start, stop, out, **kwargs):
        calls.append((threading.get_ident(), torch.get_num_threads()))
        time.sleep(0.001)  # lets the other thread take ranges too
        return real(self, start, stop, out, **kwargs)

    monkeypatch.setattr(cpu.PayloadDecoder, method, spy)
    loaded = load_file(path, verify=verify)
    assert torch.get_num_threads() == 2  # the caller's setting is back
    assert {threads for _, threads in calls} == {1}
    assert len({thread for thread, _ in calls}) == 2
    assert len(calls) > 20 + 13  # "big" alone spans 20 ranges, "wide" 33
    assert len(mapped) == (20 + 33 if reads == "mapped" and at_rest is None else 0)
    if at_rest:
        with safe_open(path, framework="pt") as f:
            assert f.entry("big").at_rest is not None
    with SztFile(path) as f:
        for name, tensor in source.items():
            got = loaded[name]
            assert got.dtype == tensor.dtype and got.shape == tensor.shape, name
            assert torch.equal(_bits(got), _bits(tensor)), name
            entry = f.entry(name)
            if entry.encoding == "splitzip":  # and equal to the reference codec's own decode of the same payload
                reference = cpu.decode(f.memory_payload(name), entry.layout, entry.codebook)
                assert torch.equal(_bits(got), _bits(reference)), name


def test_get_tensor_decodes_a_large_tensor_in_ranges(tmp_path, small_ranges, two_threads, monkeypatch):
    source = _tensors()
    path = tmp_path / "m.szt"
    save_file(source, path)
    ranges = []
    real = cpu.PayloadDecoder.decode_checked
    monkeypatch.setattr(cpu.PayloadDecoder, "decode_checked",
                        lambda self, start, stop, out, **kw: ranges.append((start, stop))
                        or real(self, start, stop, out, **kw))
    with safe_open(path, framework="pt") as f:
        assert torch.equal(_bits(f.get_tensor("big")), _bits(source["big"]))
    assert sorted(ranges) == [(a, min(a + 1024, 20_001)) for a in range(0, 20_001, 1024)]


@pytest.mark.parametrize("verify", [True, False])
def test_a_tensor_decoded_alone_is_shared_between_the_threads(tmp_path, two_threads, monkeypatch, verify):
    """A tensor asked for alone (``get_tensor``, vLLM's loader) that would be one range is cut into one range per
    thread (here 20,001 elements, ranges of at least 1,000 and at most the default 8 Mi), each decoded on its own
    thread, bit for bit; a load of several tensors keeps whole ranges. Python's ranges: the C call of a batch cuts
    a large tensor into ranges its threads share itself (``tests/codec/test_cpu.py``)."""
    monkeypatch.setattr(host_decode, "_batched", lambda entry, checked: False)
    monkeypatch.setattr(host_decode, "MIN_RANGE_ELEMENTS", 1000)
    monkeypatch.setattr(host_decode, "WHOLE_ELEMENTS", 1024)  # "big" is decoded range by range
    source = _tensors()
    path = tmp_path / "m.szt"
    save_file(source, path)
    ranges: list[tuple[int, int, int]] = []
    method = "decode_checked" if verify else "decode"
    real = getattr(cpu.PayloadDecoder, method)

    def spy(self, start, stop, out, **kwargs):
        ranges.append((start, stop, threading.get_ident()))
        time.sleep(0.01)  # lets the other thread take the other range
        return real(self, start, stop, out, **kwargs)

    monkeypatch.setattr(cpu.PayloadDecoder, method, spy)
    with safe_open(path, framework="pt", verify=verify) as f:
        assert torch.equal(_bits(f.get_tensor("big")), _bits(source["big"]))
    assert sorted(r[:2] for r in ranges) == [(0, 10_002), (10_002, 20_001)]
    assert len({thread for _, _, thread in ranges}) == 2
    ranges.clear()
    loaded = load_file(path, verify=verify)
    assert torch.equal(_bits(loaded["big"]), _bits(source["big"]))
    assert (0, 20_001) in [r[:2] for r in ranges]


def test_an_error_on_any_thread_ends_the_load(tmp_path, small_ranges, two_threads, monkeypatch):
    path = tmp_path / "m.szt"
    save_file(_tensors(), path)
    real = cpu.PayloadDecoder.decode_checked
    count = iter(range(1_000_000))

    def failing(self, start, stop, out, **kwargs):
        if next(count) == 9:
            raise MemoryError("range 9")
        time.sleep(0.001)
        return real(self, start, stop, out, **kwargs)

    monkeypatch.setattr(cpu.PayloadDecoder, "decode_checked", failing)
    with pytest.raises(MemoryError, match="range 9"):
        load_file(path)
    assert torch.get_num_threads() == 2
    decoded = next(count)
    time.sleep(0.05)
    assert next(count) == decoded + 1  # no thread decoded a range after the load raised


def test_a_corrupt_range_is_reported_after_a_parallel_decode(tmp_path, small_ranges, two_threads):
    path = tmp_path / "m.szt"
    save_file(_tensors(), path)
    with safe_open(path, framework="pt") as f:
        e = f.entry("big")
        at = e.offset + e.layout.off_sm + 15_000  # in the 15th range
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(ChecksumMismatchError, match="stored bytes") as info:
        load_file(path)
    assert info.value.tensor == "big"
    assert torch.equal(_bits(load_file(path, verify=False)["wide"]), _bits(_tensors()["wide"]))


def _small_tensor_kernel(monkeypatch, kernel: str) -> None:
    """Decode small tensors with ``kernel``: ``mapped`` (the C kernels, batched from the file's mapping), ``native``
    (the C kernels, each read into a scratch first) or ``reference`` (PyTorch, range by range); skip where the C
    kernels cannot do what it names."""
    if kernel != "reference" and cpu._native is None:
        pytest.skip("the C extension was not built here")
    if kernel == "mapped" and not host_decode.mapped_reads(True):
        pytest.skip("the C kernels do not read through the mapping here")
    monkeypatch.setattr(cpu, "_native", cpu._native if kernel != "reference" else None)
    if kernel == "native":
        monkeypatch.setattr(host_decode, "mapped_reads", lambda checked: False)


@pytest.mark.parametrize("kernel", ["mapped", "native", "reference"])
def test_small_tensors_are_read_and_decoded_whole_where_the_c_kernels_are_built(tmp_path, two_threads, monkeypatch,
                                                                                 kernel):
    """With the C kernels the small tensors are decoded together from the file's mapping by one call (``mapped``),
    or where the kernels cannot catch a fault on a mapped page, each by one read and one decode call (escapes
    checked and patched in C); with the reference they go range by range; all give the source's bits."""
    _small_tensor_kernel(monkeypatch, kernel)
    source = _tensors()
    path = tmp_path / "m.szt"
    save_file(source, path)
    whole, ranges, batches = [], [], []
    real_decode, real_checked, real_batch = cpu.decode, cpu.PayloadDecoder.decode_checked, cpu.decode_payloads
    monkeypatch.setattr(cpu, "decode", lambda payload, layout, *a, **kw: whole.append(layout.n)
                        or real_decode(payload, layout, *a, **kw))
    monkeypatch.setattr(cpu.PayloadDecoder, "decode_checked", lambda self, start, stop, out, **kw:
                        ranges.append(self.layout.n) or real_checked(self, start, stop, out, **kw))
    monkeypatch.setattr(host_decode, "decode_payloads", lambda payloads, **kw:
                        batches.append(sorted(p[1].n for p in payloads)) or real_batch(payloads, **kw))
    loaded = load_file(path)
    for name, tensor in source.items():
        assert torch.equal(_bits(loaded[name]), _bits(tensor)), name
    with SztFile(path) as f:
        splitzip = sorted(f.entry(name).layout.n for name in f.entries if f.entry(name).encoding == "splitzip")
    assert splitzip == [20_001, 64 * 513]
    expected = {"mapped": ([], [], [splitzip]), "native": (splitzip, [], []), "reference": ([], splitzip, [])}
    assert (sorted(whole), sorted(ranges), batches) == expected[kernel]


@pytest.mark.parametrize("kernel", ["mapped", "native", "reference"])
def test_each_loaded_tensor_owns_a_storage_of_its_bytes(tmp_path, two_threads, monkeypatch, kernel):
    """Every tensor a load returns has a storage of its own holding exactly its bytes, as safetensors' loads give:
    ``safetensors.torch.save_file`` refuses tensors that share one, and a tensor kept alone must not keep the others'
    memory."""
    _small_tensor_kernel(monkeypatch, kernel)
    source = _tensors()
    save_file(source, tmp_path / "m.szt")
    loaded = load_file(tmp_path / "m.szt")
    for name, tensor in loaded.items():
        assert tensor.storage_offset() == 0 and tensor.is_contiguous(), name
        assert tensor.untyped_storage().nbytes() == tensor.numel() * tensor.element_size(), name
        assert tensor.shape == source[name].shape and tensor.dtype == source[name].dtype, name
    safetensors.torch.save_file(loaded, tmp_path / "again.safetensors")
    again = safetensors.torch.load_file(tmp_path / "again.safetensors")
    assert all(torch.equal(_bits(again[name]), _bits(tensor)) for name, tensor in source.items())


@pytest.mark.parametrize("kernel", ["mapped", "native", "reference"])
def test_raw_bytes_are_returned_flat_for_every_tensor(tmp_path, two_threads, monkeypatch, kernel):
    """``as_bytes`` gives each tensor's raw bytes as flat uint8, whatever its shape and however it was decoded."""
    _small_tensor_kernel(monkeypatch, kernel)
    source = _tensors()
    save_file(source, tmp_path / "m.szt")
    with SztFile(tmp_path / "m.szt") as f:
        names = list(f.entries)
        raw = host_decode.decode_entries(f, [f.entry(name) for name in names], check_stored=[True] * len(names),
                                         check_decoded=True, as_bytes=True)
    for name, got in zip(names, raw):
        expected = source[name].reshape(-1).view(torch.uint8)
        assert got.dtype == torch.uint8 and got.dim() == 1 and torch.equal(got, expected), name


@pytest.mark.parametrize("kernel", ["mapped", "native", "reference"])
def test_tensors_are_decoded_into_the_outputs_given(tmp_path, two_threads, monkeypatch, kernel):
    """Given an output per tensor (the parameter it is loaded into, of any dtype of its byte size), each is decoded
    into it, and what comes back is a view of it in the tensor's dtype and shape."""
    _small_tensor_kernel(monkeypatch, kernel)
    source = _tensors()
    save_file(source, tmp_path / "m.szt")
    with SztFile(tmp_path / "m.szt") as f:
        names = list(f.entries)
        outs = [torch.full((source[name].numel() * source[name].element_size(),), 7, dtype=torch.uint8)
                for name in names]
        got = host_decode.decode_entries(f, [f.entry(name) for name in names], check_stored=[True] * len(names),
                                         check_decoded=True, outs=outs)
    for name, out, tensor in zip(names, outs, got):
        assert torch.equal(out, source[name].reshape(-1).view(torch.uint8)), name
        assert tensor.data_ptr() == out.data_ptr() and tensor.shape == source[name].shape, name
        assert tensor.dtype == source[name].dtype, name


@pytest.mark.parametrize("kernel", ["mapped", "native", "reference"])
def test_an_output_that_does_not_fit_is_refused_before_anything_is_decoded(tmp_path, two_threads, monkeypatch,
                                                                            kernel):
    """One output of the wrong size among those given (a small tensor's, decoded in a batch where the C kernels
    read through the mapping): a ValueError naming its tensor, and no output written."""
    _small_tensor_kernel(monkeypatch, kernel)
    source = _tensors()
    save_file(source, tmp_path / "m.szt")
    with SztFile(tmp_path / "m.szt") as f:
        names = list(f.entries)
        outs = [torch.full((source[name].numel() * source[name].element_size() + (name == "wide"),), 7,
                           dtype=torch.uint8) for name in names]
        with pytest.raises(ValueError, match="wide: decoding into a tensor needs a contiguous CPU tensor of 65664 bytes"):
            host_decode.decode_entries(f, [f.entry(name) for name in names], check_stored=[True] * len(names),
                                       check_decoded=True, outs=outs)
    assert all(bool((out == 7).all()) for out in outs)


def test_tensors_are_batched_by_bytes():
    """The tensors of a load's C calls are cut into batches of at most CALL_BYTES of output, in the order given,
    each with the indices it decodes, its outputs given (or None) and stored-bytes flags."""
    entry = type("Entry", (), {})

    def small(name, raw_length):
        e = entry()
        e.name, e.raw_length = name, raw_length
        return e

    third = host_decode.CALL_BYTES // 3
    entries = [small(f"t{i}", 8 if i == 3 else third) for i in range(7)]
    batched = [0, 1, 2, 4, 5, 6]  # index 3: decoded range by range
    outs = [torch.empty(e.raw_length, dtype=torch.uint8) for e in entries]
    batches = host_decode._batches(None, entries, batched, outs, [i % 2 == 0 for i in range(7)], True)
    assert [run for run, _ in batches] == [[0, 1, 2], [4, 5, 6]]
    assert [u.entries for _, u in batches] == [entries[:3], entries[4:]]
    assert [[out.data_ptr() for out in u.given] for _, u in batches] == \
        [[outs[i].data_ptr() for i in run] for run in ([0, 1, 2], [4, 5, 6])]
    assert [u.check_stored for _, u in batches] == [[True, False, True], [True, False, True]]
    assert [u.given for _, u in host_decode._batches(None, entries, batched, None, [True] * 7, True)] == \
        [[None] * 3] * 2


def test_a_small_tensor_whose_output_cannot_be_made_is_named(tmp_path, monkeypatch):
    """Memory runs out for the third of five small tensors decoded together: the package's error (a MemoryError)
    names that tensor and the file."""
    g = torch.Generator().manual_seed(3)
    tensors = {f"t{i}": (torch.randn(64, 48, generator=g) * 0.02).to(torch.bfloat16) for i in range(5)}
    path = tmp_path / "small.szt"
    save_file(tensors, path)
    real, made = host_pages.empty, []

    def empty(size, dtype):
        made.append(size)
        if len(made) == 3:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 6144 bytes.")
        return real(size, dtype)

    monkeypatch.setattr(host_pages, "empty", empty)
    with pytest.raises(TensorAllocationError) as info:
        load_file(path)
    assert isinstance(info.value, MemoryError) and info.value.tensor == "t2" and "small.szt" in str(info.value)


@pytest.mark.parametrize("verify", [True, False])
def test_a_small_tensor_with_corrupt_bytes_is_refused_by_name(tmp_path, verify):
    """A whole-read tensor's stored bytes are checked before anything decodes them; with verify off, a broken escape
    stream is still the package's error naming file and tensor, and nothing else changes."""
    source = _tensors()
    path = tmp_path / "m.szt"
    save_file(source, path)
    with safe_open(path, framework="pt") as f:
        e = f.entry("big")
        at = e.offset + e.layout.off_lpos  # the first escape's local position: now past its chunk
    data = bytearray(path.read_bytes())
    data[at + 1] ^= 0xF0
    path.write_bytes(bytes(data))
    error = ChecksumMismatchError if verify else PayloadError
    with pytest.raises(error, match="stored bytes" if verify else "outside its chunk") as info:
        load_file(path, verify=verify)
    assert (info.value.tensor, str(info.value.path)) == ("big", str(path))


BREAKS = [
    ("sm", ChecksumMismatchError, "stored bytes"),  # a byte of its stored bytes, far into the tensor
    ("escape", ChecksumMismatchError, "stored bytes"),  # an escape stream broken, and so its checksum
    ("codebook", ChecksumMismatchError, "decoded bytes"),  # the header's codebook edited, its checksum recomputed
]
"""Where :func:`_break` breaks a tensor, and the error and reason a decode of it gives."""


def _break(path, name: str, where: str, *, sm_element: int) -> None:
    """Break tensor ``name`` of the file at ``path`` as :data:`BREAKS` says: the ``sm`` byte of element
    ``sm_element``, its first escape's local position, or its codebook's first two exponents swapped in the header
    (which is written again with checksums that hold)."""
    from support import Forge

    if where == "codebook":
        forge = Forge.load(path)
        lut = forge.entry(name)["encoding"]["configuration"]["codebook"]
        lut[0], lut[1] = lut[1], lut[0]
        forge.write(path)
        return
    with SztFile(path) as f:
        e = f.entry(name)
        at = e.offset + (e.layout.off_sm + sm_element if where == "sm" else e.layout.off_lpos + 1)
    data = bytearray(path.read_bytes())
    data[at] ^= 0xF0
    path.write_bytes(bytes(data))


def _with_a_large_tensor() -> dict[str, torch.Tensor]:
    """:func:`_tensors` and a tensor of more than two of the C call's units, with escapes in each."""
    gen = torch.Generator().manual_seed(5)
    unit = cpu._native.UNIT_ELEMENTS if cpu._native is not None else 1 << 20
    large = (torch.randn(2 * unit + 5, generator=gen) * 0.02).to(torch.bfloat16)
    large[torch.randint(0, large.numel(), (300,), generator=gen)] = float("inf")
    large[[0, unit - 1, unit, 2 * unit, 2 * unit + 4]] = float("nan")
    return {**_tensors(), "large": large}


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("verify", [True, False])
def test_a_load_decodes_the_in_memory_form_by_one_call_on_threads_of_its_own(tmp_path, monkeypatch, threads, verify):
    """Where the C kernels read through the mapping, every SplitZip tensor of a load in the in-memory form goes to
    one C call (the raw one to Python's threads), on the caller's thread count (at most the host's cores), at most one
    per CALL_THREAD_BYTES of output, the mapping's pages dropped as they are read where that pays (here from two
    threads and 1 MiB on): bit for bit, a tensor of several units included."""
    if not host_decode.mapped_reads(verify):
        pytest.skip("the C kernels do not read through the mapping here")
    source = _with_a_large_tensor()
    path = tmp_path / "m.szt"
    save_file(source, path)
    calls: list[tuple[list[int], int, bool]] = []
    real = host_decode.decode_payloads

    def spy(payloads, **kwargs):
        calls.append(([layout.n for _, layout, _, _ in payloads], kwargs["threads"], kwargs["release"]))
        return real(payloads, **kwargs)

    monkeypatch.setattr(host_decode, "decode_payloads", spy)
    monkeypatch.setattr(cpu.cpu_kernel, "RELEASE_THREADS", 2)  # this file's pages dropped as read on two threads
    monkeypatch.setattr(cpu.cpu_kernel, "RELEASE_BYTES", 1 << 20)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        loaded = load_file(path, verify=verify)
    finally:
        torch.set_num_threads(before)
    for name, tensor in source.items():
        assert torch.equal(_bits(loaded[name]), _bits(tensor)), name
    with SztFile(path) as f:
        splitzip = [name for name in source if f.entry(name).encoding != ENCODING_RAW]
    assert "large" in splitzip and "raw_f32" not in splitzip
    raw = sum(source[name].numel() * 2 for name in splitzip)
    call_threads = min(threads, host_decode._CORES, -(-raw // host_decode.CALL_THREAD_BYTES))
    assert calls == [([source[name].numel() for name in splitzip], call_threads, call_threads >= 2)]


@pytest.mark.parametrize("where, error, reason", BREAKS)
@pytest.mark.parametrize("threads", [1, 3])
def test_a_bad_tensor_of_several_units_is_refused_by_name(tmp_path, where, error, reason, threads):
    """The C call joins a large tensor's checksums from its units': any byte wrong in any of them is the package's
    error naming the file and the tensor, on one thread or three."""
    if not host_decode.mapped_reads(True):
        pytest.skip("the C kernels do not read through the mapping here")
    path = tmp_path / "m.szt"
    save_file(_with_a_large_tensor(), path)
    _break(path, "large", where, sm_element=cpu._native.UNIT_ELEMENTS + 12_345)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        with pytest.raises(error, match=reason) as info:
            load_file(path)
    finally:
        torch.set_num_threads(before)
    assert (info.value.tensor, str(info.value.path)) == ("large", str(path))


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("reads", ["mapped", "pread"])
def test_rows_decode_to_the_source_bits_from_the_mapping_or_copied_out(tmp_path, monkeypatch, verify, reads):
    """Rows of a SplitZip tensor (what a tensor-parallel rank keeps) starting at an even element are decoded straight
    from the mapping where the C kernels guard it; rows starting at an odd element, and every row where they do
    not, from bytes copied out with ``pread``. A corrupt payload is refused by its checksum either way."""
    mapped = _reads_through(monkeypatch, reads, verify)
    source = _tensors()
    path = tmp_path / "m.szt"
    save_file(source, path)
    cases = [("wide", 2, 6), ("wide", 1, 3), ("wide", 63, 64), ("big", 0, 1), ("big", 1, 3)]
    with safe_open(path, framework="pt", verify=verify) as f:
        for name, a, b in cases:
            assert torch.equal(_bits(f.get_slice(name)[a:b]), _bits(source[name][a:b])), (name, a, b)
    even = [("wide", 513 * a, 513 * b) for name, a, b in cases if name == "wide" and a % 2 == 0] + [("big", 0, 6667)]
    assert sorted(mapped) == (sorted(even) if reads == "mapped" else [])
    if verify:
        with SztFile(path) as f:
            e = f.entry("wide")
            at = e.offset + e.layout.off_sm + 513 * 40  # outside the rows read
        data = bytearray(path.read_bytes())
        data[at] ^= 0x10
        path.write_bytes(bytes(data))
        with safe_open(path, framework="pt") as f, pytest.raises(ChecksumMismatchError, match="stored bytes") as info:
            f.get_slice("wide")[2:6]
        assert info.value.tensor == "wide"


def test_groups_are_cut_by_the_bytes_jobs_fill_besides_their_outputs(tmp_path, small_ranges, monkeypatch):
    """Each group ends with the threads waiting for its last range: the in-memory form, whose range-by-range jobs
    fill only the bytes around their streams, is one group; payloads stored at rest (read whole, then inflated) are
    cut into groups of about GROUP_BYTES."""
    source = {f"w{i}": (torch.randn(4000) * 0.02).to(torch.bfloat16) for i in range(6)}
    monkeypatch.setattr(host_decode, "GROUP_BYTES", 20_000)
    for at_rest, expected in ((None, [[0, 1, 2, 3, 4, 5]]), ("zstd", [[0], [1], [2], [3], [4], [5]])):
        path = tmp_path / f"{at_rest}.szt"
        save_file(source, path, at_rest=at_rest)
        with SztFile(path) as f:
            entries = [f.entry(name) for name in source]
        held = [host_decode._held_bytes(e) for e in entries]
        assert all(h < 100 for h in held) if at_rest is None else all(h > 10_000 for h in held)
        assert host_decode._groups(entries) == expected
        assert all(torch.equal(_bits(t), _bits(source[k])) for k, t in load_file(path).items())


@pytest.mark.parametrize("reads", ["mapped", "pread"])
def test_a_load_allocates_only_the_bytes_around_the_streams_besides_its_outputs(tmp_path, small_ranges, two_threads,
                                                                                monkeypatch, reads):
    """A tensor decoded range by range keeps only its padding and escape streams in a buffer of the load's, not a
    buffer of its stored size: one allocated and freed at every load moved glibc's heap thresholds so that loads
    repeated in one process faulted their outputs in anew (``bench/RESULTS.md``, "CPU loading")."""
    _reads_through(monkeypatch, reads, True)
    source = _tensors()
    path = tmp_path / "m.szt"
    save_file(source, path)
    with SztFile(path) as f:
        entries = [f.entry(name) for name in source]
    ranged = [e for e in entries if host_decode._ranged(e)]
    assert {e.name for e in ranged} >= {"big", "wide"}
    raw_outputs = {e.length for e in entries if e.encoding == ENCODING_RAW}
    allocated: list[int] = []
    real = torch.empty

    def spy(*args, **kwargs) -> torch.Tensor:
        tensor = real(*args, **kwargs)
        if tensor.dtype == torch.uint8:
            allocated.append(tensor.numel())
        return tensor

    monkeypatch.setattr(torch, "empty", spy)
    loaded = load_file(path)
    assert all(torch.equal(_bits(loaded[k]), _bits(v)) for k, v in source.items())
    buffers = [n for n in allocated if n not in raw_outputs and n < host_decode.SCRATCH_BYTES]  # not a thread's
    assert buffers == [sum(host_decode.around_streams_length(e) for e in ranged)]
    assert buffers[0] < sum(e.length for e in ranged) // 20


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("reader", ["load", "get_tensor"])
def test_a_file_cut_in_the_escape_streams_after_it_was_opened_is_refused_as_truncated(tmp_path, small_ranges, verify,
                                                                                       reader):
    """The bytes around a tensor's streams are read before its decoder checks its escapes: a read that finds the file
    cut short is a TruncatedFileError naming the file and the tensor, not a PayloadError about the escapes."""
    path = tmp_path / "cut.szt"
    save_file(_tensors(), path)
    with SztFile(path) as f, safe_open(path, "pt", verify=verify) as opened:
        entry = f.entry("big")
        assert host_decode._ranged(entry) and entry.layout.n_esc
        os.truncate(path, entry.offset + entry.length - 1)  # the last escape byte
        with pytest.raises(TruncatedFileError, match="big") as info:
            if reader == "load":
                host_decode.decode_entries(f, [entry], check_stored=[verify], check_decoded=verify)
            else:
                opened.get_tensor("big")
    assert "cut.szt" in str(info.value)


def test_a_batch_of_small_tensors_cut_after_the_file_was_opened_names_the_first_tensor_it_lost(tmp_path):
    """The small tensors decoded together from the mapping: a file cut short meanwhile is a TruncatedFileError
    naming it and the first tensor whose stored bytes are gone, before any of them is decoded."""
    if not host_decode.mapped_reads(True):
        pytest.skip("the C kernels do not read through the mapping here")
    gen = torch.Generator().manual_seed(11)
    path = tmp_path / "cut.szt"
    save_file({f"w{i}": (torch.randn(300 + i, generator=gen) * 0.02).to(torch.bfloat16) for i in range(10)}, path)
    with SztFile(path) as f:
        entries = [f.entry(name) for name in f.entries]
        assert all(host_decode._batched(e, True) for e in entries)
        os.truncate(path, entries[5].offset + 10)
        with pytest.raises(TruncatedFileError, match="tensor 'w5'") as info:
            host_decode.decode_entries(f, entries, check_stored=[True] * 10, check_decoded=True)
    assert "cut.szt" in str(info.value)


@pytest.mark.parametrize("thread_bytes, threads", [(1, 2), (10**9, 1)])
def test_a_load_takes_one_thread_per_thread_bytes_of_output(tmp_path, small_ranges, two_threads, monkeypatch,
                                                            thread_bytes, threads):
    """Every range costs Python holding the GIL: a small load on many threads ran slower than on one."""
    monkeypatch.setattr(host_decode, "THREAD_BYTES", thread_bytes)
    path = tmp_path / "m.szt"
    save_file(_tensors(), path)
    seen = set()
    real = cpu.PayloadDecoder.decode_checked

    def spy(self, *args, **kwargs):
        seen.add(threading.get_ident())
        time.sleep(0.001)  # lets the other thread take ranges too
        return real(self, *args, **kwargs)

    monkeypatch.setattr(cpu.PayloadDecoder, "decode_checked", spy)
    load_file(path)
    assert len(seen) == threads


# ---------------------------------------------------------------------------------------------------------------
# Windows: a tensor decoded a window of a reused buffer at a time (verify and decompress of large tensors)
# ---------------------------------------------------------------------------------------------------------------


def _windows(path, name: str, buffer_bytes: int, threads: int = 2) -> tuple[bytes, list[int]]:
    """The bytes ``decode_windows`` yields for tensor ``name``, joined, and each window's size."""
    with SztFile(path) as f:
        buffer = torch.full((buffer_bytes,), 0xAB, dtype=torch.uint8)  # nothing of it may leak into a window
        sizes, data = [], b""
        for window in host_decode.decode_windows(f, f.entry(name), buffer, threads=threads):
            sizes.append(window.numel())
            data += window.numpy().tobytes()
    return data, sizes


@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("buffer_bytes", [64, 1002, 8192, 100_000])
@pytest.mark.parametrize("reads", ["mapped", "pread"])
def test_windows_give_the_tensor_bit_for_bit(tmp_path, monkeypatch, buffer_bytes, threads, reads):
    """Escapes (subnormals, NaN and Inf payloads) in many windows, an odd element count (the last window ends mid
    pair), windows smaller than a range, a buffer larger than the tensor; read through the mapping or copied out
    with ``pread``."""
    _reads_through(monkeypatch, reads, True)
    monkeypatch.setattr(host_decode, "WINDOW_RANGE_ELEMENTS", 1000)
    source = _tensors()
    path = tmp_path / "m.szt"
    save_file(source, path)
    with SztFile(path) as f:
        names = [name for name, entry in f.entries.items() if host_decode.windowed(entry)]
    assert {"big", "wide"} <= set(names)
    for name in names:
        data, sizes = _windows(path, name, buffer_bytes, threads)
        assert data == _bits(source[name]).numpy().tobytes(), name
        assert all(size <= buffer_bytes for size in sizes) and len(sizes) >= 1
    _, sizes = _windows(path, "big", 8192, threads)
    assert sizes[0] == 2000 * min(threads, os.cpu_count(), 4) and len(sizes) == -(-20_001 * 2 // sizes[0])


def test_windows_refuse_what_they_do_not_decode(tmp_path):
    path = tmp_path / "m.szt"
    save_file(_tensors(), path, at_rest="zstd")
    with SztFile(path) as f:
        assert not host_decode.windowed(f.entry("raw_f32")) and not host_decode.windowed(f.entry("big"))
        with pytest.raises(ValueError, match="in-memory form"):
            next(host_decode.decode_windows(f, f.entry("big"), torch.empty(1 << 20, dtype=torch.uint8)))
    save_file(_tensors(), path)
    with SztFile(path) as f:
        assert host_decode.windowed(f.entry("big")) and not host_decode.windowed(f.entry("raw_f32"))
        with pytest.raises(ValueError, match="at least 4 bytes"):
            next(host_decode.decode_windows(f, f.entry("big"), torch.empty(3, dtype=torch.uint8)))


@pytest.mark.parametrize("where, error, reason", BREAKS)
def test_a_bad_window_is_refused_by_name_after_the_last(tmp_path, two_threads, where, error, reason):
    path = tmp_path / "m.szt"
    save_file(_tensors(), path)
    _break(path, "big", where, sm_element=15_001)
    with pytest.raises(error, match=reason) as info:
        _windows(path, "big", 8192)
    assert (info.value.tensor, str(info.value.path)) == ("big", str(path))


@pytest.mark.parametrize("at_rest", [None, "zstd"])
def test_the_jobs_are_made_on_one_intra_op_thread(tmp_path, two_threads, monkeypatch, at_rest):
    """A job's own copies (a payload at rest inflated, its verbatim streams copied) run on the caller's thread
    before the decode: with PyTorch's intra-op pool each woke a team that then spun beside the decoding threads
    (a 2-thread load of an at-rest file cost 2.5x the CPU of one thread)."""
    path = tmp_path / "m.szt"
    save_file(_tensors(), path, at_rest=at_rest)
    seen = []
    make_job = host_decode._new_job

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return make_job(*args, **kwargs)

    monkeypatch.setattr(host_decode, "_new_job", recording)
    loaded = load_file(path)
    assert all(torch.equal(_bits(loaded[k]), _bits(v)) for k, v in _tensors().items())
    assert seen and set(seen) == {1} and torch.get_num_threads() == 2
