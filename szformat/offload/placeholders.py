"""CPU storage that holds no weights: stand-ins the offloading runtime can bind, plan and group by address.

Offloading runtimes take a module whose tensors live on the CPU and learn from each tensor's address, size, shape
and dtype where its bytes come from. With a .szt checkpoint those bytes stay compressed in the file, so the module's
tensors only need to *exist*: each becomes a view into one anonymous private mapping whose pages are never written.
An untouched page costs no memory (a read maps the kernel's shared zero page), so a model's worth of placeholders
adds nothing to the process's resident set. ``torch.empty`` would not do: deterministic mode fills it, and the
allocator may hand out pages already resident.
"""

from __future__ import annotations

import mmap
import sys
from collections.abc import Iterable

import torch

from .binding import TensorBinding, assign_tensor

__all__ = ["Placeholders", "PLACEHOLDER_ALIGNMENT"]

PLACEHOLDER_ALIGNMENT = 4096
"""Each placeholder starts on its own page, so no two storages share one and each has a distinct address."""


class Placeholders:
    """One untouched anonymous mapping, cut into a CPU view per bound storage.

    Args:
        bindings (iterable of `TensorBinding`): the storages to stand in for (their dtype and shape are kept).
    """

    def __init__(self, bindings: Iterable[TensorBinding]):
        bindings = list(bindings)
        offsets, cursor = [], 0
        for binding in bindings:
            offsets.append(cursor)
            cursor += -(-_nbytes(binding.tensor) // PLACEHOLDER_ALIGNMENT) * PLACEHOLDER_ALIGNMENT
        self.size = max(cursor, PLACEHOLDER_ALIGNMENT)
        if sys.platform == "win32":
            self._mapping = mmap.mmap(-1, self.size)
        else:
            self._mapping = mmap.mmap(-1, self.size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                                      | getattr(mmap, "MAP_NORESERVE", 0))
        whole = torch.frombuffer(self._mapping, dtype=torch.uint8)
        self._start = whole.data_ptr()
        self.views: dict[str, torch.Tensor] = {}
        """Entry name -> the placeholder of its storage."""
        for binding, offset in zip(bindings, offsets):
            tensor = binding.tensor
            self.views[binding.entry] = whole[offset: offset + _nbytes(tensor)].view(tensor.dtype).view(tensor.shape)

    def install(self, module: torch.nn.Module, bindings: Iterable[TensorBinding]) -> None:
        """Point every name of every binding at its placeholder (tied names stay tied)."""
        for binding in bindings:
            assign_tensor(module, binding.names, self.views[binding.entry])

    def contains(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor``'s bytes lie in the placeholder mapping (it holds no weight values)."""
        if tensor.device.type != "cpu":
            return False
        return self._start <= tensor.data_ptr() < self._start + self.size

    def close(self) -> None:
        """Unmap, once no placeholder view is referenced any more (until then the mapping stays)."""
        self.views.clear()
        try:
            self._mapping.close()
        except BufferError:
            pass  # views still referenced: the mapping goes with the last of them


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
