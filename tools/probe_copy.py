"""How long the host spends *enqueueing* the device work of one staged transfer, alone and under load (CUDA only).

The loader's landing thread enqueues, per transfer, one host-to-device copy from a pinned slot and (for the last
piece of a tensor) one in-place Triton decode. This probe times each of those calls on the host (the time until the
call returns, not until the device is done), with the device idle, with copies queued behind each other, and while
reader threads fill other pinned buffers from the page cache, as they do during a load. A call that returns only
when its copy is done shows up as a call time close to the copy time.

    python3 tools/probe_copy.py [--mib 64] [--reps 10] [--threads 12] [--json probe.json]

With ``--load model.szt``, it then loads that file to the device a few times with the calls a decode and a copy
are made of wrapped in timers, and prints, per thread, where the host time of those calls goes inside a real load.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path

import torch

import szformat
from szformat.codec import cpu as cpu_codec
from szformat.codec import gpu as gpu_codec
from szformat.loading import ops as loading_ops


def _median_ms(values: list[float]) -> float:
    return 1e3 * statistics.median(values)


def copy_times(src: torch.Tensor, dst: torch.Tensor, stream: torch.cuda.Stream, reps: int, queued: int
               ) -> tuple[float, float]:
    """Median host time of one ``copy_(non_blocking=True)`` call and of the copy itself, ``queued`` copies at once."""
    calls, done = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        began = time.perf_counter()
        with torch.cuda.stream(stream):
            for _ in range(queued):
                t = time.perf_counter()
                dst.copy_(src, non_blocking=True)
                calls.append(time.perf_counter() - t)
        stream.synchronize()
        done.append((time.perf_counter() - began) / queued)
    return _median_ms(calls), _median_ms(done)


class BusyReaders:
    """``threads`` threads that read a page-cached file (written once, ``nbytes``) into pinned buffers over and
    over while a ``with`` block runs, as the loader's reader threads do during a load."""

    def __init__(self, threads: int, nbytes: int):
        self._file = tempfile.NamedTemporaryFile(dir=os.environ.get("TMPDIR", "/tmp"))
        self._file.write(os.urandom(1 << 20) * (nbytes >> 20))
        self._file.flush()
        self._buffers = [torch.empty(nbytes // threads, dtype=torch.uint8, pin_memory=True) for _ in range(threads)]
        self._stop = threading.Event()
        self._workers: list[threading.Thread] = []

    def _read(self, fd: int, buffer: torch.Tensor, offset: int) -> None:
        view = memoryview(buffer.numpy()).cast("B")
        while not self._stop.is_set():
            os.preadv(fd, [view], offset)

    def __enter__(self) -> "BusyReaders":
        self._stop.clear()
        fd = self._file.fileno()
        self._workers = [threading.Thread(target=self._read, args=(fd, buffer, i * buffer.numel()), daemon=True)
                         for i, buffer in enumerate(self._buffers)]
        for worker in self._workers:
            worker.start()
        time.sleep(0.05)
        return self

    def __exit__(self, *exc_info) -> None:
        self._stop.set()
        for worker in self._workers:
            worker.join()

    def close(self) -> None:
        self._file.close()


def decode_call_ms(nbytes: int, reps: int) -> tuple[float, float]:
    """Median host time of one ``decode_in_place`` call for a tensor of ``nbytes`` raw bytes, and of its decode."""
    n = nbytes // 2
    x = (torch.randn(n) * 0.02).to(torch.bfloat16)
    payload, layout, codebook = cpu_codec.encode(x)
    buffer = torch.empty(max(layout.raw_bytes, layout.comp_bytes), dtype=torch.uint8, device="cuda")
    scratch = gpu_codec.DecodeScratch()
    stream = torch.cuda.Stream()
    calls, done = [], []
    for _ in range(reps + 1):
        buffer[: layout.comp_bytes].copy_(payload.cuda())
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.cuda.stream(stream):
            gpu_codec.decode_in_place(buffer, layout, codebook, scratch=scratch)
        calls.append(time.perf_counter() - t)
        stream.synchronize()
        done.append(time.perf_counter() - t)
    if not torch.equal(buffer[: layout.raw_bytes].view(torch.bfloat16).cpu(), x):
        raise SystemExit("decode_in_place gave a wrong tensor")
    return _median_ms(calls[1:]), _median_ms(done[1:])


def launch_call_ms(nbytes: int, reps: int) -> tuple[float, float]:
    """Median host time of the two Triton launches alone (dense and escape passes, out of place), and until done."""
    from szformat.codec.gpu import _decode

    x = (torch.randn(nbytes // 2) * 0.02).to(torch.bfloat16)
    payload, layout, codebook = cpu_codec.encode(x)
    payload = payload.cuda()
    out = torch.empty(layout.n, dtype=torch.int16, device="cuda")
    calls, done = [], []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t = time.perf_counter()
        _decode._launch(payload, layout, codebook, out)
        calls.append(time.perf_counter() - t)
        torch.cuda.synchronize()
        done.append(time.perf_counter() - t)
    return _median_ms(calls[1:]), _median_ms(done[1:])


def event_call_us(reps: int) -> float:
    """Median host time of creating, recording and waiting (device side) on one blocking-sync event."""
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    times = []
    for _ in range(reps * 10):
        t = time.perf_counter()
        event = torch.cuda.Event(blocking=True)
        event.record(a)
        b.wait_event(event)
        times.append(time.perf_counter() - t)
    return 1e6 * statistics.median(times)


def timed_calls(path: Path, reps: int) -> list[dict]:
    """Load ``path`` ``reps`` times with the calls under test timed per thread; their host time per call."""
    from szformat.codec.gpu import _decode

    totals: dict[tuple[str, str], list[float]] = collections.defaultdict(list)

    def wrap(owner: object, name: str) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            began = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                totals[(threading.current_thread().name, name)].append(time.perf_counter() - began)

        setattr(owner, name, timed)

    wrap(_decode, "_launch")
    wrap(gpu_codec.DecodeScratch, "reserve")
    wrap(torch.Tensor, "record_stream")
    wrap(torch.Tensor, "copy_")
    wrap(gpu_codec, "decode_in_place")
    wrap(loading_ops.CudaOps, "record")
    wrap(loading_ops.CudaOps, "wait")
    wrap(loading_ops.CudaOps, "synchronize")
    szformat.load_file(path, device="cuda", verify=False)  # warm
    totals.clear()
    seconds = []
    for _ in range(reps):
        torch.cuda.synchronize()
        began = time.perf_counter()
        szformat.load_file(path, device="cuda", verify=False)
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - began)
    print(f"\nload_file({path.name}, verify=False) x {reps}: median {_median_ms(seconds):.1f} ms (timers on)\n")
    print("| thread | call | calls per load | ms per load | us per call (median) |\n|---|---|---:|---:|---:|")
    rows = []
    for (thread, name), times in sorted(totals.items(), key=lambda kv: -sum(kv[1])):
        row = {"thread": thread, "call": name, "calls": len(times) / reps, "ms": 1e3 * sum(times) / reps,
               "median_us": 1e6 * statistics.median(times)}
        rows.append(row)
        print(f"| {thread} | {name} | {row['calls']:.0f} | {row['ms']:.2f} | {row['median_us']:.1f} |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=12)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--load", type=Path, help="a .szt file to load with the calls timed")
    args = parser.parse_args()
    nbytes = args.mib << 20
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    src.random_(0, 256)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    stream = torch.cuda.Stream()
    copy_times(src, dst, stream, 2, 1)  # first-use costs
    rows = []

    def row(what: str, call: float, device: float) -> None:
        rows.append({"what": what, "call_ms": call, "done_ms": device})
        print(f"| {what} | {call:.3f} | {device:.3f} |", flush=True)

    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.mib} MiB pinned source\n")
    print("| enqueued | host call (ms) | until done (ms) |\n|---|---:|---:|")
    row("copy, device idle", *copy_times(src, dst, stream, args.reps, 1))
    row("copy, 4 queued back to back", *copy_times(src, dst, stream, args.reps, 4))
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    row("copy from pageable memory (for contrast)", *copy_times(pageable, dst, stream, args.reps, 1))
    readers = BusyReaders(args.threads, 1 << 30)
    with readers:
        row(f"copy, {args.threads} reader threads busy", *copy_times(src, dst, stream, args.reps, 1))
    with readers:
        row(f"copy, 4 queued, {args.threads} reader threads busy", *copy_times(src, dst, stream, args.reps, 4))
    row("decode_in_place, device idle", *decode_call_ms(nbytes, args.reps))
    row("Triton launches alone (dense + escape pass), device idle", *launch_call_ms(nbytes, args.reps))
    with readers:
        row(f"decode_in_place, {args.threads} reader threads busy", *decode_call_ms(nbytes, args.reps))
    readers.close()
    event_us = event_call_us(args.reps)
    rows.append({"what": "event create + record + wait", "call_us": event_us})
    print(f"| event create + record + stream wait | {event_us / 1e3:.3f} | |")
    in_load = timed_calls(args.load, 3) if args.load else []
    if args.json:
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                         "mib": args.mib, "rows": rows, "in_load": in_load}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
