"""The ``accelerate`` route: accelerate's CPU-offload hooks, reading weights from the checkpoint as they run.

``accelerate.cpu_offload`` puts an ``AlignDevicesHook`` on every module that owns parameters: before the module
runs, the hook reads each of its parameters from a ``weights_map`` and places it on the execution device; after, it
sets them back to ``meta``. The weights map is any mapping, so szformat passes :class:`SztWeightsMap`, whose lookups
decode the entry onto the execution device (Triton on the GPU, or the CPU decoder where Triton is absent): nothing
but the compressed file stays in host memory. Buffers are not offloaded (accelerate's default) and are decoded onto
the device once, at install. Loads are synchronous, one module at a time, as accelerate does them.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
from accelerate import cpu_offload
from accelerate.hooks import remove_hook_from_module

from .binding import assign_tensor, snapshot_tensors
from .decoding import CheckpointDecoder
from .handle import OffloadedModel
from .install import Installation
from .placeholders import Placeholders

__all__ = ["SztWeightsMap", "install_accelerate_hooks"]


class SztWeightsMap(Mapping):
    """accelerate's ``weights_map``, served by decoding checkpoint entries onto the device on each lookup.

    Args:
        entries (`Mapping[str, str]`): module tensor name (aliases included) -> checkpoint entry.
        decoder (`CheckpointDecoder`): decodes entries onto the execution device.
        own (`Mapping[str, torch.Tensor]`, *optional*): tensors of the module that the checkpoint does not hold
            (``strict=False``), served as they are.
    """

    def __init__(self, entries: Mapping[str, str], decoder: CheckpointDecoder,
                 own: Mapping[str, torch.Tensor] | None = None):
        self._entries = dict(entries)
        self._decoder = decoder
        self._own = dict(own or {})

    def __getitem__(self, name: str) -> torch.Tensor:
        entry = self._entries.get(name)
        if entry is None:
            return self._own[name]
        return self._decoder.load([entry])[entry]

    def __iter__(self) -> Iterator[str]:
        return iter([*self._entries, *self._own])

    def __len__(self) -> int:
        return len(self._entries) + len(self._own)


def install_accelerate_hooks(installation: Installation) -> OffloadedModel:
    """Apply ``accelerate.cpu_offload`` to the module with a weights map served from the checkpoint."""
    if installation.options:
        raise ValueError(f"the accelerate route takes no engine options, got {', '.join(installation.options)}")
    module, binding, device = installation.module, installation.binding, installation.device
    restore = snapshot_tensors(module, [name for tensor in binding for name in tensor.names])
    placeholders = Placeholders(binding)
    placeholders.install(module, binding)
    decoder = CheckpointDecoder(installation.checkpoint, device, installation.route.decoder)
    try:
        buffers = [tensor for tensor in binding if tensor.is_buffer]
        values = decoder.load(tensor.entry for tensor in buffers)
        for tensor in buffers:  # accelerate moves buffers to the device once; give it their values
            assign_tensor(module, tensor.names, values[tensor.entry])
        entries = {name: tensor.entry for tensor in binding if not tensor.is_buffer for name in tensor.names}
        own = {name: parameter.data for name, parameter in module.named_parameters(remove_duplicate=False)
               if name not in entries}
        cpu_offload(module, execution_device=device, state_dict=SztWeightsMap(entries, decoder, own))
    except BaseException:
        remove_hook_from_module(module, recurse=True)
        decoder.close()
        restore()
        raise

    def release() -> None:
        remove_hook_from_module(module, recurse=True)
        decoder.close()
        placeholders.close()

    setup_bytes = decoder.bytes_moved
    return OffloadedModel(module, installation.route, installation.checkpoint, setup_bytes=setup_bytes,
                          counters=lambda: {"h2d_bytes": decoder.bytes_moved - setup_bytes}, release=release)
