"""What every GPU launcher shares: where kernels may run, streams, alignment checks and the packed codebook.

Importing this module imports Triton; :mod:`szformat.codec.gpu` imports it only when a GPU function is first used.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch

from ..._install import install_hint
from ...errors import DecodeRouteError
from ..codebook import Codebook
from . import interpreting, triton_missing

try:
    import triton
    import triton.language as tl
except ImportError as exc:  # pragma: no cover - exercised only where Triton is absent
    raise DecodeRouteError(f"the GPU codec needs Triton: {install_hint('gpu')}") from exc
_problem = triton_missing()
if _problem is not None:
    raise DecodeRouteError(f"the GPU codec cannot run: {_problem}")

__all__ = ["triton", "tl", "interpreting", "check_device", "check_aligned", "on_stream", "codebook_words",
           "program_slots"]


def check_device(*tensors: torch.Tensor) -> torch.device:
    """The one device all ``tensors`` live on; CUDA unless the Triton interpreter runs the kernels."""
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"tensors must share one device, got {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type != "cuda" and not interpreting():
        raise DecodeRouteError(f"the GPU codec needs CUDA tensors, got a tensor on {device}")
    return device


def check_aligned(tensor: torch.Tensor, alignment: int, what: str) -> None:
    """Kernels read and write whole words; a buffer that does not start on a word boundary is refused, not split."""
    if tensor.data_ptr() % alignment:
        raise ValueError(f"{what} must start at a multiple of {alignment} bytes (address {tensor.data_ptr():#x})")


@contextlib.contextmanager
def on_stream(stream: "torch.cuda.Stream | None", device: torch.device) -> Iterator[None]:
    """Launch on ``stream`` (Triton launches on PyTorch's current stream); ``None`` keeps the current stream."""
    if stream is None or device.type != "cuda":
        yield
    else:
        with torch.cuda.stream(stream):
            yield


def codebook_words(codebook: Codebook) -> tuple[int, int, int, int]:
    """The 16 exponent bytes of ``codebook`` as four little-endian int32 kernel arguments (code c in word c // 4)."""
    words = []
    for i in range(0, 16, 4):
        word = int.from_bytes(bytes(codebook.dec_lut[i: i + 4]), "little")
        words.append(word - (1 << 32) if word >= 1 << 31 else word)
    return tuple(words)  # type: ignore[return-value]


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def program_slots(device: torch.device, per_multiprocessor: int) -> int:
    """How many programs a persistent kernel launches: enough to fill every multiprocessor of ``device``."""
    if device.type != "cuda":
        return 2  # the interpreter runs programs one after another; two still exercise the striding
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _multiprocessors(index) * per_multiprocessor
