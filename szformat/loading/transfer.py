"""The transfer loop: host staging -> staging slot -> copy stream -> decode stream, ordered by events.

:class:`TransferLoop` walks a list of transfers through a :class:`StagingRing`. While the device copies and decodes
transfer k, the host already stages transfers k+1 .. k+slots-1 (threaded reads run in the background). Three host
threads keep the steps from waiting on each other's host work: a staging thread submits the reads into each slot
as soon as it is free, a copying thread enqueues each transfer's copy as soon as its reads are done, and the calling
thread enqueues the decodes (an in-place decode costs the host 0.4-1.7 ms on the H200 host, a copy 0.01-0.2 ms),
so neither the readers nor the copy engine wait behind a decode launch. The host refills a slot once its copy has
run; the copy stream writes the slot's device buffer again only after the decode that read it (a device-side wait).
Inside :func:`timeline.recording` the loop notes where its time goes.

The routes that plug into it are :mod:`.device_route` (stored bytes cross, the device expands them) and
:mod:`.host_route` (the CPU decodes, raw bytes cross); the host sides they read from are :mod:`.sources`.
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable, Sequence

import torch

from . import timeline
from .hostio import Staged
from .ops import DeviceOps
from .plan import Transfer
from .ring import Slot, StagingRing

__all__ = ["TransferLoop", "allocate"]

Staging = Callable[[int, Transfer, Slot], Staged]
Copying = Callable[[int, Slot, torch.Tensor], Any]
Expanding = Callable[[int, Slot, Any], None]
_END = object()
"""Put on the staged queue after a failure, so that the copying thread stops waiting for transfers."""


class TransferLoop:
    """Runs transfers through a ring with a copy stream and a decode stream.

    Args:
        ops (`DeviceOps`): streams, events and copies.
        ring (`StagingRing`): the slots; at most ``ring.slots`` transfers are in flight.
        reading (`threading.Event`, *optional*): set once the reads of a run are under way (its first transfer's
            reads submitted).
    """

    def __init__(self, ops: DeviceOps, ring: StagingRing, *, reading: threading.Event | None = None):
        self.ops = ops
        self.ring = ring
        self.reading = reading
        self.copy_stream = ops.new_stream()
        self.decode_stream = ops.new_stream()
        self.side_streams: list[Any] = []
        """Streams of a route's own whose work :meth:`finish` waits for too (work the decode stream does not wait
        for)."""
        self._timeline: timeline.Timeline | None = None

    def run(self, transfers: Sequence[Transfer], stage: Staging, copy: Copying, expand: Expanding, *,
            host_writes: bool, prepare: Callable[[], None] | None = None) -> None:
        """Stage, copy and expand every transfer; returns once all device work is enqueued (see :meth:`finish`).

        ``stage(k, transfer, slot)`` starts making the bytes of ``transfers[k]`` available on the host;
        ``copy(k, slot, host_bytes)`` enqueues their copy and returns the event after which the slot's host buffer
        may be refilled; ``expand(k, slot, copied)`` enqueues what follows the copy (its decode, if any). A route
        that copies into the slot's device buffer claims it in ``copy`` and releases it in ``expand``
        (:meth:`StagingRing.claim_device`).

        Three threads share the work, so that no step waits for another one's host work: a staging thread takes
        each slot as soon as its copy has run and submits the reads into it; a copying thread enqueues each
        transfer's copy as soon as its reads are done, and hands the slot back; this thread enqueues each decode
        (whose launch costs the host far more than a copy's). So neither the readers nor the copy engine wait
        behind decode launches. ``prepare()``, when given, runs on this thread once the others have started and
        before the first ``expand``: what only the expansions need is made while the first reads run.
        """
        ops = self.ops
        self._timeline = record = timeline.current()
        start = ops.record(ops.current_stream())  # destinations may reuse memory the current stream just freed
        ops.wait(self.copy_stream, start)
        ops.wait(self.decode_stream, start)
        if record is not None:
            self._start_device_timing(record, start)
        self.ring.rewind()
        self.ring.provision(len(transfers))
        staged: queue.SimpleQueue = queue.SimpleQueue()
        copied: queue.SimpleQueue = queue.SimpleQueue()
        free = threading.Semaphore(self.ring.slots)  # slots whose copy is enqueued, or never used
        stop = threading.Event()
        workers = [threading.Thread(target=self._stage_all, args=(transfers, stage, host_writes, staged, free, stop),
                                    name="szformat-stage", daemon=True),
                   threading.Thread(target=self._copy_all, args=(len(transfers), copy, staged, copied, free, stop),
                                    name="szformat-copy", daemon=True)]
        for worker in workers:
            worker.start()
        try:
            if prepare is not None:
                began = record.now() if record is not None else 0.0
                prepare()
                if record is not None:
                    record.add("prepare", -1, began, record.now())
            for _ in transfers:
                item = copied.get()
                if isinstance(item, BaseException):
                    raise item
                self._expand(item, expand)
        except BaseException:
            stop.set()
            free.release()  # wake the staging thread if it waits for a slot: it sees ``stop`` and ends
            self.ring.cancel()  # wake the copying thread if it waits for a decode this thread will not enqueue
            workers[0].join()
            staged.put(_END)  # wake the copying thread if it waits for a staged transfer
            workers[1].join()
            while not staged.empty():  # transfers staged but never copied: wait for their reads
                item = staged.get()
                if isinstance(item, tuple):
                    item[2].settle()
            self.finish()
            self.ring.clear()  # nothing is in flight any more: the next run may use every slot
            raise
        for worker in workers:
            worker.join()

    def _stage_all(self, transfers: Sequence[Transfer], stage: Staging, host_writes: bool, staged: queue.SimpleQueue,
                   free: threading.Semaphore, stop: threading.Event) -> None:
        """The staging thread: for each transfer in order, a free slot, then its reads; hands each on to the copying
        thread (or the exception that stopped it)."""
        record = self._timeline
        try:
            for k, transfer in enumerate(transfers):
                began = record.now() if record is not None else 0.0
                free.acquire()
                if stop.is_set():
                    return
                slot = self.ring.acquire(host_writes=host_writes)  # the copy stream's wait is left to the copy
                if record is not None:
                    record.add("wait_slot", k, began, record.now())
                    began = record.now()
                item = (k, slot, stage(k, transfer, slot))
                if k == 0 and self.reading is not None:
                    self.reading.set()
                if record is not None:
                    record.add("stage", k, began, record.now(), transfer.nbytes)
                staged.put(item)
        except BaseException as e:  # the calling thread re-raises it
            staged.put(e)

    def _copy_all(self, count: int, copy: Copying, staged: queue.SimpleQueue, copied: queue.SimpleQueue,
                  free: threading.Semaphore, stop: threading.Event) -> None:
        """The copying thread: for each staged transfer in order, a wait for its reads, then its copy; hands the slot
        back to the staging thread and the transfer on to the calling thread (or the exception that stopped it).
        Once ``stop`` is set it only waits for reads."""
        record = self._timeline
        try:
            for _ in range(count):
                item = staged.get()
                if item is _END or isinstance(item, BaseException):
                    if item is not _END:
                        copied.put(item)
                    return
                k, slot, host = item
                if stop.is_set():
                    host.settle()
                    return
                began = record.now() if record is not None else 0.0
                try:
                    host_bytes = host.result()
                except BaseException:
                    host.settle()  # the other reads into this slot may still be running
                    raise
                if record is not None:
                    landed = record.now()
                    record.add("wait_reads", k, began, landed)
                host_free = copy(k, slot, host_bytes)
                self.ring.release(slot, host_free)
                free.release()
                if record is not None:
                    record.add("land", k, landed, record.now(), host_bytes.numel())
                copied.put((k, slot, host_free))
        except BaseException as e:
            copied.put(e)

    def _expand(self, item: tuple[int, Slot, Any], expand: Expanding) -> None:
        k, slot, host_free = item
        record = self._timeline
        began = record.now() if record is not None else 0.0
        expand(k, slot, host_free)
        if record is not None:
            record.add("expand", k, began, record.now())

    def enqueue(self, stream: Any, work: Callable[[], None], label: str, k: int, nbytes: int = 0) -> None:
        """``ops.enqueue``, between two timing events when a timeline is recorded and the device can time."""
        record, ops = self._timeline, self.ops
        timing = getattr(ops, "timing_event", None)
        if record is None or timing is None:
            ops.enqueue(stream, work, label)
            return
        begin = timing(stream)
        called = record.now()
        ops.enqueue(stream, work, label)
        record.add(f"{label}_call", k, called, record.now())
        record.add_device(label, k, begin, timing(stream), nbytes)

    def _start_device_timing(self, record: timeline.Timeline, start: Any) -> None:
        """Anchor device times to host times: wait until the device is idle, then mark it."""
        timing = getattr(self.ops, "timing_event", None)
        if timing is None or record.has_device_origin:
            return
        self.ops.synchronize(start)
        self.finish()
        origin = timing(self.copy_stream)
        self.ops.synchronize(origin)
        record.device_origin(origin, self.ops.elapsed_seconds)

    def finish(self) -> None:
        """Block until every copy and decode enqueued so far has completed."""
        for stream in (self.copy_stream, self.decode_stream, *self.side_streams):
            self.ops.synchronize(self.ops.record(stream))


ALLOCATION_GRANULE = 512
"""PyTorch's caching allocator rounds every block up to a multiple of this many bytes: what one reserved segment
must hold for a load's allocations to be carved out of it."""


def allocate(ops: DeviceOps, sizes: Sequence[int]) -> list[torch.Tensor]:
    """A device buffer of each size, reserved together first (:meth:`DeviceOps.reserve`)."""
    ops.reserve(sum(-(-size // ALLOCATION_GRANULE) * ALLOCATION_GRANULE for size in sizes))
    return [ops.device_buffer(size) for size in sizes]


