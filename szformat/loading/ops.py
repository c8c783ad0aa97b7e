"""Every stream, event, copy and buffer a loading route touches, behind one small interface.

The routes never call ``torch.cuda`` themselves: they ask a :class:`DeviceOps` to enqueue work on a stream, record and
wait on events, and allocate buffers. :class:`CudaOps` does it with PyTorch's CUDA streams; a test can pass an
implementation that runs the same schedule on the CPU and checks its ordering (copy before decode, decode before
slot reuse) without a GPU.
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Protocol

import torch

from ..errors import DecodeRouteError

__all__ = ["DeviceOps", "CudaOps", "cuda_ops"]


class DeviceOps(Protocol):
    """The device operations a loading route is built from.

    ``enqueue(stream, work, label, current=None)`` runs ``work`` so that the device work it launches lands on
    ``stream`` in order (with CUDA: inside ``torch.cuda.stream(stream)``); ``label`` names the step for logs and
    tests; ``current``, the stream current on the calling thread where the caller knows it, lets CUDA switch to
    ``stream`` and back with two ``set_stream`` calls: 2-3 us on the H200 host against 20 for the context managers
    (``bench/hook_calls.py``), which a resident group's hooks would pay on every forward.
    """

    device: torch.device

    def new_stream(self) -> Any: ...

    def current_stream(self) -> Any: ...

    def enqueue(self, stream: Any, work: Callable[[], None], label: str, current: Any = None) -> None: ...

    def record(self, stream: Any, into: Any = None) -> Any:
        """An event marking everything enqueued on ``stream`` so far; ``into``, an event this returned before whose
        earlier point nothing will wait on again, may be recorded again and returned instead of a new one (waits
        already enqueued keep the point it marked when they were)."""

    def wait(self, stream: Any, event: Any) -> None:
        """Work enqueued on ``stream`` from now on starts after ``event`` (no host wait)."""

    def synchronize(self, event: Any) -> None:
        """Block the host until ``event`` has completed."""

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 host buffer the device can copy from asynchronously (pinned)."""

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        """A flat uint8 buffer on the device."""

    def reserve(self, nbytes: int) -> None:
        """Prepare for :meth:`device_buffer` calls of ``nbytes`` in all (a hint: nothing is promised)."""


class CudaOps:
    """:class:`DeviceOps` on a CUDA device through PyTorch streams and events.

    Host waits sleep until the device signals (blocking-sync events) instead of spinning, because a spinning host
    thread takes a core from the reader threads that fill the staging slots.
    """

    blocking_sync = True
    """Events the host waits on put it to sleep (``cudaEventBlockingSync``) rather than spin."""

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise ValueError(f"CudaOps needs a CUDA device, got {device}")
        self.device = torch.device("cuda", torch.cuda.current_device() if device.index is None else device.index)
        bind_thread(self.device)  # the loader allocates on the thread that creates it

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def enqueue(self, stream: torch.cuda.Stream, work: Callable[[], None], label: str,
                current: torch.cuda.Stream | None = None) -> None:
        if current is None or torch.cuda.current_device() != self.device.index:  # set_stream also sets the device
            with torch.cuda.device(self.device), torch.cuda.stream(stream):
                work()
            return
        if stream is current:
            work()
            return
        torch.cuda.set_stream(stream)
        try:
            work()
        finally:
            torch.cuda.set_stream(current)

    def record(self, stream: torch.cuda.Stream, into: torch.cuda.Event | None = None) -> torch.cuda.Event:
        event = into if into is not None else torch.cuda.Event(blocking=self.blocking_sync)
        event.record(stream)  # a CUDA wait takes the event's point when it is enqueued, so one event serves again
        return event

    def timing_event(self, stream: torch.cuda.Stream) -> torch.cuda.Event:
        """An event with timing, recorded on ``stream`` (for :mod:`.timeline`)."""
        event = torch.cuda.Event(enable_timing=True)
        event.record(stream)
        return event

    def elapsed_seconds(self, begin: torch.cuda.Event, end: torch.cuda.Event) -> float:
        """Seconds between two completed timing events."""
        return begin.elapsed_time(end) / 1e3

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def synchronize(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def device_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)

    def reserve(self, nbytes: int) -> None:
        """Have PyTorch's caching allocator hold ``nbytes`` in one segment, by allocating and freeing them: the
        buffers allocated next are carved out of it, instead of each asking the driver for memory (a model's
        hundreds of tensors, each a ``cudaMalloc``, cost a load more than its copies). transformers' loader does the
        same. Where the device has no room for one segment that large, the buffers are allocated one by one."""
        try:
            torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except torch.cuda.OutOfMemoryError:
            pass


def cuda_ops(device: str | torch.device) -> CudaOps:
    """:class:`CudaOps` for ``device``, or a :class:`DecodeRouteError` saying why this machine cannot serve it."""
    device = torch.device(device)
    if device.type != "cuda":
        raise DecodeRouteError(f"device {device} is not supported for loading; use 'cpu' or a CUDA device")
    if not torch.cuda.is_available():
        raise DecodeRouteError(f"device {device} was requested, but this PyTorch ({torch.__version__}) sees no CUDA "
                               "device; load to 'cpu' instead")
    if device.index is not None and device.index >= torch.cuda.device_count():
        raise DecodeRouteError(f"device {device} was requested, but only {torch.cuda.device_count()} CUDA "
                               "device(s) are visible")
    return CudaOps(device)


def bind_thread(device: torch.device) -> None:
    """Make ``device``'s primary CUDA context current on this thread.

    PyTorch calls ``cudaSetDevice`` only when the device differs from the thread's current one, so a thread that
    has not used CUDA yet (one that is not where CUDA was first initialized) runs its first allocation without a
    current context. PyTorch's own allocator copes; an allocator plugged in through the driver API (DDO's VMM
    allocator) hands such a thread a null pointer, and the first copy into it fails with "invalid argument".
    """
    torch.cuda.init()  # loads the runtime this looks for
    runtime = cudart()
    if runtime is not None:
        index = torch.device(device).index
        runtime.cudaSetDevice(torch.cuda.current_device() if index is None else index)


_CUDART: Any = False


def cudart() -> ctypes.CDLL | None:
    """The CUDA runtime library this process already uses (the one PyTorch loaded), or ``None``."""
    global _CUDART
    if _CUDART is not False:
        return _CUDART
    candidates: list[str] = []
    try:
        with open("/proc/self/maps") as f:
            candidates += sorted({line.split()[-1] for line in f if "libcudart" in line.split()[-1]})
    except OSError:
        pass
    candidates += ["libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0"]
    _CUDART = None
    for name in candidates:
        try:
            lib = ctypes.CDLL(name)
        except OSError:
            continue
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostRegister.restype = ctypes.c_int
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cudaHostUnregister.restype = ctypes.c_int
        lib.cudaGetLastError.argtypes = []
        lib.cudaGetLastError.restype = ctypes.c_int
        lib.cudaSetDevice.argtypes = [ctypes.c_int]
        lib.cudaSetDevice.restype = ctypes.c_int
        _CUDART = lib
        break
    return _CUDART
