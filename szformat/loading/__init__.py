"""Loading .szt tensors onto a device, and the decode steps offloading runtimes build on.

* :func:`load_to_device` / :class:`DeviceLoader`: what ``load_file(..., device="cuda")`` and
  ``safe_open(..., device="cuda")`` run: mmap -> pinned staging ring (or the page cache registered for DMA) ->
  copy stream -> batched decode on the GPU, overlapped and ordered by events.
* :class:`StagingPoolDecoder`, :func:`stage_entry`, :func:`copy_and_expand`: a pinned staging pool whose entries
  advance by raw size; decode is enqueued after each upload's copies, before the upload is marked done.
* :class:`SlotDecoder`: expands a payload copied into the leading bytes of a raw-sized device slot, in place, on
  the copy's stream (native-transport runtimes).
"""

from .._lazy import attributes_on_first_use

_LAZY = {"DeviceLoader": ".device_loader", "StagingConfig": ".device_loader", "load_to_device": ".device_loader",
         "SlotDecoder": ".slot_decoder", "StagedEntry": ".staging_pool", "StagingPoolDecoder": ".staging_pool",
         "copy_and_expand": ".staging_pool", "stage_entry": ".staging_pool", "checkpoint_shards": "..format.index"}
"""Each name's module, imported on first use: a CPU load imports this package's host modules only, not the device
pipeline (its modules cost a fresh process about a third of its first ``load_file``)."""

__all__ = sorted(_LAZY)
__getattr__, __dir__ = attributes_on_first_use(__name__, _LAZY)
