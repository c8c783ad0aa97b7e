"""Can the GPU inflate the at-rest form's ``pk`` frames, bit for bit, and how fast? (nvCOMP's batched zstd)

The at-rest form's GPU load is bound by the reader threads inflating ``pk`` on the host (``bench/RESULTS.md``).
This probe measures the alternative: the same zstd frames (``szformat.format.at_rest.compress_frame``, the
writer's frame size and level) inflated on the device by nvCOMP's batched zstd decoder, called through its C API
(``nvcompBatchedZstdDecompressAsync``) with ctypes, against a pinned host-to-device copy of the same bytes.

The ``pk`` stream is made on the device from N(0, 0.02) BF16 weights: 4-bit ranks of their exponents, two per byte,
high nibble first, as the encoder packs them. Every inflate is compared with the source bytes.

Needs a CUDA device and nvCOMP's library (``pip install nvidia-libnvcomp-cu13``, or ``-cu12`` for a CUDA 12
PyTorch); the library is found in that package or through ``--lib``. Usage::

    python tools/probe_gpu_zstd.py [--pk-mib 1024] [--batches 1024,128,32]
"""

from __future__ import annotations

import argparse
import ctypes
import glob
import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from szformat.format import at_rest

BACKENDS = {"default": 0, "cuda": 2}
"""``nvcompDecompressBackend_t`` values: nvCOMP's choice, and its CUDA implementation."""


class _Options(ctypes.Structure):
    """``nvcompBatchedZstdDecompressOpts_t``: the backend, then 60 reserved bytes that must be zero."""

    _fields_ = [("backend", ctypes.c_int), ("reserved", ctypes.c_char * 60)]


def load_nvcomp(path: str | None) -> ctypes.CDLL:
    """nvCOMP's shared library, with the argument types of the three calls used here."""
    if path is None:
        import nvidia.libnvcomp  # noqa: F401 - the wheel that ships the library

        found = glob.glob(os.path.join(os.path.dirname(nvidia.libnvcomp.__file__), "lib*", "libnvcomp.so.*"))
        if not found:
            raise SystemExit("nvidia.libnvcomp is installed but holds no libnvcomp.so; pass --lib")
        path = found[0]
    lib = ctypes.CDLL(path)
    size, pointer = ctypes.c_size_t, ctypes.c_void_p
    lib.nvcompBatchedZstdDecompressGetTempSize.argtypes = [size, size, _Options, ctypes.POINTER(size), size, pointer]
    lib.nvcompBatchedZstdDecompressAsync.argtypes = [pointer, pointer, pointer, pointer, size, pointer, size, pointer,
                                                     _Options, pointer, pointer]
    for name in ("GetTempSize", "Async"):
        getattr(lib, f"nvcompBatchedZstdDecompress{name}").restype = ctypes.c_int
    return lib


def pk_stream(pairs: int) -> torch.Tensor:
    """``pairs`` bytes of packed exponent codes of N(0, 0.02) BF16 weights, on the host."""
    generator = torch.Generator(device="cuda").manual_seed(0)
    weights = (torch.randn(2 * pairs, device="cuda", generator=generator) * 0.02).to(torch.bfloat16)
    exponent = (weights.view(torch.int16).to(torch.int32) >> 7) & 0xFF
    del weights
    rank = torch.full((256,), 15, dtype=torch.int32, device="cuda")
    rank[torch.bincount(exponent, minlength=256).argsort(descending=True)[:16]] = torch.arange(
        16, dtype=torch.int32, device="cuda")
    codes = rank[exponent].to(torch.uint8)
    return ((codes[0::2] << 4) | codes[1::2]).cpu()


def probe(lib: ctypes.CDLL, pk: torch.Tensor, frames: list[bytes], batch: int, backend: int, reps: int = 5
          ) -> tuple[bool, float, int]:
    """Inflate every frame on the device in calls of ``batch`` frames: (bit-exact, median ms, temp bytes)."""
    frame_size = at_rest.DEFAULT_FRAME_SIZE
    offsets, cursor = [], 0
    for frame in frames:
        offsets.append(cursor)
        cursor += len(frame)
    stored = torch.frombuffer(bytearray(b"".join(frames)), dtype=torch.uint8).cuda()
    out = torch.zeros(pk.numel(), dtype=torch.uint8, device="cuda")
    as_device = lambda values: torch.tensor(values, dtype=torch.int64, device="cuda")  # noqa: E731
    inputs = as_device([stored.data_ptr() + offset for offset in offsets])
    input_bytes = as_device([len(frame) for frame in frames])
    output_bytes = as_device([min(frame_size, pk.numel() - i * frame_size) for i in range(len(frames))])
    outputs = as_device([out.data_ptr() + i * frame_size for i in range(len(frames))])
    written = torch.zeros(len(frames), dtype=torch.int64, device="cuda")
    statuses = torch.full((len(frames),), -1, dtype=torch.int32, device="cuda")
    options = _Options(backend)
    temp_bytes = ctypes.c_size_t()
    if lib.nvcompBatchedZstdDecompressGetTempSize(batch, frame_size, options, ctypes.byref(temp_bytes),
                                                  batch * frame_size, None):
        raise SystemExit("nvcompBatchedZstdDecompressGetTempSize failed")
    temp = torch.empty(max(temp_bytes.value, 1), dtype=torch.uint8, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream

    def inflate() -> None:
        for first in range(0, len(frames), batch):
            count = min(batch, len(frames) - first)
            status = lib.nvcompBatchedZstdDecompressAsync(
                inputs.data_ptr() + 8 * first, input_bytes.data_ptr() + 8 * first,
                output_bytes.data_ptr() + 8 * first, written.data_ptr() + 8 * first, count, temp.data_ptr(),
                temp_bytes.value, outputs.data_ptr() + 8 * first, options, statuses.data_ptr() + 4 * first, stream)
            if status:
                raise SystemExit(f"nvcompBatchedZstdDecompressAsync returned {status}")

    inflate()
    exact = bool(torch.equal(out.cpu(), pk)) and not bool(statuses.any())
    times = []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        inflate()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return exact, statistics.median(times), temp_bytes.value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pk-mib", type=int, default=1024, help="size of the pk stream (raw-equivalent: 4x)")
    parser.add_argument("--batches", default="1024,128,32", help="frames per nvCOMP call")
    parser.add_argument("--lib", help="path of libnvcomp.so (default: the nvidia-libnvcomp wheel's)")
    args = parser.parse_args()
    lib = load_nvcomp(args.lib)
    pk = pk_stream(args.pk_mib << 20)
    view = memoryview(pk.numpy())
    frame_size = at_rest.DEFAULT_FRAME_SIZE
    started = time.perf_counter()
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        frames = list(pool.map(lambda i: at_rest.compress_frame(bytes(view[i: i + frame_size])),
                               range(0, len(view), frame_size)))
    print(f"pk: {args.pk_mib} MiB in {len(frames)} frames of {frame_size >> 10} KiB (level {at_rest.DEFAULT_LEVEL}), "
          f"stored {sum(map(len, frames)) / len(view):.4f} of it, compressed in {time.perf_counter() - started:.2f} s")
    print("| backend | frames per call | bit-exact | ms | GB/s of pk | GB/s raw-equivalent | temp MiB |")
    print("|---|---:|---|---:|---:|---:|---:|")
    for name, backend in BACKENDS.items():
        for batch in (int(b) for b in args.batches.split(",")):
            exact, ms, temp = probe(lib, pk, frames, batch, backend)
            print(f"| {name} | {batch} | {'yes' if exact else 'NO'} | {ms:.1f} | {pk.numel() / ms / 1e6:.1f} | "
                  f"{4 * pk.numel() / ms / 1e6:.1f} | {temp / 2**20:.0f} |")
    pinned = torch.empty(pk.numel(), dtype=torch.uint8, pin_memory=True)
    device = torch.empty(pk.numel(), dtype=torch.uint8, device="cuda")
    times = []
    for _ in range(3):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        device.copy_(pinned, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    ms = statistics.median(times)
    print(f"anchor: pinned host-to-device copy of the pk stream, {ms:.1f} ms ({pk.numel() / ms / 1e6:.1f} GB/s)")


if __name__ == "__main__":
    main()
