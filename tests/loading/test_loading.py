"""Device loading: plans, the staging ring, the transfer pipeline, the staging-pool and slot decoders.

The device is simulated on the CPU by :class:`FakeOps`: every stream is a queue that runs only when the schedule
allows it, in the order most likely to expose a missing fence (a lazy stream runs its work as late as possible, an
eager one as early as its waits allow), and fresh buffers are filled with poison bytes. A route that decodes before
its copy, refills a slot still being read, or returns before the device is done therefore yields wrong tensors, and
the tests compare every tensor bit for bit with the source. The Triton kernels run under the interpreter.
"""

from __future__ import annotations

import gc
import json
import os
import re
import random
import threading
import time
import weakref
import zlib
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before the kernels are imported

import szformat
from szformat.format.writer import tensor_bytes, write_tensor
from szformat.codec import cpu as cpu_codec
from szformat.codec import gpu as gpu_codec
from szformat.codec.gate import EncodedTensor
from szformat.errors import (ChecksumMismatchError, DecodeRouteError, FormatError, PayloadError, ShardIndexError,
                             TruncatedFileError)
from szformat.format import at_rest
from szformat.format.constants import TORCH_TO_DTYPE
from szformat.format.writer import SztWriter
from szformat.format.reader import SztFile
from szformat.loading import (DeviceLoader, SlotDecoder, StagingConfig, StagingPoolDecoder, checkpoint_shards,
                              copy_and_expand)
from szformat.loading import device_codec, timeline
from szformat.loading import transfer
from szformat.loading.hostio import FileReader, Staged
from szformat.format.index import load_checkpoint
from szformat.loading.device_route import DeviceDecodeRoute
from szformat.loading.host_route import HostDecodeRoute
from szformat.loading.sources import MappedSource, ReadSource
from szformat.loading.transfer import TransferLoop
from szformat.loading import sources
from szformat.loading.plan import Extent, Piece, Transfer, plan_transfers, raw_extents, streamed_piece_bytes
from szformat.loading.ring import StagingRing
from szformat.loading.slot_decoder import Placement
from szformat.loading.stored_crc import StoredCrcCheck

from fakes import FakeEvent, FakeOps, ReferenceCodec, ZstdInflater
from support import write_at_rest


class NoWaitOps(FakeOps):
    """A broken device whose streams ignore waits: the control that shows the fake catches missing fences."""

    def wait(self, stream, event) -> None:
        with self.lock:
            self._note(("wait", stream.index, event))


class FakeMapping:
    """A file "registered" span by span: records the spans, whose registration completes at once."""

    def __init__(self, path):
        self.view = torch.frombuffer(bytearray(path.read_bytes()), dtype=torch.uint8)
        self.spans: list[tuple[int, int]] = []

    def register_async(self, start, stop, pool):
        self.spans.append((start, stop))
        future = Future()
        future.set_result(True)
        return future

    def close(self):
        pass


POLICIES = [(), (1,), (2,), (1, 2), (0, 1, 2)]
"""Eager stream sets: all lazy; copy stream eager; decode stream eager; both; everything (TransferLoop creates the
copy stream first, then the decode stream)."""

# ---------------------------------------------------------------------------------------------------------------
# Checkpoints
# ---------------------------------------------------------------------------------------------------------------


def _bf16_with_escapes(n: int, gen: torch.Generator, escapes: int) -> torch.Tensor:
    x = torch.randn(n, generator=gen).to(torch.bfloat16)
    rare = torch.tensor([float("inf"), float("-inf"), float("nan"), 1e-40, -3e38, 2.0 ** -120], dtype=torch.bfloat16)
    where = torch.randperm(n, generator=gen)[:escapes]
    x[where] = rare[torch.randint(len(rare), (escapes,), generator=gen)]
    return x


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {
        "big.weight": _bf16_with_escapes(9001, gen, 30).reshape(9001, 1),  # larger than a small slot: streams
        "a.bias": torch.randn(385, generator=gen).to(torch.bfloat16),
        "a.weight": _bf16_with_escapes(48 * 33, gen, 8).reshape(48, 33),
        "ids": torch.arange(77, dtype=torch.int64),
        "empty": torch.zeros(0, 4, dtype=torch.bfloat16),
        "scale": torch.tensor(0.5, dtype=torch.bfloat16),
        "f32": torch.randn(3, 5, generator=gen),
        "noisy": torch.randint(-32768, 32767, (301,), generator=gen, dtype=torch.int16).view(torch.bfloat16),
        "c.weight": torch.randn(64, 31, generator=gen).to(torch.bfloat16),
    }


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("ckpt") / "model.szt"
    tensors = _tensors(random.randrange(1 << 30))
    szformat.save_file(tensors, path)
    with SztFile(path) as f:
        encodings = {e.encoding for e in f.entries.values()}
        assert encodings == {"splitzip", "raw"} and any(e.layout and e.layout.n_esc for e in f.entries.values())
    return path, tensors


def _assert_same(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert loaded.keys() == expected.keys()
    for name, t in expected.items():
        got = loaded[name]
        assert got.dtype == t.dtype and got.shape == t.shape, name
        assert torch.equal(got.reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8)), name


def _entries(path):
    file = SztFile(path)
    return file, list(file.entries.values())


# ---------------------------------------------------------------------------------------------------------------
# Plans and the ring
# ---------------------------------------------------------------------------------------------------------------


def test_plan_packs_small_tensors_and_streams_large_ones():
    extents = [Extent(0, 64, 100), Extent(1, 256, 100), Extent(2, 512, 1000), Extent(3, 1600, 50), Extent(4, 1700, 0)]
    plan = plan_transfers(extents, 400)
    assert [(t.start, t.nbytes, t.packed) for t in plan] == [(64, 292, True), (512, 334, False), (846, 334, False),
                                                            (1180, 332, False), (1600, 50, True)]
    assert [(p.item, p.slot_offset) for p in plan[0].pieces] == [(0, 0), (1, 192)]
    assert [(p.offset, p.length, p.last) for t in plan[1:4] for p in t.pieces] == [
        (0, 334, False), (334, 334, False), (668, 332, True)]


def test_large_tensors_stream_in_equal_whole_page_pieces():
    slot = 16 << 20
    assert streamed_piece_bytes(slot + 4096, slot) == (slot // 2 + 4096)  # two halves, not a slot and a sliver
    assert streamed_piece_bytes(3 * slot, slot) == slot
    assert streamed_piece_bytes(10_000, 6_000) == 5_000  # pages would overflow the slot: plain halves
    plan = plan_transfers([Extent(0, 4096, 67_600_000)], 64 << 20)
    assert [t.nbytes for t in plan] == [33_800_192, 33_799_808]


def test_plan_covers_every_byte_once():
    rng = random.Random()
    for _ in range(50):
        cursor, extents = 0, []
        for item in range(rng.randrange(1, 30)):
            cursor += rng.choice([0, 16, 4096])
            extents.append(Extent(item, cursor, rng.choice([0, 1, 7, 100, 5000, 20000])))
            cursor += extents[-1].length
        slot = rng.choice([64, 1000, 4096, 70000])
        covered = {e.item: [] for e in extents}
        for t in plan_transfers(extents, slot):
            assert 0 < t.nbytes <= slot
            for p in t.pieces:
                extent = extents[p.item]
                assert t.start + p.slot_offset == extent.start + p.offset  # the slot holds the line's bytes
                assert p.slot_offset + p.length <= t.nbytes
                covered[p.item].append((p.offset, p.length, p.last))
        for e in extents:
            spans = covered[e.item]
            assert sum(length for _, length, _ in spans) == e.length
            assert [last for *_, last in spans] == [False] * (len(spans) - 1) + [True] * bool(spans)


def test_plan_rejects_overlaps_and_empty_slots():
    with pytest.raises(ValueError, match="inside the previous"):
        plan_transfers([Extent(0, 0, 100), Extent(1, 50, 10)], 1000)
    with pytest.raises(ValueError, match="positive"):
        plan_transfers([], 0)


def test_raw_extents_advance_by_aligned_raw_size():
    assert [(e.start, e.length) for e in raw_extents([10, 0, 64, 65], alignment=64)] == [
        (0, 10), (64, 0), (64, 64), (128, 65)]


def test_ring_reuses_slots_after_their_release_event():
    ops = FakeOps()
    ring = StagingRing(ops, 3, 128, host=True, device=True)
    stream = ops.new_stream()
    first = [ring.acquire(host_writes=True) for _ in range(3)]
    assert [s.index for s in first] == [0, 1, 2] and not any(entry[0] == "sync" for entry in ops.log)
    with pytest.raises(RuntimeError, match="acquired again"):
        ring.acquire(host_writes=True)
    events = []
    for slot in first:
        events.append(ops.record(stream))
        ring.release(slot, events[-1])
    with pytest.raises(RuntimeError, match="not acquired"):
        ring.release(first[0], events[0])
    assert ring.acquire(host_writes=True).index == 0 and ops.log[-1] == ("sync", events[0])
    start = len(ops.log)
    assert ring.acquire(host_writes=False).index == 1 and ops.log[start:] == []
    assert ring.host_waits == 1
    with pytest.raises(ValueError, match="at least 2"):
        StagingRing(ops, 1, 128, host=True, device=False)


def test_ring_host_waits_for_the_copy_and_the_device_for_the_decode():
    """The host refills a slot once its copy has run; the stream that writes its device buffer waits, on the device,
    for the decode that read it, and first, on the host, until that decode has been enqueued."""
    ops = FakeOps()
    ring = StagingRing(ops, 2, 128, host=True, device=True)
    copy_stream, decode_stream = ops.new_stream(), ops.new_stream()
    slot = ring.acquire(host_writes=True)
    ring.claim_device(slot, copy_stream)  # never used: nothing to wait for
    assert not any(step[0] == "wait" for step in ops.log)
    copied = ops.record(copy_stream)
    ring.release(slot, copied)  # the host side is handed back before the decode is enqueued
    ring.release(ring.acquire(host_writes=True), copied)
    start = len(ops.log)
    again = ring.acquire(host_writes=True)
    assert again is slot and ops.log[start:] == [("sync", copied)]
    claimed = threading.Event()
    claimer = threading.Thread(target=lambda: (ring.claim_device(slot, copy_stream), claimed.set()))
    claimer.start()
    assert not claimed.wait(0.05)  # the decode of the previous contents is not enqueued yet
    decoded = ops.record(decode_stream)
    ring.release_device(slot, decoded)
    claimer.join(2)
    assert claimed.is_set() and ops.log[-1] == ("wait", copy_stream.index, decoded)
    with pytest.raises(RuntimeError, match="not claimed"):
        ring.release_device(ring.acquire(host_writes=False), decoded)


def test_ring_cancel_wakes_a_claim_that_no_release_will_end():
    ops = FakeOps()
    ring = StagingRing(ops, 2, 128, host=True, device=True)
    slot = ring.acquire(host_writes=False)
    ring.claim_device(slot, ops.new_stream())
    waiter = threading.Thread(target=ring.claim_device, args=(slot, ops.current_stream()))
    waiter.start()
    ring.cancel()
    waiter.join(2)
    assert not waiter.is_alive()
    ring.clear()
    assert all(s.device_released.is_set() and not s.in_use for s in ring._slots)


def test_ring_allocates_a_slot_when_first_used():
    allocated = []

    class CountingOps(FakeOps):
        def host_buffer(self, nbytes):
            allocated.append(("host", nbytes))
            return super().host_buffer(nbytes)

        def device_buffer(self, nbytes):
            allocated.append(("device", nbytes))
            return super().device_buffer(nbytes)

    ops = CountingOps()
    ring = StagingRing(ops, 4, 256, host=True, device=True)
    assert allocated == []
    slot = ring.acquire(host_writes=True)
    assert allocated == [("host", 256), ("device", 256)] and slot.host.numel() == slot.device.numel() == 256
    for _ in range(3):  # runs of one transfer each start again from the first slot: nothing more is allocated
        ring.release(slot, ops.record(ops.current_stream()))
        ring.rewind()
        slot = ring.acquire(host_writes=True)
        assert slot.index == 0
    assert len(allocated) == 2


def test_a_run_allocates_device_buffers_on_the_calling_thread(checkpoint):
    """Device memory comes from the thread that called the load (an allocator plugged in through the driver API
    serves only threads with a current CUDA context), never from the run's staging or copying threads."""
    path, tensors = checkpoint
    threads = set()

    class ThreadRecordingOps(FakeOps):
        def device_buffer(self, nbytes):
            threads.add(threading.current_thread())
            return super().device_buffer(nbytes)

    staging = StagingConfig(slot_bytes=4096, slots=3, threads=2)
    with DeviceLoader("cpu", staging=staging, ops=ThreadRecordingOps(), codec=ReferenceCodec()) as loader:
        with SztFile(path) as file:
            _assert_same(loader.load(file), tensors)
    assert threads == {threading.current_thread()}


@pytest.mark.parametrize("failing", ["stage", "read", "copy", "decode"])
def test_a_failure_on_any_thread_stops_the_run_and_leaves_the_ring_usable(checkpoint, failing):
    """Submitting reads fails on the staging thread, a read on a reader thread (seen by the copying thread), a copy
    on the copying thread, a decode on the calling thread: each time the run raises it, its threads end, and the
    next run on the same ring loads every tensor."""
    path, tensors = checkpoint
    from concurrent.futures import ThreadPoolExecutor
    failed: list[str] = []

    class FailingOnceSource(ReadSource):
        def stage(self, transfer, slot, **kwargs):
            if failing in ("stage", "read") and transfer.start > 3 * 4096 and not failed:
                failed.append(failing)
                if failing == "stage":
                    raise OSError("the disk went away")
                read = Future()
                read.set_exception(OSError("the disk went away"))
                return Staged(slot.host[: transfer.nbytes], [read])
            return super().stage(transfer, slot, **kwargs)

    class FailingOnceOps(FakeOps):
        def enqueue(self, stream, work, label):
            if label == failing and not failed:
                failed.append(label)
                raise RuntimeError("the device went away")
            super().enqueue(stream, work, label)

    file, entries = _entries(path)
    ops = FailingOnceOps()
    loop = TransferLoop(ops, StagingRing(ops, 2, 4096, host=True, device=True))
    route = DeviceDecodeRoute(loop, ReferenceCodec())
    with ThreadPoolExecutor(2) as pool:
        with pytest.raises((OSError, RuntimeError), match="went away"):
            route.load(entries, FailingOnceSource(FileReader(path, pool, threads=2)))
        assert failed == [failing]
        assert not any(t.name in ("szformat-stage", "szformat-copy") for t in threading.enumerate())
        flat, _ = route.load(entries, ReadSource(FileReader(path, pool, threads=2)))
        loop.finish()
    file.close()
    _assert_same({e.name: raw.view(szformat.format.constants.DTYPES[e.dtype][0]).reshape(e.shape)
                  for raw, e in zip(flat, entries)}, tensors)


# ---------------------------------------------------------------------------------------------------------------
# The transfer pipeline
# ---------------------------------------------------------------------------------------------------------------


def _run_device_route(ops, path, *, slot_bytes, slots, mapped, pool, codec=None):
    file, entries = _entries(path)
    ring = StagingRing(ops, slots, slot_bytes, host=True, device=True)
    loop = TransferLoop(ops, ring)
    if mapped:
        source = MappedSource(FakeMapping(path), pool)
    else:
        source = ReadSource(FileReader(path, pool, threads=3))
    flat, _ = DeviceDecodeRoute(loop, codec or ReferenceCodec()).load(entries, source)
    loop.finish()
    source.close()
    loaded = {e.name: raw.view(szformat.format.constants.DTYPES[e.dtype][0]).reshape(e.shape)
              for raw, e in zip(flat, entries)}
    file.close()
    return loaded, ring


@pytest.mark.parametrize("eager", POLICIES)
@pytest.mark.parametrize("mapped", [False, True])
def test_device_route_is_exact_under_every_stream_order(checkpoint, eager, mapped):
    path, tensors = checkpoint
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(3) as pool:
        for slot_bytes, slots in [(4096, 2), (8192, 3), (1 << 20, 2)]:
            loaded, ring = _run_device_route(FakeOps(eager), path, slot_bytes=slot_bytes, slots=slots,
                                             mapped=mapped, pool=pool)
            _assert_same(loaded, tensors)
            if slot_bytes == 4096 and not mapped:
                assert ring.host_waits > 0  # slots were refilled, each after its release event


def test_fake_device_catches_a_missing_fence(checkpoint):
    """The control: the same route on a device whose streams ignore waits decodes stale (poisoned) slots, which
    gives wrong tensors or escape streams the decoder rejects."""
    path, tensors = checkpoint
    with pytest.raises((AssertionError, ValueError)):
        loaded, _ = _run_device_route(NoWaitOps(eager=(2,)), path, slot_bytes=4096, slots=2, mapped=True, pool=None)
        _assert_same(loaded, tensors)


def test_device_route_orders_each_decode_after_its_copy(checkpoint):
    """Copies and decodes are enqueued from two threads, so the log interleaves them; still, each decode waits on
    the event recorded right after a copy, and each one on a later copy than the decode before it."""
    path, _ = checkpoint
    ops = FakeOps()
    _run_device_route(ops, path, slot_bytes=4096, slots=2, mapped=True, pool=None)
    copy_stream, decode_stream = 1, 2
    after_copy: set[int] = set()  # the copy-stream events recorded by a thread right after it enqueued a copy
    last_step: dict[str, tuple] = {}
    waited: list[FakeEvent] = []
    for i, (step, caller) in enumerate(zip(ops.log, ops.callers)):
        if step[0] == "record" and step[1] == copy_stream and last_step.get(caller, ())[:1] == ("copy",):
            after_copy.add(id(step[2]))
        if step[0] == "decode":
            waits = [s for s in ops.log[:i] if s[0] == "wait" and s[1] == decode_stream]
            assert waits and id(waits[-1][2]) in after_copy
            waited.append(waits[-1][2])
        last_step[caller] = step
    assert waited and all(a.position < b.position for a, b in zip(waited, waited[1:]))


@pytest.mark.parametrize("eager", POLICIES)
def test_host_route_is_exact(checkpoint, eager):
    path, tensors = checkpoint
    from concurrent.futures import ThreadPoolExecutor

    file, entries = _entries(path)
    ops = FakeOps(eager)
    with ThreadPoolExecutor(2) as pool:
        loop = TransferLoop(ops, StagingRing(ops, 2, 4096, host=True, device=False))
        flat = HostDecodeRoute(loop, pool).load(file, entries)
        loop.finish()
    loaded = {e.name: raw.view(szformat.format.constants.DTYPES[e.dtype][0]).reshape(e.shape)
              for raw, e in zip(flat, entries)}
    file.close()
    _assert_same(loaded, tensors)


# ---------------------------------------------------------------------------------------------------------------
# The loader: routes, verification, shards
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["gpu", "cpu"])
def test_loader_loads_all_or_some_tensors(checkpoint, route):
    path, tensors = checkpoint
    staging = StagingConfig(slot_bytes=4096, slots=3, threads=2, transport="staged")
    with DeviceLoader("cpu", route=route, staging=staging, ops=FakeOps((1,)), codec=ReferenceCodec()) as loader:
        with SztFile(path) as file:
            _assert_same(loader.load(file), tensors)
            _assert_same(loader.load(file, ["a.bias", "ids"]), {k: tensors[k] for k in ("a.bias", "ids")})


def test_loader_verifies_stored_bytes(checkpoint, tmp_path):
    path, _ = checkpoint
    bad = tmp_path / "bad.szt"
    data = bytearray(path.read_bytes())
    with SztFile(path) as f:
        data[f.entries["a.weight"].offset + 5] ^= 0x10
    bad.write_bytes(bytes(data))
    staging = StagingConfig(transport="staged")
    with DeviceLoader("cpu", staging=staging, ops=FakeOps(), codec=ReferenceCodec()) as loader, SztFile(bad) as f:
        with pytest.raises(ChecksumMismatchError, match="a.weight"):
            loader.load(f)
    with DeviceLoader("cpu", staging=staging, verify=False, ops=FakeOps(), codec=ReferenceCodec()) as loader:
        with SztFile(bad) as f:
            assert not torch.equal(loader.load(f, ["a.weight"])["a.weight"], torch.zeros(48, 33, dtype=torch.bfloat16))


def _entry(name, offset, data):
    return SimpleNamespace(name=name, offset=offset, length=len(data), crc32=zlib.crc32(data))


def test_stored_crc_check_joins_pieces_in_any_order_and_skips_padding(tmp_path):
    """Two tensors with padding between them, staged in one slot and read as uneven pieces finishing in random
    order: each tensor's CRC comes out right; a flipped byte, or a piece never read, is reported."""
    a, b = os.urandom(10_000), os.urandom(25_000)
    line = a + bytes(240) + b
    entries = [_entry("a", 0, a), _entry("b", 10_240, b)]
    transfer = plan_transfers([Extent(0, 0, len(a)), Extent(1, 10_240, len(b))], 1 << 20)[0]
    slot = torch.frombuffer(bytearray(line), dtype=torch.uint8)
    cuts = sorted(random.sample(range(1, len(line)), 6))
    pieces = list(zip([0] + cuts, cuts + [len(line)]))
    random.shuffle(pieces)
    check = StoredCrcCheck(entries, tmp_path / "f.szt")
    for start, stop in pieces:
        check.add(transfer, start, slot[start:stop])
    check.check()

    slot[10_240 + 99] ^= 1
    check = StoredCrcCheck(entries, tmp_path / "f.szt")
    for start, stop in pieces:
        check.add(transfer, start, slot[start:stop])
    with pytest.raises(ChecksumMismatchError, match="stored bytes") as info:
        check.check()
    assert info.value.tensor == "b"
    check = StoredCrcCheck(entries, tmp_path / "f.szt")
    check.add(transfer, 0, slot[:5000])
    with pytest.raises(RuntimeError, match="not all read"):
        check.check()


def test_verify_rides_along_with_the_reads(checkpoint, tmp_path):
    """Staged reads check each piece on the thread that read it (no second pass: no verify pool), also for a
    tensor streamed through several slots, whose pieces are joined across transfers."""
    path, tensors = checkpoint
    staging = StagingConfig(slot_bytes=4096, slots=3, threads=3, transport="staged")
    with DeviceLoader("cpu", staging=staging, ops=FakeOps((1,)), codec=ReferenceCodec()) as loader:
        with SztFile(path) as f:
            assert f.entries["big.weight"].length > 2 * 4096
            _assert_same(loader.load(f), tensors)
        assert loader._verify_pool is None
    bad = tmp_path / "bad.szt"
    data = bytearray(path.read_bytes())
    with SztFile(path) as f:
        big = f.entries["big.weight"]
    # the last sign+mantissa byte, in a late slot of the streamed tensor: only the CRC can see it (a flip in the
    # escape streams after it could be refused first by the escape checks, a PayloadError)
    data[big.offset + big.layout.off_sm + big.layout.n - 1] ^= 0x01
    bad.write_bytes(bytes(data))
    with DeviceLoader("cpu", staging=staging, ops=FakeOps((1,)), codec=ReferenceCodec()) as loader:
        with SztFile(bad) as f, pytest.raises(ChecksumMismatchError, match="big.weight"):
            loader.load(f)


def test_registered_source_refuses_a_read_hook(checkpoint):
    path, _ = checkpoint
    file, entries = _entries(path)
    transfer = plan_transfers([Extent(0, entries[0].offset, entries[0].length)], 1 << 20)[0]
    with pytest.raises(ValueError, match="not read on the host"):
        MappedSource(FakeMapping(path), None).stage(transfer, None, verify=StoredCrcCheck(entries, path))
    file.close()


def test_copies_decodes_and_slot_waits_each_have_their_thread(checkpoint):
    """Copies are enqueued on the copying thread, decodes on the calling thread, and the host waits for slots on
    the staging thread (``test_slots_come_back_once_copied_not_once_decoded`` shows copies going on while a decode
    launch takes its time)."""
    path, tensors = checkpoint
    from concurrent.futures import ThreadPoolExecutor
    ops = FakeOps()
    file, entries = _entries(path)
    loop = TransferLoop(ops, StagingRing(ops, 3, 4096, host=True, device=True))
    with ThreadPoolExecutor(2) as pool:
        flat, _ = DeviceDecodeRoute(loop, ReferenceCodec()).load(entries, ReadSource(FileReader(path, pool, 2)))
        loop.finish()
    _assert_same({e.name: raw.view(szformat.format.constants.DTYPES[e.dtype][0]).reshape(e.shape)
                  for raw, e in zip(flat, entries)}, tensors)
    file.close()
    callers: dict[str, set[str]] = {}
    for step, caller in zip(ops.log, ops.callers):
        callers.setdefault(step[0], set()).add(caller)
    main = threading.current_thread().name
    assert callers["copy"] == {"szformat-copy"} and callers["decode"] == {main}
    assert "szformat-stage" in callers["sync"]


def test_batch_tables_are_built_once_before_the_first_decode(checkpoint):
    """Every packed transfer's table is described in one call, while the first reads run (and its one copy to the
    device is enqueued on the decode stream ahead of every decode), not as each transfer lands."""
    path, tensors = checkpoint
    calls: list[tuple[int, int]] = []

    class CountingCodec(ReferenceCodec):
        def batch_tables(self, batches, device):
            calls.append((len(batches), sum(1 for step in ops.log if step[0] == "decode")))
            return super().batch_tables(batches, device)

    ops = FakeOps(eager=(2,))
    loaded, _ = _run_device_route(ops, path, slot_bytes=4096, slots=2, mapped=True, pool=None,
                                  codec=CountingCodec())
    _assert_same(loaded, tensors)
    assert len(calls) == 1 and calls[0][0] > 1 and calls[0][1] == 0
    decodes = [i for i, step in enumerate(ops.log) if step[0] == "decode"]
    assert ops.log.index(("tables", 2)) < decodes[0]


def test_slots_come_back_once_copied_not_once_decoded():
    """A transfer that takes nothing from its slot's device buffer hands the slot back when its copy is enqueued: here
    the first expand returns only once three more transfers went through a ring of two slots."""
    ops = FakeOps()
    loop = TransferLoop(ops, StagingRing(ops, 2, 4096, host=True, device=True))
    copies: list[int] = []
    waited: list[bool] = []

    def copy(k, slot, host):
        copies.append(k)
        return ops.record(loop.copy_stream)

    def expand(k, slot, copied):
        if k == 0:
            deadline = time.monotonic() + 2
            while len(copies) < 4 and time.monotonic() < deadline:
                time.sleep(0.001)
            waited.append(len(copies) >= 4)

    loop.run([SimpleNamespace(nbytes=4096)] * 5, lambda k, t, slot: Staged(slot.host), copy, expand,
             host_writes=True)
    assert waited == [True] and copies == [0, 1, 2, 3, 4]


def test_prepare_runs_while_the_first_reads_do_and_before_the_first_expand():
    """What only the expansions need is made once the staging thread has begun reading (the reads do not wait for
    it), before the first expand; when it fails, the run stops and raises it, its threads ended."""
    ops = FakeOps()
    loop = TransferLoop(ops, StagingRing(ops, 2, 4096, host=True, device=True))
    staged: list[int] = []
    events: list[str] = []

    def stage(k, transfer, slot):
        staged.append(k)
        return Staged(slot.host)

    def prepare():
        deadline = time.monotonic() + 2
        while not staged and time.monotonic() < deadline:
            time.sleep(0.001)
        events.append(f"prepared with {len(staged)} staged")

    loop.run([SimpleNamespace(nbytes=4096)] * 3, stage, lambda k, slot, host: ops.record(loop.copy_stream),
             lambda k, slot, copied: events.append(f"expand {k}"), host_writes=True, prepare=prepare)
    assert events[0] != "prepared with 0 staged" and events[0].startswith("prepared")
    assert events[1:] == ["expand 0", "expand 1", "expand 2"]

    def failing():
        raise RuntimeError("no room for the payload buffers")

    before = threading.active_count()
    with pytest.raises(RuntimeError, match="no room"):
        loop.run([SimpleNamespace(nbytes=4096)] * 3, stage, lambda k, slot, host: ops.record(loop.copy_stream),
                 lambda k, slot, copied: events.append(f"expand {k}"), host_writes=True, prepare=failing)
    assert threading.active_count() == before and events[-1] == "expand 2"


def test_an_interrupted_run_waits_for_the_reads_already_staged(monkeypatch):
    """Reads in flight write into the ring's host slots: a run that stops must wait for them before the ring is
    handed back, even when it stops while waiting for the next staged transfer."""
    import queue

    class InterruptedQueue(queue.SimpleQueue):
        interrupted = False

        def get(self, *args, **kwargs):
            if self.interrupted:
                return super().get(*args, **kwargs)
            while self.empty():  # interrupted once a transfer is staged, with its read still running
                time.sleep(0.001)
            self.interrupted = True
            raise KeyboardInterrupt

    reads: list[Future] = []

    def stage(k, transfer, slot):
        read = Future()
        threading.Timer(0.2, read.set_result, (None,)).start()
        reads.append(read)
        return Staged(slot.host[: transfer.nbytes], [read])

    monkeypatch.setattr(transfer.queue, "SimpleQueue", InterruptedQueue)
    ops = FakeOps()
    loop = TransferLoop(ops, StagingRing(ops, 2, 4096, host=True, device=True))
    with pytest.raises(KeyboardInterrupt):
        loop.run([SimpleNamespace(nbytes=4096)] * 2, stage, lambda k, slot, host: None,
                 lambda k, slot, copied: None, host_writes=True)
    assert reads and all(read.done() for read in reads)


class TimingOps(FakeOps):
    """Fake streams whose timing events stamp the host clock when the stream reaches them."""

    def timing_event(self, stream):
        stamp = {}
        self.enqueue(stream, lambda: stamp.setdefault("at", time.perf_counter()), "timing")
        event = self.record(stream)
        event.stamp = stamp
        return event

    def elapsed_seconds(self, begin, end):
        return end.stamp["at"] - begin.stamp["at"]


@pytest.mark.parametrize("verify", [False, True])
def test_timeline_records_every_step_of_every_transfer(checkpoint, verify):
    path, tensors = checkpoint
    staging = StagingConfig(slot_bytes=4096, slots=2, threads=2, transport="staged")
    with DeviceLoader("cpu", staging=staging, verify=verify, ops=TimingOps(), codec=ReferenceCodec()) as loader:
        with SztFile(path) as f, timeline.recording() as record:
            _assert_same(loader.load(f), tensors)
        stored = sum(e.length for e in f.entries.values())
    assert timeline.current() is None
    spans = record.spans()
    transfers = {s.k for s in spans if s.what == "stage"}
    assert len(transfers) > 2 and all(k >= 0 for k in transfers)
    for what in ("wait_slot", "stage", "wait_reads", "land", "expand", "read"):
        assert {s.k for s in spans if s.what == what} == transfers, what
    read = sum(s.nbytes for s in spans if s.what == "read")
    assert read == stored  # every payload starts a page, so 4 KiB slots hold one each: no padding is read
    copies = [s for s in spans if s.lane == "device:copy"]
    assert {s.k for s in copies} == transfers and sum(s.nbytes for s in copies) == read
    assert {s.k for s in spans if s.lane == "device:decode"} <= transfers
    assert any(s.what == "crc" for s in spans) == verify
    assert all(s.start <= s.end for s in spans)
    summary = record.summary()
    assert summary["read_thread_ms"] >= summary["read_busy_ms"] > 0
    assert {"wall_ms", "wait_slot_ms", "wait_reads_ms", "land_ms", "expand_ms", "allocate_ms", "copy_busy_ms",
            "copy_call_ms", "decode_call_ms"} <= summary.keys()
    (prepared,) = [s for s in spans if s.what == "prepare"]  # on the calling thread, before the first expand
    assert prepared.lane == "MainThread" and prepared.end <= min(s.start for s in spans if s.what == "expand")
    assert summary["prepare_ms"] == pytest.approx(1e3 * (prepared.end - prepared.start))


def test_timeline_summary_covers_every_kind_of_device_work():
    """Each kind of device work the loop enqueues (copies, inflations, decodes, and any added later) gets its
    ``<kind>_call_ms`` host time and its ``<kind>_busy_ms`` device time, without a list of kinds to keep up."""
    record = timeline.Timeline()
    record.device_origin(0.0, lambda a, b: b - a)
    for k, kind in enumerate(("copy", "inflate", "decode", "join")):
        record.add(f"{kind}_call", k, 0.001 * k, 0.001 * k + 0.0005)
        record.add_device(kind, k, 0.01 * k, 0.01 * k + 0.004, nbytes=1000)
    summary = record.summary()
    for kind in ("copy", "inflate", "decode", "join"):
        assert summary[f"{kind}_call_ms"] == pytest.approx(0.5) and summary[f"{kind}_busy_ms"] == pytest.approx(4)


def test_sharded_checkpoints_load_through_index_or_folder(tmp_path):
    tensors = _tensors(random.randrange(1 << 30))
    names = sorted(tensors)
    shards = {"model-00001-of-00002.szt": names[:4], "model-00002-of-00002.szt": names[4:]}
    for shard, keys in shards.items():
        szformat.save_file({k: tensors[k] for k in keys}, tmp_path / shard)
    index = tmp_path / "model.szt.index.json"
    index.write_text(json.dumps({"metadata": {}, "weight_map": {k: s for s, keys in shards.items() for k in keys}}))
    assert [shard.path.name for shard in checkpoint_shards(tmp_path)] == sorted(shards)
    for target in (index, tmp_path):
        with DeviceLoader("cpu", staging=StagingConfig(slot_bytes=8192, transport="staged"), ops=FakeOps(),
                          codec=ReferenceCodec()) as loader:
            _assert_same(load_checkpoint(loader.load_shard, target), tensors)

    index.write_text(json.dumps({"weight_map": {names[0]: "model-00002-of-00002.szt"}}))
    with DeviceLoader("cpu", ops=FakeOps(), codec=ReferenceCodec()) as loader:
        with pytest.raises(FormatError, match="does not hold"):
            load_checkpoint(loader.load_shard, index)
    index.write_text(json.dumps({"weight_map": {names[0]: "../elsewhere.szt"}}))
    with pytest.raises(ShardIndexError, match="not a file inside the index's folder"):
        checkpoint_shards(index)
    index.unlink()
    (tmp_path / "dup.szt").write_bytes((tmp_path / "model-00001-of-00002.szt").read_bytes())
    with DeviceLoader("cpu", ops=FakeOps(), codec=ReferenceCodec()) as loader:
        with pytest.raises(FormatError, match="more than one shard"):
            load_checkpoint(loader.load_shard, tmp_path)


def test_device_without_cuda_or_triton_says_what_to_do(monkeypatch):
    if not torch.cuda.is_available():
        with pytest.raises(DecodeRouteError, match="sees no CUDA device"):
            szformat.load_file("missing.szt", device="cuda")
    from szformat.codec import gpu

    def no_triton(name):
        raise DecodeRouteError("the GPU codec needs Triton: pip install 'szformat[gpu]'")

    monkeypatch.setattr(gpu, "__getattr__", no_triton)
    with pytest.raises(DecodeRouteError, match="route='cpu'"):
        DeviceLoader("cpu", route="gpu", ops=FakeOps())
    assert DeviceLoader("cpu", route="cpu", ops=FakeOps()).route == "cpu"
    assert StagingPoolDecoder(4096, ops=FakeOps()).route == "cpu"  # "auto" falls back to the host
    with pytest.raises(DecodeRouteError, match="Triton"):
        StagingPoolDecoder(4096, route="gpu", ops=FakeOps())


def test_a_triton_too_old_for_the_kernels_is_named_before_they_run(monkeypatch):
    """torch 2.4 and 2.5 install Triton 3.0 and 3.1: the device route refuses with that reason and the way around
    it, before a kernel is compiled; the staging pool's "auto" decodes on the host."""
    from szformat.codec import gpu

    old = "Triton 3.0.0 is older than 3.2, the oldest the GPU codec runs on"
    monkeypatch.setattr(gpu, "triton_missing", lambda: old)
    with pytest.raises(DecodeRouteError, match=re.escape(f"cannot use Triton: {old}; or pass route='cpu'")):
        DeviceLoader("cpu", route="gpu", ops=FakeOps())
    assert StagingPoolDecoder(4096, ops=FakeOps()).route == "cpu"


def test_file_reader_reads_in_parallel_pieces_and_refuses_short_files(tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    import szformat.loading.hostio as hostio

    monkeypatch.setattr(hostio, "MIN_READ_PIECE", 4096)
    data = os.urandom(50_000)
    (tmp_path / "f").write_bytes(data)
    with ThreadPoolExecutor(4) as pool:
        reader = FileReader(tmp_path / "f", pool, threads=4)
        out = torch.zeros(40_000, dtype=torch.uint8)
        staged = reader.read_into(1234, out)
        assert len(staged._futures) == 4 and bytes(staged.result().numpy()) == data[1234: 41234]
        with pytest.raises(TruncatedFileError):
            reader.read_into(20_000, torch.zeros(40_000, dtype=torch.uint8))
        reader.close()


def test_file_reader_closes_its_descriptor_when_the_mapping_fails(tmp_path, monkeypatch):
    """Without ``os.preadv`` the reader maps the file, and an empty file cannot be mapped: the descriptor opened
    first must not outlive the failed constructor."""
    (tmp_path / "empty").write_bytes(b"")
    opened, closed = [], []
    real_open, real_close = os.open, os.close
    with monkeypatch.context() as patch:
        patch.delattr(os, "preadv", raising=False)
        patch.setattr(os, "open", lambda *args, **kwargs: opened.append(real_open(*args, **kwargs)) or opened[-1])
        patch.setattr(os, "close", lambda fd: closed.append(fd) or real_close(fd))
        with pytest.raises(ValueError, match="empty file"):
            FileReader(tmp_path / "empty", None, threads=1)
    assert len(opened) == 1 and closed == opened


# ---------------------------------------------------------------------------------------------------------------
# The staging-pool decoder and the slot decoder
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("route", ["gpu", "cpu"])
def test_staging_pool_advances_by_raw_size_and_decodes_before_marking_done(checkpoint, route):
    path, tensors = checkpoint
    ops = FakeOps()
    pool = StagingPoolDecoder(1 << 16, 2, route=route, ops=ops, codec=ReferenceCodec())
    stream = ops.new_stream()
    groups = [["a.bias", "a.weight", "ids", "empty"], ["big.weight", "scale", "f32"], ["noisy", "c.weight"]]
    with SztFile(path) as source:
        for group in groups + groups:  # the second round reuses both slots
            pool.begin_upload()
            staged = [pool.stage(source, name) for name in group]
            offsets = [0]
            for e in staged[:-1]:
                offsets.append(-(-(offsets[-1] + e.raw_length) // 256) * 256)
            assert [e.offset for e in staged] == offsets
            for e in staged:
                entry = source.entry(e.name)
                device_expands = route == "gpu" and entry.encoding == "splitzip"
                assert e.payload_bytes == (entry.length if device_expands else entry.raw_length)
            dest = ops.device_buffer(pool.packed_bytes)
            start = len(ops.log)
            done = pool.upload(dest, stream)
            steps = [s[0] for s in ops.log[start:]]
            expect = ["copy", "decode", "record"] if route == "gpu" else ["copy", "record"]
            assert steps == expect and ops.log[-1][2] is done and all(s[1] == stream.index for s in ops.log[start:])
            ops.synchronize(done)
            for e in staged:
                t = tensors[e.name]
                raw = dest[e.offset: e.offset + e.raw_length]
                assert torch.equal(raw, t.reshape(-1).view(torch.uint8)), e.name
    assert pool._ring.host_waits == 4


def test_staging_pool_host_route_decodes_into_entries_bit_identically(checkpoint):
    path, tensors = checkpoint
    pool = StagingPoolDecoder(1 << 16, route="cpu", ops=FakeOps())
    pool.begin_upload()
    with SztFile(path) as source:
        entry = pool.stage(source, "a.weight")
    host = pool._slot.host[entry.offset: entry.offset + entry.raw_length]
    assert torch.equal(host, tensors["a.weight"].reshape(-1).view(torch.uint8))


def test_staging_pool_refuses_a_group_larger_than_its_slot(checkpoint):
    path, _ = checkpoint
    pool = StagingPoolDecoder(16384, route="gpu", ops=FakeOps(), codec=ReferenceCodec())
    pool.begin_upload()
    with SztFile(path) as source:
        pool.stage(source, "a.weight")
        with pytest.raises(DecodeRouteError, match="too small") as info:
            pool.stage(source, "big.weight")
    assert info.value.tensor == "big.weight"
    with pytest.raises(RuntimeError, match="begin_upload"):
        pool.begin_upload()


def test_a_device_load_reserves_its_destinations_at_once_before_allocating_them(checkpoint):
    path, tensors = checkpoint
    ops = FakeOps()
    staging = StagingConfig(slot_bytes=4096, slots=2, threads=2, transport="staged")
    with DeviceLoader("cpu", staging=staging, ops=ops, codec=ReferenceCodec()) as loader, SztFile(path) as f:
        _assert_same(loader.load(f), tensors)
    raw = sum(t.numel() * t.element_size() for t in tensors.values())
    (reserved, allocated_before), = ops.reserved
    assert allocated_before == 0 and raw <= reserved <= raw + 1024 * len(tensors)


def test_slot_decoder_expands_in_place_and_refuses_small_slots(checkpoint):
    path, tensors = checkpoint
    ops = FakeOps()
    decoder = SlotDecoder(ops=ops, codec=ReferenceCodec())
    stream = ops.new_stream()
    with SztFile(path) as f:
        d = f.descriptor("big.weight")
        slot = ops.device_buffer(d.raw_length)
        ops.enqueue(stream, lambda: slot[: d.length].copy_(f.payload("big.weight")), "copy")
        ready = decoder.expand(slot, d, stream)
        ops.synchronize(ready)
        assert torch.equal(slot, tensors["big.weight"].reshape(-1).view(torch.uint8))
        with pytest.raises(DecodeRouteError, match="larger than its slot") as info:
            decoder.expand(ops.device_buffer(d.length - 1), d, stream)
        assert info.value.tensor == "big.weight" and info.value.path == str(path)
        with pytest.raises(DecodeRouteError, match="does not fit"):
            decoder.expand(ops.device_buffer(d.raw_length - 2), d, stream)
        with pytest.raises(DecodeRouteError, match="multiple of 16"):
            decoder.expand_packed(ops.device_buffer(1 << 16), [(8, d)], stream)


def _scatter_group(f, ops, names):
    """Every entry of ``names`` stored back to back (16-byte aligned) in host bytes, with destinations scattered over
    one device range in reverse order with gaps (and one not on 16 bytes), as an offloading arena places them."""
    host, placements, offset = [], [], 0
    arena = ops.device_buffer(1 << 17)
    arena.fill_(0x5A)
    at = 1 << 16
    for name in names:
        d = f.descriptor(name)
        at = (at - d.raw_length - 256) // 256 * 256 + (4 if name == "a.weight" else 0)
        placements.append(Placement(offset, arena[at: at + d.raw_length], d))
        host.append((offset, f.payload(name).clone()))
        offset = -(-(offset + d.length) // 16) * 16
    return arena, host, placements, offset


def test_slot_decoder_scatters_a_group_out_of_staging(checkpoint):
    path, tensors = checkpoint
    ops = FakeOps()
    decoder = SlotDecoder(ops=ops, codec=ReferenceCodec())
    stream = ops.new_stream()
    names = ["big.weight", "a.weight", "ids", "c.weight"]
    with SztFile(path) as f:
        arena, host, placements, nbytes = _scatter_group(f, ops, names)
        plan = decoder.scatter_plan(placements)
        assert [p.payload.name for p in plan.in_place] == ["a.weight"]  # its range starts 4 bytes past 16
        assert [p.payload.name for p in plan.copies] == ["ids"]  # stored raw
        assert plan.base.data_ptr() == min(p.destination.data_ptr() for p in placements if p not in plan.in_place
                                           and p not in plan.copies)
        for attempt in range(2):  # the plan is reused; the staging buffer too
            arena.fill_(0x5A + attempt)
            decoder.copy_to_staging(host, nbytes, stream)
            ops.synchronize(decoder.expand_scattered(plan, stream))
            written = torch.zeros(arena.numel(), dtype=torch.bool)
            for p in placements:
                assert torch.equal(p.destination, tensors[p.payload.name].reshape(-1).view(torch.uint8)), p
                start = p.destination.data_ptr() - arena.data_ptr()
                written[start: start + p.payload.raw_length] = True
            assert bool((arena[~written] == 0x5A + attempt).all()), "wrote outside the destinations"


def test_slot_decoder_refuses_a_scatter_plan_it_cannot_run(checkpoint):
    path, _ = checkpoint
    ops = FakeOps()
    decoder = SlotDecoder(ops=ops, codec=ReferenceCodec())
    with SztFile(path) as f:
        d = f.descriptor("big.weight")
        arena = ops.device_buffer(4 * d.raw_length)
        with pytest.raises(DecodeRouteError, match="staging offset 8 is not a multiple of 16") as info:
            decoder.scatter_plan([Placement(8, arena[: d.raw_length], d)])
        assert info.value.tensor == "big.weight" and info.value.path == str(path)
        with pytest.raises(DecodeRouteError, match=f"tensor of {d.raw_length} bytes"):
            decoder.scatter_plan([Placement(0, arena[: d.raw_length - 2], d)])
        with pytest.raises(DecodeRouteError, match="destinations of big.weight and big.weight overlap"):
            decoder.scatter_plan([Placement(0, arena[: d.raw_length], d),
                                  Placement(0, arena[256: 256 + d.raw_length], d)])


def test_a_load_announces_when_its_reads_are_under_way(checkpoint, monkeypatch):
    """Inside ``announcing_reads``, a load sets the event right after its first transfer's reads are submitted, not
    before; a block whose thread starts no device load sets it when it ends."""
    from szformat.loading.device_loader import announcing_reads

    path, tensors = checkpoint
    reading = threading.Event()
    seen = []
    real = ReadSource.stage

    def stage(self, *args, **kwargs):
        seen.append(reading.is_set())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(ReadSource, "stage", stage)
    staging = StagingConfig(slot_bytes=4096, slots=2, threads=2)
    with announcing_reads(reading):
        with DeviceLoader("cpu", staging=staging, ops=FakeOps(), codec=ReferenceCodec()) as loader, SztFile(path) as f:
            _assert_same(loader.load(f), tensors)
        assert reading.is_set()
    assert len(seen) > 1 and seen[0] is False and all(seen[1:])
    idle = threading.Event()
    with announcing_reads(idle):
        assert not idle.is_set()
    assert idle.is_set()


# ---------------------------------------------------------------------------------------------------------------
# The Triton kernels, under the interpreter where there is no GPU
# ---------------------------------------------------------------------------------------------------------------


def test_triton_kernels_through_every_component(checkpoint):
    if torch.cuda.is_available():
        pytest.skip("the GPU run (bench/checks/load_gpu.py) covers the kernels on a device")
    if gpu_codec.triton_missing() is not None:
        pytest.skip(gpu_codec.triton_missing())
    path, tensors = checkpoint
    codec = device_codec.triton_codec()
    staging = StagingConfig(slot_bytes=4096, slots=2, threads=2, transport="staged")
    with DeviceLoader("cpu", staging=staging, ops=FakeOps((2,)), codec=codec) as loader, SztFile(path) as f:
        _assert_same(loader.load(f), tensors)
        vectors = Path(__file__).resolve().parents[2] / "spec" / "vectors"
        with SztFile(vectors / "refuse_escape_order.szt") as bad:  # the kernels' own escape checks
            with pytest.raises(PayloadError, match="not strictly ascending"):
                loader.load(bad)

        ops = FakeOps()
        stream = ops.new_stream()
        pool = StagingPoolDecoder(1 << 16, ops=ops, codec=codec)
        pool.begin_upload()
        staged = [pool.stage(f, name) for name in ("a.weight", "ids", "c.weight")]
        dest = ops.device_buffer(pool.packed_bytes)
        ops.synchronize(pool.upload(dest, stream))
        for e in staged:
            assert torch.equal(dest[e.offset: e.offset + e.raw_length], tensors[e.name].reshape(-1).view(torch.uint8))

        d = f.descriptor("a.weight")
        slot = ops.device_buffer(d.raw_length)
        slot[: d.length] = f.payload("a.weight")
        ops.synchronize(SlotDecoder(ops=ops, codec=codec).expand(slot, d, stream))
        assert torch.equal(slot, tensors["a.weight"].reshape(-1).view(torch.uint8))

        arena, host, placements, nbytes = _scatter_group(f, ops, ["big.weight", "a.weight", "ids", "c.weight"])
        decoder = SlotDecoder(ops=ops, codec=codec)
        decoder.copy_to_staging(host, nbytes, stream)
        ops.synchronize(decoder.expand_scattered(decoder.scatter_plan(placements), stream))
        for p in placements:
            assert torch.equal(p.destination, tensors[p.payload.name].reshape(-1).view(torch.uint8)), p.payload.name


def test_copy_and_expand_merges_final_entries_into_one_copy(checkpoint):
    path, tensors = checkpoint
    ops = FakeOps()
    pool = StagingPoolDecoder(1 << 16, route="cpu", ops=ops)
    pool.begin_upload()
    with SztFile(path) as f:
        staged = [pool.stage(f, name) for name in ("a.bias", "ids", "f32")]
    copies = []

    class Dest:  # records the size of each copy into it
        def __getitem__(self, index):
            return SimpleNamespace(copy_=lambda src, non_blocking: copies.append((index.start, src.numel())))

    ops.synchronize(copy_and_expand(pool._slot.host, Dest(), staged, ops.current_stream(), ops=ops))
    assert copies == [(0, staged[-1].offset + staged[-1].raw_length)]


def test_registered_mapping_pins_whole_page_spans_once_and_releases_them(tmp_path):
    import mmap as mmap_module
    from concurrent.futures import ThreadPoolExecutor

    from szformat.loading.hostio import RegisteredMapping

    page = mmap_module.PAGESIZE
    path = tmp_path / "f"
    path.write_bytes(os.urandom(10 * page + 5))
    fd = os.open(path, os.O_RDONLY)
    mapping = mmap_module.mmap(fd, 0, prot=mmap_module.PROT_READ)
    view = torch.frombuffer(mapping, dtype=torch.uint8)
    base, calls = view.data_ptr(), []

    def call(result, *what):
        calls.append(what)
        return result

    cudart = SimpleNamespace(  # a driver that refuses spans longer than four pages
        cudaSetDevice=lambda index: call(0, "device", index),
        cudaHostRegister=lambda ptr, size, flags: call(int(size.value > 4 * page), "register", ptr.value - base,
                                                       size.value, flags),
        cudaHostUnregister=lambda ptr: call(0, "unregister", ptr.value - base),
        cudaGetLastError=lambda: call(0, "clear"))
    registered = RegisteredMapping(path, fd, mapping, view, cudart, 3)
    del view
    with ThreadPoolExecutor(2) as pool:
        first = registered.register_async(100, page + 1, pool)
        assert registered.register_async(0, 2 * page - 7, pool) is first and first.result() is True
        assert registered.register_async(2 * page, 10 * page + 5, pool).result() is False  # refused: pageable copy
    assert calls[:2] == [("device", 3), ("register", 0, 2 * page, 9)]  # read-only | portable
    assert calls[2:] == [("device", 3), ("register", 2 * page, 8 * page + 5, 9), ("clear",)]
    registered.close()
    assert calls[-1] == ("unregister", 0) and sum(c[0] == "unregister" for c in calls) == 1


def test_batch_table_arrays_cross_in_one_packed_buffer():
    """The arrays of every batch table (empty owner lists included, as a batch without escapes has) go to the device
    in one buffer and come back as views equal to the originals, each on a 16-byte boundary."""
    from szformat.loading.device_codec import pack_arrays, unpack_arrays

    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    arrays = [torch.randint(-2**62, 2**62, (3, 12), generator=gen, dtype=torch.int64),
              torch.from_numpy(np.repeat(np.arange(3, dtype=np.int32), [5, 0, 2])),
              torch.from_numpy(np.repeat(np.arange(0, dtype=np.int32), [])),
              torch.zeros(0, 12, dtype=torch.int64),
              torch.arange(7, dtype=torch.int32)]
    packed, offsets = pack_arrays(arrays)
    assert packed.dtype == torch.uint8 and all(offset % 16 == 0 for offset in offsets)
    views = unpack_arrays(packed.clone(), arrays, offsets)
    for view, array in zip(views, arrays):
        assert view.dtype == array.dtype and view.shape == array.shape and torch.equal(view, array)


class FlaggingCodec(ReferenceCodec):
    """A device codec whose escape checks flag every tensor with escapes, valid or not."""

    def decode_batch(self, payloads, table, out, errors=None):
        super().decode_batch(payloads, table, out, errors)
        if errors is not None:
            errors.fill_(1)

    def decode_in_place(self, buffer, layout, codebook, scratch, errors=None):
        super().decode_in_place(buffer, layout, codebook, scratch, errors)
        if errors is not None:
            errors.fill_(1)


@pytest.mark.parametrize("verify", [True, False])
def test_gpu_route_refuses_an_escape_stream_the_device_flags(verify):
    """The device's escape checks decide, CRC-32s on or off; the host names the rule, or says the bytes changed."""
    vectors = Path(__file__).resolve().parents[2] / "spec" / "vectors"
    staging = StagingConfig(slot_bytes=4096, slots=2, threads=2, transport="staged")
    with DeviceLoader("cpu", staging=staging, verify=verify, ops=FakeOps(), codec=ReferenceCodec()) as loader:
        with SztFile(vectors / "alignment_64.szt") as f:
            assert set(loader.load(f)) == {"a", "b", "c"}  # valid escapes (tensor a has two) pass
        with SztFile(vectors / "refuse_escape_order.szt") as f:
            with pytest.raises(PayloadError, match="not strictly ascending") as info:
                loader.load(f)
    assert info.value.tensor == "a" and "refuse_escape_order.szt" in str(info.value)
    with DeviceLoader("cpu", staging=staging, verify=verify, ops=FakeOps(), codec=FlaggingCodec()) as loader:
        with SztFile(vectors / "alignment_64.szt") as f:
            with pytest.raises(PayloadError, match="changed while the file was read") as info:
                loader.load(f)
    assert info.value.tensor == "a"


# ---------------------------------------------------------------------------------------------------------------
# Files stored at rest (1.1): the readers inflate into the slots
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def at_rest_checkpoint(tmp_path_factory):
    """The tensors of ``checkpoint`` plus one spanning many frames, at rest, in frames of the smallest size (the
    int64 ``ids`` as byte planes, format 1.2)."""
    tensors = _tensors(random.randrange(1 << 30))
    tensors["long.weight"] = _bf16_with_escapes(40000, torch.Generator().manual_seed(3), 50).reshape(400, 100)
    path = write_at_rest(tensors, tmp_path_factory.mktemp("at-rest") / "model.szt")
    with SztFile(path) as f:
        assert f.at_rest and max(len(e.segments()) for e in f.entries.values() if e.at_rest) > 4
        assert f.byte_planes
    return path, tensors


@pytest.fixture(scope="module")
def splitzip_at_rest_checkpoint(tmp_path_factory, at_rest_checkpoint):
    """``at_rest_checkpoint`` without its byte planes (format 1.1): what a device inflater takes whole."""
    _, tensors = at_rest_checkpoint
    kept = {name: t for name, t in tensors.items() if name != "ids"}
    path = write_at_rest(kept, tmp_path_factory.mktemp("at-rest-1.1") / "model.szt")
    with SztFile(path) as f:
        assert f.at_rest and not f.byte_planes
    return path, kept


@pytest.mark.parametrize("route", ["gpu", "cpu"])
@pytest.mark.parametrize("slot_bytes", [4096, 1 << 20])
def test_loader_inflates_files_stored_at_rest(at_rest_checkpoint, route, slot_bytes):
    path, tensors = at_rest_checkpoint
    staging = StagingConfig(slot_bytes=slot_bytes, slots=3, threads=2, transport="registered")
    with DeviceLoader("cpu", route=route, staging=staging, ops=FakeOps((1,)), codec=ReferenceCodec()) as loader:
        with SztFile(path) as file:
            _assert_same(loader.load(file), tensors)
            _assert_same(loader.load(file, ["long.weight"]), {"long.weight": tensors["long.weight"]})


def _with_first_frame_corrupt(path: Path, name: str, bad: Path) -> Path:
    """A copy of ``path`` at ``bad`` with one bit flipped inside the first zstd frame of tensor ``name``."""
    data = bytearray(path.read_bytes())
    with SztFile(path) as f:
        entry = f.entries[name]
        data[entry.offset + entry.at_rest.frames[0] // 2] ^= 0x10
    bad.write_bytes(bytes(data))
    return bad


@pytest.mark.parametrize("route", ["gpu", "cpu"])
def test_loader_checks_the_stored_bytes_of_files_at_rest(at_rest_checkpoint, tmp_path, route):
    path, _ = at_rest_checkpoint
    bad = _with_first_frame_corrupt(path, "long.weight", tmp_path / "bad.szt")
    staging = StagingConfig(slot_bytes=1 << 16, slots=2, threads=2)
    # With verify the stored CRC or zstd's frame checksum, whichever runs first; without it, zstd's alone.
    for verify, error in ((True, (ChecksumMismatchError, PayloadError)), (False, PayloadError)):
        with DeviceLoader("cpu", route=route, staging=staging, verify=verify, ops=FakeOps(),
                          codec=ReferenceCodec()) as loader, SztFile(bad) as f:
            with pytest.raises(error, match="long.weight"):
                loader.load(f)


@pytest.fixture(scope="module")
def mixed_at_rest_checkpoint(tmp_path_factory):
    """``at_rest_checkpoint``'s tensors, every other SplitZip one stored as it is in memory (as the writer stores a
    payload the stage would not make smaller)."""
    path = tmp_path_factory.mktemp("mixed") / "model.szt"
    tensors = _tensors(random.randrange(1 << 30))
    tensors["long.weight"] = _bf16_with_escapes(40000, torch.Generator().manual_seed(3), 50).reshape(400, 100)
    with SztWriter(path, at_rest=1, frame_size=4096, small_alignment=16) as writer:
        for i, (name, t) in enumerate(tensors.items()):
            writer.at_rest = 1 if i % 2 == 0 or name == "long.weight" else None
            write_tensor(writer, name, TORCH_TO_DTYPE[t.dtype], t.shape, tensor_bytes(t))
    with SztFile(path) as f:
        forms = {e.at_rest is None for e in f.entries.values() if e.encoding == "splitzip"}
        assert forms == {True, False}
    return path, tensors


@pytest.mark.parametrize("asked", [False, True])
def test_nvcomp_inflates_on_the_device_only_when_asked(monkeypatch, asked):
    """nvCOMP does not validate frames, so a crafted file whose CRC-32s match can fail the CUDA context: the loader
    takes it only with ``StagingConfig(device_inflate=True)``; by default the reader threads' zstd inflates, and
    refuses such frames by name."""
    from szformat.loading import device_loader

    nvcomp = ZstdInflater()
    monkeypatch.setattr(device_loader, "nvcomp_inflater", lambda: nvcomp)
    monkeypatch.setattr(device_loader, "cuda_ops", lambda device: FakeOps())  # CUDA itself, not replaced
    with DeviceLoader("cpu", staging=StagingConfig(device_inflate=asked), codec=ReferenceCodec()) as loader:
        assert loader.inflater is (nvcomp if asked else None)


@pytest.mark.parametrize("slot_bytes", [4096, 1 << 16, 1 << 20])  # long.weight streamed, or packed with others
def test_device_inflates_files_at_rest_whose_crcs_are_on(mixed_at_rest_checkpoint, slot_bytes, monkeypatch):
    """With an inflater, the stored bytes cross as they are and the device inflates them (packed transfers into the
    in-memory payload buffer, with the payloads stored as they are; streamed tensors into scratch), bit-identical,
    ``verify`` or not (the CRC-32s are then checked anyway: see the next test)."""
    path, tensors = mixed_at_rest_checkpoint
    staging = StagingConfig(slot_bytes=slot_bytes, slots=3, threads=2)
    with SztFile(path) as f:
        frames = sum(len(e.at_rest.frames) for e in f.entries.values() if e.at_rest is not None)
    made = []  # the payload buffers each load allocates: gone once it returns
    provide = DeviceDecodeRoute._provide_payload_buffers

    def recorded(self, packed, streamed, lanes):
        provide(self, packed, streamed, lanes)
        made.extend(weakref.ref(b) for b in self._slot_payloads + self._lane_payloads)

    monkeypatch.setattr(DeviceDecodeRoute, "_provide_payload_buffers", recorded)
    for verify in (True, False):
        inflater = ZstdInflater()
        with DeviceLoader("cpu", staging=staging, verify=verify, ops=FakeOps((1,)), codec=ReferenceCodec(),
                          inflater=inflater) as loader, SztFile(path) as f:
            _assert_same(loader.load(f), tensors)
            assert inflater.frames == frames
            _assert_same(loader.load(f, ["long.weight"]), {"long.weight": tensors["long.weight"]})
            assert inflater.released == 2  # after each load, the open loader holds no scratch of it
            gc.collect()
            assert made and all(ref() is None for ref in made)


def test_large_tensors_at_rest_inflate_on_lanes_of_their_own_that_the_load_waits_for(tmp_path):
    """Tensors larger than a slot and stored at rest (byte planes, SplitZip 1.1) are inflated and expanded in turn
    on two streams of their own, each after its own copy, not queued on the decode stream; the load waits for those
    streams (here they run only when waited for), and gives every tensor back bit for bit."""
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    tensors = {f"w{i}": (torch.randn(6000 + 999 * i, generator=gen) * 0.02).to(dtype)
               for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16, torch.float32, torch.bfloat16])}
    path = write_at_rest(tensors, tmp_path / "model.szt")
    ops = FakeOps()  # no stream runs before something waits for it
    with DeviceLoader("cpu", staging=StagingConfig(slot_bytes=4096, slots=3, threads=2), ops=ops,
                      codec=ReferenceCodec(), inflater=ZstdInflater()) as loader, SztFile(path) as f:
        assert all(e.at_rest is not None and e.length > 4096 for e in f.entries.values())
        _assert_same(loader.load(f), tensors)
    inflated_on = [step[1] for step in ops.log if step[0] == "inflate"]
    assert len(inflated_on) == len(tensors) and inflated_on[0] != inflated_on[1]
    assert inflated_on == [inflated_on[i % 2] for i in range(len(tensors))]  # the two lanes in turn
    assert not {step[1] for step in ops.log if step[0] == "decode"} & set(inflated_on)


@pytest.mark.parametrize("verify", [True, False])
@pytest.mark.parametrize("slot_bytes", [4096, 1 << 20])
def test_device_inflation_follows_the_crc_check_and_reports_failed_frames(splitzip_at_rest_checkpoint, tmp_path,
                                                                         slot_bytes, verify):
    """A tensor whose stored bytes fail their CRC-32 is refused before any of its frames reaches the inflater (it
    validates little), even with ``verify=False``; a frame the inflater fails is reported with the tensor's name,
    after the load."""
    path, _ = splitzip_at_rest_checkpoint
    bad = _with_first_frame_corrupt(path, "long.weight", tmp_path / "bad.szt")
    staging = StagingConfig(slot_bytes=slot_bytes, slots=2, threads=2)
    inflater = ZstdInflater()
    with DeviceLoader("cpu", staging=staging, ops=FakeOps(), codec=ReferenceCodec(), inflater=inflater,
                      verify=verify) as loader:
        with SztFile(bad) as f, pytest.raises(ChecksumMismatchError, match="long.weight"):
            loader.load(f, ["long.weight"])
        assert inflater.frames == 0
        assert inflater.released == 1  # a failed load drops its scratch too
        with SztFile(path) as f, pytest.raises(PayloadError, match="did not inflate") as info:
            loader.inflater.fail = True
            loader.load(f, ["long.weight", "a.weight"])
        assert inflater.released == 2
    assert info.value.tensor == "long.weight"  # the first that failed, in the order asked for


@pytest.fixture(scope="module")
def planes_checkpoint(tmp_path_factory):
    """Raw tensors of every element size stored as byte planes in frames of 4096 bytes (the last one short, planes
    compressed and verbatim, both transforms), beside SplitZip tensors at rest."""
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    tensors = {
        "f32.weight": (torch.randn(3001, generator=gen) * 0.02).reshape(3001, 1),  # 3 frames: streams in small slots
        "f16.weight": (torch.randn(40, 53, generator=gen) * 0.1).half(),
        "f64": torch.randn(301, generator=gen, dtype=torch.float64),
        "i32": torch.randint(-5, 5, (999,), generator=gen, dtype=torch.int32),
        "u8": torch.randint(0, 3, (5000,), generator=gen, dtype=torch.uint8),
        "bf16.weight": _bf16_with_escapes(4000, gen, 20).reshape(40, 100),
        "small": torch.randn(3, generator=gen),
    }
    path = write_at_rest(tensors, tmp_path_factory.mktemp("planes") / "model.szt")
    with SztFile(path) as f:
        stages = [e.at_rest for e in f.entries.values() if e.encoding == "raw" and e.at_rest is not None]
        assert {s.itemsize for s in stages} == {1, 2, 4, 8} and {s.transform for s in stages} == {"bytes", "sign_last"}
        lengths = [(length, s.frame_size // s.itemsize) for s in stages for length in s.planes]
        assert any(a < b for a, b in lengths) and any(a == b for a, b in lengths)  # compressed and verbatim planes
    return path, tensors


@pytest.mark.parametrize("slot_bytes", [4096, 1 << 16, 1 << 20])
def test_the_device_inflates_byte_planes_and_joins_them(planes_checkpoint, slot_bytes):
    """A 1.2 file crosses as stored: every compressed plane reaches the inflater and the codec joins the planes
    into elements, streamed or packed, bit-identical to what was written."""
    path, tensors = planes_checkpoint
    with SztFile(path) as f:
        compressed = sum(1 for e in f.entries.values() if e.encoding == "raw" and e.at_rest is not None
                         for seg in e.segments() for length in seg.planes
                         if length < seg.memory_length // len(seg.planes))
        splitzip = sum(len(e.at_rest.frames) for e in f.entries.values() if e.encoding == "splitzip")
    staging = StagingConfig(slot_bytes=slot_bytes, slots=2, threads=2)
    inflater = ZstdInflater()
    with DeviceLoader("cpu", staging=staging, ops=FakeOps(), codec=ReferenceCodec(), inflater=inflater) as loader, \
            SztFile(path) as f:
        _assert_same(loader.load(f), tensors)
        assert inflater.frames == compressed + splitzip
        _assert_same(loader.load(f, ["f32.weight", "small"]), {k: tensors[k] for k in ("f32.weight", "small")})


def test_a_plane_that_fails_to_inflate_on_the_device_is_refused_by_name(planes_checkpoint):
    path, _ = planes_checkpoint
    staging = StagingConfig(slot_bytes=1 << 16, slots=2, threads=2)
    with DeviceLoader("cpu", staging=staging, ops=FakeOps(), codec=ReferenceCodec(),
                      inflater=ZstdInflater(fail=True)) as loader, SztFile(path) as f:
        with pytest.raises(PayloadError, match="did not inflate") as info:
            loader.load(f, ["i32", "f32.weight"])
    assert info.value.tensor == "i32"


@pytest.mark.parametrize("inflater, crcs", [(None, True), (ZstdInflater(), False)], ids=["no inflater", "no crcs"])
def test_the_device_route_refuses_entries_at_rest_without_an_inflater_or_crcs(at_rest_checkpoint, inflater, crcs):
    path, _ = at_rest_checkpoint
    staging = StagingConfig(slot_bytes=1 << 16, slots=2, threads=2)
    with DeviceLoader("cpu", staging=staging, ops=FakeOps(), codec=ReferenceCodec(), inflater=inflater) as loader, \
            SztFile(path) as f:
        entries = list(f.entries.values())
        route = loader._route_for(entries, host=True)
        with pytest.raises(ValueError, match="inflated on the device only with an inflater"):
            route.load(entries, ReadSource(FileReader(path, loader._pool, 2)),
                       verify=StoredCrcCheck(entries, path) if crcs else None)


def _stage_tensor_from(source: sources.InflatingSource, name: str, start: int) -> torch.Tensor:
    """In-memory bytes ``[start, end)`` of tensor ``name``, staged by ``source`` as one transfer."""
    entry = source.memory_entries([source.file.entry(name)])[0]
    piece = Piece(0, 0, start, entry.length - start, last=True)
    transfer = Transfer(entry.offset + start, entry.length - start, (piece,), packed=False)
    slot = SimpleNamespace(host=torch.zeros(entry.length, dtype=torch.uint8))
    return source.stage(transfer, slot).result()


def test_inflating_tasks_are_cut_on_frames_so_none_is_inflated_twice(at_rest_checkpoint, monkeypatch):
    """A transfer starting inside a tensor is cut into tasks at multiples of PIECE_BYTES of its payload (where its
    ``pk`` frames start), not at multiples from the transfer's start, which would cut every frame in two."""
    path, _ = at_rest_checkpoint
    monkeypatch.setattr(sources, "PIECE_BYTES", 8192)  # two frames of 4 KiB per task
    inflated = []
    real = at_rest._inflate_frames
    monkeypatch.setattr(at_rest, "_inflate_frames", lambda stored, run, out, dctx: (
        inflated.extend(seg.memory_length for seg in run), real(stored, run, out, dctx)))
    with SztFile(path) as f, ThreadPoolExecutor(2) as pool:
        entry = f.entry("long.weight")
        start = 100  # inside the first frame
        staged = _stage_tensor_from(sources.InflatingSource(f, pool), "long.weight", start)
        count = len(inflated)
        assert torch.equal(staged, f.memory_payload("long.weight")[start:])
    covered = [s for s in at_rest.segments(entry.layout, entry.at_rest)
               if s.compressed and s.memory + s.memory_length > start]
    assert count == len(covered) == 5


def test_inflating_reads_frames_too_long_for_the_buffer_from_the_mapping(at_rest_checkpoint, monkeypatch):
    path, _ = at_rest_checkpoint
    monkeypatch.setattr(sources, "FRAME_BUFFER_LIMIT", 0)
    with SztFile(path) as f, ThreadPoolExecutor(2) as pool:
        staged = _stage_tensor_from(sources.InflatingSource(f, pool), "long.weight", 0)
        assert torch.equal(staged, f.memory_payload("long.weight"))


def test_inflating_a_file_truncated_after_it_was_opened_raises(at_rest_checkpoint, tmp_path):
    """The stored bytes are read with pread, not through the mapping: a file cut short meanwhile gives an error
    naming it and the tensor, where touching the mapping would kill the process."""
    path = tmp_path / "cut.szt"
    path.write_bytes(at_rest_checkpoint[0].read_bytes())
    with SztFile(path) as f, ThreadPoolExecutor(2) as pool:
        source = sources.InflatingSource(f, pool)
        entry = f.entry("long.weight")
        os.truncate(path, entry.offset + entry.length // 2)
        with pytest.raises(TruncatedFileError, match="long.weight") as info:
            _stage_tensor_from(source, "long.weight", 0)
    assert "cut.szt" in str(info.value)


def test_inflating_checks_each_stored_byte_once_where_transfers_cut_frames(at_rest_checkpoint, monkeypatch):
    """Two transfers cut a frame in two: both inflate it, the CRC-32 of the stored bytes counts it once."""
    path, _ = at_rest_checkpoint
    monkeypatch.setattr(sources, "PIECE_BYTES", 8192)
    with SztFile(path) as f, ThreadPoolExecutor(2) as pool:
        source = sources.InflatingSource(f, pool)
        entry = f.entry("long.weight")
        memory = source.memory_entries([entry])[0]
        check = StoredCrcCheck([entry], f.path)
        staged = []
        for lo, hi in ((0, 5000), (5000, memory.length)):  # 5000: inside the second 4 KiB frame
            transfer = Transfer(memory.offset + lo, hi - lo, (Piece(0, 0, lo, hi - lo, last=hi == memory.length),),
                                packed=False)
            slot = SimpleNamespace(host=torch.zeros(hi - lo, dtype=torch.uint8))
            staged.append(source.stage(transfer, slot, verify=check).result())
        check.check()  # every stored byte once, in order, and the CRC matches
        assert torch.equal(torch.cat(staged), f.memory_payload("long.weight"))


def test_loader_checks_the_verbatim_streams_of_files_at_rest(at_rest_checkpoint, tmp_path):
    """``sm`` is stored verbatim, beyond zstd's checksums: the stored bytes' CRC-32, taken as they are read,
    catches a flipped bit there."""
    path, _ = at_rest_checkpoint
    bad = tmp_path / "bad-sm.szt"
    data = bytearray(path.read_bytes())
    with SztFile(path) as f:
        entry = f.entries["long.weight"]
        verbatim = next(s for s in at_rest.segments(entry.layout, entry.at_rest) if not s.compressed)
        data[entry.offset + verbatim.stored + 7] ^= 0x01
    bad.write_bytes(bytes(data))
    staging = StagingConfig(slot_bytes=1 << 16, slots=2, threads=2)
    with DeviceLoader("cpu", route="gpu", staging=staging, ops=FakeOps(), codec=ReferenceCodec()) as loader, \
            SztFile(bad) as f:
        with pytest.raises(ChecksumMismatchError, match="long.weight"):
            loader.load(f)


@pytest.mark.parametrize("at_rest", [None, 1])
def test_gpu_route_checks_the_escape_streams_of_streamed_tensors(tmp_path, at_rest):
    """A tensor larger than a slot, streamed into its own destination and expanded there, in memory or at rest:
    its escape streams are checked as the device decodes them."""
    g = torch.Generator().manual_seed(4)
    exponent = torch.randint(110, 126, (40000,), generator=g, dtype=torch.int32)  # 16 common exponents
    exponent[torch.randperm(40000, generator=g)[:1500]] = torch.randint(20, 60, (1500,), generator=g,
                                                                        dtype=torch.int32)  # 1,500 escapes
    bits = (torch.randint(0, 2, (40000,), generator=g, dtype=torch.int32) << 15) | (exponent << 7) | 0x35
    x = bits.to(torch.int16).view(torch.bfloat16)  # escape streams past 4 KiB: they go through zstd too
    payload, layout, codebook = cpu_codec.encode(x)
    chunk_id = payload[layout.off_cid: layout.off_lpos].view(torch.int32)
    local_pos = payload[layout.off_lpos: layout.off_lpos + 2 * layout.n_esc].view(torch.int16)
    for stream in (chunk_id, local_pos):  # the first two escapes swapped: out of order
        stream[[0, 1]] = stream[[1, 0]].clone()
    raw = tensor_bytes(x)
    encoded = EncodedTensor("splitzip", payload, raw.numel(), zlib.crc32(raw.numpy()), zlib.crc32(payload.numpy()),
                            layout=layout, codebook=codebook)
    path = tmp_path / "escapes.szt"
    with SztWriter(path, at_rest=at_rest, small_alignment=16) as writer:
        writer.add("w", "BF16", x.shape, encoded)
    staging = StagingConfig(slot_bytes=1 << 16, slots=2, threads=2, transport="staged")
    assert layout.comp_bytes > staging.slot_bytes
    with DeviceLoader("cpu", staging=staging, verify=False, ops=FakeOps(), codec=ReferenceCodec()) as loader:
        with SztFile(path) as f:
            if at_rest:
                assert f.entry("w").at_rest.streams == ("pk", "chunk_id", "local_pos", "esc_val")
            with pytest.raises(PayloadError, match="not strictly ascending") as info:
                loader.load(f)
    assert info.value.tensor == "w"
