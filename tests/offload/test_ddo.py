"""szformat's DDO seams on the CPU: the slice descriptor and registry, configuration and version checks, and the
staging pool and native transport subclasses driven through DDO's own code with a CPU stand-in for the device.

DDO's Python side imports without a GPU; what needs one (pinned memory, the native host ring, CUDA streams) is
replaced by fakes that run the same work in stream order, deferred like a GPU's, so a missing fence shows up as a
wrong tensor. The same classes run end to end on a GPU in bench/offload.py.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("diffusers_dynamic_offloader", exc_type=ImportError)

from ddo_vmm_allocator import model_arena_adapter  # noqa: E402
from diffusers_dynamic_offloader import vmm_weight_store  # noqa: E402

import szformat  # noqa: E402
from szformat._install import install_hint  # noqa: E402
from szformat.errors import DecodeRouteError  # noqa: E402
from szformat.loading import SlotDecoder  # noqa: E402
from szformat.offload import OffloadEnvironment, bind_module  # noqa: E402
from szformat.offload.shards import Checkpoint  # noqa: E402
from szformat.offload.ddo_compat import SztFileSlice, check_ddo, ddo_config, substituted  # noqa: E402
from szformat.offload.ddo_native import (RegisteredTicket, SztArenaWeightStore, SztNativeShardTransport,  # noqa: E402
                                         staged_windows)
from szformat.offload.ddo_staging import StagingContext, SztStagingPool, group_destinations  # noqa: E402
from szformat.offload.placeholders import Placeholders  # noqa: E402
from szformat.offload.registered import runs  # noqa: E402

from fakes import ReferenceCodec  # noqa: E402

DDO = "diffusers-dynamic-offloader"


# -- a CPU stand-in for streams and events: work runs when something waits for it ------------------------------


class FakeEvent:
    def __init__(self, ops: "FakeOps", stream: "FakeStream | None" = None):
        self.ops, self.stream, self.position = ops, stream, 0
        if stream is not None:
            self.record(stream)

    def record(self, stream: "FakeStream") -> None:
        self.ops.log.append(("record", stream.name))
        self.stream, self.position = stream, len(stream.queue)

    def synchronize(self) -> None:
        self.ops.run(self.stream, self.position)


class FakeStream:
    def __init__(self, name: str):
        self.name = name
        self.queue: list = []
        self.done = 0


class FakeOps:
    """Deferred streams: enqueued work runs only when the host (or a stream that waits) needs it."""

    device = torch.device("cpu")

    def __init__(self):
        self.log: list[tuple] = []
        self.streams = {name: FakeStream(name) for name in ("compute", "upload")}

    def current_stream(self) -> FakeStream:
        return self.streams["compute"]

    def enqueue(self, stream, work, label) -> None:
        self.log.append((label, stream.name))
        stream.queue.append(work)

    def record(self, stream) -> FakeEvent:
        return FakeEvent(self, stream)

    def wait(self, stream, event) -> None:
        self.log.append(("wait", stream.name))
        stream.queue.append(lambda: self.run(event.stream, event.position))

    def synchronize(self, event) -> None:
        event.synchronize()

    def run(self, stream, position) -> None:
        while stream.done < position:
            stream.done += 1
            stream.queue[stream.done - 1]()

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.full((nbytes,), 0x5A, dtype=torch.uint8)

    def reserve(self, nbytes: int) -> None:
        pass


# -- checkpoint --------------------------------------------------------------------------------------------------


def bf16_with_escapes(shape, seed: int, escapes: int = 6) -> torch.Tensor:
    """Gaussian weights plus ``escapes`` values of rare, distinct exponents (NaN, infinities, a subnormal...)."""
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=gen) * 0.05).to(torch.bfloat16).reshape(-1)
    rare = torch.tensor([float("nan"), 1e-40, -3e38, 2.0 ** -120, float("-inf"), 2.0 ** 100, -(2.0 ** -90),
                         2.0 ** 60, 2.0 ** -70, -(2.0 ** 40), 2.0 ** -50, 2.0 ** 20], dtype=torch.bfloat16)
    x[torch.randperm(x.numel(), generator=gen)[:escapes]] = rare[torch.arange(escapes) % len(rare)]
    return x.reshape(shape)


class Weights(torch.nn.Module):
    """Four weights packed the way DDO packs a group: offsets 0, 3840 (16-aligned), 3908 (4-aligned), 3908 + 1290."""

    SHAPES = {"a": (48, 40), "b": (2, 17), "c": (15, 43), "d": (3, 64)}

    def __init__(self):
        super().__init__()
        for name, shape in self.SHAPES.items():
            self.register_parameter(name, torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16)))


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    escapes = {"a": 12, "b": 2, "c": 10, "d": 0}
    tensors = {name: bf16_with_escapes(shape, seed, escapes[name])
               for seed, (name, shape) in enumerate(Weights.SHAPES.items())}
    tensors["d"] = torch.randint(-2**15, 2**15, (3, 64), dtype=torch.int16,
                                 generator=torch.Generator().manual_seed(9)).view(torch.bfloat16)  # stored raw
    path = tmp_path_factory.mktemp("ddo") / "weights.szt"
    szformat.save_file(tensors, path)
    return path, tensors


@pytest.fixture()
def setup(stored):
    path, tensors = stored
    checkpoint = Checkpoint(path)
    module = Weights()
    binding = bind_module(module, checkpoint.entries, path=path)
    placeholders = Placeholders(binding)
    placeholders.install(module, binding)
    slices = {b.entry: SztFileSlice.of(checkpoint.file(b.entry).path, checkpoint.entries[b.entry]) for b in binding}
    yield checkpoint, module, placeholders, slices, tensors
    checkpoint.close()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.int16), b.reshape(-1).view(torch.int16))


def test_the_fixture_covers_splitzip_escapes_and_raw_entries(setup):
    checkpoint = setup[0]
    encodings = {name: entry.encoding for name, entry in checkpoint.entries.items()}
    assert encodings == {"a": "splitzip", "b": "splitzip", "c": "splitzip", "d": "raw"}
    assert checkpoint.entries["a"].layout.n_esc and checkpoint.entries["c"].layout.n_esc


# -- slices and DDO's registry -------------------------------------------------------------------------------------


def test_a_slice_is_raw_sized_and_says_how_many_bytes_are_stored(setup):
    checkpoint, module, placeholders, slices, _ = setup
    entry = checkpoint.entries["a"]
    piece = slices["a"]
    assert isinstance(piece, vmm_weight_store.SafetensorFileSlice)
    assert (piece.offset_bytes, piece.size_bytes, piece.stored_bytes) == (entry.offset, entry.raw_length, entry.length)
    assert piece.stored_bytes < piece.size_bytes
    registry = vmm_weight_store.SafetensorSliceRegistry()
    assert registry.bind(module.a, piece)
    assert registry.lookup(module.a) is piece
    assert not registry.bind(module.b, piece)  # DDO's own size check sees raw sizes


def test_placeholders_are_distinct_zero_views_and_tied_names_share_one(setup):
    _, module, placeholders, _, _ = setup
    pointers = [module.a.data_ptr(), module.b.data_ptr(), module.c.data_ptr(), module.d.data_ptr()]
    assert len(set(pointers)) == 4 and all(placeholders.contains(p) for p in module.parameters())
    assert not placeholders.contains(torch.zeros(3))
    assert not module.a.detach().view(torch.int16).any()


# -- version, structure and configuration checks --------------------------------------------------------------------


def test_an_unsupported_ddo_version_is_refused_with_the_supported_one():
    env = OffloadEnvironment(versions={DDO: "0.2.0", "ddo-vmm-allocator": "0.1.0rc2"})
    # The hint reads the installed metadata (tests/test_packaging.py checks its words), so a checkout run without
    # `pip install -e .` gets the fallback hint: compare with whatever this installation gives.
    expected = f"diffusers-dynamic-offloader 0.2.0 is not supported (szformat supports 0.1.0rc2; {install_hint('ddo')})"
    with pytest.raises(DecodeRouteError, match=re.escape(expected)):
        check_ddo(env)


def test_a_ddo_that_moved_a_seam_is_refused_naming_it(monkeypatch):
    monkeypatch.delattr(vmm_weight_store.PinnedStagingPool, "stage_file_slices")
    with pytest.raises(DecodeRouteError, match="lacks PinnedStagingPool.stage_file_slices; szformat supports 0.1.0rc2"):
        check_ddo(OffloadEnvironment())


def test_the_installed_ddo_passes_the_checks():
    check_ddo(OffloadEnvironment())


def test_configuration_picks_the_execution_mode_and_refuses_options_that_bypass_szformat():
    staging = ddo_config("staging", torch.device("cuda:1"), {"vmm_resident_weight_budget_gb": 1.5})
    native = ddo_config("native", torch.device("cuda:0"), {"vmm_staging_buffer_gb": 0.25})
    assert (staging.execution_mode, staging.vmm_resident_weight_budget_gb, staging.execution_device) == (
        "vmm_runtime", 1.5, "cuda:1")
    assert (native.execution_mode, native.vmm_native_transport, native.vmm_staging_buffer_gb) == (
        "vmm_fast_runtime", True, 0.25)
    with pytest.raises(ValueError, match=r"vmm_pin_source_weights \(pins the module's CPU tensors, but they hold no "
                                         r"weights\); vmm_source_cache_gb"):
        ddo_config("staging", "cuda:0", {"vmm_pin_source_weights": True, "vmm_source_cache_gb": 2.0})
    with pytest.raises(ValueError, match="unknown DDO options: vmm_bogus"):
        ddo_config("staging", "cuda:0", {"vmm_bogus": 1})


def test_a_substitution_lasts_for_the_block_and_refuses_a_foreign_class():
    original = vmm_weight_store.PinnedStagingPool
    with substituted(vmm_weight_store, "PinnedStagingPool", original, SztStagingPool):
        assert vmm_weight_store.PinnedStagingPool is SztStagingPool
        with pytest.raises(DecodeRouteError, match="another package replaced it"):
            with substituted(vmm_weight_store, "PinnedStagingPool", original, SztStagingPool):
                pass
    assert vmm_weight_store.PinnedStagingPool is original


# -- the staging pool --------------------------------------------------------------------------------------------


@pytest.fixture()
def unpinned(monkeypatch):
    """DDO's pool pins its slots; without a GPU, allocate them pageable (the only change to DDO's constructor)."""
    empty = torch.empty

    def pageable_empty(*args, pin_memory=False, **kwargs):
        return empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", pageable_empty)


def staged_group(setup, decoder, slot_bytes=1 << 16):
    checkpoint, module, placeholders, slices, tensors = setup
    ops = decoder.ops if decoder is not None else FakeOps()
    pool = SztStagingPool(slot_bytes)
    names = list(Weights.SHAPES)
    sources = [getattr(module, name).detach() for name in names]
    device = torch.full((sum(s.numel() * 2 for s in sources) + 64,), 0x77, dtype=torch.uint8)
    weights = {}
    offset = 0
    for name, source in zip(names, sources):
        weights[name] = device[offset: offset + source.numel() * 2].view(torch.bfloat16).view(source.shape)
        offset += source.numel() * 2
    registry = vmm_weight_store.SafetensorSliceRegistry()
    for name, source in zip(names, sources):
        registry.bind(source, slices[name])
    groups = [("blocks.0", list(zip(names, sources)))]
    pool.attach(StagingContext(files={str(f.path): f for f in checkpoint.files}, placeholders=placeholders,
                               decoder=decoder, stream=ops.streams["upload"],
                               destinations=group_destinations(groups, weights.__getitem__, registry.lookup)))
    return pool, ops, [(source, slices[name]) for name, source in zip(names, sources)], device, weights


def ddo_upload(pool, ops, entries, device):
    """What DDO's VmmWeightArena._upload_packed_group does with a pool: stage, copy on the upload stream, record an
    event, mark the upload; then what the compute stream does: wait for the event DDO records after it."""
    upload = ops.streams["upload"]
    pool.begin_upload()
    staged = pool.stage_file_slices(entries)
    nbytes = sum(view.numel() * view.element_size() for view in staged)
    packed = pool.packed_bytes
    ops.enqueue(upload, lambda: device[:nbytes].copy_(packed), "copy")
    event = FakeEvent(ops, upload)
    pool.mark_upload(event)
    ready = FakeEvent(ops, upload)  # VmmModelArena.mark_upload: a new event on the upload stream
    ready.synchronize()
    return staged, event


def test_staging_packs_the_stored_bytes_and_hands_ddo_the_device_range(setup, unpinned):
    checkpoint = setup[0]
    decoder = SlotDecoder(ops=FakeOps(), codec=ReferenceCodec())
    pool, ops, entries, device, weights = staged_group(setup, decoder)
    pool.begin_upload()
    staged = pool.stage_file_slices(entries)
    raw = [checkpoint.entries[name].raw_length for name in Weights.SHAPES]
    # DDO gets each weight's raw-sized view where it will be on the device, and copies the group's range onto itself
    assert [view.data_ptr() for view in staged] == [weights[name].data_ptr() for name in Weights.SHAPES]
    assert pool.packed_bytes.data_ptr() == device.data_ptr() and pool.packed_bytes.numel() == sum(raw)
    # the slot holds only the stored payloads, back to back on 16-byte boundaries
    slot, offset = pool._active_buffer(), 0
    for name in Weights.SHAPES:
        entry = checkpoint.entries[name]
        assert torch.equal(slot[offset: offset + entry.length], checkpoint.file(name).payload(name))
        offset = -(-(offset + entry.length) // 16) * 16
    assert pool.transport_stats.shard_read_bytes == sum(e.length for e in checkpoint.entries.values())


def test_staging_copies_stored_bytes_once_then_decodes_before_the_upload_is_marked(setup, unpinned):
    checkpoint, *_, tensors = setup
    decoder = SlotDecoder(ops=FakeOps(), codec=ReferenceCodec())
    pool, ops, entries, device, weights = staged_group(setup, decoder)
    _, event = ddo_upload(pool, ops, entries, device)
    # DDO's copy (of the range onto itself), the wait for it, one copy of the stored bytes, the batched decode, then
    # the in-place expansion of the one weight whose range does not start on 16 bytes (c, at byte 3908)
    assert [step for step in ops.log if step[0] != "record"][:5] == [
        ("copy", "upload"), ("wait", "upload"), ("copy", "upload"), ("decode", "upload"), ("decode", "upload")]
    assert ops.log.index(("decode", "upload")) < len(ops.log) - 2  # DDO's event was recorded again after decoding
    assert event.position == len(ops.streams["upload"].queue) and pool._ready_events[0] is event
    for name, weight in weights.items():
        assert same_bits(weight, tensors[name]), name
    stored = sum(e.length for e in checkpoint.entries.values())
    assert pool.copied_bytes == stored  # the stored bytes, not the raw ones


class FakePages:
    """RegisteredPages as the driver would leave them: the file's bytes, offered only inside the registered spans."""

    def __init__(self, path, spans):
        self.data, self.spans, self.closed = Path(path).read_bytes(), spans, False

    def view(self, path, start, stop):
        inside = any(lo <= start and stop <= hi for lo, hi in self.spans)
        return torch.frombuffer(bytearray(self.data[start: stop]), dtype=torch.uint8) if inside else None

    def close(self):
        self.closed = True


def spans_of(checkpoint, names):
    return [(checkpoint.entries[n].offset, checkpoint.entries[n].offset + checkpoint.entries[n].length) for n in names]


def test_runs_join_nearby_extents_and_keep_distant_ones_apart():
    assert runs([(8192, 100), (0, 4000), (4096, 50), (1 << 20, 10)], gap=4096) == [(0, 8292), (1 << 20, (1 << 20) + 10)]
    assert runs([]) == []


def test_staging_dmas_registered_payloads_without_a_host_copy(setup, unpinned):
    checkpoint, *_, tensors = setup
    decoder = SlotDecoder(ops=FakeOps(), codec=ReferenceCodec())
    pool, ops, entries, device, weights = staged_group(setup, decoder)
    registered = ("a", "c")  # pages the driver took
    pool.context.pages = FakePages(checkpoint.file("a").path, spans_of(checkpoint, registered))
    pool._buffers[0].fill_(0xEE)
    staged, _ = ddo_upload(pool, ops, entries, device)
    for name, weight in weights.items():
        assert same_bits(weight, tensors[name]), name
    slot, cursor = pool._buffers[0], 0
    for name in Weights.SHAPES:  # registered payloads were never copied into the slot; the others were
        length = checkpoint.entries[name].length
        assert bool((slot[cursor: cursor + length] == 0xEE).all()) == (name in registered), name
        cursor = -(-(cursor + length) // 16) * 16
    pages = pool.context.pages
    pool.close()  # after the copies out of the pages have run, the pages are released with the pool
    assert pages.closed and pool.context.pages is None


def test_staging_reuses_the_group_plan_and_stays_exact_on_the_next_upload(setup, unpinned):
    *_, tensors = setup
    decoder = SlotDecoder(ops=FakeOps(), codec=ReferenceCodec())
    pool, ops, entries, device, weights = staged_group(setup, decoder)
    ddo_upload(pool, ops, entries, device)
    plan = next(iter(pool.context.plans.values()))
    device.fill_(0x11)
    ddo_upload(pool, ops, entries, device)
    assert len(pool.context.plans) == 1 and next(iter(pool.context.plans.values())) is plan
    for name, weight in weights.items():
        assert same_bits(weight, tensors[name]), name


def test_without_the_event_recorded_again_the_fence_would_miss_the_decode(setup, unpinned):
    """The control: DDO's event as first recorded (before the decode) does not cover the expansion."""
    *_, tensors = setup
    decoder = SlotDecoder(ops=FakeOps(), codec=ReferenceCodec())
    pool, ops, entries, device, weights = staged_group(setup, decoder)
    upload = ops.streams["upload"]
    pool.begin_upload()
    pool.stage_file_slices(entries)
    packed = pool.packed_bytes
    ops.enqueue(upload, lambda: device[: packed.numel()].copy_(packed), "copy")
    early = FakeEvent(ops, upload)
    position = early.position
    pool.mark_upload(early)
    ops.run(upload, position)
    assert not same_bits(weights["a"], tensors["a"])


def test_staging_with_the_cpu_decoder_stages_raw_bytes_and_expands_nothing(setup, unpinned):
    *_, tensors = setup
    pool, ops, entries, device, weights = staged_group(setup, None)
    staged, _ = ddo_upload(pool, ops, entries, device)
    assert not any(step[0] == "decode" for step in ops.log)
    for (name, weight), view in zip(weights.items(), staged):
        assert same_bits(weight, tensors[name]) and same_bits(view, tensors[name]), name


def test_a_group_larger_than_the_slot_fails_as_ddo_does(setup, unpinned):
    pool, _, entries, _, _ = staged_group(setup, None, slot_bytes=4096)
    pool.begin_upload()
    with pytest.raises(RuntimeError, match="Pinned staging buffer is too small: need"):
        pool.stage_file_slices(entries)


def test_the_pool_refuses_to_upload_a_placeholder_from_cpu_memory(setup, unpinned):
    pool, _, entries, _, _ = staged_group(setup, None)
    pool.begin_upload()
    with pytest.raises(DecodeRouteError, match="instead of its checkpoint slice"):
        pool.stage(entries[0][0])
    assert pool.stage(torch.ones(4)).tolist() == [1.0] * 4  # ordinary CPU tensors go through as in DDO


def test_group_destinations_refuse_uncovered_and_misplaced_weights(setup):
    _, module, _, slices, _ = setup
    device = torch.zeros(1 << 14, dtype=torch.uint8)
    a, b = module.a.detach(), module.b.detach()
    at = {"a": device[:3840].view(torch.bfloat16), "b": device[3840:3908].view(torch.bfloat16)}
    lookup = {a.data_ptr(): slices["a"], b.data_ptr(): slices["b"]}
    found = group_destinations([("g", [("a", a), ("b", b)])], at.__getitem__, lambda s: lookup.get(s.data_ptr()))
    (key, flat), = found.items()
    assert key == (a.data_ptr(), b.data_ptr()) and flat.data_ptr() == device.data_ptr() and flat.numel() == 3908
    with pytest.raises(DecodeRouteError, match=r"streams 1 weight\(s\) szformat has no checkpoint slice for \(b\)"):
        group_destinations([("g", [("a", a), ("b", b)])], at.__getitem__,
                           lambda s: lookup.get(s.data_ptr()) if s.data_ptr() == a.data_ptr() else None)
    shifted = {"a": at["a"], "b": device[3844:3912].view(torch.bfloat16)}
    with pytest.raises(DecodeRouteError, match="DDO placed b at byte 3844 of group g, not at 3840"):
        group_destinations([("g", [("a", a), ("b", b)])], shifted.__getitem__, lambda s: lookup[s.data_ptr()])
    small = torch.zeros(1, 17, dtype=torch.bfloat16)  # 34 bytes: the next weight starts on a 2-byte boundary
    odd = {"small": device[:34].view(torch.bfloat16), "a": device[34:3874].view(torch.bfloat16)}
    with pytest.raises(DecodeRouteError, match="a starts at byte 34 of group g, not on a 4-byte boundary"):
        group_destinations([("g", [("small", small), ("a", a)])], odd.__getitem__, lambda s: slices["a"])


# -- the native transport ------------------------------------------------------------------------------------------


class FakeRing:
    """DDO's native host ring: reads file ranges into host slots (at once, on the host, as its reader threads do)."""

    def __init__(self, ops: FakeOps, window_bytes: int, slots: int):
        self.ops = ops
        self.slots = [torch.zeros(window_bytes, dtype=torch.uint8) for _ in range(slots)]
        self.reads: list[tuple[str, int, int]] = []

    def slot_ready(self, slot: int) -> bool:
        return True

    def slot_address(self, slot: int) -> int:
        return self.slots[slot].data_ptr()

    def wait_file_read(self, slot: int) -> None:
        pass

    def read_file_async(self, slot, path, offset, *, size_bytes):
        self.reads.append((Path(path).name, offset, size_bytes))
        data = Path(path).read_bytes()[offset: offset + size_bytes]
        self.slots[slot][:size_bytes].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))


def native_transport(ops: FakeOps, window_bytes: int, slots: int) -> SztNativeShardTransport:
    """DDO's transport without its native constructor (which creates the registered ring): the state it sets."""
    transport = object.__new__(SztNativeShardTransport)
    transport.window_size_bytes, transport.slots, transport.size_bytes = window_bytes, slots, window_bytes * slots
    transport.ring, transport.cache, transport._next_slot, transport._pending = FakeRing(ops, window_bytes, slots), \
        None, 0, {}
    transport.read_seconds = transport.read_bytes = transport.slot_wait_seconds = transport.slot_waits = 0
    return transport


def arena_bindings(setup, arena, names=tuple(Weights.SHAPES)):
    checkpoint, module, _, slices, _ = setup
    bindings, offset = [], 0
    for name in names:
        source = getattr(module, name)
        nbytes = source.numel() * 2
        stable = arena[offset: offset + nbytes].view(torch.bfloat16).view(source.shape)
        bindings.append(model_arena_adapter._TensorBinding(owner=module, parameter_name=name, source=None,
                                                           file_slice=slices[name], stable=stable, offset=offset,
                                                           nbytes=nbytes, label=name))
        offset = -(-(offset + nbytes) // 256) * 256
    return bindings


def test_staged_windows_read_nearby_payloads_in_one_run_and_place_them_on_16_bytes(setup):
    checkpoint = setup[0]
    bindings = arena_bindings(setup, torch.zeros(1 << 15, dtype=torch.uint8))
    windows = list(staged_windows(list(reversed(bindings)), 1 << 20))
    entries = [checkpoint.entries[name] for name in Weights.SHAPES]
    first, last = min(e.offset for e in entries), max(e.offset + e.length for e in entries)
    assert [(w.file_offset, w.size_bytes, w.arena_offset) for w in windows] == [(first, last - first, 0)]
    assert [b.label for b in windows[0].completes] == list(Weights.SHAPES)  # in file order
    small = list(staged_windows(bindings, 512))
    assert sum(w.size_bytes for w in small) == last - first and all(w.size_bytes <= 512 for w in small)
    assert sorted(b.label for w in small for b in w.completes) == sorted(Weights.SHAPES)  # each once, at its end
    a, c = bindings[0], bindings[2]
    off_grid = dataclasses.replace(c.file_slice, offset_bytes=c.file_slice.offset_bytes + 8)  # a's run is on 16 B
    shifted = dataclasses.replace(c, file_slice=off_grid)
    apart = list(staged_windows([a, shifted], 1 << 20))
    assert len(apart) == 2 and all(w.arena_offset % 16 == 0 for w in apart)
    assert [b.label for w in apart for b in w.completes] == [a.label, c.label]


@pytest.mark.parametrize("window_bytes, slots", [(1 << 16, 4), (512, 3), (1024, 2)])
def test_native_upload_moves_stored_bytes_and_decodes_each_ticket_in_one_batch(setup, window_bytes, slots):
    checkpoint, *_, tensors = setup
    ops = FakeOps()
    upload = ops.streams["upload"]
    transport = native_transport(ops, window_bytes, slots)
    transport.attach(SlotDecoder(ops=ops, codec=ReferenceCodec()))
    arena = torch.full((1 << 15,), 0x33, dtype=torch.uint8)
    bindings = arena_bindings(setup, arena)
    for attempt in range(2):  # the second upload reuses the plans the first described
        arena.fill_(0x33)
        ready = transport.upload_batch(bindings, arena, upload)  # DDO's path: windows, sub-tickets, upload_ticket
        ready.synchronize()  # what the compute stream's wait_event(ready) orders before compute
        for binding in bindings:
            assert same_bits(binding.stable, tensors[binding.parameter_name]), (attempt, binding.parameter_name)
    entries = [checkpoint.entries[name] for name in Weights.SHAPES]
    span = max(e.offset + e.length for e in entries) - min(e.offset for e in entries)
    assert sum(size for _, _, size in transport.ring.reads) == 2 * span == transport.copied_bytes  # stored + padding
    tickets = -(-(-(-span // window_bytes)) // slots)
    completing = [plan for plan in transport._plans.values() if plan.batch or plan.copies]
    # one batched decode per ticket that completes a weight (the raw-stored d is copied by it); the staging buffer is
    # filled only in stream order, so a weight decoded before its last window arrived, or a slot read again before
    # the DMA out of it ran, would give wrong bits above
    assert sum(step[0] == "decode" for step in ops.log) == 2 * len(completing) <= 2 * tickets
    assert sum(len(plan.batch) for plan in completing) == 3 and sum(len(plan.copies) for plan in completing) == 1
    assert isinstance(ready, FakeEvent) and ready.position == len(upload.queue)  # the token covers all of it


def test_native_waits_for_the_dma_out_of_a_slot_before_reading_into_it_again(setup):
    ops = FakeOps()
    transport = native_transport(ops, 512, 2)
    transport.attach(SlotDecoder(ops=ops, codec=ReferenceCodec()))
    arena = torch.zeros(1 << 15, dtype=torch.uint8)
    transport.upload_batch(arena_bindings(setup, arena), arena, ops.streams["upload"])
    # more windows than slots: every reuse of a slot first ran the queued DMA out of it
    assert ops.streams["upload"].done > 0 and len(transport.ring.reads) > 2


def test_native_dmas_registered_payloads_without_reading_into_the_ring(setup):
    checkpoint, *_, tensors = setup
    ops = FakeOps()
    upload = ops.streams["upload"]
    transport = native_transport(ops, 512, 2)
    entries = [checkpoint.entries[name] for name in Weights.SHAPES]
    pages = FakePages(checkpoint.file("a").path, [(min(e.offset for e in entries),
                                                   max(e.offset + e.length for e in entries))])
    transport.attach(SlotDecoder(ops=ops, codec=ReferenceCodec()), pages)
    arena = torch.full((1 << 15,), 0x33, dtype=torch.uint8)
    bindings = arena_bindings(setup, arena)
    ahead = transport.begin_read(bindings)  # DDO's read-ahead of the next unit
    assert isinstance(ahead, RegisteredTicket) and transport.ticket_active(ahead)
    transport.upload_ticket(ahead, arena, upload).synchronize()
    assert not transport.ticket_active(ahead)
    with pytest.raises(DecodeRouteError, match="no longer active"):
        transport.upload_ticket(ahead, arena, upload)
    for binding in bindings:
        assert same_bits(binding.stable, tensors[binding.parameter_name]), binding.parameter_name
    span = max(e.offset + e.length for e in entries) - min(e.offset for e in entries)
    assert transport.ring.reads == [] and transport.copied_bytes == span  # one run, one copy
    arena.fill_(0x33)
    transport.upload_batch(bindings, arena, upload).synchronize()  # DDO's demand path, the plan reused
    assert all(same_bits(b.stable, tensors[b.parameter_name]) for b in bindings) and len(transport._plans) == 1
    partly = native_transport(ops, 512, 2)  # c's pages not registered: the group goes through the ring
    partly.attach(SlotDecoder(ops=ops, codec=ReferenceCodec()),
                  FakePages(checkpoint.file("a").path, spans_of(checkpoint, ("a", "b", "d"))))
    arena.fill_(0x33)
    assert not partly._all_registered(bindings)
    partly.upload_batch(bindings, arena, upload).synchronize()
    assert partly.ring.reads and all(same_bits(b.stable, tensors[b.parameter_name]) for b in bindings)


def test_native_refuses_to_upload_before_szformat_attached_its_decoder(setup):
    ops = FakeOps()
    transport = native_transport(ops, 4096, 2)
    arena = torch.zeros(1 << 15, dtype=torch.uint8)
    with pytest.raises(DecodeRouteError, match="before szformat attached its decoder"):
        transport.upload_batch(arena_bindings(setup, arena), arena, ops.streams["upload"])


def test_native_refuses_a_slice_szformat_did_not_make(setup):
    ops = FakeOps()
    transport = native_transport(ops, 4096, 2)
    binding, = arena_bindings(setup, torch.zeros(1 << 15, dtype=torch.uint8))[:1]
    binding.file_slice = vmm_weight_store.SafetensorFileSlice(Path("model.safetensors"), 0, binding.nbytes)
    with pytest.raises(DecodeRouteError, match="DDO streams a from a slice szformat did not make"):
        list(transport._window_ranges([binding]))


def test_the_native_fallback_reads_a_decoded_copy(setup):
    checkpoint, *_, tensors = setup
    store = object.__new__(SztArenaWeightStore)
    store.attach(checkpoint)
    binding, = arena_bindings(setup, torch.zeros(1 << 15, dtype=torch.uint8))[:1]
    assert same_bits(store.temporary_source(binding), tensors["a"])
