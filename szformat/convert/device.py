"""Which codec encodes during a conversion: the CPU reference, or the Triton kernels on a CUDA device.

Both produce the same bytes (the GPU path is tested bit for bit against the CPU one), so the device only changes
the speed. The GPU module is imported only when asked for, so conversion on the CPU needs neither Triton nor CUDA.
"""

from __future__ import annotations

from types import ModuleType

from .._lazy import cpu_codec as cpu
from .._lazy import torch
from ..codec import gpu as gpu_codec
from ..codec.gate import CodecBackend
from ..errors import DecodeRouteError


def codec_for(device: str | torch.device) -> tuple[CodecBackend | ModuleType, torch.device]:
    """The codec backend that encodes on ``device`` (``"cpu"`` or ``"cuda[:N]"``), and the device.

    Raises:
        DecodeRouteError: the device is neither CPU nor CUDA, CUDA is not available, or Triton is not installed or
            too old (:func:`~szformat.codec.gpu.triton_missing`).
    """
    try:
        device = torch.device(device)
    except RuntimeError as e:
        raise DecodeRouteError(f"{device!r} is not a device ({e}); use 'cpu' or 'cuda'") from None
    if device.type == "cpu":
        return cpu, device
    if device.type != "cuda":
        raise DecodeRouteError(f"conversion runs on 'cpu' or 'cuda', not {device.type!r}")
    if not torch.cuda.is_available():
        build = "a CPU-only build" if torch.version.cuda is None else f"built for CUDA {torch.version.cuda}"
        raise DecodeRouteError(f"converting on {device} needs a CUDA GPU, and torch {torch.__version__} "
                               f"({build}) sees none; convert on the CPU instead (same bytes)")
    problem = gpu_codec.triton_missing()
    if problem is not None:
        raise DecodeRouteError(f"converting on {device} needs Triton: {problem}")
    return gpu_codec, device
