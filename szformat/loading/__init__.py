"""Loading .szt tensors onto a device, and the decode steps offloading runtimes build on.

* :func:`load_to_device` / :class:`DeviceLoader`: what ``load_file(..., device="cuda")`` and
  ``safe_open(..., device="cuda")`` run: mmap -> pinned staging ring (or the page cache registered for DMA) ->
  copy stream -> batched decode on the GPU, overlapped and ordered by events.
* :class:`StagingPoolDecoder`, :func:`stage_entry`, :func:`copy_and_expand`: a pinned staging pool whose entries
  advance by raw size; decode is enqueued after each upload's copies, before the upload is marked done.
* :class:`SlotDecoder`: expands a payload copied into the leading bytes of a raw-sized device slot, in place, on
  the copy's stream (native-transport runtimes).
"""

from ..format.index import checkpoint_shards
from .device_loader import DeviceLoader, StagingConfig, load_to_device
from .slot_decoder import SlotDecoder
from .staging_pool import StagedEntry, StagingPoolDecoder, copy_and_expand, stage_entry

__all__ = ["DeviceLoader", "SlotDecoder", "StagedEntry", "StagingConfig", "StagingPoolDecoder", "checkpoint_shards",
           "copy_and_expand", "load_to_device", "stage_entry"]
