"""Can the GPU inflate the at-rest form's ``pk`` frames, bit for bit, and how fast? (nvCOMP's batched zstd)

A GPU load of the at-rest form inflates its frames with nvCOMP when it is installed
(:mod:`szformat.loading.gpu_inflate`); without it the reader threads inflate on the host, and that bounds the load
(``bench/RESULTS.md``). This probe times the inflater the loads use on the writer's own frames
(``szformat.format.at_rest.compress_frame``: its frame size and level), in calls of a given number of frames,
against a pinned host-to-device copy of the same bytes.

The ``pk`` stream is made on the device from N(0, 0.02) BF16 weights: 4-bit ranks of their exponents, two per byte,
high nibble first, as the encoder packs them. Every inflate is compared with the source bytes.

Needs a CUDA device and nvCOMP (``pip install "szformat[nvcomp-cu13]"``, or ``nvcomp-cu12`` for a CUDA 12 PyTorch).
Usage::

    python tools/probe_gpu_zstd.py [--pk-mib 1024] [--batches 1024,128,32]
"""

from __future__ import annotations

import argparse
import os
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from copyrate import median_copy_seconds, pinned_h2d_gbps
from szformat.format import at_rest
from szformat.loading.gpu_inflate import nvcomp_inflater, plan_frames


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


def probe(pk: torch.Tensor, frames: list[bytes], batch: int, reps: int = 5) -> tuple[bool, float]:
    """Inflate every frame on the device in calls of ``batch`` frames: (bit-exact, median ms after one untimed
    round)."""
    inflater = nvcomp_inflater()
    frame_size = at_rest.DEFAULT_FRAME_SIZE
    offsets = [0]
    for frame in frames:
        offsets.append(offsets[-1] + len(frame))
    stored = torch.frombuffer(bytearray(b"".join(frames)), dtype=torch.uint8).cuda()
    out = torch.zeros(pk.numel(), dtype=torch.uint8, device="cuda")
    device = torch.device("cuda")
    calls = plan_frames([[(offsets[i], len(frames[i]), i * frame_size, min(frame_size, pk.numel() - i * frame_size))
                          for i in range(first, min(first + batch, len(frames)))]
                         for first in range(0, len(frames), batch)], device)
    statuses = torch.zeros(len(frames), dtype=torch.int32, device="cuda")

    def inflate() -> None:
        for n, plan in enumerate(calls):
            inflater.inflate(stored, plan, out, statuses[n * batch: n * batch + plan.count])

    seconds = median_copy_seconds(inflate, reps)
    return bool(torch.equal(out.cpu(), pk)) and not bool(statuses.any()), seconds * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pk-mib", type=int, default=1024, help="size of the pk stream (raw-equivalent: 4x)")
    parser.add_argument("--batches", default="1024,128,32", help="frames per nvCOMP call")
    args = parser.parse_args()
    if nvcomp_inflater() is None:
        raise SystemExit("nvCOMP is not installed: pip install 'szformat[nvcomp-cu13]' (or nvcomp-cu12)")
    pk = pk_stream(args.pk_mib << 20)
    view = memoryview(pk.numpy())
    frame_size = at_rest.DEFAULT_FRAME_SIZE
    started = time.perf_counter()
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        frames = list(pool.map(lambda i: at_rest.compress_frame(bytes(view[i: i + frame_size])),
                               range(0, len(view), frame_size)))
    print(f"pk: {args.pk_mib} MiB in {len(frames)} frames of {frame_size >> 10} KiB (level {at_rest.DEFAULT_LEVEL}), "
          f"stored {sum(map(len, frames)) / len(view):.4f} of it, compressed in {time.perf_counter() - started:.2f} s")
    print("| frames per call | bit-exact | ms | GB/s of pk | GB/s raw-equivalent |")
    print("|---:|---|---:|---:|---:|")
    for batch in (int(b) for b in args.batches.split(",")):
        exact, ms = probe(pk, frames, batch)
        print(f"| {batch} | {'yes' if exact else 'NO'} | {ms:.1f} | {pk.numel() / ms / 1e6:.1f} | "
              f"{4 * pk.numel() / ms / 1e6:.1f} |")
    gbps = pinned_h2d_gbps(pk.numel(), 3)
    print(f"anchor: pinned host-to-device copy of the pk stream, {pk.numel() / gbps / 1e6:.1f} ms ({gbps:.1f} GB/s)")


if __name__ == "__main__":
    main()
