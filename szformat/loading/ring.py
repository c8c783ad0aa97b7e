"""A ring of staging slots, handed out in turn, each reused only after the event that released it.

A slot pairs a pinned host buffer (filled by the host) with an optional device buffer (filled by a copy, read by
a decode). Whoever acquires a slot says how it will write it: the host writes need a host wait on the slot's last
release event; device-only use needs just the copy stream to wait on it, so the host runs ahead.
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
    host: torch.Tensor | None
    device: torch.Tensor | None
    release: Any = None
    """Event after which the slot's previous use is over (its copy, and its decode when it had one)."""
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
        self._slots = [Slot(i, ops.host_buffer(slot_bytes) if host else None,
                            ops.device_buffer(slot_bytes) if device else None) for i in range(slots)]
        self._next = 0
        self.host_waits = 0

    @property
    def slots(self) -> int:
        return len(self._slots)

    @property
    def has_host(self) -> bool:
        return self._slots[0].host is not None

    def acquire(self, *, host_writes: bool, stream: Any = None) -> Slot:
        """The next slot, once its previous use is over.

        With ``host_writes`` the host blocks until the slot's release event; otherwise ``stream`` (the one that
        will write the slot) is made to wait on it and the host goes on.
        """
        slot = self._slots[self._next]
        if slot.in_use:
            raise RuntimeError(f"staging slot {slot.index} is acquired again before it was released")
        self._next = (self._next + 1) % len(self._slots)
        if slot.release is not None:
            if host_writes:
                self.ops.synchronize(slot.release)
                self.host_waits += 1
            else:
                if stream is None:
                    raise ValueError("a device-only acquire needs the stream that writes the slot")
                self.ops.wait(stream, slot.release)
        slot.in_use = True
        return slot

    def release(self, slot: Slot, event: Any) -> None:
        """Hand ``slot`` back; it is reused only after ``event``."""
        if not slot.in_use:
            raise RuntimeError(f"staging slot {slot.index} is released but was not acquired")
        slot.release = event
        slot.in_use = False

    def release_events(self) -> list[Any]:
        """The release events of every slot used so far (to wait for all work before the buffers go)."""
        return [slot.release for slot in self._slots if slot.release is not None]
