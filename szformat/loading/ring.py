"""A ring of staging slots, handed out in turn, each reused only after the events that released it.

A slot pairs a pinned host buffer (filled by the host) with an optional device buffer (filled by a copy, read by
a decode). The two are free again at different times: the host buffer once its copy has run, the device buffer once
its decode has too. So the host waits only for the copy before refilling a slot, and the stream that will write
the slot's device buffer waits (on the device, not the host) for the decode: at once when :meth:`StagingRing.acquire`
is given that stream, or later through :meth:`StagingRing.order_device_write` (when the thread that acquires slots
is not the one that enqueues their copies). Buffers are allocated when a slot is
first used and each run starts again from the first slot, so loads of fewer transfers than slots pin and allocate
no more than they use.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    """Event after which the slot's previous use is entirely over (its copy, and its decode when it had one)."""
    device_wait: Any = None
    """Event the next device write to the slot must still be ordered after (see ``order_device_write``)."""
    in_use: bool = False


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

    def acquire(self, *, host_writes: bool, stream: Any = None) -> Slot:
        """The next slot, once its previous use is over.

        With ``host_writes`` the host blocks until the slot's host buffer is free; ``stream`` (the one that will
        write the slot on the device) is made to wait for the rest of the previous use, and the host goes on.
        Without ``stream``, call :meth:`order_device_write` before the device writes the slot.
        """
        slot = self._slots[self._next]
        if slot.in_use:
            raise RuntimeError(f"staging slot {slot.index} is acquired again before it was released")
        self._next = (self._next + 1) % len(self._slots)
        pending = slot.device_free
        if host_writes and slot.host_free is not None:
            self.ops.synchronize(slot.host_free)
            self.host_waits += 1
            if pending is slot.host_free:
                pending = None
        slot.device_wait = pending
        if stream is not None:
            self.order_device_write(slot, stream)
        if self.has_host and slot.host is None:
            slot.host = self.ops.host_buffer(self.slot_bytes)
        if self.has_device and slot.device is None:
            slot.device = self.ops.device_buffer(self.slot_bytes)
        slot.in_use = True
        return slot

    def order_device_write(self, slot: Slot, stream: Any) -> None:
        """Make ``stream`` (which will write ``slot`` on the device) wait for the rest of the slot's previous use."""
        if slot.device_wait is not None:
            self.ops.wait(stream, slot.device_wait)
            slot.device_wait = None

    def rewind(self) -> None:
        """Hand out the first slot next, so that a run of few transfers reuses the same few slots (and only those
        are ever allocated); each slot still waits for its own release events."""
        self._next = 0

    def clear(self) -> None:
        """Forget every slot's use (for after a failed run, once the device and the readers are idle)."""
        for slot in self._slots:
            slot.host_free = slot.device_free = slot.device_wait = None
            slot.in_use = False
        self._next = 0

    def release(self, slot: Slot, host_free: Any, device_free: Any = None) -> None:
        """Hand ``slot`` back: its host buffer is reused only after ``host_free``, the slot as a whole only after
        ``device_free`` (by default the same event)."""
        if not slot.in_use:
            raise RuntimeError(f"staging slot {slot.index} is released but was not acquired")
        if slot.device_wait is not None:
            raise RuntimeError(f"staging slot {slot.index} is released, but its device writes were never ordered "
                               "after its previous use")
        slot.host_free = host_free
        slot.device_free = host_free if device_free is None else device_free
        slot.in_use = False
