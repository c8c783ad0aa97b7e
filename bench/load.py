"""Time loading checkpoints to a CUDA GPU: safetensors against every .szt path, with the PCIe ceiling, in one run.

    python -m bench.load --minilm .data/minilm-bf16.safetensors --work /tmp/szload \
        [--synthetic-gb 4.2] [--json results.json] [--markdown table.md] [--timeline timeline.json] \
        [--only REGEX] [--checkpoint REGEX] [--no-cold] [--at-rest]
    python -m bench.load --peers all --out $OUT [--media disk,tmpfs,cold] [--peer-gb 4.0] \
        [--reps 3] [--work /tmp/szload]

With ``--peers``, szformat's ``load_file(device="cuda")`` (verify off and on) runs against other projects' loaders
(``bench/common.py``: safetensors, InstantTensor with its default backend and ``BackendPolicy.BUFFERED``,
fastsafetensors ``nogds``, the Run:ai Model Streamer; one whose import fails is a row saying why) on one checkpoint
built here: seeded ``randn * 0.02`` BF16 tensors of 7B-class shapes, about ``--peer-gb`` GB, saved as safetensors and
converted on the GPU. Media: the page-cached file in ``--work``, copies on tmpfs (``/dev/shm``), and the file in
``--work`` cold (caches dropped before each call). Every loader's output is checked bit for bit against the tensors
the files were written from; each row's time is shown against the fastest bit-identical peer on its medium.

For each checkpoint (prepared by ``bench/checks/load_gpu.py``'s ``prepare``, which converts on the GPU): the anchor
``safetensors.torch.load_file(original, device="cuda")``, then ``szformat.load_file(szt, device="cuda")`` through
each path, then the pinned host-to-device copy ceiling (a pinned buffer of the raw checkpoint's size) and the copy
rate out of the registered page cache. Warm: page cache warm, one untimed call first (its time is the "first" column:
kernel loading and pinned allocation included), then the median of ``--reps`` calls; the device's caching allocator
is emptied between calls so every call allocates its tensors. Cold: the page cache is dropped before one call
(``/proc/sys/vm/drop_caches`` when writable, else ``posix_fadvise(DONTNEED)``), and the share of the file still
resident (``mincore``) is reported.

With ``--at-rest`` every checkpoint is also repacked into its at-rest form (.szt 1.1: zstd frames, inflated by the
reader threads into the staging slots) and timed as a checkpoint of its own, so both forms share one run.

Rates are raw-equivalent: the checkpoint's raw tensor bytes over wall time from the call to its tensors being ready.
Peak host RSS is the process's high-water mark during one extra call (reset through ``/proc/self/clear_refs``) minus
its RSS before; it counts page-cache pages mapped into the process, so a sampled anonymous-memory peak is shown too.
Peak GPU memory is the allocator's peak during that call minus what was allocated before (the tensors included).

With ``--timeline``, one more warm call of each path in ``TIMELINE`` on the largest checkpoint runs inside
``szformat.loading.timeline.recording()``: the summary (host waits, reader busy time and rate, copy-stream busy time
and rate, decode) is printed and every span is written to the JSON file, to show where a load's time goes.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import mmap
import os
import re
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file as st_save_file

import szformat
from szformat.checksum import crc32
from szformat.convert import convert
from szformat.loading import StagingConfig, hostio, timeline
from szformat.loading.hostio import RegisteredMapping
from szformat.loading.ops import CudaOps

from .checks.load_gpu import Checkpoint, at_rest_copy, llama_shapes, prepare  # noqa: E402
from .common import (  # noqa: E402  # noqa: E402
    PEERS,
    available_peers,
    median_copy_seconds,
    memory_status,  # noqa: E402
    pinned_h2d_gbps,
)

DEVICE = torch.device("cuda")

Loader = Callable[[Checkpoint], dict]


def staged(slot_mib: int, slots: int, *, verify: bool = False, threads: int | None = None) -> Loader:
    config = StagingConfig(slot_bytes=slot_mib << 20, slots=slots, threads=threads, transport="staged")
    return lambda c: szformat.load_file(c.szt, device="cuda", verify=verify, staging=config)


def spinning_waits(load: Loader) -> Loader:
    """``load`` with host waits that spin on the event instead of sleeping (CUDA's default)."""

    def run(c: Checkpoint) -> dict:
        CudaOps.blocking_sync = False
        try:
            return load(c)
        finally:
            CudaOps.blocking_sync = True

    return run


def read_pieces(mib: int, load: Loader) -> Loader:
    """``load`` with reads cut into pieces of at least ``mib`` MiB (fewer hand-offs between threads)."""

    def run(c: Checkpoint) -> dict:
        default = hostio.MIN_READ_PIECE
        hostio.MIN_READ_PIECE = mib << 20
        try:
            return load(c)
        finally:
            hostio.MIN_READ_PIECE = default

    return run


def polling_waits(load: Loader) -> Loader:
    """``load`` with host waits that poll ``event.query()`` between short sleeps, so that no thread sits inside
    ``cudaEventSynchronize`` while another enqueues work."""

    def poll(self, event) -> None:
        while not event.query():
            time.sleep(20e-6)

    def run(c: Checkpoint) -> dict:
        blocking = CudaOps.synchronize
        CudaOps.synchronize = poll
        try:
            return load(c)
        finally:
            CudaOps.synchronize = blocking

    return run


DEFAULTS = StagingConfig()
METHODS: dict[str, Loader] = {
    "safetensors load_file": lambda c: st_load_file(c.safetensors, device="cuda"),
    "szt load_file (defaults, verify on)": lambda c: szformat.load_file(c.szt, device="cuda"),
    "szt defaults, verify off": lambda c: szformat.load_file(c.szt, device="cuda", verify=False),
    "szt defaults, verify off, spinning waits": spinning_waits(
        lambda c: szformat.load_file(c.szt, device="cuda", verify=False)),
    "szt defaults, verify off, polling waits": polling_waits(
        lambda c: szformat.load_file(c.szt, device="cuda", verify=False)),
    "szt defaults, verify on, polling waits": polling_waits(lambda c: szformat.load_file(c.szt, device="cuda")),
    "szt staged 64 MiB x 4, verify off": staged(64, 4),
    "szt staged 64 MiB x 4, verify on": staged(64, 4, verify=True),
    "szt staged 64 MiB x 4, 16 threads, verify off": staged(64, 4, threads=16),
    "szt staged 64 MiB x 6, verify off": staged(64, 6),
    "szt staged 128 MiB x 4, verify off": staged(128, 4),
    "szt staged 128 MiB x 4, 8 threads, verify off": staged(128, 4, threads=8),
    "szt staged 128 MiB x 6, verify off": staged(128, 6),
    "szt staged 256 MiB x 3, verify off": staged(256, 3),
    "szt staged 128 MiB x 4, verify on": staged(128, 4, verify=True),
    "szt staged 64 MiB x 4, 8 threads, verify off": staged(64, 4, threads=8),
    "szt staged 64 MiB x 6, 8 threads, verify off": staged(64, 6, threads=8),
    "szt defaults, 16 MiB read pieces, verify off": read_pieces(
        16, lambda c: szformat.load_file(c.szt, device="cuda", verify=False)),
    "szt staged 32 MiB x 6, verify off": staged(32, 6),
    "szt staged 32 MiB x 6, verify on": staged(32, 6, verify=True),
    "szt staged 16 MiB x 8, verify off": staged(16, 8),
    "szt staged 8 MiB x 12, verify off": staged(8, 12),
    "szt staged 4 MiB x 24, verify off": staged(4, 24),
    "szt registered 4 slots, verify off": lambda c: szformat.load_file(
        c.szt, device="cuda", verify=False, staging=StagingConfig(transport="registered", slots=4)),
    "szt host-decode route": lambda c: szformat.load_file(c.szt, device="cuda", route="cpu", verify=False),
}
COLD = ["safetensors load_file", "szt load_file (defaults, verify on)", "szt defaults, verify off"]
SMALL_ONLY = ["szt host-decode route"]
"""Paths timed on checkpoints under 1 GB only (seconds per call on the synthetic one)."""
TIMELINE = ["szt defaults, verify off", "szt load_file (defaults, verify on)"]


# -- measuring --------------------------------------------------------------------------------------------------


def timed_call(work: Callable[[], object], *, empty_cache: bool = True) -> tuple[float, object]:
    """Seconds from the call of ``work`` until the device has finished its work, and what it returned."""
    gc.collect()
    if empty_cache:
        torch.cuda.empty_cache()
    torch.cuda.synchronize()
    started = time.perf_counter()
    result = work()
    torch.cuda.synchronize()
    return time.perf_counter() - started, result


def timed(load: Loader, ckpt: Checkpoint, *, empty_cache: bool = True) -> float:
    return timed_call(lambda: load(ckpt), empty_cache=empty_cache)[0]


def memory(load: Loader, ckpt: Checkpoint) -> dict[str, float]:
    """Peak host RSS (high-water mark), sampled peak anonymous+shared RSS, and peak GPU memory, over one call."""
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current RSS
        hwm_reset = True
    except OSError:
        hwm_reset = False
    before = memory_status()
    gpu_before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    peak_anon, running = [0], [True]

    def sample() -> None:
        while running[0]:
            s = memory_status()
            peak_anon[0] = max(peak_anon[0], s.get("RssAnon", 0) + s.get("RssShmem", 0))
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    result = load(ckpt)
    torch.cuda.synchronize()
    running[0] = False
    sampler.join()
    after = memory_status()
    gpu_peak = torch.cuda.max_memory_allocated() - gpu_before
    del result
    anon_before = before.get("RssAnon", 0) + before.get("RssShmem", 0)
    return {"rss_peak_gb": (after["VmHWM"] - before["VmRSS"]) / 1e9 if hwm_reset else float("nan"),
            "anon_peak_gb": (peak_anon[0] - anon_before) / 1e9, "gpu_peak_gb": gpu_peak / 1e9}


def _files(ckpt: Checkpoint) -> list[Path]:
    szt = sorted(ckpt.szt.glob("*.szt")) if ckpt.szt.is_dir() else [ckpt.szt]
    return szt + [ckpt.safetensors]


def drop_caches(paths: list[Path]) -> str:
    """Evict ``paths`` from the page cache; says how."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3")
        how = "drop_caches"
    except OSError:
        how = "fadvise"
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    return how


def resident_share(paths: list[Path]) -> float:
    """Share of the files' pages in the page cache (``mincore``), or NaN where it cannot be read."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    total = resident = 0
    try:
        for path in paths:
            size = path.stat().st_size
            with open(path, "rb") as f, mmap.mmap(f.fileno(), size, prot=mmap.PROT_READ) as mm:
                pages = -(-size // page)
                vec = (ctypes.c_ubyte * pages)()
                view = np.frombuffer(mm, dtype=np.uint8)
                status = libc.mincore(ctypes.c_void_p(view.ctypes.data), ctypes.c_size_t(size), vec)
                del view  # the mapping closes only once no view of it is left
                if status != 0:
                    return float("nan")
                resident += sum(b & 1 for b in bytes(vec))
                total += pages
    except (OSError, ValueError):
        return float("nan")
    return resident / total if total else float("nan")


def registered_ceiling(path: Path, reps: int) -> float:
    """GB/s of copying a whole file out of its page-cache mapping once registered (NaN where registration fails)."""
    from concurrent.futures import ThreadPoolExecutor

    mapping = RegisteredMapping.open(path, DEVICE)
    if mapping is None:
        return float("nan")
    try:
        with ThreadPoolExecutor(1) as pool:
            if not mapping.register_async(0, mapping.view.numel(), pool).result():
                return float("nan")
        dev = torch.empty(mapping.view.numel(), dtype=torch.uint8, device=DEVICE)
        seconds = median_copy_seconds(lambda: dev.copy_(mapping.view, non_blocking=True), reps)
        return mapping.view.numel() / seconds / 1e9
    finally:
        torch.cuda.synchronize()
        mapping.close()


def breakdown(ckpt: Checkpoint, reps: int) -> list[dict]:
    """Where a load's time goes: each step alone, over the whole checkpoint (``seconds`` per step)."""
    from concurrent.futures import ThreadPoolExecutor

    from szformat.codec import gpu
    from szformat.format.reader import SztFile
    from szformat.loading.hostio import FileReader, default_threads

    rows = []

    def row(what: str, seconds: float) -> None:
        rows.append({"checkpoint": ckpt.name, "method": f"step: {what}", "cache": "warm", "seconds": seconds})
        print(f"{ckpt.name:<26} step: {what:<44} {seconds * 1e3:9.2f} ms", flush=True)

    with SztFile(ckpt.szt) as f:
        entries = list(f.entries.values())
        size = f.file_length

        def allocate() -> None:
            return [torch.empty(max(e.raw_length, e.length), dtype=torch.uint8, device=DEVICE) for e in entries]

        row("allocate destinations (empty allocator)", statistics.median(
            _host_time(allocate, before=torch.cuda.empty_cache) for _ in range(reps)))
        row("allocate destinations (warm allocator)", statistics.median(_host_time(allocate) for _ in range(reps)))
        row("load_file defaults (verify off), warm allocator", statistics.median(
            timed(METHODS["szt defaults, verify off"], ckpt, empty_cache=False) for _ in range(reps)))

        threads = default_threads()
        with ThreadPoolExecutor(threads) as pool:
            reader = FileReader(ckpt.szt, pool, threads)
            for slot_mib, slots, check in ((64, 2, False), (64, 4, False), (16, 8, False), (8, 12, False),
                                           (16, 8, True)):
                slot = slot_mib << 20
                pinned = [torch.empty(slot, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
                then = (lambda start, piece: crc32(piece.numpy())) if check else None

                def read_all(slot: int = slot, slots: int = slots, pinned: list = pinned, then=then) -> None:
                    pending = []
                    for k, start in enumerate(range(0, size, slot)):
                        if len(pending) == slots:
                            pending.pop(0).result()
                        pending.append(reader.read_into(start, pinned[k % slots][: min(slot, size - start)],
                                                        then=then))
                    for staged in pending:
                        staged.result()

                what = " + CRC-32 of each piece" if check else ""
                row(f"host reads{what}, {slots} pinned {slot_mib} MiB slots, {threads} threads",
                    statistics.median(_host_time(read_all) for _ in range(reps)))
            reader.close()

            chunks = [f.payload(e.name)[a: a + (4 << 20)] for e in entries for a in range(0, e.length, 4 << 20)]
            row(f"CRC-32 of every payload in the page cache, 4 MiB pieces, {threads} threads", statistics.median(
                _host_time(lambda: list(pool.map(lambda t: crc32(t.numpy()), chunks))) for _ in range(reps)))
        one = torch.empty(64 << 20, dtype=torch.uint8, pin_memory=True).random_(0, 256)
        row("CRC-32 of 64 MiB, one thread (zlib-ng)",
            statistics.median(_host_time(lambda: crc32(one.numpy())) for _ in range(reps)))

        def register(span: int) -> None:
            mapping = RegisteredMapping.open(ckpt.szt, DEVICE)
            with ThreadPoolExecutor(1) as pool:
                for start in range(0, size, span):
                    mapping.register_async(start, min(size, start + span), pool).result()
                started = time.perf_counter()
                mapping.close()
            row(f"unregister + unmap, spans of {span >> 20} MiB", time.perf_counter() - started)

        for span in (64 << 20, 1 << 40):
            row(f"register + unregister + unmap, spans of {min(span, size) >> 20} MiB",
                _host_time(lambda: register(span)))

        payloads = [(f.payload(e.name).to(DEVICE), e) for e in entries if e.encoding == "splitzip"]
        slots = [torch.empty(max(e.raw_length, e.length), dtype=torch.uint8, device=DEVICE) for _, e in payloads]
        scratch = gpu.DecodeScratch()

        def decode_all() -> None:
            for (payload, e), slot in zip(payloads, slots):
                slot[: e.length].copy_(payload)
                gpu.decode_in_place(slot, e.layout, e.codebook, scratch=scratch)

        row("GPU decode_in_place of every tensor (incl. D2D slot fill)", median_copy_seconds(decode_all, reps))
    return rows


def _host_time(work: Callable[[], object], before: Callable[[], None] | None = None) -> float:
    if before is not None:
        before()
    torch.cuda.synchronize()
    started = time.perf_counter()
    result = work()
    torch.cuda.synchronize()
    seconds = time.perf_counter() - started
    del result
    return seconds


# -- the run ----------------------------------------------------------------------------------------------------


def bench(ckpt: Checkpoint, methods: dict[str, Loader], reps: int, cold: bool) -> list[dict]:
    rows = []
    anchor: dict[str, float] = {}
    for label, load in methods.items():
        if label in SMALL_ONLY and ckpt.raw_bytes > 1e9:
            continue
        first = timed(load, ckpt)
        times = [timed(load, ckpt) for _ in range(reps if first < 1.0 else 2)]
        seconds = statistics.median(times)
        mem = memory(load, ckpt)
        anchor.setdefault("warm", seconds)
        rows.append({"checkpoint": ckpt.name, "method": label, "cache": "warm", "seconds": seconds, "first": first,
                     "spread": (max(times) - min(times)) / seconds, **mem})
        print(f"{ckpt.name:<26} {label:<44} warm {seconds * 1e3:9.2f} ms  "
              f"{ckpt.raw_bytes / seconds / 1e9:6.1f} GB/s  x{anchor['warm'] / seconds:5.2f}", flush=True)
        torch.cuda.empty_cache()
    if cold and not ckpt.szt.is_dir():
        for label in (label for label in COLD if label in methods):
            how = drop_caches(_files(ckpt))
            resident = resident_share(_files(ckpt))
            seconds = timed(METHODS[label], ckpt)
            anchor.setdefault("cold", seconds)
            rows.append({"checkpoint": ckpt.name, "method": label, "cache": f"cold ({how}, {resident:.0%} resident)",
                         "seconds": seconds})
            print(f"{ckpt.name:<26} {label:<44} cold {seconds * 1e3:9.2f} ms  "
                  f"{ckpt.raw_bytes / seconds / 1e9:6.1f} GB/s  x{anchor['cold'] / seconds:5.2f} "
                  f"({how}, {resident:.0%} resident before)", flush=True)
    if not ckpt.szt.is_dir():
        rows += breakdown(ckpt, reps)
    rows.append({"checkpoint": ckpt.name, "method": "pinned H2D copy (ceiling)", "cache": "-",
                 "gbps": pinned_h2d_gbps(ckpt.raw_bytes, reps, DEVICE)})
    if not ckpt.szt.is_dir():
        rows.append({"checkpoint": ckpt.name, "method": "registered .szt H2D copy", "cache": "warm",
                     "gbps": registered_ceiling(ckpt.szt, reps)})
    for row in rows:
        row["raw_bytes"], row["stored_bytes"] = ckpt.raw_bytes, ckpt.stored_bytes
        if "seconds" in row:
            row["gbps"] = ckpt.raw_bytes / row["seconds"] / 1e9
            row["speedup"] = anchor["cold" if row["cache"].startswith("cold") else "warm"] / row["seconds"]
    return rows


def recorded(load: Callable[[], object]) -> tuple[dict[str, float], list[list]]:
    """One warm call of ``load`` (after an untimed one: pinned slots allocated, kernels loaded) inside
    ``timeline.recording()``: its wall time and the timeline's summary, and its spans (what, transfer, start and
    end in microseconds, lane, bytes)."""
    load()
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
    with timeline.recording() as record:
        started = time.perf_counter()
        result = load()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
    del result
    spans = [[s.what, s.k, round(s.start * 1e6), round(s.end * 1e6), s.lane, s.nbytes] for s in record.spans()]
    return {"call_ms": seconds * 1e3, **record.summary()}, spans


def print_summary(title: str, summary: dict[str, float]) -> None:
    print(f"timeline {title}:\n  " + "\n  ".join(f"{key:<22} {value:10.2f}" for key, value in summary.items()),
          flush=True)


def timelines(ckpt: Checkpoint, labels: list[str]) -> list[dict]:
    """One warm call of each path, recorded: its summary printed, its spans returned."""
    out = []
    for label in labels:
        summary, spans = recorded(lambda label=label: METHODS[label](ckpt))
        print_summary(f"{ckpt.name} / {label}", summary)
        out.append({"checkpoint": ckpt.name, "method": label, "summary": summary, "spans": spans})
    return out


# -- peers ------------------------------------------------------------------------------------------------------


MEDIA = ("disk", "tmpfs", "cold")
SZT_LOADERS: dict[str, Callable[[Path], dict]] = {
    "szformat load_file, verify off": lambda path: szformat.load_file(path, device="cuda", verify=False),
    "szformat load_file, verify on": lambda path: szformat.load_file(path, device="cuda"),
}
"""szformat's rows of the peer table, each against the fastest peer on the same medium."""
TMPFS = Path("/dev/shm")


def peer_checkpoint(work: Path, target_gb: float) -> tuple[dict[str, torch.Tensor], Path, Path]:
    """Seeded ``randn * 0.02`` BF16 tensors of 7B-class shapes (:func:`llama_shapes`), drawn on the GPU and kept
    there as the reference every loader is checked against; saved as ``peers.safetensors`` in ``work`` and converted
    on the GPU to ``peers.szt``."""
    gen = torch.Generator(DEVICE).manual_seed(0)
    reference = {name: (torch.randn(shape, generator=gen, device=DEVICE) * 0.02).to(torch.bfloat16)
                 for name, shape in llama_shapes(int(target_gb * 1e9)).items()}
    st, szt = work / "peers.safetensors", work / "peers.szt"
    st_save_file({name: tensor.cpu() for name, tensor in reference.items()}, st)
    convert(st, szt, device="cuda", overwrite=True)
    os.sync()  # written pages are clean, so that dropping the caches drops them
    return reference, st, szt


def mismatches(loaded: dict, reference: dict[str, torch.Tensor]) -> list[str]:
    """Names missing, extra, not on the reference's device, or differing from it in dtype, shape or any bit."""
    bad = sorted(set(loaded) ^ set(reference))
    for name, expected in reference.items():
        got = loaded.get(name)
        if got is None:
            continue
        if (got.device != expected.device or got.dtype != expected.dtype or got.shape != expected.shape
                or not torch.equal(got.reshape(-1).view(torch.uint8), expected.reshape(-1).view(torch.uint8))):
            bad.append(name)
    return bad


def filesystem(path: Path) -> str:
    """The type of the filesystem holding ``path`` (the longest mount point of ``/proc/mounts`` above it)."""
    path, best, kind = path.resolve(), -1, "?"
    try:
        with open("/proc/mounts") as f:
            for line in f:
                fields = line.split()
                mount = Path(fields[1])
                if (path == mount or mount in path.parents) and len(fields[1]) > best:
                    best, kind = len(fields[1]), fields[2]
    except OSError:
        pass
    return kind


def copy_to_tmpfs(paths: list[Path], folder: Path) -> list[Path] | str:
    """Copies of ``paths`` in ``folder`` (on tmpfs), or why not."""
    need = sum(p.stat().st_size for p in paths) + (1 << 30)
    if not folder.parent.is_dir():
        return f"no {folder.parent}"
    if filesystem(folder.parent) != "tmpfs":
        return f"{folder.parent} is {filesystem(folder.parent)}, not tmpfs"
    free = shutil.disk_usage(folder.parent).free
    if free < need:
        return f"{folder.parent} has {free / 1e9:.1f} GB free, {need / 1e9:.1f} GB needed"
    folder.mkdir(exist_ok=True)
    copies = [folder / p.name for p in paths]
    try:
        for source, copy in zip(paths, copies):
            shutil.copyfile(source, copy)
    except OSError as error:
        shutil.rmtree(folder, ignore_errors=True)
        return f"copying to {folder} failed: {error}"
    return copies


def bench_peers(reference: dict[str, torch.Tensor], st: Path, szt: Path, loaders: dict[str, Callable[[Path], dict]],
                media: list[str], reps: int, report: Callable[[list[dict]], None]) -> list[dict]:
    """Every loader on every medium: warm media (page-cached disk file, tmpfs) the median of ``reps`` calls after
    an untimed first one, cold one call after the caches are dropped; each loader's output checked bit for bit
    against ``reference`` (on its first call, or its cold one). ``report`` gets the rows so far after each row."""
    raw = sum(t.numel() * t.element_size() for t in reference.values())
    rows: list[dict] = []
    on_tmpfs: list[Path] | str | None = None
    try:
        for medium in media:
            files = [st, szt]
            if medium == "tmpfs":
                on_tmpfs = copy_to_tmpfs(files, TMPFS / "szload-peers")
                if isinstance(on_tmpfs, str):
                    rows.append({"medium": medium, "loader": "-", "status": f"skipped: {on_tmpfs}"})
                    report(rows)
                    continue
                files = on_tmpfs
            where = f"{medium} ({filesystem(files[0].parent)})"
            for name, load in loaders.items():
                path = files[1] if name in SZT_LOADERS else files[0]
                row = {"medium": medium, "where": where, "loader": name, "file": str(path), "raw_bytes": raw,
                       "file_bytes": path.stat().st_size}
                try:
                    if medium == "cold":
                        row["cache"] = drop_caches(files)
                        row["resident_before"] = resident_share(files)
                    seconds, result = timed_call(lambda: load(path))
                    bad = mismatches(result, reference)
                    del result
                    if medium == "cold":
                        row["seconds"] = seconds
                    else:
                        times = [timed_call(lambda: load(path))[0] for _ in range(reps)]
                        row.update(first=seconds, seconds=statistics.median(times),
                                   spread=(max(times) - min(times)) / statistics.median(times))
                    row.update(status="ok", identical=not bad, mismatches=bad[:5], gbps=raw / row["seconds"] / 1e9)
                except Exception as error:  # a peer that cannot run here is a row that says why
                    row["status"] = f"failed: {type(error).__name__}: {str(error)[:300]}"
                rows.append(row)
                compare_to_peers(rows)
                print(peer_line(row), flush=True)
                report(rows)
    finally:
        if isinstance(on_tmpfs, list):  # tmpfs holds memory until its files go
            for copy in on_tmpfs:
                copy.unlink(missing_ok=True)
            on_tmpfs[0].parent.rmdir()
    return rows


def compare_to_peers(rows: list[dict]) -> None:
    """``vs_fastest_peer`` of every timed row: the fastest bit-identical peer's time on its medium over the row's
    (above 1: faster than every peer); the peer it is measured against in ``fastest_peer``."""
    for medium in {r["medium"] for r in rows}:
        timed_rows = [r for r in rows if r["medium"] == medium and r.get("status") == "ok"]
        peers = [r for r in timed_rows if r["loader"] not in SZT_LOADERS and r["identical"]]
        if not peers:
            continue
        fastest = min(peers, key=lambda r: r["seconds"])
        for r in timed_rows:
            r["vs_fastest_peer"], r["fastest_peer"] = fastest["seconds"] / r["seconds"], fastest["loader"]


def peer_line(r: dict) -> str:
    if r.get("status") != "ok":
        return f"{r['medium']:<6} {r['loader']:<32} {r['status']}"
    return (f"{r['medium']:<6} {r['loader']:<32} {r['seconds'] * 1e3:9.1f} ms {r['gbps']:6.1f} GB/s  "
            f"bit-identical: {'yes' if r['identical'] else 'NO ' + ', '.join(r['mismatches'])}")


def peer_markdown(rows: list[dict], skipped: dict[str, str]) -> str:
    lines = ["| medium | loader | time (ms) | raw-equiv. GB/s | x fastest peer (its time / this) | first call (ms) | "
             "bit-identical | note |", "|---|---|---:|---:|---:|---:|---|---|"]
    for r in rows:
        if r.get("status") != "ok":
            lines.append(f"| {r['medium']} | {r['loader']} | | | | | | {r['status']} |")
            continue
        note = r.get("cache", "")
        if "resident_before" in r:
            note += f", {r['resident_before']:.0%} resident before"
        first = f"{r['first'] * 1e3:.0f}" if "first" in r else ""
        ratio = f"{r['vs_fastest_peer']:.2f}" if "vs_fastest_peer" in r else ""
        lines.append(f"| {r.get('where', r['medium'])} | {r['loader']} | {r['seconds'] * 1e3:.1f} | {r['gbps']:.1f} "
                     f"| {ratio} | {first} | {'yes' if r['identical'] else 'NO'} | {note} |")
    for name, why in skipped.items():
        lines.append(f"| all | {name} | | | | | | skipped: {why} |")
    summary = [f"- {r['medium']}: {r['loader']} **{r['vs_fastest_peer']:.2f}x** the fastest peer ({r['fastest_peer']})"
               for r in rows if r["loader"] in SZT_LOADERS and "vs_fastest_peer" in r]
    return "\n".join(lines + [""] + summary) + "\n"


def peer_versions() -> dict[str, str | None]:
    import importlib.metadata

    found = {}
    for name in ("torch", "safetensors", "instanttensor", "fastsafetensors", "runai-model-streamer"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def run_peers(args) -> None:
    """The peer comparison: one checkpoint built here, every available peer and szformat on every medium."""
    names = list(PEERS) if args.peers == "all" else args.peers.split(",")
    peers, skipped = available_peers(names)
    for name, why in skipped.items():
        print(f"skipped {name}: {why}", flush=True)
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    reference, st, szt = peer_checkpoint(args.work, args.peer_gb)
    facts = {"device": torch.cuda.get_device_name(), "cores": os.cpu_count(), "versions": peer_versions(),
             "tensors": len(reference), "raw_bytes": sum(t.numel() * 2 for t in reference.values()),
             "safetensors_bytes": st.stat().st_size, "szt_bytes": szt.stat().st_size,
             "work_filesystem": filesystem(args.work), "prepare_s": time.perf_counter() - started,
             "reps": args.reps, "skipped": skipped}
    print(json.dumps(facts), flush=True)

    def report(rows: list[dict]) -> None:
        if args.out:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / "peers.json").write_text(json.dumps({"facts": facts, "rows": rows}, indent=1))
            (args.out / "peers.md").write_text(peer_markdown(rows, skipped))

    rows = bench_peers(reference, st, szt, {**peers, **SZT_LOADERS}, args.media.split(","), args.reps, report)
    print("\n" + peer_markdown(rows, skipped))


def markdown(rows: list[dict]) -> str:
    lines = ["| checkpoint | method | cache | time (ms) | raw-equiv. GB/s | vs safetensors | first call (ms) | "
             "peak RSS (GB) | peak anon RSS (GB) | peak GPU (GB) |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    fmt = lambda row, key, scale=1.0, spec=".2f": (  # noqa: E731
        format(row[key] * scale, spec) if isinstance(row.get(key), float) else "")
    for r in rows:
        lines.append(f"| {r['checkpoint']} | {r['method']} | {r['cache']} | {fmt(r, 'seconds', 1e3, '.1f')} | "
                     f"{fmt(r, 'gbps', 1, '.1f')} | {fmt(r, 'speedup', 1, '.2f')} | {fmt(r, 'first', 1e3, '.0f')} | "
                     f"{fmt(r, 'rss_peak_gb')} | {fmt(r, 'anon_peak_gb')} | {fmt(r, 'gpu_peak_gb')} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--minilm", type=Path, help="MiniLM-L6 BF16 model.safetensors (needed without --peers)")
    parser.add_argument("--work", type=Path, default=Path("/tmp/szload"))
    parser.add_argument("--synthetic-gb", type=float, default=4.2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--no-cold", action="store_true", help="skip the cold-cache runs")
    parser.add_argument("--only", help="time only the paths whose label matches this regular expression "
                                           "(the safetensors anchor always runs)")
    parser.add_argument("--checkpoint", help="time only the checkpoints whose name matches this regular expression")
    parser.add_argument("--at-rest", action="store_true",
                        help="time each checkpoint in its at-rest form (.szt 1.1, zstd) too, in the same run: "
                             "'<name>, at rest' rows beside the in-memory ones")
    parser.add_argument("--json", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--timeline", type=Path, help="record the TIMELINE paths on the largest checkpoint; "
                                                      "spans go to this JSON file")
    parser.add_argument("--peers", type=peer_names, help="instead of the paths above: szformat against other "
                        f"loaders, 'all' or comma-separated of {', '.join(PEERS)}")
    parser.add_argument("--media", default=",".join(MEDIA), type=media_names,
                        help=f"with --peers: comma-separated of {', '.join(MEDIA)} (default: all)")
    parser.add_argument("--peer-gb", type=float, default=4.0, help="with --peers: checkpoint size (default 4.0)")
    parser.add_argument("--out", type=Path, help="with --peers: folder for peers.json and peers.md")
    args = parser.parse_args()
    if args.peers is None and args.minilm is None:
        parser.error("--minilm is needed (or --peers)")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {os.cpu_count()} cores, "
          f"defaults {DEFAULTS}", flush=True)
    if args.peers is not None:
        run_peers(args)
        return 0
    methods = {label: load for label, load in METHODS.items()
               if args.only is None or label == "safetensors load_file" or re.search(args.only, label)}
    checkpoints = prepare(args.minilm, args.work, args.synthetic_gb)
    if args.at_rest:
        checkpoints += [at_rest_copy(c) for c in checkpoints]
    checkpoints = [c for c in checkpoints if args.checkpoint is None or re.search(args.checkpoint, c.name)]
    if args.timeline:  # first, so that a run cut short still says where the time goes
        largest = max((c for c in checkpoints if not c.szt.is_dir()), key=lambda c: c.raw_bytes)
        args.timeline.write_text(json.dumps(timelines(largest, TIMELINE)))
    rows = []
    for ckpt in checkpoints:
        rows += bench(ckpt, methods, args.reps, cold=not args.no_cold)
    table = markdown(rows)
    print("\n" + table)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))
    if args.markdown:
        args.markdown.write_text(table + "\n")
    return 0


def peer_names(value: str) -> str:
    unknown = [] if value == "all" else [name for name in value.split(",") if name not in PEERS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown peers: {', '.join(unknown)} (known: {', '.join(PEERS)}, or all)")
    return value


def media_names(value: str) -> str:
    unknown = [name for name in value.split(",") if name not in MEDIA]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown media: {', '.join(unknown)} (known: {', '.join(MEDIA)})")
    return value


if __name__ == "__main__":
    sys.exit(main())
