"""Whole tensors of a checkpoint, decoded onto the device that computes with them.

The installed engines (accelerate's hooks, diffusers' group offloading) ask for a module's tensors each time it
runs, and the DDO routes place, once, the tensors DDO does not stream. Both go through :class:`CheckpointDecoder`:
on a CUDA device it runs szformat's loading pipeline (compressed bytes cross PCIe and the GPU expands them, or the
CPU decodes and raw bytes cross where Triton is absent); on the CPU it runs the reference decoder straight from the
file mapping.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..codec.layout import ENCODING_SPLITZIP
from ..format.header import TensorEntry
from ..format.payloads import decode_entry
from ..format.reader import SztFile
from ..loading.device_loader import DeviceLoader, StagingConfig
from .shards import Checkpoint

__all__ = ["CheckpointDecoder", "decode_on_cpu"]

ENGINE_SLOT_BYTES = 16 << 20
"""Pinned staging per slot for per-module loads: a module's tensors are small, and pinned memory is resident."""


class CheckpointDecoder:
    """Decodes named entries of a checkpoint to ``device``, ready to use on any stream when returned.

    Args:
        checkpoint (`Checkpoint`): the open checkpoint.
        device (`torch.device`): a CUDA device, or the CPU (the reference decoder; used by tests and CPU-only hosts).
        decoder (`str`): ``"triton"`` (expand on the GPU) or ``"cpu"`` (decode on the host, copy raw bytes).
    """

    def __init__(self, checkpoint: Checkpoint, device: torch.device, decoder: str):
        self.checkpoint = checkpoint
        self.device = device
        self.bytes_moved = 0
        """Bytes copied host to device so far: stored bytes with the GPU decoder, raw bytes with the CPU one."""
        self._decoder = decoder
        self._loader = None
        if device.type == "cuda":
            self._loader = DeviceLoader(device, route="gpu" if decoder == "triton" else "cpu", verify=False,
                                        staging=StagingConfig(slot_bytes=ENGINE_SLOT_BYTES, transport="staged"))

    def load(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """Entries ``names``, decoded, by name (shaped and typed as stored)."""
        by_file: dict[int, tuple[SztFile, list[str]]] = {}
        for name in names:
            file = self.checkpoint.file(name)
            by_file.setdefault(id(file), (file, []))[1].append(name)
        loaded: dict[str, torch.Tensor] = {}
        for file, file_names in by_file.values():
            entries = [file.entry(name) for name in file_names]
            if self._loader is None:
                loaded.update((entry.name, decode_on_cpu(file, entry)) for entry in entries)
                continue
            loaded.update(self._loader.load(file, file_names))
            self.bytes_moved += sum(entry.length if self._decoder == "triton" else entry.raw_length
                                    for entry in entries)
        return loaded

    def close(self) -> None:
        if self._loader is not None:
            self._loader.close()
            self._loader = None


def decode_on_cpu(file: SztFile, entry: TensorEntry) -> torch.Tensor:
    """Entry ``entry`` of ``file`` as a new CPU tensor, by the reference decoder, straight from the mapping."""
    out = torch.empty(entry.shape, dtype=entry.torch_dtype(file.path))
    payload = file.memory_payload(entry.name)
    if entry.encoding != ENCODING_SPLITZIP:
        out.view(-1).view(torch.uint8).copy_(payload)
        return out
    decode_entry(file.path, entry, payload, out.view(-1))
    return out
