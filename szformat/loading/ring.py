"""A ring of staging slots, handed out in turn, each reused only after the events that released it.

A slot pairs a pinned host buffer (filled by the host) with an optional device buffer (filled by a copy, read by
a decode). The two are free again at different times, and are handed back by different threads: the host buffer
once its copy has been enqueued (:meth:`StagingRing.release`; the host waits for that copy to run before refilling
it), the device buffer once the decode that reads it has been enqueued too (:meth:`StagingRing.release_device`).
So reads into a slot never wait for a decode's launch: only a copy into the slot's device buffer does (on the host,
until the previous decode is enqueued; then on the device, until it has run), through
:meth:`StagingRing.claim_device`. Buffers are allocated when a slot is first used and each run starts again from
the first slot, so loads of fewer transfers than slots pin and allocate no more than they use.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch

from .ops import DeviceOps

__all__ = ["Slot", "StagingRing"]


@dataclass
class Slot:
    index: int
    host: torch.Tensor | None = None
    device: torch.Tensor | None = None
    host_free: Any = None
    """Event after which the host buffer may be written again (its copy has run)."""
    device_free: Any = None
    """Event after which the device buffer may be written again (the decode that read it has run)."""
    device_released: threading.Event = field(default_factory=threading.Event)
    """Set while no decode of the device buffer is still to be enqueued (then ``device_free`` is final)."""
    in_use: bool = False

    def __post_init__(self) -> None:
        self.device_released.set()


class StagingRing:
    """``slots`` staging slots of ``slot_bytes`` each, reused round robin.

    Args:
        ops (`DeviceOps`): allocates the buffers and waits on the events.
        slots (`int`): number of slots, at least 2, so the fill of one overlaps the drain of another.
        slot_bytes (`int`): size of each slot.
        host (`bool`): give each slot a pinned host buffer.
        device (`bool`): give each slot a device buffer.
    """

    def __init__(self, ops: DeviceOps, slots: int, slot_bytes: int, *, host: bool, device: bool):
        if slots < 2:
            raise ValueError(f"a staging ring needs at least 2 slots to overlap copies with decoding, got {slots}")
        if slot_bytes <= 0:
            raise ValueError(f"slot size must be positive, got {slot_bytes}")
        self.ops = ops
        self.slot_bytes = slot_bytes
        self.has_host = host
        self.has_device = device
        self._slots = [Slot(i) for i in range(slots)]
        self._next = 0
        self.host_waits = 0

    @property
    def slots(self) -> int:
        return len(self._slots)

    def acquire(self, *, host_writes: bool) -> Slot:
        """The next slot; with ``host_writes`` the host first blocks until the slot's host buffer is free (its
        copy has run). Its device buffer is not waited for here: see :meth:`claim_device`."""
        slot = self._slots[self._next]
        if slot.in_use:
            raise RuntimeError(f"staging slot {slot.index} is acquired again before it was released")
        self._next = (self._next + 1) % len(self._slots)
        if host_writes and slot.host_free is not None:
            self.ops.synchronize(slot.host_free)
            self.host_waits += 1
        self._provide(slot)
        slot.in_use = True
        return slot

    def provision(self, transfers: int) -> None:
        """Allocate now, on this thread, the buffers of the slots a run of ``transfers`` transfers will use.

        A run acquires slots on its staging thread, but device memory must come from a thread the caller's CUDA
        context is current on: an allocator plugged into PyTorch through the driver API (DDO's VMM allocator) hands
        a thread that never used CUDA a null pointer, and the first copy into it fails."""
        for slot in self._slots[: min(transfers, len(self._slots))]:
            self._provide(slot)

    def _provide(self, slot: Slot) -> None:
        if self.has_host and slot.host is None:
            slot.host = self.ops.host_buffer(self.slot_bytes)
        if self.has_device and slot.device is None:
            slot.device = self.ops.device_buffer(self.slot_bytes)

    def release(self, slot: Slot, host_free: Any) -> None:
        """Hand ``slot`` back to :meth:`acquire`: its host buffer is reused only after ``host_free``."""
        if not slot.in_use:
            raise RuntimeError(f"staging slot {slot.index} is released but was not acquired")
        slot.host_free = host_free
        slot.in_use = False

    def claim_device(self, slot: Slot, stream: Any) -> None:
        """Before ``stream`` writes the slot's device buffer: wait (on the host) until the decode of its previous
        contents is enqueued, and make ``stream`` wait (on the device) until that decode has run. The claim holds
        until :meth:`release_device`."""
        slot.device_released.wait()
        if slot.device_free is not None:
            self.ops.wait(stream, slot.device_free)
            slot.device_free = None
        slot.device_released.clear()

    def release_device(self, slot: Slot, device_free: Any) -> None:
        """The last reader of the slot's device buffer is enqueued; the buffer is free after ``device_free``."""
        if slot.device_released.is_set():
            raise RuntimeError(f"staging slot {slot.index}'s device buffer is released but was not claimed")
        slot.device_free = device_free
        slot.device_released.set()

    def cancel(self) -> None:
        """Wake every thread waiting in :meth:`claim_device` for a release that a failed run will not make."""
        for slot in self._slots:
            slot.device_released.set()

    def rewind(self) -> None:
        """Hand out the first slot next, so that a run of few transfers reuses the same few slots (and only those
        are ever allocated); each slot still waits for its own release events."""
        self._next = 0

    def clear(self) -> None:
        """Forget every slot's use (for after a failed run, once the device and the readers are idle)."""
        for slot in self._slots:
            slot.host_free = slot.device_free = None
            slot.device_released.set()
            slot.in_use = False
        self._next = 0
